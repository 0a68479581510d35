"""How arguments become a launch: the per-variant packer and the grid and check rules.

Everything that can be precomputed from the catalog is, once per variant: the ``struct`` format
of the argument buffer (natural alignment, the two hidden scratch pointers last), which
arguments are pointers and what alignment they promise, the range of each scalar, and the grid
and check expressions compiled to plain Python functions. A launch then costs one pack into the
launcher's buffer and one driver call.
"""

from __future__ import annotations

import ast
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .catalog import SCALAR_TYPES, Arg, Variant
from .errors import ArgumentError, CatalogError

_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.Call, ast.Name,
            ast.Load, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.USub,
            ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq, ast.And, ast.Or, ast.Not)
_FUNCS = {"cdiv": lambda a, b: -(-a // b), "min": min, "max": max}

INT_RANGES = {"i1": (0, 1), "i8": (-2**7, 2**7 - 1), "u8": (0, 2**8 - 1),
           "i16": (-2**15, 2**15 - 1), "u16": (0, 2**16 - 1), "i32": (-2**31, 2**31 - 1),
           "u32": (0, 2**32 - 1), "i64": (-2**63, 2**63 - 1), "u64": (0, 2**64 - 1)}


def compile_expr(text: str, names: Sequence[str], constants: Mapping[str, Any], what: str,
                 allow_tuple: bool = False) -> Callable:
    """Compile a rule like ``cdiv(n, BLOCK)`` into ``f(*values_of(names))``.

    Only arithmetic, comparisons, ``and``/``or``, integer constants and cdiv/min/max are
    allowed; ``constants`` (the variant's compile-time values) are folded in.
    """
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CatalogError(f"{what} {text!r} is not an expression: {e.msg}") from None
    allowed = _ALLOWED + ((ast.Tuple,) if allow_tuple else ())
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            raise CatalogError(f"{what} {text!r} uses {type(node).__name__}, which rules may not")
        if isinstance(node, ast.Call) and (not isinstance(node.func, ast.Name) or node.func.id not in _FUNCS
                                           or node.keywords):
            raise CatalogError(f"{what} {text!r}: only cdiv, min and max may be called")
        if isinstance(node, ast.Constant) and not isinstance(node.value, int):
            raise CatalogError(f"{what} {text!r}: only integer constants are allowed")
        if isinstance(node, ast.Name) and node.id not in _FUNCS and node.id not in names \
                and node.id not in constants:
            raise CatalogError(f"{what} {text!r} names {node.id!r}, which is neither an argument "
                               f"nor a compile-time value")
    env = {"__builtins__": {}, **_FUNCS}
    env.update({k: v for k, v in constants.items() if k not in names})
    args = ", ".join(names)
    return eval(f"lambda {args}: ({text})", env)  # noqa: S307 - validated AST above


class Packer:
    """The precomputed facts of one variant's argument list."""

    def __init__(self, variant: Variant) -> None:
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
        for g in variant.grid:
            compile_expr(g, names, variant.params, f"grid rule of {variant.kernel}")  # validates each
        #: One function of the arguments returning the (gx, gy, gz) tuple.
        self.grid_fn = compile_expr(f"({', '.join(variant.grid)},)", names, variant.params,
                                    f"grid rule of {variant.kernel}", allow_tuple=True)
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


def scalar_checker(arg: Arg) -> Callable[[Any], Any]:
    """A converter that returns the packed value of a scalar or raises ArgumentError."""
    name, t = arg.name, arg.type
    if t in ("fp32", "fp64"):
        def to_float(value: Any) -> float:
            if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
                raise ArgumentError(f"argument {name} ({t}) must be a real number, got {type(value).__name__}")
            return float(value)
        return to_float
    lo, hi = INT_RANGES[t]

    def to_int(value: Any) -> int:
        if isinstance(value, (float, bool, str, bytes)) or not hasattr(value, "__index__"):
            raise ArgumentError(f"argument {name} ({t}) must be an integer, got {type(value).__name__}"
                                f" {value!r}"[:200])
        v = value.__index__()
        if not lo <= v <= hi:
            raise ArgumentError(f"argument {name} ({t}) = {v} is out of range [{lo}, {hi}]")
        return v
    return to_int
