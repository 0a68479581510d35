"""FP8 (e4m3) attention forward for inference: validation, dispatch and launch.

q, k and v in e4m3 with FlashAttention-3's descale factors (the real value is the fp8 value times
the factor of its sequence and key/value head); the output in bf16 or fp16. The kernel
(``attn_fwd_fp8``, builder/kernels/attention_fp8.py) folds ``q_descale * k_descale`` into the
softmax scale and ``v_descale`` into the output, and rounds the softmax probabilities to e4m3 for
the P·V product (docs/attention.md, "FP8"); on sm90 its Gluon stand-in ``attn_fwd_fp8_sm90``
computes the same where the images hold it. Every call runs the general path (no cached plan):
validate, choose the variant, pad what the kernel cannot read in place, launch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from ... import interop
from ...errors import ArgumentError, KernelNotFound, UnsupportedError
from ...tuning import Choice
from . import problem as _problem
from .arrays import Output, lse_output, operand
from .dispatch import KernelChoice, _causal_modes, kernels_of, tuned_config
from .family import (
    ARCH_FP8_FORWARDS,
    FP8_ARCH_DTYPES,
    FP8_DTYPES,
    FP8_HEAD_DIMS,
    FP8_OUT_DTYPES,
    FP8_V_TRANSPOSE,
    FWD_FP8,
    AttentionCall,
    bhs,
    forward_arguments,
    kernel_strides,
)
from .framework import arrays_for
from .problem import Problem, prepare, same_device

#: The environment variable that turns the arch's own FP8 forward (:data:`.family.ARCH_FP8_FORWARDS`)
#: off: "0" runs the portable ``attn_fwd_fp8`` instead (on by default: checked against the fp32
#: reference and under memcheck on Hopper, and 5-8% faster than the portable kernel there).
ARCH_FP8_SWITCH = "AOTRITON_RT_FP8_SM90"
#: torch's names of the e4m3 formats, for messages.
TORCH_NAMES = {"fp8e4nv": "float8_e4m3fn", "fp8e4b8": "float8_e4m3fnuz"}
_OUT_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}


def is_fp8(obj: Any) -> bool:
    """Whether ``obj`` looks like an fp8 array (its dtype's name says float8): a cheap test that
    routes a call here; the validation reads the exact dtype."""
    return "float8" in str(getattr(obj, "dtype", ""))


def out_dtype_of(out_dtype: Any) -> str:
    """The catalog name of ``out_dtype`` (None: bf16): "bf16"/"fp16", their torch or JAX dtypes, or
    the names "bfloat16"/"float16"."""
    if out_dtype is None:
        return "bf16"
    name = out_dtype if isinstance(out_dtype, str) else str(out_dtype).rsplit(".", 1)[-1]
    found = _OUT_NAMES.get(name)
    if found is None:
        raise ArgumentError(f"out_dtype must be bf16 or fp16 (FP8 attention writes one of them), got {out_dtype!r}")
    return found


def fp8_bucket(head_dim: int) -> int:
    """The compiled FP8 head dim that runs ``head_dim`` (zero-padded up to it)."""
    for b in FP8_HEAD_DIMS:
        if b >= head_dim:
            return b
    raise UnsupportedError(f"FP8 attention supports head dims up to {FP8_HEAD_DIMS[-1]}, got {head_dim}")


@dataclass(frozen=True)
class Descale:
    """One descale operand: a caller's fp32 array read in place, or a float (made a one-element
    array at launch), with the (batch, head) strides the kernel reads it with."""

    array: Any
    info: interop.ArrayInfo | None
    value: float
    strides: tuple[int, int]


def check_descale(value: Any, name: str, batch: int, heads_k: int) -> Descale:
    """``value`` as a :class:`Descale`: None (1.0), a finite Python float (one factor for the
    tensor), or an fp32 array of shape ``(batch, heads_k)`` (FlashAttention-3's)."""
    if value is None:
        return Descale(None, None, 1.0, (0, 0))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ArgumentError(f"{name} must be finite, got {value!r}")
        return Descale(None, None, float(value), (0, 0))
    try:
        info = _problem.describe(value, name)
    except (ArgumentError, UnsupportedError) as e:
        raise ArgumentError(f"{name} must be a float or an fp32 GPU array of shape ({batch}, {heads_k}); {e}") from None
    if info.dtype != "fp32":
        raise ArgumentError(f"{name} must be float32, got {info.dtype}; convert it, e.g. {name}.float()")
    if tuple(info.shape) != (batch, heads_k):
        raise ArgumentError(f"{name} must have shape ({batch}, {heads_k}) (batch, key/value heads), got "
                            f"{tuple(info.shape)}; pass a float for one factor per tensor")
    strides = tuple(0 if e <= 1 else s for e, s in zip(info.shape, info.strides))
    if min(strides) < 0:
        raise ArgumentError(f"{name} has negative strides {tuple(info.strides)}; pass {name}.contiguous()")
    return Descale(value, info, 1.0, strides)


def refuse_options(**given: Any) -> None:
    """UnsupportedError naming FP8 for options its kernel does not compute."""
    for name, value in given.items():
        if value is None or value is False or (name in ("dropout_p", "softcap") and value == 0):
            continue
        raise UnsupportedError(f"FP8 attention (fp8 q, k, v) does not take {name}=; it computes inference "
                               f"forwards with causal/window masks, GQA and varlen only")


def refuse_grad(*arrays: Any) -> None:
    """UnsupportedError when an input asks for a gradient: FP8 attention has no backward."""
    if any(getattr(a, "requires_grad", False) for a in arrays):
        raise UnsupportedError("FP8 attention is inference only (no backward): an input requires grad; "
                               "run it under torch.no_grad() or detach the inputs, or train in bf16/fp16")


def prepare_fp8(q: Any, k: Any, v: Any, *, causal: Any, window: Any, align: str, scale: Any, cu_seqlens_q: Any,
                cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any, layout: str, q_descale: Any,
                k_descale: Any, v_descale: Any) -> tuple[Problem, tuple[Descale, Descale, Descale]]:
    """The validated problem and its three descale operands."""
    p = prepare(q, k, v, causal=causal, window=window, align=align, bias=None, dropout_p=0.0, seed=None, offset=0,
                scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, layout=layout, fp8=True)
    descales = tuple(check_descale(d, n, p.batch, p.heads_k)
                     for d, n in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale")))
    same_device([("q", p.qi)] + [(n, d.info) for n, d in zip(("q_descale", "k_descale", "v_descale"), descales)
                                 if d.info is not None])
    return p, descales


def spec_of(p: Problem, out_dtype: str, mode: int) -> dict[str, Any]:
    width = fp8_bucket(max(p.head_dim, p.head_dim_v))
    return {"dtype": p.dtype, "out_dtype": out_dtype, "HEAD_DIM": width, "HEAD_DIM_V": width, "CAUSAL": mode,
            "VARLEN": int(p.varlen)}


def choose(ks: Any, call: AttentionCall, p_spec: dict[str, Any], arch: str) -> KernelChoice:
    """The FP8 forward's kernel and variant for a call (mask mode 2 before 1 for bottom-right
    calls, as the bf16 forward), or KernelNotFound naming the build that adds it.

    The arch's own FP8 forward (:data:`.family.ARCH_FP8_FORWARDS`, sm90's ``attn_fwd_fp8_sm90``)
    runs the spec where the images hold it, in the config its tuning rules name (the catalog's
    ``tuning["attn_fwd_fp8_sm90"]``, else #0), unless :data:`ARCH_FP8_SWITCH` is ``0`` in the
    environment; ``attn_fwd_fp8`` otherwise (packed sequences, head dim 256, other archs, images
    without it). Both take the same arguments and the same V^T (in the key order of the config)."""
    from ...select import remedy

    want = FP8_ARCH_DTYPES.get(arch)
    if want is None:
        raise UnsupportedError(f"FP8 attention runs on {', '.join(FP8_ARCH_DTYPES)}; this GPU is {arch}")
    if p_spec["dtype"] != want:
        got = TORCH_NAMES[p_spec["dtype"]]
        raise UnsupportedError(f"{arch} multiplies {TORCH_NAMES[want]}, but q, k, v are {got}; "
                               f"convert them (e.g. x.to(torch.{TORCH_NAMES[want]})) with their descale factors")
    own = ARCH_FP8_FORWARDS.get(arch)
    off = own is not None and os.environ.get(ARCH_FP8_SWITCH) == "0"
    if off:
        own = None
    candidates = [{**p_spec, "CAUSAL": m} for m in _causal_modes(call)]
    for c in candidates:
        args = ("causal_align",) if c["CAUSAL"] == 1 and call.causal == 2 and not call.causal_equivalent else ()
        if own is not None and ks.available(own, c, args):
            why = (f"{arch}'s own FP8 forward (Gluon: TMA, warp-specialised wgmma), preferred where the images hold "
                   "it for this spec")
            config, params = tuned_config(ks, call, own, own, c, arch)
            return KernelChoice(FWD_FP8, own, c, why, config, params)
        if ks.available(FWD_FP8, c, args):
            why = "the FP8 forward (fp8 q, k, v)"
            if off:
                why += f"; {arch}'s own FP8 forward is off ({ARCH_FP8_SWITCH}=0)"
            elif own is not None:
                why += f"; {arch}'s own FP8 forward is not in these images for this spec"
            return KernelChoice(FWD_FP8, FWD_FP8, c, why, Choice(FWD_FP8, 0), dict(c))
    spec = ", ".join(f"{k}={v}" for k, v in candidates[-1].items())
    raise KernelNotFound(f"FP8 attention needs {FWD_FP8} with {spec} on {arch}, which these images lack; "
                         f"{remedy(FWD_FP8, [arch])}")


def transpose_spec(chosen: KernelChoice, order: int = 0) -> dict[str, Any]:
    """The V^T pre-pass's spec for a chosen forward, whose variants read V^T's keys in ``order``
    (:func:`key_order`)."""
    spec = {"dtype": chosen.spec["dtype"], "HEAD_DIM": chosen.spec["HEAD_DIM_V"]}
    return {**spec, "KEY_ORDER": 1} if order else spec


def key_order(handle: Any) -> int:
    """The order in which the variants of a forward's ``handle`` read V^T's keys: 1 for sm90's
    Gluon forward (``KEY_ORDER=1``: attn_fp8_v_transpose's register order), 0 for the others and
    for variants without the parameter. A handle whose candidates disagree is refused (a lookup
    that does not name the config: see :func:`forward_handle`)."""
    orders = _orders(handle)
    if len(orders) > 1:
        raise KernelNotFound(f"{handle.name}: its variants read V^T in different key orders; name KEY_ORDER")
    return orders.pop() if orders else 0


def _orders(handle: Any) -> set[int]:
    """The V^T key orders of a handle's candidate variants (``KEY_ORDER``, 0 where absent)."""
    return {v.params.get("KEY_ORDER", 0) for v in getattr(handle, "candidates", ())}


def key_permutation(cols: int) -> list[int]:
    """The key each V^T column holds in ``KEY_ORDER=1`` (``cols`` a multiple of 32): within each
    group of 32, column ``16h + 4q + 2j + e`` holds key ``16h + 8j + 2q + e`` (the builder's
    ``wgmma_key_order``, for callers that transpose V themselves)."""
    return [(n & ~31) | (n & 17) | ((n & 12) >> 1) | ((n & 2) << 2) for n in range(cols)]


def forward_handle(ks: Any, chosen: KernelChoice) -> tuple[Any, int]:
    """The chosen FP8 forward's handle and the key order its V^T must have. A spec's configs may
    read V^T in different orders (the Gluon forward keeps one config in keys' order to compare):
    the handle is then pinned to the order of the config it launches (the lowest index)."""
    handle = ks.lib.kernel(chosen.kernel, **chosen.params)
    if len(_orders(handle)) > 1:
        first = min(handle.candidates, key=lambda v: v.config.index)
        handle = ks.lib.kernel(chosen.kernel, **chosen.params, KEY_ORDER=first.params["KEY_ORDER"])
    return handle, key_order(handle)


def transpose_handle(ks: Any, chosen: KernelChoice, arch: str, order: int = 0) -> Any:
    """The V^T pre-pass's handle for a forward reading V^T's keys in ``order`` (:func:`key_order`), or
    KernelNotFound naming the build that adds it."""
    from ...select import remedy

    spec = transpose_spec(chosen, order)
    if not ks.available(FP8_V_TRANSPOSE, spec, ()):
        raise KernelNotFound(f"FP8 attention needs {FP8_V_TRANSPOSE} with "
                             f"{', '.join(f'{k}={v}' for k, v in spec.items())} on {arch}, which these images lack; "
                             f"{remedy(FP8_V_TRANSPOSE, [arch])}")
    return ks.lib.kernel(FP8_V_TRANSPOSE, **spec)


def vt_shape(batch: int, heads_k: int, width: int, rows: int, varlen: bool) -> tuple[int, ...]:
    """V^T's shape: ``(B, Hkv, width, cols)``, or ``(Hkv, width, cols)`` for packed keys, with
    ``cols`` the key rows rounded up to 32 (the forward's 16-element stride promise, and whole
    groups of 32 keys for the Gluon forward's key order)."""
    cols = -(-max(rows, 1) // 32) * 32
    return (heads_k, width, cols) if varlen else (batch, heads_k, width, cols)


def forward(q: Any, k: Any, v: Any, *, causal: Any, window: Any, align: str, scale: Any, cu_seqlens_q: Any,
            cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any, layout: str, out: Any, lse: Any,
            q_descale: Any, k_descale: Any, v_descale: Any, out_dtype: Any, library: Any) -> tuple:
    """:func:`aotriton_rt.attention` on fp8 q, k, v: ``(out, lse)``."""
    from .problem import check_output

    refuse_grad(q, k, v, q_descale, k_descale, v_descale)
    od = out_dtype_of(out_dtype)
    p, descales = prepare_fp8(q, k, v, causal=causal, window=window, align=align, scale=scale,
                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                              max_seqlen_k=max_seqlen_k, layout=layout, q_descale=q_descale, k_descale=k_descale,
                              v_descale=v_descale)
    out_i = check_output(out, "out", p.out_shape(), od, p)
    lse_i = check_output(lse, "lse", p.lse_shape(), "fp32", p)
    ks = kernels_of(library)
    call = p.call(0)
    arch = ks.device_arch(max(p.device, 0))
    chosen = choose(ks, call, spec_of(p, od, p.causal_mode), arch)
    handle, order = forward_handle(ks, chosen)
    return _launch(p, handle, chosen.spec, od, descales, out, out_i, lse, lse_i,
                   transpose_handle(ks, chosen, arch, order))


def _launch(p: Problem, handle: Any, spec: dict[str, Any], od: str, descales: tuple, out: Any, out_i: Any,
            lse: Any, lse_i: Any, transpose: Any) -> tuple:
    xp = arrays_for(p.qi.framework)
    q, k, v = xp.convert(p.q, p.qi), xp.convert(p.k, p.ki), xp.convert(p.v, p.vi)
    width = spec["HEAD_DIM"]
    o = Output(xp, p.out_shape(), od, q, p.layout, p.varlen, width, out, out_i)
    lse_out = lse_output(xp, p, q, lse, lse_i)
    if p.batch == 0 or p.heads_q == 0 or p.rows_q == 0 or p.seqlen_q == 0:
        return o.finish(), lse_out.finish()
    if p.rows_k == 0 or p.seqlen_k == 0:
        o.array[...] = 0
        lse_out.array[...] = float("-inf")
        return o.finish(), lse_out.finish()
    qo = operand(xp, q, p.qi, p.layout, p.varlen, width)
    ko = operand(xp, k, p.ki, p.layout, p.varlen, width)
    vt, vt_strides = _transposed_v(xp, p, v, width, transpose)
    arrays = {"q": qo.array, "k": ko.array, "v": vt, "out": o.array, "lse": lse_out.array}
    strides = {"q": qo.strides, "k": ko.strides, "v": vt_strides, "out": o.strides}
    for name, d in zip(("q_descale", "k_descale", "v_descale"), descales):
        arrays[name] = xp.convert(d.array, d.info) if d.info is not None else xp.full((1,), d.value, "fp32", q)
        strides[name] = d.strides
    if p.varlen:
        arrays["cu_seqlens_q"] = xp.convert(p.cu_q, p.cu_qi)
        arrays["cu_seqlens_k"] = xp.convert(p.cu_k, p.cu_ki)
    values = forward_arguments(arrays, strides, lse_out.strides, p.scalars())
    values["stride_vd"] = vt_strides[2]
    handle(*[values[name] for name in handle.arg_names])
    return o.finish(), lse_out.finish()


def _transposed_v(xp: Any, p: Problem, v: Any, width: int, transpose: Any) -> tuple[Any, tuple[int, int, int]]:
    """V^T for the forward (:func:`vt_shape`, fresh and contiguous) and its (batch, head, dim)
    strides, written by the pre-pass from V read in place (or, for a head dim below the bucket or
    misaligned rows, its zero-padded copy: the pre-pass reads 16-byte aligned rows)."""
    vo = operand(xp, v, p.vi, p.layout, p.varlen, width)
    (batch, heads, rows), _ = bhs(p.vi.shape, p.vi.strides, p.layout, p.varlen)
    shape = vt_shape(p.batch, p.heads_k, width, rows, p.varlen)
    vt = xp.empty(shape, p.dtype, v)
    full = (1,) + shape if p.varlen else shape
    cs = (full[1] * full[2] * full[3], full[2] * full[3], full[3])
    strides = kernel_strides((full[0], full[1], full[2]), cs)
    values = {"V": vo.array, "VT": vt, "stride_vz": vo.strides[0], "stride_vh": vo.strides[1],
              "stride_vn": vo.strides[2], "stride_tz": strides[0], "stride_th": strides[1], "stride_td": strides[2],
              "batch": batch, "heads": heads, "rows": rows, "cols": full[3]}
    transpose(*[values[name] for name in transpose.arg_names])
    return vt, strides


def explain_choice(ks: Any, call: AttentionCall, out_dtype: str, arch: str) -> KernelChoice:
    """What :func:`choose` picks for a call of these facts on ``arch`` (``call.dtype`` an fp8 name)."""
    width = fp8_bucket(max(call.head_dim, call.head_dim_v))
    spec = {"dtype": call.dtype, "out_dtype": out_dtype, "HEAD_DIM": width, "HEAD_DIM_V": width,
            "CAUSAL": call.causal, "VARLEN": int(call.varlen)}
    return choose(ks, call, spec, arch)


__all__ = ["FP8_DTYPES", "FP8_OUT_DTYPES", "FP8_V_TRANSPOSE", "check_descale", "forward", "forward_handle",
           "is_fp8", "key_order", "key_permutation", "out_dtype_of", "transpose_spec"]
