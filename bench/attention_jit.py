"""Benchmark and tune the attention kernels on a GPU through the Triton JIT.

Runs ``builder/kernels/attention*.py`` with ``kernel[grid](...)`` on the issue's shapes, checks
them against torch SDPA once, and prints TFLOP/s for forward and backward next to torch's
FLASH_ATTENTION and CUDNN_ATTENTION backends. Flops: forward 4·B·H·N²·D (halved when causal),
backward 2.5× forward. Times are ``triton.testing.do_bench`` medians.

    python bench/attention_jit.py                      # issue shapes, registry default configs
    python bench/attention_jit.py --configs            # sweep block/warp/stage/TMA/WS configs (D=128)
    python bench/attention_jit.py --configs --kernels fwd --causal 0   # one slice of the sweep
    python bench/attention_jit.py --aot                # also time the registry's AOT binaries
    python bench/attention_jit.py --n 4096 --d 128 --causal 0 --dtype fp16 --json out.json

``--configs`` precompiles every candidate in parallel worker processes (Triton's disk cache
carries the binaries to this process), then times each kernel alone: the forward, and the two
backward kernels separately (dk/dv and dq are independent), and prints the winners per shape as
config-table entries. ``--aot`` compiles the variants exactly as the builder does (registry
signature, divisibility, options; no JIT value specialization) and launches the binaries, to
compare the AOT image with the JIT of the same source.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from builder.kernels.attention import attn_fwd, fwd_configs  # noqa: E402
from builder.kernels.attention_bwd import (  # noqa: E402
    attn_bwd_dkdv,
    attn_bwd_dq,
    attn_bwd_dq_convert,
    attn_bwd_preprocess,
    dkdv_configs,
    dq_configs,
    preprocess_configs,
)
from builder.targets import KNOWN  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DEVICE = "cuda"  # the smoke test in tests/builder runs the argument lists on "cpu" under the interpreter
# "prea"/"dkdva" are the preprocess and dk/dv kernels with DQ_ATOMIC=1; "conv" casts the fp32 dQ.
KERNELS = {"fwd": attn_fwd, "pre": attn_bwd_preprocess, "dkdv": attn_bwd_dkdv, "dq": attn_bwd_dq,
           "prea": attn_bwd_preprocess, "dkdva": attn_bwd_dkdv, "conv": attn_bwd_dq_convert}
REGISTRY_NAME = {"fwd": "attn_fwd", "pre": "attn_bwd_preprocess", "dkdv": "attn_bwd_dkdv",
                 "dq": "attn_bwd_dq", "prea": "attn_bwd_preprocess", "dkdva": "attn_bwd_dkdv",
                 "conv": "attn_bwd_dq_convert"}
CONFIG_TABLE = {"fwd": fwd_configs, "pre": preprocess_configs, "dkdv": dkdv_configs, "dq": dq_configs,
                "prea": preprocess_configs, "dkdva": dkdv_configs, "conv": preprocess_configs}
# Backward launch sequences: the deterministic split, and FA2-style atomic dQ.
BWD = {"split": ("pre", "dkdv", "dq"), "atomic": ("prea", "dkdva", "conv")}


# ------------------------------------------------------------------------------------------------
# Problems and kernel arguments
# ------------------------------------------------------------------------------------------------

class Problem:
    """One attention problem in BSHD memory layout (what models hold), seen as BHSD through strides."""

    def __init__(self, B: int, H: int, N: int, D: int, causal: int, dtype: str,
                 materialize: bool = True) -> None:
        self.B, self.H, self.N, self.D, self.causal, self.dtype = B, H, N, D, causal, dtype
        self.tdtype = DTYPES[dtype]
        # BSHD strides, in elements.
        self.sz, self.sh, self.sm = N * H * D, D, H * D
        self.lz, self.lh = H * N, N
        if not materialize:
            return
        dev = DEVICE
        gen = torch.Generator(device=dev).manual_seed(0)

        def bshd() -> torch.Tensor:
            return torch.randn(B, N, H, D, device=dev, dtype=self.tdtype, generator=gen).transpose(1, 2)

        self.q, self.k, self.v, self.do = bshd(), bshd(), bshd(), bshd()
        self.o, self.dq, self.dk, self.dv = (torch.empty_like(self.q) for _ in range(4))
        # fp32 dQ accumulator with q's strides.
        self.dqa = torch.empty(B, N, H, D, device=dev, dtype=torch.float32).transpose(1, 2)
        self.lse = torch.empty(B, H, N, device=dev, dtype=torch.float32)
        self.delta = torch.empty_like(self.lse)
        self.dummy = torch.empty(8, device=dev, dtype=self.tdtype)
        self.dummy8 = torch.empty(16, device=dev, dtype=torch.int8)
        self.dummy32 = torch.empty(4, device=dev, dtype=torch.int32)

    @property
    def flops_fwd(self) -> float:
        f = 4.0 * self.B * self.H * self.N * self.N * self.D
        return f / 2 if self.causal else f

    @property
    def label(self) -> str:
        c = {0: "full", 1: "causal-tl", 2: "causal"}[self.causal]
        return f"{self.dtype} B{self.B} H{self.H} N{self.N} D{self.D} {c}"

    def spec(self, kernel: str) -> dict:
        atomic = int(kernel in ("prea", "dkdva"))
        if kernel in ("pre", "prea"):
            return {"dtype": self.dtype, "HEAD_DIM": self.D, "HEAD_DIM_V": self.D, "VARLEN": 0, "DQ_ATOMIC": atomic}
        if kernel == "conv":
            return {"dtype": self.dtype, "HEAD_DIM": self.D, "VARLEN": 0}
        s = {"dtype": self.dtype, "HEAD_DIM": self.D, "HEAD_DIM_V": self.D, "CAUSAL": self.causal,
             "BIAS": 0, "DROPOUT": 0, "VARLEN": 0}
        if kernel in ("dkdv", "dkdva"):
            s["DQ_ATOMIC"] = atomic
        return s

    def args(self, kernel: str, mock: bool = False) -> list:
        """Positional arguments (without constexprs); ``mock`` puts dtypes where tensors go, which
        is what ``JITFunction.warmup`` takes to compile without memory."""
        def t(name: str):
            if mock:
                return {"lse": torch.float32, "delta": torch.float32, "dqa": torch.float32, "dummy8": torch.int8,
                        "dummy32": torch.int32}.get(name, self.tdtype)
            return getattr(self, name)
        strides = (self.sz, self.sh, self.sm)
        none = (0, 0, 0)
        atomic = kernel in ("prea", "dkdva")
        dqa, dqa_strides = ("dqa", strides) if atomic else ("dummy", none)
        sizes = (self.B, self.H, self.H, self.N, self.N)
        scal = (1.0 / math.sqrt(self.D), 0.0, 0, 0, -1, 0 if self.causal else -1)
        if kernel == "fwd":
            return [t("q"), t("k"), t("v"), t("dummy"), t("o"), t("lse"), t("dummy8"), t("dummy32"),
                    t("dummy32"), *strides * 4, *none, self.lz, self.lh, *none, *sizes, *scal]
        if kernel in ("pre", "prea"):
            return [t("o"), t("do"), t("delta"), t(dqa), t("dummy32"), *strides * 2, *dqa_strides,
                    self.lz, self.lh, self.B, self.H, self.N]
        if kernel in ("dkdv", "dkdva"):
            return [t("q"), t("k"), t("v"), t("dummy"), t("do"), t("dk"), t("dv"), t("dummy"), t(dqa), t("lse"),
                    t("delta"), t("dummy32"), t("dummy32"), *strides * 3, *none, *strides * 3, *none,
                    *dqa_strides, self.lz, self.lh, *sizes, *scal]
        if kernel == "conv":
            return [t("dqa"), t("dq"), t("dummy32"), *strides * 2, self.B, self.H, self.N]
        return [t("q"), t("k"), t("v"), t("dummy"), t("do"), t("dq"), t("lse"), t("delta"), t("dummy32"),
                t("dummy32"), *strides * 3, *none, *strides * 2, self.lz, self.lh, *sizes, *scal]

    def grid(self, kernel: str, cfg: dict) -> tuple[int, int, int]:
        if kernel in ("dkdv", "dkdva"):
            return (triton.cdiv(self.N, cfg["BLOCK_N"]), self.B * self.H, 1)
        return (triton.cdiv(self.N, cfg["BLOCK_M"]), self.B * self.H, 1)

    def flags(self, kernel: str) -> dict:
        """The spec's constexprs (everything but dtype, which the tensors carry)."""
        return {k: v for k, v in self.spec(kernel).items() if k != "dtype"}


