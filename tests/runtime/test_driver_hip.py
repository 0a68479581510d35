"""The HIP driver against the fake libamdhip64, through ctypes and through hip-python.

In-process tests drive the ctypes backend (the fake reads its FAKEHIP_* settings at each
call, so monkeypatch.setenv reaches it). The end-to-end scenario runs each backend in its
own subprocess: hip-python opens its library once per process, by name.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from aotriton_rt.drivers.hip import (
    BACKEND_ENV,
    PROP_GCN_ARCH_NAME,
    PROP_NAME,
    PROP_SHARED_PER_BLOCK_OPTIN,
    PROP_SIZE,
    HipDriver,
)
from aotriton_rt.errors import (
    ArgumentError,
    DriverError,
    LaunchError,
    NoDevice,
    UnsupportedError,
)
from tests.fakehip import (
    build_fake_hip,
    fake_code_object,
    fake_hip_env,
    fnv1a64,
    read_log,
    triton_add_kernel,
)

ROOT = Path(__file__).resolve().parents[2]
HAVE_HIP_PYTHON = importlib.util.find_spec("hip") is not None
ADD_STRUCT = struct.Struct("@QQQiQQ")  # x, y, out, n, then Triton's two hidden scratch pointers


@pytest.fixture(scope="module")
def fake_hip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake runtime for this process, under a name no real discovery matches."""
    return build_fake_hip(tmp_path_factory.mktemp("fakehip"), "libfakeamdhip64.so")


