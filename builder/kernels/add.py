"""Elementwise add: out = x + y over n elements, any float dtype."""

import triton
import triton.language as tl

from builder.registry import ConfigDecl, KernelDecl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # 64-bit offsets: n may exceed 2**31 elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


KERNEL = KernelDecl(
    name="add",
    fn=add_kernel,
    signature={"x_ptr": "*{dtype}", "y_ptr": "*{dtype}", "out_ptr": "*{dtype}", "n": "i64",
               "BLOCK": "constexpr"},
    axes={"dtype": ("fp16", "bf16", "fp32")},
    configs=(ConfigDecl(constexprs={"BLOCK": 1024}, num_warps=4, num_stages=1),),
    grid=("cdiv(n, BLOCK)", "1", "1"),
    sets={"default": lambda spec, target: True},
)
