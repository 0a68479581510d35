"""The exceptions aotriton-rt raises.

Everything the package raises on purpose derives from :class:`AotritonError`, so one
``except aotriton_rt.AotritonError`` catches them all. Each message names what failed,
the offending value, and the fix.
"""

from __future__ import annotations


class AotritonError(Exception):
    """Base class of every error raised by aotriton-rt."""


class DriverError(AotritonError):
    """A GPU driver call failed (CUDA driver API or HIP runtime).

    Attributes: ``call`` (the driver function), ``code`` (its status), ``name`` and
    ``explanation`` (the driver's own strings, when it can give them).
    """

    def __init__(self, message: str, *, call: str = "", code: int = 0, name: str = "",
                 explanation: str = "") -> None:
        super().__init__(message)
        self.call = call
        self.code = code
        self.name = name
        self.explanation = explanation


class LibraryNotFound(DriverError):
    """The driver's shared library (libcuda, libamdhip64) could not be loaded."""


class NoDevice(DriverError):
    """No GPU of the required backend is visible."""


class CatalogError(AotritonError):
    """A catalog is malformed, of an unknown schema, or inconsistent with its images."""


class ImageError(AotritonError):
    """An image file is missing, corrupt, or fails its digest check."""


class ImageMismatch(ImageError):
    """A file of an image folder is not what its catalog says.

    ``problem`` says how, for callers that report it their own way: ``"missing"``,
    ``"unreadable"``, ``"not regular"``, ``"size"``, ``"sha256"``, ``"decompress"``,
    ``"raw_size"`` or ``"raw_sha256"``; ``detail`` is the OS's reason or the size found.
    """

    def __init__(self, message: str, *, path: object, problem: str, detail: object = None) -> None:
        super().__init__(message)
        self.path, self.problem, self.detail = path, problem, detail


class ImageFolderNotFound(ImageError):
    """No image folder could be found along the documented search order."""


class KernelNotFound(AotritonError):
    """No catalog variant matches the requested kernel, specialization and device."""


class LaunchError(AotritonError):
    """A launch was refused before reaching the driver (bad argument, wrong device)."""


class ArgumentError(LaunchError, TypeError):
    """An argument has the wrong type, range, alignment or device."""


class FaultError(LaunchError):
    """A kernel met indices outside its arrays (it stayed in bounds and flagged them): the call's
    results for the faulting inputs are NaN. ``bits`` holds the flag's fault bits."""

    def __init__(self, message: str, bits: int = 0) -> None:
        super().__init__(message)
        self.bits = bits


class UnsupportedError(AotritonError, NotImplementedError):
    """An operator was asked for a combination of features it does not support."""


class DownloadError(AotritonError):
    """Fetching an image bundle failed (network, HTTP status, digest)."""


class BundleError(AotritonError):
    """A bundle or bundle index is malformed, hostile, or of an unknown schema."""


#: How much of a value an error message quotes (:func:`shown`).
SHOWN_CHARS = 200


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """A value as an error message quotes it: its ``repr`` (so one line, control characters
    escaped), cut to ``limit`` characters with the full length said when it was longer."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, (str, bytes)):  # keep the closing quote, and say how long it was
        return f"{text[:limit]}...{text[-1]} ({len(value)} characters)"
    return text[:limit] + "..."
