"""Decode attention over fp8 (e4m3) KV caches on a GPU against an fp32 reference (marker ``gpu``).

The reference attends over the *dequantised* cache (stored fp8 value times its scale), so the
bound (tests/runtime/test_decode_gpu.py's ``3 |ref_lo - ref_hi| + eps``) measures the kernels'
arithmetic, not the quantisation. Contiguous and paged caches (pages of 16 and 64, NaN in every
row and page no sequence owns, random block tables), odd lengths (0, 1, 37, 513, 1000), GQA 4,
1 and 4 query rows appended (quantised by the call), per-head ``(Hkv,)``, per-sequence
``(B, Hkv)``, 0-d and float scales, causal and windowed, automatic and forced splits, left
padding with a softcap, masked head dims, a 160-row run (on the decode kernels: the varlen
route keeps caches of q's type), the torch op in a CUDA graph. The appended rows are compared
byte for byte with torch's own ``.to(float8_e4m3fn)`` of ``value / scale`` saturated, NaN and
infinities included.

The cache type follows the GPU: ``float8_e4m3fn`` on sm90 and gfx950, ``float8_e4m3fnuz`` on
gfx942; other GPUs skip. Images: ``AOTRITON_RT_TEST_IMAGES`` (``python -m builder build --set
gputest --targets sm90``).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402
from aotriton_rt.ops import decode as dec  # noqa: E402
from tests.runtime.test_decode_gpu import EPS, _close, _reference  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LENS = [1000, 37, 513, 0, 1]


@pytest.fixture(scope="module")
def lib(decode_lib: aotriton_rt.Library) -> aotriton_rt.Library:
    return decode_lib


@pytest.fixture(scope="module")
def fp8() -> Any:
    """The GPU's e4m3 cache type (its images hold that one)."""
    if getattr(torch.version, "hip", None):
        arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
        found = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}.get(arch)
    else:
        found = torch.float8_e4m3fn if torch.cuda.get_device_capability() == (9, 0) else None
    if found is None:
        pytest.skip("fp8 cache variants are built for sm90, gfx942 and gfx950 only")
    return found


def quantise(x: Any, scale: Any, fp8: Any) -> Any:
    """torch's own quantisation of ``x`` (rows, Hk, D) by ``scale`` (Hk,): ``x / scale`` in fp32,
    saturated to the largest finite value (NaN kept), rounded to nearest even."""
    top = torch.finfo(fp8).max
    y = x.float() / scale.float()[None, :, None]
    return torch.where(torch.isnan(y), y, y.clamp(-top, top)).to(fp8)


def _scales(kind: str, B: int, Hk: int, amp: Any) -> tuple[Any, Any, Any, Any]:
    """(k, v per (b, h) fp32 (B, Hk), and the k_scale / v_scale arguments of ``kind``)."""
    full = (amp / 100).repeat(B, 1) * torch.linspace(1.0, 1.7, B, device="cuda")[:, None]
    if kind == "head":
        full = full[:1].expand(B, Hk).contiguous()
    elif kind in ("float", "zero_d"):
        full = torch.full((B, Hk), 0.03, device="cuda")
    ks, vs = full, full * 0.6

    def arg(s: Any) -> Any:
        return {"float": lambda: float(s[0, 0]), "zero_d": lambda: s[0, 0].clone(), "head": lambda: s[0].clone(),
                "batch_head": lambda: s.clone()}[kind]()

    return ks, vs, arg(ks), arg(vs)


