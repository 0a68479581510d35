"""The attention operator on a GPU against an fp32 reference, every feature (marker ``gpu``).

Accuracy follows AOTriton's rule: an output may differ from the fp32 reference (fp64 for fp32
inputs) by at most ``k`` times what the same reference computed in the input's precision
differs from it, plus a small ``eps`` relative to the output's magnitude, all max-abs. Inputs
live inside larger NaN-filled buffers (views), so a read out of bounds poisons the result; the
outputs are written into views of NaN-filled buffers too, and the padding must stay NaN, so a
write out of bounds shows. Sequence lengths are primes or otherwise not block multiples.

Images: ``AOTRITON_RT_TEST_IMAGES`` pointing at ``python -m builder build --set gputest
--targets sm90`` (``builder/kernels/_attention_sets.py`` lists what the matrix needs; a CPU test
keeps the two in step). The atomic-dQ cases need ``attn_bwd_dq_convert`` in those images and
skip, saying so, without it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402
from aotriton_rt import ArgumentError  # noqa: E402
from aotriton_rt.ops import attention as op  # noqa: E402

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # the module-level name lets a development dry run point it elsewhere
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Reference precision: fp32 for 16-bit inputs, fp64 for fp32 inputs.
HIGH = {"fp16": torch.float32, "bf16": torch.float32, "fp32": torch.float64}
# (k, eps): |ours - ref_hi| <= k * |ref_lo - ref_hi| + eps * max(1, |ref_hi|), max-abs per output.
BOUNDS = {"out": (3.0, 2e-4), "lse": (3.0, 2e-5), "dq": (4.0, 5e-4), "dk": (4.0, 5e-4), "dv": (4.0, 5e-4),
          "dbias": (4.0, 5e-4)}
EPS_SCALE = {"fp16": 1.0, "bf16": 8.0, "fp32": 0.05}


# ---------------------------------------------------------------------------------------------
# The matrix. A case is plain data; ``plan`` turns it into shapes and operator options, shared
# with the CPU test that checks every kernel this matrix dispatches is in the gputest set.
# ---------------------------------------------------------------------------------------------

def _case(dtype: str = "fp16", D: int = 64, **kw: Any) -> dict:
    return {"dtype": dtype, "D": D, **kw}


MATRIX: dict[str, dict] = {
    # dtypes x default head dims, both layouts, no mask and causal (equal lengths).
    "fp16_d64": _case(),
    "fp16_d64_causal": _case(causal=True),
    "fp16_d128_bshd": _case(D=128, layout="bshd"),
    "fp16_d128_causal": _case(D=128, causal=True),
    "bf16_d64_bshd": _case("bf16", layout="bshd"),
    "bf16_d64_causal": _case("bf16", causal=True),
    "bf16_d128": _case("bf16", D=128),
    "bf16_d128_causal_bshd": _case("bf16", D=128, causal=True, layout="bshd"),
    "fp32_d64": _case("fp32"),
    "fp32_d64_causal": _case("fp32", causal=True, layout="bshd"),
    "fp32_bias_dropout": _case("fp32", bias="full", dropout=0.2),
    # Head dims off the buckets (padded), off powers of two, unequal q·k / v.
    "fp16_d40_padded_to_48": _case(D=40, S=131),
    "fp16_d8_padded_to_16": _case(D=8, S=131),
    "bf16_d72_causal_padded_to_80": _case("bf16", D=72, causal=True, S=131),
    "fp16_d96": _case(D=96, S=131),
    "bf16_d200_padded_to_224": _case("bf16", D=200, S=97),
    "fp16_d256_causal": _case(D=256, causal=True, S=131),
    "fp16_d100_padded_to_128": _case(D=100, S=131),
    "fp16_qk192_v128": _case(D=192, Dv=128, S=131),
    "fp16_qk192_v128_causal": _case(D=192, Dv=128, causal=True, S=131),
    "bf16_qk192_v128_causal_bshd": _case("bf16", D=192, Dv=128, causal=True, S=131, layout="bshd"),
    "fp16_qk64_v32_padded": _case(D=64, Dv=32),
    # Head dim 512 (fp16/bf16; runs D in 257..512 zero-padded): both layouts and dtypes, padded
    # dims, GQA, unequal lengths in both alignments, varlen, unequal q·k / v on the 512 bucket.
    "fp16_d512": _case(D=512, S=131),
    "bf16_d512_causal_bshd": _case("bf16", D=512, causal=True, S=131, layout="bshd"),
    "fp16_d384_causal_padded_to_512": _case(D=384, causal=True, S=97),
    "bf16_d300_padded_to_512": _case("bf16", D=300, S=67),
    "fp16_d512_gqa_8_to_2_causal": _case(D=512, Hq=8, Hk=2, causal=True, S=131),
    "fp16_d512_top_left_sq_lt_sk": _case(D=512, causal=True, Sq=67, Sk=131),
    "bf16_d512_bottom_right_sq_gt_sk_empty_rows": _case("bf16", D=512, causal=True, align="bottom_right", Sq=131,
                                                        Sk=67),
    "fp16_d512_varlen_causal_bottom_right": _case(D=512, varlen=((37, 53), (129, 129), (1, 7)), causal=True,
                                                  align="bottom_right"),
    "fp16_qk512_v256_padded": _case(D=512, Dv=256, S=67),
    # Causal alignments with seqlen_q != seqlen_k (bottom-right with empty rows).
    "fp16_top_left_sq_lt_sk": _case(causal=True, Sq=113, Sk=257),
    "fp16_top_left_sq_gt_sk": _case(causal=True, Sq=257, Sk=113),
    "bf16_d128_top_left_bshd": _case("bf16", D=128, causal=True, Sq=199, Sk=331, layout="bshd"),
    "fp16_bottom_right_sq_gt_sk_empty_rows": _case(causal=True, align="bottom_right", Sq=257, Sk=113),
    "bf16_d128_bottom_right_sq_lt_sk": _case("bf16", D=128, causal=True, align="bottom_right", Sq=113, Sk=257),
    # Sliding windows.
    "fp16_window_bottom_right": _case(window=(32, 16), align="bottom_right"),
    "fp16_window_causal_top_left": _case(window=(64, 0), causal=True, Sq=199, Sk=307),
    "fp16_window_right_only": _case(window=(-1, 20)),
    "bf16_d128_window_bottom_right": _case("bf16", D=128, window=(100, 100), align="bottom_right", Sq=307,
                                           Sk=199),
    # Bias: full, broadcast over rows / heads / batch / keys, without its gradient.
    "fp16_bias_full": _case(bias="full"),
    "fp16_bias_rows_broadcast": _case(bias="rows"),
    "fp16_bias_no_grad": _case(bias="full", bias_grad=False),
    "fp16_bias_heads_causal": _case(bias="heads", causal=True),
    "bf16_d128_bias_2d": _case("bf16", D=128, bias="2d"),
    "fp16_bias_keys_broadcast_copied": _case(bias="keys"),
    # Dropout (the applied mask drives the reference).
    "fp16_dropout": _case(dropout=0.2),
    "fp16_dropout_causal": _case(dropout=0.1, causal=True),
    "bf16_d128_dropout_bshd": _case("bf16", D=128, dropout=0.3, layout="bshd"),
    "fp16_dropout_bias_gqa_causal": _case(dropout=0.15, bias="heads", causal=True, Hq=8, Hk=2),
    # GQA / MQA.
    "fp16_gqa_8_to_2_causal": _case(Hq=8, Hk=2, causal=True),
    "bf16_d128_mqa_6_to_1": _case("bf16", D=128, Hq=6, Hk=1),
    # Variable lengths (one sequence of length 1, one with fewer keys than queries).
    "fp16_varlen": _case(varlen=((37, 53), (129, 129), (1, 7), (200, 61))),
    "fp16_varlen_causal_bottom_right": _case(varlen=((37, 53), (129, 129), (1, 7), (200, 61)), causal=True,
                                             align="bottom_right"),
    "bf16_d128_varlen_causal_bottom_right": _case("bf16", D=128, varlen=((67, 131), (211, 97)), causal=True,
                                                  align="bottom_right"),
    "fp16_varlen_top_left_window_bias_dropout_gqa": _case(varlen=((67, 131), (211, 97), (3, 3)), causal=True,
                                                          window=(30, 0), bias="full", dropout=0.1, Hq=4, Hk=2),
    "fp16_varlen_self_attention_causal": _case(varlen=((67, 67), (211, 211), (5, 5)), causal=True, self_cu=True),
    # Layouts that cannot be read in place (copied), batch 1 and a large batch.
    "fp16_bshd_odd_rows_copied_causal": _case(layout="bshd", pad="odd", causal=True),
    "bf16_d128_bhsd_odd_rows_copied": _case("bf16", D=128, pad="odd"),
    "fp16_batch1_long": _case(B=1, Hq=2, Hk=2, S=1031, causal=True),
    "fp16_batch64": _case(B=64, Hq=2, Hk=2, S=67),
    # Atomic-dQ backward (needs attn_bwd_dq_convert in the images).
    "atomic_fp16": _case(atomic=True),
    "atomic_fp16_causal": _case(atomic=True, causal=True),
    "atomic_bf16_d128_causal": _case("bf16", D=128, atomic=True, causal=True),
    "atomic_fp16_varlen_causal": _case(atomic=True, varlen=((37, 53), (129, 129), (200, 61)), causal=True,
                                       align="bottom_right"),
    "atomic_fp16_d40_bias": _case(D=40, S=131, atomic=True, bias="full"),
    # Through the torch op (autograd).
    "torch_dropout_bias_gqa_causal": _case(api="torch", dropout=0.15, bias="heads", causal=True, Hq=8, Hk=2),
    "torch_varlen_causal": _case(api="torch", varlen=((37, 53), (129, 129)), causal=True, align="bottom_right"),
}


#: Bottom-right cases of unequal lengths run once more on images without mask mode 2 (a library
#: view hides it), as the default set is: a mode-1 kernel aligns their band by its causal_align
#: argument, per sequence under varlen (the gputest set holds mode 1 for each).
MODE_ONE = ("fp16_bottom_right_sq_gt_sk_empty_rows", "bf16_d128_bottom_right_sq_lt_sk", "bf16_d128_window_bottom_right",
            "bf16_d128_varlen_causal_bottom_right")


# The standalone tests below, as cases: the CPU test checks their kernels are in the set too.
STANDALONE: dict[str, dict] = {
    "dropout_mask_reproducible": _case(dropout=0.2),
    "torch_dropout_manual_seed": _case(dropout=0.2),
    "deterministic_backward": _case("bf16", Hq=8, Hk=2, causal=True),
    "atomic_vs_split": _case(causal=True, atomic=True),
    "torch_compile_training": _case("bf16", layout="bshd", causal=True),
    "opcheck": _case(causal=True, align="bottom_right", bias="heads", dropout=0.1, Sq=67, Sk=97, Hq=4, Hk=2),
}


@dataclass
class Plan:
    """Shapes (in the case's layout) and operator options of a case."""

    dtype: str
    layout: str
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    lens_q: list[int]
    lens_k: list[int]
    bias: tuple[int, ...] | None
    options: dict[str, Any] = field(default_factory=dict)
    backward: dict[str, Any] = field(default_factory=dict)
    varlen: bool = False


def plan(case: dict) -> Plan:
    B, Hq, Hk = case.get("B", 2), case.get("Hq", 4), case.get("Hk", case.get("Hq", 4))
    D, Dv = case["D"], case.get("Dv", case["D"])
    layout = case.get("layout", "bhsd")
    options: dict[str, Any] = {"causal": case.get("causal", False), "window": case.get("window"),
                               "align": case.get("align", "top_left")}
    varlen = case.get("varlen")
    if varlen:
        B = len(varlen)
        lens_q, lens_k = [a for a, _ in varlen], [b for _, b in varlen]
        Sq, Sk = max(lens_q), max(lens_k)
        shapes = ((sum(lens_q), Hq, D), (sum(lens_k), Hk, D), (sum(lens_k), Hk, Dv))
        options.update(max_seqlen_q=Sq, max_seqlen_k=Sk)
    else:
        Sq, Sk = case.get("Sq", case.get("S", 257)), case.get("Sk", case.get("S", 257))
        lens_q, lens_k = [Sq] * B, [Sk] * B
        if layout == "bhsd":
            shapes = ((B, Hq, Sq, D), (B, Hk, Sk, D), (B, Hk, Sk, Dv))
        else:
            shapes = ((B, Sq, Hq, D), (B, Sk, Hk, D), (B, Sk, Hk, Dv))
            options["layout"] = "bshd"
    bias = None
    if case.get("bias"):
        bias = {"full": (B, Hq, Sq, Sk), "rows": (B, Hq, 1, Sk), "heads": (Hq, Sq, Sk), "2d": (Sq, Sk),
                "keys": (B, 1, Sq, 1)}[case["bias"]]
    if case.get("dropout"):
        options.update(dropout_p=case["dropout"], seed=0x5EED_0000_1234 + len(str(case)), offset=7)
    backward = {**({"scheme": "atomic"} if case.get("atomic") else {"deterministic": True}),
                "bias_grad": case.get("bias_grad", True)}
    return Plan(case["dtype"], layout, *shapes, lens_q, lens_k, bias, options, backward, bool(varlen))


# ---------------------------------------------------------------------------------------------
# Buffers and the reference.
# ---------------------------------------------------------------------------------------------

def nan_view(shape: tuple[int, ...], dtype: Any, odd: bool = False) -> tuple[Any, Any]:
    """A view of ``shape`` inside a larger NaN-filled buffer, and the buffer.

    Every leading dimension is padded on both sides, rows after their end: to a multiple of 16
    elements plus 16, so the view keeps the strides and alignment the kernels read in place, or
    by 3 (``odd``), which forces the operator to copy.
    """
    pads = [2] * (len(shape) - 1) + [3 if odd else (-shape[-1]) % 16 + 16]
    base = torch.full([s + p for s, p in zip(shape, pads)], float("nan"), dtype=dtype, device=DEVICE)
    view = base[tuple(slice(1, 1 + s) for s in shape[:-1]) + (slice(0, shape[-1]),)]
    return view, base


def assert_padding_untouched(name: str, base: Any, view: Any) -> None:
    """The view's elements are written (finite) and nothing around it is."""
    marker = torch.zeros_like(base, dtype=torch.bool)
    probe = marker.as_strided(view.shape, view.stride(), view.storage_offset() - base.storage_offset()
                              + marker.storage_offset())
    probe.fill_(True)
    assert torch.isnan(base[~marker].float()).all(), f"{name}: the kernel wrote outside its output view"
    assert not torch.isnan(view.float()).any(), f"{name}: part of the output was never written"


def band(lq: int, lk: int, case: dict) -> Any:
    causal, window = case.get("causal", False), case.get("window")
    if not causal and window is None:
        return None
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    diag = lk - lq if case.get("align", "top_left") == "bottom_right" else 0
    rel = torch.arange(lk, device=DEVICE)[None, :] - torch.arange(lq, device=DEVICE)[:, None] - diag
    vis = torch.ones(lq, lk, dtype=torch.bool, device=DEVICE)
    if left >= 0:
        vis &= rel >= -left
    if right >= 0:
        vis &= rel <= right
    return vis


def attend(q: Any, k: Any, v: Any, bias: Any, keep: Any, vis: Any, scale: float, p: float) -> tuple[Any, Any]:
    """Math attention on (B, H, S, D) tensors in their own dtype; GQA by repetition."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    if vis is None:
        vis = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device)
    s = s.masked_fill(~vis, float("-inf"))
    row_ok = vis.any(-1)
    s_safe = torch.where(row_ok[:, None], s, torch.zeros((), dtype=s.dtype, device=s.device))
    prob = torch.softmax(s_safe, -1) * row_ok[:, None]
    wide = torch.float64 if s.dtype == torch.float64 else torch.float32
    lse = torch.where(row_ok, torch.logsumexp(s_safe.detach().to(wide), -1),
                      torch.tensor(float("-inf"), dtype=wide, device=s.device))
    if keep is not None:
        prob = prob * keep.to(prob.dtype) / (1 - p)
    return prob @ v, lse


def reference(pl: Plan, case: dict, q: Any, k: Any, v: Any, dout: Any, bias: Any, mask: Any, dtype: Any) -> dict:
    """Outputs and gradients of the case computed by ``attend`` in ``dtype``, shaped like ours."""
    qc, kc, vc = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    bc = bias.detach().to(dtype).requires_grad_() if bias is not None else None
    scale = 1.0 / math.sqrt(case["D"])
    p = case.get("dropout", 0.0)
    if pl.varlen:
        outs, lses = [], []
        sq = sk = 0
        for b, (lq, lk) in enumerate(zip(pl.lens_q, pl.lens_k)):
            qb = qc[sq:sq + lq].transpose(0, 1)[None]
            kb, vb = kc[sk:sk + lk].transpose(0, 1)[None], vc[sk:sk + lk].transpose(0, 1)[None]
            bb = bc[b:b + 1, :, :lq, :lk] if bc is not None else None
            keep = mask[b:b + 1, :, :lq, :lk] if mask is not None else None
            o, lse = attend(qb, kb, vb, bb, keep, band(lq, lk, case), scale, p)
            outs.append(o[0].transpose(0, 1))
            lses.append(lse[0])
            sq, sk = sq + lq, sk + lk
        out, lse = torch.cat(outs, 0), torch.cat(lses, -1)
    else:
        to_bhsd = (lambda t: t.transpose(1, 2)) if pl.layout == "bshd" else (lambda t: t)
        o, lse = attend(to_bhsd(qc), to_bhsd(kc), to_bhsd(vc), bc, mask, band(pl.lens_q[0], pl.lens_k[0], case),
                        scale, p)
        out = to_bhsd(o)
    out.backward(dout.to(dtype))
    return {"out": out.detach(), "lse": lse.detach(), "dq": qc.grad, "dk": kc.grad, "dv": vc.grad,
            "dbias": bc.grad if bc is not None else None}


def check(name: str, got: Any, hi: Any, lo: Any, dtype: str) -> str:
    """AOTriton's bound; returns a one-line summary (raises on failure)."""
    got, hi, lo = got.double(), hi.double(), lo.double()
    assert got.shape == hi.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(hi.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN in the result"
    same_inf = torch.isinf(hi) & (got == hi)
    err = torch.where(same_inf, 0.0, (got - hi).abs()).max().item() if got.numel() else 0.0
    lo_inf = torch.isinf(hi) & (lo == hi)
    base = torch.where(lo_inf, 0.0, (lo - hi).abs()).max().item() if got.numel() else 0.0
    finite = hi[torch.isfinite(hi)]
    magnitude = max(1.0, finite.abs().max().item() if finite.numel() else 1.0)
    k, eps = BOUNDS[name]
    bound = k * base + eps * EPS_SCALE[dtype] * magnitude
    assert err <= bound, f"{name}: max error {err:.3g} > {k} * {base:.3g} + eps = {bound:.3g}"
    return f"{name} {err:.2e}/{bound:.2e}"


# ---------------------------------------------------------------------------------------------
# Tests.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lib(gpu_images: Any) -> aotriton_rt.Library:
    library = aotriton_rt.Library(gpu_images)
    if "attn_fwd" not in library.kernels:
        pytest.skip(f"the images at {gpu_images} have no attention kernels; build them with `python -m builder build "
                    f"--set gputest --targets sm90` and set AOTRITON_RT_TEST_IMAGES")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be IEEE fp32
    return library


def _inputs(pl: Plan, case: dict, gen: Any) -> dict:
    dtype = DTYPES[pl.dtype]
    odd = case.get("pad") == "odd"
    # Shapes are in the case's layout, so BSHD cases hold (B, S, H, D) memory.
    tensors = {}
    for name, shape in (("q", pl.q), ("k", pl.k), ("v", pl.v), ("dout", pl.q[:-1] + pl.v[-1:])):
        view, _ = nan_view(shape, dtype, odd)
        view.copy_(torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype))
        tensors[name] = view
    tensors["bias"] = None
    if pl.bias is not None:
        view, _ = nan_view(pl.bias, dtype)
        view.copy_(torch.randn(pl.bias, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype) * 2)
        tensors["bias"] = view
    if pl.varlen:
        cu_q = torch.tensor([0, *pl.lens_q], device=DEVICE).cumsum(0).to(torch.int32)
        cu_k = cu_q if case.get("self_cu") else torch.tensor([0, *pl.lens_k], device=DEVICE).cumsum(0).to(torch.int32)
        tensors["cu"] = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    else:
        tensors["cu"] = {}
    return tensors


@pytest.mark.parametrize("forward", ["dispatched", "portable", "mode1"])
@pytest.mark.parametrize("name", list(MATRIX))
def test_attention_matches_the_fp32_reference_within_the_low_precision_error(lib: Any, name: str,
                                                                             forward: str) -> None:
    """Every case as dispatched (on sm90 the Gluon forward and dK/dV where the images hold their
    specs) and, where that is not the portable attn_fwd and attn_bwd_dkdv, once more on those
    (tuning overrides); the ``MODE_ONE`` cases once more without mask mode 2 (forward and
    backward on mode 1)."""
    case = MATRIX[name]
    pl = plan(case)
    if forward == "mode1":
        if name not in MODE_ONE:
            pytest.skip("not a bottom-right case of unequal lengths (MODE_ONE)")
        from builder.tune import without_mask_mode

        lib = without_mask_mode(lib, 2)
    if case.get("atomic") and "attn_bwd_dq_convert" not in lib.kernels:
        pytest.skip("the images lack attn_bwd_dq_convert (the atomic-dQ scheme); attention_bwd.py declares it in "
                    "no gputest set")
    gen = torch.Generator(device=DEVICE).manual_seed(sum(map(ord, name)))
    t = _inputs(pl, case, gen)
    q, k, v, dout, bias = t["q"], t["k"], t["v"], t["dout"], t["bias"]
    opts = {**pl.options, **t["cu"], "bias": bias}
    kernel = op.attention_kernels(q, k, v, **opts, return_mask=bool(case.get("dropout")), library=lib)["attn_fwd"]
    if forward == "mode1":
        backward = op.attention_kernels(q, k, v, **opts, backward=True, **pl.backward, library=lib)
        modes = {h.params["CAUSAL"] for h in (kernel, *backward.values()) if "CAUSAL" in h.params}
        assert modes == {1} and "causal_align" in kernel.arg_names, f"{name}: mask modes {modes}"
    if forward == "portable":
        dkdv = op.attention_kernels(q, k, v, **opts, backward=True, **pl.backward, library=lib)["attn_bwd_dkdv"]
        if kernel.name == "attn_fwd" and dkdv.name == "attn_bwd_dkdv":
            pytest.skip("the dispatched forward and dK/dV are the portable ones already")
        from builder.tune import forced_dkdv, forced_forward

        lib = forced_dkdv(forced_forward(lib, "attn_fwd"), "attn_bwd_dkdv")
    dtype = DTYPES[pl.dtype]
    summary = []
    if case.get("api") == "torch":
        from aotriton_rt.ops import torch as op_torch

        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        b_leaf = bias.detach().clone().requires_grad_() if bias is not None else None
        res = op_torch.attention(*leaves, **{**opts, "bias": b_leaf}, return_lse=True,
                                 return_mask=bool(case.get("dropout")), library=lib)
        out, lse = res[0], res[1]
        mask = res[2] if case.get("dropout") else None
        out.backward(dout)
        got = {"out": out.detach(), "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad,
               "dbias": b_leaf.grad if b_leaf is not None else None}
    else:
        out_v, out_base = nan_view(pl.q[:-1] + pl.v[-1:], dtype)
        lse_shape = (pl.q[1], pl.q[0]) if pl.varlen else (pl.q[0], pl.q[1 if pl.layout == "bhsd" else 2],
                                                            pl.q[2 if pl.layout == "bhsd" else 1])
        lse_v, lse_base = nan_view(lse_shape, torch.float32)
        res = op.attention(q, k, v, **opts, out=out_v, lse=lse_v, return_mask=bool(case.get("dropout")), library=lib)
        assert res[0] is out_v and res[1] is lse_v
        mask = res[2] if case.get("dropout") else None
        torch.cuda.synchronize()
        assert_padding_untouched("out", out_base, out_v)
        assert_padding_untouched("lse", lse_base, lse_v)
        grads_v = [nan_view(shape, dtype) for shape in (pl.q, pl.k, pl.v)]
        dq, dk, dv, dbias = op.attention_backward(dout, q, k, v, out_v, lse_v, **opts, **pl.backward,
                                                  dq=grads_v[0][0], dk=grads_v[1][0], dv=grads_v[2][0], library=lib)
        torch.cuda.synchronize()
        for gname, (view, base), result in zip(("dq", "dk", "dv"), grads_v, (dq, dk, dv)):
            assert result is view
            assert_padding_untouched(gname, base, view)
        got = {"out": out_v, "lse": lse_v, "dq": dq, "dk": dk, "dv": dv, "dbias": dbias}
        if case.get("atomic"):
            kernels = op.attention_kernels(q, k, v, **opts, backward=True, scheme="atomic", library=lib)
            assert "attn_bwd_dq_convert" in kernels, f"the atomic scheme did not run: {list(kernels)}"
    if mask is not None:
        kept = mask.float().mean().item()
        assert kept > 0, "dropout dropped everything"
    hi = reference(pl, case, q, k, v, dout, bias, mask, HIGH[pl.dtype])
    lo = reference(pl, case, q, k, v, dout, bias, mask, dtype)
    for what in ("out", "lse", "dq", "dk", "dv", "dbias"):
        if what == "dbias" and (bias is None or not case.get("bias_grad", True)):
            assert got["dbias"] is None or case.get("api") == "torch"
            continue
        summary.append(check(what, got[what], hi[what], lo[what], pl.dtype))
    print(name, forward, kernel.name if forward != "portable" else "attn_fwd", "; ".join(summary))


def test_dropout_mask_is_reproducible_and_moves_with_the_offset(lib: Any) -> None:
    q, k, v = (torch.randn(2, 4, 257, 64, device=DEVICE, dtype=torch.float16) for _ in range(3))
    first = op.attention(q, k, v, dropout_p=0.2, seed=11, offset=3, return_mask=True, library=lib)
    again = op.attention(q, k, v, dropout_p=0.2, seed=11, offset=3, return_mask=True, library=lib)
    moved = op.attention(q, k, v, dropout_p=0.2, seed=11, offset=4, return_mask=True, library=lib)
    assert torch.equal(first[0], again[0]) and torch.equal(first[2], again[2])
    assert not torch.equal(first[2], moved[2])
    kept = first[2].float().mean().item()
    assert abs(kept - 0.8) < 0.01, f"kept {kept:.4f} of the elements, expected 0.8"


def test_torch_dropout_without_a_seed_follows_torch_manual_seed(lib: Any) -> None:
    from aotriton_rt.ops import torch as op_torch

    q, k, v = (torch.randn(2, 4, 257, 64, device=DEVICE, dtype=torch.float16) for _ in range(3))
    torch.manual_seed(1)
    first = op_torch.attention(q, k, v, dropout_p=0.2, return_mask=True, library=lib)[1]
    second = op_torch.attention(q, k, v, dropout_p=0.2, return_mask=True, library=lib)[1]
    torch.manual_seed(1)
    replay = op_torch.attention(q, k, v, dropout_p=0.2, return_mask=True, library=lib)[1]
    assert torch.equal(first, replay), "torch.manual_seed did not reproduce the dropout mask"
    assert not torch.equal(first, second), "two calls drew the same dropout mask"


def test_deterministic_backward_is_bitwise_reproducible(lib: Any) -> None:
    q, k, v, do = (torch.randn(2, 8, 331, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(4))
    k, v = k[:, :2], v[:, :2]
    out, lse = op.attention(q, k, v, causal=True, library=lib)
    first = op.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=True, library=lib)
    for _ in range(3):
        again = op.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=True, library=lib)
        assert all(torch.equal(a, b) for a, b in zip(first[:3], again[:3]))


