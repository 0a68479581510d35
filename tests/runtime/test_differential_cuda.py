"""aotriton-rt launches CUDA kernels exactly as Triton's own CUDA launcher does.

The CUDA twin of test_differential_hip.py: for every kernel of the default set on every
default CUDA target (one variant each), ``@triton.jit`` launches through Triton's own CUDA
driver (its C launcher linked against the recording fake ``libcuda.so.1`` from
tests/fakecuda) and aotriton-rt launches the builder's cubin of the same variant. Both must
agree on the cubin, kernel, grid, block, dynamic shared memory, stream, launch attributes and
every byte of the parameter bank that the fake builds from the cubin's ``.nv.info`` records.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.targets import DEFAULT
from tests.fakecuda import build_fake_cuda, fake_cuda_env
from tests.fakehip.differential import compile_env, differences, hooked_env, logged_launches, run_python

CUDA_TARGETS = tuple(a for a in DEFAULT if a.startswith("sm"))
LAUNCHES = ("cuLaunchKernel", "cuLaunchKernelEx")


@pytest.fixture(scope="session")
def cuda_sample_images(tmp_path_factory: pytest.TempPathFactory, triton_cache: Path) -> Path:
    out = tmp_path_factory.mktemp("diff-cuda")
    run_python(["-m", "tests.fakehip.differential", "build", str(out), ",".join(CUDA_TARGETS), "default", "1"],
               compile_env(triton_cache))
    return out


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_cuda(tmp_path_factory.mktemp("fakecuda"))


def launch_both(images: Path, arch: str, fake: Path, tmp: Path, triton_cache: Path,
                extra_env: dict[str, str] | None = None) -> tuple[dict, dict]:
    env = {**compile_env(triton_cache), **fake_cuda_env(fake, None, capability=int(arch[2:])),
           **(extra_env or {})}
    return logged_launches(images, arch, tmp, env, LAUNCHES, "cuModuleLoadData")


@pytest.mark.slow
@pytest.mark.parametrize("arch", CUDA_TARGETS)
def test_aotriton_launches_every_default_cuda_kernel_as_tritons_own_launcher_does(
        cuda_sample_images: Path, fake_libcuda: Path, tmp_path: Path, triton_cache: Path, arch: str) -> None:
    jit, aot = launch_both(cuda_sample_images, arch, fake_libcuda, tmp_path, triton_cache)
    assert len(jit) == len(aot) >= 8
    assert differences(cuda_sample_images, arch, jit, aot) == []


@pytest.mark.slow
def test_cuda_differential_fails_when_our_grid_is_wrong(cuda_sample_images: Path, fake_libcuda: Path,
                                                         tmp_path: Path, triton_cache: Path) -> None:
    env = hooked_env(tmp_path, "import aotriton_rt.drivers.cuda as c\n"
                                "_orig = c.CudaLauncher.__call__\n"
                                "def _wrong(self, gx, gy, gz, stream, values):\n"
                                "    return _orig(self, gx, gy + 1, gz, stream, values)\n"
                                "c.CudaLauncher.__call__ = _wrong\n")
    jit, aot = launch_both(cuda_sample_images, "sm90", fake_libcuda, tmp_path, triton_cache, env)
    problems = differences(cuda_sample_images, "sm90", jit, aot)
    assert problems and all("grid" in p for p in problems), problems
