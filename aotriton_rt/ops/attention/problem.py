"""Step 1 of a call: the problem it describes, validated.

Every argument is checked here before anything is allocated or launched, and every refusal names
the offending argument, its value and what is supported. The result, a :class:`Problem`, holds
the facts later steps need: sizes, layout, dtype, device, the mask and the kernels' scalar
arguments (named by :mod:`.family`, which also gives the strides of a ``(batch, heads, rows,
dim)`` array as the kernels address it).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ... import interop
from ...errors import ArgumentError, UnsupportedError
from .family import DTYPES, FP8_DTYPES, HEAD_DIM_BUCKETS, AttentionCall, bhs, lse_strides, scalar_arguments
from .framework import arrays_for

GRID_Y = 65535  # batch * heads is the grid's y extent
I32_MAX = 2**31 - 1
U64 = 2**64
LAYOUTS = ("bhsd", "bshd")
ALIGNS = ("top_left", "bottom_right")


def _describe(obj: Any, name: str) -> interop.ArrayInfo:
    # Module-level so that a test can let CPU tensors through (tests/runtime/test_attention_op.py).
    try:
        return interop.describe(obj)
    except ArgumentError as e:
        raise ArgumentError(f"{name}: {e}") from None
    except UnsupportedError as e:
        raise UnsupportedError(f"{name}: {e}") from None


def describe(obj: Any, name: str) -> interop.ArrayInfo:
    """:func:`aotriton_rt.interop.describe` with errors prefixed by the argument's name."""
    return _describe(obj, name)


@dataclass
class Problem:
    """A validated call: facts, argument infos and the scalar arguments of the kernels."""

    q: Any
    k: Any
    v: Any
    qi: interop.ArrayInfo
    ki: interop.ArrayInfo
    vi: interop.ArrayInfo
    layout: str
    varlen: bool
    batch: int
    heads_q: int
    heads_k: int
    seqlen_q: int  # dense length, or max_seqlen under varlen
    seqlen_k: int
    rows_q: int  # rows of the q/out arrays per (batch, head): seqlen_q, or total_q under varlen
    rows_k: int
    head_dim: int
    head_dim_v: int
    dtype: str
    device: int
    causal_mode: int
    causal_equivalent: bool
    window_left: int
    window_right: int
    scale: float
    dropout_p: float
    seed: int
    offset: int
    bias: Any = None
    bias_info: interop.ArrayInfo | None = None
    cu_q: Any = None
    cu_k: Any = None
    cu_qi: interop.ArrayInfo | None = None
    cu_ki: interop.ArrayInfo | None = None
    softcap: float = 0.0  # 0: none
    alibi: Any = None  # the ALiBi slopes, fp32 (Hq,) or (B, Hq)
    alibi_info: interop.ArrayInfo | None = None
    alibi_stride: int = 0  # the slopes' batch stride (0: shared by the batch)

    def call(self, dropout: int) -> AttentionCall:
        return AttentionCall(self.dtype, self.head_dim, self.head_dim_v, self.causal_mode, self.causal_equivalent,
                             self.bias is not None, dropout, self.varlen, self.seqlen_q, self.seqlen_k,
                             self.lse_strides(), bool(self.softcap), self.alibi_info is not None)

    def out_shape(self, width: int | None = None) -> tuple[int, ...]:
        d = self.head_dim_v if width is None else width
        if self.varlen:
            return (self.rows_q, self.heads_q, d)
        if self.layout == "bhsd":
            return (self.batch, self.heads_q, self.seqlen_q, d)
        return (self.batch, self.seqlen_q, self.heads_q, d)

    def lse_shape(self) -> tuple[int, ...]:
        return (self.heads_q, self.rows_q) if self.varlen else (self.batch, self.heads_q, self.seqlen_q)

    def lse_strides(self) -> tuple[int, int]:
        """(stride_lz, stride_lh) of the LSE and Delta arrays every launch path passes: both are
        contiguous :meth:`lse_shape` (the forward writes it so, the backward reads the caller's
        in place only when it is, else a contiguous copy); varlen rows are packed per head. Not
        padded: multiples of 16 exactly when ``seqlen_q`` is (fixed lengths)."""
        return lse_strides(self.lse_shape(), self.varlen)

    def bias_full_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads_q, self.seqlen_q, self.seqlen_k)

    def scalars(self) -> dict[str, Any]:
        """The kernels' scalar arguments (:func:`.family.scalar_arguments`)."""
        return scalar_arguments(batch=self.batch, heads_q=self.heads_q, heads_k=self.heads_k, seqlen_q=self.seqlen_q,
                                seqlen_k=self.seqlen_k, scale=self.scale, dropout_p=self.dropout_p, seed=self.seed,
                                offset=self.offset, window_left=self.window_left, window_right=self.window_right,
                                causal_mode=self.causal_mode, softcap=self.softcap)


