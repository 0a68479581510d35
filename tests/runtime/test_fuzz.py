"""Fuzzing the parsers and the launch path with hypothesis (issue 9).

Every input either parses or raises the module's typed error: never another exception, never a
hang, never a write outside the destination, never a launch the driver should not see. Runs are
derandomized (reproducible in CI) and sized to finish in well under two minutes on two cores.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from aotriton_rt.arguments import Packer, compile_expr  # noqa: E402
from aotriton_rt.bundles.format import parse_manifest  # noqa: E402
from aotriton_rt.catalog import SCALAR_TYPES, Catalog, parse_json  # noqa: E402
from aotriton_rt.download import check_member_name, install_file, parse_index  # noqa: E402
from aotriton_rt.errors import (  # noqa: E402
    AotritonError,
    ArgumentError,
    BundleError,
    CatalogError,
    LaunchError,
)
from tests.runtime.test_catalog import _catalog, _variant  # noqa: E402
from tests.runtime.test_decode_bounds import recording  # noqa: E402,F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture])

json_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                | st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)


def _paths(obj, prefix=()):
    """Every (path, container) inside a JSON value, to pick a place to mutate."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate(obj, data, values=json_values):
    obj = copy.deepcopy(obj)
    paths = [p for p in _paths(obj) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        action = data.draw(st.sampled_from(["set", "delete", "numeric"]))
        try:
            parent = obj
            for step in path[:-1]:  # an earlier mutation may have replaced part of the path
                parent = parent[step]
            if action == "delete":
                del parent[path[-1]]
            elif action == "numeric":
                parent[path[-1]] = data.draw(st.sampled_from([-1, 0, 1, 2**31, 2**32 + 2, 2**63, 2**64, 10**30]))
            else:
                parent[path[-1]] = data.draw(values)
        except (KeyError, IndexError, TypeError):
            pass
    return obj


# --------------------------------------------------------------------------- catalogs


@FUZZ
@given(st.data())
def test_mutated_catalog_loads_or_raises_a_catalog_error_and_what_loads_packs(data):
    obj = _mutate(_catalog(_variant(), _variant("hip", "gfx942", "2" * 64)), data)
    try:
        cat = Catalog.from_json(obj, source="fuzz.json")
    except CatalogError:
        return
    for v in cat.variants:
        p = Packer(v)  # a catalog that loads must give a packer without any other error
        assert p.struct.size == v.param_size
        assert Catalog.from_json(json.loads(cat.dumps())).to_json() == cat.to_json()


@FUZZ
@given(st.binary(max_size=300) | st.text(max_size=200).map(str.encode))
def test_catalog_bytes_parse_or_raise_a_catalog_error(raw):
    try:
        Catalog.from_json(parse_json(raw, "fuzz.json"), source="fuzz.json")
    except CatalogError:
        pass


@settings(FUZZ, max_examples=30)
@given(st.integers(1, 200_000), st.sampled_from(["[", "{\"a\":", "[[{\"b\":"]))
def test_nesting_of_any_depth_is_a_catalog_error(depth, opener):
    closer = {"[": "]", "{\"a\":": "}", "[[{\"b\":": "}]]"}[opener]
    text = (opener * depth + "0" + closer * depth).encode()
    with pytest.raises(CatalogError):
        Catalog.from_json(parse_json(text, "deep.json"), source="deep.json")


# --------------------------------------------------------------------------- rules


def _expr(names):
    leaf = st.sampled_from(names) | st.integers(-5, 2000).map(str)
    def infix(ops):
        return lambda kid: st.tuples(kid, st.sampled_from(ops), kid).map(lambda t: f"({t[0]} {t[1]} {t[2]})")
    arith, compare = infix(["+", "-", "*", "//", "%"]), infix(["<", "<=", "==", "!=", ">", ">="])
    return st.recursive(leaf, lambda kid: st.one_of(
        arith(kid), compare(kid),
        st.tuples(st.sampled_from(["cdiv", "min", "max"]), kid, kid).map(lambda t: f"{t[0]}({t[1]}, {t[2]})"),
        kid.map(lambda k: f"(-{k})"),
        st.tuples(kid, st.sampled_from(["and", "or"]), kid).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
    ), max_leaves=10)


def _reference(text, env):
    """An independent evaluator of the rule language: Python itself, with no builtins."""
    funcs = {"cdiv": lambda a, b: -(-a // b), "min": min, "max": max}
    return eval(text, {"__builtins__": {}, **funcs}, env)  # noqa: S307 - test oracle over generated text


@FUZZ
@given(_expr(["n", "m", "B"]), st.integers(-10**6, 10**6), st.integers(-10**6, 10**6))
def test_compiled_rules_agree_with_a_reference_evaluator(text, n, m):
    try:
        f = compile_expr(text, ["n", "m"], {"B": 128}, "rule")
    except CatalogError as e:  # a literal zero divisor is refused when the catalog loads
        assert "divides by a compile-time zero" in str(e) and any(z in text for z in (", 0)", "// 0)", "% 0)"))
        return
    try:
        want = _reference(text, {"n": n, "m": m, "B": 128})
    except ZeroDivisionError:
        with pytest.raises(LaunchError, match="divides by zero"):
            f(n, m)
        return
    assert f(n, m) == want


@FUZZ
@given(st.text(alphabet="nmB()_+-*/%<>=!, 0123456789abcdefghijklmnopqrstuvwxyz.[]{}'\"\\:;@~^&|", max_size=60))
def test_any_rule_text_compiles_or_raises_a_catalog_error(text):
    try:
        f = compile_expr(text, ["n", "m"], {"B": 128}, "rule")
    except CatalogError:
        return
    try:
        f(7, 3)
    except LaunchError:
        pass


# --------------------------------------------------------------------------- index, manifest, member names

_INDEX = {"schema": "aotriton-rt.bundle-index", "schema_version": 1, "bundle_schema_version": 1,
          "catalog_schema_version": 2,
          "bundles": [{"name": "hip-gfx942", "file": "hip-gfx942.tar", "backend": "hip", "targets": ["gfx942"],
                       "size": 100, "sha256": "a" * 64}]}
_MANIFEST = {"schema": "aotriton-rt.bundle", "schema_version": 1, "name": "hip-gfx942", "backend": "hip",
             "targets": ["gfx942"], "catalog_schema_version": 2,
             "files": [{"path": "catalog.json", "size": 10, "sha256": "b" * 64},
                       {"path": "hip/gfx942/add/add.hsaco.xz", "size": 10, "sha256": "c" * 64}]}


@FUZZ
@given(st.data())
def test_mutated_index_parses_or_raises_a_typed_error(data):
    raw = json.dumps(_mutate(_INDEX, data)).encode()
    try:
        parse_index(raw, "index.json")
    except (BundleError, CatalogError):
        pass


@FUZZ
@given(st.data())
def test_mutated_manifest_parses_or_raises_a_typed_error(data):
    raw = json.dumps(_mutate(_MANIFEST, data)).encode()
    try:
        parse_manifest(raw, "bundle.json", 1 << 30)
    except (BundleError, CatalogError):
        pass


@FUZZ
@given(st.text(max_size=80) | st.sampled_from(["../x", "a/../../b", "/etc/x", "C:/x", "a\\b", "aux.txt", "a/./b"]))
def test_member_names_are_safe_or_refused(name):
    try:
        check_member_name(name)
    except BundleError:
        return
    parts = name.split("/")
    assert not name.startswith("/") and ".." not in parts and "" not in parts and "\\" not in name


# --------------------------------------------------------------------------- tar members


_KINDS = [tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE,
          tarfile.GNUTYPE_SPARSE, tarfile.CONTTYPE]


@settings(FUZZ, max_examples=60)
@given(st.lists(st.tuples(st.sampled_from(["bundle.json", "catalog.json", "hip/a.xz", "../evil", "/tmp/aotriton-fuzz",
                                           "hip/../../evil", "x" * 300, "hip/é"]),
                          st.sampled_from(_KINDS), st.binary(max_size=64),
                          st.dictionaries(st.sampled_from(["path", "size", "linkpath", "GNU.sparse.major",
                                                           "GNU.sparse.minor", "GNU.sparse.map"]),
                                          st.text(max_size=10), max_size=2)), min_size=1, max_size=5),
       st.booleans())
def test_hostile_tar_members_never_escape_and_raise_a_typed_error(tmp_path, members, manifest_first):
    case = tmp_path / f"case-{os.urandom(4).hex()}"
    case.mkdir()
    bundle = case / "b.tar"
    manifest = json.dumps(_MANIFEST).encode()
    with tarfile.open(bundle, "w", format=tarfile.PAX_FORMAT) as tar:
        if manifest_first:
            info = tarfile.TarInfo("bundle.json")
            info.size = len(manifest)
            tar.addfile(info, io.BytesIO(manifest))
        for name, kind, body, pax in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.size = len(body) if kind == tarfile.REGTYPE else 0
            info.linkname = "/etc/passwd" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
            info.pax_headers = pax
            try:
                tar.addfile(info, io.BytesIO(body) if info.size else None)
            except (ValueError, UnicodeError):
                pass
    dest = case / "images"
    try:
        install_file(bundle, dest=dest)
    except AotritonError:
        pass
    assert not (case / "evil").exists() and not (tmp_path / "evil").exists()
    assert not Path("/tmp/aotriton-fuzz").exists()


# --------------------------------------------------------------------------- grid rules over any argument type

_GRID_RULES = ["n", "cdiv(n, BLOCK)", "n * 2 + 1", "min(n, 3) + max(n, BLOCK)", "n > 0", "n % 7", "(n + 1) // 2"]


@settings(FUZZ, max_examples=80)
@given(st.sampled_from(sorted(SCALAR_TYPES) + ["*fp32", "*i8", "*fp16"]), st.sampled_from(_GRID_RULES),
       st.sampled_from(["grid", "checks"]), st.integers(0, 2**40) | st.integers(-2**63, 2**64))
def test_grid_rules_over_any_argument_type_load_or_raise_a_catalog_error(typ, rule, where, value):
    v = _variant()
    size = 8 if typ.startswith("*") else SCALAR_TYPES[typ][0]
    v["args"][3].update(type=typ, size=size, align=size)
    if where == "grid":
        v["grid"] = [rule, "1", "1"]
    else:
        v["grid"], v["checks"] = ["1", "1", "1"], [rule]
    integer = typ in ("i1", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64")
    try:
        (variant,) = Catalog.from_json(_catalog(v), source="fuzz.json").variants
    except CatalogError as e:
        assert where == "grid" and not integer, e  # only a grid rule over a float or pointer
        return
    assert where == "checks" or integer
    try:
        grid = Packer(variant).grid_for([0x7F0000000000] * 3 + [value])
    except LaunchError:
        return
    assert all(type(g) is int and g >= 0 for g in grid), grid


# --------------------------------------------------------------------------- CAI v3 streams


class _CAI:
    def __init__(self, stream) -> None:
        self.cai = {"data": (0x7F0000000000, False), "shape": (4,), "typestr": "<f4", "version": 3,
                    "stream": stream}

    @property
    def __cuda_array_interface__(self) -> dict:
        return self.cai


@FUZZ
@given(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, 1, 2, 3, 2**64 - 1, 2**64])
       | st.floats() | st.text(max_size=4) | st.tuples(st.integers()) | st.just(object()),
       st.sampled_from(["cuda", "hip"]))
def test_cai_stream_of_any_value_is_an_argument_error_or_a_valid_launch_stream(stream, backend):
    from aotriton_rt import launch

    obj = _CAI(stream)
    try:
        got = launch._stream_getter(obj)(obj, 0, backend)
    except ArgumentError:
        assert not (type(stream) is int and 0 < stream < 2**64)
        return
    assert type(got) is int and 0 <= got < 2**64
    assert stream is None or (type(stream) is int and 0 < stream < 2**64)
    assert got == {None: 0, 1: 0 if backend == "hip" else 1, 2: 2}.get(stream, stream)


# --------------------------------------------------------------------------- image-wheel records


@FUZZ
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode())
       | json_values.map(lambda v: json.dumps({"schema": "aotriton-rt.image-wheel", "catalog_schema": v,
                                               "catalog_schema_version": v}).encode()))
