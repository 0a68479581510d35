"""The compile cache (``builder.cache``): real compiles stored, read back, and refused when bad.

One build of the fixture ``scale`` kernel (fp16 and fp32, for gfx942 and sm90: 4 variants) fills a
cache shared by the module; each test works on a copy of it. Rebuilds go into empty folders, so
every variant comes either from the cache or from a compile, and the summary counts which.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the builder compiles with triton")
pytest.importorskip("elftools", reason="the ABI proof reads ELF files with pyelftools")
pytest.importorskip("msgpack", reason="the ABI proof reads AMDGPU metadata with msgpack")

from aotriton_rt.catalog import Catalog, canonical_bytes  # noqa: E402
from builder.build import Summary, build, prove_folder  # noqa: E402
from builder.cache import MAGIC, MAX_ENTRY_BYTES, BadEntry, CacheError, CompileCache  # noqa: E402
from builder.registry import Job, expand, load_kernels  # noqa: E402
from builder.targets import parse_targets  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = "tests.builder.kernels_fixture"
VERSION = "3.6.0"


@pytest.fixture(scope="module", autouse=True)
def own_triton_cache(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
        yield


def _jobs() -> list[Job]:
    return expand(load_kernels(FIXTURE)["scale"], parse_targets("gfx942,sm90"), "default", VERSION, package=FIXTURE)


def _build(out: Path, cache: Path, **kw) -> Summary:
    options = {"workers": 2, "timeout": 300.0, "keep_going": False, "triton_version": VERSION, "quiet": True}
    return build(_jobs(), out, cache=CompileCache(cache, VERSION), **{**options, **kw})


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the images of a build without a cache, the cache filled by a second clean build)."""
    base = tmp_path_factory.mktemp("filled")
    plain = base / "plain"
    build(_jobs(), plain, workers=2, timeout=300.0, keep_going=False, triton_version=VERSION, quiet=True)
    summary = _build(base / "first", base / "cache")
    assert (summary.compiled, summary.cached, summary.discarded) == (4, 0, 0)
    return plain, base / "cache"


@pytest.fixture
def cache(filled, tmp_path: Path) -> Path:
    dest = tmp_path / "cache"
    shutil.copytree(filled[1], dest, symlinks=True)
    return dest


def _entry(cache: Path, job: Job) -> Path:
    return CompileCache(cache, VERSION).path(job.key)


def _hip(jobs: list[Job]) -> Job:
    return next(j for j in jobs if j.target.backend == "hip" and j.spec["dtype"] == "fp32")


# --------------------------------------------------------------------------- hits


def test_a_build_stores_each_variant_it_compiles_as_one_entry_under_its_key(filled) -> None:
    plain, cache = filled
    catalog = {v.key: v for v in Catalog.load(plain).variants}
    entries = sorted(p for p in cache.rglob("*") if p.is_file())
    assert [p.name for p in entries] == sorted(catalog)
    for path in entries:
        v = catalog[path.name]
        assert path == _entry(cache, next(j for j in _jobs() if j.key == v.key))
        assert re.fullmatch(r"v1-schema2-[0-9a-f]{16}", path.parent.parent.name) and path.parent.name == v.key[:2]
        # The header, the variant's catalog entry on one line, its image, then (CUDA) its PTX.
        image = (plain / v.image.path).read_bytes()
        ptx = (plain / v.ptx.path).read_bytes() if v.ptx is not None else b""
        assert path.read_bytes() == MAGIC + canonical_bytes(v.to_json()) + image + ptx


def test_a_rebuild_into_an_empty_folder_compiles_nothing_and_writes_the_same_bytes(filled, cache: Path,
                                                                                   tmp_path: Path) -> None:
    timings = tmp_path / "timings.jsonl"
    summary = _build(tmp_path / "images", cache, timings=timings)
    assert (summary.compiled, summary.reused, summary.cached, summary.discarded) == (0, 0, 4, 0)
    assert timings.read_text() == ""  # each compile appends a record
    assert summary.lines()[0].startswith("compiled 0, reused 0, from cache 4, failed 0; images ")
    assert _tree(tmp_path / "images") == _tree(filled[0])


def test_variants_already_in_the_output_folder_are_reused_before_the_cache_is_asked(filled, cache: Path,
                                                                                     tmp_path: Path) -> None:
    out = tmp_path / "images"
    shutil.copytree(filled[0], out)
    summary = _build(out, cache)
    assert (summary.compiled, summary.reused, summary.cached) == (0, 4, 0)


