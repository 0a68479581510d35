"""A kernel whose declaration is fine but whose compile always fails (a static assertion)."""

import triton
import triton.language as tl

from builder.registry import ConfigDecl, KernelDecl


@triton.jit
def broken_kernel(x_ptr, n, BLOCK: tl.constexpr):
    tl.static_assert(BLOCK % 3 == 0, "BLOCK must be a multiple of 3")
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, 1.0, mask=offs < n)


KERNEL = KernelDecl(
    name="broken",
    fn=broken_kernel,
    signature={"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
    configs=(ConfigDecl(constexprs={"BLOCK": 64}, num_warps=1, num_stages=1),),
    grid=("1", "1", "1"),
)
