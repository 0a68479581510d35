"""Prefill from a KV cache against the variable-length forward at equal work (``python -m
bench.decode --prefill``; bench/README.md, "decode's other modes")."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

import aotriton_rt
from aotriton_rt.ops import decode as dec
from bench.gpu_common import _sdpa_backend, _stats, graphed, paged_copies, parse_pairs, timed_rounds

#: ``--prefill`` shapes: batch x query rows (each sequence's whole prompt, causal).
PREFILL_SHAPES = ("8x1024", "4x4096", "1x8192")
#: The paged contenders' acceptance: their time within this factor of the varlen forward's.
PREFILL_TARGET = 1.10


def causal_flops(B: int, S: int, Hq: int, D: int) -> int:
    """FLOPs of a causal forward with S query rows against S keys: two matmuls (QKᵀ and PV) of
    2·D FLOPs per visible (query, key) pair, S(S+1)/2 pairs per head."""
    return 4 * B * Hq * D * (S * (S + 1) // 2)


def prefill_row(args: argparse.Namespace, lib: Any, B: int, S: int, ratio: int) -> dict:
    """Time the prefill contenders at one shape (see ``--prefill`` in the module docs): the same
    q/k/v as the varlen forward's packed arrays, ``decode_attention``'s contiguous and paged
    caches (holding the S rows, ``cache_seqlens`` = S, nothing appended) and SDPA's dense views."""
    dtype = torch.bfloat16
    D, Hkv = args.d, args.hkv
    Hq = Hkv * ratio
    gen = torch.Generator(device="cuda").manual_seed(B * 131 + S + ratio)
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dtype, generator=gen)
    kc = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=gen)
    vc = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=gen)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
    qp, kp, vp = q.view(B * S, Hq, D), kc.view(B * S, Hkv, D), vc.view(B * S, Hkv, D)
    paged_caches = paged_copies(kc, vc, args.page, gen)
    skipped = [page for page in args.page if page not in paged_caches]
    if skipped:
        print(f"  B={B} S={S}: page sizes {skipped} do not divide {S}; skipped")
    # name -> (the timed call, its output as (B, S, Hq, D))
    contenders: dict[str, tuple[Any, Any]] = {}

    def varlen() -> Any:
        return aotriton_rt.attention(qp, kp, vp, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S,
                                     max_seqlen_k=S, library=lib)[0]
    contenders["varlen"] = (varlen, lambda o: o.view(B, S, Hq, D))

    def ours() -> Any:
        return dec.decode_attention(q, kc, vc, cache_seqlens=lens, causal=True, library=lib)[0]
    contenders["ours"] = (ours, lambda o: o)
    for page, (kpg, vpg, table) in paged_caches.items():
        def paged(kpg: Any = kpg, vpg: Any = vpg, table: Any = table) -> Any:
            return dec.decode_attention(q, kpg, vpg, cache_seqlens=lens, block_table=table, causal=True,
                                        library=lib)[0]
        contenders[f"p{page}"] = (paged, lambda o: o)
    if args.sdpa:
        qs, ks_, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

        def flash() -> Any:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(_sdpa_backend("flash")):
                return torch.nn.functional.scaled_dot_product_attention(qs, ks_, vs, is_causal=True, enable_gqa=True)
        contenders["sdpa:flash"] = (flash, lambda o: o.transpose(1, 2))
    outputs, errors = {}, {}
    for name, (fn, as_bshd) in list(contenders.items()):
        try:
            outputs[name] = as_bshd(fn())
            torch.cuda.synchronize()
        except (RuntimeError, aotriton_rt.AotritonError) as e:  # SDPA's flash without GQA, a kernel not built
            if name == "varlen":
                raise
            print(f"  B={B} S={S} {name}: dropped ({str(e).splitlines()[0][:120]})", flush=True)
            contenders.pop(name)
    ref = outputs["varlen"]
    for name, o in outputs.items():
        if name != "varlen":
            errors[name] = (o.float() - ref.float()).abs().max().item()
    del outputs
    print(f"  B={B} S={S} {Hq}/{Hkv} heads: max |out - varlen| "
          + ", ".join(f"{n} {e:.3g}" for n, e in errors.items()), flush=True)
    calls = {name: fn for name, (fn, _) in contenders.items()}
    graphs = graphed(calls, 10)
    eager, graph = timed_rounds(calls, graphs, args.rounds)
    del graphs
    flops = causal_flops(B, S, Hq, D)
    row = {"B": B, "S": S, "Hq": Hq, "Hkv": Hkv, "D": D, "pages": list(paged_caches), "flops": flops,
           "max_error_vs_varlen": errors, "eager": {n: _stats(v) for n, v in eager.items()},
           "graph": {n: _stats(v) for n, v in graph.items() if v}}
    times = {"eager": eager, "graph": graph}
    row["vs_varlen"] = {}
    for mode in ("eager", "graph"):
        for s in row[mode].values():
            s["tflops"] = flops / (s["median_us"] * 1e-6) / 1e12
        base = times[mode].get("varlen")
        row["vs_varlen"][mode] = {n: _round_ratios(v, base) for n, v in times[mode].items()
                                  if n != "varlen" and base and len(v) == len(base)}
    return row