def test_atomic_and_split_backward_agree(lib: Any) -> None:
    """The two schemes on one dK/dV kernel family give the same dk and dv bit for bit, and dq within
    fp16 rounding (the atomic scheme's dq is summed in whatever order its atomics land).

    Each family's split and atomic dK/dV (``DQ_ATOMIC`` 0 and 1) visit the same query tiles in the
    same order with the same tile shape and the same floating-point instructions for dk and dv:
    ``DQ_ATOMIC`` only adds dQ's matmuls and reductions beside them. The portable family is one
    Triton source; the Gluon one (sm90, where the images hold both variants) computes dV and dK
    with the same wgmmas on the same register operands, its configs have the same BLOCK_M (64) in
    both schemes, and its PTX has the same fp32 arithmetic apart from dQ's, every multiply-add an
    explicit ``fma.rn`` that ptxas cannot contract differently (tests/builder/test_attention_bwd_sm90.py
    checks the PTX). Comparing across families (portable split vs Gluon atomic) would compare two
    summation orders.
    """
    if "attn_bwd_dq_convert" not in lib.kernels:
        pytest.skip("the images lack attn_bwd_dq_convert (the atomic-dQ scheme)")
    q, k, v, do = (torch.randn(2, 4, 331, 64, device=DEVICE, dtype=torch.float16) for _ in range(4))
    from builder.tune import forced_dkdv

    out, lse = op.attention(q, k, v, causal=True, library=lib)
    device = q.device.index or 0
    compared = []
    for family in ("attn_bwd_dkdv", "attn_bwd_dkdv_sm90"):
        view = forced_dkdv(lib, family)
        ran = {scheme: op.attention_kernels(q, k, v, causal=True, backward=True, deterministic=scheme == "split",
                                            scheme=scheme, library=view)["attn_bwd_dkdv"]
               for scheme in ("split", "atomic")}
        if family != "attn_bwd_dkdv" and {h.name for h in ran.values()} == {"attn_bwd_dkdv"}:
            continue  # no Gluon dK/dV for this spec on this device (not sm90, or images without it)
        assert {s: h.name for s, h in ran.items()} == {"split": family, "atomic": family}
        split_v, atomic_v = (ran[s].variant(device) for s in ("split", "atomic"))
        assert {**split_v.spec, "DQ_ATOMIC": 1} == atomic_v.spec and split_v.spec["DQ_ATOMIC"] == 0
        assert (split_v.config.constexprs["BLOCK_M"], split_v.config.constexprs["BLOCK_N"]) == \
            (atomic_v.config.constexprs["BLOCK_M"], atomic_v.config.constexprs["BLOCK_N"]), family
        split = op.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=True, library=view)
        atomic = op.attention_backward(do, q, k, v, out, lse, causal=True, scheme="atomic", library=view)
        assert torch.equal(split[1], atomic[1]) and torch.equal(split[2], atomic[2]), family  # dk, dv: same order
        assert (split[0].float() - atomic[0].float()).abs().max().item() < 2e-3, family
        compared.append(family)
    if torch.cuda.get_device_capability(device) == (9, 0) and "attn_bwd_dkdv_sm90" in lib.kernels:
        # gputest holds the Gluon dK/dV in both schemes for every spec it serves, this one included.
        assert compared == ["attn_bwd_dkdv", "attn_bwd_dkdv_sm90"]


