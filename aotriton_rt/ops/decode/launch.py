"""Decode launches: kernel handles per library, allocation, and the per-signature launch plan."""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from typing import Any

from ... import interop
from ...errors import ArgumentError, KernelNotFound
from ..attention.family import ALIBI_ARG, SINKS_ARG, SOFTCAP_ARG, USE_SINKS_ARG, named
from ..attention.framework import arrays_for
from . import validate
from .faults import fault_flag, fault_flags, shared_ones, shared_zeros
from .splits import _SM_COUNTS, num_splits_for, split_rule
from .validate import (
    APPEND,
    COMBINE,
    DECODE,
    LENGTHS,
    PACK,
    POISON,
    DecodePlan,
    _aligned,
    _bshd,
    _check_in_place,
    _check_length,
    _describe,
    _effective,
)
from .variants import choose, held_cache_axis, shared, with_paged


def _sm_count(xp: Any, device: int) -> int | None:
    """Multiprocessors (CUs) of ``device``, or None when the framework cannot tell."""
    try:
        if xp.framework == "torch":
            return int(xp.torch.cuda.get_device_properties(max(device, 0)).multi_processor_count)
        return int(xp.cupy.cuda.Device(max(device, 0)).attributes["MultiProcessorCount"])
    except Exception:  # noqa: BLE001 - a framework without the property: the arch's table
        return None


#: Launch plans a library keeps (``_Kernels.launches``) before it drops them all.
MAX_LAUNCHES = 256


class _Kernels:
    """Decode handles per library. Which variants exist and the device's arch come from the
    attention operator's per-library caches (one kernel's shards read per question), the split
    rules from the library's tuning table (other rules: a ``Library.with_tuning`` view, whose
    plans are its own). ``faults`` holds the library's fault flags by (framework, device)
    (ops/decode/faults.py)."""

    def __init__(self, lib: Any) -> None:
        from ..attention.dispatch import kernels_of

        self.lib = lib
        self.lock = threading.Lock()
        self.handles: dict[tuple, Any] = {}
        self.sms: dict[int, int] = {}
        self.faults = fault_flags(lib)
        #: The zero starts of calls without ``cache_leftpad``, by (framework, device, length)
        #: (:func:`zero_starts`); live with the library, as the fault flags.
        self.zero_starts: dict[tuple, Any] = {}
        #: The fp32 1.0 that scales given as floats are read from, by (framework, device)
        #: (:meth:`_Launch.scale_ones`); live with the library, as the zero starts.
        self.ones: dict[tuple, Any] = {}
        self.shared = kernels_of(lib)
        #: Launch plans of recent torch calls, by everything that decides them (shapes, strides,
        #: dtypes, devices, alignment, options): a repeated decode step skips validation and
        #: planning. Bounded (:data:`MAX_LAUNCHES`, cleared when full); lives with the library.
        self.launches: dict[tuple, Any] = {}

    def launch_of(self, key: tuple | None) -> Any:
        """The kept launch plan of a call key (:func:`.._torch_key`), or None: none kept, no key,
        or a key that holds an unhashable option (a list inside a window), which is never kept."""
        if key is None:
            return None
        try:
            return self.launches.get(key)
        except TypeError:
            return None

    def keep_launch(self, key: tuple, launch: Any) -> None:
        """Keep a launch plan under its call key; all are dropped when :data:`MAX_LAUNCHES` are
        kept, and a key with an unhashable option is not kept."""
        try:
            hash(key)
        except TypeError:
            return
        if len(self.launches) >= MAX_LAUNCHES:
            self.launches.clear()
        self.launches[key] = launch

    @property
    def rules(self) -> Any:
        """The ``tuning["attn_decode"]`` rules plans are made under (the library's)."""
        return self.shared.tuning.get(DECODE)

    def has(self, name: str, params: Mapping[str, Any], args: tuple[str, ...] = ()) -> bool:
        """Whether the images hold ``name`` with ``params``, every such variant taking the run-time
        arguments ``args`` (cached)."""
        return self.shared.available(name, params, args)

    def device_arch(self, device: int) -> str:
        return self.shared.device_arch(device)

    def choose(self, p: DecodePlan, aligned: bool) -> tuple[dict[str, Any], str]:
        """(spec without ``PAGED``, why) of the variants that serve ``p`` (ops/decode/variants.py):
        for a softcapped call, variants whose ``attn_decode`` takes the cap (:func:`decode_args`)."""
        args = decode_args(p)
        keyed = held_cache_axis(self.has)
        if not args:
            return choose(p.dtype, p.head_dim, aligned, p.paged, self.has, p.kv_dtype, keyed)
        return choose(p.dtype, p.head_dim, aligned, p.paged,
                      lambda name, params: self.has(name, params, args if name == DECODE else ()), p.kv_dtype, keyed)

    def handle(self, name: str, spec: Mapping[str, Any], config: int, device: int, why: str = "") -> Any:
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
            because = f" ({why})" if why else ""
            raise KernelNotFound(f"decode attention needs {name} with {shown}{because}, which these images lack: "
                                 f"{e}") from None
        with self.lock:
            self.handles[key] = hit
        return hit


