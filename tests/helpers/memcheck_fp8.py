"""The FP8 attention forward under compute-sanitizer (not collected by pytest).

    PYTHONPATH=. AOTRITON_RT_IMAGES=DIR compute-sanitizer --tool memcheck --error-exitcode 9 \\
        python tests/helpers/memcheck_fp8.py

DIR holds the gputest set's FP8 kernels (`python -m builder build --set gputest --kernels
attn_fwd_fp8,attn_fwd_fp8_sm90,attn_fp8_v_transpose --targets sm90`). Through the operator, on
exact-size arrays (a read past a sequence, a row, the head dim or a descale array is an
out-of-bounds access): odd lengths, more queries than keys (rows that see no key), GQA and MQA, a
head dim padded onto its bucket, per-head and per-tensor descales, both output dtypes, packed
sequences (one with no keys). The dense cases run twice where the images hold sm90's Gluon
``attn_fwd_fp8_sm90``: on it (the dispatch's choice; bottom-right calls on its mask mode 2) and on
the portable ``attn_fwd_fp8`` (the Gluon kernel hidden); packed sequences run the portable one.
"""

import os

import torch

import aotriton_rt
from aotriton_rt.ops.attention import explain
from builder.tune import without_kernel

# The Gluon FP8 forward runs by default; kept on here even where the environment turns it off ("0").
os.environ["AOTRITON_RT_FP8_SM90"] = "1"
GLUON = "attn_fwd_fp8_sm90"
held = aotriton_rt.Library(os.environ["AOTRITON_RT_IMAGES"])
# The portable kernel first, then (where the images hold it) the Gluon one.
libraries = [without_kernel(held, GLUON)] + ([held] if held.variants_of(GLUON) else [])
lib = libraries[0]
dev = "cuda"
fp8 = torch.float8_e4m3fn


def dense(name, B, Hq, Hk, Sq, Sk, D, out_dtype, per_head, **options):
    for library in libraries:
        _dense(name, B, Hq, Hk, Sq, Sk, D, out_dtype, per_head, library, **options)


def _dense(name, B, Hq, Hk, Sq, Sk, D, out_dtype, per_head, library, **options):
    q = torch.randn(B, Hq, Sq, D, device=dev).to(fp8)
    k, v = (torch.randn(B, Hk, Sk, D, device=dev).to(fp8) for _ in range(2))
    scales = [torch.rand(B, Hk, device=dev) + 0.5 for _ in range(3)] if per_head else [0.5, 0.25, 2.0]
    out, lse = aotriton_rt.attention(q, k, v, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2],
                                     out_dtype=out_dtype, library=library, **options)
    torch.cuda.synchronize()
    assert out.isfinite().all(), name
    band = options.get("causal", False) or options.get("window") is not None  # a window runs the band's modes
    ran = explain(dtype="fp8e4nv", head_dim=D, seqlen_q=Sq, seqlen_k=Sk, causal=band,
                  align=options.get("align", "top_left"), out_dtype=out_dtype, library=library).kernels[-1]
    print("ok", name, f"({ran.kernel}, mask mode {ran.spec['CAUSAL']})", flush=True)


def packed(name, lens, Hq, Hk, D, out_dtype, **options):
    cu_q = torch.tensor([0, *torch.tensor([a for a, _ in lens]).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([b for _, b in lens]).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), Hq, D, device=dev).to(fp8)
    k, v = (torch.randn(int(cu_k[-1]), Hk, D, device=dev).to(fp8) for _ in range(2))
    scales = [torch.rand(len(lens), Hk, device=dev) + 0.5 for _ in range(3)]
    out, lse = aotriton_rt.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     max_seqlen_q=max(a for a, _ in lens), max_seqlen_k=max(b for _, b in lens),
                                     q_descale=scales[0], k_descale=scales[1], v_descale=scales[2],
                                     out_dtype=out_dtype, library=lib, **options)
    torch.cuda.synchronize()
    assert out.isfinite().all(), name
    print("ok", name, flush=True)


for out_dtype in ("bf16", "fp16"):
    for D in (64, 128):
        dense(f"{out_dtype} D{D} no mask, Sq > Sk, per head", 2, 4, 2, 97, 61, D, out_dtype, True)
        dense(f"{out_dtype} D{D} causal bottom-right, Sq < Sk, GQA", 3, 6, 2, 45, 130, D, out_dtype, False,
              causal=True, align="bottom_right")
        dense(f"{out_dtype} D{D} causal bottom-right, Sq > Sk: rows without keys", 1, 2, 1, 70, 33, D, out_dtype,
              True, causal=True, align="bottom_right")
        dense(f"{out_dtype} D{D} window top-left", 2, 2, 2, 50, 81, D, out_dtype, False, window=(9, 4))
        packed(f"{out_dtype} D{D} packed causal", [(37, 37), (1, 1), (90, 120), (5, 0)], 4, 2, D, out_dtype,
               causal=True, align="bottom_right")
dense("bf16 D80 padded onto 128, causal", 2, 4, 2, 77, 77, 80, "bf16", True, causal=True)
print("all FP8 memcheck cases ran", flush=True)
