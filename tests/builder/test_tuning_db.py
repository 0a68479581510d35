"""The tuning database: decisions from synthetic timings, byte-stable files, folding into builds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from builder import tuning
from builder.registry import expand, load_kernels
from builder.targets import KNOWN
from builder.tuning import Entry, Timing, TuningError

ROOT = Path(__file__).resolve().parents[2]
FWD = {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 2, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0}


def _params(spec: dict, index: int, arch: str = "sm90") -> dict:
    c = load_kernels()["attn_fwd"].configs_for(spec, KNOWN[arch])[index]
    return {**c.constexprs, "num_warps": c.num_warps, "num_stages": c.num_stages}


def _entry(n: int, times: list[float | None], spec: dict = FWD, kernel: str = "attn_fwd") -> Entry:
    shape = {"batch": max(1, (1 << 19) // (n * 32)), "heads": 32, "seqlen_q": n, "seqlen_k": n}
    return Entry(kernel, spec, n, shape, tuple(Timing(i, _params(spec, i) if kernel == "attn_fwd" else {"i": i}, t)
                                               for i, t in enumerate(times)))


def test_an_exact_tie_goes_to_the_lowest_config_index() -> None:
    assert tuning.winner([Timing(0, {}, 10.0), Timing(1, {}, 10.0), Timing(2, {}, 10.0)], 0.0).index == 0
    assert tuning.winner([Timing(2, {}, 10.0), Timing(1, {}, 10.0)], 0.0).index == 1


def test_a_gain_inside_the_tolerance_keeps_the_lower_index_and_a_larger_one_wins() -> None:
    assert tuning.winner([Timing(0, {}, 100.0), Timing(1, {}, 99.5)], 0.01).index == 0
    assert tuning.winner([Timing(0, {}, 100.0), Timing(1, {}, 98.0)], 0.01).index == 1
    assert tuning.winner([Timing(0, {}, 100.0), Timing(1, {}, 99.5)], 0.0).index == 1


def test_configs_without_a_time_are_never_chosen() -> None:
    assert tuning.winner([Timing(0, {}, None, note="failed"), Timing(1, {}, 50.0)]).index == 1
    assert tuning.winner([Timing(0, {}, None), Timing(1, {}, None)]) is None


def test_consecutive_bins_with_one_winner_become_one_range_open_at_both_ends() -> None:
    entries = [_entry(512, [10, 12, 13]), _entry(1024, [20, 22, 23]), _entry(2048, [40, 42, 43]),
               _entry(4096, [90, 80, 95]), _entry(8192, [180, 160, 190]), _entry(16384, [300, 330, 290])]
    rules = tuning.decide(entries, "sm90", "db")["attn_fwd"]
    assert [(r["seqlen_q"], r["config"]) for r in rules] == [([None, 4095], 0), ([4096, 16383], 1),
                                                              ([16384, None], 2)]
    assert rules[1]["source"] == "db, measured at seqlen_q 4096..8192"
    assert rules[1]["expect"] == _params(FWD, 1) and rules[1]["spec"] == FWD and rules[1]["arch"] == "sm90"


def test_the_dkdv_kernel_is_binned_on_the_key_length() -> None:
    spec = {"dtype": "fp16", "HEAD_DIM": 64}
    rules = tuning.decide([_entry(1024, [1, 2], spec, "attn_bwd_dkdv")], "sm90", "db")["attn_bwd_dkdv"]
    assert rules == [{"arch": "sm90", "spec": spec, "seqlen_k": [None, None], "config": 0, "source":
                      "db, measured at seqlen_k 1024..1024", "expect": {"i": 0}}]


def test_the_same_measurements_give_the_same_bytes_in_any_order() -> None:
    entries = [_entry(n, [n + 0.02, n * 0.9, n * 1.3]) for n in (512, 1024, 4096)]
    entries.append(_entry(1024, [5.0, 5.0], {**FWD, "HEAD_DIM": 64, "HEAD_DIM_V": 64}))
    machine = {"gpu": "NVIDIA H200", "driver": "580.1", "arch": "sm90"}
    a = tuning.dumps(tuning.database(entries, arch="sm90", machine=machine, method={"rounds": 5}))
    b = tuning.dumps(tuning.database(entries[::-1], arch="sm90", machine=dict(reversed(machine.items())),
                                     method={"rounds": 5}))
    assert a == b
    # Noise below the file's 0.1 us resolution changes nothing.
    jitter = [Entry(e.kernel, e.spec, e.bin, e.shape, tuple(Timing(t.index, t.params, t.us + 0.01) for t in e.timings))
              for e in entries]
    assert tuning.dumps(tuning.database(jitter, arch="sm90", machine=machine, method={"rounds": 5})) == a
    db = json.loads(a)
    assert "date" not in a.decode() and db["machine"]["gpu"] == "NVIDIA H200"
    assert set(db) == {"schema", "schema_version", "arch", "machine", "method", "entries", "rules"}


def _write_db(path: Path, entries: list[Entry], arch: str = "sm90") -> dict:
    db = tuning.database(entries, arch=arch, machine={"gpu": "NVIDIA H200"}, method={})
    path.write_bytes(tuning.dumps(db))
    return db


def test_a_database_round_trips_and_its_rules_decide_again_the_same(tmp_path: Path) -> None:
    db = _write_db(tmp_path / "t.json", [_entry(n, [n, n * 0.8]) for n in (1024, 2048)])
    loaded = tuning.load(tmp_path / "t.json")
    again = tuning.database(tuning.entries_of(loaded), arch="sm90", machine=loaded["machine"], method={})
    assert tuning.dumps(again) == tuning.dumps(db) == (tmp_path / "t.json").read_bytes()


@pytest.mark.parametrize("text,match", [
    ("[]", r"t\.json: not a tuning database \(schema must be 'aotriton-rt-tuning'\)"),
    ("{", r"t\.json: not JSON"),
    (json.dumps({"schema": "aotriton-rt-tuning", "schema_version": 9}), r"schema_version 9; this builder reads 1"),
    (json.dumps({"schema": "aotriton-rt-tuning", "schema_version": 1, "arch": "sm90", "rules": {
        "attn_fwd": [{"arch": "sm90", "config": -1, "expect": {}}]}}), r"t\.json: catalog tuning\['attn_fwd'\] rule "
                                                                        r".*config must be an integer >= 0"),
    (json.dumps({"schema": "aotriton-rt-tuning", "schema_version": 1, "arch": "sm90", "rules": {
        "attn_fwd": [{"arch": "sm80", "config": 1, "expect": {}}]}}), r"rules\['attn_fwd'\]\[0\] needs arch 'sm90', "
                                                                      r"a config and the measured parameters"),
    (json.dumps({"schema": "aotriton-rt-tuning", "schema_version": 1, "arch": "sm90", "rules": {
        "attn_fwd": [{"arch": "sm90", "config": 1, "source": "x\n"}]}}), r"\.source must be a printable string"),
])
def test_a_malformed_database_is_refused_naming_the_file(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "t.json").write_text(text)
    with pytest.raises(TuningError, match=match):
        tuning.load(tmp_path / "t.json")


def test_a_missing_database_says_it_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(TuningError, match=r"nope\.json: cannot read the tuning database"):
        tuning.load(tmp_path / "nope.json")


def _jobs(arch: str = "sm90", causal: int | None = None) -> list:
    """The gputest set's fp16 D64/D128 attn_fwd jobs (mode 1 only at D128 causal, as in the default
    set); ``causal``: instead the full set's jobs of FWD with that mask mode."""
    if causal is not None:
        return [j for j in expand(load_kernels()["attn_fwd"], [KNOWN[arch]], "full", "3.6.0")
                if j.spec == {**FWD, "CAUSAL": causal}]
    return [j for j in expand(load_kernels()["attn_fwd"], [KNOWN[arch]], "gputest", "3.6.0")
            if j.spec["dtype"] == "fp16" and j.spec["HEAD_DIM"] in (64, 128)]


