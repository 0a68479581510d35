"""The catalog schema: what one catalog entry may hold, as frozen dataclasses.

A catalog lists every compiled *variant* (one kernel, one specialization, one tuning config,
one GPU target) with everything needed to launch it without Triton: the binary's symbol, the
argument layout, launch parameters, the grid rule and where the image is. ``docs/catalog.md``
specifies each field; this file is its executable form, with the limits on each field and the
one table of scalar types. Every ``from_json`` validates, and an error names the file, the JSON
path and the offending value; every ``to_json`` writes the form ``from_json`` reads. The builder
constructs these same objects (``builder/compile.py``).

The two files that hold the entries, the index (``catalog.json``) and its shards, are
:mod:`.index`; reading them from disk, lazily and digest-checked, is :mod:`.store`.
"""

from __future__ import annotations

import functools
import keyword
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import CatalogError
from ..rules import check_rule, rule_names
from .reader import _Reader, _show

_POINTER = re.compile(r"^\*(fp8e4nv|fp8e4b8|fp8e5|fp16|bf16|fp32|fp64|i1|i8|i16|i32|i64|u8|u16|u32|u64)$")
#: Every scalar type Triton 3.6 passes by value: (size in bytes, struct code the runtime packs it
#: with). A scalar is aligned to its size; i1 and u1 travel as a byte (Triton's launchers use
#: int8_t). The struct code is None for the types the runtime does not pack (no catalog may
#: hold them; the builder refuses a kernel declaring one). The one table of scalar types: the
#: builder's layout (``builder/abi.py``), this schema and the argument packer read it.
TRITON_SCALARS: dict[str, tuple[int, str | None]] = {
    "i1": (1, "b"), "u1": (1, None), "i8": (1, "b"), "u8": (1, "B"), "i16": (2, "h"), "u16": (2, "H"),
    "fp16": (2, None), "bf16": (2, None), "i32": (4, "i"), "u32": (4, "I"), "i64": (8, "q"), "u64": (8, "Q"),
    "fp32": (4, "f"), "f32": (4, None), "fp64": (8, "d"),
}
#: The scalar argument types a catalog may hold, with their (size, struct code).
SCALAR_TYPES: dict[str, tuple[int, str]] = {t: (size, code) for t, (size, code) in TRITON_SCALARS.items()
                                            if code is not None}
#: Every pointer is 8 bytes.
POINTER_SIZE = 8
BACKENDS = ("cuda", "hip")
IMAGE_FORMATS = {"cuda": "cubin", "hip": "hsaco"}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: Argument names: plain identifiers, no leading underscore (no dunders, nothing private).
_ARG_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
#: Names the generated launcher uses itself (``k(*args, stream=, grid=)``).
_RESERVED_ARGS = frozenset({"self", "stream", "grid", "extra"})
_KERNEL_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,127}$")
_SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z0-9_$.]{0,1023}$")
_PARAM_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")

#: Limits on what a catalog may claim; each is far above any real kernel and far below what
#: would exhaust memory or overflow a driver field.
MAX_PARAM_SIZE = 32764          # CUDA 12.1+ on Volta and newer: 32764 bytes of kernel parameters
MAX_ARGS = 1024
MAX_DIVISIBILITY = 1 << 16
MAX_SHARED = 1 << 24
MAX_WARPS = 64                  # num_warps * warp_size <= 1024 threads per block (checked too)
MAX_THREADS = 1024
MAX_CTAS = 16
MAX_IMAGE_BYTES = 1 << 30       # one image, compressed or raw
MAX_PTX = 64 << 20              # one PTX text, compressed or raw; real ones are under 1 MB
MAX_SCRATCH = 1 << 32           # global scratch bytes per program
MAX_RULES_CHARS = 1000
MAX_CHECKS = 64
MAX_STRING = 256                # spec / constexpr / option string values


def is_pointer_type(t: str) -> bool:
    """True for Triton pointer type strings such as ``*fp16``."""
    return bool(_POINTER.match(t))


