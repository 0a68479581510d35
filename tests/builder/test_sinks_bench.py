"""bench/sinks.py on the CPU: which images get the softcap's EXP2_SPLIT rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")


def _variant(d: int, softcap: int, index: int, flags: dict) -> SimpleNamespace:
    return SimpleNamespace(spec={"HEAD_DIM": d, "SOFTCAP": softcap}, target=SimpleNamespace(arch="sm90"),
                           config=SimpleNamespace(index=index, constexprs=flags))


class _Lib:
    def __init__(self, variants: dict) -> None:
        self.variants = variants

    def variants_of(self, kernel: str) -> list:
        return self.variants.get(kernel, [])


def test_the_split_rows_need_the_softcapped_d128_split_config_and_name_the_kernels_own() -> None:
    from bench import sinks
    from builder.kernels.attention_sm90 import TILES, sm90_fwd_configs

    ((d, kernel, twin_index, split_index, flag, _),) = [lever for lever in sinks.CAP_LEVERS if lever[4] == "EXP2_SPLIT"]
    assert (d, kernel) == (128, "attn_fwd_sm90")
    spec = {"HEAD_DIM": 128, "SOFTCAP": 1}
    configs = sm90_fwd_configs(spec, None)
    assert configs[split_index].constexprs["EXP2_SPLIT"] == 1
    twin = {k: v for k, v in configs[split_index].constexprs.items() if k != "EXP2_SPLIT"}
    assert {k: v for k, v in configs[twin_index].constexprs.items() if k != "EXP2_SPLIT"} == twin
    assert twin_index >= len(TILES[128]) and "EXP2_SPLIT" not in configs[twin_index].constexprs
    assert sinks._holds(_Lib({kernel: [_variant(128, 1, split_index, {flag: 1})]}), kernel, 128, split_index, flag)
    # The default images: no split config; D=64 or uncapped variants do not count.
    assert not sinks._holds(_Lib({kernel: [_variant(128, 1, 7, {}), _variant(64, 1, split_index, {flag: 1}),
                                           _variant(128, 0, split_index, {})]}), kernel, 128, split_index, flag)


def test_the_hardware_tanh_rows_name_the_portable_kernels_d256_twin() -> None:
    from bench import sinks
    from builder.kernels.attention import fwd_configs
    from builder.targets import KNOWN

    ((d, kernel, twin_index, tanh_index, flag, _),) = [lever for lever in sinks.CAP_LEVERS if lever[4] == "FAST_TANH"]
    assert (d, kernel, twin_index) == (256, "attn_fwd", 1)
    spec = {"dtype": "bf16", "HEAD_DIM": 256, "HEAD_DIM_V": 256, "CAUSAL": 1, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0,
            "SOFTCAP": 1, "ALIBI": 0}
    configs = fwd_configs(spec, KNOWN["sm90"])
    assert configs[tanh_index].constexprs == {**configs[twin_index].constexprs, "FAST_TANH": 1}
    held = _Lib({kernel: [_variant(256, 1, tanh_index, {"FAST_TANH": 1})]})
    assert sinks._holds(held, kernel, 256, tanh_index, flag)
    assert not sinks._holds(_Lib({}), kernel, 256, tanh_index, flag)
