"""A whole catalog: its index and shards, read lazily and written canonically.

On disk a catalog is an *index* (``catalog.json``: the tuning table and one entry per (backend,
arch, kernel) *shard* with the shard's path, size and sha256) plus the shard files, each holding
one kernel's variants on one target with what they share (argument layouts, grid rules, launch
parameters) stored once and referenced by position. :meth:`Catalog.load` reads only the index; a
shard is read, digest-checked and validated the first time something asks for its variants, so
opening a full image set costs the index alone. :class:`Catalog` is the one writer
(:meth:`Catalog.write`) and reader of that format; the builder makes one with
:meth:`Catalog.new`.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from ..errors import CatalogError
from .files import canonical_bytes, parse_json, read_bounded, write_atomic
from .index import (
    CATALOG_FILE,
    MAX_CATALOG_BYTES,
    MAX_SHARD_BYTES,
    SCHEMA,
    SCHEMA_VERSION,
    ShardRef,
    _unique_keys,
    index_from_json,
    index_to_json,
    shard_from_json,
    shard_path,
    shard_to_json,
)
from .schema import Target, Variant

#: The fix for a catalog.json over MAX_CATALOG_BYTES (an inline catalog left by an older install).
_TOO_LARGE = ("catalog.MAX_CATALOG_BYTES bounds what every Library() parses; a larger catalog must be the "
              "index form with its variants in shard files, as `python -m builder build`, bundle installs "
              "and image wheels write it: reinstall the images (`python -m aotriton_rt download --force`, "
              "or a new image wheel) or rewrite the folder with Catalog.from_json(inline).write(folder)")


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

    @classmethod
    def new(cls, triton_version: str, variants: Any, tuning: dict[str, Any] | None = None, *,
            source: str = "<memory>") -> Catalog:
        """A catalog of ``variants`` (:class:`Variant` objects, e.g. from the builder), validated
        exactly as a loaded one is: what :meth:`write` then puts on disk reads back equal.

        Raises CatalogError naming the variant and field of a bad value.
        """
        return cls.from_json({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "triton_version": triton_version,
                              "tuning": dict(tuning or {}), "variants": [v.to_json() for v in variants]},
                             source=source)

    # -- reading ---------------------------------------------------------------------------
    @classmethod
    def from_json(cls, obj: Any, *, source: str = "<memory>", folder: Path | None = None,
                  size: int | None = None) -> Catalog:
        """Validate a parsed ``catalog.json``: an index of shards (read later from ``folder``)
        or the inline form, whose ``variants`` list every variant in full (what
        :meth:`to_json` returns). ``size``: the file's bytes, when read from one (an index may
        have at most MAX_INDEX_BYTES). Raises CatalogError naming the JSON path of a bad value."""
        triton_version, tuning, refs, variants = index_from_json(obj, source, size)
        if refs is not None:
            return cls(triton_version, (), tuning, folder, source, shards=refs)
        return cls(triton_version, variants, tuning, folder, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Catalog:
        """Read and validate ``catalog.json`` (or the folder holding it); shards are read later.

        The file may have MAX_CATALOG_BYTES in either form (the index form, which the builder,
        bundle installs and image wheels write, also at most MAX_INDEX_BYTES): every Library()
        reads it whole. Raises CatalogError naming the limit and the fix for a larger one."""
        path = Path(path)
        if path.is_dir():
            path = path / CATALOG_FILE
        data = read_bounded(path, MAX_CATALOG_BYTES, "catalog", _TOO_LARGE)
        return cls.from_json(parse_json(data, str(path)), source=str(path), folder=path.parent, size=len(data))

    def _read_shard(self, ref: ShardRef) -> tuple[Variant, ...]:
        if self.folder is None:
            raise CatalogError(f"{self.source}: shard {ref.path} cannot be read: the catalog has no folder")
        file = self.folder.joinpath(*ref.path.split("/"))
        source = str(file)
        data = read_bounded(file, MAX_SHARD_BYTES, "catalog shard")
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            raise CatalogError(f"{source}: does not match its entry in {self.source} (size {len(data)}, "
                               f"index says {ref.size}, or sha256 differs); reinstall or rebuild the image folder")
        return shard_from_json(parse_json(data, source), ref, source, self.source)

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
            shard = shard_to_json(key[2], variants)
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
    return json.dumps(index_to_json(triton_version, tuning, refs), indent=1, sort_keys=True).encode() + b"\n"


def _order(v: Variant) -> tuple:
    return (v.target.backend, v.target.arch, v.kernel, v.key)
