"""aotriton_rt.jax under jax.jit: per-step time against the same kernels launched eagerly, and forward
TFLOP/s against ``jax.nn.dot_product_attention(..., implementation="cudnn")``.

1. **Step** (forward + backward, the operator's kernels): ``jit`` is one ``jax.jit`` program of
   ``aotriton_rt.jax.attention_forward`` + ``attention_backward``; ``eager`` is
   ``aotriton_rt.attention`` + ``attention_backward`` on torch tensors holding the same data (the
   runtime's fastest eager path). Ratio jit / eager: the target is at most 1.05.
2. **Forward** at D=128, N=4096 (bf16, B4 H32, causal and full), BSHD arrays read in place:
   ``ours`` (jit) next to ``cudnn`` (jit). Flops 4·B·H·N²·D, halved when causal.

Each number is a median over ``--rounds`` rounds; the contenders' order alternates every round;
each round times ``--iters`` back-to-back calls after a warm-up and divides. The spread printed is
(min-max)/median over the rounds.

    python bench/jax_jit.py                 # ~2 minutes on an H200
    python bench/jax_jit.py --rounds 7 --iters 30
With ``$OUT`` set, the rows are also written to ``$OUT/jax_jit.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/NAME.py`: the checkout on the path (python -m bench.NAME needs none)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch (eager contender) shares the GPU
# XLA's command buffers (CUDA graphs) stay at XLA's default; AOTRITON_BENCH_NO_COMMAND_BUFFERS=1
# turns them off to compare (they once failed to capture our calls: see docs/jax.md).
if os.environ.get("AOTRITON_BENCH_NO_COMMAND_BUFFERS") == "1":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import aotriton_rt  # noqa: E402
import aotriton_rt.jax as aj  # noqa: E402


def timed(fn: Callable[[], Any], sync: Callable[[Any], None], iters: int) -> float:
    """Milliseconds per call of ``iters`` back-to-back calls (after one warm-up call)."""
    sync(fn())
    start = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn()
    sync(out)
    return (time.perf_counter() - start) * 1e3 / iters


def jax_sync(out: Any) -> None:
    jax.block_until_ready(out)


def torch_sync(out: Any) -> None:
    torch.cuda.synchronize()


def rounds(contenders: dict[str, tuple[Callable, Callable]], n: int, iters: int) -> dict[str, list[float]]:
    names = list(contenders)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(n):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn, sync = contenders[name]
            times[name].append(timed(fn, sync, iters))
    return times


def stats(ts: list[float]) -> tuple[float, float]:
    med = statistics.median(ts)
    return med, (max(ts) - min(ts)) / med


def step_case(b: int, h: int, n: int, d: int, causal: bool, args: argparse.Namespace) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(key, (b, h, n, d), jnp.bfloat16) for key in keys)
    opts = {"causal": causal}

    @jax.jit
    def step(q, k, v, do):
        out, lse = aj.attention_forward(q, k, v, **opts)
        return aj.attention_backward(do, q, k, v, out, lse, **opts)[:3]

    tq, tk, tv, tdo = (torch.from_dlpack(x).clone() for x in (q, k, v, do))
    torch.cuda.synchronize()

    def eager():
        out, lse = aotriton_rt.attention(tq, tk, tv, **opts)
        return aotriton_rt.attention_backward(tdo, tq, tk, tv, out, lse, **opts)[:3]

    # Same kernels, same answers (checked once, outside the timing).
    got, want = step(q, k, v, do), eager()
    torch.cuda.synchronize()
    same = all(np.array_equal(np.asarray(g.astype(jnp.float32)), w.float().cpu().numpy()) for g, w in zip(got, want))
    times = rounds({"jit": (lambda: step(q, k, v, do), jax_sync), "eager": (eager, torch_sync)}, args.rounds,
                   args.iters)
    (jit_ms, jit_sp), (eager_ms, eager_sp) = stats(times["jit"]), stats(times["eager"])
    return {"what": "step", "shape": f"bf16 B{b} H{h} N{n} D{d} {'causal' if causal else 'full'}",
            "jit_ms": jit_ms, "eager_ms": eager_ms, "ratio_jit_over_eager": jit_ms / eager_ms,
            "spread_jit": jit_sp, "spread_eager": eager_sp, "identical": same, "rounds_ms": times}


def forward_case(causal: bool, args: argparse.Namespace) -> dict:
    b, h, n, d = 4, 32, 4096, 128
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(key, (b, n, h, d), jnp.bfloat16) for key in keys)
    ours = jax.jit(lambda q, k, v: aj.attention_forward(q, k, v, causal=causal, layout="bshd")[0])
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"))
    contenders = {"ours": (lambda: ours(q, k, v), jax_sync), "cudnn": (lambda: cudnn(q, k, v), jax_sync)}
    times = rounds(contenders, args.rounds, args.iters)
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    row = {"what": "forward", "shape": f"bf16 B{b} H{h} N{n} D{d} {'causal' if causal else 'full'}",
           "rounds_ms": times}
    for name, ts in times.items():
        med, spread = stats(ts)
        row[f"{name}_tflops"] = flops / (med * 1e-3) / 1e12
        row[f"spread_{name}"] = spread
    row["ratio_ours_over_cudnn"] = row["ours_tflops"] / row["cudnn_tflops"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="write the rows here (also $OUT/jax_jit.json when $OUT is set)")
    args = p.parse_args()
    rows = []
    for shape in ((2, 8, 1024, 64), (4, 32, 4096, 128)):
        for causal in (False, True):
            rows.append(step_case(*shape, causal, args))
            print(rows[-1], flush=True)
    for causal in (False, True):
        rows.append(forward_case(causal, args))
        print(rows[-1], flush=True)
    print(f"\naotriton_rt.jax on {jax.devices()[0].device_kind}, medians of {args.rounds} alternating rounds "
          f"x {args.iters} calls")
    print(f"{'step (fwd+bwd)':<34} {'jit ms':>8} {'eager ms':>9} {'jit/eager':>9} {'spread':>12} identical")
    for r in rows:
        if r["what"] == "step":
            print(f"{r['shape']:<34} {r['jit_ms']:8.3f} {r['eager_ms']:9.3f} {r['ratio_jit_over_eager']:9.3f} "
                  f"{r['spread_jit']:5.1%}/{r['spread_eager']:5.1%} {r['identical']}")
    print(f"{'forward TFLOP/s':<34} {'ours':>8} {'cudnn':>9} {'ours/cudnn':>10} {'spread':>12}")
    for r in rows:
        if r["what"] == "forward":
            print(f"{r['shape']:<34} {r['ours_tflops']:8.0f} {r['cudnn_tflops']:9.0f} "
                  f"{r['ratio_ours_over_cudnn']:10.2f} {r['spread_ours']:5.1%}/{r['spread_cudnn']:5.1%}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "jax_jit.json").write_text(json.dumps(rows, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
