"""The Gluon sm90 backward kernels (dK/dV and dQ) under compute-sanitizer (not collected by pytest).

    PYTHONPATH=. AOTRITON_RT_IMAGES=DIR \\
        compute-sanitizer --tool memcheck --error-exitcode 9 python tests/helpers/memcheck_attention_bwd_sm90.py \\
        [--kernels attn_bwd_dq_sm90] [--configs 0,1]

(``--kernels``/``--configs`` narrow the run: every variant of both kernels under memcheck takes minutes.)

Every attn_bwd_dkdv_sm90, attn_bwd_dkdv_sm90_a16 (the aligned-length sibling, on sizes that are multiples
of 16) and attn_bwd_dq_sm90 variant of the images (build them with `python -m builder
build --set gputest --targets sm90 --kernels
attn_fwd,attn_bwd_preprocess,attn_bwd_dkdv,attn_bwd_dq,attn_bwd_dq_convert,attn_bwd_dkdv_sm90,attn_bwd_dkdv_sm90_a16,
attn_bwd_dq_sm90`)
runs the whole split backward through the operator (forced onto it; the other role keeps the images'
routing, so the other Gluon kernel runs too), and each DQ_ATOMIC=1 dK/dV variant the whole atomic
backward (``scheme="atomic"``: its dQ reductions into DQacc included; ``--atomic only`` runs just
those), on small odd sizes: a key or query block past the last key or
query, empty rows (bottom-right band with seqlen_q > seqlen_k), GQA, one-element sequences; mode-1
variants both top-left and, where this tree can hide mode 2 (builder.tune.without_mask_mode),
bottom-right through causal_align. Inputs are exact-size allocations, so a read or write past a
tensor is an out-of-bounds access.
"""

import argparse
import math
import os

import torch

import aotriton_rt
from aotriton_rt.ops.attention import attention_kernels
from aotriton_rt.ops.attention.family import ALIGNED_SIBLINGS, family_of
from builder import tune

ap = argparse.ArgumentParser()
ap.add_argument("--kernels", default="attn_bwd_dkdv_sm90,attn_bwd_dkdv_sm90_a16,attn_bwd_dq_sm90")
ap.add_argument("--configs", default="", help="comma config indices (default: every config)")
ap.add_argument("--atomic", choices=("yes", "no", "only"), default="yes",
                help="the dK/dV kernel's DQ_ATOMIC=1 variants: run them too (yes), skip them, or run only them")
args = ap.parse_args()
configs = {int(c) for c in args.configs.split(",") if c.strip()}
lib = aotriton_rt.Library(os.environ["AOTRITON_RT_IMAGES"])
hide = getattr(tune, "without_mask_mode", None)
ran = 0
for name in args.kernels.split(","):
    variants = [v for v in lib.variants_of(name) if not configs or v.config.index in configs]
    if args.atomic != "yes":
        variants = [v for v in variants if bool(v.spec.get("DQ_ATOMIC", 0)) == (args.atomic == "only")]
    assert variants, f"no {name} (configs {sorted(configs) or 'all'}, atomic {args.atomic}) in these images"
    # The aligned sibling serves lengths that are multiples of 16 only: its own small sizes.
    aligned = name in ALIGNED_SIBLINGS.values()
    sizes = ((2, 4, 2, 64, 96), (1, 2, 2, 208, 128), (1, 1, 1, 16, 16)) if aligned else \
        ((2, 4, 2, 67, 93), (1, 2, 2, 200, 129), (1, 1, 1, 1, 1))
    for v in variants:
        D, causal = v.spec["HEAD_DIM"], v.spec["CAUSAL"]
        atomic = bool(v.spec.get("DQ_ATOMIC", 0))
        scheme = {"deterministic": False, "scheme": "atomic"} if atomic else {"deterministic": True}
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[v.spec["dtype"]]
        # The aligned sibling follows its family's rules, and runs where the lengths allow.
        forced = tune.forced_config(lib, family_of(name), v.config.index)
        aligns = {"bottom_right": forced} if causal == 2 else {"top_left": forced}
        if causal == 1 and hide is not None:
            aligns["bottom_right"] = hide(forced, 2)
        for align, view in aligns.items():
            options = {"causal": bool(causal), "align": align, "scale": 1 / math.sqrt(D)}
            for B, Hq, Hk, Sq, Sk in sizes:
                q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype)
                k = torch.randn(B, Hk, Sk, D, device="cuda", dtype=dtype)
                vv = torch.randn(B, Hk, Sk, D, device="cuda", dtype=dtype)
                do = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype)
                out, lse = aotriton_rt.attention(q, k, vv, library=lib, **options)
                dq, dk, dv, _ = aotriton_rt.attention_backward(do, q, k, vv, out, lse, library=view, **scheme,
                                                               **options)
                torch.cuda.synchronize()
                role = "attn_bwd_dkdv" if "dkdv" in name else "attn_bwd_dq"
                handle = attention_kernels(q, k, vv, backward=True, library=view, **scheme, **options)[role]
                assert handle.name == name, f"{name}: the dispatch ran {handle.name} for {(B, Hq, Sq, Sk)}"
                assert not (dq.isnan().any() or dk.isnan().any() or dv.isnan().any()), \
                    f"NaN gradient {name} {v.spec} #{v.config.index} {align} {(B, Hq, Sq, Sk)}"
                ran += 1
            print(f"ok {name} {v.spec['dtype']} D{D} causal{causal}{' atomic' if atomic else ''} {align} "
                  f"#{v.config.index}", flush=True)
print(f"memcheck cases run: {ran}", flush=True)
