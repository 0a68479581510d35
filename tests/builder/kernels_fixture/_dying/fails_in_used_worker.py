"""out = x, with a compile-time step that fails in any process that has compiled it before.

Models a compiler whose state leaks from one compile to the next in a reused process (Triton
3.6's AMD fp8 conversions have failed that way in the builder's long-lived workers, never in a
fresh one): the first compile in a process goes through, a later one in the same process raises.
"""

import triton
import triton.language as tl

from builder.registry import ConfigDecl, KernelDecl


class _OncePerProcess:
    """Constructed at compile time by :func:`_fresh_only`; raises from the second construction in a
    process on. A class, not a function: Triton's dependency finder refuses plain functions."""

    compiled = 0

    def __init__(self) -> None:
        type(self).compiled += 1
        if type(self).compiled > 1:
            raise RuntimeError("PassManager::run failed (state left by an earlier compile in this process)")


@triton.constexpr_function
def _fresh_only(block):
    _OncePerProcess()
    return block


@triton.jit
def fresh_only_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    B: tl.constexpr = _fresh_only(BLOCK)
    offs = tl.program_id(0) * B + tl.arange(0, B)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


KERNEL = KernelDecl(
    name="fresh_only",
    fn=fresh_only_kernel,
    signature={"x_ptr": "*fp32", "n": "i32", "out_ptr": "*fp32", "BLOCK": "constexpr"},
    configs=(ConfigDecl(constexprs={"BLOCK": 128}, num_warps=1, num_stages=1),
             ConfigDecl(constexprs={"BLOCK": 256}, num_warps=1, num_stages=1)),
    grid=("cdiv(n, BLOCK)", "1", "1"),
)
