"""fp8 (e4m3) KV caches in decode attention, on the CPU.

The real decode kernels run under Triton's interpreter on fp8e4nv caches (the interpreter has no
fp8e4b8) against an fp64 reference of the *dequantised* cache; the appended rows are checked by
their bytes against torch's own quantisation. Refusals, variant choice and the compiled sm90 and
gfx942/gfx950 binaries are checked without it. tests/runtime/test_decode_fp8_gpu.py runs the
same on a GPU, bit-exact for the appended rows.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest

import aotriton_rt.ops.decode as op
from tests.helpers.interpreter import patch_interpreter, report_cases, run_sharded

#: Interpreter cases: run_case's defaults overridden. ``scales``: "float" (one per cache),
#: "tensor" (a 0-d array), "head" ``(Hkv,)``, "batch_head" ``(B, Hkv)``.
CASES: dict[str, dict] = {
    "contiguous_per_head_scales_gqa_splits": {"Hq": 8, "Hk": 2, "splits": 3, "scales": "head"},
    "contiguous_float_scales_one_split_bf16": {"dtype": "bf16", "splits": 1, "scales": "float"},
    "paged_16_in_blocks_of_64_per_sequence_scales": {"paged": 16, "block_n": 64, "lens": (37, 1, 16, 0, 80),
                                                     "scales": "batch_head", "causal": True, "Sq": 2, "splits": 2},
    "paged_48_append_quantises_across_pages": {"paged": 48, "block_n": 64, "new": 3, "lens": (46, 0, 95),
                                               "Sq": 3, "causal": True, "scales": "head", "splits": 2},
    "contiguous_append_saturates": {"new": 2, "lens": (20, 0, 61), "scales": "head", "big": True},
    "window_left_padding_softcap_bf16": {"dtype": "bf16", "window": (20, 0), "Sq": 2, "leftpad": (5, 0, 30),
                                         "softcap": 2.0, "scales": "tensor", "splits": 2},
    "masked_head_dim_48_on_the_64_bucket": {"D": 48, "Hq": 4, "Hk": 1, "scales": "head", "paged": 16,
                                            "new": 1, "lens": (15, 33, 2)},
    "repeated_call_takes_the_cached_plan_with_new_scales": {"scales": "head", "repeat": True, "splits": 2},
}
FP8_MAX = 448.0
QUANTISATION = "quantisation_rounds_saturates_and_keeps_nan"


def run_case(name: str, case: dict) -> dict:
    import torch

    from tests.runtime.test_decode_op import BLOCK_N, LAUNCHES, _Library, fp64_reference

    c = {"B": 3, "Hq": 4, "Hk": 2, "Sq": 1, "D": 64, "dtype": "fp16", "cap": 96, "lens": (37, 0, 80), "paged": 0,
         "new": 0, "causal": False, "window": None, "splits": None, "scales": "head", **case}
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[c["dtype"]]
    fp8 = torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    lens = list(c["lens"])
    B, Hq, Hk, Sq, D, new = len(lens), c["Hq"], c["Hk"], c["Sq"], c["D"], c["new"]
    total = [n + new for n in lens]
    cap = max(c["cap"], max(total))
    # Per (sequence, KV head) scales of every kind; amplitudes vary by head so that a kernel using
    # the wrong head's scale is off by far more than the tolerance.
    amp = torch.linspace(0.5, 3.0, Hk)
    full = (amp / 64).repeat(B, 1) * torch.linspace(1.0, 1.5, B)[:, None]  # (B, Hk)
    if c["scales"] == "head":
        full = full[:1].expand(B, Hk)
    elif c["scales"] in ("float", "tensor"):
        full = torch.full((B, Hk), 3.0 / 64)
    ks, vs = full.clone(), full.clone() * 0.75

    def arg(s: Any) -> Any:
        if c["scales"] == "float":
            return float(s[0, 0])
        if c["scales"] == "tensor":
            return s[0, 0].clone().reshape(())
        return s[0].clone() if c["scales"] == "head" else s.clone()

    def quantise(x: Any, s: Any) -> Any:
        """torch's e4m3fn of x / s (fp32 division), saturated; s broadcast over (rows, Hk, D)."""
        y = x.float() / s[None, :, None]
        return torch.where(torch.isnan(y), y, y.clamp(-FP8_MAX, FP8_MAX)).to(fp8)

    keys = [(torch.randn(n, Hk, D, generator=gen) * amp[None, :, None]).to(dtype) for n in total]
    vals = [(torch.randn(n, Hk, D, generator=gen) * amp[None, :, None]).to(dtype) for n in total]
    if c.get("big") and new:  # appended rows past the format's range: saturated
        for b in range(B):
            keys[b][lens[b]:, 0, :2] = torch.tensor([1e4, -1e4]).to(dtype)
    stored_k = [quantise(keys[b], ks[b]) for b in range(B)]
    stored_v = [quantise(vals[b], vs[b]) for b in range(B)]
    q = (torch.randn(B, Sq, Hq, D, generator=gen) * 0.5).to(dtype)
    nan = torch.tensor(float("nan")).to(fp8)
    if c["paged"]:
        ps = c["paged"]
        max_blocks = -(-cap // ps)
        num_pages = sum(-(-n // ps) for n in total) + 5
        perm = torch.randperm(num_pages, generator=gen).tolist()
        table = torch.full((B, max_blocks), -7, dtype=torch.int32)
        k_cache = nan.repeat(num_pages, ps, Hk, D)
        v_cache = nan.repeat(num_pages, ps, Hk, D)
        it = iter(perm)
        for b, n in enumerate(total):
            for j in range(-(-n // ps)):
                table[b, j] = next(it)
            for r in range(lens[b]):
                k_cache[table[b, r // ps], r % ps] = stored_k[b][r]
                v_cache[table[b, r // ps], r % ps] = stored_v[b][r]
    else:
        table = None
        k_cache = nan.repeat(B, cap, Hk, D)
        v_cache = nan.repeat(B, cap, Hk, D)
        for b in range(B):
            k_cache[b, :lens[b]] = stored_k[b][:lens[b]]
            v_cache[b, :lens[b]] = stored_v[b][:lens[b]]
    k_new = v_new = None
    if new:
        k_new = torch.stack([keys[b][lens[b]:] for b in range(B)])
        v_new = torch.stack([vals[b][lens[b]:] for b in range(B)])
    seqlens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.tensor(c["leftpad"], dtype=torch.int32) if c.get("leftpad") else None
    LAUNCHES.clear()
    BLOCK_N[0] = c.get("block_n", 16)
    lib = _Library()
    softcap = c.get("softcap", 0.0)
    kw = {"cache_seqlens": seqlens, "block_table": table, "causal": c["causal"], "window": c["window"],
          "num_splits": c["splits"], "softcap": softcap, "cache_leftpad": starts, "library": lib}
    out, lse = op.decode_attention(q, k_cache, v_cache, k_new=k_new, v_new=v_new, k_scale=arg(ks), v_scale=arg(vs),
                                   check=True, **kw)
    errors: dict[str, float] = {}
    failed: list[str] = []
    if c.get("repeat"):  # the kept plan reads the scales of each call
        op._kernels_of(lib).launches.clear()
        for factor in (1.0, 2.0):
            again, _ = op.decode_attention(q, k_cache, v_cache, k_scale=arg(ks), v_scale=arg(vs) * factor,
                                           check=False, **kw)
            err = (again.double() - out.double() * factor).abs().max().item()
            errors[f"repeat{factor}"] = err
            if not err <= 2e-2 * factor:
                failed.append(f"a repeated call with v_scale * {factor} is off by {err}")
        if len(op._kernels_of(lib).launches) != 1:
            failed.append(f"{len(op._kernels_of(lib).launches)} launch plans for calls differing in scale values")
    tol = {"fp16": 2e-2, "bf16": 4e-2}[c["dtype"]]
    scale = 1 / math.sqrt(D)
    left, right = c["window"] if c["window"] else (-1, -1)
    if c["causal"]:
        right = 0
    for b in range(B):
        deq_k = stored_k[b].double() * ks[b][None, :, None].double()
        deq_v = stored_v[b].double() * vs[b][None, :, None].double()
        start = c["leftpad"][b] if c.get("leftpad") else 0
        ref, ref_lse = fp64_reference(q[b], deq_k, deq_v, Hq // Hk, scale, left, right, start, softcap)
        got = out[b].double()
        err = (got - ref).abs().max().item() if total[b] > start else got.abs().max().item()
        errors[f"out{b}"] = err
        if not err <= tol * amp.max().item():
            failed.append(f"out[{b}] (length {total[b]}) error {err}")
        both_inf = torch.isinf(lse[b].double()) & torch.isinf(ref_lse)
        lerr = torch.where(both_inf, 0.0, (lse[b].double() - ref_lse).abs()).max().item()
        errors[f"lse{b}"] = lerr
        if not lerr <= tol * 10:
            failed.append(f"lse[{b}] error {lerr}")
    if new:
        # The appended rows' bytes against torch's quantisation (the interpreter's rounding to fp8
        # is torch's here: tests/helpers/interpreter.py; on the GPU it is the hardware's).
        worst = 0
        for b in range(B):
            for r in range(lens[b], total[b]):
                if table is not None:
                    got_k, got_v = k_cache[table[b, r // c["paged"]], r % c["paged"]], \
                        v_cache[table[b, r // c["paged"]], r % c["paged"]]
                else:
                    got_k, got_v = k_cache[b, r], v_cache[b, r]
                for got, want in ((got_k, stored_k[b][r]), (got_v, stored_v[b][r])):
                    diff = (got.view(torch.uint8).int() - want.view(torch.uint8).int()).abs()
                    worst = max(worst, int(diff.max()))
        errors["append_codes"] = worst
        if worst:
            failed.append(f"appended rows differ from torch's quantisation by up to {worst} codes")
        if c.get("big"):
            row = k_cache[0, lens[0], 0, :2].float().tolist()
            if row != [FP8_MAX, -FP8_MAX]:
                failed.append(f"out-of-range values were stored as {row}, not saturated to +-448")
    kernels = [n for n, _ in LAUNCHES]
    if "attn_decode" not in kernels or (new and "attn_decode_append" not in kernels):
        failed.append(f"launches {kernels}")
    return {"errors": errors, "failed": failed, "launches": LAUNCHES[:]}


def _main(names: list[str]) -> None:
    from tests.runtime.test_decode_op import _install_cpu

    patch_interpreter()
    _install_cpu()
    _install_fp8_names()
    report_cases(names, lambda name: run_quantisation(name) if name == QUANTISATION else run_case(name, CASES[name]))


def _install_fp8_names() -> None:
    """The CPU describer of test_decode_op, taking fp8 tensors too."""
    import torch

    from aotriton_rt import interop
    from aotriton_rt.ops.attention import problem
    from aotriton_rt.ops.decode import validate

    names = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e4m3fnuz: "fp8e4b8", torch.float8_e5m2: "fp8e5"}
    for module in (validate, problem):
        inner = module._describe

        def describe(obj: Any, name: str, inner: Any = inner) -> Any:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.dtype in names:
                return interop.ArrayInfo(obj.data_ptr(), 0, names[obj.dtype], tuple(obj.shape), tuple(obj.stride()),
                                         "torch")
            return inner(obj, name)

        module._describe = describe


#: Values whose quantisation is easy to get wrong: a mantissa rounding up into the next exponent
#: (31.5 -> 32), ties to even in the normal and subnormal ranges, the saturation edge (464 is the
#: tie between 448 and the first value past it), past it, infinities, NaN, signed zeros, the
#: smallest subnormal and half of it.
SPECIAL = (31.5, 30.0, 17.0, 19.0, 3 * 2.0**-10, 5 * 2.0**-10, 448.0, 460.0, 464.0, 465.0, 1e4, -1e4,
           float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 2.0**-9, 2.0**-10, -3.3, 0.1, 1.0)


def run_quantisation(name: str) -> dict:
    """The append kernel's ``_quantised`` on SPECIAL (fp16, divided by 0.5, 1 and 0.37), compiled
    by the interpreter, against torch: ``(x.float() / s)`` saturated to +-448, NaN kept, rounded."""
    import torch
    import triton
    import triton.language as tl

    from builder.kernels import decode

    globals()["_quantised"] = decode._quantised  # a jit function finds its callees among the module's names

    @triton.jit
    def quantise(X, Y, scale, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, _quantised(tl.load(X + offs), scale, Y.dtype.element_ty))  # noqa: F821

    x = torch.tensor(SPECIAL + (0.0,) * (32 - len(SPECIAL)), dtype=torch.float32).half()
    failed = []
    for scale in (0.5, 1.0, 0.37):
        y = torch.zeros(32, dtype=torch.float8_e4m3fn)
        quantise[(1,)](x, y, scale, N=32)
        want = x.float() / torch.tensor(scale, dtype=torch.float32)
        want = torch.where(torch.isnan(want), want, want.clamp(-FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn)
        got_b, want_b = y.view(torch.uint8).tolist(), want.view(torch.uint8).tolist()
        for v, g, w in zip(SPECIAL, got_b, want_b):
            if g != w:
                failed.append(f"{v} / {scale}: stored {g:#04x}, torch {w:#04x}")
    return {"errors": {"out": 0.0}, "failed": failed}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return run_sharded(__file__, [QUANTISATION, *CASES])


def test_the_append_quantises_as_torch_does_saturating_and_keeping_nan(interpreted: dict) -> None:
    assert not interpreted[QUANTISATION]["failed"], interpreted[QUANTISATION]["failed"]


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_cache_decode_matches_fp64_of_the_dequantised_cache_under_the_interpreter(interpreted: dict,
                                                                                       name: str) -> None:
    result = interpreted[name]
    assert not result["failed"], f"{name}: {result['failed']}"
    assert any(k.startswith("out") for k in result["errors"])


if __name__ == "__main__":
    _main(sys.argv[1:])
