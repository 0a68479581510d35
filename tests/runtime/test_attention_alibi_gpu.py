"""ALiBi on the GPU (marker ``gpu``), on the gputest images, against an fp32 reference.

FlashAttention-2's definition: each scaled score gets ``-slope[b, h] * |i + Sk - Sq - j|`` (query
row i and key j aligned bottom-right, per sequence), then the mask and the softmax. The calls
(``CASES``) cover fp16 and bf16, head dims 64 and 128 (and 96, padded onto 128), no mask, causal
in both alignments and a window, lengths that are no block multiple with Sq < Sk and Sq > Sk
(rows that see no key), GQA and MQA, slopes shared by the batch and per sequence, packed
sequences, dropout with its returned mask and the atomic-dQ backward; inputs are views into
NaN-filled buffers. Each runs the forward and the backward through ``aotriton_rt.attention`` /
``attention_backward``; the torch op is checked with autograd and under ``torch.compile``.

One CPU test (not marked ``gpu``) checks that every kernel these calls dispatch is in the
gputest set, with ``ALIBI=1``.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.runtime.test_attention_gpu import band  # noqa: E402 - the visible band of a mask, as the operator's tests draw it

DEVICE = "cuda"
TOL = {"fp16": 6e-3, "bf16": 3e-2}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

#: name: the call. ``slopes``: "shared" (Hq,) or "batch" (B, Hq); ``mask``: none, causal or a
#: window (left, 0); ``varlen``: (q, k) lengths per sequence instead of B/Sq/Sk.
CASES: dict[str, dict[str, Any]] = {
    "fp16_d64_causal_bottom_right_sq_lt_sk_gqa_bshd": dict(
        dtype="fp16", D=64, B=2, Hq=8, Hk=2, Sq=173, Sk=259, mask="causal", align="bottom_right", slopes="shared",
        layout="bshd"),
    "bf16_d128_no_mask_sq_gt_sk_per_batch": dict(
        dtype="bf16", D=128, B=3, Hq=4, Hk=4, Sq=300, Sk=211, mask="none", slopes="batch"),
    "fp16_d128_causal_top_left_per_batch_gqa": dict(
        dtype="fp16", D=128, B=2, Hq=6, Hk=3, Sq=211, Sk=333, mask="causal", align="top_left", slopes="batch"),
    "bf16_d64_window_bottom_right_empty_rows_mqa": dict(
        dtype="bf16", D=64, B=2, Hq=4, Hk=1, Sq=300, Sk=211, mask=(40, 0), align="bottom_right", slopes="shared"),
    "fp16_d96_padded_onto_128_causal_bshd": dict(
        dtype="fp16", D=96, B=2, Hq=4, Hk=2, Sq=257, Sk=257, mask="causal", align="bottom_right", slopes="batch",
        layout="bshd"),
    "bf16_d128_varlen_causal_gqa": dict(
        dtype="bf16", D=128, Hq=8, Hk=2, varlen=((45, 45), (1, 1), (130, 190), (64, 64)), mask="causal",
        align="bottom_right", slopes="batch"),
    "fp16_d64_varlen_no_mask_shared": dict(
        dtype="fp16", D=64, Hq=4, Hk=4, varlen=((37, 100), (200, 17), (3, 3)), mask="none", slopes="shared"),
    "fp16_d64_dropout_causal_top_left": dict(
        dtype="fp16", D=64, B=2, Hq=4, Hk=2, Sq=157, Sk=211, mask="causal", align="top_left", slopes="batch",
        dropout=0.2),
    "fp16_d64_atomic_dq_causal_bottom_right": dict(
        dtype="fp16", D=64, B=2, Hq=8, Hk=2, Sq=157, Sk=211, mask="causal", align="bottom_right", slopes="shared",
        scheme="atomic"),
}


def _options(case: dict) -> dict:
    mask = case["mask"]
    opts: dict[str, Any] = {"align": case.get("align", "top_left"), "layout": case.get("layout", "bhsd")}
    if mask == "causal":
        opts["causal"] = True
    elif mask != "none":
        opts["window"] = mask
    return opts


def _sides(case: dict) -> tuple[int, int]:
    """(left, right) of the case's band, -1 unbounded."""
    mask = case["mask"]
    return (-1, 0) if mask == "causal" else (-1, -1) if mask == "none" else mask


def _lengths(case: dict) -> list[tuple[int, int]]:
    return list(case["varlen"]) if case.get("varlen") else [(case["Sq"], case["Sk"])] * case["B"]


