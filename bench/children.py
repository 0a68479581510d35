"""Child processes for the GPU benches that check kernels one at a time: a kernel that faults or
hangs costs its own child, and the parent starts a new one after it (bench/sm90_levers.py,
bench/sm90_bwd.py, bench/sm90_persistent.py). Each child appends one JSON line per finished item to a result file."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
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


def check_one_at_a_time(run: Callable[[int], str | None], total: int, path: Path, *, key: str,
                        failed: Callable[[int], dict], label: Callable[[int], str], log) -> list[dict]:
    """Items 0 .. total-1 checked by child processes that append one JSON line per finished item
    (its number under ``key``) to ``path``: ``run(start)`` runs a child from item ``start`` and
    says why it stopped early (None when it finished). The item a child stopped on is recorded as
    failed (``failed(n)``'s fields beside ``key``, ``ok`` and ``error``; logged as ``label(n)``)
    and a new child carries on after it. Returns every line, the failures included."""
    path.unlink(missing_ok=True)
    start = 0
    while start < total:
        why = run(start)
        done = read_lines(path)
        nxt = max([r[key] for r in done], default=start - 1) + 1
        if why is None and nxt >= total:
            break
        why = why or "the checking process stopped early"
        log(f"[check] {label(nxt)}: {why}; counted as failed")
        with path.open("a") as f:
            f.write(json.dumps({key: nxt, "ok": False, "error": why, **failed(nxt)}) + "\n")
        start = nxt + 1
    return read_lines(path)


def write_details(name: str, details: dict, log) -> None:
    """Write a bench's details as ``$OUT/<name>`` when OUT is set, and say where."""
    import os

    out = os.environ.get("OUT")
    if out:
        path = Path(out) / name
        path.write_text(json.dumps(details, indent=1, default=str))
        log(f"details: {path}")
