"""Benchmark and tune the attention kernels on a GPU through the Triton JIT.

Runs ``builder/kernels/attention*.py`` with ``kernel[grid](...)`` on the benchmark shapes, checks
them against torch SDPA once, and prints TFLOP/s for forward and backward next to torch's
FLASH_ATTENTION and CUDNN_ATTENTION backends. Flops: forward 4·B·H·N²·D (halved when causal),
backward 2.5× forward. The table and the sweep's rankings time their contenders together in rounds
of changing order (:func:`builder.gputime.time_rounds`, medians of ``ROUNDS``); lone timings
(the small kernels, the ``--aot`` summary) are ``triton.testing.do_bench`` medians.

This is the kernel developer's tool (raw launches, configs beyond the registry's). The operator's
numbers against cuDNN (inference and training), FlashAttention-2 and the JIT are
``bench/attention.py``'s; the tuning database the runtime reads comes from ``python -m builder
tune``, which times the built configs through the runtime.

    python bench/attention_jit.py                      # benchmark shapes, registry default configs
    python bench/attention_jit.py --configs            # sweep block/warp/stage/TMA/WS configs (D=128)
    python bench/attention_jit.py --configs --kernels fwd --n 4096 16384 --causal 0 2 --aot
    python bench/attention_jit.py --aot                # also time the registry's AOT binaries
    python bench/attention_jit.py --n 4096 --d 128 --causal 0 --dtype fp16 --json out.json

``--configs`` precompiles every candidate in parallel worker processes (Triton's disk cache
carries the binaries to this process), then times each kernel alone: the forward, and the two
backward kernels separately (dk/dv and dq are independent), and prints the winners per shape as
config-table entries. Forward candidates are first checked against SDPA's output and
logsumexp on the same shape; a wrong one is reported and not ranked. On sm90 the forward
candidates are a short list of plausible tiles (``--wide`` for the full product). A final table
gives, per shape, cuDNN, the registry's config #0 and the best candidate in TFLOP/s, and with
``--aot`` the AOT binary of every registry forward config next to the JIT of the same config.
``--aot`` compiles the variants exactly as the builder does (registry signature, divisibility,
options; no JIT value specialization) and launches the binaries, to compare the AOT image with
the JIT of the same source.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if not __package__:  # run as `python bench/NAME.py`: the checkout on the path (python -m bench.NAME needs none)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from builder.gputime import time_rounds  # noqa: E402
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
        if kernel in ("fwd", "dkdv", "dkdva", "dq"):
            s["SOFTCAP"] = 0
            s["ALIBI"] = 0
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
        scal = (1.0 / math.sqrt(self.D), 0.0, 0, 0, -1, 0 if self.causal else -1, 1 if self.causal == 2 else 0)
        if kernel == "fwd":
            return [t("q"), t("k"), t("v"), t("dummy"), t("o"), t("lse"), t("dummy8"), t("dummy32"),
                    t("dummy32"), *strides * 4, *none, self.lz, self.lh, *none, *sizes, *scal,
                    0.0, t("lse"), 0, t("lse"), 0]  # softcap, alibi_slopes, stride_az, Sinks, use_sinks: none
        if kernel in ("pre", "prea"):
            return [t("o"), t("do"), t("delta"), t(dqa), t("dummy32"), *strides * 2, *dqa_strides,
                    self.lz, self.lh, self.B, self.H, self.N]
        if kernel in ("dkdv", "dkdva"):
            return [t("q"), t("k"), t("v"), t("dummy"), t("do"), t("dk"), t("dv"), t("dummy"), t(dqa), t("lse"),
                    t("delta"), t("dummy32"), t("dummy32"), *strides * 3, *none, *strides * 3, *none,
                    *dqa_strides, self.lz, self.lh, *sizes, *scal, 0.0, t("lse"), 0]  # no softcap or ALiBi
        if kernel == "conv":
            return [t("dqa"), t("dq"), t("dummy32"), *strides * 2, self.B, self.H, self.N]
        return [t("q"), t("k"), t("v"), t("dummy"), t("do"), t("dq"), t("lse"), t("delta"), t("dummy32"),
                t("dummy32"), *strides * 3, *none, *strides * 2, self.lz, self.lh, *sizes, *scal, 0.0, t("lse"), 0]

    def grid(self, kernel: str, cfg: dict) -> tuple[int, int, int]:
        """The registry's grid rule (causal forward programs pair query blocks, for one)."""
        return _declarations()[REGISTRY_NAME[kernel]].grid_of(
            seqlen_q=self.N, seqlen_k=self.N, batch=self.B, num_heads_q=self.H, num_heads_k=self.H,
            **self.flags(kernel), **cfg)

    def flags(self, kernel: str) -> dict:
        """The spec's constexprs (everything but dtype, which the tensors carry)."""
        return {k: v for k, v in self.spec(kernel).items() if k != "dtype"}


