"""The images pip users get (``--set default``, embedded in the runtime wheel) on this GPU (marker ``gpu``).

Every forward and backward spec the default catalog holds for this GPU's arch runs through the
public API (the operator's own dispatch, tuning rules included) on ragged GQA problems, against
an fp32 reference (sm90's atomic-dQ backward asked for by name); every decode spec runs against a
cache with per-sequence lengths. A spec the catalog lacks is not tried here: what the default set
covers is README.md's table, checked by tests/runtime/test_readme_default_set.py.

Images: ``AOTRITON_RT_DEFAULT_IMAGES`` (a folder built with ``python -m builder build --set
default --targets <arch>``); without it the set is built here for this GPU's arch.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _specs(lib: aotriton_rt.Library, kernels: tuple[str, ...]) -> list[dict]:
    seen: dict[tuple, dict] = {}
    for name in kernels:
        for v in lib.variants_of(name):
            seen.setdefault(tuple(sorted(v.spec.items())), dict(v.spec))
    return [seen[k] for k in sorted(seen)]


def _reference(q, k, v, causal: bool):
    """fp32 attention in (B, H, S, D); causal with the diagonal top-left aligned."""
    rep = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = (q.float() @ kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        hidden = torch.arange(sk, device=q.device)[None, :] > torch.arange(sq, device=q.device)[:, None]
        s = s.masked_fill(hidden, float("-inf"))
    return torch.softmax(s, -1) @ vf


def test_every_default_attention_spec_matches_an_fp32_reference_forward_and_backward(default_lib) -> None:
    specs = [s for s in _specs(default_lib, ("attn_fwd",)) if not s["DROPOUT"] and not s["BIAS"]
             and not s["VARLEN"]]
    assert specs, "the default images hold no attention forward for this GPU"
    backward_dims = {s["HEAD_DIM"] for s in _specs(default_lib, ("attn_bwd_dkdv",))}
    failures = []
    for spec in specs:
        d, dtype, causal = spec["HEAD_DIM"], DTYPES[spec["dtype"]], bool(spec["CAUSAL"])
        gen = torch.Generator(device="cuda").manual_seed(d)
        q, k, v = (torch.randn(2, h, n, d, device="cuda", dtype=dtype, generator=gen)
                   for h, n in ((4, 301), (2, 333), (2, 333)))
        out, _ = aotriton_rt.attention(q, k, v, causal=causal, library=default_lib)
        qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = _reference(qr, kr, vr, causal)
        err = (out.float() - ref).abs().max().item()
        if not err <= 2e-2:
            failures.append(f"forward {spec}: max error {err:.3g}")
        if d not in backward_dims:
            continue
        dout = torch.randn_like(out)
        out2, lse = aotriton_rt.attention(q, k, v, causal=causal, library=default_lib)
        grads = aotriton_rt.attention_backward(dout, q, k, v, out2, lse, causal=causal, library=default_lib)
        ref.backward(dout.float())
        for name, got, want in zip(("dq", "dk", "dv"), grads[:3], (qr.grad, kr.grad, vr.grad)):
            gerr = ((got.float() - want).abs().max() / want.abs().max()).item()
            if not gerr <= 3e-2:
                failures.append(f"backward {spec} {name}: relative error {gerr:.3g}")
    assert not failures, "\n".join(failures)


def test_every_default_atomic_backward_spec_matches_an_fp32_reference(default_lib) -> None:
    """sm90's atomic-dQ backward, which the default images hold for the tuning database's scheme
    rules (they pick it at long sequences, too long for an fp32 reference here): every spec,
    asked for with ``scheme="atomic"`` on a ragged GQA problem, runs the atomic kernels and
    matches the reference."""
    from aotriton_rt.ops.attention import attention_kernels

    specs = [s for s in _specs(default_lib, ("attn_bwd_dkdv_sm90",)) if s["DQ_ATOMIC"]]
    if not specs:
        pytest.skip("the default images hold no atomic-dQ backward for this GPU (sm90 only)")
    failures = []
    for spec in specs:
        d, dtype, causal = spec["HEAD_DIM"], DTYPES[spec["dtype"]], bool(spec["CAUSAL"])
        gen = torch.Generator(device="cuda").manual_seed(d + 1)
        q, k, v = (torch.randn(2, h, n, d, device="cuda", dtype=dtype, generator=gen)
                   for h, n in ((4, 301), (2, 333), (2, 333)))
        handles = attention_kernels(q, k, v, causal=causal, backward=True, scheme="atomic", library=default_lib)
        ran = handles["attn_bwd_dkdv"].variant(torch.cuda.current_device()).spec.get("DQ_ATOMIC", 0)
        if ran != 1:
            failures.append(f"atomic {spec}: the dK/dV launched has DQ_ATOMIC={ran}")
            continue
        out, lse = aotriton_rt.attention(q, k, v, causal=causal, library=default_lib)
        dout = torch.randn_like(out)
        grads = aotriton_rt.attention_backward(dout, q, k, v, out, lse, causal=causal, scheme="atomic",
                                               library=default_lib)
        qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
        _reference(qr, kr, vr, causal).backward(dout.float())
        for name, got, want in zip(("dq", "dk", "dv"), grads[:3], (qr.grad, kr.grad, vr.grad)):
            gerr = ((got.float() - want).abs().max() / want.abs().max()).item()
            if not gerr <= 3e-2:
                failures.append(f"atomic backward {spec} {name}: relative error {gerr:.3g}")
    assert not failures, "\n".join(failures)


def test_every_default_decode_spec_matches_an_fp32_reference(default_lib) -> None:
    specs = _specs(default_lib, ("attn_decode",))
    assert specs, "the default images hold no decode kernels for this GPU"
    failures = []
    for spec in specs:
        # A masked spec (PADDED_D=1) runs a head dim its bucket only holds masked.
        d, dtype, paged = spec["HEAD_DIM"] - 5 * spec.get("PADDED_D", 0), DTYPES[spec["dtype"]], spec["PAGED"]
        gen = torch.Generator(device="cuda").manual_seed(d + paged)
        b, hq, hk, sq, page, blocks = 3, 8, 2, 1, 16, 12
        lens = torch.tensor([5, 190, 77], dtype=torch.int32, device="cuda")
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=gen)
        kc = torch.randn(b, page * blocks, hk, d, device="cuda", dtype=dtype, generator=gen)
        vc = torch.randn_like(kc)
        if paged:
            perm = torch.randperm(b * blocks, device="cuda", generator=gen)
            table = perm.reshape(b, blocks).to(torch.int32)
            kp = torch.empty(b * blocks, page, hk, d, device="cuda", dtype=dtype)
            vp = torch.empty_like(kp)
            kp[table.flatten().long()] = kc.reshape(b * blocks, page, hk, d)
            vp[table.flatten().long()] = vc.reshape(b * blocks, page, hk, d)
            out, _ = aotriton_rt.decode_attention(q, kp, vp, cache_seqlens=lens, block_table=table,
                                                  library=default_lib)
        else:
            out, _ = aotriton_rt.decode_attention(q, kc, vc, cache_seqlens=lens, library=default_lib)
        for z in range(b):
            n = int(lens[z])
            ref = _reference(q[z:z + 1].transpose(1, 2), kc[z:z + 1, :n].transpose(1, 2),
                             vc[z:z + 1, :n].transpose(1, 2), False).transpose(1, 2)
            err = (out[z:z + 1].float() - ref).abs().max().item()
            if not err <= 2e-2:
                failures.append(f"decode {spec} sequence {z} ({n} keys): max error {err:.3g}")
    assert not failures, "\n".join(failures)
