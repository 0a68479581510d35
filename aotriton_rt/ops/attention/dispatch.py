"""Step 2a of a call: which kernels run it. Pure functions of the call's facts and of what the
images hold, and the per-library cache of kernel handles.

:func:`forward_params` / :func:`backward_params` name the catalog variants a call needs;

:func:`choose_forward` / :func:`choose_backward` take every decision of a call (spec, kernel,
tuning config, backward scheme) into one record that says what was chosen and why
(:class:`KernelChoice`, :class:`BackwardChoice`): :class:`LibraryKernels` launches from it and
:func:`aotriton_rt.ops.attention.explain` prints it. :class:`LibraryKernels` turns the choices
into handles of one :class:`aotriton_rt.Library` and explains what is missing. Which kernels
exist and which stands in for which on an arch: :mod:`.family`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ...arch import target_arch
from ...errors import DriverError, KernelNotFound, UnsupportedError
from ...tuning import Choice, explain_config, select_kernel, seqlen_bin
from .family import (  # noqa: F401 - DTYPES, FP8_DTYPES and bucket: explain reads them here
    ALIBI_ARG,
    ALIGN_ARG,
    ALIGNED_FACTS,
    ALIGNED_SIBLINGS,
    ARCH_BACKWARDS,
    ARCH_FORWARDS,
    BACKWARD_KERNEL_RULES,
    CONVERT,
    DKDV,
    DQ,
    DTYPES,
    FP8_DTYPES,
    FWD,
    KERNEL_RULES,
    MODE_RULES,
    PRE,
    SOFTCAP_ARG,
    WIDE_HEAD_DIM,
    AttentionCall,
    bucket,
    family_of,
    head_dim_buckets,
    wide_refusal,
)
from .signature import PlanCache

#: What explain says of an aligned sibling that runs.
ALIGNED_REASON = "aligned-length variant (seqlen and LSE strides multiples of 16)"

#: ``available(kernel, params, args)``: whether the images hold such a variant, every matching
#: one of which takes the run-time arguments ``args`` (a tuple, usually empty; ``(ALIGN_ARG,)``
#: when a mode-1 kernel must align its band bottom-right).
Available = Callable[[str, Mapping[str, Any], tuple[str, ...]], bool]


def _everything(name: str, params: Mapping[str, Any], args: Sequence[str] = ()) -> bool:
    return True


def needed_args(call: AttentionCall, spec: Mapping[str, Any]) -> tuple[str, ...]:
    """The run-time arguments a variant of ``spec`` must take to serve ``call``: :data:`ALIGN_ARG`
    when a mode-1 band must be aligned bottom-right, :data:`SOFTCAP_ARG` for a softcap variant,
    :data:`ALIBI_ARG` for an ALiBi one."""
    align = (ALIGN_ARG,) if spec.get("CAUSAL", 0) == 1 and call.causal == 2 and not call.causal_equivalent else ()
    return align + ((SOFTCAP_ARG,) if spec.get("SOFTCAP") else ()) + ((ALIBI_ARG,) if spec.get("ALIBI") else ())


#: Spec axes added after images were first built, newest first. Images built before an axis have
#: no such parameter: they serve the calls that leave it, and every newer axis, at 0.
LATE_AXES = ("ALIBI", "SOFTCAP")
_SPEC_ORDER = ("SOFTCAP", "ALIBI")  # as the kernels declare them


def _late(call: AttentionCall, available: Available | None = None, name: str = "") -> list[dict[str, int]]:
    """The late axes' part of a spec for each generation of images that may serve ``call``, newest
    first: every axis; then, while the call leaves them at 0 and the images' variants of ``name``
    do not have them (:func:`held_axis`: a spec without an axis would match its variants of value
    1, which refuse the call), without the newest ones."""
    values = {"SOFTCAP": int(call.softcap), "ALIBI": int(call.alibi)}
    named = [LATE_AXES]
    for i, axis in enumerate(LATE_AXES):
        if values[axis] or (available is not None and held_axis(available, name, axis)):
            break
        named.append(LATE_AXES[i + 1:])
    return [{a: values[a] for a in _SPEC_ORDER if a in axes} for axes in named]


def _first(name: str, candidates: list[dict], available: Available, call: AttentionCall,
           missing: int = 0) -> dict:
    # The first candidate the images hold; if none, candidate ``missing``, so that the library's
    # KernelNotFound explains what is missing.
    for c in candidates:
        if available(name, c, needed_args(call, c)):
            return c
    return candidates[missing]


def held_axis(available: Available, name: str, axis: str) -> bool:
    """Whether the images' variants of ``name`` have the 0/1 spec axis ``axis`` (images built
    before it existed have none). A candidate spec that leaves such an axis out matches its
    variants of either value, so it may be offered only to images without the axis."""
    return any(available(name, {axis: value}, ()) for value in (0, 1))


def _causal_modes(call: AttentionCall) -> list[int]:
    if call.causal == 2 or (call.causal and call.causal_equivalent):
        # Mode 2 first: images built before mode 1 took its alignment at run time hold mode 2 for
        # bottom-right calls; the default set holds mode 1 only (one compile, both alignments).
        return [2, 1]
    return [call.causal]


def forward_params(call: AttentionCall, available: Available | None = None) -> dict[str, Any]:
    """The ``attn_fwd`` spec (catalog parameters) for a call.

    ``available(kernel, params, args)`` (:data:`Available`) says whether the images hold such a
    variant; among equivalent choices (head-dim pairs, mask modes) the first available is taken.
    """
    available = available or _everything
    base = [{"dtype": call.dtype, "HEAD_DIM": dk, "HEAD_DIM_V": dv, "CAUSAL": c, "BIAS": int(call.bias),
             "DROPOUT": call.dropout, "VARLEN": int(call.varlen)}
            for dk, dv in head_dim_buckets(call.head_dim, call.head_dim_v) for c in _causal_modes(call)]
    # Images built before a late axis (:data:`LATE_AXES`) have no such parameter. When nothing
    # serves the call, the oldest generation's first candidate names what is missing: the axis
    # only for a call that needs it (e.g. ``ALIBI=1``), else the real gap.
    generations = _late(call, available, FWD)
    candidates = [{**c, **late} for late in generations for c in base]
    return _first(FWD, candidates, available, call, missing=len(base) * (len(generations) - 1))


def backward_params(call: AttentionCall, available: Available | None = None, *, deterministic: bool = False,
                    dbias: bool = True, mode: str | None = None) -> tuple[str, dict[str, dict[str, Any]]]:
    """The backward scheme and the spec of each kernel it launches, in launch order.

    Returns ``("split", {preprocess, dkdv, dq})`` by default: deterministic, and on the H200
    also the faster scheme (docs/performance.md: the atomic-dQ dk/dv kernel was 1.1-1.9x slower
    at D=128). ``("atomic", {preprocess, dkdv, convert})`` when ``mode == "atomic"`` (e.g. from
    the tuning table) or when the images hold only the atomic kernels; never when
    ``deterministic``. ``dbias``: the dk/dv kernel also writes dBias (its ``BIAS=2``).
    """
    available = available or _everything
    dropout = int(bool(call.dropout))
    bias_dkdv = (2 if dbias else 1) if call.bias else 0

    def scheme(atomic: int, dk: int, dv: int, causal: int, late: dict[str, int]) -> dict[str, dict[str, Any]]:
        common = {"dtype": call.dtype, "HEAD_DIM": dk, "HEAD_DIM_V": dv}
        # ``late``: the late axes' values, as the images' generation names them (see _late).
        masks = {"CAUSAL": causal, "DROPOUT": dropout, "VARLEN": int(call.varlen), **late}
        kernels = {PRE: {**common, "VARLEN": int(call.varlen), "DQ_ATOMIC": atomic},
                   DKDV: {**common, **masks, "BIAS": bias_dkdv, "DQ_ATOMIC": atomic}}
        if atomic:
            kernels[CONVERT] = {"dtype": call.dtype, "HEAD_DIM": dk, "VARLEN": int(call.varlen)}
        else:
            kernels[DQ] = {**common, **masks, "BIAS": int(call.bias)}
        return kernels

    shapes = [(dk, dv, c) for dk, dv in head_dim_buckets(call.head_dim, call.head_dim_v)
              for c in _causal_modes(call)]
    order = [1, 0] if mode == "atomic" else [0, 1]
    generations = _late(call, available, DKDV)
    for late in generations:
        for atomic in order:
            if atomic and deterministic:
                continue
            for dk, dv, c in shapes:
                kernels = scheme(atomic, dk, dv, c, late)
                if all(available(n, p, needed_args(call, p)) for n, p in kernels.items()):
                    return ("atomic" if atomic else "split"), kernels
    return "split", scheme(0, *shapes[0], generations[-1])


def role_available(ks: LibraryKernels, arch: str | Callable[[], str]) -> Available:
    """``ks.available``, where a backward role (``attn_bwd_dkdv``, ``attn_bwd_dq``) also counts as
    held when the images hold ``arch``'s own kernel for it (:data:`ARCH_BACKWARDS`) with those
    parameters: images may carry, e.g., the atomic scheme's dK/dV as the Gluon kernel only. A
    callable ``arch`` is asked only when the portable kernel is missing."""

    def available(name: str, params: Mapping[str, Any], args: Sequence[str] = ()) -> bool:
        if ks.available(name, params, args):
            return True
        owners = [own[name] for own in ARCH_BACKWARDS.values() if name in own]
        if not any(ks.available(o, params, args) for o in owners):
            return False
        own = ARCH_BACKWARDS.get(arch() if callable(arch) else arch, {}).get(name)
        return own is not None and ks.available(own, params, args)

    return available


def mode_spec(call: AttentionCall, available: Available | None = None, *, dbias: bool = True) -> dict[str, Any]:
    """The spec a ``tuning["attn_bwd_mode"]`` rule is matched against: the split scheme's dK/dV spec
    for the call without ``DQ_ATOMIC`` (dtype, head dims, mask mode, bias, dropout, varlen), so a
    scheme rule names a call the way the kernel rules name its kernels (``python -m builder tune``
    writes both from one measurement; a rule may name a subset, e.g. ``{"HEAD_DIM": 64}``)."""
    _, specs = backward_params(call, available, deterministic=True, dbias=dbias)
    return {k: v for k, v in specs[DKDV].items() if k != "DQ_ATOMIC"}


def aligned_facts(call: AttentionCall) -> dict[str, int] | None:
    """The values of :data:`ALIGNED_FACTS` that a fixed-length call passes its kernels; None for a
    variable-length call or unknown LSE strides (no aligned sibling then)."""
    if call.varlen or call.lse_strides is None or call.seqlen_q < 1 or call.seqlen_k < 1:
        return None
    return {"seqlen_q": call.seqlen_q, "seqlen_k": call.seqlen_k, "stride_lz": call.lse_strides[0],
            "stride_lh": call.lse_strides[1]}


#: The largest divisibility an aligned sibling may declare: its facts enter the choice caches'
#: keys only through their power-of-two part up to this (so those keys stay few), which decides
#: divisibility by any power of two up to it; other divisors keep the family's kernel.
_MAX_FACT_DIVISOR = 1024


def _fact_key(call: AttentionCall) -> tuple[int, ...] | None:
    facts = aligned_facts(call)
    return None if facts is None else tuple(math.gcd(facts[n], _MAX_FACT_DIVISOR) for n in ALIGNED_FACTS)


def _serves_aligned(lib: Any, family: str, sibling: str, params: Mapping[str, Any], facts: Mapping[str, int]
                    ) -> bool:
    """Whether every variant of ``sibling`` matching ``params`` declares its arguments as the
    family's do, but for :data:`ALIGNED_FACTS` whose declared divisibility (a power of two up to
    ``_MAX_FACT_DIVISOR``) the call's ``facts`` meet."""
    from ...select import match

    own = match(lib.variants_of(sibling), sibling, params).accepted
    base = match(lib.variants_of(family), family, params).accepted
    if not own or not base:
        return False
    promised = [(a.name, a.type, a.divisibility) for a in base[0].args]
    for v in own:
        if [(a.name, a.type) for a in v.args] != [(n, t) for n, t, _ in promised]:
            return False
        for a, (_, _, d_family) in zip(v.args, promised):
            d = a.divisibility
            if a.name not in facts:
                if d != d_family:
                    return False
            elif d > 1 and (d & (d - 1) or d > _MAX_FACT_DIVISOR or facts[a.name] % d):
                return False
    return True


