"""A representative decode subset to run under compute-sanitizer (not collected by pytest).

    AOTRITON_RT_IMAGES=.gpu-images compute-sanitizer --tool memcheck --error-exitcode 9 \\
        python tests/helpers/memcheck_decode.py

Contiguous and paged caches (page sizes 16, 48, 64 and 256: smaller than a key block, neither,
one block, several; a block table whose unused entries point far outside the cache, lengths 0,
1 and past a page edge), appends across page edges, speculative query rows with GQA tiles
taller than one block, sliding windows, forced splits (merged by the combine kernel; on sm90
the chain's PDL launches), head dims 64, 80 and 128, fp32, fp8 caches (per-head, per-sequence
and float scales, appends quantised into them; float8_e4m3fnuz on gfx942, float8_e4m3fn
elsewhere, on GPUs whose images hold them; on sm90 also configs #4, #6 and #7 forced, which read V in
4-byte words), ALiBi slopes (per head and per sequence) and sinks
(joined in the epilogue and by the combine, a head at -inf), the attention() route, and hostile
inputs: pages past the cache (10**6 in a 3-column table), negative entries, lengths past the
capacity, negative or near the int32 limit, appends through them, with and without the debug
check. Without it the kernels must stay in bounds (memcheck: no error), answer NaN for the
hostile sequence, the right values elsewhere, and set the fault flag; with it the call must be
refused before launch naming the array. Prints one line per case and a summary; exits 1 when
any case's result differs from its expectation (compute-sanitizer's own errors exit 9).
Needs images with the gputest set (AOTRITON_RT_IMAGES).
"""

import os
import sys
import traceback

import torch

import aotriton_rt
from aotriton_rt import ArgumentError
from aotriton_rt.ops.decode import FAULT_LENGTH, FAULT_PAGE, decode_attention, read_faults

torch.manual_seed(0)
dev = "cuda"
lib = aotriton_rt.Library(os.environ["AOTRITON_RT_IMAGES"]) if os.environ.get("AOTRITON_RT_IMAGES") else None
_ARCH = (torch.cuda.get_device_properties(0).gcnArchName.split(":")[0] if torch.version.hip else
         "sm{}{}".format(*torch.cuda.get_device_capability()))
#: The fp8 cache type of this GPU's images (None: none; the fp8 cases are skipped).
FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn, "sm90": torch.float8_e4m3fn}.get(_ARCH)


def to_fp8(k, v, b, hk, kind):
    """The caches quantised to FP8 by a scale per KV head, and decode_attention's scale arguments
    of ``kind``: "head" (Hkv,), "batch_head" (B, Hkv: the same per sequence), "float"."""
    per_head = torch.rand(hk, device=dev) + 0.05 if kind != "float" else torch.full((hk,), 0.05, device=dev)
    arg = {"head": per_head, "batch_head": per_head.expand(b, hk).contiguous(), "float": 0.05}[kind]
    by = per_head[None, None, :, None]
    return (k.float() / by).to(FP8), (v.float() / by).to(FP8), {"k_scale": arg, "v_scale": arg}


