"""The catalog's `add` kernel on JAX arrays through DLPack, checked.

JAX arrays are immutable, so the output is a buffer we own: here a CuPy array wrapped back
into JAX with `jax.dlpack.from_dlpack` (zero copy). Any DLPack producer works as an input.
"""

import cupy as cp
import jax
import jax.numpy as jnp

import aotriton_rt

n = 1_000_003
kx, ky = jax.random.split(jax.random.PRNGKey(0))
x = jax.random.normal(kx, (n,), dtype=jnp.float32)
y = jax.random.normal(ky, (n,), dtype=jnp.float32)
out = cp.empty(n, dtype=cp.float32)

aotriton_rt.kernel("add", dtype="fp32")(x, y, out, n)
cp.cuda.get_current_stream().synchronize()
result = jax.dlpack.from_dlpack(out)
assert jnp.allclose(result, x + y), "jax: add mismatch"
print(f"jax: add of {n} floats matches")
