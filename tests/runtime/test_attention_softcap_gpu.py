"""The logit softcap on the GPU, on the default images (marker ``gpu``), against an fp32 reference.

Gemma 2's shapes (head dim 256, causal and with a sliding window, GQA; the default images), dense
and packed batches whose arrays carry NaN rows past the last sequence, odd lengths; the torch op's
gradients at head dim 64 (the gputest images). The reference applies
``softcap * tanh(scores / softcap)`` to the scaled scores before the mask (FlashAttention-2).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

CAP = 50.0  # Gemma 2's attn_logit_softcapping
TOL = {torch.bfloat16: 3e-2, torch.float16: 6e-3}


def _reference(q: Any, k: Any, v: Any, cap: float, left: int, right: int) -> Any:
    """(B, H, Sq, D) fp32; k/v (B, Hk, Sk, D); the window bottom-right aligned (-1: unbounded)."""
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
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = (cap * torch.tanh(s / cap)).masked_fill(~visible, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v)


def _rel(a: Any, b: Any) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [None, (63, 0)], ids=["causal", "window"])
def test_gemma2_shapes_dense(default_lib: Any, dtype: Any, window: Any) -> None:
    import aotriton_rt

    gen = torch.Generator(device="cuda").manual_seed(1)
    B, Hq, Hk, S, D = 2, 8, 4, 301, 256
    # Scores of a few tens: the cap bends them (Gemma 2's logits reach the cap).
    q, k, v = (torch.randn(B, S, h, D, device="cuda", generator=gen).mul(5).to(dtype) for h in (Hq, Hk, Hk))
    kw = {"window": window} if window else {"causal": True}
    out, lse = aotriton_rt.attention(q, k, v, layout="bshd", align="bottom_right", softcap=CAP,
                                     library=default_lib, **kw)
    left, right = window if window else (-1, 0)
    ref = _reference(*(t.float().transpose(1, 2) for t in (q, k, v)), CAP, left, right).transpose(1, 2)
    plain = _reference(*(t.float().transpose(1, 2) for t in (q, k, v)), 1e9, left, right).transpose(1, 2)
    assert _rel(ref, plain) > 3 * TOL[dtype], "the cap does not bend these scores: the test would prove nothing"
    assert _rel(out, ref) <= TOL[dtype], f"{_rel(out, ref):.3g}"
    assert torch.isfinite(lse).all()


def test_gemma2_packed_with_nan_past_the_last_sequence(default_lib: Any) -> None:
    import aotriton_rt

    dtype, D, Hq, Hk = torch.bfloat16, 256, 8, 4
    lens = [37, 1, 200, 64]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(total + 11, h, D, device="cuda", generator=gen).mul(5).to(dtype) for h in (Hq, Hk, Hk))
    for t in (q, k, v):
        t[total:] = float("nan")
    out, _ = aotriton_rt.attention(q[:total], k[:total], v[:total], causal=True, align="bottom_right",
                                   cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                                   softcap=CAP, library=default_lib)
    for b, n in enumerate(lens):
        a = int(cu[b])
        ref = _reference(*(t[a:a + n].float().transpose(0, 1)[None] for t in (q, k, v)), CAP, -1, 0)
        got = out[a:a + n].float().transpose(0, 1)[None]
        assert _rel(got, ref) <= TOL[dtype], f"sequence {b}: {_rel(got, ref):.3g}"


def test_the_torch_op_forward_and_gradients_at_head_dim_64(gpu_images: Any) -> None:
    """The gputest images' softcap backward (head dim 64): q, k, v gradients against fp32 autograd."""
    import aotriton_rt
    from aotriton_rt.ops import torch as op_torch

    lib = aotriton_rt.Library(gpu_images)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 4, 173, 64, device="cuda", generator=gen).mul(3).to(torch.bfloat16)
               for _ in range(3))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = op_torch.attention(*leaves, causal=True, softcap=5.0, library=lib)
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(torch.bfloat16)
    out.backward(dout)
    refs = [t.detach().float().clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*refs, 5.0, -1, 0)
    ref.backward(dout.float())
    assert _rel(out, ref) <= TOL[torch.bfloat16]
    for name, got, want in zip("qkv", leaves, refs):
        assert _rel(got.grad, want.grad) <= 2 * TOL[torch.bfloat16], f"d{name}: {_rel(got.grad, want.grad):.3g}"


def _grads(q: Any, k: Any, v: Any, dout: Any, cap: float, left: int, right: int) -> list:
    """fp32 autograd gradients of :func:`_reference` (bhsd)."""
    leaves = [t.detach().float().clone().requires_grad_() for t in (q, k, v)]
    _reference(*leaves, cap, left, right).backward(dout.float())
    return [t.grad for t in leaves]


