"""Gluon operations whose names differ between the Triton releases the builder compiles with.

The kernels call the names defined here, each whichever spelling this Triton has, so one kernel
source compiles under every release the builder supports (the Gluon frontend resolves a global
that names a builtin like the builtin itself):

- :data:`tma_load`: Hopper's TMA load, ``tma.async_copy_global_to_shared`` in Triton 3.6,
  ``tma.async_load`` later (the old name then raises);
- :func:`reinterpret`: a shared-memory descriptor's ``_reinterpret`` in 3.6, ``reinterpret`` later;
- :data:`tma_reduce_add`: a TMA reduce-add of a shared-memory tile into global memory,
  ``tma.async_atomic_add`` from Triton 3.7 on; 3.6 has the operation but no wrapper for it.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma

tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@builtin
def reinterpret(buf, dtype, shape, layout, _semantic=None):
    """The shared memory ``buf`` seen as ``dtype``, ``shape`` and ``layout`` (Triton 3.6 calls the
    method ``_reinterpret``; later releases ``reinterpret``, with the same arguments)."""
    method = buf.reinterpret if hasattr(buf, "reinterpret") else buf._reinterpret
    return method(dtype, shape, layout, _semantic=_semantic)


@builtin
def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into the global tensor at ``coord`` with one TMA
    reduce-add (``cp.reduce.async.bulk.tensor ... .add``: the L2 does the adds, elements outside
    the descriptor's shape are skipped), issued by one thread and committed as a bulk group:
    ``tma.store_wait`` waits for its read of ``src``. Triton 3.6's Gluon has the operation
    (``ttng.async_tma_reduce``) but no Python wrapper for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


tma_reduce_add = tma.async_atomic_add if hasattr(tma, "async_atomic_add") else _tma_reduce_add_36