def test_zero_keys_give_zero_output_and_minus_infinity_logsumexp(lib: Any) -> None:
    q = torch.randn(2, 4, 17, 64, device=DEVICE, dtype=torch.float16)
    k = torch.empty(2, 4, 0, 64, device=DEVICE, dtype=torch.float16)
    out, lse = op.attention(q, k, k, library=lib)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    dq, dk, dv, _ = op.attention_backward(torch.ones_like(out), q, k, k, out, lse, library=lib)
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == k.shape and dv.shape == k.shape


def test_cpu_tensors_are_refused_before_launch(lib: Any) -> None:
    q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
    with pytest.raises(ArgumentError, match=r"^q: torch\.Tensor is on the CPU"):
        op.attention(q, q, q, library=lib)


def test_torch_op_trains_under_torch_compile_like_sdpa(lib: Any) -> None:
    from aotriton_rt.ops import torch as op_torch

    torch.manual_seed(0)
    proj = torch.nn.Linear(128, 3 * 128, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(4, 129, 128, device=DEVICE, dtype=torch.bfloat16)

    def loss(attention: Any) -> Any:
        q, k, v = proj(x).view(4, 129, 3, 2, 64).unbind(2)  # BSHD views, 2 heads of 64, read in place
        return attention(q, k, v).float().square().mean()

    ours = lambda q, k, v: op_torch.attention(q, k, v, causal=True, layout="bshd", library=lib)
    ref = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), is_causal=True
    ).transpose(1, 2)
    compiled = torch.compile(loss)
    for _ in range(3):
        proj.zero_grad()
        value = compiled(ours)
        value.backward()
        got = proj.weight.grad.float().clone()
        proj.zero_grad()
        want_value = loss(ref)
        want_value.backward()
        want = proj.weight.grad.float()
        assert abs(value.item() - want_value.item()) < 1e-2 * abs(want_value.item()) + 1e-4
        assert (got - want).abs().max().item() < 3e-2 * want.abs().max().item() + 1e-5
        with torch.no_grad():
            proj.weight -= 0.1 * proj.weight.grad


