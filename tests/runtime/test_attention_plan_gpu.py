"""Attention plans on a GPU (marker ``gpu``): a cached plan replayed in a CUDA graph, repeated calls
with new arrays, dropout seeds per call, autograd twice, all against an fp32 reference.

Images: ``AOTRITON_RT_TEST_IMAGES`` pointing at ``python -m builder build --set gputest --targets
sm90``.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402
from aotriton_rt.ops import torch as op_torch  # noqa: E402
from aotriton_rt.ops.attention import dispatch  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lib(gpu_images: Any) -> aotriton_rt.Library:
    library = aotriton_rt.Library(gpu_images)
    if "attn_fwd" not in library.kernels:
        pytest.skip("these images hold no attention kernels: build `python -m builder build --set gputest "
                    "--targets sm90` and set AOTRITON_RT_TEST_IMAGES")
    return library


def builds(lib: aotriton_rt.Library) -> int:
    return dispatch.kernels_of(lib).plans.builds


def reference(q: Any, k: Any, v: Any, causal: bool = False) -> Any:
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)


def close(got: Any, want: Any, tol: float = 2e-2) -> bool:
    return bool(((got.float() - want).abs().max() <= tol * max(1.0, float(want.abs().max()))).item())


def qkv(*shape: int, dtype: Any = torch.float16) -> list[Any]:
    return [torch.randn(*shape, device="cuda", dtype=dtype) for _ in range(3)]


def test_a_cuda_graph_captured_from_a_cached_plan_replays_on_new_data(lib: aotriton_rt.Library) -> None:
    q, k, v = qkv(2, 4, 130, 64)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        aotriton_rt.attention(q, k, v, causal=True, library=lib)  # builds the plan, loads the module
    torch.cuda.current_stream().wait_stream(stream)
    before = builds(lib)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = aotriton_rt.attention(q, k, v, causal=True, library=lib)
    assert builds(lib) == before, "capture must run the cached plan"
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert close(out, reference(q, k, v, causal=True))
        assert torch.isfinite(lse).all()


def test_repeated_calls_with_new_arrays_use_one_plan_and_stay_exact(lib: aotriton_rt.Library) -> None:
    start = builds(lib)
    for _ in range(4):
        q, k, v = qkv(1, 2, 77, 64)
        out, _ = aotriton_rt.attention(q, k, v, library=lib)
        assert close(out, reference(q, k, v))
    assert builds(lib) == start + 1
    # A view 2 bytes off alignment, same shape and strides: another plan, copied, still exact.
    base = torch.randn(q.numel() + 1, device="cuda", dtype=torch.float16)
    shifted = base[1:].view(q.shape)
    out, _ = aotriton_rt.attention(shifted, k, v, library=lib)
    assert close(out, reference(shifted, k, v)) and builds(lib) == start + 2


def test_dropout_seeds_change_the_mask_per_call_under_one_plan(lib: aotriton_rt.Library) -> None:
    q, k, v = qkv(1, 2, 64, 64)
    start = builds(lib)
    a = aotriton_rt.attention(q, k, v, dropout_p=0.3, seed=1, offset=0, return_mask=True, library=lib)[2]
    b = aotriton_rt.attention(q, k, v, dropout_p=0.3, seed=2, offset=0, return_mask=True, library=lib)[2]
    c = aotriton_rt.attention(q, k, v, dropout_p=0.3, seed=1, offset=0, return_mask=True, library=lib)[2]
    assert builds(lib) == start + 1
    assert torch.equal(a, c) and not torch.equal(a, b)


def test_autograd_twice_through_cached_plans_matches_the_reference(lib: aotriton_rt.Library) -> None:
    for _ in range(2):
        q, k, v = (t.requires_grad_() for t in qkv(2, 4, 96, 64))
        grad = torch.randn_like(q)
        op_torch.attention(q, k, v, causal=True, library=lib).backward(grad)
        ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
        reference(*ref, causal=True).backward(grad.float())
        for got, want in zip((q.grad, k.grad, v.grad), (r.grad for r in ref)):
            assert close(got, want, 3e-2)


def test_cupy_arrays_reuse_one_plan_and_match_the_torch_path(lib: aotriton_rt.Library) -> None:
    cupy = pytest.importorskip("cupy")
    start = builds(lib)
    for _ in range(3):
        q, k, v = qkv(1, 2, 70, 64)
        want, _ = aotriton_rt.attention(q, k, v, library=lib)
        out, lse = aotriton_rt.attention(*(cupy.from_dlpack(t) for t in (q, k, v)), library=lib)
        assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
        assert torch.equal(torch.from_dlpack(out), want)
    assert builds(lib) == start + 2  # one plan for torch inputs, one for CuPy inputs
