"""A Hugging Face Llama generating through aotriton-rt (transformers' attention interface).

``aotriton_rt.integrations.transformers.register()`` adds the "aotriton" attention
implementation (with SDPA's mask handling); the model then prefills through the FlashAttention
kernels and decodes through the split-KV decode kernels (one query row per step, routed by
``aotriton_rt.attention``). A small randomly initialised model (no download) generates greedily
next to SDPA, and the two generations are compared.

Needs a CUDA GPU, transformers, and images with the default set:
    python -m builder build --set default --targets sm90
    python examples/transformers_llama.py
"""

import time

import torch
import transformers

import aotriton_rt.integrations.transformers as aotriton_hf

name = aotriton_hf.register()
config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                  num_attention_heads=16, num_key_value_heads=4, head_dim=64, pad_token_id=0)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
prompt = torch.randint(3, 32000, (4, 256), device="cuda")
kw = {"max_new_tokens": 64, "do_sample": False, "attention_mask": torch.ones_like(prompt), "pad_token_id": 0}
results = {}
for impl in ("sdpa", name):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        model.generate(prompt, **{**kw, "max_new_tokens": 4})  # warm up
        torch.cuda.synchronize()
        t = time.perf_counter()
        results[impl] = model.generate(prompt, **kw)[:, prompt.shape[1]:]
        torch.cuda.synchronize()
    print(f"{impl:>8}: {time.perf_counter() - t:.3f} s for 4 x 64 tokens")
same = (results[name] == results["sdpa"]).float().mean().item()
print(f"greedy tokens equal to SDPA's: {same * 100:.1f}%")
