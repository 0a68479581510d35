"""The attention operator: FlashAttention-2 forward and backward on any framework's GPU arrays.

Inputs may be torch tensors, CuPy arrays, JAX arrays or any ``__cuda_array_interface__`` /
DLPack object; they are read in place (zero copy) whenever the kernels can address them.
Everything is validated before anything is allocated or launched, and every refusal names
the offending argument, its value and what is supported.

Example::

    out, lse = aotriton_rt.attention(q, k, v, causal=True)            # (B, H, S, D) torch tensors
    dq, dk, dv, _ = aotriton_rt.attention_backward(dout, q, k, v, out, lse, causal=True)

**Layouts.** ``layout="bhsd"`` (default) takes ``(batch, heads, seqlen, head_dim)``,
``layout="bshd"`` takes ``(batch, seqlen, heads, head_dim)``; any strides work as long as the
head dimension is contiguous (otherwise, or when a stride is not a multiple of 16 elements, the
operand is copied once into a padded contiguous buffer). Variable-length batches
(``cu_seqlens_q``/``cu_seqlens_k``, int32 prefix sums on the device) take packed
``(total, heads, head_dim)`` arrays; ``max_seqlen_q``/``max_seqlen_k`` default to the longest
sequence, which costs a device synchronisation to read.

**Outputs** are allocated in the framework of ``q`` for torch and CuPy, contiguous in the
caller's layout. Inputs of other frameworks (JAX, plain DLPack or CAI producers) get torch
tensors back, or CuPy arrays when torch is not installed: wrap them with
``jax.dlpack.from_dlpack`` (zero copy), or pass preallocated ``out=`` / ``lse=`` arrays.

**Masks.** ``causal=True`` hides keys after the query; ``window=(left, right)`` keeps keys with
``i + diag - left <= j <= i + diag + right`` (-1: unbounded side); ``align`` places the diagonal
when ``seqlen_q != seqlen_k``: ``"top_left"`` (``diag = 0``, torch SDPA's ``is_causal``) or
``"bottom_right"`` (``diag = seqlen_k - seqlen_q``, FlashAttention-2). Rows that see no key
output 0 and logsumexp ``-inf``.

**Bias** is additive, broadcastable (numpy rules) to ``(batch, heads_q, seqlen_q, seqlen_k)`` in
that order whatever the layout (varlen: ``(batch, heads_q, max_seqlen_q, max_seqlen_k)``, local
positions); broadcast dimensions are read with stride 0. The backward returns its gradient in
the bias's own shape, summed over the broadcast dimensions.

**Dropout** uses counter-based Philox: one ``(seed, offset)`` pair is one mask, the same in the
forward and the backward, reproducible across runs; ``return_mask=True`` also returns the
applied keep-mask (int8, 1 = kept; 0 outside the visible band).

**Dispatch.** The kernel variant follows from the call: dtype, head-dim bucket (the smallest of
16 32 48 64 80 96 128 160 192 224 256 512 that holds the head dim; narrower dims are zero-padded and
sliced back; q·k / v pairs 192/128 run unequal, other unequal pairs on the larger bucket), mask
mode, bias, dropout, varlen, softcap and ALiBi. The tuning config comes from the catalog's ``tuning`` table when
it has rules for the kernel (see :func:`select_config`), else config 0; :func:`explain` says which
variant and config a call runs and why (tuned by which rule, or untuned). The backward runs the
split scheme (preprocess, dk/dv, dq: bit-reproducible, and the faster one on the H200) unless
``scheme="atomic"`` or a catalog tuning rule asks for atomic dQ, or the images hold only that.

**How a call runs** (read :mod:`.plan` first; the backward's plans are :mod:`.backward_plan`):
the call's signature (shapes, strides, dtypes, device, alignment, options) finds a plan, built
once per signature: :mod:`.problem` validates, :mod:`.dispatch` chooses the kernels (tuning
rules: :mod:`aotriton_rt.tuning`), and the plan fixes every argument but the addresses.
:mod:`.family` says which kernels exist and names their arguments for every caller. Later calls
allocate the outputs and launch. :mod:`.launch` is the general path for calls that need copies
or padding; :mod:`.arrays` allocates and copies.
"""

