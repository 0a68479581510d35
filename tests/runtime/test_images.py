"""Finding image folders along the documented order, and refusing corrupt images."""

import shutil

import pytest

from aotriton_rt import images
from aotriton_rt.catalog import Catalog
from aotriton_rt.errors import ImageError, ImageFolderNotFound


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv(images.ENV_IMAGES, raising=False)
    monkeypatch.setenv(images.ENV_CACHE, str(tmp_path / "cache"))
    # Hide the checkout's own images/ folder so the search goes on to the cache.
    monkeypatch.setattr(images, "_HERE", tmp_path / "pkg" / "aotriton_rt")
    # ...and any images embedded in an installed runtime (image wheels: none are installed here).
    from aotriton_rt import sources

    monkeypatch.setattr(sources, "embedded_folder", lambda: None)
    return tmp_path


def test_explicit_path_wins(built_images, clean_env):
    assert images.find(built_images).folders == [built_images]


def test_explicit_path_without_catalog_is_an_error(clean_env):
    with pytest.raises(ImageFolderNotFound, match="is not an image folder"):
        images.find(clean_env)


def test_environment_variable_is_used_and_may_list_several(built_images, clean_env, monkeypatch):
    other = clean_env / "copy"
    shutil.copytree(built_images, other)
    import os
    monkeypatch.setenv(images.ENV_IMAGES, f"{built_images}{os.pathsep}{other}")
    found = images.find()
    assert found.folders == [built_images, other] and "AOTRITON_RT_IMAGES" in found.reason


def test_download_cache_bundles_are_found_last(built_images, clean_env):
    shutil.copytree(built_images, clean_env / "cache" / "bundle-sm90")
    found = images.find()
    assert found.folders == [clean_env / "cache" / "bundle-sm90"]
    assert [why for _, why in found.tried] == ["not set", "no catalog.json", "no embedded images and no image wheels"]


def test_nothing_found_lists_every_place_and_the_fixes(clean_env):
    with pytest.raises(ImageFolderNotFound, match=r"(?s)no image folder found; looked at:.*"
                                                  r"AOTRITON_RT_IMAGES: not set.*python -m aotriton_rt download"):
        images.find()


def test_corrupt_image_is_never_returned(built_images, tmp_path):
    folder = tmp_path / "imgs"
    shutil.copytree(built_images, folder)
    cat = Catalog.load(folder)
    v = cat.variants[0]
    assert images.read_image(folder, v)[:4] == b"\x7fELF"
    path = folder / v.image.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ImageError, match=r"is corrupt: sha256 .* it was not loaded"):
        images.read_image(folder, v)


def test_missing_image_names_the_file(built_images, tmp_path):
    folder = tmp_path / "imgs"
    shutil.copytree(built_images, folder)
    v = Catalog.load(folder).variants[0]
    (folder / v.image.path).unlink()
    with pytest.raises(ImageError, match="cannot read image .*" + v.image.path.split("/")[-1]):
        images.read_image(folder, v)
