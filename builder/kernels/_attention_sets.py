"""Which attention variants each build set holds (shared by attention.py and attention_bwd.py).

``default``: what common models need (the quickstart builds it; the runtime wheel embeds it).
``gputest``: what the GPU test matrix needs (every feature at a few sizes). ``bwdsweep``: the sm90
backward's config sweep (``bench/sm90_bwd.py``, ``python -m builder tune``). ``full``: everything
(no predicate needed).
"""


#: Head dims compiled in the default set. Common open models use 64 (GPT-2, BERT, ViT, Whisper,
#: Falcon, TinyLlama, SmolLM), 80 (Phi-2, Stable Diffusion), 96 (Phi-3), 128 (Llama, Mistral,
#: Qwen, Gemma 3, DiT/Flux) and 256 (Gemma 1/2). 80 and 96 are not compiled: the operator runs
#: them zero-padded on 128 (``aotriton_rt.ops.attention.family.head_dim_buckets``), as it runs
#: any dim on the next bucket the images hold (up to 64 on 64, 65-128 on 128, 129-256 on 256).
#: Their compile time would not fit the quickstart's budget (docs/performance.md).
DEFAULT_HEAD_DIMS = (64, 128, 256)
#: (head dim, CAUSAL) pairs whose dropout (training) variants are in the default set: none. Each
#: dropout variant costs 2-11 CPU seconds to compile per target, and the build time went to the
#: variable-length kernels that every padded batch needs (``DEFAULT_VARLEN_HEAD_DIMS``); training
#: with attention dropout needs ``--set full`` (docs/performance.md, "What the default set holds").
DEFAULT_DROPOUT: tuple[tuple[int, int], ...] = ()
#: Mask modes compiled in the default set: none, and the band whose alignment is a run-time
#: argument (``causal_align``), which serves top-left and bottom-right calls alike. Mode 2
#: (bottom-right only, what images built before the argument serve such calls with) is in
#: ``full`` and ``gputest``.
DEFAULT_CAUSAL = (0, 1)
#: Head dims with variable-length kernels (forward and backward) in the default set: padded and
#: packed batches (the transformers integration unpads to ``cu_seqlens``) at the common sizes;
#: 80 and 96 run padded on 128. Without dropout: a padded batch that trains with attention
#: dropout needs ``--set full``.
DEFAULT_VARLEN_HEAD_DIMS = (64, 128)


#: Softcap forwards in the default set: Gemma 2's head dims (256 for 2B and 9B, 128 for 27B), causal
#: and windowed (mode 1), dense and packed (the padded batches the transformers integration
#: unpads), no dropout.
DEFAULT_SOFTCAP_HEAD_DIMS = (128, 256)


def in_default_set(spec: dict, target: object) -> bool:
    """The default set (forward; see :func:`in_default_backward_set`), embedded in the runtime
    wheel: what common models need. fp16/bf16, head dims ``DEFAULT_HEAD_DIMS`` (equal q·k and
    v), no mask or causal aligned either way (mode 1, ``DEFAULT_CAUSAL``); variable lengths at
    ``DEFAULT_VARLEN_HEAD_DIMS``; dropout (without the returned mask) for the (head dim, mask)
    pairs of ``DEFAULT_DROPOUT``. Not in it (build ``--set full``): fp32, other head-dim buckets
    (calls at those dims run zero-padded on the next compiled one), bias, varlen at other head
    dims, dropout elsewhere, the returned dropout mask, the atomic-dQ backward (but sm90's Gluon one,
    :func:`in_default_sm90_atomic_set`), ALiBi (the set is at
    its build-time budget: docs/performance.md)."""
    if spec.get("ALIBI", 0):
        return False
    causal = spec.get("CAUSAL", 0)
    dropout = spec.get("DROPOUT", 0)
    head_dim = spec.get("HEAD_DIM", 64)
    if spec.get("SOFTCAP", 0):
        return (spec.get("dtype") in ("fp16", "bf16") and head_dim in DEFAULT_SOFTCAP_HEAD_DIMS
                and spec.get("HEAD_DIM_V") == head_dim and causal == 1 and not dropout and not spec.get("BIAS"))
    return (spec.get("dtype") in ("fp16", "bf16")
            and head_dim in DEFAULT_HEAD_DIMS
            and spec.get("HEAD_DIM_V", head_dim) == head_dim
            and causal in DEFAULT_CAUSAL
            and dropout in (0, 1) and not (dropout and (head_dim, causal) not in DEFAULT_DROPOUT)
            and not spec.get("BIAS", 0)
            and not (spec.get("VARLEN", 0) and (dropout or head_dim not in DEFAULT_VARLEN_HEAD_DIMS))
            and not spec.get("DQ_ATOMIC", 0))


