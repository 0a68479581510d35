"""The sm90 backward with the Gluon dK/dV and dQ kernels against the portable ones and cuDNN, in one GPU run.

Per shape (B=4, H=32, N=4096; D=128 and 64; fp16 and bf16; no mask and causal), contenders time the
*whole* backward (preprocess, dK/dV, dQ, as ``aotriton_rt.attention_backward`` runs it, split scheme),
with the dK/dV and dQ kernels forced through ``builder.tune`` views:

- ``port+port``: the portable ``attn_bwd_dkdv`` and ``attn_bwd_dq`` (their config #0, the sm90
  sweep's winners);
- ``g#i+port``: the Gluon dK/dV ``attn_bwd_dkdv_sm90`` at its config i (every config the images
  hold for the spec) beside the portable dQ; at these lengths (multiples of 16) its aligned-length
  sibling ``attn_bwd_dkdv_sm90_a16`` runs where the images hold it, as the operator runs it (the
  JSON's ``launched`` says which);
- ``g#0+g#j``: the Gluon dK/dV at config 0 (the one the runtime launches untuned) beside the
  Gluon dQ ``attn_bwd_dq_sm90`` at its config j (every config held);
- ``g#p+g#q``: both Gluon kernels at their persistent configs (``PERSISTENT`` > 0), where held;
- ``g#i+atom``: the atomic scheme (``scheme="atomic"``: preprocess zeroing DQacc, the Gluon dK/dV
  with ``DQ_ATOMIC=1`` at its config i adding dQ = dS·K into DQacc, the convert kernel): five
  matmuls a tile instead of seven, FA3's scheme (the configs with ``DQ_TMA=1``, #4-#6 at D=128
  and #2/#3 at D=64, add each dQ tile with one TMA reduce-add from shared memory, the others with
  per-thread fp32 reductions);
- ``port+atom``: the same scheme on the portable ``attn_bwd_dkdv`` (``DQ_ATOMIC=1``), where the
  images hold it (gputest: fp16 D=64, bf16 D=128 causal);
- ``cudnn``: torch SDPA's cuDNN backward with inputs that require grad (what training runs).

Contenders run in rounds whose order is shuffled each round (:func:`builder.gputime.time_rounds`);
the table gives median TFLOP/s (10·B·H·N²·D, halved when causal), the min-max over rounds, and the
ratios to cuDNN and to ``port+port`` of the same run. Before timing, each shape checks that every
other contender's dq, dk, dv agree with the portable split kernels' on the timed inputs (max abs
difference relative to the largest gradient; the fp32-reference check is
tests/runtime/test_attention_bwd_sm90_gpu.py); one that does not is reported and not timed. Each
shape runs in a child process with a time limit: a kernel that faults or hangs costs its shape, not
the run.

Images (build on the GPU machine, ~1-2 min with 14 cores)::

    python -m builder build --set gputest --targets sm90 --out DIR -j 14 --kernels \\
        attn_fwd,attn_bwd_preprocess,attn_bwd_dkdv,attn_bwd_dq,attn_bwd_dq_convert,attn_bwd_dkdv_sm90,attn_bwd_dkdv_sm90_a16,\
attn_bwd_dq_sm90
    python bench/sm90_bwd_gluon.py --images DIR [--shapes 0,1] [--rounds 10]

Details (every round, the agreement checks, notes) go to ``$OUT/sm90_bwd_gluon.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import children  # noqa: E402
from bench.children import read_lines, run_child  # noqa: E402

GLUON = "attn_bwd_dkdv_sm90"
PORTABLE = "attn_bwd_dkdv"
GLUON_DQ = "attn_bwd_dq_sm90"
PORTABLE_DQ = "attn_bwd_dq"
CONVERT = "attn_bwd_dq_convert"
#: How a contender's backward runs: the split scheme (deterministic) or the atomic one.
SPLIT = {"deterministic": True}
ATOMIC = {"deterministic": False, "scheme": "atomic"}
#: The all-portable contender, the baseline of the "x portable" column.
BASELINE = "port+port"
# (dtype, head dim, mask mode, B, H, N): the training shapes (mode 2: causal, equal lengths).
SHAPES = (tuple((dt, d, c, 4, 32, 4096) for d in (128, 64) for c in (0, 2) for dt in ("fp16", "bf16"))
          # Short sequences (many small units: where the persistent configs are meant to help).
          + tuple((dt, 128, c, 16, 32, 1024) for c in (0, 2) for dt in ("fp16", "bf16")))
# Agreement of a Gluon contender's dq, dk, dv with the portable kernels': max |diff| / max |portable| below this.
AGREE = {"fp16": 2e-2, "bf16": 5e-2}


def log(msg: str) -> None:
    print(msg, flush=True)


def shapes_of(indices: str) -> list[tuple]:
    """``"all"`` or comma indices into :data:`SHAPES`."""
    if indices == "all":
        return list(SHAPES)
    return [SHAPES[int(i)] for i in indices.split(",") if i.strip()]


def shape_name(shape) -> str:
    dtype, d, causal, b, h, n = shape
    return f"{dtype} D{d} {'causal' if causal else 'full'} B{b} H{h} N{n}"


def _modes(causal: int) -> tuple[int, ...]:
    """The mask modes that serve a shape's calls: bottom-right causal of equal lengths runs on mode 2
    or, aligned by its run-time argument, mode 1 (what the dispatcher falls back to)."""
    return (2, 1) if causal == 2 else (causal,)


def gluon_configs(lib, shape, kernel: str = GLUON, atomic: int = 0) -> list[int]:
    """The config indices of a Gluon kernel (the dK/dV by default; ``atomic``: its DQ_ATOMIC=1
    variants) the images hold for ``shape``'s spec (the first mask mode held that serves it), sorted."""
    dtype, d, causal = shape[:3]
    for mode in _modes(causal):
        found = sorted({v.config.index for v in lib.variants_of(kernel) if v.target.arch == "sm90"
                        and (v.spec["dtype"], v.spec["HEAD_DIM"], v.spec["CAUSAL"]) == (dtype, d, mode)
                        and v.spec.get("DQ_ATOMIC", 0) == atomic})
        if found:
            return found
    return []


