"""The catalog's tuning rules: validated, whole, when the catalog loads; applied first match wins."""

from __future__ import annotations

from typing import Any

import pytest

from aotriton_rt import CatalogError
from aotriton_rt.catalog import Catalog
from aotriton_rt.tuning import select_config, select_mode, seqlen_bin, validate_table
from tests.runtime.test_catalog import _catalog


def _load(tuning: Any) -> Catalog:
    obj = _catalog()
    obj["tuning"] = tuning
    return Catalog.from_json(obj, source="images/catalog.json")


def test_a_well_formed_table_loads_and_is_kept_as_written() -> None:
    table = {"attn_fwd": [{"arch": "sm90", "spec": {"HEAD_DIM": 128}, "seqlen_k": [4096, None], "config": 2}],
             "attn_bwd_mode": [{"spec": {"HEAD_DIM": 64}, "mode": "atomic"}]}
    assert _load(table).tuning == table


@pytest.mark.parametrize("table,match", [
    ({"attn_fwd": {"config": 1}}, r"images/catalog\.json: catalog tuning\['attn_fwd'\] must be a list of rules, "
                                  r"got dict"),
    ({"attn_fwd": [3]}, r"images/catalog\.json: catalog tuning\['attn_fwd'\]\[0\] must be an object, got 3"),
    ({"attn_fwd": [{"seqlen_k": [1]}]}, r"tuning\['attn_fwd'\]\[0\]\.seqlen_k must be \[low, high\]"),
    ({"attn_fwd": [{"seqlen_q": [-4, None]}]}, r"tuning\['attn_fwd'\]\[0\]\.seqlen_q bounds must be integers >= 0 "
                                               r"or null, got \[-4, None\]"),
    ({"attn_fwd": [{"config": -1}]}, r"tuning\['attn_fwd'\] rule \{'config': -1\}: config must be an integer >= 0"),
    ({"attn_fwd": [{"config": 2**40}]}, r"config must be an integer >= 0"),
    ({"attn_fwd": [{"spec": [1]}]}, r"tuning\['attn_fwd'\]\[0\]\.spec must be an object, got \[1\]"),
    ({"attn_fwd": [{"spec": {"HEAD_DIM": [64]}}]}, r"\.spec\['HEAD_DIM'\] must be a string or number"),
    ({"attn_fwd": [{"arch": 90}]}, r"tuning\['attn_fwd'\]\[0\]\.arch must be a string, got 90"),
    ({"attn_bwd_mode": [{"mode": "fused"}]}, r"tuning\['attn_bwd_mode'\] rule .*: mode must be 'split' or "
                                             r"'atomic'"),
    ({"attn fwd; import os": []}, r"images/catalog\.json: \$\.tuning key 'attn fwd; import os' is not a kernel "
                                  r"name"),
    ({"attn_fwd": [{}] * 1025}, r"tuning\['attn_fwd'\] has 1025 rules; at most 1024 are read"),
])
def test_a_malformed_table_is_refused_when_the_catalog_loads(table: Any, match: str) -> None:
    with pytest.raises(CatalogError, match=match):
        _load(table)


def test_validate_table_refuses_a_table_that_is_not_an_object() -> None:
    with pytest.raises(CatalogError, match=r"x\.json: \$\.tuning must be an object, got list"):
        validate_table([], "x.json")


def test_the_first_matching_rule_decides_and_no_match_is_config_0() -> None:
    rules = [{"spec": {"HEAD_DIM": 64}, "config": 1}, {"seqlen_q": [1024, None], "config": 3}]
    assert select_config(rules, kernel="k", spec={"HEAD_DIM": 64}, seqlen_q=4096, seqlen_k=1) == 1
    assert select_config(rules, kernel="k", spec={"HEAD_DIM": 128}, seqlen_q=4096, seqlen_k=1) == 3
    assert select_config(rules, kernel="k", spec={"HEAD_DIM": 128}, seqlen_q=64, seqlen_k=1) == 0
    assert select_mode([{"mode": "atomic"}], spec={}, seqlen_q=1, seqlen_k=1) == "atomic"
    assert select_mode([], spec={}, seqlen_q=1, seqlen_k=1) is None
    assert [seqlen_bin(n) for n in (0, 1, 2, 3, 4, 4095, 4096)] == [1, 1, 2, 2, 3, 12, 13]
