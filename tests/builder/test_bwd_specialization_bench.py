"""bench/bwd_specialization.py's CPU half: what Triton's JIT specialises for a backward call that the
builder's declarations do not (its own binder, run on stand-ins), and the tile loops it finds in SASS."""

from __future__ import annotations

import pytest

from tests.helpers.benches import load_bench


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    return load_bench("bwd_specialization.py")


def test_the_jit_knows_the_lse_strides_and_lengths_divisible_where_the_images_do_not(bench) -> None:
    call = bench.Call(4, 32, 16384, 128, 1, "fp16")
    diff = {n: (aot, jit) for n, aot, jit in bench.specialization_diff(bench.job_of("attn_bwd_dkdv_sm90", call), call)}
    # Facts the AOT variant lacks: the JIT read them off this call's values.
    for name in ("stride_lz", "stride_lh", "seqlen_q", "seqlen_k", "num_heads_q", "causal_align"):
        assert diff[name][1] == "i32 %16" and diff[name][0] in ("i64 %1", "i32 %1"), (name, diff[name])
    # Batch and head strides: declared divisible as the JIT finds them, only narrower there (they fit i32).
    assert diff["stride_qz"] == ("i64 %16", "i32 %16")
    # Row strides and pointers agree: absent from the diff; batch 4 is not a multiple of 16 for either.
    assert "stride_qm" not in diff and "Q" not in diff and "LSE" not in diff and "batch" not in diff


def test_a_ragged_length_leaves_the_jit_without_the_length_and_lse_facts(bench) -> None:
    call = bench.Call(4, 32, 1000, 128, 1, "fp16")
    diff = {n: jit for n, _, jit in bench.specialization_diff(bench.job_of("attn_bwd_dq_sm90", call), call)}
    assert not diff.keys() & {"seqlen_q", "seqlen_k"}
    assert diff["stride_lh"] == "i32 %1"  # only narrower than the declared i64
    assert diff["stride_lz"] == "i32 %16"  # H * 1000 = 32000 is a multiple of 16


def test_every_backward_kernel_has_a_job_for_the_operators_causal_modes(bench) -> None:
    for dtype, causal in (("fp16", 1), ("bf16", 2), ("fp16", 0)):
        call = bench.Call(2, 4, 256, 128, causal, dtype)
        jobs = [bench.job_of(k, call) for k in bench.KERNELS]
        assert [j.kernel for j in jobs] == list(bench.KERNELS)
        assert all(j.config_index == 0 for j in jobs)


def test_the_aot_mode_is_the_builders_image_byte_for_byte_and_its_tile_loops_are_found(bench) -> None:
    """What the GPU half times as ``aot`` is the catalog's binary (compiled as builder/compile.py
    does); the tile loops are the dQ kernel's: a masked and an unmasked copy per consumer, wgmma in
    each, no spills at D=64."""
    from builder.compile import compile_job

    call = bench.Call(2, 4, 256, 64, 1, "fp16")
    job = bench.job_of("attn_bwd_dq_sm90", call)
    _, raw, _ = compile_job(job)
    cubin = bench.compile_mode("attn_bwd_dq_sm90", call, "aot").asm["cubin"]
    assert raw == cubin
    loops = bench.tile_loops(cubin)
    assert len(loops) >= 4 and all(r["HGMMA"] > 0 for r in loops)
    assert sum(r["LDL"] + r["STL"] for r in loops) == 0
