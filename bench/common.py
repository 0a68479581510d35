"""What the benchmarks share: contender names, shuffled-round timing, summaries, ratios, JSON.

The suite's result file (``python -m bench`` writes one per benchmark, ``bench/plot.py`` reads it)
is the benchmark's own JSON under ``raw`` plus ``ratios``: one entry per (row, peer) giving our
speed over the peer's (> 1: aotriton_rt is faster) as ``median``, ``min`` and ``max``. Contenders
carry the names of :data:`NAMES` there, the same in every benchmark.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: The suite's contender names; the scripts' own keys (``ours``, ``cudnn-train``, ``sdpa:flash``, ...)
#: map to these through :func:`contender`.
OURS = "aotriton_rt"
NAMES = {
    "ours": OURS, "aotriton_rt": OURS, "aot": OURS,
    "cudnn": "SDPA cuDNN", "sdpa:cudnn": "SDPA cuDNN",
    "fa2": "SDPA flash", "flash": "SDPA flash", "sdpa:flash": "SDPA flash",
    "efficient": "SDPA efficient", "sdpa:efficient": "SDPA efficient",
    "math": "SDPA math", "sdpa:math": "SDPA math",
    "default": "SDPA default", "sdpa:default": "SDPA default", "sdpa": "SDPA default",
    "jit": "Triton JIT", "triton": "Triton JIT",
    "portable": "aotriton_rt portable", "base": "aotriton_rt baseline",
    "jax-cudnn": "JAX cuDNN",
}


def contender(key: str) -> str:
    """The suite's name for a script's contender key: ``cudnn-train`` -> ``SDPA cuDNN (train)``,
    ``sdpa:flash`` -> ``SDPA flash``; an unknown key is returned as it is."""
    if key in NAMES:
        return NAMES[key]
    base, _, mode = key.partition("-")
    if base in NAMES and mode in ("inf", "train"):
        return f"{NAMES[base]} ({mode})"
    return key


# ------------------------------------------------------------------------------------------------
# Timing and summaries.
# ------------------------------------------------------------------------------------------------

def round_orders(names: Iterable[str], rounds: int, seed: int = 0, order: str = "shuffle") -> list[list[str]]:
    """The contenders' order in each round: ``shuffle`` (seeded) or ``alternate`` (as given, then
    reversed), so no contender always runs first or after the same neighbour."""
    names = list(names)
    rng = random.Random(seed)
    out = []
    for r in range(rounds):
        if order == "alternate":
            out.append(names if r % 2 == 0 else names[::-1])
        else:
            now = names[:]
            rng.shuffle(now)
            out.append(now)
    return out


def shuffled_rounds(contenders: dict[str, Callable[[], float]], rounds: int, seed: int = 0,
                    order: str = "shuffle") -> dict[str, list[float]]:
    """Every contender measured once per round, the order changing every round; a contender is a
    callable returning its measurement (e.g. µs per call of a timed batch)."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for names in round_orders(contenders, rounds, seed, order):
        for name in names:
            samples[name].append(contenders[name]())
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    """Median, min and max of a contender's per-round samples."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def paired_ratio(peer: list[float], ours: list[float]) -> dict[str, float]:
    """Our speed over a peer's from per-round times measured in the same rounds: peer / ours per
    round, then :func:`summary` of those ratios."""
    return summary([p / o for p, o in zip(peer, ours) if o])


def bounds_ratio(peer: dict[str, float], ours: dict[str, float]) -> dict[str, float]:
    """Our speed over a peer's from time summaries (``median``/``min``/``max``) when the per-round
    times are not kept: the ratio of medians, bounded by the extremes (peer min / our max to peer
    max / our min)."""
    return {"median": peer["median"] / ours["median"], "min": peer["min"] / ours["max"],
            "max": peer["max"] / ours["min"]}


def ratio_entry(row: str, peer: str, stats: dict[str, float], ours: str = OURS) -> dict[str, Any]:
    """One entry of a result's ``ratios``."""
    return {"row": row, "ours": ours, "peer": peer, **{k: float(stats[k]) for k in ("median", "min", "max")}}


def write_json(path: str | Path, data: Any) -> Path:
    """``data`` as indented JSON at ``path``, its folder made first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    return path