from __future__ import annotations

from typing import Any

from ... import interop
from ...errors import ArgumentError
from ...tuning import select_config, select_mode
from . import backward_plan as _backward_plan
from . import express as _express
from . import fp8 as _fp8
from . import plan as _plan
from . import sinks as _sinks
from .dispatch import backward_params, config_params, forward_params
from .explain import Explanation, KernelPick, explain
from .family import DTYPES, HEAD_DIM_BUCKETS, UNEQUAL_HEAD_DIMS, AttentionCall, bucket, head_dim_buckets

__all__ = [
    "AttentionCall",
    "DTYPES",
    "Explanation",
    "HEAD_DIM_BUCKETS",
    "UNEQUAL_HEAD_DIMS",
    "attention",
    "attention_backward",
    "attention_kernels",
    "backward_params",
    "bucket",
    "config_params",
    "explain",
    "forward_params",
    "head_dim_buckets",
    "KernelPick",
    "select_config",
    "select_mode",
]


def attention(q: Any, k: Any, v: Any, *, causal: bool = False, window: tuple[int, int] | None = None,
              align: str = "top_left", bias: Any = None, dropout_p: float = 0.0, seed: int | None = None,
              offset: int = 0, scale: float | None = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, layout: str = "bhsd",
              out: Any = None, lse: Any = None, return_mask: bool = False, sinks: Any = None,
              softcap: float | None = None, alibi_slopes: Any = None, q_descale: Any = None, k_descale: Any = None,
              v_descale: Any = None, out_dtype: Any = None, library: Any = None) -> tuple:
    """Scaled dot-product attention forward: ``softmax(q kᵀ · scale + bias, masked) v`` and its logsumexp.

    Arguments:
        q, k, v: GPU arrays of one dtype (fp16, bf16, fp32, or e4m3 for FP8 inference: see
            ``q_descale``), ``(B, H, S, D)`` for
            ``layout="bhsd"``, ``(B, S, H, D)`` for ``"bshd"``, or packed ``(total, H, D)`` with
            ``cu_seqlens_*``. k/v may have fewer heads than q (GQA/MQA: a divisor); v's head dim
            may differ from q's. Head dims 1..512 (257..512: fp16/bf16 on sm90, gfx90a, gfx942 and
            gfx950 only; UnsupportedError elsewhere).
        causal: hide keys right of the diagonal (see ``align``).
        window: ``(left, right)`` sliding window around the diagonal; -1 leaves a side unbounded.
        align: ``"top_left"`` or ``"bottom_right"``: where the diagonal lies when the query and key
            lengths differ.
        bias: additive, broadcastable to ``(B, Hq, Sq, Sk)``.
        dropout_p, seed, offset: dropout probability in [0, 1) and its Philox ``(seed, offset)``;
            the backward needs the same pair.
        scale: multiplies ``q kᵀ``; default ``1/sqrt(head_dim)``.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: variable-length batches.
        layout: ``"bhsd"`` or ``"bshd"`` (ignored for packed varlen arrays).
        out, lse: preallocated outputs (else allocated, see the module docs).
        return_mask: also return the dropout keep-mask (testing).
        sinks: attention sinks (gpt-oss's ``s_aux``): one logit per query head, a float GPU
            vector ``(Hq,)``, joining every row's softmax without a value. ``out`` and ``lse``
            are then the sink's (a row that sees no key outputs 0 and has ``lse`` = its sink).
        softcap: logit softcap (Gemma 2): scores become ``softcap * tanh(scores / softcap)``
            (after ``scale``, before the bias and the masks); None or 0: none; the backward takes
            the same value.
        alibi_slopes: ALiBi (FlashAttention-2's ``alibi_slopes``): fp32 GPU array ``(Hq,)`` or
            ``(B, Hq)`` (per sequence); each score gets ``-slope[b, h] * |i + Sk - Sq - j|`` after
            ``scale`` (queries and keys aligned bottom-right, per sequence under varlen, whatever
            ``align`` says of the mask). Not with ``bias`` or ``softcap``; the backward takes the
            same slopes (they get no gradient).
        q_descale, k_descale, v_descale: FP8 inference (q, k, v in e4m3: ``float8_e4m3fn`` on sm90
            and gfx950, ``float8_e4m3fnuz`` on gfx942): FlashAttention-3's descale factors, the real
            value being the fp8 value times the factor; fp32 GPU arrays ``(B, Hkv)`` or Python
            floats (one per tensor); default 1. The softmax probabilities are rounded to e4m3 for
            P·V (docs/attention.md, "FP8"). With fp8 inputs: no bias, dropout, sinks, softcap,
            ALiBi or backward.
        out_dtype: the FP8 forward's output dtype, bf16 (default) or fp16.
        library: a :class:`aotriton_rt.Library`; default :func:`aotriton_rt.default_library`.

    Returns:
        ``(out, lse)``, or ``(out, lse, mask)`` with ``return_mask``. ``out`` has q's layout and
        v's head dim; ``lse`` is fp32 ``(B, Hq, Sq)``, or ``(Hq, total_q)`` for varlen.

    Raises:
        ArgumentError: an argument is malformed (shapes, dtypes, devices, values); nothing has run.
        UnsupportedError: a combination the kernels cannot compute (message lists what they can).
        KernelNotFound: the images lack the variant this call needs (message names it).

    Example::

        out, lse = attention(q, k, v, causal=True, dropout_p=0.1, seed=1234)
    """
    if _fp8.is_fp8(q) or q_descale is not None or k_descale is not None or v_descale is not None or \
            out_dtype is not None:
        return _fp8_forward(q, k, v, causal=causal, window=window, align=align, bias=bias, dropout_p=dropout_p,
                            scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, layout=layout, out=out, lse=lse,
                            return_mask=return_mask, sinks=sinks, softcap=softcap, alibi_slopes=alibi_slopes,
                            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
                            library=library)
    try:
        result = _plan.forward(q, k, v, causal, window, align, bias, dropout_p, seed, offset, scale, cu_seqlens_q,
                               cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, out, lse, return_mask, library,
                               softcap, alibi_slopes, sinks)
        return result
    except Exception:  # an error path only: say so when the arrays are JAX tracers
        interop.refuse_jax_tracers("attention", "use aotriton_rt.jax.attention there (docs/jax.md)", q=q, k=k, v=v,
                                   bias=bias, alibi_slopes=alibi_slopes)
        raise


