"""CPU cost per launch of a small kernel, against its peers on the same cubin, in one run.

    python bench/launch_overhead.py --images DIR [--launches 20000]

Peers: this runtime from torch tensors and from CuPy arrays, Triton JIT of the same source,
cuda.core `launch`, CuPy `RawKernel` (RawModule over the same cubin), and bare ctypes
`cuLaunchKernel`. Each figure is the median over repeats of (host time of N launches) / N.
Also: `import aotriton_rt` time in a fresh interpreter, and the first launch of a kernel in a
fresh process (decompress + verify + load). Prints a table with ratios to Triton JIT.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import lzma
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as `python bench/NAME.py`: the checkout on the path (python -m bench.NAME needs none)
    sys.path.insert(0, str(ROOT))

N_ELEMS = 1024


def per_launch_us(fn, launches: int, repeats: int, sync) -> float:
    """Host time per launch in steady state: (time of ``launches`` launches) / launches.

    The GPU runs the launches as they come, as in real use. (Queuing them behind a sleep kernel
    instead was tried on the H200: every peer got slower, by 2-6 us, so that is not the
    cheaper "CPU only" figure it looks like.)
    """
    for _ in range(200):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(launches):
            fn()
        t1 = time.perf_counter()
        sync()
        samples.append((t1 - t0) / launches * 1e6)
    return statistics.median(samples)


def import_time_ms() -> tuple[float, list[str]]:
    code = ("import sys, time; t = time.perf_counter(); import aotriton_rt; d = time.perf_counter() - t; "
            "heavy = [m for m in ('torch', 'triton', 'cupy', 'jax') if m in sys.modules]; "
            "print(d * 1000, ','.join(heavy))")
    best, heavy = 1e9, []
    for _ in range(5):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                             check=True).stdout.split()
        best = min(best, float(out[0]))
        heavy = out[1].split(",") if len(out) > 1 else []
    return best, heavy


def first_launch_ms(images: str) -> tuple[float, float]:
    code = f"""