#: The decode kernel's ALiBi switch (with :data:`ALIBI_ARG` and its batch stride ``stride_az``).
USE_ALIBI_ARG = "use_alibi"


def decode_args(p: DecodePlan) -> tuple[str, ...]:
    """The run-time arguments ``attn_decode`` must take to serve ``p``: ``softcap`` for a
    softcapped call, the ALiBi slopes for an ALiBi one (images built before an argument existed
    have variants without it). Sinks are not asked for: variants without them join the sinks by
    the ``attn_sinks`` pass instead."""
    return ((SOFTCAP_ARG,) if p.softcap else ()) + ((ALIBI_ARG, USE_ALIBI_ARG) if p.alibi else ())


def takes_sinks(handle: Any) -> bool:
    """Whether a decode or combine handle joins sinks itself (``Sinks``/``use_sinks`` arguments)."""
    return handle is not None and SINKS_ARG in handle.arg_names


def _kernels_of(library: Any) -> _Kernels:
    """The decode state of ``library`` (default: the default library), made on first use."""
    from ...library import default_library, operator_state

    return operator_state(library if library is not None else default_library(), "decode", _Kernels)


#: The most fp32 scratch a call's split partials (PartO, PartL) may take: the automatic split
#: count is lowered to stay under it, an explicit ``num_splits`` past it is refused. Calls with
#: many query rows fill the GPU with their row tiles and take one split (no scratch).
MAX_SCRATCH_BYTES = 256 << 20


def scratch_bytes(p: DecodePlan, bucket: int, num_splits: int) -> int:
    """Bytes of the split partials: ``bucket``-wide fp32 rows and a logsumexp per (sequence, KV
    head, split, query row); 0 for one split (no combine)."""
    if num_splits <= 1:
        return 0
    return p.batch * p.heads_k * num_splits * p.group_rows * (bucket + 1) * 4


