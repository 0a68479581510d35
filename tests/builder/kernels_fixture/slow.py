"""A kernel that compiles for many minutes: a million-step loop unrolled at compile time.

Triton's front end visits the loop body once per ``tl.static_range`` step (about a
millisecond each), so any test timeout of seconds kills the compile long before it ends.
"""

import triton
import triton.language as tl

from builder.registry import ConfigDecl, KernelDecl


@triton.jit
def slow_kernel(x_ptr, STEPS: tl.constexpr):
    acc = tl.load(x_ptr)
    for i in tl.static_range(STEPS):
        acc = acc * 1.0001 + i
    tl.store(x_ptr, acc)


KERNEL = KernelDecl(
    name="slow",
    fn=slow_kernel,
    signature={"x_ptr": "*fp32", "STEPS": "constexpr"},
    configs=(ConfigDecl(constexprs={"STEPS": 1_000_000}, num_warps=1, num_stages=1),),
    grid=("1", "1", "1"),
)