def test_torch_ops_pass_opcheck(lib: Any) -> None:
    from aotriton_rt.ops import torch as op_torch

    key = op_torch._library_key(lib)
    q = torch.randn(2, 4, 67, 64, device=DEVICE, dtype=torch.float16)
    k = torch.randn(2, 2, 97, 64, device=DEVICE, dtype=torch.float16)
    v = torch.randn(2, 2, 97, 64, device=DEVICE, dtype=torch.float16)
    bias = torch.randn(4, 67, 97, device=DEVICE, dtype=torch.float16)
    fwd = (q, k, v, bias, None, None, None, -1, -1, True, -1, -1, "bottom_right", 0.1, 5, 8, 0.125, "bhsd", False, True,
           key)
    torch.library.opcheck(torch.ops.aotriton_rt.attention_fwd.default, fwd)
    out, lse, _ = torch.ops.aotriton_rt.attention_fwd(*fwd)
    bwd = (torch.randn_like(out), q, k, v, out, lse, bias, None, None, None, -1, -1, True, -1, -1, "bottom_right",
           0.1, 5, 8, 0.125, "bhsd", True, True, key)
    torch.library.opcheck(torch.ops.aotriton_rt.attention_bwd.default, bwd)


def test_cupy_arrays_in_cupy_arrays_out(lib: Any) -> None:
    cupy = pytest.importorskip("cupy")
    q, k, v = (torch.randn(2, 4, 131, 64, device=DEVICE, dtype=torch.float16) for _ in range(3))
    cq, ck, cv = (cupy.from_dlpack(t) for t in (q, k, v))
    out, lse = op.attention(cq, ck, cv, causal=True, library=lib)
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    want, want_lse = op.attention(q, k, v, causal=True, library=lib)
    assert torch.equal(torch.from_dlpack(out), want) and torch.equal(torch.from_dlpack(lse), want_lse)


