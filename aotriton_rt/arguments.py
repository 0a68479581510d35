"""How arguments become a launch: the per-variant packer (the rule language: :mod:`.rules`).

Everything that can be precomputed from the catalog is, once per variant: the ``struct`` format
of the argument buffer (natural alignment, the two hidden scratch pointers last), which
arguments are pointers and what alignment they promise, the range of each scalar, and the grid
and check expressions compiled to plain Python functions. A launch then costs one pack into the
launcher's buffer and one driver call.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Sequence
from typing import Any

from .catalog import SCALAR_TYPES, Arg, Variant
from .errors import ArgumentError, CatalogError
from .rules import (  # noqa: F401 - re-exported: the rule language's public names
    CUDA_GRID,
    INT_RANGES,
    MAX_RULE_CHARS,
    MAX_RULE_NODES,
    check_rule,
    compile_expr,
    compile_grid,
    grid_limits,
)


class Packer:
    """The precomputed facts of one variant's argument list."""

    def __init__(self, variant: Variant, backend: str | None = None) -> None:
        self.variant = variant
        args = variant.args + variant.hidden_args
        fmt = ["<"]
        end = 0
        for a in args:
            if a.offset > end:
                fmt.append(f"{a.offset - end}x")
            fmt.append("Q" if a.is_pointer else SCALAR_TYPES[a.type][1])
            end = a.offset + a.size
        if variant.param_size > end:
            fmt.append(f"{variant.param_size - end}x")
        self.struct = struct.Struct("".join(fmt))
        if self.struct.size != variant.param_size:
            raise CatalogError(f"variant {variant.key[:16]}: argument layout packs to "
                               f"{self.struct.size} bytes, catalog says param_size {variant.param_size}")
        names = [a.name for a in variant.args]
        self.names = names
        #: The largest grid each dimension may have on this variant's backend.
        self.grid_limits = grid_limits(backend or variant.target.backend, variant.num_threads,
                                       variant.cluster_dims)
        #: One function of the arguments returning the range-checked (gx, gy, gz) tuple.
        self.grid_fn = compile_grid(variant.grid, names, variant.params, f"grid rule of {variant.kernel}",
                                    self.grid_limits, types={a.name: a.type for a in variant.args})
        self.checks = tuple((c, compile_expr(c, names, variant.params, f"check of {variant.kernel}"))
                            for c in variant.checks)

    def grid_for(self, values: Sequence[Any]) -> tuple[int, int, int]:
        return self.grid_fn(*values)

    def run_checks(self, values: Sequence[Any]) -> None:
        for text, fn in self.checks:
            if not fn(*values):
                shown = ", ".join(f"{n}={v}" for n, v in zip(self.names, values)
                                  if n in text) or "the arguments"
                params = ", ".join(f"{k}={v}" for k, v in self.variant.params.items() if k in text)
                raise ArgumentError(f"{self.variant.kernel}: {shown} violates `{text}` of this "
                                    f"variant ({params}); choose a variant whose parameters fit")


def _not_a_scalar(value: Any) -> str:
    """Why ``value`` is not a scalar (an array of one or more dimensions), or ""."""
    shape = getattr(value, "shape", ())
    return f" of shape {tuple(shape)!r}"[:100] if isinstance(shape, tuple) and shape else ""


def scalar_checker(arg: Arg) -> Callable[[Any], Any]:
    """A converter that returns the packed value of a scalar or raises ArgumentError.

    This is the launch's slow path (the generated code calls it only for values that are not a
    plain in-range int or float), so it may take its time: arrays of one or more dimensions
    (``np.array([n])``) and number protocols that fail or answer the wrong type are refused.
    """
    name, t = arg.name, arg.type
    if t in ("fp32", "fp64"):
        def to_float(value: Any) -> float:
            if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
                raise ArgumentError(f"argument {name} ({t}) must be a real number, got {type(value).__name__}")
            shape = _not_a_scalar(value)
            if shape:
                raise ArgumentError(f"argument {name} ({t}) must be a real number, got {type(value).__name__}"
                                    f"{shape}; pass a Python float or a 0-d array (float(a[0]))")
            try:
                return float(value)
            except Exception as e:  # noqa: BLE001 - any failure of the protocol is the caller's value
                raise ArgumentError(f"argument {name} ({t}) must be a real number, got {type(value).__name__} "
                                    f"whose __float__() failed: {type(e).__name__}: {e}"[:300]) from None
        return to_float
    lo, hi = INT_RANGES[t]

    def to_int(value: Any) -> int:
        if isinstance(value, (float, bool, str, bytes)) or not hasattr(value, "__index__"):
            raise ArgumentError(f"argument {name} ({t}) must be an integer, got {type(value).__name__}"
                                f" {value!r}"[:200])
        shape = _not_a_scalar(value)
        if shape:
            raise ArgumentError(f"argument {name} ({t}) must be an integer, got {type(value).__name__}{shape}; "
                                "pass a Python int or a 0-d array (int(a[0]))")
        try:
            v = int(operator.index(value))  # checks that __index__ answered an int
        except Exception as e:  # noqa: BLE001 - any failure of the protocol is the caller's value
            raise ArgumentError(f"argument {name} ({t}) must be an integer, got {type(value).__name__} whose "
                                f"__index__() failed: {type(e).__name__}: {e}"[:300]) from None
        if not lo <= v <= hi:
            raise ArgumentError(f"argument {name} ({t}) = {v} is out of range [{lo}, {hi}]")
        return v
    return to_int
