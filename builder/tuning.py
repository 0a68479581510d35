"""The tuning database: timings measured on a GPU, the decisions drawn from them, and their folding
into a catalog's ``tuning`` rules.

``python -m builder tune`` (:mod:`builder.tune`) measures; this module owns the file format and
every decision, as pure functions (tested on the CPU with synthetic timings):

- an **entry** is one (kernel, spec, length bin) with the median time of every built config;
- :func:`winner` picks a config per entry: the lowest config index whose time is within
  ``tolerance`` of the fastest (exact ties, and differences inside the noise, go to the lower
  index: config 0 is the kernel's documented heuristic, so it is kept unless beaten clearly);
- :func:`decide` turns the entries into rules: per (kernel, spec), consecutive bins with the same
  winner become one ``[low, high]`` range of the length that sets the kernel's grid
  (``LENGTH_AXIS``), the first open below and the last open above; where an arch's own forward
  (``attn_fwd_sm90``) and the portable ``attn_fwd`` were both measured for a spec and bin, the
  faster one's winning time decides which kernel serves the bin (``tuning["attn_fwd_kernel"]``
  rules, ranges made the same way; the arch's own is kept unless the portable one is faster by
  more than the tolerance);
- an entry of kernel ``attn_bwd`` (:data:`BACKWARD`) times the *whole* backward of a call (its
  spec: :func:`aotriton_rt.ops.attention.dispatch.mode_spec`) once per contender, each a
  (scheme, dK/dV kernel, dQ kernel) combination the images hold, the untuned default first:
  the kernels share the L2 and the choice is about their sum. Its winners
  (:func:`backward_decisions`) become ``attn_bwd_mode`` rules (where both schemes were timed) and
  ``attn_bwd_dkdv_kernel`` / ``attn_bwd_dq_kernel`` rules (where a part's kernel varied), ranges
  made the same way;
- :func:`dumps` writes the database with sorted keys and rounded times, so the same measurements
  give the same bytes; where and on what it was measured (``machine``) is kept apart from the
  decisions (``rules``), and no date is recorded;
- :func:`fold` gives the catalog rules for a build: a rule is kept only when the build holds its
  spec and config on its arch *with the parameters that were measured* (``expect``); a config
  table that changed since the measurement drops the rule with a reason instead of pointing it
  at another config. A rule measured on mask mode 2 (bottom-right causal) also applies to the
  build's mode-1 variants of the same spec, unless the database measured mode 1 itself: mode 1
  is the same kernel with the band's alignment a run-time argument (one multiply), and the
  default set compiles mode 1 only (:func:`mode_one_twin`). A decision rule (which kernel, which
  scheme: :data:`DECISIONS`) is kept where the build can make that choice for its spec
  (:func:`choice_built`), mode-1 twins alike.

An entry may name who measured it in ``source`` where that was not ``builder tune`` on the
database's machine (e.g. a benchmark whose table docs/performance.md keeps); its rules' ``source``
then begins with it, and ``--recompute`` keeps it.

A database for a target checked in as ``builder/tuning_db/<arch>.json`` is folded into every build
of that target; ``python -m builder build --tuning-db FILE`` names others (docs/tuning.md).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotriton_rt.ops.attention.family import (
    ARCH_BACKWARDS,
    ARCH_FORWARDS,
    BACKWARD_KERNEL_RULES,
    DKDV,
    DKDV_KERNEL_RULES,
    DQ,
    DQ_KERNEL_RULES,
    FWD,
    KERNEL_RULES,
    MODE_RULES,
)
from aotriton_rt.tuning import in_range, select_kernel

SCHEMA = "aotriton-rt-tuning"
SCHEMA_VERSION = 1
_PORTABLE_AXIS = {FWD: "seqlen_q", DQ: "seqlen_q", DKDV: "seqlen_k"}
#: The length whose bins a kernel's rules are keyed on: the one that sizes its grid. An arch's own
#: kernel (``ARCH_FORWARDS``, ``ARCH_BACKWARDS``) takes the axis of the kernel it stands in for, so
#: that a family entry is all a new one needs here.
LENGTH_AXIS = {**_PORTABLE_AXIS, **{own: _PORTABLE_AXIS[FWD] for own in ARCH_FORWARDS.values()},
               **{own: _PORTABLE_AXIS[role] for kernels in ARCH_BACKWARDS.values() for role, own in kernels.items()},
               KERNEL_RULES: "seqlen_q", DKDV_KERNEL_RULES: "seqlen_k", DQ_KERNEL_RULES: "seqlen_q",
               MODE_RULES: "seqlen_k"}
#: Per arch forward (the runtime's ``ARCH_FORWARDS``), the portable kernel it stands in for;
#: their choices are rules under ``KERNEL_RULES``.
STANDS_IN_FOR = {own: FWD for own in ARCH_FORWARDS.values()}
#: The entries' kernel name for a whole attention backward, timed once per contender: a
#: (scheme, dK/dV kernel, dQ kernel) combination whose ``params`` say ``{"scheme": "split",
#: "attn_bwd_dkdv": "attn_bwd_dkdv_sm90", ...}`` (role -> kernel that ran it); the entry's spec
#: is the call's (:func:`aotriton_rt.ops.attention.dispatch.mode_spec`). Its decisions are the
#: ``attn_bwd_mode``, ``attn_bwd_dkdv_kernel`` and ``attn_bwd_dq_kernel`` rules.
BACKWARD = "attn_bwd"
#: Rule tables that choose which kernel plays a part, by table: (the portable kernel, arch -> the
#: arch's own kernel standing in for it). A rule is folded where the build holds both for its spec.
KERNEL_CHOICES = {
    KERNEL_RULES: (FWD, dict(ARCH_FORWARDS)),
    **{table: (role, {a: own[role] for a, own in ARCH_BACKWARDS.items() if role in own})
       for role, (table, _) in BACKWARD_KERNEL_RULES.items()},
}
#: Every rule table whose rules decide a kernel or a scheme rather than a config (no ``expect``).
DECISIONS = (*KERNEL_CHOICES, MODE_RULES)
#: Checked-in databases, one per arch: ``builder/tuning_db/<arch>.json``.
CHECKED_IN = Path(__file__).resolve().parent / "tuning_db"
DEFAULT_TOLERANCE = 0.01
_MAX_BYTES = 16 << 20
_MAX_ENTRIES = 100_000
MAX_SOURCE = 200


class TuningError(ValueError):
    """A malformed tuning database or an impossible request (names the file and the entry)."""


@dataclass(frozen=True)
class Timing:
    """One config of one entry: its index, its parameters (constexprs, warps, stages) and its
    median time in microseconds over the rounds, with the rounds' min and max (None: it failed
    or computed a wrong result, and ``note`` says which)."""

    index: int
    params: Mapping[str, Any]
    us: float | None
    spread: tuple[float, float] | None = None
    note: str = ""

    def to_json(self) -> dict:
        out: dict[str, Any] = {"index": self.index, "params": dict(self.params), "us": _round(self.us)}
        if self.spread is not None:
            out["spread"] = [_round(self.spread[0]), _round(self.spread[1])]
        if self.note:
            out["note"] = self.note
        return out


@dataclass(frozen=True)
class Entry:
    """One (kernel, spec, bin): the shape measured and every config's timing."""

    kernel: str
    spec: Mapping[str, Any]
    bin: int
    shape: Mapping[str, int]
    timings: Sequence[Timing] = field(default_factory=tuple)
    #: Who measured it, where not ``python -m builder tune`` on the database's ``machine`` with its
    #: ``method`` (e.g. a benchmark whose table docs/performance.md keeps); its rules' ``source`` says so.
    source: str = ""

    def to_json(self, tolerance: float) -> dict:
        best = winner(self.timings, tolerance)
        out = {"kernel": self.kernel, "spec": dict(self.spec), "bin": self.bin, "shape": dict(self.shape),
               "winner": None if best is None else best.index, "configs": [t.to_json() for t in self.timings]}
        if self.source:
            out["source"] = self.source
        return out


