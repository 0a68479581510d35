"""The CUDA driver: against a fake libcuda on CPU, against cuda.h's layouts, and on a GPU.

The fake libcuda below (compiled with gcc at test time) models what the driver relies on:
per-thread current contexts and primary contexts, modules that hold kernels with a known
parameter layout, and launches that check the `extra` array or the kernelParams pointers
against that layout and log the bytes that arrived. Its "cubin" is a text image:
``FAKECUBIN sm90\\nkernel NAME SIZE,SIZE,...\\n``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from aotriton_rt.drivers import struct_field_offsets
from aotriton_rt.drivers._loader import LoadedLibrary
from aotriton_rt.drivers.cuda import CudaDriver, CudaLauncher, CUlaunchAttribute, CUlaunchConfig
from aotriton_rt.errors import ArgumentError, DriverError, LaunchError, LibraryNotFound, NoDevice
from tests.fakehip import triton_add_kernel
from tests.helpers.fake_driver import compile_shared

FAKE_CUDA_SOURCE = r"""
#define FAKE_LOG_ENV "FAKECUDA_LOG"
#define FAKE_FAIL_ENV "FAKECUDA_FAIL"
#include "fake_driver.h" /* tests/helpers: env_int, injected_failure, log_line */

typedef int CUresult;
#define MAXDEV 8
#define MAXPARAMS 32

typedef struct { int magic; int device; } Ctx;
typedef struct { int magic; Ctx *ctx; char *text; } Module;
typedef struct { int magic; Module *module; char name[128]; int nparams; int sizes[MAXPARAMS];
                 int max_dynamic_shared; int non_portable; } Function;
typedef struct { unsigned x, y, z, bx, by, bz, shared; void *stream; void *attrs;
                 unsigned nattrs; } Config;
typedef struct { int id; char pad[4]; union { char raw[64]; int i; unsigned dim[3]; } v; } Attr;

static Ctx primaries[MAXDEV];
static __thread Ctx *current = NULL;

static int ndev(void) { return env_int("FAKECUDA_DEVICES", 1); }

#define ENTER(name) do { int c_ = injected_failure(name); if (c_) return c_; } while (0)

static __thread int depth;
void fakecuda_reset(void) { current = NULL; depth = 0; memset(primaries, 0, sizeof primaries); }

