"""HIP through hip-python, or through ctypes on libamdhip64 where hip-python is absent.

Both backends open the same library, found along the documented search of ``_loader``
(``AOTRITON_RT_HIP_LIB`` first). ``AOTRITON_RT_HIP_BACKEND=hip-python|ctypes`` forces one;
by default hip-python is used when importable (there are no hip-python wheels for Windows,
so Windows always takes ctypes). hip-python opens ``libamdhip64.so`` by name on first use;
the driver points it at the discovered path first, so both backends talk to one library.

Device facts come from ``hipGetDevicePropertiesR0600``, the entry point that
``hipGetDeviceProperties`` names in ROCm 6.x and 7.x headers (ROCm 5 had only the older
layout, R0000, which this driver does not read). The ctypes backend reads these offsets of
``hipDeviceProp_tR0600`` (1472 bytes on LP64 Linux and LLP64 Windows alike, since every
``size_t`` and pointer there is 8 bytes), computed by compiling ROCm's
``include/hip/hip_runtime_api.h`` and checked in the tests against hip-python's struct:

    ======  =========================  ====================
    offset  field                      type
    ======  =========================  ====================
    0       name                       char[256]
    696     sharedMemPerBlockOptin     size_t
    1160    gcnArchName                char[256]
    ======  =========================  ====================

Every failing call goes through ``HipDriver.check`` (``hipGetErrorName`` /
``hipGetErrorString`` plus a hint).

This module is longer than the runtime's others because it is one concern, the whole HIP binding
(both call paths, hip-python and ctypes, the driver protocol's calls and the launcher), kept in
one file per backend so that a backend reads top to bottom.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p
from dataclasses import dataclass

from aotriton_rt.drivers._loader import LoadedLibrary, load_library
from aotriton_rt.drivers.protocol import COMMON_HINTS, FunctionTable, driver_error
from aotriton_rt.errors import ArgumentError, DriverError, LaunchError, UnsupportedError

__all__ = ["BACKEND_ENV", "HipDriver", "HipLauncher"]

#: Forces the HIP backend: "hip-python" or "ctypes".
BACKEND_ENV = "AOTRITON_RT_HIP_BACKEND"

# AMD ends the `extra` array with 3, where CUDA uses 0 (hip/amd_detail/host_defines.h).
HIP_LAUNCH_PARAM_BUFFER_POINTER = 1
HIP_LAUNCH_PARAM_BUFFER_SIZE = 2
HIP_LAUNCH_PARAM_END = 3
HIP_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_MEMORY_SIZE = 8  # hipFuncAttributeMaxDynamicSharedMemorySize
HIP_EVENT_DISABLE_TIMING = 2  # hipEventDisableTiming

# hipDeviceProp_tR0600 layout (see the module docstring).
PROP_SIZE = 1472
PROP_NAME = 0
PROP_SHARED_PER_BLOCK_OPTIN = 696
PROP_GCN_ARCH_NAME = 1160
# Room to spare past sizeof(hipDeviceProp_tR0600): a runtime never writes more than it
# declares, but a short buffer would be memory corruption, so be generous.
_PROP_BUFFER = 4096

# Every AMD GPU the project targets has 64 KiB of LDS per workgroup without asking; more
# (gfx950: 160 KiB) is requested per function with hipFuncSetAttribute.
_SHARED_WITHOUT_OPTIN = 64 * 1024

_HINTS = {
    **COMMON_HINTS,
    98: "the image has no code for this GPU: " + COMMON_HINTS[209],
    100: "no AMD GPU is visible: check `rocm-smi` and HIP_VISIBLE_DEVICES / "
         "ROCR_VISIBLE_DEVICES",
    101: "the device index is out of range: see device_count() and HIP_VISIBLE_DEVICES",
    801: "this HIP runtime does not support the call: a newer ROCm may",
}


@dataclass(frozen=True)
class _DeviceFacts:
    name: str
    arch: str
    shared_optin: int


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def _cstr(value: object) -> str:
    """Text of what hip-python returns for a ``const char*``: bytes, str or its CStr."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return _text(value)
    return _text(bytes(value))  # CStr supports the buffer protocol


