"""The eager operators called on JAX tracers (inside ``jax.jit``) say to use ``aotriton_rt.jax``
(issue 25, finding 12): the arrays have no data yet, so there is nothing to launch on."""

from __future__ import annotations

import pytest

import aotriton_rt
from aotriton_rt.errors import ArgumentError

jax = pytest.importorskip("jax")
jnp = jax.numpy

CASES = {
    "attention": (lambda q: aotriton_rt.attention(q, q, q, causal=True)[0],
                  r"^aotriton_rt\.attention was called on a JAX tracer \(q, inside jax\.jit, grad or vmap\), "
                  r"which holds no data to launch on; use aotriton_rt\.jax\.attention there \(docs/jax\.md\)(\n|$)"),
    "attention_backward": (lambda q: aotriton_rt.attention_backward(q, q, q, q, q, q[..., 0].astype("float32"))[0],
                           r"^aotriton_rt\.attention_backward was called on a JAX tracer \(dout, inside jax\.jit, "
                           r".*; use jax\.grad of aotriton_rt\.jax\.attention there \(docs/jax\.md\)(\n|$)"),
    "decode_attention": (lambda q: aotriton_rt.decode_attention(q, q, q)[0],
                         r"^aotriton_rt\.decode_attention was called on a JAX tracer \(q, inside jax\.jit, .*; "
                         r"it has no JAX version: call it outside jax\.jit, on concrete arrays"),
}


@pytest.mark.parametrize("op", sorted(CASES))
def test_an_eager_operator_under_jax_jit_says_to_use_the_jax_module(op):
    fn, message = CASES[op]
    q = jnp.zeros((1, 2, 16, 64), jnp.float16)
    with pytest.raises(ArgumentError, match=message):
        jax.jit(fn)(q)
