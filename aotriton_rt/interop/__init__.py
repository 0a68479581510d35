"""Device arrays of any framework -> device pointer, device index, layout and stream.

The launch path calls :func:`pointer` once per array argument, so it is built for speed:
the way to read an object is chosen once per exact ``type(obj)`` and cached in
``_HANDLERS``; a torch tensor then costs ``get_device()`` + ``data_ptr()`` and a dict
lookup. Objects are recognised in this order:

1. torch tensors (``data_ptr()``/``get_device()``), CuPy arrays (``.data.ptr``/``.device.id``);
2. ``__cuda_array_interface__`` (versions 0-3), e.g. Numba device arrays;
3. DLPack (``__dlpack_device__`` + ``__dlpack__``), legacy and versioned capsules; JAX
   arrays always take this path.

Operators call :func:`describe` for dtype, shape and strides and :func:`current_stream` for
the framework's stream. The launch path (``aotriton_rt/launch.py``) uses two seams made for it:
:func:`pointer_reader` (the cached reader of one exact type, to inline it) and
:func:`stream_getter` (a framework's current-stream function, asked once).

One module per concern: :mod:`.arrays` (:class:`ArrayInfo`, dtype tables), :mod:`.frameworks`
(torch and CuPy arrays and streams), :mod:`.protocols` (``__cuda_array_interface__``, DLPack);
this module picks the reader per type and is the public API.

No framework is imported by this module: a torch tensor can only exist once torch is in
``sys.modules``, so that is where the classes are looked up, when an unknown type is first
seen.

Lifetime: every pointer returned here is borrowed from the object passed in. It stays valid
while that object is alive, exactly as ``tensor.data_ptr()`` does; keep the object referenced
until the kernel that reads it is enqueued (stream-ordered frees then keep it safe). A DLPack
capsule is consumed and its deleter called before :func:`pointer` returns: the capsule only
holds a second reference to memory the producer object already keeps alive.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from aotriton_rt.errors import ArgumentError

from .arrays import _FIX_MOVE, _FIX_UNKNOWN, ArrayInfo, _type_name
from .frameworks import _cupy_handlers, _torch_handlers, current_stream, stream_getter
from .protocols import (
    MAX_STREAM,
    _cai_describe,
    _cai_pointer,
    _dlpack_describe,
    _dlpack_pointer,
    _make_dlpack_handlers,
    cai_launch_stream,
    set_pointer_device_resolver,
)

__all__ = [
    "ArrayInfo",
    "MAX_STREAM",
    "cai_launch_stream",
    "current_stream",
    "describe",
    "refuse_jax_tracers",
    "pointer",
    "pointer_reader",
    "register_type",
    "set_pointer_device_resolver",
    "stream_getter",
]


# ---------------------------------------------------------------------------------------
# Refusals and per-instance probing

def _refusal(obj: Any) -> ArgumentError:
    name = _type_name(obj)
    if isinstance(obj, bool) or not isinstance(obj, int):
        if hasattr(obj, "__array_interface__"):
            return ArgumentError(f"{name} is a host (CPU) array (it has __array_interface__); "
                                 f"{_FIX_MOVE}, e.g. with cupy.asarray() or torch.as_tensor(..., "
                                 f"device='cuda')")
        return ArgumentError(f"cannot pass {name} as a GPU array: it is not a torch tensor and "
                             f"has neither __cuda_array_interface__ nor __dlpack__; {_FIX_UNKNOWN}")
    return ArgumentError(f"got a raw integer ({obj:#x}) where a GPU array was expected; pass "
                         f"a framework array, or allow_raw=True with device=N if it really is "
                         f"a device pointer")


def _refuse_pointer(obj: Any, backend: str, stream: int | None) -> tuple[int, int]:
    raise _refusal(obj)


def _refuse_describe(obj: Any, backend: str, stream: int | None) -> ArrayInfo:
    raise _refusal(obj)


def _probe_pointer(obj: Any, backend: str, stream: int | None) -> tuple[int, int]:
    # Types that carry no protocol on the class may still set one on the instance.
    if getattr(obj, "__cuda_array_interface__", None) is not None:
        return _cai_pointer(obj, backend, stream)
    if getattr(obj, "__dlpack__", None) is not None:
        return _dlpack_pointer(obj, backend, stream)
    raise _refusal(obj)


def _probe_describe(obj: Any, backend: str, stream: int | None) -> ArrayInfo:
    if getattr(obj, "__cuda_array_interface__", None) is not None:
        return _cai_describe(obj, backend, stream)
    if getattr(obj, "__dlpack__", None) is not None:
        return _dlpack_describe(obj, backend, stream)
    raise _refusal(obj)


# ---------------------------------------------------------------------------------------
# Handler selection, once per exact type

_Pointer = Callable[[Any, str, "int | None"], tuple[int, int]]
_Describe = Callable[[Any, str, "int | None"], ArrayInfo]
_HANDLERS: dict[type, _Pointer] = {}
_DESCRIBERS: dict[type, _Describe] = {}
_FRAMEWORK_HANDLERS: dict[str, tuple[Callable, Callable]] = {}


def _framework_handlers(name: str, make: Callable[[], tuple[Callable, Callable]]
                        ) -> tuple[Callable, Callable]:
    pair = _FRAMEWORK_HANDLERS.get(name)
    if pair is None:
        pair = _FRAMEWORK_HANDLERS[name] = make()
    return pair


def _is_instance(obj: object, module: str, attr: str) -> bool:
    # Only a module already imported can have produced obj; never import one here.
    mod = sys.modules.get(module)
    cls = getattr(mod, attr, None) if mod is not None else None
    return isinstance(cls, type) and isinstance(obj, cls)


def refuse_jax_tracers(op: str, instead: str, **arrays: Any) -> None:
    """On an operator's error path: raise ArgumentError saying what to call instead when one of
    ``arrays`` is a JAX tracer (an array inside ``jax.jit``, ``grad`` or ``vmap``, which holds no
    data yet). Walks each argument's MRO, so it is for error paths only; imports nothing."""
    if "jax" not in sys.modules:
        return
    for name, obj in arrays.items():
        if any(c.__name__ == "Tracer" and c.__module__.startswith("jax") for c in type(obj).__mro__):
            raise ArgumentError(f"aotriton_rt.{op} was called on a JAX tracer ({name}, inside jax.jit, grad or "
                                f"vmap), which holds no data to launch on; {instead}") from None


