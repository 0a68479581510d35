"""The catalog schema: what a ``catalog.json`` and its shards may hold, as frozen dataclasses.

A catalog lists every compiled *variant* (one kernel, one specialization, one tuning config,
one GPU target) with everything needed to launch it without Triton: the binary's symbol, the
argument layout, launch parameters, the grid rule and where the image is. ``docs/catalog.md``
specifies each field; this file is its executable form. Every ``from_json`` validates, and an
error names the file, the JSON path and the offending value; every ``to_json`` writes the form
``from_json`` reads. The builder constructs these same objects (``builder/compile.py``).

The shapes of the two files, the index (``catalog.json``) and a shard, are here too
(:func:`index_from_json`, :func:`shard_from_json`, and their inverses); reading them from disk,
lazily and digest-checked, is :mod:`.store`.
"""

from __future__ import annotations

import json
import keyword
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import CatalogError
from ..rules import check_rule
from ..tuning import validate_table as validate_tuning
from .reader import _Reader, _show

SCHEMA = "aotriton-rt.catalog"
SHARD_SCHEMA = "aotriton-rt.catalog-shard"
SCHEMA_VERSION = 2
CATALOG_FILE = "catalog.json"
#: A shard's file name, in the folder of its kernel's images: ``<backend>/<arch>/<kernel>/``.
SHARD_FILE = "variants.json"

_POINTER = re.compile(r"^\*(fp8e4nv|fp8e5|fp16|bf16|fp32|fp64|i1|i8|i16|i32|i64|u8|u16|u32|u64)$")
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
#: catalog.json in the index form. A full build (37,770 variants, 7 targets) is 88 shards and
#: 96 tuning rules, ~60 KB; with an sm90-sized tuning database for every target, ~300 KB. At
#: this cap a worst-case valid index loads in ~0.1 s (docs/security.md has the measurement).
MAX_INDEX_BYTES = 4 << 20
#: catalog.json of an image folder in either form, read whole by every Library(). The builder,
#: the bundle installer and image wheels all write the index form; the inline form (every
#: variant in full, ~8 KB each: a full sm90 set is ~50 MB) is for small hand-written or test
#: catalogs, so it gets the index's cap: at 64 MiB it cost 15.3 s and 471 MiB per Library().
MAX_CATALOG_BYTES = MAX_INDEX_BYTES
MAX_SHARD_BYTES = 64 << 20      # one shard file; the largest real one is a few MB
MAX_SHARDS = 4096               # index entries; a full build has 88 (one per kernel and target)
MAX_INLINE_VARIANTS = 1 << 18   # variants in the inline form; a full build has 37,770
MAX_SHARD_VARIANTS = 1 << 16    # variants (and shared tables) in one shard


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
    checks = r.list("checks", [])
    if len(checks) > MAX_CHECKS:
        raise r._fail("checks", f"a list of at most {MAX_CHECKS} rules", f"{len(checks)} items")
    for i, text in enumerate(checks):
        if not isinstance(text, str) or not text or len(text) > MAX_RULES_CHARS:
            raise r._fail(f"checks[{i}]", f"a non-empty string of at most {MAX_RULES_CHARS} characters", text)
    return tuple(grid), tuple(checks)


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
    names = tuple(a.name for a in v.args)
    params = v.params
    # A grid rule may name integer scalars only (checks may compare anything).
    types = {a.name: a.type for a in v.args}
    for field_name, rules, kw in (("grid", v.grid, {"types": types, "what": f"grid rule of {v.kernel}"}),
                                  ("checks", v.checks, {})):
        for i, text in enumerate(rules):
            try:
                check_rule(text, names, params, **kw)
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
        return cls(target, kernel, path, _sha256(r, "sha256"), r.int("size", 1, maximum=MAX_SHARD_BYTES),
                   r.int("variants", 1, maximum=MAX_SHARD_VARIANTS))

    def to_json(self) -> dict:
        return {**self.target.to_json(), "kernel": self.kernel, "path": self.path, "sha256": self.sha256,
                "size": self.size, "variants": self.variants}


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


