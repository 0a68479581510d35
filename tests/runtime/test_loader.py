"""Library discovery: the ordered search, the override variables, and the failure listing.

Real files in temporary folders stand in for installs; the fake libamdhip64 is a real ELF
shared library, so it can be opened under any name, including Windows DLL names when the
Windows plan is simulated on Linux.
"""

from __future__ import annotations

import _ctypes
import ctypes
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aotriton_rt.drivers._loader import Candidate, find_loaded, load_library, search_plan
from aotriton_rt.errors import DriverError, LibraryNotFound
from tests.fakehip import build_fake_hip

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def real_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A loadable shared library (the fake HIP runtime, under a name discovery ignores)."""
    return build_fake_hip(tmp_path_factory.mktemp("lib"), "libfakeamdhip64.so")


@pytest.fixture()
def no_maps(tmp_path: Path) -> str:
    """An empty /proc/self/maps, so tests do not see libraries other tests loaded."""
    path = tmp_path / "maps"
    path.write_text("")
    return str(path)


class Recorder:
    """An opener that records every attempt and opens with dlopen."""

    def __init__(self) -> None:
        self.tried: list[str] = []
        self.opened: list[ctypes.CDLL] = []

    def __call__(self, path: str) -> ctypes.CDLL:
        self.tried.append(path)
        handle = ctypes.CDLL(path)
        self.opened.append(handle)
        return handle


@pytest.fixture()
def opener() -> Iterator[Recorder]:
    """A Recorder that unloads what it opened: copies under real names (libamdhip64.so.6)
    left mapped in this process would be found by later discovery in other tests."""
    recorder = Recorder()
    yield recorder
    for handle in recorder.opened:
        _ctypes.dlclose(handle._handle)


# ---------------------------------------------------------------------------- the plan

def test_linux_hip_plan_is_rocm_path_then_loader_names_then_opt_rocm() -> None:
    plan = search_plan("hip", platform="linux", environ={"ROCM_PATH": "/opt/rocm-7.0.2"})
    assert plan == [
        Candidate("/opt/rocm-7.0.2/lib/libamdhip64.so.7", "ROCM_PATH"),
        Candidate("/opt/rocm-7.0.2/lib/libamdhip64.so.6", "ROCM_PATH"),
        Candidate("/opt/rocm-7.0.2/lib/libamdhip64.so", "ROCM_PATH"),
        Candidate("libamdhip64.so.7", "name"),
        Candidate("libamdhip64.so.6", "name"),
        Candidate("libamdhip64.so", "name"),
        Candidate("/opt/rocm/lib/libamdhip64.so.7", "default"),
        Candidate("/opt/rocm/lib/libamdhip64.so.6", "default"),
        Candidate("/opt/rocm/lib/libamdhip64.so", "default"),
    ]


def test_windows_hip_plan_is_hip_path_bin_then_dll_names() -> None:
    plan = search_plan("hip", platform="win32", environ={"HIP_PATH": "/sdk/hip"})
    assert [c.path for c in plan] == [
        os.path.join("/sdk/hip", "bin", "amdhip64_7.dll"),
        os.path.join("/sdk/hip", "bin", "amdhip64_6.dll"),
        os.path.join("/sdk/hip", "bin", "amdhip64.dll"),
        "amdhip64_7.dll", "amdhip64_6.dll", "amdhip64.dll",
    ]
    assert [c.source for c in plan][:3] == ["HIP_PATH"] * 3


def test_cuda_plans_use_the_driver_names_of_each_os() -> None:
    assert [c.path for c in search_plan("cuda", platform="linux", environ={})] == \
        ["libcuda.so.1", "libcuda.so"]
    assert [c.path for c in search_plan("cuda", platform="win32", environ={})] == ["nvcuda.dll"]


def test_a_plan_without_root_variables_has_no_empty_folders() -> None:
    assert search_plan("hip", platform="linux", environ={"ROCM_PATH": ""})[0] == \
        Candidate("libamdhip64.so.7", "name")


# ---------------------------------------------------------------------------- loading

def test_the_override_variable_wins_and_nothing_else_is_tried(real_lib: Path, no_maps: str,
                                                               opener: Recorder) -> None:
    found = load_library("hip", environ={"AOTRITON_RT_HIP_LIB": str(real_lib),
                                         "ROCM_PATH": "/nonexistent"},
                         opener=opener, maps_path=no_maps)
    assert (found.path, found.source) == (str(real_lib), "env")
    assert opener.tried == [str(real_lib)]
    assert found.handle.hipInit(0) == 0  # it is the library asked for


def test_an_override_that_does_not_open_is_an_error_naming_the_variable(tmp_path: Path) -> None:
    missing = tmp_path / "libamdhip64.so.7"
    with pytest.raises(LibraryNotFound, match=(
            r"^cannot load the HIP runtime library \(libamdhip64\) from "
            rf"AOTRITON_RT_HIP_LIB={missing}: .*No such file.*\nPoint AOTRITON_RT_HIP_LIB at the "
            r"full path of an existing libamdhip64\.so\.7, or unset it to search the standard "
            r"places\.$")):
        load_library("hip", environ={"AOTRITON_RT_HIP_LIB": str(missing)})


def test_rocm_path_is_searched_and_an_unloadable_file_is_skipped(real_lib: Path, tmp_path: Path,
                                                                 no_maps: str, opener: Recorder) -> None:
    lib = tmp_path / "rocm" / "lib"
    lib.mkdir(parents=True)
    (lib / "libamdhip64.so.7").write_bytes(b"not an ELF file")
    shutil.copy(real_lib, lib / "libamdhip64.so.6")
    found = load_library("hip", platform="linux", environ={"ROCM_PATH": str(tmp_path / "rocm")},
                         opener=opener, maps_path=no_maps)
    assert (found.path, found.source) == (str(lib / "libamdhip64.so.6"), "ROCM_PATH")
    assert opener.tried == [str(lib / "libamdhip64.so.7"), str(lib / "libamdhip64.so.6")]


def test_simulated_windows_finds_the_dll_under_hip_path_bin(real_lib: Path, tmp_path: Path,
                                                           no_maps: str, opener: Recorder) -> None:
    sdk = tmp_path / "AMD" / "ROCm" / "6.4"
    (sdk / "bin").mkdir(parents=True)
    shutil.copy(real_lib, sdk / "bin" / "amdhip64_6.dll")
    found = load_library("hip", platform="win32", environ={"HIP_PATH": str(sdk)}, opener=opener,
                         maps_path=no_maps)
    assert (found.path, found.source) == (str(sdk / "bin" / "amdhip64_6.dll"), "HIP_PATH")
    assert opener.tried == [str(sdk / "bin" / "amdhip64_7.dll"), str(sdk / "bin" / "amdhip64_6.dll")]


def test_simulated_windows_failure_lists_every_dll_tried_and_the_variable(tmp_path: Path,
                                                                         no_maps: str) -> None:
    with pytest.raises(LibraryNotFound) as info:
        load_library("hip", platform="win32", environ={"HIP_PATH": str(tmp_path)},
                     maps_path=no_maps)
    lines = str(info.value).splitlines()
    assert lines[0] == "cannot find the HIP runtime library (libamdhip64); tried, in order:"
    assert lines[1] == "  - already loaded (GetModuleHandleW): none"
    tried = [line.split(" (")[0].removeprefix("  - ") for line in lines[2:-1]]
    assert tried == [str(tmp_path / "bin" / "amdhip64_7.dll"), str(tmp_path / "bin" / "amdhip64_6.dll"),
                     str(tmp_path / "bin" / "amdhip64.dll"),
                     "amdhip64_7.dll", "amdhip64_6.dll", "amdhip64.dll"]
    assert all(": " in line for line in lines[2:-1])  # each with the system's error
    assert lines[-1] == ("Set AOTRITON_RT_HIP_LIB to the full path of amdhip64_7.dll (is ROCm "
                         "installed? ROCM_PATH / HIP_PATH name its root).")
    assert isinstance(info.value, DriverError) and info.value.call == "dlopen"


def test_linux_failure_lists_every_path_with_its_error(tmp_path: Path, no_maps: str) -> None:
    def refuse(path: str) -> ctypes.CDLL:
        raise OSError(f"{path}: cannot open shared object file: No such file or directory")

    with pytest.raises(LibraryNotFound) as info:
        load_library("hip", platform="linux", environ={"ROCM_PATH": str(tmp_path)},
                     opener=refuse, maps_path=no_maps)
    message = str(info.value)
    for path, source in [(f"{tmp_path}/lib/libamdhip64.so.7", "ROCM_PATH"),
                         ("libamdhip64.so.6", "name"),
                         ("/opt/rocm/lib/libamdhip64.so", "default")]:
        assert f"  - {path} ({source}): {path}: cannot open shared object file" in message
    assert message.count("\n  - ") == 10  # already-loaded + nine candidates
    assert message.endswith("Set AOTRITON_RT_HIP_LIB to the full path of libamdhip64.so.7 "
                            "(is ROCm installed? ROCM_PATH / HIP_PATH name its root).")


def test_cuda_failure_names_its_variable_and_the_driver(no_maps: str) -> None:
    def refuse(path: str) -> ctypes.CDLL:
        raise OSError("nope")

    with pytest.raises(LibraryNotFound, match=(
            r"^cannot find the CUDA driver library \(libcuda\); tried, in order:\n"
            r"  - already loaded \(/proc/self/maps\): none\n"
            r"  - libcuda\.so\.1 \(name\): nope\n  - libcuda\.so \(name\): nope\n"
            r"Set AOTRITON_RT_CUDA_LIB to the full path of libcuda\.so\.1 \(is the NVIDIA driver "
            r"installed\?\)\.$")):
        load_library("cuda", platform="linux", environ={}, opener=refuse, maps_path=no_maps)


# ---------------------------------------------------------------------------- already loaded

def test_find_loaded_reads_library_paths_from_the_maps(real_lib: Path, tmp_path: Path) -> None:
    hip7 = tmp_path / "libamdhip64.so.7"
    shutil.copy(real_lib, hip7)
    maps = tmp_path / "maps"
    maps.write_text(
        f"7f0000000000-7f0000001000 r--p 00000000 08:01 123 {hip7}\n"
        f"7f0000001000-7f0000002000 r-xp 00001000 08:01 123 {hip7}\n"
        f"7f0000003000-7f0000004000 r--p 00000000 08:01 124 {tmp_path}/libamdhip64.so.6 (deleted)\n"
        f"7f0000005000-7f0000006000 r--p 00000000 08:01 125 {tmp_path}/libamdhip64_fake.so\n"
        "7f0000007000-7f0000008000 rw-p 00000000 00:00 0 [heap]\n"
        "7f0000009000-7f000000a000 rw-p 00000000 00:00 0\n")
    assert find_loaded("hip", platform="linux", maps_path=str(maps)) == [str(hip7)]
    assert find_loaded("cuda", platform="linux", maps_path=str(maps)) == []
    assert find_loaded("hip", platform="linux", maps_path=str(tmp_path / "absent")) == []


def test_a_library_already_loaded_in_the_process_is_reused(real_lib: Path, tmp_path: Path) -> None:
    loaded = tmp_path / "torch" / "lib" / "libamdhip64.so"
    loaded.parent.mkdir(parents=True)
    shutil.copy(real_lib, loaded)
    code = (
        "import ctypes, json, sys\n"
        "from aotriton_rt.drivers._loader import load_library\n"
        "ctypes.CDLL(sys.argv[1])  # as torch would have\n"
        "found = load_library('hip', environ={'ROCM_PATH': '/nonexistent'})\n"
        "print(json.dumps([found.path, found.source]))\n")
    env = {k: v for k, v in os.environ.items() if k != "AOTRITON_RT_HIP_LIB"}
    proc = subprocess.run([sys.executable, "-c", code, str(loaded)], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout) == [str(loaded), "loaded"]
