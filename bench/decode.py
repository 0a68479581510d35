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
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/NAME.py`: the checkout on the path (python -m bench.NAME needs none)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import aotriton_rt  # noqa: E402
from aotriton_rt.ops import decode as dec  # noqa: E402

SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")  # math only when the others refuse


def _sdpa_backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def eager_ms(fn: Any, budget_ms: float = 60.0) -> float:
    """ms per call of back-to-back calls between two events (one batch)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(3, min(200, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def graphed(contenders: dict[str, Any], calls: int) -> dict[str, Graphed]:
    """Each contender captured as :class:`Graphed` (``calls`` calls per replay); one that cannot
    be captured (a backend's refusal, or ours) is left to the eager rounds, with a line saying so."""
    import aotriton_rt

    graphs = {}
    for name, fn in contenders.items():
        try:
            graphs[name] = Graphed(fn, calls=calls)
        except (RuntimeError, aotriton_rt.AotritonError) as e:
            print(f"  {name}: no CUDA graph ({str(e)[:80]})")
    return graphs


def timed_rounds(contenders: dict[str, Any], graphs: dict[str, Graphed], rounds: int
                 ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(eager ms, graph-replay ms) per contender and round, the order shuffled (seeded) per round."""
    eager: dict[str, list[float]] = {n: [] for n in contenders}
    graph: dict[str, list[float]] = {n: [] for n in graphs}
    order = list(contenders)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for name in order:
            eager[name].append(eager_ms(contenders[name]))
            if name in graphs:
                graph[name].append(graphs[name].ms())
    return eager, graph


class Graphed:
    """``calls`` invocations of ``fn`` captured in one CUDA graph; ``ms()`` times a replay."""

    def __init__(self, fn: Any, calls: int = 20) -> None:
        self.calls = calls
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            for _ in range(calls):
                self.out = fn()  # the last call's output: what a replay leaves (checked after the timing)
        self.graph.replay()
        torch.cuda.synchronize()

    def ms(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / self.calls


def _stats(values: list[float]) -> dict:
    med = statistics.median(values)
    return {"median_us": med * 1e3, "spread": (max(values) - min(values)) / med if med else 0.0,
            "runs": [v * 1e3 for v in values]}


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


def parse_pairs(items: list[str], flag: str, example: str) -> list[tuple[int, int]]:
    """``BxS`` strings as (B, S) pairs of positive integers; a malformed one exits naming ``flag``."""
    out = []
    for item in items:
        b, sep, s = item.lower().partition("x")
        if not (sep and b.isdigit() and s.isdigit() and int(b) > 0 and int(s) > 0):
            raise SystemExit(f"{flag}: {item!r} is not BxS (e.g. {example})")
        out.append((int(b), int(s)))
    return out


def paged_copies(kc: Any, vc: Any, pages: list[int], gen: Any) -> dict[int, tuple[Any, Any, Any]]:
    """Per page size dividing the cache length: ``(k_pages, v_pages, block_table)``, a copy of the
    contiguous ``(B, S, Hkv, D)`` caches as ``(B * S / page, page, Hkv, D)`` pages in a shuffled
    order and its int32 ``(B, S / page)`` table."""
    B, S, Hkv, D = kc.shape
    out = {}
    for page in pages:
        if S % page:
            continue
        blocks = S // page
        perm = torch.randperm(B * blocks, device=kc.device, generator=gen)
        kp = torch.empty(B * blocks, page, Hkv, D, device=kc.device, dtype=kc.dtype)
        vp = torch.empty_like(kp)
        kp[perm] = kc.reshape(B * blocks, page, Hkv, D)
        vp[perm] = vc.reshape(B * blocks, page, Hkv, D)
        out[page] = (kp, vp, perm.view(B, blocks).to(torch.int32))
    return out


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


# ------------------------------------------------------------------------------------------------
# The Llama-style generation benchmark.
# ------------------------------------------------------------------------------------------------

#: SDPA contenders of the generation benchmark: torch's own backend choice ("default") and each
#: backend forced (``sdpa_kernel``); one that refuses a call of the model is dropped, with why.
LLAMA_SDPA = ("default", "flash", "cudnn", "efficient")
LLAMA_PROMPT, LLAMA_NEW, LLAMA_BATCH = 512, 128, 8
#: Batch modes of the generation benchmark: ``none``, 8 prompts of 512 tokens (an all-ones mask);
#: ``left``, 8 prompts of :data:`LLAMA_LENGTHS` tokens left-padded to 512.
LLAMA_PADDING = ("none", "left")
#: The left-padded batch's prompt lengths, in a fixed shuffled order over the sequences.
LLAMA_LENGTHS = (512, 448, 384, 320, 256, 192, 128, 64)


def llama_batch(padding: str, device: str = "cuda") -> dict:
    """The prompts of one batch mode, as a transformers user batching them would pass them.

    ``none``: ``LLAMA_BATCH x LLAMA_PROMPT`` random tokens, an all-ones mask, no position ids
    (the model's own). ``left``: the same tokens cut to :data:`LLAMA_LENGTHS` (shuffled
    deterministically over the sequences) and left-padded to ``LLAMA_PROMPT`` with token 0
    (the model's ``pad_token_id``) and mask 0; position ids as ``generate`` makes them (0 on
    the pads, then 0..length-1), for the forwards called outside ``generate``.

    Returns ``{"prompt", "mask", "positions", "lengths"}`` (``positions`` None for ``none``).
    """
    gen = torch.Generator(device=device).manual_seed(1)
    prompt = torch.randint(3, 32000, (LLAMA_BATCH, LLAMA_PROMPT), device=device, generator=gen)
    if padding == "none":
        return {"prompt": prompt, "mask": torch.ones_like(prompt), "positions": None,
                "lengths": [LLAMA_PROMPT] * LLAMA_BATCH}
    if padding != "left":
        raise ValueError(f"padding must be one of {LLAMA_PADDING}, got {padding!r}")
    lengths = list(LLAMA_LENGTHS)
    random.Random(7).shuffle(lengths)
    first = LLAMA_PROMPT - torch.tensor(lengths, device=device)
    mask = (torch.arange(LLAMA_PROMPT, device=device)[None, :] >= first[:, None]).to(prompt.dtype)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return {"prompt": prompt * mask, "mask": mask, "positions": positions, "lengths": lengths}


def train_loss(logits: Any, mask: Any, padded: bool) -> Any:
    """The training step's scalar: the mean of the fp32 logits, over the real tokens' positions
    only when the batch is ``padded`` (the pads' logits get no gradient)."""
    logits = logits.float()
    if not padded:
        return logits.mean()
    weights = mask.to(logits.dtype)[..., None]
    return (logits * weights).sum() / (weights.sum() * logits.shape[-1])


def _sdpa_context(backend: str | None) -> Any:
    """``sdpa_kernel(backend)`` for a forced SDPA backend; a no-op context otherwise."""
    import contextlib

    if backend in (None, "default"):
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(_sdpa_backend(backend))


def llama(args: argparse.Namespace, lib: Any) -> dict:
    """The generation benchmark, per batch mode (``--llama-padding``, :func:`llama_batch`) and
    contender: ``generate`` wall time (128 greedy tokens for 8 prompts padded to 512 tokens), a
    prefill forward, a training step (forward + backward of :func:`train_loss`, which leaves the
    pads out), and per decode step the host wall time, the GPU time and the attention kernels'
    GPU time (profiled).

    Contenders: ``aotriton`` (``aotriton_rt.integrations.transformers``) and ``sdpa:<backend>``
    for torch's own choice (``sdpa:default``, what ``attn_implementation="sdpa"`` runs) and each
    SDPA backend forced; a backend that refuses a mode's calls (flash takes no padding mask) is
    dropped from that mode only. Method: every contender is warmed up per mode by a full-length
    ``generate`` (every cache length the timed runs see: shape-keyed plan caches, e.g. cuDNN's,
    are as warm as they get; the cold time is reported, and the second mode's is that of a
    process that has run the first), a prefill and a training step; each round runs every
    (mode, contender) pair in one shuffled order; medians and spread (max-min)/median;
    ``generate`` never compiles (``disable_compile``) and every contender gets transformers'
    default cache class (checked: the class each ``generate`` returned is reported). Greedy
    tokens are compared with aotriton's of the same mode.

    Returns ``{mode: {"padding", "prompt_lengths", "contenders", "ours", "results"}}``.
    """
    import transformers

    import aotriton_rt.integrations.transformers as hf

    name = hf.register(library=lib)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                                      head_dim=128, max_position_embeddings=4096, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    batches = {mode: llama_batch(mode) for mode in dict.fromkeys(args.llama_padding)}
    kw = {"max_new_tokens": LLAMA_NEW, "min_new_tokens": LLAMA_NEW, "do_sample": False, "pad_token_id": 0,
          "eos_token_id": None, "disable_compile": True, "return_dict_in_generate": True}
    everyone = {name: (name, None), **{f"sdpa:{be}": ("sdpa", be) for be in args.llama_sdpa}}
    contenders = {mode: dict(everyone) for mode in batches}

    def generate(mode: str, key: str) -> tuple[float, Any]:
        impl, be = everyone[key]
        batch = batches[mode]
        model.set_attn_implementation(impl)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad(), _sdpa_context(be):
            out = model.generate(batch["prompt"], attention_mask=batch["mask"], **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    def prefill_ms(mode: str, key: str) -> float:
        impl, be = everyone[key]
        batch = batches[mode]
        model.set_attn_implementation(impl)
        with torch.no_grad(), _sdpa_context(be):
            return eager_ms(lambda: model(batch["prompt"], attention_mask=batch["mask"],
                                          position_ids=batch["positions"]), 300)

    def train_ms(mode: str, key: str) -> float:
        impl, be = everyone[key]
        batch = batches[mode]
        padded = batch["positions"] is not None
        model.set_attn_implementation(impl)
        model.train()

        def step() -> None:
            out = model(batch["prompt"], attention_mask=batch["mask"], position_ids=batch["positions"])
            train_loss(out.logits, batch["mask"], padded).backward()
        try:
            with _sdpa_context(be):
                return eager_ms(step, 800)
        finally:
            model.zero_grad(set_to_none=True)
            model.eval()

    results: dict[str, dict[str, dict]] = {mode: {} for mode in batches}
    tokens: dict[str, dict[str, Any]] = {mode: {} for mode in batches}
    for mode in batches:
        for key in list(contenders[mode]):
            try:
                cold, out = generate(mode, key)
                tokens[mode][key] = out.sequences[:, LLAMA_PROMPT:]
                results[mode][key] = {"cold_generate_ms": cold * 1e3, "cache": type(out.past_key_values).__name__,
                                      "generate_ms": [], "prefill_ms": [], "train_ms": []}
                prefill_ms(mode, key)
                train_ms(mode, key)
            except RuntimeError as e:  # an SDPA backend that refuses one of the model's calls
                if key == name:
                    raise
                print(f"  padding={mode} {key}: dropped ({str(e).splitlines()[0][:120]})", flush=True)
                results[mode].pop(key, None)
                contenders[mode].pop(key)
    order = [(mode, key) for mode in contenders for key in contenders[mode]]
    for r in range(args.rounds):
        random.Random(1000 + r).shuffle(order)
        for mode, key in order:
            res = results[mode][key]
            res["generate_ms"].append(generate(mode, key)[0] * 1e3)
            res["prefill_ms"].append(prefill_ms(mode, key))
            res["train_ms"].append(train_ms(mode, key))
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
            f"{mode}/{key} {results[mode][key]['generate_ms'][-1]:.0f} ms" for mode, key in order), flush=True)
    out: dict[str, dict] = {}
    for mode, batch in batches.items():
        for key in contenders[mode]:
            impl, be = everyone[key]
            res = results[mode][key]
            res["decode_step"] = decode_step_profile(model, impl, be, batch["prompt"], batch["mask"],
                                                     positions=batch["positions"])
            res["greedy_agreement_with_aotriton"] = (tokens[mode][key] == tokens[mode][name]).float().mean().item()
        out[mode] = {"padding": mode, "prompt_lengths": batch["lengths"], "contenders": list(contenders[mode]),
                     "ours": name, "results": results[mode]}
        peers = [k for k in contenders[mode] if k.startswith("sdpa")]
        if len(peers) >= 2:  # the baseline: how often two SDPA backends pick the same free-running token
            same = (tokens[mode][peers[0]] == tokens[mode][peers[1]]).float().mean().item()
            out[mode]["sdpa_pair_agreement"] = {"pair": peers[:2], "agreement": same}
    for mode in out:
        llama_summary(out[mode])
    return out


def _median_spread(values: list[float]) -> tuple[float, float]:
    med = statistics.median(values)
    return med, ((max(values) - min(values)) / med if med else 0.0)


def llama_summary(result: dict) -> None:
    """One batch mode's compact table of the generation benchmark and the acceptance's ratios,
    labelled ``padding=<mode>`` (a result without ``padding`` is the unpadded batch)."""
    res, ours = result["results"], result["ours"]
    mode = result.get("padding", "none")
    lengths = result.get("prompt_lengths") or [LLAMA_PROMPT] * LLAMA_BATCH
    if mode == "none":
        prompts = f"{len(lengths)} x {LLAMA_PROMPT} prompt"
    else:
        prompts = (f"{len(lengths)} prompts of {min(lengths)}..{max(lengths)} tokens, {mode}-padded to "
                   f"{LLAMA_PROMPT}")
    print(f"\nLLAMA padding={mode} (16 layers, hidden 2048, 16/4 heads, D=128, bf16; {prompts}, "
          f"{LLAMA_NEW} new tokens; medians, ±spread)")
    print(f"{'contender':<16} {'generate ms':>14} {'cold ms':>8} {'prefill ms':>12} {'train ms':>12} | decode step: "
          f"{'wall us':>8} {'GPU us':>7} {'attn us':>8} | cache, attention kernels")
    for key in result["contenders"]:
        r = res[key]
        g, gs = _median_spread(r["generate_ms"])
        p, ps = _median_spread(r["prefill_ms"])
        t, ts = _median_spread(r["train_ms"])
        d = r["decode_step"]
        kernels = ", ".join(n[:40] for n in sorted(d["kernels"], key=d["kernels"].get, reverse=True)[:2])
        print(f"{key:<16} {g:>9.0f} ±{gs * 100:>2.0f}% {r['cold_generate_ms']:>8.0f} {p:>8.1f} ±{ps * 100:>2.0f}% "
              f"{t:>8.1f} ±{ts * 100:>2.0f}% | {d['wall_us_per_step']:>21.0f} {d['gpu_us_per_step']:>7.0f} "
              f"{d['attn_us_per_step']:>8.1f} | {r['cache']}, {kernels}")
    agree = {k: r["greedy_agreement_with_aotriton"] for k, r in res.items()
             if k != ours and "greedy_agreement_with_aotriton" in r}
    if agree:
        pair = result.get("sdpa_pair_agreement")
        baseline = (f"; {pair['pair'][0]} vs {pair['pair'][1]}: {pair['agreement'] * 100:.1f}%" if pair else "")
        print(f"padding={mode}: greedy tokens equal to aotriton's: "
              + ", ".join(f"{k} {v * 100:.1f}%" for k, v in agree.items()) + baseline
              + " (free-running on random weights: one near-tie flips the rest of a sequence; the GPU test "
                "suite compares choices on a shared prefix)")
    sdpa = [k for k in result["contenders"] if k.startswith("sdpa")]
    if ours not in res or not sdpa:
        return
    med = {k: {w: statistics.median(res[k][w]) for w in ("generate_ms", "prefill_ms", "train_ms")} for k in res}
    best = min(sdpa, key=lambda k: med[k]["generate_ms"])
    for peer in dict.fromkeys(["sdpa:default", best]):
        if peer not in med:
            continue
        ratios = ", ".join(f"{w.removesuffix('_ms')} x{med[peer][w] / med[ours][w]:.2f}"
                           for w in ("generate_ms", "prefill_ms", "train_ms"))
        attn = res[ours]["decode_step"]["attn_us_per_step"] / max(res[peer]["decode_step"]["attn_us_per_step"], 1e-9)
        print(f"padding={mode}: aotriton vs {peer}{' (fastest SDPA generate)' if peer == best else ''}: speed {ratios} "
              f"(> 1: aotriton faster); attention GPU time per decode step ours/theirs {attn:.2f} (target <= 0.8)")
    caches = {res[k]["cache"] for k in res}
    if len(caches) > 1:
        print(f"WARNING: padding={mode}: the contenders' generate used different cache classes: {sorted(caches)}")


ATTENTION_KERNELS = ("attn", "flash", "fmha", "sdpa", "attention", "gqa")


def is_attention_kernel(name: str) -> bool:
    """Whether a GPU kernel name is an attention kernel (ours: attn_decode*, attn_fwd*; SDPA's
    flash, cuDNN ``*sdpa*``, memory-efficient ``fmha_cutlass*``)."""
    return any(s in name.lower() for s in ATTENTION_KERNELS)


def decode_step_profile(model: Any, impl: str, backend: str | None, prompt: Any, mask: Any, steps: int = 16,
                        positions: Any = None) -> dict:
    """Per cached decoding step (``steps`` of them after a prefill, the model's own forward as
    ``generate`` calls it): host wall time (unprofiled loop), GPU time of all kernels and of the
    attention kernels (``is_attention_kernel``), from the profiler. ``positions``: the prompt's
    position ids for a padded batch (each step then takes the next one, as ``generate`` does);
    None: the model's own."""
    from torch.profiler import ProfilerActivity, profile

    model.set_attn_implementation(impl)

    def run(profiled: bool) -> tuple[float, Any]:
        with torch.no_grad(), _sdpa_context(backend):
            out = model(prompt, attention_mask=mask, position_ids=positions, use_cache=True)
            cache, tok, m, pos = out.past_key_values, out.logits[:, -1:].argmax(-1), mask, positions
            torch.cuda.synchronize()
            prof = profile(activities=[ProfilerActivity.CUDA]) if profiled else None
            if prof is not None:
                prof.__enter__()
            t = time.perf_counter()
            for _ in range(steps):
                m = torch.cat([m, torch.ones_like(tok)], 1)
                pos = None if pos is None else pos[:, -1:] + 1
                out = model(tok, attention_mask=m, position_ids=pos, past_key_values=cache, use_cache=True)
                cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            if prof is not None:
                prof.__exit__(None, None, None)
        return wall, prof

    run(False)  # warm
    wall, _ = run(False)
    _, prof = run(True)
    attn = total = 0.0
    names: dict[str, float] = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if not t or evt.key.startswith(("cuda", "Memcpy", "Memset", "aten::", "ProfilerStep")):
            continue
        total += t
        if is_attention_kernel(evt.key):
            attn += t
            names[evt.key[:100]] = t / steps
    return {"wall_us_per_step": wall / steps * 1e6, "gpu_us_per_step": total / steps,
            "attn_us_per_step": attn / steps, "kernels": names}


# ------------------------------------------------------------------------------------------------
# Prefill from a paged cache against the contiguous variable-length forward.
# ------------------------------------------------------------------------------------------------

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
    if not (args.llama or args.prefill):
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