@functools.lru_cache(maxsize=1)
def _declarations() -> dict:
    from builder.registry import load_kernels

    return load_kernels()


def registry_config(p: Problem, kernel: str, arch: str, index: int = 0) -> dict:
    """The registry's config #index for this problem on ``arch``, flattened to a dict."""
    configs = CONFIG_TABLE[kernel](p.spec(kernel), KNOWN[arch])
    c = configs[min(index, len(configs) - 1)]
    return {**c.constexprs, "num_warps": c.num_warps, "num_stages": c.num_stages, **c.options}


def launch(p: Problem, kernel: str, cfg: dict) -> None:
    KERNELS[kernel][p.grid(kernel, cfg)](*p.args(kernel), **p.flags(kernel), **cfg)


def warmup(job: tuple) -> str | None:
    """Worker: compile one (problem, kernel, config) into the disk cache: through the JIT, or
    with ``cfg == ("aot", arch, index)`` as the builder compiles registry config #index."""
    shape, kernel, cfg = job
    p = Problem(*shape, materialize=False)
    try:
        if isinstance(cfg, tuple):
            aot_compile(p, kernel, cfg[1], cfg[2])
        else:
            KERNELS[kernel].warmup(*p.args(kernel, mock=True), grid=(1,), **p.flags(kernel), **cfg)
        return None
    except Exception as exc:  # reported, the config is skipped
        return f"{type(exc).__name__}: {str(exc)[-300:]}"


_POOL: list = []  # one worker pool for the whole run: each worker imports torch and triton once


def precompile(jobs: list[tuple], workers: int) -> dict:
    """Compile in parallel; returns {job index: error} for the ones that failed."""
    if not jobs:
        return {}
    if not _POOL:
        ctx = __import__("multiprocessing").get_context("spawn")
        _POOL.append(ProcessPoolExecutor(workers, mp_context=ctx))
    errors = list(_POOL[0].map(warmup, jobs))
    return {i: e for i, e in enumerate(errors) if e}


# ------------------------------------------------------------------------------------------------
# AOT: compile exactly as the builder does, launch the binary.
# ------------------------------------------------------------------------------------------------

def aot_compile(p: Problem, kernel: str, arch: str, index: int = 0):
    """(compiled kernel, registry job) of config #index, compiled as the builder does; None if
    the registry has no such variant."""
    from triton.compiler import ASTSource

    from builder.registry import expand
    from builder.targets import gpu_target, parse_targets

    decl = _declarations()[REGISTRY_NAME[kernel]]
    want = p.spec(kernel)
    jobs = [j for j in expand(decl, parse_targets(arch), "full", triton.__version__)
            if j.spec == want and j.config_index == index]
    if not jobs:
        return None
    job = jobs[0]
    names = list(job.signature)
    attrs = {(names.index(n),): [["tt.divisibility", d]] for n, d in job.divisibility.items()}
    src = ASTSource(fn=decl.fn, signature=dict(job.signature), constexprs=dict(job.constexprs), attrs=attrs)
    return triton.compile(src, target=gpu_target(job.target), options=job.options()), job


