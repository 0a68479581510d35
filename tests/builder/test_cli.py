"""``python -m builder`` end to end: build, list, merge, verify, exit codes and messages.

Most tests run the CLI as a subprocess, exactly as CI and users do. One unsharded build of
``add`` for gfx942 and sm90 (6 variants) is shared by the module. Failure and timeout tests run
``main()`` in-process with the registry pointed at the fixture kernels package, because the CLI
only builds ``builder/kernels``; the compiles still happen in real worker processes.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the builder compiles with triton")
pytest.importorskip("elftools", reason="the ABI proof reads ELF files with pyelftools")
pytest.importorskip("msgpack", reason="the ABI proof reads AMDGPU metadata with msgpack")

from aotriton_rt.catalog import CATALOG_FILE, Catalog  # noqa: E402
from builder import registry  # noqa: E402
from builder.__main__ import main  # noqa: E402

ROOT = Path(registry.__file__).resolve().parent.parent
FIXTURE = "tests.builder.kernels_fixture"
SELECT = ["--kernels", "add", "--targets", "gfx942,sm90"]
SUMMARY = re.compile(r"compiled (\d+), reused (\d+), failed (\d+); images (\d+\.\d\d) MB xz from "
                     r"(\d+\.\d\d) MB raw \((\d+\.\d)%\); (\d+\.\d) s")


def cli(*args: str | Path, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m builder ARGS`` from the checkout at ``cwd``, as a user would."""
    env = {k: v for k, v in os.environ.items() if k != "AOTRITON_BUILDER_ANY_TRITON"}
    return subprocess.run([sys.executable, "-m", "builder", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _edit_catalog(folder: Path, edit) -> None:
    """Edit the catalog in its inline form (every variant in full) and write that form back."""
    obj = Catalog.load(folder).to_json()
    edit(obj)
    (folder / CATALOG_FILE).write_text(json.dumps(obj, indent=1))


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("ref") / "images"
    done = cli("build", *SELECT, "--out", out, "-j", "2")
    assert done.returncode == 0, done.stderr
    return out, done


@pytest.fixture
def copy(ref, tmp_path: Path) -> Path:
    dest = tmp_path / "images"
    shutil.copytree(ref[0], dest)
    return dest


# --------------------------------------------------------------------------- build


def test_build_prints_the_summary_with_counts_bytes_and_ratio(ref) -> None:
    out, done = ref
    assert f"building 6 variants (default set) into {out} with 2 workers" in done.stderr
    last = done.stdout.strip().splitlines()[-1]
    m = SUMMARY.fullmatch(last)
    assert m, last
    assert m.group(1, 2, 3) == ("6", "0", "0")
    variants = Catalog.load(out).variants
    packed, raw = sum(v.image.size for v in variants), sum(v.image.raw_size for v in variants)
    assert m.group(4, 5) == (f"{packed / 1e6:.2f}", f"{raw / 1e6:.2f}")
    assert m.group(6) == f"{100 * packed / raw:.1f}"
    assert "FAILED" not in done.stdout + done.stderr


def test_two_clean_builds_give_byte_identical_catalogs_and_images(ref, tmp_path: Path) -> None:
    # The second build runs from a copy of the checkout at another path, as on another CI
    # machine, with its own empty Triton cache (the CLI makes one per run): a real recompile,
    # and proof that no source path leaks into keys, catalog or binaries.
    checkout = tmp_path / "elsewhere"
    for part in ("builder", "aotriton_rt"):
        shutil.copytree(ROOT / part, checkout / part, ignore=shutil.ignore_patterns("__pycache__"))
    again = cli("build", *SELECT, "--out", tmp_path / "again", "-j", "2", "-q", cwd=checkout)
    assert again.returncode == 0, again.stderr
    assert SUMMARY.fullmatch(again.stdout.strip()).group(1, 2) == ("6", "0")
    assert _tree(tmp_path / "again") == _tree(ref[0])
    catalog = Catalog.load(ref[0])
    cuda = sum(v.target.backend == "cuda" for v in catalog.variants)
    # catalog, one shard per target and kernel, 6 images, and the PTX beside each cubin
    assert len(_tree(ref[0])) == 7 + len(catalog.target_kernels()) + cuda


def test_a_second_build_with_no_change_compiles_nothing_in_seconds(ref, copy: Path) -> None:
    started = time.monotonic()
    again = cli("build", *SELECT, "--out", copy, "-j", "2")
    wall = time.monotonic() - started
    assert again.returncode == 0, again.stderr
    m = SUMMARY.fullmatch(again.stdout.strip())
    assert m.group(1, 2, 3) == ("0", "6", "0")
    assert float(m.group(7)) < 2.0, "the build itself (after start-up) should take well under 2 s"
    assert wall < 20, f"the whole command took {wall:.1f} s"
    assert _tree(copy) == _tree(ref[0])


def test_four_shards_merged_equal_one_unsharded_build(ref, tmp_path: Path) -> None:
    shards = [tmp_path / f"shard{k}" for k in range(1, 5)]
    for k, folder in enumerate(shards, 1):
        done = cli("build", *SELECT, "--shard", f"{k}/4", "--out", folder, "-j", "1", "-q")
        assert done.returncode == 0, done.stderr
        assert f", shard {k}/4) into {folder}" in done.stderr
    counts = [len(Catalog.load(s).variants) for s in shards]
    assert sorted(counts) == [1, 1, 2, 2]
    merged = cli("merge", *shards, "--out", tmp_path / "merged")
    assert merged.returncode == 0, merged.stderr
    assert merged.stdout.strip() == f"merged 4 folders: 6 variants into {tmp_path / 'merged'}"
    assert _tree(tmp_path / "merged") == _tree(ref[0])


def test_merge_of_different_triton_versions_fails_with_the_reason(copy: Path, ref, tmp_path: Path) -> None:
    _edit_catalog(copy, lambda obj: obj.update(triton_version="3.5.0"))
    done = cli("merge", ref[0], copy, "--out", tmp_path / "merged")
    assert done.returncode == 1
    assert done.stderr.strip() == ("error: cannot merge catalogs built with different Triton versions: "
                                   "['3.5.0', '3.6.0']")


# --------------------------------------------------------------------------- list


def test_list_prints_exactly_what_build_builds(ref) -> None:
    done = cli("list", *SELECT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(v.key[:16] for v in Catalog.load(ref[0]).variants)
    assert all(re.fullmatch(r"[0-9a-f]{16}  add\[dtype=(fp16|bf16|fp32)\]#0@(gfx942|sm90)  "
                            r"warps=4 stages=1", line) for line in lines), lines
    assert done.stderr.strip() == "6 variants: add@gfx942=3, add@sm90=3"


def test_list_of_a_shard_is_that_slice(ref) -> None:
    keys = [cli("list", *SELECT, "--shard", f"{k}/2").stdout.split() for k in (1, 2)]
    first = [w for w in keys[0] if re.fullmatch(r"[0-9a-f]{16}", w)]
    second = [w for w in keys[1] if re.fullmatch(r"[0-9a-f]{16}", w)]
    assert len(first) == len(second) == 3 and not set(first) & set(second)


# --------------------------------------------------------------------------- verify


def test_verify_proves_every_image_of_a_build(ref) -> None:
    done = cli("verify", "--images", ref[0])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"ABI proof passed for 6 images in {ref[0]}"


def _shift_n(obj: dict) -> None:
    # add's i64 `n` moves from 24 to 32 and the hidden pointers follow: a well-formed catalog
    # (aligned, no overlaps, param_size covers everything) that the binary contradicts.
    v = next(v for v in obj["variants"] if v["target"]["backend"] == "hip")
    v["args"][3]["offset"] = 32
    v["hidden_args"][0]["offset"], v["hidden_args"][1]["offset"] = 40, 48
    v["param_size"] = 56


def test_verify_fails_on_a_catalog_offset_the_binary_contradicts(copy: Path) -> None:
    _edit_catalog(copy, _shift_n)
    Catalog.load(copy)  # well formed: only the binary can tell
    done = cli("verify", "--images", copy)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == ("error: ABI mismatch in add_kernel (hip/gfx942): args[3].offset: "
                                   "catalog has 32, binary has 24")


def test_verify_names_the_json_path_of_a_malformed_catalog(copy: Path) -> None:
    _edit_catalog(copy, lambda obj: obj["variants"][4]["args"][3].update(offset=30))
    done = cli("verify", "--images", copy)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"error: {copy / CATALOG_FILE}: $.variants[4].args[3].offset must be "
                                   "a multiple of align 8, found 30")


def test_verify_of_a_folder_without_a_catalog_says_so(tmp_path: Path) -> None:
    done = cli("verify", "--images", tmp_path)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert re.fullmatch(rf"error: cannot read catalog {re.escape(str(tmp_path / CATALOG_FILE))}: .+",
                        done.stderr.strip())


def test_verify_fails_on_a_changed_image(copy: Path) -> None:
    image = sorted(copy.rglob("*.cubin.xz"))[0]
    image.write_bytes(image.read_bytes() + b"\0")
    done = cli("verify", "--images", copy)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: {image.relative_to(copy).as_posix()}: sha256 does not match "
                                   "the catalog")


# --------------------------------------------------------------------------- argument errors


def test_an_unknown_target_fails_listing_the_known_ones(tmp_path: Path) -> None:
    out = tmp_path / "never"
    done = cli("build", "--kernels", "add", "--targets", "gfx942,gfx9999", "--out", out)
    assert done.returncode == 1
    assert re.fullmatch(r"error: unknown target gfx9999; known targets: gfx908, gfx90a, gfx942, gfx950, "
                        r"gfx1100, .*sm80, sm86, sm89, sm90 \(aliases: hip, cuda, default\)",
                        done.stderr.strip()), done.stderr
    assert not out.exists()


def test_an_unknown_kernel_fails_listing_the_known_ones() -> None:
    done = cli("list", "--kernels", "add,nope")
    assert done.returncode == 1
    assert re.fullmatch(r"error: unknown kernel nope; known kernels: add, .*layernorm, .*softmax.*",
                        done.stderr.strip()), done.stderr


def test_a_malformed_shard_fails_with_the_expected_form() -> None:
    done = cli("list", *SELECT, "--shard", "5/4")
    assert done.returncode == 1
    assert done.stderr.strip() == "error: --shard must be K/N with 1 <= K <= N, got '5/4'"


def test_a_command_is_required() -> None:
    done = cli()
    assert done.returncode == 2
    assert "the following arguments are required: COMMAND" in done.stderr


def test_version_and_help_say_what_each_command_does_and_its_defaults() -> None:
    from aotriton_rt import __version__

    assert cli("--version").stdout == f"aotriton-rt builder {__version__}\n"
    top = cli("--help").stdout
    assert "``" not in top, "the top-level help is plain text, not reStructuredText"
    for command in ("build", "list", "merge", "verify", "pack", "wheel"):
        assert re.search(rf"^    {command} +\S", top, re.M), f"{command} has no description in --help"
    build = cli("build", "--help").stdout
    for option, default in (("--set", "default"), ("--targets", "default"), ("--timeout", "600.0")):
        assert re.search(rf"{option} .*\(default:\s+{re.escape(default)}\)", build, re.S), option
    assert "--add" in build and "--replace" in build


# --------------------------------------------------------------------------- failures (in-process)


@pytest.fixture
def fixture_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Point the CLI's registry at the fixture package; workers follow through Job.package."""
    real_load, real_expand = registry.load_kernels, registry.expand
    monkeypatch.setattr(registry, "load_kernels", lambda package=FIXTURE: real_load(FIXTURE))
    monkeypatch.setattr(registry, "expand", functools.partial(real_expand, package=FIXTURE))
    # cmd_build points TRITON_CACHE_DIR at a temporary folder; restore it afterwards.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))


def test_a_failed_compile_is_named_and_makes_the_build_exit_non_zero(
        fixture_kernels, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["build", "--kernels", "broken,scale", "--targets", "gfx942", "--out", str(tmp_path), "-j", "2"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert re.search(r"^error: compiled 2, reused 0, failed 1; images .*\nFAILED broken\[\]#0@gfx942: "
                     r"BLOCK must be a multiple of 3$", err, re.M), err
    assert out == ""
    assert not (tmp_path / CATALOG_FILE).exists()


def test_keep_going_exits_zero_and_still_reports_each_failure_and_timeout(
        fixture_kernels, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["build", "--kernels", "broken,scale,slow", "--targets", "gfx942", "--out", str(tmp_path),
               "-j", "2", "--timeout", "6", "--keep-going"])
    out, err = capsys.readouterr()
    assert rc == 0
    lines = out.strip().splitlines()
    assert SUMMARY.fullmatch(lines[0]).group(1, 2, 3) == ("2", "0", "2")
    assert sorted(lines[1:]) == ["FAILED broken[]#0@gfx942: BLOCK must be a multiple of 3",
                                 "FAILED slow[]#0@gfx942: timed out after 6 s"]
    assert "FAILED slow[]#0@gfx942: timed out after 6 s" in err
    # What compiled is written and listed; what failed is reported, never silently dropped.
    assert sorted(v.spec["dtype"] for v in Catalog.load(tmp_path).variants) == ["fp16", "fp32"]
