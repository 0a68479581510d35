"""Differential launches: Triton's own launcher and aotriton-rt, against one recording fake.

Triton's HIP and CUDA drivers build their launchers from C (``triton/backends/*/driver.py``)
and open the GPU library they are pointed at: ``TRITON_LIBHIP_PATH`` for HIP (symbols through
``hipGetProcAddress``), ``libcuda.so.1`` by name for CUDA (the fake sits first on
``LD_LIBRARY_PATH``). With the fake answering device queries as the target GPU, ``@triton.jit``
compiles a variant's source with its config and "launches" it (a variant whose divisibility
hints the JIT cannot infer goes through ``triton.compile`` with the builder's hints, then the
same Triton loader and launcher); then aotriton-rt launches the
image the builder made of the same variant, with the same argument values, on the same fake.
The fakes record each launch (kernel, grid, block, dynamic shared memory, stream and the
kernarg bytes the GPU would see, built from the code object's own metadata), so the two
launches can be compared field by field.

Run as ``python -m tests.fakehip.differential IMAGES ARCH JIT_LOG AOT_LOG`` with the fake's
environment in place (``fake_hip_env`` plus ``TRITON_LIBHIP_PATH``, or ``fake_cuda_env``); it
launches every variant of ``ARCH`` in the catalog
both ways, JIT first, and writes a ``{"call": "variant", "key": ...}`` line to each log before
each launch so records can be matched to variants.

The argument values are chosen so that Triton's JIT specializes exactly as the builder
compiled: pointers 16-byte aligned; integers with declared divisibility are multiples of it
and the others odd (never 1, which the JIT would fold into a constant); i64 values are at
least 2**32 and u64 values at least 2**63 so the JIT types them as the catalog does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: Where fake tensors live: far from any real mapping, 4 GiB apart, 256-byte aligned.
POINTER_BASE = 0x7E00_0000_0000
POINTER_STRIDE = 1 << 32
STREAM = 0x5000

# Values that the kernels' run-time checks constrain (see builder/kernels/attention*.py).
# Decode kernels check page sizes in multiples of 16, positive split counts and their head dim
# (``head_dim``: HEAD_DIM as is, at most HEAD_DIM masked; see argument_values); attention kernels
# take causal_align 0 or 1 (1: a non-zero word, so a misplaced one shows), the sinks kernels a
# varlen flag of 0 or 1.
_FIXED_INTS = {"batch": 5, "num_heads_q": 9, "num_heads_k": 3, "seqlen_q": 3, "seqlen_new": 2, "page_size": 32,
               "num_pages": 7, "capacity": 96, "num_splits": 4, "causal_align": 1, "varlen": 1, "seqs": 3,
               "cols": 96}  # V^T columns: whole groups of 32 keys (the key-ordered pre-pass refuses others)
_FIXED_FLOATS = {"dropout_p": 0.25, "sm_scale": 0.125}
_INT_BASE = {"i8": 0, "i16": 0, "i32": 0, "u8": 0, "u16": 0, "u32": 0, "i64": 1 << 32, "u64": 1 << 63}


def argument_values(args: Sequence[Any], params: Mapping[str, Any]) -> list[Any]:
    """The value each argument gets in both launches: an address for pointers (see the module
    docstring), a number for scalars. ``args`` are catalog ``Arg`` objects, ``params`` the
    variant's spec and constexprs."""
    values: list[Any] = []
    for i, a in enumerate(args):
        if a.is_pointer:
            values.append(POINTER_BASE + (i + 1) * POINTER_STRIDE)
        elif a.type.startswith(("fp", "bf")):
            values.append(_FIXED_FLOATS.get(a.name, 0.375 + 0.125 * (i % 4)))
        elif a.name == "head_dim" and "HEAD_DIM" in params:  # decode: the bucket, or one less masked
            values.append(params["HEAD_DIM"] - (1 if params.get("PADDED_D") else 0))
        elif a.name in _FIXED_INTS:  # scaled to the divisibility a variant declares (aligned siblings)
            x = _FIXED_INTS[a.name]
            values.append(x * a.divisibility if a.divisibility > 1 and x % a.divisibility else x)
        else:
            step = a.divisibility if a.divisibility > 1 else 2
            values.append(_INT_BASE[a.type] + step * (3 + 2 * i) + (1 if a.divisibility <= 1 else 0))
    return values