def aot_launcher(p: Problem, kernel: str, arch: str, index: int = 0):
    built = aot_compile(p, kernel, arch, index)
    if built is None:
        return None
    compiled, job = built
    names = list(job.signature)
    grid = p.grid(kernel, dict(job.config.constexprs))
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
    """One callable alone (the sweep's small kernels, the --aot summary); rankings and the table go
    through :func:`builder.gputime.time_rounds` instead, contenders interleaved."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


ROUNDS = 5  # timing rounds of the sweep ranking and the table (medians over them)


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None else flops / (ms * 1e-3) / 1e12


# sm90 forward tiles worth timing: (BLOCK_M, BLOCK_N, USE_TMA, WARP_SPEC, warps, stages). Two
# 4-warp 128x64 programs fit an SM (255 registers, 96 KB of shared memory each); 8 warps or
# 128-key tiles hold one program per SM; warp specialization turns 4 warps into a producer and
# two consumer warp groups (64 rows each, or 128 with BLOCK_M 256); the plain 8-warp tile is the
# pre-TMA default.
SM90_FWD = ((128, 64, 1, 0, 4, 2), (128, 64, 1, 0, 8, 2), (128, 128, 1, 0, 8, 2), (128, 128, 1, 0, 8, 3),
            (64, 64, 1, 0, 4, 2), (64, 128, 1, 0, 4, 2), (256, 64, 1, 0, 8, 2), (128, 64, 1, 1, 4, 3),
            (128, 64, 1, 1, 4, 4), (128, 128, 1, 1, 4, 2), (256, 64, 1, 1, 4, 2), (128, 64, 0, 0, 8, 3))


def sweep_candidates(kernel: str, p: Problem, arch: str, wide: bool = False) -> list[dict]:
    """Configs to rank. Forward on sm90: SM90_FWD and the registry's table (``wide``: the full
    block x warp x stage x TMA product); elsewhere the product of block sizes, warps, stages."""
    out = []
    if kernel == "fwd" and arch == "sm90" and not wide:
        for bm, bn, tma, ws, w, s in SM90_FWD:
            out.append({"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma, "WARP_SPEC": ws, "num_warps": w,
                        "num_stages": s})
        for c in CONFIG_TABLE["fwd"](p.spec("fwd"), KNOWN[arch]):
            cfg = {**c.constexprs, "num_warps": c.num_warps, "num_stages": c.num_stages, **c.options}
            if cfg not in out:
                out.append(cfg)
    elif kernel == "fwd":
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
            out.append({"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": 0, "num_warps": w, "num_stages": s})
    elif kernel == "dq":
        for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
            out.append({"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": 0, "num_warps": w, "num_stages": s})
    return out


def fwd_reference(p: Problem) -> tuple:
    """SDPA's (flash backend) output and natural-log LSE for the problem: what a forward
    candidate must reproduce before it is ranked. LSE is None where the op is unavailable."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    scale = 1.0 / math.sqrt(p.D)
    try:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            p.q, p.k, p.v, 0.0, bool(p.causal), False, scale=scale)[:2]
        return out, lse.float()
    except Exception:  # an older/newer signature: compare the output alone
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(p.q, p.k, p.v, is_causal=bool(p.causal))
        return out, None


def fwd_error(p: Problem, ref: tuple) -> float:
    """Largest absolute difference of our output (and LSE) from the reference, after a launch."""
    out, lse = ref
    err = (p.o.float() - out.float()).abs().max().item()
    if lse is not None:
        err = max(err, (p.lse - lse).abs().max().item())
    return err


FWD_TOL = 5e-3  # absolute, on outputs of magnitude < 1 and on LSE; fp16/bf16 rounding is ~1e-3


