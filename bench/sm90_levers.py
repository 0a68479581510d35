"""Measure the sm90 forward levers against cuDNN in one GPU run: build, check, time.

Levers (each built into its own image folder, ``<images>/<lever>-triton<version>``, and launched
through ``aotriton_rt.Library`` exactly as the operator launches its kernels):

- ``ours``: the portable ``attn_fwd``, every config of the registry's sm90 table (#0 is what the
  operator runs today).
- ``sweep``: ``attn_fwd`` with configs the table lacks (``SWEEP``).
- ``gluon``: ``attn_fwd_sm90`` (builder/kernels/attention_sm90.py), every config.
- ``ws``: ``attn_fwd`` with Triton's own Hopper warp specialization (``WARP_SPEC=1``). Triton 3.6
  computes wrong results with it; the lever is meant to be built by another Triton (e.g. 3.8 on
  the CPU: ``--levers ws --build-only`` under that Triton) and passed with ``--prebuilt``.

Every variant is first checked against an fp32 reference on a problem with ragged lengths
(seqlen_q 1000, seqlen_k 1111, memory past the sequences NaN) in its mask mode, in a child
process with a time limit (a kernel that hangs costs its variant; checks resume after it); a
wrong one is reported with where it is wrong and not timed. Then, per shape, every passing
variant and SDPA's cuDNN backend (inputs without grad: "cudnn"; with grad, the training forward:
"cudnn-train") are timed in rounds whose order is shuffled each round (CUDA events, a fixed
number of launches per sample), in one child process with a time limit. The table gives median
TFLOP/s, the spread (min-max over rounds) and the ratio to "cudnn"'s median of the same run.
Builds run with --keep-going and a per-variant timeout: a lever that fails to compile does not
stop the others.

    python bench/sm90_levers.py -j16                                  # build here, check, time
    python bench/sm90_levers.py --levers ws --build-only --images DIR # build one lever only (CPU ok)
    python bench/sm90_levers.py --no-build --prebuilt DIR/ws-triton3.8.0

Details (every sample, every check) go to ``$OUT/sm90_levers.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import children  # noqa: E402
from bench.children import read_lines, run_child  # noqa: E402

# The builder's ABI proof reads ELF with pyelftools; a machine without it can carry the wheel (a
# pure-Python wheel imports straight from its zip).
for _whl in sorted((ROOT / ".whl").glob("pyelftools-*.whl")):
    sys.path.insert(0, str(_whl))

SPEC_BASE = {"BIAS": 0, "DROPOUT": 0, "VARLEN": 0, "SOFTCAP": 0, "ALIBI": 0}
# (dtype, head dim, mask mode, B, H, N): the benchmark shapes.
SHAPES = (("fp16", 128, 0, 4, 32, 4096), ("bf16", 128, 0, 4, 32, 4096), ("fp16", 128, 2, 4, 32, 4096),
          ("bf16", 128, 2, 4, 32, 4096), ("fp16", 64, 0, 4, 32, 4096))
LEVERS = ("ours", "sweep", "gluon", "ws")
# attn_fwd configs the sm90 table lacks: (BLOCK_M, BLOCK_N, num_warps, num_stages, USE_TMA, options).
SWEEP = ((128, 128, 8, 2, 1, {}), (128, 64, 4, 3, 1, {}), (128, 128, 8, 3, 1, {"maxnreg": 240}),
         (256, 64, 8, 2, 1, {}))
# attn_fwd with Triton's Hopper warp specialization: (BLOCK_M, BLOCK_N, num_warps, num_stages).
WS = ((128, 64, 4, 3), (128, 128, 4, 2), (128, 64, 4, 2))


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# Build
# ------------------------------------------------------------------------------------------------

def bench_specs(shapes) -> list[dict]:
    specs = []
    for dtype, d, causal, *_ in shapes:
        spec = {"dtype": dtype, "HEAD_DIM": d, "HEAD_DIM_V": d, "CAUSAL": causal, **SPEC_BASE}
        if spec not in specs:
            specs.append(spec)
    return specs


def lever_jobs(lever: str, specs: list[dict], version: str) -> list:
    """The registry jobs of one lever for these specs on sm90."""
    from builder.registry import ConfigDecl, expand, load_kernels
    from builder.targets import parse_targets

    kernels = load_kernels()
    sm90 = parse_targets("sm90")
    if lever == "gluon":
        kernel = kernels["attn_fwd_sm90"]
    elif lever == "ours":
        kernel = kernels["attn_fwd"]
    elif lever == "sweep":
        extra = tuple(ConfigDecl(constexprs={"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma, "WARP_SPEC": 0},
                             num_warps=w, num_stages=s, options=opts)
                      for bm, bn, w, s, tma, opts in SWEEP)
        table = kernels["attn_fwd"].configs_for
        # Per spec, the sweep configs the registry's own table does not already hold.
        kernel = dataclasses.replace(kernels["attn_fwd"], configs=lambda spec, target: tuple(
            c for c in extra if c not in table(spec, target)))
    elif lever == "ws":
        extra = tuple(ConfigDecl(constexprs={"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": 1, "WARP_SPEC": 1},
                             num_warps=w, num_stages=s)
                      for bm, bn, w, s in WS)
        kernel = dataclasses.replace(kernels["attn_fwd"], configs=extra)
    else:
        raise ValueError(f"unknown lever {lever!r}; levers: {', '.join(LEVERS)}")
    return [j for j in expand(kernel, sm90, "full", version) if j.spec in specs]


def build_levers(levers: list[str], specs: list[dict], images: Path, workers: int, timeout: float) -> dict:
    """Build each lever into its folder; returns {lever: folder or error text}."""
    import triton

    from builder.build import build

    out = {}
    for lever in levers:
        folder = images / f"{lever}-triton{triton.__version__}"
        started = time.monotonic()
        try:
            jobs = lever_jobs(lever, specs, triton.__version__)
            log(f"[build] {lever}: {len(jobs)} variants into {folder}")
            summary = build(jobs, folder, workers=workers, timeout=timeout, keep_going=True,
                            triton_version=triton.__version__, quiet=True, existing="replace")
            for line in summary.lines():
                log(f"[build] {lever}: {line}")
            out[lever] = str(folder)
        except Exception as exc:  # one lever's failure must not stop the others
            out[lever] = f"build failed: {type(exc).__name__}: {str(exc)[-400:]}"
            log(f"[build] {lever}: {out[lever]}")
        log(f"[build] {lever}: {time.monotonic() - started:.0f} s")
    return out


# ------------------------------------------------------------------------------------------------
# Problems, reference, launches
# ------------------------------------------------------------------------------------------------

def make_inputs(torch, B: int, H: int, Sq: int, Sk: int, D: int, dtype, seed: int, pad: int = 64):
    """BSHD tensors seen as BHSD; the rows past each sequence (``pad`` of them) hold NaN."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def bshd(n: int):
        full = torch.full((B, n + pad, H, D), float("nan"), device="cuda", dtype=dtype)
        full[:, :n] = torch.randn(B, n, H, D, device="cuda", dtype=dtype, generator=gen)
        return full[:, :n].transpose(1, 2)

    return bshd(Sq), bshd(Sk), bshd(Sk)


