"""FlashAttention-2 forward kernel, written for ahead-of-time compilation.

Every feature flag is a constexpr specialization axis (dtype, head-dim bucket, mask mode, bias,
dropout, varlen); block sizes, warps and stages are tuning configs. Nothing here depends on the
Triton JIT's run-time specialization: strides are explicit arguments (the head dimension must be
contiguous), integer 1 is never folded away, and unused pointers are passed as 0.

Conventions shared with `attention_bwd.py` and the operator (see docs/attention.md):

- Q, K, V, Out are addressed as ``base + b*stride_z + h*stride_h + m*stride_m + d``; with VARLEN the
  batch stride is ignored and rows start at ``cu_seqlens[b]`` (packed ``(total, heads, dim)``).
- Mask mode ``CAUSAL``: 0 none, 1 band aligned top-left, 2 band aligned bottom-right. Key ``j`` is
  visible from query ``i`` when ``i + diag - window_left <= j <= i + diag + window_right`` with
  ``diag = 0`` (top-left) or ``seqlen_k - seqlen_q`` (bottom-right); a negative window side means
  unbounded. Plain causal is ``window_left = -1, window_right = 0``.
- LSE is the natural-log logsumexp, fp32, at ``LSE + b*stride_lz + h*stride_lh + row`` where row is
  the packed row (``cu_seqlens_q[b] + i``) with VARLEN, else ``i``. Rows that see no key get -inf
  and a zero output.
- Dropout keeps element (i, j) of head (b, h) when the first Philox-4x32-10 word of counter
  ``(j, i, b*num_heads_q + h, philox_offset mod 2**32)`` under key ``philox_seed`` is
  ``>= dropout_p * 2**32``; kept values are scaled by ``1 / (1 - dropout_p)``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.random import philox as _philox

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

# Head-dim buckets the kernels are compiled for; a head dim between two buckets is zero-padded
# by the operator to the next one (zero columns change neither q.k nor the visible output).
HEAD_DIM_BUCKETS = (16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)
# (qk, v) head-dim pairs compiled besides the equal ones: MLA-style 192/128.
UNEQUAL_HEAD_DIMS = ((192, 128),)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (tl.arange needs power-of-two extents)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


# --------------------------------------------------------------------------------------------
# Shared device helpers (also used by the backward kernels).
# --------------------------------------------------------------------------------------------


@triton.jit
def _window(seqlen_q, seqlen_k, window_left, window_right, CAUSAL: tl.constexpr):
    """Band of visible keys as (diag, left, right): j - i - diag in [-left, right]."""
    if CAUSAL == 2:
        diag = seqlen_k - seqlen_q
    else:
        diag = seqlen_k * 0
    # A negative side is unbounded; seqlen_q + seqlen_k is wider than any real distance.
    unbounded = seqlen_q + seqlen_k
    left = tl.where(window_left < 0, unbounded, window_left)
    right = tl.where(window_right < 0, unbounded, window_right)
    return diag, left, right


@triton.jit
def _span(a0, A_BLOCK: tl.constexpr, len_b, diag, left, right, B_BLOCK: tl.constexpr):
    """Split the B axis, seen from rows a0..a0+A_BLOCK-1 of the A axis, into three B-block ranges.

    Rows index the A axis, the band is ``a + diag - left <= b <= a + diag + right``. Returns
    (lo, f1, f2, hi): blocks in [lo, f1) and [f2, hi) need masks, blocks in [f1, f2) are visible for
    every row and lie inside ``len_b`` so they run without any mask. lo, f1, f2 are multiples of
    B_BLOCK. The backward dk/dv pass calls this with the axes swapped (diag -> -diag, sides swapped).
    """
    lo = tl.maximum(a0 + diag - left, 0)
    lo = lo // B_BLOCK * B_BLOCK
    hi = tl.minimum(a0 + A_BLOCK + diag + right, len_b)
    hi = tl.maximum(hi, lo)
    hi_up = (hi + B_BLOCK - 1) // B_BLOCK * B_BLOCK
    full_lo = tl.maximum(a0 + A_BLOCK - 1 + diag - left, 0)
    full_lo = (full_lo + B_BLOCK - 1) // B_BLOCK * B_BLOCK
    full_hi = tl.minimum(a0 + diag + right + 1, len_b)
    full_hi = tl.maximum(full_hi, 0) // B_BLOCK * B_BLOCK
    f1 = tl.minimum(tl.maximum(full_lo, lo), hi_up)
    f2 = tl.minimum(tl.maximum(full_hi, f1), hi_up)
    return lo, f1, f2, hi


@triton.jit
def _dropout_keep(philox_seed, philox_offset, bh, rows, cols, dropout_p):
    """Keep-mask of a tile; rows / cols are broadcastable 2-D query / key indices.

    The forward and both backward passes call it with the same counters, whatever their tile
    orientation, so a (seed, offset) pair gives one mask everywhere.
    """
    zero = (rows * 0 + cols * 0).to(tl.uint32)
    c0 = zero + cols.to(tl.uint32)
    c1 = zero + rows.to(tl.uint32)
    c2 = zero + bh.to(tl.uint32)
    c3 = zero + philox_offset.to(tl.uint32)
    r, _, _, _ = _philox(philox_seed, c0, c1, c2, c3)
    # Threshold in fp32 is exact enough: p is quantised to 2**-24 relative.
    threshold = tl.cast(dropout_p * 4294967296.0, tl.int64)
    threshold = tl.minimum(threshold, 4294967295).to(tl.uint32)
    return r >= threshold


# --------------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------------


@triton.jit
def _fwd_blocks(
    acc, l_i, m_i, q,
    K_base, V_base, B_base, DM_base,
    stride_kn, stride_vn, stride_bm, stride_dmm,
    start, end,
    offs_m, rows_b, offs_n, offs_dk, offs_dv,
    seqlen_q, seqlen_k, diag, left, right, qk_scale,
    philox_seed, philox_offset, bh, dropout_p,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) over key blocks start, start+BLOCK_N, ... < end."""
    BLOCK_DK: tl.constexpr = q.shape[1]
    BLOCK_DV: tl.constexpr = acc.shape[1]
    # K is read transposed, (dim, keys), so q @ k needs no layout change in registers.
    k_ptrs = K_base + offs_n[None, :] * stride_kn + offs_dk[:, None] + start * stride_kn
    v_ptrs = V_base + offs_n[:, None] * stride_vn + offs_dv[None, :] + start * stride_vn
    if BIAS != 0:
        b_ptrs = B_base + rows_b[:, None] * stride_bm + offs_n[None, :] + start
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if MASKED:
            kmask = cols[None, :] < seqlen_k
            if HEAD_DIM != BLOCK_DK:
                kmask = kmask & (offs_dk[:, None] < HEAD_DIM)
            k = tl.load(k_ptrs, mask=kmask, other=0.0)
        elif HEAD_DIM != BLOCK_DK:
            k = tl.load(k_ptrs, mask=offs_dk[:, None] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_ptrs)
        qk = tl.dot(q, k, input_precision=PREC) * qk_scale
        if BIAS != 0:
            if MASKED:
                bias = tl.load(b_ptrs, mask=cols[None, :] < seqlen_k, other=0.0)
            else:
                bias = tl.load(b_ptrs)
            qk += bias.to(tl.float32) * LOG2E
        if MASKED:
            visible = cols[None, :] < seqlen_k
            if CAUSAL != 0:
                rel = cols[None, :] - offs_m[:, None] - diag
                visible = visible & (rel >= -left) & (rel <= right)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASKED or BIAS != 0:
            # A row that has seen only masked keys keeps m = -inf; subtract 0 instead (no NaN).
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT != 0:
            keep = _dropout_keep(philox_seed, philox_offset, bh, offs_m[:, None], cols[None, :],
                                 dropout_p)
            if DROPOUT == 2:
                dm_ptrs = DM_base + offs_m[:, None] * stride_dmm + cols[None, :]
                tl.store(dm_ptrs, keep.to(tl.int8),
                         mask=(offs_m[:, None] < seqlen_q) & (cols[None, :] < seqlen_k))
            p = tl.where(keep, p, 0.0)
        if MASKED:
            vmask = cols[:, None] < seqlen_k
            if HEAD_DIM_V != BLOCK_DV:
                vmask = vmask & (offs_dv[None, :] < HEAD_DIM_V)
            v = tl.load(v_ptrs, mask=vmask, other=0.0)
        elif HEAD_DIM_V != BLOCK_DV:
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
        if BIAS != 0:
            b_ptrs += BLOCK_N
    return acc, l_i, m_i


