"""Why a decode call runs the kernels it runs: variants (head-dim bucket, masking, cache type),
tuning config and split count, from the call's facts alone.

:func:`explain` makes the decisions :class:`~.launch._Launch` makes (the variant choice of
:mod:`.variants`, the catalog's split rule and config, the split count for the arch's
multiprocessor count) without arrays, a GPU or a launch. ``python -m aotriton_rt explain decode
...`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import ArgumentError, KernelNotFound, NoDevice
from .launch import _kernels_of
from .splits import _SM_COUNTS, num_splits_for, split_rule
from .validate import APPEND, COMBINE, DECODE, DTYPES, FP8_CACHES, FP8_QUERY_DTYPES, check_head_dim
from .variants import choose, held_cache_axis, shared, with_paged

__all__ = ["DecodeExplanation", "explain"]


@dataclass(frozen=True)
class DecodeExplanation:
    """What :func:`explain` found: the call, the arch and one line per kernel in launch order."""

    facts: str
    arch: str
    lines: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join([f"decode on {self.arch}: {self.facts}", *(f"  {line}" for line in self.lines)])


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def explain(*, dtype: str, head_dim: int, seqlen_k: int, seqlen_q: int = 1, batch: int = 1, heads_q: int = 32,
            heads_k: int = 8, kv_dtype: str | None = None, paged: bool = False, append: int = 0,
            arch: str | None = None, library: Any = None) -> DecodeExplanation:
    """Which decode variants, configs and split count a :func:`~aotriton_rt.ops.decode.decode_attention`
    call with these facts runs, and why.

    Arguments:
        dtype: q's dtype, "fp16", "bf16" or "fp32".
        head_dim: the head dim (a bucket is read as is; other dims masked on the next bucket).
        seqlen_k: the keys each sequence sees (cached plus appended rows).
        seqlen_q, batch, heads_q, heads_k: query rows per sequence, sequences, query and KV heads.
        kv_dtype: the caches' type: None (q's), "fp8e4nv" (``float8_e4m3fn``) or "fp8e4b8"
            (``float8_e4m3fnuz``).
        paged: a paged cache; append: rows appended per sequence (0: no append kernel).
        arch: the catalog arch (default: the one device 0 runs).
        library: a :class:`aotriton_rt.Library`; default :func:`aotriton_rt.default_library`.

    Raises:
        ArgumentError: a malformed fact, or an ``arch`` the images do not hold.
        UnsupportedError: a head dim past 256, an fp8 cache with fp32 queries or of another format.
        KernelNotFound: the images lack a kernel the call needs on ``arch`` (as the call would).

    Example::

        print(explain(dtype="bf16", head_dim=128, seqlen_k=8192, batch=32, kv_dtype="fp8e4nv", arch="sm90"))
    """
    from ...errors import UnsupportedError
    from ...select import match

    if dtype not in DTYPES:
        raise UnsupportedError(f"dtype {dtype!r}; decode attention supports {', '.join(DTYPES)}")
    kv = kv_dtype or dtype
    if kv != dtype:
        if kv not in FP8_CACHES:
            raise UnsupportedError(f"kv_dtype {kv!r}; fp8 caches are e4m3: fp8e4nv (float8_e4m3fn) or fp8e4b8 "
                                   f"(float8_e4m3fnuz)")
        if dtype not in FP8_QUERY_DTYPES:
            raise UnsupportedError(f"an fp8 cache serves fp16 and bf16 queries, not {dtype}")
    check_head_dim(head_dim)
    for name, value in (("seqlen_k", seqlen_k), ("seqlen_q", seqlen_q), ("batch", batch), ("heads_q", heads_q),
                        ("heads_k", heads_k)):
        _positive(value, name)
    if heads_q % heads_k:
        raise ArgumentError(f"heads_q {heads_q} is not a multiple of heads_k {heads_k}")
    ks = _kernels_of(library)
    built = sorted({a for _, a in ks.lib.targets()})
    if arch is None:
        try:
            arch = ks.device_arch(0)
        except NoDevice:
            raise NoDevice(f"no GPU found on this machine to take the arch from; pass arch={built[0]!r} (the "
                           f"images hold: {', '.join(built)})") from None
    elif arch not in built:
        raise ArgumentError(f"arch {arch!r} has no images here; built: {', '.join(built) or 'none'}")

    def on_arch(name: str, params: dict) -> list:
        return match(ks.lib.variants_of(name), name, params, [arch]).accepted

    def has(name: str, params: dict) -> bool:
        return bool(on_arch(name, params))

    spec, why = choose(dtype, head_dim, True, paged, has, kv, held_cache_axis(has))
    group_rows = heads_q // heads_k * seqlen_q
    rule, config = split_rule(ks.rules, arch, batch_heads=batch * heads_k, paged=paged, rows=group_rows)
    cache = f"{kv} cache" + (", dequantised with k_scale/v_scale" if kv != dtype else "")
    facts = (f"{dtype} q, {cache}, head dim {head_dim}, {'paged' if paged else 'contiguous'}, batch {batch}, "
             f"{heads_q}/{heads_k} heads, {seqlen_q} query rows, {seqlen_k} keys"
             + (f", {append} appended" if append else ""))

    def picked(name: str, params: dict, index: int) -> Any:
        found = [v for v in on_arch(name, params) if v.config.index == index] or on_arch(name, params)
        if not found:
            shown = ", ".join(f"{k}={v}" for k, v in params.items())
            raise KernelNotFound(f"decode attention needs {name} with {shown} on {arch} ({why}), which these "
                                 f"images lack")
        return found[0]

    decode = picked(DECODE, with_paged(spec, paged), config)
    block_m = int(decode.config.constexprs.get("BLOCK_M", 16))
    block_n = int(decode.config.constexprs.get("BLOCK_N", 64))
    splits = num_splits_for(batch, heads_k, -(-group_rows // block_m), seqlen_k, block_n, _SM_COUNTS.get(arch, 100),
                            rule)
    rule_text = (f"config #{config} by the catalog's rule for {batch * heads_k} (sequence, KV head) pairs and "
                 f"{group_rows} rows per KV head; {splits} split(s) (waves {rule.waves}, at least {rule.min_blocks} "
                 f"key blocks each, at most {rule.max_splits}, {_SM_COUNTS.get(arch, 100)} multiprocessors)")
    lines = []
    if append:
        lines.append(_line(picked(APPEND, with_paged(spec, paged), 0), "the append" + (
            ": stores value / scale in the fp8 cache" if kv != dtype else "")))
    lines.append(_line(decode, f"{why}; {rule_text}"))
    if splits > 1:
        lines.append(_line(picked(COMBINE, shared(spec), 0), f"merges the {splits} splits"))
    return DecodeExplanation(facts, arch, lines)


def _line(variant: Any, reason: str) -> str:
    spec = ", ".join(f"{k}={v}" for k, v in variant.spec.items())
    params = " ".join([*(f"{k}={v}" for k, v in variant.config.constexprs.items() if k.startswith("BLOCK")),
                       f"num_warps={variant.config.num_warps}", f"num_stages={variant.config.num_stages}"])
    return f"{variant.kernel}[{spec}] config #{variant.config.index} ({params}): {reason}"