def _default_library() -> Any:
    from ...library import default_library

    return default_library()


class LibraryKernels:
    """Per-library caches: which variants exist, the tuning table, handles per call shape."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.available_cache: dict[tuple, bool] = {}
        self.choices: dict[tuple, Any] = {}  # call shape -> (spec, handle) / (mode, specs, handles)
        self.plans = PlanCache()  # call signature -> Plan (see plan.py, backward_plan.py)
        self.arch: dict[int, str] = {}
        self.tuning = lib.tuning  # the library's table (a view's own: Library.with_tuning)

    def available(self, name: str, params: Mapping[str, Any], args: Sequence[str] = ()) -> bool:
        """Whether the images hold ``name`` with ``params`` whose every matching variant takes
        the run-time arguments ``args`` (cached)."""
        key = (name, tuple(sorted(params.items())), tuple(args))
        hit = self.available_cache.get(key)
        if hit is None:
            hit = _available(self.lib, name, params) and (not args or _takes(self.lib, name, params, args))
            self.available_cache[key] = hit
        return hit

    def aligned_sibling(self, name: str, params: Mapping[str, Any], call: AttentionCall,
                        args: Sequence[str] = ()) -> str | None:
        """The aligned sibling of kernel ``name`` (:data:`ALIGNED_SIBLINGS`) that may run ``call``
        with ``params`` in its place, or None: the images hold it for ``params`` (its variants
        taking ``args``), declared as ``name``'s but for :data:`ALIGNED_FACTS`, and the call's
        facts meet each divisibility it declares (cached per power-of-two part of the facts)."""
        sibling = ALIGNED_SIBLINGS.get(name)
        facts = _fact_key(call)
        if sibling is None or facts is None or not self.available(sibling, params, args):
            return None
        key = ("aligned", sibling, tuple(sorted(params.items())), facts)
        hit = self.available_cache.get(key)
        if hit is None:
            reduced = dict(zip(ALIGNED_FACTS, facts))
            hit = self.available_cache[key] = _serves_aligned(self.lib, name, sibling, params, reduced)
        return sibling if hit else None

    def device_arch(self, device: int) -> str:
        arch = self.arch.get(device)
        if arch is None:
            arch = self.arch[device] = target_arch(self.lib, device)
        return arch

    def _call_key(self, call: AttentionCall, device: int, *extra: Any) -> tuple:
        # Lengths matter only to tuning rules, and to those only through their ranges.
        tuned = bool(self.tuning)
        return (call.dtype, call.head_dim, call.head_dim_v, call.causal, call.causal_equivalent, call.bias,
                call.dropout, call.varlen, call.softcap, call.alibi, seqlen_bin(call.seqlen_q) if tuned else 0,
                seqlen_bin(call.seqlen_k) if tuned else 0, device, *extra)

    def forward(self, call: AttentionCall, device: int) -> tuple[dict[str, Any], Any]:
        """The forward's spec and kernel handle for a call (cached per call shape): what
        :func:`choose_forward` chose."""
        key = self._call_key(call, device)
        hit = self.choices.get(key)
        if hit is None:
            chosen = choose_forward(self, call, lambda: self.device_arch(device))
            hit = self.choices[key] = (chosen.spec, self.handle(chosen, call, lambda: self.device_arch(device)))
        return hit

    def backward(self, call: AttentionCall, device: int, deterministic: bool, dbias: bool,
                 scheme: str | None = None) -> tuple[str, dict[str, dict[str, Any]], dict[str, Any]]:
        """The backward's scheme, specs and handles for a call (cached per call shape): what
        :func:`choose_backward` chose."""
        key = self._call_key(call, device, "bwd", deterministic, dbias, scheme, _fact_key(call))
        hit = self.choices.get(key)
        if hit is None:
            chosen = choose_backward(self, call, lambda: self.device_arch(device), deterministic=deterministic,
                                     dbias=dbias, scheme=scheme)
            hit = self.choices[key] = (chosen.mode, {role: k.spec for role, k in chosen.kernels.items()},
                                       {role: self.handle(k, call, lambda: self.device_arch(device))
                                        for role, k in chosen.kernels.items()})
        return hit

    def handle(self, chosen: KernelChoice, call: AttentionCall, arch: Callable[[], str] | None = None) -> Any:
        """The library's handle for a chosen kernel (the library caches it by its parameters).

        Raises UnsupportedError when the images lack it because no build compiles it for the call
        on ``arch`` (:func:`.family.wide_refusal`), else KernelNotFound naming what is missing."""
        try:
            return self.lib.kernel(chosen.kernel, **chosen.params)
        except KernelNotFound as e:
            name = chosen.kernel
            why = refusal(call, chosen, arch)
            if why is not None:
                raise UnsupportedError(why) from None
            raise KernelNotFound(
                f"attention ({call.describe()}) needs {name} with {_show(chosen.spec)}, which these images lack "
                f"(or use a supported combination): {e}") from None


class Route(NamedTuple):
    """Which kernel plays a part of a call, and why; ``reason`` is "" where nothing was to choose
    (no other kernel serves the spec here)."""

    kernel: str
    reason: str


def forward_kernel(ks: LibraryKernels, call: AttentionCall, spec: dict[str, Any],
                   arch: str | Callable[[], str]) -> Route:
    """(kernel name, reason): which forward kernel runs ``spec`` on ``arch`` (a callable is asked
    only when the images hold a per-architecture forward for the spec; the reason is "" then).

    ``attn_fwd`` unless the images hold the arch's own forward (:data:`ARCH_FORWARDS`) for this
    spec; then that one, unless a ``tuning["attn_fwd_kernel"]`` rule names another kernel the
    images hold for the spec.
    """
    return _arch_kernel(ks, call, spec, arch, FWD, ARCH_FORWARDS, KERNEL_RULES, "forward")


def backward_kernel(ks: LibraryKernels, call: AttentionCall, role: str, spec: dict[str, Any],
                    arch: str | Callable[[], str]) -> Route:
    """(kernel name, reason): which kernel plays ``role`` (a portable backward kernel's name, e.g.
    ``attn_bwd_dkdv``) of a backward for ``spec`` on ``arch``, as :func:`forward_kernel` does for
    the forward: the arch's own kernel (:data:`ARCH_BACKWARDS`) where the images hold it for this
    spec, unless a rule of the role's table (``tuning["attn_bwd_dkdv_kernel"]``,
    ``tuning["attn_bwd_dq_kernel"]``) names the portable one (and the images hold it). Roles
    without a per-architecture kernel keep the portable kernel. The atomic scheme's dK/dV
    (``DQ_ATOMIC=1``) is chosen the same way: the Gluon one where the images hold its spec.

    The kernel so chosen gives way to its aligned sibling (:data:`ALIGNED_SIBLINGS`) where
    :meth:`LibraryKernels.aligned_sibling` allows (the reason then ends with
    :data:`ALIGNED_REASON`): rules name the family, the call's alignment picks its member."""
    if role not in BACKWARD_KERNEL_RULES:
        return Route(role, "")
    owns = {a: kernels[role] for a, kernels in ARCH_BACKWARDS.items() if role in kernels}
    table, what = BACKWARD_KERNEL_RULES[role]
    name, why = _arch_kernel(ks, call, spec, arch, role, owns, table, what)
    sibling = ks.aligned_sibling(name, spec, call, needed_args(call, spec))
    if sibling is not None:
        return Route(sibling, f"{why}; {ALIGNED_REASON}" if why else ALIGNED_REASON)
    return Route(name, why)