# --------------------------------------------------------------------------- bad entries


def _flip_image_byte(path: Path, job: Job) -> None:
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_variant(edit):
    def tamper(path: Path, job: Job) -> None:
        data = path.read_bytes()
        end = data.index(b"\n", len(MAGIC))
        obj = json.loads(data[len(MAGIC):end])
        edit(obj)
        path.write_bytes(MAGIC + canonical_bytes(obj) + data[end + 1:])
    return tamper


def _other_variant(path: Path, job: Job) -> None:
    other = next(j for j in _jobs() if j.target == job.target and j.key != job.key)
    shutil.copyfile(path.parent.parent / other.key[:2] / other.key, path)


BAD = [
    ("an image byte flipped", _flip_image_byte, r"its sha256 does not match its variant"),
    ("truncated", lambda p, j: p.write_bytes(p.read_bytes()[:-1]), r"its files are \d+ bytes, but its variant "
                                                                    r"says \d+"),
    ("another header", lambda p, j: p.write_bytes(b"x" + p.read_bytes()), r"not a compile-cache entry \(wrong "
                                                                         r"header\)"),
    ("not JSON", lambda p, j: p.write_bytes(MAGIC + b"{oops\n"), r"its variant is not a valid catalog entry "
                                                                 r"\(compile-cache entry .*: not valid JSON"),
    ("a field out of range", _edit_variant(lambda v: v.update(num_warps=10**9)),
     r"its variant is not a valid catalog entry \(.*\$\.num_warps must be an integer in \[1, 64\]"),
    ("another variant's entry", _other_variant, r"it holds another variant than scale\[dtype=fp32\]#0@gfx942 "
                                                r"\(key differs\)"),
    ("a layout the binary disagrees with", _edit_variant(lambda v: v["args"][3].update(offset=28)),
     r"its variant does not match its binary \(ABI mismatch in scale_kernel \(hip/gfx942\): args\[3\]\.offset"),
    ("a FIFO", lambda p, j: (p.unlink(), os.mkfifo(p)), r"not a regular file"),
    ("over the size limit", lambda p, j: os.truncate(p, MAX_ENTRY_BYTES + 1), rf"{MAX_ENTRY_BYTES + 1} bytes, "
                                                                              rf"over the limit of {MAX_ENTRY_BYTES}"),
]


