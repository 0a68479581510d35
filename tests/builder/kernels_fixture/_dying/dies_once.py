"""out = x, with a compile-time step that kills the compiling process once.

When ``AOTRITON_TEST_DIE_ONCE`` names a file that does not exist, the first compile creates it
and kills its own process with SIGKILL, as the out-of-memory killer would; every later compile
(the retry) goes through. Without the variable it is an ordinary kernel.
"""

import os
import signal

import triton
import triton.language as tl

from builder.registry import ConfigDecl, KernelDecl


class _KillOnFirstCompile:
    """Constructed at compile time by :func:`_die_once`. A class, not a function: Triton's
    dependency finder hashes the globals a constexpr function names and refuses plain functions."""

    def __init__(self) -> None:
        marker = os.environ.get("AOTRITON_TEST_DIE_ONCE")
        if marker:
            try:
                open(marker, "x").close()
            except FileExistsError:
                return
            os.kill(os.getpid(), signal.SIGKILL)


@triton.constexpr_function
def _die_once(block):
    _KillOnFirstCompile()
    return block


@triton.jit
def dies_once_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    B: tl.constexpr = _die_once(BLOCK)
    offs = tl.program_id(0) * B + tl.arange(0, B)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


KERNEL = KernelDecl(
    name="dies_once",
    fn=dies_once_kernel,
    signature={"x_ptr": "*fp32", "n": "i32", "out_ptr": "*fp32", "BLOCK": "constexpr"},
    configs=(ConfigDecl(constexprs={"BLOCK": 128}, num_warps=1, num_stages=1),),
    grid=("cdiv(n, BLOCK)", "1", "1"),
)
