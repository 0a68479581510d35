"""The Gluon sm90 FP8 forward (``attn_fwd_fp8_sm90``) on an H100/H200 (marker ``gpu``).

Every variant the images hold (each tile config, both output dtypes, mask modes 0/1/2; mode 1 in
both alignments through its ``causal_align`` argument) runs ragged problems, launched directly:
lengths that are no block multiple, seqlen_q below and above seqlen_k (bottom-right rows that see
no key), a sliding window, GQA and MQA, a long square problem that wraps the slot ring many times,
descales per (batch, key/value head) and per tensor. The reference is fp32 attention of the
dequantised inputs, with the error bounds of tests/runtime/test_attention_fp8_gpu.py (P rounded
to e4m3: ``max <= 2^-4 max|v| + 2^-7 max|ref|``, ``mean <= 2^-8 max|v|``). Inputs live in
NaN-filled buffers: rows past each sequence, columns past the head dim, and V^T's key columns past
``seqlen_k`` (which the pre-pass would zero; TMA's bounds keep this kernel from reading them), past
``seqlen_k`` rounded up to 32 for the configs that read V^T in their key order (``KEY_ORDER=1``).
Outputs are views of NaN-filled buffers whose padding must stay NaN.

The persistent configs (``PERSISTENT`` > 0: a grid of at most 132 programs looping over query
tiles) also run problems around their grid size: fewer tiles than programs, exactly 132, 133,
hundreds with an odd count and heads whose tile count is odd, GQA, seqlen_q above and below
seqlen_k, with descales that differ per (batch, key/value head), which each tile reads anew.

Through the operator: the dispatch runs it for dense calls (``explain`` says so) and its results
agree with the portable ``attn_fwd_fp8`` on the same inputs.

Images: ``AOTRITON_RT_TEST_IMAGES`` pointing at ``python -m builder build --set gputest --targets
sm90 --kernels attn_fwd_fp8,attn_fwd_fp8_sm90,attn_fp8_v_transpose``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402
from tests.runtime.test_attention_sm90_gpu import _reference  # noqa: E402  (fp32 inputs: the same maths)

pytestmark = pytest.mark.gpu
# The Gluon FP8 forward runs by default; kept on here even where the environment turns it off ("0").
os.environ["AOTRITON_RT_FP8_SM90"] = "1"

GLUON = "attn_fwd_fp8_sm90"
OUT = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (B, Sq, Sk, window_left, window_right, heads_q, heads_k); a window side -1 is unbounded.
PROBLEMS = {
    "ragged_gqa": (2, 300, 457, -1, -1, 4, 2),
    "more_queries": (2, 333, 211, -1, -1, 2, 2),
    "window_gqa": (2, 377, 400, 60, 20, 8, 2),
    "short_mqa": (3, 33, 70, -1, -1, 2, 1),
    "long_square": (1, 2048, 2048, -1, -1, 4, 4),
}


@pytest.fixture(scope="module")
def lib() -> Any:
    folder = os.environ.get("AOTRITON_RT_TEST_IMAGES")
    if not folder:
        pytest.skip("set AOTRITON_RT_TEST_IMAGES to images built with --set gputest --targets sm90")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU visible to torch")
    library = aotriton_rt.Library(folder)
    if not library.variants_of(GLUON):
        pytest.skip(f"these images hold no {GLUON}: build with --set gputest --targets sm90 --kernels {GLUON}")
    torch.backends.cuda.matmul.allow_tf32 = False
    return library


def _padded(B: int, n: int, H: int, D: int, gen: Any) -> tuple[Any, Any, Any]:
    """(NaN-filled fp8 buffer, its (B, H, n, D) view holding e4m3 data, that data in fp32)."""
    full = torch.full((B, n + 37, H, D + 64), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    data = (torch.randn(B, n, H, D, device="cuda", generator=gen) * 40).to(torch.float8_e4m3fn)
    view = full[:, :n, :, :D]
    view.copy_(data)
    return full, view.transpose(1, 2), data.float().transpose(1, 2)


def _transposed(v: Any, order: int) -> Any:
    """V^T of a (B, H, n, D) fp8 view: (B, H, D, n) with the keys contiguous, inside a buffer whose
    rows are 16-element multiples and NaN past n (and NaN rows between heads). ``order`` 1: as the
    pre-pass writes it for a KEY_ORDER=1 variant: each 32 keys in the forward's register order and
    zeros from n to the next multiple of 32 (which such a variant reads), NaN past that."""
    from aotriton_rt.ops.attention.fp8 import key_permutation

    B, H, n, D = v.shape
    cols = -(-n // 16) * 16 + 32
    full = torch.full((B, H, D + 8, cols), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    vt = full[:, :, :D, :]
    if order == 0:
        vt[..., :n].copy_(v.transpose(-1, -2))
        return vt
    r32 = -(-n // 32) * 32
    keys = torch.zeros(B, H, D, r32, device="cuda").to(torch.float8_e4m3fn)
    keys[..., :n].copy_(v.transpose(-1, -2))
    perm = torch.tensor(key_permutation(r32), device="cuda")
    vt[..., :r32].view(torch.uint8).copy_(keys.view(torch.uint8).index_select(-1, perm))  # bytes: no fp8 gather
    return vt


def _run_case(lib: Any, v: Any, problem: tuple, align: int, per_head: bool) -> str | None:
    """Variant v on one problem; None if it matches the fp32 reference of the dequantised inputs,
    else why not."""
    B, Sq, Sk, left, right, Hq, Hk = problem
    causal, D, od = v.spec["CAUSAL"], v.spec["HEAD_DIM"], v.spec["out_dtype"]
    win_left, win_right = (left, right) if causal else (-1, -1)
    if causal and left < 0:
        win_right = 0  # plain causal
    gen = torch.Generator(device="cuda").manual_seed(1000 * v.config.index + Sq)
    _, q8, q = _padded(B, Sq, Hq, D, gen)
    _, k8, k = _padded(B, Sk, Hk, D, gen)
    _, v8, vf = _padded(B, Sk, Hk, D, gen)
    vt = _transposed(v8, v.config.constexprs.get("KEY_ORDER", 0))
    if per_head:
        descales = [torch.rand(B, Hk, device="cuda", generator=gen) * 0.02 + 0.005 for _ in range(3)]
        strides = [d.stride() for d in descales]
    else:
        descales = [torch.full((1,), x, device="cuda") for x in (0.011, 0.007, 0.019)]
        strides = [(0, 0)] * 3
    rep = Hq // Hk
    dq, dk, dv = (d.expand(B, Hk) if not per_head else d for d in descales)
    qd = q * dq.repeat_interleave(rep, 1)[..., None, None]
    kd, vd = k * dk[..., None, None], vf * dv[..., None, None]
    out_full = torch.full((B, Sq + 5, Hq, D + 64), float("nan"), device="cuda", dtype=OUT[od])
    out = out_full[:, :Sq, :, :D].transpose(1, 2)
    lse = torch.full((B, Hq, Sq + 5), float("nan"), device="cuda")[:, :, :Sq]
    scale = 1 / math.sqrt(D)
    handle = lib.kernel(GLUON, **v.spec, **v.config.constexprs, num_warps=v.config.num_warps,
                        num_stages=v.config.num_stages)
    values = {"Q": q8, "K": k8, "V": vt, "Out": out, "LSE": lse, "cu_seqlens_q": None, "cu_seqlens_k": None,
              "q_descale": descales[0], "k_descale": descales[1], "v_descale": descales[2],
              **{f"stride_q{a}": s for a, s in zip("zhm", q8.stride()[:3])},
              **{f"stride_k{a}": s for a, s in zip("zhn", k8.stride()[:3])},
              **{f"stride_v{a}": s for a, s in zip("zhd", vt.stride()[:3])},
              **{f"stride_o{a}": s for a, s in zip("zhm", out.stride()[:3])},
              "stride_lz": lse.stride(0), "stride_lh": lse.stride(1),
              "stride_qdz": strides[0][0], "stride_qdh": strides[0][1], "stride_kdz": strides[1][0],
              "stride_kdh": strides[1][1], "stride_vdz": strides[2][0], "stride_vdh": strides[2][1],
              "batch": B, "num_heads_q": Hq, "num_heads_k": Hk, "seqlen_q": Sq, "seqlen_k": Sk, "sm_scale": scale,
              "window_left": win_left, "window_right": win_right, "causal_align": align}
    handle(*[values[n] for n in handle.arg_names])
    torch.cuda.synchronize()
    ref, ref_lse = _reference(qd, kd, vd, causal, win_left, win_right, scale, align)
    err = (out.float() - ref).abs()
    vmax = vd.abs().max().item()
    bound = vmax / 16 + ref.abs().max().item() / 128
    finite = torch.isfinite(ref_lse)
    lse_ok = torch.equal(torch.isfinite(lse), finite)
    err_lse = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    lse_bound = 2e-3 * ref_lse[finite].abs().max().item() + 1e-3 if finite.any() else 0.0
    pad_ok = bool(out_full[:, Sq:].isnan().all()) and bool(out_full[..., D:].isnan().all())
    if err.max().item() <= bound and err.mean().item() <= vmax / 256 and lse_ok and err_lse <= lse_bound and pad_ok:
        return None
    return (f"{v.spec} #{v.config.index} {v.config.constexprs} B{B} Hq{Hq} Hk{Hk} Sq{Sq} Sk{Sk} window "
            f"({win_left}, {win_right}) causal_align {align} per-head descales {per_head}: out max "
            f"{err.max().item():.3g} (bound {bound:.3g}) mean {err.mean().item():.3g} (bound {vmax / 256:.3g}) "
            f"lse {err_lse:.3g} lse-inf-rows-agree {lse_ok} padding-untouched {pad_ok}")


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_every_gluon_fp8_variant_matches_fp32_of_the_dequantised_inputs(lib: Any, problem: str) -> None:
    failures = []
    for v in lib.variants_of(GLUON):
        if v.spec["CAUSAL"] == 0 and PROBLEMS[problem][3] >= 0:
            continue  # windows are a band: mask modes 1 and 2
        for align in ((0, 1) if v.spec["CAUSAL"] == 1 else (0,)):
            for per_head in (True, False):
                failure = _run_case(lib, v, PROBLEMS[problem], align, per_head)
                if failure:
                    failures.append(failure)
    assert not failures, "\n".join(failures)


# (B, Sq, Sk, window_left, window_right, heads_q, heads_k) around the persistent grid of 132 programs.
PERSISTENT_PROBLEMS = {
    "one_tile": (1, 40, 300, -1, -1, 1, 1),
    "fewer_tiles_than_programs": (2, 500, 700, -1, -1, 3, 1),
    "tiles_132": (3, 512, 512, -1, -1, 11, 11),
    "tiles_133": (7, 128, 200, -1, -1, 19, 19),
    "odd_tiles_gqa_window": (5, 1100, 1050, 200, 30, 9, 3),
    "more_queries_gqa": (3, 1300, 900, -1, -1, 8, 2),
}


@pytest.mark.parametrize("problem", sorted(PERSISTENT_PROBLEMS))
def test_persistent_gluon_fp8_variants_compute_every_tile_of_ragged_problems(lib: Any, problem: str) -> None:
    persistent = [v for v in lib.variants_of(GLUON) if v.config.constexprs.get("PERSISTENT", 0) > 0]
    assert {v.spec["HEAD_DIM"] for v in persistent} == {64, 128}, "gputest holds persistent configs at 64 and 128"
    failures = []
    for v in persistent:
        if v.spec["CAUSAL"] == 0 and PERSISTENT_PROBLEMS[problem][3] >= 0:
            continue  # windows are a band: mask modes 1 and 2
        for align in ((0, 1) if v.spec["CAUSAL"] == 1 else (0,)):
            failure = _run_case(lib, v, PERSISTENT_PROBLEMS[problem], align, per_head=True)
            if failure:
                failures.append(failure)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("causal, align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
def test_the_operator_runs_it_for_dense_calls_and_agrees_with_the_portable_fp8_forward(lib: Any, causal: bool,
                                                                                      align: str) -> None:
    from aotriton_rt.ops.attention import explain
    from builder.tune import without_kernel

    portable = without_kernel(lib, GLUON)
    B, Hq, Hk, Sq, Sk, D = 2, 8, 2, 517, 1029, 128
    ex = explain(dtype="fp8e4nv", head_dim=D, seqlen_q=Sq, seqlen_k=Sk, causal=causal, align=align, library=lib)
    assert ex.kernels[-1].kernel == GLUON, str(ex)
    assert explain(dtype="fp8e4nv", head_dim=D, seqlen_q=Sq, seqlen_k=Sk, causal=causal, align=align,
                   library=portable).kernels[-1].kernel == "attn_fwd_fp8"
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = ((torch.randn(B, h, s, D, device="cuda", generator=gen) * 40).to(torch.float8_e4m3fn)
               for h, s in ((Hq, Sq), (Hk, Sk), (Hk, Sk)))
    descales = {n: torch.rand(B, Hk, device="cuda", generator=gen) * 0.02 + 0.005
                for n in ("q_descale", "k_descale", "v_descale")}
    got, got_lse = aotriton_rt.attention(q, k, v, causal=causal, align=align, library=lib, **descales)
    want, want_lse = aotriton_rt.attention(q, k, v, causal=causal, align=align, library=portable, **descales)
    vmax = (v.float() * descales["v_descale"][..., None, None]).abs().max().item()
    diff = (got.float() - want.float()).abs()
    # Both round P to e4m3 the same way; their fp32 sums differ in order, which can move a
    # probability across a rounding boundary now and then.
    assert diff.max().item() <= vmax / 16 and diff.mean().item() <= vmax / 512, (diff.max().item(), vmax)
    seen = want_lse.isfinite()
    assert torch.equal(got_lse.isfinite(), seen)
    assert (got_lse[seen] - want_lse[seen]).abs().max().item() < 1e-3 * want_lse[seen].abs().max().item() + 1e-3