def paged(lens, page, hk, d, dtype, spare=3):
    blocks = max(-(-max(lens) // page), 1) + 1
    pages = sum(-(-n // page) for n in lens) + spare
    table = torch.full((len(lens), blocks), 1 << 30, dtype=torch.int32)
    order = torch.randperm(pages).tolist()
    it = iter(order)
    for b, n in enumerate(lens):
        for j in range(-(-n // page)):
            table[b, j] = next(it)
    k = torch.randn(pages, page, hk, d, device=dev, dtype=dtype)
    return k, torch.randn_like(k), table.to(dev)


def forced(config):
    """The images with ``config`` forced on every decode call."""
    return lib.with_tuning({"attn_decode": [{"config": config, "splits": {"waves": 2, "min_blocks": 1,
                                                                           "max_splits": 64}}]})


def run(name, b=3, hq=8, hk=2, sq=1, d=64, dtype=torch.float16, page=None, lens=(37, 0, 1), new=0, fp8=None,
        config=None, **opts):
    lens_new = [n + new for n in lens]
    if page:
        k, v, table = paged(lens_new, page, hk, d, dtype)
    else:
        cap = max(lens_new) + 5
        k = torch.randn(b, cap, hk, d, device=dev, dtype=dtype)
        v, table = torch.randn_like(k), None
    if fp8:
        if FP8 is None:
            print(f"skip {name}: no fp8 cache variants for {_ARCH}", flush=True)
            return
        k, v, scales = to_fp8(k, v, b, hk, fp8)
        opts = {**opts, **scales}
    images = lib
    if config is not None:
        held = {x.config.index for x in lib.variants_of("attn_decode") if x.spec.get("KV_DTYPE", "").startswith("fp8")}
        if config not in held:
            print(f"skip {name}: the images hold no fp8 decode config #{config}", flush=True)
            return
        images = forced(config)
    alibi, with_sinks = opts.pop("alibi", None), opts.pop("sinks", False)
    if alibi:  # slopes per query head, or per sequence and query head
        opts["alibi_slopes"] = torch.rand(hq, device=dev) if alibi == "head" else torch.rand(b, hq, device=dev)
    if with_sinks:  # one head at -inf: joined as nothing
        opts["sinks"] = torch.randn(hq, device=dev).index_fill_(0, torch.tensor([hq - 1], device=dev), float("-inf"))
    q = torch.randn(b, sq, hq, d, device=dev, dtype=dtype)
    kn = torch.randn(b, new, hk, d, device=dev, dtype=dtype) if new else None
    vn = torch.randn_like(kn) if new else None
    seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
    out, lse = decode_attention(q, k, v, cache_seqlens=seqlens, block_table=table, k_new=kn, v_new=vn,
                                library=images, **opts)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), name
    assert read_faults(library=images) == 0, f"{name}: fault flag set on valid inputs"


RESULTS = []


def case(name, fn, *args, **kwargs):
    """Run one case; record ok or the mismatch (never stop: the summary lists every one)."""
    try:
        fn(name, *args, **kwargs)
        RESULTS.append((name, None))
        print(f"ok   {name}", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported in the summary
        RESULTS.append((name, f"{type(exc).__name__}: {exc}"))
        print(f"FAIL {name}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}", flush=True)


BIG = 10**6


def hostile(name, paged, lens, new=0, changes=None, bits=0, splits=1, terms=False):
    """Sequence 1 is hostile. check=True: refused naming the array; check=False: in bounds (the
    sanitizer says), NaN for sequence 1, finite elsewhere, flag == bits. ``terms``: with ALiBi
    slopes per sequence and sinks (the faulting sequence still answers NaN)."""
    read_faults(library=lib)
    if paged:  # 9 pages of 16 rows, a 3-column table
        k = torch.randn(9, 16, 2, 64, device=dev, dtype=torch.float16)
        table = torch.arange(9, dtype=torch.int32, device=dev).reshape(3, 3)
        for (b, j), page in (changes or {}).items():
            table[b, j] = page
    else:
        k, table = torch.randn(3, 48, 2, 64, device=dev, dtype=torch.float16), None
    v = torch.randn_like(k)
    q = torch.randn(3, 1, 8, 64, device=dev, dtype=torch.float16)
    kn = torch.randn(3, new, 2, 64, device=dev, dtype=torch.float16) if new else None
    vn = torch.randn_like(kn) if new else None
    lens_d = torch.tensor(lens, dtype=torch.int32, device=dev)
    args = {"cache_seqlens": lens_d, "block_table": table, "k_new": kn, "v_new": vn, "num_splits": splits,
            "library": lib}
    if terms:
        args.update(alibi_slopes=torch.rand(3, 8, device=dev), sinks=torch.randn(8, device=dev))
    want = "block_table[1," if bits == FAULT_PAGE else "cache_seqlens[1]"
    try:
        decode_attention(q, k, v, check=True, **args)
    except ArgumentError as e:
        if want not in str(e):
            raise AssertionError(f"check=True refused without naming {want}: {e}") from None
    else:
        raise AssertionError("check=True did not refuse")
    out, lse = decode_attention(q, k, v, check=False, **args)
    torch.cuda.synchronize()
    got = read_faults(library=lib)
    assert got == bits, f"fault bits {got}, expected {bits}"
    assert out[1].isnan().all() and lse[1].isnan().all(), "the hostile sequence does not answer NaN"
    assert out[0].isfinite().all() and out[2].isfinite().all(), "a good sequence is not finite"


def host_refusal(name, paged, new):
    """Lengths on the host (an int, a CPU tensor) past capacity (48 rows): refused before launch
    naming block_table / k_cache; exactly at capacity runs, in range."""
    k = torch.randn(9, 16, 2, 64, device=dev, dtype=torch.float16) if paged else \
        torch.randn(3, 48, 2, 64, device=dev, dtype=torch.float16)
    table = torch.arange(9, dtype=torch.int32, device=dev).reshape(3, 3) if paged else None
    q = torch.randn(3, 1, 8, 64, device=dev, dtype=torch.float16)
    kn = torch.randn(3, new, 2, 64, device=dev, dtype=torch.float16) if new else None
    args = {"block_table": table, "k_new": kn, "v_new": kn, "library": lib}
    at = 48 - new
    for make in (int, lambda n: torch.tensor([n, 0, 0], dtype=torch.int32)):
        try:
            decode_attention(q, k, torch.randn_like(k), cache_seqlens=make(at + 1), **args)
        except ArgumentError as e:
            assert ("block_table" if paged else "k_cache") in str(e), str(e)
        else:
            raise AssertionError(f"cache_seqlens {at + 1} + {new} rows past capacity 48 ran")
        out, _ = decode_attention(q, k, torch.randn_like(k), cache_seqlens=make(at), **args)
        torch.cuda.synchronize()
        assert out.isfinite().all() and read_faults(library=lib) == 0, "exactly at capacity"


case("contiguous, one split", run, num_splits=1)
case("contiguous, forced splits", run, num_splits=5, lens=(300, 0, 129))
case("paged 16, random table", run, page=16, lens=(33, 1, 16), num_splits=3)
case("paged 48, append across page edges", run, page=48, lens=(47, 95, 0), new=3, sq=3, causal=True)
case("speculative 16 rows, group 4 (two row blocks)", run, sq=16, page=16, lens=(70, 20, 16), causal=True, num_splits=2)
case("sliding window", run, page=16, sq=2, lens=(200, 3, 64), causal=True, window=(31, 0))
case("head dim 80", run, d=80, lens=(100, 7, 1))
case("head dim 128 bf16 paged", run, d=128, dtype=torch.bfloat16, page=32, lens=(500, 65, 2), causal=True)
case("paged 64, one table entry per key block", run, d=128, dtype=torch.bfloat16, page=64, lens=(700, 63, 0), new=2,
    causal=True, num_splits=4)
case("paged 256, seven splits merged by the combine kernel", run, d=128, dtype=torch.bfloat16, page=256,
     lens=(3000, 1, 255), hq=32, hk=8, num_splits=7)
for _ in range(2):  # again: the prepared launches
    case("paged 16, six splits, prepared launch", run, page=16, lens=(900, 1, 17), num_splits=6)
case("fp32", run, dtype=torch.float32, lens=(60, 0, 9), num_splits=2)
case("softcap, paged 16, splits, window", run, page=16, sq=2, lens=(200, 3, 64), causal=True, window=(31, 0),
     num_splits=3, softcap=30.0)
case("softcap, head dim 128 bf16 contiguous, append", run, d=128, dtype=torch.bfloat16, lens=(500, 0, 2), new=2,
     softcap=50.0)
case("alibi per head, paged 16, splits, window", run, page=16, sq=2, lens=(200, 3, 64), causal=True,
     window=(31, 0), num_splits=3, alibi="head")
case("alibi per sequence, head dim 128 bf16 contiguous, append, one split", run, d=128, dtype=torch.bfloat16,
     lens=(500, 0, 2), new=2, alibi="batch", num_splits=1)
case("alibi, 16-row chunk, group 4, paged 48", run, sq=16, page=48, lens=(70, 20, 16), causal=True, alibi="batch",
     num_splits=2)
case("sinks in the epilogue, paged 64, one split", run, d=128, dtype=torch.bfloat16, page=64, lens=(700, 63, 0),
     sinks=True, num_splits=1)
case("sinks in the combine, seven splits, alibi", run, d=128, dtype=torch.bfloat16, page=256, lens=(3000, 1, 255),
     hq=32, hk=8, num_splits=7, sinks=True, alibi="head")
case("sinks, fp8 cache, per-head scales, splits", run, d=128, dtype=torch.bfloat16, lens=(900, 0, 37), fp8="head",
     num_splits=4, sinks=True)
case("alibi and sinks, 160-row run", run, d=128, dtype=torch.bfloat16, page=16, lens=(300, 0, 5), sq=160, hq=16,
     hk=4, causal=True, alibi="batch", sinks=True)


def clamped(name):
    k, v, table = paged([40, 10], 16, 2, 64, torch.float16)
    q = torch.randn(2, 1, 4, 64, device=dev, dtype=torch.float16)
    out, _ = decode_attention(q, k, v, cache_seqlens=torch.tensor([40, 1 << 20], dtype=torch.int32, device=dev),
                              block_table=table, check=False, library=lib)
    torch.cuda.synchronize()
    # Clamped to the table's 64 rows, it also reaches the table's unused (out-of-range) entries.
    bits = read_faults(library=lib)
    assert out[1].isnan().all() and out[0].isfinite().all() and bits == FAULT_LENGTH | FAULT_PAGE, bits


def attention_route(name):
    q = torch.randn(4, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    kk = torch.randn(4, 8, 777, 128, device=dev, dtype=torch.bfloat16)
    aotriton_rt.attention(q, kk, kk, causal=True, align="bottom_right", library=lib)
    torch.cuda.synchronize()


case("fp8 cache, per-head scales, contiguous, splits", run, d=128, dtype=torch.bfloat16, lens=(900, 0, 37),
     fp8="head", num_splits=4)
case("fp8 cache, per-sequence scales, paged 16, append across pages", run, d=128, dtype=torch.bfloat16, page=16,
     lens=(47, 15, 0), new=3, sq=3, causal=True, fp8="batch_head", num_splits=2)
case("fp8 cache, float scales, paged 64, fp16, head dim 64", run, page=64, lens=(130, 63, 1), new=1,
     fp8="float", causal=True)
case("fp8 cache, masked head dim 96, paged 48, window", run, d=96, dtype=torch.float16, page=48, lens=(200, 3, 96),
     new=1, sq=2, causal=True, window=(31, 0), fp8="head", num_splits=3)
case("fp8 cache, 160-row run on the decode kernels", run, d=128, dtype=torch.bfloat16, page=16, lens=(300, 0, 5),
     sq=160, new=0, hq=16, hk=4, causal=True, fp8="head")
for config in (4, 6, 7):  # V read in 4-byte words (#6: #5's deeper ring; #7: 128-key blocks)
    case(f"fp8 cache, config #{config}, paged 16, per-sequence scales, append across pages", run, d=128,
         dtype=torch.bfloat16, page=16, lens=(47, 15, 0), new=3, sq=3, causal=True, fp8="batch_head", num_splits=2,
         config=config)
    case(f"fp8 cache, config #{config}, contiguous, fp16, head dim 64, window", run, lens=(301, 1, 77), new=1,
         fp8="head", window=(40, 0), causal=True, config=config)
case("lengths past the block table are clamped", clamped)
case("attention() route", attention_route)
for splits in (1, 3):
    case(f"hostile: page 10**6 in a 3-column table, splits {splits}", hostile, True, [40, 30, 5],
         changes={(1, 1): BIG}, bits=FAULT_PAGE, splits=splits)
    case(f"hostile: negative page, splits {splits}", hostile, True, [40, 30, 5], changes={(1, 0): -5},
         bits=FAULT_PAGE, splits=splits)
    case(f"hostile: length past the table, splits {splits}", hostile, True, [40, 55, 5], bits=FAULT_LENGTH,
         splits=splits)
    case(f"hostile: negative length, splits {splits}", hostile, True, [40, -3, 5], bits=FAULT_LENGTH, splits=splits)
    case(f"hostile: length near the int32 limit + append, splits {splits}", hostile, True, [40, 2**31 - 2, 5],
         new=2, bits=FAULT_LENGTH, splits=splits)
    case(f"hostile: append through a page past the cache, splits {splits}", hostile, True, [20, 15, 5], new=2,
         changes={(1, 1): BIG}, bits=FAULT_PAGE, splits=splits)
    case(f"hostile: append through a negative page, splits {splits}", hostile, True, [20, 31, 5], new=2,
         changes={(1, 1): -1}, bits=FAULT_PAGE, splits=splits)
    case(f"hostile: contiguous length past the cache + append, splits {splits}", hostile, False, [20, 47, 5],
         new=2, bits=FAULT_LENGTH, splits=splits)
    case(f"hostile: contiguous negative length, splits {splits}", hostile, False, [40, -1, 5], bits=FAULT_LENGTH,
         splits=splits)
    case(f"hostile: page 10**6 with alibi and sinks, splits {splits}", hostile, True, [40, 30, 5],
         changes={(1, 1): BIG}, bits=FAULT_PAGE, splits=splits, terms=True)
for paged_cache in (True, False):
    for rows in (0, 5):
        case(f"host lengths past capacity refused, at capacity run ({'paged' if paged_cache else 'contiguous'}, "
             f"{rows} appended)", host_refusal, paged_cache, rows)

failed = [(n, why) for n, why in RESULTS if why]
print(f"\nmemcheck_decode: {len(RESULTS) - len(failed)} of {len(RESULTS)} cases as expected")
for n, why in failed:
    print(f"  FAILED {n}: {why}")
sys.exit(1 if failed else 0)