def test_jax_arrays_get_torch_outputs_that_wrap_back_without_copy(lib: Any) -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU's memory to torch
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(kk, (2, 4, 131, 64), dtype=jnp.float16) for kk in jax.random.split(key, 3))
    out, lse = op.attention(q, k, v, causal=True, library=lib)
    assert isinstance(out, torch.Tensor)
    torch.cuda.synchronize()
    want, _ = op.attention(*(torch.from_dlpack(x) for x in (q, k, v)), causal=True, library=lib)
    assert torch.equal(out, want)
    back = jax.dlpack.from_dlpack(out)
    assert back.shape == (2, 4, 131, 64)


@pytest.fixture(scope="module")
def lib_without_80_and_96(gpu_images: Any, tmp_path_factory: pytest.TempPathFactory) -> aotriton_rt.Library:
    """The images with every head-dim 80 and 96 variant taken out, as the default set has them."""
    import shutil
    from pathlib import Path

    from aotriton_rt.catalog import CATALOG_FILE, Catalog

    catalog = Catalog.load(Path(gpu_images) / CATALOG_FILE)
    if not any(v.kernel == "attn_fwd" and v.spec.get("HEAD_DIM") == 128 for v in catalog.variants):
        pytest.skip(f"the images at {gpu_images} have no head-dim 128 attention kernels")
    out = tmp_path_factory.mktemp("without-80-96")
    kept = [v for v in catalog.variants if v.spec.get("HEAD_DIM") not in (80, 96)]
    for v in kept:
        for image in (v.image, v.ptx):
            if image is not None:
                (out / image.path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(gpu_images) / image.path, out / image.path)
    obj = catalog.to_json()
    obj["variants"] = [v.to_json() for v in kept]
    Catalog.from_json(obj).write(out)  # the index form: an inline catalog this size is refused
    return aotriton_rt.Library(out)


