"""Every kernel of the default build, launched on a real GPU from torch, CuPy and JAX.

All of these need a CUDA GPU (marker `gpu`); they are run on the H200 in every session that
touches GPU code.
"""

from __future__ import annotations

import threading

import pytest

import aotriton_rt
from aotriton_rt import ArgumentError, KernelNotFound

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
TOL = {"fp16": 2e-3, "bf16": 2e-2, "fp32": 1e-5}


@pytest.fixture(scope="module")
def lib(gpu_images):
    return aotriton_rt.Library(gpu_images)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_add_matches_torch_for_every_dtype(lib, dtype):
    n = 1_000_003
    x = torch.randn(n, device="cuda", dtype=DTYPES[dtype])
    y = torch.randn(n, device="cuda", dtype=DTYPES[dtype])
    out = torch.full_like(x, float("nan"))
    lib.kernel("add", dtype=dtype)(x, y, out, n)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x + y, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("block,n_cols", [(256, 200), (1024, 1000), (1024, 1)])
def test_softmax_matches_fp32_reference_on_strided_rows(lib, dtype, block, n_cols):
    rows = 517
    base = torch.randn(rows, n_cols + 7, device="cuda", dtype=DTYPES[dtype]) * 4
    x = base[:, :n_cols]  # row stride n_cols + 7: not contiguous
    out = torch.full((rows, n_cols), float("nan"), device="cuda", dtype=DTYPES[dtype])
    lib.kernel("softmax", dtype=dtype, BLOCK=block)(out, x, rows, n_cols, x.stride(0), out.stride(0))
    torch.cuda.synchronize()
    ref = torch.softmax(x.float(), dim=-1)
    assert (out.float() - ref).abs().max().item() <= TOL[dtype] * 4


def test_softmax_refuses_rows_longer_than_its_block(lib):
    x = torch.randn(4, 300, device="cuda", dtype=torch.float16)
    out = torch.empty_like(x)
    with pytest.raises(ArgumentError, match=r"n_cols=300 violates `n_cols <= BLOCK`"):
        lib.kernel("softmax", dtype="fp16", BLOCK=256)(out, x, 4, 300, 300, 300)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_norms_match_fp32_reference(lib, kind, dtype):
    rows, cols = 333, 1000
    x = torch.randn(rows, cols, device="cuda", dtype=DTYPES[dtype])
    w = torch.randn(cols, device="cuda", dtype=DTYPES[dtype])
    b = torch.randn(cols, device="cuda", dtype=DTYPES[dtype])
    y = torch.full_like(x, float("nan"))
    mean = torch.empty(rows, device="cuda")
    rstd = torch.empty(rows, device="cuda")
    lib.kernel(kind, dtype=dtype, BLOCK=1024)(x, y, w, b, mean, rstd, rows, cols, x.stride(0), y.stride(0), 1e-5)
    torch.cuda.synchronize()
    xf = x.float()
    if kind == "layernorm":
        ref = torch.nn.functional.layer_norm(xf, (cols,), w.float(), b.float(), 1e-5)
    else:
        ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    assert (y.float() - ref).abs().max().item() <= (1e-4 if dtype == "fp32" else 2e-2)


def test_cpu_tensor_is_refused_before_launch(lib):
    x = torch.randn(16)
    with pytest.raises(ArgumentError, match="CPU"):
        lib.kernel("add", dtype="fp32")(x, x, x, 16)


def test_misaligned_pointer_is_refused(lib):
    x = torch.randn(1025, device="cuda")
    view = x[1:]  # 4-byte offset: breaks the 16-byte alignment the binary assumes
    with pytest.raises(ArgumentError, match="not 16-byte aligned"):
        lib.kernel("add", dtype="fp32")(view, view, view, 1024)


def test_scalar_out_of_range_is_refused(lib):
    x = torch.randn(16, device="cuda", dtype=torch.float16)
    with pytest.raises(ArgumentError, match=r"n_rows \(i32\) = 4294967296 is out of range"):
        lib.kernel("softmax", dtype="fp16", BLOCK=256)(x, x, 2**32, 16, 16, 16)


def test_unknown_variant_explains_what_exists(lib):
    with pytest.raises(KernelNotFound, match="dtype='fp8'"):
        lib.kernel("add", dtype="fp8")