@dataclass(frozen=True)
class Target:
    """A GPU target: ``backend`` ("cuda"/"hip"), ``arch`` ("sm90", "gfx942"), ``warp_size``."""

    backend: str
    arch: str
    warp_size: int

    @classmethod
    def from_json(cls, r: _Reader) -> Target:
        backend = r.str("backend")
        if backend not in BACKENDS:
            raise r._fail("backend", f"one of {', '.join(BACKENDS)}", backend)
        arch = r.str("arch")
        pattern = r"^sm\d{2,3}a?$" if backend == "cuda" else r"^gfx[0-9a-f]{3,5}$"
        if not re.match(pattern, arch):
            raise r._fail("arch", f"a {backend} arch name like {'sm90' if backend == 'cuda' else 'gfx942'}", arch)
        warp = r.int("warp_size", 1)
        if warp not in (32, 64):
            raise r._fail("warp_size", "32 or 64", warp)
        return cls(backend, arch, warp)

    def to_json(self) -> dict:
        return {"backend": self.backend, "arch": self.arch, "warp_size": self.warp_size}


@dataclass(frozen=True)
class Arg:
    """One kernel parameter in launch order: its Triton type and its place in the buffer."""

    name: str
    type: str
    offset: int
    size: int
    align: int
    divisibility: int = 1

    @property
    def is_pointer(self) -> bool:
        return self.type.startswith("*")

    @classmethod
    def from_json(cls, r: _Reader) -> Arg:
        t = r.str("type")
        if is_pointer_type(t):
            size = POINTER_SIZE
        elif t in SCALAR_TYPES:
            size = SCALAR_TYPES[t][0]
        else:
            raise r._fail("type", "a Triton type like *fp16, i32, i64 or fp32", t)
        name = r.str("name")
        if not _ARG_NAME.match(name) or keyword.iskeyword(name) or name in _RESERVED_ARGS:
            raise r._fail("name", "a plain identifier of at most 64 characters (letters, digits, '_', not "
                          "starting with '_', not a Python keyword nor self/stream/grid/extra)", name)
        arg = cls(name, t, r.int("offset", maximum=MAX_PARAM_SIZE), r.int("size", 1, maximum=8),
                  r.int("align", 1, maximum=8), r.int("divisibility", 1, default=1, maximum=MAX_DIVISIBILITY))
        if arg.size != size:
            raise r._fail("size", f"{size} for type {t}", arg.size)
        if arg.align not in (1, 2, 4, 8) or arg.offset % arg.align:
            raise r._fail("offset", f"a multiple of align {arg.align}", arg.offset)
        return arg

    def to_json(self) -> dict:
        out = {"name": self.name, "type": self.type, "offset": self.offset, "size": self.size,
               "align": self.align}
        if self.divisibility != 1:
            out["divisibility"] = self.divisibility
        return out


@dataclass(frozen=True)
class Image:
    """Where a variant's binary is, relative to its image folder, and its digests."""

    path: str
    format: str
    compression: str
    sha256: str
    size: int
    raw_sha256: str
    raw_size: int

    @classmethod
    def from_json(cls, r: _Reader, formats: tuple[str, ...] = ("cubin", "hsaco")) -> Image:
        path = _relative_path(r, "path")
        fmt = r.str("format")
        if fmt not in formats:
            raise r._fail("format", " or ".join(formats), fmt)
        comp = r.str("compression")
        if comp not in ("xz", "none"):
            raise r._fail("compression", "xz or none", comp)
        # jax.jit reads the PTX whole and hands it to jaxlib as one string: a tighter bound.
        limit = MAX_PTX if fmt == "ptx" else MAX_IMAGE_BYTES
        return cls(path, fmt, comp, _sha256(r, "sha256"), r.int("size", 1, maximum=limit),
                   _sha256(r, "raw_sha256"), r.int("raw_size", 1, maximum=limit))

    def to_json(self) -> dict:
        return {"path": self.path, "format": self.format, "compression": self.compression,
                "sha256": self.sha256, "size": self.size, "raw_sha256": self.raw_sha256,
                "raw_size": self.raw_size}


