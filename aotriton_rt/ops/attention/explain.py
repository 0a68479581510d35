"""Why an attention call runs the kernels it runs: variant, tuning config and backward scheme.

:func:`explain` answers from the call's facts alone (dtype, head dims, lengths, mask, ...): it
asks the operator's own decision (:func:`.dispatch.choose_forward`,
:func:`.dispatch.choose_backward`: spec, kernel, tuning config and scheme, each with why) and
prints it, with the variant the chosen handle runs on ``arch``; for each kernel it says whether
its config is *tuned* (a rule matched: which rule, from which database, which length bin) or
*untuned* (no rule: the documented heuristic, config 0). It launches nothing and needs no GPU
when ``arch`` is given. ``python -m aotriton_rt explain attention ...`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import ArgumentError, KernelNotFound, NoDevice, UnsupportedError
from ...tuning import Choice
from .dispatch import (
    DTYPES,
    FP8_DTYPES,
    AttentionCall,
    KernelChoice,
    bucket,
    choose_backward,
    choose_forward,
    kernels_of,
    refusal,
)
from .problem import ALIBI_WITH_SOFTCAP

__all__ = ["Explanation", "KernelPick", "explain"]


@dataclass(frozen=True)
class KernelPick:
    """One kernel of the call: its spec, the config launched and why.

    ``config`` is the config index that runs; ``choice`` what the tuning table asked (its
    ``config`` differs from ``config`` only when that config is not in the images, which
    ``note`` then says). ``params``: the launched variant's config constexprs, warps and stages.
    """

    kernel: str
    spec: dict[str, Any]
    config: int
    params: dict[str, Any]
    choice: Choice
    variant_key: str = ""
    note: str = ""
    #: Why this kernel serves the call where another could (the portable forward or an arch's own).
    kernel_reason: str = ""
    #: The part of the call it plays: the portable kernel's name (``attn_bwd_dkdv`` for the Gluon
    #: dK/dV too), as :func:`aotriton_rt.ops.attention.dispatch.backward_params` names its specs.
    role: str = ""

    @property
    def tuned(self) -> bool:
        return self.choice.tuned and self.config == self.choice.config

    def line(self) -> str:
        spec = ", ".join(f"{k}={v}" for k, v in self.spec.items())
        params = " ".join(f"{k}={v}" for k, v in self.params.items())
        text = f"{self.kernel}[{spec}] config #{self.config} ({params}): {self.choice.reason}"
        return text + (f"; {self.note}" if self.note else "") + (f"; kernel: {self.kernel_reason}"
                                                                 if self.kernel_reason else "")


@dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found: the call, the arch, the kernels in launch order and, for a
    backward, its scheme and why."""

    call: AttentionCall
    arch: str
    kernels: list[KernelPick] = field(default_factory=list)
    scheme: str | None = None
    scheme_reason: str = ""
    #: The spec the ``tuning["attn_bwd_mode"]`` rules were matched against (backward only;
    #: :func:`aotriton_rt.ops.attention.dispatch.mode_spec`).
    scheme_spec: dict[str, Any] = field(default_factory=dict)

    @property
    def tuned(self) -> bool:
        """Every kernel's config came from a tuning rule."""
        return all(k.tuned for k in self.kernels)

    def __str__(self) -> str:
        head = (f"attention {'backward' if self.scheme else 'forward'} on {self.arch}: {self.call.describe()}, "
                f"seqlen_q {self.call.seqlen_q}, seqlen_k {self.call.seqlen_k}")
        lines = [head]
        if self.scheme:
            lines.append(f"  scheme {self.scheme}: {self.scheme_reason}")
        lines.extend(f"  {k.line()}" for k in self.kernels)
        return "\n".join(lines)


