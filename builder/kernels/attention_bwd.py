"""FlashAttention-2 backward kernels: preprocess (delta), dk/dv, dq.

The split design is deterministic: the dk/dv kernel owns one key block of one key/value head
and loops over every query head of its GQA group, so the group reduction happens in registers;
the dq kernel owns one query block. Neither uses atomics. Conventions (layouts, mask band,
dropout counters) are those of ``attention.py``; see docs/attention.md.

Delta (rowsum(dO * O), fp32) has the layout of LSE and uses LSE's strides.
"""

from __future__ import annotations

import triton
import triton.language as tl

from builder.kernels._attention_sets import (
    in_bwd_sweep_set,
    in_default_backward_schemes_set,
    in_default_backward_set,
    in_default_sm90_atomic_set,
    in_gputest_set,
    in_sm90_gluon_atomic_set,
)
from builder.kernels.attention import (
    ALIGN_CHECKS,
    DTYPES,
    GQA_CHECKS,
    HEAD_DIM_BUCKETS,
    LOG2E,
    _alibi,
    _alibi_factor,
    _causal_order,
    _dropout_keep,
    _hip_options,
    _sequence,
    _span,
    _tanh,
    _window,
    block_d,
    divisibility_of,
    fwd_excluded,
    head_dim_excluded,
    signature_of,
    stride_checks,
)
from builder.registry import ConfigDecl, KernelDecl


