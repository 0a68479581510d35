"""A call's signature: the key of its attention plan.

:func:`_sig` reads, for one array argument, what decides a launch except its address: shape,
strides, dtype, device and whether the address is 16-byte aligned (exact torch tensors through
``shape``/``stride()``/``dtype``/``get_device()``/``data_ptr()``, anything else through
:func:`aotriton_rt.interop.describe`); :func:`_typed` keeps an option's type in the key, so that
``causal=1`` never finds the plan of ``causal=True``. :mod:`.plan` builds the key from these and
keeps the plans in the library's :class:`~.dispatch.PlanCache`.
"""

from __future__ import annotations

import sys
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