def _select(obj: object) -> tuple[_Pointer, _Describe]:
    tp = type(obj)
    if _is_instance(obj, "torch", "Tensor"):
        pair = _framework_handlers("torch", _torch_handlers)
    elif _is_instance(obj, "cupy", "ndarray"):
        pair = _framework_handlers("cupy", _cupy_handlers)
    elif tp.__module__.partition(".")[0] in ("jax", "jaxlib") and hasattr(tp, "__dlpack__"):
        pair = _framework_handlers("jax", lambda: _make_dlpack_handlers("jax"))
    elif hasattr(tp, "__cuda_array_interface__"):
        pair = (_cai_pointer, _cai_describe)
    elif hasattr(tp, "__dlpack__"):
        pair = (_dlpack_pointer, _dlpack_describe)
    elif isinstance(obj, int) or hasattr(tp, "__array_interface__") or tp.__module__ == "builtins":
        # Not cached: the launch path gives None and raw ints their own meaning (an unused
        # pointer; an address with raw_pointers=True), which one refused describe(None) or
        # pointer(5) must not overrule for the rest of the process.
        return _refuse_pointer, _refuse_describe
    else:
        pair = (_probe_pointer, _probe_describe)
    _HANDLERS[tp], _DESCRIBERS[tp] = pair
    return pair