static const struct { int code; const char *name, *text; } errs[] = {
  {0, "CUDA_SUCCESS", "no error"}, {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
  {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
  {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
  {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
  {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
  {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
  {209, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
  {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
  {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
};
CUresult cuGetErrorName(CUresult e, const char **s) {
  for (size_t i = 0; i < sizeof errs / sizeof *errs; i++) if (errs[i].code == e) { *s = errs[i].name; return 0; }
  *s = NULL; return 1;
}
CUresult cuGetErrorString(CUresult e, const char **s) {
  for (size_t i = 0; i < sizeof errs / sizeof *errs; i++) if (errs[i].code == e) { *s = errs[i].text; return 0; }
  *s = NULL; return 1;
}

CUresult cuInit(unsigned flags) { ENTER("cuInit"); return flags ? 1 : ndev() > 0 ? 0 : 100; }
CUresult cuDeviceGetCount(int *n) { ENTER("cuDeviceGetCount"); *n = ndev(); return 0; }
CUresult cuDeviceGet(int *d, int ordinal) {
  ENTER("cuDeviceGet"); if (ordinal < 0 || ordinal >= ndev()) return 101; *d = ordinal; return 0;
}
CUresult cuDeviceGetName(char *buf, int len, int d) {
  if (d < 0 || d >= ndev()) return 101; snprintf(buf, len, "Fake NVIDIA H200 #%d", d); return 0;
}
CUresult cuDeviceGetAttribute(int *v, int attr, int d) {
  if (d < 0 || d >= ndev()) return 101;
  int cc = env_int("FAKECUDA_CC", 90);
  switch (attr) {
    case 75: *v = cc / 10; return 0;
    case 76: *v = cc % 10; return 0;
    case 97: *v = env_int("FAKECUDA_SMEM_OPTIN", 232448); return 0;
  }
  return 1;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int d) {
  ENTER("cuDevicePrimaryCtxRetain");
  if (d < 0 || d >= ndev()) return 101;
  primaries[d].magic = 0xC7; primaries[d].device = d; *ctx = &primaries[d];
  log_line("{\"call\":\"cuDevicePrimaryCtxRetain\",\"device\":%d}", d);
  return 0;
}
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current; return 0; }
CUresult cuCtxSetCurrent(void *ctx) {
  Ctx *c = ctx; if (c && c->magic != 0xC7) return 201; current = c;
  log_line("{\"call\":\"cuCtxSetCurrent\",\"device\":%d}", c ? c->device : -1);
  return 0;
}
static __thread Ctx *pushed[16];
CUresult cuCtxPushCurrent_v2(void *ctx) {
  ENTER("cuCtxPushCurrent_v2"); Ctx *c = ctx; if (!c || c->magic != 0xC7) return 201; if (depth == 16) return 1;
  pushed[depth++] = current; current = c;
  log_line("{\"call\":\"cuCtxPushCurrent_v2\",\"device\":%d}", c->device);
  return 0;
}
CUresult cuCtxPopCurrent_v2(void **ctx) {
  if (!current || !depth) return 201; if (ctx) *ctx = current; current = pushed[--depth];
  log_line("{\"call\":\"cuCtxPopCurrent_v2\",\"device\":%d}", current ? current->device : -1);
  return 0;
}
CUresult cuCtxGetDevice(int *d) { if (!current) return 201; *d = current->device; return 0; }
CUresult cuCtxSynchronize(void) {
  if (!current) return 201; log_line("{\"call\":\"cuCtxSynchronize\",\"device\":%d}", current->device);
  return 0;
}

CUresult cuModuleLoadData(void **mod, const void *image) {
  ENTER("cuModuleLoadData");
  if (!current) return 201;
  const char *t = image;
  if (strncmp(t, "FAKECUBIN sm", 12)) return 200;
  if (atoi(t + 12) != env_int("FAKECUDA_CC", 90)) return 209;
  Module *m = calloc(1, sizeof *m); m->magic = 0x3D; m->ctx = current; m->text = strdup(t);
  log_line("{\"call\":\"cuModuleLoadData\",\"device\":%d,\"size\":%zu}", current->device, strlen(t) + 1);
  *mod = m; return 0;
}
CUresult cuModuleGetFunction(void **fn, void *mod, const char *name) {
  Module *m = mod; if (!m || m->magic != 0x3D) return 400;
  char key[160]; snprintf(key, sizeof key, "\nkernel %s ", name);
  const char *at = strstr(m->text, key); if (!at) return 500;
  Function *f = calloc(1, sizeof *f); f->magic = 0xF7; f->module = m;
  snprintf(f->name, sizeof f->name, "%s", name);
  const char *p = at + strlen(key);
  while (*p && *p != '\n' && f->nparams < MAXPARAMS) {
    f->sizes[f->nparams++] = (int)strtol(p, (char **)&p, 10); if (*p == ',') p++;
  }
  *fn = f; return 0;
}
CUresult cuFuncGetAttribute(int *value, int attr, void *fn) {
  ENTER("cuFuncGetAttribute");
  if (attr != 1) return 1;  /* only CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES */
  const char *s = getenv("FAKECUDA_STATIC_SMEM"); *value = s ? atoi(s) : 1024;
  return 0;
}
CUresult cuFuncSetAttribute(void *fn, int attr, int value) {
  Function *f = fn; if (!f || f->magic != 0xF7) return 400;
  if (attr == 8) { if (value > env_int("FAKECUDA_SMEM_OPTIN", 232448)) return 1; f->max_dynamic_shared = value; }
  else if (attr == 14) f->non_portable = value; else return 1;
  log_line("{\"call\":\"cuFuncSetAttribute\",\"name\":\"%s\",\"attr\":%d,\"value\":%d}", f->name, attr, value);
  return 0;
}

CUresult cuFuncSetCacheConfig(void *fn, int config) {
  Function *f = fn; if (!f || f->magic != 0xF7) return 400;
  log_line("{\"call\":\"cuFuncSetCacheConfig\",\"name\":\"%s\",\"config\":%d}", f->name, config);
  return 0;
}

/* Natural alignment of each parameter, as nvcc lays out a kernel's parameter buffer. */
static size_t layout(const Function *f, size_t *offsets) {
  size_t at = 0;
  for (int i = 0; i < f->nparams; i++) {
    size_t a = f->sizes[i] >= 8 ? 8 : f->sizes[i];
    at = (at + a - 1) / a * a; offsets[i] = at; at += f->sizes[i];
  }
  return at;
}
static void hexify(char *out, const unsigned char *p, size_t n) {
  for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", p[i]); out[2 * n] = 0;
}
static int check_launch(Function *f, unsigned bx, unsigned by, unsigned bz, unsigned shared) {
  if (!f || f->magic != 0xF7) return 400;
  if (!current) return 201;
  if (current != f->module->ctx) return 400;
  if ((unsigned long long)bx * by * bz > 1024) return 1;
  if (shared > 49152 && (int)shared > f->max_dynamic_shared) return 1;
  return 0;
}
CUresult cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
  ENTER("cuLaunchKernel");
  Function *f = fn; int rc = check_launch(f, bx, by, bz, shared); if (rc) return rc;
  size_t offsets[MAXPARAMS], size = layout(f, offsets);
  unsigned char pbuf[4096] = {0}; const void *args; const char *mode;
  if (params && !extra) {  /* kernelParams: one pointer per parameter */
    for (int i = 0; i < f->nparams; i++) memcpy(pbuf + offsets[i], params[i], f->sizes[i]);
    args = pbuf; mode = "params";
  } else if (!params && extra && (uintptr_t)extra[0] == 1 && (uintptr_t)extra[2] == 2 && extra[3] &&
             (uintptr_t)extra[4] == 0 && *(size_t *)extra[3] == size) {
    args = extra[1]; mode = "extra";
  } else return 1;
  char hex[8192]; hexify(hex, args, size);
  log_line("{\"call\":\"cuLaunchKernel\",\"device\":%d,\"name\":\"%s\",\"grid\":[%u,%u,%u],\"block\":[%u,%u,%u],"
        "\"shared\":%u,\"stream\":%llu,\"mode\":\"%s\",\"args\":\"%s\"}", current->device, f->name,
        gx, gy, gz, bx, by, bz, shared, (unsigned long long)(uintptr_t)stream, mode, hex);
  return 0;
}
CUresult cuLaunchKernelEx(const Config *c, void *fn, void **params, void **extra) {
  ENTER("cuLaunchKernelEx");
  Function *f = fn; int rc = check_launch(f, c->bx, c->by, c->bz, c->shared); if (rc) return rc;
  if (!params || extra) return 1;
  size_t offsets[MAXPARAMS], size = layout(f, offsets);
  unsigned char buf[4096] = {0};
  for (int i = 0; i < f->nparams; i++) memcpy(buf + offsets[i], params[i], f->sizes[i]);
  char hex[8192]; hexify(hex, buf, size);
  char attrs[1024] = ""; size_t used = 0; const Attr *a = c->attrs;
  for (unsigned i = 0; i < c->nattrs; i++)
    used += snprintf(attrs + used, sizeof attrs - used, "%s[%d,%u,%u,%u]", i ? "," : "", a[i].id,
                     a[i].v.dim[0], a[i].v.dim[1], a[i].v.dim[2]);
  log_line("{\"call\":\"cuLaunchKernelEx\",\"device\":%d,\"name\":\"%s\",\"grid\":[%u,%u,%u],\"block\":[%u,%u,%u],"
        "\"shared\":%u,\"stream\":%llu,\"attrs\":[%s],\"args\":\"%s\"}", current->device, f->name, c->x, c->y, c->z,
        c->bx, c->by, c->bz, c->shared, (unsigned long long)(uintptr_t)c->stream, attrs, hex);
  return 0;
}
CUresult cuMemAlloc_v2(unsigned long long *p, size_t n) {
  ENTER("cuMemAlloc_v2");
  if (!current) return 201; if (!n) return 1;
  void *m = NULL; if (posix_memalign(&m, 256, n)) return 2;
  *p = (unsigned long long)(uintptr_t)m;
  log_line("{\"call\":\"cuMemAlloc_v2\",\"device\":%d,\"size\":%zu}", current->device, n);
  return 0;
}
CUresult cuStreamIsCapturing(void *stream, int *status) {
  const char *s = getenv("FAKECUDA_CAPTURING");
  *status = s && *s && strtoull(s, NULL, 10) == (unsigned long long)(uintptr_t)stream;
  return 0;
}
"""

def _triton_cuda_h() -> Path | None:
    # triton ships cuda.h with its NVIDIA backend; find it without importing triton.
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "backends" / "nvidia" / "include" / "cuda.h"
    return path if path.exists() else None


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the fake libcuda")
    directory = tmp_path_factory.mktemp("fakecuda")
    source = directory / "fake_cuda.c"
    source.write_text(FAKE_CUDA_SOURCE)
    # Not "libcuda.so.1": loaded into this process under the real name, the fake would be
    # found by later discovery here (/proc/self/maps, dlopen by soname).
    return compile_shared(source, directory / "libfakecuda.so", "libfakecuda.so")


@pytest.fixture()
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cuda.jsonl"
    monkeypatch.setenv("FAKECUDA_LOG", str(path))
    for var in ("FAKECUDA_DEVICES", "FAKECUDA_CC", "FAKECUDA_SMEM_OPTIN", "FAKECUDA_FAIL",
                "FAKECUDA_CAPTURING"):
        monkeypatch.delenv(var, raising=False)
    return path


@pytest.fixture()
def driver(fake_libcuda: Path, log: Path) -> CudaDriver:
    handle = ctypes.CDLL(str(fake_libcuda))
    handle.fakecuda_reset()  # the fake's state is per process: start each test clean
    return CudaDriver(LoadedLibrary(handle, str(fake_libcuda), "test"))


def records(log: Path, call: str | None = None) -> list[dict]:
    if not log.exists():
        return []
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in rows if call is None or r["call"] == call]


def cubin(*kernels: tuple[str, list[int]], arch: str = "sm90") -> bytes:
    lines = [f"FAKECUBIN {arch}"] + [f"kernel {n} {','.join(map(str, s))}" for n, s in kernels]
    return ("\n".join(lines) + "\n").encode() + b"\0"


ADD = ("add_kernel", [8, 8, 8, 4, 8, 8])  # three pointers, n, two scratch pointers
ADD_STRUCT = struct.Struct("@QQQiQQ")      # native alignment pads n to 8 like nvcc
ADD_VALUES = (0x1000, 0x2000, 0x3000, 98765, 0, 0)


# ---------------------------------------------------------------------------- CPU: fake libcuda

def test_cuda_driver_reports_devices_arch_and_name(driver: CudaDriver,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKECUDA_DEVICES", "2")
    monkeypatch.setenv("FAKECUDA_CC", "80")
    assert driver.device_count() == 2
    assert driver.device_arch(1) == "sm80"
    assert driver.device_name(1) == "Fake NVIDIA H200 #1"


def test_current_device_is_zero_without_a_context_and_follows_the_current_one(
        driver: CudaDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKECUDA_DEVICES", "2")
    assert driver.current_device() == 0
    driver.load_module(1, cubin(ADD))  # binds device 1's primary context: none was current
    assert driver.current_device() == 1


def test_load_module_uses_the_devices_primary_context_and_restores_the_callers(
        driver: CudaDriver, log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKECUDA_DEVICES", "2")
    driver.load_module(0, cubin(ADD))
    driver.load_module(1, cubin(ADD))
    assert [r["device"] for r in records(log, "cuModuleLoadData")] == [0, 1]
    # device 0's context stays current for the caller; device 1's was pushed and popped
    assert [r["device"] for r in records(log, "cuCtxSetCurrent")] == [0, 1, 0]
    assert driver.current_device() == 0


@pytest.mark.parametrize("mode", ["params", "extra"])
def test_launcher_passes_the_packed_buffer(fake_libcuda: Path, log: Path, monkeypatch, mode: str) -> None:
    handle = ctypes.CDLL(str(fake_libcuda))
    handle.fakecuda_reset()
    driver = CudaDriver(LoadedLibrary(handle, str(fake_libcuda), "test"))
    module = driver.load_module(0, cubin(ADD))
    function = driver.get_function(0, module, "add_kernel")
    launch = driver.make_launcher(function, struct=ADD_STRUCT, num_threads=128, shared=4096)
    if mode == "extra":  # the mode bench/launch_overhead.py compares, made as it makes it
        launch = CudaLauncher(driver, function, "add_kernel", 0, ADD_STRUCT, 128, 4096, mode)
    launch(7, 2, 1, 0xABC, ADD_VALUES)
    (record,) = records(log, "cuLaunchKernel")
    assert record["grid"] == [7, 2, 1] and record["block"] == [128, 1, 1]
    assert record["shared"] == 4096 and record["stream"] == 0xABC and record["mode"] == mode
    assert bytes.fromhex(record["args"]) == ADD_STRUCT.pack(*ADD_VALUES)


def test_launcher_skips_an_empty_grid(driver: CudaDriver, log: Path) -> None:
    function = driver.get_function(0, driver.load_module(0, cubin(ADD)), "add_kernel")
    launch = driver.make_launcher(function, struct=ADD_STRUCT, num_threads=128, shared=0)
    launch(0, 1, 1, 0, ADD_VALUES)
    assert records(log, "cuLaunchKernel") == []


def test_launcher_refuses_values_that_do_not_fit_its_struct(driver: CudaDriver) -> None:
    function = driver.get_function(0, driver.load_module(0, cubin(ADD)), "add_kernel")
    launch = driver.make_launcher(function, struct=ADD_STRUCT, num_threads=128, shared=0)
    with pytest.raises(ArgumentError, match=r"cannot pack the 2 launch arguments of add_kernel "
                                            r"with format '@QQQiQQ'"):
        launch(1, 1, 1, 0, (1, 2))


def test_launch_from_a_thread_without_context_binds_the_primary_context_and_keeps_it(
        driver: CudaDriver, log: Path) -> None:
    function = driver.get_function(0, driver.load_module(0, cubin(ADD)), "add_kernel")
    launch = driver.make_launcher(function, struct=ADD_STRUCT, num_threads=64, shared=0)
    errors: list[BaseException] = []
    after: list[int] = []

    def worker() -> None:
        try:
            launch(3, 1, 1, 0, ADD_VALUES)
            after.append(driver.current_device() if driver._current_context() is not None else -1)
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert errors == []
    assert [r["device"] for r in records(log, "cuLaunchKernel")] == [0]
    assert after == [0]  # as the CUDA runtime does, the thread keeps the context it was given
    assert records(log, "cuCtxPushCurrent_v2") == []


@pytest.mark.parametrize("extended", [False, True], ids=["cuLaunchKernel", "cuLaunchKernelEx"])
def test_launch_on_device_1_while_device_0_is_current_runs_in_device_1s_context_and_restores_0(
        driver: CudaDriver, log: Path, monkeypatch: pytest.MonkeyPatch, extended: bool) -> None:
    monkeypatch.setenv("FAKECUDA_DEVICES", "2")
    driver.load_module(0, cubin(ADD))  # the caller works on device 0 (its context is current)
    function = driver.get_function(1, driver.load_module(1, cubin(ADD)), "add_kernel")
    launch = driver.make_launcher(function, struct=ADD_STRUCT, num_threads=64, shared=0, cooperative=extended)
    call = "cuLaunchKernelEx" if extended else "cuLaunchKernel"
    assert driver.current_device() == 0
    launch(2, 1, 1, 0, ADD_VALUES)
    launch(2, 1, 1, 0, ADD_VALUES)
    # the fake refuses (400) a launch whose function is not in the current context
    assert [r["device"] for r in records(log, call)] == [1, 1]
    assert [r["device"] for r in records(log, "cuCtxPushCurrent_v2")] == [1, 1]
    assert [r["device"] for r in records(log, "cuCtxPopCurrent_v2")] == [0, 0]
    assert driver.current_device() == 0
    # with device 1 current already, a launch does no context work (the common path)
    driver._cuCtxSetCurrent(driver._primary_context(1))
    launch(2, 1, 1, 0, ADD_VALUES)
    assert len(records(log, "cuCtxPushCurrent_v2")) == 2 and len(records(log, call)) == 3
    assert driver.current_device() == 1


def test_a_failed_context_switch_is_reported_and_launches_nothing(
        driver: CudaDriver, log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKECUDA_DEVICES", "2")
    driver.load_module(0, cubin(ADD))
    function = driver.get_function(1, driver.load_module(1, cubin(ADD)), "add_kernel")
    launch = driver.make_launcher(function, struct=ADD_STRUCT, num_threads=64, shared=0)
    monkeypatch.setenv("FAKECUDA_FAIL", "cuCtxPushCurrent_v2=201")
    with pytest.raises(DriverError, match=r"^cuCtxPushCurrent\(device 1\) failed: CUDA_ERROR_INVALID_CONTEXT"):
        launch(2, 1, 1, 0, ADD_VALUES)
    assert records(log, "cuLaunchKernel") == []
    assert driver.current_device() == 0


def test_cooperative_cluster_and_pdl_launches_use_launch_kernel_ex(driver: CudaDriver,
                                                                   log: Path) -> None:
    function = driver.get_function(0, driver.load_module(0, cubin(ADD)), "add_kernel")
    launch = driver.make_launcher(function, struct=ADD_STRUCT, num_threads=256, shared=1024,
                                  cooperative=True, pdl=True, cluster_dims=(2, 1, 1))
    launch(5, 3, 1, 0x55, ADD_VALUES)
    (record,) = records(log, "cuLaunchKernelEx")
    assert record["grid"] == [10, 3, 1]  # the grid counts clusters of 2 blocks along x
    assert record["block"] == [256, 1, 1] and record["shared"] == 1024
    assert record["stream"] == 0x55
    # PDL (6), cooperative (2), cluster dims (4), cluster scheduling policy SPREAD (5)
    assert record["attrs"] == [[6, 1, 0, 0], [2, 1, 0, 0], [4, 2, 1, 1], [5, 1, 0, 0]]
    # kernelParams pointed into the packed buffer at each parameter's offset
    assert bytes.fromhex(record["args"]) == ADD_STRUCT.pack(*ADD_VALUES)


def test_pdl_variants_launch_plainly_when_pdl_is_turned_off_for_measuring(
        fake_libcuda: Path, log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AOTRITON_RT_CUDA_PDL", "off")
    handle = ctypes.CDLL(str(fake_libcuda))
    handle.fakecuda_reset()
    driver = CudaDriver(LoadedLibrary(handle, str(fake_libcuda), "test"))
    function = driver.get_function(0, driver.load_module(0, cubin(ADD)), "add_kernel")
    driver.make_launcher(function, struct=ADD_STRUCT, num_threads=64, shared=0, pdl=True)(2, 1, 1, 0x55, ADD_VALUES)
    driver.make_launcher(function, struct=ADD_STRUCT, num_threads=64, shared=0, pdl=True,
                         cooperative=True)(2, 1, 1, 0x55, ADD_VALUES)
    assert [r["grid"] for r in records(log, "cuLaunchKernel")] == [[2, 1, 1]]
    (ex,) = records(log, "cuLaunchKernelEx")
    assert ex["attrs"] == [[2, 1, 0, 0]]  # cooperative only: no PDL attribute


def test_large_clusters_opt_in_to_non_portable_sizes(driver: CudaDriver, log: Path) -> None:
    function = driver.get_function(0, driver.load_module(0, cubin(ADD)), "add_kernel")
    driver.make_launcher(function, struct=ADD_STRUCT, num_threads=128, shared=0,
                         cluster_dims=(16, 1, 1))
    assert records(log, "cuFuncSetAttribute") == [
        {"call": "cuFuncSetAttribute", "name": "add_kernel", "attr": 14, "value": 1}]


def test_prepare_function_opts_in_to_shared_memory_above_48_kib(driver: CudaDriver,
                                                                log: Path) -> None:
    function = driver.get_function(0, driver.load_module(0, cubin(ADD)), "add_kernel")
    driver.prepare_function(function, 48 * 1024)  # at the limit: nothing to do
    assert records(log, "cuFuncSetAttribute") == [] and records(log, "cuFuncSetCacheConfig") == []
    driver.prepare_function(function, 100_000)
    assert records(log, "cuFuncSetAttribute") == [
        {"call": "cuFuncSetAttribute", "name": "add_kernel", "attr": 8, "value": 100_000}]
    # As Triton's loader does for kernels past 48 KiB: shared memory preferred over L1.
    assert records(log, "cuFuncSetCacheConfig") == [
        {"call": "cuFuncSetCacheConfig", "name": "add_kernel", "config": 1}]
    launch = driver.make_launcher(function, struct=ADD_STRUCT, num_threads=128, shared=100_000)
    launch(1, 1, 1, 0, ADD_VALUES)  # the fake refuses > 48 KiB without the opt-in
    assert records(log, "cuLaunchKernel")[0]["shared"] == 100_000


def test_prepare_function_refuses_more_shared_memory_than_the_device_has(
        driver: CudaDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKECUDA_SMEM_OPTIN", "101376")
    monkeypatch.setenv("FAKECUDA_CC", "86")
    function = driver.get_function(0, driver.load_module(0, cubin(ADD, arch="sm86")),
                                   "add_kernel")
    with pytest.raises(LaunchError, match=r"kernel add_kernel needs 200000 \+ 1024 \(static\) bytes of shared "
                                          r"memory per block but device 0 \(Fake NVIDIA H200 #0, sm86\) "
                                          r"allows at most 101376"):
        driver.prepare_function(function, 200_000)
    # The static part counts: dynamic alone would fit, dynamic + static does not.
    with pytest.raises(LaunchError, match=r"needs 100800 \+ 1024 \(static\)"):
        driver.prepare_function(function, 100_800)


def test_alloc_synchronize_and_capture_status(driver: CudaDriver, log: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert driver.alloc(0, 0) == 0
    ptr = driver.alloc(0, 1 << 20)
    assert ptr % 256 == 0 and records(log, "cuMemAlloc_v2") == [
        {"call": "cuMemAlloc_v2", "device": 0, "size": 1 << 20}]
    driver.synchronize(0)
    assert records(log, "cuCtxSynchronize") == [{"call": "cuCtxSynchronize", "device": 0}]
    monkeypatch.setenv("FAKECUDA_CAPTURING", str(0x77))
    assert driver.is_capturing(0x77) and not driver.is_capturing(0x78)


def test_check_names_the_call_the_code_the_drivers_strings_and_an_arch_hint(
        driver: CudaDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKECUDA_CC", "80")
    image = cubin(ADD, arch="sm90")
    with pytest.raises(DriverError, match=(
            r"^cuModuleLoadData\(\d+ bytes, device 0\) failed: CUDA_ERROR_NO_BINARY_FOR_GPU "
            r"\(209\): no kernel image is available for execution on the device\. "
            r"Hint: image built for another arch")) as info:
        driver.load_module(0, cubin(ADD, arch="sm90"))
    assert (info.value.call, info.value.code) == (f"cuModuleLoadData({len(image)} bytes, device 0)", 209)
    assert info.value.name == "CUDA_ERROR_NO_BINARY_FOR_GPU"


def test_check_hints_at_making_a_context_current(driver: CudaDriver) -> None:
    with pytest.raises(DriverError, match=r"^cuCtxSynchronize failed: CUDA_ERROR_INVALID_CONTEXT "
                                          r"\(201\): invalid device context\. Hint: make a "
                                          r"context current: e\.g\. import torch and touch the "
                                          r"device"):
        driver.check(driver._cuCtxSynchronize(), "cuCtxSynchronize")


def test_check_reports_a_missing_symbol_and_an_unknown_code(driver: CudaDriver) -> None:
    module = driver.load_module(0, cubin(ADD))
    with pytest.raises(DriverError, match=r"^cuModuleGetFunction\('mul_kernel'\) failed: "
                                          r"CUDA_ERROR_NOT_FOUND \(500\): named symbol not found"):
        driver.get_function(0, module, "mul_kernel")
    with pytest.raises(DriverError, match=r"^cuFoo failed: unknown error \(12345\)\.$"):
        driver.check(12345, "cuFoo")


def test_launch_failure_names_the_kernel_grid_and_stream(driver: CudaDriver,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    function = driver.get_function(0, driver.load_module(0, cubin(ADD)), "add_kernel")
    launch = driver.make_launcher(function, struct=ADD_STRUCT, num_threads=128, shared=0)
    monkeypatch.setenv("FAKECUDA_FAIL", "cuLaunchKernel=2")
    with pytest.raises(DriverError, match=r"^cuLaunchKernel\(add_kernel, grid=\(4, 1, 1\), "
                                          r"block=\(128, 1, 1\), shared=0, stream=0x0\) failed: "
                                          r"CUDA_ERROR_OUT_OF_MEMORY \(2\): out of memory\. "
                                          r"Hint: the GPU is out of memory"):
        launch(4, 1, 1, 0, ADD_VALUES)


def test_no_device_raises_no_device(fake_libcuda: Path, log: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKECUDA_DEVICES", "0")
    handle = ctypes.CDLL(str(fake_libcuda))
    with pytest.raises(NoDevice, match=r"^cuInit failed: CUDA_ERROR_NO_DEVICE \(100\): no "
                                       r"CUDA-capable device is detected\. Hint: no CUDA GPU is "
                                       r"visible: check `nvidia-smi` and CUDA_VISIBLE_DEVICES"):
        CudaDriver(LoadedLibrary(handle, str(fake_libcuda), "test"))


def test_make_launcher_rejects_an_impossible_block(driver: CudaDriver) -> None:
    function = driver.get_function(0, driver.load_module(0, cubin(ADD)), "add_kernel")
    with pytest.raises(LaunchError, match=r"invalid launch shape: num_threads=2048 \(1\.\.1024\)"):
        driver.make_launcher(function, struct=ADD_STRUCT, num_threads=2048, shared=0)


def test_struct_field_offsets_follow_the_formats_alignment() -> None:
    assert struct_field_offsets(struct.Struct("@QQQiQQ")) == [0, 8, 16, 24, 32, 40]
    assert struct_field_offsets(struct.Struct("<QiQ")) == [0, 8, 12]
    assert struct_field_offsets(struct.Struct("<Qi4xQ")) == [0, 8, 16]
    assert struct_field_offsets(struct.Struct("@hQ2i")) == [0, 8, 16, 20]
    assert struct_field_offsets(struct.Struct("<8sB")) == [0, 8]
    assert struct_field_offsets(struct.Struct("")) == []


# ---------------------------------------------------------------------------- CPU: discovery

def test_missing_libcuda_raises_library_not_found_listing_every_path(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("AOTRITON_RT_CUDA_LIB", "LD_PRELOAD")}
    env["LD_LIBRARY_PATH"] = str(tmp_path)  # nothing there
    code = ("from aotriton_rt.drivers import get_driver\n"
            "from aotriton_rt.errors import LibraryNotFound\n"
            "try:\n    get_driver('cuda')\nexcept LibraryNotFound as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, cwd=Path(__file__).parents[2])
    if "tried" not in proc.stdout:
        pytest.skip("a real libcuda is installed here")
    assert "cannot find the CUDA driver library (libcuda); tried, in order:" in proc.stdout
    assert "  - libcuda.so.1 (name): libcuda.so.1: cannot open shared object file" in proc.stdout
    assert "  - libcuda.so (name): libcuda.so: cannot open shared object file" in proc.stdout
    assert "Set AOTRITON_RT_CUDA_LIB to the full path of libcuda.so.1" in proc.stdout


def test_get_driver_for_an_unusable_override_raises_library_not_found(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aotriton_rt.drivers import _drivers, get_driver
    monkeypatch.delitem(_drivers, "cuda", raising=False)
    monkeypatch.setenv("AOTRITON_RT_CUDA_LIB", str(tmp_path / "libcuda.so.1"))
    with pytest.raises(LibraryNotFound, match=r"cannot load the CUDA driver library \(libcuda\) "
                                              r"from AOTRITON_RT_CUDA_LIB=.*libcuda\.so\.1"):
        get_driver("cuda")
    assert "cuda" not in _drivers  # a failure is not cached


# ---------------------------------------------------------------------------- CPU: cuda.h layouts

def test_ctypes_layouts_and_constants_match_cuda_h(tmp_path: Path) -> None:
    cuda_h = _triton_cuda_h()
    if cuda_h is None or shutil.which("gcc") is None:
        pytest.skip("needs gcc and triton's bundled cuda.h")
    probe = tmp_path / "probe.c"
    probe.write_text(
        '#include <stdio.h>\n#include <stddef.h>\n#include "cuda.h"\n'
        "int main(void) { printf(\"%zu %zu %zu %zu %zu %zu %d %d %d %d %d %d %d %d %d %d %d\\n\","
        " sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value), sizeof(CUlaunchConfig),"
        " offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),"
        " offsetof(CUlaunchConfig, numAttrs),"
        " (int)(size_t)CU_LAUNCH_PARAM_END, (int)(size_t)CU_LAUNCH_PARAM_BUFFER_POINTER,"
        " (int)(size_t)CU_LAUNCH_PARAM_BUFFER_SIZE,"
        " CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,"
        " CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,"
        " CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, CU_LAUNCH_ATTRIBUTE_COOPERATIVE,"
        " CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,"
        " CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,"
        " CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,"
        " CUDA_ERROR_INVALID_CONTEXT); return 0; }\n")
    exe = tmp_path / "probe"
    subprocess.run(["gcc", f"-I{cuda_h.parent}", "-o", str(exe), str(probe)], check=True)
    got = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True,
                                          check=True).stdout.split()]
    from aotriton_rt.drivers import cuda
    assert got == [
        ctypes.sizeof(CUlaunchAttribute), CUlaunchAttribute.value.offset,
        ctypes.sizeof(CUlaunchConfig), CUlaunchConfig.hStream.offset,
        CUlaunchConfig.attrs.offset, CUlaunchConfig.numAttrs.offset,
        cuda.CU_LAUNCH_PARAM_END, cuda.CU_LAUNCH_PARAM_BUFFER_POINTER,
        cuda.CU_LAUNCH_PARAM_BUFFER_SIZE, cuda.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        cuda.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        cuda.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
        cuda.CU_LAUNCH_ATTRIBUTE_COOPERATIVE, cuda.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
        cuda.CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
        cuda.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        cuda.CUDA_ERROR_INVALID_CONTEXT]


# ---------------------------------------------------------------------------- GPU

@pytest.fixture()
def gpu_add(tmp_path: Path):
    """torch, the CUDA driver, the current device and add_kernel compiled for its arch."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")  # compiles the kernel for this GPU's arch
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    from aotriton_rt.drivers import get_driver
    drv = get_driver("cuda")
    device = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(device)
    kernel = triton_add_kernel("cuda", major * 10 + minor, 32, tmp_path)
    function = drv.get_function(device, drv.load_module(device, kernel.image), kernel.symbol)
    drv.prepare_function(function, kernel.shared)
    launch = drv.make_launcher(function, struct=struct.Struct("@QQQiQQ"),
                               num_threads=32 * kernel.num_warps, shared=kernel.shared)
    return torch, drv, device, launch


@pytest.mark.gpu
def test_add_kernel_runs_on_the_gpu_through_the_launcher(gpu_add) -> None:
    torch, drv, device, launch = gpu_add
    major, minor = torch.cuda.get_device_capability(device)
    assert drv.device_arch(device) == f"sm{major}{minor}"
    assert drv.device_name(device) == torch.cuda.get_device_name(device)
    n = 1_000_003
    x = torch.rand(n, device="cuda")
    y = torch.rand(n, device="cuda")
    out = torch.full_like(x, float("nan"))
    stream = torch.cuda.current_stream().cuda_stream
    launch((n + 1023) // 1024, 1, 1, stream, (x.data_ptr(), y.data_ptr(), out.data_ptr(), n, 0, 0))
    drv.synchronize(device)
    assert torch.equal(out, x + y)
    assert not drv.is_capturing(stream)


@pytest.mark.gpu
def test_add_kernel_runs_from_a_fresh_thread_and_under_graph_capture(gpu_add) -> None:
    torch, drv, device, launch = gpu_add
    n = 4096
    x = torch.rand(n, device="cuda")
    out = torch.zeros_like(x)
    args = (x.data_ptr(), x.data_ptr(), out.data_ptr(), n, 0, 0)
    thread = threading.Thread(target=launch, args=(4, 1, 1, 0, args))
    thread.start()
    thread.join()
    drv.synchronize(device)
    assert torch.equal(out, 2 * x)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out.zero_()
        with torch.cuda.graph(graph, stream=side):
            assert drv.is_capturing(side.cuda_stream)
            launch(4, 1, 1, side.cuda_stream, args)
    graph.replay()
    drv.synchronize(device)
    assert torch.equal(out, 2 * x)


@pytest.mark.gpu
def test_launch_overhead_is_close_to_a_bare_ctypes_call(gpu_add) -> None:
    """The CPU cost of one launch, printed (run with -s); the bound only catches blunders."""
    import time

    torch, drv, device, launch = gpu_add
    x = torch.zeros(1024, device="cuda")
    values = (x.data_ptr(), x.data_ptr(), x.data_ptr(), 1024, 0, 0)
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(1000):
        launch(1, 1, 1, stream, values)
    drv.synchronize(device)
    runs = 20_000
    start = time.perf_counter()
    for _ in range(runs):
        launch(1, 1, 1, stream, values)
    per_launch = (time.perf_counter() - start) / runs
    drv.synchronize(device)
    print(f"\nlauncher: {per_launch * 1e6:.2f} us per launch (CPU side, driver included)")
    assert per_launch < 50e-6


def _pdl_add_images(root: Path, *, pdl: bool) -> Path:
    """An image folder with one cuda sm90 ``add`` variant whose image is the fake's cubin of
    ``add_kernel(x_ptr, n)`` and whose catalog says ``launch.pdl``."""
    import hashlib
    import lzma

    from tests.helpers.httpfaults import make_variant

    raw = cubin(("add_kernel", [8, 4, 8, 8]))
    xz = lzma.compress(raw, format=lzma.FORMAT_XZ)
    v = make_variant("add", "cuda", "sm90", 32, xz, raw, 0)
    v["launch"]["pdl"] = pdl
    path = root.joinpath(*v["image"]["path"].split("/"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(xz)
    assert v["image"]["sha256"] == hashlib.sha256(xz).hexdigest()
    (root / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                   "triton_version": "3.6.0", "tuning": {}, "variants": [v]}))
    return root


@pytest.mark.parametrize("pdl", [True, False])
def test_a_prepared_launch_without_pdl_drops_only_the_pdl_attribute_and_keeps_its_launcher(
        driver: CudaDriver, log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pdl: bool) -> None:
    """Kernel.prepare(pdl=False) (the decode chain's per-call rule): a PDL variant launches through
    cuLaunchKernel, without the attribute, from a launcher made once per device; prepare(pdl=True)
    and the handle's own call keep the attribute. A variant without PDL launches the same either way."""
    import aotriton_rt

    lib = aotriton_rt.Library(_pdl_add_images(tmp_path / "imgs", pdl=pdl), backend="cuda")
    lib._driver, lib.backend_now = driver, "cuda"
    made = []
    make = driver.make_launcher
    monkeypatch.setattr(driver, "make_launcher", lambda *a, **kw: made.append(kw["pdl"]) or make(*a, **kw))
    k = lib.kernel("add", raw_pointers=True)
    x = 0x7F0000001000
    k(x, 5000, stream=0x50)
    with_pdl = k.prepare(0, (0, 5000))
    plain = k.prepare(0, (0, 5000), pdl=False)
    again = k.prepare(0, (0, 4000), pdl=False)
    for launch in (with_pdl, plain, again):
        launch(0x60, (x, 5000))
    assert made == ([True, False] if pdl else [False])  # the plain launcher: made once, kept
    plain_launches = records(log, "cuLaunchKernel")
    ex_launches = records(log, "cuLaunchKernelEx")
    if pdl:
        assert [r["stream"] for r in ex_launches] == [0x50, 0x60]  # the handle's call, prepare(pdl=True)
        assert all(r["attrs"] == [[6, 1, 0, 0]] for r in ex_launches)
        assert [r["stream"] for r in plain_launches] == [0x60, 0x60]
        assert [r["grid"] for r in ex_launches + plain_launches] == [[5, 1, 1]] * 3 + [[4, 1, 1]]
    else:
        assert ex_launches == []
        assert [r["grid"] for r in plain_launches] == [[5, 1, 1]] * 3 + [[4, 1, 1]]  # cdiv(n, 1024), as prepared