def test_fold_keeps_rules_whose_config_the_build_holds_as_measured_and_strips_expect() -> None:
    db = tuning.database([_entry(1024, [10, 12]), _entry(4096, [90, 80])], arch="sm90", machine={"gpu": "H200"},
                         method={})
    both = _jobs() + _jobs(causal=2)
    table, notes = tuning.fold([("sm90.json", db)], both, {"attn_decode": [{"arch": "sm90", "config": 0}]})
    assert notes == ["sm90.json: 4 rules folded (2 of them mode-2 rules applied to CAUSAL=1), 0 dropped"]
    assert [(r["spec"]["CAUSAL"], r["config"]) for r in table["attn_fwd"]] == [(2, 0), (1, 0), (2, 1), (1, 1)]
    assert all("expect" not in r for r in table["attn_fwd"])
    assert table["attn_fwd"][2]["source"] == "tuning database sm90 (H200), measured at seqlen_q 4096..4096"
    assert table["attn_decode"] == [{"arch": "sm90", "config": 0}]  # the kernels' own rules follow


def test_rules_measured_on_mode_2_serve_a_build_of_mode_1_only_like_the_default_set() -> None:
    db = tuning.database([_entry(1024, [10, 12]), _entry(4096, [90, 80])], arch="sm90", machine={"gpu": "H200"},
                         method={})
    table, notes = tuning.fold([("sm90.json", db)], _jobs())  # no mode 2 built: no "dropped" for its rules
    assert notes == ["sm90.json: 2 rules folded (2 of them mode-2 rules applied to CAUSAL=1), 0 dropped"]
    assert [r["spec"] for r in table["attn_fwd"]] == [{**FWD, "CAUSAL": 1}] * 2
    assert table["attn_fwd"][1]["seqlen_q"] == [4096, None] and table["attn_fwd"][1]["config"] == 1
    assert table["attn_fwd"][1]["source"].endswith(tuning.MODE_ONE_NOTE)
    # Rules measured on mode 1 itself win: no twin is made for a spec the database measured.
    measured = tuning.database([_entry(1024, [10, 12]), _entry(1024, [12, 10], {**FWD, "CAUSAL": 1})],
                               arch="sm90", machine={}, method={})
    table, _ = tuning.fold([("sm90.json", measured)], _jobs() + _jobs(causal=2))
    assert [(r["spec"]["CAUSAL"], r["config"]) for r in table["attn_fwd"]] == [(1, 1), (2, 0)]
    # Twins are only for mode 2: a mode-0 rule stays one rule.
    assert tuning.mode_one_twin({"spec": {**FWD, "CAUSAL": 0}, "config": 1}) is None


