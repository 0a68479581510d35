"""The framework-neutral protocols: ``__cuda_array_interface__`` (versions 0-3) and DLPack
(legacy and versioned capsules), read without importing any framework."""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable
from typing import Any

from aotriton_rt.errors import ArgumentError

from .arrays import (
    _DLPACK_CODE_NAMES,
    _DLPACK_DTYPES,
    _FIX_MOVE,
    _FIX_UNKNOWN,
    _TYPESTR_DTYPES,
    ArrayInfo,
    _contiguous_strides,
    _type_name,
)

# ---------------------------------------------------------------------------------------
# Pointer -> device resolver for __cuda_array_interface__ (the protocol has no device field)

_device_of: Callable[[int], int] | None = None


def set_pointer_device_resolver(fn: Callable[[int], int] | None) -> None:
    """Install the function that maps a device pointer to its device ordinal.

    ``__cuda_array_interface__`` does not say on which device its pointer lives. Nothing in
    aotriton-rt installs a resolver: such arrays report device -1 ("unknown"), and the launch
    path then checks only the arrays whose device is known. An application that can tell (e.g.
    through ``cuPointerGetAttribute``) may install one; tests install one to stand in for a
    second GPU. ``None`` removes it. Exceptions the resolver raises propagate.

    Example::

        interop.set_pointer_device_resolver(lambda ptr: 1 if ptr >= split else 0)
    """
    global _device_of
    _device_of = fn



def _typestr_dtype(typestr: str, what: str) -> tuple[str, int]:
    """Triton name and item size of a numpy-style typestr such as ``'<f4'``."""
    if len(typestr) < 3 or typestr[0] not in "<|=" or typestr[1:] not in _TYPESTR_DTYPES:
        raise ArgumentError(
            f"{what} has typestr {typestr!r}, which Triton kernels do not take; supported: "
            f"little-endian " + ", ".join(sorted(_TYPESTR_DTYPES)))
    return _TYPESTR_DTYPES[typestr[1:]], int(typestr[2:])