def launch_args(q, k, v, out, lse, causal: int, scale: float) -> list:
    """attn_fwd's argument list for a call of mask mode ``causal`` (2: bottom-right, which a mode-1
    variant serves by its argument causal_align; images built before causal_align, softcap, the
    ALiBi or the sinks arguments take the list up to them: see :class:`Contender`)."""
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    return [q, k, v, None, out, lse, None, None, None, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *out.stride()[:3], 0, 0, 0, *lse.stride()[:2], 0, 0, 0, B, H, H, Sq, Sk, scale, 0.0, 0, 0,
            -1, 0 if causal else -1, 1 if causal == 2 else 0, 0.0, None, 0, None, 0]  # ..., causal_align,
    # softcap, alibi_slopes, stride_az, Sinks, use_sinks (no softcap, ALiBi or sinks)


def reference(torch, q, k, v, causal: int, scale: float):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        Sq, Sk = q.shape[2], k.shape[2]
        i = torch.arange(Sq, device="cuda")[:, None]
        j = torch.arange(Sk, device="cuda")[None, :]
        diag = Sk - Sq if causal == 2 else 0
        s = s.masked_fill(j > i + diag, float("-inf"))
    return torch.softmax(s, -1) @ v.float(), torch.logsumexp(s, -1)


class Contender:
    """One built variant: its label, handle and catalog facts."""

    def __init__(self, lever: str, lib, variant) -> None:
        self.lever = lever
        self.variant = variant
        cfg = variant.config
        self.index = cfg.index
        params = {**variant.spec, **cfg.constexprs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        self.handle = lib.kernel(variant.kernel, **params)
        tile = "x".join(str(cfg.constexprs.get(n)) for n in ("BLOCK_M", "BLOCK_N") if n in cfg.constexprs)
        extra = ",".join(f"{n}={v}" for n, v in cfg.constexprs.items() if n not in ("BLOCK_M", "BLOCK_N"))
        opts = ",".join(f"{n}={v}" for n, v in cfg.options.items())
        self.label = (f"{lever}#{cfg.index} {tile} w{cfg.num_warps}s{cfg.num_stages} {extra}"
                      + (f" {opts}" if opts else ""))

    def __call__(self, args: list) -> None:
        # causal_align comes last: variants built before it take the arguments up to it.
        self.handle(*args[:len(self.handle.arg_names)])


def contenders_of(folders: dict) -> list:
    import aotriton_rt

    found = []
    for lever, folder in folders.items():
        if not Path(folder).is_dir():
            continue
        try:
            lib = aotriton_rt.Library(folder)
            for v in lib.variants:
                found.append(Contender(lever, lib, v))
        except Exception as exc:
            log(f"[load] {lever}: {type(exc).__name__}: {str(exc)[:300]}")
    return found


def check(torch, c: Contender, seed: int = 0) -> dict:
    """Max errors of a contender on a ragged problem with NaN past the sequences."""
    spec = c.variant.spec
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec["dtype"]]
    D, causal = spec["HEAD_DIM"], spec["CAUSAL"]
    B, H, Sq, Sk = 2, 3, 1000, 1111
    q, k, v = make_inputs(torch, B, H, Sq, Sk, D, dtype, seed)
    out = torch.full((B, Sq, H, D), float("nan"), device="cuda", dtype=dtype).transpose(1, 2)
    lse = torch.full((B, H, Sq), float("nan"), device="cuda")
    scale = 1 / math.sqrt(D)
    c(launch_args(q, k, v, out, lse, causal, scale))
    torch.cuda.synchronize()
    ref, ref_lse = reference(torch, q, k, v, causal, scale)
    err_out = (out.float() - ref).abs().max().item()
    err_lse = (lse - ref_lse).abs().max().item()
    tol_out = 1e-2 if spec["dtype"] == "fp16" else 3e-2
    ok = err_out <= tol_out and err_lse <= 1e-3  # NaN compares False: fails
    res = {"ok": ok, "err_out": err_out, "err_lse": err_lse, "tol_out": tol_out}
    if not ok:
        res["diagnosis"] = diagnose(torch, out, lse, ref, ref_lse, tol_out)
    return res


