"""CPU torch tensors taken as device arrays: the operators' tests run their real code on CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def cpu_describer(fallback: Callable[[Any, str], Any],
                  device_of: Callable[[int], int] = lambda ptr: 0) -> Callable[[Any, str], Any]:
    """A ``describe(obj, name)`` for an operator's module: a CPU torch tensor becomes an
    :class:`aotriton_rt.interop.ArrayInfo` on device ``device_of(data_ptr)`` (default 0), anything
    else goes to ``fallback`` (the module's own describe)."""
    import torch

    from aotriton_rt import interop

    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
             torch.int64: "i64", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e4m3fnuz: "fp8e4b8"}

    def describe(obj: Any, name: str) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            return interop.ArrayInfo(obj.data_ptr(), device_of(obj.data_ptr()), names[obj.dtype], tuple(obj.shape),
                                     tuple(obj.stride()), "torch")
        return fallback(obj, name)

    return describe
