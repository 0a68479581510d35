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


def test_the_hardware_tanh_rows_name_the_portable_kernels_d256_twin() -> None:
    from bench import sinks
    from builder.kernels.attention import fwd_configs
    from builder.targets import KNOWN

    spec = {"dtype": "bf16", "HEAD_DIM": 256, "HEAD_DIM_V": 256, "CAUSAL": 1, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0,
            "SOFTCAP": 1, "ALIBI": 0}
    configs = fwd_configs(spec, KNOWN["sm90"])
    assert configs[sinks.FAST_TANH_CONFIG].constexprs == {**configs[0].constexprs, "FAST_TANH": 1}
    held = SimpleNamespace(spec={"HEAD_DIM": 256, "SOFTCAP": 1}, target=SimpleNamespace(arch="sm90"),
                           config=SimpleNamespace(index=sinks.FAST_TANH_CONFIG, constexprs={"FAST_TANH": 1}))

    class Lib:
        def variants_of(self, kernel: str) -> list:
            return [held] if kernel == "attn_fwd" else []

    assert sinks._has_fast_tanh(Lib()) and not sinks._has_fast_tanh(_Lib([]))
