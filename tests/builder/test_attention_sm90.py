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


def test_the_default_set_holds_the_one_tile_and_persistent_configs_at_128_and_the_persistent_one_at_64() -> None:
    from builder.kernels.attention_sm90 import PERSISTENT_PROGRAMS, TILES
    from builder.registry import expand
    from builder.targets import parse_targets

    # No mask and mode 1 (it takes the band's alignment at run time, so it serves both alignments),
    # both dtypes; the configs under their full-table numbers, which the tuning database's rules use.
    jobs = expand(_kernels()["attn_fwd_sm90"], parse_targets("sm80,sm90,gfx942"), "default", "3.6.0")
    full = {(j.spec["dtype"], j.spec["HEAD_DIM"], j.spec["CAUSAL"], j.spec["SOFTCAP"], j.config_index): j.constexprs
            for j in expand(_kernels()["attn_fwd_sm90"], parse_targets("sm90"), "full", "3.6.0")}
    assert {j.target.arch for j in jobs} == {"sm90"}
    got = {(j.spec["dtype"], j.spec["HEAD_DIM"], j.spec["CAUSAL"], j.spec["SOFTCAP"], j.config_index) for j in jobs}
    # Softcap (Gemma 2 27B's head dim 128) where the default set holds the attn_fwd twin: mode 1,
    # with the configs the checked-in database picks for the capped spec (`builder tune --softcap`).
    from builder import tuning

    tuned = {(r["spec"]["dtype"], r["spec"]["HEAD_DIM"], 1, 1, r["config"])
             for path in tuning.checked_in({"sm90"}) for r in tuning.load(path)["rules"].get("attn_fwd_sm90", [])
             if r["spec"].get("SOFTCAP") and r["spec"]["CAUSAL"] in (1, 2)}
    assert got == {(dt, d, c, cap, i) for dt in ("bf16", "fp16") for c in (0, 1)
                   for d, indices in ((128, (0, len(TILES[128]), len(TILES[128]) + 1)), (64, (len(TILES[64]),)))
                   for cap in ((0, 1) if d == 128 and c == 1 else (0,)) for i in indices} | tuned
    for j in jobs:
        key = (j.spec["dtype"], j.spec["HEAD_DIM"], j.spec["CAUSAL"], j.spec["SOFTCAP"], j.config_index)
        assert j.constexprs == full[key]  # the same variant (and key) as the full set's
        if key not in tuned:  # the one-tile #0 and the persistent configs after the one-tile table
            assert j.constexprs["PERSISTENT"] == (0 if j.config_index == 0 else PERSISTENT_PROGRAMS)


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

    want = {"dtype": "bf16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 2, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0,
            "SOFTCAP": 0, "ALIBI": 0}
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
    args[-1]["offset"] += 4  # the last argument moved
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


# --------------------------------------------------------------------------------------------
# Persistent configs (PERSISTENT > 0): one grid dimension of min(work units, PERSISTENT) programs.
# --------------------------------------------------------------------------------------------

def _constexprs(spec: dict, index: int) -> dict:
    from builder.kernels.attention_sm90 import sm90_fwd_configs

    return {**spec, **sm90_fwd_configs(spec, None)[index].constexprs}


