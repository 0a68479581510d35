"""builder tune's measuring loop on the CPU: a real Library over a synthetic sm90 catalog (nothing is
launched), the operator replaced by a stand-in that reports the config the runtime's tuning table
forced, and a clock that charges each config its own time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import aotriton_rt
from builder import tuning
from builder.tune import contender_name, forced_config, measure
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

        rules = library.tuning.get("attn_fwd")
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
        handle = op.attention_kernels(*qkv(S=300, D=128), causal=True, library=forced_config(lib, "attn_fwd", index))
        assert handle["attn_fwd"].candidates[0].config.index == index
    assert op.attention_kernels(*qkv(S=300, D=128), library=lib)["attn_fwd"].candidates[0].config.index == 0
    assert lib.catalogs[0].tuning == {}


# The backward's kernel and scheme choice: whole backwards through the operator's dispatch.
CALL = {**BASE, "CAUSAL": 0}
#: ms per whole backward, by (scheme, dK/dV kernel, dQ or convert kernel) as the dispatcher picks them.
WHOLE_MS = {("split", "attn_bwd_dkdv_sm90", "attn_bwd_dq_sm90"): 1.0,
            ("split", "attn_bwd_dkdv_sm90", "attn_bwd_dq"): 0.8,
            ("split", "attn_bwd_dkdv", "attn_bwd_dq_sm90"): 1.2,
            ("split", "attn_bwd_dkdv", "attn_bwd_dq"): 1.1,
            ("atomic", "attn_bwd_dkdv", "attn_bwd_dq_convert"): 0.5}


@pytest.fixture
def bwd_lib(tmp_path: Path) -> aotriton_rt.Library:
    """Synthetic sm90 images (never launched): fp16 D=128 no mask, the forward, both schemes of the
    portable backward, and the Gluon dK/dV (split only, as today) and dQ."""
    pre = {k: BASE[k] for k in ("dtype", "HEAD_DIM", "HEAD_DIM_V", "VARLEN")}
    variants = [_synthetic_variant("attn_fwd", CALL), _synthetic_variant("attn_bwd_dq", CALL),
                _synthetic_variant("attn_bwd_dq_sm90", CALL),
                _synthetic_variant("attn_bwd_dkdv_sm90", {**CALL, "DQ_ATOMIC": 0}),
                _synthetic_variant("attn_bwd_dq_convert", {"dtype": "fp16", "HEAD_DIM": 128, "VARLEN": 0})]
    for atomic in (0, 1):
        variants.append(_synthetic_variant("attn_bwd_dkdv", {**CALL, "DQ_ATOMIC": atomic}))
        variants.append(_synthetic_variant("attn_bwd_preprocess", {**pre, "DQ_ATOMIC": atomic}))
    (tmp_path / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                       "triton_version": "3.6.0", "tuning": {},
                                                       "variants": variants}))
    return aotriton_rt.Library(tmp_path)


class Backward:
    """Stands in for aotriton_rt.attention_backward: asks the real dispatcher which kernels the view
    runs (nothing is launched) and remembers them for the clock."""

    def __init__(self) -> None:
        self.ran: tuple = ()
        self.seen: dict[tuple, set] = {}

    def __call__(self, do, q, k, v, out, lse, *, causal, deterministic, library):
        from aotriton_rt.ops import attention as op
        from tests.runtime.test_attention_op import qkv

        b, h, n, d = q.shape
        handles = op.attention_kernels(*qkv(B=b, H=h, S=n, D=d), causal=causal, backward=True,
                                       deterministic=deterministic, library=library)
        scheme = "atomic" if "attn_bwd_dq_convert" in handles else "split"
        self.ran = (scheme, handles["attn_bwd_dkdv"].name,
                    handles["attn_bwd_dq" if scheme == "split" else "attn_bwd_dq_convert"].name)
        self.seen.setdefault(self.ran, set()).add(deterministic)
        return q.float(), k.float(), v.float(), None


class WholeClock:
    def __init__(self, op: Backward) -> None:
        self.op = op

    def calls(self, fn, n: int, flush: bool) -> list[float]:
        fn()
        return [WHOLE_MS[self.op.ran]] * n

    def sync(self) -> None:
        pass


def test_tune_times_every_whole_backward_the_images_hold_and_decides_the_scheme_and_kernels(
        bwd_lib: aotriton_rt.Library, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    backward = Backward()
    monkeypatch.setattr(aotriton_rt, "attention", lambda q, k, v, *, causal, library: (q, torch.zeros(q.shape[:3])))
    monkeypatch.setattr(aotriton_rt, "attention_backward", backward)
    logged: list[str] = []
    entries = measure(bwd_lib, "sm90", ["attn_bwd"], ["fp16"], [128], [False], [256, 1024], heads=2, tokens=1,
                      rounds=2, device="cpu", clock=WholeClock(backward), log=logged.append)
    # Every combination once (the forced Gluon dK/dV of the atomic scheme runs the portable one: kept
    # once), the untuned default first; all through non-deterministic calls, as the atomic one must be.
    assert list(backward.seen) == list(WHOLE_MS) and all(d == {False} for d in backward.seen.values())
    assert [(e.kernel, e.spec, e.bin) for e in entries] == [("attn_bwd", CALL, 256), ("attn_bwd", CALL, 1024)]
    assert [(t.index, t.params["scheme"], t.params["attn_bwd_dkdv"], t.us) for t in entries[0].timings] == [
        (0, "split", "attn_bwd_dkdv_sm90", 1000.0), (1, "split", "attn_bwd_dkdv_sm90", 800.0),
        (2, "split", "attn_bwd_dkdv", 1200.0), (3, "split", "attn_bwd_dkdv", 1100.0),
        (4, "atomic", "attn_bwd_dkdv", 500.0)]
    assert entries[0].timings[4].params == {"scheme": "atomic", "attn_bwd_preprocess": "attn_bwd_preprocess",
                                            "attn_bwd_dkdv": "attn_bwd_dkdv",
                                            "attn_bwd_dq_convert": "attn_bwd_dq_convert"}
    assert any(line.startswith("attn_bwd fp16 D128 full N1024 B1: #0 split:dkdv_sm90+dq_sm90 1000.0us") and
               line.endswith("-> #4") for line in logged), logged
    rules = tuning.database(entries, arch="sm90", machine={"gpu": "test"}, method={})["rules"]
    assert [r["mode"] for r in rules["attn_bwd_mode"]] == ["atomic"]
    assert [(r["spec"]["DQ_ATOMIC"], r["kernel"]) for r in rules["attn_bwd_dkdv_kernel"]] == [(0, "attn_bwd_dkdv_sm90")]
    assert [r["kernel"] for r in rules["attn_bwd_dq_kernel"]] == ["attn_bwd_dq"]


def test_images_with_one_whole_backward_have_nothing_to_choose(lib: aotriton_rt.Library) -> None:
    from builder.tune import backward_contenders

    spec, contenders = backward_contenders(lib, "sm90", "fp16", 128, True)
    assert spec == {**BASE, "CAUSAL": 2} and [c[1]["scheme"] for c in contenders] == ["split"]
    logged: list[str] = []
    assert measure(lib, "sm90", ["attn_bwd"], ["fp16"], [128], [True], [1024], log=logged.append) == []
    assert logged == ["attn_bwd fp16 D128 causal: 1 whole backward the images can run, nothing to choose"]


def test_a_scheme_held_only_at_a_wider_head_dim_is_not_a_contender(tmp_path: Path) -> None:
    from builder.tune import backward_contenders

    d64 = {**CALL, "HEAD_DIM": 64, "HEAD_DIM_V": 64}
    pre = {k: d64[k] for k in ("dtype", "HEAD_DIM", "HEAD_DIM_V", "VARLEN")}
    variants = [_synthetic_variant("attn_bwd_preprocess", {**pre, "DQ_ATOMIC": 0}),
                _synthetic_variant("attn_bwd_dkdv", {**d64, "DQ_ATOMIC": 0}), _synthetic_variant("attn_bwd_dq", d64),
                _synthetic_variant("attn_bwd_dq_sm90", d64),
                # The atomic scheme at D=128 only: a D=64 call would run it zero-padded.
                _synthetic_variant("attn_bwd_preprocess", {**pre, "HEAD_DIM": 128, "HEAD_DIM_V": 128, "DQ_ATOMIC": 1}),
                _synthetic_variant("attn_bwd_dkdv", {**CALL, "DQ_ATOMIC": 1}),
                _synthetic_variant("attn_bwd_dq_convert", {"dtype": "fp16", "HEAD_DIM": 128, "VARLEN": 0})]
    (tmp_path / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                       "triton_version": "3.6.0", "tuning": {},
                                                       "variants": variants}))
    lib = aotriton_rt.Library(tmp_path)
    spec, contenders = backward_contenders(lib, "sm90", "fp16", 64, False)
    assert spec == d64
    assert [contender_name(c[1]) for c in contenders] == ["split:dkdv+dq_sm90", "split:dkdv+dq"]
    # The D=128 call has it at its own head dim (and no split scheme: nothing else to compare).
    assert [contender_name(c[1]) for c in backward_contenders(lib, "sm90", "fp16", 128, False)[1]] == [
        "atomic:dkdv+dq_convert"]


def test_a_view_without_mask_mode_2_runs_bottom_right_calls_on_mode_1_and_its_tuning_views_keep_hiding_it(
        tmp_path: Path) -> None:
    from aotriton_rt.ops import attention as op
    from builder.tune import forced_config, without_mask_mode
    from tests.runtime.test_attention_op import qkv

    variants = [_synthetic_variant("attn_fwd", {**BASE, "CAUSAL": c}, i) for c in (1, 2) for i in (0, 1)]
    (tmp_path / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                       "triton_version": "3.6.0", "tuning": {},
                                                       "variants": variants}))
    lib = aotriton_rt.Library(tmp_path)

    def forward(library: aotriton_rt.Library):
        return op.attention_kernels(*qkv(S=300, Sk=400, D=128), causal=True, align="bottom_right",
                                    library=library)["attn_fwd"]

    view = without_mask_mode(lib, 2)
    assert isinstance(view, aotriton_rt.Library) and {v.spec["CAUSAL"] for v in view.variants_of("attn_fwd")} == {1}
    assert forward(lib).params["CAUSAL"] == 2 and forward(view).params["CAUSAL"] == 1
    forced = forward(forced_config(view, "attn_fwd", 1))
    assert (forced.params["CAUSAL"], forced.candidates[0].config.index) == (1, 1)
    assert {c.spec["CAUSAL"] for c in forward(view).candidates} == {1}  # its handles hold no mode 2 either
    assert len(lib.variants_of("attn_fwd")) == 4


def test_tune_times_the_arch_backward_configs_of_both_schemes_then_whole_backwards_at_their_winners(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon dK/dV's configs are timed for the split scheme and, separately, for the atomic one
    (their DQ_ATOMIC=1 spec), the Gluon dQ's where the images route the call to the portable dQ; the
    whole backwards are then timed with each part at the config that won its bin."""
    torch = pytest.importorskip("torch")
    pre = {k: BASE[k] for k in ("dtype", "HEAD_DIM", "HEAD_DIM_V", "VARLEN")}
    variants = [_synthetic_variant("attn_fwd", CALL), _synthetic_variant("attn_bwd_dq", CALL),
                _synthetic_variant("attn_bwd_dq_convert", {"dtype": "fp16", "HEAD_DIM": 128, "VARLEN": 0})]
    variants += [_synthetic_variant("attn_bwd_dq_sm90", CALL, i) for i in (0, 1)]
    for atomic in (0, 1):
        variants += [_synthetic_variant("attn_bwd_dkdv_sm90", {**CALL, "DQ_ATOMIC": atomic}, i) for i in (0, 1)]
        variants.append(_synthetic_variant("attn_bwd_preprocess", {**pre, "DQ_ATOMIC": atomic}))
    tuning_table = {"attn_bwd_dq_kernel": [{"arch": "sm90", "kernel": "attn_bwd_dq"}]}
    (tmp_path / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                       "triton_version": "3.6.0", "tuning": tuning_table,
                                                       "variants": variants}))
    lib = aotriton_rt.Library(tmp_path)
    # ms per part by (kernel, DQ_ATOMIC or None, config): config 1 is faster everywhere.
    part_ms = {("attn_bwd_dkdv_sm90", 0, 0): 1.0, ("attn_bwd_dkdv_sm90", 0, 1): 0.6,
               ("attn_bwd_dkdv_sm90", 1, 0): 0.9, ("attn_bwd_dkdv_sm90", 1, 1): 0.3,
               ("attn_bwd_dq_sm90", None, 0): 0.5, ("attn_bwd_dq_sm90", None, 1): 0.4,
               ("attn_bwd_dq", None, 0): 0.45, ("attn_bwd_dq_convert", None, 0): 0.05}
    ran: list[tuple] = []

    def backward(do, q, k, v, out, lse, *, causal, deterministic, library):
        from aotriton_rt.ops import attention as op
        from tests.runtime.test_attention_op import qkv

        b, h, n, d = q.shape
        handles = op.attention_kernels(*qkv(B=b, H=h, S=n, D=d), causal=causal, backward=True,
                                       deterministic=deterministic, library=library)
        dkdv = handles["attn_bwd_dkdv"]
        last = handles["attn_bwd_dq_convert" if "attn_bwd_dq_convert" in handles else "attn_bwd_dq"]
        ran[:] = [(dkdv.name, dkdv.params["DQ_ATOMIC"], dkdv.candidates[0].config.index),
                  (last.name, None, last.candidates[0].config.index)]
        return q.float(), k.float(), v.float(), None

    class Clock:
        def calls(self, fn, n: int, flush: bool) -> list[float]:
            fn()
            return [sum(part_ms[p] for p in ran)] * n

        def sync(self) -> None:
            pass

    monkeypatch.setattr(aotriton_rt, "attention", lambda q, k, v, *, causal, library: (q, torch.zeros(q.shape[:3])))
    monkeypatch.setattr(aotriton_rt, "attention_backward", backward)
    logged: list[str] = []
    entries = measure(lib, "sm90", ["attn_bwd_dkdv_sm90", "attn_bwd_dq_sm90", "attn_bwd"], ["fp16"], [128], [False],
                      [1024], heads=2, tokens=1, rounds=2, device="cpu", clock=Clock(), log=logged.append)
    assert [(e.kernel, e.spec.get("DQ_ATOMIC")) for e in entries] == [
        ("attn_bwd_dkdv_sm90", 0), ("attn_bwd_dkdv_sm90", 1), ("attn_bwd_dq_sm90", None), ("attn_bwd", None)]
    assert [tuning.winner(e.timings).index for e in entries[:3]] == [1, 1, 1]
    whole = {contender_name(t.params): t.us for t in entries[3].timings}
    # Every whole backward at the winners: dK/dV #1 (0.6 split, 0.3 atomic), dQ #1 (0.4).
    assert whole == {"split:dkdv_sm90+dq_sm90": 1000.0, "split:dkdv_sm90+dq": 1050.0,
                     "atomic:dkdv_sm90+dq_convert": 350.0}
    rules = tuning.database(entries, arch="sm90", machine={"gpu": "test"}, method={})["rules"]
    assert sorted((r["spec"].get("DQ_ATOMIC"), r["config"]) for r in rules["attn_bwd_dkdv_sm90"]) == [(0, 1), (1, 1)]
    assert [r["mode"] for r in rules["attn_bwd_mode"]] == ["atomic"]


