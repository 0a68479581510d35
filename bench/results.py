"""Each product benchmark's own JSON turned into the suite's ``ratios`` (see :mod:`bench.common`).

One function per benchmark, the only place that knows the scripts' JSON layouts. Ratios are our
speed over a peer's measured in the same run (> 1: aotriton_rt is faster): per round where the
script keeps the rounds' times (the rounds pair the contenders), else from median/min/max times
(:func:`bench.common.bounds_ratio`), else medians only (min = max = median).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.common import OURS, bounds_ratio, contender, paired_ratio, ratio_entry


def _median_only(x: float) -> dict[str, float]:
    return {"median": x, "min": x, "max": x}


def attention(raw: dict) -> list[dict]:
    from bench.attention import RATIOS  # imports torch: only when an attention result is read

    out = []
    for row in raw.get("rows", []):
        cs = row.get("contenders", {})
        for ours_key, other_key in RATIOS.values():
            if ours_key not in cs or other_key not in cs:
                continue
            ours, peer = cs[ours_key], cs[other_key]
            what = ours_key.split(" ", 1)[1]
            if ours.get("rounds_ms") and peer.get("rounds_ms"):
                stats = paired_ratio(peer["rounds_ms"], ours["rounds_ms"])
            else:
                stats = bounds_ratio(*({k: s[f"{k}_ms"] for k in ("median", "min", "max")} for s in (peer, ours)))
            out.append(ratio_entry(f"{row['shape']} {what}", contender(other_key.split(" ", 1)[0]), stats))
    return out


def attention_jit(raw: dict) -> list[dict]:
    out = []
    for row in raw.get("table", []):
        rounds = row.get("rounds_ms", {})
        for what in ("fwd", "bwd"):
            ours_key = f"ours_{what}"
            for peer in ("flash", "cudnn"):
                key = f"{peer}_{what}"
                if not row.get(ours_key) or not row.get(key):
                    continue
                if rounds.get(ours_key) and rounds.get(key):
                    stats = paired_ratio(rounds[key], rounds[ours_key])
                else:
                    stats = _median_only(row[ours_key] / row[key])  # TFLOP/s medians
                out.append(ratio_entry(f"{row['shape']} {what}", contender(peer), stats, ours=f"{OURS} (Triton JIT)"))
    return out


def decode(raw: dict) -> list[dict]:
    out = []
    for row in raw.get("rows", []):
        graph = row.get("graph", {})
        ours = graph.get("ours")
        if not ours:
            continue
        label = f"B{row['B']} S{row['cache']} {row['gqa']}:1"
        for name, s in graph.items():
            if not name.startswith("sdpa"):
                continue
            if ours.get("runs") and s.get("runs"):
                stats = paired_ratio(s["runs"], ours["runs"])
            else:
                stats = _median_only(s["median_us"] / ours["median_us"])
            out.append(ratio_entry(label, contender(name), stats))
    return out


def host_cost(raw: dict) -> list[dict]:
    out = []
    groups = [("forward (1,1,64,64) fp16", raw.get("forward", {}), "aotriton_rt.attention"),
              ("fwd+bwd autograd", raw.get("train", {}), "aotriton_rt autograd fwd+bwd"),
              ("decode step wall", raw.get("decode", {}).get("wall", {}), "aotriton_rt decode")]
    for label, group, ours_key in groups:
        if ours_key not in group:
            continue
        for name, s in group.items():
            if name.startswith("SDPA"):
                peer = name.removesuffix(" fwd+bwd").removesuffix(" (enable_gqa)")
                peer = peer.replace("SDPA decode", "SDPA default")
                out.append(ratio_entry(label, peer, bounds_ratio(s, group[ours_key])))
    return out


LAUNCH_PEERS = {"triton JIT (same source)": "Triton JIT", "cuda.core launch (same cubin)": "cuda.core",
                "cupy RawKernel (same cubin)": "CuPy RawKernel", "bare ctypes cuLaunchKernel": "ctypes cuLaunchKernel"}


def launch_overhead(raw: dict) -> list[dict]:
    ours = raw.get("aotriton_rt (torch tensors)")
    if not isinstance(ours, float):
        return []
    return [ratio_entry("host µs per launch", peer, _median_only(raw[key] / ours))
            for key, peer in LAUNCH_PEERS.items() if isinstance(raw.get(key), float)]


def jax_jit(raw: list) -> list[dict]:
    out = []
    for row in raw if isinstance(raw, list) else []:
        rounds = row.get("rounds_ms", {})
        if row.get("what") == "forward":
            if rounds.get("ours") and rounds.get("cudnn"):
                stats = paired_ratio(rounds["cudnn"], rounds["ours"])
            else:
                stats = _median_only(row["ratio_ours_over_cudnn"])
            out.append(ratio_entry(f"{row['shape']} fwd", "JAX cuDNN", stats, ours=f"{OURS}.jax"))
        elif row.get("what") == "step":
            if rounds.get("jit") and rounds.get("eager"):
                stats = paired_ratio(rounds["eager"], rounds["jit"])
            else:
                stats = _median_only(row["eager_ms"] / row["jit_ms"])
            out.append(ratio_entry(f"{row['shape']} fwd+bwd", f"{OURS} eager (torch)", stats, ours=f"{OURS}.jax jit"))
    return out


def build_cost(raw: Any) -> list[dict]:
    return []  # a cost estimate, no peers


EXTRACTORS: dict[str, Callable[[Any], list[dict]]] = {
    "attention": attention, "attention_jit": attention_jit, "decode": decode, "host_cost": host_cost,
    "launch_overhead": launch_overhead, "jax_jit": jax_jit, "build_cost": build_cost,
}


def ratios_of(name: str, raw: Any) -> tuple[list[dict], str | None]:
    """The suite's ratios of benchmark ``name``'s JSON, or ([], why not)."""
    try:
        return EXTRACTORS[name](raw), None
    except (ImportError, KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError) as exc:
        return [], f"ratios not read from {name}'s JSON: {type(exc).__name__}: {exc}"
