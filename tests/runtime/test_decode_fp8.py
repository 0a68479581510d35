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
from aotriton_rt.errors import ArgumentError, KernelNotFound, UnsupportedError
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
    # Sinks joined by the split combine (one head's at -inf), and by the epilogue with ALiBi slopes.
    "paged_16_sinks_in_the_combine_bf16": {"sinks": True, "dtype": "bf16", "paged": 16, "block_n": 64, "new": 1,
                                           "lens": (37, 1, 70), "scales": "batch_head", "causal": True, "splits": 2},
    "contiguous_sinks_and_alibi_one_split": {"sinks": True, "alibi": True, "splits": 1, "Sq": 2, "causal": True,
                                             "scales": "head"},
    "masked_head_dim_48_on_the_64_bucket": {"D": 48, "Hq": 4, "Hk": 1, "scales": "head", "paged": 16,
                                            "new": 1, "lens": (15, 33, 2)},
    "repeated_call_takes_the_cached_plan_with_new_scales": {"scales": "head", "repeat": True, "splits": 2},
    # sm90's configs #4/#5: V read in 4-byte words and widened before its dot (the inline
    # assembly run by tests/helpers/interpreter.py); a masked head dim reads V as is.
    "v_widened_paged_16_gqa_append_bf16": {"v_w": True, "dtype": "bf16", "paged": 16, "block_n": 64, "new": 2,
                                           "Hq": 8, "Hk": 2, "lens": (37, 1, 70), "scales": "batch_head",
                                           "causal": True, "splits": 2},
    "v_widened_contiguous_window_sinks_odd_lengths": {"v_w": True, "window": (20, 0), "Sq": 2, "lens": (45, 3, 77),
                                                      "sinks": True, "scales": "float", "block_n": 64},
    "v_widened_masked_head_dim_48_window": {"v_w": True, "D": 48, "window": (20, 0), "Sq": 2,
                                            "scales": "float"},
    "v_widened_128_key_blocks_paged_48_splits": {"v_w": True, "block_n": 128, "paged": 48, "lens": (130, 2, 257),
                                                 "scales": "head", "causal": True, "splits": 2},
    # bf16 queries (dots in fp16, each row scaled into fp16's range) whose rows in one tile span
    # 1e-30..1e6: past fp16's 65504 and below its smallest subnormal.
    "bf16_query_rows_past_fp16_range_gqa_splits": {"dtype": "bf16", "Hq": 4, "Hk": 1, "Sq": 2, "splits": 2,
                                                   "q_rows": (1e6, 1e-30, 3e4, 1.0), "causal": True,
                                                   "scales": "head", "paged": 16, "block_n": 64},
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
    q = torch.randn(B, Sq, Hq, D, generator=gen) * 0.5
    if c.get("q_rows"):  # per query head magnitudes
        q = q * torch.tensor(c["q_rows"], dtype=torch.float64).float()[None, None, :, None]
    q = q.to(dtype)
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
    if c.get("v_w"):
        made = lib.kernel

        def kernel(name: str, **params: Any) -> Any:
            handle = made(name, **params)
            if "V_WIDENED" in handle.constexprs:
                handle.constexprs["V_WIDENED"] = 1
            return handle

        lib.kernel = kernel
    softcap = c.get("softcap", 0.0)
    sinks = slopes = None
    if c.get("sinks"):
        sinks = torch.randn(Hq, generator=gen) * 2
        sinks[Hq - 1] = float("-inf")
    if c.get("alibi"):
        slopes = torch.rand(Hq, generator=gen) * 0.3 + 0.05
    kw = {"cache_seqlens": seqlens, "block_table": table, "causal": c["causal"], "window": c["window"],
          "num_splits": c["splits"], "softcap": softcap, "cache_leftpad": starts, "sinks": sinks,
          "alibi_slopes": slopes, "library": lib}
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
        ref, ref_lse = fp64_reference(q[b], deq_k, deq_v, Hq // Hk, scale, left, right, start, softcap, slopes,
                                      sinks)
        got = out[b].double()
        err = (got - ref).abs().max().item() if total[b] > start else got.abs().max().item()
        errors[f"out{b}"] = err
        if not err <= tol * amp.max().item():
            failed.append(f"out[{b}] (length {total[b]}) error {err}")
        both_inf = torch.isinf(lse[b].double()) & torch.isinf(ref_lse)
        # Beyond the absolute bound, fp32's own rounding of large logsumexps (the 1e6 query rows).
        lerr = torch.where(both_inf, 0.0, (lse[b].double() - ref_lse).abs() - 1e-6 * ref_lse.abs()).max().item()
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
    if "attn_decode" not in kernels or (new and "attn_decode_append" not in kernels) or "attn_sinks" in kernels:
        failed.append(f"launches {kernels}")
    return {"errors": errors, "failed": failed, "launches": LAUNCHES[:]}


