"""The Gluon sm90 backward kernels through the builder, on the CPU, each beside the portable kernel it
stands in for: the dK/dV kernel (builder/kernels/attention_bwd_sm90.py, for ``attn_bwd_dkdv``) and
the dQ kernel (builder/kernels/attention_bwd_dq_sm90.py, for ``attn_bwd_dq``).

Each compiles for sm90 with the builder's own path, its binary proves the catalog's argument layout,
its argument list and grid are its portable kernel's (the operator passes the same values by name),
ptxas keeps its wgmmas asynchronous and spills (almost) nothing, and no other target or set builds it.
The dK/dV kernel is built in both backward schemes: split (``DQ_ATOMIC=0``) and atomic
(``DQ_ATOMIC=1``: it also adds dQ into the fp32 DQacc with vectorised fp32 reductions, computing dK
and dV as the split one does); the dQ kernel belongs to the split scheme only. The dK/dV kernel's aligned-length sibling
(``attn_bwd_dkdv_sm90_a16``: lengths and LSE strides declared multiples of 16) is built once beside it:
its catalog declares those facts, and its unmasked tiles are shorter.
"""

from __future__ import annotations

import lzma
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("elftools")

NAME = "attn_bwd_dkdv_sm90"
BASE = {"BIAS": 0, "DROPOUT": 0, "VARLEN": 0, "DQ_ATOMIC": 0, "SOFTCAP": 0, "ALIBI": 0}
ATOMIC = {**BASE, "DQ_ATOMIC": 1}
#: The variants compiled here: D=128 bottom-right causal (the training shape), D=128 top-left
#: (window arguments), D=64 without a mask; then the atomic scheme's at D=128 top-left (BUILT[1]'s
#: twin) and D=64 bottom-right, at D=128 without a mask FA3's split of the dQ tile (DQ_SHARE=1,
#: config #2); then the atomic scheme with its dQ tiles reduced through TMA (DQ_TMA=1): FA3's split
#: (bf16 D=128 no mask, config #5), per consumer at D=64 (top-left, config #2) and at D=128 in two
#: chunks (BUILT[0]'s twin, config #4).
BUILT = ({"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 2, **BASE},
         {"dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 1, **BASE},
         {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0, **BASE},
         {"dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 1, **ATOMIC},
         {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 2, **ATOMIC},
         {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 0, **ATOMIC},
         {"dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 0, **ATOMIC},
         {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 1, **ATOMIC},
         {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 2, **ATOMIC})
SPLIT_BUILT = BUILT[:3]
#: BUILT's index of the DQ_SHARE=1 variant.
SHARED = 5
#: BUILT's indices of the DQ_TMA=1 variants: {index: (config, DQ_SHARE)}.
TMA = {6: (5, 1), 7: (2, 0), 8: (4, 0)}
#: BUILT's atomic variants whose dQ is added by per-thread fp32 reductions.
ATOMIC_ADDS = (3, 4, SHARED)
DQ_NAME = "attn_bwd_dq_sm90"
DQ_BASE = {k: v for k, v in BASE.items() if k != "DQ_ATOMIC"}
#: The split scheme's three for the dQ kernel (mode 1: the run-time alignment and window arguments).
DQ_BUILT = tuple({k: v for k, v in spec.items() if k != "DQ_ATOMIC"} for spec in SPLIT_BUILT)


@dataclass(frozen=True)
class Gluon:
    """One Gluon backward kernel: the portable kernel it stands in for, the spec axes it fixes at 0,
    the ``DQ_ATOMIC`` values it is compiled with (none: no such axis), the specs compiled here and
    the config of each (#0 unless ``configs`` says), the tile a program owns (128 rows) and the one
    its loader streams through the ring, how many wgmma groups accumulate per streamed tile besides
    S and dP (dK and dV; dQ), and the most spill stores or loads ptxas may emit per (head dim,
    ``DQ_ATOMIC``)."""

    name: str
    portable: str
    base: dict
    schemes: tuple
    built: tuple
    configs: dict
    owned: str
    streamed: str
    accumulators: int
    spills: dict

    def config(self, spec: dict) -> int:
        return self.configs.get(self.built.index(spec), 0)


#: D=128 dK/dV holds dK and dV (128 fp32 registers) plus S^T and dP^T (64) and their 16-bit copies:
#: ptxas spills some loop-invariant scalars (measured 29-44 stores, none in the query-tile loops
#: once LSE and Delta are loaded just before their use; 88-101 when they were held across the
#: waits). The atomic scheme at D=128 also holds a 64 x 64 dQ chunk (32 registers): measured 69-80
#: stores, 77-92 loads, 9-18 reloads a query tile; DQ_SHARE=1 99-104 and 85-87, 16-26 reloads a
#: tile (a whole 64 x 128 dQ tile spilled 107 and serialized every wgmma); through TMA (no per-thread
#: pointers) DQ_SHARE=1 58 stores and 31 loads. The dQ kernel's config
#: #0 tiles fit the consumers' registers (measured: none at either head dim). More means a regression.
KERNELS = (Gluon(NAME, "attn_bwd_dkdv", DQ_BASE, (0, 1), BUILT, {SHARED: 2, **{i: c for i, (c, _) in TMA.items()}},
                 "BLOCK_N", "BLOCK_M", 2,
                 {(64, 0): 0, (128, 0): 48, (64, 1): 0, (128, 1): 112}),
           Gluon(DQ_NAME, "attn_bwd_dq", DQ_BASE, (), DQ_BUILT, {}, "BLOCK_M", "BLOCK_N", 1,
                 {(64, 0): 0, (128, 0): 0}))


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
    # The dK/dV kernel in both schemes (DQ_ATOMIC 0 and 1), the dQ kernel in the split one (no such axis).
    schemes = [(a,) for a in gluon.schemes] or [()]
    axes = ("dtype", "HEAD_DIM", "CAUSAL") + (("DQ_ATOMIC",) if gluon.schemes else ())
    assert {tuple(j.spec[k] for k in axes) for j in jobs} == {
        (dt, d, c, *a) for dt in ("fp16", "bf16") for d in (64, 128) for c in (0, 1, 2) for a in schemes}
    assert all(("DQ_ATOMIC" in j.spec) == bool(gluon.schemes) for j in jobs)
    assert all(j.spec["HEAD_DIM"] == j.spec["HEAD_DIM_V"] and all(j.spec[k] == 0 for k in gluon.base) for j in jobs)


def _key(job, drop=()):
    return tuple(sorted((k, v) for k, v in job.spec.items() if k not in drop))


def test_gputest_and_default_hold_every_served_spec(gluon: Gluon) -> None:
    from builder.registry import expand
    from builder.targets import parse_targets

    targets = parse_targets("sm80,sm90,gfx942")
    full = expand(_kernels()[gluon.name], targets, "full", "3.6.0")
    gputest = expand(_kernels()[gluon.name], targets, "gputest", "3.6.0")
    # Every spec it serves whose portable split kernel the GPU test matrix holds (the rest of its
    # backward comes from those specs); the dK/dV with DQ_ATOMIC 0 and 1 for each (the atomic
    # scheme's dK/dV for every spec of the split one), whether or not the portable atomic one is.
    portable = {_key(j) for j in expand(_kernels()[gluon.portable], targets, "gputest", "3.6.0")
                if not j.spec.get("DQ_ATOMIC")}

    def split_twin(job):
        return _key(job) if "DQ_ATOMIC" not in job.spec else tuple(sorted({**job.spec, "DQ_ATOMIC": 0}.items()))

    assert sorted(j.label for j in gputest) == sorted(j.label for j in full if split_twin(j) in portable)
    assert {j.spec["CAUSAL"] for j in gputest} == {0, 1, 2}
    if gluon.schemes:
        assert ({split_twin(j) for j in gputest if j.spec["DQ_ATOMIC"]}
                == {split_twin(j) for j in gputest if not j.spec["DQ_ATOMIC"]})
    # The default set: config #0 and each config the checked-in tuning database picks for the spec,
    # on sm90, for every fixed-length spec whose portable backward the default set holds, in both
    # schemes (the dK/dV kernel's atomic specs: the split ones' twins; varlen stays portable).
    from builder.tuning import tuned_configs

    default = expand(_kernels()[gluon.name], targets, "default", "3.6.0")
    portable_default = {_key(j) for j in expand(_kernels()[gluon.portable], targets, "default", "3.6.0")
                        if j.target.arch == "sm90" and not j.spec.get("VARLEN") and not j.spec.get("DQ_ATOMIC")
                        and j.spec["HEAD_DIM"] in (64, 128)}
    assert default and {j.target.arch for j in default} == {"sm90"}
    family = gluon.name.removesuffix("_a16")
    for spec in {_key(j) for j in default}:
        held = sorted(j.config_index for j in default if _key(j) == spec)
        assert held == list(tuned_configs(family)(dict(spec), parse_targets("sm90")[0])) and held[0] == 0
    if gluon.schemes:
        assert ({split_twin(j) for j in default if j.spec["DQ_ATOMIC"]}
                == {split_twin(j) for j in default if not j.spec["DQ_ATOMIC"]})
    else:
        assert not any(j.spec.get("DQ_ATOMIC") for j in default)
    assert {split_twin(j) for j in default} == portable_default
    assert {j.spec["CAUSAL"] for j in default} == {0, 1}


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
    # The same portable dK/dV as on sm80 but the head dim 512 bucket, which sm80 does not compile.
    assert {s for s in specs("attn_bwd_dkdv") if dict(s)["HEAD_DIM"] != 512} == specs("attn_bwd_dkdv", sm80)


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
    # The portable kernel's grid, and for the dK/dV's persistent configs one dimension of
    # min(units, PERSISTENT) programs (a unit: one key block of one KV head).
    for B, Hk, N in ((4, 32, 4096), (16, 8, 1000), (1, 1, 1), (2, 3, 129)):
        call = {"batch": B, "num_heads_k": Hk, "num_heads_q": Hk, "seqlen_q": N, "seqlen_k": N}
        expect = portable.grid_of(BLOCK_N=128, BLOCK_M=64, **call)
        assert own.grid_of(BLOCK_N=128, BLOCK_M=64, PERSISTENT=0, **call) == expect
        if "PERSISTENT" in own.grid[0]:
            units = expect[0] * expect[1]
            assert own.grid_of(BLOCK_N=128, BLOCK_M=64, PERSISTENT=132, **call) == (min(units, 132), 1, 1)
    # The portable kernel's checks hold too (the Gluon one adds non-empty extents for TMA).
    assert set(portable.checks_for({})) <= set(own.checks)
    assert "causal_align == 0 or causal_align == 1" in own.checks
    assert constexprs(own)[:len(constexprs(portable))] == constexprs(portable)


def test_its_configs_keep_the_constexprs_the_grid_and_the_operator_read(gluon: Gluon) -> None:
    from builder.kernels.attention_bwd_sm90 import CONSUMER_REGS, PERSISTENT_PROGRAMS
    from builder.targets import KNOWN

    decl = _kernels()[gluon.name]
    for spec in gluon.built:
        configs = decl.configs_for(spec, KNOWN["sm90"])
        ways = [(c.constexprs.get("DQ_SHARE", 0), c.constexprs.get("DQ_TMA", 0), c.constexprs.get("PERSISTENT", 0))
                for c in configs]
        # The atomic scheme runs each tile with each dQ split (at D=128), the per-consumer one first,
        # then the same through TMA (D=128 per consumer: its two 64 KB chunk buffers fit one tile),
        # then persistent with TMA, then OVERLAP=1 (dK's matmul behind dQ's) one tile a program and
        # persistent for each split; the split scheme its tiles, then persistent, then OVERLAP.
        P = PERSISTENT_PROGRAMS
        overlap = [c.constexprs.get("OVERLAP", 0) for c in configs]
        if gluon.schemes and spec.get("DQ_ATOMIC") and spec["HEAD_DIM"] == 128:
            assert ways == [(0, 0, 0), (0, 0, 0), (1, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (1, 1, 0), (0, 1, P),
                            (1, 1, P), (0, 1, 0), (0, 1, P), (1, 1, 0), (1, 1, P)]
            assert overlap == [0] * 9 + [1] * 4
        elif gluon.schemes and spec.get("DQ_ATOMIC"):
            assert ways == [(0, 0, 0), (0, 0, 0), (0, 1, 0), (0, 1, 0), (0, 1, P), (0, 1, 0), (0, 1, P)]
            assert overlap == [0] * 5 + [1] * 2
        elif gluon.schemes:
            # Then the OVERLAP=1 and (at D=64) OVERLAP=2 configs, one tile a program (persistent
            # ones returned wrong gradients on the H200).
            overlaps = [0, 0, 0, 1] + ([2] if spec["HEAD_DIM"] == 64 else [])
            assert ways == [(0, 0, 0), (0, 0, 0), (0, 0, P)] + [(0, 0, 0)] * (len(overlaps) - 3)
            assert [c.constexprs.get("OVERLAP", 0) for c in configs] == overlaps
        else:  # the dQ kernel: its tiles, then the first one persistent
            assert ways == [(0, 0, 0)] * (len(configs) - 1) + [(0, 0, P)] and 2 <= len(configs) <= 4
            first, last = configs[0].constexprs, configs[-1].constexprs
            assert {k: v for k, v in first.items() if k != "PERSISTENT"} == {
                k: v for k, v in last.items() if k != "PERSISTENT"}
        if gluon.schemes and spec == BUILT[SHARED]:
            assert configs[gluon.config(spec)].constexprs["DQ_SHARE"] == 1
        if gluon.schemes and spec in BUILT[min(TMA):]:
            share = TMA[BUILT.index(spec)][1]
            assert ways[gluon.config(spec)] == (share, 1, 0)
        for c in configs:
            assert c.constexprs[gluon.owned] == 128 and c.constexprs["USE_TMA"] == 1
            assert c.constexprs[gluon.streamed] in ((32, 64) if c.constexprs.get("OVERLAP") == 1 else (64, 128))
            assert c.constexprs["CONSUMER_REGS"] == CONSUMER_REGS and c.backends == ("cuda",)
            if spec.get("DQ_ATOMIC"):
                assert c.constexprs["BLOCK_M"] == 64  # the atomic dQ tile has dK's shape
        if spec.get("DQ_ATOMIC"):
            # The split scheme's tiles (BLOCK_M, STAGES), in its order: dK and dV are summed over
            # the same query tiles in both schemes, whatever config runs.
            split = decl.configs_for({**spec, "DQ_ATOMIC": 0}, KNOWN["sm90"])

            def tiles(cs):
                return [(c.constexprs["BLOCK_M"], c.constexprs["STAGES"]) for c in cs]

            plain = [c for c in configs if not c.constexprs["DQ_TMA"]]
            split = [c for c in split if not c.constexprs.get("OVERLAP")]
            assert tiles(plain) == tiles(split)[:2] * len({w[0] for w in ways})
            # The TMA configs' tiles are split ones too, their shared memory within sm90's.
            assert set(tiles(configs)) == set(tiles(split))


_BUILT_FOLDERS: dict[str, Path] = {}


def _build(gluon: Gluon, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``gluon.built`` (each at ``gluon.config``), built by the builder, proof included (once per kernel)."""
    from builder.build import build
    from builder.registry import expand
    from builder.targets import parse_targets

    if gluon.name not in _BUILT_FOLDERS:
        jobs = [j for j in expand(_kernels()[gluon.name], parse_targets("sm90"), "full", "3.6.0")
                if j.spec in gluon.built and j.config_index == gluon.config(j.spec)]
        assert len(jobs) == len(gluon.built)
        out = tmp_path_factory.mktemp(gluon.name)
        summary = build(jobs, out, workers=1, timeout=600, keep_going=False, triton_version="3.6.0", quiet=True)
        assert summary.failed == [] and summary.compiled == len(gluon.built)
        _BUILT_FOLDERS[gluon.name] = out
    return _BUILT_FOLDERS[gluon.name]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dK/dV kernel's BUILT variants, built by the builder, proof included."""
    return _build(KERNELS[0], tmp_path_factory)


@pytest.fixture(scope="module")
def compiled(gluon: Gluon, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``gluon``'s built variants, built by the builder, proof included."""
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
        # Four device-side TMA descriptors (Q, dO, K, V), 128 bytes each, in the runtime's global
        # scratch; a fifth (DQacc) with DQ_TMA.
        tma_descs = 4 + variant.config.constexprs.get("DQ_TMA", 0)
        assert variant.scratch["global_size"] == tma_descs * 128 and variant.scratch["global_align"] == 128
        assert [a.name for a in variant.args] == portable_args
        assert variant.shared <= 232448
        assert variant.config.index == gluon.config(variant.spec)


def test_the_atomic_dkdv_adds_its_ds_tiles_to_the_split_ones_shared_memory(built: Path) -> None:
    """The atomic scheme adds two 64 x 64 dS^T tiles (16-bit) to the split one's shared memory,
    four (double-buffered) with DQ_SHARE."""
    shared = {tuple(sorted(v.spec.items())): v.shared for v in _variants(built)}
    atomic, split = (tuple(sorted(spec.items())) for spec in (BUILT[3], {**BUILT[3], "DQ_ATOMIC": 0}))
    assert BUILT[1] == dict(split) and shared[atomic] - shared[split] >= 2 * 64 * 64 * 2
    # BUILT[SHARED]'s config #2 has BUILT[1]'s config #0 tile (64 queries, 2 stages).
    assert shared[tuple(sorted(BUILT[SHARED].items()))] - shared[split] >= 4 * 64 * 64 * 2
    # Through TMA, also the fp32 dQ tiles (64 x 64 each): one per consumer with DQ_SHARE, else one
    # per 64-column chunk (BUILT[8] is BUILT[0] with DQ_ATOMIC=1, config #4: the same tile).
    share_tma = shared[tuple(sorted(BUILT[6].items()))]
    assert share_tma - shared[split] >= 4 * 64 * 64 * 2 + 2 * 64 * 64 * 4
    chunked = shared[tuple(sorted(BUILT[8].items()))] - shared[tuple(sorted(BUILT[0].items()))]
    assert chunked >= 2 * 64 * 64 * 2 + 4 * 64 * 64 * 4
    assert max(shared.values()) <= 232448


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


@pytest.mark.parametrize(("gluon", "index"), [(g, i) for g in KERNELS for i in range(len(g.built))],
                         indirect=["gluon"], ids=[f"{g.name}-{i}" for g in KERNELS for i in range(len(g.built))])
def test_ptxas_keeps_the_gluon_wgmmas_asynchronous(gluon: Gluon, compiled: Path, index: int) -> None:
    """Per streamed tile and consumer, S and dP (HEAD_DIM/16 k-steps each) and the accumulating
    groups (dK and dV, or dQ: streamed tile/16 each), and with DQ_ATOMIC dQ = dS·K (64 keys deep,
    4 k-steps, per 64-column chunk: HEAD_DIM/16 in all, either dQ split), in a masked and an
    unmasked copy of the loop, for both consumers: at least 4 HGMMA per warpgroup fence, else ptxas
    serialized them."""
    spec = gluon.built[index]
    ops = _ops(compiled, spec)
    hgmma = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
    fences = ops.get("WARPGROUP.ARRIVE", 0)
    assert fences > 0 and hgmma >= 4 * fences, f"wgmma serialized by ptxas: {hgmma} HGMMA, {fences} fences"
    streamed = _variant(compiled, spec).config.constexprs[gluon.streamed]
    dq = spec["HEAD_DIM"] // 16 if spec.get("DQ_ATOMIC") else 0
    assert hgmma == 2 * 2 * (2 * spec["HEAD_DIM"] // 16 + gluon.accumulators * streamed // 16 + dq)


def test_ptxas_spills_nothing_at_head_dim_64_and_little_at_128(gluon: Gluon, compiled: Path) -> None:
    """At most ``gluon.spills`` spill stores and loads per (head dim, DQ_ATOMIC) (see KERNELS)."""
    for spec in gluon.built:
        ops, most = _ops(compiled, spec), gluon.spills[spec["HEAD_DIM"], spec.get("DQ_ATOMIC", 0)]
        assert ops.get("STL", 0) <= most and ops.get("LDL", 0) <= most, (spec, ops.get("STL"), ops.get("LDL"))


def _ptx(built: Path, spec: dict) -> str:
    return lzma.decompress((built / _variant(built, spec).ptx.path).read_bytes()).decode()


@pytest.mark.parametrize("index", ATOMIC_ADDS)
def test_the_atomic_dkdv_adds_dq_with_vectorised_fp32_reductions_and_the_split_one_adds_none(built: Path,
                                                                                             index: int) -> None:
    """Each consumer thread adds its 64 x D/128 share of a dQ tile (D/256 with DQ_SHARE: half the
    columns) as pairs of adjacent fp32 values (``atom...add.v2.f32``, result unused: ptxas writes
    it to RZ, a fire-and-forget reduction), in the masked and the unmasked copy of the loop, for
    both consumers; the split scheme's kernel has no atomics but the TMA descriptors' (EXCH)."""
    d = BUILT[index]["HEAD_DIM"]
    per_thread = 64 * d // 128 // (2 if index == SHARED else 1)
    ops = _ops(built, BUILT[index])
    assert ops.get("ATOMG.E.ADD.F32") == 2 * 2 * per_thread // 2
    adds = re.findall(r"\batom\.global\.[\w.]*add\.(v\d\.)?f32", _ptx(built, BUILT[index]))
    assert adds and all(v == "v2." for v in adds) and len(adds) == 2 * per_thread
    for spec in SPLIT_BUILT:
        assert not any(op.startswith("ATOMG.E.ADD") for op in _ops(built, spec))


@pytest.mark.parametrize("index", sorted(TMA))
def test_the_tma_dkdv_reduces_each_dq_tile_with_one_tma_reduce_add_and_no_thread_atomics(built: Path,
                                                                                         index: int) -> None:
    """DQ_TMA=1: each consumer stores its dQ tile (or each 64-column chunk of it) to shared memory
    and one thread adds it into DQacc with a 3-D TMA reduce-add (``cp.reduce.async.bulk.tensor``,
    ptxas: ``UTMAREDG.3D.ADD``), in the masked and the unmasked copy of the loop, for both
    consumers; no per-thread fp32 atomics remain, and each consumer waits for its reductions' reads
    (``cp.async.bulk.wait_group.read``) before it rewrites the tiles and before it exits."""
    spec = BUILT[index]
    chunks = 1 if TMA[index][1] else spec["HEAD_DIM"] // 64
    ops = _ops(built, spec)
    assert ops.get("UTMAREDG.3D.ADD") == 2 * 2 * chunks
    assert not any(op.startswith("ATOMG.E.ADD") for op in ops)
    ptx = _ptx(built, spec)
    reduces = re.findall(r"\bcp\.reduce\.async\.bulk\.tensor\.3d\.global\.shared::cta\.add\b", ptx)
    assert len(reduces) == 2 * 2 * chunks
    assert not re.search(r"\batom\.global\.[\w.]*add\.(v\d\.)?f32", ptx)
    # Unpredicated (the descriptors' set-up has its own, predicated ones): per consumer one in each
    # copy of the loop (before the tile's first store) and one before it exits.
    assert len(re.findall(r"^\s*cp\.async\.bulk\.wait_group\.read\s+0;", ptx, re.M)) == 2 * 3


@pytest.mark.parametrize(("split_index", "atomic_index"), [(1, 3), (0, 8)], ids=["adds", "tma"])
def test_the_atomic_dkdv_computes_dk_and_dv_with_the_split_ones_arithmetic(built: Path, split_index: int,
                                                                           atomic_index: int) -> None:
    """BUILT[3] is BUILT[1] with DQ_ATOMIC=1, BUILT[8] BUILT[0] with DQ_ATOMIC=1 and its dQ through TMA
    (same tiles, same query-tile order): each one's PTX has the
    split one's floating-point instructions, count for count, plus dQ's scaling (one mul.f32 per
    dQ element a thread adds) and nothing else; and the split one's wgmmas, plus dQ's. Every
    multiply-add is an explicit ``fma.rn`` (no ``mul.f32`` feeds an ``add``/``sub.f32``), so ptxas
    has none of its own to contract, differently or not. What tests/runtime/test_attention_gpu.py's
    bit-equality of the two schemes' dk and dv on the Gluon kernel rests on."""
    def ops(spec: dict, wgmma: bool) -> Counter:
        found = Counter(re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", _ptx(built, spec), re.M))
        if wgmma:
            return Counter({op: n for op, n in found.items() if op.startswith("wgmma.mma_async")})
        return Counter({op: n for op, n in found.items() if re.search(r"\.(f32|f16x2|bf16x2|f16|bf16)$", op)
                        and not op.startswith(("atom", "ld", "st", "wgmma"))})

    split, atomic = ops(BUILT[split_index], False), ops(BUILT[atomic_index], False)
    assert split["fma.rn.f32"] > 0 and split["mul.f32"] > 0
    per_thread = 64 * BUILT[atomic_index]["HEAD_DIM"] // 128
    assert atomic - split == Counter({"mul.f32": 2 * 2 * per_thread}) and not split - atomic
    assert not ops(BUILT[split_index], True) - ops(BUILT[atomic_index], True)
    for spec in (BUILT[split_index], BUILT[atomic_index]):
        ptx = _ptx(built, spec)
        products = set(re.findall(r"^\s*mul\.f32\s+(%r\d+),", ptx, re.M))
        sums = re.findall(r"^\s*(?:add|sub)\.f32\s+%r\d+,\s*(%r\d+),\s*(%r\d+);", ptx, re.M)
        assert products and sums and not products & {r for pair in sums for r in pair}, spec

# ------------------------------------------------------------------------------------------------
# The aligned-length sibling (attn_bwd_dkdv_sm90_a16): BUILT[0] with both lengths and the LSE/Delta
# strides declared multiples of 16.
# ------------------------------------------------------------------------------------------------

ALIGNED_NAME = "attn_bwd_dkdv_sm90_a16"
#: Spill stores or loads ptxas may emit in the sibling at D=128 (measured 80 stores and 50 loads,
#: against BUILT[0]'s 44 and 42: the masked tiles spill more, 2-3 of the ~128 tiles a key block
#: visits at N=16384, as the JIT's do; docs/performance.md). More means a regression.
ALIGNED_SPILLS = 96


@pytest.fixture(scope="module")
def aligned_built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """BUILT[0]'s aligned-length sibling at config #0, built by the builder, proof included."""
    from builder.build import build
    from builder.registry import expand
    from builder.targets import parse_targets

    jobs = [j for j in expand(_kernels()[ALIGNED_NAME], parse_targets("sm90"), "full", "3.6.0")
            if j.spec == BUILT[0] and j.config_index == 0]
    out = tmp_path_factory.mktemp(ALIGNED_NAME)
    summary = build(jobs, out, workers=1, timeout=600, keep_going=False, triton_version="3.6.0", quiet=True)
    assert summary.failed == [] and summary.compiled == 1
    return out


def test_the_aligned_siblings_catalog_declares_the_four_facts_and_the_runtime_takes_it_for_aligned_calls_only(
        built: Path, aligned_built: Path) -> None:
    from aotriton_rt.ops.attention.dispatch import _serves_aligned
    from aotriton_rt.ops.attention.family import ALIGNED_FACTS
    from builder.build import prove_folder

    assert prove_folder(aligned_built) == 1
    (aligned,) = _variants(aligned_built)
    plain = _variant(built, BUILT[0])
    assert aligned.kernel == ALIGNED_NAME and aligned.spec == plain.spec and aligned.config == plain.config
    mine, theirs = ({a.name: (a.type, a.divisibility) for a in v.args} for v in (aligned, plain))
    assert list(mine) == list(theirs)
    assert {n for n in mine if mine[n] != theirs[n]} == set(ALIGNED_FACTS)
    assert all(mine[n][1] == 16 and theirs[n][1] == 1 for n in ALIGNED_FACTS)

    class Images:  # both folders' variants, as a Library holding them serves them to the dispatch
        def variants_of(self, name: str) -> list:
            return [v for v in (aligned, plain) if v.kernel == name]

    def facts(n: int, lse: tuple[int, int]) -> dict[str, int]:
        return {"seqlen_q": n, "seqlen_k": n, "stride_lz": lse[0], "stride_lh": lse[1]}

    assert _serves_aligned(Images(), NAME, ALIGNED_NAME, BUILT[0], facts(16384, (32 * 16384, 16384)))
    assert not _serves_aligned(Images(), NAME, ALIGNED_NAME, BUILT[0], facts(16383, (32 * 16383, 16383)))
    assert not _serves_aligned(Images(), NAME, ALIGNED_NAME, BUILT[0], facts(16384, (32 * 16384 + 8, 16384)))


def test_the_aligned_siblings_unmasked_tiles_are_shorter_and_read_lse_and_delta_with_vector_loads(
        built: Path, aligned_built: Path) -> None:
    """bench/bwd_specialization.py's tile-loop count (its ``aot+lse+len`` mode, which is this
    binary): the same wgmma loops, LSE and Delta read with 8-byte loads, and the two consumers'
    unmasked tiles (each consumer's shortest loop) shorter than the plain kernel's; spills bounded."""
    from tests.helpers.benches import load_bench

    bench = load_bench("bwd_specialization.py")
    (aligned,) = _variants(aligned_built)
    raw = lzma.decompress((aligned_built / aligned.image.path).read_bytes())
    plain = lzma.decompress((built / _variant(built, BUILT[0]).image.path).read_bytes())
    call = bench.Call(4, 32, 16384, 128, BUILT[0]["CAUSAL"], BUILT[0]["dtype"])
    assert bench.compile_mode(NAME, call, "aot+lse+len").asm["cubin"] == raw
    mine, theirs = bench.tile_loops(raw), bench.tile_loops(plain)
    assert len(mine) == len(theirs) >= 4
    assert [r["HGMMA"] for r in mine] == [r["HGMMA"] for r in theirs]
    assert all(r["LDG.64"] > 0 for r in mine) and not any(r["LDG.64"] for r in theirs)

    def unmasked(loops: list) -> list[int]:
        # Address order: consumer 0's masked and unmasked loops, then consumer 1's.
        return [min(r["instructions"] for r in loops[:2]), min(r["instructions"] for r in loops[2:4])]

    assert sum(unmasked(mine)) < sum(unmasked(theirs)), (unmasked(mine), unmasked(theirs))
    assert all(a <= b for a, b in zip(unmasked(mine), unmasked(theirs))), (unmasked(mine), unmasked(theirs))
    ops = _ops(aligned_built, BUILT[0])
    assert ops.get("STL", 0) <= ALIGNED_SPILLS and ops.get("LDL", 0) <= ALIGNED_SPILLS


# ------------------------------------------------------------------------------------------------
# Persistent configs (PERSISTENT > 0): PERSISTENT_PROGRAMS programs, each looping over key blocks.
# ------------------------------------------------------------------------------------------------

#: (kernel, spec, config, most spill stores or loads, most of them inside the wgmma loops): the
#: dK/dV's persistent configs of the split training shape (#2), FA3's scheme at D=128 (TMA dQ,
#: DQ_SHARE=1, #8) and at D=64 (#4), and the dQ kernel's (#3) at D=128 and 64. Measured: 80/96 and
#: 14 inside the loops, 81/59 and 52, 20/34 and 0 (the unit loop's own values beside the
#: non-persistent kernel's loop invariants); dQ 17/33 and 0, none. More means a regression.
PERSISTENT_BUILT = ((NAME, BUILT[0], 2, 100, 16), (NAME, BUILT[6], 8, 100, 56),
                    (NAME, {**BUILT[7], "CAUSAL": 2}, 4, 40, 0),
                    (DQ_NAME, DQ_BUILT[1], 3, 40, 0), (DQ_NAME, DQ_BUILT[2], 3, 0, 0))


def _build_listed(listed: list[tuple[str, dict, int]], folder: Path) -> Path:
    """Each (kernel, spec, config index) of ``listed``, built for sm90 by the builder into ``folder``."""
    from builder.build import build
    from builder.registry import expand
    from builder.targets import parse_targets

    jobs = [j for name, spec, index in listed for j in expand(_kernels()[name], parse_targets("sm90"), "full", "3.6.0")
            if j.spec == spec and j.config_index == index]
    assert len(jobs) == len(listed)
    summary = build(jobs, folder, workers=1, timeout=600, keep_going=False, triton_version="3.6.0", quiet=True)
    assert summary.failed == [] and summary.compiled == len(listed)
    return folder


@pytest.fixture(scope="module")
def persistent_built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_listed([(name, spec, index) for name, spec, index, _, _ in PERSISTENT_BUILT],
                         tmp_path_factory.mktemp("bwd-persistent"))


def test_persistent_binaries_prove_the_catalog_and_their_grid_is_one_program_per_sm(
        persistent_built: Path) -> None:
    """The catalog's grid rule, as the runtime evaluates it, launches min(units, 132) programs (a
    unit: one non-persistent program's block, of 128 keys of one KV head for the dK/dV, of 128
    queries of one query head for the dQ); the descriptors are 4-D over the whole tensors (made
    once per program: four, five with DQ_TMA, as the non-persistent kernel's)."""
    from aotriton_rt.arguments import Packer
    from aotriton_rt.errors import ArgumentError
    from builder.build import prove_folder
    from builder.kernels.attention_bwd_sm90 import PERSISTENT_PROGRAMS
    from tests.helpers.sass import sass_ops

    assert prove_folder(persistent_built) == len(PERSISTENT_BUILT)
    for variant in _variants(persistent_built):
        assert variant.config.constexprs["PERSISTENT"] == PERSISTENT_PROGRAMS == 132
        assert variant.num_warps == 12 and variant.shared <= 232448
        tma_descs = 4 + variant.config.constexprs.get("DQ_TMA", 0)
        assert variant.scratch["global_size"] == tma_descs * 128
        packer = Packer(variant)
        values = {a.name: 0 for a in variant.args}

        def grid(B, Hk, N, packer=packer, values=values):
            values.update(batch=B, num_heads_q=Hk * 4, num_heads_k=Hk, seqlen_q=N, seqlen_k=N)
            return packer.grid_for([values[n] for n in packer.names])

        # Units: 128-key blocks of each KV head (dK/dV), 128-query blocks of each query head (dQ).
        heads = 1 if variant.kernel == NAME else 4
        assert grid(16, 8, 1024) == (132, 1, 1) and grid(4, 32, 4096) == (132, 1, 1)
        assert grid(1, 2, 300) == (6 * heads, 1, 1) and grid(1, 1, 1) == (heads, 1, 1)
        # The programs number the units in 32 bits: a call with more than 2**30 is refused.
        values.update(batch=1024, num_heads_q=32, num_heads_k=32, seqlen_q=2**22 + 128, seqlen_k=2**22 + 128)
        with pytest.raises(ArgumentError, match=r"<= 1073741824"):
            packer.run_checks([values[n] for n in packer.names])
        ops = sass_ops(lzma.decompress((persistent_built / variant.image.path).read_bytes()))
        assert ops.get("UTMALDG.4D", 0) > 0 and not ops.get("UTMALDG.3D") and not ops.get("UTMALDG.2D")
        if variant.config.constexprs.get("DQ_TMA"):
            assert ops.get("UTMAREDG.4D.ADD") == 2 * 2 * (1 if variant.config.constexprs["DQ_SHARE"]
                                                          else variant.spec["HEAD_DIM"] // 64)


@pytest.mark.parametrize("index", range(len(PERSISTENT_BUILT)))
def test_persistent_configs_keep_their_wgmmas_asynchronous_and_spill_little(persistent_built: Path,
                                                                              index: int) -> None:
    """As the non-persistent kernel: at least 4 HGMMA per warpgroup fence, the same matmuls per
    tile; spills within PERSISTENT_BUILT's bounds, inside and outside the wgmma loops."""
    from tests.helpers.sass import listing_loop_spills, sass_listing, sass_ops

    name, spec, _, most, in_loops = PERSISTENT_BUILT[index]
    (gluon,) = [g for g in KERNELS if g.name == name]
    (variant,) = [v for v in _variants(persistent_built) if v.kernel == name and v.spec == spec]
    raw = lzma.decompress((persistent_built / variant.image.path).read_bytes())
    ops = sass_ops(raw)
    hgmma = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
    fences = ops.get("WARPGROUP.ARRIVE", 0)
    assert fences > 0 and hgmma >= 4 * fences, (hgmma, fences)
    streamed = variant.config.constexprs[gluon.streamed]
    dq = spec["HEAD_DIM"] // 16 if spec.get("DQ_ATOMIC") else 0
    assert hgmma == 2 * 2 * (2 * spec["HEAD_DIM"] // 16 + gluon.accumulators * streamed // 16 + dq)
    assert ops.get("STL", 0) <= most and ops.get("LDL", 0) <= most, (ops.get("STL"), ops.get("LDL"))
    assert listing_loop_spills(sass_listing(raw)) <= in_loops


def test_persistent_units_visit_every_key_block_of_every_head_once() -> None:
    """A persistent program takes units pid, pid + P, ...: over any program count every unit
    once; without a mask unit u is key block u % blocks of (batch * KV head) u // blocks, the
    non-persistent grid's order (the causal order is _heavy_first's, the non-persistent grid's)."""
    for blocks, bh in ((1, 1), (8, 512), (3, 7), (33, 2)):
        units = blocks * bh
        for programs in (1, 5, 132, 1000):
            taken = [u for pid in range(min(units, programs)) for u in range(pid, units, programs)]
            assert sorted(taken) == list(range(units))
        assert sorted((u % blocks, u // blocks) for u in range(units)) == [(n, b) for n in range(blocks)
                                                                          for b in range(bh)]



# ------------------------------------------------------------------------------------------------
# OVERLAP=1 (split scheme): a tile's dV and dK matmuls behind the next tile's S^T and dP^T.
# ------------------------------------------------------------------------------------------------

#: (spec, config, OVERLAP, BLOCK_M, most spill stores or loads, most inside the wgmma loops): the
#: split scheme's OVERLAP configs, one tile a program. OVERLAP=1 (operands in registers; #3) at
#: D=64 (64-query tiles) and D=128 (32-query tiles: with 64, dK and dV, the previous tile's operands
#: in flight and this tile's S^T and dP^T need more registers than a consumer has and ptxas
#: serializes every wgmma, C7512); OVERLAP=2 (operands in shared memory, D=64 only; #4).
#: Measured: OVERLAP=1 D=64 3/3, D=128 15/16, none inside the loops; OVERLAP=2 D=64 none. More
#: means a regression.
_BF16_D128_MODE1 = {**BUILT[0], "dtype": "bf16", "CAUSAL": 1}
OVERLAP_BUILT = ((_BF16_D128_MODE1, 3, 1, 32, 24, 0), ({**BUILT[0], "CAUSAL": 2}, 3, 1, 32, 24, 0),
                 ({**BUILT[2], "CAUSAL": 1}, 3, 1, 64, 16, 0), ({**BUILT[2], "CAUSAL": 1}, 4, 2, 64, 0, 0))


@pytest.fixture(scope="module")
def overlap_built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_listed([(NAME, spec, index) for spec, index, *_ in OVERLAP_BUILT],
                         tmp_path_factory.mktemp("bwd-overlap"))


@pytest.mark.parametrize("index", range(len(OVERLAP_BUILT)))
def test_overlap_configs_keep_their_wgmmas_asynchronous_and_spill_little(overlap_built: Path, index: int) -> None:
    """The ABI proof holds; the four matmuls of a step are issued before its waits (at least 4 HGMMA
    per warpgroup fence: a serialized kernel fences each one); per consumer the loops' steps (S^T,
    dP^T: D/16 k-steps each; dV, dK of the previous tile: BLOCK_M/16 each) in a masked and an
    unmasked copy, the first tile's S^T and dP^T (masked and not) and the last tile's dV and dK;
    spills within OVERLAP_BUILT's bounds, inside and outside the wgmma loops."""
    from builder.build import prove_folder
    from tests.helpers.sass import listing_loop_spills, sass_listing, sass_ops

    assert prove_folder(overlap_built) == len(OVERLAP_BUILT)
    spec, config, overlap, block_m, most, in_loops = OVERLAP_BUILT[index]
    (variant,) = [v for v in _variants(overlap_built) if v.spec == spec and v.config.index == config]
    assert variant.config.constexprs["OVERLAP"] == overlap and variant.config.constexprs["BLOCK_M"] == block_m
    assert variant.config.constexprs["STAGES"] == 3 and variant.num_warps == 12
    raw = lzma.decompress((overlap_built / variant.image.path).read_bytes())
    ops = sass_ops(raw)
    hgmma = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
    fences = ops.get("WARPGROUP.ARRIVE", 0)
    assert fences > 0 and hgmma >= 4 * fences, f"wgmma serialized by ptxas: {hgmma} HGMMA, {fences} fences"
    d = spec["HEAD_DIM"]
    step = 2 * d // 16 + 2 * block_m // 16
    assert hgmma == 2 * (2 * step + 2 * (2 * d // 16) + 2 * block_m // 16)
    assert ops.get("STL", 0) <= most and ops.get("LDL", 0) <= most, (ops.get("STL"), ops.get("LDL"))
    assert listing_loop_spills(sass_listing(raw)) <= in_loops
    # dV's and dK's A operands: registers with OVERLAP=1 (HGMMA Rd, Ra, gdesc[...]), shared-memory
    # descriptors with OVERLAP=2 (every HGMMA reads both operands through gdesc).
    from_registers = len(re.findall(r"HGMMA\.\S+ R\d+, R\d+, gdesc", sass_listing(raw)))
    assert from_registers == (2 * (2 * 2 * block_m // 16 + 2 * block_m // 16) if overlap == 1 else 0)


#: A child that turns the builder's compiler setting on, then assembles the PTX (argv[2]) with ptxas
#: (argv[1]) as Triton does with line info off, argv[3] times, printing each binary's sha256.
_ASSEMBLE = """
import hashlib, subprocess, sys, tempfile
from builder.compile import fixed_layout_for_compilers
if not fixed_layout_for_compilers():
    print("refused")
    sys.exit()
with tempfile.TemporaryDirectory() as tmp:
    for i in range(int(sys.argv[3])):
        out = f"{tmp}/{i}.o"
        subprocess.run([sys.argv[1], "-lineinfo", "-suppress-debug-info", "-v", "--gpu-name=sm_90a", sys.argv[2],
                        "-o", out], check=True, capture_output=True)
        print(hashlib.sha256(open(out, "rb").read()).hexdigest())
"""


def test_the_builder_assembles_a_kernel_that_ptxas_schedules_two_ways_the_same_way_every_time(
        overlap_built: Path, tmp_path: Path) -> None:
    """ptxas (CUDA 12.8) assembles the PTX of the bf16 D=128 causal OVERLAP=1 variant to one of two
    binaries, about half the time each, depending on where address-space randomisation put its
    heap; the builder starts its compilers with randomisation off (builder/compile.py), so six more
    assemblies of the catalog's PTX under that setting are the image's bytes."""
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas

    spec, config, *_ = OVERLAP_BUILT[0]
    (variant,) = [v for v in _variants(overlap_built) if v.spec == spec and v.config.index == config]
    ptx = tmp_path / "kernel.ptx"
    ptx.write_bytes(lzma.decompress((overlap_built / variant.ptx.path).read_bytes()))
    run = subprocess.run([sys.executable, "-c", _ASSEMBLE, get_ptxas(90).path, str(ptx), "6"], check=True,
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    if run.stdout.strip() == "refused":
        pytest.skip("this machine refuses personality(ADDR_NO_RANDOMIZE) (a seccomp profile)")
    assert run.stdout.split() == [variant.image.raw_sha256] * 6


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
