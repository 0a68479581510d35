"""Fixtures shared by runtime tests: the Triton cache of the differential launch tests
(test_differential_hip.py, _cuda.py), the sm90 GPU tests' image folder and the default images
on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def triton_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Triton cache for the builder and the JIT: the JIT of a variant hits the builder's
    compile of it when both specialize alike, so each variant compiles once per session
    (``AOTRITON_RT_DIFF_TRITON_CACHE`` keeps it across sessions, as .ci/run does)."""
    return Path(os.environ.get("AOTRITON_RT_DIFF_TRITON_CACHE") or tmp_path_factory.mktemp("triton-cache"))


@pytest.fixture()
def sm90_images() -> str:
    """The gputest sm90 image folder of ``AOTRITON_RT_TEST_IMAGES``; skips without an sm90 GPU
    visible to torch or without the variable."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU visible to torch")
    folder = os.environ.get("AOTRITON_RT_TEST_IMAGES")
    if not folder:
        pytest.skip("set AOTRITON_RT_TEST_IMAGES to images built with --set gputest --targets sm90")
    return folder


@pytest.fixture(scope="session")
def default_lib(tmp_path_factory: pytest.TempPathFactory):
    """A Library of the default images (what the runtime wheel embeds) for this GPU:
    ``AOTRITON_RT_DEFAULT_IMAGES``, else the set built here for this GPU's arch."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU visible to torch")
    import aotriton_rt

    folder = os.environ.get("AOTRITON_RT_DEFAULT_IMAGES")
    if not folder:
        major, minor = torch.cuda.get_device_capability()
        folder = str(tmp_path_factory.mktemp("default"))
        subprocess.run([sys.executable, "-m", "builder", "build", "--set", "default", "--targets",
                        f"sm{major}{minor}", "--out", folder, "-q", "-j", str(os.cpu_count() or 2)],
                       cwd=Path(__file__).resolve().parents[2], check=True)
    return aotriton_rt.Library(folder)


@pytest.fixture(scope="module")
def decode_lib(gpu_images: Path):
    """A Library of the GPU test images that holds the decode kernels (else the test skips)."""
    torch = pytest.importorskip("torch")
    import aotriton_rt

    library = aotriton_rt.Library(gpu_images)
    if "attn_decode" not in library.kernels:
        pytest.skip(f"the images at {gpu_images} have no decode kernels; build them with `python -m builder build "
                    f"--set gputest --targets sm90` and set AOTRITON_RT_TEST_IMAGES")
    torch.backends.cuda.matmul.allow_tf32 = False
    return library
