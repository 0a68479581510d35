"""Decode attention for torch: ``torch.library`` custom ops with fake implementations.

Importing this module imports torch and registers ``aotriton_rt::decode_attention`` (reads the
caches) and ``aotriton_rt::decode_attention_append`` (writes ``k_new``/``v_new`` into them, so
it declares the caches mutated), each with a shape-only fake implementation: they trace under
``torch.compile`` and ``FakeTensorMode``, and they capture into CUDA graphs (no host
synchronisation: lengths stay on the device, outputs and split scratch come from torch's
allocator). :func:`decode_attention` picks the op::

    from aotriton_rt.ops.torch_decode import decode_attention
    out = decode_attention(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                           k_new=k, v_new=v, causal=True)

An fp8 cache (``torch.float8_e4m3fn``; ``float8_e4m3fnuz`` on gfx942) takes ``k_scale`` and
``v_scale``, floats or float32 tensors, as :func:`aotriton_rt.ops.decode.decode_attention` does: the
ops carry a tensor as ``Tensor?`` and a float as a ``float`` (0.0: none).

Decoding is inference: there is no autograd formula (train through ``aotriton_rt.ops.torch``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import decode as _core
from .attention.problem import ALIBI_WITH_SOFTCAP, check_softcap
from .torch import _library, _library_key

__all__ = ["decode_attention", "decode_attention_op", "decode_attention_append_op"]


def _call(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor | None, cache_len: int,
          block_table: Tensor | None, cache_leftpad: Tensor | None, k_new: Tensor | None, v_new: Tensor | None,
          causal: bool, window_left: int, window_right: int, scale: float, softcap: float, num_splits: int,
          max_seqlen_k: int, layout: str, cache_layout: str, library: int, sinks: Tensor | None = None,
          k_scale: Tensor | None = None, v_scale: Tensor | None = None, k_scale_value: float = 0.0,
          v_scale_value: float = 0.0, alibi_slopes: Tensor | None = None) -> tuple[Tensor, Tensor]:
    lens: Any = cache_seqlens if cache_seqlens is not None else (cache_len if cache_len >= 0 else None)
    window = None if window_left == -1 and window_right == -1 else (window_left, window_right)
    return _core.decode_attention(
        q, k_cache, v_cache, cache_seqlens=lens, block_table=block_table, cache_leftpad=cache_leftpad, k_new=k_new,
        v_new=v_new, causal=causal, window=window, scale=scale, softcap=softcap, num_splits=num_splits or None,
        max_seqlen_k=None if max_seqlen_k < 0 else max_seqlen_k, layout=layout, cache_layout=cache_layout,
        sinks=sinks, k_scale=_scale(k_scale, k_scale_value), v_scale=_scale(v_scale, v_scale_value),
        alibi_slopes=alibi_slopes, library=_library(library))


def _scale(tensor: Tensor | None, value: float) -> Tensor | float | None:
    """An fp8 cache's scale as the ops carry it: a tensor, else a float (0.0: none)."""
    return tensor if tensor is not None else (value or None)


def _fake(q: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    b, s, h = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bshd" else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("aotriton_rt::decode_attention", mutates_args=())
def decode_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor | None, cache_len: int,
                        block_table: Tensor | None, cache_leftpad: Tensor | None, sinks: Tensor | None,
                        alibi_slopes: Tensor | None, k_scale: Tensor | None, v_scale: Tensor | None,
                        k_scale_value: float, v_scale_value: float, causal: bool,
                        window_left: int, window_right: int, scale: float, softcap: float, num_splits: int,
                        max_seqlen_k: int, layout: str, cache_layout: str, library: int) -> tuple[Tensor, Tensor]:
    """(out, lse) of q against the caches (nothing appended). ``cache_len`` is a host length
    for every sequence (-1: use ``cache_seqlens``, or the whole cache when that is None);
    ``cache_leftpad``: each sequence's first cache row (None: 0); ``sinks``: attention sinks;
    ``alibi_slopes``: ALiBi slopes (fp32 ``(Hq,)`` or ``(B, Hq)``; None: none);
    ``softcap``: the logit softcap (0.0: none); ``k_scale``/``v_scale`` (tensors) or
    ``k_scale_value``/``v_scale_value`` (floats, 0.0: none): an fp8 cache's scales."""
    return _call(q, k_cache, v_cache, cache_seqlens, cache_len, block_table, cache_leftpad, None, None, causal,
                 window_left, window_right, scale, softcap, num_splits, max_seqlen_k, layout, cache_layout, library,
                 sinks, k_scale, v_scale, k_scale_value, v_scale_value, alibi_slopes)


@decode_attention_op.register_fake
def _decode_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor | None, cache_len: int,
                 block_table: Tensor | None, cache_leftpad: Tensor | None, sinks: Tensor | None,
                 alibi_slopes: Tensor | None, k_scale: Tensor | None, v_scale: Tensor | None, k_scale_value: float,
                 v_scale_value: float, causal: bool,
                 window_left: int, window_right: int, scale: float, softcap: float, num_splits: int,
                 max_seqlen_k: int, layout: str, cache_layout: str, library: int) -> tuple[Tensor, Tensor]:
    return _fake(q, layout)