def _round_ratios(times: list[float], base: list[float]) -> dict:
    """This contender's time over the base's, round by round: median, min and max."""
    ratios = [t / b for t, b in zip(times, base)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def prefill_table(args: argparse.Namespace, lib: Any) -> list[dict]:
    rows = []
    for B, S in parse_pairs(args.prefill_shapes, "--prefill-shapes", "8x1024"):
        for ratio in args.gqa:
            rows.append(prefill_row(args, lib, B, S, ratio))
            torch.cuda.empty_cache()
    return rows


def prefill_summary(rows: list[dict]) -> None:
    """The ``--prefill`` table: per shape and contender, TFLOP/s from the CUDA-graph medians (the
    eager ones where no graph was timed), the time over varlen's per round (median [min-max]),
    the max error against varlen; then each page size's ratios against the target."""
    print(f"\nPREFILL (causal, bf16; TFLOP/s = causal FLOPs / median time, CUDA-graph replay [eager]; "
          f"/varlen = time / varlen's, per round: median [min-max], paged target <= {PREFILL_TARGET:.2f})")
    print(f"{'B':>3} {'S':>6} {'heads':>6} {'contender':<11} | {'TFLOP/s':>8} {'[eager]':>8} | "
          f"{'/varlen':>7} {'[min-max]':>11} {'eager':>6} | {'max err':>8}")
    for r in rows:
        for name in r["eager"]:
            s = r["graph"].get(name)
            e = r["eager"][name]
            mode = "graph" if s else "eager"
            tflops = f"{s['tflops']:>8.1f}" if s else f"{'-':>8}"
            vs, ve = r["vs_varlen"].get(mode, {}).get(name), r["vs_varlen"].get("eager", {}).get(name)
            ratio = (f"{vs['median']:>7.2f} [{vs['min']:.2f}-{vs['max']:.2f}]" if vs else f"{'':>7} {'':>11}")
            err = r["max_error_vs_varlen"].get(name)
            eager_ratio = f"{ve['median']:.2f}" if ve else ""
            print(f"{r['B']:>3} {r['S']:>6} {r['Hq']:>3}/{r['Hkv']:<2} {name:<11} | {tflops} {e['tflops']:>8.1f} | "
                  f"{ratio} {eager_ratio:>6} | "
                  + (f"{err:>8.3g}" if err is not None else f"{'-':>8}") + (" WRONG" if (err or 0) > 5e-2 else ""))
    pages = sorted({p for r in rows for p in r.get("pages", [])})
    for page in pages:
        name, parts, worst = f"p{page}", [], 0.0
        for r in rows:
            mode = "graph" if name in r["vs_varlen"].get("graph", {}) else "eager"
            v = r["vs_varlen"].get(mode, {}).get(name)
            if v is None:
                continue
            worst = max(worst, v["median"])
            parts.append(f"{r['B']}x{r['S']} {v['median']:.2f}" + ("" if mode == "graph" else " (eager)"))
        if parts:
            verdict = "within" if worst <= PREFILL_TARGET else "NOT within"
            print(f"{name}/varlen: {', '.join(parts)}: {verdict} {(PREFILL_TARGET - 1) * 100:.0f}% of varlen")