def _byte_strides(strides: Any, itemsize: int, what: str) -> tuple[int, ...]:
    out = []
    for s in strides:
        if s % itemsize:
            raise ArgumentError(f"{what} has byte strides {tuple(strides)} that are not multiples "
                                f"of the item size {itemsize}; make it contiguous first")
        out.append(s // itemsize)
    return tuple(out)


# ---------------------------------------------------------------------------------------
# __cuda_array_interface__

#: The largest raw stream handle: a pointer-sized unsigned integer (also what ``stream=`` of a
#: launch accepts, aotriton_rt.launch).
MAX_STREAM = 2**64 - 1
#: ``__cuda_array_interface__`` v3 ``stream`` 1 and 2 (the legacy and the per-thread default
#: stream) as each driver spells them. CUDA's CU_STREAM_LEGACY and CU_STREAM_PER_THREAD are
#: those very handles. HIP has no legacy handle of that meaning: its null stream (0) is the
#: blocking default stream, and it defines hipStreamPerThread as (hipStream_t)2.
_CAI_DEFAULT_STREAMS = {"cuda": (None, 1, 2), "hip": (None, 0, 2)}


def _cai_stream(cai: dict, obj: object) -> int | None:
    """The producer's ``stream`` of a CAI dict, checked as the v3 protocol defines it: None
    (nothing to wait for), 1 (legacy default stream), 2 (per-thread default stream) or a
    handle; 0 (ambiguous), negatives, values of 2**64 and more and non-integers are refused."""
    stream = cai.get("stream")
    if stream is None or (type(stream) is int and 0 < stream <= MAX_STREAM):
        return stream
    if stream == 0 and not isinstance(stream, (bool, float)):
        raise ArgumentError(
            f"{_type_name(obj)}.__cuda_array_interface__ has stream 0, which the protocol "
            f"forbids as ambiguous; the producer must give None, 1 (legacy default stream), "
            f"2 (per-thread default stream) or a stream handle")
    if not isinstance(stream, bool) and hasattr(type(stream), "__index__"):  # e.g. NumPy integers
        value = operator.index(stream)
        if 0 < value <= MAX_STREAM:
            return value
        shown = str(value)
    else:
        shown = f"{stream!r}"[:80] + f" ({_type_name(stream)})"
    raise ArgumentError(f"{_type_name(obj)}.__cuda_array_interface__ has stream {shown}, which is not a "
                        "stream handle: it must be None, 1, 2 or a handle in (2, 2**64) (CUDA Array "
                        "Interface v3); fix the producer or pass stream= explicitly")


def cai_launch_stream(obj: object, backend: str) -> int:
    """The raw stream handle to launch on after ``obj``'s producer stream on ``backend``
    (``__cuda_array_interface__`` v3), or ArgumentError naming ``obj``'s type; None is the
    default stream (0)."""
    stream = _cai_stream(_cai_dict(obj), obj)
    if stream is None or stream <= 2:
        return _CAI_DEFAULT_STREAMS[backend][stream or 0] or 0
    return stream


def _cai_dict(obj: object) -> dict:
    try:
        cai = obj.__cuda_array_interface__
    except Exception as exc:
        raise ArgumentError(f"{_type_name(obj)}.__cuda_array_interface__ is not available: "
                            f"{exc}; {_FIX_UNKNOWN}") from None
    if not isinstance(cai, dict):
        raise ArgumentError(f"{_type_name(obj)}.__cuda_array_interface__ is a "
                            f"{_type_name(cai)}, not a dict")
    return cai


def _cai_data(cai: dict, obj: object) -> tuple[int, bool]:
    data = cai.get("data")
    try:
        if not isinstance(data, (tuple, list)) or len(data) != 2:
            raise TypeError
        return operator.index(data[0]), bool(data[1])  # some producers give NumPy integers
    except TypeError:
        raise ArgumentError(f"{_type_name(obj)}.__cuda_array_interface__ has no valid 'data' "
                            f"entry (expected a (pointer, readonly) tuple), got {data!r}") from None


def _cai_device(ptr: int) -> int:
    # A zero-size array may report a NULL pointer, which no driver can place on a device.
    resolver = _device_of
    return resolver(ptr) if resolver is not None and ptr else -1


def _cai_pointer(obj: Any, backend: str, stream: int | None) -> tuple[int, int]:
    # Inlined happy path (this runs per argument per launch); the helpers explain failures.
    try:
        cai = obj.__cuda_array_interface__
        ptr = cai["data"][0]
        producer_stream = cai.get("stream")
    except Exception:
        cai = _cai_dict(obj)
        ptr = _cai_data(cai, obj)[0]
        producer_stream = cai.get("stream")
    if producer_stream == 0:
        _cai_stream(cai, obj)
    if type(ptr) is not int:
        ptr = _cai_data(cai, obj)[0]
    resolver = _device_of
    return ptr, (resolver(ptr) if resolver is not None and ptr else -1)


def _cai_describe(obj: Any, backend: str, stream: int | None) -> ArrayInfo:
    what = f"{_type_name(obj)}.__cuda_array_interface__"
    cai = _cai_dict(obj)
    producer_stream = _cai_stream(cai, obj)
    ptr, readonly = _cai_data(cai, obj)
    try:
        shape = tuple(int(n) for n in cai["shape"])
        typestr = cai["typestr"]
    except (KeyError, TypeError) as exc:
        raise ArgumentError(f"{what} lacks a valid 'shape'/'typestr' entry ({exc!r})") from None
    if cai.get("mask") is not None:
        raise ArgumentError(f"{what} has a mask; masked arrays cannot be passed to a kernel, "
                            f"fill the masked values first")
    dtype, itemsize = _typestr_dtype(typestr, what)
    strides = cai.get("strides")
    strides = (_contiguous_strides(shape) if strides is None
               else _byte_strides(strides, itemsize, what))
    if len(strides) != len(shape):
        raise ArgumentError(f"{what} has {len(strides)} strides for {len(shape)} dimensions")
    return ArrayInfo(ptr, _cai_device(ptr), dtype, shape, strides, "cai", producer_stream,
                     bool(readonly))


# ---------------------------------------------------------------------------------------
# DLPack

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):
    # version (2 x u32), manager_ctx and deleter are ABI-stable across major versions:
    # dlpack.h guarantees the deleter can be called whatever the major version.
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_kDLCPU, _kDLCUDA, _kDLCUDAHost, _kDLROCM, _kDLROCMHost, _kDLCUDAManaged = 1, 2, 3, 10, 11, 13
_DLPACK_DEVICE_NAMES = {
    1: "kDLCPU", 2: "kDLCUDA", 3: "kDLCUDAHost", 4: "kDLOpenCL", 7: "kDLVulkan", 8: "kDLMetal",
    9: "kDLVPI", 10: "kDLROCM", 11: "kDLROCMHost", 12: "kDLExtDev", 13: "kDLCUDAManaged",
    14: "kDLOneAPI", 15: "kDLWebGPU", 16: "kDLHexagon", 17: "kDLMAIA", 18: "kDLTrn",
}
# Device types a kernel of each backend can read directly.
_DLPACK_ACCEPTED = {"cuda": (_kDLCUDA, _kDLCUDAManaged), "hip": (_kDLROCM,)}
_DLPACK_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY
_MAX_VERSION = (1, 1)

