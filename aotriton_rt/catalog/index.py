"""The two files of a catalog: the index (``catalog.json``) and the shards it lists.

An image folder's ``catalog.json`` is the *index* (the tuning table and one entry per
(backend, arch, kernel) shard: path, size, sha256) or, for small hand-written and test catalogs,
the *inline* form listing every variant in full; a *shard* (``variants.json`` beside a kernel's
images) holds one kernel's variants on one target with what they share (argument layouts, grid
rules, launch parameters) stored once and referenced by position. This module gives their JSON
shapes (:func:`index_from_json`, :func:`shard_from_json`, and their inverses), names, size
limits and where they and the images sit in a folder. One entry's fields are :mod:`.schema`;
reading the files from disk, lazily and digest-checked, is :mod:`.store`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import CatalogError
from ..tuning import validate_table as validate_tuning
from .reader import _Reader
from .schema import (
    _KERNEL_NAME,
    Target,
    Variant,
    _launch_from_json,
    _layout_from_json,
    _relative_path,
    _rules_from_json,
    _sha256,
    _Shared,
)

SCHEMA = "aotriton-rt.catalog"
SHARD_SCHEMA = "aotriton-rt.catalog-shard"
SCHEMA_VERSION = 2
CATALOG_FILE = "catalog.json"
#: A shard's file name, in the folder of its kernel's images: ``<backend>/<arch>/<kernel>/``.
SHARD_FILE = "variants.json"

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

_LAUNCH_FIELDS = ("scratch", "num_warps", "num_ctas", "cluster_dims", "shared", "launch")


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
