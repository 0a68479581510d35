"""The catalog's tuning rules: which compiled config (or backward scheme) a call should run.

A catalog may carry a ``tuning`` table, kernel name → list of rules. Each rule is an object;
the first whose conditions all hold decides. Conditions, all optional: ``arch`` (catalog arch,
e.g. ``"sm90"``), ``spec`` (a subset of the variant's spec), ``seqlen_q`` / ``seqlen_k``
(inclusive ``[low, high]`` ranges, ``null`` for an open end). The decision: ``config`` (an
index into the kernel's config table, 0 its default) or, under ``"attn_bwd_mode"``,
``mode`` (``"split"`` or ``"atomic"``), or, under ``"attn_fwd_kernel"``, ``kernel``: which
forward kernel serves the call (``"attn_fwd"``, the portable one, or a per-architecture forward
such as ``"attn_fwd_sm90"`` that the images hold for the call's spec; without a rule the
per-architecture one is preferred where it exists), and likewise under ``"attn_bwd_dkdv_kernel"``
which dK/dV kernel serves a split-scheme backward (``"attn_bwd_dkdv"`` or e.g.
``"attn_bwd_dkdv_sm90"``), and under ``"attn_bwd_dq_kernel"`` which dQ kernel (``"attn_bwd_dq"`` or
e.g. ``"attn_bwd_dq_sm90"``). A rule may say where it came from in ``source`` (a string,
e.g. the tuning database and GPU that measured it; ``python -m builder tune`` writes it), which
:func:`explain_config` repeats. Example::

    "tuning": {"attn_fwd": [{"arch": "sm90", "spec": {"HEAD_DIM": 128}, "seqlen_k": [4096, null],
                             "config": 2}],
               "attn_bwd_mode": [{"spec": {"HEAD_DIM": 64}, "mode": "atomic"}]}

Without a matching rule a kernel runs config 0, the documented heuristic: every kernel's config
table lists the config expected to be fastest first (see docs/tuning.md), so an untuned target
still runs a sensible config, and :func:`explain_config` says "untuned".

The table is data from an image folder: :func:`validate_table` checks all of it when the
catalog loads (a bad rule is a :class:`CatalogError` naming the file and the rule, not a
surprise on some later call), and every count and number is bounded. Operators cache their
choice per power-of-two length bin (:func:`seqlen_bin`), so range bounds should be powers of two.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import CatalogError

__all__ = ["DKDV_KERNEL_RULES", "DQ_KERNEL_RULES", "KERNEL_RULES", "MODE_RULES", "Choice", "explain_config",
           "in_range", "seqlen_bin", "select_config", "select_kernel", "select_mode", "validate_table"]

#: The table entry whose rules pick the attention backward's scheme instead of a config.
MODE_RULES = "attn_bwd_mode"
#: The table entry whose rules pick which forward kernel serves an attention call.
KERNEL_RULES = "attn_fwd_kernel"
#: The table entry whose rules pick which dK/dV kernel serves a split-scheme attention backward
#: (``"attn_bwd_dkdv"``, the portable one, or a per-architecture one such as ``"attn_bwd_dkdv_sm90"``).
DKDV_KERNEL_RULES = "attn_bwd_dkdv_kernel"
#: The same for the split backward's dQ kernel (``"attn_bwd_dq"`` or e.g. ``"attn_bwd_dq_sm90"``).
DQ_KERNEL_RULES = "attn_bwd_dq_kernel"
_MODES = ("split", "atomic")
_MAX_SOURCE = 300
# A full build's table names 7 kernels with 96 rules, at most 18 per kernel. The total bounds
# what a catalog of either form spends on its table at load (4M tiny rules took 6 s and 700 MB).
_MAX_KERNELS = 256
_MAX_RULES = 1024
_MAX_TOTAL_RULES = 16384
_MAX_CONFIG = 1 << 16
_MAX_LENGTH = 2**63 - 1
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def seqlen_bin(n: int) -> int:
    """The power-of-two bin of a sequence length, the granularity at which choices are cached."""
    return max(n, 1).bit_length()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(bounds: Any, where: str) -> None:
    if bounds is None:
        return
    if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2):
        raise CatalogError(f"catalog {where} must be [low, high] (high may be null), got {bounds!r}")
    for b in bounds:
        if b is not None and not (_is_int(b) and 0 <= b <= _MAX_LENGTH):
            raise CatalogError(f"catalog {where} bounds must be integers >= 0 or null, got {bounds!r}")


def _check_rule(rule: Any, kernel: str, i: int) -> None:
    where = f"tuning[{kernel!r}][{i}]"
    if not isinstance(rule, dict):
        raise CatalogError(f"catalog {where} must be an object, got {rule!r}"[:300])
    want = rule.get("spec", {})
    if not isinstance(want, dict):
        raise CatalogError(f"catalog {where}.spec must be an object, got {want!r}"[:300])
    for key, value in want.items():
        if not isinstance(key, str) or not (value is None or isinstance(value, (str, int, float))):
            raise CatalogError(f"catalog {where}.spec[{key!r}] must be a string or number, got {value!r}"[:300])
    _check_range(rule.get("seqlen_q"), where + ".seqlen_q")
    _check_range(rule.get("seqlen_k"), where + ".seqlen_k")
    if "arch" in rule and not isinstance(rule["arch"], str):
        raise CatalogError(f"catalog {where}.arch must be a string, got {rule['arch']!r}"[:300])
    source = rule.get("source")
    if source is not None and not (isinstance(source, str) and len(source) <= _MAX_SOURCE
                                   and source.isprintable()):
        raise CatalogError(f"catalog {where}.source must be a printable string of at most {_MAX_SOURCE} "
                           f"characters, got {source!r}"[:400])
    if kernel == MODE_RULES:
        if rule.get("mode") not in _MODES:
            raise CatalogError(f"catalog tuning[{MODE_RULES!r}] rule {rule!r}: mode must be 'split' or 'atomic'"[:400])
    elif kernel in (KERNEL_RULES, DKDV_KERNEL_RULES, DQ_KERNEL_RULES):
        name = rule.get("kernel")
        if not (isinstance(name, str) and _NAME.match(name)):
            raise CatalogError(f"catalog tuning[{kernel!r}] rule {rule!r}: kernel must be a kernel name"[:400])
    elif "config" in rule:
        index = rule["config"]
        if not _is_int(index) or not 0 <= index <= _MAX_CONFIG:
            raise CatalogError(f"catalog tuning[{kernel!r}] rule {rule!r}: config must be an integer >= 0"[:400])


def _check_rules(rules: Any, kernel: str) -> list:
    if not isinstance(rules, list):
        raise CatalogError(f"catalog tuning[{kernel!r}] must be a list of rules, got {type(rules).__name__}")
    if len(rules) > _MAX_RULES:
        raise CatalogError(f"catalog tuning[{kernel!r}] has {len(rules)} rules; at most {_MAX_RULES} are read")
    for i, rule in enumerate(rules):
        _check_rule(rule, kernel, i)
    return rules


def validate_table(table: Any, source: str = "<memory>") -> dict[str, list]:
    """Check a whole ``tuning`` table (as :class:`aotriton_rt.Catalog` loads it); returns it.

    Raises:
        CatalogError: naming ``source`` and the first malformed entry or rule.
    """
    if not isinstance(table, dict):
        raise CatalogError(f"{source}: $.tuning must be an object, got {type(table).__name__}")
    if len(table) > _MAX_KERNELS:
        raise CatalogError(f"{source}: $.tuning names {len(table)} kernels; at most {_MAX_KERNELS} are read")
    total = sum(len(rules) for rules in table.values() if isinstance(rules, list))
    if total > _MAX_TOTAL_RULES:
        raise CatalogError(f"{source}: $.tuning has {total} rules in all; at most {_MAX_TOTAL_RULES} are read")
    for kernel, rules in table.items():
        if not isinstance(kernel, str) or not _NAME.match(kernel):
            raise CatalogError(f"{source}: $.tuning key {kernel!r} is not a kernel name"[:300])
        try:
            _check_rules(rules, kernel)
        except CatalogError as e:
            raise CatalogError(f"{source}: {e}") from None
    return table


def _matching_rule(rules: Any, kernel: str, spec: Mapping[str, Any], seqlen_q: int, seqlen_k: int,
                   arch: str | Callable[[], str] | None) -> tuple[int, dict] | None:
    if not rules:
        return None
    for i, rule in enumerate(_check_rules(rules, kernel)):
        want = rule.get("spec", {})
        if any(spec.get(key) != value for key, value in want.items()):
            continue
        if not (in_range(seqlen_q, rule.get("seqlen_q")) and in_range(seqlen_k, rule.get("seqlen_k"))):
            continue
        if "arch" in rule:
            # Asked last: finding the device's arch may need the driver.
            if callable(arch):
                arch = arch()
            if rule["arch"] != arch:
                continue
        return i, rule
    return None


def in_range(value: int, bounds: Any) -> bool:
    """Whether a length lies in a rule's inclusive ``[low, high]`` range (None: no bound)."""
    if bounds is None:
        return True
    lo, hi = bounds
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def select_config(rules: Any, *, kernel: str, spec: Mapping[str, Any], seqlen_q: int, seqlen_k: int,
                  arch: str | Callable[[], str] | None = None) -> int:
    """The tuning config index for a call, from a catalog ``tuning[kernel]`` rule list.

    The first rule whose conditions all hold gives ``config``; no rule matching: 0, the
    kernel's default. ``arch`` may be a callable, asked only when a rule names an arch.

    Raises:
        CatalogError: the rules are malformed.

    Example::

        select_config(cat.tuning["attn_fwd"], kernel="attn_fwd", spec={"HEAD_DIM": 128},
                      seqlen_q=8192, seqlen_k=8192, arch="sm90")
    """
    hit = _matching_rule(rules, kernel, spec, seqlen_q, seqlen_k, arch)
    return 0 if hit is None else hit[1].get("config", 0)