@dataclass(frozen=True)
class Config:
    """The tuning config a variant was compiled with. ``index`` 0 is the kernel's default."""

    index: int
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, r: _Reader) -> Config:
        return cls(r.int("index", maximum=1 << 20), r.scalars("constexprs", _PARAM_KEY, MAX_STRING),
                   r.int("num_warps", 1, maximum=MAX_WARPS), r.int("num_stages", 0, maximum=64),
                   r.scalars("options", _PARAM_KEY, MAX_STRING))

    def to_json(self) -> dict:
        return {"index": self.index, "constexprs": dict(sorted(self.constexprs.items())),
                "num_warps": self.num_warps, "num_stages": self.num_stages,
                "options": dict(sorted(self.options.items()))}


@dataclass(frozen=True)
class Variant:
    """One compiled binary and everything needed to launch it."""

    key: str
    kernel: str
    symbol: str
    target: Target
    spec: dict[str, Any]
    config: Config
    args: tuple[Arg, ...]
    hidden_args: tuple[Arg, ...]
    param_size: int
    scratch: dict[str, int]
    num_warps: int
    num_ctas: int
    cluster_dims: tuple[int, int, int]
    shared: int
    cooperative: bool
    pdl: bool
    grid: tuple[str, str, str]
    image: Image
    triton_version: str
    checks: tuple[str, ...] = ()
    #: CUDA only, optional: the variant's PTX (xz), which jaxlib's Triton custom call needs.
    ptx: Image | None = None

    @property
    def num_threads(self) -> int:
        return self.num_warps * self.target.warp_size

    @property
    def params(self) -> dict[str, Any]:
        """Every named value fixed at compile time: spec axes, then config constexprs."""
        return {**self.spec, **self.config.constexprs}

    @classmethod
    def from_json(cls, obj: Any, path: str, source: str, *, shared: _Shared | None = None) -> Variant:
        """Validate one variant. ``shared`` (a shard's) supplies its target, kernel, Triton
        version, and the tables its ``layout``/``rules`` indices point into."""
        r = _Reader(obj, path, source)
        key = _sha256(r, "key")
        if shared is None:
            target = Target.from_json(r.sub("target"))
            kernel = r.name("kernel", _KERNEL_NAME, "a kernel name (letters, digits, '_')")
            triton_version = r.str("triton_version")
            args, hidden, param_size = _layout_from_json(r)
            grid, checks = _rules_from_json(r)
            launch = _launch_from_json(r, target)
        else:
            target, kernel, triton_version = shared.target, shared.kernel, shared.triton_version
            args, hidden, param_size = shared.layouts[r.int("layout", maximum=len(shared.layouts) - 1)]
            grid, checks = shared.rules[r.int("rules", maximum=len(shared.rules) - 1)]
            launch = shared.launches[r.int("launch_params", maximum=len(shared.launches) - 1)]
        scratch, num_warps, num_ctas, cluster, shared_bytes, cooperative, pdl = launch
        image = Image.from_json(r.sub("image"))
        if image.format != IMAGE_FORMATS[target.backend]:
            raise CatalogError(f"{source}: {path}.image.format must be "
                               f"{IMAGE_FORMATS[target.backend]} for backend {target.backend}, "
                               f"found {_show(image.format)}")
        ptx = None
        if "ptx" in r.obj:
            ptx = Image.from_json(r.sub("ptx"), formats=("ptx",))
            if target.backend != "cuda":
                raise CatalogError(f"{source}: {path}.ptx is only for cuda variants, found on {target.backend}")
            if ptx.path == image.path:
                raise r._fail("ptx", "a path other than the image's", ptx.path)
        variant = cls(
            key=key, kernel=kernel,
            symbol=r.name("symbol", _SYMBOL, "a binary symbol name (letters, digits, '_', '$', '.')"),
            target=target, spec=r.scalars("spec", _PARAM_KEY, MAX_STRING), config=Config.from_json(r.sub("config")),
            args=args, hidden_args=hidden, param_size=param_size, scratch=scratch,
            num_warps=num_warps, num_ctas=num_ctas, cluster_dims=cluster, shared=shared_bytes,
            cooperative=cooperative, pdl=pdl, grid=grid, image=image,
            triton_version=triton_version, checks=checks, ptx=ptx)
        _check_rules(variant, path, source)
        return variant

    def to_json(self) -> dict:
        out = {
            "key": self.key, "kernel": self.kernel, "symbol": self.symbol,
            "target": self.target.to_json(), "spec": dict(sorted(self.spec.items())),
            "config": self.config.to_json(), "args": [a.to_json() for a in self.args],
            "hidden_args": [a.to_json() for a in self.hidden_args], "param_size": self.param_size,
            "scratch": dict(self.scratch), "num_warps": self.num_warps, "num_ctas": self.num_ctas,
            "cluster_dims": list(self.cluster_dims), "shared": self.shared,
            "launch": {"cooperative": self.cooperative, "pdl": self.pdl},
            "grid": list(self.grid), "image": self.image.to_json(),
            "triton_version": self.triton_version, "checks": list(self.checks),
        }
        if self.ptx is not None:
            out["ptx"] = self.ptx.to_json()
        return out


