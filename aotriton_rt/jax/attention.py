"""Attention for JAX: the operator's kernels as traced calls, differentiable through ``jax.custom_vjp``.

The eager operator (:mod:`aotriton_rt.ops.attention`) decides everything: arguments are
validated and kernels chosen by its public :func:`~aotriton_rt.ops.attention.attention_kernels`,
handed shape-and-dtype stand-ins for the traced arrays, so bad input fails while tracing with
the eager path's typed errors and messages. This module then lays the arrays out as the eager
path does (head dims zero-padded to the compiled bucket, contiguous strides, bias rows padded
to 8 when needed) and launches the same kernels through :mod:`aotriton_rt.jax.kernels`, so the
outputs under ``jax.jit`` are those of the eager path.

Attention sinks are applied around the kernels in ``jax.numpy`` (:mod:`aotriton_rt.jax.sinks`):
the forward's ``(out, lse)`` rescaled, the backward kernels fed the rescaled pair, the sinks'
gradient a reduction beside them.

Dropout's ``seed``/``offset`` and every option are static (Python values fixed at trace time):
jaxlib's Triton call bakes scalar arguments into the compiled program. Varlen batches need
``max_seqlen_q``/``max_seqlen_k`` (the eager path would read them from the device).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .. import interop
from ..errors import ArgumentError
from ..ops.attention import attention_kernels
from ..ops.attention.family import (
    BIAS_ALIGN,
    CONVERT,
    DKDV,
    DQ,
    FWD,
    PRE,
    backward_arguments,
    bhs,
    bias_row_width,
    bias_strides,
    contiguous_kernel_strides,
    contiguous_strides,
    forward_arguments,
    kernel_strides,
    lse_strides,
    scalar_arguments,
)
from ..ops.attention.sinks import check_sinks
from . import sinks as _sinks
from .kernels import JaxKernel, Out, Update

_TRITON = {"float8_e4m3fn": "fp8e4nv", "float8_e4m3fnuz": "fp8e4b8", "float16": "fp16", "bfloat16": "bf16",
           "float32": "fp32", "float64": "fp64", "int8": "i8",
           "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8", "uint32": "u32", "bool": "i1"}


class _Standin:
    """Shape and dtype of a traced array, as the eager validator reads arrays (never a pointer)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, x: Any, name: str) -> None:
        dtype = jnp.dtype(x.dtype).name
        if dtype not in _TRITON:
            raise ArgumentError(f"{name} has dtype {dtype}, which Triton kernels do not take")
        self.shape, self.dtype = tuple(int(n) for n in x.shape), _TRITON[dtype]


def _describe(obj: _Standin, backend: str, stream: int | None) -> interop.ArrayInfo:
    # A 256-aligned stand-in address: the validator checks layouts, no memory is read.
    return interop.ArrayInfo(256, -1, obj.dtype, obj.shape, contiguous_strides(obj.shape), "jax")


def _no_pointer(obj: _Standin, backend: str, stream: int | None) -> tuple[int, int]:
    raise ArgumentError("a traced JAX array has no device pointer; use aotriton_rt.jax under jax.jit")


interop.register_type(_Standin, _no_pointer, _describe)


@dataclass(frozen=True)
class _Options:
    causal: bool = False
    window: tuple[int, int] | None = None
    align: str = "top_left"
    dropout_p: float = 0.0
    seed: int | None = None
    offset: int = 0
    scale: float | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    layout: str = "bhsd"
    deterministic: bool = False
    scheme: str | None = None
    library: Any = None
    arch: str | None = None
    same_cu: bool = False
    softcap: float | None = None

    def eager(self) -> dict[str, Any]:
        return {"causal": self.causal, "window": self.window, "align": self.align, "dropout_p": self.dropout_p,
                "seed": self.seed, "offset": self.offset, "scale": self.scale, "max_seqlen_q": self.max_seqlen_q,
                "max_seqlen_k": self.max_seqlen_k, "layout": self.layout, "softcap": self.softcap}


#: XLA's flags that ask every op for run-to-run reproducible results (the first implies the second).
XLA_DETERMINISM_FLAGS = ("xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops")


