"""Attention sinks as an epilogue of any attention forward, and their gradient.

A sink is a learnable logit per query head that joins every row's softmax without a value
(gpt-oss; FlashAttention-3's ``learnable_sink``): ``p_j = exp(x_j - L')`` with
``L' = logaddexp(L, s_h)``, where ``L`` is the row's logsumexp over its visible keys. Given a
forward's ``(Out, LSE)`` over the keys alone, the sink's result is exact from them:

- ``attn_sinks`` rescales each row in place, ``Out *= exp(L - L')``, ``LSE = L'`` (a row that saw
  no key keeps ``Out = 0`` and takes ``LSE = s_h``; a NaN row stays NaN);
- the backward kernels, given that ``(Out, LSE)``, compute dQ, dK and dV with the sink in the
  softmax as they are: the sink's own term in ``dS`` vanishes (it has no value) and
  ``Delta = rowsum(dO * Out)`` is taken over the rescaled output;
- ``attn_sinks_bwd`` writes the sink's gradient, ``dS_h = -sum over rows of exp(s_h - L') *
  rowsum(dO * Out)``, as one partial sum per (row block, batch, head), summed by the caller in a
  fixed order (reproducible).

Both take rows as ``(batch, head, row)`` with strides, so dense and decode layouts share them;
packed (varlen) batches pass ``varlen=1`` and ``CuQ``, and sequence ``b``'s rows are
``CuQ[b] .. CuQ[b + 1]`` (``rows``: the longest), so rows past the last sequence are never
touched. The head dim is looped over in chunks of ``BLOCK_D`` (any width).
"""

import triton
import triton.language as tl

from builder.kernels.attention import signature_of
from builder.registry import ConfigDecl, KernelDecl

SINKS = "attn_sinks"
SINKS_BWD = "attn_sinks_bwd"


@triton.jit
def _rows_of(CuQ, off_b, rows, total, varlen):
    """(first row, row count) of sequence ``off_b``: ``CuQ[b]``, ``CuQ[b + 1] - CuQ[b]`` when
    ``varlen``, else (0, rows); clamped to ``rows`` rows inside the arrays' ``total``, whatever
    ``CuQ`` holds."""
    first = 0
    count = rows
    if varlen != 0:
        first = tl.minimum(tl.maximum(tl.load(CuQ + off_b), 0), total)
        end = tl.minimum(tl.maximum(tl.load(CuQ + off_b + 1), first), total)
        count = tl.minimum(end - first, rows)
    return first, count


