"""Building with Ray (``builder.cluster``, ``build --executor ray``) on a local Ray instance.

The command line builds ``add`` and ``softmax`` for sm90 and gfx942 (18 variants) once with the
process pool and once as Ray tasks (starting its own Ray); the other tests share one Ray instance
of two CPUs started here (``ray.init(num_cpus=2)``). A worker killed in the middle of a compile
comes from the fixture kernel ``dies_once``, which kills its own process on its first compile.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the builder compiles with triton")
pytest.importorskip("elftools", reason="the ABI proof reads ELF files with pyelftools")
pytest.importorskip("msgpack", reason="the ABI proof reads AMDGPU metadata with msgpack")

from aotriton_rt.catalog import Catalog  # noqa: E402
from builder import registry  # noqa: E402
from builder.__main__ import main  # noqa: E402
from builder.build import BuildError, Summary, build, prove_folder  # noqa: E402
from builder.cluster import RayExecutor, import_ray  # noqa: E402
from builder.merge import merge  # noqa: E402
from builder.pool import LocalPool  # noqa: E402
from builder.targets import parse_targets  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = "tests.builder.kernels_fixture"
DYING = FIXTURE + "._dying"
VERSION = "3.6.0"
SELECT = ["--kernels", "add,softmax", "--targets", "sm90,gfx942"]
NEEDS_RAY = "the Ray executor's tests need ray (pip install 'aotriton-rt[cluster]')"


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _cli(*args: str | Path, **extra_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("AOTRITON_BUILDER_ANY_TRITON", "AOTRITON_BUILDER_CACHE", "RAY_ADDRESS")} | extra_env
    return subprocess.run([sys.executable, "-m", "builder", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _jobs(kernel: str, targets: str, package: str = FIXTURE) -> list[registry.Job]:
    return registry.expand(registry.load_kernels(package)[kernel], parse_targets(targets), "default", VERSION,
                           package=package)


def _build(jobs: list, out: Path, executor, **kw) -> Summary:
    options = {"workers": 2, "timeout": 300.0, "keep_going": False, "triton_version": VERSION, "quiet": True}
    return build(jobs, out, executor=executor, **{**options, **kw})


@pytest.fixture(scope="module")
def pool_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """add and softmax for sm90 and gfx942, built by the command line with the process pool."""
    out = tmp_path_factory.mktemp("pool") / "images"
    done = _cli("build", *SELECT, "--out", out, "-j", "2", "-q")
    assert done.returncode == 0, done.stderr
    return out


# --------------------------------------------------------------------------- the command line


def test_the_command_line_builds_with_ray_the_same_bytes_as_the_process_pool(pool_build: Path,
                                                                              tmp_path: Path) -> None:
    pytest.importorskip("ray", reason=NEEDS_RAY)
    # The address file a `ray start` leaves behind, of a cluster long gone: without --address the
    # build starts its own Ray instead of waiting for that one (Ray's temporary folder must be
    # short: its sockets live there).
    ray_tmp = Path(tempfile.mkdtemp(prefix="aotriton-ray-", dir="/tmp"))
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")
    started = time.monotonic()
    try:
        done = _cli("build", *SELECT, "--out", tmp_path / "ray", "--executor", "ray", RAY_TMPDIR=str(ray_tmp))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert f"building 18 variants (default set) into {tmp_path / 'ray'} as Ray tasks" in done.stderr
    assert re.search(r"^\[18/18\] failed 0, \d+ s, ETA 0 s$", done.stderr, re.M), done.stderr  # progress
    assert done.stdout.startswith("compiled 18, reused 0, failed 0;")
    assert _tree(tmp_path / "ray") == _tree(pool_build)
    assert seconds < 120, f"a local Ray build of 18 small variants took {seconds:.0f} s"


def test_ray_options_without_the_ray_executor_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["build", *SELECT, "--out", str(tmp_path), "--address", "auto"]) == 1
    assert capsys.readouterr().err == "error: --address is for --executor ray\n"
    assert main(["build", *SELECT, "--out", str(tmp_path), "--retries", "1"]) == 1
    assert capsys.readouterr().err == "error: --retries is for --executor ray\n"
    with pytest.raises(ValueError, match=r"^retries must be >= 0, got -1$"):
        RayExecutor(retries=-1)
    assert not any(tmp_path.iterdir())


def test_a_missing_ray_is_named_with_the_extra_that_installs_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    message = ("--executor ray needs Ray, which is not installed: pip install 'aotriton-rt[cluster]' "
               "(or pip install ray)")
    with pytest.raises(BuildError, match=re.escape(message)):
        import_ray()
    assert main(["build", *SELECT, "--out", str(tmp_path), "--executor", "ray"]) == 1
    assert capsys.readouterr().err == f"error: {message}\n"


# --------------------------------------------------------------------------- on a local Ray instance


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A local Ray instance of two CPUs; its workers see AOTRITON_TEST_DIE_ONCE (dies_once's marker)."""
    ray = pytest.importorskip("ray", reason=NEEDS_RAY)
    marker = tmp_path_factory.mktemp("dying") / "died"
    with pytest.MonkeyPatch.context() as mp:
        # Workers inherit the environment of the process that starts Ray.
        mp.setenv("AOTRITON_TEST_DIE_ONCE", str(marker))
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
        mp.delenv("RAY_ADDRESS", raising=False)
        started = time.monotonic()
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False)
        print(f"ray.init: {time.monotonic() - started:.1f} s", file=sys.stderr)
        try:
            yield marker
        finally:
            ray.shutdown()


