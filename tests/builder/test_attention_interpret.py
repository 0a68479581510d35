"""Attention kernels checked under Triton's interpreter against an fp64 reference.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the cases run in subprocesses
that execute this file as a script (``python test_attention_interpret.py CASE...``) and print one
JSON line per case; the tests below read those results. The kernels are the real ones from
``builder/kernels/attention*.py``, launched the way the operator launches them (explicit strides,
padded head-dim buckets, 0 for unused pointers).
"""

from __future__ import annotations

import math
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.interpreter import patch_interpreter, report_cases, run_sharded
from tests.helpers.sass import sass_ops

ROOT = Path(__file__).resolve().parents[2]

# name -> case. Shapes are tiny: the interpreter runs every program in Python.
# Defaults: B=2, Hq=Hk=2, Sq=37, Sk=53 (primes, not block multiples), D=32, fp32, BHSD,
# no mask, no bias, no dropout, BLOCK 16x16.
CASES: dict[str, dict] = {
    "plain_fp32": {},
    "plain_fp16": {"dtype": "fp16"},
    "plain_bf16": {"dtype": "bf16"},
    "causal_top_left_sq_lt_sk": {"causal": 1},
    "causal_bottom_right_sq_lt_sk": {"causal": 2},
    "causal_top_left_sq_gt_sk": {"causal": 1, "Sq": 53, "Sk": 37},
    "causal_bottom_right_sq_gt_sk_empty_rows": {"causal": 2, "Sq": 53, "Sk": 37},
    # Mask mode 1 takes its alignment at run time (causal_align 1: bottom-right); mode 2 ignores it.
    "causal_mode_1_aligned_bottom_right_sq_lt_sk": {"causal": 1, "align": 1},
    "causal_mode_1_aligned_bottom_right_empty_rows": {"causal": 1, "align": 1, "Sq": 53, "Sk": 37, "D": 128,
                                                      "dtype": "fp16"},
    "causal_mode_2_ignores_causal_align_0": {"causal": 2, "align": 0, "Sq": 53, "Sk": 37},
    "varlen_mode_1_bottom_right_per_sequence": {"varlen": ((5, 9), (17, 31), (1, 1), (40, 23)), "causal": 1,
                                                "align": 1, "window": (6, 0)},
    "sliding_window_bottom_right": {"causal": 2, "window": (7, 3)},
    "sliding_window_top_left_left_only": {"causal": 1, "window": (11, -1)},
    "blocks_32x16_causal": {"causal": 2, "BM": 32, "BN": 16, "window": (-1, 5)},
    "blocks_16x32_causal_top_left": {"causal": 1, "BM": 16, "BN": 32},
    "gqa_4_to_2_bshd": {"Hq": 4, "Hk": 2, "layout": "bshd", "causal": 2},
    "mqa_3_to_1": {"Hq": 3, "Hk": 1, "dtype": "fp16"},
    "bias_full_with_dbias": {"bias": "full"},
    "bias_broadcast_batch_and_heads": {"bias": "row", "causal": 1},
    "bias_broadcast_batch": {"bias": "heads", "Hq": 4, "Hk": 2},
    "dropout_fp32": {"dropout": 0.3},
    "dropout_causal_gqa_bias": {"dropout": 0.25, "causal": 2, "Hq": 4, "Hk": 2, "bias": "full"},
    "varlen_causal_bottom_right": {"varlen": ((5, 9), (17, 31), (1, 1), (40, 23)), "causal": 2},
    "varlen_window_dropout_bias": {"varlen": ((19, 19), (33, 7)), "causal": 1, "window": (4, 2),
                                   "dropout": 0.2, "bias": "full"},
    "head_dim_48_bucket_fp16": {"D": 48, "dtype": "fp16", "causal": 2},
    # Head dims above 64 loop over a causal program's two query blocks at run time.
    "head_dim_128_causal_runtime_tile_loop": {"D": 128, "dtype": "bf16", "causal": 1, "Sq": 61, "Sk": 61, "BM": 16},
    "head_dim_40_padded_to_48": {"D": 40, "pad_to": 48},
    "head_dim_80_bf16": {"D": 80, "dtype": "bf16", "Sq": 19, "Sk": 23},
    "qk_32_v_16": {"D": 32, "Dv": 16, "causal": 1},
    # The widest bucket: a head dim zero-padded from 300 to 512, GQA, top-left causal.
    "head_dim_300_padded_to_512_gqa_causal_fp16": {"D": 300, "pad_to": 512, "dtype": "fp16", "causal": 1, "B": 1,
                                                   "Hq": 2, "Hk": 1, "Sq": 23, "Sk": 29},
    # Non-deterministic backward: dQ accumulated with fp32 atomics inside the dk/dv kernel.
    "atomic_dq_gqa_causal_bshd": {"atomic": 1, "Hq": 4, "Hk": 2, "layout": "bshd", "causal": 2},
    "atomic_dq_varlen_dropout_padded_head": {"atomic": 1, "varlen": ((13, 29), (30, 17)), "dropout": 0.2,
                                             "D": 40, "pad_to": 48, "causal": 1, "window": (-1, 4)},
    # The Hopper path (device-side tensor descriptors): zero-fill must replace every load mask.
    "tma_varlen_causal_head_dim_48": {"tma": 1, "varlen": ((19, 30), (33, 7)), "causal": 2, "D": 48,
                                      "dtype": "fp16"},
    "tma_gqa_bshd_window_bias_dropout": {"tma": 1, "Hq": 4, "Hk": 2, "layout": "bshd", "causal": 1,
                                         "window": (6, 2), "bias": "full", "dropout": 0.2},
    # The backward's TMA path with the atomic dQ: q/dO descriptors per GQA head, rows past the end.
    "tma_atomic_dq_gqa_ragged": {"tma": 1, "atomic": 1, "Hq": 4, "Hk": 2, "causal": 2, "Sq": 45, "Sk": 70,
                                 "dtype": "bf16"},
    # Warp-specialized: one always-masked loop over the band.
    "tma_ws_causal_bottom_right_empty_rows": {"tma": 1, "ws": 1, "causal": 2, "Sq": 53, "Sk": 37,
                                              "dtype": "bf16"},
    "tma_ws_plain_blocks_32x32": {"tma": 1, "ws": 1, "BM": 32, "BN": 32, "Hq": 4, "Hk": 1},
    # The unmasked loop scales row maxima, not scores: a negative scale must take the masked path.
    "negative_scale_causal_window": {"scale": -5.0, "causal": 2, "window": (9, 4)},
    "negative_scale_plain_fp16": {"scale": -4.0, "dtype": "fp16", "Sq": 40, "Sk": 64},
    # Every score far below 0 (q and k point apart): a row whose first block shows it no key must
    # not keep a running maximum of 0, or exp2 underflows for all of its real keys.
    "very_negative_scores_left_window": {"shift": 6.0, "causal": 1, "window": (11, -1)},
    # Causal backward programs are renumbered longest-first over groups of heads (4 heads a group
    # here, the last group short): every (block, head) must still be computed exactly once.
    "causal_program_order_head_groups": {"B": 3, "Hq": 6, "Hk": 3, "Sq": 29, "Sk": 40, "causal": 2,
                                         "group_programs": 8},
    # ALiBi (FlashAttention-2's: -slope * |i + Sk - Sq - j|, bottom-right positions whatever the mask's
    # alignment), shared by the batch ("heads") or per sequence ("batch"); lengths Sq != Sk both ways.
    "alibi_no_mask_sq_lt_sk": {"alibi": "heads"},
    "alibi_no_mask_sq_gt_sk_per_batch_fp16": {"alibi": "batch", "Sq": 53, "Sk": 37, "dtype": "fp16"},
    "alibi_causal_bottom_right_empty_rows_gqa": {"alibi": "batch", "causal": 2, "Sq": 53, "Sk": 37, "Hq": 4,
                                                  "Hk": 2},
    "alibi_causal_top_left_mode_1": {"alibi": "heads", "causal": 1, "align": 0, "BM": 32},
    "alibi_varlen_window_per_sequence": {"alibi": "batch", "varlen": ((5, 9), (17, 31), (1, 1), (40, 23)),
                                         "causal": 1, "align": 1, "window": (6, 2)},
    "alibi_head_dim_128_runtime_tile_loop_bf16": {"alibi": "heads", "D": 128, "dtype": "bf16", "causal": 1,
                                                  "align": 1, "Sq": 61, "Sk": 61},
    "alibi_dropout_mqa": {"alibi": "batch", "dropout": 0.25, "Hq": 3, "Hk": 1, "causal": 2},
    "alibi_atomic_dq_varlen": {"alibi": "batch", "atomic": 1, "varlen": ((13, 29), (30, 17)), "causal": 2},
    "alibi_tma_gqa_bshd": {"alibi": "heads", "tma": 1, "Hq": 4, "Hk": 2, "layout": "bshd", "causal": 1,
                           "window": (-1, 3)},
    "alibi_tma_ws_causal_bottom_right": {"alibi": "batch", "tma": 1, "ws": 1, "causal": 2, "Sq": 45, "Sk": 70},
    "alibi_negative_scale": {"alibi": "heads", "scale": -2.0, "causal": 2, "window": (9, 4)},
    # Attention sinks joined in the forward's epilogue (the backward kernels as they are).
    "sinks_no_mask_fp16": {"sinks": True, "dtype": "fp16"},
    "sinks_causal_bottom_right_empty_rows_gqa": {"sinks": True, "causal": 2, "Sq": 53, "Sk": 37, "Hq": 4, "Hk": 2},
    "sinks_window_varlen_bf16": {"sinks": True, "causal": 1, "align": 1, "window": (5, 0), "dtype": "bf16",
                                 "varlen": ((5, 9), (17, 31), (1, 1), (40, 23))},
    "sinks_dropout_head_dim_128_runtime_tile_loop": {"sinks": True, "dropout": 0.25, "D": 128, "causal": 1},
    "sinks_tma_ws_alibi": {"sinks": True, "alibi": "heads", "tma": 1, "ws": 1, "causal": 2, "Sq": 45, "Sk": 70},
}