def persistent_configs(lib, shape, kernel: str, atomic: int = 0) -> list[int]:
    """Of :func:`gluon_configs`, the persistent ones (constexpr ``PERSISTENT`` > 0)."""
    dtype, d, causal = shape[:3]
    held = set(gluon_configs(lib, shape, kernel, atomic))
    return sorted({v.config.index for v in lib.variants_of(kernel) if v.config.index in held
                   and v.spec["dtype"] == dtype and v.spec["HEAD_DIM"] == d and v.spec.get("DQ_ATOMIC", 0) == atomic
                   and getattr(v.config, "constexprs", {}).get("PERSISTENT", 0)})


def portable_atomic(lib, shape) -> bool:
    """Whether the images hold the portable atomic dK/dV for ``shape``'s spec."""
    dtype, d, causal = shape[:3]
    return any((v.spec["dtype"], v.spec["HEAD_DIM"], v.spec["DQ_ATOMIC"]) == (dtype, d, 1)
               and v.spec["CAUSAL"] in _modes(causal) and v.target.arch == "sm90"
               and not v.spec["BIAS"] and not v.spec["DROPOUT"] and not v.spec["VARLEN"]
               for v in lib.variants_of(PORTABLE))


def contender_views(lib, shape) -> dict:
    """label -> (library view, the (dK/dV, dQ or convert) kernels and configs it must launch, the
    backward's scheme arguments), as the module docs list them."""
    from builder.tune import forced_config, forced_dkdv, forced_split

    # A portable kernel runs whichever config the images' rules pick (None: any).
    views = {BASELINE: (forced_split(lib, PORTABLE, PORTABLE_DQ), ((PORTABLE, None), (PORTABLE_DQ, None)), SPLIT)}
    for i in gluon_configs(lib, shape):
        views[f"g#{i}+port"] = (forced_split(forced_config(lib, GLUON, i), GLUON, PORTABLE_DQ),
                                ((GLUON, i), (PORTABLE_DQ, None)), SPLIT)
    dkdv = gluon_configs(lib, shape)
    if dkdv:
        for j in gluon_configs(lib, shape, GLUON_DQ):
            view = forced_split(forced_config(forced_config(lib, GLUON, dkdv[0]), GLUON_DQ, j), GLUON, GLUON_DQ)
            views[f"g#{dkdv[0]}+g#{j}"] = (view, ((GLUON, dkdv[0]), (GLUON_DQ, j)), SPLIT)
    # Both split kernels persistent (their pairing with the untuned other is above).
    for i in persistent_configs(lib, shape, GLUON):
        for j in persistent_configs(lib, shape, GLUON_DQ):
            view = forced_split(forced_config(forced_config(lib, GLUON, i), GLUON_DQ, j), GLUON, GLUON_DQ)
            views[f"g#{i}+g#{j}"] = (view, ((GLUON, i), (GLUON_DQ, j)), SPLIT)
    for i in gluon_configs(lib, shape, atomic=1):
        views[f"g#{i}+atom"] = (forced_config(lib, GLUON, i), ((GLUON, i), (CONVERT, None)), ATOMIC)
    if portable_atomic(lib, shape):
        views["port+atom"] = (forced_dkdv(lib, PORTABLE), ((PORTABLE, None), (CONVERT, None)), ATOMIC)
    return views


