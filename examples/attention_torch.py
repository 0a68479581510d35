"""Attention in a torch training loop: forward, backward, checked against SDPA in fp32.

A causal self-attention block with grouped-query heads (8 query heads, 2 key/value heads of 64)
runs a few SGD steps. The projections produce (batch, seqlen, heads, dim) tensors, which the
operator reads in place (layout="bshd"); autograd carries the gradients through the
``aotriton_rt::attention_fwd`` custom op. Each step compares the attention output and the
gradients reaching q, k and v with torch's math SDPA on the same inputs in fp32.

Needs a CUDA GPU and images with the default set (AOTRITON_RT_IMAGES, or the default search):
    python -m builder build --set default --targets sm90
    python examples/attention_torch.py
"""

import torch

import aotriton_rt.ops.attention
from aotriton_rt.ops.torch import attention

torch.manual_seed(0)
B, S, E, HQ, HK, D = 4, 509, 512, 8, 2, 64  # 509 keys: not a multiple of any block size
dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
q_proj = torch.nn.Linear(E, HQ * D, device="cuda", dtype=dtype)
kv_proj = torch.nn.Linear(E, 2 * HK * D, device="cuda", dtype=dtype)
o_proj = torch.nn.Linear(HQ * D, E, device="cuda", dtype=dtype)
params = [*q_proj.parameters(), *kv_proj.parameters(), *o_proj.parameters()]
optimizer = torch.optim.SGD(params, lr=0.05)
x = torch.randn(B, S, E, device="cuda", dtype=dtype)
target = torch.randn(B, S, E, device="cuda", dtype=dtype)


def sdpa_fp32(q, k, v):
    """torch's math SDPA in fp32 on BSHD tensors (GQA by repeating the key/value heads)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    k, v = k.repeat_interleave(HQ // HK, 1), v.repeat_interleave(HQ // HK, 1)
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


worst = 0.0
for step in range(5):
    optimizer.zero_grad()
    q = q_proj(x).view(B, S, HQ, D)
    k, v = kv_proj(x).view(B, S, 2, HK, D).unbind(2)
    # Leaves for the check; gradients continue into the projections below.
    ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(ql, kl, vl, causal=True, layout="bshd")
    out.retain_grad()  # the gradient reaching the attention output drives the reference's backward
    loss = torch.nn.functional.mse_loss(o_proj(out.reshape(B, S, HQ * D)).float(), target.float())
    loss.backward()

    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = sdpa_fp32(qr, kr, vr)
    ref.backward(out.grad.float())
    errors = {"out": (out.float() - ref).abs().max().item() / ref.abs().max().item()}
    for name, ours, theirs in (("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad), ("dv", vl.grad, vr.grad)):
        errors[name] = (ours.float() - theirs).abs().max().item() / theirs.abs().max().item()
    worst = max(worst, *errors.values())
    print(f"step {step}: loss {loss.item():.5f}; max error vs fp32 SDPA (relative to max |ref|): "
          + ", ".join(f"{k} {e:.2e}" for k, e in errors.items()))

    torch.autograd.backward((q, k, v), (ql.grad, kl.grad, vl.grad))
    optimizer.step()

fwd = aotriton_rt.ops.attention.attention_kernels(ql, kl, vl, causal=True, layout="bshd")["attn_fwd"]
variant = fwd.variant(torch.cuda.current_device())
print(f"{dtype} on {torch.cuda.get_device_name()}: attn_fwd {variant.spec}, config #{variant.config.index} "
      f"{variant.config.constexprs}")
limit = 3e-2 if dtype == torch.bfloat16 else 5e-3
assert worst < limit, f"max relative error {worst:.2e} exceeds {limit}"
print(f"torch: attention matches fp32 SDPA (worst {worst:.2e} < {limit})")
