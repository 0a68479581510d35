"""Merging shard outputs (``build --shard K/N``) into one image folder and catalog."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from aotriton_rt.catalog import CATALOG_FILE, Catalog, Variant, check_image, write_atomic
from aotriton_rt.errors import ImageMismatch

from .build import BuildError, _remove_stale, catalog_files


def merge(inputs: Sequence[Path], out: Path) -> Catalog:
    """Union the catalogs of ``inputs`` and copy their images into ``out``.

    Shards of one build never disagree; a key present twice with different content, or
    catalogs from different Triton versions, are errors.
    """
    if not inputs:
        raise BuildError("merge needs at least one input folder")
    catalogs = [Catalog.load(Path(p) / CATALOG_FILE) for p in inputs]
    versions = {c.triton_version for c in catalogs}
    if len(versions) != 1:
        raise BuildError(f"cannot merge catalogs built with different Triton versions: {sorted(versions)}")
    variants: dict[str, tuple[Variant, Path]] = {}
    for src, cat in zip(inputs, catalogs):
        for v in cat.variants:
            if v.key in variants and variants[v.key][0] != v:
                raise BuildError(f"variant {v.key[:16]} ({v.kernel}) differs between "
                                 f"{variants[v.key][1]} and {src}")
            variants[v.key] = (v, Path(src))
    seen: dict[tuple, str] = {}
    for key, (v, _) in variants.items():
        ident = (v.kernel, v.target, repr(sorted(v.spec.items())), repr(v.config.to_json()))
        if ident in seen:
            raise BuildError(f"{v.kernel} for {v.target.arch} with {dict(sorted(v.spec.items()))} appears "
                             f"under two keys ({seen[ident][:16]} and {key[:16]}): were the shards built "
                             "from different sources? Rebuild them from one commit")
        seen[ident] = key
    out.mkdir(parents=True, exist_ok=True)
    for v, src in variants.values():
        for image in (v.image, v.ptx):
            if image is None:
                continue
            rel = image.path
            try:
                data = check_image(src, image, decompress=False)
            except ImageMismatch as e:
                raise BuildError(f"{src / rel}: sha256 does not match its catalog" if e.problem in ("size", "sha256")
                                 else str(e)) from None
            dest = out / rel
            if not (dest.exists() and dest.read_bytes() == data):
                dest.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(dest, data)
    tuning: dict[str, list] = {}
    for cat in catalogs:  # the shards' rules, each once (shards of one build repeat them)
        for name, rules in (cat.tuning or {}).items():
            have = tuning.setdefault(name, [])
            have.extend(r for r in rules if r not in have)
    merged = Catalog.new(versions.pop(), [v for v, _ in variants.values()], tuning, source=str(out / CATALOG_FILE))
    written = merged.write(out)  # the shards, then catalog.json last
    _remove_stale(out, catalog_files(merged) | written)
    return merged
