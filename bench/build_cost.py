"""What a build set costs to compile, from per-variant CPU seconds, without building all of it.

    python bench/build_cost.py sample --set default --per-cell 1 --timings T.jsonl [--targets ...] [--kernels ...]
    python bench/build_cost.py estimate --set default --timings T.jsonl [--workers 2]

``sample`` compiles a random sample of the set (``--per-cell`` variants of every kernel x target
x head dim, or with ``--by class`` of every kernel x target x (causal, dropout), seeded; cells
already timed in ``--timings`` as often are skipped) with one worker and appends a
record per variant to ``--timings`` (``python -m builder build --timings`` writes the same
records): CPU seconds of the worker and of its compiler subprocesses (ptxas, ld.lld), which a
machine shared with other work inflates far less than wall time.

``estimate`` prices every variant of a set at the mean CPU seconds of the most specific group of
timed variants that has data (kernel, target, head dim, mask and config; then kernel, target,
head dim, whether causal, whether dropout; then without the head dim; then the same for the
target's family, CUDA, CDNA or RDNA; then kernel and target; then kernel), prints
the total per kernel and per target, and the wall time it predicts for ``--workers`` workers on
an otherwise idle machine with that many cores: CPU seconds / workers, plus each worker's
start (importing Triton and the kernels, from the records of workers' first jobs). It
estimates the images' size the same way (xz bytes of images and of CUDA PTX).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as `python bench/NAME.py`: the checkout on the path (python -m bench.NAME needs none)
    sys.path.insert(0, str(ROOT))


def _jobs(build_set: str, targets: str, kernels: str | None) -> list:
    from builder import registry
    from builder.build import check_triton_version
    from builder.targets import parse_targets

    version = check_triton_version()
    chosen = parse_targets(targets)
    return [j for k in registry.select(registry.load_kernels(), kernels)
            for j in registry.expand(k, chosen, build_set, version)]


def _head_dim(spec: dict) -> object:
    return spec.get("HEAD_DIM", "-")


def _family(arch: str) -> str:
    return "cuda" if arch.startswith("sm") else "cdna" if arch.startswith("gfx9") else "rdna"


def _mask_class(spec: dict) -> tuple[bool, bool]:
    """(causal or windowed, dropout): what multiplies an attention kernel's code (and compile) size."""
    return bool(spec.get("CAUSAL")), bool(spec.get("DROPOUT"))


def _cell(kernel: str, arch: str, spec: dict, by: str) -> tuple:
    if by == "class":
        return (kernel, arch, *_mask_class(spec))
    return (kernel, arch, _head_dim(spec))


def _groups(kernel: str, arch: str, spec: dict, config: int) -> list[tuple]:
    """The groups a variant belongs to, most specific first."""
    hd, cls = _head_dim(spec), _mask_class(spec)
    return [(kernel, arch, hd, spec.get("CAUSAL"), spec.get("DROPOUT"), config), (kernel, arch, hd, *cls),
            (kernel, arch, *cls), (kernel, _family(arch), hd, *cls), (kernel, _family(arch), *cls),
            (kernel, arch), (kernel,)]


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def cmd_sample(args: argparse.Namespace) -> int:
    from builder import registry
    from builder.build import build, check_triton_version

    timings = Path(args.timings)
    records = _records(timings)
    done = {r["key"] for r in records}
    have: dict[tuple, int] = defaultdict(int)
    for r in records:
        have[_cell(r["kernel"], r["arch"], r["spec"], args.by)] += 1
    cells: dict[tuple, list] = defaultdict(list)
    for job in _jobs(args.set, args.targets, args.kernels):
        cells[_cell(job.kernel, job.target.arch, job.spec, args.by)].append(job)
    rng = random.Random(args.seed)
    chosen = []
    for cell in sorted(cells, key=str):
        jobs = sorted((j for j in cells[cell] if j.key not in done), key=lambda j: j.key)
        chosen += rng.sample(jobs, max(0, min(args.per_cell - have[cell], len(jobs))))
    print(f"sampling {len(chosen)} variants of {sum(map(len, cells.values()))} in {len(cells)} cells", file=sys.stderr)
    if not chosen:
        return 0
    with tempfile.TemporaryDirectory(prefix="aotriton-cost-") as tmp:
        os.environ["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton-cache")  # no cache hits: real compiles
        summary = build(chosen, Path(tmp) / "images", workers=args.jobs, timeout=600.0, keep_going=True,
                        triton_version=check_triton_version(), quiet=False, existing="replace",
                        tuning=registry.tuning_of(registry.load_kernels(), chosen), timings=timings)
    print("\n".join(summary.lines()))
    return 0