#: Head dims whose backward (training) kernels are in the default set (80 and 96 train on 128;
#: 256 trains with ``--set full``: its backward would put the quickstart's build past budget).
DEFAULT_BACKWARD_HEAD_DIMS = (64, 128)


def in_default_backward_set(spec: dict, target: object) -> bool:
    """The default set's backward kernels: the forward's combinations at
    ``DEFAULT_BACKWARD_HEAD_DIMS`` (causal in both alignments, as the forward), without softcap:
    the default set serves Gemma 2's inference (forward and decode); training it with the cap
    needs ``--set full`` or ``gputest`` (its backward would put the quickstart past budget)."""
    return (in_default_set(spec, target) and spec.get("HEAD_DIM", 64) in DEFAULT_BACKWARD_HEAD_DIMS
            and not spec.get("SOFTCAP", 0))


def in_bwd_sweep_set(spec: dict, target: object) -> bool:
    """The ``bwdsweep`` set: the calls whose backward configs are swept on sm90 (the issue's
    training shapes): fp16/bf16, head dim 64 or 128 (equal q·k and v), no mask or causal
    bottom-right (equal lengths), no bias, dropout, varlen or atomic dQ. The forward and the
    preprocess kernel of those calls come with their first config only (``set_configs``: the
    backward needs their outputs, not their alternates); dK/dV and dQ with every config."""
    head_dim = spec.get("HEAD_DIM")
    return (getattr(target, "arch", None) == "sm90"
            and spec.get("dtype") in ("fp16", "bf16")
            and head_dim in DEFAULT_BACKWARD_HEAD_DIMS
            and spec.get("HEAD_DIM_V", head_dim) == head_dim
            and spec.get("CAUSAL", 0) in (0, 2)
            and not spec.get("BIAS", 0) and not spec.get("DROPOUT", 0) and not spec.get("VARLEN", 0)
            and not spec.get("DQ_ATOMIC", 0) and not spec.get("SOFTCAP", 0) and not spec.get("ALIBI", 0))


# The feature combinations tests/runtime/test_attention_gpu.py launches beyond the default set,
# as (dtype, HEAD_DIM, HEAD_DIM_V, CAUSAL, bias, dropout, varlen, atomic). ``bias``: 0 none,
# 1 bias with its gradient (dk/dv BIAS=2), 2 also without (dk/dv BIAS=1 too). Forward and dq
# kernels of a dropout combination come with DROPOUT 1 and 2 (2 returns the mask). ``atomic``
# adds the atomic-dQ backward (preprocess and dk/dv with DQ_ATOMIC=1, the convert kernel).
# A CPU test (tests/runtime/test_attention_op.py) checks that every kernel the GPU matrix
# dispatches is in this set.
GPUTEST = (
    # fp32, head dims between buckets and off powers of two, unequal q·k / v.
    ("fp32", 64, 64, 0, 0, 0, 0, 0),
    ("fp32", 64, 64, 2, 0, 0, 0, 0),
    ("fp32", 64, 64, 0, 1, 1, 0, 0),
    ("fp16", 48, 48, 0, 0, 0, 0, 0),
    ("fp16", 16, 16, 0, 0, 0, 0, 0),
    ("bf16", 80, 80, 2, 0, 0, 0, 0),
    ("fp16", 96, 96, 0, 0, 0, 0, 0),
    ("bf16", 224, 224, 0, 0, 0, 0, 0),
    ("fp16", 256, 256, 2, 0, 0, 0, 0),
    ("fp16", 192, 128, 0, 0, 0, 0, 0),
    ("fp16", 192, 128, 2, 0, 0, 0, 0),
    ("bf16", 192, 128, 2, 0, 0, 0, 0),
    # Top-left alignment (seqlen_q != seqlen_k), windows.
    ("fp16", 64, 64, 1, 0, 0, 0, 0),
    ("bf16", 128, 128, 1, 0, 0, 0, 0),
    # Bias, dropout and their combinations.
    ("fp16", 64, 64, 0, 2, 0, 0, 0),
    ("fp16", 64, 64, 2, 1, 0, 0, 0),
    ("bf16", 128, 128, 0, 1, 0, 0, 0),
    ("fp16", 64, 64, 0, 0, 1, 0, 0),
    ("fp16", 64, 64, 2, 0, 1, 0, 0),
    ("bf16", 128, 128, 0, 0, 1, 0, 0),
    ("fp16", 64, 64, 2, 1, 1, 0, 0),
    # Variable lengths.
    ("fp16", 64, 64, 0, 0, 0, 1, 0),
    ("fp16", 64, 64, 2, 0, 0, 1, 0),
    ("bf16", 128, 128, 2, 0, 0, 1, 0),
    ("bf16", 128, 128, 1, 0, 0, 1, 0),  # bottom-right on mode 1, aligned per sequence (MODE_ONE)
    ("fp16", 64, 64, 1, 1, 1, 1, 0),
    # Atomic-dQ backward.
    ("fp16", 64, 64, 0, 0, 0, 0, 1),
    ("fp16", 64, 64, 2, 0, 0, 0, 1),
    ("bf16", 128, 128, 2, 0, 0, 0, 1),
    ("fp16", 64, 64, 2, 0, 0, 1, 1),
    ("fp16", 48, 48, 0, 1, 0, 0, 1),
)