def _jit_infers(a: Any, value: Any) -> bool:
    """Whether Triton's JIT, given ``value`` for the scalar ``a``, specializes it with the builder's
    divisibility hint: 16 exactly where the value is an int divisible by 16 (floats: never)."""
    if not isinstance(value, int):
        return a.divisibility == 1
    return a.divisibility == (16 if value % 16 == 0 else 1)


def evaluate_grid(rule: Sequence[str], values: Mapping[str, Any]) -> tuple[int, int, int]:
    """The grid rule of a variant, evaluated by Python itself (not by aotriton_rt.pack) so the
    reference launch does not share the runtime's expression evaluator. The rules come from
    this repository's own kernel files."""
    env = {"cdiv": lambda a, b: -(-a // b), "min": min, "max": max, "__builtins__": {}}
    return tuple(int(eval(expr, env, dict(values))) for expr in rule)  # noqa: S307 (trusted test input)


def fake_tensor_type():
    """A stand-in for a device tensor: ``data_ptr()`` and a torch dtype, nothing else (not a
    torch.Tensor, so Triton's HIP JIT adds no 2 GiB buffer-range specialization the builder
    does not)."""
    import torch

    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
              "fp64": torch.float64, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32,
              "i64": torch.int64, "u8": torch.uint8, "fp8e4nv": torch.float8_e4m3fn,
              "fp8e4b8": torch.float8_e4m3fnuz}

    class FakeTensor:
        def __init__(self, address: int, type_: str) -> None:
            self.address = address
            self.dtype = dtypes[type_.lstrip("*")]

        def data_ptr(self) -> int:
            return self.address

    return FakeTensor


def _activate_triton_driver(backend: str) -> None:
    """Make Triton's own HIP or CUDA driver active, with device 0 and a fixed stream, without
    a GPU build of torch (which is what would normally pick and feed the driver)."""
    import triton.runtime

    if backend == "hip":
        from triton.backends.amd.driver import HIPDriver as Base
    else:
        from triton.backends.nvidia.driver import CudaDriver as Base

    class Driver(Base):
        def __init__(self) -> None:
            super().__init__()
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None
            self.get_current_stream = lambda device=None: STREAM
            if backend == "cuda":
                self.get_device_capability = lambda device=None: divmod(int(os.environ["FAKECUDA_CC"]), 10)

    triton.runtime.driver.set_active(Driver())


#: The address Triton's allocator hands out for global scratch in the JIT launches.
TRITON_SCRATCH = 0x7D00_0000_0000


def _set_triton_allocator(log: Path) -> None:
    """Global scratch for Triton's launcher (kernels that need it refuse to launch without an
    allocator): a fixed fake address, each request logged as ``{"call": "scratch", "size"}``."""
    import triton

    class Scratch:
        def data_ptr(self) -> int:
            return TRITON_SCRATCH

    def allocate(size: int, align: int, stream: object) -> Scratch:
        with open(log, "a") as f:
            f.write(json.dumps({"call": "scratch", "status": 0, "size": size, "align": align}) + "\n")
        return Scratch()

    triton.set_allocator(allocate)


def _compiled(fn: Any, v: Any, constexprs: dict, options: dict) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget

    from builder.compile import source_class

    types = {a.name: a.type for a in v.args}
    signature = {n: types.get(n, "constexpr") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(a.name),): [["tt.divisibility", a.divisibility]]
             for a in v.args if a.divisibility != 1}
    arch = v.target.arch if v.target.backend == "hip" else int(v.target.arch[2:])
    src = source_class(fn)(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget(v.target.backend, arch, v.target.warp_size), options=options)


def _in_order(fn: Any, v: Any, call: list, constexprs: dict) -> list:
    """Every argument of ``fn`` in order, as CompiledKernel's launcher takes them."""
    runtime = dict(zip((a.name for a in v.args), call))
    return [runtime[n] if n in runtime else constexprs[n] for n in fn.arg_names]


def _mark(log: Path, key: str) -> None:
    with open(log, "a") as f:
        f.write(json.dumps({"call": "variant", "key": key, "status": 0}) + "\n")


