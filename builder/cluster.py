"""Running a build's compiles as Ray tasks, on this machine or on a Ray cluster.

``python -m builder build --executor ray [--address ADDR]``. Ray is imported here only, and only
when this executor runs (``pip install 'aotriton-rt[cluster]'``). Each job is one task that
declares one CPU and runs :func:`builder.compile.run_job`, as a local worker would; a task whose
worker process dies (killed, out of memory, a crash in the compiler, its node lost) is retried by
Ray up to ``retries`` times; results are handed to the build as they finish (``ray.wait``).

The builder keeps as many tasks in flight as the cluster has CPUs, so a task starts about when it
is submitted, and the timeout counts from then, as the local pool's counts from when a worker
takes a job: a task past it is cancelled (its worker killed) and reported, not retried.

Every node compiles with the code it has: run every node from the same commit and Triton
version. A task checks that its kernel source and Triton give the job's key, and fails by name
when they do not, instead of compiling something else under that key.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Sequence

from .build import BuildError
from .pool import Done
from .registry import Job

#: How often the number of tasks in flight follows the cluster's CPUs (nodes joining or leaving).
_RESIZE_S = 10.0


def import_ray():
    """The ``ray`` module, or BuildError naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise BuildError("--executor ray needs Ray, which is not installed: pip install 'aotriton-rt[cluster]' "
                         "(or pip install ray)") from None
    return ray


class RayExecutor:
    """Compile jobs as Ray tasks on the cluster at ``address``.

    Args:
        address: what ``ray.init(address=...)`` takes: ``"auto"`` (the cluster started with
            ``ray start`` on this machine), ``"HOST:6379"`` or ``"ray://HOST:10001"``. None:
            ``RAY_ADDRESS`` if set, else a new Ray instance on this machine, shut down when the
            build ends (never a cluster that ``ray start`` left behind: a stale one would hang).
        retries: how many times Ray runs a task again when its worker dies.

    If Ray is already initialised in this process (``ray.init`` called by the caller), that
    connection is used and left open.
    """

    def __init__(self, address: str | None = None, retries: int = 3) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.address, self.retries = address, retries

    def run(self, jobs: Sequence[Job], timeout: float, done: Done) -> None:
        """Compile every job, calling ``done`` for each as it finishes, fails or times out."""
        ray = import_ray()
        started_here = not ray.is_initialized()
        if started_here:
            ray.init(address=self.address or os.environ.get("RAY_ADDRESS") or "local")
        task = ray.remote(num_cpus=1, max_retries=self.retries)(_compile_task)
        pending = list(reversed(jobs))
        running: dict = {}  # ObjectRef -> (job, submitted)
        try:
            width, resized = _cpus(ray), time.monotonic()
            while pending or running:
                if time.monotonic() - resized > _RESIZE_S:
                    width, resized = _cpus(ray), time.monotonic()
                while pending and len(running) < width:
                    job = pending.pop()
                    running[task.remote(job)] = (job, time.monotonic())
                deadline = min(submitted + timeout for _, submitted in running.values())
                wait = max(0.0, min(deadline - time.monotonic(), _RESIZE_S))
                ready, _ = ray.wait(list(running), num_returns=1, timeout=wait)
                if ready:  # and whatever else finished meanwhile
                    ready, _ = ray.wait(list(running), num_returns=len(running), timeout=0)
                for ref in ready:
                    job, _ = running.pop(ref)
                    try:
                        status, payload = ray.get(ref)
                    except ray.exceptions.RayError as e:
                        status, payload = "error", self._describe(e)
                    done(job, status, payload)
                now = time.monotonic()
                for ref, (job, submitted) in list(running.items()):
                    if now - submitted >= timeout:
                        ray.cancel(ref, force=True)
                        del running[ref]
                        done(job, "error", f"timed out after {timeout:g} s")
        finally:
            for ref in running:
                ray.cancel(ref, force=True)
            if started_here:
                ray.shutdown()

    def _describe(self, error: Exception) -> str:
        """One line for a task that Ray could not complete."""
        name = type(error).__name__
        if name in ("WorkerCrashedError", "NodeDiedError", "OutOfMemoryError"):
            attempts = self.retries + 1
            return f"worker died ({name}; {attempts} attempt{'s' if attempts > 1 else ''})"
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        return f"{name}: {first}"[:500]


def _cpus(ray) -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def _compile_task(job: Job) -> tuple[str, object]:
    """One job on a Ray worker: a fresh Triton cache per task (so every compile is real and the
    worker's disk does not fill up over a long build), the source check, then the compile."""
    wrong = _source_differs(job)
    if wrong:
        return "error", wrong
    from .compile import run_job

    with tempfile.TemporaryDirectory(prefix="aotriton-build-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        return run_job(job)


def _source_differs(job: Job) -> str | None:
    """Why this worker would not compile what the build's machine asked for, or None."""
    try:
        import triton

        from .registry import key_of, load_kernels

        kernel = load_kernels(job.package).get(job.kernel)
        if kernel is not None and key_of(job, kernel.fn.cache_key, triton.__version__) == job.key:
            return None
        what = f"no kernel {job.kernel}" if kernel is None else f"another source of {job.kernel} or Triton"
    except Exception as e:  # noqa: BLE001 - reported by name, like a failed compile
        what = f"cannot load kernel {job.kernel} ({type(e).__name__}: {e})"
    return (f"the Ray worker on {socket.gethostname()} has {what} than the machine that started the build: "
            "run every node from the same commit and Triton version")[:500]
