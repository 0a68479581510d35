"""What attention sinks (and the logit softcap, ALiBi) cost: the same calls with and without, alternating.

    python -m bench.sinks [--images DIR] [--rounds 5] [--softcap | --decode] [--baseline DIR]

Rows (bf16, gpt-oss's attention: head dim 64, 64 query / 8 KV heads): prefill forwards, causal
and with gpt-oss's 128-key window, dense; the forward + backward of a training step; decode
steps against contiguous caches. Each contender runs as a CUDA graph of 10 calls (and eagerly),
in a shuffled order every round; the ratio is per round, with sinks over without (aim <= 1.05).
``--softcap``: instead, Gemma 2's attention with and without ``softcap=`` (cap 50), causal and
with a 4096-key window: the 2B/9B forward (head dim 256, 16/8 heads), the 27B forward (head dim
128, 32/16 heads), the 27B training step (forward + backward) and its decode steps against
contiguous caches (the decode kernels' run-time cap); with ``--baseline DIR`` also the uncapped
decode steps on these images against DIR's (images built before the cap was an argument). Where
the images hold sm90's EXP2_SPLIT configs (gputest, full), the 27B forward also with half its
exp2 on the FMA pipe (config #9) against its twin without (#7) and against the uncapped call,
and the 2B/9B forward with the hardware tanh (the portable kernel's FAST_TANH config #3) against
its twin without (#1, the TMA-load config) and against the uncapped call.
``--decode``: decode steps (bf16, head dim 128, 32/8 heads; contiguous caches, and a paged one of
16-row pages) with and without sinks (joined by the decode kernels: one split in the epilogue,
several in the combine), ALiBi slopes and both; with ``--baseline DIR`` also these images against
DIR's (images built before the arguments: the ``attn_sinks`` pass) with sinks and without either.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import torch

import aotriton_rt
from aotriton_rt.ops import torch as op_torch
from aotriton_rt.ops.attention.family import FWD, FWD_SM90
from bench.gpu_common import graphed, timed_rounds
from builder import tune

HQ, HK, D = 64, 8, 64


def _rows(lib: Any, gen: Any) -> dict[str, dict[str, Any]]:
    """name -> {"plain": fn, "sinks": fn} for every row."""
    rows: dict[str, dict[str, Any]] = {}
    sinks = torch.randn(HQ, device="cuda", generator=gen)
    for B, S in ((4, 4096), (16, 1024)):
        q = torch.randn(B, S, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(B, S, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        for mask, kw in (("causal", {"causal": True}), ("window 128", {"window": (127, 0)})):
            def call(s: Any, q: Any = q, k: Any = k, v: Any = v, kw: dict = kw) -> Any:
                return aotriton_rt.attention(q, k, v, layout="bshd", align="bottom_right", sinks=s, library=lib,
                                             **kw)[0]
            rows[f"forward {B}x{S} {mask}"] = {"plain": lambda c=call: c(None), "sinks": lambda c=call: c(sinks)}
    B, S = 4, 2048
    q = torch.randn(B, S, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k, v = (torch.randn(B, S, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            for _ in range(2))
    leaf = sinks.clone().requires_grad_()
    dout = torch.randn(B, S, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step(s: Any, q: Any = q, k: Any = k, v: Any = v, dout: Any = dout) -> None:
        out = op_torch.attention(q, k, v, causal=True, layout="bshd", sinks=s, library=lib)
        out.backward(dout)
    rows[f"forward+backward {B}x{S} causal"] = {"plain": lambda: step(None), "sinks": lambda: step(leaf)}
    for B, S in ((1, 8192), (32, 2048)):
        q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        kc, vc = (torch.randn(B, S, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")

        def dec(s: Any, q: Any = q, kc: Any = kc, vc: Any = vc, lens: Any = lens) -> Any:
            return aotriton_rt.decode_attention(q, kc, vc, cache_seqlens=lens, sinks=s, library=lib)[0]
        rows[f"decode B={B} {S} keys"] = {"plain": lambda d=dec: d(None), "sinks": lambda d=dec: d(sinks)}
    return rows


#: The softcap levers the images may hold as configs of their own, on sm90: (head dim, kernel,
#: its config without the lever, the same config with it, the lever's constexpr, the rows' word):
#: the portable forward's hardware tanh (FAST_TANH; config #3, the twin of #1, the tuning database's
#: pick for Gemma 2's capped causal calls) at head dim 256, the Gluon forward's exp2 half on the FMA
#: pipe (EXP2_SPLIT; config #9, the twin of #7, persistent without ping-pong) at 128.
CAP_LEVERS = ((256, FWD, 1, 3, "FAST_TANH", "hw tanh"), (128, FWD_SM90, 7, 9, "EXP2_SPLIT", "split"))


def _holds(lib: Any, kernel: str, head_dim: int, index: int, flag: str) -> bool:
    """Whether the images hold sm90's softcapped ``kernel`` at ``head_dim`` in config ``index``
    with the constexpr ``flag`` on."""
    return any(v.spec.get("SOFTCAP") and v.spec["HEAD_DIM"] == head_dim and v.target.arch == "sm90"
               and v.config.index == index and v.config.constexprs.get(flag) for v in lib.variants_of(kernel))


def _softcap_rows(lib: Any, gen: Any, base: Any = None) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for d, hq, hk in ((256, 16, 8), (128, 32, 16)):
        for B, S in ((4, 4096), (1, 8192)):
            q = torch.randn(B, S, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v = (torch.randn(B, S, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
            for mask, kw in (("causal", {"causal": True}), ("window 4096", {"window": (4095, 0)})):
                def call(cap: Any, images: Any = lib, q: Any = q, k: Any = k, v: Any = v, kw: dict = kw) -> Any:
                    return aotriton_rt.attention(q, k, v, layout="bshd", align="bottom_right", softcap=cap,
                                                 library=images, **kw)[0]
                rows[f"D={d} forward {B}x{S} {mask}"] = {"plain": lambda c=call: c(None),
                                                         "sinks": lambda c=call: c(50.0)}
                for head_dim, kernel, twin, lever, flag, word in CAP_LEVERS:
                    if d != head_dim or not _holds(lib, kernel, d, lever, flag):
                        continue
                    # The capped call on the lever's config against its twin without the lever,
                    # and against the call without a cap.
                    def forced(index: int, c: Any = call, kernel: str = kernel) -> Any:
                        return c(50.0, tune.forced_config(lib, kernel, index))
                    rows[f"D={d} forward {B}x{S} {mask} {word} vs #{twin}"] = {
                        "plain": lambda f=forced, i=twin: f(i), "sinks": lambda f=forced, i=lever: f(i)}
                    rows[f"D={d} forward {B}x{S} {mask} {word} vs no cap"] = {
                        "plain": lambda c=call: c(None), "sinks": lambda f=forced, i=lever: f(i)}
    B, S = 2, 4096
    q = torch.randn(B, S, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k, v = (torch.randn(B, S, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, S, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)

    # The arrays are bound now: the decode loop below rebinds q.
    def step(cap: Any, q: Any = q, k: Any = k, v: Any = v, dout: Any = dout) -> None:
        op_torch.attention(q, k, v, causal=True, layout="bshd", softcap=cap, library=lib).backward(dout)
    rows[f"forward+backward D=128 {B}x{S} causal"] = {"plain": lambda: step(None), "sinks": lambda: step(50.0)}
    for B, S in ((1, 8192), (32, 2048)):
        q = torch.randn(B, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        kc, vc = (torch.randn(B, S, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")

        def dec(cap: float, q: Any = q, kc: Any = kc, vc: Any = vc, lens: Any = lens) -> Any:
            return aotriton_rt.decode_attention(q, kc, vc, cache_seqlens=lens, softcap=cap, library=lib)[0]
        rows[f"D=128 decode B={B} {S} keys"] = {"plain": lambda d=dec: d(0.0), "sinks": lambda d=dec: d(50.0)}
        if base is not None:  # the run-time cap's cost to uncapped calls: these images against the others
            def old(q: Any = q, kc: Any = kc, vc: Any = vc, lens: Any = lens) -> Any:
                return aotriton_rt.decode_attention(q, kc, vc, cache_seqlens=lens, library=base)[0]
            rows[f"D=128 decode B={B} {S} no cap vs base"] = {"plain": old, "sinks": lambda d=dec: d(0.0)}
    return rows


def _decode_rows(lib: Any, gen: Any, base: Any = None) -> dict[str, dict[str, Any]]:
    """Decode steps with and without sinks, ALiBi slopes and both ("sinks" is the "with" side)."""
    rows: dict[str, dict[str, Any]] = {}
    hq, hk, d = 32, 8, 128
    sinks = torch.randn(hq, device="cuda", generator=gen)
    for B, S, page in ((1, 8192, None), (8, 4096, None), (8, 4096, 16), (32, 2048, None)):
        q = torch.randn(B, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        table = None
        if page:
            kc, vc = (torch.randn(B * S // page, page, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                      for _ in range(2))
            table = torch.randperm(B * S // page, device="cuda", generator=gen).int().reshape(B, S // page)
        else:
            kc, vc = (torch.randn(B, S, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)], device="cuda")

        def dec(s: Any = None, a: Any = None, images: Any = lib, q: Any = q, kc: Any = kc, vc: Any = vc,
                lens: Any = lens, table: Any = table) -> Any:
            return aotriton_rt.decode_attention(q, kc, vc, cache_seqlens=lens, block_table=table, sinks=s,
                                                alibi_slopes=a, library=images)[0]
        name = f"decode B={B} {S}" + (f" paged {page}" if page else "")
        rows[f"{name} sinks"] = {"plain": lambda d=dec: d(), "sinks": lambda d=dec: d(sinks)}
        rows[f"{name} alibi"] = {"plain": lambda d=dec: d(), "sinks": lambda d=dec, a=slopes: d(None, a)}
        rows[f"{name} both"] = {"plain": lambda d=dec: d(), "sinks": lambda d=dec, a=slopes: d(sinks, a)}
        if base is not None:  # the joined sinks against the pass; plain calls' cost of the new arguments
            rows[f"{name} sinks vs base"] = {"plain": lambda d=dec: d(sinks, None, base),
                                             "sinks": lambda d=dec: d(sinks)}
            rows[f"{name} plain vs base"] = {"plain": lambda d=dec: d(None, None, base), "sinks": lambda d=dec: d()}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", default=os.environ.get("AOTRITON_RT_IMAGES"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--softcap", action="store_true", help="the softcap's rows instead of the sinks'")
    ap.add_argument("--decode", action="store_true", help="decode steps with sinks, ALiBi slopes and both")
    ap.add_argument("--baseline", default=None,
                    help="with --softcap or --decode: also time decode steps on these images against DIR's")
    args = ap.parse_args()
    lib = aotriton_rt.Library(args.images) if args.images else aotriton_rt.default_library()
    base = aotriton_rt.Library(args.baseline) if args.baseline else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = (_softcap_rows(lib, gen, base) if args.softcap else _decode_rows(lib, gen, base) if args.decode
            else _rows(lib, gen))
    what = ("SOFTCAP (bf16, Gemma 2's heads, cap 50" if args.softcap else
            "DECODE SINKS / ALIBI (bf16, D=128, 32/8 heads" if args.decode else f"SINKS (bf16, D={D}, {HQ}/{HK} heads")
    print(f"{what}; time with / without, per round: median [min-max]; aim <= 1.05)")
    print(f"{'row':40s} | {'without us':>10s} {'with us':>9s} | {'graph x':>7s} {'[min-max]':>11s} | {'eager x':>7s}")
    for name, pair in rows.items():
        training = name.startswith("forward+backward")
        try:
            pair["sinks"]()
        except aotriton_rt.KernelNotFound as e:  # the default images hold no softcap backward
            print(f"{name:40s} | skipped: these images lack a kernel it needs ({str(e).splitlines()[0]})")
            continue
        graphs = {} if training else graphed(pair, 10)
        eager, graph = timed_rounds(pair, graphs, args.rounds)
        times = graph if set(graphs) == set(pair) else eager
        ratios = [a / b for a, b in zip(times["sinks"], times["plain"])]
        eager_ratio = statistics.median(a / b for a, b in zip(eager["sinks"], eager["plain"]))
        print(f"{name:40s} | {1e3 * statistics.median(times['plain']):10.1f} "
              f"{1e3 * statistics.median(times['sinks']):9.1f} | {statistics.median(ratios):7.3f} "
              f"[{min(ratios):.3f}-{max(ratios):.3f}] | {eager_ratio:7.3f}" + ("  (eager)" if training else ""),
              flush=True)


if __name__ == "__main__":
    main()
