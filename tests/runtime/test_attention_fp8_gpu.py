"""FP8 attention forward on the GPU (marker ``gpu``), on the gputest images, against fp32.

The reference is fp32 attention of the *dequantised* inputs (fp8 value times its descale
factor), so the only differences are the kernel's own roundings. The error bound: the kernel
rounds each softmax probability P (in [0, 1]) to e4m3 before P·V, a relative error of at most
2^-4 per probability (3 mantissa bits, round to nearest), so ``|out - ref| <= 2^-4 * max|v|``
from P, plus probabilities below e4m3's smallest subnormal (2^-9 of the row maximum) that become
0, plus the output's own rounding (bf16: 2^-8 relative, fp16: 2^-11). Tests assert
``max err <= 2^-4 * max|v| + 2^-7 * max|ref|`` and a mean error well below it
(``<= 2^-8 * max|v|``: the roundings are unbiased and average out over the keys).

Cases: head dims 64 and 128 (and 80, padded onto 128), bf16 and fp16 output, no mask, causal in
both alignments and a window, odd lengths with Sq < Sk and Sq > Sk (rows that see no key), GQA
and MQA, descales per (batch, head) and per tensor, packed sequences with NaN rows past the pack.
The dense cases run on the FP8 forward the images choose (sm90's Gluon ``attn_fwd_fp8_sm90`` where
they hold it) and, where that is the Gluon one, on the portable ``attn_fwd_fp8`` too.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")

# The Gluon FP8 forward runs by default; kept on here even where the environment turns it off ("0").
os.environ["AOTRITON_RT_FP8_SM90"] = "1"
DEVICE = "cuda"
OUT = {"bf16": torch.bfloat16, "fp16": torch.float16}

CASES: dict[str, dict[str, Any]] = {
    "d128_no_mask_bf16_per_head_descales_gqa": dict(D=128, B=2, Hq=8, Hk=2, Sq=300, Sk=457, out="bf16"),
    "d64_causal_bottom_right_fp16_sq_gt_sk_mqa": dict(D=64, B=2, Hq=4, Hk=1, Sq=333, Sk=211, causal=True,
                                                      align="bottom_right", out="fp16"),
    "d128_causal_top_left_fp16_float_descales": dict(D=128, B=3, Hq=4, Hk=4, Sq=257, Sk=389, causal=True,
                                                     out="fp16", descale="float"),
    "d64_window_bshd_bf16": dict(D=64, B=2, Hq=4, Hk=2, Sq=190, Sk=190, window=(33, 7), layout="bshd", out="bf16"),
    "d80_padded_onto_128_causal_bf16": dict(D=80, B=2, Hq=4, Hk=2, Sq=129, Sk=129, causal=True, out="bf16"),
    "d128_long_4096_causal_bf16": dict(D=128, B=1, Hq=4, Hk=4, Sq=4096, Sk=4096, causal=True, out="bf16"),
}
VARLEN = {
    "d128_varlen_causal_bottom_right_bf16_gqa": dict(D=128, Hq=8, Hk=2, lens=((45, 45), (1, 1), (130, 190), (7, 0)),
                                                     causal=True, align="bottom_right", out="bf16"),
    "d64_varlen_no_mask_fp16": dict(D=64, Hq=4, Hk=4, lens=((37, 100), (200, 17), (3, 3)), out="fp16"),
}


@pytest.fixture(scope="module")
def lib(gpu_images: Any) -> Any:
    import aotriton_rt

    library = aotriton_rt.Library(gpu_images)
    if not any(v.kernel == "attn_fwd_fp8" for v in library.variants):
        pytest.skip(f"the images at {gpu_images} have no FP8 variants; build them with `python -m builder build "
                    f"--set gputest --kernels attn_fwd_fp8` and set AOTRITON_RT_TEST_IMAGES")
    torch.backends.cuda.matmul.allow_tf32 = False
    return library


def _fp8() -> Any:
    major, _ = torch.cuda.get_device_capability()
    hip = getattr(torch.version, "hip", None)
    if hip and "gfx942" in torch.cuda.get_device_properties(0).gcnArchName:
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def _quantise(x: Any, per: Any) -> tuple[Any, Any]:
    """(fp8 x, fp32 descale (B, H)): x scaled so each (batch, head) spans e4m3's range."""
    amax = x.abs().amax(dim=(-1, -2)).float().clamp_min(1e-6)
    scale = amax / 224.0  # below both formats' maxima (448 OCP, 240 fnuz)
    return (x / scale[..., None, None]).to(per), scale


def _reference(q, k, v, scale, causal, window, align):
    sq, sk = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    diag = sk - sq if align == "bottom_right" else 0
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    ok = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        ok &= j >= i + diag - left
    if right >= 0:
        ok &= j <= i + diag + right
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v, lse


def _check(got: Any, ref: Any, v: Any, name: str) -> None:
    err = (got.float() - ref).abs()
    vmax = v.abs().max().item()
    bound = vmax / 16 + ref.abs().max().item() / 128
    assert err.max().item() <= bound, f"{name}: max error {err.max().item():.4g} > {bound:.4g}"
    assert err.mean().item() <= vmax / 256, f"{name}: mean error {err.mean().item():.4g} > {vmax / 256:.4g}"


