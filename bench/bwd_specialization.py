"""What the Triton JIT knows about a backward call that the AOT images do not, and what it is worth.

The AOT variants are compiled with the registry's declarations (``divisibility`` of pointers and
strides, i64 batch/head strides, u64 dropout seeds); the JIT specialises every launch on its
arguments (integers divisible by 16 or equal to 1, pointers 16-byte aligned, i32 where a value
fits). For one call (default: the benchmark grid's B4 H32 N16384 D128 causal) this script builds
each backward kernel the operator launches on sm90 (``attn_bwd_preprocess``,
``attn_bwd_dkdv_sm90``, ``attn_bwd_dq_sm90``, config #0) in four *modes*:

- ``aot``: exactly as the builder compiles it;
- ``aot+lse``: plus ``stride_lz``/``stride_lh`` divisible by 16 (each head's LSE/Delta row aligned);
- ``aot+lse+len``: plus ``seqlen_q``/``seqlen_k`` divisible by 16 (for the dK/dV kernel, the binary
  of its aligned-length sibling ``attn_bwd_dkdv_sm90_a16`` byte for byte);
- ``jit``: the signature and attributes Triton 3.6's JIT derives from this call's arguments
  (its own specialisation code, run on stand-in tensors).

``--sass`` (CPU, no GPU needed) lists the attributes that differ between ``aot`` and ``jit`` and,
per mode, the instruction count of each kernel's innermost query/key-tile loops (the ones holding
HGMMA), their global loads and local-memory spills. Without ``--sass`` (GPU) it times, in shuffled
rounds (:func:`builder.gputime.time_rounds`), every kernel in every mode and the whole backward
(preprocess, dK/dV, dQ) per mode, all through Triton's own launcher, so only the code differs.
With ``--images DIR`` the same rounds also time the operator's backward on those images (``ours
bwd``: the runtime's launcher, plan and scratch) and through the JIT (``jit bwd``), the two
contenders of ``bench/attention.py``'s bwd/jit. ``ours bwd`` runs what the dispatch picks: at the
default N=16384 (lengths and LSE strides multiples of 16) on images that hold the aligned-length
sibling (``--set gputest`` or ``full``) its dK/dV is ``attn_bwd_dkdv_sm90_a16``, the ``aot+lse+len``
binary, so ``ours bwd`` against ``bwd aot+lse+len`` isolates the launch path there (against ``bwd
aot`` on images without the sibling, or at a ragged ``--n``; the output and JSON name the dK/dV
kernel that ran), ``bwd jit`` against ``jit bwd`` checks that the ``jit`` mode is what the JIT builds, and ``ours
bwd, no cache preference`` is ``ours bwd`` without the L1/shared preference that Triton's loader
sets and the runtime now sets too (``CU_FUNC_CACHE_PREFER_SHARED`` past 48 KiB of shared memory; the
one launch setting in which the runtime used to differ): the gain of that change.

    python bench/bwd_specialization.py --sass                      # CPU: the diff, ~3 min a dtype
    python bench/bwd_specialization.py --images DIR --rounds 5     # H200: times, ~3 min
    python bench/bwd_specialization.py --dtype bf16 --causal 2 --n 4096
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERNELS = ("attn_bwd_preprocess", "attn_bwd_dkdv_sm90", "attn_bwd_dq_sm90")
MODES = ("aot", "aot+lse", "aot+lse+len", "jit")
_EXTRA = {"aot": {}, "aot+lse": {"stride_lz": 16, "stride_lh": 16},
          "aot+lse+len": {"stride_lz": 16, "stride_lh": 16, "seqlen_q": 16, "seqlen_k": 16}}
_FP32 = {"LSE", "Delta", "DQacc", "alibi_slopes"}


class Call:
    """One backward call's scalar arguments, as the operator passes them for ``causal=True``
    (``causal_align`` 0: top-left, which equal lengths make bottom-right too): q, k, v, dO, O in
    (B, N, H, D) memory seen as (B, H, N, D), fresh contiguous gradients, (B, H, N) LSE/Delta."""

    def __init__(self, B: int, H: int, N: int, D: int, causal: int, dtype: str) -> None:
        self.B, self.H, self.N, self.D, self.causal, self.dtype = B, H, N, D, causal, dtype
        self.ours_dkdv: str | None = None  # the dK/dV kernel the operator ran (--images), once known
        bshd, cont, none = (N * H * D, D, H * D), (H * N * D, N * D, D), (0, 0, 0)
        self.values: dict[str, Any] = {
            "batch": B, "num_heads_q": H, "num_heads_k": H, "seqlen_q": N, "seqlen_k": N,
            "sm_scale": 1 / math.sqrt(D), "dropout_p": 0.0, "philox_seed": 0, "philox_offset": 0,
            "window_left": -1, "window_right": 0 if causal else -1, "causal_align": 0, "softcap": 0.0,
            "stride_az": 0, "stride_lz": H * N, "stride_lh": N}
        for prefix, row, strides in (("q", "m", bshd), ("k", "n", bshd), ("v", "n", bshd), ("do", "m", bshd),
                                     ("o", "m", bshd), ("dq", "m", cont), ("dk", "n", cont), ("dv", "n", cont),
                                     ("b", "m", none), ("db", "m", none), ("dqa", "m", none)):
            self.values.update({f"stride_{prefix}z": strides[0], f"stride_{prefix}h": strides[1],
                                f"stride_{prefix}{row}": strides[2]})

    @property
    def label(self) -> str:
        return f"{self.dtype} B{self.B} H{self.H} N{self.N} D{self.D} causal={self.causal}"

    @property
    def flops_bwd(self) -> float:
        f = 4.0 * self.B * self.H * self.N * self.N * self.D
        return 2.5 * (f / 2 if self.causal else f)


def job_of(kernel: str, call: Call) -> Any:
    """The registry's config-#0 job of ``kernel`` for the call's spec on sm90."""
    import triton

    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    want = {"dtype": call.dtype, "HEAD_DIM": call.D, "HEAD_DIM_V": call.D, "CAUSAL": call.causal, "BIAS": 0,
            "DROPOUT": 0, "VARLEN": 0, "DQ_ATOMIC": 0, "SOFTCAP": 0,
            "ALIBI": 0}
    for job in expand(load_kernels()[kernel], parse_targets("sm90"), "full", triton.__version__):
        if job.config_index == 0 and all(want[k] == v for k, v in job.spec.items()):
            return job
    raise LookupError(f"{kernel}: no sm90 job for {want}")


def jit_specialization(job: Any, call: Call) -> tuple[dict[str, str], dict[tuple, list]]:
    """(signature, attrs) that Triton's JIT derives for this call: its binder run on stand-ins that
    carry a dtype and a 16-byte aligned ``data_ptr`` (torch allocations are 256-byte aligned)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from builder.registry import load_kernels

    class Pointer:
        def __init__(self, dtype: Any) -> None:
            self.dtype = dtype

        def data_ptr(self) -> int:
            return 0x7F0000000000

    fn = load_kernels()[job.kernel].fn
    backend = make_backend(GPUTarget("cuda", 90, 64))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}[call.dtype]
    args = []
    for p in fn.params:
        t = job.signature[p.name]
        if t == "constexpr":
            args.append(job.constexprs[p.name])
        elif t.startswith("*"):
            args.append(Pointer(torch.float32 if p.name in _FP32 else torch.int32 if p.name.startswith("cu_")
                                else tdt))
        else:
            args.append(call.values[p.name])
    _, spec, _ = binder(*args)
    signature = {p.name: s[0] for p, s in zip(fn.params, spec)}
    attrs = {(i,): backend.parse_attr(s[1]) for i, s in enumerate(spec) if isinstance(s[1], str)}
    return signature, attrs


