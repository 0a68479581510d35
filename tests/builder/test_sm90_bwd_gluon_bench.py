"""bench/sm90_bwd_gluon.py on the CPU: its shapes, how a faulting shape costs only itself, the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.benches import load_bench


@pytest.fixture
def bench():
    return load_bench("sm90_bwd_gluon.py")


def test_it_times_the_issues_training_shapes(bench) -> None:
    assert len(bench.SHAPES) == 12
    long, short = bench.SHAPES[:8], bench.SHAPES[8:]
    assert {s[:3] for s in long} == {(dt, d, c) for dt in ("fp16", "bf16") for d in (64, 128) for c in (0, 2)}
    assert {s[3:] for s in long} == {(4, 32, 4096)}
    assert {s[:3] for s in short} == {(dt, 128, c) for dt in ("fp16", "bf16") for c in (0, 2)}
    assert {s[3:] for s in short} == {(16, 32, 1024)}
    assert bench.shapes_of("0,3") == [bench.SHAPES[0], bench.SHAPES[3]]


def _row(tflops: float, vs_cudnn: float | None, vs_portable: float | None) -> dict:
    return {"tflops": tflops, "tflops_min": tflops - 5, "tflops_max": tflops + 5, "vs_cudnn": vs_cudnn,
            "vs_portable": vs_portable}


def test_a_shape_whose_child_dies_is_recorded_and_the_next_child_resumes_after_it(bench, tmp_path: Path) -> None:
    calls = []

    def run(argv: list[str], timeout: float):
        start = int(argv[argv.index("--start") + 1])
        path = Path(argv[argv.index("--result") + 1])
        calls.append(start)
        with open(path, "a") as f:
            for i in range(start, 3):
                if i == 1 and start <= 1:
                    return "exit status -11"  # the shape-1 kernel faults
                f.write(json.dumps({"shape": list(bench.SHAPES[i]), "rows": {}, "notes": []}) + "\n")
        return None

    results = bench.run_shapes("DIR", [], 3, 2, 60.0, tmp_path, run=run)
    assert calls == [0, 2]
    assert [r.get("error") for r in results] == [None, "the timing process: exit status -11", None]


def test_the_summary_gives_ratios_to_cudnn_and_the_portable_backward_and_the_best_of_each_pairing(bench) -> None:
    shape = bench.SHAPES[0]
    rows = {"cudnn": _row(500, 1.0, 1.4), "port+port": _row(350, 0.7, 1.0), "g#0+port": _row(400, 0.8, 1.14),
            "g#1+port": _row(410, 0.82, 1.17), "g#0+g#0": _row(460, 0.92, 1.31), "g#0+g#1": _row(440, 0.88, 1.26),
            "g#0+atom": _row(470, 0.94, 1.34), "g#1+atom": _row(480, 0.96, 1.37)}
    lines = bench.summary_lines([{"shape": list(shape), "rows": rows, "notes": []},
                                 {"error": "the timing process: timed out after 300 s"}], [shape, bench.SHAPES[1]])
    table = [line for line in lines if line.startswith("fp16 D128 full") and " best " not in line
             and ": none" not in line]
    assert [line.split()[6] for line in table] == ["cudnn", "port+port", "g#0+port", "g#1+port", "g#0+g#0",
                                                   "g#0+g#1", "g#0+atom", "g#1+atom"]
    assert table[4].split()[6:] == ["g#0+g#0", "460", "455-465", "0.92", "1.31"]
    assert lines[-4:-1] == [
        "fp16 D128 full B4 H32 N4096  Gluon dK/dV + portable dQ: best g#1+port 410 TFLOP/s, 0.82x cuDNN, "
        "1.17x portable",
        "fp16 D128 full B4 H32 N4096  Gluon dK/dV + Gluon dQ: best g#0+g#0 460 TFLOP/s, 0.92x cuDNN, 1.31x portable",
        "fp16 D128 full B4 H32 N4096  Gluon dK/dV + fused atomic dQ: best g#1+atom 480 TFLOP/s, 0.96x cuDNN, "
        "1.37x portable"]
    assert "bf16 D128 full B4 H32 N4096  the timing process: timed out after 300 s" in lines
    assert lines[-1].startswith("bf16 D128 full B4 H32 N4096  nothing timed")


class _Variant:
    def __init__(self, kernel: str, dtype: str, d: int, causal: int, index: int, atomic: int | None = None,
                 persistent: int = 0) -> None:
        from types import SimpleNamespace

        self.kernel = kernel
        self.target = SimpleNamespace(arch="sm90")
        self.spec = {"dtype": dtype, "HEAD_DIM": d, "CAUSAL": causal}
        if atomic is not None:
            self.spec.update({"BIAS": 0, "DROPOUT": 0, "VARLEN": 0, "DQ_ATOMIC": atomic})
        self.config = SimpleNamespace(index=index, constexprs={"PERSISTENT": persistent})


class _Lib:
    """What contender_views reads of a Library: variants, and tuning views (``with_tuning``)."""

    def __init__(self, variants: list, tuning: dict | None = None) -> None:
        self._variants = variants
        self.tuning = tuning or {}

    def with_tuning(self, rules: dict) -> _Lib:
        return _Lib(self._variants, {**self.tuning, **rules})

    def variants_of(self, name: str) -> list:
        return [v for v in self._variants if v.kernel == name]


def test_the_contenders_pair_each_gluon_dkdv_config_with_the_portable_dq_and_config_0_with_each_gluon_dq(
        bench) -> None:
    shape = bench.SHAPES[0]  # fp16 D128 no mask
    held = [_Variant(bench.GLUON, "fp16", 128, 0, i) for i in (0, 1)] + \
        [_Variant(bench.GLUON_DQ, "fp16", 128, 0, j) for j in (0, 1, 2)] + \
        [_Variant(bench.GLUON_DQ, "bf16", 128, 0, 5), _Variant(bench.GLUON, "fp16", 128, 2, 7)]
    views = bench.contender_views(_Lib(held), shape)
    assert {label: wanted for label, (_, wanted, _) in views.items()} == {
        "port+port": (("attn_bwd_dkdv", None), ("attn_bwd_dq", None)),
        "g#0+port": ((bench.GLUON, 0), ("attn_bwd_dq", None)),
        "g#1+port": ((bench.GLUON, 1), ("attn_bwd_dq", None)),
        "g#0+g#0": ((bench.GLUON, 0), (bench.GLUON_DQ, 0)),
        "g#0+g#1": ((bench.GLUON, 0), (bench.GLUON_DQ, 1)),
        "g#0+g#2": ((bench.GLUON, 0), (bench.GLUON_DQ, 2))}
    # With persistent configs of both kernels held, they also run together.
    more = held + [_Variant(bench.GLUON, "fp16", 128, 0, 2, persistent=132),
                   _Variant(bench.GLUON_DQ, "fp16", 128, 0, 3, persistent=132)]
    both = bench.contender_views(_Lib(more), shape)
    assert both["g#2+g#3"][1] == ((bench.GLUON, 2), (bench.GLUON_DQ, 3))
    assert set(both) - set(views) == {"g#2+port", "g#0+g#3", "g#2+g#3"}
    table = views["g#0+g#1"][0].tuning
    assert table["attn_bwd_dkdv_kernel"] == [{"kernel": bench.GLUON}]
    assert table["attn_bwd_dq_kernel"] == [{"kernel": bench.GLUON_DQ}]
    assert table[bench.GLUON] == [{"config": 0}] and table[bench.GLUON_DQ] == [{"config": 1}]
    assert views["g#1+port"][0].tuning["attn_bwd_dq_kernel"] == [{"kernel": "attn_bwd_dq"}]
    assert all(scheme == {"deterministic": True} for _, _, scheme in views.values())


def test_the_atomic_contenders_run_each_gluon_atomic_dkdv_config_and_the_portable_one_where_held(bench) -> None:
    shape = bench.SHAPES[2]  # fp16 D128 causal
    held = [_Variant(bench.GLUON, "fp16", 128, 2, i, atomic=a) for i in (0, 1) for a in (0, 1)] + \
        [_Variant(bench.PORTABLE, "fp16", 128, 2, 0, atomic=1), _Variant(bench.GLUON, "fp16", 128, 0, 3, atomic=1)]
    views = bench.contender_views(_Lib(held), shape)
    atomic = {label: (wanted, scheme) for label, (_, wanted, scheme) in views.items() if "atom" in label}
    assert atomic == {
        "g#0+atom": (((bench.GLUON, 0), ("attn_bwd_dq_convert", None)), {"deterministic": False, "scheme": "atomic"}),
        "g#1+atom": (((bench.GLUON, 1), ("attn_bwd_dq_convert", None)), {"deterministic": False, "scheme": "atomic"}),
        "port+atom": ((("attn_bwd_dkdv", None), ("attn_bwd_dq_convert", None)),
                      {"deterministic": False, "scheme": "atomic"})}
    assert {"g#0+port", "g#1+port"} <= set(views)  # the split contenders stay
    tuning = views["g#1+atom"][0].tuning
    assert tuning["attn_bwd_dkdv_kernel"] == [{"kernel": bench.GLUON}] and tuning[bench.GLUON] == [{"config": 1}]
    assert views["port+atom"][0].tuning["attn_bwd_dkdv_kernel"] == [{"kernel": "attn_bwd_dkdv"}]
    # Images without the portable atomic dK/dV: no port+atom.
    assert "port+atom" not in bench.contender_views(_Lib(held[:4]), shape)


def test_without_images_it_says_how_to_build_them(bench, capsys) -> None:
    assert bench.main(["--images", "/nonexistent"]) == 1
    assert "no image folder at '/nonexistent'" in capsys.readouterr().out


def test_a_bottom_right_causal_shape_pairs_the_mode_1_variants_where_the_images_lack_mode_2(bench) -> None:
    """Equal lengths: the dispatcher serves a bottom-right call with mode 1 (causal_align) when mode 2
    is not built, so the bench times those variants; mode 2's where held."""
    shape = bench.SHAPES[2]  # fp16 D128 causal (mode 2)
    mode1 = [_Variant(bench.GLUON, "fp16", 128, 1, i, atomic=a) for i in (0, 1) for a in (0, 1)]
    assert bench.gluon_configs(_Lib(mode1), shape) == [0, 1]
    assert bench.gluon_configs(_Lib(mode1), shape, atomic=1) == [0, 1]
    both = mode1 + [_Variant(bench.GLUON, "fp16", 128, 2, 5, atomic=0)]
    assert bench.gluon_configs(_Lib(both), shape) == [5]
    assert bench.gluon_configs(_Lib(mode1), bench.SHAPES[0]) == []  # no mask: mode 0 only
