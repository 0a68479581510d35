"""bench/build_cost.py: pricing a build set from per-variant timing records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the set is what the builder's declarations expand to")

from bench import build_cost  # noqa: E402


def _record(kernel: str, arch: str, spec: dict, cpu: float, first: bool = False, config: int = 0) -> dict:
    return {"key": f"{kernel}{arch}{sorted(spec.items())}{cpu}", "kernel": kernel, "arch": arch, "spec": spec,
            "config": config, "cpu_s": cpu, "wall_s": cpu, "first": first, "xz_bytes": 1000, "raw_bytes": 4000}


def test_a_variant_is_priced_by_the_most_specific_group_with_timings() -> None:
    causal = {"dtype": "fp16", "HEAD_DIM": 64, "CAUSAL": 2, "DROPOUT": 0}
    records = [_record("attn_fwd", "sm90", causal, 6.0), _record("attn_fwd", "sm90", {**causal, "CAUSAL": 0}, 2.0),
               _record("attn_fwd", "gfx942", {**causal, "HEAD_DIM": 128}, 4.0),
               _record("attn_fwd", "gfx1100", causal, 9.0, first=True)]  # a worker's first job: left out
    means, start = build_cost._price(records)
    price = lambda arch, spec: next(means[g] for g in build_cost._groups("attn_fwd", arch, spec, 0) if g in means)
    assert price("sm90", {**causal, "dtype": "bf16"}) == 6.0  # same target, head dim and mask
    assert price("sm90", {**causal, "CAUSAL": 1, "HEAD_DIM": 256}) == 6.0  # same target and mask class
    assert price("sm80", {**causal, "CAUSAL": 0}) == 2.0  # the family (CUDA) and mask class
    assert price("gfx950", causal) == 4.0  # CDNA, causal: gfx942's
    assert price("gfx1151", causal) == pytest.approx(4.0)  # no RDNA timing counts: the kernel's mean, (6+2+4)/3
    # The first job cost 9 s where the same group (here the kernel's mean) costs 4 s: 5 s of start.
    assert start == pytest.approx(5.0)


def test_estimate_prints_the_total_and_the_wall_time_on_the_workers(tmp_path: Path, capsys) -> None:
    timings = tmp_path / "t.jsonl"
    timings.write_text("\n".join(json.dumps(_record("add", arch, {"dtype": "fp32"}, 1.0))
                                 for arch in ("sm90", "gfx942", "gfx1100")) + "\n")
    assert build_cost.main(["estimate", "--set", "default", "--kernels", "add", "--timings", str(timings)]) == 0
    out = capsys.readouterr().out
    # 3 variants of add on each of the seven default targets at 1 CPU s each: 21 s, 10.5 s on 2 workers.
    assert "default: 21 variants priced from 3 timed" in out and "21 CPU s" in out
    assert "idle wall on 2 cores ~ 10 s" in out
