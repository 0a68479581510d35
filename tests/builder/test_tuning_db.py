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
FWD = {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 2, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0,
       "SOFTCAP": 0, "ALIBI": 0}


def _params(spec: dict, index: int, arch: str = "sm90", kernel: str = "attn_fwd") -> dict:
    c = load_kernels()[kernel].configs_for(spec, KNOWN[arch])[index]
    return {**c.constexprs, "num_warps": c.num_warps, "num_stages": c.num_stages}


def _entry(n: int, times: list[float | None], spec: dict = FWD, kernel: str = "attn_fwd") -> Entry:
    shape = {"batch": max(1, (1 << 19) // (n * 32)), "heads": 32, "seqlen_q": n, "seqlen_k": n}
    forward = kernel in ("attn_fwd", "attn_fwd_sm90")
    return Entry(kernel, spec, n, shape, tuple(Timing(i, _params(spec, i, kernel=kernel) if forward else {"i": i}, t)
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


def test_an_arch_kernel_is_binned_on_the_length_of_the_kernel_it_stands_in_for() -> None:
    from aotriton_rt.ops.attention.family import ARCH_BACKWARDS, ARCH_FORWARDS, FWD

    stand_ins = [(FWD, own) for own in ARCH_FORWARDS.values()] + [
        (role, own) for kernels in ARCH_BACKWARDS.values() for role, own in kernels.items()]
    assert ("attn_bwd_dkdv", "attn_bwd_dkdv_sm90") in stand_ins
    for role, own in stand_ins:
        assert tuning.LENGTH_AXIS[own] == tuning.LENGTH_AXIS[role], own
    spec = {"dtype": "fp16", "HEAD_DIM": 64}
    (rule,) = tuning.decide([_entry(1024, [1, 2], spec, "attn_bwd_dkdv_sm90")], "sm90", "db")["attn_bwd_dkdv_sm90"]
    assert rule["seqlen_k"] == [None, None] and "seqlen_q" not in rule


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


def test_databases_measured_before_the_late_axes_fold_onto_the_variants_that_leave_them_at_zero() -> None:
    # A rule measured before ALIBI (or before SOFTCAP and ALIBI) names its spec without them: it
    # serves the build's variants with those axes at 0, and its spec (a subset) is what the rule keeps.
    jobs = _jobs(causal=2) + [j for j in expand(load_kernels()["attn_fwd"], [KNOWN["sm90"]], "full", "3.6.0")
                              if j.spec == {**FWD, "ALIBI": 1}]
    assert {j.spec["ALIBI"] for j in jobs} == {0, 1}
    for gone in (("ALIBI",), ("ALIBI", "SOFTCAP")):
        old = {k: v for k, v in FWD.items() if k not in gone}
        db = tuning.database([_entry(1024, [10, 12], old), _entry(4096, [90, 80], old)], arch="sm90", machine={},
                             method={})
        table, notes = tuning.fold([("sm90.json", db)], jobs)
        assert notes == ["sm90.json: 2 rules folded, 0 dropped"], gone
        assert [(r["spec"], r["config"]) for r in table["attn_fwd"]] == [(old, 0), (old, 1)]
    assert tuning._measured_specs({**FWD, "ALIBI": 1}) == [{**FWD, "ALIBI": 1}]
    assert tuning._measured_specs({**FWD, "SOFTCAP": 1}) == [{**FWD, "SOFTCAP": 1},
                                                              {k: v for k, v in FWD.items() if k != "ALIBI"} | {
                                                                  "SOFTCAP": 1}]


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


# The backward's kernel and scheme choice: entries of whole backwards (kernel "attn_bwd").
CALL = {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0, "DROPOUT": 0, "VARLEN": 0, "BIAS": 0}
OWN_DKDV, OWN_DQ = "attn_bwd_dkdv_sm90", "attn_bwd_dq_sm90"
#: The contenders builder.tune.backward_contenders finds in images with both Gluon kernels and the
#: atomic scheme, in its order.
PAIRS = (("split", OWN_DKDV, OWN_DQ), ("split", OWN_DKDV, "attn_bwd_dq"), ("split", "attn_bwd_dkdv", OWN_DQ),
         ("split", "attn_bwd_dkdv", "attn_bwd_dq"), ("atomic", "attn_bwd_dkdv", "attn_bwd_dq_convert"))


def _whole(n: int, times: list[float | None], spec: dict = CALL, pairs: tuple = PAIRS, source: str = "") -> Entry:
    def params(scheme: str, dkdv: str, last: str) -> dict:
        return {"scheme": scheme, "attn_bwd_preprocess": "attn_bwd_preprocess", "attn_bwd_dkdv": dkdv,
                "attn_bwd_dq" if scheme == "split" else "attn_bwd_dq_convert": last}

    shape = {"batch": max(1, (1 << 19) // (n * 32)), "heads": 32, "seqlen_q": n, "seqlen_k": n}
    return Entry(tuning.BACKWARD, spec, n, shape, tuple(Timing(i, params(*p), t) for i, (p, t) in
                                                        enumerate(zip(pairs, times))), source)


def _decided(rules: dict, table: str, axis: str = "seqlen_k") -> list[tuple]:
    return [(r["spec"].get("DQ_ATOMIC"), r[axis], r["mode" if table == "attn_bwd_mode" else "kernel"])
            for r in rules.get(table, [])]


def test_whole_backwards_decide_the_scheme_and_each_parts_kernel_per_bin() -> None:
    entries = [_whole(1024, [10, 9, 12, 11, 20]),    # split wins; Gluon dK/dV + portable dQ
               _whole(4096, [90, 95, 99, 99, 80]),   # atomic wins; split: Gluon + Gluon
               _whole(16384, [300, 290, 330, 320, 250])]
    rules = tuning.decide(entries, "sm90", "db")
    assert set(rules) == {"attn_bwd_mode", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"}
    assert _decided(rules, "attn_bwd_mode") == [(None, [None, 4095], "split"), (None, [4096, None], "atomic")]
    # The split scheme's parts are decided in every bin, atomic winner or not: deterministic calls run it.
    assert _decided(rules, "attn_bwd_dkdv_kernel") == [(0, [None, None], OWN_DKDV)]
    assert _decided(rules, "attn_bwd_dq_kernel", "seqlen_q") == [
        (None, [None, 4095], "attn_bwd_dq"), (None, [4096, 16383], OWN_DQ), (None, [16384, None], "attn_bwd_dq")]
    mode = rules["attn_bwd_mode"][1]
    assert mode == {"arch": "sm90", "spec": CALL, "seqlen_k": [4096, None], "mode": "atomic",
                    "source": "db, whole backward, split vs atomic measured at seqlen_k 4096..16384"}
    assert rules["attn_bwd_dkdv_kernel"][0]["spec"] == {**CALL, "DQ_ATOMIC": 0}
    assert rules["attn_bwd_dq_kernel"][0]["source"] == ("db, whole split backward, attn_bwd_dq_sm90 vs attn_bwd_dq "
                                                        "measured at seqlen_q 1024..1024")
    assert not any("expect" in r for table in rules.values() for r in table)


def test_a_whole_backward_tie_keeps_the_default_the_split_scheme_and_the_arch_kernels() -> None:
    # Inside the 1% tolerance everything ties with contender 0: the untuned default stays.
    rules = tuning.decide([_whole(1024, [100, 99.5, 99.2, 99.9, 99.1])], "sm90", "db")
    assert _decided(rules, "attn_bwd_mode") == [(None, [None, None], "split")]
    assert _decided(rules, "attn_bwd_dkdv_kernel") == [(0, [None, None], OWN_DKDV)]
    assert _decided(rules, "attn_bwd_dq_kernel", "seqlen_q") == [(None, [None, None], OWN_DQ)]
    # And a clear gain wins: the same times, tolerance 0.
    eager = tuning.decide([_whole(1024, [100, 99.5, 99.2, 99.9, 99.1])], "sm90", "db", tolerance=0.0)
    assert _decided(eager, "attn_bwd_mode") == [(None, [None, None], "atomic")]
    assert _decided(eager, "attn_bwd_dkdv_kernel") == [(0, [None, None], "attn_bwd_dkdv")]


def test_whole_backwards_give_the_same_bytes_in_any_order_and_decide_again_the_same(tmp_path: Path) -> None:
    entries = [_whole(n, [n, n * 0.97, n * 1.2, n * 1.1, n * (1.3 if n < 4096 else 0.9)]) for n in (1024, 2048, 4096)]
    entries.append(_whole(1024, [5, 6, 7, 8], {**CALL, "CAUSAL": 2}, PAIRS[:4]))
    a = tuning.dumps(tuning.database(entries, arch="sm90", machine={"gpu": "H200"}, method={}))
    assert a == tuning.dumps(tuning.database(entries[::-1], arch="sm90", machine={"gpu": "H200"}, method={}))
    (tmp_path / "t.json").write_bytes(a)
    again = tuning.load(tmp_path / "t.json")
    assert tuning.dumps(tuning.database(tuning.entries_of(again), arch="sm90", machine=again["machine"],
                                        method={})) == a


def test_only_what_varied_is_decided() -> None:
    # Images without the atomic scheme and without a Gluon dK/dV: the dQ kernel only.
    pairs = (("split", "attn_bwd_dkdv", OWN_DQ), ("split", "attn_bwd_dkdv", "attn_bwd_dq"))
    rules = tuning.decide([_whole(1024, [10, 8], pairs=pairs)], "sm90", "db")
    assert set(rules) == {"attn_bwd_dq_kernel"}
    # A contender that failed or computed a wrong result is not a choice: nothing left to decide.
    assert tuning.decide([_whole(1024, [10, None], pairs=pairs)], "sm90", "db") == {}


def test_an_arch_dkdv_of_the_atomic_scheme_is_decided_under_dq_atomic_1() -> None:
    # Images whose dispatcher runs an arch dK/dV with DQ_ATOMIC=1: the atomic scheme's dK/dV varies too.
    pairs = (*PAIRS[:4], ("atomic", OWN_DKDV, "attn_bwd_dq_convert"), PAIRS[4])
    rules = tuning.decide([_whole(4096, [10, 11, 12, 13, 7, 9], pairs=pairs)], "sm90", "db")
    assert _decided(rules, "attn_bwd_dkdv_kernel") == [(0, [None, None], OWN_DKDV), (1, [None, None], OWN_DKDV)]
    assert rules["attn_bwd_dkdv_kernel"][1]["source"] == ("db, whole atomic backward, attn_bwd_dkdv_sm90 vs "
                                                          "attn_bwd_dkdv measured at seqlen_k 4096..4096")
    assert _decided(rules, "attn_bwd_mode") == [(None, [None, None], "atomic")]


def _backward_jobs(kernels: tuple[str, ...] = ("attn_bwd_dkdv", "attn_bwd_dq", OWN_DKDV, OWN_DQ),
                   build_set: str = "gputest") -> list:
    return [j for name in kernels for j in expand(load_kernels()[name], [KNOWN["sm90"]], build_set, "3.6.0")]


def test_fold_keeps_backward_decisions_only_where_the_build_can_make_them() -> None:
    # fp16 D64: no mask (gputest holds both schemes and both Gluon kernels) and bottom-right causal.
    entries = [_whole(1024, [10, 9, 12, 11, 8]), _whole(1024, [10, 9, 12, 11, 8], {**CALL, "CAUSAL": 2})]
    db = tuning.database(entries, arch="sm90", machine={"gpu": "H200"}, method={})
    assert len(db["rules"]["attn_bwd_mode"]) == 2
    table, notes = tuning.fold([("sm90.json", db)], _backward_jobs())
    assert notes == ["sm90.json: 9 rules folded (3 of them mode-2 rules applied to CAUSAL=1), 0 dropped"]
    # The atomic scheme at every mode: gputest holds the Gluon dK/dV with DQ_ATOMIC=1 at each (the
    # portable atomic one at mode 2 only), and the dispatch runs either.
    assert [(r["spec"]["CAUSAL"], r["mode"]) for r in table["attn_bwd_mode"]] == [
        (0, "atomic"), (2, "atomic"), (1, "atomic")]
    assert [(r["spec"]["CAUSAL"], r["kernel"]) for r in table["attn_bwd_dq_kernel"]] == [
        (0, "attn_bwd_dq"), (2, "attn_bwd_dq"), (1, "attn_bwd_dq")]
    assert [r["spec"]["CAUSAL"] for r in table["attn_bwd_dkdv_kernel"]] == [0, 2, 1]
    assert table["attn_bwd_dq_kernel"][2]["source"].endswith(tuning.MODE_ONE_NOTE)
    # Without the Gluon kernels there is no kernel choice to make, and without the atomic dK/dV no scheme.
    portable = tuning.fold([("sm90.json", db)], _backward_jobs(("attn_bwd_dkdv", "attn_bwd_dq")))[0]
    assert set(portable) == {"attn_bwd_mode"}
    # The default set holds the Gluon kernels at modes 0 and 1 (the mode-2 rule applies to mode 1),
    # the dK/dV one in both schemes: the kernel choices and the scheme are folded.
    default = tuning.fold([("sm90.json", db)], _backward_jobs(("attn_bwd_dq", OWN_DQ), "default"))[0]
    assert [(r["spec"]["CAUSAL"], r["kernel"]) for r in default.pop("attn_bwd_dq_kernel")] == [
        (0, "attn_bwd_dq"), (1, "attn_bwd_dq")]
    assert default == {}
    default = tuning.fold([("sm90.json", db)], _backward_jobs(("attn_bwd_dkdv", OWN_DKDV), "default"))[0]
    assert [(r["spec"]["CAUSAL"], r["mode"]) for r in default["attn_bwd_mode"]] == [(0, "atomic"), (1, "atomic")]
    assert not any(j.spec.get("DQ_ATOMIC") for j in _backward_jobs(("attn_bwd_dkdv",), "default"))


def test_an_entry_measured_by_a_benchmark_says_so_in_its_rules_and_survives_recompute(tmp_path: Path) -> None:
    pairs = PAIRS[:2]
    db = _write_db(tmp_path / "t.json", [_whole(4096, [4377.0, 4066.0], pairs=pairs, source="bench/x.py, H200")])
    (rule,) = db["rules"]["attn_bwd_dq_kernel"]
    assert rule["source"] == ("bench/x.py, H200, whole split backward, attn_bwd_dq_sm90 vs attn_bwd_dq measured at "
                              "seqlen_q 4096..4096")
    assert db["entries"][0]["source"] == "bench/x.py, H200"
    run = subprocess.run([sys.executable, "-m", "builder", "tune", "--recompute", str(tmp_path / "t.json"), "--out",
                          str(tmp_path / "again.json")], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "t.json").read_bytes()
    assert "attn_bwd       fp16 D64 full    4096:#1=split:dkdv_sm90+dq" in run.stdout


def test_an_entry_with_a_malformed_source_is_refused_naming_it(tmp_path: Path) -> None:
    db = _write_db(tmp_path / "t.json", [_whole(4096, [2.0, 1.0], pairs=PAIRS[:2])])
    db["entries"][0]["source"] = "x\n" * 3
    with pytest.raises(TuningError, match=r"<memory>: entries\[0\] is malformed \(TypeError: source must be a "
                                          r"printable string of at most 200 characters\)"):
        tuning.entries_of(db)


def test_the_checked_in_sm90_database_sends_d64_backwards_to_the_portable_dq_as_the_bench_measured() -> None:
    db = tuning.load(tuning.CHECKED_IN / "sm90.json")
    if not any(e.get("source", "").startswith("bench/sm90_bwd_gluon.py") for e in db["entries"]):
        pytest.skip("builder tune re-measured the backward: the bench's interim entries are gone")
    rules = db["rules"]["attn_bwd_dq_kernel"]
    assert sorted((r["spec"]["dtype"], r["spec"]["HEAD_DIM"], r["spec"]["CAUSAL"], r["kernel"]) for r in rules) == [
        ("bf16", 64, 0, "attn_bwd_dq"), ("fp16", 64, 0, "attn_bwd_dq")]
    assert all(r["source"].startswith("bench/sm90_bwd_gluon.py --rounds 5, H200") for r in rules)
    assert "attn_bwd_mode" not in db["rules"]  # the bench timed no atomic scheme


def test_whole_backwards_whose_params_name_no_scheme_or_kernel_are_refused() -> None:
    bad = Entry(tuning.BACKWARD, CALL, 1024, {}, (Timing(0, {"scheme": "split", "attn_bwd_dq": "attn_bwd_dq"}, 2.0),
                                                   Timing(1, {"scheme": "fused", "attn_bwd_dq": "x; y"}, 1.0)))
    with pytest.raises(TuningError, match=r"the decided rules: catalog tuning\['attn_bwd_mode'\] rule .*: mode must "
                                          r"be 'split' or 'atomic'"):
        tuning.database([bad], arch="sm90", machine={}, method={})
    odd = Entry(tuning.BACKWARD, CALL, 1024, {}, (Timing(0, {"scheme": "split", "attn_bwd_dq": "attn_bwd_dq"}, 2.0),
                                                   Timing(1, {"scheme": "split", "attn_bwd_dq": "x; y"}, 1.0)))
    with pytest.raises(TuningError, match=r"tuning\['attn_bwd_dq_kernel'\] rule .*: kernel must be a kernel name"):
        tuning.database([odd], arch="sm90", machine={}, method={})


def _forward_jobs(build_set: str) -> list:
    """The build's fp16 D=128 jobs of both forwards on sm90, no mask and causal."""
    return [j for name in ("attn_fwd", "attn_fwd_sm90") for j in expand(load_kernels()[name], [KNOWN["sm90"]],
                                                                        build_set, "3.6.0")
            if j.spec["dtype"] == "fp16" and j.spec["HEAD_DIM"] == 128 and not j.spec["BIAS"] + j.spec["DROPOUT"]
            + j.spec["VARLEN"]]


def test_a_build_without_the_winning_config_chooses_the_forward_its_own_configs_measured_faster() -> None:
    # No mask. Bin 1024: the arch forward wins with its persistent config #6, but its config #0 is
    # slower than the portable #0. Bin 4096: the arch forward's #0 wins outright.
    own, full = "attn_fwd_sm90", {**FWD, "CAUSAL": 0}
    entries = [_entry(1024, [100.0, 95.0], full), _entry(1024, [110.0, 111.0, 120, 120, 120, 120, 70.0, 72.0],
                                                          full, own),
               _entry(4096, [400.0, 420.0], full), _entry(4096, [300.0, 310.0, 350, 350, 350, 350, 330.0, 320.0],
                                                          full, own)]
    db = tuning.database(entries, arch="sm90", machine={"gpu": "H200"}, method={})
    assert [(r["seqlen_q"], r["kernel"]) for r in db["rules"]["attn_fwd_kernel"]] == [([None, None], own)]
    # A build of each forward's config #0 only (the default set was one until it took the persistent configs).
    gputest = _forward_jobs("gputest")
    default = [j for j in gputest if j.config_index == 0]
    assert 6 in {j.config_index for j in gputest if j.kernel == own and j.spec == full}
    # gputest holds #6: the database's choice, the arch forward at every length, running #6 at 1024.
    table, notes = tuning.fold([("sm90.json", db)], gputest)
    assert table["attn_fwd_kernel"] == db["rules"]["attn_fwd_kernel"]
    assert [(r["seqlen_q"], r["config"]) for r in table[own]] == [([None, 4095], 6), ([4096, None], 0)]
    assert notes == ["sm90.json: 5 rules folded, 0 dropped"]
    # The #0-only build: its #0s decide, the portable forward at 1024 (and its config rule for #1 drops).
    table, notes = tuning.fold([("sm90.json", db)], default)
    assert [(r["seqlen_q"], r["kernel"]) for r in table["attn_fwd_kernel"]] == [([None, 4095], "attn_fwd"),
                                                                                ([4096, None], own)]
    assert table["attn_fwd_kernel"][0]["source"] == ("tuning database sm90 (H200), attn_fwd_sm90 vs attn_fwd measured "
                                                     "at seqlen_q 1024..1024")
    assert [(r["seqlen_q"], r["config"]) for r in table[own]] == [([4096, None], 0)]  # #6 not built: #0 runs
    assert notes[-1] == ('sm90.json: attn_fwd_kernel {"ALIBI": 0, "BIAS": 0, "CAUSAL": 0, "DROPOUT": 0, "HEAD_DIM": '
                         '128, "HEAD_DIM_V": 128, "SOFTCAP": 0, "VARLEN": 0, "dtype": "fp16"} at seqlen_q 1024: '
                         'attn_fwd in this build, '
                         'where the database chose attn_fwd_sm90 (whose winning config this build does not hold)')
    assert notes[0].endswith(" 2 dropped")  # the two config rules whose winner (#1, #6) is not built


def test_a_forward_whose_built_config_zero_was_not_measured_as_built_decides_nothing_there() -> None:
    own = "attn_fwd_sm90"
    entries = [_entry(1024, [100.0, 95.0], FWD), _entry(1024, [110.0, 111.0, 120, 120, 120, 120, 70.0], FWD, own)]
    db = json.loads(json.dumps(tuning.database(entries, arch="sm90", machine={}, method={})))
    db["entries"][1]["configs"][0]["params"]["STAGES"] = 2  # config #0 was another kernel when measured
    first_configs = [j for j in _forward_jobs("gputest") if j.config_index == 0 and j.spec["CAUSAL"] in (0, 1)]
    table, _ = tuning.fold([("sm90.json", db)], first_configs + _jobs(causal=2))
    assert table["attn_fwd"]  # the portable forward's rule folds; the choice does not
    assert "attn_fwd_kernel" not in table  # no rule: the untuned heuristic, not a guess


def test_the_checked_in_database_sends_n1024_d128_where_each_builds_own_configs_measured_faster() -> None:
    db = tuning.load(tuning.CHECKED_IN / "sm90.json")
    if not any(e.get("source", "").startswith("bench/sm90_persistent.py") for e in db["entries"]):
        pytest.skip("builder tune re-measured the forward: the bench's interim entries are gone")
    from aotriton_rt.tuning import select_config, select_kernel

    def kernel(table: dict, causal: int) -> tuple:
        at = {"spec": {**FWD, "CAUSAL": causal}, "seqlen_q": 1024, "seqlen_k": 1024, "arch": "sm90"}
        choice = select_kernel(table.get("attn_fwd_kernel"), **at)
        return (None if choice is None else choice.rule["kernel"],
                select_config(table.get("attn_fwd_sm90"), kernel="attn_fwd_sm90", **at))

    gputest = tuning.fold([("sm90.json", db)], _forward_jobs("gputest"))[0]
    # The persistent configs the bench measured fastest at B16 H32 N1024 (fp16: #7 full, #6 causal).
    assert [kernel(gputest, c) for c in (0, 1)] == [("attn_fwd_sm90", 7), ("attn_fwd_sm90", 6)]
    default, notes = tuning.fold([("sm90.json", db)], _forward_jobs("default"))
    assert [n.split(" at seqlen_q ")[1][:4] for n in notes if "in this build, where the database chose" in n] == [
        "1024"]  # fp16 mode 1 (a mode-2 rule's twin): the one bin whose choice this build makes otherwise
    # Config #0 of each: the one-tile Gluon 718.8 us vs attn_fwd's 128x128 799.4 us full; causal
    # 526.3 us vs attn_fwd's 128x64 481.6 us.
    assert [kernel(default, c) for c in (0, 1)] == [("attn_fwd_sm90", 0), ("attn_fwd", 0)]


def test_a_set_built_with_tuned_configs_holds_every_config_the_database_picks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from builder.registry import _kept_configs, load_kernels
    from builder.targets import KNOWN

    spec = {"dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0,
            "DQ_ATOMIC": 0}
    rules = {"attn_bwd_dkdv_sm90": [
        {"arch": "sm90", "spec": {**spec, "CAUSAL": 2}, "seqlen_k": [None, None], "config": 3, "expect": {}},
        {"arch": "sm90", "spec": {**spec, "CAUSAL": 0}, "seqlen_k": [None, 2047], "config": 2, "expect": {}},
        {"arch": "sm90", "spec": {**spec, "CAUSAL": 0}, "seqlen_k": [2048, None], "config": 99, "expect": {}}]}
    monkeypatch.setattr(tuning, "_checked_in_rules", lambda arch: rules if arch == "sm90" else {})
    kernel = load_kernels()["attn_bwd_dkdv_sm90"]
    built = {"SOFTCAP": 0, "ALIBI": 0}  # a built spec carries the axes added after the database
    kept = {c: [i for i, _ in _kept_configs(kernel, "default", {**spec, **built, "CAUSAL": c}, KNOWN["sm90"])]
            for c in (0, 1, 2)}
    # Mode 1 runs mode 2's pick; #99 (past the config table) is left out, not an error.
    assert kept == {0: [0, 2], 1: [0, 3], 2: [0, 3]}
    assert tuning.tuned_configs("attn_bwd_dkdv_sm90")({**spec, "CAUSAL": 0}, KNOWN["sm80"]) == (0,)