@torch.library.custom_op("aotriton_rt::decode_attention_append", mutates_args=("k_cache", "v_cache"))
def decode_attention_append_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor | None,
                               cache_len: int, block_table: Tensor | None, cache_leftpad: Tensor | None,
                               sinks: Tensor | None, alibi_slopes: Tensor | None, k_scale: Tensor | None,
                               v_scale: Tensor | None,
                               k_scale_value: float, v_scale_value: float, k_new: Tensor, v_new: Tensor, causal: bool,
                               window_left: int,
                               window_right: int, scale: float, softcap: float, num_splits: int, max_seqlen_k: int,
                               layout: str, cache_layout: str, library: int) -> tuple[Tensor, Tensor]:
    """As ``decode_attention`` after writing k_new/v_new at ``cache_seqlens[b] + i`` (into an fp8
    cache: ``value / scale``, saturated, rounded to nearest)."""
    return _call(q, k_cache, v_cache, cache_seqlens, cache_len, block_table, cache_leftpad, k_new, v_new, causal,
                 window_left, window_right, scale, softcap, num_splits, max_seqlen_k, layout, cache_layout, library,
                 sinks, k_scale, v_scale, k_scale_value, v_scale_value, alibi_slopes)


@decode_attention_append_op.register_fake
def _append_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor | None, cache_len: int,
                 block_table: Tensor | None, cache_leftpad: Tensor | None, sinks: Tensor | None,
                 alibi_slopes: Tensor | None, k_scale: Tensor | None, v_scale: Tensor | None, k_scale_value: float,
                 v_scale_value: float, k_new: Tensor, v_new: Tensor, causal: bool, window_left: int,
                 window_right: int, scale: float, softcap: float, num_splits: int, max_seqlen_k: int, layout: str,
                 cache_layout: str, library: int) -> tuple[Tensor, Tensor]:
    return _fake(q, layout)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cache_seqlens: Tensor | int | None = None,
                     block_table: Tensor | None = None, k_new: Tensor | None = None, v_new: Tensor | None = None,
                     causal: bool = False, window: tuple[int, int] | None = None, scale: float | None = None,
                     softcap: float = 0.0, num_splits: int | None = None, max_seqlen_k: int | None = None,
                     layout: str = "bshd", cache_layout: str = "bshd", cache_leftpad: Tensor | None = None,
                     return_lse: bool = False, sinks: Tensor | None = None, k_scale: Tensor | float | None = None,
                     v_scale: Tensor | float | None = None, alibi_slopes: Tensor | None = None,
                     library: Any = None) -> Tensor | tuple[Tensor, Tensor]:
    """Decode attention on torch tensors through the custom ops (see
    :func:`aotriton_rt.ops.decode.decode_attention` for the arguments).

    Returns:
        ``out`` shaped like q; ``(out, lse)`` with ``return_lse``.

    Example::

        out = decode_attention(q, k_cache, v_cache, cache_seqlens=lens, k_new=k, v_new=v, causal=True)
        lens += 1   # the caller advances the lengths
        # An fp8 cache, one scale per KV head:
        out = decode_attention(q, k_fp8, v_fp8, cache_seqlens=lens, k_scale=ks, v_scale=vs)
    """
    if window is not None and not (isinstance(window, (tuple, list)) and len(window) == 2):
        from ..errors import ArgumentError

        raise ArgumentError(f"window must be (left, right), two integers >= -1 (-1: unbounded), got {window!r}")
    if (k_new is None) != (v_new is None):
        from ..errors import ArgumentError

        raise ArgumentError("k_new and v_new come together (the rows to append to both caches)")
    left, right = window if window is not None else (-1, -1)
    cache_len = -1
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_len, cache_seqlens = cache_seqlens, None
    if scale is None:
        scale = q.shape[-1] ** -0.5
    # Checked here, as the operator would: the op's schema takes a plain float (0.0: none).
    softcap = check_softcap(softcap, scale)
    if alibi_slopes is not None and softcap:
        from ..errors import UnsupportedError

        raise UnsupportedError(ALIBI_WITH_SOFTCAP)
    (k_tensor, k_value), (v_tensor, v_value) = _split_scale(k_scale, "k_scale"), _split_scale(v_scale, "v_scale")
    scales = (k_tensor, v_tensor, k_value, v_value)
    common = (causal, left, right, float(scale), softcap, int(num_splits or 0),
              -1 if max_seqlen_k is None else max_seqlen_k, layout, cache_layout, _library_key(library))
    if k_new is None and v_new is None:
        out, lse = decode_attention_op(q, k_cache, v_cache, cache_seqlens, cache_len, block_table, cache_leftpad,
                                       sinks, alibi_slopes, *scales, *common)
    else:
        out, lse = decode_attention_append_op(q, k_cache, v_cache, cache_seqlens, cache_len, block_table,
                                              cache_leftpad, sinks, alibi_slopes, *scales, k_new, v_new, *common)
    return (out, lse) if return_lse else out


def _split_scale(value: Any, name: str) -> tuple[Tensor | None, float]:
    """(tensor, float) of an fp8 cache's scale as the ops carry it; a float is checked here, as the
    operator would (the op's 0.0 means none)."""
    import math

    if value is None or isinstance(value, Tensor):
        return value, 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        from ..errors import ArgumentError

        raise ArgumentError(f"{name} must be a finite number > 0, got {value!r}")
    return None, float(value)