@triton.jit
def attn_sinks(Out, LSE, Sinks, CuQ, stride_oz, stride_oh, stride_om, stride_lz, stride_lh, batch, num_heads, rows,
               head_dim, seqs, varlen, ALIGNED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid: (cdiv(batch * rows * num_heads, BLOCK_R), 1, 1): the rows ``(b, m, h)`` flattened with
    the head innermost (a BSHD output's rows lie in that order), so a decode step's few rows fill
    whole programs. Packed batches: ``batch`` 1, ``rows`` the packed total, and only rows from
    ``CuQ[0]`` to ``CuQ[seqs]`` (clamped to the arrays) are the sequences'. LSE rows and Out's
    head dim have unit stride. ALIGNED variants promise 16-byte rows (pointer, strides and head
    dim), which lets the loads and stores be vectors. Sinks: fp32, one per head."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    off_h = r % num_heads
    t = r // num_heads
    off_m = t % rows
    off_b = t // rows
    row_ok = off_b < batch
    if varlen != 0:
        lo = tl.minimum(tl.maximum(tl.load(CuQ), 0), rows)
        hi = tl.minimum(tl.maximum(tl.load(CuQ + seqs), lo), rows)
        row_ok = row_ok & (off_m >= lo) & (off_m < hi)
    l_ptrs = LSE + off_b * stride_lz + off_h * stride_lh + off_m
    lse = tl.load(l_ptrs, mask=row_ok, other=0.0)
    sink = tl.load(Sinks + off_h, mask=row_ok, other=0.0)
    top = tl.maximum(lse, sink)
    top = tl.where(top == float("-inf"), 0.0, top)  # both -inf: no key and a sink of -inf
    new = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
    scale = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - new))
    tl.store(l_ptrs, new, mask=row_ok)
    O_rows = Out + off_b * stride_oz + off_h * stride_oh + off_m * stride_om
    for d0 in range(0, head_dim, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (offs_d[None, :] < head_dim)
        ptrs = O_rows[:, None] + offs_d[None, :]
        o = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, (o.to(tl.float32) * scale[:, None]).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def attn_sinks_bwd(DOut, Out, LSE, Sinks, Partial, CuQ,
                   stride_doz, stride_doh, stride_dom, stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                   batch, num_heads, rows, total, head_dim, varlen,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid: (cdiv(rows, BLOCK_M), batch * num_heads, 1). Partial: fp32 (cdiv(rows, BLOCK_M),
    batch, num_heads), each program's ``-sum exp(s - L') * rowsum(dO * Out)`` over its rows."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // num_heads
    off_h = pid_bh % num_heads
    first, count = _rows_of(CuQ, off_b, rows, total, varlen)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < count
    offs_m = first + offs_m
    lse = tl.load(LSE + off_b.to(tl.int64) * stride_lz + off_h.to(tl.int64) * stride_lh + offs_m, mask=row_ok,
                  other=float("inf"))
    sink = tl.load(Sinks + off_h)
    rows64 = offs_m.to(tl.int64)[:, None]
    DO_rows = DOut + off_b.to(tl.int64) * stride_doz + off_h.to(tl.int64) * stride_doh + rows64 * stride_dom
    O_rows = Out + off_b.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh + rows64 * stride_om
    delta = tl.zeros([BLOCK_M], dtype=tl.float32)
    for d0 in range(0, head_dim, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (offs_d[None, :] < head_dim)
        do = tl.load(DO_rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        o = tl.load(O_rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        delta += tl.sum(do * o, 1)
    # A sink of -inf takes no share (and a row with no key beside it has lse' = -inf too).
    p = tl.where(row_ok, tl.exp(sink - lse), 0.0)
    p = tl.where(sink == float("-inf"), 0.0, p)
    tl.store(Partial + (pid_m.to(tl.int64) * batch + off_b) * num_heads + off_h, -tl.sum(p * delta, 0))


_SIG = signature_of(attn_sinks, {"Out": "*{dtype}", "LSE": "*fp32", "Sinks": "*fp32", "CuQ": "*i32"})
_BWD_SIG = signature_of(attn_sinks_bwd, {"DOut": "*{dtype}", "Out": "*{dtype}", "LSE": "*fp32", "Sinks": "*fp32",
                                         "Partial": "*fp32", "CuQ": "*i32"})
# Element-aligned rows of any width: the caller's arrays need no alignment beyond their dtype's.
_SHAPES = ("num_heads >= 1", "rows >= 1", "head_dim >= 1", "stride_om >= 0", "stride_lh >= 0",
           "varlen == 0 or varlen == 1")
_GRID = ("cdiv(rows, BLOCK_M)", "batch * num_heads", "1")


def _configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    return (ConfigDecl(constexprs={"BLOCK_M": 64, "BLOCK_D": 64}, num_warps=4, num_stages=1),)


def _epilogue_configs(spec: dict, target: object) -> tuple[ConfigDecl, ...]:
    return (ConfigDecl(constexprs={"BLOCK_R": 64, "BLOCK_D": 64}, num_warps=4, num_stages=1),)


def _epilogue_divisibility(spec: dict) -> dict:
    """ALIGNED=1: 16-byte rows (Out's address, its strides and the head dim in 8 elements of
    fp16/bf16 or 4 of fp32, declared as the builder's integer hints); else nothing promised."""
    if not spec.get("ALIGNED"):
        return {}
    step = 4 if spec["dtype"] == "fp32" else 8
    return {"Out": 16, "stride_oz": step, "stride_oh": step, "stride_om": step, "head_dim": step}


def _epilogue_checks(spec: dict) -> tuple[str, ...]:
    div = _epilogue_divisibility(spec)
    return _SHAPES + ("seqs >= 0", "batch * rows * num_heads <= 137438953408") + tuple(
        f"{n} % {d} == 0" for n, d in div.items() if n != "Out")


KERNELS = [
    KernelDecl(name=SINKS, fn=attn_sinks, signature=_SIG, axes={"dtype": ("fp16", "bf16", "fp32"), "ALIGNED": (0, 1)},
               configs=_epilogue_configs, grid=("cdiv(batch * rows * num_heads, BLOCK_R)", "1", "1"),
               divisibility=_epilogue_divisibility, sets={"default": lambda spec, target: True},
               checks=_epilogue_checks),
    KernelDecl(name=SINKS_BWD, fn=attn_sinks_bwd, signature=_BWD_SIG, axes={"dtype": ("fp16", "bf16", "fp32")},
               configs=_configs, grid=_GRID, divisibility={}, sets={"default": lambda spec, target: True},
               checks=_SHAPES + ("batch >= 1",)),
]
