"""FlashAttention-2 forward kernel, written for ahead-of-time compilation.

Every feature flag is a constexpr specialization axis (dtype, head-dim bucket, mask mode, bias,
dropout, varlen); block sizes, warps and stages are tuning configs. Nothing here depends on the
Triton JIT's run-time specialization: strides are explicit arguments (the head dimension must be
contiguous), integer 1 is never folded away, and unused pointers are passed as 0.

Conventions shared with `attention_bwd.py` and the operator (see docs/attention.md):

- Q, K, V, Out are addressed as ``base + b*stride_z + h*stride_h + m*stride_m + d``; with VARLEN the
  batch stride is ignored and rows start at ``cu_seqlens[b]`` (packed ``(total, heads, dim)``).
- Mask mode ``CAUSAL``: 0 none, 1 band aligned by the run-time argument ``causal_align`` (0
  top-left, 1 bottom-right), 2 band aligned bottom-right (``causal_align`` ignored: images built
  before the argument existed compiled 1 as top-left only). Key ``j`` is visible from query ``i``
  when ``i + diag - window_left <= j <= i + diag + window_right`` with ``diag = 0`` (top-left) or
  ``seqlen_k - seqlen_q`` (bottom-right), per sequence under VARLEN; a negative window side means
  unbounded. Plain causal is ``window_left = -1, window_right = 0``. One compiled mode-1 kernel
  serves both alignments: the alignment costs a multiply, not a second compile.
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
# Causal backward programs per scheduling group (see _causal_order): about one wave of 2-CTA/SM
# programs.
CAUSAL_GROUP_PROGRAMS: tl.constexpr = tl.constexpr(256)

# Head-dim buckets the kernels are compiled for (a head dim between two buckets is zero-padded by
# the operator to the next one: zero columns change neither q.k nor the visible output), the
# (qk, v) pairs compiled besides the equal ones (MLA-style 192/128) and the dtypes: the family's,
# which the runtime dispatches by. (Kept at five lines: a kernel's key includes its line number.)
from aotriton_rt.ops.attention.family import DTYPES, FWD, HEAD_DIM_BUCKETS, UNEQUAL_HEAD_DIMS  # noqa: E402


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (tl.arange needs power-of-two extents)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


# --------------------------------------------------------------------------------------------
# Shared device helpers (also used by the backward kernels).
# --------------------------------------------------------------------------------------------


@triton.jit
def _window(seqlen_q, seqlen_k, window_left, window_right, causal_align, CAUSAL: tl.constexpr):
    """Band of visible keys as (diag, left, right): j - i - diag in [-left, right]. The lengths are
    the sequence's own (per sequence under VARLEN), so a bottom-right band aligns each one."""
    if CAUSAL == 2:
        diag = seqlen_k - seqlen_q
    elif CAUSAL == 1:
        # 0 top-left, 1 bottom-right (the catalog's checks refuse anything else).
        diag = causal_align * (seqlen_k - seqlen_q)
    else:
        diag = seqlen_k * 0
    # A negative side is unbounded; seqlen_q + seqlen_k is wider than any real distance.
    unbounded = seqlen_q + seqlen_k
    left = tl.where(window_left < 0, unbounded, window_left)
    right = tl.where(window_right < 0, unbounded, window_right)
    return diag, left, right


