"""How a call becomes a kernel launch: one plan per call signature, built once, run many times.

1. **Signature.** :func:`forward` / :func:`.backward_plan.backward` read, for each array
   argument, what decides a launch except its address: shape, strides, dtype, device, whether the
   address is 16-byte aligned (exact torch tensors: ``shape``/``stride()``/``dtype``/
   ``get_device()``/``data_ptr()``; anything else: :func:`aotriton_rt.interop.describe`), plus
   every option (with its type, so that ``causal=1`` never finds the plan of ``causal=True``).
   That tuple is the plan's key; how one argument is read is :mod:`.signature`.
2. **Plan, on the first call of a signature** (:func:`_build_forward`,
   :func:`.backward_plan._build_backward`): validate everything (:mod:`.problem`; a refusal
   raises and caches nothing, so it is raised again on every repeat), choose the kernels
   (:mod:`.dispatch`, tuning rules included), then lay out the arguments. When every operand
   can be read in place, nothing is padded and the outputs are fresh, the plan is *direct*:
   output shapes and dtypes, and for each kernel an argument list with its scalars, strides and
   grid fixed and only the array slots open.
   Otherwise the plan keeps the validated problem and runs the general path of :mod:`.launch`
   (copies, padding, empty problems, dBias reduction) without validating or dispatching again.
3. **Every call**: look the key up in the library's bounded LRU (:class:`.signature.PlanCache`),
   allocate the outputs, fill the array slots (integer addresses for torch tensors on a :class:`Kernel`,
   whose :meth:`~aotriton_rt.launch.Kernel.prepare` checked the scalars and computed the grid
   once; the arrays themselves for other handles) and launch on the framework's current stream.

What may change under an equal signature is checked per call or is part of the key: addresses
(alignment is in the key), the dropout ``seed``/``offset`` (per-call values, validated each call
and never baked into a plan, so CUDA graph capture and ``torch.compile`` see fresh ones), and the
device (in the key). Variable-length calls without ``max_seqlen_q``/``max_seqlen_k`` read the
lengths from the device each call and are planned anew every time: pass them in hot loops.

This module holds the pieces every plan is made of (open slots, launches, allocation, stride
checks, the per-call dropout pair), the forward plans and :func:`kernels` (what a call of either
direction would launch); the backward plans are :mod:`.backward_plan`, which imports from here.
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass, replace
from typing import Any

from ...errors import ArgumentError
from . import launch as general
from . import sinks as _sinks
from .arrays import bias_strides_in_place
from .dispatch import kernels_of
from .family import (
    ALIGN,
    FWD,
    SINKS_ARG,
    USE_SINKS_ARG,
    bhs,
    contiguous_kernel_strides,
    contiguous_strides,
    forward_arguments,
    kernel_strides,
)
from .framework import arrays_for
from .problem import (
    U64,
    Problem,
    addressable,
    check_output,
    check_scheme,
    int_arg,
    prepare,
)
from .signature import _NO_LENGTHS, _described_sig, _sig, _torch_tensor_type, _typed

# ---------------------------------------------------------------------------------------------
# Direct plans: argument lists with the array slots open.
# ---------------------------------------------------------------------------------------------

class _Slot:
    """An open argument: filled per call from the call's sources at ``index``."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Launch:
    """One kernel of a direct plan: its argument template, open slots and launch function.

    Per call the arguments are gathered in C: ``pick(sources + constants)`` with ``pick`` an
    ``itemgetter`` of each argument's position in that concatenation.
    """

    __slots__ = ("handle", "constants", "pick", "prepared")

    def __init__(self, handle: Any, values: dict[str, Any], device: int, fast: bool, sources: int) -> None:
        template = [values[name] for name in handle.arg_names]
        constants = [v for v in template if not isinstance(v, _Slot)]
        positions, c = [], sources
        for v in template:
            if isinstance(v, _Slot):
                positions.append(v.index)
            else:
                positions.append(c)
                c += 1
        self.handle = handle
        self.constants = tuple(constants)
        self.pick = operator.itemgetter(*positions) if len(positions) > 1 else lambda t: (t[positions[0]],)
        self.prepared = None
        if fast:
            self.prepared = handle.prepare(device, [0 if isinstance(v, _Slot) else v for v in template])
            if self.prepared is not None:
                # Prepared launches pack integers only: an absent array (no bias, no mask) is address 0.
                self.constants = tuple(0 if v is None else v for v in constants)

    def __call__(self, src: tuple, stream: int) -> None:
        if self.prepared is not None:
            self.prepared(stream, self.pick(src + self.constants))
        else:
            self.handle(*self.pick(src + self.constants))


