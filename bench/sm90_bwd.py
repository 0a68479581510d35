"""Measure the sm90 split backward's configs against cuDNN in one GPU run: build, check, time.

Builds the ``bwdsweep`` set (builder/kernels/_attention_sets.py: the forward and preprocess with
their first config, ``attn_bwd_dkdv`` and ``attn_bwd_dq`` with every sm90 config of
``_SM90_DKDV_SWEEP`` / ``_SM90_DQ_SWEEP``) for the shapes asked into one image folder, or takes
one built elsewhere (``--no-build --images DIR``: any folder holding them, e.g. a ``full`` build).
Every config runs *through the operator* (``aotriton_rt.attention_backward``, split scheme) on a
library view whose tuning table forces it (``builder.tune.forced_config``, as ``python -m builder
tune`` does), the other backward kernel at its config #0; which config a call launched is read
back from the operator and recorded.

1. **Check.** Every dK/dV and dQ config is compared with an fp32 reference (dq, dk, dv) on
   ragged problems (``CHECK_PROBLEMS``: GQA, lengths off the block sizes, more queries than keys,
   shorter than a block; causal aligned bottom-right; memory past each sequence NaN), with AOTriton's bound
   (tests/runtime/test_attention_gpu.py: 4x the error of the same math in the input dtype, plus an
   epsilon). Checks run in child processes with a time limit: a config that faults or hangs
   costs itself, and a new child carries on after it.
2. **Per-kernel timing.** Per shape, every passing config (``dkdv#i``, ``dq#j``; ``#0`` runs
   both at config 0) times the whole backward in rounds of shuffled order
   (:func:`builder.gputime.time_rounds`); the fastest config of each kernel is picked.
3. **Against the peers.** The combination of the two winners (``ours-best``), config 0
   (``ours#0``), SDPA's cuDNN backward (inputs that require grad: what training runs) and SDPA's
   flash backward, timed together in shuffled rounds. The table gives median TFLOP/s
   (10·B·H·N²·D, halved when causal), the min-max over rounds and the ratio to cuDNN of the same
   run.

    python bench/sm90_bwd.py -j16                       # build here (16 cores: ~1-2 min), check, time
    python bench/sm90_bwd.py --no-build --images DIR    # images built elsewhere
    python bench/sm90_bwd.py --shapes 0,2 --dtypes fp16 # a subset

Details (every round, every check, the winners) go to ``$OUT/sm90_bwd.json`` when OUT is set.
The winners are the candidates for each table's config #0 (or, once measured over length
bins with ``python -m builder tune --kernels attn_bwd_dkdv,attn_bwd_dq``, a tuning database).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import children  # noqa: E402
from bench.children import read_lines, run_child  # noqa: E402

# The builder's ABI proof reads ELF with pyelftools; a machine without it can carry the wheel.
for _whl in sorted((ROOT / ".whl").glob("pyelftools-*.whl")):
    sys.path.insert(0, str(_whl))

KERNELS = ("attn_bwd_dkdv", "attn_bwd_dq")
SHORT = {"attn_bwd_dkdv": "dkdv", "attn_bwd_dq": "dq"}
# (head dim, mask mode, B, H, N) per dtype: the training shapes (mode 2: causal, equal lengths).
SHAPES = ((128, 0, 4, 32, 4096), (128, 2, 4, 32, 4096), (64, 0, 4, 32, 4096), (64, 2, 4, 32, 4096))
# tests/runtime/test_attention_gpu.py's bound for gradients: k x the input-dtype math's error + eps.
BOUND_K, BOUND_EPS = 4.0, 5e-4
EPS_SCALE = {"fp16": 1.0, "bf16": 8.0}
# (B, query heads, key/value heads, seqlen_q, seqlen_k): GQA (dK/dV sum two query heads), lengths that
# are no block multiple, more queries than keys (causal rows that see no key), shorter than a block.
CHECK_PROBLEMS = {"ragged_gqa": (2, 4, 2, 1000, 1111), "more_queries": (1, 2, 2, 1111, 1000),
                  "short": (3, 2, 1, 33, 70)}


def log(msg: str) -> None:
    print(msg, flush=True)


def shapes_of(indices: str, dtypes: str) -> list[tuple]:
    """(dtype, D, causal, B, H, N) for every dtype asked and every SHAPES index asked."""
    picked = SHAPES if indices == "all" else tuple(SHAPES[int(i)] for i in indices.split(","))
    return [(dt, *s) for dt in dtypes.split(",") if dt for s in picked]


def spec_key(spec: dict) -> tuple:
    """The (dtype, head dim, mask mode) a variant's spec serves."""
    return spec.get("dtype"), spec.get("HEAD_DIM"), spec.get("CAUSAL", 0)


