"""Hopper (sm90) attention backward dK/dV in Gluon, FlashAttention-3 style.

Same arguments, grid, conventions and results as ``attn_bwd_dkdv`` in ``attention_bwd.py``, in
both schemes (split, ``DQ_ATOMIC=0``: dQ comes from ``attn_bwd_dq``; atomic, ``DQ_ATOMIC=1``: this
kernel also adds dQ into the fp32 DQacc, see below), for the cases the backward spends most time
on: fp16/bf16, head dim 64 or 128 (equal q.k and v dims), every mask mode and window, GQA, no bias,
no dropout, fixed lengths. Every other case and every other target keeps the portable kernel;
this one is compiled for sm90 only (Gluon kernels are per architecture).

Layout of one program (one key block of ``BLOCK_N`` keys of one key/value head, as ``attn_bwd_dkdv``):

- Two *consumer* warp groups of 4 warps, each owning ``BLOCK_N // 2`` keys (the wgmma M tile, 64):
  its K and V rows stay in shared memory, its dK and dV accumulators in registers (fp32,
  ``64 x HEAD_DIM`` each: 64 registers a thread at D=128 for each).
- One *loader* warp (``warp_specialize``) that loads K and V once, then streams the Q and dO tiles
  (``BLOCK_M`` queries) of every query head of the GQA group with TMA into a ring of ``STAGES``
  shared-memory slots, each with a ready and a free mbarrier. Both consumers read every slot; a
  slot is refilled when both have arrived on its free barrier. LSE and Delta (``BLOCK_M`` fp32
  each, L2-resident) are read by the consumers with ordinary loads, issued before the matmuls
  that hide them: a 1-D TMA of them would need 16-byte aligned rows, which odd lengths break.
- Per query tile each consumer issues, as asynchronous wgmma: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (both
  operands in shared memory), then, with Pᵀ = exp2(Sᵀ·scale·log2e - LSE·log2e) in registers,
  dV += Pᵀ·dO, and with dSᵀ = Pᵀ∘(dPᵀ - Delta) in registers, dK += dSᵀ·Q (the A operands in
  registers, FA3's ``Mma_dKV_is_RS``). dPᵀ runs while Pᵀ is computed; dV's matmul runs while dSᵀ
  is. Registers per consumer thread at D=128, BLOCK_M=64: dK 64 + dV 64 + Sᵀ 32 + dPᵀ 32 + the
  fp16 Pᵀ and dSᵀ operands 16 + 16; ``CONSUMER_REGS`` (240) holds that, the loader takes 24.

With ``DQ_ATOMIC=1`` (FA3's backward: five matmuls a tile where the split scheme's two kernels
run seven) each consumer also computes its keys' share of the tile's dQ, dS·K_c (``BLOCK_M x
HEAD_DIM``, 64 keys deep), and adds it, times ``sm_scale``, into DQacc with fp32 atomic adds, as
``attn_bwd_dkdv`` does (DQacc zeroed by ``attn_bwd_preprocess``, cast by ``attn_bwd_dq_convert``).
dS is the transpose of the register tile dSᵀ: dSᵀ is stored (16-bit) to a per-consumer shared
buffer whose transposed view is the matmul's A operand, K_c (in shared memory already) its B. The
dQ tile is computed in 64-column chunks (32 fp32 registers a thread each): the first runs beside
dV's and dK's matmuls, the rest after; at D=128 a whole 64 x 128 tile (64 registers) beside dK and
dV made ptxas serialize every wgmma. Each thread adds pairs of adjacent columns
(``atom.add.v2.f32``, result unused: a reduction). Both consumers add into the same query rows, so
every dQ element takes two adds per key block (FA3 splits the dQ tile between its warp groups after
a barrier and reduces through TMA; Gluon in Triton 3.6 has no TMA reduce).

With ``DQ_ATOMIC=1`` and ``OVERLAP=1`` the atomic scheme takes FA3's order: dV's matmul, then dQ's
(its first chunk), then dK's, which runs while the dQ tile is staged and added (the wait before
the adds leaves only dK's group in flight); without it dV's and dK's matmuls are issued together
and every matmul of the tile is waited for before dQ is added.

With ``OVERLAP=1`` (split scheme) each consumer issues a tile's dV and dK matmuls behind the next
tile's Sᵀ and dPᵀ (``_consume_overlapped``): they run while that tile's Pᵀ and dSᵀ are computed,
and a tile's Q/dO slot is released one tile later. ptxas serializes every wgmma of the kernel if
the next tile's 16-bit operands are written while the previous ones are still read (C7513: they
are converted after the wait) or if registers run out (C7512: at D=128 with 64-query tiles, dK,
dV, the operands in flight and the next Sᵀ and dPᵀ need more than 240; the D=128 ``OVERLAP=1``
configs take 32-query tiles). ``OVERLAP=2`` frees those registers instead: Pᵀ and dSᵀ go to shared
memory (a pair of buffers per consumer and tile parity, written while the previous tile's matmuls
read the other pair) and dV's and dK's matmuls read them there; at D=64 only (``OVERLAP_SMEM_D``).

Query tiles are visited in ``attn_bwd_dkdv``'s split: the tiles on the band's edges and the
sequence end (masked) first, then the unmasked run, so the hot loop carries no mask code; that
order repeats for each query head of the group.

Device-side TMA descriptors (made in the kernel, 128 bytes each) live in the runtime's global
scratch, as for ``attn_fwd_sm90``. Q and dO are described as 3-D tensors (group heads, rows, dim)
so one descriptor serves every query head of the GQA group.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from builder.kernels._gluon import reinterpret, tma_load, tma_reduce_add

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
#: Programs per scheduling group under a causal mask (attention.py's CAUSAL_GROUP_PROGRAMS).
GROUP_PROGRAMS: gl.constexpr = gl.constexpr(256)
#: Columns of dQ's tile per matmul with DQ_ATOMIC (head dim 128: two, see _tile).
DQ_CHUNK: gl.constexpr = gl.constexpr(64)


@gluon.jit
def _heavy_first(num_blocks, num_bh):
    """(key block, batch*head) of this program under a causal mask, as attn_bwd_dkdv's _causal_order
    orders them: in launch order, groups of about GROUP_PROGRAMS programs over a few heads, each
    head's key blocks first to last inside a group (the first key blocks see the most queries), so
    the light blocks end the grid and the heads in flight keep their Q/dO in L2."""
    lin = gl.program_id(1).to(gl.int64) * num_blocks + gl.program_id(0)
    return _heavy_first_of(lin, num_blocks, num_bh)


@gluon.jit
def _heavy_first_of(lin, num_blocks, num_bh):
    """_heavy_first's (key block, batch*head) of the lin-th work unit in launch order."""
    heads = gl.maximum(GROUP_PROGRAMS // num_blocks, 1)
    per_group = heads * num_blocks
    group = lin // per_group
    first = group * heads
    size = gl.minimum(heads, num_bh - first)
    rem = lin - group * per_group
    return (rem // size).to(gl.int32), (first + rem % size).to(gl.int32)


@gluon.jit
def _query_block(idx, lo, f1, f2, n1, n2, BLOCK_M: gl.constexpr):
    """First query of the idx-th visited tile of a head: [lo, f1) and [f2, hi) (masked) first, then
    the unmasked [f1, f2)."""
    start = lo + idx * BLOCK_M
    start = gl.where(idx >= n1, f2 + (idx - n1) * BLOCK_M, start)
    start = gl.where(idx >= n1 + n2, f1 + (idx - n1 - n2) * BLOCK_M, start)
    return start


@gluon.jit
def _window(len_q, len_k, window_left, window_right, causal_align, CAUSAL: gl.constexpr):
    """Band of visible keys as (diag, left, right): key j is visible from query i when
    j - i - diag lies in [-left, right] (attention.py's _window). Mask mode 1 is aligned by
    causal_align (0 top-left, 1 bottom-right), mode 2 bottom-right; a negative side is unbounded."""
    if CAUSAL == 2:
        diag = len_k - len_q
    elif CAUSAL == 1:
        diag = causal_align * (len_k - len_q)
    else:
        diag = len_k * 0
    unbounded = len_q + len_k
    left = gl.where(window_left < 0, unbounded, window_left)
    right = gl.where(window_right < 0, unbounded, window_right)
    return diag, left, right


@gluon.jit
def _visited(a0, A_BLOCK: gl.constexpr, len_b, diag, left, right, B_BLOCK: gl.constexpr, CAUSAL: gl.constexpr):
    """The B-axis blocks that rows a0 .. a0+A_BLOCK-1 of the A axis visit, the band being
    a + diag - left <= b <= a + diag + right (attention.py's _span; the dK/dV kernel swaps the
    axes: diag -> -diag, sides swapped). Returns (lo, f1, f2, n1, n2, n): blocks [lo, f1) and
    [f2, hi) need a mask (n1 and n2 of them), [f1, f2) lie inside the band and len_b and need
    none; n blocks in all. Without a mask only the partial block at len_b's end is masked."""
    if CAUSAL != 0:
        lo = gl.maximum(a0 + diag - left, 0)
        lo = lo // B_BLOCK * B_BLOCK
        hi = gl.minimum(a0 + A_BLOCK + diag + right, len_b)
        hi = gl.maximum(hi, lo)
        hi_up = (hi + B_BLOCK - 1) // B_BLOCK * B_BLOCK
        full_lo = gl.maximum(a0 + A_BLOCK - 1 + diag - left, 0)
        full_lo = (full_lo + B_BLOCK - 1) // B_BLOCK * B_BLOCK
        full_hi = gl.minimum(a0 + diag + right + 1, len_b)
        full_hi = gl.maximum(full_hi, 0) // B_BLOCK * B_BLOCK
        f1 = gl.minimum(gl.maximum(full_lo, lo), hi_up)
        f2 = gl.minimum(gl.maximum(full_hi, f1), hi_up)
    else:
        lo = len_b * 0
        f1 = lo
        f2 = len_b // B_BLOCK * B_BLOCK
        hi = len_b
    n1 = (f1 - lo) // B_BLOCK
    n2 = (hi - f2 + B_BLOCK - 1) // B_BLOCK
    n = n1 + n2 + (f2 - f1) // B_BLOCK
    return lo, f1, f2, n1, n2, n


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, free,
            start_n, group, lo, f1, f2, n1, n2, n, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """Loader warp: both consumers' K and V rows, then Q and dO of every visited tile of every head."""
    _load_unit(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, kv_bar, ready, free,
               0, 0, 0, 0, start_n, group, lo, f1, f2, n1, n2, n, BLOCK_M, STAGES, 0)


@gluon.jit
def _loader_persistent(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, kv_free, ready,
                       free, units, num_blocks, num_heads_k, batch, group, len_q, diag, left, right,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """Loader warp of a persistent program: _loader's work for each of its units in turn, the ring
    of Q/dO slots running on across units."""
    t = 0
    u = 0
    for unit in range(gl.program_id(0), units, gl.num_programs(0)):
        off_b, off_hk, start_n, lo, f1, f2, n1, n2, n = _unit(unit, num_blocks, num_heads_k, batch, len_q, diag,
                                                              left, right, BLOCK_M, BLOCK_N, CAUSAL)
        t = _load_unit(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, kv_free, ready,
                       free, t, u, off_b, off_hk, start_n, group, lo, f1, f2, n1, n2, n, BLOCK_M, STAGES, 1)
        u += 1


@gluon.jit
def _unit(unit, num_blocks, num_heads_k, batch, len_q, diag, left, right, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(batch, KV head, first key, and the query tiles it visits as _visited gives them) of a
    persistent program's work unit: the non-persistent grid's programs in launch order (heavy key
    blocks first under a causal mask)."""
    if CAUSAL != 0:
        pid_n, pid_bh = _heavy_first_of(unit.to(gl.int64), num_blocks, batch * num_heads_k)
    else:
        pid_n = unit % num_blocks
        pid_bh = unit // num_blocks
    start_n = pid_n * BLOCK_N
    lo, f1, f2, n1, n2, n = _visited(start_n, BLOCK_N, len_q, -diag, right, left, BLOCK_M, CAUSAL)
    return pid_bh // num_heads_k, pid_bh % num_heads_k, start_n, lo, f1, f2, n1, n2, n


@gluon.jit
def _load_owned(a_desc, b_desc, a_smem, b_smem, bar, off_b, off_h, start, PERSISTENT: gl.constexpr):
    """The two tiles a program owns for its whole unit (K and V of its keys here; Q and dO of its
    queries in the dQ kernel), each consumer's half (a_smem/b_smem index c: rows start + c*HALF ..)
    into shared memory, completing ``bar``: through 2-D descriptors at the head, or with
    PERSISTENT 4-D (batch, head, row, dim) ones at batch off_b and head off_h."""
    HALF: gl.constexpr = a_smem.shape[1]
    BLOCK_D: gl.constexpr = a_smem.shape[2]
    mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
    for c in gl.static_range(2):
        if PERSISTENT:
            a_dst = reinterpret(a_smem.index(c), a_smem.dtype, [1, 1, HALF, BLOCK_D], a_desc.layout)
            b_dst = reinterpret(b_smem.index(c), b_smem.dtype, [1, 1, HALF, BLOCK_D], b_desc.layout)
            tma_load(a_desc, [off_b, off_h, start + c * HALF, 0], bar, a_dst)
            tma_load(b_desc, [off_b, off_h, start + c * HALF, 0], bar, b_dst)
        else:
            tma_load(a_desc, [start + c * HALF, 0], bar, a_smem.index(c))
            tma_load(b_desc, [start + c * HALF, 0], bar, b_smem.index(c))


@gluon.jit
def _load_unit(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, kv_free, ready, free,
               t0, u, off_b, off_hk, start_n, group, lo, f1, f2, n1, n2, n, BLOCK_M: gl.constexpr,
               STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
    """One unit's loads: both consumers' K and V rows (after the consumers released the previous
    unit's, PERSISTENT), then Q and dO of every visited tile of every head of the group, into the
    ring's slots t0, t0 + 1, ... Descriptors are 3-D (group head, row, dim) at the group's first
    head, or with PERSISTENT 4-D (batch, head, row, dim) over the whole tensors (at batch off_b and
    KV head off_hk, query heads off_hk * group ...). Returns the ring position after the unit."""
    BLOCK_D: gl.constexpr = k_smem.shape[2]
    if PERSISTENT:
        # A fresh barrier counts as having completed the phase before its first.
        mbarrier.wait(kv_free, (u & 1) ^ 1)
    _load_owned(k_desc, v_desc, k_smem, v_smem, kv_bar, off_b, off_hk, start_n, PERSISTENT)
    total = group * n
    for i in range(total):
        it = t0 + i
        g = i // n
        j = i - g * n
        s = it % STAGES
        # A fresh barrier counts as having completed the phase before its first: the first pass
        # over the ring does not wait.
        mbarrier.wait(free.index(s), ((it // STAGES) & 1) ^ 1)
        start_m = _query_block(j, lo, f1, f2, n1, n2, BLOCK_M)
        mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        if PERSISTENT:
            # The 4-D (batch, head, row, dim) view of the slot, for the 4-D descriptors.
            q_dst = reinterpret(q_smem.index(s), q_smem.dtype, [1, 1, BLOCK_M, BLOCK_D], q_desc.layout)
            do_dst = reinterpret(do_smem.index(s), do_smem.dtype, [1, 1, BLOCK_M, BLOCK_D], do_desc.layout)
            tma_load(q_desc, [off_b, off_hk * group + g, start_m, 0], ready.index(s), q_dst)
            tma_load(do_desc, [off_b, off_hk * group + g, start_m, 0], ready.index(s), do_dst)
        else:
            # The 3-D (head, row, dim) view of the slot, for the 3-D descriptors.
            q_dst = reinterpret(q_smem.index(s), q_smem.dtype, [1, BLOCK_M, BLOCK_D], q_desc.layout)
            do_dst = reinterpret(do_smem.index(s), do_smem.dtype, [1, BLOCK_M, BLOCK_D], do_desc.layout)
            tma_load(q_desc, [g, start_m, 0], ready.index(s), q_dst)
            tma_load(do_desc, [g, start_m, 0], ready.index(s), do_dst)
    return t0 + total


@gluon.jit
def _reduce_dq(desc, buf, dq, qb, qh, start_m, col, WAIT: gl.constexpr, PERSISTENT: gl.constexpr):
    """Add a dQ tile into DQacc through shared memory: store it to ``buf``, then one TMA reduce-add
    of rows start_m.. of head qh (of the group: the 3-D descriptor; of batch qb: PERSISTENT's 4-D
    one), columns col.. (rows past the sequence are skipped by the descriptor's shape). WAIT:
    first wait until the previous tile's reductions have read their buffers (issued a whole tile
    of matmuls ago, so normally done)."""
    if WAIT:
        tma.store_wait(0)
    buf.store(dq)
    # Each thread's generic-proxy stores before the async proxy reads them; the barrier pass puts
    # the partition's barrier between these stores and the one thread that issues the copy.
    fence_async_shared()
    BLOCK_M: gl.constexpr = buf.shape[0]
    COLS: gl.constexpr = buf.shape[1]
    if PERSISTENT:
        tma_reduce_add(desc, [qb, qh, start_m, col], reinterpret(buf, gl.float32, [1, 1, BLOCK_M, COLS], desc.layout))
    else:
        tma_reduce_add(desc, [qh, start_m, col], reinterpret(buf, gl.float32, [1, BLOCK_M, COLS], desc.layout))


@gluon.jit
def _add_dq(ptrs, dq, q_rows, dq_cols, len_q, MASKED: gl.constexpr):
    """Add a dQ tile into DQacc (fp32 reductions: the result is unused, so ptxas issues no wait)."""
    if MASKED:
        gl.atomic_add(ptrs, dq, mask=(q_rows < len_q)[:, None] & (dq_cols >= 0)[None, :], sem="relaxed")
    else:
        gl.atomic_add(ptrs, dq, sem="relaxed")


@gluon.jit
def _p_ds(sT, dpT, rows, cols, L_head, D_head, len_q, diag, left, right, qk_scale, MASKED: gl.constexpr,
          CAUSAL: gl.constexpr, LATER: gl.constexpr):
    """P^T and dS^T (fp32) of a tile from its S^T and dP^T matmuls, still running: waits for
    each just before its use. ``rows``: the tile's query indices (along its columns); LATER: the
    matmul groups issued after dP^T that may keep running (OVERLAP's dV and dK of the previous
    tile)."""
    # LSE and Delta are read while the matmuls run, each just before its use: with dK, dV, S^T and
    # dP^T in registers there is no room to hold them (16 registers each) across a wait.
    if MASKED:
        lse = gl.load(L_head + rows, mask=rows < len_q, other=float("inf"))
    else:
        lse = gl.load(L_head + rows)
    # Rows that saw no key stored -inf: +inf here makes their probabilities 0, not NaN.
    lse = gl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    # Groups retire in order: LATER + 1 outstanding means S^T is done while dP^T may still run.
    sT = warpgroup_mma_wait(LATER + 1, deps=(sT,))
    pT = gl.exp2(sT * qk_scale - lse[None, :])
    if MASKED:
        visible = (rows < len_q)[None, :]
        if CAUSAL != 0:
            rel = cols[:, None] - rows[None, :] - diag
            visible = visible & (rel >= -left) & (rel <= right)
        pT = gl.where(visible, pT, 0.0)
        delta = gl.load(D_head + rows, mask=rows < len_q, other=0.0)
    else:
        delta = gl.load(D_head + rows)
    dpT = warpgroup_mma_wait(LATER, deps=(dpT,))
    return pT, pT * (dpT - delta[None, :])


@gluon.jit
def _issue_pair(it, a0, a1, b0_smem, b1_smem, ready, STAGES: gl.constexpr, layout: gl.constexpr):
    """A0·B0ᵀ and A1·B1ᵀ of streamed tile ``it`` (B0, B1 in its ring slot), issued as asynchronous
    wgmma once the loader has filled the slot: the dK/dV kernel's Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, the
    dQ kernel's S = Q·Kᵀ and dP = dO·Vᵀ."""
    s = it % STAGES
    b0 = b0_smem.index(s)
    b1 = b1_smem.index(s)
    M: gl.constexpr = a0.shape[0]
    N: gl.constexpr = b0.shape[0]
    zero = gl.zeros([M, N], gl.float32, layout)
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    c0 = warpgroup_mma(a0, b0.permute((1, 0)), zero, use_acc=False, is_async=True)
    c1 = warpgroup_mma(a1, b1.permute((1, 0)), zero, use_acc=False, is_async=True)
    return c0, c1


@gluon.jit
def _tile(it, start_m, dk, dv, k, v, q_smem, do_smem, ready, free, L_head, D_head, cols, qcols,
          len_q, diag, left, right, qk_scale, k_smem, ds_smem, ds_bar, DQA_head, stride_dqam, dq_rows, dq_cols,
          sm_scale, dq_smem, dqa_desc, qb, qh, C: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
          STAGES: gl.constexpr, DQ_ATOMIC: gl.constexpr, DQ_SHARE: gl.constexpr, DQ_TMA: gl.constexpr,
          s_layout: gl.constexpr, a_layout: gl.constexpr, dq_layout: gl.constexpr, PERSISTENT: gl.constexpr,
          DQ_LATE: gl.constexpr):
    """dK, dV of one consumer after query tile ``it`` (first query start_m) of the loader's order;
    with DQ_ATOMIC also this consumer's share of the tile's dQ (dS·K over its 64 keys, scaled),
    added into DQacc. DQ_LATE (DQ_ATOMIC): dK's matmul is issued after dQ's first one and runs
    while that dQ tile is added (FA3's order), instead of beside dV's before it."""
    s = it % STAGES
    q = q_smem.index(s)
    do = do_smem.index(s)
    BLOCK_M: gl.constexpr = q.shape[0]
    sT, dpT = _issue_pair(it, k, v, q_smem, do_smem, ready, STAGES, s_layout)
    pT, dsT = _p_ds(sT, dpT, start_m + qcols, cols, L_head, D_head, len_q, diag, left, right, qk_scale, MASKED,
                    CAUSAL, 0)
    p_op = gl.convert_layout(pT.to(q.dtype), a_layout)
    ds16 = dsT.to(q.dtype)
    ds_op = gl.convert_layout(ds16, a_layout)
    if DQ_ATOMIC:
        # dQ = dS·K: dS is the transpose of the register tile dS^T, so dS^T goes to shared memory
        # (before dV's and dK's matmuls are issued: its fp32 registers die here) and the dQ
        # matmuls read its transposed view (16-bit wgmma operands may be either major). The
        # fence orders these generic-proxy stores before wgmma's async-proxy reads; the
        # compiler's barrier pass (or the arrive's) makes all four warps store first.
        # DQ_SHARE=0: this consumer's buffer, last read by its previous tile's dQ matmuls (waited
        # for). DQ_SHARE=1 (FA3's split): one buffer per consumer and tile parity; a buffer is
        # rewritten two tiles later, after the other consumer arrived on the next tile's ds_bar,
        # so after its matmuls that read the buffer were waited for.
        if DQ_SHARE:
            b = it % 2
            ds_smem.index(2 * b + C).store(ds16)
        else:
            ds_smem.index(C).store(ds16)
        fence_async_shared()
    dv = warpgroup_mma(p_op, do, dv, is_async=True)
    if not DQ_LATE:
        dk = warpgroup_mma(ds_op, q, dk, is_async=True)
    if DQ_ATOMIC:
        CHUNK: gl.constexpr = dq_cols.shape[0]
        q_rows = start_m + dq_rows
        row_ptrs = DQA_head + q_rows.to(gl.int64)[:, None] * stride_dqam + dq_cols[None, :]
        dq_zero = gl.zeros([BLOCK_M, CHUNK], gl.float32, dq_layout)
        if DQ_SHARE:
            # Consumer C computes columns [C*CHUNK, (C+1)*CHUNK) of the tile's dQ over all 128
            # keys, K_0's rows then K_1's: one add per dQ element per key block. The parity's
            # barrier completes when both consumers stored their dS^T.
            mbarrier.arrive(ds_bar.index(b), count=1)
            mbarrier.wait(ds_bar.index(b), (it // 2) & 1)
            dq = warpgroup_mma(ds_smem.index(2 * b).permute((1, 0)), k_smem.index(0).slice(C * CHUNK, CHUNK, dim=1),
                               dq_zero, use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_smem.index(2 * b + 1).permute((1, 0)),
                               k_smem.index(1).slice(C * CHUNK, CHUNK, dim=1), dq, is_async=True)
            NCHUNK: gl.constexpr = 1
            col = C * CHUNK
            buf = C
        else:
            # dQ's share of this consumer's 64 keys, dS·K_C, in CHUNK-column pieces: the first
            # runs beside dV's and dK's matmuls, the others one at a time (each 32 fp32 registers
            # a thread: a whole 64 x 128 tile beside dK and dV made ptxas serialize every wgmma
            # for want of registers).
            BLOCK_D: gl.constexpr = k.shape[1]
            ds_t = ds_smem.index(C).permute((1, 0))
            dq = warpgroup_mma(ds_t, k.slice(0, CHUNK, dim=1), dq_zero, use_acc=False, is_async=True)
            NCHUNK: gl.constexpr = BLOCK_D // CHUNK
            col = 0
            buf = C * NCHUNK
        if DQ_LATE:
            # Groups retire in order: dV's and dQ's are done, dK's runs on while dQ is added.
            dk = warpgroup_mma(ds_op, q, dk, is_async=True)
            dv, dq = warpgroup_mma_wait(1, deps=(dv, dq))
        else:
            dk, dv, dq = warpgroup_mma_wait(0, deps=(dk, dv, dq))
            mbarrier.arrive(free.index(s), count=1)
        if DQ_TMA:
            _reduce_dq(dqa_desc, dq_smem.index(buf), dq * sm_scale, qb, qh, start_m, col, True, PERSISTENT)
        else:
            _add_dq(row_ptrs + col, dq * sm_scale, q_rows, dq_cols, len_q, MASKED)
        if DQ_LATE:
            # The next chunks' matmuls would retire after dK's: wait for it here.
            dk = warpgroup_mma_wait(0, deps=(dk,))
            mbarrier.arrive(free.index(s), count=1)
        for i in gl.static_range(1, NCHUNK):
            dq = warpgroup_mma(ds_t, k.slice(i * CHUNK, CHUNK, dim=1), dq_zero, use_acc=False, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq,))
            if DQ_TMA:
                _reduce_dq(dqa_desc, dq_smem.index(C * NCHUNK + i), dq * sm_scale, qb, qh, start_m, i * CHUNK, False,
                           PERSISTENT)
            else:
                _add_dq(row_ptrs + i * CHUNK, dq * sm_scale, q_rows, dq_cols, len_q, MASKED)
    else:
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
        mbarrier.arrive(free.index(s), count=1)
    return dk, dv


@gluon.jit
def _issue_dkdv(it, dk, dv, p_op, ds_op, q_smem, do_smem, op_smem, C: gl.constexpr, STAGES: gl.constexpr,
                OPS_SMEM: gl.constexpr):
    """Tile ``it``'s dV += P^T·dO and dK += dS^T·Q as asynchronous wgmma (OVERLAP): the operands
    ``p_op``, ``ds_op`` in registers, or with OPS_SMEM consumer C's buffers of the tile's parity."""
    s = it % STAGES
    if OPS_SMEM:
        b = 4 * C + 2 * (it % 2)
        dv = warpgroup_mma(op_smem.index(b), do_smem.index(s), dv, is_async=True)
        dk = warpgroup_mma(op_smem.index(b + 1), q_smem.index(s), dk, is_async=True)
    else:
        dv = warpgroup_mma(p_op, do_smem.index(s), dv, is_async=True)
        dk = warpgroup_mma(ds_op, q_smem.index(s), dk, is_async=True)
    return dk, dv


@gluon.jit
def _tile_overlapped(it, start_m, dk, dv, p_op, ds_op, k, v, q_smem, do_smem, ready, free, L_head, D_head, cols,
                     qcols, len_q, diag, left, right, qk_scale, op_smem, C: gl.constexpr, MASKED: gl.constexpr,
                     CAUSAL: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr, a_layout: gl.constexpr,
                     FIRST: gl.constexpr, OPS_SMEM: gl.constexpr):
    """OVERLAP's step: query tile ``it``'s S^T and dP^T matmuls, then (unless FIRST) the previous
    tile's dV and dK matmuls from its P^T and dS^T operands, which run while this tile's P^T and
    dS^T are computed; then the previous tile's Q/dO slot is released. The operands: registers
    ``p_op``, ``ds_op`` (returned for the next step), or with OPS_SMEM consumer C's buffers of the
    tile's parity in ``op_smem`` (4 C + 2 parity: P^T, then dS^T). Returns dK, dV and this tile's
    register operands (0 with OPS_SMEM)."""
    dtype: gl.constexpr = q_smem.dtype
    sT, dpT = _issue_pair(it, k, v, q_smem, do_smem, ready, STAGES, s_layout)
    if FIRST:
        pT, dsT = _p_ds(sT, dpT, start_m + qcols, cols, L_head, D_head, len_q, diag, left, right, qk_scale, MASKED,
                        CAUSAL, 0)
    else:
        dk, dv = _issue_dkdv(it - 1, dk, dv, p_op, ds_op, q_smem, do_smem, op_smem, C, STAGES, OPS_SMEM)
        pT, dsT = _p_ds(sT, dpT, start_m + qcols, cols, L_head, D_head, len_q, diag, left, right, qk_scale, MASKED,
                        CAUSAL, 2)
    if OPS_SMEM:
        # This tile's operands into the other parity's buffers (last read by tile it-2's matmuls,
        # waited for), while the previous tile's matmuls still run.
        b = 4 * C + 2 * (it % 2)
        op_smem.index(b).store(pT.to(dtype))
        op_smem.index(b + 1).store(dsT.to(dtype))
        fence_async_shared()
        p_next = 0
        ds_next = 0
    if not FIRST:
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
        mbarrier.arrive(free.index((it - 1) % STAGES), count=1)
    if not OPS_SMEM:
        # Only now: the new operands take the registers of the ones the matmuls just read (written
        # while those run, ptxas serializes every wgmma of the kernel: C7513).
        p_next = gl.convert_layout(pT.to(dtype), a_layout)
        ds_next = gl.convert_layout(dsT.to(dtype), a_layout)
    return dk, dv, p_next, ds_next


@gluon.jit
def _consume_overlapped(dk, dv, k, v, q_smem, do_smem, ready, free, LSE, Delta, t0, off_b, off_hk, group, stride_lz,
                        stride_lh, cols, qcols, len_q, diag, left, right, qk_scale, lo, f1, f2, n1, n2, n,
                        CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                        a_layout: gl.constexpr, op_smem, C: gl.constexpr, OPS_SMEM: gl.constexpr):
    """OVERLAP=1 (split scheme): every query tile of every group head in the loader's order, as
    _tile computes them, with each tile's dV and dK matmuls issued behind the next tile's S^T and
    dP^T (_tile_overlapped; the last tile's after the loops). A Q/dO slot is held one tile longer,
    so the ring needs three slots to keep one tile loaded ahead."""
    masked = n1 + n2
    if group * n > 0:
        # The order's first tile (group head 0): its S^T and dP^T only.
        L_head = LSE + off_b.to(gl.int64) * stride_lz + (off_hk * group).to(gl.int64) * stride_lh
        D_head = Delta + off_b.to(gl.int64) * stride_lz + (off_hk * group).to(gl.int64) * stride_lh
        if masked > 0:
            dk, dv, p_op, ds_op = _tile_overlapped(t0, _query_block(0, lo, f1, f2, n1, n2, BLOCK_M), dk, dv, 0, 0,
                                                   k, v, q_smem, do_smem, ready, free, L_head, D_head, cols, qcols,
                                                   len_q, diag, left, right, qk_scale, op_smem, C, True, CAUSAL,
                                                   STAGES, s_layout, a_layout, True, OPS_SMEM)
        else:
            dk, dv, p_op, ds_op = _tile_overlapped(t0, f1, dk, dv, 0, 0, k, v, q_smem, do_smem, ready, free, L_head,
                                                   D_head, cols, qcols, len_q, diag, left, right, qk_scale, op_smem, C,
                                                   False, CAUSAL, STAGES, s_layout, a_layout, True, OPS_SMEM)
        for g in range(group):
            off_h = off_hk * group + g
            L_head = LSE + off_b.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh
            D_head = Delta + off_b.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh
            base = t0 + g * n
            # Group head 0 starts after the tile taken above (the first masked one, else the first unmasked).
            first_masked = ((g == 0) & (masked > 0)).to(gl.int32)
            first_unmasked = masked + ((g == 0) & (masked == 0)).to(gl.int32)
            for j in range(first_masked, masked):
                dk, dv, p_op, ds_op = _tile_overlapped(base + j, _query_block(j, lo, f1, f2, n1, n2, BLOCK_M), dk, dv,
                                                       p_op, ds_op, k, v, q_smem, do_smem, ready, free, L_head,
                                                       D_head, cols, qcols, len_q, diag, left, right, qk_scale, op_smem,
                                                       C, True, CAUSAL, STAGES, s_layout, a_layout, False,
                                                       OPS_SMEM)
            for j in range(first_unmasked, n):
                dk, dv, p_op, ds_op = _tile_overlapped(base + j, f1 + (j - masked) * BLOCK_M, dk, dv, p_op, ds_op,
                                                       k, v, q_smem, do_smem, ready, free, L_head, D_head, cols,
                                                       qcols, len_q, diag, left, right, qk_scale, op_smem, C, False,
                                                       CAUSAL, STAGES, s_layout, a_layout, False, OPS_SMEM)
        # The last tile's dV and dK.
        last = t0 + group * n - 1
        dk, dv = _issue_dkdv(last, dk, dv, p_op, ds_op, q_smem, do_smem, op_smem, C, STAGES, OPS_SMEM)
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
        mbarrier.arrive(free.index(last % STAGES), count=1)
    return dk, dv


@gluon.jit
def _consumer(c: gl.constexpr, q_smem, do_smem, k_smem, v_smem, ds_smem, ds_bar, dq_smem, dqa_desc, kv_bar, ready,
              free, LSE, Delta, DK, DV, DQacc, off_b, off_hk, group, stride_lz, stride_lh, stride_dkn, stride_dvn,
              stride_dqaz, stride_dqah, stride_dqam,
              start_n, len_q, len_k, sm_scale, diag, left, right, lo, f1, f2, n1, n2, n,
              CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, DQ_ATOMIC: gl.constexpr,
              DQ_SHARE: gl.constexpr, DQ_TMA: gl.constexpr, DQ_COLS: gl.constexpr, OVERLAP: gl.constexpr):
    """Consumer warp group c: keys start_n + c*HALF ..., every query tile of every group head."""
    _consume_unit(c, q_smem, do_smem, k_smem, v_smem, ds_smem, ds_bar, dq_smem, dqa_desc, kv_bar, kv_bar, ready,
                  free, LSE, Delta, DK, DV, DQacc, 0, 0, off_b, off_hk, group, stride_lz, stride_lh, stride_dkn,
                  stride_dvn, stride_dqaz, stride_dqah, stride_dqam, start_n, len_q, len_k, sm_scale, diag, left,
                  right, lo, f1, f2, n1, n2, n, CAUSAL, BLOCK_M, STAGES, DQ_ATOMIC, DQ_SHARE, DQ_TMA, DQ_COLS, 0,
                  OVERLAP)


@gluon.jit
def _consumer_persistent(c: gl.constexpr, q_smem, do_smem, k_smem, v_smem, ds_smem, ds_bar, dq_smem, dqa_desc, kv_bar,
                         kv_free, ready, free, LSE, Delta, DK, DV, DQacc, units, num_blocks, num_heads_k, batch,
                         group, stride_lz, stride_lh, stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh,
                         stride_dvn, stride_dqaz, stride_dqah, stride_dqam, len_q, len_k, sm_scale, diag, left,
                         right, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, DQ_ATOMIC: gl.constexpr, DQ_SHARE: gl.constexpr, DQ_TMA: gl.constexpr,
                         DQ_COLS: gl.constexpr, OVERLAP: gl.constexpr):
    """Consumer warp group c of a persistent program: _consumer's work for each of its units in
    the loader's order, the ring position running on across units."""
    t = 0
    u = 0
    for unit in range(gl.program_id(0), units, gl.num_programs(0)):
        off_b, off_hk, start_n, lo, f1, f2, n1, n2, n = _unit(unit, num_blocks, num_heads_k, batch, len_q, diag,
                                                              left, right, BLOCK_M, BLOCK_N, CAUSAL)
        DK_head = DK + off_b.to(gl.int64) * stride_dkz + off_hk.to(gl.int64) * stride_dkh
        DV_head = DV + off_b.to(gl.int64) * stride_dvz + off_hk.to(gl.int64) * stride_dvh
        t = _consume_unit(c, q_smem, do_smem, k_smem, v_smem, ds_smem, ds_bar, dq_smem, dqa_desc, kv_bar, kv_free,
                          ready, free, LSE, Delta, DK_head, DV_head, DQacc, t, u, off_b, off_hk, group, stride_lz,
                          stride_lh, stride_dkn, stride_dvn, stride_dqaz, stride_dqah, stride_dqam, start_n, len_q,
                          len_k, sm_scale, diag, left, right, lo, f1, f2, n1, n2, n, CAUSAL, BLOCK_M, STAGES,
                          DQ_ATOMIC, DQ_SHARE, DQ_TMA, DQ_COLS, 1, OVERLAP)
        u += 1
    if DQ_TMA:
        tma.store_wait(0)


@gluon.jit
def _consume_unit(c: gl.constexpr, q_smem, do_smem, k_smem, v_smem, ds_smem, ds_bar, dq_smem, dqa_desc, kv_bar,
                  kv_free, ready, free, LSE, Delta, DK, DV, DQacc, t0, u, off_b, off_hk, group, stride_lz, stride_lh,
                  stride_dkn, stride_dvn, stride_dqaz, stride_dqah, stride_dqam,
                  start_n, len_q, len_k, sm_scale, diag, left, right, lo, f1, f2, n1, n2, n,
                  CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, DQ_ATOMIC: gl.constexpr,
                  DQ_SHARE: gl.constexpr, DQ_TMA: gl.constexpr, DQ_COLS: gl.constexpr, PERSISTENT: gl.constexpr,
                  OVERLAP: gl.constexpr):
    """One unit of consumer warp group c: keys start_n + c*HALF ..., every query tile of every
    group head, from the ring's slot t0 on (K and V in phase ``u & 1`` of kv_bar); DK and DV
    point at the unit's (batch, KV head). With PERSISTENT it releases K and V (kv_free) once its
    last matmul is done. Returns the ring position after the unit."""
    HALF: gl.constexpr = k_smem.shape[1]
    BLOCK_D: gl.constexpr = k_smem.shape[2]
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    cols = start_n + c * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    qcols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    dk = gl.zeros([HALF, BLOCK_D], gl.float32, acc_layout)
    dv = gl.zeros([HALF, BLOCK_D], gl.float32, acc_layout)
    qk_scale = sm_scale * LOG2E
    k = k_smem.index(c)
    v = v_smem.index(c)
    # dQ's tile (BLOCK_M queries x HEAD_DIM), DQ_COLS columns a matmul.
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    dq_cols = gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
    # Always wait: the loader's K/V copies must land before the program may exit (or reload them).
    mbarrier.wait(kv_bar, u & 1)
    masked = n1 + n2
    if OVERLAP and not DQ_ATOMIC:
        dk, dv = _consume_overlapped(dk, dv, k, v, q_smem, do_smem, ready, free, LSE, Delta, t0, off_b, off_hk, group,
                                     stride_lz, stride_lh, cols, qcols, len_q, diag, left, right, qk_scale, lo, f1,
                                     f2, n1, n2, n, CAUSAL, BLOCK_M, STAGES, s_layout, a_layout, ds_smem, c,
                                     OVERLAP == 2)
    else:
        for g in range(group):
            off_h = off_hk * group + g
            L_head = LSE + off_b.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh
            D_head = Delta + off_b.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh
            DQA_head = DQacc + off_b.to(gl.int64) * stride_dqaz + off_h.to(gl.int64) * stride_dqah
            if PERSISTENT:
                qh = off_h  # the 4-D descriptors' head
            else:
                qh = g  # the 3-D descriptors' group head
            base = t0 + g * n
            for j in range(0, masked):
                start_m = _query_block(j, lo, f1, f2, n1, n2, BLOCK_M)
                dk, dv = _tile(base + j, start_m, dk, dv, k, v, q_smem, do_smem, ready, free, L_head, D_head,
                               cols, qcols, len_q, diag, left, right, qk_scale, k_smem, ds_smem, ds_bar, DQA_head,
                               stride_dqam, dq_rows, dq_cols, sm_scale, dq_smem, dqa_desc, off_b, qh, c, True, CAUSAL,
                               STAGES, DQ_ATOMIC, DQ_SHARE, DQ_TMA, s_layout, a_layout, dq_layout, PERSISTENT,
                               DQ_ATOMIC * OVERLAP)
            for j in range(masked, n):
                start_m = f1 + (j - masked) * BLOCK_M
                dk, dv = _tile(base + j, start_m, dk, dv, k, v, q_smem, do_smem, ready, free, L_head, D_head,
                               cols, qcols, len_q, diag, left, right, qk_scale, k_smem, ds_smem, ds_bar, DQA_head,
                               stride_dqam, dq_rows, dq_cols, sm_scale, dq_smem, dqa_desc, off_b, qh, c, False, CAUSAL,
                               STAGES, DQ_ATOMIC, DQ_SHARE, DQ_TMA, s_layout, a_layout, dq_layout, PERSISTENT,
                               DQ_ATOMIC * OVERLAP)
    if PERSISTENT:
        # Every matmul reading K and V was waited for in its tile: the loader may refill them.
        mbarrier.arrive(kv_free, count=1)
    elif DQ_TMA:
        # The shared-memory tiles must stay until the last reductions have read them (PERSISTENT:
        # after the last unit).
        tma.store_wait(0)

    k_rows = start_n + c * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    d_cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, acc_layout))
    keep = (k_rows < len_k)[:, None] & (d_cols >= 0)[None, :]
    rows64 = k_rows.to(gl.int64)[:, None]
    gl.store(DK + rows64 * stride_dkn + d_cols[None, :], (dk * sm_scale).to(dtype), mask=keep)
    gl.store(DV + rows64 * stride_dvn + d_cols[None, :], dv.to(dtype), mask=keep)
    return t0 + group * n


@gluon.jit
def _whole(T, batch, heads, rows, dim, stride_z, stride_h, stride_m, BLOCK_ROWS: gl.constexpr,
           BLOCK_COLS: gl.constexpr):
    """A 4-D (batch, head, row, dim) TMA descriptor over the whole tensor T (rows of ``dim``
    contiguous elements), blocks of BLOCK_ROWS x BLOCK_COLS of one head."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_ROWS, BLOCK_COLS], T.dtype.element_ty)
    return tma.make_tensor_descriptor(T, shape=[batch, heads, rows, dim], strides=[stride_z, stride_h, stride_m, 1],
                                      block_shape=[1, 1, BLOCK_ROWS, BLOCK_COLS], layout=layout)


@gluon.jit
def attn_bwd_dkdv_sm90(
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
    HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    CAUSAL: gl.constexpr, BIAS: gl.constexpr, DROPOUT: gl.constexpr, VARLEN: gl.constexpr,
    DQ_ATOMIC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, USE_TMA: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, DQ_SHARE: gl.constexpr, DQ_TMA: gl.constexpr,
    PERSISTENT: gl.constexpr, OVERLAP: gl.constexpr = 0,
):
    """dK, dV of one key block of one key/value head, summed over its GQA query heads (see
    attn_bwd_dkdv); with DQ_ATOMIC also this block's share of dQ (scaled, fp32) added into DQacc.

    Grid: (cdiv(seqlen_k, BLOCK_N), batch * num_heads_k, 1); with PERSISTENT > 0 (min(units,
    PERSISTENT), 1, 1), a unit being one such program's key block, which each program takes in
    turn (every PERSISTENT-th in the non-persistent grid's launch order): the descriptors are
    made once, 4-D over the whole tensors, and the loader fetches the next unit's K and V as soon
    as both consumers are done with the last one's. Bias, DBias, cu_seqlens_* and the
    dropout arguments are accepted (attn_bwd_dkdv's argument list) and ignored: BIAS, DROPOUT,
    VARLEN, SOFTCAP and ALIBI are 0 (DQacc too without DQ_ATOMIC; with it BLOCK_M is 64, one consumer's keys, so dQ's
    tile has dK's shape). HEAD_DIM == HEAD_DIM_V, a power of two (64 or 128). USE_TMA is 1
    (Q and dO always come through TMA; it is there for the argument list's constexpr set).
    BLOCK_N is two consumers' 64 keys. STAGES: Q/dO slots in the ring. CONSUMER_REGS: registers
    per thread of the consumer warp groups (the loader warp gets 24). DQ_SHARE (DQ_ATOMIC, head
    dim 128): 0 each consumer adds its keys' dQ over the whole head dim, 1 each adds half of the
    head dim over both consumers' keys (FA3's split: half the atomic adds, a barrier a tile).
    DQ_TMA (DQ_ATOMIC): 0 the adds are per-thread fp32 reductions from registers; 1 each dQ tile
    goes to shared memory and into DQacc with one TMA reduce-add (FA3's path). OVERLAP (split
    scheme): 1 issues each query tile's dV and dK matmuls behind the next tile's S^T and dP^T, so
    they run while that tile's P^T and dS^T are computed (_consume_overlapped), their A operands
    in registers; 2 the same with the A operands in shared memory. OVERLAP (atomic scheme): 1
    issues dK's matmul after dQ's, running while dQ is added (FA3's order).
    """
    gl.static_assert(BIAS == 0 and DROPOUT == 0 and VARLEN == 0,
                     "attn_bwd_dkdv_sm90: no bias, dropout or varlen")
    gl.static_assert(DQ_ATOMIC == 0 or BLOCK_M == BLOCK_N // 2, "attn_bwd_dkdv_sm90: atomic dQ needs 64-query tiles")
    gl.static_assert(HEAD_DIM == HEAD_DIM_V, "attn_bwd_dkdv_sm90: equal q.k and v head dims")
    gl.static_assert(BLOCK_N == 128, "attn_bwd_dkdv_sm90: two consumers of 64 keys")
    HALF: gl.constexpr = BLOCK_N // 2
    BLOCK_D: gl.constexpr = HEAD_DIM
    dtype: gl.constexpr = Q.dtype.element_ty
    gl.static_assert(BLOCK_D % DQ_CHUNK == 0, "attn_bwd_dkdv_sm90: head dim a multiple of dQ's chunk")
    gl.static_assert(DQ_TMA == 0 or DQ_ATOMIC == 1, "attn_bwd_dkdv_sm90: DQ_TMA reduces an atomic dQ")
    gl.static_assert(OVERLAP == 0 or DQ_ATOMIC == 0 or OVERLAP == 1,
                     "attn_bwd_dkdv_sm90: OVERLAP=2 is the split scheme's")
    gl.static_assert(DQ_SHARE == 0 or (DQ_ATOMIC == 1 and BLOCK_D == 2 * DQ_CHUNK),
                     "attn_bwd_dkdv_sm90: DQ_SHARE splits an atomic dQ tile of head dim 128 between the consumers")
    if DQ_SHARE:
        DQ_COLS: gl.constexpr = BLOCK_D // 2
    else:
        DQ_COLS: gl.constexpr = DQ_CHUNK

    len_q = seqlen_q
    len_k = seqlen_k
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_D], dtype)
    if PERSISTENT:
        group = num_heads_q // num_heads_k
        # 4-D (batch, head, row, dim) descriptors over the whole tensors, made once per program.
        q_desc = _whole(Q, batch, num_heads_q, len_q, HEAD_DIM, stride_qz, stride_qh, stride_qm, BLOCK_M, BLOCK_D)
        do_desc = _whole(DO, batch, num_heads_q, len_q, HEAD_DIM, stride_doz, stride_doh, stride_dom, BLOCK_M,
                         BLOCK_D)
        k_desc = _whole(K, batch, num_heads_k, len_k, HEAD_DIM, stride_kz, stride_kh, stride_kn, HALF, BLOCK_D)
        v_desc = _whole(V, batch, num_heads_k, len_k, HEAD_DIM, stride_vz, stride_vh, stride_vn, HALF, BLOCK_D)
    else:
        if CAUSAL != 0:
            pid_n, pid_bh = _heavy_first(gl.num_programs(0), batch * num_heads_k)
        else:
            pid_n = gl.program_id(0)
            pid_bh = gl.program_id(1)
        off_b = pid_bh // num_heads_k
        off_hk = pid_bh % num_heads_k
        group = num_heads_q // num_heads_k
        start_n = pid_n * BLOCK_N

        Q_group = Q + off_b.to(gl.int64) * stride_qz + (off_hk * group).to(gl.int64) * stride_qh
        DO_group = DO + off_b.to(gl.int64) * stride_doz + (off_hk * group).to(gl.int64) * stride_doh
        K_head = K + off_b.to(gl.int64) * stride_kz + off_hk.to(gl.int64) * stride_kh
        V_head = V + off_b.to(gl.int64) * stride_vz + off_hk.to(gl.int64) * stride_vh
        DK_head = DK + off_b.to(gl.int64) * stride_dkz + off_hk.to(gl.int64) * stride_dkh
        DV_head = DV + off_b.to(gl.int64) * stride_dvz + off_hk.to(gl.int64) * stride_dvh

        tile3_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, BLOCK_D], dtype)
        q_desc = tma.make_tensor_descriptor(Q_group, shape=[group, len_q, HEAD_DIM],
                                            strides=[stride_qh, stride_qm, 1],
                                            block_shape=[1, BLOCK_M, BLOCK_D], layout=tile3_layout)
        do_desc = tma.make_tensor_descriptor(DO_group, shape=[group, len_q, HEAD_DIM],
                                             strides=[stride_doh, stride_dom, 1],
                                             block_shape=[1, BLOCK_M, BLOCK_D], layout=tile3_layout)
        k_desc = tma.make_tensor_descriptor(K_head, shape=[len_k, HEAD_DIM], strides=[stride_kn, 1],
                                            block_shape=[HALF, BLOCK_D], layout=kv_layout)
        v_desc = tma.make_tensor_descriptor(V_head, shape=[len_k, HEAD_DIM], strides=[stride_vn, 1],
                                            block_shape=[HALF, BLOCK_D], layout=kv_layout)

    # The band seen from a key block (attn_bwd_dkdv's _span with the axes swapped: rows i with
    # j - diag - right <= i <= j - diag + left): query tiles [lo, f1) and [f2, hi) need a mask,
    # [f1, f2) do not.
    diag, left, right = _window(len_q, len_k, window_left, window_right, causal_align, CAUSAL)
    if PERSISTENT == 0:
        lo, f1, f2, n1, n2, n = _visited(start_n, BLOCK_N, len_q, -diag, right, left, BLOCK_M, CAUSAL)

    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], tile_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_D], kv_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=2)
    if DQ_ATOMIC:
        # Each consumer's dS^T tile, the A operand (transposed) of the dQ matmuls; with DQ_SHARE
        # one pair per tile parity, and a barrier per parity that both consumers arrive on.
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2 + 2 * DQ_SHARE, HALF, BLOCK_M], ds_layout)
        if DQ_SHARE:
            ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for b in gl.static_range(2):
                mbarrier.init(ds_bar.index(b), count=2)
        else:
            ds_bar = ready  # unused
    elif OVERLAP == 2:
        # Each consumer's P^T and dS^T tiles, the A operands of dV's and dK's matmuls, one pair
        # per tile parity.
        op_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [8, HALF, BLOCK_M], op_layout)
        ds_bar = ready  # unused
    else:
        ds_smem = k_smem  # unused
        ds_bar = ready  # unused
    if DQ_TMA:
        # Each consumer's dQ tiles (fp32, DQ_COLS columns: one with DQ_SHARE, a chunk per
        # DQ_CHUNK columns without), staged for the TMA reduce-add into DQacc, whose descriptor
        # serves every query head of the group: 3-D (group head, row, dim) at the group's first
        # head, or with PERSISTENT 4-D (batch, head, row, dim) over the whole tensor.
        NBUF: gl.constexpr = 1 if DQ_SHARE else BLOCK_D // DQ_COLS
        dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_COLS], gl.float32)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2 * NBUF, BLOCK_M, DQ_COLS], dq_layout)
        if PERSISTENT:
            dqa_desc = _whole(DQacc, batch, num_heads_q, len_q, HEAD_DIM, stride_dqaz, stride_dqah, stride_dqam,
                              BLOCK_M, DQ_COLS)
        else:
            dq3_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, DQ_COLS], gl.float32)
            DQA_group = DQacc + off_b.to(gl.int64) * stride_dqaz + (off_hk * group).to(gl.int64) * stride_dqah
            dqa_desc = tma.make_tensor_descriptor(DQA_group, shape=[group, len_q, HEAD_DIM],
                                                  strides=[stride_dqah, stride_dqam, 1],
                                                  block_shape=[1, BLOCK_M, DQ_COLS], layout=dq3_layout)
    else:
        dq_smem = k_smem  # unused
        dqa_desc = q_desc  # unused

    if PERSISTENT:
        # Both consumers arrive once they are done with a unit's K and V; the loader waits for
        # that before it loads the next unit's.
        kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_free, count=2)
        num_blocks = gl.cdiv(len_k, BLOCK_N)
        units = num_blocks * batch * num_heads_k
        gl.warp_specialize([
            (_consumer_persistent, (0, q_smem, do_smem, k_smem, v_smem, ds_smem, ds_bar, dq_smem, dqa_desc, kv_bar,
                                    kv_free, ready, free, LSE, Delta, DK, DV, DQacc, units, num_blocks, num_heads_k,
                                    batch, group, stride_lz, stride_lh, stride_dkz, stride_dkh, stride_dkn,
                                    stride_dvz, stride_dvh, stride_dvn, stride_dqaz, stride_dqah, stride_dqam, len_q,
                                    len_k, sm_scale, diag, left, right, CAUSAL, BLOCK_M, BLOCK_N, STAGES, DQ_ATOMIC,
                                    DQ_SHARE, DQ_TMA, DQ_COLS, OVERLAP)),
            (_consumer_persistent, (1, q_smem, do_smem, k_smem, v_smem, ds_smem, ds_bar, dq_smem, dqa_desc, kv_bar,
                                    kv_free, ready, free, LSE, Delta, DK, DV, DQacc, units, num_blocks, num_heads_k,
                                    batch, group, stride_lz, stride_lh, stride_dkz, stride_dkh, stride_dkn,
                                    stride_dvz, stride_dvh, stride_dvn, stride_dqaz, stride_dqah, stride_dqam, len_q,
                                    len_k, sm_scale, diag, left, right, CAUSAL, BLOCK_M, BLOCK_N, STAGES, DQ_ATOMIC,
                                    DQ_SHARE, DQ_TMA, DQ_COLS, OVERLAP)),
            (_loader_persistent, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, kv_free,
                                  ready, free, units, num_blocks, num_heads_k, batch, group, len_q, diag, left,
                                  right, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer, (0, q_smem, do_smem, k_smem, v_smem, ds_smem, ds_bar, dq_smem, dqa_desc, kv_bar, ready, free,
                         LSE, Delta, DK_head, DV_head, DQacc, off_b, off_hk, group, stride_lz, stride_lh, stride_dkn,
                         stride_dvn, stride_dqaz, stride_dqah, stride_dqam, start_n, len_q, len_k, sm_scale, diag,
                         left, right, lo, f1, f2, n1, n2, n, CAUSAL, BLOCK_M, STAGES, DQ_ATOMIC, DQ_SHARE, DQ_TMA,
                         DQ_COLS, OVERLAP)),
            (_consumer, (1, q_smem, do_smem, k_smem, v_smem, ds_smem, ds_bar, dq_smem, dqa_desc, kv_bar, ready, free,
                         LSE, Delta, DK_head, DV_head, DQacc, off_b, off_hk, group, stride_lz, stride_lh, stride_dkn,
                         stride_dvn, stride_dqaz, stride_dqah, stride_dqam, start_n, len_q, len_k, sm_scale, diag,
                         left, right, lo, f1, f2, n1, n2, n, CAUSAL, BLOCK_M, STAGES, DQ_ATOMIC, DQ_SHARE, DQ_TMA,
                         DQ_COLS, OVERLAP)),
            (_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, free,
                       start_n, group, lo, f1, f2, n1, n2, n, BLOCK_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])


# --------------------------------------------------------------------------------------------
# Registry declaration.
# --------------------------------------------------------------------------------------------

from aotriton_rt.ops.attention.family import ALIGNED_FACTS, ALIGNED_SIBLINGS, DKDV_SM90  # noqa: E402
from builder.kernels._attention_sets import SM90_GLUON_BWD_HEAD_DIMS, in_default_backward_schemes_set  # noqa: E402
from builder.kernels._attention_sets import in_gputest_set as _in_bwd_gputest_set  # noqa: E402
from builder.kernels.attention import ALIGN_CHECKS, GQA_CHECKS, divisibility_of, signature_of, stride_checks  # noqa: E402
from builder.kernels.attention_bwd import _GRAD_PTRS  # noqa: E402
from builder.registry import ConfigDecl, KernelDecl  # noqa: E402 - declarations follow the kernel
from builder.tuning import tuned_configs  # noqa: E402

#: Head dims compiled: the ones the H200 backward benchmarks measure (docs/performance.md); one
#: tuple with the set that adds the atomic scheme's preprocess/convert kernels for them.
HEAD_DIMS = SM90_GLUON_BWD_HEAD_DIMS
#: (BLOCK_M, STAGES) per head dim, the expected fastest first (unmeasured). BLOCK_N is always 128
#: (two consumers of 64 keys). Shared memory: K and V of 128 keys (D=128: 64 KB) plus STAGES Q
#: and dO tiles (D=128, BLOCK_M=64: 32 KB a stage), and with DQ_ATOMIC two 8 KB dSᵀ tiles (the
#: same tiles serve both schemes). ptxas on the CPU: D=64 spills nothing; D=128 spills 29-44
#: registers of loop-invariant scalars, none inside the query-tile loops (with DQ_ATOMIC: 74-75
#: stores, 11-20 reloads a tile). 128-query tiles do not fit at D=64 either (S^T and dP^T take
#: 128 registers: 513 spill stores, ~100 a tile).
TILES = {128: ((64, 2), (64, 3)), 64: ((64, 3), (64, 2))}
#: Registers per thread of each consumer warp group (setmaxnreg); the loader warp takes 24.
CONSUMER_REGS = 240
#: Head dims whose atomic-scheme variants also come with DQ_SHARE=1: each consumer computes half
#: of the dQ tile's columns over both consumers' keys (D/2 = 64 columns, one wgmma N tile; at
#: D=64 a 32-column slice of a 128-byte swizzled K row is not a whole swizzle atom).
DQ_SHARE_D = (128,)
#: (BLOCK_M, STAGES) of the DQ_TMA=1 configs per (head dim, DQ_SHARE): the fp32 dQ tiles staged
#: for the reduce-add take 32 KB (D=64; D=128 with DQ_SHARE) or 64 KB (D=128, two 64-column chunks
#: per consumer), so at D=128 only the tiles whose shared memory stays within sm90's 227 KB.
DQ_TMA_TILES = {(128, 1): ((64, 2), (64, 3)), (128, 0): ((64, 2),), (64, 0): ((64, 3), (64, 2))}
#: Programs of a persistent config (PERSISTENT): one per SM of an H100 SXM or H200 (132), each
#: one CTA (the kernel's shared memory holds one per SM).
PERSISTENT_PROGRAMS = 132
#: Q/dO slots of the OVERLAP configs (split scheme, one tile a program: OVERLAP=1, then OVERLAP=2,
#: after the others): a tile's slot is released one tile later, so three keep one tile loaded
#: ahead. No OVERLAP config is persistent: on the H200 the persistent ones returned wrong dK/dV
#: (relative error 0.4-68 against the portable kernels) and faulted at some shapes, while each
#: half alone (persistent, or OVERLAP one tile a program) matched the fp32 reference. OVERLAP=1's
#: query tile per head dim (registers, see the module docs); OVERLAP=2 takes 64 (its operand
#: buffers: 32 KB at D=64).
OVERLAP_STAGES = 3
OVERLAP_BLOCK_M = {64: 64, 128: 32}
#: Head dims with OVERLAP=2 configs. At D=128 (64-query tiles, 229,760 bytes of shared memory) the
#: ptxas of CUDA 12.8 and 12.9 (Triton 3.6's and 3.9's) dies with a segmentation fault on some specs'
#: one-tile variant (CUDA 13.0's compiles them), and the rest reload 12-13 spilled values a tile.
OVERLAP_SMEM_D = (64,)


def sm90_dkdv_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    """The tile table for a head dim, and for the atomic scheme at head dim 128 (``DQ_SHARE_D``)
    each tile again with DQ_SHARE=1 (FA3's split of the dQ tile between the consumers). The
    per-consumer dQ (DQ_SHARE=0) comes first: the simpler scheme, the one the runtime launches
    untuned. The atomic scheme's tiles then come again with DQ_TMA=1 (dQ through shared memory and
    a TMA reduce-add; ``DQ_TMA_TILES``), then the persistent configs (``PERSISTENT_PROGRAMS``
    programs looping over the key blocks): the first tile of the split scheme, or of the atomic
    one's TMA configs (both dQ splits at D=128); for the split scheme then OVERLAP=1 and (at
    ``OVERLAP_SMEM_D``) OVERLAP=2, one tile a program (``OVERLAP_STAGES``); each group after
    the earlier ones, so that their numbers keep their meaning. num_warps is the default
    partition's (consumer 0); the compiled kernel runs 12 warps (two consumer groups and the
    loader's group), which the catalog records from the binary."""
    atomic = bool(spec.get("DQ_ATOMIC"))
    shares = (0, 1) if atomic and spec["HEAD_DIM"] in DQ_SHARE_D else (0,)
    tiles = TILES[spec["HEAD_DIM"]]
    combos = [(share, 0, bm, st, 0) for share in shares for bm, st in tiles]
    if atomic:
        combos += [(share, 1, bm, st, 0) for share in shares for bm, st in DQ_TMA_TILES[(spec["HEAD_DIM"], share)]]
        combos += [(share, 1, *DQ_TMA_TILES[(spec["HEAD_DIM"], share)][0], PERSISTENT_PROGRAMS) for share in shares]
    else:
        combos += [(0, 0, *tiles[0], PERSISTENT_PROGRAMS)]
    combos = [(*c, 0) for c in combos]
    if atomic:
        # OVERLAP=1 (FA3's order: dK's matmul behind dQ's, running while dQ is added), one tile a
        # program and persistent, on the TMA configs' first tile.
        combos += [(share, 1, *DQ_TMA_TILES[(spec["HEAD_DIM"], share)][0], programs, 1)
                   for share in shares for programs in (0, PERSISTENT_PROGRAMS)]
    if not atomic:
        overlaps = (1, 2) if spec["HEAD_DIM"] in OVERLAP_SMEM_D else (1,)
        combos += [(0, 0, OVERLAP_BLOCK_M[spec["HEAD_DIM"]] if overlap == 1 else 64, OVERLAP_STAGES, 0, overlap)
                   for overlap in overlaps]
    # OVERLAP is named only where it is set (the kernel's default is 0): the other configs keep the
    # parameters the tuning database measured them with (its rules check them).
    return tuple(ConfigDecl(constexprs={"BLOCK_M": bm, "BLOCK_N": 128, "USE_TMA": 1, "STAGES": st,
                                        "CONSUMER_REGS": CONSUMER_REGS, "DQ_SHARE": share, "DQ_TMA": tma_,
                                        "PERSISTENT": programs, **({"OVERLAP": overlap} if overlap else {})},
                            num_warps=4, num_stages=1, backends=("cuda",))
                 for share, tma_, bm, st, programs, overlap in combos)


def _excluded(spec: dict, target: object) -> str | None:
    if target.backend != "cuda" or target.arch != "sm90":
        return f"{target.arch}: a Gluon kernel for sm90 only (other targets run attn_bwd_dkdv)"
    if spec["HEAD_DIM"] != spec["HEAD_DIM_V"]:
        return "unequal q.k and v head dims run attn_bwd_dkdv"
    return None


def in_gputest_set(spec: dict, target: object) -> bool:
    """The portable split backward's GPU-test specs that this kernel serves (the GPU test forces
    it), with ``DQ_ATOMIC`` 0 and 1: the atomic scheme's preprocess and convert kernels come with
    them (``in_sm90_gluon_atomic_set``), not the portable atomic dK/dV."""
    return _in_bwd_gputest_set({**spec, "DQ_ATOMIC": 0}, target)


_SIG = signature_of(attn_bwd_dkdv_sm90, _GRAD_PTRS)
_DIV = divisibility_of(_SIG, aligned=("q", "k", "v", "do", "dk", "dv", "dqa"), bias=("b", "db"))
# attn_bwd_dkdv's checks, and TMA descriptors need a non-empty extent in every dimension.
_CHECKS = GQA_CHECKS + ALIGN_CHECKS + ("batch * num_heads_k <= 65535", "dropout_p < 1", "seqlen_q >= 1",
                                       "seqlen_k >= 1",
                                       # A persistent program numbers the key blocks in 32 bits.
                                       "cdiv(seqlen_k, BLOCK_N) * batch * num_heads_k <= 1073741824")

#: attn_bwd_dkdv's grid with PERSISTENT 0: (cdiv(seqlen_k, BLOCK_N), batch * num_heads_k, 1);
#: otherwise one dimension of min(units, PERSISTENT) programs, a unit being one such key block.
GRID = ("cdiv(seqlen_k, BLOCK_N) * (1 - min(PERSISTENT, 1))"
        " + min(cdiv(seqlen_k, BLOCK_N) * batch * num_heads_k, PERSISTENT)",
        "batch * num_heads_k * (1 - min(PERSISTENT, 1)) + min(PERSISTENT, 1)", "1")

KERNEL = KernelDecl(
    name=DKDV_SM90,
    fn=attn_bwd_dkdv_sm90,
    signature=_SIG,
    axes={"dtype": ("fp16", "bf16"), "HEAD_DIM": HEAD_DIMS, "HEAD_DIM_V": HEAD_DIMS, "CAUSAL": (0, 1, 2),
          "BIAS": (0,), "DROPOUT": (0,), "VARLEN": (0,), "DQ_ATOMIC": (0, 1), "SOFTCAP": (0,), "ALIBI": (0,)},
    configs=sm90_dkdv_configs,
    grid=GRID,
    divisibility=_DIV,
    exclude=_excluded,
    sets={"default": in_default_backward_schemes_set, "gputest": in_gputest_set},
    set_configs={"default": tuned_configs(DKDV_SM90)},
    checks=_CHECKS + stride_checks(_DIV),
)

#: The call facts the aligned-length sibling declares divisible by 16 beyond ``_DIV`` (the runtime's
#: list, which its dispatch checks the catalog against): the LSE/Delta strides (each head's row then
#: starts 64-byte aligned, so LSE and Delta are read with 8-byte loads) and both lengths. Triton's
#: JIT knows all four for such a call; with only the strides ptxas recomputes the second consumer's
#: column offsets every tile (docs/performance.md).
_DIV_A16 = {**_DIV, **{n: 16 for n in ALIGNED_FACTS}}




#: The aligned-length sibling: the same Gluon function, arguments, grid and configs, compiled with
#: ``ALIGNED_FACTS`` divisible by 16, for both schemes. The runtime runs it in place of
#: ``attn_bwd_dkdv_sm90`` where the call's lengths and LSE strides are multiples of 16 and the
#: images hold it for the spec (its tuning rules are the family's:
#: aotriton_rt/ops/attention/family.py, ``ALIGNED_SIBLINGS``); a ragged call keeps the plain
#: kernel. A separate kernel name because one kernel's variants share their argument declarations
#: (aotriton_rt/launch.py). In every set that holds the plain kernel, with the same configs.
ALIGNED_KERNEL = KernelDecl(
    name=ALIGNED_SIBLINGS[DKDV_SM90],
    fn=attn_bwd_dkdv_sm90,
    signature=_SIG,
    axes=KERNEL.axes,
    configs=sm90_dkdv_configs,
    grid=KERNEL.grid,
    divisibility=_DIV_A16,
    exclude=_excluded,
    sets={"default": in_default_backward_schemes_set, "gputest": in_gputest_set},
    set_configs={"default": tuned_configs(DKDV_SM90)},
    checks=_CHECKS + stride_checks(_DIV_A16),
)
KERNELS = [ALIGNED_KERNEL]
