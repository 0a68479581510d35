"""Catalog kernels as a JAX primitive: traced, jitted, vmapped, lowered to jaxlib's Triton call.

A call names each kernel argument in catalog order, as the eager :class:`aotriton_rt.Kernel`
does, with three JAX-only forms for pointers: an :class:`Out` (or ``jax.ShapeDtypeStruct``)
is a fresh output, an :class:`Update` is an array the kernel reads and writes (returned as a
new array, XLA aliases the buffer), and ``None`` is a null pointer. Scalars are Python
numbers, fixed at trace time. Outputs come back in argument order.

Everything that can fail is checked while tracing: pointer dtypes against the catalog types,
scalars with the eager path's range checks, then at lowering the variant for the target, its
``checks`` and its grid rule (shapes are static, so the grid is a constant).

XLA hands a custom call its operands first, then its results, and jaxlib gives them to the
kernel's pointer parameters in order. A fresh output that comes before an input in the
kernel's argument list is therefore passed as a zero-filled operand aliased to its result.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from .. import arch as _arch
from ..arguments import Packer, scalar_checker
from ..errors import ArgumentError, KernelNotFound, UnsupportedError
from ..images import read_image
from ..select import select_one
from . import jaxlib_triton

_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64", "i1": "bool",
           "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8", "u16": "uint16",
           "u32": "uint32", "u64": "uint64"}
_GRID_LIMITS = (2**31 - 1, 65535, 65535)


@dataclass(frozen=True)
class Out:
    """A fresh output of ``shape`` and ``dtype``; ``zero=True`` clears it before the kernel runs."""

    shape: tuple[int, ...]
    dtype: Any
    zero: bool = False


@dataclass(frozen=True)
class Update:
    """An array the kernel reads and writes in place; the call returns its new value."""

    array: Any


@dataclass(frozen=True)
class _Call:
    """Static facts of one bound call; hashable by value, so equal calls share compilations."""

    lib: Any
    name: str
    params: tuple
    arch: str | None
    slots: tuple  # per kernel argument: ("in", i) ("out", j) ("null",) ("scalar", value)
    outs: tuple  # per fresh result: (shape, dtype name, zero)
    aliases: tuple  # (operand index, result index)
    order: tuple  # per returned output, in argument order: index into the primitive's results
    grid: tuple | None


kernel_p = Primitive("aotriton_kernel")
kernel_p.multiple_results = True


@kernel_p.def_abstract_eval
def _abstract(*avals: Any, call: _Call) -> list:
    results = [jax.core.ShapedArray(shape, jnp.dtype(dtype)) for shape, dtype, _ in call.outs]
    results += [jax.core.ShapedArray(avals[i].shape, avals[i].dtype) for i, _ in call.aliases]
    return results


@functools.lru_cache(maxsize=512)
def _compiled(call: _Call) -> Any:
    return jax.jit(functools.partial(kernel_p.bind, call=call))


def _impl(*args: Any, call: _Call) -> list:
    # Outside jit: the call as a one-kernel XLA program, compiled once per distinct call.
    return _compiled(call)(*args)


kernel_p.def_impl(_impl)


class JaxKernel:
    """A catalog kernel callable on JAX arrays, under ``jax.jit`` and ``jax.vmap``.

    Example::

        add = aotriton_rt.jax.kernel("add", dtype="fp32")
        z = jax.jit(lambda x, y: add(x, y, Out(x.shape, x.dtype), x.size))(x, y)
    """

    def __init__(self, handle: Any, arch: str | None = None) -> None:
        self.handle = handle
        self.arch = arch
        self.args = handle.candidates[0].args
        self.arg_names = [a.name for a in self.args]
        self._scalars = {a.name: scalar_checker(a) for a in self.args if not a.is_pointer}

    def __repr__(self) -> str:
        return f"<aotriton_rt.jax.JaxKernel {self.handle.name} args=({', '.join(self.arg_names)})>"

    def __call__(self, *args: Any, grid: tuple[int, ...] | None = None) -> Any:
        """Run the kernel; returns its outputs (Out and Update arguments) in argument order,
        a single array when there is one, None when there is none."""
        if len(args) != len(self.args):
            raise ArgumentError(f"{self.handle.name} takes {len(self.args)} arguments "
                                f"({', '.join(self.arg_names)}), got {len(args)}")
        slots, operands, fresh, inouts, returned = [], [], [], [], []
        # Fresh outputs after the last input pointer are true results; earlier ones are operands.
        last_input = max((i for i, (a, v) in enumerate(zip(self.args, args))
                          if a.is_pointer and v is not None and not _is_out(v)), default=-1)
        for i, (a, value) in enumerate(zip(self.args, args)):
            if not a.is_pointer:
                slots.append(("scalar", self._scalar(a, value)))
            elif value is None:
                slots.append(("null",))
            elif _is_out(value):
                shape, dtype, zero = _out_spec(value)
                _check_dtype(a, dtype, self.handle.name)
                if i < last_input:
                    array = jnp.zeros(shape, dtype)
                    slots.append(("in", len(operands)))
                    inouts.append(len(operands))
                    returned.append(("alias", len(operands)))
                    operands.append(array)
                else:
                    slots.append(("out", len(fresh)))
                    returned.append(("fresh", len(fresh)))
                    fresh.append((tuple(shape), jnp.dtype(dtype).name, zero))
            else:
                update = isinstance(value, Update)
                array = value.array if update else value
                if not hasattr(array, "shape") or not hasattr(array, "dtype"):
                    raise ArgumentError(f"argument {a.name} must be a JAX array, Out, Update or None, got "
                                        f"{type(array).__name__}")
                _check_dtype(a, array.dtype, self.handle.name)
                slots.append(("in", len(operands)))
                if update:
                    inouts.append(len(operands))
                    returned.append(("alias", len(operands)))
                operands.append(array)
        aliases = tuple((op, len(fresh) + j) for j, op in enumerate(inouts))
        alias_of = {op: res for op, res in aliases}
        order = tuple(index if kind == "fresh" else alias_of[index] for kind, index in returned)
        if grid is not None:
            grid = _grid(tuple(grid) if isinstance(grid, (tuple, list)) else (grid,))
        h = self.handle
        call = _Call(h.library, h.name, tuple(sorted(h.params.items())), self.arch, tuple(slots), tuple(fresh),
                     aliases, order, grid)
        results = kernel_p.bind(*operands, call=call)
        outs = [results[i] for i in order]
        return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)

    def _scalar(self, a: Any, value: Any) -> Any:
        if isinstance(value, jax.core.Tracer) or isinstance(value, jax.Array):
            raise ArgumentError(f"argument {a.name} ({a.type}) must be a Python number under jax.jit: jaxlib's "
                                "Triton call fixes scalars when the program is compiled (mark it static, e.g. "
                                "jax.jit(f, static_argnums=...))")
        value = self._scalars[a.name](value)
        if a.divisibility > 1 and value % a.divisibility:
            raise ArgumentError(f"argument {a.name} = {value} is not a multiple of {a.divisibility}, which this "
                                "kernel was compiled to assume; choose a variant compiled without that assumption")
        return value


def _is_out(value: Any) -> bool:
    return isinstance(value, (Out, jax.ShapeDtypeStruct))


def _out_spec(value: Any) -> tuple[tuple[int, ...], Any, bool]:
    return tuple(value.shape), value.dtype, bool(getattr(value, "zero", False))


def _check_dtype(a: Any, dtype: Any, kernel: str) -> None:
    want = _DTYPES.get(a.type[1:])
    got = jnp.dtype(dtype).name
    if want is not None and got != want:
        raise ArgumentError(f"{kernel}: argument {a.name} must be a {want} array (catalog type {a.type}), got {got}")


def _grid(grid: tuple) -> tuple[int, int, int]:
    if not 1 <= len(grid) <= 3:
        raise ArgumentError(f"grid must be 1 to 3 integers, got {grid!r}")
    g = [*grid, 1, 1][:3]
    for i, (value, limit) in enumerate(zip(g, _GRID_LIMITS)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            raise ArgumentError(f"grid[{i}] = {value!r} must be an integer in [0, {limit}]")
    return g[0], g[1], g[2]


def kernel(name: str, *, library: Any = None, arch: str | None = None, **params: Any) -> JaxKernel:
    """A JAX handle on catalog kernel ``name``: ``lib.kernel(name, **params)`` for ``jax.jit``.

    Arguments:
        name, params: as for :meth:`aotriton_rt.Library.kernel` (``dtype="fp16"``, ``BLOCK=...``).
        library: the :class:`aotriton_rt.Library` (default: the process-wide one).
        arch: the catalog target to lower for (``"sm90"``, ``"gfx942"``); default: the GPU of the
            lowering platform. Needed to lower without a GPU (``.trace(...).lower(lowering_platforms=...)``).

    Raises KernelNotFound (no such variant), ArgumentError (bad arguments, at trace time),
    UnsupportedError (no jaxlib Triton call for the platform, at lowering time).
    """
    if library is None:
        from ..library import default_library

        library = default_library()
    return JaxKernel(library.kernel(name, **params), arch)


# ---------------------------------------------------------------------------------------------
# Lowering
# ---------------------------------------------------------------------------------------------

_BACKEND = {"cuda": "cuda", "rocm": "hip"}


def _device_arch(platform: str) -> str:
    backend = _BACKEND[platform]
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        devices = []
    if devices:
        cc = getattr(devices[0], "compute_capability", None)
        if isinstance(cc, str) and cc:
            return _arch.normalize(backend, cc)
    if backend == "hip":
        try:
            return _arch.normalize("hip", jaxlib_triton.triton_module().get_arch_details(0))
        except Exception:  # noqa: BLE001 - reported below
            pass
    raise UnsupportedError(f"cannot tell which {platform} GPU to lower for (no {platform} device is visible); "
                           f"pass arch= (e.g. 'sm90' or 'gfx942') to aotriton_rt.jax")


def variant_for(call: _Call, platform: str) -> Any:
    """The catalog variant a call runs on the lowering platform's GPU."""
    if platform not in _BACKEND:
        raise UnsupportedError(f"aotriton_rt.jax kernels run on GPUs (cuda, rocm), not on {platform!r}; "
                               "put the arrays on a GPU (jax.device_put) or jit for a GPU backend")
    backend = _BACKEND[platform]
    handle = call.lib.kernel(call.name, **dict(call.params))
    usable = [v for v in handle.candidates if v.target.backend == backend]
    if not usable:
        raise KernelNotFound(f"{call.name}: these images hold no {backend} variants; build them for a "
                             f"{backend} target (python -m builder build --targets ...)")
    device_arch = call.arch or _device_arch(platform)
    target = _arch.pick_target(backend, device_arch, sorted({v.target.arch for v in usable}))
    return select_one(usable, call.name, dict(call.params), [target])


