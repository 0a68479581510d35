"""The Gluon sm90 dQ kernel (builder/kernels/attention_bwd_dq_sm90.py) through the builder, on the CPU.

It compiles for sm90 with the builder's own path, its binary proves the catalog's argument layout,
its argument list and grid are attn_bwd_dq's (with the run-time ``causal_align`` after
``window_right``), ptxas keeps its wgmmas asynchronous and spills nothing, and no other target or
set builds it.
"""

from __future__ import annotations

import lzma
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("elftools")

NAME = "attn_bwd_dq_sm90"
BASE = {"BIAS": 0, "DROPOUT": 0, "VARLEN": 0}
#: The variants compiled here: D=128 bottom-right causal (the training shape), D=128 mode 1 (the
#: run-time alignment and window arguments), D=64 without a mask.
BUILT = ({"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 2, **BASE},
         {"dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 1, **BASE},
         {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0, **BASE})


def _kernels():
    from builder.registry import load_kernels

    return load_kernels()


def test_the_gluon_dq_is_built_for_sm90_only_and_for_the_cases_it_serves() -> None:
    from builder.registry import expand
    from builder.targets import parse_targets

    jobs = expand(_kernels()[NAME], parse_targets("sm80,sm90,gfx942,gfx950"), "full", "3.6.0")
    assert jobs and {j.target.arch for j in jobs} == {"sm90"}
    assert {(j.spec["dtype"], j.spec["HEAD_DIM"], j.spec["CAUSAL"]) for j in jobs} == {
        (dt, d, c) for dt in ("fp16", "bf16") for d in (64, 128) for c in (0, 1, 2)}
    assert all(j.spec["HEAD_DIM"] == j.spec["HEAD_DIM_V"] and all(j.spec[k] == 0 for k in BASE) for j in jobs)


def test_gputest_holds_every_served_spec_and_default_none() -> None:
    from builder.registry import expand
    from builder.targets import parse_targets

    targets = parse_targets("sm80,sm90,gfx942")
    full = expand(_kernels()[NAME], targets, "full", "3.6.0")
    gputest = expand(_kernels()[NAME], targets, "gputest", "3.6.0")

    def key(job, drop=()):
        return tuple(sorted((k, v) for k, v in job.spec.items() if k not in drop))

    # Every spec it serves whose portable dQ the GPU test matrix holds (the rest of its backward
    # comes from those specs)...
    portable = {key(j) for j in expand(_kernels()["attn_bwd_dq"], targets, "gputest", "3.6.0")}
    assert sorted(j.label for j in gputest) == sorted(j.label for j in full if key(j) in portable)
    assert {j.spec["CAUSAL"] for j in gputest} == {0, 1, 2}
    assert expand(_kernels()[NAME], targets, "default", "3.6.0") == []
    # ... which are the Gluon dK/dV's, less its DQ_ATOMIC axis: the forced pair runs every spec.
    dkdv = expand(_kernels()["attn_bwd_dkdv_sm90"], targets, "gputest", "3.6.0")
    assert {key(j, ("DQ_ATOMIC",)) for j in dkdv} == {key(j) for j in gputest}


def test_its_runtime_arguments_grid_and_checks_are_attn_bwd_dqs_with_causal_align() -> None:
    kernels = _kernels()
    portable, gluon = kernels["attn_bwd_dq"], kernels[NAME]

    def runtime(k):
        return [(n, t) for n, t in k.signature.items() if t != "constexpr"]

    # attn_bwd_dq's arguments once it takes the run-time mask alignment (issue-10e's ABI).
    expected = runtime(portable)
    if ("causal_align", "i32") not in expected:
        at = expected.index(("window_right", "i32")) + 1
        expected = expected[:at] + [("causal_align", "i32")] + expected[at:]
    assert runtime(gluon) == expected
    assert dict(gluon.divisibility) == dict(portable.divisibility)
    assert gluon.grid == portable.grid
    # The portable kernel's checks hold too (the Gluon one adds non-empty extents for TMA).
    assert set(portable.checks) <= set(gluon.checks)
    assert "causal_align == 0 or causal_align == 1" in gluon.checks
    constexprs = [n for n, t in gluon.signature.items() if t == "constexpr"]
    assert constexprs[:len([n for n, t in portable.signature.items() if t == "constexpr"])] == [
        n for n, t in portable.signature.items() if t == "constexpr"]


def test_its_configs_keep_the_constexprs_the_grid_and_the_operator_read() -> None:
    from builder.kernels.attention_bwd_sm90 import CONSUMER_REGS
    from builder.targets import KNOWN

    decl = _kernels()[NAME]
    for spec in BUILT:
        configs = decl.configs_for(spec, KNOWN["sm90"])
        assert 1 <= len(configs) <= 3
        for c in configs:
            assert c.constexprs["BLOCK_M"] == 128 and c.constexprs["USE_TMA"] == 1
            assert c.constexprs["BLOCK_N"] in (64, 128)
            assert c.constexprs["CONSUMER_REGS"] == CONSUMER_REGS and c.backends == ("cuda",)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Config #0 of the BUILT specs, built by the builder, proof included."""
    from builder.build import build
    from builder.registry import expand
    from builder.targets import parse_targets

    jobs = [j for j in expand(_kernels()[NAME], parse_targets("sm90"), "full", "3.6.0")
            if j.spec in BUILT and j.config_index == 0]
    assert len(jobs) == len(BUILT)
    out = tmp_path_factory.mktemp("gluon_dq")
    summary = build(jobs, out, workers=1, timeout=600, keep_going=False, triton_version="3.6.0", quiet=True)
    assert summary.failed == [] and summary.compiled == len(BUILT)
    return out


def _variants(built: Path):
    from aotriton_rt.catalog import Catalog

    return Catalog.load(built / "catalog.json").variants


def test_sm90_gluon_dq_variants_compile_and_their_binaries_prove_the_catalog_layout(built: Path) -> None:
    from builder.build import prove_folder

    assert prove_folder(built) == len(BUILT)
    names = [n for n, t in _kernels()[NAME].signature.items() if t != "constexpr"]
    for variant in _variants(built):
        assert variant.kernel == NAME and variant.target.arch == "sm90"
        # Two consumer warp groups and the loader's group (its one warp padded to a group).
        assert variant.num_warps == 12 and variant.config.num_warps == 4
        # Four device-side TMA descriptors (Q, dO, K, V), 128 bytes each, in the runtime's global scratch.
        assert variant.scratch["global_size"] == 4 * 128 and variant.scratch["global_align"] == 128
        assert [a.name for a in variant.args] == names and "causal_align" in names
        assert variant.shared <= 232448


def test_a_catalog_that_lies_about_the_gluon_dq_binary_fails_the_abi_proof(built: Path) -> None:
    from builder.abi import AbiError, prove

    variant = _variants(built)[0]
    raw = lzma.decompress((built / variant.image.path).read_bytes())
    prove(variant.to_json(), raw)
    with pytest.raises(AbiError, match=r"num_warps .*catalog has \(128, 1, 1\), binary has \(384, 1, 1\)"):
        prove({**variant.to_json(), "num_warps": 4}, raw)


def _ops(built: Path, spec: dict) -> dict[str, int]:
    from tests.helpers.sass import sass_ops

    (variant,) = [v for v in _variants(built) if v.spec == spec]
    return sass_ops(lzma.decompress((built / variant.image.path).read_bytes()))


@pytest.mark.parametrize("index", range(len(BUILT)))
def test_ptxas_keeps_the_gluon_dq_wgmmas_asynchronous_and_spills_nothing(built: Path, index: int) -> None:
    """Three wgmma groups a key tile per consumer (S, dP: HEAD_DIM/16 k-steps each; dQ: BLOCK_N/16),
    in a masked and an unmasked copy of the loop, for both consumers: at least 4 HGMMA per
    warpgroup fence, else ptxas serialized them. Config #0's tiles fit the consumers' registers
    (measured: no spill store or load at either head dim)."""
    from builder.kernels.attention_bwd_dq_sm90 import TILES

    spec = BUILT[index]
    ops = _ops(built, spec)
    hgmma = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
    fences = ops.get("WARPGROUP.ARRIVE", 0)
    assert fences > 0 and hgmma >= 4 * fences, f"wgmma serialized by ptxas: {hgmma} HGMMA, {fences} fences"
    block_n = TILES[spec["HEAD_DIM"]][0][0]
    assert hgmma == 2 * 2 * (2 * spec["HEAD_DIM"] // 16 + block_n // 16)
    assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, (spec, ops.get("STL"), ops.get("LDL"))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
