"""Device facts → catalog target names, and which built targets a device can run."""

from __future__ import annotations

import re
from typing import Any

from .errors import KernelNotFound


def normalize(backend: str, raw: str) -> str:
    """The catalog arch for a device's raw arch string.

    ``"gfx942:sramecc+:xnack-"`` → ``"gfx942"``; ``"sm_90"``, ``"sm90a"`` or ``"9.0"`` → ``"sm90"``.
    """
    raw = raw.strip().lower()
    if backend == "hip":
        return raw.split(":", 1)[0]
    m = re.fullmatch(r"(?:sm_?)?(\d+)(?:\.(\d+))?a?", raw)
    if not m:
        raise ValueError(f"not a CUDA arch: {raw!r}")
    return f"sm{m.group(1)}{m.group(2)}" if m.group(2) is not None else f"sm{m.group(1)}"


def compatible(backend: str, device_arch: str) -> list[str]:
    """Catalog archs whose binaries run on ``device_arch``, best first.

    A cubin runs on its own major version at the same or a newer minor (sm80 runs on sm86 and
    sm89, not on sm90: sm90 code is sm_90a and runs only there). HSACO code objects are built
    per gfx target and must match exactly.
    """
    if backend == "hip":
        return [device_arch]
    m = re.fullmatch(r"sm(\d+?)(\d)", device_arch)
    if not m:
        return [device_arch]
    major, minor = m.group(1), int(m.group(2))
    if device_arch == "sm90" or int(major) >= 10:
        return [device_arch]
    return [f"sm{major}{n}" for n in range(minor, -1, -1)]


def pick_target(backend: str, device_arch: str, built: list[str]) -> str:
    """The best built arch for a device, or KernelNotFound listing the built ones."""
    for arch in compatible(backend, device_arch):
        if arch in built:
            return arch
    have = ", ".join(sorted(built)) or "none"
    raise KernelNotFound(
        f"no image for {device_arch}; built archs: {have} — build it with "
        f"`python -m builder build --targets {device_arch} --add` (keeps the images already there) or "
        f"download it with "
        f"`python -m aotriton_rt download --arch {device_arch}`")


def target_arch(lib: Any, device: int) -> str:
    """The built arch whose images run on ``device`` of library ``lib`` (from the catalog indexes:
    no shard is read)."""
    built = lib.targets()
    if len(built) == 1:
        # Images of one arch: the device must run that arch, or the launch will say why.
        return built[0][1]
    driver = lib.driver
    raw = normalize(driver.backend, driver.device_arch(max(device, 0)))
    return pick_target(driver.backend, raw, sorted(a for b, a in built if b == driver.backend))


def detect_targets() -> list[str]:
    """Catalog archs of every visible GPU (CUDA first, then HIP); [] when there is none."""
    from .drivers import available_drivers

    found = []
    for driver in available_drivers():
        for d in range(driver.device_count()):
            arch = normalize(driver.backend, driver.device_arch(d))
            if arch not in found:
                found.append(arch)
    return found
