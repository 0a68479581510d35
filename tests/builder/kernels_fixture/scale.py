"""A kernel that compiles everywhere: out = x * alpha, with a layout that needs padding.

``n`` (i32) sits between two pointers and ``alpha`` (fp32) ends the list, so both the
declared arguments and the hidden scratch pointers need padding: a wrong layout shows.
"""

import triton
import triton.language as tl

from builder.registry import ConfigDecl, KernelDecl


@triton.jit
def scale_kernel(x_ptr, n, out_ptr, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * alpha, mask=mask)


KERNEL = KernelDecl(
    name="scale",
    fn=scale_kernel,
    signature={"x_ptr": "*{dtype}", "n": "i32", "out_ptr": "*fp32", "alpha": "fp32",
               "BLOCK": "constexpr"},
    axes={"dtype": ("fp16", "fp32")},
    configs=(ConfigDecl(constexprs={"BLOCK": 256}, num_warps=2, num_stages=1),),
    grid=("cdiv(n, BLOCK)", "1", "1"),
)
