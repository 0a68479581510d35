"""FP8 (e4m3) attention forward for inference, written for ahead-of-time compilation.

Q, K and V are e4m3 with FlashAttention-3's descale factors: the real value of an element is its
fp8 value times the factor of its (sequence, key/value head), read from fp32 arrays
``q_descale``/``k_descale``/``v_descale`` at ``b * stride_<x>dz + h_kv * stride_<x>dh`` (strides 0
broadcast one factor). ``q_descale * k_descale`` folds into the softmax scale of each program and
``v_descale`` into its output, so the loop runs on the fp8 values.

As in FlashAttention-3, the softmax probabilities P (in [0, 1]) are rounded to e4m3 for the P·V
product: 3 mantissa bits, a relative error of at most 2^-4 per probability (round to nearest),
and probabilities below e4m3's smallest subnormal (2^-9 OCP, 2^-10 fnuz) of the row's maximum
become 0. The row sums that normalise the output are taken before the rounding, in fp32.

Everything else follows ``attn_fwd`` (attention.py's module docs): addressing, varlen packing,
mask modes 0/1/2 with ``causal_align`` and windows, GQA, the natural-log LSE, the causal
programs' pairing of query blocks. No bias, dropout, softcap or ALiBi.

V is read transposed, ``V^T[z, h, d, n]`` with the keys contiguous (``stride_vd`` between head-dim
rows; the rows past the head dim zero): Hopper's FP8 wgmma reads both operands K-major from shared
memory, for P·V that is V^T. Fed a row-major V tile, Triton 3.6 still emits the FP8 wgmma but
transposes each tile through registers into shared memory with byte-wide stores, which made the
forward 2.7x slower on the H200. The operator transposes the caller's V with
``attn_fp8_v_transpose`` first (one read and one write of V, ~3% of a long forward):
docs/attention.md, "FP8 forward (inference)".
"""

from __future__ import annotations

import triton
import triton.language as tl

# The head dims compiled (others run zero-padded on the next) and the dtypes, by the runtime's
# names (aotriton_rt.ops.attention.family: FP8_HEAD_DIMS, FP8_DTYPES, FP8_OUT_DTYPES, FP8_ARCH_DTYPES).
from aotriton_rt.ops.attention.family import (  # noqa: E402
    FP8_ARCH_DTYPES,
    FP8_DTYPES,
    FP8_HEAD_DIMS,
    FP8_OUT_DTYPES,
    FP8_V_TRANSPOSE,
    FWD_FP8,
)
from builder.kernels.attention import LN2, LOG2E, _causal_order, _sequence, _span, _window  # noqa: F401


