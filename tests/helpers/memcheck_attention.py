"""A representative attention subset to run under compute-sanitizer (not collected by pytest).

    compute-sanitizer --tool memcheck --error-exitcode 9 python tests/helpers/memcheck_attention.py

Forward and backward through the operator for: plain, causal (both alignments) with
seqlen_q != seqlen_k, sliding window, bias broadcast over heads, dropout, GQA, varlen, a head
dim that is not a power of two, BSHD strides, fp32. Sizes are small and odd so that every
boundary path runs. Needs images with the gputest set (AOTRITON_RT_IMAGES).
"""

import torch

from aotriton_rt.ops.attention import attention, attention_backward

torch.manual_seed(0)
dev = "cuda"


def run(name, b=2, hq=4, hk=4, sq=67, sk=93, d=64, dv=None, dtype=torch.float16, layout="bhsd", **opts):
    shape = (lambda s, h, d: (b, h, s, d)) if layout == "bhsd" else (lambda s, h, d: (b, s, h, d))
    q = torch.randn(shape(sq, hq, d), device=dev, dtype=dtype)
    k = torch.randn(shape(sk, hk, d), device=dev, dtype=dtype)
    v = torch.randn(shape(sk, hk, dv or d), device=dev, dtype=dtype)
    out, lse = attention(q, k, v, layout=layout, **opts)
    dq, dk, dv, dbias = attention_backward(torch.randn_like(out), q, k, v, out, lse, layout=layout, **opts)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(dq).all(), name
    print(f"ok {name}")


run("plain")
run("causal top-left", causal=True)
run("causal bottom-right", causal=True, align="bottom_right")
run("window", window=(16, 8))
run("bias over heads", bias=torch.randn(2, 1, 67, 93, device=dev, dtype=torch.float16))
run("dropout", dropout_p=0.2, seed=1234)
run("gqa", hq=8, hk=2)
run("head dim 80", d=80, dtype=torch.bfloat16, causal=True, align="bottom_right")
run("head dim 40 padded to 48, bias", d=40, bias=torch.randn(2, 4, 67, 93, device=dev, dtype=torch.float16))
run("head dims 192/128", d=192, dv=128)
run("bshd", layout="bshd")
run("head dim 128 (sm90: 8-warp 128x128 TMA tile)", d=128)
run("head dim 128 bshd, bf16, causal (sm90: paired 4-warp TMA tile)", d=128, layout="bshd", dtype=torch.bfloat16,
    causal=True, align="bottom_right")
run("fp32", dtype=torch.float32)
cu = torch.tensor([0, 31, 67], device=dev, dtype=torch.int32)
q = torch.randn(67, 4, 64, device=dev, dtype=torch.float16)
out, lse = attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=36, max_seqlen_k=36)
attention_backward(torch.randn_like(out), q, q, q, out, lse, cu_seqlens_q=cu, cu_seqlens_k=cu,
                   max_seqlen_q=36, max_seqlen_k=36)
torch.cuda.synchronize()
print("ok varlen")