def _layout_from_json(r: _Reader) -> tuple[tuple[Arg, ...], tuple[Arg, ...], int]:
    """``args``, ``hidden_args`` and ``param_size`` of a variant or of a shard's layout table."""
    path, source = r.path, r.source
    raw_args, raw_hidden = r.list("args"), r.list("hidden_args")
    if len(raw_args) > MAX_ARGS:
        raise r._fail("args", f"a list of at most {MAX_ARGS} arguments", f"{len(raw_args)} items")
    args = tuple(Arg.from_json(_Reader(a, f"{path}.args[{i}]", source)) for i, a in enumerate(raw_args))
    # The launcher always appends the two scratch pointers Triton adds (global, profile).
    if len(raw_hidden) != 2:
        raise r._fail("hidden_args", "the two scratch pointers Triton appends", f"{len(raw_hidden)} items")
    hidden = tuple(Arg.from_json(_Reader(a, f"{path}.hidden_args[{i}]", source))
                   for i, a in enumerate(raw_hidden))
    for i, a in enumerate(hidden):
        if not a.is_pointer:
            raise CatalogError(f"{source}: {path}.hidden_args[{i}].type must be a pointer type, "
                               f"found {_show(a.type)}")
    names = [a.name for a in args]
    if len(set(names)) != len(names):
        raise r._fail("args", "a list of uniquely named arguments", names)
    end = 0
    for i, a in enumerate(args + hidden):
        if a.offset < end:
            where = f"args[{i}]" if i < len(args) else f"hidden_args[{i - len(args)}]"
            raise CatalogError(f"{source}: {path}.{where}.offset {a.offset} overlaps the "
                               f"previous argument, which ends at {end}")
        end = a.offset + a.size
    param_size = r.int("param_size", maximum=MAX_PARAM_SIZE)
    if param_size < end:
        raise r._fail("param_size", f"at least {end}, the end of the last argument", param_size)
    return args, hidden, param_size


def _launch_from_json(r: _Reader, target: Target) -> tuple:
    """(scratch, num_warps, num_ctas, cluster_dims, shared, cooperative, pdl) of a variant or of
    a shard's ``launch_params`` table."""
    scratch_r = r.sub("scratch")
    scratch = {k: scratch_r.int(k, 0 if k.endswith("size") else 1,
                                maximum=MAX_SCRATCH if k.endswith("size") else 1 << 16)
               for k in ("global_size", "global_align", "profile_size", "profile_align")}
    cluster = r.list("cluster_dims", [1, 1, 1])
    if len(cluster) != 3 or not all(isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= MAX_CTAS
                                    for c in cluster) or cluster[0] * cluster[1] * cluster[2] > MAX_CTAS:
        raise r._fail("cluster_dims", f"three integers >= 1 whose product is at most {MAX_CTAS}", cluster)
    launch = r.sub("launch")
    num_warps = r.int("num_warps", 1, maximum=MAX_WARPS)
    if num_warps * target.warp_size > MAX_THREADS:
        raise r._fail("num_warps", f"at most {MAX_THREADS // target.warp_size} ({MAX_THREADS} threads "
                      f"per block of {target.warp_size}-wide warps)", num_warps)
    return (scratch, num_warps, r.int("num_ctas", 1, maximum=MAX_CTAS), tuple(cluster),
            r.int("shared", maximum=MAX_SHARED), launch.get("cooperative", bool, "true or false"),
            launch.get("pdl", bool, "true or false"))


