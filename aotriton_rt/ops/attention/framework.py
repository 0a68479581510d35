"""The caller's framework as the attention and decode operators use it (torch, else CuPy):
allocate outputs and scratch, convert operands, read values back.
"""

from __future__ import annotations

from typing import Any

from ... import interop
from ...errors import UnsupportedError


class TorchArrays:
    framework = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
                       "i8": torch.int8, "i32": torch.int32, "fp8e4nv": torch.float8_e4m3fn,
                       "fp8e4b8": torch.float8_e4m3fnuz}

    def convert(self, obj: Any, info: interop.ArrayInfo) -> Any:
        torch = self.torch
        if isinstance(obj, torch.Tensor):
            # The kernels are outside autograd; copies made here must not join the caller's graph.
            return obj.detach() if obj.requires_grad else obj
        if hasattr(obj, "__dlpack__"):
            return torch.from_dlpack(obj)
        return torch.as_tensor(obj, device=torch.device("cuda", max(info.device, 0)))

    def empty(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        return self.torch.empty(shape, dtype=self.dtypes[dtype], device=like.device)

    def zeros(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        return self.torch.zeros(shape, dtype=self.dtypes[dtype], device=like.device)

    def full(self, shape: tuple[int, ...], value: float, dtype: str, like: Any) -> Any:
        return self.torch.full(shape, value, dtype=self.dtypes[dtype], device=like.device)

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x.reshape(shape)

    def sum_keep(self, x: Any, dims: tuple[int, ...], dtype: str) -> Any:
        return x.sum(dim=dims, keepdim=True, dtype=self.torch.float32).to(self.dtypes[dtype])

    def contiguous(self, x: Any) -> Any:
        return x.contiguous()

    def as_fp32(self, x: Any) -> Any:
        return x.to(self.torch.float32).contiguous()

    def max_len(self, cu: Any) -> int:
        return int((cu[1:] - cu[:-1]).max().item()) if cu.shape[0] > 1 else 0

    def settle_for_sharing(self, like: Any) -> bool:
        """Whether an array just made on the current stream may be shared with calls on every
        stream: False while that stream is capturing a graph (its fill is a node of the graph,
        its memory the graph's pool); else waits until its fill has run and returns True."""
        if not like.is_cuda:
            return True
        if self.torch.cuda.is_current_stream_capturing():
            return False
        self.torch.cuda.current_stream(like.device).synchronize()
        return True


class CupyArrays:
    framework = "cupy"

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.dtypes = {"fp16": "float16", "fp32": "float32", "i8": "int8", "i32": "int32"}

    def convert(self, obj: Any, info: interop.ArrayInfo) -> Any:
        cupy = self.cupy
        if isinstance(obj, cupy.ndarray):
            return obj
        with cupy.cuda.Device(max(info.device, 0)):
            return cupy.from_dlpack(obj) if hasattr(obj, "__dlpack__") else cupy.asarray(obj)

    def _dtype(self, dtype: str) -> str:
        if dtype not in self.dtypes:
            raise UnsupportedError(f"CuPy has no {dtype} dtype; pass torch tensors for {dtype} attention")
        return self.dtypes[dtype]

    def empty(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        with like.device:
            return self.cupy.empty(shape, dtype=self._dtype(dtype))

    def zeros(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        with like.device:
            return self.cupy.zeros(shape, dtype=self._dtype(dtype))

    def full(self, shape: tuple[int, ...], value: float, dtype: str, like: Any) -> Any:
        with like.device:
            return self.cupy.full(shape, value, dtype=self._dtype(dtype))

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x.reshape(shape)

    def sum_keep(self, x: Any, dims: tuple[int, ...], dtype: str) -> Any:
        return x.sum(axis=dims, keepdims=True, dtype="float32").astype(self._dtype(dtype))

    def contiguous(self, x: Any) -> Any:
        return self.cupy.ascontiguousarray(x)

    def as_fp32(self, x: Any) -> Any:
        return self.cupy.ascontiguousarray(x, dtype="float32")

    def max_len(self, cu: Any) -> int:
        return int((cu[1:] - cu[:-1]).max()) if cu.shape[0] > 1 else 0

    def settle_for_sharing(self, like: Any) -> bool:
        """See :meth:`TorchArrays.settle_for_sharing`."""
        stream = self.cupy.cuda.get_current_stream()
        if stream.is_capturing():
            return False
        stream.synchronize()
        return True


_ARRAYS: dict[str, Any] = {}


def arrays_for(framework: str) -> Any:
    """The framework that allocates outputs: the input's for torch and CuPy, else torch, else CuPy."""
    xp = _ARRAYS.get(framework)
    if xp is not None:
        return xp
    order = [framework] if framework in ("torch", "cupy") else ["torch", "cupy"]
    for name in order:
        try:
            xp = TorchArrays() if name == "torch" else CupyArrays()
        except ImportError:
            continue
        _ARRAYS[framework] = xp
        return xp
    raise UnsupportedError(f"attention on {framework} arrays allocates its outputs and scratch with torch or CuPy, "
                           f"and neither is installed; install one (pip install torch, or cupy-cuda12x)")