def registry_config(p: Problem, kernel: str, arch: str, index: int = 0) -> dict:
    """The registry's config #index for this problem on ``arch``, flattened to a dict."""
    configs = CONFIG_TABLE[kernel](p.spec(kernel), KNOWN[arch])
    c = configs[min(index, len(configs) - 1)]
    return {**c.constexprs, "num_warps": c.num_warps, "num_stages": c.num_stages, **c.options}


def launch(p: Problem, kernel: str, cfg: dict) -> None:
    KERNELS[kernel][p.grid(kernel, cfg)](*p.args(kernel), **p.flags(kernel), **cfg)


def warmup(job: tuple) -> str | None:
    """Worker: compile one (problem, kernel, config) through the JIT into the disk cache."""
    shape, kernel, cfg = job
    p = Problem(*shape, materialize=False)
    try:
        KERNELS[kernel].warmup(*p.args(kernel, mock=True), grid=(1,), **p.flags(kernel), **cfg)
        return None
    except Exception as exc:  # reported, the config is skipped
        return f"{type(exc).__name__}: {str(exc)[-300:]}"


def precompile(jobs: list[tuple], workers: int) -> dict:
    """Compile in parallel; returns {job index: error} for the ones that failed."""
    if not jobs:
        return {}
    ctx = __import__("multiprocessing").get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        errors = list(pool.map(warmup, jobs))
    return {i: e for i, e in enumerate(errors) if e}