def fit_splits(p: DecodePlan, bucket: int, num_splits: int, explicit: bool) -> int:
    """``num_splits`` lowered until the partials fit :data:`MAX_SCRATCH_BYTES` (``explicit``: the
    caller's count, refused with ArgumentError instead)."""
    if scratch_bytes(p, bucket, num_splits) <= MAX_SCRATCH_BYTES:
        return num_splits
    if explicit:
        mib = scratch_bytes(p, bucket, num_splits) / (1 << 20)
        raise ArgumentError(f"num_splits={num_splits} needs {mib:.0f} MiB of fp32 scratch for the split partials, "
                            f"past MAX_SCRATCH_BYTES ({MAX_SCRATCH_BYTES >> 20} MiB); pass fewer splits or leave "
                            f"num_splits=None")
    per_split = scratch_bytes(p, bucket, 2) // 2
    return max(1, MAX_SCRATCH_BYTES // per_split) if per_split else num_splits


#: Contiguous split calls that read at least this many K/V bytes launch without PDL (see pdl_choice).
PLAIN_MIN_KV_BYTES = 48 << 20
_ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8e4nv": 1, "fp8e4b8": 1}


def kv_bytes(p: DecodePlan) -> int:
    """K and V bytes a call reads at most: every (sequence, KV head)'s visible keys (the length
    estimate the split count uses, cut to the sliding window) times the head dim, twice."""
    keys = p.seqlen_k_hint
    if p.window_left >= 0:
        keys = min(keys, p.window_left + p.seqlen_q)
    return 2 * p.batch * p.heads_k * keys * p.head_dim * _ELEMENT_BYTES.get(p.kv_dtype, 2)


def pdl_choice(p: DecodePlan, num_splits: int) -> tuple[bool, str]:
    """(launch the chain with PDL where compiled in, why): the decode chain's per-call decision.

    PDL lets append → decode → combine start before their predecessor ends (docs/attention.md).
    On the H200 (docs/performance.md, PDL on and off) it takes 8-15% off the latency-bound calls
    (one sequence, up to 8k keys: 8-32 MiB of K/V) and 0-12% off every paged call, but makes
    *contiguous* calls that are split and read 64 MiB or more 3-16% slower (B=8 with 2k-32k keys,
    B=1 with 32k; 1.16x at B=8 from 8k keys, reproducibly), which the paged cache of the same
    shape is not; unsplit calls (B=64: the batch fills the GPU) were not slower. So: a contiguous,
    split call of at least :data:`PLAIN_MIN_KV_BYTES` launches plainly, everything else with PDL.
    The cause of the loss is not known; the threshold sits between the fast 32 MiB and the slow
    64 MiB rows."""
    if p.paged:
        return True, "PDL: a paged cache (PDL measured 0-12% faster at every paged shape)"
    if num_splits == 1:
        return True, "PDL: one split, no combine (unsplit contiguous calls were not slower with PDL)"
    nbytes = kv_bytes(p)
    mib = nbytes / (1 << 20)
    if nbytes >= PLAIN_MIN_KV_BYTES:
        return False, (f"no PDL: a contiguous cache, {num_splits} splits, {mib:.0f} MiB of K/V >= "
                       f"{PLAIN_MIN_KV_BYTES >> 20} MiB (PDL measured 3-16% slower there)")
    return True, f"PDL: {mib:.1f} MiB of K/V < {PLAIN_MIN_KV_BYTES >> 20} MiB (latency-bound: PDL 8-15% faster)"


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



#: The int32 lengths arrays of fast calls without a lengths tensor, by (device, batch, length):
#: never freed, because captured CUDA graphs hold their addresses (``_Launch._constant_lens``);
#: at most this many (4 bytes a sequence each), then made per call.
_CONSTANT_LENS: dict[tuple, Any] = {}
_MAX_CONSTANT_LENS = 4096

#: The array arguments of the decode kernels, in the order run_fast gathers their addresses.
_POINTERS = ("Q", "K", "V", "Out", "LSE", "BlockTable", "CacheSeqlens", "KNew", "VNew", "PartO", "PartL",
             "Faults", "CacheStart", "KScale", "VScale", ALIBI_ARG, SINKS_ARG)
#: Arguments of decode kernels in images built before the fused split merge was removed: always
#: null (those kernels then leave the merge to attn_decode_combine, as the current ones do).
_RETIRED = {"Counters": None}


def zero_starts(ks: _Kernels, xp: Any, like: Any, device: int, batch: int) -> tuple[Any, bool]:
    """The ``CacheStart`` of calls without ``cache_leftpad``: an int32 zeros array of at least
    ``batch`` entries (a power of two from 64, so a library keeps at most 11 per device), owned by
    the library like its fault flags (:func:`shared_zeros`): never freed while it lives, since a
    captured CUDA graph keeps reading its address; read only, so shared by calls on every stream."""
    size = max(64, 1 << max(batch - 1, 0).bit_length())
    return shared_zeros(ks.zero_starts, (xp.framework, device, size), xp, like, size)


class _Launch:
    """Everything one call shape launches: handles, split count, scalar arguments."""

    def __init__(self, p: DecodePlan, infos: dict, ks: _Kernels, layout: str, num_splits: int | None,
                 cache_seqlens: Any, cache_leftpad: Any = None) -> None:
        self.p, self.layout, self.ks = p, layout, ks
        self.xp = xp = arrays_for(infos["q"].framework)
        q_shape = tuple(infos["q"].shape)
        oi = infos.get("out")
        o_strides = _bshd(oi, layout)[1] if oi is not None else _bshd_contiguous(q_shape, layout)
        o_strides = _effective((p.batch, p.heads_q, p.seqlen_q), o_strides)
        if oi is not None:
            _check_in_place(oi, "out", o_strides)
        # The variants: as is where the head dim is a bucket and the arrays are aligned (an
        # unaligned q is then copied), else masked on the smallest bucket the images hold.
        spec, why = ks.choose(p, p.aligned and (oi is None or _aligned(oi, o_strides)))
        self.spec, self.why = spec, why
        self.bucket = spec["HEAD_DIM"]
        self.q_copy = p.q_copy or (not spec.get("PADDED_D") and not _aligned(infos["q"], p.q_strides))
        arch = ks.device_arch(p.device)
        rule, config = split_rule(ks.rules, arch, batch_heads=p.batch * p.heads_k, paged=p.paged,
                                  rows=p.group_rows, fp8=p.fp8)
        paged = with_paged(spec, p.paged)
        self.decode = ks.handle(DECODE, paged, config, p.device, why)
        self.append = ks.handle(APPEND, paged, 0, p.device, why) if p.seqlen_new else None
        row_blocks = -(-p.group_rows // _block_m(self.decode, p.device))
        explicit = num_splits is not None
        if num_splits is None:
            sm = ks.sms.get(p.device)
            if sm is None:
                sm = ks.sms[p.device] = _sm_count(xp, p.device) or _SM_COUNTS.get(arch, 100)
            num_splits = num_splits_for(p.batch, p.heads_k, row_blocks, p.seqlen_k_hint,
                                        _block_n(self.decode, p.device), sm, rule)
        num_splits = fit_splits(p, self.bucket, num_splits, explicit)
        self.num_splits = num_splits
        self.pdl, self.pdl_reason = pdl_choice(p, num_splits)
        self.combine = ks.handle(COMBINE, shared(spec), 0, p.device, why) if num_splits > 1 else None
        self.q_shape = q_shape
        self.lse_shape = (p.batch, p.heads_q, p.seqlen_q)
        self.part_rows = p.batch * p.heads_k * num_splits * p.group_rows
        self.lens_mode = ("full" if cache_seqlens is None else "int" if isinstance(cache_seqlens, int)
                          else "host" if validate._host_lengths(cache_seqlens) is not None else "array")
        self.base = {"stride_btz": p.bt_stride, "batch": p.batch, "num_heads_q": p.heads_q,
                     "num_heads_k": p.heads_k, "seqlen_q": p.seqlen_q, "seqlen_new": p.seqlen_new,
                     "capacity": p.capacity, "num_pages": p.num_pages, "page_size": p.page_size, "sm_scale": p.scale,
                     "window_left": p.window_left, "window_right": p.window_right, "num_splits": num_splits,
                     "head_dim": p.head_dim, SOFTCAP_ARG: p.softcap, **_scale_args(p),
                     "stride_az": p.alibi_stride, USE_ALIBI_ARG: int(p.alibi), USE_SINKS_ARG: 0,
                     **named("q", "m", p.q_strides), **named("k", "n", p.k_strides),
                     **named("v", "n", p.v_strides), **named("o", "m", o_strides),
                     **named("kn", "m", p.kn_strides), **named("vn", "m", p.vn_strides),
                     "stride_lz": p.heads_q * p.seqlen_q, "stride_lh": p.seqlen_q}
        self.varlen = _varlen_route(p, ks, spec, layout, infos, oi is None)
        if p.softcap and not self.varlen and SOFTCAP_ARG not in self.decode.arg_names:
            # Never a silent answer without the cap: the variant would ignore it.
            raise KernelNotFound(f"softcap={p.softcap} needs attn_decode with a softcap argument; these images were "
                                 f"built before it ({', '.join(f'{k}={v}' for k, v in paged.items())}): rebuild "
                                 f"them (`python -m builder build --kernels attn_decode`)")
        if p.alibi and not self.varlen and USE_ALIBI_ARG not in self.decode.arg_names:
            # Never a silent answer without the term: the variant would ignore the slopes.
            shown = ", ".join(f"{k}={v}" for k, v in paged.items())
            raise KernelNotFound(f"alibi_slopes needs attn_decode with ALiBi arguments (alibi_slopes, stride_az, "
                                 f"use_alibi); these images were built before them ({shown}): rebuild them "
                                 f"(`python -m builder build --kernels attn_decode,attn_decode_combine`)")
        # Sinks: joined by the kernels where they take them (one split: attn_decode's epilogue;
        # several: attn_decode_combine's), by the variable-length forward on its route, else by
        # the attn_sinks pass over (out, lse) after the launches (images built before them).
        self.sinks_pass = False
        if p.sinks:
            fused = takes_sinks(self.decode) and (self.combine is None or takes_sinks(self.combine))
            if fused and not self.varlen:
                self.base[USE_SINKS_ARG] = 1
            self.sinks_pass = not fused and not self.varlen
        if self.varlen:
            self.lengths = ks.handle(LENGTHS, {}, 0, p.device, why)
            self.pack = ks.handle(PACK, shared(paged), 0, p.device, why)
            self.poison = ks.handle(POISON, shared(spec), 0, p.device, why)
        fast = xp.framework == "torch" and p.device >= 0 and not self.q_copy and not self.varlen
        self.fast = self._prepare() if fast else None
        self.starts_mode = ("zeros" if cache_leftpad is None else
                            "host" if validate._host_starts(cache_leftpad) is not None else "array")
        if p.fp8 and "KScale" not in self.decode.arg_names:
            raise KernelNotFound(f"an fp8 cache ({p.kv_dtype}) needs attn_decode with KScale and VScale arguments; "
                                 f"these images hold variants without them: rebuild them (`python -m builder build "
                                 f"--kernels attn_decode,attn_decode_append`)")
        if cache_leftpad is not None and "CacheStart" not in self.decode.arg_names:
            raise KernelNotFound("cache_leftpad needs attn_decode with a CacheStart argument; these images were built "
                                 "before it: rebuild them (`python -m builder build --kernels attn_decode`)")
        self.lens = None  # the constant lengths array of "full"/"int" calls, made on the first fast call
        self.flag = None  # the library's fault flag for this device, fetched on the first call
        self.zeros = None  # the library's zero starts (calls without cache_leftpad), fetched on the first call
        self.ones = None  # the library's 1.0 (scales given as floats), fetched on the first call

    def _prepare(self) -> list | None:
        """Integer-address launches for torch tensors (as the attention plans do): per kernel,
        ``(launch, template, pointer slots)``, the scalars checked and the grid computed once,
        with or without PDL as :func:`pdl_choice` decided for the call (``self.pdl``). None when a
        handle cannot take them (the per-call handle path then serves; it launches the variants as
        compiled)."""
        torch = sys.modules["torch"]
        backend = "hip" if getattr(torch.version, "hip", None) else "cuda"
        values = {**self.base, **dict.fromkeys(_POINTERS, 0), **dict.fromkeys(_RETIRED, 0)}
        prepared = []
        for handle in (self.append, self.decode, self.combine):
            if handle is None:
                continue
            if not callable(getattr(handle, "prepare", None)) or \
                    getattr(getattr(handle, "library", None), "backend_now", None) != backend:
                return None
            template = [values[n] for n in handle.arg_names]
            launch = handle.prepare(self.p.device, template, pdl=self.pdl)
            if launch is None:
                return None
            slots = tuple((i, _POINTERS.index(n)) for i, n in enumerate(handle.arg_names) if n in _POINTERS)
            prepared.append((launch, template, slots))
        self.torch = torch
        self.stream = interop.stream_getter("torch")
        self.tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[self.p.dtype]
        return prepared

    def run_fast(self, q: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any, k_new: Any, v_new: Any,
                 out: Any, cache_leftpad: Any = None, k_scale: Any = None, v_scale: Any = None,
                 alibi_slopes: Any = None, sinks: Any = None) -> tuple[Any, Any]:
        """A repeated torch call: allocate, fill the address slots, launch (no per-call checks)."""
        torch, p, dev = self.torch, self.p, q.device
        o = out if out is not None else torch.empty(self.q_shape, dtype=self.tdtype, device=dev)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=dev)
        if p.batch == 0 or p.heads_q == 0:
            return o, lse
        if self.lens_mode == "array":
            lens = cache_seqlens
        elif self.lens_mode == "host":
            lens = self.seqlens(q, cache_seqlens)
        else:
            lens = self.lens
            if lens is None:
                lens = self._constant_lens(q, cache_seqlens)
        stream = self.stream(p.device)
        # Every array whose address a launch reads is held by a name here until the launches are
        # enqueued: one freed earlier (a temporary's data_ptr()) goes back to the allocator, whose
        # next allocation in this call (the fp32 sinks, the starts) would then share its memory.
        part = (torch.empty((self.part_rows * (self.bucket + 1),), dtype=torch.float32, device=dev)
                if self.combine is not None else None)  # one allocation: the partial outputs, then their logsumexps
        part_o = part.data_ptr() if part is not None else 0
        part_l = part_o + self.part_rows * self.bucket * 4 if part is not None else 0
        flag = self.flag if self.flag is not None else self._flag(q)
        starts = self.starts(q, cache_leftpad, cache_seqlens)
        ones = self.scale_ones(q) if self._reads_ones() else None
        s32 = self.sinks_fp32(sinks)
        # In _POINTERS order.
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                     block_table.data_ptr() if block_table is not None else 0, lens.data_ptr(),
                     k_new.data_ptr() if k_new is not None else 0, v_new.data_ptr() if v_new is not None else 0,
                     part_o, part_l, flag.data_ptr(), starts.data_ptr(),
                     *self._scale_addresses(k_scale, v_scale, ones),
                     alibi_slopes.data_ptr() if alibi_slopes is not None else 0,
                     s32.data_ptr() if s32 is not None else 0)
        for launch, template, slots in self.fast:
            args = list(template)
            for i, j in slots:
                args[i] = addresses[j]
            launch(stream, tuple(args))
        del part, flag, starts, ones, s32  # enqueued: their reuse is ordered after these launches
        if self.sinks_pass:
            self._sinks_pass(o, lse, sinks)
        return o, lse

    def sinks_fp32(self, sinks: Any) -> Any:
        """The sinks as the kernels read them, fp32 (fp16/bf16 ones converted: a new array of Hq
        values, ordered on the stream before its reuse by the framework's allocator); None when
        the kernels do not read them."""
        if sinks is None or not self.base[USE_SINKS_ARG]:
            return None
        return sinks if self.p.sinks == "fp32" else self.xp.as_fp32(sinks)

    def _sinks_pass(self, o: Any, lse: Any, sinks: Any) -> None:
        """The sinks joined to ``(o, lse)`` by the ``attn_sinks`` pass (decode variants built before
        they took them)."""
        from ..attention.sinks import apply_sinks

        apply_sinks(o, lse, sinks, heads_q=self.p.heads_q, layout=self.layout, library=self.ks.lib)

    def _constant_lens(self, q: Any, cache_seqlens: Any) -> Any:
        """The lengths array of a "full"/"int" fast call: one per (device, batch, length) for the
        life of the process (:data:`_CONSTANT_LENS`), since a CUDA graph that captured a call keeps
        reading its address after the plan that made it is gone (the plan cache is cleared when
        full; a change of tuning rules or PDL policy remakes plans), shared by calls on every stream
        (read only; published once its fill has finished). One made during a capture (its
        fill a node of the graph, its memory the graph's pool) or past the table's bound serves
        this call only."""
        value = self.p.capacity if self.lens_mode == "full" else cache_seqlens
        key = (q.device.index, self.p.batch, value)
        lens = _CONSTANT_LENS.get(key)
        if lens is None:
            lens = self.seqlens(q, cache_seqlens)
            if len(_CONSTANT_LENS) >= _MAX_CONSTANT_LENS or not self.xp.settle_for_sharing(q):
                return lens
            lens = _CONSTANT_LENS.setdefault(key, lens)
        self.lens = lens
        return lens

    def _reads_ones(self) -> bool:
        """Whether a scale given as a float is read from the library's 1.0 (:meth:`scale_ones`)."""
        s = self.p.scales
        return s is not None and not (s.k_array and s.v_array)

    def _scale_addresses(self, k_scale: Any, v_scale: Any, ones: Any) -> tuple[int, int]:
        """The fast path's KScale and VScale: the arrays' addresses, ``ones`` (the library's 1.0,
        held by the caller until its launches are enqueued) for floats, 0 for a cache of q's type
        (never read)."""
        s = self.p.scales
        if s is None:
            return 0, 0
        one = ones.data_ptr() if ones is not None else 0
        return (k_scale.data_ptr() if s.k_array else one, v_scale.data_ptr() if s.v_array else one)

    def scale_ones(self, like: Any) -> Any:
        """The fp32 1.0 a scale given as a float is read from (its value is the kernel's
        ``k_scale``/``v_scale``): the library's, shared like its zero starts."""
        if self.ones is not None:
            return self.ones
        ones, kept = shared_ones(self.ks.ones, (self.xp.framework, self.p.device), self.xp, like)
        if kept:
            self.ones = ones
        return ones

    def scale_arrays(self, like: Any, k_scale: Any, v_scale: Any, infos: dict | None) -> tuple[Any, Any]:
        """The KScale and VScale arguments of the first (handle) launch: arrays converted, the
        library's 1.0 for floats, None without an fp8 cache."""
        s = self.p.scales
        if s is None:
            return None, None
        found = []
        for name, value, is_array in (("k_scale", k_scale, s.k_array), ("v_scale", v_scale, s.v_array)):
            if not is_array:
                found.append(self.scale_ones(like))
            else:
                found.append(value if infos is None else self.xp.convert(value, infos[name]))
        return found[0], found[1]

    def _flag(self, like: Any) -> Any:
        flag, kept = fault_flag(self.ks, self.xp, like, self.p.device)
        if kept:
            self.flag = flag
        return flag

    def starts(self, like: Any, cache_leftpad: Any, cache_seqlens: Any, infos: dict | None = None) -> Any:
        """The ``CacheStart`` array: the library's zeros without ``cache_leftpad``, a host one
        checked (a cached plan skips _plan) and copied, a device one as is."""
        if self.starts_mode == "zeros":
            if self.zeros is None:
                zeros, kept = zero_starts(self.ks, self.xp, like, self.p.device, self.p.batch)
                if not kept:
                    return zeros
                self.zeros = zeros
            return self.zeros
        if self.starts_mode == "host":
            starts = validate._host_starts(cache_leftpad)
            if len(starts) != self.p.batch:
                raise ArgumentError(f"cache_leftpad must have shape ({self.p.batch},), got {len(starts)} starts")
            lens = (validate._host_lengths(cache_seqlens) if self.lens_mode == "host" else
                    [cache_seqlens] * self.p.batch if self.lens_mode == "int" else None)
            validate.check_starts(starts, lens, self.p.capacity)
            if self.xp.framework == "torch":
                return self.xp.torch.tensor(starts, dtype=self.xp.torch.int32, device=like.device)
            return self.xp.cupy.asarray(starts, dtype="int32")
        return cache_leftpad if infos is None else self.xp.convert(cache_leftpad, infos["cache_leftpad"])

    def seqlens(self, like: Any, cache_seqlens: Any, infos: dict | None = None) -> Any:
        if self.lens_mode == "host":  # checked on the host every call (a cached plan skips _plan)
            lens = validate._host_lengths(cache_seqlens)
            if len(lens) != self.p.batch:
                raise ArgumentError(f"cache_seqlens must have shape ({self.p.batch},), got {len(lens)} lengths")
            for b, n in enumerate(lens):
                _check_length(n, self.p.seqlen_new, self.p.capacity, self.p.paged, f"cache_seqlens[{b}]")
            if self.xp.framework == "torch":
                return self.xp.torch.tensor(lens, dtype=self.xp.torch.int32, device=like.device)
            return self.xp.cupy.asarray(lens, dtype="int32")
        if self.lens_mode == "full":
            return self.xp.full((self.p.batch,), self.p.capacity, "i32", like)
        if self.lens_mode == "int":
            return self.xp.full((self.p.batch,), cache_seqlens, "i32", like)
        return cache_seqlens if infos is None else self.xp.convert(cache_seqlens, infos["cache_seqlens"])

    def run(self, q: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any, k_new: Any, v_new: Any, out: Any,
            infos: dict | None = None, cache_leftpad: Any = None, k_scale: Any = None,
            v_scale: Any = None, alibi_slopes: Any = None, sinks: Any = None) -> tuple[Any, Any]:
        xp, p = self.xp, self.p
        if infos is not None:  # first call: any framework, converted once
            q, k, v = (xp.convert(a, infos[n]) for a, n in ((q, "q"), (k, "k_cache"), (v, "v_cache")))
            if self.q_copy:
                q = xp.contiguous(q)
                p.q_strides = _effective((p.batch, p.heads_q, p.seqlen_q), _bshd(_describe(q, "q"), self.layout)[1])
                self.base.update(named("q", "m", p.q_strides))
            block_table = xp.convert(block_table, infos["block_table"]) if p.paged else None
            if k_new is not None:
                k_new, v_new = xp.convert(k_new, infos["k_new"]), xp.convert(v_new, infos["v_new"])
            if out is not None:
                out = xp.convert(out, infos["out"])
            if alibi_slopes is not None:
                alibi_slopes = xp.convert(alibi_slopes, infos["alibi_slopes"])
            if sinks is not None:
                sinks = xp.convert(sinks, infos["sinks"])
        lse = xp.empty(self.lse_shape, "fp32", q)
        if p.batch == 0 or p.heads_q == 0:
            return (out if out is not None else xp.empty(self.q_shape, p.dtype, q)), lse
        # The varlen route's forward allocates the output itself (its fresh-output plan).
        o = out if out is not None or self.varlen else xp.empty(self.q_shape, p.dtype, q)
        values = {**self.base, "Q": q, "K": k, "V": v, "Out": o, "LSE": lse, "BlockTable": block_table,
                  "CacheSeqlens": self.seqlens(q, cache_seqlens, infos),
                  "CacheStart": self.starts(q, cache_leftpad, cache_seqlens, infos), "KNew": k_new, "VNew": v_new,
                  "PartO": None, "PartL": None, "Faults": self.flag if self.flag is not None else self._flag(q),
                  **dict(zip(("KScale", "VScale"), self.scale_arrays(q, k_scale, v_scale, infos))),
                  ALIBI_ARG: alibi_slopes, SINKS_ARG: self.sinks_fp32(sinks), **_RETIRED}
        if self.append is not None:
            self.append(*[values[n] for n in self.append.arg_names])
        if self.varlen:
            return self._run_varlen(q, values, lse, alibi_slopes, sinks)
        if self.combine is not None:
            values["PartO"] = xp.empty((self.part_rows, self.bucket), "fp32", q)
            values["PartL"] = xp.empty((self.part_rows,), "fp32", q)
        self.decode(*[values[n] for n in self.decode.arg_names])
        if self.combine is not None:
            self.combine(*[values[n] for n in self.combine.arg_names])
        if self.sinks_pass:
            self._sinks_pass(o, lse, sinks)
        return o, lse


    def _run_varlen(self, q: Any, values: dict, lse: Any, alibi_slopes: Any = None,
                    sinks: Any = None) -> tuple[Any, Any]:
        """A long query run through the variable-length forward: each sequence's live cache rows
        packed (``attn_decode_lengths``, ``attn_decode_pack``), the forward on them aligned
        bottom-right with the call's mask (ALiBi's positions too: a sequence's packed keys start
        at its first live row, which shifts query and key positions alike; sinks joined by it),
        then NaN for every sequence whose lengths or table entries were out of range
        (``attn_decode_poison``): the decode kernels' answers."""
        from ..attention.plan import forward

        xp, p = self.xp, self.p
        B, Sq, Hq, Hk, D = p.batch, p.seqlen_q, p.heads_q, p.heads_k, p.head_dim
        rows = max(B * p.capacity, 1)
        ko, vo = xp.empty((rows, Hk, D), p.dtype, q), xp.empty((rows, Hk, D), p.dtype, q)
        values.update(CuQ=xp.empty((B + 1,), "i32", q), CuK=xp.empty((B + 1,), "i32", q),
                      SeqFaults=xp.empty((B,), "i32", q), KOut=ko, VOut=vo, stride_okm=Hk * D, stride_okh=D,
                      stride_ovm=Hk * D, stride_ovh=D)
        for handle in (self.lengths, self.pack):
            handle(*[values[n] for n in handle.arg_names])
        left, right = p.window_left, p.window_right
        causal, window = (True, None) if left < 0 and right == 0 else (False, None) if left < 0 and right < 0 \
            else (False, (left, right))
        # No out=: a fresh (B * Sq, Hq, D) output is the call's (B, Sq, Hq, D) one, and lets the
        # forward take its direct plan (the general one, which out= needs, costs ~100 µs more).
        packed, lse_packed = forward(q.reshape(B * Sq, Hq, D), ko, vo, causal, window, "bottom_right", None, 0.0,
                                     None, 0, p.scale, values["CuQ"], values["CuK"], Sq, p.capacity, "bhsd", None,
                                     None, False, self.ks.lib, p.softcap or None, alibi_slopes, sinks)
        o = packed.reshape(self.q_shape)
        per_sequence = lse_packed.reshape(Hq, B, Sq)
        if xp.framework == "torch":
            lse.copy_(per_sequence.permute(1, 0, 2))
        else:
            lse[...] = per_sequence.transpose(1, 0, 2)
        self.poison(*[{**values, "Out": o, "LSE": lse}[n] for n in self.poison.arg_names])
        return o, lse