def _nan_view(shape: tuple[int, ...], dtype: Any) -> Any:
    """A view of ``shape`` inside a larger NaN-filled buffer (leading dims padded on both sides, the
    last to a multiple of 16 plus 16): the kernels read it in place, and a read past it is NaN."""
    pads = [2] * (len(shape) - 1) + [(-shape[-1]) % 16 + 16]
    base = torch.full([s + p for s, p in zip(shape, pads)], float("nan"), dtype=dtype, device=DEVICE)
    return base[tuple(slice(1, 1 + s) for s in shape[:-1]) + (slice(0, shape[-1]),)]


def _slopes(case: dict, gen: Any) -> Any:
    heads, batch = case["Hq"], len(_lengths(case))
    shape = (heads,) if case["slopes"] == "shared" else (batch, heads)
    # 0.02-0.5 per key: over a few hundred keys the bias reaches tens of logits, so it shapes every row.
    return torch.rand(shape, device=DEVICE, generator=gen) * 0.48 + 0.02


def _inputs(case: dict, gen: Any) -> dict:
    """q, k, v, dout (NaN-padded views in the case's layout, or packed), slopes, cu_seqlens."""
    dtype, D, Hq, Hk = DTYPES[case["dtype"]], case["D"], case["Hq"], case["Hk"]
    lengths = _lengths(case)
    if case.get("varlen"):
        total_q, total_k = sum(a for a, _ in lengths), sum(b for _, b in lengths)
        shapes = {"q": (total_q, Hq, D), "k": (total_k, Hk, D), "v": (total_k, Hk, D), "dout": (total_q, Hq, D)}
    else:
        B, Sq, Sk = case["B"], case["Sq"], case["Sk"]
        bshd = case.get("layout") == "bshd"
        shape = (lambda h, s: (B, s, h, D)) if bshd else (lambda h, s: (B, h, s, D))
        shapes = {"q": shape(Hq, Sq), "k": shape(Hk, Sk), "v": shape(Hk, Sk), "dout": shape(Hq, Sq)}
    arrays = {}
    for name, s in shapes.items():
        view = _nan_view(s, dtype)
        view.copy_(torch.randn(s, device=DEVICE, generator=gen).to(dtype))
        arrays[name] = view
    arrays["slopes"] = _slopes(case, gen)
    if case.get("varlen"):
        for name, col in (("cu_seqlens_q", 0), ("cu_seqlens_k", 1)):
            arrays[name] = torch.tensor([0] + [sum(x[col] for x in lengths[:i + 1]) for i in range(len(lengths))],
                                        dtype=torch.int32, device=DEVICE)
    return arrays


def _per_sequence(x: Any, case: dict, b: int, rows: str) -> Any:
    """Sequence ``b`` of a call's array as (H, S, D) fp32 (``rows``: "q" or "k" lengths)."""
    lengths = _lengths(case)
    col = 0 if rows == "q" else 1
    if case.get("varlen"):
        start = sum(x_[col] for x_ in lengths[:b])
        return x[start:start + lengths[b][col]].float().transpose(0, 1)
    x = x[b].transpose(0, 1) if case.get("layout") == "bshd" else x[b]
    return x.float()


def _reference(case: dict, q: Any, k: Any, v: Any, slope: Any, mask: Any = None, p_drop: float = 0.0) -> tuple:
    """(out, lse) of one sequence in fp32: q (Hq, Sq, D), k/v (Hk, Sk, D), slope (Hq,); ``mask``:
    the applied dropout keep-mask (Hq, Sq, Sk)."""
    sq, sk = q.shape[1], k.shape[1]
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    i = torch.arange(sq, device=DEVICE)[:, None]
    j = torch.arange(sk, device=DEVICE)[None, :]
    s = q @ k.transpose(-1, -2) * case["D"] ** -0.5
    s = s - slope[:, None, None] * (i + sk - sq - j).abs()  # ALiBi: after the scale, bottom-right positions
    visible = band(sq, sk, {"window": _sides(case), "align": case.get("align", "top_left")})
    s = s.masked_fill(~visible, float("-inf"))
    row_ok = visible.any(-1)
    safe = torch.where(row_ok[:, None], s, 0.0)
    p = torch.softmax(safe, -1) * row_ok[:, None]
    lse = torch.where(row_ok, torch.logsumexp(safe, -1), float("-inf"))
    if mask is not None:
        p = p * mask.float() / (1.0 - p_drop)
    return p @ v, lse


