"""Running test cases under Triton's CPU interpreter, in subprocesses.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the cases run in a child
process: the test module itself, run as a script with case names as arguments, printing one
JSON object per case. Cases are split over two children (CI has two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_interpreted(script: str | Path, names: list[str]) -> list[dict]:
    """Run ``script`` with ``names`` under the interpreter; its JSON lines, one per name."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script), *names], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(results) != len(names):
        raise RuntimeError(f"interpreter subprocess failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


def run_sharded(script: str | Path, names: list[str], shards: int = 2) -> dict[str, dict]:
    """All ``names`` over ``shards`` children at once; results by case name."""
    parts = [names[i::shards] for i in range(shards)]
    with ThreadPoolExecutor(len(parts)) as pool:
        results = [r for part in pool.map(lambda p: run_interpreted(script, p), parts) for r in part]
    return {r["name"]: r for r in results}
