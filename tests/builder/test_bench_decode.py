"""bench/decode.py's forced contenders and summary, and its --llama and --prefill modes
(bench/llama.py, bench/prefill.py); the GPU timing runs on the H200 only."""

from __future__ import annotations

import argparse
import types

import pytest

from aotriton_rt.ops.decode import SplitRule, split_rule
from tests.helpers.benches import load_bench


@pytest.fixture(scope="module")
def bench() -> types.SimpleNamespace:
    """The decode benchmark's modules (what they share, the two modes, the kernel table) as one
    namespace."""
    pytest.importorskip("torch")
    merged = types.SimpleNamespace()
    for script in ("gpu_common.py", "llama.py", "prefill.py", "decode.py"):
        vars(merged).update({k: v for k, v in vars(load_bench(script)).items() if not k.startswith("__")})
    return merged


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"config": [], "min_blocks": [], "waves": None, "splits": [], "shapes": [],
                                 "b": [1, 8], "cache": [2048], **kw})


def test_forced_split_counts_keep_the_images_rules_and_min_blocks_contenders_force_a_config(bench) -> None:
    images = [{"arch": "sm90", "min_batch_heads": 212, "config": 2}, {"arch": "sm90", "splits": {"waves": 2}}]
    variants = bench._variants(_args(config=[0], min_blocks=[1, 8], splits=[1]), images)
    assert [(tag, forced) for tag, _, forced in variants] == [("#0mb1", None), ("#0mb8", None), ("=1", 1)]
    assert variants[2][1] is images  # =1: the images' own config choice, only the split count forced
    assert split_rule(variants[0][1], "sm90", batch_heads=512) == (SplitRule(min_blocks=1), 0)
    assert split_rule(variants[1][1], "sm90")[0].min_blocks == 8


def test_shapes_are_the_listed_pairs_or_every_batch_with_every_cache(bench) -> None:
    assert bench.shapes_of(_args()) == [(1, 2048), (8, 2048)]
    assert bench.shapes_of(_args(shapes=["8x512", "1X8192"])) == [(8, 512), (1, 8192)]
    with pytest.raises(SystemExit, match=r"--shapes: '8x' is not BxS"):
        bench.shapes_of(_args(shapes=["8x"]))


def test_the_summary_compares_each_forced_contender_with_its_default(bench, capsys) -> None:
    def stats(us: float, x: float) -> dict:
        return {"median_us": us, "vs_sdpa": x, "bw_pct": 50.0, "spread": 0.0}

    row = {"B": 1, "cache": 2048, "gqa": 4, "pages": [16],
           "graph": {"sdpa:cudnn": stats(8.6, 1.0), "ours": stats(8.0, 1.075), "p16": stats(8.4, 1.02),
                     "ours=1": stats(10.0, 0.86), "p16#0mb2": stats(10.5, 0.82)},
           "splits": {"ours": 8, "ours=1": 1, "p16": 8, "p16#0mb2": 16},
           "graph_sdpa_best": "sdpa:cudnn", "eager": {}}
    bench.summary([row])
    out = capsys.readouterr().out
    assert "ours=1: 1/2048/4:1 x0.86 [0.80] (8/1)" in out
    assert "p16#0mb2: 1/2048/4:1 x0.82 [0.80] (8/16)" in out
    assert "0.95" in out.split("\n")[3]  # p16 /c: 8.0 / 8.4


