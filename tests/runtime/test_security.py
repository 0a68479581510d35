"""Regressions of the adversarial review (issue 9): a catalog is data, reads are bounded, and no
bad value reaches a driver or leaves the process in a poisoned state.

Download, install and CLI faults are in ``test_download.py`` / ``test_install_crash.py``; the
launch refusals that need a driver run against the fake HIP library in
``test_library.py``. This module covers what needs no driver.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import time
from pathlib import Path

import pytest

from aotriton_rt import images
from aotriton_rt.arguments import compile_expr, compile_grid, grid_limits
from aotriton_rt.catalog import Catalog
from aotriton_rt.errors import CatalogError, ImageError, ImageFolderNotFound, LaunchError
from aotriton_rt.library import Library
from tests.helpers.httpfaults import make_image_folder


def _folder(tmp_path: Path, edit=None) -> Path:
    folder = make_image_folder(tmp_path / "imgs", targets=(("cuda", "sm90", 32),), kernels=("add",))
    if edit is not None:
        cat = json.loads((folder / "catalog.json").read_text())
        edit(cat["variants"][0])
        (folder / "catalog.json").write_text(json.dumps(cat))
    return folder


# --------------------------------------------------------------------------- 1. catalog is never code


def test_argument_name_carrying_code_is_refused_at_load_and_never_runs(tmp_path):
    marker = tmp_path / "PWNED"
    attack = f"n=open({str(marker)!r}, 'w')"

    def edit(v):
        v["args"][1]["name"] = attack

    folder = _folder(tmp_path, edit)
    with pytest.raises(CatalogError, match=r"catalog\.json: \$\.variants\[0\]\.args\[1\]\.name must be a plain "
                                           r"identifier .* found \"n=open\("):
        Library(folder, backend="cuda").kernel("add").variant(0)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["__class__", "_private", "lambda", "stream", "grid", "self", "x" * 65, "1n",
                                  "n\u00e9", "n-1", ""])
def test_argument_names_must_be_plain_public_identifiers(tmp_path, name):
    folder = _folder(tmp_path, lambda v: v["args"][1].update(name=name))
    with pytest.raises(CatalogError, match=r"\$\.variants\[0\]\.args\[1\]\.name must be a plain identifier"):
        Catalog.load(folder)


def test_rules_are_compiled_from_our_tokens_only():
    f = compile_expr("cdiv(n, B) + 0x10", ["n"], {"B": 8}, "grid rule")
    assert f(17) == 3 + 16
    # A compile-time value is folded as a re-printed integer; a string value cannot be spliced in.
    with pytest.raises(CatalogError, match=r"compile-time value B = '1\)\+\(2' is not an integer"):
        compile_expr("n + B", ["n"], {"B": "1)+(2"}, "grid rule")


@pytest.mark.parametrize("text,message", [
    ("(" * 5000 + "n" + ")" * 5000, "nests too deeply|more than 200 parts|longer than 1000"),
    ("n+" * 400 + "n", "longer than 1000 characters|more than 200 parts"),
    ("min(n)", "min takes 2 to 8 arguments"),
    ("cdiv(n, 2, 3)", "cdiv takes 2 arguments"),
    ("cdiv(*n)", "cdiv takes 2 arguments"),
    ("n ** 99", "uses Pow"),
    ("n if n else 1", "uses IfExp"),
    ("[n]", "uses List"),
    ("(n, 1)", "uses Tuple"),
    ("2 ** 64", "uses Pow"),
    ("18446744073709551616 * n", "does not fit in 64 bits"),
])
def test_hostile_rules_are_refused_with_a_catalog_error(text, message):
    with pytest.raises(CatalogError, match=message):
        compile_expr(text, ["n"], {}, "grid rule")


def test_rule_dividing_by_zero_is_a_launch_error_naming_the_rule():
    f = compile_expr("cdiv(n, m)", ["n", "m"], {}, "grid rule of k")
    with pytest.raises(LaunchError, match=r"grid rule of k `cdiv\(n, m\)` divides by zero"):
        f(4, 0)
    g = compile_grid(["n % m", "1", "1"], ["n", "m"], {}, "grid rule of k", (10, 10, 10))
    with pytest.raises(LaunchError, match=r"divides by zero"):
        g(4, 0)


def test_rule_with_a_zero_compile_time_divisor_is_refused_at_catalog_load(tmp_path):
    folder = _folder(tmp_path, lambda v: v["config"]["constexprs"].update(BLOCK=0))
    with pytest.raises(CatalogError, match=r"\$\.variants\[0\]\.grid\[0\]: .*divides by a compile-time zero"):
        Library(folder, backend="cuda")


def test_bad_grid_rule_names_its_json_path(tmp_path):
    folder = _folder(tmp_path, lambda v: v.update(grid=["cdiv(n, BLOCK)", "__import__('os')", "1"]))
    with pytest.raises(CatalogError, match=r"\$\.variants\[0\]\.grid\[1\]: .*only cdiv, min and max may be called"):
        Catalog.load(folder)


@pytest.mark.parametrize("backend,threads,cluster,limits", [
    ("cuda", 128, (1, 1, 1), (2**31 - 1, 65535, 65535)),
    ("cuda", 128, (2, 1, 1), ((2**31 - 1) // 2, 65535, 65535)),
    ("hip", 256, (1, 1, 1), ((2**32 - 1) // 256, 65535, 65535)),
    ("hip", 1, (1, 1, 1), (2**31 - 1, 65535, 65535)),
])
def test_grid_limits_follow_each_driver(backend, threads, cluster, limits):
    assert grid_limits(backend, threads, cluster) == limits


def test_grid_rule_results_are_range_checked_before_any_driver_call():
    g = compile_grid(["cdiv(n, 1024)", "1", "1"], ["n"], {}, "grid rule of add", grid_limits("cuda", 128))
    assert g(2048) == (2, 1, 1)
    with pytest.raises(LaunchError, match=r"gives grid \(-1, 1, 1\) for these arguments"):
        g(-2000)
    with pytest.raises(LaunchError, match=r"gives grid \(4194304, 1, 1\)|gives grid"):
        g((2**32 + 2) * 1024)


# --------------------------------------------------------------------------- schema, JSON and file bounds


def test_hidden_arguments_missing_is_the_catalogs_fault(tmp_path):
    folder = _folder(tmp_path, lambda v: v.update(hidden_args=v["hidden_args"][:1]))
    with pytest.raises(CatalogError, match=r"\$\.variants\[0\]\.hidden_args must be the two scratch pointers"):
        Catalog.load(folder)


def test_absurd_argument_offset_is_refused_at_load(tmp_path):
    def edit(v):
        v["hidden_args"][1]["offset"] = 2**60
        v["param_size"] = 2**60 + 8
    with pytest.raises(CatalogError, match=r"hidden_args\[1\]\.offset must be an integer in \[0, 32764\]"):
        Catalog.load(_folder(tmp_path, edit))


def test_deeply_nested_catalog_is_a_catalog_error(tmp_path):
    (tmp_path / "catalog.json").write_text('{"schema": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(CatalogError, match="nested too deeply"):
        Catalog.load(tmp_path)


def test_non_utf8_catalog_is_a_catalog_error(tmp_path):
    (tmp_path / "catalog.json").write_bytes(b'{"schema": "\xff\xfe"}')
    with pytest.raises(CatalogError, match=r"not UTF-8 text \(byte 12\)"):
        Catalog.load(tmp_path)
    with pytest.raises(CatalogError, match="not UTF-8"):
        Library(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_catalog_or_image_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    folder = _folder(tmp_path)
    v = Catalog.load(folder).variants[0]
    image = folder / v.image.path
    image.unlink()
    os.mkfifo(image)
    with pytest.raises(ImageError, match="is not a regular file"):
        images.read_image(folder, v)
    (folder / "catalog.json").unlink()
    os.mkfifo(folder / "catalog.json")
    with pytest.raises(CatalogError, match="is not a regular file"):
        Catalog.load(folder / "catalog.json")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_image_linked_to_dev_zero_is_refused(tmp_path):
    folder = _folder(tmp_path)
    v = Catalog.load(folder).variants[0]
    image = folder / v.image.path
    image.unlink()
    image.symlink_to("/dev/zero")
    with pytest.raises(ImageError, match="is not a regular file"):
        images.read_image(folder, v)


def test_decompression_bomb_stops_at_raw_size(tmp_path):
    bomb = lzma.compress(bytes(256 << 20), format=lzma.FORMAT_XZ)  # ~40 KB that inflates to 256 MiB

    def edit(v):
        v["image"].update(sha256=hashlib.sha256(bomb).hexdigest(), size=len(bomb), raw_size=4096)

    folder = _folder(tmp_path, edit)
    v = Catalog.load(folder).variants[0]
    (folder / v.image.path).write_bytes(bomb)
    start = time.perf_counter()
    with pytest.raises(ImageError, match="decompresses to more than the catalog's raw_size of 4096 bytes"):
        images.read_image(folder, v)
    assert time.perf_counter() - start < 1.0


def test_image_of_another_size_than_the_catalog_says_is_refused_before_reading(tmp_path):
    folder = _folder(tmp_path)
    v = Catalog.load(folder).variants[0]
    with open(folder / v.image.path, "ab") as f:
        f.write(b"x")
    with pytest.raises(ImageError, match=rf"is {v.image.size + 1} bytes but the catalog says {v.image.size}"):
        images.read_image(folder, v)


# --------------------------------------------------------------------------- 6, 8. image search


def test_images_variable_naming_no_folder_is_an_error(monkeypatch):
    monkeypatch.setenv(images.ENV_IMAGES, os.pathsep)
    with pytest.raises(ImageFolderNotFound, match=r"AOTRITON_RT_IMAGES is set to ':', which names no folder"):
        images.find()


def test_no_home_folder_is_a_typed_error_naming_the_variable(monkeypatch):
    monkeypatch.delenv(images.ENV_CACHE, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(images, "_default_cache_root", no_home)
    with pytest.raises(ImageFolderNotFound, match=r"no per-user cache folder: .* set \$AOTRITON_RT_CACHE"):
        images.cache_root()


def test_path_longer_than_the_os_allows_is_not_a_crash(tmp_path):
    with pytest.raises(ImageFolderNotFound, match="is not an image folder"):
        images.find(tmp_path / ("x" * 5000))


# --------------------------------------------------------------------------- 7. no poisoned state


def test_interpreter_tests_skip_without_torch(monkeypatch):
    import importlib.util

    from tests.helpers.interpreter import require_interpreter

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(pytest.skip.Exception, match="interpreter tests need torch"):
        require_interpreter()
