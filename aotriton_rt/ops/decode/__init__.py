"""Decode attention over a KV cache: split-KV kernels, contiguous and paged caches.

FlashAttention-2's ``flash_attn_with_kvcache``: query rows per sequence (one generated token, a
speculative draft, or a chunk of a prompt: any number up to :data:`MAX_SEQLEN_Q`) attend to that
sequence's cached keys and values, optionally after appending new ones to the cache in the same
call::

    out, lse = aotriton_rt.ops.decode.decode_attention(
        q, k_cache, v_cache, cache_seqlens=lens, k_new=k, v_new=v, causal=True)

**Shapes.** ``q``: ``(B, Sq, Hq, D)`` (``layout="bshd"``, the default) or ``(B, Hq, Sq, D)``
(``"bhsd"``). Contiguous caches: ``(B, S_cache, Hkv, D)`` (``cache_layout="bshd"``) or
``(B, Hkv, S_cache, D)`` (``"bhsd"``), any strides with a contiguous head dim. Paged caches:
``(num_pages, page_size, Hkv, D)`` with ``block_table`` int32 ``(B, max_blocks)``: row ``n`` of
sequence ``b`` is row ``n % page_size`` of page ``block_table[b, n // page_size]``; the page size
must be a multiple of 16. ``k_new``/``v_new``: ``(B, Sn, Hkv, D)`` (or ``(B, Hkv, Sn, D)`` with
``layout="bhsd"``).

**Head dims.** Any ``D`` in 1..256, read in place. A ``D`` that is a compiled bucket (16, 32, 48,
64, 80, 96, 128, 160, 192, 224, 256) with 16-byte aligned caches runs its bucket's variants as
is (16-byte loads); any other ``D``, or unaligned caches, runs the smallest bucket >= ``D`` the
images hold with every row access masked to ``D`` columns (``PADDED_D=1``: nothing past column
``D`` is read or written, no copy).

**Lengths.** ``cache_seqlens`` (an int, or an int32 ``(B,)`` device array) counts the rows
already in the cache; new rows are written at ``cache_seqlens[b] + i`` and the queries see
``cache_seqlens[b] + Sn`` keys. The caller advances ``cache_seqlens`` afterwards (as with
FlashAttention). ``None``: every sequence fills its whole cache (``S_cache`` or ``max_blocks *
page_size`` rows), no append. Lengths known on the host (an int, a CPU tensor or NumPy array,
copied to the device per call) are checked before launch, as FlashAttention-2 does: a length
plus the appended rows past ``block_table.shape[1] * page_size`` (or the cache's length) is an
:class:`ArgumentError` naming ``block_table`` (or ``k_cache``). Device arrays are the caller's
contract: whatever they hold, the kernels stay inside their arrays (lengths and page indices
clamped, appends out of range dropped), write NaN for a faulting sequence and OR the fault into
a per-device flag (:func:`read_faults`). ``check=True`` or ``AOTRITON_RT_DEBUG=1`` reads lengths
and table back and checks every length and referenced page before launch, and reads the flag
after (device synchronisations; :class:`~aotriton_rt.FaultError` when set).

**Masks.** Bottom-right aligned (the queries are the sequence's last ``Sq`` rows): ``causal``
hides keys after each query, ``window=(left, right)`` is a sliding window (-1 unbounded).

**Logit softcap.** ``softcap=c > 0`` (Gemma 2; FlashAttention-2's ``softcap``): scores ``s =
q·k * scale`` become ``c * tanh(s / c)`` before the masks and the softmax, as
:func:`aotriton_rt.attention` computes them. A run-time argument of every decode variant;
images built before it existed refuse a capped call with :class:`KernelNotFound` (a call
without a cap runs on them as before).

**ALiBi.** ``alibi_slopes`` (fp32 ``(Hq,)`` or ``(B, Hq)``, FlashAttention-2's): every score
gets ``-slope * |i + len_k - Sq - j|``, query row ``i`` sitting at key position ``i + len_k - Sq``
(the queries are the sequence's last rows), ``slope`` that of the row's query head. A run-time
argument of every decode variant; not with a softcap (refused as :func:`aotriton_rt.attention`
refuses it); images built before it refuse such a call with :class:`KernelNotFound`.

**Sinks.** ``sinks`` (one logit per query head): joined by the decode kernels where they take
them (one split: the decode kernel's epilogue; several: the combine's, after the merge), else
by the ``attn_sinks`` pass over ``(out, lse)`` (images built before the arguments).

**Splits.** One program per (GQA group tile, split, batch x KV head); the keys each tile's
query rows may see (a causal tile of a long run: only those up to its rows) are cut into
``num_splits`` runs, whose partials ``attn_decode_combine`` merges (a second launch). Long
query runs fill the GPU with their tiles and take one split. Default: enough programs for
``waves`` per SM, each split at least ``min_blocks`` key blocks, from the catalog's
``tuning["attn_decode"]`` rules (``{"arch": "sm90", "splits": {"waves": 2, "min_blocks": 4,
"max_splits": 64}}``; a rule may also pick a ``config`` and apply only from a work size on,
``min_batch_heads``, or to one cache kind, ``paged``), else
:data:`DEFAULT_SPLIT_RULES`; lowered so that the fp32 partials stay under
:data:`MAX_SCRATCH_BYTES` (an explicit ``num_splits`` past it is refused).
"""

