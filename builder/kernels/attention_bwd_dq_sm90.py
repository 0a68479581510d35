"""Hopper (sm90) attention backward dQ in Gluon, the companion of ``attn_bwd_dkdv_sm90``.

Same arguments, grid, conventions and results as ``attn_bwd_dq`` in ``attention_bwd.py`` (the split
scheme's dQ pass) for the cases ``attn_bwd_dkdv_sm90`` serves: fp16/bf16, head dim 64 or 128 (equal
q.k and v dims), every mask mode (mode 1 aligned by the run-time ``causal_align``), windows, GQA, no
bias, no dropout, fixed lengths. Compiled for sm90 only; every other case keeps ``attn_bwd_dq``.

Layout of one program (one query block of ``BLOCK_M`` queries of one query head, as ``attn_bwd_dq``):

- Two *consumer* warp groups of 4 warps, each owning ``BLOCK_M // 2`` queries (the wgmma M tile,
  64): their Q and dO rows stay in shared memory, LSE and Delta in registers (two rows a thread),
  the dQ accumulator in registers (fp32, ``64 x HEAD_DIM``: 64 registers a thread at D=128).
- One *loader* warp (``warp_specialize``) that loads Q and dO once, then streams the K and V tiles
  (``BLOCK_N`` keys of the query head's key/value head) with TMA into a ring of ``STAGES``
  shared-memory slots, each with a ready and a free mbarrier; a slot is refilled when both
  consumers have arrived on its free barrier.
- Per key tile each consumer issues, as asynchronous wgmma, S = Q·Kᵀ and dP = dO·Vᵀ (operands in
  shared memory), computes P = exp2(S·scale·log2e - LSE·log2e) while dP runs, dS = P∘(dP - Delta),
  and accumulates dQ += dS·K with dS in registers (the A operand). Registers per consumer thread at
  D=128, BLOCK_N=64: dQ 64 + S 32 + dP 32 + the 16-bit dS operand 16.

Key tiles are visited in ``attn_bwd_dkdv_sm90``'s order (its ``_query_block`` on the key axis): the
tiles on the band's edges and the sequence end (masked) first, then the unmasked run, so the hot
loop carries no mask code. Under a mask the programs start heaviest first (the last query blocks
see the most keys), as ``attn_bwd_dq``'s ``_causal_order`` orders them.

Four device-side TMA descriptors (128 bytes each) live in the runtime's global scratch, as for
``attn_bwd_dkdv_sm90``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from builder.kernels._gluon import reinterpret, tma_load
from builder.kernels.attention_bwd_sm90 import (
    LOG2E,
    _heavy_first,
    _heavy_first_of,
    _issue_pair,
    _load_owned,
    _query_block,
    _visited,
    _whole,
    _window,
)


@gluon.jit
def _dq_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, ready, free,
               start_m, lo, f1, f2, n1, n2, n, STAGES: gl.constexpr):
    """Loader warp: both consumers' Q and dO rows, then K and V of every visited key tile."""
    _dq_load_unit(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, q_bar, ready, free,
                  0, 0, 0, 0, 0, start_m, lo, f1, f2, n1, n2, n, STAGES, 0)


