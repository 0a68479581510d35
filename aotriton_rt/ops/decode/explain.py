"""Why a decode call runs the kernels it runs: variants (head-dim bucket, masking, cache type),
tuning config and split count, and who joins the attention sinks, from the call's facts alone.

:func:`explain` makes the decisions :class:`~.launch._Launch` makes (the variant choice of
:mod:`.variants`, the catalog's split rule and config, the split count for the arch's
multiprocessor count) without arrays, a GPU or a launch. ``python -m aotriton_rt explain decode
...`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import ArgumentError, KernelNotFound, NoDevice
from ..attention.family import ALIBI_ARG, SINKS_ARG, SOFTCAP_ARG
from .launch import USE_ALIBI_ARG, _kernels_of
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
            softcap: bool = False, alibi: bool = False, sinks: bool = False, arch: str | None = None,
            library: Any = None) -> DecodeExplanation:
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
        softcap, alibi: the call passes a logit ``softcap`` or ``alibi_slopes`` (variants whose
            decode kernel takes the argument; not both).
        sinks: the call passes ``sinks``: joined by the decode kernel (one split) or the combine
            (several) where they take them, else by the ``attn_sinks`` pass after them.
        arch: the catalog arch (default: the one device 0 runs).
        library: a :class:`aotriton_rt.Library`; default :func:`aotriton_rt.default_library`.

    Raises:
        ArgumentError: a malformed fact, or an ``arch`` the images do not hold.
        UnsupportedError: a head dim past 256, an fp8 cache with fp32 queries or of another format,
            ``alibi`` with ``softcap``.
        KernelNotFound: the images lack a kernel the call needs on ``arch`` (as the call would;
            with ``softcap`` or ``alibi``, decode variants that take the argument).

    Example::

        print(explain(dtype="bf16", head_dim=128, seqlen_k=8192, batch=32, kv_dtype="fp8e4nv", arch="sm90"))
    """
    from ...errors import UnsupportedError
    from ...select import match
    from ..attention.problem import ALIBI_WITH_SOFTCAP

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
    for name, value in (("softcap", softcap), ("alibi", alibi), ("sinks", sinks)):
        if not isinstance(value, bool):
            raise ArgumentError(f"{name} must be True or False (whether the call passes it), got {value!r}")
    if softcap and alibi:
        raise UnsupportedError(ALIBI_WITH_SOFTCAP)
    needed = ((SOFTCAP_ARG,) if softcap else ()) + ((ALIBI_ARG, USE_ALIBI_ARG) if alibi else ())
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
        found = match(ks.lib.variants_of(name), name, params, [arch]).accepted
        if name != DECODE or not needed:
            return found
        return [v for v in found if set(needed) <= {a.name for a in v.args}]

    def has(name: str, params: dict) -> bool:
        return bool(on_arch(name, params))

    def held(name: str, params: dict) -> bool:  # any variant, with or without the arguments
        return bool(match(ks.lib.variants_of(name), name, params, [arch]).accepted)

    spec, why = choose(dtype, head_dim, True, paged, has, kv, held_cache_axis(held))
    group_rows = heads_q // heads_k * seqlen_q
    rule, config = split_rule(ks.rules, arch, batch_heads=batch * heads_k, paged=paged, rows=group_rows,
                              fp8=kv != dtype)
    cache = f"{kv} cache" + (", dequantised with k_scale/v_scale" if kv != dtype else "")
    terms = [t for t, on in (("softcap", softcap), ("ALiBi slopes", alibi), ("sinks", sinks)) if on]
    facts = (f"{dtype} q, {cache}, head dim {head_dim}, {'paged' if paged else 'contiguous'}, batch {batch}, "
             f"{heads_q}/{heads_k} heads, {seqlen_q} query rows, {seqlen_k} keys"
             + (f", {append} appended" if append else "") + "".join(f", {t}" for t in terms))

    def picked(name: str, params: dict, index: int) -> Any:
        found = [v for v in on_arch(name, params) if v.config.index == index] or on_arch(name, params)
        if not found:
            shown = ", ".join(f"{k}={v}" for k, v in params.items())
            taking = f" taking {', '.join(needed)}" if name == DECODE and needed else ""
            raise KernelNotFound(f"decode attention needs {name} with {shown}{taking} on {arch} ({why}), which "
                                 f"these images lack")
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
    combine = picked(COMBINE, shared(spec), 0) if splits > 1 else None
    joined = sinks and _takes_sinks(decode) and (combine is None or _takes_sinks(combine))
    epilogue = "; joins the attention sinks in its epilogue" if joined and combine is None else ""
    lines.append(_line(decode, f"{why}; {rule_text}{epilogue}"))
    if combine is not None:
        lines.append(_line(combine, f"merges the {splits} splits" + (" and joins the attention sinks" if joined
                                                                      else "")))
    if sinks and not joined:
        lines.append(_line(_sinks_pass(ks, on_arch, dtype, head_dim, heads_q, seqlen_q, arch),
                           "joins the attention sinks to (out, lse): the decode variants predate them"))
    return DecodeExplanation(facts, arch, lines)


def _takes_sinks(variant: Any) -> bool:
    """Whether a decode or combine variant joins sinks itself (its ``Sinks`` argument)."""
    return any(a.name == SINKS_ARG for a in variant.args)


def _sinks_pass(ks: Any, on_arch: Any, dtype: str, head_dim: int, heads_q: int, seqlen_q: int, arch: str) -> Any:
    """The ``attn_sinks`` variant that joins the sinks after decode variants built before them, on
    the call's fresh ``(B, Sq, Hq, D)`` output (16-byte steps where its rows allow them)."""
    from ..attention.sinks import SINKS, aligned

    rows = aligned(dtype, 0, (seqlen_q * heads_q * head_dim, head_dim, heads_q * head_dim, head_dim))
    found = on_arch(SINKS, {"dtype": dtype, "ALIGNED": int(rows)})
    if not found:
        raise KernelNotFound(f"decode attention with sinks needs {SINKS} with dtype={dtype} on {arch} (its decode "
                             f"variants predate the sinks), which these images lack")
    return found[0]


def _line(variant: Any, reason: str) -> str:
    spec = ", ".join(f"{k}={v}" for k, v in variant.spec.items())
    params = " ".join([*(f"{k}={v}" for k, v in variant.config.constexprs.items() if k.startswith("BLOCK")),
                       f"num_warps={variant.config.num_warps}", f"num_stages={variant.config.num_stages}"])
    return f"{variant.kernel}[{spec}] config #{variant.config.index} ({params}): {reason}"
