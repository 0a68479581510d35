"""Device arrays of any framework -> device pointer, device index, layout and stream.

The launch path calls :func:`pointer` once per array argument, so it is built for speed:
the way to read an object is chosen once per exact ``type(obj)`` and cached in
``_HANDLERS``; a torch tensor then costs ``get_device()`` + ``data_ptr()`` and a dict
lookup. Objects are recognised in this order:

1. torch tensors (``data_ptr()``/``get_device()``), CuPy arrays (``.data.ptr``/``.device.id``);
2. ``__cuda_array_interface__`` (versions 0-3), e.g. Numba device arrays;
3. DLPack (``__dlpack_device__`` + ``__dlpack__``), legacy and versioned capsules; JAX
   arrays always take this path.

Operators call :func:`describe` for dtype, shape and strides, :func:`current_stream` for
the framework's stream and :func:`empty` to allocate outputs.

No framework is imported by this module: a torch tensor can only exist once torch is in
``sys.modules``, so that is where the classes are looked up, when an unknown type is first
seen.

Lifetime: every pointer returned here is borrowed from the object passed in. It stays valid
while that object is alive, exactly as ``tensor.data_ptr()`` does; keep the object referenced
until the kernel that reads it is enqueued (stream-ordered frees then keep it safe). A DLPack
capsule is consumed and its deleter called before :func:`pointer` returns: the capsule only
holds a second reference to memory the producer object already keeps alive.
"""

from __future__ import annotations

import ctypes
import importlib
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aotriton_rt.errors import ArgumentError, UnsupportedError

__all__ = [
    "ArrayInfo",
    "current_stream",
    "describe",
    "empty",
    "pointer",
    "set_pointer_device_resolver",
]


@dataclass(frozen=True)
class ArrayInfo:
    """What an operator needs to know about one device array.

    ``dtype`` is a Triton type name (``"fp16"``, ``"bf16"``, ``"fp32"``, ``"i32"``,
    ``"u8"``, ``"i1"`` for booleans as the catalog spells them, ``"fp8e4nv"``...), ``strides``
    are in elements, ``device`` is the device ordinal (-1 when unknown: a
    ``__cuda_array_interface__`` pointer with no resolver installed). ``stream`` is the
    producer's stream when the protocol names one (``__cuda_array_interface__`` v3: 1 legacy
    default, 2 per-thread default, or a handle); the consumer must order its launch after it.
    ``readonly`` comes from the CAI ``data`` tuple or the DLPack read-only flag.
    """

    ptr: int
    device: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    framework: str
    stream: int | None = None
    readonly: bool = False


# ---------------------------------------------------------------------------------------
# Names and small helpers

def _type_name(obj: object) -> str:
    tp = type(obj)
    module = tp.__module__
    return tp.__qualname__ if module == "builtins" else f"{module}.{tp.__qualname__}"


# numpy-style typestr (as in __cuda_array_interface__, also CuPy's dtype.str) -> Triton name.
# '|' is "not applicable" byte order; '<' is little endian, which every supported GPU is.
_TYPESTR_DTYPES = {
    "f2": "fp16", "f4": "fp32", "f8": "fp64",
    "i1": "i8", "i2": "i16", "i4": "i32", "i8": "i64",
    "u1": "u8", "u2": "u16", "u4": "u32", "u8": "u64",
    "b1": "i1",
}

# DLPack (type code, bits) -> Triton name. Codes from dlpack.h (DLDataTypeCode).
_DLPACK_DTYPES = {
    (0, 8): "i8", (0, 16): "i16", (0, 32): "i32", (0, 64): "i64",
    (1, 8): "u8", (1, 16): "u16", (1, 32): "u32", (1, 64): "u64",
    (2, 16): "fp16", (2, 32): "fp32", (2, 64): "fp64",
    (4, 16): "bf16",
    (6, 8): "i1",
    (9, 8): "fp8e4b15", (10, 8): "fp8e4nv", (11, 8): "fp8e4b8",
    (12, 8): "fp8e5", (13, 8): "fp8e5b16",
}
_DLPACK_CODE_NAMES = {
    0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat", 5: "complex", 6: "bool",
    7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn",
    11: "float8_e4m3fnuz", 12: "float8_e5m2", 13: "float8_e5m2fnuz", 14: "float8_e8m0fnu",
    15: "float6_e2m3fn", 16: "float6_e3m2fn", 17: "float4_e2m1fn",
}

