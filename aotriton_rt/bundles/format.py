"""The bundle formats: index, manifest, install record, and where installs live.

``python -m builder pack`` writes bundles and their index with these names and schemas; the
runtime reads them here. ``docs/noimage.md`` specifies the formats. Standard library only.

A published folder holds ``index.json`` (:func:`parse_index`) and one ``.tar`` bundle per target
or family. A bundle's first member is ``bundle.json`` (:func:`parse_manifest`), the digest of
every other member. An installed bundle is the folder ``<images root>/<name>/`` holding the
unpacked files, its ``bundle.json`` and the installer's ``install.json``.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import __version__
from ..catalog import CATALOG_FILE
from ..catalog import SCHEMA_VERSION as CATALOG_SCHEMA_VERSION
from ..errors import AotritonError, BundleError, CatalogError, DownloadError

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
#: The largest total a bundle may unpack to (archive-bomb cap); a parameter overrides it.
DEFAULT_MAX_UNPACKED = 8 << 30
#: The largest index or manifest read.
MAX_JSON = 64 << 20
#: The largest catalog a bundle may carry. A bundle carries its catalog inline (a full sm90 set
#: is ~50 MB), parsed once at install and written into the folder as the index and its shards.
MAX_BUNDLE_CATALOG_BYTES = 64 << 20
CHUNK = 1 << 20
BUNDLE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\.tar$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_WINDOWS_DEVICES = frozenset({"con", "prn", "aux", "nul", "conin$", "conout$",
                              *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))})
_NOT_PORTABLE = frozenset('<>:"|?*\\')


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
        if not isinstance(name, str) or not BUNDLE_NAME.match(name) or name in names:
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


def parse_manifest(data: bytes, source: str, cap: int) -> dict:
    obj = _load_json(data, source, BundleError)
    _check_schema(obj, BUNDLE_SCHEMA, BUNDLE_SCHEMA_VERSION, "bundle", source)
    name = obj.get("name")
    if not isinstance(name, str) or not BUNDLE_NAME.match(name):
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


# --------------------------------------------------------------------------- where installs live


def long_path(p: Path) -> Path:
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
        from ..images import cache_root
        dest = cache_root()
    return long_path(Path(dest))


# --------------------------------------------------------------------------- choosing bundles


def _split_arch(text: str) -> tuple[str, str] | None:
    from ..arch import normalize

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
    from ..arch import compatible

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
