"""bench/decode.py's forced contenders and summary (the GPU timing runs on the H200 only)."""

from __future__ import annotations

import argparse

import pytest

from aotriton_rt.ops.decode import SplitRule, split_rule
from tests.helpers.benches import load_bench


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("torch")
    return load_bench("decode.py")


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"config": [], "min_blocks": [], "waves": None, "combine": [], **kw})


def test_a_combine_contender_keeps_the_images_configs_and_splits(bench) -> None:
    images = [{"arch": "sm90", "min_batch_heads": 212, "config": 2, "splits": {"min_blocks": 4}},
              {"arch": "sm90", "splits": {"waves": 2}}]
    (tag, rules), = bench._variants(_args(combine=["separate"]), images)
    assert tag == "~separate"
    # A big batch still gets config #2, a small one the images' splits; both merge separately.
    assert split_rule(rules, "sm90", batch_heads=512) == (SplitRule(combine="separate"), 2)
    assert split_rule(rules, "sm90", batch_heads=8) == (SplitRule(combine="separate"), 0)
    assert split_rule(rules, "gfx942")[0].combine == "separate"  # past the images' own rules
    assert split_rule(images, "sm90", batch_heads=8)[0].combine == "separate"  # the default contender
    assert [t for t, _ in bench._variants(_args(config=[0, 2], combine=["fused", "separate"]), None)] == \
        ["#0", "#2", "~fused", "~separate"]


def test_the_summary_compares_each_forced_contender_with_its_default(bench, capsys) -> None:
    def stats(us: float, x: float) -> dict:
        return {"median_us": us, "vs_sdpa": x, "bw_pct": 50.0, "spread": 0.0}

    row = {"B": 1, "cache": 2048, "gqa": 4, "pages": [16],
           "graph": {"sdpa:cudnn": stats(8.6, 1.0), "ours": stats(8.0, 1.075), "p16": stats(8.4, 1.02),
                     "ours~separate": stats(10.0, 0.86), "p16~separate": stats(10.5, 0.82)},
           "graph_sdpa_best": "sdpa:cudnn", "eager": {}}
    bench.summary([row])
    out = capsys.readouterr().out
    assert "ours~separate: 1/2048/4:1 x0.86 [0.80]" in out
    assert "p16~separate: 1/2048/4:1 x0.82 [0.80]" in out
    assert "0.95" in out.split("\n")[3]  # p16 /c: 8.0 / 8.4