from __future__ import annotations

from typing import Any

from ... import interop
from ...errors import AotritonError, ArgumentError, KernelNotFound, UnsupportedError
from ..attention.signature import _typed
from .faults import FAULT_LENGTH, FAULT_PAGE, clear_faults, describe_faults, raise_faults, read_faults
from .launch import MAX_SCRATCH_BYTES, _kernels_of, _Launch, decode_args
from .splits import DEFAULT_SPLIT_RULES, SplitRule, num_splits_for, split_rule
from .validate import (
    _LAYOUTS,
    APPEND,
    COMBINE,
    DECODE,
    HEAD_DIM_BUCKETS,
    MAX_GROUP_ROWS,
    MAX_SEQLEN_Q,
    ROUTED_SEQLEN_Q,
    DecodePlan,
    _check_contents,
    _debug,
    _describe,
    _int,
    _plan,
)
from .variants import shared, with_paged

__all__ = ["DEFAULT_SPLIT_RULES", "FAULT_LENGTH", "FAULT_PAGE", "HEAD_DIM_BUCKETS", "MAX_GROUP_ROWS",
           "MAX_SCRATCH_BYTES", "MAX_SEQLEN_Q", "ROUTED_SEQLEN_Q", "DecodePlan", "SplitRule", "cached_launch",
           "clear_faults", "decode_attention", "decode_kernels", "describe_faults", "num_splits_for", "read_faults",
           "route_from_attention", "route_options", "split_rule"]