def launch_both(images: Path, arch: str, jit_log: Path, aot_log: Path) -> list[str]:
    """Launch every ``arch`` variant of the catalog at ``images`` through Triton's JIT (records
    to ``jit_log``) and through aotriton-rt (``aot_log``); returns the keys in launch order."""
    from aotriton_rt.catalog import Catalog
    from builder.registry import _constexpr_defaults, load_kernels

    catalog = Catalog.load(images)
    variants = [v for v in catalog.variants if v.target.arch == arch]
    backend = variants[0].target.backend
    kernels = load_kernels()
    FakeTensor = fake_tensor_type()
    _activate_triton_driver(backend)

    os.environ["FAKEHIP_LOG" if backend == "hip" else "FAKECUDA_LOG"] = str(jit_log)
    _set_triton_allocator(jit_log)
    for v in variants:
        values = argument_values(v.args, v.params)
        named = {a.name: x for a, x in zip(v.args, values)}
        grid = evaluate_grid(v.grid, {**named, **v.params})
        call = [FakeTensor(x, a.type) if a.is_pointer else x for a, x in zip(v.args, values)]
        # A config may leave out a constexpr whose parameter has a default (the builder takes it).
        constexprs = {**_constexpr_defaults(kernels[v.kernel]), **v.params}
        fn = kernels[v.kernel].fn
        constexprs = {k: c for k, c in constexprs.items() if k in fn.arg_names}
        options = {"num_warps": v.config.num_warps, "num_stages": v.config.num_stages, **v.config.options}
        _mark(jit_log, v.key)
        if all(a.divisibility == 16 if a.is_pointer else _jit_infers(a, x) for a, x in zip(v.args, values)):
            fn[grid](*call, **constexprs, **options)
        else:
            # The JIT only ever infers divisibility 16 (and every fake pointer here is aligned);
            # a variant built with another hint (8 for bias strides, none for index arrays that
            # may be any int32 view), or a fixed value the JIT would read as divisible by 16 where
            # the builder promised nothing (``cols``), goes through triton.compile with the
            # builder's own hints instead, then Triton's own loader and launcher, exactly as a JIT
            # launch would.
            _compiled(fn, v, constexprs, options)[grid](*_in_order(fn, v, call, constexprs), stream=STREAM)

    import aotriton_rt

    os.environ["FAKEHIP_LOG" if backend == "hip" else "FAKECUDA_LOG"] = str(aot_log)
    lib = aotriton_rt.Library(images, backend=backend)
    for v in variants:
        k = lib.kernel(v.kernel, raw_pointers=True, num_warps=v.config.num_warps,
                       num_stages=v.config.num_stages, **v.params)
        _mark(aot_log, v.key)
        k(*argument_values(v.args, v.params), stream=STREAM)
        assert k.variant(0).key == v.key, (k.variant(0).key, v.key)
    return [v.key for v in variants]


def records_by_variant(records: list[dict], launch_calls: Sequence[str], load_call: str) -> dict[str, dict]:
    """Group one log: per variant key, its launch record and the load record of the image that
    the launched function came from (matched through module and function handles)."""
    out: dict[str, dict] = {}
    loads: dict[int, dict] = {}
    functions: dict[int, int] = {}
    key = None
    scratch = 0  # the largest scratch allocation so far: aotriton-rt keeps and grows one buffer
    for r in records:
        call = r["call"]
        if call == "variant":
            key = r["key"]
            out[key] = {}
        elif call in ("scratch", "cuMemAlloc_v2", "hipMalloc") and not r.get("status"):
            scratch = max(scratch, r["size"])
            if call == "scratch" and key is not None:
                out[key]["scratch_needed"] = r["size"]
        elif r.get("status"):
            if key is not None:
                out[key].setdefault("failures", []).append(r)
        elif call.startswith(load_call):
            loads[r["module"]] = r
        elif r.get("function") is not None and r.get("module") is not None:
            functions[r["function"]] = r["module"]
        elif call in launch_calls and key is not None:
            out[key]["launch"] = r
            out[key]["load"] = loads.get(functions.get(r.get("function")))
            out[key]["scratch_capacity"] = scratch
    return out


