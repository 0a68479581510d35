"""bench/sinks.py on the CPU: which images get the softcap's EXP2_SPLIT rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")


def _variant(d: int, softcap: int, index: int, split: int) -> SimpleNamespace:
    return SimpleNamespace(spec={"HEAD_DIM": d, "SOFTCAP": softcap},
                           config=SimpleNamespace(index=index, constexprs={"EXP2_SPLIT": split}))


class _Lib:
    def __init__(self, variants: list) -> None:
        self.variants = variants

    def variants_of(self, kernel: str) -> list:
        return self.variants if kernel == "attn_fwd_sm90" else []


def test_the_split_rows_need_the_softcapped_d128_split_config_and_name_the_kernels_own() -> None:
    from bench import sinks
    from builder.kernels.attention_sm90 import TILES, sm90_fwd_configs

    spec = {"HEAD_DIM": 128, "SOFTCAP": 1}
    configs = sm90_fwd_configs(spec, None)
    assert configs[sinks.SPLIT_CONFIG].constexprs["EXP2_SPLIT"] == 1
    twin = {k: v for k, v in configs[sinks.SPLIT_CONFIG].constexprs.items() if k != "EXP2_SPLIT"}
    assert {k: v for k, v in configs[sinks.SPLIT_TWIN].constexprs.items() if k != "EXP2_SPLIT"} == twin
    assert sinks.SPLIT_TWIN >= len(TILES[128]) and "EXP2_SPLIT" not in configs[sinks.SPLIT_TWIN].constexprs
    assert sinks._has_exp2_split(_Lib([_variant(128, 1, sinks.SPLIT_CONFIG, 1)]))
    # The default images: no split config; D=64 or uncapped variants do not count.
    assert not sinks._has_exp2_split(_Lib([_variant(128, 1, 7, 0), _variant(64, 1, sinks.SPLIT_CONFIG, 1),
                                          _variant(128, 0, sinks.SPLIT_CONFIG, 0)]))
