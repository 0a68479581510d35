"""aotriton-rt: prebuilt Triton kernels, launched from Python without Triton.

Importing this package is free: it loads no driver library, probes no device and imports no
framework (torch, CuPy, JAX) until first use.

    import aotriton_rt
    add = aotriton_rt.kernel("add", dtype="fp32")
    add(x, y, out, x.numel())
"""

from __future__ import annotations

from typing import Any

from .errors import (
    AotritonError,
    ArgumentError,
    BundleError,
    CatalogError,
    DownloadError,
    DriverError,
    FaultError,
    ImageError,
    ImageFolderNotFound,
    KernelNotFound,
    LaunchError,
    LibraryNotFound,
    NoDevice,
    UnsupportedError,
)

__version__ = "0.1.0"

_LAZY = {
    "Library": ("library", "Library"),
    "Kernel": ("launch", "Kernel"),
    "kernel": ("library", "kernel"),
    "default_library": ("library", "default_library"),
    "Catalog": ("catalog", "Catalog"),
    "attention": ("ops.attention", "attention"),
    "attention_backward": ("ops.attention", "attention_backward"),
    "decode_attention": ("ops.decode", "decode_attention"),
    "warmup": ("ops.attention.warmup", "warmup"),
}


def __getattr__(name: str) -> Any:
    # Public names resolve on first use so that `import aotriton_rt` stays cheap.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'aotriton_rt' has no attribute {name!r}")


__all__ = [
    "AotritonError", "ArgumentError", "BundleError", "CatalogError", "DownloadError", "DriverError",
    "FaultError", "ImageError", "ImageFolderNotFound", "KernelNotFound", "LaunchError", "LibraryNotFound",
    "NoDevice", "UnsupportedError", *_LAZY,
]
