"""What is in a catalog: the schema of ``catalog.json``, as frozen dataclasses.

A catalog lists every compiled *variant* (one kernel, one specialization, one tuning config,
one GPU target) with everything needed to launch it without Triton: the binary's symbol, the
argument layout, launch parameters, the grid rule and where the image is. ``docs/catalog.md``
specifies each field. Loading validates everything; an error names the file, the JSON path and
the offending value.

On disk a catalog is an *index* (``catalog.json``: the tuning table and one entry per (backend,
arch, kernel) *shard* with the shard's path, size and sha256) plus the shard files, each holding
one kernel's variants on one target with what they share (argument layouts, grid rules, checks)
stored once and referenced by position. :meth:`Catalog.load` reads only the index; a shard is
read, digest-checked and validated the first time something asks for its variants, so opening a
full image set costs the index alone. This module is the one writer (:meth:`Catalog.write`) and
reader of that format.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import os
import re
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CatalogError
from .tuning import validate_table as validate_tuning

SCHEMA = "aotriton-rt.catalog"
SHARD_SCHEMA = "aotriton-rt.catalog-shard"
SCHEMA_VERSION = 2
CATALOG_FILE = "catalog.json"
#: A shard's file name, in the folder of its kernel's images: ``<backend>/<arch>/<kernel>/``.
SHARD_FILE = "variants.json"

_POINTER = re.compile(r"^\*(fp8e4nv|fp8e5|fp16|bf16|fp32|fp64|i1|i8|i16|i32|i64|u8|u16|u32|u64)$")
#: Scalar argument types and their (size, struct code). Triton passes i1 as a byte.
SCALAR_TYPES: dict[str, tuple[int, str]] = {
    "i1": (1, "b"), "i8": (1, "b"), "u8": (1, "B"), "i16": (2, "h"), "u16": (2, "H"),
    "i32": (4, "i"), "u32": (4, "I"), "i64": (8, "q"), "u64": (8, "Q"),
    "fp32": (4, "f"), "fp64": (8, "d"),
}
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
MAX_SCRATCH = 1 << 32           # global scratch bytes per program
MAX_RULES_CHARS = 1000
MAX_CHECKS = 64
MAX_STRING = 256                # spec / constexpr / option string values
MAX_CATALOG_BYTES = 64 << 20    # catalog.json (index, or inline variants); a full index is ~100 KB
MAX_SHARD_BYTES = 64 << 20      # one shard file; the largest real one is a few MB
MAX_SHARDS = 1 << 16            # index entries
MAX_SHARD_VARIANTS = 1 << 16    # variants (and shared tables) in one shard


def is_pointer_type(t: str) -> bool:
    """True for Triton pointer type strings such as ``*fp16``."""
    return bool(_POINTER.match(t))


class _Reader:
    """Typed access to one JSON object, with errors that name file and JSON path."""

    def __init__(self, obj: Any, path: str, source: str) -> None:
        if not isinstance(obj, Mapping):
            raise CatalogError(f"{source}: {path} must be an object, found {_show(obj)}")
        self.obj, self.path, self.source = obj, path, source

    def _fail(self, key: str, what: str, value: Any) -> CatalogError:
        return CatalogError(f"{self.source}: {self.path}.{key} must be {what}, found {_show(value)}")

    def get(self, key: str, kind: type | tuple[type, ...], what: str, default: Any = ...) -> Any:
        if key not in self.obj:
            if default is not ...:
                return default
            raise CatalogError(f"{self.source}: {self.path}.{key} is missing")
        value = self.obj[key]
        # bool is an int in Python; a catalog int field must not accept true/false.
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            raise self._fail(key, what, value)
        return value

    def int(self, key: str, minimum: int = 0, default: Any = ..., maximum: int = 2**63 - 1) -> int:
        what = f"an integer >= {minimum}" if maximum == 2**63 - 1 else f"an integer in [{minimum}, {maximum}]"
        value = self.get(key, int, what, default)
        if not minimum <= value <= maximum:
            raise self._fail(key, what, value)
        return value

    def name(self, key: str, pattern: re.Pattern, what: str) -> str:
        value = self.str(key)
        if not pattern.match(value):
            raise self._fail(key, what, value)
        return value

    def str(self, key: str, default: Any = ...) -> str:
        return self.get(key, str, "a string", default)

    def sub(self, key: str, default: Any = ...) -> _Reader:
        value = self.get(key, Mapping, "an object", default)
        return _Reader(value, f"{self.path}.{key}", self.source)

    def list(self, key: str, default: Any = ...) -> list:
        return self.get(key, list, "a list", default)


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _show(value: Any) -> str:
    try:
        text = json.dumps(value) if not isinstance(value, Mapping) else "an object"
    except (RecursionError, ValueError):
        text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _scalars(r: _Reader, key: str) -> dict[str, Any]:
    obj = r.sub(key, {})
    for k, v in obj.obj.items():
        if not _PARAM_KEY.match(k):
            raise CatalogError(f"{obj.source}: {obj.path} has key {_show(k)}, which is not a plain name")
        if not isinstance(v, (str, int, float, bool)) or v is None:
            raise obj._fail(k, "a string, number or boolean", v)
        if isinstance(v, str) and len(v) > MAX_STRING:
            raise obj._fail(k, f"a string of at most {MAX_STRING} characters", v)
        if isinstance(v, int) and not -2**63 <= v < 2**64:
            raise obj._fail(k, "an integer that fits in 64 bits", v)
    return dict(obj.obj)


def _strings(r: _Reader, key: str) -> list[str]:
    items = r.list(key, [])
    if len(items) > MAX_CHECKS:
        raise r._fail(key, f"a list of at most {MAX_CHECKS} rules", f"{len(items)} items")
    for i, s in enumerate(items):
        if not isinstance(s, str) or not s or len(s) > MAX_RULES_CHARS:
            raise r._fail(f"{key}[{i}]", f"a non-empty string of at most {MAX_RULES_CHARS} characters", s)
    return items


@dataclass(frozen=True)
class Target:
    """A GPU target: ``backend`` ("cuda"/"hip"), ``arch`` ("sm90", "gfx942"), ``warp_size``."""

    backend: str
    arch: str
    warp_size: int

    @property
    def name(self) -> str:
        return self.arch

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
            size = 8
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
        path = r.str("path")
        parts = path.split("/")
        if path.startswith("/") or "\\" in path or ":" in path or any(p in ("", ".", "..") for p in parts):
            raise r._fail("path", "a relative '/'-separated path inside the image folder", path)
        fmt = r.str("format")
        if fmt not in formats:
            raise r._fail("format", " or ".join(formats), fmt)
        comp = r.str("compression")
        if comp not in ("xz", "none"):
            raise r._fail("compression", "xz or none", comp)
        digests = {}
        for key in ("sha256", "raw_sha256"):
            digests[key] = r.str(key)
            if not _HEX64.match(digests[key]):
                raise r._fail(key, "64 lowercase hex digits", digests[key])
        if len(path) > 1024:
            raise r._fail("path", "a path of at most 1024 characters", path)
        return cls(path, fmt, comp, digests["sha256"], r.int("size", 1, maximum=MAX_IMAGE_BYTES),
                   digests["raw_sha256"], r.int("raw_size", 1, maximum=MAX_IMAGE_BYTES))

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
        return cls(r.int("index", maximum=1 << 20), _scalars(r, "constexprs"),
                   r.int("num_warps", 1, maximum=MAX_WARPS), r.int("num_stages", 0, maximum=64),
                   _scalars(r, "options"))

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
        key = r.str("key")
        if not _HEX64.match(key):
            raise r._fail("key", "64 lowercase hex digits", key)
        if shared is None:
            target = Target.from_json(r.sub("target"))
            kernel = r.name("kernel", _KERNEL_NAME, "a kernel name (letters, digits, '_')")
            triton_version = r.str("triton_version")
            args, hidden, param_size = _layout_from_json(r)
            grid, checks = _rules_from_json(r)
        else:
            target, kernel, triton_version = shared.target, shared.kernel, shared.triton_version
            args, hidden, param_size = shared.layouts[r.int("layout", maximum=len(shared.layouts) - 1)]
            grid, checks = shared.rules[r.int("rules", maximum=len(shared.rules) - 1)]
        if shared is None:
            launch = _launch_from_json(r, target)
        else:
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
            target=target, spec=_scalars(r, "spec"), config=Config.from_json(r.sub("config")), args=args,
            hidden_args=hidden, param_size=param_size, scratch=scratch,
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


_LAUNCH_FIELDS = ("scratch", "num_warps", "num_ctas", "cluster_dims", "shared", "launch")


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
    return tuple(grid), tuple(_strings(r, "checks"))


@dataclass(frozen=True)
class _Shared:
    """What the variants of one shard have in common."""

    target: Target
    kernel: str
    triton_version: str
    layouts: tuple[tuple[tuple[Arg, ...], tuple[Arg, ...], int], ...]
    rules: tuple[tuple[tuple[str, str, str], tuple[str, ...]], ...]
    launches: tuple[tuple, ...]


def _check_rules(v: Variant, path: str, source: str) -> None:
    """Parse every grid and check rule of ``v`` now, so that a bad one names its JSON path."""
    from .pack import check_rule  # the rule language lives with its compiler

    names = tuple(a.name for a in v.args)
    params = v.params
    for field_name, rules in (("grid", v.grid), ("checks", v.checks)):
        for i, text in enumerate(rules):
            try:
                check_rule(text, names, params)
            except CatalogError as e:
                raise CatalogError(f"{source}: {path}.{field_name}[{i}]: {e}") from None


@dataclass(frozen=True)
class ShardRef:
    """An index entry: where the variants of one kernel on one target are, and their digest."""

    target: Target
    kernel: str
    path: str
    sha256: str
    size: int
    variants: int

    @classmethod
    def from_json(cls, r: _Reader) -> ShardRef:
        target = Target.from_json(r)
        kernel = r.name("kernel", _KERNEL_NAME, "a kernel name (letters, digits, '_')")
        path = _relative_path(r, "path")
        sha = r.str("sha256")
        if not _HEX64.match(sha):
            raise r._fail("sha256", "64 lowercase hex digits", sha)
        return cls(target, kernel, path, sha, r.int("size", 1, maximum=MAX_SHARD_BYTES),
                   r.int("variants", 1, maximum=MAX_SHARD_VARIANTS))

    def to_json(self) -> dict:
        return {**self.target.to_json(), "kernel": self.kernel, "path": self.path, "sha256": self.sha256,
                "size": self.size, "variants": self.variants}


def _relative_path(r: _Reader, key: str) -> str:
    path = r.str(key)
    parts = path.split("/")
    if (path.startswith("/") or "\\" in path or ":" in path or len(path) > 1024
            or any(p in ("", ".", "..") for p in parts)):
        raise r._fail(key, "a relative '/'-separated path inside the image folder", path)
    return path


def shard_path(target: Target, kernel: str) -> str:
    """Where the builder puts a shard: beside the kernel's images."""
    return f"{target.backend}/{target.arch}/{kernel}/{SHARD_FILE}"


