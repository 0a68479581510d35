"""Decode call validation: shapes, strides, dtypes, lengths and pages, refused before any launch."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ... import interop
from ...errors import ArgumentError, UnsupportedError
from ..attention.problem import _describe, alibi_stride, check_softcap, window_sides  # shared with attention
from ..attention.sinks import check_sinks

DECODE = "attn_decode"
COMBINE = "attn_decode_combine"
APPEND = "attn_decode_append"
LENGTHS = "attn_decode_lengths"
PACK = "attn_decode_pack"
POISON = "attn_decode_poison"
# Mirror builder/kernels/decode.py (the runtime never imports the builder; a test keeps them equal).
HEAD_DIM_BUCKETS = (16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)
#: Longest query run per sequence decode_attention takes (key positions, window ends and
#: ``capacity + seqlen_q`` stay inside the kernels' int32 arithmetic).
MAX_SEQLEN_Q = 2**28
#: Most query rows per KV head (GQA group times query rows): the kernels' 32-bit row index and
#: the combine kernel's grid x.
MAX_GROUP_ROWS = 2**30
#: Longest query run that ``attention()`` and the transformers integration send to the decode
#: kernels by themselves (one token or a speculative draft); longer runs are prefill, which the
#: attention kernels do faster. ``decode_attention`` takes up to :data:`MAX_SEQLEN_Q`.
ROUTED_SEQLEN_Q = 16
DTYPES = ("fp16", "bf16", "fp32")
#: fp8 KV caches (e4m3), by catalog type: the torch dtype each is, and the targets whose images
#: hold their variants (mirrors builder/kernels/decode.py's ``FP8_KV``; a test keeps them equal).
FP8_CACHES = {"fp8e4nv": ("float8_e4m3fn", ("sm90", "gfx950")), "fp8e4b8": ("float8_e4m3fnuz", ("gfx942",))}
#: Query dtypes an fp8 cache serves.
FP8_QUERY_DTYPES = ("fp16", "bf16")
_ALIGN = 16
_GRID = 65535
_MAX_CAPACITY = 2**28  # lengths + windows stay far inside int32 in the kernels
_LAYOUTS = ("bshd", "bhsd")



@dataclass(frozen=True)
class KVScales:
    """An fp8 cache's dequantisation scales, as the kernels take them: a real value is the stored
    one times ``KScale[b * k_strides[0] + h * k_strides[1]] * k_value`` (likewise V). A per-head
    array: ``k_array`` True, its (batch, head) strides (0 along an axis it lacks), ``k_value`` 1.0;
    a Python float: ``k_array`` False, strides (0, 0) over an array holding 1.0, ``k_value`` it."""

    k_array: bool
    v_array: bool
    k_strides: tuple[int, int]
    v_strides: tuple[int, int]
    k_value: float
    v_value: float


@dataclass
class DecodePlan:
    """A validated decode call: sizes, strides (elements) and which kernels it needs."""

    dtype: str
    head_dim: int
    batch: int
    heads_q: int
    heads_k: int
    seqlen_q: int
    seqlen_new: int
    capacity: int
    paged: bool
    page_size: int
    num_pages: int
    seqlen_k_hint: int
    q_strides: tuple[int, int, int]
    k_strides: tuple[int, int, int]
    v_strides: tuple[int, int, int]
    kn_strides: tuple[int, int, int]
    vn_strides: tuple[int, int, int]
    bt_stride: int
    window_left: int
    window_right: int
    scale: float
    device: int
    q_copy: bool
    #: Every array read or written in place along the head dim (caches, appended rows) has a
    #: 16-byte aligned address and strides: what the PADDED_D=0 variants assume.
    aligned: bool = True
    #: The logit softcap (scores ``softcap * tanh(s / softcap)``); 0.0 for none.
    softcap: float = 0.0
    #: The caches' element type: ``dtype``, or an fp8 type of :data:`FP8_CACHES` ("" means ``dtype``).
    kv_dtype: str = ""
    #: An fp8 cache's scales (:class:`KVScales`); None for a cache of q's type.
    scales: KVScales | None = None
    #: ALiBi slopes given (fp32 ``(Hq,)`` or ``(B, Hq)``), and their batch stride (0: shared).
    alibi: bool = False
    alibi_stride: int = 0
    #: The attention sinks' dtype ("fp16", "bf16" or "fp32"; the kernels read fp32), "" without.
    sinks: str = ""

    def __post_init__(self) -> None:
        if not self.kv_dtype:
            self.kv_dtype = self.dtype

    @property
    def fp8(self) -> bool:
        """Whether the caches are fp8 (dequantised by the kernels with :attr:`scales`)."""
        return self.kv_dtype != self.dtype

    @property
    def group_rows(self) -> int:
        return self.heads_q // self.heads_k * self.seqlen_q


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ArgumentError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _bshd(info: interop.ArrayInfo, layout: str) -> tuple[tuple[int, int, int, int], tuple[int, int, int]]:
    """((batch, rows, heads, dim), (batch, head, row) strides) of a 4-D array in ``layout``."""
    s = info.strides
    if layout == "bshd":
        b, n, h, d = info.shape
        return (b, n, h, d), (s[0], s[2], s[1])
    b, h, n, d = info.shape
    return (b, n, h, d), (s[0], s[1], s[2])


def _dim_contiguous(info: interop.ArrayInfo) -> bool:
    return info.strides[-1] == 1 or info.shape[-1] <= 1


def _aligned(info: interop.ArrayInfo, strides: Sequence[int]) -> bool:
    return _dim_contiguous(info) and info.ptr % 16 == 0 and all(s >= 0 and s % _ALIGN == 0 for s in strides)


def _check_in_place(info: interop.ArrayInfo, name: str, strides: Sequence[int]) -> None:
    """Refuse an array the kernels cannot address in place: a head dim that is not contiguous,
    or a negative stride."""
    if not _dim_contiguous(info) or any(s < 0 for s in strides):
        raise ArgumentError(f"{name} must have a contiguous head dim and non-negative strides (it is read in "
                            f"place), got strides {tuple(info.strides)}")


def check_head_dim(d: int) -> None:
    """Refuse a head dim no bucket holds (the attention operator's wording)."""
    if d < 1:
        raise ArgumentError(f"head dim {d}: q, the caches and k_new/v_new need at least one column")
    if d > HEAD_DIM_BUCKETS[-1]:
        raise UnsupportedError(f"head dim {d} exceeds the largest supported head dim {HEAD_DIM_BUCKETS[-1]}; "
                               f"supported: 1..{HEAD_DIM_BUCKETS[-1]} (compiled buckets "
                               f"{', '.join(map(str, HEAD_DIM_BUCKETS))}; others are read masked on the next "
                               f"one)")


def _effective(extents: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    # An axis of extent 1 is never stepped over: 0 meets any divisibility.
    return tuple(0 if e <= 1 else s for e, s in zip(extents, strides))


def _check_dtype(info: interop.ArrayInfo, name: str, dtype: str) -> None:
    if info.dtype != dtype:
        raise ArgumentError(f"{name} has dtype {info.dtype} but q has {dtype}; q, the caches and k_new/v_new "
                            f"share one dtype")


def _cache_dtype(qi: interop.ArrayInfo, ki: interop.ArrayInfo, vi: interop.ArrayInfo) -> str:
    """The caches' element type: q's, or an e4m3 type of :data:`FP8_CACHES` with fp16/bf16 queries."""
    kv = ki.dtype
    if kv.startswith("fp8"):
        if kv not in FP8_CACHES:
            raise UnsupportedError(f"k_cache has dtype {kv}; fp8 caches are e4m3: torch.float8_e4m3fn (sm90, "
                                   f"gfx950) or torch.float8_e4m3fnuz (gfx942)")
        if vi.dtype != kv:
            raise ArgumentError(f"v_cache has dtype {vi.dtype} but k_cache has {kv}; the caches share one dtype")
        if qi.dtype not in FP8_QUERY_DTYPES:
            raise UnsupportedError(f"an fp8 cache (k_cache {FP8_CACHES[kv][0]}) serves fp16 and bf16 queries; q has "
                                   f"dtype {qi.dtype}: pass q in fp16 or bf16")
        return kv
    for name, info in (("k_cache", ki), ("v_cache", vi)):
        _check_dtype(info, name, qi.dtype)
    return qi.dtype


def _check_scales(k_scale: Any, v_scale: Any, fp8: bool, kv_dtype: str, batch: int, heads_k: int,
                  infos: dict[str, Any]) -> KVScales | None:
    """The fp8 cache's scales (:class:`KVScales`), or None for a cache of q's type; the arrays'
    infos go into ``infos`` (for the device check). ArgumentError for scales without an fp8
    cache, an fp8 cache without both, and malformed ones."""
    if not fp8:
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if value is not None:
                raise ArgumentError(f"{name} is for fp8 caches (float8_e4m3fn, float8_e4m3fnuz); the caches have "
                                    f"q's dtype {kv_dtype}: drop {name}")
        return None
    parts = []
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if value is None:
            raise ArgumentError(f"an fp8 cache ({FP8_CACHES[kv_dtype][0]}) needs k_scale and v_scale (a real value "
                                f"is the stored one times its scale): pass {name}, e.g. 1.0 for unscaled values")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value) or value <= 0:
                raise ArgumentError(f"{name} must be a finite number > 0, got {value!r}")
            parts.append((False, (0, 0), float(value)))
            continue
        if isinstance(value, bool):
            raise ArgumentError(f"{name} must be a number or an fp32 array, got {value!r}")
        si = _describe(value, name)
        if si.dtype != "fp32":
            raise ArgumentError(f"{name} must be float32, got {si.dtype}; convert it, e.g. {name}.float()")
        shape = tuple(si.shape)
        if shape in ((), (1,)):
            strides = (0, 0)
        elif shape == (heads_k,):
            strides = (0, si.strides[0] if heads_k > 1 else 0)
        elif shape == (batch, heads_k):
            strides = (si.strides[0] if batch > 1 else 0, si.strides[1] if heads_k > 1 else 0)
        else:
            raise ArgumentError(f"{name} must be a float, or a float32 array of shape () or (1,) (one scale), "
                                f"({heads_k},) (one per KV head) or ({batch}, {heads_k}) (per sequence and KV "
                                f"head), got shape {shape}")
        if any(st < 0 for st in strides):
            raise ArgumentError(f"{name} has negative strides {tuple(si.strides)}; pass {name}.contiguous()")
        infos[name] = si
        parts.append((True, strides, 1.0))
    (ka, kst, kv), (va, vst, vv) = parts
    return KVScales(ka, va, kst, vst, kv, vv)


def _plan(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any, block_table: Any, k_new: Any, v_new: Any,
          causal: bool, window: Any, scale: Any, max_seqlen_k: Any, layout: str, cache_layout: str,
          cache_leftpad: Any = None, softcap: Any = None, k_scale: Any = None,
          v_scale: Any = None, alibi_slopes: Any = None, sinks: Any = None) -> tuple[DecodePlan, dict[str, Any]]:
    if layout not in _LAYOUTS:
        raise ArgumentError(f"layout must be 'bshd' (batch, seqlen, heads, head_dim) or 'bhsd', got {layout!r}")
    if cache_layout not in _LAYOUTS:
        raise ArgumentError(f"cache_layout must be 'bshd' or 'bhsd', got {cache_layout!r}")
    qi, ki, vi = _describe(q, "q"), _describe(k_cache, "k_cache"), _describe(v_cache, "v_cache")
    if qi.dtype not in DTYPES:
        raise UnsupportedError(f"q has dtype {qi.dtype}; decode attention supports {', '.join(DTYPES)}")
    infos: dict[str, Any] = {"q": qi, "k_cache": ki, "v_cache": vi}
    kv_dtype = _cache_dtype(qi, ki, vi)
    for name, info in infos.items():
        if len(info.shape) != 4:
            raise ArgumentError(f"{name} must be 4-D, got shape {tuple(info.shape)}")
    if tuple(ki.shape) != tuple(vi.shape):
        raise ArgumentError(f"v_cache has shape {tuple(vi.shape)} but k_cache has {tuple(ki.shape)}; they hold the "
                            f"same rows")
    (batch, seqlen_q, heads_q, d), q_strides = _bshd(qi, layout)
    if not 1 <= seqlen_q <= MAX_SEQLEN_Q:
        raise ArgumentError(f"q has {seqlen_q} query rows per sequence; decode attention takes 1..MAX_SEQLEN_Q "
                            f"(2**28) (use aotriton_rt.attention for longer runs)")
    paged = block_table is not None
    if paged:
        num_pages, page_size, heads_k, dk = ki.shape
        k_strides = (ki.strides[0], ki.strides[2], ki.strides[1])
        v_strides = (vi.strides[0], vi.strides[2], vi.strides[1])
        bti = _describe(block_table, "block_table")
        infos["block_table"] = bti
        if bti.dtype != "i32":
            raise ArgumentError(f"block_table must be int32, got {bti.dtype}")
        if len(bti.shape) != 2 or bti.shape[0] != batch:
            raise ArgumentError(f"block_table must be (batch, max_blocks) = ({batch}, ...), got shape "
                                f"{tuple(bti.shape)}")
        if bti.shape[1] > 1 and bti.strides[1] != 1:
            raise ArgumentError(f"block_table rows must be contiguous, got strides {tuple(bti.strides)}")
        if page_size < 16 or page_size % 16:
            raise ArgumentError(f"page size {page_size} (k_cache.shape[1]) is not a multiple of 16; paged caches "
                                f"need pages of 16, 32, 48, ... rows")
        if num_pages < 1:
            raise ArgumentError("a paged cache needs at least one page")
        capacity = bti.shape[1] * page_size
        bt_stride = bti.strides[0] if batch > 1 else 0
    else:
        (kb, capacity, heads_k, dk), k_strides = _bshd(ki, cache_layout)
        _, v_strides = _bshd(vi, cache_layout)
        if kb != batch:
            raise ArgumentError(f"k_cache has batch {kb} but q has batch {batch} (a paged cache needs block_table)")
        num_pages, page_size, bt_stride = 1, 16, 0
        k_strides = _effective((batch, heads_k, capacity), k_strides)
        v_strides = _effective((batch, heads_k, capacity), v_strides)
    if dk != d:
        raise ArgumentError(f"k_cache has head dim {dk} but q has {d}")
    check_head_dim(d)
    if heads_k < 1 or heads_q % heads_k:
        raise ArgumentError(f"q has {heads_q} heads, not a multiple of the cache's {heads_k} KV heads")
    if heads_q // heads_k * seqlen_q > MAX_GROUP_ROWS:
        raise ArgumentError(f"{heads_q // heads_k} query heads per KV head times {seqlen_q} query rows exceed "
                            f"MAX_GROUP_ROWS (2**30) rows per KV head, the kernels' 32-bit row index; split the "
                            f"query rows into shorter runs")
    if batch * heads_k > _GRID:
        raise UnsupportedError(f"batch * kv heads = {batch * heads_k} exceeds {_GRID}, the kernels' grid limit")
    if capacity > _MAX_CAPACITY:
        raise UnsupportedError(f"a cache of {capacity} rows per sequence exceeds {_MAX_CAPACITY}")
    for name, info, strides in (("k_cache", ki, k_strides), ("v_cache", vi, v_strides)):
        _check_in_place(info, name, strides)
    aligned = _aligned(ki, k_strides) and _aligned(vi, v_strides)
    scales = _check_scales(k_scale, v_scale, kv_dtype != qi.dtype, kv_dtype, batch, heads_k, infos)
    q_strides = _effective((batch, heads_q, seqlen_q), q_strides)
    # A q the kernels cannot address is copied; one that is merely unaligned only where the
    # aligned (PADDED_D=0) variants run (_Launch decides).
    q_copy = not _dim_contiguous(qi) or any(s < 0 for s in q_strides)

    seqlen_new = 0
    kn_strides = vn_strides = (0, 0, 0)
    if (k_new is None) != (v_new is None):
        raise ArgumentError("k_new and v_new come together (the rows to append to both caches)")
    if k_new is not None:
        kni, vni = _describe(k_new, "k_new"), _describe(v_new, "v_new")
        infos.update(k_new=kni, v_new=vni)
        for name, info in (("k_new", kni), ("v_new", vni)):
            if kv_dtype != qi.dtype and info.dtype != qi.dtype:
                raise ArgumentError(f"{name} has dtype {info.dtype} but q has {qi.dtype}; k_new and v_new come in "
                                    f"q's dtype (the kernels quantise them into the fp8 cache)")
            _check_dtype(info, name, qi.dtype)
            if len(info.shape) != 4:
                raise ArgumentError(f"{name} must be 4-D, got shape {tuple(info.shape)}")
        if tuple(kni.shape) != tuple(vni.shape):
            raise ArgumentError(f"v_new has shape {tuple(vni.shape)} but k_new has {tuple(kni.shape)}")
        (nb, seqlen_new, nh, nd), kn_strides = _bshd(kni, layout)
        _, vn_strides = _bshd(vni, layout)
        if (nb, nh, nd) != (batch, heads_k, d):
            raise ArgumentError(f"k_new must hold (batch, rows, kv heads, head dim) = ({batch}, n, {heads_k}, {d}) "
                                f"in layout {layout!r}, got shape {tuple(kni.shape)}")
        if seqlen_new < 1:
            raise ArgumentError("k_new has no rows; pass k_new=None to append nothing")
        if cache_seqlens is None:
            raise ArgumentError("appending k_new needs cache_seqlens (where each sequence's new rows go)")
        kn_strides = _effective((batch, heads_k, seqlen_new), kn_strides)
        vn_strides = _effective((batch, heads_k, seqlen_new), vn_strides)
        for name, info, strides in (("k_new", kni, kn_strides), ("v_new", vni, vn_strides)):
            _check_in_place(info, name, strides)
            aligned = aligned and _aligned(info, strides)
    if seqlen_new > capacity:
        raise ArgumentError(f"appending {seqlen_new} rows exceeds the cache's capacity of {capacity} rows per "
                            f"sequence")

    hint = capacity
    host = _host_lengths(cache_seqlens)
    if host is not None:
        if len(host) != batch:
            raise ArgumentError(f"cache_seqlens must have shape ({batch},), got {len(host)} lengths")
        for b, n in enumerate(host):
            _check_length(n, seqlen_new, capacity, paged, f"cache_seqlens[{b}]")
    elif cache_seqlens is not None and not isinstance(cache_seqlens, int) or isinstance(cache_seqlens, bool):
        ci = _describe(cache_seqlens, "cache_seqlens")
        infos["cache_seqlens"] = ci
        if ci.dtype != "i32" or tuple(ci.shape) != (batch,) or (batch > 1 and ci.strides[0] != 1):
            raise ArgumentError(f"cache_seqlens must be a contiguous int32 array of shape ({batch},), got "
                                f"{ci.dtype} {tuple(ci.shape)}")
    elif cache_seqlens is not None:
        _check_length(cache_seqlens, seqlen_new, capacity, paged, "cache_seqlens")
        hint = cache_seqlens + seqlen_new
    if max_seqlen_k is not None:
        hint = _int(max_seqlen_k, "max_seqlen_k", 0, capacity)
    if cache_leftpad is not None:
        lens = host if host is not None else None if cache_seqlens is None or "cache_seqlens" in infos \
            else [cache_seqlens] * batch
        _check_leftpad(cache_leftpad, batch, capacity, lens, infos)

    if not isinstance(causal, bool):
        raise ArgumentError(f"causal must be True or False, got {causal!r}")
    left, right = window_sides(causal, window)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ArgumentError(f"scale must be a finite number, got {scale!r}")
    softcap = check_softcap(softcap, scale)
    slopes_stride = 0
    if alibi_slopes is not None:
        ai = _describe(alibi_slopes, "alibi_slopes")
        slopes_stride = alibi_stride(ai, batch, heads_q, softcap)
        if scale == 0:
            raise ArgumentError("alibi_slopes needs a non-zero scale (the kernels add the term in units of the "
                                "scaled scores)")
        infos["alibi_slopes"] = ai
    device = -1
    for name, info in infos.items():
        if info.device < 0:
            continue
        if device < 0:
            device = info.device
        elif info.device != device:
            raise ArgumentError(f"{name} is on device {info.device} but q is on device {device}; every array must "
                                f"be on one GPU")
    if sinks is not None:
        infos["sinks"] = check_sinks(sinks, heads_q, device)
    plan = DecodePlan(qi.dtype, d, batch, heads_q, heads_k, seqlen_q, seqlen_new, capacity, paged, page_size,
                      num_pages, hint, q_strides, k_strides, v_strides, kn_strides, vn_strides, bt_stride, left, right,
                      float(scale), device, q_copy, aligned, softcap, kv_dtype, scales, alibi_slopes is not None,
                      slopes_stride, infos["sinks"].dtype if sinks is not None else "")
    return plan, infos



def _check_leftpad(cache_leftpad: Any, batch: int, capacity: int, lens: list[int] | None, infos: dict) -> None:
    """Refuse a malformed ``cache_leftpad``, and host values outside ``[0, cache_seqlens[b]]``
    (``lens``: the cached lengths when known on the host; else ``[0, capacity]``)."""
    host = _host_starts(cache_leftpad)
    if host is None:
        if isinstance(cache_leftpad, (bool, int)):
            raise ArgumentError(f"cache_leftpad must be an int32 array of shape ({batch},), got {cache_leftpad!r}")
        li = _describe(cache_leftpad, "cache_leftpad")
        infos["cache_leftpad"] = li
        if li.dtype != "i32" or tuple(li.shape) != (batch,) or (batch > 1 and li.strides[0] != 1):
            raise ArgumentError(f"cache_leftpad must be a contiguous int32 array of shape ({batch},), got "
                                f"{li.dtype} {tuple(li.shape)}")
        return
    if len(host) != batch:
        raise ArgumentError(f"cache_leftpad must have shape ({batch},), got {len(host)} starts")
    check_starts(host, lens, capacity)


def check_starts(starts: Sequence[int], lens: Sequence[int] | None, capacity: int) -> None:
    """Refuse a left padding past its sequence's cached rows (``lens``; None: the capacity)."""
    for b, start in enumerate(starts):
        top = capacity if lens is None else lens[b]
        if not 0 <= start <= top:
            what = f"cache_seqlens[{b}] = {top}" if lens is not None else f"the capacity {capacity}"
            raise ArgumentError(f"cache_leftpad[{b}] = {start} must be in [0, {top}] ({what}): a sequence's keys "
                                f"start within its cached rows")


def _host_lengths(obj: Any) -> list[int] | None:
    """``cache_seqlens`` on the host (see :func:`_host_ints`)."""
    return _host_ints(obj, "cache_seqlens")


def _host_starts(obj: Any) -> list[int] | None:
    """``cache_leftpad`` on the host (see :func:`_host_ints`)."""
    return _host_ints(obj, "cache_leftpad")


def _host_ints(obj: Any, name: str) -> list[int] | None:
    """The lengths of a host array (a CPU torch tensor, a NumPy array), checked before launch and
    copied to the device per call; None for anything else (an int, None, a device array).
    Module-level so that tests running everything on the CPU can take CPU tensors as device arrays."""
    kind = (type(obj).__module__.split(".")[0], type(obj).__name__)
    if kind == ("torch", "Tensor") and obj.device.type == "cpu" or kind == ("numpy", "ndarray"):
        if obj.ndim != 1 or "int" not in str(obj.dtype):
            raise ArgumentError(f"{name} must be a 1-D integer array, got {obj.dtype} {tuple(obj.shape)}")
        return [int(n) for n in obj.tolist()]
    return None


def _check_length(n: int, seqlen_new: int, capacity: int, paged: bool, name: str) -> None:
    """Refuse a length the cache cannot hold with its appended rows (FlashAttention-2's rule: past
    ``block_table.shape[1] * page_size`` rows names block_table); exactly at capacity is fine."""
    if n < 0:
        raise ArgumentError(f"{name} must be >= 0, got {n}")
    if n + seqlen_new > capacity:
        what = ("block_table can address (block_table.shape[1] * page_size)" if paged
                else "k_cache holds (its sequence length)")
        raise ArgumentError(f"{name}={n} plus {seqlen_new} new rows exceeds the {capacity} rows {what} per sequence")


def _debug(check: Any) -> bool:
    if check is None:
        return os.environ.get("AOTRITON_RT_DEBUG", "") not in ("", "0")
    if not isinstance(check, bool):
        raise ArgumentError(f"check must be True, False or None, got {check!r}")
    return check


def _host(xp: Any, x: Any) -> list:
    return x.tolist() if xp.framework == "torch" else xp.cupy.asnumpy(x).tolist()


def _check_contents(xp: Any, p: DecodePlan, seqlens: Any, table: Any, starts: Any = None) -> None:
    """Debug mode: every length within capacity, every start within its length and every
    referenced page in [0, num_pages)."""
    lens = _host(xp, seqlens)
    rows = _host(xp, table) if table is not None else None
    firsts = _host(xp, starts) if starts is not None else [0] * len(lens)
    if starts is not None:
        check_starts(firsts, lens, p.capacity)
    for b, n in enumerate(lens):
        total = n + p.seqlen_new
        if n < 0 or total > p.capacity:
            raise ArgumentError(f"cache_seqlens[{b}] = {n} plus {p.seqlen_new} new rows is outside the {p.capacity} "
                                f"rows {'block_table can address' if p.paged else 'k_cache holds'}")
        if rows is not None:
            skip = firsts[b] // p.page_size  # pages wholly before a left padding's start are never read
            for j, page in enumerate(rows[b][skip:-(-total // p.page_size)], skip):
                if not 0 <= page < p.num_pages:
                    raise ArgumentError(f"block_table[{b}, {j}] = {page} is not a page of the cache "
                                        f"(0..{p.num_pages - 1}); sequence {b} has {total} rows")


