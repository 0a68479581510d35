"""Images that come with installed packages: embedded in the runtime wheel, and image wheels.

The runtime wheel (``pip install aotriton-rt``) embeds the ``default`` image set for every
default target as package data, in ``aotriton_rt/images``. More images come as *image wheels*:
data-only wheels (``aotriton-rt-images-sm90-full`` and the like, made by
``python -m builder wheel images``) that install one image folder each as a top-level folder
of the environment and declare it under the entry-point group ``aotriton_rt.images``::

    [aotriton_rt.images]
    sm90-full = aotriton_rt_images_sm90_full

The value names the folder (``site-packages/aotriton_rt_images_sm90_full``), which holds
``catalog.json``, the images and ``image-wheel.json`` (what was packed: set, targets, Triton
version, catalog schema). Nothing of an image wheel is imported or executed. An image wheel
whose catalog schema this runtime does not read is refused with :class:`CatalogError` naming
the wheel, rather than skipped, so that a stale install cannot silently hide kernels.

:func:`aotriton_rt.images.find` merges the embedded folder (or a source checkout's
``images/``) with every installed image wheel; :attr:`Found.origins` says where each folder
came from and ``python -m aotriton_rt info`` prints it per folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .catalog import CATALOG_FILE, SCHEMA, SCHEMA_VERSION, check_image, parse_json, read_bounded
from .errors import CatalogError

ENTRY_POINT_GROUP = "aotriton_rt.images"
WHEEL_INFO = "image-wheel.json"
WHEEL_INFO_SCHEMA = "aotriton-rt.image-wheel"
_MAX_INFO_BYTES = 1 << 16


@dataclass(frozen=True)
class Source:
    """One image folder that came with an installed package, and which package."""

    folder: Path
    origin: str


def embedded_folder() -> Path | None:
    """``aotriton_rt/images`` of the installed runtime, when it holds a catalog."""
    from importlib.resources import files

    try:
        root = files("aotriton_rt") / "images"
    except (ModuleNotFoundError, TypeError):
        return None
    path = Path(str(root))
    # A zipped install (zipimport) has no real folder to read images from lazily: skip it.
    return path if (path / CATALOG_FILE).is_file() else None


def _read_info(folder: Path, dist: str, project: str) -> dict:
    """The wheel's ``image-wheel.json``, read as untrusted data: a regular file only (a FIFO or
    device is refused without blocking), at most ``_MAX_INFO_BYTES``, JSON of any nesting
    (CatalogError, never RecursionError). A broken record refuses the wheel by name, like an
    incompatible one, rather than skip it: a warning is easy to miss, a missing kernel is not."""
    info_path = folder / WHEEL_INFO
    fix = f"reinstall it (pip install --force-reinstall {project})"
    try:
        info = parse_json(read_bounded(info_path, _MAX_INFO_BYTES, "image-wheel record"),
                          f"image wheel {dist}: {info_path}")
    except CatalogError as e:
        raise CatalogError(f"image wheel {dist}: {e}; {fix}") from None
    if not isinstance(info, dict) or info.get("schema") != WHEEL_INFO_SCHEMA:
        raise CatalogError(f"image wheel {dist}: {info_path} is not an aotriton-rt image-wheel record; {fix}")
    return info


def check_compatible(info: dict, dist: str) -> None:
    """Refuse an image wheel whose catalog schema this runtime does not read."""
    from . import __version__

    schema, version = info.get("catalog_schema"), info.get("catalog_schema_version")
    if schema == SCHEMA and version == SCHEMA_VERSION:
        return
    advice = ("upgrade the runtime: pip install -U aotriton-rt" if isinstance(version, int)
              and version > SCHEMA_VERSION else f"install an image wheel made for this runtime "
              f"(python -m builder wheel images, with aotriton-rt {__version__}'s builder)")
    raise CatalogError(
        f"image wheel {dist} holds a catalog of schema {schema!r} version {version!r}, but "
        f"aotriton-rt {__version__} reads {SCHEMA!r} version {SCHEMA_VERSION}; its images were not "
        f"used. To fix: {advice}")


def image_wheels() -> list[Source]:
    """Every installed image wheel's folder, sorted by distribution name (CatalogError if one
    is incompatible or broken)."""
    from importlib.metadata import entry_points

    found: dict[str, Source] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        name = f"{dist.metadata['Name']} {dist.version}" if dist is not None else ep.name
        if dist is None or not ep.value.isidentifier():
            raise CatalogError(f"image wheel {name}: entry point {ep.name} = {ep.value!r} must name a "
                               "top-level folder of its own distribution")
        folder = Path(str(dist.locate_file(ep.value)))
        if not (folder / CATALOG_FILE).is_file():
            raise CatalogError(f"image wheel {name}: {folder} has no {CATALOG_FILE}; reinstall it "
                               f"(pip install --force-reinstall {dist.metadata['Name']})")
        check_compatible(_read_info(folder, name, dist.metadata["Name"]), name)
        found.setdefault(str(folder), Source(folder, f"image wheel {name}"))
    return sorted(found.values(), key=lambda s: s.origin)


def packaged() -> list[Source]:
    """The embedded images (if any) first, then the installed image wheels."""
    out = []
    embedded = embedded_folder()
    if embedded is not None:
        from . import __version__

        out.append(Source(embedded, f"embedded in aotriton-rt {__version__}"))
    return out + image_wheels()


def summary_lines(lib) -> list[str]:
    """Per image folder of ``lib``: where it came from, how many variants it serves (after
    earlier folders), for which targets, and whether every image's digests check out."""
    from collections import Counter

    from .errors import ImageError

    origins = getattr(lib.found, "origins", {}) or {}
    _ = lib.variants  # reads every folder's shards and records which folder serves each key
    lines = []
    for folder, catalog in zip(lib.found.folders, lib.catalogs):
        served = sum(lib._folder.get(v.key) == folder for v in catalog.variants)
        bad = []
        for v in catalog.variants:
            try:
                check_image(folder, v.image)  # both digests, as every launch checks them
            except ImageError as e:
                bad.append(str(e).splitlines()[0])
        targets = Counter(v.target.arch for v in catalog.variants)
        state = "digests OK" if not bad else f"{len(bad)} FAILED digest checks (first: {bad[0]})"
        lines.append(f"  {origins.get(str(folder), lib.found.reason)}: {folder}")
        per_target = ", ".join(f"{t} {n}" for t, n in sorted(targets.items()))
        lines.append(f"    {len(catalog.variants)} variants ({per_target}"
                     + (f"; {len(catalog.variants) - served} also in an earlier folder, used from there"
                        if served < len(catalog.variants) else "") + "), "
                     f"triton {catalog.triton_version}, {state}")
    return lines