import time, torch, aotriton_rt
x = torch.randn({N_ELEMS}, device="cuda"); torch.cuda.synchronize()
lib = aotriton_rt.Library({images!r})
t = time.perf_counter(); k = lib.kernel("add", dtype="fp32"); k(x, x, x, {N_ELEMS}); torch.cuda.synchronize()
first = time.perf_counter() - t
t = time.perf_counter(); k(x, x, x, {N_ELEMS}); torch.cuda.synchronize(); second = time.perf_counter() - t
print(first * 1000, second * 1000)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    a, b = out.stdout.split()
    return float(a), float(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", default=str(ROOT / "images"))
    ap.add_argument("--launches", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="also write results here")
    args = ap.parse_args()

    import torch

    import aotriton_rt

    lib = aotriton_rt.Library(args.images)
    add = lib.kernel("add", dtype="fp32")
    x = torch.randn(N_ELEMS, device="cuda")
    y = torch.randn(N_ELEMS, device="cuda")
    out = torch.empty_like(x)
    add(x, y, out, N_ELEMS)
    torch.cuda.synchronize()
    variant = add.variant(0)
    cubin = lzma.decompress((Path(args.images) / variant.image.path).read_bytes())
    sync = torch.cuda.synchronize
    results: dict[str, float | str] = {}

    def run(name, fn, sync_fn=sync):
        try:
            results[name] = per_launch_us(fn, args.launches, args.repeats, sync_fn)
        except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
            results[name] = f"unavailable: {type(e).__name__}: {e}"[:120]

    # ``add`` against torch.add, alternating per round (order shuffled, seeded): the ratio per
    # round, as host speed drifts between rounds here.
    pair = {"aotriton_rt add": lambda: add(x, y, out, N_ELEMS), "torch.add(out=)": lambda: torch.add(x, y, out=out)}
    per_round: dict[str, list[float]] = {n: [] for n in pair}
    for r in range(args.repeats):
        order = list(pair)
        random.Random(r).shuffle(order)
        for name in order:
            per_round[name].append(per_launch_us(pair[name], args.launches, 1, sync))
    ratios = [a / b for a, b in zip(per_round["aotriton_rt add"], per_round["torch.add(out=)"])]
    for name, samples in per_round.items():
        print(f"{name:24s} {statistics.median(samples):6.2f} us ({min(samples):.2f}-{max(samples):.2f})")
    print(f"aotriton_rt add / torch.add per round: median {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}); target <= 1.10")
    results["add vs torch.add (ratio, median of rounds)"] = f"{statistics.median(ratios):.3f}"

    grid = (1,)
    run("aotriton_rt (torch tensors)", lambda: add(x, y, out, N_ELEMS))
    launch_grid = add[grid]
    run("aotriton_rt (torch, explicit grid)", lambda: launch_grid(x, y, out, N_ELEMS))

    try:
        import cupy as cp

        cx, cy = cp.asarray(x), cp.asarray(y)
        cout = cp.empty_like(cx)
        # The legacy default stream, like every other peer here (the sleep kernel blocks it).
        cstream = cp.cuda.Stream.null
        cstream.use()
        add(cx, cy, cout, N_ELEMS)
        run("aotriton_rt (cupy arrays)", lambda: add(cx, cy, cout, N_ELEMS), cstream.synchronize)
        tmp = ROOT / ".bench-add.cubin"
        tmp.write_bytes(cubin)
        raw_kernel = cp.RawModule(path=str(tmp)).get_function(variant.symbol)
        tmp.unlink()
        args6 = (cx, cy, cout, cp.int64(N_ELEMS), cp.uint64(0), cp.uint64(0))
        run("cupy RawKernel (same cubin)",
            lambda: raw_kernel((1,), (variant.num_threads,), args6), cstream.synchronize)
        cp.cuda.Stream.null.use()
    except Exception as e:  # noqa: BLE001
        results["cupy"] = f"unavailable: {e}"[:120]

    try:
        import triton

        from builder.kernels.add import add_kernel

        jit = add_kernel[grid]
        jit(x, y, out, N_ELEMS, BLOCK=1024, num_warps=4, num_stages=1)
        run("triton JIT (same source)", lambda: jit(x, y, out, N_ELEMS, BLOCK=1024, num_warps=4, num_stages=1))
        results["triton version"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        results["triton JIT (same source)"] = f"unavailable: {e}"[:120]

    try:
        try:
            from cuda.core import Device, LaunchConfig, ObjectCode, launch
        except ImportError:
            from cuda.core.experimental import Device, LaunchConfig, ObjectCode, launch
        dev = Device(0)
        dev.set_current()
        stream = dev.default_stream
        kern = ObjectCode.from_cubin(cubin).get_kernel(variant.symbol)
        cfg = LaunchConfig(grid=1, block=variant.num_threads)
        # cuda.core takes ctypes integers (not c_void_p) for raw pointers.
        kargs = (ctypes.c_uint64(x.data_ptr()), ctypes.c_uint64(y.data_ptr()), ctypes.c_uint64(out.data_ptr()),
                 ctypes.c_int64(N_ELEMS), ctypes.c_uint64(0), ctypes.c_uint64(0))
        run("cuda.core launch (same cubin)", lambda: launch(stream, cfg, kern, *kargs), stream.sync)
    except Exception as e:  # noqa: BLE001
        results["cuda.core launch (same cubin)"] = f"unavailable: {type(e).__name__}: {e}"[:120]

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        assert cuda.cuModuleLoadData(ctypes.byref(mod), cubin) == 0
        assert cuda.cuModuleGetFunction(ctypes.byref(fn), mod, variant.symbol.encode()) == 0
        holders = [ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                   ctypes.c_int64(N_ELEMS), ctypes.c_void_p(0), ctypes.c_void_p(0)]
        params = (ctypes.c_void_p * 6)(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
        launch_fn = cuda.cuLaunchKernel
        launch_fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_uint, ctypes.c_void_p,
                                                                       ctypes.c_void_p, ctypes.c_void_p]
        stream = torch.cuda.current_stream().cuda_stream
        nt = variant.num_threads
        run("bare ctypes cuLaunchKernel", lambda: launch_fn(fn, 1, 1, 1, nt, 1, 1, 0, stream, params, None))
    except Exception as e:  # noqa: BLE001
        results["bare ctypes cuLaunchKernel"] = f"unavailable: {e}"[:120]

    # Where the time goes: the runtime's Python path with the driver call replaced by a no-op,
    # the launcher alone (pack + one ctypes call), and the torch accessors it relies on.
    st = add._states[0]
    real = st.launcher
    st.launcher = lambda gx, gy, gz, stream, values: None
    run("breakdown: runtime Python path, no driver call", lambda: add(x, y, out, N_ELEMS))
    st.launcher = real
    values = (x.data_ptr(), y.data_ptr(), out.data_ptr(), N_ELEMS, 0, 0)
    s0 = torch.cuda.current_stream().cuda_stream
    run("breakdown: launcher alone (pack + cuLaunchKernel)", lambda: real(1, 1, 1, s0, values))
    run("breakdown: 3x data_ptr + get_device", lambda: (x.data_ptr(), x.get_device(), y.data_ptr(),
                                                       y.get_device(), out.data_ptr(), out.get_device()))
    raw_stream = torch._C._cuda_getCurrentRawStream
    run("breakdown: torch current raw stream", lambda: raw_stream(0))

    # The launcher's modes side by side, in this process: kernelParams or the extra buffer,
    # with the GIL held through cuLaunchKernel or released (ctypes' default).
    from aotriton_rt.drivers.cuda import _SIGNATURES, CudaLauncher

    drv = lib.driver
    hold = ctypes.PYFUNCTYPE(ctypes.c_int, *_SIGNATURES["cuLaunchKernel"])(
        ctypes.cast(drv._cuLaunchKernel, ctypes.c_void_p).value)
    for mode, gil in (("params", "held"), ("params", "released"), ("extra", "released")):
        launcher = CudaLauncher(drv, real._function, real._symbol, real._device, real._struct, real._block,
                                real._shared, mode)
        launcher._launch = hold if gil == "held" else drv._cuLaunchKernel
        run(f"launcher mode: {mode}, GIL {gil}", lambda launcher=launcher: launcher(1, 1, 1, s0, values))

    imp_ms, heavy = import_time_ms()
    results["import aotriton_rt (ms)"] = imp_ms
    results["import pulled in"] = ",".join(heavy) or "nothing heavy"
    first, second = first_launch_ms(args.images)
    results["first launch in fresh process (ms)"] = first
    results["second launch (ms)"] = second

    jit_us = results.get("triton JIT (same source)")
    print(f"\nGPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; launches {args.launches} x "
          f"{args.repeats} repeats (median); kernel add fp32, {N_ELEMS} elements, 1 block")
    print(f"{'what':44s} {'us/launch':>10s} {'vs Triton JIT':>14s}")
    for name, value in results.items():
        if isinstance(value, float) and "(ms)" not in name:
            ratio = f"{value / jit_us:.2f}x" if isinstance(jit_us, float) else "-"
            print(f"{name:44s} {value:10.2f} {ratio:>14s}")
        elif isinstance(value, float):
            print(f"{name:44s} {value:10.2f} ms")
        else:
            print(f"{name:44s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TRITON_PRINT_AUTOTUNING", "0")
    main()
