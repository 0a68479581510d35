"""Attention sinks on traced arrays: the eager epilogue and the sinks' gradient, in ``jax.numpy``.

The math is that of the eager kernels ``attn_sinks`` and ``attn_sinks_bwd``
(``builder/kernels/sinks.py`` has the derivation), written out here so XLA fuses it with its
neighbours and ``jax.vmap`` maps it (a mapped ``sinks`` included) without a kernel call:

- the forward's ``(out, lse)`` over the visible keys becomes the sinks' with
  ``lse' = logaddexp(lse, s_h)`` and ``out' = out * exp(lse - lse')`` (a row that saw no key
  keeps ``out = 0`` and takes ``lse' = s_h``);
- the backward kernels fed ``(out', lse')`` give dq, dk and dv with the sinks unchanged;
- ``d s_h = -sum over rows of exp(s_h - lse') * rowsum(dout * out')`` (a sink of -inf: 0).

Arrays are the attention's: ``out`` in its layout (``(B, H, S, D)``, ``(B, S, H, D)`` or packed
``(total, H, D)``), ``lse`` fp32 ``(B, H, S)`` or ``(H, total)``; packed batches touch only the
rows from ``cu_seqlens_q[0]`` to ``cu_seqlens_q[-1]`` (clamped to the arrays), as the kernels do.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def _sink_rows(sinks: Any, varlen: bool) -> Any:
    """The sinks as fp32, broadcastable against the lse (head on its second-last axis)."""
    s = sinks.astype(jnp.float32)
    return s[:, None] if varlen else s[None, :, None]


def _to_out(x: Any, layout: str, varlen: bool) -> Any:
    """An lse-shaped array broadcastable against ``out`` (one value per row)."""
    if varlen:
        return x.T[..., None]
    return (x if layout == "bhsd" else x.transpose(0, 2, 1))[..., None]


def _to_lse(x: Any, layout: str, varlen: bool) -> Any:
    """A per-row array in ``out``'s layout (its head dim reduced) in the lse's shape."""
    if varlen:
        return x.T
    return x if layout == "bhsd" else x.transpose(0, 2, 1)


def _packed_rows(lse: Any, cu_seqlens_q: Any) -> Any:
    """(1, total) mask of the rows of a packed batch's sequences."""
    total = lse.shape[-1]
    lo = jnp.clip(cu_seqlens_q[0], 0, total)
    hi = jnp.clip(cu_seqlens_q[-1], lo, total)
    rows = jnp.arange(total, dtype=cu_seqlens_q.dtype)
    return ((rows >= lo) & (rows < hi))[None, :]


def apply_sinks(out: Any, lse: Any, sinks: Any, *, layout: str, cu_seqlens_q: Any = None) -> tuple[Any, Any]:
    """``(out', lse')``: the forward's ``(out, lse)`` over the keys made the result with ``sinks``."""
    varlen = cu_seqlens_q is not None
    s = _sink_rows(sinks, varlen)
    # As attn_sinks computes it: both -inf (no key, a sink of -inf) gives -inf, not NaN.
    top = jnp.maximum(lse, s)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    new = top + jnp.log(jnp.exp(lse - top) + jnp.exp(s - top))
    scale = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - new))
    if varlen:
        rows = _packed_rows(lse, cu_seqlens_q)
        new, scale = jnp.where(rows, new, lse), jnp.where(rows, scale, 1.0)
    rescaled = (out.astype(jnp.float32) * _to_out(scale, layout, varlen)).astype(out.dtype)
    return rescaled, new


def sinks_grad(dout: Any, out: Any, lse: Any, sinks: Any, *, layout: str, cu_seqlens_q: Any = None) -> Any:
    """The gradient of ``sinks`` (shaped and typed like it) from the forward's final ``(out, lse)``
    (the sinks' own, as :func:`apply_sinks` returns them) and ``dout``."""
    varlen = cu_seqlens_q is not None
    s = _sink_rows(sinks, varlen)
    delta = _to_lse((dout.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1), layout, varlen)
    take = jnp.broadcast_to(s != -jnp.inf, lse.shape)
    if varlen:
        take = take & _packed_rows(lse, cu_seqlens_q)
    # A select, not a product: rows left out may hold NaN (packed padding) or exp(nan).
    share = jnp.where(take, jnp.exp(s - lse) * delta, 0.0)
    return (-share.sum(axis=-1 if varlen else (0, 2))).astype(sinks.dtype)
