"""Where the host time of a small call goes: cProfile and torch.profiler over the operator's calls.

    python -m bench.host_profile --images DIR [--calls 2000] [--top 25] [--out DIR]

For each path (a forward ``aotriton_rt.attention`` at (1, 1, 64, 64) fp16, a forward + backward
through ``aotriton_rt.ops.torch.attention`` and autograd, an eager ``decode_attention`` at batch 1
with a 2,048-key cache, the generic ``add`` launch) it runs ``--calls`` calls under cProfile and
prints the functions by their own time per call (µs), then one torch.profiler table of the
forward + backward (CPU side: what torch's own ops and autograd cost around ours). Last, the
first call in a fresh process under cProfile: where its milliseconds go (catalog open, shard
reads, decompression, module load, launcher build, plan building).

The numbers are cProfile's, which adds its own cost to every Python call: use them to rank where
the time goes, ``bench/host_cost.py`` for the per-call times themselves.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

FIRST_CALL = r"""
import cProfile, pstats, sys, time
import torch
torch.cuda.init()
q, k, v = (torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.float16) for _ in range(3))
torch.cuda.synchronize()
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
import aotriton_rt
lib = aotriton_rt.Library(sys.argv[1])
out, lse = aotriton_rt.attention(q, k, v, library=lib)
torch.cuda.synchronize()
prof.disable()
print(f"first call after torch is up, import included: {(time.perf_counter() - t0) * 1e3:.1f} ms (under cProfile)")
st = pstats.Stats(prof)
st.sort_stats("cumulative").print_stats(int(sys.argv[2]))
st.sort_stats("tottime").print_stats(int(sys.argv[2]))
"""


def profile(name: str, fn: Callable[[], Any], calls: int, top: int, sync: Callable[[], None]) -> str:
    """cProfile of ``calls`` calls of ``fn`` after a warm-up; the table by own time, per call."""
    for _ in range(20):
        fn()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    sync()
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())  # own times sum to the profiled total
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    out = [f"\n== {name}: {total / calls * 1e6:.1f} µs per call under cProfile; own time per call, top {top}"]
    for (file, line, func), (_calls, nc, tt, ct, _) in rows:
        where = f"{Path(file).name}:{line}" if line else file
        out.append(f"  {tt / calls * 1e6:8.2f} µs own {ct / calls * 1e6:8.2f} µs cum {nc / calls:6.1f} calls  "
                    f"{func}  ({where})")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", required=True)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()

    import torch

    import aotriton_rt
    from aotriton_rt.ops import torch as op_torch

    lib = aotriton_rt.Library(args.images)
    sync = torch.cuda.synchronize
    q, k, v = (torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(q)
    qd = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kd, vd = (torch.randn(1, 2048, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)

    def train() -> None:
        op_torch.attention(*leaves, library=lib).backward(grad)

    add = lib.kernel("add", dtype="fp32")
    paths = {"forward (1,1,64,64) fp16": lambda: aotriton_rt.attention(q, k, v, library=lib),
             "autograd forward+backward (1,1,64,64) fp16": train,
             "decode_attention B=1, 2048 keys, 32/8 heads, bf16": lambda: aotriton_rt.decode_attention(
                 qd, kd, vd, library=lib),
             "add (generic launch, 4096 fp32)": lambda: add(x, x, y, x.numel())}
    report = []
    for name, fn in paths.items():
        try:
            report.append(profile(name, fn, args.calls, args.top, sync))
        except Exception as e:  # noqa: BLE001 - a path the images cannot serve: say so, go on
            report.append(f"\n== {name}: not profiled ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
        print(report[-1], flush=True)

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    for _ in range(20):
        train()
    sync()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(200):
            train()
        sync()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
    report.append("\n== torch.profiler, autograd forward+backward, 200 steps\n" + table)
    print(report[-1], flush=True)

    first = subprocess.run([sys.executable, "-c", FIRST_CALL, args.images, str(args.top)], capture_output=True,
                           text=True, timeout=300)
    report.append("\n== first call in a fresh process\n" + first.stdout + first.stderr[-2000:])
    print(report[-1], flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "host_profile.txt").write_text("\n".join(report))


if __name__ == "__main__":
    main()
