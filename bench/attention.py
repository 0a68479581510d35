"""The attention operator's speed: TFLOP/s next to torch SDPA and the Triton JIT of the same source.

For every shape (B=4, H=32, D in {64, 128}, N in {1024, 4096, 16384}, causal or not, fp16 and
bf16) it times, forward and backward:

- ``ours``: ``aotriton_rt.attention`` / ``attention_backward`` (the AOT images, the runtime's
  dispatch, tuning config and backward scheme, Python overhead included);
- ``jit``: the same operator calls, but each kernel launched through the Triton JIT of
  ``builder/kernels/attention*.py`` with exactly the config of the AOT variant the runtime
  chose (``handle.variant(device).config``): same arguments, same constexprs, warps, stages;
- ``flash`` and ``cudnn``: ``torch.nn.functional.scaled_dot_product_attention`` under
  ``sdpa_kernel(FLASH_ATTENTION)`` / ``sdpa_kernel(CUDNN_ATTENTION)``.

Flops: forward 4·B·H·N²·D (halved when causal), backward 2.5× that. Times are per call of
back-to-back batches (see :func:`bench_ms`). Tensors hold (B, N, H, D)
memory seen as (B, H, N, D), which every contender reads in place. JIT kernels are compiled
up front in parallel worker processes (Triton's disk cache carries them here). Each shape times
all contenders in ``--rounds`` interleaved rounds and reports medians (see :func:`run`).

    python bench/attention.py                     # everything (~4-5 minutes on an H200)
    python bench/attention.py --quick             # fp16, D=128, N 1024 and 4096
    python bench/attention.py --rounds 5          # more interleaved rounds (medians of 5)
    python bench/attention.py --json out.json --no-jit --n 4096 --d 128 --dtype bf16
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import aotriton_rt  # noqa: E402
from aotriton_rt.arguments import compile_expr  # noqa: E402
from aotriton_rt.ops import attention as op  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "i8": torch.int8,
          "i32": torch.int32}
JIT_MODULES = {"attn_fwd": "builder.kernels.attention", "attn_bwd_preprocess": "builder.kernels.attention_bwd",
               "attn_bwd_dkdv": "builder.kernels.attention_bwd", "attn_bwd_dq": "builder.kernels.attention_bwd",
               "attn_bwd_dq_convert": "builder.kernels.attention_bwd"}


def jit_function(name: str) -> Any:
    import importlib

    return getattr(importlib.import_module(JIT_MODULES[name]), name)


# ------------------------------------------------------------------------------------------------
# The JIT twin of a Library: same dispatch, kernels launched through triton's JIT.
# ------------------------------------------------------------------------------------------------

class JitKernel:
    """A kernel handle with the AOT handle's argument list that launches the JIT of the same source
    with the AOT variant's config. With ``jobs`` set it records compile jobs instead of launching."""

    def __init__(self, aot: Any, device: int, jobs: list | None) -> None:
        self.arg_names = aot.arg_names
        variant = aot.variant(device)
        self.variant = variant
        self.fn = jit_function(variant.kernel)
        self.constexprs = {k: v for k, v in variant.params.items() if k in self.fn.arg_names}
        self.options = {"num_warps": variant.config.num_warps, "num_stages": variant.config.num_stages,
                        **variant.config.options}
        self.grid = compile_expr(f"({', '.join(variant.grid)},)", self.arg_names, variant.params,
                                 f"grid of {variant.kernel}", allow_tuple=True)
        self.pointers = {a.name: a.type[1:] for a in variant.args if a.is_pointer}
        self.jobs = jobs
        self.dummies: dict[str, Any] = {}

    def _dummy(self, dtype: str, device: Any) -> Any:
        # The JIT takes a real (unused) pointer where the AOT launch passes 0.
        if dtype not in self.dummies:
            self.dummies[dtype] = torch.empty(64, dtype=DTYPES[dtype], device=device)
        return self.dummies[dtype]

    def __call__(self, *args: Any, stream: Any = None) -> None:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        values = [self._dummy(self.pointers[n], device) if a is None else a for n, a in zip(self.arg_names, args)]
        if self.jobs is not None:
            mock = [v.dtype if isinstance(v, torch.Tensor) else v for v in values]
            self.jobs.append((self.variant.kernel, mock, self.constexprs, self.options))
            return
        grid = self.grid(*[0 if isinstance(v, torch.Tensor) else v for v in values])
        self.fn[grid](*values, **self.constexprs, **self.options)


class JitLibrary:
    """Everything of ``lib`` (variants, tuning, driver), but kernels come from :class:`JitKernel`."""

    def __init__(self, lib: Any, jobs: list | None = None) -> None:
        self._lib = lib
        self._jobs = jobs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def kernel(self, name: str, **params: Any) -> JitKernel:
        return JitKernel(self._lib.kernel(name, **params), torch.cuda.current_device(), self._jobs)


