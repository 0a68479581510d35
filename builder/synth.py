"""A full-size catalog made from a small real build, for measuring what a full image set costs.

``synthesise(images, into, variants)`` writes an image folder whose catalog holds about
``variants`` entries spread over the default targets: every shard of one real target of
``images`` is repeated on each target (each of its variants ``copies`` times, with new keys and
config indices far above the real ones, so they are never preferred), and kernels named
``<kernel>_synthN`` (copies of the real shards) fill the rest. Images are shared through
symbolic links; only the real target's own variants can be launched. The output is written
through :mod:`aotriton_rt.catalog` and passes every check a real catalog does.

Used by ``tests/runtime/test_catalog_scale.py`` and ``bench/host_cost.py``; needs no triton.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from aotriton_rt.catalog import CATALOG_FILE, SHARD_FILE, Catalog, ShardRef, Target, canonical_bytes, index_bytes

#: The default targets of ``python -m builder build`` (builder/targets.py), with their warp sizes.
DEFAULT_TARGETS = (("hip", "gfx90a", 64), ("hip", "gfx942", 64), ("hip", "gfx950", 64), ("hip", "gfx1100", 32),
                   ("hip", "gfx1201", 32), ("cuda", "sm80", 32), ("cuda", "sm90", 32))


def synthesise(images: Path, into: Path, variants: int, *, copies: int = 4,
               targets: tuple[tuple[str, str, int], ...] = DEFAULT_TARGETS) -> Path:
    """Write a catalog of about ``variants`` entries into ``into`` (see the module doc)."""
    images, into = Path(images), Path(into)
    base = Catalog.load(images)
    base.variants  # noqa: B018 - read and check every shard before copying any
    refs = [r for r in base._groups.values() if isinstance(r, ShardRef)]
    if not refs:
        raise ValueError(f"{images}: not a sharded catalog")
    real = min({(r.target.backend, r.target.arch) for r in refs}, key=lambda t: (t[0] != "cuda", t[1] != "sm90"))
    shards = {r.kernel: json.loads((images / r.path).read_bytes()) for r in refs
              if (r.target.backend, r.target.arch) == real}
    per_target = max(1, variants // len(targets))
    into.mkdir(parents=True, exist_ok=True)
    for entry in images.iterdir():
        if entry.name != CATALOG_FILE and not (into / entry.name).exists():
            (into / entry.name).symlink_to(entry.resolve())
    out_refs = []
    for backend, arch, warp in targets:
        target = Target(backend, arch, warp)
        count, n = 0, 0
        plan = [(k, k, copies) for k in sorted(shards)]
        while count < per_target:
            for kernel, name, times in plan:
                shard = _copy(shards[kernel], target, name, times, keep=(backend, arch) == real and name == kernel)
                count += len(shard["variants"])
                out_refs.append(_write(into, target, name, shard))
                if count >= per_target:
                    break
            n += 1
            plan = [(k, f"{k}_synth{n}", 1) for k in sorted(shards)]
    (into / CATALOG_FILE).unlink(missing_ok=True)
    (into / CATALOG_FILE).write_bytes(index_bytes(base.triton_version, base.tuning, out_refs))
    return into


def _copy(shard: dict, target: Target, name: str, times: int, keep: bool) -> dict:
    out = copy.deepcopy(shard)
    out["target"], out["kernel"] = target.to_json(), name
    entries = []
    for v in shard["variants"]:
        for j in range(times):
            e = copy.deepcopy(v)
            if not (keep and j == 0):
                e["key"] = hashlib.sha256(f"{v['key']}:{target.arch}:{name}:{j}".encode()).hexdigest()
                e["config"]["index"] += 1000 * (j + 1)
            if target.backend == "hip":
                e.pop("ptx", None)
                e["image"]["format"] = "hsaco"
                e["num_warps"] = min(e["num_warps"], 1024 // target.warp_size)
            entries.append(e)
    out["variants"] = entries
    return out


def _write(into: Path, target: Target, name: str, shard: dict) -> ShardRef:
    data = canonical_bytes(shard)
    path = f"synth/{target.backend}/{target.arch}/{name}/{SHARD_FILE}"
    dest = into.joinpath(*path.split("/"))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    return ShardRef(target, name, path, hashlib.sha256(data).hexdigest(), len(data), len(shard["variants"]))
