"""torch and CuPy: their arrays read through their own attributes (faster than the protocols),
and their current streams. Neither is imported until an array of it is seen."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from aotriton_rt.errors import ArgumentError

from .arrays import _FIX_MOVE, _TRITON_TO_TORCH, ArrayInfo, _type_name
from .protocols import _byte_strides, _typestr_dtype

# ---------------------------------------------------------------------------------------
# torch

def _torch_handlers() -> tuple[Callable, Callable]:
    torch = sys.modules["torch"]
    # A ROCm build of torch calls its HIP devices "cuda"; which runtime it really drives
    # decides which kernels its pointers can feed.
    torch_backend = "hip" if getattr(torch.version, "hip", None) else "cuda"
    dtypes = {getattr(torch, attr): name for name, attr in _TRITON_TO_TORCH.items()
              if name != "u1" and hasattr(torch, attr)}

    def refuse(t: Any, backend: str) -> ArgumentError:
        name = _type_name(t)
        if t.layout is not torch.strided:
            return ArgumentError(
                f"{name} with layout {t.layout} has no single data pointer; "
                f"pass a dense tensor, e.g. t.to_dense()")
        kind = t.device.type
        if kind == "cpu":
            return ArgumentError(
                f"{name} is on the CPU (device 'cpu'); {_FIX_MOVE}, e.g. t.cuda() or t.to('cuda')")
        if kind == "meta":
            return ArgumentError(
                f"{name} is on the 'meta' device and has no memory; "
                f"allocate it on the GPU, e.g. torch.empty(..., device='cuda')")
        if backend != torch_backend:
            return ArgumentError(
                f"{name} is a {torch_backend.upper()} tensor (torch {torch.__version__}) but the "
                f"kernel is for {backend.upper()}; use kernels built for {torch_backend.upper()} "
                f"or a torch build for {backend.upper()}")
        return ArgumentError(f"{name} on device {t.device} has no readable data pointer; "
                             f"pass a materialised GPU tensor")

    def torch_pointer(t: Any, backend: str, stream: int | None) -> tuple[int, int]:
        device = t.get_device()
        if device < 0 or backend != torch_backend:
            raise refuse(t, backend)
        try:
            return t.data_ptr(), device
        except RuntimeError:
            # Sparse tensors and storage-less tensors (fake/functional) land here.
            raise refuse(t, backend) from None

    def torch_describe(t: Any, backend: str, stream: int | None) -> ArrayInfo:
        ptr, device = torch_pointer(t, backend, stream)
        dtype = dtypes.get(t.dtype)
        if dtype is None:
            raise ArgumentError(f"{_type_name(t)} has dtype {t.dtype}, which Triton kernels "
                                f"do not take; convert it, e.g. t.float()")
        return ArrayInfo(ptr, device, dtype, tuple(t.shape), tuple(t.stride()), "torch")

    return torch_pointer, torch_describe


# ---------------------------------------------------------------------------------------
# CuPy

def _cupy_handlers() -> tuple[Callable, Callable]:
    cupy = sys.modules["cupy"]
    cupy_backend = "hip" if getattr(cupy.cuda.runtime, "is_hip", False) else "cuda"

    def cupy_pointer(a: Any, backend: str, stream: int | None) -> tuple[int, int]:
        if backend != cupy_backend:
            raise ArgumentError(
                f"{_type_name(a)} is a {cupy_backend.upper()} array but the kernel is for "
                f"{backend.upper()}; use kernels built for {cupy_backend.upper()}")
        # MemoryPointer.ptr already includes the view's offset; its device_id is a plain int
        # (a.device.id builds a Device object on every call).
        mem = a.data
        return mem.ptr, mem.device_id

    def cupy_describe(a: Any, backend: str, stream: int | None) -> ArrayInfo:
        ptr, device = cupy_pointer(a, backend, stream)
        what = _type_name(a)
        dtype, itemsize = _typestr_dtype(a.dtype.str, what)
        return ArrayInfo(ptr, device, dtype, tuple(a.shape),
                         _byte_strides(a.strides, itemsize, what), "cupy")

    return cupy_pointer, cupy_describe


_STREAM_GETTERS: dict[str, Callable[[int], int]] = {}


def stream_getter(framework: str) -> Callable[[int], int] | None:
    """The function ``device -> raw stream handle`` of ``framework``'s current stream
    (``"torch"`` or ``"cupy"``; found once, then cached), or None for any other framework, whose
    work is on the default stream (0). The launch path calls it once per launch; importing
    the framework is left to the caller (an array of it exists).

    Example::

        get = stream_getter("torch")
        stream = get(0) if get is not None else 0
    """
    getter = _STREAM_GETTERS.get(framework)
    if getter is None:
        if framework == "torch":
            getter = _torch_stream_getter()
        elif framework == "cupy":
            getter = _cupy_stream_getter()
        else:
            return None
        _STREAM_GETTERS[framework] = getter
    return getter


def _torch_stream_getter() -> Callable[[int], int]:
    torch = importlib.import_module("torch")
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw  # one C call, no Stream object
    return lambda device: torch.cuda.current_stream(device).cuda_stream


def _cupy_stream_getter() -> Callable[[int], int]:
    cupy = importlib.import_module("cupy")
    try:  # one C call returning the thread's current stream handle on the current device
        from cupy_backends.cuda.stream import get_current_stream_ptr
    except ImportError:
        get_current_stream_ptr = None

    def get(device: int) -> int:
        if get_current_stream_ptr is not None and cupy.cuda.runtime.getDevice() == device:
            return get_current_stream_ptr()
        try:
            return cupy.cuda.get_current_stream(device).ptr
        except TypeError:  # CuPy without the device_id argument: the current device's stream
            return cupy.cuda.get_current_stream().ptr

    return get


def current_stream(framework: str, device: int) -> int:
    """Return the raw stream handle the framework is currently issuing work to on ``device``.

    ``"torch"``: ``torch.cuda.current_stream(device)`` (read through the fast raw accessor);
    ``"cupy"``: ``cupy.cuda.get_current_stream()``; any other framework: 0, the default
    stream. Launching on this stream orders the kernel after the framework's earlier work
    without any synchronisation.

    Example::

        stream = current_stream(info.framework, info.device)
    """
    getter = _STREAM_GETTERS.get(framework) or stream_getter(framework)
    return 0 if getter is None else getter(device)
