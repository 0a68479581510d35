"""Adding a kernel the attention operator dispatches to takes its own file and one family entry.

docs/adding-a-kernel.md ("A kernel that an operator dispatches to") promises that another arch's
own forward needs nothing but its file in ``builder/kernels/`` and its entry in
``aotriton_rt/ops/attention/family.py``. Here the page's file is written into a package of its
own, which the registry loads as it loads ``builder/kernels`` (``load_kernels(package)``, as the
axpy example's test does), and compiled with ``attn_fwd`` for sm80 on the CPU (one variant each);
the page's entry is added to ``ARCH_FORWARDS``. Nothing runs on a GPU: a driver that records each
launch's parameter block stands in for CUDA, and CPU torch tensors for device arrays. The
operator, ``attention_kernels`` and ``explain`` must then pick the new kernel on sm80 and say why,
pack for it the parameter block they pack for ``attn_fwd``, and pick ``attn_fwd`` without the entry.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="the builder compiles with triton")
pytest.importorskip("elftools", reason="the ABI proof reads ELF files with pyelftools")

import aotriton_rt  # noqa: E402
import aotriton_rt.drivers  # noqa: E402
from aotriton_rt.catalog import Catalog  # noqa: E402
from aotriton_rt.ops import attention as op  # noqa: E402
from aotriton_rt.ops.attention import family, plan, problem  # noqa: E402
from builder.build import build, check_triton_version, prove_folder  # noqa: E402
from builder.registry import expand, load_kernels  # noqa: E402
from builder.targets import parse_targets  # noqa: E402
from tests.helpers.cpu_arrays import cpu_describer  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "adding-a-kernel.md"
HEADING = "## A kernel that an operator dispatches to"
PACKAGE = "dispatched_kernel_example"
TOY = "attn_fwd_toy"
SPEC = {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0,
        "SOFTCAP": 0, "ALIBI": 0}
UNTUNED = ("untuned (no rule of tuning['attn_fwd_kernel'] matches; heuristic: sm80's own forward, preferred where "
           "the images hold it)")


def _section() -> str:
    return DOC.read_text().split(HEADING, 1)[1]


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", _section(), re.S)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page's file as a kernels package of its own, built with attn_fwd's same spec for sm80."""
    root = tmp_path_factory.mktemp("kernels")
    (root / PACKAGE).mkdir()
    (root / PACKAGE / "__init__.py").write_text("")
    (root / PACKAGE / "attention_toy.py").write_text(_blocks("python")[0])
    out = tmp_path_factory.mktemp("toy") / "images"
    with pytest.MonkeyPatch.context() as mp:
        # Spawned workers start with the parent's sys.path and environment: they find the
        # package, and compile for real instead of reusing ~/.triton.
        mp.syspath_prepend(str(root))
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
        version = check_triton_version()
        toy = load_kernels(PACKAGE)
        assert list(toy) == [TOY]
        jobs = expand(toy[TOY], parse_targets("default"), "default", version, package=PACKAGE)
        assert [(j.target.arch, j.spec) for j in jobs] == [("sm80", SPEC)]  # its axes, its arch
        jobs += [j for j in expand(load_kernels()["attn_fwd"], parse_targets("sm80"), "default", version)
                 if j.spec == SPEC]
        summary = build(jobs, out, workers=2, timeout=300.0, keep_going=False, triton_version=version, quiet=True)
    assert (summary.compiled, summary.failed) == (2, [])
    return out


class RecordingDriver:
    """A CUDA driver of one sm80 device whose launches record their grid and parameter block."""

    backend = "cuda"

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, int, int], bytes]] = []

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def device_arch(self, device: int) -> str:
        return "sm80"

    def load_module(self, device: int, image: bytes) -> int:
        return 1

    def get_function(self, device: int, module: int, symbol: str) -> int:
        return 1

    def prepare_function(self, function: int, shared: int) -> None:
        pass

    def make_launcher(self, function: int, *, struct: Any, **launch: Any) -> Any:
        def launcher(gx: int, gy: int, gz: int, stream: int, values: tuple) -> None:
            self.launches.append(((gx, gy, gz), struct.pack(*values)))
        return launcher


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> RecordingDriver:
    """The recording driver, and CPU torch tensors taken as arrays on its device 0."""
    fake = RecordingDriver()
    monkeypatch.setattr(aotriton_rt.drivers, "get_driver", lambda backend: fake)
    monkeypatch.setattr(problem, "_describe", cpu_describer(problem._describe))
    monkeypatch.setattr(plan, "_stream_getter", lambda p, q: lambda device: 0)
    return fake


