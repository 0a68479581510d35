"""LayerNorm and RMSNorm forward over the last dimension, one row per program.

Also writes the per-row mean (LayerNorm) and reciprocal standard deviation in fp32, which a
backward pass needs.
"""

import triton
import triton.language as tl

from builder.registry import ConfigDecl, KernelDecl


@triton.jit
def norm_fwd_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_rows, n_cols,
                    x_row_stride, y_row_stride, eps, BLOCK: tl.constexpr, IS_RMS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / n_cols
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    var = tl.sum(xc * xc, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(rstd_ptr + row, rstd)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if not IS_RMS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _norm(name: str, is_rms: int) -> KernelDecl:
    return KernelDecl(
        name=name,
        fn=norm_fwd_kernel,
        signature={"x_ptr": "*{dtype}", "y_ptr": "*{dtype}", "w_ptr": "*{dtype}",
                   "b_ptr": "*{dtype}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
                   "n_rows": "i32", "n_cols": "i32", "x_row_stride": "i64",
                   "y_row_stride": "i64", "eps": "fp32", "BLOCK": "constexpr",
                   "IS_RMS": "constexpr"},
        axes={"dtype": ("fp16", "bf16", "fp32"), "BLOCK": (256, 1024, 4096, 16384),
              "IS_RMS": (is_rms,)},
        configs=lambda spec, target: (ConfigDecl(num_warps=4 if spec["BLOCK"] <= 1024 else 8,
                                             num_stages=1),),
        grid=("n_rows", "1", "1"),
        checks=("n_cols <= BLOCK", "n_cols >= 1"),
        sets={"default": lambda spec, target: spec["BLOCK"] in (1024, 4096) and spec["dtype"] != "bf16"},
    )


KERNELS = [_norm("layernorm", 0), _norm("rmsnorm", 1)]