def _rules_from_json(r: _Reader) -> tuple[tuple[str, str, str], tuple[str, ...]]:
    """``grid`` and ``checks`` (their form; each variant parses them against its own params)."""
    grid = r.list("grid")
    if len(grid) != 3 or not all(isinstance(g, str) and g and len(g) <= MAX_RULES_CHARS for g in grid):
        raise r._fail("grid", "three expression strings", grid)
    checks = r.list("checks", [])
    if len(checks) > MAX_CHECKS:
        raise r._fail("checks", f"a list of at most {MAX_CHECKS} rules", f"{len(checks)} items")
    for i, text in enumerate(checks):
        if not isinstance(text, str) or not text or len(text) > MAX_RULES_CHARS:
            raise r._fail(f"checks[{i}]", f"a non-empty string of at most {MAX_RULES_CHARS} characters", text)
    return tuple(grid), tuple(checks)


@dataclass(frozen=True)
class _Shared:
    """What the variants of one shard have in common (:func:`.index.shard_from_json` reads them)."""

    target: Target
    kernel: str
    triton_version: str
    layouts: tuple[tuple[tuple[Arg, ...], tuple[Arg, ...], int], ...]
    rules: tuple[tuple[tuple[str, str, str], tuple[str, ...]], ...]
    launches: tuple[tuple, ...]


def _check_rules(v: Variant, path: str, source: str) -> None:
    """Parse every grid and check rule of ``v`` now, so that a bad one names its JSON path.

    A shard's variants share a few rule lists and differ in values those rules mostly do not
    name: the verdict is cached on the rules and the values they use (see :func:`check_rule`)."""
    names = tuple(a.name for a in v.args)
    try:
        used = _rule_names(tuple(v.grid), tuple(v.checks))
    except CatalogError:
        used = ()  # a rule that does not parse: _checked_rules names it below
    params = v.params
    values = tuple((n, params[n]) for n in used if n in params and n not in names)
    types = tuple((a.name, a.type) for a in v.args if a.name in used)
    args = (names, tuple(v.grid), tuple(v.checks), values, types, v.kernel)
    try:
        hash(args)
    except TypeError:  # a compile-time value that is not a scalar: checked (and refused) uncached
        error = _checked_rules.__wrapped__(*args)
    else:
        error = _checked_rules(*args)
    if error is not None:
        field_name, i, message = error
        raise CatalogError(f"{source}: {path}.{field_name}[{i}]: {message}")


@functools.lru_cache(maxsize=1024)
def _rule_names(grid: tuple[str, ...], checks: tuple[str, ...]) -> frozenset[str]:
    return frozenset(n for text in (*grid, *checks) for n in rule_names(text, "rule"))


@functools.lru_cache(maxsize=4096)
def _checked_rules(names: tuple[str, ...], grid: tuple[str, ...], checks: tuple[str, ...], values: tuple,
                   types: tuple, kernel: str) -> tuple[str, int, str] | None:
    """None, or (field, index, message) of the first rule that fails its check."""
    params = dict(values)
    kinds = dict(types)
    for field_name, rules, kw in (("grid", grid, {"types": kinds, "what": f"grid rule of {kernel}"}),
                                  ("checks", checks, {})):
        for i, text in enumerate(rules):
            try:
                check_rule(text, names, params, **kw)
            except CatalogError as e:
                return field_name, i, str(e)
    return None


def _relative_path(r: _Reader, key: str) -> str:
    """An image's or a shard's path: relative to the image folder, '/'-separated, no '..'."""
    path = r.str(key)
    if path.startswith("/") or "\\" in path or ":" in path or any(p in ("", ".", "..") for p in path.split("/")):
        raise r._fail(key, "a relative '/'-separated path inside the image folder", path)
    if len(path) > 1024:
        raise r._fail(key, "a path of at most 1024 characters", path)
    return path


def _sha256(r: _Reader, key: str) -> str:
    return r.name(key, _HEX64, "64 lowercase hex digits")
