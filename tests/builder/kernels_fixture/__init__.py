"""Kernels used only by the builder's tests: one that compiles, one that cannot, one that hangs.

Select them with ``registry.load_kernels(package=PACKAGE)`` and expand with the same
``package`` so that worker processes find the declarations again.
"""

PACKAGE = __name__
