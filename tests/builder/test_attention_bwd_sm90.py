"""The Gluon sm90 backward kernels through the builder, on the CPU, each beside the portable kernel it
stands in for: the dK/dV kernel (builder/kernels/attention_bwd_sm90.py, for ``attn_bwd_dkdv``) and
the dQ kernel (builder/kernels/attention_bwd_dq_sm90.py, for ``attn_bwd_dq``).

Each compiles for sm90 with the builder's own path, its binary proves the catalog's argument layout,
its argument list and grid are its portable kernel's (the operator passes the same values by name),
ptxas keeps its wgmmas asynchronous and spills (almost) nothing, and no other target or set builds it.
"""

from __future__ import annotations

import lzma
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("elftools")

NAME = "attn_bwd_dkdv_sm90"
BASE = {"BIAS": 0, "DROPOUT": 0, "VARLEN": 0, "DQ_ATOMIC": 0}
#: The variants compiled here: D=128 bottom-right causal (the training shape), D=128 top-left
#: (window arguments), D=64 without a mask.
BUILT = ({"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 2, **BASE},
         {"dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 1, **BASE},
         {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0, **BASE})
DQ_NAME = "attn_bwd_dq_sm90"
DQ_BASE = {k: v for k, v in BASE.items() if k != "DQ_ATOMIC"}
#: The same three for the dQ kernel (mode 1: the run-time alignment and window arguments).
DQ_BUILT = tuple({k: v for k, v in spec.items() if k != "DQ_ATOMIC"} for spec in BUILT)


@dataclass(frozen=True)
class Gluon:
    """One Gluon backward kernel: the portable kernel it stands in for, the spec axes it fixes, the
    specs compiled here (config #0), the tile a program owns (128 rows) and the one its loader
    streams through the ring, how many wgmma groups accumulate per streamed tile besides S and dP
    (dK and dV; dQ), and the most spill stores or loads ptxas may emit per head dim."""

    name: str
    portable: str
    base: dict
    built: tuple
    owned: str
    streamed: str
    accumulators: int
    spills: dict


#: D=128 dK/dV holds dK and dV (128 fp32 registers) plus S^T and dP^T (64) and their 16-bit copies:
#: ptxas spills some loop-invariant scalars (measured 29-44 stores, none in the query-tile loops
#: once LSE and Delta are loaded just before their use; 88-101 when they were held across the
#: waits). The dQ kernel's config #0 tiles fit the consumers' registers (measured: none at either
#: head dim). More means a regression.
KERNELS = (Gluon(NAME, "attn_bwd_dkdv", BASE, BUILT, "BLOCK_N", "BLOCK_M", 2, {64: 0, 128: 48}),
           Gluon(DQ_NAME, "attn_bwd_dq", DQ_BASE, DQ_BUILT, "BLOCK_M", "BLOCK_N", 1, {64: 0, 128: 0}))


def _kernels():
    from builder.registry import load_kernels

    return load_kernels()


@pytest.fixture(scope="module", params=KERNELS, ids=lambda g: g.name)
def gluon(request: pytest.FixtureRequest) -> Gluon:
    return request.param


def test_the_gluon_kernel_is_built_for_sm90_only_and_for_the_cases_it_serves(gluon: Gluon) -> None:
    from builder.registry import expand
    from builder.targets import parse_targets

    jobs = expand(_kernels()[gluon.name], parse_targets("sm80,sm90,gfx942,gfx950"), "full", "3.6.0")
    assert jobs and {j.target.arch for j in jobs} == {"sm90"}
    assert {(j.spec["dtype"], j.spec["HEAD_DIM"], j.spec["CAUSAL"]) for j in jobs} == {
        (dt, d, c) for dt in ("fp16", "bf16") for d in (64, 128) for c in (0, 1, 2)}
    assert all(j.spec["HEAD_DIM"] == j.spec["HEAD_DIM_V"] and all(j.spec[k] == 0 for k in gluon.base) for j in jobs)


def _key(job, drop=()):
    return tuple(sorted((k, v) for k, v in job.spec.items() if k not in drop))


def test_gputest_holds_every_served_spec_and_default_none(gluon: Gluon) -> None:
    from builder.registry import expand
    from builder.targets import parse_targets

    targets = parse_targets("sm80,sm90,gfx942")
    full = expand(_kernels()[gluon.name], targets, "full", "3.6.0")
    gputest = expand(_kernels()[gluon.name], targets, "gputest", "3.6.0")
    # Every spec it serves whose portable kernel the GPU test matrix holds (the rest of its
    # backward comes from those specs).
    portable = {_key(j) for j in expand(_kernels()[gluon.portable], targets, "gputest", "3.6.0")}
    assert sorted(j.label for j in gputest) == sorted(j.label for j in full if _key(j) in portable)
    assert {j.spec["CAUSAL"] for j in gputest} == {0, 1, 2}
    assert expand(_kernels()[gluon.name], targets, "default", "3.6.0") == []


def test_the_gluon_dq_serves_the_gluon_dkdvs_gputest_specs() -> None:
    """Less the dK/dV's DQ_ATOMIC axis: a forced Gluon pair runs every spec either serves."""
    from builder.registry import expand
    from builder.targets import parse_targets

    targets = parse_targets("sm80,sm90,gfx942")
    dkdv = expand(_kernels()[NAME], targets, "gputest", "3.6.0")
    dq = expand(_kernels()[DQ_NAME], targets, "gputest", "3.6.0")
    assert {_key(j, ("DQ_ATOMIC",)) for j in dkdv} == {_key(j) for j in dq}


def test_its_runtime_arguments_grid_and_checks_are_the_portable_kernels(gluon: Gluon) -> None:
    kernels = _kernels()
    portable, own = kernels[gluon.portable], kernels[gluon.name]

    def runtime(k):
        return [(n, t) for n, t in k.signature.items() if t != "constexpr"]

    def constexprs(k):
        return [n for n, t in k.signature.items() if t == "constexpr"]

    assert runtime(own) == runtime(portable) and ("causal_align", "i32") in runtime(own)
    assert dict(own.divisibility) == dict(portable.divisibility)
    assert own.grid == portable.grid
    # The portable kernel's checks hold too (the Gluon one adds non-empty extents for TMA).
    assert set(portable.checks) <= set(own.checks)
    assert "causal_align == 0 or causal_align == 1" in own.checks
    assert constexprs(own)[:len(constexprs(portable))] == constexprs(portable)


def test_its_configs_keep_the_constexprs_the_grid_and_the_operator_read(gluon: Gluon) -> None:
    from builder.kernels.attention_bwd_sm90 import CONSUMER_REGS
    from builder.targets import KNOWN

    decl = _kernels()[gluon.name]
    for spec in gluon.built:
        configs = decl.configs_for(spec, KNOWN["sm90"])
        assert 1 <= len(configs) <= 3
        for c in configs:
            assert c.constexprs[gluon.owned] == 128 and c.constexprs["USE_TMA"] == 1
            assert c.constexprs[gluon.streamed] in (64, 128)
            assert c.constexprs["CONSUMER_REGS"] == CONSUMER_REGS and c.backends == ("cuda",)


_BUILT_FOLDERS: dict[str, Path] = {}


def _build(gluon: Gluon, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Config #0 of ``gluon.built``, built by the builder, proof included (once per kernel)."""
    from builder.build import build
    from builder.registry import expand
    from builder.targets import parse_targets

    if gluon.name not in _BUILT_FOLDERS:
        jobs = [j for j in expand(_kernels()[gluon.name], parse_targets("sm90"), "full", "3.6.0")
                if j.spec in gluon.built and j.config_index == 0]
        assert len(jobs) == len(gluon.built)
        out = tmp_path_factory.mktemp(gluon.name)
        summary = build(jobs, out, workers=1, timeout=600, keep_going=False, triton_version="3.6.0", quiet=True)
        assert summary.failed == [] and summary.compiled == len(gluon.built)
        _BUILT_FOLDERS[gluon.name] = out
    return _BUILT_FOLDERS[gluon.name]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dK/dV kernel's BUILT variants (config #0), built by the builder, proof included."""
    return _build(KERNELS[0], tmp_path_factory)


@pytest.fixture(scope="module")
def compiled(gluon: Gluon, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``gluon``'s built variants (config #0), built by the builder, proof included."""
    return _build(gluon, tmp_path_factory)


def _variants(built: Path):
    from aotriton_rt.catalog import Catalog

    return Catalog.load(built / "catalog.json").variants


def test_sm90_gluon_variants_compile_and_their_binaries_prove_the_catalog_layout(gluon: Gluon,
                                                                                  compiled: Path) -> None:
    from builder.build import prove_folder

    assert prove_folder(compiled) == len(gluon.built)
    portable_args = [n for n, t in _kernels()[gluon.portable].signature.items() if t != "constexpr"]
    for variant in _variants(compiled):
        assert variant.kernel == gluon.name and variant.target.arch == "sm90"
        # Two consumer warp groups and the loader's group (its one warp padded to a group).
        assert variant.num_warps == 12 and variant.config.num_warps == 4
        # Four device-side TMA descriptors (Q, dO, K, V), 128 bytes each, in the runtime's global scratch.
        assert variant.scratch["global_size"] == 4 * 128 and variant.scratch["global_align"] == 128
        assert [a.name for a in variant.args] == portable_args
        assert variant.shared <= 232448


def test_a_catalog_that_lies_about_the_gluon_binary_fails_the_abi_proof(compiled: Path) -> None:
    from builder.abi import AbiError, prove

    variant = _variants(compiled)[0]
    raw = lzma.decompress((compiled / variant.image.path).read_bytes())
    prove(variant.to_json(), raw)
    with pytest.raises(AbiError, match=r"num_warps .*catalog has \(128, 1, 1\), binary has \(384, 1, 1\)"):
        prove({**variant.to_json(), "num_warps": 4}, raw)


def _variant(built: Path, spec: dict):
    (variant,) = [v for v in _variants(built) if v.spec == spec]
    return variant


def _ops(built: Path, spec: dict) -> dict[str, int]:
    from tests.helpers.sass import sass_ops

    return sass_ops(lzma.decompress((built / _variant(built, spec).image.path).read_bytes()))


@pytest.mark.parametrize("index", range(len(BUILT)))
def test_ptxas_keeps_the_gluon_wgmmas_asynchronous(gluon: Gluon, compiled: Path, index: int) -> None:
    """Per streamed tile and consumer, S and dP (HEAD_DIM/16 k-steps each) and the accumulating
    groups (dK and dV, or dQ: streamed tile/16 each), in a masked and an unmasked copy of the loop,
    for both consumers: at least 4 HGMMA per warpgroup fence, else ptxas serialized them."""
    spec = gluon.built[index]
    ops = _ops(compiled, spec)
    hgmma = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
    fences = ops.get("WARPGROUP.ARRIVE", 0)
    assert fences > 0 and hgmma >= 4 * fences, f"wgmma serialized by ptxas: {hgmma} HGMMA, {fences} fences"
    streamed = _variant(compiled, spec).config.constexprs[gluon.streamed]
    assert hgmma == 2 * 2 * (2 * spec["HEAD_DIM"] // 16 + gluon.accumulators * streamed // 16)


def test_ptxas_spills_nothing_at_head_dim_64_and_little_at_128(gluon: Gluon, compiled: Path) -> None:
    """At most ``gluon.spills`` spill stores and loads per head dim (see KERNELS)."""
    for spec in gluon.built:
        ops, most = _ops(compiled, spec), gluon.spills[spec["HEAD_DIM"]]
        assert ops.get("STL", 0) <= most and ops.get("LDL", 0) <= most, (spec, ops.get("STL"), ops.get("LDL"))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
