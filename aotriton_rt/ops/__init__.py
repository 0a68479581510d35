"""Operators built on the catalog's kernels.

``aotriton_rt.ops.attention`` is framework-agnostic (any CUDA array, through
:mod:`aotriton_rt.interop`); ``aotriton_rt.ops.torch`` adds autograd and a ``torch.library``
custom op (importing it imports torch and registers the op). The functions are re-exported as
``aotriton_rt.attention`` and ``aotriton_rt.attention_backward``; this package itself exports
nothing, so that ``aotriton_rt.ops.attention`` always names the module.
"""
