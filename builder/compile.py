"""Compiling one variant: a Job in, a compressed image and its catalog :class:`Variant` out.

Runs inside workers: the local pool's processes (``pool.py``) or Ray tasks (``cluster.py``), both
through :func:`run_job`. Only this module and the kernel files import triton.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import lzma
import os
import resource
import sys
import time
import traceback
from functools import cache

from aotriton_rt.catalog import IMAGE_FORMATS, Arg, Config, Image, Variant, image_path

from .registry import Job, load_kernels

#: xz preset 9 (AOTriton measured LZMA at ~7% of raw size on its images), without the extreme
#: flag and with the dictionary cut to the input (see :func:`xz`).
XZ_PRESET = 9


def xz(data: bytes) -> bytes:
    """``data`` as an xz stream, preset :data:`XZ_PRESET` with a dictionary no larger than the input.

    A dictionary past the input's size cannot find more matches, but the encoder still
    allocates and clears its match finder for it (preset 9: 64 MiB, 674 MiB of encoder
    memory per call); cut to the input the stream's bytes are the same but for the header's
    dictionary size, and the default set's 870 files compress in about a third of the CPU time.
    The extreme flag (-9e) made them larger, not smaller (7.966 against 7.959 MB). Deterministic.
    """
    dict_size = max(1 << 12, 1 << (max(len(data), 1) - 1).bit_length())
    return lzma.compress(data, format=lzma.FORMAT_XZ,
                         filters=[{"id": lzma.FILTER_LZMA2, "preset": XZ_PRESET, "dict_size": min(dict_size, 1 << 26)}])


def compile_env() -> dict[str, str]:
    """Environment for reproducible compiles: no line info (it embeds absolute source paths), and
    floating-point contraction (a*b+c as one FMA) on, which Triton 3.6 does by default and Triton
    3.9 does only while this variable says so (3.10 turns it off otherwise)."""
    return {"TRITON_DISABLE_LINE_INFO": "1", "TRITON_ALWAYS_COMPILE": "0", "TRITON_DEFAULT_FP_FUSION": "1"}


#: Linux's personality flag that starts the programs a process executes without address-space
#: layout randomisation (``setarch -R``).
ADDR_NO_RANDOMIZE = 0x0040000


@cache
def fixed_layout_for_compilers() -> bool:
    """Make the compilers this process runs from now on (ptxas) start without address-space layout
    randomisation; return whether they will.

    ptxas (CUDA 12.8, Triton 3.6's) schedules some kernels differently from run to run: the
    same PTX of an sm90 Gluon backward variant assembled to one of two binaries, about half the
    time each, and always to the same one with randomisation off, whatever the paths and
    environment. The flag is inherited across ``exec`` and changes nothing in this process's own
    layout. Best effort: a seccomp profile (Docker's default) may refuse the call, and then
    such variants may differ between builds; everything still compiles."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        current = libc.personality(ctypes.c_ulong(0xFFFFFFFF))  # query
        if current == -1:
            return False
        if current & ADDR_NO_RANDOMIZE:
            return True
        return libc.personality(ctypes.c_ulong(current | ADDR_NO_RANDOMIZE)) != -1
    except (OSError, AttributeError):  # a libc without personality(2)
        return False


@cache
def _kernels(package: str):
    return load_kernels(package)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its waited-for children (ptxas, ld.lld)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_compiled_here = False  # whether this worker process has run a job yet


def run_job(job: Job) -> tuple[str, object]:
    """What a worker does with one job: compile it, prove its ABI against the fresh binary, and
    measure what it cost. Returns ``("ok", (variant, xz image, xz PTX or None, cost))`` or
    ``("error", the error's last line)``; never raises, so every failure reaches the build by name.

    ``cost``: CPU seconds of this process and its compiler subprocesses, wall seconds, and whether
    this was the worker's first job (which also paid for importing Triton and the kernels).
    """
    global _compiled_here
    first, _compiled_here = not _compiled_here, True
    try:
        cpu, wall = cpu_seconds(), time.monotonic()
        variant, raw, packed, ptx = compile_job_with_ptx(job)
        from .abi import prove

        prove(variant, raw)
        cost = {"cpu_s": round(cpu_seconds() - cpu, 3), "wall_s": round(time.monotonic() - wall, 3), "first": first}
        return "ok", (variant, packed, ptx, cost)
    except BaseException as e:  # noqa: BLE001 - every failure is reported by name
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        return "error", detail.splitlines()[-1][:500]


def config_of(job: Job) -> Config:
    """The catalog :class:`Config` a compile of ``job`` records."""
    return Config(job.config_index, dict(job.config.constexprs), job.config.num_warps, job.config.num_stages,
                  dict(job.config.options))


def compile_job(job: Job) -> tuple[Variant, bytes, bytes]:
    """Compile ``job``; return (its catalog variant, raw binary, xz binary)."""
    variant, raw, packed, _ = compile_job_with_ptx(job)
    return dataclasses.replace(variant, ptx=None), raw, packed


def compile_job_with_ptx(job: Job) -> tuple[Variant, bytes, bytes, bytes | None]:
    """Compile ``job``; return (its catalog variant, raw, xz, xz PTX or None).

    The variant is the runtime's own :class:`aotriton_rt.catalog.Variant`, with its image
    paths (:func:`aotriton_rt.catalog.image_path`) and digests filled in; it is validated when
    the build puts it into a catalog (:meth:`aotriton_rt.catalog.Catalog.new`).

    CUDA variants also keep their PTX: jaxlib's Triton custom call (``aotriton_rt.jax``) takes
    PTX text and assembles it itself; it cannot load a cubin. HIP needs nothing extra: jaxlib's
    ROCm call reads the HSACO itself from a file path.
    """
    os.environ.update(compile_env())
    fixed_layout_for_compilers()
    import triton

    from .abi import HIDDEN_ARGS, natural_layout
    from .targets import gpu_target

    kernel = _kernels(job.package)[job.kernel]
    names = list(job.signature)
    attrs = {(names.index(n),): [["tt.divisibility", d]] for n, d in job.divisibility.items()}
    src = source_class(kernel.fn)(fn=kernel.fn, signature=dict(job.signature), constexprs=dict(job.constexprs),
                                  attrs=attrs)
    compiled = triton.compile(src, target=gpu_target(job.target), options=job.options())
    md = compiled.metadata
    fmt = IMAGE_FORMATS[job.target.backend]
    raw = compiled.asm[fmt]
    packed = xz(raw)
    ptx_packed = ptx = None
    if job.target.backend == "cuda":
        ptx = compiled.asm["ptx"]
        ptx = ptx.encode() if isinstance(ptx, str) else ptx
        ptx_packed = xz(ptx)

    runtime_args = [n for n in names if job.signature[n] != "constexpr"]
    types = [job.signature[n] for n in runtime_args]
    layout, param_size = natural_layout(types)
    args = tuple(Arg(name, types[i] if i < len(types) else "*i8", offset, size, align,
                     job.divisibility.get(name, 1))
                 for i, (name, (offset, size, align)) in enumerate(zip(runtime_args + list(HIDDEN_ARGS), layout)))
    num_ctas = getattr(md, "num_ctas", 1)

    def image(fmt: str, data: bytes, raw: bytes) -> Image:
        return Image(image_path(job.target, job.kernel, job.key, fmt), fmt, "xz", hashlib.sha256(data).hexdigest(),
                     len(data), hashlib.sha256(raw).hexdigest(), len(raw))

    variant = Variant(
        key=job.key, kernel=job.kernel, symbol=md.name, target=job.target, spec=dict(job.spec),
        config=config_of(job),
        args=args[:len(runtime_args)], hidden_args=args[len(runtime_args):], param_size=param_size,
        scratch={"global_size": getattr(md, "global_scratch_size", 0) or 0,
                 "global_align": getattr(md, "global_scratch_align", 1) or 1,
                 "profile_size": getattr(md, "profile_scratch_size", 0) or 0,
                 "profile_align": getattr(md, "profile_scratch_align", 1) or 1},
        # Warp specialization can change the warp count: the metadata's is the launch's.
        num_warps=md.num_warps, num_ctas=num_ctas, cluster_dims=(num_ctas, 1, 1), shared=md.shared,
        cooperative=bool(getattr(md, "launch_cooperative_grid", False)),
        pdl=bool(getattr(md, "launch_pdl", False)),
        grid=tuple(job.grid), image=image(fmt, packed, raw), triton_version=triton.__version__,
        checks=tuple(job.checks), ptx=image("ptx", ptx_packed, ptx) if ptx_packed is not None else None)
    return variant, raw, packed, ptx_packed


def source_class(fn) -> type:
    """The Triton source wrapper that compiles ``fn``: Gluon kernels (``@gluon.jit``, per-architecture
    kernels with explicit layouts) parse through ``GluonASTSource``, every other kernel through
    ``ASTSource``. Both take the same signature, constexprs and attributes."""
    is_gluon = getattr(fn, "is_gluon", None)
    if callable(is_gluon) and is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource
    from triton.compiler import ASTSource

    return ASTSource
