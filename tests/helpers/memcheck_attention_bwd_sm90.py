"""The Gluon sm90 dK/dV kernel under compute-sanitizer (not collected by pytest).

    PYTHONPATH=. AOTRITON_RT_IMAGES=DIR \\
        compute-sanitizer --tool memcheck --error-exitcode 9 python tests/helpers/memcheck_attention_bwd_sm90.py

Every attn_bwd_dkdv_sm90 variant of the images (build them with `python -m builder build --set gputest
--targets sm90 --kernels attn_fwd,attn_bwd_preprocess,attn_bwd_dkdv,attn_bwd_dq,attn_bwd_dkdv_sm90`)
runs the whole split backward through the operator (forced onto it) on small odd sizes: a key block
past the last key, query tiles past the last query, empty rows (bottom-right band with seqlen_q >
seqlen_k), GQA, one-element sequences. Inputs are exact-size allocations, so a read or write past a
tensor is an out-of-bounds access.
"""

import math
import os

import torch

import aotriton_rt
from builder.tune import ForcedConfig

lib = aotriton_rt.Library(os.environ["AOTRITON_RT_IMAGES"])
variants = lib.variants_of("attn_bwd_dkdv_sm90")
assert variants, "no attn_bwd_dkdv_sm90 in these images"
for v in variants:
    D, causal = v.spec["HEAD_DIM"], v.spec["CAUSAL"]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[v.spec["dtype"]]
    view = ForcedConfig(lib, "attn_bwd_dkdv_sm90", v.config.index)
    options = {"causal": bool(causal), "align": "bottom_right" if causal == 2 else "top_left",
               "scale": 1 / math.sqrt(D)}
    for B, Hq, Hk, Sq, Sk in ((2, 4, 2, 67, 93), (1, 2, 2, 200, 129), (1, 1, 1, 1, 1)):
        q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, Hk, Sk, D, device="cuda", dtype=dtype)
        vv = torch.randn(B, Hk, Sk, D, device="cuda", dtype=dtype)
        do = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype)
        out, lse = aotriton_rt.attention(q, k, vv, library=lib, **options)
        dq, dk, dv, _ = aotriton_rt.attention_backward(do, q, k, vv, out, lse, deterministic=True, library=view,
                                                       **options)
        torch.cuda.synchronize()
        assert not (dk.isnan().any() or dv.isnan().any()), f"NaN dK/dV {v.spec} #{v.config.index} {(B, Hq, Sq, Sk)}"
    print(f"ok {v.spec['dtype']} D{D} causal{causal} #{v.config.index}", flush=True)
