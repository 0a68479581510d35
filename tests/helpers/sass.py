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
    ops: dict[str, int] = {}
    for op in _INSTRUCTION.findall(_listing(cubin)):
        ops[op] = ops.get(op, 0) + 1
    return ops


def sass_listing(cubin: bytes) -> str:
    """The nvdisasm listing of ``cubin`` (whole instructions, operands included)."""
    return _listing(cubin)


def _listing(cubin: bytes) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout


_LABEL = re.compile(r"^(\.L_x_\d+):")
# A conditional branch (a loop's back edge when its label comes first). ptxas puts an mbarrier
# wait's retry loop out of line after the kernel, with an unconditional branch back into the code:
# not a loop of the code, so such branches are left out.
_BRANCH = re.compile(r"@!?U?P\w+\s+BRA `\((\.L_x_\d+)\)")


def loop_spills(cubin: bytes) -> int:
    """Local-memory instructions (``STL``/``LDL``) inside the innermost loops that issue wgmma.

    A loop is a conditional backward branch's range of the listing; the innermost wgmma loops are
    those holding an ``HGMMA`` (``QGMMA`` for FP8) and no smaller such range (the key loops of an
    attention kernel; an outer tile loop holds them). A spill there costs every iteration; one
    outside them, once per tile."""
    return listing_loop_spills(_listing(cubin))


def listing_loop_spills(listing: str) -> int:
    """:func:`loop_spills` of an nvdisasm listing."""
    lines = listing.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    ranges = [(labels[m.group(1)], i) for i, line in enumerate(lines)
              if (m := _BRANCH.search(line)) and labels.get(m.group(1), i + 1) <= i]
    wgmma = {i for i, line in enumerate(lines) if "HGMMA" in line or "QGMMA" in line}
    loops = [(a, b) for a, b in ranges if any(a <= i <= b for i in wgmma)]
    innermost = [(a, b) for a, b in loops
                 if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)]
    local = [i for i, line in enumerate(lines) if _INSTRUCTION.search(line)
             and _INSTRUCTION.search(line).group(1).split(".")[0] in ("STL", "LDL")]
    return sum(1 for i in local if any(a <= i <= b for a, b in innermost))
