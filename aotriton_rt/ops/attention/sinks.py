"""Attention sinks: a learnable logit per query head in every row's softmax, with no value.

gpt-oss's ``s_aux`` and FlashAttention-3's ``learnable_sink``. Any forward's ``(out, lse)`` over
the visible keys becomes the sink's result in place (``attn_sinks``: ``out *= exp(lse - lse')``,
``lse' = logaddexp(lse, sink)``), and the backward kernels given that ``(out, lse)`` produce the
sink's dq, dk and dv unchanged; the sink's own gradient comes from ``attn_sinks_bwd``
(``builder/kernels/sinks.py`` has the derivation). One code path for dense, varlen and decode
calls, every forward kernel and both vendors, for one more launch and one pass over ``out``.
"""

from __future__ import annotations

from typing import Any

from ... import interop
from ...errors import ArgumentError
from ...library import default_library
from .framework import arrays_for

SINKS = "attn_sinks"
SINKS_BWD = "attn_sinks_bwd"
_FLOATS = ("fp16", "bf16", "fp32")


def check_sinks(sinks: Any, heads_q: int, device: int) -> interop.ArrayInfo:
    """The sinks array's description; ArgumentError unless a float GPU vector of ``heads_q``
    values on ``device``."""
    try:
        info = interop.describe(sinks)
    except ArgumentError as e:
        raise ArgumentError(f"sinks: {e}") from None
    if info.dtype not in _FLOATS:
        raise ArgumentError(f"sinks must be fp16, bf16 or fp32, got {info.dtype}")
    if tuple(info.shape) != (heads_q,):
        raise ArgumentError(f"sinks must have shape ({heads_q},): one logit per query head, got {tuple(info.shape)}")
    if info.device != device:
        raise ArgumentError(f"sinks is on device {info.device}, the attention's arrays on device {device}")
    return info


def _rows(info: interop.ArrayInfo, name: str, layout: str, varlen: bool) -> tuple[int, int, int, int, int, int]:
    """(batch, heads, rows, batch stride, head stride, row stride) of an out-like array (varlen:
    batch 1, rows the packed total)."""
    shape, st = tuple(info.shape), tuple(info.strides)
    if st[-1] != 1 and shape[-1] > 1:
        raise ArgumentError(f"{name} must have a unit stride along the head dim, got strides {st}")
    if varlen:
        return 1, shape[1], shape[0], 0, st[1], st[0]
    if layout == "bshd":
        return shape[0], shape[2], shape[1], st[0], st[2], st[1]
    return shape[0], shape[1], shape[2], st[0], st[1], st[2]


def _lse_rows(info: interop.ArrayInfo, varlen: bool) -> tuple[int, int]:
    """(batch stride, head stride) of a logsumexp array: ``(B, H, S)``, or ``(H, total)`` varlen."""
    st = tuple(info.strides)
    if st[-1] != 1 and info.shape[-1] > 1:
        raise ArgumentError(f"lse must have a unit stride along its rows, got strides {st}")
    return (0, st[0]) if varlen else (st[0], st[1])


def fp32(xp: Any, sinks: Any, info: interop.ArrayInfo) -> Any:
    """The sinks as an fp32 array of the framework ``xp`` (a new one of Hq values, unless fp32)."""
    return xp.as_fp32(xp.convert(sinks, info))


def lse_heads(lse: Any, varlen: bool) -> int:
    """The query heads of a forward's logsumexp: ``(B, Hq, Sq)``, or ``(Hq, total)`` varlen."""
    return lse.shape[0] if varlen else lse.shape[1]


def _sequences(xp: Any, rows: int, cu_seqlens_q: Any, max_seqlen_q: int | None) -> tuple[int, int]:
    """(sequences, rows per sequence at most) of a packed batch: ``cu_seqlens_q``'s length less
    one, ``max_seqlen_q`` (read from the lengths when None), never past the packed ``rows``."""
    info = interop.describe(cu_seqlens_q)
    if max_seqlen_q is None:
        max_seqlen_q = xp.max_len(xp.convert(cu_seqlens_q, info))
    return max(info.shape[0] - 1, 0), min(int(max_seqlen_q), rows)