def xla_asks_determinism(flags: str | None = None) -> bool:
    """Whether ``XLA_FLAGS`` (or ``flags``) turns on one of :data:`XLA_DETERMINISM_FLAGS`: a bare
    ``--flag``, ``--flag=true`` or ``--flag=1``; the last mention of a flag wins, as in XLA. The
    backward then runs the reproducible split scheme, as with ``deterministic=True``, since XLA
    cannot see which scheme our custom calls take."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    state: dict[str, bool] = {}
    for token in flags.split():
        name, _, value = token.removeprefix("--").partition("=")
        if token.startswith("--") and name in XLA_DETERMINISM_FLAGS:
            state[name] = value.lower() in ("", "true", "1")
    return any(state.values())


def _options(causal: Any, window: Any, align: Any, dropout_p: Any, seed: Any, offset: Any, scale: Any,
             max_seqlen_q: Any, max_seqlen_k: Any, layout: Any, deterministic: Any, scheme: Any, library: Any,
             arch: Any, cu_q: Any, cu_k: Any, softcap: Any = None) -> _Options:
    for name, value in (("seed", seed), ("offset", offset), ("scale", scale), ("dropout_p", dropout_p),
                        ("softcap", softcap),
                        ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, (jax.core.Tracer, jax.Array)):
            raise ArgumentError(f"{name} must be a Python number under jax.jit (jaxlib's Triton call fixes kernel "
                                f"scalars at compile time); mark it static")
    if (cu_q is not None or cu_k is not None) and (max_seqlen_q is None or max_seqlen_k is None):
        raise ArgumentError("variable-length attention in JAX needs max_seqlen_q and max_seqlen_k (Python ints): "
                            "under jax.jit the lengths cannot be read from the device")
    if isinstance(window, list):
        window = tuple(window)
    deterministic = bool(deterministic) or xla_asks_determinism()
    return _Options(causal, window, align, dropout_p, seed, offset, scale, max_seqlen_q, max_seqlen_k, layout,
                    deterministic, scheme, library, arch, cu_q is not None and cu_q is cu_k, softcap)


def _standin(x: Any, name: str) -> _Standin | None:
    return None if x is None else _Standin(x, name)


def _kernels(q: Any, k: Any, v: Any, bias: Any, cu_q: Any, cu_k: Any, o: _Options, *, backward: bool = False,
             return_mask: bool = False, alibi: Any = None) -> dict[str, Any]:
    """Validation and dispatch by the eager operator: the handles its call would launch."""
    cq = _standin(cu_q, "cu_seqlens_q")
    ck = cq if o.same_cu else _standin(cu_k, "cu_seqlens_k")
    return attention_kernels(_Standin(q, "q"), _Standin(k, "k"), _Standin(v, "v"), backward=backward,
                             deterministic=o.deterministic, scheme=o.scheme, return_mask=return_mask,
                             bias_grad=True, library=o.library, bias=_standin(bias, "bias"), cu_seqlens_q=cq,
                             cu_seqlens_k=ck, alibi_slopes=_standin(alibi, "alibi_slopes"), **o.eager())


def _check_sinks(sinks: Any, lse: Any) -> None:
    """The eager path's checks of ``sinks`` (a float vector, one per query head: the lse's
    second-last axis, dense or packed) and its messages."""
    if not (hasattr(sinks, "shape") and hasattr(sinks, "dtype")):
        raise ArgumentError(f"sinks must be an array of one logit per query head, got {type(sinks).__name__}")
    check_sinks(_Standin(sinks, "sinks"), lse.shape[-2], -1)


def _with_sinks(out: Any, lse: Any, sinks: Any, cu_q: Any, o: _Options) -> tuple[Any, Any]:
    _check_sinks(sinks, lse)
    return _sinks.apply_sinks(out, lse, sinks, layout=o.layout, cu_seqlens_q=cu_q)


@functools.lru_cache(maxsize=256)
def _jax_kernel(handle: Any, arch: str | None) -> JaxKernel:
    return JaxKernel(handle, arch)


# ---------------------------------------------------------------------------------------------
# The problem's facts and layouts (as the eager operator computes them).
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Facts:
    varlen: bool
    batch: int
    heads_q: int
    heads_k: int
    seqlen_q: int
    seqlen_k: int
    rows_q: int
    rows_k: int
    head_dim: int
    head_dim_v: int
    scalars: tuple

    def lse_shape(self) -> tuple[int, ...]:
        return (self.heads_q, self.rows_q) if self.varlen else (self.batch, self.heads_q, self.seqlen_q)

    def bias_full(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads_q, self.seqlen_q, self.seqlen_k)


def _facts(q: Any, k: Any, v: Any, cu_q: Any, o: _Options) -> _Facts:
    varlen = cu_q is not None
    if varlen:
        batch, (rows_q, heads_q, d), (rows_k, heads_k, _) = cu_q.shape[0] - 1, q.shape, k.shape
        seqlen_q, seqlen_k = o.max_seqlen_q, o.max_seqlen_k
    else:
        (batch, heads_q, seqlen_q), _ = bhs(q.shape, q.shape, o.layout, False)
        (_, heads_k, seqlen_k), _ = bhs(k.shape, k.shape, o.layout, False)
        rows_q, rows_k, d = seqlen_q, seqlen_k, q.shape[-1]
    scale = 1.0 / math.sqrt(d) if o.scale is None else float(o.scale)
    left, right = o.window if o.window is not None else (-1, -1)
    if o.causal:
        right = 0
    masked = o.causal or left >= 0 or right >= 0
    seed, offset = (o.seed, o.offset) if o.dropout_p > 0 else (0, 0)
    scalars = scalar_arguments(batch=batch, heads_q=heads_q, heads_k=heads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                               scale=scale, dropout_p=float(o.dropout_p), seed=seed, offset=offset, window_left=left,
                               window_right=right, causal_mode=2 if masked and o.align == "bottom_right" else 0,
                               softcap=float(o.softcap or 0.0))
    return _Facts(varlen, batch, heads_q, heads_k, seqlen_q, seqlen_k, rows_q, rows_k, d, v.shape[-1],
                  tuple(scalars.items()))


_strides = contiguous_kernel_strides  # (batch, head, row) kernel strides of a contiguous array


def _pad(x: Any, width: int) -> Any:
    extra = width - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _bias_operand(bias: Any, f: _Facts) -> tuple[Any, tuple[int, int, int]]:
    """The bias as the kernels read it: stride 0 over broadcast dims, rows padded to 8 if needed."""
    extents = (1,) * (4 - bias.ndim) + tuple(bias.shape)
    full = f.bias_full()
    if extents[3] == full[3] and full[3] % BIAS_ALIGN == 0:
        arr = bias.reshape(extents)
    else:
        arr = jnp.zeros(extents[:3] + (bias_row_width(full[3]),), bias.dtype)
        arr = arr.at[..., :full[3]].set(jnp.broadcast_to(bias.reshape(extents), extents[:3] + (full[3],)))
    return arr, bias_strides(extents, contiguous_strides(arr.shape))


def _add_bias(bias: Any, f: _Facts, arrays: dict[str, Any], strides: dict[str, Any], alibi: Any = None) -> None:
    """The bias as the kernels read it and the ALiBi slopes (contiguous: batch stride 0 for ``(Hq,)``
    or a batch of one), where the call has them."""
    if bias is not None:
        arrays["bias"], strides["bias"] = _bias_operand(bias, f)
    if alibi is not None:
        per_sequence = alibi.ndim == 2 and f.batch > 1
        arrays["alibi"], strides["alibi"] = alibi, (alibi.shape[-1] if per_sequence else 0,)


def _empty(f: _Facts) -> bool:
    return f.batch == 0 or f.heads_q == 0 or f.rows_q == 0 or f.rows_k == 0 or f.seqlen_q == 0 or f.seqlen_k == 0


def _launch(handle: Any, o: _Options, values: dict[str, Any]) -> Any:
    k = _jax_kernel(handle, o.arch)
    return k(*[values[name] for name in k.arg_names])


# ---------------------------------------------------------------------------------------------
# Forward and backward on traced arrays.
# ---------------------------------------------------------------------------------------------

def _forward(q: Any, k: Any, v: Any, bias: Any, cu_q: Any, cu_k: Any, o: _Options, return_mask: bool = False,
             alibi: Any = None) -> tuple:
    handle = _kernels(q, k, v, bias, cu_q, cu_k, o, return_mask=return_mask, alibi=alibi)[FWD]
    f = _facts(q, k, v, cu_q, o)
    wq, wv = handle.params["HEAD_DIM"], handle.params["HEAD_DIM_V"]
    out_shape = tuple(q.shape[:-1]) + (f.head_dim_v,)
    mask_shape = (f.batch, f.heads_q, f.seqlen_q, f.seqlen_k)
    if _empty(f):
        out = jnp.zeros(out_shape, q.dtype)
        lse = jnp.full(f.lse_shape(), -jnp.inf, jnp.float32)
        mask = jnp.zeros(mask_shape, jnp.int8)
        return (out, lse, mask) if return_mask else (out, lse)
    qp, kp, vp = _pad(q, wq), _pad(k, wq), _pad(v, wv)
    padded_out = tuple(q.shape[:-1]) + (wv,)
    lay, vl = o.layout, f.varlen
    arrays = {"q": qp, "k": kp, "v": vp, "out": Out(padded_out, q.dtype), "lse": Out(f.lse_shape(), jnp.float32),
              "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    strides = {"q": _strides(qp.shape, lay, vl), "k": _strides(kp.shape, lay, vl), "v": _strides(vp.shape, lay, vl),
               "out": _strides(padded_out, lay, vl)}
    if return_mask:
        arrays["mask"], strides["mask"] = Out(mask_shape, jnp.int8, zero=True), contiguous_strides(mask_shape)[:3]
    _add_bias(bias, f, arrays, strides, alibi)
    values = forward_arguments(arrays, strides, lse_strides(f.lse_shape(), vl), dict(f.scalars))
    results = _launch(handle, o, values)
    out, lse = results[0], results[1]
    if wv != f.head_dim_v:
        out = out[..., :f.head_dim_v]
    return (out, lse, results[2]) if return_mask else (out, lse)


def _backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, bias: Any, cu_q: Any, cu_k: Any,
              o: _Options, alibi: Any = None) -> tuple:
    handles = _kernels(q, k, v, bias, cu_q, cu_k, o, backward=True, alibi=alibi)
    f = _facts(q, k, v, cu_q, o)
    for name, x, shape, dtype in (("dout", dout, out.shape, q.dtype), ("out", out, tuple(q.shape[:-1]) +
                                  (f.head_dim_v,), q.dtype), ("lse", lse, f.lse_shape(), jnp.float32)):
        if tuple(x.shape) != tuple(shape) or jnp.dtype(x.dtype) != jnp.dtype(dtype):
            raise ArgumentError(f"{name} must have shape {tuple(shape)} and dtype {jnp.dtype(dtype).name}, got "
                                f"{tuple(x.shape)} {jnp.dtype(x.dtype).name}")
    atomic = CONVERT in handles
    wq, wv = handles[PRE].params["HEAD_DIM"], handles[PRE].params["HEAD_DIM_V"]
    full = f.bias_full()
    dbias_shape = full[:3] + (bias_row_width(full[3]),)
    if _empty(f):
        zeros = [jnp.zeros(x.shape, x.dtype) for x in (q, k, v)]
        return (*zeros, None if bias is None else jnp.zeros(bias.shape, bias.dtype))
    qp, kp, vp, dop, op = _pad(q, wq), _pad(k, wq), _pad(v, wv), _pad(dout, wv), _pad(out, wv)
    dq_shape, dk_shape = tuple(q.shape[:-1]) + (wq,), tuple(k.shape[:-1]) + (wq,)
    dv_shape = tuple(v.shape[:-1]) + (wv,)
    lay, vl = o.layout, f.varlen
    arrays = {"dout": dop, "q": qp, "k": kp, "v": vp, "out": op, "lse": lse, "cu_seqlens_q": cu_q,
              "cu_seqlens_k": cu_k, "delta": Out(f.lse_shape(), jnp.float32)}
    strides = {"dout": _strides(dop.shape, lay, vl), "q": _strides(qp.shape, lay, vl),
               "k": _strides(kp.shape, lay, vl), "v": _strides(vp.shape, lay, vl), "out": _strides(op.shape, lay, vl),
               "dq": _strides(dq_shape, lay, vl), "dk": _strides(dk_shape, lay, vl), "dv": _strides(dv_shape, lay, vl)}
    _add_bias(bias, f, arrays, strides, alibi)
    if bias is not None:
        arrays["dbias"] = Out(dbias_shape, q.dtype, zero=f.varlen)
        strides["dbias"] = contiguous_strides(dbias_shape)[:3]
    if atomic:
        arrays["dqacc"], strides["dqacc"] = Out(dq_shape, jnp.float32), _strides(dq_shape, lay, vl)
    # One dict for the three launches: each takes the outputs of the one before.
    values = backward_arguments(arrays, strides, lse_strides(f.lse_shape(), vl), dict(f.scalars))
    pre = _launch(handles[PRE], o, values)
    delta, dqacc = (pre[0], pre[1]) if atomic else (pre, None)
    values["Delta"] = delta
    values["DK"], values["DV"] = Out(dk_shape, k.dtype), Out(dv_shape, v.dtype)
    if atomic:
        values["DQacc"] = Update(dqacc)
    got = _launch(handles[DKDV], o, values)
    dk, dv = got[0], got[1]
    dbias_buf = got[2] if bias is not None else None
    if atomic:
        dqacc = got[-1]
        values["DQacc"] = dqacc
        values["DQ"] = Out(dq_shape, q.dtype)
        dq = _launch(handles[CONVERT], o, values)
    else:
        values["DQ"] = Out(dq_shape, q.dtype)
        dq = _launch(handles[DQ], o, values)
    dq, dk, dv = dq[..., :f.head_dim], dk[..., :f.head_dim], dv[..., :f.head_dim_v]
    return dq, dk, dv, _reduce_dbias(dbias_buf, bias, f)


def _reduce_dbias(buf: Any, bias: Any, f: _Facts) -> Any:
    if buf is None:
        return None
    full = f.bias_full()
    extents = (1,) * (4 - bias.ndim) + tuple(bias.shape)
    grad = buf[..., :full[3]]
    dims = tuple(i for i in range(4) if extents[i] == 1 and full[i] != 1)
    if dims:
        grad = grad.astype(jnp.float32).sum(axis=dims, keepdims=True).astype(bias.dtype)
    return grad.reshape(bias.shape)


# ---------------------------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------------------------

def attention_forward(q: Any, k: Any, v: Any, *, causal: bool = False, window: tuple[int, int] | None = None,
                      align: str = "top_left", bias: Any = None, dropout_p: float = 0.0, seed: int | None = None,
                      offset: int = 0, scale: float | None = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
                      max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, layout: str = "bhsd",
                      return_mask: bool = False, sinks: Any = None, softcap: float | None = None,
                      alibi_slopes: Any = None,
                      library: Any = None, arch: str | None = None) -> tuple:
    """``(out, lse)`` (and the dropout mask with ``return_mask``) of :func:`aotriton_rt.attention`, as JAX
    arrays, traceable under ``jax.jit``; not differentiable (see :func:`attention`).

    Arguments as :func:`aotriton_rt.attention`; all options are static (``alibi_slopes`` is an
    array, traced like q). ``sinks``: a (traced) ``(Hq,)`` float array, one logit per query head;
    ``out`` and ``lse`` are then the sinks'. ``arch``: the target to lower for without a GPU (e.g.
    ``"sm90"``). Raises the eager path's ArgumentError / UnsupportedError / KernelNotFound while
    tracing.
    """
    o = _options(causal, window, align, dropout_p, seed, offset, scale, max_seqlen_q, max_seqlen_k, layout, False,
                 None, library, arch, cu_seqlens_q, cu_seqlens_k, softcap)
    result = _forward(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, o, return_mask, alibi_slopes)
    if sinks is None:
        return result
    return _with_sinks(result[0], result[1], sinks, cu_seqlens_q, o) + tuple(result[2:])


def attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *, causal: bool = False,
                       window: tuple[int, int] | None = None, align: str = "top_left", bias: Any = None,
                       dropout_p: float = 0.0, seed: int | None = None, offset: int = 0, scale: float | None = None,
                       cu_seqlens_q: Any = None, cu_seqlens_k: Any = None, max_seqlen_q: int | None = None,
                       max_seqlen_k: int | None = None, layout: str = "bhsd", deterministic: bool = False,
                       scheme: str | None = None, sinks: Any = None, softcap: float | None = None,
                       alibi_slopes: Any = None, library: Any = None, arch: str | None = None) -> tuple:
    """``(dq, dk, dv, dbias)`` of :func:`aotriton_rt.attention_backward`, as JAX arrays, under ``jax.jit``.

    With ``sinks``, ``out`` and ``lse`` are :func:`attention_forward`'s with the same sinks, and
    their gradient comes fifth: ``(dq, dk, dv, dbias, dsinks)``, ``dsinks`` shaped and typed like
    ``sinks``.
    """
    o = _options(causal, window, align, dropout_p, seed, offset, scale, max_seqlen_q, max_seqlen_k, layout,
                 deterministic, scheme, library, arch, cu_seqlens_q, cu_seqlens_k, softcap)
    grads = _backward(dout, q, k, v, out, lse, bias, cu_seqlens_q, cu_seqlens_k, o, alibi_slopes)
    if sinks is None:
        return grads
    _check_sinks(sinks, lse)
    return grads + (_sinks.sinks_grad(dout, out, lse, sinks, layout=o.layout, cu_seqlens_q=cu_seqlens_q),)


# ---------------------------------------------------------------------------------------------
# vmap: a mapped axis folds into the batch (the kernels' grid already spans batch * heads).
# ---------------------------------------------------------------------------------------------

def _fold(x: Any, batched: bool, size: int) -> Any:
    """(V, B, ...) -> (V*B, ...), broadcasting an unmapped array over V first."""
    if not batched:
        x = jnp.broadcast_to(x, (size,) + tuple(x.shape))
    return x.reshape((x.shape[0] * x.shape[1],) + tuple(x.shape[2:]))


def _unfold(x: Any, size: int) -> Any:
    return x.reshape((size, x.shape[0] // size) + tuple(x.shape[1:]))


def _fold_bias(bias: Any, batched: bool, size: int, batch: int) -> tuple[Any, tuple]:
    """The bias as (V*B, h, s, k): mapped or not, every element gets its own (B, ...) slab."""
    shape = tuple(bias.shape[1:]) if batched else tuple(bias.shape)
    padded = (1,) * (4 - len(shape)) + shape
    x = bias.reshape(((size,) if batched else ()) + padded)
    x = jnp.broadcast_to(x, (size, batch) + padded[1:])
    return x.reshape((size * batch,) + padded[1:]), shape


def _fold_alibi(alibi: Any, batched: bool, size: int, batch: int) -> Any:
    """The slopes for the folded (V*B) batch: shared ``(Hq,)`` ones as they are, else ``(V*B, Hq)``."""
    shape = tuple(alibi.shape[1:]) if batched else tuple(alibi.shape)
    if not batched and len(shape) == 1:
        return alibi
    x = alibi.reshape(((size,) if batched else ()) + ((1,) if len(shape) == 1 else shape[:1]) + shape[-1:])
    return jnp.broadcast_to(x, (size, batch, shape[-1])).reshape(size * batch, shape[-1])


def _extras(extra: tuple, has_bias: bool, has_alibi: bool) -> tuple[Any, Any]:
    """(bias, alibi) from a core's trailing arrays (each present only when the call has it)."""
    return (extra[0] if has_bias else None), (extra[int(has_bias)] if has_alibi else None)


