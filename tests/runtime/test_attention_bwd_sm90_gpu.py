"""The Gluon sm90 backward kernels (``attn_bwd_dkdv_sm90``, ``attn_bwd_dq_sm90``) on an H100/H200
against an fp32 reference (marker ``gpu``).

Every built variant of each (each dtype, head dim, mask mode and tile config) runs through the
operator (``attention_backward``) on a library view that forces it (``builder.tune.forced_config``;
a dQ variant runs beside the portable dK/dV, so its checks are its own): the split scheme, and for
the dK/dV kernel's ``DQ_ATOMIC=1`` variants the atomic scheme (``scheme="atomic"``: preprocess
zeroing DQacc, the Gluon dK/dV adding dS·K into it, the convert kernel), whose dQ is then the Gluon
kernel's own too. Problems are ragged: lengths that are no block multiple (1000/1111), more queries than keys
(rows that see no key under the bottom-right band), a sliding window with GQA, sequences shorter
than one block. Mask-mode-1 variants run top-left and, where the runtime can send a bottom-right
call to mode 1 (``builder.tune.without_mask_mode``, with the run-time ``causal_align``), bottom-right
too. Inputs live in NaN-filled buffers (rows past each sequence are NaN), so a read past a
sequence poisons the result. dQ, dK and dV must be within bench/sm90_bwd.py's bound (AOTriton's: 4x
the error of the same math in the input dtype, plus an epsilon) of the fp32 reference, and the
kernel's own gradients (dK, dV or dQ) within that bound of the portable kernel's on the same inputs
(bitwise equality is not expected: the two sum their tiles in different orders and round P and dS
at different points).

The dK/dV kernel's aligned-length sibling (``attn_bwd_dkdv_sm90_a16``: both lengths and the LSE
strides declared multiples of 16) runs in place of it wherever a call allows: each of its variants
is forced (through a view forcing its family's config) on problems whose lengths are multiples of
16, with the same NaN padding, checks and bounds; a ragged call on the same images must run the
plain kernel, and both must be right.

Images: ``AOTRITON_RT_TEST_IMAGES`` pointing at ``python -m builder build --set gputest --targets
sm90`` (both kernels declare their gputest variants in builder/kernels/attention_bwd_sm90.py and
attention_bwd_dq_sm90.py).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
NAME = "attn_bwd_dkdv_sm90"
DQ_NAME = "attn_bwd_dq_sm90"
ALIGNED = "attn_bwd_dkdv_sm90_a16"
#: Per Gluon kernel: the portable kernel it stands in for, and the gradients it computes.
ROLES = {NAME: ("attn_bwd_dkdv", ("dk", "dv")), DQ_NAME: ("attn_bwd_dq", ("dq",)),
         ALIGNED: ("attn_bwd_dkdv", ("dk", "dv"))}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (B, query heads, key/value heads, seqlen_q, seqlen_k, window or None).
PROBLEMS = {
    "ragged_gqa": (2, 4, 2, 1000, 1111, None),
    "more_queries": (1, 2, 2, 1111, 1000, None),
    "window_gqa": (2, 4, 2, 777, 900, (100, 20)),
    "short": (3, 2, 1, 33, 70, None),
}
#: Problems whose lengths (and so LSE strides) are multiples of 16: what the aligned sibling serves.
ALIGNED_PROBLEMS = {
    "aligned_gqa": (2, 4, 2, 1024, 1024, None),
    "aligned_more_keys": (1, 2, 2, 512, 1024, None),
    "aligned_more_queries": (1, 2, 2, 1024, 496, None),
    "aligned_window_gqa": (2, 4, 2, 768, 896, (100, 20)),
    "aligned_short": (3, 2, 1, 16, 48, None),
}


def _setup(name: str):
    folder = os.environ.get("AOTRITON_RT_TEST_IMAGES")
    if not folder:
        pytest.skip("set AOTRITON_RT_TEST_IMAGES to images built with --set gputest --targets sm90")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU visible to torch")
    sys.path.insert(0, str(ROOT / "bench"))
    import sm90_bwd

    lib = aotriton_rt.Library(folder)
    found = list(lib.variants_of(name))
    if not found:
        pytest.skip(f"these images hold no {name}: build with --set gputest --targets sm90")
    return sm90_bwd, lib, found


@pytest.fixture(scope="module")
def setup():
    return _setup(NAME)


@pytest.fixture(scope="module")
def setup_dq():
    return _setup(DQ_NAME)


@pytest.fixture(scope="module")
def setup_aligned():
    return _setup(ALIGNED)


def _reference(q, k, v, do, mode: int, window, scale: float, dtype, bottom_right: bool | None = None):
    """(dq, dk, dv) of softmax(q kᵀ scale, masked) v computed in ``dtype`` (k, v shared by GQA groups);
    the band is aligned bottom-right under mask mode 2 or ``bottom_right``."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ ke.transpose(-1, -2)) * scale
    if mode:
        sq, sk = q.shape[2], k.shape[2]
        left, right = window if window else (-1, 0)
        diag = sk - sq if (mode == 2 if bottom_right is None else bottom_right) else 0
        rel = torch.arange(sk, device=q.device)[None, :] - torch.arange(sq, device=q.device)[:, None] - diag
        visible = torch.ones_like(rel, dtype=torch.bool)
        if left >= 0:
            visible &= rel >= -left
        if right >= 0:
            visible &= rel <= right
        seen = visible.any(-1, keepdim=True)  # rows that see no key have no output and no gradient
        s = s.masked_fill(~visible, float("-inf")).masked_fill(~seen, 0.0)
        p = (torch.softmax(s.float(), -1) * seen).to(dtype)
    else:
        p = torch.softmax(s.float(), -1).to(dtype)
    (p @ ve).backward(do.to(dtype))
    return q.grad, k.grad, v.grad


