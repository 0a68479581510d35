"""Decode attention at any query length and any head dim, without a GPU (FlashAttention-2's
``flash_attn_with_kvcache`` semantics).

- Under Triton's interpreter (subprocesses, as tests/runtime/test_decode_op.py): the real
  kernels on CPU tensors against an fp64 reference. Query runs of 1, 3, 16, 64 and 128 rows
  against contiguous and paged caches with appended rows, causal and sliding windows, GQA,
  several splits; head dims 1, 32, 59, 64, 80, 128, 200 and 256. Every array of the caller is a
  view into a buffer whose columns past the head dim hold NaN where a case says so: the masked
  (``PADDED_D=1``) variants must neither read them (no NaN in the answer) nor write them (they
  stay NaN in the caches and ``out``). Each case names the variant it must run: as is at a
  bucket with aligned arrays, masked otherwise or when the images lack the exact one. The logit
  softcap at a masked head dim and on 128-row runs: through the variable-length forward's
  ``SOFTCAP=1`` variant, or on the decode kernels where the images' forward has none.
- Each query tile reads only the keys its own rows can see: the K elements a call loads are
  counted and equal the per-tile ranges (a causal run of 128 rows reads 61% of what cutting
  every tile at the run's ends read).
- Variant choice for images without masked variants, the split count for long runs, and the
  bound on the split partials, as pure functions.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from aotriton_rt import ArgumentError
from aotriton_rt.ops import decode as op
from aotriton_rt.ops.decode.launch import VARLEN_SEQLEN_Q
from tests.helpers.interpreter import patch_interpreter, report_cases, run_sharded
from tests.runtime.test_decode_bounds import recording  # noqa: F401 - the fixture
from tests.runtime.test_decode_op import _Handle, _install_cpu, _Library, fp64_reference

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16  # the interpreter runs BLOCK_M = BLOCK_N = 16 (test_decode_op._Handle)


def _images_without(*missing: tuple) -> Any:
    """Images that hold every decode variant but those whose (HEAD_DIM, PADDED_D) is ``missing``."""
    return lambda name, spec: (spec["HEAD_DIM"], spec["PADDED_D"]) not in missing


def _default_like(name: str, spec: dict) -> bool:
    """Images holding the default set's head dims: 64 and 128, as is and masked."""
    return spec["HEAD_DIM"] in (64, 128)


