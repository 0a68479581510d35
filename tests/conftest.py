"""Shared test setup: the `gpu` marker skips, with a reason, where no CUDA GPU can be used."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def gpu_missing_reason() -> str | None:
    """None when a CUDA device is usable, else why not (checked without importing torch)."""
    for name in ("libcuda.so.1", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return "no CUDA driver library (libcuda.so.1) on this machine"
    if lib.cuInit(0) != 0:
        return "cuInit failed: no usable CUDA device"
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return "the CUDA driver reports no devices"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_missing_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_images(tmp_path_factory) -> Path:
    """An image folder with the default set for this GPU's arch, built here with the builder."""
    reason = gpu_missing_reason()
    if reason:
        pytest.skip(reason)
    lib = ctypes.CDLL("libcuda.so.1")
    major, minor = ctypes.c_int(), ctypes.c_int()
    dev = ctypes.c_int()
    lib.cuDeviceGet(ctypes.byref(dev), 0)
    lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # COMPUTE_CAPABILITY_MAJOR
    lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    arch = f"sm{major.value}{minor.value}"
    prebuilt = os.environ.get("AOTRITON_RT_TEST_IMAGES")
    if prebuilt:
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("images")
    subprocess.run([sys.executable, "-m", "builder", "build", "--targets", arch, "--out", str(out),
                    "-q", "--kernels", os.environ.get("AOTRITON_RT_TEST_KERNELS", "add,softmax,layernorm,rmsnorm")],
                   cwd=ROOT, check=True,
                   env={**os.environ, "AOTRITON_BUILDER_ANY_TRITON": "1"})
    return out


@pytest.fixture(scope="session")
def built_images(tmp_path_factory) -> Path:
    """A real image folder: add and softmax (default set) for two HIP and two CUDA targets."""
    out = tmp_path_factory.mktemp("built")
    subprocess.run([sys.executable, "-m", "builder", "build", "--targets", "gfx942,gfx1100,sm80,sm90",
                    "--kernels", "add,softmax", "--out", str(out), "-q", "-j", "2"],
                   cwd=ROOT, check=True)
    return out