@triton.jit
def _sequence(cu_seqlens, off_b, seqlen, VARLEN: tl.constexpr):
    """(first row, length) of batch entry off_b: its packed rows from cu_seqlens with VARLEN, else
    (0, seqlen). With VARLEN the batch stride is ignored: callers scale off_b by (1 - VARLEN)."""
    if VARLEN:
        start = tl.load(cu_seqlens + off_b)
        length = tl.load(cu_seqlens + off_b + 1) - start
    else:
        start = 0
        length = seqlen
    return start, length


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
def _causal_order(num_blocks, num_bh, HEAVY_LAST: tl.constexpr):
    """(block along axis 0, batch*head) of this program under a causal mask: longest first.

    The hardware starts programs in linear order (axis 0 fastest). Taken in that order, programs
    cover groups of heads, and inside a group every head's heaviest block before any lighter one,
    so the lightest blocks finish the grid (longest-processing-time order: a short tail). The
    heaviest block is the last one (HEAVY_LAST: query blocks see the most keys) or the first (key
    blocks of the backward see the most queries). Groups hold about CAUSAL_GROUP_PROGRAMS
    programs, so the heads in flight at once stay few and their K/V stay in L2.
    """
    lin = tl.program_id(1).to(tl.int64) * num_blocks + tl.program_id(0)
    heads = tl.maximum(CAUSAL_GROUP_PROGRAMS // num_blocks, 1)
    per_group = heads * num_blocks
    group = lin // per_group
    first = group * heads
    size = tl.minimum(heads, num_bh - first)
    rem = lin - group * per_group
    pid = rem // size
    if HEAVY_LAST:
        pid = num_blocks - 1 - pid
    pid_bh = first + rem % size
    return pid.to(tl.int32), pid_bh.to(tl.int32)


@triton.jit
def _tanh(x):
    """tanh(x) as 1 - 2 / (1 + e^2x): one exp2 and one fast (non-IEEE, ~2 ulp: Triton's fp32 ``/``,
    the same binary as ``tl.fdiv(..., ieee_rounding=False)`` on sm90 and gfx942) division, ~1e-7
    absolute everywhere; e^2x overflowing to inf gives 1, underflowing to 0 gives -1 (HIP and CUDA)."""
    return 1.0 - 2.0 / (1.0 + tl.math.exp2((2.0 * LOG2E) * x))


@triton.jit
def _softcapped(qk, qk_scale, softcap):
    """Raw scores ``q.k`` made softcapped so that the caller's ``* qk_scale`` (sm_scale * LOG2E)
    gives ``softcap * tanh(q.k * sm_scale / softcap)`` in log2 units (FlashAttention-2's softcap,
    before the bias and the masks). Needs ``qk_scale != 0`` and ``softcap > 0``. The scales fold
    into :func:`_tanh`'s two constants: one multiply, exp2, add, fast division and subtract per
    score (absolute error ~1e-7 * softcap in logits)."""
    c = softcap * LOG2E / qk_scale
    return c - 2.0 * c / (1.0 + tl.math.exp2(qk * (2.0 * qk_scale / softcap)))


@triton.jit
def _softcapped_fast(qk, qk_scale, softcap):
    """``tanh(q.k * sm_scale / softcap)`` with the hardware tanh (``tanh.approx.f32``, CUDA only;
    relative error at most 2^-10.99, as sm90's Gluon forward and FlashAttention-2 and -3 cap
    logits): one special-function operation a score where :func:`_softcapped` takes two (an exp2
    and a division's reciprocal). Unlike _softcapped it leaves the cap to the caller's scale:
    ``softcap * LOG2E`` in qk_scale's place takes it to log2 units (one multiply a score less)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [qk * (qk_scale / (softcap * LOG2E))],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _alibi_factor(alibi_slopes, stride_az, off_b, off_h, ALIBI: tl.constexpr):
    """``-slope * LOG2E`` of query head off_h of sequence off_b: the factor of :func:`_alibi` in the
    kernels' log2 units (scores are multiplied by ``sm_scale * LOG2E`` before exp2). Slopes are fp32,
    ``alibi_slopes[off_b * stride_az + off_h]`` (stride_az 0: shared by the batch). 0 without ALIBI
    (never read then: the slopes pointer may be 0)."""
    if ALIBI:
        factor = tl.load(alibi_slopes + off_b.to(tl.int64) * stride_az + off_h) * -LOG2E
    else:
        factor = tl.full([], 0.0, tl.float32)
    return factor


@triton.jit
def _alibi(alibi_k, rows, cols, len_q, len_k):
    """FlashAttention-2's ALiBi term of a tile in log2 units, ``alibi_k * |i + len_k - len_q - j|``
    (``alibi_k`` from :func:`_alibi_factor`): query row i and key j aligned bottom-right, whatever
    the mask's alignment. ``rows`` / ``cols`` are broadcastable 2-D positions in the sequence
    (per sequence under VARLEN, as len_q / len_k are)."""
    return alibi_k * tl.abs(rows - cols + (len_k - len_q)).to(tl.float32)


@triton.jit
def _fwd_block(
    acc, l_i, m_i, q, start_n, k_ptrs, v_ptrs, b_ptrs, k_desc, v_desc, DM_base, stride_dmm,
    offs_m, offs_n, offs_dk, offs_dv, seqlen_q, seqlen_k, diag, left, right, qk_scale,
    philox_seed, philox_offset, bh, dropout_p, softcap, alibi_k,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, PREC: tl.constexpr, USE_TMA: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) by the key block at start_n.

    m_i is the running row maximum in log2 units (-inf until a row sees a visible key), l_i the
    running sum of exp2(score - m_i), acc the unnormalised output. k_ptrs / v_ptrs / b_ptrs point
    at this block; with USE_TMA, K and V come through device-side tensor descriptors (Hopper TMA)
    instead, which zero-fill past the sequence and the head dim, so no load mask is needed. An
    unmasked block without bias needs ``qk_scale >= 0`` (attn_fwd sends every block of a negative
    scale through the masked path).
    """
    BLOCK_DK: tl.constexpr = q.shape[1]
    BLOCK_DV: tl.constexpr = acc.shape[1]
    cols = start_n + offs_n
    if USE_TMA:
        # V is requested with K: a TMA load lands in shared memory, so it costs no registers, and
        # waiting for it here keeps the loop's only cross-warp-group barrier at the loop top
        # (waited for after the softmax, it splits the two warp groups of an 8-warp tile there).
        k = k_desc.load([start_n, 0]).T
        v = v_desc.load([start_n, 0])
    elif MASKED:
        kmask = cols[None, :] < seqlen_k
        if HEAD_DIM != BLOCK_DK:
            kmask = kmask & (offs_dk[:, None] < HEAD_DIM)
        k = tl.load(k_ptrs, mask=kmask, other=0.0)
    elif HEAD_DIM != BLOCK_DK:
        k = tl.load(k_ptrs, mask=offs_dk[:, None] < HEAD_DIM, other=0.0)
    else:
        k = tl.load(k_ptrs)
    qk = tl.dot(q, k, input_precision=PREC)
    if SOFTCAP == 2:  # FAST_TANH (CUDA configs only)
        qk = _softcapped_fast(qk, qk_scale, softcap)
        qk_scale = softcap * LOG2E
    elif SOFTCAP:
        qk = _softcapped(qk, qk_scale, softcap)
    if MASKED and CAUSAL == 0 and BIAS == 0 and ALIBI == 0:
        # Only the sequence end masks: one FMA per score applies the scale and a per-key -inf.
        key_bias = tl.where(offs_n < seqlen_k - start_n, 0.0, float("-inf"))
        qk = qk * qk_scale + key_bias[None, :]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
    elif MASKED or BIAS != 0 or ALIBI != 0:
        # A bias (a tensor's or ALiBi's) varies along the row: the scale goes on every score.
        qk = qk * qk_scale
        if BIAS != 0:
            if MASKED:
                bias = tl.load(b_ptrs, mask=cols[None, :] < seqlen_k, other=0.0)
            else:
                bias = tl.load(b_ptrs)
            qk += bias.to(tl.float32) * LOG2E
        if ALIBI != 0:
            qk += _alibi(alibi_k, offs_m[:, None], cols[None, :], seqlen_q, seqlen_k)
        if MASKED:
            if CAUSAL != 0:
                # The sequence end folds into each row's right edge: j < seqlen_k is
                # j - i - diag <= seqlen_k - 1 - i - diag.
                rel = cols[None, :] - offs_m[:, None] - diag
                right_i = tl.minimum(right, seqlen_k - 1 - diag - offs_m)
                visible = (rel >= -left) & (rel <= right_i[:, None])
            else:
                visible = offs_n[None, :] < seqlen_k - start_n
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen only masked keys keeps m = -inf and subtracts 0 (no NaN); its p and
        # l stay 0, and its first visible key sets m exactly.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
    else:
        # Steady state: the scale goes on the row maximum (exact for a non-negative scale, as
        # rounding is monotonic), so each score costs one FMA on its way into exp2.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    l_ij = tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DROPOUT != 0:
        keep = _dropout_keep(philox_seed, philox_offset, bh, offs_m[:, None], cols[None, :], dropout_p)
        if DROPOUT == 2:
            dm_ptrs = DM_base + offs_m[:, None] * stride_dmm + cols[None, :]
            tl.store(dm_ptrs, keep.to(tl.int8),
                     mask=(offs_m[:, None] < seqlen_q) & (cols[None, :] < seqlen_k))
        p = tl.where(keep, p, 0.0)
    if USE_TMA:
        pass
    elif MASKED:
        vmask = cols[:, None] < seqlen_k
        if HEAD_DIM_V != BLOCK_DV:
            vmask = vmask & (offs_dv[None, :] < HEAD_DIM_V)
        v = tl.load(v_ptrs, mask=vmask, other=0.0)
    elif HEAD_DIM_V != BLOCK_DV:
        v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
    # Updated after the P.V issue: fewer registers live across the dot.
    l_i = l_i * alpha + l_ij
    return acc, l_i, m_new


@triton.jit
def _fwd_blocks(
    acc, l_i, m_i, q,
    K_base, V_base, B_base, DM_base, k_desc, v_desc,
    stride_kn, stride_vn, stride_bm, stride_dmm,
    start, end,
    offs_m, rows_b, offs_n, offs_dk, offs_dv,
    seqlen_q, seqlen_k, diag, left, right, qk_scale,
    philox_seed, philox_offset, bh, dropout_p, softcap, alibi_k,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):
    """_fwd_block over the key blocks start, start+BLOCK_N, ... < end (one loop)."""
    # K is read transposed, (dim, keys), so q @ k needs no layout change in registers.
    k_ptrs = K_base + offs_n[None, :] * stride_kn + offs_dk[:, None] + start * stride_kn
    v_ptrs = V_base + offs_n[:, None] * stride_vn + offs_dv[None, :] + start * stride_vn
    b_ptrs = B_base
    if BIAS != 0:
        b_ptrs = B_base + rows_b[:, None] * stride_bm + offs_n[None, :] + start
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, start_n, k_ptrs, v_ptrs, b_ptrs, k_desc, v_desc, DM_base, stride_dmm,
            offs_m, offs_n, offs_dk, offs_dv, seqlen_q, seqlen_k, diag, left, right, qk_scale,
            philox_seed, philox_offset, bh, dropout_p, softcap, alibi_k,
            MASKED, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, PREC, USE_TMA, SOFTCAP, ALIBI)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
        if BIAS != 0:
            b_ptrs += BLOCK_N
    return acc, l_i, m_i