def _rel(a: Any, b: Any) -> float:
    """Max error relative to the reference's largest element, at least 0.01 (a sequence of one
    query and one key has dq = 0 exactly: its softmax is 1 whatever the score)."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-2)).item()


@pytest.fixture(scope="module")
def lib(gpu_images: Any) -> Any:
    import aotriton_rt

    library = aotriton_rt.Library(gpu_images)
    if not any(v.kernel == "attn_fwd" and v.spec.get("ALIBI") for v in library.variants):
        pytest.skip(f"the images at {gpu_images} have no ALiBi variants; build them with `python -m builder build "
                    f"--set gputest` and set AOTRITON_RT_TEST_IMAGES")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be IEEE fp32
    return library


def _check_sequences(case: dict, a: dict, out: Any, lse: Any, grads: Any, mask: Any = None) -> None:
    """Every sequence's out, lse and (with ``grads``) dq, dk, dv against fp32 autograd."""
    tol = TOL[case["dtype"]]
    plain_differs = False
    for b, (lq, lk) in enumerate(_lengths(case)):
        leaves = [_per_sequence(a[n], case, b, "q" if n == "q" else "k").clone().requires_grad_()
                  for n in ("q", "k", "v")]
        slope = a["slopes"] if a["slopes"].dim() == 1 else a["slopes"][b]
        seq_mask = None if mask is None else mask[b, :, :lq, :lk].bool()
        ref, ref_lse = _reference(case, *leaves, slope, seq_mask, case.get("dropout", 0.0))
        plain, _ = _reference(case, *(t.detach() for t in leaves), torch.zeros_like(slope), seq_mask,
                              case.get("dropout", 0.0))
        plain_differs |= _rel(ref, plain) > 3 * tol
        got = _per_sequence(out, case, b, "q")
        assert torch.isfinite(got).all(), f"sequence {b}: non-finite output"
        assert _rel(got, ref) <= tol, f"sequence {b} out: {_rel(got, ref):.3g}"
        got_lse = lse[:, sum(x[0] for x in _lengths(case)[:b]):][:, :lq] if case.get("varlen") else lse[b]
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(got_lse), finite), f"sequence {b}: lse -inf where the reference's is not"
        if finite.any():
            assert (got_lse[finite] - ref_lse[finite]).abs().max().item() <= 1e-2, f"sequence {b} lse"
        if grads is None:
            continue
        ref.backward(_per_sequence(a["dout"], case, b, "q"))
        for name, got_g, leaf in zip(("dq", "dk", "dv"), grads, leaves):
            g = _per_sequence(got_g, case, b, "q" if name == "dq" else "k")
            assert torch.isfinite(g).all(), f"sequence {b} {name}: non-finite"
            assert _rel(g, leaf.grad) <= 2 * tol, f"sequence {b} {name}: {_rel(g, leaf.grad):.3g}"
    assert plain_differs, "ALiBi does not change these outputs: the test would prove nothing"


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_fp32_through_attention_and_attention_backward(lib: Any, name: str) -> None:
    import aotriton_rt

    case = CASES[name]
    gen = torch.Generator(device=DEVICE).manual_seed(sum(map(ord, name)))
    a = _inputs(case, gen)
    opts = {**_options(case), "alibi_slopes": a["slopes"], "library": lib}
    if case.get("varlen"):
        opts.update(cu_seqlens_q=a["cu_seqlens_q"], cu_seqlens_k=a["cu_seqlens_k"],
                     max_seqlen_q=max(x for x, _ in case["varlen"]), max_seqlen_k=max(x for _, x in case["varlen"]))
        opts.pop("layout")
    mask = None
    if case.get("dropout"):
        opts.update(dropout_p=case["dropout"], seed=1234, offset=8)
        out, lse, mask = aotriton_rt.attention(a["q"], a["k"], a["v"], return_mask=True, **opts)
    else:
        out, lse = aotriton_rt.attention(a["q"], a["k"], a["v"], **opts)
    grads = aotriton_rt.attention_backward(a["dout"], a["q"], a["k"], a["v"], out, lse,
                                           scheme=case.get("scheme"), **opts)[:3]
    _check_sequences(case, a, out, lse, grads, mask)
    # The kernels that ran are the ALiBi variants (on sm90 too: the Gluon kernels have none).
    from aotriton_rt.ops.attention import attention_kernels

    ran = attention_kernels(a["q"], a["k"], a["v"], backward=True, scheme=case.get("scheme"), **opts)
    assert all(h.params.get("ALIBI", 1) == 1 for h in ran.values()), {n: h.name for n, h in ran.items()}


