"""The sm90 backward config sweep (builder/kernels/attention_bwd.py ``_SM90_DKDV_SWEEP`` /
``_SM90_DQ_SWEEP``, the ``bwdsweep`` set) on the CPU: which sets hold which configs, real sm90
images of the alternates built and proven by the builder, and the tuning view that forces them."""

from __future__ import annotations

import json
import lzma
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest

BWD = ("attn_bwd_dkdv", "attn_bwd_dq")
TARGETS = "sm80,sm90,gfx942,gfx1100"
# The shared memory one program may use on sm90 (227 KB).
SM90_SHARED = 232448


def _kernels():
    from builder.registry import load_kernels

    return load_kernels()


def _jobs(name: str, build_set: str, targets: str = TARGETS) -> list:
    from builder.registry import expand
    from builder.targets import parse_targets

    return expand(_kernels()[name], parse_targets(targets), build_set, "3.6.0")


def _slot(job) -> tuple:
    return job.target.arch, tuple(sorted(job.spec.items()))


@pytest.mark.parametrize("build_set", ["default", "gputest"])
def test_the_default_and_gputest_sets_build_one_backward_config_per_spec(build_set: str) -> None:
    for name in BWD:
        jobs = _jobs(name, build_set)
        assert jobs
        assert {j.config_index for j in jobs} == {0}, name
        assert max(Counter(_slot(j) for j in jobs).values()) == 1


def test_the_bwdsweep_set_is_every_sm90_backward_config_of_the_training_specs() -> None:
    from builder.kernels._attention_sets import in_bwd_sweep_set
    from builder.kernels.attention_bwd import _SM90_DKDV_SWEEP, _SM90_DQ_SWEEP

    for name, sweep in (("attn_bwd_dkdv", _SM90_DKDV_SWEEP), ("attn_bwd_dq", _SM90_DQ_SWEEP)):
        jobs = _jobs(name, "bwdsweep")
        assert {j.target.arch for j in jobs} == {"sm90"}
        specs = {(j.spec["dtype"], j.spec["HEAD_DIM"], j.spec["HEAD_DIM_V"], j.spec["CAUSAL"]) for j in jobs}
        assert specs == {(dt, d, d, c) for dt in ("fp16", "bf16") for d in (64, 128) for c in (0, 2)}
        assert all(not j.spec["BIAS"] and not j.spec["DROPOUT"] and not j.spec["VARLEN"]
                   and not j.spec.get("DQ_ATOMIC", 0) for j in jobs)
        per_slot = Counter(_slot(j) for j in jobs)
        for job in jobs:
            assert per_slot[_slot(job)] == 1 + len(sweep[job.spec["HEAD_DIM"]]), job.label
            assert in_bwd_sweep_set(job.spec, job.target)
    # The forward and preprocess kernels the backward needs come with config 0 only; no convert kernel.
    fwd = _jobs("attn_fwd", "bwdsweep")
    assert len(fwd) == 8 and {j.config_index for j in fwd} == {0} and {j.target.arch for j in fwd} == {"sm90"}
    pre = _jobs("attn_bwd_preprocess", "bwdsweep")
    assert {(j.spec["dtype"], j.spec["HEAD_DIM"]) for j in pre} == {(dt, d) for dt in ("fp16", "bf16")
                                                                     for d in (64, 128)}
    assert _jobs("attn_bwd_dq_convert", "bwdsweep") == []


