"""docs/security.md's limits table against the code (issue 25, finding 10): every bound is listed
once with the value the code has, and every limit constant of the package is listed."""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import json
import re
import tarfile
from pathlib import Path

import pytest

import aotriton_rt
from aotriton_rt.bundles.format import MAX_BUNDLE_CATALOG_BYTES
from aotriton_rt.errors import BundleError

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "security.md").read_text(encoding="utf-8")
PACKAGE = Path(aotriton_rt.__file__).parent

#: A row's constant: `aotriton_rt.module.NAME` = value, or `aotriton_rt.module.function(param=)` = default.
ROW = re.compile(r"^\| (?P<limit>[^|]+) \| (?P<value>[^|]+) \| "
                 r"`(?P<path>aotriton_rt(?:\.\w+)+)(?:\((?P<param>\w+)=\))?` = (?P<literal>[^|]+?) \| "
                 r"(?P<where>[^|]+) \|$", re.M)
#: Names that match the limit pattern but bound nothing an input controls: driver API enums, a
#: type's range, the DLPack version we ask for, a key's canonical divisor.
NOT_LIMITS = {
    "aotriton_rt.drivers.cuda.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
    "aotriton_rt.drivers.cuda.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES",
    "aotriton_rt.drivers.hip.HIP_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_MEMORY_SIZE",
    "aotriton_rt.ops.attention.problem.I32_MAX",
    "aotriton_rt.interop.protocols._MAX_VERSION",
    "aotriton_rt.interop.protocols._NO_MAX_VERSION",
    "aotriton_rt.ops.attention.dispatch._MAX_FACT_DIVISOR",
}
#: Limits that are not named MAX_/LIMIT but are listed all the same.
ALSO_LIMITS = {"aotriton_rt.catalog.files.XZ_MEMLIMIT", "aotriton_rt.rules.CUDA_GRID",
               "aotriton_rt.ops.attention.signature.PLAN_CACHE_SIZE", "aotriton_rt.errors.SHOWN_CHARS",
               "aotriton_rt.bundles.format.DEFAULT_MAX_UNPACKED", "aotriton_rt.bundles.fetch.DEFAULT_DEADLINE"}
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _rows() -> list[re.Match]:
    return list(ROW.finditer(DOC))


def _resolve(path: str, param: str | None):
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return inspect.signature(obj).parameters[param].default if param else obj
    raise AssertionError(f"{path}: no module")


def _limit_constants() -> set[str]:
    """Every module-level constant of the package whose name says it is a limit."""
    found = set()
    for file in PACKAGE.rglob("*.py"):
        module = ".".join(("aotriton_rt", *file.relative_to(PACKAGE).with_suffix("").parts))
        module = module.removesuffix(".__init__")
        for node in ast.parse(file.read_text(encoding="utf-8")).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Name) and re.fullmatch(r"_?[A-Z0-9_]*(MAX|LIMIT)[A-Z0-9_]*", t.id):
                    found.add(f"{module}.{t.id}")
    return found


def test_the_limits_table_parses():
    assert len(_rows()) >= 40
    assert len(DOC.split("## Limits and defaults")[1].split("## What is not covered")[0].splitlines()) >= 45


@pytest.mark.parametrize("row", _rows(), ids=lambda m: m["path"] + (f"({m['param']}=)" if m["param"] else ""))
def test_each_listed_limit_has_the_value_the_code_has(row):
    actual = _resolve(row["path"], row["param"])
    assert ast.literal_eval(row["literal"].strip()) == actual, row[0]
    size = re.fullmatch(r"(\d+) ([KMG]iB)", row["value"].strip())
    if size:  # the human-readable value agrees too
        assert int(size[1]) * UNITS[size[2]] == actual, row[0]


def test_each_limit_is_listed_once():
    listed = [m["path"] + (m["param"] or "") for m in _rows()]
    assert len(listed) == len(set(listed)), sorted(n for n in listed if listed.count(n) > 1)


def test_every_limit_constant_of_the_package_is_in_the_table():
    listed = {m["path"] for m in _rows() if not m["param"]}
    required = (_limit_constants() - NOT_LIMITS) | ALSO_LIMITS
    assert sorted(required - listed) == []
    assert NOT_LIMITS <= _limit_constants(), "a name in NOT_LIMITS no longer exists; drop it"


def test_the_doc_names_no_module_or_constant_that_does_not_exist():
    for stale in ("images.XZ_MEMLIMIT", "pack.MAX_", "pack.grid_limits", "256 MiB catalog"):
        assert stale not in DOC


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes, size: int | None = None) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data) if size is None else size
    if size is None:
        tar.addfile(info, io.BytesIO(data))
    else:  # a header only: the unpacker must refuse it by its size before reading the body
        tar.fileobj.write(info.tobuf(tar.format, tar.encoding, tar.errors))


def test_the_unpacker_refuses_a_catalog_over_the_bundle_cap(tmp_path):
    from aotriton_rt.bundles.unpack import unpack_bundle

    size = MAX_BUNDLE_CATALOG_BYTES + 1
    manifest = json.dumps({"schema": "aotriton-rt.bundle", "schema_version": 1, "name": "hip-gfx942",
                           "backend": "hip", "targets": ["gfx942"], "catalog_schema_version": 2,
                           "files": [{"path": "catalog.json", "size": size, "sha256": "b" * 64}]}).encode()
    bundle = tmp_path / "b.tar"
    with open(bundle, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _tar_member(tar, "bundle.json", manifest)
        _tar_member(tar, "catalog.json", b"", size=size)
    (tmp_path / "out").mkdir()
    with pytest.raises(BundleError, match=rf"catalog\.json is {size} bytes, over the {MAX_BUNDLE_CATALOG_BYTES} a "
                                          r"bundle's catalog may have \(bundles\.format\.MAX_BUNDLE_CATALOG_BYTES\)"):
        unpack_bundle(bundle, tmp_path / "out", "b.tar", 1 << 40)
