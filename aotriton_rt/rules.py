"""The grid and check rule language: a small expression tree, validated and compiled.

A catalog's grid rules (``cdiv(n, BLOCK)``) and checks (``n % BLOCK == 0``) are parsed with
``ast`` into a tree of the few nodes a rule may use, checked against the variant's argument names
and compile-time values, and compiled from our own tokens into a plain Python function: no text
of a catalog is ever compiled. The catalog checks every rule here when it loads; the packer
(:mod:`aotriton_rt.arguments`) compiles them once per variant.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import CatalogError, LaunchError

#: Bounds on a rule's text: real rules are a few dozen characters of a few operators.
MAX_RULE_CHARS = 1000
MAX_RULE_NODES = 200
#: Integer constants (literal or folded compile-time values) must fit in this many bits.
_MAX_CONST_BITS = 64

_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%"}
_COMPARE = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_UNARY = {ast.USub: "-", ast.Not: "not "}
_BOOL = {ast.And: " and ", ast.Or: " or "}
#: Callable name in a rule -> (the name our generated source uses, allowed argument counts).
_CALLS = {"cdiv": ("_cdiv", (2, 2)), "min": ("_min", (2, 8)), "max": ("_max", (2, 8))}
_FUNCS = {"_cdiv": lambda a, b: -(-a // b), "_min": min, "_max": max}

INT_RANGES = {"i1": (0, 1), "i8": (-2**7, 2**7 - 1), "u8": (0, 2**8 - 1),
              "i16": (-2**15, 2**15 - 1), "u16": (0, 2**16 - 1), "i32": (-2**31, 2**31 - 1),
              "u32": (0, 2**32 - 1), "i64": (-2**63, 2**63 - 1), "u64": (0, 2**64 - 1)}


@functools.lru_cache(maxsize=4096)  # thousands of variants share a few dozen rule texts
def _parse_rule(text: str, what: str) -> ast.Expression:
    if not isinstance(text, str) or len(text) > MAX_RULE_CHARS:
        raise CatalogError(f"{what} is longer than {MAX_RULE_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CatalogError(f"{what} {text!r} is not an expression: {e.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise CatalogError(f"{what} {text[:60]!r}... nests too deeply to be a rule") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_RULE_NODES:
        raise CatalogError(f"{what} {text[:60]!r}... has more than {MAX_RULE_NODES} parts")
    return tree


def _const(value: Any, text: str, what: str, name: str = "") -> str:
    """An integer constant, re-printed by us (never the catalog's spelling)."""
    if isinstance(value, bool):
        value = int(value)
    if type(value) is not int:
        of = f"compile-time value {name} = {value!r}" if name else f"constant {value!r}"
        raise CatalogError(f"{what} {text!r}: {of} is not an integer; only integer constants are allowed")
    if value.bit_length() > _MAX_CONST_BITS:
        raise CatalogError(f"{what} {text!r}: constant {value} does not fit in {_MAX_CONST_BITS} bits")
    return str(int(value))


def _emit(node: ast.AST, slots: Mapping[str, int], constants: Mapping[str, Any], text: str, what: str,
          top: bool = False) -> str:
    """Python source for one validated rule node, built only from our own tokens.

    Arguments become placeholders ``a0, a1, ...``, compile-time values and literals are
    re-printed integers, operators and calls come from fixed tables: no text of the catalog
    reaches the compiler.
    """
    def sub(n: ast.AST) -> str:
        return _emit(n, slots, constants, text, what)

    if isinstance(node, ast.Tuple) and top:
        if not 1 <= len(node.elts) <= 3:
            raise CatalogError(f"{what} {text!r} must have 1 to 3 parts")
        return "(" + "".join(sub(e) + ", " for e in node.elts) + ")"
    if isinstance(node, ast.Constant):
        return _const(node.value, text, what)
    if isinstance(node, ast.Name):
        if node.id in slots:
            return f"a{slots[node.id]}"
        if node.id in constants:
            return _const(constants[node.id], text, what, node.id)
        raise CatalogError(f"{what} {text!r} names {node.id!r}, which is neither an argument "
                           f"nor a compile-time value")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        right = sub(node.right)
        if right == "0" and isinstance(node.op, (ast.FloorDiv, ast.Mod)):
            raise CatalogError(f"{what} {text!r} divides by a compile-time zero")
        return f"({sub(node.left)} {_BINARY[type(node.op)]} {right})"
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return f"({_UNARY[type(node.op)]}{sub(node.operand)})"
    if isinstance(node, ast.BoolOp) and type(node.op) in _BOOL:
        return "(" + _BOOL[type(node.op)].join(sub(v) for v in node.values) + ")"
    if isinstance(node, ast.Compare) and all(type(o) in _COMPARE for o in node.ops):
        parts = [sub(node.left)]
        for op, right in zip(node.ops, node.comparators):
            parts += [_COMPARE[type(op)], sub(right)]
        return "(" + " ".join(parts) + ")"
    if isinstance(node, ast.Call):
        fn = node.func.id if isinstance(node.func, ast.Name) else None
        if fn not in _CALLS or node.keywords:
            raise CatalogError(f"{what} {text!r}: only cdiv, min and max may be called")
        name, (lo, hi) = _CALLS[fn]
        if not lo <= len(node.args) <= hi or any(isinstance(a, ast.Starred) for a in node.args):
            raise CatalogError(f"{what} {text!r}: {fn} takes {lo if lo == hi else f'{lo} to {hi}'} arguments")
        args = [sub(a) for a in node.args]
        if fn == "cdiv":
            if args[1] == "0":
                raise CatalogError(f"{what} {text!r} divides by a compile-time zero")
            return f"(-((-{args[0]}) // {args[1]}))"  # inlined: a call costs more than the division
        return f"{name}({', '.join(args)})"
    kind = type(node.op if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.BoolOp)) else node).__name__
    raise CatalogError(f"{what} {text!r} uses {kind}, which rules may not")