# ---------------------------------------------------------------------------------------------
# Subprocess side: runs with TRITON_INTERPRET=1.
# ---------------------------------------------------------------------------------------------

def _bucket(d: int) -> int:
    from builder.kernels.attention import HEAD_DIM_BUCKETS
    return next(b for b in HEAD_DIM_BUCKETS if b >= d)


def run_case(name: str, case: dict) -> dict:
    """Run one case forward and backward; return max errors and the checks that failed."""
    import torch
    import triton

    import builder.kernels.attention as attention_module
    from builder.kernels.attention import attn_fwd
    from builder.kernels.attention_bwd import attn_bwd_dkdv, attn_bwd_dq, attn_bwd_dq_convert, attn_bwd_preprocess

    c = {"B": 2, "Hq": 2, "Hk": 2, "Sq": 37, "Sk": 53, "D": 32, "dtype": "fp32", "layout": "bhsd",
         "causal": 0, "window": None, "bias": None, "dropout": 0.0, "varlen": None, "BM": 16,
         "BN": 16, **case}
    if "group_programs" in c:  # the interpreter reads the kernels' globals at run time
        attention_module.CAUSAL_GROUP_PROGRAMS = triton.language.constexpr(c["group_programs"])
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[c["dtype"]]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    B, Hq, Hk, D = c["B"], c["Hq"], c["Hk"], c["D"]
    Dv = c.get("Dv", D)
    varlen = c["varlen"]
    if varlen:
        B = len(varlen)
        lens_q = [a for a, _ in varlen]
        lens_k = [b for _, b in varlen]
        Sq, Sk = max(lens_q), max(lens_k)
    else:
        Sq, Sk = c["Sq"], c["Sk"]
        lens_q, lens_k = [Sq] * B, [Sk] * B
    scale = c.get("scale", 1.0 / math.sqrt(D))
    causal = c["causal"]
    wl, wr = c["window"] if c["window"] else (-1, 0 if causal else -1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    # Logical per-sequence tensors (H, S, D); the kernel sees them packed or batched.
    shift = c.get("shift", 0.0)
    qs = [(randn(Hq, lq, D).float() + shift).to(dtype) for lq in lens_q]
    ks = [(randn(Hk, lk, D).float() - shift).to(dtype) for lk in lens_k]
    vs = [randn(Hk, lk, Dv) for lk in lens_k]
    dos = [randn(Hq, lq, Dv) for lq in lens_q]

    # Operator behaviour for head dims between buckets: zero-pad to the bucket.
    Dk_b = c.get("pad_to", D)
    Dv_b = c.get("pad_to", Dv)
    assert Dk_b == _bucket(Dk_b) and Dv_b == _bucket(Dv_b)

    def pad(t, d):
        return torch.nn.functional.pad(t, (0, d - t.shape[-1]))

    def pack(ts, d, heads):
        """Lay out as the kernel expects; returns (tensor, stride_z, stride_h, stride_m)."""
        ts = [pad(t, d) for t in ts]
        if varlen:
            x = torch.cat([t.transpose(0, 1) for t in ts], 0).contiguous()  # (total, H, d)
            return x, 0, x.stride(1), x.stride(0)
        if c["layout"] == "bshd":
            x = torch.stack([t.transpose(0, 1) for t in ts]).contiguous()  # (B, S, H, d)
            return x, x.stride(0), x.stride(2), x.stride(1)
        x = torch.stack(ts).contiguous()  # (B, H, S, d)
        return x, x.stride(0), x.stride(1), x.stride(2)

    def unpack(x, d, lens):
        if varlen:
            starts = [0] + list(torch.tensor(lens).cumsum(0)[:-1].tolist())
            return [x[s:s + n].transpose(0, 1)[..., :d] for s, n in zip(starts, lens)]
        if c["layout"] == "bshd":
            return [x[b].transpose(0, 1)[..., :lens[b], :d] for b in range(B)]
        return [x[b][..., :lens[b], :d] for b in range(B)]

    q, sqz, sqh, sqm = pack(qs, Dk_b, Hq)
    k, skz, skh, skn = pack(ks, Dk_b, Hk)
    v, svz, svh, svn = pack(vs, Dv_b, Hk)
    do, sdoz, sdoh, sdom = pack(dos, Dv_b, Hq)
    out = torch.full_like(do, float("nan"))
    dq = torch.full_like(q, float("nan"))
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    _, soz, soh, som = pack(dos, Dv_b, Hq)
    if varlen:
        total_q = sum(lens_q)
        lse = torch.full((Hq, total_q), float("nan"))
        slz, slh = 0, lse.stride(0)
        cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0).to(torch.int32)
    else:
        lse = torch.full((B, Hq, Sq), float("nan"))
        slz, slh = lse.stride(0), lse.stride(1)
        cu_q = cu_k = torch.empty(0, dtype=torch.int32)
    delta = torch.full_like(lse, float("nan"))

    # Bias: stored broadcast with stride 0 where a dimension is shared.
    bias_kind = c["bias"]
    nothing = torch.empty(0, dtype=dtype)
    if bias_kind:
        shape = {"full": (B, Hq), "row": (1, 1), "heads": (1, Hq)}[bias_kind]
        bias_store = torch.randn(*shape, Sq, Sk, generator=gen).to(dtype)
        bias = bias_store.expand(B, Hq, Sq, Sk)
        sbz, sbh, sbm = bias.stride()[:3]
        dbias = torch.full((B, Hq, Sq, Sk), float("nan"), dtype=dtype)
        sdbz, sdbh, sdbm = dbias.stride()[:3]
    else:
        bias = dbias = nothing
        sbz = sbh = sbm = sdbz = sdbh = sdbm = 0
    # ALiBi slopes (fp32): one per query head, shared by the batch (stride 0) or per sequence.
    alibi_kind = c.get("alibi")
    if alibi_kind:
        slopes = (torch.rand(B if alibi_kind == "batch" else 1, Hq, generator=gen) * 0.4 + 0.05)
        saz = slopes.stride(0) if alibi_kind == "batch" else 0
    else:
        slopes, saz = torch.empty(0), 0
    alibi = {"alibi_slopes": slopes, "stride_az": saz, "ALIBI": 1 if alibi_kind else 0}
    # Sinks (fp32, one logit per query head), around the scores' size; one of -inf (a head without).
    sinks_t = torch.randn(Hq, generator=gen) * 2.0 if c.get("sinks") else torch.empty(0)
    if c.get("sinks"):
        sinks_t[-1] = float("-inf")
    p_drop = c["dropout"]
    dropout = 2 if p_drop else 0
    seed, offset = 0x1234_5678_9ABC, 77
    dmask = torch.zeros(B, Hq, Sq, Sk, dtype=torch.int8) if dropout else torch.empty(0, dtype=torch.int8)
    sdmz, sdmh, sdmm = dmask.stride()[:3] if dropout else (0, 0, 0)

    flags = {"HEAD_DIM": Dk_b, "HEAD_DIM_V": Dv_b, "CAUSAL": causal, "DROPOUT": dropout,
             "VARLEN": 1 if varlen else 0}
    # causal_align: 1 aligns a mode-1 band bottom-right; mode 2 is bottom-right whatever it says.
    align = c.get("align", 1 if causal == 2 else 0)
    common = (B, Hq, Hk, Sq, Sk, scale, p_drop, seed, offset, wl, wr, align)

    def forward(out, lse, dmask):
        # The registry's grid (causal programs pair query blocks p and n-1-p).
        grid = attention_module.KERNELS[0].grid_of(seqlen_q=Sq, batch=B, num_heads_q=Hq, BLOCK_M=c["BM"],
                                                   CAUSAL=causal, WARP_SPEC=c.get("ws", 0))
        attn_fwd[grid](
            q, k, v, bias, out, lse, dmask, cu_q, cu_k,
            sqz, sqh, sqm, skz, skh, skn, svz, svh, svn, soz, soh, som, sbz, sbh, sbm, slz, slh,
            sdmz, sdmh, sdmm, *common, softcap=0.0, BIAS=1 if bias_kind else 0, BLOCK_M=c["BM"], BLOCK_N=c["BN"],
            USE_TMA=c.get("tma", 0), WARP_SPEC=c.get("ws", 0), SOFTCAP=0, Sinks=sinks_t,
            use_sinks=int(bool(c.get("sinks"))), **alibi, **flags)

    forward(out, lse, dmask)
    atomic = c.get("atomic", 0)
    # The fp32 dQ accumulator of the atomic path, laid out like q (so it has q's strides);
    # NaN-filled so that a missed zero-fill shows.
    dqacc = torch.full(q.shape, float("nan")) if atomic else torch.empty(0)
    sdqaz, sdqah, sdqam = (sqz, sqh, sqm) if atomic else (0, 0, 0)
    attn_bwd_preprocess[(triton.cdiv(Sq, c["BM"]), B * Hq, 1)](
        out, do, delta, dqacc, cu_q, soz, soh, som, sdoz, sdoh, sdom, sdqaz, sdqah, sdqam, slz, slh,
        B, Hq, Sq, HEAD_DIM=Dk_b, HEAD_DIM_V=Dv_b, VARLEN=flags["VARLEN"], DQ_ATOMIC=atomic,
        BLOCK_M=c["BM"])
    bias_flag = 2 if bias_kind else 0
    attn_bwd_dkdv[(triton.cdiv(Sk, c["BN"]), B * Hk, 1)](
        q, k, v, bias, do, dk, dv, dbias, dqacc, lse, delta, cu_q, cu_k,
        sqz, sqh, sqm, skz, skh, skn, svz, svh, svn, sbz, sbh, sbm, sdoz, sdoh, sdom,
        skz, skh, skn, svz, svh, svn, sdbz, sdbh, sdbm, sdqaz, sdqah, sdqam, slz, slh, *common, softcap=0.0,
        BIAS=bias_flag, DQ_ATOMIC=atomic, BLOCK_M=c["BM"], BLOCK_N=c["BN"], USE_TMA=c.get("tma", 0), SOFTCAP=0,
        **alibi, **flags)
    if atomic:
        attn_bwd_dq_convert[(triton.cdiv(Sq, c["BM"]), B * Hq, 1)](
            dqacc, dq, cu_q, sdqaz, sdqah, sdqam, sqz, sqh, sqm, B, Hq, Sq,
            HEAD_DIM=Dk_b, VARLEN=flags["VARLEN"], BLOCK_M=c["BM"])
    else:
        attn_bwd_dq[(triton.cdiv(Sq, c["BM"]), B * Hq, 1)](
            q, k, v, bias, do, dq, lse, delta, cu_q, cu_k,
            sqz, sqh, sqm, skz, skh, skn, svz, svh, svn, sbz, sbh, sbm, sdoz, sdoh, sdom,
            sqz, sqh, sqm, slz, slh, *common, softcap=0.0,
            BIAS=bias_flag, BLOCK_M=c["BM"], BLOCK_N=c["BN"], USE_TMA=c.get("tma", 0), SOFTCAP=0, **alibi,
            **flags)

    errors: dict[str, float] = {}
    failed: list[str] = []
    tol = {"fp32": 2e-4, "fp16": 2e-2, "bf16": 8e-2}[c["dtype"]]

    def compare(what, got, ref):
        ref = ref.to(torch.float64)
        got = got.to(torch.float64)
        both_inf = torch.isinf(ref) & torch.isinf(got) & (torch.sign(ref) == torch.sign(got))
        diff = torch.where(both_inf, 0.0, (got - ref).abs())
        err = float(diff.max()) if diff.numel() else 0.0
        scale_ = max(1.0, float(ref[torch.isfinite(ref)].abs().max()) if ref.numel() else 1.0)
        errors[what] = max(errors.get(what, 0.0), err / scale_)
        if not err <= tol * scale_:  # also catches NaN
            failed.append(f"{what}: max error {err:.3g} > {tol * scale_:.3g}")

    if dropout:
        # Same seed and offset again: the same mask; another offset: a different one.
        dmask2 = torch.zeros_like(dmask)
        forward(torch.empty_like(out), torch.empty_like(lse), dmask2)
        if not torch.equal(dmask, dmask2):
            failed.append("dropout mask differs between two runs with the same seed and offset")
        offset += 1
        common = (B, Hq, Hk, Sq, Sk, scale, p_drop, seed, offset, wl, wr, align)
        dmask3 = torch.zeros_like(dmask)
        forward(torch.empty_like(out), torch.empty_like(lse), dmask3)
        if torch.equal(dmask, dmask3):
            failed.append("dropout mask did not change with the Philox offset")

    outs, dqs, dks, dvs = (unpack(out, Dv, lens_q), unpack(dq, D, lens_q), unpack(dk, D, lens_k),
                           unpack(dv, Dv, lens_k))
    group = Hq // Hk
    dbias_ref = torch.zeros(B, Hq, Sq, Sk, dtype=torch.float64)
    kept = total = 0
    for b in range(B):
        lq, lk = lens_q[b], lens_k[b]
        qr = qs[b].double().requires_grad_()
        kr = ks[b].double().requires_grad_()
        vr = vs[b].double().requires_grad_()
        s = qr @ kr.repeat_interleave(group, 0).transpose(-1, -2) * scale
        if bias_kind:
            br = bias[b, :, :lq, :lk].double().requires_grad_()
            s = s + br
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        if alibi_kind:
            # After the scale, per sequence: its own lengths align i and j bottom-right.
            slope = slopes[b if alibi_kind == "batch" else 0].double()[:, None, None]
            s = s - slope * (i + lk - lq - j).abs()
        if causal:
            diag = lk - lq if causal == 2 or align else 0
            rel = j - i - diag
            vis = torch.ones(lq, lk, dtype=torch.bool)
            if wl >= 0:
                vis &= rel >= -wl
            if wr >= 0:
                vis &= rel <= wr
        else:
            vis = torch.ones(lq, lk, dtype=torch.bool)
        s = s.masked_fill(~vis, float("-inf"))
        row_ok = vis.any(-1)
        if c.get("sinks"):
            # The sink joins every row's softmax with no value: L' = logsumexp(scores, sink).
            sink = sinks_t.double()[:, None, None].expand(Hq, lq, 1)
            full = torch.logsumexp(torch.cat([s, sink], -1), -1)
            p = torch.exp(s - torch.where(torch.isinf(full), 0.0, full)[..., None])
            lse_ref = full.detach()
        else:
            s_safe = torch.where(row_ok[:, None], s, 0.0)
            p = torch.softmax(s_safe, -1) * row_ok[:, None]
            lse_ref = torch.where(row_ok, torch.logsumexp(s_safe.detach(), -1), float("-inf"))
        if dropout:
            keep = dmask[b, :, :lq, :lk].bool() & vis
            kept += int(keep.sum())
            total += int(vis.sum()) * Hq
            p = p * keep / (1.0 - p_drop)
        o = p @ vr.repeat_interleave(group, 0)
        grads = torch.autograd.grad(o, [qr, kr, vr] + ([br] if bias_kind else []), dos[b].double())
        compare("out", outs[b], o.detach())
        got_lse = lse[:, cu_q[b]:cu_q[b] + lq] if varlen else lse[b, :, :lq]
        compare("lse", got_lse, lse_ref)
        compare("dq", dqs[b], grads[0])
        compare("dk", dks[b], grads[1])
        compare("dv", dvs[b], grads[2])
        if bias_kind:
            dbias_ref[b, :, :lq, :lk] = grads[3]
            compare("dbias", dbias[b, :, :lq, :lk], grads[3])
    if dropout and total:
        frac = kept / total
        if abs(frac - (1 - p_drop)) > 0.05:
            failed.append(f"kept fraction {frac:.3f} is far from 1 - p = {1 - p_drop:.3f}")
    if bias_kind and bias_kind != "full":
        # What the operator does for a broadcast bias: sum the full dS over the shared dims.
        dims = {"row": (0, 1), "heads": (0,)}[bias_kind]
        got = dbias.double().sum(dims, keepdim=True)
        compare("dbias_reduced", got, dbias_ref.sum(dims, keepdim=True))
    return {"name": name, "errors": errors, "failed": failed}


