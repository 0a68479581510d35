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
- ``ours~separate`` / ``p16~fused``: with ``--combine separate`` (or ``fused``), the split
  partials merged by the separate ``attn_decode_combine`` launch (the previous default) or by
  the decode kernel's last split (the default, one launch): both ways timed in the same run.

Each contender is timed two ways: ``eager`` (back-to-back calls between CUDA events, so host
cost counts where it exceeds the kernel's) and ``graph`` (the same calls captured in a CUDA
graph and replayed: kernel time). Reported: medians over ``--rounds`` rounds, spread
(max-min)/median, ratio vs SDPA's best backend, and K/V bandwidth (bytes of the visible K and V
/ time) as % of ``--peak-tbs``. Outputs are checked before timing against an fp32 reference of
at most four sequences, computed one sequence at a time (a whole-batch fp32 reference with K/V
repeated per query head would be 64 GiB at B=64, 32k cache, GQA 8:1).

``--llama``: the issue's generation benchmark: a randomly initialised Llama-style model (16
layers, hidden 2048, 16 query / 4 KV heads, head dim 128, bf16; no download) generating 128
tokens for 8 sequences from 512-token prompts through transformers' attention interface, with
``sdpa`` and with aotriton-rt (``aotriton_rt.integrations.transformers``), alternating; also a
prefill forward and a training step (forward + backward) per implementation, and the attention
share of decode steps from the profiler.

    python bench/decode.py                                   # the kernel table
    python bench/decode.py --config 0 1 2 --b 8 64 --cache 8192
    python bench/decode.py --b 1 8 64 --cache 2048 8192 32768 --gqa 4 --page 16 64 256 --combine separate
    python bench/decode.py --llama --rounds 3
Images: AOTRITON_RT_IMAGES (or the default library). Writes JSON under $OUT when set.
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
        # Captured on the warm-up stream: the fused combine's counters are made (zeroed) per
        # stream outside a capture, so the capture finds them there.
        with torch.cuda.graph(self.graph, stream=stream):
            for _ in range(calls):
                fn()
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


