"""`python -m builder pack`: image folder -> per-target (or per-family) bundles plus index.json,
byte-reproducible, refusing folders whose images do not match their catalog."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from aotriton_rt.catalog import Catalog, Target
from aotriton_rt.download import install_file, verify_folder
from aotriton_rt.errors import CatalogError, ImageError
from builder.__main__ import main as builder_main
from builder.bundle import bundle_name, family, pack
from tests.helpers.httpfaults import make_image_folder

ALL = (("hip", "gfx90a", 64), ("hip", "gfx942", 64), ("hip", "gfx950", 64), ("hip", "gfx1100", 32),
       ("hip", "gfx1201", 32), ("cuda", "sm80", 32), ("cuda", "sm90", 32))


@pytest.fixture
def folder(tmp_path) -> Path:
    return make_image_folder(tmp_path / "images", targets=ALL)


def sha_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pack_writes_one_bundle_per_target_and_an_index(folder, tmp_path):
    index = pack(folder, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "index.json").read_text()) == index
    assert {k: index[k] for k in ("schema", "schema_version", "bundle_schema_version", "catalog_schema_version",
                                  "triton_version", "grouping")} == {
        "schema": "aotriton-rt.bundle-index", "schema_version": 1, "bundle_schema_version": 1,
        "catalog_schema_version": 2, "triton_version": "3.6.0", "grouping": "target"}
    names = [b["name"] for b in index["bundles"]]
    assert names == ["cuda-sm80", "cuda-sm90", "hip-gfx1100", "hip-gfx1201", "hip-gfx90a", "hip-gfx942",
                     "hip-gfx950"]
    for b in index["bundles"]:
        path = tmp_path / "out" / b["file"]
        assert b["file"] == f"{b['name']}.tar" and b["variants"] == 2
        assert (b["size"], b["sha256"]) == (path.stat().st_size, sha_of(path))
        assert b["targets"] == [b["name"].split("-", 1)[1]] and b["backend"] == b["name"].split("-")[0]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([*(f"{n}.tar" for n in names),
                                                                           "index.json"])


def test_pack_by_family_groups_targets(folder, tmp_path):
    index = pack(folder, tmp_path / "out", by="family")
    got = {b["name"]: (b["targets"], b["variants"]) for b in index["bundles"]}
    assert got == {"cuda-sm8x": (["sm80"], 2), "cuda-sm9x": (["sm90"], 2),
                   "hip-gfx11x": (["gfx1100"], 2), "hip-gfx12x": (["gfx1201"], 2),
                   "hip-gfx9x": (["gfx90a", "gfx942", "gfx950"], 6)}
    assert index["grouping"] == "family"


def test_family_and_bundle_names():
    hip, cuda = (lambda a: Target("hip", a, 64)), (lambda a: Target("cuda", a, 32))
    assert [family(hip(a)) for a in ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1151", "gfx1201")] == [
        "gfx9x", "gfx9x", "gfx9x", "gfx11x", "gfx11x", "gfx12x"]
    assert [family(cuda(a)) for a in ("sm80", "sm86", "sm89", "sm90", "sm90a", "sm100")] == [
        "sm8x", "sm8x", "sm8x", "sm9x", "sm9x", "sm10x"]
    assert bundle_name(hip("gfx942")) == "hip-gfx942" and bundle_name(cuda("sm86"), "family") == "cuda-sm8x"
    with pytest.raises(ValueError, match="unknown grouping 'arch'; use one of target, family"):
        bundle_name(hip("gfx942"), "arch")


def test_pack_is_byte_reproducible(folder, tmp_path):
    first = pack(folder, tmp_path / "a")
    # Same content elsewhere, with other timestamps and permissions: the bytes must not change.
    moved = shutil.copytree(folder, tmp_path / "elsewhere" / "images")
    for i, p in enumerate(sorted(moved.rglob("*"))):
        if p.is_file():
            os.chmod(p, 0o600 if i % 2 else 0o664)
            os.utime(p, (1_700_000_000 + i, 1_700_000_000 + i))
    second = pack(moved, tmp_path / "b")
    assert first == second
    for name in [b["file"] for b in first["bundles"]] + ["index.json"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_bundle_members_are_ordered_with_fixed_metadata(folder, tmp_path):
    pack(folder, tmp_path / "out")
    with tarfile.open(tmp_path / "out" / "hip-gfx942.tar") as tar:
        members = tar.getmembers()
        manifest = json.loads(tar.extractfile("bundle.json").read())
        catalog_bytes = tar.extractfile("catalog.json").read()
    names = [m.name for m in members]
    assert names[:2] == ["bundle.json", "catalog.json"] and names[2:] == sorted(names[2:]) and len(names) == 4
    assert all(n.startswith("hip/gfx942/") for n in names[2:])
    assert {(m.type, m.mtime, m.mode, m.uid, m.gid, m.uname, m.gname) for m in members} == {
        (tarfile.REGTYPE, 946684800, 0o644, 0, 0, "", "")}
    assert manifest["name"] == "hip-gfx942" and manifest["targets"] == ["gfx942"]
    assert [f["path"] for f in manifest["files"]] == names[1:]
    assert manifest["files"][0]["sha256"] == hashlib.sha256(catalog_bytes).hexdigest()


def test_bundle_catalog_holds_only_its_targets_and_matching_digests(folder, tmp_path):
    pack(folder, tmp_path / "out", by="family")
    with tarfile.open(tmp_path / "out" / "hip-gfx9x.tar") as tar:
        catalog = Catalog.from_json(json.loads(tar.extractfile("catalog.json").read()))
        files = {f["path"]: f for f in json.loads(tar.extractfile("bundle.json").read())["files"]}
    assert sorted({v.target.arch for v in catalog.variants}) == ["gfx90a", "gfx942", "gfx950"]
    for v in catalog.variants:
        assert (files[v.image.path]["sha256"], files[v.image.path]["size"]) == (v.image.sha256, v.image.size)
        assert sha_of(folder / v.image.path) == v.image.sha256


def test_packed_bundle_installs_and_verifies(folder, tmp_path):
    pack(folder, tmp_path / "out")
    installed = install_file(tmp_path / "out" / "cuda-sm90.tar", dest=tmp_path / "cache")
    assert installed.targets == ("sm90",) and verify_folder(installed.path).ok


def test_pack_refuses_an_image_that_does_not_match_its_digest(folder, tmp_path):
    victim = next((folder / "hip" / "gfx942").rglob("*.xz"))
    data = victim.read_bytes()
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ImageError, match=rf"image .*{victim.name} does not match its sha256 in the catalog; "
                                         "rebuild the image folder before packing"):
        pack(folder, tmp_path / "out")
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "out").iterdir())
    assert not (tmp_path / "out" / "hip-gfx942.tar").exists()


def test_pack_refuses_a_missing_or_resized_image(folder, tmp_path):
    victim = next((folder / "cuda" / "sm90").rglob("*.xz"))
    victim.write_bytes(victim.read_bytes() + b"\0")
    with pytest.raises(ImageError, match=r"is \d+ bytes, the catalog says \d+"):
        pack(folder, tmp_path / "out")
    victim.unlink()
    with pytest.raises(ImageError, match=r"cannot read image .*No such file or directory; rebuild"):
        pack(folder, tmp_path / "out")


def test_pack_refuses_a_catalog_of_unknown_schema(folder, tmp_path):
    catalog = json.loads((folder / "catalog.json").read_text())
    catalog["schema_version"] = 3
    (folder / "catalog.json").write_text(json.dumps(catalog))
    with pytest.raises(CatalogError, match=r"catalog schema_version 3 is not understood"):
        pack(folder, tmp_path / "out")


def test_pack_refuses_an_empty_catalog(tmp_path):
    folder = make_image_folder(tmp_path / "images", targets=())
    with pytest.raises(CatalogError, match="no variants; nothing to pack"):
        pack(folder, tmp_path / "out")


def test_python_dash_m_builder_pack(folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert builder_main(["pack", "--images", str(folder), "--out", str(out), "--by", "family"]) == 0
    stdout = capsys.readouterr().out
    assert "hip-gfx9x.tar: 6 variants for gfx90a, gfx942, gfx950" in stdout
    assert f"wrote 5 bundles and index.json to {out}" in stdout
    assert builder_main(["pack", "--images", str(tmp_path / "nowhere"), "--out", str(out)]) == 1
    assert "error: cannot read catalog" in capsys.readouterr().err


def test_a_cuda_bundle_carries_and_installs_the_ptx_beside_each_cubin(built_images, tmp_path):
    pack(built_images, tmp_path / "out")
    installed = install_file(tmp_path / "out" / "cuda-sm90.tar", dest=tmp_path / "cache")
    catalog = Catalog.load(installed.path)
    assert catalog.variants and all(v.ptx is not None for v in catalog.variants)
    for v in catalog.variants:
        assert sha_of(installed.path / v.ptx.path) == v.ptx.sha256
    assert verify_folder(installed.path).ok