@pytest.fixture
def entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's family entry: the constant pairs of its ARCH_FORWARDS line added to the table."""
    (line,) = (b for b in _blocks("python") if "ARCH_FORWARDS" in b)
    (assign,) = ast.parse(line).body
    assert [t.id for t in assign.targets] == ["ARCH_FORWARDS"]
    added = {k.value: v.value for k, v in zip(assign.value.keys, assign.value.values) if isinstance(v, ast.Constant)}
    assert added == {"sm80": TOY}
    for arch, kernel in added.items():
        monkeypatch.setitem(family.ARCH_FORWARDS, arch, kernel)


def _qkv() -> tuple[Any, Any, Any]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, 4, 128, 64, generator=gen).half() for _ in range(3))


def _library(images: Path) -> aotriton_rt.Library:
    return aotriton_rt.Library(images, backend="cuda")  # a fresh one: dispatch choices are cached per library


def test_the_file_declares_attn_fwds_arguments_and_its_binary_proves_them(images: Path) -> None:
    assert prove_folder(images) == 2  # the ABI proof reads both binaries
    variants = Catalog.load(images).variants
    (toy,) = [v for v in variants if v.kernel == TOY]
    (portable,) = [v for v in variants if v.kernel == "attn_fwd"]
    assert toy.target.arch == "sm80" and toy.spec == SPEC == portable.spec
    assert toy.args == portable.args and toy.hidden_args == portable.hidden_args
    assert toy.param_size == portable.param_size


def test_with_the_entry_a_call_on_sm80_runs_the_new_kernel_and_explain_says_why(
        images: Path, driver: RecordingDriver, entry: None) -> None:
    lib = _library(images)
    assert op.attention_kernels(*_qkv(), library=lib)["attn_fwd"].name == TOY
    ex = op.explain(dtype="fp16", head_dim=64, seqlen_q=128, arch="sm80", library=lib)
    (pick,) = ex.kernels
    assert (pick.role, pick.kernel, pick.spec, pick.kernel_reason) == ("attn_fwd", TOY, SPEC, UNTUNED)
    assert pick.line().endswith(f"; kernel: {UNTUNED}")
    # The page prints this explanation.
    shown = op.explain(dtype="fp16", head_dim=64, seqlen_q=4096, arch="sm80", library=lib)
    assert _blocks("text")[0].strip() == str(shown)


def test_without_the_entry_attn_fwd_runs_and_explain_has_nothing_to_say_of_the_kernel(
        images: Path, driver: RecordingDriver) -> None:
    assert "sm80" not in family.ARCH_FORWARDS
    lib = _library(images)
    assert op.attention_kernels(*_qkv(), library=lib)["attn_fwd"].name == "attn_fwd"
    (pick,) = op.explain(dtype="fp16", head_dim=64, seqlen_q=128, arch="sm80", library=lib).kernels
    assert (pick.kernel, pick.kernel_reason) == ("attn_fwd", "")
    assert "kernel:" not in pick.line()


def _launch(images: Path, driver: RecordingDriver, q: Any, k: Any, v: Any) -> tuple[str, tuple, bytes]:
    """(kernel, grid, parameter block with the fresh outputs' addresses zeroed) of one operator call;
    checks that those slots held the outputs' addresses."""
    lib = _library(images)
    name = op.attention_kernels(q, k, v, library=lib)["attn_fwd"].name
    out, lse = op.attention(q, k, v, library=lib)
    (grid, block), = driver.launches
    driver.launches.clear()
    (variant,) = lib.variants_of(name)
    slots = {a.name: (a.offset, a.size) for a in variant.args}
    masked = bytearray(block)
    for arg, array in (("Out", out), ("LSE", lse)):
        offset, size = slots[arg]
        assert int.from_bytes(block[offset:offset + size], "little") == array.data_ptr()
        masked[offset:offset + size] = bytes(size)
    offset, size = slots["Q"]
    assert int.from_bytes(block[offset:offset + size], "little") == q.data_ptr()
    return name, grid, bytes(masked)


def test_the_operator_packs_the_same_parameter_block_for_it_as_for_attn_fwd(
        images: Path, driver: RecordingDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv()
    portable = _launch(images, driver, q, k, v)
    monkeypatch.setitem(family.ARCH_FORWARDS, "sm80", TOY)
    toy = _launch(images, driver, q, k, v)
    assert (portable[0], toy[0]) == ("attn_fwd", TOY)
    assert toy[1:] == portable[1:] and portable[1] == (1, 8, 1)  # 128 rows in one 128-row block, 2 x 4 heads