@pytest.fixture(scope="module")
def fake_hip_std(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake runtime under the real name, for subprocesses."""
    return build_fake_hip(tmp_path_factory.mktemp("fakehip_std"))


@pytest.fixture()
def log(tmp_path: Path, fake_hip: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "hip.jsonl"
    for key, value in fake_hip_env(fake_hip, path).items():
        monkeypatch.setenv(key, value)
    return path


@pytest.fixture()
def driver(log: Path, fake_hip: Path) -> HipDriver:
    return HipDriver(environ={"AOTRITON_RT_HIP_LIB": str(fake_hip), BACKEND_ENV: "ctypes"})


def calls(log: Path, call: str) -> list[dict]:
    return [r for r in read_log(log) if r["call"] == call]


def loaded_add(driver: HipDriver, device: int = 0) -> int:
    module = driver.load_module(device, fake_code_object("gfx942", ["add_kernel", "mul_kernel"]))
    return driver.get_function(device, module, "add_kernel")


# ---------------------------------------------------------------------------- ctypes, in process

def test_ctypes_backend_reports_devices_arch_and_name(driver: HipDriver,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEHIP_DEVICES", "2")
    monkeypatch.setenv("FAKEHIP_ARCH", "gfx950:sramecc+:xnack-")
    monkeypatch.setenv("FAKEHIP_NAME", "AMD Instinct MI355X")
    assert driver.api_name == "ctypes"
    assert driver.device_count() == 2
    assert driver.device_arch(1) == "gfx950:sramecc+:xnack-"
    assert driver.device_name(1) == "AMD Instinct MI355X"
    assert driver.current_device() == 0


def test_load_module_on_another_device_restores_the_current_one(
        driver: HipDriver, log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEHIP_DEVICES", "2")
    image = fake_code_object("gfx942", ["add_kernel"])
    driver.load_module(1, image)
    (record,) = calls(log, "hipModuleLoadData")
    assert record["device"] == 1 and record["size"] == len(image)
    assert record["fnv1a64"] == fnv1a64(image) and record["head"] == image[:16]
    assert driver.current_device() == 0


def test_launcher_sends_the_packed_buffer_grid_block_shared_and_stream(driver: HipDriver,
                                                                      log: Path) -> None:
    function = loaded_add(driver)
    launch = driver.make_launcher(function, struct=ADD_STRUCT, num_threads=256, shared=2048)
    values = (0x7F00_0000_1000, 0x7F00_0000_2000, 0x7F00_0000_3000, 4097, 0, 0)
    launch(5, 3, 2, 0xBEEF, values)
    (record,) = calls(log, "hipModuleLaunchKernel")
    assert record["name"] == "add_kernel"
    assert record["grid"] == [5, 3, 2] and record["block"] == [256, 1, 1]
    assert record["shared"] == 2048 and record["stream"] == 0xBEEF
    assert record["args_size"] == ADD_STRUCT.size == 48
    assert record["args"] == ADD_STRUCT.pack(*values)


def test_launch_on_device_1_while_device_0_is_current_runs_with_device_1_current_and_restores_0(
        driver: HipDriver, log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEHIP_DEVICES", "2")
    driver._api.set_device(0)  # the fake's current device is per thread and outlives a test
    launch = driver.make_launcher(loaded_add(driver, device=1), struct=ADD_STRUCT, num_threads=64, shared=0)
    assert driver.current_device() == 0
    launch(2, 1, 1, 0, (1, 2, 3, 4, 0, 0))
    launch(2, 1, 1, 0, (1, 2, 3, 4, 0, 0))
    # the fake refuses a launch unless the function's device is current
    assert [(r["device"], r["module_device"]) for r in calls(log, "hipModuleLaunchKernel")] == [(1, 1), (1, 1)]
    assert driver.current_device() == 0
    # with device 1 current already, the launch does not touch the device (hipSetDevice would fail)
    driver._api.set_device(1)
    monkeypatch.setenv("FAKEHIP_FAIL", "hipSetDevice=101")
    launch(2, 1, 1, 0, (1, 2, 3, 4, 0, 0))
    assert len(calls(log, "hipModuleLaunchKernel")) == 3 and driver.current_device() == 1
    monkeypatch.delenv("FAKEHIP_FAIL")
    driver._api.set_device(0)


def test_a_failed_device_switch_is_reported_and_launches_nothing(
        driver: HipDriver, log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEHIP_DEVICES", "2")
    driver._api.set_device(0)  # the fake's current device is per thread and outlives a test
    launch = driver.make_launcher(loaded_add(driver, device=1), struct=ADD_STRUCT, num_threads=64, shared=0)
    monkeypatch.setenv("FAKEHIP_FAIL", "hipSetDevice=101")
    with pytest.raises(DriverError, match=r"^hipSetDevice\(1\) failed: hipErrorInvalidDevice \(101\)"):
        launch(2, 1, 1, 0, (1, 2, 3, 4, 0, 0))
    assert calls(log, "hipModuleLaunchKernel") == []
    assert driver.current_device() == 0


def test_launcher_skips_an_empty_grid_and_refuses_values_that_do_not_fit(driver: HipDriver,
                                                                         log: Path) -> None:
    launch = driver.make_launcher(loaded_add(driver), struct=ADD_STRUCT, num_threads=64, shared=0)
    launch(1, 0, 1, 0, (1, 2, 3, 4, 0, 0))
    assert calls(log, "hipModuleLaunchKernel") == []
    with pytest.raises(ArgumentError, match=r"cannot pack the 3 launch arguments of add_kernel "
                                            r"with format '@QQQiQQ'"):
        launch(1, 1, 1, 0, (1, 2, 3))


def test_concurrent_launches_never_mix_argument_buffers(driver: HipDriver, log: Path) -> None:
    launch = driver.make_launcher(loaded_add(driver), struct=ADD_STRUCT, num_threads=64, shared=0)
    sent = {ADD_STRUCT.pack(t, t, t, t, t, t) for t in range(8)}

    def worker(t: int) -> None:
        for _ in range(40):
            launch(1, 1, 1, t, (t, t, t, t, t, t))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    records = calls(log, "hipModuleLaunchKernel")
    assert len(records) == 320
    assert all(r["args"] in sent and r["args"] == ADD_STRUCT.pack(*[r["stream"]] * 6)
               for r in records)


def test_prepare_function_asks_for_lds_above_64_kib_where_the_device_has_it(
        driver: HipDriver, log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEHIP_ARCH", "gfx950:sramecc+:xnack-")
    monkeypatch.setenv("FAKEHIP_LDS", str(160 * 1024))
    module = driver.load_module(0, fake_code_object("gfx950", ["attn_fwd"]))
    function = driver.get_function(0, module, "attn_fwd")
    driver.prepare_function(function, 64 * 1024)  # the default limit: nothing to ask
    assert calls(log, "hipFuncSetAttribute") == []
    driver.prepare_function(function, 96 * 1024)
    assert [(r["name"], r["attr"], r["value"]) for r in calls(log, "hipFuncSetAttribute")] == \
        [("attn_fwd", 8, 96 * 1024)]


def test_prepare_function_refuses_more_lds_than_the_device_has(driver: HipDriver) -> None:
    with pytest.raises(LaunchError, match=r"kernel add_kernel needs 98304 bytes of LDS per "
                                          r"workgroup but device 0 \(Fake AMD Instinct, "
                                          r"gfx942:sramecc\+:xnack-\) allows at most 65536"):
        driver.prepare_function(loaded_add(driver), 96 * 1024)


def test_alloc_synchronize_and_capture_status(driver: HipDriver, log: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEHIP_DEVICES", "2")
    assert driver.alloc(1, 0) == 0
    ptr = driver.alloc(1, 4096)
    assert ptr % 256 == 0
    assert [(r["device"], r["size"], r["ptr"]) for r in calls(log, "hipMalloc")] == [(1, 4096, ptr)]
    driver.synchronize(1)
    assert [r["device"] for r in calls(log, "hipDeviceSynchronize")] == [1]
    assert driver.current_device() == 0
    monkeypatch.setenv("FAKEHIP_CAPTURING", f"{0x5000}")
    assert driver.is_capturing(0x5000) and not driver.is_capturing(0x5001)


def test_scratch_pool_over_hip_gives_each_stream_and_each_capture_its_own_buffer(
        driver: HipDriver, log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aotriton_rt.scratch import MAX_STREAMS, ScratchPool

    pool = ScratchPool(lambda: driver)
    seen: list[tuple[int, int]] = []

    def launch(gx: int, gy: int, gz: int, stream: int, values: tuple) -> None:
        seen.append((stream, values[-2]))

    for stream in (0x100, 0x200, 0x100):
        pool.launch(0, stream, 4096, launch, 1, 1, 1, ())
    monkeypatch.setenv("FAKEHIP_CAPTURING", f"{0x300}")
    pool.launch(0, 0x300, 4096, launch, 1, 1, 1, ())
    monkeypatch.delenv("FAKEHIP_CAPTURING")
    for stream in range(0x1000, 0x1000 + MAX_STREAMS + 4):
        pool.launch(0, stream, 4096, launch, 1, 1, 1, ())
    first = dict(seen[:4])
    assert len(set(first.values())) == 3 and first[0x100] == seen[2][1]
    assert first[0x300] not in [p for s, p in seen if s != 0x300]  # the graph's: never handed on
    assert [r["stream"] for r in calls(log, "hipEventRecord")][:2] == [0x200, 0x100]
    assert len(calls(log, "hipStreamWaitEvent")) >= 4
    assert pool.stats()["graphs"] == 1  # HIP names no graph: kept for the process


def test_image_for_another_arch_fails_with_the_drivers_name_and_an_arch_hint(
        driver: HipDriver) -> None:
    image = fake_code_object("gfx90a", ["add_kernel"])
    with pytest.raises(DriverError, match=(
            rf"^hipModuleLoadData\({len(image)} bytes, device 0\) failed: hipErrorNoBinaryForGpu "
            r"\(209\): no kernel image is available for execution on the device\. Hint: image "
            r"built for another arch: compare the catalog target with device_arch\(\)")) as info:
        driver.load_module(0, image)
    assert (info.value.code, info.value.name) == (209, "hipErrorNoBinaryForGpu")


def test_missing_symbol_fails_with_not_found(driver: HipDriver) -> None:
    module = driver.load_module(0, fake_code_object("gfx942", ["add_kernel"]))
    with pytest.raises(DriverError, match=r"^hipModuleGetFunction\('softmax_kernel'\) failed: "
                                          r"hipErrorNotFound \(500\): named symbol not found\. "
                                          r"Hint: the image has no kernel of that name"):
        driver.get_function(0, module, "softmax_kernel")


def test_launch_failure_names_the_kernel_grid_and_stream(driver: HipDriver,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    launch = driver.make_launcher(loaded_add(driver), struct=ADD_STRUCT, num_threads=1024,
                                  shared=0)
    monkeypatch.setenv("FAKEHIP_FAIL", "hipModuleLaunchKernel=701")
    with pytest.raises(DriverError, match=(
            r"^hipModuleLaunchKernel\(add_kernel, grid=\(2, 1, 1\), block=\(1024, 1, 1\), "
            r"shared=0, stream=0x10\) failed: hipErrorLaunchOutOfResources \(701\): too many "
            r"resources requested for launch\. Hint: the kernel needs more registers")):
        launch(2, 1, 1, 0x10, (1, 2, 3, 4, 0, 0))


def test_the_fake_rejects_a_cuda_style_extra_array_and_check_reports_it(
        driver: HipDriver) -> None:
    function = loaded_add(driver)
    buf = ctypes.create_string_buffer(8)
    size = ctypes.c_size_t(8)
    # CUDA ends `extra` with 0; HIP needs 3 (HIP_LAUNCH_PARAM_END)
    cuda_style = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
    status = driver._api.launch(function, 1, 1, 1, 64, 1, 1, 0, 0, None, cuda_style)
    with pytest.raises(DriverError, match=r"^hipModuleLaunchKernel failed: hipErrorInvalidValue "
                                          r"\(1\): invalid argument\.$"):
        driver.check(status, "hipModuleLaunchKernel")


def test_no_device_raises_no_device(driver: HipDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEHIP_DEVICES", "0")
    with pytest.raises(NoDevice, match=r"^hipGetDeviceCount failed: hipErrorNoDevice \(100\): no "
                                       r"ROCm-capable device is detected\. Hint: no AMD GPU is "
                                       r"visible: check `rocm-smi`"):
        driver.device_count()


def test_cooperative_pdl_and_cluster_launches_are_refused_on_hip(driver: HipDriver) -> None:
    function = loaded_add(driver)
    with pytest.raises(UnsupportedError, match=r"HIP launches support neither cooperative grids, "
                                               r"PDL nor clusters here \(asked: cooperative=True"):
        driver.make_launcher(function, struct=ADD_STRUCT, num_threads=64, shared=0,
                             cooperative=True)


# ---------------------------------------------------------------------------- backend selection

def test_an_unknown_backend_name_is_refused(fake_hip: Path) -> None:
    with pytest.raises(UnsupportedError, match=r"AOTRITON_RT_HIP_BACKEND='cython' names no HIP "
                                               r"backend; use 'hip-python' or 'ctypes'"):
        HipDriver(environ={"AOTRITON_RT_HIP_LIB": str(fake_hip), BACKEND_ENV: "cython"})


def test_forcing_hip_python_without_it_fails_and_says_how_to_fix(fake_hip: Path, log: Path) -> None:
    def no_hip_python() -> tuple[object, object]:
        raise ImportError("No module named 'hip'")

    with pytest.raises(DriverError, match=r"AOTRITON_RT_HIP_BACKEND=hip-python but hip-python "
                                          r"cannot be imported \(No module named 'hip'\): pip "
                                          r"install the hip-python release matching your ROCm, "
                                          r"or set AOTRITON_RT_HIP_BACKEND=ctypes"):
        HipDriver(environ={"AOTRITON_RT_HIP_LIB": str(fake_hip), BACKEND_ENV: "hip-python"},
                  importer=no_hip_python)
    fallback = HipDriver(environ={"AOTRITON_RT_HIP_LIB": str(fake_hip)}, importer=no_hip_python)
    assert fallback.api_name == "ctypes"


@pytest.mark.skipif(not HAVE_HIP_PYTHON, reason="hip-python is not installed")
def test_device_prop_offsets_match_hip_pythons_struct() -> None:
    from hip import hip

    props = hip.hipDeviceProp_t()
    assert props.c_sizeof() == PROP_SIZE
    base = props.as_c_void_p().value
    ctypes.memset(base, 0, PROP_SIZE)
    ctypes.memmove(base + PROP_NAME, b"marker name\0", 12)
    ctypes.memmove(base + PROP_GCN_ARCH_NAME, b"gfx1201\0", 8)
    ctypes.c_size_t.from_address(base + PROP_SHARED_PER_BLOCK_OPTIN).value = 0x1234_5678
    # hip-python 6.x/7.x read char arrays as bytes, 10.x as str.
    assert props.name in (b"marker name", "marker name")
    assert props.gcnArchName in (b"gfx1201", "gfx1201")
    assert props.sharedMemPerBlockOptin == 0x1234_5678


# ---------------------------------------------------------------------------- end to end, per backend

SCENARIO = r"""
import json, struct, sys
from aotriton_rt.drivers import get_driver
drv = get_driver("hip")
image = open(sys.argv[1], "rb").read()
symbol, num_warps, shared = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
module = drv.load_module(1, image)
function = drv.get_function(1, module, symbol)
drv.prepare_function(function, shared)
launch = drv.make_launcher(function, struct=struct.Struct("@QQQiQQ"), num_threads=64 * num_warps,
                           shared=shared)
scratch = drv.alloc(1, 1 << 16)
launch(977, 1, 1, 0x1234, (0x7000_0000_0000, 0x7000_0010_0000, 0x7000_0020_0000, 1_000_000,
                           scratch, 0))
errors = []
try:
    drv.get_function(1, module, "no_such_kernel")
except Exception as exc:
    errors.append(f"{type(exc).__name__}: {exc}")
from aotriton_rt.scratch import ScratchPool
pool, seen = ScratchPool(lambda: drv), []
for stream in (0x50, 0x60, 0x50, 0x1234):  # 0x1234 is capturing
    pool.launch(1, stream, 4096, lambda gx, gy, gz, s, v: seen.append(v[-2]), 1, 1, 1, ())
print(json.dumps({"api": drv.api_name, "count": drv.device_count(), "arch": drv.device_arch(1),
                  "name": drv.device_name(1), "current": drv.current_device(),
                  "capturing": drv.is_capturing(0x1234), "scratch": scratch, "errors": errors,
                  "library": drv.library_path, "pool": seen}))
"""


@pytest.fixture(scope="module")
def gfx942_add(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, int, int]:
    """add_kernel compiled by Triton for gfx942: a real code object to feed the fake."""
    pytest.importorskip("triton")
    directory = tmp_path_factory.mktemp("gfx942")
    kernel = triton_add_kernel("hip", "gfx942", 64, directory)
    path = directory / "add.hsaco"
    path.write_bytes(kernel.image)
    return path, kernel.symbol, kernel.num_warps, kernel.shared


@pytest.mark.parametrize("backend", [
    "ctypes",
    pytest.param("hip-python", marks=pytest.mark.skipif(
        not HAVE_HIP_PYTHON, reason="hip-python is not installed (pip install hip-python)")),
])
def test_a_triton_code_object_loads_and_launches_through_each_backend(
        backend: str, fake_hip_std: Path, tmp_path: Path,
        gfx942_add: tuple[Path, str, int, int]) -> None:
    image_path, symbol, num_warps, shared = gfx942_add
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, **fake_hip_env(fake_hip_std, log, devices=2, backend=backend,
                                        capturing=str(0x1234), name="AMD Instinct MI300X")}
    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(image_path), symbol,
                           str(num_warps), str(shared)],
                          env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["api"] == backend
    assert facts["library"] == str(fake_hip_std)
    assert (facts["count"], facts["current"]) == (2, 0)
    assert facts["arch"] == "gfx942:sramecc+:xnack-"
    assert facts["name"] == "AMD Instinct MI300X"
    assert facts["capturing"] is True
    assert facts["errors"] == [
        "DriverError: hipModuleGetFunction('no_such_kernel') failed: hipErrorNotFound (500): "
        "named symbol not found. Hint: the image has no kernel of that name: the catalog's "
        "symbol does not match the image."]
    image = image_path.read_bytes()
    (load,) = calls(log, "hipModuleLoadData")
    assert (load["device"], load["size"], load["fnv1a64"]) == (1, len(image), fnv1a64(image))
    (launch,) = calls(log, "hipModuleLaunchKernel")
    assert launch["name"] == symbol == "add_kernel"
    assert (launch["device"], launch["module_device"]) == (1, 1)  # launched with device 1 current
    assert launch["grid"] == [977, 1, 1] and launch["block"] == [64 * num_warps, 1, 1]
    assert launch["shared"] == shared and launch["stream"] == 0x1234
    assert launch["args"] == struct.pack("@QQQiQQ", 0x7000_0000_0000, 0x7000_0010_0000,
                                         0x7000_0020_0000, 1_000_000, facts["scratch"], 0)
    # The scratch pool through this backend: one buffer per stream, another for the capture.
    a, b, a2, captured = facts["pool"]
    assert a == a2 and len({a, b, captured}) == 3
    assert [r["size"] for r in calls(log, "hipMalloc")] == [1 << 16] + [(1 << 20) + 256] * 3
    assert [r["stream"] for r in calls(log, "hipEventRecord")] == [0x60, 0x50]
    assert len(calls(log, "hipEventCreateWithFlags")) == 2


DEFAULT = r"""
import json
from aotriton_rt.drivers import available_drivers, default_driver
from aotriton_rt.errors import NoDevice
try:
    print(json.dumps({"default": default_driver().backend,
                      "available": [d.backend for d in available_drivers()]}))
except NoDevice as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.mark.parametrize("devices", [1, 0])
def test_default_driver_falls_back_to_hip_and_explains_when_nothing_is_usable(
        devices: int, fake_hip_std: Path, tmp_path: Path) -> None:
    env = {**os.environ, **fake_hip_env(fake_hip_std, None, devices=devices, backend="ctypes"),
           "AOTRITON_RT_CUDA_LIB": str(tmp_path / "libcuda.so.1")}  # no CUDA, even on a GPU box
    proc = subprocess.run([sys.executable, "-c", DEFAULT], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=True)
    facts = json.loads(proc.stdout)
    if devices:
        assert facts == {"default": "hip", "available": ["hip"]}
        return
    lines = facts["error"].splitlines()
    assert lines[0] == "no GPU backend is usable:"
    assert lines[1].startswith("  - cuda: cannot load the CUDA driver library (libcuda) from "
                               "AOTRITON_RT_CUDA_LIB=")
    assert lines[2] == ("  - hip: hipGetDeviceCount failed: hipErrorNoDevice (100): no ROCm-capable "
                        "device is detected. Hint: no AMD GPU is visible: check `rocm-smi` and "
                        "HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES.")
    assert lines[3].startswith("Pass backend='cuda' or 'hip' to see the full error")