def _variants(args: argparse.Namespace, default_rules: Any) -> list[tuple[str, list]]:
    """(tag, tuning rules) of the forced contenders: each ``--config`` with each ``--min-blocks``
    (tag ``#2`` or ``#0mb1``) and the ``--waves`` override; each ``--combine`` mode (tag
    ``~separate``) with the images' own rules otherwise (their configs and splits)."""
    out = []
    for config in args.config:
        for mb in args.min_blocks or [None]:
            splits = {}
            if args.waves is not None:
                splits["waves"] = args.waves
            if mb is not None:
                splits["min_blocks"] = mb
            tag = f"#{config}" + (f"mb{mb}" if mb is not None else "") + (f"w{args.waves}" if args.waves else "")
            out.append((tag, [{"config": config, **({"splits": splits} if splits else {})}]))
    for mode in args.combine:
        out.append((f"~{mode}", [{**r, "combine": mode} for r in default_rules or []] + [{"combine": mode}]))
    return out


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
    for B in args.b:
        for S in args.cache:
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
    ks = dec._kernels_of(lib)
    Hq = Hkv * ratio
    gen = torch.Generator(device="cuda").manual_seed(B * 131 + S + ratio)
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=dtype, generator=gen)
    kc = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=gen)
    vc = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=gen)
    # One shuffled-page copy of the cache per page size: (num_pages, page, Hkv, D) and its table.
    paged_caches = {}
    for page in args.page:
        if S % page:
            continue
        blocks = S // page
        perm = torch.randperm(B * blocks, device="cuda", generator=gen)
        kp = torch.empty(B * blocks, page, Hkv, D, device="cuda", dtype=dtype)
        vp = torch.empty_like(kp)
        kp[perm] = kc.view(B * blocks, page, Hkv, D)
        vp[perm] = vc.view(B * blocks, page, Hkv, D)
        paged_caches[page] = (kp, vp, perm.view(B, blocks).to(torch.int32))
    # SDPA's layout: (B, H, S, D) views of the same memory.
    qs, ks_, vs = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    checked = _checked_sequences(B)
    ref = _reference(qs, ks_, vs, checked)
    contenders: dict[str, Any] = {}
    for be in SDPA_BACKENDS:
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
    variants = [("", default_rules), *_variants(args, default_rules)]
    for tag, rules in variants:
        def ours(rules: Any = rules) -> Any:
            ks.rules = rules
            return dec.decode_attention(q, kc, vc, causal=True, library=lib)[0]

        todo = [(f"ours{tag}", ours)]
        for page, (kp, vp, table) in paged_caches.items():
            def paged(rules: Any = rules, kp: Any = kp, vp: Any = vp, table: Any = table) -> Any:
                ks.rules = rules
                return dec.decode_attention(q, kp, vp, block_table=table, causal=True, library=lib)[0]
            todo.append((f"p{page}{tag}", paged))
        for name, fn in todo:
            err = _max_error(fn(), ref, checked)
            if err > 5e-2:
                print(f"  {name} B={B} S={S} gqa={ratio}: wrong (max error {err:.3g}); skipped")
                continue
            contenders[name] = fn
    graphs = {}
    for name, fn in contenders.items():
        try:
            graphs[name] = Graphed(fn)
        except RuntimeError as e:  # a backend that cannot be captured: eager only
            print(f"  {name}: no CUDA graph ({str(e)[:80]})")
    eager = {n: [] for n in contenders}
    graph = {n: [] for n in graphs}
    order = list(contenders)
    for r in range(args.rounds):
        random.Random(r).shuffle(order)
        for name in order:
            eager[name].append(eager_ms(contenders[name]))
            if name in graphs:
                graph[name].append(graphs[name].ms())
    kv_bytes = 2 * B * S * Hkv * D * 2
    row = {"B": B, "cache": S, "gqa": ratio, "Hq": Hq, "Hkv": Hkv, "D": D, "pages": list(paged_caches),
           "kv_bytes": kv_bytes, "eager": {n: _stats(v) for n, v in eager.items()},
           "graph": {n: _stats(v) for n, v in graph.items() if v}}
    for mode in ("eager", "graph"):
        sd = {n: s["median_us"] for n, s in row[mode].items() if n.startswith("sdpa")}
        if sd:
            best = min(sd, key=sd.get)
            row[f"{mode}_sdpa_best"] = best
            for s in row[mode].values():
                s["vs_sdpa"] = sd[best] / s["median_us"]
                s["bw_pct"] = kv_bytes / (s["median_us"] * 1e-6) / (args.peak_tbs * 1e12) * 100
    return row


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
            extra = f" x{s.get('vs_sdpa', 0):.2f} {s.get('bw_pct', 0):.0f}%bw" if not n.startswith("sdpa") else ""
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
        if not (best and o):
            continue
        line = (f"{r['B']:>3} {r['cache']:>6} {r['gqa']:>3}:1 | {best:>15} {g[best]['median_us']:>8.1f} | "
                f"{o['median_us']:>8.1f} {o['vs_sdpa']:>5.2f} {o['bw_pct']:>4.0f}")
        for page in pages:
            p = g.get(f"p{page}")
            if p:
                line += (f" | {p['median_us']:>8.1f} {p['vs_sdpa']:>5.2f} {p['bw_pct']:>4.0f} "
                         f"{o['median_us'] / p['median_us']:>5.2f}")
            else:
                line += f" | {'-':>8} {'-':>5} {'-':>4} {'-':>5}"
        print(line + f" | {e.get('ours', {}).get('vs_sdpa', nan):>7.2f}")
    extra = sorted({n for r in rows for n in r.get("graph", {}) if "#" in n or "~" in n})
    if extra:
        print("forced contenders: x vs SDPA's best [the default contender's time / this one's: < 1 = the default "
              "is faster]")
    for n in extra:
        base = n.split("#")[0].split("~")[0]
        vals = [f"{r['B']}/{r['cache']}/{r['gqa']}:1 x{r['graph'][n]['vs_sdpa']:.2f}"
                + (f" [{r['graph'][base]['median_us'] / r['graph'][n]['median_us']:.2f}]" if base in r['graph'] else "")
                for r in rows if n in r.get("graph", {}) and "vs_sdpa" in r["graph"][n]]
        print(f"{n}: " + ", ".join(vals))


# ------------------------------------------------------------------------------------------------
# The Llama-style generation benchmark.
# ------------------------------------------------------------------------------------------------

