"""What the decode-family GPU benchmarks share (``bench/decode.py``, ``bench/llama.py``,
``bench/prefill.py``): SDPA's backends by name, eager and CUDA-graph timing with shuffled rounds,
their summaries, ``BxS`` argument pairs and paged copies of a cache."""

from __future__ import annotations

import random
import statistics
from typing import Any

import torch

SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")  # math only when the others refuse


def _sdpa_backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def eager_ms(fn: Any, budget_ms: float = 60.0) -> float:
    """ms per call of back-to-back calls between two events (one batch)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(3, min(200, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def graphed(contenders: dict[str, Any], calls: int) -> dict[str, Graphed]:
    """Each contender captured as :class:`Graphed` (``calls`` calls per replay); one that cannot
    be captured (a backend's refusal, or ours) is left to the eager rounds, with a line saying so."""
    import aotriton_rt

    graphs = {}
    for name, fn in contenders.items():
        try:
            graphs[name] = Graphed(fn, calls=calls)
        except (RuntimeError, aotriton_rt.AotritonError) as e:
            print(f"  {name}: no CUDA graph ({str(e)[:80]})")
    return graphs


def timed_rounds(contenders: dict[str, Any], graphs: dict[str, Graphed], rounds: int
                 ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(eager ms, graph-replay ms) per contender and round, the order shuffled (seeded) per round."""
    eager: dict[str, list[float]] = {n: [] for n in contenders}
    graph: dict[str, list[float]] = {n: [] for n in graphs}
    order = list(contenders)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for name in order:
            eager[name].append(eager_ms(contenders[name]))
            if name in graphs:
                graph[name].append(graphs[name].ms())
    return eager, graph


class Graphed:
    """``calls`` invocations of ``fn`` captured in one CUDA graph; ``ms()`` times a replay."""

    def __init__(self, fn: Any, calls: int = 20) -> None:
        self.calls = calls
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            for _ in range(calls):
                self.out = fn()  # the last call's output: what a replay leaves (checked after the timing)
        self.graph.replay()
        torch.cuda.synchronize()

    def ms(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / self.calls


def _stats(values: list[float]) -> dict:
    med = statistics.median(values)
    return {"median_us": med * 1e3, "spread": (max(values) - min(values)) / med if med else 0.0,
            "runs": [v * 1e3 for v in values]}


def parse_pairs(items: list[str], flag: str, example: str) -> list[tuple[int, int]]:
    """``BxS`` strings as (B, S) pairs of positive integers; a malformed one exits naming ``flag``."""
    out = []
    for item in items:
        b, sep, s = item.lower().partition("x")
        if not (sep and b.isdigit() and s.isdigit() and int(b) > 0 and int(s) > 0):
            raise SystemExit(f"{flag}: {item!r} is not BxS (e.g. {example})")
        out.append((int(b), int(s)))
    return out


def paged_copies(kc: Any, vc: Any, pages: list[int], gen: Any) -> dict[int, tuple[Any, Any, Any]]:
    """Per page size dividing the cache length: ``(k_pages, v_pages, block_table)``, a copy of the
    contiguous ``(B, S, Hkv, D)`` caches as ``(B * S / page, page, Hkv, D)`` pages in a shuffled
    order and its int32 ``(B, S / page)`` table."""
    B, S, Hkv, D = kc.shape
    out = {}
    for page in pages:
        if S % page:
            continue
        blocks = S // page
        perm = torch.randperm(B * blocks, device=kc.device, generator=gen)
        kp = torch.empty(B * blocks, page, Hkv, D, device=kc.device, dtype=kc.dtype)
        vp = torch.empty_like(kp)
        kp[perm] = kc.reshape(B * blocks, page, Hkv, D)
        vp[perm] = vc.reshape(B * blocks, page, Hkv, D)
        out[page] = (kp, vp, perm.view(B, blocks).to(torch.int32))
    return out
