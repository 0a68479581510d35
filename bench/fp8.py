"""FP8 attention forward against our bf16 forward and cuDNN's bf16 SDPA: speed and accuracy.

    python -m bench.fp8 [--images DIR] [--rounds 8] [--shape 4x4096x32x128] [--configs]

Rows: head dim 128, B4 H32 N4096 by default, no mask and causal. Contenders (each a CUDA graph of
10 forwards, their order shuffled every round): ``aotriton_rt fp8`` (e4m3 q, k, v with per-head
descales, bf16 out: the images' choice of FP8 forward, sm90's Gluon ``attn_fwd_fp8_sm90`` where
they hold it; a line names the kernel), ``aotriton_rt fp8 portable`` (the same call on the portable
``attn_fwd_fp8``, when the Gluon one is what the images chose), ``aotriton_rt bf16`` (the same call
in bf16: the images' choice of forward, the Gluon one on sm90 where they hold it), ``SDPA cuDNN``
(bf16) and, where torch takes fp8 inputs in ``scaled_dot_product_attention``, ``SDPA fp8`` (else a
line says why not). Times are medians with their [min-max] over the rounds; TFLOP/s count
4·B·H·N²·D (halved when causal). ``--configs`` also times each config of both FP8 forwards the
images hold for the call (the operator launches #0).

Accuracy (B1 H4 N4096 D128, the same shapes' inputs): max and mean absolute error of each
contender's output against fp32 attention of the dequantised fp8 inputs, in units of max|v|.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import torch

import aotriton_rt
from aotriton_rt.ops.attention.family import FWD_FP8_SM90
from bench.gpu_common import _sdpa_backend, graphed, timed_rounds


def _quantised(x: Any, heads_k: int) -> tuple[Any, Any]:
    """(e4m3 x, fp32 (B, heads_k) descales): each key/value head's group spans e4m3 to 224."""
    b, h = x.shape[0], x.shape[1]
    amax = x.float().abs().view(b, heads_k, -1).amax(-1).clamp_min(1e-6)
    scale = amax / 224.0
    per_head = scale.repeat_interleave(h // heads_k, 1)[..., None, None]
    return (x.float() / per_head).to(torch.float8_e4m3fn), scale


GLUON = FWD_FP8_SM90


def _portable(lib: Any) -> Any:
    """``lib`` without sm90's Gluon FP8 forward: FP8 calls run ``attn_fwd_fp8``."""
    from builder.tune import without_kernel

    return without_kernel(lib, GLUON)


def _fp8_kernel(lib: Any, N: int, D: int, causal: bool) -> str:
    """The FP8 forward the images run for the benchmark's call."""
    from aotriton_rt.ops.attention import explain

    return explain(dtype="fp8e4nv", head_dim=D, seqlen_q=N, causal=causal, library=lib).kernels[-1].kernel


def _configs(lib: Any, q8: Any, k8: Any, v8: Any, causal: bool, fp8: dict) -> dict[str, Any]:
    """``fp8 config #i`` (``attn_fwd_fp8``) and ``fp8 gluon config #i`` (``attn_fwd_fp8_sm90``): each
    config of the two FP8 forwards the images hold for this call."""
    from aotriton_rt.ops.attention import fp8 as op

    p, descales = op.prepare_fp8(q8, k8, v8, causal=causal, window=None, align="top_left", scale=None,
                                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                                 layout="bhsd", **fp8)
    spec = op.spec_of(p, "bf16", p.causal_mode)
    ks = op.kernels_of(lib)
    chosen = op.choose(ks, p.call(0), spec, "sm90")
    runs = {}
    for kernel, label in ((op.FWD_FP8, "fp8 config"), (GLUON, "fp8 gluon config")):
        for v in lib.variants_of(kernel):
            if all(v.spec.get(k) == val for k, val in spec.items()):
                c = v.config
                handle = lib.kernel(kernel, **spec, **c.constexprs, num_warps=c.num_warps, num_stages=c.num_stages)
                # Each config with the V^T key order it reads (the Gluon one's KEY_ORDER).
                transpose = op.transpose_handle(ks, chosen, "sm90", op.key_order(handle))
                runs[f"{label} #{c.index}"] = (lambda h=handle, t=transpose: op._launch(
                    p, h, spec, "bf16", descales, None, None, None, None, t)[0])
    return runs


def _contenders(lib: Any, B: int, H: int, N: int, D: int, causal: bool, gen: Any, configs: bool = False
                ) -> tuple[dict, dict]:
    from torch.nn.attention import sdpa_kernel

    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    (q8, dq), (k8, dk), (v8, dv) = (_quantised(x, H) for x in (q, k, v))
    fp8 = dict(q_descale=dq, k_descale=dk, v_descale=dv)
    runs = {"aotriton_rt fp8": lambda: aotriton_rt.attention(q8, k8, v8, causal=causal, library=lib, **fp8)[0]}
    if _fp8_kernel(lib, N, D, causal) == GLUON:
        portable = _portable(lib)
        runs["aotriton_rt fp8 portable"] = lambda: aotriton_rt.attention(q8, k8, v8, causal=causal, library=portable,
                                                                         **fp8)[0]
    runs["aotriton_rt bf16"] = lambda: aotriton_rt.attention(q, k, v, causal=causal, library=lib)[0]

    def cudnn() -> Any:
        with sdpa_kernel(_sdpa_backend("cudnn")):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    runs["SDPA cuDNN"] = cudnn
    if configs:
        runs.update(_configs(lib, q8, k8, v8, causal, fp8))
    notes = {}
    try:
        with sdpa_kernel(_sdpa_backend("cudnn")):
            torch.nn.functional.scaled_dot_product_attention(q8, k8, v8, is_causal=causal)

        def sdpa_fp8() -> Any:
            with sdpa_kernel(_sdpa_backend("cudnn")):
                return torch.nn.functional.scaled_dot_product_attention(q8, k8, v8, is_causal=causal)
        runs["SDPA fp8"] = sdpa_fp8
    except (RuntimeError, TypeError, NotImplementedError) as e:
        notes["SDPA fp8"] = f"torch {torch.__version__} refuses fp8 inputs: {str(e).splitlines()[0][:160]}"
    return runs, notes


def _accuracy(lib: Any, causal: bool, gen: Any) -> dict[str, dict[str, float]]:
    from torch.nn.attention import sdpa_kernel

    B, H, N, D = 1, 4, 4096, 128
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    (q8, dq), (k8, dk), (v8, dv) = (_quantised(x, H) for x in (q, k, v))
    deq = [x8.float() * d[..., None, None] for x8, d in ((q8, dq), (k8, dk), (v8, dv))]
    s = deq[0] @ deq[1].transpose(-1, -2) * D ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(N, N, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(s, -1) @ deq[2]
    vmax = deq[2].abs().max().item()
    qb, kb, vb = (x.to(torch.bfloat16) for x in deq)
    outs = {"aotriton_rt fp8": aotriton_rt.attention(q8, k8, v8, causal=causal, q_descale=dq, k_descale=dk,
                                                      v_descale=dv, library=lib)[0],
            "aotriton_rt bf16": aotriton_rt.attention(qb, kb, vb, causal=causal, library=lib)[0]}
    if _fp8_kernel(lib, N, D, causal) == GLUON:
        outs["aotriton_rt fp8 portable"] = aotriton_rt.attention(q8, k8, v8, causal=causal, q_descale=dq,
                                                                 k_descale=dk, v_descale=dv, library=_portable(lib))[0]
    with sdpa_kernel(_sdpa_backend("cudnn")):
        outs["SDPA cuDNN"] = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)
    result = {}
    for name, out in outs.items():
        err = (out.float() - ref).abs()
        result[name] = {"max_abs": err.max().item(), "mean_abs": err.mean().item(),
                        "max_over_vmax": err.max().item() / vmax, "mean_over_vmax": err.mean().item() / vmax}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", default=os.environ.get("AOTRITON_RT_IMAGES"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--shape", default="4x4096x32x128", help="BxNxHxD")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for fp8.json")
    ap.add_argument("--configs", action="store_true", help="also time each FP8 config the images hold")
    args = ap.parse_args()
    B, N, H, D = (int(x) for x in args.shape.lower().split("x"))
    lib = aotriton_rt.Library(args.images) if args.images else aotriton_rt.default_library()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: dict[str, Any] = {"shape": {"B": B, "N": N, "H": H, "D": D}, "torch": torch.__version__,
                               "device": torch.cuda.get_device_name(), "rows": {}, "accuracy": {}}
    print(f"FP8 forward, B{B} N{N} H{H} D{D}: ms per forward, median [min-max] over {args.rounds} rounds "
          f"(CUDA graphs of 10)")
    for causal in (False, True):
        row = "causal" if causal else "no mask"
        runs, notes = _contenders(lib, B, H, N, D, causal, gen, args.configs)
        notes["aotriton_rt fp8"] = f"runs {_fp8_kernel(lib, N, D, causal)}"
        for name, why in notes.items():
            print(f"  {row}: {name}: {why}")
        graphs = graphed(runs, 10)
        eager, graph = timed_rounds(runs, graphs, args.rounds)
        flops = 4 * B * H * N * N * D / (2 if causal else 1)
        entry = {}
        for name in runs:
            times = graph.get(name) or eager[name]
            med = statistics.median(times)
            entry[name] = {"ms": med, "min": min(times), "max": max(times), "tflops": flops / med / 1e9,
                           "graph": name in graph}
            print(f"  {row:8s} {name:24s} {med:8.3f} ms [{min(times):.3f}-{max(times):.3f}] "
                  f"{flops / med / 1e9:7.1f} TFLOP/s", flush=True)
        ours = graph.get("aotriton_rt fp8") or eager["aotriton_rt fp8"]
        for peer in runs:
            if peer != "aotriton_rt fp8":
                theirs = graph.get(peer) or eager[peer]
                ratios = [t / o for t, o in zip(theirs, ours)]
                entry[f"fp8 speedup over {peer}"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                     "max": max(ratios)}
                print(f"  {row:8s} fp8 over {peer:24s} x{statistics.median(ratios):.3f} "
                      f"[{min(ratios):.3f}-{max(ratios):.3f}]")
        results["rows"][row] = {**entry, "notes": notes}
        acc = _accuracy(lib, causal, gen)
        results["accuracy"][row] = acc
        for name, a in acc.items():
            print(f"  {row:8s} accuracy {name:24s} max {a['max_abs']:.3e} ({a['max_over_vmax']:.2e} max|v|) "
                  f"mean {a['mean_abs']:.3e} ({a['mean_over_vmax']:.2e} max|v|)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