def _length(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**31 - 1:
        raise ArgumentError(f"{name} must be an integer in [1, 2**31 - 1], got {value!r}")
    return value


def explain(*, dtype: str, head_dim: int, seqlen_q: int, seqlen_k: int | None = None, head_dim_v: int | None = None,
            causal: bool = False, align: str = "top_left", bias: bool = False, dropout: bool = False,
            varlen: bool = False, alibi: bool = False, softcap: bool = False, sinks: bool = False,
            backward: bool = False, deterministic: bool = False, scheme: str | None = None, arch: str | None = None,
            out_dtype: str = "bf16", library: Any = None) -> Explanation:
    """Which variants and configs an attention call with these facts runs, and why.

    Arguments:
        dtype: "fp16", "bf16" or "fp32"; or an e4m3 format, "fp8e4nv" (``float8_e4m3fn``) or
            "fp8e4b8" (``float8_e4m3fnuz``), for the FP8 inference forward (``out_dtype``: its
            output, "bf16" or "fp16"; no bias, dropout, ALiBi, softcap, sinks or backward).
        head_dim, head_dim_v: q·k and v head dims (``head_dim_v`` defaults to ``head_dim``).
        seqlen_q, seqlen_k: the lengths (``seqlen_k`` defaults to ``seqlen_q``); with varlen, the maxima.
        causal, align, bias, dropout, varlen: as for :func:`aotriton_rt.attention` (bias/dropout: present or not).
        alibi: the call passes ``alibi_slopes`` (ALiBi variants; not with ``bias`` or ``softcap``).
        softcap: the call passes a logit ``softcap`` (its ``SOFTCAP=1`` variants; the value itself
            changes no choice).
        sinks: the call passes ``sinks``: a forward variant that takes them joins them in its
            epilogue (its line says so); one built before that has the sinks' kernel after it
            (``attn_sinks``, its 16-byte variant where the output's rows allow it); the backward
            has their gradient's kernel after it (``attn_sinks_bwd``).
        backward, deterministic, scheme: explain the backward's kernels (and its scheme) instead.
        arch: the catalog arch to explain for (e.g. "sm90"); default: the one device 0 runs
            (no driver is needed when the images hold one arch; NoDevice, naming the archs to
            pass, when they hold several and there is no GPU).
        library: a :class:`aotriton_rt.Library`; default :func:`aotriton_rt.default_library`.

    Returns:
        an :class:`Explanation`; ``str()`` of it prints one line per kernel, e.g.
        ``attn_fwd[...] config #1 (BLOCK_M=128 ...): tuned (rule #4 of tuning['attn_fwd'], from
        tuning database sm90 (NVIDIA H200), measured at seqlen_q 4096..8192, seqlen_q in [4096, inf],
        arch sm90)``.

    Raises:
        ArgumentError: a malformed fact, or an ``arch`` the images do not hold.
        UnsupportedError: a head dim beyond the largest bucket, or on the 512 bucket where no
            build compiles it for the dtype and ``arch`` (:func:`.family.wide_refusal`).
        KernelNotFound: the images lack a kernel the call needs (as the call itself would).

    Example::

        print(explain(dtype="bf16", head_dim=128, seqlen_q=4096, causal=True, arch="sm90"))
    """
    if scheme not in (None, "split", "atomic"):
        raise ArgumentError(f"scheme must be None, 'split' or 'atomic', got {scheme!r}")
    if dtype in FP8_DTYPES:
        return _explain_fp8(dtype=dtype, head_dim=head_dim, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                            head_dim_v=head_dim_v, causal=causal, align=align, varlen=varlen, arch=arch,
                            out_dtype=out_dtype, library=library, unsupported={
                                "bias": bias, "dropout": dropout, "alibi": alibi, "softcap": softcap, "sinks": sinks,
                                "backward": backward})
    call = call_of(dtype=dtype, head_dim=head_dim, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim_v=head_dim_v,
                   causal=causal, align=align, bias=bias, dropout=dropout, varlen=varlen, alibi=alibi,
                   softcap=softcap)
    ks = kernels_of(library)
    arch = _arch_of(ks, arch)
    if not isinstance(sinks, bool):
        raise ArgumentError(f"sinks must be True or False (whether the call passes it), got {sinks!r}")
    if not backward:
        forward = _pick(ks, choose_forward(ks, call, arch), call, arch)
        if not sinks:
            return Explanation(call, arch, [forward])
        if _takes_sinks(ks, forward, arch):
            note = "; ".join(n for n in (forward.note, "joins the attention sinks in its epilogue") if n)
            return Explanation(call, arch, [replace(forward, note=note)])
        return Explanation(call, arch, [forward, _pick(ks, sinks_choice(call, False), call, arch)])
    tail = [_pick(ks, sinks_choice(call, backward), call, arch)] if sinks else []
    chosen = choose_backward(ks, call, arch, deterministic=deterministic, scheme=scheme)
    return Explanation(call, arch, [*(_pick(ks, k, call, arch) for k in chosen.kernels.values()), *tail],
                       chosen.mode, chosen.reason, chosen.mode_spec)


def _takes_sinks(ks: Any, pick: KernelPick, arch: str) -> bool:
    """Whether the variant ``pick`` names takes the forward's sinks arguments (:data:`SINKS_ARG`)."""
    from .family import SINKS_ARG

    return any(v.key == pick.variant_key and any(a.name == SINKS_ARG for a in v.args)
               for v in ks.lib.variants_of(pick.kernel))


def _arch_of(ks: Any, arch: str | None) -> str:
    """``arch``, checked against the images' archs; without one, the arch device 0 runs."""
    built = sorted({a for _, a in ks.lib.targets()})
    if arch is None:
        try:
            return ks.device_arch(0)
        except NoDevice:
            raise NoDevice(f"no GPU found on this machine to take the arch from; pass arch={built[0]!r} (the "
                           f"images hold: {', '.join(built)})") from None
    if arch not in built:
        raise ArgumentError(f"arch {arch!r} has no images here; built: {', '.join(built) or 'none'}")
    return arch


def _explain_fp8(*, dtype: str, head_dim: int, seqlen_q: int, seqlen_k: int | None, head_dim_v: int | None,
                 causal: bool, align: str, varlen: bool, arch: str | None, out_dtype: str, library: Any,
                 unsupported: dict[str, bool]) -> Explanation:
    """:func:`explain` of an FP8 forward (``dtype`` an e4m3 format)."""
    from .fp8 import FP8_V_TRANSPOSE, explain_choice, out_dtype_of, transpose_spec

    asked = [name for name, flag in unsupported.items() if flag]
    if asked:
        raise UnsupportedError(f"FP8 attention is an inference forward without {', '.join(asked)}")
    base = call_of(dtype="bf16", head_dim=head_dim, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim_v=head_dim_v,
                   causal=causal, align=align, varlen=varlen)
    call = replace(base, dtype=dtype)
    ks = kernels_of(library)
    arch = _arch_of(ks, arch)
    forward = explain_choice(ks, call, out_dtype_of(out_dtype), arch)
    order = _fp8_key_order(ks, forward)
    spec = transpose_spec(forward, order)
    why = "V^T for the FP8 forward's P·V (keys contiguous" + (", each 32 in the forward's register order)" if order
                                                               else ")")
    pre = KernelChoice(FP8_V_TRANSPOSE, FP8_V_TRANSPOSE, spec, why, Choice(FP8_V_TRANSPOSE, 0), dict(spec))
    return Explanation(call, arch, [_pick(ks, pre, call, arch), _pick(ks, forward, call, arch)])


def _fp8_key_order(ks: Any, forward: KernelChoice) -> int:
    """The key order of V^T that the explained FP8 forward reads (0 where the images lack it:
    the explanation then says what is missing)."""
    from .fp8 import forward_handle

    try:
        return forward_handle(ks, forward)[1]
    except KernelNotFound:
        return 0


def sinks_choice(call: AttentionCall, backward: bool) -> KernelChoice:
    """The sinks' kernel of a call with ``sinks`` (:mod:`.sinks`): after the forward, the epilogue
    that joins them to each row's softmax, in 16-byte steps (``ALIGNED=1``) where the operator's
    output rows allow it (a contiguous output whose v head dim is a multiple of 16 bytes); after
    the backward, their gradient's reduction."""
    from .sinks import SINKS, SINKS_BWD, aligned

    if backward:
        name, spec, why = SINKS_BWD, {"dtype": call.dtype}, "attention sinks: their gradient, after the backward"
    else:
        # A fresh contiguous output: its address aligned, its strides multiples of the head dim.
        name, spec = SINKS, {"dtype": call.dtype, "ALIGNED": int(aligned(call.dtype, 0, (call.head_dim_v,)))}
        why = "attention sinks: the epilogue that joins them to each row's softmax"
    return KernelChoice("sinks", name, spec, why, Choice(name, 0), dict(spec))


def call_of(*, dtype: str, head_dim: int, seqlen_q: int, seqlen_k: int | None = None, head_dim_v: int | None = None,
            causal: bool = False, align: str = "top_left", bias: bool = False, dropout: bool = False,
            varlen: bool = False, alibi: bool = False, softcap: bool = False) -> AttentionCall:
    """The dispatch's view of a call with these facts (validated as the call itself would be):
    what :func:`explain` explains and :func:`.warmup.warmup` readies."""
    if dtype not in DTYPES:
        raise ArgumentError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if align not in ("top_left", "bottom_right"):
        raise ArgumentError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    seqlen_q = _length(seqlen_q, "seqlen_q")
    seqlen_k = _length(seqlen_q if seqlen_k is None else seqlen_k, "seqlen_k")
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    for d in (head_dim, head_dim_v):
        bucket(d)  # refuses head dims past the largest bucket, as the call would
    for name, flag in (("alibi", alibi), ("softcap", softcap)):
        if not isinstance(flag, bool):
            raise ArgumentError(f"{name} must be True or False (whether the call passes it), got {flag!r}")
    if alibi and bias:
        raise UnsupportedError("alibi with bias is not compiled: the ALiBi kernels take no bias tensor; add the ALiBi "
                               "term to the bias instead, or drop one")
    if alibi and softcap:
        raise UnsupportedError(ALIBI_WITH_SOFTCAP)
    # The operator's LSE/Delta are contiguous (B, H, seqlen_q): strides (H·seqlen_q, seqlen_q), which
    # are multiples of 16 exactly when seqlen_q is, whatever H; one head's stand in for them.
    return AttentionCall(dtype, head_dim, head_dim_v, (1 if align == "top_left" else 2) if causal else 0,
                         bool(causal) and seqlen_q == seqlen_k, bool(bias), int(bool(dropout)), bool(varlen),
                         seqlen_q, seqlen_k, None if varlen else (seqlen_q, seqlen_q), softcap=softcap, alibi=alibi)


def _pick(ks: Any, chosen: KernelChoice, call: AttentionCall, arch: str) -> KernelPick:
    """``chosen`` in words, with the variant its handle runs on ``arch``: the library's pick among
    those matching its parameters there (the lowest config, where its tuned one is not built)."""
    from ...select import match, remedy

    name, choice = chosen.kernel, chosen.config
    found = match(ks.lib.variants_of(name), name, chosen.spec, [arch]).accepted
    why = None if found else refusal(call, chosen, arch)
    if why is not None:
        raise UnsupportedError(why)
    if not found:
        raise KernelNotFound(f"attention ({call.describe()}) needs {name} with "
                             f"{', '.join(f'{k}={v}' for k, v in chosen.spec.items())} on {arch}, which these images "
                             f"lack; {remedy(name, [arch])}")
    variant = match(found, name, chosen.params, [arch]).accepted[0]
    note = ""
    if variant.config.index != choice.config:
        note = f"config #{choice.config} is not in these images, so #{variant.config.index} runs"
    elif len({v.config.index for v in found}) == 1 and not choice.tuned:
        note = "the only config built"
    params = {**variant.config.constexprs, "num_warps": variant.config.num_warps,
              "num_stages": variant.config.num_stages}
    return KernelPick(name, dict(chosen.spec), variant.config.index, params, choice, variant.key, note, chosen.reason,
                      chosen.role)