def _means(records: list[dict], metric: str) -> dict[tuple, float]:
    """Mean of ``metric`` per group, over the records that have it."""
    sums: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        if metric in r:
            for g in _groups(r["kernel"], r["arch"], r["spec"], r["config"]):
                sums[g].append(r[metric])
    return {g: statistics.fmean(v) for g, v in sums.items()}


def _price(records: list[dict]) -> tuple[dict[tuple, float], float]:
    """Mean CPU seconds per group (workers' first jobs left out), and a worker's start cost."""
    means = _means([r for r in records if not r.get("first")], "cpu_s")
    starts = []
    for r in records:
        if r.get("first"):
            base = next((means[g] for g in _groups(r["kernel"], r["arch"], r["spec"], r["config"]) if g in means), None)
            if base is not None:
                starts.append(max(0.0, r["cpu_s"] - base))
    return means, (statistics.median(starts) if starts else 0.0)


def _lookup(means: dict[tuple, float], job) -> float | None:
    return next((means[g] for g in _groups(job.kernel, job.target.arch, job.spec, job.config_index) if g in means),
                None)


def cmd_estimate(args: argparse.Namespace) -> int:
    records = _records(Path(args.timings))
    if not records:
        raise SystemExit(f"{args.timings}: no timing records")
    means, start = _price(records)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    per_arch: dict[str, float] = defaultdict(float)
    levels = [0] * 7
    unpriced = []
    for job in _jobs(args.set, args.targets, args.kernels):
        groups = _groups(job.kernel, job.target.arch, job.spec, job.config_index)
        level = next((i for i, g in enumerate(groups) if g in means), None)
        if level is None:
            unpriced.append(job.label)
            continue
        levels[level] += 1
        cost = means[groups[level]]
        per_kernel[job.kernel][0] += 1
        per_kernel[job.kernel][1] += cost
        per_arch[job.target.arch] += cost
    sizes = {m: _means(records, m) for m in ("xz_bytes", "ptx_xz_bytes")}
    image_bytes = sum(_lookup(sizes["xz_bytes"], j) or 0 for j in _jobs(args.set, args.targets, args.kernels))
    ptx_bytes = sum(_lookup(sizes["ptx_xz_bytes"], j) or 0 for j in _jobs(args.set, args.targets, args.kernels)
                    if j.target.backend == "cuda")
    total = sum(c for _, c in per_kernel.values())
    count = sum(n for n, _ in per_kernel.values())
    print(f"{'kernel':<22}{'variants':>9}{'CPU s':>9}{'s/variant':>10}")
    for name, (n, cost) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:<22}{n:>9}{cost:>9.0f}{cost / n:>10.2f}")
    print("per target: " + ", ".join(f"{a} {c:.0f} s" for a, c in sorted(per_arch.items())))
    wall = total / args.workers + start
    print(f"{args.set}: {count} variants priced from {len(records)} timed "
          f"(by group level {levels}); {total:.0f} CPU s; worker start {start:.1f} s; "
          f"idle wall on {args.workers} cores ~ {wall:.0f} s = {wall / 60:.1f} min")
    print(f"size: images ~{image_bytes / 1e6:.1f} MB xz, CUDA PTX ~{ptx_bytes / 1e6:.1f} MB xz "
          "(from the timed variants' mean sizes)")
    if unpriced:
        print(f"{len(unpriced)} variants have no timed group, e.g. {unpriced[0]}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "set": args.set, "targets": args.targets, "variants": count, "timed": len(records), "levels": levels,
            "cpu_s": total, "worker_start_s": start, "workers": args.workers, "wall_s": wall,
            "per_kernel": {k: {"variants": n, "cpu_s": c} for k, (n, c) in per_kernel.items()},
            "per_target_cpu_s": dict(per_arch), "image_xz_bytes": image_bytes, "ptx_xz_bytes": ptx_bytes,
            "unpriced": len(unpriced)}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn in (("sample", cmd_sample), ("estimate", cmd_estimate)):
        sp = sub.add_parser(name)
        sp.add_argument("--set", default="default")
        sp.add_argument("--targets", default="default")
        sp.add_argument("--kernels")
        sp.add_argument("--timings", required=True, help="JSON lines, one per compiled variant")
        sp.set_defaults(func=fn)
        if name == "sample":
            sp.add_argument("--per-cell", type=int, default=1, help="timed variants wanted per cell")
            sp.add_argument("--by", choices=("hd", "class"), default="hd",
                            help="cells: kernel x target x head dim, or kernel x target x (causal, dropout)")
            sp.add_argument("--seed", type=int, default=0)
            sp.add_argument("-j", "--jobs", type=int, default=1)
        else:
            sp.add_argument("--workers", type=int, default=2)
            sp.add_argument("--json", default=None, help="also write the estimate here")
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
