"""builder tune's measuring loop on the CPU: a real Library over a synthetic sm90 catalog (nothing is
launched), the operator replaced by a stand-in that reports the config the runtime's tuning table
forced, and a clock that charges each config its own time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import aotriton_rt
from builder import tuning
from builder.tune import ForcedConfig, measure
from tests.runtime.test_attention_op import _synthetic_variant

BASE = {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0}
COST_MS = {0: 1.0, 1: 0.5, 2: 0.1}  # config 2 is fastest, but computes a wrong result


@pytest.fixture
def lib(tmp_path: Path) -> aotriton_rt.Library:
    variants = [_synthetic_variant("attn_fwd", {**BASE, "CAUSAL": c}, i) for c in (0, 2) for i in (0, 1, 2)]
    for c in (0, 2):
        variants.append(_synthetic_variant("attn_bwd_dkdv", {**BASE, "CAUSAL": c, "DQ_ATOMIC": 0}))
        variants.append(_synthetic_variant("attn_bwd_dq", {**BASE, "CAUSAL": c}))
    variants.append(_synthetic_variant("attn_bwd_preprocess", {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128,
                                                               "VARLEN": 0, "DQ_ATOMIC": 0}))
    (tmp_path / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                       "triton_version": "3.6.0", "tuning": {},
                                                       "variants": variants}))
    return aotriton_rt.Library(tmp_path)


class Operator:
    """Stands in for aotriton_rt.attention: reads the config the library's tuning forces."""

    def __init__(self) -> None:
        self.config = 0
        self.seen: set[int] = set()

    def __call__(self, q, k, v, *, causal, library):
        import torch

        rules = library.catalogs[0].tuning.get("attn_fwd") if isinstance(library, ForcedConfig) else None
        self.config = rules[0]["config"] if rules else 0
        self.seen.add(self.config)
        out = q.float() * (3.0 if self.config == 2 else 1.0)
        return out, torch.zeros(q.shape[:3])


class Clock:
    def __init__(self, op: Operator) -> None:
        self.op = op

    def calls(self, fn, n: int, flush: bool) -> list[float]:
        fn()
        return [COST_MS[self.op.config]] * n

    def sync(self) -> None:
        pass


def test_measure_times_every_built_config_through_the_runtime_and_never_picks_a_wrong_one(
        lib: aotriton_rt.Library, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    op = Operator()
    monkeypatch.setattr(aotriton_rt, "attention", op)
    logged: list[str] = []
    entries = measure(lib, "sm90", ["attn_fwd", "attn_bwd_dq"], ["fp16"], [128], [False, True], [256, 1024],
                      heads=2, tokens=1, rounds=2, device="cpu", clock=Clock(op), log=logged.append)
    assert op.seen == {0, 1, 2}
    assert [(e.kernel, e.spec["CAUSAL"], e.bin) for e in entries] == [
        ("attn_fwd", 0, 256), ("attn_fwd", 0, 1024), ("attn_fwd", 2, 256), ("attn_fwd", 2, 1024)]
    for e in entries:
        assert e.shape == {"batch": 1, "heads": 2, "seqlen_q": e.bin, "seqlen_k": e.bin}
        assert [(t.index, t.us) for t in e.timings] == [(0, 1000.0), (1, 500.0), (2, None)]
        assert e.timings[2].note == "wrong result: differs from config #0"
        assert e.timings[1].params["BLOCK_M"] and e.timings[1].spread == (500.0, 500.0)
    assert "attn_bwd_dq fp16 D128 full: 1 config built, nothing to choose" in logged
    db = tuning.database(entries, arch="sm90", machine={"gpu": "test"}, method={})
    assert [(r["spec"]["CAUSAL"], r["seqlen_q"], r["config"]) for r in db["rules"]["attn_fwd"]] == [
        (0, [None, None], 1), (2, [None, None], 1)]


def test_a_forced_view_makes_the_dispatcher_pick_that_config_and_leaves_the_library_alone(
        lib: aotriton_rt.Library) -> None:
    from aotriton_rt.ops import attention as op
    from tests.runtime.test_attention_op import qkv

    for index in (0, 1, 2):
        handle = op.attention_kernels(*qkv(S=300, D=128), causal=True, library=ForcedConfig(lib, "attn_fwd", index))
        assert handle["attn_fwd"].candidates[0].config.index == index
    assert op.attention_kernels(*qkv(S=300, D=128), library=lib)["attn_fwd"].candidates[0].config.index == 0
    assert lib.catalogs[0].tuning == {}
