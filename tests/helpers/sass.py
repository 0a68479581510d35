"""SASS opcode counts of a cubin, from the ``nvdisasm`` that ships with Triton: how the CPU tests
check what ptxas made of a kernel (wgmma kept asynchronous, no register spills) without a GPU."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

# One instruction of nvdisasm's listing: its address comment, an optional predicate, the opcode.
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")


def sass_ops(cubin: bytes) -> dict[str, int]:
    """How many times each opcode (``HGMMA.64x128x16.F32``, ``STL``, ...) appears in ``cubin``."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops: dict[str, int] = {}
    for op in _INSTRUCTION.findall(sass):
        ops[op] = ops.get(op, 0) + 1
    return ops