def specialization_diff(job: Any, call: Call) -> list[tuple[str, str, str]]:
    """(argument, AOT type/divisibility, JIT type/divisibility) for every runtime argument on
    which the two differ."""
    signature, attrs = jit_specialization(job, call)
    names = list(job.signature)
    jit_div = {names[k[0]]: dict(v).get("tt.divisibility", 1) for k, v in attrs.items()}
    out = []
    for n, t in job.signature.items():
        if t == "constexpr":
            continue
        aot = f"{t.replace('{dtype}', call.dtype)} %{job.divisibility.get(n, 1)}"
        jit = f"{signature[n]} %{jit_div.get(n, 1)}" if signature[n] != "constexpr" else "constexpr"
        if aot.replace("fp16", "").replace("bf16", "") != jit.replace("fp16", "").replace("bf16", ""):
            out.append((n, aot, jit))
    return out


def compile_mode(kernel: str, call: Call, mode: str) -> Any:
    """The CompiledKernel of ``kernel`` for the call in ``mode`` (Triton's disk cache applies)."""
    os.environ.setdefault("TRITON_DISABLE_LINE_INFO", "1")  # as the builder compiles
    import triton

    from builder.compile import source_class
    from builder.registry import load_kernels
    from builder.targets import gpu_target

    job = job_of(kernel, call)
    names = list(job.signature)
    if mode == "jit":
        signature, attrs = jit_specialization(job, call)
    else:
        signature = dict(job.signature)
        div = {**job.divisibility, **{n: d for n, d in _EXTRA[mode].items() if n in names}}
        attrs = {(names.index(n),): [["tt.divisibility", d]] for n, d in div.items()}
    src = source_class(load_kernels()[kernel].fn)(fn=load_kernels()[kernel].fn, signature=signature,
                                                  constexprs=dict(job.constexprs), attrs=attrs)
    return triton.compile(src, target=gpu_target(job.target), options=job.options())


