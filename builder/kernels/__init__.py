"""Kernel declarations: one module per kernel family, each with KERNEL or KERNELS."""