# Defaults: B=2, Hq=4, Hk=2, Sq=1, D=32, fp32, contiguous cache of 64 rows, lengths (37, 5), one
# split. "run": the (HEAD_DIM, PADDED_D) the call must launch. "pad": NaN columns past the head
# dim in every caller array (q, caches, k_new/v_new, out). "count": check the K elements loaded.
CASES: dict[str, dict] = {
    # Query lengths.
    "one_row_contiguous_append_causal_gqa": {"Sq": 1, "new": 1, "causal": True, "run": (32, 0)},
    "three_rows_paged_append_window": {"Sq": 3, "paged": 16, "new": 3, "causal": True, "window": (20, 0),
                                       "lens": (40, 0), "splits": 2, "run": (32, 0)},
    "sixteen_rows_two_sided_window_append": {"Sq": 16, "new": 2, "window": (7, 2), "lens": (30, 3),
                                             "run": (32, 0)},
    "sixty_four_rows_paged_causal_append_gqa": {"Sq": 64, "Hq": 4, "Hk": 1, "paged": 32, "new": 64,
                                                "causal": True, "lens": (40, 0), "cap": 128, "count": True,
                                                "run": (32, 0)},
    "sixty_four_rows_no_mask_splits": {"Sq": 64, "Hq": 2, "Hk": 1, "lens": (90, 17), "cap": 96, "splits": 3,
                                       "run": (32, 0)},
    "one_twenty_eight_rows_causal_reads_per_tile": {"Sq": 128, "Hq": 2, "Hk": 1, "new": 128, "causal": True,
                                                    "lens": (0, 30), "cap": 160, "count": True, "run": (32, 0)},
    "one_twenty_eight_rows_an_empty_sequence_two_sided_window": {"Sq": 128, "Hq": 2, "Hk": 1, "window": (9, 4),
                                                                 "lens": (0, 150), "cap": 160, "run": (32, 0)},
    "one_twenty_eight_rows_paged_window_gqa_splits": {"Sq": 128, "Hq": 2, "Hk": 1, "paged": 16, "causal": True,
                                                      "window": (40, 0), "lens": (150, 60), "cap": 160,
                                                      "splits": 2, "run": (32, 0)},
    # Head dims: the bucket as is, masked views of NaN-padded buffers, images lacking buckets.
    "head_dim_1_masked_on_16": {"D": 1, "Sq": 2, "new": 1, "causal": True, "pad": 3, "run": (16, 1)},
    "head_dim_59_fp16_paged_nan_columns": {"D": 59, "dtype": "fp16", "Sq": 3, "paged": 16, "new": 2,
                                           "causal": True, "pad": 5, "splits": 2, "out": True, "run": (64, 1)},
    "head_dim_64_rows_not_16_byte_aligned": {"D": 64, "Sq": 2, "new": 1, "causal": True, "pad": 3, "out": True,
                                             "run": (64, 1)},
    "head_dim_64_aligned_runs_as_is": {"D": 64, "Sq": 2, "new": 1, "causal": True, "pad": 16, "run": (64, 0)},
    "head_dim_80_bf16_as_is": {"D": 80, "dtype": "bf16", "Sq": 4, "paged": 16, "new": 2, "causal": True,
                               "run": (80, 0)},
    "head_dim_80_on_128_in_default_like_images": {"D": 80, "dtype": "fp16", "Sq": 3, "new": 3, "causal": True,
                                                  "held": _default_like, "splits": 2, "run": (128, 1)},
    "head_dim_128_fp32_window_splits": {"D": 128, "Sq": 16, "Hq": 8, "Hk": 2, "new": 4, "window": (24, 0),
                                        "causal": True, "splits": 2, "lens": (50, 9), "run": (128, 0)},
    "head_dim_200_on_224": {"D": 200, "Sq": 2, "paged": 16, "new": 1, "causal": True, "pad": 24, "run": (224, 1)},
    "head_dim_256_masked_when_only_that_is_held": {"D": 256, "dtype": "fp16", "Sq": 2, "new": 1, "causal": True,
                                                   "held": _images_without((256, 0)), "splits": 2, "run": (256, 1)},
    # Logit softcap (scores scaled up by "amp" so that a cap of 1.5 bends them): the decode
    # kernels at a masked head dim; a long run through the variable-length forward's SOFTCAP=1
    # variant; the same run on the decode kernels when the images' forward has no softcap.
    "softcap_head_dim_59_masked_paged_nan_columns": {"softcap": 1.5, "amp": 2.0, "D": 59, "Sq": 3, "paged": 16,
                                                     "new": 2, "causal": True, "pad": 5, "splits": 2,
                                                     "run": (64, 1)},
    "softcap_128_rows_paged_window_through_the_varlen_forward": {"softcap": 1.5, "amp": 2.0, "Sq": 128, "Hq": 2,
                                                                 "Hk": 1, "paged": 16, "new": 5, "causal": True,
                                                                 "window": (40, 0), "lens": (150, 30), "cap": 160,
                                                                 "run": (32, 0)},
    "softcap_128_rows_on_the_decode_kernels_without_a_capped_forward": {
        "softcap": 1.5, "amp": 2.0, "Sq": 128, "Hq": 2, "Hk": 1, "causal": True, "lens": (0, 30), "new": 128,
        "cap": 160, "splits": 2, "held": lambda name, spec: not (name == "attn_fwd" and spec.get("SOFTCAP")),
        "routed": False, "run": (32, 0)},
}


# ---------------------------------------------------------------------------------------------
# Interpreter side (subprocess).
# ---------------------------------------------------------------------------------------------

RUNS: list = []  # (kernel, spec) of each launch
K_LOADS: list = []  # [first byte, end, elements loaded] of the K cache while counting


