"""bench/attention.py's shapes, ratios and tables (the GPU timing itself is builder/gputime.py's)."""

from __future__ import annotations

import argparse

import pytest

from tests.helpers.benches import load_bench


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("torch")
    return load_bench("attention.py")


def _args(**kw) -> argparse.Namespace:
    base = {"dtype": None, "n": None, "d": None, "b": 4, "h": 32, "causal": None, "shapes": "d128,d64,n1024,n16384"}
    return argparse.Namespace(**{**base, **kw})


def test_the_default_shapes_are_the_acceptance_grid(bench) -> None:
    shapes = bench.problems(_args())
    assert len(shapes) == 14
    assert {s for s in shapes if s[3] == 128 and s[2] == 4096} == {
        (4, 32, 4096, 128, c, dt) for c in (False, True) for dt in ("fp16", "bf16")}
    assert {s[:4] for s in shapes} == {(4, 32, 4096, 128), (4, 32, 4096, 64), (16, 32, 1024, 128),
                                       (4, 32, 16384, 128)}
    assert all(s[4] for s in shapes if s[2] == 16384)  # N=16384: causal only
    assert bench.problems(_args(shapes="n1024", causal=[1], dtype=["bf16"])) == [(16, 32, 1024, 128, True, "bf16")]
    assert bench.problems(_args(n=[2048], d=[64], causal=[0])) == [(4, 32, 2048, 64, False, "fp16"),
                                                                     (4, 32, 2048, 64, False, "bf16")]


def test_ratios_are_speed_ratios_against_cudnn_inference_training_and_the_jit(bench) -> None:
    got = bench.ratios({"ours fwd": 2.0, "cudnn-inf fwd": 1.6, "cudnn-train fwd": 1.8, "jit fwd": 2.0,
                        "ours bwd": 5.0, "cudnn-train bwd": 4.0})
    assert got == {"fwd/cudnn-inf": 0.8, "fwd/cudnn-train": 0.9, "bwd/cudnn": 0.8, "fwd/jit": 1.0}


def test_a_baseline_folder_is_timed_as_base_and_ratioed_against_ours(bench) -> None:
    # --baseline: the same operator calls on other images (e.g. the kernels before a change).
    got = bench.ratios({"ours fwd": 2.0, "base fwd": 2.2, "ours bwd": 5.0, "base bwd": 4.5})
    assert got == pytest.approx({"fwd/base": 1.1, "bwd/base": 0.9})
    assert bench.CONTENDERS["base bwd"] == bench.CONTENDERS["ours bwd"]


def test_the_tables_show_medians_spread_and_ratios(bench, capsys) -> None:
    row = {"shape": "fp16 B4 H32 N4096 D128 full", "ratios": {"fwd/cudnn-inf": 0.83},
           "contenders": {"ours fwd": {"tflops": 500.0, "median_ms": 2.0, "min_ms": 1.9, "max_ms": 2.1}}}
    bench.print_tables([row])
    out = capsys.readouterr().out
    assert "500 (10.0)" in out and "0.83" in out and "FlashAttention-2" in out