# ------------------------------------------------------------------------------------------------
# Build
# ------------------------------------------------------------------------------------------------

def sweep_jobs(shapes: list[tuple], version: str) -> list:
    """The bwdsweep set's sm90 jobs for these shapes: forward and preprocess (config 0), dK/dV and
    dQ (every config)."""
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    kernels = load_kernels()
    wanted = {s[:3] for s in shapes}
    dims = {s[:2] for s in shapes}
    jobs = []
    for name in ("attn_fwd", "attn_bwd_preprocess", *KERNELS):
        for job in expand(kernels[name], parse_targets("sm90"), "bwdsweep", version):
            if name == "attn_bwd_preprocess":
                keep = (job.spec["dtype"], job.spec["HEAD_DIM"]) in dims
            else:
                keep = spec_key(job.spec) in wanted
            if keep:
                jobs.append(job)
    return jobs


def build_images(shapes: list[tuple], folder: Path, workers: int, timeout: float) -> dict:
    import triton

    from builder.build import build

    started = time.monotonic()
    jobs = sweep_jobs(shapes, triton.__version__)
    log(f"[build] {len(jobs)} variants into {folder} with {workers} workers")
    summary = build(jobs, folder, workers=workers, timeout=timeout, keep_going=True,
                    triton_version=triton.__version__, quiet=True, existing="replace")
    for line in summary.lines():
        log(f"[build] {line}")
    log(f"[build] {time.monotonic() - started:.0f} s")
    return {"variants": len(jobs), "failed": summary.failed, "seconds": time.monotonic() - started}


# ------------------------------------------------------------------------------------------------
# Candidates, inputs, references
# ------------------------------------------------------------------------------------------------

def swept(spec: dict, shapes: list[tuple]) -> bool:
    """Whether a dK/dV or dQ spec is the one the operator runs for one of ``shapes``."""
    plain = all(not spec.get(n, 0) for n in ("BIAS", "DROPOUT", "VARLEN", "DQ_ATOMIC"))
    return plain and spec.get("HEAD_DIM_V") == spec.get("HEAD_DIM") and spec_key(spec) in {s[:3] for s in shapes}


def candidates_of(lib, shapes: list[tuple]) -> list[dict]:
    """Every dK/dV and dQ config the library holds on sm90 for ``shapes``, in a fixed order."""
    out = {}
    for v in lib.variants:
        if v.kernel in KERNELS and v.target.arch == "sm90" and swept(v.spec, shapes):
            c = v.config
            params = {**c.constexprs, "num_warps": c.num_warps, "num_stages": c.num_stages, **c.options}
            out[(v.kernel, spec_key(v.spec), c.index)] = {
                "kernel": v.kernel, "spec": dict(v.spec), "index": c.index, "params": params,
                "label": f"{SHORT[v.kernel]}#{c.index}", "tile": describe(params)}
    return [out[k] for k in sorted(out, key=lambda k: (k[0], str(k[1]), k[2]))]


def describe(params: dict) -> str:
    extra = "".join(f" {n}={v}" for n, v in params.items()
                    if n not in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))
    return f"{params['BLOCK_M']}x{params['BLOCK_N']} w{params['num_warps']}s{params['num_stages']}{extra}"


def view_of(lib, forced: dict[str, int]):
    """``lib`` with each kernel of ``forced`` sent to its config index."""
    from builder.tune import forced_config

    view = lib
    for kernel, index in sorted(forced.items()):
        view = forced_config(view, kernel, index)
    return view


