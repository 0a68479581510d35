"""Which attention variants each build set holds (shared by attention.py and attention_bwd.py).

``default``: the small set the quickstart and CI build. ``gputest``: what the GPU test matrix
needs (every feature at a few sizes). ``full``: everything (no predicate needed).
"""


def in_default_set(spec: dict, target: object) -> bool:
    """The small CI set: fp16/bf16, D 64 and 128, no mask or bottom-right causal, no extras
    (deterministic backward only)."""
    return (spec.get("dtype") in ("fp16", "bf16")
            and spec.get("HEAD_DIM", 64) in (64, 128)
            and spec.get("HEAD_DIM_V", spec.get("HEAD_DIM", 64)) == spec.get("HEAD_DIM", 64)
            and spec.get("CAUSAL", 0) in (0, 2)
            and not spec.get("BIAS", 0) and not spec.get("DROPOUT", 0) and not spec.get("VARLEN", 0)
            and not spec.get("DQ_ATOMIC", 0))


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


def in_gputest_set(spec: dict, target: object) -> bool:
    """The GPU test matrix: the default set plus every feature at a few head dims (``GPUTEST``)."""
    return in_default_set(spec, target) or any(_in_gputest_combo(spec, c) for c in GPUTEST)