#: Query rows per sequence from which a call whose images hold the packing kernels and the
#: variable-length forward runs there (docs/performance.md, "Decode": the forward reads a packed
#: cache at 0.9x-plus of its own speed where the decode kernels' prefill tile reaches 0.5x).
VARLEN_SEQLEN_Q = 128


def _varlen_route(p: DecodePlan, ks: _Kernels, spec: dict, layout: str, infos: dict, fresh_out: bool) -> bool:
    """Whether a call runs through the variable-length forward (:meth:`_Launch._run_varlen`): a
    long query run at a compiled head dim, ``bshd`` arrays whose rows pack as they lie, packed
    K/V within :data:`MAX_SCRATCH_BYTES`, and images that hold every kernel of the route (for a
    softcapped call, a forward compiled with the cap: ``SOFTCAP=1`` taking ``softcap``; for an
    ALiBi call, ``ALIBI=1`` taking the slopes)."""
    if p.fp8:
        return False  # the packing kernels copy caches of q's type only
    if p.seqlen_q < VARLEN_SEQLEN_Q or spec.get("PADDED_D") or spec["HEAD_DIM"] != p.head_dim or layout != "bshd":
        return False
    packed = (p.seqlen_q * p.heads_q * p.head_dim, p.head_dim, p.heads_q * p.head_dim)  # (batch, head, row)
    sizes = (p.batch, p.heads_q, p.seqlen_q)
    if not fresh_out or any(n > 1 and st != want for n, st, want in zip(sizes, p.q_strides, packed)):
        return False
    itemsize = {"fp16": 2, "bf16": 2, "fp32": 4}[p.dtype]
    if 2 * p.batch * p.capacity * p.heads_k * p.head_dim * itemsize > MAX_SCRATCH_BYTES:
        return False
    causal = 0 if p.window_left < 0 and p.window_right < 0 else 1
    forward = {"dtype": p.dtype, "HEAD_DIM": p.head_dim, "HEAD_DIM_V": p.head_dim, "CAUSAL": causal, "BIAS": 0,
               "DROPOUT": 0, "VARLEN": 1}
    # The late axes at their value where the images' forward has them (an unkeyed spec would match
    # the SOFTCAP=1 or ALIBI=1 variants, which refuse this call); images built before one have none.
    from ..attention.dispatch import held_axis

    late = {"SOFTCAP": int(bool(p.softcap)), "ALIBI": int(p.alibi)}
    forward.update({axis: value for axis, value in late.items() if value or held_axis(ks.has, "attn_fwd", axis)})
    args = ((SOFTCAP_ARG,) if p.softcap else ()) + ((ALIBI_ARG,) if p.alibi else ())
    return (ks.has(LENGTHS, {}) and ks.has(PACK, shared(with_paged(spec, p.paged))) and ks.has(POISON, shared(spec))
            and ks.has("attn_fwd", forward, args))


def _scale_args(p: DecodePlan) -> dict[str, Any]:
    """The scalar arguments of an fp8 cache's scales (:class:`~.validate.KVScales`); neutral ones
    for a cache of q's type (its variants never read them)."""
    s = p.scales
    if s is None:
        return {"stride_ksz": 0, "stride_ksh": 0, "stride_vsz": 0, "stride_vsh": 0, "k_scale": 1.0, "v_scale": 1.0}
    return {"stride_ksz": s.k_strides[0], "stride_ksh": s.k_strides[1], "stride_vsz": s.v_strides[0],
            "stride_vsh": s.v_strides[1], "k_scale": s.k_value, "v_scale": s.v_value}


def _bshd_contiguous(shape: tuple, layout: str) -> tuple[int, int, int]:
    """(batch, head, row) strides of a contiguous array of ``shape`` in ``layout``."""
    b, x, y, d = shape
    return (x * y * d, d, y * d) if layout == "bshd" else (x * y * d, y * d, d)