@functools.lru_cache(maxsize=256)
def _forward_core(o: _Options, has_bias: bool, has_alibi: bool = False) -> Any:
    @jax.custom_batching.custom_vmap
    def core(q: Any, k: Any, v: Any, *extra: Any) -> tuple:
        bias, alibi = _extras(extra, has_bias, has_alibi)
        return _forward(q, k, v, bias, None, None, o, alibi=alibi)

    @core.def_vmap
    def rule(size: int, batched: list, q: Any, k: Any, v: Any, *extra: Any) -> tuple:
        b = q.shape[1] if batched[0] else q.shape[0]
        folded = [_fold(x, m, size) for x, m in zip((q, k, v), batched)]
        bias, alibi = _extras(extra, has_bias, has_alibi)
        fb = _fold_bias(bias, batched[3], size, b)[0] if has_bias else None
        fa = _fold_alibi(alibi, batched[3 + has_bias], size, b) if has_alibi else None
        out, lse = _forward(*folded, fb, None, None, o, alibi=fa)
        return (_unfold(out, size), _unfold(lse, size)), (True, True)

    return core


@functools.lru_cache(maxsize=256)
def _backward_core(o: _Options, has_bias: bool, has_alibi: bool = False) -> Any:
    @jax.custom_batching.custom_vmap
    def core(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *extra: Any) -> tuple:
        bias, alibi = _extras(extra, has_bias, has_alibi)
        return _backward(dout, q, k, v, out, lse, bias, None, None, o, alibi)

    @core.def_vmap
    def rule(size: int, batched: list, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *extra: Any) -> tuple:
        b = q.shape[1] if batched[1] else q.shape[0]
        folded = [_fold(x, m, size) for x, m in zip((dout, q, k, v, out, lse), batched)]
        bias, alibi = _extras(extra, has_bias, has_alibi)
        fb, shape = _fold_bias(bias, batched[6], size, b) if has_bias else (None, None)
        fa = _fold_alibi(alibi, batched[6 + has_bias], size, b) if has_alibi else None
        dq, dk, dv, dbias = _backward(*folded, fb, None, None, o, fa)
        grads = (_unfold(dq, size), _unfold(dk, size), _unfold(dv, size))
        if dbias is not None:
            dbias = _unfold(dbias, size)  # (V, B, h, s, k): sum over what the caller's bias broadcast
            padded = (1,) * (4 - len(shape)) + shape
            if padded[0] == 1 and dbias.shape[1] != 1:
                dbias = dbias.astype(jnp.float32).sum(axis=1, keepdims=True).astype(dbias.dtype)
            dbias = dbias.reshape((size,) + shape)
        return (*grads, dbias), (True, True, True, None if dbias is None else True)

    return core