def test_eight_threads_thousand_launches_each_are_correct(lib):
    add = lib.kernel("add", dtype="fp32")
    n = 4099
    errors = []

    def work(seed: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                g = torch.Generator(device="cuda").manual_seed(seed)
                x = torch.randn(n, device="cuda", generator=g)
                acc = torch.zeros(n, device="cuda")
                for _ in range(1000):
                    add(acc, x, acc, n)  # acc += x, on this thread's current stream
            stream.synchronize()
            torch.testing.assert_close(acc, x * 1000, rtol=1e-4, atol=1e-3)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_cuda_graph_capture_and_replay(lib):
    add = lib.kernel("add", dtype="fp32")
    n = 10_000
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    out = torch.empty_like(x)
    add(x, y, out, n)  # warm up: module load happens outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add(x, y, out, n)
        add(out, y, out, n)
    for _ in range(3):
        x.copy_(torch.randn(n, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, x + 2 * y)


def test_cupy_arrays_launch_on_the_cupy_stream(lib):
    cp = pytest.importorskip("cupy")
    n = 100_003
    x = cp.random.standard_normal(n, dtype=cp.float32)
    y = cp.random.standard_normal(n, dtype=cp.float32)
    out = cp.full(n, cp.nan, dtype=cp.float32)
    with cp.cuda.Stream(non_blocking=True) as s:
        lib.kernel("add", dtype="fp32")(x, y, out, n)
        s.synchronize()
    assert bool(cp.allclose(out, x + y))


def test_jax_arrays_through_dlpack(lib):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    n = 100_003
    x = jax.random.normal(jax.random.PRNGKey(1), (n,), dtype=jnp.float32)
    y = jax.random.normal(jax.random.PRNGKey(2), (n,), dtype=jnp.float32)
    out = torch.full((n,), float("nan"), device="cuda")
    lib.kernel("add", dtype="fp32")(x, y, out, n)
    torch.cuda.synchronize()
    expect = torch.from_dlpack(x + y)
    torch.testing.assert_close(out, expect)


def _as(framework: str, t):
    """The same device memory seen from another framework (zero copy)."""
    if framework == "torch":
        return t
    if framework == "cupy":
        cp = pytest.importorskip("cupy")
        return cp.asarray(t)  # through __cuda_array_interface__
    jax = pytest.importorskip("jax")
    return jax.dlpack.from_dlpack(t)  # JAX arrays are read-only: only inputs come from JAX


@pytest.mark.parametrize("framework", ["torch", "cupy", "jax"])
def test_every_default_kernel_runs_from_each_framework(lib, framework):
    rows, cols = 129, 1000
    x = torch.randn(rows, cols, device="cuda")
    y = torch.randn(rows, cols, device="cuda")
    w = torch.randn(cols, device="cuda")
    b = torch.randn(cols, device="cuda")
    torch.cuda.synchronize()
    X, Y, W, B = (_as(framework, t) for t in (x, y, w, b))
    outs = {name: torch.full((rows, cols), float("nan"), device="cuda")
            for name in ("add", "softmax", "ln", "rms")}
    dst = {k: _as("cupy" if framework == "cupy" else "torch", v) for k, v in outs.items()}
    mean = torch.empty(rows, device="cuda")
    rstd = torch.empty(rows, device="cuda")
    lib.kernel("add", dtype="fp32")(X, Y, dst["add"], rows * cols)
    lib.kernel("softmax", dtype="fp32", BLOCK=1024)(dst["softmax"], X, rows, cols, cols, cols)
    lib.kernel("layernorm", dtype="fp32", BLOCK=1024)(X, dst["ln"], W, B, mean, rstd, rows, cols, cols, cols, 1e-5)
    lib.kernel("rmsnorm", dtype="fp32", BLOCK=1024)(X, dst["rms"], W, B, mean, rstd, rows, cols, cols, cols, 1e-5)
    torch.cuda.synchronize()
    if framework == "cupy":
        import cupy as cp
        cp.cuda.get_current_stream().synchronize()
    torch.testing.assert_close(outs["add"], x + y)
    torch.testing.assert_close(outs["softmax"], torch.softmax(x, -1), atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(outs["ln"], torch.nn.functional.layer_norm(x, (cols,), w, b, 1e-5),
                               atol=1e-4, rtol=1e-4)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(outs["rms"], ref, atol=1e-4, rtol=1e-4)
