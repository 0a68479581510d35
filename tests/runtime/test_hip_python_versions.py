"""The fake-library suite runs once per hip-python release we claim (.ci/run): this test makes
sure each run really uses the release it was given, in this process and in the subprocesses
that the HIP tests start."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = os.environ.get("AOTRITON_RT_EXPECT_HIP_PYTHON")

pytestmark = pytest.mark.skipif(not EXPECTED, reason="set by .ci/run's hip-python matrix only")


def test_the_hip_python_under_test_is_the_release_ci_installed() -> None:
    assert version("hip-python") == EXPECTED
    import hip

    assert Path(hip.__file__).resolve().is_relative_to(Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]).resolve())


def test_subprocesses_of_the_hip_tests_see_the_same_release() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    out = subprocess.run([sys.executable, "-c", "from importlib.metadata import version; print(version('hip-python'))"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == EXPECTED
