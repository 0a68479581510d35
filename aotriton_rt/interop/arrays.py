"""What interop reports about a device array (:class:`ArrayInfo`), and the dtype tables and
names its readers share."""

from __future__ import annotations

from dataclasses import dataclass


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