def _fp8_forward(q: Any, k: Any, v: Any, *, bias: Any, dropout_p: Any, return_mask: Any, sinks: Any, softcap: Any,
                 alibi_slopes: Any, **options: Any) -> tuple:
    """:func:`attention` on fp8 q, k, v (:mod:`.fp8`)."""
    try:
        if not _fp8.is_fp8(q):
            qd = getattr(q, "dtype", None)
            raise ArgumentError(f"q_descale, k_descale, v_descale and out_dtype apply to FP8 attention (e4m3 q, k, v); "
                                f"q has dtype {qd}")
        _fp8.refuse_options(bias=bias, dropout_p=dropout_p, return_mask=return_mask, sinks=sinks, softcap=softcap,
                            alibi_slopes=alibi_slopes)
        return _fp8.forward(q, k, v, **options)
    except Exception:  # an error path only: say so when the arrays are JAX tracers
        interop.refuse_jax_tracers("attention", "use aotriton_rt.jax.attention there (docs/jax.md)", q=q, k=k, v=v)
        raise


def _heads_q(q: Any, layout: str, cu_seqlens_q: Any) -> int:
    """q's head count (after the operator has validated q)."""
    shape = interop.describe(q).shape
    return shape[1] if cu_seqlens_q is not None or layout == "bhsd" else shape[2]


def attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *, causal: bool = False,
                       window: tuple[int, int] | None = None, align: str = "top_left", bias: Any = None,
                       dropout_p: float = 0.0, seed: int | None = None, offset: int = 0, scale: float | None = None,
                       cu_seqlens_q: Any = None, cu_seqlens_k: Any = None, max_seqlen_q: int | None = None,
                       max_seqlen_k: int | None = None, layout: str = "bhsd", deterministic: bool = False,
                       scheme: str | None = None, bias_grad: bool = True, dq: Any = None, dk: Any = None,
                       dv: Any = None, sinks: Any = None, softcap: float | None = None,
                       alibi_slopes: Any = None, library: Any = None) -> tuple:
    """Gradients of :func:`attention` with respect to q, k, v and the bias.

    Takes the forward's inputs, its ``out`` and ``lse``, the gradient ``dout`` (shaped like
    ``out``) and the same options (the same ``seed``/``offset`` replay the forward's dropout
    mask). The split scheme runs by default (bit-reproducible; ``deterministic=True`` insists on
    it); ``scheme="atomic"`` asks for the atomic-dQ scheme (dQ summed with fp32 atomics: dk, dv
    and dbias stay reproducible, dq does not), as a catalog tuning rule may. ``bias_grad=False``
    skips dbias (saves a ``(B, Hq, Sq, Sk)`` buffer). ``dq``/``dk``/``dv``: preallocated outputs.

    With ``sinks``, ``out`` and ``lse`` are the forward's with the same sinks, and the sinks'
    gradient comes fifth. ``alibi_slopes``: the forward's (no gradient is computed for them).

    Returns:
        ``(dq, dk, dv, dbias)``: shaped like q, k, v (dk/dv summed over each GQA group) and like
        ``bias`` (summed over its broadcast dims); ``dbias`` is None without a bias or with
        ``bias_grad=False``. With ``sinks``: ``(dq, dk, dv, dbias, dsinks)``, ``dsinks`` shaped
        and typed like ``sinks``.

    Raises: as :func:`attention`.

    Example::

        dq, dk, dv, dbias = attention_backward(dout, q, k, v, out, lse, bias=b, causal=True)
    """
    try:
        grads = _backward_plan.backward(dout, q, k, v, out, lse, causal=causal, window=window, align=align,
                                       bias=bias, dropout_p=dropout_p, seed=seed, offset=offset, scale=scale,
                                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, layout=layout,
                                       deterministic=deterministic, scheme=scheme, bias_grad=bias_grad, dq=dq,
                                       dk=dk, dv=dv, library=library, softcap=softcap,
                                       alibi_slopes=alibi_slopes)
        if sinks is not None:
            grads = tuple(grads) + (_sinks.sinks_grad(dout, out, lse, sinks,
                                                      heads_q=_heads_q(q, layout, cu_seqlens_q), layout=layout,
                                                      cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                                                      library=library),)
        return grads
    except Exception:  # an error path only: say so when the arrays are JAX tracers
        interop.refuse_jax_tracers("attention_backward",
                                   "use jax.grad of aotriton_rt.jax.attention there (docs/jax.md)", dout=dout, q=q,
                                   k=k, v=v, out=out, lse=lse, bias=bias, alibi_slopes=alibi_slopes)
        raise



def attention_kernels(q: Any, k: Any, v: Any, *, backward: bool = False, deterministic: bool = False,
                      scheme: str | None = None, return_mask: bool = False, bias_grad: bool = True,
                      library: Any = None, **options: Any) -> dict[str, Any]:
    """The kernel handles a call with these arguments launches, by catalog kernel name.

    Takes :func:`attention`'s arguments (and, with ``backward=True``, the backward's
    ``deterministic``/``scheme``/``bias_grad``); launches nothing. ``handle.variant(device)`` gives the
    exact variant (spec and tuning config) a launch on ``device`` uses. Benchmarks use it to
    run the Triton JIT of the same source with the same config.

    Example::

        fwd = attention_kernels(q, k, v, causal=True)["attn_fwd"]
        print(fwd.variant(0).config)
    """
    names = ("causal", "window", "align", "bias", "dropout_p", "seed", "offset", "scale", "cu_seqlens_q",
             "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "layout", "softcap", "alibi_slopes")
    defaults = {"causal": False, "align": "top_left", "dropout_p": 0.0, "offset": 0, "layout": "bhsd"}
    chosen = {n: options.pop(n, defaults.get(n)) for n in names}
    if options:
        raise ArgumentError(f"unknown option(s) {', '.join(sorted(options))}")
    return _plan.kernels(q, k, v, backward=backward, deterministic=deterministic, scheme=scheme,
                         return_mask=return_mask, bias_grad=bias_grad, library=library, options=chosen)


_plan.EXPRESS = _express