def _arch_kernel(ks: LibraryKernels, call: AttentionCall, spec: dict[str, Any], arch: str | Callable[[], str],
                 portable: str, owns: Mapping[str, str], table: str, what: str) -> Route:
    needs = needed_args(call, spec)
    candidates = [name for name in dict.fromkeys(owns.values()) if ks.available(name, spec, needs)]
    if not candidates:
        return Route(portable, "")  # nothing to choose
    if callable(arch):
        arch = arch()
    own = owns.get(arch)
    if own not in candidates:
        return Route(portable, f"the portable {what} ({arch} has no per-architecture {what} for this spec here)")
    choice = select_kernel(ks.tuning.get(table), spec=spec, seqlen_q=call.seqlen_q, seqlen_k=call.seqlen_k,
                           arch=arch, table=table)
    if choice is not None:
        name = choice.rule["kernel"]
        if name == portable and not ks.available(portable, spec, needs):
            return Route(own, f"{choice.reason} names {name!r}, which these images lack for this spec; {own} runs")
        if name == portable or name == own:
            return Route(name, choice.reason)
        return Route(own, f"{choice.reason} names {name!r}, which does not serve this spec on {arch}; {own} runs")
    return Route(own, f"untuned (no rule of tuning[{table!r}] matches; heuristic: {arch}'s own {what}, preferred "
                      "where the images hold it)")