@triton.jit
def attn_fwd(
    Q, K, V, Bias, Out, LSE, DropMask, cu_seqlens_q, cu_seqlens_k,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    stride_bz, stride_bh, stride_bm,
    stride_lz, stride_lh,
    stride_dmz, stride_dmh, stride_dmm,
    batch, num_heads_q, num_heads_k, seqlen_q, seqlen_k,
    sm_scale, dropout_p, philox_seed, philox_offset, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    CAUSAL: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Attention forward: Out = softmax(Q K^T * sm_scale + Bias, masked) V and its logsumexp.

    Grid: (cdiv(seqlen_q, BLOCK_M), batch * num_heads_q, 1). With VARLEN, seqlen_q / seqlen_k are
    the maxima over the batch and the per-sequence lengths come from cu_seqlens_q / cu_seqlens_k.
    GQA: query head h reads key/value head h // (num_heads_q // num_heads_k). Bias is indexed by
    (b, h, i, j) with unit stride over j (stride 0 broadcasts a dimension). DROPOUT: 0 off, 1 on,
    2 on and the applied keep-mask is written to DropMask (int8, unit stride over j).
    """
    PREC: tl.constexpr = "ieee" if Q.dtype.element_ty == tl.float32 else "tf32"
    BLOCK_DK: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    BLOCK_DV: tl.constexpr = triton.next_power_of_2(HEAD_DIM_V)

    num_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    if CAUSAL != 0:
        # Heavier query blocks (more visible keys) start first: a shorter tail under causal.
        pid_m = num_m_blocks - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // num_heads_q
    off_h = pid_bh % num_heads_q
    off_hk = off_h // (num_heads_q // num_heads_k)

    if VARLEN:
        q_start = tl.load(cu_seqlens_q + off_b)
        len_q = tl.load(cu_seqlens_q + off_b + 1) - q_start
        k_start = tl.load(cu_seqlens_k + off_b)
        len_k = tl.load(cu_seqlens_k + off_b + 1) - k_start
        off_bz = off_b.to(tl.int64) * 0
    else:
        q_start = 0
        len_q = seqlen_q
        k_start = 0
        len_k = seqlen_k
        off_bz = off_b.to(tl.int64)
    start_m = pid_m * BLOCK_M
    if start_m >= len_q:
        return

    Q_base = Q + off_bz * stride_qz + off_h.to(tl.int64) * stride_qh + \
        (q_start + start_m).to(tl.int64) * stride_qm
    K_base = K + off_bz * stride_kz + off_hk.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
    V_base = V + off_bz * stride_vz + off_hk.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
    O_base = Out + off_bz * stride_oz + off_h.to(tl.int64) * stride_oh + \
        (q_start + start_m).to(tl.int64) * stride_om
    B_base = Bias
    if BIAS != 0:
        B_base = Bias + off_b.to(tl.int64) * stride_bz + off_h.to(tl.int64) * stride_bh
    DM_base = DropMask
    if DROPOUT == 2:
        DM_base = DropMask + off_b.to(tl.int64) * stride_dmz + off_h.to(tl.int64) * stride_dmh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    # Bias rows past the sequence are clamped rather than masked so the unmasked loop stays lean.
    rows_b = tl.minimum(offs_m, len_q - 1)

    qmask = offs_m[:, None] < len_q
    if HEAD_DIM != BLOCK_DK:
        qmask = qmask & (offs_dk[None, :] < HEAD_DIM)
    q = tl.load(Q_base + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_dk[None, :], mask=qmask,
                other=0.0)

    qk_scale = sm_scale * LOG2E
    bh = off_b * num_heads_q + off_h
    diag, left, right = _window(len_q, len_k, window_left, window_right, CAUSAL)
    if CAUSAL != 0:
        lo, f1, f2, hi = _span(start_m, BLOCK_M, len_k, diag, left, right, BLOCK_N)
    else:
        lo = 0
        f1 = 0
        f2 = len_k // BLOCK_N * BLOCK_N
        hi = len_k

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if CAUSAL != 0:
        acc, l_i, m_i = _fwd_blocks(
            acc, l_i, m_i, q, K_base, V_base, B_base, DM_base,
            stride_kn, stride_vn, stride_bm, stride_dmm, lo, f1,
            offs_m, rows_b, offs_n, offs_dk, offs_dv,
            len_q, len_k, diag, left, right, qk_scale,
            philox_seed, philox_offset, bh, dropout_p,
            True, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PREC)
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, K_base, V_base, B_base, DM_base,
        stride_kn, stride_vn, stride_bm, stride_dmm, f1, f2,
        offs_m, rows_b, offs_n, offs_dk, offs_dv,
        len_q, len_k, diag, left, right, qk_scale,
        philox_seed, philox_offset, bh, dropout_p,
        False, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PREC)
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, K_base, V_base, B_base, DM_base,
        stride_kn, stride_vn, stride_bm, stride_dmm, f2, hi,
        offs_m, rows_b, offs_n, offs_dk, offs_dv,
        len_q, len_k, diag, left, right, qk_scale,
        philox_seed, philox_offset, bh, dropout_p,
        True, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PREC)

    # Epilogue: rows that saw no key have l = 0; they output 0 and logsumexp -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    inv_l = 1.0 / l_safe
    if DROPOUT != 0:
        inv_l = inv_l / (1.0 - dropout_p)
    acc = acc * inv_l[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    row_ok = offs_m < len_q
    L_base = LSE + off_b.to(tl.int64) * stride_lz + off_h.to(tl.int64) * stride_lh + q_start
    tl.store(L_base + offs_m, lse, mask=row_ok)
    omask = row_ok[:, None]
    if HEAD_DIM_V != BLOCK_DV:
        omask = omask & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(O_base + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_dv[None, :],
             acc.to(Out.dtype.element_ty), mask=omask)
