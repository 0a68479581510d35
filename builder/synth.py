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


def synthesise(images: Path, into: Path, variants: int, *, kernels: int = 40,
               targets: tuple[tuple[str, str, int], ...] = DEFAULT_TARGETS) -> Path:
    """Write a catalog of about ``variants`` entries into ``into`` (see the module doc):
    ``kernels`` shards per target, each of about ``variants / len(targets) / kernels`` entries."""
    images, into = Path(images), Path(into)
    base = Catalog.load(images)
    refs = [r for r in base._groups.values() if isinstance(r, ShardRef)]
    base.variants  # noqa: B018 - read and check every shard before copying any
    if not refs:
        raise ValueError(f"{images}: not a sharded catalog")
    real = min({(r.target.backend, r.target.arch) for r in refs}, key=lambda t: (t[0] != "cuda", t[1] != "sm90", t))
    shards = {r.kernel: json.loads((images / r.path).read_bytes()) for r in refs
              if (r.target.backend, r.target.arch) == real}
    size = max(1, variants // len(targets) // max(kernels, len(shards)))
    names = sorted(shards)
    plan = [(k, k) for k in names]
    for i in range(max(kernels, len(names)) - len(names)):
        plan.append((names[i % len(names)], f"{names[i % len(names)]}_synth{i}"))
    into.mkdir(parents=True, exist_ok=True)
    for entry in images.iterdir():
        if entry.name != CATALOG_FILE and not (into / entry.name).exists():
            (into / entry.name).symlink_to(entry.resolve())
    out_refs = []
    for backend, arch, warp in targets:
        target = Target(backend, arch, warp)
        for kernel, name in plan:
            shard = _copy(shards[kernel], target, name, size, keep=(backend, arch) == real and name == kernel)
            out_refs.append(_write(into, target, name, shard))
    (into / CATALOG_FILE).unlink(missing_ok=True)
    (into / CATALOG_FILE).write_bytes(index_bytes(base.triton_version, base.tuning, out_refs))
    return into


def _copy(shard: dict, target: Target, name: str, size: int, keep: bool) -> dict:
    """``shard`` for ``target`` under ``name`` with its variants repeated to ``size`` entries (the
    real ones first, under their own keys when ``keep``)."""
    out = dict(shard, target=target.to_json(), kernel=name)
    base = shard["variants"]
    entries = []
    for i in range(max(size, len(base) if keep else 1)):
        v, j = base[i % len(base)], i // len(base)
        e = copy.deepcopy(v)
        if not (keep and j == 0):
            e["key"] = hashlib.sha256(f"{v['key']}:{target.arch}:{name}:{j}".encode()).hexdigest()
            e["config"]["index"] += 1000 * (j + 1)
        if target.backend == "hip":
            e.pop("ptx", None)
            e["image"]["format"] = "hsaco"
        entries.append(e)
    out["variants"] = entries
    out["launch_params"] = [dict(p, num_warps=min(p["num_warps"], 1024 // target.warp_size))
                            for p in shard["launch_params"]]
    return out


def _write(into: Path, target: Target, name: str, shard: dict) -> ShardRef:
    data = canonical_bytes(shard)
    path = f"synth/{target.backend}/{target.arch}/{name}/{SHARD_FILE}"
    dest = into.joinpath(*path.split("/"))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    return ShardRef(target, name, path, hashlib.sha256(data).hexdigest(), len(data), len(shard["variants"]))
