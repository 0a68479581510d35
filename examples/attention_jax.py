"""Attention on JAX arrays: a ``jax.custom_vjp`` through DLPack, forward and backward checked.

JAX arrays are immutable, so the operator cannot write into them: it reads the inputs in place
through DLPack and allocates its outputs with torch (CuPy when torch is absent).
``jax.dlpack.from_dlpack`` wraps those buffers back into JAX without a copy. The forward saves
``out`` and ``lse`` for the backward, as the kernels' contract asks.

This runs eagerly: a traced (``jax.jit``) function has no buffers to hand over.

Needs a CUDA GPU, jax[cuda12], torch, and the default images (AOTRITON_RT_IMAGES):
    python examples/attention_jax.py
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch's allocator

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import aotriton_rt  # noqa: E402


def to_jax(t: torch.Tensor) -> jax.Array:
    # JAX reads on its own stream: finish the producing torch stream first (portable across
    # JAX versions, whatever they do with the DLPack stream argument).
    torch.cuda.current_stream().synchronize()
    return jax.dlpack.from_dlpack(t)


@jax.custom_vjp
def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    out, _ = aotriton_rt.attention(q, k, v, causal=True)  # torch tensors back (q, k, v are read in place)
    return to_jax(out)


def attention_fwd(q, k, v):
    out, lse = aotriton_rt.attention(q, k, v, causal=True)
    out, lse = to_jax(out), to_jax(lse)
    return out, (q, k, v, out, lse)


def attention_bwd(residuals, dout):
    q, k, v, out, lse = residuals
    dq, dk, dv, _ = aotriton_rt.attention_backward(dout, q, k, v, out, lse, causal=True)
    return to_jax(dq), to_jax(dk), to_jax(dv)


attention.defvjp(attention_fwd, attention_bwd)


def reference(q, k, v):
    """Causal softmax attention in fp32 with jnp."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    n = q.shape[2]
    s = jnp.where(jnp.tril(jnp.ones((n, n), dtype=bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


B, H, S, D = 2, 8, 331, 64
keys = jax.random.split(jax.random.PRNGKey(0), 4)
q, k, v, dout = (jax.random.normal(key, (B, H, S, D), dtype=jnp.float16) for key in keys)

out, pullback = jax.vjp(attention, q, k, v)
grads = pullback(dout)
ref_out, ref_pullback = jax.vjp(reference, q, k, v)
ref_grads = ref_pullback(dout.astype(jnp.float32))

errors = {"out": out.astype(jnp.float32) - ref_out}
errors.update({name: g.astype(jnp.float32) - r for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
scale = {"out": ref_out, "dq": ref_grads[0], "dk": ref_grads[1], "dv": ref_grads[2]}
relative = {name: float(jnp.abs(e).max() / jnp.abs(scale[name]).max()) for name, e in errors.items()}
print("max error vs fp32 jnp (relative to max |ref|): " + ", ".join(f"{n} {e:.2e}" for n, e in relative.items()))
assert max(relative.values()) < 5e-3, f"jax: attention differs from the reference: {relative}"
print(f"jax: attention forward and backward match the reference on {jax.devices()[0]}")