def test_the_faster_forward_serves_each_bin_and_the_arch_one_keeps_ties() -> None:
    own = "attn_fwd_sm90"
    entries = [_entry(1024, [100, 95]), _entry(1024, [110, 104], kernel=own),    # portable by > 1%
               _entry(2048, [200, 190]), _entry(2048, [191, 199], kernel=own),    # a tie within 1%: own
               _entry(4096, [400, 420]), _entry(4096, [330, 350], kernel=own),
               _entry(8192, [800, 790]), _entry(8192, [700, 690], kernel=own)]
    rules = tuning.decide(entries, "sm90", "db")
    assert [(r["seqlen_q"], r["kernel"]) for r in rules["attn_fwd_kernel"]] == [([None, 2047], "attn_fwd"),
                                                                                 ([2048, None], own)]
    assert rules["attn_fwd_kernel"][0]["source"] == "db, attn_fwd_sm90 vs attn_fwd measured at seqlen_q 1024..1024"
    assert rules["attn_fwd_kernel"][1]["spec"] == FWD and rules["attn_fwd_kernel"][1]["arch"] == "sm90"
    # A bin only one of them was timed in decides nothing.
    assert "attn_fwd_kernel" not in tuning.decide([_entry(1024, [1, 2], kernel=own)], "sm90", "db")


def test_fold_keeps_a_forward_choice_only_where_the_build_holds_both_forwards() -> None:
    db = tuning.database([_entry(1024, [100]), _entry(1024, [120], kernel="attn_fwd_sm90")], arch="sm90",
                         machine={"gpu": "H200"}, method={})
    gluon = [j for j in expand(load_kernels()["attn_fwd_sm90"], [KNOWN["sm90"]], "full", "3.6.0")
             if j.spec in (FWD, {**FWD, "CAUSAL": 1})]
    assert gluon
    table, _ = tuning.fold([("sm90.json", db)], _jobs() + _jobs(causal=2) + gluon)
    assert [(r["kernel"], r["spec"]["CAUSAL"]) for r in table["attn_fwd_kernel"]] == [("attn_fwd", 2), ("attn_fwd", 1)]
    assert "attn_fwd_kernel" not in tuning.fold([("sm90.json", db)], _jobs())[0]


def test_a_database_with_forward_choices_round_trips(tmp_path: Path) -> None:
    db = tuning.database([_entry(1024, [100]), _entry(1024, [120], kernel="attn_fwd_sm90")], arch="sm90",
                         machine={"gpu": "H200"}, method={})
    path = tmp_path / "sm90.json"
    path.write_bytes(tuning.dumps(db))
    assert tuning.load(path)["rules"]["attn_fwd_kernel"] == db["rules"]["attn_fwd_kernel"]


def test_fold_drops_a_rule_whose_config_changed_since_it_was_measured() -> None:
    db = tuning.database([_entry(1024, [10, 8])], arch="sm90", machine={}, method={})
    db["rules"]["attn_fwd"][0]["expect"] = {**db["rules"]["attn_fwd"][0]["expect"], "num_warps": 16}
    table, notes = tuning.fold([("old.json", db)], _jobs())
    assert table == {}
    assert notes[0] == "old.json: 0 rules folded, 1 dropped"
    assert "config #1 is now" in notes[1] and "measured" in notes[1]
    assert notes[1].endswith("run `python -m builder tune` again")


def test_fold_drops_a_rule_for_a_variant_not_built_and_ignores_other_archs() -> None:
    db = tuning.database([_entry(1024, [10, 8]), _entry(1024, [10, 8], {**FWD, "dtype": "bf16"})], arch="sm90",
                         machine={}, method={})
    table, notes = tuning.fold([("a.json", db)], _jobs())
    assert len(table["attn_fwd"]) == 1 and "dropped, this build has no such variant" in notes[1]
    assert tuning.fold([("a.json", db)], _jobs("sm80")) == ({}, ["a.json: 0 rules folded, 0 dropped"])