class _SpecHandle(_Handle):
    def __call__(self, *args: Any) -> None:
        RUNS.append((self.decl.name, dict(self.spec)))
        super().__call__(*args)


def _install_counter() -> None:
    """Count the live elements every interpreted load reads from K's bytes (``K_LOADS``)."""
    import numpy as np
    from triton.runtime import interpreter as interp

    b = interp.InterpreterBuilder
    load = b.create_masked_load

    def masked_load(self, ptrs, mask, other, *a):  # noqa: ANN001, ANN202 - interpreter internals
        if K_LOADS:
            addr = np.asarray(ptrs.data).astype(np.uint64)
            live = np.broadcast_to(np.asarray(mask.data), addr.shape).astype(bool)
            lo, hi = K_LOADS[0][:2]
            K_LOADS[0][2] += int(((addr >= lo) & (addr < hi) & live).sum())
        return load(self, ptrs, mask, other, *a)

    b.create_masked_load = masked_load


def expected_key_loads(lens_k: list[int], heads_k: int, group: int, sq: int, d: int, left: int, right: int,
                       whole_run: bool = False) -> int:
    """K elements one split loads: per (sequence, KV head, tile of BLOCK query rows), the key
    blocks from the tile's first row's window start to its last row's window end (``whole_run``:
    the run's first and last rows for every tile, as before the ranges were per tile)."""
    total = 0
    rows = group * sq
    for len_k in lens_k:
        diag = len_k - sq
        lft = len_k + sq if left < 0 else left
        rgt = len_k + sq if right < 0 else right
        for first in range(0, rows, BLOCK):
            last = min(first + BLOCK, rows) - 1
            if whole_run or first // sq != last // sq:
                q_first, q_last = 0, sq - 1
            else:
                q_first, q_last = first % sq, last % sq
            lo = max(q_first + diag - lft, 0)
            hi = max(min(q_last + 1 + diag + rgt, len_k), lo)
            lo = lo // BLOCK * BLOCK
            if hi > lo:
                total += min(lo + -(-(hi - lo) // BLOCK) * BLOCK, len_k) - lo
    return total * heads_k * d


def run_case(name: str, case: dict) -> dict:
    import torch

    c = {"B": 2, "Hq": 4, "Hk": 2, "Sq": 1, "D": 32, "dtype": "fp32", "cap": 64, "lens": (37, 5), "paged": 0,
         "new": 0, "causal": False, "window": None, "splits": 1, "pad": 0, **case}
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[c["dtype"]]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    lens, new = list(c["lens"]), c["new"]
    B, Hq, Hk, Sq, D = len(lens), c["Hq"], c["Hk"], c["Sq"], c["D"]
    total = [n + new for n in lens]
    cap = max(c["cap"], max(total))
    nan = float("nan")

    def view(*shape: int) -> Any:
        """The first D columns of a NaN buffer ``pad`` columns wider."""
        return torch.full((*shape, D + c["pad"]), nan, dtype=dtype)[..., :D]

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen).to(dtype)

    keys = [randn(n, Hk, D) for n in total]
    vals = [randn(n, Hk, D) for n in total]
    q = view(B, Sq, Hq)
    q.copy_((torch.randn(B, Sq, Hq, D, generator=gen) * c.get("amp", 1.0)).to(dtype))
    if c["paged"]:
        ps = c["paged"]
        num_pages = sum(-(-n // ps) for n in total) + 3
        perm = torch.randperm(num_pages, generator=gen).tolist()
        table = torch.full((B, -(-cap // ps)), -7, dtype=torch.int32)
        k_cache, v_cache = view(num_pages, ps, Hk), view(num_pages, ps, Hk)
        it = iter(perm)
        for b, n in enumerate(total):
            for j in range(-(-n // ps)):
                table[b, j] = next(it)
        where = [[(int(table[b, r // ps]), r % ps) for r in range(total[b])] for b in range(B)]
    else:
        table = None
        k_cache, v_cache = view(B, cap, Hk), view(B, cap, Hk)
        where = [[(b, r) for r in range(total[b])] for b in range(B)]
    for b in range(B):
        for r in range(lens[b]):  # the cached rows; the new ones come through the append
            k_cache[where[b][r]] = keys[b][r]
            v_cache[where[b][r]] = vals[b][r]
    k_new = v_new = None
    if new:
        k_new, v_new = view(B, new, Hk), view(B, new, Hk)
        k_new.copy_(torch.stack([keys[b][lens[b]:] for b in range(B)]))
        v_new.copy_(torch.stack([vals[b][lens[b]:] for b in range(B)]))
    out = view(B, Sq, Hq) if c.get("out") else None
    lib = _Library(c.get("held"))
    lib.kernel = lambda kname, **params: _SpecHandle(lib.decls[kname], params)
    RUNS.clear()
    storage = k_cache.untyped_storage()
    K_LOADS[:] = [[storage.data_ptr(), storage.data_ptr() + storage.nbytes(), 0]] if c.get("count") else []
    softcap = c.get("softcap", 0.0)
    got, lse = op.decode_attention(q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                   block_table=table, k_new=k_new, v_new=v_new, causal=c["causal"],
                                   window=c["window"], num_splits=c["splits"], out=out, softcap=softcap, check=True,
                                   library=lib)
    loaded = K_LOADS[0][2] if K_LOADS else None
    K_LOADS.clear()
    failed: list[str] = []
    if out is not None and got.data_ptr() != out.data_ptr():
        failed.append("out was not written in place")
    runs = {(spec["HEAD_DIM"], spec.get("PADDED_D")) for k, spec in RUNS if k.startswith("attn_decode") and
            "HEAD_DIM" in spec}
    if runs != {tuple(c["run"])}:
        failed.append(f"launched (HEAD_DIM, PADDED_D) {sorted(runs)}, expected {c['run']}")
    launched = [k for k, _ in RUNS]
    # Long runs at a compiled head dim go through the variable-length forward (no splits there).
    routed = c.get("routed", Sq >= VARLEN_SEQLEN_Q and c["run"][1] == 0 and out is None)
    if routed != ("attn_decode_pack" in launched):
        failed.append(f"launches {launched}: the variable-length route {'not ' if routed else ''}expected")
    if ("attn_decode_append" in launched) != bool(new) or \
            not routed and ("attn_decode_combine" in launched) != (c["splits"] > 1):
        failed.append(f"launches {launched}")
    capped = [spec.get("SOFTCAP") for k, spec in RUNS if k == "attn_fwd"]
    if routed and softcap and capped != [1]:
        failed.append(f"the variable-length forward ran with SOFTCAP {capped}, expected [1]")
    tol = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 4e-2}[c["dtype"]]
    scale = 1 / math.sqrt(D)
    left, right = c["window"] if c["window"] else (-1, -1)
    if c["causal"]:
        right = 0
    group = Hq // Hk
    errors = {}
    for b in range(B):
        n = total[b]
        ref, ref_lse = fp64_reference(q[b], keys[b], vals[b], group, scale, left, right, softcap=softcap)
        if softcap:
            bent = (fp64_reference(q[b], keys[b], vals[b], group, scale, left, right)[0] - ref).abs().max().item()
            errors[f"bent{b}"] = bent
            if not bent > 10 * tol:
                failed.append(f"the cap bends sequence {b}'s answer by only {bent}: the case would prove nothing")
        err = (got[b].double() - ref).abs().max().item()
        gl = lse[b].double()
        lerr = torch.where(torch.isinf(gl) & torch.isinf(ref_lse), 0.0, (gl - ref_lse).abs()).max().item()
        errors[f"out{b}"], errors[f"lse{b}"] = err, lerr
        if not err <= tol:
            failed.append(f"out[{b}] (length {n}) error {err}")
        if not lerr <= tol * 10:
            failed.append(f"lse[{b}] error {lerr}")
        for r in range(lens[b], n):  # the appended rows landed where the table (or batch) says
            if not torch.equal(k_cache[where[b][r]], keys[b][r]):
                failed.append(f"appended row {r} of sequence {b} is not in the cache")
                break
    if c["pad"]:
        for what, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
            if t is not None and not t._base[..., D:].isnan().all():
                failed.append(f"{what}: a column past the head dim was written")
    result = {"errors": errors, "failed": failed}
    if loaded is not None:
        per_tile = expected_key_loads(total, Hk, group, Sq, D, left, right)
        whole = expected_key_loads(total, Hk, group, Sq, D, left, right, whole_run=True)
        # The variable-length route packs the cache once: each live key row read exactly once.
        want = sum(total) * Hk * D if routed else per_tile
        result["key_loads"] = {"loaded": loaded, "want": want, "per_tile": per_tile, "whole_run": whole}
        if loaded != want:
            failed.append(f"loaded {loaded} K elements, expected {want} (per-tile ranges: {per_tile}, "
                          f"whole run: {whole})")
    return result


def _main(names: list[str]) -> None:
    from aotriton_rt.ops.decode import validate

    patch_interpreter()
    _install_cpu()
    op._describe = validate._describe  # ``out`` is described by the operator's own import
    _install_counter()
    report_cases(names, lambda name: run_case(name, CASES[name]))


# ---------------------------------------------------------------------------------------------
# Test side.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return run_sharded(__file__, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_any_query_length_and_head_dim_matches_fp64_under_the_interpreter(interpreted: dict, name: str) -> None:
    result = interpreted[name]
    assert not result["failed"], f"{name}: {result['failed']}"
    assert any(k.startswith("out") for k in result["errors"])


def test_a_causal_run_of_128_rows_reads_each_key_once(interpreted: dict) -> None:
    # Sequences of 128 and 158 keys (0 and 30 cached). Packed for the variable-length forward,
    # every key is read once: less than the decode kernels' per-tile ranges (61% of one range
    # per run), which already read only the keys up to each tile.
    loads = interpreted["one_twenty_eight_rows_causal_reads_per_tile"]["key_loads"]
    assert loads["loaded"] == loads["want"] < loads["per_tile"] < 0.65 * loads["whole_run"], loads


def test_images_without_masked_variants_run_bucket_head_dims_as_before() -> None:
    from aotriton_rt.ops.decode.variants import choose

    legacy = {("attn_decode", frozenset({"dtype", "HEAD_DIM", "PAGED"})),
              ("attn_decode_combine", frozenset({"dtype", "HEAD_DIM"}))}

    def has(name: str, params: dict) -> bool:  # images built before PADDED_D: no such parameter
        return (name, frozenset(params)) in legacy and params["HEAD_DIM"] == 64

    assert choose("fp16", 64, True, True, has) == ({"dtype": "fp16", "HEAD_DIM": 64},
                                                   "head dim 64: images without masked variants")
    # Nothing serves 59 there: the first candidate, for the library to explain what is missing.
    assert choose("fp16", 59, True, False, has)[0] == {"dtype": "fp16", "HEAD_DIM": 64, "PADDED_D": 1}


def test_the_variant_candidates_run_from_the_exact_bucket_to_the_widest() -> None:
    from aotriton_rt.ops.decode.variants import candidates

    assert [(s["HEAD_DIM"], s.get("PADDED_D")) for s, _ in candidates("bf16", 128, True)] == [
        (128, 0), (128, 1), (160, 1), (192, 1), (224, 1), (256, 1), (128, None)]
    unaligned = candidates("bf16", 128, False)
    assert [(s["HEAD_DIM"], s["PADDED_D"]) for s, _ in unaligned][:2] == [(128, 1), (160, 1)]
    assert unaligned[0][1] == "head dim 128: the arrays are not 16-byte aligned, so rows are read masked on the 128 " \
                              "bucket"
    assert [s["HEAD_DIM"] for s, _ in candidates("fp16", 81, True)] == [96, 128, 160, 192, 224, 256]


def test_long_runs_fill_the_gpu_with_row_tiles_and_take_one_split() -> None:
    from aotriton_rt.ops.decode import SplitRule, num_splits_for

    rule = SplitRule(2, 4, 64)
    # One sequence, 8 KV heads, GQA 4: 128 query rows are 32 tiles per KV head, 256 programs.
    assert num_splits_for(1, 8, -(-4 * 128 // 16), 32768, 64, 132, rule) == 1
    assert num_splits_for(1, 8, -(-4 * 1 // 16), 32768, 64, 132, rule) > 1  # one token: split


def test_split_partials_stay_under_the_scratch_bound() -> None:
    from aotriton_rt.ops.decode.launch import MAX_SCRATCH_BYTES, fit_splits, scratch_bytes
    from aotriton_rt.ops.decode.validate import DecodePlan

    # 4 sequences, 8 KV heads, GQA 4, 2048 query rows: 8192 rows per KV head.
    plan = DecodePlan("fp16", 59, 4, 32, 8, 2048, 0, 1 << 20, False, 16, 1, 1 << 20, (0, 0, 0), (0, 0, 0),
                      (0, 0, 0), (0, 0, 0), (0, 0, 0), 0, -1, 0, 0.1, 0, False)
    assert scratch_bytes(plan, 64, 1) == 0
    assert scratch_bytes(plan, 64, 2) == 4 * 8 * 2 * 8192 * 65 * 4
    lowered = fit_splits(plan, 64, 64, explicit=False)
    assert 1 <= lowered < 64
    assert scratch_bytes(plan, 64, lowered) <= MAX_SCRATCH_BYTES < scratch_bytes(plan, 64, lowered + 1)
    assert fit_splits(plan, 64, lowered, explicit=True) == lowered
    with pytest.raises(ArgumentError, match=r"num_splits=64 needs 4160 MiB of fp32 scratch for the split partials, "
                                            r"past MAX_SCRATCH_BYTES \(256 MiB\); pass fewer splits or leave "
                                            r"num_splits=None"):
        fit_splits(plan, 64, 64, explicit=True)


def test_a_long_unaligned_call_picks_the_masked_variants_and_copies_nothing(recording: Any) -> None:  # noqa: F811
    import torch

    from tests.runtime.test_decode_op import LAUNCHES

    lib = recording
    # Rows of 67 elements: neither q nor the caches 16-byte aligned.
    q = torch.randn(2, 128, 8, 64 + 3).half()[..., :64]
    k, v = (torch.randn(2, 256, 2, 64 + 3).half()[..., :64] for _ in range(2))
    LAUNCHES.clear()
    op.decode_attention(q, k, v, cache_seqlens=100, causal=True, num_splits=1, library=lib)
    ((_, name, args),) = LAUNCHES
    assert name == "attn_decode" and args["Q"] == q.data_ptr() and args["head_dim"] == 64
    assert args["stride_qm"] == 8 * 67 and args["seqlen_q"] == 128
    launch = next(iter(op._kernels_of(lib).launches.values()))
    assert launch.spec == {"dtype": "fp16", "HEAD_DIM": 64, "PADDED_D": 1, "KV_DTYPE": "fp16"} and not launch.q_copy


def test_an_aligned_call_at_a_bucket_keeps_the_fast_path(recording: Any,  # noqa: F811
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from aotriton_rt.ops.decode import launch, validate
    from tests.runtime.test_decode_op import LAUNCHES

    monkeypatch.setattr(launch, "_describe", validate._describe)  # the recording one: q's copy is described
    lib = recording
    q = torch.randn(2, 1, 8, 64).half()
    k = torch.randn(2, 256, 2, 64).half()
    LAUNCHES.clear()
    op.decode_attention(q, k, torch.randn_like(k), cache_seqlens=100, num_splits=2, library=lib)
    launch = next(iter(op._kernels_of(lib).launches.values()))
    assert launch.spec == {"dtype": "fp16", "HEAD_DIM": 64, "PADDED_D": 0, "KV_DTYPE": "fp16"}
    assert launch.why == "head dim 64 is a bucket and the arrays are 16-byte aligned"
    # An unaligned q at the fast path is copied, as before: the caches decide the variant.
    LAUNCHES.clear()
    q_odd = torch.randn(2, 1, 8, 72).half()[..., :64]
    op.decode_attention(q_odd, k, torch.randn_like(k), cache_seqlens=100, num_splits=2, library=lib)
    decode = [args for _, name, args in LAUNCHES if name == "attn_decode"][0]
    assert decode["Q"] != q_odd.data_ptr() and decode["stride_qh"] == 64


def test_an_explicit_split_count_past_the_scratch_bound_is_refused(recording: Any) -> None:  # noqa: F811
    import torch

    q = torch.randn(1, 128, 32, 128).half()
    k = torch.randn(1, 256, 2, 128).half()
    with pytest.raises(ArgumentError, match=r"num_splits=1024 needs 2064 MiB of fp32 scratch"):
        op.decode_attention(q, k, torch.randn_like(k), cache_seqlens=100, num_splits=1024, library=recording)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _main(sys.argv[1:])


def test_the_long_query_route_takes_the_uncapped_forward_where_the_images_have_the_softcap_axis() -> None:
    """The route runs the varlen forward only where the images hold it for the call: an uncapped
    call needs SOFTCAP=0 where the forward has the axis (the default set holds D=256 varlen capped
    only, whose variants refuse softcap=0), and images built before the axis serve it unkeyed."""
    from aotriton_rt.ops.decode.launch import _varlen_route
    from aotriton_rt.ops.decode.validate import DecodePlan

    def plan(softcap: float) -> DecodePlan:
        B, Sq, Hq, Hk, D, cap = 2, 128, 4, 2, 256, 512
        return DecodePlan(dtype="bf16", head_dim=D, batch=B, heads_q=Hq, heads_k=Hk, seqlen_q=Sq, seqlen_new=0,
                          capacity=cap, paged=False, page_size=0, num_pages=0, seqlen_k_hint=cap,
                          q_strides=(Sq * Hq * D, D, Hq * D), k_strides=(cap * Hk * D, D, Hk * D),
                          v_strides=(cap * Hk * D, D, Hk * D), kn_strides=(0, 0, 0), vn_strides=(0, 0, 0),
                          bt_stride=0, window_left=-1, window_right=0, scale=0.0625, device=0, q_copy=False,
                          softcap=softcap)

    class Held:
        def __init__(self, forwards: list[dict]) -> None:
            self.forwards = forwards

        def has(self, name: str, params: dict, args: tuple = ()) -> bool:
            if name != "attn_fwd":
                return True  # the packing kernels
            return any(all(f.get(k, "absent") == v for k, v in params.items()) for f in self.forwards)

    spec = {"dtype": "bf16", "HEAD_DIM": 256}
    capped_only = Held([{"HEAD_DIM": 256, "VARLEN": 1, "CAUSAL": 1, "SOFTCAP": 1, "dtype": "bf16", "HEAD_DIM_V": 256,
                         "BIAS": 0, "DROPOUT": 0}])
    assert not _varlen_route(plan(0.0), capped_only, spec, "bshd", {}, True)
    assert _varlen_route(plan(50.0), capped_only, spec, "bshd", {}, True)
    before_axis = Held([{"HEAD_DIM": 256, "VARLEN": 1, "CAUSAL": 1, "dtype": "bf16", "HEAD_DIM_V": 256, "BIAS": 0,
                         "DROPOUT": 0}])
    assert _varlen_route(plan(0.0), before_axis, spec, "bshd", {}, True)
    assert not _varlen_route(plan(50.0), before_axis, spec, "bshd", {}, True)
    # The same for ALiBi: decode calls never pass slopes, so an ALIBI=1 forward serves none.
    alibi_only = Held([{**capped_only.forwards[0], "SOFTCAP": 0, "ALIBI": 1}])
    assert not _varlen_route(plan(0.0), alibi_only, spec, "bshd", {}, True)
    both = Held([{**capped_only.forwards[0], "SOFTCAP": 0, "ALIBI": a} for a in (0, 1)])
    assert _varlen_route(plan(0.0), both, spec, "bshd", {}, True)
