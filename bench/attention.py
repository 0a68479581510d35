"""The attention operator's speed next to torch SDPA (cuDNN and FlashAttention-2) and the Triton JIT of
the same kernel source, all measured in one run, the contenders' order changing every round.

Contenders, per shape (TFLOP/s; forward 4·B·H·N²·D flops, halved when causal; backward 2.5× that;
forward+backward 3.5×):

- ``ours``: ``aotriton_rt.attention`` / ``attention_backward`` (the AOT images through the
  operator: its dispatch, tuning config and backward scheme, Python included): ``fwd``, ``bwd``,
  ``fwd+bwd``. The operator's forward always writes the logsumexp, so inference and training
  forwards are the same call. On sm90 at lengths that are multiples of 16 (every default shape)
  the backward's Gluon dK/dV is its aligned-length sibling ``attn_bwd_dkdv_sm90_a16`` where the
  images hold it (gputest, full): the JSON's ``bwd_kernels`` and ``explain`` say which ran.
- ``portable``: where an arch's own forward serves the call (``attn_fwd_sm90`` on sm90), the
  same forward call on the portable ``attn_fwd`` (a tuning override): ``fwd``.
- ``jit``: the same operator calls, each kernel launched through the Triton JIT of
  ``builder/kernels/`` with exactly the config of the AOT variant the runtime chose
  (:class:`JitLibrary`): ``fwd``, ``bwd``. The AOT image should be within 3% of it. (The JIT
  specialises every call on its values: for the aligned sibling's calls it knows what the sibling
  declares, the lengths and LSE strides divisible by 16, and more.)
- ``cudnn-inf``: ``scaled_dot_product_attention`` under ``sdpa_kernel(CUDNN_ATTENTION)`` with
  inputs that do not require grad (inference; cuDNN then skips saving softmax statistics): ``fwd``.
- ``cudnn-train``: the same with inputs that require grad: ``fwd`` (timed alone, statistics
  saved), ``bwd`` (``torch.autograd.grad`` of one forward's output, graph retained), ``fwd+bwd``.
- ``fa2-inf`` / ``fa2-train``: the same for ``sdpa_kernel(FLASH_ATTENTION)``, torch's
  FlashAttention-2 backend.
- ``mea-inf`` / ``mea-train``, else ``math-inf`` / ``math-train``: torch's memory-efficient
  backend (``EFFICIENT_ATTENTION``), else its math backend, the same way, timed only for a shape
  whose forward and backward neither cuDNN nor FlashAttention-2 serves (head dims above 256, e.g.
  ``d512``). The row's ``peers`` (printed with each shape and under the tables) names the SDPA
  backends that ran, ``errors`` why the others did not.
- ``base`` (with ``--baseline DIR``): the same operator calls on the images of ``DIR``, e.g. the
  kernels before a source change, built into their own folder: ``fwd``, ``bwd``; the ratios
  ``fwd/base`` and ``bwd/base`` say whether the change made them faster (> 1) or slower.

Timing (:mod:`builder.gputime`): every contender is warmed up and calibrated, then each of
``--rounds`` rounds runs all of them in a seeded shuffled order (``--order alternate``: forward,
then reversed), each for ~25 ms of back-to-back calls between per-call CUDA events; a round's
value is the median call, a contender's result the median over rounds with the rounds' min and
max. Tensors hold (B, N, H, D) memory seen as (B, H, N, D), read in place by every contender.

Default shapes (``--shapes``; the benchmark grid), each fp16 and bf16, causal and not
unless said: ``d128`` B4 H32 N4096 D128; ``d64`` B4 H32 N4096 D64; ``n1024`` B16 H32 N1024 D128;
``n16384`` B4 H32 N16384 D128 causal. Also asked for by name: ``d512`` B2 H16 N4096 D512 (needs
images with the 512 bucket: ``gputest`` or ``full`` on sm90). ``--n/--d/--b/--h`` give a grid of
their own instead.

    python bench/attention.py --images DIR --json out.json        # the benchmark grid, estimated 4-5 min
    python bench/attention.py --images DIR --shapes d128 --rounds 8
    python bench/attention.py --images DIR --shapes d512 --rounds 8 --no-jit
    python bench/attention.py --images DIR --n 4096 --d 128 --dtype bf16 --causal 1 --no-jit
    python bench/attention.py --images NEW --baseline OLD --n 1024 4096 16384 --d 64 128 --causal 1 --no-jit
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/NAME.py`: the checkout on the path (python -m bench.NAME needs none)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import aotriton_rt  # noqa: E402
from aotriton_rt.arguments import compile_expr  # noqa: E402
from aotriton_rt.ops import attention as op  # noqa: E402
from builder.gputime import ORDERS, time_rounds  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "i8": torch.int8,
          "i32": torch.int32}
#: name: (B, H, N, D, causal values); dtypes fp16 and bf16.
SHAPES = {"d128": (4, 32, 4096, 128, (0, 1)), "d64": (4, 32, 4096, 64, (0, 1)),
          "n1024": (16, 32, 1024, 128, (0, 1)), "n16384": (4, 32, 16384, 128, (1,)),
          "d512": (2, 16, 4096, 512, (0, 1))}
#: The shapes timed by default (the benchmark grid); the others run when named in ``--shapes``.
GRID = ("d128", "d64", "n1024", "n16384")
#: torch SDPA backends: (backend, contender name), the first two always timed, the rest in order,
#: the first one that serves a shape, only when neither of the first two does.
SDPA_PEERS = (("cudnn", "cudnn"), ("flash", "fa2"), ("efficient", "mea"), ("math", "math"))
#: contender -> (what it times, flops multiple of the forward).
CONTENDERS = {
    "ours fwd": 1.0, "ours bwd": 2.5, "ours fwd+bwd": 3.5, "portable fwd": 1.0, "jit fwd": 1.0, "jit bwd": 2.5,
    "cudnn-inf fwd": 1.0, "cudnn-train fwd": 1.0, "cudnn-train bwd": 2.5, "cudnn-train fwd+bwd": 3.5,
    "fa2-inf fwd": 1.0, "fa2-train fwd": 1.0, "fa2-train bwd": 2.5, "fa2-train fwd+bwd": 3.5,
    "mea-inf fwd": 1.0, "mea-train fwd": 1.0, "mea-train bwd": 2.5, "mea-train fwd+bwd": 3.5,
    "math-inf fwd": 1.0, "math-train fwd": 1.0, "math-train bwd": 2.5, "math-train fwd+bwd": 3.5,
    "base fwd": 1.0, "base bwd": 2.5,
}
#: ratio name -> (ours, other).
RATIOS = {
    "fwd/cudnn-inf": ("ours fwd", "cudnn-inf fwd"), "fwd/cudnn-train": ("ours fwd", "cudnn-train fwd"),
    "bwd/cudnn": ("ours bwd", "cudnn-train bwd"), "f+b/cudnn": ("ours fwd+bwd", "cudnn-train fwd+bwd"),
    "fwd/jit": ("ours fwd", "jit fwd"), "bwd/jit": ("ours bwd", "jit bwd"),
    "fwd/fa2": ("ours fwd", "fa2-inf fwd"), "bwd/fa2": ("ours bwd", "fa2-train bwd"),
    "fwd/mea": ("ours fwd", "mea-inf fwd"), "bwd/mea": ("ours bwd", "mea-train bwd"),
    "fwd/math": ("ours fwd", "math-inf fwd"), "bwd/math": ("ours bwd", "math-train bwd"),
    "fwd/portable": ("ours fwd", "portable fwd"),
    "fwd/base": ("ours fwd", "base fwd"), "bwd/base": ("ours bwd", "base bwd"),
}


@functools.cache
def jit_function(name: str) -> Any:
    """The ``@triton.jit`` function the builder compiles for catalog kernel ``name``."""
    from builder.registry import load_kernels

    return load_kernels()[name].fn


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
# Problems and contenders.
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


def sdpa_contenders(p: Problem, backend: str, name: str) -> tuple[dict[str, Any], str | None]:
    """``{name}-inf fwd``, ``{name}-train fwd/bwd/fwd+bwd`` for one SDPA backend; or the error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qg, kg, vg = (t.detach().requires_grad_() for t in (p.q, p.k, p.v))

    def inf() -> Any:
        with sdpa_kernel(be):
            return sdpa(p.q, p.k, p.v, is_causal=p.causal)

    def train() -> Any:
        with sdpa_kernel(be):
            return sdpa(qg, kg, vg, is_causal=p.causal)

    try:
        with torch.no_grad():
            inf()
        o = train()
    except RuntimeError as exc:
        return {}, str(exc).splitlines()[0][:200]

    def bwd() -> Any:
        return torch.autograd.grad(o, (qg, kg, vg), p.do, retain_graph=True)

    def both() -> Any:
        return torch.autograd.grad(train(), (qg, kg, vg), p.do)

    forward = {f"{name}-inf fwd": inf, f"{name}-train fwd": train}
    try:  # a backend may serve a shape's forward but not its backward
        bwd()
    except RuntimeError as exc:
        return forward, "backward: " + str(exc).splitlines()[0][:200]
    return {**forward, f"{name}-train bwd": bwd, f"{name}-train fwd+bwd": both}, None