@functools.lru_cache(maxsize=256)
def _differentiable(o: _Options) -> Any:
    @jax.custom_vjp
    def attn(q: Any, k: Any, v: Any, bias: Any, sinks: Any, cu_q: Any, cu_k: Any, alibi: Any) -> Any:
        return fwd(q, k, v, bias, sinks, cu_q, cu_k, alibi)[0]

    def fwd(q: Any, k: Any, v: Any, bias: Any, sinks: Any, cu_q: Any, cu_k: Any, alibi: Any) -> tuple:
        extra = [x for x in (bias, alibi) if x is not None]
        if cu_q is None:
            out, lse = _forward_core(o, bias is not None, alibi is not None)(q, k, v, *extra)
        else:
            out, lse = _forward(q, k, v, bias, cu_q, cu_k, o, alibi=alibi)
        if sinks is not None:  # outside the kernels' vmap rule: a mapped sinks maps with it
            out, lse = _with_sinks(out, lse, sinks, cu_q, o)
        return out, (q, k, v, bias, sinks, cu_q, cu_k, alibi, out, lse)

    def bwd(res: tuple, dout: Any) -> tuple:
        q, k, v, bias, sinks, cu_q, cu_k, alibi, out, lse = res
        dout = dout.astype(q.dtype)
        # With sinks, (out, lse) are the sinks': the backward kernels give their dq, dk, dv as is.
        if cu_q is None:
            extra = [x for x in (bias, alibi) if x is not None]
            dq, dk, dv, dbias = _backward_core(o, bias is not None, alibi is not None)(dout, q, k, v, out, lse,
                                                                                       *extra)
        else:
            dq, dk, dv, dbias = _backward(dout, q, k, v, out, lse, bias, cu_q, cu_k, o, alibi)
        dsinks = None if sinks is None else _sinks.sinks_grad(dout, out, lse, sinks, layout=o.layout,
                                                              cu_seqlens_q=cu_q)
        # The slopes are a constant (FlashAttention-2 gives them no gradient): a zero cotangent.
        dalibi = None if alibi is None else jnp.zeros_like(alibi)
        return dq, dk, dv, dbias, dsinks, _int_zero(cu_q), _int_zero(cu_k), dalibi

    attn.defvjp(fwd, bwd)
    return attn