class Catalog:
    """A catalog: the variants of one image folder, read shard by shard as they are asked for.

    Example::

        cat = Catalog.load("images")                         # reads catalog.json only
        cat.variants_of("add", targets={("cuda", "sm90")})   # reads and checks one shard
        [v.kernel for v in cat.variants]                     # reads every shard
    """

    def __init__(self, triton_version: str, variants: Any = (), tuning: dict[str, Any] | None = None,
                 folder: Path | None = None, source: str = "<memory>", *,
                 shards: tuple[ShardRef, ...] = ()) -> None:
        self.triton_version = triton_version
        self.tuning = tuning if tuning is not None else {}
        self.folder = folder
        self.source = source
        self._lock = threading.Lock()
        #: (backend, arch, kernel) -> its variants once read, or its index entry before.
        self._groups: dict[tuple[str, str, str], tuple[Variant, ...] | ShardRef] = {}
        self._warp: dict[tuple[str, str], Target] = {}
        for ref in shards:
            self._groups[(ref.target.backend, ref.target.arch, ref.kernel)] = ref
            self._warp[(ref.target.backend, ref.target.arch)] = ref.target
        grouped: dict[tuple[str, str, str], list[Variant]] = {}
        for v in variants:
            grouped.setdefault((v.target.backend, v.target.arch, v.kernel), []).append(v)
            self._warp[(v.target.backend, v.target.arch)] = v.target
        for k, vs in grouped.items():
            self._groups[k] = tuple(sorted(vs, key=_order))
        self._all: tuple[Variant, ...] | None = None

    def __repr__(self) -> str:
        return f"<aotriton_rt.Catalog {self.source}: {len(self._groups)} kernel/target groups>"

    # -- reading ---------------------------------------------------------------------------
    @classmethod
    def from_json(cls, obj: Any, *, source: str = "<memory>", folder: Path | None = None) -> Catalog:
        """Validate a parsed ``catalog.json``: an index of shards (read later from ``folder``)
        or the inline form, whose ``variants`` list every variant in full (what
        :meth:`to_json` returns). Raises CatalogError naming the JSON path of a bad value."""
        r = _Reader(obj, "$", source)
        schema = r.str("schema")
        if schema != SCHEMA:
            raise r._fail("schema", f'"{SCHEMA}"', schema)
        _check_version(r, source)
        # The tuning rules are validated here, at load, by the module that applies them.
        tuning = validate_tuning(dict(r.sub("tuning", {}).obj), source)
        triton_version = r.str("triton_version")
        if "shards" in r.obj:
            if "variants" in r.obj:
                raise CatalogError(f"{source}: $ has both shards and variants; a catalog lists one or the other")
            raw = r.list("shards")
            if len(raw) > MAX_SHARDS:
                raise r._fail("shards", f"a list of at most {MAX_SHARDS} entries", f"{len(raw)} items")
            refs = tuple(ShardRef.from_json(_Reader(e, f"$.shards[{i}]", source)) for i, e in enumerate(raw))
            seen: dict[Any, int] = {}
            for i, ref in enumerate(refs):
                for what, ident in (("target and kernel", (ref.target.backend, ref.target.arch, ref.kernel)),
                                    ("path", ref.path)):
                    if ident in seen:
                        raise CatalogError(f"{source}: $.shards[{i}] repeats the {what} of "
                                           f"$.shards[{seen[ident]}]")
                    seen[ident] = i
            return cls(triton_version, (), tuning, folder, source, shards=refs)
        raw = r.list("variants")
        if len(raw) > MAX_SHARDS * 4:
            raise r._fail("variants", "an inline list of at most 262144 variants", f"{len(raw)} items")
        variants = tuple(Variant.from_json(v, f"$.variants[{i}]", source) for i, v in enumerate(raw))
        _unique_keys(variants, source, "$.variants")
        return cls(triton_version, variants, tuning, folder, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Catalog:
        """Read and validate ``catalog.json`` (or the folder holding it); shards are read later."""
        path = Path(path)
        if path.is_dir():
            path = path / CATALOG_FILE
        data = _read_bounded(path, MAX_CATALOG_BYTES, "catalog")
        return cls.from_json(parse_json(data, str(path)), source=str(path), folder=path.parent)

    def _read_shard(self, ref: ShardRef) -> tuple[Variant, ...]:
        if self.folder is None:
            raise CatalogError(f"{self.source}: shard {ref.path} cannot be read: the catalog has no folder")
        file = self.folder.joinpath(*ref.path.split("/"))
        source = str(file)
        data = _read_bounded(file, MAX_SHARD_BYTES, "catalog shard")
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            raise CatalogError(f"{source}: does not match its entry in {self.source} (size {len(data)}, "
                               f"index says {ref.size}, or sha256 differs); reinstall or rebuild the image folder")
        r = _Reader(parse_json(data, source), "$", source)
        if r.str("schema") != SHARD_SCHEMA:
            raise r._fail("schema", f'"{SHARD_SCHEMA}"', r.obj["schema"])
        _check_version(r, source)
        target = Target.from_json(r.sub("target"))
        kernel = r.name("kernel", _KERNEL_NAME, "a kernel name (letters, digits, '_')")
        if target != ref.target or kernel != ref.kernel:
            raise CatalogError(f"{source}: holds {kernel} for {target.backend} {target.arch}, but {self.source} "
                               f"lists it for {ref.kernel} on {ref.target.backend} {ref.target.arch}")
        tables = {}
        for name in ("layouts", "rules", "launch_params", "variants"):
            tables[name] = r.list(name)
            if not 1 <= len(tables[name]) <= MAX_SHARD_VARIANTS:
                raise r._fail(name, f"a list of 1 to {MAX_SHARD_VARIANTS} entries", f"{len(tables[name])} items")
        if len(tables["variants"]) != ref.variants:
            raise r._fail("variants", f"the {ref.variants} entries the index counts",
                          f"{len(tables['variants'])} items")
        shared = _Shared(
            target, kernel, r.str("triton_version"),
            tuple(_layout_from_json(_Reader(e, f"$.layouts[{i}]", source)) for i, e in enumerate(tables["layouts"])),
            tuple(_rules_from_json(_Reader(e, f"$.rules[{i}]", source)) for i, e in enumerate(tables["rules"])),
            tuple(_launch_from_json(_Reader(e, f"$.launch_params[{i}]", source), target)
                  for i, e in enumerate(tables["launch_params"])))
        variants = tuple(Variant.from_json(v, f"$.variants[{i}]", source, shared=shared)
                         for i, v in enumerate(tables["variants"]))
        _unique_keys(variants, source, "$.variants")
        return variants

    def _group(self, key: tuple[str, str, str]) -> tuple[Variant, ...]:
        got = self._groups[key]
        if isinstance(got, ShardRef):
            with self._lock:
                got = self._groups[key]
                if isinstance(got, ShardRef):
                    got = self._groups[key] = self._read_shard(got)
        return got

    def variants_of(self, kernel: str, targets: Any = None) -> tuple[Variant, ...]:
        """The variants of ``kernel``, on ``targets`` ((backend, arch) pairs) or every target;
        reads (and checks) only those shards."""
        out: list[Variant] = []
        for key in sorted(self._groups):
            if key[2] == kernel and (targets is None or key[:2] in targets):
                out.extend(self._group(key))
        return tuple(out)

    @property
    def variants(self) -> tuple[Variant, ...]:
        """Every variant, in canonical order (reads every shard: for tools, not for launches)."""
        if self._all is None:
            everything = tuple(v for key in sorted(self._groups) for v in self._group(key))
            _unique_keys(everything, self.source, "variants")
            self._all = everything
        return self._all

    @property
    def kernels(self) -> list[str]:
        """Kernel names, from the index alone."""
        return sorted({k for _, _, k in self._groups})

    def targets(self) -> list[Target]:
        """The targets the catalog has variants for, from the index alone."""
        return [self._warp[k] for k in sorted(self._warp)]

    @property
    def count(self) -> int:
        """How many variants the catalog lists (from the index alone)."""
        return sum(g.variants if isinstance(g, ShardRef) else len(g) for g in self._groups.values())

    def shard_refs(self) -> list[ShardRef]:
        """The index entries of the shards not read yet."""
        return [g for g in self._groups.values() if isinstance(g, ShardRef)]

    def target_kernels(self) -> list[tuple[str, str, str]]:
        """(backend, arch, kernel) of every shard, from the index alone."""
        return sorted(self._groups)

    # -- writing ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        """The inline form: every variant in full (what tools print and compare)."""
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
                "triton_version": self.triton_version, "tuning": self.tuning,
                "variants": [v.to_json() for v in self.variants]}

    def dumps(self) -> str:
        """Canonical text of the inline form: equal catalogs are equal bytes."""
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    def files(self) -> dict[str, bytes]:
        """The sharded form as files (relative path -> bytes), ``catalog.json`` last.

        Canonical: keys sorted, compact separators, shards and their variants in a fixed order,
        so equal catalogs give equal bytes."""
        out: dict[str, bytes] = {}
        refs = []
        for key in sorted(self._groups):
            variants = self._group(key)
            target = variants[0].target
            layouts: dict[str, int] = {}
            rules: dict[str, int] = {}
            launches: dict[str, int] = {}
            entries = []
            for v in variants:
                entry = v.to_json()
                layout = json.dumps({k: entry.pop(k) for k in ("args", "hidden_args", "param_size")}, sort_keys=True)
                rule = json.dumps({k: entry.pop(k) for k in ("grid", "checks")}, sort_keys=True)
                for k in ("target", "kernel", "triton_version"):
                    del entry[k]
                entry["layout"] = layouts.setdefault(layout, len(layouts))
                entry["rules"] = rules.setdefault(rule, len(rules))
                launch = json.dumps({k: entry.pop(k) for k in _LAUNCH_FIELDS}, sort_keys=True)
                entry["launch_params"] = launches.setdefault(launch, len(launches))
                entries.append(entry)
            shard = {"schema": SHARD_SCHEMA, "schema_version": SCHEMA_VERSION, "target": target.to_json(),
                     "kernel": key[2], "triton_version": variants[0].triton_version,
                     "layouts": [json.loads(t) for t in layouts], "rules": [json.loads(t) for t in rules],
                     "launch_params": [json.loads(t) for t in launches],
                     "variants": entries}
            data = canonical_bytes(shard)
            path = shard_path(target, key[2])
            out[path] = data
            refs.append(ShardRef(target, key[2], path, hashlib.sha256(data).hexdigest(), len(data), len(variants)))
        out[CATALOG_FILE] = index_bytes(self.triton_version, self.tuning, refs)
        return out

    def write(self, folder: str | os.PathLike) -> set[str]:
        """Write the sharded form into ``folder``: each shard atomically, then ``catalog.json``.
        Returns the relative paths written."""
        folder = Path(folder)
        files = self.files()
        for rel, data in files.items():
            dest = folder.joinpath(*rel.split("/"))
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not (dest.is_file() and dest.stat().st_size == len(data) and dest.read_bytes() == data):
                write_atomic(dest, data)
        return set(files)


