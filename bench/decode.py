"""Decode attention speed: aotriton-rt's split-KV kernels next to SDPA's best backend (GPU).

Kernel benchmark (default): one query row per sequence, bf16, D=128, 8 KV heads with GQA 4:1
(32 query heads) and 8:1 (64), B in {1, 8, 64}, cache lengths 2k..32k, bottom-right causal
(with one query row: every cached key). Contenders, in a shuffled order every round:

- ``sdpa``: ``scaled_dot_product_attention(q, k, v, enable_gqa=True)`` under each backend that
  accepts the call (flash, cuDNN, efficient, math); the fastest backend's median is the peer;
- ``ours``: ``decode_attention`` on a contiguous cache ``(B, S, Hkv, D)``;
- ``p16``, ``p256`` (``--page``): the same cache as ``(num_pages, page, Hkv, D)`` pages in a
  shuffled block table (vLLM's page size 16, FlashAttention's 256);
- ``ours#i`` / ``p16#i``: with ``--config i ...`` (tuning config i forced, e.g. the sm90
  alternates: #1 128-key steps with 8 warps, #2 four stages) and ``--waves/--min-blocks``
  split-rule overrides; without ``#``: the runtime's own choice from the catalog's tuning rules.
- ``ours=1`` / ``p16=4``: with ``--splits 1 4``, the split count forced (``=1``: no split, no
  combine launch) under the images' own config rule.

Shapes: every ``--b`` with every ``--cache``, or exactly the ``--shapes BxS`` listed (e.g. the
Llama decode shape and long single sequences together: ``--shapes 8x512 8x1024 1x2048``). Each
contender's split count is reported next to its time (``/s``).

Each contender is timed two ways: ``eager`` (back-to-back calls between CUDA events, so host
cost counts where it exceeds the kernel's) and ``graph`` (the same calls captured in a CUDA
graph and replayed: kernel time). Reported: medians over ``--rounds`` rounds, spread
(max-min)/median, ratio vs SDPA's best backend, and K/V bandwidth (bytes of the visible K and V
/ time) as % of ``--peak-tbs``. Outputs are checked before timing against an fp32 reference of
at most four sequences, computed one sequence at a time (a whole-batch fp32 reference with K/V
repeated per query head would be 64 GiB at B=64, 32k cache, GQA 8:1).

``--llama``: the generation benchmark: a randomly initialised Llama-style model (16
layers, hidden 2048, 16 query / 4 KV heads, head dim 128, bf16; no download) generating 128
tokens for 8 sequences through transformers' attention interface, in two batch modes
(``--llama-padding``, both by default): ``none``, 8 prompts of 512 tokens; ``left``, 8 prompts of
512, 448, ..., 64 tokens left-padded to 512 (pad token 0, attention mask 0 on the pads), as a
transformers user batches prompts of different lengths. Per mode: ``generate``, a prefill
forward and a training step (its loss leaves the pads out); see ``llama`` for the contenders
(aotriton-rt and SDPA under each of its backends) and the method. One table per mode.

``--prefill``: causal prefill (every sequence's S query rows against its own S keys) from a
paged cache against the contiguous variable-length forward, at equal work: per ``--prefill-shapes
BxS`` (default 8x1024 4x4096 1x8192), ``--hkv`` 8 KV heads with ``--gqa`` 4 (32 query heads), D=128,
bf16. Contenders, shuffled every round: ``varlen``, ``aotriton_rt.attention`` on packed
``(B*S, H, D)`` q/k/v with ``cu_seqlens`` (the reference); ``ours``, ``decode_attention`` with q's
S rows against a contiguous cache that already holds them (``cache_seqlens`` = S, nothing
appended); ``p16``, ``p256`` (``--page``): the same against shuffled pages; ``sdpa:flash``
(``--no-sdpa`` drops it) on dense ``(B, H, S, D)`` views. Timed eager and from a CUDA graph as
the kernel table; reported: TFLOP/s of the medians, each contender's time over varlen's per
round (median [min-max]; the paged ones' target is <= 1.10) and the max |out - varlen| per
contender, checked once per shape before timing.

    python bench/decode.py                                   # the kernel table
    python bench/decode.py --config 0 1 2 --b 8 64 --cache 8192
    python bench/decode.py --b 1 8 64 --cache 2048 8192 32768 --gqa 4 --page 16 64 256
    # the split rule at small caches (the Llama decode shape, B=1 long caches): rule vs none vs min_blocks
    python bench/decode.py --shapes 8x512 8x768 8x1024 1x2048 1x8192 --hkv 4 --gqa 4 --page \
        --splits 1 --config 0 --min-blocks 1 2 8 --rounds 9
    python bench/decode.py --llama --rounds 5
    python bench/decode.py --llama --llama-padding left --llama-sdpa default cudnn --rounds 3
    python bench/decode.py --prefill --rounds 5 --prefill-shapes 8x1024 4x4096 1x8192
    python bench/decode.py --fp8 --rounds 9 --fp8-shapes 32x8192 64x8192 --hkv 8 --gqa 4 --page 16

``--fp8``: fp8 (e4m3) KV caches with per-head scales against bf16 ones (bench/decode_fp8.py):
per ``--fp8-shapes BxS`` (default 32x8192 64x8192), contiguous and paged (the first ``--page``),
alternating every round; medians, spreads and the per-round fp8 speedup, median [min-max];
with ``--baseline DIR`` each contender also on DIR's images in the same rounds (``base:``).
Images: AOTRITON_RT_IMAGES (or the default library). Writes JSON under $OUT when set.
``--pdl``: the decode chain's PDL policies side by side in one process (sm90): each default
contender (``ours``, ``p64``, ...) also as ``ours@on`` (PDL wherever compiled in) and ``ours@off``
(never), the plain name being the runtime's per-call rule (``pdl_choice`` in
``aotriton_rt/ops/decode/launch.py``, which this benchmark wraps in its own process to force the
policies: :func:`force_pdl_policies`); the order is shuffled every round with everything else,
and a PDL table reports per shape the three times, the rule's decision and the per-round
ratios on/off and rule/best-of-both (median [min-max]). ``--no-sdpa`` skips SDPA's backends (a
faster policy-only run). ``AOTRITON_RT_CUDA_PDL=off`` still turns PDL off process-wide.

    # the rule against always/never PDL at the measured grid (~3 min on the H200)
    python bench/decode.py --pdl --no-sdpa --b 1 8 64 --cache 2048 8192 32768 --gqa 4 8 --page 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/NAME.py`: the checkout on the path (python -m bench.NAME needs none)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import aotriton_rt  # noqa: E402
from aotriton_rt.ops import decode as dec  # noqa: E402
from bench.decode_fp8 import FP8_SHAPES, fp8_summary, fp8_table  # noqa: E402
from bench.gpu_common import (  # noqa: E402
    SDPA_BACKENDS,
    _sdpa_backend,
    _stats,
    graphed,
    paged_copies,
    parse_pairs,
    timed_rounds,
)
from bench.llama import LLAMA_PADDING, LLAMA_SDPA, llama  # noqa: E402
from bench.prefill import PREFILL_SHAPES, prefill_summary, prefill_table  # noqa: E402


def _variants(args: argparse.Namespace, default_rules: Any) -> list[tuple[str, Any, int | None]]:
    """(tag, tuning rules, forced split count or None) of the forced contenders: each
    ``--config`` with each ``--min-blocks`` (tag ``#2`` or ``#0mb1``) and the ``--waves``
    override; each ``--splits`` count (tag ``=1``) under the images' own rules."""
    out: list[tuple[str, Any, int | None]] = []
    for config in args.config:
        for mb in args.min_blocks or [None]:
            splits = {}
            if args.waves is not None:
                splits["waves"] = args.waves
            if mb is not None:
                splits["min_blocks"] = mb
            tag = f"#{config}" + (f"mb{mb}" if mb is not None else "") + (f"w{args.waves}" if args.waves else "")
            out.append((tag, [{"config": config, **({"splits": splits} if splits else {})}], None))
    for n in args.splits:
        out.append((f"={n}", default_rules, n))
    return out


def shapes_of(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(batch, cache length) pairs: ``--shapes BxS ...`` as listed, else every --b with every --cache."""
    if not args.shapes:
        return [(b, s) for b in args.b for s in args.cache]
    return parse_pairs(args.shapes, "--shapes", "8x512")


def splits_used(fn: Any, library: Any) -> int | None:
    """The split count of the launch plan that ``fn()`` (one decode call on ``library``) makes."""
    plan = plan_of(fn, library)
    return plan.num_splits if plan is not None else None


def plan_of(fn: Any, library: Any) -> Any:
    """The launch plan that ``fn()`` (one decode call on ``library``) makes (its split count, its
    PDL decision)."""
    launches = dec._kernels_of(library).launches
    launches.clear()
    fn()
    plans = list(launches.values())
    return plans[-1] if plans else None


#: ``--pdl`` contenders: name suffix -> the decode PDL policy (:data:`PDL_POLICY`); "" is the rule.
PDL_TAGS = {"": "rule", "@on": "on", "@off": "off"}
#: The PDL policy the next decode plan is made under: "rule" (the runtime's ``pdl_choice``), "on"
#: (PDL wherever compiled in) or "off" (never). Each contender sets it before its call, so that a
#: plan made again (the runtime keeps a bounded number) gets its contender's policy.
PDL_POLICY = {"now": "rule"}


def force_pdl_policies() -> None:
    """Make this process's decode plans follow :data:`PDL_POLICY` (a measurement switch the runtime
    does not have): the runtime's ``pdl_choice``, wrapped."""
    from aotriton_rt.ops.decode import launch

    rule = launch.pdl_choice
    if getattr(rule, "forced_by_bench", False):
        return

    def choice(p: Any, num_splits: int) -> tuple[bool, str]:
        policy = PDL_POLICY["now"]
        if policy == "on":
            return True, "PDL (policy 'on')"
        if policy == "off":
            return False, "no PDL (policy 'off')"
        return rule(p, num_splits)

    choice.forced_by_bench = True
    launch.pdl_choice = choice


def contender_library(lib: Any, rules: Any, default_rules: Any, policy: str) -> Any:
    """The library a contender calls: ``lib`` itself for the images' own rules under the PDL rule,
    else a ``Library.with_tuning`` view of it (launch plans are per library, so each contender's
    are its own) with ``rules`` in place of the images' decode rules."""
    if rules is default_rules:
        return lib if policy == "rule" else lib.with_tuning({})
    return lib.with_tuning({"attn_decode": rules})


def _checked_sequences(batch: int, most: int = 4) -> list[int]:
    """The sequences whose outputs are checked: first, last and a few between (at most ``most``)."""
    if batch <= most:
        return list(range(batch))
    return sorted({round(i * (batch - 1) / (most - 1)) for i in range(most)})


def _reference(qs: Any, ks: Any, vs: Any, checked: list[int]) -> Any:
    """fp32 attention of the ``checked`` sequences, one at a time, as (len(checked), 1, Hq, D).

    A whole-batch fp32 reference with K/V repeated per query head is B * Hq * S * D * 4 bytes per
    tensor (64 GiB at B=64, 32k cache, GQA 8:1); one sequence is Hq * S * D * 4 (1 GiB there)."""
    outs = []
    for b in checked:
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qs[b:b + 1].float(), ks[b:b + 1].float(), vs[b:b + 1].float(), enable_gqa=True))
        torch.cuda.synchronize()
    return torch.cat(outs).transpose(1, 2)