def _raw(obj: Any, device: int | None) -> tuple[int, int]:
    if isinstance(obj, bool) or not isinstance(obj, int):
        raise _refusal(obj)
    if device is None or device < 0:
        raise ArgumentError(f"allow_raw=True needs device=N (got {device!r}): a raw pointer "
                            f"({obj:#x}) does not say which GPU it lives on")
    if not 0 <= obj < 1 << 64:
        raise ArgumentError(f"raw pointer {obj:#x} does not fit in 64 bits")
    return obj, device


# ---------------------------------------------------------------------------------------
# Public API

def pointer(obj: Any, *, backend: str = "cuda", stream: int | None = None,
            allow_raw: bool = False, device: int | None = None) -> tuple[int, int]:
    """Return ``(device pointer, device index)`` of a GPU array.

    Args:
        obj: a torch tensor, CuPy array, JAX array, or any object exposing
            ``__cuda_array_interface__`` or DLPack.
        backend: ``"cuda"`` or ``"hip"``, the backend of the kernel that will read it.
        stream: the raw stream handle the launch goes on, handed to DLPack producers so
            that they order their pending work before it; ``None``: let the producer assume
            the legacy default stream.
        allow_raw: accept a plain ``int`` as a device pointer (refused otherwise: an int is
            far more often a mistake than a pointer).
        device: the device of a raw pointer; required with ``allow_raw``.

    Returns:
        The pointer (including any view offset) and the device ordinal; the device is -1
        for ``__cuda_array_interface__`` arrays when no resolver is installed (see
        :func:`set_pointer_device_resolver`). The pointer is borrowed: keep ``obj`` alive
        until the kernel is enqueued.

    Raises:
        ArgumentError: CPU or host memory, meta/sparse torch tensors, a device of another
            backend, an unknown object, or a malformed protocol answer.

    Example::

        ptr, dev = pointer(torch.ones(4, device="cuda"))
    """
    if allow_raw and isinstance(obj, int):
        return _raw(obj, device)
    try:
        handler = _HANDLERS[type(obj)]
    except KeyError:
        handler = _select(obj)[0]
    return handler(obj, backend, stream)


def describe(obj: Any, *, backend: str = "cuda", stream: int | None = None) -> ArrayInfo:
    """Return an :class:`ArrayInfo` (pointer, device, Triton dtype, shape, strides in
    elements, framework, producer stream) for a GPU array.

    Arguments, lifetime and errors as for :func:`pointer`; additionally raises
    :class:`ArgumentError` for a dtype Triton kernels do not take (complex, vector lanes,
    big-endian) and for strides that are not whole elements.

    Example::

        info = describe(x)            # ArrayInfo(ptr=..., dtype='fp16', shape=(4, 8), ...)
        if info.strides[-1] != 1: ...
    """
    try:
        handler = _DESCRIBERS[type(obj)]
    except KeyError:
        handler = _select(obj)[1]
    return handler(obj, backend, stream)


#: ``pointer_reader(tp)``: the reader :func:`pointer` uses for arrays of exact type ``tp``, once one
#: has been seen (None before, and for the types never cached: ints, None, host arrays). It is
#: called as ``reader(obj, backend, stream)`` and returns ``(pointer, device)`` or raises
#: ArgumentError, exactly as :func:`pointer` does. The launch path calls it per argument of a type
#: it does not inline, so it is the cache's own lookup, with no call of ours around it; anyone
#: else should call :func:`pointer`.
pointer_reader: Callable[[type], Callable[[Any, str, int | None], tuple[int, int]] | None] = _HANDLERS.get


def register_type(tp: type, pointer_fn: Callable[[Any, str, int | None], tuple[int, int]],
                  describe_fn: Callable[[Any, str, int | None], ArrayInfo]) -> None:
    """Teach :func:`pointer` and :func:`describe` a type of array they cannot read by protocol
    (e.g. a stand-in that a tracer passes instead of a real array). Both functions take
    ``(obj, backend, stream)``; later registrations of ``tp`` replace earlier ones.
    """
    _HANDLERS[tp], _DESCRIBERS[tp] = pointer_fn, describe_fn