def int_arg(value: Any, name: str, low: int, high: int | None = None) -> int:
    """An integer option in ``[low, high]``, or ArgumentError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = operator.index(value)
        except TypeError:
            raise ArgumentError(f"{name} must be an integer, got {value!r}") from None
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ArgumentError(f"{name} must be {bounds}, got {value}")
    return value


def same_device(infos: Sequence[tuple[str, interop.ArrayInfo]]) -> int:
    device, first = -1, ""
    for name, info in infos:
        if info.device < 0:
            continue  # unknown (CAI without a resolver): the launch path checks the pointer
        if device < 0:
            device, first = info.device, name
        elif info.device != device:
            raise ArgumentError(f"{name} is on device {info.device} but {first} is on device {device}; "
                                f"every array must be on one GPU")
    return device


def window_sides(causal: bool, window: Any) -> tuple[int, int]:
    """(left, right): the keys a query sees either side of its diagonal (-1: unbounded), from
    ``causal`` and ``window`` (attention and decode alike). ArgumentError for a malformed window or
    one that contradicts ``causal``."""
    if window is not None:
        ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
            isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)
        if not ok:
            raise ArgumentError(f"window must be (left, right), two integers >= -1 (-1: unbounded), got {window!r}")
        left, right = window
    else:
        left, right = -1, -1
    if causal:
        if right not in (-1, 0):
            raise ArgumentError(f"causal=True hides every key right of the diagonal, but window={tuple(window)} asks "
                                f"for {right} keys there; pass window=({left}, 0) or causal=False")
        right = 0
    return left, right


def mask_mode(causal: Any, window: Any, align: str, seqlen_q: int, seqlen_k: int, varlen: bool, same_cu: bool
          ) -> tuple[int, bool, int, int]:
    """(CAUSAL mode, alignments equivalent, window_left, window_right) from the user's options."""
    if not isinstance(causal, bool):
        raise ArgumentError(f"causal must be True or False, got {causal!r}; choose the diagonal with "
                            f"align='top_left' or 'bottom_right'")
    if align not in ALIGNS:
        raise ArgumentError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    left, right = window_sides(causal, window)
    if not causal and left < 0 and right < 0:
        return 0, False, -1, -1
    equivalent = (not varlen and seqlen_q == seqlen_k) or (varlen and same_cu)
    return (1 if align == "top_left" else 2), equivalent, left, right


def check_softcap(softcap: Any, scale: float) -> float:
    """The logit softcap as a float, 0.0 for none (None or 0); ArgumentError unless a finite
    positive number, or with a zero ``scale`` (the kernels divide by it)."""
    if softcap is None or (type(softcap) in (int, float) and softcap == 0):
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        raise ArgumentError(f"softcap must be a finite number > 0 (None or 0: no softcap), got {softcap!r}")
    if scale == 0:
        raise ArgumentError("softcap needs a non-zero scale")
    return float(softcap)


#: Why a call with both ALiBi slopes and a softcap is refused (the call, explain and warmup).
ALIBI_WITH_SOFTCAP = "alibi_slopes with softcap= is not compiled (no model combines them); drop one"


def check_alibi(p: Problem, slopes: Any, infos: Sequence[tuple[str, interop.ArrayInfo]]) -> None:
    """Validate the ALiBi slopes of problem ``p`` and record them on it: fp32, shape ``(Hq,)`` or
    ``(B, Hq)``, contiguous along the heads, on the device of ``infos``' arrays. UnsupportedError
    with a bias tensor or a softcap (no kernel combines them)."""
    ai = _describe(slopes, "alibi_slopes")
    if p.bias is not None:
        raise UnsupportedError("alibi_slopes with bias= is not compiled: the ALiBi kernels take no bias tensor; "
                               "add the ALiBi term to the bias instead (-slope * |i + seqlen_k - seqlen_q - j|), or "
                               "drop one")
    stride = alibi_stride(ai, p.batch, p.heads_q, p.softcap)
    same_device(list(infos) + [("alibi_slopes", ai)])
    p.alibi, p.alibi_info, p.alibi_stride = slopes, ai, stride


