"""Decode attention on a GPU against an fp32 reference (marker ``gpu``).

Caches are NaN-filled before the sequences' rows are written, so a read of any row or page a
sequence does not own poisons its output; block tables are random permutations with spare
pages. Bound (AOTriton's rule): ``|ours - ref_hi| <= 3 |ref_lo - ref_hi| + eps * max(1, |ref_hi|)``
where ref_lo is the same reference computed in the input precision.

Images: ``AOTRITON_RT_TEST_IMAGES`` pointing at ``python -m builder build --set gputest
--targets sm90`` (decode kernels for fp16/bf16 at D 64/128, fp32 at 64/128, fp16 D 32/80,
bf16 D 256; the attention kernels for the transformers model test).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402
from aotriton_rt import ArgumentError, FaultError  # noqa: E402
from aotriton_rt.ops.decode import FAULT_LENGTH, FAULT_PAGE, decode_attention, read_faults  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
EPS = {"fp16": 2e-4, "bf16": 2e-3, "fp32": 1e-5}


@pytest.fixture(scope="module")
def lib(decode_lib: aotriton_rt.Library) -> aotriton_rt.Library:
    return decode_lib


def _reference(q: Any, keys: list, vals: list, causal: bool, window: Any, dtype: Any, softcap: float = 0.0,
               slopes: Any = None, sinks: Any = None) -> tuple[Any, Any]:
    """(out (B, Sq, Hq, D), lse (B, Hq, Sq)) per sequence in ``dtype``; keys[b]: (n, Hk, D);
    ``softcap`` (0: none) makes the scaled scores ``softcap * tanh(s / softcap)`` before the mask;
    ALiBi ``slopes`` ``(Hq,)`` or ``(B, Hq)``; ``sinks`` ``(Hq,)``. Rows that see no key: 0 and -inf
    (with a sink: its logit)."""
    outs, lses = [], []
    B, Sq, Hq, D = q.shape
    left, right = window if window else (-1, -1)
    if causal:
        right = 0
    for b in range(B):
        n = keys[b].shape[0]
        group = Hq // keys[b].shape[1]
        kk = keys[b].to(dtype).transpose(0, 1).repeat_interleave(group, 0)
        vv = vals[b].to(dtype).transpose(0, 1).repeat_interleave(group, 0)
        s = q[b].to(dtype).transpose(0, 1) @ kk.transpose(-1, -2) / math.sqrt(D)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        rel = torch.arange(n, device=q.device)[None, :] - torch.arange(Sq, device=q.device)[:, None] - (n - Sq)
        if slopes is not None:
            per_seq = slopes if slopes.dim() == 1 else slopes[b]
            s = s - per_seq.to(dtype)[:, None, None] * rel.abs().to(dtype)[None]
        vis = torch.ones_like(rel, dtype=torch.bool)
        if left >= 0:
            vis &= rel >= -left
        if right >= 0:
            vis &= rel <= right
        s = s.masked_fill(~vis, float("-inf"))
        seen = vis.any(-1)
        p = torch.softmax(torch.where(seen[:, None], s, 0.0), -1) * seen[:, None]
        out = (p @ vv).transpose(0, 1)
        lse = torch.where(seen, torch.logsumexp(torch.where(seen[:, None], s, 0.0), -1), float("-inf"))
        if sinks is not None:
            joined = torch.logaddexp(lse, sinks.to(dtype)[:, None])
            out = out * torch.where(lse == float("-inf"), 0.0, torch.exp(lse - joined)).transpose(0, 1)[..., None]
            lse = joined
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _close(name: str, got: Any, hi: Any, lo: Any, eps: float) -> None:
    got, hi, lo = got.double(), hi.double(), lo.double()
    inf = torch.isinf(hi)
    assert torch.equal(torch.isinf(got), inf), f"{name}: -inf where the reference has none (or the other way)"
    got, hi, lo = (torch.where(inf, 0.0, t) for t in (got, hi, lo))
    err = (got - hi).abs().max().item()
    bound = 3 * (lo - hi).abs().max().item() + eps * max(1.0, hi.abs().max().item())
    assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g}"


def _cache(lens: list, new: int, Hk: int, D: int, dtype: Any, page: int | None, gen: Any, layout: str = "bshd"
           ) -> dict:
    total = [n + new for n in lens]
    cap = max(total) + 19
    keys = [torch.randn(n, Hk, D, device="cuda", generator=gen).to(dtype) for n in total]
    vals = [torch.randn(n, Hk, D, device="cuda", generator=gen).to(dtype) for n in total]
    B = len(lens)
    table = None
    if page:
        max_blocks = -(-cap // page)
        num_pages = sum(-(-n // page) for n in total) + 7
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(len(lens))).tolist()
        table = torch.full((B, max_blocks), num_pages + 1000, dtype=torch.int32)
        kc = torch.full((num_pages, page, Hk, D), float("nan"), device="cuda", dtype=dtype)
        vc = torch.full_like(kc, float("nan"))
        it = iter(perm)
        for b, n in enumerate(total):
            for j in range(-(-n // page)):
                table[b, j] = next(it)
            rows = torch.arange(lens[b])
            pages = table[b, rows // page].long().cuda()
            kc[pages, (rows % page).cuda()] = keys[b][:lens[b]]
            vc[pages, (rows % page).cuda()] = vals[b][:lens[b]]
        table = table.cuda()
    else:
        kc = torch.full((B, cap, Hk, D), float("nan"), device="cuda", dtype=dtype)
        vc = torch.full_like(kc, float("nan"))
        for b in range(B):
            kc[b, :lens[b]] = keys[b][:lens[b]]
            vc[b, :lens[b]] = vals[b][:lens[b]]
        if layout == "bhsd":
            kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    k_new = torch.stack([keys[b][lens[b]:] for b in range(B)]) if new else None
    v_new = torch.stack([vals[b][lens[b]:] for b in range(B)]) if new else None
    return {"k": kc, "v": vc, "table": table, "keys": keys, "vals": vals, "k_new": k_new, "v_new": v_new,
            "lens": torch.tensor(lens, dtype=torch.int32, device="cuda")}


CASES = {
    # name: dtype, D, Hq, Hk, Sq, lens, new, page, causal, window, splits
    "fp16_d128_gqa4_paged16_split_auto": ("fp16", 128, 32, 8, 1, [1000, 0, 1, 513], 0, 16, True, None, None),
    "bf16_d128_gqa8_contiguous_forced_splits": ("bf16", 128, 64, 8, 1, [4099, 37, 2048], 0, None, True, None, 7),
    "bf16_d64_paged64_append_at_page_edges": ("bf16", 64, 16, 4, 1, [63, 64, 127, 0], 1, 64, True, None, None),
    "fp16_d64_speculative_4_rows_append": ("fp16", 64, 8, 2, 4, [100, 31, 5], 4, 32, True, None, 3),
    "fp16_d128_16_rows_group_4": ("fp16", 128, 8, 2, 16, [300, 16, 17], 0, None, True, None, 2),
    "bf16_d128_sliding_window_paged": ("bf16", 128, 16, 2, 2, [900, 40, 3], 0, 16, True, (255, 0), None),
    "fp32_d64_window_both_sides": ("fp32", 64, 4, 4, 3, [77, 200], 0, None, False, (20, 1), 2),
    "fp32_d128_mqa_paged": ("fp32", 128, 8, 1, 1, [333, 1], 2, 48, True, None, None),
    "fp16_d80_bucket_not_power_of_two": ("fp16", 80, 8, 2, 1, [500, 129], 0, 16, True, None, None),
    "bf16_d256_paged": ("bf16", 256, 4, 1, 2, [700, 2], 1, 32, True, None, None),
    "fp16_d32_no_mask_lengths_0_1": ("fp16", 32, 4, 2, 1, [0, 1, 45], 0, None, False, None, 3),
    "fp16_d64_bhsd_cache": ("fp16", 64, 8, 2, 1, [301, 5], 0, "bhsd", True, None, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_an_fp32_reference(lib: aotriton_rt.Library, name: str) -> None:
    dtype_name, D, Hq, Hk, Sq, lens, new, page, causal, window, splits = CASES[name]
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(sum(map(ord, name)))
    layout = "bhsd" if page == "bhsd" else "bshd"
    c = _cache(lens, new, Hk, D, dtype, page if isinstance(page, int) else None, gen, layout)
    q = torch.randn(len(lens), Sq, Hq, D, device="cuda", generator=gen).to(dtype)
    out, lse = decode_attention(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"],
                                k_new=c["k_new"], v_new=c["v_new"], causal=causal, window=window, num_splits=splits,
                                cache_layout=layout, check=True, library=lib)
    hi_t = torch.float64 if dtype == torch.float32 else torch.float32
    ref_hi, lse_hi = _reference(q, c["keys"], c["vals"], causal, window, hi_t)
    ref_lo, lse_lo = _reference(q, c["keys"], c["vals"], causal, window, dtype)
    _close("out", out, ref_hi, ref_lo, EPS[dtype_name])
    _close("lse", lse, lse_hi, lse_lo, EPS[dtype_name])
    if new:
        for b, n in enumerate(lens):
            for r in range(n, n + new):
                if c["table"] is not None:
                    row = c["k"][c["table"][b, r // c["k"].shape[1]], r % c["k"].shape[1]]
                else:
                    row = c["k"][b, r]
                assert torch.equal(row, c["keys"][b][r]), f"appended row {r} of sequence {b}"


@pytest.mark.parametrize("page", [None, 16, 64, 256])
@pytest.mark.parametrize("config", [0, 1, 2])
def test_every_tuning_config_matches_the_reference_on_paged_and_contiguous_caches(lib: aotriton_rt.Library,
                                                                                  config: int, page: Any) -> None:
    """The configs the catalog's rules may pick (sm90: #2 for large batches; paged binaries
    with their own stage counts) each give the same answer, with and without splits."""
    gen = torch.Generator(device="cuda").manual_seed(100 + config)
    lens = [3000, 1, 700, 256]
    c = _cache(lens, 1, 8, 128, torch.bfloat16, page, gen, "bshd")
    q = torch.randn(len(lens), 1, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    ref_hi, _ = _reference(q, c["keys"], c["vals"], True, None, torch.float32)
    ref_lo, _ = _reference(q, c["keys"], c["vals"], True, None, torch.bfloat16)
    forced = lib.with_tuning({"attn_decode": [{"config": config}]})
    for splits in (1, 5):
        kv = (c["k"].clone(), c["v"].clone())
        out, _ = decode_attention(q, *kv, cache_seqlens=c["lens"], block_table=c["table"], k_new=c["k_new"],
                                  v_new=c["v_new"], causal=True, num_splits=splits, check=True, library=forced)
        _close(f"out (config {config}, {splits} splits)", out, ref_hi, ref_lo, EPS["bf16"])


@pytest.mark.parametrize("page", [16, 32, 48, 64, 80, 96, 128, 256])
def test_paged_caches_of_every_page_size_match_the_contiguous_cache_and_the_reference(lib: aotriton_rt.Library,
                                                                                     page: int) -> None:
    """Pages smaller than a key block (one table entry per 16-row chunk), a multiple of it (one
    per block) and neither (48, 80, 96: blocks that start mid-page, page edges after any chunk of
    the block, walked from one division per block): the same sequences through a shuffled,
    NaN-padded paged cache and a contiguous one, lengths 0, 1, page multiples and not, an append
    across a page edge."""
    lens = [2000, 1, 0, 777, 256, 4 * page - 1]
    data = {}
    for kind in ("contiguous", "paged"):
        gen = torch.Generator(device="cuda").manual_seed(page)  # the same rows for both caches
        data[kind] = _cache(lens, 1, 8, 128, torch.bfloat16, page if kind == "paged" else None, gen)
    gen = torch.Generator(device="cuda").manual_seed(1000 + page)
    q = torch.randn(len(lens), 2, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    c = data["paged"]
    ref_hi, _ = _reference(q, c["keys"], c["vals"], True, None, torch.float32)
    ref_lo, _ = _reference(q, c["keys"], c["vals"], True, None, torch.bfloat16)
    for splits in (None, 3):
        outs = {}
        for kind, c in data.items():
            kv = (c["k"].clone(), c["v"].clone())
            outs[kind], _ = decode_attention(q, *kv, cache_seqlens=c["lens"], block_table=c["table"],
                                             k_new=c["k_new"], v_new=c["v_new"], causal=True, num_splits=splits,
                                             check=True, library=lib)
            _close(f"{kind} out (page {page}, splits {splits})", outs[kind], ref_hi, ref_lo, EPS["bf16"])
        diff = (outs["paged"].float() - outs["contiguous"].float()).abs().max().item()
        assert diff <= 1e-2, f"paged (page {page}) and contiguous outputs differ by {diff:.3g}"


def _pdl_expected() -> bool:
    """Programmatic dependent launch is compiled into the sm90+ decode variants only."""
    return torch.cuda.get_device_capability() >= (9, 0) and not torch.version.hip


@pytest.mark.parametrize("policy", ["on", "off"])
@pytest.mark.parametrize("page", [None, 16])
def test_each_launch_of_the_decode_chain_reads_what_the_kernel_before_it_wrote(
        lib: aotriton_rt.Library, page: Any, policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Append, decode and combine launch back to back after torch kernels that write their
    inputs (the query, the new rows) just before: on sm90 they are PDL launches that may start
    before their predecessor finished, and must wait for it (griddepcontrol.wait) before reading.
    Eagerly and replayed from a CUDA graph, each call matches the reference of its own inputs;
    the call before leaves other partials where this call's will be (the allocator hands the
    same block back), so a combine that read early would return those. Under both PDL policies
    (the per-call rule picks one of them): PDL launches, and the same variants launched plainly,
    forced here as bench/decode.py --pdl forces them (its own process's pdl_choice, a view with
    plans of its own)."""
    from aotriton_rt.ops import decode as dec
    from aotriton_rt.ops.decode import launch

    monkeypatch.setattr(launch, "pdl_choice", lambda p, num_splits: (policy == "on", f"policy {policy!r}"))
    view = lib.with_tuning({})
    _chain_reads_its_predecessors_writes(view, page)
    plans = list(dec._kernels_of(view).launches.values())
    assert plans and all(plan.pdl is (policy == "on") for plan in plans), [plan.pdl_reason for plan in plans]