def test_image_wheel_record_of_any_bytes_is_accepted_or_a_catalog_error(tmp_path, raw):
    from aotriton_rt import sources

    (tmp_path / "image-wheel.json").write_bytes(raw)
    try:
        sources.check_compatible(sources._read_info(tmp_path, "w 0.1", "w"), "w 0.1")
    except CatalogError as e:
        assert str(e).startswith("image wheel w 0.1")


# --------------------------------------------------------------------------- launches through the fake driver


LAUNCH_FUZZ = r"""
import json, sys
from hypothesis import given, settings, strategies as st
import aotriton_rt
from aotriton_rt.errors import AotritonError

lib = aotriton_rt.Library(sys.argv[1], backend="hip")
add = lib.kernel("add", dtype="fp32", raw_pointers=True)
P = 0x7F0000000000
anything = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=4)
            | st.just(P) | st.tuples(st.integers(-2, 2**33)))
scalar = (st.integers(1, 100_000) | st.integers(-2**65, 2**65) | st.sampled_from([0, 1, 1024, -2000, 2**31, 2**40])
          | anything)
grids = (st.none() | st.lists(st.integers(1, 64), min_size=1, max_size=3).map(tuple) | st.integers(-2, 2**33)
         | st.lists(st.integers(-2, 2**33), min_size=0, max_size=4).map(tuple) | anything)

class CAI:
    def __init__(self, stream):
        self.cai = {"data": (P, False), "shape": (4,), "typestr": "<f4", "version": 3, "stream": stream}

    @property
    def __cuda_array_interface__(self):
        return self.cai

cai = st.builds(CAI, st.none() | st.sampled_from([0, 1, 2, -1, 2**64, 2**70, 0xBEEF]) | anything)
outcomes = {"ok": 0, "refused": 0}

@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(st.sampled_from([P, P + 4, None]) | cai | anything, scalar,
       st.none() | st.integers(0, 2**64 - 1) | anything, grids, st.just([]) | st.lists(anything, max_size=2))
def fuzz(x, n, stream, grid, extra):
    call = add if grid is None else add[grid]
    try:
        call(x, P, P, n, *extra, **({} if stream is None else {"stream": stream}))
        outcomes["ok"] += 1
    except AotritonError:
        outcomes["refused"] += 1

fuzz()
print(json.dumps(outcomes))
"""


