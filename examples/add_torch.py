"""The catalog's `add` kernel on PyTorch tensors (current torch stream), checked against torch."""

import torch

import aotriton_rt

n = 1_000_003  # not a multiple of the block size
x = torch.randn(n, device="cuda")
y = torch.randn(n, device="cuda")
out = torch.empty_like(x)

add = aotriton_rt.kernel("add", dtype="fp32")
add(x, y, out, n)  # grid from the catalog's rule: cdiv(n, BLOCK)
torch.cuda.synchronize()
torch.testing.assert_close(out, x + y)
print(f"torch: add of {n} floats matches ({add.variant(x.device.index).target.arch})")