@dataclass(frozen=True)
class KernelChoice:
    """One kernel of a call as the dispatch chose it: what :class:`LibraryKernels` launches and
    :func:`aotriton_rt.ops.attention.explain` prints.

    ``role``: the part it plays, the portable kernel's name (``attn_bwd_dkdv`` for sm90's dK/dV
    too); ``kernel`` and ``reason``: which kernel plays it and why (:class:`Route`); ``spec``: its
    catalog spec; ``config``: what the tuning rules of the kernel's family (:func:`family_of`) ask;
    ``params``: what the library is asked for, the spec and, where ``config`` names a config
    other than 0 that the images hold on the arch, that config's constexprs, warps and stages
    (otherwise the lowest config built runs).
    """

    role: str
    kernel: str
    spec: dict[str, Any]
    reason: str
    config: Choice
    params: dict[str, Any]


@dataclass(frozen=True)
class BackwardChoice:
    """A backward as the dispatch chose it: the scheme (``"split"`` or ``"atomic"``) and why, the
    spec its ``tuning["attn_bwd_mode"]`` rules are matched against (:func:`mode_spec`), and its
    kernels by role, in launch order."""

    mode: str
    reason: str
    mode_spec: dict[str, Any]
    kernels: dict[str, KernelChoice]


def _resolved(arch: str | Callable[[], str]) -> str:
    return arch() if callable(arch) else arch


