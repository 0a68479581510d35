"""The Gluon sm90 dK/dV kernel (``attn_bwd_dkdv_sm90``) on an H100/H200 against an fp32 reference
(marker ``gpu``).

Every built variant (each dtype, head dim, mask mode and tile config) runs through the operator
(``attention_backward``, split scheme) on a library view that forces it (``builder.tune.ForcedConfig``),
on ragged problems: lengths that are no block multiple (1000/1111), more queries than keys (rows
that see no key under the bottom-right band), a sliding window with GQA, sequences shorter than
one block. Inputs live in NaN-filled buffers (rows past each sequence are NaN), so a read past a
sequence poisons the result. dQ, dK and dV must be within bench/sm90_bwd.py's bound (AOTriton's: 4x
the error of the same math in the input dtype, plus an epsilon) of the fp32 reference, and dK, dV
within that bound of the portable ``attn_bwd_dkdv``'s on the same inputs (bitwise equality is not
expected: the two sum their tiles in different orders and round P and dS at different points).

Images: ``AOTRITON_RT_TEST_IMAGES`` pointing at ``python -m builder build --set gputest --targets
sm90`` (attn_bwd_dkdv_sm90 declares its gputest variants in builder/kernels/attention_bwd_sm90.py).
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
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (B, query heads, key/value heads, seqlen_q, seqlen_k, window or None).
PROBLEMS = {
    "ragged_gqa": (2, 4, 2, 1000, 1111, None),
    "more_queries": (1, 2, 2, 1111, 1000, None),
    "window_gqa": (2, 4, 2, 777, 900, (100, 20)),
    "short": (3, 2, 1, 33, 70, None),
}


@pytest.fixture(scope="module")
def setup():
    folder = os.environ.get("AOTRITON_RT_TEST_IMAGES")
    if not folder:
        pytest.skip("set AOTRITON_RT_TEST_IMAGES to images built with --set gputest --targets sm90")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU visible to torch")
    sys.path.insert(0, str(ROOT / "bench"))
    import sm90_bwd

    lib = aotriton_rt.Library(folder)
    found = list(lib.variants_of(NAME))
    if not found:
        pytest.skip(f"these images hold no {NAME}: build with --set gputest --targets sm90")
    return sm90_bwd, lib, found


def _reference(q, k, v, do, mode: int, window, scale: float, dtype):
    """(dq, dk, dv) of softmax(q kᵀ scale, masked) v computed in ``dtype`` (k, v shared by GQA groups)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ ke.transpose(-1, -2)) * scale
    if mode:
        sq, sk = q.shape[2], k.shape[2]
        left, right = window if window else (-1, 0)
        diag = sk - sq if mode == 2 else 0
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


def _options(mode: int, window, scale: float) -> dict:
    align = "bottom_right" if mode == 2 else "top_left"
    if window:
        return {"window": window, "align": align, "scale": scale}
    return {"causal": bool(mode), "align": align, "scale": scale}


def _run_case(bench, lib, v, problem: str) -> str | None:
    """None when the variant passes ``problem``, else a line saying what failed."""
    from aotriton_rt.ops.attention import attention_kernels
    from builder.tune import ForcedConfig, forced_dkdv

    B, Hq, Hk, Sq, Sk, window = PROBLEMS[problem]
    mode, D, dtype_name = v.spec["CAUSAL"], v.spec["HEAD_DIM"], v.spec["dtype"]
    dtype = DTYPES[dtype_name]
    q, k, vv, do = bench.bshd_inputs(torch, B, ((Sq, Hq), (Sk, Hk), (Sk, Hk), (Sq, Hq)), D, dtype,
                                     seed=v.config.index, pad=64)
    scale = 1 / math.sqrt(D)
    options = _options(mode, window, scale)
    gluon = ForcedConfig(lib, NAME, v.config.index)
    portable = forced_dkdv(lib, "attn_bwd_dkdv")
    handle = attention_kernels(q, k, vv, backward=True, deterministic=True, library=gluon, **options)["attn_bwd_dkdv"]
    launched = (handle.name, handle.variant(torch.cuda.current_device()).config.index)
    if launched != (NAME, v.config.index):
        return f"launched {launched}, not {NAME}#{v.config.index}"
    out, lse = aotriton_rt.attention(q, k, vv, library=lib, **options)
    got = aotriton_rt.attention_backward(do, q, k, vv, out, lse, deterministic=True, library=gluon, **options)[:3]
    theirs = aotriton_rt.attention_backward(do, q, k, vv, out, lse, deterministic=True, library=portable,
                                            **options)[:3]
    torch.cuda.synchronize()
    hi = _reference(q, k, vv, do, mode, window, scale, torch.float32)
    lo = _reference(q, k, vv, do, mode, window, scale, dtype)
    bad = []
    for name, g, h, lo_ in zip(("dq", "dk", "dv"), got, hi, lo):
        e = bench.grad_error(torch, g, h, lo_, dtype_name)
        if not e["ok"]:
            bad.append(f"{name} err {e['err']:.3g} > bound {e['bound']:.3g} (NaN {e['nan']})")
    for name, g, p, h, lo_ in zip(("dk", "dv"), got[1:], theirs[1:], hi[1:], lo[1:]):
        # Against the portable kernel's result, within the bound the reference check allows.
        bound = bench.grad_error(torch, g, h, lo_, dtype_name)["bound"]
        diff = (g.double() - p.double()).abs().max().item()
        if not diff <= bound:
            bad.append(f"{name} differs from attn_bwd_dkdv's by {diff:.3g} > {bound:.3g}")
    if bad:
        return f"{dict(v.spec)} #{v.config.index} {problem}: " + "; ".join(bad)
    return None


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_every_gluon_dkdv_variant_matches_an_fp32_reference_and_the_portable_kernel(setup, problem: str) -> None:
    bench, lib, found = setup
    failures = []
    ran = 0
    for v in found:
        if v.spec["CAUSAL"] == 0 and PROBLEMS[problem][5]:
            continue  # a window is a band: mask modes 1 and 2
        ran += 1
        line = _run_case(bench, lib, v, problem)
        if line:
            failures.append(line)
    assert ran > 0
    assert not failures, "\n".join(failures)


def test_the_operator_picks_the_gluon_dkdv_by_default_where_the_images_hold_it(setup) -> None:
    """Without a forced view: the images' own routing (no tuning rule sends these calls elsewhere)."""
    from aotriton_rt.ops.attention import attention_kernels

    bench, lib, found = setup
    if lib.catalogs and any("attn_bwd_dkdv_kernel" in (c.tuning or {}) for c in lib.catalogs):
        pytest.skip("these images carry attn_bwd_dkdv_kernel rules")
    spec = found[0].spec
    D, dtype = spec["HEAD_DIM"], DTYPES[spec["dtype"]]
    q, k, v, _ = bench.bshd_inputs(torch, 1, ((300, 2),) * 4, D, dtype, seed=0, pad=0)
    options = _options(spec["CAUSAL"], None, 1 / math.sqrt(D))
    handle = attention_kernels(q, k, v, backward=True, library=lib, **options)["attn_bwd_dkdv"]
    assert handle.name == NAME