@pytest.mark.gpu
@pytest.mark.parametrize("portable", [False, True], ids=["images_choice", "portable"])
@pytest.mark.parametrize("name", list(CASES))
def test_fp8_forward_matches_fp32_of_the_dequantised_inputs(lib: Any, name: str, portable: bool) -> None:
    import aotriton_rt

    if portable:
        if not lib.variants_of("attn_fwd_fp8_sm90"):
            pytest.skip("the images' choice is the portable FP8 forward already")
        from builder.tune import without_kernel

        lib = without_kernel(lib, "attn_fwd_fp8_sm90")
    c = CASES[name]
    torch.manual_seed(0)
    fp8 = _fp8()
    bshd = c.get("layout") == "bshd"
    q, k, v = (torch.randn(c["B"], h, s, c["D"], device=DEVICE) * 3
               for h, s in ((c["Hq"], c["Sq"]), (c["Hk"], c["Sk"]), (c["Hk"], c["Sk"])))
    kw = {}
    if c.get("descale") == "float":
        scales = [x.abs().max().item() / 224.0 for x in (q, k, v)]
        q8, k8, v8 = ((x / s).to(fp8) for x, s in zip((q, k, v), scales))
        kw = dict(q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
        deq = [x.float() * s for x, s in zip((q8, k8, v8), scales)]
    else:
        # q_descale is per key/value head (FlashAttention-3): one factor per GQA group.
        groups = q.view(c["B"], c["Hk"], -1, c["Sq"], c["D"]).transpose(2, 3).reshape(c["B"], c["Hk"], -1, c["D"])
        _, sq_ = _quantise(groups, fp8)
        q8 = (q / sq_.repeat_interleave(c["Hq"] // c["Hk"], 1)[..., None, None]).to(fp8)
        k8, sk_ = _quantise(k, fp8)
        v8, sv_ = _quantise(v, fp8)
        kw = dict(q_descale=sq_, k_descale=sk_, v_descale=sv_)
        rep = c["Hq"] // c["Hk"]
        deq = [q8.float() * sq_.repeat_interleave(rep, 1)[..., None, None], k8.float() * sk_[..., None, None],
               v8.float() * sv_[..., None, None]]
    args = [x.transpose(1, 2).contiguous() if bshd else x for x in (q8, k8, v8)]
    opts = dict(causal=c.get("causal", False), window=c.get("window"), align=c.get("align", "top_left"),
                layout="bshd" if bshd else "bhsd")
    out, lse = aotriton_rt.attention(*args, **opts, out_dtype=c["out"], library=lib, **kw)
    assert out.dtype == OUT[c["out"]]
    ref, ref_lse = _reference(*deq, c["D"] ** -0.5, opts["causal"], opts["window"], opts["align"])
    _check(out.transpose(1, 2) if bshd else out, ref, deq[2], name)
    seen = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen), f"{name}: rows without keys must have lse -inf"
    assert (lse[seen] - ref_lse[seen]).abs().max().item() < 2e-3 * ref_lse[seen].abs().max().item() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(VARLEN))
def test_fp8_forward_packs_sequences_and_never_reads_past_them(lib: Any, name: str) -> None:
    import aotriton_rt

    c = VARLEN[name]
    torch.manual_seed(1)
    fp8 = _fp8()
    lens_q, lens_k = [a for a, _ in c["lens"]], [b for _, b in c["lens"]]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)
    tq, tk, b = sum(lens_q), sum(lens_k), len(lens_q)
    # Packs inside NaN-filled buffers: any read past a sequence poisons the output.
    qb = torch.full((tq + 16, c["Hq"], c["D"]), float("nan"), device=DEVICE).to(fp8)
    kb = torch.full((tk + 16, c["Hk"], c["D"]), float("nan"), device=DEVICE).to(fp8)
    vb = torch.full((tk + 16, c["Hk"], c["D"]), float("nan"), device=DEVICE).to(fp8)
    qb[:tq] = (torch.randn(tq, c["Hq"], c["D"], device=DEVICE) * 50).to(fp8)
    kb[:tk] = (torch.randn(tk, c["Hk"], c["D"], device=DEVICE) * 50).to(fp8)
    vb[:tk] = (torch.randn(tk, c["Hk"], c["D"], device=DEVICE) * 50).to(fp8)
    dsc = [torch.rand(b, c["Hk"], device=DEVICE) * 0.02 + 0.005 for _ in range(3)]
    out, lse = aotriton_rt.attention(qb[:tq], kb[:tk], vb[:tk], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=c.get("causal", False),
                                     align=c.get("align", "top_left"), q_descale=dsc[0], k_descale=dsc[1],
                                     v_descale=dsc[2], out_dtype=c["out"], library=lib)
    rep = c["Hq"] // c["Hk"]
    for i, (_, n) in enumerate(c["lens"]):
        got = out[cu_q[i]:cu_q[i + 1]].float().transpose(0, 1)[None]
        if n == 0:
            assert torch.equal(got, torch.zeros_like(got)), f"{name}: rows without keys must be 0"
            continue
        dq = dsc[0][i].repeat_interleave(rep)[None, :, None, None]
        qs = qb[cu_q[i]:cu_q[i + 1]].float().transpose(0, 1)[None] * dq
        ks = kb[cu_k[i]:cu_k[i + 1]].float().transpose(0, 1)[None] * dsc[1][i][None, :, None, None]
        vs = vb[cu_k[i]:cu_k[i + 1]].float().transpose(0, 1)[None] * dsc[2][i][None, :, None, None]
        ref, _ = _reference(qs, ks, vs, c["D"] ** -0.5, c.get("causal", False), None, c.get("align", "top_left"))
        _check(got, ref, vs, f"{name}[{i}]")


@pytest.mark.gpu
def test_fp8_forward_refuses_gradients_on_the_gpu(lib: Any) -> None:
    import aotriton_rt
    from aotriton_rt.errors import UnsupportedError

    q = torch.randn(1, 2, 64, 128, device=DEVICE).to(_fp8())
    descale = torch.ones(1, 2, device=DEVICE, requires_grad=True)
    with pytest.raises(UnsupportedError, match="FP8 attention is inference only"):
        aotriton_rt.attention(q, q, q, v_descale=descale, library=lib)
