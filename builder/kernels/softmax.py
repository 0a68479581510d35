"""Row softmax: each program normalises one row of a 2-D array (rows may be strided)."""

import triton
import triton.language as tl

from builder.registry import ConfigDecl, KernelDecl


@triton.jit
def softmax_kernel(out_ptr, in_ptr, n_rows, n_cols, in_row_stride, out_row_stride,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    y = e / tl.sum(e, axis=0)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


KERNEL = KernelDecl(
    name="softmax",
    fn=softmax_kernel,
    signature={"out_ptr": "*{dtype}", "in_ptr": "*{dtype}", "n_rows": "i32", "n_cols": "i32",
               "in_row_stride": "i64", "out_row_stride": "i64", "BLOCK": "constexpr"},
    axes={"dtype": ("fp16", "bf16", "fp32"), "BLOCK": (256, 1024, 4096, 16384)},
    configs=lambda spec, target: (ConfigDecl(num_warps=_warps(spec["BLOCK"]), num_stages=1),),
    grid=("n_rows", "1", "1"),
    checks=("n_cols <= BLOCK", "n_cols >= 1"),
    sets={"default": lambda spec, target: spec["BLOCK"] in (256, 1024)},
)