def _chain_reads_its_predecessors_writes(lib: aotriton_rt.Library, page: Any) -> None:
    from aotriton_rt.ops.torch_decode import decode_attention as op

    gen = torch.Generator(device="cuda").manual_seed(11)
    B, Hq, Hk, D = 4, 32, 8, 128
    lens = [3000, 0, 1, 1500]
    c = _cache(lens, 1, Hk, D, torch.bfloat16, page, gen)
    for name in ("attn_decode", "attn_decode_combine", "attn_decode_append"):
        cache = {"PAGED": int(bool(page)), "KV_DTYPE": "bf16"} if name != "attn_decode_combine" else {}
        spec = {"dtype": "bf16", "HEAD_DIM": D, **cache, "PADDED_D": 0}
        assert lib.kernel(name, **spec).variant(0).pdl == _pdl_expected(), name
    base_q = torch.randn(B, 1, Hq, D, device="cuda", generator=gen).to(torch.bfloat16)
    sign = torch.ones((), device="cuda", dtype=torch.bfloat16)

    def step() -> Any:
        q = base_q * sign  # written by the kernel right before the chain
        kn, vn = c["k_new"] * sign, c["v_new"] * sign
        return op(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"], k_new=kn, v_new=vn,
                  causal=True, num_splits=6, library=lib)

    def check(what: str, out: Any, s: float) -> None:
        keys = [torch.cat([c["keys"][b][:n], c["keys"][b][n:] * s]) for b, n in enumerate(lens)]
        vals = [torch.cat([c["vals"][b][:n], c["vals"][b][n:] * s]) for b, n in enumerate(lens)]
        hi, _ = _reference(base_q * s, keys, vals, True, None, torch.float32)
        lo, _ = _reference(base_q * s, keys, vals, True, None, torch.bfloat16)
        _close(what, out, hi, lo, EPS["bf16"])

    for i in range(4):  # the first call plans, the next ones take the prepared launches
        s = -1.0 if i % 2 else 1.0
        sign.fill_(s)
        out = step()
        torch.cuda.synchronize()
        check(f"eager call {i}", out, s)
    graph = torch.cuda.CUDAGraph()
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        step()
    torch.cuda.current_stream().wait_stream(warm)
    with torch.cuda.graph(graph):
        out = step()
    for i, s in enumerate((1.0, -1.0, 0.5, -1.0)):
        sign.fill_(s)
        graph.replay()
        torch.cuda.synchronize()
        check(f"graph replay {i} (sign {s})", out, s)