def operator_contenders(p: Problem, library: Any, name: str, deterministic: bool) -> dict[str, Any]:
    causal = {"causal": p.causal}
    out, lse = op.attention(p.q, p.k, p.v, **causal, library=library)

    def fwd() -> Any:
        return op.attention(p.q, p.k, p.v, **causal, library=library)

    def bwd() -> Any:
        return op.attention_backward(p.do, p.q, p.k, p.v, out, lse, **causal, deterministic=deterministic,
                                     library=library)

    def both() -> Any:
        o, s = op.attention(p.q, p.k, p.v, **causal, library=library)
        return op.attention_backward(p.do, p.q, p.k, p.v, o, s, **causal, deterministic=deterministic,
                                     library=library)

    fns = {f"{name} fwd": fwd, f"{name} bwd": bwd}
    if name == "ours":
        fns[f"{name} fwd+bwd"] = both
    return fns


def tflops(flops: float, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def run(p: Problem, lib: Any, jit: Any, args: argparse.Namespace, base: Any = None) -> dict:
    """One shape: every contender in ``args.rounds`` rounds of changing order (see the module docs);
    ``base``: the ``--baseline`` library, or None."""
    causal = {"causal": p.causal}
    try:  # which variants and configs run, and whether a tuning rule chose them
        explained = [str(op.explain(dtype=p.dtype, head_dim=p.D, seqlen_q=p.N, causal=p.causal, backward=b,
                                    deterministic=args.deterministic, library=lib)) for b in (False, True)]
    except Exception as exc:  # noqa: BLE001 - the timings do not depend on it
        explained = [f"explain failed: {type(exc).__name__}: {str(exc)[:300]}"]
    bwd = op.attention_kernels(p.q, p.k, p.v, **causal, backward=True, deterministic=args.deterministic, library=lib)
    row: dict[str, Any] = {"shape": p.label, "B": p.B, "H": p.H, "N": p.N, "D": p.D, "causal": p.causal,
                           "dtype": p.dtype, "explain": explained,
                           "bwd_mode": "atomic" if "attn_bwd_dq_convert" in bwd else "split",
                           "bwd_kernels": {role: h.name for role, h in bwd.items()}, "errors": {}}
    fns: dict[str, Any] = {}
    fns.update(operator_contenders(p, lib, "ours", args.deterministic))
    forward = op.attention_kernels(p.q, p.k, p.v, **causal, library=lib)["attn_fwd"].name
    row["fwd_kernel"] = forward
    if forward != "attn_fwd":  # an arch's own forward serves the call: time the portable one too
        from builder.tune import forced_forward

        portable = forced_forward(lib, "attn_fwd")
        fns["portable fwd"] = operator_contenders(p, portable, "portable", args.deterministic)["portable fwd"]
    if jit is not None:
        try:
            fns.update(operator_contenders(p, jit, "jit", args.deterministic))
        except Exception as exc:  # noqa: BLE001 - e.g. a kernel the JIT cannot launch; the others still run
            row["errors"]["jit"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    if base is not None:
        try:
            fns.update(operator_contenders(p, base, "base", args.deterministic))
        except Exception as exc:  # noqa: BLE001 - e.g. the baseline lacks a kernel; the others still run
            row["errors"]["base"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row["peers"], whole = [], False
    for i, (backend, name) in enumerate(SDPA_PEERS):
        if i >= 2 and whole:
            break  # fallbacks only until one backend serves the shape's forward and backward
        got, err = sdpa_contenders(p, backend, name)
        if err:
            row["errors"][name] = err
        if got:
            row["peers"].append(backend + (" (forward only)" if err else ""))
            whole = whole or not err
        fns.update(got)
    fns = {k: f for k, f in fns.items() if k not in args.skip}
    stats = time_rounds(fns, rounds=args.rounds, seed=args.seed, order=args.order, flush_l2=args.flush_l2,
                        log=lambda m: row["errors"].setdefault("timing", []).append(m))
    row["contenders"] = {}
    for name, s in stats.items():
        flops = CONTENDERS[name] * p.flops_fwd
        row["contenders"][name] = {**s.to_json(), "tflops": tflops(flops, s.median),
                                   "tflops_min": tflops(flops, s.high), "tflops_max": tflops(flops, s.low)}
    row["ratios"] = ratios({name: s.median for name, s in stats.items()})
    return row


def ratios(median_ms: dict[str, float]) -> dict[str, float]:
    """Speed ratios ours / other (> 1: ours is faster) from median milliseconds per call; the two
    sides of each ratio do the same work, so it is their inverse time ratio."""
    return {name: median_ms[other] / median_ms[ours] for name, (ours, other) in RATIOS.items()
            if ours in median_ms and other in median_ms}


def print_tables(rows: list[dict]) -> None:
    """TFLOP/s medians with their spread, then the ratios, one line per shape."""
    names = [c for c in CONTENDERS if any(c in r["contenders"] for r in rows)]
    short = {c: c.replace("cudnn-", "cud-").replace("-train", "-tr").replace("fwd+bwd", "f+b") for c in names}
    width = max(12, *(len(s) + 1 for s in short.values()))
    head = f"{'shape':<32}" + "".join(f"{short[c]:>{width}}" for c in names)
    print("\nTFLOP/s: median over rounds (spread: (max - min) / median, in %)\n" + head + "\n" + "-" * len(head))
    for r in rows:
        cells = []
        for c in names:
            s = r["contenders"].get(c)
            spread = 0.0 if not s else (s["max_ms"] - s["min_ms"]) / s["median_ms"] * 100
            text = f"{s['tflops']:.0f} ({spread:.1f})" if s else "-"
            cells.append(f"{text:>{width}}")
        print(f"{r['shape']:<32}" + "".join(cells))
    shown = [k for k in RATIOS if any(k in r["ratios"] for r in rows)] or list(RATIOS)
    head = f"{'shape':<32}" + "".join(f"{k:>16}" for k in shown)
    print("\nSpeed ratios, ours / other (> 1: ours is faster)\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['shape']:<32}" + "".join(f"{r['ratios'][k]:>16.2f}" if k in r["ratios"] else f"{'-':>16}"
                                             for k in shown))
    print("ours: AOT images through the operator; jit: the same calls on the Triton JIT with the AOT variant's "
          "config; cud-inf / fa2-inf: inputs without grad; -tr: inputs with grad (fwd alone, bwd alone, f+b); "
          "fa2: torch SDPA's FlashAttention-2 backend; mea / math: its memory-efficient / math backend (where "
          "neither cuDNN nor FlashAttention-2 serves); base: the operator on the --baseline images.")
    for r in rows:
        if "peers" in r:
            print(f"SDPA peers of {r['shape']}: {', '.join(r['peers']) or 'none'}")


def problems(args: argparse.Namespace) -> list[tuple[int, int, int, int, bool, str]]:
    """(B, H, N, D, causal, dtype) of every shape asked for, in order."""
    dtypes = args.dtype or ["fp16", "bf16"]
    if args.n or args.d:
        causals = args.causal if args.causal is not None else [0, 1]
        return [(args.b, args.h, n, d, bool(c), dt) for dt, d, n, c in
                itertools.product(dtypes, args.d or [128], args.n or [4096], causals)]
    out = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            sys.exit(f"--shapes: unknown {name!r}; choose from {', '.join(SHAPES)}")
        b, h, n, d, causals = SHAPES[name]
        causals = [c for c in causals if args.causal is None or c in args.causal]
        out += [(b, h, n, d, bool(c), dt) for dt in dtypes for c in causals]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", default=None, help="image folder (default: the default search)")
    ap.add_argument("--baseline", default=None, help="a second image folder timed as 'base' in the same rounds "
                    "(e.g. the kernels before a change; ratios fwd/base, bwd/base)")
    ap.add_argument("--shapes", default=",".join(GRID), help=f"comma list of {', '.join(SHAPES)} (default: "
                    f"{', '.join(GRID)})")
    ap.add_argument("--n", type=int, nargs="*", default=None, help="own grid: sequence lengths (replaces --shapes)")
    ap.add_argument("--d", type=int, nargs="*", default=None, help="own grid: head dims (replaces --shapes)")
    ap.add_argument("--b", type=int, default=4, help="own grid: batch")
    ap.add_argument("--h", type=int, default=32, help="own grid: heads")
    ap.add_argument("--dtype", nargs="*", default=None, choices=["fp16", "bf16"])
    ap.add_argument("--causal", type=int, nargs="*", default=None, help="0 and/or 1 (default: the shape's)")
    ap.add_argument("--deterministic", action="store_true", help="time the split (bit-reproducible) backward")
    ap.add_argument("--no-jit", action="store_true", help="skip the Triton JIT contenders")
    ap.add_argument("--skip", default="", help="comma list of contenders to leave out, e.g. 'fa2-train fwd+bwd'")
    ap.add_argument("--rounds", type=int, default=8, help="timing rounds per shape (medians over them)")
    ap.add_argument("--order", default="shuffle", choices=ORDERS, help="the contenders' order, per round")
    ap.add_argument("--seed", type=int, default=0, help="seeds the shuffled order")
    ap.add_argument("--flush-l2", action="store_true", help="zero a 2x-L2 buffer before every timed call")
    ap.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--json", default=None, help="write the results here after every shape (also "
                    "$OUT/bench-attention.json when $OUT is set)")
    args = ap.parse_args()
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    shapes = problems(args)
    lib = aotriton_rt.Library(args.images) if args.images else aotriton_rt.default_library()
    base = aotriton_rt.Library(args.baseline) if args.baseline else None
    import triton

    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
          f"images {lib.found.folders}, {len(shapes)} shapes, {args.rounds} rounds, order {args.order} "
          f"(seed {args.seed})" + (f", baseline {base.found.folders}" if base else ""), flush=True)
    jit = None
    if not args.no_jit:
        # Device-side tensor descriptors (the TMA configs) need Triton's global scratch allocator.
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        jobs: list = []
        recorder = JitLibrary(lib, jobs)
        for b, h, d, c, dt in sorted({(b, h, d, c, dt) for b, h, _, d, c, dt in shapes}):
            # The JIT specializes integers on divisibility by 16 and equality to 1, not on their
            # values: the real batch and heads with N=256 compile the kernels every N uses.
            p = Problem(b, h, 256, d, c, dt)
            try:
                out, lse = op.attention(p.q, p.k, p.v, causal=p.causal, library=lib)
                op.attention(p.q, p.k, p.v, causal=p.causal, library=recorder)
                op.attention_backward(p.do, p.q, p.k, p.v, out, lse, causal=p.causal,
                                      deterministic=args.deterministic, library=recorder)
            except Exception as exc:  # noqa: BLE001 - reported again, per shape, when timed
                print(f"  JIT compile jobs of {p.label}: {type(exc).__name__}: {str(exc)[:200]}")
        precompile(jobs, args.workers)
        jit = JitLibrary(lib)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                               "triton": triton.__version__, "rounds": args.rounds, "order": args.order,
                               "seed": args.seed, "flush_l2": args.flush_l2, "images": [str(f) for f in
                                                                                        lib.found.folders],
                               "baseline": [str(f) for f in base.found.folders] if base else None,
                               "rows": []}
    outputs = [Path(args.json)] if args.json else []
    if os.environ.get("OUT"):
        outputs.append(Path(os.environ["OUT"], "bench-attention.json"))
    for shape in shapes:
        p = Problem(*shape)
        row = run(p, lib, jit, args, base)
        results["rows"].append(row)
        print(f"{row['shape']} (SDPA peers: {', '.join(row['peers']) or 'none'}): "
              + ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items())
              + (f"  errors: {row['errors']}" if row["errors"] else ""), flush=True)
        del p
        torch.cuda.empty_cache()
        for path in outputs:  # after every shape: a run cut short keeps what it measured
            path.write_text(json.dumps(results, indent=1))
    print_tables(results["rows"])


if __name__ == "__main__":
    main()