def _warmup(job: tuple) -> str | None:
    name, mock, constexprs, options = job
    try:
        jit_function(name).warmup(*mock, grid=(1,), **constexprs, **options)
        return None
    except Exception as exc:  # reported; that kernel is then compiled at its first launch
        return f"{name}: {type(exc).__name__}: {str(exc)[-300:]}"


def precompile(jobs: list, workers: int) -> None:
    unique = {json.dumps([j[0], [str(m) for m in j[1]], j[2], j[3]], sort_keys=True): j for j in jobs}
    if not unique:
        return
    print(f"compiling {len(unique)} JIT kernels with {workers} workers ...", flush=True)
    ctx = __import__("multiprocessing").get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        for error in pool.map(_warmup, unique.values()):
            if error:
                print("  warmup failed:", error)


# ------------------------------------------------------------------------------------------------
# Problems and timing.
# ------------------------------------------------------------------------------------------------

class Problem:
    def __init__(self, B: int, H: int, N: int, D: int, causal: bool, dtype: str) -> None:
        self.B, self.H, self.N, self.D, self.causal, self.dtype = B, H, N, D, causal, dtype
        gen = torch.Generator(device="cuda").manual_seed(0)

        def bshd() -> torch.Tensor:
            return torch.randn(B, N, H, D, device="cuda", dtype=DTYPES[dtype], generator=gen).transpose(1, 2)

        self.q, self.k, self.v, self.do = bshd(), bshd(), bshd(), bshd()

    @property
    def label(self) -> str:
        return f"{self.dtype} B{self.B} H{self.H} N{self.N} D{self.D} {'causal' if self.causal else 'full'}"

    @property
    def flops_fwd(self) -> float:
        f = 4.0 * self.B * self.H * self.N * self.N * self.D
        return f / 2 if self.causal else f


def bench_ms(fn: Any, budget_ms: float = 150.0, batches: int = 5) -> float:
    """Milliseconds per call of ``fn``: the median over ``batches`` batches of back-to-back calls,
    each batch between one pair of CUDA events (calls per batch: what fits budget_ms / batches,
    1 to 50).

    Back to back, the host enqueues the next call while the GPU runs the current one, so a
    contender's host-side cost (Python, argument checks, launch) counts only where it exceeds
    its kernel time, as in a training loop. Timing single calls between events would instead add
    every contender's host path to its kernel time (tens of microseconds on a 0.3 ms kernel).
    """
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end)
    calls = max(1, min(50, int(budget_ms / batches / max(first, 1e-3))))
    times = []
    for _ in range(batches):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None else flops / (ms * 1e-3) / 1e12


def sdpa_fns(p: Problem, backend: str) -> tuple[Any, Any, str | None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    q, k, v = (t.detach().requires_grad_() for t in (p.q, p.k, p.v))

    def fwd() -> Any:
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=p.causal)

    try:
        o = fwd()
    except RuntimeError as exc:
        return None, None, str(exc).splitlines()[0][:200]
    return fwd, lambda: torch.autograd.grad(o, (q, k, v), p.do, retain_graph=True), None