def choose_kernel(ks: LibraryKernels, call: AttentionCall, role: str, spec: dict[str, Any],
                  arch: str | Callable[[], str]) -> KernelChoice:
    """The kernel playing ``role`` (``attn_fwd`` or a backward kernel's portable name) for ``spec``
    on ``arch``, and its config: :func:`forward_kernel` or :func:`backward_kernel`, then the
    config rules of its family (an aligned sibling's configs follow its family's). A callable
    ``arch`` is asked only where a rule names an arch or a tuned config must be found."""
    route = forward_kernel(ks, call, spec, arch) if role == FWD else backward_kernel(ks, call, role, spec, arch)
    config, params = tuned_config(ks, call, family_of(route.kernel), route.kernel, spec, arch)
    return KernelChoice(role, route.kernel, dict(spec), route.reason, config, params)


def tuned_config(ks: LibraryKernels, call: AttentionCall, family: str, kernel: str, spec: dict[str, Any],
                 arch: str | Callable[[], str]) -> tuple[Choice, dict[str, Any]]:
    """What the tuning rules of ``family`` ask for ``kernel``/``spec`` in this call, and the
    parameters the library is asked for: the spec, plus that config's constexprs, warps and stages
    where it is not 0 and the images hold it on ``arch`` (otherwise the lowest config built runs)."""
    rules = ks.tuning.get(family)
    config = explain_config(rules, kernel=family, spec=spec, seqlen_q=call.seqlen_q, seqlen_k=call.seqlen_k,
                            arch=arch) if rules else Choice(family, 0)
    params = dict(spec)
    if config.config:
        params.update(config_params(ks.lib.variants_of(kernel), kernel, spec, config.config, _resolved(arch)))
    return config, params