def _main(names: list[str]) -> None:
    from aotriton_rt import interop
    from tests.helpers.cpu_arrays import cpu_describer
    from tests.runtime.test_decode_op import _install_cpu

    patch_interpreter()
    _install_cpu()
    _install_fp8_names()
    real = interop.describe  # the sinks' own look at their array
    cpu = cpu_describer(lambda obj, name: real(obj))
    interop.describe = lambda obj, **kw: cpu(obj, "")
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



# ---------------------------------------------------------------------------------------------
# Without the interpreter: refusals, the launch arguments, variant choice, the builder's variants.
# ---------------------------------------------------------------------------------------------

def _names() -> dict:
    import torch

    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
            torch.float8_e4m3fn: "fp8e4nv", torch.float8_e4m3fnuz: "fp8e4b8", torch.float8_e5m2: "fp8e5"}


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Any:
    """CPU tensors stand for device 0 arrays (those whose address is in :data:`ELSEWHERE` for
    device 1, fp8 ones too); the kernels record their launches (test_decode_op's)."""
    import torch

    from aotriton_rt import interop
    from aotriton_rt.ops.decode import validate
    from tests.runtime.test_decode_op import _recording_library

    lib = _recording_library(monkeypatch)
    names = _names()
    monkeypatch.setattr(validate, "_describe", lambda obj, name: interop.ArrayInfo(
        obj.data_ptr(), int(obj.data_ptr() in ELSEWHERE), names[obj.dtype], tuple(obj.shape), tuple(obj.stride()),
        "torch") if isinstance(obj, torch.Tensor) else interop.describe(obj))
    return lib


#: Addresses of the tensors the recording fixture describes as on device 1.
ELSEWHERE: set = set()


def _call(lib: Any, kv: Any = None, q_dtype: Any = None, **kw: Any) -> Any:
    import torch

    kv = kv if kv is not None else torch.float8_e4m3fn
    q = torch.randn(2, 1, 8, 64).to(q_dtype or torch.float16)
    k = torch.randn(2, 64, 2, 64).to(kv)
    args = {"cache_seqlens": torch.tensor([37, 60], dtype=torch.int32), "check": False, "library": lib, **kw}
    return op.decode_attention(q, k, kw.pop("v_cache", None) if "v_cache" in kw else k.clone(), **{
        n: a for n, a in args.items() if n != "v_cache"})