def test_the_full_set_adds_the_alternates_only_where_the_sweep_runs() -> None:
    from builder.kernels._attention_sets import in_bwd_sweep_set

    for name in BWD:
        per_slot = Counter(_slot(j) for j in _jobs(name, "full"))
        swept = {_slot(j) for j in _jobs(name, "bwdsweep")}
        assert {slot for slot, n in per_slot.items() if n > 1} == swept
        assert all(n == 1 for slot, n in per_slot.items() if slot not in swept)
    from builder.targets import parse_targets

    (sm90,) = parse_targets("sm90")
    assert not in_bwd_sweep_set({"dtype": "fp32", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0}, sm90)
    assert not in_bwd_sweep_set({"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 1}, sm90)


def test_every_alternate_is_a_new_config_and_tma_stays_off_outside_sm90() -> None:
    for name in BWD:
        seen: dict[tuple, list] = {}
        for job in _jobs(name, "full"):
            c = job.config
            seen.setdefault(_slot(job), []).append(
                (json.dumps(c.constexprs, sort_keys=True), c.num_warps, c.num_stages, json.dumps(c.options)))
            if job.target.arch != "sm90":
                assert c.constexprs["USE_TMA"] == 0, job.label
        for slot, configs in seen.items():
            assert len(set(configs)) == len(configs), f"{name} {slot}: a config repeats"


# ---------------------------------------------------------------------------------------------
# Real sm90 images of the alternates, through the builder (compile, ABI proof).
# ---------------------------------------------------------------------------------------------

def _index_of(name: str, spec: dict, **want) -> int:
    from builder.targets import parse_targets

    (sm90,) = parse_targets("sm90")
    configs = _kernels()[name].configs_for(spec, sm90)
    for i, c in enumerate(configs):
        params = {**c.constexprs, "num_warps": c.num_warps, "num_stages": c.num_stages, **c.options}
        if all(params.get(k) == v for k, v in want.items()):
            return i
    raise AssertionError(f"{name}: no config with {want}")


D128 = {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 2, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0,
        "SOFTCAP": 0, "ALIBI": 0}
D64 = {**D128, "dtype": "bf16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0}
# (kernel, spec, the config's parameters): config 0, the TMA alternates of both kernels (one the
# 32-row dK/dV tile that spills least at D=128), and dQ at D=64 with and without the register cap.
BUILT = (
    ("attn_bwd_dkdv", {**D128, "DQ_ATOMIC": 0}, {"BLOCK_M": 64, "BLOCK_N": 128, "num_stages": 2, "USE_TMA": 0}),
    ("attn_bwd_dkdv", {**D128, "DQ_ATOMIC": 0}, {"BLOCK_M": 64, "BLOCK_N": 128, "num_stages": 2, "USE_TMA": 1}),
    ("attn_bwd_dq", D128, {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 3, "USE_TMA": 1}),
    ("attn_bwd_dkdv", {**D128, "DQ_ATOMIC": 0}, {"BLOCK_M": 32, "BLOCK_N": 128, "num_stages": 3, "USE_TMA": 1}),
    ("attn_bwd_dq", D64, {"maxnreg": 128}),
    ("attn_bwd_dq", D64, {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 3, "USE_TMA": 0}),
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from builder.build import build

    jobs = []
    for name, spec, want in BUILT:
        index = _index_of(name, spec, **want)
        (job,) = [j for j in _jobs(name, "bwdsweep", "sm90") if j.spec == spec and j.config_index == index]
        jobs.append(job)
    out = tmp_path_factory.mktemp("bwdsweep")
    summary = build(jobs, out, workers=2, timeout=900, keep_going=False, triton_version="3.6.0", quiet=True)
    assert summary.failed == [] and summary.compiled == len(BUILT)
    return out


def _variants(built: Path) -> list:
    from aotriton_rt.catalog import Catalog

    found = {(v.kernel, json.dumps(v.spec, sort_keys=True), v.config.index): v
             for v in Catalog.load(built / "catalog.json").variants}
    return [found[(name, json.dumps(spec, sort_keys=True), _index_of(name, spec, **want))]
            for name, spec, want in BUILT]


def _binary(built: Path, variant) -> bytes:
    return lzma.decompress((built / variant.image.path).read_bytes())


def _sass_ops(cubin: bytes) -> Counter:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout
    return Counter(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))


def test_the_sweep_alternates_compile_for_sm90_and_their_binaries_prove_the_catalog(built: Path) -> None:
    from builder.build import prove_folder

    assert prove_folder(built) == len(BUILT)
    args: dict[str, set] = {}
    for variant in _variants(built):
        assert variant.target.arch == "sm90" and variant.shared <= SM90_SHARED, variant.config
        args.setdefault(variant.kernel, set()).add(tuple(a.name for a in variant.args))
    # One runtime argument list per kernel: the operator's arguments fit every alternate.
    assert {k: len(v) for k, v in args.items()} == {"attn_bwd_dkdv": 1, "attn_bwd_dq": 1}
    # At most one program per SM for the 8-warp tiles of 128 keys; the dQ tiles fit two.
    assert all(v.shared <= SM90_SHARED // 2 - 1024 for v in _variants(built)[4:6])


def test_the_tma_alternates_load_through_descriptors_in_the_runtimes_global_scratch(built: Path) -> None:
    plain, dkdv_tma, dq_tma, dkdv_tma_32 = _variants(built)[:4]
    assert plain.scratch["global_size"] == 0
    # Two device-side descriptors of 128 bytes each: q and dO (dK/dV), k and v (dQ).
    for variant in (dkdv_tma, dq_tma, dkdv_tma_32):
        assert variant.scratch["global_size"] == 2 * 128 and variant.scratch["global_align"] == 128
        ops = _sass_ops(_binary(built, variant))
        assert sum(n for op, n in ops.items() if op.startswith("UTMALDG")) > 0, "no TMA load in the binary"
        assert sum(n for op, n in ops.items() if op.startswith("HGMMA")) > 0, "no wgmma in the binary"
    assert not any(op.startswith("UTMALDG") for op in _sass_ops(_binary(built, plain)))


def test_the_register_cap_reaches_ptxas(built: Path) -> None:
    from builder.abi import read_cubin

    capped, uncapped = _variants(built)[4:6]
    assert capped.config.options == {"maxnreg": 128} and capped.num_warps == 8 and capped.kernel == "attn_bwd_dq"
    assert read_cubin(_binary(built, capped), capped.symbol).extra["registers"] <= 128
    # Without the cap the same tile takes more: the cap is what lets two 8-warp programs share an SM.
    assert read_cubin(_binary(built, uncapped), uncapped.symbol).extra["registers"] > 128


# ---------------------------------------------------------------------------------------------
# The operator's dispatch under forced configs (what bench/sm90_bwd.py and `builder tune` time).
# ---------------------------------------------------------------------------------------------

def test_nested_forced_views_send_each_backward_kernel_to_its_own_config(tmp_path: Path) -> None:
    import sys

    import aotriton_rt
    from aotriton_rt.ops import attention as op
    from tests.runtime.test_attention_op import _synthetic_variant, qkv

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "bench"))
    import sm90_bwd

    base = {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 0, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0}
    variants = [_synthetic_variant("attn_fwd", base)]
    variants.append(_synthetic_variant("attn_bwd_preprocess", {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128,
                                                               "VARLEN": 0, "DQ_ATOMIC": 0}))
    variants += [_synthetic_variant("attn_bwd_dkdv", {**base, "DQ_ATOMIC": 0}, i) for i in range(3)]
    variants += [_synthetic_variant("attn_bwd_dq", base, i) for i in range(3)]
    (tmp_path / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                       "triton_version": "3.6.0", "tuning": {},
                                                       "variants": variants}))
    lib = aotriton_rt.Library(tmp_path)
    q, k, v = qkv(S=512, D=128)

    def picked(view) -> tuple[int, int]:
        handles = op.attention_kernels(q, k, v, backward=True, deterministic=True, library=view)
        return tuple(handles[name].candidates[0].config.index for name in BWD)

    assert picked(lib) == (0, 0)
    assert picked(sm90_bwd.view_of(lib, {"attn_bwd_dkdv": 2, "attn_bwd_dq": 1})) == (2, 1)
    assert picked(sm90_bwd.view_of(lib, {"attn_bwd_dq": 2})) == (0, 2)
    assert lib.catalogs[0].tuning == {}
    # The bench's candidates: every dK/dV and dQ config of the shapes asked, labelled by kernel and index.
    cands = sm90_bwd.candidates_of(lib, [("fp16", 128, 0, 1, 1, 512)])
    assert [c["label"] for c in cands] == ["dkdv#0", "dkdv#1", "dkdv#2", "dq#0", "dq#1", "dq#2"]
    # The H200 winner first (_SM90_PROMOTED), then the previous first config as an alternate.
    assert (cands[0]["tile"], cands[1]["tile"]) == ("64x128 w8s2 USE_TMA=1", "64x128 w8s2 USE_TMA=0")
    assert sm90_bwd.candidates_of(lib, [("bf16", 128, 0, 1, 1, 512)]) == []