def alibi_stride(ai: interop.ArrayInfo, batch: int, heads_q: int, softcap: float) -> int:
    """The batch stride of ALiBi slopes ``ai`` (0: one ``(Hq,)`` vector shared by the batch);
    ArgumentError unless fp32 of shape ``(Hq,)`` or ``(B, Hq)``, contiguous along the heads;
    UnsupportedError with a softcap. Shared by the attention and decode operators."""
    if softcap:
        raise UnsupportedError(ALIBI_WITH_SOFTCAP)
    if ai.dtype != "fp32":
        raise ArgumentError(f"alibi_slopes must be float32, got {ai.dtype}; convert it, e.g. slopes.float()")
    shape = tuple(ai.shape)
    if shape not in ((heads_q,), (batch, heads_q)):
        raise ArgumentError(f"alibi_slopes must have shape ({heads_q},) (a slope per query head) or "
                            f"({batch}, {heads_q}) (per sequence and query head), got {shape}")
    if heads_q > 1 and ai.strides[-1] != 1:
        raise ArgumentError(f"alibi_slopes must be contiguous along the heads (stride 1), got stride "
                            f"{ai.strides[-1]}; pass slopes.contiguous()")
    stride = ai.strides[0] if len(shape) == 2 and batch > 1 else 0
    if stride < 0:
        raise ArgumentError(f"alibi_slopes has a negative batch stride {stride}; pass slopes.contiguous()")
    return stride


