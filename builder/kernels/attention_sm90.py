"""Hopper (sm90) attention forward in Gluon, FlashAttention-3 style.

Same arguments, conventions and results as ``attn_fwd`` in ``attention.py`` (strides, mask modes,
LSE layout, GQA, scale), for the cases the portable kernel spends most time on: fp16/bf16, head
dim 64 or 128, no bias, no dropout, fixed lengths. Every other case and every other target keeps
the portable kernel; this one is compiled for sm90 only (Gluon kernels are per architecture).

What Gluon lets this kernel do that the Triton compiler does not do for ``attn_fwd`` on sm90:

- One program owns ``BLOCK_M`` query rows split between two *consumer* warp groups of 4 warps
  (``BLOCK_M // 2`` rows each, the wgmma M tile), and one *loader* warp (``warp_specialize``) that
  streams K and V blocks with TMA into a ring of ``STAGES`` shared-memory slots, each slot with its
  own K-ready, V-ready and slot-free mbarriers. Both consumers read every slot; it is handed back
  when both have arrived on its free barrier.
- Each consumer overlaps its softmax with the previous block's P·V matmul (FA3's intra-warpgroup
  pipelining): block j's S = Q·Kᵀ and block j-1's O += P·V are issued as asynchronous wgmma,
  the softmax of S_j runs while P·V still executes, and O is rescaled once P·V has retired. P
  stays in registers as the A operand of the P·V wgmma.

Key blocks are visited in the order of ``attn_fwd``: the ones that need a mask (band edges, the
sequence end) first, the unmasked run last, so the hot loop carries no mask code. The very first
block always goes through the masked path (it starts the software pipeline).

Device-side TMA descriptors (made in the kernel, 128 bytes each) live in the runtime's global
scratch, as for ``attn_fwd``'s ``USE_TMA`` configs.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from builder.kernels._gluon import reinterpret, tma_load

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


@gluon.jit
def _key_block(idx, lo, f1, f2, n1, n2, BLOCK_N: gl.constexpr):
    """First key of the idx-th visited block: [lo, f1) and [f2, hi) (masked) first, [f1, f2) last."""
    start = lo + idx * BLOCK_N
    start = gl.where(idx >= n1, f2 + (idx - n1) * BLOCK_N, start)
    start = gl.where(idx >= n1 + n2, f1 + (idx - n1 - n2) * BLOCK_N, start)
    return start


@gluon.jit
def _loader(k_desc, v_desc, q_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free,
            start_m, lo, f1, f2, n1, n2, n, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Loader warp: both consumers' Q tiles, then every visited K/V block into the slot ring."""
    HALF: gl.constexpr = q_smem.shape[1]
    for c in gl.static_range(2):
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        tma_load(q_desc, [start_m + c * HALF, 0], q_bar.index(c), q_smem.index(c))
    for idx in range(n):
        _load_block(idx, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_free, lo, f1, f2, n1, n2,
                    BLOCK_N, STAGES)


@gluon.jit
def _load_block(idx, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_free, lo, f1, f2, n1, n2,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of the idx-th visited K and V blocks into slot idx % STAGES, once it is free."""
    s = idx % STAGES
    # A fresh barrier counts as having completed the phase before its first: the first pass over
    # the ring does not wait.
    mbarrier.wait(kv_free.index(s), ((idx // STAGES) & 1) ^ 1)
    start_n = _key_block(idx, lo, f1, f2, n1, n2, BLOCK_N)
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma_load(k_desc, [start_n, 0], k_ready.index(s), k_smem.index(s))
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma_load(v_desc, [start_n, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _cap_constants(softcap, qk_scale, SOFTCAP: gl.constexpr):
    """(cap_c, cap_k) of _softmax's softcap: ``softcap * LOG2E`` (the scale that takes the tanh to
    log2 units: ``softcap * tanh(.)`` in raw-score units times ``qk_scale`` is ``tanh(.) * softcap
    * sm_scale * LOG2E / sm_scale``) and ``qk_scale / (softcap * LOG2E)`` (``sm_scale / softcap``);
    (0, 0) without SOFTCAP (never read then)."""
    if SOFTCAP:
        cap_c = softcap * LOG2E
        cap_k = qk_scale / (softcap * LOG2E)
    else:
        cap_c = qk_scale * 0.0
        cap_k = qk_scale * 0.0
    return cap_c, cap_k


@gluon.jit
def _tanh_approx(x):
    """The hardware tanh (``tanh.approx.f32``, one special-function operation; relative error at
    most 2^-10.99, the fast tanh FlashAttention-2 and -3 cap logits with)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


#: 2**f on [-1/2, 1/2], degree 3, fitted for minimax relative error (Remez): below 7.5e-5, a
#: third of an fp16 P's rounding (2**-12) and a 26th of a bf16 P's, which every P is rounded to
#: before its matmul. Degree 4 (2.6e-6) took one more multiply-add per exp2 on a pipe the split
#: already loads.
EXP2_POLY: gl.constexpr = gl.constexpr((0.9999280571937561, 0.6932609677314758, 0.2426111251115799,
                                        0.0551716685295105))
#: 1.5 * 2**23: x + ROUNDER rounds x to an integer held in the sum's low mantissa bits.
ROUNDER: gl.constexpr = gl.constexpr(12582912.0)


