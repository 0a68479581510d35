"""The Gluon sm90 forward under compute-sanitizer (not collected by pytest).

    AOTRITON_RT_IMAGES=.gpu-images/sm90-gluon-test \\
        compute-sanitizer --tool memcheck --error-exitcode 9 python tests/helpers/memcheck_attention_sm90.py

(`--persistent` after the script: only the persistent configs, PERSISTENT > 0.)

Every attn_fwd_sm90 variant of the images (build them with `python -m builder build --set gputest
--kernels attn_fwd_sm90 --targets sm90`) on small odd sizes: a tile past the last query row,
key blocks past the sequence end, empty rows (bottom-right band with seqlen_q > seqlen_k), GQA,
more tiles than a persistent config's programs.
Inputs are exact-size allocations, so a read or write past a tensor is an out-of-bounds access.
"""

import math
import os
import sys

import torch

import aotriton_rt

lib = aotriton_rt.Library(os.environ["AOTRITON_RT_IMAGES"])
variants = lib.variants_of("attn_fwd_sm90")
if "--persistent" in sys.argv[1:]:  # only the persistent configs (PERSISTENT > 0)
    variants = [v for v in variants if v.config.constexprs.get("PERSISTENT", 0) > 0]
assert variants, "no attn_fwd_sm90 in these images"
for v in variants:
    D, causal = v.spec["HEAD_DIM"], v.spec["CAUSAL"]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[v.spec["dtype"]]
    handle = lib.kernel("attn_fwd_sm90", **v.spec, **v.config.constexprs, num_warps=v.config.num_warps,
                        num_stages=v.config.num_stages)
    # The last size has more query tiles (300) and causal units (150) than a persistent config's
    # 132 programs: its programs loop over tiles.
    for B, Hq, Hk, Sq, Sk in ((2, 4, 2, 67, 93), (1, 2, 2, 200, 129), (1, 1, 1, 1, 1), (5, 20, 4, 300, 257)):
        q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, Hk, Sk, D, device="cuda", dtype=dtype)
        vv = torch.randn(B, Hk, Sk, D, device="cuda", dtype=dtype)
        out = torch.empty_like(q)
        lse = torch.empty(B, Hq, Sq, device="cuda")
        for align in (0, 1) if causal == 1 else (0,):  # mode 1: top-left and bottom-right bands
            handle(q, k, vv, None, out, lse, None, None, None, *q.stride()[:3], *k.stride()[:3], *vv.stride()[:3],
                   *out.stride()[:3], 0, 0, 0, *lse.stride()[:2], 0, 0, 0, B, Hq, Hk, Sq, Sk, 1 / math.sqrt(D),
                   0.0, 0, 0, -1, 0 if causal else -1, align,
                   2.0 if v.spec.get("SOFTCAP") else 0.0, None, 0)  # softcap; no ALiBi
            torch.cuda.synchronize()
            assert not out.isnan().any(), f"NaN output {v.spec} #{v.config.index} {(B, Hq, Hk, Sq, Sk)} align {align}"
    print(f"ok {v.spec['dtype']} D{D} causal{causal} #{v.config.index}", flush=True)