@pytest.mark.parametrize("scheme", ["split", "atomic"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_backward_schemes_gqa_and_masks_at_head_dim_64(gpu_images: Any, scheme: str, mask: str) -> None:
    """Both backward schemes (the atomic one sums dQ with fp32 atomics), GQA 8:2, unequal lengths
    (bottom-right causal and window), every gradient against fp32 autograd."""
    import aotriton_rt

    lib = aotriton_rt.Library(gpu_images)
    gen = torch.Generator(device="cuda").manual_seed(4)
    B, Hq, Hk, Sq, Sk, D, cap = 2, 8, 2, 157, 211, 64, 8.0
    q = torch.randn(B, Hq, Sq, D, device="cuda", generator=gen).mul(2).to(torch.float16)
    k, v = (torch.randn(B, Hk, Sk, D, device="cuda", generator=gen).mul(2).to(torch.float16) for _ in range(2))
    kw, (left, right) = {"none": ({}, (-1, -1)), "causal": ({"causal": True}, (-1, 0)),
                         "window": ({"window": (40, 0)}, (40, 0))}[mask]
    out, lse = aotriton_rt.attention(q, k, v, align="bottom_right", softcap=cap, library=lib, **kw)
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(torch.float16)
    dq, dk, dv, _ = aotriton_rt.attention_backward(dout, q, k, v, out, lse, align="bottom_right", softcap=cap,
                                                   scheme=scheme, library=lib, **kw)
    ref = _reference(*(t.float() for t in (q, k, v)), cap, left, right)
    plain = _reference(*(t.float() for t in (q, k, v)), 1e9, left, right)
    assert _rel(ref, plain) > 0.05, "the cap does not bend these scores"
    assert _rel(out, ref) <= TOL[torch.float16]
    for name, got, want in zip("qkv", (dq, dk, dv), _grads(q, k, v, dout, cap, left, right)):
        assert _rel(got, want) <= 2 * TOL[torch.float16], f"d{name}: {_rel(got, want):.3g}"


def test_backward_packed_with_softcap_and_sinks(gpu_images: Any) -> None:
    """Packed sequences (varlen, causal), softcap together with attention sinks: dq, dk, dv and
    dsinks against fp32 autograd of the softcapped scores with a sink column in the softmax."""
    import aotriton_rt

    lib = aotriton_rt.Library(gpu_images)
    dtype, D, Hq, Hk, cap = torch.bfloat16, 64, 4, 2, 6.0
    lens = [45, 1, 130, 64]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(total, h, D, device="cuda", generator=gen).mul(2).to(dtype) for h in (Hq, Hk, Hk))
    sinks = torch.randn(Hq, device="cuda", generator=gen)
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
              softcap=cap, sinks=sinks, library=lib)
    out, lse = aotriton_rt.attention(q, k, v, **kw)
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(dtype)
    dq, dk, dv, _, dsinks = aotriton_rt.attention_backward(dout, q, k, v, out, lse, **kw)
    leaves = [t.detach().float().clone().requires_grad_() for t in (q, k, v, sinks)]
    rq, rk, rv, rs = leaves
    outs = []
    for b, n in enumerate(lens):
        a = int(cu[b])
        qb, kb, vb = (t[a:a + n].transpose(0, 1).repeat_interleave(Hq // t.shape[1], 0) for t in (rq, rk, rv))
        s = torch.einsum("hqd,hkd->hqk", qb, kb) * D ** -0.5
        s = (cap * torch.tanh(s / cap)).masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1),
                                                    float("-inf"))
        s = torch.cat([s, rs[:, None, None].expand(Hq, n, 1)], -1)
        outs.append(torch.einsum("hqk,hkd->qhd", torch.softmax(s, -1)[..., :n], vb))
    ref = torch.cat(outs)
    ref.backward(dout.float())
    assert _rel(out, ref) <= TOL[dtype]
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), (dq, dk, dv, dsinks), [t.grad for t in leaves]):
        assert _rel(got, want) <= 2 * TOL[dtype], f"{name}: {_rel(got, want):.3g}"


@pytest.mark.parametrize("kernel", ["attn_fwd", "attn_fwd_sm90"])
@pytest.mark.parametrize("window", [None, (100, 0)], ids=["causal", "window"])
def test_head_dim_128_on_each_forward_kernel(default_lib: Any, kernel: str, window: Any) -> None:
    """Gemma 2 27B's head dim on the default images, forced onto the portable and (on sm90) the
    Gluon forward: both softcap the same scores."""
    import aotriton_rt
    from aotriton_rt.ops.attention import attention_kernels
    from builder.tune import forced_forward

    if kernel == "attn_fwd_sm90" and not any(v.kernel == kernel and v.spec.get("SOFTCAP")
                                             for v in default_lib.variants):
        pytest.skip("these images hold no softcap variant of the sm90 forward (not an sm90 build)")
    lib = forced_forward(default_lib, kernel)
    gen = torch.Generator(device="cuda").manual_seed(6)
    B, Hq, Hk, S, D = 2, 8, 2, 777, 128
    q, k, v = (torch.randn(B, S, h, D, device="cuda", generator=gen).mul(4).to(torch.bfloat16) for h in (Hq, Hk, Hk))
    kw = {"window": window} if window else {"causal": True}
    out, _ = aotriton_rt.attention(q, k, v, layout="bshd", align="bottom_right", softcap=CAP, library=lib, **kw)
    ran = attention_kernels(q, k, v, layout="bshd", align="bottom_right", softcap=CAP, library=lib,
                             **kw)["attn_fwd"]
    assert ran.name == kernel
    left, right = window if window else (-1, 0)
    ref = _reference(*(t.float().transpose(1, 2) for t in (q, k, v)), CAP, left, right).transpose(1, 2)
    assert _rel(out, ref) <= TOL[torch.bfloat16], f"{_rel(out, ref):.3g}"


