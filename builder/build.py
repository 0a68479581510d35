"""Building an image folder: parallel, bounded, incremental, reproducible.

Variants whose key is already in the output folder's catalog, with an intact image, are reused;
then those in the compile cache, if one is given (:mod:`builder.cache`), are read from it. The
rest are compiled by an executor, each with a per-job timeout: local worker processes (``-j``,
:mod:`builder.pool`) or Ray tasks (:mod:`builder.cluster`); a job that overruns is killed and
reported as failed by name. Outputs are written atomically and the catalog last, in canonical
form, so two clean builds give identical bytes, whichever executor compiled them and whether or
not they came from the cache.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from aotriton_rt.catalog import CATALOG_FILE, SHARD_FILE, Catalog, Variant, check_image, write_atomic
from aotriton_rt.errors import ImageMismatch

from .cache import BadEntry, CompileCache
from .pool import Done, LocalPool
from .registry import Job

PINNED_TRITON = "3.6.0"


class BuildError(Exception):
    pass


class Executor(Protocol):
    """What compiles a build's jobs: :class:`builder.pool.LocalPool` (the default) or
    :class:`builder.cluster.RayExecutor`. ``run`` calls ``done`` once per job, as each finishes,
    fails or runs past ``timeout`` seconds, and returns when every job has been reported."""

    def run(self, jobs: Sequence[Job], timeout: float, done: Done) -> None: ...


@dataclass
class Summary:
    compiled: int = 0
    reused: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    raw_bytes: int = 0
    packed_bytes: int = 0
    seconds: float = 0.0
    kept: int = 0  # variants of earlier builds kept beside this build's (existing="keep")
    cached: int = 0  # variants read from the compile cache
    discarded: int = 0  # compile-cache entries found bad, compiled again

    def lines(self) -> list[str]:
        ratio = 100.0 * self.packed_bytes / self.raw_bytes if self.raw_bytes else 0.0
        kept = f", kept {self.kept} of earlier builds" if self.kept else ""
        cached = f", from cache {self.cached}" if self.cached or self.discarded else ""
        if self.discarded:
            cached += f" ({self.discarded} bad {'entry' if self.discarded == 1 else 'entries'} compiled again)"
        out = [f"compiled {self.compiled}, reused {self.reused}{cached}, failed {len(self.failed)}{kept}; "
               f"images {self.packed_bytes / 1e6:.2f} MB xz from {self.raw_bytes / 1e6:.2f} MB raw "
               f"({ratio:.1f}%); {self.seconds:.1f} s"]
        out += [f"FAILED {label}: {reason}" for label, reason in self.failed]
        return out


def check_triton_version() -> str:
    import triton

    if triton.__version__ != PINNED_TRITON and not os.environ.get("AOTRITON_BUILDER_ANY_TRITON"):
        raise BuildError(f"the builder is pinned to triton {PINNED_TRITON} but {triton.__version__} "
                         f"is installed: pip install triton=={PINNED_TRITON} "
                         "(or set AOTRITON_BUILDER_ANY_TRITON=1 to build anyway)")
    return triton.__version__


#: What a build does with variants already in the output folder that it would not build.
EXISTING = ("refuse", "keep", "replace")


def _identity(kernel: str, arch: str, spec: dict, config_index: int) -> tuple:
    """What makes two variants the same slot: a rebuild of it (new source, new Triton) replaces it."""
    return kernel, arch, tuple(sorted((k, repr(v)) for k, v in spec.items())), config_index


def _job_identity(job: Job) -> tuple:
    return _identity(job.kernel, job.target.arch, job.spec, job.config_index)


def _variant_identity(v: Variant) -> tuple:
    return _identity(v.kernel, v.target.arch, v.spec, v.config.index)


def _others(previous: dict[str, Variant], jobs: Sequence[Job]) -> dict[str, Variant]:
    """Intact variants of earlier builds in the folder that none of ``jobs`` rebuilds."""
    slots = {_job_identity(j) for j in jobs}
    keys = {j.key for j in jobs}
    return {k: v for k, v in previous.items() if k not in keys and _variant_identity(v) not in slots}


def _describe_others(others: dict[str, Variant]) -> str:
    from collections import Counter

    per = Counter(f"{v.kernel}@{v.target.arch}" for v in others.values())
    shown = ", ".join(f"{k}={n}" for k, n in sorted(per.items())[:12])
    return shown + (f", ... ({len(per)} kernel/target pairs)" if len(per) > 12 else "")


def _previous(out: Path) -> dict[str, Variant]:
    """Variants of an earlier build in ``out`` whose image is still intact, by key."""
    try:
        catalog = Catalog.load(out / CATALOG_FILE)
    except Exception:  # noqa: BLE001 - no or unreadable catalog: nothing to reuse
        return {}
    keep = {}
    for v in catalog.variants:
        if v.target.backend == "cuda" and v.ptx is None:
            continue  # built before the PTX was kept (aotriton_rt.jax needs it): compile again
        if all(_intact(out, image) for image in (v.image, v.ptx) if image is not None):
            keep[v.key] = v
    return keep


def _previous_tuning(out: Path) -> dict[str, list]:
    try:
        return {name: list(rules) for name, rules in Catalog.load(out / CATALOG_FILE).tuning.items()}
    except Exception:  # noqa: BLE001 - no or unreadable catalog: no rules to keep
        return {}


def _intact(out: Path, image) -> bool:
    try:
        check_image(out, image, decompress=False)
    except ImageMismatch:
        return False
    return True


class _Lines:
    """Progress for logs (no terminal): a line at every tenth, with counts and ETA."""

    def __init__(self, total: int) -> None:
        self.total, self.n, self.failed, self.start = total, 0, 0, time.monotonic()

    def update(self, job: Job, ok: bool) -> None:
        self.n += 1
        self.failed += not ok
        if self.n == self.total or self.n % max(1, self.total // 10) == 0:
            spent = time.monotonic() - self.start
            eta = spent / self.n * (self.total - self.n)
            print(f"[{self.n}/{self.total}] failed {self.failed}, {spent:.0f} s, ETA {eta:.0f} s",
                  file=sys.stderr)

    def close(self) -> None:
        pass


class _Bar:
    """Progress on a terminal: a tqdm bar with counts and ETA."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="variant", dynamic_ncols=True, file=sys.stderr)
        self.failed = 0

    def update(self, job: Job, ok: bool) -> None:
        self.failed += not ok
        self.bar.set_postfix_str(f"failed {self.failed}" if self.failed else job.kernel, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _progress(total: int, quiet: bool):
    if quiet or total == 0:
        return None
    if sys.stderr.isatty():
        try:
            return _Bar(total)
        except ImportError:
            pass
    return _Lines(total)


def build(jobs: Sequence[Job], out: Path, *, workers: int, timeout: float, keep_going: bool,
          triton_version: str, quiet: bool = False, existing: str = "refuse", tuning: dict | None = None,
          timings: Path | None = None, executor: Executor | None = None,
          cache: CompileCache | None = None) -> Summary:
    """Compile ``jobs`` into the image folder ``out``, with the ``tuning`` table
    (``registry.tuning_of``; default empty).

    ``executor`` compiles what is neither in ``out`` nor in ``cache``: by default ``workers``
    local processes (:class:`builder.pool.LocalPool`); :class:`builder.cluster.RayExecutor` runs
    the same jobs as Ray tasks. ``cache`` (:class:`builder.cache.CompileCache`): variants are
    read from it before compiling, and each one compiled is stored in it; an entry that fails
    its checks is compiled again (counted in ``Summary.discarded``). The folder written is the
    same bytes whichever executor compiled it and whether or not the cache held it.

    ``timings``: a file to which one JSON line per compiled variant is appended (kernel, target,
    spec, config index, CPU seconds of the worker and its compiler subprocesses, wall seconds,
    image sizes): the cost model of docs/performance.md is summed from such records. A worker's
    first job also pays for importing Triton and the kernels.

    The folder may already hold variants that ``jobs`` do not rebuild (other kernels, targets
    or sets). ``existing`` says what happens to them: ``"refuse"`` (the default) raises
    BuildError before compiling anything, naming them; ``"keep"`` keeps them next to the new
    ones; ``"replace"`` drops them, so the catalog lists exactly ``jobs``. Earlier builds of
    the same slots (same kernel, spec, config and target; e.g. from an edited kernel) are
    always replaced.
    """
    if existing not in EXISTING:
        raise ValueError(f"existing must be one of {', '.join(EXISTING)}, got {existing!r}")
    started = time.monotonic()
    previous = _previous(out)
    others = _others(previous, jobs)
    if others and existing == "refuse":
        raise BuildError(
            f"{out} already holds {len(others)} variants this build would drop ({_describe_others(others)}); "
            "nothing was built. Pass --add to keep them next to the new ones, --replace to drop them, "
            "or build into another folder (--out)")
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary()
    variants: dict[str, Variant] = dict(others) if existing == "keep" else {}
    summary.kept = len(variants)
    todo = []
    for job in jobs:
        if job.key in previous:
            variants[job.key] = previous[job.key]
            summary.reused += 1
        else:
            todo.append(job)
    if cache is not None:
        todo = _from_cache(cache, todo, out, variants, summary, quiet)
    bar = _progress(len(todo), quiet)
    cache_error: list[str] = []
    record = timings.open("a", encoding="utf-8") if timings is not None else None

    def done(job: Job, status: str, payload) -> None:
        if status == "ok":
            variant, packed, ptx, cost = payload
            if record is not None:
                record.write(json.dumps({"key": job.key, "kernel": job.kernel, "arch": job.target.arch,
                                         "spec": job.spec, "config": job.config_index, **cost,
                                         "xz_bytes": len(packed), "raw_bytes": variant.image.raw_size,
                                         "ptx_xz_bytes": len(ptx) if ptx is not None else 0},
                                        sort_keys=True) + "\n")
                record.flush()
            path = out / variant.image.path
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, packed)
            if ptx is not None:
                write_atomic(out / variant.ptx.path, ptx)
            variants[job.key] = variant
            summary.compiled += 1
            if cache is not None:
                try:
                    cache.put(job, variant, packed, ptx)
                except OSError as e:
                    if not cache_error:  # once: the build goes on, it only stores nothing
                        cache_error.append(str(e))
                        print(f"compile cache: cannot store {job.label} in {cache.root}: {e.strerror or e}; "
                              "building on without storing", file=sys.stderr)
        else:
            summary.failed.append((job.label, str(payload)))
            if not quiet:
                print(f"FAILED {job.label}: {payload}", file=sys.stderr)
        if bar is not None:
            bar.update(job, status == "ok")

    try:
        if todo:
            (executor or LocalPool(min(workers, len(todo)))).run(todo, timeout, done)
    finally:
        if record is not None:
            record.close()
    if bar is not None:
        bar.close()
    if summary.failed and not keep_going:
        summary.seconds = time.monotonic() - started
        raise BuildError("\n".join(summary.lines()))

    tuning = dict(tuning or {})
    if existing == "keep":  # the kept variants' rules stay too (each rule once)
        for name, rules in _previous_tuning(out).items():
            have = tuning.setdefault(name, [])
            have.extend(r for r in rules if r not in have)
    catalog = Catalog.new(triton_version, variants.values(), tuning, source=str(out / CATALOG_FILE))
    for v in catalog.variants:
        summary.packed_bytes += v.image.size
        summary.raw_bytes += v.image.raw_size
    written = catalog.write(out)  # the shards, then catalog.json last
    _remove_stale(out, catalog_files(catalog) | written)
    summary.seconds = time.monotonic() - started
    return summary


