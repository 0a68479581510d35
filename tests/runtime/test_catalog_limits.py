"""The index form's bounds (issue 25): a valid ``catalog.json`` index at today's caps must load
cheaply on every ``Library()``, and one just past a cap is refused with a CatalogError naming it.

A full build (``python -m builder list --set full``: 37,770 variants for 7 targets) has 88
shards and a tuning table of 7 kernels, 96 rules; the index built here is that scale with an
sm90-sized tuning table for *every* target (~700 rules), which no build has yet. The shard
files need not exist: opening a library reads the index only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aotriton_rt import tuning
from aotriton_rt.catalog import CATALOG_FILE, MAX_CATALOG_BYTES, MAX_INDEX_BYTES, SCHEMA, SCHEMA_VERSION, Catalog
from aotriton_rt.catalog.index import MAX_SHARDS
from aotriton_rt.errors import CatalogError
from aotriton_rt.library import Library

TARGETS = [("cuda", "sm80", 32), ("cuda", "sm90", 32), ("hip", "gfx90a", 64), ("hip", "gfx942", 64),
           ("hip", "gfx950", 64), ("hip", "gfx1100", 32), ("hip", "gfx1201", 32)]
KERNELS = ["add", "attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_dq_convert", "attn_bwd_preprocess", "attn_decode",
           "attn_decode_append", "attn_decode_combine", "attn_fwd", "layernorm", "rmsnorm", "softmax"]
SM90_ONLY = ["attn_bwd_dkdv_sm90", "attn_bwd_dkdv_sm90_a16", "attn_bwd_dq_sm90", "attn_fwd_sm90"]
#: One rule as the sm90 tuning database writes it (the longest kind: spec, range, source).
RULE = {"arch": "sm90", "config": 1, "seqlen_q": [None, 2047],
        "source": "tuning database sm90 (NVIDIA H200), measured at seqlen_q 1024..1024",
        "spec": {"BIAS": 0, "CAUSAL": 0, "DROPOUT": 0, "HEAD_DIM": 128, "HEAD_DIM_V": 128, "VARLEN": 0,
                 "dtype": "bf16"}}


def _shard(backend: str, arch: str, warp: int, kernel: str, i: int = 0) -> dict:
    return {"arch": arch, "backend": backend, "kernel": kernel, "path": f"{backend}/{arch}/{kernel}/variants.json",
            "sha256": f"{i:064x}", "size": 4_000_000, "variants": 2656, "warp_size": warp}


def _index(shards: list, table: dict) -> dict:
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "triton_version": "3.6.0", "tuning": table,
            "shards": shards}


def _full_index() -> dict:
    shards = [_shard(b, a, w, k) for b, a, w in TARGETS for k in KERNELS]
    shards += [_shard("cuda", "sm90", 32, k) for k in SM90_ONLY]
    rules = {"attn_bwd_dkdv_kernel": 17, "attn_bwd_dq_kernel": 15, "attn_bwd_mode": 10, "attn_fwd": 18,
             "attn_fwd_kernel": 10, "attn_fwd_sm90": 18, "attn_decode": 8}
    table = {k: [{**RULE, "arch": a} for _, a, _ in TARGETS for _ in range(n)] for k, n in rules.items()}
    for k in ("attn_bwd_mode",):
        table[k] = [{**r, "mode": "split"} for r in table[k]]
    for k in ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
        table[k] = [{**r, "kernel": "attn_fwd"} for r in table[k]]
    return _index(shards, table)


def _write(folder: Path, obj: dict, size: int | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    if size is not None:
        assert len(data) <= size
        data += b" " * (size - len(data))  # JSON whitespace: the same catalog, this many bytes
    (folder / CATALOG_FILE).write_bytes(data)
    return folder


def test_a_full_build_sized_index_loads_far_under_the_caps(tmp_path) -> None:
    index = _full_index()
    folder = _write(tmp_path / "img", index)
    size = (folder / CATALOG_FILE).stat().st_size
    lib = Library(folder)
    assert len(lib.catalogs[0].target_kernels()) == 88
    assert sum(len(r) for r in lib.catalogs[0].tuning.values()) == 96 * 7
    # The margins the caps promise: at least ten times this (already generous) index.
    assert size * 10 <= MAX_INDEX_BYTES, size
    assert 88 * 10 <= MAX_SHARDS
    assert 96 * 7 * 10 <= tuning._MAX_TOTAL_RULES
    assert 18 * 7 * 8 <= tuning._MAX_RULES and 7 * 10 <= tuning._MAX_KERNELS


def test_an_index_one_byte_past_its_cap_is_refused_naming_the_limit(tmp_path) -> None:
    folder = _write(tmp_path / "img", _full_index(), MAX_INDEX_BYTES + 1)
    with pytest.raises(CatalogError, match=rf"catalog .*catalog\.json is {MAX_INDEX_BYTES + 1} bytes, over the "
                                           rf"limit of {MAX_INDEX_BYTES}; catalog\.MAX_CATALOG_BYTES bounds"):
        Library(folder)
    _write(tmp_path / "ok", _full_index(), MAX_INDEX_BYTES)
    Library(tmp_path / "ok")


def test_an_inline_catalog_over_the_cap_is_refused_naming_the_limit_and_the_fix(tmp_path) -> None:
    """What an older runtime's bundle or wheel install left in its folder: the inline form, up
    to 64 MiB (a full sm90 set is ~50 MB), 15 s and 471 MiB per Library(). The folder's
    catalog.json now has the index's cap in either form; installs write the index form."""
    inline = {**_index([], {"attn_fwd": [RULE]}), "variants": []}
    del inline["shards"]
    assert MAX_CATALOG_BYTES == MAX_INDEX_BYTES
    _write(tmp_path / "img", inline, MAX_CATALOG_BYTES + 1)
    with pytest.raises(CatalogError, match=rf"catalog\.json is {MAX_CATALOG_BYTES + 1} bytes, over the limit of "
                                           rf"{MAX_CATALOG_BYTES}; catalog\.MAX_CATALOG_BYTES bounds what every "
                                           r"Library\(\) parses; a larger catalog must be the index form with its "
                                           r"variants in shard files.*reinstall the images \(`python -m "
                                           r"aotriton_rt download --force`.*Catalog\.from_json\(inline\)"
                                           r"\.write\(folder\)"):
        Library(tmp_path / "img")
    # At the cap, a small hand-written or test catalog still works inline.
    _write(tmp_path / "ok", inline, MAX_CATALOG_BYTES)
    assert Catalog.load(tmp_path / "ok").tuning == {"attn_fwd": [RULE]}


