"""Decode attention with ALiBi slopes and attention sinks on a GPU against fp32 (marker ``gpu``).

FlashAttention-2's ALiBi in decode: query row ``i`` (the sequence's last ``Sq`` rows) sits at key
position ``i + len_k - Sq`` and every score gets ``-slope * |i + len_k - Sq - j|``, the slope of
the row's own query head (``(Hq,)`` or per sequence ``(B, Hq)``). Sinks (gpt-oss): a logit per
query head joins each row's softmax with no value, joined by the decode kernel's epilogue (one
split) or by the combine (several). Contiguous and paged caches (NaN wherever a sequence owns no
row, random block tables), 1 and 4 query rows with their rows appended, GQA 4, odd lengths (0,
1, 37, 513, 1000), causal and windowed, forced splits; a sink of -inf leaves its head bit for
bit as without sinks; 160-row runs through the variable-length forward (its ``ALIBI=1`` variant
where the images hold it) and on the decode kernels; an fp8 cache; ``aotriton_rt.attention``'s
route (no ``attn_sinks`` pass); the torch op in a CUDA graph. Reference and bound as in
tests/runtime/test_decode_gpu.py (``3 |ref_lo - ref_hi| + eps``).

Images: ``AOTRITON_RT_TEST_IMAGES`` (``python -m builder build --set gputest --targets sm90``).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402
from aotriton_rt.ops import decode as dec  # noqa: E402
from tests.runtime.test_decode_gpu import EPS, _cache, _close, _reference  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LENS = [1000, 37, 513, 0, 1]


@pytest.fixture(scope="module")
def lib(decode_lib: aotriton_rt.Library) -> aotriton_rt.Library:
    return decode_lib


def _check(out: Any, lse: Any, q: Any, c: dict, causal: bool, window: Any, dtype_name: str, slopes: Any,
           sinks: Any) -> None:
    ref_hi, lse_hi = _reference(q, c["keys"], c["vals"], causal, window, torch.float32, slopes=slopes, sinks=sinks)
    ref_lo, lse_lo = _reference(q, c["keys"], c["vals"], causal, window, DTYPES[dtype_name], slopes=slopes,
                                sinks=sinks)
    _close("out", out, ref_hi, ref_lo, EPS[dtype_name])
    _close("lse", lse, lse_hi, lse_lo, EPS[dtype_name])


def _slopes(kind: str, B: int, Hq: int, gen: Any) -> Any:
    """ALiBi's geometric slopes (2**(-8 h / Hq)) scaled up so that they bend a decode step."""
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / Hq) for h in range(Hq)], device="cuda") * 4
    if kind == "head":
        return base
    return (base[None, :] * (torch.rand(B, 1, device="cuda", generator=gen) + 0.5)).contiguous()


def _bent(q: Any, c: dict, causal: bool, window: Any, slopes: Any) -> None:
    with_slopes, _ = _reference(q, c["keys"], c["vals"], causal, window, torch.float32, slopes=slopes)
    plain, _ = _reference(q, c["keys"], c["vals"], causal, window, torch.float32)
    assert (with_slopes - plain).abs().max().item() > 0.1, "the slopes do not bend these scores"