def decode_attention(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any = None, block_table: Any = None,
                     k_new: Any = None, v_new: Any = None, causal: bool = False,
                     window: tuple[int, int] | None = None, scale: float | None = None,
                     softcap: float = 0.0, num_splits: int | None = None, max_seqlen_k: int | None = None,
                     layout: str = "bshd", cache_layout: str = "bshd", out: Any = None, check: bool | None = None,
                     cache_leftpad: Any = None, sinks: Any = None, k_scale: Any = None, v_scale: Any = None,
                     alibi_slopes: Any = None, library: Any = None) -> tuple[Any, Any]:
    """Attention of query rows per sequence against a (contiguous or paged) KV cache.

    Arguments:
        q: ``(B, Sq, Hq, D)`` (``layout="bshd"``) or ``(B, Hq, Sq, D)``; fp16, bf16 or fp32;
            ``Sq`` from 1 to :data:`MAX_SEQLEN_Q`, ``D`` from 1 to 256.
        k_cache, v_cache: ``(B, S_cache, Hkv, D)`` (``cache_layout`` as for q), or paged
            ``(num_pages, page_size, Hkv, D)`` with ``block_table``. Read (and appended to) in place.
            q's dtype, or fp8 e4m3 with fp16/bf16 queries (``torch.float8_e4m3fn`` on sm90 and
            gfx950, ``torch.float8_e4m3fnuz`` on gfx942) with ``k_scale`` and ``v_scale``.
        cache_seqlens: rows already cached per sequence: an int, a host integer array (CPU tensor,
            NumPy; checked before launch) or an int32 ``(B,)`` device array; None: the whole cache.
        block_table: int32 ``(B, max_blocks)`` page indices (a paged cache).
        k_new, v_new: rows to write at ``cache_seqlens[b] + i`` before attending, shaped like q
            with Hkv heads.
        causal, window: bottom-right aligned causal mask and sliding window ``(left, right)``.
        scale: default ``1/sqrt(D)``.
        softcap: logit softcap (Gemma 2): scores ``s = q·k * scale`` become ``softcap *
            tanh(s / softcap)`` before the masks; 0 (or None) for none.
        num_splits: override the split count (default: the catalog's rule, see the module docs);
            refused when its partials would pass :data:`MAX_SCRATCH_BYTES`.
        max_seqlen_k: an upper bound of the keys any sequence sees, for the split count only
            (default: ``cache_seqlens + Sn`` when an int, else the capacity).
        out: preallocated output shaped like q.
        cache_leftpad: each sequence's first cache row (FlashAttention-2's left padding): an int32
            ``(B,)`` device array or a host integer array (checked before launch); sequence b
            attends to rows ``[cache_leftpad[b], cache_seqlens[b] + Sn)``, the rows before never
            read; masks stay aligned to the end. Needs ``0 <= cache_leftpad[b] <= cache_seqlens[b]``.
        check: read lengths, starts and block table back and check them before launch, and the fault
            flag after (default: ``AOTRITON_RT_DEBUG``).
        sinks: attention sinks, one logit per query head (``(Hq,)``, fp16, bf16 or fp32, as for
            :func:`aotriton_rt.attention`): out and lse are the sinks'.
        alibi_slopes: FlashAttention-2's ALiBi slopes, fp32 ``(Hq,)`` or ``(B, Hq)``: scores get
            ``-slope * |i + len_k - Sq - j|`` (query row ``i``, key ``j``). Not with ``softcap``.
        k_scale, v_scale: an fp8 cache's scales (required with one, refused without): a real
            key is the stored value times its scale. A float > 0 (one per cache), or a float32
            array on q's device of shape ``()`` or ``(1,)`` (one), ``(Hkv,)`` (per KV head) or
            ``(B, Hkv)`` (per sequence and KV head). ``k_new``/``v_new`` (q's dtype) are stored
            as ``value / scale`` rounded to nearest, saturated to the format's largest finite
            value (448; 240 for e4m3fnuz), NaN kept.
        library: a :class:`aotriton_rt.Library`; default :func:`aotriton_rt.default_library`.

    Returns:
        ``(out, lse)``: out shaped like q; lse fp32 ``(B, Hq, Sq)`` (natural log; -inf for rows
        that see no key, whose output is 0).

    Raises:
        ArgumentError: malformed shapes, dtypes, strides, lengths the cache cannot hold, a page
            size that is not a multiple of 16, more than :data:`MAX_SEQLEN_Q` query rows (or
            :data:`MAX_GROUP_ROWS` per KV head), a softcap that is negative, not finite, or
            with a zero scale, an fp8 cache without scales or scales without one, scales of the
            wrong shape, dtype or device, ALiBi slopes or sinks of the wrong shape, dtype or
            device, ALiBi slopes with a zero scale; nothing has run.
        UnsupportedError: a head dim past 256, sizes past the grid, an fp8 cache with fp32
            queries or of another fp8 format, ALiBi slopes with a softcap.
        FaultError: with ``check``, the fault flag was set (see :func:`read_faults`).
        KernelNotFound: the images lack the decode kernels for this dtype / head dim / cache
            type (fp8 variants are built for the targets named above), or (with ``softcap`` or
            ``alibi_slopes``) were built before the decode kernel took the argument.

    Example::

        out, lse = decode_attention(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                    k_new=k, v_new=v, causal=True)
    """
    return _decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, window, scale,
                   softcap, num_splits, max_seqlen_k, layout, cache_layout, out, check, cache_leftpad, library,
                   k_scale, v_scale, alibi_slopes, sinks)


