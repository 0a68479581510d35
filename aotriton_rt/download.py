"""NOIMAGE mode: fetch, verify and install image bundles.

A runtime package can ship without images; this module installs them per GPU target from a
published folder (``index.json`` plus one ``.tar`` bundle per target or family, made by
``python -m builder pack``) or from a local bundle file. ``docs/noimage.md`` specifies the
formats and the security model.

Installation is all-or-nothing. Under a per-bundle file lock: download into a staging folder
(resuming a partial download with an HTTP Range request), check the bundle's sha256 against the
index while it streams, unpack into a staging folder checking every member (name, type, size,
digest, a cap on the total), check the catalog against the unpacked images, and only then swap
the folder into place. Anything that fails leaves the previous install as it was. Nothing from a
bundle is ever executed: members are written as plain, non-executable files.

Example::

    from aotriton_rt.download import download, install_file, verify
    download("gfx942", url="https://example.org/aotriton-rt/0.1.0/")
    install_file("hip-gfx942.tar")            # air-gapped
    assert all(r.ok for r in verify())

The network part needs the optional extra ``pip install aotriton-rt[download]`` (requests,
platformdirs, filelock, tqdm); ``verify`` needs only the standard library.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import stat
import sys
import tarfile
import time
import unicodedata
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote, urlsplit

from . import __version__
from .catalog import CATALOG_FILE, Catalog, open_regular, parse_json
from .catalog import SCHEMA_VERSION as CATALOG_SCHEMA_VERSION
from .errors import (
    AotritonError,
    BundleError,
    CatalogError,
    DownloadError,
    ImageFolderNotFound,
)

BUNDLE_SCHEMA = "aotriton-rt.bundle"
BUNDLE_SCHEMA_VERSION = 1
INDEX_SCHEMA = "aotriton-rt.bundle-index"
INDEX_SCHEMA_VERSION = 1
INSTALL_SCHEMA = "aotriton-rt.install"
INSTALL_SCHEMA_VERSION = 1
INDEX_FILE = "index.json"
#: The first member of every bundle: what the bundle is and the digest of every other member.
MANIFEST_FILE = "bundle.json"
#: Written by the installer beside the unpacked files: which bundle (by sha256) is installed.
INSTALL_FILE = "install.json"
ENV_URL = "AOTRITON_RT_URL"
#: Where ``download`` looks when neither ``url`` nor ``$AOTRITON_RT_URL`` is given; a release
#: sets it to its published folder.
DEFAULT_URL: str | None = None
#: The largest total a bundle may unpack to (archive-bomb cap); a parameter overrides it.
DEFAULT_MAX_UNPACKED = 8 << 30

_MAX_JSON = 64 << 20
_MAX_CATALOG = 256 << 20  # the catalog is parsed in memory; real ones are a few MB
_CHUNK = 1 << 20
_MAX_BACKOFF = 30.0
#: Seconds a whole ``download`` call may take, however steadily a server trickles bytes.
DEFAULT_DEADLINE = 3600.0
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\.tar$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# 425/429/5xx are the statuses a server uses for "try again later"; other 4xx will not change.
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_WINDOWS_DEVICES = frozenset({"con", "prn", "aux", "nul", "conin$", "conout$",
                              *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))})
_NOT_PORTABLE = frozenset('<>:"|?*\\')


# --------------------------------------------------------------------------- formats


def check_member_name(name: str) -> str:
    """Return ``name`` if it is a safe, portable path for a bundle member; else raise.

    Safe means relative, '/'-separated, without ``..``/``.``/empty components, and valid as a
    file name on Windows too (bundles built on Linux are installed on Windows).

    Raises:
        BundleError: naming the member and why it is refused.
    """
    why = _unsafe(name)
    if why:
        raise BundleError(f"bundle member {name!r} refused: {why}")
    return name


def _unsafe(name: str) -> str | None:
    if not isinstance(name, str) or not name:
        return "empty name"
    if len(name) > 1024:
        return "name longer than 1024 characters"
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        return "absolute path"
    for part in name.split("/"):
        if part == "..":
            return "'..' would escape the install folder"
        if part in ("", "."):
            return "empty or '.' path component"
        bad = sorted(c for c in set(part) if c in _NOT_PORTABLE or ord(c) < 32)
        if bad:
            return f"character {bad[0]!r} is not allowed in file names on every OS"
        if part[-1] in " .":
            return "a component ends with a dot or space, which Windows drops"
        if part.split(".", 1)[0].lower() in _WINDOWS_DEVICES:
            return f"{part!r} is a reserved device name on Windows"
        if len(part.encode("utf-8")) > 255:
            return "a path component is longer than 255 bytes"
    return None


def _load_json(data: bytes, source: str, error: type[AotritonError]) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{source}: not valid JSON ({e})") from None
    except RecursionError:
        raise error(f"{source}: JSON nested too deeply") from None


def _check_schema(obj: Any, schema: str, version: int, what: str, source: str,
                  error: type[AotritonError] = BundleError) -> None:
    if not isinstance(obj, dict) or obj.get("schema") != schema:
        found = obj.get("schema") if isinstance(obj, dict) else type(obj).__name__
        raise error(f"{source}: not an aotriton-rt {what}: schema is {found!r}, expected {schema!r}")
    v = obj.get("schema_version")
    if type(v) is not int:
        raise error(f"{source}: {what} schema_version must be an integer, found {v!r}")
    if v > version:
        raise error(f"{source}: {what} schema_version {v} is newer than this aotriton-rt "
                    f"{__version__} understands (it reads {version}); upgrade it: "
                    "pip install -U aotriton-rt")
    if v < version:
        raise error(f"{source}: {what} schema_version {v} is older than this aotriton-rt "
                    f"{__version__} reads ({version}); download bundles made for this version, "
                    "or install the aotriton-rt release that made them")


def _check_catalog_version(v: Any, source: str) -> None:
    if v != CATALOG_SCHEMA_VERSION:
        newer = isinstance(v, int) and v > CATALOG_SCHEMA_VERSION
        raise CatalogError(
            f"{source}: its catalogs are schema_version {v!r}, this aotriton-rt {__version__} "
            f"reads version {CATALOG_SCHEMA_VERSION}; "
            + ("upgrade it: pip install -U aotriton-rt" if newer else
               "point --url at images built for this version, or rebuild and pack them"))


def _int(obj: dict, key: str, source: str, where: str) -> int:
    v = obj.get(key)
    if type(v) is not int or v < 0:
        raise BundleError(f"{source}: {where}.{key} must be an integer >= 0, found {v!r}")
    return v


def _sha(obj: dict, key: str, source: str, where: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not _HEX64.match(v):
        raise BundleError(f"{source}: {where}.{key} must be 64 lowercase hex digits, found {v!r}")
    return v


def _targets(obj: dict, source: str, where: str) -> list[str]:
    v = obj.get("targets")
    if not isinstance(v, list) or not v or not all(isinstance(t, str) and t for t in v):
        raise BundleError(f"{source}: {where}.targets must be a non-empty list of arch names, "
                          f"found {v!r}")
    if obj.get("backend") not in ("cuda", "hip"):
        raise BundleError(f"{source}: {where}.backend must be cuda or hip, "
                          f"found {obj.get('backend')!r}")
    return v


def parse_index(data: bytes, source: str) -> dict:
    """Parse and validate a bundle index (``index.json``) written by ``python -m builder pack``.

    Returns the index as a dict. Raises BundleError for a malformed index or an unknown index or
    bundle schema, and CatalogError when its bundles hold catalogs this runtime cannot read.
    """
    obj = _load_json(data, source, BundleError)
    _check_schema(obj, INDEX_SCHEMA, INDEX_SCHEMA_VERSION, "bundle index", source)
    v = obj.get("bundle_schema_version")
    if v != BUNDLE_SCHEMA_VERSION:
        raise BundleError(f"{source}: it lists bundles of format {v!r}, this aotriton-rt "
                          f"{__version__} reads format {BUNDLE_SCHEMA_VERSION}; "
                          + ("upgrade it: pip install -U aotriton-rt"
                             if isinstance(v, int) and v > BUNDLE_SCHEMA_VERSION
                             else "point --url at bundles made for this version"))
    _check_catalog_version(obj.get("catalog_schema_version"), source)
    bundles = obj.get("bundles")
    if not isinstance(bundles, list):
        raise BundleError(f"{source}: $.bundles must be a list")
    names: set[str] = set()
    for i, b in enumerate(bundles):
        where = f"$.bundles[{i}]"
        if not isinstance(b, dict):
            raise BundleError(f"{source}: {where} must be an object")
        name, file = b.get("name"), b.get("file")
        if not isinstance(name, str) or not _NAME.match(name) or name in names:
            raise BundleError(f"{source}: {where}.name must be a unique lowercase name, found {name!r}")
        # The file name is joined to the base URL: it must not be able to point anywhere else.
        if not isinstance(file, str) or not _FILE.match(file):
            raise BundleError(f"{source}: {where}.file must be a plain file name ending in .tar, "
                              f"found {file!r}")
        names.add(name)
        _targets(b, source, where)
        _int(b, "size", source, where)
        _sha(b, "sha256", source, where)
    return obj


def _parse_manifest(data: bytes, source: str, cap: int) -> dict:
    obj = _load_json(data, source, BundleError)
    _check_schema(obj, BUNDLE_SCHEMA, BUNDLE_SCHEMA_VERSION, "bundle", source)
    name = obj.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise BundleError(f"{source}: bundle name {name!r} is not a lowercase name of letters, "
                          "digits, '-' and '_'")
    _targets(obj, source, "$")
    _check_catalog_version(obj.get("catalog_schema_version"), source)
    files = obj.get("files")
    if not isinstance(files, list) or not files:
        raise BundleError(f"{source}: $.files must be a non-empty list")
    seen: set[str] = set()
    folded: set[str] = set()
    total = 0
    for i, f in enumerate(files):
        where = f"$.files[{i}]"
        if not isinstance(f, dict):
            raise BundleError(f"{source}: {where} must be an object")
        path = check_member_name(f.get("path"))
        if path in (MANIFEST_FILE, INSTALL_FILE):
            raise BundleError(f"{source}: {where}.path {path!r} is reserved for the installer")
        # Windows and macOS file systems fold case, and macOS Unicode normalization (NFC/NFD):
        # two such names would overwrite each other there.
        key = unicodedata.normalize("NFC", path).casefold()
        if key in folded:
            raise BundleError(f"{source}: {where}.path {path!r} repeats another path (ignoring case and "
                              "Unicode normalization)")
        folded.add(key)
        seen.add(path)
        total += _int(f, "size", source, where)
        _sha(f, "sha256", source, where)
    folders = {p.rsplit("/", 1)[0] for p in seen if "/" in p}
    folders |= {f.rsplit("/", i)[0] for f in folders for i in range(1, f.count("/") + 1)}
    if clash := sorted(seen & folders):
        raise BundleError(f"{source}: {clash[0]!r} is listed both as a file and as a folder")
    if CATALOG_FILE not in seen:
        raise BundleError(f"{source}: $.files does not list {CATALOG_FILE}")
    if total > cap:
        raise BundleError(f"{source}: bundle {name} unpacks to {total} bytes, over the limit of "
                          f"{cap}; refused (raise max_unpacked_bytes if it is genuine)")
    return obj


# --------------------------------------------------------------------------- unpacking


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
        while self.read(_CHUNK):
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
def _open_tar(path: Path, source: str) -> Iterator[tuple[tarfile.TarFile, _HashingReader]]:
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


def _read_manifest(tar: tarfile.TarFile, source: str, cap: int) -> tuple[dict, bytes]:
    first = tar.next()
    if first is None or first.name != MANIFEST_FILE:
        found = repr(first.name) if first is not None else "an empty archive"
        raise BundleError(f"{source}: the first member must be {MANIFEST_FILE}, found {found}")
    _regular(first, source)
    if first.size > _MAX_JSON:
        raise BundleError(f"{source}: {MANIFEST_FILE} is {first.size} bytes, over {_MAX_JSON}")
    data = tar.extractfile(first).read()
    return _parse_manifest(data, f"{source}:{MANIFEST_FILE}", cap), data


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
        entry = listed.get(v.image.path)
        if entry is None:
            raise BundleError(f"{source}: variant {v.kernel} {v.key[:16]} needs {v.image.path}, "
                              "which the bundle does not hold")
        if entry["sha256"] != v.image.sha256 or entry["size"] != v.image.size:
            raise BundleError(f"{source}: the catalog and {MANIFEST_FILE} disagree on the digest "
                              f"of {v.image.path}")
    return catalog


def _unpack(bundle: Path, into: Path, source: str, cap: int) -> tuple[dict, bytes, str]:
    """Check and unpack ``bundle`` into the empty folder ``into``.

    Returns (manifest, manifest bytes, sha256 of the bundle as read). Every member is checked
    before it is written and every digest before this returns; ``into`` may hold a partial
    result when it raises, which the caller deletes.
    """
    with _open_tar(bundle, source) as (tar, reader):
        manifest, manifest_bytes = _read_manifest(tar, source, cap)
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
                if member.size > _MAX_CATALOG:
                    raise BundleError(f"{source}: {CATALOG_FILE} is {member.size} bytes, over "
                                      f"{_MAX_CATALOG}")
                data = src.read()
                _check_digest(hashlib.sha256(data).hexdigest(), entry, name, source)
                _check_catalog(data, f"{source}:{CATALOG_FILE}", listed, manifest)
                (into / CATALOG_FILE).write_bytes(data)
            else:
                _copy(src, into.joinpath(*name.split("/")), entry, name, source)
            written.add(name)
        if missing := sorted(set(listed) - written):
            raise BundleError(f"{source}: {len(missing)} file(s) listed in {MANIFEST_FILE} are "
                              f"missing from the bundle, first {missing[0]!r}")
        return manifest, manifest_bytes, reader.drain()


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
        while chunk := src.read(_CHUNK):
            hasher.update(chunk)
            dst.write(chunk)
    _check_digest(hasher.hexdigest(), entry, name, source)


# --------------------------------------------------------------------------- installing


@dataclass(frozen=True)
class InstalledBundle:
    """One bundle in place: its image folder ``path`` and what the call did.

    ``action`` is ``"installed"`` or ``"already installed"`` (the same sha256 was there).
    """

    name: str
    path: Path
    sha256: str
    targets: tuple[str, ...]
    action: str


def _need(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise DownloadError(f"installing images needs the optional package {module!r}: "
                            "pip install 'aotriton-rt[download]'") from e


def _long_path(p: Path) -> Path:
    # Windows refuses paths over 260 characters unless they carry the \\?\ prefix (which
    # also turns off '/' translation, so the path must be absolute and normalised first).
    p = Path(os.path.abspath(p))
    if os.name != "nt" or str(p).startswith("\\\\?\\"):
        return p
    s = str(p)
    return Path("\\\\?\\UNC\\" + s[2:] if s.startswith("\\\\") else "\\\\?\\" + s)


def images_root(dest: str | os.PathLike | None = None) -> Path:
    """The folder holding one installed image folder per bundle.

    ``dest`` when given, else :func:`aotriton_rt.images.cache_root` (``$AOTRITON_RT_CACHE`` or
    the per-user cache), which is where the runtime looks for downloaded images.
    """
    if dest is None:
        from .images import cache_root
        dest = cache_root()
    return _long_path(Path(dest))


@contextmanager
def _bundle_lock(root: Path, name: str, timeout: float) -> Iterator[Path]:
    """Hold the installer lock of bundle ``name``; yields its (absent or stale) staging folder."""
    filelock = _need("filelock")
    path = root / f".{name}.lock"
    lock = filelock.FileLock(str(path), timeout=timeout)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except filelock.Timeout as e:
        raise DownloadError(f"another installer of {name} has held {path} for over {timeout:g} s; "
                            "wait for it to finish (the lock is released when it exits)") from e
    except OSError as e:  # the root is a file, read-only, or its path is too long
        raise DownloadError(f"cannot install into {str(root)[:300]}: {e.strerror or e}; pass a writable "
                            "folder with --dest (or set $AOTRITON_RT_CACHE)") from None
    try:
        # Dot-named and without catalog.json at its top: never mistaken for an image folder.
        staging = root / f".{name}.staging"
        _recover(root / name, staging)
        yield staging
    finally:
        lock.release()


def _recover(final: Path, staging: Path) -> None:
    """Finish what a killed installer left half-done, under the lock, before anything else.

    The swap renames the install aside into ``staging/old-*`` and then the new folder into
    place; killed between the two, the install is missing and its copy is in staging: put it
    back (the previous, verified install) rather than let the staging reset delete it.
    """
    if os.path.lexists(final) or not _is_real_dir(staging):
        return
    olds = sorted((p for p in staging.iterdir() if p.name.startswith("old-") and _is_real_dir(p)
                   and (p / INSTALL_FILE).is_file()), key=lambda p: p.stat().st_mtime, reverse=True)
    if olds:
        os.replace(olds[0], final)


def _is_real_dir(p: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(p).st_mode)
    except OSError:
        return False


def _reset_staging(staging: Path, keep: str | None = None) -> None:
    """Empty the staging folder under the lock: whatever is there was left by a dead installer.

    A staging path that is not a real folder (a planted symlink, a file) is removed itself,
    never followed: the installer deletes only what it created.
    """
    if os.path.lexists(staging) and not _is_real_dir(staging):
        staging.unlink()
    if _is_real_dir(staging):
        for p in staging.iterdir():
            if p.name != keep:
                _remove(p)
    staging.mkdir(exist_ok=True)


def _remove(p: Path) -> None:
    if _is_real_dir(p):
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _intact(folder: Path, sha256: str) -> bool:
    """Whether bundle ``sha256`` is installed in ``folder`` and still passes :func:`verify_folder`
    (else the caller reinstalls it: a corrupted install is repaired, never reported as done)."""
    return _installed_sha(folder) == sha256 and verify_folder(folder).ok


def _bundle_cap(cap: int) -> int:
    """The largest bundle file that can unpack to at most ``cap`` bytes (tar headers and padding)."""
    return cap + cap // 8 + (16 << 20)


def _installed_sha(folder: Path) -> str | None:
    record = _load_record(folder)
    if record is None:
        return None
    if not isinstance(record, dict) or record.get("schema") != INSTALL_SCHEMA:
        return None
    return record.get("sha256") if (folder / CATALOG_FILE).is_file() else None


def _swap(new: Path, final: Path, staging: Path) -> None:
    # os.replace cannot put a folder over a non-empty one (on Windows, over any folder), so
    # the old install is renamed aside first and restored if the second rename fails.
    old = None
    if os.path.lexists(final):
        old = staging / f"old-{uuid.uuid4().hex[:12]}"
        os.replace(final, old)
    try:
        os.replace(new, final)
    except OSError:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None:
        _remove(old)


def _install(bundle: Path, root: Path, staging: Path, *, expect_name: str, sha256: str,
             source: str, cap: int) -> InstalledBundle:
    # Not mkdtemp: its 0700 would make the install unreadable to the other users of a shared
    # images folder. The mode comes from the umask, as for every folder and file below it.
    unpack = staging / f"unpack-{uuid.uuid4().hex[:12]}"
    try:
        unpack.mkdir()
        manifest, manifest_bytes, got = _unpack(bundle, unpack, source, cap)
        if manifest["name"] != expect_name:
            raise BundleError(f"{source}: the bundle calls itself {manifest['name']!r}, "
                              f"expected {expect_name!r}")
        if got != sha256:
            raise BundleError(f"{source}: changed while being installed (sha256 {got[:16]}..., "
                              f"expected {sha256[:16]}...); nothing was installed")
        (unpack / MANIFEST_FILE).write_bytes(manifest_bytes)
        record = {"schema": INSTALL_SCHEMA, "schema_version": INSTALL_SCHEMA_VERSION,
                  "name": expect_name, "sha256": sha256,
                  "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(), "source": source}
        (unpack / INSTALL_FILE).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
        final = root / expect_name
        _swap(unpack, final, staging)
    except OSError as e:
        raise DownloadError(f"installing {expect_name} into {root} failed: {e}; the previous "
                            "install, if any, is unchanged") from e
    finally:
        _remove(unpack)
    return InstalledBundle(expect_name, final, sha256, tuple(manifest["targets"]), "installed")


def _read_small(path: Path, limit: int) -> bytes:
    with open_regular(path) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise BundleError(f"{path} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BundleError(f"{path} is over {limit} bytes")
    return data


def _sha256_file(path: Path) -> str:
    hasher = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def install_file(bundle: str | os.PathLike, *, dest: str | os.PathLike | None = None,
                 sha256: str | None = None, max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED,
                 lock_timeout: float = 600.0, force: bool = False) -> InstalledBundle:
    """Install a local bundle file (air-gapped installs), with every check of :func:`download`.

    Args:
        bundle: a ``.tar`` made by ``python -m builder pack``.
        dest: the images root (default :func:`images_root`).
        sha256: when given, the digest the file must have (e.g. from ``index.json``).
        max_unpacked_bytes: refuse bundles that unpack to more than this.
        lock_timeout: seconds to wait for another installer of the same bundle.
        force: install even when the same bundle is installed and intact.

    Returns the :class:`InstalledBundle`; a bundle whose sha256 is already installed and passes
    :func:`verify_folder` is left as it is (one that fails it is reinstalled). Raises BundleError
    (hostile or malformed bundle), CatalogError (catalog schema not understood), DownloadError
    (lock, file system).
    """
    source = str(bundle)
    path = _long_path(Path(bundle))
    if not path.is_file():
        raise BundleError(f"{source}: no such bundle file")
    with _open_tar(path, source) as (tar, _):
        name = _read_manifest(tar, source, max_unpacked_bytes)[0]["name"]
    digest = _sha256_file(path)
    if sha256 is not None and digest != sha256.lower():
        raise BundleError(f"{source}: sha256 is {digest}, expected {sha256.lower()}; the file is "
                          "corrupt or not the bundle you meant")
    root = images_root(dest)
    with _bundle_lock(root, name, lock_timeout) as staging:
        if not force and _intact(root / name, digest):
            _remove(staging)  # whatever a killed installer left there is of no use now
            return InstalledBundle(name, root / name, digest, _installed_targets(root / name),
                                   "already installed")
        _reset_staging(staging)
        try:
            return _install(path, root, staging, expect_name=name, sha256=digest, source=source,
                            cap=max_unpacked_bytes)
        finally:
            _remove(staging)


def _installed_targets(folder: Path) -> tuple[str, ...]:
    try:
        targets = json.loads((folder / MANIFEST_FILE).read_bytes()).get("targets", [])
    except (OSError, ValueError, AttributeError, RecursionError):
        return ()
    return tuple(t for t in targets if isinstance(t, str)) if isinstance(targets, list) else ()


# --------------------------------------------------------------------------- network


@dataclass(frozen=True)
class _Net:
    timeout: float
    retries: int
    backoff: float
    allow_http: bool
    progress: bool
    #: time.monotonic() after which the whole download gives up, however steadily bytes trickle.
    deadline: float = float("inf")
    seconds: float = 0.0  # the deadline as the user gave it, for messages

    def check_deadline(self, url: str) -> None:
        if time.monotonic() > self.deadline:
            raise DownloadError(f"{url}: not finished within the deadline of {self.seconds:g} s; the server "
                                "is too slow. Try again later, or raise --deadline")


class _Transient(Exception):
    """A failure worth retrying: connection trouble, a timeout, 5xx, a short body."""


def _check_scheme(url: str, allow_http: bool) -> None:
    scheme = urlsplit(url).scheme.lower()
    if scheme == "https" or (scheme == "http" and allow_http):
        return
    if scheme == "http":
        raise DownloadError(f"refusing plain HTTP for {url}: the index that vouches for every "
                            "digest would travel unauthenticated; use https://, or pass "
                            "--allow-http (allow_http=True) on a network you trust")
    raise DownloadError(f"unsupported URL {url!r}: use https:// (http:// with --allow-http); "
                        "for a bundle file on disk use --from-file")


def _resolve_url(url: str | None, allow_http: bool) -> tuple[str, str]:
    """(base URL ending in '/', index URL) from a folder URL or a URL of index.json itself."""
    url = url or os.environ.get(ENV_URL) or DEFAULT_URL
    if not url:
        raise DownloadError(f"no download URL: pass --url BASE (the folder holding {INDEX_FILE}) "
                            f"or set {ENV_URL}; for a bundle file on disk use --from-file")
    _check_scheme(url, allow_http)
    if urlsplit(url).path.endswith(".json"):
        return url.rsplit("/", 1)[0] + "/", url
    base = url.rstrip("/") + "/"
    return base, base + INDEX_FILE


def _session() -> Any:
    requests = _need("requests")
    session = requests.Session()
    session.headers["User-Agent"] = f"aotriton-rt/{__version__}"
    # Byte ranges and the digest must refer to the stored bytes, never a re-encoded stream.
    session.headers["Accept-Encoding"] = "identity"
    return session


@contextmanager
def _get(session: Any, url: str, net: _Net, headers: dict[str, str]) -> Iterator[Any]:
    """A streaming GET whose connection failures, also those while reading, become _Transient."""
    requests, urllib3 = sys.modules["requests"], importlib.import_module("urllib3")
    try:
        with session.get(url, headers=headers, stream=True,
                         timeout=(net.timeout, net.timeout)) as r:
            _check_scheme(r.url, net.allow_http)  # a redirect must not downgrade https
            yield r
    except requests.Timeout as e:
        raise _Transient(f"timed out (no answer for {net.timeout:g} s)") from e
    except (requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError) as e:
        raise _Transient("the connection broke mid-transfer") from e
    except (requests.ConnectionError, urllib3.exceptions.HTTPError) as e:
        text = str(e)
        # urllib3 reports a read timeout in the middle of a body as a connection error.
        if "timed out" in text.lower():
            raise _Transient(f"timed out (no data for {net.timeout:g} s)") from e
        raise _Transient(f"connection failed: {text}") from e
    except requests.RequestException as e:
        raise DownloadError(f"{url}: {e}") from e


def _body(r: Any, url: str, net: _Net) -> Iterator[bytes]:
    # Raw reads rather than iter_content: when a connection breaks mid-chunk, urllib3 2
    # discards the bytes it had buffered for that chunk, and those are what a resume keeps.
    # read1 returns what has arrived (read() would wait for a whole chunk, which a server
    # trickling a byte a second makes last for days), so the deadline is checked between reads.
    # decode_content=False: the digest is over the stored bytes, whatever a server claims.
    read = getattr(r.raw, "read1", None) or r.raw.read
    while True:
        net.check_deadline(url)
        chunk = read(_CHUNK, decode_content=False)
        if not chunk:
            return
        yield chunk


def _status_error(r: Any, url: str) -> None:
    text = f"HTTP {r.status_code} {r.reason or ''}".rstrip()
    if r.status_code in _RETRY_STATUS:
        raise _Transient(f"{url}: {text}")
    hint = (f"; check --url: it must be the folder holding {INDEX_FILE}"
            if r.status_code in (401, 403, 404, 410) else "")
    raise DownloadError(f"{url}: {text}{hint}")


def _retrying(url: str, net: _Net, attempt: Callable[[], Any], progress: Callable[[], int]) -> Any:
    """Run ``attempt`` until it returns, retrying _Transient failures with exponential backoff.

    An attempt that moved ``progress`` forward (bytes kept for resuming) resets the count, so
    a connection that keeps dropping still finishes as long as every try gains ground.
    """
    failures = 0
    best = progress()
    while True:
        net.check_deadline(url)
        try:
            return attempt()
        except _Transient as e:
            # Only bytes beyond the most ever held count as progress: a server that cuts every
            # attempt short and then refuses the resume (416, another range) makes a restart
            # from 0 regain the same bytes over and over, which must not reset the count.
            if progress() > best:
                best, failures = progress(), 0
            else:
                failures += 1
            if failures > net.retries:
                raise DownloadError(f"{url}: gave up after {failures} failed attempts in a row; "
                                    f"last: {e}. Check the connection, or raise --retries / "
                                    "--timeout") from e
            if failures:
                pause = min(net.backoff * 2 ** (failures - 1), _MAX_BACKOFF)
                time.sleep(max(0.0, min(pause, net.deadline - time.monotonic())))


def _fetch_bytes(session: Any, url: str, net: _Net, limit: int) -> bytes:
    def attempt() -> bytes:
        with _get(session, url, net, {}) as r:
            if r.status_code != 200:
                _status_error(r, url)
            body = bytearray()
            for chunk in _body(r, url, net):
                body += chunk
                if len(body) > limit:
                    raise DownloadError(f"{url}: more than {limit} bytes; not a bundle index")
            return bytes(body)

    return _retrying(url, net, attempt, lambda: 0)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(enabled: bool, total: int, initial: int, label: str) -> Any:
    if not enabled:
        return _NoBar()
    tqdm = _need("tqdm")
    return tqdm.tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,
                     desc=label, file=sys.stderr)


class _Partial:
    """The ``.part`` file being downloaded, with the digest of the bytes it holds so far."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size = path, size
        self.hasher, self.have = hashlib.sha256(), 0
        if path.exists():
            if path.stat().st_size > size:
                path.unlink()
            else:
                with open(path, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        self.hasher.update(chunk)
                        self.have += len(chunk)

    def restart(self) -> None:
        self.path.unlink(missing_ok=True)
        self.hasher, self.have = hashlib.sha256(), 0


def _range_start(value: str | None) -> int | None:
    m = re.match(r"^\s*bytes\s+(\d+)-\d+/(?:\d+|\*)\s*$", value or "")
    return int(m.group(1)) if m else None


def _fetch_rest(session: Any, url: str, st: _Partial, net: _Net, bar: Any) -> None:
    headers = {"Range": f"bytes={st.have}-"} if st.have else {}
    over = False
    with _get(session, url, net, headers) as r:
        if r.status_code == 416:  # the server's file is shorter than what we hold
            st.restart()
            bar.reset()
            raise _Transient(f"{url}: the server refused to resume; starting over")
        if r.status_code not in (200, 206):
            _status_error(r, url)
        if r.status_code == 206 and _range_start(r.headers.get("Content-Range")) != st.have:
            st.restart()
            bar.reset()
            raise _Transient(f"{url}: the server sent another range than asked; starting over")
        if r.status_code == 200 and st.have:  # the server ignores Range: take it from the top
            st.restart()
            bar.reset()
        with open(st.path, "ab") as f:
            for chunk in _body(r, url, net):
                if st.have + len(chunk) > st.size:
                    over = True
                    break
                f.write(chunk)
                st.hasher.update(chunk)
                st.have += len(chunk)
                bar.update(len(chunk))
    if over:
        st.restart()
        raise DownloadError(f"{url}: the server sent more than the {st.size} bytes the index "
                            "lists; nothing was installed")
    if st.have < st.size:
        raise _Transient(f"connection closed after {st.have} of {st.size} bytes")


def _fetch_file(session: Any, url: str, part: Path, size: int, sha256: str, net: _Net,
                label: str) -> None:
    st = _Partial(part, size)
    bar = _progress_bar(net.progress, size, st.have, label)
    try:
        _retrying(url, net, lambda: _fetch_rest(session, url, st, net, bar) if st.have < size
                  else None, lambda: st.have)
    finally:
        bar.close()
    got = st.hasher.hexdigest()
    if got != sha256:
        part.unlink(missing_ok=True)
        raise DownloadError(f"{url}: the download has sha256 {got[:16]}..., the index says "
                            f"{sha256[:16]}...; it is corrupt or was replaced on the server. "
                            "Nothing was installed; run the command again")


def _install_from_url(session: Any, entry: dict, url: str, root: Path, net: _Net, *,
                      keep_partial: bool, cap: int, lock_timeout: float, force: bool = False) -> InstalledBundle:
    name, sha256 = entry["name"], entry["sha256"]
    # A bundle is its files plus tar headers (512 bytes each, padded): never more than this.
    if entry["size"] > _bundle_cap(cap):
        raise BundleError(f"{url}: the index lists {entry['size']} bytes for bundle {name}, over the limit of "
                          f"{_bundle_cap(cap)} for max_unpacked_bytes={cap}; refused before downloading")
    with _bundle_lock(root, name, lock_timeout) as staging:
        if not force and _intact(root / name, sha256):
            _remove(staging)  # whatever a killed installer left there is of no use now
            return InstalledBundle(name, root / name, sha256, tuple(entry["targets"]),
                                   "already installed")
        part_name = f"{sha256[:16]}.part"
        _reset_staging(staging, keep=part_name)
        part = staging / part_name
        kept = False
        try:
            try:
                _fetch_file(session, url, part, entry["size"], sha256, net, name)
            except BaseException:
                kept = keep_partial and part.exists()
                raise
            return _install(part, root, staging, expect_name=name, sha256=sha256, source=url,
                            cap=cap)
        finally:
            if not kept:
                _remove(staging)


# --------------------------------------------------------------------------- choosing bundles


def _split_arch(text: str) -> tuple[str, str] | None:
    from .arch import normalize

    backend, _, arch = text.rpartition("/")
    if not backend:
        backend = "hip" if arch.startswith("gfx") else "cuda"
    if backend not in ("cuda", "hip"):
        return None
    try:
        return backend, normalize(backend, arch)
    except ValueError:
        return None


def select_bundles(index: dict, archs: Sequence[str], *, source: str = INDEX_FILE) -> list[dict]:
    """The index entries to install for ``archs``.

    Each item is a bundle name (``hip-gfx9x``) or an arch (``gfx942``, ``sm90``,
    ``gfx942:sramecc+:xnack-``, ``hip/gfx942``); a CUDA device also takes a bundle built for an
    older minor of its major (sm86 runs sm80 code). Raises DownloadError listing what the index
    offers when an item has no bundle.
    """
    from .arch import compatible

    bundles = index["bundles"]
    chosen: dict[str, dict] = {}
    missing = []
    for want in archs:
        text = want.strip().lower()
        hit = next((b for b in bundles if b["name"] == text), None)
        split = _split_arch(text) if hit is None else None
        if split is not None:
            backend, arch = split
            hit = next((b for a in compatible(backend, arch) for b in bundles
                        if b["backend"] == backend and a in b["targets"]), None)
        if hit is None:
            missing.append(want)
        else:
            chosen.setdefault(hit["name"], hit)
    if missing:
        offered = ", ".join(sorted({t for b in bundles for t in b["targets"]})) or "nothing"
        raise DownloadError(f"no bundle for {', '.join(missing)} in {source}; it offers {offered}. "
                            f"Pass one of those to --arch, or build and pack the target: "
                            f"python -m builder build --targets {missing[0]}")
    return list(chosen.values())


def _wanted(arch: str | Sequence[str], detect: Callable[[], list[str]] | None) -> list[str]:
    items = [a.strip() for a in (arch.split(",") if isinstance(arch, str) else arch) if a.strip()]
    lowered = [a.lower() for a in items]
    if not items:
        raise DownloadError("no target given: pass --arch auto or a list such as --arch gfx942,sm90")
    if "auto" not in lowered:
        return items
    if lowered != ["auto"]:
        raise DownloadError("--arch auto cannot be combined with named targets")
    reason = ""
    try:
        if detect is None:
            from .arch import detect_targets as detect
        found = list(detect())
    except (AotritonError, ImportError) as e:
        found, reason = [], f" ({e})"
    if not found:
        raise DownloadError(f"--arch auto found no GPU on this machine{reason}; name the targets "
                            "to fetch instead, e.g. --arch gfx942 or --arch sm90,gfx1100")
    return found


def download(arch: str | Sequence[str] = "auto", *, url: str | None = None,
             dest: str | os.PathLike | None = None, allow_http: bool = False,
             timeout: float = 30.0, retries: int = 4, backoff: float = 0.5,
             progress: bool | None = None, keep_partial: bool = False,
             max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED, lock_timeout: float = 600.0,
             detect: Callable[[], list[str]] | None = None, deadline: float = DEFAULT_DEADLINE,
             force: bool = False) -> list[InstalledBundle]:
    """Download and install the bundles for ``arch``; afterwards no network is needed.

    Args:
        arch: ``"auto"`` (the GPUs of this machine), or archs / bundle names as a comma string
            or a sequence: ``"gfx942,sm90"``.
        url: the published folder holding ``index.json`` (or the index's URL); default
            ``$AOTRITON_RT_URL``, then :data:`DEFAULT_URL`.
        dest: the images root (default :func:`images_root`).
        allow_http: accept ``http://``; only https is accepted otherwise.
        timeout: seconds to connect, and seconds without data before a read gives up.
        deadline: seconds the whole call may take (index and every bundle) before it gives up,
            however steadily a slow server sends.
        retries: failed attempts in a row allowed per file before giving up.
        backoff: first pause between attempts; it doubles per failure (capped at 30 s).
        progress: show a progress bar; default when stderr is a terminal.
        keep_partial: keep a failed download's partial file so that the next call resumes it;
            by default nothing partial is left behind.
        max_unpacked_bytes: refuse bundles that unpack to more than this.
        lock_timeout: seconds to wait for another installer of the same bundle.
        detect: for ``"auto"``, the function listing this machine's archs (default
            :func:`aotriton_rt.arch.detect_targets`).
        force: install even when the same bundle is already installed (repairs an install
            that fails :func:`verify`; one that fails it is repaired without ``force`` too).

    Returns one :class:`InstalledBundle` per bundle. Raises DownloadError (network, HTTP,
    digest, no bundle for a target), BundleError (malformed or hostile index or bundle) or
    CatalogError (a catalog schema this runtime cannot read); the previous install stays as it
    was in every case.

    Example::

        download("gfx942", url="https://example.org/aotriton-rt/0.1.0/")
    """
    wanted = _wanted(arch, detect)
    base, index_url = _resolve_url(url, allow_http)
    if progress is None:  # a bar only for a person at a terminal, and only if tqdm is there
        progress = (sys.stderr is not None and sys.stderr.isatty()
                    and importlib.util.find_spec("tqdm") is not None)
    if not (0 < timeout <= deadline) or retries < 0 or backoff < 0:
        raise DownloadError(f"need 0 < timeout <= deadline, retries >= 0 and backoff >= 0; got timeout={timeout}, "
                            f"deadline={deadline}, retries={retries}, backoff={backoff}")
    net = _Net(timeout, retries, backoff, allow_http, progress, time.monotonic() + deadline, deadline)
    root = images_root(dest)
    with _session() as session:
        index = parse_index(_fetch_bytes(session, index_url, net, _MAX_JSON), index_url)
        return [_install_from_url(session, entry, base + quote(entry["file"]), root, net,
                                  keep_partial=keep_partial, cap=max_unpacked_bytes,
                                  lock_timeout=lock_timeout, force=force)
                for entry in select_bundles(index, wanted, source=index_url)]


# --------------------------------------------------------------------------- verifying


@dataclass(frozen=True)
class VerifyReport:
    """The result of re-checking one image folder: ``problems`` is empty when it is intact."""

    name: str
    path: Path
    files: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_folder(folder: str | os.PathLike) -> VerifyReport:
    """Re-check an image folder: every file's size and sha256, the catalog, nothing extra.

    An installed bundle is checked against its ``bundle.json`` (which ``install.json``
    fingerprints); any other image folder against its ``catalog.json`` alone. Standard
    library only.
    """
    folder = Path(folder)
    try:
        return _verify_folder(folder)
    except OSError as e:  # the folder itself cannot be read: a report, not a crash
        return VerifyReport(folder.name, folder, 0, (f"cannot read {folder}: {e.strerror or e}",))


def _verify_folder(folder: Path) -> VerifyReport:
    problems: list[str] = []
    if not (folder / CATALOG_FILE).is_file():
        return VerifyReport(folder.name, folder, 0, (f"{folder} holds no {CATALOG_FILE}",))
    expected: dict[str, tuple[int, str]] = {}
    bundle = (folder / MANIFEST_FILE).is_file()
    if bundle:
        try:
            data = _read_small(folder / MANIFEST_FILE, _MAX_JSON)
        except (OSError, BundleError) as e:
            data = b""
            problems.append(f"{MANIFEST_FILE} cannot be read: {getattr(e, 'strerror', None) or e}")
        try:
            manifest = _parse_manifest(data, str(folder / MANIFEST_FILE), 1 << 62)
            expected = {f["path"]: (f["size"], f["sha256"]) for f in manifest["files"]}
        except AotritonError as e:
            problems.append(str(e))
        record = _load_record(folder)
        if record is None:
            problems.append(f"{INSTALL_FILE} is missing or unreadable")
        elif record.get("manifest_sha256") != hashlib.sha256(data).hexdigest():
            problems.append(f"{MANIFEST_FILE} was modified after installation")
    try:
        catalog = Catalog.load(folder)
    except CatalogError as e:
        problems.append(str(e))
    else:
        for v in catalog.variants:
            want = (v.image.size, v.image.sha256)
            if bundle and expected and expected.get(v.image.path) != want:
                problems.append(f"{v.image.path}: {MANIFEST_FILE} and {CATALOG_FILE} disagree")
            expected.setdefault(v.image.path, want)
    for rel, (size, sha256) in sorted(expected.items()):
        path = folder.joinpath(*rel.split("/"))
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                problems.append(f"{rel}: not a regular file")
            elif st.st_size != size:
                problems.append(f"{rel}: {st.st_size} bytes, expected {size}")
            elif _sha256_file(path) != sha256:
                problems.append(f"{rel}: sha256 differs from the catalog (corrupt or modified)")
        except FileNotFoundError:
            problems.append(f"missing {rel}")
        except OSError as e:
            problems.append(f"{rel}: cannot be read ({e.strerror or e})")
    if bundle:
        known = set(expected) | {MANIFEST_FILE, INSTALL_FILE, CATALOG_FILE}
        for dirpath, _, names in os.walk(folder):
            for n in names:
                rel = Path(dirpath, n).relative_to(folder).as_posix()
                if rel not in known:
                    problems.append(f"unexpected file {rel}")
    return VerifyReport(folder.name, folder, len(expected), tuple(problems))


def _load_record(folder: Path) -> dict | None:
    try:
        record = json.loads(_read_small(folder / INSTALL_FILE, _MAX_JSON))
    except (OSError, ValueError, RecursionError, BundleError):
        return None
    return record if isinstance(record, dict) and record.get("schema") == INSTALL_SCHEMA else None


def verify(dest: str | os.PathLike | None = None,
           names: Sequence[str] | None = None) -> list[VerifyReport]:
    """Re-check every installed bundle under ``dest`` (or only ``names``); see :func:`verify_folder`.

    Raises ImageFolderNotFound when nothing is installed there.
    """
    root = images_root(dest)
    if names:
        for n in names:
            if not isinstance(n, str) or not _NAME.match(n):
                raise ImageFolderNotFound(f"{n!r} is not a bundle name (lowercase letters, digits, '-', '_'); "
                                          "name an installed bundle, or use --folder PATH for a folder")
        folders = [root / n for n in names]
    else:
        folders = sorted(p for p in root.iterdir()
                         if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []
        if not folders:
            raise ImageFolderNotFound(f"nothing is installed in {root}; install images with "
                                      "`python -m aotriton_rt download --arch ARCH` "
                                      "(or --from-file BUNDLE)")
    return [verify_folder(f) for f in folders]


# --------------------------------------------------------------------------- command line


def add_cli(subparsers: Any) -> None:
    """Add the ``download`` and ``verify`` subcommands to ``python -m aotriton_rt``.

    Each sets ``func``: call ``args.func(args)``, which returns the exit status.
    """
    d = subparsers.add_parser(
        "download", help="fetch and install image bundles for your GPUs",
        description="Fetch, verify and install image bundles, or install one from a file.")
    d.add_argument("--arch", default="auto",
                   help="auto (the GPUs of this machine, the default) or a comma list of archs "
                        "or bundle names: gfx942,sm90")
    d.add_argument("--url", help=f"the published folder holding {INDEX_FILE} "
                                 f"(default: ${ENV_URL})")
    d.add_argument("--dest", help="images folder to install into (default: the per-user cache, "
                                  "or $AOTRITON_RT_CACHE)")
    d.add_argument("--from-file", metavar="BUNDLE", action="append",
                   help="install a local bundle file instead of downloading (repeatable)")
    d.add_argument("--sha256", help="with --from-file: the digest the bundle must have")
    d.add_argument("--allow-http", action="store_true", help="accept a plain http:// URL")
    d.add_argument("--timeout", type=float, default=30.0, help="seconds (default: 30)")
    d.add_argument("--retries", type=int, default=4, help="attempts in a row (default: 4)")
    d.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE,
                   help=f"seconds the whole download may take (default: {DEFAULT_DEADLINE:g})")
    d.add_argument("--force", action="store_true",
                   help="reinstall even if the same bundle is installed (an install that fails verify "
                        "is repaired without it too)")
    d.add_argument("--keep-partial", action="store_true",
                   help="keep a failed download's partial file so a later run resumes it")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=_cli_download)

    v = subparsers.add_parser("verify", help="re-check installed image folders",
                              description="Re-check the digests of installed image folders.")
    v.add_argument("names", nargs="*", help="bundle names (default: all installed)")
    v.add_argument("--dest", help="images folder (default: the per-user cache)")
    v.add_argument("--folder", help="check this image folder instead")
    v.set_defaults(func=_cli_verify)


def _cli_download(args: argparse.Namespace) -> int:
    try:
        if args.from_file:
            done = [install_file(f, dest=args.dest, sha256=args.sha256, force=args.force)
                    for f in args.from_file]
        else:
            done = download(args.arch, url=args.url, dest=args.dest, allow_http=args.allow_http,
                            timeout=args.timeout, retries=args.retries, deadline=args.deadline,
                            keep_partial=args.keep_partial, force=args.force,
                            progress=False if args.no_progress else None)
    except AotritonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for b in done:
        print(f"{b.action}: {b.name} ({', '.join(b.targets)}) in {b.path}")
    return 0


def _cli_verify(args: argparse.Namespace) -> int:
    try:
        reports = [verify_folder(args.folder)] if args.folder else verify(args.dest, args.names)
    except AotritonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for r in reports:
        print(f"{'ok' if r.ok else 'FAILED'}: {r.name} ({r.files} files) in {r.path}")
        for p in r.problems:
            print(f"  {p}")
    if not all(r.ok for r in reports):
        print("reinstall with `python -m aotriton_rt download` (or --from-file)", file=sys.stderr)
        return 1
    return 0
