"""Split-KV decode attention over contiguous or paged KV caches (flash-decoding), ahead of time.

Three kernels, launched by ``aotriton_rt/ops/decode.py`` (see docs/attention.md, "Decode"):

- ``attn_decode_append`` writes ``seqlen_new`` new key/value rows per sequence into the cache at
  positions ``cache_seqlens[b] + i`` (through the block table when ``PAGED``).
- ``attn_decode`` computes attention of ``seqlen_q`` query rows per sequence (any number up to
  ``MAX_SEQLEN_Q``: one token, a speculative draft, a chunk of a prompt) against the first
  ``cache_seqlens[b] + seqlen_new`` cache rows. One program per (query-row block, split,
  batch * kv head): the rows of its tile are the GQA group's query heads times the query rows
  (``row = g * seqlen_q + i``), so every K/V tile is read once for the whole group. The keys
  the tile's own rows may see (from its first row's window start to its last row's window
  end: a causal tile early in a long run reads only the keys up to it) are cut into
  ``num_splits`` equal runs of whole key blocks; each program writes its run's normalised
  partial output and logsumexp (fp32) to scratch, or, with one split, the final output
  directly.
- ``attn_decode_combine`` merges the splits' partials per (kv head group row, batch * kv head).

Programmatic dependent launch (CUDA sm90+, the ``PDL`` constexpr of the sm90 configs, launched
with the launch.pdl attribute): each kernel may start before its predecessor on the stream has
finished, and every program waits for it (``griddepcontrol.wait``: the predecessor complete and
its writes visible; without a programmatic predecessor it passes at once) before its first
global load or store, and lets its own successor launch once only its stores are left. Only
index arithmetic precedes the wait, so the chain hides launch latency, never reorders memory
accesses.

Masks are bottom-right aligned (the queries are the sequence's last ``seqlen_q`` rows): key ``j``
is visible from query ``i`` when ``i + diag - window_left <= j <= i + diag + window_right`` with
``diag = len_k - seqlen_q``; a negative side is unbounded, causal is ``window_right = 0``.
A left-padded sequence (``CacheStart[b] > 0``, FlashAttention-2's ``cache_leftpad``) sees only
keys ``CacheStart[b] <= j < len_k``: the alignment stays relative to the end, and the rows
before its start are never read (nor their block-table entries).

Logit softcap (Gemma 2; FlashAttention-2's ``softcap``): with the run-time ``softcap > 0``, the
scores ``s = q.k * sm_scale`` become ``softcap * tanh(s / softcap)`` before the masks and the
softmax (the forward's ``_softcapped``: one exp2 and one fast division per score). A run-time
value behind a uniform branch per key block, not a compiled axis: every variant serves calls
with and without a cap, and calls without one skip it (sm90: 4 more instructions per key
block, 462 against 458; in the paged kernel's 16-row-chunk loop 32 more, 668 against 636, its
per-chunk load masks kept in registers across the branch). The shared-memory ring and the
16-byte K/V copies are those of the kernel without it (tests/builder/test_decode_paged_offsets.py).

ALiBi (FlashAttention-2's ``alibi_slopes``): with the run-time ``use_alibi != 0`` each score gets
``-slope * |i + len_k - seqlen_q - j|``, the slope of the row's own query head (a tile's rows are
GQA heads times query rows), fp32 at ``alibi_slopes[b * stride_az + h]``. It shares the softcap's
uniform branch (:func:`_raw_with_terms`; a branch of its own was if-converted into every block:
31 more instructions in the sm90 contiguous loop), so calls with neither skip both: bf16 D=128
sm90 loops of 475, 464 and 638 instructions per key block (contiguous, whole-page, 16-row
chunks) against 465, 462 and 668 without the argument; the branch holds 90 (the cap's 66 and
ALiBi's absolute value, conversion and FMA per score).

Sinks (gpt-oss): with ``use_sinks != 0`` a logit per query head joins each row's softmax with
no value. One split joins it in ``attn_decode``'s epilogue, several in ``attn_decode_combine``
after the merge (the partials stay without it); a sink of -inf leaves a row bit for bit as it is.

Head dims: ``HEAD_DIM`` is a compiled bucket. ``PADDED_D=0`` variants read rows of exactly
``HEAD_DIM`` elements with 16-byte aligned addresses and strides (16-byte vector loads: the fast
path). ``PADDED_D=1`` variants take any ``head_dim`` in ``[1, HEAD_DIM]`` at run time and mask
every load and store along the head dim with ``offs_d < head_dim``, assuming no alignment beyond
the element's own (a head dim of 59 fp16 has 118-byte rows), so any cache is read in place;
columns past ``head_dim`` are never touched. Split partials keep ``HEAD_DIM``-wide rows.

Cache layouts (explicit strides, head dim contiguous): contiguous ``K + b*stride_kz +
h*stride_kh + n*stride_kn`` (e.g. ``(B, S_cache, H_kv, D)``); paged ``K + page*stride_kz +
h*stride_kh + (n % page_size)*stride_kn`` with ``page = BlockTable[b, n // page_size]`` (e.g.
``(num_pages, page_size, H_kv, D)``); key blocks start at multiples of BLOCK_N, so a page of a
multiple of BLOCK_N rows holds whole blocks (one table entry per block) and any page of a
multiple of 16 rows whole 16-row chunks (one entry per chunk). Cache contents and block-table
entries are the caller's contract, and no value of them makes a kernel read or write outside its
arrays: lengths are clamped to ``[0, capacity]`` (so table columns stay below the table's width),
page indices to ``[0, num_pages)``, and the append kernel drops rows whose
position or page is out of range instead of writing them. A kernel that meets such a value ORs
its bit into the int32 at ``Faults`` (``FAULT_LENGTH``: ``cache_seqlens[b] < 0``,
``cache_seqlens[b] + seqlen_new > capacity`` or ``CacheStart[b]`` outside ``[0, capacity]``;
``FAULT_PAGE``: a referenced table entry outside ``[0, num_pages)``), and ``attn_decode``
writes NaN to that sequence's output and logsumexp (the combine kernel carries the NaN through),
so a bad answer is never a plausible one. On the in-range path this is an add and an OR per
table entry and a store predicated off: no branch.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from builder.kernels.attention import (
    LN2,
    LOG2E,
    SHARED_LIMIT,
    _softcapped,
    _with_sink,
    divisibility_of,
    next_power_of_2,
    signature_of,
    stride_checks,
)
from builder.registry import ConfigDecl, KernelDecl

# Bits of the fault flag (mirrored by aotriton_rt/ops/decode/faults.py; a test keeps them equal).
FAULT_LENGTH: tl.constexpr = tl.constexpr(1)
FAULT_PAGE: tl.constexpr = tl.constexpr(2)

# Head dims the decode kernels are compiled for: the attention buckets (the cache is read in
# place, so its head dim must be one of them).
HEAD_DIM_BUCKETS = (16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)
# Longest query run per sequence: with capacities up to 2**28 rows (the runtime's bound), key
# positions, window ends and ``capacity + seqlen_q`` stay inside int32.
MAX_SEQLEN_Q = 2**28
# Query rows per KV head (GQA group times seqlen_q): row indices and the combine kernel's grid x
# stay inside int32 with a tile to spare.
MAX_GROUP_ROWS = 2**30


@triton.jit
def _kv_offsets(bt_row, cols, col_ok, page_size, num_pages, stride_kz, stride_kn, stride_vz, stride_vn,
                PAGED: tl.constexpr):
    """Element offsets (int64) of K and V rows ``cols`` of one sequence and head, one block-table
    entry per row (the append kernel's few scattered rows), and which rows' pages are in the cache
    (entries are the caller's contract: a bad one is clamped in bounds and its row not written)."""
    if PAGED:
        entry = tl.load(bt_row + cols // page_size, mask=col_ok, other=0)
        page = tl.minimum(tl.maximum(entry, 0), num_pages - 1)
        row = cols % page_size
        page_ok = page == entry
        page = page.to(tl.int64)
        return page * stride_kz + row * stride_kn, page * stride_vz + row * stride_vn, page_ok
    rows = cols.to(tl.int64)
    return rows * stride_kn, rows * stride_vn, col_ok


@triton.jit
def _page_row(bt_row, first, ok, page_size, num_pages):
    """(page, row in the page, sign), int64 scalars and _page_of's int32 sign word, of a sequence's
    cache row ``first`` (>= 0): one block-table entry, clamped into the cache (entries are the
    caller's contract). One unsigned division; the row is what it leaves (a signed ``//`` and
    ``%`` were two division sequences)."""
    entry = (tl.cast(first, tl.uint32) // tl.cast(page_size, tl.uint32)).to(tl.int32)
    page, sign = _page_of(bt_row, entry, ok, num_pages)
    return page, (first - entry * page_size).to(tl.int64), sign


@triton.jit
def _page_of(bt_row, entry, ok, num_pages):
    """Block-table entry ``entry`` of a sequence (int64), clamped into the cache, and a sign word:
    negative exactly when the entry is outside ``[0, num_pages)`` (``(num_pages - 1 - page) |
    page``; a masked-off entry loads 0, a page of every cache). The key loop ORs the words and
    tests the sign once after it: an add and an OR per entry, no predicate kept across chunks
    (a per-entry compare carried as a predicate cost 25 instructions per block in the chunked
    sm90 loop, mostly predicate spills)."""
    page = tl.load(bt_row + entry, mask=ok, other=0)
    sign = (num_pages - 1 - page) | page
    return tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64), sign


@triton.jit
def _block_offsets(start_n, offs_n, start_b, len_k, bt_row, page_size, num_pages, stride_kz, stride_kn, stride_vz,
                   stride_vn, MODE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets (int64, BLOCK_N) of the K and V rows of the key block at ``start_n``, and
    the OR of its table entries' sign words (negative when one was out of range; see _page_of).

    MODE 0: a contiguous cache. MODE 1: pages a multiple of BLOCK_N rows: the block lies in one
    page, one block-table entry per block and a contiguous run of rows (the contiguous cache's
    addressing from a per-block base). MODE 2: any page of a multiple of 16 rows: each 16-row
    chunk of the block lies in one page (blocks start at multiples of BLOCK_N), one entry per
    chunk, broadcast over its rows (a chunk wholly before the sequence's first row ``start_b``
    reads no entry: a left-padded sequence's table need not map those rows). Scalar entry
    loads keep the K/V copies direct loads for the software pipeliner; a per-key gather of the
    table became shared-memory copies of page ids and their read-back (80 extra copies and 200
    shared loads per block in the sm90 binary).
    """
    if MODE == 0:
        rows = (start_n + offs_n).to(tl.int64)
        return rows * stride_kn, rows * stride_vn, 0
    if MODE == 1:
        page, row, sign = _page_row(bt_row, start_n, start_n < len_k, page_size, num_pages)
        return (page * stride_kz + row * stride_kn + offs_n * stride_kn,
                page * stride_vz + row * stride_vn + offs_n * stride_vn, sign)
    CHUNK: tl.constexpr = 16
    chunk = offs_n // CHUNK
    k_off = tl.zeros([BLOCK_N], dtype=tl.int64)
    v_off = tl.zeros([BLOCK_N], dtype=tl.int64)
    # The block's first row by one division; each next chunk is 16 rows on, which crosses at most
    # one page edge (pages are at least 16 rows): an add and a compare, not a division per chunk.
    entry = (tl.cast(start_n, tl.uint32) // tl.cast(page_size, tl.uint32)).to(tl.int32)
    row = start_n - entry * page_size
    sign = 0
    for c in tl.static_range(BLOCK_N // CHUNK):
        if c > 0:
            row += CHUNK
            edge = row >= page_size
            entry = tl.where(edge, entry + 1, entry)
            row = tl.where(edge, row - page_size, row)
        first = start_n + c * CHUNK
        page, sign_c = _page_of(bt_row, entry, (first < len_k) & (first + CHUNK > start_b), num_pages)
        sign = sign | sign_c
        k_off = tl.where(chunk == c, page * stride_kz + row.to(tl.int64) * stride_kn, k_off)
        v_off = tl.where(chunk == c, page * stride_vz + row.to(tl.int64) * stride_vn, v_off)
    within = offs_n % CHUNK
    return k_off + within * stride_kn, v_off + within * stride_vn, sign


@triton.jit
def _raw_with_terms(qk, rel, qk_scale, softcap, alibi_raw):
    """Raw scores ``qk`` with the run-time terms, in the units the caller's ``* qk_scale`` takes
    to log2 units: the logit softcap (``softcap > 0``, :func:`_softcapped`) and the ALiBi term
    ``alibi_raw * |rel|`` (``alibi_raw``: the rows' ``-slope * LOG2E / qk_scale``, zeros without
    ALiBi: the term is then an exact 0), in FlashAttention-2's order; the runtime refuses calls
    with both."""
    qk = tl.where(softcap > 0, _softcapped(qk, qk_scale, softcap), qk)
    return qk + alibi_raw[:, None] * tl.abs(rel).to(tl.float32)


#: PTX: a 32-bit word of four e4m3 bytes to four fp16 values, byte i (from the least
#: significant) to value i: ``cvt.rn.f16x2.e4m3x2`` widens a pair, its low byte to the low half.
#: (tests/helpers/interpreter.py runs it under the interpreter by these semantics.)
E4M3X4_TO_F16 = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
    "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")


@triton.jit
def _widened_rows(X_head, off, ok, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp16 ``(BLOCK_N, BLOCK_D)``: the e4m3 rows at byte offsets ``off`` from ``X_head`` (zeros
    where ``ok`` is false and past HEAD_DIM), read as 32-bit words and widened four bytes at a
    time in registers.

    Why: the P.V dot sums over keys, so each thread's operand registers hold pairs of keys for one
    column, a whole row (HEAD_DIM bytes) apart in a ``(keys, D)`` cache. Handed an fp8 tile, the
    compiler gathers those bytes one load at a time from shared memory (64 per thread per 64-key
    block at D=128, with as many moves to pair them); widened first, the tile reaches the dot as
    a bf16 cache's does, through ``ldmatrix.trans`` of 16-bit values. The words and the join are
    what keep the compiler from moving the widening past the layout change: a word holds four
    columns of one key, which no dot operand layout keeps in one thread. Rows must start at
    4-byte multiples (PADDED_D=0 variants promise 16)."""
    tl.static_assert(HEAD_DIM % 4 == 0, "attn_decode: V_WIDENED reads whole 4-byte words")
    BLOCK_D: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    offs_w = tl.arange(0, BLOCK_D // 4)
    words = (X_head + off[:, None]).to(tl.pointer_type(tl.int32), bitcast=True) + offs_w[None, :]
    if HEAD_DIM == BLOCK_D:
        w = tl.load(words, mask=ok[:, None], other=0)
    else:
        w = tl.load(words, mask=ok[:, None] & (offs_w < HEAD_DIM // 4)[None, :], other=0)
    h0, h1, h2, h3 = tl.inline_asm_elementwise(E4M3X4_TO_F16, "=h,=h,=h,=h,r", [w],
                                               dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                               is_pure=True, pack=1)
    # (keys, words, 2, 2) -> column 4 * word + 2 * i + j holds byte 2 * i + j of its word.
    return tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), (BLOCK_N, BLOCK_D))


@triton.jit
def _attend(acc, l_i, m_i, page_sign, q, K_head, V_head, bt_row, start, end, start_b, len_k, qi, diag, left, right,
            qk_scale, softcap, alibi_raw, use_alibi,
            page_size, num_pages, stride_kz, stride_kn, stride_vz, stride_vn, offs_n, offs_d, head_dim,
            HEAD_DIM: tl.constexpr, PADDED_D: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
            PREC: tl.constexpr, V_WORDS: tl.constexpr):
    """Online softmax of the tile's query rows over key blocks ``start..end`` (see _block_offsets
    for MODE); returns the updated (acc, l_i, m_i, page_sign): ``page_sign`` ORed with the table
    entries' sign words (negative once one was out of range). Rows before ``start_b`` (a left
    padding) and from ``len_k`` on are neither loaded nor seen. ``softcap > 0``: scores become
    ``softcap * tanh(q.k * sm_scale / softcap)`` before the masks (the forward's ``_softcapped``;
    a uniform branch per key block, so one binary serves calls with and without a cap).
    ``use_alibi != 0``: each score gets ``alibi_raw * |j - i - diag|`` (``alibi_raw``: its row's
    factor, :func:`_alibi_rows`), FlashAttention-2's ALiBi term with query row i at key position
    ``i + diag``; the two terms share one uniform branch per key block (:func:`_raw_with_terms`)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        col_ok = (cols >= start_b) & (cols < len_k)
        k_off, v_off, sign = _block_offsets(start_n, offs_n, start_b, len_k, bt_row, page_size, num_pages, stride_kz,
                                            stride_kn, stride_vz, stride_vn, MODE, BLOCK_N)
        page_sign = page_sign | sign
        # K as (dim, keys): loads run along the contiguous head dim.
        k = tl.load(K_head + k_off[None, :] + offs_d[:, None],
                    mask=_and_dim(col_ok[None, :], offs_d, head_dim, HEAD_DIM, PADDED_D, 0), other=0.0)
        if V_WORDS:
            # An fp8 V widened before the P.V dot sees it (see _widened_rows).
            v = _widened_rows(V_head, v_off, col_ok, HEAD_DIM, BLOCK_N)
        else:
            v = tl.load(V_head + v_off[:, None] + offs_d[None, :],
                        mask=_and_dim(col_ok[:, None], offs_d, head_dim, HEAD_DIM, PADDED_D, 1), other=0.0)
        # An fp8 cache widens in registers to q's type (exact: every e4m3 value is an fp16 and a
        # bf16); its scales are folded into qk_scale and the output by the caller.
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        qk = tl.dot(q, k, input_precision=PREC)
        rel = cols[None, :] - qi[:, None] - diag
        visible = (rel >= -left) & (rel <= right) & col_ok[None, :]
        # One uniform branch for both run-time score terms: a branch of its own, ALiBi's few
        # instructions per score were if-converted into every block (31 more per sm90 block).
        if (softcap > 0) | (use_alibi != 0):
            qk = _raw_with_terms(qk, rel, qk_scale, softcap, alibi_raw)
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # Rows that have seen no visible key keep m = -inf and subtract 0 (no NaN).
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i, page_sign


@triton.jit
def _fp16_rows(q):
    """bf16 query rows in fp16 for an fp8 cache's dots, with each row's factor: ``(q * f in
    fp16, f)``, f a power of two that puts the row's largest ``|value|`` in [2**13, 2**14).

    Every e4m3 value is an fp16 (and a bf16), so with q in fp16 the cache widens with one
    ``cvt.rn.f16x2.e4m3x2`` per pair where bf16 needs that and a conversion per value (fp16 to
    bf16: 192 of sm90's ~990 instructions per 64-key block). bf16's range is fp32's, fp16's ends
    at 65504: the factor brings each row into it. Scaled by a power of two, every value of the row
    down to ``2**-27`` of its largest is an fp16 exactly (8 significant bits fit in 11), the
    products and their fp32 sums are the bf16 ones times f, and the caller's score scale divided
    by f (exact) gives the same scores bit for bit; P then rounds to fp16, finer than bf16. Values
    below ``2**-27`` of their row's largest become fp16 subnormals or zero (their share of any
    score is below that). All-zero and subnormal-only rows take f = 2**127, rows holding an inf
    or NaN f = 2**-115 (which keeps them inf or NaN)."""
    a = tl.max(tl.abs(q.to(tl.float32)), 1)
    biased = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF  # a's exponent + 127: 0 zero/subnormal, 255 inf/NaN
    f_biased = tl.minimum(tl.maximum(127 + 13 + 127 - biased, 1), 254)
    f = (f_biased << 23).to(tl.float32, bitcast=True)
    return (q.to(tl.float32) * f[:, None]).to(tl.float16), f


@triton.jit
def _kv_scales(KScale, VScale, off_b, off_hk, stride_ksz, stride_ksh, stride_vsz, stride_vsh, k_scale, v_scale,
               FP8: tl.constexpr):
    """(K scale, V scale), fp32, of sequence off_b's KV head off_hk in an fp8 cache: a real value
    is the stored one times ``KScale[b*stride_ksz + h*stride_ksh] * k_scale`` (per-head scales:
    strides (0, 1) for ``(Hkv,)``, (Hkv, 1) for ``(B, Hkv)``; a per-tensor one: strides 0, and
    ``k_scale`` the value over an array holding 1.0). (1, 1) for a cache of q's type (no load)."""
    if FP8:
        ks = tl.load(KScale + off_b.to(tl.int64) * stride_ksz + off_hk.to(tl.int64) * stride_ksh) * k_scale
        vs = tl.load(VScale + off_b.to(tl.int64) * stride_vsz + off_hk.to(tl.int64) * stride_vsh) * v_scale
        return ks, vs
    return 1.0, 1.0


@triton.jit
def _quantised(x, scale, KV: tl.constexpr):
    """``x / scale`` in the fp8 type ``KV``: an fp32 division rounded to nearest (as torch's),
    saturated to the format's largest finite value (448 for e4m3fn, 240 for e4m3fnuz), NaN kept,
    then rounded to nearest even."""
    FP8_MAX: tl.constexpr = 448.0 if KV == tl.float8e4nv else 240.0
    y = tl.math.div_rn(x.to(tl.float32), tl.zeros_like(x.to(tl.float32)) + scale)
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
    return y.to(KV, fp_downcast_rounding="rtne")


@triton.jit
def _after_predecessor(PDL: tl.constexpr):
    """With PDL (a launch that may start before its predecessor on the stream finished): wait
    until the predecessor has completed and its writes are visible (every thread waits; without
    a programmatic predecessor it passes at once, the stream having ordered the launch). Every
    program calls this before its first global load or store, so reads of the predecessor's
    outputs and writes to memory it may still read stay ordered."""
    if PDL:
        gdc_wait()


@triton.jit
def _successor_may_launch(PDL: tl.constexpr):
    """With PDL: the successor may launch once every program got here (it waits for this grid's
    completion before touching memory, so it never sees these writes early). Called late, when
    only the stores are left: the successor's programs then wait briefly, and a profiler's
    duration of the successor (which starts at its launch) stays close to its own work."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _and_dim(mask, offs_d, head_dim, HEAD_DIM: tl.constexpr, PADDED_D: tl.constexpr, DIM_AXIS: tl.constexpr):
    """``mask`` and the head-dim bound along DIM_AXIS of a 2-D tile: the run-time ``head_dim``
    with PADDED_D, else HEAD_DIM, which a power-of-two head dim (the tile's own width) needs
    not and does not get."""
    if PADDED_D:
        if DIM_AXIS == 0:
            mask = mask & (offs_d < head_dim)[:, None]
        else:
            mask = mask & (offs_d < head_dim)[None, :]
    elif HEAD_DIM != triton.next_power_of_2(HEAD_DIM):
        if DIM_AXIS == 0:
            mask = mask & (offs_d < HEAD_DIM)[:, None]
        else:
            mask = mask & (offs_d < HEAD_DIM)[None, :]
    return mask


@triton.jit
def _sequence_length(CacheSeqlens, off_b, seqlen_new, capacity):
    """(keys visible to this sequence's queries: cached rows plus the appended ones, clamped to
    ``[0, capacity]``; FAULT_LENGTH when the clamp was needed, else 0). Compared before the add,
    so a length near the int32 limit cannot wrap into range (``seqlen_new <= capacity``)."""
    cached = tl.load(CacheSeqlens + off_b)
    fault = tl.where((cached < 0) | (cached > capacity - seqlen_new), FAULT_LENGTH, 0)
    len_k = tl.minimum(tl.maximum(cached, 0), capacity - seqlen_new) + seqlen_new
    return len_k, fault


@triton.jit
def _sequence_start(CacheStart, off_b, len_k, capacity):
    """(this sequence's first key row, its left padding ``cache_leftpad[b]`` clamped to ``[0,
    len_k]``; FAULT_LENGTH when it is outside ``[0, capacity]``, else 0)."""
    start = tl.load(CacheStart + off_b)
    fault = tl.where((start < 0) | (start > capacity), FAULT_LENGTH, 0)
    return tl.minimum(tl.maximum(start, 0), len_k), fault


@triton.jit
def _alibi_rows(alibi_slopes, stride_az, use_alibi, off_b, heads, row_ok, qk_scale, BLOCK_M: tl.constexpr):
    """ALiBi's factor of each tile row in raw score units, ``-slope * LOG2E / qk_scale`` (the key
    loop multiplies raw scores by ``qk_scale`` into log2 units), from the fp32 slope of the row's
    query head ``heads`` in sequence off_b, ``alibi_slopes[off_b * stride_az + head]``; loaded once
    per program. Zeros when ``use_alibi`` is 0 (the slopes are then not read: any address)."""
    alibi_raw = tl.zeros([BLOCK_M], dtype=tl.float32)
    if use_alibi != 0:
        slopes = alibi_slopes + off_b.to(tl.int64) * stride_az
        alibi_raw = tl.load(slopes + heads, mask=row_ok, other=0.0) * (-LOG2E / qk_scale)
    return alibi_raw


@triton.jit
def _record_fault(Faults, fault):
    """OR ``fault`` (0 or FAULT_* bits) into the flag: one atomic, predicated off when 0."""
    tl.atomic_or(Faults, fault, mask=fault != 0, sem="relaxed")


@triton.jit
def attn_decode(
    Q, K, V, Out, LSE, PartO, PartL, BlockTable, CacheSeqlens, CacheStart, Faults, KScale, VScale,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    stride_lz, stride_lh,
    stride_btz,
    stride_ksz, stride_ksh, stride_vsz, stride_vsh,
    batch, num_heads_q, num_heads_k, seqlen_q, seqlen_new, capacity, num_pages, page_size, num_splits,
    sm_scale, window_left, window_right, head_dim, softcap, k_scale, v_scale,
    alibi_slopes, stride_az, use_alibi, Sinks, use_sinks,
    HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, PADDED_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr = 0, V_WIDENED: tl.constexpr = 0,
):
    """Split-KV attention of seqlen_q query rows per sequence against its KV cache.

    Grid: (cdiv(group * seqlen_q, BLOCK_M), num_splits, batch * num_heads_k) with group =
    num_heads_q // num_heads_k. Q and Out are addressed (b, query head, row); LSE at
    ``b*stride_lz + h*stride_lh + row``. With num_splits > 1 the program writes its split's
    normalised output and logsumexp to PartO / PartL (fp32, rows ``((bk*num_splits + split) *
    group*seqlen_q + tile row)``, PartO rows HEAD_DIM wide) for attn_decode_combine. A length or
    table entry out of range (see the module doc) is ORed into ``Faults`` and makes the tile's
    output and logsumexp NaN. ``head_dim``: the rows' width, HEAD_DIM unless PADDED_D.
    ``CacheStart``: each sequence's first key row (FlashAttention-2's ``cache_leftpad``; zeros
    without one): its keys are rows ``[CacheStart[b], len_k)``, the rows before never read.
    ``softcap``: FlashAttention-2's logit softcap, scores ``softcap * tanh(q.k * sm_scale /
    softcap)`` before the masks and the softmax; 0 for none (a run-time value: every variant
    takes it; ``softcap > 0`` needs ``sm_scale != 0``, checked at launch).
    ``KScale``/``VScale``, ``k_scale``/``v_scale``: an fp8 cache's dequantisation scales (see
    :func:`_kv_scales`); variants with a cache of q's own type never read them.
    ``use_alibi != 0``: FlashAttention-2's ALiBi, each scaled score gets ``-slope * |i + len_k -
    seqlen_q - j|`` with ``slope = alibi_slopes[b*stride_az + h]`` (fp32, h the row's query head;
    ``stride_az`` 0 shares one ``(Hq,)`` vector across the batch); 0: the slopes are not read.
    ``use_sinks != 0``: attention sinks, ``Sinks[h]`` (fp32, one logit per query head) joins each
    row's softmax with no value, and LSE includes it; with one split here, in the epilogue, with
    several in attn_decode_combine (the partials stay without it). 0: ``Sinks`` is not read.
    ``V_WIDENED`` (CUDA, an fp8 cache with whole rows): V is read in 4-byte words and widened in
    registers before the P.V dot (:func:`_widened_rows`); without it the dot's operand is gathered
    byte by byte from shared memory.
    """
    PREC: tl.constexpr = "ieee" if Q.dtype.element_ty == tl.float32 else None
    # An fp8 cache's V widened from 4-byte words (configs #4-#6 on sm90), where its rows are
    # whole (PADDED_D=0 promises 16-byte aligned rows and strides; a masked head dim reads as is).
    V_WORDS: tl.constexpr = V_WIDENED and K.dtype.element_ty != Q.dtype.element_ty and not PADDED_D
    BLOCK_D: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_bk = tl.program_id(2)
    off_b = pid_bk // num_heads_k
    off_hk = pid_bk % num_heads_k
    group = num_heads_q // num_heads_k
    rows_total = group * seqlen_q

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < rows_total
    qi = rows % seqlen_q
    heads = off_hk * group + rows // seqlen_q
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    row_mask = _and_dim(row_ok[:, None], offs_d, head_dim, HEAD_DIM, PADDED_D, 1)
    _after_predecessor(PDL)

    # Row offsets in int64: a long query run times its row stride may pass 2**31 elements.
    q_ptrs = (Q + off_b.to(tl.int64) * stride_qz + heads.to(tl.int64)[:, None] * stride_qh
              + qi.to(tl.int64)[:, None] * stride_qm + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_mask, other=0.0)

    len_k, fault = _sequence_length(CacheSeqlens, off_b, seqlen_new, capacity)
    start_b, start_fault = _sequence_start(CacheStart, off_b, len_k, capacity)
    fault = fault | start_fault
    diag = len_k - seqlen_q
    # A side wider than every key is unbounded; capped there, ``diag - left`` cannot wrap.
    unbounded = capacity + seqlen_q
    left = tl.where((window_left < 0) | (window_left > unbounded), unbounded, window_left)
    right = tl.where((window_right < 0) | (window_right > unbounded), unbounded, window_right)
    # Keys the tile's rows may see: its query rows run from q_first to q_last unless the tile
    # crosses into the next head's rows (then it holds both ends of the run). Cut into
    # num_splits runs of blocks.
    first = pid_m * BLOCK_M
    last = tl.minimum(first + BLOCK_M, rows_total) - 1
    one_head = first // seqlen_q == last // seqlen_q
    q_first = tl.where(one_head, first % seqlen_q, 0)
    q_last = tl.where(one_head, last % seqlen_q, seqlen_q - 1)
    lo = tl.maximum(q_first + diag - left, start_b)
    hi = tl.minimum(q_last + 1 + diag + right, len_k)
    hi = tl.maximum(hi, lo)
    lo = lo // BLOCK_N * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
    start = lo + pid_s * per_split
    end = tl.minimum(start + per_split, hi)

    K_head = K + off_hk.to(tl.int64) * stride_kh
    V_head = V + off_hk.to(tl.int64) * stride_vh
    if not PAGED:
        K_head += off_b.to(tl.int64) * stride_kz
        V_head += off_b.to(tl.int64) * stride_vz
    bt_row = BlockTable + off_b.to(tl.int64) * stride_btz

    ks, vs = _kv_scales(KScale, VScale, off_b, off_hk, stride_ksz, stride_ksh, stride_vsz, stride_vsh, k_scale,
                        v_scale, K.dtype.element_ty != Q.dtype.element_ty)
    # The program's KV head is fixed: its K scale folds into the score scale once.
    qk_scale = sm_scale * ks * LOG2E
    if (K.dtype.element_ty != Q.dtype.element_ty) and (Q.dtype.element_ty == tl.bfloat16):
        # An fp8 cache under bf16 queries: the dots run in fp16 (_fp16_rows), the score scale
        # per row, (BLOCK_M,) here and (BLOCK_M, 1) in the key loop.
        q, row_factor = _fp16_rows(q)
        qk_scale = qk_scale / row_factor
        alibi_raw = _alibi_rows(alibi_slopes, stride_az, use_alibi, off_b, heads, row_ok, qk_scale, BLOCK_M)
        qk_scale = qk_scale[:, None]
    else:
        # ALiBi's term in raw score units (slopes need sm_scale != 0: checked at launch).
        alibi_raw = _alibi_rows(alibi_slopes, stride_az, use_alibi, off_b, heads, row_ok, qk_scale, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    page_sign = fault * 0  # int32 0, carried through the key loop
    if PAGED:
        # A block inside one page (pages a multiple of BLOCK_N): one table entry per block;
        # smaller or odd pages: one per 16-row chunk. A uniform branch, both loops in the binary.
        if page_size % BLOCK_N == 0:
            acc, l_i, m_i, page_sign = _attend(acc, l_i, m_i, page_sign, q, K_head, V_head, bt_row, start, end,
                                              start_b, len_k, qi, diag, left, right, qk_scale, softcap, alibi_raw,
                                              use_alibi, page_size, num_pages, stride_kz, stride_kn, stride_vz,
                                              stride_vn, offs_n, offs_d, head_dim, HEAD_DIM, PADDED_D, BLOCK_N, 1,
                                              PREC, V_WORDS)
        else:
            acc, l_i, m_i, page_sign = _attend(acc, l_i, m_i, page_sign, q, K_head, V_head, bt_row, start, end,
                                              start_b, len_k, qi, diag, left, right, qk_scale, softcap, alibi_raw,
                                              use_alibi, page_size, num_pages, stride_kz, stride_kn, stride_vz,
                                              stride_vn, offs_n, offs_d, head_dim, HEAD_DIM, PADDED_D, BLOCK_N, 2,
                                              PREC, V_WORDS)
    else:
        acc, l_i, m_i, page_sign = _attend(acc, l_i, m_i, page_sign, q, K_head, V_head, bt_row, start, end, start_b,
                                          len_k, qi, diag, left, right, qk_scale, softcap, alibi_raw, use_alibi,
                                          page_size, num_pages, stride_kz, stride_kn, stride_vz, stride_vn, offs_n,
                                          offs_d, head_dim, HEAD_DIM, PADDED_D, BLOCK_N, 0, PREC, V_WORDS)

    _successor_may_launch(PDL)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    if K.dtype.element_ty != Q.dtype.element_ty:
        acc = acc * vs  # linear: split partials scaled alike merge unchanged
    lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
    if (use_sinks != 0) & (num_splits == 1):  # several splits: the combine joins the sink
        sink2 = tl.load(Sinks + heads, mask=row_ok, other=float("-inf")) * LOG2E
        factor, lse2 = _with_sink(tl.full([BLOCK_M], 1.0, tl.float32), lse2, sink2)
        acc = acc * factor[:, None]
    lse = lse2 * LN2
    # A faulting sequence answers NaN (never a plausible number); the flag says why.
    fault = fault | tl.where(page_sign < 0, FAULT_PAGE, 0)
    acc = tl.where(fault != 0, float("nan"), acc)
    lse = tl.where(fault != 0, float("nan"), lse)
    _record_fault(Faults, fault)
    o_ptrs = (Out + off_b.to(tl.int64) * stride_oz + heads.to(tl.int64)[:, None] * stride_oh
              + qi.to(tl.int64)[:, None] * stride_om + offs_d[None, :])
    l_ptrs = LSE + off_b.to(tl.int64) * stride_lz + heads.to(tl.int64) * stride_lh + qi
    if num_splits == 1:
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_mask)
        tl.store(l_ptrs, lse, mask=row_ok)
    else:
        base = pid_bk.to(tl.int64) * num_splits * rows_total + rows
        part = base + pid_s * rows_total
        tl.store(PartO + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_mask)
        tl.store(PartL + part, lse, mask=row_ok)


@triton.jit
def _joined(lse, sink):
    """(the output factor, the logsumexp) of a row of natural-log logsumexp ``lse`` joined by a
    sink logit ``sink``: ``exp(lse - lse')`` and ``lse' = logaddexp(lse, sink)``. A row that saw
    no key (``lse`` -inf) gets factor 0 and the sink's logit; a sink of -inf leaves the row bit
    for bit as it was (factor exactly 1, ``lse' = lse + log(1)``); NaN stays NaN."""
    top = tl.maximum(lse, sink)
    top = tl.where(top == float("-inf"), 0.0, top)  # both -inf: no key and a sink of -inf
    new = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
    factor = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - new))
    return factor, new


@triton.jit
def attn_decode_combine(
    Out, LSE, PartO, PartL,
    stride_oz, stride_oh, stride_om,
    stride_lz, stride_lh,
    batch, num_heads_q, num_heads_k, seqlen_q, num_splits, head_dim, Sinks, use_sinks,
    HEAD_DIM: tl.constexpr, PADDED_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = 0,
):
    """Merge attn_decode's split partials: out = sum_s exp(lse_s - lse) * out_s.

    Grid: (group * seqlen_q, batch * num_heads_k, 1), one program per output row. Splits that saw
    no key have lse -inf and weigh 0; a row no split saw outputs 0 and lse -inf. ``use_sinks !=
    0``: the row's head's sink logit ``Sinks[h]`` (fp32) joins the merged row (:func:`_joined`;
    a row no split saw keeps 0 and takes the sink's logit); 0: ``Sinks`` is not read.
    """
    BLOCK_D: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    row = tl.program_id(0)
    pid_bk = tl.program_id(1)
    off_b = pid_bk // num_heads_k
    off_hk = pid_bk % num_heads_k
    group = num_heads_q // num_heads_k
    rows_total = group * seqlen_q
    head = off_hk * group + row // seqlen_q
    qi = row % seqlen_q
    base = pid_bk.to(tl.int64) * num_splits * rows_total + row
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    _after_predecessor(PDL)

    m_vec = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + offs_s
        m_vec = tl.maximum(m_vec, tl.load(PartL + base + s.to(tl.int64) * rows_total, mask=s < num_splits,
                                          other=float("-inf")))
    m = tl.max(m_vec, 0)
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    den = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + offs_s
        s_ok = s < num_splits
        idx = base + s.to(tl.int64) * rows_total
        w = tl.math.exp2((tl.load(PartL + idx, mask=s_ok, other=float("-inf")) - m_sub) * LOG2E)
        o_mask = _and_dim(s_ok[:, None], offs_d, head_dim, HEAD_DIM, PADDED_D, 1)
        o = tl.load(PartO + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=o_mask, other=0.0)
        acc += w[:, None] * o
        den += w
    total = tl.sum(den, 0)
    safe = tl.where(total == 0.0, 1.0, total)
    _successor_may_launch(PDL)
    out = tl.sum(acc, 0) / safe
    lse = tl.where(total == 0.0, float("-inf"), m_sub + tl.log(safe))
    if use_sinks != 0:
        factor, lse = _joined(lse, tl.load(Sinks + head))
        out = out * factor
    o_ptrs = Out + off_b.to(tl.int64) * stride_oz + head.to(tl.int64) * stride_oh + qi.to(tl.int64) * stride_om + offs_d
    if PADDED_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_d < head_dim)
    elif HEAD_DIM != BLOCK_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty))
    tl.store(LSE + off_b.to(tl.int64) * stride_lz + head.to(tl.int64) * stride_lh + qi, lse)


