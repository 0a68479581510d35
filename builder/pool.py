"""Running a build's compiles in local worker processes: the default executor (``-j N``).

Each worker is a process started with ``spawn`` (a clean Triton) that compiles one job at a time
(:func:`builder.compile.run_job`). A job that runs past its timeout has its worker killed and
replaced; a worker that dies is reported for the job it held. A job whose compile fails in a
worker that has compiled before is compiled once more in a fresh worker, and only that answer
counts: Triton's compiler can carry state from one compile to the next in a process (3.6's AMD
fp8 conversions failed an assertion in long-lived workers and passed in fresh ones), and a real
error fails twice. The Ray executor
(:mod:`builder.cluster`) offers the same :meth:`LocalPool.run`.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait

from .registry import Job

#: What an executor calls once per job, as its result arrives: (job, "ok" or "error", payload);
#: the payload of "ok" is :func:`builder.compile.run_job`'s, of "error" a one-line reason.
Done = Callable[[Job, str, object], None]


def _worker(conn) -> None:
    from .compile import run_job

    while True:
        job = conn.recv()
        if job is None:
            return
        conn.send(run_job(job))


class LocalPool:
    """``workers`` processes on this machine, each compiling one job at a time, killable on timeout."""

    def __init__(self, workers: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.n = max(1, workers)
        self.idle: list = []

    def _spawn(self):
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker, args=(child,), daemon=True)
        proc.start()
        child.close()
        return proc, parent

    def run(self, jobs: Sequence[Job], timeout: float, done: Done) -> None:
        """Compile every job, calling ``done`` for each as it finishes, fails or times out
        (``timeout`` seconds from when a worker takes it)."""
        pending = list(reversed(jobs))
        busy: dict = {}  # conn -> (proc, job, started)
        used: set = set()  # workers (their pipes) that have compiled a job
        retried: set[str] = set()
        try:
            while pending or busy:
                while pending and len(busy) < self.n:
                    proc, conn = self.idle.pop() if self.idle else self._spawn()
                    job = pending.pop()
                    conn.send(job)
                    busy[conn] = (proc, job, time.monotonic())
                now = time.monotonic()
                deadline = min(started + timeout for _, _, started in busy.values())
                ready = wait(list(busy), timeout=max(0.0, deadline - now))
                for conn in ready:
                    proc, job, _ = busy.pop(conn)
                    try:
                        status, payload = conn.recv()
                    except (EOFError, OSError):
                        status, payload = "error", f"worker died (exit code {proc.exitcode})"
                        proc.join()
                    else:
                        if status != "ok" and conn in used and job.key not in retried:
                            # Again in a fresh worker; this one, its state suspect, is retired.
                            retried.add(job.key)
                            conn.send(None)
                            proc.join(timeout=5)
                            fresh, fresh_conn = self._spawn()
                            fresh_conn.send(job)
                            busy[fresh_conn] = (fresh, job, time.monotonic())
                            continue
                        used.add(conn)
                        self.idle.append((proc, conn))
                    done(job, status, payload)
                now = time.monotonic()
                for conn, (proc, job, started) in list(busy.items()):
                    if now - started >= timeout:
                        proc.kill()
                        proc.join()
                        del busy[conn]
                        done(job, "error", f"timed out after {timeout:g} s")
        finally:
            for _, conn in self.idle:
                conn.send(None)
            for proc, _ in self.idle:
                proc.join(timeout=5)
            for proc, _, _ in busy.values():
                proc.kill()
