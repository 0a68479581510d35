"""A call's signature: the key of its attention plan.

:func:`_sig` reads, for one array argument, what decides a launch except its address: shape,
strides, dtype, device and whether the address is 16-byte aligned (exact torch tensors through
``shape``/``stride()``/``dtype``/``get_device()``/``data_ptr()``, anything else through
:func:`aotriton_rt.interop.describe`); :func:`_typed` keeps an option's type in the key, so that
``causal=1`` never finds the plan of ``causal=True``. :mod:`.plan` (forward) and
:mod:`.backward_plan` build the key from these and keep the plans in the library's
:class:`PlanCache` (one per library, on its :class:`~.dispatch.LibraryKernels`).
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any

from . import problem as _problem

# ---------------------------------------------------------------------------------------------
# Signatures.
# ---------------------------------------------------------------------------------------------

class _NoTensor:
    pass


_tensor: type = _NoTensor  # torch.Tensor once torch is imported (never imported from here)


def _torch_tensor_type() -> type:
    global _tensor
    torch = sys.modules.get("torch")
    if torch is not None:
        _tensor = torch.Tensor
    return _tensor


def _sig(obj: Any, name: str) -> tuple[Any, int]:
    """(signature, address) of one array argument."""
    if type(obj) is _tensor:
        dev = obj.get_device()
        if dev >= 0 and obj.is_cuda:  # other device types (xpu, mps...) are described, and refused
            ptr = obj.data_ptr()
            return (obj.shape, obj.stride(), obj.dtype, dev, not ptr & 15), ptr
    return _described_sig(obj, name)


def _described_sig(obj: Any, name: str) -> tuple[Any, int]:
    if obj is None:
        return None, 0
    if _tensor is _NoTensor and _torch_tensor_type() is type(obj):
        return _sig(obj, name)
    info = _problem._describe(obj, name)
    return (type(obj), info.shape, info.strides, info.dtype, info.device, info.framework, info.readonly,
            not info.ptr & 15), info.ptr


_NO_LENGTHS = ("no max_seqlen",)


def _typed(value: Any) -> tuple:
    # True == 1 == 1.0 hash alike; the type keeps options that validation tells apart apart.
    if type(value) in (tuple, list):
        return (type(value), *(_typed(v) for v in value))
    return (type(value), value)


# ---------------------------------------------------------------------------------------------
# The plans of one library, by signature.
# ---------------------------------------------------------------------------------------------

#: Plans kept per library; the least recently used goes first.
PLAN_CACHE_SIZE = 1024


class PlanCache:
    """A bounded, thread-safe LRU of plans by call signature.

    Lookups take no lock (``OrderedDict`` operations are atomic under the GIL); inserts and
    evictions do. ``builds`` counts the plans made since the last :meth:`clear`, for tests and
    benchmarks.
    """

    def __init__(self, capacity: int = PLAN_CACHE_SIZE) -> None:
        self.capacity = capacity
        self.builds = 0
        self._plans: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key: tuple) -> Any:
        plan = self._plans.get(key)
        if plan is not None:
            try:
                self._plans.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile
                pass
        return plan

    def put(self, key: tuple, plan: Any) -> None:
        with self._lock:
            self.builds += 1
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)

    def clear(self) -> None:
        """Forget every plan (and reset ``builds``)."""
        with self._lock:
            self._plans.clear()
            self.builds = 0
