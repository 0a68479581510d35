"""Attention from many threads on many streams at once, against single-stream results.

    python tests/helpers/streams_stress.py --images DIR [--threads 8] [--iters 6]
                                         [--families fwd,bwd,decode,graph,jax]

Every kernel family the sm90 images dispatch runs here: the forward as the images route it and
forced onto each config of the portable (``attn_fwd``, TMA configs included) and the Gluon
(``attn_fwd_sm90``, persistent configs included) kernel; the backward as routed (split, Gluon),
forced onto the portable split kernels, and the atomic scheme; the decode chain on a contiguous
and on a paged cache; the JAX path under ``jax.jit``; and CUDA graphs captured on two streams,
replayed while the same calls run eagerly on other streams. Each thread has its own stream and
runs the cases in its own shuffled order, a batch at a time without synchronising in between,
then compares every output with the one-stream result: bitwise (the forward, the split backward,
decode, and the atomic scheme's dK/dV are deterministic; the atomic dQ is compared within 1e-2).

Prints one line per mismatch and a summary; exits 1 when any output differed, 0 otherwise.
Run with ``PYTHONPATH`` at another checkout of ``aotriton_rt`` to test that one (the forced
views come from this checkout's ``builder``).
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Case:
    name: str
    run: Callable[[], tuple]
    exact: tuple[bool, ...] = ()   # per output: bitwise (True) or within 1e-2 (False); default all exact


def _rand(torch: Any, shape: tuple, dtype: Any, seed: int) -> Any:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", dtype=dtype, generator=gen)


def forward_cases(torch: Any, aotriton_rt: Any, lib: Any) -> list[Case]:
    from builder.tune import forced_config

    shapes = [(1, 8, 2048, 128, True), (2, 8, 333, 128, True), (1, 2, 1000, 64, True),
              (2, 4, 512, 128, False), (1, 1, 64, 64, False), (2, 4, 5, 64, True), (4, 16, 1024, 128, True)]
    views: list[tuple[str, Any]] = [("routed", lib)]
    for kernel in ("attn_fwd", "attn_fwd_sm90"):
        for index in sorted({v.config.index for v in lib.variants_of(kernel)}):
            views.append((f"{kernel}#{index}", forced_config(lib, kernel, index)))
    cases = []
    for dtype_name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for i, (b, h, n, d, causal) in enumerate(shapes):
            q, k, v = (_rand(torch, (b, h, n, d), dtype, 10 * i + j) for j in range(3))
            for label, view in views:
                def run(q=q, k=k, v=v, causal=causal, view=view) -> tuple:
                    return aotriton_rt.attention(q, k, v, causal=causal, library=view)

                cases.append(Case(f"fwd {label} {dtype_name} {(b, h, n, d)} causal={causal}", run))
    return cases


def backward_cases(torch: Any, aotriton_rt: Any, lib: Any) -> list[Case]:
    from builder.tune import forced_split

    shapes = [(2, 4, 1000, 128, True), (1, 8, 2048, 128, False), (2, 4, 777, 64, True), (1, 2, 4096, 64, False),
              (3, 2, 33, 128, False)]
    views = [("routed", lib, {}), ("portable split", forced_split(lib, "attn_bwd_dkdv", "attn_bwd_dq"), {}),
             ("gluon split", forced_split(lib, "attn_bwd_dkdv_sm90", "attn_bwd_dq_sm90"), {}),
             ("atomic", lib, {"scheme": "atomic"})]
    cases = []
    for i, (b, h, n, d, causal) in enumerate(shapes):
        q, k, v, do = (_rand(torch, (b, h, n, d), torch.bfloat16, 100 + 10 * i + j) for j in range(4))
        out, lse = aotriton_rt.attention(q, k, v, causal=causal, library=lib)
        for label, view, extra in views:
            def run(q=q, k=k, v=v, do=do, out=out, lse=lse, causal=causal, view=view, extra=extra) -> tuple:
                options = extra or {"deterministic": True}
                dq, dk, dv, _ = aotriton_rt.attention_backward(do, q, k, v, out, lse, causal=causal, library=view,
                                                               **options)
                return dq, dk, dv

            exact = (False, True, True) if extra else ()
            cases.append(Case(f"bwd {label} bf16 {(b, h, n, d)} causal={causal}", run, exact))
    return cases


def decode_cases(torch: Any, aotriton_rt: Any, lib: Any) -> list[Case]:
    b, hq, hk, d, cache, page = 8, 32, 8, 128, 4096, 64
    q = _rand(torch, (b, 1, hq, d), torch.bfloat16, 7)
    kc, vc = (_rand(torch, (b, cache, hk, d), torch.bfloat16, s) for s in (8, 9))
    lens = torch.randint(1, cache, (b,), device="cuda", dtype=torch.int32, generator=torch.Generator(
        device="cuda").manual_seed(3))
    pages = b * cache // page
    perm = torch.randperm(pages, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    table = perm.to(torch.int32).reshape(b, cache // page)
    kp, vp = (_rand(torch, (pages, page, hk, d), torch.bfloat16, s) for s in (11, 12))

    def contiguous() -> tuple:
        return aotriton_rt.decode_attention(q, kc, vc, cache_seqlens=lens, causal=True, library=lib)

    def paged() -> tuple:
        return aotriton_rt.decode_attention(q, kp, vp, cache_seqlens=lens, block_table=table, causal=True,
                                            library=lib)

    def constant_lengths() -> tuple:  # an int: one lengths array for the process, shared by every stream
        return aotriton_rt.decode_attention(q, kc, vc, cache_seqlens=3000, library=lib)

    return [Case("decode contiguous bf16", contiguous), Case("decode paged bf16", paged),
            Case("decode int lengths bf16", constant_lengths)]


def _outputs(result: Any) -> tuple:
    return tuple(x for x in (result if isinstance(result, tuple) else (result,)) if x is not None)


def _differs(torch: Any, case: Case, got: tuple, want: tuple) -> str | None:
    for i, (g, w) in enumerate(zip(got, want)):
        exact = case.exact[i] if i < len(case.exact) else True
        if exact and not torch.equal(g, w):
            bad = (g != w) & ~(g.isnan() & w.isnan())
            if bad.any():
                return f"output {i}: {int(bad.sum())} of {g.numel()} elements differ"
        if not exact and not torch.allclose(g.float(), w.float(), atol=1e-2, rtol=1e-2):
            return f"output {i}: max difference {(g.float() - w.float()).abs().max().item():.3g}"
    return None


def references(torch: Any, cases: list[Case]) -> tuple[list[Case], list[tuple]]:
    """One-stream results; cases the images cannot run are dropped (and counted)."""
    from aotriton_rt.errors import AotritonError

    kept, refs, dropped = [], [], 0
    for case in cases:
        try:
            out = _outputs(case.run())
        except AotritonError:  # a forced config the images lack for this call
            dropped += 1
            continue
        torch.cuda.synchronize()
        kept.append(case)
        refs.append(tuple(x.clone() for x in out))
    torch.cuda.synchronize()
    print(f"{len(kept)} cases ({dropped} not in these images)", flush=True)
    return kept, refs


def stress(torch: Any, cases: list[Case], refs: list[tuple], threads: int, iters: int, batch: int = 8) -> list[str]:
    """Each thread on its own stream, shuffled cases, ``batch`` calls between synchronisations."""
    mismatches: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def worker(t: int) -> None:
        rng = random.Random(t)
        stream = torch.cuda.Stream()
        order = [i for _ in range(iters) for i in range(len(cases))]
        rng.shuffle(order)
        try:
            start.wait()
            with torch.cuda.stream(stream):
                for lo in range(0, len(order), batch):
                    chunk = order[lo:lo + batch]
                    results = [(i, _outputs(cases[i].run())) for i in chunk]
                    stream.synchronize()
                    for i, got in results:
                        why = _differs(torch, cases[i], got, refs[i])
                        if why:
                            with lock:
                                mismatches.append(f"thread {t}: {cases[i].name}: {why}")
        except Exception as exc:  # noqa: BLE001 - reported: a fault must fail the run, not hang it
            with lock:
                errors.append(f"thread {t}: {type(exc).__name__}: {exc}"[:500])

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return mismatches + errors


def graphs(torch: Any, cases: list[Case], refs: list[tuple], replays: int) -> list[str]:
    """Two graphs captured on two streams, replayed together while the same calls run eagerly."""
    picks = [i for i, c in enumerate(cases) if c.name.startswith(("fwd routed fp16 (1, 8, 2048", "bwd routed"))][:2]
    picks += [i for i, c in enumerate(cases) if c.name.startswith("fwd attn_fwd_sm90#6 bf16 (4, 16")][:1]
    mismatches: list[str] = []
    captured = []
    for i in picks:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            cases[i].run()  # plans built before capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = _outputs(cases[i].run())
        captured.append((i, graph, stream, out))
    torch.cuda.synchronize()
    stop = threading.Event()

    def eager() -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                for i, *_ in captured:
                    cases[i].run()
        stream.synchronize()

    workers = [threading.Thread(target=eager) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        for r in range(replays):
            for _, graph, stream, _ in captured:
                with torch.cuda.stream(stream):
                    graph.replay()
            for i, _, stream, out in captured:
                stream.synchronize()
                why = _differs(torch, cases[i], out, refs[i])
                if why:
                    mismatches.append(f"graph replay {r}: {cases[i].name}: {why}")
    finally:
        stop.set()
        for w in workers:
            w.join()
    print(f"graphs: {len(captured)} captured on {len(captured)} streams, {replays} replays", flush=True)
    return mismatches


def jax_cases(lib: Any, threads: int, iters: int) -> list[str]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import aotriton_rt.jax as ajax

    rng = np.random.default_rng(0)
    calls = []
    for (b, h, n, d, causal) in [(1, 8, 2048, 128, True), (2, 4, 333, 128, True), (2, 4, 512, 64, False)]:
        q, k, v = (jnp.asarray(rng.standard_normal((b, h, n, d)), jnp.bfloat16) for _ in range(3))
        fn = jax.jit(lambda q, k, v, causal=causal: ajax.attention_forward(q, k, v, causal=causal, library=lib)[0])
        calls.append((f"jax fwd {(b, h, n, d)} causal={causal}", fn, (q, k, v)))
    refs = [np.asarray(fn(*a)) for _, fn, a in calls]
    mismatches: list[str] = []
    lock = threading.Lock()

    def worker(t: int) -> None:
        order = [i for _ in range(iters) for i in range(len(calls))]
        random.Random(t).shuffle(order)
        outs = [(i, calls[i][1](*calls[i][2])) for i in order]
        for i, out in outs:
            if not np.array_equal(np.asarray(out), refs[i], equal_nan=True):
                with lock:
                    mismatches.append(f"thread {t}: {calls[i][0]}: differs")

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    print(f"jax: {len(calls)} calls x {iters} x {threads} threads", flush=True)
    return mismatches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", required=True)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--families", default="fwd,bwd,decode,graph,jax")
    args = ap.parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))  # builder, after any PYTHONPATH checkout of aotriton_rt
    import torch

    import aotriton_rt

    print(f"aotriton_rt from {Path(aotriton_rt.__file__).parent}", flush=True)
    families = set(args.families.split(","))
    lib = aotriton_rt.Library(args.images)
    cases: list[Case] = []
    if "fwd" in families or "graph" in families:
        cases += forward_cases(torch, aotriton_rt, lib)
    if "bwd" in families or "graph" in families:
        cases += backward_cases(torch, aotriton_rt, lib)
    if "decode" in families:
        cases += decode_cases(torch, aotriton_rt, lib)
    cases, refs = references(torch, cases)
    bad: list[str] = []
    if families & {"fwd", "bwd", "decode"}:
        bad += stress(torch, cases, refs, args.threads, args.iters)
        print(f"streams: {args.threads} threads x {args.iters} x {len(cases)} calls", flush=True)
    if "graph" in families:
        bad += graphs(torch, cases, refs, args.replays)
    if "jax" in families:
        bad += jax_cases(lib, args.threads, args.iters)
    for line in bad[:50]:
        print("MISMATCH", line)
    print(f"{len(bad)} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
