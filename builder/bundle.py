"""``python -m builder pack``: an image folder → one bundle per target (or family) + index.json.

A bundle is an uncompressed tar (the images inside are xz already) holding, in this order,
``bundle.json`` (what the bundle is and the size and sha256 of every other member),
``catalog.json`` (the folder's catalog restricted to the bundle's targets), then the images at
their catalog paths, sorted. Member metadata is fixed (mtime, owner, mode), so equal image
folders give byte-identical bundles and index. ``docs/noimage.md`` specifies the formats; the
runtime side is :mod:`aotriton_rt.bundles` (this module imports its format only).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import sys
import tarfile
from pathlib import Path
from typing import Any, BinaryIO

from aotriton_rt.bundles.format import (
    BUNDLE_SCHEMA,
    BUNDLE_SCHEMA_VERSION,
    INDEX_FILE,
    INDEX_SCHEMA,
    INDEX_SCHEMA_VERSION,
    MANIFEST_FILE,
    check_member_name,
)
from aotriton_rt.catalog import CATALOG_FILE, Catalog, Image, Target, Variant, write_atomic
from aotriton_rt.catalog import SCHEMA_VERSION as CATALOG_SCHEMA_VERSION
from aotriton_rt.errors import AotritonError, CatalogError, ImageError

GROUPINGS = ("target", "family")
# 2000-01-01 UTC: fixed so that bytes depend on content only, and plausible so that tar tools
# do not warn about timestamps at the epoch.
_MTIME = 946684800
_CHUNK = 1 << 20


def family(target: Target) -> str:
    """The family a target belongs to: ``gfx942`` → ``gfx9x``, ``gfx1100`` → ``gfx11x``,
    ``sm80`` → ``sm8x``, ``sm90`` → ``sm9x``."""
    # A gfx name ends in two hex digits of minor and stepping (gfx9|42, gfx11|00); an sm name
    # in one digit of minor version (sm8|6).
    if target.backend == "hip":
        prefix, pattern = "gfx", r"gfx(\d+)[0-9a-f]{2}"
    else:
        prefix, pattern = "sm", r"sm(\d+)\da?"
    m = re.fullmatch(pattern, target.arch)
    if not m:
        raise CatalogError(f"cannot tell the family of {target.backend} arch {target.arch!r}")
    return f"{prefix}{m.group(1)}x"


def bundle_name(target: Target, by: str = "target") -> str:
    """The name of the bundle holding ``target``'s variants: ``hip-gfx942`` or ``hip-gfx9x``."""
    if by not in GROUPINGS:
        raise ValueError(f"unknown grouping {by!r}; use one of {', '.join(GROUPINGS)}")
    return f"{target.backend}-{target.arch if by == 'target' else family(target)}"