def _options(mode: int, window, scale: float, bottom_right: bool | None = None) -> dict:
    align = "bottom_right" if (mode == 2 if bottom_right is None else bottom_right) else "top_left"
    if window:
        return {"window": window, "align": align, "scale": scale}
    return {"causal": bool(mode), "align": align, "scale": scale}


def _views(lib, name: str, index: int, bottom_right: bool, mode: int):
    """(view forcing ``name``'s config ``index``, view of the portable kernels) for one case. A dQ
    variant runs beside the portable dK/dV. A bottom-right call on a mode-1 variant needs mode 2
    hidden (None, None when this tree cannot hide it)."""
    from aotriton_rt.ops.attention.family import family_of
    from builder import tune

    # The aligned sibling follows its family's rules: forcing the family's config runs it where it serves.
    gluon = tune.forced_config(lib, family_of(name), index)
    if name == DQ_NAME:
        gluon = tune.forced_split(gluon, "attn_bwd_dkdv", DQ_NAME)
    portable = tune.forced_split(lib, "attn_bwd_dkdv", "attn_bwd_dq")
    if bottom_right and mode == 1:
        hide = getattr(tune, "without_mask_mode", None)
        if hide is None:
            return None, None
        gluon, portable = hide(gluon, 2), hide(portable, 2)
    return gluon, portable


