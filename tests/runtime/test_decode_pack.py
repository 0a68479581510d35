"""Packing a KV cache for the variable-length forward (``attn_decode_lengths``, ``attn_decode_pack``,
``attn_decode_poison``), under Triton's interpreter, without a GPU.

Each case builds a cache (contiguous, or pages of 16 rows in a shuffled order) whose rows outside
every sequence's live range ``[start, length + new)`` hold NaN, runs the three kernels as the
runtime would, and checks: the prefix sums (queries dense, keys the live rows), every packed row
equal to its cache row (so no NaN was read), and for hostile lengths, starts and table entries
the fault bits per sequence and in the flag, NaN packed rows for the faulting sequence only, and
NaN output and logsumexp rows for it after the poison kernel, the others untouched.
"""

from __future__ import annotations

import functools
import operator
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# name: lens, starts, new rows, page size (0: contiguous), head dim (PADDED_D when not the bucket),
# table changes {(b, column): page}, expected fault bits per sequence.
CASES: dict[str, dict] = {
    "contiguous_starts_and_an_empty_sequence": {"lens": (37, 0, 20), "starts": (0, 0, 5)},
    "paged_with_appended_rows": {"lens": (40, 17, 33), "starts": (3, 0, 20), "new": 2, "page": 16},
    "padded_head_dim_paged": {"lens": (21, 30), "starts": (4, 0), "page": 16, "D": 40},
    "length_and_start_faults": {"lens": (10, -3, 70, 12), "starts": (0, 0, 0, 99),
                                "faults": (0, 1, 1, 1)},
    "a_page_past_the_cache": {"lens": (40, 30, 5), "starts": (0, 0, 0), "page": 16, "table": {(1, 1): 10**6},
                              "faults": (0, 2, 0)},
}


