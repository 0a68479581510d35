"""Which build sets hold the attention kernels' head dim 512 variants (builder/kernels/_attention_sets.py)."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("triton", reason="the builder's registry imports the kernels, which need triton")

from builder.registry import expand, load_kernels  # noqa: E402
from builder.targets import parse_targets  # noqa: E402

ATTENTION = ("attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_dq_convert")


def _wide(build_set: str, targets: str) -> list:
    kernels = load_kernels()
    return [j for name in ATTENTION for j in expand(kernels[name], parse_targets(targets), build_set, "3.6.0")
            if 512 in (j.spec.get("HEAD_DIM"), j.spec.get("HEAD_DIM_V"))]


def test_gputest_holds_head_dim_512_at_fp16_and_bf16_no_mask_and_mode_1_dense_and_one_packed() -> None:
    jobs = _wide("gputest", "sm90,gfx942,gfx950,gfx90a,gfx1100,sm80")
    per_target = Counter(j.target.arch for j in jobs)
    # Forward, dK/dV and dQ: fp16/bf16 x (no mask, mode 1) dense, and fp16 mode 1 packed; the
    # preprocess: fp16/bf16 dense, fp16 packed. No atomic scheme (no convert kernel).
    assert per_target == {arch: 18 for arch in ("sm90", "gfx942", "gfx950", "gfx90a")}
    for j in jobs:
        spec = j.spec
        assert spec["dtype"] in ("fp16", "bf16") and spec["HEAD_DIM"] == spec["HEAD_DIM_V"] == 512
        assert spec.get("CAUSAL", 0) in (0, 1) and not spec.get("DQ_ATOMIC", 0)
        assert not any(spec.get(a, 0) for a in ("BIAS", "DROPOUT", "SOFTCAP", "ALIBI"))
        assert not spec["VARLEN"] or (spec["dtype"] == "fp16" and spec.get("CAUSAL", 1) == 1)
        assert j.config_index == 0
    assert Counter(j.kernel for j in jobs if j.target.arch == "sm90") == {
        "attn_fwd": 5, "attn_bwd_dkdv": 5, "attn_bwd_dq": 5, "attn_bwd_preprocess": 3}


def test_the_default_set_holds_no_head_dim_512() -> None:
    assert _wide("default", "default") == []


def test_full_holds_head_dim_512_for_fp16_and_bf16_on_sm90_and_cdna_only() -> None:
    jobs = _wide("full", "default")
    per_target = Counter(j.target.arch for j in jobs)
    # Every feature combination the narrower buckets have: 120 forwards, 216 dK/dV, 84 dQ,
    # 8 preprocess and 4 convert variants per target.
    assert per_target == {arch: 432 for arch in ("sm90", "gfx942", "gfx950", "gfx90a")}
    assert {j.spec["dtype"] for j in jobs} == {"fp16", "bf16"}
    assert Counter(j.kernel for j in jobs if j.target.arch == "gfx942") == {
        "attn_fwd": 120, "attn_bwd_dkdv": 216, "attn_bwd_dq": 84, "attn_bwd_preprocess": 8, "attn_bwd_dq_convert": 4}


def test_head_dim_512_configs_fit_each_target() -> None:
    # The tiles ptxas and the AMDGPU backend fit without spilling at fp16, no mask (the compiles
    # themselves: tests/builder/test_attention_interpret.py).
    configs = {(j.kernel, j.target.arch): (j.config.constexprs["BLOCK_M"], j.config.constexprs["BLOCK_N"],
                                           j.config.num_warps, j.config.num_stages, j.config.constexprs["USE_TMA"])
               for j in _wide("gputest", "sm90,gfx942,gfx950,gfx90a") if j.kernel != "attn_bwd_preprocess"}
    assert configs[("attn_fwd", "sm90")] == (64, 32, 8, 2, 1)
    assert configs[("attn_bwd_dkdv", "sm90")] == (32, 32, 8, 1, 1)
    assert configs[("attn_bwd_dq", "sm90")] == (32, 64, 8, 1, 1)
    assert {configs[("attn_fwd", a)] for a in ("gfx942", "gfx950", "gfx90a")} == {(64, 32, 8, 1, 0)}
    assert configs[("attn_bwd_dkdv", "gfx942")] == (16, 16, 4, 1, 0)
    assert configs[("attn_bwd_dkdv", "gfx950")] == configs[("attn_bwd_dkdv", "gfx90a")] == (16, 32, 4, 1, 0)
    assert configs[("attn_bwd_dq", "gfx942")] == configs[("attn_bwd_dq", "gfx950")] == (32, 32, 4, 1, 0)
    assert configs[("attn_bwd_dq", "gfx90a")] == (32, 16, 4, 1, 0)


def test_cuda_softcap_forwards_get_hardware_tanh_twins_outside_the_default_set() -> None:
    """attn_fwd's softcap specs on CUDA: each config again with FAST_TANH=1 (named only there, so
    the others keep their measured parameters), in gputest and full; HIP and uncapped specs get
    none, and the default set holds a FAST_TANH config only where the checked-in tuning database
    picks it for the spec."""
    from builder.kernels.attention import fwd_configs
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    spec = {"dtype": "bf16", "HEAD_DIM": 256, "HEAD_DIM_V": 256, "CAUSAL": 1, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0,
            "SOFTCAP": 1, "ALIBI": 0}
    targets = parse_targets("sm80,sm90,gfx942")
    for target in targets:
        capped, plain = fwd_configs(spec, target), fwd_configs({**spec, "SOFTCAP": 0}, target)
        if target.backend == "cuda":
            assert len(capped) == 2 * len(plain)
            assert all("FAST_TANH" not in c.constexprs for c in capped[:len(plain)])
            for exact, fast in zip(capped[:len(plain)], capped[len(plain):]):
                assert fast.constexprs == {**exact.constexprs, "FAST_TANH": 1}
                assert (fast.num_warps, fast.num_stages) == (exact.num_warps, exact.num_stages)
        else:
            assert capped == plain
    kernel = load_kernels()["attn_fwd"]
    default = expand(kernel, targets, "default", "3.6.0")
    from builder import tuning

    picked = {(r["arch"], r["spec"]["dtype"], r["spec"]["HEAD_DIM"], r["spec"]["CAUSAL"], r["config"])
              for path in tuning.checked_in({"sm80", "sm90"}) for r in tuning.load(path)["rules"].get("attn_fwd", [])
              if r["spec"].get("SOFTCAP")}
    held = {(j.target.arch, j.spec["dtype"], j.spec["HEAD_DIM"], j.spec["CAUSAL"], j.config_index)
            for j in default if j.constexprs["FAST_TANH"]}
    assert held <= picked and all(j.spec["SOFTCAP"] for j in default if j.constexprs["FAST_TANH"])
    fast = [j for j in expand(kernel, targets, "gputest", "3.6.0") if j.constexprs["FAST_TANH"]]
    assert fast and all(j.spec["SOFTCAP"] and j.target.backend == "cuda" for j in fast)


def test_the_hardware_tanh_twin_takes_one_special_function_operation_a_score_off_the_forward() -> None:
    """The sm90 D=256 softcapped forward (the 2B/9B Gemma 2 shape, portable kernel): its FAST_TANH
    twin caps with MUFU.TANH and drops the exact tanh's exp2 and reciprocal (two operations a
    score become one), with fewer instructions in all; the exact variant has no MUFU.TANH."""
    from builder.compile import compile_job
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets
    from tests.helpers.sass import sass_ops

    spec = {"dtype": "bf16", "HEAD_DIM": 256, "HEAD_DIM_V": 256, "CAUSAL": 1, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0,
            "SOFTCAP": 1, "ALIBI": 0}
    jobs = {j.config_index: j for j in expand(load_kernels()["attn_fwd"], parse_targets("sm90"), "full", "3.6.0")
            if j.spec == spec}
    exact, fast = (sass_ops(compile_job(jobs[i])[1]) for i in (0, len(jobs) // 2))
    assert "MUFU.TANH" not in exact and fast["MUFU.TANH"] >= 64
    assert exact["MUFU.EX2"] - fast["MUFU.EX2"] >= fast["MUFU.TANH"] - 16
    assert exact["MUFU.RCP"] - fast.get("MUFU.RCP", 0) >= fast["MUFU.TANH"] - 16
    assert sum(fast.values()) < sum(exact.values())