# ---------------------------------------------------------------------------- ctypes backend

_P = POINTER
_SIGNATURES: dict[str, tuple] = {
    "hipInit": (c_uint,),
    "hipGetErrorName": (c_int,),
    "hipGetErrorString": (c_int,),
    "hipGetDeviceCount": (_P(c_int),),
    "hipGetDevice": (_P(c_int),),
    "hipSetDevice": (c_int,),
    "hipGetDevicePropertiesR0600": (c_void_p, c_int),
    "hipModuleLoadData": (_P(c_void_p), c_void_p),
    "hipModuleGetFunction": (_P(c_void_p), c_void_p, c_char_p),
    "hipFuncSetAttribute": (c_void_p, c_int, c_int),
    "hipModuleLaunchKernel": (c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint,
                              c_void_p, _P(c_void_p), _P(c_void_p)),
    "hipMalloc": (_P(c_void_p), c_size_t),
    "hipStreamIsCapturing": (c_void_p, _P(c_int)),
    "hipDeviceSynchronize": (),
}


class _CtypesApi:
    """The HIP calls the driver needs, straight through ctypes. Each returns the status
    first (an int) and any result after it."""

    name = "ctypes"

    def __init__(self, found: LoadedLibrary) -> None:
        self.library_path = found.path
        self._handle = found.handle
        for fname, argtypes in _SIGNATURES.items():
            self._fn(fname, argtypes, c_char_p if fname.startswith("hipGetError") else c_int)
        self.launch: Callable[..., int] = self._hipModuleLaunchKernel

    def extra_argument(self, extra: ctypes.Array) -> object:
        return extra

    def error_name(self, code: int) -> str:
        return _text(self._hipGetErrorName(code) or b"")

    def error_string(self, code: int) -> str:
        return _text(self._hipGetErrorString(code) or b"")

    def init(self) -> int:
        return self._hipInit(0)

    def device_count(self) -> tuple[int, int]:
        count = c_int()
        return self._hipGetDeviceCount(byref(count)), count.value

    def get_device(self) -> tuple[int, int]:
        device = c_int()
        return self._hipGetDevice(byref(device)), device.value

    def set_device(self, device: int) -> int:
        return self._hipSetDevice(device)

    def device_facts(self, device: int) -> tuple[int, _DeviceFacts | None]:
        buf = ctypes.create_string_buffer(_PROP_BUFFER)
        status = self._hipGetDevicePropertiesR0600(buf, device)
        if status:
            return status, None
        raw = buf.raw
        optin = int.from_bytes(raw[PROP_SHARED_PER_BLOCK_OPTIN:PROP_SHARED_PER_BLOCK_OPTIN + 8],
                               "little")
        facts = _DeviceFacts(_text(raw[PROP_NAME:PROP_NAME + 256]),
                             _text(raw[PROP_GCN_ARCH_NAME:PROP_GCN_ARCH_NAME + 256]), optin)
        return status, facts

    def module_load_data(self, image: bytes) -> tuple[int, int]:
        module = c_void_p()
        return self._hipModuleLoadData(byref(module), image), module.value or 0

    def module_get_function(self, module: int, symbol: bytes) -> tuple[int, int]:
        function = c_void_p()
        return self._hipModuleGetFunction(byref(function), module, symbol), function.value or 0

    def func_set_attribute(self, function: int, attribute: int, value: int) -> int:
        return self._hipFuncSetAttribute(function, attribute, value)

    def malloc(self, nbytes: int) -> tuple[int, int]:
        ptr = c_void_p()
        return self._hipMalloc(byref(ptr), nbytes), ptr.value or 0

    def stream_is_capturing(self, stream: int) -> tuple[int, int]:
        status = c_int()
        return self._hipStreamIsCapturing(stream, byref(status)), status.value

    def device_synchronize(self) -> int:
        return self._hipDeviceSynchronize()

    def _fn(self, name: str, argtypes: tuple, restype: type = c_int) -> ctypes._CFuncPtr:
        """The library's ``name``, typed and kept as ``self._<name>``: bound here for every call of
        :data:`_SIGNATURES`, at first use for the scratch bookkeeping (aotriton_rt.scratch)."""
        fn = getattr(self, "_" + name, None)
        if fn is None:
            try:
                fn = getattr(self._handle, name)
            except AttributeError:
                raise DriverError(f"{self.library_path} has no {name}: aotriton-rt needs the HIP "
                                  f"runtime of ROCm 6.0 or newer", call=name) from None
            fn.argtypes, fn.restype = list(argtypes), restype
            setattr(self, "_" + name, fn)
        return fn

    def capture_info(self, stream: int) -> tuple[int, int, int]:
        status, ident = c_int(), c_uint64()
        fn = self._fn("hipStreamGetCaptureInfo", (c_void_p, _P(c_int), _P(c_uint64)))
        return fn(stream, byref(status), byref(ident)), status.value, ident.value

    def event_create(self) -> tuple[int, int]:
        event = c_void_p()
        status = self._fn("hipEventCreateWithFlags", (_P(c_void_p), c_uint))(byref(event), HIP_EVENT_DISABLE_TIMING)
        return status, event.value or 0

    def event_record(self, event: int, stream: int) -> int:
        return self._fn("hipEventRecord", (c_void_p, c_void_p))(event, stream)

    def stream_wait_event(self, stream: int, event: int) -> int:
        return self._fn("hipStreamWaitEvent", (c_void_p, c_void_p, c_uint))(stream, event, 0)

    def event_synchronize(self, event: int) -> int:
        return self._fn("hipEventSynchronize", (c_void_p,))(event)

    def event_destroy(self, event: int) -> int:
        return self._fn("hipEventDestroy", (c_void_p,))(event)

    def free(self, ptr: int) -> int:
        return self._fn("hipFree", (c_void_p,))(ptr)


