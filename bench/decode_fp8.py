"""fp8 (e4m3) KV caches against bf16 ones in decode attention (``python bench/decode.py --fp8``).

Per ``--fp8-shapes BxS`` (default 32x8192 64x8192): one query row per sequence, bf16 queries,
``--hkv`` KV heads (8) with ``--gqa`` 4 (32 query heads), ``--d`` 128, every cached key visible.
Contenders, in a shuffled order every round (bench/gpu_common.py's ``timed_rounds``):

- ``bf16``: ``decode_attention`` on a contiguous bf16 cache ``(B, S, Hkv, D)``;
- ``fp8``: the same rows quantised to e4m3 (``float8_e4m3fn``; ``float8_e4m3fnuz`` on gfx942)
  with one scale per KV head (``k_scale``/``v_scale`` of shape ``(Hkv,)``);
- ``p16:bf16``, ``p16:fp8`` (``--page``, first size only): the same caches in shuffled pages;
- ``fp8#4`` ... ``fp8#8`` (and ``p16:`` ones): with one of sm90's configs #4-#8 forced (configs
  #0 and #2 with V read in 4-byte words and widened before its dot; #6 with six stages; #7 and #8
  with 128-key blocks, 4 and 8 warps), where the images hold them (gputest, full). The runtime's
  own choice is #2 from 212 (sequence, KV head) pairs on, else #0.

With ``--baseline DIR`` every contender runs again on the images of ``DIR`` in the same rounds,
tagged ``base:`` (e.g. images built by another Triton release; the speedups stay per library).
Each is timed from a CUDA graph of 10 calls (and eagerly). Reported: medians over ``--rounds``
rounds with their spread ((max-min)/median), the K/V bandwidth (bytes read / time) as % of
``--peak-tbs``, and per round the fp8 time over the bf16 time as a speedup, median [min-max]
(the aim: >= 1.7 at batch >= 32 with 8k keys). The fp8 answer's error against an fp32 reference
of its dequantised cache is checked before timing, with the bf16 cache's for comparison.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from aotriton_rt.ops import decode as dec
from bench.gpu_common import _stats, graphed, paged_copies, parse_pairs, timed_rounds

FP8_SHAPES = ("32x8192", "64x8192")


def fp8_type() -> Any:
    """The GPU's e4m3 cache type."""
    if getattr(torch.version, "hip", None) and "gfx942" in torch.cuda.get_device_properties(0).gcnArchName:
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def _error(out: Any, q: Any, k: Any, v: Any) -> float:
    """Max |out - fp32 reference| over the first sequence (k, v: its real-valued rows)."""
    hq, hk = q.shape[2], k.shape[2]
    kk = k[0].float().transpose(0, 1).repeat_interleave(hq // hk, 0)
    vv = v[0].float().transpose(0, 1).repeat_interleave(hq // hk, 0)
    s = q[0].float().transpose(0, 1) @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    ref = (torch.softmax(s, -1) @ vv).transpose(0, 1)
    return (out[0].float() - ref).abs().max().item()


#: sm90's fp8-only decode configs the table forces besides the runtime's own choice.
WIDENED = (4, 5, 6, 7, 8)


def _forced_view(lib: Any, config: int) -> Any:
    """A view of ``lib`` launching the fp8 decode variants' config ``config``, or None without it."""
    held = any(v.config.index == config and v.spec.get("KV_DTYPE", "").startswith("fp8")
               for v in lib.variants_of("attn_decode"))
    if not held:
        return None
    return lib.with_tuning({"attn_decode": [{"config": config, "splits": {"waves": 2, "min_blocks": 4,
                                                                           "max_splits": 64}}]})


def _contender(lib: Any, q: Any, lens: Any, k: Any, v: Any, table: Any, kw: dict) -> Any:
    return lambda: dec.decode_attention(q, k, v, cache_seqlens=lens, block_table=table, library=lib, **kw)[0]


def fp8_table(args: Any, lib: Any, base: Any = None) -> list[dict]:
    rows = []
    fp8 = fp8_type()
    top = torch.finfo(fp8).max
    for B, S in parse_pairs(args.fp8_shapes, "--fp8-shapes", "32x8192"):
        hk, hq, d = args.hkv, args.hkv * args.gqa[0], args.d
        gen = torch.Generator(device="cuda").manual_seed(B * S)
        q = torch.randn(B, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        kc, vc = (torch.randn(B, S, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        ks = kc.float().abs().amax((0, 1, 3)) / top  # one scale per KV head, as a calibration would give
        vs = vc.float().abs().amax((0, 1, 3)) / top
        k8 = (kc.float() / ks[None, None, :, None]).to(fp8)
        v8 = (vc.float() / vs[None, None, :, None]).to(fp8)
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        caches = {"bf16": (kc, vc, None, {}), "fp8": (k8, v8, None, {"k_scale": ks, "v_scale": vs})}
        if args.page:
            page = args.page[0]
            for name, (k, v, _, kw) in list(caches.items()):
                for size, (kp, vp, table) in paged_copies(k.view(torch.uint8) if k.dtype == fp8 else k,
                                                          v.view(torch.uint8) if v.dtype == fp8 else v,
                                                          [page], gen).items():
                    if k.dtype == fp8:
                        kp, vp = kp.view(fp8), vp.view(fp8)
                    caches[f"p{size}:{name}"] = (kp, vp, table.cuda(), kw)

        fns = {}
        for prefix, images in (("", lib), ("base:", base)):
            if images is None:
                continue
            fns.update({prefix + name: _contender(images, q, lens, *c) for name, c in caches.items()})
            for config in WIDENED:
                forced = _forced_view(images, config)
                if forced is not None:
                    fns.update({f"{prefix}{name}#{config}": _contender(forced, q, lens, *c)
                                for name, c in caches.items() if "fp8" in name})
        deq = (k8.float() * ks[None, None, :, None], v8.float() * vs[None, None, :, None])
        errors = {n: _error(fns[n](), q, kc, vc) if n.endswith("bf16") else _error(fns[n](), q, *deq)
                  for n in fns if ":" not in n.removeprefix("base:")}
        graphs = graphed(fns, 10)
        eager, graph = timed_rounds(fns, graphs, args.rounds)
        times = {n: graph[n] if n in graphs else eager[n] for n in fns}
        row: dict = {"B": B, "S": S, "hq": hq, "hkv": hk, "d": d, "errors": errors, "contenders": {}}
        for name, runs in times.items():
            kv_bytes = 2 * B * S * hk * d * (1 if "fp8" in name else 2)
            row["contenders"][name] = {**_stats(runs), "graph": name in graphs,
                                       "bw_pct": 100 * kv_bytes / (statistics.median(runs) * 1e-3) / (
                                           args.peak_tbs * 1e12)}
        for images in ("", "base:"):
            for cache in ("", f"p{args.page[0]}:" if args.page else None):
                for tag in ("", *(f"#{c}" for c in WIDENED)):
                    if cache is None or f"{images}{cache}fp8{tag}" not in times:
                        continue
                    ratios = [a / b for a, b in zip(times[f"{images}{cache}bf16"], times[f"{images}{cache}fp8{tag}"])]
                    row.setdefault("speedup", {})[images + (cache.rstrip(":") or "contiguous") + tag] = {
                        "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        if base is not None:  # each contender on these images over the same on the baseline's
            for name in [n for n in times if not n.startswith("base:") and f"base:{n}" in times]:
                ratios = [b / a for a, b in zip(times[name], times[f"base:{name}"])]
                row.setdefault("over_base", {})[name] = {"median": statistics.median(ratios), "min": min(ratios),
                                                         "max": max(ratios)}
        rows.append(row)
        _print_row(row)
    return rows


def _print_row(row: dict) -> None:
    print(f"B={row['B']} S={row['S']} Hq={row['hq']} Hkv={row['hkv']} D={row['d']}  max error vs fp32: "
          + ", ".join(f"{n} {e:.2e}" for n, e in row["errors"].items()) + " (fp8: of its dequantised cache)")
    for name, st in row["contenders"].items():
        print(f"  {name:10s} {st['median_us']:9.1f} us  spread {100 * st['spread']:4.1f}%  "
              f"{st['bw_pct']:5.1f}% of peak{'' if st['graph'] else '  (eager)'}")
    for cache, x in row.get("speedup", {}).items():
        print(f"  fp8 speedup over bf16 ({cache}): {x['median']:.2f}x [{x['min']:.2f}-{x['max']:.2f}] (aim >= 1.7)",
              flush=True)
    for name, x in row.get("over_base", {}).items():
        print(f"  {name} against the baseline images: {x['median']:.3f}x as fast [{x['min']:.3f}-{x['max']:.3f}]",
              flush=True)


def fp8_summary(rows: list[dict]) -> None:
    worst = [x["median"] for r in rows for x in r.get("speedup", {}).values()]
    if worst:
        print(f"fp8 over bf16, worst median speedup: {min(worst):.2f}x (aim >= 1.7 at batch >= 32, 8k keys)")

