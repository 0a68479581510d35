"""The Gluon sm90 forward (builder/kernels/attention_sm90.py) through the builder, on the CPU.

It compiles for sm90 with the builder's own path (GluonASTSource), its binary proves the
catalog's argument layout, its argument list is attn_fwd's (the operator passes the same values
by name), and no other target builds it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("triton")
pytest.importorskip("elftools")


def _kernels():
    from builder.registry import load_kernels

    return load_kernels()


def test_the_gluon_forward_is_built_for_sm90_only() -> None:
    from builder.registry import expand
    from builder.targets import parse_targets

    jobs = expand(_kernels()["attn_fwd_sm90"], parse_targets("sm80,sm90,gfx942,gfx950"), "full", "3.6.0")
    assert jobs and {j.target.arch for j in jobs} == {"sm90"}
    assert {j.spec["dtype"] for j in jobs} == {"fp16", "bf16"}
    assert all(j.spec["HEAD_DIM"] == j.spec["HEAD_DIM_V"] for j in jobs)


def test_the_default_set_holds_its_first_config_at_head_dim_128_without_a_mask_and_in_mask_mode_1() -> None:
    from builder.registry import expand
    from builder.targets import parse_targets

    # Mode 1 takes the band's alignment at run time (causal_align), so it serves both alignments.
    jobs = expand(_kernels()["attn_fwd_sm90"], parse_targets("sm80,sm90,gfx942"), "default", "3.6.0")
    assert sorted((j.spec["dtype"], j.spec["CAUSAL"]) for j in jobs) == [
        (dt, c) for dt in ("bf16", "fp16") for c in (0, 1)]
    assert {(j.target.arch, j.spec["HEAD_DIM"], j.config_index) for j in jobs} == {("sm90", 128, 0)}


def test_its_runtime_arguments_are_attn_fwds_in_order_and_type() -> None:
    kernels = _kernels()
    portable, gluon = kernels["attn_fwd"], kernels["attn_fwd_sm90"]

    def runtime(k):
        return [(n, t) for n, t in k.signature.items() if t != "constexpr"]

    assert runtime(gluon) == runtime(portable)
    assert {n: d for n, d in gluon.divisibility.items()} == dict(portable.divisibility)


def test_the_builder_picks_gluons_source_class_for_gluon_kernels_only() -> None:
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    from builder.compile import source_class

    kernels = _kernels()
    assert source_class(kernels["attn_fwd_sm90"].fn) is GluonASTSource
    assert source_class(kernels["attn_fwd"].fn) is ASTSource


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two variants of bf16 D=64 bottom-right causal built by the builder, proof included: config #0
    (loader warp, two consumer warp groups) and #3 (one consumer issuing its own loads)."""
    from builder.build import build
    from builder.registry import expand
    from builder.targets import parse_targets

    want = {"dtype": "bf16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 2, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0}
    jobs = [j for j in expand(_kernels()["attn_fwd_sm90"], parse_targets("sm90"), "full", "3.6.0")
            if j.spec == want and j.config_index in (0, 3)]
    assert len(jobs) == 2 and [j.config.constexprs["WARP_SPECIALIZE"] for j in jobs] == [1, 0]
    out = tmp_path_factory.mktemp("gluon")
    summary = build(jobs, out, workers=1, timeout=600, keep_going=False, triton_version="3.6.0", quiet=True)
    assert summary.failed == [] and summary.compiled == 2
    return out


def _variant(built: Path, index: int):
    from aotriton_rt.catalog import Catalog

    (variant,) = [v for v in Catalog.load(built / "catalog.json").variants if v.config.index == index]
    return variant


def test_sm90_gluon_variants_compile_and_their_binaries_prove_the_catalog_layout(built: Path) -> None:
    from builder.build import prove_folder
    from builder.kernels.attention_sm90 import CONSUMER_REGS

    assert prove_folder(built) == 2
    variant = _variant(built, 0)
    assert variant.kernel == "attn_fwd_sm90" and variant.target.arch == "sm90"
    # Two consumer warp groups and the loader's group (its one warp padded to a group).
    assert variant.num_warps == 12 and variant.config.num_warps == 4
    assert variant.config.constexprs["CONSUMER_REGS"] == CONSUMER_REGS
    # Three device-side TMA descriptors (Q, K, V), 128 bytes each, in the runtime's global scratch.
    assert variant.scratch["global_size"] == 3 * 128 and variant.scratch["global_align"] == 128
    # attn_fwd's argument list: the operator's argument values fit unchanged.
    assert [a.name for a in variant.args] == [n for n, t in _kernels()["attn_fwd"].signature.items()
                                              if t != "constexpr"]
    assert variant.shared <= 232448
    # Without the loader warp: one 4-warp consumer of 64 rows, small enough for two programs per SM.
    inline = _variant(built, 3)
    assert inline.num_warps == 4 and inline.config.constexprs["BLOCK_M"] == 64
    assert [a.name for a in inline.args] == [a.name for a in variant.args]
    assert 2 * (inline.shared + 1024) <= 233472


def test_a_catalog_that_lies_about_the_gluon_binary_fails_the_abi_proof(built: Path) -> None:
    import lzma

    from builder.abi import AbiError, prove

    variant = _variant(built, 0)
    raw = lzma.decompress((built / variant.image.path).read_bytes())
    prove(variant.to_json(), raw)
    wrong_warps = {**variant.to_json(), "num_warps": 4}  # the binary requires 12 warps (384 threads)
    with pytest.raises(AbiError, match=r"num_warps .*catalog has \(128, 1, 1\), binary has \(384, 1, 1\)"):
        prove(wrong_warps, raw)
    args = [dict(a) for a in variant.to_json()["args"]]
    args[-1]["offset"] += 4  # causal_align moved
    with pytest.raises(AbiError, match=r"ABI mismatch in attn_fwd_sm90 .*args\[\d+\]\.offset"):
        prove({**variant.to_json(), "args": args}, raw)


@pytest.mark.parametrize("index", [0, 3])
def test_ptxas_keeps_the_gluon_wgmmas_asynchronous_and_spills_nothing(built: Path, index: int) -> None:
    """ptxas serializes wgmma (a fence and a wait around each instruction) when it cannot prove
    in-flight operand registers safe, a silent 2x loss; P stays in registers across its P.V here."""
    import lzma

    from tests.helpers.sass import sass_ops

    variant = _variant(built, index)
    ops = sass_ops(lzma.decompress((built / variant.image.path).read_bytes()))
    hgmma = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
    fences = ops.get("WARPGROUP.ARRIVE", 0)
    # D=64: 4 k-steps for Q.K^T, and 8 (128-key blocks) or 4 (64-key blocks) for P.V per issue site.
    assert hgmma >= 4 * fences > 0, f"wgmma serialized by ptxas: {hgmma} HGMMA, {fences} fences"
    assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, "register spills"


class _Shaped:
    """Stands in for a tensor where only shape and strides are read (launch_args)."""

    def __init__(self, *shape: int) -> None:
        self.shape = shape

    def stride(self) -> tuple:
        out, acc = [], 1
        for n in reversed(self.shape):
            out.insert(0, acc)
            acc *= n
        return tuple(out)


def test_the_levers_bench_loads_the_built_variant_with_attn_fwds_argument_list(built: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import sm90_levers

    contenders = sm90_levers.contenders_of({"gluon-test": str(built)})
    assert sorted(c.label.split()[0] for c in contenders) == ["gluon-test#0", "gluon-test#3"]
    contender = next(c for c in contenders if c.index == 0)
    assert contender.label.startswith("gluon-test#0 128x128 w4s1 ")
    q = _Shaped(2, 3, 100, 64)
    args = sm90_levers.launch_args(q, q, q, q, _Shaped(2, 3, 100), causal=2, scale=0.125)
    assert len(args) == len(contender.handle.arg_names)
    named = dict(zip(contender.handle.arg_names, args))
    assert (named["seqlen_q"], named["window_left"], named["window_right"], named["stride_lh"]) == (100, -1, 0, 100)
    assert named["causal_align"] == 1  # a bottom-right call


def test_every_lever_expands_to_sm90_jobs_of_the_benchmarked_specs() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import sm90_levers

    specs = sm90_levers.bench_specs(sm90_levers.SHAPES)
    kernels = {"ours": "attn_fwd", "sweep": "attn_fwd", "ws": "attn_fwd", "gluon": "attn_fwd_sm90"}
    for lever in sm90_levers.LEVERS:
        jobs = sm90_levers.lever_jobs(lever, specs, "3.6.0")
        assert jobs, lever
        assert {j.kernel for j in jobs} == {kernels[lever]} and {j.target.arch for j in jobs} == {"sm90"}
        assert {json.dumps(j.spec, sort_keys=True) for j in jobs} == {json.dumps(s, sort_keys=True) for s in specs}
        if lever == "sweep":  # per spec, only configs the registry's table lacks
            table = _kernels()["attn_fwd"].configs_for
            assert not [j.label for j in jobs if j.config in table(j.spec, j.target)]
    with pytest.raises(ValueError, match="unknown lever 'fast'; levers: ours, sweep, gluon, ws"):
        sm90_levers.lever_jobs("fast", specs, "3.6.0")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_every_gputest_gluon_forward_has_its_attn_fwd_twin_so_dispatch_can_reach_it() -> None:
    # The forward's spec is chosen among attn_fwd's variants; a Gluon variant whose spec attn_fwd
    # lacks in the same set is built and tested by nothing (the JAX every-kernel test caught one).
    from builder.registry import expand
    from builder.targets import parse_targets

    def specs(name):
        return {tuple(sorted(j.spec.items())) for j in expand(_kernels()[name], parse_targets("sm90"), "gputest",
                                                                "3.6.0")}

    assert specs("attn_fwd_sm90") and specs("attn_fwd_sm90") <= specs("attn_fwd")