def choose_forward(ks: LibraryKernels, call: AttentionCall, arch: str | Callable[[], str]) -> KernelChoice:
    """Every decision of a forward call on ``arch``: the spec (:func:`forward_params`), the kernel
    and its config (:func:`choose_kernel`)."""
    return choose_kernel(ks, call, FWD, forward_params(call, ks.available), arch)


def choose_backward(ks: LibraryKernels, call: AttentionCall, arch: str | Callable[[], str], *,
                    deterministic: bool = False, dbias: bool = True, scheme: str | None = None) -> BackwardChoice:
    """Every decision of a backward call on ``arch``: the scheme (``scheme`` when given; else a
    ``tuning["attn_bwd_mode"]`` rule, never asked by a deterministic call; else the split one),
    the specs the images hold for it (:func:`backward_params`, which falls back to the scheme they
    hold), and each kernel with its config (:func:`choose_kernel`)."""
    asked = mode_spec(call, ks.available, dbias=dbias)
    mode, reason = scheme, f"asked for (scheme={scheme!r})"
    if scheme is None:
        rules = ks.tuning.get(MODE_RULES)
        reason = (f"untuned (no rule of tuning[{MODE_RULES!r}] matches; heuristic: the deterministic split scheme, "
                  "bit-reproducible)")
        if deterministic:
            reason = f"deterministic=True (the atomic scheme is not reproducible; tuning[{MODE_RULES!r}] is not asked)"
        elif rules:
            choice = explain_config(rules, kernel=MODE_RULES, spec=asked, seqlen_q=call.seqlen_q,
                                    seqlen_k=call.seqlen_k, arch=arch)
            if choice.rule is not None:
                mode, reason = choice.rule["mode"], choice.reason
    got, specs = backward_params(call, role_available(ks, arch), deterministic=deterministic, dbias=dbias, mode=mode)
    if mode is not None and got != mode:
        reason += f"; the images lack the {mode} kernels, so {got} runs"
    elif mode is None and got == "atomic":
        reason = "the images hold only the atomic-dQ kernels"
    return BackwardChoice(got, reason, asked, {role: choose_kernel(ks, call, role, spec, arch)
                                               for role, spec in specs.items()})


