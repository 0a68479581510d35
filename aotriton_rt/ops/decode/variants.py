"""Which decode variants serve a call: the compiled head-dim bucket, whether its rows are read
as is (``PADDED_D=0``) or masked to the call's head dim (``PADDED_D=1``), and the caches' element
type (``KV_DTYPE``: q's own, or fp8)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .validate import COMBINE, DECODE, DTYPES, FP8_CACHES, HEAD_DIM_BUCKETS

#: The spec axis of the caches' element type (attn_decode and attn_decode_append only).
KV_AXIS = "KV_DTYPE"

#: ``has(kernel, params)``: whether the images hold such a variant.
Has = Callable[[str, Mapping[str, Any]], bool]


def candidates(dtype: str, head_dim: int, aligned: bool, kv_dtype: str | None = None
               ) -> list[tuple[dict[str, Any], str]]:
    """(spec without ``PAGED``, why), best first, for a call at ``head_dim``.

    As is at the head dim itself when it is a bucket and every array read in place is 16-byte
    aligned (``aligned``): 16-byte loads, the fast path. Then masked on each bucket from the
    smallest holding ``head_dim`` up (images that lack a bucket run the call on the next one
    they hold). Last, for images built before the masked variants existed (no ``PADDED_D``
    parameter), the head dim's own bucket as is: new images never match it, having failed
    the first candidate. ``kv_dtype``: the caches' type, keyed as ``KV_DTYPE`` (None: images
    built before the axis, which hold caches of q's type only).
    """
    found = _candidates(dtype, head_dim, aligned)
    if kv_dtype is None:
        return found
    if kv_dtype != dtype:
        return [({**spec, KV_AXIS: kv_dtype}, f"{why}; an fp8 cache ({kv_dtype}), dequantised in registers")
                for spec, why in found]
    return [({**spec, KV_AXIS: kv_dtype}, why) for spec, why in found]


def _candidates(dtype: str, head_dim: int, aligned: bool) -> list[tuple[dict[str, Any], str]]:
    exact = head_dim in HEAD_DIM_BUCKETS and aligned
    found: list[tuple[dict[str, Any], str]] = []
    if exact:
        found.append(({"dtype": dtype, "HEAD_DIM": head_dim, "PADDED_D": 0},
                      f"head dim {head_dim} is a bucket and the arrays are 16-byte aligned"))
    if head_dim in HEAD_DIM_BUCKETS and not aligned:
        why = f"head dim {head_dim}: the arrays are not 16-byte aligned, so rows are read masked"
    else:
        why = f"head dim {head_dim} is read masked"
    for bucket in HEAD_DIM_BUCKETS:
        if bucket >= head_dim:
            found.append(({"dtype": dtype, "HEAD_DIM": bucket, "PADDED_D": 1}, f"{why} on the {bucket} bucket"))
    if exact:
        found.append(({"dtype": dtype, "HEAD_DIM": head_dim}, f"head dim {head_dim}: images without masked "
                                                               f"variants"))
    return found


def shared(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` of the kernels without a cache type (combine, pack, poison): they never read the
    caches' elements, or (pack) serve caches of q's type only."""
    return {k: v for k, v in spec.items() if k != KV_AXIS}


def with_paged(spec: Mapping[str, Any], paged: bool) -> dict[str, Any]:
    """``spec`` of the kernels with a ``PAGED`` axis (decode, append), in the axes' order."""
    return {"dtype": spec["dtype"], "HEAD_DIM": spec["HEAD_DIM"], "PAGED": int(paged), **spec}


def held_cache_axis(has: Has) -> bool:
    """Whether the images' decode variants have the ``KV_DTYPE`` axis (images built before fp8
    caches have none)."""
    return any(has(DECODE, {KV_AXIS: t}) for t in (*DTYPES, *FP8_CACHES))


def choose(dtype: str, head_dim: int, aligned: bool, paged: bool, has: Has, kv_dtype: str = "",
           keyed: bool | None = None) -> tuple[dict[str, Any], str]:
    """The first of :func:`candidates` whose decode and combine kernels the images hold, and why;
    when none, the first (so the library's KernelNotFound says what is missing). ``kv_dtype``:
    the caches' type ("": q's). A cache of q's type is asked for by ``KV_DTYPE`` where the images
    have the axis (``keyed``; None: :func:`held_cache_axis` of ``has``), else a spec without it
    would match their fp8 variants too."""
    kv_dtype = kv_dtype or dtype
    if keyed is None:
        keyed = held_cache_axis(has)
    keyed = keyed or kv_dtype != dtype
    found = candidates(dtype, head_dim, aligned, kv_dtype if keyed else None)
    for spec, why in found:
        if has(DECODE, with_paged(spec, paged)) and has(COMBINE, shared(spec)):
            return spec, why
    spec, why = found[0]
    if kv_dtype != dtype:
        targets = " and ".join(FP8_CACHES[kv_dtype][1]) if kv_dtype in FP8_CACHES else "no target"
        why += (f"; an fp8 cache ({FP8_CACHES.get(kv_dtype, ('?',))[0]}) runs on variants built for "
                f"{targets} (`python -m builder build --kernels attn_decode,attn_decode_append`)")
    if spec.get("PADDED_D") == 0:
        why += f"; the images hold no masked variant at a bucket >= {head_dim} either"
    return spec, why
