"""The decode chain's per-call PDL decision, on CPU.

- The rule (``pdl_choice``) at the shapes measured on the H200 (docs/performance.md, PDL on and
  off): the contiguous split calls PDL made slower launch plainly, the latency-bound ones, the
  unsplit ones and every paged one keep PDL.
- The decision reaches ``Kernel.prepare`` for every launch of the chain (append, decode,
  combine) and is taken once per plan; plans follow their library's tuning rules, and the decode
  state has no switch for either (benchmarks force policies in their own process).
- ``Kernel.prepare(pdl=False)`` launches a PDL variant through the real CUDA driver against the
  fake libcuda without the launch attribute, and keeps that launcher (in test_driver_cuda.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from aotriton_rt.ops import decode as op
from aotriton_rt.ops.decode import SplitRule, num_splits_for
from aotriton_rt.ops.decode import launch as dl
from aotriton_rt.ops.decode.validate import DecodePlan


def _plan(batch: int, keys: int, heads_k: int = 8, heads_q: int = 32, paged: bool = False, dtype: str = "bf16",
          window_left: int = -1) -> DecodePlan:
    """A validated call's plan: one query row per sequence, D=128, the cache full to ``keys``."""
    page = 64 if paged else 0
    return DecodePlan(dtype=dtype, head_dim=128, batch=batch, heads_q=heads_q, heads_k=heads_k, seqlen_q=1,
                      seqlen_new=0, capacity=keys, paged=paged, page_size=page,
                      num_pages=batch * keys // 64 if paged else 0, seqlen_k_hint=keys, q_strides=(0, 0, 0),
                      k_strides=(0, 0, 0), v_strides=(0, 0, 0), kn_strides=(0, 0, 0), vn_strides=(0, 0, 0),
                      bt_stride=0, window_left=window_left, window_right=-1, scale=0.1, device=0, q_copy=False)


def _splits(p: DecodePlan) -> int:
    """The split count the sm90 default rule gives on the H200 (132 SMs, 64-key blocks)."""
    return num_splits_for(p.batch, p.heads_k, 1, p.seqlen_k_hint, 64, 132, SplitRule(2, 4, 64))


# The H200 table (bf16, D=128, 32 query / 8 KV heads, contiguous): PDL-on time / PDL-off time.
MEASURED = {(1, 2048): 0.85, (1, 8192): 0.92, (1, 32768): 1.03, (8, 2048): 1.06, (8, 8192): 1.16,
            (8, 32768): 1.16}


@pytest.mark.parametrize(("batch", "keys"), sorted(MEASURED))
def test_contiguous_split_calls_that_pdl_made_slower_launch_plainly_and_the_faster_ones_keep_pdl(
        batch: int, keys: int) -> None:
    p = _plan(batch, keys)
    assert _splits(p) > 1
    pdl, why = dl.pdl_choice(p, _splits(p))
    assert pdl is (MEASURED[batch, keys] < 1), why
    assert ("no PDL: a contiguous cache" in why) is not pdl
    # The same shape paged: PDL measured 0-12% faster at every paged shape.
    paged = _plan(batch, keys, paged=True)
    assert dl.pdl_choice(paged, _splits(paged)) == (True, "PDL: a paged cache (PDL measured 0-12% faster at "
                                                          "every paged shape)")


@pytest.mark.parametrize("keys", [2048, 8192, 32768])
@pytest.mark.parametrize("heads_q", [32, 64])
def test_a_batch_that_fills_the_gpu_without_splits_keeps_pdl_however_much_it_reads(keys: int, heads_q: int) -> None:
    p = _plan(64, keys, heads_q=heads_q)
    assert _splits(p) == 1 and dl.kv_bytes(p) >= 512 << 20
    assert dl.pdl_choice(p, 1) == (True, "PDL: one split, no combine (unsplit contiguous calls were not slower "
                                         "with PDL)")


def test_the_threshold_counts_the_bytes_a_call_reads_across_gqa_ratios_dtypes_and_windows() -> None:
    # 4 KV heads (GQA 8:1): B=8 with 2k keys reads 32 MiB (PDL), with 8k 128 MiB (plain).
    assert dl.kv_bytes(_plan(8, 2048, heads_k=4, heads_q=32)) == 32 << 20
    assert dl.pdl_choice(_plan(8, 2048, heads_k=4), 5)[0] is True
    assert dl.pdl_choice(_plan(8, 8192, heads_k=4), 5)[0] is False
    # fp32 reads twice the bytes of bf16 for the same keys.
    assert dl.kv_bytes(_plan(1, 8192, dtype="fp32")) == 2 * dl.kv_bytes(_plan(1, 8192)) == 64 << 20
    assert dl.pdl_choice(_plan(1, 8192, dtype="fp32"), 13)[0] is False
    # A sliding window reads its span, not the cache: 32k keys behind a 4k window is 8 MiB at B=1.
    windowed = _plan(1, 32768, window_left=4095)
    assert dl.kv_bytes(windowed) == 2 * 8 * 4096 * 128 * 2
    assert dl.pdl_choice(windowed, 8) == (True, "PDL: 16.0 MiB of K/V < 48 MiB (latency-bound: PDL 8-15% faster)")
    # Just below and at the threshold.
    at = _plan(1, 12288)  # 48 MiB
    assert dl.kv_bytes(at) == dl.PLAIN_MIN_KV_BYTES and dl.pdl_choice(at, 8)[0] is False
    assert dl.pdl_choice(_plan(1, 12288 - 64), 8)[0] is True