def shard_path(target: Target, kernel: str) -> str:
    """Where the builder puts a shard: beside the kernel's images."""
    return f"{target.backend}/{target.arch}/{kernel}/{SHARD_FILE}"


def image_path(target: Target, kernel: str, key: str, fmt: str) -> str:
    """Where the builder puts an image: ``<backend>/<arch>/<kernel>/<kernel>-<key16>.<fmt>.xz``
    (a CUDA variant's PTX beside its cubin, ``fmt`` "ptx")."""
    return f"{target.backend}/{target.arch}/{kernel}/{kernel}-{key[:16]}.{fmt}.xz"


# --------------------------------------------------------------------------- whole files


def index_from_json(obj: Any, source: str, size: int | None = None) -> tuple[
        str, dict[str, Any], tuple[ShardRef, ...] | None, tuple[Variant, ...]]:
    """Validate a parsed ``catalog.json``: (triton_version, tuning, shard entries, variants).

    The index form gives its shard entries (and no variants); the inline form, whose
    ``variants`` list every variant in full, gives None and the variants. ``size``: the file's
    size in bytes, when read from one (the index form may have at most MAX_INDEX_BYTES).
    Raises CatalogError naming the JSON path of a bad value.
    """
    r = _Reader(obj, "$", source)
    if size is not None and size > MAX_INDEX_BYTES and isinstance(r.obj.get("shards"), list):
        # Refused before anything is validated: only the inline form may be this large.
        raise CatalogError(f"{source}: an index catalog (one listing shards) is {size} bytes, over the "
                           f"{MAX_INDEX_BYTES} it may have (catalog.MAX_INDEX_BYTES); rebuild the image folder")
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
        return triton_version, tuning, refs, ()
    raw = r.list("variants")
    if len(raw) > MAX_INLINE_VARIANTS:
        raise r._fail("variants", f"an inline list of at most {MAX_INLINE_VARIANTS} variants", f"{len(raw)} items")
    variants = tuple(Variant.from_json(v, f"$.variants[{i}]", source) for i, v in enumerate(raw))
    _unique_keys(variants, source, "$.variants")
    return triton_version, tuning, None, variants


def index_to_json(triton_version: str, tuning: dict[str, Any], refs: Any) -> dict:
    """The ``catalog.json`` index listing ``refs`` (:class:`ShardRef`)."""
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "triton_version": triton_version,
            "tuning": tuning, "shards": [ref.to_json() for ref in refs]}


def shard_from_json(obj: Any, ref: ShardRef, source: str, index: str) -> tuple[Variant, ...]:
    """Validate a parsed shard file against its entry ``ref`` in the index ``index``; its variants
    in order.
    Raises CatalogError naming the file and JSON path of a bad value."""
    r = _Reader(obj, "$", source)
    if r.str("schema") != SHARD_SCHEMA:
        raise r._fail("schema", f'"{SHARD_SCHEMA}"', r.obj["schema"])
    _check_version(r, source)
    target = Target.from_json(r.sub("target"))
    kernel = r.name("kernel", _KERNEL_NAME, "a kernel name (letters, digits, '_')")
    if target != ref.target or kernel != ref.kernel:
        raise CatalogError(f"{source}: holds {kernel} for {target.backend} {target.arch}, but {index} "
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


def shard_to_json(kernel: str, variants: Any) -> dict:
    """The shard file of ``kernel``'s ``variants`` on one target: what they share stored once
    (target, kernel, Triton version; the ``layouts``, ``rules`` and ``launch_params`` tables),
    each variant pointing into the tables by position, tables in order of first use."""
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
             "kernel": kernel, "triton_version": variants[0].triton_version,
             "layouts": [json.loads(t) for t in layouts], "rules": [json.loads(t) for t in rules],
             "launch_params": [json.loads(t) for t in launches],
             "variants": entries}
    return shard


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