def aligned(dtype: str, ptr: int, extents: tuple[int, ...]) -> bool:
    """Whether ``attn_sinks`` may take the output in 16-byte steps (its ``ALIGNED=1`` variant): a
    16-byte aligned address and every stride and the head dim, ``extents``, whole 16-byte steps."""
    step = 4 if dtype == "fp32" else 8  # elements in 16 bytes
    return ptr % 16 == 0 and all(x % step == 0 for x in extents)


def apply_sinks(out: Any, lse: Any, sinks: Any, *, heads_q: int, layout: str, cu_seqlens_q: Any = None,
                max_seqlen_q: int | None = None, library: Any = None) -> None:
    """Make the forward's ``(out, lse)`` over the keys the result with ``sinks``, in place
    (packed batches: only the rows of ``cu_seqlens_q``'s sequences; ``max_seqlen_q`` unused)."""
    oi, li = interop.describe(out), interop.describe(lse)
    si = check_sinks(sinks, heads_q, oi.device)
    varlen = cu_seqlens_q is not None
    batch, heads, rows, oz, oh, om = _rows(oi, "out", layout, varlen)
    if batch * heads * rows == 0:
        return
    lz, lh = _lse_rows(li, varlen)
    seqs = max(interop.describe(cu_seqlens_q).shape[0] - 1, 0) if varlen else 0
    xp = arrays_for(oi.framework)
    s32 = fp32(xp, sinks, si)
    head_dim = oi.shape[-1]
    handle = (library or default_library()).kernel(SINKS, dtype=oi.dtype,
                                                    ALIGNED=int(aligned(oi.dtype, oi.ptr, (oz, oh, om, head_dim))))
    handle(out, lse, s32, cu_seqlens_q, oz, oh, om, lz, lh, batch, heads, rows, head_dim, seqs, int(varlen))


def sinks_grad(dout: Any, out: Any, lse: Any, sinks: Any, *, heads_q: int, layout: str, cu_seqlens_q: Any = None,
               max_seqlen_q: int | None = None, library: Any = None) -> Any:
    """The gradient of ``sinks`` (shaped and typed like it) from the forward's final ``(out,
    lse)`` and ``dout``: ``-sum over rows of exp(sink - lse) * rowsum(dout * out)``."""
    oi, li, di = interop.describe(out), interop.describe(lse), interop.describe(dout)
    si = check_sinks(sinks, heads_q, oi.device)
    if tuple(di.shape) != tuple(oi.shape) or di.dtype != oi.dtype:
        raise ArgumentError(f"dout must match out's shape {tuple(oi.shape)} and dtype {oi.dtype}, got "
                            f"{tuple(di.shape)} {di.dtype}")
    varlen = cu_seqlens_q is not None
    batch, heads, rows, oz, oh, om = _rows(oi, "out", layout, varlen)
    _, _, _, dz, dh, dm = _rows(di, "dout", layout, varlen)
    lz, lh = _lse_rows(li, varlen)
    xp = arrays_for(oi.framework)
    like = xp.convert(out, oi)
    total = rows
    if varlen:
        batch, rows = _sequences(xp, total, cu_seqlens_q, max_seqlen_q)
    if batch * heads * rows == 0:
        return xp.zeros((heads_q,), si.dtype, like)
    s32 = fp32(xp, sinks, si)
    handle = (library or default_library()).kernel(SINKS_BWD, dtype=oi.dtype)
    block_m = handle.variant(max(oi.device, 0)).config.constexprs["BLOCK_M"]
    partial = xp.empty((-(-rows // block_m), batch, heads), "fp32", like)
    handle(dout, out, lse, s32, partial, cu_seqlens_q, dz, dh, dm, oz, oh, om, lz, lh, batch, heads, rows, total,
           oi.shape[-1], int(varlen))
    return xp.reshape(xp.sum_keep(partial, (0, 1), si.dtype), (heads_q,))
