"""What the fake GPU driver libraries share on the Python side: building one (``compile_shared``,
with ``fake_driver.h`` on the include path) and reading what it recorded (``read_log``,
``fnv1a64``). The fakes themselves: ``tests/fakehip`` (libamdhip64) and ``tests/fakecuda``
(libcuda.so.1)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

#: The C helpers every fake includes (environment, failure injection, the log, hex, FNV-1a).
HEADER = Path(__file__).with_name("fake_driver.h")

# Fields the fakes write as hex text; read_log turns them back into bytes.
_HEX_FIELDS = ("args", "head")


def compile_shared(source: Path, out: Path, soname: str) -> Path:
    """Compile one C file into the shared library ``out`` with the given soname.

    Skips recompiling when ``out`` is newer than ``source`` and the shared header. Raises
    ``RuntimeError`` with gcc's output when compiling fails, and ``FileNotFoundError`` when gcc
    is missing.
    """
    if out.exists() and out.stat().st_mtime >= max(source.stat().st_mtime, HEADER.stat().st_mtime):
        return out
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise FileNotFoundError("gcc is needed to build the fake GPU libraries")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    proc = subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-Wall", f"-I{HEADER.parent}", f"-Wl,-soname,{soname}", "-o", str(tmp),
         str(source)],
        capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {source.name} failed:\n{proc.stderr}")
    os.replace(tmp, out)  # atomic, so parallel builders never see half a library
    return out


def read_log(path: Path) -> list[dict]:
    """Parse a fake's JSON-lines log; hex fields (``args``, ``head``) become bytes.

    A missing log reads as no calls.
    """
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        for field in _HEX_FIELDS:
            if field in record:
                record[field] = bytes.fromhex(record[field])
        records.append(record)
    return records


def fnv1a64(data: bytes) -> str:
    """The FNV-1a 64-bit digest, as the fakes log it for module images (16 hex digits)."""
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"