def _decode(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any, k_new: Any, v_new: Any,
            causal: bool, window: Any, scale: Any, softcap: Any, num_splits: Any, max_seqlen_k: Any, layout: str,
            cache_layout: str, out: Any, check: Any, cache_leftpad: Any, library: Any, k_scale: Any = None,
            v_scale: Any = None, alibi_slopes: Any = None, sinks: Any = None) -> tuple[Any, Any]:
    """:func:`decode_attention`'s body."""
    debug = _debug(check)
    key = None if debug else _torch_key(q, k_cache, v_cache, cache_seqlens, cache_leftpad, block_table, k_new, v_new,
                                        out, causal, window, scale, num_splits, max_seqlen_k, layout, cache_layout,
                                        softcap, scales=(k_scale, v_scale, alibi_slopes, sinks))
    ks = None
    if key is not None:
        try:
            ks = _kernels_of(library)
        except AotritonError:  # no images: the validation below speaks first
            ks = None
        launch = ks.launch_of(key) if ks is not None else None
        if launch is not None:
            if launch.fast is not None:
                return launch.run_fast(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out,
                                       cache_leftpad, k_scale, v_scale, alibi_slopes, sinks)
            return launch.run(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out,
                              cache_leftpad=cache_leftpad, k_scale=k_scale, v_scale=v_scale,
                              alibi_slopes=alibi_slopes, sinks=sinks)
    try:
        p, infos = _plan(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k_new,
                         v_new=v_new, causal=causal, window=window, scale=scale, max_seqlen_k=max_seqlen_k,
                         layout=layout, cache_layout=cache_layout, cache_leftpad=cache_leftpad, softcap=softcap,
                         k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes, sinks=sinks)
    except Exception:  # an error path only: say so when the arrays are JAX tracers
        interop.refuse_jax_tracers("decode_attention", "it has no JAX version: call it outside jax.jit, on "
                                   "concrete arrays", q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new)
        raise
    if num_splits is not None:
        num_splits = _int(num_splits, "num_splits", 1, 1024)
    if out is not None:
        out_i = _describe(out, "out")
        if tuple(out_i.shape) != tuple(infos["q"].shape) or out_i.dtype != p.dtype:
            raise ArgumentError(f"out must have shape {tuple(infos['q'].shape)} and dtype {p.dtype}, got "
                                f"{tuple(out_i.shape)} {out_i.dtype}")
        infos["out"] = out_i
    launch = _Launch(p, infos, ks if ks is not None else _kernels_of(library), layout, num_splits, cache_seqlens,
                     cache_leftpad)
    xp = launch.xp
    if debug:
        seqlens = launch.seqlens(xp.convert(q, infos["q"]), cache_seqlens, infos)
        table = xp.convert(block_table, infos["block_table"]) if p.paged else None
        starts = launch.starts(xp.convert(q, infos["q"]), cache_leftpad, cache_seqlens, infos) \
            if cache_leftpad is not None else None
        _check_contents(xp, p, seqlens, table, starts)
    if key is not None and not launch.q_copy:
        launch.ks.keep_launch(key, launch)
    result = launch.run(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out, infos, cache_leftpad,
                        k_scale, v_scale, alibi_slopes, sinks)
    if debug:
        raise_faults(launch.ks, p.device)
    return result




