"""bench/sm90_bwd.py on the CPU: what it builds, how a faulting check costs one config, the
reference bound, and the summary table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench():
    sys.path.insert(0, str(ROOT / "bench"))
    import sm90_bwd

    return sm90_bwd


def test_it_builds_the_bwdsweep_jobs_of_the_asked_shapes_only(bench) -> None:
    from builder.kernels.attention_bwd import _SM90_DKDV_SWEEP, _SM90_DQ_SWEEP

    shapes = bench.shapes_of("0,3", "fp16")
    assert shapes == [("fp16", 128, 0, 4, 32, 4096), ("fp16", 64, 2, 4, 32, 4096)]
    jobs = bench.sweep_jobs(shapes, "3.6.0")
    assert {j.target.arch for j in jobs} == {"sm90"}
    count = {name: sum(j.kernel == name for j in jobs) for name in
             ("attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq")}
    assert count == {"attn_fwd": 2, "attn_bwd_preprocess": 2,
                     "attn_bwd_dkdv": 2 + len(_SM90_DKDV_SWEEP[128]) + len(_SM90_DKDV_SWEEP[64]),
                     "attn_bwd_dq": 2 + len(_SM90_DQ_SWEEP[128]) + len(_SM90_DQ_SWEEP[64])}
    assert {bench.spec_key(j.spec) for j in jobs if j.kernel != "attn_bwd_preprocess"} == {("fp16", 128, 0),
                                                                                          ("fp16", 64, 2)}


def _fake_child(fault_at: set[int], calls: list, total: int = 4):
    def run(argv: list[str], timeout: float):
        start = int(argv[argv.index("--start") + 1])
        path = Path(argv[argv.index("--result") + 1])
        calls.append((start, argv[1]))
        for i in range(start, total):
            if i in fault_at:
                return "exit status -11"
            with path.open("a") as f:
                f.write(json.dumps({"number": i, "ok": True, "kernel": "attn_bwd_dq"}) + "\n")
        return None
    return run


def test_a_check_that_faults_fails_its_config_and_a_new_process_checks_the_rest(bench, monkeypatch,
                                                                                tmp_path) -> None:
    calls: list = []
    monkeypatch.setattr(bench, "_run_child", _fake_child({1}, calls))
    results = bench.run_checks("/images", ["--shapes", "all"], 4, 60.0, tmp_path)
    assert calls == [(0, "/images"), (2, "/images")]
    assert [(r["number"], r["ok"]) for r in results] == [(0, True), (1, False), (2, True), (3, True)]
    assert results[1]["error"] == "exit status -11"
    assert bench.check_line(results[1]) == "[check] FAIL candidate 1: exit status -11"


def test_a_child_that_times_out_is_reported_not_raised(bench) -> None:
    why = bench._run_child(["--child-check", "/nonexistent", "--start", "0", "--result", "/dev/null"], timeout=0.01)
    assert why == "timed out after 0 s"


def test_the_bound_is_the_input_dtype_error_times_four_plus_epsilon_and_nan_fails(bench) -> None:
    torch = pytest.importorskip("torch")
    hi = torch.zeros(4, 4)
    hi[0, 0] = 2.0
    lo = hi.clone()
    lo[1, 1] = 0.01  # the fp16 math is off by 0.01: the bound is 4 * 0.01 + 5e-4 * 2.0
    good = hi.clone()
    good[2, 2] = 0.04
    assert bench.grad_error(torch, good, hi, lo, "fp16") == pytest.approx(
        {"err": 0.04, "bound": 0.041, "ok": True, "nan": 0})
    bad = hi.clone()
    bad[2, 2] = 0.05
    assert not bench.grad_error(torch, bad, hi, lo, "fp16")["ok"]
    nan = hi.clone()
    nan[3, 3] = float("nan")
    res = bench.grad_error(torch, nan, hi, lo, "bf16")
    assert not res["ok"] and res["nan"] == 1


def _result(shape, best, per_kernel, rows, notes=()):
    def row(ms, lo, hi, ratio=None, tflops=0.0):
        return {"median_ms": ms, "min_ms": lo, "max_ms": hi, "tflops": tflops, "ratio": ratio,
                "tflops_min": 0.0, "tflops_max": 0.0}
    return {"shape": list(shape), "best": best, "notes": list(notes),
            "per_kernel": {n: row(*v) for n, v in per_kernel.items()},
            "rows": {n: row(*v) for n, v in rows.items()}}


def test_the_summary_gives_each_shape_its_peers_ratios_and_winning_configs(bench) -> None:
    cands = [{"kernel": "attn_bwd_dkdv", "spec": {"dtype": "fp16", "HEAD_DIM": 128, "CAUSAL": 0}, "index": i,
              "tile": t} for i, t in ((0, "64x128 w8s2 USE_TMA=0"), (3, "64x128 w8s3 USE_TMA=0"))]
    cands.append({"kernel": "attn_bwd_dq", "spec": {"dtype": "fp16", "HEAD_DIM": 128, "CAUSAL": 0}, "index": 0,
                  "tile": "128x64 w8s3 USE_TMA=0"})
    results = [
        _result(("fp16", 128, 0, 4, 32, 4096), {"attn_bwd_dkdv": 3, "attn_bwd_dq": 0},
                {"#0": (6.0, 5.9, 6.2), "dkdv#3": (5.4, 5.3, 5.6)},
                {"cudnn": (4.0, 3.9, 4.1, 1.0, 550.0), "ours#0": (6.0, 5.9, 6.1, 0.667, 366.0),
                 "ours-best": (5.4, 5.3, 5.5, 0.741, 407.0)}),
        _result(("bf16", 64, 2, 4, 32, 4096), {}, {}, {}, notes=["cudnn: RuntimeError: no kernel"]),
    ]
    text = "\n".join(bench.summary_lines(results, cands))
    assert "  dkdv#3    0.900 [0.883-0.933]   64x128 w8s3 USE_TMA=0" in text
    assert "fp16 D128 full B4H32N4096: #0 = 6.000 ms" in text
    assert ("fp16 D128 full B4H32N4096   winners: dkdv#3 64x128 w8s3 USE_TMA=0 / dq#0 128x64 w8s3 USE_TMA=0"
            in text)
    assert "    407.0 [   0.0-   0.0]  x0.741  ours-best" in text
    last = text.splitlines()[text.splitlines().index("== summary: TFLOP/s and ratio to cuDNN") + 2]
    assert last.split() == ["fp16", "D128", "full", "B4H32N4096", "550", "-", "366", "x0.67", "407", "x0.74"]
    assert "bf16 D64 causal B4H32N4096" in text
    assert "(note) bf16 D64 causal B4H32N4096: cudnn: RuntimeError: no kernel" in text


@pytest.mark.parametrize("causal", [0, 2])
def test_the_reference_is_torchs_attention_backward_with_gqa_and_the_bottom_right_band(bench, causal: int) -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(causal)
    q, do = (torch.randn(2, 4, 9, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, 13, 16, generator=gen) for _ in range(2))
    got = bench.reference(torch, q, k, v, do, causal, 0.3, torch.float32)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    # Bottom-right: query i sees keys j <= i + (13 - 9).
    mask = torch.ones(9, 13, dtype=torch.bool).tril(13 - 9) if causal else None
    out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=0.3, enable_gqa=True)
    want = torch.autograd.grad(out, (qg, kg, vg), do)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.allclose(a, b, atol=1e-5), name


def test_query_rows_that_see_no_key_get_no_gradient_in_the_reference(bench) -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(7)
    q, do = (torch.randn(1, 2, 12, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, 5, 8, generator=gen) for _ in range(2))
    dq, dk, dv = bench.reference(torch, q, k, v, do, 2, 0.5, torch.float32)
    # Bottom-right with 12 queries on 5 keys: rows 0-6 see nothing.
    assert dq[:, :, :7].abs().max() == 0 and dq[:, :, 7:].abs().max() > 0
    assert all(bool(torch.isfinite(g).all()) for g in (dq, dk, dv))
    qg, kg, vg = (t[:, :, 7:].clone().requires_grad_() if t is q else t.clone().requires_grad_() for t in (q, k, v))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=0.5)
    want = torch.autograd.grad(out, (qg, kg, vg), do[:, :, 7:])
    assert torch.allclose(dq[:, :, 7:], want[0], atol=1e-5)
    assert torch.allclose(dk, want[1], atol=1e-5) and torch.allclose(dv, want[2], atol=1e-5)


def test_a_check_line_names_the_worst_margin_and_what_failed(bench) -> None:
    def grads(dk_err: float) -> dict:
        return {"dq": {"err": 1e-3, "bound": 1e-2, "ok": True, "nan": 0},
                "dk": {"err": dk_err, "bound": 1e-2, "ok": dk_err <= 1e-2, "nan": int(dk_err != dk_err)}}
    cand = {"kernel": "attn_bwd_dkdv", "label": "dkdv#3", "tile": "32x128 w8s3 USE_TMA=1", "index": 3,
            "spec": {"dtype": "bf16", "HEAD_DIM": 128, "CAUSAL": 2}}
    passed = {**cand, "ok": True, "problems": {"short": {"ok": True, "launched": 3, "grads": grads(5e-3)},
                                               "ragged_gqa": {"ok": True, "launched": 3, "grads": grads(2e-3)}}}
    assert bench.check_line(passed) == ("[check] PASS dkdv#3  32x128 w8s3 USE_TMA=1      bf16 D128 causal: "
                                        "worst error/bound 0.50 (short dk)")
    failed = {**cand, "ok": False, "problems": {"short": {"ok": False, "launched": 0, "grads": grads(float("nan"))},
                                                "ragged_gqa": {"ok": True, "launched": 3, "grads": grads(2e-3)}}}
    line = bench.check_line(failed)
    assert line.startswith("[check] FAIL dkdv#3") and "worst error/bound nan (short dk)" in line
    assert "; short: dq 1.0e-03/1.0e-02 dk nan/1.0e-02 NaN (the operator launched #0)" in line
