"""The fake libamdhip64 builds a launch's kernarg segment from the code object's metadata, the
way the HIP runtime does, so the differential tests compare what a GPU would read. These tests
pin that model: explicit arguments from kernelParams or from the `extra` buffer at their
metadata offsets, hidden arguments from the launch, and refusals a real runtime would give."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import msgpack
import pytest

from tests.fakehip import build_fake_hip, fake_code_object, fake_hip_env, read_log

METADATA = msgpack.packb({
    "amdhsa.version": [1, 2],
    "amdhsa.kernels": [{
        ".name": "k", ".symbol": "k.kd", ".kernarg_segment_size": 32, ".max_flat_workgroup_size": 256,
        ".group_segment_fixed_size": 1024, ".vgpr_count": 12, ".wavefront_size": 64,
        ".args": [
            {".offset": 0, ".size": 8, ".value_kind": "global_buffer", ".address_space": "global"},
            {".offset": 8, ".size": 4, ".value_kind": "by_value"},
            {".offset": 16, ".size": 4, ".value_kind": "hidden_block_count_x"},
            {".offset": 20, ".size": 2, ".value_kind": "hidden_group_size_x"},
            {".offset": 24, ".size": 4, ".value_kind": "hidden_dynamic_lds_size"},
        ]}],
})


@pytest.fixture()
def hip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ctypes.CDLL, Path]:
    lib = build_fake_hip(tmp_path, "libfakeamdhip64.so")
    log = tmp_path / "calls.jsonl"
    for key, value in fake_hip_env(lib, log).items():
        monkeypatch.setenv(key, value)
    return ctypes.CDLL(str(lib)), log


def _function(lib: ctypes.CDLL) -> ctypes.c_void_p:
    image = fake_code_object("gfx942", ["k"], METADATA)
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.hipModuleLoadData(ctypes.byref(module), image) == 0
    assert lib.hipModuleGetFunction(ctypes.byref(function), module, b"k") == 0
    return function


def _launch(lib: ctypes.CDLL, function, block: int, params=None, extra=None) -> int:
    lib.hipModuleLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    return lib.hipModuleLaunchKernel(function, 7, 1, 1, block, 1, 1, 512, 0x5000, params, extra)


EXPECTED = (struct.pack("<Qi4x", 0x7F00_0000_1000, -5) + struct.pack("<IH2xI4x", 7, 128, 512))


def test_kernel_params_land_at_their_metadata_offsets_and_hidden_args_come_from_the_launch(hip) -> None:
    lib, log = hip
    ptr, n = ctypes.c_uint64(0x7F00_0000_1000), ctypes.c_int32(-5)
    params = (ctypes.c_void_p * 2)(ctypes.addressof(ptr), ctypes.addressof(n))
    assert _launch(lib, _function(lib), 128, params=params) == 0
    (record,) = [r for r in read_log(log) if r["call"] == "hipModuleLaunchKernel"]
    assert record["via"] == "kernelParams"
    assert bytes.fromhex(record["kernarg"]) == EXPECTED


def test_an_extra_buffer_is_read_at_the_same_offsets_and_its_padding_ignored(hip) -> None:
    lib, log = hip
    buf = ctypes.create_string_buffer(struct.pack("<Qi", 0x7F00_0000_1000, -5) + b"\xee" * 4)
    size = ctypes.c_size_t(16)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 3)
    assert _launch(lib, _function(lib), 128, extra=extra) == 0
    (record,) = [r for r in read_log(log) if r["call"] == "hipModuleLaunchKernel"]
    assert record["via"] == "extra" and record["args_size"] == 16
    assert bytes.fromhex(record["kernarg"]) == EXPECTED


def test_an_extra_buffer_that_ends_before_an_argument_is_refused(hip) -> None:
    lib, log = hip
    buf = ctypes.create_string_buffer(8)
    size = ctypes.c_size_t(8)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 3)
    assert _launch(lib, _function(lib), 128, extra=extra) == 1  # hipErrorInvalidValue
    (record,) = [r for r in read_log(log) if r["call"] == "hipModuleLaunchKernel"]
    assert "ends before argument 1" in record["reason"]


def test_a_block_over_the_kernels_max_flat_workgroup_size_is_refused(hip) -> None:
    lib, log = hip
    ptr, n = ctypes.c_uint64(1), ctypes.c_int32(1)
    params = (ctypes.c_void_p * 2)(ctypes.addressof(ptr), ctypes.addressof(n))
    assert _launch(lib, _function(lib), 512, params=params) == 9  # hipErrorInvalidConfiguration


def test_get_proc_address_resolves_what_tritons_launcher_asks_for_and_nothing_else(hip) -> None:
    lib, _ = hip
    lib.hipGetProcAddress.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                      ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
    for name in (b"hipGetDeviceProperties", b"hipModuleLoadDataEx", b"hipModuleLaunchKernel",
                 b"hipPointerGetAttribute", b"hipFuncGetAttribute", b"hipGetLastError"):
        fn, status = ctypes.c_void_p(), ctypes.c_int(-1)
        assert lib.hipGetProcAddress(name, ctypes.byref(fn), 70200000, 0, ctypes.byref(status)) == 0
        assert fn.value and status.value == 0
    fn = ctypes.c_void_p()
    assert lib.hipGetProcAddress(b"hipNoSuchCall", ctypes.byref(fn), 70200000, 0, None) == 500
    assert fn.value is None
