"""Installing a bundle: per-bundle lock, staging folder, all-or-nothing swap.

Under a file lock per bundle name: reset the staging folder (finishing what a killed installer
left half-done), unpack into it, write the install record, then swap the folder into place. A
bundle already installed and intact is left as it is; one that fails :func:`verify_folder` is
reinstalled.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..catalog import CATALOG_FILE
from ..errors import BundleError, DownloadError
from .format import (
    DEFAULT_MAX_UNPACKED,
    INSTALL_FILE,
    INSTALL_SCHEMA,
    INSTALL_SCHEMA_VERSION,
    MANIFEST_FILE,
    images_root,
    long_path,
)
from .unpack import open_tar, read_manifest, unpack_bundle
from .verify import load_record, sha256_file, verify_folder


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


def need_optional(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise DownloadError(f"installing images needs the optional package {module!r}: "
                            "pip install 'aotriton-rt[download]'") from e

@contextmanager
def bundle_lock(root: Path, name: str, timeout: float) -> Iterator[Path]:
    """Hold the installer lock of bundle ``name``; yields its (absent or stale) staging folder."""
    filelock = need_optional("filelock")
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


def reset_staging(staging: Path, keep: str | None = None) -> None:
    """Empty the staging folder under the lock: whatever is there was left by a dead installer.

    A staging path that is not a real folder (a planted symlink, a file) is removed itself,
    never followed: the installer deletes only what it created.
    """
    if os.path.lexists(staging) and not _is_real_dir(staging):
        staging.unlink()
    if _is_real_dir(staging):
        for p in staging.iterdir():
            if p.name != keep:
                remove_path(p)
    staging.mkdir(exist_ok=True)


def remove_path(p: Path) -> None:
    if _is_real_dir(p):
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def installed_intact(folder: Path, sha256: str) -> bool:
    """Whether bundle ``sha256`` is installed in ``folder`` and still passes :func:`verify_folder`
    (else the caller reinstalls it: a corrupted install is repaired, never reported as done)."""
    return _installed_sha(folder) == sha256 and verify_folder(folder).ok


def bundle_cap(cap: int) -> int:
    """The largest bundle file that can unpack to at most ``cap`` bytes (tar headers and padding)."""
    return cap + cap // 8 + (16 << 20)


def _installed_sha(folder: Path) -> str | None:
    record = load_record(folder)
    if record is None:
        return None
    if not isinstance(record, dict) or record.get("schema") != INSTALL_SCHEMA:
        return None
    if "catalog_sha256" not in record:
        return None  # installed by an older runtime with its catalog inline: reinstall it sharded
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
        remove_path(old)


def install_bundle(bundle: Path, root: Path, staging: Path, *, expect_name: str, sha256: str,
             source: str, cap: int) -> InstalledBundle:
    # Not mkdtemp: its 0700 would make the install unreadable to the other users of a shared
    # images folder. The mode comes from the umask, as for every folder and file below it.
    unpack = staging / f"unpack-{uuid.uuid4().hex[:12]}"
    try:
        unpack.mkdir()
        manifest, manifest_bytes, got = unpack_bundle(bundle, unpack, source, cap)
        if manifest["name"] != expect_name:
            raise BundleError(f"{source}: the bundle calls itself {manifest['name']!r}, "
                              f"expected {expect_name!r}")
        if got != sha256:
            raise BundleError(f"{source}: changed while being installed (sha256 {got[:16]}..., "
                              f"expected {sha256[:16]}...); nothing was installed")
        (unpack / MANIFEST_FILE).write_bytes(manifest_bytes)
        record = {"schema": INSTALL_SCHEMA, "schema_version": INSTALL_SCHEMA_VERSION,
                  "name": expect_name, "sha256": sha256,
                  "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
                  # The folder's catalog.json is the index written at install, not the bundle's
                  # inline catalog the manifest vouches for: verify checks it against this.
                  "catalog_sha256": hashlib.sha256((unpack / CATALOG_FILE).read_bytes()).hexdigest(),
                  "source": source}
        (unpack / INSTALL_FILE).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
        final = root / expect_name
        _swap(unpack, final, staging)
    except OSError as e:
        raise DownloadError(f"installing {expect_name} into {root} failed: {e}; the previous "
                            "install, if any, is unchanged") from e
    finally:
        remove_path(unpack)
    return InstalledBundle(expect_name, final, sha256, tuple(manifest["targets"]), "installed")

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
    path = long_path(Path(bundle))
    if not path.is_file():
        raise BundleError(f"{source}: no such bundle file")
    with open_tar(path, source) as (tar, _):
        name = read_manifest(tar, source, max_unpacked_bytes)[0]["name"]
    digest = sha256_file(path)
    if sha256 is not None and digest != sha256.lower():
        raise BundleError(f"{source}: sha256 is {digest}, expected {sha256.lower()}; the file is "
                          "corrupt or not the bundle you meant")
    root = images_root(dest)
    with bundle_lock(root, name, lock_timeout) as staging:
        if not force and installed_intact(root / name, digest):
            remove_path(staging)  # whatever a killed installer left there is of no use now
            return InstalledBundle(name, root / name, digest, _installed_targets(root / name),
                                   "already installed")
        reset_staging(staging)
        try:
            return install_bundle(path, root, staging, expect_name=name, sha256=digest, source=source,
                            cap=max_unpacked_bytes)
        finally:
            remove_path(staging)


def _installed_targets(folder: Path) -> tuple[str, ...]:
    try:
        targets = json.loads((folder / MANIFEST_FILE).read_bytes()).get("targets", [])
    except (OSError, ValueError, AttributeError, RecursionError):
        return ()
    return tuple(t for t in targets if isinstance(t, str)) if isinstance(targets, list) else ()
