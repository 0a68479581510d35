"""The attention operator's express route: calls of 1..16 query rows without bias, dropout or
preallocated outputs, which the split-KV decode kernels serve (``plan.py``'s routing point).

Apart from ``plan.py`` so that the two operators do not import each other: short attention calls
run on the decode kernels (through here), and the decode operator's long query runs run on the
attention forward (``plan.forward``). The package's ``__init__`` installs this module as
``plan.EXPRESS``; the decode operator is imported at the first call routed here.
"""

from __future__ import annotations

from typing import Any


def route_options(q: Any, k: Any, v: Any, **options: Any) -> dict | None:
    """:func:`aotriton_rt.ops.decode.route_options`."""
    from ..decode import route_options as route

    return route(q, k, v, **options)


def decode_attention(q: Any, k: Any, v: Any, **options: Any) -> tuple:
    """:func:`aotriton_rt.ops.decode.decode_attention`."""
    from ..decode import decode_attention as decode

    return decode(q, k, v, **options)


def cached_launch(q: Any, k: Any, v: Any, **options: Any) -> Any:
    """:func:`aotriton_rt.ops.decode.cached_launch`."""
    from ..decode import cached_launch as cached

    return cached(q, k, v, **options)