@triton.jit
def attn_bwd_preprocess(
    Out, DO, Delta, DQacc, cu_seqlens_q,
    stride_oz, stride_oh, stride_om,
    stride_doz, stride_doh, stride_dom,
    stride_dqaz, stride_dqah, stride_dqam,
    stride_lz, stride_lh,
    batch, num_heads_q, seqlen_q,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, VARLEN: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] (fp32); with DQ_ATOMIC also zero the
    fp32 dQ accumulator that attn_bwd_dkdv adds into (one launch instead of a memset).

    Grid: (cdiv(seqlen_q, BLOCK_M), batch * num_heads_q, 1).
    """
    BLOCK_DV: tl.constexpr = triton.next_power_of_2(HEAD_DIM_V)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // num_heads_q
    off_h = pid_bh % num_heads_q
    q_start, len_q = _sequence(cu_seqlens_q, off_b, seqlen_q, VARLEN)
    off_bz = off_b.to(tl.int64) * (1 - VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= len_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < len_q) & (offs_d[None, :] < HEAD_DIM_V)
    rows = (q_start + offs_m).to(tl.int64)
    o = tl.load(Out + off_bz * stride_oz + off_h.to(tl.int64) * stride_oh + rows[:, None] * stride_om
                + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + off_bz * stride_doz + off_h.to(tl.int64) * stride_doh + rows[:, None] * stride_dom
                 + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    D_base = Delta + off_b.to(tl.int64) * stride_lz + off_h.to(tl.int64) * stride_lh + q_start
    tl.store(D_base + offs_m, delta, mask=offs_m < len_q)
    if DQ_ATOMIC:
        BLOCK_DK: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
        offs_dk = tl.arange(0, BLOCK_DK)
        tl.store(DQacc + off_bz * stride_dqaz + off_h.to(tl.int64) * stride_dqah + rows[:, None] * stride_dqam
                 + offs_dk[None, :], tl.zeros([BLOCK_M, BLOCK_DK], dtype=tl.float32),
                 mask=(offs_m[:, None] < len_q) & (offs_dk[None, :] < HEAD_DIM))


@triton.jit
def attn_bwd_dq_convert(
    DQacc, DQ, cu_seqlens_q,
    stride_dqaz, stride_dqah, stride_dqam,
    stride_dqz, stride_dqh, stride_dqm,
    batch, num_heads_q, seqlen_q,
    HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """DQ = DQacc cast to DQ's type, after attn_bwd_dkdv with DQ_ATOMIC (already scaled).

    Grid: (cdiv(seqlen_q, BLOCK_M), batch * num_heads_q, 1).
    """
    BLOCK_DK: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // num_heads_q
    off_h = pid_bh % num_heads_q
    q_start, len_q = _sequence(cu_seqlens_q, off_b, seqlen_q, VARLEN)
    off_bz = off_b.to(tl.int64) * (1 - VARLEN)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DK)
    mask = (offs_m[:, None] < len_q) & (offs_d[None, :] < HEAD_DIM)
    rows = (q_start + offs_m).to(tl.int64)
    acc = tl.load(DQacc + off_bz * stride_dqaz + off_h.to(tl.int64) * stride_dqah + rows[:, None] * stride_dqam
                  + offs_d[None, :], mask=mask, other=0.0)
    tl.store(DQ + off_bz * stride_dqz + off_h.to(tl.int64) * stride_dqh + rows[:, None] * stride_dqm
             + offs_d[None, :], acc.to(DQ.dtype.element_ty), mask=mask)


@triton.jit
def _load_rows(ptrs, rows, len_rows, offs_d, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr):
    """Load a (rows x dim) tile; masks only what the variant and the loop can leave out of range."""
    BLOCK_D: tl.constexpr = offs_d.shape[0]
    if MASKED:
        mask = rows[:, None] < len_rows
        if HEAD_DIM != BLOCK_D:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        return tl.load(ptrs, mask=mask, other=0.0)
    elif HEAD_DIM != BLOCK_D:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, cols,
    Q_base, DO_base, B_base, DB_base, L_base, D_base, DQA_base, q_desc, do_desc,
    stride_qm, stride_dom, stride_bm, stride_dbm, stride_dqam,
    start, end, offs_m, offs_dk, offs_dv,
    len_q, len_k, diag, left, right, qk_scale, sm_scale,
    philox_seed, philox_offset, bh, dropout_p, softcap, alibi_k,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr,
    DQ_ATOMIC: tl.constexpr, USE_TMA: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):
    """Accumulate dk, dv of one key block over query blocks start, start+BLOCK_M, ... < end.

    Tiles are kept transposed, (keys x queries), so dk and dv come out of the dots directly.
    With DQ_ATOMIC the same dS also yields this block's share of dq, added to the fp32
    accumulator (FA2's scheme: 5 matmuls per tile instead of 7, at the cost of determinism).
    With USE_TMA, q and dO come through tensor descriptors (rows relative to the sequence start;
    they zero-fill past the sequence and the head dim, so no load mask is needed).
    """
    q_ptrs = Q_base + (start + offs_m)[:, None] * stride_qm + offs_dk[None, :]
    do_ptrs = DO_base + (start + offs_m)[:, None] * stride_dom + offs_dv[None, :]
    for start_m in range(start, end, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        if USE_TMA:
            q = q_desc.load([start_m, 0])
        else:
            q = _load_rows(q_ptrs, rows, len_q, offs_dk, HEAD_DIM, MASKED)
        if MASKED:
            lse = tl.load(L_base + rows, mask=rows < len_q, other=float("inf"))
            delta = tl.load(D_base + rows, mask=rows < len_q, other=0.0)
        else:
            lse = tl.load(L_base + rows)
            delta = tl.load(D_base + rows)
        # Rows that saw no key stored -inf: +inf here makes their probabilities 0, not NaN.
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
        qkT = tl.dot(k, tl.trans(q), input_precision=PREC)
        if SOFTCAP:
            tT = _tanh(qkT * (qk_scale / (softcap * LOG2E)))
            qkT = tT * (softcap * LOG2E)
        else:
            qkT = qkT * qk_scale
        if BIAS != 0:
            bmask = (rows[None, :] < len_q) & (cols[:, None] < len_k)
            biasT = tl.load(B_base + rows[None, :] * stride_bm + cols[:, None], mask=bmask, other=0.0)
            qkT += biasT.to(tl.float32) * LOG2E
        if ALIBI:
            # A constant of q and k: it enters P, not dS's formula.
            qkT += _alibi(alibi_k, rows[None, :], cols[:, None], len_q, len_k)
        pT = tl.math.exp2(qkT - lse[None, :])
        if MASKED:
            visible = rows[None, :] < len_q
            if CAUSAL != 0:
                rel = cols[:, None] - rows[None, :] - diag
                visible = visible & (rel >= -left) & (rel <= right)
            pT = tl.where(visible, pT, 0.0)
        if USE_TMA:
            do = do_desc.load([start_m, 0])
        else:
            do = _load_rows(do_ptrs, rows, len_q, offs_dv, HEAD_DIM_V, MASKED)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        if DROPOUT != 0:
            keepT = _dropout_keep(philox_seed, philox_offset, bh, rows[None, :], cols[:, None],
                                  dropout_p)
            inv_keep = 1.0 / (1.0 - dropout_p)
            pdT = tl.where(keepT, pT * inv_keep, 0.0)
            dv = tl.dot(pdT.to(do.dtype), do, dv, input_precision=PREC)
            dpT = tl.where(keepT, dpT * inv_keep, 0.0)
        else:
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)  # d(softcap * tanh(s / softcap)) / ds
        if BIAS == 2:
            tl.store(DB_base + rows[None, :] * stride_dbm + cols[:, None],
                     dsT.to(DB_base.dtype.element_ty),
                     mask=(rows[None, :] < len_q) & (cols[:, None] < len_k))
        dsT = dsT.to(q.dtype)
        dk = tl.dot(dsT, q, dk, input_precision=PREC)
        if DQ_ATOMIC:
            dq = tl.dot(tl.trans(dsT), k, input_precision=PREC) * sm_scale
            amask = rows[:, None] < len_q
            if HEAD_DIM != offs_dk.shape[0]:
                amask = amask & (offs_dk[None, :] < HEAD_DIM)
            tl.atomic_add(DQA_base + rows[:, None] * stride_dqam + offs_dk[None, :], dq, mask=amask,
                          sem="relaxed")
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit
def _zero_dbias(DB_base, stride_dbm, cols, start, end, len_q, len_k, offs_m, BLOCK_M: tl.constexpr):
    """dBias is 0 where the band hides a key; those query blocks are never visited otherwise."""
    zeros = tl.zeros([BLOCK_M, cols.shape[0]], dtype=DB_base.dtype.element_ty)
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m
        tl.store(DB_base + rows[:, None] * stride_dbm + cols[None, :], zeros,
                 mask=(rows[:, None] < len_q) & (cols[None, :] < len_k))


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, Bias, DO, DK, DV, DBias, DQacc, LSE, Delta, cu_seqlens_q, cu_seqlens_k,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_bz, stride_bh, stride_bm,
    stride_doz, stride_doh, stride_dom,
    stride_dkz, stride_dkh, stride_dkn,
    stride_dvz, stride_dvh, stride_dvn,
    stride_dbz, stride_dbh, stride_dbm,
    stride_dqaz, stride_dqah, stride_dqam,
    stride_lz, stride_lh,
    batch, num_heads_q, num_heads_k, seqlen_q, seqlen_k,
    sm_scale, dropout_p, philox_seed, philox_offset, window_left, window_right, causal_align, softcap,
    alibi_slopes, stride_az,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    CAUSAL: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    DQ_ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):
    """dK, dV of one key block of one key/value head, summed over its GQA query heads.

    Grid: (cdiv(seqlen_k, BLOCK_N), batch * num_heads_k, 1). BIAS: 0 none, 1 bias, 2 bias and
    dBias = dS written at DBias[b, h, i, j] (full, unbroadcast; the operator reduces it over
    broadcast dimensions). DQ_ATOMIC: also add dQ (scaled, fp32) into DQacc, which
    attn_bwd_preprocess zeroed and attn_bwd_dq_convert casts; then attn_bwd_dq is not run.
    USE_TMA (tuning, sm90 only): the streamed q and dO tiles through device-side tensor
    descriptors (one pair per query head, in the runtime's global scratch). ALIBI: the forward's
    ALiBi term (its slopes and ``stride_az``) in the recomputed scores of each query head.
    """
    PREC: tl.constexpr = "ieee" if Q.dtype.element_ty == tl.float32 else None
    BLOCK_DK: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    BLOCK_DV: tl.constexpr = triton.next_power_of_2(HEAD_DIM_V)
    if CAUSAL != 0:
        # Key blocks that see the most queries (the first ones) first, over small groups of heads.
        pid_n, pid_bh = _causal_order(tl.cdiv(seqlen_k, BLOCK_N), batch * num_heads_k, False)
    else:
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
    off_b = pid_bh // num_heads_k
    off_hk = pid_bh % num_heads_k
    group = num_heads_q // num_heads_k
    q_start, len_q = _sequence(cu_seqlens_q, off_b, seqlen_q, VARLEN)
    k_start, len_k = _sequence(cu_seqlens_k, off_b, seqlen_k, VARLEN)
    off_bz = off_b.to(tl.int64) * (1 - VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= len_k:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    cols = start_n + offs_n
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    krow = (k_start + cols).to(tl.int64)
    K_base = K + off_bz * stride_kz + off_hk.to(tl.int64) * stride_kh
    V_base = V + off_bz * stride_vz + off_hk.to(tl.int64) * stride_vh
    k = _load_rows(K_base + krow[:, None] * stride_kn + offs_dk[None, :], cols, len_k, offs_dk,
                   HEAD_DIM, True)
    v = _load_rows(V_base + krow[:, None] * stride_vn + offs_dv[None, :], cols, len_k, offs_dv,
                   HEAD_DIM_V, True)

    qk_scale = sm_scale * LOG2E
    diag, left, right = _window(len_q, len_k, window_left, window_right, causal_align, CAUSAL)
    # Seen from a key block the band is mirrored: rows i with j - diag - right <= i <= j - diag + left.
    if CAUSAL != 0:
        lo, f1, f2, hi = _span(start_n, BLOCK_N, len_q, -diag, right, left, BLOCK_M)
    else:
        lo = 0
        f1 = 0
        f2 = len_q // BLOCK_M * BLOCK_M
        hi = len_q

    dk = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    q_row0 = q_start.to(tl.int64)
    for g in range(0, group):
        off_h = off_hk * group + g
        bh = off_b * num_heads_q + off_h
        alibi_k = _alibi_factor(alibi_slopes, stride_az, off_b, off_h, ALIBI)
        Q_base = Q + off_bz * stride_qz + off_h.to(tl.int64) * stride_qh + q_row0 * stride_qm
        DO_base = DO + off_bz * stride_doz + off_h.to(tl.int64) * stride_doh + q_row0 * stride_dom
        L_base = LSE + off_b.to(tl.int64) * stride_lz + off_h.to(tl.int64) * stride_lh + q_start
        D_base = Delta + off_b.to(tl.int64) * stride_lz + off_h.to(tl.int64) * stride_lh + q_start
        B_base = Bias
        if BIAS != 0:
            B_base = Bias + off_b.to(tl.int64) * stride_bz + off_h.to(tl.int64) * stride_bh
        DB_base = DBias
        if BIAS == 2:
            DB_base = DBias + off_b.to(tl.int64) * stride_dbz + off_h.to(tl.int64) * stride_dbh
        DQA_base = DQacc
        if DQ_ATOMIC:
            DQA_base = DQacc + off_bz * stride_dqaz + off_h.to(tl.int64) * stride_dqah + q_row0 * stride_dqam
        if USE_TMA:
            q_desc = tl.make_tensor_descriptor(Q_base, shape=[len_q, HEAD_DIM], strides=[stride_qm, 1],
                                               block_shape=[BLOCK_M, BLOCK_DK])
            do_desc = tl.make_tensor_descriptor(DO_base, shape=[len_q, HEAD_DIM_V], strides=[stride_dom, 1],
                                                block_shape=[BLOCK_M, BLOCK_DV])
        else:
            q_desc = Q_base
            do_desc = DO_base
        if CAUSAL != 0:
            dk, dv = _dkdv_blocks(
                dk, dv, k, v, cols, Q_base, DO_base, B_base, DB_base, L_base, D_base, DQA_base, q_desc, do_desc,
                stride_qm, stride_dom, stride_bm, stride_dbm, stride_dqam, lo, f1, offs_m, offs_dk, offs_dv,
                len_q, len_k, diag, left, right, qk_scale, sm_scale, philox_seed, philox_offset, bh,
                dropout_p, softcap, alibi_k, True, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_M, PREC,
                DQ_ATOMIC, USE_TMA, SOFTCAP, ALIBI)
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, cols, Q_base, DO_base, B_base, DB_base, L_base, D_base, DQA_base, q_desc, do_desc,
            stride_qm, stride_dom, stride_bm, stride_dbm, stride_dqam, f1, f2, offs_m, offs_dk, offs_dv,
            len_q, len_k, diag, left, right, qk_scale, sm_scale, philox_seed, philox_offset, bh,
            dropout_p, softcap, alibi_k, False, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_M, PREC,
            DQ_ATOMIC, USE_TMA, SOFTCAP, ALIBI)
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, cols, Q_base, DO_base, B_base, DB_base, L_base, D_base, DQA_base, q_desc, do_desc,
            stride_qm, stride_dom, stride_bm, stride_dbm, stride_dqam, f2, hi, offs_m, offs_dk, offs_dv,
            len_q, len_k, diag, left, right, qk_scale, sm_scale, philox_seed, philox_offset, bh,
            dropout_p, softcap, alibi_k, True, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_M, PREC,
            DQ_ATOMIC, USE_TMA, SOFTCAP, ALIBI)
        if BIAS == 2 and CAUSAL != 0:
            _zero_dbias(DB_base, stride_dbm, cols, 0, lo, len_q, len_k, offs_m, BLOCK_M)
            hi_up = (hi + BLOCK_M - 1) // BLOCK_M * BLOCK_M
            _zero_dbias(DB_base, stride_dbm, cols, hi_up, len_q, len_q, len_k, offs_m, BLOCK_M)

    dk = dk * sm_scale
    kmask = cols[:, None] < len_k
    dkmask = kmask
    if HEAD_DIM != BLOCK_DK:
        dkmask = dkmask & (offs_dk[None, :] < HEAD_DIM)
    dvmask = kmask
    if HEAD_DIM_V != BLOCK_DV:
        dvmask = dvmask & (offs_dv[None, :] < HEAD_DIM_V)
    DK_base = DK + off_bz * stride_dkz + off_hk.to(tl.int64) * stride_dkh
    DV_base = DV + off_bz * stride_dvz + off_hk.to(tl.int64) * stride_dvh
    tl.store(DK_base + krow[:, None] * stride_dkn + offs_dk[None, :], dk.to(DK.dtype.element_ty),
             mask=dkmask)
    tl.store(DV_base + krow[:, None] * stride_dvn + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             mask=dvmask)


@triton.jit
def _dq_blocks(
    dq, q, do, lse, delta, rows,
    K_base, V_base, B_base, k_desc, v_desc,
    stride_kn, stride_vn, stride_bm,
    start, end, offs_n, offs_dk, offs_dv,
    len_q, len_k, diag, left, right, qk_scale,
    philox_seed, philox_offset, bh, dropout_p, softcap, alibi_k,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    USE_TMA: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):
    """Accumulate dq of one query block over key blocks start, start+BLOCK_N, ... < end (with
    USE_TMA, k and v through tensor descriptors, as q and dO in _dkdv_blocks)."""
    k_ptrs = K_base + (start + offs_n)[:, None] * stride_kn + offs_dk[None, :]
    v_ptrs = V_base + (start + offs_n)[:, None] * stride_vn + offs_dv[None, :]
    rows_b = tl.minimum(rows, len_q - 1)
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if USE_TMA:
            k = k_desc.load([start_n, 0])
            v = v_desc.load([start_n, 0])
        else:
            k = _load_rows(k_ptrs, cols, len_k, offs_dk, HEAD_DIM, MASKED)
            v = _load_rows(v_ptrs, cols, len_k, offs_dv, HEAD_DIM_V, MASKED)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        if SOFTCAP:
            t = _tanh(qk * (qk_scale / (softcap * LOG2E)))
            qk = t * (softcap * LOG2E)
        else:
            qk = qk * qk_scale
        if BIAS != 0:
            b_ptrs = B_base + rows_b[:, None] * stride_bm + cols[None, :]
            if MASKED:
                bias = tl.load(b_ptrs, mask=cols[None, :] < len_k, other=0.0)
            else:
                bias = tl.load(b_ptrs)
            qk += bias.to(tl.float32) * LOG2E
        if ALIBI:
            qk += _alibi(alibi_k, rows[:, None], cols[None, :], len_q, len_k)
        p = tl.math.exp2(qk - lse[:, None])
        if MASKED:
            visible = cols[None, :] < len_k
            if CAUSAL != 0:
                rel = cols[None, :] - rows[:, None] - diag
                visible = visible & (rel >= -left) & (rel <= right)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        if DROPOUT != 0:
            keep = _dropout_keep(philox_seed, philox_offset, bh, rows[:, None], cols[None, :],
                                 dropout_p)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def attn_bwd_dq(
    Q, K, V, Bias, DO, DQ, LSE, Delta, cu_seqlens_q, cu_seqlens_k,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_bz, stride_bh, stride_bm,
    stride_doz, stride_doh, stride_dom,
    stride_dqz, stride_dqh, stride_dqm,
    stride_lz, stride_lh,
    batch, num_heads_q, num_heads_k, seqlen_q, seqlen_k,
    sm_scale, dropout_p, philox_seed, philox_offset, window_left, window_right, causal_align, softcap,
    alibi_slopes, stride_az,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    CAUSAL: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):
    """dQ of one query block of one query head.

    Grid: (cdiv(seqlen_q, BLOCK_M), batch * num_heads_q, 1). BIAS only matters as 0 / non-0 here.
    USE_TMA (tuning, sm90 only): the streamed k and v tiles through device-side tensor descriptors.
    ALIBI: the forward's ALiBi term in the recomputed scores.
    """
    PREC: tl.constexpr = "ieee" if Q.dtype.element_ty == tl.float32 else None
    BLOCK_DK: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    BLOCK_DV: tl.constexpr = triton.next_power_of_2(HEAD_DIM_V)
    num_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    if CAUSAL != 0:
        # Query blocks that see the most keys first, over small groups of heads.
        pid_m, pid_bh = _causal_order(num_m_blocks, batch * num_heads_q, True)
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    off_b = pid_bh // num_heads_q
    off_h = pid_bh % num_heads_q
    off_hk = off_h // (num_heads_q // num_heads_k)
    q_start, len_q = _sequence(cu_seqlens_q, off_b, seqlen_q, VARLEN)
    k_start, len_k = _sequence(cu_seqlens_k, off_b, seqlen_k, VARLEN)
    off_bz = off_b.to(tl.int64) * (1 - VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= len_q:
        return

    offs_m = tl.arange(0, BLOCK_M)
    rows = start_m + offs_m
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    qrow = (q_start + rows).to(tl.int64)
    Q_base = Q + off_bz * stride_qz + off_h.to(tl.int64) * stride_qh
    DO_base = DO + off_bz * stride_doz + off_h.to(tl.int64) * stride_doh
    q = _load_rows(Q_base + qrow[:, None] * stride_qm + offs_dk[None, :], rows, len_q, offs_dk,
                   HEAD_DIM, True)
    do = _load_rows(DO_base + qrow[:, None] * stride_dom + offs_dv[None, :], rows, len_q, offs_dv,
                    HEAD_DIM_V, True)
    L_base = LSE + off_b.to(tl.int64) * stride_lz + off_h.to(tl.int64) * stride_lh + q_start
    D_base = Delta + off_b.to(tl.int64) * stride_lz + off_h.to(tl.int64) * stride_lh + q_start
    lse = tl.load(L_base + rows, mask=rows < len_q, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    delta = tl.load(D_base + rows, mask=rows < len_q, other=0.0)

    K_base = K + off_bz * stride_kz + off_hk.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
    V_base = V + off_bz * stride_vz + off_hk.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
    B_base = Bias
    if BIAS != 0:
        B_base = Bias + off_b.to(tl.int64) * stride_bz + off_h.to(tl.int64) * stride_bh
    if USE_TMA:
        k_desc = tl.make_tensor_descriptor(K_base, shape=[len_k, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_DK])
        v_desc = tl.make_tensor_descriptor(V_base, shape=[len_k, HEAD_DIM_V], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
    else:
        k_desc = K_base
        v_desc = V_base

    qk_scale = sm_scale * LOG2E
    bh = off_b * num_heads_q + off_h
    alibi_k = _alibi_factor(alibi_slopes, stride_az, off_b, off_h, ALIBI)
    diag, left, right = _window(len_q, len_k, window_left, window_right, causal_align, CAUSAL)
    if CAUSAL != 0:
        lo, f1, f2, hi = _span(start_m, BLOCK_M, len_k, diag, left, right, BLOCK_N)
    else:
        lo = 0
        f1 = 0
        f2 = len_k // BLOCK_N * BLOCK_N
        hi = len_k

    dq = tl.zeros([BLOCK_M, BLOCK_DK], dtype=tl.float32)
    if CAUSAL != 0:
        dq = _dq_blocks(
            dq, q, do, lse, delta, rows, K_base, V_base, B_base, k_desc, v_desc, stride_kn, stride_vn,
            stride_bm,
            lo, f1, offs_n, offs_dk, offs_dv, len_q, len_k, diag, left, right, qk_scale,
            philox_seed, philox_offset, bh, dropout_p, softcap, alibi_k,
            True, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PREC, USE_TMA, SOFTCAP, ALIBI)
    dq = _dq_blocks(
        dq, q, do, lse, delta, rows, K_base, V_base, B_base, k_desc, v_desc, stride_kn, stride_vn,
            stride_bm,
        f1, f2, offs_n, offs_dk, offs_dv, len_q, len_k, diag, left, right, qk_scale,
        philox_seed, philox_offset, bh, dropout_p, softcap, alibi_k,
        False, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PREC, USE_TMA, SOFTCAP, ALIBI)
    dq = _dq_blocks(
        dq, q, do, lse, delta, rows, K_base, V_base, B_base, k_desc, v_desc, stride_kn, stride_vn,
            stride_bm,
        f2, hi, offs_n, offs_dk, offs_dv, len_q, len_k, diag, left, right, qk_scale,
        philox_seed, philox_offset, bh, dropout_p, softcap, alibi_k,
        True, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PREC, USE_TMA, SOFTCAP, ALIBI)

    dq = dq * sm_scale
    dqmask = rows[:, None] < len_q
    if HEAD_DIM != BLOCK_DK:
        dqmask = dqmask & (offs_dk[None, :] < HEAD_DIM)
    DQ_base = DQ + off_bz * stride_dqz + off_h.to(tl.int64) * stride_dqh
    tl.store(DQ_base + qrow[:, None] * stride_dqm + offs_dk[None, :], dq.to(DQ.dtype.element_ty),
             mask=dqmask)


# --------------------------------------------------------------------------------------------
# Registry declarations.
# --------------------------------------------------------------------------------------------


def _bwd_config(target: object, bm: int, bn: int, warps: int, stages: int, options: dict | None = None,
                tma: int = 0) -> ConfigDecl:
    if target.backend == "cuda":
        return ConfigDecl(constexprs={"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma}, num_warps=warps,
                          num_stages=stages, options=options or {})
    return ConfigDecl(constexprs={"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": 0}, num_warps=warps, num_stages=1,
                      options=_hip_options(target, 1))


#: sm90 alternates of the split backward, swept by ``bench/sm90_bwd.py`` and ``python -m builder
#: tune`` (ranked by measurement, not yet by any catalog rule): (BLOCK_M, BLOCK_N, warps, stages,
#: options, USE_TMA) by head-dim bucket, after each table's config #0. They are built only for the
#: ``bwdsweep`` specs (``in_bwd_sweep_set``) in the ``bwdsweep`` and ``full`` sets; ``default``
#: and ``gputest`` keep config #0 (``set_configs``).
#:
#: Chosen from ptxas's register use and spills on the CPU (fp16, no mask; 255 registers is the
#: 8-warp ceiling): dK/dV keeps k, v, dk and dv of 128 keys in two warp groups and spills at
#: D=128 (#0: 87 spill stores; 64x64 or 128x64 tiles 350, 4-warp 128-key tiles 520), far less
#: with q and dO through TMA descriptors (64x128: 38; 32x128 with 3 stages: 2) and not at all at
#: D=64 with TMA (#0: 17). dQ never spills; TMA frees registers (D=128: 236 -> 175, 137 with
#: 32-key blocks; D=64: 131 -> 125), so 8-warp tiles under 128 registers and ~113 KB of shared
#: memory run two programs per SM (``maxnreg`` where ptxas lands just above).
_SM90_DKDV_SWEEP = {
    64: ((64, 128, 8, 3, None, 1), (64, 128, 8, 2, None, 1), (64, 128, 8, 4, None, 1), (32, 128, 8, 3, None, 1),
         (32, 128, 8, 4, None, 1), (128, 128, 8, 2, None, 1), (32, 128, 8, 3, None, 0), (64, 128, 8, 2, None, 0)),
    128: ((32, 128, 8, 3, None, 1), (32, 128, 8, 2, None, 1), (32, 128, 8, 4, None, 1), (64, 128, 8, 2, None, 1),
          (64, 128, 8, 3, None, 1), (64, 64, 4, 3, None, 1), (32, 128, 8, 3, None, 0), (32, 128, 8, 2, None, 0)),
}
_SM90_DQ_SWEEP = {
    64: ((128, 64, 8, 3, None, 1), (128, 64, 8, 3, {"maxnreg": 128}, 0), (128, 64, 8, 4, None, 1),
         (128, 128, 8, 2, None, 1), (128, 32, 8, 4, None, 1), (128, 64, 4, 3, None, 1), (128, 32, 4, 4, None, 1),
         (64, 64, 4, 3, None, 0)),
    128: ((128, 64, 8, 3, None, 1), (128, 32, 8, 3, None, 1), (128, 32, 8, 3, {"maxnreg": 128}, 1),
          (128, 64, 8, 2, None, 1), (128, 128, 8, 2, None, 1), (128, 32, 8, 4, None, 1), (128, 32, 8, 3, None, 0),
          (64, 64, 4, 3, None, 0)),
}


#: The sweep's winners on the H200 (bench/sm90_bwd.py, B4 H32 N4096, fp16 and bf16, no mask and
#: causal; docs/performance.md), launched first for the ``bwdsweep`` specs: dK/dV at D=128 with
#: q/dO through TMA (64x128, 8 warps, 2 stages), dQ with k/v through TMA (D=128: 128x64, 8 warps;
#: D=64: 4 warps). The previous first config follows as an alternate. D=64 dK/dV keeps its own.
_SM90_PROMOTED = {("dkdv", 128): (64, 128, 8, 2, None, 1), ("dq", 128): (128, 64, 8, 3, None, 1),
                  ("dq", 64): (128, 64, 4, 3, None, 1)}


def _with_sweep(first: ConfigDecl, sweep: dict, spec: dict, target: object, kernel: str) -> tuple[ConfigDecl, ...]:
    """For ``bwdsweep`` specs: the promoted winner (if any) first, then ``first`` and the rest of
    the sm90 sweep's alternates; elsewhere ``first`` alone."""
    if not in_bwd_sweep_set(spec, target):
        return (first,)
    d = block_d(spec)
    winner = _SM90_PROMOTED.get((kernel, d))
    rest = tuple(_bwd_config(target, *c) for c in sweep[d] if c != winner)
    if winner is None:
        return (first,) + rest
    return (_bwd_config(target, *winner), first) + rest


def _wide_dkdv(target: object) -> ConfigDecl:
    """dK/dV at D=512 (fp16/bf16 on sm90 and CDNA: ``family.WIDE_ARCHS``): k, v, dk and dv of the
    resident keys (two 512-wide fp32 accumulators) stay in registers, so few keys and queries fit.
    sm90: 32 keys, 32 queries per step with q and dO through TMA descriptors, 8 warps, 98 KB of
    shared memory, 251 registers, no spills (plain loads spill 228 bytes; 64 keys spill KBs).
    CDNA, 4 waves, 16 queries per step: 32 keys on gfx90a and gfx950, 16 on gfx942 (32 spill 15
    VGPRs there), none spilled."""
    if target.backend == "cuda":
        return _bwd_config(target, 32, 32, 8, 1, tma=1)
    return _bwd_config(target, 16, 16 if target.arch == "gfx942" else 32, 4, 1)


def _wide_dq(target: object) -> ConfigDecl:
    """dQ at D=512: 32 resident queries (q, dO, dq). sm90: 64 keys per step through TMA, 8 warps,
    128 KB of shared memory, no spills; 1.63-1.68x the whole backward's speed of 32 keys by plain
    loads with 16x32 dK/dV tiles on the H200 (B2 H16 N4096 fp16). CDNA: 4 waves, 32 keys per
    step on gfx942 and gfx950, 16 on gfx90a, no spills."""
    if target.backend == "cuda":
        return _bwd_config(target, 32, 64, 8, 1, tma=1)
    return _bwd_config(target, 32, 16 if target.arch == "gfx90a" else 32, 4, 1)


def dkdv_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    """dK/dV: BLOCK_N keys stay resident (k, v, dk, dv), BLOCK_M queries stream through.

    Index 0 is what the operator launches without a tuning rule; on sm90 the ``bwdsweep`` specs
    launch ``_SM90_PROMOTED``'s winner first (D=128) and list ``_SM90_DKDV_SWEEP``'s alternates."""
    d = block_d(spec)
    if spec["dtype"] == "fp32":
        return (_bwd_config(target, 16, 32, 4, 1 if d > 64 else 2),)
    if d > 256:
        return (_wide_dkdv(target),)
    if target.backend == "cuda":
        if d <= 64:
            first = _bwd_config(target, 64, 128, 8, 3 if target.arch == "sm90" else 2)
        elif d <= 128:
            first = _bwd_config(target, 64, 128, 8, 2)
        else:
            return (_bwd_config(target, 32, 64, 8, 2 if target.arch == "sm90" else 1),)
        return _with_sweep(first, _SM90_DKDV_SWEEP, spec, target, "dkdv")
    if target.arch.startswith("gfx1") or d > 128:
        return (_bwd_config(target, 32, 32, 4, 1),)
    return (_bwd_config(target, 32, 64, 4, 1),)


def dq_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    """dQ: BLOCK_M queries stay resident (q, dO, dq), BLOCK_N keys stream through.

    Index 0 is what the operator launches without a tuning rule; on sm90 the ``bwdsweep`` specs
    launch ``_SM90_PROMOTED``'s winner first and list ``_SM90_DQ_SWEEP``'s alternates."""
    d = block_d(spec)
    if spec["dtype"] == "fp32":
        return (_bwd_config(target, 32, 16, 4, 1 if d > 64 else 2),)
    if d > 256:
        return (_wide_dq(target),)
    if target.backend == "cuda":
        if d <= 128:
            return _with_sweep(_bwd_config(target, 128, 64, 8, 3 if target.arch == "sm90" else 2),
                               _SM90_DQ_SWEEP, spec, target, "dq")
        return (_bwd_config(target, 64, 32, 8, 2 if target.arch == "sm90" else 1),)
    if target.arch.startswith("gfx1") or d > 128:
        return (_bwd_config(target, 32, 32, 4, 1),)
    return (_bwd_config(target, 64, 32, 4, 1),)


def preprocess_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    """Elementwise: one config everywhere."""
    return (ConfigDecl(constexprs={"BLOCK_M": 64 if block_d(spec) <= 128 else 32}, num_warps=4,
                   num_stages=1),)


_GRAD_PTRS = {"Q": "*{dtype}", "K": "*{dtype}", "V": "*{dtype}", "Bias": "*{dtype}", "DO": "*{dtype}",
              "DQ": "*{dtype}", "DK": "*{dtype}", "DV": "*{dtype}", "DBias": "*{dtype}", "DQacc": "*fp32",
              "LSE": "*fp32", "Delta": "*fp32", "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32",
              "Out": "*{dtype}", "alibi_slopes": "*fp32"}
_PRE_SIG = signature_of(attn_bwd_preprocess, _GRAD_PTRS)
_PRE_DIV = divisibility_of(_PRE_SIG, aligned=("o", "do", "dqa"))
_CONVERT_SIG = signature_of(attn_bwd_dq_convert, _GRAD_PTRS)
_CONVERT_DIV = divisibility_of(_CONVERT_SIG, aligned=("dqa", "dq"))
_DKDV_SIG = signature_of(attn_bwd_dkdv, _GRAD_PTRS)
_DKDV_DIV = divisibility_of(_DKDV_SIG, aligned=("q", "k", "v", "do", "dk", "dv", "dqa"), bias=("b", "db"))
_DQ_SIG = signature_of(attn_bwd_dq, _GRAD_PTRS)
_DQ_DIV = divisibility_of(_DQ_SIG, aligned=("q", "k", "v", "do", "dq"), bias=("b",))
_HEADS = {"HEAD_DIM": HEAD_DIM_BUCKETS, "HEAD_DIM_V": HEAD_DIM_BUCKETS}

# Imported below the kernels: a kernel's key holds its line number.
from aotriton_rt.ops.attention.family import CONVERT, DKDV, DQ, PRE  # noqa: E402


def _bwd_head_dim_excluded(spec: dict, target: object) -> str | None:
    return head_dim_excluded(spec, target, backward=True)


def _bwd_excluded(spec: dict, target: object) -> str | None:
    return fwd_excluded(spec, target, backward=True)


def _softcap_checks(base: tuple[str, ...]):
    """The checks of a dK/dV or dQ spec: ``base``, and for softcap variants a positive cap and a
    non-zero scale (as the forward's)."""
    return lambda spec: base + (("softcap > 0", "sm_scale != 0") if spec.get("SOFTCAP") else ())


KERNELS = [
    KernelDecl(
        name=PRE,
        fn=attn_bwd_preprocess,
        signature=_PRE_SIG,
        axes={"dtype": DTYPES, **_HEADS, "VARLEN": (0, 1), "DQ_ATOMIC": (0, 1)},
        configs=preprocess_configs,
        grid=("cdiv(seqlen_q, BLOCK_M)", "batch * num_heads_q", "1"),
        divisibility=_PRE_DIV,
        exclude=_bwd_head_dim_excluded,
        sets={"default": in_default_backward_schemes_set, "bwdsweep": in_bwd_sweep_set,
              "gputest": lambda spec, target: in_gputest_set(spec, target) or in_sm90_gluon_atomic_set(spec, target)},
        checks=("batch * num_heads_q <= 65535",) + stride_checks(_PRE_DIV),
    ),
    KernelDecl(
        name=CONVERT,
        fn=attn_bwd_dq_convert,
        signature=_CONVERT_SIG,
        axes={"dtype": DTYPES, "HEAD_DIM": HEAD_DIM_BUCKETS, "VARLEN": (0, 1)},
        configs=preprocess_configs,
        grid=("cdiv(seqlen_q, BLOCK_M)", "batch * num_heads_q", "1"),
        divisibility=_CONVERT_DIV,
        exclude=_bwd_head_dim_excluded,
        sets={"default": in_default_sm90_atomic_set, "bwdsweep": lambda spec, target: False,
              "gputest": lambda spec, target: in_gputest_set(spec, target) or in_sm90_gluon_atomic_set(spec, target)},
        checks=("batch * num_heads_q <= 65535",) + stride_checks(_CONVERT_DIV),
    ),
    KernelDecl(
        name=DKDV,
        fn=attn_bwd_dkdv,
        signature=_DKDV_SIG,
        axes={"dtype": DTYPES, **_HEADS, "CAUSAL": (0, 1, 2), "BIAS": (0, 1, 2), "DROPOUT": (0, 1),
              "VARLEN": (0, 1), "DQ_ATOMIC": (0, 1), "SOFTCAP": (0, 1), "ALIBI": (0, 1)},
        configs=dkdv_configs,
        grid=("cdiv(seqlen_k, BLOCK_N)", "batch * num_heads_k", "1"),
        divisibility=_DKDV_DIV,
        exclude=_bwd_excluded,
        sets={"default": in_default_backward_set, "gputest": in_gputest_set, "bwdsweep": in_bwd_sweep_set},
        # sm90's sweep alternates only in bwdsweep and full (see _SM90_DKDV_SWEEP).
        set_configs={"default": 1, "gputest": 1},
        checks=_softcap_checks(GQA_CHECKS + ALIGN_CHECKS + ("batch * num_heads_k <= 65535", "dropout_p < 1")
                               + stride_checks(_DKDV_DIV)),
    ),
    KernelDecl(
        name=DQ,
        fn=attn_bwd_dq,
        signature=_DQ_SIG,
        axes={"dtype": DTYPES, **_HEADS, "CAUSAL": (0, 1, 2), "BIAS": (0, 1), "DROPOUT": (0, 1),
              "VARLEN": (0, 1), "SOFTCAP": (0, 1), "ALIBI": (0, 1)},
        configs=dq_configs,
        grid=("cdiv(seqlen_q, BLOCK_M)", "batch * num_heads_q", "1"),
        divisibility=_DQ_DIV,
        exclude=_bwd_excluded,
        sets={"default": in_default_backward_set, "gputest": in_gputest_set, "bwdsweep": in_bwd_sweep_set},
        # sm90's sweep alternates only in bwdsweep and full (see _SM90_DKDV_SWEEP).
        set_configs={"default": 1, "gputest": 1},
        checks=_softcap_checks(GQA_CHECKS + ALIGN_CHECKS + ("batch * num_heads_q <= 65535", "dropout_p < 1")
                               + stride_checks(_DQ_DIV)),
    ),
]
