"""aotriton-rt: prebuilt Triton kernels, launched from Python without Triton."""

__version__ = "0.1.0"