def test_a_build_folds_a_database_given_on_the_command_line_into_its_catalog(tmp_path: Path) -> None:
    from aotriton_rt.catalog import Catalog

    add = {"dtype": "fp32"}
    good = Entry("add", add, 1024, {}, (Timing(0, {"BLOCK": 1024, "num_warps": 4, "num_stages": 1}, 3.0),))
    stale = Entry("add", {"dtype": "fp16"}, 1024, {},
                  (Timing(0, {"BLOCK": 512, "num_warps": 4, "num_stages": 1}, 3.0),))
    _write_db(tmp_path / "sm90.json", [good, stale])
    run = subprocess.run([sys.executable, "-m", "builder", "build", "--targets", "sm90", "--kernels", "add", "-q",
                          "-j", "1", "--out", str(tmp_path / "img"), "--tuning-db", str(tmp_path / "sm90.json")],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "tuning database sm90.json: 1 rules folded, 1 dropped" in run.stderr
    assert "config #0 is now {'BLOCK': 1024, 'num_warps': 4, 'num_stages': 1}" in run.stderr
    rules = Catalog.load(tmp_path / "img").tuning["add"]
    assert rules == [{"arch": "sm90", "spec": add, "seqlen_q": [None, None], "config": 0,
                      "source": "tuning database sm90 (NVIDIA H200), measured at seqlen_q 1024..1024"}]


def test_checked_in_databases_are_found_by_arch(tmp_path: Path) -> None:
    (tmp_path / "sm90.json").write_text("{}")
    assert tuning.checked_in({"sm90", "sm80", "gfx942"}, tmp_path) == [tmp_path / "sm90.json"]


def test_every_checked_in_database_loads_and_folds_without_a_dropped_rule() -> None:
    for path in sorted(tuning.CHECKED_IN.glob("*.json")):
        db = tuning.load(path)
        names = {n for n in db["rules"] if n not in tuning.DECISIONS}
        for table in set(db["rules"]) & set(tuning.DECISIONS):  # the kernels its choices are between
            names |= set(tuning.decision_kernels(table))
        jobs = [j for name in sorted(names) for j in expand(load_kernels()[name], [KNOWN[db["arch"]]], "full", "3.6.0")]
        table, notes = tuning.fold([(path.name, db)], jobs)
        assert notes[0].endswith(" 0 dropped"), notes
        # Every rule, and a mode-1 twin of each mode-2 rule (the database measured no mode 1).
        twins = sum(1 for rules in db["rules"].values() for r in rules if tuning.mode_one_twin(r) is not None)
        assert sum(map(len, table.values())) == sum(map(len, db["rules"].values())) + twins


def test_recompute_decides_again_without_a_gpu_and_writes_the_same_bytes(tmp_path: Path) -> None:
    _write_db(tmp_path / "t.json", [_entry(1024, [100, 99]), _entry(4096, [100, 97])])
    cmd = [sys.executable, "-m", "builder", "tune", "--recompute", str(tmp_path / "t.json")]
    subprocess.run(cmd + ["--out", str(tmp_path / "same.json")], cwd=ROOT, check=True, capture_output=True)
    assert (tmp_path / "same.json").read_bytes() == (tmp_path / "t.json").read_bytes()
    subprocess.run(cmd + ["--tolerance", "0", "--out", str(tmp_path / "eager.json")], cwd=ROOT, check=True,
                   capture_output=True)
    rules = json.loads((tmp_path / "eager.json").read_text())["rules"]["attn_fwd"]
    assert [r["config"] for r in rules] == [1]


def test_tune_refuses_bins_that_are_not_powers_of_two() -> None:
    from builder.tune import parse_bins

    assert parse_bins("4096,512,1024") == (512, 1024, 4096)
    with pytest.raises(TuningError, match=r"--bins must be powers of two >= 16, got '1000'"):
        parse_bins("1000")
    with pytest.raises(TuningError, match=r"--bins must be a comma list of integers, got 'a'"):
        parse_bins("a")


def test_a_bin_is_measured_at_the_benchmark_shapes() -> None:
    from builder.tune import shape_of

    assert [shape_of(n, 32, 1 << 19)["batch"] for n in (512, 1024, 4096, 16384, 32768)] == [32, 16, 4, 1, 1]


def test_tune_without_a_gpu_says_so_and_names_the_way_that_needs_none(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/runtime/test_tune_gpu.py runs tune")
    run = subprocess.run([sys.executable, "-m", "builder", "tune", "--out", str(tmp_path / "t.json")], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 1 and not (tmp_path / "t.json").exists()
    assert run.stderr.strip() == "error: tune needs a GPU (torch sees none); --recompute works without one"
