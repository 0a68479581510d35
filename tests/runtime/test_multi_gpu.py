"""Several GPUs (marker ``gpu``): launches on any device whatever device is current, and ring attention.

The two-device tests skip, saying so, on a machine with one GPU. The ring test runs on one GPU:
its ranks are threads that share the device (``aotriton_rt.ops.ring.LocalRing``),
so the merge, the block rule and the travelling gradients run through the real kernels and are
checked against the fp32 reference within the operator's error bound.

Images: ``AOTRITON_RT_TEST_IMAGES`` pointing at ``python -m builder build --set gputest
--targets sm90`` (the attention tests skip without attention kernels).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402
from aotriton_rt import ArgumentError  # noqa: E402
from aotriton_rt.ops.ring import aotriton_blocks, ring_backward, ring_forward, run_local  # noqa: E402

pytestmark = pytest.mark.gpu


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, torch sees {torch.cuda.device_count()}")


@pytest.fixture(scope="module")
def lib(gpu_images: Any) -> aotriton_rt.Library:
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be IEEE fp32
    return aotriton_rt.Library(gpu_images)


def _attention_lib(lib: aotriton_rt.Library) -> aotriton_rt.Library:
    if "attn_fwd" not in lib.kernels:
        pytest.skip("the images have no attention kernels; build them with `python -m builder build --set gputest "
                    "--targets sm90` and set AOTRITON_RT_TEST_IMAGES")
    return lib


def reference(q, k, v, causal, dout, dtype):
    """Math attention computed in ``dtype`` (fp32: the reference; bf16: its low-precision twin):
    the output and the gradients of q, k, v for ``dout``, all as fp32."""
    qc, kc, vc = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    s = qc @ kc.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    out = torch.softmax(s, dim=-1) @ vc
    out.backward(dout.to(dtype))
    return [t.detach().float() for t in (out, qc.grad, kc.grad, vc.grad)]


# As tests/runtime/test_attention_gpu.py: (k, eps) per output, eps scaled by 8 for bf16.
BOUNDS = {"out": (3.0, 8 * 2e-4), "dq": (4.0, 8 * 5e-4), "dk": (4.0, 8 * 5e-4), "dv": (4.0, 8 * 5e-4)}


def _within(got: Any, hi: Any, lo: Any, k: float, eps: float) -> tuple[bool, float, float]:
    """AOTriton's rule: |ours - ref_fp32| <= k |ref_lowp - ref_fp32| + eps max(1, |ref|), max-abs."""
    err = (got.float() - hi).abs().max().item()
    bound = k * (lo.float() - hi).abs().max().item() + eps * max(1.0, hi.abs().max().item())
    return err <= bound, err, bound


# ---------------------------------------------------------------------------------------------
# Two devices.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("current, data", [(0, 1), (1, 0)], ids=["current0_data1", "current1_data0"])
def test_add_on_one_device_while_the_other_is_current_launches_there_and_keeps_the_current_device(
        lib: aotriton_rt.Library, current: int, data: int) -> None:
    _two_gpus()
    add = lib.kernel("add", dtype="fp32")
    torch.cuda.set_device(current)
    dev = torch.device("cuda", data)
    x, y = torch.rand(1 << 20, device=dev), torch.rand(1 << 20, device=dev)
    out = torch.full_like(x, float("nan"))
    add(x, y, out, x.numel())
    torch.cuda.synchronize(dev)
    assert torch.equal(out, x + y)
    assert torch.cuda.current_device() == current
    # and the current device still works for our launches
    x0 = torch.rand(4096, device="cuda")
    out0 = torch.zeros_like(x0)
    add(x0, x0, out0, x0.numel())
    assert torch.equal(out0, 2 * x0)


def test_attention_with_tensors_on_cuda1_while_device_0_is_current_matches_the_fp32_reference(
        lib: aotriton_rt.Library) -> None:
    _two_gpus()
    lib = _attention_lib(lib)
    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda:1").manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, 257, 64, device="cuda:1", generator=gen, dtype=torch.bfloat16)
                     for _ in range(4))
    hi = reference(q, k, v, True, dout, torch.float32)
    lo = reference(q, k, v, True, dout, torch.bfloat16)
    out, lse = aotriton_rt.attention(q, k, v, causal=True, library=lib)
    dq, dk, dv, _ = aotriton_rt.attention_backward(dout, q, k, v, out, lse, causal=True, library=lib)
    assert out.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    for i, (name, got) in enumerate((("out", out), ("dq", dq), ("dk", dk), ("dv", dv))):
        ok, err, bound = _within(got, hi[i], lo[i], *BOUNDS[name])
        assert ok, f"{name}: error {err:.3g} > bound {bound:.3g}"


def test_tensors_on_two_devices_in_one_call_are_refused(lib: aotriton_rt.Library) -> None:
    _two_gpus()
    add = lib.kernel("add", dtype="fp32")
    x0, x1 = torch.rand(16, device="cuda:0"), torch.rand(16, device="cuda:1")
    with pytest.raises(ArgumentError, match=r"argument y_ptr is on device 1 but the other arguments are on device 0"):
        add(x0, x1, torch.empty_like(x0), 16)
    if "attn_fwd" in lib.kernels:
        q = torch.randn(1, 2, 64, 64, device="cuda:0", dtype=torch.float16)
        with pytest.raises(ArgumentError, match=r"k is on device 1 but q is on device 0"):
            aotriton_rt.attention(q, q.to("cuda:1"), q, library=lib)


# ---------------------------------------------------------------------------------------------
# Ring attention on one GPU: ranks simulated by threads, blocks on the real kernels.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_simulated_ring_through_the_real_kernels_matches_the_fp32_reference(
        lib: aotriton_rt.Library, world: int, causal: bool) -> None:
    lib = _attention_lib(lib)
    attend, attend_backward = aotriton_blocks(lib)
    gen = torch.Generator(device="cuda").manual_seed(world)
    S = 256 * world
    q, k, v, dout = (torch.randn(2, 4, S, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    hi = reference(q, k, v, causal, dout, torch.float32)
    lo = reference(q, k, v, causal, dout, torch.bfloat16)

    # ring_forward/ring_backward directly: torch's autograd runs CUDA backward work on one engine
    # thread per device, which would serialise the simulated ranks (the autograd wiring is proven
    # on CPU, with threads and with a gloo process group, in tests/runtime/test_ring.py).
    def body(rank, ring):
        ql_, kl_, vl_, dl_ = (t.chunk(world, dim=2)[rank].contiguous() for t in (q, k, v, dout))
        out, lse = ring_forward(ql_, kl_, vl_, ring, causal=causal, attend=attend)
        dq, dk, dv = ring_backward(dl_, ql_, kl_, vl_, out, lse, ring, causal=causal, attend_backward=attend_backward)
        torch.cuda.synchronize()
        return out, dq, dk, dv

    results = run_local(world, body)
    got = [torch.cat([r[i] for r in results], dim=2) for i in range(4)]
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        ok, err, bound = _within(got[i], hi[i], lo[i], *BOUNDS[name])
        assert ok, f"{name} (world {world}): error {err:.3g} > bound {bound:.3g}"
