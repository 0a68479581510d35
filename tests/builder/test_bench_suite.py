"""python -m bench (bench/__main__.py) on the CPU: its arguments, the --quick settings each benchmark
gets, the skips without a GPU, the JSON it writes, the ratios it reads and the plot it draws."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import __main__ as runner
from bench import common, results


class FakeRun:
    """subprocess.run standing in for the benchmarks: records each call, writes ``raw`` to --json."""

    def __init__(self, raw: dict | None = None, rc: int = 0) -> None:
        self.calls: list[tuple[list[str], dict]] = []
        self.raw, self.rc = raw or {}, rc

    def __call__(self, cmd: list[str], cwd: Path, env: dict, timeout: float | None) -> subprocess.CompletedProcess:
        self.calls.append((cmd, env))
        name = cmd[2].removeprefix("bench.")
        if name in self.raw:
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(self.raw[name]))
        return subprocess.CompletedProcess(cmd, self.rc)

    def command(self, name: str) -> list[str]:
        return next(cmd for cmd, _ in self.calls if cmd[2] == f"bench.{name}")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeRun:
    run = FakeRun()
    monkeypatch.setattr(runner.subprocess, "run", run)
    return run


def test_the_arguments_pick_benchmarks_and_the_results_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    args = runner.parse(["--only", "decode, attention"])
    assert args.names == ["decode", "attention"] and args.out == tmp_path and not args.quick
    monkeypatch.delenv("OUT")
    assert runner.parse([]).names == list(runner.BENCHMARKS)
    assert runner.parse([]).out == Path("bench-results")
    assert runner.parse(["--out", "x"]).out == Path("x")
    with pytest.raises(SystemExit):
        runner.parse(["--only", "attention,sm90_bwd"])  # investigations are not the suite's


def test_quick_settings_reach_every_benchmark_on_a_gpu(fake: FakeRun, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    monkeypatch.setattr(runner, "gpu_available", lambda: True)
    assert runner.main(["--quick", "--images", "IMG", "--out", str(tmp_path)]) == 0
    assert [cmd[2] for cmd, _ in fake.calls] == [f"bench.{n}" for n in runner.BENCHMARKS]
    for cmd, env in fake.calls:
        assert cmd[1] == "-m" and env["AOTRITON_RT_IMAGES"] == "IMG" and env["OUT"] == str(tmp_path / "raw")
        assert cmd[-2:] == ["--json", str(tmp_path / "raw" / f"{cmd[2][6:]}.json")]
    assert fake.command("attention")[3:-2] == ["--shapes", "d128", "--dtype", "bf16", "--causal", "1",
                                               "--rounds", "3", "--no-jit", "--images", "IMG"]
    assert fake.command("attention_jit")[3:-2] == ["--n", "4096", "--d", "128", "--causal", "2", "--dtype", "bf16"]
    assert fake.command("decode")[3:-2] == ["--b", "8", "--cache", "8192", "--gqa", "4", "--page", "16",
                                            "--rounds", "3"]
    assert fake.command("host_cost")[3:-2] == ["--rounds", "3", "--calls", "200", "--fresh", "2", "--synth", "0",
                                               "--images", "IMG"]
    assert fake.command("launch_overhead")[3:-2] == ["--launches", "2000", "--repeats", "3", "--images", "IMG"]
    assert fake.command("jax_jit")[3:-2] == ["--rounds", "3", "--iters", "10"]
    assert fake.command("build_cost")[3:6] == ["estimate", "--set", "default"]


def test_without_quick_the_benchmarks_get_their_own_defaults(fake: FakeRun, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setattr(runner, "gpu_available", lambda: True)
    runner.main(["--only", "attention,decode,host_cost", "--out", str(tmp_path)])
    assert fake.command("attention")[3:] == ["--json", str(tmp_path / "raw" / "attention.json")]
    assert fake.command("decode")[3:-2] == []
    assert fake.command("host_cost")[3:-2] == ["--python-path"]  # no --images: its GPU rows cannot run


def test_a_cpu_only_run_skips_the_gpu_benchmarks_and_runs_the_cpu_ones(fake: FakeRun, monkeypatch, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(runner, "gpu_available", lambda: False)
    assert runner.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("attention", "attention_jit", "decode", "launch_overhead", "jax_jit"):
        assert f"{name}: skipped: needs a GPU" in out
        assert json.loads((tmp_path / f"{name}.json").read_text())["status"] == "skipped"
    assert [cmd[2] for cmd, _ in fake.calls] == ["bench.host_cost", "bench.build_cost"]
    assert fake.command("host_cost")[3:-2] == ["--python-path", "--rounds", "3", "--calls", "200"]


def test_the_json_holds_the_scripts_own_results_and_the_ratios(monkeypatch, tmp_path: Path) -> None:
    raw = {"rows": [{"B": 8, "cache": 8192, "gqa": 4,
                     "graph": {"ours": {"median_us": 10.0, "runs": [10.0, 11.0, 9.0]},
                               "sdpa:flash": {"median_us": 12.0, "runs": [12.0, 11.0, 13.5]},
                               "p16": {"median_us": 10.5, "runs": [10.5, 10.5, 10.5]}}}]}
    fake = FakeRun({"decode": raw})
    monkeypatch.setattr(runner.subprocess, "run", fake)
    monkeypatch.setattr(runner, "gpu_available", lambda: True)
    assert runner.main(["--only", "decode", "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "decode.json").read_text())
    assert got["status"] == "ok" and got["raw"] == raw and got["command"][:2] == ["-m", "bench.decode"]
    [entry] = got["ratios"]
    assert entry["row"] == "B8 S8192 4:1" and entry["ours"] == "aotriton_rt" and entry["peer"] == "SDPA flash"
    assert entry["median"] == pytest.approx(1.2) and entry["min"] == pytest.approx(1.0)
    assert entry["max"] == pytest.approx(1.5)  # per round: 12/10, 11/11, 13.5/9


def test_a_failing_benchmark_makes_the_exit_status_1(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(runner.subprocess, "run", FakeRun(rc=3))
    monkeypatch.setattr(runner, "gpu_available", lambda: False)
    assert runner.main(["--only", "build_cost", "--out", str(tmp_path)]) == 1
    assert json.loads((tmp_path / "build_cost.json").read_text())["status"] == "failed"


def test_contenders_carry_the_same_names_in_every_benchmark() -> None:
    assert common.contender("ours") == "aotriton_rt"
    assert common.contender("cudnn-train") == "SDPA cuDNN (train)" and common.contender("fa2-inf") == "SDPA flash (inf)"
    assert {common.contender(k) for k in ("sdpa:flash", "flash", "fa2")} == {"SDPA flash"}
    assert common.contender("jit") == "Triton JIT" and common.contender("sdpa:math") == "SDPA math"
    raw = {"forward": {"aotriton_rt.attention": {"median": 10.0, "min": 9.0, "max": 12.0},
                       "SDPA flash": {"median": 20.0, "min": 18.0, "max": 24.0}}}
    [entry] = results.host_cost(raw)
    assert entry["peer"] == "SDPA flash" and entry["median"] == 2.0 and entry["min"] == 1.5
    assert entry["max"] == pytest.approx(24 / 9)


def test_attention_ratios_pair_the_rounds() -> None:
    pytest.importorskip("torch")
    cs = {"ours fwd": {"median_ms": 1.0, "min_ms": 0.9, "max_ms": 1.1, "rounds_ms": [1.0, 0.9, 1.1]},
          "cudnn-inf fwd": {"median_ms": 1.2, "min_ms": 1.1, "max_ms": 1.3, "rounds_ms": [1.2, 1.1, 1.3]}}
    [entry] = results.attention({"rows": [{"shape": "bf16 B4 H32 N4096 D128 causal", "contenders": cs}]})
    assert entry["row"] == "bf16 B4 H32 N4096 D128 causal fwd" and entry["peer"] == "SDPA cuDNN (inf)"
    assert entry["median"] == pytest.approx(1.2) and entry["min"] == pytest.approx(1.3 / 1.1)


def test_rounds_change_the_contenders_order() -> None:
    orders = common.round_orders("abcd", 6, seed=1)
    assert all(sorted(o) == list("abcd") for o in orders) and len({tuple(o) for o in orders}) > 1
    assert common.round_orders("abc", 2, order="alternate") == [list("abc"), list("cba")]
    calls = []
    got = common.shuffled_rounds({"x": lambda: calls.append("x") or 1.0, "y": lambda: calls.append("y") or 3.0}, 3)
    assert got == {"x": [1.0] * 3, "y": [3.0] * 3} and len(calls) == 6
    assert common.summary([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


def test_the_plot_is_a_png_of_the_ratios(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from bench.plot import plot

    result = {"benchmark": "attention", "quick": True, "ratios": [
        common.ratio_entry("fp16 N4096 fwd", "SDPA cuDNN (inf)", {"median": 0.95, "min": 0.9, "max": 1.0}),
        common.ratio_entry("fp16 N4096 fwd", "SDPA flash (inf)", {"median": 1.3, "min": 1.2, "max": 1.35}),
        common.ratio_entry("fp16 N4096 bwd", "SDPA cuDNN (train)", {"median": 0.8, "min": 0.78, "max": 0.82})]}
    path = plot(result, tmp_path / "attention.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    with pytest.raises(ValueError, match="no ratios"):
        plot({"benchmark": "build_cost", "ratios": []}, tmp_path / "none.png")
