"""Re-checking installed image folders: every file's size and sha256, nothing extra.

Standard library only: ``python -m aotriton_rt verify`` works without the download extra.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..catalog import CATALOG_FILE, Catalog, check_file, open_regular
from ..errors import AotritonError, BundleError, CatalogError, ImageFolderNotFound, ImageMismatch
from .format import (
    BUNDLE_NAME,
    CHUNK,
    INSTALL_FILE,
    INSTALL_SCHEMA,
    MANIFEST_FILE,
    MAX_JSON,
    images_root,
    parse_manifest,
)


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
    fingerprints, with the index ``catalog.json`` the installer wrote; the index vouches for each
    shard); any other image folder against its ``catalog.json`` alone. Standard
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
    recorded = False  # whether install.json vouches for catalog.json (an index the installer wrote)
    bundle = (folder / MANIFEST_FILE).is_file()
    if bundle:
        try:
            data = read_small(folder / MANIFEST_FILE, MAX_JSON)
        except (OSError, BundleError) as e:
            data = b""
            problems.append(f"{MANIFEST_FILE} cannot be read: {getattr(e, 'strerror', None) or e}")
        try:
            manifest = parse_manifest(data, str(folder / MANIFEST_FILE), 1 << 62)
            expected = {f["path"]: (f["size"], f["sha256"]) for f in manifest["files"]}
        except AotritonError as e:
            problems.append(str(e))
        record = load_record(folder)
        if record is None:
            problems.append(f"{INSTALL_FILE} is missing or unreadable")
        elif record.get("manifest_sha256") != hashlib.sha256(data).hexdigest():
            problems.append(f"{MANIFEST_FILE} was modified after installation")
        if record is not None and "catalog_sha256" in record:
            # The manifest vouches for the inline catalog the bundle carried; the installer wrote
            # it as an index (recorded here) whose entries vouch for each shard.
            expected.pop(CATALOG_FILE, None)
            recorded = True
            if sha256_file(folder / CATALOG_FILE) != record["catalog_sha256"]:
                problems.append(f"{CATALOG_FILE} was modified after installation")
    shards: set[str] = set()
    try:
        catalog = Catalog.load(folder)
        shards = {ref.path for ref in catalog.shard_refs()}
        catalog.variants  # noqa: B018 - reads every shard, each checked against its index entry
    except CatalogError as e:
        problems.append(str(e))
    else:
        for image in (i for v in catalog.variants for i in (v.image, v.ptx) if i is not None):
            want = (image.size, image.sha256)
            if bundle and expected and expected.get(image.path) != want:
                problems.append(f"{image.path}: {MANIFEST_FILE} and {CATALOG_FILE} disagree")
            expected.setdefault(image.path, want)
    for rel, (size, sha256) in sorted(expected.items()):
        try:
            check_file(folder.joinpath(*rel.split("/")), size, sha256, keep=False)
        except ImageMismatch as e:
            problems.append(_PROBLEMS[e.problem].format(rel=rel, size=size, detail=e.detail))
    if bundle:
        known = set(expected) | shards | {MANIFEST_FILE, INSTALL_FILE, CATALOG_FILE}
        for dirpath, _, names in os.walk(folder):
            for n in names:
                rel = Path(dirpath, n).relative_to(folder).as_posix()
                if rel not in known:
                    problems.append(f"unexpected file {rel}")
    # Files checked by digest: the images (and a catalog the manifest lists), the recorded index, shards.
    return VerifyReport(folder.name, folder, len(expected) + len(shards) + recorded, tuple(problems))


#: How a report words what :func:`aotriton_rt.catalog.check_file` found wrong.
_PROBLEMS = {
    "missing": "missing {rel}",
    "unreadable": "{rel}: cannot be read ({detail})",
    "not regular": "{rel}: not a regular file",
    "size": "{rel}: {detail} bytes, expected {size}",
    "sha256": "{rel}: sha256 differs from the catalog (corrupt or modified)",
}


def load_record(folder: Path) -> dict | None:
    try:
        record = json.loads(read_small(folder / INSTALL_FILE, MAX_JSON))
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
            if not isinstance(n, str) or not BUNDLE_NAME.match(n):
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


def read_small(path: Path, limit: int) -> bytes:
    with open_regular(path) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise BundleError(f"{path} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BundleError(f"{path} is over {limit} bytes")
    return data


def sha256_file(path: Path) -> str:
    hasher = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()
