"""Step 3 of a call, the general way: launch from the caller's arrays whatever they are.

This path copies what the kernels cannot read in place (misaligned or strided operands, head dims
padded to their bucket, caller outputs of another layout), handles empty problems without a
launch and reduces dBias over broadcast dimensions. A call whose plan found none of that needed
skips it: :mod:`.plan` (or :mod:`.backward_plan`) fills a prebuilt argument list instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .arrays import Output, bias_operand, lse_output, operand
from .family import (
    CONVERT,
    DKDV,
    DQ,
    PRE,
    backward_arguments,
    bias_row_width,
    contiguous_kernel_strides,
    contiguous_strides,
    forward_arguments,
)
from .framework import arrays_for
from .problem import Problem


def launch(handle: Any, values: Mapping[str, Any]) -> None:
    """Launch ``handle`` with its arguments picked by name from ``values`` (catalog order)."""
    handle(*[values[name] for name in handle.arg_names])


def _working(p: Problem) -> tuple[Any, Any, Any, Any]:
    xp = arrays_for(p.qi.framework)
    return xp, xp.convert(p.q, p.qi), xp.convert(p.k, p.ki), xp.convert(p.v, p.vi)


def forward(p: Problem, handle: Any, spec: dict, out: Any, out_i: Any, lse: Any, lse_i: Any,
             return_mask: bool) -> tuple:
    xp, q, k, v = _working(p)
    width_q, width_v = spec["HEAD_DIM"], spec["HEAD_DIM_V"]
    o = Output(xp, p.out_shape(), p.dtype, q, p.layout, p.varlen, width_v, out, out_i)
    lse_out = lse_output(xp, p, q, lse, lse_i)
    mask = None
    if return_mask:
        mask = xp.zeros((p.batch, p.heads_q, p.seqlen_q, p.seqlen_k), "i8", q)
    empty = p.batch == 0 or p.heads_q == 0 or p.rows_q == 0
    if empty or p.rows_k == 0 or p.seqlen_k == 0 or p.seqlen_q == 0:
        # No programs (nothing to compute) or no keys: rows that see no key are 0 with lse -inf.
        if not empty:
            o.array[...] = 0
            lse_out.array[...] = float("-inf")
        return _results(o.finish(), lse_out.finish(), mask, return_mask)
    qo = operand(xp, q, p.qi, p.layout, p.varlen, width_q)
    ko = operand(xp, k, p.ki, p.layout, p.varlen, width_q)
    vo = operand(xp, v, p.vi, p.layout, p.varlen, width_v)
    arrays = {"q": qo.array, "k": ko.array, "v": vo.array, "out": o.array, "lse": lse_out.array, "mask": mask}
    strides = {"q": qo.strides, "k": ko.strides, "v": vo.strides, "out": o.strides}
    _add_bias_and_lengths(xp, p, q, arrays, strides)
    if mask is not None:
        strides["mask"] = contiguous_strides(mask.shape)[:3]
    values = forward_arguments(arrays, strides, lse_out.strides, p.scalars())
    launch(handle, values)
    return _results(o.finish(), lse_out.finish(), mask, return_mask)


def _results(out: Any, lse: Any, mask: Any, return_mask: bool) -> tuple:
    return (out, lse, mask) if return_mask else (out, lse)


def _add_bias_and_lengths(xp: Any, p: Problem, like: Any, arrays: dict[str, Any], strides: dict[str, Any]) -> None:
    """The call's bias (as the kernels read it), varlen arrays and ALiBi slopes (read in place:
    the kernels read one slope per program), where it has them."""
    if p.bias is not None:
        arrays["bias"], strides["bias"] = bias_operand(xp, p, like)
    if p.varlen:
        arrays["cu_seqlens_q"] = xp.convert(p.cu_q, p.cu_qi)
        arrays["cu_seqlens_k"] = xp.convert(p.cu_k, p.cu_ki)
    if p.alibi_info is not None:
        arrays["alibi"], strides["alibi"] = xp.convert(p.alibi, p.alibi_info), (p.alibi_stride,)


def backward(p: Problem, specs: dict, handles: dict, mode: str, dout: Any, doi: Any, out: Any, oi: Any,
              lse: Any, li: Any, user_grads: tuple, grad_infos: list, want_dbias: bool) -> tuple:
    xp, q, k, v = _working(p)
    width_q, width_v = specs[PRE]["HEAD_DIM"], specs[PRE]["HEAD_DIM_V"]
    g_dq = Output(xp, tuple(p.qi.shape), p.dtype, q, p.layout, p.varlen, width_q, user_grads[0], grad_infos[0])
    g_dk = Output(xp, tuple(p.ki.shape), p.dtype, q, p.layout, p.varlen, width_q, user_grads[1], grad_infos[1])
    g_dv = Output(xp, tuple(p.vi.shape), p.dtype, q, p.layout, p.varlen, width_v, user_grads[2], grad_infos[2])
    dbias_buf = None
    full = p.bias_full_shape()
    if want_dbias:
        # The kernel writes the full, unbroadcast dS; rows padded to 8 keep its stride promise.
        # Under varlen the positions past each sequence are never visited: zero them.
        shape = full[:3] + (bias_row_width(full[3]),)
        dbias_buf = xp.zeros(shape, p.dtype, q) if p.varlen else xp.empty(shape, p.dtype, q)
    if p.batch == 0 or p.heads_q == 0 or p.rows_q == 0 or p.rows_k == 0 or p.seqlen_q == 0 or p.seqlen_k == 0:
        for g in (g_dq, g_dk, g_dv):
            g.array[...] = 0
        if dbias_buf is not None:
            dbias_buf[...] = 0
        return (g_dq.finish(), g_dk.finish(), g_dv.finish(), _reduce_dbias(xp, p, dbias_buf))
    qo = operand(xp, q, p.qi, p.layout, p.varlen, width_q)
    ko = operand(xp, k, p.ki, p.layout, p.varlen, width_q)
    vo = operand(xp, v, p.vi, p.layout, p.varlen, width_v)
    doo = operand(xp, xp.convert(dout, doi), doi, p.layout, p.varlen, width_v)
    oo = operand(xp, xp.convert(out, oi), oi, p.layout, p.varlen, width_v)
    # Delta is written with LSE's strides (the kernels share them): both are made contiguous.
    lse_arr = xp.contiguous(xp.convert(lse, li))
    delta = xp.empty(p.lse_shape(), "fp32", q)
    arrays = {"dout": doo.array, "q": qo.array, "k": ko.array, "v": vo.array, "out": oo.array, "lse": lse_arr,
              "delta": delta, "dq": g_dq.array, "dk": g_dk.array, "dv": g_dv.array, "dbias": dbias_buf}
    strides = {"dout": doo.strides, "q": qo.strides, "k": ko.strides, "v": vo.strides, "out": oo.strides,
               "dq": g_dq.strides, "dk": g_dk.strides, "dv": g_dv.strides}
    _add_bias_and_lengths(xp, p, q, arrays, strides)
    if dbias_buf is not None:
        strides["dbias"] = contiguous_strides(dbias_buf.shape)[:3]
    if mode == "atomic":
        shape = tuple(p.qi.shape[:-1]) + (width_q,)
        arrays["dqacc"] = xp.empty(shape, "fp32", q)
        strides["dqacc"] = contiguous_kernel_strides(shape, p.layout, p.varlen)
        order = (PRE, DKDV, CONVERT)
    else:
        order = (PRE, DKDV, DQ)
    values = backward_arguments(arrays, strides, p.lse_strides(), p.scalars())
    for name in order:
        launch(handles[name], values)
    return (g_dq.finish(), g_dk.finish(), g_dv.finish(), _reduce_dbias(xp, p, dbias_buf))


def _reduce_dbias(xp: Any, p: Problem, buf: Any) -> Any:
    """dBias in the bias's own shape: the kernel's full dS summed over the broadcast dims."""
    if buf is None:
        return None
    bi = p.bias_info
    full = p.bias_full_shape()
    extents = (1,) * (4 - len(bi.shape)) + tuple(bi.shape)
    grad = buf[..., :full[3]]
    dims = tuple(i for i in range(4) if extents[i] == 1 and full[i] != 1)
    if dims:
        grad = xp.sum_keep(grad, dims, p.dtype)
    return xp.contiguous(xp.reshape(grad, tuple(bi.shape)))

