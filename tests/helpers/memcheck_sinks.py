"""The attention-sinks kernels under compute-sanitizer (not collected by pytest).

    AOTRITON_RT_IMAGES=DIR compute-sanitizer --tool memcheck --error-exitcode 9 \\
        python tests/helpers/memcheck_sinks.py

``attn_sinks`` and ``attn_sinks_bwd`` through the public calls: dense bhsd and bshd with odd
lengths and head dims 64 and 128 (with a view whose rows are strided), packed batches with an
empty sequence and spare rows past the last one, and hostile ``cu_seqlens_q`` (negative, past
the arrays), which the kernels must clamp; decode with sinks on contiguous and paged caches.
Prints one line per case; exits 1 when a case's output is not finite where it must be.
"""

import os
import sys

import torch

import aotriton_rt
from aotriton_rt.ops.attention import sinks as sinks_mod

lib = aotriton_rt.Library(os.environ["AOTRITON_RT_IMAGES"]) if os.environ.get("AOTRITON_RT_IMAGES") else None
torch.manual_seed(0)
bad = []


def case(name, fn):
    try:
        ok = fn()
    except Exception as e:  # noqa: BLE001 - reported per case
        ok = False
        print(f"{name}: {type(e).__name__}: {e}")
    print(f"{name}: {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        bad.append(name)


def dense(layout, d, s):
    def run():
        shape = (2, 4, s, d) if layout == "bhsd" else (2, s, 4, d)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        sinks = torch.randn(4, device="cuda")
        out, lse = aotriton_rt.attention(q, k, v, causal=True, layout=layout, sinks=sinks, library=lib)
        dq, dk, dv, _, ds = aotriton_rt.attention_backward(torch.randn_like(out), q, k, v, out, lse, causal=True,
                                                           layout=layout, sinks=sinks, library=lib)
        torch.cuda.synchronize()
        return bool(torch.isfinite(out).all() and torch.isfinite(ds).all() and torch.isfinite(dq).all())
    return run


def packed(cu, spare, hostile=False):
    def run():
        total = max(cu[-1], 0) if not hostile else 50
        q, k, v = (torch.randn(total + spare, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        sinks = torch.randn(2, device="cuda")
        if hostile:  # the epilogue kernels alone, on a forward's outputs: they clamp to the arrays
            out = torch.randn(total + spare, 2, 64, device="cuda", dtype=torch.float16)
            lse = torch.randn(2, total + spare, device="cuda")
            sinks_mod.apply_sinks(out, lse, sinks, heads_q=2, layout="bhsd", cu_seqlens_q=cu_t, max_seqlen_q=64,
                                  library=lib)
            ds = sinks_mod.sinks_grad(torch.randn_like(out), out, lse, sinks, heads_q=2, layout="bhsd",
                                      cu_seqlens_q=cu_t, max_seqlen_q=64, library=lib)
            torch.cuda.synchronize()
            return bool(torch.isfinite(ds).all())
        lens = [b - a for a, b in zip(cu, cu[1:])]
        kw = {"cu_seqlens_q": cu_t, "cu_seqlens_k": cu_t, "max_seqlen_q": max(lens), "max_seqlen_k": max(lens),
              "causal": True, "library": lib}
        out, lse = aotriton_rt.attention(q[:total], k[:total], v[:total], sinks=sinks, **kw)
        *_, ds = aotriton_rt.attention_backward(torch.randn_like(out), q[:total], k[:total], v[:total], out, lse,
                                                sinks=sinks, **kw)
        torch.cuda.synchronize()
        return bool(torch.isfinite(out).all() and torch.isfinite(ds).all())
    return run


def decode(page):
    def run():
        B, cap, hk, d = 3, 128, 2, 128
        lens = torch.tensor([100, 0, 128], dtype=torch.int32, device="cuda")
        q = torch.randn(B, 2, 8, d, device="cuda", dtype=torch.float16)
        if page:
            k = torch.randn(B * cap // page, page, hk, d, device="cuda", dtype=torch.float16)
            table = torch.randperm(B * cap // page, device="cuda").reshape(B, cap // page).to(torch.int32)
            kw = {"block_table": table}
        else:
            k = torch.randn(B, cap, hk, d, device="cuda", dtype=torch.float16)
            kw = {}
        out, lse = aotriton_rt.decode_attention(q, k, k.clone(), cache_seqlens=lens, causal=True,
                                                sinks=torch.randn(8, device="cuda"), library=lib, **kw)
        torch.cuda.synchronize()
        return bool(torch.isfinite(out).all())
    return run


for layout in ("bhsd", "bshd"):
    for d, s in ((64, 77), (128, 130)):
        case(f"dense {layout} D={d} S={s}", dense(layout, d, s))
case("packed with an empty sequence and spare rows", packed([0, 30, 30, 95], 13))
case("packed, hostile cu_seqlens_q (negative, past the arrays)", packed([-9, 40, 10**6], 7, hostile=True))
case("decode contiguous", decode(0))
case("decode paged", decode(16))
print(f"{len(bad)} of 9 cases failed: {bad}" if bad else "all 9 cases ok")
sys.exit(1 if bad else 0)