# ------------------------------------------------------------------------------------------------
# AOT: compile exactly as the builder does, launch the binary.
# ------------------------------------------------------------------------------------------------

def aot_launcher(p: Problem, kernel: str, arch: str, index: int = 0):
    from triton.compiler import ASTSource

    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    decl = load_kernels()[REGISTRY_NAME[kernel]]
    want = p.spec(kernel)
    jobs = [j for j in expand(decl, parse_targets(arch), "full", triton.__version__)
            if j.spec == want and j.config_index == index]
    if not jobs:
        return None
    job = jobs[0]
    names = list(job.signature)
    attrs = {(names.index(n),): [["tt.divisibility", d]] for n, d in job.divisibility.items()}
    src = ASTSource(fn=decl.fn, signature=dict(job.signature), constexprs=dict(job.constexprs), attrs=attrs)
    compiled = triton.compile(src, target=job.target.gpu_target(), options=job.options())
    cfg = {**job.config.constexprs}
    grid = p.grid(kernel, cfg)
    # The launcher takes every argument in order, constexprs included (it skips them).
    values = p.args(kernel) + [job.constexprs[n] for n in names if job.signature[n] == "constexpr"]
    runner = compiled[grid]
    return lambda: runner(*values)


# ------------------------------------------------------------------------------------------------
# Torch references
# ------------------------------------------------------------------------------------------------

def sdpa_fns(p: Problem, backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    q, k, v = (t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v))
    causal = bool(p.causal)

    def fwd():
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    try:
        o = fwd()
    except RuntimeError as exc:
        return None, None, str(exc).splitlines()[0]
    do = p.do

    def bwd():
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    return fwd, bwd, None