def select_mode(rules: Any, *, spec: Mapping[str, Any], seqlen_q: int, seqlen_k: int,
                arch: str | Callable[[], str] | None = None) -> str | None:
    """The backward scheme a ``tuning["attn_bwd_mode"]`` rule asks for, or None."""
    hit = _matching_rule(rules, MODE_RULES, spec, seqlen_q, seqlen_k, arch)
    return None if hit is None else hit[1]["mode"]


def select_kernel(rules: Any, *, spec: Mapping[str, Any], seqlen_q: int, seqlen_k: int,
                  arch: str | Callable[[], str] | None = None, table: str = KERNEL_RULES) -> Choice | None:
    """The ``tuning[table]`` rule (``"attn_fwd_kernel"``: the forward's, ``"attn_bwd_dkdv_kernel"`` /
    ``"attn_bwd_dq_kernel"``: the split backward's dK/dV / dQ) that names the kernel of a call (its
    ``rule["kernel"]``), as a :class:`Choice` for its reason; None when no rule matches."""
    hit = _matching_rule(rules, table, spec, seqlen_q, seqlen_k, arch)
    return None if hit is None else Choice(table, 0, hit[0], hit[1])


#: What an untuned kernel runs, in words (docs/tuning.md).
UNTUNED_HEURISTIC = "config 0, the first of the kernel's config table, which lists the expected fastest first"