# Capsule names must outlive the capsules that point at them: module constants do.
_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
_USED = b"used_dltensor"
_USED_VERSIONED = b"used_dltensor_versioned"

# Own prototypes rather than ctypes.pythonapi's shared function objects, whose argtypes
# other code may set differently. PYFUNCTYPE keeps the GIL held.
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", ctypes.pythonapi))
_capsule_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi))

# Deleters are called with the GIL held: NumPy's and others take it themselves (fine while
# held), some producers' deleters touch Python objects without taking it (unsafe if released).
_DeleterType = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)
_DELETERS: dict[int, Any] = {}


def _call_deleter(deleter: int | None, managed: int) -> None:
    if not deleter:
        return  # NULL deleter: the producer has nothing to release (allowed by dlpack.h)
    fn = _DELETERS.get(deleter)
    if fn is None:
        if len(_DELETERS) > 256:  # deleters are static functions; this only bounds odd cases
            _DELETERS.clear()
        fn = _DELETERS[deleter] = _DeleterType(deleter)
    fn(managed)


# Types whose __dlpack__ rejected max_version (pre-1.0 producers); asked without it next time.
_NO_MAX_VERSION: set[type] = set()


def _dlpack_stream(stream: int | None, backend: str) -> int | None:
    """The ``stream=`` to hand a producer for a launch on ``stream`` (a raw handle)."""
    # DLPack forbids 0 on CUDA (ambiguous) and spells the legacy default stream 1; on ROCm
    # 0 is the default stream and 1/2 are not allowed.
    if stream == 0 and backend == "cuda":
        return 1
    return stream


def _dlpack_capsule(obj: Any, stream: int | None) -> Any:
    tp = type(obj)
    kwargs = {} if stream is None else {"stream": stream}
    try:
        if tp not in _NO_MAX_VERSION:
            try:
                return obj.__dlpack__(max_version=_MAX_VERSION, **kwargs)
            except TypeError:
                capsule = obj.__dlpack__(**kwargs)
                _NO_MAX_VERSION.add(tp)
                return capsule
        return obj.__dlpack__(**kwargs)
    except Exception as exc:
        raise ArgumentError(f"{_type_name(obj)}.__dlpack__() failed: {exc}") from exc


def _check_dlpack_device(obj: Any, device_type: int, backend: str) -> None:
    if device_type in _DLPACK_ACCEPTED.get(backend, ()):
        return
    name = _type_name(obj)
    label = f"DLPack device type {device_type}"
    if device_type == _kDLCPU:
        raise ArgumentError(f"{name}: tensor is on the CPU ({label}); {_FIX_MOVE}")
    if device_type in (_kDLCUDAHost, _kDLROCMHost):
        raise ArgumentError(f"{name}: tensor is in pinned host memory ({label}, "
                            f"{_DLPACK_DEVICE_NAMES[device_type]}); {_FIX_MOVE}")
    if device_type in (_kDLCUDA, _kDLCUDAManaged, _kDLROCM):
        where = "a ROCm" if device_type == _kDLROCM else "a CUDA"
        raise ArgumentError(f"{name}: tensor is on {where} device ({label}) but the kernel is "
                            f"for {backend.upper()}; use kernels built for that backend")
    raise ArgumentError(
        f"{name}: tensor is on an unsupported device ({label}, "
        f"{_DLPACK_DEVICE_NAMES.get(device_type, 'unknown')}); aotriton-rt launches on CUDA "
        f"and ROCm GPUs only")