def time_shape(torch, lib, shape: tuple, rounds: int, seed: int) -> dict:
    """Agreement check, then the shuffled-rounds timing of one shape (see the module docs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import aotriton_rt
    from aotriton_rt.ops.attention import attention_kernels
    from aotriton_rt.ops.attention.family import family_of
    from builder.gputime import time_rounds

    dtype_name, D, causal, B, H, N = shape
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # (B, S, H, D) memory seen as (B, H, S, D), as training code lays it out.
    q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
                   for _ in range(4))
    scale = 1 / math.sqrt(D)
    options = {"causal": bool(causal), "align": "bottom_right", "scale": scale}
    flops = 10.0 * B * H * N * N * D / (2 if causal else 1)
    out, lse = aotriton_rt.attention(q, k, v, library=lib, **options)
    notes: list[str] = []

    def ours(view, scheme):
        return lambda: aotriton_rt.attention_backward(do, q, k, v, out, lse, library=view, **scheme, **options)

    views = contender_views(lib, shape)
    launched, usable = {}, {}
    device = torch.cuda.current_device()
    for label, (view, wanted, scheme) in views.items():
        hs = attention_kernels(q, k, v, backward=True, library=view, **scheme, **options)
        roles = (PORTABLE, CONVERT if scheme is ATOMIC else PORTABLE_DQ)
        got = tuple((hs[role].name, hs[role].variant(device).config.index) for role in roles if role in hs)
        atomic = hs[PORTABLE].variant(device).spec.get("DQ_ATOMIC", 0)
        launched[label] = " + ".join(f"{n}#{i}" for n, i in got) + (" (atomic dQ)" if atomic else "")
        # The Gluon dK/dV's aligned-length sibling is that kernel at these lengths (multiples of 16).
        if len(got) == 2 and atomic == (scheme is ATOMIC) and all(
                family_of(n) == wn and wi in (None, i) for (n, i), (wn, wi) in zip(got, wanted)):
            usable[label] = (view, scheme)
        else:
            notes.append(f"{label}: launched {launched[label]}, not the kernels it names; not timed")
    agree = {}
    base = ours(views[BASELINE][0], SPLIT)()[:3]
    for label, (view, scheme) in usable.items():
        if label == BASELINE:
            continue
        grads = ours(view, scheme)()[:3]
        torch.cuda.synchronize()
        rel = max(((g.double() - p.double()).abs().max() / p.double().abs().max().clamp_min(1e-30)).item()
                  for g, p in zip(grads, base))
        agree[label] = {"rel": rel, "ok": bool(rel <= AGREE[dtype_name])}  # NaN fails
    fns = {label: ours(*vs) for label, vs in usable.items() if label == BASELINE or agree[label]["ok"]}
    for label, a in agree.items():
        if not a["ok"]:
            notes.append(f"{label}: dq/dk/dv differ from the portable kernels' by {a['rel']:.3g} (relative); "
                         f"not timed")

    def cudnn():
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=bool(causal), scale=scale)
        return lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)

    try:
        fns["cudnn"] = cudnn()
    except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
        notes.append(f"cudnn: {type(exc).__name__}: {str(exc)[:200]}")
    stats = time_rounds(fns, rounds=rounds, seed=seed, log=notes.append)
    base, port = stats.get("cudnn"), stats.get(BASELINE)

    def row(st) -> dict:
        return {"median_ms": st.median, "min_ms": st.low, "max_ms": st.high, "rounds_ms": list(st.rounds),
                "tflops": flops / (st.median * 1e-3) / 1e12, "tflops_min": flops / (st.high * 1e-3) / 1e12,
                "tflops_max": flops / (st.low * 1e-3) / 1e12,
                "vs_cudnn": base.median / st.median if base else None,
                "vs_portable": port.median / st.median if port else None}

    return {"shape": list(shape), "launched": launched, "agree": agree,
            "rows": {n: row(st) for n, st in stats.items()}, "notes": notes}


def child_time(folder: str, shapes: list[tuple], start: int, rounds: int, result: Path) -> None:
    """Time shapes[start:] one by one, appending each shape's result as a JSON line to ``result``."""
    import torch

    import aotriton_rt

    lib = aotriton_rt.Library(folder)
    for i in range(start, len(shapes)):
        try:
            res = time_shape(torch, lib, shapes[i], rounds, seed=i)
        except Exception as exc:  # noqa: BLE001 - recorded; the next shape still runs
            res = {"shape": list(shapes[i]), "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        with open(result, "a") as f:
            f.write(json.dumps(res) + "\n")


def run_shapes(folder: str, selection: list[str], total: int, rounds: int, timeout: float, work: Path,
               run=None) -> list[dict]:
    """Every shape, in child processes: after a child dies (fault, hang), a new one resumes at the
    shape after the last one it finished, and the lost shape is recorded as such."""
    run = run or (lambda argv, t: run_child(__file__, argv, t))
    path = work / "sm90_bwd_gluon.jsonl"
    path.unlink(missing_ok=True)
    results: list[dict] = []
    while len(results) < total:
        start = len(results)
        why = run(["--child", folder, *selection, "--rounds", str(rounds), "--start", str(start),
                   "--result", str(path)], timeout)
        results = read_lines(path)
        if len(results) < total:
            lost = {"shape": None, "index": len(results),
                    "error": f"the timing process: {why or 'exited before finishing its shape'}"}
            with open(path, "a") as f:
                f.write(json.dumps(lost) + "\n")
            results = read_lines(path)
    return results


def summary_lines(results: list[dict], shapes: list[tuple]) -> list[str]:
    """The compact table: per shape and contender, median TFLOP/s [min-max], ratio to cuDNN and to
    the all-portable backward; then, one line per shape, the best contender of each Gluon pairing."""
    lines = ["", "backward TFLOP/s (median [min-max] over rounds), whole backward, shuffled order each round",
             f"{'shape':<28} {'contender':<10} {'TFLOP/s':>8} {'range':>15} {'x cuDNN':>8} {'x portable':>10}"]
    best_lines = []
    for i, shape in enumerate(shapes):
        res = results[i] if i < len(results) else {"error": "not measured"}
        name = shape_name(shape)
        if "error" in res:
            lines.append(f"{name:<28} {res['error']}")
            best_lines.append(f"{name:<28} nothing timed ({res['error']})")
            continue
        rows = res["rows"]
        for label in sorted(rows, key=lambda n: (n != "cudnn", n != BASELINE, n.endswith("+atom"),
                                                 not n.endswith("+port"), n)):
            r = rows[label]
            vc = f"{r['vs_cudnn']:.2f}" if r["vs_cudnn"] else "-"
            vp = f"{r['vs_portable']:.2f}" if r["vs_portable"] else "-"
            lines.append(f"{name:<28} {label:<10} {r['tflops']:8.0f} {r['tflops_min']:7.0f}-{r['tflops_max']:<7.0f}"
                         f" {vc:>8} {vp:>10}")
        for what, pick in (("Gluon dK/dV + portable dQ", lambda n: n.startswith("g#") and n.endswith("+port")),
                           ("Gluon dK/dV + Gluon dQ", lambda n: n.startswith("g#") and "+g#" in n),
                           ("Gluon dK/dV + fused atomic dQ", lambda n: n.startswith("g#") and n.endswith("+atom"))):
            timed = {n: r for n, r in rows.items() if pick(n)}
            if not timed:
                why = "; ".join(res.get("notes", [])) or "none built"
                best_lines.append(f"{name:<28} {what}: none timed ({why})")
                continue
            best = max(timed, key=lambda n: (timed[n]["tflops"], n))
            r = timed[best]
            best_lines.append(f"{name:<28} {what}: best {best} {r['tflops']:.0f} TFLOP/s, "
                              f"{r['vs_cudnn'] or float('nan'):.2f}x cuDNN, "
                              f"{r['vs_portable'] or float('nan'):.2f}x portable")
    return lines + ["", "summary (target: the whole backward >= 0.9x cuDNN at D=128, >= 0.85x at D=64):"] + best_lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", required=False, default=os.environ.get("BWD_IMAGES", ""),
                    help="image folder holding attn_fwd, attn_bwd_* and both Gluon backward kernels for the shapes")
    ap.add_argument("--shapes", default="all", help="'all' or comma indices into SHAPES")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per timing process")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shapes = shapes_of(args.shapes)
    if args.child:
        child_time(args.child, shapes, args.start, args.rounds, Path(args.result))
        return 0
    if not args.images or not (Path(args.images) / "catalog.json").is_file():
        log(f"no image folder at {args.images!r}: build one (see the module docs) and pass --images")
        return 1
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sm90-bwd-gluon-") as tmp:
        work = Path(os.environ.get("OUT") or tmp)
        results = run_shapes(args.images, ["--shapes", args.shapes], len(shapes), args.rounds, args.timeout, work)
    for r in results:
        for note in r.get("notes", []):
            log(f"note {shape_name(r['shape']) if r.get('shape') else '?'}: {note}")
    for line in summary_lines(results, shapes):
        log(line)
    log(f"\ntotal {time.monotonic() - started:.0f} s")
    children.write_details("sm90_bwd_gluon.json", {"shapes": shapes, "results": results}, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