def lower_call(call: _Call, platform: str) -> tuple[Any, tuple[int, int, int], bytes]:
    """(variant, grid, opaque) of a call: everything the custom call carries. Pure: no GPU."""
    variant = variant_for(call, platform)
    packer = Packer(variant)
    values = []
    params: list[tuple] = []
    for a, slot in zip(variant.args, call.slots):
        kind = slot[0]
        if kind == "scalar":
            values.append(slot[1])
            params.append(("scalar", slot[1], jaxlib_triton.scalar_type(a.type)))
            continue
        values.append(0)
        if kind == "null":
            params.append(("scalar", 0, "u64"))  # a null pointer: 8 zero bytes
        elif kind == "in":
            params.append(("array", 0, a.divisibility if a.divisibility > 1 else 0))
        else:
            shape, dtype, zero = call.outs[slot[1]]
            nbytes = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize if zero else 0
            params.append(("array", nbytes, a.divisibility if a.divisibility > 1 else 0))
    if packer.checks:
        packer.run_checks(values)
    grid = call.grid if call.grid is not None else packer.grid_for(values)
    grid = _grid(tuple(int(g) for g in grid))
    if jaxlib_triton.scratch_bytes(variant, grid):
        # The global scratch, as one more XLA result that only the kernel sees (_lowering).
        align = variant.scratch["global_align"]
        params.append(("array", 0, align if align > 1 else 0))
    if variant.target.backend == "cuda":
        binary = jaxlib_triton.ptx_text(call.lib._folder[variant.key], variant)
    else:
        binary = jaxlib_triton.hsaco_file(read_image(call.lib._folder[variant.key], variant), variant)
    return variant, grid, jaxlib_triton.kernel_call(variant, binary, grid, params)


