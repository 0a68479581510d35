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
- :func:`dumps` writes the database with sorted keys and rounded times, so the same measurements
  give the same bytes; where and on what it was measured (``machine``) is kept apart from the
  decisions (``rules``), and no date is recorded;
- :func:`fold` gives the catalog rules for a build: a rule is kept only when the build holds its
  spec and config on its arch *with the parameters that were measured* (``expect``); a config
  table that changed since the measurement drops the rule with a reason instead of pointing it
  at another config. A rule measured on mask mode 2 (bottom-right causal) also applies to the
  build's mode-1 variants of the same spec, unless the database measured mode 1 itself: mode 1
  is the same kernel with the band's alignment a run-time argument (one multiply), and the
  default set compiles mode 1 only (:func:`mode_one_twin`).

A database for a target checked in as ``builder/tuning_db/<arch>.json`` is folded into every build
of that target; ``python -m builder build --tuning-db FILE`` names others (docs/tuning.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotriton_rt.ops.attention.dispatch import ARCH_FORWARDS, FWD
from aotriton_rt.tuning import KERNEL_RULES

SCHEMA = "aotriton-rt-tuning"
SCHEMA_VERSION = 1
#: The length whose bins a kernel's rules are keyed on: the one that sizes its grid.
LENGTH_AXIS = {"attn_fwd": "seqlen_q", "attn_fwd_sm90": "seqlen_q", "attn_bwd_dq": "seqlen_q",
               "attn_bwd_dkdv": "seqlen_k"}
#: Per arch forward (the runtime's ``ARCH_FORWARDS``), the portable kernel it stands in for;
#: their choices are rules under ``KERNEL_RULES``.
STANDS_IN_FOR = {own: FWD for own in ARCH_FORWARDS.values()}
#: Checked-in databases, one per arch: ``builder/tuning_db/<arch>.json``.
CHECKED_IN = Path(__file__).resolve().parent / "tuning_db"
DEFAULT_TOLERANCE = 0.01
_MAX_BYTES = 16 << 20
_MAX_ENTRIES = 100_000


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

    def to_json(self, tolerance: float) -> dict:
        best = winner(self.timings, tolerance)
        return {"kernel": self.kernel, "spec": dict(self.spec), "bin": self.bin, "shape": dict(self.shape),
                "winner": None if best is None else best.index, "configs": [t.to_json() for t in self.timings]}


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


def _spec_key(spec: Mapping[str, Any]) -> str:
    return json.dumps(dict(spec), sort_keys=True)


def decide(entries: Iterable[Entry], arch: str, source: str, tolerance: float = DEFAULT_TOLERANCE) -> dict[str, list]:
    """Catalog rules from measured entries (see the module docs); deterministic in its inputs.

    Each rule: ``arch``, ``spec``, the kernel's length range, ``config``, ``source``, and
    ``expect`` (the winner's parameters, checked and dropped by :func:`fold`).
    """
    groups: dict[tuple[str, str], list[tuple[int, Timing]]] = {}
    specs: dict[str, Mapping[str, Any]] = {}
    for e in entries:
        best = winner(e.timings, tolerance)
        if best is None:
            continue
        key = _spec_key(e.spec)
        specs[key] = e.spec
        groups.setdefault((e.kernel, key), []).append((e.bin, best))
    rules: dict[str, list] = {}
    for (kernel, key), bins in sorted(groups.items()):
        axis = LENGTH_AXIS.get(kernel, "seqlen_q")
        bins.sort(key=lambda b: b[0])
        if len({b for b, _ in bins}) != len(bins):
            raise TuningError(f"{kernel} {key}: bin measured twice")
        for low, high, lo, hi, t in _runs(bins, lambda t: t.index):
            rules.setdefault(kernel, []).append({
                "arch": arch, "spec": dict(specs[key]), axis: [low, high], "config": t.index,
                "source": f"{source}, measured at {axis} {lo}..{hi}", "expect": dict(t.params)})
    # Which forward serves each bin where an arch's own forward and the portable one were both timed.
    for own, portable in sorted(STANDS_IN_FOR.items()):
        for (kernel, key), bins in sorted(groups.items()):
            if kernel != own:
                continue
            theirs = dict(groups.get((portable, key), []))
            picks = []
            for b, t in sorted(bins, key=lambda b: b[0]):
                other = theirs.get(b)
                if other is None:
                    continue
                faster = _round(other.us) * (1.0 + tolerance) < _round(t.us)
                picks.append((b, portable if faster else own))
            axis = LENGTH_AXIS[own]
            for low, high, lo, hi, name in _runs(picks, lambda name: name):
                rules.setdefault(KERNEL_RULES, []).append({
                    "arch": arch, "spec": dict(specs[key]), axis: [low, high], "kernel": name,
                    "source": f"{source}, {own} vs {portable} measured at {axis} {lo}..{hi}"})
    return rules


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
    rules decided from them."""
    gpu = str(machine.get("gpu", "unknown GPU"))
    source = f"tuning database {arch} ({gpu})"
    ordered = sorted(entries, key=lambda e: (e.kernel, _spec_key(e.spec), e.bin))
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "arch": arch, "machine": dict(machine),
            "method": {**dict(method), "tolerance": tolerance},
            "entries": [e.to_json(tolerance) for e in ordered],
            "rules": decide(ordered, arch, source, tolerance)}


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
            out.append(Entry(str(e["kernel"]), dict(e["spec"]), int(e["bin"]), dict(e["shape"]), timings))
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
            if kernel == KERNEL_RULES and rule.get("arch") == db["arch"]:
                continue  # its kernel name was checked by validate_table
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
    for job in jobs:
        archs.add((job.kernel, job.target.arch))
        specs.add((job.kernel, job.target.arch, _spec_key(job.spec)))
        built[(job.kernel, job.target.arch, _spec_key(job.spec), job.config_index)] = _job_params(job)
    table: dict[str, list] = {}
    notes: list[str] = []
    for name, db in databases:
        kept_before, dropped_before = sum(map(len, table.values())), len(notes)
        twins = 0
        for kernel, rules in sorted(db.get("rules", {}).items()):
            for i, rule, twin in _with_mode_one_twins(kernel, rules):
                arch = rule.get("arch")
                key = _spec_key(rule.get("spec", {}))
                if twin and (kernel, arch, key) not in specs and kernel != KERNEL_RULES:
                    continue  # the build has no mode-1 variant of the spec: nothing to say
                served = mode_one_twin(rule)
                if (not twin and served is not None and (kernel, arch, key) not in specs
                        and (kernel, arch, _spec_key(served["spec"])) in specs):
                    continue  # no mode 2 built (the default set), but mode 1: its twin, next, serves
                if kernel == KERNEL_RULES:
                    # A choice between two forwards means something only where the build holds both.
                    key = _spec_key(rule.get("spec", {}))
                    if any((own, arch, key) in specs and (portable, arch, key) in specs
                           for own, portable in STANDS_IN_FOR.items()) and rule not in table.get(kernel, []):
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
    for kernel, rules in (declared or {}).items():
        have = table.setdefault(kernel, [])
        have.extend(r for r in rules if r not in have)
    return table, notes
