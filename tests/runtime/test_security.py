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
import stat
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from aotriton_rt import images
from aotriton_rt.arguments import compile_expr, compile_grid, grid_limits
from aotriton_rt.catalog import Catalog
from aotriton_rt.errors import ArgumentError, CatalogError, ImageError, ImageFolderNotFound, LaunchError
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


# --------------------------------------------------------------------------- review of issue 25


def guarded(fn, timeout: float = 20.0) -> tuple[bool, dict]:
    """Run ``fn`` in a daemon thread: (whether it finished in time, {"value"|"error": ...}), so
    that a regression that blocks fails the test instead of hanging the session."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test to judge
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), box


def unblock(fifo: Path) -> None:
    """Release a reader stuck opening ``fifo`` (after a regression) by opening its write end."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.fixture
def jaxlib_triton(monkeypatch):
    pytest.importorskip("jax")
    from aotriton_rt.jax import jaxlib_triton as mod

    monkeypatch.setattr(mod, "_ptx_cache", {})
    monkeypatch.delenv("AOTRITON_RT_JAX_HSACO_DIR", raising=False)
    return mod


def _hip_variant():
    from tests.runtime.test_catalog import _catalog, _variant

    return Catalog.from_json(_catalog(_variant("hip", "gfx942"))).variants[0]


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")
@pytest.mark.parametrize("plant", ["symlink to another folder", "world-writable folder", "file"])
def test_hsaco_for_jaxlib_never_goes_where_another_user_could_have_planted_something(
        plant, jaxlib_triton, tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    old = tmp / f"aotriton-rt-jax-{os.getuid()}"  # the fixed name an attacker could create first
    victim = tmp_path / "victim"
    victim.mkdir()
    if plant == "symlink to another folder":
        old.symlink_to(victim)
    elif plant == "world-writable folder":
        old.mkdir()
        old.chmod(0o777)
    else:
        old.write_bytes(b"planted")
    raw = b"\x7fELF hsaco" * 100
    path = Path(jaxlib_triton.hsaco_file(raw, _hip_variant()))
    assert path.read_bytes() == raw
    assert path.parent != old and not os.path.realpath(path).startswith(str(victim))
    assert list(victim.iterdir()) == [] and (not old.is_dir() or list(old.iterdir()) == [])
    st = os.lstat(path.parent)
    assert stat.S_ISDIR(st.st_mode) and st.st_mode & 0o077 == 0 and st.st_uid == os.geteuid()
    assert stat.S_ISREG(os.lstat(path).st_mode) and os.lstat(path).st_mode & 0o077 == 0
    # One private folder per process, reused; each lowering gets a fresh file in it.
    again = Path(jaxlib_triton.hsaco_file(raw, _hip_variant()))
    assert again.parent == path.parent and again != path


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")
@pytest.mark.parametrize("plant", ["symlink", "world-writable", "file"])
def test_hsaco_folder_named_by_the_variable_must_be_a_private_folder(plant, jaxlib_triton, tmp_path,
                                                                     monkeypatch):
    given = tmp_path / "hsaco"
    if plant == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        given.symlink_to(tmp_path / "elsewhere")
    elif plant == "world-writable":
        given.mkdir()
        given.chmod(0o777)
    else:
        given.write_bytes(b"x")
    monkeypatch.setenv("AOTRITON_RT_JAX_HSACO_DIR", str(given))
    with pytest.raises(ImageError, match=r"AOTRITON_RT_JAX_HSACO_DIR=.*hsaco is not a private folder"):
        jaxlib_triton.hsaco_file(b"x", _hip_variant())
    assert not any((tmp_path / "elsewhere").glob("*")) if plant == "symlink" else True


def _ptx_folder(tmp_path: Path):
    folder = make_image_folder(tmp_path / "imgs", targets=(("cuda", "sm90", 32),), kernels=("add",), ptx=True)
    return folder, Catalog.load(folder).variants[0]


def test_ptx_is_read_digest_checked(jaxlib_triton, tmp_path):
    folder, v = _ptx_folder(tmp_path)
    assert jaxlib_triton.ptx_text(folder, v).startswith("// add sm90 0\n.version 8.0")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_ptx_that_is_a_fifo_is_refused_without_blocking(jaxlib_triton, tmp_path):
    folder, v = _ptx_folder(tmp_path)
    path = folder / v.ptx.path
    path.unlink()
    os.mkfifo(path)
    try:
        done, box = guarded(lambda: jaxlib_triton.ptx_text(folder, v), 10)
    finally:
        unblock(path)
    assert done, "reading the PTX blocked on a FIFO"
    assert isinstance(box.get("error"), ImageError) and "is not a regular file" in str(box["error"]), box


def test_oversized_ptx_is_refused_without_reading_it(jaxlib_triton, tmp_path):
    folder, v = _ptx_folder(tmp_path)
    path = folder / v.ptx.path
    os.truncate(path, 600 << 20)  # sparse: no disk is used, and reading it would allocate 600 MB
    tracemalloc.start()
    try:
        with pytest.raises(ImageError, match=rf"is {600 << 20} bytes but the catalog says {v.ptx.size}"):
            jaxlib_triton.ptx_text(folder, v)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_catalog_refuses_a_ptx_larger_than_max_ptx(tmp_path):
    from aotriton_rt.catalog import MAX_PTX

    folder, _ = _ptx_folder(tmp_path)
    cat = json.loads((folder / "catalog.json").read_text())
    cat["variants"][0]["ptx"]["raw_size"] = MAX_PTX + 1
    (folder / "catalog.json").write_text(json.dumps(cat))
    with pytest.raises(CatalogError, match=rf"\$\.variants\[0\]\.ptx\.raw_size must be an integer in "
                                           rf"\[1, {MAX_PTX}\]"):
        Catalog.load(folder)


def test_verify_checks_the_ptx_of_a_plain_image_folder(tmp_path):
    from aotriton_rt.download import verify_folder

    folder, v = _ptx_folder(tmp_path)
    assert verify_folder(folder).ok
    (folder / v.ptx.path).write_bytes(b"\0" * v.ptx.size)
    report = verify_folder(folder)
    assert not report.ok and any(v.ptx.path in p for p in report.problems), report.problems


class _CAI:
    def __init__(self, stream) -> None:
        self.stream = stream

    @property
    def __cuda_array_interface__(self) -> dict:
        cai = {"data": (0x7F0000000000, False), "shape": (4,), "typestr": "<f4", "version": 3}
        if self.stream is not _CAI:
            cai["stream"] = self.stream
        return cai


@pytest.mark.parametrize("backend,given,launched", [
    ("cuda", _CAI, 0), ("cuda", None, 0), ("cuda", 1, 1), ("cuda", 2, 2), ("cuda", 0xBEEF, 0xBEEF),
    ("cuda", 2**64 - 1, 2**64 - 1),
    ("hip", None, 0), ("hip", 1, 0), ("hip", 2, 2), ("hip", 0xBEEF, 0xBEEF),
])
def test_cai_stream_becomes_the_stream_the_driver_means(backend, given, launched):
    from aotriton_rt import launch

    obj = _CAI(given)
    assert launch._stream_getter(obj)(obj, 0, backend) == launched


class _CAIForSomeDtypes:
    """JAX's arrays: the interface is a property of the type that raises for bf16 buffers."""

    def __init__(self, bf16: bool) -> None:
        self.bf16 = bf16

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.bf16:
            raise AttributeError("__cuda_array_interface__ is not supported for BF16 buffers.")
        return {"data": (0x7F0000000000, False), "shape": (4,), "typestr": "<f4", "version": 3, "stream": 0xBEEF}


def test_an_array_whose_type_refuses_the_interface_for_its_dtype_launches_on_the_default_stream():
    from aotriton_rt import launch

    # The getter is decided once per type: whichever array of the type comes first.
    first, bf16 = _CAIForSomeDtypes(False), _CAIForSomeDtypes(True)
    getter = launch._stream_getter(first)
    assert getter(first, 0, "cuda") == 0xBEEF and getter(bf16, 0, "cuda") == 0


@pytest.mark.parametrize("given,message", [
    (0, "stream 0, which the protocol forbids"),
    (-1, r"stream -1, which is not a stream handle: it must be None, 1, 2 or a handle in \(2, 2\*\*64\)"),
    (2**64, r"stream 18446744073709551616, which is not a stream handle"),
    (2**70, r"stream 1180591620717411303424, which is not a stream handle"),
    (True, r"stream True \(bool\), which is not a stream handle"),
    (1.0, r"stream 1.0 \(float\), which is not a stream handle"),
    ("1", r"stream '1' \(str\), which is not a stream handle"),
])
def test_cai_stream_out_of_range_or_of_another_type_is_an_argument_error_naming_the_array(given, message):
    from aotriton_rt import launch

    obj = _CAI(given)
    for backend in ("cuda", "hip"):
        with pytest.raises(ArgumentError, match=r"^test_security\._CAI\.__cuda_array_interface__ has " + message):
            launch._stream_getter(obj)(obj, 0, backend)


@pytest.mark.parametrize("edit,arg,typ", [
    (lambda v: v.update(grid=["cdiv(x_ptr, BLOCK)", "1", "1"]), "x_ptr", r"\*fp32"),
    (lambda v: v["args"][1].update(type="fp32"), "n", "fp32"),
])
def test_grid_rule_over_a_float_or_pointer_argument_is_refused_at_load(edit, arg, typ, tmp_path):
    with pytest.raises(CatalogError, match=rf"\$\.variants\[0\]\.grid\[0\]: grid rule of add 'cdiv\({arg}, BLOCK\)' "
                                           rf"uses argument '{arg}' \({typ}\); a grid rule may use only integer "
                                           "scalar arguments and compile-time values"):
        Catalog.load(_folder(tmp_path, edit))


def test_grid_rules_may_still_use_float_or_pointer_arguments_in_checks(tmp_path):
    folder = _folder(tmp_path, lambda v: v.update(checks=["x_ptr % 16 == 0"]))
    assert Catalog.load(folder).variants[0].checks == ("x_ptr % 16 == 0",)


def test_grid_rule_results_must_be_plain_ints():
    limits = (10, 10, 10)
    g = compile_grid(["n > 0", "1", "1"], ["n"], {}, "grid rule of k", limits)
    with pytest.raises(LaunchError, match=r"grid rule of k \(n > 0, 1, 1\) gives grid \(True, 1, 1\)"):
        g(5)
    g = compile_grid(["n", "1", "1"], ["n"], {}, "grid rule of k", limits)
    with pytest.raises(LaunchError, match=r"gives grid \(2\.5, 1, 1\)"):
        g(2.5)
    assert g(3) == (3, 1, 1)
    with pytest.raises(CatalogError, match=r"grid rule of k 's' uses argument 's' \(fp32\)"):
        compile_grid(["s", "1", "1"], ["s"], {}, "grid rule of k", limits, types={"s": "fp32"})


def _wheel_folder(tmp_path: Path, info: bytes | None) -> Path:
    folder = tmp_path / "site" / "aotriton_rt_images_x"
    folder.mkdir(parents=True)
    if info is not None:
        (folder / "image-wheel.json").write_bytes(info)
    return folder


@pytest.mark.parametrize("info,message", [
    (b"[" * 30_000 + b"]" * 30_000, "nested too deeply"),
    (b"[" * 100_000 + b"]" * 100_000, r"is 200000 bytes, over the limit of 65536"),
    (b"\xff\xfe", r"not UTF-8 text"),
    (b'{"schema": "aotriton-rt.image-wheel", "catalog_schema": [1], "catalog_schema_version": {"a": 1}}',
     r"holds a catalog of schema \[1\] version \{'a': 1\}"),
    (b'"aotriton-rt.image-wheel"', "is not an aotriton-rt image-wheel record"),
])
def test_image_wheel_record_of_any_content_is_a_catalog_error_naming_the_wheel(info, message, tmp_path):
    from aotriton_rt import sources

    folder = _wheel_folder(tmp_path, info)
    with pytest.raises(CatalogError, match=r"^image wheel w 0\.1[: ].*" + message):
        sources.check_compatible(sources._read_info(folder, "w 0.1", "w"), "w 0.1")


def test_sparse_image_wheel_record_is_refused_without_reading_it(tmp_path):
    from aotriton_rt import sources

    folder = _wheel_folder(tmp_path, b"")
    os.truncate(folder / "image-wheel.json", 600 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(CatalogError, match=rf"is {600 << 20} bytes, over the limit of 65536"):
            sources._read_info(folder, "w 0.1", "w")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


class _Dist:
    version = "0.1.0"
    metadata = {"Name": "aotriton-rt-images-x"}

    def __init__(self, root: Path) -> None:
        self.root = root

    def locate_file(self, p: str) -> Path:
        return self.root / p


class _EntryPoint:
    name, value = "x", "aotriton_rt_images_x"

    def __init__(self, root: Path) -> None:
        self.dist = _Dist(root)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_image_wheel_record_that_is_a_fifo_fails_library_typed_without_blocking(tmp_path, monkeypatch):
    import importlib.metadata

    from aotriton_rt import sources

    folder = _wheel_folder(tmp_path, None)
    (folder / "catalog.json").write_text("{}")
    os.mkfifo(folder / "image-wheel.json")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [_EntryPoint(tmp_path / "site")])
    monkeypatch.delenv(images.ENV_IMAGES, raising=False)
    monkeypatch.setattr(images, "_HERE", tmp_path / "pkg" / "aotriton_rt")
    monkeypatch.setattr(sources, "embedded_folder", lambda: None)
    try:
        done, box = guarded(Library, 10)
    finally:
        unblock(folder / "image-wheel.json")
    assert done, "Library() blocked on a FIFO"
    assert isinstance(box.get("error"), CatalogError), box
    assert str(box["error"]).startswith("image wheel aotriton-rt-images-x 0.1.0: ")
    assert "image-wheel.json is not a regular file" in str(box["error"])
    assert "pip install --force-reinstall aotriton-rt-images-x" in str(box["error"])
