"""The CUDA driver API through ctypes on libcuda.

Contexts: the driver works in the context the caller's framework made current. torch, CuPy
and JAX all use each device's *primary* context, so where a call is tied to a device
(loading a module, allocating, synchronising) the driver makes that device's primary context
current for the call, and when the thread had no context at all it leaves it current, as the
CUDA runtime does. A launch runs in the primary context of its function's device whatever the
caller's current context is: the launcher compares the current context with that one (one
``cuCtxGetCurrent``, the only context work on the common path) and, when they differ, pushes
the function's context around the launch and pops it after; a thread with no context at all
keeps the one it was given.

Every failing call goes through ``CudaDriver.check``, which raises ``DriverError`` with
``cuGetErrorName`` / ``cuGetErrorString`` and a hint.

This module is longer than the runtime's others because it is one concern, the whole CUDA
binding (the ctypes signatures, the driver protocol's calls and the two launchers they build), kept
in one file per backend so that a backend reads top to bottom.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p

from aotriton_rt.drivers._loader import LoadedLibrary, load_library
from aotriton_rt.drivers.protocol import COMMON_HINTS, FunctionTable, driver_error, struct_field_offsets
from aotriton_rt.errors import ArgumentError, DriverError, LaunchError, UnsupportedError

__all__ = ["CUlaunchAttribute", "CUlaunchConfig", "CudaDriver", "CudaLauncher",
           "CudaLauncherEx"]

# Values from cuda.h (checked against it by tests/runtime/test_driver_cuda.py).
CU_LAUNCH_PARAM_END = 0
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_LAUNCH_PARAM_BUFFER_POINTER = 1
CU_LAUNCH_PARAM_BUFFER_SIZE = 2
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_CACHE_PREFER_SHARED = 1
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 5
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CU_CLUSTER_SCHEDULING_POLICY_SPREAD = 1
CUDA_ERROR_INVALID_CONTEXT = 201

# Without an opt-in a block may use at most 48 KiB of dynamic shared memory.
_SHARED_WITHOUT_OPTIN = 48 * 1024
# Clusters of more than 8 blocks are "non-portable" and need a per-function opt-in.
_PORTABLE_CLUSTER = 8

_HINTS = {
    **COMMON_HINTS,
    100: "no CUDA GPU is visible: check `nvidia-smi` and CUDA_VISIBLE_DEVICES",
    101: "the device index is out of range: see device_count() and CUDA_VISIBLE_DEVICES",
    222: "the image needs a newer NVIDIA driver than the one installed",
}


class _ClusterDim(ctypes.Structure):
    _fields_ = [("x", c_uint), ("y", c_uint), ("z", c_uint)]


class CUlaunchAttributeValue(ctypes.Union):
    """The 64-byte value union of ``CUlaunchAttribute`` (only the members used here)."""

    _fields_ = [("pad", ctypes.c_char * 64),
                ("_align", c_void_p),  # the C union holds pointers: 8-byte aligned
                ("cooperative", c_int),
                ("clusterDim", _ClusterDim),
                ("clusterSchedulingPolicyPreference", c_int),
                ("programmaticStreamSerializationAllowed", c_int)]


class CUlaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, and the value union (72 bytes)."""

    _fields_ = [("id", c_int), ("pad", ctypes.c_char * 4), ("value", CUlaunchAttributeValue)]


class CUlaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``, the first argument of ``cuLaunchKernelEx`` (56 bytes)."""

    _fields_ = [("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint),
                ("blockDimX", c_uint), ("blockDimY", c_uint), ("blockDimZ", c_uint),
                ("sharedMemBytes", c_uint), ("hStream", c_void_p),
                ("attrs", POINTER(CUlaunchAttribute)), ("numAttrs", c_uint)]


_P = POINTER
# argtypes of every entry point used; restype is CUresult (int) for all of them. The _v2
# names are the current ABI of those that have one (cuMemAlloc, cuCtxPushCurrent...).
_SIGNATURES: dict[str, tuple] = {
    "cuInit": (c_uint,),
    "cuGetErrorName": (c_int, _P(c_char_p)),
    "cuGetErrorString": (c_int, _P(c_char_p)),
    "cuDeviceGetCount": (_P(c_int),),
    "cuDeviceGet": (_P(c_int), c_int),
    "cuDeviceGetName": (c_char_p, c_int, c_int),
    "cuDeviceGetAttribute": (_P(c_int), c_int, c_int),
    "cuDevicePrimaryCtxRetain": (_P(c_void_p), c_int),
    "cuCtxGetCurrent": (_P(c_void_p),),
    "cuCtxSetCurrent": (c_void_p,),
    "cuCtxPushCurrent_v2": (c_void_p,),
    "cuCtxPopCurrent_v2": (_P(c_void_p),),
    "cuCtxGetDevice": (_P(c_int),),
    "cuCtxSynchronize": (),
    "cuModuleLoadData": (_P(c_void_p), c_void_p),
    "cuModuleGetFunction": (_P(c_void_p), c_void_p, c_char_p),
    "cuFuncSetAttribute": (c_void_p, c_int, c_int),
    "cuFuncSetCacheConfig": (c_void_p, c_int),
    "cuFuncGetAttribute": (_P(c_int), c_int, c_void_p),
    "cuLaunchKernel": (c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint,
                       c_void_p, _P(c_void_p), _P(c_void_p)),
    "cuMemAlloc_v2": (_P(c_uint64), c_size_t),
    "cuStreamIsCapturing": (c_void_p, _P(c_int)),
}
# Resolved on first use (CudaDriver._optional_fn): cuLaunchKernelEx exists from CUDA 12.0 on.
_OPTIONAL_SIGNATURES: dict[str, tuple] = {
    "cuLaunchKernelEx": (_P(CUlaunchConfig), c_void_p, _P(c_void_p), _P(c_void_p)),
    # Scratch bookkeeping (aotriton_rt.scratch): bound at the first launch that needs scratch.
    "cuStreamGetCaptureInfo_v2": (c_void_p, _P(c_int), _P(c_uint64), _P(c_void_p), c_void_p, c_void_p),
    "cuEventCreate": (_P(c_void_p), c_uint),
    "cuEventRecord": (c_void_p, c_void_p),
    "cuEventSynchronize": (c_void_p,),
    "cuEventDestroy_v2": (c_void_p,),
    "cuStreamWaitEvent": (c_void_p, c_void_p, c_uint),
    "cuMemFree_v2": (c_uint64,),
    "cuThreadExchangeStreamCaptureMode": (_P(c_int),),
    "cuUserObjectCreate": (_P(c_void_p), c_void_p, c_void_p, c_uint, c_uint),
    "cuGraphRetainUserObject": (c_void_p, c_void_p, c_uint, c_uint),
}

CU_EVENT_DISABLE_TIMING = 2
CU_STREAM_CAPTURE_MODE_RELAXED = 2
CU_USER_OBJECT_NO_DESTRUCTOR_SYNC = 1
CU_GRAPH_USER_OBJECT_MOVE = 1


def _bind(lib: ctypes.CDLL, name: str, argtypes: tuple, path: str) -> ctypes._CFuncPtr:
    try:
        fn = getattr(lib, name)
    except AttributeError:
        raise DriverError(f"{path} has no {name}: the NVIDIA driver is too old for "
                          f"aotriton-rt (CUDA 12 or newer is needed)", call=name) from None
    fn.argtypes = list(argtypes)
    fn.restype = c_int
    return fn


def _error_text(getter: ctypes._CFuncPtr, status: int) -> str:
    # cuGetErrorName/String fail (and leave NULL) for codes the driver does not know.
    text = c_char_p()
    if getter(status, byref(text)) != 0 or not text.value:
        return ""
    return text.value.decode(errors="replace")


class CudaDriver:
    """The CUDA backend (see ``aotriton_rt.drivers.protocol.Driver`` for the protocol).

    ``CudaDriver()`` finds libcuda along the documented search (``AOTRITON_RT_CUDA_LIB``
    first) and calls ``cuInit``; pass ``library`` to use an already opened one. Raises
    ``LibraryNotFound`` / ``NoDevice`` / ``DriverError``.
    """

    backend = "cuda"

    def __init__(self, library: LoadedLibrary | None = None) -> None:
        found = library if library is not None else load_library("cuda")
        self.library_path = found.path
        self._lib = found.handle
        for name, argtypes in _SIGNATURES.items():
            setattr(self, "_" + name, _bind(found.handle, name, argtypes, found.path))
        self._lock = threading.RLock()
        self._primary: dict[int, int] = {}        # device index -> primary context
        self._functions = FunctionTable()
        self._arch: dict[int, str] = {}
        self._optional: dict[str, ctypes._CFuncPtr] = {}
        # PDL variants launched plainly (AOTRITON_RT_CUDA_PDL=off), for measuring what PDL gives
        # (bench/decode.py): their in-kernel wait then returns at once, the stream orders them.
        self._pdl = os.environ.get("AOTRITON_RT_CUDA_PDL", "on") != "off"
        self.check(self._cuInit(0), "cuInit")

    # ------------------------------------------------------------------ errors

    def check(self, status: int, call: str) -> None:
        """Raise ``DriverError`` (``NoDevice`` for code 100) when ``status`` is not 0.

        The message names ``call``, the code, the driver's ``cuGetErrorName`` and
        ``cuGetErrorString``, and a hint for the common codes.
        """
        if status == 0:
            return
        status = int(status)
        raise driver_error(call=call, code=status,
                           name=_error_text(self._cuGetErrorName, status),
                           explanation=_error_text(self._cuGetErrorString, status),
                           hint=_HINTS.get(status, ""))

    # ------------------------------------------------------------------ devices and contexts

    def device_count(self) -> int:
        """Number of visible CUDA devices."""
        count = c_int()
        self.check(self._cuDeviceGetCount(byref(count)), "cuDeviceGetCount")
        return count.value

    def _device_handle(self, device: int) -> int:
        handle = c_int()
        self.check(self._cuDeviceGet(byref(handle), device), f"cuDeviceGet({device})")
        return handle.value

    def _current_context(self) -> int | None:
        ctx = c_void_p()
        self.check(self._cuCtxGetCurrent(byref(ctx)), "cuCtxGetCurrent")
        return ctx.value

    def _primary_context(self, device: int) -> int:
        ctx = self._primary.get(device)
        if ctx is None:
            with self._lock:
                ctx = self._primary.get(device)
                if ctx is None:
                    handle = c_void_p()
                    # Retained for the life of the process, like the frameworks do.
                    self.check(self._cuDevicePrimaryCtxRetain(
                        byref(handle), self._device_handle(device)),
                        f"cuDevicePrimaryCtxRetain({device})")
                    ctx = self._primary[device] = handle.value
        return ctx

    @contextmanager
    def _on_device(self, device: int) -> Iterator[None]:
        """Make ``device``'s primary context current for a block; restore the caller's."""
        ctx = self._primary_context(device)
        previous = self._current_context()
        if previous != ctx:
            self.check(self._cuCtxSetCurrent(ctx), f"cuCtxSetCurrent(device {device})")
        try:
            yield
        finally:
            # A thread that had no context keeps this one (the CUDA runtime does the same).
            if previous is not None and previous != ctx:
                self.check(self._cuCtxSetCurrent(previous), "cuCtxSetCurrent(restore)")

    def current_device(self) -> int:
        """The device of the current context (the framework's current device), else 0."""
        if self._current_context() is None:
            return 0
        device = c_int()
        self.check(self._cuCtxGetDevice(byref(device)), "cuCtxGetDevice")
        return device.value

    def _attribute(self, attribute: int, device: int) -> int:
        value = c_int()
        self.check(self._cuDeviceGetAttribute(byref(value), attribute,
                                              self._device_handle(device)),
                   f"cuDeviceGetAttribute({attribute}, device {device})")
        return value.value

    def device_arch(self, device: int) -> str:
        """The compute capability as a target name: ``"sm90"`` for 9.0, ``"sm80"`` for 8.0."""
        arch = self._arch.get(device)
        if arch is None:
            major = self._attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
            minor = self._attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
            arch = self._arch[device] = f"sm{major}{minor}"
        return arch

    def device_name(self, device: int) -> str:
        """The marketing name, e.g. ``"NVIDIA H200"``."""
        buf = ctypes.create_string_buffer(256)
        self.check(self._cuDeviceGetName(buf, len(buf), self._device_handle(device)),
                   f"cuDeviceGetName({device})")
        return buf.value.decode(errors="replace")

    # ------------------------------------------------------------------ modules

    def load_module(self, device: int, image: bytes) -> int:
        """Load a cubin from memory into ``device``'s primary context; returns the module."""
        module = c_void_p()
        with self._on_device(device):
            self.check(self._cuModuleLoadData(byref(module), image),
                       f"cuModuleLoadData({len(image)} bytes, device {device})")
        return module.value

    def get_function(self, device: int, module: int, symbol: str) -> int:
        """The kernel ``symbol`` of ``module``; returns the function handle."""
        function = c_void_p()
        with self._on_device(device):
            self.check(self._cuModuleGetFunction(byref(function), module, symbol.encode()),
                       f"cuModuleGetFunction({symbol!r})")
        self._functions.add(function.value, device, symbol)
        return function.value

    def prepare_function(self, function: int, shared: int) -> None:
        """Opt ``function`` in to ``shared`` bytes of dynamic shared memory when > 48 KiB, and
        prefer shared memory over L1 for it.

        Raises ``LaunchError`` when the device cannot give that much to one block.
        """
        if shared <= _SHARED_WITHOUT_OPTIN:
            return
        device = self._functions.device(function)
        if device is None:
            device = self.current_device()
        limit = self._attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device)
        symbol = self._functions.symbol(function)
        # The binary's static shared memory (1 KiB on sm90 Triton kernels) counts too.
        static = c_int()
        self.check(self._cuFuncGetAttribute(byref(static), CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function),
                   f"cuFuncGetAttribute({symbol}, SHARED_SIZE_BYTES)")
        if shared + static.value > limit:
            raise LaunchError(
                f"kernel {symbol} needs {shared} + {static.value} (static) bytes of shared memory per block but device "
                f"{device} ({self.device_name(device)}, {self.device_arch(device)}) allows at "
                f"most {limit}: use a config with fewer stages or smaller blocks")
        self.check(self._cuFuncSetAttribute(function,
                                            CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                            shared),
                   f"cuFuncSetAttribute({symbol}, MAX_DYNAMIC_SHARED_SIZE_BYTES={shared})")
        # Triton's own loader marks such kernels this way too: the images launch as the JIT that
        # tuned them does (the L1/shared split is the one difference the launch paths had).
        self.check(self._cuFuncSetCacheConfig(function, CU_FUNC_CACHE_PREFER_SHARED),
                   f"cuFuncSetCacheConfig({symbol}, PREFER_SHARED)")

    # ------------------------------------------------------------------ launches

    def make_launcher(self, function: int, *, struct: struct.Struct, num_threads: int,
                      shared: int, cooperative: bool = False, pdl: bool = False,
                      cluster_dims: tuple[int, int, int] = (1, 1, 1)
                      ) -> CudaLauncher | CudaLauncherEx:
        """A launcher for ``function`` with blocks of ``num_threads`` threads.

        Plain launches use ``cuLaunchKernel`` with ``kernelParams`` pointing into the packed
        buffer; a cooperative, PDL or cluster launch uses ``cuLaunchKernelEx`` with launch attributes
        and per-parameter pointers into the same buffer (one per non-padding struct item).
        With clusters the grid given to the launcher counts clusters (Triton's programs)
        and each dimension is multiplied by ``cluster_dims``.
        """
        cluster = tuple(int(c) for c in cluster_dims)
        if not 1 <= num_threads <= 1024 or shared < 0 or len(cluster) != 3 \
                or min(cluster) < 1:
            raise LaunchError(f"invalid launch shape: num_threads={num_threads} (1..1024), "
                              f"shared={shared} (>= 0), cluster_dims={cluster_dims}")
        device = self._functions.device(function, 0)
        symbol = self._functions.symbol(function)
        pdl = pdl and self._pdl
        if not (cooperative or pdl or cluster != (1, 1, 1)):
            return CudaLauncher(self, function, symbol, device, struct, num_threads, shared)
        if cluster[0] * cluster[1] * cluster[2] > _PORTABLE_CLUSTER:
            self.check(self._cuFuncSetAttribute(
                function, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                f"cuFuncSetAttribute({symbol}, NON_PORTABLE_CLUSTER_SIZE_ALLOWED)")
        return CudaLauncherEx(self, self._kernel_ex(), function, symbol, device, struct,
                              num_threads, shared, cooperative, pdl, cluster)

    def _kernel_ex(self) -> ctypes._CFuncPtr:
        if "cuLaunchKernelEx" not in self._optional and not hasattr(self._lib, "cuLaunchKernelEx"):
            raise UnsupportedError("cooperative, PDL and cluster launches need "
                                   "cuLaunchKernelEx (NVIDIA driver for CUDA 12.0 or newer)")
        return self._optional_fn("cuLaunchKernelEx")

    # ------------------------------------------------------------------ memory and streams

    def alloc(self, device: int, nbytes: int) -> int:
        """``nbytes`` of device memory on ``device`` (never freed: scratch lives as long as
        the kernels that use it). 0 bytes gives the null pointer."""
        if nbytes == 0:
            return 0
        ptr = c_uint64()
        with self._on_device(device):
            self.check(self._cuMemAlloc_v2(byref(ptr), nbytes),
                       f"cuMemAlloc_v2({nbytes} bytes, device {device})")
        return ptr.value

    def is_capturing(self, stream: int) -> bool:
        """Whether ``stream`` is being captured into a CUDA graph (active or invalidated)."""
        status = c_int()
        self.check(self._cuStreamIsCapturing(stream, byref(status)), "cuStreamIsCapturing")
        return status.value != 0

    def synchronize(self, device: int) -> None:
        """Wait for all work on ``device`` (``cuCtxSynchronize`` in its primary context)."""
        with self._on_device(device):
            self.check(self._cuCtxSynchronize(), f"cuCtxSynchronize(device {device})")

    # ------------------------------------------------------------------ events and graphs
    # What aotriton_rt.scratch needs to give each stream and each captured graph its own
    # global scratch. Calls that name a stream run in that stream's context; the legacy and
    # per-thread handles (0, 1, 2) mean the current context, so those retry in ``device``'s
    # primary context when the thread has none.

    def _optional_fn(self, name: str) -> ctypes._CFuncPtr:
        fn = self._optional.get(name)
        if fn is None:
            fn = self._optional[name] = _bind(self._lib, name, _OPTIONAL_SIGNATURES[name], self.library_path)
        return fn

    def _stream_call(self, device: int, call: str, fn: ctypes._CFuncPtr, *args: object) -> None:
        status = fn(*args)
        if status == CUDA_ERROR_INVALID_CONTEXT:
            with self._on_device(device):
                status = fn(*args)
        self.check(status, call)

    def capture_info(self, device: int, stream: int) -> tuple[int, int, int]:
        """``(status, id, graph)`` of ``stream``'s capture: status 0 when it is not capturing,
        1 while capturing (``id`` unique in the process, ``graph`` the graph being built),
        2 when the capture was invalidated."""
        status, ident, graph = c_int(), c_uint64(), c_void_p()
        self._stream_call(device, "cuStreamGetCaptureInfo", self._optional_fn("cuStreamGetCaptureInfo_v2"),
                          stream, byref(status), byref(ident), byref(graph), None, None)
        return status.value, ident.value, graph.value or 0

    def capture_probe(self) -> Callable[[int], int]:
        """A cheap ``probe(stream)``: 0 when ``stream`` is not capturing a graph, else non-zero
        (then ask :meth:`capture_info`). One preallocated result: not for concurrent use."""
        status = c_int()
        ref = byref(status)
        query = self._cuStreamIsCapturing

        def probe(stream: int) -> int:
            if query(stream, ref):
                return 1  # unknown (e.g. no context): take the careful path, capture_info says
            return status.value

        return probe

    def event_recorder(self) -> Callable[[int, int], int]:
        """``cuEventRecord`` itself: ``record(event, stream)`` returns the status; on a
        non-zero status call :meth:`event_record`, which retries in context and raises."""
        return self._optional_fn("cuEventRecord")

    def event_create(self, device: int) -> int:
        """A new event without timing in ``device``'s primary context."""
        event = c_void_p()
        with self._on_device(device):
            self.check(self._optional_fn("cuEventCreate")(byref(event), CU_EVENT_DISABLE_TIMING),
                       f"cuEventCreate(device {device})")
        return event.value

    def event_record(self, device: int, event: int, stream: int) -> None:
        """Record ``event`` on ``stream``: it completes once the work queued there so far has."""
        self._stream_call(device, "cuEventRecord", self._optional_fn("cuEventRecord"), event, stream)

    def stream_wait_event(self, device: int, stream: int, event: int) -> None:
        """Make work queued on ``stream`` from now on wait for ``event`` (on the device)."""
        self._stream_call(device, "cuStreamWaitEvent", self._optional_fn("cuStreamWaitEvent"), stream, event, 0)

    def free(self, device: int, ptr: int, event: int = 0) -> None:
        """Wait for ``event`` (when given) on the host, destroy it, then free ``ptr``. Runs with
        relaxed capture rules so that a graph captured by another thread is not invalidated."""
        with self._on_device(device), self._relaxed():
            if event:
                self.check(self._optional_fn("cuEventSynchronize")(event), "cuEventSynchronize")
                self.check(self._optional_fn("cuEventDestroy_v2")(event), "cuEventDestroy")
            if ptr:
                self.check(self._optional_fn("cuMemFree_v2")(ptr), f"cuMemFree({ptr:#x}, device {device})")

    def alloc_relaxed(self, device: int, nbytes: int) -> int:
        """:meth:`alloc` while a graph is being captured: with the thread's capture rules relaxed
        for the call (``cuMemAlloc`` is not stream-ordered, so the capture does not record it)."""
        with self._relaxed():
            return self.alloc(device, nbytes)

    @contextmanager
    def _relaxed(self) -> Iterator[None]:
        mode = c_int(CU_STREAM_CAPTURE_MODE_RELAXED)
        exchange = self._optional_fn("cuThreadExchangeStreamCaptureMode")
        self.check(exchange(byref(mode)), "cuThreadExchangeStreamCaptureMode")
        try:
            yield
        finally:
            self.check(exchange(byref(mode)), "cuThreadExchangeStreamCaptureMode(restore)")

    def retain_in_graph(self, graph: int, data: int, destroy: ctypes._CFuncPtr) -> bool:
        """Tie ``data`` to ``graph``'s life: ``destroy(data)`` runs (on a driver thread, once every
        launch of the graph and its executables has finished) when the last of them is destroyed.
        ``destroy`` must stay referenced and must not call the driver. Returns True."""
        obj = c_void_p()
        self.check(self._optional_fn("cuUserObjectCreate")(
            byref(obj), data, ctypes.cast(destroy, c_void_p), 1, CU_USER_OBJECT_NO_DESTRUCTOR_SYNC),
            "cuUserObjectCreate")
        self.check(self._optional_fn("cuGraphRetainUserObject")(graph, obj, 1, CU_GRAPH_USER_OBJECT_MOVE),
                   "cuGraphRetainUserObject")
        return True


class _LauncherBase:
    """The argument buffer shared by both CUDA launch paths, allocated once."""

    __slots__ = ("_driver", "_function", "_symbol", "_device", "_struct", "_pack", "_buf",
                 "_size", "_block", "_shared", "_lock", "_context", "_current", "_current_ref",
                 "_get_current", "__weakref__")

    def __init__(self, driver: CudaDriver, function: int, symbol: str, device: int,
                 layout: struct.Struct, num_threads: int, shared: int) -> None:
        self._driver = driver
        self._function = function
        self._symbol = symbol
        self._device = device
        self._struct = layout
        self._pack = layout.pack_into
        # One byte at least: a zero-length ctypes buffer has no stable address.
        self._buf = ctypes.create_string_buffer(max(layout.size, 1))
        self._size = c_size_t(layout.size)
        self._block = num_threads
        self._shared = shared
        # The buffer is shared by all callers and ctypes drops the GIL during the call.
        self._lock = threading.Lock()
        # The context the function lives in, and a preallocated slot (used under the lock)
        # for the thread's current one: the common-path check is one call and one compare.
        self._context = driver._primary_context(device)
        self._current = c_void_p()
        self._current_ref = ctypes.pointer(self._current)
        self._get_current = driver._cuCtxGetCurrent

    def _in_context(self, launch: ctypes._CFuncPtr, *args: object) -> int:
        """``launch(*args)`` with the function's context current; the caller's restored after.

        Called under the lock when the current context is not the function's: another
        device's (``torch.cuda.set_device(0)`` with tensors on ``cuda:1``) is pushed aside
        for the launch and popped back; a thread without a context keeps the function's.
        """
        driver = self._driver
        if self._current.value is None:
            driver.check(driver._cuCtxSetCurrent(self._context), f"cuCtxSetCurrent(device {self._device})")
            return launch(*args)
        driver.check(driver._cuCtxPushCurrent_v2(self._context), f"cuCtxPushCurrent(device {self._device})")
        try:
            return launch(*args)
        finally:
            popped = c_void_p()
            driver.check(driver._cuCtxPopCurrent_v2(byref(popped)), f"cuCtxPopCurrent(device {self._device})")

    def _bad_values(self, values: tuple, exc: struct.error) -> ArgumentError:
        return ArgumentError(f"cannot pack the {len(values)} launch arguments of {self._symbol} "
                             f"with format {self._struct.format!r}: {exc}")

    _API = ""  # the driver call a launch failure is reported under (each launcher sets it)

    def _failed(self, status: int, gx: int, gy: int, gz: int, stream: int,
                values: tuple) -> None:
        self._driver.check(status, f"{self._API}({self._describe(gx, gy, gz, stream)})")

    def _describe(self, gx: int, gy: int, gz: int, stream: int) -> str:
        return (f"{self._symbol}, grid=({gx}, {gy}, {gz}), block=({self._block}, 1, 1), "
                f"shared={self._shared}, stream={stream:#x}")

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self._symbol} device={self._device} "
                f"block={self._block} shared={self._shared} args={self._struct.format!r}>")