def test_merge_replaces_the_entries_of_the_specs_a_later_database_measured(tmp_path: Path) -> None:
    from builder.tune import merged

    def entry(kernel: str, n: int, fast: int, **spec: int) -> tuning.Entry:
        timings = tuple(tuning.Timing(i, {"BLOCK_M": 64}, 10.0 if i == fast else 20.0, None, "") for i in (0, 1))
        return tuning.Entry(kernel, {**BASE, "CAUSAL": 0, **spec}, n, {"batch": 1, "heads": 2, "seqlen_q": n,
                                                                        "seqlen_k": n}, timings)

    old = tuning.database([entry("attn_fwd", 1024, 1), entry("attn_bwd_dq", 1024, 0), entry("attn_bwd_dq", 2048, 0),
                           entry("attn_bwd_dq", 1024, 0, CAUSAL=1)],
                          arch="sm90", machine={"gpu": "old"}, method={"rounds": 3})
    new = tuning.database([entry("attn_bwd_dq", 4096, 1)], arch="sm90", machine={"gpu": "new"}, method={"rounds": 5})
    (tmp_path / "old.json").write_bytes(tuning.dumps(old))
    (tmp_path / "new.json").write_bytes(tuning.dumps(new))
    db = merged([tmp_path / "old.json", tmp_path / "new.json"])
    # The non-causal dQ's bins are the new run's alone; the causal dQ it did not measure stays.
    assert sorted((e["kernel"], e["spec"]["CAUSAL"], e["bin"]) for e in db["entries"]) == [
        ("attn_bwd_dq", 0, 4096), ("attn_bwd_dq", 1, 1024), ("attn_fwd", 0, 1024)]
    assert sorted((r["spec"]["CAUSAL"], r["config"]) for r in db["rules"]["attn_bwd_dq"]) == [(0, 1), (1, 0)]
    assert db["machine"] == {"gpu": "new"} and db["method"]["rounds"] == 5
    # What the old GPU measured says so, in its entries and in the rules decided from them.
    kept = {(e["kernel"], e["spec"]["CAUSAL"]): e.get("source", "") for e in db["entries"]}
    assert kept == {("attn_bwd_dq", 0): "", ("attn_bwd_dq", 1): "python -m builder tune on old",
                    ("attn_fwd", 0): "python -m builder tune on old"}
    causal = next(r for r in db["rules"]["attn_bwd_dq"] if r["spec"]["CAUSAL"] == 1)
    assert "python -m builder tune on old" in causal["source"]
    hip = tuning.database([entry("attn_bwd_dq", 4096, 1)], arch="gfx942", machine={}, method={})
    (tmp_path / "hip.json").write_bytes(tuning.dumps(hip))
    with pytest.raises(tuning.TuningError, match="different arches"):
        merged([tmp_path / "old.json", tmp_path / "hip.json"])


