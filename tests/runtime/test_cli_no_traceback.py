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
        "destination path too long": (["download", "--from-file", str(ROOT / "pyproject.toml"), "--dest",
                                       str(tmp / ("y" * 5000))], r"not a readable bundle|too long"),
    }


CASES = ["missing bundle file", "bundle that is not a tar", "destination is a file", "verify escaping --dest",
         "path too long", "unsupported URL", "negative retries", "destination path too long"]


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
        raise KeyError("surprise\nsecond line")
    monkeypatch.setattr(d, "cmd_verify", boom)
    rc = main(["verify"])
    err = capsys.readouterr().err
    assert rc == d.EXIT_BUG == 3 and err.count("\n") == 1
    assert "error: unexpected KeyError: 'surprise\\nsecond line'; this is a bug in aotriton-rt, please report" in err


# Issue 25, finding 8: values the user typed are checked up front, and echoed escaped on one line.
def _download(*flags: str) -> list[str]:
    return ["download", "--arch", "gfx942", "--dest", "/nonexistent-aotriton-dest", *flags]


USAGE = {
    "unclosed IPv6 host": (_download("--url", "https://[::1"),
                           r"argument --url: invalid URL 'https://\[::1': Invalid IPv6 URL; pass --url as "
                           r"https://host/folder/"),
    "newline in the URL": (_download("--url", "https://a\nb/"),
                           r"argument --url: invalid URL 'https://a\\nb/': it holds a space or control character"),
    "port out of range": (_download("--url", "https://a:99999/"), r"argument --url: invalid URL .*Port out of range"),
    "no host": (_download("--url", "https:///x"), r"argument --url: invalid URL 'https:///x': it names no host"),
    "very long URL": (_download("--url", "https://a/" + "x" * 100_000), r"argument --url: invalid URL 'https://a/x+"
                      r"\.\.\.' \(100010 characters\): longer than 8192 characters"),
    "infinite timeout": (_download("--url", "https://a/", "--timeout", "inf"),
                         r"argument --timeout: must be a number of seconds in \(0, 604800\], got 'inf'"),
    "zero deadline": (_download("--url", "https://a/", "--deadline", "0"), r"argument --deadline: .* got '0'"),
    "NaN deadline": (_download("--url", "https://a/", "--deadline", "nan"),
                     r"argument --deadline: must be a number of seconds in \(0, 604800\], got 'nan'"),
    "deadline past the bound": (_download("--url", "https://a/", "--deadline", "1e9"),
                                r"argument --deadline: must be a number .* got '1e9'"),
    "unknown command": (["bogus\nline"], r"argument command: invalid choice: 'bogus\\nline'"),
    "unknown flag": (["verify", "--no-such\nflag"], r"unrecognized arguments: --no-such\\nflag"),
}


@pytest.mark.parametrize("case", sorted(USAGE))
def test_a_bad_command_line_is_one_escaped_line_and_exit_status_2(case, capsys):
    import aotriton_rt.__main__ as d

    argv, message = USAGE[case]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == d.EXIT_USAGE == 2
    assert err.count("\n") == 1 and len(err) < 700, err
    assert re.match(r"python -m aotriton_rt( download| verify)?: error: " + message, err), err
    assert err.rstrip().endswith("--help` lists the options"), err


def test_the_download_api_refuses_the_same_values_with_a_typed_error(tmp_path):
    from aotriton_rt.download import download
    from aotriton_rt.errors import DownloadError

    with pytest.raises(DownloadError, match=r"^invalid URL 'https://\[::1': Invalid IPv6 URL; pass --url"):
        download("gfx942", url="https://[::1", dest=tmp_path)
    with pytest.raises(DownloadError, match=r"^need 0 < timeout <= deadline <= 604800"):
        download("gfx942", url="https://a/", dest=tmp_path, timeout=float("inf"), deadline=float("inf"))
    with pytest.raises(DownloadError, match=r"^refusing plain HTTP for 'http://a/'"):
        download("gfx942", url="http://a/", dest=tmp_path)


def test_exit_statuses_agree_with_the_docs():
    import aotriton_rt.__main__ as d

    security = (ROOT / "docs" / "security.md").read_text()
    errors = (ROOT / "docs" / "errors.md").read_text()
    scheme = (f"exit status {d.EXIT_ERROR} for a refused input, {d.EXIT_USAGE} for a bad command line, "
              f"{d.EXIT_BUG} for an internal error")
    assert scheme in security
    assert f"| {d.EXIT_BUG} |" in errors.splitlines()[errors.splitlines().index("## Command-line exit codes") + 2]


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
