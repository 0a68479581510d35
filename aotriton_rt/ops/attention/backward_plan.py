"""Backward plans: :func:`backward` finds or builds the plan of an ``attention_backward`` call.

The steps are :mod:`.plan`'s (signature, plan on the first call, fill and launch on every call)
and so are the pieces a plan is made of (open slots, launches, allocation, stride checks); this
module adds what only the backward has: its three kernels (preprocess, dK/dV, dQ or the atomic
dQ convert), ``dout`` and the forward's ``out``/``lse`` as operands, and the dBias reduction,
which always takes the general path of :mod:`.launch`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ...errors import ArgumentError
from . import launch as general
from . import problem as _problem
from .dispatch import kernels_of
from .family import CONVERT, DKDV, DQ, PRE, backward_arguments, contiguous_strides
from .plan import (
    _add_alibi,
    _Allocator,
    _bias_in_place,
    _directable,
    _fast_handles,
    _fresh_strides,
    _in_place_strides,
    _Launch,
    _philox,
    _scalars,
    _Slot,
    _stream_getter,
)
from .problem import Problem, check_output, check_scheme, prepare, same_device
from .signature import _described_sig, _sig, _typed


@dataclass
class _GeneralBackward:
    """A validated problem (its arrays dropped) run through the general path, dBias included."""

    problem: Problem
    specs: dict
    handles: dict
    mode: str
    infos: tuple  # dout, out, lse
    grad_infos: list
    want_dbias: bool

    def run(self, arrays: tuple, grads: tuple, ptrs: tuple, seed: Any, offset: Any) -> tuple:
        dout, q, k, v, out, lse, bias, cu_q, cu_k, alibi = arrays
        p = self.problem
        seed, offset = _philox(seed, offset, p.dropout_p) if p.dropout_p else (0, 0)
        p = replace(p, q=q, k=k, v=v, bias=bias, cu_q=cu_q, cu_k=cu_k, alibi=alibi, seed=seed, offset=offset)
        doi, oi, li = self.infos
        return general.backward(p, self.specs, self.handles, self.mode, dout, doi, out, oi, lse, li, grads,
                                self.grad_infos, self.want_dbias)


class _DirectBackward:
    """Gradients allocated fresh, every operand read in place, no dBias: allocate, fill, launch."""

    # Sources, per call: dout, q, k, v, out, lse, bias, cu_q, cu_k, alibi, dq, dk, dv, delta, dqacc, seed, offset.
    def __init__(self, p: Problem, q: Any, mode: str, handles: dict, strides: dict[str, tuple], infos: tuple,
                 fast: bool) -> None:
        self.alloc = _Allocator(p, q)
        self.dtype = p.dtype
        self.shapes = (tuple(p.qi.shape), tuple(p.ki.shape), tuple(p.vi.shape))
        self.lse_shape = p.lse_shape()
        self.dqacc_shape = tuple(p.qi.shape) if mode == "atomic" else None
        self.dropout_p = p.dropout_p
        self.fast = fast
        self.device = p.device
        self.infos = (infos[0], p.qi, p.ki, p.vi, infos[1], infos[2], p.bias_info, p.cu_qi, p.cu_ki, p.alibi_info)
        arrays = {"dout": _Slot(0), "q": _Slot(1), "k": _Slot(2), "v": _Slot(3), "out": _Slot(4), "lse": _Slot(5),
                  "dq": _Slot(10), "dk": _Slot(11), "dv": _Slot(12), "delta": _Slot(13)}
        strides = {**strides, "dq": _fresh_strides(p, self.shapes[0]), "dk": _fresh_strides(p, self.shapes[1]),
                   "dv": _fresh_strides(p, self.shapes[2])}
        if p.bias_info is not None:
            arrays["bias"] = _Slot(6)
        if p.varlen:
            arrays["cu_seqlens_q"], arrays["cu_seqlens_k"] = _Slot(7), _Slot(8)
        _add_alibi(p, arrays, strides, _Slot(9))
        if mode == "atomic":
            arrays["dqacc"], strides["dqacc"] = _Slot(14), _fresh_strides(p, self.dqacc_shape)
        values = backward_arguments(arrays, strides, p.lse_strides(), _scalars(p, 15))
        order = (PRE, DKDV, CONVERT) if mode == "atomic" else (PRE, DKDV, DQ)
        self.launches = tuple(_Launch(handles[name], values, p.device, fast, 17) for name in order)
        self.stream = _stream_getter(p, q) if fast else None

    def run(self, arrays: tuple, grads: tuple, ptrs: tuple, seed: Any, offset: Any) -> tuple:
        if self.dropout_p:
            seed, offset = _philox(seed, offset, self.dropout_p)
        q = arrays[1]
        alloc = self.alloc
        dq = alloc.empty(self.shapes[0], self.dtype, q)
        dk = alloc.empty(self.shapes[1], self.dtype, q)
        dv = alloc.empty(self.shapes[2], self.dtype, q)
        delta = alloc.empty(self.lse_shape, "fp32", q)
        dqacc = None if self.dqacc_shape is None else alloc.empty(self.dqacc_shape, "fp32", q)
        if self.fast:
            src = (*ptrs, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), delta.data_ptr(),
                   0 if dqacc is None else dqacc.data_ptr(), seed, offset)
            stream = self.stream(self.device)
        else:
            xp = alloc.xp
            src = (*[None if a is None else xp.convert(a, i) for a, i in zip(arrays, self.infos)],
                   dq, dk, dv, delta, dqacc, seed, offset)
            stream = 0
        for launch in self.launches:
            launch(src, stream)
        return dq, dk, dv, None


def backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *, deterministic: Any, scheme: Any,
             bias_grad: Any, dq: Any, dk: Any, dv: Any, library: Any, **options: Any) -> tuple:
    """:func:`aotriton_rt.attention_backward`: find or build the plan of this call's signature and run it."""
    arrays = (dout, q, k, v, out, lse, options["bias"], options["cu_seqlens_q"], options["cu_seqlens_k"],
              options["alibi_slopes"])
    grads = (dq, dk, dv)
    try:
        if options["cu_seqlens_q"] is not None or options["cu_seqlens_k"] is not None:
            if options["max_seqlen_q"] is None or options["max_seqlen_k"] is None:
                raise LookupError
        names = ("dout", "q", "k", "v", "out", "lse", "bias", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes")
        sigs = [_sig(a, n) if a is not None else (None, 0) for a, n in zip(arrays, names)]
        key = ("bwd", *(s for s, _ in sigs), *(_sig(g, "grad")[0] if g is not None else None for g in grads),
               options["cu_seqlens_q"] is options["cu_seqlens_k"],
               *(_typed(options[n]) if n != "window" or options[n] is not None else None for n in _BWD_OPTIONS),
               _typed(deterministic), _typed(scheme), _typed(bias_grad))
        ptrs = tuple(p for _, p in sigs)
        ks = kernels_of(library)
        plan = ks.plans.get(key)
    except Exception:
        key = plan = None
    if plan is None:
        ks, plan = _build_backward(library, arrays, grads, deterministic, scheme, bias_grad, options)
        if key is not None:
            ks.plans.put(key, plan)
        else:
            ptrs = tuple(_described_sig(a, "array")[1] for a in arrays)
    return plan.run(arrays, grads, ptrs, options["seed"], options["offset"])


def backward_after(forward_key: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *,
                   deterministic: bool, bias_grad: bool, library: Any, **options: Any) -> tuple:
    """The backward of a forward call planned under ``forward_key`` (:func:`.plan.forward_keyed`),
    on that call's own operands and fresh outputs: the eager autograd path.

    The forward key already pins the signatures of q, k, v, bias and the lengths and every option;
    ``out`` and ``lse`` are that plan's fresh outputs, whose shapes, strides and alignment it fixes.
    So the backward plan is found from the forward key, ``dout``'s signature and the two flags (both
    bools here), without re-reading the other eight arrays and eight options on every step. The
    caller guarantees that contract (torch tensors saved by the forward, ``out``/``lse`` not given
    to it); without a key this is :func:`backward`.
    """
    bias, cu_q, cu_k, alibi = options["bias"], options["cu_seqlens_q"], options["cu_seqlens_k"], options["alibi_slopes"]
    arrays = (dout, q, k, v, out, lse, bias, cu_q, cu_k, alibi)
    plan = key = None
    if forward_key is not None:
        try:
            sd, pd = _sig(dout, "dout")
            key = ("bwd after", forward_key, sd, deterministic, bias_grad)
            ks = kernels_of(library)
            plan = ks.plans.get(key)
        except Exception:  # anything odd: the full path below validates and says what
            key = plan = None
    if plan is None:
        if key is None:
            return backward(dout, q, k, v, out, lse, deterministic=deterministic, scheme=None, bias_grad=bias_grad,
                            dq=None, dk=None, dv=None, library=library, **options)
        ks, plan = _build_backward(library, arrays, (None, None, None), deterministic, None, bias_grad, options)
        ks.plans.put(key, plan)
    ptrs = (pd, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
            0 if bias is None else bias.data_ptr(), 0 if cu_q is None else cu_q.data_ptr(),
            0 if cu_k is None else cu_k.data_ptr(), 0 if alibi is None else alibi.data_ptr())
    return plan.run(arrays, (None, None, None), ptrs, options["seed"], options["offset"])


_BWD_OPTIONS = ("causal", "window", "align", "dropout_p", "scale", "max_seqlen_q", "max_seqlen_k", "layout",
                "softcap")


def _build_backward(library: Any, arrays: tuple, grads: tuple, deterministic: Any, scheme: Any, bias_grad: Any,
                    options: dict) -> tuple[Any, Any]:
    dout, q, k, v, out, lse, bias = arrays[:7]
    p = prepare(q, k, v, **options)
    if not isinstance(deterministic, bool):
        raise ArgumentError(f"deterministic must be True or False, got {deterministic!r}")
    check_scheme(scheme, deterministic)
    doi = _problem._describe(dout, "dout")
    oi = _problem._describe(out, "out")
    li = _problem._describe(lse, "lse")
    for name, info in (("dout", doi), ("out", oi)):
        if tuple(info.shape) != p.out_shape() or info.dtype != p.dtype:
            raise ArgumentError(f"{name} must have shape {p.out_shape()} and dtype {p.dtype} (the forward's output), "
                                f"got {tuple(info.shape)} {info.dtype}")
    if tuple(li.shape) != p.lse_shape() or li.dtype != "fp32":
        raise ArgumentError(f"lse must have shape {p.lse_shape()} and dtype fp32 (the forward's logsumexp), got "
                            f"{tuple(li.shape)} {li.dtype}")
    same_device([("q", p.qi), ("dout", doi), ("out", oi), ("lse", li)])
    grad_infos = [check_output(g, n, s, p.dtype, p) for g, n, s in
                  zip(grads, ("dq", "dk", "dv"), (tuple(p.qi.shape), tuple(p.ki.shape), tuple(p.vi.shape)))]
    ks = kernels_of(library)
    call = p.call(1 if p.dropout_p else 0)
    want_dbias = bias is not None and bool(bias_grad)
    mode, specs, handles = ks.backward(call, p.device, deterministic, want_dbias, scheme)
    stripped = replace(p, q=None, k=None, v=None, bias=None, cu_q=None, cu_k=None, alibi=None, seed=0, offset=0)
    strides = None
    lse_ok = li.ptr % 16 == 0 and tuple(li.strides) == contiguous_strides(li.shape)
    if (all(g is None for g in grads) and not want_dbias and lse_ok and _directable(p)
            and specs[PRE]["HEAD_DIM"] == p.head_dim
            and specs[PRE]["HEAD_DIM_V"] == p.head_dim_v):
        strides = {"q": _in_place_strides(p, p.qi, p.head_dim), "k": _in_place_strides(p, p.ki, p.head_dim),
                   "v": _in_place_strides(p, p.vi, p.head_dim_v), "dout": _in_place_strides(p, doi, p.head_dim_v),
                   "out": _in_place_strides(p, oi, p.head_dim_v), "bias": _bias_in_place(p)}
    if strides is None or None in strides.values():
        return ks, _GeneralBackward(stripped, specs, handles, mode, (doi, oi, li), grad_infos, want_dbias)
    fast = _fast_handles(p, list(handles.values()), list(arrays))
    direct = _DirectBackward(stripped, q, mode, handles, strides, (doi, oi, li), fast)
    if fast and any(launch.prepared is None for launch in direct.launches):
        direct = _DirectBackward(stripped, q, mode, handles, strides, (doi, oi, li), False)
    return ks, direct
