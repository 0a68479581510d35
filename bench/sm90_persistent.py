"""Time the persistent Gluon forward (``attn_fwd_sm90`` with ``PERSISTENT`` > 0) against its one-tile
configs, the portable ``attn_fwd`` and cuDNN in one GPU run, at the short sequences it is for.

Contenders, every one from one image folder built with ``python -m builder build --set gputest
--targets sm90`` and launched through ``aotriton_rt.Library`` as the operator launches them:

- ``persistent#i``: every ``attn_fwd_sm90`` config with ``PERSISTENT`` > 0 (a grid of min(work
  units, PERSISTENT) programs looping over query tiles; builder/kernels/attention_sm90.py): #6 and
  #7 at D=128, #4 and #5 at D=64;
- ``gluon#0``, ``gluon#1``: the one-program-per-tile Gluon configs of the same tile (128x128, three
  stages at D=128, four at D=64, with and without ping-pong);
- ``attn_fwd#0``, ``attn_fwd#1``: the portable kernel (#1, 4-warp 128x64 TMA, is what the tuning
  database runs at N <= 1024 D=128 today);
- ``cudnn`` (SDPA's cuDNN backend, inputs without grad) and ``cudnn-train`` (inputs with grad).

Shapes: B16 H32 N1024 and B4 H32 N4096, D=128, fp16 and bf16, no mask and causal (mask mode 1
with the top-left band, which is cuDNN's ``is_causal`` for square problems); then D=64 at the same
sizes in the two D=64 specs the gputest set holds (fp16 without a mask, bf16 causal), shapes 8-11. Every contender is
first checked against an fp32 reference on a ragged NaN-padded problem (bench/sm90_levers.py's
check) in a child process with a time limit (a hang costs that contender, checks resume after it);
a wrong one is not timed. Timing runs in one child: per shape, rounds whose contender order is
shuffled every round, a fixed number of launches per CUDA-event sample; medians, min-max spread
over rounds and the ratio to ``cudnn``'s median of the same run.

    python bench/sm90_persistent.py --images .gpu-images/gt
    python bench/sm90_persistent.py --images .gpu-images/gt --shapes 0,1 --rounds 20
    python bench/sm90_persistent.py --images .gpu-images/gt --shapes 8,9,10,11   # D=64 only

The summary table comes last; details (every sample, every check) go to
``$OUT/sm90_persistent.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench import children  # noqa: E402
from bench.children import read_lines, run_child  # noqa: E402

# (dtype, head dim, mask mode, B, H, N): D=128 first (the indices earlier runs were given), then D=64
# in the (dtype, mask mode) pairs the gputest set holds at D=64 (others would time cuDNN alone).
SHAPES = (tuple((dtype, 128, causal, b, 32, n) for b, n in ((16, 1024), (4, 4096))
                for causal in (0, 1) for dtype in ("fp16", "bf16"))
          + tuple((dtype, 64, causal, b, 32, n) for b, n in ((16, 1024), (4, 4096))
                  for dtype, causal in (("fp16", 0), ("bf16", 1))))
#: One-tile Gluon configs and portable configs timed next to the persistent ones.
GLUON_CONFIGS = (0, 1)
PORTABLE_CONFIGS = (0, 1)
_BASE = {"BIAS": 0, "DROPOUT": 0, "VARLEN": 0}
HEAD_DIMS = (64, 128)


def log(msg: str) -> None:
    print(msg, flush=True)


def wanted(variant) -> str | None:
    """The contender name of a catalog variant, or None when it is not one."""
    spec, cfg = variant.spec, variant.config
    if any(spec.get(k) != v for k, v in _BASE.items()) or spec.get("CAUSAL") not in (0, 1):
        return None
    if spec.get("HEAD_DIM") not in HEAD_DIMS or spec.get("HEAD_DIM_V") != spec.get("HEAD_DIM"):
        return None
    if variant.target.arch != "sm90":
        return None
    if variant.kernel == "attn_fwd_sm90":
        if cfg.constexprs.get("PERSISTENT", 0) > 0:
            return "persistent"
        return "gluon" if cfg.index in GLUON_CONFIGS else None
    if variant.kernel == "attn_fwd" and cfg.index in PORTABLE_CONFIGS:
        return "attn_fwd"
    return None


def contenders_of(images: str) -> list:
    """Every contender of the image folder, in catalog order."""
    from sm90_levers import Contender

    import aotriton_rt

    lib = aotriton_rt.Library(images)
    found = []
    for v in lib.variants:
        name = wanted(v)
        if name is not None:
            found.append(Contender(name, lib, v))
    return found


def child_check(images: str, start: int, result: Path) -> None:
    import torch
    from sm90_levers import check

    for i, c in enumerate(contenders_of(images)[start:], start):
        try:
            res = check(torch, c)
        except Exception as exc:
            res = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        res.update(index=i, label=c.label, key=c.variant.key, spec=c.variant.spec)
        with result.open("a") as f:
            f.write(json.dumps(res, default=str) + "\n")


def child_time(images: str, keys: list[str], shapes: tuple, rounds: int, launches: int, budget: float,
               result: Path) -> None:
    import torch
    from sm90_levers import time_shapes

    contenders = [c for c in contenders_of(images) if c.variant.key in set(keys)]

    def pick(shape: tuple) -> list:
        dtype, d, causal = shape[:3]
        return [c for c in contenders if (c.variant.spec["dtype"], c.variant.spec["HEAD_DIM"],
                                          c.variant.spec["CAUSAL"]) == (dtype, d, causal)]

    time_shapes(torch, shapes, pick, rounds, launches, budget, result)


def run_checks(images: str, total: int, timeout: float, work: Path) -> list[dict]:
    """Every contender's check, one child at a time; a child that hangs or dies is killed, the
    contender it was on counts as failed and a new child carries on after it."""
    path = work / "checks.jsonl"

    def run(start: int) -> str | None:
        return run_child(__file__, ["--child-check", "--images", images, "--start", str(start), "--result", str(path)],
                         timeout)

    return children.check_one_at_a_time(run, total, path, key="index",
                                        failed=lambda n: {"label": f"#{n}", "key": None},
                                        label=lambda n: f"contender #{n}", log=log)


def _best(rows: dict, prefix: str) -> tuple[str, dict] | None:
    mine = [(name, row) for name, row in rows.items() if name.startswith(prefix)]
    return max(mine, key=lambda kv: kv[1]["tflops"]) if mine else None


def summary(results: list[dict]) -> list[str]:
    """One line per shape: cuDNN's median and, per contender family, its best config with its
    median, ratio to cuDNN and min-max over rounds (TFLOP/s)."""
    lines = []
    for res in results:
        dtype, d, causal, b, h, n = res["shape"]
        rows = res["rows"]
        cudnn = rows.get("cudnn", {}).get("tflops")
        cells = [f"cudnn {cudnn:.1f}" if cudnn else "cudnn -"]
        for prefix in ("persistent#", "gluon#", "attn_fwd#"):
            best = _best(rows, prefix)
            if best is None:
                cells.append(f"{prefix[:-1]} -")
                continue
            name, row = best
            ratio = f"x{row['ratio']:.3f}" if row.get("ratio") else "x-"
            spread = f"[{row['tflops_min']:.0f}-{row['tflops_max']:.0f}]"
            cells.append(f"{name.split()[0]} {row['tflops']:.1f} {ratio} {spread}")
        shape = f"{dtype} B{b} H{h} N{n} D{d} {'causal' if causal else 'full'}"
        lines.append(f"{shape:30} | " + " | ".join(cells))
    for res in results:
        for name, err in res.get("errors", {}).items():
            lines.append(f"  (not timed) {res['shape']}: {name}: {err}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", default=".gpu-images/gt", help="images built with --set gputest --targets sm90")
    ap.add_argument("--shapes", default="all", help="'all' or comma indices into SHAPES")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--launches", type=int, default=20, help="launches per timing sample")
    ap.add_argument("--check-timeout", type=float, default=120.0, help="seconds allowed per checking process")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the timing rounds")
    ap.add_argument("--child-check", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-time", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--keys", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    shapes = SHAPES if args.shapes == "all" else tuple(SHAPES[int(i)] for i in args.shapes.split(","))
    if args.child_check:
        child_check(args.images, args.start, Path(args.result))
        return 0
    if args.child_time:
        child_time(args.images, json.loads(args.keys), shapes, args.rounds, args.launches, args.budget,
                   Path(args.result))
        return 0

    import os

    started = time.monotonic()
    contenders = contenders_of(args.images)
    log(f"[load] {len(contenders)} contenders from {args.images}: "
        + ", ".join(sorted({c.label.split()[0] for c in contenders})))
    if not any(c.lever == "persistent" for c in contenders):
        log("[load] no persistent attn_fwd_sm90 config in these images: build them with --set gputest --targets sm90")
    details: dict = {"images": args.images, "shapes": shapes, "checks": [], "timing": []}
    with tempfile.TemporaryDirectory(prefix="sm90-persistent-") as tmp:
        work = Path(os.environ.get("OUT") or tmp)
        checks = run_checks(args.images, len(contenders), args.check_timeout, work)
        details["checks"] = checks
        for r in checks:
            what = r.get("error") or f"out {r.get('err_out', math.nan):.2e} lse {r.get('err_lse', math.nan):.2e}"
            spec = r.get("spec") or {}
            log(f"[check] {'PASS' if r['ok'] else 'FAIL'} {r['label']} {spec.get('dtype', '')} "
                f"causal{spec.get('CAUSAL', '')}: {what}")
        keys = [r["key"] for r in checks if r["ok"]]
        path = work / "timing.jsonl"
        path.unlink(missing_ok=True)
        why = run_child(__file__, ["--child-time", "--images", args.images, "--keys", json.dumps(keys),
                                   "--shapes", args.shapes, "--rounds", str(args.rounds),
                                   "--launches", str(args.launches), "--budget", str(args.budget),
                                   "--result", str(path)], args.budget + 180)
        results = read_lines(path)
        if why:
            log(f"[time] the timing process: {why}; {len(results)} of {len(shapes)} shapes measured")
    details["timing"] = results
    from sm90_levers import print_table

    print_table(results)
    log("\n== summary: best config of each family, median TFLOP/s and ratio to cuDNN (same run, shuffled order)")
    for line in summary(results):
        log(line)
    log(f"\ntotal {time.monotonic() - started:.0f} s")
    children.write_details("sm90_persistent.json", details, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