def fp8_cache(lens: list, new: int, Hk: int, D: int, dtype: Any, page: int | None, gen: Any, fp8: Any,
              kind: str) -> dict:
    """test_decode_gpu's cache in fp8: the real rows quantised per (sequence, KV head), NaN
    wherever no sequence owns a row; ``keys``/``vals``: each sequence's dequantised rows (the
    appended ones as the call quantises them), ``k_new``/``v_new`` in q's dtype."""
    B = len(lens)
    total = [n + new for n in lens]
    cap = max(total) + 19
    amp = torch.linspace(0.5, 4.0, Hk, device="cuda")
    ks, vs, k_arg, v_arg = _scales(kind, B, Hk, amp)
    real_k = [(torch.randn(n, Hk, D, device="cuda", generator=gen) * amp[None, :, None]).to(dtype) for n in total]
    real_v = [(torch.randn(n, Hk, D, device="cuda", generator=gen) * amp[None, :, None]).to(dtype) for n in total]
    stored_k = [quantise(real_k[b], ks[b], fp8) for b in range(B)]
    stored_v = [quantise(real_v[b], vs[b], fp8) for b in range(B)]
    nan = torch.tensor(float("nan"), device="cuda").to(fp8)
    table = None
    if page:
        max_blocks = -(-cap // page)
        num_pages = sum(-(-n // page) for n in total) + 7
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(B)).tolist()
        table = torch.full((B, max_blocks), num_pages + 1000, dtype=torch.int32)
        kc = nan.repeat(num_pages, page, Hk, D)
        vc = nan.repeat(num_pages, page, Hk, D)
        it = iter(perm)
        for b, n in enumerate(total):
            for j in range(-(-n // page)):
                table[b, j] = next(it)
            rows = torch.arange(lens[b])
            pages = table[b, rows // page].long().cuda()
            kc[pages, (rows % page).cuda()] = stored_k[b][:lens[b]]
            vc[pages, (rows % page).cuda()] = stored_v[b][:lens[b]]
        table = table.cuda()
    else:
        kc = nan.repeat(B, cap, Hk, D)
        vc = nan.repeat(B, cap, Hk, D)
        for b in range(B):
            kc[b, :lens[b]] = stored_k[b][:lens[b]]
            vc[b, :lens[b]] = stored_v[b][:lens[b]]
    return {"k": kc, "v": vc, "table": table, "ks": ks, "vs": vs, "k_scale": k_arg, "v_scale": v_arg,
            "stored_k": stored_k, "stored_v": stored_v, "page": page,
            "keys": [stored_k[b].float() * ks[b][None, :, None] for b in range(B)],
            "vals": [stored_v[b].float() * vs[b][None, :, None] for b in range(B)],
            "k_new": torch.stack([real_k[b][lens[b]:] for b in range(B)]) if new else None,
            "v_new": torch.stack([real_v[b][lens[b]:] for b in range(B)]) if new else None,
            "lens": torch.tensor(lens, dtype=torch.int32, device="cuda"), "total": total, "cached": lens}


def _row(c: dict, cache: Any, b: int, r: int) -> Any:
    if c["page"]:
        return cache[c["table"][b, r // c["page"]].long(), r % c["page"]]
    return cache[b, r]


def _appended_bytes_match(c: dict, kc: Any, vc: Any) -> None:
    """Every appended row's bytes equal torch's quantisation of the row."""
    for b, (n, total) in enumerate(zip(c["cached"], c["total"])):
        for r in range(n, total):
            for cache, stored, name in ((kc, c["stored_k"], "k"), (vc, c["stored_v"], "v")):
                got, want = _row(c, cache, b, r).view(torch.uint8), stored[b][r].view(torch.uint8)
                assert torch.equal(got, want), f"{name} row {r} of sequence {b}: {got.tolist()} != {want.tolist()}"


def _check(out: Any, lse: Any, q: Any, c: dict, causal: bool, window: Any, dtype_name: str,
           softcap: float = 0.0) -> None:
    ref_hi, lse_hi = _reference(q, c["keys"], c["vals"], causal, window, torch.float32, softcap)
    ref_lo, lse_lo = _reference(q, c["keys"], c["vals"], causal, window, DTYPES[dtype_name], softcap)
    _close("out", out, ref_hi, ref_lo, EPS[dtype_name])
    _close("lse", lse, lse_hi, lse_lo, EPS[dtype_name])


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("kind", ["head", "batch_head", "float", "zero_d"])
@pytest.mark.parametrize("page", [None, 16, 64], ids=["contiguous", "paged16", "paged64"])
@pytest.mark.parametrize("Sq", [1, 4])
def test_an_fp8_cache_step_matches_the_fp32_reference_of_the_dequantised_cache(
        lib: aotriton_rt.Library, fp8: Any, Sq: int, page: Any, kind: str, D: int, dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(11 * Sq + (page or 0) + D)
    c = fp8_cache(LENS, Sq, 8, D, dtype, page, gen, fp8, kind)
    q = torch.randn(len(LENS), Sq, 32, D, device="cuda", generator=gen).to(dtype)
    for splits, causal, window in ((None, True, None), (3, False, (255, 2))):
        kc, vc = c["k"].clone(), c["v"].clone()  # each call appends its rows to a fresh copy
        out, lse = dec.decode_attention(q, kc, vc, cache_seqlens=c["lens"], block_table=c["table"], k_new=c["k_new"],
                                        v_new=c["v_new"], k_scale=c["k_scale"], v_scale=c["v_scale"], causal=causal,
                                        window=window, num_splits=splits, check=True, library=lib)
        _check(out, lse, q, c, causal, window, dtype_name)
        _appended_bytes_match(c, kc, vc)


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
def test_the_append_stores_what_torch_quantises_saturated_with_nan_and_infinities(lib: aotriton_rt.Library, fp8: Any,
                                                                                   page: Any) -> None:
    """Values past the format's range saturate, NaN stays NaN, ties round to even: byte for byte."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    c = fp8_cache([5, 40, 0], 3, 2, 128, torch.bfloat16, page, gen, fp8, "head")
    special = torch.tensor([1e4, -1e4, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 31.5, 17.0, 19.0],
                           device="cuda")
    for new in (c["k_new"], c["v_new"]):
        new[:, :, 0, :10] = (special * c["ks"][0, 0]).to(new.dtype)  # k and v scales: NaN, inf and saturation alike
    c["stored_k"] = [torch.cat([s[:n], quantise(c["k_new"][b], c["ks"][b], fp8)])
                     for b, (s, n) in enumerate(zip(c["stored_k"], c["cached"]))]
    c["stored_v"] = [torch.cat([s[:n], quantise(c["v_new"][b], c["vs"][b], fp8)])
                     for b, (s, n) in enumerate(zip(c["stored_v"], c["cached"]))]
    q = torch.randn(3, 3, 4, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    kc, vc = c["k"].clone(), c["v"].clone()
    dec.decode_attention(q, kc, vc, cache_seqlens=c["lens"], block_table=c["table"], k_new=c["k_new"],
                         v_new=c["v_new"], k_scale=c["k_scale"], v_scale=c["v_scale"], causal=True, library=lib)
    torch.cuda.synchronize()
    _appended_bytes_match(c, kc, vc)
    top = torch.finfo(fp8).max
    assert _row(c, kc, 0, 5)[0, :2].float().tolist() == [top, -top]


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
def test_bf16_query_rows_past_fp16s_range_match_on_an_fp8_cache(lib: aotriton_rt.Library, fp8: Any,
                                                                 page: Any) -> None:
    """Under bf16 queries an fp8 cache's dots run in fp16, each query row scaled into fp16's range:
    rows of one GQA group at 1e6, 1e-30, 3e4 and 1 times N(0, 1) (past fp16's 65504 and below its
    subnormals) match the reference, with and without splits."""
    gen = torch.Generator(device="cuda").manual_seed(23 + (page or 0))
    c = fp8_cache(LENS, 1, 8, 128, torch.bfloat16, page, gen, fp8, "head")
    rows = torch.tensor([1e6, 1e-30, 3e4, 1.0], device="cuda").repeat(8)  # by query head
    q = torch.randn(len(LENS), 1, 32, 128, device="cuda", generator=gen) * rows[None, None, :, None]
    q = q.to(torch.bfloat16)
    for splits in (None, 3):
        kc, vc = c["k"].clone(), c["v"].clone()
        out, lse = dec.decode_attention(q, kc, vc, cache_seqlens=c["lens"], block_table=c["table"], k_new=c["k_new"],
                                        v_new=c["v_new"], k_scale=c["k_scale"], v_scale=c["v_scale"], causal=True,
                                        num_splits=splits, check=True, library=lib)
        assert torch.isfinite(out).all()
        _check(out, lse, q, c, True, None, "bf16")


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
def test_left_padding_a_window_and_a_softcap_on_an_fp8_cache(lib: aotriton_rt.Library, fp8: Any, page: Any) -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    lens = [700, 90, 41]
    starts = [30, 0, 17]
    c = fp8_cache(lens, 2, 4, 128, torch.bfloat16, page, gen, fp8, "batch_head")
    q = (torch.randn(3, 2, 16, 128, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    out, lse = dec.decode_attention(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"],
                                    k_new=c["k_new"], v_new=c["v_new"], k_scale=c["k_scale"], v_scale=c["v_scale"],
                                    cache_leftpad=torch.tensor(starts, dtype=torch.int32, device="cuda"),
                                    window=(255, 0), softcap=8.0, num_splits=2, library=lib)
    c["keys"] = [k[s:] for k, s in zip(c["keys"], starts)]
    c["vals"] = [v[s:] for v, s in zip(c["vals"], starts)]
    _check(out, lse, q, c, False, (255, 0), "bf16", 8.0)


@pytest.mark.parametrize("D", [96, 48])
def test_a_masked_head_dim_reads_the_fp8_cache_in_place(lib: aotriton_rt.Library, fp8: Any, D: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(D)
    c = fp8_cache([300, 1, 77], 1, 2, D, torch.float16, 16, gen, fp8, "head")
    q = torch.randn(3, 1, 8, D, device="cuda", generator=gen, dtype=torch.float16)
    handles = dec.decode_kernels(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"],
                                 k_new=c["k_new"], v_new=c["v_new"], k_scale=c["k_scale"], v_scale=c["v_scale"],
                                 library=lib)
    assert handles["attn_decode"].params["PADDED_D"] == 1
    out, lse = dec.decode_attention(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"],
                                    k_new=c["k_new"], v_new=c["v_new"], k_scale=c["k_scale"], v_scale=c["v_scale"],
                                    causal=True, library=lib)
    _check(out, lse, q, c, True, None, "fp16")
    _appended_bytes_match(c, c["k"], c["v"])


@pytest.mark.parametrize("config", range(9))
@pytest.mark.parametrize("page", [None, 16, 64], ids=["contiguous", "paged16", "paged64"])
def test_every_sm90_fp8_decode_config_matches_the_reference(lib: aotriton_rt.Library, fp8: Any, page: Any,
                                                            config: int) -> None:
    """Each config forced, #4-#8 included (V read in 4-byte words and widened before its dot):
    bf16 and fp16 queries, D 64 and 128, GQA 4, odd lengths, appended rows, splits and a window."""
    held = {v.config.index for v in lib.variants_of("attn_decode") if v.spec.get("KV_DTYPE") == "fp8e4nv"}
    if config not in held:
        pytest.skip(f"the images hold fp8 decode configs {sorted(held)} only")
    forced = lib.with_tuning({"attn_decode": [{"config": config, "splits": {"waves": 2, "min_blocks": 1,
                                                                             "max_splits": 64}}]})
    for dtype_name, D in (("bf16", 128), ("fp16", 64)):
        dtype = DTYPES[dtype_name]
        gen = torch.Generator(device="cuda").manual_seed(config * 7 + D + (page or 0))
        c = fp8_cache(LENS, 1, 8, D, dtype, page, gen, fp8, "batch_head")
        q = torch.randn(len(LENS), 1, 32, D, device="cuda", generator=gen).to(dtype)
        for splits, causal, window in ((None, True, None), (2, False, (255, 0))):
            kc, vc = c["k"].clone(), c["v"].clone()
            out, lse = dec.decode_attention(q, kc, vc, cache_seqlens=c["lens"], block_table=c["table"],
                                            k_new=c["k_new"], v_new=c["v_new"], k_scale=c["k_scale"],
                                            v_scale=c["v_scale"], causal=causal, window=window, num_splits=splits,
                                            check=True, library=forced)
            _check(out, lse, q, c, causal, window, dtype_name)
            _appended_bytes_match(c, kc, vc)
    # The handles the calls launched, by config: the forced one's first sm90 variant is that config.
    decodes = {key[2]: h for key, h in dec._kernels_of(forced).handles.items() if key[0] == "attn_decode"}
    assert config in decodes, f"config {config} never launched: {sorted(decodes)}"
    launched = min((v for v in decodes[config].candidates if v.target.arch == "sm90"), key=lambda v: v.config.index)
    assert launched.config.index == config
    assert launched.params.get("V_WIDENED", 0) == int(config >= 4)


def test_a_run_of_160_rows_stays_on_the_decode_kernels_and_matches(lib: aotriton_rt.Library, fp8: Any) -> None:
    """The variable-length route packs caches of q's type only: an fp8 cache's long run takes the
    decode kernels' prefill tile."""
    gen = torch.Generator(device="cuda").manual_seed(160)
    c = fp8_cache([900, 0, 333], 160, 8, 128, torch.bfloat16, 16, gen, fp8, "head")
    q = torch.randn(3, 160, 32, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    out, lse = dec.decode_attention(q, c["k"], c["v"], cache_seqlens=c["lens"], block_table=c["table"],
                                    k_new=c["k_new"], v_new=c["v_new"], k_scale=c["k_scale"], v_scale=c["v_scale"],
                                    causal=True, library=lib)
    _check(out, lse, q, c, True, None, "bf16")


def test_the_torch_op_replays_an_fp8_step_in_a_cuda_graph_with_new_scales(lib: aotriton_rt.Library,
                                                                          fp8: Any) -> None:
    from aotriton_rt.ops.torch_decode import decode_attention as op

    gen = torch.Generator(device="cuda").manual_seed(8)
    c = fp8_cache([500, 17, 0, 64], 1, 4, 128, torch.bfloat16, 16, gen, fp8, "head")
    q = torch.randn(4, 1, 16, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    ks, vs = c["k_scale"].clone(), c["v_scale"].clone()
    kc, vc = c["k"].clone(), c["v"].clone()

    def step() -> Any:
        return op(q, kc, vc, cache_seqlens=c["lens"], block_table=c["table"], k_new=c["k_new"], v_new=c["v_new"],
                  k_scale=ks, v_scale=vs, causal=True, library=lib)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = _reference(q, c["keys"], c["vals"], True, None, torch.float32)
    assert (out.float() - ref).abs().max().item() < 3e-2 * 4
    vs.mul_(2.0)  # the graph reads the scales from the device: the output doubles
    kc.copy_(c["k"])
    vc.copy_(c["v"])
    graph.replay()
    torch.cuda.synchronize()
    c["stored_v"] = [torch.cat([s[:n], quantise(c["v_new"][b], c["vs"][b] * 2, fp8)])
                     for b, (s, n) in enumerate(zip(c["stored_v"], c["cached"]))]
    vals = [s.float() * c["vs"][b][None, :, None] * 2 for b, s in enumerate(c["stored_v"])]
    ref, _ = _reference(q, c["keys"], vals, True, None, torch.float32)
    assert (out.float() - ref).abs().max().item() < 3e-2 * 8