@gluon.jit
def _exp2_fma(x):
    """2**x for finite x <= 0 on the FMA and integer pipes, no special-function operation: x =
    k + f with k = round(x) (the ROUNDER addition), 2**f by EXP2_POLY, k added to its exponent
    bits. x is clamped to -125 (a result of 2**-125 or more where the exact one underflows toward
    0, so only for scores far below their row's maximum). Half the softcapped forward's exp2 go
    here: with the tanh, two special-function operations a score made that unit the bound
    (FlashAttention-4 balances the units the same way)."""
    x = gl.maximum(x, -125.0)
    t = x + ROUNDER
    f = x - (t - ROUNDER)
    p = f * EXP2_POLY[3] + EXP2_POLY[2]
    p = p * f + EXP2_POLY[1]
    p = p * f + EXP2_POLY[0]
    # k << 23 is t's bit pattern shifted by 23: ROUNDER's own bits vanish mod 2**32.
    bits = p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _exp2_split(x):
    """exp2 of a score tile, the even columns with the special-function unit, the odd ones with
    _exp2_fma (each thread holds column pairs, so the split moves no data)."""
    BM: gl.constexpr = x.shape[0]
    BN: gl.constexpr = x.shape[1]
    a, b = gl.split(gl.reshape(x, [BM, BN // 2, 2]))
    return gl.reshape(gl.join(gl.exp2(a), _exp2_fma(b)), [BM, BN])


@gluon.jit
def _softmax(s_acc, m_i, start_n, rows, cols, len_k, diag, left, right, qk_scale, cap_c, cap_k,
             MASKED: gl.constexpr, CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, SPLIT: gl.constexpr):
    """(p, new row maximum, rescale factor) of one S block; m is in log2 units (scaled scores).

    Unmasked blocks fold the scale into the exponent (needs qk_scale >= 0: a negative scale sends
    every block through the masked path, see attn_fwd_sm90). Rows that have seen no visible key
    keep m = -inf and subtract 0 (no NaN); their p stays 0. SOFTCAP: the raw scores are softcapped
    first, ``tanh(s * cap_k)`` with the hardware tanh (one special-function operation per score
    where attn_fwd's _softcapped takes two: the exp2 of p makes the unit the bound), and ``cap_c``
    takes them to log2 units in qk_scale's place (the cap's own multiply folded into the
    softmax's multiply-add: one instruction a score less). SPLIT:
    half of an unmasked block's exp2 on the FMA pipe (_exp2_split; the softcapped forward's
    EXP2_SPLIT configs, the FP8 forward's).
    """
    if SOFTCAP:
        s_acc = _tanh_approx(s_acc * cap_k)
        qk_scale = cap_c
    if MASKED:
        qk = s_acc * qk_scale
        keys = start_n + cols
        if CAUSAL != 0:
            rel = keys[None, :] - rows[:, None] - diag
            right_i = gl.minimum(right, len_k - 1 - diag - rows)
            visible = (rel >= -left) & (rel <= right_i[:, None])
        else:
            visible = (keys < len_k)[None, :] & (rows >= 0)[:, None]
        qk = gl.where(visible, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(qk - m_sub[:, None])
        alpha = gl.exp2(m_i - m_sub)
    else:
        m_new = gl.maximum(m_i, gl.max(s_acc, 1) * qk_scale)
        if SPLIT:
            # Every score is finite here (a masked block's -inf never takes this path).
            p = gl.convert_layout(_exp2_split(s_acc * qk_scale - m_new[:, None]), s_acc.type.layout)
        else:
            p = gl.exp2(s_acc * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
    return p, m_new, alpha


@gluon.jit
def _take_turn(turn, k, c: gl.constexpr, PINGPONG: gl.constexpr):
    """With PINGPONG, wait until consumer c may issue its k-th group of matmuls (FA3's inter-warpgroup
    schedule: the consumers take turns, so one's softmax runs while the other's matmuls do).

    turn[c] completes a phase each time the other consumer passes the turn. Consumer 0 goes first:
    its k-th wait is on parity (k & 1) ^ 1, which a fresh barrier counts as complete for k = 0;
    consumer 1 waits on parity k & 1, completed by consumer 0's k-th pass. Both issue the same
    number of groups (the same key blocks), so the alternation never waits on a missing pass.
    """
    if PINGPONG:
        mbarrier.wait(turn.index(c), (k & 1) ^ (1 - c))


@gluon.jit
def _pass_turn(turn, c: gl.constexpr, PINGPONG: gl.constexpr):
    """With PINGPONG, hand the matmul turn to the other consumer (after issuing, not finishing)."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - c), count=1)


@gluon.jit
def _consumer(c: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, turn,
              O_head, L_head, stride_om, start_m, len_q, len_k, qk_scale, diag, left, right,
              lo, f1, f2, n1, n2, n, q_desc, k_desc, v_desc, cap_c, cap_k, sink2,
              CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
              INLINE: gl.constexpr, SOFTCAP: gl.constexpr):
    """Consumer warp group c: rows start_m + c*HALF ... of the program's tile, the whole key loop.

    INLINE (no loader warp): the consumer issues the TMA loads itself: Q and the first STAGES
    blocks up front, then block j-1+STAGES into the slot block j-1 frees.
    """
    HALF: gl.constexpr = q_smem.shape[1]
    if INLINE:
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        tma_load(q_desc, [start_m + c * HALF, 0], q_bar.index(c), q_smem.index(c))
        for j in range(0, gl.minimum(n, STAGES)):
            _load_block(j, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_free, lo, f1, f2, n1, n2,
                        BLOCK_N, STAGES)
    _attend(c, q_smem, k_smem, v_smem, q_bar, q_bar, k_ready, v_ready, kv_free, turn, O_head, L_head, stride_om,
            start_m, len_q, len_k, qk_scale, diag, left, right, lo, f1, f2, n1, n2, n, k_desc, v_desc, 0, 0, 0,
            cap_c, cap_k, sink2, CAUSAL, BLOCK_N, STAGES, PINGPONG, INLINE, False, SOFTCAP)


@gluon.jit
def _with_sink(inv_l, lse2, sink2):
    """attn_fwd's _with_sink: a sink logit ``sink2`` joined to rows of logsumexp ``lse2`` (log2
    units); the rows' output factor and new logsumexp."""
    top = gl.maximum(lse2, sink2)
    top = gl.where(top == float("-inf"), 0.0, top)  # both -inf: no key and a sink of -inf
    new = top + gl.log2(gl.exp2(lse2 - top) + gl.exp2(sink2 - top))
    scale = gl.where(lse2 == float("-inf"), 0.0, gl.exp2(lse2 - new))
    return inv_l * scale, new


@gluon.jit
def _attend(c: gl.constexpr, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, turn,
            O_head, L_head, stride_om, start_m, len_q, len_k, qk_scale, diag, left, right,
            lo, f1, f2, n1, n2, n, k_desc, v_desc, ring, turns, q_phase, cap_c, cap_k, sink2,
            CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
            INLINE: gl.constexpr, RELEASE_Q: gl.constexpr, SOFTCAP: gl.constexpr):
    """Consumer c's part of one query tile: its n key blocks from ring position ``ring`` on (after
    ``turns`` matmul groups), then O and LSE of its rows stored. The tile's Q is the q_phase-th
    load into its Q slot; with RELEASE_Q the slot is handed back on q_free as soon as the tile's
    last Q.K^T has retired (the persistent loader then loads the next tile's Q during the last P.V
    and the stores). The head's sink logit ``sink2`` (log2 units; -inf without sinks) joins each
    row's softmax (attn_fwd's ``_with_sink``)."""
    HALF: gl.constexpr = q_smem.shape[1]
    BLOCK_D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    rows = start_m + c * HALF + gl.arange(0, HALF, layout=row_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([HALF], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([HALF], gl.float32, row_layout)
    acc = gl.zeros([HALF, BLOCK_D], gl.float32, o_layout)
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
    q = q_smem.index(c)
    mbarrier.wait(q_bar.index(c), q_phase & 1)

    # Prologue: S_0 and its softmax; P_0 waits for the loop's first P.V.
    p = gl.zeros([HALF, BLOCK_N], dtype, p_layout)
    if n > 0:
        s0 = ring % STAGES
        k0 = k_smem.index(s0).permute((1, 0))
        _take_turn(turn, turns, c, PINGPONG)
        mbarrier.wait(k_ready.index(s0), (ring // STAGES) & 1)
        s_acc = warpgroup_mma(q, k0, s_zero, use_acc=False, is_async=True)
        _pass_turn(turn, c, PINGPONG)
        s_acc = warpgroup_mma_wait(0, deps=(s_acc,))
        start0 = _key_block(0, lo, f1, f2, n1, n2, BLOCK_N)
        p32, m_i, alpha = _softmax(s_acc, m_i, start0, rows, cols, len_k, diag, left, right, qk_scale,
                                   cap_c, cap_k, True, CAUSAL, SOFTCAP, SOFTCAP == 2)
        l_i = gl.sum(p32, 1)
        p = gl.convert_layout(p32.to(dtype), p_layout)

    # Steady state, masked blocks then unmasked ones: issue S_j and P_{j-1}.V_{j-1}, softmax S_j
    # while P.V runs, then rescale O and free slot j-1.
    masked_end = gl.maximum(n1 + n2, 1)
    for idx in range(1, masked_end):
        acc, p, l_i, m_i = _step(idx, c, acc, p, l_i, m_i, q, k_smem, v_smem, k_ready, v_ready, kv_free, turn,
                                 s_zero, rows, cols, len_k, diag, left, right, qk_scale, lo, f1, f2, n1, n2,
                                 n, k_desc, v_desc, ring, turns, cap_c, cap_k, True, CAUSAL, BLOCK_N, STAGES,
                                 PINGPONG, INLINE, p_layout, o_layout, SOFTCAP)
    for idx in range(masked_end, n):
        acc, p, l_i, m_i = _step(idx, c, acc, p, l_i, m_i, q, k_smem, v_smem, k_ready, v_ready, kv_free, turn,
                                 s_zero, rows, cols, len_k, diag, left, right, qk_scale, lo, f1, f2, n1, n2,
                                 n, k_desc, v_desc, ring, turns, cap_c, cap_k, False, CAUSAL, BLOCK_N, STAGES,
                                 PINGPONG, INLINE, p_layout, o_layout, SOFTCAP)
    if RELEASE_Q:
        # Every Q.K^T of the tile has retired (each _step waits for its S): Q's slot may be refilled.
        mbarrier.arrive(q_free.index(c), count=1)
    # Epilogue: the last block's P.V.
    if n > 0:
        last = ring + n - 1
        s = last % STAGES
        v = v_smem.index(s)
        _take_turn(turn, turns + n, c, PINGPONG)
        mbarrier.wait(v_ready.index(s), (last // STAGES) & 1)
        acc = warpgroup_mma(p, v, acc, is_async=True)
        _pass_turn(turn, c, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(kv_free.index(s), count=1)

    # Rows that saw no key have l = 0: output 0, logsumexp -inf.
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse2 = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_safe))
    inv, lse2 = _with_sink(1.0 / l_safe, lse2, sink2)
    gl.store(L_head + rows, lse2 * LN2, mask=rows < len_q)
    inv_l = gl.convert_layout(inv, gl.SliceLayout(1, o_layout))
    out = (acc * inv_l[:, None]).to(dtype)
    o_rows = start_m + c * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O_head + o_rows.to(gl.int64)[:, None] * stride_om + o_cols[None, :]
    gl.store(o_ptrs, out, mask=(o_rows < len_q)[:, None] & (o_cols >= 0)[None, :])


@gluon.jit
def _step(idx, c: gl.constexpr, acc, p, l_i, m_i, q, k_smem, v_smem, k_ready, v_ready, kv_free, turn, s_zero,
          rows, cols, len_k, diag, left, right, qk_scale, lo, f1, f2, n1, n2, n, k_desc, v_desc, ring, turns,
          cap_c, cap_k,
          MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
          PINGPONG: gl.constexpr, INLINE: gl.constexpr, p_layout: gl.constexpr, o_layout: gl.constexpr,
          SOFTCAP: gl.constexpr):
    """One pipelined key block idx >= 1 of consumer c (see _consumer). ring: the ring position of
    the tile's block 0 (slot ring % STAGES); turns: the consumer's matmul groups before the tile."""
    it = ring + idx
    s = it % STAGES
    prev = (it - 1) % STAGES
    k = k_smem.index(s).permute((1, 0))
    v = v_smem.index(prev)
    _take_turn(turn, turns + idx, c, PINGPONG)
    mbarrier.wait(k_ready.index(s), (it // STAGES) & 1)
    s_acc = warpgroup_mma(q, k, s_zero, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v, acc, is_async=True)
    _pass_turn(turn, c, PINGPONG)
    # Groups retire in order: one outstanding means S_j is done and P.V may still run.
    s_acc = warpgroup_mma_wait(1, deps=(s_acc,))
    start_n = _key_block(idx, lo, f1, f2, n1, n2, BLOCK_N)
    p32, m_i, alpha = _softmax(s_acc, m_i, start_n, rows, cols, len_k, diag, left, right, qk_scale,
                               cap_c, cap_k, MASKED, CAUSAL, SOFTCAP, SOFTCAP == 2)
    l_i = l_i * alpha + gl.sum(p32, 1)
    p = gl.convert_layout(p32.to(p.dtype), p_layout)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(kv_free.index(prev), count=1)
    if INLINE:
        # The slot block idx-1 just freed takes block idx-1+STAGES (its wait passes at once).
        if idx - 1 + STAGES < n:
            _load_block(idx - 1 + STAGES, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_free,
                        lo, f1, f2, n1, n2, BLOCK_N, STAGES)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return acc, p, l_i, m_i


@gluon.jit
def _band(start_m, len_k, diag, left, right, sm_scale, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr):
    """The key blocks the query tile at start_m visits (attn_fwd's _window / _span, for the whole
    BLOCK_M tile): (lo, f1, f2, n1, n2, n); blocks [lo, f1) and [f2, hi) need a mask (n1 and n2 of
    them), [f1, f2) do not; n in all."""
    if CAUSAL != 0:
        lo = gl.maximum(start_m + diag - left, 0)
        lo = lo // BLOCK_N * BLOCK_N
        hi = gl.minimum(start_m + BLOCK_M + diag + right, len_k)
        hi = gl.maximum(hi, lo)
        hi_up = (hi + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        full_lo = gl.maximum(start_m + BLOCK_M - 1 + diag - left, 0)
        full_lo = (full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        full_hi = gl.minimum(start_m + diag + right + 1, len_k)
        full_hi = gl.maximum(full_hi, 0) // BLOCK_N * BLOCK_N
        f1 = gl.minimum(gl.maximum(full_lo, lo), hi_up)
        f2 = gl.minimum(gl.maximum(full_hi, f1), hi_up)
    else:
        lo = len_k * 0
        f1 = lo
        f2 = len_k // BLOCK_N * BLOCK_N
        hi = len_k
    # The unmasked path scales row maxima, which needs a non-negative scale.
    f1 = gl.where(sm_scale < 0, lo, f1)
    f2 = gl.where(sm_scale < 0, lo, f2)
    n1 = (f1 - lo) // BLOCK_N
    n2 = (hi - f2 + BLOCK_N - 1) // BLOCK_N
    n = n1 + n2 + (f2 - f1) // BLOCK_N
    return lo, f1, f2, n1, n2, n


@gluon.jit
def _tile_count(pid, programs, tiles, PAIRS: gl.constexpr):
    """How many of ``tiles`` query tiles program pid < programs of a persistent grid runs (see
    _tile_of): those of its units, the last unit one tile short when ``tiles`` is odd and PAIRS 2.
    Plain integer arithmetic (every numerator is >= 0, so C and Python division agree): the CPU
    tests call the function's Python body to check the tiling for many grids."""
    step = PAIRS * programs
    count = (tiles - PAIRS * pid + step - 1) // step
    if PAIRS == 2:
        count += (tiles - PAIRS * pid - 1 + step - 1) // step
    return count


@gluon.jit
def _tile_of(j, pid, programs, num_m, CAUSAL: gl.constexpr, PAIRS: gl.constexpr):
    """(query block, batch * head) of program pid's j-th tile in a persistent grid.

    Tiles are numbered head by head, so the programs running at one time share a few heads' K and V
    in L2; program pid takes units pid, pid + programs, ... of PAIRS consecutive tiles. Causal
    heads number their query blocks heaviest and lightest alternately (last, first, second last,
    ...) and PAIRS = 2: a unit is one heavy and one light tile, so the units are about the same
    work and a static round-robin of units balances the programs; the heavy tile goes first.
    Plain integer arithmetic, like _tile_count.
    """
    t = PAIRS * (pid + (j // PAIRS) * programs) + j % PAIRS
    pid_bh = t // num_m
    r = t % num_m
    if CAUSAL != 0:
        # Even r: num_m - 1 - r // 2 (the heavy ones, last first); odd r: r // 2.
        pid_m = r // 2 + (1 - r % 2) * (num_m - 1 - r)
    else:
        pid_m = r
    return pid_m, pid_bh


@gluon.jit
def _persistent_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free,
                       num_m, tiles, num_heads_q, group, len_k, diag, left, right, sm_scale,
                       CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       PAIRS: gl.constexpr):
    """Loader warp of a persistent program: for each of its tiles, both consumers' Q (once they
    have handed their Q slot back) and every visited K/V block, through one slot ring whose
    positions (and so barrier phases) run on across tiles: the next tile's loads start while the
    consumers finish the current one."""
    HALF: gl.constexpr = q_smem.shape[1]
    BLOCK_D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    ring = pid * 0
    for j in range(_tile_count(pid, programs, tiles, PAIRS)):
        pid_m, pid_bh = _tile_of(j, pid, programs, num_m, CAUSAL, PAIRS)
        off_b = pid_bh // num_heads_q
        off_h = pid_bh % num_heads_q
        off_hk = off_h // group
        start_m = pid_m * BLOCK_M
        lo, f1, f2, n1, n2, n = _band(start_m, len_k, diag, left, right, sm_scale, CAUSAL, BLOCK_M, BLOCK_N)
        for c in gl.static_range(2):
            # The j-th use of the slot; a fresh barrier counts the phase before its first as done.
            mbarrier.wait(q_free.index(c), (j & 1) ^ 1)
            mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
            q_dst = reinterpret(q_smem.index(c), dtype, [1, 1, HALF, BLOCK_D], q_desc.layout)
            tma_load(q_desc, [off_b, off_h, start_m + c * HALF, 0], q_bar.index(c), q_dst)
        for idx in range(n):
            it = ring + idx
            s = it % STAGES
            mbarrier.wait(kv_free.index(s), ((it // STAGES) & 1) ^ 1)
            start_n = _key_block(idx, lo, f1, f2, n1, n2, BLOCK_N)
            k_dst = reinterpret(k_smem.index(s), dtype, [1, 1, BLOCK_N, BLOCK_D], k_desc.layout)
            v_dst = reinterpret(v_smem.index(s), dtype, [1, 1, BLOCK_N, BLOCK_D], v_desc.layout)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma_load(k_desc, [off_b, off_hk, start_n, 0], k_ready.index(s), k_dst)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma_load(v_desc, [off_b, off_hk, start_n, 0], v_ready.index(s), v_dst)
        ring += n


@gluon.jit
def _sink_logit(Sinks, off_h, use_sinks, sm_scale):
    """Head off_h's sink logit in log2 units (``Sinks[off_h] * LOG2E``), -inf without sinks (which
    joins nothing: _with_sink leaves every row exactly as it is)."""
    sink2 = gl.full([], float("-inf"), gl.float32)
    if use_sinks != 0:
        sink2 = gl.load(Sinks + off_h) * LOG2E
    return sink2


@gluon.jit
def _persistent_consumer(c: gl.constexpr, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, turn,
                         Out, LSE, stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                         num_m, tiles, num_heads_q, len_q, len_k, qk_scale, diag, left, right, sm_scale,
                         k_desc, v_desc, cap_c, cap_k, Sinks, use_sinks, CAUSAL: gl.constexpr,
                         BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, PAIRS: gl.constexpr,
                         SOFTCAP: gl.constexpr):
    """Consumer warp group c of a persistent program: the loader's tiles in the same order, each
    with the non-persistent consumer's pipeline and epilogue (_attend), ring position and
    ping-pong turns carried from tile to tile."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    ring = pid * 0
    turns = pid * 0
    for j in range(_tile_count(pid, programs, tiles, PAIRS)):
        pid_m, pid_bh = _tile_of(j, pid, programs, num_m, CAUSAL, PAIRS)
        off_b = pid_bh // num_heads_q
        off_h = pid_bh % num_heads_q
        start_m = pid_m * BLOCK_M
        O_head = Out + off_b.to(gl.int64) * stride_oz + off_h.to(gl.int64) * stride_oh
        L_head = LSE + off_b.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh
        lo, f1, f2, n1, n2, n = _band(start_m, len_k, diag, left, right, sm_scale, CAUSAL, BLOCK_M, BLOCK_N)
        sink2 = _sink_logit(Sinks, off_h, use_sinks, sm_scale)
        _attend(c, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, turn, O_head, L_head, stride_om,
                start_m, len_q, len_k, qk_scale, diag, left, right, lo, f1, f2, n1, n2, n, k_desc, v_desc, ring,
                turns, j, cap_c, cap_k, sink2, CAUSAL, BLOCK_N, STAGES, PINGPONG, False, True, SOFTCAP)
        ring += n
        turns += gl.where(n > 0, n + 1, 0)


@gluon.jit
def _attn_fwd_persistent(Q, K, V, Out, LSE, stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                         stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                         batch, num_heads_q, num_heads_k, len_q, len_k, sm_scale, diag, left, right, softcap,
                         Sinks, use_sinks, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, SOFTCAP: gl.constexpr):
    """attn_fwd_sm90 with PERSISTENT: programs loop over (query block, batch * head) tiles."""
    HALF: gl.constexpr = BLOCK_M // 2
    BLOCK_D: gl.constexpr = HEAD_DIM
    PAIRS: gl.constexpr = 2 if CAUSAL != 0 else 1
    dtype: gl.constexpr = Q.dtype.element_ty
    num_m = (len_q + BLOCK_M - 1) // BLOCK_M
    tiles = num_m * batch * num_heads_q
    qk_scale = sm_scale * LOG2E
    cap_c, cap_k = _cap_constants(softcap, qk_scale, SOFTCAP)

    # One 4-D (batch, head, row, dim) descriptor per tensor serves every tile of the program.
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    q4_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, HALF, BLOCK_D], dtype)
    kv4_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, BLOCK_D], dtype)
    q_desc = tma.make_tensor_descriptor(Q, shape=[batch, num_heads_q, len_q, HEAD_DIM],
                                        strides=[stride_qz, stride_qh, stride_qm, 1],
                                        block_shape=[1, 1, HALF, BLOCK_D], layout=q4_layout)
    k_desc = tma.make_tensor_descriptor(K, shape=[batch, num_heads_k, len_k, HEAD_DIM],
                                        strides=[stride_kz, stride_kh, stride_kn, 1],
                                        block_shape=[1, 1, BLOCK_N, BLOCK_D], layout=kv4_layout)
    v_desc = tma.make_tensor_descriptor(V, shape=[batch, num_heads_k, len_k, HEAD_DIM],
                                        strides=[stride_vz, stride_vh, stride_vn, 1],
                                        block_shape=[1, 1, BLOCK_N, BLOCK_D], layout=kv4_layout)

    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_bar.index(c), count=1)
        mbarrier.init(q_free.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_free.index(s), count=2)

    group = num_heads_q // num_heads_k
    gl.warp_specialize([
        (_persistent_consumer, (0, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, turn, Out, LSE,
                                stride_oz, stride_oh, stride_om, stride_lz, stride_lh, num_m, tiles, num_heads_q,
                                len_q, len_k, qk_scale, diag, left, right, sm_scale, k_desc, v_desc, cap_c, cap_k,
                                Sinks, use_sinks, CAUSAL, BLOCK_M, BLOCK_N, STAGES, PINGPONG, PAIRS, SOFTCAP)),
        (_persistent_consumer, (1, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, turn, Out, LSE,
                                stride_oz, stride_oh, stride_om, stride_lz, stride_lh, num_m, tiles, num_heads_q,
                                len_q, len_k, qk_scale, diag, left, right, sm_scale, k_desc, v_desc, cap_c, cap_k,
                                Sinks, use_sinks, CAUSAL, BLOCK_M, BLOCK_N, STAGES, PINGPONG, PAIRS, SOFTCAP)),
        (_persistent_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready,
                              kv_free, num_m, tiles, num_heads_q, group, len_k, diag, left, right, sm_scale,
                              CAUSAL, BLOCK_M, BLOCK_N, STAGES, PAIRS)),
    ], [4, 1], [CONSUMER_REGS, 24])


@gluon.jit
def attn_fwd_sm90(
    Q, K, V, Bias, Out, LSE, DropMask, cu_seqlens_q, cu_seqlens_k,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    stride_bz, stride_bh, stride_bm,
    stride_lz, stride_lh,
    stride_dmz, stride_dmh, stride_dmm,
    batch, num_heads_q, num_heads_k, seqlen_q, seqlen_k,
    sm_scale, dropout_p, philox_seed, philox_offset, window_left, window_right, causal_align, softcap,
    alibi_slopes, stride_az, Sinks, use_sinks,
    HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    CAUSAL: gl.constexpr, BIAS: gl.constexpr, DROPOUT: gl.constexpr, VARLEN: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
    WARP_SPECIALIZE: gl.constexpr, CONSUMER_REGS: gl.constexpr, PERSISTENT: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, EXP2_SPLIT: gl.constexpr = 0,
):
    """Attention forward (see attn_fwd): Out = softmax(Q K^T * sm_scale, masked) V and its logsumexp.

    Grid: (cdiv(seqlen_q, BLOCK_M), batch * num_heads_q, 1). Bias, DropMask, cu_seqlens_* and the
    dropout arguments are accepted (attn_fwd's argument list) and ignored: BIAS, DROPOUT and VARLEN
    are 0; so are alibi_slopes and stride_az (ALIBI is 0: ALiBi calls run attn_fwd). HEAD_DIM ==
    HEAD_DIM_V, a power of two (64 or 128). STAGES: K/V slots in the ring.
    PINGPONG: the two consumers take turns issuing their matmuls (see _take_turn). CONSUMER_REGS:
    registers per thread of the second consumer warp group (the loader warp gets 24).
    WARP_SPECIALIZE 0: no loader warp and one consumer of BLOCK_M rows (4 warps) that issues its
    own TMA loads (a fallback, and small enough for two programs per SM with short key blocks).
    SOFTCAP: attn_fwd's logit softcap on the raw scores (``softcap > 0``, ``sm_scale != 0``).
    EXP2_SPLIT (SOFTCAP): unmasked blocks compute half their exp2 on the FMA pipe (_exp2_split).
    ``Sinks``/``use_sinks``: attn_fwd's attention sinks, joined in the epilogue.
    """
    gl.static_assert(EXP2_SPLIT == 0 or SOFTCAP == 1, "attn_fwd_sm90: EXP2_SPLIT balances a softcap's units")
    # The softcap mode the partitions see: 0 none, 1 softcap, 2 softcap with EXP2_SPLIT.
    CAP: gl.constexpr = SOFTCAP * (1 + EXP2_SPLIT)
    gl.static_assert(BIAS == 0 and DROPOUT == 0 and VARLEN == 0, "attn_fwd_sm90: no bias, dropout or varlen")
    gl.static_assert(ALIBI == 0, "attn_fwd_sm90: no ALiBi")
    gl.static_assert(HEAD_DIM == HEAD_DIM_V, "attn_fwd_sm90: equal q.k and v head dims")
    gl.static_assert(PINGPONG <= WARP_SPECIALIZE, "attn_fwd_sm90: PINGPONG needs two consumers")
    CONSUMERS: gl.constexpr = 2 if WARP_SPECIALIZE else 1
    HALF: gl.constexpr = BLOCK_M // CONSUMERS
    BLOCK_D: gl.constexpr = HEAD_DIM
    dtype: gl.constexpr = Q.dtype.element_ty

    len_q = seqlen_q
    len_k = seqlen_k
    # The band's diagonal (key index minus query index of its main diagonal) and its two sides.
    unbounded = len_q + len_k
    if CAUSAL == 2:
        diag = len_k - len_q
    elif CAUSAL == 1:
        diag = causal_align * (len_k - len_q)  # 0 top-left, 1 bottom-right
    else:
        diag = len_k * 0
    left = gl.where(window_left < 0, unbounded, window_left)
    right = gl.where(window_right < 0, unbounded, window_right)

    if PERSISTENT != 0:
        gl.static_assert(WARP_SPECIALIZE == 1, "attn_fwd_sm90: PERSISTENT needs the loader warp")
        _attn_fwd_persistent(Q, K, V, Out, LSE, stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                             stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                             batch, num_heads_q, num_heads_k, len_q, len_k, sm_scale, diag, left, right, softcap,
                             Sinks, use_sinks, HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMER_REGS,
                             CAP)
    else:
        pid_m = gl.program_id(0)
        if CAUSAL != 0:
            # Heaviest query tile first (it sees the most keys, in either alignment): one program per
            # SM runs in launch order, so the light tiles fill the end of the grid (a shorter tail).
            pid_m = gl.num_programs(0) - 1 - pid_m
        pid_bh = gl.program_id(1)
        off_b = pid_bh // num_heads_q
        off_h = pid_bh % num_heads_q
        off_hk = off_h // (num_heads_q // num_heads_k)
        start_m = pid_m * BLOCK_M

        Q_head = Q + off_b.to(gl.int64) * stride_qz + off_h.to(gl.int64) * stride_qh
        K_base = K + off_b.to(gl.int64) * stride_kz + off_hk.to(gl.int64) * stride_kh
        V_base = V + off_b.to(gl.int64) * stride_vz + off_hk.to(gl.int64) * stride_vh
        O_head = Out + off_b.to(gl.int64) * stride_oz + off_h.to(gl.int64) * stride_oh
        L_head = LSE + off_b.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh

        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_D], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
        q_desc = tma.make_tensor_descriptor(Q_head, shape=[len_q, HEAD_DIM], strides=[stride_qm, 1],
                                            block_shape=[HALF, BLOCK_D], layout=q_layout)
        k_desc = tma.make_tensor_descriptor(K_base, shape=[len_k, HEAD_DIM], strides=[stride_kn, 1],
                                            block_shape=[BLOCK_N, BLOCK_D], layout=kv_layout)
        v_desc = tma.make_tensor_descriptor(V_base, shape=[len_k, HEAD_DIM], strides=[stride_vn, 1],
                                            block_shape=[BLOCK_N, BLOCK_D], layout=kv_layout)

        lo, f1, f2, n1, n2, n = _band(start_m, len_k, diag, left, right, sm_scale, CAUSAL, BLOCK_M, BLOCK_N)
        qk_scale = sm_scale * LOG2E
        cap_c, cap_k = _cap_constants(softcap, qk_scale, SOFTCAP)
        sink2 = _sink_logit(Sinks, off_h, use_sinks, sm_scale)

        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, HALF, BLOCK_D], q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(q_bar.index(c), count=1)
            mbarrier.init(turn.index(c), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(kv_free.index(s), count=CONSUMERS)

        if WARP_SPECIALIZE:
            gl.warp_specialize([
                (_consumer, (0, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, turn, O_head, L_head,
                             stride_om, start_m, len_q, len_k, qk_scale, diag, left, right, lo, f1, f2, n1, n2, n,
                             q_desc, k_desc, v_desc, cap_c, cap_k, sink2, CAUSAL, BLOCK_N, STAGES,
                             PINGPONG, False, CAP)),
                (_consumer, (1, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, turn, O_head, L_head,
                             stride_om, start_m, len_q, len_k, qk_scale, diag, left, right, lo, f1, f2, n1, n2, n,
                             q_desc, k_desc, v_desc, cap_c, cap_k, sink2, CAUSAL, BLOCK_N, STAGES,
                             PINGPONG, False, CAP)),
                (_loader, (k_desc, v_desc, q_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free,
                           start_m, lo, f1, f2, n1, n2, n, BLOCK_N, STAGES)),
            ], [4, 1], [CONSUMER_REGS, 24])
        else:
            _consumer(0, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, turn, O_head, L_head,
                      stride_om, start_m, len_q, len_k, qk_scale, diag, left, right, lo, f1, f2, n1, n2, n,
                      q_desc, k_desc, v_desc, cap_c, cap_k, sink2, CAUSAL, BLOCK_N, STAGES, 0, True,
                      CAP)


# --------------------------------------------------------------------------------------------
# Registry declaration.
# --------------------------------------------------------------------------------------------

from aotriton_rt.ops.attention.family import FWD_SM90  # noqa: E402
from builder.kernels._attention_sets import in_default_set as _in_attn_fwd_default  # noqa: E402
from builder.kernels._attention_sets import in_gputest_set as _in_attn_fwd_gputest  # noqa: E402
from builder.kernels.attention import (  # noqa: E402
    ALIGN_CHECKS,
    FWD_POINTERS,
    GQA_CHECKS,
    divisibility_of,
    signature_of,
    stride_checks,
)
from builder.registry import ConfigDecl, KernelDecl  # noqa: E402 - declarations follow the kernel
from builder.tuning import tuned_configs  # noqa: E402

#: Head dims compiled: the ones whose portable sm90 forward trails cuDNN most (docs/performance.md).
HEAD_DIMS = (64, 128)
#: (BLOCK_M, BLOCK_N, STAGES, PINGPONG, WARP_SPECIALIZE) per head dim, the expected fastest first (unmeasured:
#: bench/sm90_levers.py ranks them). Shared memory: the two consumers' Q tiles plus STAGES K and V
#: blocks (D=128, BLOCK_N=128: 32 KB + 64 KB a stage; three stages are the most that fit sm90's
#: 227 KB). Two stages leave the loader no slot to fill while a consumer holds block j-1 (P.V) and
#: j (S); they are there to measure that. WARP_SPECIALIZE 0 (one 64-row consumer, its own loads):
#: 64-key blocks in three stages take 112 KB, two programs per SM.
TILES = {128: ((128, 128, 3, 1, 1), (128, 128, 3, 0, 1), (128, 64, 4, 1, 1), (128, 128, 2, 0, 1),
               (64, 64, 3, 0, 0), (64, 128, 2, 0, 0)),
         64: ((128, 128, 4, 1, 1), (128, 128, 4, 0, 1), (128, 64, 4, 1, 1), (64, 64, 4, 0, 0))}
#: Persistent configs (PERSISTENT > 0), appended after TILES' so that the tuning database's config
#: indices keep their meaning: the same tile, a grid of min(work units, PERSISTENT) programs that
#: loop over the query tiles (for short sequences, where one tile's prologue and epilogue are a large
#: share of its time and the loader can start the next tile's loads during them). Every mask mode:
#: mode 1 serves both alignments (the default set's only causal mode), and square causal calls
#: dispatch to mode 2 where the images hold it (gputest, full; what `builder tune` measures), so its
#: table must hold them too, under the same indices. Each head dim's persistent rows are its first
#: tile with and without ping-pong (at D=128 they lifted N=1024 from 0.60-0.68x cuDNN to 0.83-0.89x;
#: at D=64, four 32 KB K/V stages plus 16 KB of Q, 144 KB of shared memory, `builder tune` picks #4
#: at nearly every length: docs/performance.md, "Attention forward and backward").
PERSISTENT_TILES = {128: ((128, 128, 3, 1, 1), (128, 128, 3, 0, 1)), 64: ((128, 128, 4, 1, 1), (128, 128, 4, 0, 1))}
#: Programs of a persistent grid: one per SM of an H100 SXM / H200 (132 SMs). Any count is correct
#: (each program strides over the tiles by the grid size); fewer SMs run a second partial wave,
#: more leave SMs idle. The runtime passes no SM count to grid rules, so it is a constant.
PERSISTENT_PROGRAMS = 132
#: Registers per thread of each consumer warp group (setmaxnreg); the loader warp takes 24.
CONSUMER_REGS = 240


def sm90_fwd_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    """The tile table for a head dim, then its persistent configs; for softcap specs then the
    persistent configs again with EXP2_SPLIT (half the unmasked blocks' exp2 on the FMA pipe).
    num_warps is the default partition's (consumer 0); the compiled kernel runs 12 warps (two
    consumer groups and the loader's group), which the catalog records from the binary."""
    d = spec["HEAD_DIM"]
    rows = [(*t, 0, 0) for t in TILES[d]] + [(*t, PERSISTENT_PROGRAMS, 0) for t in PERSISTENT_TILES[d]]
    if spec.get("SOFTCAP"):
        rows += [(*t, PERSISTENT_PROGRAMS, 1) for t in PERSISTENT_TILES[d]]
    # EXP2_SPLIT is named only where it is 1 (the kernel's default is 0): the other configs keep
    # the parameters the tuning database measured them with (its rules check them).
    return tuple(ConfigDecl(constexprs={"BLOCK_M": bm, "BLOCK_N": bn, "STAGES": st, "PINGPONG": pp,
                                        "WARP_SPECIALIZE": ws, "CONSUMER_REGS": CONSUMER_REGS,
                                        "PERSISTENT": programs, **({"EXP2_SPLIT": 1} if split else {})},
                            num_warps=4, num_stages=1, backends=("cuda",))
                 for bm, bn, st, pp, ws, programs, split in rows)


def _excluded(spec: dict, target: object) -> str | None:
    if target.backend != "cuda" or target.arch != "sm90":
        return f"{target.arch}: a Gluon kernel for sm90 only (other targets run attn_fwd)"
    if spec["HEAD_DIM"] != spec["HEAD_DIM_V"]:
        return "unequal q.k and v head dims run attn_fwd"
    return None


def in_levers_set(spec: dict, target: object) -> bool:
    """The set ``bench/sm90_levers.py`` measures: D=128 without mask and bottom-right causal in both
    dtypes, D=64 without mask in fp16."""
    d, causal = spec["HEAD_DIM"], spec["CAUSAL"]
    return (d == 128 and causal in (0, 2)) or (d == 64 and causal == 0 and spec["dtype"] == "fp16")


def in_gputest_set(spec: dict, target: object) -> bool:
    """The GPU tests' and the tuning database's variants: D=64 and D=128 in every mask mode in
    both dtypes (mode 1 is the default set's causal kernel, both alignments; all four D=64
    dtype/mask pairs, so that the acceptance grid's D=64 rows and `builder tune` meet the Gluon
    forward a full build has), each only where the gputest set holds its ``attn_fwd`` twin (the
    forward's spec is chosen among the portable kernel's variants, so a Gluon variant without one
    is never dispatched)."""
    return _in_attn_fwd_gputest(spec, target)  # every spec of the kernel's axes (HEAD_DIMS) qualifies


def in_default_set(spec: dict, target: object) -> bool:
    """Head dims 64 and 128 (fp16/bf16, no mask and causal mode 1, which serves both alignments),
    in the configs :func:`default_configs` names; the tuning database sends the lengths where
    ``attn_fwd`` is faster back to it. Softcap variants where the default set holds their
    ``attn_fwd`` twin (a Gluon variant without one is never dispatched)."""
    return spec["CAUSAL"] in (0, 1) and (not spec.get("SOFTCAP") or _in_attn_fwd_default(spec, target))


def default_configs(spec: dict, target: object = None) -> tuple[int, ...]:
    """The default set's configs of a spec, under their full-table numbers: at D=128 the one-tile
    #0 (15-20% over attn_fwd at N >= 4096 on the H200) and both persistent configs (#6 with
    ping-pong, #7 without: 0.87-0.88x cuDNN at N=1024 against #0's 0.60-0.68x, and the database's
    pick at most D=128 lengths); at D=64 the persistent config with ping-pong only (#4: the
    database's pick at nearly every D=64 length, 3-25% faster than attn_fwd; the one-tile configs
    were slower than attn_fwd there). docs/performance.md, "Attention forward and backward".
    A softcapped spec (Gemma 2's) also holds the configs the tuning database picks for it."""
    first = len(TILES[spec["HEAD_DIM"]])
    base = (0, first, first + 1) if spec["HEAD_DIM"] == 128 else (first,)
    return tuple(sorted(set(base) | set(_softcap_picks(spec, target))))


_softcap_picks = tuned_configs(FWD_SM90, first=0, when=lambda spec: bool(spec.get("SOFTCAP")))
default_configs.from_database = True  # type: ignore[attr-defined]  # a stale database's picks are dropped


#: One program per (query tile, batch * head) with PERSISTENT 0; otherwise one dimension of
#: min(work units, PERSISTENT) programs, a unit being one query tile (two, heavy and light, with a
#: mask: see _tile_of). Each rule is the sum of the two cases, one of them multiplied by zero.
GRID = ("cdiv(seqlen_q, BLOCK_M) * (1 - min(PERSISTENT, 1))"
        " + min(cdiv(cdiv(seqlen_q, BLOCK_M) * batch * num_heads_q, 1 + min(CAUSAL, 1)), PERSISTENT)",
        "batch * num_heads_q * (1 - min(PERSISTENT, 1)) + min(PERSISTENT, 1)", "1")

_SIG = signature_of(attn_fwd_sm90, FWD_POINTERS)
_DIV = divisibility_of(_SIG, aligned=("q", "k", "v", "o"), bias=("b",))

# TMA descriptors need a non-empty extent in every dimension.
_CHECKS = (GQA_CHECKS + ALIGN_CHECKS + ("batch * num_heads_q <= 65535", "seqlen_q >= 1", "seqlen_k >= 1",
                                       # A persistent program numbers the tiles in 32 bits.
                                       "cdiv(seqlen_q, BLOCK_M) * batch * num_heads_q <= 1073741824")
           + stride_checks(_DIV))


def _checks(spec: dict) -> tuple[str, ...]:
    """The launch checks; softcap variants also need a positive cap and a non-zero scale."""
    return _CHECKS + (("softcap > 0", "sm_scale != 0") if spec.get("SOFTCAP") else ())


KERNEL = KernelDecl(
    name=FWD_SM90,
    fn=attn_fwd_sm90,
    signature=_SIG,
    axes={"dtype": ("fp16", "bf16"), "HEAD_DIM": HEAD_DIMS, "HEAD_DIM_V": HEAD_DIMS, "CAUSAL": (0, 1, 2),
          "BIAS": (0,), "DROPOUT": (0,), "VARLEN": (0,), "SOFTCAP": (0, 1), "ALIBI": (0,)},
    configs=sm90_fwd_configs,
    grid=GRID,
    divisibility=_DIV,
    exclude=_excluded,
    sets={"default": in_default_set, "gputest": in_gputest_set, "levers": in_levers_set},
    set_configs={"default": default_configs},
    checks=_checks,
)
