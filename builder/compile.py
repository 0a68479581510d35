"""Compiling one variant: a Job in, a compressed image and its catalog entry out.

Runs inside worker processes (see build.py). Only this module and the kernel files import triton.
"""

from __future__ import annotations

import hashlib
import lzma
import os
from functools import cache

from .registry import Job, load_kernels

#: xz with the extreme preset: AOTriton measured LZMA at ~7% of raw size on its images.
XZ_PRESET = 9 | lzma.PRESET_EXTREME
IMAGE_EXT = {"cuda": "cubin", "hip": "hsaco"}


def compile_env() -> dict[str, str]:
    """Environment for reproducible compiles: no line info (it embeds absolute source paths)."""
    return {"TRITON_DISABLE_LINE_INFO": "1", "TRITON_ALWAYS_COMPILE": "0"}


@cache
def _kernels(package: str):
    return load_kernels(package)


def compile_job(job: Job) -> tuple[dict, bytes, bytes]:
    """Compile ``job``; return (catalog variant without image path, raw binary, xz binary)."""
    variant, raw, packed, _ = compile_job_with_ptx(job)
    variant.pop("ptx", None)
    return variant, raw, packed


def compile_job_with_ptx(job: Job) -> tuple[dict, bytes, bytes, bytes | None]:
    """Compile ``job``; return (catalog variant without image paths, raw, xz, xz PTX or None).

    CUDA variants also keep their PTX: jaxlib's Triton custom call (``aotriton_rt.jax``) takes
    PTX text and assembles it itself; it cannot load a cubin. HIP needs nothing extra: jaxlib's
    ROCm call reads the HSACO itself from a file path.
    """
    os.environ.update(compile_env())
    import triton

    from .abi import HIDDEN_ARGS, natural_layout

    kernel = _kernels(job.package)[job.kernel]
    names = list(job.signature)
    attrs = {(names.index(n),): [["tt.divisibility", d]] for n, d in job.divisibility.items()}
    src = source_class(kernel.fn)(fn=kernel.fn, signature=dict(job.signature), constexprs=dict(job.constexprs),
                                  attrs=attrs)
    compiled = triton.compile(src, target=job.target.gpu_target(), options=job.options())
    md = compiled.metadata
    fmt = IMAGE_EXT[job.target.backend]
    raw = compiled.asm[fmt]
    packed = lzma.compress(raw, format=lzma.FORMAT_XZ, preset=XZ_PRESET)
    ptx_packed = None
    if job.target.backend == "cuda":
        ptx = compiled.asm["ptx"]
        ptx = ptx.encode() if isinstance(ptx, str) else ptx
        ptx_packed = lzma.compress(ptx, format=lzma.FORMAT_XZ, preset=XZ_PRESET)

    runtime_args = [n for n in names if job.signature[n] != "constexpr"]
    types = [job.signature[n] for n in runtime_args]
    layout, param_size = natural_layout(types)
    args = []
    for i, (name, (offset, size, align)) in enumerate(zip(runtime_args + list(HIDDEN_ARGS),
                                                           layout)):
        arg = {"name": name, "type": types[i] if i < len(types) else "*i8", "offset": offset,
               "size": size, "align": align}
        if job.divisibility.get(name, 1) != 1:
            arg["divisibility"] = job.divisibility[name]
        args.append(arg)
    num_ctas = getattr(md, "num_ctas", 1)
    variant = {
        "key": job.key, "kernel": job.kernel, "symbol": md.name,
        "target": job.target.to_json(), "spec": dict(job.spec),
        "config": {"index": job.config_index, "constexprs": dict(job.config.constexprs),
                   "num_warps": job.config.num_warps, "num_stages": job.config.num_stages,
                   "options": dict(job.config.options)},
        "args": args[:len(runtime_args)], "hidden_args": args[len(runtime_args):],
        "param_size": param_size,
        "scratch": {"global_size": getattr(md, "global_scratch_size", 0) or 0,
                    "global_align": getattr(md, "global_scratch_align", 1) or 1,
                    "profile_size": getattr(md, "profile_scratch_size", 0) or 0,
                    "profile_align": getattr(md, "profile_scratch_align", 1) or 1},
        # Warp specialization can change the warp count: the metadata's is the launch's.
        "num_warps": md.num_warps, "num_ctas": num_ctas,
        "cluster_dims": [num_ctas, 1, 1], "shared": md.shared,
        "launch": {"cooperative": bool(getattr(md, "launch_cooperative_grid", False)),
                   "pdl": bool(getattr(md, "launch_pdl", False))},
        "grid": list(job.grid), "checks": list(job.checks),
        "image": {"format": fmt, "compression": "xz",
                  "sha256": hashlib.sha256(packed).hexdigest(), "size": len(packed),
                  "raw_sha256": hashlib.sha256(raw).hexdigest(), "raw_size": len(raw)},
        "triton_version": triton.__version__,
    }
    if ptx_packed is not None:
        variant["ptx"] = {"format": "ptx", "compression": "xz",
                          "sha256": hashlib.sha256(ptx_packed).hexdigest(), "size": len(ptx_packed),
                          "raw_sha256": hashlib.sha256(ptx).hexdigest(), "raw_size": len(ptx)}
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


def image_path(variant: dict) -> str:
    """Relative image path: ``<backend>/<arch>/<kernel>/<kernel>-<key16>.<fmt>.xz``."""
    t = variant["target"]
    return (f"{t['backend']}/{t['arch']}/{variant['kernel']}/"
            f"{variant['kernel']}-{variant['key'][:16]}.{variant['image']['format']}.xz")


def ptx_path(variant: dict) -> str:
    """Relative path of a CUDA variant's PTX, beside its cubin: ``...-<key16>.ptx.xz``."""
    return image_path(variant).removesuffix(f".{variant['image']['format']}.xz") + ".ptx.xz"
