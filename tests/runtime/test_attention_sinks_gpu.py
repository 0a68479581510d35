"""Attention sinks on the GPU, on the default images (marker ``gpu``), against an fp32 reference.

The reference is gpt-oss's eager attention in fp32: the sink logit joins each row's softmax
and is dropped. Dense batches through the torch op with autograd (q, k, v and the sinks'
gradients), GQA, causal and sliding-window masks, odd lengths; packed (varlen) batches whose
arrays carry NaN rows past the last sequence; decode on contiguous and paged caches whose rows
past each sequence hold NaN, with appended rows and windows; a sink of -inf gives the call
without sinks.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def _reference(q: Any, k: Any, v: Any, sinks: Any, left: int, right: int, scale: float) -> Any:
    """(B, H, Sq, D) fp32 attention with sinks; k/v (B, Hk, Sk, D); the window bottom-right aligned
    (left/right -1: unbounded)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    sq, sk = q.shape[2], k.shape[2]
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = s.masked_fill(~visible, float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, sq, 1)
    p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    return torch.einsum("bhqk,bhkd->bhqd", p, v)


MASKS = {"none": (-1, -1), "causal": (-1, 0), "window": (40, 0)}
TOL = {torch.bfloat16: 3e-2, torch.float16: 6e-3}


def _rel(a: Any, b: Any) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_forward_and_all_gradients_through_the_torch_op(default_lib: Any, dtype: Any, head_dim: int,
                                                        mask: str) -> None:
    from aotriton_rt.ops import torch as op_torch

    gen = torch.Generator(device="cuda").manual_seed(head_dim + len(mask))
    B, Hq, Hk, S = 2, 4, 2, 173
    q, k, v = (torch.randn(B, S, h, head_dim, device="cuda", dtype=dtype, generator=gen) for h in (Hq, Hk, Hk))
    sinks = (torch.randn(Hq, device="cuda", generator=gen) * 2).to(dtype)
    left, right = MASKS[mask]
    scale = head_dim ** -0.5
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    causal = mask == "causal"
    window = None if mask != "window" else (left, right)
    out = op_torch.attention(*leaves[:3], causal=causal, window=window, align="bottom_right", layout="bshd",
                             sinks=leaves[3], library=default_lib)
    dout = torch.randn(out.shape, device="cuda", dtype=dtype, generator=gen)
    out.backward(dout)
    ref_leaves = [t.detach().float().clone().requires_grad_() for t in (q, k, v, sinks)]
    rq, rk, rv = (t.transpose(1, 2) for t in ref_leaves[:3])
    ref = _reference(rq, rk, rv, ref_leaves[3], left, right, scale).transpose(1, 2)
    ref.backward(dout.float())
    tol = TOL[dtype]
    assert _rel(out, ref) <= tol, f"out: {_rel(out, ref):.3g}"
    for name, got, want in zip("q k v sinks".split(), leaves, ref_leaves):
        assert got.grad is not None and got.grad.dtype == got.dtype, name
        assert _rel(got.grad, want.grad) <= 2 * tol, f"d{name}: {_rel(got.grad, want.grad):.3g}"