def test_an_index_of_one_shard_too_many_is_refused_naming_the_limit(tmp_path) -> None:
    shards = [_shard("cuda", "sm90", 32, f"k{i}", i) | {"path": f"s/{i}.json"} for i in range(MAX_SHARDS + 1)]
    _write(tmp_path / "img", _index(shards, {}))
    with pytest.raises(CatalogError, match=rf"\$\.shards must be a list of at most {MAX_SHARDS} entries, "
                                           rf'found "{MAX_SHARDS + 1} items"'):
        Library(tmp_path / "img")
    del shards[-1]
    _write(tmp_path / "ok", _index(shards, {}))
    assert len(Library(tmp_path / "ok").catalogs[0].target_kernels()) == MAX_SHARDS


def _rules(kernels: int, per_kernel: int) -> dict:
    return {f"k{i}": [{"config": 1}] * per_kernel for i in range(kernels)}


@pytest.mark.parametrize(("table", "message"), [
    (_rules(tuning._MAX_KERNELS + 1, 0), rf"\$\.tuning names {tuning._MAX_KERNELS + 1} kernels; "
                                         rf"at most {tuning._MAX_KERNELS} are read"),
    (_rules(1, tuning._MAX_RULES + 1), rf"tuning\['k0'\] has {tuning._MAX_RULES + 1} rules; "
                                       rf"at most {tuning._MAX_RULES} are read"),
    (_rules(tuning._MAX_TOTAL_RULES // tuning._MAX_RULES + 1, tuning._MAX_RULES),
     rf"\$\.tuning has {tuning._MAX_TOTAL_RULES + tuning._MAX_RULES} rules in all; "
     rf"at most {tuning._MAX_TOTAL_RULES} are read"),
], ids=["kernels", "rules-per-kernel", "rules-in-all"])
def test_a_tuning_table_past_a_cap_is_refused_naming_the_limit(tmp_path, table, message) -> None:
    _write(tmp_path / "img", _index([_shard("cuda", "sm90", 32, "add")], table))
    with pytest.raises(CatalogError, match=message):
        Library(tmp_path / "img")


def test_a_tuning_table_at_every_cap_loads(tmp_path) -> None:
    table = _rules(tuning._MAX_TOTAL_RULES // tuning._MAX_RULES, tuning._MAX_RULES)
    table.update(_rules(tuning._MAX_KERNELS, 0) | table)
    _write(tmp_path / "img", _index([_shard("cuda", "sm90", 32, "add")], table))
    assert sum(map(len, Library(tmp_path / "img").catalogs[0].tuning.values())) == tuning._MAX_TOTAL_RULES
