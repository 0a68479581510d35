"""The attention kernels: which exist, which stands in for which on an arch, and how they are called.

One declaration read by every caller: the eager plans (:mod:`.plan`, :mod:`.backward_plan`), the
general path (:mod:`.launch`), JAX (:mod:`aotriton_rt.jax.attention`), the dispatch step
(:mod:`.dispatch`) and the builder (``builder/kernels/attention*.py``, ``builder/tune.py``,
``builder/tuning.py``).

- **Kernels**: the portable forward and backward kernels (:data:`FWD`, :data:`PRE`,
  :data:`DKDV`, :data:`DQ`, :data:`CONVERT`), each arch's own kernels standing in for them
  (:data:`ARCH_FORWARDS`, :data:`ARCH_BACKWARDS`), aligned-length siblings
  (:data:`ALIGNED_SIBLINGS`), the compiled head dims and dtypes, and the tuning tables whose rules
  choose among them.
- **Calls**: :func:`forward_arguments` / :func:`backward_arguments` name every argument of the
  kernels, from the caller's arrays (or whatever stands in for them: a plan's open slots, JAX
  buffers), strides and scalars; :func:`scalar_arguments` names the problem's scalars. The layout
  helpers below give the strides: a ``(batch, heads, rows, dim)`` array as the kernels address it.

Pure data and pure functions: nothing here reads an array, a catalog or a device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import UnsupportedError
from ...tuning import DKDV_KERNEL_RULES, DQ_KERNEL_RULES, KERNEL_RULES, MODE_RULES

__all__ = [
    "ALIBI_ARG", "ALIGN", "ALIGN_ARG", "ALIGNED_FACTS", "ALIGNED_SIBLINGS", "ARCH_BACKWARDS", "ARCH_FORWARDS",
    "ARCH_FP8_FORWARDS", "AttentionCall",
    "BACKWARD_KERNEL_RULES", "BIAS_ALIGN", "CONVERT", "DKDV", "DKDV_KERNEL_RULES", "DKDV_SM90", "DKDV_SM90_A16", "DQ",
    "DQ_KERNEL_RULES", "DQ_SM90", "DTYPES", "FP8_ARCH_DTYPES", "FP8_DTYPES", "FP8_HEAD_DIMS", "FP8_OUT_DTYPES",
    "FP8_V_TRANSPOSE", "FWD", "FWD_FP8", "FWD_FP8_SM90", "FWD_SM90", "HEAD_DIM_BUCKETS", "KERNEL_RULES", "MODE_RULES",
    "PRE",
    "SCALARS", "SINKS_ARG", "SOFTCAP_ARG", "UNEQUAL_HEAD_DIMS", "USE_SINKS_ARG", "WIDE_ARCHS", "WIDE_DTYPES",
    "WIDE_HEAD_DIM", "align_arg", "backward_arguments", "bhs", "bias_row_width",
    "bias_strides", "bucket",
    "contiguous_kernel_strides", "contiguous_strides", "family_of", "forward_arguments", "head_dim_buckets",
    "kernel_strides", "lse_strides", "named", "scalar_arguments", "wide_compiled", "wide_refusal",
]

# ---------------------------------------------------------------------------------------------
# The kernels.
# ---------------------------------------------------------------------------------------------

#: The head dims the kernels are compiled for (others run zero-padded on the next), the unequal
#: q·k / v pairs compiled as such, and the dtypes (``builder/kernels/attention.py`` declares its
#: variants from these).
HEAD_DIM_BUCKETS = (16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 512)
UNEQUAL_HEAD_DIMS = ((192, 128),)
DTYPES = ("fp16", "bf16", "fp32")
#: The widest bucket is compiled only where its kernels fit: fp16 and bf16 (fp32 tiles spill
#: kilobytes of registers), forward and backward, on the archs with room for a 512-wide fp32
#: accumulator (sm90's 255 registers beside 227 KB of shared memory; CDNA's 512 VGPRs with
#: AGPRs). sm80-89 and RDNA spill hundreds to thousands of bytes per thread there
#: (docs/attention.md, "Head dim 512"). Elsewhere a call that needs it is refused by name
#: (:func:`wide_refusal`), not reported as a missing variant.
WIDE_HEAD_DIM = 512
WIDE_DTYPES = ("fp16", "bf16")
WIDE_ARCHS = {"forward": ("sm90", "gfx90a", "gfx942", "gfx950"), "backward": ("sm90", "gfx90a", "gfx942", "gfx950")}

FWD = "attn_fwd"
PRE = "attn_bwd_preprocess"
DKDV = "attn_bwd_dkdv"
DQ = "attn_bwd_dq"
CONVERT = "attn_bwd_dq_convert"
FWD_SM90 = "attn_fwd_sm90"
DKDV_SM90 = "attn_bwd_dkdv_sm90"
DKDV_SM90_A16 = "attn_bwd_dkdv_sm90_a16"
DQ_SM90 = "attn_bwd_dq_sm90"
#: The FP8 (e4m3) inference forward (builder/kernels/attention_fp8.py): its input dtypes (OCP e4m3,
#: e4m3fnuz: each target compiles the one its matrix units take), output dtypes and head dims
#: (a call's head dim runs zero-padded on the next of these).
FWD_FP8 = "attn_fwd_fp8"
#: Its V^T pre-pass: the caller's V, (keys, dim), transposed for the FP8 forward (keys contiguous).
FP8_V_TRANSPOSE = "attn_fp8_v_transpose"
FP8_DTYPES = ("fp8e4nv", "fp8e4b8")
FP8_OUT_DTYPES = ("bf16", "fp16")
FP8_HEAD_DIMS = (64, 128, 256)
#: The e4m3 format each arch's matrix units take: OCP e4m3 (``fp8e4nv``, torch's ``float8_e4m3fn``)
#: on sm90 and gfx950, e4m3fnuz (``fp8e4b8``, ``float8_e4m3fnuz``) on gfx942.
FP8_ARCH_DTYPES = {"sm90": "fp8e4nv", "gfx950": "fp8e4nv", "gfx942": "fp8e4b8"}
#: sm90's own FP8 forward (builder/kernels/attention_fp8_sm90.py, Gluon): ``attn_fwd_fp8``'s
#: arguments, axes and results for fixed lengths at head dims 64 and 128.
FWD_FP8_SM90 = "attn_fwd_fp8_sm90"
#: Per-architecture FP8 forwards standing in for ``attn_fwd_fp8``: preferred on their arch where
#: the images hold the call's spec (:func:`aotriton_rt.ops.attention.fp8.choose`); no tuning
#: table names them yet.
ARCH_FP8_FORWARDS = {"sm90": FWD_FP8_SM90}

#: Per-architecture forwards: same arguments, mask modes, LSE and results as ``attn_fwd`` for the
#: specs they are compiled for (builder/kernels/attention_sm90.py: fp16/bf16, head dim 64/128, no
#: bias, dropout or varlen). Preferred on their arch when the images hold the call's spec, unless a
#: ``tuning["attn_fwd_kernel"]`` rule names another kernel.
ARCH_FORWARDS = {"sm90": FWD_SM90}
#: Per-architecture kernels of the backward, by the portable kernel they stand in for: same
#: arguments, grid and results (builder/kernels/attention_bwd_sm90.py and attention_bwd_dq_sm90.py:
#: the dK/dV and dQ kernels for fp16/bf16, head dim 64/128, no bias, dropout or varlen; the dK/dV
#: one also with ``DQ_ATOMIC=1``, the atomic scheme's). Each is preferred on its arch when the
#: images hold the call's spec, unless a rule of its role's table (:data:`BACKWARD_KERNEL_RULES`)
#: names another kernel. A role counts as held when either kernel is
#: (:func:`aotriton_rt.ops.attention.dispatch.role_available`).
ARCH_BACKWARDS = {"sm90": {DKDV: DKDV_SM90, DQ: DQ_SM90}}
#: Aligned-length siblings, by the kernel they belong to: the same source, arguments, grid and
#: configs, compiled with some of :data:`ALIGNED_FACTS` declared divisible beyond the family's
#: promise (builder/kernels/attention_bwd_sm90.py: ``attn_bwd_dkdv_sm90_a16``, both lengths and the
#: LSE/Delta strides multiples of 16, which shortens the Gluon dK/dV's unmasked tile). An
#: implementation detail of its family, never a name rules use: where the family's kernel is chosen
#: (by the heuristic or by a rule naming it), the sibling runs instead when the images hold it for
#: the spec, the catalog declares it like the family but for these facts, and the call's values
#: meet every divisibility it declares
#: (:meth:`aotriton_rt.ops.attention.dispatch.LibraryKernels.aligned_sibling`); config rules of
#: the family (``tuning["attn_bwd_dkdv_sm90"]``) choose its config.
ALIGNED_SIBLINGS = {DKDV_SM90: DKDV_SM90_A16}
#: The call facts an aligned sibling may declare divisible beyond its family (kernel argument
#: names; values from :func:`aotriton_rt.ops.attention.dispatch.aligned_facts`).
ALIGNED_FACTS = ("seqlen_q", "seqlen_k", "stride_lz", "stride_lh")
#: Per role of the split backward: the tuning table whose rules name the kernel playing it, and
#: the role in words (explain's reasons). The tables' names, like the forward's
#: (:data:`KERNEL_RULES`) and the scheme's (:data:`MODE_RULES`), are the tuning format's
#: (:mod:`aotriton_rt.tuning`, which checks their rules when a catalog loads).
BACKWARD_KERNEL_RULES = {DKDV: (DKDV_KERNEL_RULES, "dK/dV kernel"), DQ: (DQ_KERNEL_RULES, "dQ kernel")}
#: The run-time argument that aligns a mask-mode-1 band: 0 top-left, 1 bottom-right (mode 2 is
#: bottom-right whatever it says). Images built before it existed compiled mode 1 as top-left
#: only, so a mode-1 variant serves a bottom-right call only if its arguments include it.
ALIGN_ARG = "causal_align"
#: The forward's run-time logit softcap (0 for none; read by its ``SOFTCAP=1`` variants only).
SOFTCAP_ARG = "softcap"
#: The ALiBi slopes (fp32, one per query head, per sequence with the batch stride ``stride_az``;
#: read by the ``ALIBI=1`` variants only, a null pointer elsewhere).
ALIBI_ARG = "alibi_slopes"
#: The forward kernels' attention sinks (fp32, one logit per query head) and whether to read them:
#: images built before the arguments existed join the sinks by a pass over the outputs instead.
SINKS_ARG = "Sinks"
USE_SINKS_ARG = "use_sinks"
#: Declared stride divisibility (elements): Q/K/V/Out and the gradients 16, Bias/dBias 8.
ALIGN = 16
BIAS_ALIGN = 8


def family_of(name: str) -> str:
    """The kernel whose tuning rules ``name`` follows: its family for an aligned sibling
    (:data:`ALIGNED_SIBLINGS`), else ``name`` itself."""
    for family, sibling in ALIGNED_SIBLINGS.items():
        if name == sibling:
            return family
    return name


def bucket(head_dim: int) -> int:
    """The smallest compiled head-dim bucket holding ``head_dim`` (1..512)."""
    for b in HEAD_DIM_BUCKETS:
        if b >= head_dim:
            return b
    raise UnsupportedError(f"head dim {head_dim} exceeds the largest supported head dim {HEAD_DIM_BUCKETS[-1]}; "
                           f"supported: 1..{HEAD_DIM_BUCKETS[-1]} (compiled buckets "
                           f"{', '.join(map(str, HEAD_DIM_BUCKETS))}; others are zero-padded)")


def wide_compiled(dtype: str, arch: str, backward: bool) -> bool:
    """Whether the :data:`WIDE_HEAD_DIM` bucket is compiled for ``dtype`` on ``arch`` (the
    forward's kernels, or with ``backward`` the backward's): the builder excludes the others."""
    return dtype in WIDE_DTYPES and arch in WIDE_ARCHS["backward" if backward else "forward"]


def wide_refusal(call: AttentionCall, spec: Mapping[str, Any], arch: str, backward: bool) -> str | None:
    """Why ``spec`` (a kernel spec chosen for ``call``) cannot be in any images for ``arch``: its
    head dims are the :data:`WIDE_HEAD_DIM` bucket, which is not compiled for the call's dtype
    there (:func:`wide_compiled`); None otherwise."""
    if WIDE_HEAD_DIM not in (spec.get("HEAD_DIM"), spec.get("HEAD_DIM_V")):
        return None
    if wide_compiled(call.dtype, arch, backward):
        return None
    part = "backward" if backward else "forward"
    dims = f"{call.head_dim}" + (f"/{call.head_dim_v}" if call.head_dim_v != call.head_dim else "")
    *most, last = WIDE_ARCHS[part]
    fixes = [f"a head dim up to {HEAD_DIM_BUCKETS[-2]}"]
    if call.dtype not in WIDE_DTYPES:
        fixes.append("/".join(WIDE_DTYPES))
    if arch not in WIDE_ARCHS[part]:
        fixes.append("a GPU of those archs")
    return (f"head dim {WIDE_HEAD_DIM} {part} is not available for {call.dtype} on {arch}: head dim {dims} runs on "
            f"the {WIDE_HEAD_DIM} bucket, compiled for {' and '.join(WIDE_DTYPES)} on {', '.join(most)} and {last} "
            f"only (its tiles spill registers elsewhere); use {', or '.join(fixes)}")


def head_dim_buckets(head_dim: int, head_dim_v: int) -> list[tuple[int, int]]:
    """Compiled (q·k, v) head-dim pairs able to run these head dims, best first.

    Equal dims use their bucket; an unequal pair runs as such when it is compiled
    (``UNEQUAL_HEAD_DIMS``), and otherwise on the larger bucket for both (zero padding
    changes neither the scores nor the kept output columns). After those come the wider
    equal buckets, narrowest first: images that lack a bucket (the default set has no 80 or
    96) run the call zero-padded on the next one they hold (80 and 96 on 128).
    """
    bq, bv = bucket(head_dim), bucket(head_dim_v)
    wide = max(bq, bv)
    first = [(bq, bv), (wide, wide)] if (bq, bv) in UNEQUAL_HEAD_DIMS else [(wide, wide)]
    return first + [(b, b) for b in HEAD_DIM_BUCKETS if b > wide]


@dataclass(frozen=True)
class AttentionCall:
    """The facts of one attention call that decide which kernels run.

    ``causal`` is the call's mask (0 none, 1 band aligned top-left, 2 bottom-right);
    ``causal_equivalent`` says the two alignments coincide for this call (equal lengths).
    Kernels of mask mode 1 take the alignment as a run-time argument (:data:`ALIGN_ARG`), so
    they serve either alignment; mode 2 serves bottom-right calls, and top-left ones of equal
    lengths. ``dropout`` is 0 off, 1 on, 2 on and the mask returned.
    """

    dtype: str
    head_dim: int
    head_dim_v: int
    causal: int = 0
    causal_equivalent: bool = False
    bias: bool = False
    dropout: int = 0
    varlen: bool = False
    seqlen_q: int = 0
    seqlen_k: int = 0
    #: (stride_lz, stride_lh) of the LSE and Delta arrays the backward's kernels read (the
    #: operator's contiguous ``(B, Hq, Sq)``: ``(Hq·Sq, Sq)``); None: unknown, so no aligned sibling.
    lse_strides: tuple[int, int] | None = None
    #: Scores logit-softcapped (the forward's ``SOFTCAP`` variants).
    softcap: bool = False
    #: Scores with ALiBi's linear bias (the ``ALIBI`` variants).
    alibi: bool = False

    def describe(self) -> str:
        """The combination in words, for error messages."""
        parts = [self.dtype, f"head dim {self.head_dim}" + (f"/{self.head_dim_v}" if self.head_dim_v != self.head_dim
                                                           else "")]
        parts.append({0: "no mask", 1: "causal/window top-left", 2: "causal/window bottom-right"}[self.causal])
        if self.bias:
            parts.append("bias")
        if self.dropout:
            parts.append("dropout" + (" with mask" if self.dropout == 2 else ""))
        if self.varlen:
            parts.append("varlen")
        if self.softcap:
            parts.append("softcap")
        if self.alibi:
            parts.append("ALiBi")
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Layout: (batch, head, row) extents and strides as the kernels see them.
# ---------------------------------------------------------------------------------------------

def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides (elements) of ``shape``; an empty axis steps like one of extent 1."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def bhs(shape: Sequence[int], strides: Sequence[int], layout: str, varlen: bool
        ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(extents, strides) of the batch, head and row axes; batch is absent (0) under varlen."""
    if varlen:
        return (1, shape[1], shape[0]), (0, strides[1], strides[0])
    if layout == "bhsd":
        return (shape[0], shape[1], shape[2]), (strides[0], strides[1], strides[2])
    return (shape[0], shape[2], shape[1]), (strides[0], strides[2], strides[1])