@triton.jit
def _fp8_block(acc, l_i, m_i, q, start_n, k_ptrs, v_ptrs, offs_m, offs_n, offs_dk, offs_dv, seqlen_k,
               diag, left, right, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               VARLEN: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) by the key block at start_n (attention.py's
    ``_fwd_block`` without bias, dropout, softcap or ALiBi; P rounded to V's fp8 type)."""
    BLOCK_DK: tl.constexpr = q.shape[1]
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
    qk = tl.dot(q, k)
    if MASKED:
        qk = qk * qk_scale
        if CAUSAL != 0:
            rel = cols[None, :] - offs_m[:, None] - diag
            right_i = tl.minimum(right, seqlen_k - 1 - diag - offs_m)
            visible = (rel >= -left) & (rel <= right_i[:, None])
        else:
            visible = offs_n[None, :] < seqlen_k - start_n
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    l_ij = tl.sum(p, 1)
    acc = acc * alpha[:, None]
    # V^T's rows past the head dim are zeros (attn_fp8_v_transpose writes the bucket's width).
    if MASKED and VARLEN:
        v = tl.load(v_ptrs, mask=cols[:, None] < seqlen_k, other=0.0)
    elif MASKED:
        # Dense V^T is zero from seqlen_k to its width, a multiple of 16: a bound that is one too
        # keeps the loads 16 bytes wide (a mask at seqlen_k itself made them single bytes, and the
        # causal forward 1.7x slower on the H200). P is 0 for those keys anyway.
        v = tl.load(v_ptrs, mask=cols[:, None] < (seqlen_k + 15) // 16 * 16, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = tl.dot(p.to(v.dtype), v, acc)
    l_i = l_i * alpha + l_ij
    return acc, l_i, m_new


@triton.jit
def _fp8_blocks(acc, l_i, m_i, q, K_base, V_base, stride_kn, stride_vd, start, end,
                offs_m, offs_n, offs_dk, offs_dv, seqlen_k, diag, left, right, qk_scale,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_N: tl.constexpr, VARLEN: tl.constexpr):
    k_ptrs = K_base + offs_n[None, :] * stride_kn + offs_dk[:, None] + start * stride_kn
    # A (keys, dim) tile of V^T (keys contiguous): what the FP8 wgmma reads K-major.
    v_ptrs = V_base + offs_n[:, None] + offs_dv[None, :].to(tl.int64) * stride_vd + start
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _fp8_block(acc, l_i, m_i, q, start_n, k_ptrs, v_ptrs, offs_m, offs_n, offs_dk, offs_dv,
                                   seqlen_k, diag, left, right, qk_scale, MASKED, CAUSAL, HEAD_DIM, HEAD_DIM_V,
                                   VARLEN)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N
    return acc, l_i, m_i


@triton.jit
def _fp8_tile(pid_m, Q_head, O_head, L_head, K_base, V_base, stride_qm, stride_kn, stride_vd, stride_om,
              len_q, len_k, qk_scale, v_scale, window_left, window_right, causal_align,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr):
    """Output rows and logsumexp of query block pid_m of one (sequence, head); ``qk_scale`` is
    the descaled softmax scale in log2 units, ``v_scale`` V's descale factor."""
    BLOCK_DK: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    BLOCK_DV: tl.constexpr = triton.next_power_of_2(HEAD_DIM_V)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    qmask = offs_m[:, None] < len_q
    if HEAD_DIM != BLOCK_DK:
        qmask = qmask & (offs_dk[None, :] < HEAD_DIM)
    q = tl.load(Q_head + offs_m[:, None].to(tl.int64) * stride_qm + offs_dk[None, :], mask=qmask, other=0.0)

    diag, left, right = _window(len_q, len_k, window_left, window_right, causal_align, CAUSAL)
    if CAUSAL != 0:
        lo, f1, f2, hi = _span(start_m, BLOCK_M, len_k, diag, left, right, BLOCK_N)
    else:
        lo = 0
        f1 = 0
        f2 = len_k // BLOCK_N * BLOCK_N
        hi = len_k
    # The unmasked loop scales row maxima, which needs a non-negative scale (see attention.py).
    f1 = tl.where(qk_scale < 0, lo, f1)
    f2 = tl.where(qk_scale < 0, lo, f2)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if CAUSAL != 0:
        acc, l_i, m_i = _fp8_blocks(acc, l_i, m_i, q, K_base, V_base, stride_kn, stride_vd, lo, f1,
                                    offs_m, offs_n, offs_dk, offs_dv, len_k, diag, left, right, qk_scale,
                                    True, CAUSAL, HEAD_DIM, HEAD_DIM_V, BLOCK_N, VARLEN)
    acc, l_i, m_i = _fp8_blocks(acc, l_i, m_i, q, K_base, V_base, stride_kn, stride_vd, f2, hi,
                                offs_m, offs_n, offs_dk, offs_dv, len_k, diag, left, right, qk_scale,
                                True, CAUSAL, HEAD_DIM, HEAD_DIM_V, BLOCK_N, VARLEN)
    acc, l_i, m_i = _fp8_blocks(acc, l_i, m_i, q, K_base, V_base, stride_kn, stride_vd, f1, f2,
                                offs_m, offs_n, offs_dk, offs_dv, len_k, diag, left, right, qk_scale,
                                False, CAUSAL, HEAD_DIM, HEAD_DIM_V, BLOCK_N, VARLEN)

    # Rows that saw no key output 0 and logsumexp -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc * (v_scale / l_safe)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    row_ok = offs_m < len_q
    tl.store(L_head + offs_m, lse, mask=row_ok)
    omask = row_ok[:, None]
    if HEAD_DIM_V != BLOCK_DV:
        omask = omask & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(O_head + offs_m[:, None].to(tl.int64) * stride_om + offs_dv[None, :],
             acc.to(O_head.dtype.element_ty), mask=omask)


@triton.jit
def attn_fwd_fp8(
    Q, K, V, Out, LSE, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vd,
    stride_oz, stride_oh, stride_om,
    stride_lz, stride_lh,
    stride_qdz, stride_qdh, stride_kdz, stride_kdh, stride_vdz, stride_vdh,
    batch, num_heads_q, num_heads_k, seqlen_q, seqlen_k,
    sm_scale, window_left, window_right, causal_align,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIRED: tl.constexpr,
):
    """FP8 attention forward: Out = softmax(dq·dk · Q K^T * sm_scale, masked) (dv · V), its LSE.

    ``dq``, ``dk``, ``dv``: the descale factors of the program's sequence and key/value head (module
    docs). Grid, addressing of Q, K, Out, masks and LSE as ``attn_fwd`` (causal programs compute
    query blocks p and n-1-p of their head). V is V^T from :func:`attn_fp8_v_transpose`: element
    (key n, dim d) at ``V + b*stride_vz + h*stride_vh + d*stride_vd + n`` (``n`` the packed row
    under VARLEN), ``HEAD_DIM_V`` rows. Out is fp16 or bf16 (the ``out_dtype`` axis).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // num_heads_q
    off_h = pid_bh % num_heads_q
    off_hk = off_h // (num_heads_q // num_heads_k)

    q_start, len_q = _sequence(cu_seqlens_q, off_b, seqlen_q, VARLEN)
    k_start, len_k = _sequence(cu_seqlens_k, off_b, seqlen_k, VARLEN)
    off_bz = off_b.to(tl.int64) * (1 - VARLEN)
    if VARLEN and CAUSAL == 0:
        if pid_m * BLOCK_M >= len_q:
            return

    b64 = off_b.to(tl.int64)
    hk64 = off_hk.to(tl.int64)
    dq = tl.load(q_descale + b64 * stride_qdz + hk64 * stride_qdh)
    dk = tl.load(k_descale + b64 * stride_kdz + hk64 * stride_kdh)
    dv = tl.load(v_descale + b64 * stride_vdz + hk64 * stride_vdh)
    qk_scale = sm_scale * dq * dk * LOG2E

    Q_head = Q + off_bz * stride_qz + off_h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
    K_base = K + off_bz * stride_kz + hk64 * stride_kh + k_start.to(tl.int64) * stride_kn
    V_base = V + off_bz * stride_vz + hk64 * stride_vh + k_start.to(tl.int64)
    O_head = Out + off_bz * stride_oz + off_h.to(tl.int64) * stride_oh + q_start.to(tl.int64) * stride_om
    L_head = LSE + b64 * stride_lz + off_h.to(tl.int64) * stride_lh + q_start

    if CAUSAL != 0 and PAIRED:
        # Blocks p and n-1-p: every program does about the same work (see attn_fwd).
        last = tl.cdiv(len_q, BLOCK_M) - 1 - pid_m
        tiles = (pid_m <= last).to(tl.int32) + (pid_m < last).to(tl.int32)
        for t in range(0, tiles):
            _fp8_tile(pid_m + t * (last - pid_m), Q_head, O_head, L_head, K_base, V_base,
                      stride_qm, stride_kn, stride_vd, stride_om, len_q, len_k, qk_scale, dv,
                      window_left, window_right, causal_align, HEAD_DIM, HEAD_DIM_V, CAUSAL, BLOCK_M, BLOCK_N, VARLEN)
    else:
        if CAUSAL != 0:
            # One block per program, the heaviest (last) first: the hardware starts programs in order.
            pid_m = tl.cdiv(seqlen_q, BLOCK_M) - 1 - pid_m
            if pid_m * BLOCK_M >= len_q:
                return
        _fp8_tile(pid_m, Q_head, O_head, L_head, K_base, V_base,
                  stride_qm, stride_kn, stride_vd, stride_om, len_q, len_k, qk_scale, dv,
                  window_left, window_right, causal_align, HEAD_DIM, HEAD_DIM_V, CAUSAL, BLOCK_M, BLOCK_N, VARLEN)


@triton.jit
def wgmma_key_order(n):
    """The key stored at V^T column ``n`` in ``KEY_ORDER=1`` (see :func:`attn_fp8_v_transpose`):
    within each 32-key group, column ``16h + 4q + 2j + e`` holds key ``16h + 8j + 2q + e``."""
    return (n & ~31) | (n & 17) | ((n & 12) >> 1) | ((n & 2) << 2)


@triton.jit
def attn_fp8_v_transpose(V, VT, stride_vz, stride_vh, stride_vn, stride_tz, stride_th, stride_td,
                         batch, heads, rows, cols, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                         KEY_ORDER: tl.constexpr = 0):
    """``VT[z, h, d, n] = V[z, h, n, d]``: V^T for :func:`attn_fwd_fp8`, zero at ``rows <= n < cols``.
    V's rows are ``HEAD_DIM`` wide (the operator zero-pads a narrower head dim first). Grid:
    (cdiv(cols, BLOCK_N), batch * heads, 1).

    ``KEY_ORDER=1`` (for sm90's Gluon FP8 forward; ``cols`` a multiple of 32): column ``n`` holds
    key :func:`wgmma_key_order` (n) instead, a permutation within each group of 32 keys. The
    forward's P·V sums over keys, so any order of them gives the same product as long as P's
    columns follow it; in this one the e4m3 probabilities a thread holds after the Q·K^T wgmma are
    already where the P·V wgmma's register operand wants them (no byte shuffles between threads)."""
    pid_n = tl.program_id(0)
    pid_zh = tl.program_id(1)
    off_z = (pid_zh // heads).to(tl.int64)
    off_h = (pid_zh % heads).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keys = wgmma_key_order(offs_n) if KEY_ORDER == 1 else offs_n
    offs_d = tl.arange(0, HEAD_DIM)
    src = V + off_z * stride_vz + off_h * stride_vh + keys[:, None].to(tl.int64) * stride_vn + offs_d[None, :]
    x = tl.load(src, mask=keys[:, None] < rows, other=0.0)
    dst = VT + off_z * stride_tz + off_h * stride_th + offs_d[:, None].to(tl.int64) * stride_td + offs_n[None, :]
    tl.store(dst, tl.trans(x), mask=offs_n[None, :] < cols)


# --------------------------------------------------------------------------------------------
# Registry declarations.
# --------------------------------------------------------------------------------------------

from builder.kernels._attention_sets import in_fp8_default_set, in_fp8_gputest_set  # noqa: E402
from builder.kernels.attention import (  # noqa: E402
    ALIGN_CHECKS,
    GQA_CHECKS,
    _hip_options,
    divisibility_of,
    signature_of,
    stride_checks,
)
from builder.registry import ConfigDecl, KernelDecl  # noqa: E402


def fp8_excluded(spec: dict, target: object) -> str | None:
    """FP8 variants only for the targets with FP8 matrix units, in each one's e4m3 format."""
    want = FP8_ARCH_DTYPES.get(target.arch)
    if want is None:
        return f"{target.arch} has no FP8 matrix units the kernel uses (FP8 targets: {', '.join(FP8_ARCH_DTYPES)})"
    if spec["dtype"] != want:
        return f"{target.arch} multiplies {want}, not {spec['dtype']}"
    return None


def fp8_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    """#0 is what the operator launches. sm90: 128x64 tiles, 4 warps (8 at head dim 256), K/V
    prefetched 3 deep (cp.async), causal programs one query block each (``PAIRED=0``); the
    alternate for ``bench/fp8.py`` is the 8-warp 128x128 tile with paired causal blocks. CDNA:
    128x64 (64x64 at 256), one stage, 16x16 MFMA tiles, paired causal blocks."""
    d = spec["HEAD_DIM"]
    if target.backend == "cuda":
        if d > 128:
            return (ConfigDecl(constexprs={"BLOCK_M": 128, "BLOCK_N": 64, "PAIRED": 1}, num_warps=8, num_stages=2),)
        # Causal: one query block per program, heaviest first, ran 8% faster than the pairs on the
        # H200 (the JIT, B4 H32 N4096 D128); the pairs stay as the alternate.
        paired = 0 if spec["CAUSAL"] else 1
        return (ConfigDecl(constexprs={"BLOCK_M": 128, "BLOCK_N": 64, "PAIRED": paired}, num_warps=4, num_stages=3),
                ConfigDecl(constexprs={"BLOCK_M": 128, "BLOCK_N": 128, "PAIRED": 1}, num_warps=8, num_stages=3))
    bm = 128 if d <= 128 else 64
    return (ConfigDecl(constexprs={"BLOCK_M": bm, "BLOCK_N": 64, "PAIRED": 1}, num_warps=4, num_stages=1,
                       options=_hip_options(target, 2)),)


_FP8_SIG = signature_of(attn_fwd_fp8, {
    "Q": "*{dtype}", "K": "*{dtype}", "V": "*{dtype}", "Out": "*{out_dtype}", "LSE": "*fp32",
    "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32",
    "q_descale": "*fp32", "k_descale": "*fp32", "v_descale": "*fp32"})
# The descale factors are read one per program: no alignment promised (any view is read in place).
_FP8_DIV = {n: d for n, d in divisibility_of(_FP8_SIG, aligned=("q", "k", "v", "o")).items()
            if n not in ("q_descale", "k_descale", "v_descale")}
_FP8_CHECKS = GQA_CHECKS + ALIGN_CHECKS + ("batch * num_heads_q <= 65535",) + stride_checks(_FP8_DIV)

KERNELS = [KernelDecl(
    name=FWD_FP8,
    fn=attn_fwd_fp8,
    signature=_FP8_SIG,
    axes={"dtype": FP8_DTYPES, "out_dtype": FP8_OUT_DTYPES, "HEAD_DIM": FP8_HEAD_DIMS, "HEAD_DIM_V": FP8_HEAD_DIMS,
          "CAUSAL": (0, 1, 2), "VARLEN": (0, 1)},
    configs=fp8_configs,
    grid=("cdiv(seqlen_q, BLOCK_M * (1 + min(CAUSAL, 1) * PAIRED))", "batch * num_heads_q", "1"),
    divisibility=_FP8_DIV,
    exclude=lambda spec, target: (
        "unequal head dims are not compiled for FP8" if spec["HEAD_DIM"] != spec["HEAD_DIM_V"]
        else fp8_excluded(spec, target)),
    sets={"default": in_fp8_default_set, "gputest": in_fp8_gputest_set},
    set_configs={"default": 1, "gputest": 1},
    checks=_FP8_CHECKS,
)]


def _transpose_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    """#0 the keys in order (the portable forward's V^T); on sm90 #1 in the Gluon FP8 forward's
    register order (``KEY_ORDER=1``), which the runtime asks for by name."""
    options = _hip_options(target, 2) if target.backend == "hip" else {}
    natural = ConfigDecl(constexprs={"BLOCK_N": 64, "KEY_ORDER": 0}, num_warps=4, num_stages=1, options=options)
    if getattr(target, "arch", None) != "sm90":
        return (natural,)
    return (natural, ConfigDecl(constexprs={"BLOCK_N": 64, "KEY_ORDER": 1}, num_warps=4, num_stages=1))


_T_SIG = signature_of(attn_fp8_v_transpose, {"V": "*{dtype}", "VT": "*{dtype}"})
_T_DIV = divisibility_of(_T_SIG, aligned=("v", "t"))
KERNELS.append(KernelDecl(
    name=FP8_V_TRANSPOSE,
    fn=attn_fp8_v_transpose,
    signature=_T_SIG,
    axes={"dtype": FP8_DTYPES, "HEAD_DIM": FP8_HEAD_DIMS},
    configs=_transpose_configs,
    grid=("cdiv(cols, BLOCK_N)", "batch * heads", "1"),
    divisibility=_T_DIV,
    exclude=fp8_excluded,
    sets={"default": in_fp8_default_set, "gputest": in_fp8_gputest_set},
    # The default images hold both orders on sm90: keys in order for the portable FP8 forward (packed
    # sequences), the register order for the Gluon one.
    checks=("batch * heads <= 65535", "KEY_ORDER == 0 or cols % 32 == 0") + stride_checks(_T_DIV),
))