def _max_error(out: Any, ref: Any, checked: list[int]) -> float:
    """Largest |out - ref| over the checked sequences of a (B, 1, Hq, D) output."""
    return (out[checked].float() - ref).abs().max().item()


def kernel_table(args: argparse.Namespace, lib: Any) -> list[dict]:
    rows = []
    default_rules = dec._kernels_of(lib).rules
    for B, S in shapes_of(args):
        for ratio in args.gqa:
            rows.append(one_shape(args, lib, B, S, ratio, default_rules))
            _print_row(rows[-1])
            torch.cuda.empty_cache()
    return rows


def one_shape(args: argparse.Namespace, lib: Any, B: int, S: int, ratio: int, default_rules: Any) -> dict:
    """Time every contender at one shape (see the module docs); ``default_rules``: the images' own
    tuning rules (what a plain call uses)."""
    dtype = torch.bfloat16
    D, Hkv = args.d, args.hkv
    if args.pdl:
        force_pdl_policies()
    Hq = Hkv * ratio
    gen = torch.Generator(device="cuda").manual_seed(B * 131 + S + ratio)
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=dtype, generator=gen)
    kc = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=gen)
    vc = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=gen)
    # One shuffled-page copy of the cache per page size: (num_pages, page, Hkv, D) and its table.
    paged_caches = paged_copies(kc, vc, args.page, gen)
    # SDPA's layout: (B, H, S, D) views of the same memory.
    qs, ks_, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    checked = _checked_sequences(B)
    ref = _reference(qs, ks_, vs, checked)
    contenders: dict[str, Any] = {}
    for be in SDPA_BACKENDS if args.sdpa else ():
        if be == "math" and contenders:
            continue  # the reference path (it repeats K/V per query head): only when nothing else runs
        def sdpa(be: str = be) -> Any:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(_sdpa_backend(be)):
                return torch.nn.functional.scaled_dot_product_attention(qs, ks_, vs, enable_gqa=True)
        try:
            out = sdpa().transpose(1, 2)
            torch.cuda.synchronize()
        except RuntimeError:
            continue
        if _max_error(out, ref, checked) > 5e-2:
            continue
        contenders[f"sdpa:{be}"] = sdpa
    # "ours" / "p<page>": the runtime's own choice (the catalog's tuning rules); "#i": config i forced.
    variants = [("", default_rules, None), *_variants(args, default_rules)]
    # With --pdl the default contenders also run under each fixed PDL policy (ours@on, ours@off).
    policies = [(tag, policy) for tag, policy in PDL_TAGS.items() if args.pdl or not tag]
    splits: dict[str, int | None] = {}
    pdl_used: dict[str, bool] = {}
    for tag, rules, forced in variants:
        for ptag, policy in policies if not tag else [("", "rule")]:
            view = contender_library(lib, rules, default_rules, policy)

            def ours(view: Any = view, forced: int | None = forced, policy: str = policy) -> Any:
                PDL_POLICY["now"] = policy
                return dec.decode_attention(q, kc, vc, causal=True, num_splits=forced, library=view)[0]

            todo = [(f"ours{tag}{ptag}", ours)]
            for page, (kp, vp, table) in paged_caches.items():
                def paged(view: Any = view, forced: int | None = forced, kp: Any = kp, vp: Any = vp,
                          table: Any = table, policy: str = policy) -> Any:
                    PDL_POLICY["now"] = policy
                    return dec.decode_attention(q, kp, vp, block_table=table, causal=True, num_splits=forced,
                                                library=view)[0]
                todo.append((f"p{page}{tag}{ptag}", paged))
            for name, fn in todo:
                err = _max_error(fn(), ref, checked)
                if err > 5e-2:
                    print(f"  {name} B={B} S={S} gqa={ratio}: wrong (max error {err:.3g}); skipped")
                    continue
                contenders[name] = fn
                plan = plan_of(fn, view)
                splits[name] = plan.num_splits if plan is not None else None
                if plan is not None:
                    pdl_used[name] = bool(plan.pdl)
    PDL_POLICY["now"] = "rule"
    graphs = graphed(contenders, 20)
    eager, graph = timed_rounds(contenders, graphs, args.rounds)
    PDL_POLICY["now"] = "rule"
    # A replay's output too, after every contender has run (a graph can outlive what it points at).
    for name, g in list(graphs.items()):
        g.graph.replay()
        torch.cuda.synchronize()
        out = g.out.transpose(1, 2) if name.startswith("sdpa") else g.out
        err = _max_error(out, ref, checked)
        if err > 5e-2:
            print(f"  {name} B={B} S={S} gqa={ratio}: wrong after graph replay (max error {err:.3g}); "
                  "its graph times dropped")
            graph.pop(name, None)
    kv_bytes = 2 * B * S * Hkv * D * 2
    row = {"B": B, "cache": S, "gqa": ratio, "Hq": Hq, "Hkv": Hkv, "D": D, "pages": list(paged_caches),
           "kv_bytes": kv_bytes, "splits": splits, "pdl": pdl_used, "eager": {n: _stats(v) for n, v in eager.items()},
           "graph": {n: _stats(v) for n, v in graph.items() if v}}
    if args.pdl:
        row["pdl_ratios"] = pdl_ratios(graph)
    for mode in ("eager", "graph"):
        for s in row[mode].values():
            s["bw_pct"] = kv_bytes / (s["median_us"] * 1e-6) / (args.peak_tbs * 1e12) * 100
        sd = {n: s["median_us"] for n, s in row[mode].items() if n.startswith("sdpa")}
        if sd:
            best = min(sd, key=sd.get)
            row[f"{mode}_sdpa_best"] = best
            for s in row[mode].values():
                s["vs_sdpa"] = sd[best] / s["median_us"]
    return row