class _RuleFailed:
    """Raises the typed error of a rule that cannot be evaluated for some argument values."""

    def __init__(self, text: str, what: str) -> None:
        self.text, self.what = text, what

    def __call__(self) -> None:
        raise LaunchError(f"{self.what} `{self.text}` divides by zero for these arguments; "
                          "check the argument values (a zero size?)")


def _build(body: list[str], nargs: int, env: dict[str, Any]) -> Callable:
    params = ", ".join(f"a{i}" for i in range(nargs))
    source = "\n".join([f"def _rule({params}):", *body])
    namespace = {"__builtins__": {}, "ZeroDivisionError": ZeroDivisionError, **_FUNCS, **env}
    exec(compile(source, "<aotriton_rt rule>", "exec"), namespace)  # noqa: S102 - our tokens only
    return namespace["_rule"]


def _integer_arguments_only(tree: ast.AST, types: Mapping[str, str], text: str, what: str) -> None:
    """Refuse a grid rule naming a float or pointer argument: a float gives a float grid, and a
    pointer's value differs between the direct launch (its address) and a prepared one (0)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in types and types[node.id] not in INT_RANGES:
            raise CatalogError(f"{what} {text!r} uses argument {node.id!r} ({types[node.id]}); a grid rule "
                               "may use only integer scalar arguments and compile-time values")


def check_rule(text: str, names: Sequence[str], constants: Mapping[str, Any], *,
               types: Mapping[str, str] | None = None, what: str = "rule") -> None:
    """Raise CatalogError if ``text`` is not a rule over ``names`` and integer ``constants``;
    with ``types`` (argument name -> catalog type), a grid rule over integer arguments only.

    A rule's validity depends only on the names it uses: whether each is an argument, and the
    value of each compile-time one. The check is cached on exactly that, so the thousands of
    variants of a catalog, which differ in values their rules do not name, share a few dozen
    checks (a catalog shard is read on the first call: this is on that call's path)."""
    used = rule_names(text, what)
    argument = frozenset(n for n in used if n in names)
    folded = tuple((n, constants[n]) for n in used if n not in argument and n in constants)
    named_types = None if types is None else tuple((n, types.get(n)) for n in sorted(argument))
    _check_rule_cached(text, tuple(sorted(argument)), folded, named_types, what)


@functools.lru_cache(maxsize=4096)
def rule_names(text: str, what: str = "rule") -> tuple[str, ...]:
    """The names a rule uses (sorted; called functions' names excluded), from its parsed tree.

    Raises:
        CatalogError: the rule does not parse (see :func:`check_rule`)."""
    tree = _parse_rule(text, what)
    calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return tuple(sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in calls}))


@functools.lru_cache(maxsize=4096)
def _check_rule_cached(text: str, arguments: tuple[str, ...], constants: tuple, types: tuple | None,
                       what: str) -> None:
    tree = _parse_rule(text, what)
    if types is not None:
        _integer_arguments_only(tree, {n: t for n, t in types if t is not None}, text, what)
    _emit(tree.body, {n: i for i, n in enumerate(arguments)}, dict(constants), text, what)