@dataclass(frozen=True)
class Choice:
    """Which config a tuning table gives a call, and why (see :func:`explain_config`).

    ``rule_index`` / ``rule``: the first matching rule of ``tuning[kernel]``, None when none
    matched (the call is *untuned*).
    """

    kernel: str
    config: int
    rule_index: int | None = None
    rule: dict | None = None

    @property
    def tuned(self) -> bool:
        return self.rule is not None

    @property
    def reason(self) -> str:
        """One line: ``tuned (rule #i of tuning['attn_fwd'], from ..., seqlen_q in [a, b])`` or
        ``untuned (heuristic: ...)``."""
        if self.rule is None:
            return f"untuned (no rule of tuning[{self.kernel!r}] matches; heuristic: {UNTUNED_HEURISTIC})"
        where = [f"rule #{self.rule_index} of tuning[{self.kernel!r}]"]
        if self.rule.get("source"):
            where.append(f"from {self.rule['source']}")
        for axis in ("seqlen_q", "seqlen_k"):
            bounds = self.rule.get(axis)
            if bounds is not None:
                lo, hi = bounds
                where.append(f"{axis} in [{lo if lo is not None else 0}, {hi if hi is not None else 'inf'}]")
        if "arch" in self.rule:
            where.append(f"arch {self.rule['arch']}")
        return "tuned (" + ", ".join(where) + ")"


def explain_config(rules: Any, *, kernel: str, spec: Mapping[str, Any], seqlen_q: int, seqlen_k: int,
                   arch: str | Callable[[], str] | None = None) -> Choice:
    """:func:`select_config` with its reason: the config index and the rule that gave it, if any.

    Raises:
        CatalogError: the rules are malformed.

    Example::

        choice = explain_config(rules, kernel="attn_fwd", spec=spec, seqlen_q=4096, seqlen_k=4096, arch="sm90")
        print(choice.config, choice.reason)   # 1 tuned (rule #3 of tuning['attn_fwd'], from ..., seqlen_q in ...)
    """
    hit = _matching_rule(rules, kernel, spec, seqlen_q, seqlen_k, arch)
    if hit is None:
        return Choice(kernel, 0)
    return Choice(kernel, hit[1].get("config", 0), hit[0], hit[1])
