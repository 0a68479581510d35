"""The decode kernels' fault flag: one int32 per (library, framework, device), only ever ORed.

The kernels never read or write outside their arrays, whatever the lengths and block table say
(builder/kernels/decode.py clamps them); a kernel that had to clamp ORs a bit into the flag and
writes NaN for that sequence. :func:`read_faults` reads (and by default clears) it; a call with
``check=True`` reads it after its launches and raises :class:`~aotriton_rt.FaultError`.

Kernels on any stream only OR bits into the flag, so sharing one per device is safe; reading and
clearing are host operations ordered on the current stream (synchronise other streams first), and
a fault ORed between a read and its clear is lost.
"""

from __future__ import annotations

import sys
from typing import Any

from ...errors import FaultError

# Mirrors builder/kernels/decode.py (a test keeps them equal).
#: ``cache_seqlens[b] < 0``, ``cache_seqlens[b] + Sn`` past the capacity, or ``cache_leftpad[b]``
#: outside ``[0, capacity]``.
FAULT_LENGTH = 1
#: A block-table entry the sequence's rows reference outside ``[0, num_pages)``.
FAULT_PAGE = 2
_WHAT = {FAULT_LENGTH: "cache_seqlens[b] + appended rows outside [0, capacity] (the cache's length, or "
                       "block_table.shape[1] * page_size), or a cache_leftpad start outside it",
         FAULT_PAGE: "a referenced block_table entry outside [0, num_pages)"}


def describe_faults(bits: int) -> str:
    """The faults of a flag value, in words ("none" for 0)."""
    return "; ".join(text for bit, text in _WHAT.items() if bits & bit) or "none"


def shared_zeros(table: dict, key: tuple, xp: Any, like: Any, size: int) -> tuple[Any, bool]:
    """``(array, kept)``: the int32 zeros array of ``size`` that ``table`` (a library's, which owns
    it) keeps under ``key``, made on first use and shared with calls on every stream once its zero
    fill has run (``kept`` True); or, made while a CUDA graph is being captured (its memory the
    graph's pool, its fill a node), one that serves that call only (``kept`` False)."""
    return _shared(table, key, xp, like, lambda: xp.zeros((size,), "i32", like))


def shared_ones(table: dict, key: tuple, xp: Any, like: Any) -> tuple[Any, bool]:
    """``(array, kept)``: an fp32 array holding 1.0, kept as :func:`shared_zeros` keeps zeros."""
    return _shared(table, key, xp, like, lambda: xp.full((1,), 1.0, "fp32", like))


def _shared(table: dict, key: tuple, xp: Any, like: Any, make: Any) -> tuple[Any, bool]:
    found = table.get(key)
    if found is not None:
        return found, True
    made = make()
    if not xp.settle_for_sharing(like):
        return made, False
    return table.setdefault(key, made), True  # one atomic step: the first array made wins


def fault_flag(ks: Any, xp: Any, like: Any, device: int) -> tuple[Any, bool]:
    """The flag of ``ks`` (a library's decode kernels) for ``like``'s framework and device
    (:func:`shared_zeros`)."""
    return shared_zeros(ks.faults, (xp.framework, device), xp, like, 1)


def fault_flags(library: Any) -> dict[tuple[str, int], Any]:
    """The fault flags of ``library`` (default: the default library) by (framework, device)."""
    from ...library import default_library, operator_state

    return operator_state(library if library is not None else default_library(), "decode.faults",
                          lambda lib: {})


def read_faults(device: int | None = None, *, library: Any = None, clear: bool = True) -> int:
    """The decode fault bits (:data:`FAULT_LENGTH`, :data:`FAULT_PAGE`) ORed by the calls made
    through ``library`` (default: the default library) on ``device`` (None: every device) since
    the flag was last cleared; 0 when none. Synchronises with the current stream. ``clear``: zero
    the flag after reading it."""
    bits = 0
    for (framework, dev), flag in list(fault_flags(library).items()):
        if device is not None and dev != device:
            continue
        bits |= int(_host_value(framework, flag))
        if clear:
            if framework == "torch":
                flag.zero_()
            else:
                flag.fill(0)
    return bits


def clear_faults(device: int | None = None, *, library: Any = None) -> None:
    """Zero the decode fault flag(s) of ``library`` on ``device`` (None: every device)."""
    read_faults(device, library=library, clear=True)


def raise_faults(ks: Any, device: int) -> None:
    """``check=True`` after its launches: raise :class:`FaultError` when the flag of ``device`` is
    set (by this call, or by an unchecked one since the flag was last read), clearing it."""
    bits = read_faults(device, library=ks.lib)
    if bits:
        raise FaultError(f"decode kernels on device {device} met {describe_faults(bits)} (fault bits {bits}); they "
                         f"stayed in bounds and wrote NaN for the faulting sequences. The flag covers every decode "
                         f"call since it was last read, unchecked ones too; it is now cleared", bits)


def _host_value(framework: str, flag: Any) -> int:
    if framework == "torch":
        return int(flag.item())
    return int(sys.modules["cupy"].asnumpy(flag)[0])
