"""The local worker pool compiles a job that failed in a used worker once more in a fresh one.

The fixture kernel ``fresh_only`` (tests/builder/kernels_fixture/_dying) compiles in a fresh
process and fails in any process that compiled it before, as Triton 3.6's AMD fp8 conversions
did in the builder's long-lived workers: with one worker, its second job fails there and must
come out of a fresh worker; a job that fails in a fresh worker stays failed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from aotriton_rt.catalog import Catalog  # noqa: E402
from builder import registry  # noqa: E402
from builder.build import build  # noqa: E402
from builder.pool import LocalPool  # noqa: E402
from builder.targets import parse_targets  # noqa: E402

DYING = "tests.builder.kernels_fixture._dying"


@pytest.fixture(autouse=True)
def empty_triton_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every compile compiles (a Triton cache hit would skip the fixture's compile-time step);
    the workers inherit the variable when they start."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))


def _jobs() -> list[registry.Job]:
    jobs = registry.expand(registry.load_kernels(DYING)["fresh_only"], parse_targets("gfx942"), "full", "3.6.0",
                           package=DYING)
    assert len(jobs) == 2, "the fixture's two configs: two jobs for one worker"
    return jobs


def test_a_job_that_fails_in_a_used_worker_is_compiled_again_in_a_fresh_one(tmp_path: Path) -> None:
    jobs = _jobs()
    summary = build(jobs, tmp_path / "images", executor=LocalPool(1), workers=1, timeout=300.0, keep_going=True,
                    triton_version="3.6.0", quiet=True)
    assert (summary.compiled, summary.failed) == (2, [])
    assert sorted(v.key for v in Catalog.load(tmp_path / "images").variants) == sorted(j.key for j in jobs)


def test_a_real_error_fails_again_in_the_fresh_worker_and_is_reported_once(tmp_path: Path) -> None:
    broken = registry.expand(registry.load_kernels("tests.builder.kernels_fixture")["broken"],
                             parse_targets("gfx942"), "full", "3.6.0", package="tests.builder.kernels_fixture")
    results = []
    LocalPool(1).run(_jobs()[:1] + broken, 300.0, lambda job, status, payload: results.append((status, str(payload))))
    assert results == [("ok", results[0][1]), ("error", "BLOCK must be a multiple of 3")]
