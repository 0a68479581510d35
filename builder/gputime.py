"""How a GPU call is timed, for ``python -m builder tune`` and the benchmarks in ``bench/``.

:func:`time_rounds` times several *contenders* (name → callable) the same way:

1. **Calibration** (also the warmup of every contender): each runs ``warmup`` times, then one
   timed call fixes how many calls a round gives it (``budget_ms`` worth, within
   ``[min_calls, max_calls]``).
2. **Rounds.** Each round runs every contender once, in an order that changes from round to
   round: shuffled with a seeded generator (``order="shuffle"``, reproducible from ``seed``) or
   alternately forward and reversed (``"alternate"``). A contender runs one untimed call, then
   its calls back to back, each between its own pair of CUDA events; the round's value is the
   median of those calls. GPUs slow down as they warm (clocks fall under sustained load), so a
   contender always timed first or last would read faster or slower than the same kernel
   elsewhere in the round; changing the order gives every contender the same mix.
3. **Result** per contender: the median over rounds, and their min and max (:class:`Stats`).

Back-to-back calls keep the GPU's queue ahead of the host, so host-side cost (Python, checks,
launch) counts only where it exceeds the kernel's time, as in a training loop; a per-call event
pair still gives one sample per call. ``flush_l2=True`` zeroes a buffer of twice the L2 size
before every call (outside its events), for cold-cache numbers.

The loop is written against a small :class:`Clock` so that its logic is tested on the CPU
(tests/builder/test_tuning.py); :class:`CudaClock` is the real one (torch, imported when used).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

ORDERS = ("shuffle", "alternate")


@dataclass(frozen=True)
class Stats:
    """A contender's time in milliseconds: median over rounds, min and max over rounds, and the
    rounds' values themselves."""

    median: float
    low: float
    high: float
    rounds: tuple[float, ...]

    def to_json(self) -> dict:
        return {"median_ms": self.median, "min_ms": self.low, "max_ms": self.high, "rounds_ms": list(self.rounds)}


def summarize(values: Sequence[float]) -> Stats:
    """:class:`Stats` of the rounds' values (at least one)."""
    if not values:
        raise ValueError("no values to summarize")
    return Stats(statistics.median(values), min(values), max(values), tuple(values))


def round_order(names: Sequence[str], round_index: int, seed: int = 0, order: str = "shuffle") -> list[str]:
    """The order of the contenders in round ``round_index``: a seeded shuffle, or the given order
    on even rounds and its reverse on odd ones."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    names = list(names)
    if order == "alternate":
        return names if round_index % 2 == 0 else names[::-1]
    rng = random.Random(seed * 1_000_003 + round_index)
    rng.shuffle(names)
    return names


class Clock(Protocol):
    def calls(self, fn: Callable[[], Any], n: int, flush: bool) -> list[float]:
        """Run ``fn`` ``n`` times back to back; the milliseconds of each call."""

    def sync(self) -> None:
        """Wait for the device."""


class CudaClock:
    """CUDA events around each call (torch's current stream); an optional L2 flush before each."""

    def __init__(self, flush_l2: bool = False) -> None:
        import torch

        self.torch = torch
        self.flush_buffer = None
        if flush_l2:
            l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or 64 << 20
            self.flush_buffer = torch.empty(2 * l2, dtype=torch.int8, device="cuda")

    def calls(self, fn: Callable[[], Any], n: int, flush: bool) -> list[float]:
        torch = self.torch
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            if flush and self.flush_buffer is not None:
                self.flush_buffer.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    def sync(self) -> None:
        self.torch.cuda.synchronize()


def time_rounds(contenders: Mapping[str, Callable[[], Any]], *, rounds: int = 5, seed: int = 0,
                order: str = "shuffle", budget_ms: float = 25.0, min_calls: int = 3, max_calls: int = 50,
                warmup: int = 2, flush_l2: bool = False, clock: Clock | None = None,
                log: Callable[[str], None] | None = None) -> dict[str, Stats]:
    """Time every contender in ``rounds`` rounds of changing order (see the module docs).

    Returns name → :class:`Stats` (milliseconds per call). A contender that raises is reported
    through ``log`` and left out of the result.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    clock = clock or CudaClock(flush_l2)
    alive = dict(contenders)
    calls: dict[str, int] = {}
    for name in round_order(list(alive), 0, seed, order):
        try:
            clock.calls(alive[name], warmup, False)
            first = min(clock.calls(alive[name], 1, flush_l2))
        except Exception as exc:  # noqa: BLE001 - one failing contender must not end the run
            if log:
                log(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
            del alive[name]
            continue
        calls[name] = max(min_calls, min(max_calls, int(budget_ms / max(first, 1e-3))))
    samples: dict[str, list[float]] = {name: [] for name in alive}
    for r in range(rounds):
        for name in round_order(list(alive), r, seed, order):
            clock.calls(alive[name], 1, False)
            samples[name].append(statistics.median(clock.calls(alive[name], calls[name], flush_l2)))
    return {name: summarize(values) for name, values in samples.items()}
