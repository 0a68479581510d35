"""Token-by-token decoding with a paged KV cache, checked against SDPA in fp32.

Eight sequences of different prompt lengths share one pool of 16-row pages; each step appends
the new token's key/value to the cache and attends to the whole sequence in one call
(``decode_attention(..., k_new=, v_new=)``), with 32 query heads on 8 key/value heads (GQA
4:1). The step is captured once in a CUDA graph and replayed: lengths live on the device, so
the same graph serves every step. Each step compares with SDPA over the dense history.

Needs a CUDA GPU and images with the default set (AOTRITON_RT_IMAGES, or the default search):
    python -m builder build --set default --targets sm90
    python examples/decode_torch.py
"""

import torch

from aotriton_rt.ops.torch_decode import decode_attention

torch.manual_seed(0)
B, HQ, HK, D, PAGE, STEPS = 8, 32, 8, 128, 16, 20
dtype = torch.bfloat16
prompts = [17, 300, 1, 64, 65, 1000, 5, 250]
max_len = max(prompts) + STEPS
blocks = -(-max_len // PAGE)
pages = B * blocks
# The pool and a shuffled block table (pages of one sequence are scattered).
k_cache = torch.zeros(pages, PAGE, HK, D, device="cuda", dtype=dtype)
v_cache = torch.zeros_like(k_cache)
block_table = torch.randperm(pages, device="cuda").view(B, blocks).to(torch.int32)
history_k = [torch.randn(n, HK, D, device="cuda", dtype=dtype) for n in prompts]
history_v = [torch.randn(n, HK, D, device="cuda", dtype=dtype) for n in prompts]
for b, n in enumerate(prompts):  # prefill the cache (a real model writes it during prefill)
    rows = torch.arange(n, device="cuda")
    page = block_table[b, rows // PAGE].long()
    k_cache[page, rows % PAGE] = history_k[b]
    v_cache[page, rows % PAGE] = history_v[b]
lengths = torch.tensor(prompts, dtype=torch.int32, device="cuda")
q = torch.empty(B, 1, HQ, D, device="cuda", dtype=dtype)
k_new = torch.empty(B, 1, HK, D, device="cuda", dtype=dtype)
v_new = torch.empty_like(k_new)


def step():
    return decode_attention(q, k_cache, v_cache, cache_seqlens=lengths, block_table=block_table, k_new=k_new,
                            v_new=v_new, causal=True)


for t in (q, k_new, v_new):
    t.normal_()
step()  # compiles nothing (ahead of time); warms the launch plan up
lengths.copy_(torch.tensor(prompts, dtype=torch.int32))
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = step()

worst = 0.0
for _ in range(STEPS):
    for t in (q, k_new, v_new):
        t.normal_()
    graph.replay()
    for b in range(B):
        history_k[b] = torch.cat([history_k[b], k_new[b]])
        history_v[b] = torch.cat([history_v[b], v_new[b]])
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b].transpose(0, 1).float(), history_k[b].transpose(0, 1).float(),
            history_v[b].transpose(0, 1).float(), enable_gqa=True).transpose(0, 1)
        worst = max(worst, (out[b].float() - ref).abs().max().item())
    lengths += 1
torch.cuda.synchronize()
print(f"{STEPS} decode steps of {B} sequences replayed from one CUDA graph; max |out - SDPA fp32| = {worst:.2e}")
assert worst < 2e-2