@pytest.mark.parametrize("dtype,D,causal", [("bf16", 80, True), ("fp16", 96, False), ("bf16", 96, True)])
def test_head_dims_without_a_compiled_bucket_run_zero_padded_on_128_forward_and_backward(
        lib_without_80_and_96: Any, dtype: str, D: int, causal: bool) -> None:
    lib = lib_without_80_and_96
    case = _case(dtype, D=D, causal=causal, S=197)
    pl = plan(case)
    gen = torch.Generator(device=DEVICE).manual_seed(D)
    t = _inputs(pl, case, gen)
    q, k, v, dout = t["q"], t["k"], t["v"], t["dout"]
    kernels = op.attention_kernels(q, k, v, **pl.options, backward=True, library=lib)
    assert {h.variant(0).spec["HEAD_DIM"] for h in kernels.values()} == {128}, "not run on the 128 bucket"
    out, lse = op.attention(q, k, v, **pl.options, library=lib)
    dq, dk, dv, _ = op.attention_backward(dout, q, k, v, out, lse, **pl.options, **pl.backward, library=lib)
    torch.cuda.synchronize()
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    hi = reference(pl, case, q, k, v, dout, None, None, HIGH[dtype])
    lo = reference(pl, case, q, k, v, dout, None, None, DTYPES[dtype])
    summary = [check(name, got[name], hi[name], lo[name], dtype) for name in got]
    print(f"{dtype} D={D} causal={causal} on the 128 bucket:", "; ".join(summary))