def bshd_inputs(torch, B: int, sizes: tuple[tuple[int, int], ...], D: int, dtype, seed: int, pad: int):
    """Tensors of (B, S, H, D) memory seen as (B, H, S, D), one per (S, H) of ``sizes``; the ``pad``
    rows past each sequence hold NaN."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for n, H in sizes:
        full = torch.full((B, n + pad, H, D), float("nan"), device="cuda", dtype=dtype)
        full[:, :n] = torch.randn(B, n, H, D, device="cuda", dtype=dtype, generator=gen)
        out.append(full[:, :n].transpose(1, 2))
    return out


def reference(torch, q, k, v, do, causal: int, scale: float, dtype):
    """(dq, dk, dv) of softmax(q kᵀ scale, bottom-right causal band) v, computed in ``dtype``; k and v
    are shared by groups of query heads (GQA), so their gradients sum over the group."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ ke.transpose(-1, -2)) * scale
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        visible = j <= i + (sk - sq)
        # A query row that sees no key (more queries than keys) has no output and no gradient.
        seen = visible.any(-1, keepdim=True)
        s = s.masked_fill(~visible, float("-inf")).masked_fill(~seen, 0.0)
        p = (torch.softmax(s.float(), -1) * seen).to(dtype)
    else:
        p = torch.softmax(s.float(), -1).to(dtype)
    out = p @ ve
    out.backward(do.to(dtype))
    return q.grad, k.grad, v.grad


def grad_error(torch, got, hi, lo, dtype_name: str) -> dict:
    """Max error of ``got`` against the fp32 ``hi`` and AOTriton's bound from the input-dtype ``lo``."""
    got, hi, lo = got.double(), hi.double(), lo.double()
    err = (got - hi).abs().max().item()  # NaN propagates: the comparison below fails
    base = (lo - hi).abs().max().item()
    magnitude = max(1.0, hi.abs().max().item())
    bound = BOUND_K * base + BOUND_EPS * EPS_SCALE[dtype_name] * magnitude
    return {"err": err, "bound": bound, "ok": bool(err <= bound), "nan": int(got.isnan().sum().item())}


def check(torch, lib, cand: dict, seed: int = 0, problems: dict | None = None) -> dict:
    """One config's dq, dk, dv on each of ``problems`` (default ``CHECK_PROBLEMS``) against the fp32
    reference; ok when every problem is."""
    results = {name: check_problem(torch, lib, cand, shape, seed)
               for name, shape in (problems or CHECK_PROBLEMS).items()}
    return {"ok": all(r["ok"] for r in results.values()), "problems": results}


def check_problem(torch, lib, cand: dict, problem: tuple, seed: int = 0) -> dict:
    """One config's dq, dk, dv on one ragged NaN-padded problem, ``(B, query heads, key/value heads,
    seqlen_q, seqlen_k)``, against the fp32 reference."""
    import aotriton_rt
    from aotriton_rt.ops.attention import attention_kernels

    spec = cand["spec"]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec["dtype"]]
    D, causal = spec["HEAD_DIM"], spec["CAUSAL"]
    B, Hq, Hk, Sq, Sk = problem
    q, k, v, do = bshd_inputs(torch, B, ((Sq, Hq), (Sk, Hk), (Sk, Hk), (Sq, Hq)), D, dtype, seed, pad=64)
    scale = 1 / math.sqrt(D)
    options = {"causal": bool(causal), "align": "bottom_right", "scale": scale}
    view = view_of(lib, {cand["kernel"]: cand["index"]})
    out, lse = aotriton_rt.attention(q, k, v, library=lib, **options)
    handles = attention_kernels(q, k, v, backward=True, deterministic=True, library=view, **options)
    launched = handles[cand["kernel"]].variant(torch.cuda.current_device()).config.index
    dq, dk, dv, _ = aotriton_rt.attention_backward(do, q, k, v, out, lse, deterministic=True, library=view,
                                                   **options)
    torch.cuda.synchronize()
    hi = reference(torch, q, k, v, do, causal, scale, torch.float32)
    lo = reference(torch, q, k, v, do, causal, scale, dtype)
    grads = {name: grad_error(torch, g, h, lo_, spec["dtype"])
             for name, g, h, lo_ in zip(("dq", "dk", "dv"), (dq, dk, dv), hi, lo)}
    ok = launched == cand["index"] and all(g["ok"] for g in grads.values())
    return {"ok": ok, "launched": launched, "grads": grads}


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------