def _int_zero(x: Any) -> Any:
    if x is None:
        return None
    import numpy as np

    return np.zeros(x.shape, jax.dtypes.float0)


def attention(q: Any, k: Any, v: Any, *, causal: bool = False, window: tuple[int, int] | None = None,
              align: str = "top_left", bias: Any = None, dropout_p: float = 0.0, seed: int | None = None,
              offset: int = 0, scale: float | None = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, layout: str = "bhsd",
              deterministic: bool = False, scheme: str | None = None, sinks: Any = None,
              softcap: float | None = None, alibi_slopes: Any = None, q_descale: Any = None,
              k_descale: Any = None, v_descale: Any = None, out_dtype: Any = None, library: Any = None,
              arch: str | None = None) -> Any:
    """Differentiable attention on JAX arrays: ``out`` of :func:`aotriton_rt.attention`, with a
    ``jax.custom_vjp`` running the operator's backward kernels (gradients for q, k, v, bias and
    ``sinks``: a traced ``(Hq,)`` float array of one logit per query head, gpt-oss's ``s_aux``).

    Works under ``jax.jit``, ``jax.grad`` and ``jax.vmap`` (a mapped axis is folded into the
    batch: one launch per kernel; varlen calls under vmap run once per mapped element).
    Options are static Python values; see :func:`aotriton_rt.attention` for their meaning and
    ``docs/jax.md`` for what differs from the eager path. ``alibi_slopes`` (ALiBi) is an fp32 array
    ``(Hq,)`` or ``(B, Hq)``, traced like q, and gets a zero gradient. FP8 q, k, v (with
    ``q_descale``/``k_descale``/``v_descale``, ``out_dtype``) run :func:`attention_fp8`: forward only.

    Example::

        loss = lambda q, k, v: aotriton_rt.jax.attention(q, k, v, causal=True).sum()
        dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    """
    if "float8" in jnp.dtype(q.dtype).name or any(x is not None for x in (q_descale, k_descale, v_descale,
                                                                            out_dtype)):
        from ..ops.attention.fp8 import refuse_options

        if "float8" not in jnp.dtype(q.dtype).name:
            raise ArgumentError(f"q_descale, k_descale, v_descale and out_dtype apply to FP8 attention (e4m3 q, k, "
                                f"v); q has dtype {jnp.dtype(q.dtype).name}")
        refuse_options(bias=bias, dropout_p=dropout_p, sinks=sinks, softcap=softcap, alibi_slopes=alibi_slopes)
        return attention_fp8(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                             out_dtype=out_dtype, causal=causal, window=window, align=align, scale=scale,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                             max_seqlen_k=max_seqlen_k, layout=layout, library=library, arch=arch)
    o = _options(causal, window, align, dropout_p, seed, offset, scale, max_seqlen_q, max_seqlen_k, layout,
                 deterministic, scheme, library, arch, cu_seqlens_q, cu_seqlens_k, softcap)
    return _differentiable(o)(q, k, v, bias, sinks, cu_seqlens_q, cu_seqlens_k, alibi_slopes)


