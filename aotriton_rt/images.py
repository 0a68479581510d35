"""Where images come from, and reading one safely.

The search order, first match wins:

1. an explicit path given to :class:`aotriton_rt.Library` (or ``path=``);
2. the environment variable ``AOTRITON_RT_IMAGES``: one image folder, or several separated by
   ``os.pathsep``;
3. the ``images/`` folder of a source checkout, or ``aotriton_rt/images`` embedded in the
   runtime wheel, together with every installed image wheel (:mod:`aotriton_rt.sources`);
4. the per-user cache where ``python -m aotriton_rt download`` installs bundles
   (``AOTRITON_RT_CACHE`` overrides it), one image folder per bundle.

An image folder is a directory holding ``catalog.json``. Every image is checked against the
catalog's sha256 (compressed and raw) before its bytes are handed to a driver.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .catalog import CATALOG_FILE, Variant, check_image
from .errors import ImageFolderNotFound

ENV_IMAGES = "AOTRITON_RT_IMAGES"
ENV_CACHE = "AOTRITON_RT_CACHE"
_HERE = Path(__file__).resolve().parent


def cache_root() -> Path:
    """The per-user folder holding downloaded image folders (``.../aotriton-rt/images``).

    Raises ImageFolderNotFound when there is no home folder to put it in (e.g. a UID without a
    passwd entry and no ``$HOME``); set ``$AOTRITON_RT_CACHE`` then.
    """
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    try:
        return _default_cache_root()
    except (RuntimeError, KeyError) as e:  # Path.home() without $HOME nor a passwd entry
        raise ImageFolderNotFound(f"no per-user cache folder: {e}; set ${ENV_CACHE} to a writable "
                                  "folder (or pass --dest)") from None


def _default_cache_root() -> Path:
    try:
        from platformdirs import user_cache_dir
        base = Path(user_cache_dir("aotriton-rt", appauthor=False))
    except ImportError:  # the core runtime needs only the standard library
        if sys.platform == "win32":
            base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local")) / "aotriton-rt" / "Cache"
        elif sys.platform == "darwin":
            base = Path.home() / "Library" / "Caches" / "aotriton-rt"
        else:
            base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aotriton-rt"
    return base / "images"


@dataclass
class Found:
    """The image folders chosen, why, and every place looked at on the way."""

    folders: list[Path]
    reason: str
    tried: list[tuple[str, str]] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict)  # str(folder) -> where it came from


def _is_folder(p: Path) -> bool:
    try:
        return (p / CATALOG_FILE).is_file()
    except (OSError, ValueError):  # a name too long for the OS, a NUL byte: not an image folder
        return False


def find(path: str | os.PathLike | None = None) -> Found:
    """Locate image folders along the documented order; raise ImageFolderNotFound if none."""
    tried: list[tuple[str, str]] = []
    if path is not None:
        p = Path(path)
        if _is_folder(p):
            return Found([p], "given explicitly", tried)
        raise ImageFolderNotFound(f"{str(p)[:300]} is not an image folder (no {CATALOG_FILE} in it)")
    env = os.environ.get(ENV_IMAGES)
    if env:
        folders = [Path(x) for x in env.split(os.pathsep) if x]
        if not folders:
            raise ImageFolderNotFound(f"${ENV_IMAGES} is set to {env!r}, which names no folder; set it to "
                                      f"an image folder (several separated by {os.pathsep!r}) or unset it")
        bad = [str(f)[:300] for f in folders if not _is_folder(f)]
        if bad:
            raise ImageFolderNotFound(f"{ENV_IMAGES} names folders without {CATALOG_FILE}: "
                                      f"{', '.join(bad)}")
        return Found(folders, f"from ${ENV_IMAGES}", tried)
    tried.append((f"${ENV_IMAGES}", "not set"))
    # Installed images (aotriton_rt.sources): a source checkout's images/ or the ones embedded
    # in the runtime wheel, merged with every installed image wheel.
    from .sources import packaged

    checkout = _HERE.parent / "images"
    if _is_folder(checkout):
        sources = [(checkout, "the source checkout's images/ folder")]
        sources += [(s.folder, s.origin) for s in packaged() if s.folder != _HERE / "images"]
    else:
        tried.append((str(checkout), f"no {CATALOG_FILE}"))
        sources = [(s.folder, s.origin) for s in packaged()]
    if sources:
        return Found([f for f, _ in sources], " + ".join(o for _, o in sources), tried,
                     {str(f): o for f, o in sources})
    tried.append(("installed packages", "no embedded images and no image wheels"))
    root = cache_root()
    try:
        bundles = sorted(p for p in root.glob("*") if _is_folder(p)) if root.is_dir() else []
    except OSError as e:
        bundles = []
        tried.append((str(root)[:300], f"unreadable ({e.strerror or e})"))
    if bundles:
        return Found(bundles, f"downloaded bundles in {root}", tried)
    tried.append((str(root), "no downloaded bundles"))
    places = "\n".join(f"  {where}: {why}" for where, why in tried)
    raise ImageFolderNotFound(
        "no image folder found; looked at:\n" + places + "\nbuild images with "
        "`python -m builder build`, download them with `python -m aotriton_rt download`, "
        f"or point ${ENV_IMAGES} at a folder holding {CATALOG_FILE}")


def read_image(folder: Path, variant: Variant) -> bytes:
    """The raw binary of ``variant``, after checking both of its digests
    (:func:`aotriton_rt.catalog.check_image`: bounded reads of a regular file, bounded
    decompression). Raises ImageError."""
    return check_image(folder, variant.image)