def time_shape(torch, lib, shape: tuple, cands: list[dict], rounds: int, peer_rounds: int, seed: int) -> dict:
    """Stage 2 and 3 of the module docs for one shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import aotriton_rt
    from builder.gputime import time_rounds

    dtype_name, D, causal, B, H, N = shape
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    q, k, v, do = bshd_inputs(torch, B, ((N, H),) * 4, D, dtype, seed=1, pad=0)
    scale = 1 / math.sqrt(D)
    options = {"causal": bool(causal), "align": "bottom_right", "scale": scale}
    flops = 10.0 * B * H * N * N * D / (2 if causal else 1)
    out, lse = aotriton_rt.attention(q, k, v, library=lib, **options)
    notes: list[str] = []

    def ours(forced: dict[str, int]):
        view = view_of(lib, forced)
        return lambda: aotriton_rt.attention_backward(do, q, k, v, out, lse, deterministic=True, library=view,
                                                      **options)

    fns = {"#0": ours({})}
    for c in cands:
        if c["index"] != 0:
            fns[c["label"]] = ours({c["kernel"]: c["index"]})
    per_kernel = time_rounds(fns, rounds=rounds, seed=seed, log=notes.append)
    best = {}
    for kernel in KERNELS:
        mine = {lbl: st for lbl, st in per_kernel.items() if lbl == "#0" or lbl.startswith(SHORT[kernel] + "#")}
        if mine:
            label = min(mine, key=lambda lbl: (mine[lbl].median, lbl))
            best[kernel] = 0 if label == "#0" else int(label.split("#")[1])

    def sdpa(backend):
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=bool(causal), scale=scale)
        return lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)

    peers = {"cudnn": sdpa, "sdpa-flash": sdpa}
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}
    final = {}
    for name, make in peers.items():
        try:
            final[name] = make(backends[name])
        except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
            notes.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
    final["ours#0"] = fns["#0"]
    forced = {k: i for k, i in best.items() if i != 0}
    if forced:
        final["ours-best"] = ours(forced)
    stats = time_rounds(final, rounds=peer_rounds, seed=seed + 1, log=notes.append)
    base = stats.get("cudnn")

    def row(st) -> dict:
        r = {"median_ms": st.median, "min_ms": st.low, "max_ms": st.high, "rounds_ms": list(st.rounds),
             "tflops": flops / (st.median * 1e-3) / 1e12, "tflops_min": flops / (st.high * 1e-3) / 1e12,
             "tflops_max": flops / (st.low * 1e-3) / 1e12}
        r["ratio"] = base.median / st.median if base else None
        return r

    return {"shape": list(shape), "best": best, "per_kernel": {n: row(st) for n, st in per_kernel.items()},
            "rows": {n: row(st) for n, st in stats.items()}, "notes": notes}


# ------------------------------------------------------------------------------------------------
# Child processes: a config that faults takes its CUDA context with it; one that hangs cannot be
# stopped from its own process.
# ------------------------------------------------------------------------------------------------

def child_check(folder: str, shapes: list[tuple], start: int, result: Path) -> None:
    import torch

    import aotriton_rt

    lib = aotriton_rt.Library(folder)
    cands = candidates_of(lib, shapes)
    for i, cand in enumerate(cands[start:], start):
        try:
            res = check(torch, lib, cand)
        except Exception as exc:  # noqa: BLE001 - recorded against this config
            res = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                   "trace": traceback.format_exc()[-1500:]}
        res.update(number=i, **cand)
        with result.open("a") as f:
            f.write(json.dumps(res, default=str) + "\n")


def child_time(folder: str, passed: list[list], shapes: list[tuple], rounds: int, peer_rounds: int,
               result: Path) -> None:
    import torch

    import aotriton_rt

    lib = aotriton_rt.Library(folder)
    ok = {(k, tuple(s), i) for k, s, i in passed}
    cands = [c for c in candidates_of(lib, shapes) if (c["kernel"], spec_key(c["spec"]), c["index"]) in ok]
    for shape in shapes:
        mine = [c for c in cands if spec_key(c["spec"]) == tuple(shape[:3])]
        try:
            res = time_shape(torch, lib, tuple(shape), mine, rounds, peer_rounds, seed=0)
        except Exception as exc:  # noqa: BLE001 - one shape's failure must not lose the others
            res = {"shape": list(shape), "rows": {}, "per_kernel": {}, "best": {},
                   "notes": [f"{type(exc).__name__}: {str(exc)[:300]}", traceback.format_exc()[-1500:]]}
        with result.open("a") as f:
            f.write(json.dumps(res, default=str) + "\n")


def _run_child(argv: list[str], timeout: float) -> str | None:
    """Run this script as a child; None if it finished, else why not."""
    return run_child(__file__, argv, timeout)


_read_lines = read_lines


def run_checks(folder: str, child_args: list[str], total: int, timeout: float, work: Path) -> list[dict]:
    """Every candidate's check, a child process at a time; one that faults or hangs is recorded as
    failed and a new child carries on after it."""
    path = work / "bwd_checks.jsonl"

    def run(start: int) -> str | None:
        return _run_child(["--child-check", folder, *child_args, "--start", str(start), "--result", str(path)],
                          timeout)

    return children.check_one_at_a_time(run, total, path, key="number", failed=lambda n: {},
                                        label=lambda n: f"candidate {n}", log=log)


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------

def check_line(r: dict) -> str:
    """One line per checked config: the worst error/bound of a passing one, what failed otherwise."""
    if "kernel" not in r:
        return f"[check] FAIL candidate {r['number']}: {r.get('error')}"
    spec = r["spec"]
    if r.get("error"):
        what = r["error"]
    else:
        worst = max(((g["err"] / g["bound"] if g["bound"] else float("inf"), f"{name} {grad}")
                     for name, p in r["problems"].items() for grad, g in p["grads"].items()),
                    key=lambda t: (t[0] != t[0], t[0]))  # NaN ranks worst
        what = f"worst error/bound {worst[0]:.2f} ({worst[1]})"
        for name, p in r["problems"].items():
            if not p["ok"]:
                what += f"; {name}: " + " ".join(f"{n} {g['err']:.1e}/{g['bound']:.1e}{' NaN' if g['nan'] else ''}"
                                                 for n, g in p["grads"].items())
                if p["launched"] != r["index"]:
                    what += f" (the operator launched #{p['launched']})"
    return (f"[check] {'PASS' if r['ok'] else 'FAIL'} {r['label']:<7} {r['tile']:<26} {spec['dtype']} "
            f"D{spec['HEAD_DIM']} {'causal' if spec['CAUSAL'] else 'full'}: {what}")


def _shape_name(shape) -> str:
    dt, D, causal, B, H, N = shape
    return f"{dt} D{D} {'causal' if causal else 'full'} B{B}H{H}N{N}"


def summary_lines(results: list[dict], cands: list[dict]) -> list[str]:
    """The report: every config's time relative to #0, each shape's contenders with their spread,
    and last one compact line per shape."""
    tiles = {(c["kernel"], spec_key(c["spec"]), c["index"]): c["tile"] for c in cands}
    kernel_of = {short: kernel for kernel, short in SHORT.items()}
    lines = ["", "== every config through the whole backward: median time relative to #0 [min-max over rounds] "
             "(the other kernel at #0)"]
    for res in results:
        key = tuple(res["shape"][:3])
        pk = res.get("per_kernel", {})
        base = pk.get("#0", {}).get("median_ms")
        if not base:
            continue
        lines.append(f"{_shape_name(res['shape'])}: #0 = {base:.3f} ms")
        for label in sorted(pk, key=lambda n: (n != "#0", n.split("#")[0], int(n.split("#")[1] or 0))):
            short, index = label.split("#")
            tile = tiles.get((kernel_of[short], key, int(index))) if short else "config 0 of both"
            spread = f"[{pk[label]['min_ms'] / base:.3f}-{pk[label]['max_ms'] / base:.3f}]"
            lines.append(f"  {label:<8}{pk[label]['median_ms'] / base:7.3f} {spread:<15} {tile}")
    lines += ["", "== against the peers (same run, shuffled order): median TFLOP/s [min-max over rounds], "
              "ratio to cuDNN's median"]
    for res in results:
        key = tuple(res["shape"][:3])
        best = res.get("best", {})
        picks = " / ".join(f"{SHORT[k]}#{best[k]} {tiles.get((k, key, best[k]), '?')}" for k in KERNELS if k in best)
        lines.append(f"{_shape_name(res['shape'])}   winners: {picks or '-'}")
        for name, r in sorted(res.get("rows", {}).items(), key=lambda kv: -kv[1]["tflops"]):
            ratio = f"x{r['ratio']:.3f}" if r.get("ratio") else "  -   "
            lines.append(f"  {r['tflops']:7.1f} [{r['tflops_min']:6.1f}-{r['tflops_max']:6.1f}]  {ratio}  {name}")
    lines += ["", "== summary: TFLOP/s and ratio to cuDNN",
              f"{'shape':<28}{'cudnn':>8}{'flash':>13}{'ours#0':>13}{'ours-best':>13}"]
    for res in results:
        rows = res.get("rows", {})

        def cell(name: str, rows: dict = rows) -> str:
            r = rows.get(name)
            if not r:
                return "-"
            if r.get("ratio") and name != "cudnn":
                return f"{r['tflops']:.0f} x{r['ratio']:.2f}"
            return f"{r['tflops']:.0f}"

        best_cell = cell("ours-best") if "ours-best" in rows else ("= #0" if rows else "-")
        lines.append(f"{_shape_name(res['shape']):<28}{cell('cudnn'):>8}{cell('sdpa-flash'):>13}"
                     f"{cell('ours#0'):>13}{best_cell:>13}")
    for res in results:
        for note in res.get("notes", []):
            lines.append(f"(note) {_shape_name(res['shape'])}: {note[:300]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", default=os.environ.get("BWD_IMAGES", "/tmp/sm90-bwd"),
                    help="the image folder to build into (and time from)")
    ap.add_argument("--no-build", action="store_true", help="time --images as it is (built elsewhere)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds allowed per variant's compile")
    ap.add_argument("--shapes", default="all", help=f"'all' or comma indices into SHAPES {SHAPES}")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the per-config timing")
    ap.add_argument("--peer-rounds", type=int, default=10, help="rounds of the timing against the peers")
    ap.add_argument("--check-timeout", type=float, default=120.0, help="seconds allowed per checking process")
    ap.add_argument("--time-timeout", type=float, default=240.0, help="seconds allowed for all the timing")
    ap.add_argument("--child-check", help=argparse.SUPPRESS)
    ap.add_argument("--child-time", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--passed", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    shapes = shapes_of(args.shapes, args.dtypes)
    if args.child_check:
        child_check(args.child_check, shapes, args.start, Path(args.result))
        return 0
    if args.child_time:
        child_time(args.child_time, json.loads(args.passed), shapes, args.rounds, args.peer_rounds,
                   Path(args.result))
        return 0

    started = time.monotonic()
    details: dict = {"shapes": shapes, "build": {}, "checks": [], "timing": []}
    images = Path(args.images)
    if not args.no_build:
        details["build"] = build_images(shapes, images, args.jobs, args.timeout)
    if args.build_only:
        write_details(details)
        return 0
    if not (images / "catalog.json").is_file():
        log(f"no image folder at {images}: build one (drop --no-build) or name it with --images")
        write_details(details)
        return 1

    import tempfile

    import aotriton_rt

    folder = str(images)
    cands = candidates_of(aotriton_rt.Library(folder), shapes)
    log(f"[check] {len(cands)} dK/dV and dQ configs in {folder}")
    selection = ["--shapes", args.shapes, "--dtypes", args.dtypes]
    with tempfile.TemporaryDirectory(prefix="sm90-bwd-") as tmp:
        work = Path(os.environ.get("OUT") or tmp)
        checks = run_checks(folder, selection, len(cands), args.check_timeout, work)
        for r in checks:
            log(check_line(r))
        details["checks"] = checks
        passed = [[r["kernel"], list(spec_key(r["spec"])), r["index"]] for r in checks if r.get("ok")]
        path = work / "bwd_timing.jsonl"
        path.unlink(missing_ok=True)
        why = _run_child(["--child-time", folder, "--passed", json.dumps(passed), *selection,
                          "--rounds", str(args.rounds),
                          "--peer-rounds", str(args.peer_rounds), "--result", str(path)], args.time_timeout)
        results = _read_lines(path)
        if why:
            log(f"[time] the timing process: {why}; {len(results)} of {len(shapes)} shapes measured")
    details["timing"] = results
    for line in summary_lines(results, cands):
        log(line)
    log(f"\nchecked {sum(bool(r.get('ok')) for r in checks)}/{len(cands)} configs; "
        f"total {time.monotonic() - started:.0f} s")
    write_details(details)
    return 0


def write_details(details: dict) -> None:
    children.write_details("sm90_bwd.json", details, log)


if __name__ == "__main__":
    sys.exit(main())