# ---------------------------------------------------------------------------------------------
# FP8 inference forward.
# ---------------------------------------------------------------------------------------------

def _descale_operand(d: Any, name: str) -> tuple[Any, Any]:
    """(what the eager validator reads, the array launched): a float stays a float (a one-element
    array at launch), an array is traced like q."""
    if d is None or (isinstance(d, (int, float)) and not isinstance(d, bool)):
        return d, jnp.full((1,), 1.0 if d is None else float(d), jnp.float32)
    if not (hasattr(d, "shape") and hasattr(d, "dtype")):
        raise ArgumentError(f"{name} must be a float or an fp32 array of shape (batch, key/value heads), got "
                            f"{type(d).__name__}")
    return _Standin(d, name), d


def _fp8_forward(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, descales: tuple, out_dtype: str,
                 o: _Options) -> tuple[Any, Any]:
    from ..ops.attention import fp8 as _fp8
    from ..ops.attention.dispatch import kernels_of

    cq = _standin(cu_q, "cu_seqlens_q")
    ck = cq if o.same_cu else _standin(cu_k, "cu_seqlens_k")
    checked = [_descale_operand(d, n) for d, n in zip(descales, ("q_descale", "k_descale", "v_descale"))]
    p, ds = _fp8.prepare_fp8(_Standin(q, "q"), _Standin(k, "k"), _Standin(v, "v"), causal=o.causal,
                             window=o.window, align=o.align, scale=o.scale, cu_seqlens_q=cq, cu_seqlens_k=ck,
                             max_seqlen_q=o.max_seqlen_q, max_seqlen_k=o.max_seqlen_k, layout=o.layout,
                             q_descale=checked[0][0], k_descale=checked[1][0], v_descale=checked[2][0])
    ks = kernels_of(o.library)
    chosen = _fp8.choose(ks, p.call(0), _fp8.spec_of(p, out_dtype, p.causal_mode), o.arch or ks.device_arch(0))
    handle, order = _fp8.forward_handle(ks, chosen)
    f = _facts(q, k, v, cu_q, o)
    width = chosen.spec["HEAD_DIM"]
    out_jnp = jnp.float16 if out_dtype == "fp16" else jnp.bfloat16
    if _empty(f):
        zeros = jnp.zeros(tuple(q.shape[:-1]) + (f.head_dim_v,), out_jnp)
        return zeros, jnp.full(f.lse_shape(), -jnp.inf, jnp.float32)
    qp, kp = _pad(q, width), _pad(k, width)
    padded_out = tuple(q.shape[:-1]) + (width,)
    lay, vl = o.layout, f.varlen
    # V^T as the eager path's pre-pass writes it (XLA transposes here): (B, Hkv, width, cols).
    axes = (1, 2, 0) if vl else (0, 1, 3, 2) if lay == "bhsd" else (0, 2, 3, 1)
    vt = jnp.transpose(_pad(v, width), axes)
    shape = _fp8.vt_shape(f.batch, f.heads_k, width, f.rows_k, vl)
    vt = jnp.pad(vt, [(0, 0)] * (vt.ndim - 1) + [(0, shape[-1] - vt.shape[-1])])
    if order:  # the keys in the order the forward reads them (attn_fp8_v_transpose's KEY_ORDER=1)
        vt = jnp.take(vt, jnp.asarray(_fp8.key_permutation(shape[-1]), jnp.int32), axis=-1)
    full = (1,) + shape if vl else shape
    vt_strides = kernel_strides(full[:3], contiguous_strides(full)[:3])
    arrays = {"q": qp, "k": kp, "v": vt, "out": Out(padded_out, out_jnp), "lse": Out(f.lse_shape(), jnp.float32),
              "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    strides = {"q": _strides(qp.shape, lay, vl), "k": _strides(kp.shape, lay, vl), "v": vt_strides,
               "out": _strides(padded_out, lay, vl)}
    for name, (_, arr), d in zip(("q_descale", "k_descale", "v_descale"), checked, ds):
        arrays[name] = arr
        # A traced (B, Hkv) array is contiguous: strides (Hkv, 1), 0 over an axis of one.
        strides[name] = (0, 0) if d.info is None else tuple(
            0 if e <= 1 else s for e, s in zip(d.info.shape, contiguous_strides(d.info.shape)))
    values = forward_arguments(arrays, strides, lse_strides(f.lse_shape(), vl), dict(f.scalars))
    values["stride_vd"] = vt_strides[2]
    out, lse = _launch(handle, o, values)[:2]
    return (out[..., :f.head_dim_v] if width != f.head_dim_v else out), lse