def compared_fields(launch: dict, load: dict | None) -> dict:
    """The fields of a launch that must be identical between the two launchers. HIP records
    carry the kernarg segment (``kernarg``) and the launch call; CUDA records the parameter
    bank (``params``) and the launch attributes, but not the call: ``cuLaunchKernel`` and
    ``cuLaunchKernelEx`` without attributes are the same launch."""
    fields = {"name": launch["name"], "grid": launch["grid"], "block": launch["block"],
              "shared": launch["shared"], "stream": launch["stream"],
              "image": None if load is None else (load["size"], load["fnv1a64"])}
    if "kernarg" in launch:
        fields.update(call=launch["call"], kernarg=launch["kernarg"])
    else:
        fields.update(attrs=launch["attrs"], kernarg=launch["params"])
    return fields


def explain_kernarg(jit: bytes, aot: bytes, args: Sequence[Any]) -> str:
    """Which arguments differ between two kernarg segments, by catalog name and offset, with
    pointers shown as the argument they point to."""
    lines = []
    names = {POINTER_BASE + (i + 1) * POINTER_STRIDE: a.name for i, a in enumerate(args)}

    def show(raw: bytes, a: Any) -> str:
        value = int.from_bytes(raw, "little")
        return f"&{names[value]}" if a.is_pointer and value in names else f"0x{value:x}"

    for a in args:
        j, o = jit[a.offset:a.offset + a.size], aot[a.offset:a.offset + a.size]
        if j != o:
            lines.append(f"  {a.name} @ {a.offset}+{a.size}: triton {show(j, a)} vs aotriton-rt {show(o, a)}")
    if len(jit) != len(aot):
        lines.append(f"  kernarg size: triton {len(jit)} vs aotriton-rt {len(aot)}")
    return "\n".join(lines) or "  (bytes differ outside the named arguments)"


def sample_jobs(targets: str, build_set: str = "default", per_kernel: int = 1,
                kernels: str | None = None, where: str | None = None) -> list:
    """``per_kernel`` variants of every kernel of ``build_set`` on each of ``targets``, rotating
    through each kernel's variants from one target to the next so that the sample covers
    different specs and configs at the cost of one compile per kernel and target. ``where``
    (``"ALIBI=1"``, comma-separated pairs): only variants whose spec has those values."""
    wanted = dict(pair.split("=") for pair in where.split(",")) if where else {}
    import triton

    from builder.registry import expand, load_kernels, select
    from builder.targets import parse_targets

    chosen = []
    for target in parse_targets(targets):
        # A stable start per target (not its position in the list), so adding a target does not
        # change, and recompile, the sample of the others.
        start = zlib.crc32(target.arch.encode()) * per_kernel
        for kernel in select(load_kernels(), kernels):
            jobs = sorted((j for j in expand(kernel, [target], build_set, triton.__version__)
                           if all(str(j.spec.get(k)) == v for k, v in wanted.items())), key=lambda j: j.label)
            for n in range(min(per_kernel, len(jobs))):
                chosen.append(jobs[(start + n) % len(jobs)])
    return chosen


def build_sample(out: Path, targets: str, build_set: str, per_kernel: int, kernels: str | None,
                 where: str | None = None) -> int:
    """Build ``sample_jobs(...)`` into the image folder ``out`` with the builder; returns the
    number of variants."""
    from builder.build import build, check_triton_version

    jobs = sample_jobs(targets, build_set, per_kernel, kernels, where)
    assert jobs, f"no {build_set} variant of {kernels or 'any kernel'} on {targets} has {where}"
    build(jobs, out, workers=2, timeout=600.0, keep_going=False,
          triton_version=check_triton_version(), quiet=True)
    return len(jobs)


# ---------------------------------------------------------------------------------------------
# The tests' side (test_differential_hip.py, test_differential_cuda.py): run the above in a
# subprocess under a fake's environment and compare the two logs.
# ---------------------------------------------------------------------------------------------

def run_python(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repository root; fails the test with its output when it fails."""
    proc = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc


def compile_env(triton_cache: Path) -> dict[str, str]:
    """The environment of a subprocess that compiles with Triton into the session's cache."""
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path, "TRITON_CACHE_DIR": str(triton_cache),
            "TRITON_DISABLE_LINE_INFO": "1", "TRITON_ALWAYS_COMPILE": "0"}