def test_fuzzed_launches_are_refused_typed_or_reach_the_driver_in_range(built_images, tmp_path):
    from tests.fakehip import build_fake_hip, fake_hip_env, read_log

    lib = build_fake_hip(tmp_path / "fakehip")
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, **fake_hip_env(lib, log, backend="ctypes"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", LAUNCH_FUZZ, str(built_images)], env=env, capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = json.loads(proc.stdout.splitlines()[-1])
    assert outcomes["ok"] > 0 and outcomes["refused"] > 0, outcomes
    launches = [r for r in read_log(log) if r["call"] == "hipModuleLaunchKernel"]
    assert launches, "no launch reached the fake driver"
    for r in launches:
        gx, gy, gz = r["grid"]
        assert r["status"] == 0, r
        assert 0 < gx and gx * r["block"][0] < 2**32 and 0 < gy <= 65535 and 0 < gz <= 65535, r
        assert 0 <= r["stream"] < 2**64, r


# --------------------------------------------------------------------------- issue 25: shards, tuning, CLI

_TUNING = {"attn_fwd": [{"spec": {"HEAD_DIM": 128}, "seqlen_q": [1024, None], "arch": "sm90", "config": 1,
                         "source": "db"}],
           "attn_decode": [{"arch": "sm90", "splits": {"waves": 2, "min_blocks": 8, "max_splits": 64}, "config": 1}]}


@settings(FUZZ, max_examples=40)
@given(st.data())
def test_mutated_shards_and_index_load_or_raise_a_catalog_error(tmp_path, data):
    """A schema-2 catalog written as index + shards, one file mutated: loading it and reading every
    shard gives the variants or a CatalogError, nothing else."""
    folder = tmp_path / f"case-{os.urandom(4).hex()}"
    cat = Catalog.from_json(_catalog(_variant(), _variant("hip", "gfx942", "2" * 64)), source="fuzz.json")
    written = sorted(cat.write(folder))
    target = folder / data.draw(st.sampled_from(written))
    obj = json.loads(target.read_bytes())
    target.write_text(json.dumps(_mutate(obj, data)))
    try:
        loaded = Catalog.load(folder)
        for kernel in {v.kernel for v in cat.variants}:
            loaded.variants_of(kernel)
    except CatalogError:
        pass


@FUZZ
@given(st.data())
def test_mutated_tuning_rules_validate_or_raise_a_catalog_error(data):
    from aotriton_rt.ops.decode import split_rule
    from aotriton_rt.tuning import select_config, validate_table

    table = _mutate(_TUNING, data)
    try:
        checked = validate_table(table, "fuzz.json")
    except CatalogError:
        return
    try:  # what loads must select without any other error
        select_config(checked.get("attn_fwd", []), kernel="attn_fwd", spec={"HEAD_DIM": 128}, seqlen_q=2048,
                      seqlen_k=2048, arch="sm90")
        split_rule(checked.get("attn_decode", []), "sm90", batch_heads=8)
    except CatalogError:
        pass


_CLI_WORDS = st.sampled_from(["download", "verify", "info", "explain", "attention", "--url", "--timeout", "--deadline",
                              "--retries", "--arch", "--dest", "--from-file", "--seqlen", "inf", "nan", "-1", "0",
                              "1e999", "https://[::1", "https://a\nb/", "ftp://x", "http://127.0.0.1:9/",
                              "https://a:99999/", "\x00", "x" * 300])


@settings(FUZZ, max_examples=60)
@given(st.lists(_CLI_WORDS | st.text(max_size=20), min_size=1, max_size=6))
def test_fuzzed_command_lines_end_in_one_line_and_a_documented_status(tmp_path, monkeypatch, capsys, argv):
    import aotriton_rt.__main__ as cli

    monkeypatch.setenv("AOTRITON_RT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AOTRITON_RT_IMAGES", str(tmp_path / "no-images"))
    if "download" in argv and "--url" not in argv:
        argv = [*argv, "--url", "https://[::1"]  # never the network
    argv = [a if not a.startswith("http://127") else "https://[::1" for a in argv]
    try:
        status = cli.main(argv)
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err
    assert status in (0, cli.EXIT_ERROR, cli.EXIT_USAGE), err
    assert "Traceback" not in err and "unexpected" not in err


# --------------------------------------------------------------------------- decode arguments

_ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                 st.text(max_size=3), st.just([1, 2]))


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_arguments_are_refused_typed_or_launched_in_range(recording, data) -> None:  # noqa: F811
    """Every decode call on random arguments is refused with an AotritonError or, with its
    lengths on the host, launches only lengths within the cache."""
    import numpy as np
    import torch

    from aotriton_rt import AotritonError
    from aotriton_rt.ops import decode as op
    from tests.runtime.test_decode_bounds import _append, _arrays

    paged = data.draw(st.booleans())
    a = _arrays(paged)
    capacity = 64
    new = data.draw(st.sampled_from([0, 0, 1, 5]))
    kind = data.draw(st.sampled_from(["int", "tensor", "numpy", "any"]))
    lens = data.draw(st.lists(st.integers(-2**40, 2**40) | st.integers(-2, 70), min_size=1, max_size=3))
    cache_seqlens: object = {"int": lens[0], "tensor": torch.tensor(lens[:2] + [0] * (2 - len(lens[:2])),
                                                                        dtype=torch.int64),
                             "numpy": np.array(lens, dtype=np.int64), "any": data.draw(_ANY)}[kind]
    if paged and data.draw(st.booleans()):
        values = data.draw(st.lists(st.integers(-2**31, 2**31 - 1), min_size=8, max_size=8))
        a["block_table"] = torch.tensor(values, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
        a["block_table"] = a["block_table"].reshape(data.draw(st.sampled_from([(2, 4), (4, 2), (8,)])))
    kwargs = {}
    for name in ("window", "num_splits", "scale", "causal"):
        if data.draw(st.integers(0, 3)) == 0:  # mostly valid calls, so that many reach the launch
            kwargs[name] = data.draw(_ANY)
    try:
        op.decode_attention(**a, cache_seqlens=cache_seqlens, **_append(new), check=False, library=recording,
                            **kwargs)
    except AotritonError:
        hypothesis.event("refused")
        return
    hypothesis.event("launched")
    if kind == "int":
        assert 0 <= cache_seqlens and cache_seqlens + new <= capacity
    elif kind in ("tensor", "numpy"):
        host = [int(x) for x in (cache_seqlens.tolist())]
        assert all(0 <= n and n + new <= capacity for n in host[:2])
