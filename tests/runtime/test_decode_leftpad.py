"""Left-padded batches decoded in place (FlashAttention-2's ``cache_leftpad``), without a GPU.

- Under Triton's interpreter (subprocesses, as tests/runtime/test_decode_kvcache.py): sequence
  b's keys are cache rows ``[cache_leftpad[b], cache_seqlens[b] + Sn)`` and the query rows stay
  its last ones. The rows before each start hold NaN (and, paged, the table entries of pages
  wholly before it are out of range): a result free of NaN and equal to an fp64 reference shows
  they were never read. Starts at 0, inside a key block and past a block edge, with appended
  rows, causal and windowed masks, GQA, 1 and 3 query rows, splits, one-entry-per-block and
  one-entry-per-chunk pages; a start past the capacity without ``check`` sets FAULT_LENGTH.
- Refusals on the host (no kernel runs): starts past their lengths, negative, of the wrong
  dtype or shape; with ``check=True`` device starts are read back and checked.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from aotriton_rt import ArgumentError
from aotriton_rt.ops import decode as op
from tests.helpers.interpreter import patch_interpreter, report_cases, run_sharded
from tests.runtime.test_decode_bounds import _append, _arrays, recording  # noqa: F401 - the fixture
from tests.runtime.test_decode_op import BLOCK_N, _install_cpu, _Library, fp64_reference

ROOT = Path(__file__).resolve().parents[2]

# Defaults: Hq=4, Hk=2 (GQA), D=32, fp32, a contiguous cache of 64 rows, one split, BLOCK_N=16;
# "lens" cached rows and "starts" per sequence. Starts 7 and 18: inside the first block and past
# the first block edge; a start equal to its length sees only the appended rows (or no key).
CASES: dict[str, dict] = {
    "one_row_contiguous_append_causal_gqa": {"Sq": 1, "new": 1, "causal": True, "lens": (37, 20, 45),
                                             "starts": (0, 7, 18)},
    "three_rows_paged_append_window_splits": {"Sq": 3, "paged": 16, "new": 3, "causal": True, "window": (20, 0),
                                              "lens": (40, 30, 50), "starts": (5, 17, 33), "splits": 2},
    "three_rows_no_mask_splits_start_at_length": {"Sq": 3, "lens": (30, 3, 40), "starts": (16, 3, 0),
                                                  "splits": 3},
    "one_row_paged_chunks_start_mid_block": {"Sq": 1, "paged": 16, "block_n": 32, "new": 2, "causal": True,
                                             "lens": (45, 33, 20), "starts": (20, 33, 0), "splits": 2},
    "start_past_capacity_faults_without_check": {"Sq": 1, "lens": (37, 20, 45), "starts": (3, 200, 18),
                                                 "check": False, "fault": 1},
}


# ---------------------------------------------------------------------------------------------
# Interpreter side (subprocess).
# ---------------------------------------------------------------------------------------------

def run_case(name: str, case: dict) -> dict:
    import torch

    c = {"Hq": 4, "Hk": 2, "Sq": 1, "D": 32, "cap": 64, "paged": 0, "new": 0, "causal": False, "window": None,
         "splits": 1, "check": True, "fault": None, **case}
    BLOCK_N[0] = c.get("block_n", 16)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    lens, starts, new = list(c["lens"]), list(c["starts"]), c["new"]
    B, Hq, Hk, Sq, D = len(lens), c["Hq"], c["Hk"], c["Sq"], c["D"]
    total = [n + new for n in lens]
    cap = max(c["cap"], max(total))
    nan = float("nan")
    keys = [torch.randn(n, Hk, D, generator=gen) for n in total]
    vals = [torch.randn(n, Hk, D, generator=gen) for n in total]
    q = torch.randn(B, Sq, Hq, D, generator=gen)
    if c["paged"]:
        ps = c["paged"]
        blocks = -(-cap // ps)
        num_pages = B * blocks + 2
        perm = iter(torch.randperm(num_pages, generator=gen).tolist())
        table = torch.full((B, blocks), -7, dtype=torch.int32)
        for b in range(B):
            for j in range(-(-total[b] // ps)):
                if (j + 1) * ps > min(starts[b], cap):  # pages wholly before the start stay unmapped
                    table[b, j] = next(perm)
        k_cache, v_cache = (torch.full((num_pages, ps, Hk, D), nan) for _ in range(2))
        where = [[(int(table[b, r // ps]), r % ps) for r in range(total[b])] for b in range(B)]
    else:
        table = None
        k_cache, v_cache = (torch.full((B, cap, Hk, D), nan) for _ in range(2))
        where = [[(b, r) for r in range(total[b])] for b in range(B)]
    for b in range(B):
        for r in range(min(starts[b], lens[b]), lens[b]):  # rows before the start stay NaN
            k_cache[where[b][r]] = keys[b][r]
            v_cache[where[b][r]] = vals[b][r]
    k_new = v_new = None
    if new:
        k_new = torch.stack([keys[b][lens[b]:] for b in range(B)])
        v_new = torch.stack([vals[b][lens[b]:] for b in range(B)])
    lib = _Library()
    op.read_faults(library=lib)
    got, lse = op.decode_attention(q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                   cache_leftpad=torch.tensor(starts, dtype=torch.int32), block_table=table,
                                   k_new=k_new, v_new=v_new, causal=c["causal"], window=c["window"],
                                   num_splits=c["splits"], check=c["check"], library=lib)
    failed: list[str] = []
    faults = op.read_faults(library=lib)
    if faults != (c["fault"] or 0):
        failed.append(f"fault flag {faults}, expected {c['fault'] or 0}")
    scale = 1 / math.sqrt(D)
    left, right = c["window"] if c["window"] else (-1, -1)
    if c["causal"]:
        right = 0
    group = Hq // Hk
    errors = {}
    for b in range(B):
        n, s0 = total[b], starts[b]
        if s0 > cap:  # the faulting sequence answers NaN
            if not (got[b].isnan().all() and lse[b].isnan().all()):
                failed.append(f"sequence {b} with start {s0} past the capacity did not answer NaN")
            continue
        ref, ref_lse = fp64_reference(q[b], keys[b], vals[b], group, scale, left, right, start=s0)
        err = (got[b].double() - ref).abs().max().item()
        gl = lse[b].double()
        lerr = torch.where(torch.isinf(gl) & torch.isinf(ref_lse), 0.0, (gl - ref_lse).abs()).max().item()
        errors[f"out{b}"], errors[f"lse{b}"] = err, lerr
        if not err <= 1e-4:
            failed.append(f"out[{b}] (start {s0}, length {n}) error {err}")
        if not lerr <= 1e-3:
            failed.append(f"lse[{b}] (start {s0}) error {lerr}")
    return {"errors": errors, "failed": failed}


def _main(names: list[str]) -> None:
    from aotriton_rt.ops.decode import validate

    patch_interpreter()
    _install_cpu()
    validate._host_starts = lambda obj: None  # CPU tensors stand for device arrays here
    op._describe = validate._describe
    report_cases(names, lambda name: run_case(name, CASES[name]))


# ---------------------------------------------------------------------------------------------
# Test side.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return run_sharded(__file__, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_left_padded_sequences_match_fp64_and_never_read_before_their_start(interpreted: dict, name: str) -> None:
    result = interpreted[name]
    assert not result["failed"], f"{name}: {result['failed']}"
    assert any(k.startswith("out") for k in result["errors"])


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("starts,lens,match", [
    ((31, 0), (30, 30), r"cache_leftpad\[0\] = 31 must be in \[0, 30\] \(cache_seqlens\[0\] = 30\)"),
    ((0, -1), (30, 30), r"cache_leftpad\[1\] = -1 must be in \[0, 30\]"),
    ((5, 12), 10, r"cache_leftpad\[1\] = 12 must be in \[0, 10\]"),
], ids=["past_host_length", "negative", "past_int_length"])
def test_host_starts_outside_their_lengths_are_refused(recording: Any, paged: bool,  # noqa: F811
                                                      starts: tuple, lens: Any, match: str) -> None:
    import torch

    lens = torch.tensor(lens, dtype=torch.int32) if isinstance(lens, tuple) else lens
    starts = torch.tensor(starts, dtype=torch.int32)
    for _ in range(2):  # the second takes the cached plan, which checks host starts again
        op.decode_attention(**_arrays(paged), cache_seqlens=lens, cache_leftpad=torch.zeros(2, dtype=torch.int32),
                            **_append(2), library=recording)
        with pytest.raises(ArgumentError, match=match):
            op.decode_attention(**_arrays(paged), cache_seqlens=lens, cache_leftpad=starts, **_append(2),
                                library=recording)


def test_device_starts_are_checked_with_check_and_malformed_ones_refused(recording: Any,  # noqa: F811
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from aotriton_rt.ops.decode import validate
    from tests.runtime.test_decode_op import LAUNCHES

    monkeypatch.setattr(validate, "_host_lengths", lambda obj: None)  # device lengths and starts
    monkeypatch.setattr(validate, "_host_starts", lambda obj: None)
    a = _arrays(True)
    lens = torch.tensor((30, 20), dtype=torch.int32)
    good, bad = torch.tensor((4, 20), dtype=torch.int32), torch.tensor((4, 21), dtype=torch.int32)
    LAUNCHES.clear()
    op.decode_attention(**a, cache_seqlens=lens, cache_leftpad=good, check=True, library=recording)
    (args,) = [args for _, name, args in LAUNCHES if name == "attn_decode"]
    assert args["CacheStart"] == good.data_ptr()
    with pytest.raises(ArgumentError, match=r"cache_leftpad\[1\] = 21 must be in \[0, 20\]"):
        op.decode_attention(**a, cache_seqlens=lens, cache_leftpad=bad, check=True, library=recording)
    op.decode_attention(**a, cache_seqlens=lens, cache_leftpad=bad, check=False, library=recording)  # unchecked
    for wrong, match in ((good.long(), r"cache_leftpad must be a contiguous int32 array of shape \(2,\), got i64"),
                         (torch.zeros(3, dtype=torch.int32), r"shape \(2,\), got i32 \(3,\)"),
                         (0, r"cache_leftpad must be an int32 array of shape \(2,\), got 0")):
        with pytest.raises(ArgumentError, match=match):
            op.decode_attention(**a, cache_seqlens=lens, cache_leftpad=wrong, library=recording)


def test_calls_without_leftpad_share_the_librarys_zero_starts(recording: Any) -> None:  # noqa: F811
    from aotriton_rt.ops.decode.launch import _kernels_of
    from tests.runtime.test_decode_op import LAUNCHES

    LAUNCHES.clear()
    for causal in (False, True, True):  # two plans, one repeated
        op.decode_attention(**_arrays(False), cache_seqlens=7, causal=causal, library=recording)
    starts = {args["CacheStart"] for _, name, args in LAUNCHES if name == "attn_decode"}
    (zeros,) = _kernels_of(recording).zero_starts.values()
    assert starts == {zeros.data_ptr()} and len(zeros) == 64 and not zeros.any()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _main(sys.argv[1:])