def _dumps(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = size, _MTIME, 0o644, tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class _Digesting:
    """Hands tarfile the bytes of an image while hashing them: one read per image."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.hasher = raw, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.hasher.update(data)
        return data


def _images(variants: list[Variant], source: str) -> list[Image]:
    by_path: dict[str, Image] = {}
    # Each variant's image and, for CUDA, its PTX (aotriton_rt.jax's lowering reads it).
    for image in (i for v in variants for i in (v.image, v.ptx) if i is not None):
        seen = by_path.setdefault(image.path, image)
        if (seen.sha256, seen.size) != (image.sha256, image.size):
            raise CatalogError(f"{source}: two variants name {image.path} with different digests")
        check_member_name(image.path)  # never write a bundle the runtime would refuse
    return [by_path[p] for p in sorted(by_path)]


def _write_bundle(path: Path, manifest: bytes, catalog: bytes, folder: Path,
                  images: list[Image]) -> tuple[int, str]:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT,
                              encoding="utf-8") as tar:
                tar.addfile(_member(MANIFEST_FILE, len(manifest)), io.BytesIO(manifest))
                tar.addfile(_member(CATALOG_FILE, len(catalog)), io.BytesIO(catalog))
                for image in images:
                    _add_image(tar, folder, image)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    return path.stat().st_size, hasher.hexdigest()


def _add_image(tar: tarfile.TarFile, folder: Path, image: Image) -> None:
    src = folder.joinpath(*image.path.split("/"))
    try:
        size = src.stat().st_size
    except OSError as e:
        raise ImageError(f"cannot read image {src}: {e.strerror or e}; rebuild the image folder "
                         "(python -m builder build) before packing") from e
    if size != image.size:
        raise ImageError(f"image {src} is {size} bytes, the catalog says {image.size}; rebuild "
                         "the image folder before packing")
    with open(src, "rb") as f:
        reader = _Digesting(f)
        tar.addfile(_member(image.path, image.size), reader)
    if reader.hasher.hexdigest() != image.sha256:
        raise ImageError(f"image {src} does not match its sha256 in the catalog; rebuild the "
                         "image folder before packing")


def pack(images: str | os.PathLike, out: str | os.PathLike, *, by: str = "target") -> dict:
    """Write one bundle per target (``by="target"``) or family (``by="family"``) plus index.json.

    Args:
        images: an image folder (holding ``catalog.json``).
        out: the folder to write ``<name>.tar`` files and ``index.json`` into (created).
        by: ``"target"`` (``hip-gfx942.tar``) or ``"family"`` (``hip-gfx9x.tar``).

    Returns the index written. Raises CatalogError (bad or empty catalog), ImageError (an
    image missing or not matching its digest) or BundleError (a path the runtime would refuse).

    Example::

        pack("images", "dist/bundles", by="family")
    """
    if by not in GROUPINGS:
        raise ValueError(f"unknown grouping {by!r}; use one of {', '.join(GROUPINGS)}")
    folder, out = Path(images), Path(out)
    catalog = Catalog.load(folder)
    if not catalog.variants:
        raise CatalogError(f"{catalog.source}: no variants; nothing to pack")
    groups: dict[str, list[Variant]] = {}
    for v in catalog.variants:
        groups.setdefault(bundle_name(v.target, by), []).append(v)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for name in sorted(groups):
        variants = groups[name]
        # A bundle carries its catalog inline (one member the downloader checks before any image).
        sub = Catalog(catalog.triton_version, variants, catalog.tuning, source=catalog.source)
        catalog_bytes = sub.dumps().encode("utf-8")
        bundle_images = _images(variants, catalog.source)
        targets = sorted({v.target.arch for v in variants})
        backend = variants[0].target.backend
        manifest = {
            "schema": BUNDLE_SCHEMA, "schema_version": BUNDLE_SCHEMA_VERSION, "name": name,
            "backend": backend, "targets": targets, "triton_version": catalog.triton_version,
            "catalog_schema_version": CATALOG_SCHEMA_VERSION,
            "files": [{"path": CATALOG_FILE, "size": len(catalog_bytes),
                       "sha256": hashlib.sha256(catalog_bytes).hexdigest()}]
            + [{"path": i.path, "size": i.size, "sha256": i.sha256} for i in bundle_images],
        }
        file = f"{name}.tar"
        size, sha256 = _write_bundle(out / file, _dumps(manifest), catalog_bytes, folder,
                                     bundle_images)
        entries.append({"name": name, "file": file, "backend": backend, "targets": targets,
                        "size": size, "sha256": sha256, "variants": len(variants)})
    index = {"schema": INDEX_SCHEMA, "schema_version": INDEX_SCHEMA_VERSION,
             "bundle_schema_version": BUNDLE_SCHEMA_VERSION,
             "catalog_schema_version": CATALOG_SCHEMA_VERSION,
             "triton_version": catalog.triton_version, "grouping": by, "bundles": entries}
    write_atomic(out / INDEX_FILE, _dumps(index))
    return index


def add_cli(subparsers: Any) -> None:
    """Add the ``pack`` subcommand to ``python -m builder`` (sets ``func``)."""
    p = subparsers.add_parser(
        "pack", help="bundle an image folder per target (or family) plus index.json",
        description="Turn an image folder into reproducible bundles for `python -m aotriton_rt "
                    "download`: one per target (or family) and an index.json.")
    p.add_argument("--images", required=True, help="the image folder to pack")
    p.add_argument("--out", required=True, help="where to write the bundles and index.json")
    p.add_argument("--by", choices=GROUPINGS, default="target",
                   help="one bundle per target (default) or per family (gfx9x, sm8x, ...)")
    p.set_defaults(func=_cli_pack)


def _cli_pack(args: argparse.Namespace) -> int:
    try:
        index = pack(args.images, args.out, by=args.by)
    except AotritonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for b in index["bundles"]:
        print(f"{b['file']}: {b['variants']} variants for {', '.join(b['targets'])}, "
              f"{b['size'] / 1e6:.2f} MB, sha256 {b['sha256'][:16]}...")
    print(f"wrote {len(index['bundles'])} bundles and {INDEX_FILE} to {args.out}")
    return 0
