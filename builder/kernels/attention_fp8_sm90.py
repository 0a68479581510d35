"""Hopper (sm90) FP8 (e4m3) attention forward in Gluon, FlashAttention-3 style.

Same arguments, conventions and results as ``attn_fwd_fp8`` in ``attention_fp8.py`` (descale
factors folded into the score scale and the output, P rounded to e4m3 for P·V, V read as the
pre-pass's V^T, mask modes 0/1/2 with ``causal_align`` and windows, GQA, natural-log LSE), for
fixed lengths and head dims 64 and 128. Packed sequences and head dim 256 keep the portable
kernel, and so does every other target: this one is compiled for sm90 only.

The pipeline is ``attn_fwd_sm90``'s (attention_sm90.py): one program owns ``BLOCK_M`` query rows
split between two consumer warp groups of 64 rows (the wgmma M tile); a loader warp
(``warp_specialize``) streams K blocks ``[BLOCK_N, D]`` and V^T blocks ``[D, BLOCK_N]`` with TMA
into a ring of ``STAGES`` slots; each consumer issues block j's S = Q·Kᵀ and block j-1's
O += P·V as asynchronous wgmma and runs the softmax of S_j while P·V executes; with PINGPONG the
two consumers take turns issuing. What FP8 changes:

- Both wgmma read e4m3 (k = 32 per instruction, ``QGMMA`` in SASS). Hopper's FP8 wgmma takes its
  shared-memory operands K-major only: K's tile ``[BLOCK_N, D]`` permuted is the K-major B of
  Q·Kᵀ, and V^T's tile ``[D, BLOCK_N]`` (keys contiguous) permuted is the K-major B of P·V. This
  is why the operator runs ``attn_fp8_v_transpose`` first, as for the portable kernel.
- P is rounded to e4m3 in registers (round to nearest, as ``attn_fwd_fp8``'s ``p.to(v.dtype)``)
  and used as the register A operand of the P·V wgmma (``DotOperandLayout`` with ``k_width`` 4:
  four bytes per 32-bit register). The accumulator layout of S holds a thread's scores in pairs
  of columns, the 8-bit A operand in runs of four. In keys' order that takes byte permutes and
  warp shuffles (``PRMT``, ``SHFL.IDX``: 156 PRMT, 24 SHFL and 64 LOP3 a key block per thread at
  D=128, against 475 instructions for the whole bf16 block). With ``KEY_ORDER=1`` (every config
  but the last) the P·V product takes the keys of each 32-key group in the order in which a
  thread already holds them, and ``attn_fp8_v_transpose`` writes V^T's columns in that order, so
  the conversion moves nothing (``_p_operand``; the sum over keys is the same in any order).
- The descale factors of a tile's (sequence, key/value head) are read once per tile: ``q_descale
  * k_descale`` scales the scores, ``v_descale`` the output.

Key blocks are visited as in ``attn_fwd_sm90``: the masked ones (band edges, the sequence end)
first, the unmasked run last. TMA fills what lies past a tensor's extent with zeros: Q rows past
``seqlen_q`` and keys past ``seqlen_k`` are never read from memory (the keys' scores are masked).
The three TMA descriptors are made in the kernel (128 bytes each, the runtime's global scratch).
PERSISTENT configs run ``attn_fwd_sm90``'s persistent schedule (programs looping over query tiles,
the slot ring and the consumers' turns carried from tile to tile).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from builder.kernels._gluon import reinterpret, tma_load
from builder.kernels.attention_sm90 import _band, _key_block, _pass_turn, _softmax, _take_turn, _tile_count, _tile_of

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


@gluon.jit
def _fp8_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free,
                start_m, lo, f1, f2, n1, n2, n, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Loader warp: both consumers' Q tiles, then every visited K block and V^T block (keys
    ``start_n ...`` are V^T's columns) into the slot ring, each once its slot is free."""
    HALF: gl.constexpr = q_smem.shape[1]
    for c in gl.static_range(2):
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        tma_load(q_desc, [start_m + c * HALF, 0], q_bar.index(c), q_smem.index(c))
    for idx in range(n):
        s = idx % STAGES
        # A fresh barrier counts as having completed the phase before its first: the first pass
        # over the ring does not wait.
        mbarrier.wait(kv_free.index(s), ((idx // STAGES) & 1) ^ 1)
        start_n = _key_block(idx, lo, f1, f2, n1, n2, BLOCK_N)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma_load(k_desc, [start_n, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma_load(v_desc, [0, start_n], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _p_operand(p, fp8: gl.constexpr, p_layout: gl.constexpr, KEY_ORDER: gl.constexpr):
    """The P·V wgmma's register operand from the P a step carries (:func:`_p_carried`).
    KEY_ORDER=1: P (fp32, the accumulator layout of Q·K^T) with its columns taken in
    attn_fp8_v_transpose's key order (column ``16h + 4q + 2j + e`` of the result is key
    ``16h + 8j + 2q + e`` of P), which puts each probability where the thread that computed it
    must hand it to the wgmma: the layout conversion moves nothing (checked when the kernel
    compiles), and each register's four e4m3 bytes come from two paired conversions. It is
    rounded here, just before the wgmma that reads it, because P carried from one step to the
    next in e4m3 is held a byte a register and packed again at the wgmma (112 PRMT and 64 LOP3 a
    key block per thread at D=128). KEY_ORDER=0: P already e4m3 in the operand layout."""
    if KEY_ORDER == 1:
        HALF: gl.constexpr = p.shape[0]
        BLOCK_N: gl.constexpr = p.shape[1]
        # Every visited block starts at a multiple of BLOCK_N (_band), so its groups of 32 keys are V^T's.
        gl.static_assert(BLOCK_N % 32 == 0, "attn_fwd_fp8_sm90: KEY_ORDER=1 takes keys in groups of 32")
        p = gl.permute(p.reshape(HALF, BLOCK_N // 32, 2, 2, 4, 2), 0, 1, 2, 4, 3, 5).reshape(HALF, BLOCK_N)
        p = gl.convert_layout(p, p_layout, assert_trivial=True)
        # Four probabilities a register, rounded to nearest (as p.to(fp8)): two cvt's of a pair each.
        gl.static_assert(fp8 == gl.float8e4nv, "attn_fwd_fp8_sm90: KEY_ORDER=1 packs OCP e4m3")
        p = gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [p], dtype=gl.float8e4nv, is_pure=True, pack=4)
    return p


@gluon.jit
def _p_carried(p32, fp8: gl.constexpr, p_layout: gl.constexpr, KEY_ORDER: gl.constexpr):
    """The softmax's P (fp32) as a step carries it to the next step's P·V: as it is in KEY_ORDER=1
    (:func:`_p_operand` rounds it there), else rounded to e4m3 and moved into the operand layout
    (byte permutes and warp shuffles)."""
    p = p32
    if KEY_ORDER == 0:
        p = gl.convert_layout(p32.to(fp8), p_layout)
    return p


@gluon.jit
def _vt_keys(len_k, KEY_ORDER: gl.constexpr):
    """V^T's columns the forward reads: the keys, rounded up to 32 in KEY_ORDER=1 (a key's column
    may lie past seqlen_k within its group of 32; the pre-pass writes zeros past the keys)."""
    if KEY_ORDER == 1:
        return (len_k + 31) // 32 * 32
    return len_k


@gluon.jit
def _fp8_step(idx, c: gl.constexpr, acc, p, l_i, m_i, q, k_smem, v_smem, k_ready, v_ready, kv_free, turn, s_zero,
              rows, cols, len_k, diag, left, right, qk_scale, lo, f1, f2, n1, n2, ring, turns,
              MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              PINGPONG: gl.constexpr, SPLIT: gl.constexpr, p_layout: gl.constexpr, o_layout: gl.constexpr,
              KEY_ORDER: gl.constexpr):
    """One pipelined key block idx >= 1 of consumer c: issue S_idx = Q·K_idx^T and O += P_{idx-1}·V_{idx-1},
    softmax S_idx while P·V runs, then rescale O and free slot idx-1. ring: the ring position of
    the tile's block 0; turns: the consumer's matmul groups before the tile."""
    it = ring + idx
    s = it % STAGES
    prev = (it - 1) % STAGES
    k = k_smem.index(s).permute((1, 0))
    v = v_smem.index(prev).permute((1, 0))
    _take_turn(turn, turns + idx, c, PINGPONG)
    mbarrier.wait(k_ready.index(s), (it // STAGES) & 1)
    s_acc = warpgroup_mma(q, k, s_zero, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
    acc = warpgroup_mma(_p_operand(p, q.dtype, p_layout, KEY_ORDER), v, acc, is_async=True)
    _pass_turn(turn, c, PINGPONG)
    # Groups retire in order: one outstanding means S_idx is done and P.V may still run.
    s_acc = warpgroup_mma_wait(1, deps=(s_acc,))
    start_n = _key_block(idx, lo, f1, f2, n1, n2, BLOCK_N)
    p32, m_i, alpha = _softmax(s_acc, m_i, start_n, rows, cols, len_k, diag, left, right, qk_scale,
                               qk_scale, qk_scale, MASKED, CAUSAL, False, SPLIT)
    l_i = l_i * alpha + gl.sum(p32, 1)
    p = _p_carried(p32, q.dtype, p_layout, KEY_ORDER)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(kv_free.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return acc, p, l_i, m_i


@gluon.jit
def _fp8_consumer(c: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, turn,
                  O_head, L_head, stride_om, start_m, len_q, len_k, qk_scale, v_scale, diag, left, right,
                  lo, f1, f2, n1, n2, n,
                  CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                  SPLIT: gl.constexpr, KEY_ORDER: gl.constexpr):
    """Consumer warp group c of a one-tile program (see _fp8_attend)."""
    _fp8_attend(c, q_smem, k_smem, v_smem, q_bar, q_bar, k_ready, v_ready, kv_free, turn, O_head, L_head,
                stride_om, start_m, len_q, len_k, qk_scale, v_scale, diag, left, right, lo, f1, f2, n1, n2, n,
                0, 0, 0, CAUSAL, BLOCK_N, STAGES, PINGPONG, SPLIT, False, KEY_ORDER)


@gluon.jit
def _fp8_attend(c: gl.constexpr, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, turn,
                O_head, L_head, stride_om, start_m, len_q, len_k, qk_scale, v_scale, diag, left, right,
                lo, f1, f2, n1, n2, n, ring, turns, q_phase,
                CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                SPLIT: gl.constexpr, RELEASE_Q: gl.constexpr, KEY_ORDER: gl.constexpr):
    """Consumer warp group c's part of one query tile: rows ``start_m + c * HALF ...``, its n key
    blocks from ring position ``ring`` on (after ``turns`` matmul groups), then O (times
    ``v_scale``) and LSE of its rows stored. The tile's Q is the q_phase-th load into its Q slot;
    with RELEASE_Q the slot is handed back on q_free once the tile's last Q·K^T has retired (the
    persistent loader then loads the next tile's Q during the last P·V and the stores)."""
    HALF: gl.constexpr = q_smem.shape[1]
    BLOCK_D: gl.constexpr = q_smem.shape[2]
    fp8: gl.constexpr = q_smem.dtype
    out_dtype: gl.constexpr = O_head.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_D, 32])
    # The 8-bit A operand of wgmma: four consecutive k elements per 32-bit register.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
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
    if KEY_ORDER == 1:
        p = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
    else:
        p = gl.zeros([HALF, BLOCK_N], fp8, p_layout)
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
                                   qk_scale, qk_scale, True, CAUSAL, False, False)
        l_i = gl.sum(p32, 1)
        p = _p_carried(p32, fp8, p_layout, KEY_ORDER)

    # Steady state, masked blocks then unmasked ones.
    masked_end = gl.maximum(n1 + n2, 1)
    for idx in range(1, masked_end):
        acc, p, l_i, m_i = _fp8_step(idx, c, acc, p, l_i, m_i, q, k_smem, v_smem, k_ready, v_ready, kv_free, turn,
                                     s_zero, rows, cols, len_k, diag, left, right, qk_scale, lo, f1, f2, n1, n2,
                                     ring, turns, True, CAUSAL, BLOCK_N, STAGES, PINGPONG, SPLIT, p_layout, o_layout,
                                     KEY_ORDER)
    for idx in range(masked_end, n):
        acc, p, l_i, m_i = _fp8_step(idx, c, acc, p, l_i, m_i, q, k_smem, v_smem, k_ready, v_ready, kv_free, turn,
                                     s_zero, rows, cols, len_k, diag, left, right, qk_scale, lo, f1, f2, n1, n2,
                                     ring, turns, False, CAUSAL, BLOCK_N, STAGES, PINGPONG, SPLIT, p_layout, o_layout,
                                     KEY_ORDER)
    if RELEASE_Q:
        # Every Q.K^T of the tile has retired (each step waits for its S): Q's slot may be refilled.
        mbarrier.arrive(q_free.index(c), count=1)
    # Epilogue: the last block's P.V.
    if n > 0:
        last = ring + n - 1
        s = last % STAGES
        v = v_smem.index(s).permute((1, 0))
        _take_turn(turn, turns + n, c, PINGPONG)
        mbarrier.wait(v_ready.index(s), (last // STAGES) & 1)
        acc = warpgroup_mma(_p_operand(p, fp8, p_layout, KEY_ORDER), v, acc, is_async=True)
        _pass_turn(turn, c, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(kv_free.index(s), count=1)

    # Rows that saw no key output 0 and logsumexp -inf (attn_fwd_fp8's epilogue).
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    gl.store(L_head + rows, lse, mask=rows < len_q)
    factor = gl.convert_layout(v_scale / l_safe, gl.SliceLayout(1, o_layout))
    out = (acc * factor[:, None]).to(out_dtype)
    o_rows = start_m + c * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O_head + o_rows.to(gl.int64)[:, None] * stride_om + o_cols[None, :]
    gl.store(o_ptrs, out, mask=(o_rows < len_q)[:, None] & (o_cols >= 0)[None, :])


@gluon.jit
def _score_scale(q_descale, k_descale, stride_qdz, stride_qdh, stride_kdz, stride_kdh, off_b, off_hk, sm_scale):
    """The score scale of a (sequence, key/value head) in log2 units, ``sm_scale * dq * dk * LOG2E``,
    the descale factors read as attn_fwd_fp8 reads them."""
    b64 = off_b.to(gl.int64)
    hk64 = off_hk.to(gl.int64)
    dq = gl.load(q_descale + b64 * stride_qdz + hk64 * stride_qdh)
    dk = gl.load(k_descale + b64 * stride_kdz + hk64 * stride_kdh)
    return sm_scale * dq * dk * LOG2E


@gluon.jit
def _out_scale(v_descale, stride_vdz, stride_vdh, off_b, off_hk):
    """V's descale factor of a (sequence, key/value head): the output's scale."""
    return gl.load(v_descale + off_b.to(gl.int64) * stride_vdz + off_hk.to(gl.int64) * stride_vdh)


@gluon.jit
def _fp8_persistent_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free,
                           q_descale, k_descale, stride_qdz, stride_qdh, stride_kdz, stride_kdh,
                           num_m, tiles, num_heads_q, group, len_k, diag, left, right, sm_scale,
                           CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           PAIRS: gl.constexpr):
    """Loader warp of a persistent program: for each of its tiles, both consumers' Q (once they
    have handed their Q slot back) and every visited K and V^T block, through one slot ring whose
    positions (and so barrier phases) run on across tiles. The band of a tile depends on the sign
    of its descaled score scale (see _band), so the loader reads the descales too."""
    HALF: gl.constexpr = q_smem.shape[1]
    BLOCK_D: gl.constexpr = q_smem.shape[2]
    BLOCK_N_: gl.constexpr = k_smem.shape[1]
    fp8: gl.constexpr = q_smem.dtype
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    ring = pid * 0
    for j in range(_tile_count(pid, programs, tiles, PAIRS)):
        pid_m, pid_bh = _tile_of(j, pid, programs, num_m, CAUSAL, PAIRS)
        off_b = pid_bh // num_heads_q
        off_h = pid_bh % num_heads_q
        off_hk = off_h // group
        start_m = pid_m * BLOCK_M
        qk_scale = _score_scale(q_descale, k_descale, stride_qdz, stride_qdh, stride_kdz, stride_kdh, off_b, off_hk,
                                sm_scale)
        lo, f1, f2, n1, n2, n = _band(start_m, len_k, diag, left, right, qk_scale, CAUSAL, BLOCK_M, BLOCK_N)
        for c in gl.static_range(2):
            # The j-th use of the slot; a fresh barrier counts the phase before its first as done.
            mbarrier.wait(q_free.index(c), (j & 1) ^ 1)
            mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
            q_dst = reinterpret(q_smem.index(c), fp8, [1, 1, HALF, BLOCK_D], q_desc.layout)
            tma_load(q_desc, [off_b, off_h, start_m + c * HALF, 0], q_bar.index(c), q_dst)
        for idx in range(n):
            it = ring + idx
            s = it % STAGES
            mbarrier.wait(kv_free.index(s), ((it // STAGES) & 1) ^ 1)
            start_n = _key_block(idx, lo, f1, f2, n1, n2, BLOCK_N)
            k_dst = reinterpret(k_smem.index(s), fp8, [1, 1, BLOCK_N_, BLOCK_D], k_desc.layout)
            v_dst = reinterpret(v_smem.index(s), fp8, [1, 1, BLOCK_D, BLOCK_N_], v_desc.layout)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma_load(k_desc, [off_b, off_hk, start_n, 0], k_ready.index(s), k_dst)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma_load(v_desc, [off_b, off_hk, 0, start_n], v_ready.index(s), v_dst)
        ring += n


@gluon.jit
def _fp8_persistent_consumer(c: gl.constexpr, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, turn,
                             Out, LSE, stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                             q_descale, k_descale, v_descale, stride_qdz, stride_qdh, stride_kdz, stride_kdh,
                             stride_vdz, stride_vdh, num_m, tiles, num_heads_q, group, len_q, len_k, diag, left, right,
                             sm_scale, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             STAGES: gl.constexpr, PINGPONG: gl.constexpr, SPLIT: gl.constexpr, PAIRS: gl.constexpr,
                             KEY_ORDER: gl.constexpr):
    """Consumer warp group c of a persistent program: the loader's tiles in the same order, each
    with the one-tile consumer's pipeline and epilogue (_fp8_attend), ring position and ping-pong
    turns carried from tile to tile."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    ring = pid * 0
    turns = pid * 0
    for j in range(_tile_count(pid, programs, tiles, PAIRS)):
        pid_m, pid_bh = _tile_of(j, pid, programs, num_m, CAUSAL, PAIRS)
        off_b = pid_bh // num_heads_q
        off_h = pid_bh % num_heads_q
        off_hk = off_h // group
        start_m = pid_m * BLOCK_M
        O_head = Out + off_b.to(gl.int64) * stride_oz + off_h.to(gl.int64) * stride_oh
        L_head = LSE + off_b.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh
        qk_scale = _score_scale(q_descale, k_descale, stride_qdz, stride_qdh, stride_kdz, stride_kdh, off_b, off_hk,
                                sm_scale)
        dv = _out_scale(v_descale, stride_vdz, stride_vdh, off_b, off_hk)
        lo, f1, f2, n1, n2, n = _band(start_m, len_k, diag, left, right, qk_scale, CAUSAL, BLOCK_M, BLOCK_N)
        _fp8_attend(c, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, turn, O_head, L_head,
                    stride_om, start_m, len_q, len_k, qk_scale, dv, diag, left, right, lo, f1, f2, n1, n2, n,
                    ring, turns, j, CAUSAL, BLOCK_N, STAGES, PINGPONG, SPLIT, True, KEY_ORDER)
        ring += n
        turns += gl.where(n > 0, n + 1, 0)


@gluon.jit
def _attn_fwd_fp8_persistent(Q, K, V, Out, LSE, q_descale, k_descale, v_descale,
                             stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                             stride_vz, stride_vh, stride_vd, stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                             stride_qdz, stride_qdh, stride_kdz, stride_kdh, stride_vdz, stride_vdh,
                             batch, num_heads_q, num_heads_k, len_q, len_k, sm_scale, diag, left, right,
                             HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                             SPLIT: gl.constexpr, CONSUMER_REGS: gl.constexpr, KEY_ORDER: gl.constexpr):
    """attn_fwd_fp8_sm90 with PERSISTENT: programs loop over (query block, batch * head) tiles."""
    HALF: gl.constexpr = BLOCK_M // 2
    BLOCK_D: gl.constexpr = HEAD_DIM
    PAIRS: gl.constexpr = 2 if CAUSAL != 0 else 1
    fp8: gl.constexpr = Q.dtype.element_ty
    num_m = (len_q + BLOCK_M - 1) // BLOCK_M
    tiles = num_m * batch * num_heads_q

    # One 4-D (batch, head, row, column) descriptor per tensor serves every tile of the program.
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_D], fp8)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], fp8)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_D, BLOCK_N], fp8)
    q4_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, HALF, BLOCK_D], fp8)
    k4_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, BLOCK_D], fp8)
    v4_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_D, BLOCK_N], fp8)
    q_desc = tma.make_tensor_descriptor(Q, shape=[batch, num_heads_q, len_q, HEAD_DIM],
                                        strides=[stride_qz, stride_qh, stride_qm, 1],
                                        block_shape=[1, 1, HALF, BLOCK_D], layout=q4_layout)
    k_desc = tma.make_tensor_descriptor(K, shape=[batch, num_heads_k, len_k, HEAD_DIM],
                                        strides=[stride_kz, stride_kh, stride_kn, 1],
                                        block_shape=[1, 1, BLOCK_N, BLOCK_D], layout=k4_layout)
    v_desc = tma.make_tensor_descriptor(V, shape=[batch, num_heads_k, HEAD_DIM, _vt_keys(len_k, KEY_ORDER)],
                                        strides=[stride_vz, stride_vh, stride_vd, 1],
                                        block_shape=[1, 1, BLOCK_D, BLOCK_N], layout=v4_layout)

    q_smem = gl.allocate_shared_memory(fp8, [2, HALF, BLOCK_D], q_layout)
    k_smem = gl.allocate_shared_memory(fp8, [STAGES, BLOCK_N, BLOCK_D], k_layout)
    v_smem = gl.allocate_shared_memory(fp8, [STAGES, BLOCK_D, BLOCK_N], v_layout)
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
        (_fp8_persistent_consumer, (0, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, turn, Out,
                                    LSE, stride_oz, stride_oh, stride_om, stride_lz, stride_lh, q_descale, k_descale,
                                    v_descale, stride_qdz, stride_qdh, stride_kdz, stride_kdh, stride_vdz, stride_vdh,
                                    num_m, tiles, num_heads_q, group, len_q, len_k, diag, left, right, sm_scale,
                                    CAUSAL, BLOCK_M, BLOCK_N, STAGES, PINGPONG, SPLIT, PAIRS, KEY_ORDER)),
        (_fp8_persistent_consumer, (1, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, turn, Out,
                                    LSE, stride_oz, stride_oh, stride_om, stride_lz, stride_lh, q_descale, k_descale,
                                    v_descale, stride_qdz, stride_qdh, stride_kdz, stride_kdh, stride_vdz, stride_vdh,
                                    num_m, tiles, num_heads_q, group, len_q, len_k, diag, left, right, sm_scale,
                                    CAUSAL, BLOCK_M, BLOCK_N, STAGES, PINGPONG, SPLIT, PAIRS, KEY_ORDER)),
        (_fp8_persistent_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready,
                                  kv_free, q_descale, k_descale, stride_qdz, stride_qdh, stride_kdz, stride_kdh,
                                  num_m, tiles, num_heads_q, group, len_k, diag, left, right, sm_scale,
                                  CAUSAL, BLOCK_M, BLOCK_N, STAGES, PAIRS)),
    ], [4, 1], [CONSUMER_REGS, 24])


@gluon.jit
def attn_fwd_fp8_sm90(
    Q, K, V, Out, LSE, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vd,
    stride_oz, stride_oh, stride_om,
    stride_lz, stride_lh,
    stride_qdz, stride_qdh, stride_kdz, stride_kdh, stride_vdz, stride_vdh,
    batch, num_heads_q, num_heads_k, seqlen_q, seqlen_k,
    sm_scale, window_left, window_right, causal_align,
    HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PERSISTENT: gl.constexpr, EXP2_SPLIT: gl.constexpr = 0,
    KEY_ORDER: gl.constexpr = 0,
):
    """FP8 attention forward (see attn_fwd_fp8): Out = softmax(dq·dk · Q K^T * sm_scale, masked) (dv · V).

    Grid: (cdiv(seqlen_q, BLOCK_M), batch * num_heads_q, 1); causal programs run the heaviest
    query tile first. ``cu_seqlens_*`` are accepted (attn_fwd_fp8's argument list) and ignored:
    VARLEN is 0. V is V^T from ``attn_fp8_v_transpose`` (``HEAD_DIM_V`` rows of keys, ``stride_vd``
    apart). HEAD_DIM == HEAD_DIM_V, 64 or 128. BLOCK_M: two consumer warp groups of BLOCK_M / 2
    rows; BLOCK_N: keys per block; STAGES: K/V^T slots in the ring; PINGPONG: the consumers take
    turns issuing their matmuls; CONSUMER_REGS: registers per thread of a consumer warp group (the
    loader warp gets 24). PERSISTENT > 0: a grid of min(work units, PERSISTENT) programs, each
    looping over query tiles (attn_fwd_sm90's persistent schedule: causal heads pair a heavy and a
    light tile), its loader starting the next tile's loads while the consumers finish a tile.
    EXP2_SPLIT: unmasked key blocks compute half their exp2 on the FMA pipe (attn_fwd_sm90's
    _exp2_split): with FP8 matmuls at twice bf16's rate the special-function unit's exp2 is about
    as long as a block's matmuls.
    """
    gl.static_assert(VARLEN == 0, "attn_fwd_fp8_sm90: fixed lengths only (packed sequences run attn_fwd_fp8)")
    gl.static_assert(HEAD_DIM == HEAD_DIM_V, "attn_fwd_fp8_sm90: equal q.k and v head dims")
    gl.static_assert(BLOCK_M == 128, "attn_fwd_fp8_sm90: two consumer warp groups of 64 rows")
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
        _attn_fwd_fp8_persistent(Q, K, V, Out, LSE, q_descale, k_descale, v_descale,
                                 stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                                 stride_vz, stride_vh, stride_vd, stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                                 stride_qdz, stride_qdh, stride_kdz, stride_kdh, stride_vdz, stride_vdh,
                                 batch, num_heads_q, num_heads_k, len_q, len_k, sm_scale, diag, left, right,
                                 HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N, STAGES, PINGPONG, EXP2_SPLIT, CONSUMER_REGS,
                                 KEY_ORDER)
    else:
        _attn_fwd_fp8_tile(Q, K, V, Out, LSE, q_descale, k_descale, v_descale,
                           stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                           stride_vz, stride_vh, stride_vd, stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                           stride_qdz, stride_qdh, stride_kdz, stride_kdh, stride_vdz, stride_vdh,
                           num_heads_q, num_heads_k, len_q, len_k, sm_scale, diag, left, right,
                           HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N, STAGES, PINGPONG, EXP2_SPLIT, CONSUMER_REGS,
                           KEY_ORDER)


@gluon.jit
def _attn_fwd_fp8_tile(Q, K, V, Out, LSE, q_descale, k_descale, v_descale,
                       stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                       stride_vz, stride_vh, stride_vd, stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                       stride_qdz, stride_qdh, stride_kdz, stride_kdh, stride_vdz, stride_vdh,
                       num_heads_q, num_heads_k, len_q, len_k, sm_scale, diag, left, right,
                       HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                       SPLIT: gl.constexpr, CONSUMER_REGS: gl.constexpr, KEY_ORDER: gl.constexpr):
    """attn_fwd_fp8_sm90 without PERSISTENT: one program per (query tile, batch * head)."""
    HALF: gl.constexpr = BLOCK_M // 2
    BLOCK_D: gl.constexpr = HEAD_DIM
    fp8: gl.constexpr = Q.dtype.element_ty
    pid_m = gl.program_id(0)
    if CAUSAL != 0:
        # Heaviest query tile first: the light tiles fill the end of the grid (a shorter tail).
        pid_m = gl.num_programs(0) - 1 - pid_m
    pid_bh = gl.program_id(1)
    off_b = pid_bh // num_heads_q
    off_h = pid_bh % num_heads_q
    off_hk = off_h // (num_heads_q // num_heads_k)
    start_m = pid_m * BLOCK_M
    b64 = off_b.to(gl.int64)
    hk64 = off_hk.to(gl.int64)
    qk_scale = _score_scale(q_descale, k_descale, stride_qdz, stride_qdh, stride_kdz, stride_kdh, off_b, off_hk,
                            sm_scale)
    dv = _out_scale(v_descale, stride_vdz, stride_vdh, off_b, off_hk)

    Q_head = Q + b64 * stride_qz + off_h.to(gl.int64) * stride_qh
    K_base = K + b64 * stride_kz + hk64 * stride_kh
    V_base = V + b64 * stride_vz + hk64 * stride_vh
    O_head = Out + b64 * stride_oz + off_h.to(gl.int64) * stride_oh
    L_head = LSE + b64 * stride_lz + off_h.to(gl.int64) * stride_lh

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_D], fp8)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], fp8)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_D, BLOCK_N], fp8)
    q_desc = tma.make_tensor_descriptor(Q_head, shape=[len_q, HEAD_DIM], strides=[stride_qm, 1],
                                        block_shape=[HALF, BLOCK_D], layout=q_layout)
    k_desc = tma.make_tensor_descriptor(K_base, shape=[len_k, HEAD_DIM], strides=[stride_kn, 1],
                                        block_shape=[BLOCK_N, BLOCK_D], layout=k_layout)
    # V^T: HEAD_DIM rows of keys; columns past seqlen_k (past its 32-key group in KEY_ORDER=1) read as zeros.
    v_desc = tma.make_tensor_descriptor(V_base, shape=[HEAD_DIM, _vt_keys(len_k, KEY_ORDER)], strides=[stride_vd, 1],
                                        block_shape=[BLOCK_D, BLOCK_N], layout=v_layout)

    # _band's last argument only decides by its sign whether the unmasked path may run.
    lo, f1, f2, n1, n2, n = _band(start_m, len_k, diag, left, right, qk_scale, CAUSAL, BLOCK_M, BLOCK_N)

    q_smem = gl.allocate_shared_memory(fp8, [2, HALF, BLOCK_D], q_layout)
    k_smem = gl.allocate_shared_memory(fp8, [STAGES, BLOCK_N, BLOCK_D], k_layout)
    v_smem = gl.allocate_shared_memory(fp8, [STAGES, BLOCK_D, BLOCK_N], v_layout)
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
        mbarrier.init(kv_free.index(s), count=2)

    gl.warp_specialize([
        (_fp8_consumer, (0, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, turn, O_head, L_head,
                         stride_om, start_m, len_q, len_k, qk_scale, dv, diag, left, right, lo, f1, f2, n1, n2, n,
                         CAUSAL, BLOCK_N, STAGES, PINGPONG, SPLIT, KEY_ORDER)),
        (_fp8_consumer, (1, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, turn, O_head, L_head,
                         stride_om, start_m, len_q, len_k, qk_scale, dv, diag, left, right, lo, f1, f2, n1, n2, n,
                         CAUSAL, BLOCK_N, STAGES, PINGPONG, SPLIT, KEY_ORDER)),
        (_fp8_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free,
                       start_m, lo, f1, f2, n1, n2, n, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


# --------------------------------------------------------------------------------------------
# Registry declaration.
# --------------------------------------------------------------------------------------------

from aotriton_rt.ops.attention.family import FP8_OUT_DTYPES, FWD_FP8_SM90  # noqa: E402
from builder.kernels._attention_sets import GPUTEST_FP8_HEAD_DIMS, in_fp8_default_set  # noqa: E402
from builder.kernels.attention_fp8 import KERNELS as _PORTABLE  # noqa: E402
from builder.kernels.attention_fp8 import fp8_excluded  # noqa: E402
from builder.kernels.attention_sm90 import GRID as GRID_SM90  # noqa: E402
from builder.registry import ConfigDecl, KernelDecl  # noqa: E402 - declarations follow the kernel

#: Head dims compiled (the portable kernel keeps 256).
HEAD_DIMS = (64, 128)
#: (BLOCK_N, STAGES, PINGPONG, PERSISTENT) per head dim, the expected fastest first (unmeasured;
#: `bench/fp8.py --configs` times each). BLOCK_M is 128 (two 64-row consumers). Shared memory:
#: 2 x 64 rows of Q plus STAGES K and V^T blocks; in e4m3 a D=128, 128-key stage is 32 KB (half
#: the bf16 kernel's), so four stages take 144 KB.
#: 128-key blocks: 256-key ones compiled (Triton splits V^T's 256-byte-wide TMA box) but ptxas put
#: 190-850 stores a thread into local memory, and at D=128 fenced every wgmma on its own.
#: The persistent rows (PERSISTENT programs, one per SM of an H100 SXM / H200, looping over query
#: tiles: attn_fwd_sm90's schedule, which lifted its bf16 forward 7-39%) come last.
TILES = {128: ((128, 4, 1, 0), (128, 4, 0, 0), (128, 3, 1, 0), (128, 4, 1, 132), (128, 4, 0, 132)),
         64: ((128, 4, 1, 0), (128, 4, 0, 0), (128, 4, 1, 132), (128, 4, 0, 132))}
#: Registers per thread of each consumer warp group (setmaxnreg); the loader warp takes 24.
CONSUMER_REGS = 240


def fp8_sm90_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    """The tile table of the spec's head dim, then its first one-tile and first persistent rows
    again with EXP2_SPLIT (half of an unmasked block's exp2 on the FMA pipe), then the first row
    with the keys in order (``KEY_ORDER=0``: P moved into the P·V operand by byte permutes and warp
    shuffles, as before the key order; the others read ``attn_fp8_v_transpose``'s KEY_ORDER=1 V^T).
    num_warps is the default partition's (consumer 0); the compiled kernel runs 12 warps (two
    consumer groups and the loader's group), which the catalog records from the binary."""
    tiles = TILES[spec["HEAD_DIM"]]
    # EXP2_SPLIT is named only where it is 1 (the kernel's default is 0): the other configs keep
    # the parameters their tuning measurements name.
    split = [t for t in tiles if t[3] == 0][:1] + [t for t in tiles if t[3] != 0][:1]
    rows = [(0, 1, t) for t in tiles] + [(1, 1, t) for t in split] + [(0, 0, tiles[0])]
    return tuple(ConfigDecl(constexprs={"BLOCK_M": 128, "BLOCK_N": bn, "STAGES": st, "PINGPONG": pp,
                                        "CONSUMER_REGS": CONSUMER_REGS, "PERSISTENT": programs,
                                        **({"EXP2_SPLIT": 1} if twin else {}), "KEY_ORDER": order},
                            num_warps=4, num_stages=1, backends=("cuda",))
                 for twin, order, (bn, st, pp, programs) in rows)


#: The config the operator runs per head dim (the catalog rule of :func:`fp8_sm90_tuning`; else #0),
#: measured by ``python -m bench.fp8 --configs --rounds 6`` (B4 N4096 H32, bf16 out, an H100 SXM):
#: the persistent ping-pong tile, at D=128 #3 (1.677 ms without a mask and 1.074 causal against the
#: portable ``attn_fwd_fp8``'s 1.759 and 1.165; #0: 1.822 and 1.219), at D=64 #2 (1.280 and 0.793,
#: tied with the portable kernel's 1.286 and 0.794; #0: 1.367 and 0.924).
FASTEST = {128: 3, 64: 2}


def fp8_sm90_tuning(target: object) -> list[dict]:
    """The catalog's rules for ``target``: :data:`FASTEST`'s config per head dim on sm90."""
    if getattr(target, "arch", None) != "sm90":
        return []
    return [{"spec": {"HEAD_DIM": d}, "config": i, "source": "bench/fp8.py --configs"} for d, i in FASTEST.items()]


def default_fp8_sm90_configs(spec: dict, target: object) -> tuple[int, ...]:
    """The default set's config of a spec: the one the operator runs (:data:`FASTEST`)."""
    return (FASTEST.get(spec["HEAD_DIM"], 0),)


def _excluded(spec: dict, target: object) -> str | None:
    if target.backend != "cuda" or target.arch != "sm90":
        return f"{target.arch}: a Gluon kernel for sm90 only (other targets run attn_fwd_fp8)"
    if spec["HEAD_DIM"] != spec["HEAD_DIM_V"]:
        return "unequal head dims are not compiled for FP8"
    return fp8_excluded(spec, target)


def in_gputest_set(spec: dict, target: object) -> bool:
    """The GPU tests' variants: head dims 64 and 128, both outputs, every mask mode (mode 2 is what
    a bottom-right call prefers where the images hold it; mode 1 serves both alignments)."""
    return spec["HEAD_DIM"] in GPUTEST_FP8_HEAD_DIMS


#: attn_fwd_sm90's grid: one program per (query tile, batch * head) with PERSISTENT 0, else one
#: dimension of min(work units, PERSISTENT) programs (a unit is one query tile, or a heavy and a
#: light one with a mask).
GRID = GRID_SM90

_SIG = _PORTABLE[0].signature | {n: "constexpr" for n in ("STAGES", "PINGPONG", "CONSUMER_REGS", "PERSISTENT",
                                                          "EXP2_SPLIT", "KEY_ORDER")}
_SIG = {n: _SIG[n] for n in attn_fwd_fp8_sm90.arg_names}
# TMA descriptors need a non-empty extent in every dimension; a persistent program numbers the
# tiles in 32 bits; in KEY_ORDER=1 V^T's rows hold the keys rounded up to 32.
_CHECKS = _PORTABLE[0].checks + ("seqlen_q >= 1", "seqlen_k >= 1",
                                 "cdiv(seqlen_q, BLOCK_M) * batch * num_heads_q <= 1073741824",
                                 "KEY_ORDER == 0 or stride_vd >= cdiv(seqlen_k, 32) * 32")

KERNEL = KernelDecl(
    name=FWD_FP8_SM90,
    fn=attn_fwd_fp8_sm90,
    signature=_SIG,
    axes={"dtype": ("fp8e4nv",), "out_dtype": FP8_OUT_DTYPES, "HEAD_DIM": HEAD_DIMS, "HEAD_DIM_V": HEAD_DIMS,
          "CAUSAL": (0, 1, 2), "VARLEN": (0,)},
    configs=fp8_sm90_configs,
    grid=GRID,
    divisibility=dict(_PORTABLE[0].divisibility),
    exclude=_excluded,
    # The default set: the portable FP8 forward's dense default specs (D=128, bf16 out, modes 0 and 1)
    # in the config the operator runs; packed sequences stay on attn_fwd_fp8.
    sets={"default": in_fp8_default_set, "gputest": in_gputest_set},
    set_configs={"default": default_fp8_sm90_configs},
    tuning=fp8_sm90_tuning,
    checks=_CHECKS,
)
