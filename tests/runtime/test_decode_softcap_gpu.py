"""Decode attention with a logit softcap on a GPU against an fp32 reference (marker ``gpu``).

Gemma 2's decode steps: scores ``s = q·k * scale`` become ``softcap * tanh(s / softcap)`` before
the mask (FlashAttention-2). Contiguous and paged caches (NaN wherever a sequence owns no row,
random block tables), 1, 4 and 160 query rows with their rows appended, GQA 4, odd lengths
(0, 1, 37, 513, 1000), causal and windowed, forced splits; the 160-row runs both through the
variable-length forward (its ``SOFTCAP=1`` variant, where the images hold it) and on the decode
kernels (``out=`` keeps them there). Queries are scaled so that the cap bends every answer (each
case checks it does). Also: ``aotriton_rt.attention`` routes a capped decode step to the decode
kernels, and the torch op's capped step replays in a CUDA graph. The reference and the bound are
tests/runtime/test_decode_gpu.py's (``3 |ref_lo - ref_hi| + eps``).

Images: ``AOTRITON_RT_TEST_IMAGES`` (``python -m builder build --set gputest --targets sm90``; the
default set serves every case too).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402
from aotriton_rt.ops import decode as dec  # noqa: E402
from tests.runtime.test_decode_gpu import EPS, _cache, _close, _reference  # noqa: E402

pytestmark = pytest.mark.gpu
CAP = 8.0
AMP = 8.0  # q's scale: scores of about +-8, which a cap of 8 bends
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LENS = [1000, 37, 513, 0, 1]


@pytest.fixture(scope="module")
def lib(decode_lib: aotriton_rt.Library) -> aotriton_rt.Library:
    return decode_lib


def _bent(q: Any, c: dict, causal: bool, window: Any) -> None:
    """The cap changes the answer by far more than the bound: the case proves something."""
    capped, _ = _reference(q, c["keys"], c["vals"], causal, window, torch.float32, CAP)
    plain, _ = _reference(q, c["keys"], c["vals"], causal, window, torch.float32)
    assert (capped - plain).abs().max().item() > 0.1, "the cap does not bend these scores"


def _check(out: Any, lse: Any, q: Any, c: dict, causal: bool, window: Any, dtype_name: str) -> None:
    ref_hi, lse_hi = _reference(q, c["keys"], c["vals"], causal, window, torch.float32, CAP)
    ref_lo, lse_lo = _reference(q, c["keys"], c["vals"], causal, window, DTYPES[dtype_name], CAP)
    _close("out", out, ref_hi, ref_lo, EPS[dtype_name])
    _close("lse", lse, lse_hi, lse_lo, EPS[dtype_name])


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("mask", ["causal", "window"])
@pytest.mark.parametrize("page", [None, 16, 64], ids=["contiguous", "paged16", "paged64"])
@pytest.mark.parametrize("Sq", [1, 4])
def test_a_capped_decode_step_matches_the_fp32_reference(lib: aotriton_rt.Library, Sq: int, page: Any, mask: str,
                                                        dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(7 * Sq + (page or 0))
    c = _cache(LENS, Sq, 8, 128, dtype, page, gen)
    q = (torch.randn(len(LENS), Sq, 32, 128, device="cuda", generator=gen) * AMP).to(dtype)
    causal, window = (True, None) if mask == "causal" else (False, (255, 2))
    _bent(q, c, causal, window)
    for splits in (None, 3):
        kv = (c["k"].clone(), c["v"].clone())  # each call appends its rows to a fresh copy
        out, lse = dec.decode_attention(q, *kv, cache_seqlens=c["lens"], block_table=c["table"], k_new=c["k_new"],
                                        v_new=c["v_new"], causal=causal, window=window, softcap=CAP,
                                        num_splits=splits, check=True, library=lib)
        _check(out, lse, q, c, causal, window, dtype_name)


@pytest.mark.parametrize("route", ["auto", "decode_kernels"])
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
def test_a_capped_run_of_160_rows_matches_the_reference_on_either_route(lib: aotriton_rt.Library, page: Any,
                                                                        route: str) -> None:
    """A chunk of a prompt against the cache: through the variable-length forward where the
    images hold its capped variant (``auto``), or on the decode kernels' tiles (``out=``)."""
    Sq, dtype_name = 160, "bf16"
    gen = torch.Generator(device="cuda").manual_seed(160 + (page or 0))
    c = _cache(LENS, Sq, 8, 128, torch.bfloat16, page, gen)
    q = (torch.randn(len(LENS), Sq, 32, 128, device="cuda", generator=gen) * AMP).to(torch.bfloat16)
    _bent(q, c, True, None)
    ks = dec._kernels_of(lib)
    ks.launches.clear()
    out = torch.empty_like(q) if route == "decode_kernels" else None
    got, lse = dec.decode_attention(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"],
                                    k_new=c["k_new"], v_new=c["v_new"], causal=True, softcap=CAP, out=out,
                                    check=False, library=lib)  # unchecked: the call keeps its plan
    (plan,) = [p for p in ks.launches.values() if p.p.seqlen_q == Sq]
    capped_forward = ks.has("attn_fwd", {"dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 1,
                                         "BIAS": 0, "DROPOUT": 0, "VARLEN": 1, "SOFTCAP": 1}, ("softcap",))
    assert plan.varlen == (route == "auto" and capped_forward and ks.has("attn_decode_pack", {
        "dtype": "bf16", "HEAD_DIM": 128, "PAGED": int(page is not None), "PADDED_D": 0})), plan.varlen
    print(f"160 rows, {route}: {'the variable-length forward' if plan.varlen else 'the decode kernels'}")
    _check(got, lse, q, c, True, None, dtype_name)


