"""Attention on eight streams at once gives the one-stream results, bit for bit (marker ``gpu``).

Runs ``tests/helpers/streams_stress.py`` in a subprocess (a GPU fault would leave this process's
context unusable): every kernel family the sm90 images dispatch from 8 threads on 8 streams,
CUDA graphs captured on two streams replayed beside eager calls, and the JAX path under
``jax.jit`` from 8 threads. Images: ``AOTRITON_RT_TEST_IMAGES`` pointing at ``python -m builder
build --set gputest --targets sm90``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "streams_stress.py"


@pytest.mark.parametrize("families", ["fwd", "bwd", "decode", "graph", "jax"])
def test_every_kernel_family_on_eight_streams_matches_one_stream_bitwise(sm90_images: str,
                                                                         families: str) -> None:
    if families == "jax":
        pytest.importorskip("jax")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--images", sm90_images, "--families", families,
                           "--threads", "8", "--iters", "4"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 mismatches" in proc.stdout