def test_persistent_configs_follow_each_head_dims_tile_table_in_every_mask_mode() -> None:
    from builder.kernels.attention_sm90 import PERSISTENT_PROGRAMS, TILES
    from builder.registry import expand
    from builder.targets import parse_targets

    def jobs(build_set):
        return expand(_kernels()["attn_fwd_sm90"], parse_targets("sm90"), build_set, "3.6.0")

    def persistent(build_set):
        return {(j.spec["dtype"], j.spec["HEAD_DIM"], j.spec["CAUSAL"], j.config_index) for j in jobs(build_set)
                if j.constexprs["PERSISTENT"] and not j.constexprs["EXP2_SPLIT"]}

    # Softcap specs then hold the persistent configs again with EXP2_SPLIT, in gputest and full.
    for build_set in ("gputest", "full"):
        split = [j for j in jobs(build_set) if j.constexprs["EXP2_SPLIT"]]
        assert split and all(j.spec["SOFTCAP"] and j.constexprs["PERSISTENT"] for j in split)
        assert {j.config_index - len(TILES[j.spec["HEAD_DIM"]]) for j in split} == {2, 3}
        capped = {tuple(sorted(j.spec.items())) for j in jobs(build_set) if j.spec["SOFTCAP"]}
        assert {tuple(sorted(j.spec.items())) for j in split} == capped
    assert not any(j.constexprs["EXP2_SPLIT"] for j in jobs("default"))

    # Appended after each head dim's tile table (the tuning database's indices keep their configs),
    # for every spec of the set: gputest's (every spec its attn_fwd twin has: at D=128 all but fp16
    # mode 2; at D=64 both dtypes without a mask and in modes 1 and 2 for fp16, 1 for bf16) and full's.
    for build_set in ("gputest", "full"):
        specs = {(j.spec["dtype"], j.spec["HEAD_DIM"], j.spec["CAUSAL"]) for j in jobs(build_set)}
        assert persistent(build_set) == {(dt, d, c, i) for dt, d, c in specs
                                         for i in (len(TILES[d]), len(TILES[d]) + 1)}
    assert {c for _, d, c, _ in persistent("gputest") if d == 128} == {0, 1, 2}
    assert {(dt, c) for dt, d, c, _ in persistent("gputest") if d == 64} == {
        ("fp16", 0), ("fp16", 1), ("fp16", 2), ("bf16", 0), ("bf16", 1)}
    assert len(persistent("full")) == 2 * 2 * 3 * 2
    # The default set: both at D=128, the ping-pong one at D=64, no mask and mode 1.
    assert persistent("default") == {(dt, d, c, i) for dt in ("fp16", "bf16") for c in (0, 1)
                                     for d, i in ((128, 6), (128, 7), (64, 4))}
    for j in jobs("full"):
        d, programs = j.spec["HEAD_DIM"], j.constexprs["PERSISTENT"]
        assert programs == (PERSISTENT_PROGRAMS if j.config_index >= len(TILES[d]) else 0), j.label
        if programs:  # the head dim's first tile, with ping-pong then without
            first = TILES[d][0]
            assert tuple(j.constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "STAGES", "WARP_SPECIALIZE")) == (
                first[0], first[1], first[2], 1), j.label
            assert j.constexprs["PINGPONG"] == (1 if (j.config_index - len(TILES[d])) % 2 == 0 else 0), j.label


@pytest.mark.parametrize("causal", [0, 1])
def test_the_persistent_tiling_runs_every_tile_exactly_once_for_any_grid(causal: int) -> None:
    # The kernel's own functions (their Python bodies are plain integer arithmetic): for any number
    # of programs, more or fewer than the work units, every (query block, head) is one program's.
    from builder.kernels.attention_sm90 import _tile_count, _tile_of

    pairs = 2 if causal else 1
    for num_m in (1, 2, 3, 8, 9):
        for bh in (1, 2, 5, 32):
            tiles = num_m * bh
            for programs in (1, 2, 3, 7, 64, 131, 132, 133, 600):
                seen = [_tile_of.fn(j, pid, programs, num_m, causal, pairs)
                        for pid in range(programs) for j in range(_tile_count.fn(pid, programs, tiles, pairs))]
                assert len(seen) == tiles, (num_m, bh, programs)
                assert sorted(seen) == [(m, b) for m in range(num_m) for b in range(bh)], (num_m, bh, programs)


