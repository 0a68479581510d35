"""Decode attention over a KV cache: split-KV kernels, contiguous and paged caches.

In the spirit of FlashAttention's ``flash_attn_with_kvcache``: a few query rows per sequence
(1..16: one generated token, or a speculative draft) attend to that sequence's cached keys and
values, optionally after appending new ones to the cache in the same call::

    out, lse = aotriton_rt.ops.decode.decode_attention(
        q, k_cache, v_cache, cache_seqlens=lens, k_new=k, v_new=v, causal=True)

**Shapes.** ``q``: ``(B, Sq, Hq, D)`` (``layout="bshd"``, the default) or ``(B, Hq, Sq, D)``
(``"bhsd"``). Contiguous caches: ``(B, S_cache, Hkv, D)`` (``cache_layout="bshd"``) or
``(B, Hkv, S_cache, D)`` (``"bhsd"``), any strides with a contiguous head dim. Paged caches:
``(num_pages, page_size, Hkv, D)`` with ``block_table`` int32 ``(B, max_blocks)``: row ``n`` of
sequence ``b`` is row ``n % page_size`` of page ``block_table[b, n // page_size]``; the page size
must be a multiple of 16. ``k_new``/``v_new``: ``(B, Sn, Hkv, D)`` (or ``(B, Hkv, Sn, D)`` with
``layout="bhsd"``).

**Lengths.** ``cache_seqlens`` (an int, or an int32 ``(B,)`` device array) counts the rows
already in the cache; new rows are written at ``cache_seqlens[b] + i`` and the queries see
``cache_seqlens[b] + Sn`` keys. The caller advances ``cache_seqlens`` afterwards (as with
FlashAttention). ``None``: every sequence fills its whole cache (``S_cache`` or ``max_blocks *
page_size`` rows), no append. Lengths known on the host are checked before launch; device
arrays are the caller's contract (kernels clamp lengths and page indices so bad values cannot
fault, they give wrong numbers): ``check=True`` or ``AOTRITON_RT_DEBUG=1`` reads them back and
checks every length and referenced page (a device synchronisation).

**Masks.** Bottom-right aligned (the queries are the sequence's last ``Sq`` rows): ``causal``
hides keys after each query, ``window=(left, right)`` is a sliding window (-1 unbounded).

**Splits.** One program per (GQA group tile, split, batch x KV head); the keys of each sequence
are cut into ``num_splits`` runs merged by a combine kernel. Default: enough programs for
``waves`` per SM, each split at least ``min_blocks`` key blocks, from the catalog's
``tuning["attn_decode"]`` rules (``{"arch": "sm90", "splits": {"waves": 2, "min_blocks": 4,
"max_splits": 64}}``; a rule may also pick a ``config`` and apply only from a work size on,
``min_batch_heads``, or to one cache kind, ``paged``), else :data:`DEFAULT_SPLIT_RULES`.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import interop
from ..errors import AotritonError, ArgumentError, CatalogError, KernelNotFound, UnsupportedError

__all__ = ["DEFAULT_SPLIT_RULES", "DecodePlan", "SplitRule", "decode_attention", "decode_kernels", "num_splits_for",
           "route_from_attention", "split_rule"]

DECODE = "attn_decode"
COMBINE = "attn_decode_combine"
APPEND = "attn_decode_append"
# Mirrors builder/kernels/decode.py (the runtime never imports the builder; a test keeps them equal).
HEAD_DIM_BUCKETS = (16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)
MAX_SEQLEN_Q = 16
DTYPES = ("fp16", "bf16", "fp32")
_ALIGN = 16
_GRID = 65535
_MAX_CAPACITY = 2**28  # lengths + windows stay far inside int32 in the kernels
_LAYOUTS = ("bshd", "bhsd")


@dataclass(frozen=True)
class SplitRule:
    """How many splits a call gets: ``waves`` resident programs per SM to fill (the decode
    tile's occupancy), splits of at least ``min_blocks`` key blocks, at most ``max_splits``."""

    waves: int = 2
    min_blocks: int = 4
    max_splits: int = 64


# Per target, when the catalog has no rule: SM (CU) counts of the usual parts and the rule.
DEFAULT_SPLIT_RULES: dict[str, SplitRule] = {"sm90": SplitRule(2, 4, 64), "sm80": SplitRule(2, 4, 64)}
_SM_COUNTS = {"sm80": 108, "sm86": 84, "sm89": 128, "sm90": 132, "gfx90a": 110, "gfx908": 120, "gfx942": 304,
              "gfx950": 256, "gfx1100": 48, "gfx1101": 30, "gfx1151": 20, "gfx1200": 32, "gfx1201": 32}


def num_splits_for(batch: int, heads_k: int, row_blocks: int, seqlen_k: int, block_n: int, sm_count: int,
                   rule: SplitRule) -> int:
    """Splits per (batch, KV head), FlashAttention's way: 1 when the programs already fill
    ``rule.waves`` programs per SM (80% of them), else the fewest splits whose last wave is
    nearly as full (85% of the best efficiency) as any split count allows, each split at least
    ``rule.min_blocks`` key blocks long and at most ``rule.max_splits`` of them; no split left
    without keys."""
    base = max(batch * heads_k * row_blocks, 1)
    slots = max(rule.waves * sm_count, 1)
    if base * 5 >= slots * 4:
        return 1
    blocks = -(-max(seqlen_k, 1) // block_n)
    limit = max(1, min(blocks // max(rule.min_blocks, 1), rule.max_splits))
    effs = []
    for s in range(1, limit + 1):
        waves = base * s / slots
        effs.append(waves / math.ceil(waves))
    best = max(effs)
    splits = next(s for s, e in enumerate(effs, 1) if e >= 0.85 * best)
    # The kernel gives every split cdiv(blocks, splits) blocks: drop the splits that would be left
    # empty (each still launches a program and adds a partial for the combine to read).
    return -(-blocks // -(-blocks // splits))


def split_rule(rules: Any, arch: str, *, batch_heads: int = 1, paged: bool = False) -> tuple[SplitRule, int]:
    """(split rule, config index) from catalog ``tuning["attn_decode"]`` rules for ``arch``.

    Rules are objects, the first that matches wins: ``arch`` (optional) the target,
    ``min_batch_heads`` (optional) at least that many (sequence, KV head) pairs in the call
    (``batch_heads``: the work size before splitting), ``paged`` (optional) the cache kind.
    ``splits`` (optional) overrides fields of the default rule, ``config`` (optional) picks a
    tuning config.
    """
    base = DEFAULT_SPLIT_RULES.get(arch, SplitRule())
    if not rules:
        return base, 0
    if not isinstance(rules, list):
        raise CatalogError(f"catalog tuning['attn_decode'] must be a list of rules, got {type(rules).__name__}")
    for i, rule in enumerate(rules):
        where = f"catalog tuning['attn_decode'][{i}]"
        if not isinstance(rule, dict):
            raise CatalogError(f"{where} must be an object, got {rule!r}")
        if "arch" in rule and rule["arch"] != arch:
            continue
        least = rule.get("min_batch_heads", 0)
        if isinstance(least, bool) or not isinstance(least, int) or not 0 <= least <= 2**31:
            raise CatalogError(f"{where}.min_batch_heads must be an integer in [0, 2**31], got {least!r}")
        kind = rule.get("paged")
        if kind is not None and not isinstance(kind, bool):
            raise CatalogError(f"{where}.paged must be true or false, got {kind!r}")
        if batch_heads < least or (kind is not None and kind != bool(paged)):
            continue
        splits = rule.get("splits", {})
        if not isinstance(splits, dict) or set(splits) - {"waves", "min_blocks", "max_splits"}:
            raise CatalogError(f"{where}.splits must be an object with waves, min_blocks, max_splits; got {splits!r}")
        fields = {}
        for key, (lo, hi) in {"waves": (1, 64), "min_blocks": (1, 4096), "max_splits": (1, 1024)}.items():
            if key in splits:
                value = splits[key]
                if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                    raise CatalogError(f"{where}.splits.{key} must be an integer in [{lo}, {hi}], got {value!r}")
                fields[key] = value
        config = rule.get("config", 0)
        if isinstance(config, bool) or not isinstance(config, int) or not 0 <= config < 64:
            raise CatalogError(f"{where}.config must be an integer in [0, 64), got {config!r}")
        return SplitRule(**{**base.__dict__, **fields}), config
    return base, 0


# ---------------------------------------------------------------------------------------------
# Arrays: torch or CuPy allocate outputs and scratch.
# ---------------------------------------------------------------------------------------------

def _describe(obj: Any, name: str) -> interop.ArrayInfo:
    try:
        return interop.describe(obj)
    except ArgumentError as e:
        raise ArgumentError(f"{name}: {e}") from None
    except UnsupportedError as e:
        raise UnsupportedError(f"{name}: {e}") from None


class _Arrays:
    """Allocation in the inputs' framework (torch; CuPy for CuPy inputs; torch, else CuPy, for
    other DLPack / CAI inputs)."""

    def __init__(self, framework: str) -> None:
        order = [framework] if framework in ("torch", "cupy") else ["torch", "cupy"]
        for name in order:
            try:
                if name == "torch":
                    import torch

                    self.mod, self.name = torch, "torch"
                    self.dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
                                   "i32": torch.int32}
                else:
                    import cupy

                    self.mod, self.name = cupy, "cupy"
                    self.dtypes = {"fp16": "float16", "fp32": "float32", "i32": "int32"}
                return
            except ImportError:
                continue
        raise UnsupportedError(f"decode attention on {framework} arrays allocates its outputs with torch or CuPy, "
                               f"and neither is installed")

    def convert(self, obj: Any, info: interop.ArrayInfo) -> Any:
        if self.name == "torch":
            torch = self.mod
            if isinstance(obj, torch.Tensor):
                return obj.detach() if obj.requires_grad else obj
            if hasattr(obj, "__dlpack__"):
                return torch.from_dlpack(obj)
            return torch.as_tensor(obj, device=torch.device("cuda", max(info.device, 0)))
        cupy = self.mod
        if isinstance(obj, cupy.ndarray):
            return obj
        with cupy.cuda.Device(max(info.device, 0)):
            return cupy.from_dlpack(obj) if hasattr(obj, "__dlpack__") else cupy.asarray(obj)

    def _dtype(self, dtype: str) -> Any:
        if dtype not in self.dtypes:
            raise UnsupportedError(f"CuPy has no {dtype} dtype; pass torch tensors for {dtype} decode attention")
        return self.dtypes[dtype]

    def empty(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        if self.name == "torch":
            return self.mod.empty(shape, dtype=self._dtype(dtype), device=like.device)
        with like.device:
            return self.mod.empty(shape, dtype=self._dtype(dtype))

    def full(self, shape: tuple[int, ...], value: float, dtype: str, like: Any) -> Any:
        if self.name == "torch":
            return self.mod.full(shape, value, dtype=self._dtype(dtype), device=like.device)
        with like.device:
            return self.mod.full(shape, value, dtype=self._dtype(dtype))

    def host(self, x: Any) -> list:
        return x.tolist() if self.name == "torch" else self.mod.asnumpy(x).tolist()

    def sm_count_of(self, device: int) -> int | None:
        """Multiprocessors (CUs) of ``device``, or None when the framework cannot tell."""
        try:
            if self.name == "torch":
                return int(self.mod.cuda.get_device_properties(max(device, 0)).multi_processor_count)
            return int(self.mod.cuda.Device(max(device, 0)).attributes["MultiProcessorCount"])
        except Exception:  # noqa: BLE001 - a framework without the property: the arch's table
            return None


_ARRAYS: dict[str, _Arrays] = {}


def _arrays(framework: str) -> _Arrays:
    xp = _ARRAYS.get(framework)
    if xp is None:
        xp = _ARRAYS[framework] = _Arrays(framework)
    return xp


# ---------------------------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------------------------

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


def _aligned(info: interop.ArrayInfo, strides: Sequence[int]) -> bool:
    dim_ok = info.strides[-1] == 1 or info.shape[-1] <= 1
    return dim_ok and info.ptr % 16 == 0 and all(s >= 0 and s % _ALIGN == 0 for s in strides)


def _effective(extents: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    # An axis of extent 1 is never stepped over: 0 meets any divisibility.
    return tuple(0 if e <= 1 else s for e, s in zip(extents, strides))


def _check_dtype(info: interop.ArrayInfo, name: str, dtype: str) -> None:
    if info.dtype != dtype:
        raise ArgumentError(f"{name} has dtype {info.dtype} but q has {dtype}; q, the caches and k_new/v_new "
                            f"share one dtype")


def _plan(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any, block_table: Any, k_new: Any, v_new: Any,
          causal: bool, window: Any, scale: Any, max_seqlen_k: Any, layout: str, cache_layout: str
          ) -> tuple[DecodePlan, dict[str, Any]]:
    if layout not in _LAYOUTS:
        raise ArgumentError(f"layout must be 'bshd' (batch, seqlen, heads, head_dim) or 'bhsd', got {layout!r}")
    if cache_layout not in _LAYOUTS:
        raise ArgumentError(f"cache_layout must be 'bshd' or 'bhsd', got {cache_layout!r}")
    qi, ki, vi = _describe(q, "q"), _describe(k_cache, "k_cache"), _describe(v_cache, "v_cache")
    if qi.dtype not in DTYPES:
        raise UnsupportedError(f"q has dtype {qi.dtype}; decode attention supports {', '.join(DTYPES)}")
    infos: dict[str, Any] = {"q": qi, "k_cache": ki, "v_cache": vi}
    for name in ("k_cache", "v_cache"):
        _check_dtype(infos[name], name, qi.dtype)
    for name, info in infos.items():
        if len(info.shape) != 4:
            raise ArgumentError(f"{name} must be 4-D, got shape {tuple(info.shape)}")
    if tuple(ki.shape) != tuple(vi.shape):
        raise ArgumentError(f"v_cache has shape {tuple(vi.shape)} but k_cache has {tuple(ki.shape)}; they hold the "
                            f"same rows")
    (batch, seqlen_q, heads_q, d), q_strides = _bshd(qi, layout)
    if not 1 <= seqlen_q <= MAX_SEQLEN_Q:
        raise ArgumentError(f"q has {seqlen_q} query rows per sequence; decode attention takes 1..{MAX_SEQLEN_Q} "
                            f"(use aotriton_rt.attention for prefill)")
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
    if d not in HEAD_DIM_BUCKETS:
        raise UnsupportedError(f"head dim {d}: the cache is read in place, so its head dim must be one of "
                               f"{', '.join(map(str, HEAD_DIM_BUCKETS))}; allocate the cache padded to the next one")
    if heads_k < 1 or heads_q % heads_k:
        raise ArgumentError(f"q has {heads_q} heads, not a multiple of the cache's {heads_k} KV heads")
    if batch * heads_k > _GRID:
        raise UnsupportedError(f"batch * kv heads = {batch * heads_k} exceeds {_GRID}, the kernels' grid limit")
    if capacity > _MAX_CAPACITY:
        raise UnsupportedError(f"a cache of {capacity} rows per sequence exceeds {_MAX_CAPACITY}")
    for name, info, strides in (("k_cache", ki, k_strides), ("v_cache", vi, v_strides)):
        if not _aligned(info, strides):
            raise ArgumentError(f"{name} must have a contiguous head dim, a 16-byte aligned address and strides "
                                f"that are multiples of 16 elements (it is read and written in place), got "
                                f"strides {tuple(info.strides)}")
    q_strides = _effective((batch, heads_q, seqlen_q), q_strides)
    q_copy = not _aligned(qi, q_strides)

    seqlen_new = 0
    kn_strides = vn_strides = (0, 0, 0)
    if (k_new is None) != (v_new is None):
        raise ArgumentError("k_new and v_new come together (the rows to append to both caches)")
    if k_new is not None:
        kni, vni = _describe(k_new, "k_new"), _describe(v_new, "v_new")
        infos.update(k_new=kni, v_new=vni)
        for name, info in (("k_new", kni), ("v_new", vni)):
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
            if not _aligned(info, strides):
                raise ArgumentError(f"{name} must have a contiguous head dim, a 16-byte aligned address and strides "
                                    f"that are multiples of 16 elements, got strides {tuple(info.strides)}")
    if seqlen_new > capacity:
        raise ArgumentError(f"appending {seqlen_new} rows exceeds the cache's capacity of {capacity} rows per "
                            f"sequence")

    hint = capacity
    if cache_seqlens is not None and not isinstance(cache_seqlens, int) or isinstance(cache_seqlens, bool):
        ci = _describe(cache_seqlens, "cache_seqlens")
        infos["cache_seqlens"] = ci
        if ci.dtype != "i32" or tuple(ci.shape) != (batch,) or (batch > 1 and ci.strides[0] != 1):
            raise ArgumentError(f"cache_seqlens must be a contiguous int32 array of shape ({batch},), got "
                                f"{ci.dtype} {tuple(ci.shape)}")
    elif cache_seqlens is not None:
        if not 0 <= cache_seqlens <= capacity - seqlen_new:
            what = "the block table can address" if paged else "the cache holds"
            raise ArgumentError(f"cache_seqlens={cache_seqlens} plus {seqlen_new} new rows exceeds the {capacity} rows "
                                f"{what} per sequence" if cache_seqlens >= 0
                                else f"cache_seqlens must be >= 0, got {cache_seqlens}")
        hint = cache_seqlens + seqlen_new
    if max_seqlen_k is not None:
        hint = _int(max_seqlen_k, "max_seqlen_k", 0, capacity)

    if not isinstance(causal, bool):
        raise ArgumentError(f"causal must be True or False, got {causal!r}")
    left, right = -1, -1
    if window is not None:
        ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
            isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)
        if not ok:
            raise ArgumentError(f"window must be (left, right), two integers >= -1 (-1: unbounded), got {window!r}")
        left, right = window
    if causal:
        if right not in (-1, 0):
            raise ArgumentError(f"causal=True hides every key right of the diagonal, but window={tuple(window)} asks "
                                f"for {right} keys there; pass window=({left}, 0) or causal=False")
        right = 0
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ArgumentError(f"scale must be a finite number, got {scale!r}")
    device = -1
    for name, info in infos.items():
        if info.device < 0:
            continue
        if device < 0:
            device = info.device
        elif info.device != device:
            raise ArgumentError(f"{name} is on device {info.device} but q is on device {device}; every array must "
                                f"be on one GPU")
    plan = DecodePlan(qi.dtype, d, batch, heads_q, heads_k, seqlen_q, seqlen_new, capacity, paged, page_size,
                      num_pages, hint, q_strides, k_strides, v_strides, kn_strides, vn_strides, bt_stride, left, right,
                      float(scale), device, q_copy)
    return plan, infos


# ---------------------------------------------------------------------------------------------
# Kernels of a library (cached).
# ---------------------------------------------------------------------------------------------

class _Kernels:
    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.lock = threading.Lock()
        self.handles: dict[tuple, Any] = {}
        self.arch: dict[int, str] = {}
        self.sms: dict[int, int] = {}
        self.available: dict[tuple, bool] = {}
        self.rules = None
        for cat in getattr(lib, "catalogs", ()):
            if (cat.tuning or {}).get(DECODE) is not None:
                self.rules = cat.tuning[DECODE]
                break

    def has(self, name: str, params: Mapping[str, Any]) -> bool:
        """Whether the images hold ``name`` with ``params`` (cached)."""
        key = (name, tuple(sorted(params.items())))
        hit = self.available.get(key)
        if hit is None:
            from ..select import match

            hit = self.available[key] = bool(match(getattr(self.lib, "variants", ()), name, dict(params)).accepted)
        return hit

    def device_arch(self, device: int) -> str:
        arch = self.arch.get(device)
        if arch is None:
            from .attention.dispatch import target_arch

            arch = self.arch[device] = target_arch(self.lib, device)
        return arch

    def handle(self, name: str, spec: Mapping[str, Any], config: int, device: int) -> Any:
        key = (name, tuple(sorted(spec.items())), config, device)
        hit = self.handles.get(key)
        if hit is not None:
            return hit
        params = dict(spec)
        if config:
            arch = self.device_arch(device)
            for v in self.lib.variants:
                if v.kernel == name and v.config.index == config and v.target.arch == arch and \
                        all(v.spec.get(k) == val for k, val in spec.items()):
                    params.update({**v.config.constexprs, "num_warps": v.config.num_warps,
                                   "num_stages": v.config.num_stages})
                    break
        try:
            hit = self.lib.kernel(name, **params)
        except KernelNotFound as e:
            shown = ", ".join(f"{k}={v}" for k, v in spec.items())
            raise KernelNotFound(f"decode attention needs {name} with {shown}, which these images lack; build it "
                                 f"(`python -m builder build --set full --kernels {name}`). {e}") from None
        with self.lock:
            self.handles[key] = hit
        return hit


_KERNELS: dict[int, _Kernels] = {}
_KERNELS_LOCK = threading.Lock()


def _kernels_of(library: Any) -> _Kernels:
    if library is None:
        from ..library import default_library

        library = default_library()
    ks = _KERNELS.get(id(library))
    if ks is None or ks.lib is not library:
        with _KERNELS_LOCK:
            ks = _KERNELS[id(library)] = _Kernels(library)
    return ks


def _block_n(handle: Any, device: int) -> int:
    try:
        return int(handle.variant(max(device, 0)).config.constexprs.get("BLOCK_N", 64))
    except Exception:  # noqa: BLE001 - handles without variants (tests): the usual tile
        return 64


def _block_m(handle: Any, device: int) -> int:
    try:
        return int(handle.variant(max(device, 0)).config.constexprs.get("BLOCK_M", 16))
    except Exception:  # noqa: BLE001
        return 16


# ---------------------------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------------------------

def _debug(check: Any) -> bool:
    if check is None:
        return os.environ.get("AOTRITON_RT_DEBUG", "") not in ("", "0")
    if not isinstance(check, bool):
        raise ArgumentError(f"check must be True, False or None, got {check!r}")
    return check


def _check_contents(xp: _Arrays, p: DecodePlan, seqlens: Any, table: Any) -> None:
    """Debug mode: every length within capacity and every referenced page in [0, num_pages)."""
    lens = xp.host(seqlens)
    rows = xp.host(table) if table is not None else None
    for b, n in enumerate(lens):
        total = n + p.seqlen_new
        if n < 0 or total > p.capacity:
            raise ArgumentError(f"cache_seqlens[{b}] = {n} plus {p.seqlen_new} new rows is outside the {p.capacity} "
                                f"rows the {'block table can address' if p.paged else 'cache holds'}")
        if rows is not None:
            for j, page in enumerate(rows[b][:-(-total // p.page_size)]):
                if not 0 <= page < p.num_pages:
                    raise ArgumentError(f"block_table[{b}, {j}] = {page} is not a page of the cache "
                                        f"(0..{p.num_pages - 1}); sequence {b} has {total} rows")


def decode_attention(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any = None, block_table: Any = None,
                     k_new: Any = None, v_new: Any = None, causal: bool = False,
                     window: tuple[int, int] | None = None, scale: float | None = None,
                     num_splits: int | None = None, max_seqlen_k: int | None = None, layout: str = "bshd",
                     cache_layout: str = "bshd", out: Any = None, check: bool | None = None,
                     library: Any = None) -> tuple[Any, Any]:
    """Attention of 1..16 query rows per sequence against a (contiguous or paged) KV cache.

    Arguments:
        q: ``(B, Sq, Hq, D)`` (``layout="bshd"``) or ``(B, Hq, Sq, D)``; fp16, bf16 or fp32.
        k_cache, v_cache: ``(B, S_cache, Hkv, D)`` (``cache_layout`` as for q), or paged
            ``(num_pages, page_size, Hkv, D)`` with ``block_table``. Read (and appended to) in place.
        cache_seqlens: rows already cached per sequence: an int or int32 ``(B,)`` device array;
            None: the whole cache.
        block_table: int32 ``(B, max_blocks)`` page indices (a paged cache).
        k_new, v_new: rows to write at ``cache_seqlens[b] + i`` before attending, shaped like q
            with Hkv heads.
        causal, window: bottom-right aligned causal mask and sliding window ``(left, right)``.
        scale: default ``1/sqrt(D)``.
        num_splits: override the split count (default: the catalog's rule, see the module docs).
        max_seqlen_k: an upper bound of the keys any sequence sees, for the split count only
            (default: ``cache_seqlens + Sn`` when an int, else the capacity).
        out: preallocated output shaped like q.
        check: read lengths and block table back and check them (default: ``AOTRITON_RT_DEBUG``).
        library: a :class:`aotriton_rt.Library`; default :func:`aotriton_rt.default_library`.

    Returns:
        ``(out, lse)``: out shaped like q; lse fp32 ``(B, Hq, Sq)`` (natural log; -inf for rows
        that see no key, whose output is 0).

    Raises:
        ArgumentError: malformed shapes, dtypes, strides, lengths the cache cannot hold, a page
            size that is not a multiple of 16; nothing has run.
        UnsupportedError: a head dim that is not a compiled bucket, sizes past the grid.
        KernelNotFound: the images lack the decode kernels for this dtype / head dim.
    """
    debug = _debug(check)
    key = None if debug else _torch_key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out, causal,
                                        window, scale, num_splits, max_seqlen_k, layout, cache_layout, library)
    if key is not None:
        launch = _LAUNCHES.get(key)
        # A plan holds while its library's tuning rules do (a benchmark comparing configs swaps them).
        if launch is not None and launch.ks.rules is launch.rules:
            if launch.fast is not None:
                return launch.run_fast(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out)
            return launch.run(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out)
    p, infos = _plan(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k_new,
                     v_new=v_new, causal=causal, window=window, scale=scale, max_seqlen_k=max_seqlen_k,
                     layout=layout, cache_layout=cache_layout)
    if num_splits is not None:
        num_splits = _int(num_splits, "num_splits", 1, 1024)
    if out is not None:
        out_i = _describe(out, "out")
        if tuple(out_i.shape) != tuple(infos["q"].shape) or out_i.dtype != p.dtype:
            raise ArgumentError(f"out must have shape {tuple(infos['q'].shape)} and dtype {p.dtype}, got "
                                f"{tuple(out_i.shape)} {out_i.dtype}")
        infos["out"] = out_i
    launch = _Launch(p, infos, _kernels_of(library), layout, num_splits, cache_seqlens)
    xp = launch.xp
    if debug:
        seqlens = launch.seqlens(xp.convert(q, infos["q"]), cache_seqlens, infos)
        table = xp.convert(block_table, infos["block_table"]) if p.paged else None
        _check_contents(xp, p, seqlens, table)
    if key is not None and not p.q_copy:
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.clear()
        _LAUNCHES[key] = launch
    return launch.run(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out, infos)


#: The array arguments of the decode kernels, in the order run_fast gathers their addresses.
_POINTERS = ("Q", "K", "V", "Out", "LSE", "BlockTable", "CacheSeqlens", "KNew", "VNew", "PartO", "PartL")

# Launch plans of recent torch calls, by everything that decides them (shapes, strides, dtypes,
# devices, alignment, options): a repeated decode step skips validation and planning.
_LAUNCHES: dict[tuple, _Launch] = {}
_MAX_LAUNCHES = 256


def cached_launch(q: Any, k_cache: Any, v_cache: Any, *, causal: bool = False, window: Any = None,
                  scale: Any = None, layout: str = "bshd", cache_layout: str = "bshd", library: Any = None) -> Any:
    """The launch plan a :func:`decode_attention` call with these arguments (no lengths, table,
    append or ``out``) made and cached, when it runs repeated calls with integer addresses; else None.

    For the attention operator's plans, whose own key already pins everything this plan depends
    on: they keep it and call ``run_fast(q, k, v, None, None, None, None, None)`` directly.
    """
    key = _torch_key(q, k_cache, v_cache, None, None, None, None, None, causal, window, scale, None, None, layout,
                     cache_layout, library)
    launch = _LAUNCHES.get(key) if key is not None else None
    return launch if launch is not None and launch.fast is not None else None


def _torch_key(q: Any, k: Any, v: Any, lens: Any, table: Any, kn: Any, vn: Any, out: Any, *options: Any
               ) -> tuple | None:
    """A key for the launch cache when every array is a torch tensor (else None: full checks)."""
    if type(q).__name__ != "Tensor" or type(q).__module__ != "torch":
        return None
    parts: list = [id(options[-1]) if options[-1] is not None else 0, *options[:-1]]
    for t in (q, k, v, lens, table, kn, vn, out):
        if t is None or (isinstance(t, int) and not isinstance(t, bool)):
            parts.append(t)
        elif type(t) is type(q):
            parts.append((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0))
        else:
            return None
    try:
        return tuple(parts) if hash(tuple(parts)) is not None else None
    except TypeError:  # an unhashable option (a list window): no caching
        return None


class _Launch:
    """Everything one call shape launches: handles, split count, scalar arguments."""

    def __init__(self, p: DecodePlan, infos: dict, ks: _Kernels, layout: str, num_splits: int | None,
                 cache_seqlens: Any) -> None:
        self.p, self.layout, self.ks, self.rules = p, layout, ks, ks.rules
        self.xp = xp = _arrays(infos["q"].framework)
        spec = {"dtype": p.dtype, "HEAD_DIM": p.head_dim}
        arch = ks.device_arch(p.device)
        rule, config = split_rule(ks.rules, arch, batch_heads=p.batch * p.heads_k, paged=p.paged)
        self.decode = ks.handle(DECODE, {**spec, "PAGED": int(p.paged)}, config, p.device)
        self.append = ks.handle(APPEND, {**spec, "PAGED": int(p.paged)}, 0, p.device) if p.seqlen_new else None
        row_blocks = -(-p.group_rows // _block_m(self.decode, p.device))
        if num_splits is None:
            sm = ks.sms.get(p.device)
            if sm is None:
                sm = ks.sms[p.device] = xp.sm_count_of(p.device) or _SM_COUNTS.get(arch, 100)
            num_splits = num_splits_for(p.batch, p.heads_k, row_blocks, p.seqlen_k_hint,
                                        _block_n(self.decode, p.device), sm, rule)
        self.num_splits = num_splits
        self.combine = ks.handle(COMBINE, spec, 0, p.device) if num_splits > 1 else None
        q_shape = tuple(infos["q"].shape)
        self.q_shape = q_shape
        self.lse_shape = (p.batch, p.heads_q, p.seqlen_q)
        self.part_rows = p.batch * p.heads_k * num_splits * p.group_rows
        oi = infos.get("out")
        o_strides = _bshd(oi, layout)[1] if oi is not None else _bshd_contiguous(q_shape, layout)
        o_strides = _effective((p.batch, p.heads_q, p.seqlen_q), o_strides)
        if oi is not None and not _aligned(oi, o_strides):
            raise ArgumentError(f"out must have a contiguous head dim, a 16-byte aligned address and strides that "
                                f"are multiples of 16 elements, got strides {tuple(oi.strides)}")
        self.lens_mode = "full" if cache_seqlens is None else "int" if isinstance(cache_seqlens, int) else "array"
        self.base = {"stride_btz": p.bt_stride, "batch": p.batch, "num_heads_q": p.heads_q,
                     "num_heads_k": p.heads_k, "seqlen_q": p.seqlen_q, "seqlen_new": p.seqlen_new,
                     "capacity": p.capacity, "num_pages": p.num_pages, "page_size": p.page_size, "sm_scale": p.scale,
                     "window_left": p.window_left, "window_right": p.window_right, "num_splits": num_splits,
                     **_named("q", "m", p.q_strides), **_named("k", "n", p.k_strides),
                     **_named("v", "n", p.v_strides), **_named("o", "m", o_strides),
                     **_named("kn", "m", p.kn_strides), **_named("vn", "m", p.vn_strides),
                     "stride_lz": p.heads_q * p.seqlen_q, "stride_lh": p.seqlen_q}
        self.fast = self._prepare() if xp.name == "torch" and p.device >= 0 and not p.q_copy else None
        self.lens = None  # the constant lengths array of "full"/"int" calls, made on the first fast call

    def _prepare(self) -> list | None:
        """Integer-address launches for torch tensors (as the attention plans do): per kernel,
        ``(launch, template, pointer slots)``, the scalars checked and the grid computed once.
        None when a handle cannot take them (the per-call handle path then serves)."""
        import sys

        torch = sys.modules["torch"]
        backend = "hip" if getattr(torch.version, "hip", None) else "cuda"
        values = {**self.base, **dict.fromkeys(_POINTERS, 0)}
        prepared = []
        for handle in (self.append, self.decode, self.combine):
            if handle is None:
                continue
            if not callable(getattr(handle, "prepare", None)) or \
                    getattr(getattr(handle, "library", None), "backend_now", None) != backend:
                return None
            template = [values[n] for n in handle.arg_names]
            launch = handle.prepare(self.p.device, template)
            if launch is None:
                return None
            slots = tuple((i, _POINTERS.index(n)) for i, n in enumerate(handle.arg_names) if n in _POINTERS)
            prepared.append((launch, template, slots))
        self.torch = torch
        self.stream = interop.stream_getter("torch")
        self.tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[self.p.dtype]
        return prepared

    def run_fast(self, q: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any, k_new: Any, v_new: Any,
                 out: Any) -> tuple[Any, Any]:
        """A repeated torch call: allocate, fill the address slots, launch (no per-call checks)."""
        torch, p, dev = self.torch, self.p, q.device
        o = out if out is not None else torch.empty(self.q_shape, dtype=self.tdtype, device=dev)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=dev)
        if p.batch == 0 or p.heads_q == 0:
            return o, lse
        if self.lens_mode == "array":
            lens = cache_seqlens
        else:
            lens = self.lens
            if lens is None:
                lens = self.seqlens(q, cache_seqlens)
                # Kept only when made outside a CUDA graph capture (a captured fill never ran).
                if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
                    self.lens = lens
        if self.combine is not None:  # one allocation: the partial outputs, then their logsumexps
            part_o = torch.empty((self.part_rows * (p.head_dim + 1),), dtype=torch.float32, device=dev).data_ptr()
            part_l = part_o + self.part_rows * p.head_dim * 4
        else:
            part_o = part_l = 0
        # In _POINTERS order.
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                     block_table.data_ptr() if block_table is not None else 0, lens.data_ptr(),
                     k_new.data_ptr() if k_new is not None else 0, v_new.data_ptr() if v_new is not None else 0,
                     part_o, part_l)
        stream = self.stream(p.device)
        for launch, template, slots in self.fast:
            args = list(template)
            for i, j in slots:
                args[i] = addresses[j]
            launch(stream, tuple(args))
        return o, lse

    def seqlens(self, like: Any, cache_seqlens: Any, infos: dict | None = None) -> Any:
        if self.lens_mode == "full":
            return self.xp.full((self.p.batch,), self.p.capacity, "i32", like)
        if self.lens_mode == "int":
            return self.xp.full((self.p.batch,), cache_seqlens, "i32", like)
        return cache_seqlens if infos is None else self.xp.convert(cache_seqlens, infos["cache_seqlens"])

    def run(self, q: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any, k_new: Any, v_new: Any, out: Any,
            infos: dict | None = None) -> tuple[Any, Any]:
        xp, p = self.xp, self.p
        if infos is not None:  # first call: any framework, converted once
            q, k, v = (xp.convert(a, infos[n]) for a, n in ((q, "q"), (k, "k_cache"), (v, "v_cache")))
            if p.q_copy:
                q = q.contiguous() if xp.name == "torch" else xp.mod.ascontiguousarray(q)
                p.q_strides = _effective((p.batch, p.heads_q, p.seqlen_q), _bshd(_describe(q, "q"), self.layout)[1])
                self.base.update(_named("q", "m", p.q_strides))
            block_table = xp.convert(block_table, infos["block_table"]) if p.paged else None
            if k_new is not None:
                k_new, v_new = xp.convert(k_new, infos["k_new"]), xp.convert(v_new, infos["v_new"])
            if out is not None:
                out = xp.convert(out, infos["out"])
        o = out if out is not None else xp.empty(self.q_shape, p.dtype, q)
        lse = xp.empty(self.lse_shape, "fp32", q)
        if p.batch == 0 or p.heads_q == 0:
            return o, lse
        values = {**self.base, "Q": q, "K": k, "V": v, "Out": o, "LSE": lse, "BlockTable": block_table,
                  "CacheSeqlens": self.seqlens(q, cache_seqlens, infos), "KNew": k_new, "VNew": v_new,
                  "PartO": None, "PartL": None}
        if self.append is not None:
            self.append(*[values[n] for n in self.append.arg_names])
        if self.combine is not None:
            values["PartO"] = xp.empty((self.part_rows, p.head_dim), "fp32", q)
            values["PartL"] = xp.empty((self.part_rows,), "fp32", q)
        self.decode(*[values[n] for n in self.decode.arg_names])
        if self.combine is not None:
            self.combine(*[values[n] for n in self.combine.arg_names])
        return o, lse


def _bshd_contiguous(shape: tuple, layout: str) -> tuple[int, int, int]:
    """(batch, head, row) strides of a contiguous array of ``shape`` in ``layout``."""
    b, x, y, d = shape
    return (x * y * d, d, y * d) if layout == "bshd" else (x * y * d, y * d, d)


def _named(prefix: str, row: str, strides: Sequence[int]) -> dict[str, int]:
    return {f"stride_{prefix}z": strides[0], f"stride_{prefix}h": strides[1], f"stride_{prefix}{row}": strides[2]}


def decode_kernels(q: Any, k_cache: Any, v_cache: Any, *, library: Any = None, **options: Any) -> dict[str, Any]:
    """The kernel handles :func:`decode_attention` with these arguments launches (nothing runs);
    for benchmarks that time the exact binaries or report their configs."""
    p, _ = _plan(q, k_cache, v_cache, cache_seqlens=options.pop("cache_seqlens", None),
                 block_table=options.pop("block_table", None), k_new=options.pop("k_new", None),
                 v_new=options.pop("v_new", None), causal=options.pop("causal", False),
                 window=options.pop("window", None), scale=options.pop("scale", None),
                 max_seqlen_k=options.pop("max_seqlen_k", None), layout=options.pop("layout", "bshd"),
                 cache_layout=options.pop("cache_layout", "bshd"))
    if options:
        raise ArgumentError(f"unknown option(s) {', '.join(sorted(options))}")
    ks = _kernels_of(library)
    spec = {"dtype": p.dtype, "HEAD_DIM": p.head_dim}
    handles = {DECODE: ks.handle(DECODE, {**spec, "PAGED": int(p.paged)}, 0, p.device),
               COMBINE: ks.handle(COMBINE, spec, 0, p.device)}
    if p.seqlen_new:
        handles[APPEND] = ks.handle(APPEND, {**spec, "PAGED": int(p.paged)}, 0, p.device)
    return handles


# ---------------------------------------------------------------------------------------------
# Routing from aotriton_rt.attention (issue #13): short query runs go to the decode kernels.
# ---------------------------------------------------------------------------------------------

def route_from_attention(q: Any, k: Any, v: Any, *, causal: Any, window: Any, align: Any, bias: Any,
                         dropout_p: Any, scale: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, layout: Any, out: Any,
                         lse: Any, return_mask: Any, library: Any) -> tuple[Any, Any] | None:
    """``(out, lse)`` from the decode kernels when an ``attention()`` call can run there, else None.

    :func:`route_options` decides; the attention operator's plans call it once per call
    signature and then :func:`decode_attention` with its answer.
    """
    opts = route_options(q, k, v, causal=causal, window=window, align=align, bias=bias, dropout_p=dropout_p,
                         scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, layout=layout, out=out,
                         lse=lse, return_mask=return_mask, library=library)
    if opts is None:
        return None
    try:
        return decode_attention(q, k, v, **opts)
    except (ArgumentError, UnsupportedError, KernelNotFound):
        return None


def route_options(q: Any, k: Any, v: Any, *, causal: Any, window: Any, align: Any, bias: Any,
                  dropout_p: Any, scale: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, layout: Any, out: Any,
                  lse: Any, return_mask: Any, library: Any) -> dict[str, Any] | None:
    """The :func:`decode_attention` options of an ``attention()`` call that can run there, else None.

    Taken: dense (no cu_seqlens) forward calls with 1..16 query rows, no bias, no dropout, no
    preallocated ``out``/``lse``, equal q/k/v head dims that are a compiled bucket, K/V readable
    in place, and a mask the decode kernels express: none, or causal/window aligned bottom-right
    (or top-left with equal lengths, where the alignments coincide). The results equal the
    prefill kernel's (same ``out`` layout, ``lse`` fp32 ``(B, Hq, Sq)``), so the backward is
    unchanged. Anything else, any refusal, or images without the decode kernels: None, and
    ``attention()`` runs as before (its own validation reports malformed calls).
    """
    if (bias is not None or dropout_p or cu_seqlens_q is not None or cu_seqlens_k is not None or out is not None
            or lse is not None or return_mask or layout not in _LAYOUTS):
        return None
    try:
        qi = interop.describe(q)
        if len(qi.shape) != 4:
            return None
        seqlen_q = qi.shape[2] if layout == "bhsd" else qi.shape[1]
        if not 1 <= seqlen_q <= MAX_SEQLEN_Q or qi.shape[3] not in HEAD_DIM_BUCKETS:
            return None
        ki = interop.describe(k)
        if len(ki.shape) != 4:
            return None
        seqlen_k = ki.shape[2] if layout == "bhsd" else ki.shape[1]
        if window is not None and not (isinstance(window, (tuple, list)) and len(window) == 2):
            return None
        wl, wr = (-1, -1) if window is None else (window[0], window[1])
        if not all(isinstance(w, int) for w in (wl, wr)):
            return None
        masked = causal is True or wl >= 0 or wr >= 0
        if masked and align != "bottom_right" and seqlen_q != seqlen_k:
            return None
        if interop.describe(v).shape[-1] != qi.shape[3]:
            return None
        spec = {"dtype": qi.dtype, "HEAD_DIM": qi.shape[3]}
        try:
            ks = _kernels_of(library)
            if not all(ks.has(name, params) for name, params in ((DECODE, {**spec, "PAGED": 0}), (COMBINE, spec))):
                return None
        except AotritonError:
            return None  # no images (yet): attention() validates the call first, then reports that
        return {"causal": causal is True, "window": window, "scale": scale, "layout": layout,
                "cache_layout": layout, "library": library}
    except (ArgumentError, UnsupportedError, KernelNotFound):
        return None
