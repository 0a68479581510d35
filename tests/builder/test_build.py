"""Building image folders through ``builder.build.build``: real compiles on the CPU.

One small build (the fixture ``scale`` kernel, fp16 and fp32, for gfx942 and sm90) is shared by
the module; tests that change a folder work on a copy. Failures and timeouts use the fixture
kernels ``broken`` (a static assertion) and ``slow`` (a compile that takes many minutes).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import multiprocessing
import re
import shutil
import time
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="the builder compiles with triton")
pytest.importorskip("elftools", reason="the ABI proof reads ELF files with pyelftools")
pytest.importorskip("msgpack", reason="the ABI proof reads AMDGPU metadata with msgpack")

from aotriton_rt.catalog import CATALOG_FILE, SHARD_FILE, Catalog  # noqa: E402
from aotriton_rt.errors import CatalogError  # noqa: E402
from builder import build as build_mod  # noqa: E402
from builder.abi import AbiError, prove  # noqa: E402
from builder.build import BuildError, Summary, build, check_triton_version, prove_folder  # noqa: E402
from builder.merge import merge  # noqa: E402
from builder.registry import Job, expand, load_kernels  # noqa: E402
from builder.targets import parse_targets  # noqa: E402

FIXTURE = "tests.builder.kernels_fixture"
VERSION = "3.6.0"
EM_AMDGPU, EM_CUDA = 224, 190
XZ_MAGIC = b"\xfd7zXZ\x00"


@pytest.fixture(scope="module", autouse=True)
def own_triton_cache(tmp_path_factory: pytest.TempPathFactory):
    # Workers inherit the environment: compile for real here instead of reusing ~/.triton.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
        yield


def _jobs(names: str, targets: str = "gfx942,sm90") -> list[Job]:
    kernels = load_kernels(FIXTURE)
    return [j for n in names.split(",") for j in
            expand(kernels[n], parse_targets(targets), "default", VERSION, package=FIXTURE)]


def _build(jobs: list[Job], out: Path, **kw) -> Summary:
    options = {"workers": 2, "timeout": 300.0, "keep_going": False, "triton_version": VERSION,
               "quiet": True}
    return build(jobs, out, **{**options, **kw})


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _edit_catalog(folder: Path, edit) -> None:
    """Edit the catalog in its inline form (every variant in full) and write that form back."""
    obj = Catalog.load(folder).to_json()
    edit(obj)
    (folder / CATALOG_FILE).write_text(json.dumps(obj))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Summary, list[Job]]:
    out = tmp_path_factory.mktemp("scale") / "images"
    jobs = _jobs("scale")
    return out, _build(jobs, out), jobs


@pytest.fixture
def copy(built, tmp_path: Path) -> Path:
    dest = tmp_path / "images"
    shutil.copytree(built[0], dest)
    return dest


# --------------------------------------------------------------------------- a clean build


def test_build_writes_one_image_per_variant_at_its_documented_path(built) -> None:
    out, summary, jobs = built
    catalog = Catalog.load(out)
    assert sorted(v.key for v in catalog.variants) == sorted(j.key for j in jobs)
    expected = {f"{v.target.backend}/{v.target.arch}/scale/scale-{v.key[:16]}.{v.image.format}.xz"
                for v in catalog.variants}
    assert {v.image.path for v in catalog.variants} == expected
    # CUDA variants also keep their PTX beside the cubin (what jaxlib's Triton call takes).
    ptx = {f"cuda/{v.target.arch}/scale/scale-{v.key[:16]}.ptx.xz" for v in catalog.variants
           if v.target.backend == "cuda"}
    assert {v.ptx.path for v in catalog.variants if v.ptx is not None} == ptx
    # One shard per target and kernel, beside its images (docs/catalog.md).
    shards = {f"{t.backend}/{t.arch}/scale/{SHARD_FILE}" for t in catalog.targets()}
    assert set(_tree(out)) == expected | ptx | shards | {CATALOG_FILE}
    assert {v.image.format for v in catalog.variants if v.target.backend == "hip"} == {"hsaco"}
    assert {v.image.format for v in catalog.variants if v.target.backend == "cuda"} == {"cubin"}


def test_images_are_xz_of_real_hsaco_and_cubin_binaries_for_their_target(built) -> None:
    out = built[0]
    for v in Catalog.load(out).variants:
        packed = (out / v.image.path).read_bytes()
        assert packed.startswith(XZ_MAGIC) and v.image.compression == "xz"
        assert (len(packed), hashlib.sha256(packed).hexdigest()) == (v.image.size, v.image.sha256)
        raw = lzma.decompress(packed, format=lzma.FORMAT_XZ)
        assert (len(raw), hashlib.sha256(raw).hexdigest()) == (v.image.raw_size, v.image.raw_sha256)
        assert raw.startswith(b"\x7fELF")
        machine = int.from_bytes(raw[18:20], "little")
        assert machine == (EM_AMDGPU if v.target.backend == "hip" else EM_CUDA), v.image.path
        # Compression is worth it even on these tiny kernels.
        assert v.image.size < v.image.raw_size * 0.6


def test_catalog_layout_is_what_the_binaries_themselves_record(built) -> None:
    out = built[0]
    catalog = Catalog.load(out)
    for v in catalog.variants:
        # x_ptr, n (i32), out_ptr, alpha (fp32), then the two hidden scratch pointers: the i32 and
        # the fp32 each force 4 bytes of padding.
        assert [(a.name, a.offset, a.size) for a in v.args] == [
            ("x_ptr", 0, 8), ("n", 8, 4), ("out_ptr", 16, 8), ("alpha", 24, 4)]
        assert [(a.name, a.offset) for a in v.hidden_args] == [("global_scratch", 32),
                                                               ("profile_scratch", 40)]
        assert v.param_size == 48
        raw = lzma.decompress((out / v.image.path).read_bytes())
        abi = prove(v.to_json(), raw)
        assert abi.params == ((0, 8), (8, 4), (16, 8), (24, 4), (32, 8), (40, 8))
        assert abi.extra["arch"] == v.target.arch
    assert prove_folder(out) == len(catalog.variants) == 4


def test_catalog_records_what_the_kernel_declared(built) -> None:
    out, _, jobs = built
    catalog = Catalog.load(out)
    assert catalog.triton_version == VERSION and catalog.tuning == {}
    for v in catalog.variants:
        job = next(j for j in jobs if j.key == v.key)
        assert v.kernel == "scale" and v.symbol == "scale_kernel"
        assert v.spec == job.spec and v.config.index == 0
        assert v.config.constexprs == {"BLOCK": 256}
        assert (v.config.num_warps, v.config.num_stages, v.num_warps) == (2, 1, 2)
        assert v.target.warp_size == (64 if v.target.backend == "hip" else 32)
        assert v.args[0].type == f"*{v.spec['dtype']}" and v.args[2].type == "*fp32"
        assert [a.divisibility for a in v.args] == [16, 1, 16, 1]
        assert v.grid == ("cdiv(n, BLOCK)", "1", "1") and v.checks == ()
        assert (v.num_ctas, v.cluster_dims, v.cooperative, v.pdl) == (1, (1, 1, 1), False, False)
        assert v.triton_version == VERSION


def test_catalog_file_is_written_in_canonical_form(built) -> None:
    out = built[0]
    files = Catalog.load(out).files()
    assert files == {rel: (out / rel).read_bytes() for rel in files}
    index = json.loads(files[CATALOG_FILE])
    assert [(e["backend"], e["arch"], e["kernel"]) for e in index["shards"]] == [
        ("cuda", "sm90", "scale"), ("hip", "gfx942", "scale")]
    # Shards are compact: what variants share (here the grid rule) is stored once per shard.
    shard = json.loads(files[f"cuda/sm90/scale/{SHARD_FILE}"])
    assert len(shard["variants"]) == 2 and shard["rules"] == [{"checks": [], "grid": ["cdiv(n, BLOCK)", "1", "1"]}]
    assert all(set(v) >= {"layout", "rules", "launch_params"} and "args" not in v for v in shard["variants"])


def test_summary_counts_variants_and_bytes(built) -> None:
    out, summary, _ = built
    catalog = Catalog.load(out)
    assert (summary.compiled, summary.reused, summary.failed) == (4, 0, [])
    assert summary.packed_bytes == sum(v.image.size for v in catalog.variants)
    assert summary.raw_bytes == sum(v.image.raw_size for v in catalog.variants)
    assert summary.seconds > 0


def test_summary_prints_counts_sizes_ratio_time_and_each_failure() -> None:
    summary = Summary(compiled=3, reused=2, failed=[("add[dtype=fp16]#0@gfx942", "boom")],
                      raw_bytes=2_000_000, packed_bytes=150_000, seconds=12.34)
    assert summary.lines() == [
        "compiled 3, reused 2, failed 1; images 0.15 MB xz from 2.00 MB raw (7.5%); 12.3 s",
        "FAILED add[dtype=fp16]#0@gfx942: boom"]
    assert Summary().lines() == ["compiled 0, reused 0, failed 0; images 0.00 MB xz from 0.00 MB raw "
                                 "(0.0%); 0.0 s"]


# --------------------------------------------------------------------------- incremental builds


def test_a_cuda_variant_built_without_its_ptx_is_compiled_again(built, copy: Path) -> None:
    catalog = Catalog.load(copy).to_json()
    for v in catalog["variants"]:
        if v.pop("ptx", None) is not None:
            (copy / v["image"]["path"].replace(".cubin.xz", ".ptx.xz")).unlink()
    (copy / CATALOG_FILE).write_text(json.dumps(catalog))
    summary = _build(built[2], copy)
    cuda = sum(v["target"]["backend"] == "cuda" for v in catalog["variants"])
    assert (summary.compiled, summary.reused) == (cuda, 4 - cuda) and cuda
    assert _tree(copy) == _tree(built[0])


def test_a_second_build_reuses_every_variant_and_rewrites_no_image(built, copy: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*.xz")}
    started = time.monotonic()
    summary = _build(built[2], copy)
    assert (summary.compiled, summary.reused, summary.failed) == (0, 4, [])
    assert time.monotonic() - started < 5.0
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("*.xz")} == before
    assert _tree(copy) == _tree(built[0])


def test_a_build_recompiles_only_missing_and_corrupt_images(built, copy: Path) -> None:
    images = sorted(copy.rglob("*.xz"))
    images[0].unlink()
    images[-1].write_bytes(images[-1].read_bytes() + b"\0")
    summary = _build(built[2], copy)
    assert (summary.compiled, summary.reused) == (2, 2)
    # The recompiled images are the same bytes: compiles are reproducible.
    assert _tree(copy) == _tree(built[0])


def test_a_build_removes_the_images_its_catalog_no_longer_lists(built, copy: Path) -> None:
    summary = _build([j for j in built[2] if j.target.backend == "hip"], copy, existing="replace")
    assert (summary.compiled, summary.reused) == (0, 2)
    assert not [p for p in (copy / "cuda").rglob("*") if p.is_file()]
    assert not (copy / "cuda" / "sm90").exists()
    assert {v.target.arch for v in Catalog.load(copy).variants} == {"gfx942"}
    assert len(list(copy.rglob("*.xz"))) == 2


def test_a_build_that_would_drop_other_variants_refuses_and_leaves_the_folder_alone(built, copy: Path) -> None:
    before = _tree(copy)
    with pytest.raises(BuildError, match=r"already holds 2 variants this build would drop \(scale@sm90=2\); "
                                         r"nothing was built. Pass --add to keep them.*--replace to drop them"):
        _build([j for j in built[2] if j.target.backend == "hip"], copy)
    assert _tree(copy) == before


def test_a_build_with_add_keeps_the_other_variants_beside_its_own(built, copy: Path) -> None:
    hip = [j for j in built[2] if j.target.backend == "hip"]
    _build(hip, copy, existing="replace")
    summary = _build([j for j in built[2] if j.target.backend == "cuda"], copy, existing="keep")
    assert (summary.compiled, summary.reused, summary.kept) == (2, 0, 2)
    assert "kept 2 of earlier builds" in summary.lines()[0]
    assert _tree(copy) == _tree(built[0])


def test_a_rebuild_of_the_same_slots_replaces_them_without_asking(built, copy: Path) -> None:
    # An edited kernel gets new keys for the same kernel/spec/config/target: not "other" variants.
    def rekey(obj: dict) -> None:
        for v in obj["variants"]:
            v["key"] = "0" * 48 + v["key"][48:]
    _edit_catalog(copy, rekey)
    summary = _build(built[2], copy)
    assert (summary.compiled, summary.reused, summary.kept) == (4, 0, 0)
    assert _tree(copy) == _tree(built[0])


def test_an_unknown_existing_policy_is_refused(built, copy: Path) -> None:
    with pytest.raises(ValueError, match="existing must be one of refuse, keep, replace, got 'merge'"):
        _build(built[2], copy, existing="merge")


def test_a_build_ignores_an_unreadable_previous_catalog(built, copy: Path) -> None:
    (copy / CATALOG_FILE).write_text("{not json")
    summary = _build(built[2], copy)
    assert (summary.compiled, summary.reused) == (4, 0)
    assert _tree(copy) == _tree(built[0])


# --------------------------------------------------------------------------- failures and timeouts


def test_a_failed_compile_fails_the_build_by_name_and_keeps_the_old_catalog(
        built, copy: Path, capsys: pytest.CaptureFixture) -> None:
    old = (copy / CATALOG_FILE).read_bytes()
    jobs = built[2] + _jobs("broken", "gfx942")
    with pytest.raises(BuildError) as info:
        _build(jobs, copy, quiet=False)
    lines = str(info.value).splitlines()
    assert re.fullmatch(r"compiled 0, reused 4, failed 1; images .*", lines[0])
    assert lines[1:] == ["FAILED broken[]#0@gfx942: BLOCK must be a multiple of 3"]
    assert "FAILED broken[]#0@gfx942: BLOCK must be a multiple of 3" in capsys.readouterr().err
    # A failed build does not replace the catalog: the folder still describes a good build.
    assert (copy / CATALOG_FILE).read_bytes() == old


def test_a_failed_build_into_an_empty_folder_writes_no_catalog(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"FAILED broken\[\]#0@sm90: BLOCK must be a multiple of 3"):
        _build(_jobs("broken", "sm90"), tmp_path)
    assert not (tmp_path / CATALOG_FILE).exists()


def test_a_timed_out_compile_is_killed_reported_and_its_worker_replaced(tmp_path: Path) -> None:
    slow = _jobs("slow", "gfx942")
    scale = [j for j in _jobs("scale", "gfx942") if j.spec["dtype"] == "fp32"]
    broken = _jobs("broken", "gfx942")
    others = set(multiprocessing.active_children())  # e.g. servers of other test modules
    started = time.monotonic()
    # One worker: the job after the slow one can only run if the killed worker is replaced.
    # The timeout leaves that replacement room for its start-up (importing triton) on slow CI.
    summary = _build(slow + scale + broken, tmp_path, workers=1, timeout=6.0, keep_going=True)
    assert time.monotonic() - started < 60
    assert summary.failed == [("slow[]#0@gfx942", "timed out after 6 s"),
                              ("broken[]#0@gfx942", "BLOCK must be a multiple of 3")]
    assert summary.compiled == 1
    # Nothing is left running, and nothing is dropped: the catalog lists exactly what compiled.
    assert set(multiprocessing.active_children()) - others == set()
    assert [v.key for v in Catalog.load(tmp_path).variants] == [scale[0].key]
    assert prove_folder(tmp_path) == 1


def test_keep_going_prints_each_failure_as_it_happens(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    summary = _build(_jobs("broken", "gfx942,sm90"), tmp_path, keep_going=True, quiet=False)
    err = capsys.readouterr().err
    assert "FAILED broken[]#0@gfx942: BLOCK must be a multiple of 3" in err
    assert "FAILED broken[]#0@sm90: BLOCK must be a multiple of 3" in err
    assert re.search(r"^\[2/2\] failed 2, \d+ s, ETA 0 s$", err, re.M)
    assert summary.compiled == 0 and len(summary.failed) == 2
    assert Catalog.load(tmp_path).variants == ()


# --------------------------------------------------------------------------- the ABI proof


def _hip_first(obj: dict) -> dict:
    return next(v for v in obj["variants"] if v["target"]["backend"] == "hip")


def _cuda_first(obj: dict) -> dict:
    return next(v for v in obj["variants"] if v["target"]["backend"] == "cuda")


TAMPERS = [
    # Still a valid catalog (aligned, no overlap), but not what the binary reads.
    ("alpha moved", lambda v: v["args"][3].update(offset=28),
     r"args\[3\]\.offset: catalog has 28, binary has 24"),
    ("n widened", lambda v: v["args"][1].update(type="i64", size=8),
     r"args\[1\]\.size: catalog has 8, binary has 4"),
    ("pointer as scalar", lambda v: v["args"][2].update(type="i64"),
     r"args\[2\]\.kind: catalog has 'value', binary has 'pointer' \(catalog type 'i64'\)"),
    ("param_size padded", lambda v: v.update(param_size=56),
     r"param_size: catalog has 56, binary has 48"),
]


@pytest.mark.parametrize("first", [_hip_first, _cuda_first], ids=["hip", "cuda"])
@pytest.mark.parametrize(("what", "tamper", "message"), TAMPERS, ids=[t[0] for t in TAMPERS])
def test_verify_catches_a_catalog_layout_that_disagrees_with_the_binary(
        copy: Path, first, what: str, tamper, message: str) -> None:
    _edit_catalog(copy, lambda obj: tamper(first(obj)))
    Catalog.load(copy)  # the tampered catalog is well formed: only the binary can tell
    where = r"\(hip/gfx942\)" if first is _hip_first else r"\(cuda/sm90\)"
    with pytest.raises(AbiError, match=rf"^ABI mismatch in scale_kernel {where}: {message}"):
        prove_folder(copy)


def test_catalog_missing_a_hidden_arg_is_refused_when_it_loads(copy: Path) -> None:
    # The launcher always appends Triton's two scratch pointers: the catalog must list both.
    _edit_catalog(copy, lambda obj: (_hip_first(obj)["hidden_args"].pop(), _hip_first(obj).update(param_size=40)))
    with pytest.raises(CatalogError, match=r"hidden_args must be the two scratch pointers Triton appends"):
        Catalog.load(copy)


def test_verify_catches_a_wrong_block_size(copy: Path) -> None:
    _edit_catalog(copy, lambda obj: _hip_first(obj).update(num_warps=4))
    with pytest.raises(AbiError, match=r"num_warps \(threads per block\): catalog has 256, binary has 128"):
        prove_folder(copy)


def test_verify_catches_an_image_labelled_with_the_wrong_arch(copy: Path) -> None:
    _edit_catalog(copy, lambda obj: _hip_first(obj)["target"].update(arch="gfx90a"))
    with pytest.raises(AbiError, match=r"target\.arch: catalog has 'gfx90a', binary has 'gfx942'"):
        prove_folder(copy)


def test_verify_catches_a_changed_image(copy: Path) -> None:
    image = sorted(copy.rglob("*.hsaco.xz"))[0]
    image.write_bytes(image.read_bytes()[:-1] + b"\0")
    with pytest.raises(BuildError, match=rf"^{re.escape(image.relative_to(copy).as_posix())}: sha256 "
                                         r"does not match the catalog$"):
        prove_folder(copy)


def test_verify_catches_an_entry_pointing_at_another_backends_image(copy: Path) -> None:
    # The digests are copied along, so they match: only reading the binary can tell.
    def swap(obj: dict) -> None:
        hip, cuda = _hip_first(obj), _cuda_first(obj)
        hip["image"].update({k: cuda["image"][k] for k in ("path", "sha256", "size", "raw_sha256",
                                                           "raw_size")})
        hip["image"]["format"] = "hsaco"
    _edit_catalog(copy, swap)
    with pytest.raises(AbiError, match=r"scale_kernel: image\.format: catalog says hsaco \(EM_AMDGPU\), "
                                       r"binary is EM_CUDA"):
        prove_folder(copy)


def test_a_build_reruns_the_proof_only_for_what_it_compiles(built, copy: Path) -> None:
    # Reused variants were proved when compiled and their bytes are digest-checked on reuse, so
    # a catalog edited behind the builder's back is reused as is; `verify` is the check for that.
    _edit_catalog(copy, lambda obj: _hip_first(obj)["args"][3].update(offset=28))
    assert _build(built[2], copy).reused == 4
    with pytest.raises(AbiError):
        prove_folder(copy)


# --------------------------------------------------------------------------- merge


def test_merge_of_a_folder_with_its_copy_is_the_same_folder(built, copy: Path, tmp_path: Path) -> None:
    merged = merge([built[0], copy], tmp_path / "merged")
    assert len(merged.variants) == 4
    assert _tree(tmp_path / "merged") == _tree(built[0])


def test_merge_refuses_folders_of_different_triton_versions(built, copy: Path, tmp_path: Path) -> None:
    _edit_catalog(copy, lambda obj: obj.update(triton_version="3.5.0"))
    with pytest.raises(BuildError, match=r"^cannot merge catalogs built with different Triton versions: "
                                         r"\['3\.5\.0', '3\.6\.0'\]$"):
        merge([built[0], copy], tmp_path / "merged")


def test_merge_refuses_a_variant_that_differs_between_inputs(built, copy: Path, tmp_path: Path) -> None:
    _edit_catalog(copy, lambda obj: _cuda_first(obj).update(shared=1024))
    with pytest.raises(BuildError, match=rf"^variant [0-9a-f]{{16}} \(scale\) differs between "
                                         rf"{re.escape(str(built[0]))} and {re.escape(str(copy))}$"):
        merge([built[0], copy], tmp_path / "merged")


def test_merge_refuses_an_image_that_does_not_match_its_catalog(copy: Path, tmp_path: Path) -> None:
    image = sorted(copy.rglob("*.cubin.xz"))[0]
    image.write_bytes(b"\0" + image.read_bytes())
    with pytest.raises(BuildError, match=rf"^{re.escape(str(image))}: sha256 does not match its catalog$"):
        merge([copy], tmp_path / "merged")


def test_merge_keeps_every_tuning_rule_of_its_inputs_once(built, copy: Path, tmp_path: Path) -> None:
    shared = {"arch": "sm90", "spec": {"dtype": "fp32"}, "config": 1}
    first = tmp_path / "first"
    shutil.copytree(built[0], first)
    _edit_catalog(first, lambda obj: obj.update(tuning={"scale": [shared]}))
    _edit_catalog(copy, lambda obj: obj.update(tuning={"scale": [shared, {"seqlen_k": [0, 64], "config": 0}],
                                                       "attn_bwd_mode": [{"mode": "atomic"}]}))
    merged = merge([first, copy], tmp_path / "merged")
    want = {"scale": [shared, {"seqlen_k": [0, 64], "config": 0}], "attn_bwd_mode": [{"mode": "atomic"}]}
    assert merged.tuning == want
    assert Catalog.load(tmp_path / "merged").tuning == want


def test_merge_needs_an_input(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"^merge needs at least one input folder$"):
        merge([], tmp_path)


# --------------------------------------------------------------------------- the documented example


def test_the_example_in_adding_a_kernel_builds_and_proves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "adding-a-kernel.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    package = tmp_path / "adding_a_kernel_example"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "axpy.py").write_text(code)
    # Spawned workers start with the parent's sys.path, so they find the package too.
    monkeypatch.syspath_prepend(str(tmp_path))
    kernels = load_kernels("adding_a_kernel_example")
    assert list(kernels) == ["axpy"]
    full = expand(kernels["axpy"], parse_targets(None), "full", VERSION, package="adding_a_kernel_example")
    assert len(full) == 42  # what the page says
    jobs = expand(kernels["axpy"], parse_targets("gfx942,sm90"), "default", VERSION,
                  package="adding_a_kernel_example")
    out = tmp_path / "images"
    summary = _build(jobs, out)
    assert (summary.compiled, summary.failed) == (8, [])
    assert prove_folder(out) == 8
    for v in Catalog.load(out).variants:
        # The parameter table on the page.
        assert [(a.name, a.offset, a.size) for a in v.args + v.hidden_args] == [
            ("x_ptr", 0, 8), ("y_ptr", 8, 8), ("n", 16, 8), ("alpha", 24, 4),
            ("global_scratch", 32, 8), ("profile_scratch", 40, 8)]
        assert v.param_size == 48


# --------------------------------------------------------------------------- the pinned triton


def test_the_builder_refuses_another_triton_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AOTRITON_BUILDER_ANY_TRITON", raising=False)
    assert check_triton_version() == build_mod.PINNED_TRITON == triton.__version__
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    with pytest.raises(BuildError, match=r"^the builder is pinned to triton 3\.6\.0 but 3\.5\.1 is installed: "
                                         r"pip install triton==3\.6\.0 \(or set AOTRITON_BUILDER_ANY_TRITON=1 "
                                         r"to build anyway\)$"):
        check_triton_version()
    monkeypatch.setenv("AOTRITON_BUILDER_ANY_TRITON", "1")
    assert check_triton_version() == "3.5.1"


def test_timings_record_the_cpu_seconds_and_sizes_of_each_compiled_variant(tmp_path: Path) -> None:
    jobs = _jobs("scale")
    timings = tmp_path / "timings.jsonl"
    _build(jobs, tmp_path / "images", workers=1, timings=timings)
    records = [json.loads(line) for line in timings.read_text().splitlines()]
    assert sorted(r["key"] for r in records) == sorted(j.key for j in jobs)
    catalog = {v.key: v for v in Catalog.load(tmp_path / "images").variants}
    for r in records:
        v = catalog[r["key"]]
        assert (r["kernel"], r["arch"], r["spec"], r["config"]) == (v.kernel, v.target.arch, dict(v.spec), 0)
        assert r["xz_bytes"] == v.image.size and r["raw_bytes"] == v.image.raw_size
        assert r["ptx_xz_bytes"] == (v.ptx.size if v.ptx is not None else 0)
        assert 0 < r["cpu_s"] < 600 and 0 < r["wall_s"] < 600
    # One worker: its first job also paid for importing Triton, and only that one is marked.
    assert [r["first"] for r in records] == [True] + [False] * (len(records) - 1)
    # A rebuild compiles nothing, so it appends nothing.
    _build(jobs, tmp_path / "images", workers=1, timings=timings)
    assert len(timings.read_text().splitlines()) == len(records)


def test_compilers_keep_their_randomised_layout_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    """The no-randomisation switch for ptxas is Linux's personality(2): elsewhere it does nothing
    and says so (the build goes on)."""
    from builder import compile as compile_mod

    compile_mod.fixed_layout_for_compilers.cache_clear()
    monkeypatch.setattr(compile_mod.sys, "platform", "darwin")
    try:
        assert compile_mod.fixed_layout_for_compilers() is False
    finally:
        compile_mod.fixed_layout_for_compilers.cache_clear()