def test_shards_built_by_ray_and_by_the_pool_merge_into_the_same_bytes(ray_cluster, pool_build: Path,
                                                                        tmp_path: Path) -> None:
    jobs = [j for k in registry.select(registry.load_kernels(), "add,softmax")
            for j in registry.expand(k, parse_targets("sm90,gfx942"), "default", VERSION)]
    tuning = registry.tuning_of(registry.load_kernels(), jobs)
    first = _build(registry.shard(jobs, "1/2"), tmp_path / "one", RayExecutor(), tuning=tuning)
    second = _build(registry.shard(jobs, "2/2"), tmp_path / "two", LocalPool(2), tuning=tuning)
    assert (first.compiled, second.compiled, first.failed, second.failed) == (9, 9, [], [])
    merge([tmp_path / "one", tmp_path / "two"], tmp_path / "merged")
    assert _tree(tmp_path / "merged") == _tree(pool_build)


def test_a_worker_killed_in_the_middle_of_a_compile_is_retried_and_the_build_completes(
        ray_cluster: Path, tmp_path: Path) -> None:
    ray_cluster.unlink(missing_ok=True)
    jobs = _jobs("dies_once", "gfx942,sm90", DYING) + [j for j in _jobs("scale", "gfx942") if j.spec["dtype"] == "fp32"]
    summary = _build(jobs, tmp_path / "images", RayExecutor(retries=2))
    assert ray_cluster.exists(), "no worker was killed: the test proves nothing"
    assert (summary.compiled, summary.failed) == (3, [])
    assert sorted(v.key for v in Catalog.load(tmp_path / "images").variants) == sorted(j.key for j in jobs)
    assert prove_folder(tmp_path / "images") == 3


def test_a_worker_that_dies_on_every_attempt_fails_its_job_by_name(ray_cluster: Path, tmp_path: Path) -> None:
    ray_cluster.unlink(missing_ok=True)
    jobs = _jobs("dies_once", "gfx942", DYING)
    summary = _build(jobs, tmp_path / "images", RayExecutor(retries=0), keep_going=True)
    assert ray_cluster.exists()
    assert summary.failed == [("dies_once[]#0@gfx942", "worker died (WorkerCrashedError; 1 attempt)")]
    assert Catalog.load(tmp_path / "images").variants == ()


def test_a_task_past_its_timeout_is_cancelled_and_reported_and_the_rest_builds(ray_cluster, tmp_path: Path) -> None:
    slow = _jobs("slow", "gfx942")
    scale = [j for j in _jobs("scale", "gfx942") if j.spec["dtype"] == "fp32"]
    started = time.monotonic()
    summary = _build(slow + scale, tmp_path / "images", RayExecutor(), timeout=8.0, keep_going=True)
    assert time.monotonic() - started < 60
    assert summary.failed == [("slow[]#0@gfx942", "timed out after 8 s")]
    assert summary.compiled == 1
    assert [v.key for v in Catalog.load(tmp_path / "images").variants] == [scale[0].key]


def test_a_worker_with_another_source_than_the_build_refuses_to_compile_under_its_key(
        ray_cluster, tmp_path: Path) -> None:
    job = replace(_jobs("scale", "gfx942")[0], key="0" * 64)
    summary = _build([job], tmp_path / "images", RayExecutor(), keep_going=True)
    assert summary.failed == [(job.label, f"the Ray worker on {socket.gethostname()} has another source of scale or "
                                          "Triton than the machine that started the build: run every node from the "
                                          "same commit and Triton version")]