def _dlpack_read(obj: Any, backend: str, stream: int | None, full: bool
                 ) -> tuple[int, int, tuple | None, int]:
    """Consume one capsule from ``obj``: (ptr, device, layout or None, flags).

    ``layout`` is ``(code, bits, lanes, shape, strides)`` when ``full``; the shape and
    strides arrays belong to the capsule, so they are copied before its deleter runs.
    """
    dlpack_device = getattr(obj, "__dlpack_device__", None)
    if dlpack_device is not None:
        # Ask for the device first: a CPU producer only accepts stream=None, and refusing
        # here costs no capsule.
        device_type = int(dlpack_device()[0])
        _check_dlpack_device(obj, device_type, backend)
    capsule = _dlpack_capsule(obj, _dlpack_stream(stream, backend))
    if type(capsule).__name__ != "PyCapsule":
        raise ArgumentError(f"{_type_name(obj)}.__dlpack__() returned {_type_name(capsule)}, "
                            f"not a DLPack capsule")
    if _capsule_is_valid(capsule, _NAME_VERSIONED):
        managed = _capsule_get_pointer(capsule, _NAME_VERSIONED)
        _capsule_set_name(capsule, _USED_VERSIONED)
        versioned = True
    elif _capsule_is_valid(capsule, _NAME):
        managed = _capsule_get_pointer(capsule, _NAME)
        _capsule_set_name(capsule, _USED)
        versioned = False
    else:
        raw = _capsule_get_name(capsule)
        shown = raw.decode(errors="replace") if raw else None
        hint = ("it was already consumed; call __dlpack__() once per use"
                if shown in ("used_dltensor", "used_dltensor_versioned")
                else "expected 'dltensor' or 'dltensor_versioned'")
        raise ArgumentError(f"{_type_name(obj)}.__dlpack__() returned a capsule named "
                            f"{shown!r}: {hint}")
    # From the rename on, the capsule's destructor leaves the tensor alone and releasing it
    # is ours: every path below ends in exactly one deleter call.
    if versioned:
        head = _DLManagedTensorVersioned.from_address(managed)
        deleter = head.deleter
    else:
        head = _DLManagedTensor.from_address(managed)
        deleter = head.deleter
    try:
        if versioned and head.major != 1:
            raise ArgumentError(
                f"{_type_name(obj)} exports DLPack {head.major}.{head.minor}; aotriton-rt "
                f"reads DLPack 1.x; upgrade aotriton-rt or export with max_version=(1, 1)")
        flags = head.flags if versioned else 0
        t = head.dl_tensor
        device_type = t.device.device_type
        _check_dlpack_device(obj, device_type, backend)
        ptr = (t.data or 0) + t.byte_offset
        layout = None
        if full:
            ndim = t.ndim
            dtype = t.dtype
            if ndim < 0 or (ndim and not t.shape):
                raise ArgumentError(f"{_type_name(obj)} exported a malformed DLPack tensor "
                                    f"(ndim {ndim}, shape pointer {'set' if t.shape else 'NULL'})")
            shape = tuple(t.shape[i] for i in range(ndim))
            strides = (tuple(t.strides[i] for i in range(ndim)) if t.strides
                       else _contiguous_strides(shape))
            layout = (dtype.code, dtype.bits, dtype.lanes, shape, strides)
        return ptr, t.device.device_id, layout, flags
    finally:
        _call_deleter(deleter, managed)


def _dlpack_dtype(obj: Any, code: int, bits: int, lanes: int) -> str:
    dtype = _DLPACK_DTYPES.get((code, bits)) if lanes == 1 else None
    if dtype is None:
        kind = _DLPACK_CODE_NAMES.get(code, "unknown")
        vector = f" x {lanes} lanes" if lanes != 1 else ""
        raise ArgumentError(
            f"{_type_name(obj)} has DLPack dtype {kind}{bits}{vector} (code {code}, bits {bits}, "
            f"lanes {lanes}), which Triton kernels do not take; supported: "
            + ", ".join(sorted(set(_DLPACK_DTYPES.values()))))
    return dtype


def _make_dlpack_handlers(framework: str) -> tuple[Callable, Callable]:
    def dlpack_pointer(obj: Any, backend: str, stream: int | None) -> tuple[int, int]:
        ptr, device, _, _ = _dlpack_read(obj, backend, stream, False)
        return ptr, device

    def dlpack_describe(obj: Any, backend: str, stream: int | None) -> ArrayInfo:
        ptr, device, layout, flags = _dlpack_read(obj, backend, stream, True)
        code, bits, lanes, shape, strides = layout
        # The producer has ordered its work before `stream` (that is what stream= asks
        # for), so there is no producer stream left to wait on.
        return ArrayInfo(ptr, device, _dlpack_dtype(obj, code, bits, lanes), shape, strides,
                         framework, None, bool(flags & _DLPACK_READ_ONLY))

    return dlpack_pointer, dlpack_describe


_dlpack_pointer, _dlpack_describe = _make_dlpack_handlers("dlpack")
