"""Attention in a jitted JAX program: ``jax.jit(jax.grad(...))`` through aotriton_rt.jax, checked.

``aotriton_rt.jax.attention`` lowers the catalog's kernels to jaxlib's Triton custom call, so the
forward and backward run inside the XLA program (no DLPack round trip, no host sync). Its
gradients are compared with ``jax.nn.dot_product_attention`` and with an fp32 reference.

Needs a CUDA GPU, jax[cuda13] (or cuda12), and images built by this version's builder (they
carry the PTX jaxlib assembles), e.g. AOTRITON_RT_IMAGES=.gpu-images:
    python examples/attention_jax.py
"""

import jax
import jax.numpy as jnp

import aotriton_rt.jax as aj

B, S, H, D = 2, 1000, 8, 64
keys = jax.random.split(jax.random.PRNGKey(0), 4)
q, k, v, w = (jax.random.normal(key, (B, S, H, D), dtype=jnp.bfloat16) for key in keys)


def loss(attend, q, k, v):
    return (attend(q, k, v).astype(jnp.float32) * w.astype(jnp.float32)).sum()


def ours(q, k, v):
    return aj.attention(q, k, v, causal=True, layout="bshd")


def cudnn_or_xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def reference(q, k, v):
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf) / jnp.sqrt(D)
    s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vf)


grad = jax.jit(jax.grad(lambda q, k, v: loss(ours, q, k, v), argnums=(0, 1, 2)))
got = grad(q, k, v)
theirs = jax.jit(jax.grad(lambda q, k, v: loss(cudnn_or_xla, q, k, v), argnums=(0, 1, 2)))(q, k, v)
want = jax.grad(lambda q, k, v: loss(reference, q, k, v), argnums=(0, 1, 2))(q, k, v)


def rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


for name, g, t, r in zip(("dq", "dk", "dv"), got, theirs, want):
    print(f"{name}: vs fp32 reference {rel(g, r):.2e}, jax.nn.dot_product_attention vs the same {rel(t, r):.2e}")
    assert rel(g, r) < 2e-2, f"jax: {name} differs from the reference"
print(f"jax: jit(grad(attention)) matches the reference on {jax.devices()[0]}")