def run(p: Problem, lib: Any, jit: Any, deterministic: bool, rounds: int = 3) -> dict:
    """One shape: every contender timed in each of ``rounds`` interleaved rounds, medians kept.

    The H200 runs slower as it warms up (clocks fall under sustained load), so a contender timed
    first on a cool card reads up to ~15% faster than the same kernel a few seconds later.
    Interleaving the contenders and taking each one's median over the rounds gives every one the
    same mix of clock states, which is what makes the ratios comparable.
    """
    causal = {"causal": p.causal}
    fwd = op.attention_kernels(p.q, p.k, p.v, **causal, library=lib)["attn_fwd"]
    bwd = op.attention_kernels(p.q, p.k, p.v, **causal, backward=True, deterministic=deterministic, library=lib)
    row: dict[str, Any] = {"shape": p.label, "fwd_variant": {**fwd.variant(0).params,
                                                             "num_warps": fwd.variant(0).config.num_warps,
                                                             "config": fwd.variant(0).config.index},
                           "bwd_kernels": {n: h.variant(0).config.index for n, h in bwd.items()},
                           "bwd_mode": "atomic" if "attn_bwd_dq_convert" in bwd else "split"}
    out, lse = op.attention(p.q, p.k, p.v, **causal, library=lib)
    fns: dict[str, tuple[float, Any]] = {}  # key -> (flops, callable)
    for name, library in (("ours", lib), ("jit", jit)):
        if library is None:
            continue
        fns[f"{name}_fwd"] = (p.flops_fwd, lambda library=library: op.attention(p.q, p.k, p.v, **causal,
                                                                               library=library))
        fns[f"{name}_bwd"] = (2.5 * p.flops_fwd, lambda library=library: op.attention_backward(
            p.do, p.q, p.k, p.v, out, lse, **causal, deterministic=deterministic, library=library))
    for be in ("flash", "cudnn"):
        f, b, err = sdpa_fns(p, be)
        if err:
            row[f"{be}_error"] = err
            continue
        fns[f"{be}_fwd"] = (p.flops_fwd, f)
        fns[f"{be}_bwd"] = (2.5 * p.flops_fwd, b)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for key, (flops, fn) in fns.items():
            samples[key].append(tflops(flops, bench_ms(fn)))
    for key, values in samples.items():
        row[key] = sorted(values)[len(values) // 2]
        row[f"{key}_rounds"] = values
    for d in ("fwd", "bwd"):
        ours = row.get(f"ours_{d}")
        for other in ("flash", "cudnn", "jit"):
            if ours and row.get(f"{other}_{d}"):
                row[f"{d}_vs_{other}"] = ours / row[f"{other}_{d}"]
    return row


def print_table(rows: list[dict]) -> None:
    cols = ["ours_fwd", "jit_fwd", "flash_fwd", "cudnn_fwd", "ours_bwd", "jit_bwd", "flash_bwd", "cudnn_bwd"]
    ratios = ["fwd_vs_cudnn", "bwd_vs_cudnn", "fwd_vs_flash", "bwd_vs_flash", "fwd_vs_jit", "bwd_vs_jit"]
    head = f"{'shape':<34}" + "".join(f"{c:>10}" for c in cols) + "".join(f"{r:>13}" for r in ratios)
    print("\nTFLOP/s (CUDA-event medians) and ratios ours / other\n" + head + "\n" + "-" * len(head))
    for r in rows:
        cells = "".join(f"{r[c]:>10.0f}" if r.get(c) else f"{'-':>10}" for c in cols)
        cells += "".join(f"{r[c]:>13.2f}" if r.get(c) else f"{'-':>13}" for c in ratios)
        print(f"{r['shape']:<34}{cells}")
    print("ours: AOT images through the operator (bwd scheme: the dispatcher's, see bwd_mode in --json);"
          " jit: the same calls on the Triton JIT with the AOT variant's config.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fp16, D=128, N 1024 and 4096 only")
    ap.add_argument("--images", default=None, help="image folder (default: the default search)")
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--n", type=int, nargs="*", default=None)
    ap.add_argument("--d", type=int, nargs="*", default=None)
    ap.add_argument("--dtype", nargs="*", default=None, choices=["fp16", "bf16"])
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--deterministic", action="store_true", help="time the split (bit-reproducible) backward")
    ap.add_argument("--no-jit", action="store_true", help="skip the Triton JIT comparison")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved timing rounds per shape; each contender's median is reported")
    ap.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--json", default=None, help="write the results here (after every shape)")
    args = ap.parse_args()

    ns = args.n or ([1024, 4096] if args.quick else [1024, 4096, 16384])
    ds = args.d or ([128] if args.quick else [64, 128])
    dtypes = args.dtype or (["fp16"] if args.quick else ["fp16", "bf16"])
    lib = aotriton_rt.Library(args.images) if args.images else aotriton_rt.default_library()
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, images {lib.found.folders}")
    jit = None
    if not args.no_jit:
        import triton

        # Device-side tensor descriptors (the TMA configs) need Triton's global scratch allocator.
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        jobs: list = []
        recorder = JitLibrary(lib, jobs)
        for dt, d, c in itertools.product(dtypes, ds, args.causal):
            # The JIT specializes integers on divisibility by 16 and equality to 1, not on their
            # values: the real batch and heads with N=256 compile the kernels every N uses.
            p = Problem(args.b, args.h, 256, d, bool(c), dt)
            out, lse = op.attention(p.q, p.k, p.v, causal=p.causal, library=lib)
            op.attention(p.q, p.k, p.v, causal=p.causal, library=recorder)
            op.attention_backward(p.do, p.q, p.k, p.v, out, lse, causal=p.causal,
                                  deterministic=args.deterministic, library=recorder)
        precompile(jobs, args.workers)
        jit = JitLibrary(lib)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": []}
    for dt, d, n, c in itertools.product(dtypes, ds, ns, args.causal):
        p = Problem(args.b, args.h, n, d, bool(c), dt)
        row = run(p, lib, jit, args.deterministic, args.rounds)
        results["rows"].append(row)
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                          if k != "fwd_variant" and not k.endswith("_rounds")}), flush=True)
        del p
        torch.cuda.empty_cache()
        if args.json:  # after every shape: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1))
    print_table(results["rows"])


if __name__ == "__main__":
    main()