def check(p: Problem, cfgs: dict) -> str:
    """Ours (both backward modes) vs fp32 math SDPA (causal alignments agree: N_q == N_k)."""
    q, k, v = (t.detach().float().requires_grad_() for t in (p.q, p.k, p.v))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(p.causal))
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), p.do.float())
    s = q @ k.transpose(-1, -2) / math.sqrt(p.D)
    if p.causal:
        s = s.masked_fill(torch.ones(p.N, p.N, device=s.device, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    tol = 2e-2 if p.dtype == "fp16" else 6e-2
    lines, ok = [], True
    for mode, seq in BWD.items():
        for t in (p.o, p.dq, p.dk, p.dv):
            t.fill_(float("nan"))
        launch(p, "fwd", cfgs["fwd"])
        for kernel in seq:
            launch(p, kernel, cfgs[kernel])
        torch.cuda.synchronize()
        errs = []
        for name, got, ref in (("out", p.o, o), ("lse", p.lse, lse), ("dq", p.dq, dq), ("dk", p.dk, dk),
                               ("dv", p.dv, dv)):
            err = (got.float() - ref).abs().max().item() / max(1.0, ref.abs().max().item())
            ok &= err <= tol  # NaN fails too
            errs.append(f"{name} {err:.1e}")
        lines.append(f"{mode}: " + ", ".join(errs))
    return ("PASS " if ok else "FAIL ") + "; ".join(lines) + f" (tol {tol})"


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------

def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None else flops / (ms * 1e-3) / 1e12


def sweep_candidates(kernel: str, p: Problem, arch: str) -> list[dict]:
    """Configs to rank: block sizes x warps x stages, and on sm90 the TMA / warp-specialized paths."""
    out = []
    if kernel == "fwd":
        for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
            if bm * bn * p.D > 128 * 128 * 128 and s > 2 or (w == 8 and bm == 64):
                continue
            for tma in ((0, 1) if arch == "sm90" else (0,)):
                out.append({"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma, "WARP_SPEC": 0,
                            "num_warps": w, "num_stages": s})
        if arch == "sm90" and p.D <= 128:
            for bn, s in itertools.product((64, 128), (2, 3)):
                out.append({"BLOCK_M": 128, "BLOCK_N": bn, "USE_TMA": 1, "WARP_SPEC": 1,
                            "num_warps": 4, "num_stages": s})
    elif kernel in ("dkdv", "dkdva"):
        for bm, bn, w, s in itertools.product((32, 64, 128), (64, 128), (4, 8), (1, 2, 3)):
            out.append({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s})
    elif kernel == "dq":
        for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
            out.append({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s})
    return out


def run_sweep(problems: list[Problem], arch: str, workers: int, top: int, kernels: tuple[str, ...]) -> dict:
    results = {}
    for p in problems:
        jobs = [((p.B, p.H, p.N, p.D, p.causal, p.dtype), k, c)
                for k in kernels for c in sweep_candidates(k, p, arch)]
        errors = precompile(jobs, workers)
        print(f"\n== sweep {p.label}: {len(jobs)} configs, {len(errors)} failed to compile", flush=True)
        per_kernel: dict[str, list] = {k: [] for k in kernels}
        for i, (_, kernel, cfg) in enumerate(jobs):
            if i in errors:
                continue
            try:
                ms = bench_ms(lambda p=p, kernel=kernel, cfg=cfg: launch(p, kernel, cfg))
            except Exception as exc:  # out of resources etc.
                print(f"   skip {kernel} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            per_kernel[kernel].append((ms, cfg))
        # The small kernels keep their registry config.
        small = {k: registry_config(p, k, arch) for k in ("pre", "prea", "conv")}
        small_ms = {k: bench_ms(lambda p=p, k=k, c=c: launch(p, k, c)) for k, c in small.items()}
        pre_ms = small_ms["pre"]
        best = {}
        for kernel, rows in per_kernel.items():
            rows.sort(key=lambda r: r[0])
            print(f"-- {kernel}: best {top} of {len(rows)}")
            for ms, cfg in rows[:top]:
                print(f"   {ms:8.3f} ms  {cfg}")
            if rows:
                best[kernel] = rows[0]
        if "fwd" in best:
            print(f"   fwd best: {tflops(p.flops_fwd, best['fwd'][0]):.0f} TFLOP/s")
        if "dkdv" in best and "dq" in best:
            total = pre_ms + best["dkdv"][0] + best["dq"][0]
            print(f"   bwd best: {tflops(2.5 * p.flops_fwd, total):.0f} TFLOP/s "
                  f"(pre {pre_ms:.3f} + dkdv {best['dkdv'][0]:.3f} + dq {best['dq'][0]:.3f} ms)")
        if "dkdva" in best:
            total = small_ms["prea"] + best["dkdva"][0] + small_ms["conv"]
            print(f"   bwd best, atomic dQ: {tflops(2.5 * p.flops_fwd, total):.0f} TFLOP/s "
                  f"(pre {small_ms['prea']:.3f} + dkdv {best['dkdva'][0]:.3f} + convert {small_ms['conv']:.3f} ms)")
        results[p.label] = {k: {"ms": v[0], "config": v[1]} for k, v in best.items()}
        results[p.label].update({f"{k}_ms": v for k, v in small_ms.items()})
    return results


def run_table(problems: list[Problem], arch: str, aot: bool, index: int) -> list[dict]:
    rows = []
    for p in problems:
        cfgs = {k: registry_config(p, k, arch, index if k == "fwd" else 0) for k in KERNELS}
        row = {"shape": p.label, "fwd_config": cfgs["fwd"]}
        try:
            row["ours_fwd"] = tflops(p.flops_fwd, bench_ms(lambda p=p, cfgs=cfgs: launch(p, "fwd", cfgs["fwd"])))
            for mode, seq in BWD.items():
                ms = bench_ms(lambda p=p, cfgs=cfgs, seq=seq: [launch(p, k, cfgs[k]) for k in seq])
                row["ours_bwd" if mode == "split" else "ours_bwd_atomic"] = tflops(2.5 * p.flops_fwd, ms)
        except Exception as exc:
            print(f"{p.label}: ours failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        if aot:
            fns = {k: aot_launcher(p, k, arch, index if k == "fwd" else 0) for k in ("fwd", *BWD["split"])}
            if all(fns.values()):
                row["aot_fwd"] = tflops(p.flops_fwd, bench_ms(fns["fwd"]))
                row["aot_bwd"] = tflops(2.5 * p.flops_fwd,
                                        bench_ms(lambda fns=fns: [fns[k]() for k in BWD["split"]]))
        for be in ("flash", "cudnn"):
            fwd, bwd, err = sdpa_fns(p, be)
            if err:
                row[f"{be}_error"] = err
                continue
            row[f"{be}_fwd"] = tflops(p.flops_fwd, bench_ms(fwd))
            row[f"{be}_bwd"] = tflops(2.5 * p.flops_fwd, bench_ms(bwd))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def print_table(rows: list[dict], aot: bool) -> None:
    cols = ["ours_fwd"] + (["aot_fwd"] if aot else []) + ["flash_fwd", "cudnn_fwd", "ours_bwd", "ours_bwd_atomic"] \
        + (["aot_bwd"] if aot else []) + ["flash_bwd", "cudnn_bwd"]
    head = f"{'shape':<36}" + "".join(f"{c:>11}" for c in cols) + f"{'fwd/cudnn':>11}{'bwd/cudnn':>11}"
    print("\nTFLOP/s (do_bench median)\n" + head + "\n" + "-" * len(head))
    for r in rows:
        cells = "".join(f"{r[c]:>11.0f}" if r.get(c) is not None else f"{'-':>11}" for c in cols)
        best_bwd = max(r.get("ours_bwd") or 0, r.get("ours_bwd_atomic") or 0)
        ratio = "".join(f"{ours / r['cudnn_' + d]:>11.2f}" if r.get("cudnn_" + d) else f"{'-':>11}"
                        for d, ours in (("fwd", r["ours_fwd"]), ("bwd", best_bwd)))
        print(f"{r['shape']:<36}{cells}{ratio}")
    print("ours_bwd: deterministic split (preprocess, dk/dv, dq); ours_bwd_atomic: dQ by fp32 atomics in dk/dv.\n"
          "bwd/cudnn uses the faster of the two. Floor (issue #4): fwd >= 0.85x cuDNN, bwd >= 0.60x cuDNN at "
          "D=128, N >= 4096; AOT within 3% of JIT.")


def device_arch() -> str:
    props = torch.cuda.get_device_properties(0)
    if torch.version.hip:
        return props.gcnArchName.split(":")[0]
    return f"sm{props.major}{props.minor}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", action="store_true", help="sweep configs per shape (tuning mode)")
    ap.add_argument("--aot", action="store_true", help="also time the registry's AOT-compiled binaries")
    ap.add_argument("--fwd-config", type=int, default=0,
                    help="registry forward config index to time (sm90: 0 plain, 1 TMA, 2 TMA+WS)")
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--n", type=int, nargs="*", default=None, help="sequence lengths (default 1024 4096 16384; "
                    "sweep: 4096)")
    ap.add_argument("--d", type=int, nargs="*", default=None, help="head dims (default 64 128; sweep: 128)")
    ap.add_argument("--kernels", default="fwd,dkdv,dq,dkdva",
                    help="sweep only these of fwd, dkdv, dq, dkdva (atomic-dQ dk/dv); one shape of all four "
                    "takes ~2-3 minutes with 16 compile workers")
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 2], help="0 none, 2 causal (1: top-left)")
    ap.add_argument("--dtype", nargs="*", default=None, help="fp16 bf16 (default both; sweep: fp16)")
    ap.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--json", type=str, default=None, help="write the results here")
    args = ap.parse_args()

    arch = device_arch()
    if arch not in KNOWN:
        sys.exit(f"{arch} is not a builder target; known: {', '.join(KNOWN)}")
    # Device-side tensor descriptors (USE_TMA) need Triton's global scratch allocator.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    ns = args.n or ([4096] if args.configs else [1024, 4096, 16384])
    dtypes = args.dtype or (["fp16"] if args.configs else ["fp16", "bf16"])
    ds = args.d or ([128] if args.configs else [64, 128])
    kernels = tuple(k for k in args.kernels.split(",") if k)
    unknown = set(kernels) - {"fwd", "dkdv", "dq", "dkdva"}
    if unknown:
        sys.exit(f"--kernels: unknown {', '.join(sorted(unknown))}; choose from fwd, dkdv, dq, dkdva")
    print(f"device {torch.cuda.get_device_name(0)} ({arch}), torch {torch.__version__}, triton {triton.__version__}")

    check_p = Problem(2, 4, 1024, max(ds), 2, dtypes[0])
    print("check vs fp32 SDPA:", check(check_p, {k: registry_config(check_p, k, arch, args.fwd_config if k == "fwd"
                                                                      else 0) for k in KERNELS}))
    del check_p

    out: dict = {"arch": arch, "device": torch.cuda.get_device_name(0)}
    for dt in dtypes:
        for d in ds:
            for n in ns:
                for c in args.causal:
                    p = Problem(args.b, args.h, n, d, c, dt)
                    if args.configs:
                        out.setdefault("sweep", {}).update(run_sweep([p], arch, args.workers, args.top, kernels))
                    else:
                        out.setdefault("table", []).extend(run_table([p], arch, args.aot, args.fwd_config))
                    del p
                    torch.cuda.empty_cache()
                    if args.json:  # after every shape: a run cut short by a time limit keeps its results
                        Path(args.json).write_text(json.dumps(out, indent=1))
    if "table" in out:
        print_table(out["table"], args.aot)


if __name__ == "__main__":
    main()
