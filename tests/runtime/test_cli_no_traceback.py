"""``python -m aotriton_rt`` never shows a traceback: one line naming the problem and the fix,
and a non-zero exit status (issue 9, item 6)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aotriton_rt.__main__ import _one_line, main

ROOT = Path(__file__).resolve().parents[2]


def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    a_file = tmp / "a-file"
    a_file.write_text("x")
    return {
        "missing bundle file": (["download", "--from-file", str(tmp / "nope.tar"), "--dest", str(tmp / "d")],
                                r"nope\.tar: no such bundle file"),
        "bundle that is not a tar": (["download", "--from-file", str(a_file), "--dest", str(tmp / "d")],
                                     r"not a readable bundle"),
        "destination is a file": (["verify", "--dest", str(a_file)], r"nothing is installed in"),
        "verify escaping --dest": (["verify", "../..", "--dest", str(tmp)], r"'\.\./\.\.' is not a bundle name"),
        "path too long": (["verify", "--folder", str(tmp / ("x" * 5000))], r"reinstall with"),
        "unsupported URL": (["download", "--arch", "gfx942", "--url", "ftp://example.org/", "--dest", str(tmp)],
                            r"unsupported URL 'ftp://example\.org/'"),
        "negative retries": (["download", "--arch", "gfx942", "--url", "http://127.0.0.1:9/", "--allow-http",
                              "--retries", "-1", "--dest", str(tmp)], r"need 0 < timeout <= deadline"),
        "zero deadline": (["download", "--arch", "gfx942", "--url", "http://127.0.0.1:9/", "--allow-http",
                           "--deadline", "0", "--dest", str(tmp)], r"need 0 < timeout <= deadline"),
        "destination path too long": (["download", "--from-file", str(ROOT / "pyproject.toml"), "--dest",
                                       str(tmp / ("y" * 5000))], r"not a readable bundle|too long"),
    }


CASES = ["missing bundle file", "bundle that is not a tar", "destination is a file", "verify escaping --dest",
         "path too long", "unsupported URL", "negative retries", "zero deadline", "destination path too long"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gives_one_error_line_and_a_nonzero_status(case, tmp_path, capsys):
    argv, message = _bad_inputs(tmp_path)[case]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0
    assert "Traceback" not in err
    assert re.search(message, err), err


def test_unexpected_exception_is_reported_as_a_bug_in_one_line(monkeypatch, capsys):
    import aotriton_rt.__main__ as d

    def boom(args):
        raise KeyError("surprise")
    monkeypatch.setattr(d, "cmd_verify", boom)
    rc = main(["verify"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "error: unexpected KeyError: 'surprise'; this is a bug in aotriton-rt, please report it" in err


def test_info_with_an_empty_images_variable_says_what_is_wrong(tmp_path):
    env = {**os.environ, "AOTRITON_RT_IMAGES": os.pathsep, "PYTHONPATH": str(ROOT),
           "AOTRITON_RT_CUDA_LIB": str(tmp_path / "nope.so"), "AOTRITON_RT_HIP_LIB": str(tmp_path / "no.so")}
    proc = subprocess.run([sys.executable, "-m", "aotriton_rt", "info"], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert "Traceback" not in proc.stderr
    assert "AOTRITON_RT_IMAGES is set to ':', which names no folder" in proc.stdout


def test_a_driver_search_failure_is_summarised_with_its_fix():
    e = RuntimeError("cannot find the CUDA driver; tried, in order:\n  - a: no\n  - b: no\nSet X to the path.")
    assert _one_line(e) == "cannot find the CUDA driver (2 places tried); Set X to the path."