class CudaLauncher(_LauncherBase):
    """``cuLaunchKernel`` over the packed buffer: through ``kernelParams`` (the default) or
    through ``extra``.

    ``kernelParams`` is an array of fixed pointers into the buffer (each parameter's place in
    it never changes), so either way a launch is one pack and one call. The call releases the
    GIL (ctypes' way: a launch that blocks on a full queue must not stall other Python threads);
    ``mode="extra"`` and a GIL-holding ``_launch`` are what bench/launch_overhead.py compares.
    """

    __slots__ = ("_launch", "_kernel_params", "_extra")
    _API = "cuLaunchKernel"

    def __init__(self, driver: CudaDriver, function: int, symbol: str, device: int,
                 layout: struct.Struct, num_threads: int, shared: int, mode: str = "params") -> None:
        super().__init__(driver, function, symbol, device, layout, num_threads, shared)
        self._launch = driver._cuLaunchKernel
        base = ctypes.addressof(self._buf)
        if mode == "extra":
            self._kernel_params = None
            self._extra = (c_void_p * 5)(CU_LAUNCH_PARAM_BUFFER_POINTER, base,
                                         CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(self._size),
                                         CU_LAUNCH_PARAM_END)
        else:
            offsets = struct_field_offsets(layout)
            self._kernel_params = (c_void_p * max(len(offsets), 1))(*(base + o for o in offsets))
            self._extra = None

    def __call__(self, gx: int, gy: int, gz: int, stream: int, values: tuple) -> None:
        """Pack ``values`` and launch a (gx, gy, gz) grid on ``stream``; see ``Launcher``."""
        if not (gx and gy and gz):
            return
        with self._lock:
            try:
                self._pack(self._buf, 0, *values)
            except struct.error as exc:
                raise self._bad_values(values, exc) from None
            self._get_current(self._current_ref)
            if self._current.value == self._context:
                status = self._launch(self._function, gx, gy, gz, self._block, 1, 1, self._shared,
                                      stream, self._kernel_params, self._extra)
            else:
                status = self._in_context(self._launch, self._function, gx, gy, gz, self._block, 1, 1,
                                          self._shared, stream, self._kernel_params, self._extra)
        if status:
            self._failed(status, gx, gy, gz, stream, values)


