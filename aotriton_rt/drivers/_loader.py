"""Finding and opening the GPU driver's shared library: one ordered, documented search.

For ``kind`` "cuda" (the CUDA driver, libcuda) or "hip" (the HIP runtime, libamdhip64),
``load_library`` tries, in this order, and returns the first that opens:

1. The override variable, ``AOTRITON_RT_CUDA_LIB`` or ``AOTRITON_RT_HIP_LIB``: the full path
   of the library. When it is set nothing else is tried, and failing to open it is an error.
2. A copy already loaded in this process (by torch, CuPy, JAX...), so that we share its
   driver state instead of loading a second runtime: on Linux the paths in
   ``/proc/self/maps``; on Windows ``GetModuleHandleW`` of the standard names.
3. The standard places for the platform:

   ============  ==========================================================================
   Linux CUDA    ``libcuda.so.1``, ``libcuda.so`` (the system loader's search)
   Windows CUDA  ``nvcuda.dll``
   Linux HIP     ``$ROCM_PATH/lib/<name>``, then the bare names (the loader's search:
                 ``LD_LIBRARY_PATH``, ldconfig cache), then ``/opt/rocm/lib/<name>``, for
                 each name ``libamdhip64.so.7``, ``libamdhip64.so.6``, ``libamdhip64.so``
   Windows HIP   ``%HIP_PATH%\\bin\\<name>``, then the bare names, for each name
                 ``amdhip64_7.dll``, ``amdhip64_6.dll``, ``amdhip64.dll``
   ============  ==========================================================================

   ``$ROCM_PATH`` / ``%HIP_PATH%`` come first because setting them says which install to
   use; ``/opt/rocm`` is the default install, tried last. (Python 3.8+ on Windows does not
   search ``PATH`` for bare DLL names, so ``%HIP_PATH%\\bin`` must be named explicitly.)

When nothing opens, ``LibraryNotFound`` lists every place tried with the system's error and
names the variable to set. The platform is a parameter (default ``sys.platform``) so the
Windows plan can be exercised on Linux; the opener follows the real host.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from aotriton_rt.errors import LibraryNotFound

__all__ = ["ENV_VARS", "Candidate", "LoadedLibrary", "find_loaded", "load_library",
           "search_plan"]

#: The override variable of each kind.
ENV_VARS = {"cuda": "AOTRITON_RT_CUDA_LIB", "hip": "AOTRITON_RT_HIP_LIB"}

_WHAT = {"cuda": "the CUDA driver library (libcuda)",
         "hip": "the HIP runtime library (libamdhip64)"}

_NAMES = {
    ("cuda", "posix"): ("libcuda.so.1", "libcuda.so"),
    ("cuda", "win32"): ("nvcuda.dll",),
    ("hip", "posix"): ("libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so"),
    ("hip", "win32"): ("amdhip64_7.dll", "amdhip64_6.dll", "amdhip64.dll"),
}

# Basenames that count as "this library" when found among the process's mappings.
_LOADED_PATTERN = {"cuda": re.compile(r"libcuda\.so(\.\d+)*"),
                   "hip": re.compile(r"libamdhip64\.so(\.\d+)*")}

_INSTALL_HINT = {
    "cuda": "is the NVIDIA driver installed?",
    "hip": "is ROCm installed? ROCM_PATH / HIP_PATH name its root",
}


@dataclass(frozen=True)
class Candidate:
    """One place to try: ``path`` (a full path or a bare name) and where it came from."""

    path: str
    source: str  # "env", "loaded", "ROCM_PATH", "HIP_PATH", "name", "default"


@dataclass(frozen=True)
class LoadedLibrary:
    """An opened driver library: the ctypes handle, what was opened, and why."""

    handle: ctypes.CDLL
    path: str
    source: str


def _os_family(platform: str) -> str:
    return "win32" if platform == "win32" else "posix"


def _check_kind(kind: str) -> None:
    if kind not in ENV_VARS:
        raise ValueError(f"unknown library kind {kind!r}; known: {', '.join(ENV_VARS)}")


def search_plan(kind: str, *, platform: str | None = None,
                environ: Mapping[str, str] | None = None) -> list[Candidate]:
    """The standard places for ``kind`` on ``platform``, in search order (step 3 above).

    Example: ``search_plan("hip", platform="win32", environ={"HIP_PATH": r"C:\\HIP"})``
    starts with ``C:\\HIP\\bin\\amdhip64_7.dll``.
    """
    _check_kind(kind)
    platform = sys.platform if platform is None else platform
    environ = os.environ if environ is None else environ
    family = _os_family(platform)
    names = _NAMES[(kind, family)]
    plan: list[Candidate] = []
    if kind == "hip":
        root_var = "HIP_PATH" if family == "win32" else "ROCM_PATH"
        subdir = "bin" if family == "win32" else "lib"
        root = environ.get(root_var, "")
        if root:
            plan += [Candidate(os.path.join(root, subdir, n), root_var) for n in names]
    plan += [Candidate(n, "name") for n in names]
    if kind == "hip" and family == "posix":
        plan += [Candidate(os.path.join("/opt/rocm/lib", n), "default") for n in names]
    return plan


def find_loaded(kind: str, *, platform: str | None = None,
                maps_path: str = "/proc/self/maps") -> list[str]:
    """Paths of copies of ``kind``'s library already mapped into this process (step 2).

    On Linux this reads ``maps_path``; on a real Windows host it asks ``GetModuleHandleW``.
    Elsewhere (or when simulating Windows on another host) it finds nothing.
    """
    _check_kind(kind)
    platform = sys.platform if platform is None else platform
    if _os_family(platform) == "win32":
        return _loaded_windows(_NAMES[(kind, "win32")]) if sys.platform == "win32" else []
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []  # no procfs (macOS, some sandboxes): nothing known to be loaded
    pattern = _LOADED_PATTERN[kind]
    found: list[str] = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        path = fields[5]
        if pattern.fullmatch(os.path.basename(path)) and path not in found \
                and os.path.exists(path):  # skips "(deleted)" mappings
            found.append(path)
    return found


def _loaded_windows(names: Sequence[str]) -> list[str]:
    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
    kernel32.GetModuleHandleW.argtypes = [ctypes.c_wchar_p]
    kernel32.GetModuleHandleW.restype = ctypes.c_void_p
    kernel32.GetModuleFileNameW.argtypes = [ctypes.c_void_p, ctypes.c_wchar_p, ctypes.c_uint32]
    kernel32.GetModuleFileNameW.restype = ctypes.c_uint32
    found = []
    for name in names:
        module = kernel32.GetModuleHandleW(name)
        if module:
            buf = ctypes.create_unicode_buffer(32768)
            if kernel32.GetModuleFileNameW(module, buf, len(buf)):
                found.append(buf.value)
    return found


def _default_opener() -> Callable[[str], ctypes.CDLL]:
    # The opener follows the real host: a simulated "win32" on Linux still opens with dlopen.
    if sys.platform == "win32":
        return ctypes.WinDLL  # type: ignore[attr-defined]
    return ctypes.CDLL


def _display_name(kind: str, platform: str) -> str:
    return _NAMES[(kind, _os_family(platform))][0]


def load_library(kind: str, *, platform: str | None = None,
                 environ: Mapping[str, str] | None = None,
                 opener: Callable[[str], ctypes.CDLL] | None = None,
                 maps_path: str = "/proc/self/maps") -> LoadedLibrary:
    """Open ``kind``'s driver library ("cuda" or "hip") along the documented search order.

    Arguments: ``platform`` (default ``sys.platform``) picks the names and folders;
    ``environ`` (default ``os.environ``) supplies the override and root variables;
    ``opener`` opens one candidate (default ``ctypes.CDLL``, ``ctypes.WinDLL`` on Windows);
    ``maps_path`` is where Linux lists this process's mappings.

    Returns a ``LoadedLibrary``. Raises ``LibraryNotFound`` listing every place tried and
    the OS error for each, and naming the variable to set.

    Example: ``load_library("hip").path`` -> ``"/opt/rocm/lib/libamdhip64.so.7"``.
    """
    _check_kind(kind)
    platform = sys.platform if platform is None else platform
    environ = os.environ if environ is None else environ
    opener = _default_opener() if opener is None else opener
    var = ENV_VARS[kind]

    override = environ.get(var, "")
    if override:
        try:
            return LoadedLibrary(opener(override), override, "env")
        except OSError as exc:
            raise LibraryNotFound(
                f"cannot load {_WHAT[kind]} from {var}={override}: {exc}\n"
                f"Point {var} at the full path of an existing {_display_name(kind, platform)}, "
                f"or unset it to search the standard places.", call="dlopen") from exc

    tried: list[str] = []
    loaded = find_loaded(kind, platform=platform, maps_path=maps_path)
    if not loaded:
        where = "/proc/self/maps" if _os_family(platform) == "posix" else "GetModuleHandleW"
        tried.append(f"already loaded ({where}): none")
    candidates = [Candidate(p, "loaded") for p in loaded]
    candidates += search_plan(kind, platform=platform, environ=environ)
    for candidate in candidates:
        try:
            return LoadedLibrary(opener(candidate.path), candidate.path, candidate.source)
        except OSError as exc:
            tried.append(f"{candidate.path} ({candidate.source}): {exc}")
    listing = "\n".join(f"  - {line}" for line in tried)
    raise LibraryNotFound(
        f"cannot find {_WHAT[kind]}; tried, in order:\n{listing}\n"
        f"Set {var} to the full path of {_display_name(kind, platform)} "
        f"({_INSTALL_HINT[kind]}).", call="dlopen")