def _refusals() -> list:
    import torch

    heads = torch.ones(2)
    return [
        ("no_scales", {}, ArgumentError,
         r"an fp8 cache \(float8_e4m3fn\) needs k_scale and v_scale \(a real value is the stored one times its "
         r"scale\): pass k_scale, e\.g\. 1\.0 for unscaled values"),
        ("v_scale_missing", {"k_scale": 1.0}, ArgumentError, r"needs k_scale and v_scale .*pass v_scale"),
        ("scales_without_an_fp8_cache", {"kv": torch.float16, "k_scale": 1.0, "v_scale": 1.0}, ArgumentError,
         r"k_scale is for fp8 caches \(float8_e4m3fn, float8_e4m3fnuz\); the caches have q's dtype fp16: drop "
         r"k_scale"),
        ("fp32_queries", {"q_dtype": torch.float32, "k_scale": 1.0, "v_scale": 1.0}, UnsupportedError,
         r"an fp8 cache \(k_cache float8_e4m3fn\) serves fp16 and bf16 queries; q has dtype fp32: pass q in fp16 "
         r"or bf16"),
        ("e5m2_cache", {"kv": torch.float8_e5m2, "k_scale": 1.0, "v_scale": 1.0}, UnsupportedError,
         r"k_cache has dtype fp8e5; fp8 caches are e4m3: torch\.float8_e4m3fn \(sm90, gfx950\) or "
         r"torch\.float8_e4m3fnuz \(gfx942\)"),
        ("v_cache_of_another_type", {"v_cache": torch.zeros(2, 64, 2, 64).half(), "k_scale": 1.0, "v_scale": 1.0},
         ArgumentError, r"v_cache has dtype fp16 but k_cache has fp8e4nv; the caches share one dtype"),
        ("scale_shape", {"k_scale": torch.ones(8), "v_scale": heads}, ArgumentError,
         r"k_scale must be a float, or a float32 array of shape \(\) or \(1,\) \(one scale\), \(2,\) \(one per "
         r"KV head\) or \(2, 2\) \(per sequence and KV head\), got shape \(8,\)"),
        ("scale_dtype", {"k_scale": heads, "v_scale": heads.half()}, ArgumentError,
         r"v_scale must be float32, got fp16; convert it, e\.g\. v_scale\.float\(\)"),
        ("zero_scale", {"k_scale": 0.0, "v_scale": 1.0}, ArgumentError,
         r"k_scale must be a finite number > 0, got 0\.0"),
        ("nan_scale", {"k_scale": 1.0, "v_scale": float("nan")}, ArgumentError,
         r"v_scale must be a finite number > 0, got nan"),
        ("boolean_scale", {"k_scale": True, "v_scale": 1.0}, ArgumentError,
         r"k_scale must be a number or an fp32 array, got True"),
        ("k_new_in_fp8", {"k_scale": 1.0, "v_scale": 1.0, "k_new": torch.zeros(2, 1, 2, 64).to(torch.float8_e4m3fn),
                          "v_new": torch.zeros(2, 1, 2, 64).to(torch.float8_e4m3fn)}, ArgumentError,
         r"k_new has dtype fp8e4nv but q has fp16; k_new and v_new come in q's dtype \(the kernels quantise them into "
         r"the fp8 cache\)"),
    ]


#: The cases of :func:`_refusals` (made there: they hold torch tensors, imported only by the tests).
REFUSAL_IDS = ("no_scales", "v_scale_missing", "scales_without_an_fp8_cache", "fp32_queries", "e5m2_cache",
               "v_cache_of_another_type", "scale_shape", "scale_dtype", "zero_scale", "nan_scale", "boolean_scale",
               "k_new_in_fp8")


@pytest.mark.parametrize("index", range(len(REFUSAL_IDS)), ids=REFUSAL_IDS)
def test_an_fp8_cache_call_with_bad_scales_or_dtypes_is_refused_before_any_launch(recording: Any,
                                                                                   index: int) -> None:
    from tests.runtime.test_decode_op import LAUNCHES

    case, kw, exc, match = _refusals()[index]
    assert case == REFUSAL_IDS[index]
    LAUNCHES.clear()
    with pytest.raises(exc, match=match):
        _call(recording, **kw)
    assert not LAUNCHES


def test_scales_on_another_device_are_refused(recording: Any) -> None:
    import torch

    scale = torch.ones(2)
    ELSEWHERE.add(scale.data_ptr())
    try:
        with pytest.raises(ArgumentError, match=r"k_scale is on device 1 but q is on device 0; every array must be on "
                                                r"one GPU"):
            _call(recording, k_scale=scale, v_scale=1.0)
    finally:
        ELSEWHERE.discard(scale.data_ptr())


