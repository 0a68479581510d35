"""Fixtures shared by the differential launch tests (test_differential_hip.py, _cuda.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def triton_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Triton cache for the builder and the JIT: the JIT of a variant hits the builder's
    compile of it when both specialize alike, so each variant compiles once per session
    (``AOTRITON_RT_DIFF_TRITON_CACHE`` keeps it across sessions, as .ci/run does)."""
    return Path(os.environ.get("AOTRITON_RT_DIFF_TRITON_CACHE") or tmp_path_factory.mktemp("triton-cache"))
