"""The catalog's `add` kernel on CuPy arrays (through __cuda_array_interface__), checked."""

import cupy as cp

import aotriton_rt

n = 1_000_003
x = cp.random.standard_normal(n, dtype=cp.float32)
y = cp.random.standard_normal(n, dtype=cp.float32)
out = cp.empty_like(x)

aotriton_rt.kernel("add", dtype="fp32")(x, y, out, n)  # launches on CuPy's current stream
cp.cuda.get_current_stream().synchronize()
assert cp.allclose(out, x + y), "cupy: add mismatch"
print(f"cupy: add of {n} floats matches")