def test_packed_batches_with_nan_past_the_last_sequence(default_lib: Any) -> None:
    import aotriton_rt

    dtype, D, Hq, Hk = torch.bfloat16, 64, 4, 1
    lens = [37, 1, 200, 64]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    total, spare = int(cu[-1]), 19
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(total + spare, h, D, device="cuda", dtype=dtype, generator=gen) for h in (Hq, Hk, Hk))
    for t in (q, k, v):
        t[total:] = float("nan")
    sinks = torch.randn(Hq, device="cuda", generator=gen)
    kw = {"causal": True, "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max(lens),
          "max_seqlen_k": max(lens), "library": default_lib}
    out, lse = aotriton_rt.attention(q[:total], k[:total], v[:total], sinks=sinks, **kw)
    dout = torch.randn(out.shape, device="cuda", dtype=dtype, generator=gen)
    dq, dk, dv, _, dsinks = aotriton_rt.attention_backward(dout, q[:total], k[:total], v[:total], out, lse,
                                                            sinks=sinks, **kw)
    assert dsinks.shape == sinks.shape and dsinks.dtype == sinks.dtype
    want_ds = torch.zeros(Hq, device="cuda")
    for b, n in enumerate(lens):
        a = int(cu[b])
        leaves = [t[a:a + n].float().transpose(0, 1)[None].clone().requires_grad_() for t in (q, k, v)]
        s = sinks.clone().requires_grad_()
        ref = _reference(*leaves, s, -1, 0, D ** -0.5)
        ref.backward(dout[a:a + n].float().transpose(0, 1)[None])
        want_ds += s.grad
        got = out[a:a + n].float().transpose(0, 1)[None]
        assert _rel(got, ref) <= 3e-2, f"sequence {b}: out {_rel(got, ref):.3g}"
        for name, g, leaf in (("dq", dq, leaves[0]), ("dk", dk, leaves[1]), ("dv", dv, leaves[2])):
            got_g = g[a:a + n].float().transpose(0, 1)[None]
            assert _rel(got_g, leaf.grad) <= 6e-2, f"sequence {b}: {name} {_rel(got_g, leaf.grad):.3g}"
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert _rel(dsinks, want_ds) <= 3e-2, f"dsinks {_rel(dsinks, want_ds):.3g}"


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("rows", [1, 3])
def test_decode_with_sinks_appended_rows_and_a_window(default_lib: Any, paged: bool, rows: int) -> None:
    import aotriton_rt

    dtype, D, Hq, Hk, cap, page = torch.float16, 128, 8, 2, 256, 16
    lens = [200, 17, 0]
    B = len(lens)
    gen = torch.Generator(device="cuda").manual_seed(rows + 10 * paged)
    kc = torch.full((B, cap, Hk, D), float("nan"), device="cuda", dtype=dtype)
    vc = kc.clone()
    for b, n in enumerate(lens):
        kc[b, :n] = torch.randn(n, Hk, D, device="cuda", dtype=dtype, generator=gen)
        vc[b, :n] = torch.randn(n, Hk, D, device="cuda", dtype=dtype, generator=gen)
    kn, vn = (torch.randn(B, rows, Hk, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    q = torch.randn(B, rows, Hq, D, device="cuda", dtype=dtype, generator=gen)
    sinks = torch.randn(Hq, device="cuda", generator=gen) * 2
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kw: dict = {}
    k_arg, v_arg = kc.clone(), vc.clone()
    if paged:
        perm = torch.randperm(B * cap // page, generator=torch.Generator().manual_seed(5)).cuda()
        table = perm.reshape(B, cap // page).to(torch.int32)
        k_arg = torch.empty(B * cap // page, page, Hk, D, device="cuda", dtype=dtype)
        v_arg = torch.empty_like(k_arg)
        k_arg[perm] = kc.reshape(B * cap // page, page, Hk, D)
        v_arg[perm] = vc.reshape(B * cap // page, page, Hk, D)
        kw["block_table"] = table
    out, lse = aotriton_rt.decode_attention(q, k_arg, v_arg, cache_seqlens=lens_t, k_new=kn, v_new=vn,
                                            window=(31, 0), sinks=sinks, library=default_lib, **kw)
    plain, _ = aotriton_rt.decode_attention(q, k_arg, v_arg, cache_seqlens=lens_t + rows, window=(31, 0),
                                            sinks=torch.full((Hq,), float("-inf"), device="cuda"),
                                            library=default_lib, **kw)
    again, _ = aotriton_rt.decode_attention(q, k_arg, v_arg, cache_seqlens=lens_t + rows, window=(31, 0),
                                            library=default_lib, **kw)
    assert torch.equal(plain, again), "a sink of -inf changed the output"
    for b, n in enumerate(lens):
        keys = torch.cat([kc[b, :n], kn[b]]).float().transpose(0, 1)[None]
        vals = torch.cat([vc[b, :n], vn[b]]).float().transpose(0, 1)[None]
        ref = _reference(q[b].float().transpose(0, 1)[None], keys, vals, sinks, 31, 0, D ** -0.5)
        got = out[b].float().transpose(0, 1)[None]
        assert _rel(got, ref) <= 6e-3, f"sequence {b}: {_rel(got, ref):.3g}"