def diagnose(torch, out, lse, ref, ref_lse, tol: float) -> dict:
    """Where a wrong result is wrong: which query rows (and their position in a 128-row tile: the
    Gluon kernel's consumers own rows 0-63 and 64-127), NaN or not, LSE rows with the wrong -inf."""
    bad = ((out.float() - ref).abs() > tol) | out.isnan()
    rows = bad.any(-1).any(0).any(0)  # (Sq,)
    idx = rows.nonzero().flatten()
    in_tile = idx % 128
    finite = torch.isfinite(ref_lse)
    return {
        "bad_rows": int(rows.sum()), "rows": int(rows.numel()),
        "first_bad_rows": idx[:8].tolist(), "last_bad_rows": idx[-4:].tolist(),
        "bad_rows_in_tile_half_0_1": [int((in_tile < 64).sum()), int((in_tile >= 64).sum())],
        "nan_out": int(out.isnan().sum()), "nan_lse": int(lse.isnan().sum()),
        "lse_inf_rows_disagree": int((torch.isfinite(lse) != finite).sum()),
        "bad_heads": bad.any(-1).any(-1).sum(0).tolist(),
    }


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------

def sample_ms(torch, fn, launches: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / launches


def time_shape(torch, shape: tuple, contenders: list, rounds: int, launches: int, deadline: float,
               rng: random.Random) -> dict:
    dtype_name, D, causal, B, H, N = shape
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    q, k, v = make_inputs(torch, B, H, N, N, D, dtype, seed=1, pad=0)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, N, device="cuda")
    scale = 1 / math.sqrt(D)
    args = launch_args(q, k, v, out, lse, causal, scale)
    flops = 4.0 * B * H * N * N * D / (2 if causal else 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), scale=scale)

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def cudnn_train():  # inputs that require grad: the training forward (it also keeps the LSE)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=bool(causal), scale=scale)

    fns = {"cudnn": cudnn, "cudnn-train": cudnn_train}
    for c in contenders:
        fns[c.label] = (lambda c=c: c(args))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    errors: dict[str, str] = {}
    for name, fn in list(fns.items()):  # warm up (first launch loads the module)
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            del fns[name]
    for r in range(rounds):
        if time.monotonic() > deadline:
            errors["_budget"] = f"stopped after {r} rounds: time budget spent"
            break
        order = list(fns)
        rng.shuffle(order)
        for name in order:
            try:
                samples[name].append(sample_ms(torch, fns[name], launches))
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                fns.pop(name, None)
    rows = {}
    for name, ms in samples.items():
        if not ms:
            continue
        med = statistics.median(ms)
        rows[name] = {"ms": ms, "median_ms": med, "tflops": flops / (med * 1e-3) / 1e12,
                      "tflops_min": flops / (max(ms) * 1e-3) / 1e12, "tflops_max": flops / (min(ms) * 1e-3) / 1e12}
    base = rows.get("cudnn", {}).get("tflops")
    for row in rows.values():
        row["ratio"] = row["tflops"] / base if base else None
    return {"shape": shape, "rows": rows, "errors": errors}