def test_attention_kernels_are_told_from_the_rest_by_name(bench) -> None:
    for name in ("attn_decode", "attn_decode_combine", "pytorch_flash::flash_fwd_splitkv_kernel<...>",
                 "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "fmha_cutlassF_bf16_aligned"):
        assert bench.is_attention_kernel(name), name
    for name in ("nvjet_tst_128x64_64x8_2x1_v_bz_TNT", "void at::native::vectorized_elementwise_kernel<4>",
                 "triton_red_fused_rms_norm", "void at::native::(anonymous namespace)::cat_kernel"):
        assert not bench.is_attention_kernel(name), name


def _llama_contender(gen: float, attn: float, cache: str = "DynamicCache", agree: float = 1.0) -> dict:
    return {"generate_ms": [gen, gen * 1.1, gen * 0.9], "prefill_ms": [18.0] * 3, "train_ms": [60.0] * 3,
            "cold_generate_ms": gen * 3, "cache": cache, "greedy_agreement_with_aotriton": agree,
            "decode_step": {"wall_us_per_step": gen * 1e3 / 128, "gpu_us_per_step": 900.0,
                            "attn_us_per_step": attn, "kernels": {"attn_decode": attn}}}


def test_the_llama_summary_compares_ours_with_sdpas_default_and_fastest_backend(bench, capsys) -> None:
    result = {"padding": "none", "prompt_lengths": [512] * 8, "contenders": ["aotriton", "sdpa:default", "sdpa:flash"],
              "ours": "aotriton", "results": {"aotriton": _llama_contender(1600.0, 80.0),
                                              "sdpa:default": _llama_contender(4800.0, 100.0),
                                              "sdpa:flash": _llama_contender(1400.0, 120.0, agree=0.75)}}
    bench.llama_summary(result)
    out = capsys.readouterr().out
    assert "LLAMA padding=none (" in out and "8 x 512 prompt, 128 new tokens" in out
    assert "padding=none: aotriton vs sdpa:default: speed generate x3.00, prefill x1.00, train x1.00" in out
    assert "ours/theirs 0.80 (target <= 0.8)" in out
    assert "padding=none: aotriton vs sdpa:flash (fastest SDPA generate): speed generate x0.88" in out
    assert "ours/theirs 0.67" in out and "WARNING" not in out
    assert "greedy tokens equal to aotriton's: sdpa:default 100.0%, sdpa:flash 75.0%" in out
    result["results"]["sdpa:flash"]["cache"] = "StaticCache"
    bench.llama_summary(result)
    assert "padding=none: the contenders' generate used different cache classes: ['DynamicCache', 'StaticCache']" \
        in capsys.readouterr().out


def test_the_llama_summary_labels_the_left_padded_mode_and_its_prompt_lengths(bench, capsys) -> None:
    # A padded mode without flash (it takes no padding mask): the fastest SDPA is cuDNN.
    result = {"padding": "left", "prompt_lengths": [256, 64, 512, 448, 128, 384, 320, 192],
              "contenders": ["aotriton", "sdpa:default", "sdpa:cudnn"], "ours": "aotriton",
              "results": {"aotriton": _llama_contender(2000.0, 90.0), "sdpa:default": _llama_contender(3000.0, 100.0),
                          "sdpa:cudnn": _llama_contender(2500.0, 100.0)}}
    bench.llama_summary(result)
    out = capsys.readouterr().out
    assert "LLAMA padding=left (" in out and "8 prompts of 64..512 tokens, left-padded to 512" in out
    assert "padding=left: aotriton vs sdpa:default: speed generate x1.50" in out
    assert "padding=left: aotriton vs sdpa:cudnn (fastest SDPA generate): speed generate x1.25" in out
    assert "padding=none" not in out


def test_the_left_padded_batch_holds_prompts_of_every_length_padded_on_the_left(bench) -> None:
    import torch

    plain, left = bench.llama_batch("none", device="cpu"), bench.llama_batch("left", device="cpu")
    assert plain["positions"] is None and bool(plain["mask"].all()) and plain["lengths"] == [512] * 8
    assert sorted(left["lengths"], reverse=True) == list(bench.LLAMA_LENGTHS)
    assert left["lengths"] != sorted(left["lengths"]) and left["lengths"] == bench.llama_batch("left", "cpu")["lengths"]
    mask, prompt, pos = left["mask"], left["prompt"], left["positions"]
    assert prompt.shape == mask.shape == pos.shape == (8, 512)
    for b, n in enumerate(left["lengths"]):
        assert mask[b].tolist() == [0] * (512 - n) + [1] * n  # left padding: the real tokens end the row
        assert bool((prompt[b, : 512 - n] == 0).all()) and bool((prompt[b, 512 - n:] >= 3).all())
        assert pos[b].tolist() == [0] * (512 - n) + list(range(n))  # as generate() makes them
    # The real tokens are the unpadded batch's own (the prompts differ in length only).
    assert torch.equal(prompt[mask == 1], plain["prompt"][mask == 1])
    with pytest.raises(ValueError, match="padding must be one of"):
        bench.llama_batch("right", device="cpu")


def test_the_padded_training_loss_gives_the_pads_no_gradient(bench) -> None:
    import torch

    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    logits = torch.randn(2, 4, 5, dtype=torch.bfloat16, requires_grad=True)
    loss = bench.train_loss(logits, mask, padded=True)
    assert loss.item() == pytest.approx(logits.float()[mask == 1].mean().item(), rel=1e-5)
    loss.backward()
    assert bool((logits.grad[0, :2] == 0).all()) and bool((logits.grad[mask == 1] != 0).all())
    assert bench.train_loss(logits, mask, padded=False).item() == pytest.approx(logits.float().mean().item())


def test_the_command_line_runs_both_batch_modes_and_one_gqa_ratio_for_prefill(bench) -> None:
    args = bench.parse_args(["--llama"])
    assert args.llama_padding == ["none", "left"] and args.gqa == [4, 8]
    args = bench.parse_args(["--prefill", "--prefill-shapes", "8x1024", "1x8192"])
    assert args.gqa == [4] and args.page == [16, 256] and args.prefill_shapes == ["8x1024", "1x8192"]
    assert bench.parse_args(["--prefill", "--gqa", "8"]).gqa == [8]
    with pytest.raises(SystemExit):
        bench.parse_args(["--llama", "--llama-padding", "right"])
    with pytest.raises(SystemExit, match=r"--prefill-shapes: '8by1024' is not BxS \(e.g. 8x1024\)"):
        bench.parse_pairs(["8by1024"], "--prefill-shapes", "8x1024")


def test_the_prefill_summary_holds_the_paged_caches_to_ten_percent_of_varlen(bench, capsys) -> None:
    assert bench.causal_flops(1, 2, 1, 1) == 12  # 3 visible pairs x 2 matmuls x 2 FLOPs
    assert bench._round_ratios([1.1, 1.0, 1.3], [1.0, 1.0, 1.0]) == {
        "median": pytest.approx(1.1), "min": pytest.approx(1.0), "max": pytest.approx(1.3)}

    def row(B: int, S: int, times: dict[str, list[float]], graphed: bool = True) -> dict:
        flops = bench.causal_flops(B, S, 32, 128)
        stats = {n: {**bench._stats(v), "tflops": flops / (sorted(v)[1] * 1e-3) / 1e12} for n, v in times.items()}
        ratios = {n: bench._round_ratios(v, times["varlen"]) for n, v in times.items() if n != "varlen"}
        return {"B": B, "S": S, "Hq": 32, "Hkv": 8, "D": 128, "pages": [16, 256], "flops": flops,
                "max_error_vs_varlen": {n: 0.004 for n in times if n != "varlen"} | {"p16": 0.2},
                "eager": stats, "graph": stats if graphed else {},
                "vs_varlen": {"eager": ratios, "graph": ratios if graphed else {}}}

    small = row(8, 1024, {"varlen": [0.20, 0.21, 0.19], "p256": [0.21, 0.22, 0.20], "p16": [0.24, 0.25, 0.23]})
    long = row(1, 8192, {"varlen": [1.0, 1.0, 1.0], "p256": [1.02, 1.01, 1.03], "p16": [1.05, 1.04, 1.06]},
               graphed=False)
    bench.prefill_summary([small, long])
    out = capsys.readouterr().out
    lines = out.splitlines()
    p256 = next(line for line in lines if line.split()[:4] == ["8", "1024", "32/8", "p256"])
    assert p256.split()[8:11] == ["1.05", "[1.05-1.05]", "1.05"]  # 0.21/0.20, 0.22/0.21, 0.20/0.19 round by round
    varlen = next(line for line in lines if line.split()[:4] == ["1", "8192", "32/8", "varlen"])
    assert varlen.split()[4:8] == ["|", "-", f"{bench.causal_flops(1, 8192, 32, 128) / 1e-3 / 1e12:.1f}", "|"]
    assert "WRONG" in next(line for line in lines if line.split()[:4] == ["8", "1024", "32/8", "p16"])
    assert "p256/varlen: 8x1024 1.05, 1x8192 1.02 (eager): within 10% of varlen" in out
    assert "p16/varlen: 8x1024 1.20, 1x8192 1.05 (eager): NOT within 10% of varlen" in out


def test_the_pdl_table_pairs_the_three_policies_round_by_round(bench, capsys) -> None:
    # Per-round graph times (ms): contiguous, where PDL is slower and the rule launched plainly,
    # and paged, where PDL is faster and the rule kept it.
    times = {"ours": [0.070, 0.068, 0.069], "ours@on": [0.080, 0.078, 0.081], "ours@off": [0.068, 0.070, 0.069],
             "p64": [0.067, 0.066, 0.067], "p64@on": [0.066, 0.067, 0.067], "p64@off": [0.069, 0.068, 0.070],
             "ours#2": [0.070] * 3, "sdpa:cudnn": [0.068] * 3}
    ratios = bench.pdl_ratios(times)
    assert set(ratios) == {"ours", "p64"}  # forced configs and SDPA have no policy twins
    assert ratios["ours"]["on/off"]["median"] == pytest.approx(0.081 / 0.069)  # rounds: 1.18, 1.11, 1.17
    assert ratios["ours"]["on/off"]["min"] == pytest.approx(0.078 / 0.070)
    assert ratios["ours"]["rule/best"]["max"] == pytest.approx(0.070 / 0.068)  # best of the round, not of medians
    assert ratios["ours"]["rule/best"]["min"] == pytest.approx(0.068 / 0.070)
    assert ratios["p64"]["rule/best"]["median"] == pytest.approx(1.0)
    row = {"B": 8, "cache": 8192, "gqa": 4, "pages": [64], "pdl_ratios": ratios, "pdl": {"ours": False, "p64": True},
           "graph": {n: {"median_us": sorted(v)[1] * 1e3, "spread": 0.0} for n, v in times.items()}}
    bench.pdl_summary([row])
    out = capsys.readouterr().out.splitlines()
    contiguous = next(line for line in out if " ours |" in line)
    assert contiguous.split() == ["8", "8192", "4:1", "ours", "|", "80.0", "69.0", "69.0", "plain", "|", "1.17",
                                  "[1.11-1.18]", "|", "1.00", "[0.97-1.03]"]
    assert " p64 |" in out[-1] and out[-1].split()[8] == "PDL"
    # Without SDPA contenders the main table still lists ours and the paged cache (no x column).
    bench.summary([{**row, "graph": {n: {**s, "bw_pct": 50.0} for n, s in row["graph"].items()
                                     if not n.startswith("sdpa")}}])
    line = capsys.readouterr().out.splitlines()[3]
    assert line.split()[:6] == ["8", "8192", "4:1", "|", "-", "-"] and "69.0" in line and "nan" in line


def test_the_forced_pdl_policies_wrap_the_runtimes_rule_in_the_benchmarks_process(
        bench, monkeypatch: pytest.MonkeyPatch) -> None:
    from aotriton_rt.ops.decode import launch
    from tests.runtime.test_decode_pdl_rule import _plan

    rule = launch.pdl_choice
    monkeypatch.setattr(launch, "pdl_choice", rule)  # put back after the test
    monkeypatch.setitem(bench.PDL_POLICY, "now", "rule")
    bench.force_pdl_policies()
    forced = launch.pdl_choice
    bench.force_pdl_policies()  # once is enough: never wrapped twice
    assert launch.pdl_choice is forced and forced is not rule
    slow, fast = _plan(8, 8192), _plan(1, 2048, paged=True)
    assert forced(slow, 5) == rule(slow, 5) and forced(slow, 5)[0] is False
    bench.PDL_POLICY["now"] = "on"
    assert forced(slow, 5) == (True, "PDL (policy 'on')")
    bench.PDL_POLICY["now"] = "off"
    assert forced(fast, 7) == (False, "no PDL (policy 'off')")


def test_contenders_with_other_rules_or_a_forced_policy_call_views_with_plans_of_their_own(bench) -> None:
    class Lib:
        def with_tuning(self, rules: dict) -> tuple:
            return ("view", rules)

    lib, images = Lib(), [{"arch": "sm90", "config": 2}]
    assert bench.contender_library(lib, images, images, "rule") is lib
    assert bench.contender_library(lib, images, images, "off") == ("view", {})
    assert bench.contender_library(lib, [{"config": 0}], images, "rule") == ("view", {"attn_decode": [{"config": 0}]})


def test_the_fp8_mode_parses_its_shapes_and_reports_the_speedup_per_round(bench, capsys) -> None:
    args = bench.parse_args(["--fp8", "--fp8-shapes", "32x8192", "64x8192"])
    assert args.fp8 and bench.parse_pairs(args.fp8_shapes, "--fp8-shapes", "32x8192") == [(32, 8192), (64, 8192)]
    fp8 = load_bench("decode_fp8.py")
    stats = {"median_us": 100.0, "spread": 0.02, "bw_pct": 80.0, "graph": True}
    row = {"B": 32, "S": 8192, "hq": 32, "hkv": 8, "d": 128, "errors": {"bf16": 1e-3, "fp8": 2e-3},
           "contenders": {"bf16": stats, "fp8": {**stats, "median_us": 55.0}},
           "speedup": {"contiguous": {"median": 1.82, "min": 1.75, "max": 1.9}},
           "over_base": {"fp8#4": {"median": 1.1, "min": 1.05, "max": 1.2}}}
    fp8._print_row(row)
    fp8.fp8_summary([row])
    text = capsys.readouterr().out
    assert "fp8 speedup over bf16 (contiguous): 1.82x [1.75-1.90] (aim >= 1.7)" in text
    assert "fp8#4 against the baseline images: 1.100x as fast [1.050-1.200]" in text
    assert bench.parse_args(["--fp8", "--baseline", "/x"]).baseline == "/x"
    assert "worst median speedup: 1.82x" in text