def _in_gputest_combo(spec: dict, combo: tuple) -> bool:
    dtype, hd, hdv, causal, bias, dropout, varlen, atomic = combo
    if spec.get("dtype") != dtype or spec.get("HEAD_DIM") != hd or spec.get("VARLEN", 0) != varlen:
        return False
    if "HEAD_DIM_V" in spec and spec["HEAD_DIM_V"] != hdv:
        return False
    if spec.get("DQ_ATOMIC", 0) and not atomic:
        return False
    if "HEAD_DIM_V" not in spec:  # attn_bwd_dq_convert: only the atomic scheme runs it
        return bool(atomic)
    if "CAUSAL" not in spec:  # attn_bwd_preprocess
        return True
    if spec["CAUSAL"] != causal or bool(spec.get("DROPOUT", 0)) != bool(dropout):
        return False
    if "DQ_ATOMIC" in spec:  # attn_bwd_dkdv: BIAS 2 writes dBias, 1 skips it
        return spec["BIAS"] in ({0: (0,), 1: (2,), 2: (1, 2)}[bias])
    return spec.get("BIAS", 0) == (1 if bias else 0)  # attn_fwd, attn_bwd_dq


#: Head dims of the ALiBi variants in the gputest set (``in_gputest_alibi``).
GPUTEST_ALIBI_HEAD_DIMS = (64, 128)


def in_gputest_alibi(spec: dict, target: object) -> bool:
    """The ALiBi variants (``ALIBI=1``) of the GPU test matrix (tests/runtime/test_attention_alibi_gpu.py):
    fp16 and bf16 at head dims ``GPUTEST_ALIBI_HEAD_DIMS`` (equal q·k and v), no mask and mask mode
    1 (both alignments), dense and packed, without dropout; and at fp16, head dim 64, mode 1, dense,
    also with dropout (its returned mask included) and the atomic-dQ scheme's dK/dV."""
    head_dim = spec.get("HEAD_DIM")
    if (not spec.get("ALIBI", 0) or spec.get("dtype") not in ("fp16", "bf16") or head_dim not in GPUTEST_ALIBI_HEAD_DIMS
            or spec.get("HEAD_DIM_V") != head_dim or spec.get("CAUSAL") not in (0, 1)):
        return False
    one = spec["dtype"] == "fp16" and head_dim == 64 and spec["CAUSAL"] == 1 and not spec.get("VARLEN")
    return (not spec.get("DROPOUT") and not spec.get("DQ_ATOMIC")) or one


#: The widest head-dim bucket (``aotriton_rt.ops.attention.family.WIDE_HEAD_DIM``): in
#: ``gputest`` at :func:`in_gputest_wide`'s combinations and in ``full``, never in the default set
#: (each variant costs the quickstart's budget and common models stop at 256).
WIDE_HEAD_DIM = 512


def in_gputest_wide(spec: dict, target: object) -> bool:
    """The head dim 512 variants of the GPU test matrix (tests/runtime/test_attention_gpu.py, its ``d512`` cases),
    forward and split backward: fp16 and bf16, no mask and mask mode 1 (both alignments), dense;
    fp16 mode 1 also packed (varlen). No bias, dropout, softcap, ALiBi or atomic dQ. Only where
    the bucket is compiled at all (the kernels' ``exclude``)."""
    if spec.get("HEAD_DIM") != WIDE_HEAD_DIM or spec.get("HEAD_DIM_V", WIDE_HEAD_DIM) != WIDE_HEAD_DIM:
        return False
    if "HEAD_DIM_V" not in spec:  # attn_bwd_dq_convert: only the atomic scheme runs it
        return False
    if spec.get("dtype") not in ("fp16", "bf16") or spec.get("CAUSAL", 1) not in (0, 1):
        return False
    if any(spec.get(axis, 0) for axis in ("BIAS", "DROPOUT", "SOFTCAP", "ALIBI", "DQ_ATOMIC")):
        return False
    return not spec.get("VARLEN", 0) or (spec["dtype"] == "fp16" and spec.get("CAUSAL", 1) == 1)