@pytest.mark.parametrize("page", [None, 64])
def test_the_pdl_rule_launches_large_contiguous_split_calls_plainly_and_they_match_the_reference(
        lib: aotriton_rt.Library, page: Any) -> None:
    """B=8 with 8192 keys and 8 KV heads (256 MiB of K/V, split): the shape where PDL measured 16%
    slower on a contiguous cache. The rule launches its chain plainly (a paged cache keeps PDL);
    eagerly and replayed from a CUDA graph the outputs match the reference."""
    from aotriton_rt.ops import decode as dec

    gen = torch.Generator(device="cuda").manual_seed(23)
    lens = [8192 - 20] * 8  # a cache of 8192 rows: the lengths, the appended row and 19 spare
    c = _cache(lens, 1, 8, 128, torch.bfloat16, page, gen)
    q = torch.randn(len(lens), 1, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    ref_hi, _ = _reference(q, c["keys"], c["vals"], True, None, torch.float32)
    ref_lo, _ = _reference(q, c["keys"], c["vals"], True, None, torch.bfloat16)

    def step() -> Any:
        return decode_attention(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"], k_new=c["k_new"],
                                v_new=c["v_new"], causal=True, library=lib)[0]

    dec._kernels_of(lib).launches.clear()
    for i in range(3):
        _close(f"eager call {i}", step(), ref_hi, ref_lo, EPS["bf16"])
    (plan,) = dec._kernels_of(lib).launches.values()
    assert plan.num_splits > 1 and plan.pdl is (page is not None), plan.pdl_reason
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        step()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for i in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        _close(f"graph replay {i}", out, ref_hi, ref_lo, EPS["bf16"])


def test_attention_routes_decoding_to_the_decode_kernels_and_matches_prefill(lib: aotriton_rt.Library) -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(4, 32, 1, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(4, 8, 3001, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    launched = []
    original = aotriton_rt.ops.decode.decode_attention

    def spy(*a: Any, **kw: Any) -> Any:
        launched.append(kw.get("cache_layout"))
        return original(*a, **kw)

    aotriton_rt.ops.decode.decode_attention = spy
    try:
        out, lse = aotriton_rt.attention(q, k, v, causal=True, align="bottom_right", library=lib)
        # Repeated calls of the signature run the kept decode plan (integer addresses), on new data.
        repeats = []
        for _ in range(2):
            q2, k2 = torch.randn_like(q), torch.randn_like(k)
            repeats.append((q2, k2, aotriton_rt.attention(q2, k2, v, causal=True, align="bottom_right",
                                                          library=lib)[0]))
    finally:
        aotriton_rt.ops.decode.decode_attention = original
    assert launched == ["bhsd"]
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    assert (out.float() - ref).abs().max().item() < 2e-2
    assert lse.shape == (4, 32, 1) and lse.dtype == torch.float32
    for q2, k2, out2 in repeats:
        ref = torch.nn.functional.scaled_dot_product_attention(q2.float(), k2.float(), v.float(), enable_gqa=True)
        assert (out2.float() - ref).abs().max().item() < 2e-2


def test_decode_step_replays_in_a_cuda_graph_with_new_lengths(lib: aotriton_rt.Library) -> None:
    from aotriton_rt.ops.torch_decode import decode_attention as op

    gen = torch.Generator(device="cuda").manual_seed(6)
    B, Hq, Hk, D, page = 8, 16, 4, 128, 16
    c = _cache([500, 900, 17, 0, 64, 65, 1000, 3], 1, Hk, D, torch.bfloat16, page, gen)
    q = torch.randn(B, 1, Hq, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    lens = c["lens"].clone()
    kn, vn = c["k_new"].clone(), c["v_new"].clone()
    op(q, c["k"], c["v"], cache_seqlens=lens, block_table=c["table"], k_new=kn, v_new=vn, causal=True, library=lib)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(q, c["k"], c["v"], cache_seqlens=lens, block_table=c["table"], k_new=kn, v_new=vn, causal=True,
                 library=lib)
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = _reference(q, c["keys"], c["vals"], True, None, torch.float32)
    assert (out.float() - ref).abs().max().item() < 3e-2
    # Shorter sequences and new queries on replay: the graph reads lengths and data from the device.
    n = [int(x) for x in c["lens"].tolist()]
    lens.copy_(torch.tensor([max(x - 1, 0) for x in n], dtype=torch.int32))
    q.copy_(torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype))
    graph.replay()
    torch.cuda.synchronize()
    # The new row now lands at n-1 (over the last cached row): each sequence holds its first n-1
    # rows and the new one.
    keys = [torch.cat([c["keys"][b][:max(x - 1, 0)], c["keys"][b][x:]]) for b, x in enumerate(n)]
    vals = [torch.cat([c["vals"][b][:max(x - 1, 0)], c["vals"][b][x:]]) for b, x in enumerate(n)]
    ref, _ = _reference(q, keys, vals, True, None, torch.float32)
    assert (out.float() - ref).abs().max().item() < 3e-2


def test_a_graph_without_lengths_keeps_its_lengths_after_its_plan_is_dropped(lib: aotriton_rt.Library) -> None:
    # A call without cache_seqlens reads a constant lengths array; a graph that captured the call
    # holds its address after the plan cache drops the plan (it is cleared when full), so the
    # array must outlive the plan. It once did not: the freed block, handed to the next small
    # allocation, gave every sequence that allocation's contents as its length on replay.
    from aotriton_rt.ops import decode as dec

    gen = torch.Generator(device="cuda").manual_seed(10)
    B, S, Hq, Hk, D = 2, 1024 + 48, 8, 2, 64  # a length no other test's constant lengths array has
    q = torch.randn(B, 1, Hq, D, device="cuda", generator=gen, dtype=torch.float16)
    k = torch.randn(B, S, Hk, D, device="cuda", generator=gen, dtype=torch.float16)
    v = torch.randn(B, S, Hk, D, device="cuda", generator=gen, dtype=torch.float16)
    decode_attention(q, k, v, causal=True, library=lib)  # the plan and its lengths, made outside the capture
    decode_attention(q, k, v, causal=True, library=lib)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = decode_attention(q, k, v, causal=True, library=lib)
    dec._kernels_of(lib).launches.clear()
    torch.cuda.synchronize()
    junk = [torch.zeros((B,), dtype=torch.int32, device="cuda") for _ in range(256)]  # takes any freed small block
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                                           v.transpose(1, 2).float(), enable_gqa=True)
    assert (out.float() - ref.transpose(1, 2)).abs().max().item() < 2e-2
    assert len(junk) == 256


def test_custom_op_passes_opcheck(lib: aotriton_rt.Library) -> None:
    from aotriton_rt.ops.torch import _library_key
    from aotriton_rt.ops.torch_decode import decode_attention_op

    gen = torch.Generator(device="cuda").manual_seed(7)
    c = _cache([100, 37], 0, 2, 64, torch.float16, 16, gen)
    q = torch.randn(2, 1, 8, 64, device="cuda", generator=gen, dtype=torch.float16)
    sinks = torch.randn(8, device="cuda", generator=gen)
    slopes = torch.rand(8, device="cuda", generator=gen)
    for s, a, softcap in ((None, None, 0.0), (sinks, None, 0.0), (None, None, 30.0), (sinks, slopes, 0.0)):
        torch.library.opcheck(decode_attention_op, (q, c["k"], c["v"], c["lens"], -1, c["table"], None, s, a, None,
                                                    None, 0.0, 0.0, True, -1, 0, 0.125, softcap, 0, -1, "bshd",
                                                    "bshd", _library_key(lib)),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("paged", [False, True])
def test_the_torch_op_passes_cache_leftpad_through(lib: aotriton_rt.Library, paged: bool) -> None:
    """``ops.torch_decode.decode_attention(cache_leftpad=)`` (the custom op) gives the operator's
    result bit for bit, appended rows included, and differs from a call without the starts."""
    from aotriton_rt.ops.torch_decode import decode_attention as op_decode

    gen = torch.Generator(device="cuda").manual_seed(9)
    page = 16 if paged else None
    q = torch.randn(3, 2, 8, 64, device="cuda", generator=gen, dtype=torch.float16)
    kn, vn = (torch.randn(3, 2, 2, 64, device="cuda", generator=gen, dtype=torch.float16) for _ in range(2))
    starts = torch.tensor([0, 9, 33], dtype=torch.int32, device="cuda")
    results = []
    for through_op in (False, True):  # a fresh, equal cache each time: the call appends to it
        c = _cache([40, 23, 57], 2, 2, 64, torch.float16, page, torch.Generator(device="cuda").manual_seed(10))
        call = op_decode if through_op else decode_attention
        out = call(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"], cache_leftpad=starts,
                   k_new=kn, v_new=vn, causal=True, library=lib)
        results.append(out[0] if isinstance(out, tuple) else out)
    assert torch.equal(results[0], results[1]) and results[1].isfinite().all()
    c = _cache([40, 23, 57], 0, 2, 64, torch.float16, page, torch.Generator(device="cuda").manual_seed(10))
    q = q[:, :1].contiguous()
    padded = op_decode(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"], cache_leftpad=starts,
                       library=lib)
    whole = op_decode(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"], library=lib)
    assert torch.equal(padded[0], whole[0]) and not torch.equal(padded[1:], whole[1:])


@pytest.mark.parametrize("mask", ["causal", "window", "none"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_the_varlen_route_agrees_with_the_decode_kernels(lib: aotriton_rt.Library, paged: bool, mask: str) -> None:
    """A 192-row run takes the variable-length route; the same call with ``out=`` (which keeps it
    on the decode kernels) gives the same answer, left padding and appended rows included."""
    from aotriton_rt.ops import decode as dec
    from aotriton_rt.ops.decode import launch

    gen = torch.Generator(device="cuda").manual_seed(12)
    Sq, D = 192, 128
    c = _cache([500, 0, 77], Sq, 2, D, torch.bfloat16, 16 if paged else None, gen)
    q = torch.randn(3, Sq, 8, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    starts = torch.tensor([0, 0, 40], dtype=torch.int32, device="cuda")
    options = {"causal": mask == "causal", "window": (100, 3) if mask == "window" else None,
               "cache_leftpad": starts, "library": lib}
    kc, vc = c["k"].clone(), c["v"].clone()
    routed = decode_attention(q, kc, vc, cache_seqlens=c["lens"], block_table=c["table"], k_new=c["k_new"],
                              v_new=c["v_new"], **options)
    plans = [p for p in dec._kernels_of(lib).launches.values() if p.p.seqlen_q == Sq]
    if not any(p.varlen for p in plans):
        pytest.skip("these images lack the route's kernels or the varlen forward at bf16, head dim 128")
    out = torch.empty_like(q)
    kept = decode_attention(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"], k_new=c["k_new"],
                            v_new=c["v_new"], out=out, **options)
    assert launch.VARLEN_SEQLEN_Q <= Sq
    for got, want in zip(routed, kept):
        assert got.isfinite().all() == want.isfinite().all()
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2, equal_nan=True)


def test_paged_lengths_past_the_block_table_are_refused_in_debug_mode(lib: aotriton_rt.Library) -> None:
    gen = torch.Generator(device="cuda").manual_seed(8)
    c = _cache([40, 10], 0, 2, 64, torch.float16, 16, gen)
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.float16)
    too_long = torch.tensor([40, 10_000], dtype=torch.int32, device="cuda")
    with pytest.raises(ArgumentError, match=r"cache_seqlens\[1\] = 10000 plus 0 new rows is outside the"):
        decode_attention(q, c["k"], c["v"], cache_seqlens=too_long, block_table=c["table"], check=True, library=lib)
    # Without the check the kernels clamp: no fault; the long sequence answers NaN and is flagged.
    read_faults(library=lib)
    out, lse = decode_attention(q, c["k"], c["v"], cache_seqlens=too_long, block_table=c["table"], check=False,
                                library=lib)
    assert out[1].isnan().all() and lse[1].isnan().all() and out[0].isfinite().all()
    # Clamped to the table's rows, it also reaches the table's unused (out-of-range) entries.
    assert read_faults(library=lib) == FAULT_LENGTH | FAULT_PAGE


# ---------------------------------------------------------------------------------------------
# Hostile lengths and block tables: never a read or write outside the arrays, never a plausible
# answer (tests/helpers/memcheck_decode.py runs the same under compute-sanitizer).
# ---------------------------------------------------------------------------------------------

BIG = 10**6
# name: (paged, lens, new, table changes {(b, column): page}, fault bits). Sequence 1 is hostile;
# pages of 16 rows, a 3-column table (48 rows) over 9 pages; contiguous caches hold 48 rows.
HOSTILE = {
    "page_past_the_cache": (True, [40, 30, 5], 0, {(1, 1): BIG}, FAULT_PAGE),
    "negative_page": (True, [40, 30, 5], 0, {(1, 0): -5}, FAULT_PAGE),
    "length_past_the_table": (True, [40, 55, 5], 0, {}, FAULT_LENGTH),
    "negative_length": (True, [40, -3, 5], 0, {}, FAULT_LENGTH),
    "length_near_the_int32_limit_append": (True, [40, 2**31 - 2, 5], 2, {}, FAULT_LENGTH),
    "append_through_a_page_past_the_cache": (True, [20, 15, 5], 2, {(1, 1): BIG}, FAULT_PAGE),
    "contiguous_length_past_the_cache_append": (False, [20, 47, 5], 2, {}, FAULT_LENGTH),
    "contiguous_negative_length": (False, [40, -1, 5], 0, {}, FAULT_LENGTH),
}


def _hostile(paged: bool, lens: list, new: int, changes: dict, gen: Any) -> dict:
    """A cache inside a buffer of NaN sentinels (K: pages 2..10 of 13, or sequences 1..3 of 5)."""
    if paged:
        buf = torch.full((13, 16, 2, 64), float("nan"), device="cuda", dtype=torch.float16)
        k = buf[2:11]
        table = (torch.arange(9, dtype=torch.int32, device="cuda").reshape(3, 3))
        for (b, j), page in changes.items():
            table[b, j] = page
    else:
        buf = torch.full((5, 48, 2, 64), float("nan"), device="cuda", dtype=torch.float16)
        k, table = buf[1:4], None
    k.copy_(torch.randn(k.shape, device="cuda", generator=gen))
    vbuf = buf.clone()
    v = vbuf[2:11] if paged else vbuf[1:4]
    v.copy_(torch.randn(v.shape, device="cuda", generator=gen))
    kn = torch.randn(3, new, 2, 64, device="cuda", generator=gen).half() if new else None
    vn = torch.randn(3, new, 2, 64, device="cuda", generator=gen).half() if new else None
    return {"buf": buf, "vbuf": vbuf, "k": k, "v": v, "table": table, "k_new": kn, "v_new": vn,
            "lens": torch.tensor(lens, dtype=torch.int32, device="cuda")}


@pytest.mark.parametrize("Sq", [1, 128], ids=["one_row", "long_run"])  # 128: the varlen route
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_tables_and_lengths_stay_in_bounds_answer_nan_and_set_the_fault_flag(
        lib: aotriton_rt.Library, name: str, splits: int, Sq: int) -> None:
    paged, lens, new, changes, bits = HOSTILE[name]
    gen = torch.Generator(device="cuda").manual_seed(sum(map(ord, name)))
    c = _hostile(paged, lens, new, changes, gen)
    q = torch.randn(3, Sq, 8, 64, device="cuda", generator=gen).half()
    args = {"cache_seqlens": c["lens"], "block_table": c["table"], "k_new": c["k_new"], "v_new": c["v_new"],
            "num_splits": splits, "library": lib}
    before = (c["buf"].clone(), c["vbuf"].clone())
    # check=True: refused before launch, naming the array.
    with pytest.raises(ArgumentError, match=r"block_table\[1, \d\]" if bits == FAULT_PAGE else r"cache_seqlens\[1\]"):
        decode_attention(q, c["k"], c["v"], check=True, **args)
    assert read_faults(library=lib) == 0
    out, lse = decode_attention(q, c["k"], c["v"], check=False, **args)
    assert read_faults(library=lib) == bits
    assert out[1].isnan().all() and lse[1].isnan().all(), "the faulting sequence must answer NaN"
    # The good sequences: exactly what their rows give.
    ps = 16
    for b in (0, 2):
        n = lens[b] + new
        rows = torch.arange(n, device="cuda")
        idx = (c["table"][b, rows // ps].long(), rows % ps) if paged else (torch.full_like(rows, b), rows)
        kk, vv = c["k"][idx], c["v"][idx]
        ref_hi, _ = _reference(q[b:b + 1], [kk], [vv], False, None, torch.float32)
        ref_lo, _ = _reference(q[b:b + 1], [kk], [vv], False, None, torch.float16)
        _close(f"out[{b}]", out[b:b + 1], ref_hi, ref_lo, EPS["fp16"])
    # K changed only where an append was valid: every row of a good sequence, the hostile one's
    # rows on in-range pages when only a page was bad, none when its length was.
    want = before[0].clone()
    view = want[2:11] if paged else want[1:4]
    for b in range(3):
        if b == 1 and bits == FAULT_LENGTH:
            continue
        for i in range(new):
            r = lens[b] + i
            page = int(c["table"][b, r // ps]) if paged else b
            if 0 <= page < 9:
                view[(page, r % ps) if paged else (b, r)] = c["k_new"][b, i]
    assert torch.equal(c["buf"].nan_to_num(7.0), want.nan_to_num(7.0)), "K changed outside the valid appends"


@pytest.mark.parametrize("lengths", ["device", "host", "int"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_exactly_at_capacity_matches_the_reference_and_one_more_row_is_refused(lib: aotriton_rt.Library,
                                                                              lengths: str, paged: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    c = _hostile(paged, [0, 0, 0], 2, {}, gen)
    lens = [46, 46, 46]  # 46 cached + 2 appended = 48 = the table's (or cache's) capacity
    keys = []
    vals = []
    ps = 16
    for b in range(3):
        rows = torch.arange(48, device="cuda")
        if paged:
            idx = (c["table"][b, rows // ps].long(), rows % ps)
        else:
            idx = (torch.full_like(rows, b), rows)
        kk, vv = c["k"][idx].clone(), c["v"][idx].clone()
        kk[46:], vv[46:] = c["k_new"][b], c["v_new"][b]
        keys.append(kk)
        vals.append(vv)
    value = {"device": torch.tensor(lens, dtype=torch.int32, device="cuda"),
             "host": torch.tensor(lens, dtype=torch.int32), "int": 46}[lengths]
    q = torch.randn(3, 2, 8, 64, device="cuda", generator=gen).half()
    args = {"block_table": c["table"], "k_new": c["k_new"], "v_new": c["v_new"], "causal": True, "library": lib}
    over = {"device": c["lens"] + 47, "host": torch.tensor([47, 0, 0], dtype=torch.int32), "int": 47}[lengths]
    if lengths != "device":  # lengths on the host: refused before launch (FlashAttention-2's rule)
        with pytest.raises(ArgumentError, match="block_table" if paged else "k_cache"):
            decode_attention(q, c["k"], c["v"], cache_seqlens=over, check=False, **args)
    out, lse = decode_attention(q, c["k"], c["v"], cache_seqlens=value, check=lengths == "device", **args)
    ref_hi, lse_hi = _reference(q, keys, vals, True, None, torch.float32)
    ref_lo, lse_lo = _reference(q, keys, vals, True, None, torch.float16)
    _close("out", out, ref_hi, ref_lo, EPS["fp16"])
    _close("lse", lse, lse_hi, lse_lo, EPS["fp16"])
    assert read_faults(library=lib) == 0


def test_check_raises_a_fault_error_for_an_earlier_unchecked_faulting_call(lib: aotriton_rt.Library) -> None:
    gen = torch.Generator(device="cuda").manual_seed(6)
    c = _hostile(True, [40, 30, 5], 0, {(1, 1): BIG}, gen)
    q = torch.randn(3, 1, 8, 64, device="cuda", generator=gen).half()
    read_faults(library=lib)
    for _ in range(2):  # the second takes the cached plan and its prepared launch
        decode_attention(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"], check=False, library=lib)
    c["table"][1, 1] = 4
    with pytest.raises(FaultError, match=r"block_table entry outside \[0, num_pages\)") as info:
        decode_attention(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"], check=True, library=lib)
    assert info.value.bits == FAULT_PAGE and read_faults(library=lib) == 0
    out, _ = decode_attention(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"], check=True,
                              library=lib)
    assert out.isfinite().all()


# ---------------------------------------------------------------------------------------------
# The transformers integration: a small randomly initialised Llama.
# ---------------------------------------------------------------------------------------------

def _llama(name: str, dtype: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=1024, pad_token_id=0)
    model = transformers.LlamaForCausalLM(copy.deepcopy(config)).to("cuda", dtype)
    model.set_attn_implementation(name)
    return model


def test_llama_logits_gradients_and_generation_match_sdpa_within_sdpa_vs_eager(lib: aotriton_rt.Library) -> None:
    import aotriton_rt.integrations.transformers as hf

    name = hf.register(library=lib)
    models = {}
    for impl in ("sdpa", "eager", name):
        models[impl] = _llama(impl, torch.float16)
        if impl != "sdpa":
            models[impl].load_state_dict(models["sdpa"].state_dict())
    gen = torch.Generator(device="cuda").manual_seed(9)
    ids = torch.randint(1, 512, (3, 77), device="cuda", generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0  # a left-padded row
    ids = ids.masked_fill(mask == 0, 0)
    logits, grads = {}, {}
    for impl, model in models.items():
        model.zero_grad()
        out = model(ids, attention_mask=mask)
        real = mask.bool()
        logits[impl] = out.logits[real].float()
        out.logits[real].float().pow(2).mean().backward()
        grads[impl] = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    for what, values in (("logits", logits), ("gradients", grads)):
        eager = (values["eager"] - values["sdpa"]).abs().max().item()
        ours = (values[name] - values["sdpa"]).abs().max().item()
        assert ours <= 2 * eager + 1e-3 * values["sdpa"].abs().max().item(), \
            f"{what}: aotriton-vs-sdpa {ours:.3g}, eager-vs-sdpa {eager:.3g}"
    prompt = torch.randint(1, 512, (4, 40), device="cuda", generator=gen)
    kw = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(prompt)}
    with torch.no_grad():
        seqs = {impl: m.generate(prompt, **kw)[:, 40:] for impl, m in models.items()}
    agree_eager = (seqs["eager"] == seqs["sdpa"]).float().mean().item()
    agree_ours = (seqs[name] == seqs["sdpa"]).float().mean().item()
    assert agree_ours >= min(agree_eager, 0.9) - 0.05, f"greedy tokens equal to sdpa's: ours {agree_ours:.2f}, " \
                                                        f"eager {agree_eager:.2f}"