def test_causal_persistent_units_pair_a_heavy_query_tile_with_a_light_one_heavy_first() -> None:
    from builder.kernels.attention_sm90 import _tile_count, _tile_of

    num_m, bh, programs = 8, 64, 132
    tiles = num_m * bh
    for pid in range(programs):
        mine = [_tile_of.fn(j, pid, programs, num_m, 1, 2) for j in range(_tile_count.fn(pid, programs, tiles, 2))]
        for (m0, b0), (m1, b1) in zip(mine[0::2], mine[1::2]):
            # Query block m sees m + 1 key blocks (square causal): every unit is num_m + 1 blocks of work.
            assert b0 == b1 and m0 > m1 and (m0 + 1) + (m1 + 1) == num_m + 1
    # Consecutive programs work on the same heads at the same time (K and V shared in L2).
    assert [_tile_of.fn(0, pid, programs, num_m, 1, 2)[1] for pid in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [_tile_of.fn(0, pid, programs, num_m, 0, 1)[1] for pid in range(10)] == [0] * 8 + [1, 1]


def test_the_grid_rule_launches_one_program_per_tile_or_the_persistent_grid() -> None:
    from builder.kernels.attention_sm90 import TILES

    kernel = _kernels()["attn_fwd_sm90"]
    spec = {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0, "SOFTCAP": 0}
    persistent = len(TILES[128])

    def grid(causal, index, B, H, N):
        return kernel.grid_of(**_constexprs({**spec, "CAUSAL": causal}, index), batch=B, num_heads_q=H, seqlen_q=N)

    assert grid(0, 0, 16, 32, 1024) == (8, 512, 1) and grid(1, 0, 2, 3, 1000) == (8, 6, 1)
    assert grid(0, persistent, 16, 32, 1024) == (132, 1, 1) and grid(1, persistent + 1, 16, 32, 1024) == (132, 1, 1)
    # Fewer work units than programs: one program per unit (a causal unit is two tiles).
    assert grid(0, persistent, 2, 3, 1000) == (48, 1, 1) and grid(1, persistent, 2, 3, 1000) == (24, 1, 1)
    assert grid(1, persistent, 1, 1, 40) == (1, 1, 1) and grid(1, persistent, 7, 19, 128) == (67, 1, 1)


def _build_persistent(tmp_path_factory: pytest.TempPathFactory, head_dim: int) -> Path:
    """bf16 mask mode 1 at ``head_dim``, its first persistent config (ping-pong), built by the builder."""
    from builder.build import build
    from builder.kernels.attention_sm90 import TILES
    from builder.registry import expand
    from builder.targets import parse_targets

    want = {"dtype": "bf16", "HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim, "CAUSAL": 1, "BIAS": 0, "DROPOUT": 0,
            "VARLEN": 0, "SOFTCAP": 0, "ALIBI": 0}
    jobs = [j for j in expand(_kernels()["attn_fwd_sm90"], parse_targets("sm90"), "gputest", "3.6.0")
            if j.spec == want and j.config_index == len(TILES[head_dim])]
    assert len(jobs) == 1 and jobs[0].constexprs["PERSISTENT"] > 0 and jobs[0].constexprs["PINGPONG"] == 1
    out = tmp_path_factory.mktemp(f"gluon-persistent-d{head_dim}")
    summary = build(jobs, out, workers=1, timeout=600, keep_going=False, triton_version="3.6.0", quiet=True)
    assert summary.failed == [] and summary.compiled == 1
    return out


@pytest.fixture(scope="module")
def built_persistent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bf16 D=128 mask mode 1, the first persistent config (ping-pong), built by the builder."""
    return _build_persistent(tmp_path_factory, 128)


@pytest.fixture(scope="module")
def built_persistent_d64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bf16 D=64 mask mode 1 (a gputest spec), the first persistent config (ping-pong)."""
    return _build_persistent(tmp_path_factory, 64)


@pytest.mark.parametrize("head_dim", [128, 64])
def test_the_persistent_variant_compiles_proves_its_layout_and_keeps_attn_fwds_arguments(
        request: pytest.FixtureRequest, head_dim: int) -> None:
    from aotriton_rt.arguments import Packer
    from aotriton_rt.catalog import Catalog
    from builder.build import prove_folder

    built_persistent = request.getfixturevalue("built_persistent" if head_dim == 128 else "built_persistent_d64")

    assert prove_folder(built_persistent) == 1
    (variant,) = Catalog.load(built_persistent / "catalog.json").variants
    assert variant.num_warps == 12 and variant.scratch["global_size"] == 3 * 128
    # Two 64-row Q halves and STAGES K/V blocks: 224 KB at D=128 (3 stages), 144 KB at D=64 (4 stages).
    assert variant.shared <= 232448 and variant.shared > {128: 224, 64: 144}[head_dim] * 1024
    assert [a.name for a in variant.args] == [n for n, t in _kernels()["attn_fwd"].signature.items()
                                              if t != "constexpr"]
    # The runtime's own grid evaluation of the catalog's rule (the rule folds the variant's constexprs).
    packer = Packer(variant)
    values = {a.name: 0 for a in variant.args}

    def grid(B, H, N):
        values.update(batch=B, num_heads_q=H, num_heads_k=H, seqlen_q=N, seqlen_k=N)
        return packer.grid_for([values[n] for n in packer.names])

    assert grid(16, 32, 1024) == (132, 1, 1) and grid(4, 32, 4096) == (132, 1, 1)
    assert grid(1, 2, 300) == (3, 1, 1)  # six tiles (three query blocks of two heads): three causal units


@pytest.mark.parametrize("head_dim", [128, 64])
def test_ptxas_keeps_the_persistent_wgmmas_asynchronous_and_spills_nothing_in_the_key_loops(
        request: pytest.FixtureRequest, head_dim: int) -> None:
    import lzma

    from aotriton_rt.catalog import Catalog
    from tests.helpers.sass import loop_spills, sass_ops

    built_persistent = request.getfixturevalue("built_persistent" if head_dim == 128 else "built_persistent_d64")

    (variant,) = Catalog.load(built_persistent / "catalog.json").variants
    cubin = lzma.decompress((built_persistent / variant.image.path).read_bytes())
    ops = sass_ops(cubin)
    hgmma = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
    fences = ops.get("WARPGROUP.ARRIVE", 0)
    # k-steps of 16 per issue site: HEAD_DIM / 16 for Q.K^T (8 at D=128, 4 at D=64), BLOCK_N / 16 for P.V.
    assert hgmma >= head_dim // 16 * fences > 0, f"wgmma serialized by ptxas: {hgmma} HGMMA, {fences} fences"
    # The tile loop carries more than the one-tile kernel: ptxas (Triton 3.6) keeps one per-thread
    # column offset in local memory, stored once and reloaded once per tile, outside the key loops;
    # at D=128 also the sinks' pointer and flag (14 local accesses per tile, none in a key loop).
    assert loop_spills(cubin) == 0, "local memory traffic inside a wgmma loop"
    assert ops.get("STL", 0) + ops.get("LDL", 0) <= (14 if head_dim == 128 else 2), ops


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


def test_loop_spills_counts_local_memory_only_inside_the_innermost_wgmma_loops() -> None:
    from tests.helpers.sass import listing_loop_spills

    def listing(body: list[str]) -> str:
        return "\n".join(f"        /*{i * 16:04x}*/                   {op} ;" if not op.startswith(".L") else op
                         for i, op in enumerate(body))

    # A tile loop around a key loop, and an mbarrier wait's retry loop out of line after EXIT that
    # branches back into the key loop (unconditionally: not a loop of the code).
    tile_loop = [".L_x_1:", "LDL R2, [R1]", ".L_x_2:", "SYNCS.PHASECHK.TRANS64.TRYWAIT P5, [UR4], R0",
                 "@!P5 BRA `(.L_x_9)", ".L_x_3:", "HGMMA.64x128x16.F32 R24, gdesc[UR4], R24", "{spill}",
                 "@P0 BRA `(.L_x_2)", "HGMMA.64x128x16.F32 R24, gdesc[UR4], R24", "LDL R4, [R1+0x8]",
                 "STL [R1], R0", "@P1 BRA `(.L_x_1)", "EXIT", ".L_x_9:",
                 "SYNCS.PHASECHK.TRANS64.TRYWAIT P5, [UR4], R0", "@!P5 BRA `(.L_x_9)", "BRA `(.L_x_3)"]
    outside = [op for op in tile_loop if op != "{spill}"]
    inside = [op.replace("{spill}", "LDL R3, [R1+0x4]") for op in tile_loop]
    assert listing_loop_spills(listing(outside)) == 0  # once per tile, in the outer loop only
    assert listing_loop_spills(listing(inside)) == 1


def test_the_persistent_bench_picks_the_persistent_variant_and_summarises_ratios_to_cudnn(
        built_persistent: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import sm90_persistent

    (contender,) = sm90_persistent.contenders_of(str(built_persistent))
    assert contender.label.startswith("persistent#6 128x128 w4s1 ") and "PERSISTENT=132" in contender.label
    import sm90_levers

    q = _Shaped(2, 3, 100, 128)
    args = sm90_levers.launch_args(q, q, q, q, _Shaped(2, 3, 100), causal=1, scale=0.1)
    assert len(args) == len(contender.handle.arg_names)  # the bench's causal calls: top-left (align 0)
    assert dict(zip(contender.handle.arg_names, args))["causal_align"] == 0
    row = {"tflops": 500.0, "tflops_min": 490.0, "tflops_max": 510.0}
    results = [{"shape": ("bf16", 128, 1, 16, 32, 1024), "errors": {"gluon#0 x": "LaunchError: boom"},
                "rows": {"cudnn": {**row, "ratio": 1.0}, contender.label: {**row, "tflops": 450.0, "ratio": 0.9},
                         "attn_fwd#1 128x64": {**row, "tflops": 300.0, "ratio": 0.6}}}]
    lines = sm90_persistent.summary(results)
    assert lines[0] == ("bf16 B16 H32 N1024 D128 causal | cudnn 500.0 | persistent#6 450.0 x0.900 [490-510] | "
                        "gluon - | attn_fwd#1 300.0 x0.600 [490-510]")
    assert lines[1].endswith("gluon#0 x: LaunchError: boom")
    assert [s[:3] for s in sm90_persistent.SHAPES[:4]] == [("fp16", 128, 0), ("bf16", 128, 0), ("fp16", 128, 1),
                                                          ("bf16", 128, 1)]


def test_the_persistent_bench_times_head_dim_64_in_the_gputest_sets_d64_specs_after_the_d128_shapes(
        built_persistent_d64: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import sm90_persistent

    # D=128's shape indices (0-7) keep their meaning; D=64 follows, only where gputest has variants.
    assert {s[1] for s in sm90_persistent.SHAPES[:8]} == {128}
    assert sm90_persistent.SHAPES[8:] == (("fp16", 64, 0, 16, 32, 1024), ("bf16", 64, 1, 16, 32, 1024),
                                         ("fp16", 64, 0, 4, 32, 4096), ("bf16", 64, 1, 4, 32, 4096))
    (contender,) = sm90_persistent.contenders_of(str(built_persistent_d64))
    assert contender.label.startswith("persistent#4 128x128 w4s1 ") and "PERSISTENT=132" in contender.label
    assert contender.variant.spec["HEAD_DIM"] == 64


def test_the_softcapped_gluon_forward_caps_with_one_hardware_tanh_per_score(tmp_path: Path) -> None:
    """SOFTCAP=1: one MUFU.TANH per score (``tanh.approx.f32``) and no reciprocal, beside the
    softmax's MUFU.EX2: the special-function unit bounds this kernel, and the portable kernel's
    tanh (an exp2 and a division) took two of its operations per score. The wgmmas stay
    asynchronous and nothing spills."""
    import lzma

    from aotriton_rt.catalog import Catalog
    from builder.build import build
    from builder.registry import expand
    from builder.targets import parse_targets
    from tests.helpers.sass import sass_ops

    want = {"dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 1, "BIAS": 0, "DROPOUT": 0,
            "VARLEN": 0, "SOFTCAP": 1}
    jobs = [j for j in expand(_kernels()["attn_fwd_sm90"], parse_targets("sm90"), "default", "3.6.0")
            if {**j.spec, **want} == j.spec and j.config_index == 0]
    assert len(jobs) == 1
    summary = build(jobs, tmp_path, workers=1, timeout=600, keep_going=False, triton_version="3.6.0", quiet=True)
    assert summary.failed == [] and summary.compiled == 1
    (variant,) = Catalog.load(tmp_path / "catalog.json").variants
    ops = sass_ops(lzma.decompress((tmp_path / variant.image.path).read_bytes()))
    mufu = {op: n for op, n in ops.items() if op.startswith("MUFU")}
    # Per score: one TANH beside the softmax's EX2 (which also rescales rows); the few reciprocals
    # are per row or per program (the cap's constants, the epilogue's 1/l), not per score.
    assert mufu["MUFU.TANH"] >= 256 and mufu["MUFU.TANH"] <= mufu["MUFU.EX2"], mufu
    assert mufu.get("MUFU.RCP", 0) < mufu["MUFU.TANH"] // 16, mufu
    hgmma = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
    assert hgmma >= 8 * ops.get("WARPGROUP.ARRIVE", 0) > 0
    assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, "register spills"


def _exp2_fma_in_numpy(x):
    """_exp2_fma's steps in numpy fp32 (its adds rounded as the GPU's; the polynomial's
    multiply-adds rounded twice where the GPU fuses them: a bound, not the exact bits)."""
    import numpy as np

    from builder.kernels.attention_sm90 import EXP2_POLY, ROUNDER

    f32 = np.float32
    x = np.maximum(x.astype(f32), f32(-125.0))
    t = x + f32(ROUNDER.value)
    f = x - (t - f32(ROUNDER.value))
    c = [f32(v) for v in EXP2_POLY.value]
    p = f * c[3] + c[2]
    p = p * f + c[1]
    p = p * f + c[0]
    bits = p.view(np.int32) + (t.view(np.int32) << np.int32(23))
    return bits.view(f32)


def test_exp2_on_the_fma_pipe_is_within_8e_5_of_exp2_down_to_its_clamp() -> None:
    """_exp2_fma (EXP2_SPLIT's half of the exp2): relative error below 8e-5 (a third of an fp16
    P's rounding, 2**-12, which every P takes before its matmul) for every x in [-125, 0] (dense
    grid, integers and half-integers, where the rounding to k = round(x) changes side); below the
    clamp a result of 2**-125..2**-124 where the true one is smaller (a score that far below its
    row's maximum adds nothing to the sum)."""
    import numpy as np

    xs = np.concatenate([np.linspace(-125.0, 0.0, 2_000_001, dtype=np.float64),
                         np.arange(-125, 1, dtype=np.float64), np.arange(-125, 0, dtype=np.float64) + 0.5,
                         np.arange(-125, 0, dtype=np.float64) + 0.5 - 1e-6])
    got = _exp2_fma_in_numpy(xs).astype(np.float64)
    want = np.exp2(xs.astype(np.float32).astype(np.float64))
    assert np.all(np.isfinite(got)) and np.max(np.abs(got / want - 1)) < 8e-5
    low = _exp2_fma_in_numpy(np.array([-126.0, -200.0, -1e30]))
    assert np.all((low >= 2.0**-125.5) & (low <= 2.0**-124.5))


def test_exp2_split_halves_the_softcapped_forwards_exp2_on_the_special_function_unit(tmp_path: Path) -> None:
    """EXP2_SPLIT (the softcap specs' configs after the persistent ones): the unmasked blocks take
    half their exp2 off the special-function unit (where the cap's tanh doubled the load), without
    moving data (no more shared-memory traffic, no spills) or touching the matmuls; its twin
    without the split is the same tile."""
    import lzma

    from aotriton_rt.catalog import Catalog
    from builder.build import build
    from builder.kernels.attention_sm90 import TILES
    from builder.registry import expand
    from builder.targets import parse_targets
    from tests.helpers.sass import sass_ops

    want = {"dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 1, "BIAS": 0, "DROPOUT": 0,
            "VARLEN": 0, "SOFTCAP": 1, "ALIBI": 0}
    plain, split = len(TILES[128]) + 1, len(TILES[128]) + 3  # persistent, no ping-pong; the same split
    jobs = {j.config_index: j for j in expand(_kernels()["attn_fwd_sm90"], parse_targets("sm90"), "full", "3.6.0")
            if j.spec == want and j.config_index in (plain, split)}
    assert {i: j.constexprs["EXP2_SPLIT"] for i, j in jobs.items()} == {plain: 0, split: 1}
    assert ({k: v for k, v in jobs[plain].constexprs.items() if k != "EXP2_SPLIT"}
            == {k: v for k, v in jobs[split].constexprs.items() if k != "EXP2_SPLIT"})
    summary = build(list(jobs.values()), tmp_path, workers=1, timeout=600, keep_going=False,
                    triton_version="3.6.0", quiet=True)
    assert summary.failed == [] and summary.compiled == 2
    ops = {v.config.index: sass_ops(lzma.decompress((tmp_path / v.image.path).read_bytes()))
           for v in Catalog.load(tmp_path / "catalog.json").variants}
    # Each consumer's unmasked block: 64 rows x 128 keys over 128 threads, 64 exp2 a thread, 32 moved.
    assert ops[plain]["MUFU.EX2"] - ops[split]["MUFU.EX2"] == 2 * 32
    assert ops[plain]["MUFU.TANH"] == ops[split]["MUFU.TANH"]
    for op in ("STS", "LDS", "STL", "LDL", "WARPGROUP.ARRIVE"):
        assert ops[split].get(op, 0) == ops[plain].get(op, 0), op
    assert (sum(n for op, n in ops[split].items() if op.startswith("HGMMA"))
            == sum(n for op, n in ops[plain].items() if op.startswith("HGMMA")))