@pytest.mark.parametrize("sinks_on", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("kind", ["head", "batch"])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("mask", ["causal", "window"])
@pytest.mark.parametrize("page", [None, 16, 64], ids=["contiguous", "paged16", "paged64"])
@pytest.mark.parametrize("Sq", [1, 4])
def test_an_alibi_decode_step_matches_the_fp32_reference(lib: aotriton_rt.Library, Sq: int, page: Any, mask: str,
                                                        dtype_name: str, kind: str, sinks_on: bool) -> None:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(7 * Sq + (page or 0))
    c = _cache(LENS, Sq, 8, 128, dtype, page, gen)
    q = torch.randn(len(LENS), Sq, 32, 128, device="cuda", generator=gen).to(dtype)
    slopes = _slopes(kind, len(LENS), 32, gen)
    sinks = torch.randn(32, device="cuda", generator=gen) * 2 if sinks_on else None
    causal, window = (True, None) if mask == "causal" else (False, (255, 2))
    _bent(q, c, causal, window, slopes)
    for splits in (None, 1, 3):
        kv = (c["k"].clone(), c["v"].clone())  # each call appends its rows to a fresh copy
        out, lse = dec.decode_attention(q, *kv, cache_seqlens=c["lens"], block_table=c["table"], k_new=c["k_new"],
                                        v_new=c["v_new"], causal=causal, window=window, alibi_slopes=slopes,
                                        sinks=sinks, num_splits=splits, check=True, library=lib)
        _check(out, lse, q, c, causal, window, dtype_name, slopes, sinks)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
def test_a_sink_of_minus_inf_leaves_its_head_bit_for_bit_as_without_sinks(lib: aotriton_rt.Library, page: Any,
                                                                         splits: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(11 + splits)
    c = _cache(LENS, 0, 8, 128, torch.bfloat16, page, gen)
    q = torch.randn(len(LENS), 2, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    sinks = torch.randn(32, device="cuda", generator=gen)
    sinks[5] = float("-inf")
    kw = {"cache_seqlens": c["lens"], "block_table": c["table"], "causal": True, "num_splits": splits,
          "library": lib}
    with_sinks, lse = dec.decode_attention(q, c["k"], c["v"], sinks=sinks, **kw)
    plain, plain_lse = dec.decode_attention(q, c["k"], c["v"], **kw)
    assert torch.equal(with_sinks[:, :, 5], plain[:, :, 5]) and torch.equal(lse[:, 5], plain_lse[:, 5])
    assert not torch.equal(with_sinks, plain)


@pytest.mark.parametrize("route", ["auto", "decode_kernels"])
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
def test_an_alibi_run_of_160_rows_with_sinks_matches_the_reference_on_either_route(lib: aotriton_rt.Library,
                                                                                  page: Any, route: str) -> None:
    """A chunk of a prompt against the cache: through the variable-length forward where the
    images hold its ALiBi variant (``auto``), or on the decode kernels' tiles (``out=``)."""
    Sq = 160
    gen = torch.Generator(device="cuda").manual_seed(160 + (page or 0))
    c = _cache(LENS, Sq, 8, 128, torch.bfloat16, page, gen)
    q = torch.randn(len(LENS), Sq, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    slopes, sinks = _slopes("batch", len(LENS), 32, gen), torch.randn(32, device="cuda", generator=gen)
    ks = dec._kernels_of(lib)
    ks.launches.clear()
    out = torch.empty_like(q) if route == "decode_kernels" else None
    got, lse = dec.decode_attention(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"],
                                    k_new=c["k_new"], v_new=c["v_new"], causal=True, alibi_slopes=slopes, sinks=sinks,
                                    out=out, check=False, library=lib)
    (plan,) = [p for p in ks.launches.values() if p.p.seqlen_q == Sq]
    print(f"160 rows, {route}: {'the variable-length forward' if plan.varlen else 'the decode kernels'}")
    if route == "decode_kernels":
        assert not plan.varlen
    _check(got, lse, q, c, True, None, "bf16", slopes, sinks)


def test_an_fp8_cache_with_alibi_and_sinks_matches_the_dequantised_reference(lib: aotriton_rt.Library) -> None:
    cap = torch.cuda.get_device_capability()
    fp8 = torch.float8_e4m3fn if cap >= (9, 0) else None
    if fp8 is None or not dec._kernels_of(lib).has("attn_decode", {"KV_DTYPE": "fp8e4nv"}):
        pytest.skip("no fp8e4nv decode variants for this GPU in the images")
    gen = torch.Generator(device="cuda").manual_seed(8)
    c = _cache(LENS, 0, 8, 128, torch.bfloat16, 16, gen)
    scale = 0.05
    k8, v8 = (c["k"] / scale).to(fp8), (c["v"] / scale).to(fp8)
    deq = {"keys": [(x / scale).to(fp8).float() * scale for x in c["keys"]],
           "vals": [(x / scale).to(fp8).float() * scale for x in c["vals"]]}
    q = torch.randn(len(LENS), 2, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    slopes, sinks = _slopes("head", len(LENS), 32, gen), torch.randn(32, device="cuda", generator=gen)
    for splits in (1, 3):
        out, lse = dec.decode_attention(q, k8, v8, cache_seqlens=c["lens"], block_table=c["table"], causal=True,
                                        alibi_slopes=slopes, sinks=sinks, k_scale=scale, v_scale=scale,
                                        num_splits=splits, check=True, library=lib)
        _check(out, lse, q, deq, True, None, "bf16", slopes, sinks)


def test_attention_routes_alibi_and_sinks_to_the_decode_kernels_without_a_pass(lib: aotriton_rt.Library) -> None:
    from aotriton_rt.ops.attention import sinks as sinks_module

    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(4, 32, 3, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(4, 8, 3001, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slopes, sinks = _slopes("batch", 4, 32, gen), torch.randn(32, device="cuda", generator=gen)
    calls, passes = [], []
    original, original_pass = dec.decode_attention, sinks_module.apply_sinks

    def spy(*a: Any, **kw: Any) -> Any:
        calls.append(kw.get("alibi_slopes") is slopes)
        return original(*a, **kw)

    dec.decode_attention = spy
    sinks_module.apply_sinks = lambda *a, **kw: passes.append(1) or original_pass(*a, **kw)
    try:
        out, lse = aotriton_rt.attention(q, k, v, causal=True, align="bottom_right", alibi_slopes=slopes, sinks=sinks,
                                         library=lib)
        again, _ = aotriton_rt.attention(q, k, v, causal=True, align="bottom_right", alibi_slopes=slopes,
                                         sinks=sinks, library=lib)
    finally:
        dec.decode_attention, sinks_module.apply_sinks = original, original_pass
    assert calls == [True] and not passes  # the first call; the second runs the kept decode plan
    qb = q.transpose(1, 2)
    c = {"keys": [k[b].transpose(0, 1) for b in range(4)], "vals": [v[b].transpose(0, 1) for b in range(4)]}
    _bent(qb, c, True, None, slopes)
    _check(out.transpose(1, 2), lse, qb, c, True, None, "bf16", slopes, sinks)
    assert torch.equal(out, again)


def test_an_alibi_step_with_sinks_of_the_torch_op_replays_in_a_cuda_graph(lib: aotriton_rt.Library) -> None:
    from aotriton_rt.ops.torch_decode import decode_attention as op

    gen = torch.Generator(device="cuda").manual_seed(6)
    c = _cache([500, 900, 17, 0, 64, 65, 1000, 3], 1, 4, 128, torch.bfloat16, 16, gen)
    q = torch.randn(8, 1, 16, 128, device="cuda", generator=gen).to(torch.bfloat16)
    slopes, sinks = _slopes("batch", 8, 16, gen), torch.randn(16, device="cuda", generator=gen).half()
    lens = c["lens"].clone()
    kn, vn = c["k_new"].clone(), c["v_new"].clone()
    kw = {"cache_seqlens": lens, "block_table": c["table"], "k_new": kn, "v_new": vn, "causal": True,
          "alibi_slopes": slopes, "sinks": sinks, "library": lib}
    op(q, c["k"], c["v"], **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = op(q, c["k"], c["v"], return_lse=True, **kw)
    q.copy_(torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype))
    slopes.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, lse, q, c, True, None, "bf16", slopes, sinks.float())
