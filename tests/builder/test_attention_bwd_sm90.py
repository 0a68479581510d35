"""The Gluon sm90 dK/dV kernel (builder/kernels/attention_bwd_sm90.py) through the builder, on the CPU.

It compiles for sm90 with the builder's own path (split scheme, and with DQ_ATOMIC=1 the atomic
scheme's dK/dV that also adds dQ), its binary proves the catalog's argument layout, its argument
list and grid are attn_bwd_dkdv's (the operator passes the same values by name), ptxas keeps its
wgmmas asynchronous, its dQ additions are vectorised fp32 reductions, and no other target or set
builds it.
"""

from __future__ import annotations

import lzma
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("elftools")

NAME = "attn_bwd_dkdv_sm90"
BASE = {"BIAS": 0, "DROPOUT": 0, "VARLEN": 0, "DQ_ATOMIC": 0}
ATOMIC = {**BASE, "DQ_ATOMIC": 1}
#: The variants compiled here: D=128 bottom-right causal (the training shape), D=128 top-left
#: (window arguments), D=64 without a mask; then the atomic scheme's at D=128 causal and D=64, and
#: at D=128 without a mask FA3's split of the dQ tile (DQ_SHARE=1, config #2).
BUILT = ({"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 2, **BASE},
         {"dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 1, **BASE},
         {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0, **BASE},
         {"dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 1, **ATOMIC},
         {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 2, **ATOMIC},
         {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 0, **ATOMIC})
#: The config built for each of BUILT (#0 unless listed).
CONFIG = {5: 2}
SPLIT_BUILT = BUILT[:3]
SHARED = 5


def _kernels():
    from builder.registry import load_kernels

    return load_kernels()


def test_the_gluon_dkdv_is_built_for_sm90_only_and_for_the_cases_it_serves() -> None:
    from builder.registry import expand
    from builder.targets import parse_targets

    jobs = expand(_kernels()[NAME], parse_targets("sm80,sm90,gfx942,gfx950"), "full", "3.6.0")
    assert jobs and {j.target.arch for j in jobs} == {"sm90"}
    assert {(j.spec["dtype"], j.spec["HEAD_DIM"], j.spec["CAUSAL"], j.spec["DQ_ATOMIC"]) for j in jobs} == {
        (dt, d, c, a) for dt in ("fp16", "bf16") for d in (64, 128) for c in (0, 1, 2) for a in (0, 1)}
    assert all(j.spec["HEAD_DIM"] == j.spec["HEAD_DIM_V"] and all(j.spec[k] == 0 for k in ("BIAS", "DROPOUT", "VARLEN"))
               for j in jobs)


def test_gputest_holds_every_served_spec_and_default_none() -> None:
    from builder.registry import expand
    from builder.targets import parse_targets

    targets = parse_targets("sm80,sm90,gfx942")
    full = expand(_kernels()[NAME], targets, "full", "3.6.0")
    gputest = expand(_kernels()[NAME], targets, "gputest", "3.6.0")
    # Every spec it serves whose portable dK/dV the GPU test matrix holds (the rest of its
    # backward, preprocess and dQ, comes from those specs).
    def key(job):
        return tuple(sorted(job.spec.items()))

    portable = {key(j) for j in expand(_kernels()["attn_bwd_dkdv"], targets, "gputest", "3.6.0")
                if j.spec["DQ_ATOMIC"] == 0}

    def split_twin(job):
        return tuple(sorted({**job.spec, "DQ_ATOMIC": 0}.items()))

    # With DQ_ATOMIC 0 and 1: the atomic scheme's dK/dV for every spec of the split one.
    assert sorted(j.label for j in gputest) == sorted(j.label for j in full if split_twin(j) in portable)
    assert {j.spec["CAUSAL"] for j in gputest} == {0, 1, 2}
    assert ({split_twin(j) for j in gputest if j.spec["DQ_ATOMIC"]}
            == {split_twin(j) for j in gputest if not j.spec["DQ_ATOMIC"]})
    assert expand(_kernels()[NAME], targets, "default", "3.6.0") == []


def test_gputest_holds_the_rest_of_each_gluon_atomic_backward_but_not_the_portable_atomic_dkdv() -> None:
    """The atomic scheme needs the preprocess (DQ_ATOMIC=1, which zeroes DQacc) and the convert
    kernel for every spec whose Gluon atomic dK/dV gputest holds; on sm90 only (other targets'
    gputest is unchanged), and no portable atomic dK/dV beyond the GPU matrix's own combinations."""
    from builder.registry import expand
    from builder.targets import parse_targets

    kernels = _kernels()
    sm90 = parse_targets("sm90")

    def specs(name, targets=sm90):
        return {tuple(sorted(j.spec.items())) for j in expand(kernels[name], targets, "gputest", "3.6.0")}

    gluon = [dict(s) for s in specs(NAME) if dict(s)["DQ_ATOMIC"]]
    assert {(s["dtype"], s["HEAD_DIM"]) for s in gluon} == {(dt, d) for dt in ("fp16", "bf16") for d in (64, 128)}
    pre, convert = specs("attn_bwd_preprocess"), specs("attn_bwd_dq_convert")
    for s in gluon:
        assert tuple(sorted({"dtype": s["dtype"], "HEAD_DIM": s["HEAD_DIM"], "HEAD_DIM_V": s["HEAD_DIM"], "VARLEN": 0,
                             "DQ_ATOMIC": 1}.items())) in pre
        assert tuple(sorted({"dtype": s["dtype"], "HEAD_DIM": s["HEAD_DIM"], "VARLEN": 0}.items())) in convert
    sm80 = parse_targets("sm80")
    assert specs("attn_bwd_dq_convert", sm80) <= convert and specs("attn_bwd_preprocess", sm80) < pre
    assert specs("attn_bwd_dkdv") == specs("attn_bwd_dkdv", sm80)


def test_its_runtime_arguments_grid_and_checks_are_attn_bwd_dkdvs() -> None:
    kernels = _kernels()
    portable, gluon = kernels["attn_bwd_dkdv"], kernels[NAME]

    def runtime(k):
        return [(n, t) for n, t in k.signature.items() if t != "constexpr"]

    assert runtime(gluon) == runtime(portable)
    assert dict(gluon.divisibility) == dict(portable.divisibility)
    assert gluon.grid == portable.grid
    # The portable kernel's checks hold too (the Gluon one adds non-empty extents for TMA).
    assert set(portable.checks) <= set(gluon.checks)


def test_its_configs_keep_the_constexprs_the_grid_and_the_operator_read() -> None:
    from builder.kernels.attention_bwd_sm90 import CONSUMER_REGS
    from builder.targets import KNOWN

    decl = _kernels()[NAME]
    for spec in BUILT:
        configs = decl.configs_for(spec, KNOWN["sm90"])  # the same tiles for both schemes
        shares = [c.constexprs["DQ_SHARE"] for c in configs]
        # The atomic scheme at D=128 runs each tile with each dQ split, the per-consumer one first.
        if spec["DQ_ATOMIC"] and spec["HEAD_DIM"] == 128:
            assert shares == [0, 0, 1, 1] and configs[CONFIG[SHARED]].constexprs["DQ_SHARE"] == 1
        else:
            assert 1 <= len(configs) <= 3 and set(shares) == {0}
        for c in configs:
            assert c.constexprs["BLOCK_N"] == 128 and c.constexprs["USE_TMA"] == 1
            assert c.constexprs["BLOCK_M"] == 64  # the atomic dQ tile has dK's shape
            assert c.constexprs["CONSUMER_REGS"] == CONSUMER_REGS and c.backends == ("cuda",)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Config #0 of the BUILT specs, built by the builder, proof included."""
    from builder.build import build
    from builder.registry import expand
    from builder.targets import parse_targets

    jobs = [j for j in expand(_kernels()[NAME], parse_targets("sm90"), "full", "3.6.0")
            if j.spec in BUILT and j.config_index == CONFIG.get(BUILT.index(j.spec), 0)]
    assert len(jobs) == len(BUILT)
    out = tmp_path_factory.mktemp("gluon_bwd")
    summary = build(jobs, out, workers=1, timeout=600, keep_going=False, triton_version="3.6.0", quiet=True)
    assert summary.failed == [] and summary.compiled == len(BUILT)
    return out


def _variants(built: Path):
    from aotriton_rt.catalog import Catalog

    return Catalog.load(built / "catalog.json").variants


def test_sm90_gluon_dkdv_variants_compile_and_their_binaries_prove_the_catalog_layout(built: Path) -> None:
    from builder.build import prove_folder

    assert prove_folder(built) == len(BUILT)
    portable_args = [n for n, t in _kernels()["attn_bwd_dkdv"].signature.items() if t != "constexpr"]
    for variant in _variants(built):
        assert variant.kernel == NAME and variant.target.arch == "sm90"
        # Two consumer warp groups and the loader's group (its one warp padded to a group).
        assert variant.num_warps == 12 and variant.config.num_warps == 4
        # Four device-side TMA descriptors (Q, dO, K, V), 128 bytes each, in the runtime's global scratch.
        assert variant.scratch["global_size"] == 4 * 128 and variant.scratch["global_align"] == 128
        assert [a.name for a in variant.args] == portable_args
        assert variant.shared <= 232448
    # The atomic scheme adds two 64 x 64 dS^T tiles (16-bit) to the split one's shared memory,
    # four (double-buffered) with DQ_SHARE.
    shared = {tuple(sorted(v.spec.items())): v.shared for v in _variants(built)}
    atomic, split = (tuple(sorted(spec.items())) for spec in (BUILT[3], {**BUILT[3], "DQ_ATOMIC": 0}))
    assert BUILT[1] == dict(split) and shared[atomic] - shared[split] >= 2 * 64 * 64 * 2
    assert shared[tuple(sorted(BUILT[SHARED].items()))] - shared[split] >= 4 * 64 * 64 * 2


def test_a_catalog_that_lies_about_the_gluon_dkdv_binary_fails_the_abi_proof(built: Path) -> None:
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
def test_ptxas_keeps_the_gluon_dkdv_wgmmas_asynchronous(built: Path, index: int) -> None:
    """Four wgmma groups a query tile per consumer (S^T, dP^T: HEAD_DIM/16 k-steps each; dV, dK:
    BLOCK_M/16 = 4 each), in a masked and an unmasked copy of the loop, for both consumers: at
    least 4 HGMMA per warpgroup fence, else ptxas serialized them."""
    ops = _ops(built, BUILT[index])
    hgmma = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
    fences = ops.get("WARPGROUP.ARRIVE", 0)
    assert fences > 0 and hgmma >= 4 * fences, f"wgmma serialized by ptxas: {hgmma} HGMMA, {fences} fences"
    d = BUILT[index]["HEAD_DIM"]
    # With DQ_ATOMIC, dQ = dS·K: 64 keys deep (4 k-steps) per 64-column chunk, D/16 in all.
    dq = d // 16 if BUILT[index]["DQ_ATOMIC"] else 0
    assert hgmma == 2 * 2 * (2 * d // 16 + 2 * 64 // 16 + dq)


def test_ptxas_spills_nothing_at_head_dim_64_and_little_at_128(built: Path) -> None:
    """D=64 fits the consumers' 240 registers. D=128 holds dK and dV (128 fp32 registers) plus S^T
    and dP^T (64) and their 16-bit copies: ptxas spills some loop-invariant scalars (measured: 29-44
    stores, none in the query-tile loops once LSE and Delta are loaded just before their use; 88-101
    when they were held across the waits). More means a regression."""
    for spec in (BUILT[2], BUILT[4]):
        d64 = _ops(built, spec)
        assert d64.get("STL", 0) == 0 and d64.get("LDL", 0) == 0, spec
    for spec in BUILT[:2]:
        ops = _ops(built, spec)
        assert ops.get("STL", 0) <= 48 and ops.get("LDL", 0) <= 48, (spec, ops.get("STL"), ops.get("LDL"))
    # The atomic scheme at D=128 holds a 64 x 64 dQ chunk (32 registers) beside dK and dV: ptxas
    # spills more (measured: 69-80 stores, 77-92 loads, 9-18 reloads a query tile; DQ_SHARE=1 99-104
    # and 85-87, 16-26 reloads a tile). A whole 64 x 128 dQ tile spilled 107 and serialized every wgmma.
    for spec in (BUILT[3], BUILT[SHARED]):
        ops = _ops(built, spec)
        assert ops.get("STL", 0) <= 112 and ops.get("LDL", 0) <= 112, (spec, ops.get("STL"), ops.get("LDL"))


@pytest.mark.parametrize("index", range(len(SPLIT_BUILT), len(BUILT)))
def test_the_atomic_dkdv_adds_dq_with_vectorised_fp32_reductions_and_the_split_one_adds_none(built: Path,
                                                                                             index: int) -> None:
    """Each consumer thread adds its 64 x D/128 share of a dQ tile (D/256 with DQ_SHARE: half the
    columns) as pairs of adjacent fp32 values (``atom...add.v2.f32``, result unused: ptxas writes
    it to RZ, a fire-and-forget reduction), in the masked and the unmasked copy of the loop, for
    both consumers; the split scheme's kernel has no atomics but the TMA descriptors' (EXCH)."""
    import re

    d = BUILT[index]["HEAD_DIM"]
    per_thread = 64 * d // 128 // (2 if index == SHARED else 1)
    ops = _ops(built, BUILT[index])
    assert ops.get("ATOMG.E.ADD.F32") == 2 * 2 * per_thread // 2
    (variant,) = [v for v in _variants(built) if v.spec == BUILT[index]]
    ptx = lzma.decompress((built / variant.ptx.path).read_bytes()).decode()
    adds = re.findall(r"\batom\.global\.[\w.]*add\.(v\d\.)?f32", ptx)
    assert adds and all(v == "v2." for v in adds) and len(adds) == 2 * per_thread
    for spec in SPLIT_BUILT:
        assert not any(op.startswith("ATOMG.E.ADD") for op in _ops(built, spec))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