# Triton name -> torch dtype attribute name (also the NumPy/CuPy dtype name where one exists).
# Booleans are "i1" in the catalog; Triton 3.6 itself canonicalises them to "u1", accepted too.
_TRITON_TO_TORCH = {
    "fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64",
    "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
    "u1": "bool", "i1": "bool",
    "fp8e4nv": "float8_e4m3fn", "fp8e5": "float8_e5m2",
    "fp8e4b8": "float8_e4m3fnuz", "fp8e5b16": "float8_e5m2fnuz",
}

_FIX_MOVE = "move it to the GPU first"
_FIX_UNKNOWN = ("pass a torch, CuPy or JAX GPU array, an object with __cuda_array_interface__ "
                "or __dlpack__, or a raw device pointer with allow_raw=True, device=N")


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


# ---------------------------------------------------------------------------------------
# Pointer -> device resolver for __cuda_array_interface__ (the protocol has no device field)

_device_of: Callable[[int], int] | None = None


def set_pointer_device_resolver(fn: Callable[[int], int] | None) -> None:
    """Install the function that maps a device pointer to its device ordinal.

    ``__cuda_array_interface__`` does not say on which device its pointer lives; the
    library installs a resolver backed by the driver (``cuPointerGetAttribute`` with
    ``CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL``, or its HIP twin) so that this module need
    not import a driver. Without one, such arrays report device -1 ("unknown").
    ``None`` removes the resolver. Exceptions the resolver raises propagate.

    Example::

        interop.set_pointer_device_resolver(driver.pointer_device)
    """
    global _device_of
    _device_of = fn


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


# ---------------------------------------------------------------------------------------
# __cuda_array_interface__

def _cai_stream(cai: dict, obj: object) -> int | None:
    stream = cai.get("stream")
    if stream == 0:
        raise ArgumentError(
            f"{_type_name(obj)}.__cuda_array_interface__ has stream 0, which the protocol "
            f"forbids as ambiguous; the producer must give None, 1 (legacy default stream), "
            f"2 (per-thread default stream) or a stream handle")
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


# ---------------------------------------------------------------------------------------
# Refusals and per-instance probing

def _refusal(obj: Any) -> ArgumentError:
    name = _type_name(obj)
    if isinstance(obj, bool) or not isinstance(obj, int):
        if hasattr(obj, "__array_interface__"):
            return ArgumentError(f"{name} is a host (CPU) array (it has __array_interface__); "
                                 f"{_FIX_MOVE}, e.g. with cupy.asarray() or torch.as_tensor(..., "
                                 f"device='cuda')")
        return ArgumentError(f"cannot pass {name} as a GPU array: it is not a torch tensor and "
                             f"has neither __cuda_array_interface__ nor __dlpack__; {_FIX_UNKNOWN}")
    return ArgumentError(f"got a raw integer ({obj:#x}) where a GPU array was expected; pass "
                         f"a framework array, or allow_raw=True with device=N if it really is "
                         f"a device pointer")


def _refuse_pointer(obj: Any, backend: str, stream: int | None) -> tuple[int, int]:
    raise _refusal(obj)


def _refuse_describe(obj: Any, backend: str, stream: int | None) -> ArrayInfo:
    raise _refusal(obj)


def _probe_pointer(obj: Any, backend: str, stream: int | None) -> tuple[int, int]:
    # Types that carry no protocol on the class may still set one on the instance.
    if getattr(obj, "__cuda_array_interface__", None) is not None:
        return _cai_pointer(obj, backend, stream)
    if getattr(obj, "__dlpack__", None) is not None:
        return _dlpack_pointer(obj, backend, stream)
    raise _refusal(obj)