@pytest.mark.parametrize("kind", ["float", "zero_d", "head", "batch_head"])
def test_the_scales_reach_both_kernels_by_strides_and_factor_on_first_and_prepared_launches(
        recording: Any, kind: str) -> None:
    """Floats: the library's 1.0 array with strides 0 and the value as the factor; arrays: their
    addresses and (batch, head) strides, factor 1.0. A kept plan takes each call's scale arrays."""
    import torch

    from tests.runtime.test_decode_op import LAUNCHES

    made = {"float": lambda: 0.25, "zero_d": lambda: torch.tensor(0.25), "head": lambda: torch.ones(2),
            "batch_head": lambda: torch.ones(3, 2)[:2]}[kind]
    strides = {"float": (0, 0), "zero_d": (0, 0), "head": (0, 1), "batch_head": (2, 1)}[kind]
    kn = torch.randn(2, 1, 2, 64).half()
    LAUNCHES.clear()
    calls = []
    for _ in range(3):
        ks, vs = made(), made()
        calls.append((ks, vs))
        _call(recording, k_scale=ks, v_scale=vs, k_new=kn, v_new=kn.clone(), num_splits=2)
    assert [(w, n) for w, n, _ in LAUNCHES] == [(w, n) for w in ("call", "prepared", "prepared")
                                                 for n in ("attn_decode_append", "attn_decode", "attn_decode_combine")]
    ones = set()
    for i, (_, name, args) in enumerate(LAUNCHES):
        if name == "attn_decode_combine":
            assert "KScale" not in args
            continue
        ks, vs = calls[i // 3]
        assert (args["stride_ksz"], args["stride_ksh"]) == (args["stride_vsz"], args["stride_vsh"]) == strides
        if kind == "float":
            assert args["k_scale"] == args["v_scale"] == 0.25 and args["KScale"] == args["VScale"] != 0
            ones.add(args["KScale"])
        else:
            assert args["k_scale"] == args["v_scale"] == 1.0
            assert (args["KScale"], args["VScale"]) == (ks.data_ptr(), vs.data_ptr())
    assert len(ones) <= 1  # one 1.0 array, the library's


def test_a_cache_of_q_type_passes_neutral_scales(recording: Any) -> None:
    import torch

    from tests.runtime.test_decode_op import LAUNCHES

    LAUNCHES.clear()
    _call(recording, kv=torch.float16)
    (_, _, args), = [x for x in LAUNCHES if x[1] == "attn_decode"]
    assert (args["KScale"], args["VScale"], args["k_scale"], args["v_scale"]) == (0, 0, 1.0, 1.0)


def test_images_without_fp8_variants_refuse_an_fp8_cache_naming_the_variant_and_the_targets(
        monkeypatch: pytest.MonkeyPatch, recording: Any) -> None:
    lib = recording
    monkeypatch.setattr(lib, "held", lambda name, spec: spec.get("KV_DTYPE", spec["dtype"]) == spec["dtype"]
                        if "dtype" in spec else True)
    real = lib.kernel

    def kernel(name: str, **params: Any) -> Any:
        if params.get("KV_DTYPE", "").startswith("fp8"):
            raise KernelNotFound(f"no variant of {name} matches KV_DTYPE={params['KV_DTYPE']}")
        return real(name, **params)

    monkeypatch.setattr(lib, "kernel", kernel)
    with pytest.raises(KernelNotFound, match=r"decode attention needs attn_decode with dtype=fp16, HEAD_DIM=64, "
                                             r"PAGED=0, PADDED_D=0, KV_DTYPE=fp8e4nv \(.*an fp8 cache "
                                             r"\(float8_e4m3fn\) runs on variants built for sm90 and gfx950"):
        _call(lib, k_scale=1.0, v_scale=1.0)


def test_the_variant_choice_keys_the_cache_type_only_where_the_images_have_it() -> None:
    from aotriton_rt.ops.decode.variants import choose, shared

    def images(axis: bool, fp8: bool = True) -> Any:
        def has(name: str, params: dict) -> bool:
            kv = params.get("KV_DTYPE")
            if kv is None:
                return True
            return axis and (kv == params.get("dtype", kv) or fp8 and kv == "fp8e4nv")
        return has

    old, _ = choose("bf16", 128, True, False, images(axis=False))
    assert old == {"dtype": "bf16", "HEAD_DIM": 128, "PADDED_D": 0}
    new, _ = choose("bf16", 128, True, False, images(axis=True))
    assert new == {**old, "KV_DTYPE": "bf16"} and shared(new) == old
    fp8, why = choose("bf16", 128, True, True, images(axis=True), "fp8e4nv")
    assert fp8 == {**old, "KV_DTYPE": "fp8e4nv"} and "an fp8 cache (fp8e4nv), dequantised in registers" in why


def test_the_runtime_fp8_table_mirrors_the_builder() -> None:
    from aotriton_rt.ops.decode import validate
    from builder.kernels import decode as kernels

    assert {t: archs for t, (_, archs) in validate.FP8_CACHES.items()} == kernels.FP8_KV
    assert validate.DTYPES == kernels.DTYPES


def test_fp8_variants_are_built_for_their_targets_and_sets_only() -> None:
    """fp8e4nv on sm90 and gfx950, fp8e4b8 on gfx942, with fp16/bf16 queries: gputest at head dims
    64 and 128 as is and masked, the default set at 128 as is."""
    import collections

    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    decls = load_kernels()
    targets = parse_targets("default")
    for name in ("attn_decode", "attn_decode_append"):
        for build_set, dims, padded in (("default", {128}, {0}), ("gputest", {64, 128}, {0, 1})):
            found = collections.defaultdict(set)
            for j in expand(decls[name], targets, build_set, "3.6.0"):
                if j.spec["KV_DTYPE"] != j.spec["dtype"]:
                    found[(j.target.arch, j.spec["KV_DTYPE"])].add((j.spec["dtype"], j.spec["HEAD_DIM"],
                                                                     j.spec["PADDED_D"]))
            want = {(d, h, p) for d in ("fp16", "bf16") for h in dims for p in padded}
            assert dict(found) == {("sm90", "fp8e4nv"): want, ("gfx950", "fp8e4nv"): want,
                                   ("gfx942", "fp8e4b8"): want}, (name, build_set)
    for name in ("attn_decode_combine", "attn_decode_pack", "attn_decode_poison"):
        assert "KV_DTYPE" not in decls[name].axes


@pytest.mark.parametrize("paged", [0, 1], ids=["contiguous", "paged"])
def test_the_sm90_fp8_variant_copies_16_byte_pieces_and_widens_with_the_e4m3_convert(paged: int) -> None:
    """K arrives in 16-byte cp.async pieces (half the bytes of a bf16 row, so the copies halve);
    the dots stay fp16 mma fed by ``cvt.rn.f16x2.e4m3x2`` (two values per instruction); the
    append quantises with the saturating ``cvt.rn.satfinite.e4m3x2.f32``."""
    import lzma
    import re

    from builder.compile import compile_job_with_ptx
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    spec = {"dtype": "fp16", "HEAD_DIM": 128, "PAGED": paged, "PADDED_D": 0, "KV_DTYPE": "fp8e4nv"}
    texts = {}
    for name in ("attn_decode", "attn_decode_append"):
        (job,) = [j for j in expand(load_kernels()[name], parse_targets("sm90"), "gputest", "3.6.0")
                  if j.spec == spec and j.config_index == 0]
        texts[name] = lzma.decompress(compile_job_with_ptx(job)[3]).decode()
    ptx = texts["attn_decode"]
    sizes = re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*, (0x[0-9a-f]+)", ptx)
    assert sizes.count("0x10") >= 4, sizes
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert "ld.global.b8" not in ptx and "ld.global.u8" not in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in texts["attn_decode_append"]


@pytest.mark.parametrize("paged", [0, 1], ids=["contiguous", "paged"])
def test_an_fp8_cache_under_bf16_queries_runs_both_dots_in_fp16(paged: int) -> None:
    """bf16 queries over an fp8 cache: the query rows go to fp16 once per program, each scaled into
    its range (``_fp16_rows``; the ``q_rows`` interpreter case checks the numbers), so the cache
    widens with the e4m3-to-fp16 convert alone and both dots are fp16 mma: no fp16-to-bf16
    conversion per value (ptxas ``F2F``) is left. A bf16 cache keeps its bf16 dots."""
    import lzma
    import re

    from builder.compile import compile_job_with_ptx
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets
    from tests.helpers.sass import sass_ops

    decl = load_kernels()["attn_decode"]
    found = {}
    for kv in ("fp8e4nv", "bf16"):
        spec = {"dtype": "bf16", "HEAD_DIM": 128, "PAGED": paged, "PADDED_D": 0, "KV_DTYPE": kv}
        (job,) = [j for j in expand(decl, parse_targets("sm90"), "default", "3.6.0")
                  if j.spec == spec and j.config_index == 0]
        _, cubin, _, ptx = compile_job_with_ptx(job)
        found[kv] = (set(re.findall(r"mma\.sync\.aligned\.[\w.]+", lzma.decompress(ptx).decode())), sass_ops(cubin))
    mmas, ops = found["fp8e4nv"]
    assert mmas == {"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"}
    assert ops.get("F2FP.F16.E4M3.UNPACK_B", 0) >= 64 and not any(op.startswith("F2F.") for op in ops)
    assert found["bf16"][0] == {"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"}


@pytest.mark.parametrize("paged", [0, 1])
def test_sm90_configs_4_to_8_widen_an_fp8_v_from_words_before_its_dot(paged: int) -> None:
    """Configs #4 and #5 (gputest and full) are #0 and #2 with V read in 4-byte words and widened
    in registers: V arrives in 16-byte copies like K and reaches the P.V dot through
    ``ldmatrix.trans`` of 16-bit values, where #0 gathers it byte by byte from shared memory
    (``ld.shared.b8``, 64 per thread per 64-key block); #6 is #5 with a deeper ring, #7 and #8
    take 128-key blocks (4 and 8 warps). Caches of q's type have none of them."""
    import lzma
    import re

    from builder.compile import compile_job_with_ptx
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    decl = load_kernels()["attn_decode"]
    spec = {"dtype": "fp16", "HEAD_DIM": 128, "PAGED": paged, "PADDED_D": 0, "KV_DTYPE": "fp8e4nv"}
    jobs = {j.config_index: j for j in expand(decl, parse_targets("sm90"), "gputest", "3.6.0") if j.spec == spec}
    assert sorted(jobs) == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert [jobs[i].constexprs["V_WIDENED"] for i in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert jobs[6].config.num_stages > jobs[5].config.num_stages  # #6: the deeper ring
    assert [(jobs[i].constexprs["BLOCK_N"], jobs[i].config.num_warps) for i in (7, 8)] == [(128, 4), (128, 8)]
    for twin, base in ((4, 0), (5, 2)):  # the same tile and pipeline as its twin
        assert jobs[twin].config.num_stages == jobs[base].config.num_stages
        assert {k: v for k, v in jobs[twin].constexprs.items() if k != "V_WIDENED"} == \
            {k: v for k, v in jobs[base].constexprs.items() if k != "V_WIDENED"}
    default = {j.config_index for j in expand(decl, parse_targets("sm90"), "default", "3.6.0") if j.spec == spec}
    assert default == {0, 3}
    plain = {j.config_index for j in expand(decl, parse_targets("sm90"), "gputest", "3.6.0")
             if j.spec == {**spec, "KV_DTYPE": "fp16"}}
    assert plain == {0, 1, 2, 3}

    def ptx_of(i: int) -> str:
        return lzma.decompress(compile_job_with_ptx(jobs[i])[3]).decode()

    assert len(re.findall(r"ld\.shared\.b8", ptx_of(0))) >= 64
    for i in (4, 5, 6, 7, 8):
        ptx = ptx_of(i)
        assert "ld.shared.b8" not in ptx
        assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") >= 8
        assert "cp.async.ca.shared.global" not in ptx or paged  # contiguous: only 16-byte copies
        assert ptx.count("cvt.rn.f16x2.e4m3x2") >= 64


@pytest.mark.parametrize("arch,kv", [("gfx942", "fp8e4b8"), ("gfx950", "fp8e4nv")])
def test_the_hip_fp8_variants_compile(arch: str, kv: str) -> None:
    from builder.abi import prove
    from builder.compile import compile_job
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    for name in ("attn_decode", "attn_decode_append"):
        jobs = [j for j in expand(load_kernels()[name], parse_targets(arch), "default", "3.6.0")
                if j.spec["KV_DTYPE"] == kv and j.spec["dtype"] == "bf16" and j.spec["PAGED"] == 1]
        variant, raw, _ = compile_job(jobs[0])
        assert raw[:4] == b"\x7fELF"
        prove(variant, raw)


def test_the_torch_ops_carry_tensor_and_float_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """``aotriton_rt::decode_attention(_append)``: ``Tensor? k_scale, Tensor? v_scale, float
    k_scale_value, float v_scale_value`` after the sinks; the wrapper splits each scale into them
    and checks floats as the operator does; opcheck traces the fake implementation."""
    import torch

    from aotriton_rt.ops import torch_decode

    for name in ("decode_attention", "decode_attention_append"):
        schema = str(getattr(torch.ops.aotriton_rt, name).default._schema)
        assert ("Tensor? sinks, Tensor? alibi_slopes, Tensor? k_scale, Tensor? v_scale, float k_scale_value, "
                "float v_scale_value" in schema), schema
    seen: list = []

    def operator(q: Any, k: Any, v: Any, **kw: Any) -> tuple:
        seen.append((kw["k_scale"], kw["v_scale"]))
        b, s, h, _ = q.shape
        return q * 2, torch.zeros(b, h, s)

    monkeypatch.setattr(torch_decode._core, "decode_attention", operator)
    q = torch.randn(2, 1, 8, 64).half()
    k = torch.randn(2, 64, 2, 64).to(torch.float8_e4m3fn)
    kn = torch.randn(2, 1, 2, 64).half()
    lens = torch.tensor([3, 40], dtype=torch.int32)
    heads = torch.ones(2)
    torch_decode.decode_attention(q, k, k, cache_seqlens=lens, k_scale=0.5, v_scale=heads)
    torch_decode.decode_attention(q, k, k, cache_seqlens=lens, k_new=kn, v_new=kn, k_scale=heads, v_scale=2)
    torch_decode.decode_attention(q, q, q, cache_seqlens=lens)
    assert seen[0][0] == 0.5 and seen[0][1] is heads and seen[1][0] is heads and seen[1][1] == 2.0
    assert seen[2] == (None, None)
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ArgumentError, match=r"k_scale must be a finite number > 0"):
            torch_decode.decode_attention(q, k, k, cache_seqlens=lens, k_scale=bad, v_scale=1.0)
    half = torch.randn(2, 64, 2, 64).half()  # opcheck's schema test does arithmetic torch lacks for fp8 on CPU
    torch.library.opcheck(torch_decode.decode_attention_op,
                          (q, half, half, lens, -1, None, None, None, None, heads, None, 0.0, 0.5, True, -1, 0, 0.125,
                           0.0, 0, -1, "bshd", "bshd", 0),
                          test_utils=("test_schema", "test_faketensor"))


def _catalog(folder: Any, variants: list) -> Any:
    import json

    import aotriton_rt

    folder.mkdir(exist_ok=True)
    (folder / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                     "triton_version": "3.6.0", "variants": variants}))
    return aotriton_rt.Library(folder)


