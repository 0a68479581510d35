"""Wheels: the runtime wheel with images embedded, data-only image wheels, and their discovery.

The image folder is a real build (``built_images``: add and softmax for gfx942, gfx1100, sm80,
sm90). Image wheels are "installed" by unpacking them into a folder on ``sys.path``, which is
all an installer does for a pure wheel; ``.ci/run`` also installs both kinds with pip into a
fresh venv.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from aotriton_rt import images as images_mod
from aotriton_rt import sources
from aotriton_rt.catalog import CATALOG_FILE, SCHEMA_VERSION, Catalog
from aotriton_rt.errors import CatalogError
from builder import wheels
from builder.wheels import WheelError, image_wheel, image_wheels, normalize_wheel, runtime_wheel

ROOT = Path(__file__).resolve().parent.parent.parent


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _install(wheel: Path, site: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty site folder on sys.path, and no other images anywhere the search looks."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delenv("AOTRITON_RT_IMAGES", raising=False)
    monkeypatch.setenv("AOTRITON_RT_CACHE", str(tmp_path / "no-cache"))
    monkeypatch.setattr(images_mod, "_HERE", tmp_path / "pkg" / "aotriton_rt")
    monkeypatch.setattr(sources, "embedded_folder", lambda: None)
    return folder


def test_two_builds_of_an_image_wheel_are_byte_identical(built_images: Path, tmp_path: Path) -> None:
    a = image_wheels(built_images, tmp_path / "a", targets=["sm90"], set_name="default", version="0.1.0")
    b = image_wheels(built_images, tmp_path / "b", targets=["sm90"], set_name="default", version="0.1.0")
    assert [p.name for p in a] == ["aotriton_rt_images_sm90_default-0.1.0-py3-none-any.whl"]
    assert _sha(a[0]) == _sha(b[0])


def test_source_date_epoch_sets_every_timestamp_of_a_wheel(built_images: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # 2023-11-14T22:13:20Z
    path = image_wheel(built_images, tmp_path, targets=["gfx942"], set_name="x", version="1.0")
    with zipfile.ZipFile(path) as zf:
        assert {i.date_time for i in zf.infolist()} == {(2023, 11, 14, 22, 13, 20)}
        names = zf.namelist()
    assert names[-1] == "aotriton_rt_images_gfx942_x-1.0.dist-info/RECORD"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "soon")
    with pytest.raises(WheelError, match="SOURCE_DATE_EPOCH must be an integer number of seconds, got 'soon'"):
        image_wheel(built_images, tmp_path, targets=["gfx942"], set_name="x", version="1.0")


def test_an_image_wheel_holds_its_targets_variants_a_record_and_an_entry_point(built_images: Path,
                                                                               tmp_path: Path) -> None:
    path = image_wheel(built_images, tmp_path, targets=["sm80", "sm90"], set_name="full", version="0.1.0")
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        index = json.loads(zf.read(f"aotriton_rt_images_sm80_sm90_full/{CATALOG_FILE}"))
        # The index form with its shards, as `build` writes it: a Library() reads the index alone.
        assert "variants" not in index and len(index["shards"]) == 4
        zf.extractall(tmp_path / "unzipped")
        catalog = Catalog.load(tmp_path / "unzipped" / "aotriton_rt_images_sm80_sm90_full")
        info = json.loads(zf.read("aotriton_rt_images_sm80_sm90_full/image-wheel.json"))
        entry = zf.read("aotriton_rt_images_sm80_sm90_full-0.1.0.dist-info/entry_points.txt").decode()
        record = zf.read("aotriton_rt_images_sm80_sm90_full-0.1.0.dist-info/RECORD").decode()
        assert not [n for n in names if n.endswith(".py")], "an image wheel carries no code"
        for v in catalog.variants:
            assert hashlib.sha256(zf.read(f"aotriton_rt_images_sm80_sm90_full/{v.image.path}")).hexdigest() == \
                v.image.sha256
            assert hashlib.sha256(zf.read(f"aotriton_rt_images_sm80_sm90_full/{v.ptx.path}")).hexdigest() == \
                v.ptx.sha256
    assert {v.target.arch for v in catalog.variants} == {"sm80", "sm90"}
    assert info["targets"] == ["sm80", "sm90"] and info["catalog_schema_version"] == SCHEMA_VERSION
    assert info["triton_version"] == catalog.triton_version and info["set"] == "full"
    assert entry == "[aotriton_rt.images]\nsm80-sm90-full = aotriton_rt_images_sm80_sm90_full\n"
    assert len(record.splitlines()) == len(names)


def test_packing_a_target_the_folder_lacks_is_refused(built_images: Path, tmp_path: Path) -> None:
    with pytest.raises(WheelError, match=r"holds no variant for gfx950 \(it has: gfx1100, gfx942, sm80, sm90\)"):
        image_wheels(built_images, tmp_path, targets=["gfx950"], set_name="full", version="0.1.0")


def test_an_installed_image_wheel_is_found_and_merged_with_its_origin(built_images: Path, site: Path,
                                                                      tmp_path: Path) -> None:
    for t in ("sm90", "gfx942"):
        _install(image_wheel(built_images, tmp_path / "dist", targets=[t], set_name="full", version="0.1.0"), site)
    found = images_mod.find()
    assert found.folders == [site / "aotriton_rt_images_gfx942_full", site / "aotriton_rt_images_sm90_full"]
    assert found.origins[str(site / "aotriton_rt_images_sm90_full")] == \
        "image wheel aotriton-rt-images-sm90-full 0.1.0"
    from aotriton_rt.library import Library

    lib = Library()
    assert {v.target.arch for v in lib.variants} == {"gfx942", "sm90"}
    lines = sources.summary_lines(lib)
    assert lines[0] == f"  image wheel aotriton-rt-images-gfx942-full 0.1.0: {site / 'aotriton_rt_images_gfx942_full'}"
    assert "digests OK" in lines[1] and "digests OK" in lines[3]


def test_info_reports_an_image_that_fails_its_digest(built_images: Path, site: Path, tmp_path: Path) -> None:
    _install(image_wheel(built_images, tmp_path / "dist", targets=["sm90"], set_name="full", version="0.1.0"), site)
    victim = next(p for p in (site / "aotriton_rt_images_sm90_full" / "cuda").rglob("*.xz")
                  if not p.name.endswith(".ptx.xz"))  # a kernel image (info checks those)
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    from aotriton_rt.library import Library

    lines = sources.summary_lines(Library())
    assert "1 FAILED digest checks (first: image " in lines[1] and "is corrupt" in lines[1]


def test_an_image_wheel_of_another_catalog_schema_is_refused_by_name(built_images: Path, site: Path,
                                                                     tmp_path: Path) -> None:
    _install(image_wheel(built_images, tmp_path / "dist", targets=["sm90"], set_name="full", version="0.1.0"), site)
    info_path = site / "aotriton_rt_images_sm90_full" / "image-wheel.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "catalog_schema_version": 3}))
    with pytest.raises(CatalogError, match=r"image wheel aotriton-rt-images-sm90-full 0.1.0 holds a catalog of "
                                           r"schema 'aotriton-rt.catalog' version 3, but aotriton-rt .* reads "
                                           r"'aotriton-rt.catalog' version 2; its images were not used. "
                                           r"To fix: upgrade the runtime: pip install -U aotriton-rt"):
        images_mod.find()


def test_an_image_wheel_without_its_record_is_refused(built_images: Path, site: Path, tmp_path: Path) -> None:
    _install(image_wheel(built_images, tmp_path / "dist", targets=["sm90"], set_name="full", version="0.1.0"), site)
    (site / "aotriton_rt_images_sm90_full" / "image-wheel.json").unlink()
    with pytest.raises(CatalogError, match=r"image wheel aotriton-rt-images-sm90-full 0.1.0: cannot read .*"
                                           r"image-wheel.json.*\(pip install --force-reinstall "
                                           r"aotriton-rt-images-sm90-full\)$"):
        images_mod.find()


def test_with_no_images_installed_the_search_says_where_it_looked(site: Path) -> None:
    from aotriton_rt.errors import ImageFolderNotFound

    with pytest.raises(ImageFolderNotFound, match="installed packages: no embedded images and no image wheels"):
        images_mod.find()


def test_normalizing_a_wheel_fixes_order_timestamps_and_record(tmp_path: Path) -> None:
    path = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x-1.0.dist-info/RECORD", "stale")
        zf.writestr("x-1.0.dist-info/METADATA", "Name: x\n")
        zf.writestr(zipfile.ZipInfo("x/b.py", (2001, 1, 1, 0, 0, 0)), "b")
        zf.writestr("x/a.py", "a")
    normalize_wheel(path)
    with zipfile.ZipFile(path) as zf:
        assert zf.namelist() == ["x/a.py", "x/b.py", "x-1.0.dist-info/METADATA", "x-1.0.dist-info/RECORD"]
        assert zf.read("x-1.0.dist-info/RECORD").decode().splitlines()[0] == \
            "x/a.py,sha256=ypeBEsobvcr6wjGzmiPcTaeG7_gUfE5yuYB3ha_uSLs,1"


@pytest.mark.slow
def test_the_runtime_wheel_embeds_the_images_and_builds_byte_identically(built_images: Path, tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    a = runtime_wheel(built_images, tmp_path / "a")
    b = runtime_wheel(built_images, tmp_path / "b")
    assert a.name == "aotriton_rt-0.1.0-py3-none-any.whl" and _sha(a) == _sha(b)
    with zipfile.ZipFile(a) as zf:
        names = set(zf.namelist())
        assert "shards" in json.loads(zf.read(f"aotriton_rt/images/{CATALOG_FILE}"))
        zf.extractall(tmp_path / "unzipped")
        embedded = Catalog.load(tmp_path / "unzipped" / "aotriton_rt" / "images")
    assert {f"aotriton_rt/images/{v.image.path}" for v in embedded.variants} <= names
    # CUDA variants carry their PTX too: aotriton_rt.jax hands it to jaxlib under jax.jit.
    ptx = {f"aotriton_rt/images/{v.ptx.path}" for v in embedded.variants if v.target.backend == "cuda"}
    assert ptx and ptx <= names
    assert embedded.variants == Catalog.load(built_images).variants
    assert {"aotriton_rt/sources.py", "builder/wheels.py", "builder/kernels/attention.py"} <= names
    # Installed, with no checkout on the path: the runtime finds the embedded images itself.
    site = tmp_path / "site"
    _install(a, site)
    env = {**{k: v for k, v in os.environ.items() if k not in ("AOTRITON_RT_IMAGES", "PYTHONPATH")},
           "PYTHONPATH": str(site), "AOTRITON_RT_CACHE": str(tmp_path / "no-cache")}
    probe = ("import aotriton_rt.images as i; f = i.find(); print(f.reason); "
             "import aotriton_rt; print(aotriton_rt.__file__)")
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {probe}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["embedded in aotriton-rt 0.1.0", str(site / "aotriton_rt" / "__init__.py")]


def test_a_runtime_wheel_needs_the_source_tree(tmp_path: Path) -> None:
    with pytest.raises(WheelError, match="is not the aotriton-rt source tree"):
        runtime_wheel(None, tmp_path / "dist", project=tmp_path)


def test_image_wheel_names_are_checked() -> None:
    assert wheels.dist_name(["gfx942", "sm90"], "Full") == "aotriton-rt-images-gfx942-sm90-full"
    with pytest.raises(WheelError, match="is not a valid distribution name"):
        wheels.dist_name(["sm90"], "my set")


def test_info_names_the_origin_of_an_explicit_folder_and_both_clis_print_their_version(built_images: Path) -> None:
    from aotriton_rt import __version__

    env = {k: v for k, v in os.environ.items() if k != "AOTRITON_RT_IMAGES"}
    run = lambda *a: subprocess.run([sys.executable, "-m", *a], cwd=ROOT, env=env, capture_output=True,
                                    text=True, check=True).stdout
    info = run("aotriton_rt", "info", "--images", str(built_images))
    assert f"  given explicitly: {built_images}\n" in info
    assert re.search(r"^    36 variants \(gfx1100 9, gfx942 9, sm80 9, sm90 9\), triton 3\.6\.0, digests OK$",
                     info, re.M)
    assert run("aotriton_rt", "--version") == f"aotriton-rt {__version__}\n"
    assert run("builder", "--version") == f"aotriton-rt builder {__version__}\n"


def test_the_image_extras_name_one_full_image_wheel_per_default_target_and_gfx1151_at_this_version() -> None:
    tomllib = pytest.importorskip("tomllib")
    from aotriton_rt import __version__
    from builder.targets import DEFAULT

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__
    extras = {k: v for k, v in project["optional-dependencies"].items() if k.startswith("images-")}
    # gfx1151 is not a default target (the runtime wheel does not embed it), so its extra is the
    # way to install its images.
    assert extras == {f"images-{t}-full": [f"{wheels.dist_name([t], 'full')}=={__version__}"]
                      for t in (*DEFAULT, "gfx1151")}


def test_a_checkouts_images_come_first_and_are_merged_with_installed_image_wheels(
        built_images: Path, site: Path, tmp_path: Path) -> None:
    import shutil

    checkout = tmp_path / "pkg" / "images"
    shutil.copytree(built_images, checkout)
    _install(image_wheel(built_images, tmp_path / "dist", targets=["sm90"], set_name="full", version="0.1.0"), site)
    found = images_mod.find()
    assert found.folders == [checkout, site / "aotriton_rt_images_sm90_full"]
    assert found.reason == "the source checkout's images/ folder + image wheel aotriton-rt-images-sm90-full 0.1.0"