@pytest.mark.parametrize(("what", "spoil", "reason"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_entry_is_detected_discarded_compiled_again_and_replaced(
        filled, cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture, what: str, spoil, reason: str) -> None:
    job = _hip(_jobs())
    entry = _entry(cache, job)
    spoil(entry, job)
    with pytest.raises(BadEntry, match=reason):
        CompileCache(cache, VERSION).get(job)
    summary = _build(tmp_path / "images", cache, quiet=False)
    assert (summary.compiled, summary.cached, summary.discarded) == (1, 3, 1)
    assert "from cache 3 (1 bad entry compiled again)" in summary.lines()[0]
    err = capsys.readouterr().err
    assert re.search(rf"^compile cache: discarded {re.escape(str(entry))}: {reason}.*; compiling "
                     rf"{re.escape(job.label)} again$", err, re.M), err
    assert _tree(tmp_path / "images") == _tree(filled[0])
    # The entry was replaced by the fresh compile: the next build reads all four.
    assert entry.is_file() and not entry.is_symlink()
    assert _build(tmp_path / "again", cache).cached == 4


def test_an_entry_that_is_a_symlink_is_not_followed_even_to_a_valid_entry(filled, cache: Path,
                                                                           tmp_path: Path) -> None:
    job = _hip(_jobs())
    entry = _entry(cache, job)
    elsewhere = tmp_path / "elsewhere"
    shutil.copyfile(entry, elsewhere)
    genuine = elsewhere.read_bytes()
    entry.unlink()
    entry.symlink_to(elsewhere)
    with pytest.raises(BadEntry, match=r": a symbolic link; it was not followed$"):
        CompileCache(cache, VERSION).get(job)
    summary = _build(tmp_path / "images", cache)
    assert (summary.compiled, summary.cached, summary.discarded) == (1, 3, 1)
    # The link itself was replaced; what it pointed to was neither read nor written.
    assert not entry.is_symlink() and entry.read_bytes() == genuine
    assert elsewhere.read_bytes() == genuine
    assert _tree(tmp_path / "images") == _tree(filled[0])


def test_a_cache_folder_that_is_a_symlink_is_not_followed_nor_written_through(filled, cache: Path,
                                                                               tmp_path: Path) -> None:
    job = _hip(_jobs())
    folder = _entry(cache, job).parent
    elsewhere = tmp_path / "elsewhere"
    shutil.move(folder, elsewhere)  # valid entries, behind a link
    folder.symlink_to(elsewhere, target_is_directory=True)
    before = _tree(elsewhere)
    with pytest.raises(BadEntry, match=rf"^{re.escape(str(folder))}: not a folder \(a symbolic link or a file\); "
                                       r"it was not followed$"):
        CompileCache(cache, VERSION).get(job)
    summary = _build(tmp_path / "images", cache)
    assert summary.compiled == summary.discarded >= 1 and summary.compiled + summary.cached == 4
    assert folder.is_dir() and not folder.is_symlink()
    assert _tree(elsewhere) == before
    assert _tree(tmp_path / "images") == _tree(filled[0])


def test_an_entry_that_cannot_be_stored_is_reported_once_and_the_build_goes_on(
        filled, cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    job = _hip(_jobs())
    entry = _entry(cache, job)
    entry.unlink()
    (entry / "occupied").mkdir(parents=True)  # a folder in the entry's place: no file can replace it
    summary = _build(tmp_path / "images", cache)
    assert (summary.compiled, summary.cached, summary.discarded, summary.failed) == (1, 3, 1, [])
    err = capsys.readouterr().err
    assert re.search(rf"^compile cache: cannot store {re.escape(job.label)} in {re.escape(str(cache))}: .*; "
                     r"building on without storing$", err, re.M), err
    assert _tree(tmp_path / "images") == _tree(filled[0])
    assert prove_folder(tmp_path / "images") == 4


def test_a_cache_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(CacheError, match=r"^cannot create the compile cache folder .*/file: File exists$"):
        CompileCache(tmp_path / "file", VERSION)


def test_a_system_that_cannot_open_without_following_links_gets_no_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "supports_dir_fd", set())
    with pytest.raises(CacheError, match=r"^the compile cache needs a system that opens files without following "
                                         r"links \(O_NOFOLLOW and dir_fd\): Linux or macOS$"):
        CompileCache(tmp_path / "cache", VERSION)
    assert not (tmp_path / "cache").exists()


def test_a_cache_folder_that_cannot_be_opened_counts_as_a_bad_entry(cache: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    job = _hip(_jobs())
    compile_cache = CompileCache(cache, VERSION)
    real_open = os.open

    def refuse(path, flags, *args, **kw):
        if path == job.key[:2]:
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(BadEntry, match=rf"{re.escape(job.key[:2])}: cannot be opened: Permission denied$"):
        compile_cache.get(job)


# --------------------------------------------------------------------------- the command line


def _cli(*args: str | Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "builder", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**{k: v for k, v in os.environ.items()
                                               if k not in ("AOTRITON_BUILDER_ANY_TRITON", "AOTRITON_BUILDER_CACHE")},
                                            **env})


def test_the_cache_comes_from_the_option_or_the_environment_and_no_cache_turns_it_off(tmp_path: Path) -> None:
    select = ["--kernels", "add", "--targets", "gfx942", "-j", "2"]
    cache = tmp_path / "cache"
    first = _cli("build", *select, "--out", tmp_path / "a", env={"AOTRITON_BUILDER_CACHE": str(cache)})
    assert first.returncode == 0, first.stderr
    assert f"into {tmp_path / 'a'} with 2 workers, compile cache {cache}" in first.stderr
    assert first.stdout.startswith("compiled 3, reused 0, failed 0;")
    second = _cli("build", *select, "--out", tmp_path / "b", "--cache", cache, env={})
    assert second.stdout.startswith("compiled 0, reused 0, from cache 3, failed 0;"), second.stderr
    off = _cli("build", *select, "--out", tmp_path / "c", "--no-cache", env={"AOTRITON_BUILDER_CACHE": str(cache)})
    assert off.stdout.startswith("compiled 3, reused 0, failed 0;"), off.stderr
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b") == _tree(tmp_path / "c")
