"""Unpacking a bundle, and its defences: every member checked before it is written.

One sequential pass over an uncompressed tar: the manifest first, then the catalog (checked
against the manifest), then each image, refused unless it is a regular file with a safe,
portable name, listed in the manifest, of the listed size and sha256. ``docs/security.md``
lists every check. The bundle carries its catalog inline; the folder gets it in the index form
with one shard per kernel and target (:meth:`Catalog.files`), so that opening it reads the
index alone.
"""

from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ..catalog import CATALOG_FILE, Catalog, parse_json
from ..errors import BundleError
from .format import (
    CHUNK,
    MANIFEST_FILE,
    MAX_BUNDLE_CATALOG_BYTES,
    MAX_JSON,
    check_member_name,
    parse_manifest,
)


class _HashingReader:
    """A read-only file wrapper that digests every byte it hands out."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.hasher = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.hasher.update(data)
        return data

    def drain(self) -> str:
        while self.read(CHUNK):
            pass
        return self.hasher.hexdigest()


def _member_kind(m: tarfile.TarInfo) -> str | None:
    """None for a regular file; otherwise what the member is, for the error message."""
    if m.sparse is not None or m.type == tarfile.GNUTYPE_SPARSE:
        return "a sparse file"
    if m.type in (tarfile.REGTYPE, tarfile.AREGTYPE):
        return None
    return {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link",
            tarfile.CHRTYPE: "a character device", tarfile.BLKTYPE: "a block device",
            tarfile.FIFOTYPE: "a FIFO", tarfile.CONTTYPE: "a contiguous file",
            tarfile.DIRTYPE: "a folder"}.get(m.type, f"of tar type {m.type!r}")


def _regular(m: tarfile.TarInfo, source: str) -> None:
    kind = _member_kind(m)
    if kind:
        raise BundleError(f"{source}: member {m.name!r} is {kind}; bundles hold regular files only")


@contextmanager
def open_tar(path: Path, source: str) -> Iterator[tuple[tarfile.TarFile, _HashingReader]]:
    # Stream mode ("r|"): one sequential pass, no seeking, no member table held up front.
    try:
        with open(path, "rb") as raw:
            reader = _HashingReader(raw)
            with tarfile.open(fileobj=reader, mode="r|", encoding="utf-8", errors="strict") as tar:
                yield tar, reader
    except UnicodeError as e:
        raise BundleError(f"{source}: a member name is not valid UTF-8") from e
    except (tarfile.TarError, ValueError, EOFError, OverflowError) as e:
        # ValueError and friends: malformed headers tarfile does not wrap (e.g. PAX 1.0 sparse maps).
        raise BundleError(f"{source}: not a readable bundle (an uncompressed tar): {e}") from e


def read_manifest(tar: tarfile.TarFile, source: str, cap: int) -> tuple[dict, bytes]:
    first = tar.next()
    if first is None or first.name != MANIFEST_FILE:
        found = repr(first.name) if first is not None else "an empty archive"
        raise BundleError(f"{source}: the first member must be {MANIFEST_FILE}, found {found}")
    _regular(first, source)
    if first.size > MAX_JSON:
        raise BundleError(f"{source}: {MANIFEST_FILE} is {first.size} bytes, over {MAX_JSON}")
    data = tar.extractfile(first).read()
    return parse_manifest(data, f"{source}:{MANIFEST_FILE}", cap), data


def _check_catalog(data: bytes, source: str, listed: dict[str, dict], manifest: dict | None = None) -> Catalog:
    catalog = Catalog.from_json(parse_json(data, source), source=source)
    if manifest is not None:
        # What the bundle says it is must be what it holds: `download --arch` chose it by these.
        have = {(v.target.backend, v.target.arch) for v in catalog.variants}
        said = {(manifest["backend"], t) for t in manifest["targets"]}
        if have != said:
            raise BundleError(f"{source}: {MANIFEST_FILE} says {manifest['backend']} "
                              f"{', '.join(sorted(manifest['targets']))} but the catalog holds "
                              f"{', '.join(sorted(f'{b} {a}' for b, a in have)) or 'no variants'}; refused")
    for v in catalog.variants:
        # The PTX too (kept for jax.jit): every file the catalog vouches for is one the
        # manifest lists with the same digest and size, so it is checked as it is unpacked.
        for image in (v.image, v.ptx):
            if image is None:
                continue
            entry = listed.get(image.path)
            if entry is None:
                raise BundleError(f"{source}: variant {v.kernel} {v.key[:16]} needs {image.path}, "
                                  "which the bundle does not hold")
            if entry["sha256"] != image.sha256 or entry["size"] != image.size:
                raise BundleError(f"{source}: the catalog and {MANIFEST_FILE} disagree on the digest "
                                  f"of {image.path}")
    return catalog


def unpack_bundle(bundle: Path, into: Path, source: str, cap: int) -> tuple[dict, bytes, str]:
    """Check and unpack ``bundle`` into the empty folder ``into``.

    Returns (manifest, manifest bytes, sha256 of the bundle as read). Every member is checked
    before it is written and every digest before this returns; ``into`` may hold a partial
    result when it raises, which the caller deletes.
    """
    with open_tar(bundle, source) as (tar, reader):
        manifest, manifest_bytes = read_manifest(tar, source, cap)
        listed = {f["path"]: f for f in manifest["files"]}
        written: set[str] = set()
        total = 0
        # tar.next(), not iteration: TarFile.__iter__ would yield the manifest a second time.
        while (member := tar.next()) is not None:
            name = check_member_name(member.name)
            if member.type == tarfile.DIRTYPE:
                continue  # folders are implied by the files; the name was still checked
            _regular(member, source)
            entry = listed.get(name)
            if entry is None:
                raise BundleError(f"{source}: member {name!r} is not listed in {MANIFEST_FILE}")
            if name in written:
                raise BundleError(f"{source}: member {name!r} appears twice")
            if member.size != entry["size"]:
                raise BundleError(f"{source}: member {name!r} is {member.size} bytes, "
                                  f"{MANIFEST_FILE} says {entry['size']}")
            total += member.size
            if total > cap:  # unreachable for a consistent manifest; kept as a second fence
                raise BundleError(f"{source}: unpacked size passes the limit of {cap} bytes")
            if not written and name != CATALOG_FILE:
                raise BundleError(f"{source}: {CATALOG_FILE} must follow {MANIFEST_FILE}, "
                                  f"found {name!r}")
            src = tar.extractfile(member)
            if name == CATALOG_FILE:
                if member.size > MAX_BUNDLE_CATALOG_BYTES:
                    raise BundleError(f"{source}: {CATALOG_FILE} is {member.size} bytes, over the "
                                      f"{MAX_BUNDLE_CATALOG_BYTES} a bundle's catalog may have "
                                      "(bundles.format.MAX_BUNDLE_CATALOG_BYTES)")
                data = src.read()
                _check_digest(hashlib.sha256(data).hexdigest(), entry, name, source)
                catalog = _check_catalog(data, f"{source}:{CATALOG_FILE}", listed, manifest)
                _write_sharded(catalog, into, listed, source)
            else:
                _copy(src, into.joinpath(*name.split("/")), entry, name, source)
            written.add(name)
        if missing := sorted(set(listed) - written):
            raise BundleError(f"{source}: {len(missing)} file(s) listed in {MANIFEST_FILE} are "
                              f"missing from the bundle, first {missing[0]!r}")
        return manifest, manifest_bytes, reader.drain()


def _write_sharded(catalog: Catalog, into: Path, listed: dict[str, dict], source: str) -> None:
    """Write ``catalog`` into ``into`` as the builder does: the index, one shard per kernel and
    target (each shard's sha256 in the index), through the catalog module's own writer."""
    files = catalog.files()
    for rel in sorted(set(files) - {CATALOG_FILE}):
        # A member at a shard's path would be refused below as a duplicate; say why up front.
        if rel in listed:
            raise BundleError(f"{source}: member {rel!r} is where the installer writes the catalog shard "
                              f"of {rel.rsplit('/', 2)[-2]}; refused")
        target = into.joinpath(*rel.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "xb") as f:  # as every member: never through an existing file or link
            f.write(files[rel])
    with open(into / CATALOG_FILE, "xb") as f:  # the index last, as Catalog.write does
        f.write(files[CATALOG_FILE])


def _check_digest(got: str, entry: dict, name: str, source: str) -> None:
    if got != entry["sha256"]:
        raise BundleError(f"{source}: member {name!r} has sha256 {got[:16]}..., {MANIFEST_FILE} "
                          f"says {entry['sha256'][:16]}...; nothing was installed")


def _copy(src: BinaryIO, target: Path, entry: dict, name: str, source: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    hasher = hashlib.sha256()
    # "xb": never follow or overwrite anything already there; the mode is the process default,
    # never the archive's, so no member can arrive executable.
    with open(target, "xb") as dst:
        while chunk := src.read(CHUNK):
            hasher.update(chunk)
            dst.write(chunk)
    _check_digest(hasher.hexdigest(), entry, name, source)