def llama(args: argparse.Namespace, lib: Any) -> dict:
    import transformers

    import aotriton_rt.integrations.transformers as hf

    name = hf.register(library=lib)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                                      head_dim=128, max_position_embeddings=4096, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    gen = torch.Generator(device="cuda").manual_seed(1)
    prompt = torch.randint(3, 32000, (8, 512), device="cuda", generator=gen)
    mask = torch.ones_like(prompt)
    kw = {"max_new_tokens": 128, "min_new_tokens": 128, "do_sample": False, "attention_mask": mask,
          "pad_token_id": 0, "eos_token_id": None}
    impls = ["sdpa", name]
    times: dict[str, dict[str, list]] = {i: {"generate": [], "prefill": [], "train_step": []} for i in impls}
    outputs = {}
    for impl in impls:  # warm up (and compile nothing: aotriton is ahead of time)
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outputs[impl] = model.generate(prompt, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
    for r in range(args.rounds):
        order = impls if r % 2 == 0 else impls[::-1]
        for impl in order:
            model.set_attn_implementation(impl)
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                outputs[impl] = model.generate(prompt, **kw)
            torch.cuda.synchronize()
            times[impl]["generate"].append(time.perf_counter() - t)
            with torch.no_grad():
                times[impl]["prefill"].append(eager_ms(lambda: model(prompt, attention_mask=mask), 300) / 1e3)
            model.train()

            def step() -> None:
                out = model(prompt, attention_mask=mask)
                out.logits.float().mean().backward()
            times[impl]["train_step"].append(eager_ms(step, 1500) / 1e3)
            model.zero_grad(set_to_none=True)
            model.eval()
    agree = (outputs[name][:, 512:] == outputs["sdpa"][:, 512:]).float().mean().item()
    share = {impl: attention_share(model, impl, prompt, mask) for impl in impls}
    result = {"impls": impls, "times": times, "greedy_agreement": agree, "attention_share": share}
    print("\nLLAMA (16 layers, hidden 2048, 16/4 heads, D=128, bf16; 8 x 512 prompt, 128 new tokens)")
    for what in ("generate", "prefill", "train_step"):
        s = statistics.median(times["sdpa"][what])
        o = statistics.median(times[name][what])
        spread = (max(times[name][what]) - min(times[name][what])) / o
        print(f"  {what:<11} sdpa {s * 1e3:9.1f} ms | aotriton {o * 1e3:9.1f} ms ±{spread * 100:.0f}% | "
              f"speed vs sdpa x{s / o:.3f}")
    a, b = share["sdpa"], share[name]
    print(f"  attention per decode step (profiled): sdpa {a['attn_us_per_step']:.1f} us, aotriton "
          f"{b['attn_us_per_step']:.1f} us, ratio {b['attn_us_per_step'] / max(a['attn_us_per_step'], 1e-9):.2f} "
          f"(of {a['total_us_per_step']:.0f} / {b['total_us_per_step']:.0f} us GPU time per step)")
    print(f"  greedy tokens equal to sdpa's: {agree * 100:.1f}%")
    return result


ATTENTION_KERNELS = ("attn", "flash", "fmha", "sdpa", "attention", "gqa")


def attention_share(model: Any, impl: str, prompt: Any, mask: Any, steps: int = 16) -> dict:
    """GPU time of attention kernels per decode step, from the profiler: ``steps`` cached decoding
    steps after a prefill (kernels named like attention count as attention)."""
    from torch.profiler import ProfilerActivity, profile

    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model(prompt, attention_mask=mask, use_cache=True)
        cache = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        m = mask
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                m = torch.cat([m, torch.ones_like(tok)], 1)
                out = model(tok, attention_mask=m, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
    attn = total = 0.0
    names: dict[str, float] = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if not t or evt.key.startswith(("cuda", "Memcpy", "Memset", "aten::", "ProfilerStep")):
            continue
        total += t
        if any(s in evt.key.lower() for s in ATTENTION_KERNELS):
            attn += t
            names[evt.key[:60]] = t / steps
    return {"attn_us_per_step": attn / steps, "total_us_per_step": total / steps, "kernels": names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--cache", type=int, nargs="+", default=[2048, 4096, 8192, 32768])
    ap.add_argument("--gqa", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--page", type=int, nargs="+", default=[16, 256],
                    help="page sizes of the paged contenders (multiples of 16; vLLM 16, FlashAttention 256)")
    ap.add_argument("--config", type=int, nargs="*", default=[],
                    help="tuning config indices to time besides the runtime's own choice")
    ap.add_argument("--waves", type=int, default=None, help="split rule: programs per SM to aim for")
    ap.add_argument("--min-blocks", type=int, nargs="*", default=[],
                    help="split rule: key blocks per split at least (one forced contender per value and --config)")
    ap.add_argument("--combine", nargs="*", default=[], choices=("fused", "separate"),
                    help="also time the split partials merged this way (one forced contender per value)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="memory bandwidth for the %% column (H200: 4.8)")
    ap.add_argument("--llama", action="store_true", help="the generation benchmark instead of the kernel table")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    images = os.environ.get("AOTRITON_RT_IMAGES")
    lib = aotriton_rt.Library(images) if images else aotriton_rt.default_library()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  images {images or 'default'}")
    result: dict = {"device": torch.cuda.get_device_name(), "args": vars(args)}
    if args.llama:
        result["llama"] = llama(args, lib)
    else:
        rows = kernel_table(args, lib)
        result["rows"] = rows
        summary(rows)
    out = args.json or (os.path.join(os.environ["OUT"], "decode_bench.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