def _probe_describe(obj: Any, backend: str, stream: int | None) -> ArrayInfo:
    if getattr(obj, "__cuda_array_interface__", None) is not None:
        return _cai_describe(obj, backend, stream)
    if getattr(obj, "__dlpack__", None) is not None:
        return _dlpack_describe(obj, backend, stream)
    raise _refusal(obj)


# ---------------------------------------------------------------------------------------
# Handler selection, once per exact type

_Pointer = Callable[[Any, str, "int | None"], tuple[int, int]]
_Describe = Callable[[Any, str, "int | None"], ArrayInfo]
_HANDLERS: dict[type, _Pointer] = {}
_DESCRIBERS: dict[type, _Describe] = {}
_FRAMEWORK_HANDLERS: dict[str, tuple[Callable, Callable]] = {}


def _framework_handlers(name: str, make: Callable[[], tuple[Callable, Callable]]
                        ) -> tuple[Callable, Callable]:
    pair = _FRAMEWORK_HANDLERS.get(name)
    if pair is None:
        pair = _FRAMEWORK_HANDLERS[name] = make()
    return pair


def _is_instance(obj: object, module: str, attr: str) -> bool:
    # Only a module already imported can have produced obj; never import one here.
    mod = sys.modules.get(module)
    cls = getattr(mod, attr, None) if mod is not None else None
    return isinstance(cls, type) and isinstance(obj, cls)


def _select(obj: object) -> tuple[_Pointer, _Describe]:
    tp = type(obj)
    if _is_instance(obj, "torch", "Tensor"):
        pair = _framework_handlers("torch", _torch_handlers)
    elif _is_instance(obj, "cupy", "ndarray"):
        pair = _framework_handlers("cupy", _cupy_handlers)
    elif tp.__module__.partition(".")[0] in ("jax", "jaxlib") and hasattr(tp, "__dlpack__"):
        pair = _framework_handlers("jax", lambda: _make_dlpack_handlers("jax"))
    elif hasattr(tp, "__cuda_array_interface__"):
        pair = (_cai_pointer, _cai_describe)
    elif hasattr(tp, "__dlpack__"):
        pair = (_dlpack_pointer, _dlpack_describe)
    elif isinstance(obj, int) or hasattr(tp, "__array_interface__") or tp.__module__ == "builtins":
        # Not cached: the launch path gives None and raw ints their own meaning (an unused
        # pointer; an address with raw_pointers=True), which one refused describe(None) or
        # pointer(5) must not overrule for the rest of the process.
        return _refuse_pointer, _refuse_describe
    else:
        pair = (_probe_pointer, _probe_describe)
    _HANDLERS[tp], _DESCRIBERS[tp] = pair
    return pair


def _raw(obj: Any, device: int | None) -> tuple[int, int]:
    if isinstance(obj, bool) or not isinstance(obj, int):
        raise _refusal(obj)
    if device is None or device < 0:
        raise ArgumentError(f"allow_raw=True needs device=N (got {device!r}): a raw pointer "
                            f"({obj:#x}) does not say which GPU it lives on")
    if not 0 <= obj < 1 << 64:
        raise ArgumentError(f"raw pointer {obj:#x} does not fit in 64 bits")
    return obj, device


# ---------------------------------------------------------------------------------------
# Public API

def pointer(obj: Any, *, backend: str = "cuda", stream: int | None = None,
            allow_raw: bool = False, device: int | None = None) -> tuple[int, int]:
    """Return ``(device pointer, device index)`` of a GPU array.

    Args:
        obj: a torch tensor, CuPy array, JAX array, or any object exposing
            ``__cuda_array_interface__`` or DLPack.
        backend: ``"cuda"`` or ``"hip"``, the backend of the kernel that will read it.
        stream: the raw stream handle the launch goes on, handed to DLPack producers so
            that they order their pending work before it; ``None``: let the producer assume
            the legacy default stream.
        allow_raw: accept a plain ``int`` as a device pointer (refused otherwise: an int is
            far more often a mistake than a pointer).
        device: the device of a raw pointer; required with ``allow_raw``.

    Returns:
        The pointer (including any view offset) and the device ordinal; the device is -1
        for ``__cuda_array_interface__`` arrays when no resolver is installed (see
        :func:`set_pointer_device_resolver`). The pointer is borrowed: keep ``obj`` alive
        until the kernel is enqueued.

    Raises:
        ArgumentError: CPU or host memory, meta/sparse torch tensors, a device of another
            backend, an unknown object, or a malformed protocol answer.

    Example::

        ptr, dev = pointer(torch.ones(4, device="cuda"))
    """
    if allow_raw and isinstance(obj, int):
        return _raw(obj, device)
    try:
        handler = _HANDLERS[type(obj)]
    except KeyError:
        handler = _select(obj)[0]
    return handler(obj, backend, stream)


