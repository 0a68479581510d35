"""aotriton-rt for JAX: catalog kernels and attention under ``jax.jit``, ``jax.grad`` and ``jax.vmap``.

Importing this module imports JAX (``import aotriton_rt`` alone never does). Kernels lower to
jaxlib's Triton custom call, so nothing is compiled at run time beyond what jaxlib does with
the catalog's PTX (CUDA) or HSACO (ROCm). See ``docs/jax.md``.

Example::

    import jax, aotriton_rt.jax as aj
    loss = lambda q, k, v: aj.attention(q, k, v, causal=True).astype(jax.numpy.float32).sum()
    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
"""

from __future__ import annotations

from .attention import attention, attention_backward, attention_forward, attention_fp8
from .kernels import JaxKernel, Out, Update, kernel

__all__ = ["JaxKernel", "Out", "Update", "attention", "attention_backward", "attention_forward", "attention_fp8",
           "kernel"]