def _lowering(ctx: Any, *operands: Any, call: _Call) -> Any:
    platform = ctx.module_context.platforms[0]
    variant, grid, opaque = lower_call(call, platform)
    if 0 in grid:
        # No programs: fresh outputs are zeros, updated arrays keep their values.
        def nothing(*ops: Any) -> list:
            return [jnp.zeros(s, d) for s, d, _ in call.outs] + [ops[i] for i, _ in call.aliases]
        return mlir.lower_fun(nothing, multiple_results=True)(ctx, *operands)
    scratch = jaxlib_triton.scratch_bytes(variant, grid)
    if not scratch:
        rule = jax.ffi.ffi_lowering(jaxlib_triton.TARGET, operand_output_aliases=dict(call.aliases),
                                    has_side_effect=False)
        return rule(ctx, *operands, opaque=opaque)
    # The scratch is one more result, which XLA allocates like any other (inside a command buffer
    # too) and the caller never sees. jaxlib hands buffers to array parameters in order, operands
    # then results, so it sits right after the fresh results that parameters consume and before
    # the aliased results that none does (their memory is their operand's).
    fresh = len(call.outs)
    avals = list(ctx.avals_out)
    with_scratch = ctx.replace(avals_out=[*avals[:fresh], jax.core.ShapedArray((scratch,), jnp.uint8),
                                          *avals[fresh:]])
    rule = jax.ffi.ffi_lowering(jaxlib_triton.TARGET, has_side_effect=False,
                                operand_output_aliases={op: res + 1 for op, res in call.aliases})
    results = list(rule(with_scratch, *operands, opaque=opaque))
    return results[:fresh] + results[fresh + 1:]


mlir.register_lowering(kernel_p, _lowering, platform="cuda")
mlir.register_lowering(kernel_p, _lowering, platform="rocm")


def _refuse(ctx: Any, *operands: Any, call: _Call) -> Any:
    variant_for(call, ctx.module_context.platforms[0])  # raises UnsupportedError naming the platform


mlir.register_lowering(kernel_p, _refuse, platform="cpu")


# ---------------------------------------------------------------------------------------------
# vmap: the kernel's grid knows nothing of a batch, so a batched call runs once per element.
# ---------------------------------------------------------------------------------------------

def _batch(args: Any, dims: Any, *, call: _Call) -> tuple[list, list]:
    moved = [jnp.moveaxis(a, d, 0) if d is not None else None for a, d in zip(args, dims)]

    def one(sliced: list) -> list:
        it = iter(sliced)
        ops = [next(it) if m is not None else a for a, m in zip(args, moved)]
        return kernel_p.bind(*ops, call=call)

    results = jax.lax.map(one, [m for m in moved if m is not None])
    return list(results), [0] * len(results)


batching.primitive_batchers[kernel_p] = _batch