def _main(names: list[str]) -> None:
    patch_interpreter()
    report_cases(names, lambda name: run_case(name, CASES[name]))


# ---------------------------------------------------------------------------------------------
# Test side.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return run_sharded(__file__, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_attention_matches_fp64_reference_under_interpreter(interpreted: dict, name: str) -> None:
    result = interpreted[name]
    assert not result["failed"], f"{name}: {result['failed']} (errors {result['errors']})"
    expected = {"out", "lse", "dq", "dk", "dv"}
    if CASES[name].get("bias"):
        expected.add("dbias")
    assert expected <= set(result["errors"]), f"{name}: not every output was compared"


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compiles through the builder (no interpreter in this process).
# ---------------------------------------------------------------------------------------------

# (kernel, target, spec, config index, what the variant must show)
COMPILES = [
    # 8-warp 128x128, 3 stages, just under the limit: #0 without a mask, #1 causal (two query
    # blocks per program, in a loop); the causal #0 is the 4-warp tile at 255 registers.
    ("attn_fwd", "sm90", {"dtype": "fp16", "HEAD_DIM": 128, "CAUSAL": 2}, 0, "wgmma"),
    ("attn_fwd", "sm90", {"dtype": "fp16", "HEAD_DIM": 128, "CAUSAL": 2}, 1, "wgmma"),
    ("attn_fwd", "sm90", {"dtype": "bf16", "HEAD_DIM": 128, "CAUSAL": 0}, 0, "wgmma"),
    ("attn_fwd", "sm90", {"dtype": "fp16", "HEAD_DIM": 64, "CAUSAL": 0, "BIAS": 1, "DROPOUT": 1}, 0, "wgmma"),
    ("attn_fwd", "gfx942", {"dtype": "fp16", "HEAD_DIM": 128, "CAUSAL": 1, "BIAS": 1, "DROPOUT": 2}, 0, ""),
    ("attn_bwd_dkdv", "gfx1100", {"dtype": "bf16", "HEAD_DIM": 80, "CAUSAL": 2, "BIAS": 2}, 0, ""),
    ("attn_bwd_dq", "sm90", {"dtype": "fp16", "HEAD_DIM": 128, "CAUSAL": 2, "VARLEN": 1}, 0, "wgmma"),
    ("attn_bwd_dkdv", "sm90", {"dtype": "fp16", "HEAD_DIM": 128, "DQ_ATOMIC": 1}, 0, ""),
    ("attn_bwd_preprocess", "gfx942", {"dtype": "fp16", "HEAD_DIM": 128, "DQ_ATOMIC": 1}, 0, ""),
    # ALiBi: the 4-warp causal tile (two programs per SM) and the backward's dQ keep their limits.
    ("attn_fwd", "sm90", {"dtype": "fp16", "HEAD_DIM": 128, "CAUSAL": 1, "ALIBI": 1}, 0, "wgmma"),
    ("attn_bwd_dq", "sm90", {"dtype": "bf16", "HEAD_DIM": 64, "CAUSAL": 1, "VARLEN": 1, "ALIBI": 1}, 0, "wgmma"),
    # Head dim 512 through TMA without a spill: the forward, and the backward's 32-row tiles
    # (under wgmma's 64: mma.sync); CDNA's 8-wave forward in gfx942's 64 KB of LDS.
    ("attn_fwd", "sm90", {"dtype": "fp16", "HEAD_DIM": 512, "CAUSAL": 0}, 0, "wgmma nospill"),
    ("attn_bwd_dkdv", "sm90", {"dtype": "bf16", "HEAD_DIM": 512, "CAUSAL": 1}, 0, "mma_sync nospill"),
    ("attn_bwd_dq", "sm90", {"dtype": "fp16", "HEAD_DIM": 512, "CAUSAL": 0}, 0, "mma_sync nospill"),
    ("attn_fwd", "gfx942", {"dtype": "bf16", "HEAD_DIM": 512, "CAUSAL": 1}, 0, ""),
    ("attn_bwd_dkdv", "gfx942", {"dtype": "fp16", "HEAD_DIM": 512, "CAUSAL": 0}, 0, ""),
    ("attn_bwd_dq", "gfx950", {"dtype": "bf16", "HEAD_DIM": 512, "CAUSAL": 1, "VARLEN": 1}, 0, ""),
]