@pytest.mark.gpu
def test_the_torch_op_trains_with_slopes_under_autograd_and_torch_compile(lib: Any) -> None:
    from aotriton_rt.ops import torch as op_torch

    case = CASES["fp16_d128_causal_top_left_per_batch_gqa"]
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    a = _inputs(case, gen)
    slopes = a["slopes"].clone().requires_grad_()  # a constant to the op: no gradient flows to it
    leaves = [a[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
    out = op_torch.attention(*leaves, causal=True, alibi_slopes=slopes, library=lib)
    out.backward(a["dout"])
    assert slopes.grad is None
    for b in range(case["B"]):
        refs = [_per_sequence(a[n], case, b, "q" if n == "q" else "k").clone().requires_grad_()
                for n in ("q", "k", "v")]
        ref, _ = _reference(case, *refs, a["slopes"][b])
        ref.backward(_per_sequence(a["dout"], case, b, "q"))
        assert _rel(out[b], ref) <= TOL["fp16"]
        for name, leaf, want in zip("qkv", leaves, refs):
            assert _rel(leaf.grad[b], want.grad) <= 2 * TOL["fp16"], f"d{name}: {_rel(leaf.grad[b], want.grad):.3g}"

    def loss(q: Any, k: Any, v: Any, s: Any) -> Any:
        return op_torch.attention(q, k, v, causal=True, alibi_slopes=s, library=lib).float().square().mean()

    compiled = [t.detach().clone().requires_grad_() for t in leaves]
    eager = [t.detach().clone().requires_grad_() for t in leaves]
    value = torch.compile(loss)(*compiled, a["slopes"])  # as the other torch.compile tests: a library= graph-breaks
    value.backward()
    want = loss(*eager, a["slopes"])
    want.backward()
    assert abs(value.item() - want.item()) <= 1e-3 * abs(want.item())
    for c, e in zip(compiled, eager):  # the compiled graph may round the loss's own ops differently
        assert _rel(c.grad, e.grad) <= TOL["fp16"], f"torch.compile gradients: {_rel(c.grad, e.grad):.3g} from eager"


# ---------------------------------------------------------------------------------------------
# On the CPU: every kernel these calls dispatch is in the gputest set.
# ---------------------------------------------------------------------------------------------

def test_every_kernel_these_calls_dispatch_is_an_alibi_variant_of_the_gputest_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from aotriton_rt.ops import attention as op
    from aotriton_rt.ops.attention import dispatch
    from builder.registry import load_kernels
    from builder.targets import KNOWN
    from tests.runtime.test_attention_op import Dev, _Recorder, dispatch_arch_kernels

    decls = load_kernels()
    arch_kernels = set(dispatch_arch_kernels())
    dtype = {"now": "fp16"}

    def in_gputest(lib: Any, name: str, params: dict) -> bool:
        params = {**params, "dtype": dtype["now"]}
        decl = decls[name]
        return (name not in arch_kernels and not (decl.exclude and decl.exclude(params, KNOWN["sm90"]))
                and decl.sets["gputest"](params, KNOWN["sm90"]))

    monkeypatch.setattr(dispatch, "_available", in_gputest)
    monkeypatch.setattr(dispatch, "_takes", lambda lib, name, params, args: all(a in decls[name].signature
                                                                                for a in args))
    for name, case in CASES.items():
        dtype["now"] = case["dtype"]
        D, Hq, Hk = case["D"], case["Hq"], case["Hk"]
        opts = _options(case)
        lengths = _lengths(case)
        if case.get("varlen"):
            tq, tk = sum(x for x, _ in lengths), sum(x for _, x in lengths)
            q, k = Dev(tq, Hq, D), Dev(tk, Hk, D)
            cu = Dev(len(lengths) + 1, dtype="i32")
            opts.pop("layout")
            opts.update(cu_seqlens_q=cu, cu_seqlens_k=Dev(len(lengths) + 1, dtype="i32", ptr=0x7F00_0001_0000),
                        max_seqlen_q=max(x for x, _ in lengths), max_seqlen_k=max(x for _, x in lengths))
        else:
            B, Sq, Sk = case["B"], case["Sq"], case["Sk"]
            bshd = opts["layout"] == "bshd"
            q = Dev(B, Sq, Hq, D) if bshd else Dev(B, Hq, Sq, D)
            k = Dev(B, Sk, Hk, D) if bshd else Dev(B, Hk, Sk, D)
        slopes = Dev(Hq, dtype="fp32") if case["slopes"] == "shared" else Dev(len(lengths), Hq, dtype="fp32")
        rec = _Recorder()
        dropout = {"dropout_p": case["dropout"], "seed": 1} if case.get("dropout") else {}
        for mask in ((False, True) if dropout else (False,)):
            op.attention_kernels(q, k, k, alibi_slopes=slopes, return_mask=mask, library=rec, **dropout, **opts)
        op.attention_kernels(q, k, k, alibi_slopes=slopes, backward=True, scheme=case.get("scheme"), library=rec,
                             **dropout, **opts)
        for kernel, params in rec.asked:
            assert in_gputest(rec, kernel, params), f"{name}: {kernel}[{params}] is not in the gputest set"
            assert params.get("ALIBI", 1) == 1, f"{name}: {kernel} without ALiBi"
        if case.get("scheme") == "atomic":
            assert "attn_bwd_dq_convert" in [n for n, _ in rec.asked], f"{name}: not the atomic scheme"
