"""Wheels: the runtime wheel with the default images embedded, and data-only image wheels.

``python -m builder wheel runtime --images images/ --out dist/`` builds the ``aotriton-rt``
wheel with setuptools from a staging copy of the project in which the image folder sits at
``aotriton_rt/images`` (package data; the runtime finds it through ``importlib.resources``).

``python -m builder wheel images --images DIR --set full --out dist/`` writes one data-only
wheel per target of ``DIR`` (``--targets`` picks some, ``--combined`` makes one for all),
named ``aotriton-rt-images-<target>-<set>``. Such a wheel holds one image folder (its catalog in
the index form, one shard per kernel and target, as ``build`` writes it), a record of
what it holds (``image-wheel.json``: set, targets, Triton version, catalog schema) and an
entry point in the group ``aotriton_rt.images`` through which the runtime discovers it
(:mod:`aotriton_rt.sources`). It contains no code.

Both kinds are reproducible: entries in a fixed order, every timestamp from
``SOURCE_DATE_EPOCH`` (a fixed date when unset), fixed permissions, and a RECORD written from
the contents, so two builds from the same inputs are byte-identical.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from aotriton_rt.catalog import SCHEMA, SCHEMA_VERSION, Catalog, check_file
from aotriton_rt.errors import ImageMismatch
from aotriton_rt.sources import ENTRY_POINT_GROUP, WHEEL_INFO, WHEEL_INFO_SCHEMA

#: Zip timestamps when SOURCE_DATE_EPOCH is unset: 2026-01-01T00:00:00Z.
DEFAULT_EPOCH = 1767225600
_ROOT = Path(__file__).resolve().parent.parent
_NAME_PART = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


class WheelError(Exception):
    """A wheel could not be made from the given inputs."""


def _epoch() -> tuple[int, int, int, int, int, int]:
    raw = os.environ.get("SOURCE_DATE_EPOCH")
    try:
        seconds = int(raw) if raw else DEFAULT_EPOCH
    except ValueError:
        raise WheelError(f"SOURCE_DATE_EPOCH must be an integer number of seconds, got {raw!r}") from None
    seconds = max(seconds, 315532800)  # zip cannot store dates before 1980
    return time.gmtime(seconds)[:6]


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def write_wheel(path: Path, files: Mapping[str, bytes], dist_info: str) -> Path:
    """Write ``files`` (archive name -> bytes) as a reproducible wheel at ``path``.

    Entries go in sorted order with the ``.dist-info`` folder last; RECORD is written here
    from the contents (a RECORD in ``files`` is replaced).
    """
    record_name = f"{dist_info}/RECORD"
    names = sorted(n for n in files if n != record_name)
    names = [n for n in names if not n.startswith(dist_info + "/")] + \
            [n for n in names if n.startswith(dist_info + "/")]
    record = "".join(f"{n},{_record_hash(files[n])},{len(files[n])}\n" for n in names) + f"{record_name},,\n"
    stamp = _epoch()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w") as zf:
            for name, data in [*((n, files[n]) for n in names), (record_name, record.encode())]:
                info = zipfile.ZipInfo(name, date_time=stamp)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = (0o100644 & 0xFFFF) << 16
                info.create_system = 3  # Unix, so the permissions above are read as such
                zf.writestr(info, data, compresslevel=9)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def normalize_wheel(path: Path) -> Path:
    """Rewrite a wheel in place in the reproducible form of :func:`write_wheel`."""
    with zipfile.ZipFile(path) as zf:
        files = {i.filename: zf.read(i) for i in zf.infolist() if not i.is_dir()}
    dist_infos = {n.split("/", 1)[0] for n in files if n.split("/", 1)[0].endswith(".dist-info")}
    if len(dist_infos) != 1:
        raise WheelError(f"{path}: expected one .dist-info folder, found {sorted(dist_infos)}")
    return write_wheel(path, files, dist_infos.pop())


# ---------------------------------------------------------------------------------------------
# Image wheels.
# ---------------------------------------------------------------------------------------------

def _folder_files(images: Path, catalog: Catalog) -> dict[str, bytes]:
    """Every file the catalog lists, read and digest-checked: each variant's image and, for CUDA
    variants, the PTX that ``aotriton_rt.jax`` hands to jaxlib under ``jax.jit``."""
    out = {}
    for v in catalog.variants:
        for image in (v.image, v.ptx):
            if image is None:
                continue
            try:
                out[image.path] = check_file(images / image.path, image.size, image.sha256)
            except ImageMismatch as e:
                raise WheelError(f"{e}; rebuild the folder (python -m builder build) before packing it") from None
    return out


def dist_name(targets: Sequence[str], set_name: str) -> str:
    """``aotriton-rt-images-<targets>-<set>``, the distribution name of an image wheel."""
    name = f"aotriton-rt-images-{'-'.join(targets)}-{set_name}".lower()
    if not _NAME_PART.match(name):
        raise WheelError(f"{name!r} is not a valid distribution name: use letters, digits, '-' and '.'")
    return name


def image_wheel(images: Path, out: Path, *, targets: Sequence[str], set_name: str, version: str,
                name: str | None = None) -> Path:
    """One data-only wheel holding the variants of ``targets`` in the image folder ``images``."""
    catalog = Catalog.load(images)
    chosen = [v for v in catalog.variants if v.target.arch in set(targets)]
    if not chosen:
        have = sorted({v.target.arch for v in catalog.variants})
        raise WheelError(f"{images} holds no variant for {', '.join(targets)} (it has: {', '.join(have) or 'none'})")
    dist = name or dist_name(targets, set_name)
    module = re.sub(r"[^a-z0-9]", "_", dist.lower())
    sub = Catalog(catalog.triton_version, tuple(chosen), catalog.tuning)
    files = {f"{module}/{p}": data for p, data in _folder_files(images, sub).items()}
    # The index and one shard per kernel and target, as `build` writes them: a Library() reads
    # the index alone, and the shards a call needs.
    files.update({f"{module}/{p}": data for p, data in sub.files().items()})
    info = {"schema": WHEEL_INFO_SCHEMA, "name": dist, "version": version, "set": set_name,
            "targets": sorted({v.target.arch for v in chosen}), "triton_version": catalog.triton_version,
            "catalog_schema": SCHEMA, "catalog_schema_version": SCHEMA_VERSION, "variants": len(chosen),
            "kernels": sorted({v.kernel for v in chosen})}
    files[f"{module}/{WHEEL_INFO}"] = (json.dumps(info, indent=1, sort_keys=True) + "\n").encode()
    dist_info = f"{module}-{version}.dist-info"
    files[f"{dist_info}/METADATA"] = (
        "Metadata-Version: 2.1\n"
        f"Name: {dist}\n"
        f"Version: {version}\n"
        f"Summary: aotriton-rt images ({set_name} set) for {', '.join(info['targets'])}, built with triton "
        f"{catalog.triton_version}, catalog schema {SCHEMA_VERSION}\n"
        "License: MIT\n"
        "Requires-Dist: aotriton-rt\n").encode()
    files[f"{dist_info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: aotriton-rt builder\n"
                                   b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    entry = dist.removeprefix("aotriton-rt-images-")
    files[f"{dist_info}/entry_points.txt"] = f"[{ENTRY_POINT_GROUP}]\n{entry} = {module}\n".encode()
    return write_wheel(out / f"{module}-{version}-py3-none-any.whl", files, dist_info)


def image_wheels(images: Path, out: Path, *, targets: Sequence[str] | None, set_name: str, version: str,
                 combined: bool = False) -> list[Path]:
    """Image wheels for ``targets`` (default: every target of the folder), one per target or one."""
    have = sorted({v.target.arch for v in Catalog.load(images).variants})
    chosen = list(targets) if targets else have
    missing = [t for t in chosen if t not in have]
    if missing:
        raise WheelError(f"{images} holds no variant for {', '.join(missing)} (it has: {', '.join(have) or 'none'})")
    if combined:
        return [image_wheel(images, out, targets=chosen, set_name=set_name, version=version)]
    return [image_wheel(images, out, targets=[t], set_name=set_name, version=version) for t in chosen]


# ---------------------------------------------------------------------------------------------
# The runtime wheel.
# ---------------------------------------------------------------------------------------------

_STAGED = ("pyproject.toml", "README.md", "LICENSE", "aotriton_rt", "builder")


def runtime_wheel(images: Path | None, out: Path, *, project: Path = _ROOT) -> Path:
    """The ``aotriton-rt`` wheel, built by setuptools, with ``images`` embedded (None: none)."""
    if not (project / "pyproject.toml").is_file():
        raise WheelError(f"{project} is not the aotriton-rt source tree (no pyproject.toml): the runtime "
                         "wheel is built from a checkout")
    try:
        import setuptools  # noqa: F401 - the build backend, run in a subprocess below
    except ImportError:
        raise WheelError("building the runtime wheel needs setuptools: pip install 'setuptools>=68'") from None
    with tempfile.TemporaryDirectory(prefix="aotriton-wheel-") as tmp:
        stage = Path(tmp) / "src"
        stage.mkdir()
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "images")
        for item in _STAGED:
            src = project / item
            if src.is_dir():
                shutil.copytree(src, stage / item, ignore=ignore)
            elif src.is_file():
                shutil.copy2(src, stage / item)
        if images is not None:
            catalog = Catalog.load(images)
            dest = stage / "aotriton_rt" / "images"
            for rel, data in _folder_files(images, catalog).items():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                (dest / rel).write_bytes(data)
            embedded = catalog.write(dest)  # the index and its shards, as `build` writes them
        dist = Path(tmp) / "dist"
        code = ("import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))")
        env = {**os.environ, "SOURCE_DATE_EPOCH": str(os.environ.get("SOURCE_DATE_EPOCH") or DEFAULT_EPOCH)}
        proc = subprocess.run([sys.executable, "-c", code, str(dist)], cwd=stage, env=env,
                              capture_output=True, text=True)
        if proc.returncode:
            raise WheelError("setuptools failed to build the runtime wheel:\n" + proc.stderr[-3000:])
        built = dist / proc.stdout.strip().splitlines()[-1]
        out.mkdir(parents=True, exist_ok=True)
        target = out / built.name
        shutil.copyfile(built, target)
    normalize_wheel(target)
    if images is not None:
        with zipfile.ZipFile(target) as zf:
            names = set(zf.namelist())
            if missing := sorted(rel for rel in embedded if f"aotriton_rt/images/{rel}" not in names):
                raise WheelError(f"{target}: setuptools left {missing[0]} of the images out (check "
                                 "[tool.setuptools.package-data])")
    return target


# ---------------------------------------------------------------------------------------------
# Command line: python -m builder wheel {runtime,images}.
# ---------------------------------------------------------------------------------------------

def _cmd_runtime(args) -> int:
    images = None if args.no_images else Path(args.images)
    path = runtime_wheel(images, Path(args.out))
    print(f"{path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0


def _cmd_images(args) -> int:
    from aotriton_rt import __version__

    targets = [t.strip() for t in args.targets.split(",") if t.strip()] if args.targets else None
    for path in image_wheels(Path(args.images), Path(args.out), targets=targets, set_name=args.set,
                             version=args.version or __version__, combined=args.combined):
        print(f"{path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0


class CliHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, except where there is none (None, False)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_cli(sub, default_images: Path) -> None:
    """Register ``wheel runtime`` and ``wheel images`` on the builder's subcommands."""
    w = sub.add_parser("wheel", help="make the runtime wheel or data-only image wheels",
                       description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = w.add_subparsers(dest="kind", required=True)
    r = kinds.add_parser("runtime", help="the aotriton-rt wheel with an image folder embedded",
                         formatter_class=CliHelp,
                         description="Build the aotriton-rt wheel (runtime + builder) with setuptools, "
                                     "embedding an image folder (normally the default set for every "
                                     "default target) as aotriton_rt/images. Reproducible (SOURCE_DATE_EPOCH).")
    r.add_argument("--images", default=str(default_images), help="image folder to embed")
    r.add_argument("--no-images", action="store_true", help="embed no images (a runtime-only wheel)")
    r.add_argument("--out", default="dist", help="folder to write the wheel into")
    r.set_defaults(func=_cmd_runtime)
    i = kinds.add_parser("images", help="data-only wheels holding an image folder's variants",
                         formatter_class=CliHelp,
                         description="Write aotriton-rt-images-<target>-<set> wheels from an image folder: "
                                     "one per target (or one for all with --combined). pip install them "
                                     "next to aotriton-rt; the runtime finds and merges them.")
    i.add_argument("--images", default=str(default_images), help="image folder to pack")
    i.add_argument("--targets", help="comma list of targets to pack (default: every target in the folder)")
    i.add_argument("--set", default="full", help="the set name that goes into the wheel's name")
    i.add_argument("--combined", action="store_true", help="one wheel for all the targets")
    i.add_argument("--version", help="wheel version (default: this aotriton-rt's version)")
    i.add_argument("--out", default="dist", help="folder to write the wheels into")
    i.set_defaults(func=_cmd_images)