def print_table(results: list[dict]) -> None:
    log("\n== sm90 forward levers vs cuDNN (same run, shuffled order; median TFLOP/s, min-max over rounds)")
    for res in results:
        dtype, D, causal, B, H, N = res["shape"]
        log(f"\n{dtype} B{B} H{H} N{N} D{D} {'causal' if causal else 'full'}")
        rows = sorted(res["rows"].items(), key=lambda kv: -kv[1]["tflops"])
        for name, row in rows:
            ratio = f"{row['ratio']:.3f}" if row["ratio"] else "  -  "
            log(f"  {row['tflops']:7.1f}  [{row['tflops_min']:6.1f}-{row['tflops_max']:6.1f}]  x{ratio}  {name}")
        for name, err in res["errors"].items():
            log(f"  (not timed) {name}: {err}")


# ------------------------------------------------------------------------------------------------
# Child processes: a kernel that hangs (an mbarrier waited for forever) cannot be stopped from its
# own process, so checks and timing run in children with time limits; dying with its process
# takes the hung kernel's CUDA context with it.
# ------------------------------------------------------------------------------------------------

def child_check(folders: dict, start: int, result: Path) -> None:
    """Check contenders start, start+1, ... (in contenders_of order), appending each result to
    ``result`` (JSON lines) as soon as it is known."""
    import torch

    contenders = contenders_of(folders)
    for i, c in enumerate(contenders[start:], start):
        try:
            res = check(torch, c)
        except Exception as exc:
            res = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                   "trace": traceback.format_exc()[-1500:]}
        res.update(index=i, label=c.label, key=c.variant.key, spec=c.variant.spec)
        with result.open("a") as f:
            f.write(json.dumps(res, default=str) + "\n")


def child_time(folders: dict, keys: list[str], shapes: tuple, rounds: int, launches: int, budget: float,
               result: Path) -> None:
    """Time the contenders whose variant keys are ``keys`` per shape against cuDNN, appending each
    shape's result to ``result`` (JSON lines)."""
    import torch

    contenders = [c for c in contenders_of(folders) if c.variant.key in set(keys)]

    def pick(shape: tuple) -> list:
        dtype, D, causal = shape[:3]
        return [c for c in contenders if c.variant.spec == {"dtype": dtype, "HEAD_DIM": D, "HEAD_DIM_V": D,
                                                             "CAUSAL": causal, **SPEC_BASE}]

    time_shapes(torch, shapes, pick, rounds, launches, budget, result)


def time_shapes(torch, shapes, pick, rounds: int, launches: int, budget: float, result: Path) -> None:
    """Time each shape's contenders (``pick(shape)``) with cuDNN's in shuffled rounds, appending each
    shape's result to ``result`` (JSON lines) as soon as it is known; a shape reached after
    ``budget`` seconds, or one whose timing raised, is recorded with the reason instead."""
    deadline = time.monotonic() + budget
    rng = random.Random(0)
    for shape in shapes:
        if time.monotonic() > deadline:
            res = {"shape": shape, "rows": {}, "errors": {"_budget": "time budget spent before this shape"}}
        else:
            try:
                res = time_shape(torch, shape, pick(shape), rounds, launches, deadline, rng)
            except Exception as exc:
                res = {"shape": shape, "rows": {}, "errors": {"_shape": f"{type(exc).__name__}: {str(exc)[:300]}"}}
        with result.open("a") as f:
            f.write(json.dumps(res, default=str) + "\n")


