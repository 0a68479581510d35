"""Kernel declarations (``KernelDecl``): one module per kernel family, each with KERNEL or KERNELS."""
