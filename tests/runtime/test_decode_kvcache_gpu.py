"""Decode attention as FlashAttention-2's ``flash_attn_with_kvcache`` on a GPU (marker ``gpu``):
every query length and head dim against an fp32 reference, parametrised like its
``test_flash_attn_kvcache``.

Query runs of 1, 3, 16, 64 and 128 rows; head dims 32, 59, 64, 80, 128 and 256 (59 runs masked
on the 64 bucket, 80 as is where the images hold it and else masked on 128); paged and
contiguous caches (NaN wherever a sequence owns no row), with and without appended rows (as
many as the query rows: the chunked-prefill step), causal and a two-sided local window; fp16 and
bf16; GQA 3:1. Bound as in tests/runtime/test_decode_gpu.py (AOTriton's rule).

Images: ``AOTRITON_RT_TEST_IMAGES`` pointing at ``python -m builder build --set gputest
--targets sm90`` (its masked variants: fp16/bf16 at 64 and 128, fp16 at 256). A combination
the images lack is skipped, naming the variant.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402
from aotriton_rt import KernelNotFound  # noqa: E402
from aotriton_rt.ops.decode import HEAD_DIM_BUCKETS, decode_attention, decode_kernels  # noqa: E402
from tests.runtime.test_decode_gpu import DTYPES, EPS, _cache, _close, _reference  # noqa: E402

pytestmark = pytest.mark.gpu
MASKS = {"causal": (True, None), "local": (False, (13, 5))}


@pytest.fixture(scope="module")
def lib(decode_lib: aotriton_rt.Library) -> aotriton_rt.Library:
    return decode_lib


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("append", [False, True], ids=["cached", "append"])
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged"])
@pytest.mark.parametrize("D", [32, 59, 64, 80, 128, 256])
@pytest.mark.parametrize("Sq", [1, 3, 16, 64, 128])
def test_kvcache_attention_matches_an_fp32_reference(lib: aotriton_rt.Library, Sq: int, D: int, page: Any,
                                                     append: bool, mask: str, dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    causal, window = MASKS[mask]
    lens = [300, 0, 77]
    new = Sq if append else 0
    gen = torch.Generator(device="cuda").manual_seed(Sq * 1000 + D * 10 + int(append))
    c = _cache(lens, new, 2, D, dtype, page, gen)
    q = torch.randn(len(lens), Sq, 6, D, device="cuda", generator=gen).to(dtype)
    options = {"cache_seqlens": c["lens"], "block_table": c["table"], "k_new": c["k_new"], "v_new": c["v_new"],
               "causal": causal, "window": window}
    try:
        kernels = decode_kernels(q, c["k"], c["v"], library=lib, **options)
        out, lse = decode_attention(q, c["k"], c["v"], check=True, library=lib, **options)
    except KernelNotFound as e:
        pytest.skip(f"the images lack the decode variants of {dtype_name} at head dim {D}: {str(e)[:300]}")
    spec = kernels["attn_decode"].params
    # A head dim off the bucket runs masked; at a bucket the exact variant runs where the images
    # hold it (gputest holds fp16 at 256 masked only).
    assert spec["HEAD_DIM"] >= D and (spec["PADDED_D"] == 1 or spec["HEAD_DIM"] == D)
    if spec["HEAD_DIM"] != D or D not in HEAD_DIM_BUCKETS:
        assert spec["PADDED_D"] == 1
    ref_hi, lse_hi = _reference(q, c["keys"], c["vals"], causal, window, torch.float32)
    ref_lo, lse_lo = _reference(q, c["keys"], c["vals"], causal, window, dtype)
    _close("out", out, ref_hi, ref_lo, EPS[dtype_name])
    _close("lse", lse, lse_hi, lse_lo, EPS[dtype_name])
    for b, n in enumerate(lens):
        for r in range(n, n + new):
            if page:
                row = c["k"][c["table"][b, r // page], r % page]
            else:
                row = c["k"][b, r]
            assert torch.equal(row, c["keys"][b][r]), f"appended row {r} of sequence {b}"


@pytest.mark.parametrize("D", [59, 64])
def test_nan_columns_past_the_head_dim_neither_leak_nor_get_written(lib: aotriton_rt.Library, D: int) -> None:
    """Caches, q and out as views of the first D columns of NaN buffers 7 columns wider: rows
    that are not 16-byte aligned, read and written masked in place."""
    gen = torch.Generator(device="cuda").manual_seed(D)
    lens, Sq = [200, 33], 16

    def view(*shape: int) -> Any:
        return torch.full((*shape, D + 7), float("nan"), device="cuda", dtype=torch.bfloat16)[..., :D]

    keys = [torch.randn(n + Sq, 2, D, device="cuda", generator=gen).to(torch.bfloat16) for n in lens]
    vals = [torch.randn(n + Sq, 2, D, device="cuda", generator=gen).to(torch.bfloat16) for n in lens]
    k, v = view(2, 256, 2), view(2, 256, 2)
    for b, n in enumerate(lens):
        k[b, :n], v[b, :n] = keys[b][:n], vals[b][:n]
    q, out = view(2, Sq, 6), view(2, Sq, 6)
    q.copy_(torch.randn(2, Sq, 6, D, device="cuda", generator=gen))
    k_new, v_new = view(2, Sq, 2), view(2, Sq, 2)
    k_new.copy_(torch.stack([keys[b][n:] for b, n in enumerate(lens)]))
    v_new.copy_(torch.stack([vals[b][n:] for b, n in enumerate(lens)]))
    try:
        decode_attention(q, k, v, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"), k_new=k_new,
                         v_new=v_new, causal=True, out=out, check=True, library=lib)
    except KernelNotFound as e:
        pytest.skip(f"the images lack the masked bf16 decode variants at 64: {str(e)[:300]}")
    ref_hi, _ = _reference(q, keys, vals, True, None, torch.float32)
    ref_lo, _ = _reference(q, keys, vals, True, None, torch.bfloat16)
    _close("out", out, ref_hi, ref_lo, EPS["bf16"])
    for name, t in (("k_cache", k), ("v_cache", v), ("out", out)):
        assert t._base[..., D:].isnan().all(), f"{name}: a column past the head dim was written"
