"""Attention for torch: ``torch.library`` custom ops with fake implementations, and autograd.

Importing this module imports torch and registers three operators, ``aotriton_rt::attention_fwd``,
``aotriton_rt::attention_bwd`` and ``aotriton_rt::attention_fp8_fwd`` (``torch.ops.aotriton_rt.*``;
the last, FP8 inference, has no autograd formula), with shape-only fake
implementations (so they trace under ``torch.compile`` and ``FakeTensorMode``) and an autograd
formula (so ``loss.backward()`` works). :func:`attention` is the entry point::

    from aotriton_rt.ops.torch import attention
    out = attention(q, k, v, causal=True, dropout_p=0.1)     # q, k, v: (B, H, S, D) CUDA tensors
    out.sum().backward()

Dropout without a ``seed`` draws from torch's generator of the tensors' device the way torch's
own dropout does: the generator's seed, and its Philox offset advanced by 4 per call. So
``torch.manual_seed(s)`` makes the masks reproducible, successive calls get fresh masks, and
the backward replays the forward's mask (the pair is saved for it).

A call on plain tensors, with no dispatch/function mode active and no compiler tracing, skips the
op dispatcher: with nothing for autograd to record (no input needs a gradient, or grad mode is
off) it runs the operator's plan directly, else an ``autograd.Function`` around the same forward
and backward plans records the graph node. Same kernels and results, without the dispatcher's
per-call cost (several times a small attention's launches); ``torch.compile``, fake tensors and
subclasses go through the custom ops.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from ..errors import ArgumentError
from ..library import live_library
from . import attention as _core
from .attention import backward_plan as _core_backward_plan
from .attention import plan as _core_plan
from .attention import sinks as _core_sinks

__all__ = ["attention", "attention_bwd", "attention_fp8_fwd", "attention_fwd", "register_library"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

#: Library objects that are not Libraries, by the key :func:`register_library` gave them (kept
#: for the process: a traced graph may call with the key at any time).
_LIBRARIES: dict[int, Any] = {0: None}
#: Keys for those objects, from a range no Library's ``op_key`` reaches.
_OP_KEYS = itertools.count(1 << 62)
_I64 = 2**63
_OFFSET_STEP = 4  # torch advances its Philox offset in multiples of 4 (one 128-bit draw)


def _library_key(library: Any) -> int:
    # Operators take only tensors and scalars: a library travels as an integer key, a Library's
    # own ``op_key`` (found again through aotriton_rt.library.live_library, also from code
    # torch.compile traced). Other library objects (wrappers, test doubles) get a key when an
    # eager call (or register_library) registers them; nothing is registered while torch.compile
    # traces (a traced registration would be a side effect replayed after the graph).
    if library is None:
        return 0
    key = _own_key(library)
    if key is not None:
        return key
    if _compiling():
        key = _foreign_key(library)
        if key is None:
            raise ArgumentError("the library passed to aotriton_rt's torch ops is neither an aotriton_rt.Library "
                                "nor registered: call aotriton_rt.ops.torch.register_library(library) before "
                                "torch.compile first traces a call with it")
        return key
    return register_library(library)


def _own_key(library: Any) -> int | None:
    """A Library's own ``op_key`` (None for other objects, a copy of a Library included)."""
    key = getattr(library, "op_key", None)
    return key if type(key) is int and live_library(key) is library else None


def register_library(library: Any) -> int:
    """Make a library object that is not an :class:`aotriton_rt.Library` (a wrapper, a test
    double) usable by the ops from code torch.compile traces; returns its key (a serial number).
    Libraries need nothing: each carries its own key."""
    key = _own_key(library)
    if key is not None:
        return key
    key = _foreign_key(library)
    if key is None:
        key = next(_OP_KEYS)
        _LIBRARIES[key] = library
    return key


def _foreign_key(library: Any) -> int | None:
    """The key :func:`register_library` gave this very object (by identity: a wrapper may define
    ``==`` or no hash), or None."""
    for key, known in list(_LIBRARIES.items()):
        if known is library and key:
            return key
    return None