def describe(obj: Any, *, backend: str = "cuda", stream: int | None = None) -> ArrayInfo:
    """Return an :class:`ArrayInfo` (pointer, device, Triton dtype, shape, strides in
    elements, framework, producer stream) for a GPU array.

    Arguments, lifetime and errors as for :func:`pointer`; additionally raises
    :class:`ArgumentError` for a dtype Triton kernels do not take (complex, vector lanes,
    big-endian) and for strides that are not whole elements.

    Example::

        info = describe(x)            # ArrayInfo(ptr=..., dtype='fp16', shape=(4, 8), ...)
        if info.strides[-1] != 1: ...
    """
    try:
        handler = _DESCRIBERS[type(obj)]
    except KeyError:
        handler = _select(obj)[1]
    return handler(obj, backend, stream)


_STREAM_GETTERS: dict[str, Callable[[int], int]] = {}


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
    getter = _STREAM_GETTERS.get(framework)
    if getter is None:
        if framework == "torch":
            getter = _torch_stream_getter()
        elif framework == "cupy":
            getter = _cupy_stream_getter()
        else:
            return 0
        _STREAM_GETTERS[framework] = getter
    return getter(device)


def empty(framework: str, shape: int | tuple[int, ...], dtype: str, device: int,
          like: Any = None) -> Any:
    """Allocate an uninitialised output array of ``framework`` on GPU ``device``.

    Args:
        framework: ``"torch"`` or ``"cupy"`` (usually ``ArrayInfo.framework`` of an input).
        shape: the extents.
        dtype: a Triton type name, e.g. ``"fp16"``.
        device: the device ordinal.
        like: an input array; for torch, its ``device`` is reused as is.

    Raises:
        UnsupportedError: other frameworks (JAX arrays are immutable, raw protocols have no
            allocator) or a dtype the framework lacks; pass a preallocated ``out=`` instead.
        ArgumentError: an unknown dtype name or a negative device.

    Example::

        out = empty("torch", (4, 8), "fp16", 0)
    """
    if dtype not in _TRITON_TO_TORCH:
        raise ArgumentError(f"unknown dtype {dtype!r}; expected a Triton name such as "
                            + ", ".join(sorted(_TRITON_TO_TORCH)))
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if framework == "torch":
        torch = importlib.import_module("torch")
        torch_dtype = getattr(torch, _TRITON_TO_TORCH[dtype], None)
        if torch_dtype is None:
            raise UnsupportedError(f"torch {torch.__version__} has no dtype "
                                   f"{_TRITON_TO_TORCH[dtype]} for {dtype}; pass out=")
        where = like.device if _is_instance(like, "torch", "Tensor") else None
        if where is None:
            if device < 0:
                raise ArgumentError(f"cannot allocate on device {device}; pass a device ordinal")
            where = torch.device("cuda", device)
        return torch.empty(shape, dtype=torch_dtype, device=where)
    if framework == "cupy":
        if dtype == "bf16" or dtype.startswith("fp8"):
            raise UnsupportedError(f"CuPy has no {dtype} dtype; pass out= (e.g. a torch tensor)")
        if device < 0:
            raise ArgumentError(f"cannot allocate on device {device}; pass a device ordinal")
        cupy = importlib.import_module("cupy")
        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=_TRITON_TO_TORCH[dtype])
    raise UnsupportedError(
        f"cannot allocate the output as a {framework!r} array: aotriton-rt allocates only "
        f"torch tensors and CuPy arrays; pass out= with a preallocated GPU array")