def cached_launch(q: Any, k_cache: Any, v_cache: Any, *, causal: bool = False, window: Any = None,
                  scale: Any = None, softcap: Any = 0.0, layout: str = "bshd", cache_layout: str = "bshd",
                  alibi_slopes: Any = None, sinks: Any = None, library: Any = None) -> Any:
    """The launch plan a :func:`decode_attention` call with these arguments (no lengths, table,
    append or ``out``) made and cached, when it runs repeated calls with integer addresses; else None.

    For the attention operator's plans, whose own key already pins everything this plan depends
    on: they keep it and call ``run_fast(q, k, v, None, None, None, None, None, None, None,
    None, alibi_slopes, sinks)`` directly.
    """
    key = _torch_key(q, k_cache, v_cache, None, None, None, None, None, None, causal, window, scale, None, None,
                     layout, cache_layout, softcap, scales=(None, None, alibi_slopes, sinks))
    launch = _kernels_of(library).launch_of(key)
    return launch if launch is not None and launch.fast is not None else None


def _torch_key(q: Any, k: Any, v: Any, lens: Any, starts: Any, table: Any, kn: Any, vn: Any, out: Any,
               *options: Any, scales: tuple = (None, None)) -> tuple | None:
    """A key for the library's launch cache (``_Kernels.launches``) when every array is a torch
    tensor (else None: full checks). ``scales``: an fp8 cache's (k_scale, v_scale), floats
    (their values, typed: a plan bakes them in) or tensors, then the ALiBi slopes and the sinks."""
    if type(q).__name__ != "Tensor" or type(q).__module__ != "torch":
        return None
    # Options typed: causal=1 or num_splits=True must not find the plan of True or 1 and skip
    # the validation that refuses them.
    parts: list = [_typed(o) for o in options]
    for t in (q, k, v, lens, starts, table, kn, vn, out, *scales):
        if type(t) is float:
            parts.append(("float", t))
        elif t is None or type(t) is int:
            parts.append(t)
        elif type(t) is type(q):
            # get_device() and is_cuda, not .device: a torch.device object per tensor per call
            # costs more than the rest of the entry (-1 for CPU and meta alike: neither ever
            # has a plan, both are refused before one is made).
            parts.append((t.shape, t.stride(), t.dtype, t.get_device(), t.is_cuda, t.data_ptr() % 16 == 0))
        else:
            return None
    return tuple(parts)



def decode_kernels(q: Any, k_cache: Any, v_cache: Any, *, library: Any = None, **options: Any) -> dict[str, Any]:
    """The kernel handles :func:`decode_attention` with these arguments launches (nothing runs);
    for benchmarks that time the exact binaries or report their configs."""
    p, _ = _plan(q, k_cache, v_cache, cache_seqlens=options.pop("cache_seqlens", None),
                 cache_leftpad=options.pop("cache_leftpad", None),
                 block_table=options.pop("block_table", None), k_new=options.pop("k_new", None),
                 v_new=options.pop("v_new", None), causal=options.pop("causal", False),
                 window=options.pop("window", None), scale=options.pop("scale", None),
                 max_seqlen_k=options.pop("max_seqlen_k", None), layout=options.pop("layout", "bshd"),
                 cache_layout=options.pop("cache_layout", "bshd"), softcap=options.pop("softcap", None),
                 k_scale=options.pop("k_scale", None), v_scale=options.pop("v_scale", None),
                 alibi_slopes=options.pop("alibi_slopes", None), sinks=options.pop("sinks", None))
    if options:
        raise ArgumentError(f"unknown option(s) {', '.join(sorted(options))}")
    ks = _kernels_of(library)
    spec, why = ks.choose(p, p.aligned)
    handles = {DECODE: ks.handle(DECODE, with_paged(spec, p.paged), 0, p.device, why),
               COMBINE: ks.handle(COMBINE, shared(spec), 0, p.device, why)}
    if p.seqlen_new:
        handles[APPEND] = ks.handle(APPEND, with_paged(spec, p.paged), 0, p.device, why)
    return handles


# ---------------------------------------------------------------------------------------------
# Routing from aotriton_rt.attention (issue #13): short query runs go to the decode kernels.
# ---------------------------------------------------------------------------------------------

