"""Arrays: outputs and scratch allocated in the caller's framework (torch or CuPy), and operands
as the kernels address them (in place when possible, else a padded contiguous copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ... import interop
from .family import (
    ALIGN,
    BIAS_ALIGN,
    bhs,
    bias_row_width,
    bias_strides,
    contiguous_kernel_strides,
    contiguous_strides,
    kernel_strides,
)
from .family import lse_strides as contiguous_lse_strides
from .problem import I32_MAX, Problem, addressable


@dataclass
class Operand:
    """One (batch, heads, rows, dim) tensor as the kernels address it."""

    array: Any
    strides: tuple[int, int, int]  # batch, head, row (elements)


def operand(xp: Any, obj: Any, info: interop.ArrayInfo, layout: str, varlen: bool, width: int) -> Operand:
    """The array itself when addressable with rows of ``width``, else a zero-padded contiguous copy."""
    extents, strides = bhs(info.shape, info.strides, layout, varlen)
    strides = kernel_strides(extents, strides)
    if addressable(info, strides, width, ALIGN):
        return Operand(obj, strides)
    shape = tuple(info.shape[:-1]) + (width,)
    buf = xp.zeros(shape, info.dtype, obj) if width != info.shape[-1] else xp.empty(shape, info.dtype, obj)
    buf[..., :info.shape[-1]] = obj
    return Operand(buf, contiguous_kernel_strides(shape, layout, varlen))


class Output:
    """An output the kernel writes: the caller's array, a fresh exact one, or a padded buffer
    copied into the exact one afterwards."""

    def __init__(self, xp: Any, shape: tuple[int, ...], dtype: str, like: Any, layout: str, varlen: bool,
                 width: int, user: Any = None, user_info: interop.ArrayInfo | None = None,
                 fill: float | None = None) -> None:
        self.result = user
        self.buffer = None
        if user is not None:
            extents, strides = bhs(user_info.shape, user_info.strides, layout, varlen)
            strides = kernel_strides(extents, strides)
            if addressable(user_info, strides, width, ALIGN):
                self.array, self.strides = xp.convert(user, user_info), strides
                return
            self.target = xp.convert(user, user_info)
        padded = tuple(shape[:-1]) + (width,)
        if fill is not None:
            arr = xp.full(padded, fill, dtype, like)
        else:
            arr = xp.empty(padded, dtype, like)
        self.array, self.strides = arr, contiguous_kernel_strides(padded, layout, varlen)
        if user is None and width == shape[-1]:
            self.result = arr
        else:
            self.buffer = arr
            if user is None:
                self.target = xp.empty(shape, dtype, like)
                self.result = self.target

    def finish(self) -> Any:
        if self.buffer is not None:
            self.target[...] = self.buffer[..., :self.target.shape[-1]]
        return self.result


# ---------------------------------------------------------------------------------------------
# Validation: every argument checked before anything is allocated or launched.
# ---------------------------------------------------------------------------------------------


class LseOutput:
    """The fp32 logsumexp (or Delta) buffer and its (batch, head) strides; rows unit-strided."""

    def __init__(self, array: Any, strides: tuple[int, int], target: Any = None) -> None:
        self.array, self.strides, self.target = array, strides, target

    def finish(self) -> Any:
        if self.target is None:
            return self.array
        self.target[...] = self.array
        return self.target


def lse_strides(p: Problem, info: interop.ArrayInfo) -> tuple[int, int] | None:
    """Kernel strides of a caller's LSE array, or None when it must be copied."""
    if p.varlen:
        ok = info.shape[1] <= 1 or info.strides[1] == 1
        return (0, 0 if info.shape[0] <= 1 else info.strides[0]) if ok else None
    ok = info.shape[2] <= 1 or info.strides[2] == 1
    return (0 if info.shape[0] <= 1 else info.strides[0], 0 if info.shape[1] <= 1 else info.strides[1]) if ok \
        else None


def lse_output(xp: Any, p: Problem, like: Any, user: Any, info: Any) -> LseOutput:
    if user is not None:
        strides = lse_strides(p, info)
        if strides is not None and min(strides) >= 0:
            return LseOutput(user, strides)
    shape = p.lse_shape()
    arr = xp.empty(shape, "fp32", like)
    return LseOutput(arr, contiguous_lse_strides(shape, p.varlen), None if user is None else xp.convert(user, info))


def _bias_extents(p: Problem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    bi = p.bias_info
    nd = len(bi.shape)
    return (1,) * (4 - nd) + tuple(bi.shape), (0,) * (4 - nd) + tuple(bi.strides)


def bias_strides_in_place(p: Problem) -> tuple[int, int, int] | None:
    """The (batch, head, row) strides at which the kernels can read the bias where it is (stride 0
    over broadcast dims, unit stride over keys, aligned), or None when it must be copied."""
    bi = p.bias_info
    extents, strides = _bias_extents(p)
    full = p.bias_full_shape()
    kstrides = bias_strides(extents, strides)
    keys_ok = extents[3] == full[3] and (strides[3] == 1 or full[3] <= 1)
    if keys_ok and bi.ptr % 16 == 0 and all(s >= 0 and s % BIAS_ALIGN == 0 for s in kstrides) \
            and kstrides[2] <= I32_MAX:
        return kstrides
    return None


def bias_operand(xp: Any, p: Problem, like: Any) -> tuple[Any, tuple[int, int, int]]:
    """The bias as the kernels read it: (batch, head, row) strides, unit stride over keys,
    stride 0 over broadcast dims; copied with rows padded to 8 when it cannot be read in place."""
    bi = p.bias_info
    kstrides = bias_strides_in_place(p)
    if kstrides is not None:
        return xp.convert(p.bias, bi), kstrides
    extents, _ = _bias_extents(p)
    full = p.bias_full_shape()
    shape = extents[:3] + (bias_row_width(full[3]),)
    buf = xp.zeros(shape, p.dtype, like)
    buf[..., :full[3]] = xp.reshape(xp.convert(p.bias, bi), extents)
    return buf, bias_strides(extents, contiguous_strides(shape))