# ---------------------------------------------------------------------------- hip-python backend

class _HipPythonApi:
    """The same calls through hip-python (``from hip import hip``)."""

    name = "hip-python"

    def __init__(self, found: LoadedLibrary, hip: object, chip: object | None) -> None:
        self.library_path = found.path
        # hip-python dlopens "libamdhip64.so" on its first call, by the name in chip.DLL.
        # Point it at the library we found; even where that attribute is missing, the copy
        # we hold open already satisfies a dlopen of its soname.
        if chip is not None and hasattr(chip, "DLL"):
            chip.DLL = os.fsencode(found.path)
        self._keep_open = found.handle
        self._hip = hip
        launch = hip.hipModuleLaunchKernel

        def launch_status(*args: object) -> int:
            return launch(*args)[0]

        self.launch: Callable[..., int] = launch_status

    def extra_argument(self, extra: ctypes.Array) -> object:
        # hip-python takes a plain address for `extra` and uses it as is.
        return ctypes.addressof(extra)

    def _error_code(self, code: int) -> object | None:
        # hip-python takes only its enum; a code outside the enum has no name to ask for.
        try:
            return self._hip.hipError_t(code)
        except ValueError:
            return None

    def error_name(self, code: int) -> str:
        enum = self._error_code(code)
        return "" if enum is None else _cstr(self._hip.hipGetErrorName(enum)[1])

    def error_string(self, code: int) -> str:
        enum = self._error_code(code)
        return "" if enum is None else _cstr(self._hip.hipGetErrorString(enum)[1])

    def init(self) -> int:
        return self._hip.hipInit(0)[0]

    def device_count(self) -> tuple[int, int]:
        status, count = self._hip.hipGetDeviceCount()
        return status, count

    def get_device(self) -> tuple[int, int]:
        status, device = self._hip.hipGetDevice()
        return status, device

    def set_device(self, device: int) -> int:
        return self._hip.hipSetDevice(device)[0]

    def device_facts(self, device: int) -> tuple[int, _DeviceFacts | None]:
        props = self._hip.hipDeviceProp_t()
        try:
            status = self._hip.hipGetDeviceProperties(props, device)[0]
        except TypeError:
            # hip-python 10 allocates the struct itself: hipGetDeviceProperties(device) returns
            # (status, props), and its char arrays read as str rather than bytes.
            status, props = self._hip.hipGetDeviceProperties(device)
        if status:
            return status, None
        return status, _DeviceFacts(_cstr(props.name), _cstr(props.gcnArchName),
                                    int(props.sharedMemPerBlockOptin))

    def module_load_data(self, image: bytes) -> tuple[int, int]:
        status, module = self._hip.hipModuleLoadData(image)
        return status, int(module) if module is not None else 0

    def module_get_function(self, module: int, symbol: bytes) -> tuple[int, int]:
        status, function = self._hip.hipModuleGetFunction(module, symbol)
        return status, int(function) if function is not None else 0

    def func_set_attribute(self, function: int, attribute: int, value: int) -> int:
        attr = self._hip.hipFuncAttribute(attribute)
        return self._hip.hipFuncSetAttribute(function, attr, value)[0]

    def malloc(self, nbytes: int) -> tuple[int, int]:
        status, ptr = self._hip.hipMalloc(nbytes)
        return status, int(ptr) if ptr is not None else 0

    def stream_is_capturing(self, stream: int) -> tuple[int, int]:
        status, capture = self._hip.hipStreamIsCapturing(stream)
        return status, int(capture)

    def device_synchronize(self) -> int:
        return self._hip.hipDeviceSynchronize()[0]

    def capture_info(self, stream: int) -> tuple[int, int, int]:
        status, capture, ident = self._hip.hipStreamGetCaptureInfo(stream)
        return status, int(capture), int(ident or 0)

    def event_create(self) -> tuple[int, int]:
        status, event = self._hip.hipEventCreateWithFlags(HIP_EVENT_DISABLE_TIMING)
        return status, int(event) if event is not None else 0

    def event_record(self, event: int, stream: int) -> int:
        return self._hip.hipEventRecord(event, stream)[0]

    def stream_wait_event(self, stream: int, event: int) -> int:
        return self._hip.hipStreamWaitEvent(stream, event, 0)[0]

    def event_synchronize(self, event: int) -> int:
        return self._hip.hipEventSynchronize(event)[0]

    def event_destroy(self, event: int) -> int:
        return self._hip.hipEventDestroy(event)[0]

    def free(self, ptr: int) -> int:
        return self._hip.hipFree(ptr)[0]