def prepare(q: Any, k: Any, v: Any, *, causal: Any, window: Any, align: str, bias: Any, dropout_p: Any,
             seed: Any, offset: Any, scale: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
             max_seqlen_k: Any, layout: str, softcap: Any = None, alibi_slopes: Any = None, fp8: bool = False
             ) -> Problem:
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout must be 'bhsd' (batch, heads, seqlen, head_dim) or 'bshd' (batch, seqlen, "
                            f"heads, head_dim), got {layout!r}")
    qi, ki, vi = _describe(q, "q"), _describe(k, "k"), _describe(v, "v")
    if fp8 and qi.dtype not in FP8_DTYPES:
        raise ArgumentError(f"q has dtype {qi.dtype}; FP8 attention takes e4m3 q, k, v ({', '.join(FP8_DTYPES)})")
    if not fp8 and qi.dtype in FP8_DTYPES:
        raise UnsupportedError(f"q has dtype {qi.dtype}: FP8 attention is an inference forward only "
                               f"(aotriton_rt.attention with fp8 q, k, v); no backward, bias, dropout, softcap or "
                               f"ALiBi with fp8 inputs")
    if not fp8 and qi.dtype not in DTYPES:
        raise UnsupportedError(f"q has dtype {qi.dtype}; attention supports {', '.join(DTYPES)} (and "
                               f"{', '.join(FP8_DTYPES)} forwards)")
    for name, info in (("k", ki), ("v", vi)):
        if info.dtype != qi.dtype:
            raise ArgumentError(f"{name} has dtype {info.dtype} but q has {qi.dtype}; q, k, v (and bias) must "
                                f"share one dtype")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    infos = [("q", qi), ("k", ki), ("v", vi)]
    cu_qi = cu_ki = None
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ArgumentError("variable-length attention needs both cu_seqlens_q and cu_seqlens_k "
                                "(int32 prefix sums of the sequence lengths, batch + 1 entries)")
        for name, info in (("q", qi), ("k", ki), ("v", vi)):
            if len(info.shape) != 3:
                raise ArgumentError(f"{name} must be 3-D (total, heads, head_dim) with cu_seqlens, got shape "
                                    f"{tuple(info.shape)}")
        cu_qi, cu_ki = _describe(cu_seqlens_q, "cu_seqlens_q"), _describe(cu_seqlens_k, "cu_seqlens_k")
        for name, info in (("cu_seqlens_q", cu_qi), ("cu_seqlens_k", cu_ki)):
            if info.dtype != "i32":
                raise ArgumentError(f"{name} must be int32, got {info.dtype}; convert it, e.g. cu.to(torch.int32)")
            if len(info.shape) != 1 or info.shape[0] < 2:
                raise ArgumentError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(info.shape)}")
            if info.strides[0] != 1:
                raise ArgumentError(f"{name} must be contiguous, got stride {info.strides[0]}")
        if cu_qi.shape != cu_ki.shape:
            raise ArgumentError(f"cu_seqlens_q has {cu_qi.shape[0]} entries but cu_seqlens_k has {cu_ki.shape[0]}; "
                                f"both are batch + 1 long")
        infos += [("cu_seqlens_q", cu_qi), ("cu_seqlens_k", cu_ki)]
        batch = cu_qi.shape[0] - 1
        rows_q, heads_q, dq_ = qi.shape
        rows_k, heads_k, dk_ = ki.shape
        rows_v, heads_v, dv_ = vi.shape
        if rows_v != rows_k:
            raise ArgumentError(f"v has {rows_v} rows but k has {rows_k}; k and v hold the same keys")
        seqlen_q = seqlen_k = -1
    else:
        for name, info in (("q", qi), ("k", ki), ("v", vi)):
            if len(info.shape) != 4:
                axes = "(batch, heads, seqlen, head_dim)" if layout == "bhsd" else "(batch, seqlen, heads, head_dim)"
                raise ArgumentError(f"{name} must be 4-D {axes} for layout={layout!r}, got shape "
                                    f"{tuple(info.shape)} (packed varlen arrays need cu_seqlens_q/k)")
        if max_seqlen_q is not None or max_seqlen_k is not None:
            raise ArgumentError("max_seqlen_q/max_seqlen_k only apply with cu_seqlens_q/cu_seqlens_k")
        (batch, heads_q, seqlen_q), _ = bhs(qi.shape, qi.strides, layout, False)
        (batch_k, heads_k, seqlen_k), _ = bhs(ki.shape, ki.strides, layout, False)
        (batch_v, heads_v, seqlen_v), _ = bhs(vi.shape, vi.strides, layout, False)
        dq_, dk_, dv_ = qi.shape[3], ki.shape[3], vi.shape[3]
        for name, b in (("k", batch_k), ("v", batch_v)):
            if b != batch:
                raise ArgumentError(f"{name} has batch {b} but q has batch {batch}")
        if seqlen_v != seqlen_k:
            raise ArgumentError(f"v has seqlen {seqlen_v} but k has {seqlen_k}; k and v hold the same keys")
        rows_q, rows_k = seqlen_q, seqlen_k
    if dk_ != dq_:
        raise ArgumentError(f"k has head dim {dk_} but q has {dq_}; q·k needs equal head dims (v's may differ)")
    for what, d in (("q·k", dq_), ("v", dv_)):
        if d < 1:
            raise ArgumentError(f"the {what} head dim is {d}; it must be at least 1")
        if d > HEAD_DIM_BUCKETS[-1]:
            raise UnsupportedError(f"the {what} head dim {d} exceeds the largest supported head dim "
                                   f"{HEAD_DIM_BUCKETS[-1]}; supported: 1..{HEAD_DIM_BUCKETS[-1]} (compiled "
                                   f"buckets {', '.join(map(str, HEAD_DIM_BUCKETS))}; others are zero-padded)")
    if heads_v != heads_k:
        raise ArgumentError(f"v has {heads_v} heads but k has {heads_k}; k and v share their heads")
    if heads_k < 1 or heads_q % heads_k:
        raise ArgumentError(f"q has {heads_q} heads, not a multiple of k's {heads_k}; grouped-query attention "
                            f"needs num_heads_q % num_heads_k == 0 (MQA: 1 key/value head)")
    if batch * heads_q > GRID_Y:
        raise UnsupportedError(f"batch * heads_q = {batch} * {heads_q} = {batch * heads_q} exceeds {GRID_Y}, the "
                               f"kernels' grid limit; split the batch into chunks of at most "
                               f"{max(GRID_Y // max(heads_q, 1), 1)}")
    if max(rows_q, rows_k) > I32_MAX:
        raise UnsupportedError(f"sequences of {max(rows_q, rows_k)} rows exceed the kernels' 32-bit row index")
    device = same_device(infos)

    # Scalars.
    if scale is None:
        scale = 1.0 / math.sqrt(dq_)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ArgumentError(f"scale must be a finite number, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ArgumentError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    softcap = check_softcap(softcap, scale)
    if dropout_p > 0:
        if seed is None:
            raise ArgumentError(f"dropout_p={dropout_p} needs seed= (and offset=): the backward must replay the "
                                f"forward's mask from the same (seed, offset)")
        seed = int_arg(seed, "seed", 0, U64 - 1)
        offset = int_arg(offset, "offset", 0, U64 - 1)
    else:
        seed, offset = 0, 0

    if varlen:
        if max_seqlen_q is None or max_seqlen_k is None:
            # Reading the lengths back synchronises with the device; callers in a hot loop pass them.
            xp = arrays_for(cu_qi.framework)
            if max_seqlen_q is None:
                max_seqlen_q = xp.max_len(xp.convert(cu_seqlens_q, cu_qi))
            if max_seqlen_k is None:
                max_seqlen_k = xp.max_len(xp.convert(cu_seqlens_k, cu_ki))
        seqlen_q = int_arg(max_seqlen_q, "max_seqlen_q", 0, I32_MAX)
        seqlen_k = int_arg(max_seqlen_k, "max_seqlen_k", 0, I32_MAX)
    same_cu = cu_seqlens_q is cu_seqlens_k and cu_seqlens_q is not None
    causal_mode, equivalent, left, right = mask_mode(causal, window, align, seqlen_q, seqlen_k, varlen, same_cu)

    p = Problem(q, k, v, qi, ki, vi, layout, varlen, batch, heads_q, heads_k, seqlen_q, seqlen_k, rows_q, rows_k,
                 dq_, dv_, qi.dtype, device, causal_mode, equivalent, left, right, float(scale), float(dropout_p),
                 seed, offset, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, cu_qi=cu_qi, cu_ki=cu_ki, softcap=softcap)
    if bias is not None:
        bi = _describe(bias, "bias")
        if bi.dtype != qi.dtype:
            raise ArgumentError(f"bias has dtype {bi.dtype} but q has {qi.dtype}; q, k, v (and bias) must share "
                                f"one dtype")
        full = p.bias_full_shape()
        shape = tuple(bi.shape)
        padded = (1,) * (4 - len(shape)) + shape
        if not 1 <= len(shape) <= 4 or any(e not in (1, f) for e, f in zip(padded, full)):
            what = "(batch, heads_q, max_seqlen_q, max_seqlen_k)" if varlen else "(batch, heads_q, seqlen_q, seqlen_k)"
            raise ArgumentError(f"bias of shape {shape} does not broadcast to {what} = {full}")
        same_device(infos + [("bias", bi)])
        p.bias, p.bias_info = bias, bi
    if alibi_slopes is not None:
        check_alibi(p, alibi_slopes, infos)
    return p


def check_output(obj: Any, name: str, shape: tuple[int, ...], dtype: str, p: Problem
                  ) -> interop.ArrayInfo | None:
    if obj is None:
        return None
    info = _describe(obj, name)
    if tuple(info.shape) != tuple(shape) or info.dtype != dtype:
        raise ArgumentError(f"{name} must have shape {tuple(shape)} and dtype {dtype}, got {tuple(info.shape)} "
                            f"{info.dtype}")
    if info.readonly:
        raise ArgumentError(f"{name} is read-only; pass a writable array")
    same_device([("q", p.qi), (name, info)])
    return info



def check_scheme(scheme: Any, deterministic: bool) -> None:
    if scheme not in (None, "split", "atomic"):
        raise ArgumentError(f"scheme must be None, 'split' or 'atomic', got {scheme!r}")
    if scheme == "atomic" and deterministic:
        raise UnsupportedError("scheme='atomic' sums dq with atomics and is not deterministic, but reproducible "
                               "results were asked for (deterministic=True, torch.use_deterministic_algorithms(True) "
                               "or XLA's --xla_gpu_deterministic_ops / --xla_gpu_exclude_nondeterministic_ops); "
                               "use scheme='split' or leave scheme unset")



# ---------------------------------------------------------------------------------------------
# Layout: whether the kernels can address an array in place (strides: :mod:`.family`).
# ---------------------------------------------------------------------------------------------

def addressable(info: interop.ArrayInfo, strides: Sequence[int], width: int, multiple: int) -> bool:
    """Can the kernels read this array in place as rows of ``width`` elements?"""
    dim_ok = info.shape[-1] == width and (info.strides[-1] == 1 or info.shape[-1] <= 1)
    return (dim_ok and info.ptr % 16 == 0 and all(s >= 0 and s % multiple == 0 for s in strides)
            and strides[-1] <= I32_MAX)
