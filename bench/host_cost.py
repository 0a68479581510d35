"""Host cost of the attention operator per call, against torch SDPA's backends, in one process.

    python bench/host_cost.py --images DIR [--rounds 7] [--calls 2000] [--full-images DIR2]
    python bench/host_cost.py --python-path          # no GPU: the operator's own Python cost

DIR: ``python -m builder build --set gputest --targets sm90 --out DIR``. Rows:

- per-call host time of ``aotriton_rt.attention`` and of the torch custom op at (1, 1, 64, 64)
  fp16, against ``F.scaled_dot_product_attention`` with its default, efficient, flash and cuDNN
  backends; forward + backward through autograd against SDPA's;
- a decode step, q (8, 32, 1, 128) bf16, k/v (8, 8, 4096, 128): wall time per call against the
  kernel's own time from CUDA events (and SDPA's wall time); and at batch 1 with 2,048 keys,
  eager wall time per call against SDPA's, shuffled;
- ``import aotriton_rt`` and the first attention call in a fresh process (torch and CUDA up);
- with ``--full-images`` (or a catalog synthesised to ``--synth`` variants from DIR's): opening
  the library + the first call, the memory that adds, and catalog bytes per variant.

Per-call figures: host time of ``--calls`` calls / calls (the GPU runs them as they come, synced
after each batch), median over ``--rounds`` rounds with the spread (min-max); the contenders'
order is shuffled every round. Ratios are against peers measured in the same run. Prints a
table; writes ``host_cost.json`` under ``$OUT`` when set.

``--python-path`` needs no GPU: CPU tensors stand in for device arrays and the kernels do
nothing, so it times only the operator's Python (signature, plan lookup, allocation, argument
filling). Run it with ``PYTHONPATH`` at another checkout to compare before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as `python bench/host_cost.py`, the checkout goes on the path unless PYTHONPATH names one (to time
# another checkout); python -m bench.host_cost needs none.
if not __package__ and str(ROOT) not in sys.path and "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------------------

def per_call_rounds(contenders: dict[str, Any], calls: int, rounds: int, sync: Callable[[], None],
                    seed: int = 0) -> dict[str, list[float]]:
    """µs per call for every contender, ``rounds`` samples each, the order shuffled every round.

    A contender is a callable, or ``(callable, context factory)`` entered around each batch (e.g.
    SDPA's backend selection, which should not be timed per call).
    """
    rng = random.Random(seed)
    names = list(contenders)

    def parts(name: str) -> tuple[Callable[[], Any], Any]:
        c = contenders[name]
        return (c[0], c[1]) if isinstance(c, tuple) else (c, contextlib.nullcontext)

    for name in names:  # warm up: plans, modules, caches
        fn, context = parts(name)
        with context():
            for _ in range(50):
                fn()
        sync()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[:] if r % 2 == 0 else names[::-1]
        rng.shuffle(order)
        for name in order:
            fn, context = parts(name)
            with context():
                sync()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                t1 = time.perf_counter()
                sync()
            samples[name].append((t1 - t0) / calls * 1e6)
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def fmt(s: dict[str, float]) -> str:
    return f"{s['median']:8.2f} ({s['min']:.2f}-{s['max']:.2f})"


# ---------------------------------------------------------------------------------------------
# No GPU: the operator's own Python cost with no-op kernels.
# ---------------------------------------------------------------------------------------------

def python_path(calls: int, rounds: int) -> dict[str, Any]:
    """Per-call Python cost of aotriton_rt.attention (+ backward) with CPU tensors and no-op kernels."""
    import torch

    from aotriton_rt import interop
    from aotriton_rt.ops import attention as op
    from builder.registry import _resolve_signature, load_kernels

    decls = load_kernels()
    names = {torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.bfloat16: "bf16"}

    def describe(obj: Any, name: str) -> interop.ArrayInfo:
        return interop.ArrayInfo(obj.data_ptr(), 0, names[obj.dtype], tuple(obj.shape), tuple(obj.stride()), "torch")

    class NoOp:
        def __init__(self, name: str, params: dict) -> None:
            self.arg_names = [n for n, t in _resolve_signature(decls[name], params).items() if t != "constexpr"]
            self.params = params

        def __call__(self, *args: Any, stream: Any = None) -> None:
            pass

        def prepare(self, device: int, values: Any) -> Callable:
            return lambda stream, args: None

    class NoOpLibrary:
        catalogs: list = []  # what checkouts before Library.tuning read the tuning table from
        tuning: dict = {}

        def kernel(self, name: str, **params: Any) -> NoOp:
            return NoOp(name, params)

        def targets(self) -> list[tuple[str, str]]:
            return [("cuda", "sm80")]  # one arch, so the dispatch asks no driver; sm80: the portable kernels

    lib = NoOpLibrary()
    new_layout = hasattr(op, "plan")
    if new_layout:
        from aotriton_rt.ops.attention import dispatch, plan, problem

        problem._describe = describe
        dispatch._available = lambda library, name, params: name != "attn_bwd_dq_convert"
        # CPU tensors report device -1; count them as device 0 so the torch fast path is timed.
        real_sig = plan._sig

        def sig(obj: Any, name: str) -> Any:
            if type(obj) is torch.Tensor:  # as signature._sig, with CPU tensors counted as device 0
                ptr = obj.data_ptr()
                return (obj.shape, obj.stride(), obj.dtype, obj.get_device() + 1 + obj.is_cuda, not ptr & 15), ptr
            return real_sig(obj, name)

        # Each plan module looks these up in its own namespace: plan.py (the forward, and the
        # backward before it moved to backward_plan.py) and backward_plan.py where it exists.
        backward_plan = sys.modules.get("aotriton_rt.ops.attention.backward_plan")
        for module in (plan, backward_plan) if backward_plan is not None else (plan,):
            module._sig = sig
            module._fast_handles = lambda p, handles, arrays: True
            module._stream_getter = lambda p, q: (lambda device: 0)
        # Where the signature helpers live: plan.py before they moved to signature.py.
        sys.modules.get("aotriton_rt.ops.attention.signature", plan)._tensor = torch.Tensor
    else:
        op._describe = describe
        op._available = lambda library, name, params: name != "attn_bwd_dq_convert"
    q, k, v = (torch.randn(1, 1, 64, 64).to(torch.float16) for _ in range(3))
    out, lse = op.attention(q, k, v, library=lib)
    dout = torch.randn_like(out)
    from aotriton_rt.ops import torch as op_torch

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(out)
    contenders = {
        "attention (1,1,64,64) fp16": lambda: op.attention(q, k, v, library=lib),
        "attention causal": lambda: op.attention(q, k, v, causal=True, library=lib),
        "attention_backward": lambda: op.attention_backward(dout, q, k, v, out, lse, library=lib),
        "autograd forward+backward": lambda: op_torch.attention(*leaves, library=lib).backward(grad),
        "torch.empty x2 (floor)": lambda: (torch.empty((1, 1, 64, 64), dtype=torch.float16),
                                           torch.empty((1, 1, 64), dtype=torch.float32)),
    }
    samples = per_call_rounds(contenders, calls, rounds, lambda: None)
    return {name: summary(s) for name, s in samples.items()} | {"layout": "plans" if new_layout else "monolith"}


# ---------------------------------------------------------------------------------------------
# GPU rows.
# ---------------------------------------------------------------------------------------------

FIRST_CALL = r"""
import json, os, resource, sys, time
import torch
torch.cuda.init()
q, k, v = (torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.float16) for _ in range(3))
torch.cuda.synchronize()
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
import aotriton_rt
t1 = time.perf_counter()
lib = aotriton_rt.Library(sys.argv[1])
warm_ms = None
if len(sys.argv) > 2:
    w = time.perf_counter()
    aotriton_rt.warmup(dtype="fp16", head_dim=64, seqlen=64, library=lib)
    warm_ms = (time.perf_counter() - w) * 1e3