def _import_hip_python() -> tuple[object, object | None]:
    from hip import hip
    try:
        from hip import chip
    except ImportError:
        chip = None
    return hip, chip


def _select_api(environ: Mapping[str, str],
                importer: Callable[[], tuple[object, object | None]]) -> _CtypesApi | _HipPythonApi:
    choice = environ.get(BACKEND_ENV, "").strip().lower()
    if choice not in ("", "hip-python", "ctypes"):
        raise UnsupportedError(f"{BACKEND_ENV}={environ[BACKEND_ENV]!r} names no HIP backend; "
                               f"use 'hip-python' or 'ctypes', or unset it")
    found = load_library("hip", environ=environ)
    if choice == "ctypes":
        return _CtypesApi(found)
    try:
        hip, chip = importer()
    except ImportError as exc:
        if choice == "hip-python":
            raise DriverError(f"{BACKEND_ENV}=hip-python but hip-python cannot be imported "
                              f"({exc}): pip install the hip-python release matching your "
                              f"ROCm, or set {BACKEND_ENV}=ctypes", call="import hip") from exc
        return _CtypesApi(found)
    return _HipPythonApi(found, hip, chip)


# ---------------------------------------------------------------------------- the driver

class HipDriver:
    """The HIP backend (see ``aotriton_rt.drivers.protocol.Driver`` for the protocol).

    ``HipDriver()`` picks the backend (``AOTRITON_RT_HIP_BACKEND``; hip-python when
    importable, else ctypes), opens libamdhip64 and calls ``hipInit``. ``api_name`` says
    which backend is in use, ``library_path`` which library. Raises ``LibraryNotFound``,
    ``NoDevice``, ``DriverError``.
    """

    backend = "hip"

    def __init__(self, *, environ: Mapping[str, str] | None = None,
                 importer: Callable[[], tuple[object, object | None]] = _import_hip_python
                 ) -> None:
        self._api = _select_api(os.environ if environ is None else environ, importer)
        self.api_name = self._api.name
        self.library_path = self._api.library_path
        self._lock = threading.Lock()
        self._facts: dict[int, _DeviceFacts] = {}
        self._functions = FunctionTable()
        # HIP may read a module's image after hipModuleLoadData returns (code objects are
        # loaded per device on first use), so each image lives as long as its module.
        self._images: dict[int, bytes] = {}
        self.check(self._api.init(), "hipInit")

    def check(self, status: int, call: str) -> None:
        """Raise ``DriverError`` (``NoDevice`` for code 100) when ``status`` is not 0.

        The message names ``call``, the code, ``hipGetErrorName`` / ``hipGetErrorString``
        and a hint for the common codes.
        """
        if not status:
            return
        code = int(status)
        raise driver_error(call=call, code=code, name=self._api.error_name(code),
                           explanation=self._api.error_string(code),
                           hint=_HINTS.get(code, ""))

    # ------------------------------------------------------------------ devices

    def device_count(self) -> int:
        """Number of visible HIP devices."""
        status, count = self._api.device_count()
        self.check(status, "hipGetDeviceCount")
        return count

    def current_device(self) -> int:
        """The calling thread's current HIP device (what torch.cuda.current_device() sets)."""
        status, device = self._api.get_device()
        self.check(status, "hipGetDevice")
        return device

    @contextmanager
    def _on_device(self, device: int) -> Iterator[None]:
        """Make ``device`` current for a block, then restore the caller's device."""
        previous = self.current_device()
        if previous != device:
            self.check(self._api.set_device(device), f"hipSetDevice({device})")
        try:
            yield
        finally:
            if previous != device:
                self.check(self._api.set_device(previous), f"hipSetDevice({previous})")

    def _device_facts(self, device: int) -> _DeviceFacts:
        facts = self._facts.get(device)
        if facts is None:
            status, facts = self._api.device_facts(device)
            self.check(status, f"hipGetDevicePropertiesR0600({device})")
            assert facts is not None
            if not facts.arch.startswith("gfx"):
                raise DriverError(
                    f"device {device} reports gcnArchName {facts.arch!r}, not a gfx target: "
                    f"this HIP runtime's hipDeviceProp_tR0600 layout is not the one "
                    f"aotriton-rt reads (backend {self.api_name}, {self.library_path})",
                    call="hipGetDevicePropertiesR0600")
            self._facts[device] = facts
        return facts

    def device_arch(self, device: int) -> str:
        """The raw gcnArchName, e.g. ``"gfx942:sramecc+:xnack-"``."""
        return self._device_facts(device).arch

    def device_name(self, device: int) -> str:
        """The marketing name, e.g. ``"AMD Instinct MI300X"``."""
        return self._device_facts(device).name

    # ------------------------------------------------------------------ modules

    def load_module(self, device: int, image: bytes) -> int:
        """Load a code object (HSACO) from memory on ``device``; returns the module."""
        image = bytes(image)
        with self._on_device(device):
            status, module = self._api.module_load_data(image)
            self.check(status, f"hipModuleLoadData({len(image)} bytes, device {device})")
        self._images[module] = image
        return module

    def get_function(self, device: int, module: int, symbol: str) -> int:
        """The kernel ``symbol`` of ``module``; returns the function handle."""
        with self._on_device(device):
            status, function = self._api.module_get_function(module, symbol.encode())
            self.check(status, f"hipModuleGetFunction({symbol!r})")
        self._functions.add(function, device, symbol)
        return function

    def prepare_function(self, function: int, shared: int) -> None:
        """Allow ``function`` ``shared`` bytes of LDS when that is over 64 KiB.

        Raises ``LaunchError`` when the device cannot give that much to one workgroup.
        """
        if shared <= _SHARED_WITHOUT_OPTIN:
            return
        device = self._functions.device(function)
        if device is None:
            device = self.current_device()
        facts = self._device_facts(device)
        symbol = self._functions.symbol(function)
        if shared > facts.shared_optin:
            raise LaunchError(
                f"kernel {symbol} needs {shared} bytes of LDS per workgroup but device {device} "
                f"({facts.name}, {facts.arch}) allows at most {facts.shared_optin}: use a "
                f"config with fewer stages or smaller blocks")
        with self._on_device(device):
            self.check(self._api.func_set_attribute(
                function, HIP_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_MEMORY_SIZE, shared),
                f"hipFuncSetAttribute({symbol}, MaxDynamicSharedMemorySize={shared})")

    def make_launcher(self, function: int, *, struct: struct.Struct, num_threads: int,
                      shared: int, cooperative: bool = False, pdl: bool = False,
                      cluster_dims: tuple[int, int, int] = (1, 1, 1)) -> HipLauncher:
        """A ``hipModuleLaunchKernel`` launcher for ``function`` (blocks of ``num_threads``).

        Cooperative, PDL and cluster launches are not available on HIP here and raise
        ``UnsupportedError``.
        """
        if cooperative or pdl or tuple(cluster_dims) != (1, 1, 1):
            raise UnsupportedError(
                f"HIP launches support neither cooperative grids, PDL nor clusters here "
                f"(asked: cooperative={cooperative}, pdl={pdl}, "
                f"cluster_dims={tuple(cluster_dims)})")
        if not 1 <= num_threads <= 1024 or shared < 0:
            raise LaunchError(f"invalid launch shape: num_threads={num_threads} (1..1024), "
                              f"shared={shared} (>= 0)")
        symbol = self._functions.symbol(function)
        device = self._functions.device(function, 0)
        return HipLauncher(self, function, symbol, device, struct, num_threads, shared)

    # ------------------------------------------------------------------ memory and streams

    def alloc(self, device: int, nbytes: int) -> int:
        """``nbytes`` of device memory on ``device`` (never freed). 0 bytes gives 0."""
        if nbytes == 0:
            return 0
        with self._on_device(device):
            status, ptr = self._api.malloc(nbytes)
            self.check(status, f"hipMalloc({nbytes} bytes, device {device})")
        return ptr

    def is_capturing(self, stream: int) -> bool:
        """Whether ``stream`` is being captured into a HIP graph (active or invalidated)."""
        status, capture = self._api.stream_is_capturing(stream)
        self.check(status, "hipStreamIsCapturing")
        return capture != 0

    def synchronize(self, device: int) -> None:
        """Wait for all work on ``device``."""
        with self._on_device(device):
            self.check(self._api.device_synchronize(), f"hipDeviceSynchronize(device {device})")

    # ------------------------------------------------------------------ events and graphs
    # What aotriton_rt.scratch needs (see the CUDA driver). HIP runs each call on the current
    # device, so the calls that create or free run on ``device``.

    def capture_info(self, device: int, stream: int) -> tuple[int, int, int]:
        """``(status, id, graph)`` of ``stream``'s capture (graph: 0, not reported here)."""
        status, capture, ident = self._api.capture_info(stream)
        self.check(status, "hipStreamGetCaptureInfo")
        return capture, ident, 0

    def capture_probe(self) -> Callable[[int], bool]:
        """``probe(stream)``: whether ``stream`` is capturing a graph (:meth:`is_capturing`)."""
        return self.is_capturing

    def event_recorder(self) -> Callable[[int, int], int]:
        """``record(event, stream)`` returning the status (see the CUDA driver)."""
        return self._api.event_record

    def event_create(self, device: int) -> int:
        with self._on_device(device):
            status, event = self._api.event_create()
            self.check(status, f"hipEventCreateWithFlags(device {device})")
        return event

    def event_record(self, device: int, event: int, stream: int) -> None:
        self.check(self._api.event_record(event, stream), "hipEventRecord")

    def stream_wait_event(self, device: int, stream: int, event: int) -> None:
        self.check(self._api.stream_wait_event(stream, event), "hipStreamWaitEvent")

    def free(self, device: int, ptr: int, event: int = 0) -> None:
        """Wait for ``event`` (when given), destroy it, then free ``ptr``."""
        with self._on_device(device):
            if event:
                self.check(self._api.event_synchronize(event), "hipEventSynchronize")
                self.check(self._api.event_destroy(event), "hipEventDestroy")
            if ptr:
                self.check(self._api.free(ptr), f"hipFree({ptr:#x}, device {device})")

    def alloc_relaxed(self, device: int, nbytes: int) -> int:
        """:meth:`alloc` while a graph is being captured (HIP allows it in every capture mode)."""
        return self.alloc(device, nbytes)

    def retain_in_graph(self, graph: int, data: int, destroy: object) -> bool:
        """Not wired on HIP: a captured graph's scratch then lives as long as the process."""
        return False