@gluon.jit
def _dq_loader_persistent(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready,
                          free, units, num_blocks, num_heads_q, num_heads_k, batch, len_k, diag, left, right,
                          BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """Loader warp of a persistent program: _dq_loader's work for each of its units in turn, the
    ring of K/V slots running on across units."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    t = 0
    u = 0
    for unit in range(gl.program_id(0), units, gl.num_programs(0)):
        off_b, off_h, start_m, lo, f1, f2, n1, n2, n = _dq_unit(unit, num_blocks, num_heads_q, batch, len_k, diag,
                                                                left, right, BLOCK_M, BLOCK_N, CAUSAL)
        t = _dq_load_unit(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready,
                          free, t, u, off_b, off_h, off_h // (num_heads_q // num_heads_k), start_m, lo, f1, f2, n1,
                          n2, n, STAGES, 1)
        u += 1


@gluon.jit
def _dq_unit(unit, num_blocks, num_heads_q, batch, len_k, diag, left, right, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(batch, query head, first query, and the key tiles it visits as _visited gives them) of a
    persistent program's work unit: the non-persistent grid's programs in launch order (heavy,
    i.e. last, query blocks first under a causal mask)."""
    if CAUSAL != 0:
        idx, pid_bh = _heavy_first_of(unit.to(gl.int64), num_blocks, batch * num_heads_q)
        pid_m = num_blocks - 1 - idx
    else:
        pid_m = unit % num_blocks
        pid_bh = unit // num_blocks
    start_m = pid_m * BLOCK_M
    lo, f1, f2, n1, n2, n = _visited(start_m, BLOCK_M, len_k, diag, left, right, BLOCK_N, CAUSAL)
    return pid_bh // num_heads_q, pid_bh % num_heads_q, start_m, lo, f1, f2, n1, n2, n


@gluon.jit
def _dq_load_unit(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, free,
                  t0, u, off_b, off_h, off_hk, start_m, lo, f1, f2, n1, n2, n, STAGES: gl.constexpr,
                  PERSISTENT: gl.constexpr):
    """One unit's loads: both consumers' Q and dO rows (after the consumers released the previous
    unit's, PERSISTENT), then K and V of every visited key tile into the ring's slots t0, t0 + 1,
    ... Descriptors are 2-D at the head, or with PERSISTENT 4-D (batch, head, row, dim) over the
    whole tensors (batch off_b, query head off_h, KV head off_hk). Returns the ring position after
    the unit."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    BLOCK_D: gl.constexpr = k_smem.shape[2]
    if PERSISTENT:
        # A fresh barrier counts as having completed the phase before its first.
        mbarrier.wait(q_free, (u & 1) ^ 1)
    _load_owned(q_desc, do_desc, q_smem, do_smem, q_bar, off_b, off_h, start_m, PERSISTENT)
    for i in range(n):
        it = t0 + i
        s = it % STAGES
        # A fresh barrier counts as having completed the phase before its first: the first pass
        # over the ring does not wait.
        mbarrier.wait(free.index(s), ((it // STAGES) & 1) ^ 1)
        start_n = _query_block(i, lo, f1, f2, n1, n2, BLOCK_N)
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        if PERSISTENT:
            k_dst = reinterpret(k_smem.index(s), k_smem.dtype, [1, 1, BLOCK_N, BLOCK_D], k_desc.layout)
            v_dst = reinterpret(v_smem.index(s), v_smem.dtype, [1, 1, BLOCK_N, BLOCK_D], v_desc.layout)
            tma_load(k_desc, [off_b, off_hk, start_n, 0], ready.index(s), k_dst)
            tma_load(v_desc, [off_b, off_hk, start_n, 0], ready.index(s), v_dst)
        else:
            tma_load(k_desc, [start_n, 0], ready.index(s), k_smem.index(s))
            tma_load(v_desc, [start_n, 0], ready.index(s), v_smem.index(s))
    return t0 + n


@gluon.jit
def _dq_tile(it, start_n, dq, q, do, k_smem, v_smem, ready, free, lse, delta, rows, kcols, len_k, diag, left,
             right, qk_scale, MASKED: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
             s_layout: gl.constexpr, a_layout: gl.constexpr):
    """dQ of one consumer after key tile ``it`` (first key start_n) of the loader's order."""
    s = it % STAGES
    k = k_smem.index(s)
    qk, dp = _issue_pair(it, q, do, k_smem, v_smem, ready, STAGES, s_layout)
    # Groups retire in order: one outstanding means S is done while dP may still run.
    qk = warpgroup_mma_wait(1, deps=(qk,))
    p = gl.exp2(qk * qk_scale - lse[:, None])
    if MASKED:
        cols = start_n + kcols
        visible = (cols < len_k)[None, :]
        if CAUSAL != 0:
            rel = cols[None, :] - rows[:, None] - diag
            visible = visible & (rel >= -left) & (rel <= right)
        p = gl.where(visible, p, 0.0)
    dp = warpgroup_mma_wait(0, deps=(dp,))
    ds = p * (dp - delta[:, None])
    ds_op = gl.convert_layout(ds.to(q.dtype), a_layout)
    dq = warpgroup_mma(ds_op, k, dq, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    mbarrier.arrive(free.index(s), count=1)
    return dq


@gluon.jit
def _dq_consumer(c: gl.constexpr, q_smem, do_smem, k_smem, v_smem, q_bar, ready, free, L_head, D_head, DQ_head,
                 stride_dqm, start_m, len_q, len_k, sm_scale, diag, left, right, lo, f1, f2, n1, n2, n,
                 CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """Consumer warp group c: queries start_m + c*HALF ..., every visited key tile."""
    _dq_consume_unit(c, q_smem, do_smem, k_smem, v_smem, q_bar, q_bar, ready, free, L_head, D_head, DQ_head,
                     stride_dqm, 0, 0, start_m, len_q, len_k, sm_scale, diag, left, right, lo, f1, f2, n1, n2, n,
                     CAUSAL, STAGES, 0)


@gluon.jit
def _dq_consumer_persistent(c: gl.constexpr, q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, free, LSE, Delta,
                            DQ, units, num_blocks, num_heads_q, batch, stride_lz, stride_lh, stride_dqz, stride_dqh,
                            stride_dqm, len_q, len_k, sm_scale, diag, left, right, BLOCK_M: gl.constexpr,
                            CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """Consumer warp group c of a persistent program: _dq_consumer's work for each of its units in
    the loader's order, the ring position running on across units."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    t = 0
    u = 0
    for unit in range(gl.program_id(0), units, gl.num_programs(0)):
        off_b, off_h, start_m, lo, f1, f2, n1, n2, n = _dq_unit(unit, num_blocks, num_heads_q, batch, len_k, diag,
                                                                left, right, BLOCK_M, BLOCK_N, CAUSAL)
        L_head = LSE + off_b.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh
        D_head = Delta + off_b.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh
        DQ_head = DQ + off_b.to(gl.int64) * stride_dqz + off_h.to(gl.int64) * stride_dqh
        t = _dq_consume_unit(c, q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, free, L_head, D_head,
                             DQ_head, stride_dqm, t, u, start_m, len_q, len_k, sm_scale, diag, left, right, lo, f1,
                             f2, n1, n2, n, CAUSAL, STAGES, 1)
        u += 1


@gluon.jit
def _dq_consume_unit(c: gl.constexpr, q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, free, L_head, D_head,
                     DQ_head, stride_dqm, t0, u, start_m, len_q, len_k, sm_scale, diag, left, right, lo, f1, f2, n1,
                     n2, n, CAUSAL: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
    """One unit of consumer warp group c: queries start_m + c*HALF ..., every visited key tile from
    the ring's slot t0 on (Q and dO in phase ``u & 1`` of q_bar). With PERSISTENT it releases Q
    and dO (q_free) once its last matmul is done. Returns the ring position after the unit."""
    HALF: gl.constexpr = q_smem.shape[1]
    BLOCK_D: gl.constexpr = q_smem.shape[2]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    rows = start_m + c * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    kcols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    # LSE and Delta stay in registers (two rows a thread). Rows past the sequence and rows that saw
    # no key (LSE -inf) get +inf: their probabilities are 0, not NaN.
    lse = gl.load(L_head + rows, mask=rows < len_q, other=float("inf"))
    lse = gl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    delta = gl.load(D_head + rows, mask=rows < len_q, other=0.0)
    dq = gl.zeros([HALF, BLOCK_D], gl.float32, acc_layout)
    qk_scale = sm_scale * LOG2E
    q = q_smem.index(c)
    do = do_smem.index(c)
    # Always wait: the loader's Q/dO copies must land before the program may exit (or reload them).
    mbarrier.wait(q_bar, u & 1)
    masked = n1 + n2
    for j in range(0, masked):
        start_n = _query_block(j, lo, f1, f2, n1, n2, BLOCK_N)
        dq = _dq_tile(t0 + j, start_n, dq, q, do, k_smem, v_smem, ready, free, lse, delta, rows, kcols, len_k,
                      diag, left, right, qk_scale, True, CAUSAL, STAGES, s_layout, a_layout)
    for j in range(masked, n):
        start_n = f1 + (j - masked) * BLOCK_N
        dq = _dq_tile(t0 + j, start_n, dq, q, do, k_smem, v_smem, ready, free, lse, delta, rows, kcols, len_k,
                      diag, left, right, qk_scale, False, CAUSAL, STAGES, s_layout, a_layout)
    if PERSISTENT:
        # Every matmul reading Q and dO was waited for in its tile: the loader may refill them.
        mbarrier.arrive(q_free, count=1)

    q_rows = start_m + c * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    d_cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, acc_layout))
    keep = (q_rows < len_q)[:, None] & (d_cols >= 0)[None, :]
    ptrs = DQ_head + q_rows.to(gl.int64)[:, None] * stride_dqm + d_cols[None, :]
    gl.store(ptrs, (dq * sm_scale).to(DQ_head.dtype.element_ty), mask=keep)
    return t0 + n


@gluon.jit
def attn_bwd_dq_sm90(
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
    HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    CAUSAL: gl.constexpr, BIAS: gl.constexpr, DROPOUT: gl.constexpr, VARLEN: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, USE_TMA: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PERSISTENT: gl.constexpr,
):
    """dQ of one query block of one query head (see attn_bwd_dq).

    Grid: (cdiv(seqlen_q, BLOCK_M), batch * num_heads_q, 1); with PERSISTENT > 0 (min(units,
    PERSISTENT), 1, 1), a unit being one such program's query block, which each program takes in
    turn (every PERSISTENT-th in the non-persistent grid's launch order): the descriptors are
    made once, 4-D over the whole tensors, and the loader fetches the next unit's Q and dO as soon
    as both consumers are done with the last one's. Bias, cu_seqlens_* and the dropout
    arguments are accepted (attn_bwd_dq's argument list) and ignored: BIAS, DROPOUT, VARLEN, SOFTCAP
    and ALIBI are 0. causal_align aligns mask mode 1's band (0 top-left, 1 bottom-right). HEAD_DIM == HEAD_DIM_V
    (64 or 128). USE_TMA is 1 (K and V always come through TMA). BLOCK_M is two consumers' 64
    queries. STAGES: K/V slots in the ring. CONSUMER_REGS: registers per thread of the consumer
    warp groups (the loader warp gets 24).
    """
    gl.static_assert(BIAS == 0 and DROPOUT == 0 and VARLEN == 0, "attn_bwd_dq_sm90: no bias, dropout or varlen")
    gl.static_assert(HEAD_DIM == HEAD_DIM_V, "attn_bwd_dq_sm90: equal q.k and v head dims")
    gl.static_assert(BLOCK_M == 128, "attn_bwd_dq_sm90: two consumers of 64 queries")
    HALF: gl.constexpr = BLOCK_M // 2
    BLOCK_D: gl.constexpr = HEAD_DIM
    dtype: gl.constexpr = Q.dtype.element_ty

    len_q = seqlen_q
    len_k = seqlen_k
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    if PERSISTENT:
        # 4-D (batch, head, row, dim) descriptors over the whole tensors, made once per program.
        q_desc = _whole(Q, batch, num_heads_q, len_q, HEAD_DIM, stride_qz, stride_qh, stride_qm, HALF, BLOCK_D)
        do_desc = _whole(DO, batch, num_heads_q, len_q, HEAD_DIM, stride_doz, stride_doh, stride_dom, HALF, BLOCK_D)
        k_desc = _whole(K, batch, num_heads_k, len_k, HEAD_DIM, stride_kz, stride_kh, stride_kn, BLOCK_N, BLOCK_D)
        v_desc = _whole(V, batch, num_heads_k, len_k, HEAD_DIM, stride_vz, stride_vh, stride_vn, BLOCK_N, BLOCK_D)
    else:
        if CAUSAL != 0:
            # attn_bwd_dkdv_sm90's heavy-first order, reversed along the blocks: here the last query
            # blocks see the most keys.
            idx, pid_bh = _heavy_first(gl.num_programs(0), batch * num_heads_q)
            pid_m = gl.num_programs(0) - 1 - idx
        else:
            pid_m = gl.program_id(0)
            pid_bh = gl.program_id(1)
        off_b = pid_bh // num_heads_q
        off_h = pid_bh % num_heads_q
        off_hk = off_h // (num_heads_q // num_heads_k)
        start_m = pid_m * BLOCK_M

        Q_head = Q + off_b.to(gl.int64) * stride_qz + off_h.to(gl.int64) * stride_qh
        DO_head = DO + off_b.to(gl.int64) * stride_doz + off_h.to(gl.int64) * stride_doh
        DQ_head = DQ + off_b.to(gl.int64) * stride_dqz + off_h.to(gl.int64) * stride_dqh
        K_head = K + off_b.to(gl.int64) * stride_kz + off_hk.to(gl.int64) * stride_kh
        V_head = V + off_b.to(gl.int64) * stride_vz + off_hk.to(gl.int64) * stride_vh
        L_head = LSE + off_b.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh
        D_head = Delta + off_b.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh

        q_desc = tma.make_tensor_descriptor(Q_head, shape=[len_q, HEAD_DIM], strides=[stride_qm, 1],
                                            block_shape=[HALF, BLOCK_D], layout=q_layout)
        do_desc = tma.make_tensor_descriptor(DO_head, shape=[len_q, HEAD_DIM], strides=[stride_dom, 1],
                                             block_shape=[HALF, BLOCK_D], layout=q_layout)
        k_desc = tma.make_tensor_descriptor(K_head, shape=[len_k, HEAD_DIM], strides=[stride_kn, 1],
                                            block_shape=[BLOCK_N, BLOCK_D], layout=kv_layout)
        v_desc = tma.make_tensor_descriptor(V_head, shape=[len_k, HEAD_DIM], strides=[stride_vn, 1],
                                            block_shape=[BLOCK_N, BLOCK_D], layout=kv_layout)

    # Key tiles [lo, f1) and [f2, hi) need a mask, [f1, f2) do not (attn_bwd_dq's _span).
    diag, left, right = _window(len_q, len_k, window_left, window_right, causal_align, CAUSAL)
    if PERSISTENT == 0:
        lo, f1, f2, n1, n2, n = _visited(start_m, BLOCK_M, len_k, diag, left, right, BLOCK_N, CAUSAL)

    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_D], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=2)

    if PERSISTENT:
        # Both consumers arrive once they are done with a unit's Q and dO; the loader waits for
        # that before it loads the next unit's.
        q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_free, count=2)
        num_blocks = gl.cdiv(len_q, BLOCK_M)
        units = num_blocks * batch * num_heads_q
        gl.warp_specialize([
            (_dq_consumer_persistent, (0, q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, free, LSE, Delta, DQ,
                                       units, num_blocks, num_heads_q, batch, stride_lz, stride_lh, stride_dqz,
                                       stride_dqh, stride_dqm, len_q, len_k, sm_scale, diag, left, right, BLOCK_M,
                                       CAUSAL, STAGES)),
            (_dq_consumer_persistent, (1, q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, free, LSE, Delta, DQ,
                                       units, num_blocks, num_heads_q, batch, stride_lz, stride_lh, stride_dqz,
                                       stride_dqh, stride_dqm, len_q, len_k, sm_scale, diag, left, right, BLOCK_M,
                                       CAUSAL, STAGES)),
            (_dq_loader_persistent, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, q_free,
                                     ready, free, units, num_blocks, num_heads_q, num_heads_k, batch, len_k, diag,
                                     left, right, BLOCK_M, STAGES, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_dq_consumer, (0, q_smem, do_smem, k_smem, v_smem, q_bar, ready, free, L_head, D_head, DQ_head,
                            stride_dqm, start_m, len_q, len_k, sm_scale, diag, left, right, lo, f1, f2, n1, n2, n,
                            CAUSAL, STAGES)),
            (_dq_consumer, (1, q_smem, do_smem, k_smem, v_smem, q_bar, ready, free, L_head, D_head, DQ_head,
                            stride_dqm, start_m, len_q, len_k, sm_scale, diag, left, right, lo, f1, f2, n1, n2, n,
                            CAUSAL, STAGES)),
            (_dq_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, ready, free,
                          start_m, lo, f1, f2, n1, n2, n, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])


# --------------------------------------------------------------------------------------------
# Registry declaration.
# --------------------------------------------------------------------------------------------

from aotriton_rt.ops.attention.family import DQ_SM90  # noqa: E402
from builder.kernels._attention_sets import in_default_backward_set  # noqa: E402
from builder.kernels.attention import ALIGN_CHECKS, GQA_CHECKS, divisibility_of, signature_of, stride_checks  # noqa: E402
from builder.kernels.attention_bwd import _GRAD_PTRS  # noqa: E402
from builder.kernels.attention_bwd_sm90 import CONSUMER_REGS, HEAD_DIMS, PERSISTENT_PROGRAMS, in_gputest_set  # noqa: E402
from builder.kernels.attention_bwd_sm90 import _excluded as _dkdv_excluded  # noqa: E402
from builder.registry import ConfigDecl, KernelDecl  # noqa: E402 - declarations follow the kernel
from builder.tuning import tuned_configs  # noqa: E402

#: (BLOCK_N, STAGES) per head dim, the expected fastest first (unmeasured). BLOCK_M is always 128
#: (two consumers of 64 queries). ptxas on the CPU (fp16, CONSUMER_REGS 240): 64-key tiles spill
#: nothing at either head dim; 128-key tiles spill nothing at D=64 and, at D=128, nothing without a
#: mask and 7 stores of loop-invariant scalars under one (S and dP then take 128 registers beside
#: dQ's 64). Shared memory at D=128: Q and dO 64 KB plus K and V 32 KB a stage of 64 keys.
#: Tried and dropped: leaving each tile's dQ matmul in flight behind the next tile's S and dP
#: (an accumulator carried through the loops): ptxas then serializes every wgmma ("C7512 ...
#: serialized due to insufficient register resources", one warpgroup fence per HGMMA), at D=128
#: with 32- and 64-key tiles and at D=64 with 64- and 128-key tiles alike.
TILES = {128: ((64, 2), (64, 3), (128, 2)), 64: ((128, 2), (64, 3), (128, 3))}


def sm90_dq_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    """The tile table for a head dim, then its first tile persistent (``PERSISTENT_PROGRAMS``
    programs looping over the query blocks; after the others, so their numbers keep their
    meaning). num_warps is the default partition's (consumer 0); the compiled kernel runs 12
    warps (two consumer groups and the loader's group), which the catalog records from the binary."""
    tiles = TILES[spec["HEAD_DIM"]]
    rows = [(*t, 0) for t in tiles] + [(*tiles[0], PERSISTENT_PROGRAMS)]
    return tuple(ConfigDecl(constexprs={"BLOCK_M": 128, "BLOCK_N": bn, "USE_TMA": 1, "STAGES": st,
                                        "CONSUMER_REGS": CONSUMER_REGS, "PERSISTENT": programs},
                            num_warps=4, num_stages=1, backends=("cuda",))
                 for bn, st, programs in rows)


def _excluded(spec: dict, target: object) -> str | None:
    why = _dkdv_excluded(spec, target)
    return why and why.replace("attn_bwd_dkdv", "attn_bwd_dq")


_SIG = signature_of(attn_bwd_dq_sm90, _GRAD_PTRS)
_DIV = divisibility_of(_SIG, aligned=("q", "k", "v", "do", "dq"), bias=("b",))

KERNEL = KernelDecl(
    name=DQ_SM90,
    fn=attn_bwd_dq_sm90,
    signature=_SIG,
    axes={"dtype": ("fp16", "bf16"), "HEAD_DIM": HEAD_DIMS, "HEAD_DIM_V": HEAD_DIMS, "CAUSAL": (0, 1, 2),
          "BIAS": (0,), "DROPOUT": (0,), "VARLEN": (0,), "SOFTCAP": (0,), "ALIBI": (0,)},
    configs=sm90_dq_configs,
    # attn_bwd_dq's grid with PERSISTENT 0; otherwise min(units, PERSISTENT) programs.
    grid=("cdiv(seqlen_q, BLOCK_M) * (1 - min(PERSISTENT, 1))"
          " + min(cdiv(seqlen_q, BLOCK_M) * batch * num_heads_q, PERSISTENT)",
          "batch * num_heads_q * (1 - min(PERSISTENT, 1)) + min(PERSISTENT, 1)", "1"),
    divisibility=_DIV,
    exclude=_excluded,
    sets={"default": in_default_backward_set, "gputest": in_gputest_set},
    set_configs={"default": tuned_configs(DQ_SM90)},
    # attn_bwd_dq's checks, and TMA descriptors need a non-empty extent in every dimension.
    checks=GQA_CHECKS + ALIGN_CHECKS + ("batch * num_heads_q <= 65535", "dropout_p < 1", "seqlen_q >= 1",
                                         "seqlen_k >= 1",
                                         # A persistent program numbers the query blocks in 32 bits.
                                         "cdiv(seqlen_q, BLOCK_M) * batch * num_heads_q <= 1073741824")
    + stride_checks(_DIV),
)