@triton.jit
def _row_tile(num_heads_k, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(sequence, KV head, this program's BLOCK_R row indices, the head dim's offsets) of a
    ``(cdiv(rows, BLOCK_R), batch * num_heads_k)`` grid (the append and pack kernels')."""
    BLOCK_D: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    pid_bk = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    return pid_bk // num_heads_k, pid_bk % num_heads_k, rows, tl.arange(0, BLOCK_D)


@triton.jit
def attn_decode_append(
    KNew, VNew, K, V, BlockTable, CacheSeqlens, Faults, KScale, VScale,
    stride_knz, stride_knh, stride_knm,
    stride_vnz, stride_vnh, stride_vnm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_btz,
    stride_ksz, stride_ksh, stride_vsz, stride_vsh,
    batch, num_heads_k, seqlen_new, capacity, num_pages, page_size, head_dim, k_scale, v_scale,
    HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, PADDED_D: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Write new rows (b, h, i) of KNew / VNew to cache row ``cache_seqlens[b] + i`` of head h.

    Grid: (cdiv(seqlen_new, BLOCK_R), batch * num_heads_k, 1). Rows outside ``[0, capacity)`` or
    whose table entry is outside ``[0, num_pages)`` are not written, and their fault is ORed into
    ``Faults`` (the runtime refuses such calls when it knows the lengths; see the module doc).
    An fp8 cache (K's type is not KNew's) stores each value divided by its head's scale
    (:func:`_kv_scales`, :func:`_quantised`).
    """
    off_b, off_hk, rows, offs_d = _row_tile(num_heads_k, BLOCK_R, HEAD_DIM)
    _after_predecessor(PDL)
    cached = tl.load(CacheSeqlens + off_b)
    live = rows < seqlen_new
    # Compared before the add: a length near the int32 limit cannot wrap into range.
    in_range = (cached >= 0) & (cached <= capacity - seqlen_new)
    ok = live & in_range
    pos = tl.where(ok, cached + rows, 0)
    bt_row = BlockTable + off_b.to(tl.int64) * stride_btz
    k_off, v_off, page_ok = _kv_offsets(bt_row, pos, ok, page_size, num_pages, stride_kz, stride_kn, stride_vz,
                                        stride_vn, PAGED)
    fault = tl.where(in_range, 0, FAULT_LENGTH) | tl.max(tl.where(ok & ~page_ok, FAULT_PAGE, 0), 0)
    ok = ok & page_ok
    K_head = K + off_hk.to(tl.int64) * stride_kh
    V_head = V + off_hk.to(tl.int64) * stride_vh
    if not PAGED:
        K_head += off_b.to(tl.int64) * stride_kz
        V_head += off_b.to(tl.int64) * stride_vz
    mask = _and_dim(ok[:, None], offs_d, head_dim, HEAD_DIM, PADDED_D, 1)
    src = off_b.to(tl.int64) * stride_knz + off_hk.to(tl.int64) * stride_knh + rows[:, None] * stride_knm
    kn = tl.load(KNew + src + offs_d[None, :], mask=mask, other=0.0)
    src = off_b.to(tl.int64) * stride_vnz + off_hk.to(tl.int64) * stride_vnh + rows[:, None] * stride_vnm
    vn = tl.load(VNew + src + offs_d[None, :], mask=mask, other=0.0)
    if K.dtype.element_ty != KNew.dtype.element_ty:
        ks, vs = _kv_scales(KScale, VScale, off_b, off_hk, stride_ksz, stride_ksh, stride_vsz, stride_vsh, k_scale,
                            v_scale, True)
        kn = _quantised(kn, ks, K.dtype.element_ty)
        vn = _quantised(vn, vs, V.dtype.element_ty)
    _successor_may_launch(PDL)
    tl.store(K_head + k_off[:, None] + offs_d[None, :], kn, mask=mask)
    tl.store(V_head + v_off[:, None] + offs_d[None, :], vn, mask=mask)
    _record_fault(Faults, fault)


# --------------------------------------------------------------------------------------------
# Packing a cache for the variable-length forward (long query runs: a prompt against its cache).
# --------------------------------------------------------------------------------------------

@triton.jit
def attn_decode_lengths(CuQ, CuK, SeqFaults, CacheSeqlens, CacheStart, batch, seqlen_q, seqlen_new, capacity,
                        BLOCK_B: tl.constexpr, PDL: tl.constexpr = 0):
    """The variable-length forward's prefix sums for a cache, and each sequence's fault bits.

    Grid: (1, 1, 1). ``CuQ[b] = b * seqlen_q`` (the query rows, dense, packed as they lie);
    ``CuK[b + 1] - CuK[b]``: sequence b's live cache rows ``[CacheStart[b], cache_seqlens[b] +
    seqlen_new)``, its length and start clamped as ``attn_decode`` clamps them. ``SeqFaults[b]``:
    FAULT_LENGTH when a clamp was needed, else 0 (``attn_decode_pack`` ORs FAULT_PAGE into it, and
    ``attn_decode_poison`` answers NaN for every sequence it flags). A faulting sequence keeps at
    least one packed row, which the pack kernel fills with NaN. Totals stay in int32: the runtime
    bounds ``batch * capacity``.
    """
    _after_predecessor(PDL)
    offs = tl.arange(0, BLOCK_B)
    tl.store(CuK + offs, 0, mask=offs == 0)
    tl.store(CuQ + offs, 0, mask=offs == 0)
    carry = tl.sum(offs * 0, 0)
    for b0 in range(0, batch, BLOCK_B):
        bs = b0 + offs
        ok = bs < batch
        cached = tl.load(CacheSeqlens + bs, mask=ok, other=0)
        start = tl.load(CacheStart + bs, mask=ok, other=0)
        bad = (cached < 0) | (cached > capacity - seqlen_new) | (start < 0) | (start > capacity)
        len_k = tl.minimum(tl.maximum(cached, 0), capacity - seqlen_new) + seqlen_new
        first = tl.minimum(tl.maximum(start, 0), len_k)
        n = tl.where(bad, tl.maximum(len_k - first, 1), len_k - first)
        n = tl.where(ok, n, 0)
        tl.store(CuK + 1 + bs, carry + tl.cumsum(n, 0), mask=ok)
        tl.store(CuQ + 1 + bs, (bs + 1) * seqlen_q, mask=ok)
        tl.store(SeqFaults + bs, tl.where(bad, FAULT_LENGTH, 0), mask=ok)
        carry += tl.sum(n, 0)
    _successor_may_launch(PDL)


@triton.jit
def attn_decode_pack(
    K, V, KOut, VOut, CuK, BlockTable, CacheSeqlens, CacheStart, SeqFaults, Faults,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_okm, stride_okh,
    stride_ovm, stride_ovh,
    stride_btz,
    batch, num_heads_k, seqlen_new, capacity, num_pages, page_size, head_dim,
    HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, PADDED_D: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Copy sequence b's live rows of KV head h, cache rows ``[CacheStart[b], cache_seqlens[b] +
    seqlen_new)`` (after the append), to packed rows ``CuK[b] + i`` of KOut / VOut: the layout of
    the variable-length forward, which then serves a long query run against the cache at its speed.
    Packed rows are ``HEAD_DIM`` wide (zeros past ``head_dim``) and 16-byte aligned.

    Grid: (cdiv(capacity, BLOCK_R), batch * num_heads_k, 1). Lengths, starts and table entries
    are clamped as ``attn_decode`` clamps them (never a read outside the cache); a sequence with
    a length fault has all its packed rows written NaN, and a row whose table entry is outside
    ``[0, num_pages)`` is written NaN and FAULT_PAGE ORed into ``SeqFaults[b]`` and ``Faults``.
    """
    off_b, off_hk, rows, offs_d = _row_tile(num_heads_k, BLOCK_R, HEAD_DIM)
    _after_predecessor(PDL)
    len_k, fault = _sequence_length(CacheSeqlens, off_b, seqlen_new, capacity)
    first, start_fault = _sequence_start(CacheStart, off_b, len_k, capacity)
    fault = fault | start_fault
    n = tl.where(fault != 0, tl.maximum(len_k - first, 1), len_k - first)
    if tl.program_id(0) * BLOCK_R < n:
        live = rows < n
        pos = first + rows
        src_ok = live & (pos < len_k) & (fault == 0)
        bt_row = BlockTable + off_b.to(tl.int64) * stride_btz
        k_off, v_off, page_ok = _kv_offsets(bt_row, tl.where(src_ok, pos, 0), src_ok, page_size, num_pages,
                                            stride_kz, stride_kn, stride_vz, stride_vn, PAGED)
        bad_row = live & ((fault != 0) | (src_ok & ~page_ok))
        page_fault = tl.max(tl.where(src_ok & ~page_ok, FAULT_PAGE, 0), 0)
        K_head = K + off_hk.to(tl.int64) * stride_kh
        V_head = V + off_hk.to(tl.int64) * stride_vh
        if not PAGED:
            K_head += off_b.to(tl.int64) * stride_kz
            V_head += off_b.to(tl.int64) * stride_vz
        load = _and_dim((src_ok & page_ok)[:, None], offs_d, head_dim, HEAD_DIM, PADDED_D, 1)
        k = tl.load(K_head + k_off[:, None] + offs_d[None, :], mask=load, other=0.0)
        v = tl.load(V_head + v_off[:, None] + offs_d[None, :], mask=load, other=0.0)
        k = tl.where(bad_row[:, None], float("nan"), k)
        v = tl.where(bad_row[:, None], float("nan"), v)
        dest = (tl.load(CuK + off_b) + rows).to(tl.int64)
        # Packed rows are HEAD_DIM wide whatever the cache's head dim: columns past it are
        # written 0 (the masked load's), so the forward reads them in place at the bucket.
        store = live[:, None] & (offs_d[None, :] < HEAD_DIM)
        _successor_may_launch(PDL)
        tl.store(KOut + dest[:, None] * stride_okm + off_hk.to(tl.int64) * stride_okh + offs_d[None, :],
                 k.to(KOut.dtype.element_ty), mask=store)
        tl.store(VOut + dest[:, None] * stride_ovm + off_hk.to(tl.int64) * stride_ovh + offs_d[None, :],
                 v.to(VOut.dtype.element_ty), mask=store)
        tl.atomic_or(SeqFaults + off_b, page_fault, mask=page_fault != 0, sem="relaxed")
        _record_fault(Faults, fault | page_fault)
    else:
        _successor_may_launch(PDL)


@triton.jit
def attn_decode_poison(Out, LSE, SeqFaults, stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                       batch, num_heads_q, seqlen_q, head_dim,
                       HEAD_DIM: tl.constexpr, PADDED_D: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr = 0):
    """NaN over the output and logsumexp rows of every sequence ``SeqFaults`` flags, after the
    variable-length forward (``attn_decode``'s answer for a faulting sequence: never a plausible
    one). Grid: (cdiv(seqlen_q, BLOCK_M), batch * num_heads_q, 1); a clean sequence's programs
    store nothing."""
    BLOCK_D: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // num_heads_q
    off_h = pid_bh % num_heads_q
    _after_predecessor(PDL)
    bad = tl.load(SeqFaults + off_b) != 0
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (rows < seqlen_q) & bad
    nan = tl.full([BLOCK_M, BLOCK_D], float("nan"), dtype=tl.float32)
    o_ptrs = (Out + off_b.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh
              + rows.to(tl.int64)[:, None] * stride_om + offs_d[None, :])
    _successor_may_launch(PDL)
    tl.store(o_ptrs, nan.to(Out.dtype.element_ty), mask=_and_dim(ok[:, None], offs_d, head_dim, HEAD_DIM, PADDED_D, 1))
    tl.store(LSE + off_b.to(tl.int64) * stride_lz + off_h.to(tl.int64) * stride_lh + rows,
             tl.full([BLOCK_M], float("nan"), dtype=tl.float32), mask=ok)


# --------------------------------------------------------------------------------------------
# Registry declarations.
# --------------------------------------------------------------------------------------------

DTYPES = ("fp16", "bf16", "fp32")
# What the default build holds: what most decoders run (fp16/bf16 at head dims 64 and 128), as
# is and masked (PADDED_D=1: every head dim 1..64 and 65..128, e.g. 80 and 96 on 128).
DEFAULT_HEAD_DIMS = (64, 128)
# Beyond the default set, what tests/runtime/test_decode_gpu.py and test_decode_kvcache_gpu.py
# launch: (dtype, HEAD_DIM) as is (PADDED_D=0) and masked (PADDED_D=1: fp16 at 256 serves the
# head dim 256 masked, the path of any bucket the images hold only masked).
GPUTEST = (("fp32", 64), ("fp32", 128), ("fp16", 80), ("bf16", 256), ("fp16", 32))
GPUTEST_PADDED = (("fp16", 256),)


#: fp8 (e4m3) KV caches, by Triton type, and the targets that hold their variants: OCP e4m3fn
#: (torch's float8_e4m3fn) where the hardware converts it (sm90, gfx950), e4m3fnuz (torch's
#: float8_e4m3fnuz, another exponent bias and no infinities) on gfx942, whose hardware has only it.
FP8_KV = {"fp8e4nv": ("sm90", "gfx950"), "fp8e4b8": ("gfx942",)}
#: The cache's element type (attn_decode and attn_decode_append's ``KV_DTYPE``): q's own, or fp8.
KV_DTYPES = (*DTYPES, *FP8_KV)
#: Head dims of the fp8 cache's variants in the default set (bf16 and fp16 queries, as is only).
FP8_DEFAULT_HEAD_DIMS = (128,)
#: ... and in gputest (as is and masked), for tests/runtime/test_decode_fp8_gpu.py.
FP8_GPUTEST_HEAD_DIMS = (64, 128)


def kv_excluded(spec: dict, target: object) -> str | None:
    """A cache type other than q's is fp8 with fp16/bf16 queries, on the targets of ``FP8_KV``."""
    kv = spec["KV_DTYPE"]
    if kv == spec["dtype"]:
        return None
    if kv not in FP8_KV:
        return f"a {kv} cache serves {kv} queries only"
    if spec["dtype"] not in ("fp16", "bf16"):
        return "an fp8 cache serves fp16 and bf16 queries"
    if target.arch not in FP8_KV[kv]:
        return f"{kv} caches are compiled for {', '.join(FP8_KV[kv])} only"
    return None


def _fp8(spec: dict) -> bool:
    return spec.get("KV_DTYPE", spec["dtype"]) != spec["dtype"]


def in_decode_default_set(spec: dict, target: object) -> bool:
    """fp16/bf16 at head dims 64 and 128, contiguous and paged caches, as is and masked; fp8
    caches at ``FP8_DEFAULT_HEAD_DIMS`` as is."""
    if spec["dtype"] not in ("fp16", "bf16") or spec["HEAD_DIM"] not in DEFAULT_HEAD_DIMS:
        return False
    return not _fp8(spec) or (spec["HEAD_DIM"] in FP8_DEFAULT_HEAD_DIMS and not spec.get("PADDED_D"))


def in_decode_gputest_set(spec: dict, target: object) -> bool:
    """The default set plus the (dtype, head dim) pairs the GPU tests launch."""
    if _fp8(spec):
        return spec["HEAD_DIM"] in FP8_GPUTEST_HEAD_DIMS
    pairs = GPUTEST_PADDED if spec.get("PADDED_D") else GPUTEST
    return in_decode_default_set(spec, target) or (spec["dtype"], spec["HEAD_DIM"]) in pairs


def default_decode_configs(spec: dict, target: object) -> tuple[int, ...]:
    """The default set's decode configs: #0 everywhere, and on sm90 the prefill tile #3 (a chunk
    of a prompt against the cache at about twice #0's speed: docs/performance.md, "Decode")."""
    return (0, 3) if target.arch == "sm90" and spec["dtype"] != "fp32" else (0,)


def uses_pdl(target: object) -> bool:
    """Programmatic dependent launch for the decode chain (append, decode, combine): CUDA sm90
    and later (``griddepcontrol`` is an sm90 PTX instruction); sm80 and HIP launch plainly."""
    return target.backend == "cuda" and int(target.arch.removeprefix("sm")) >= 90


def _pdl(constexprs: dict, target: object, options: dict | None = None) -> dict:
    """``ConfigDecl`` fields for ``constexprs`` on ``target``: the ``PDL`` constexpr and, where
    it is on, the ``launch_pdl`` compile option (the catalog's launch.pdl, which makes the runtime
    launch with programmatic stream serialization)."""
    pdl = uses_pdl(target)
    return {"constexprs": {**constexprs, "PDL": int(pdl)},
            "options": {**(options or {}), **({"launch_pdl": True} if pdl else {})}}


def _cfg(target: object, bm: int, bn: int, warps: int, stages: int, options: dict | None = None,
         v_widened: int = 0) -> ConfigDecl:
    return ConfigDecl(num_warps=warps, num_stages=stages,
                      **_pdl({"BLOCK_M": bm, "BLOCK_N": bn, "V_WIDENED": v_widened}, target, options))


def decode_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    """Decode tiles by target and head dim, the expected fastest first (config 0 is launched).

    Decoding is bound by reading K/V: the tile is 16 query rows (a GQA group times the query
    rows, padded) by BLOCK_N keys, and the pipeline stages keep several K/V tiles in flight per
    program. sm90 alternates: #1 128-key steps with 8 warps (half the loop overhead, twice the
    bytes per stage), #2 four stages (three K/V tiles in flight, still two programs per SM at
    D=128), which the catalog rule (``decode_tuning``) picks for batches that fill the GPU
    without splits; #3 the prefill tile, 128 query rows (64 at D=256) over three stages, for long
    query runs (a prompt's chunk against the cache; ``SM90_PREFILL_ROWS``), where a 16-row tile
    reads every K/V block eight times as often. ``bench/decode.py --config`` forces any. Paged
    caches get more stages for the same ring (``_stages``).
    """
    d = next_power_of_2(spec["HEAD_DIM"])
    if spec["dtype"] == "fp32":
        return (_cfg(target, 16, 32, 4, _stages(2, spec, target) if target.backend == "cuda" else 1),)
    if target.backend == "hip":
        opts = {"waves_per_eu": 2}
        if target.arch.startswith("gfx9"):
            opts["matrix_instr_nonkdim"] = 16
        return (_cfg(target, 16, 64 if d <= 128 else 32, 4, 1, opts),)
    bn = 64 if d <= 128 else 32
    # K and V tiles per stage: 2 * bn * d * 2 bytes. Config 0 keeps two programs per SM (one's
    # softmax and dots overlap the other's loads); the others trade that for more bytes in flight.
    stage = 4 * bn * d
    limit = SHARED_LIMIT.get(target.arch, 99 * 1024)
    two_per_sm = max(2, min(3, limit // 2 // stage))
    if target.arch == "sm90":
        wide = d <= 128
        found = (_cfg(target, 16, bn, 4, _stages(two_per_sm, spec, target)),
                 _cfg(target, 16, 2 * bn, 8, _stages(2, spec, target)),
                 _cfg(target, 16, bn, 4, _stages(4, spec, target)),
                 _cfg(target, 128 if wide else 64, bn, 8 if wide else 4, _stages(3 if wide else 2, spec, target)))
        if spec.get("KV_DTYPE", spec["dtype"]) != spec["dtype"] and not spec.get("PADDED_D"):
            # #4, #5: configs #0 and #2 with an fp8 V widened from 4-byte words before its dot
            # (docs/attention.md, "FP8 KV caches": no byte loads from shared memory); whole rows
            # only (a masked head dim promises no 4-byte alignment). #6: #5 with six stages, 80 KB
            # of K/V in flight (a bf16 cache's #2: 96 KB; fp8's #2: 48 KB) in the same 102 KB of
            # shared memory as bf16's #2, still two programs per SM. #7, #8: 128-key blocks (three
            # stages, 4 and 8 warps): the per-block work (row maxima, barriers, loop control) over
            # twice the keys, 617 instructions a 64 keys with 4 warps where #4 takes 711.
            found += (_cfg(target, 16, bn, 4, _stages(two_per_sm, spec, target), v_widened=1),
                      _cfg(target, 16, bn, 4, _stages(4, spec, target), v_widened=1),
                      _cfg(target, 16, bn, 4, _stages(6, spec, target), v_widened=1),
                      _cfg(target, 16, 2 * bn, 4, _stages(3, spec, target), v_widened=1),
                      _cfg(target, 16, 2 * bn, 8, _stages(3, spec, target), v_widened=1))
        return found
    return (_cfg(target, 16, bn, 4, _stages(two_per_sm, spec, target)),)


def _stages(stages: int, spec: dict, target: object) -> int:
    """``num_stages`` that gives a paged cache on CUDA the K/V copies in flight that ``stages``
    gives a contiguous one.

    Triton's software pipeliner (3.6) gives a direct load ``num_stages - 1`` shared-memory
    buffers but a load whose address comes from another load of the loop (K/V rows through the
    block table) only ``(num_stages - 1) // 2``: the page-id copy takes its own stages. At 3
    stages the paged kernel kept one K/V buffer and waited for every copy (``async_wait num =
    0``; 39 KB of shared memory against 70 KB contiguous: 0.65-0.7x the contiguous speed on an
    H200). ``2 * stages - 1`` gives it the contiguous ring (tests/builder/test_decode_compile.py
    pins equal buffer counts)."""
    return 2 * stages - 1 if spec.get("PAGED") and target.backend == "cuda" else stages


# sm90: from this many (sequence, KV head) pairs on, the call fills the GPU without splits (two
# programs on each of the H200's 132 SMs, 80% full) and is a pure stream of K/V; there config #2
# (4 stages, 3 K/V tiles in flight per program, still two programs per SM at D=128) measured
# 0.97-1.00x cuDNN where config #0 got 0.87-0.88x (B=64, 8 KV heads, 2k-32k cache). Below it the
# splits already give every SM work and the two measured within 2%.
SM90_DEEP_FROM = 212
# sm90: from this many query rows per (sequence, KV head) pair on (the GQA group times the query
# rows: a chunk of a prompt, a long draft), config #3's prefill tile (128 query rows, 8 warps,
# three K/V stages) reuses each K/V block for 8x the rows of the 16-row decode tiles.
SM90_PREFILL_ROWS = 256


def decode_tuning(target: object) -> list[dict]:
    """The catalog's rules for ``target`` (see aotriton_rt/ops/decode.py, ``split_rule``): on
    sm90, config #2 (the deeper pipeline) for calls of at least ``SM90_DEEP_FROM`` (sequence, KV
    head) pairs; everywhere the split rule: fill ``waves`` resident programs per SM (config 0's
    occupancy: two on sm80/sm90, whose shared memory holds two 3-stage rings; two on CDNA/RDNA,
    one stage), splits of at least 4 key blocks, at most 64."""
    splits = {"waves": 2, "min_blocks": 4, "max_splits": 64}
    if target.arch != "sm90":
        return [{"splits": splits}]
    return [{"min_rows": SM90_PREFILL_ROWS, "config": 3, "splits": splits},
            {"min_batch_heads": SM90_DEEP_FROM, "config": 2, "splits": splits}, {"splits": splits}]


def combine_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    """Eight splits at a time; one stage (the loop is two short passes)."""
    return (ConfigDecl(num_warps=4, num_stages=1, **_pdl({"BLOCK_S": 8}, target)),)


def append_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    return (ConfigDecl(num_warps=4, num_stages=1, **_pdl({"BLOCK_R": 16}, target)),)


# K and V are typed by the cache's dtype (KV_DTYPE: q's own, or an fp8 format with its scales).
_SCALES = {"KScale": "*fp32", "VScale": "*fp32"}
_DECODE_SIG = {**signature_of(attn_decode, {
    "Q": "*{dtype}", "K": "*{KV_DTYPE}", "V": "*{KV_DTYPE}", "Out": "*{dtype}", "LSE": "*fp32", "PartO": "*fp32",
    "PartL": "*fp32", "BlockTable": "*i32", "CacheSeqlens": "*i32", "CacheStart": "*i32",
    "Faults": "*i32", **_SCALES, "alibi_slopes": "*fp32", "Sinks": "*fp32"}), "k_scale": "fp32", "v_scale": "fp32"}
# Lengths, block tables and scales may be any int32 / fp32 views (e.g. a slice of a longer array).
_INDEX_POINTERS = ("BlockTable", "CacheSeqlens", "CacheStart", "Faults", *_SCALES)
_DECODE_DIV = {**{n: d for n, d in divisibility_of(_DECODE_SIG, aligned=("q", "k", "v", "o")).items()
                  if n not in _INDEX_POINTERS}, "page_size": 16}
_COMBINE_SIG = signature_of(attn_decode_combine, {"Out": "*{dtype}", "LSE": "*fp32", "PartO": "*fp32",
                                                  "PartL": "*fp32", "Sinks": "*fp32"})
_COMBINE_DIV = divisibility_of(_COMBINE_SIG, aligned=("o",))
_APPEND_SIG = {**signature_of(attn_decode_append, {
    "KNew": "*{dtype}", "VNew": "*{dtype}", "K": "*{KV_DTYPE}", "V": "*{KV_DTYPE}", "BlockTable": "*i32",
    "CacheSeqlens": "*i32", "Faults": "*i32", **_SCALES}), "k_scale": "fp32", "v_scale": "fp32"}
_APPEND_DIV = {**{n: d for n, d in divisibility_of(_APPEND_SIG, aligned=("kn", "vn", "k", "v")).items()
                  if n not in _INDEX_POINTERS}, "page_size": 16}
_LENGTHS_SIG = signature_of(attn_decode_lengths, {"CuQ": "*i32", "CuK": "*i32", "SeqFaults": "*i32",
                                                  "CacheSeqlens": "*i32", "CacheStart": "*i32"})
_LENGTHS_DIV = {n: 1 for n in ("CuQ", "CuK", "SeqFaults", "CacheSeqlens", "CacheStart")}
_PACK_SIG = signature_of(attn_decode_pack, {
    "K": "*{dtype}", "V": "*{dtype}", "KOut": "*{dtype}", "VOut": "*{dtype}", "CuK": "*i32", "BlockTable": "*i32",
    "CacheSeqlens": "*i32", "CacheStart": "*i32", "SeqFaults": "*i32", "Faults": "*i32"})
_PACK_DIV = {**{n: d for n, d in divisibility_of(_PACK_SIG, aligned=("k", "v", "ok", "ov")).items()
                if n not in (*_INDEX_POINTERS, "CuK", "SeqFaults")}, "page_size": 16}
_POISON_SIG = signature_of(attn_decode_poison, {"Out": "*{dtype}", "LSE": "*fp32", "SeqFaults": "*i32"})
_POISON_DIV = {n: d for n, d in divisibility_of(_POISON_SIG, aligned=("o",)).items() if n != "SeqFaults"}
# The caller's arrays read or written along the head dim (pointer, then its strides' letter):
# PADDED_D=1 variants promise nothing of them (rows of any width, any element-aligned address).
_CALLER_ROWS = {"Q": "q", "K": "k", "V": "v", "Out": "o", "KNew": "kn", "VNew": "vn"}


def _per_padding(div: dict) -> tuple:
    """(divisibility, stride checks) as functions of the spec: ``div`` and its stride checks for
    PADDED_D=0; for PADDED_D=1, ``div`` without the caller's rows (pointers and strides)."""
    strides = {f"stride_{t}{s}" for t in _CALLER_ROWS.values() for s in ("z", "h", "m", "n")}
    masked = {n: d for n, d in div.items() if n not in _CALLER_ROWS and n not in strides}

    def divisibility(spec: dict) -> dict:
        return masked if spec.get("PADDED_D") else div

    def checks(spec: dict) -> tuple[str, ...]:
        return stride_checks(divisibility(spec))

    return divisibility, checks


def _head_dim_checks(spec: dict) -> tuple[str, ...]:
    """The run-time head dim: the bucket itself, or for PADDED_D=1 any width up to it."""
    return ("head_dim >= 1", "head_dim <= HEAD_DIM") if spec.get("PADDED_D") else ("head_dim == HEAD_DIM",)


_DECODE_DIVS, _DECODE_STRIDES = _per_padding(_DECODE_DIV)
_COMBINE_DIVS, _COMBINE_STRIDES = _per_padding(_COMBINE_DIV)
_APPEND_DIVS, _APPEND_STRIDES = _per_padding(_APPEND_DIV)
_PACK_DIVS, _PACK_STRIDES = _per_padding(_PACK_DIV)
_POISON_DIVS, _POISON_STRIDES = _per_padding(_POISON_DIV)
_SHAPE_CHECKS = ("num_heads_k >= 1", "num_heads_q % num_heads_k == 0", "seqlen_q >= 1",
                 f"seqlen_q <= {MAX_SEQLEN_Q}", f"num_heads_q // num_heads_k * seqlen_q <= {MAX_GROUP_ROWS}",
                 "batch * num_heads_k <= 65535")
_PAGE_CHECKS = ("page_size >= 16", "page_size % 16 == 0", "num_pages >= 1", "capacity >= 0")
# The logit softcap: 0 (none) or positive (NaN fails both), and a cap divides by the scale; so
# does ALiBi's factor in raw score units. (With both, the kernel caps, then adds ALiBi's term:
# FlashAttention-2's order; the runtime refuses such calls, as aotriton_rt.attention does.)
_SOFTCAP_CHECKS = ("softcap >= 0", "softcap == 0 or sm_scale != 0", "use_alibi == 0 or sm_scale != 0")
_SETS = {"default": in_decode_default_set, "gputest": in_decode_gputest_set}


def _in_route_default_set(spec: dict, target: object) -> bool:
    """The route's kernels in the default build: sm90 (where the varlen forward they feed was
    measured), fp16/bf16 at head dims 64 and 128 (the route runs compiled head dims only)."""
    return target.arch == "sm90" and (not spec or in_decode_default_set(spec, target))


def _in_route_gputest_set(spec: dict, target: object) -> bool:
    return not spec or in_decode_gputest_set(spec, target)


_ROUTE_SETS = {"default": _in_route_default_set, "gputest": _in_route_gputest_set}
_AXES = {"dtype": DTYPES, "HEAD_DIM": HEAD_DIM_BUCKETS}

KERNELS = [
    KernelDecl(
        name="attn_decode",
        fn=attn_decode,
        signature=_DECODE_SIG,
        axes={**_AXES, "PAGED": (0, 1), "PADDED_D": (0, 1), "KV_DTYPE": KV_DTYPES},
        exclude=kv_excluded,
        configs=decode_configs,
        grid=("cdiv(num_heads_q // num_heads_k * seqlen_q, BLOCK_M)", "num_splits", "batch * num_heads_k"),
        divisibility=_DECODE_DIVS,
        sets=_SETS,
        # sm90's deeper-pipeline config (#2, picked by decode_tuning for calls that fill the GPU)
        # and #1 only in gputest and full: the default build leaves out that rule with them.
        set_configs={"default": default_decode_configs},
        tuning=decode_tuning,
        checks=lambda spec: _SHAPE_CHECKS + _PAGE_CHECKS + _head_dim_checks(spec)
        + ("num_splits >= 1", "num_splits <= 65535", "seqlen_new >= 0") + _SOFTCAP_CHECKS + _DECODE_STRIDES(spec),
    ),
    KernelDecl(
        name="attn_decode_combine",
        fn=attn_decode_combine,
        signature=_COMBINE_SIG,
        axes={**_AXES, "PADDED_D": (0, 1)},
        configs=combine_configs,
        grid=("num_heads_q // num_heads_k * seqlen_q", "batch * num_heads_k", "1"),
        divisibility=_COMBINE_DIVS,
        sets=_SETS,
        checks=lambda spec: _SHAPE_CHECKS + _head_dim_checks(spec) + ("num_splits >= 1",) + _COMBINE_STRIDES(spec),
    ),
    KernelDecl(
        name="attn_decode_append",
        fn=attn_decode_append,
        signature=_APPEND_SIG,
        axes={**_AXES, "PAGED": (0, 1), "PADDED_D": (0, 1), "KV_DTYPE": KV_DTYPES},
        exclude=kv_excluded,
        configs=append_configs,
        grid=("cdiv(seqlen_new, BLOCK_R)", "batch * num_heads_k", "1"),
        divisibility=_APPEND_DIVS,
        sets=_SETS,
        checks=lambda spec: ("num_heads_k >= 1", "batch * num_heads_k <= 65535", "seqlen_new >= 1") + _PAGE_CHECKS
        + _head_dim_checks(spec) + _APPEND_STRIDES(spec),
    ),
    # The long-query-run route: prefix sums and packed K/V for the variable-length forward, and
    # NaN for the sequences whose lengths or table entries were out of range.
    KernelDecl(
        name="attn_decode_lengths",
        sets=_ROUTE_SETS,
        fn=attn_decode_lengths,
        signature=_LENGTHS_SIG,
        configs=lambda spec, target: (ConfigDecl(num_warps=4, num_stages=1, **_pdl({"BLOCK_B": 1024}, target)),),
        grid=("1", "1", "1"),
        divisibility=lambda spec: _LENGTHS_DIV,
        checks=lambda spec: ("batch >= 1", "seqlen_q >= 1", f"seqlen_q <= {MAX_SEQLEN_Q}", "seqlen_new >= 0",
                             "capacity >= 0", "batch * capacity <= 2147483647"),
    ),
    KernelDecl(
        name="attn_decode_pack",
        fn=attn_decode_pack,
        signature=_PACK_SIG,
        axes={**_AXES, "PAGED": (0, 1), "PADDED_D": (0,)},
        configs=lambda spec, target: (ConfigDecl(num_warps=4, num_stages=1, **_pdl({"BLOCK_R": 32}, target)),),
        grid=("cdiv(capacity, BLOCK_R)", "batch * num_heads_k", "1"),
        divisibility=_PACK_DIVS,
        sets=_ROUTE_SETS,
        checks=lambda spec: ("num_heads_k >= 1", "batch * num_heads_k <= 65535", "seqlen_new >= 0")
        + _PAGE_CHECKS + _head_dim_checks(spec) + _PACK_STRIDES(spec),
    ),
    KernelDecl(
        name="attn_decode_poison",
        fn=attn_decode_poison,
        signature=_POISON_SIG,
        axes={**_AXES, "PADDED_D": (0,)},
        configs=lambda spec, target: (ConfigDecl(num_warps=4, num_stages=1, **_pdl({"BLOCK_M": 64}, target)),),
        grid=("cdiv(seqlen_q, BLOCK_M)", "batch * num_heads_q", "1"),
        divisibility=_POISON_DIVS,
        sets=_ROUTE_SETS,
        checks=lambda spec: ("batch * num_heads_q <= 65535", "seqlen_q >= 1") + _head_dim_checks(spec)
        + _POISON_STRIDES(spec),
    ),
]