def test_softcap_tunes_the_capped_forward_specs_and_the_default_set_keeps_their_winner(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--softcap``: every forward call capped, the entries and rules of the SOFTCAP=1 spec (the
    hardware-tanh config #2 winning here), which the forward's default set then holds; the
    backward's kernels are refused (their softcap specs run the portable kernels only)."""
    torch = pytest.importorskip("torch")
    from builder.registry import _kept_configs, load_kernels
    from builder.targets import KNOWN

    capped = {**BASE, "dtype": "bf16", "HEAD_DIM": 256, "HEAD_DIM_V": 256, "CAUSAL": 2, "SOFTCAP": 1, "ALIBI": 0}
    variants = [_synthetic_variant("attn_fwd", capped, i) for i in range(4)]
    (tmp_path / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                       "triton_version": "3.6.0", "tuning": {},
                                                       "variants": variants}))
    lib = aotriton_rt.Library(tmp_path)
    ms = {0: 1.0, 1: 1.1, 2: 0.89, 3: 0.95}
    seen = []

    class Capped(Operator):
        def __call__(self, q, k, v, *, causal, library, softcap=None):
            seen.append(softcap)
            rules = library.tuning.get("attn_fwd")
            self.config = rules[0]["config"] if rules else 0
            return q.float(), torch.zeros(q.shape[:3])

    op = Capped()
    monkeypatch.setattr(aotriton_rt, "attention", op)

    class CapClock(Clock):
        def calls(self, fn, n: int, flush: bool) -> list[float]:
            fn()
            return [ms[self.op.config]] * n

    entries = measure(lib, "sm90", ["attn_fwd"], ["bf16"], [256], [True], [1024], heads=2, tokens=1, rounds=2,
                      device="cpu", clock=CapClock(op), log=lambda m: None, softcap=50.0)
    assert set(seen) == {50.0}
    assert [(e.kernel, e.spec["SOFTCAP"], tuning.winner(e.timings).index) for e in entries] == [("attn_fwd", 1, 2)]
    rules = tuning.database(entries, arch="sm90", machine={"gpu": "test"}, method={})["rules"]
    monkeypatch.setattr(tuning, "_checked_in_rules", lambda arch: rules if arch == "sm90" else {})
    fwd = load_kernels()["attn_fwd"]
    for mode in (1, 2):  # the mode-2 measurement serves mode 1 too
        kept = [i for i, _ in _kept_configs(fwd, "default", {**capped, "CAUSAL": mode}, KNOWN["sm90"])]
        assert kept == [0, 2]
    assert [i for i, _ in _kept_configs(fwd, "default", {**capped, "SOFTCAP": 0}, KNOWN["sm90"])] == [0]
    with pytest.raises(tuning.TuningError, match="softcap tunes the forwards"):
        measure(lib, "sm90", ["attn_fwd", "attn_bwd"], ["bf16"], [256], [True], [1024], softcap=50.0)