def run_sweep(problems: list[Problem], arch: str, workers: int, top: int, kernels: tuple[str, ...],
              aot: bool = False, wide: bool = False) -> dict:
    results = {}
    for p in problems:
        shape = (p.B, p.H, p.N, p.D, p.causal, p.dtype)
        jobs = [(shape, k, c) for k in kernels for c in sweep_candidates(k, p, arch, wide)]
        n_reg = len(CONFIG_TABLE["fwd"](p.spec("fwd"), KNOWN[arch])) if "fwd" in kernels else 0
        aot_jobs = [(shape, "fwd", ("aot", arch, i)) for i in range(n_reg)] if aot else []
        errors = precompile(jobs + aot_jobs, workers)
        print(f"\n== sweep {p.label}: {len(jobs)} configs, {len(errors)} failed to compile", flush=True)
        for i, e in sorted(errors.items()):
            print(f"   compile failed: {(jobs + aot_jobs)[i][1:]}: {e[-160:]}")
        ref = fwd_reference(p) if "fwd" in kernels else None
        per_kernel: dict[str, list] = {k: [] for k in kernels}
        candidates: dict[str, dict] = {k: {} for k in kernels}  # kernel -> {label: (cfg, fn)}
        for i, (_, kernel, cfg) in enumerate(jobs):
            if i in errors:
                continue
            try:
                if kernel == "fwd":
                    p.o.fill_(float("nan"))
                    p.lse.fill_(float("nan"))
                    launch(p, kernel, cfg)
                    err = fwd_error(p, ref)
                    if not err <= FWD_TOL:  # NaN fails too
                        print(f"   WRONG fwd {cfg}: max error {err:.3g} > {FWD_TOL}")
                        continue
            except Exception as exc:  # out of resources etc.
                print(f"   skip {kernel} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            candidates[kernel][json.dumps(cfg, sort_keys=True)] = (
                cfg, lambda p=p, kernel=kernel, cfg=cfg: launch(p, kernel, cfg))
        for kernel, cands in candidates.items():
            # One kernel's candidates in rounds of changing order (a warming GPU favours whichever runs first).
            stats = time_rounds({label: fn for label, (_, fn) in cands.items()}, rounds=ROUNDS,
                                log=lambda m, kernel=kernel: print(f"   skip {kernel} {m}"))
            per_kernel[kernel] = [(stats[label].median, cfg) for label, (cfg, _) in cands.items() if label in stats]
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
        res: dict = {k: {"ms": v[0], "config": v[1]} for k, v in best.items()}
        res.update({f"{k}_ms": v for k, v in small_ms.items()})
        if "fwd" in best:
            res["fwd_all"] = [{"ms": ms, "config": cfg} for ms, cfg in per_kernel["fwd"]]
            res.update(fwd_summary(p, arch, per_kernel["fwd"], aot, n_reg, ref))
            print(f"   fwd best: {tflops(p.flops_fwd, best['fwd'][0]):.0f} TFLOP/s")
        if "dkdv" in best and "dq" in best:
            total = pre_ms + best["dkdv"][0] + best["dq"][0]
            print(f"   bwd best: {tflops(2.5 * p.flops_fwd, total):.0f} TFLOP/s "
                  f"(pre {pre_ms:.3f} + dkdv {best['dkdv'][0]:.3f} + dq {best['dq'][0]:.3f} ms)")
        if "dkdva" in best:
            total = small_ms["prea"] + best["dkdva"][0] + small_ms["conv"]
            print(f"   bwd best, atomic dQ: {tflops(2.5 * p.flops_fwd, total):.0f} TFLOP/s "
                  f"(pre {small_ms['prea']:.3f} + dkdv {best['dkdva'][0]:.3f} + convert {small_ms['conv']:.3f} ms)")
        results[p.label] = res
    return results


