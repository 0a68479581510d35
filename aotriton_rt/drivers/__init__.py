"""GPU drivers behind one small protocol: ``get_driver("cuda" | "hip")``.

A driver loads images into modules, finds functions, and makes *launchers*: callables that
pack one call's argument values into a preallocated buffer and issue exactly one launch.
Importing this package (or ``drivers.cuda`` / ``drivers.hip``) opens no library and probes
no device; the driver of a backend is created on first ``get_driver`` and then shared.

Example::

    drv = get_driver("cuda")
    module = drv.load_module(0, cubin_bytes)
    fn = drv.get_function(0, module, "add_kernel")
    launch = drv.make_launcher(fn, struct=struct.Struct("<QQQiiQQ"), num_threads=128, shared=0)
    launch(blocks, 1, 1, stream, (x_ptr, y_ptr, out_ptr, n, 0, 0, 0))
"""

from __future__ import annotations

import threading

from aotriton_rt.drivers.protocol import (
    COMMON_HINTS,
    Driver,
    FunctionTable,
    Launcher,
    driver_error,
    struct_field_offsets,
)
from aotriton_rt.errors import AotritonError, NoDevice, UnsupportedError

__all__ = ["BACKENDS", "COMMON_HINTS", "Driver", "Launcher", "available_drivers", "default_driver",
           "FunctionTable", "driver_error", "get_driver", "struct_field_offsets"]

#: The backends ``get_driver`` knows.
BACKENDS = ("cuda", "hip")
_drivers: dict[str, Driver] = {}
_drivers_lock = threading.Lock()


def get_driver(backend: str) -> Driver:
    """The process-wide driver of ``backend`` ("cuda" or "hip"), created on first use.

    Creation is thread-safe and happens once; a failed creation (no library, no device) is
    not cached, so fixing the environment and calling again works.

    Raises ``UnsupportedError`` for an unknown backend, ``LibraryNotFound`` when the driver
    library cannot be found, ``DriverError`` when initialising it fails.
    """
    driver = _drivers.get(backend)
    if driver is not None:
        return driver
    if backend not in BACKENDS:
        raise UnsupportedError(f"unknown GPU backend {backend!r}; known: {', '.join(BACKENDS)}")
    with _drivers_lock:
        driver = _drivers.get(backend)
        if driver is None:
            if backend == "cuda":
                from aotriton_rt.drivers.cuda import CudaDriver
                driver = CudaDriver()
            else:
                from aotriton_rt.drivers.hip import HipDriver
                driver = HipDriver()
            _drivers[backend] = driver
    return driver


def _usable(backend: str) -> tuple[Driver | None, str]:
    """The backend's driver when it loads and sees at least one device, else why not."""
    try:
        driver = get_driver(backend)
        if driver.device_count() > 0:
            return driver, ""
        return None, "no devices"
    except AotritonError as exc:
        return None, str(exc).splitlines()[0]


def available_drivers() -> list[Driver]:
    """The drivers that load and see at least one device, CUDA first; [] when none does."""
    found = []
    for backend in BACKENDS:
        driver, _ = _usable(backend)
        if driver is not None:
            found.append(driver)
    return found


def default_driver() -> Driver:
    """The first of CUDA, then HIP, whose driver loads and sees a device.

    Raises ``NoDevice`` with each backend's reason when neither is usable.
    """
    reasons = []
    for backend in BACKENDS:
        driver, why = _usable(backend)
        if driver is not None:
            return driver
        reasons.append(f"  - {backend}: {why}")
    raise NoDevice("no GPU backend is usable:\n" + "\n".join(reasons) +
                   "\nPass backend='cuda' or 'hip' to see the full error, or set "
                   "AOTRITON_RT_CUDA_LIB / AOTRITON_RT_HIP_LIB to the driver library.")