class CudaLauncherEx(_LauncherBase):
    """``cuLaunchKernelEx`` with cooperative / PDL / cluster attributes."""

    __slots__ = ("_launch", "_config", "_attrs", "_params", "_cluster")
    _API = "cuLaunchKernelEx"

    def __init__(self, driver: CudaDriver, launch: ctypes._CFuncPtr, function: int, symbol: str,
                 device: int, layout: struct.Struct, num_threads: int, shared: int,
                 cooperative: bool, pdl: bool, cluster: tuple[int, int, int]) -> None:
        super().__init__(driver, function, symbol, device, layout, num_threads, shared)
        self._launch = launch
        self._cluster = cluster
        attrs: list[CUlaunchAttribute] = []
        if pdl:
            attr = CUlaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        if cooperative:
            attr = CUlaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_COOPERATIVE)
            attr.value.cooperative = 1
            attrs.append(attr)
        if cluster != (1, 1, 1):
            attr = CUlaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
            attrs.append(attr)
            attr = CUlaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE)
            attr.value.clusterSchedulingPolicyPreference = CU_CLUSTER_SCHEDULING_POLICY_SPREAD
            attrs.append(attr)
        self._attrs = (CUlaunchAttribute * len(attrs))(*attrs)
        self._config = CUlaunchConfig(blockDimX=num_threads, blockDimY=1, blockDimZ=1,
                                      sharedMemBytes=shared, attrs=self._attrs,
                                      numAttrs=len(attrs))
        # cuLaunchKernelEx refuses `extra` for cooperative kernels (as cuLaunchCooperativeKernel
        # has none): pass kernelParams, one pointer per parameter into the packed buffer.
        base = ctypes.addressof(self._buf)
        offsets = struct_field_offsets(layout)
        self._params = (c_void_p * max(len(offsets), 1))(*(base + o for o in offsets))

    def __call__(self, gx: int, gy: int, gz: int, stream: int, values: tuple) -> None:
        """Pack ``values`` and launch (gx, gy, gz) clusters on ``stream``; see ``Launcher``."""
        if not (gx and gy and gz):
            return
        cx, cy, cz = self._cluster
        with self._lock:
            try:
                self._pack(self._buf, 0, *values)
            except struct.error as exc:
                raise self._bad_values(values, exc) from None
            config = self._config
            config.gridDimX, config.gridDimY, config.gridDimZ = gx * cx, gy * cy, gz * cz
            config.hStream = stream
            self._get_current(self._current_ref)
            if self._current.value == self._context:
                status = self._launch(config, self._function, self._params, None)
            else:
                status = self._in_context(self._launch, config, self._function, self._params, None)
        if status:
            self._failed(status, gx, gy, gz, stream, values)