def test_saturated_scores_give_the_capped_softmax(gpu_images: Any) -> None:
    """Scores of thousands with a cap of 1: tanh saturates at +-1 (exp2 overflows to inf or
    underflows to 0 inside it) and the output is still the reference's, finite, in the forward
    and the gradients."""
    import aotriton_rt

    lib = aotriton_rt.Library(gpu_images)
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(1, 2, 150, 64, device="cuda", generator=gen).mul(30).to(torch.float16) for _ in range(3))
    v = v / 30
    out, lse = aotriton_rt.attention(q, k, v, softcap=1.0, library=lib)
    ref = _reference(q.float(), k.float(), v.float(), 1.0, -1, -1)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert _rel(out, ref) <= TOL[torch.float16]
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(torch.float16)
    grads = aotriton_rt.attention_backward(dout, q, k, v, out, lse, softcap=1.0, library=lib)[:3]
    for name, got, want in zip("qkv", grads, _grads(q, k, v, dout, 1.0, -1, -1)):
        assert torch.isfinite(got).all(), f"d{name}"
        assert (got.float() - want).abs().max() <= 2 * TOL[torch.float16] * want.abs().max().clamp_min(1.0), f"d{name}"


def test_every_softcap_forward_config_of_the_gputest_images(gpu_images: Any) -> None:
    """Each softcapped forward variant the gputest images hold on this GPU, forced through its
    config (the hardware-tanh FAST_TANH and the FMA-pipe EXP2_SPLIT ones among them, which no rule
    selects yet), against the reference: causal and windowed, bf16, at the variant's head dim."""
    import aotriton_rt
    from aotriton_rt.arch import target_arch
    from aotriton_rt.ops.attention import attention_kernels
    from builder.tune import forced_config, without_mask_mode

    lib = aotriton_rt.Library(gpu_images)
    arch = target_arch(lib, torch.cuda.current_device())
    found = sorted({(v.kernel, v.spec["HEAD_DIM"], v.spec["CAUSAL"], v.config.index) for v in lib.variants
                    if v.target.arch == arch and v.spec.get("SOFTCAP") and v.spec["dtype"] == "bf16"
                    and v.kernel in ("attn_fwd", "attn_fwd_sm90") and v.spec["HEAD_DIM"] == v.spec["HEAD_DIM_V"]
                    and not v.spec.get("VARLEN") and not v.spec.get("BIAS") and not v.spec.get("DROPOUT")
                    and v.spec["CAUSAL"] in (1, 2)})
    assert found, "the gputest images hold no softcapped forward for this GPU"
    gen = torch.Generator(device="cuda").manual_seed(8)
    failures, ran_cases = [], 0
    for kernel, d, mode, index in found:
        q, k, v = (torch.randn(1, 333, h, d, device="cuda", generator=gen).mul(4).to(torch.bfloat16) for h in (4, 2, 2))
        view = forced_config(lib, kernel, index)
        if mode == 1:  # mode 2 would serve these equal-length calls
            view = without_mask_mode(view, 2)
        for window in (None, (100, 0)):
            kw = {"window": window} if window else {"causal": True}
            align = "bottom_right" if mode == 2 else "top_left"
            ran = attention_kernels(q, k, v, layout="bshd", align=align, softcap=CAP, library=view, **kw)["attn_fwd"]
            if (ran.name, ran.candidates[0].config.index) != (kernel, index):
                continue  # e.g. a mode-1 variant where mode 2 serves bottom-right calls
            out, _ = aotriton_rt.attention(q, k, v, layout="bshd", align=align, softcap=CAP, library=view, **kw)
            left, right = window if window else (-1, 0)
            ref = _reference(*(t.float().transpose(1, 2) for t in (q, k, v)), CAP, left, right).transpose(1, 2)
            err = _rel(out, ref)
            ran_cases += 1
            if not err <= TOL[torch.bfloat16]:
                failures.append(f"{kernel} D{d} mode {mode} #{index} {'window' if window else 'causal'}: {err:.3g}")
    assert ran_cases >= len(found), f"{ran_cases} cases ran for {len(found)} variants"
    assert not failures, "\n".join(failures)