def _fast_handles(p: Problem, handles: list[Any], arrays: list[Any]) -> bool:
    """Whether launches may take integer addresses: torch tensors on a device, compiled handles."""
    t = _torch_tensor_type()
    torch = sys.modules.get("torch")
    backend = "hip" if getattr(getattr(torch, "version", None), "hip", None) else "cuda"
    return (p.qi.framework == "torch" and p.device >= 0 and all(type(a) is t for a in arrays if a is not None)
            and all(callable(getattr(h, "prepare", None)) for h in handles)
            and all(getattr(getattr(h, "library", None), "backend_now", None) == backend for h in handles))


class _Allocator:
    """Fresh outputs in the framework of q: torch.empty with fixed dtype and device, or CuPy."""

    def __init__(self, p: Problem, q: Any) -> None:
        self.xp = arrays_for(p.qi.framework)
        self.torch = None
        if self.xp.framework == "torch":
            self.torch = self.xp.torch
            self.device = q.device
            self.dtypes = self.xp.dtypes
            self.out_dtype = self.dtypes[p.dtype]
            self.fp32 = self.dtypes["fp32"]

    def empty(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        if self.torch is not None:
            return self.torch.empty(shape, dtype=self.dtypes[dtype], device=self.device)
        return self.xp.empty(shape, dtype, like)


def _in_place_strides(p: Problem, info: Any, width: int) -> tuple[int, int, int] | None:
    extents, strides = bhs(info.shape, info.strides, p.layout, p.varlen)
    strides = kernel_strides(extents, strides)
    return strides if addressable(info, strides, width, ALIGN) else None


def _bias_in_place(p: Problem) -> tuple[int, int, int] | None:
    return (0, 0, 0) if p.bias_info is None else bias_strides_in_place(p)


def _fresh_strides(p: Problem, shape: tuple[int, ...]) -> tuple[int, ...]:
    return contiguous_kernel_strides(shape, p.layout, p.varlen)


def _directable(p: Problem) -> bool:
    """Whether a direct plan may serve: something to compute, cu_seqlens 16-byte aligned (the
    kernels' promise, checked by the handle on the general path), a framework that allocates."""
    if not (p.batch and p.heads_q and p.rows_q and p.rows_k and p.seqlen_q and p.seqlen_k):
        return False
    if p.varlen and (p.cu_qi.ptr % 16 or p.cu_ki.ptr % 16):
        return False
    return p.qi.framework in ("torch", "cupy")


# ---------------------------------------------------------------------------------------------
# Forward.
# ---------------------------------------------------------------------------------------------

@dataclass
class _GeneralForward:
    """A validated problem (its arrays dropped) run through the general path."""

    problem: Problem
    handle: Any
    spec: dict
    out_i: Any
    lse_i: Any
    return_mask: bool
    fuses_sinks = False

    def run(self, q: Any, k: Any, v: Any, bias: Any, cu_q: Any, cu_k: Any, alibi: Any, out: Any, lse: Any,
            ptrs: tuple, seed: Any, offset: Any, sinks: Any = None) -> tuple:
        p = self.problem
        seed, offset = _philox(seed, offset, p.dropout_p) if p.dropout_p else (0, 0)
        p = replace(p, q=q, k=k, v=v, bias=bias, cu_q=cu_q, cu_k=cu_k, alibi=alibi, seed=seed, offset=offset)
        return general.forward(p, self.handle, self.spec, out, self.out_i, lse, self.lse_i, self.return_mask)


#: ``express.py``, the route to the decode kernels, installed by the package's ``__init__`` (plan
#: imports nothing of the decode operator, whose long query runs call :func:`forward`).
EXPRESS: Any = None


class _DecodeForward:
    """A call the decode kernels serve (:func:`aotriton_rt.ops.decode.route_options`), ALiBi
    slopes and sinks passed per call: the decode operator joins the sinks itself (in its kernels
    where they take them, else by the ``attn_sinks`` pass)."""

    fuses_sinks = True

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.launch = None  # the decode plan, once a call has made one that takes integer addresses

    def run(self, q: Any, k: Any, v: Any, bias: Any, cu_q: Any, cu_k: Any, alibi: Any, out: Any, lse: Any,
            ptrs: tuple, seed: Any, offset: Any, sinks: Any = None) -> tuple:
        launch = self.launch
        # This plan's key pins all the decode plan depends on (the library, and so its tuning
        # rules; the slopes' and sinks' signatures).
        if launch is not None:
            return launch.run_fast(q, k, v, None, None, None, None, None, None, None, None, alibi, sinks)
        result = EXPRESS.decode_attention(q, k, v, alibi_slopes=alibi, sinks=sinks, **self.options)
        self.launch = EXPRESS.cached_launch(q, k, v, alibi_slopes=alibi, sinks=sinks, **self.options)
        return result


def _philox(seed: Any, offset: Any, dropout_p: float) -> tuple[int, int]:
    """The per-call dropout pair, validated like the first call's (never part of a plan)."""
    if seed is None:
        raise ArgumentError(f"dropout_p={dropout_p} needs seed= (and offset=): the backward must replay the "
                            f"forward's mask from the same (seed, offset)")
    if type(seed) is not int or not 0 <= seed < U64:
        seed = int_arg(seed, "seed", 0, U64 - 1)
    if type(offset) is not int or not 0 <= offset < U64:
        offset = int_arg(offset, "offset", 0, U64 - 1)
    return seed, offset


class _DirectForward:
    """Outputs allocated fresh, every operand read in place: allocate, fill, launch.

    ``sinks``: the call's sinks array description, when the forward kernel takes them (its
    ``Sinks``/``use_sinks`` arguments: joined in its epilogue, ``fuses_sinks``); they are passed
    as fp32, converted per call when given in another dtype (a new array of Hq values, which lives
    until the call returns: the launch is on the framework's current stream, which its allocator
    orders the array's reuse after).
    """

    # Sources, per call: q, k, v, bias, cu_q, cu_k, alibi, out, lse, mask, seed, offset, sinks.
    def __init__(self, p: Problem, q: Any, handle: Any, strides: dict[str, tuple], return_mask: bool,
                 fast: bool, sinks: Any = None) -> None:
        self.alloc = _Allocator(p, q)
        self.dtype = p.dtype
        self.out_shape = p.out_shape()
        self.lse_shape = p.lse_shape()
        self.mask_shape = (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k) if return_mask else None
        self.dropout_p = p.dropout_p
        self.fast = fast
        self.device = p.device
        self.infos = (p.qi, p.ki, p.vi, p.bias_info, p.cu_qi, p.cu_ki, p.alibi_info)
        arrays = {"q": _Slot(0), "k": _Slot(1), "v": _Slot(2), "out": _Slot(7), "lse": _Slot(8)}
        strides = {**strides, "out": _fresh_strides(p, self.out_shape)}
        if return_mask:
            arrays["mask"], strides["mask"] = _Slot(9), contiguous_strides(self.mask_shape)[:3]
        if p.bias_info is not None:
            arrays["bias"] = _Slot(3)
        if p.varlen:
            arrays["cu_seqlens_q"], arrays["cu_seqlens_k"] = _Slot(4), _Slot(5)
        _add_alibi(p, arrays, strides, _Slot(6))
        values = forward_arguments(arrays, strides, p.lse_strides(), _scalars(p, 10))
        self.sinks_info = sinks
        self.fuses_sinks = sinks is not None
        if sinks is not None:
            values[SINKS_ARG], values[USE_SINKS_ARG] = _Slot(12), 1
        self.launches = (_Launch(handle, values, p.device, fast, 13),)
        self.stream = _stream_getter(p, q) if fast else None

    def run(self, q: Any, k: Any, v: Any, bias: Any, cu_q: Any, cu_k: Any, alibi: Any, out: Any, lse: Any,
            ptrs: tuple, seed: Any, offset: Any, sinks: Any = None) -> tuple:
        if self.dropout_p:
            seed, offset = _philox(seed, offset, self.dropout_p)
        alloc = self.alloc
        if alloc.torch is not None:
            empty = alloc.torch.empty
            o = empty(self.out_shape, dtype=alloc.out_dtype, device=alloc.device)
            lse_out = empty(self.lse_shape, dtype=alloc.fp32, device=alloc.device)
        else:
            o = alloc.empty(self.out_shape, self.dtype, q)
            lse_out = alloc.empty(self.lse_shape, "fp32", q)
        mask = None
        if self.mask_shape is not None:
            mask = alloc.xp.zeros(self.mask_shape, "i8", q)
        s32 = None
        if self.sinks_info is not None:
            s32 = sinks if self.sinks_info.dtype == "fp32" else _sinks.fp32(alloc.xp, sinks, self.sinks_info)
        if self.fast:
            src = (*ptrs, o.data_ptr(), lse_out.data_ptr(), 0 if mask is None else mask.data_ptr(), seed, offset,
                   0 if s32 is None else s32.data_ptr())
            self.launches[0](src, self.stream(self.device))
        else:
            xp = alloc.xp
            arrays = [None if a is None else xp.convert(a, i)
                      for a, i in zip((q, k, v, bias, cu_q, cu_k, alibi), self.infos)]
            if s32 is not None and self.sinks_info.dtype == "fp32":
                s32 = xp.convert(s32, self.sinks_info)
            self.launches[0]((*arrays, o, lse_out, mask, seed, offset, s32), 0)
        return (o, lse_out, mask) if self.mask_shape is not None else (o, lse_out)


def _add_alibi(p: Problem, arrays: dict[str, Any], strides: dict[str, Any], slot: Any) -> None:
    """The ALiBi slopes' slot and batch stride, where the call has them."""
    if p.alibi_info is not None:
        arrays["alibi"], strides["alibi"] = slot, (p.alibi_stride,)


def _scalars(p: Problem, seed_slot: int) -> dict[str, Any]:
    """The problem's scalars; with dropout, ``philox_seed``/``philox_offset`` are open slots
    (``seed_slot`` and the next): per-call values, never part of a plan."""
    scalars = p.scalars()
    if p.dropout_p:
        scalars["philox_seed"], scalars["philox_offset"] = _Slot(seed_slot), _Slot(seed_slot + 1)
    return scalars


def _stream_getter(p: Problem, q: Any) -> Any:
    from ... import interop

    return interop.stream_getter("torch")


def forward(q: Any, k: Any, v: Any, causal: Any, window: Any, align: Any, bias: Any, dropout_p: Any, seed: Any,
            offset: Any, scale: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
            layout: Any, out: Any, lse: Any, return_mask: Any, library: Any, softcap: Any = None,
            alibi_slopes: Any = None, sinks: Any = None) -> tuple:
    """:func:`aotriton_rt.attention`: find or build the plan of this call's signature and run it."""
    return forward_keyed(q, k, v, causal, window, align, bias, dropout_p, seed, offset, scale, cu_seqlens_q,
                         cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, out, lse, return_mask, library,
                         softcap, alibi_slopes, sinks)[1]


def forward_keyed(q: Any, k: Any, v: Any, causal: Any, window: Any, align: Any, bias: Any, dropout_p: Any,
                  seed: Any, offset: Any, scale: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                  max_seqlen_k: Any, layout: Any, out: Any, lse: Any, return_mask: Any, library: Any,
                  softcap: Any = None, alibi_slopes: Any = None, sinks: Any = None) -> tuple:
    """(plan key, result) of :func:`forward`: the key (None when the call has none) pins every
    operand's signature and option, which lets an autograd backward find its own plan from it
    and the gradient's signature alone (:func:`.backward_plan.backward_after`). With ``sinks``
    the result is the sinks' (:mod:`.sinks`): joined in the forward kernel's epilogue where it
    takes them, else by the ``attn_sinks`` pass over the outputs."""
    ks = None
    try:
        sq, pq = _sig(q, "q")
        sk, pk = _sig(k, "k")
        sv, pv = _sig(v, "v")
        sb, pb = _sig(bias, "bias") if bias is not None else (None, 0)
        sa, pa = _sig(alibi_slopes, "alibi_slopes") if alibi_slopes is not None else (None, 0)
        ss = _sig(sinks, "sinks")[0] if sinks is not None else None
        varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        if varlen:
            if max_seqlen_q is None or max_seqlen_k is None:
                raise LookupError  # lengths live on the device: planned per call
            scq, pcq = _sig(cu_seqlens_q, "cu_seqlens_q")
            sck, pck = _sig(cu_seqlens_k, "cu_seqlens_k")
            extra = (scq, sck, cu_seqlens_q is cu_seqlens_k, _typed(max_seqlen_q), _typed(max_seqlen_k))
        else:
            pcq = pck = 0
            extra = _NO_LENGTHS if max_seqlen_q is None and max_seqlen_k is None else (_typed(max_seqlen_q),
                                                                                          _typed(max_seqlen_k))
        if out is not None or lse is not None:
            extra += (_sig(out, "out")[0], _sig(lse, "lse")[0])
        key = ("fwd", sq, sk, sv, sb, causal.__class__, causal, None if window is None else _typed(window), align,
               dropout_p.__class__, dropout_p, scale.__class__, scale, layout, return_mask.__class__, return_mask,
               softcap.__class__, softcap, sa, ss, *extra)
        ks = kernels_of(library)
        plan = ks.plans.get(key)
    except Exception:  # anything odd: the full validation below says what
        key = plan = None
        pq = pk = pv = pb = pcq = pck = pa = 0
    if plan is None:
        ks, plan = _build_forward(library, q, k, v, causal=causal, window=window, align=align, bias=bias,
                                  dropout_p=dropout_p, seed=seed, offset=offset, scale=scale, cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                  layout=layout, out=out, lse=lse, return_mask=return_mask, softcap=softcap,
                                  alibi_slopes=alibi_slopes, sinks=sinks)
        if key is not None:
            ks.plans.put(key, plan)
        else:
            # No signature (e.g. varlen lengths read from the device): addresses from the arrays.
            pq, pk, pv = (_described_sig(a, n)[1] for a, n in ((q, "q"), (k, "k"), (v, "v")))
            pb = _described_sig(bias, "bias")[1]
            pcq, pck = _described_sig(cu_seqlens_q, "cu")[1], _described_sig(cu_seqlens_k, "cu")[1]
            pa = _described_sig(alibi_slopes, "alibi_slopes")[1]
    result = plan.run(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, alibi_slopes, out, lse,
                      (pq, pk, pv, pb, pcq, pck, pa), seed, offset, sinks)
    if sinks is not None and not plan.fuses_sinks:
        _sinks.apply_sinks(result[0], result[1], sinks, heads_q=_sinks.lse_heads(result[1], cu_seqlens_q is not None),
                           layout=layout, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, library=library)
    return key, result


def _build_forward(library: Any, q: Any, k: Any, v: Any, *, return_mask: Any, out: Any, lse: Any, sinks: Any = None,
                   **options: Any) -> tuple[Any, Any]:
    p = prepare(q, k, v, **options)
    sinks_info = None if sinks is None else _sinks.check_sinks(sinks, p.heads_q, p.device)
    if return_mask and p.dropout_p == 0:
        raise ArgumentError("return_mask=True returns the dropout mask, so it needs dropout_p > 0")
    out_i = check_output(out, "out", p.out_shape(), p.dtype, p)
    lse_i = check_output(lse, "lse", p.lse_shape(), "fp32", p)
    ks = kernels_of(library)  # after validation: a malformed call is refused even without images
    call = p.call(2 if return_mask else 1 if p.dropout_p else 0)
    # THE routing point for other kernel families: 1..16 query rows without bias, dropout or
    # preallocated outputs run on the split-KV decode kernels when the images hold them (their
    # out/lse equal the prefill's, so the backward is unchanged; a softcap or ALiBi slopes go
    # along where the images' decode kernel takes them, sinks always: the decode operator joins
    # them). A family returns its own plan object (anything with this `run`) before the attn_fwd
    # dispatch below.
    if p.rows_q <= 16 and EXPRESS is not None:
        opts = EXPRESS.route_options(q, k, v, out=out, lse=lse, return_mask=return_mask, library=library,
                                     softcap=p.softcap, alibi_slopes=p.alibi,
                                     **{n: options[n] for n in ("causal", "window", "align", "bias", "dropout_p",
                                                                "scale", "cu_seqlens_q", "cu_seqlens_k", "layout")})
        if opts is not None:
            return ks, _DecodeForward(opts)
    spec, handle = ks.forward(call, p.device)
    stripped = replace(p, q=None, k=None, v=None, bias=None, cu_q=None, cu_k=None, alibi=None, seed=0, offset=0)
    strides = None
    if (out is None and lse is None and _directable(p) and spec["HEAD_DIM"] == p.head_dim
            and spec["HEAD_DIM_V"] == p.head_dim_v):
        strides = {"q": _in_place_strides(p, p.qi, p.head_dim), "k": _in_place_strides(p, p.ki, p.head_dim),
                   "v": _in_place_strides(p, p.vi, p.head_dim_v), "bias": _bias_in_place(p)}
    if strides is None or None in strides.values():
        return ks, _GeneralForward(stripped, handle, spec, out_i, lse_i, bool(return_mask))
    fused = sinks_info if sinks_info is not None and SINKS_ARG in handle.arg_names else None
    fast = _fast_handles(p, [handle], [q, k, v, p.bias, p.cu_q, p.cu_k, p.alibi, sinks])
    direct = _DirectForward(stripped, q, handle, strides, bool(return_mask), fast, fused)
    if fast and direct.launches[0].prepared is None:
        direct = _DirectForward(stripped, q, handle, strides, bool(return_mask), False, fused)
    return ks, direct


# ---------------------------------------------------------------------------------------------
# Both directions.
# ---------------------------------------------------------------------------------------------

def kernels(q: Any, k: Any, v: Any, *, backward: bool, deterministic: bool, scheme: Any, return_mask: bool,
            bias_grad: bool, library: Any, options: dict) -> dict[str, Any]:
    """The handles a call would launch (validated like a call; nothing is launched or cached)."""
    p = prepare(q, k, v, **options)
    ks = kernels_of(library)
    if not backward:
        return {FWD: ks.forward(p.call(2 if return_mask else 1 if p.dropout_p else 0), p.device)[1]}
    check_scheme(scheme, bool(deterministic))
    return dict(ks.backward(p.call(1 if p.dropout_p else 0), p.device, bool(deterministic),
                            p.bias is not None and bool(bias_grad), scheme)[2])
