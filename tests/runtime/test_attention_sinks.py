"""Attention sinks: the epilogue's algebra, and its two kernels under Triton's interpreter.

- The algebra, in fp64 torch without kernels: attention with a sink logit per head (gpt-oss's
  reference: the sink joins the softmax, then is dropped) equals the forward over the keys
  rescaled by ``exp(lse - lse')``; and the backward kernels' formula (``dS = P (dP - Delta)``
  with ``P = exp(S - lse')``, ``Delta = rowsum(dO * out')``) fed that ``(out', lse')`` gives
  autograd's dq, dk and dv, while ``-sum exp(s - lse') Delta`` gives the sink's gradient. With
  masks that leave rows empty and with dropout.
- The kernels, on CPU tensors under the interpreter, against the fp64 formulas: dense bhsd and
  bshd, packed (varlen) and decode layouts, head dims that are not the chunk's multiple, rows
  that saw no key (lse -inf), a NaN row (stays NaN, touches no other), sinks of -inf.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _reference(q, k, v, sinks, mask, scale, keep=None, p_drop=0.0):
    """gpt-oss's eager attention with sinks: (B, H, Sq, D) fp64 arrays, mask (Sq, Sk) of bools."""
    import torch

    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    if keep is not None:
        p = p * keep / (1 - p_drop)
    return torch.einsum("bhqk,bhkd->bhqd", p, v)