def compile_expr(text: str, names: Sequence[str], constants: Mapping[str, Any], what: str,
                 allow_tuple: bool = False) -> Callable:
    """Compile a rule like ``cdiv(n, BLOCK)`` into ``f(*values_of(names))``.

    Only arithmetic (``+ - * // %``), comparisons, ``and``/``or``/``not``, integer constants and
    cdiv/min/max are allowed; ``constants`` (the variant's compile-time values) are folded in.
    The function is generated from the validated tree with placeholder names, so no text of
    the catalog is ever compiled. Division by zero raises LaunchError naming the rule.

    Raises:
        CatalogError: the rule is not such an expression, is too long, or names something
            that is neither an argument nor an integer compile-time value.
    """
    tree = _parse_rule(text, what)
    if isinstance(tree.body, ast.Tuple) and not allow_tuple:
        raise CatalogError(f"{what} {text!r} uses Tuple, which rules may not")
    slots = {n: i for i, n in enumerate(names)}
    expr = _emit(tree.body, slots, constants, text, what, top=allow_tuple)
    body = ["    try:", f"        return {expr}", "    except ZeroDivisionError:", "        _fail()"]
    return _build(body, len(names), {"_fail": _RuleFailed(text, what)})


def compile_grid(rules: Sequence[str], names: Sequence[str], constants: Mapping[str, Any], what: str,
                 limits: tuple[int, int, int], *, types: Mapping[str, str] | None = None) -> Callable:
    """Compile three grid rules into ``f(*values) -> (gx, gy, gz)`` that refuses out-of-range grids.

    ``limits`` are the largest allowed sizes per dimension (see :func:`grid_limits`); a rule
    giving anything but an ``int`` (a bool or float included), a negative size or one over its
    limit raises LaunchError before any driver call. ``types`` (argument name -> catalog type)
    refuses, with CatalogError, a rule naming a float or pointer argument.
    """
    slots = {n: i for i, n in enumerate(names)}
    trees = [_parse_rule(r, what) for r in rules]
    if types is not None:
        for r, tree in zip(rules, trees):
            _integer_arguments_only(tree, types, r, what)
    exprs = [_emit(tree.body, slots, constants, r, what) for r, tree in zip(rules, trees)]
    limits = tuple(int(x) for x in limits)
    # A dimension whose rule folds to a constant (usually "1") is checked now, not per launch.
    checks = []
    for i, (e, lim) in enumerate(zip(exprs, limits)):
        if re.fullmatch(r"-?\d+", e):
            if not 0 <= int(e) <= lim:
                raise CatalogError(f"{what} {rules[i]!r} is the constant {e}, outside [0, {lim}]")
        else:
            checks.append(f"type(g{i}) is int and 0 <= g{i} <= {lim}")
    body = ["    try:",
            f"        g0 = {exprs[0]}; g1 = {exprs[1]}; g2 = {exprs[2]}",
            "    except ZeroDivisionError:",
            "        _fail()"]
    if checks:
        body.append(f"    if not ({' and '.join(checks)}): _bad((g0, g1, g2))")
    body.append("    return g0, g1, g2")
    lx, ly, lz = limits
    text = ", ".join(rules)

    def bad(g: tuple) -> None:
        raise LaunchError(f"{what} ({text}) gives grid {g} for these arguments; each size must be in "
                          f"[0, {lx}], [0, {ly}], [0, {lz}] — check the argument values (a negative "
                          "size, or too many blocks?)")
    return _build(body, len(names), {"_fail": _RuleFailed(text, what), "_bad": bad, "type": type, "int": int})


#: CUDA's gridDim limits (x, y, z), per cuLaunchKernel.
CUDA_GRID = (2**31 - 1, 65535, 65535)


def grid_limits(backend: str, num_threads: int, cluster_dims: Sequence[int] = (1, 1, 1)) -> tuple[int, int, int]:
    """The largest grid (in programs) a launch may use on ``backend``.

    CUDA: gridDim.x < 2^31, y and z < 2^16; with clusters the grid counts clusters, so each
    limit is divided by the cluster size. HIP: the same, and gridDim.x * blockDim.x must also fit
    in 32 bits (the HSA dispatch packet's grid size is a u32 of work-items).
    """
    lx, ly, lz = (lim // max(c, 1) for lim, c in zip(CUDA_GRID, cluster_dims))
    if backend == "hip":
        lx = min(lx, (2**32 - 1) // max(num_threads, 1))
    return lx, ly, lz