def in_gputest_set(spec: dict, target: object) -> bool:
    """The GPU test matrix: the default set plus every feature at a few head dims (``GPUTEST``),
    softcap also at head dim 64 (fp16 and bf16, no mask or mode 1, dense and packed), ALiBi
    at :func:`in_gputest_alibi`'s combinations and head dim 512 at :func:`in_gputest_wide`'s."""
    if spec.get("ALIBI", 0):
        return in_gputest_alibi(spec, target)
    if spec.get("SOFTCAP", 0):
        return in_default_set(spec, target) or (
            spec.get("dtype") in ("fp16", "bf16") and spec.get("HEAD_DIM") == spec.get("HEAD_DIM_V") == 64
            and spec.get("CAUSAL") in (0, 1) and not spec.get("DROPOUT") and not spec.get("BIAS"))
    return (in_default_set(spec, target) or any(_in_gputest_combo(spec, c) for c in GPUTEST)
            or in_gputest_wide(spec, target))


#: Head dims of the sm90 Gluon backward (builder/kernels/attention_bwd_sm90.py's HEAD_DIMS are these).
SM90_GLUON_BWD_HEAD_DIMS = (64, 128)


def in_sm90_gluon_atomic_set(spec: dict, target: object) -> bool:
    """The specs of the atomic-dQ backward whose dK/dV the Gluon kernel runs in the gputest set
    (fp16/bf16, head dim 64 or 128, equal q·k and v, fixed lengths, on sm90): what the preprocess
    (``DQ_ATOMIC=1``) and convert kernels add to ``gputest`` so that the scheme runs there
    without the portable atomic dK/dV."""
    head_dim = spec.get("HEAD_DIM")
    return (getattr(target, "arch", None) == "sm90"
            and spec.get("dtype") in ("fp16", "bf16")
            and head_dim in SM90_GLUON_BWD_HEAD_DIMS
            and spec.get("HEAD_DIM_V", head_dim) == head_dim
            and not spec.get("VARLEN", 0)
            and spec.get("DQ_ATOMIC", 1) == 1)


def in_default_sm90_atomic_set(spec: dict, target: object) -> bool:
    """The atomic-dQ backward's default variants on sm90: the atomic twins (``DQ_ATOMIC=1``) of the
    default backward's specs that :func:`in_sm90_gluon_atomic_set` gives the Gluon dK/dV (and its
    aligned sibling), the preprocess and the convert kernel, so that the tuning database's scheme
    rules (the atomic scheme where it beats the split one) hold for the images pip users get; not
    the portable atomic dK/dV (the dispatch runs the Gluon one on sm90)."""
    return in_sm90_gluon_atomic_set(spec, target) and in_default_backward_set({**spec, "DQ_ATOMIC": 0}, target)


def in_default_backward_schemes_set(spec: dict, target: object) -> bool:
    """The default set's variants of a kernel that both backward schemes run (the preprocess, sm90's
    Gluon dK/dV): :func:`in_default_backward_set`'s, and on sm90 :func:`in_default_sm90_atomic_set`'s."""
    return in_default_backward_set(spec, target) or in_default_sm90_atomic_set(spec, target)


#: Head dims of the FP8 forward in the gputest set (both output dtypes, mask modes 0 and 1, dense
#: and packed).
GPUTEST_FP8_HEAD_DIMS = (64, 128)
#: Head dims of the FP8 forward in the default set: 128 (Llama-class models), bf16 output. Its 12
#: variants and 3 V^T pre-pass ones (sm90, gfx942, gfx950) cost about 1-2 CPU seconds each
#: (docs/performance.md).
DEFAULT_FP8_HEAD_DIMS = (128,)


def in_fp8_default_set(spec: dict, target: object) -> bool:
    """The FP8 forward's default variants: bf16 output, head dims ``DEFAULT_FP8_HEAD_DIMS``, no
    mask or mode 1, dense and packed; and its V^T pre-pass at those head dims."""
    return (spec.get("HEAD_DIM") in DEFAULT_FP8_HEAD_DIMS and spec.get("out_dtype", "bf16") == "bf16"
            and spec.get("CAUSAL", 0) in DEFAULT_CAUSAL)


def in_fp8_gputest_set(spec: dict, target: object) -> bool:
    """The FP8 forward's variants in the GPU test matrix (tests/runtime/test_attention_fp8_gpu.py):
    head dims ``GPUTEST_FP8_HEAD_DIMS``, bf16 and fp16 output, mask modes 0 and 1, dense and packed
    (and the V^T pre-pass at those head dims)."""
    return spec.get("HEAD_DIM") in GPUTEST_FP8_HEAD_DIMS and spec.get("CAUSAL", 0) in (0, 1)
