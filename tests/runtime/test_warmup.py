"""``aotriton_rt.warmup``: what an attention call will launch, readied ahead of the call.

- With the recording "images" of the plan tests: warmup makes the dispatch's choice and readies
  every chosen handle (forward, and the backward's with ``backward=True``) on the device asked;
  the call that follows chooses nothing anew; the background form hands back its result or its
  error through a Future; bad facts are refused as the call would refuse them.
- With real compiled images and a recording driver (tests/runtime/test_warmup_images.py): warmup
  loads the module, and the first attention call after it loads none.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402
from aotriton_rt import ArgumentError, KernelNotFound  # noqa: E402
from aotriton_rt.ops import attention as op  # noqa: E402
from aotriton_rt.ops.attention import dispatch  # noqa: E402
from tests.runtime.test_attention_plan import RecordingKernel, RecordingLibrary, cpu_arrays, qkv  # noqa: E402,F401


class _Variant:
    def __init__(self, kernel: str, spec: dict) -> None:
        self.kernel, self.spec = kernel, spec
        self.config = type("Config", (), {"index": 0})()


class ReadyingKernel(RecordingKernel):
    """A recording handle that also records being readied (``variant(device)``)."""

    def variant(self, device: int = 0) -> _Variant:
        with self.lib.lock:
            self.lib.readied.append((self.name, device))
        return _Variant(self.name, dict(self.spec))


class ReadyingLibrary(RecordingLibrary):
    def __init__(self) -> None:
        super().__init__()
        self.readied: list[tuple[str, int]] = []

    def kernel(self, name: str, **params: Any) -> ReadyingKernel:
        if not self.has(name, params):
            raise KernelNotFound(f"{name} with {params} is not in these images")
        return ReadyingKernel(self, name, params)


@pytest.fixture(scope="module")
def lib() -> ReadyingLibrary:  # the plan tests' autouse fixture clears its plans and launches
    return ReadyingLibrary()


@pytest.fixture
def chosen(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The dispatch's choices as they are made (forward and backward)."""
    made: list[str] = []
    fwd, bwd = dispatch.choose_forward, dispatch.choose_backward
    monkeypatch.setattr(dispatch, "choose_forward", lambda *a, **k: made.append("fwd") or fwd(*a, **k))
    monkeypatch.setattr(dispatch, "choose_backward", lambda *a, **k: made.append("bwd") or bwd(*a, **k))
    return made


def test_warmup_readies_the_forward_and_the_call_after_it_chooses_nothing(lib: ReadyingLibrary,
                                                                          chosen: list[str]) -> None:
    dispatch.kernels_of(lib).choices.clear()
    lib.readied.clear()
    lines = aotriton_rt.warmup(dtype="fp16", head_dim=32, seqlen=24, causal=True, device=1, library=lib)
    assert lib.readied == [("attn_fwd", 1)] and chosen == ["fwd"]
    assert len(lines) == 1 and lines[0].startswith("attn_fwd[") and lines[0].endswith("config #0 on device 1")
    assert "dtype=fp16" in lines[0] and "HEAD_DIM=32" in lines[0]
    # Device 1 was readied, so the call on device 0 chooses for itself; a second warm-up of
    # device 0 makes the choice the call then finds.
    aotriton_rt.warmup(dtype="fp16", head_dim=32, seqlen=24, causal=True, library=lib)
    assert chosen == ["fwd", "fwd"]
    q, k, v = qkv(S=24, D=32)
    op.attention(q, k, v, causal=True, library=lib)
    assert chosen == ["fwd", "fwd"]  # the call found the warm-up's choice