def hooked_env(directory: Path, source: str) -> dict[str, str]:
    """A ``PYTHONPATH`` whose ``sitecustomize`` runs ``source`` at interpreter start-up, before
    the runner imports aotriton-rt: how a test breaks one launch decision on purpose."""
    hook = Path(directory) / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(source)
    return {"PYTHONPATH": os.pathsep.join(filter(None, (str(hook), str(ROOT), os.environ.get("PYTHONPATH"))))}


def logged_launches(images: Path, arch: str, tmp: Path, env: dict[str, str], launch_calls: Sequence[str],
                    load_call: str) -> tuple[dict, dict]:
    """Run the differential for ``arch`` under ``env`` (the fake's); returns (triton, aotriton-rt)
    records by variant key."""
    jit_log, aot_log = tmp / f"triton-{arch}.jsonl", tmp / f"aotriton-{arch}.jsonl"
    run_python(["-m", "tests.fakehip.differential", str(images), arch, str(jit_log), str(aot_log)], env)
    from tests.helpers.fake_driver import read_log

    return (records_by_variant(read_log(jit_log), launch_calls, load_call),
            records_by_variant(read_log(aot_log), launch_calls, load_call))


def differences(images: Path, arch: str, jit: dict, aot: dict) -> list[str]:
    """Human-readable differences between the two launchers' records, one entry per variant."""
    from aotriton_rt.catalog import Catalog

    catalog = Catalog.load(images)
    problems = []
    for v in (v for v in catalog.variants if v.target.arch == arch):
        j, a = jit.get(v.key, {}), aot.get(v.key, {})
        label = f"{v.kernel} {v.key[:16]}@{arch}"
        if "launch" not in j or "launch" not in a:
            problems.append(f"{label}: no launch recorded (triton: {j.get('failures')}, "
                            f"aotriton-rt: {a.get('failures')})")
            continue
        fj, fa = compared_fields(j["launch"], j["load"]), compared_fields(a["launch"], a["load"])
        if v.hidden_args and v.scratch["global_size"]:
            # Global scratch lives at different addresses in the two processes: both must pass
            # one, and ours must be at least as large as what Triton's launcher asked for.
            at = v.hidden_args[0].offset * 2
            pj, pa = fj["kernarg"][at:at + 16], fa["kernarg"][at:at + 16]
            if int(pj or "0", 16) and int(pa or "0", 16):
                fj["kernarg"] = fj["kernarg"][:at] + "0" * 16 + fj["kernarg"][at + 16:]
                fa["kernarg"] = fa["kernarg"][:at] + "0" * 16 + fa["kernarg"][at + 16:]
            if a.get("scratch_capacity", 0) < j.get("scratch_needed", 0):
                problems.append(f"{label}: aotriton-rt's global scratch holds {a.get('scratch_capacity')} "
                                f"bytes, Triton's launcher asked for {j.get('scratch_needed')}")
        if fj != fa:
            fields = [k for k in fj if fj[k] != fa[k]]
            detail = "\n".join(f"  {k}: triton {fj[k]} vs aotriton-rt {fa[k]}" for k in fields if k != "kernarg")
            if "kernarg" in fields:
                detail += "\n" + explain_kernarg(bytes.fromhex(fj["kernarg"]), bytes.fromhex(fa["kernarg"]),
                                                 v.args + v.hidden_args)
            problems.append(f"{label}: {', '.join(fields)} differ\n{detail}")
        elif "args_size" in a["launch"] and a["launch"]["args_size"] != len(bytes.fromhex(fa["kernarg"])):
            problems.append(f"{label}: aotriton-rt passed {a['launch']['args_size']} argument bytes for a "
                            f"{len(bytes.fromhex(fa['kernarg']))}-byte kernarg segment")
    return problems


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1] == "build":
        out_arg, targets_arg, set_arg, per_arg = sys.argv[2:6]
        print(build_sample(Path(out_arg), targets_arg, set_arg, int(per_arg),
                           sys.argv[6] if len(sys.argv) > 6 else None, sys.argv[7] if len(sys.argv) > 7 else None))
    else:
        images_arg, arch_arg, jit_arg, aot_arg = sys.argv[1:5]
        print(json.dumps(launch_both(Path(images_arg), arch_arg, Path(jit_arg), Path(aot_arg))))