@triton.jit
def _with_sink(inv_l, lse2, sink2):
    """A sink logit ``sink2`` joined to rows of logsumexp ``lse2`` (both log2 units): the rows'
    output factor ``inv_l`` times ``exp2(lse2 - lse2')`` and their new logsumexp ``lse2' =
    log2(exp2(lse2) + exp2(sink2))`` (builder/kernels/sinks.py's ``attn_sinks``, in the epilogue).
    A row that saw no key keeps output 0 and takes the sink's logit; a NaN stays NaN. A sink of
    -inf (no sinks) returns both unchanged, bit for bit."""
    top = tl.maximum(lse2, sink2)
    top = tl.where(top == float("-inf"), 0.0, top)  # both -inf: no key and a sink of -inf
    new = top + tl.math.log2(tl.math.exp2(lse2 - top) + tl.math.exp2(sink2 - top))
    scale = tl.where(lse2 == float("-inf"), 0.0, tl.math.exp2(lse2 - new))
    return inv_l * scale, new


@triton.jit
def _fwd_tile(
    pid_m, Q_head, O_head, L_head, K_base, V_base, B_base, DM_base, k_desc, v_desc,
    stride_qm, stride_kn, stride_vn, stride_om, stride_bm, stride_dmm,
    len_q, len_k, sm_scale, dropout_p, philox_seed, philox_offset, window_left, window_right, causal_align, bh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
    TMA_STORE: tl.constexpr, softcap, SOFTCAP: tl.constexpr, alibi_k, ALIBI: tl.constexpr, sink2,
):
    """Output rows and logsumexp of query block pid_m of one (sequence, head).

    The head's sink logit ``sink2`` (log2 units; -inf without sinks) joins each row's softmax
    (:func:`_with_sink`).

    TMA_STORE: write Out through a TMA descriptor. Its 32 KB staging buffer shares shared memory
    with the K/V ring only when nothing loops around this tile; warp-specialized kernels store
    plainly too (one more K/V stage fits instead).
    """
    start_m = pid_m * BLOCK_M
    Q_base = Q_head + start_m.to(tl.int64) * stride_qm
    O_base = O_head + start_m.to(tl.int64) * stride_om

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    # Bias rows past the sequence are clamped rather than masked so the unmasked loop stays lean.
    rows_b = tl.minimum(offs_m, len_q - 1)

    if USE_TMA:
        # The descriptor's shape clips at this sequence's end and at the true head dim, so TMA
        # zero-fills every padded row and column.
        q_desc = tl.make_tensor_descriptor(Q_base, shape=[len_q - start_m, HEAD_DIM], strides=[stride_qm, 1],
                                           block_shape=[BLOCK_M, BLOCK_DK])
        q = q_desc.load([0, 0])
    else:
        qmask = offs_m[:, None] < len_q
        if HEAD_DIM != BLOCK_DK:
            qmask = qmask & (offs_dk[None, :] < HEAD_DIM)
        q = tl.load(Q_base + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_dk[None, :], mask=qmask,
                    other=0.0)

    qk_scale = sm_scale * LOG2E
    diag, left, right = _window(len_q, len_k, window_left, window_right, causal_align, CAUSAL)
    if CAUSAL != 0:
        lo, f1, f2, hi = _span(start_m, BLOCK_M, len_k, diag, left, right, BLOCK_N)
    else:
        lo = 0
        f1 = 0
        f2 = len_k // BLOCK_N * BLOCK_N
        hi = len_k
    # The unmasked loop scales row maxima instead of scores, which needs a non-negative scale; a
    # negative one (legal, if odd) sends every block through the first masked loop instead.
    f1 = tl.where(sm_scale < 0, lo, f1)
    f2 = tl.where(sm_scale < 0, lo, f2)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if WARP_SPEC:
        # Triton 3.6's Hopper warp specialization accepts one specialized loop and nothing after
        # it, so the whole band runs as one always-masked loop (the mask is a few ALU ops).
        acc, l_i, m_i = _fwd_blocks(
            acc, l_i, m_i, q, K_base, V_base, B_base, DM_base, k_desc, v_desc,
            stride_kn, stride_vn, stride_bm, stride_dmm, lo, hi,
            offs_m, rows_b, offs_n, offs_dk, offs_dv,
            len_q, len_k, diag, left, right, qk_scale,
            philox_seed, philox_offset, bh, dropout_p, softcap, alibi_k,
            True, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PREC,
            USE_TMA, True, SOFTCAP, ALIBI)
    else:
        # Boundary blocks first, the unmasked run last (the softmax does not care about the
        # order of key blocks): what only the masks need is dead by the hot loop, which
        # keeps its registers (4-warp 128-row tiles run at the 255-register limit).
        if CAUSAL != 0:
            acc, l_i, m_i = _fwd_blocks(
                acc, l_i, m_i, q, K_base, V_base, B_base, DM_base, k_desc, v_desc,
                stride_kn, stride_vn, stride_bm, stride_dmm, lo, f1,
                offs_m, rows_b, offs_n, offs_dk, offs_dv,
                len_q, len_k, diag, left, right, qk_scale,
                philox_seed, philox_offset, bh, dropout_p, softcap, alibi_k,
                True, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PREC,
                USE_TMA, False, SOFTCAP, ALIBI)
        acc, l_i, m_i = _fwd_blocks(
            acc, l_i, m_i, q, K_base, V_base, B_base, DM_base, k_desc, v_desc,
            stride_kn, stride_vn, stride_bm, stride_dmm, f2, hi,
            offs_m, rows_b, offs_n, offs_dk, offs_dv,
            len_q, len_k, diag, left, right, qk_scale,
            philox_seed, philox_offset, bh, dropout_p, softcap, alibi_k,
            True, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PREC,
            USE_TMA, False, SOFTCAP, ALIBI)
        acc, l_i, m_i = _fwd_blocks(
            acc, l_i, m_i, q, K_base, V_base, B_base, DM_base, k_desc, v_desc,
            stride_kn, stride_vn, stride_bm, stride_dmm, f1, f2,
            offs_m, rows_b, offs_n, offs_dk, offs_dv,
            len_q, len_k, diag, left, right, qk_scale,
            philox_seed, philox_offset, bh, dropout_p, softcap, alibi_k,
            False, CAUSAL, BIAS, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PREC,
            USE_TMA, False, SOFTCAP, ALIBI)

    # Epilogue: rows that saw no key have l = 0; they output 0 and logsumexp -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    inv_l = 1.0 / l_safe
    if DROPOUT != 0:
        inv_l = inv_l / (1.0 - dropout_p)
    lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
    inv_l, lse2 = _with_sink(inv_l, lse2, sink2)
    acc = acc * inv_l[:, None]
    lse = lse2 * LN2
    row_ok = offs_m < len_q
    tl.store(L_head + offs_m, lse, mask=row_ok)
    if USE_TMA and TMA_STORE:
        o_desc = tl.make_tensor_descriptor(O_base, shape=[len_q - start_m, HEAD_DIM_V], strides=[stride_om, 1],
                                           block_shape=[BLOCK_M, BLOCK_DV])
        o_desc.store([0, 0], acc.to(O_head.dtype.element_ty))
    else:
        omask = row_ok[:, None]
        if HEAD_DIM_V != BLOCK_DV:
            omask = omask & (offs_dv[None, :] < HEAD_DIM_V)
        tl.store(O_base + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_dv[None, :],
                 acc.to(O_head.dtype.element_ty), mask=omask)


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
    sm_scale, dropout_p, philox_seed, philox_offset, window_left, window_right, causal_align, softcap,
    alibi_slopes, stride_az, Sinks, use_sinks,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    CAUSAL: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, FAST_TANH: tl.constexpr = 0,
):
    """Attention forward: Out = softmax(Q K^T * sm_scale + Bias, masked) V and its logsumexp.

    Grid: (cdiv(seqlen_q, BLOCK_M * PAIRS), batch * num_heads_q, 1) where PAIRS is 2 under a
    causal mask and 1 otherwise. With VARLEN, seqlen_q / seqlen_k are the maxima over the batch
    and the per-sequence lengths come from cu_seqlens_q / cu_seqlens_k. GQA: query head h reads
    key/value head h // (num_heads_q // num_heads_k). Bias is indexed by (b, h, i, j) with unit
    stride over j (stride 0 broadcasts a dimension). DROPOUT: 0 off, 1 on, 2 on and the applied
    keep-mask is written to DropMask (int8, unit stride over j). CAUSAL 1 aligns its band by
    causal_align (0 top-left, 1 bottom-right), CAUSAL 2 bottom-right whatever causal_align is.
    Causal programs compute query blocks p and n-1-p of their head (n blocks): every program then
    does the same work, n+1 blocks' worth, whatever p is. A program with no pair left (a grid
    sized for more blocks, or a shorter packed sequence) returns; one with p == n-1-p does one
    block. At head dims above 64 (BLOCK_DK >= 128) the two blocks run in a run-time loop, at 64
    and below as two inlined copies (faster there, twice the compile time). USE_TMA / WARP_SPEC
    (tuning, sm90 only): K/V/Q/Out through device-side tensor descriptors, and warp-specialized
    key loops (unpaired: the key loop must be the kernel's only loop); descriptors need the
    runtime's global scratch. SOFTCAP: scores become ``softcap * tanh(q.k * sm_scale / softcap)``
    before the bias and the masks (FlashAttention-2's logit softcap; ``softcap > 0`` and
    ``sm_scale != 0``, checked at launch); SOFTCAP=0 variants ignore ``softcap``. ALIBI: each
    scaled score gets FlashAttention-2's ALiBi term ``-slope * |i + seqlen_k - seqlen_q - j|`` (the
    sequence's own lengths), with ``slope = alibi_slopes[b * stride_az + h]`` (fp32; ``stride_az``
    0 shares the slopes across the batch); ALIBI=0 variants ignore both arguments. ``use_sinks``
    != 0: attention sinks (gpt-oss), ``Sinks[h]`` (fp32, one logit per query head) joins every
    row's softmax denominator with no value, and LSE includes it (what ``attn_sinks`` makes of
    the output without them); 0: ``Sinks`` is not read (any address). FAST_TANH (SOFTCAP, CUDA
    configs only): the cap's tanh from the hardware (``_softcapped_fast``).
    """
    tl.static_assert(FAST_TANH == 0 or SOFTCAP == 1, "attn_fwd: FAST_TANH is a softcap's tanh")
    # The softcap mode the key blocks see: 0 none, 1 the exact tanh, 2 the hardware one.
    CAP: tl.constexpr = SOFTCAP * (1 + FAST_TANH)
    PREC: tl.constexpr = "ieee" if Q.dtype.element_ty == tl.float32 else None
    BLOCK_DK: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    BLOCK_DV: tl.constexpr = triton.next_power_of_2(HEAD_DIM_V)
    PAIRED: tl.constexpr = CAUSAL != 0 and not WARP_SPEC

    # Blocks of one head run side by side and share its K/V in L2.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // num_heads_q
    off_h = pid_bh % num_heads_q
    off_hk = off_h // (num_heads_q // num_heads_k)

    q_start, len_q = _sequence(cu_seqlens_q, off_b, seqlen_q, VARLEN)
    k_start, len_k = _sequence(cu_seqlens_k, off_b, seqlen_k, VARLEN)
    off_bz = off_b.to(tl.int64) * (1 - VARLEN)
    if VARLEN and not PAIRED:
        # Only packed batches have programs past their sequence (the grid uses the longest one).
        # The early return is unstructured control flow, which Hopper warp specialization rejects.
        if pid_m * BLOCK_M >= len_q:
            return

    Q_head = Q + off_bz * stride_qz + off_h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
    K_base = K + off_bz * stride_kz + off_hk.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
    V_base = V + off_bz * stride_vz + off_hk.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
    O_head = Out + off_bz * stride_oz + off_h.to(tl.int64) * stride_oh + q_start.to(tl.int64) * stride_om
    L_head = LSE + off_b.to(tl.int64) * stride_lz + off_h.to(tl.int64) * stride_lh + q_start
    B_base = Bias
    if BIAS != 0:
        B_base = Bias + off_b.to(tl.int64) * stride_bz + off_h.to(tl.int64) * stride_bh
    DM_base = DropMask
    if DROPOUT == 2:
        DM_base = DropMask + off_b.to(tl.int64) * stride_dmz + off_h.to(tl.int64) * stride_dmh
    if USE_TMA:
        # One K and one V descriptor per (sequence, head), shared by the program's query blocks.
        k_desc = tl.make_tensor_descriptor(K_base, shape=[len_k, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_DK])
        v_desc = tl.make_tensor_descriptor(V_base, shape=[len_k, HEAD_DIM_V], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
    else:
        k_desc = K_base
        v_desc = V_base
    bh = off_b * num_heads_q + off_h
    alibi_k = _alibi_factor(alibi_slopes, stride_az, off_b, off_h, ALIBI)
    sink2 = float("-inf")  # joins nothing (_with_sink leaves every row exactly as it is)
    if use_sinks != 0:
        sink2 = tl.load(Sinks + off_h) * LOG2E

    if PAIRED:
        last = tl.cdiv(len_q, BLOCK_M) - 1 - pid_m
        if BLOCK_DK >= 128:
            # A run-time loop over the program's tiles (pid_m, then last): one copy of the three
            # key loops instead of two, half the variant's compile time (docs/performance.md).
            # Nothing is live from one tile to the next but the head's bases. Out is stored
            # plainly: inside a loop Triton keeps a TMA store buffer apart from the K/V ring
            # (sm90 4-warp tile: 131 KB of shared memory instead of 98 KB, one program per SM).
            # On the H200 it ran as fast as the inlined tiles at D=128 (0.99-1.04x) but 4-7%
            # slower at D=64, which keeps them.
            tiles = (pid_m <= last).to(tl.int32) + (pid_m < last).to(tl.int32)
            for t in range(0, tiles):
                _fwd_tile(
                    pid_m + t * (last - pid_m), Q_head, O_head, L_head, K_base, V_base, B_base, DM_base,
                    k_desc, v_desc, stride_qm, stride_kn, stride_vn, stride_om, stride_bm, stride_dmm,
                    len_q, len_k, sm_scale, dropout_p, philox_seed, philox_offset, window_left, window_right,
                    causal_align, bh, HEAD_DIM, HEAD_DIM_V, BLOCK_DK, BLOCK_DV, CAUSAL, BIAS, DROPOUT, PREC,
                    BLOCK_M, BLOCK_N, USE_TMA, WARP_SPEC, False, softcap, CAP, alibi_k, ALIBI, sink2)
        else:
            # Two inlined tiles: each tile's TMA store buffer can share memory with its K/V ring.
            for t in tl.static_range(2):
                if t == 0:
                    tile = pid_m
                    run = pid_m <= last
                else:
                    tile = last
                    run = pid_m < last
                if run:
                    _fwd_tile(
                        tile, Q_head, O_head, L_head, K_base, V_base, B_base, DM_base,
                        k_desc, v_desc, stride_qm, stride_kn, stride_vn, stride_om, stride_bm, stride_dmm,
                        len_q, len_k, sm_scale, dropout_p, philox_seed, philox_offset, window_left, window_right,
                        causal_align, bh, HEAD_DIM, HEAD_DIM_V, BLOCK_DK, BLOCK_DV, CAUSAL, BIAS, DROPOUT, PREC,
                        BLOCK_M, BLOCK_N, USE_TMA, WARP_SPEC, True, softcap, CAP, alibi_k, ALIBI, sink2)
    else:
        _fwd_tile(
            pid_m, Q_head, O_head, L_head, K_base, V_base, B_base, DM_base,
            k_desc, v_desc, stride_qm, stride_kn, stride_vn, stride_om, stride_bm, stride_dmm,
            len_q, len_k, sm_scale, dropout_p, philox_seed, philox_offset, window_left, window_right, causal_align,
            bh, HEAD_DIM, HEAD_DIM_V, BLOCK_DK, BLOCK_DV, CAUSAL, BIAS, DROPOUT, PREC,
            BLOCK_M, BLOCK_N, USE_TMA, WARP_SPEC, not WARP_SPEC, softcap, CAP, alibi_k, ALIBI, sink2)


# --------------------------------------------------------------------------------------------
# Registry declarations (shared helpers are used by attention_bwd.py too).
# --------------------------------------------------------------------------------------------

from aotriton_rt.ops.attention.family import WIDE_ARCHS, WIDE_DTYPES, WIDE_HEAD_DIM, wide_compiled  # noqa: E402
from builder.kernels._attention_sets import in_bwd_sweep_set, in_default_set, in_gputest_set  # noqa: E402
from builder.registry import ConfigDecl, KernelDecl  # noqa: E402 - declarations follow the kernels
from builder.tuning import tuned_configs  # noqa: E402

# Strides of tensors whose rows are 16-element aligned in every contiguous BHSD / BSHD layout
# with a bucketed head dim (every bucket is a multiple of 16): declaring it lets Triton emit
# 16-byte vector loads. Bias rows (length seqlen_k) only promise 8, enough for 16-byte fp16
# vectors; the operator pads a bias whose row stride is not a multiple of 8.
_ALIGNED_STRIDE = 16
_BIAS_STRIDE = 8
# Shared memory per block, bytes: used by the config tables to keep stages within the target.
SHARED_LIMIT = {"sm80": 166912, "sm90": 232448, "gfx90a": 65536, "gfx942": 65536, "gfx950": 163840,
                "gfx1100": 65536, "gfx1201": 65536}


def signature_of(fn: triton.JITFunction, pointers: dict[str, str]) -> dict[str, str]:
    """Triton argument types by naming convention.

    ``pointers`` gives every pointer's type; UPPER_CASE names are constexprs; batch and head
    strides (``stride_*z``, ``stride_*h``) are i64 so large tensors cannot overflow; row strides
    are i32 (per-tile offsets stay 32-bit); scales are fp32; Philox seed and offset are u64;
    every other scalar (sizes, window sides) is i32.
    """
    sig = {}
    for name in fn.arg_names:
        if name in pointers:
            sig[name] = pointers[name]
        elif name.isupper():
            sig[name] = "constexpr"
        elif name.startswith("stride_"):
            sig[name] = "i64" if name[-1] in "zh" else "i32"
        elif name in ("sm_scale", "dropout_p", "softcap"):
            sig[name] = "fp32"
        elif name.startswith("philox_"):
            sig[name] = "u64"
        else:
            sig[name] = "i32"
    return sig


#: Pointers the kernels read one element at a time (a slope or a sink per program): no alignment promised
#: beyond the element's, so any view of a caller's array is read in place.
UNALIGNED_POINTERS = ("alibi_slopes", "Sinks")


def divisibility_of(sig: dict[str, str], aligned: tuple[str, ...], bias: tuple[str, ...] = ()) -> dict:
    """Every pointer but :data:`UNALIGNED_POINTERS` 16-byte aligned; the strides of ``aligned``
    tensors (stride_<t>z/h/m) 16 and of ``bias`` tensors 8."""
    div = {n: 16 for n, t in sig.items() if t.startswith("*") and n not in UNALIGNED_POINTERS}
    for name in sig:
        if name.startswith("stride_"):
            tensor = name[len("stride_"):-1]
            if tensor in aligned:
                div[name] = _ALIGNED_STRIDE
            elif tensor in bias:
                div[name] = _BIAS_STRIDE
    return div


def stride_checks(div: dict[str, int]) -> tuple[str, ...]:
    """Run-time checks that mirror the declared stride divisibility, one per tensor."""
    groups: dict[str, list[str]] = {}
    for name, d in div.items():
        if name.startswith("stride_"):
            groups.setdefault(name[len("stride_"):-1], []).append(f"{name} % {d} == 0")
    return tuple(" and ".join(parts) for parts in groups.values())


def head_dim_excluded(spec: dict, target: object, backward: bool = False) -> str | None:
    """Unequal q.k / v head dims are compiled only for the pairs in UNEQUAL_HEAD_DIMS; the widest
    bucket only where the family says the forward's (or with ``backward`` the backward's) kernels
    fit (``wide_compiled``)."""
    dk, dv = spec.get("HEAD_DIM"), spec.get("HEAD_DIM_V")
    if dk is not None and dv is not None and dk != dv and (dk, dv) not in UNEQUAL_HEAD_DIMS:
        return f"head dims {dk}/{dv}: unequal pairs are only {UNEQUAL_HEAD_DIMS}"
    if WIDE_HEAD_DIM in (dk, dv) and not wide_compiled(spec["dtype"], target.arch, backward):
        return f"head dim {WIDE_HEAD_DIM}: compiled for {WIDE_DTYPES} on {WIDE_ARCHS} only"
    return None


def fwd_excluded(spec: dict, target: object, backward: bool = False) -> str | None:
    """:func:`head_dim_excluded`, softcap only without a bias or dropout (the full set would grow
    by a quarter for combinations no model has), and ALiBi only without a bias tensor or softcap
    (a bias can carry ALiBi's term itself; no model combines ALiBi with a softcap)."""
    if spec.get("SOFTCAP") and (spec.get("BIAS") or spec.get("DROPOUT")):
        return "softcap is compiled without bias and without dropout"
    if spec.get("ALIBI") and (spec.get("BIAS") or spec.get("SOFTCAP")):
        return "ALiBi is compiled without a bias tensor and without softcap"
    return head_dim_excluded(spec, target, backward)


def fwd_checks(spec: dict) -> tuple[str, ...]:
    """The forward's launch checks; softcap variants also need a positive cap and a non-zero scale."""
    return _FWD_CHECKS + (("softcap > 0", "sm_scale != 0") if spec.get("SOFTCAP") else ())


def block_d(spec: dict) -> int:
    """The padded (power-of-two) head-dim extent the kernel computes with."""
    return next_power_of_2(max(spec.get("HEAD_DIM", 0), spec.get("HEAD_DIM_V", 0)))


def _hip_options(target: object, waves: int) -> dict:
    opts: dict = {"waves_per_eu": waves}
    if target.arch.startswith("gfx9"):
        # CDNA: 16x16 MFMA tiles suit the 64-128 wide attention tiles best.
        opts["matrix_instr_nonkdim"] = 16
    return opts


_NO_TMA = {"USE_TMA": 0, "WARP_SPEC": 0}


def _cfg(bm: int, bn: int, warps: int, stages: int, tma: int = 0, ws: int = 0) -> ConfigDecl:
    return ConfigDecl(constexprs={"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma, "WARP_SPEC": ws},
                  num_warps=warps, num_stages=stages)


def _sm90_fwd_configs(spec: dict, d: int) -> tuple[ConfigDecl, ...]:
    """Hopper fp16/bf16 forward configs, the expected fastest first (the operator's default).

    Ranked on the H200 with ``bench/attention_jit.py --configs --kernels fwd`` (B4 H32 D128).
    The 4-warp 128x64 TMA tile fits two programs per SM (255 registers, 96 KB of shared memory
    each), so one program's softmax overlaps the other's matmuls; with 8 warps one program
    fills the SM and both warp groups meet at every TMA barrier. With a bias or dropout in the
    loop the 4-warp tile spills, so those specs take 8 warps.
    """
    if d <= 64:
        return (_cfg(128, 64, 4, 3), _cfg(128, 64, 4, 2, tma=1), _cfg(128, 64, 8, 2, tma=1))
    if d > 256:
        # D=512: 64x32 through TMA, 8 warps, two K/V stages: 192 KB of shared memory, 242
        # registers, no spills (without TMA: 320 bytes of spill stores; 64x64 tiles: 320 KB).
        return (_cfg(64, 32, 8, 2, tma=1),)
    if d > 128:
        return (_cfg(128, 64, 8, 2), _cfg(128, 64, 8, 2, tma=1))
    if spec["BIAS"] or spec["DROPOUT"]:
        return (_cfg(128, 64, 8, 3), _cfg(128, 64, 8, 2, tma=1))
    # No warp-specialized config: with Triton 3.6 its results were wrong on the H200
    # (2026-11-30: max error 0.53 non-causal, NaN causal, at B2 H3 Sq1000 Sk1111 D128; NaN or
    # 0.2 errors in a minimal one-loop kernel too, and host-side descriptors crash its
    # partitioner), so WARP_SPEC=1 stays a bench candidate only.
    # One 8-warp 128x128 program per SM with three K/V stages (230 KB): 5-10% faster than two
    # 4-warp 128x64 programs once V is requested with K (see _fwd_block). Causal programs (two
    # query blocks each) keep the 4-warp tile: through the operator the two tiles tie, and the
    # 8-warp causal binary ran 4-5% behind its own JIT build (ptxas allocates 255 registers for
    # it without the JIT's knowledge that seqlen_k % 16 == 0), the 4-warp one 1-3% ahead.
    if spec["CAUSAL"] == 0:
        return (_cfg(128, 128, 8, 3, tma=1), _cfg(128, 64, 4, 2, tma=1), _cfg(128, 64, 8, 3))
    return (_cfg(128, 64, 4, 2, tma=1), _cfg(128, 128, 8, 3, tma=1), _cfg(128, 64, 8, 3))


def _fast_tanh_twins(spec: dict, configs: tuple[ConfigDecl, ...]) -> tuple[ConfigDecl, ...]:
    """``configs``, then for a softcap spec up to head dim 256 each again with FAST_TANH=1 (the
    hardware tanh, CUDA only). FAST_TANH is named only in those (the kernel's default is 0): the others keep the
    parameters the tuning database measured."""
    if not spec.get("SOFTCAP") or block_d(spec) > 256:  # the 512 bucket: no capped model uses it
        return configs
    return configs + tuple(ConfigDecl(constexprs={**c.constexprs, "FAST_TANH": 1}, num_warps=c.num_warps,
                                      num_stages=c.num_stages, options=c.options, backends=c.backends)
                           for c in configs)


def fwd_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    """Forward tuning table by target and head dim; index 0 is what the operator launches.

    fp32 runs IEEE dots (no tensor cores), so it takes small tiles everywhere. On sm90 the
    alternates after #0 are there for ``bench/attention_jit.py --aot`` to compare.
    """
    d = block_d(spec)
    fp32 = spec["dtype"] == "fp32"
    if target.backend == "cuda":
        if fp32:
            bm, bn, w, s = (64, 32, 4, 2) if d <= 64 else (32, 32, 4, 2) if d <= 128 else (32, 16, 4, 1)
            return (_cfg(bm, bn, w, s),)
        if target.arch == "sm90":
            return _fast_tanh_twins(spec, _sm90_fwd_configs(spec, d))
        bm, bn, w, s = (128, 64, 4, 3) if d <= 64 else (128, 64, 8, 2) if d <= 128 else (64, 32, 4, 2)
        return _fast_tanh_twins(spec, (_cfg(bm, bn, w, s),))
    rdna = target.arch.startswith("gfx1")
    if fp32:
        bm, bn, w = (64, 32, 4) if d <= 64 else (32, 32, 4) if d <= 128 else (32, 16, 4)
    elif rdna:
        bm, bn, w = (64, 32, 4) if d <= 128 else (32, 32, 4)
    elif d > 256:
        # D=512 (CDNA only): 8 waves hold the 64x512 fp32 accumulator without spilling (4 waves
        # spill 150-200 VGPRs); K and V tiles fill gfx942's 64 KB of LDS exactly.
        bm, bn, w = (64, 32, 8)
    else:
        bm, bn, w = (128, 64, 4) if d <= 128 else (64, 32, 4)
    return (ConfigDecl(constexprs={"BLOCK_M": bm, "BLOCK_N": bn, **_NO_TMA}, num_warps=w, num_stages=1,
                   options=_hip_options(target, 2)),)


def _gputest_configs(spec: dict, target: object) -> tuple[int, ...]:
    """The gputest set's forward configs: every one (sm90's alternates for the tuning tests), but
    config #0 alone for ALiBi variants (the GPU tests run what the operator launches)."""
    return (0,) if spec.get("ALIBI") else tuple(range(len(fwd_configs(spec, target))))


#: The forward's pointer types: attn_fwd's, and those of every kernel that stands in for it (its
#: argument list, see docs/adding-a-kernel.md).
FWD_POINTERS = {
    "Q": "*{dtype}", "K": "*{dtype}", "V": "*{dtype}", "Bias": "*{dtype}", "Out": "*{dtype}",
    "LSE": "*fp32", "DropMask": "*i8", "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "alibi_slopes": "*fp32",
    "Sinks": "*fp32"}
_FWD_SIG = signature_of(attn_fwd, FWD_POINTERS)
_FWD_DIV = divisibility_of(_FWD_SIG, aligned=("q", "k", "v", "o"), bias=("b",))
# Checks shared by the attention kernels; the GQA ratio must be whole and the head grid fits in y.
GQA_CHECKS = ("num_heads_k >= 1", "num_heads_q % num_heads_k == 0")
# The band's alignment under CAUSAL=1 (attention.py's module docs): a multiplier, so only 0 and 1.
ALIGN_CHECKS = ("causal_align == 0 or causal_align == 1",)

_FWD_CHECKS = GQA_CHECKS + ALIGN_CHECKS + ("batch * num_heads_q <= 65535", "dropout_p < 1") + \
    stride_checks(_FWD_DIV)

KERNELS = [KernelDecl(
    name=FWD,
    fn=attn_fwd,
    signature=_FWD_SIG,
    axes={"dtype": DTYPES, "HEAD_DIM": HEAD_DIM_BUCKETS, "HEAD_DIM_V": HEAD_DIM_BUCKETS,
          "CAUSAL": (0, 1, 2), "BIAS": (0, 1), "DROPOUT": (0, 1, 2), "VARLEN": (0, 1), "SOFTCAP": (0, 1),
          "ALIBI": (0, 1)},
    configs=fwd_configs,
    # Causal programs do two query blocks each (see attn_fwd); warp-specialized builds (bench
    # candidates only) do one.
    grid=("cdiv(seqlen_q, BLOCK_M * (1 + min(CAUSAL, 1) * (1 - WARP_SPEC)))", "batch * num_heads_q", "1"),
    divisibility=_FWD_DIV,
    exclude=fwd_excluded,
    sets={"default": in_default_set, "gputest": in_gputest_set, "bwdsweep": in_bwd_sweep_set},
    # sm90's alternates (bench candidates, no catalog rule picks them) only in gputest and full:
    # each would add a compile to the quickstart for no speed; a softcapped spec (Gemma 2's) also
    # holds the configs the tuning database picks for it (`builder tune --softcap`: the hardware
    # tanh). The backward's sweep needs the forward's outputs only.
    set_configs={"default": tuned_configs(FWD, when=lambda spec: bool(spec.get("SOFTCAP"))), "bwdsweep": 1,
                 "gputest": _gputest_configs},
    checks=fwd_checks,
)]