def kernel_strides(extents: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """Strides as passed: an axis of extent <= 1 is never stepped over, and 0 meets any
    divisibility a kernel assumes."""
    return tuple(0 if e <= 1 else s for e, s in zip(extents, strides))


def bias_strides(extents: Sequence[int], strides: Sequence[int]) -> tuple[int, int, int]:
    """(batch, head, row) strides of a bias of 4-D ``extents`` (its shape, padded with leading 1s):
    0 over the axes it broadcasts (extent 1)."""
    return tuple(0 if e == 1 else s for e, s in zip(extents[:3], strides[:3]))


def contiguous_kernel_strides(shape: Sequence[int], layout: str, varlen: bool) -> tuple[int, ...]:
    """Kernel (batch, head, row) strides of a contiguous array of ``shape``."""
    extents, strides = bhs(shape, contiguous_strides(shape), layout, varlen)
    return kernel_strides(extents, strides)


def lse_strides(shape: Sequence[int], varlen: bool) -> tuple[int, int]:
    """(stride_lz, stride_lh) of a contiguous LSE or Delta array of ``shape``: ``(B, Hq, Sq)``, or
    ``(Hq, total_q)`` under varlen (rows packed per head, no batch stride)."""
    cs = contiguous_strides(shape)
    return (0, cs[0]) if varlen else (cs[0], cs[1])


def bias_row_width(seqlen_k: int) -> int:
    """Keys per row of a bias or dBias buffer the operator allocates: padded to :data:`BIAS_ALIGN`."""
    return -(-max(seqlen_k, 1) // BIAS_ALIGN) * BIAS_ALIGN


def named(prefix: str, row: str, strides: Sequence[int]) -> dict[str, int]:
    """``stride_<prefix>z/h/<row>``: an array's (batch, head, row) strides as the kernels name them
    (``row`` is ``m`` for query rows, ``n`` for key rows)."""
    return {f"stride_{prefix}z": strides[0], f"stride_{prefix}h": strides[1], f"stride_{prefix}{row}": strides[2]}


# ---------------------------------------------------------------------------------------------
# Arguments.
# ---------------------------------------------------------------------------------------------

#: The problem's scalar arguments, as every attention kernel names them (:func:`scalar_arguments`).
SCALARS = ("batch", "num_heads_q", "num_heads_k", "seqlen_q", "seqlen_k", "sm_scale", "dropout_p", "philox_seed",
           "philox_offset", "window_left", "window_right", ALIGN_ARG, SOFTCAP_ARG)
_NONE = (0, 0, 0)
_DESCALES = ("q_descale", "k_descale", "v_descale")
_FORWARD_ARRAYS = frozenset(("q", "k", "v", "out", "lse", "mask", "bias", "cu_seqlens_q", "cu_seqlens_k", "alibi",
                             *_DESCALES))
_FORWARD_STRIDES = frozenset(("q", "k", "v", "out", "mask", "bias", "alibi", *_DESCALES))
_BACKWARD_ARRAYS = frozenset(("dout", "q", "k", "v", "out", "lse", "bias", "cu_seqlens_q", "cu_seqlens_k", "dq",
                              "dk", "dv", "delta", "dqacc", "dbias", "alibi"))
_BACKWARD_STRIDES = frozenset(("dout", "q", "k", "v", "out", "dq", "dk", "dv", "bias", "dbias", "dqacc", "alibi"))


def align_arg(causal_mode: int) -> int:
    """The kernels' ``causal_align`` for a call's mask: 1 for a bottom-right band, else 0 (a
    mode-1 kernel aligns its band by it; mode 2 and unmasked kernels ignore it; images built
    before it existed do not take it, and launches pick arguments by the variant's names)."""
    return 1 if causal_mode == 2 else 0


def scalar_arguments(*, batch: int, heads_q: int, heads_k: int, seqlen_q: int, seqlen_k: int, scale: float,
                     dropout_p: float, seed: int, offset: int, window_left: int, window_right: int,
                     causal_mode: int, softcap: float = 0.0) -> dict[str, Any]:
    """The problem's scalars by kernel argument name (:data:`SCALARS`). ``seqlen_q``/``seqlen_k``
    are the dense lengths, or the longest under varlen; ``seed``/``offset`` are 0 without dropout."""
    return {"batch": batch, "num_heads_q": heads_q, "num_heads_k": heads_k, "seqlen_q": seqlen_q,
            "seqlen_k": seqlen_k, "sm_scale": scale, "dropout_p": dropout_p, "philox_seed": seed,
            "philox_offset": offset, "window_left": window_left, "window_right": window_right,
            ALIGN_ARG: align_arg(causal_mode), SOFTCAP_ARG: softcap}


def _check(what: str, given: Mapping[str, Any], known: frozenset) -> None:
    if not given.keys() <= known:
        raise TypeError(f"{what}: unknown names {sorted(set(given) - known)}; known: {sorted(known)}")


def forward_arguments(arrays: Mapping[str, Any], strides: Mapping[str, Sequence[int]], lse_strides: Sequence[int],
                      scalars: Mapping[str, Any]) -> dict[str, Any]:
    """Every argument of the forward kernels (``attn_fwd`` and its per-arch stand-ins), by name.

    Arguments:
        arrays: ``q k v out lse`` and, where the call has them, ``mask`` (the dropout mask
            returned), ``bias``, ``cu_seqlens_q``/``cu_seqlens_k``, ``alibi`` (the ALiBi slopes):
            whatever the caller launches with (arrays, a plan's open slots, JAX buffers); absent
            ones are null. The FP8 forward also takes ``q_descale``/``k_descale``/``v_descale``.
        strides: (batch, head, row) kernel strides of ``q k v out`` and of ``mask``/``bias`` when
            given (absent: zeros); ``alibi``: ``(batch stride,)`` of the slopes, 0 when the batch
            shares them (absent: 0); the descales: their ``(batch, head)`` strides (absent: 0).
        lse_strides: ``(stride_lz, stride_lh)`` of the LSE array.
        scalars: :func:`scalar_arguments`, possibly with some values replaced by a caller's slots.

    Returns:
        ``{argument name: value}``; a launch picks its handle's ``arg_names`` from it.

    Example::

        values = forward_arguments({"q": q, "k": k, "v": v, "out": o, "lse": lse},
                                   {"q": sq, "k": sk, "v": sv, "out": so}, (Hq * Sq, Sq), scalars)
        handle(*[values[n] for n in handle.arg_names])
    """
    _check("forward arrays", arrays, _FORWARD_ARRAYS)
    _check("forward strides", strides, _FORWARD_STRIDES)
    a, s = arrays.get, strides.get
    return {"Q": a("q"), "K": a("k"), "V": a("v"), "Out": a("out"), "LSE": a("lse"), "DropMask": a("mask"),
            "Bias": a("bias"), "cu_seqlens_q": a("cu_seqlens_q"), "cu_seqlens_k": a("cu_seqlens_k"),
            **named("q", "m", strides["q"]), **named("k", "n", strides["k"]), **named("v", "n", strides["v"]),
            **named("o", "m", strides["out"]), **named("b", "m", s("bias", _NONE)),
            **named("dm", "m", s("mask", _NONE)), "stride_lz": lse_strides[0], "stride_lh": lse_strides[1],
            ALIBI_ARG: a("alibi"), "stride_az": s("alibi", _NONE)[0], SINKS_ARG: None, USE_SINKS_ARG: 0,
            **_descales(a, s), **scalars}


def _descales(a: Any, s: Any) -> dict[str, Any]:
    """The FP8 forward's descale factors (``q_descale`` at ``stride_qdz``/``stride_qdh``, ...)."""
    values = {}
    for name in _DESCALES:
        z, h = s(name, (0, 0))
        values.update({name: a(name), f"stride_{name[0]}dz": z, f"stride_{name[0]}dh": h})
    return values


def backward_arguments(arrays: Mapping[str, Any], strides: Mapping[str, Sequence[int]], lse_strides: Sequence[int],
                       scalars: Mapping[str, Any]) -> dict[str, Any]:
    """Every argument of the backward kernels (preprocess, dK/dV, dQ or the atomic scheme's convert,
    and their per-arch stand-ins), by name; one dict serves all of a backward's launches.

    Arguments:
        arrays: ``dout q k v out lse delta dq dk dv`` and, where the call has them, ``bias``,
            ``dbias``, ``dqacc`` (the atomic scheme's fp32 dQ), ``cu_seqlens_q``/``cu_seqlens_k``,
            ``alibi``; absent ones are null.
        strides: (batch, head, row) kernel strides of ``dout q k v out dq dk dv`` and of
            ``bias``/``dbias``/``dqacc`` when given (absent: zeros); ``alibi`` as for
            :func:`forward_arguments`.
        lse_strides: ``(stride_lz, stride_lh)`` of the LSE array, which Delta shares.
        scalars: as for :func:`forward_arguments`.
    """
    _check("backward arrays", arrays, _BACKWARD_ARRAYS)
    _check("backward strides", strides, _BACKWARD_STRIDES)
    a, s = arrays.get, strides.get
    return {"DO": a("dout"), "Q": a("q"), "K": a("k"), "V": a("v"), "Out": a("out"), "LSE": a("lse"),
            "Bias": a("bias"), "cu_seqlens_q": a("cu_seqlens_q"), "cu_seqlens_k": a("cu_seqlens_k"),
            "DQ": a("dq"), "DK": a("dk"), "DV": a("dv"), "Delta": a("delta"), "DQacc": a("dqacc"),
            "DBias": a("dbias"),
            **named("q", "m", strides["q"]), **named("k", "n", strides["k"]), **named("v", "n", strides["v"]),
            **named("do", "m", strides["dout"]), **named("o", "m", strides["out"]),
            **named("dq", "m", strides["dq"]), **named("dk", "n", strides["dk"]), **named("dv", "n", strides["dv"]),
            **named("b", "m", s("bias", _NONE)), **named("db", "m", s("dbias", _NONE)),
            **named("dqa", "m", s("dqacc", _NONE)), "stride_lz": lse_strides[0], "stride_lh": lse_strides[1],
            ALIBI_ARG: a("alibi"), "stride_az": s("alibi", _NONE)[0], **scalars}
