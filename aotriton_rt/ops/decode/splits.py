"""Split-KV work division: how many key runs a decode call splits into (the catalog's rules)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...errors import CatalogError


@dataclass(frozen=True)
class SplitRule:
    """How many splits a call gets: ``waves`` resident programs per SM to fill (the decode
    tile's occupancy), splits of at least ``min_blocks`` key blocks, at most ``max_splits``
    (attn_decode_combine merges their partials)."""

    waves: int = 2
    min_blocks: int = 4
    max_splits: int = 64


# Per target, when the catalog has no rule: SM (CU) counts of the usual parts and the rule.
DEFAULT_SPLIT_RULES: dict[str, SplitRule] = {"sm90": SplitRule(2, 4, 64), "sm80": SplitRule(2, 4, 64)}
_SM_COUNTS = {"sm80": 108, "sm86": 84, "sm89": 128, "sm90": 132, "gfx90a": 110, "gfx908": 120, "gfx942": 304,
              "gfx950": 256, "gfx1100": 48, "gfx1101": 30, "gfx1151": 20, "gfx1200": 32, "gfx1201": 32}


def num_splits_for(batch: int, heads_k: int, row_blocks: int, seqlen_k: int, block_n: int, sm_count: int,
                   rule: SplitRule) -> int:
    """Splits per (batch, KV head), FlashAttention's way: 1 when the programs already fill
    ``rule.waves`` programs per SM (80% of them), else the fewest splits whose last wave is
    nearly as full (85% of the best efficiency) as any split count allows, each split at least
    ``rule.min_blocks`` key blocks long and at most ``rule.max_splits`` of them; no split left
    without keys."""
    base = max(batch * heads_k * row_blocks, 1)
    slots = max(rule.waves * sm_count, 1)
    if base * 5 >= slots * 4:
        return 1
    blocks = -(-max(seqlen_k, 1) // block_n)
    limit = max(1, min(blocks // max(rule.min_blocks, 1), rule.max_splits))
    effs = []
    for s in range(1, limit + 1):
        waves = base * s / slots
        effs.append(waves / math.ceil(waves))
    best = max(effs)
    splits = next(s for s, e in enumerate(effs, 1) if e >= 0.85 * best)
    # The kernel gives every split cdiv(blocks, splits) blocks: drop the splits that would be left
    # empty (each still launches a program and adds a partial for the combine to read).
    return -(-blocks // -(-blocks // splits))


def _bounded(obj: dict, key: str, lo: int, hi: int, where: str, shown: str | None = None) -> int:
    """``obj[key]`` (default 0), an integer (not a bool) in ``[lo, hi]``, else CatalogError
    naming ``where.key`` and the bounds (``hi`` written as ``shown`` when given)."""
    value = obj.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CatalogError(f"{where}.{key} must be an integer in [{lo}, {shown or hi}], got {value!r}")
    return value


def split_rule(rules: Any, arch: str, *, batch_heads: int = 1, paged: bool = False, rows: int = 1,
               fp8: bool = False) -> tuple[SplitRule, int]:
    """(split rule, config index) from catalog ``tuning["attn_decode"]`` rules for ``arch``.

    Rules are objects, the first that matches wins: ``arch`` (optional) the target,
    ``min_batch_heads`` (optional) at least that many (sequence, KV head) pairs in the call
    (``batch_heads``: the work size before splitting), ``min_rows`` (optional) at least that many
    query rows per (sequence, KV head) pair (``rows``: the GQA group times the query rows; a
    prefill-sized run takes a larger tile), ``paged`` (optional) the cache kind, ``fp8``
    (optional) whether the cache is fp8 (its own configs, e.g. sm90's #4-#8, which caches of q's
    type do not have).
    ``splits`` (optional) overrides fields of the default rule, ``config`` (optional) picks a
    tuning config. A ``combine`` key (the removed fused split merge's switch) is refused.
    """
    base = DEFAULT_SPLIT_RULES.get(arch, SplitRule())
    if not rules:
        return base, 0
    if not isinstance(rules, list):
        raise CatalogError(f"catalog tuning['attn_decode'] must be a list of rules, got {type(rules).__name__}")
    for i, rule in enumerate(rules):
        where = f"catalog tuning['attn_decode'][{i}]"
        if not isinstance(rule, dict):
            raise CatalogError(f"{where} must be an object, got {rule!r}")
        if "combine" in rule:
            raise CatalogError(f"{where}.combine is no longer read: the fused split merge was removed (splits are "
                               f"always merged by attn_decode_combine); drop the key, got {rule['combine']!r}")
        if "arch" in rule and rule["arch"] != arch:
            continue
        least = _bounded(rule, "min_batch_heads", 0, 2**31, where, "2**31")
        least_rows = _bounded(rule, "min_rows", 0, 2**40, where, "2**40")
        kind = rule.get("paged")
        if kind is not None and not isinstance(kind, bool):
            raise CatalogError(f"{where}.paged must be true or false, got {kind!r}")
        quantised = rule.get("fp8")
        if quantised is not None and not isinstance(quantised, bool):
            raise CatalogError(f"{where}.fp8 must be true or false, got {quantised!r}")
        if batch_heads < least or rows < least_rows or (kind is not None and kind != bool(paged)) or \
                (quantised is not None and quantised != bool(fp8)):
            continue
        splits = rule.get("splits", {})
        if not isinstance(splits, dict) or set(splits) - {"waves", "min_blocks", "max_splits"}:
            raise CatalogError(f"{where}.splits must be an object with waves, min_blocks, max_splits; got {splits!r}")
        fields = {key: _bounded(splits, key, lo, hi, f"{where}.splits")
                  for key, (lo, hi) in {"waves": (1, 64), "min_blocks": (1, 4096), "max_splits": (1, 1024)}.items()
                  if key in splits}
        config = rule.get("config", 0)
        if isinstance(config, bool) or not isinstance(config, int) or not 0 <= config < 64:
            raise CatalogError(f"{where}.config must be an integer in [0, 64), got {config!r}")
        return SplitRule(**{**base.__dict__, **fields}), config
    return base, 0