def index_bytes(triton_version: str, tuning: dict[str, Any], refs: Any) -> bytes:
    """Canonical ``catalog.json`` text of an index listing ``refs`` (:class:`ShardRef`)."""
    index = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "triton_version": triton_version,
             "tuning": tuning, "shards": [ref.to_json() for ref in refs]}
    return json.dumps(index, indent=1, sort_keys=True).encode() + b"\n"


def canonical_bytes(obj: Any) -> bytes:
    """Compact canonical JSON (sorted keys, no spaces), as shards are written."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def _check_version(r: _Reader, source: str) -> None:
    version = r.int("schema_version", 1)
    if version != SCHEMA_VERSION:
        raise CatalogError(
            f"{source}: catalog schema_version {version} is not understood by this runtime "
            f"(it reads version {SCHEMA_VERSION}); "
            + ("upgrade aotriton-rt (pip install -U aotriton-rt)" if version > SCHEMA_VERSION
               else "rebuild the images with this version's builder or download them again"))


def _unique_keys(variants: tuple[Variant, ...], source: str, where: str) -> None:
    seen: dict[str, int] = {}
    for i, v in enumerate(variants):
        if v.key in seen:
            raise CatalogError(f"{source}: {where}[{i}].key repeats {where}[{seen[v.key]}].key "
                               f"({v.key[:16]}...)")
        seen[v.key] = i


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    try:
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            # A FIFO would block a read forever and /dev/zero never ends: regular files only.
            if not stat.S_ISREG(st.st_mode):
                raise CatalogError(f"{what} {path} is not a regular file; reinstall the image folder")
            if st.st_size > limit:
                raise CatalogError(f"{what} {path} is {st.st_size} bytes, over the limit of "
                                   f"{limit}; it is not a catalog this runtime reads")
            # At most what fstat said, plus one byte to notice growth: a read of ``limit`` bytes
            # would allocate that much up front however small the file is.
            data = f.read(st.st_size + 1)
    except OSError as e:
        raise CatalogError(f"cannot read {what} {path}: {e.strerror or e}") from e
    if len(data) > min(st.st_size, limit):
        raise CatalogError(f"{what} {path} changed while it was read; reinstall the image folder")
    return data


def open_regular(path: str | os.PathLike) -> Any:
    """Open ``path`` for reading without blocking: a FIFO opens at once (then fails the caller's
    regular-file check) instead of waiting for a writer forever."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    return os.fdopen(fd, "rb", buffering=0)


def parse_json(data: bytes, source: str) -> Any:
    """Parse catalog text: UTF-8 JSON, nested no deeper than Python can recurse; else CatalogError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CatalogError(f"{source}: not UTF-8 text (byte {e.start}); reinstall or rebuild the image "
                           "folder") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CatalogError(f"{source}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise CatalogError(f"{source}: JSON nested too deeply to be a catalog") from None
    except ValueError as e:  # e.g. an integer literal too long to convert
        raise CatalogError(f"{source}: not valid JSON ({e})") from None


def _order(v: Variant) -> tuple:
    return (v.target.backend, v.target.arch, v.kernel, v.key)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and os.replace."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