def route_from_attention(q: Any, k: Any, v: Any, *, causal: Any, window: Any, align: Any, bias: Any,
                         dropout_p: Any, scale: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, layout: Any, out: Any,
                         lse: Any, return_mask: Any, library: Any, softcap: Any = None, alibi_slopes: Any = None,
                         sinks: Any = None) -> tuple[Any, Any] | None:
    """``(out, lse)`` from the decode kernels when an ``attention()`` call can run there, else None.

    :func:`route_options` decides; the attention operator's plans call it once per call
    signature and then :func:`decode_attention` with its answer.
    """
    opts = route_options(q, k, v, causal=causal, window=window, align=align, bias=bias, dropout_p=dropout_p,
                         scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, layout=layout, out=out,
                         lse=lse, return_mask=return_mask, library=library, softcap=softcap,
                         alibi_slopes=alibi_slopes)
    if opts is None:
        return None
    try:
        return decode_attention(q, k, v, alibi_slopes=alibi_slopes, sinks=sinks, **opts)
    except (ArgumentError, UnsupportedError, KernelNotFound):
        return None


def route_options(q: Any, k: Any, v: Any, *, causal: Any, window: Any, align: Any, bias: Any,
                  dropout_p: Any, scale: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, layout: Any, out: Any,
                  lse: Any, return_mask: Any, library: Any, softcap: Any = None,
                  alibi_slopes: Any = None) -> dict[str, Any] | None:
    """The :func:`decode_attention` options of an ``attention()`` call that can run there, else None.

    Taken: dense (no cu_seqlens) forward calls with 1..:data:`ROUTED_SEQLEN_Q` query rows (longer
    runs are prefill, faster on the attention kernels; :func:`decode_attention` itself takes them
    when asked), no bias, no dropout, no preallocated ``out``/``lse``, equal q/k/v head dims whose
    decode variants (as is or masked, :mod:`.variants`) the images hold, K/V readable in place,
    and a mask the decode kernels express: none, or causal/window aligned bottom-right
    (or top-left with equal lengths, where the alignments coincide). A logit ``softcap`` goes
    along when the images' decode kernel takes it (else None: images built before it); so do
    ALiBi slopes (passed per call, not among the options: an array). The
    results equal the prefill kernel's (same ``out`` layout, ``lse`` fp32 ``(B, Hq, Sq)``), so
    the backward is unchanged. Anything else, any refusal, or images without the decode kernels:
    None, and ``attention()`` runs as before (its own validation reports malformed calls).
    """
    if (bias is not None or dropout_p or cu_seqlens_q is not None or cu_seqlens_k is not None or out is not None
            or lse is not None or return_mask or layout not in _LAYOUTS):
        return None
    try:
        qi = interop.describe(q)
        if len(qi.shape) != 4:
            return None
        seqlen_q = qi.shape[2] if layout == "bhsd" else qi.shape[1]
        if not 1 <= seqlen_q <= ROUTED_SEQLEN_Q:
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
        # The decode call's own validation: a call it refuses (shapes, strides) stays with attention().
        p, _ = _plan(q, k, v, cache_seqlens=None, block_table=None, k_new=None, v_new=None, causal=causal is True,
                     window=window, scale=scale, max_seqlen_k=None, layout=layout, cache_layout=layout,
                     softcap=softcap, alibi_slopes=alibi_slopes)
        try:
            ks = _kernels_of(library)
            spec, _ = ks.choose(p, p.aligned)
            if not (ks.has(DECODE, with_paged(spec, False), decode_args(p)) and ks.has(COMBINE, shared(spec))):
                return None
        except AotritonError:
            return None  # no images (yet): attention() validates the call first, then reports that
        return {"causal": causal is True, "window": window, "scale": scale, "softcap": p.softcap, "layout": layout,
                "cache_layout": layout, "library": library}
    except (ArgumentError, UnsupportedError, KernelNotFound):
        return None
