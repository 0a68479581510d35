"""Run the product benchmarks: ``python -m bench [--quick] [--only NAME,...] [--images DIR] [--out DIR] [--plot]``.

Each benchmark runs in its own process (``python -m bench.NAME``), prints its own table and writes
its JSON; the runner then writes ``OUT/NAME.json`` (the script's JSON under ``raw``, plus the
ratios against its peers, see :mod:`bench.common`) and with ``--plot`` ``OUT/NAME.png``. Without a
GPU the GPU benchmarks are skipped, each with a line saying so, and the CPU ones still run
(``host_cost`` as ``--python-path``); the exit status is 1 only when a benchmark that ran failed.
``bench/README.md`` says what each one measures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT, write_json
from bench.results import ratios_of


@dataclass(frozen=True)
class Benchmark:
    name: str
    what: str
    gpu: bool  # needs a GPU (a CPU-only run skips it unless ``cpu`` says how to run it)
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    images_flag: bool = False  # takes --images DIR (all get AOTRITON_RT_IMAGES=DIR)
    cpu: tuple[str, ...] | None = None  # the arguments of its CPU-only form, if it has one
    cpu_quick: tuple[str, ...] = ()

    def args(self, *, quick: bool, gpu: bool, images: str | None) -> tuple[list[str], str | None]:
        """The script's arguments for this run, and a note when it runs in a reduced form."""
        if self.cpu is not None and (not gpu or images is None):
            note = ("no GPU: the operator's Python path only" if not gpu else
                    "no --images: the operator's Python path only (the GPU rows need --images)")
            return [*self.cpu, *(self.cpu_quick if quick else ())], note
        out = list(self.quick if quick else self.full)
        if self.images_flag and images:
            out += ["--images", images]
        return out, None


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("attention", "attention forward/backward TFLOP/s vs SDPA cuDNN, SDPA flash and the Triton JIT",
              gpu=True, images_flag=True,
              quick=("--shapes", "d128", "--dtype", "bf16", "--causal", "1", "--rounds", "3", "--no-jit")),
    Benchmark("attention_jit", "the kernels through the Triton JIT vs SDPA flash and cuDNN (kernel developer's view)",
              gpu=True, quick=("--n", "4096", "--d", "128", "--causal", "2", "--dtype", "bf16")),
    Benchmark("decode", "split-KV decode attention vs SDPA's backends, eager and CUDA graph",
              gpu=True, quick=("--b", "8", "--cache", "8192", "--gqa", "4", "--page", "16", "--rounds", "3")),
    Benchmark("host_cost", "host (CPU) cost per attention call vs SDPA's backends; first call; import",
              gpu=True, images_flag=True, quick=("--rounds", "3", "--calls", "200", "--fresh", "2", "--synth", "0"),
              cpu=("--python-path",), cpu_quick=("--rounds", "3", "--calls", "200")),
    Benchmark("launch_overhead", "host cost per kernel launch vs Triton JIT, cuda.core, CuPy and bare ctypes",
              gpu=True, images_flag=True, quick=("--launches", "2000", "--repeats", "3")),
    Benchmark("jax_jit", "aotriton_rt.jax under jax.jit vs eager torch, and vs JAX's cuDNN attention",
              gpu=True, quick=("--rounds", "3", "--iters", "10")),
    Benchmark("build_cost", "the default build set's compile cost, estimated from bench/build_timings.jsonl",
              gpu=False, full=("estimate", "--set", "default", "--timings", "bench/build_timings.jsonl"),
              quick=("estimate", "--set", "default", "--timings", "bench/build_timings.jsonl")),
)}
SKIP_GPU = "skipped: needs a GPU"


def gpu_available() -> bool:
    """Whether torch sees a CUDA (or ROCm) device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def default_out() -> Path:
    return Path(os.environ.get("OUT") or "bench-results")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                 epilog="benchmarks: " + ", ".join(BENCHMARKS))
    ap.add_argument("--quick", action="store_true", help="each benchmark's smallest settings (see bench/README.md)")
    ap.add_argument("--only", default=None, help="comma list of benchmarks to run (default: all)")
    ap.add_argument("--images", default=None, help="image folder for every benchmark (default: the default search)")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default: $OUT, else bench-results/)")
    ap.add_argument("--plot", action="store_true", help="also a PNG per benchmark (needs matplotlib)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds allowed per benchmark (default: none)")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)
    names = [n.strip() for n in (args.only or "").split(",") if n.strip()] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    args.names = names
    args.out = args.out or default_out()
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install 'aotriton-rt[bench]'")
    return args


def command(bench: Benchmark, script_args: list[str], raw: Path) -> list[str]:
    return [sys.executable, "-m", f"bench.{bench.name}", *script_args, "--json", str(raw)]


def run_benchmark(bench: Benchmark, args: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    """Runs one benchmark (or skips it) and writes ``OUT/NAME.json``; returns what it wrote."""
    result: dict[str, Any] = {"benchmark": bench.name, "what": bench.what, "quick": args.quick, "gpu": gpu,
                              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "ratios": [], "raw": None}
    if bench.gpu and not gpu and bench.cpu is None:
        print(f"{bench.name}: {SKIP_GPU}", flush=True)
        result.update(status="skipped", reason=SKIP_GPU)
        write_json(args.out / f"{bench.name}.json", result)
        return result
    script_args, note = bench.args(quick=args.quick, gpu=gpu, images=args.images)
    raw = args.out / "raw" / f"{bench.name}.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.unlink(missing_ok=True)
    cmd = command(bench, script_args, raw)
    env = {**os.environ, "OUT": str(raw.parent)}  # where the scripts' own $OUT files go
    if args.images:
        env["AOTRITON_RT_IMAGES"] = args.images
    print(f"\n=== {bench.name}" + (f" ({note})" if note else "") + ": " + " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    result.update(command=cmd[1:], note=note, returncode=rc, seconds=round(time.perf_counter() - start, 1),
                  status="ok" if rc == 0 else "failed")
    if raw.exists():
        result["raw"] = json.loads(raw.read_text())
        result["ratios"], why = ratios_of(bench.name, result["raw"])
        if why:
            result["ratios_note"] = why
    elif rc == 0:
        result["ratios_note"] = "the benchmark wrote no JSON"
    path = write_json(args.out / f"{bench.name}.json", result)
    if args.plot and result["ratios"]:
        from bench.plot import plot

        result["png"] = str(plot(result, path.with_suffix(".png")))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list:
        for b in BENCHMARKS.values():
            print(f"{b.name:<16} {'GPU' if b.gpu else 'CPU'}  {b.what}")
        return 0
    gpu = gpu_available()
    if not gpu:
        print("no GPU: the GPU benchmarks are skipped; host_cost runs its --python-path form", flush=True)
    results = [run_benchmark(BENCHMARKS[n], args, gpu) for n in args.names]
    print(f"\nresults in {args.out}/" + (" (quick settings)" if args.quick else ""))
    for r in results:
        extra = f" {r['seconds']} s" if "seconds" in r else ""
        extra += f", rc {r['returncode']}" if r["status"] == "failed" else ""
        extra += f", {r['png']}" if "png" in r else ""
        print(f"  {r['benchmark']:<16} {r.get('reason') or r['status']}{extra}")
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