@pytest.mark.parametrize("masked_rows", [False, True])
@pytest.mark.parametrize("p_drop", [0.0, 0.3])
def test_the_epilogue_and_unchanged_backward_give_the_sinks_gradients(masked_rows: bool, p_drop: float) -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(7 + masked_rows + int(10 * p_drop))
    B, H, Sq, Sk, D = 2, 3, 9, 13, 8
    q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) for n in (Sq, Sk, Sk))
    sinks = torch.randn(H, generator=gen, dtype=torch.float64)
    scale = D ** -0.5
    i, j = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
    mask = j <= i + (Sk - Sq) if not masked_rows else (j <= i - 3)  # rows 0-2 see no key
    keep = (torch.rand(B, H, Sq, Sk, generator=gen) >= p_drop).double() if p_drop else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = _reference(*leaves, mask, scale, keep, p_drop)
    dout = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref.backward(dout)

    # The forward over the keys alone, as a kernel returns it (a row without keys: 0, -inf).
    s = (torch.einsum("bhqd,bhkd->bhqk", q, k) * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(lse[..., None] == float("-inf"), 0.0, torch.exp(s - lse[..., None]))
    drop = keep / (1 - p_drop) if keep is not None else 1.0
    out = torch.einsum("bhqk,bhkd->bhqd", p * drop, v)
    # The epilogue.
    new = torch.logaddexp(lse, sinks.reshape(1, H, 1))
    out2 = out * torch.where(lse == float("-inf"), 0.0, torch.exp(lse - new))[..., None]
    assert torch.allclose(out2, ref.detach(), atol=1e-12)
    # The backward kernels' formulas on (out2, new), unchanged.
    P = torch.exp(s - new[..., None])
    dv = torch.einsum("bhqk,bhqd->bhkd", P * drop, dout)
    dP = torch.einsum("bhqd,bhkd->bhqk", dout, v) * drop
    delta = (dout * out2).sum(-1)
    dS = P * (dP - delta[..., None])
    dq = torch.einsum("bhqk,bhkd->bhqd", dS, k) * scale
    dk = torch.einsum("bhqk,bhqd->bhkd", dS, q) * scale
    dsinks = -(torch.exp(sinks.reshape(1, H, 1) - new) * delta).sum((0, 2))
    for name, got, leaf in zip("q k v sinks".split(), (dq, dk, dv, dsinks), leaves):
        assert torch.allclose(got, leaf.grad, atol=1e-10), name


# Interpreter cases: layout, (batch, heads, rows, head dim), dtype, what the lse rows hold.
CASES: dict[str, dict] = {
    "bhsd_fp16_head_dim_80": {"layout": "bhsd", "shape": (2, 3, 70, 80), "dtype": "fp16"},
    "bshd_bf16_empty_and_nan_rows": {"layout": "bshd", "shape": (2, 2, 33, 64), "dtype": "bf16", "empty": (0, 5),
                                     "nan": (1, 7)},
    # Packed: sequences of 40, 0 and 91 rows, then 9 rows past the last one (NaN lse: untouched).
    "varlen_fp32_head_dim_24": {"layout": "varlen", "shape": (1, 4, 140, 24), "dtype": "fp32", "empty": (0, 130),
                                "cu": (0, 40, 40, 131)},
    # Lengths past the arrays: clamped to them, nothing outside read or written.
    "varlen_hostile_lengths": {"layout": "varlen", "shape": (1, 2, 50, 16), "dtype": "fp16", "cu": (-7, 30, 10**6)},
    "decode_bshd_a_sink_of_minus_inf": {"layout": "bshd", "shape": (3, 8, 2, 128), "dtype": "fp16",
                                        "minus_inf_head": 5, "empty": (2, 1)},
}


def run_case(name: str, case: dict) -> dict:
    import torch

    from builder.kernels.sinks import attn_sinks, attn_sinks_bwd

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[case["dtype"]]
    B, H, S, D = case["shape"]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    layout = case["layout"]
    if layout == "bshd":
        out = torch.randn(B, S, H, D, generator=gen).to(dt)
        dout = torch.randn(B, S, H, D, generator=gen).to(dt)
        view = (lambda t: t.transpose(1, 2))  # as (B, H, S, D)
        ostr = (out.stride(0), out.stride(2), out.stride(1))
        dstr = (dout.stride(0), dout.stride(2), dout.stride(1))
    elif layout == "varlen":
        out = torch.randn(S, H, D, generator=gen).to(dt)
        dout = torch.randn(S, H, D, generator=gen).to(dt)
        view = (lambda t: t.transpose(0, 1).unsqueeze(0))
        ostr = (0, out.stride(1), out.stride(0))
        dstr = (0, dout.stride(1), dout.stride(0))
    else:
        out = torch.randn(B, H, S, D, generator=gen).to(dt)
        dout = torch.randn(B, H, S, D, generator=gen).to(dt)
        view = (lambda t: t)
        ostr = (out.stride(0), out.stride(1), out.stride(2))
        dstr = (dout.stride(0), dout.stride(1), dout.stride(2))
    lse = torch.randn(H, S, generator=gen) * 3 if layout == "varlen" else torch.randn(B, H, S, generator=gen) * 3
    lse4 = lse.unsqueeze(0) if layout == "varlen" else lse  # (B, H, S)
    sinks = torch.randn(H, generator=gen) * 2
    if "minus_inf_head" in case:
        sinks[case["minus_inf_head"]] = float("-inf")
    empty = case.get("empty")
    nan = case.get("nan")
    if empty:
        lse4[empty[0], :, empty[1]] = float("-inf")
        view(out)[empty[0], :, empty[1]] = 0
    if nan:
        lse4[nan[0], :, nan[1]] = float("nan")
    # fp64 expectations, from the inputs before the kernels touch them.
    o64, l64, s64 = view(out).double(), lse4.double(), sinks.double().reshape(1, H, 1)
    new = torch.logaddexp(l64, s64)
    factor = torch.where(l64 == float("-inf"), 0.0, torch.exp(l64 - new))
    want_out = o64 * factor[..., None]
    delta = (view(dout).double() * want_out).sum(-1)
    terms = torch.exp(s64 - new) * delta
    want_grad = -torch.where(torch.isnan(terms) & ~torch.isnan(new), 0.0, terms).sum((0, 2))
    lz, lh = (0, lse.stride(0)) if layout == "varlen" else (lse.stride(0), lse.stride(1))
    cu = case.get("cu")
    if cu is not None:
        # Only the sequences' rows (clamped to the arrays) take the sink; the others keep their
        # values and add nothing to the gradient.
        lo, hi = min(max(cu[0], 0), S), min(max(cu[-1], 0), S)
        inside = torch.zeros(S, dtype=torch.bool)
        inside[lo:hi] = True
        keep = ~inside
        want_out[:, :, keep] = o64[:, :, keep]
        new[:, :, keep] = l64[:, :, keep]
        terms[:, :, keep] = 0.0
        want_grad = -torch.where(torch.isnan(terms) & ~torch.isnan(new), 0.0, terms).sum((0, 2))
        cu_t = torch.tensor(cu, dtype=torch.int32)
        batch, rows = len(cu) - 1, S
    else:
        cu_t, batch, rows = None, B, S
    grid = ((rows + 63) // 64, batch * H)
    # The epilogue: rows flattened; a packed batch is one batch of S rows.
    fb = 1 if cu is not None else B
    attn_sinks[((fb * S * H + 63) // 64,)](out, lse, sinks, cu_t, *ostr, lz, lh, fb, H, S, D,
                                            len(cu) - 1 if cu is not None else 0, int(cu is not None),
                                            ALIGNED=0, BLOCK_R=64, BLOCK_D=64)
    partial = torch.full((grid[0], batch, H), 7.0)
    attn_sinks_bwd[grid](dout, out, lse, sinks, partial, cu_t, *dstr, *ostr, lz, lh, batch, H, rows, S, D,
                         int(cu is not None), BLOCK_M=64, BLOCK_D=64)
    got_grad = partial.double().sum((0, 1))
    failed = []
    tol = {"fp16": 2e-3, "bf16": 1.6e-2, "fp32": 1e-5}[case["dtype"]]
    got_out, got_lse = view(out).double(), lse4.double()
    finite = ~torch.isnan(want_out)
    if not torch.allclose(got_out[finite], want_out[finite], rtol=tol, atol=tol):
        failed.append(f"out: max error {(got_out - want_out)[finite].abs().max():.3g}")
    if not torch.equal(torch.isnan(got_out), ~finite):
        failed.append("NaN rows of out differ from the NaN lse rows")
    lfin = ~torch.isnan(new)
    if not (torch.allclose(got_lse[lfin], new[lfin], rtol=1e-5, atol=1e-5) and torch.isnan(got_lse[~lfin]).all()):
        failed.append(f"lse: max error {(got_lse - new)[lfin].abs().max():.3g}")
    if nan is None:
        scale = max(1.0, float(want_grad.abs().max()))
        if not torch.allclose(got_grad, want_grad, rtol=tol * 4, atol=tol * 4 * scale):
            failed.append(f"dsinks {got_grad.tolist()} != {want_grad.tolist()}")
    elif not torch.isnan(got_grad).any():
        failed.append("a NaN row left the sinks' gradient finite")
    if "minus_inf_head" in case:
        h = case["minus_inf_head"]
        if not torch.equal(got_out[:, h][lfin[:, h]], o64[:, h][lfin[:, h]].to(dt).double()):
            failed.append("a sink of -inf changed its head's output")
    return {"name": name, "ok": not failed, "failed": failed}


def test_the_sinks_kernels_match_fp64_under_the_interpreter() -> None:
    from tests.helpers.interpreter import run_sharded

    results = run_sharded(__file__, list(CASES))
    bad = {n: r.get("failed") or r.get("error") for n, r in results.items() if not r.get("ok")}
    assert not bad, bad


def test_sinks_are_refused_unless_one_float_vector_per_query_head_on_the_device() -> None:
    from aotriton_rt.errors import ArgumentError
    from aotriton_rt.ops.attention.sinks import check_sinks
    from tests.runtime.test_attention_op import Dev

    with pytest.raises(ArgumentError, match=r"shape \(4,\): one logit per query head, got \(2, 2\)"):
        check_sinks(Dev(2, 2, dtype="fp32"), 4, -1)
    with pytest.raises(ArgumentError, match="sinks must be fp16, bf16 or fp32, got i32"):
        check_sinks(Dev(4, dtype="i32"), 4, -1)
    with pytest.raises(ArgumentError, match="sinks is on device -1, the attention's arrays on device 0"):
        check_sinks(Dev(4, dtype="fp16"), 4, 0)
    assert check_sinks(Dev(4, dtype="fp16"), 4, -1).shape == (4,)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tests.helpers.interpreter import patch_interpreter, report_cases

    patch_interpreter()
    report_cases(sys.argv[1:], lambda n: run_case(n, CASES[n]))