t2 = time.perf_counter()
out, lse = aotriton_rt.attention(q, k, v, library=lib)
torch.cuda.synchronize()
t3 = time.perf_counter()
out, lse = aotriton_rt.attention(q, k, v, library=lib)
torch.cuda.synchronize()
t4 = time.perf_counter()
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "open_ms": (t2 - t1) * 1e3, "first_call_ms": (t3 - t2) * 1e3,
                  "second_call_ms": (t4 - t3) * 1e3, "warmup_ms": warm_ms, "open_plus_first_ms": (t3 - t1) * 1e3,
                  "added_mb": (rss1 - rss0) / 1024, "variants": sum(c.count for c in lib.catalogs),
                  "shards": sum(len(c.target_kernels()) for c in lib.catalogs),
                  "shards_read": sum(len(c.target_kernels()) - len(c.shard_refs()) for c in lib.catalogs)}))
"""

IMPORT = ("import sys, time; t = time.perf_counter(); import aotriton_rt; d = time.perf_counter() - t; "
          "heavy = [m for m in ('torch', 'triton', 'cupy', 'jax', 'numpy') if m in sys.modules]; "
          "print(d * 1000, ','.join(heavy) or '-')")


def fresh_process(images: Path, repeats: int = 5) -> dict[str, Any]:
    """First-call rows from fresh processes; alternately with ``aotriton_rt.warmup`` called
    between open and the first call (the ``warmed_`` keys)."""
    runs, warmed = [], []
    for _ in range(repeats):
        for extra, into in (((), runs), (("warm",), warmed)):
            out = subprocess.run([sys.executable, "-c", FIRST_CALL, str(images), *extra], capture_output=True,
                                 text=True, cwd=ROOT, check=True).stdout
            into.append(json.loads(out.strip().splitlines()[-1]))
    imports = []
    for _ in range(repeats):
        ms, heavy = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True, cwd=ROOT,
                                   check=True).stdout.split()
        imports.append(float(ms))
    counts = ("variants", "shards", "shards_read")
    result = {key: summary([r[key] for r in runs]) for key in runs[0] if key not in counts and key != "warmup_ms"}
    result.update({f"warmed_{key}": summary([r[key] for r in warmed]) for key in ("warmup_ms", "first_call_ms")})
    result.update({key: runs[0][key] for key in counts})
    result["import_alone_ms"] = summary(imports)
    result["import_heavy_modules"] = heavy
    return result


def synthesise(images: Path, variants: int, into: Path) -> Path:
    """A catalog of ``variants`` entries over the seven default targets, made from DIR's real
    shards (``builder/synth.py``: new keys, same images; only DIR's own variants are chosen)."""
    from builder.synth import synthesise as synth

    if into.exists():
        import shutil

        shutil.rmtree(into)
    return synth(images, into, variants)


def catalog_bytes(folder: Path) -> int:
    """Bytes of a folder's catalog: ``catalog.json`` and every shard it lists."""
    from aotriton_rt.catalog import Catalog

    cat = Catalog.load(folder)
    return (folder / "catalog.json").stat().st_size + sum(r.size for r in cat.shard_refs())


def gpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import aotriton_rt
    from aotriton_rt.ops import torch as op_torch

    lib = aotriton_rt.Library(args.images)
    sync = torch.cuda.synchronize
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    # Small forward: host time per call.
    q, k, v = (torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.float16) for _ in range(3))

    def sdpa(backend: Any) -> Any:
        run = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
        if backend is None:
            return run
        try:
            with sdpa_kernel(backend):
                run()
        except RuntimeError:
            return None  # this backend cannot run the shape here
        return run, lambda: sdpa_kernel(backend)

    contenders = {"aotriton_rt.attention": lambda: aotriton_rt.attention(q, k, v, library=lib),
                  "aotriton_rt.ops.torch.attention (custom op)": lambda: op_torch.attention(q, k, v, library=lib)}
    for name, backend in (("SDPA default", None), ("SDPA efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):
        fn = sdpa(backend)
        if fn is not None:
            contenders[name] = fn
    fwd = {n: summary(s) for n, s in per_call_rounds(contenders, args.calls, args.rounds, sync).items()}
    results["forward"] = fwd

    # Forward + backward through autograd.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(q)

    def ours_train() -> None:
        op_torch.attention(*leaves, library=lib).backward(grad)

    def sdpa_train() -> None:
        F.scaled_dot_product_attention(*leaves).backward(grad)
    train = {n: summary(s) for n, s in per_call_rounds({"aotriton_rt autograd fwd+bwd": ours_train,
                                                         "SDPA default fwd+bwd": sdpa_train},
                                                        max(args.calls // 4, 50), args.rounds, sync).items()}
    results["train"] = train

    # Decode step: wall per call vs the kernel's own time.
    qd = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    kd, vd = (torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    decode = {"aotriton_rt decode": lambda: aotriton_rt.attention(qd, kd, vd, library=lib),
              "SDPA decode (enable_gqa)": lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)}
    n = max(args.calls // 10, 50)
    wall = {}
    for name, fn in decode.items():
        samples = []
        for _ in range(args.rounds):
            fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            samples.append((time.perf_counter() - t0) / n * 1e6)
        wall[name] = summary(samples)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    kernel = []
    for _ in range(args.rounds):
        aotriton_rt.attention(qd, kd, vd, library=lib)
        sync()
        start.record()
        for _ in range(n):
            aotriton_rt.attention(qd, kd, vd, library=lib)
        end.record()
        sync()
        kernel.append(start.elapsed_time(end) / n * 1e3)
    # A graph of n calls gives the kernels' time with no host gaps between them.
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        aotriton_rt.attention(qd, kd, vd, library=lib)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        for _ in range(n):
            aotriton_rt.attention(qd, kd, vd, library=lib)
    graph_us = []
    for _ in range(args.rounds):
        sync()
        start.record()
        graph.replay()
        end.record()
        sync()
        graph_us.append(start.elapsed_time(end) / n * 1e3)
    results["decode"] = {"wall": wall, "events_per_call": summary(kernel), "graph_per_call": summary(graph_us)}

    # Decode at batch 1 (a single stream generating): eager wall per call, ours and SDPA's, shuffled.
    q1 = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k1, v1 = (torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    results["decode_b1"] = {n: summary(s) for n, s in per_call_rounds(
        {"aotriton_rt decode, batch 1, 2048 keys": lambda: aotriton_rt.attention(q1, k1, v1, library=lib),
         "SDPA decode (enable_gqa), batch 1, 2048 keys": lambda: F.scaled_dot_product_attention(
             q1, k1, v1, enable_gqa=True)}, max(args.calls // 2, 50), args.rounds, sync).items()}

    results["fresh_process"] = fresh_process(args.images, args.fresh)
    full = args.full_images
    if full is None and args.synth:
        full = synthesise(args.images, args.synth, Path(tempfile.gettempdir()) / "aotriton_rt_synth_images")
    if full is not None:
        try:
            size = catalog_bytes(Path(full))
            fp = fresh_process(Path(full), max(args.fresh // 2, 2))
            fp["catalog_bytes_per_variant"] = size / max(fp["variants"], 1)
            results["full_set"] = fp
        except (OSError, subprocess.CalledProcessError) as e:
            results["full_set_error"] = f"{type(e).__name__}: {getattr(e, 'stderr', '') or e}"[-2000:]
    return results


def table(results: dict[str, Any]) -> str:
    rows = ["| row | µs per call, median (min-max) | ratio |", "|---|---:|---:|"]
    fwd = results["forward"]
    peers = [v["median"] for n, v in fwd.items() if n.startswith("SDPA")]
    fastest = min(peers) if peers else float("nan")
    for name, s in fwd.items():
        rows.append(f"| {name}, (1,1,64,64) fp16 | {fmt(s)} | {s['median'] / fastest:.2f}x SDPA fastest |")
    train = results["train"]
    sd = train["SDPA default fwd+bwd"]["median"]
    for name, s in train.items():
        rows.append(f"| {name} | {fmt(s)} | {s['median'] / sd:.2f}x SDPA |")
    dec = results["decode"]
    ev = dec["graph_per_call"]["median"]
    for name, s in dec["wall"].items():
        rows.append(f"| {name}: wall per call | {fmt(s)} | {s['median'] / ev:.3f}x our kernel (graph) |")
    rows.append(f"| decode: our kernel per call, CUDA graph of calls | {fmt(dec['graph_per_call'])} | |")
    b1 = results.get("decode_b1", {})
    sdpa_b1 = next((v["median"] for n, v in b1.items() if n.startswith("SDPA")), float("nan"))
    for name, s in b1.items():
        rows.append(f"| {name}: wall per call | {fmt(s)} | {s['median'] / sdpa_b1:.2f}x SDPA |")
    rows.append(f"| decode: our calls per call by CUDA events (eager) | {fmt(dec['events_per_call'])} | |")
    fp = results["fresh_process"]
    rows.append(f"| import aotriton_rt (alone; heavy modules: {fp['import_heavy_modules']}) | "
                f"{fp['import_alone_ms']['median']:.2f} ms | |")
    for key in ("open_ms", "first_call_ms", "open_plus_first_ms", "second_call_ms", "added_mb"):
        unit = "MB" if key.endswith("mb") else "ms"
        rows.append(f"| fresh process ({fp['variants']} variants): {key[:-3]} | {fp[key]['median']:.2f} {unit} | |")
    for key in ("warmed_warmup_ms", "warmed_first_call_ms"):
        if key in fp:
            rows.append(f"| fresh process: {key[:-3].replace('_', ' ')} | {fp[key]['median']:.2f} ms | |")
    if "full_set" in results:
        fs = results["full_set"]
        for key in ("open_ms", "first_call_ms", "open_plus_first_ms", "added_mb"):
            unit = "MB" if key.endswith("mb") else "ms"
            rows.append(f"| full set ({fs['variants']} variants): {key[:-3]} | {fs[key]['median']:.2f} {unit} | |")
        rows.append(f"| full set: catalog bytes per variant | {fs['catalog_bytes_per_variant']:.0f} B | |")
        rows.append(f"| full set: shards read by open + first call | {fs['shards_read']} of {fs['shards']} | |")
    if "full_set_error" in results:
        rows.append(f"| full set: failed | {results['full_set_error'][-300:]} | |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=Path, help="gputest images for this GPU (sm90)")
    ap.add_argument("--full-images", type=Path, help="an image folder with the full set, for the catalog rows")
    ap.add_argument("--synth", type=int, default=43000,
                    help="without --full-images: synthesise a catalog of this many variants (0: skip)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--fresh", type=int, default=5, help="fresh processes for the first-call rows")
    ap.add_argument("--python-path", action="store_true", help="no GPU: time the operator's Python only")
    ap.add_argument("--json", type=Path, help="write the results here (also $OUT/host_cost.json when $OUT is set)")
    args = ap.parse_args()
    if args.python_path:
        results = python_path(args.calls, args.rounds)
        layout = results.pop("layout")
        print(f"operator Python path, CPU tensors, no-op kernels ({layout}); µs per call, median (min-max)")
        for name, s in results.items():
            print(f"  {name:32s} {fmt(s)}")
        results["layout"] = layout
    else:
        if args.images is None:
            ap.error("--images is required (or --python-path)")
        results = gpu(args)
        print(table(results))
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "host_cost.json").write_text(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
