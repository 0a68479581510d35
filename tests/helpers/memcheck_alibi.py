"""The ALiBi attention kernels under compute-sanitizer (not collected by pytest).

    AOTRITON_RT_IMAGES=DIR compute-sanitizer --tool memcheck --error-exitcode 9 \\
        python tests/helpers/memcheck_alibi.py

DIR holds the gputest set's attention kernels (`python -m builder build --set gputest --kernels
attn_fwd,attn_bwd_preprocess,attn_bwd_dkdv,attn_bwd_dq,attn_bwd_dq_convert --targets sm90`).
Forward and backward with slopes per head and per sequence, through the operator, on exact-size
arrays (a read past the slopes, a sequence or a row is an out-of-bounds access): odd lengths,
more queries than keys (rows that see no key), GQA, packed sequences, the atomic-dQ scheme.
"""

import os

import torch

import aotriton_rt

lib = aotriton_rt.Library(os.environ["AOTRITON_RT_IMAGES"])
dev = "cuda"


def dense(name, B, Hq, Hk, Sq, Sk, D, dtype, per_batch, scheme=None, **options):
    q = torch.randn(B, Hq, Sq, D, device=dev, dtype=dtype)
    k, v = (torch.randn(B, Hk, Sk, D, device=dev, dtype=dtype) for _ in range(2))
    slopes = torch.rand((B, Hq) if per_batch else (Hq,), device=dev)
    out, lse = aotriton_rt.attention(q, k, v, alibi_slopes=slopes, library=lib, **options)[:2]
    grads = aotriton_rt.attention_backward(torch.randn_like(out), q, k, v, out, lse, alibi_slopes=slopes,
                                           library=lib, scheme=scheme, **options)
    torch.cuda.synchronize()
    assert all(g.isfinite().all() for g in grads[:3]), name
    print("ok", name, flush=True)


def packed(name, lens, Hq, Hk, D, dtype, **options):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, Hq, D, device=dev, dtype=dtype)
    k, v = (torch.randn(total, Hk, D, device=dev, dtype=dtype) for _ in range(2))
    slopes = torch.rand(Hq, device=dev)
    opts = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max(lens), "max_seqlen_k": max(lens), **options}
    out, lse = aotriton_rt.attention(q, k, v, alibi_slopes=slopes, library=lib, **opts)[:2]
    grads = aotriton_rt.attention_backward(torch.randn_like(out), q, k, v, out, lse, alibi_slopes=slopes,
                                           library=lib, **opts)
    torch.cuda.synchronize()
    assert all(g.isfinite().all() for g in grads[:3]), name
    print("ok", name, flush=True)


for dtype in (torch.float16, torch.bfloat16):
    for D in (64, 128):
        dense(f"{dtype} D{D} no mask, Sq > Sk, per batch", 2, 4, 2, 97, 61, D, dtype, True)
        dense(f"{dtype} D{D} causal bottom-right, Sq < Sk, GQA", 3, 6, 2, 45, 130, D, dtype, False,
              causal=True, align="bottom_right")
        dense(f"{dtype} D{D} causal bottom-right, Sq > Sk: rows without keys", 1, 2, 1, 70, 33, D, dtype, True,
              causal=True, align="bottom_right")
        dense(f"{dtype} D{D} window top-left", 2, 2, 2, 50, 81, D, dtype, False, window=(9, 4))
        packed(f"{dtype} D{D} packed causal", [37, 1, 90], 4, 2, D, dtype, causal=True, align="bottom_right")
dense("fp16 D64 atomic dQ, causal", 2, 4, 2, 77, 77, 64, torch.float16, False, causal=True, scheme="atomic")
print("all ALiBi memcheck cases ran", flush=True)