def _compile(item: tuple) -> dict:
    from builder.compile import compile_job
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    name, arch, want, index, _ = item
    base = {"HEAD_DIM_V": want.get("HEAD_DIM"), "CAUSAL": 0, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0, "DQ_ATOMIC": 0,
            "SOFTCAP": 0, "ALIBI": 0}
    want = {**{k: v for k, v in base.items() if v is not None}, **want}
    jobs = [j for j in expand(load_kernels()[name], parse_targets(arch), "full", "3.6.0")
            if all(j.spec.get(k, v) == v for k, v in want.items()) and j.config_index == index]
    assert len(jobs) == 1, f"{name} {arch} {want} #{index}: {len(jobs)} jobs"
    compiled, raw, _ = compile_job(jobs[0])
    variant = compiled.to_json()
    assert raw[:4] == b"\x7fELF"  # cubin and hsaco are both ELF
    if arch.startswith("sm"):
        variant["sass_ops"] = sass_ops(raw)
    return variant


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    # Fresh processes: each compile is independent and CI has 2 cores.
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_compile, COMPILES))


@pytest.mark.parametrize("index", range(len(COMPILES)), ids=[f"{c[0]}-{c[1]}-#{c[3]}" for c in COMPILES])
def test_attention_variant_compiles_ahead_of_time_within_shared_memory(compiled: list, index: int) -> None:
    from builder.kernels.attention import SHARED_LIMIT

    name, arch, _, _, expect = COMPILES[index]
    variant = compiled[index]
    assert variant["kernel"] == name and variant["target"]["arch"] == arch
    assert 0 < variant["shared"] <= SHARED_LIMIT[arch], f"{variant['shared']} bytes of shared memory"
    if name == "attn_fwd" and arch == "sm90" and variant["config"]["num_warps"] == 4:
        # The 4-warp tile is chosen for two programs per SM: 228 KB, less 1 KB reserved per block.
        assert variant["shared"] <= (233472 // 2) - 1024, f"{variant['shared']} bytes: one program per SM"
    assert variant["image"]["raw_size"] > 1000
    if expect == "warp_specialized":
        # 4 declared warps become a producer and two consumer warp groups; descriptors need scratch.
        assert variant["num_warps"] == 12
        assert variant["scratch"]["global_size"] > 0
    else:
        assert variant["num_warps"] == variant["config"]["num_warps"]
    if "nospill" in expect:
        assert variant["sass_ops"].get("STL", 0) == 0, "register spills"
    if "sass_ops" in variant and "mma_sync" not in expect:
        ops = variant["sass_ops"]
        hgmma = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
        fences = ops.get("WARPGROUP.ARRIVE", 0)
        assert hgmma > 0, "no wgmma in an sm90 kernel"
        # ptxas serializes wgmma (a fence and a wait around every instruction) when it cannot
        # prove the in-flight operand registers safe: a silent 2x slowdown. Each tl.dot should
        # issue its k-steps under one fence.
        assert hgmma >= 4 * fences, f"wgmma serialized by ptxas: {hgmma} HGMMA, {fences} fences"


# ---------------------------------------------------------------------------------------------
# The real Hopper code paths (TMA zero-fill, warp specialization) on the GPU, through the JIT.
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("causal", [0, 1, 2])  # 1: aligned bottom-right by causal_align
@pytest.mark.parametrize("index", range(3))
def test_every_sm90_forward_config_matches_an_fp32_reference_on_the_gpu(index: int, causal: int) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU visible to torch")
    import triton

    sys.path.insert(0, str(ROOT))
    from builder.kernels.attention import KERNELS, attn_fwd, fwd_configs
    from builder.targets import KNOWN

    spec = {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": causal, "BIAS": 0, "DROPOUT": 0,
            "VARLEN": 0, "ALIBI": 0}
    configs = fwd_configs(spec, KNOWN["sm90"])
    if index >= len(configs):
        pytest.skip(f"the sm90 table has {len(configs)} forward configs")
    cfg = configs[index]
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    # Lengths that are no block multiple, seqlen_q < seqlen_k (bottom-right band), BSHD layout.
    B, H, Sq, Sk, D = 2, 3, 1000, 1111, 128
    gen = torch.Generator(device="cuda").manual_seed(index)

    def bshd(n):
        return torch.randn(B, n, H, D, device="cuda", dtype=torch.float16, generator=gen).transpose(1, 2)

    q, k, v = bshd(Sq), bshd(Sk), bshd(Sk)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, Sq), float("nan"), device="cuda")
    none = torch.empty(16, device="cuda", dtype=torch.int8)
    scale = 1 / math.sqrt(D)
    grid = KERNELS[0].grid_of(seqlen_q=Sq, batch=B, num_heads_q=H, CAUSAL=causal, **cfg.constexprs)
    attn_fwd[grid](q, k, v, q, out, lse, none, none, none, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                   *out.stride()[:3], 0, 0, 0, *lse.stride()[:2], 0, 0, 0, B, H, H, Sq, Sk, scale, 0.0, 0, 0,
                   -1, 0 if causal else -1, 1, 0.0, lse, 0, lse, 0, HEAD_DIM=D, HEAD_DIM_V=D, CAUSAL=causal, BIAS=0,
                   DROPOUT=0, VARLEN=0, SOFTCAP=0, ALIBI=0, **cfg.constexprs, num_warps=cfg.num_warps,
                   num_stages=cfg.num_stages, **cfg.options)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(Sq, device="cuda")[:, None]
        j = torch.arange(Sk, device="cuda")[None, :]
        s = s.masked_fill(j > i + (Sk - Sq), float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    ref = torch.softmax(s, -1) @ v.float()
    err_out = (out.float() - ref).abs().max().item()
    err_lse = (lse - ref_lse).abs().max().item()
    assert err_out < 1e-2 and err_lse < 1e-3, f"config #{index} {cfg}: out {err_out:.3g}, lse {err_lse:.3g}"


def test_bench_argument_lists_match_the_kernels() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.attention_jit import KERNELS, Problem

    p = Problem(2, 4, 128, 64, 2, "fp16", materialize=False)
    for name, fn in KERNELS.items():
        cfg = {"fwd": ("BLOCK_M", "BLOCK_N", "USE_TMA", "WARP_SPEC"), "pre": ("BLOCK_M",), "prea": ("BLOCK_M",),
               "conv": ("BLOCK_M",)}.get(name, ("BLOCK_M", "BLOCK_N", "USE_TMA"))
        supplied = len(p.args(name, mock=True)) + len(p.flags(name)) + len(cfg)
        # A lever's constexpr with a default (FAST_TANH) may be left to it.
        required = sum(1 for param in fn.params if not param.has_default)
        assert required <= supplied <= len(fn.arg_names), f"{name}: {supplied} arguments for {len(fn.arg_names)}"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _main(sys.argv[1:])