def fwd_summary(p: Problem, arch: str, rows: list, aot: bool, n_reg: int, ref: tuple) -> dict:
    """cuDNN, registry #0 and best forward for one swept shape; AOT vs JIT of each registry config."""
    out: dict = {}
    fwd, _, err = sdpa_fns(p, "cudnn")
    out["cudnn_ms"] = None if err else bench_ms(fwd)
    timed = {json.dumps(cfg, sort_keys=True): ms for ms, cfg in rows}
    out["registry"] = []
    for i in range(n_reg):
        cfg = registry_config(p, "fwd", arch, i)
        entry = {"index": i, "config": cfg, "jit_ms": timed.get(json.dumps(cfg, sort_keys=True))}
        if aot:
            try:
                fn = aot_launcher(p, "fwd", arch, i)
                p.o.fill_(float("nan"))
                p.lse.fill_(float("nan"))
                fn()
                err = fwd_error(p, ref)
                entry["aot_ms"] = bench_ms(fn) if err <= FWD_TOL else None
                entry["aot_error"] = err
            except Exception as exc:
                entry["aot_failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        out["registry"].append(entry)
    for e in out["registry"]:
        line = f"   registry #{e['index']}: JIT {e['jit_ms'] or float('nan'):.3f} ms"
        if aot:
            line += f", AOT {e.get('aot_ms') or float('nan'):.3f} ms"
            if e.get("aot_ms") and e.get("jit_ms"):
                line += f" ({(e['aot_ms'] / e['jit_ms'] - 1) * 100:+.1f}%)"
            line += f" {e.get('aot_failed', '')}"
        print(line + f"  {e['config']}")
    return out


def print_sweep_table(sweep: dict) -> None:
    """One line per swept shape: cuDNN, registry #0, best candidate (TFLOP/s) and their ratios."""
    rows = [(label, r) for label, r in sweep.items() if "registry" in r]
    if not rows:
        return
    head = (f"{'shape':<34}{'cudnn':>7}{'#0':>7}{'#0/cud':>8}{'aot#0':>7}{'aot/jit':>8}{'best':>7}"
            f"{'best/cud':>9}  best config")
    print("\nforward TFLOP/s (configs: medians of interleaved rounds; cuDNN, AOT: do_bench medians)\n"
          + head + "\n" + "-" * (len(head) + 20))
    for label, r in rows:
        p = Problem(*problem_of(label), materialize=False)
        cud = tflops(p.flops_fwd, r.get("cudnn_ms"))
        reg0 = r["registry"][0] if r["registry"] else {}
        t0 = tflops(p.flops_fwd, reg0.get("jit_ms"))
        a0 = tflops(p.flops_fwd, reg0.get("aot_ms"))
        tb = tflops(p.flops_fwd, r["fwd"]["ms"])

        def f(x, w=7, d=0):
            return f"{x:>{w}.{d}f}" if x is not None else f"{'-':>{w}}"
        cfg = r["fwd"]["config"]
        short = (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
                 f"{' tma' if cfg.get('USE_TMA') else ''}{' ws' if cfg.get('WARP_SPEC') else ''}")
        print(f"{label:<34}{f(cud)}{f(t0)}{f(t0 / cud if t0 and cud else None, 8, 2)}{f(a0)}"
              f"{f(a0 / t0 if a0 and t0 else None, 8, 3)}{f(tb)}{f(tb / cud if cud else None, 9, 2)}  {short}")
    print("Floor: forward >= 0.85x cuDNN at D=128, N >= 4096 (causal too); AOT within 3% of JIT.\n"
          "#0 is the registry's default config (what the operator launches); reorder fwd_configs if 'best' wins.")


def problem_of(label: str) -> tuple:
    """Problem arguments back from a label ("fp16 B4 H32 N4096 D128 causal")."""
    dtype, b, h, n, d, c = label.split()
    return int(b[1:]), int(h[1:]), int(n[1:]), int(d[1:]), {"full": 0, "causal-tl": 1, "causal": 2}[c], dtype


def precompile_table(problems: list[Problem], arch: str, aot: bool, index: int, workers: int) -> None:
    """Warm the disk cache with every kernel the table launches (JIT, and AOT with ``aot``)."""
    jobs, seen = [], set()
    for p in problems:
        shape = (p.B, p.H, p.N, p.D, p.causal, p.dtype)
        for k in KERNELS:
            cfg = registry_config(p, k, arch, index if k == "fwd" else 0)
            key = (p.D, p.causal, p.dtype, k, json.dumps(cfg, sort_keys=True))
            if key not in seen:
                seen.add(key)
                jobs.append((shape, k, cfg))
            if aot and k in ("fwd", *BWD["split"]) and key[:4] + ("aot",) not in seen:
                seen.add(key[:4] + ("aot",))
                jobs.append((shape, k, ("aot", arch, index if k == "fwd" else 0)))
    errors = precompile(jobs, workers)
    for i, e in sorted(errors.items()):
        print(f"compile failed: {jobs[i][1:]}: {e[-200:]}")


def run_table(problems: list[Problem], arch: str, aot: bool, index: int) -> list[dict]:
    rows = []
    for p in problems:
        cfgs = {k: registry_config(p, k, arch, index if k == "fwd" else 0) for k in KERNELS}
        row = {"shape": p.label, "fwd_config": cfgs["fwd"]}
        # Every contender of the shape in rounds of changing order (builder.gputime), medians kept.
        fns = {"ours_fwd": (1.0, lambda p=p, cfgs=cfgs: launch(p, "fwd", cfgs["fwd"]))}
        for mode, seq in BWD.items():
            fns["ours_bwd" if mode == "split" else "ours_bwd_atomic"] = (
                2.5, lambda p=p, cfgs=cfgs, seq=seq: [launch(p, k, cfgs[k]) for k in seq])
        if aot:
            aots = {k: aot_launcher(p, k, arch, index if k == "fwd" else 0) for k in ("fwd", *BWD["split"])}
            if all(aots.values()):
                fns["aot_fwd"] = (1.0, aots["fwd"])
                fns["aot_bwd"] = (2.5, lambda aots=aots: [aots[k]() for k in BWD["split"]])
        for be in ("flash", "cudnn"):
            fwd, bwd, err = sdpa_fns(p, be)
            if err:
                row[f"{be}_error"] = err
                continue
            fns[f"{be}_fwd"] = (1.0, fwd)
            fns[f"{be}_bwd"] = (2.5, bwd)
        stats = time_rounds({k: fn for k, (_, fn) in fns.items()}, rounds=ROUNDS,
                            log=lambda m, p=p: print(f"{p.label}: failed: {m}"))
        if "ours_fwd" not in stats:
            continue
        for k, s in stats.items():
            row[k] = tflops(fns[k][0] * p.flops_fwd, s.median)
        row["rounds_ms"] = {k: list(s.rounds) for k, s in stats.items()}  # per round, for paired ratios
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def print_table(rows: list[dict], aot: bool) -> None:
    cols = ["ours_fwd"] + (["aot_fwd"] if aot else []) + ["flash_fwd", "cudnn_fwd", "ours_bwd", "ours_bwd_atomic"] \
        + (["aot_bwd"] if aot else []) + ["flash_bwd", "cudnn_bwd"]
    head = f"{'shape':<36}" + "".join(f"{c:>11}" for c in cols) + f"{'fwd/cudnn':>11}{'bwd/cudnn':>11}"
    print(f"\nTFLOP/s (medians of {ROUNDS} rounds, contenders interleaved)\n" + head + "\n" + "-" * len(head))
    for r in rows:
        cells = "".join(f"{r[c]:>11.0f}" if r.get(c) is not None else f"{'-':>11}" for c in cols)
        best_bwd = max(r.get("ours_bwd") or 0, r.get("ours_bwd_atomic") or 0)
        ratio = "".join(f"{ours / r['cudnn_' + d]:>11.2f}" if r.get("cudnn_" + d) else f"{'-':>11}"
                        for d, ours in (("fwd", r["ours_fwd"]), ("bwd", best_bwd)))
        print(f"{r['shape']:<36}{cells}{ratio}")
    print("ours_bwd: deterministic split (preprocess, dk/dv, dq); ours_bwd_atomic: dQ by fp32 atomics in dk/dv.\n"
          "bwd/cudnn uses the faster of the two. Floor: fwd >= 0.85x cuDNN, bwd >= 0.60x cuDNN at "
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
                    help="registry forward config index to time (sm90 D128 without a mask: 0 8-warp 128x128 TMA, "
                    "1 4-warp 128x64 TMA, 2 8-warp plain pointers; causal: 0 and 1 swapped)")
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
    ap.add_argument("--wide", action="store_true", help="sm90 forward sweep: the full product, not SM90_FWD")
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

    # Compile in parallel first: the check's kernels, and in table mode everything it launches.
    check_shape = (2, 4, 1024, max(ds), 2, dtypes[0])
    table = [] if args.configs else [Problem(args.b, args.h, n, d, c, dt, materialize=False)
                                     for dt in dtypes for d in ds for n in ns for c in args.causal]
    precompile_table([Problem(*check_shape, materialize=False), *table], arch, args.aot and not args.configs,
                     args.fwd_config, args.workers)
    check_p = Problem(*check_shape)
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
                        out.setdefault("sweep", {}).update(
                            run_sweep([p], arch, args.workers, args.top, kernels, args.aot, args.wide))
                    else:
                        out.setdefault("table", []).extend(run_table([p], arch, args.aot, args.fwd_config))
                    del p
                    torch.cuda.empty_cache()
                    if args.json:  # after every shape: a run cut short by a time limit keeps its results
                        Path(args.json).write_text(json.dumps(out, indent=1))
    if "table" in out:
        print_table(out["table"], args.aot)
    if "sweep" in out:
        print_sweep_table(out["sweep"])


if __name__ == "__main__":
    main()