def _run_case(bench, lib, v, problem: str, bottom_right: bool | None = None) -> str | None:
    """None when the variant passes ``problem``, else a line saying what failed."""
    from aotriton_rt.ops.attention import attention_kernels

    name = v.kernel
    role, mine = ROLES[name]
    atomic = bool(v.spec.get("DQ_ATOMIC", 0))
    scheme = {"deterministic": False, "scheme": "atomic"} if atomic else {"deterministic": True}
    if atomic:
        mine = ("dq", "dk", "dv")
    B, Hq, Hk, Sq, Sk, window = {**PROBLEMS, **ALIGNED_PROBLEMS}[problem]
    mode, D, dtype_name = v.spec["CAUSAL"], v.spec["HEAD_DIM"], v.spec["dtype"]
    dtype = DTYPES[dtype_name]
    q, k, vv, do = bench.bshd_inputs(torch, B, ((Sq, Hq), (Sk, Hk), (Sk, Hk), (Sq, Hq)), D, dtype,
                                     seed=v.config.index, pad=64)
    scale = 1 / math.sqrt(D)
    options = _options(mode, window, scale, bottom_right)
    gluon, portable = _views(lib, name, v.config.index, bool(bottom_right), mode)
    if gluon is None:
        return None
    handle = attention_kernels(q, k, vv, backward=True, library=gluon, **scheme, **options)[role]
    variant = handle.variant(torch.cuda.current_device())
    launched = (handle.name, variant.config.index, variant.spec.get("DQ_ATOMIC", 0))
    if launched != (name, v.config.index, int(atomic)):
        return f"launched {launched}, not {name}#{v.config.index} DQ_ATOMIC={int(atomic)}"
    out, lse = aotriton_rt.attention(q, k, vv, library=lib, **options)
    got = aotriton_rt.attention_backward(do, q, k, vv, out, lse, library=gluon, **scheme, **options)[:3]
    theirs = aotriton_rt.attention_backward(do, q, k, vv, out, lse, deterministic=True, library=portable,
                                            **options)[:3]
    torch.cuda.synchronize()
    hi = _reference(q, k, vv, do, mode, window, scale, torch.float32, bottom_right)
    lo = _reference(q, k, vv, do, mode, window, scale, dtype, bottom_right)
    bad = []
    for grad, g, h, lo_ in zip(("dq", "dk", "dv"), got, hi, lo):
        e = bench.grad_error(torch, g, h, lo_, dtype_name)
        if not e["ok"]:
            bad.append(f"{grad} err {e['err']:.3g} > bound {e['bound']:.3g} (NaN {e['nan']})")
    for grad, g, p, h, lo_ in zip(("dq", "dk", "dv"), got, theirs, hi, lo):
        if grad not in mine:
            continue
        # Against the portable kernel's result, within the bound the reference check allows.
        bound = bench.grad_error(torch, g, h, lo_, dtype_name)["bound"]
        diff = (g.double() - p.double()).abs().max().item()
        if not diff <= bound:
            bad.append(f"{grad} differs from {role}'s by {diff:.3g} > {bound:.3g}")
    if atomic:
        # The atomic scheme sums dQ in whatever order the additions land: run it again, and the
        # two runs must agree within the same bound (a race would not).
        again = aotriton_rt.attention_backward(do, q, k, vv, out, lse, library=gluon, **scheme, **options)[0]
        bound = bench.grad_error(torch, got[0], hi[0], lo[0], dtype_name)["bound"]
        diff = (again.double() - got[0].double()).abs().max().item()
        if not diff <= bound:
            bad.append(f"dq of a second atomic run differs by {diff:.3g} > {bound:.3g}")
    if bad:
        align = "" if bottom_right is None else (" bottom-right" if bottom_right else " top-left")
        return f"{name} {dict(v.spec)} #{v.config.index} {problem}{align}: " + "; ".join(bad)
    return None


def _run_all(bench, lib, found, problem: str) -> None:
    failures = []
    ran = 0
    for v in found:
        if v.spec["CAUSAL"] == 0 and {**PROBLEMS, **ALIGNED_PROBLEMS}[problem][5]:
            continue  # a window is a band: mask modes 1 and 2
        aligns = (False, True) if v.spec["CAUSAL"] == 1 else (None,)
        for bottom_right in aligns:
            ran += 1
            line = _run_case(bench, lib, v, problem, bottom_right)
            if line:
                failures.append(line)
    assert ran > 0
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_every_gluon_dkdv_variant_matches_an_fp32_reference_and_the_portable_kernel(setup, problem: str) -> None:
    _run_all(*setup, problem)


@pytest.mark.parametrize("problem", sorted(ALIGNED_PROBLEMS))
def test_every_aligned_dkdv_variant_runs_aligned_calls_and_matches_an_fp32_reference_and_the_portable_kernel(
        setup_aligned, problem: str) -> None:
    _run_all(*setup_aligned, problem)