def run_case(name: str, case: dict) -> dict:
    import torch
    import triton

    from builder.kernels.decode import attn_decode_lengths, attn_decode_pack, attn_decode_poison

    c = {"new": 0, "page": 0, "D": 64, "table": {}, "faults": None, "Hk": 2, "cap": 64, **case}
    lens, starts, new, page, D, Hk, cap = list(c["lens"]), list(c["starts"]), c["new"], c["page"], c["D"], c["Hk"], \
        c["cap"]
    B = len(lens)
    bucket = 64
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    nan = float("nan")
    # The live rows each sequence should pack, before any clamp: [start, length + new).
    total = [max(0, min(n, cap - new)) + new for n in lens]
    first = [min(max(s, 0), t) for s, t in zip(starts, total)]
    rows = [torch.randn(total[b], Hk, D, generator=gen).half() for b in range(B)]
    if page:
        blocks = -(-cap // page)
        num_pages = B * blocks + 3
        perm = iter(torch.randperm(num_pages, generator=gen).tolist())
        table = torch.tensor([[next(perm) for _ in range(blocks)] for _ in range(B)], dtype=torch.int32)
        k = torch.full((num_pages, page, Hk, D), nan).half()
        for b in range(B):
            for r in range(first[b], total[b]):
                k[table[b, r // page], r % page] = rows[b][r]
        for (b, j), p in c["table"].items():
            table[b, j] = p
    else:
        table = torch.zeros((1, 1), dtype=torch.int32)
        num_pages = 1
        k = torch.full((B, cap, Hk, D), nan).half()
        for b in range(B):
            k[b, first[b]:total[b]] = rows[b][first[b]:]
    v = k * 2
    lens_t = torch.tensor(lens, dtype=torch.int32)
    starts_t = torch.tensor(starts, dtype=torch.int32)
    cu_q = torch.full((B + 1,), -1, dtype=torch.int32)
    cu_k = torch.full((B + 1,), -1, dtype=torch.int32)
    seq_faults = torch.full((B,), -1, dtype=torch.int32)
    faults = torch.zeros((1,), dtype=torch.int32)
    Sq = 3
    attn_decode_lengths[(1,)](cu_q, cu_k, seq_faults, lens_t, starts_t, B, Sq, new, cap, BLOCK_B=2)
    packed_rows = int(cu_k[-1])
    ko = torch.full((max(packed_rows, 1), Hk, bucket), 7.0).half()  # packed rows are the bucket wide
    vo = torch.full_like(ko, 7.0)
    attn_decode_pack[(triton.cdiv(cap, 16), B * Hk)](
        k, v, ko, vo, cu_k, table, lens_t, starts_t, seq_faults, faults,
        k.stride(0), k.stride(2), k.stride(1), v.stride(0), v.stride(2), v.stride(1),
        ko.stride(0), ko.stride(1), vo.stride(0), vo.stride(1), table.stride(0),
        B, Hk, new, cap, num_pages, page or 16, D,
        HEAD_DIM=bucket, PAGED=int(bool(page)), PADDED_D=int(D != bucket), BLOCK_R=16)
    failed: list[str] = []
    if cu_q.tolist() != [b * Sq for b in range(B + 1)]:
        failed.append(f"cu_q {cu_q.tolist()}")
    want = c["faults"] or (0,) * B
    if seq_faults.tolist() != list(want):
        failed.append(f"sequence faults {seq_faults.tolist()}, expected {list(want)}")
    if int(faults) != functools.reduce(operator.or_, want, 0):
        failed.append(f"fault flag {int(faults)}, expected the OR of {list(want)}")
    for b in range(B):
        lo, hi = int(cu_k[b]), int(cu_k[b + 1])
        got_k, got_v = ko[lo:hi, :, :D].float(), vo[lo:hi, :, :D].float()
        if not ((ko[lo:hi, :, D:] == 0).all() and (vo[lo:hi, :, D:] == 0).all()):
            failed.append(f"sequence {b}: columns past the head dim are not zero")
        if want[b]:
            if hi - lo < 1 or not (got_k.isnan().any() and got_v.isnan().any()):
                failed.append(f"faulting sequence {b} packed no NaN row ({hi - lo} rows)")
            continue
        ref = rows[b][first[b]:].float()
        if hi - lo != len(ref):
            failed.append(f"sequence {b}: {hi - lo} packed rows, expected {len(ref)}")
        elif not (torch.equal(got_k, ref) and torch.equal(got_v, ref * 2)):
            failed.append(f"sequence {b}: packed rows differ from the cache's live rows "
                          f"(NaN read: {bool(got_k.isnan().any())})")
    # The poison kernel: NaN over the faulting sequences' rows only.
    Hq = 4
    out = torch.zeros((B, Sq, Hq, D)).half()
    lse = torch.zeros((B, Hq, Sq))
    attn_decode_poison[(1, B * Hq)](out, lse, seq_faults, out.stride(0), out.stride(2), out.stride(1),
                                    lse.stride(0), lse.stride(1), B, Hq, Sq, D,
                                    HEAD_DIM=bucket, PADDED_D=int(D != bucket), BLOCK_M=16)
    for b in range(B):
        if bool(want[b]) != bool(out[b].float().isnan().all() and lse[b].isnan().all()):
            failed.append(f"sequence {b}: poisoned {bool(out[b].float().isnan().any())}, fault {want[b]}")
    return {"name": name, "ok": not failed, "failed": failed, "packed_rows": packed_rows}


def test_packing_a_cache_for_the_varlen_forward() -> None:
    from tests.helpers.interpreter import run_sharded

    results = run_sharded(__file__, list(CASES))
    bad = {n: r.get("failed") or r.get("error") for n, r in results.items() if not r.get("ok")}
    assert not bad, bad


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tests.helpers.interpreter import patch_interpreter, report_cases

    patch_interpreter()
    report_cases(sys.argv[1:], lambda n: run_case(n, CASES[n]))
