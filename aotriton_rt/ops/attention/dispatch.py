"""Step 2a of a call: which kernels run it. Pure functions of the call's facts and of what the
images hold, and the per-library cache of kernel handles.

:func:`forward_params` / :func:`backward_params` name the catalog variants a call needs;
:func:`choose_forward` / :func:`choose_backward` take every decision of a call (spec, kernel,
tuning config, backward scheme) into one record that says what was chosen and why
(:class:`KernelChoice`, :class:`BackwardChoice`): :class:`LibraryKernels` launches from it and
:func:`aotriton_rt.ops.attention.explain` prints it. :class:`LibraryKernels` turns the choices
into handles of one :class:`aotriton_rt.Library` and explains what is missing.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ...errors import KernelNotFound, UnsupportedError
from ...tuning import (
    DKDV_KERNEL_RULES,
    DQ_KERNEL_RULES,
    KERNEL_RULES,
    MODE_RULES,
    Choice,
    explain_config,
    select_kernel,
    seqlen_bin,
)

# Mirrors builder/kernels/attention.py (the runtime never imports the builder; a test keeps the
# two equal): the head dims the kernels are compiled for, and the unequal q·k / v pairs.
HEAD_DIM_BUCKETS = (16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)
UNEQUAL_HEAD_DIMS = ((192, 128),)
DTYPES = ("fp16", "bf16", "fp32")

FWD = "attn_fwd"
PRE = "attn_bwd_preprocess"
DKDV = "attn_bwd_dkdv"
DQ = "attn_bwd_dq"
CONVERT = "attn_bwd_dq_convert"
#: Per-architecture forwards: same arguments, mask modes, LSE and results as ``attn_fwd`` for the
#: specs they are compiled for (builder/kernels/attention_sm90.py: fp16/bf16, head dim 64/128, no
#: bias, dropout or varlen). Preferred on their arch when the images hold the call's spec, unless a
#: ``tuning["attn_fwd_kernel"]`` rule names another kernel.
ARCH_FORWARDS = {"sm90": "attn_fwd_sm90"}
#: Per-architecture kernels of the backward, by the portable kernel they stand in for: same
#: arguments, grid and results (builder/kernels/attention_bwd_sm90.py and attention_bwd_dq_sm90.py:
#: the dK/dV and dQ kernels for fp16/bf16, head dim 64/128, no bias, dropout or varlen; the dK/dV
#: one also with ``DQ_ATOMIC=1``, the atomic scheme's). Each is preferred on its arch when the
#: images hold the call's spec, unless a rule of its role's table (:data:`BACKWARD_KERNEL_RULES`)
#: names another kernel. A role counts as held when either kernel is (:func:`role_available`).
ARCH_BACKWARDS = {"sm90": {DKDV: "attn_bwd_dkdv_sm90", DQ: "attn_bwd_dq_sm90"}}
#: Aligned-length siblings, by the kernel they belong to: the same source, arguments, grid and
#: configs, compiled with some of :data:`ALIGNED_FACTS` declared divisible beyond the family's
#: promise (builder/kernels/attention_bwd_sm90.py: ``attn_bwd_dkdv_sm90_a16``, both lengths and the
#: LSE/Delta strides multiples of 16, which shortens the Gluon dK/dV's unmasked tile). An
#: implementation detail of its family, never a name rules use: where the family's kernel is chosen
#: (by the heuristic or by a rule naming it), the sibling runs instead when the images hold it for
#: the spec, the catalog declares it like the family but for these facts, and the call's values
#: meet every divisibility it declares (:meth:`LibraryKernels.aligned_sibling`); config rules of
#: the family (``tuning["attn_bwd_dkdv_sm90"]``) choose its config.
ALIGNED_SIBLINGS = {"attn_bwd_dkdv_sm90": "attn_bwd_dkdv_sm90_a16"}
#: The call facts an aligned sibling may declare divisible beyond its family (values from
#: :func:`aligned_facts`).
ALIGNED_FACTS = ("seqlen_q", "seqlen_k", "stride_lz", "stride_lh")
#: What explain says of an aligned sibling that runs.
ALIGNED_REASON = "aligned-length variant (seqlen and LSE strides multiples of 16)"
#: Per role of the split backward: the tuning table whose rules name the kernel playing it, and
#: the role in words (explain's reasons).
BACKWARD_KERNEL_RULES = {DKDV: (DKDV_KERNEL_RULES, "dK/dV kernel"), DQ: (DQ_KERNEL_RULES, "dQ kernel")}
#: The run-time argument that aligns a mask-mode-1 band: 0 top-left, 1 bottom-right (mode 2 is
#: bottom-right whatever it says). Images built before it existed compiled mode 1 as top-left
#: only, so a mode-1 variant serves a bottom-right call only if its arguments include it.
ALIGN_ARG = "causal_align"


@dataclass(frozen=True)
class AttentionCall:
    """The facts of one attention call that decide which kernels run.

    ``causal`` is the call's mask (0 none, 1 band aligned top-left, 2 bottom-right);
    ``causal_equivalent`` says the two alignments coincide for this call (equal lengths).
    Kernels of mask mode 1 take the alignment as a run-time argument (:data:`ALIGN_ARG`), so
    they serve either alignment; mode 2 serves bottom-right calls, and top-left ones of equal
    lengths. ``dropout`` is 0 off, 1 on, 2 on and the mask returned.
    """

    dtype: str
    head_dim: int
    head_dim_v: int
    causal: int = 0
    causal_equivalent: bool = False
    bias: bool = False
    dropout: int = 0
    varlen: bool = False
    seqlen_q: int = 0
    seqlen_k: int = 0
    #: (stride_lz, stride_lh) of the LSE and Delta arrays the backward's kernels read (the
    #: operator's contiguous ``(B, Hq, Sq)``: ``(Hq·Sq, Sq)``); None: unknown, so no aligned sibling.
    lse_strides: tuple[int, int] | None = None

    def describe(self) -> str:
        """The combination in words, for error messages."""
        parts = [self.dtype, f"head dim {self.head_dim}" + (f"/{self.head_dim_v}" if self.head_dim_v != self.head_dim
                                                           else "")]
        parts.append({0: "no mask", 1: "causal/window top-left", 2: "causal/window bottom-right"}[self.causal])
        if self.bias:
            parts.append("bias")
        if self.dropout:
            parts.append("dropout" + (" with mask" if self.dropout == 2 else ""))
        if self.varlen:
            parts.append("varlen")
        return ", ".join(parts)


#: ``available(kernel, params, args)``: whether the images hold such a variant, every matching
#: one of which takes the run-time arguments ``args`` (a tuple, usually empty; ``(ALIGN_ARG,)``
#: when a mode-1 kernel must align its band bottom-right).
Available = Callable[[str, Mapping[str, Any], tuple[str, ...]], bool]


def _everything(name: str, params: Mapping[str, Any], args: Sequence[str] = ()) -> bool:
    return True


def bucket(head_dim: int) -> int:
    """The smallest compiled head-dim bucket holding ``head_dim`` (1..256)."""
    for b in HEAD_DIM_BUCKETS:
        if b >= head_dim:
            return b
    raise UnsupportedError(f"head dim {head_dim} exceeds the largest supported head dim {HEAD_DIM_BUCKETS[-1]}; "
                           f"supported: 1..{HEAD_DIM_BUCKETS[-1]} (compiled buckets "
                           f"{', '.join(map(str, HEAD_DIM_BUCKETS))}; others are zero-padded)")


def head_dim_buckets(head_dim: int, head_dim_v: int) -> list[tuple[int, int]]:
    """Compiled (q·k, v) head-dim pairs able to run these head dims, best first.

    Equal dims use their bucket; an unequal pair runs as such when it is compiled
    (``UNEQUAL_HEAD_DIMS``), and otherwise on the larger bucket for both (zero padding
    changes neither the scores nor the kept output columns). After those come the wider
    equal buckets, narrowest first: images that lack a bucket (the default set has no 80 or
    96) run the call zero-padded on the next one they hold (80 and 96 on 128).
    """
    bq, bv = bucket(head_dim), bucket(head_dim_v)
    wide = max(bq, bv)
    first = [(bq, bv), (wide, wide)] if (bq, bv) in UNEQUAL_HEAD_DIMS else [(wide, wide)]
    return first + [(b, b) for b in HEAD_DIM_BUCKETS if b > wide]


def needed_args(call: AttentionCall, causal: int) -> tuple[str, ...]:
    """The run-time arguments a variant of mask mode ``causal`` must take to serve ``call``:
    :data:`ALIGN_ARG` when a mode-1 band must be aligned bottom-right, else none."""
    return (ALIGN_ARG,) if causal == 1 and call.causal == 2 and not call.causal_equivalent else ()


def _first(name: str, candidates: list[dict], available: Available, call: AttentionCall) -> dict:
    # The first candidate the images hold; if none, the first, so that the library's
    # KernelNotFound explains what is missing.
    for c in candidates:
        if available(name, c, needed_args(call, c["CAUSAL"])):
            return c
    return candidates[0]


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
    candidates = [{"dtype": call.dtype, "HEAD_DIM": dk, "HEAD_DIM_V": dv, "CAUSAL": c, "BIAS": int(call.bias),
                   "DROPOUT": call.dropout, "VARLEN": int(call.varlen)}
                  for dk, dv in head_dim_buckets(call.head_dim, call.head_dim_v) for c in _causal_modes(call)]
    return _first(FWD, candidates, available, call)


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

    def scheme(atomic: int, dk: int, dv: int, causal: int) -> dict[str, dict[str, Any]]:
        common = {"dtype": call.dtype, "HEAD_DIM": dk, "HEAD_DIM_V": dv}
        masks = {"CAUSAL": causal, "DROPOUT": dropout, "VARLEN": int(call.varlen)}
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
    for atomic in order:
        if atomic and deterministic:
            continue
        for dk, dv, c in shapes:
            kernels = scheme(atomic, dk, dv, c)
            if all(available(n, p, needed_args(call, p.get("CAUSAL", 0))) for n, p in kernels.items()):
                return ("atomic" if atomic else "split"), kernels
    return "split", scheme(0, *shapes[0])


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


def family_of(name: str) -> str:
    """The kernel whose tuning rules ``name`` follows: its family for an aligned sibling
    (:data:`ALIGNED_SIBLINGS`), else ``name`` itself."""
    for family, sibling in ALIGNED_SIBLINGS.items():
        if name == sibling:
            return family
    return name


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


#: Plans kept per library; the least recently used goes first.
PLAN_CACHE_SIZE = 1024


class PlanCache:
    """A bounded, thread-safe LRU of plans by call signature.

    Lookups take no lock (``OrderedDict`` operations are atomic under the GIL); inserts and
    evictions do. ``builds`` counts the plans made since the last :meth:`clear`, for tests and
    benchmarks.
    """

    def __init__(self, capacity: int = PLAN_CACHE_SIZE) -> None:
        self.capacity = capacity
        self.builds = 0
        self._plans: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key: tuple) -> Any:
        plan = self._plans.get(key)
        if plan is not None:
            try:
                self._plans.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile
                pass
        return plan

    def put(self, key: tuple, plan: Any) -> None:
        with self._lock:
            self.builds += 1
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)

    def clear(self) -> None:
        """Forget every plan (and reset ``builds``)."""
        with self._lock:
            self._plans.clear()
            self.builds = 0


class LibraryKernels:
    """Per-library caches: which variants exist, the tuning table, handles per call shape."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.available_cache: dict[tuple, bool] = {}
        self.choices: dict[tuple, Any] = {}  # call shape -> (spec, handle) / (mode, specs, handles)
        self.plans = PlanCache()  # call signature -> Plan (see plan.py)
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
                call.dropout, call.varlen, seqlen_bin(call.seqlen_q) if tuned else 0,
                seqlen_bin(call.seqlen_k) if tuned else 0, device, *extra)

    def forward(self, call: AttentionCall, device: int) -> tuple[dict[str, Any], Any]:
        """The forward's spec and kernel handle for a call (cached per call shape): what
        :func:`choose_forward` chose."""
        key = self._call_key(call, device)
        hit = self.choices.get(key)
        if hit is None:
            chosen = choose_forward(self, call, lambda: self.device_arch(device))
            hit = self.choices[key] = (chosen.spec, self.handle(chosen, call))
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
                                       {role: self.handle(k, call) for role, k in chosen.kernels.items()})
        return hit

    def handle(self, chosen: KernelChoice, call: AttentionCall) -> Any:
        """The library's handle for a chosen kernel (the library caches it by its parameters)."""
        try:
            return self.lib.kernel(chosen.kernel, **chosen.params)
        except KernelNotFound as e:
            name = chosen.kernel
            raise KernelNotFound(
                f"attention ({call.describe()}) needs {name} with {_show(chosen.spec)}, which these images lack; "
                f"build it (`python -m builder build --set full --kernels {name}`) or use a supported "
                f"combination. {e}") from None


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
    sibling = ks.aligned_sibling(name, spec, call, needed_args(call, spec.get("CAUSAL", 0)))
    if sibling is not None:
        return Route(sibling, f"{why}; {ALIGNED_REASON}" if why else ALIGNED_REASON)
    return Route(name, why)


