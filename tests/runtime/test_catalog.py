"""The catalog schema: round trips, canonical text, and rejection of malformed catalogs.

Every rejection must name the file and the JSON path of the bad value, so a user can find it
in a catalog of thousands of variants; the messages are pinned here.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from aotriton_rt.catalog import CATALOG_FILE, SCHEMA, SCHEMA_VERSION, Catalog, Variant
from aotriton_rt.errors import AotritonError, CatalogError


def _variant(backend: str = "cuda", arch: str = "sm90", key: str = "1" * 64) -> dict:
    """One variant as the builder writes it (taken from a real add@sm90 build)."""
    fmt = "cubin" if backend == "cuda" else "hsaco"
    return {
        "key": key, "kernel": "add", "symbol": "add_kernel",
        "target": {"backend": backend, "arch": arch, "warp_size": 32 if backend == "cuda" else 64},
        "spec": {"dtype": "fp32"},
        "config": {"index": 0, "constexprs": {"BLOCK": 1024}, "num_warps": 4, "num_stages": 1,
                   "options": {}},
        "args": [
            {"name": "x_ptr", "type": "*fp32", "offset": 0, "size": 8, "align": 8, "divisibility": 16},
            {"name": "y_ptr", "type": "*fp32", "offset": 8, "size": 8, "align": 8, "divisibility": 16},
            {"name": "out_ptr", "type": "*fp32", "offset": 16, "size": 8, "align": 8,
             "divisibility": 16},
            {"name": "n", "type": "i64", "offset": 24, "size": 8, "align": 8},
        ],
        "hidden_args": [
            {"name": "global_scratch", "type": "*i8", "offset": 32, "size": 8, "align": 8},
            {"name": "profile_scratch", "type": "*i8", "offset": 40, "size": 8, "align": 8},
        ],
        "param_size": 48,
        "scratch": {"global_size": 0, "global_align": 1, "profile_size": 0, "profile_align": 1},
        "num_warps": 4, "num_ctas": 1, "cluster_dims": [1, 1, 1], "shared": 0,
        "launch": {"cooperative": False, "pdl": False},
        "grid": ["cdiv(n, BLOCK)", "1", "1"],
        "checks": [],
        "image": {"path": f"{backend}/{arch}/add/add-{key[:16]}.{fmt}.xz", "format": fmt,
                  "compression": "xz", "sha256": "a" * 64, "size": 1272, "raw_sha256": "b" * 64,
                  "raw_size": 4824},
        "triton_version": "3.6.0",
    }


def _catalog(*variants: dict) -> dict:
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "triton_version": "3.6.0",
            "tuning": {}, "variants": list(variants) or [_variant()]}


def _set(obj: Any, path: str, value: Any) -> None:
    """Set ``value`` at a JSON path like ``variants[0].args[1].offset`` (no leading ``$.``)."""
    steps = [int(s) if s.isdigit() else s for s in re.findall(r"[^.\[\]]+", path)]
    for step in steps[:-1]:
        obj = obj[step]
    if value is _DELETE:
        del obj[steps[-1]]
    else:
        obj[steps[-1]] = value


_DELETE = object()


# --------------------------------------------------------------------------- round trips


def test_catalog_round_trips_through_json_unchanged() -> None:
    obj = _catalog(_variant("hip", "gfx942", "2" * 64), _variant("cuda", "sm90", "1" * 64))
    cat = Catalog.from_json(obj)
    again = Catalog.from_json(json.loads(cat.dumps()))
    assert again.to_json() == cat.to_json()
    # Equal as dataclasses, not only as JSON: nothing is lost or retyped on the way.
    assert sorted(again.variants, key=lambda v: v.key) == sorted(cat.variants, key=lambda v: v.key)
    assert {v["key"]: v for v in cat.to_json()["variants"]} == {v["key"]: v for v in obj["variants"]}


def test_catalog_text_is_canonical_whatever_the_input_order() -> None:
    a, b = _variant("hip", "gfx942", "2" * 64), _variant("cuda", "sm90", "1" * 64)
    shuffled = {k: v for k, v in reversed(list(_catalog(b, a).items()))}
    shuffled["variants"] = [{k: v for k, v in reversed(list(x.items()))} for x in shuffled["variants"]]
    text = Catalog.from_json(_catalog(a, b)).dumps()
    assert Catalog.from_json(shuffled).dumps() == text
    # Variants come out ordered by backend, arch, kernel, key: cuda before hip.
    assert [v["target"]["arch"] for v in json.loads(text)["variants"]] == ["sm90", "gfx942"]
    assert text.endswith("}\n")


def test_catalog_load_accepts_the_file_or_its_folder(tmp_path: Path) -> None:
    (tmp_path / CATALOG_FILE).write_text(json.dumps(_catalog()))
    by_file = Catalog.load(tmp_path / CATALOG_FILE)
    by_folder = Catalog.load(tmp_path)
    assert by_file.variants == by_folder.variants
    assert by_folder.folder == tmp_path
    assert by_folder.source == str(tmp_path / CATALOG_FILE)


def test_variant_exposes_launch_facts_derived_from_its_fields() -> None:
    v = Catalog.from_json(_catalog(_variant("hip", "gfx942"))).variants[0]
    assert isinstance(v, Variant)
    assert v.num_threads == 4 * 64
    assert v.params == {"dtype": "fp32", "BLOCK": 1024}
    assert [a.is_pointer for a in v.args] == [True, True, True, False]
    assert [a.divisibility for a in v.args] == [16, 16, 16, 1]
    assert [a.name for a in v.hidden_args] == ["global_scratch", "profile_scratch"]
    assert v.cluster_dims == (1, 1, 1) and v.cooperative is False and v.pdl is False


def test_catalog_omits_a_divisibility_of_one_when_written() -> None:
    v = _variant()
    v["args"][3]["divisibility"] = 1
    written = Catalog.from_json(_catalog(v)).to_json()["variants"][0]["args"]
    assert "divisibility" not in written[3]
    assert written[0]["divisibility"] == 16


def test_catalog_defaults_optional_fields() -> None:
    v = _variant()
    for key in ("checks", "cluster_dims"):
        del v[key]
    del v["args"][0]["divisibility"]
    del v["config"]["options"]
    obj = _catalog(v)
    del obj["tuning"]
    parsed = Catalog.from_json(obj).variants[0]
    assert parsed.checks == () and parsed.cluster_dims == (1, 1, 1)
    assert parsed.args[0].divisibility == 1 and parsed.config.options == {}


def test_catalog_lists_its_targets_once_each() -> None:
    cat = Catalog.from_json(_catalog(_variant("hip", "gfx942", "3" * 64), _variant("cuda", "sm90", "1" * 64),
                                     _variant("cuda", "sm90", "2" * 64)))
    assert [(t.backend, t.arch) for t in cat.targets()] == [("cuda", "sm90"), ("hip", "gfx942")]


# --------------------------------------------------------------------------- file-level errors


def test_catalog_load_of_a_missing_file_says_which(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match=r"cannot read catalog .*nowhere.*catalog\.json"):
        Catalog.load(tmp_path / "nowhere" / CATALOG_FILE)


def test_catalog_load_of_broken_json_gives_line_and_column(tmp_path: Path) -> None:
    (tmp_path / CATALOG_FILE).write_text('{"schema": "aotriton-rt.catalog",\n "variants": [,]}')
    with pytest.raises(CatalogError, match=r"catalog\.json: not valid JSON \(line 2, column 15: "):
        Catalog.load(tmp_path)


def test_catalog_errors_name_the_file_and_the_json_path(tmp_path: Path) -> None:
    obj = _catalog()
    obj["variants"][0]["args"][1]["offset"] = 3
    (tmp_path / CATALOG_FILE).write_text(json.dumps(obj))
    with pytest.raises(CatalogError) as info:
        Catalog.load(tmp_path)
    assert str(info.value) == (f"{tmp_path / CATALOG_FILE}: $.variants[0].args[1].offset must be a "
                               "multiple of align 8, found 3")
    assert isinstance(info.value, AotritonError)


def test_catalog_rejects_another_schema() -> None:
    obj = _catalog()
    obj["schema"] = "aotriton.catalog"
    with pytest.raises(CatalogError, match=r'^x\.json: \$\.schema must be "aotriton-rt\.catalog", '
                                           r'found "aotriton\.catalog"$'):
        Catalog.from_json(obj, source="x.json")


def test_catalog_rejects_a_newer_schema_version_and_says_to_upgrade() -> None:
    obj = _catalog()
    obj["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(CatalogError, match=rf"x\.json: catalog schema_version {SCHEMA_VERSION + 1} is not "
                                           rf"understood by this runtime \(it reads version "
                                           rf"{SCHEMA_VERSION}\); upgrade aotriton-rt "
                                           r"\(pip install -U aotriton-rt\)"):
        Catalog.from_json(obj, source="x.json")


def test_catalog_rejects_an_older_schema_version_and_says_to_rebuild() -> None:
    obj = _catalog()
    obj["schema_version"] = 0
    # 0 is below the minimum of 1, so it fails as a malformed value, not as an old version.
    with pytest.raises(CatalogError, match=r"\$\.schema_version must be an integer >= 1, found 0"):
        Catalog.from_json(obj, source="x.json")


def test_catalog_rejects_a_repeated_variant_key() -> None:
    with pytest.raises(CatalogError, match=r"\$\.variants\[1\]\.key repeats \$\.variants\[0\]\.key "
                                           r"\(1111111111111111\.\.\.\)"):
        Catalog.from_json(_catalog(_variant(), _variant()), source="x.json")


# --------------------------------------------------------------------------- field-level errors

# (JSON path to change, new value, the message after "x.json: ")
MALFORMED = [
    ("variants", {}, r"\$\.variants must be a list, found an object"),
    ("variants[0]", 3, r"\$\.variants\[0\] must be an object, found 3"),
    ("triton_version", 3.6, r"\$\.triton_version must be a string, found 3\.6"),
    ("tuning", [], r"\$\.tuning must be an object, found \[\]"),
    ("variants[0].key", "X" * 64, r"\$\.variants\[0\]\.key must be 64 lowercase hex digits, found \"XXX"),
    ("variants[0].symbol", _DELETE, r"\$\.variants\[0\]\.symbol is missing"),
    ("variants[0].kernel", None, r"\$\.variants\[0\]\.kernel must be a string, found null"),
    ("variants[0].target.backend", "rocm", r"\$\.variants\[0\]\.target\.backend must be one of cuda, hip, "
                                           r"found \"rocm\""),
    ("variants[0].target.arch", "gfx942", r"\$\.variants\[0\]\.target\.arch must be a cuda arch name like "
                                          r"sm90, found \"gfx942\""),
    ("variants[0].target.warp_size", 16, r"\$\.variants\[0\]\.target\.warp_size must be 32 or 64, found 16"),
    ("variants[0].spec.dtype", ["fp32"], r"\$\.variants\[0\]\.spec\.dtype must be a string, number or "
                                         r"boolean, found \[\"fp32\"\]"),
    ("variants[0].config.num_warps", 0, r"\$\.variants\[0\]\.config\.num_warps must be an integer in \[1, 64\], "
                                        r"found 0"),
    ("variants[0].config.options.waves_per_eu", {}, r"\$\.variants\[0\]\.config\.options\.waves_per_eu must "
                                                    r"be a string, number or boolean"),
    ("variants[0].args", "x_ptr", r"\$\.variants\[0\]\.args must be a list, found \"x_ptr\""),
    ("variants[0].args[1].offset", 3, r"\$\.variants\[0\]\.args\[1\]\.offset must be a multiple of align 8, "
                                      r"found 3"),
    ("variants[0].args[1].offset", 4, r"\$\.variants\[0\]\.args\[1\]\.offset must be a multiple of align 8, "
                                      r"found 4"),
    ("variants[0].args[2].offset", 0, r"\$\.variants\[0\]\.args\[2\]\.offset 0 overlaps the previous "
                                      r"argument, which ends at 16"),
    ("variants[0].args[1].offset", -8, r"\$\.variants\[0\]\.args\[1\]\.offset must be an integer in \[0, 32764\], "
                                       r"found -8"),
    ("variants[0].args[0].type", "*fp17", r"\$\.variants\[0\]\.args\[0\]\.type must be a Triton type like "
                                          r"\*fp16, i32, i64 or fp32, found \"\*fp17\""),
    ("variants[0].args[0].size", 4, r"\$\.variants\[0\]\.args\[0\]\.size must be 8 for type \*fp32, found 4"),
    ("variants[0].args[3].size", True, r"\$\.variants\[0\]\.args\[3\]\.size must be an integer in \[1, 8\], "
                                       r"found true"),
    ("variants[0].args[1].name", "x_ptr", r"\$\.variants\[0\]\.args must be a list of uniquely named "
                                          r"arguments, found \[\"x_ptr\", \"x_ptr\""),
    ("variants[0].hidden_args[0].offset", 24, r"\$\.variants\[0\]\.hidden_args\[0\]\.offset 24 overlaps "
                                              r"the previous argument, which ends at 32"),
    ("variants[0].param_size", 40, r"\$\.variants\[0\]\.param_size must be at least 48, the end of the "
                                   r"last argument, found 40"),
    ("variants[0].scratch.global_align", 0, r"\$\.variants\[0\]\.scratch\.global_align must be an integer "
                                            r"in \[1, 65536\], found 0"),
    ("variants[0].scratch", _DELETE, r"\$\.variants\[0\]\.scratch is missing"),
    ("variants[0].cluster_dims", [1, 1], r"\$\.variants\[0\]\.cluster_dims must be three integers >= 1 "
                                         r"whose product is at most 16, found \[1, 1\]"),
    ("variants[0].num_warps", True, r"\$\.variants\[0\]\.num_warps must be an integer in \[1, 64\], found true"),
    ("variants[0].shared", -1, r"\$\.variants\[0\]\.shared must be an integer in \[0, 16777216\], found -1"),
    ("variants[0].launch.pdl", "no", r"\$\.variants\[0\]\.launch\.pdl must be true or false, found \"no\""),
    ("variants[0].grid", ["n", "1"], r"\$\.variants\[0\]\.grid must be three expression strings, "
                                     r"found \[\"n\", \"1\"\]"),
    ("variants[0].checks", ["n > 0", ""], r"\$\.variants\[0\]\.checks\[1\] must be a non-empty string of at "
                                          r"most 1000 characters, "
                                          r"found \"\""),
    ("variants[0].image.path", "../add.cubin.xz", r"\$\.variants\[0\]\.image\.path must be a relative "
                                                  r"'/'-separated path inside the image folder"),
    ("variants[0].image.path", "/etc/add.cubin.xz", r"\$\.variants\[0\]\.image\.path must be a relative"),
    ("variants[0].image.path", "cuda\\sm90\\a.xz", r"\$\.variants\[0\]\.image\.path must be a relative"),
    ("variants[0].image.format", "hsaco", r"\$\.variants\[0\]\.image\.format must be cubin for backend "
                                          r"cuda, found \"hsaco\""),
    ("variants[0].image.format", "ptx", r"\$\.variants\[0\]\.image\.format must be cubin or hsaco, "
                                        r"found \"ptx\""),
    ("variants[0].image.compression", "gzip", r"\$\.variants\[0\]\.image\.compression must be xz or none, "
                                              r"found \"gzip\""),
    ("variants[0].image.sha256", "A" * 64, r"\$\.variants\[0\]\.image\.sha256 must be 64 lowercase hex "
                                           r"digits"),
    ("variants[0].image.raw_size", 0, r"\$\.variants\[0\]\.image\.raw_size must be an integer in \[1, 1073741824\], "
                                      r"found 0"),
    ("variants[0].triton_version", _DELETE, r"\$\.variants\[0\]\.triton_version is missing"),
]


@pytest.mark.parametrize(("path", "value", "message"), MALFORMED,
                         ids=[f"{p}={'<deleted>' if v is _DELETE else json.dumps(v)[:20]}"
                              for p, v, _ in MALFORMED])
def test_catalog_rejects_a_malformed_field_naming_its_json_path(path: str, value: Any, message: str) -> None:
    obj = copy.deepcopy(_catalog())
    _set(obj, path, value)
    with pytest.raises(CatalogError, match=r"^x\.json: " + message):
        Catalog.from_json(obj, source="x.json")


def test_catalog_error_shortens_a_long_offending_value() -> None:
    obj = _catalog()
    obj["variants"][0]["kernel"] = ["k" * 100]
    with pytest.raises(CatalogError) as info:
        Catalog.from_json(obj, source="x.json")
    assert str(info.value).endswith('found ["' + "k" * 55 + "...")
    assert len(str(info.value)) < 150


def test_catalog_rejects_a_hip_arch_spelled_like_a_cuda_one() -> None:
    v = _variant("hip", "gfx942")
    v["target"]["arch"] = "sm90"
    with pytest.raises(CatalogError, match=r"\$\.variants\[0\]\.target\.arch must be a hip arch name like "
                                           r"gfx942, found \"sm90\""):
        Catalog.from_json(_catalog(v), source="x.json")


# --------------------------------------------------------------------------- Catalog.new (what the builder makes)


def test_a_catalog_made_from_variants_in_memory_writes_what_loading_reads(tmp_path: Path) -> None:
    made = [Variant.from_json(_variant(key=k), "$", "<test>") for k in ("2" * 64, "1" * 64)]
    tuning = {"add": [{"arch": "sm90", "config": 0}]}
    cat = Catalog.new("3.6.0", made, tuning, source="<built>")
    cat.write(tmp_path)
    back = Catalog.load(tmp_path)
    assert back.variants == tuple(sorted(made, key=lambda v: v.key)) and back.tuning == tuning


def test_a_catalog_made_in_memory_is_validated_like_a_loaded_one() -> None:
    import dataclasses

    good = Variant.from_json(_variant(), "$", "<test>")
    bad = dataclasses.replace(good, args=(dataclasses.replace(good.args[0], offset=3),) + good.args[1:])
    with pytest.raises(CatalogError, match=r"<built>: \$\.variants\[0\]\.args\[0\]\.offset must be a multiple of "
                                           r"align 8, found 3"):
        Catalog.new("3.6.0", [bad], source="<built>")