class HipLauncher:
    """``hipModuleLaunchKernel`` with the packed buffer passed through ``extra``.

    The launch runs with the function's device current whatever the calling thread's device
    is: one ``hipGetDevice`` per launch, and ``hipSetDevice`` to the function's device and
    back to the caller's only when they differ.
    """

    __slots__ = ("_driver", "_function", "_symbol", "_device", "_struct", "_pack", "_buf", "_size",
                 "_extra", "_extra_arg", "_launch", "_get_device", "_block", "_shared", "_lock",
                 "__weakref__")

    def __init__(self, driver: HipDriver, function: int, symbol: str, device: int,
                 layout: struct.Struct, num_threads: int, shared: int) -> None:
        self._driver = driver
        self._function = function
        self._symbol = symbol
        self._device = device
        self._get_device = driver._api.get_device
        self._struct = layout
        self._pack = layout.pack_into
        # One byte at least: a zero-length ctypes buffer has no stable address.
        self._buf = ctypes.create_string_buffer(max(layout.size, 1))
        self._size = c_size_t(layout.size)
        self._extra = (c_void_p * 5)(HIP_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(self._buf),
                                     HIP_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(self._size),
                                     HIP_LAUNCH_PARAM_END)
        self._extra_arg = driver._api.extra_argument(self._extra)
        self._launch = driver._api.launch
        self._block = num_threads
        self._shared = shared
        # The buffer is shared by all callers and the launch call may drop the GIL.
        self._lock = threading.Lock()

    def __call__(self, gx: int, gy: int, gz: int, stream: int, values: tuple) -> None:
        """Pack ``values`` and launch a (gx, gy, gz) grid on ``stream``; see ``Launcher``."""
        if not (gx and gy and gz):
            return
        with self._lock:
            try:
                self._pack(self._buf, 0, *values)
            except struct.error as exc:
                raise ArgumentError(
                    f"cannot pack the {len(values)} launch arguments of {self._symbol} with "
                    f"format {self._struct.format!r}: {exc}") from None
            current_status, current = self._get_device()
            if not current_status and current == self._device:
                status = self._launch(self._function, gx, gy, gz, self._block, 1, 1, self._shared,
                                      stream, None, self._extra_arg)
            else:
                self._driver.check(current_status, "hipGetDevice")
                status = self._on_own_device(gx, gy, gz, stream, current)
        if status:
            self._driver.check(status, f"hipModuleLaunchKernel({self._symbol}, "
                                       f"grid=({gx}, {gy}, {gz}), block=({self._block}, 1, 1), "
                                       f"shared={self._shared}, stream={stream:#x})")

    def _on_own_device(self, gx: int, gy: int, gz: int, stream: int, previous: int) -> int:
        """The launch with this function's device made current, and ``previous`` restored after."""
        driver = self._driver
        driver.check(driver._api.set_device(self._device), f"hipSetDevice({self._device})")
        try:
            return self._launch(self._function, gx, gy, gz, self._block, 1, 1, self._shared,
                                stream, None, self._extra_arg)
        finally:
            driver.check(driver._api.set_device(previous), f"hipSetDevice({previous})")

    def __repr__(self) -> str:
        return (f"<HipLauncher {self._symbol} device={self._device} block={self._block} shared={self._shared} "
                f"args={self._struct.format!r}>")
