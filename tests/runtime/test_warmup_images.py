"""``aotriton_rt.warmup`` on real compiled images (the dispatched-kernel page's sm80 build) with a
recording driver: the module is loaded by the warm-up, and the first call after it loads none."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402
from aotriton_rt.ops import attention as op  # noqa: E402
from tests.builder.test_adding_a_dispatched_kernel import _qkv, driver, images  # noqa: E402,F401


def test_with_real_images_warmup_loads_the_module_and_the_first_call_loads_none(
        images: Any, driver: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 - the fixtures
    loads: list[int] = []
    real = driver.load_module
    monkeypatch.setattr(driver, "load_module", lambda dev, image: loads.append(len(image)) or real(dev, image))
    lib = aotriton_rt.Library(images, backend="cuda")
    (line,) = aotriton_rt.warmup(dtype="fp16", head_dim=64, seqlen=128, library=lib)
    assert line.startswith("attn_fwd[") and line.endswith("config #0 on device 0")
    assert "HEAD_DIM=64" in line and "dtype=fp16" in line and "CAUSAL=0" in line
    assert len(loads) == 1 and loads[0] > 1000  # the decompressed image went to the driver
    op.attention(*_qkv(), library=lib)
    assert len(loads) == 1 and len(driver.launches) == 1  # launched, nothing loaded again
