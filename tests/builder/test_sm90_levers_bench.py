"""bench/sm90_levers.py's orchestration on the CPU: a checking process that hangs costs one
variant, not the lever or the run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def levers(monkeypatch: pytest.MonkeyPatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import sm90_levers

    monkeypatch.setattr(sm90_levers, "contenders_of", lambda folders: ["a", "b", "c", "d"])
    return sm90_levers


def _fake_child(hang_at: set[int], calls: list):
    def run(argv: list[str], timeout: float):
        start = int(argv[argv.index("--start") + 1])
        path = Path(argv[argv.index("--result") + 1])
        calls.append(start)
        for i in range(start, 4):
            if i in hang_at:
                return f"timed out after {timeout:.0f} s"
            with path.open("a") as f:
                f.write(json.dumps({"index": i, "ok": True, "label": f"v{i}", "key": f"k{i}", "spec": {}}) + "\n")
        return None
    return run


def test_a_hung_check_fails_that_variant_and_a_new_process_checks_the_rest(levers, monkeypatch, tmp_path) -> None:
    calls: list = []
    monkeypatch.setattr(levers, "_run_child", _fake_child({1}, calls))
    results = levers.run_checks({}, 90.0, tmp_path)
    assert calls == [0, 2]
    assert [(r["index"], r["ok"]) for r in results] == [(0, True), (1, False), (2, True), (3, True)]
    assert results[1]["error"] == "timed out after 90 s" and results[1]["key"] is None


def test_a_hang_on_the_last_variant_ends_the_checks(levers, monkeypatch, tmp_path) -> None:
    calls: list = []
    monkeypatch.setattr(levers, "_run_child", _fake_child({3}, calls))
    results = levers.run_checks({}, 5.0, tmp_path)
    assert calls == [0]
    assert [r["ok"] for r in results] == [True, True, True, False]


def test_a_child_that_times_out_is_reported_not_raised(levers) -> None:
    why = levers._run_child(["--child-check", "{}", "--start", "0", "--result", "/dev/null"], timeout=0.01)
    assert why == "timed out after 0 s"


def test_a_wrong_result_is_located_by_rows_tile_half_and_nan(levers) -> None:
    torch = pytest.importorskip("torch")
    ref = torch.zeros(2, 3, 300, 8)
    out = ref.clone()
    out[1, 2, 200] = 1.0  # row 200: second half of its 128-row tile
    out[0, 0, 10, 3] = float("nan")  # row 10: first half
    ref_lse = torch.zeros(2, 3, 300)
    lse = ref_lse.clone()
    lse[0, 1, 299] = float("-inf")
    d = levers.diagnose(torch, out, lse, ref, ref_lse, 1e-2)
    assert d["bad_rows"] == 2 and d["first_bad_rows"] == [10, 200]
    assert d["bad_rows_in_tile_half_0_1"] == [1, 1]
    assert d["nan_out"] == 1 and d["nan_lse"] == 0 and d["lse_inf_rows_disagree"] == 1
    assert d["bad_heads"] == [1, 0, 1]


def test_time_shapes_records_every_shape_a_timed_one_a_failed_one_and_one_past_the_budget(levers, monkeypatch,
                                                                                          tmp_path) -> None:
    """The per-shape loop both forward lever benches share: each shape's result is appended as soon as
    it is known, an exception costs that shape only, and once the budget is spent the rest say so."""
    timed: list = []

    def fake_time_shape(torch, shape, mine, rounds, launches, deadline, rng):
        if shape == "bad":
            raise RuntimeError("no variant")
        timed.append((shape, mine, rounds, launches))
        return {"shape": shape, "rows": {"x": 1.0}}

    monkeypatch.setattr(levers, "time_shape", fake_time_shape)
    out = tmp_path / "t.jsonl"
    levers.time_shapes(None, ["s1", "bad", "s2"], lambda s: [s.upper()], 3, 20, 60.0, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["shape"] for r in rows] == ["s1", "bad", "s2"]
    assert timed == [("s1", ["S1"], 3, 20), ("s2", ["S2"], 3, 20)]
    assert rows[1]["errors"] == {"_shape": "RuntimeError: no variant"}
    late = tmp_path / "late.jsonl"
    levers.time_shapes(None, ["s3"], lambda s: [], 3, 20, -1.0, late)
    assert json.loads(late.read_text())["errors"] == {"_budget": "time budget spent before this shape"}