def _arch_kernel(ks: LibraryKernels, call: AttentionCall, spec: dict[str, Any], arch: str | Callable[[], str],
                 portable: str, owns: Mapping[str, str], table: str, what: str) -> Route:
    needs = needed_args(call, spec.get("CAUSAL", 0))
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
    family = family_of(route.kernel)
    rules = ks.tuning.get(family)
    config = explain_config(rules, kernel=family, spec=spec, seqlen_q=call.seqlen_q, seqlen_k=call.seqlen_k,
                            arch=arch) if rules else Choice(family, 0)
    params = dict(spec)
    if config.config:
        params.update(config_params(ks.lib.variants_of(route.kernel), route.kernel, spec, config.config,
                                    _resolved(arch)))
    return KernelChoice(role, route.kernel, dict(spec), route.reason, config, params)


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


def target_arch(lib: Any, device: int) -> str:
    """The built arch whose images run on ``device`` (from the catalog indexes: no shard is read)."""
    from ... import arch as _arch

    built = lib.targets()
    if len(built) == 1:
        # Images of one arch: the device must run that arch, or the launch will say why.
        return built[0][1]
    driver = lib.driver
    raw = _arch.normalize(driver.backend, driver.device_arch(max(device, 0)))
    return _arch.pick_target(driver.backend, raw, sorted(a for b, a in built if b == driver.backend))


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
