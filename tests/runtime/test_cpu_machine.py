"""A new user on a machine with no GPU and only the runtime installed (issue 25, finding 11): the
builder's console script names the extra to install, and ``explain`` without ``--arch`` says to
pass it, each in one line, never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs the console script exactly as its installed wrapper does (`sys.exit(main())`), with the
# entry taken from pyproject.toml and Triton unimportable.
CONSOLE = """
import importlib, sys
sys.modules["triton"] = None  # what `import triton` does when the [builder] extra is missing
module, _, attr = sys.argv[1].partition(":")
sys.argv = [sys.argv[2], *sys.argv[3:]]
sys.exit(getattr(importlib.import_module(module), attr)())
"""


def _no_gpu_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine without a GPU driver (the driver search's variables point at
    nothing, so this holds on a GPU machine too)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "AOTRITON_RT_CUDA_LIB": str(tmp_path / "no-libcuda.so"),
            "AOTRITON_RT_HIP_LIB": str(tmp_path / "no-libamdhip64.so")}


def _console(script: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    entry = re.search(rf'^{script} = "([\w.:]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    return subprocess.run([sys.executable, "-c", CONSOLE, entry, script, *args], env=_no_gpu_env(tmp_path),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [["list"], ["build", "--targets", "sm90", "--kernels", "add"]])
def test_the_builder_without_its_extra_names_the_extra_in_one_line(tmp_path, args):
    run = _console("aotriton-rt-builder", args, tmp_path)
    assert "Traceback" not in run.stderr, run.stderr
    assert run.returncode == 1
    assert run.stderr == (f"error: aotriton-rt-builder {args[0]} needs triton, which is not installed; install "
                          "the builder's extra: pip install 'aotriton-rt[builder]'\n")


def test_the_builder_help_needs_no_triton(tmp_path):
    run = _console("aotriton-rt-builder", ["--help"], tmp_path)
    assert run.returncode == 0 and "build" in run.stdout, run.stderr


def _two_arch_images(folder: Path) -> Path:
    from tests.runtime.test_attention_op import _synthetic_variant

    base = {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 0, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0}
    variants = [_synthetic_variant("attn_fwd", base, 0, arch=a) for a in ("sm80", "sm90")]
    folder.mkdir()
    (folder / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                     "triton_version": "3.6.0", "tuning": {},
                                                     "variants": variants}))
    return folder


def test_explain_without_a_gpu_or_arch_says_to_pass_arch(tmp_path):
    images = _two_arch_images(tmp_path / "images")
    run = subprocess.run([sys.executable, "-m", "aotriton_rt", "explain", "attention", "--images", str(images),
                          "--seqlen", "128"], env=_no_gpu_env(tmp_path), cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert run.stderr == ("error: no GPU found on this machine to take the arch from; pass --arch sm80 (the "
                          "images hold: sm80, sm90)\n")
    ok = subprocess.run([sys.executable, "-m", "aotriton_rt", "explain", "attention", "--images", str(images),
                         "--seqlen", "128", "--arch", "sm90"], env=_no_gpu_env(tmp_path), cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("attention forward on sm90"), ok.stderr


def test_explain_as_a_function_says_to_pass_arch_too(tmp_path, monkeypatch):
    import aotriton_rt
    from aotriton_rt.errors import NoDevice
    from aotriton_rt.ops import attention as op

    lib = aotriton_rt.Library(_two_arch_images(tmp_path / "images"))

    def no_gpu(*a, **k):
        raise NoDevice("no GPU backend is usable:\n  - cuda: x\n  - hip: y\nPass backend='cuda' ...")
    monkeypatch.setattr(type(lib), "driver", property(no_gpu), raising=False)
    with pytest.raises(NoDevice, match=r"^no GPU found on this machine to take the arch from; pass arch='sm80' "
                                       r"\(the images hold: sm80, sm90\)$"):
        op.explain(dtype="fp16", head_dim=128, seqlen_q=128, library=lib)