def pdl_ratios(times: dict[str, list[float]]) -> dict[str, dict]:
    """Per cache kind with all three policies timed (``ours``, ``ours@on``, ``ours@off``, ...):
    the per-round ratios on/off (< 1: PDL faster) and rule/min(on, off) (1: the rule picked the
    faster policy that round), as median, min and max over rounds."""
    out = {}
    for name in times:
        on, off = times.get(name + "@on"), times.get(name + "@off")
        rule = times[name]
        if "@" in name or not on or not off or len(on) != len(rule) or len(off) != len(rule):
            continue
        pairs = {"on/off": [a / b for a, b in zip(on, off)],
                 "rule/best": [r / min(a, b) for r, a, b in zip(rule, on, off)]}
        out[name] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in pairs.items()}
    return out


def pdl_summary(rows: list[dict]) -> None:
    """The ``--pdl`` table: per shape and cache kind, the graph times of the three policies, the
    rule's decision (PDL / plain) and the per-round ratios (median [min-max])."""
    lines = []
    for r in rows:
        g = r.get("graph", {})
        for name, ratios in r.get("pdl_ratios", {}).items():
            oo, rb = ratios["on/off"], ratios["rule/best"]
            used = r.get("pdl", {}).get(name)
            on, off, rule = (g[name + "@on"]["median_us"], g[name + "@off"]["median_us"], g[name]["median_us"])
            lines.append(f"{r['B']:>3} {r['cache']:>6} {r['gqa']:>3}:1 {name:>5} | {on:>8.1f} {off:>8.1f} {rule:>8.1f} "
                         f"{'PDL' if used else 'plain' if used is not None else '?':>5} | "
                         f"{oo['median']:>5.2f} [{oo['min']:.2f}-{oo['max']:.2f}] | "
                         f"{rb['median']:>5.2f} [{rb['min']:.2f}-{rb['max']:.2f}]")
    if not lines:
        return
    print("\nPDL policies (CUDA-graph replay us; on = PDL wherever compiled in, off = never, rule = the runtime's "
          "per-call choice;\n on/off < 1: PDL faster; rule/best: the rule's time / the faster policy's, per round: "
          "median [min-max], 1.00 = the rule picked the faster)")
    print(f"{'B':>3} {'cache':>6} {'gqa':>4} {'kind':>5} | {'on us':>8} {'off us':>8} {'rule us':>8} {'rule':>5} | "
          f"{'on/off':>17} | {'rule/best':>17}")
    for line in lines:
        print(line)