def test_attention_routes_a_capped_decode_step_to_the_decode_kernels(lib: aotriton_rt.Library) -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = (torch.randn(4, 32, 3, 128, device="cuda", generator=gen) * AMP).to(torch.bfloat16)
    k = torch.randn(4, 8, 3001, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    calls = []
    original = dec.decode_attention

    def spy(*a: Any, **kw: Any) -> Any:
        calls.append(kw.get("softcap"))
        return original(*a, **kw)

    dec.decode_attention = spy
    try:
        out, lse = aotriton_rt.attention(q, k, v, causal=True, align="bottom_right", softcap=CAP, library=lib)
        again, _ = aotriton_rt.attention(q, k, v, causal=True, align="bottom_right", softcap=CAP, library=lib)
    finally:
        dec.decode_attention = original
    assert calls == [CAP]  # the first call; the second runs the kept decode plan
    keys = [k[b].transpose(0, 1) for b in range(4)]
    vals = [v[b].transpose(0, 1) for b in range(4)]
    qb = q.transpose(1, 2)
    c = {"keys": keys, "vals": vals}
    _bent(qb, c, True, None)
    _check(out.transpose(1, 2), lse, qb, c, True, None, "bf16")
    assert torch.equal(out, again)


def test_a_capped_step_of_the_torch_op_replays_in_a_cuda_graph(lib: aotriton_rt.Library) -> None:
    from aotriton_rt.ops.torch_decode import decode_attention as op

    gen = torch.Generator(device="cuda").manual_seed(6)
    c = _cache([500, 900, 17, 0, 64, 65, 1000, 3], 1, 4, 128, torch.bfloat16, 16, gen)
    q = (torch.randn(8, 1, 16, 128, device="cuda", generator=gen) * AMP).to(torch.bfloat16)
    lens = c["lens"].clone()
    kn, vn = c["k_new"].clone(), c["v_new"].clone()
    op(q, c["k"], c["v"], cache_seqlens=lens, block_table=c["table"], k_new=kn, v_new=vn, causal=True, softcap=CAP,
       library=lib)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = op(q, c["k"], c["v"], cache_seqlens=lens, block_table=c["table"], k_new=kn, v_new=vn, causal=True,
                      softcap=CAP, return_lse=True, library=lib)
    q.copy_((torch.randn(q.shape, device="cuda", generator=gen) * AMP).to(q.dtype))
    graph.replay()
    torch.cuda.synchronize()
    _bent(q, c, True, None)
    _check(out, lse, q, c, True, None, "bf16")