# ---------------------------------------------------------------------------------------------
# The decision through decode_attention: the real plans over recording kernel handles.
# ---------------------------------------------------------------------------------------------

@pytest.fixture()
def recording(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fake library whose handles record each prepare's ``pdl`` (and each launch)."""
    import torch

    from aotriton_rt import interop
    from aotriton_rt.ops.decode import validate
    from tests.runtime import test_decode_op as t

    names = {torch.float16: "fp16", torch.int32: "i32"}
    monkeypatch.setattr(validate, "_describe", lambda obj, name: interop.ArrayInfo(
        obj.data_ptr(), 0, names[obj.dtype], tuple(obj.shape), tuple(obj.stride()), "torch"))
    monkeypatch.setattr(interop, "stream_getter", lambda framework: (lambda device: 0x77))
    lib = t._Library()
    monkeypatch.setattr(lib, "kernel", lambda name, **params: t._AddressHandle(lib.decls[name], params))
    t.LAUNCHES.clear()
    t.PREPARED.clear()
    yield lib, t.PREPARED, t.LAUNCHES  # a fresh library: its launch cache starts empty


def _call(lib: Any, paged: bool, times: int = 2) -> None:
    import torch

    B, Hk, D = 2, 2, 64
    q = torch.randn(B, 1, 8, D).half()
    if paged:
        k, table = torch.randn(8, 64, Hk, D).half(), torch.arange(8, dtype=torch.int32).reshape(B, 4)
    else:
        k, table = torch.randn(B, 256, Hk, D).half(), None
    v = torch.randn_like(k)
    kn, vn = torch.randn(B, 1, Hk, D).half(), torch.randn(B, 1, Hk, D).half()
    for _ in range(times):
        op.decode_attention(q, k, v, cache_seqlens=torch.tensor([37, 60], dtype=torch.int32), block_table=table,
                            k_new=kn, v_new=vn, num_splits=3, causal=True, check=False, library=lib)


CHAIN = ["attn_decode_append", "attn_decode", "attn_decode_combine"]


def test_every_launch_of_the_chain_is_prepared_with_the_plans_decision_once(
        recording: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lib, prepared, launches = recording
    _call(lib, paged=False, times=3)  # 256 KiB of K/V: PDL
    assert prepared == [(n, True) for n in CHAIN]  # one plan: prepared once, launched twice
    assert [w for w, _, _ in launches].count("prepared") == 2 * len(CHAIN)
    (plan,) = op._kernels_of(lib).launches.values()
    assert plan.pdl is True and plan.pdl_reason.startswith("PDL: 0.2 MiB of K/V < 48 MiB")
    monkeypatch.setattr(dl, "PLAIN_MIN_KV_BYTES", 1 << 10)
    op._kernels_of(lib).launches.clear()
    prepared.clear()
    _call(lib, paged=False)
    assert prepared == [(n, False) for n in CHAIN]
    prepared.clear()
    _call(lib, paged=True)
    assert prepared == [(n, True) for n in CHAIN]  # paged: PDL whatever the size


def test_each_library_plans_under_its_own_rules_and_the_state_has_no_switches(
        recording: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Other split rules are another library (a ``Library.with_tuning`` view): its calls make their
    own plans under its rules; the decode state offers no setter for the rules or a PDL policy."""
    import torch

    from tests.runtime import test_decode_op as t

    lib, prepared, launches = recording
    ks = dl._kernels_of(lib)
    with pytest.raises(AttributeError):
        ks.rules = [{"splits": {"max_splits": 1}}]
    assert not hasattr(ks, "pdl") and not hasattr(ks, "generation") and not hasattr(dl, "PDL_POLICIES")
    one_split = t._Library()
    one_split.tuning = {"attn_decode": [{"splits": {"max_splits": 1}}]}
    monkeypatch.setattr(one_split, "kernel", lambda name, **params: t._AddressHandle(one_split.decls[name], params))
    q, k = torch.randn(2, 1, 8, 64).half(), torch.randn(2, 4096, 2, 64).half()
    for library in (lib, one_split, lib, one_split):
        op.decode_attention(q, k, torch.randn_like(k), causal=True, check=False, library=library)
    # Each library keeps its own plans: one call signature, one plan per library.
    plans = {library: plan for library in (lib, one_split) for plan in dl._kernels_of(library).launches.values()}
    assert [len(dl._kernels_of(library).launches) for library in (lib, one_split)] == [1, 1]
    assert all(plan.ks.lib is library for library, plan in plans.items())
    assert dl._kernels_of(one_split).rules == one_split.tuning["attn_decode"]
    assert plans[lib].num_splits > 1 and plans[one_split].num_splits == 1