def test_a_ragged_call_runs_the_plain_dkdv_and_an_aligned_one_the_sibling_both_right(setup_aligned) -> None:
    """The same images, the family named by a view (whatever rules the images carry): lengths that
    are multiples of 16 run the sibling, one off them the plain kernel; both match the reference."""
    from aotriton_rt.ops.attention import attention_kernels
    from builder.tune import forced_dkdv

    bench, lib, found = setup_aligned
    view = forced_dkdv(lib, NAME)
    spec = found[0].spec
    D, dtype_name = spec["HEAD_DIM"], spec["dtype"]
    dtype = DTYPES[dtype_name]
    failures = []
    for (Sq, Sk), expect in (((1024, 1024), ALIGNED), ((1024, 1023), NAME), ((1000, 1008), NAME),
                             ((1040, 1008), ALIGNED)):
        q, k, v, do = bench.bshd_inputs(torch, 2, ((Sq, 4), (Sk, 2), (Sk, 2), (Sq, 4)), D, dtype, seed=Sk, pad=64)
        scale = 1 / math.sqrt(D)
        options = _options(spec["CAUSAL"], None, scale, bottom_right=spec["CAUSAL"] == 2)
        handle = attention_kernels(q, k, v, backward=True, deterministic=True, library=view, **options)
        ran = handle["attn_bwd_dkdv"].name
        out, lse = aotriton_rt.attention(q, k, v, library=lib, **options)
        got = aotriton_rt.attention_backward(do, q, k, v, out, lse, deterministic=True, library=view, **options)[:3]
        torch.cuda.synchronize()
        hi = _reference(q, k, v, do, spec["CAUSAL"], None, scale, torch.float32, spec["CAUSAL"] == 2)
        lo = _reference(q, k, v, do, spec["CAUSAL"], None, scale, dtype, spec["CAUSAL"] == 2)
        errors = {g: bench.grad_error(torch, a, h, lo_, dtype_name) for g, a, h, lo_ in zip(("dq", "dk", "dv"), got,
                                                                                          hi, lo)}
        bad = [f"{g} err {e['err']:.3g} > {e['bound']:.3g}" for g, e in errors.items() if not e["ok"]]
        if ran != expect or bad:
            failures.append(f"Sq={Sq} Sk={Sk}: ran {ran} (expected {expect}) {'; '.join(bad)}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_every_gluon_dq_variant_matches_an_fp32_reference_and_the_portable_kernel(setup_dq, problem: str) -> None:
    _run_all(*setup_dq, problem)


def test_the_operator_picks_the_gluon_dkdv_by_default_where_the_images_hold_it(setup) -> None:
    """Without a forced view: the images' own routing (no tuning rule sends these calls elsewhere)."""
    from aotriton_rt.ops.attention import attention_kernels

    bench, lib, found = setup
    if "attn_bwd_dkdv_kernel" in lib.tuning:
        pytest.skip("these images carry attn_bwd_dkdv_kernel rules")
    spec = found[0].spec
    D, dtype = spec["HEAD_DIM"], DTYPES[spec["dtype"]]
    q, k, v, _ = bench.bshd_inputs(torch, 1, ((300, 2),) * 4, D, dtype, seed=0, pad=0)
    options = _options(spec["CAUSAL"], None, 1 / math.sqrt(D))
    handle = attention_kernels(q, k, v, backward=True, library=lib, **options)["attn_bwd_dkdv"]
    assert handle.name == NAME


def test_the_operator_picks_the_gluon_dq_by_default_where_the_images_hold_it(setup_dq) -> None:
    """Without a forced view: the images' own routing (no tuning rule sends these calls elsewhere)."""
    from aotriton_rt.ops.attention import attention_kernels

    bench, lib, found = setup_dq
    if "attn_bwd_dq_kernel" in lib.tuning:
        pytest.skip("these images carry attn_bwd_dq_kernel rules")
    spec = found[0].spec
    D, dtype = spec["HEAD_DIM"], DTYPES[spec["dtype"]]
    q, k, v, _ = bench.bshd_inputs(torch, 1, ((300, 2),) * 4, D, dtype, seed=0, pad=0)
    options = _options(spec["CAUSAL"], None, 1 / math.sqrt(D))
    handle = attention_kernels(q, k, v, backward=True, library=lib, **options)["attn_bwd_dq"]
    assert handle.name == DQ_NAME


def test_the_atomic_scheme_runs_the_gluon_dkdv_where_the_images_hold_its_atomic_spec(setup) -> None:
    """scheme='atomic' without a forced view: the images' own routing sends the atomic dK/dV to the
    Gluon kernel (DQ_ATOMIC=1), beside the preprocess and the convert kernel."""
    from aotriton_rt.ops.attention import attention_kernels

    bench, lib, found = setup
    if "attn_bwd_dkdv_kernel" in lib.tuning:
        pytest.skip("these images carry attn_bwd_dkdv_kernel rules")
    atomic = [v for v in found if v.spec.get("DQ_ATOMIC")]
    if not atomic:
        pytest.skip(f"these images hold no {NAME} with DQ_ATOMIC=1")
    spec = atomic[0].spec
    D, dtype = spec["HEAD_DIM"], DTYPES[spec["dtype"]]
    q, k, v, _ = bench.bshd_inputs(torch, 1, ((300, 2),) * 4, D, dtype, seed=0, pad=0)
    options = _options(spec["CAUSAL"], None, 1 / math.sqrt(D))
    handles = attention_kernels(q, k, v, backward=True, scheme="atomic", library=lib, **options)
    assert list(handles) == ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq_convert"]
    dkdv = handles["attn_bwd_dkdv"]
    assert dkdv.name == NAME and dkdv.variant(torch.cuda.current_device()).spec["DQ_ATOMIC"] == 1