def _library(key: int) -> Any:
    if key in _LIBRARIES:
        return _LIBRARIES[key]
    found = live_library(key)
    if found is None:
        raise ArgumentError("the library passed to aotriton_rt's torch ops is neither an aotriton_rt.Library nor "
                            "registered: call aotriton_rt.ops.torch.register_library(library) before torch.compile "
                            "first traces a call with it")
    return found


def _signed(u64: int) -> int:
    # Schema ints are int64; Philox seeds and offsets are u64, carried as their two's complement.
    return u64 - 2**64 if u64 >= _I64 else u64


def _unsigned(i64: int) -> int:
    return i64 + 2**64 if i64 < 0 else i64


def _window(window_left: int, window_right: int) -> tuple[int, int] | None:
    return None if window_left == -1 and window_right == -1 else (window_left, window_right)


@torch.library.custom_op("aotriton_rt::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor | None,
                  cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                  causal: bool, window_left: int, window_right: int, align: str, dropout_p: float, seed: int,
                  offset: int, scale: float, layout: str, return_mask: bool, deterministic: bool, library: int,
                  softcap: float = 0.0, alibi_slopes: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Forward: (out, lse, mask); mask is an empty int8 tensor unless ``return_mask``; ``softcap``
    0.0 for none; ``alibi_slopes`` None for none (no gradient flows to them).

    ``max_seqlen_*`` are -1 without cu_seqlens, ``window_*`` -1 for an unbounded side;
    ``deterministic`` only travels to the backward.
    """
    varlen = cu_seqlens_q is not None
    result = _core.attention(
        q, k, v, causal=causal, window=_window(window_left, window_right), align=align, bias=bias,
        dropout_p=dropout_p, seed=_unsigned(seed), offset=_unsigned(offset), scale=scale,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q if varlen else None,
        max_seqlen_k=max_seqlen_k if varlen else None, layout=layout, return_mask=return_mask, sinks=sinks,
        softcap=softcap or None, alibi_slopes=alibi_slopes, library=_library(library))
    if return_mask:
        return result
    out, lse = result
    return out, lse, q.new_empty((0,), dtype=torch.int8)


def _lse_shape(q: Tensor, layout: str, varlen: bool) -> tuple[int, ...]:
    if varlen:
        return (q.shape[1], q.shape[0])
    if layout == "bhsd":
        return (q.shape[0], q.shape[1], q.shape[2])
    return (q.shape[0], q.shape[2], q.shape[1])


def _seqlen(t: Tensor, layout: str) -> int:
    return t.shape[2] if layout == "bhsd" else t.shape[1]


@attention_fwd.register_fake
def _attention_fwd_fake(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor | None,
                        cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                        causal: bool, window_left: int, window_right: int, align: str, dropout_p: float, seed: int,
                        offset: int, scale: float, layout: str, return_mask: bool, deterministic: bool, library: int,
                        softcap: float = 0.0, alibi_slopes: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    varlen = cu_seqlens_q is not None
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(_lse_shape(q, layout, varlen), dtype=torch.float32)
    if not return_mask:
        mask = q.new_empty((0,), dtype=torch.int8)
    elif varlen:
        mask = q.new_empty((cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q, max_seqlen_k), dtype=torch.int8)
    else:
        mask = q.new_empty((q.shape[0], lse.shape[1], _seqlen(q, layout), _seqlen(k, layout)), dtype=torch.int8)
    return out, lse, mask


@torch.library.custom_op("aotriton_rt::attention_fp8_fwd", mutates_args=())
def attention_fp8_fwd(q: Tensor, k: Tensor, v: Tensor, q_descale: Tensor | None, k_descale: Tensor | None,
                      v_descale: Tensor | None, q_scale: float, k_scale: float, v_scale: float,
                      cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                      causal: bool, window_left: int, window_right: int, align: str, scale: float, layout: str,
                      out_dtype: str, library: int) -> tuple[Tensor, Tensor]:
    """FP8 forward (inference, no autograd formula): (out, lse). A descale tensor None stands for
    its float ``*_scale`` (one factor per tensor)."""
    varlen = cu_seqlens_q is not None
    return _core.attention(
        q, k, v, causal=causal, window=_window(window_left, window_right), align=align, scale=scale,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q if varlen else None,
        max_seqlen_k=max_seqlen_k if varlen else None, layout=layout,
        q_descale=q_scale if q_descale is None else q_descale, k_descale=k_scale if k_descale is None else k_descale,
        v_descale=v_scale if v_descale is None else v_descale, out_dtype=out_dtype, library=_library(library))


@attention_fp8_fwd.register_fake
def _attention_fp8_fwd_fake(q: Tensor, k: Tensor, v: Tensor, q_descale: Tensor | None, k_descale: Tensor | None,
                            v_descale: Tensor | None, q_scale: float, k_scale: float, v_scale: float,
                            cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int,
                            max_seqlen_k: int, causal: bool, window_left: int, window_right: int, align: str,
                            scale: float, layout: str, out_dtype: str, library: int) -> tuple[Tensor, Tensor]:
    dtype = torch.float16 if out_dtype == "fp16" else torch.bfloat16
    out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=dtype)
    return out, q.new_empty(_lse_shape(q, layout, cu_seqlens_q is not None), dtype=torch.float32)


def _attention_fp8(q: Tensor, k: Tensor, v: Tensor, descales: tuple, out_dtype: Any, cu_q: Tensor | None,
                   cu_k: Tensor | None, max_q: int | None, max_k: int | None, causal: bool, left: int, right: int,
                   align: str, scale: float, layout: str, library: Any) -> tuple[Tensor, Tensor]:
    """:func:`attention` on fp8 q, k, v: the operator directly, or the inference custom op under
    a compiler or a mode."""
    from .attention import fp8 as _fp8

    _fp8.refuse_grad(q, k, v, *descales)
    od = _fp8.out_dtype_of(out_dtype)
    if _eager(q, k, v, cu_q, cu_k, *(d for d in descales if isinstance(d, Tensor))) != _OP:
        return _core.attention(q, k, v, causal=causal, window=_window(left, right), align=align, scale=scale,
                               cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                               layout=layout, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                               out_dtype=od, library=library)
    tensors = [d if isinstance(d, Tensor) else None for d in descales]
    floats = [1.0 if d is None or isinstance(d, Tensor) else float(d) for d in descales]
    return attention_fp8_fwd(q, k, v, *tensors, *floats, cu_q, cu_k, -1 if max_q is None else max_q,
                             -1 if max_k is None else max_k, causal, left, right, align, float(scale), layout, od,
                             _library_key(library))


@torch.library.custom_op("aotriton_rt::attention_bwd", mutates_args=())
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, bias: Tensor | None,
                  sinks: Tensor | None, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int,
                  max_seqlen_k: int, causal: bool, window_left: int, window_right: int, align: str, dropout_p: float,
                  seed: int, offset: int, scale: float, layout: str, deterministic: bool, bias_grad: bool,
                  library: int, softcap: float = 0.0, alibi_slopes: Tensor | None = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward: (dq, dk, dv, dbias, dsinks); dbias is an empty tensor without a bias or
    ``bias_grad``, dsinks one without sinks."""
    varlen = cu_seqlens_q is not None
    grads = _core.attention_backward(
        dout, q, k, v, out, lse, causal=causal, window=_window(window_left, window_right), align=align, bias=bias,
        dropout_p=dropout_p, seed=_unsigned(seed), offset=_unsigned(offset), scale=scale,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q if varlen else None,
        max_seqlen_k=max_seqlen_k if varlen else None, layout=layout, deterministic=deterministic,
        bias_grad=bias_grad, sinks=sinks, softcap=softcap or None, alibi_slopes=alibi_slopes,
        library=_library(library))
    dq, dk, dv, dbias = grads[:4]
    if dbias is None:
        dbias = q.new_empty((0,))
    return dq, dk, dv, dbias, grads[4] if sinks is not None else q.new_empty((0,))


@attention_bwd.register_fake
def _attention_bwd_fake(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, bias: Tensor | None,
                        sinks: Tensor | None, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                        max_seqlen_q: int, max_seqlen_k: int, causal: bool, window_left: int, window_right: int,
                        align: str, dropout_p: float, seed: int, offset: int, scale: float, layout: str,
                        deterministic: bool, bias_grad: bool, library: int, softcap: float = 0.0,
                        alibi_slopes: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    dbias = bias.new_empty(bias.shape) if bias is not None and bias_grad else q.new_empty((0,))
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias, dsinks


_FWD_OPTIONS = ("max_seqlen_q", "max_seqlen_k", "causal", "window_left", "window_right", "align", "dropout_p",
                "seed", "offset", "scale", "layout", "return_mask", "deterministic", "library", "softcap")


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, bias, sinks, cu_q, cu_k, *options, alibi = inputs
    out, lse, mask = output
    ctx.save_for_backward(q, k, v, bias, sinks, cu_q, cu_k, out, lse, alibi)
    ctx.options = dict(zip(_FWD_OPTIONS, options, strict=True))
    ctx.mark_non_differentiable(lse, mask)
    ctx.set_materialize_grads(False)  # see _EagerAttention.forward


def _backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None, dmask: Tensor | None) -> tuple:
    if dout is None:
        return (None,) * (8 + len(_FWD_OPTIONS))
    q, k, v, bias, sinks, cu_q, cu_k, out, lse, alibi = ctx.saved_tensors
    o = ctx.options
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias, dsinks = attention_bwd(
        dout, q, k, v, out, lse, bias, sinks, cu_q, cu_k, o["max_seqlen_q"], o["max_seqlen_k"], o["causal"],
        o["window_left"], o["window_right"], o["align"], o["dropout_p"], o["seed"], o["offset"], o["scale"],
        o["layout"], o["deterministic"], bias_grad, o["library"], o["softcap"], alibi)
    sinks_grad = sinks is not None and ctx.needs_input_grad[4]
    # No gradient for cu_seqlens, the options and the ALiBi slopes (a constant, as in FlashAttention-2).
    return (dq, dk, dv, dbias if bias_grad else None, dsinks if sinks_grad else None) + \
        (None,) * (3 + len(_FWD_OPTIONS))


torch.library.register_autograd("aotriton_rt::attention_fwd", _backward, setup_context=_setup_context)


def _dropout_state(device: torch.device) -> tuple[int, int]:
    """(seed, offset) from torch's generator of ``device``, advancing its Philox offset."""
    if device.type == "cuda":
        gen = torch.cuda.default_generators[device.index if device.index is not None else
                                            torch.cuda.current_device()]
        try:
            offset = gen.get_offset()
            gen.set_offset(offset + _OFFSET_STEP)
            return gen.initial_seed() % 2**64, offset
        except RuntimeError:
            pass  # a generator that cannot report its offset (e.g. while capturing): draw a seed
    # Generators without a Philox offset (CPU): a fresh seed drawn from torch's default one.
    return int(torch.randint(0, _I64 - 1, (), dtype=torch.int64).item()), 0


_Tensor = torch.Tensor
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling


#: What :func:`_eager` finds: run the plan directly (no gradient to record), run it under
#: :class:`_EagerAttention` (eager autograd), or go through the custom op.
_DIRECT, _AUTOGRAD, _OP = 0, 1, 2


def _eager(*tensors: Any) -> int:
    """How a call may skip the dispatcher: plain tensors (no subclass, e.g. fake or functional) and
    no dispatch or function mode nor a compiler tracing, with (``_AUTOGRAD``) or without
    (``_DIRECT``) a gradient to record; anything else (``_OP``) takes the custom op."""
    grad = False
    for t in tensors:
        if t is not None:
            if type(t) is not _Tensor:
                return _OP
            grad = grad or t.requires_grad
    if _compiling() or _dispatch_modes() or _function_modes():  # is_compiling first: dynamo folds it
        return _OP
    return _AUTOGRAD if grad and _grad_enabled() else _DIRECT


def _forward_plan(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor | None, cu_q: Tensor | None,
                  cu_k: Tensor | None, alibi: Tensor | None, o: dict) -> tuple:
    """(plan key, result) of the operator's forward for the options :func:`attention` gathered
    (no dispatcher); with ``sinks``, the sinks' result (fresh outputs)."""
    key, result = _core_plan.forward_keyed(q, k, v, o["causal"], o["window"], o["align"], bias, o["dropout_p"],
                                           o["seed"], o["offset"], o["scale"], cu_q, cu_k, o["max_seqlen_q"],
                                           o["max_seqlen_k"], o["layout"], None, None, o["return_mask"], o["library"],
                                           o["softcap"], alibi, sinks)
    return key, result


class _EagerAttention(torch.autograd.Function):
    """The custom op's forward and backward for eager autograd, without the dispatcher.

    ``torch.library`` ops pay for schema parsing and dispatch twice per training step (forward
    and backward op), several times the cost of a small attention's launches; an
    ``autograd.Function`` records the same graph node. ``torch.compile`` and subclasses still
    see the custom op.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor | None,
                cu_q: Tensor | None, cu_k: Tensor | None, alibi: Tensor | None, options: dict) -> tuple:
        key, result = _forward_plan(q, k, v, bias, sinks, cu_q, cu_k, alibi, options)
        out, lse = result[:2]
        ctx.save_for_backward(q, k, v, bias, sinks, cu_q, cu_k, out, lse, alibi)
        ctx.options = options
        ctx.forward_key = key  # the backward finds its plan from it (backward_plan.backward_after)
        ctx.mark_non_differentiable(*result[1:])
        # The backward reads only ``out``'s gradient: without this, autograd fills a zeros tensor
        # (an allocation and a kernel) for the lse (and mask) it hands to every backward call.
        ctx.set_materialize_grads(False)
        return tuple(result)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: Tensor | None, *unused: Any) -> tuple:
        if dout is None:
            return (None,) * 9
        q, k, v, bias, sinks, cu_q, cu_k, out, lse, alibi = ctx.saved_tensors
        o = ctx.options
        bias_grad = bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias = _core_backward_plan.backward_after(
            ctx.forward_key, dout, q, k, v, out, lse, deterministic=o["deterministic"], bias_grad=bias_grad,
            library=o["library"], causal=o["causal"], window=o["window"], align=o["align"], bias=bias,
            dropout_p=o["dropout_p"], seed=o["seed"], offset=o["offset"], scale=o["scale"], cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k, max_seqlen_q=o["max_seqlen_q"], max_seqlen_k=o["max_seqlen_k"], layout=o["layout"],
            softcap=o["softcap"] or None, alibi_slopes=alibi)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            dsinks = _core_sinks.sinks_grad(dout, out, lse, sinks, heads_q=_core_sinks.lse_heads(lse, cu_q is not None),
                                            layout=o["layout"], cu_seqlens_q=cu_q, max_seqlen_q=o["max_seqlen_q"],
                                            library=o["library"])
        return dq, dk, dv, dbias if bias_grad else None, dsinks, None, None, None, None


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, window: tuple[int, int] | None = None,
              align: str = "top_left", bias: Tensor | None = None, dropout_p: float = 0.0, seed: int | None = None,
              offset: int | None = None, scale: float | None = None, cu_seqlens_q: Tensor | None = None,
              cu_seqlens_k: Tensor | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
              layout: str = "bhsd", deterministic: bool = False, return_lse: bool = False,
              return_mask: bool = False, sinks: Tensor | None = None, softcap: float | None = None,
              alibi_slopes: Tensor | None = None, q_descale: Tensor | float | None = None,
              k_descale: Tensor | float | None = None, v_descale: Tensor | float | None = None,
              out_dtype: Any = None, library: Any = None) -> Tensor | tuple[Tensor, ...]:
    """Differentiable attention on torch tensors (works under ``torch.compile``).

    Options as :func:`aotriton_rt.ops.attention.attention`; gradients flow to q, k, v, bias
    and ``sinks`` (attention sinks: one logit per query head, see there). ``softcap``: the
    logit softcap (gradients included). ``alibi_slopes``: ALiBi's fp32 slopes, ``(Hq,)`` or
    ``(B, Hq)`` (a constant: no gradient flows to them, as in FlashAttention-2). ``seed``/``offset``:
    the dropout Philox pair, drawn from torch's generator when ``seed`` is None.
    ``deterministic=True`` (or ``torch.use_deterministic_algorithms(True)``): the backward runs
    the bit-reproducible scheme. FP8 q, k, v
    (``q_descale``/``k_descale``/``v_descale``, ``out_dtype``: see there) run the FP8 inference
    forward: no gradient (an input that requires one is refused), no bias, dropout, sinks,
    softcap or ALiBi.

    Returns:
        ``out``; ``(out, lse)`` with ``return_lse``; the dropout keep-mask appended with
        ``return_mask``.

    Example::

        out = attention(q, k, v, causal=True)
        out.float().pow(2).mean().backward()
    """
    if dropout_p and seed is None:
        seed, drawn = _dropout_state(q.device)
        offset = drawn if offset is None else offset
    seed = 0 if seed is None else seed
    offset = 0 if offset is None else offset
    if cu_seqlens_q is not None and cu_seqlens_k is not None:
        # The schema needs the lengths as numbers (fake tensors have no values to read).
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if len(cu_seqlens_q) > 1 else 0
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item()) if len(cu_seqlens_k) > 1 else 0
    if window is not None and not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise ArgumentError(f"window must be (left, right), two integers >= -1 (-1: unbounded), got {window!r}")
    left, right = window if window is not None else (-1, -1)
    if not 0 <= seed < 2**64 or not 0 <= offset < 2**64:
        raise ArgumentError(f"seed and offset must be in [0, 2**64), got seed={seed}, offset={offset}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    # torch.use_deterministic_algorithms(True) asks every op for reproducible results: the backward
    # then keeps the split scheme, whatever a tuning rule says (the atomic one sums dQ in the order
    # its additions land).
    if not deterministic and torch.are_deterministic_algorithms_enabled():
        deterministic = True
    if q.dtype in _FP8 or q_descale is not None or k_descale is not None or v_descale is not None or \
            out_dtype is not None:
        from .attention import fp8 as _fp8

        if q.dtype not in _FP8:
            raise ArgumentError(f"q_descale, k_descale, v_descale and out_dtype apply to FP8 attention (e4m3 q, k, v); "
                                f"q has dtype {q.dtype}")
        _fp8.refuse_options(bias=bias, dropout_p=dropout_p, return_mask=return_mask, sinks=sinks, softcap=softcap,
                            alibi_slopes=alibi_slopes)
        out, lse = _attention_fp8(q, k, v, (q_descale, k_descale, v_descale), out_dtype, cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, causal, left, right, align, float(scale), layout,
                                  library)
        return (out, lse) if return_lse else out
    route = _eager(q, k, v, bias, sinks, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    if route != _OP and type(causal) is bool and type(return_mask) is bool and type(deterministic) is bool:
        # No mode or compiler watching: the op's own body directly (the same plans; the
        # dispatcher round trip costs more than the whole launch), under an autograd.Function
        # when a gradient is to be recorded.
        varlen = cu_seqlens_q is not None
        options = {"causal": causal, "window": _window(left, right), "align": align, "dropout_p": float(dropout_p),
                   "seed": seed, "offset": offset, "scale": float(scale),
                   "max_seqlen_q": max_seqlen_q if varlen else None, "max_seqlen_k": max_seqlen_k if varlen else None,
                   "layout": layout, "return_mask": return_mask, "deterministic": deterministic, "library": library,
                   "softcap": float(softcap or 0.0)}
        if route == _AUTOGRAD:
            result = _EagerAttention.apply(q, k, v, bias, sinks, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options)
        else:
            result = _forward_plan(q, k, v, bias, sinks, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options)[1]
        out, lse = result[:2]
        mask = result[2] if return_mask else None
    else:
        out, lse, mask = attention_fwd(
            q, k, v, bias, sinks, cu_seqlens_q, cu_seqlens_k, -1 if max_seqlen_q is None else max_seqlen_q,
            -1 if max_seqlen_k is None else max_seqlen_k, causal, left, right, align, float(dropout_p), _signed(seed),
            _signed(offset), float(scale), layout, return_mask, deterministic, _library_key(library),
            float(softcap or 0.0), alibi_slopes)
    result: tuple = (out,)
    if return_lse:
        result += (lse,)
    if return_mask:
        result += (mask,)
    return result[0] if len(result) == 1 else result