def _run_child(argv: list[str], timeout: float) -> str | None:
    """Run this script as a child; None if it finished, else why not."""
    return run_child(__file__, argv, timeout)


_read_lines = read_lines


def run_checks(folders: dict, timeout: float, work: Path) -> list[dict]:
    """Every contender's check, a child process at a time; a child that hangs or dies is killed,
    the variant it was on is recorded as failed, and a new child carries on after it."""
    import aotriton_rt  # noqa: F401 - fail here, not in every child, if the runtime is missing

    path = work / "checks.jsonl"

    def run(start: int) -> str | None:
        return _run_child(["--child-check", json.dumps(folders), "--start", str(start), "--result", str(path)],
                          timeout)

    return children.check_one_at_a_time(run, len(contenders_of(folders)), path, key="index",
                                        failed=lambda n: {"label": f"#{n}", "key": None, "spec": {}},
                                        label=lambda n: f"variant #{n}", log=log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", default=os.environ.get("LEVERS_IMAGES", "/tmp/sm90-levers"),
                    help="folder holding one image folder per lever")
    ap.add_argument("--levers", default="ours,sweep,gluon", help=f"comma list of {', '.join(LEVERS)}")
    ap.add_argument("--prebuilt", nargs="*", default=[], help="extra lever folders built elsewhere")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds allowed per variant's compile")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--no-build", action="store_true", help="use the folders already under --images")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--launches", type=int, default=20, help="launches per timing sample")
    ap.add_argument("--check-timeout", type=float, default=90.0, help="seconds allowed per checking process")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds for the timing rounds")
    ap.add_argument("--shapes", default="all", help="'all' or comma indices into SHAPES")
    ap.add_argument("--child-check", help=argparse.SUPPRESS)
    ap.add_argument("--child-time", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--keys", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    shapes = SHAPES if args.shapes == "all" else tuple(SHAPES[int(i)] for i in args.shapes.split(","))
    if args.child_check:
        child_check(json.loads(args.child_check), args.start, Path(args.result))
        return 0
    if args.child_time:
        child_time(json.loads(args.child_time), json.loads(args.keys), shapes, args.rounds, args.launches,
                   args.budget, Path(args.result))
        return 0

    started = time.monotonic()
    levers = [x for x in args.levers.split(",") if x]
    images = Path(args.images)
    details: dict = {"shapes": shapes, "levers": levers, "build": {}, "checks": [], "timing": []}
    folders: dict[str, str] = {}
    if not args.no_build:
        details["build"] = build_levers(levers, bench_specs(shapes), images, args.jobs, args.timeout)
    for lever in levers:
        for folder in sorted(images.glob(f"{lever}-triton*")):
            folders[folder.name] = str(folder)
    for extra in args.prebuilt:
        folders[Path(extra).name] = extra
    details["folders"] = folders
    if args.build_only:
        write_details(details)
        return 0

    import tempfile

    with tempfile.TemporaryDirectory(prefix="sm90-levers-") as tmp:
        work = Path(os.environ.get("OUT") or tmp)
        checks = run_checks(folders, args.check_timeout, work)
        details["checks"] = checks
        for r in checks:
            spec = r.get("spec") or {}
            what = r.get("error") or f"out {r.get('err_out', math.nan):.2e} lse {r.get('err_lse', math.nan):.2e}"
            if r.get("diagnosis"):
                what += " " + json.dumps(r["diagnosis"])
            log(f"[check] {'PASS' if r['ok'] else 'FAIL'} {r['label']} {spec.get('dtype', '')} "
                f"D{spec.get('HEAD_DIM', '')} causal{spec.get('CAUSAL', '')}: {what}")
        keys = [r["key"] for r in checks if r["ok"]]
        path = work / "timing.jsonl"
        path.unlink(missing_ok=True)
        why = _run_child(["--child-time", json.dumps(folders), "--keys", json.dumps(keys), "--shapes", args.shapes,
                          "--rounds", str(args.rounds), "--launches", str(args.launches),
                          "--budget", str(args.budget), "--result", str(path)], args.budget + 120)
        results = _read_lines(path)
        if why:
            log(f"[time] the timing process: {why}; {len(results)} of {len(shapes)} shapes measured")
    details["timing"] = results
    print_table(results)
    log(f"\ntotal {time.monotonic() - started:.0f} s")
    write_details(details)
    return 0


def write_details(details: dict) -> None:
    children.write_details("sm90_levers.json", details, log)


if __name__ == "__main__":
    sys.exit(main())