def test_warmup_with_backward_readies_the_training_steps_kernels(lib: ReadyingLibrary, chosen: list[str]) -> None:
    dispatch.kernels_of(lib).choices.clear()
    lib.readied.clear()
    lines = aotriton_rt.warmup(dtype="bf16", head_dim=64, seqlen=128, backward=True, library=lib)
    assert [name for name, _ in lib.readied] == ["attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    assert chosen == ["fwd", "bwd"] and len(lines) == 4
    # One head: the call's logsumexp strides are the warm-up's stand-in's, so even the backward's
    # choice (which also keys on their alignment) is found; with more heads it is made again,
    # cheaply, on the same shards and modules.
    q, k, v = qkv(H=1, S=128, D=64, dtype=torch.bfloat16)
    out, lse = op.attention(q, k, v, library=lib)
    op.attention_backward(torch.randn_like(out), q, k, v, out, lse, library=lib)
    assert chosen == ["fwd", "bwd"]


def test_background_warmup_returns_a_future_of_its_result_or_its_error(lib: ReadyingLibrary) -> None:
    pending = aotriton_rt.warmup(dtype="fp16", head_dim=32, seqlen=24, background=True, library=lib)
    assert pending.result(timeout=60)[0].startswith("attn_fwd[")
    missing = ReadyingLibrary()
    missing.missing = (*missing.missing, "attn_fwd")  # images without the forward
    failed = aotriton_rt.warmup(dtype="fp16", head_dim=32, seqlen=24, background=True, library=missing)
    with pytest.raises(KernelNotFound):
        failed.result(timeout=60)


@pytest.mark.parametrize(("facts", "message"), [
    ({"dtype": "fp8"}, r"dtype must be one of"),
    ({"seqlen": 0}, r"seqlen_q must be an integer in \[1, 2\*\*31 - 1\], got 0"),
    ({"align": "left"}, r"align must be 'top_left' or 'bottom_right'"),
    ({"device": -1}, r"device must be a device index >= 0, got -1"),
    ({"background": 1}, r"background must be True or False, got 1"),
    ({"backward": "yes"}, r"backward and deterministic must be True or False"),
])
def test_malformed_facts_are_refused_before_anything_is_read(lib: ReadyingLibrary, facts: dict,
                                                             message: str) -> None:
    lib.readied.clear()
    with pytest.raises(ArgumentError, match=message):
        aotriton_rt.warmup(**{"dtype": "fp16", "head_dim": 32, "seqlen": 24, "library": lib, **facts})
    assert lib.readied == []



def test_warmup_of_a_capped_or_alibi_call_readies_those_variants(lib: ReadyingLibrary, chosen: list[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The recording images' variants take every run-time argument (softcap, alibi_slopes).
    monkeypatch.setattr(dispatch, "_takes", lambda library, name, params, args: library.has(name, params))
    dispatch.kernels_of(lib).choices.clear()
    lib.readied.clear()
    capped = aotriton_rt.warmup(dtype="bf16", head_dim=64, seqlen=128, causal=True, softcap=True, backward=True,
                                library=lib)
    assert [name for name, _ in lib.readied] == ["attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    assert "SOFTCAP=1" in capped[0] and "SOFTCAP=1" in capped[2] and "SOFTCAP=1" in capped[3]
    # The capped call that follows finds the warm-up's choice.
    q, k, v = qkv(H=1, S=128, D=64, dtype=torch.bfloat16)
    op.attention(q, k, v, causal=True, softcap=30.0, library=lib)
    assert chosen == ["fwd", "bwd"]
    lines = aotriton_rt.warmup(dtype="bf16", head_dim=64, seqlen=128, alibi=True, library=lib)
    assert "ALIBI=1" in lines[0] and "SOFTCAP=0" in lines[0]
    with pytest.raises(ArgumentError, match=r"alibi must be True or False"):
        aotriton_rt.warmup(dtype="bf16", head_dim=64, seqlen=128, alibi="yes", library=lib)
    # With sinks: the forward joins them itself (it takes Sinks), so only their gradient's kernel
    # follows the backward; a forward without the arguments has the epilogue after it (the 16-byte
    # one at D=64).
    lib.readied.clear()
    aotriton_rt.warmup(dtype="bf16", head_dim=64, seqlen=128, sinks=True, backward=True, library=lib)
    readied = [name for name, _ in lib.readied]
    assert readied[0] == "attn_fwd" and readied[-1] == "attn_sinks_bwd" and "attn_sinks" not in readied
    lib.readied.clear()
    made = ReadyingLibrary.kernel

    def built_before(self: ReadyingLibrary, name: str, **params: Any) -> ReadyingKernel:
        kernel = made(self, name, **params)
        kernel.arg_names = [n for n in kernel.arg_names if n not in ("Sinks", "use_sinks")]
        return kernel

    with monkeypatch.context() as m:
        m.setattr(ReadyingLibrary, "kernel", built_before)
        dispatch.kernels_of(lib).choices.clear()
        lines = aotriton_rt.warmup(dtype="bf16", head_dim=64, seqlen=128, sinks=True, library=lib)
    dispatch.kernels_of(lib).choices.clear()
    assert [name for name, _ in lib.readied] == ["attn_fwd", "attn_sinks"]
    assert "ALIGNED=1" in lines[-1]