def _is_array(d: Any) -> bool:
    return d is not None and not (isinstance(d, (int, float)) and not isinstance(d, bool))


def _inference_only(o: _Options, descales: tuple, out_dtype: str) -> Any:
    """The forward as a ``jax.custom_vjp`` whose backward refuses: descale arrays are its
    arguments (traced), floats stay static."""
    static = tuple(None if _is_array(d) else d for d in descales)

    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, arrays: tuple) -> Any:
        given = tuple(a if a is not None else s for a, s in zip(arrays, static))
        return _fp8_forward(q, k, v, cu_q, cu_k, given, out_dtype, o)[0]

    def fwd(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, arrays: tuple) -> tuple:
        return run(q, k, v, cu_q, cu_k, arrays), None

    def bwd(res: Any, g: Any) -> tuple:
        from ..errors import UnsupportedError

        raise UnsupportedError("FP8 attention is inference only (no backward): jax.grad through an FP8 "
                               "aotriton_rt.jax attention is not supported; differentiate a bf16/fp16 call")

    run.defvjp(fwd, bwd)
    return lambda q, k, v, cu_q, cu_k: run(q, k, v, cu_q, cu_k, tuple(d if _is_array(d) else None for d in descales))


def attention_fp8(q: Any, k: Any, v: Any, *, q_descale: Any = None, k_descale: Any = None, v_descale: Any = None,
                  out_dtype: Any = None, causal: bool = False, window: tuple[int, int] | None = None,
                  align: str = "top_left", scale: float | None = None, cu_seqlens_q: Any = None,
                  cu_seqlens_k: Any = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                  layout: str = "bhsd", return_lse: bool = False, library: Any = None,
                  arch: str | None = None) -> Any:
    """FP8 inference attention on JAX arrays (``jnp.float8_e4m3fn``, or ``float8_e4m3fnuz`` on
    gfx942): :func:`aotriton_rt.attention`'s FP8 forward under ``jax.jit``. ``q_descale``,
    ``k_descale``, ``v_descale``: Python floats (static) or fp32 arrays ``(B, Hkv)`` (traced);
    ``out_dtype``: bf16 (default) or fp16. Returns ``out``, or ``(out, lse)`` with ``return_lse``.
    Forward only: ``jax.grad`` through it raises ``UnsupportedError`` while tracing.

    Example::

        out = jax.jit(lambda q, k, v, d: aotriton_rt.jax.attention_fp8(q, k, v, q_descale=d, k_descale=d,
                                                                       v_descale=d, causal=True))(q8, k8, v8, d)
    """
    from ..ops.attention.fp8 import out_dtype_of

    o = _options(causal, window, align, 0.0, None, 0, scale, max_seqlen_q, max_seqlen_k, layout, False, None,
                 library, arch, cu_seqlens_q, cu_seqlens_k)
    od = out_dtype_of(out_dtype)
    if return_lse:
        return _fp8_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, (q_descale, k_descale, v_descale), od, o)
    return _inference_only(o, (q_descale, k_descale, v_descale), od)(q, k, v, cu_seqlens_q, cu_seqlens_k)
