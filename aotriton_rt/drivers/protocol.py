"""What every driver is and builds on: the protocol, the one error, the function table.

The backends (``drivers.cuda``, ``drivers.hip``) import this module, never the package, so the
package may choose among them without a circle.
"""

from __future__ import annotations

import re
import struct as _struct
from typing import Any, Protocol

from aotriton_rt.errors import DriverError, NoDevice

_ARCH_HINT = ("image built for another arch: compare the catalog target with "
              "device_arch() and load the image of this device's arch")

#: Hints for the status codes that CUDA_ERROR_* and hipError_t number alike.
COMMON_HINTS = {
    2: "the GPU is out of memory: free tensors (e.g. torch.cuda.empty_cache()) or shrink "
       "the problem",
    100: "no GPU is visible to this process",
    101: "the device index is out of range: see device_count()",
    200: _ARCH_HINT,
    201: "make a context current: e.g. import torch and touch the device "
         "(torch.zeros(1, device='cuda'))",
    209: _ARCH_HINT,
    218: _ARCH_HINT,
    400: "a handle belongs to another device or context: make the kernel's device current "
         "(e.g. `with torch.cuda.device(i):`)",
    500: "the image has no kernel of that name: the catalog's symbol does not match the image",
    700: "a kernel accessed memory it does not own and the context is now unusable: check "
         "pointer arguments, sizes and strides",
    701: "the kernel needs more registers, threads or shared memory than the device offers: "
         "use another config",
    720: "a cooperative grid must fit on the device at once: use fewer blocks",
    900: "this call is not allowed while the stream is captured into a graph",
}


class Launcher(Protocol):
    """Issues one launch of one function; thread-safe; owns its argument buffer."""

    def __call__(self, gx: int, gy: int, gz: int, stream: int, values: tuple) -> None:
        """Pack ``values`` with the launcher's struct and launch a (gx, gy, gz) grid.

        ``stream`` is the raw stream handle (0: the legacy default stream). An empty grid
        (any dimension 0) launches nothing. Raises ``DriverError`` when the driver refuses.
        """
        ...


class Driver(Protocol):
    """One GPU backend. Device indices are the framework's (0-based, after *_VISIBLE_DEVICES);
    module and function handles are plain ints."""

    backend: str

    def device_count(self) -> int: ...
    def current_device(self) -> int: ...
    def device_arch(self, device: int) -> str: ...
    def device_name(self, device: int) -> str: ...
    def load_module(self, device: int, image: bytes) -> int: ...
    def get_function(self, device: int, module: int, symbol: str) -> int: ...
    def prepare_function(self, function: int, shared: int) -> None: ...
    def make_launcher(self, function: int, *, struct: _struct.Struct, num_threads: int,
                      shared: int, cooperative: bool = False, pdl: bool = False,
                      cluster_dims: tuple[int, int, int] = (1, 1, 1)) -> Launcher: ...
    def alloc(self, device: int, nbytes: int) -> int: ...
    def is_capturing(self, stream: int) -> bool: ...
    def synchronize(self, device: int) -> None: ...
    # Global scratch per stream and per captured graph (aotriton_rt.scratch).
    def capture_probe(self) -> Any: ...
    def capture_info(self, device: int, stream: int) -> tuple[int, int, int]: ...
    def event_recorder(self) -> Any: ...
    def event_create(self, device: int) -> int: ...
    def event_record(self, device: int, event: int, stream: int) -> None: ...
    def stream_wait_event(self, device: int, stream: int, event: int) -> None: ...
    def free(self, device: int, ptr: int, event: int = 0) -> None: ...
    def alloc_relaxed(self, device: int, nbytes: int) -> int: ...
    def retain_in_graph(self, graph: int, data: int, destroy: Any) -> bool: ...


def driver_error(*, call: str, code: int, name: str, explanation: str,
                 hint: str) -> DriverError:
    """The one error every failing driver call turns into (``NoDevice`` for code 100).

    The message reads ``cuModuleLoadData failed: CUDA_ERROR_NO_BINARY_FOR_GPU (209): no
    kernel image is available for execution on the device. Hint: ...``.
    """
    text = f"{call} failed: {name or 'unknown error'} ({code})"
    if explanation:
        text += f": {explanation}"
    text += "."
    if hint:
        text += f" Hint: {hint}."
    # 100 is "no device" in both CUDA_ERROR_* and hipError_t numbering.
    cls = NoDevice if code == 100 else DriverError
    return cls(text, call=call, code=code, name=name, explanation=explanation)


class FunctionTable:
    """The device and kernel name behind each function handle a driver gave out, for
    shared-memory opt-ins, launchers and error messages (both drivers keep one)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[int, str]] = {}

    def add(self, function: int, device: int, symbol: str) -> None:
        self._entries[function] = (device, symbol)

    def device(self, function: int, default: int | None = None) -> int | None:
        """The device ``function`` was loaded on, else ``default`` (a handle from elsewhere)."""
        entry = self._entries.get(function)
        return default if entry is None else entry[0]

    def symbol(self, function: int) -> str:
        """The kernel's name, else the handle in hex."""
        entry = self._entries.get(function)
        return hex(function) if entry is None else entry[1]


_FORMAT_ITEM = re.compile(r"\s*(\d*)([xcbB?hHiIlLqQnNefdspP])")


def struct_field_offsets(layout: _struct.Struct) -> list[int]:
    """Byte offset of every non-padding item of ``layout``, in order.

    Launch paths that take ``kernelParams`` (an array of pointers, one per kernel
    parameter) point into the packed buffer at these offsets, so each non-padding item of
    the struct must be exactly one kernel parameter. ``"<QiQ"`` -> ``[0, 8, 12]``;
    ``"<Qi4xQ"`` -> ``[0, 8, 16]``.
    """
    fmt = layout.format
    prefix = fmt[0] if fmt and fmt[0] in "@=<>!" else ""
    body = fmt[len(prefix):]
    offsets: list[int] = []
    seen = prefix
    pos = 0
    while pos < len(body):
        match = _FORMAT_ITEM.match(body, pos)
        if match is None:
            if body[pos:].strip():
                raise ValueError(f"cannot read struct format {fmt!r} at {body[pos:]!r}")
            break
        count, code = match.groups()
        n = int(count) if count else 1
        if code == "x":
            seen += match.group(0).strip()
        elif code in "sp":  # one item of n bytes
            offsets.append(_struct.calcsize(seen + f"{n}{code}") - n)
            seen += f"{n}{code}"
        else:
            for _ in range(n):
                # calcsize(prefix + item) - size(item) is the item's aligned start.
                offsets.append(_struct.calcsize(seen + code) - _struct.calcsize(prefix + code))
                seen += code
        pos = match.end()
    return offsets