def test_explain_decode_shows_the_fp8_variant_its_config_and_splits(tmp_path: Any) -> None:
    """``explain decode`` over a synthetic sm90 catalog (bf16 and fp8 caches, combine): the fp8
    call runs the KV_DTYPE=fp8e4nv decode and append variants, a bf16 call the bf16 ones, and the
    split count is the runtime's; an fp8 call on images without its variants is refused."""
    from aotriton_rt.ops.decode.explain import explain
    from tests.runtime.test_attention_op import _synthetic_variant

    base = {"dtype": "bf16", "HEAD_DIM": 128}
    variants = [_synthetic_variant(name, {**base, "PAGED": 1, "PADDED_D": 0, "KV_DTYPE": kv})
                for name in ("attn_decode", "attn_decode_append") for kv in ("bf16", "fp8e4nv")]
    variants.append(_synthetic_variant("attn_decode_combine", {**base, "PADDED_D": 0}))
    lib = _catalog(tmp_path / "new", variants)
    text = str(explain(dtype="bf16", head_dim=128, seqlen_k=8192, batch=2, kv_dtype="fp8e4nv", paged=True, append=1,
                       arch="sm90", library=lib))
    assert text.splitlines()[0] == ("decode on sm90: bf16 q, fp8e4nv cache, dequantised with k_scale/v_scale, head "
                                    "dim 128, paged, batch 2, 32/8 heads, 1 query rows, 8192 keys, 1 appended")
    assert "attn_decode_append[dtype=bf16, HEAD_DIM=128, PAGED=1, PADDED_D=0, KV_DTYPE=fp8e4nv] config #0" in text
    assert "stores value / scale in the fp8 cache" in text
    assert "attn_decode[dtype=bf16, HEAD_DIM=128, PAGED=1, PADDED_D=0, KV_DTYPE=fp8e4nv] config #0" in text
    assert "an fp8 cache (fp8e4nv), dequantised in registers" in text and "13 split(s)" in text
    assert "attn_decode_combine[dtype=bf16, HEAD_DIM=128, PADDED_D=0] config #0" in text
    plain = str(explain(dtype="bf16", head_dim=128, seqlen_k=8192, batch=2, paged=True, arch="sm90", library=lib))
    assert "KV_DTYPE=bf16" in plain and "fp8" not in plain
    only_bf16 = _catalog(tmp_path / "old", [v for v in variants if v["spec"].get("KV_DTYPE") != "fp8e4nv"])
    with pytest.raises(KernelNotFound, match=r"needs attn_decode with dtype=bf16, HEAD_DIM=128, PAGED=1, PADDED_D=0, "
                                             r"KV_DTYPE=fp8e4nv on sm90 .*built for sm90 and gfx950"):
        explain(dtype="bf16", head_dim=128, seqlen_k=8192, kv_dtype="fp8e4nv", paged=True, arch="sm90",
                library=only_bf16)
    with pytest.raises(UnsupportedError, match=r"an fp8 cache serves fp16 and bf16 queries, not fp32"):
        explain(dtype="fp32", head_dim=128, seqlen_k=10, kv_dtype="fp8e4nv", arch="sm90", library=lib)
    import subprocess

    from tests.helpers.interpreter import ROOT

    cli = subprocess.run([sys.executable, "-m", "aotriton_rt", "explain", "decode", "--images", str(tmp_path / "new"),
                          "--arch", "sm90", "--dtype", "bf16", "--kv-dtype", "fp8e4nv", "--paged", "--seqlen", "1",
                          "--seqlen-k", "8192", "--batch", "2", "--append", "1"],
                         capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == text


def test_images_built_before_the_cache_type_axis_serve_caches_of_q_type(tmp_path: Any) -> None:
    """Variants without ``KV_DTYPE`` (images built before fp8 caches): a bf16 call is served
    without asking for the axis; an fp8 call is refused naming the variant."""
    import json

    from aotriton_rt.ops.decode import variants as chooser
    from tests.runtime.test_attention_op import _synthetic_variant

    base = {"dtype": "bf16", "HEAD_DIM": 128}
    new = _synthetic_variant("attn_decode", {**base, "PAGED": 0, "PADDED_D": 0, "KV_DTYPE": "bf16"})
    old = json.loads(json.dumps(new))
    del old["spec"]["KV_DTYPE"]
    lib = _catalog(tmp_path, [old, _synthetic_variant("attn_decode_combine", {**base, "PADDED_D": 0})])
    ks = op._kernels_of(lib)
    spec, _ = ks.choose(_plan("bf16"), True)
    assert spec == {**base, "PADDED_D": 0} and not chooser.held_cache_axis(ks.has)
    spec, why = ks.choose(_plan("fp8e4nv"), True)
    assert spec["KV_DTYPE"] == "fp8e4nv" and "runs on variants built for sm90 and gfx950" in why


def _plan(kv: str) -> Any:
    from aotriton_rt.ops.decode.validate import DecodePlan

    return DecodePlan("bf16", 128, 2, 8, 2, 1, 0, 64, False, 16, 1, 64, (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0),
                      (0, 0, 0), 0, -1, -1, 0.1, 0, False, kv_dtype=kv)


if __name__ == "__main__":
    _main(sys.argv[1:])