def _from_cache(cache: CompileCache, jobs: Sequence[Job], out: Path, variants: dict[str, Variant],
                summary: Summary, quiet: bool) -> list[Job]:
    """Write the variants of ``jobs`` that ``cache`` holds into ``out``; return the others."""
    todo = []
    for job in jobs:
        try:
            hit = cache.get(job)
        except BadEntry as e:
            summary.discarded += 1
            if not quiet:
                print(f"compile cache: discarded {e.path}: {e.reason}; compiling {job.label} again", file=sys.stderr)
            hit = None
        if hit is None:
            todo.append(job)
            continue
        path = out / hit.variant.image.path
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, hit.image)
        if hit.ptx is not None:
            write_atomic(out / hit.variant.ptx.path, hit.ptx)
        variants[job.key] = hit.variant
        summary.cached += 1
    return todo


def catalog_files(catalog: Catalog) -> set[str]:
    """Every file a catalog names: each variant's image and, for CUDA, its PTX."""
    return {image.path for v in catalog.variants for image in (v.image, v.ptx) if image is not None}


def _remove_stale(out: Path, keep: set[str]) -> None:
    """Delete image and shard files of earlier builds that the new catalog no longer lists."""
    for backend in ("cuda", "hip"):
        root = out / backend
        if not root.is_dir():
            continue
        for path in [*root.rglob("*.xz"), *root.rglob(SHARD_FILE)]:
            if path.relative_to(out).as_posix() not in keep:
                path.unlink()
        for d in [*sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True), root]:
            if not any(d.iterdir()):
                d.rmdir()


#: How ``prove_folder`` names what :func:`aotriton_rt.catalog.check_image` found wrong.
_MISMATCH = {"sha256": "sha256", "size": "sha256", "raw_sha256": "raw sha256", "raw_size": "raw sha256",
             "decompress": "xz stream"}


def prove_folder(folder: Path) -> int:
    """Re-prove every image of the image folder ``folder``: its digests, then its ABI against
    the catalog (:func:`builder.abi.prove`); returns the number checked. ``python -m builder
    verify`` runs it (the installed-bundle check is :func:`aotriton_rt.download.verify_folder`).

    Raises BuildError for a file that does not match the catalog, AbiError for a binary that
    disagrees with its entry.
    """
    from .abi import prove

    catalog = Catalog.load(folder / CATALOG_FILE)
    for v in catalog.variants:
        try:
            raw = check_image(folder, v.image)
        except ImageMismatch as e:
            what = _MISMATCH.get(e.problem)
            raise BuildError(f"{v.image.path}: {what} does not match the catalog" if what else str(e)) from None
        prove(v, raw)
    return len(catalog.variants)