def _compile_worker(item: tuple) -> str | None:
    kernel, shape, mode = item
    try:
        compile_mode(kernel, Call(*shape), mode)
        return None
    except Exception as exc:  # noqa: BLE001 - reported; that mode is left out
        return f"{kernel} {mode}: {type(exc).__name__}: {str(exc)[-300:]}"


def precompile(call: Call, workers: int) -> None:
    shape = (call.B, call.H, call.N, call.D, call.causal, call.dtype)
    items = [(k, shape, m) for k in KERNELS for m in MODES]
    ctx = __import__("multiprocessing").get_context("spawn")
    with ProcessPoolExecutor(max(1, workers), mp_context=ctx) as pool:
        for err in pool.map(_compile_worker, items):
            if err:
                print("compile failed:", err)


# ------------------------------------------------------------------------------------------------
# SASS: the innermost tile loops.
# ------------------------------------------------------------------------------------------------

_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass_instructions(cubin: bytes) -> list[tuple[int, str, str]]:
    """(address, opcode, text) of every instruction, from the cuobjdump that ships with Triton."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    out = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            text = m.group(2)
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
            out.append((int(m.group(1), 16), op, text))
    return out


def tile_loops(cubin: bytes) -> list[dict[str, int]]:
    """The innermost loops that issue wgmma (a backward branch's range holding HGMMA and no such
    loop inside it), in address order: instructions, HGMMA, global loads, spill loads/stores."""
    ins = sass_instructions(cubin)
    spans = set()
    for addr, op, text in ins:
        target = re.search(r"0x([0-9a-f]+)", text) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) <= addr:
            spans.add((int(target.group(1), 16), addr))

    def ops(lo: int, hi: int) -> collections.Counter:
        return collections.Counter(op for a, op, _ in ins if lo <= a <= hi)

    hot = [s for s in spans if any(op.startswith("HGMMA") for op in ops(*s))]
    inner = [s for s in hot if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in hot)]
    rows = []
    for lo, hi in sorted(inner):
        c = ops(lo, hi)
        rows.append({"instructions": sum(c.values()), "HGMMA": sum(v for k, v in c.items() if k.startswith("HGMMA")),
                     "LDG": sum(v for k, v in c.items() if k.startswith("LDG")),
                     "LDG.64": sum(v for k, v in c.items() if k.startswith("LDG.E.64")),
                     "LDL": sum(v for k, v in c.items() if k.startswith("LDL")),
                     "STL": sum(v for k, v in c.items() if k.startswith("STL"))})
    return rows


def sass_report(call: Call) -> dict:
    print(f"{call.label}: attributes on which the JIT's specialisation differs from the builder's")
    report: dict = {"call": call.label, "diff": {}, "loops": {}}
    for kernel in KERNELS:
        diff = specialization_diff(job_of(kernel, call), call)
        report["diff"][kernel] = diff
        print(f"  {kernel}: {len(diff)} arguments: " + ", ".join(f"{n} ({a} -> {j})" for n, a, j in diff))
    print("\ninnermost wgmma loops per mode (SASS instructions / global loads of which .64 / spill LDL+STL)")
    for kernel in KERNELS:
        for mode in MODES:
            compiled = compile_mode(kernel, call, mode)
            loops = tile_loops(compiled.asm["cubin"])
            report["loops"][f"{kernel} {mode}"] = loops
            cells = "  ".join(f"{r['instructions']}/{r['LDG']}({r['LDG.64']})/{r['LDL'] + r['STL']}" for r in loops)
            print(f"  {kernel:<22}{mode:<13}{cells or '(no wgmma loop)'}")
    return report


# ------------------------------------------------------------------------------------------------
# GPU: time every kernel in every mode through Triton's launcher.
# ------------------------------------------------------------------------------------------------

def tensors(call: Call) -> dict[str, Any]:
    """The call's arrays by kernel argument name: q, k, v, dO random, O and LSE random stand-ins
    (replaced by the operator's forward with ``--images``), fresh gradients and Delta."""
    import torch

    torch.manual_seed(0)
    B, H, N, D = call.B, call.H, call.N, call.D
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[call.dtype]

    def bshd() -> Any:
        return torch.randn(B, N, H, D, device="cuda", dtype=dt).transpose(1, 2)

    return {"Q": bshd(), "K": bshd(), "V": bshd(), "DO": bshd(), "Out": bshd(),
            "DQ": torch.empty(B, H, N, D, device="cuda", dtype=dt),
            "DK": torch.empty(B, H, N, D, device="cuda", dtype=dt),
            "DV": torch.empty(B, H, N, D, device="cuda", dtype=dt),
            # A plausible logsumexp (row maxima of unit-variance scores are a few units); timing only.
            "LSE": torch.rand(B, H, N, device="cuda", dtype=torch.float32) + 3.0,
            "Delta": torch.empty(B, H, N, device="cuda", dtype=torch.float32)}


def launchers(call: Call, t: dict[str, Any]) -> dict[str, Any]:
    """name -> callable: "<kernel> <mode>" for each kernel and mode, "bwd <mode>" for the three in
    order, on the arrays ``t``; every pointer the kernels ignore gets a real (unused) buffer."""
    import torch

    from builder.registry import load_kernels

    dt = t["Q"].dtype
    dummy = {"*fp32": torch.empty(64, device="cuda", dtype=torch.float32),
             "*i32": torch.empty(64, device="cuda", dtype=torch.int32),
             "*dt": torch.empty(64, device="cuda", dtype=dt)}
    fns: dict[str, Any] = {}
    for kernel in KERNELS:
        decl = load_kernels()[kernel]
        job = job_of(kernel, call)
        args = []
        for n, ty in job.signature.items():
            if ty == "constexpr":
                args.append(job.constexprs[n])
            elif ty.startswith("*"):
                args.append(t.get(n, dummy["*fp32" if ty == "*fp32" else "*i32" if ty == "*i32" else "*dt"]))
            else:
                args.append(call.values[n])
        grid = decl.grid_of(**call.values, **job.constexprs)
        for mode in MODES:
            runner = compile_mode(kernel, call, mode)[grid]
            fns[f"{kernel} {mode}"] = lambda runner=runner, args=args: runner(*args)
    for mode in MODES:
        seq = [fns[f"{k} {mode}"] for k in KERNELS]
        fns[f"bwd {mode}"] = lambda seq=seq: [f() for f in seq]
    return fns


def operator_contenders(call: Call, t: dict[str, Any], images: str, workers: int) -> dict[str, Any]:
    """``ours bwd`` (the operator on the AOT images: the runtime's launcher, plan and scratch) and
    ``jit bwd`` (the same operator calls through bench/attention.py's JitLibrary: the Triton JIT of
    each kernel with the variant's config), as bench/attention.py times them; the forward's O and
    LSE replace the stand-ins in ``t``."""
    import aotriton_rt
    from aotriton_rt.ops import attention as op

    # Imported by its package name, not loaded from its path: precompile's spawned workers
    # unpickle ``bench.attention._warmup`` by importing the module under the same name.
    from bench import attention as bench

    lib = aotriton_rt.Library(images)
    jit = bench.JitLibrary(lib)
    out, lse = op.attention(t["Q"], t["K"], t["V"], causal=bool(call.causal), library=lib)
    t["Out"].copy_(out)
    t["LSE"].copy_(lse)
    try:  # which kernels and configs the operator runs (the modes above are config #0)
        print(f"operator's backward on {images}:\n" + str(op.explain(
            dtype=call.dtype, head_dim=call.D, seqlen_q=call.N, causal=bool(call.causal), backward=True, library=lib)))
    except Exception as exc:  # noqa: BLE001 - the timings do not depend on it
        print(f"explain failed: {type(exc).__name__}: {str(exc)[:300]}")

    def run(library: Any) -> Any:
        return op.attention_backward(t["DO"], t["Q"], t["K"], t["V"], out, lse, causal=bool(call.causal),
                                     library=library)

    jobs: list = []
    run(bench.JitLibrary(lib, jobs))  # records the JIT's compile jobs, launches nothing
    bench.precompile(jobs, workers)

    # The L1/shared split preference Triton's loader sets on kernels over 48 KB of shared memory,
    # which the runtime sets too since it was found to be the one launch difference: a second
    # Library (its own modules) with the driver's default instead, as the runtime launched before.
    ran = op.attention_kernels(t["Q"], t["K"], t["V"], causal=bool(call.causal), backward=True,
                               library=lib)["attn_bwd_dkdv"].name
    print(f"'ours bwd' runs the dK/dV kernel {ran}" + (" (the aligned-length sibling: mode aot+lse+len's binary)"
                                                      if _aligned(ran) else ""))
    fns = {"ours bwd": lambda: run(lib), "jit bwd": lambda: run(jit)}
    call.ours_dkdv = ran
    plain = aotriton_rt.Library(images)
    try:
        run(plain)
        print(f"'ours bwd, no cache preference': CU_FUNC_CACHE_PREFER_NONE on {no_preference(plain)} loaded kernels")
        fns["ours bwd, no cache preference"] = lambda: run(plain)
    except Exception as exc:  # noqa: BLE001 - the other contenders still run
        print(f"'ours bwd, no cache preference' left out: {type(exc).__name__}: {str(exc)[:300]}")
    return fns


def _aligned(kernel: str) -> bool:
    """Whether ``kernel`` is an aligned-length sibling (the dispatch's ``ALIGNED_SIBLINGS``)."""
    from aotriton_rt.ops.attention.family import family_of

    return family_of(kernel) != kernel


def no_preference(lib: Any) -> int:
    """``cuFuncSetCacheConfig(PREFER_NONE)`` (the driver's default) on every kernel ``lib`` has
    loaded; how many."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    for _, function in lib._modules.values():
        status = cuda.cuFuncSetCacheConfig(ctypes.c_void_p(function), 0)  # CU_FUNC_CACHE_PREFER_NONE
        if status:
            raise RuntimeError(f"cuFuncSetCacheConfig returned {status}")
    return len(lib._modules)


def time_modes(call: Call, rounds: int, seed: int, images: str | None, workers: int) -> dict:
    import torch
    import triton

    from builder.gputime import time_rounds

    # Device-side TMA descriptors need Triton's global scratch allocator (as bench/attention.py's JIT).
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    t = tensors(call)
    extra = operator_contenders(call, t, images, workers) if images else {}
    fns = {**launchers(call, t), **extra}
    log: list[str] = []
    stats = time_rounds(fns, rounds=rounds, seed=seed, log=log.append)
    rows = {name: s.to_json() for name, s in stats.items()}
    print(f"\n{call.label}: median ms over {rounds} shuffled rounds (spread %), and time / jit")
    print(f"{'':<22}" + "".join(f"{m:>22}" for m in MODES))
    for what in (*KERNELS, "bwd"):
        cells = []
        for mode in MODES:
            s, ref = stats.get(f"{what} {mode}"), stats.get(f"{what} jit")
            if s is None:
                cells.append(f"{'-':>22}")
                continue
            spread = (s.high - s.low) / s.median * 100
            rel = f" {s.median / ref.median:.3f}x" if ref else ""
            cells.append(f"{f'{s.median:.3f} ({spread:.0f}%){rel}':>22}")
        print(f"{what:<22}" + "".join(cells))
    if "bwd aot" in stats and "bwd jit" in stats:
        aot, jit = stats["bwd aot"].median, stats["bwd jit"].median
        print(f"backward TFLOP/s: aot {call.flops_bwd / aot / 1e9:.0f}, jit {call.flops_bwd / jit / 1e9:.0f}; "
              f"aot / jit speed {jit / aot:.3f} (the acceptance bar: >= 0.97)")
    # The mode whose binaries the operator launches: aot+lse+len where its dK/dV is the aligned sibling.
    same = "bwd aot+lse+len" if call.ours_dkdv and _aligned(call.ours_dkdv) else "bwd aot"
    for name in extra:
        s = stats.get(name)
        if s is not None:
            print(f"{name:<22}{s.median:.3f} ms ({(s.high - s.low) / s.median * 100:.0f}%), "
                  f"{call.flops_bwd / s.median / 1e9:.0f} TFLOP/s"
                  + (f", / {same} {s.median / stats[same].median:.3f}x" if same in stats else ""))
    if "ours bwd" in stats and "jit bwd" in stats:
        print(f"operator: ours / jit speed {stats['jit bwd'].median / stats['ours bwd'].median:.3f} "
              "(bench/attention.py's bwd/jit)")
    for m in log:
        print("failed:", m)
    return {"call": call.label, "rounds": rounds, "ours_dkdv": call.ours_dkdv, "timings": rows, "errors": log}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", action="store_true", help="CPU: specialisation diff and tile-loop SASS per mode")
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=128, choices=[64, 128])
    ap.add_argument("--causal", type=int, default=None, choices=[0, 1, 2],
                    help="mask mode; default: what the operator runs causal=True on with the gputest images "
                    "(mode 1 for fp16 D=128, the only one they hold; mode 2, tried first, for bf16)")
    ap.add_argument("--dtype", nargs="*", default=["fp16", "bf16"], choices=["fp16", "bf16"])
    ap.add_argument("--images", default=None, help="GPU: also time the operator's backward on these images "
                    "('ours bwd', the runtime's launcher) and through the JIT ('jit bwd'), as bench/attention.py")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--json", default=None, help="write the results here (also $OUT/bwd-specialization.json)")
    args = ap.parse_args()
    results = []
    for dtype in args.dtype:
        causal = args.causal if args.causal is not None else {"fp16": 1, "bf16": 2}[dtype]
        call = Call(args.b, args.h, args.n, args.d, causal, dtype)
        precompile(call, args.workers if not args.sass else min(args.workers, 2))
        results.append(sass_report(call) if args.sass
                       else time_modes(call, args.rounds, args.seed, args.images, args.workers))
    outputs = [Path(args.json)] if args.json else []
    if os.environ.get("OUT"):
        outputs.append(Path(os.environ["OUT"], "bwd-specialization.json"))
    for path in outputs:
        path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
