"""Child processes for the GPU benches that check kernels one at a time: a kernel that faults or
hangs costs its own child, and the parent starts a new one after it (bench/sm90_levers.py,
bench/sm90_bwd.py). Each child appends one JSON line per finished item to a result file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_child(script: str, argv: list[str], timeout: float) -> str | None:
    """Run ``script`` with ``argv`` in a new interpreter; None if it finished, else why not."""
    try:
        proc = subprocess.run([sys.executable, script, *argv], timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    return None if proc.returncode == 0 else f"exit status {proc.returncode}"


def read_lines(path: Path) -> list[dict]:
    """The JSON lines a child wrote to ``path`` (none when it wrote nothing)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_details(name: str, details: dict, log) -> None:
    """Write a bench's details as ``$OUT/<name>`` when OUT is set, and say where."""
    import os

    out = os.environ.get("OUT")
    if out:
        path = Path(out) / name
        path.write_text(json.dumps(details, indent=1, default=str))
        log(f"details: {path}")