def _print_row(row: dict) -> None:
    head = f"B={row['B']:<3} cache={row['cache']:<6} gqa={row['gqa']}:1"
    for mode in ("graph", "eager"):
        stats = row.get(mode, {})
        if not stats:
            continue
        best = row.get(f"{mode}_sdpa_best")
        parts = []
        for n, s in sorted(stats.items(), key=lambda kv: (not kv[0].startswith("sdpa"), kv[0])):
            if n.startswith("sdpa") and n != best:
                continue
            used = row.get("splits", {}).get(n)
            pdl = row.get("pdl", {}).get(n)
            extra = ((f" x{s['vs_sdpa']:.2f}" if "vs_sdpa" in s else "") + f" {s.get('bw_pct', 0):.0f}%bw"
                     + (f" /{used}s" if used else "") + ("" if pdl is None or "@" in n else " pdl" if pdl else " plain")
                     if not n.startswith("sdpa") else "")
            parts.append(f"{n} {s['median_us']:.1f}us±{s['spread'] * 100:.0f}%{extra}")
        print(f"{head} [{mode}] " + " | ".join(parts), flush=True)


def summary(rows: list[dict]) -> None:
    """The compact final table: per shape SDPA's best backend, ours (the runtime's default choice)
    and each paged cache, as time, ratio vs SDPA (x, >1 = faster), % of peak bandwidth, and the
    paged/contiguous speed ratio (/c)."""
    nan = float("nan")
    pages = sorted({p for r in rows for p in r.get("pages", [])})
    print("\nSUMMARY (CUDA-graph replay = kernel time; x = SDPA best time / ours; bw = K/V bytes / time / peak; "
          "/c = contiguous time / paged time)")
    head = f"{'B':>3} {'cache':>6} {'gqa':>4} | {'sdpa best':>15} {'us':>8} | {'ours us':>8} {'x':>5} {'bw%':>4}"
    for page in pages:
        head += f" | {'p' + str(page) + ' us':>8} {'x':>5} {'bw%':>4} {'/c':>5}"
    print(head + f" | {'eager x':>7}")
    for r in rows:
        g, e = r.get("graph", {}), r.get("eager", {})
        best = r.get("graph_sdpa_best")
        o = g.get("ours")
        if not o:
            continue
        sdpa = f"{best:>15} {g[best]['median_us']:>8.1f}" if best else f"{'-':>15} {'-':>8}"
        line = (f"{r['B']:>3} {r['cache']:>6} {r['gqa']:>3}:1 | {sdpa} | "
                f"{o['median_us']:>8.1f} {o.get('vs_sdpa', nan):>5.2f} {o.get('bw_pct', nan):>4.0f}")
        for page in pages:
            p = g.get(f"p{page}")
            if p:
                line += (f" | {p['median_us']:>8.1f} {p.get('vs_sdpa', nan):>5.2f} {p.get('bw_pct', nan):>4.0f} "
                         f"{o['median_us'] / p['median_us']:>5.2f}")
            else:
                line += f" | {'-':>8} {'-':>5} {'-':>4} {'-':>5}"
        print(line + f" | {e.get('ours', {}).get('vs_sdpa', nan):>7.2f}")
    extra = sorted({n for r in rows for n in r.get("graph", {}) if "#" in n or "=" in n})
    if extra:
        print("forced contenders: B/cache/gqa x vs SDPA's best [the default contender's time / this one's: < 1 = the "
              "default is faster] (split counts: default/this)")
    for n in extra:
        base = n.split("#")[0].split("=")[0]
        vals = []
        for r in rows:
            g, used = r.get("graph", {}), r.get("splits", {})
            if n not in g or "vs_sdpa" not in g[n]:
                continue
            vals.append(f"{r['B']}/{r['cache']}/{r['gqa']}:1 x{g[n]['vs_sdpa']:.2f}"
                        + (f" [{g[base]['median_us'] / g[n]['median_us']:.2f}]" if base in g else "")
                        + (f" ({used.get(base)}/{used.get(n)})" if used.get(n) else ""))
        print(f"{n}: " + ", ".join(vals))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``), with ``--gqa``'s default per mode."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--cache", type=int, nargs="+", default=[2048, 4096, 8192, 32768])
    ap.add_argument("--gqa", type=int, nargs="+", default=None,
                    help="query heads per KV head (default: 4 8; --prefill: 4)")
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--shapes", nargs="*", default=[],
                    help="BxS pairs (e.g. 8x512 1x8192) instead of every --b with every --cache")
    ap.add_argument("--page", type=int, nargs="*", default=[16, 256],
                    help="page sizes of the paged contenders (multiples of 16; vLLM 16, FlashAttention 256)")
    ap.add_argument("--config", type=int, nargs="*", default=[],
                    help="tuning config indices to time besides the runtime's own choice")
    ap.add_argument("--waves", type=int, default=None, help="split rule: programs per SM to aim for")
    ap.add_argument("--min-blocks", type=int, nargs="*", default=[],
                    help="split rule: key blocks per split at least (one forced contender per value and --config)")
    ap.add_argument("--splits", type=int, nargs="*", default=[],
                    help="forced split counts to time besides the rule's (1: no split, no combine launch)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="memory bandwidth for the %% column (H200: 4.8)")
    ap.add_argument("--llama", action="store_true", help="the generation benchmark instead of the kernel table")
    ap.add_argument("--llama-sdpa", nargs="+", default=list(LLAMA_SDPA), choices=LLAMA_SDPA,
                    help="SDPA contenders of --llama: torch's own choice and forced backends")
    ap.add_argument("--llama-padding", nargs="+", default=list(LLAMA_PADDING), choices=LLAMA_PADDING,
                    help="batch modes of --llama: none (8 x 512-token prompts), left (8 prompts of 64..512 "
                         "tokens left-padded to 512); default both")
    ap.add_argument("--prefill", action="store_true",
                    help="causal prefill from paged caches (--page) vs the varlen forward, instead of the kernel table")
    ap.add_argument("--prefill-shapes", nargs="+", default=list(PREFILL_SHAPES),
                    help=f"BxS pairs of --prefill: batch x query rows (default: {' '.join(PREFILL_SHAPES)})")
    ap.add_argument("--pdl", action="store_true",
                    help="also time the default contenders with PDL always on (@on) and off (@off): the rule vs both")
    ap.add_argument("--sdpa", action=argparse.BooleanOptionalAction, default=True,
                    help="time SDPA's backends (--no-sdpa: aotriton-rt's contenders only)")
    ap.add_argument("--fp8", action="store_true",
                    help="fp8 (e4m3) KV caches against bf16 ones instead of the kernel table")
    ap.add_argument("--fp8-shapes", nargs="+", default=list(FP8_SHAPES), help="BxS pairs of the --fp8 table")
    ap.add_argument("--baseline", default=None,
                    help="--fp8: a second image folder whose contenders run in the same rounds as 'base:...' "
                         "(e.g. images built by another Triton release)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.gqa is None:
        args.gqa = [4] if args.prefill else [4, 8]
    return args


def main() -> None:
    args = parse_args()
    images = os.environ.get("AOTRITON_RT_IMAGES")
    lib = aotriton_rt.Library(images) if images else aotriton_rt.default_library()
    pdl = os.environ.get("AOTRITON_RT_CUDA_PDL", "on")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  images {images or 'default'}  "
          f"PDL launches {pdl}")
    result: dict = {"device": torch.cuda.get_device_name(), "args": vars(args), "pdl": pdl}
    if args.llama:
        result["llama"] = llama(args, lib)
    if args.prefill:
        result["prefill"] = {"rows": prefill_table(args, lib)}
        prefill_summary(result["prefill"]["rows"])
    if args.fp8:
        base = aotriton_rt.Library(args.baseline) if args.baseline else None
        result["fp8"] = {"rows": fp8_table(args, lib, base)}
        fp8_summary(result["fp8"]["rows"])
    if not (args.llama or args.prefill or args.fp8):
        rows = kernel_table(args, lib)
        result["rows"] = rows
        summary(rows)
        pdl_summary(rows)
    out = args.json or (os.path.join(os.environ["OUT"], "decode_bench.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