def _round(us: float | None) -> float | None:
    # 0.1 us: far below run-to-run noise, and what keeps the file's bytes stable.
    return None if us is None else round(float(us), 1)


def winner(timings: Iterable[Timing], tolerance: float = DEFAULT_TOLERANCE) -> Timing | None:
    """The config to run: the lowest index whose time is within ``tolerance`` (a fraction) of the
    fastest; None when no config has a time. Times compare after rounding to 0.1 us, as written."""
    timed = [t for t in timings if t.us is not None]
    if not timed:
        return None
    best = min(_round(t.us) for t in timed)
    return min((t for t in timed if _round(t.us) <= best * (1.0 + tolerance)), key=lambda t: t.index)


#: Spec axes added after tuning databases were first measured, newest first.
LATE_AXES = ("ALIBI", "SOFTCAP")


def _measured_specs(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The specs a database rule may name for a built variant: its own and, while its late axes
    (:data:`LATE_AXES`, newest first) are 0, the spec without them (databases measured before the
    axes existed: before ``ALIBI``, or before ``SOFTCAP`` and ``ALIBI``)."""
    specs, dropped = [spec], set()
    for axis in LATE_AXES:
        if spec.get(axis) != 0:
            break
        dropped.add(axis)
        specs.append({k: v for k, v in spec.items() if k not in dropped})
    return specs


def _spec_key(spec: Mapping[str, Any]) -> str:
    return json.dumps(dict(spec), sort_keys=True)


def decide(entries: Iterable[Entry], arch: str, source: str, tolerance: float = DEFAULT_TOLERANCE) -> dict[str, list]:
    """Catalog rules from measured entries (see the module docs); deterministic in its inputs.

    Each config rule: ``arch``, ``spec``, the kernel's length range, ``config``, ``source``, and
    ``expect`` (the winner's parameters, checked and dropped by :func:`fold`). Each decision rule
    (:data:`DECISIONS`: which kernel plays a part, which backward scheme): ``arch``, ``spec``, the
    range, ``kernel`` or ``mode``, ``source``.
    """
    groups: dict[tuple[str, str], list[tuple[int, Timing]]] = {}
    specs: dict[str, Mapping[str, Any]] = {}
    sources: dict[tuple[str, str, int], str] = {}
    backwards: list[Entry] = []
    for e in entries:
        if e.kernel == BACKWARD:
            backwards.append(e)
            continue
        best = winner(e.timings, tolerance)
        if best is None:
            continue
        key = _spec_key(e.spec)
        specs[key] = e.spec
        groups.setdefault((e.kernel, key), []).append((e.bin, best))
        sources[(e.kernel, key, e.bin)] = e.source or source
    rules: dict[str, list] = {}
    for (kernel, key), bins in sorted(groups.items()):
        axis = LENGTH_AXIS.get(kernel, "seqlen_q")
        bins.sort(key=lambda b: b[0])
        if len({b for b, _ in bins}) != len(bins):
            raise TuningError(f"{kernel} {key}: bin measured twice")
        for low, high, lo, hi, t in _runs(bins, lambda t: t.index):
            rules.setdefault(kernel, []).append({
                "arch": arch, "spec": dict(specs[key]), axis: [low, high], "config": t.index,
                "source": f"{sources[(kernel, key, lo)]}, measured at {axis} {lo}..{hi}"[:300],
                "expect": dict(t.params)})
    # (decision table, spec) -> per bin (bin, decision, what was compared, source).
    picks: dict[tuple[str, str], list[tuple[int, str, str, str]]] = {}
    # Which forward serves each bin where an arch's own forward and the portable one were both timed.
    for own, portable in sorted(STANDS_IN_FOR.items()):
        for (kernel, key), bins in sorted(groups.items()):
            if kernel != own:
                continue
            theirs = dict(groups.get((portable, key), []))
            for b, t in sorted(bins, key=lambda b: b[0]):
                other = theirs.get(b)
                if other is None:
                    continue
                faster = _round(other.us) * (1.0 + tolerance) < _round(t.us)
                picks.setdefault((KERNEL_RULES, key), []).append(
                    (b, portable if faster else own, f"{own} vs {portable}", sources[(kernel, key, b)]))
    # The backward's scheme and the kernel of each part, from whole backwards.
    for e in backwards:
        for table, spec, decision, what in backward_decisions(e, tolerance):
            key = _spec_key(spec)
            specs[key] = spec
            picks.setdefault((table, key), []).append((e.bin, decision, what, e.source or source))
    for (table, key), bins in sorted(picks.items()):
        bins.sort(key=lambda b: b[0])
        if len({b[0] for b in bins}) != len(bins):
            raise TuningError(f"{table} {key}: bin measured twice")
        axis = LENGTH_AXIS[table]
        field_name = "mode" if table == MODE_RULES else "kernel"
        for low, high, lo, hi, (decision, what, src) in _runs([(b, rest) for b, *rest in bins], lambda d: d[0]):
            rules.setdefault(table, []).append({
                "arch": arch, "spec": dict(specs[key]), axis: [low, high], field_name: decision,
                "source": f"{src}, {what} measured at {axis} {lo}..{hi}"[:300]})
    return rules


def backward_decisions(entry: Entry, tolerance: float = DEFAULT_TOLERANCE) -> list[tuple[str, dict, str, str]]:
    """The decisions one :data:`BACKWARD` entry (one bin) makes, as ``(table, rule spec, decision, what
    was compared)``:

    - ``attn_bwd_mode``, where both schemes were timed: the scheme of the fastest contender
      (:func:`winner` over all of them, so a tie keeps the lower index: the split scheme);
    - per scheme and per part whose kernel varied among that scheme's contenders
      (``attn_bwd_dkdv_kernel``, ``attn_bwd_dq_kernel``): the kernel of the scheme's fastest
      contender. The split scheme's kernels are decided even where the atomic scheme wins, since
      deterministic calls still run it. A dK/dV rule's spec carries the scheme's ``DQ_ATOMIC``.
    """
    timed = [t for t in entry.timings if t.us is not None]
    schemes = list(dict.fromkeys(str(t.params.get("scheme")) for t in timed))
    out: list[tuple[str, dict, str, str]] = []
    if len(schemes) > 1:
        best = winner(entry.timings, tolerance)
        out.append((MODE_RULES, dict(entry.spec), str(best.params.get("scheme")),
                    f"whole backward, {' vs '.join(schemes)}"))
    for scheme in schemes:
        theirs = [t for t in entry.timings if str(t.params.get("scheme")) == scheme]
        best = winner(theirs, tolerance)
        for role, (table, _) in sorted(BACKWARD_KERNEL_RULES.items()):
            names = list(dict.fromkeys(str(t.params[role]) for t in theirs if t.us is not None and role in t.params))
            if len(names) < 2 or role not in best.params:
                continue
            spec = {**entry.spec, "DQ_ATOMIC": int(scheme == "atomic")} if role == DKDV else dict(entry.spec)
            out.append((table, spec, str(best.params[role]), f"whole {scheme} backward, {' vs '.join(names)}"))
    return out


def _runs(bins: list[tuple[int, Any]], same: Any) -> list[tuple]:
    """Consecutive bins with the same decision as ``(low, high, first bin, last bin, decision)``:
    ranges from the first bin to the next run's first bin - 1, the first open below and the
    last open above."""
    runs: list[list] = []  # [first bin, last bin, decision]
    for b, d in bins:
        if runs and same(runs[-1][2]) == same(d):
            runs[-1][1] = b
        else:
            runs.append([b, b, d])
    return [(None if i == 0 else lo, None if i == len(runs) - 1 else runs[i + 1][0] - 1, lo, hi, d)
            for i, (lo, hi, d) in enumerate(runs)]


def database(entries: Sequence[Entry], *, arch: str, machine: Mapping[str, Any], method: Mapping[str, Any],
             tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """The database object :func:`dumps` writes: measurements, their machine and method, and the
    rules decided from them.

    Raises:
        TuningError: a rule decided from malformed entries (e.g. a whole backward whose params
            name no kernel) would not load in a catalog; it says which.
    """
    from aotriton_rt.errors import CatalogError
    from aotriton_rt.tuning import validate_table

    gpu = str(machine.get("gpu", "unknown GPU"))
    source = f"tuning database {arch} ({gpu})"
    ordered = sorted(entries, key=lambda e: (e.kernel, _spec_key(e.spec), e.bin))
    rules = decide(ordered, arch, source, tolerance)
    try:
        validate_table(rules, "the decided rules")
    except CatalogError as e:
        raise TuningError(str(e)) from None
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "arch": arch, "machine": dict(machine),
            "method": {**dict(method), "tolerance": tolerance},
            "entries": [e.to_json(tolerance) for e in ordered], "rules": rules}


def dumps(db: Mapping[str, Any]) -> bytes:
    """The file's bytes: sorted keys, two-space indent, a final newline."""
    return (json.dumps(db, sort_keys=True, indent=2) + "\n").encode()


def entries_of(db: Mapping[str, Any], where: str = "<memory>") -> list[Entry]:
    """The entries back from a loaded database (to decide again with another tolerance)."""
    out = []
    for i, e in enumerate(db.get("entries", [])):
        try:
            timings = tuple(Timing(int(t["index"]), dict(t["params"]), t["us"],
                                   tuple(t["spread"]) if t.get("spread") else None, t.get("note", ""))
                            for t in e["configs"])
            src = e.get("source", "")
            if not isinstance(src, str) or len(src) > MAX_SOURCE or not src.isprintable():
                raise TypeError(f"source must be a printable string of at most {MAX_SOURCE} characters")
            out.append(Entry(str(e["kernel"]), dict(e["spec"]), int(e["bin"]), dict(e["shape"]), timings, src))
        except (KeyError, TypeError, ValueError) as exc:
            raise TuningError(f"{where}: entries[{i}] is malformed ({type(exc).__name__}: {exc})") from None
    return out


def load(path: str | Path) -> dict:
    """Read and check a database file; the rules are validated as a catalog would validate them.

    Raises:
        TuningError: naming the file and what is wrong.
    """
    from aotriton_rt.errors import CatalogError
    from aotriton_rt.tuning import validate_table

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TuningError(f"{path}: cannot read the tuning database ({e.strerror or e})") from None
    if len(data) > _MAX_BYTES:
        raise TuningError(f"{path}: {len(data)} bytes; a tuning database is at most {_MAX_BYTES}")
    try:
        db = json.loads(data)
    except ValueError as e:
        raise TuningError(f"{path}: not JSON ({e})") from None
    if not isinstance(db, dict) or db.get("schema") != SCHEMA:
        raise TuningError(f"{path}: not a tuning database (schema must be {SCHEMA!r})")
    if db.get("schema_version") != SCHEMA_VERSION:
        raise TuningError(f"{path}: tuning database schema_version {db.get('schema_version')!r}; this builder "
                          f"reads {SCHEMA_VERSION}")
    if not isinstance(db.get("arch"), str) or not isinstance(db.get("rules"), dict):
        raise TuningError(f"{path}: needs an 'arch' string and a 'rules' object")
    if len(db.get("entries", [])) > _MAX_ENTRIES:
        raise TuningError(f"{path}: more than {_MAX_ENTRIES} entries")
    try:
        validate_table(db["rules"], str(path))
    except CatalogError as e:
        raise TuningError(str(e)) from None
    for kernel, rules in db["rules"].items():
        for i, rule in enumerate(rules):
            if kernel in DECISIONS and rule.get("arch") == db["arch"]:
                continue  # its kernel name or scheme was checked by validate_table
            if rule.get("arch") != db["arch"] or not isinstance(rule.get("expect"), dict) or "config" not in rule:
                raise TuningError(f"{path}: rules[{kernel!r}][{i}] needs arch {db['arch']!r}, a config and the "
                                  f"measured parameters ('expect')")
    return db


#: Said in a rule's ``source`` when it was measured on mask mode 2 and folded for mode 1.
MODE_ONE_NOTE = "; applied to CAUSAL=1 (the same kernel, aligned at run time)"


def mode_one_twin(rule: Mapping[str, Any]) -> dict | None:
    """The rule for mask mode 1 that a rule measured on mode 2 stands for, or None (not mode 2).

    Mode 1 compiles the same kernel as mode 2, but for ``diag = causal_align * (len_k - len_q)``
    in place of ``len_k - len_q`` (builder/kernels/attention.py ``_window``): the same code and
    registers, one run-time multiply, so mode 2's measurements rank mode 1's configs and kernels
    the same way."""
    spec = rule.get("spec")
    if not isinstance(spec, Mapping) or spec.get("CAUSAL") != 2:
        return None
    twin = {**rule, "spec": {**spec, "CAUSAL": 1}}
    if isinstance(rule.get("source"), str):
        twin["source"] = (rule["source"] + MODE_ONE_NOTE)[:300]
    return twin


def _with_mode_one_twins(kernel: str, rules: Sequence[Mapping[str, Any]]) -> list[tuple[int, dict, bool]]:
    """(index, rule, is a twin) for every rule, each mode-2 rule followed by its mode-1 twin
    unless the database holds rules of that kernel for the mode-1 spec itself."""
    measured = {_spec_key(r.get("spec", {})) for r in rules}
    out = []
    for i, rule in enumerate(rules):
        out.append((i, dict(rule), False))
        twin = mode_one_twin(rule)
        if twin is not None and _spec_key(twin["spec"]) not in measured:
            out.append((i, twin, True))
    return out


def checked_in(archs: Iterable[str], folder: Path = CHECKED_IN) -> list[Path]:
    """The checked-in databases of these archs that exist, in arch order."""
    return [folder / f"{a}.json" for a in sorted(set(archs)) if (folder / f"{a}.json").is_file()]


@functools.cache
def _checked_in_rules(arch: str) -> dict[str, list]:
    """The rules of the checked-in database of ``arch`` ({} where there is none)."""
    paths = checked_in({arch})
    return dict(load(paths[0])["rules"]) if paths else {}


def tuned_configs(family: str, first: int = 1, when: Callable[[Mapping[str, Any]], bool] | None = None
                  ) -> Callable[[Mapping[str, Any], Any], tuple[int, ...]]:
    """A ``KernelDecl.set_configs`` entry: the first ``first`` configs (#0 is what an untuned call
    runs) and every config that a rule of the checked-in database of the target's arch picks for
    kernel ``family`` at the spec (a mode-2 rule's pick also at mode 1, as :func:`fold` applies
    it), so a set built with it holds the configs the database dispatches and its rules fold;
    with ``when``, only for the specs it accepts (the first configs alone for the others).
    An index past the spec's configs (a database older than the config table) is dropped by the
    registry; :func:`fold` then notes the rule it cannot fold."""
    def keep(spec: Mapping[str, Any], target: Any) -> tuple[int, ...]:
        arch = getattr(target, "arch", None)
        if when is not None and not when(spec):
            return tuple(range(first))
        rules = _checked_in_rules(arch).get(family, []) if isinstance(arch, str) else []
        keys = {_spec_key(s) for s in _measured_specs(spec)}
        picks = {r["config"] for _, r, _ in _with_mode_one_twins(family, rules)
                 if r.get("arch") == arch and _spec_key(r.get("spec", {})) in keys}
        return tuple(sorted(set(range(first)) | picks))
    keep.from_database = True  # type: ignore[attr-defined]
    return keep


def choice_built(table: str, arch: Any, spec: Mapping[str, Any], specs: set[tuple[str, str, str]]) -> bool:
    """Whether a build holding ``specs`` ((kernel, arch, spec key) of its jobs) can make the choice a
    rule of decision table ``table`` (:data:`DECISIONS`) makes for ``spec`` on ``arch``: for a
    kernel choice, the portable kernel and the arch's own for that spec; for the backward's scheme,
    a dK/dV kernel of each scheme (``DQ_ATOMIC`` 0 and 1) for the call's spec, the portable one or
    the arch's own (the dispatch runs either; the gputest and default sets hold the atomic scheme
    on sm90 through the arch's kernel alone)."""
    if table == MODE_RULES:
        portable, owns = KERNEL_CHOICES[DKDV_KERNEL_RULES]
        return all(any((k, arch, _spec_key({**spec, "DQ_ATOMIC": atomic})) in specs for k in (portable, owns.get(arch)))
                   for atomic in (0, 1))
    portable, owns = KERNEL_CHOICES[table]
    key = _spec_key(spec)
    return (portable, arch, key) in specs and (owns.get(arch), arch, key) in specs


def decision_kernels(table: str) -> tuple[str, ...]:
    """The kernels a build must hold for a decision table's rules to fold (:func:`choice_built`): a
    scheme rule needs the dK/dV kernels, as the dK/dV kernel choice does."""
    portable, owns = KERNEL_CHOICES[DKDV_KERNEL_RULES if table == MODE_RULES else table]
    return (portable, *dict.fromkeys(owns.values()))


def _runs_in(entry: Entry, spec: Mapping[str, Any], arch: str, built: Mapping[tuple, dict],
             lowest: Mapping[tuple, int], tolerance: float) -> Timing | None:
    """The timing of the config a build holding ``built`` runs for ``entry``'s kernel and bin at
    ``spec``: the entry's winner where the build holds it as measured (its config rule folds), else
    the lowest config index built (no rule: the untuned default) where it holds that one as
    measured; None where the build runs a config this entry did not time."""
    key = _spec_key(spec)

    def as_measured(t: Timing) -> bool:
        return t.us is not None and built.get((entry.kernel, arch, key, t.index)) == dict(t.params)

    best = winner(entry.timings, tolerance)
    if best is not None and as_measured(best):
        return best
    first = lowest.get((entry.kernel, arch, key))
    return next((t for t in entry.timings if t.index == first and as_measured(t)), None)


def forward_choices_for_build(db: Mapping[str, Any], built: Mapping[tuple, dict], lowest: Mapping[tuple, int],
                              where: str = "<memory>") -> tuple[list[tuple[int, dict, bool]], list[str]] | None:
    """The ``attn_fwd_kernel`` rules for one build, decided again from ``db``'s entries, as
    (index, rule, is a mode-1 twin), and one note per bin whose choice differs from the database's;
    None where ``db`` has no entry of a forward (its stored rules then fold as they are).

    The stored rules compare each forward's *winning* config; a build that lacks a winner (the
    default set keeps config #0 only) runs another config there, whose time may rank the two
    forwards the other way. So each entry is reduced to the config this build runs
    (:func:`_runs_in`), for the entry's spec and, for a mode-2 entry, for its mode-1 twin (the build's
    mode-1 configs; unless the database measured mode 1 itself), and :func:`decide` chooses again.
    With every winner built the rules are the stored ones, byte for byte."""
    arch = str(db.get("arch"))
    mine = [e for e in entries_of(db, where) if e.kernel in STANDS_IN_FOR or e.kernel in STANDS_IN_FOR.values()]
    if not mine:
        return None
    tolerance = float(db.get("method", {}).get("tolerance", DEFAULT_TOLERANCE))
    source = f"tuning database {arch} ({db.get('machine', {}).get('gpu', 'unknown GPU')})"
    measured = {(e.kernel, _spec_key(e.spec)) for e in mine}
    views: dict[bool, list[Entry]] = {False: [], True: []}
    for e in mine:
        twin = mode_one_twin({"spec": e.spec})
        for is_twin, spec in ((False, e.spec), (True, twin["spec"] if twin else None)):
            if spec is None or (is_twin and (e.kernel, _spec_key(spec)) in measured):
                continue
            run = _runs_in(e, spec, arch, built, lowest, tolerance)
            if run is not None:
                views[is_twin].append(Entry(e.kernel, spec, e.bin, e.shape, (run,), e.source))
    out: list[tuple[int, dict, bool]] = []
    for is_twin, entries in views.items():
        for i, rule in enumerate(decide(entries, arch, source, tolerance).get(KERNEL_RULES, [])):
            if is_twin:
                rule = {**rule, "source": (rule["source"] + MODE_ONE_NOTE)[:300]}
            out.append((i, rule, is_twin))
    # Per (spec, bin): what the database chose (every winner) and what this build's configs say.
    notes = []
    full = decide(mine, arch, source, tolerance).get(KERNEL_RULES, [])
    for _, rule, is_twin in out:
        spec = {**rule["spec"], "CAUSAL": 2} if is_twin else rule["spec"]
        for b in sorted({e.bin for e in mine if _spec_key(e.spec) == _spec_key(spec)}):
            hit = select_kernel(full, spec=spec, seqlen_q=b, seqlen_k=b, arch=arch)
            chose = None if hit is None else hit.rule["kernel"]
            if in_range(b, rule["seqlen_q"]) and chose not in (None, rule["kernel"]):
                notes.append(f"{where}: {KERNEL_RULES} {_spec_key(rule['spec'])} at seqlen_q {b}: {rule['kernel']} "
                             f"in this build, where the database chose {chose} (whose winning config this build "
                             f"does not hold)")
    return out, notes


def _job_params(job: Any) -> dict:
    return {**job.config.constexprs, "num_warps": job.config.num_warps, "num_stages": job.config.num_stages}


def fold(databases: Sequence[tuple[str, Mapping[str, Any]]], jobs: Sequence[Any],
         declared: Mapping[str, list] | None = None) -> tuple[dict[str, list], list[str]]:
    """The catalog tuning table for a build: each database's rules the build can honour, then the
    kernels' ``declared`` rules (``registry.tuning_of``). Returns (table, notes): per database a
    line "NAME: N rules folded, M dropped" (with how many of the N are mode-2 rules applied to mode 1,
    see :func:`mode_one_twin`), followed by one line per dropped rule.

    ``databases``: (name, loaded database) pairs; an earlier database's rule wins over a later one's
    (first match). A rule is dropped, with a note, when its kernel/arch is built but its spec or
    config is not, or when the config built under its index has other parameters than measured.
    Rules of kernels or archs the build does not hold are left out silently.
    """
    built: dict[tuple, dict] = {}
    archs: set[tuple[str, str]] = set()
    specs: set[tuple[str, str, str]] = set()
    lowest: dict[tuple[str, str, str], int] = {}
    for job in jobs:
        archs.add((job.kernel, job.target.arch))
        for spec in _measured_specs(job.spec):
            where = (job.kernel, job.target.arch, _spec_key(spec))
            specs.add(where)
            built[(*where, job.config_index)] = _job_params(job)
            lowest[where] = min(lowest.get(where, job.config_index), job.config_index)
    table: dict[str, list] = {}
    notes: list[str] = []
    for name, db in databases:
        kept_before, dropped_before = sum(map(len, table.values())), len(notes)
        twins = 0
        redecided = forward_choices_for_build(db, built, lowest, name)
        choices = [] if redecided is None else redecided[1]
        for kernel, rules in sorted(db.get("rules", {}).items()):
            ruled = _with_mode_one_twins(kernel, rules)
            if kernel == KERNEL_RULES and redecided is not None:
                ruled = redecided[0]
            for i, rule, twin in ruled:
                arch = rule.get("arch")
                key = _spec_key(rule.get("spec", {}))
                if twin and (kernel, arch, key) not in specs and kernel not in DECISIONS:
                    continue  # the build has no mode-1 variant of the spec: nothing to say
                served = mode_one_twin(rule)
                if (not twin and served is not None and (kernel, arch, key) not in specs
                        and (kernel, arch, _spec_key(served["spec"])) in specs):
                    continue  # no mode 2 built (the default set), but mode 1: its twin, next, serves
                if kernel in DECISIONS:
                    # A choice between kernels (or schemes) means something only where the build holds both.
                    if choice_built(kernel, arch, rule.get("spec", {}), specs) and rule not in table.get(kernel, []):
                        table.setdefault(kernel, []).append(dict(rule))
                        twins += twin
                    continue
                if (kernel, arch) not in archs:
                    continue
                where = f"{name}: {kernel} rule #{i} ({_spec_key(rule.get('spec', {}))}, config #{rule['config']})"
                have = built.get((kernel, arch, _spec_key(rule.get("spec", {})), rule["config"]))
                if have is None:
                    notes.append(f"{where}: dropped, this build has no such variant")
                    continue
                if have != dict(rule["expect"]):
                    notes.append(f"{where}: dropped, config #{rule['config']} is now {have}, measured "
                                 f"{dict(rule['expect'])}; run `python -m builder tune` again")
                    continue
                kept = {k: v for k, v in rule.items() if k != "expect"}
                if kept not in table.setdefault(kernel, []):
                    table[kernel].append(kept)
                    twins += twin
        folded = sum(map(len, table.values())) - kept_before
        also = f" ({twins} of them mode-2 rules applied to CAUSAL=1)" if twins else ""
        notes.insert(dropped_before, f"{name}: {folded} rules folded{also}, {len(notes) - dropped_before} dropped")
        notes.extend(choices)
    for kernel, rules in (declared or {}).items():
        have = table.setdefault(kernel, [])
        have.extend(r for r in rules if r not in have)
    return table, notes