def refusal(call: AttentionCall, chosen: KernelChoice, arch: str | Callable[[], str] | None) -> str | None:
    """Why no images can hold ``chosen`` for ``call`` on ``arch`` (:func:`.family.wide_refusal`),
    or None. A callable ``arch`` is asked only for a spec on the widest bucket; None, or one that
    finds no device (e.g. JAX lowering for a named arch), gives None: the caller's
    KernelNotFound stands."""
    if arch is None or WIDE_HEAD_DIM not in (chosen.spec.get("HEAD_DIM"), chosen.spec.get("HEAD_DIM_V")):
        return None
    if callable(arch):
        try:
            arch = arch()
        except DriverError:
            return None
    return wide_refusal(call, chosen.spec, arch, chosen.role != FWD)


def _show(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def config_params(variants: Sequence[Any], name: str, spec: Mapping[str, Any], index: int,
                  arch: str) -> dict[str, Any]:
    """Parameters selecting config ``index`` of ``name``/``spec`` on ``arch``; {} (config 0)
    when that config was not built."""
    for v in variants:
        if v.kernel == name and v.config.index == index and v.target.arch == arch and \
                all(v.spec.get(k) == val for k, val in spec.items()):
            return {**v.config.constexprs, "num_warps": v.config.num_warps, "num_stages": v.config.num_stages}
    return {}


def _available(lib: Any, name: str, params: Mapping[str, Any]) -> bool:
    from ...select import match

    # Only this kernel's variants (one shard per target): a full image set holds thousands of others.
    return bool(match(lib.variants_of(name), name, params).accepted)


def _takes(lib: Any, name: str, params: Mapping[str, Any], args: Sequence[str]) -> bool:
    from ...select import match

    found = match(lib.variants_of(name), name, params).accepted
    return bool(found) and all(set(args) <= {a.name for a in v.args} for v in found)


def kernels_of(library: Any) -> LibraryKernels:
    """The attention state of ``library`` (default: the default library), made on first use."""
    from ...library import operator_state

    return operator_state(library if library is not None else _default_library(), "attention", LibraryKernels)
