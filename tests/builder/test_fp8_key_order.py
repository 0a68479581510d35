"""sm90's Gluon FP8 forward reads V^T with each 32 keys in its register order (``KEY_ORDER=1``):
``attn_fp8_v_transpose`` writes that order (run here under Triton's interpreter), the forward takes
P's columns in it (the reshape and permute of its ``_p_operand``, read from the kernel's source
and applied to a CPU tensor), and the two meet: P·V is unchanged. The runtime's copy of the order
(for JAX, which transposes V itself) is the same, and the operator asks for the pre-pass in the
order of the forward it launches."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = {"keys_93_d64": (2, 3, 93, 64), "keys_128_d128": (1, 2, 128, 128), "keys_31_d64": (1, 1, 31, 64)}


def _p_reorder() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The split of BLOCK_N // 32 groups and the permute of ``_p_operand``'s key order, from its source."""
    from builder.kernels.attention_fp8_sm90 import _p_operand

    found = re.search(r"gl\.permute\(p\.reshape\(HALF, BLOCK_N // 32, ([\d, ]+)\), ([\d, ]+)\)", _p_operand.src)
    assert found, "the key order's reshape and permute in _p_operand"
    return tuple(int(x) for x in found[1].split(",")), tuple(int(x) for x in found[2].split(","))


def _run_case(name: str) -> dict:
    import torch
    import triton

    from aotriton_rt.ops.attention.fp8 import key_permutation, vt_shape
    from builder.kernels.attention_fp8 import attn_fp8_v_transpose

    b, h, rows, d = CASES[name]
    torch.manual_seed(0)
    v = torch.randn(b, h, rows, d)
    shape = vt_shape(b, h, d, rows, False)
    cols = shape[-1]
    out = {}
    for order in (0, 1):
        vt = torch.full(shape, float("nan"))
        grid = (triton.cdiv(cols, 64), b * h, 1)
        attn_fp8_v_transpose[grid](v, vt, h * rows * d, rows * d, d, h * d * cols, d * cols, cols, b, h, rows,
                                   cols, HEAD_DIM=d, BLOCK_N=64, KEY_ORDER=order)
        out[order] = vt
    natural = torch.zeros(shape)
    natural[..., :rows] = v.transpose(-1, -2)
    split, perm = _p_reorder()
    # P over every column (keys past `rows` masked to 0, as the forward's softmax leaves them).
    p = torch.rand(b, h, 64, cols)
    p[..., rows:] = 0.0
    reordered = p.reshape(b * h, 64, cols // 32, *split).permute(0, *(i + 1 for i in perm)).reshape(b, h, 64, cols)
    want = p @ natural.transpose(-1, -2)
    got = reordered @ out[1].transpose(-1, -2)
    return {"errors": {}, "failed": [],
            "natural_exact": bool(torch.equal(out[0], natural)),
            "permuted_matches_runtime": bool(torch.equal(out[1], natural[..., key_permutation(cols)])),
            "cols": cols, "product_err": float((got - want).abs().max()),
            "scale": float(want.abs().max())}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    from tests.helpers.interpreter import run_sharded

    return run_sharded(__file__, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_the_key_ordered_v_transpose_and_the_reordered_p_give_the_same_product(interpreted, name) -> None:
    r = interpreted[name]
    assert not r["failed"], r["failed"]
    assert r["cols"] % 32 == 0
    assert r["natural_exact"] and r["permuted_matches_runtime"]
    assert r["product_err"] <= 1e-5 * r["scale"]


def test_the_key_order_is_a_permutation_within_each_32_keys() -> None:
    from aotriton_rt.ops.attention.fp8 import key_permutation

    perm = key_permutation(96)
    assert sorted(perm) == list(range(96))
    assert all(n // 32 == k // 32 for n, k in enumerate(perm))
    assert perm[:8] == [0, 1, 8, 9, 2, 3, 10, 11]


def test_the_operator_asks_for_the_transpose_in_the_order_of_the_forward_it_launches() -> None:
    from aotriton_rt.ops.attention import fp8 as op

    class Variant:
        def __init__(self, index: int, order: int | None) -> None:
            self.params = {"HEAD_DIM": 128, **({"KEY_ORDER": order} if order is not None else {})}
            self.config = type("Config", (), {"index": index})()

    class Handle:
        def __init__(self, name: str, candidates: list) -> None:
            self.name, self.candidates = name, candidates

    class Lib:
        def __init__(self, variants: list) -> None:
            self.variants, self.asked = variants, []

        def kernel(self, name: str, **params: Any) -> Handle:
            self.asked.append(params)
            return Handle(name, [v for v in self.variants
                                 if all(v.params.get(k, 0) == x for k, x in params.items() if k == "KEY_ORDER")])

    chosen = op.KernelChoice("attn_fwd", "attn_fwd_fp8_sm90", {"dtype": "fp8e4nv", "HEAD_DIM_V": 128}, "", None,
                             {"HEAD_DIM": 128})
    mixed = Lib([Variant(7, 0), Variant(0, 1), Variant(3, 1)])
    handle, order = op.forward_handle(type("Ks", (), {"lib": mixed})(), chosen)
    assert order == 1 and mixed.asked[-1] == {"HEAD_DIM": 128, "KEY_ORDER": 1}
    assert {v.params["KEY_ORDER"] for v in handle.candidates} == {1}
    # Images built before the key order: no KEY_ORDER parameter, the keys in order.
    old = Lib([Variant(0, None), Variant(1, None)])
    assert op.forward_handle(type("Ks", (), {"lib": old})(), chosen)[1] == 0
    assert op.transpose_spec(chosen, 1) == {"dtype": "fp8e4nv", "HEAD_DIM": 128, "KEY_ORDER": 1}
    assert op.transpose_spec(chosen, 0) == {"dtype": "fp8e4nv", "HEAD_DIM": 128}
    with pytest.raises(op.KernelNotFound, match="different key orders"):
        op.key_order(Handle("attn_fwd_fp8_sm90", mixed.variants))


def test_every_gluon_fp8_config_but_the_last_reads_the_key_ordered_transpose_built_beside_it() -> None:
    import triton

    from builder.kernels.attention_fp8_sm90 import fp8_sm90_configs
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    for d in (64, 128):
        orders = [c.constexprs["KEY_ORDER"] for c in fp8_sm90_configs({"HEAD_DIM": d}, None)]
        assert orders == [1] * (len(orders) - 1) + [0]
    pre = load_kernels()["attn_fp8_v_transpose"]
    targets = parse_targets("sm90,gfx942")
    gputest = {(j.target.arch, j.constexprs.get("KEY_ORDER", 0)) for j in expand(pre, targets, "gputest",
                                                                                 triton.__version__)}
    assert gputest == {("sm90", 0), ("sm90", 1), ("gfx942", 0)}
    default = {(j.target.arch, j.constexprs.get("KEY_ORDER", 0)) for j in expand(pre, targets, "default",
                                                                                 triton.__version__)}
    # The default images hold the Gluon FP8 forward on sm90 too: both orders there.
    assert default == {("sm90", 0), ("sm90", 1), ("gfx942", 0)}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tests.helpers.interpreter import patch_interpreter, report_cases

    patch_interpreter()
    report_cases(sys.argv[1:], _run_case)
