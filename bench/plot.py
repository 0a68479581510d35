"""A bar chart per benchmark from the suite's JSON: our speed over each peer's, per row.

    python -m bench.plot bench-results/attention.json [...]     # writes attention.png beside it

Bars are the median ratio (> 1: aotriton_rt is faster), error bars its min-max, one bar per peer
in each row (shape); the line at 1 is parity. Only ratios measured in the same run are drawn.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Draws ``result['ratios']`` (see :mod:`bench.common`) into the PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = result["ratios"]
    if not entries:
        raise ValueError(f"{result.get('benchmark')}: no ratios to plot")
    rows = list(dict.fromkeys(e["row"] for e in entries))
    peers = list(dict.fromkeys(f"{e['ours']} vs {e['peer']}" for e in entries))
    width = 0.8 / len(peers)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) * max(1, len(peers)) * 0.5 + 2), 4.8))
    for i, peer in enumerate(peers):
        xs, med, lo, hi = [], [], [], []
        for j, row in enumerate(rows):
            e = next((e for e in entries if e["row"] == row and f"{e['ours']} vs {e['peer']}" == peer), None)
            if e is None:
                continue
            xs.append(j - 0.4 + width * (i + 0.5))
            med.append(e["median"])
            lo.append(max(e["median"] - e["min"], 0.0))
            hi.append(max(e["max"] - e["median"], 0.0))
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=peer)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(rows, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speed ratio, ours / peer (> 1: ours faster)")
    title = f"{result.get('benchmark', '')}: median over rounds, min-max bars"
    if result.get("quick"):
        title += " (--quick)"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    for name in argv if argv is not None else sys.argv[1:]:
        src = Path(name)
        print(plot(json.loads(src.read_text()), src.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
