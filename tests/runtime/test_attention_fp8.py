"""FP8 attention forward on the CPU: its refusals, its variants' selection and sets, and the real
kernel under Triton's interpreter against an fp32 reference of the dequantised inputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from aotriton_rt.errors import ArgumentError, KernelNotFound, UnsupportedError

ROOT = Path(__file__).resolve().parents[2]
torch = pytest.importorskip("torch")

E4M3 = {"fp8e4nv": torch.float8_e4m3fn, "fp8e4b8": torch.float8_e4m3fnuz}


def _install(arch: str = "sm90") -> None:
    """The operator on CPU tensors and an interpreted library, on ``arch`` (this process only)."""
    from aotriton_rt.ops.attention import dispatch
    from tests.runtime.test_attention_op import _install_cpu_operator

    _install_cpu_operator()
    dispatch.LibraryKernels.device_arch = lambda self, device: arch


@pytest.fixture()
def cpu_operator(monkeypatch: pytest.MonkeyPatch):
    from aotriton_rt.ops.attention import dispatch, problem
    from tests.helpers.cpu_arrays import cpu_describer
    from tests.runtime.test_attention_op import InterpretedLibrary

    monkeypatch.setattr(problem, "_describe", cpu_describer(problem._describe))
    monkeypatch.setattr(dispatch, "_available", lambda lib, name, params: lib.has(name, params))
    monkeypatch.setattr(dispatch, "_takes", lambda lib, name, params, args: all(
        a in lib.decls[name].signature for a in args))
    monkeypatch.setattr(dispatch.LibraryKernels, "device_arch", lambda self, device: "sm90")
    return InterpretedLibrary


def _qkv(dtype=torch.float8_e4m3fn, B=2, H=4, Hk=2, S=9, D=64):
    q = torch.randn(B, H, S, D).to(dtype)
    k = torch.randn(B, Hk, S, D).to(dtype)
    return q, k, torch.randn(B, Hk, S, D).to(dtype)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"q_descale": torch.ones(2, 4)}, ArgumentError, r"q_descale must have shape \(2, 2\) \(batch, key/value heads\)"),
    ({"k_descale": torch.ones(2, 2, dtype=torch.float16)}, ArgumentError, "k_descale must be float32, got fp16"),
    ({"v_descale": float("nan")}, ArgumentError, "v_descale must be finite"),
    ({"v_descale": "2"}, ArgumentError, "v_descale must be a float or an fp32 GPU array"),
    ({"out_dtype": "fp32"}, ArgumentError, "out_dtype must be bf16 or fp16"),
    ({"bias": torch.zeros(1)}, UnsupportedError, "FP8 attention .* does not take bias="),
    ({"dropout_p": 0.1, "seed": 1}, UnsupportedError, "FP8 attention .* does not take dropout_p="),
    ({"softcap": 30.0}, UnsupportedError, "does not take softcap="),
    ({"alibi_slopes": torch.ones(4)}, UnsupportedError, "does not take alibi_slopes="),
])
def test_fp8_attention_refuses_malformed_descales_and_features(cpu_operator, kwargs, error, match) -> None:
    import aotriton_rt

    with pytest.raises(error, match=match):
        aotriton_rt.attention(*_qkv(), library=cpu_operator(), **kwargs)


def test_fp8_attention_refuses_mixed_dtypes_and_descales_without_fp8(cpu_operator) -> None:
    import aotriton_rt

    q, k, v = _qkv()
    with pytest.raises(ArgumentError, match="k has dtype bf16 but q has fp8e4nv"):
        aotriton_rt.attention(q, k.to(torch.bfloat16), v, library=cpu_operator())
    with pytest.raises(ArgumentError, match="q_descale, k_descale, v_descale and out_dtype apply to FP8 attention"):
        aotriton_rt.attention(*(x.to(torch.bfloat16) for x in (q, k, v)), q_descale=2.0, library=cpu_operator())


def test_fp8_attention_refuses_gradients_and_the_backward(cpu_operator) -> None:
    import aotriton_rt

    q, k, v = _qkv()
    q = q.float().requires_grad_()
    with pytest.raises(UnsupportedError, match="FP8 attention is inference only"):
        aotriton_rt.attention(q.to(torch.float8_e4m3fn), k, v, library=cpu_operator())
    qf, kf, vf = _qkv()
    with pytest.raises(UnsupportedError, match="q has dtype fp8e4nv: FP8 attention is an inference forward only"):
        aotriton_rt.attention_backward(torch.zeros(2, 4, 9, 64, dtype=torch.bfloat16), qf, kf, vf,
                                       torch.zeros(2, 4, 9, 64, dtype=torch.bfloat16), torch.zeros(2, 4, 9),
                                       library=cpu_operator())


def test_fp8_attention_names_the_arch_format_and_the_missing_build(cpu_operator, monkeypatch) -> None:
    import aotriton_rt
    from aotriton_rt.ops.attention import dispatch

    with pytest.raises(UnsupportedError, match=r"sm90 multiplies float8_e4m3fn, but q, k, v are float8_e4m3fnuz"):
        aotriton_rt.attention(*_qkv(torch.float8_e4m3fnuz), library=cpu_operator())
    with pytest.raises(KernelNotFound, match=r"FP8 attention needs attn_fwd_fp8 with dtype=fp8e4nv, out_dtype=fp16, "
                                             r"HEAD_DIM=64.*python -m builder build --set full --kernels attn_fwd_fp8"):
        aotriton_rt.attention(*_qkv(), out_dtype="fp16", library=cpu_operator(missing=("attn_fwd_fp8",)))
    monkeypatch.setattr(dispatch.LibraryKernels, "device_arch", lambda self, device: "sm80")
    with pytest.raises(UnsupportedError, match="FP8 attention runs on sm90, gfx950, gfx942; this GPU is sm80"):
        aotriton_rt.attention(*_qkv(), library=cpu_operator())


def test_fp8_variants_are_declared_per_target_format_and_set() -> None:
    import triton

    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    decl = load_kernels()["attn_fwd_fp8"]
    jobs = expand(decl, parse_targets("sm80,sm90,gfx942,gfx950,gfx1100"), "full", triton.__version__)
    assert {(j.target.arch, j.spec["dtype"]) for j in jobs} == {("sm90", "fp8e4nv"), ("gfx950", "fp8e4nv"),
                                                                ("gfx942", "fp8e4b8")}
    gputest = expand(decl, parse_targets("sm90"), "gputest", triton.__version__)
    assert {(j.spec["HEAD_DIM"], j.spec["CAUSAL"], j.spec["VARLEN"], j.spec["out_dtype"]) for j in gputest} == {
        (d, c, v, o) for d in (64, 128) for c in (0, 1) for v in (0, 1) for o in ("bf16", "fp16")}
    default = expand(decl, parse_targets("sm90,gfx942,gfx950"), "default", triton.__version__)
    assert {(j.spec["HEAD_DIM"], j.spec["out_dtype"]) for j in default} == {(128, "bf16")}
    assert len(default) == 12
    pre = expand(load_kernels()["attn_fp8_v_transpose"], parse_targets("sm80,sm90,gfx942,gfx950"), "default",
                 triton.__version__)
    assert {(j.target.arch, j.spec["dtype"], j.spec["HEAD_DIM"]) for j in pre} == {
        ("sm90", "fp8e4nv", 128), ("gfx950", "fp8e4nv", 128), ("gfx942", "fp8e4b8", 128)}


@pytest.mark.parametrize("arch", ["sm90", "gfx942", "gfx950"])
def test_fp8_variant_compiles_to_fp8_matrix_instructions(arch: str) -> None:
    import triton

    from builder.compile import compile_env, source_class
    from builder.registry import expand, load_kernels
    from builder.targets import gpu_target, parse_targets

    decl = load_kernels()["attn_fwd_fp8"]
    job = next(j for j in expand(decl, parse_targets(arch), "gputest", triton.__version__)
               if j.spec["HEAD_DIM"] == 64 and j.spec["CAUSAL"] == 1 and j.spec["VARLEN"] == 1)
    assert job.spec["dtype"] == ("fp8e4b8" if arch == "gfx942" else "fp8e4nv")
    import os

    os.environ.update(compile_env())
    names = list(job.signature)
    attrs = {(names.index(n),): [["tt.divisibility", d]] for n, d in job.divisibility.items()}
    src = source_class(decl.fn)(fn=decl.fn, signature=dict(job.signature), constexprs=dict(job.constexprs),
                                attrs=attrs)
    asm = triton.compile(src, target=gpu_target(job.target), options=job.options()).asm
    if arch == "sm90":
        # Both products on FP8 wgmma, P.V included: Triton stores V's tiles K-major itself.
        assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in asm["ptx"]
        assert ".bf16.bf16" not in asm["ptx"] and ".f16.f16" not in asm["ptx"]
    else:
        # 16x16 MFMA tiles (matrix_instr_nonkdim=16), both products in fp8.
        assert "v_mfma_f32_16x16x32_fp8_fp8" in asm["amdgcn"]
        assert "bf16" not in " ".join(line for line in asm["amdgcn"].splitlines() if "v_mfma" in line)


def test_explain_names_the_fp8_variant_and_refuses_what_it_lacks(tmp_path: Path) -> None:
    import json

    import aotriton_rt
    from aotriton_rt.ops.attention import explain
    from tests.runtime.test_attention_op import _synthetic_variant

    spec = {"dtype": "fp8e4nv", "out_dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 1, "VARLEN": 0}
    (tmp_path / "catalog.json").write_text(json.dumps({
        "schema": "aotriton-rt.catalog", "schema_version": 2, "triton_version": "3.6.0",
        "variants": [*(_synthetic_variant("attn_fwd_fp8", spec, i) for i in (0, 1)),
                     _synthetic_variant("attn_fp8_v_transpose", {"dtype": "fp8e4nv", "HEAD_DIM": 128})]}))
    lib = aotriton_rt.Library(tmp_path)
    ex = explain(dtype="fp8e4nv", head_dim=96, seqlen_q=4096, causal=True, align="bottom_right", arch="sm90",
                 library=lib)
    assert [k.kernel for k in ex.kernels] == ["attn_fp8_v_transpose", "attn_fwd_fp8"] and ex.kernels[1].spec == spec
    assert "attn_fwd_fp8[dtype=fp8e4nv, out_dtype=bf16, HEAD_DIM=128" in str(ex)
    assert "the FP8 forward" in str(ex) and "fp8e4nv, head dim 96" in str(ex)
    with pytest.raises(KernelNotFound, match="attn_fwd_fp8 with dtype=fp8e4nv, out_dtype=fp16"):
        explain(dtype="fp8e4nv", head_dim=128, seqlen_q=64, causal=True, out_dtype="fp16", arch="sm90", library=lib)
    with pytest.raises(UnsupportedError, match="FP8 attention is an inference forward without dropout, backward"):
        explain(dtype="fp8e4nv", head_dim=128, seqlen_q=64, dropout=True, backward=True, arch="sm90", library=lib)
    with pytest.raises(UnsupportedError, match="sm90 multiplies float8_e4m3fn, but q, k, v are float8_e4m3fnuz"):
        explain(dtype="fp8e4b8", head_dim=128, seqlen_q=64, arch="sm90", library=lib)


# ---------------------------------------------------------------------------------------------
# The kernel under the interpreter.
# ---------------------------------------------------------------------------------------------

CASES = {
    "dense_causal_gqa_odd_lengths": {"causal": True, "Sq": 29, "Sk": 37, "Hq": 4, "Hk": 2, "align": "bottom_right"},
    "dense_bshd_head_dim_40_fp16_out": {"layout": "bshd", "D": 40, "out_dtype": "fp16", "descale": "float"},
    "varlen_window_per_head_descales": {"varlen": ((5, 9), (17, 31), (1, 1), (23, 0)), "window": (4, 2),
                                        "Hq": 4, "Hk": 2},
    "torch_op_and_its_fake": {"api": "torch", "causal": True, "Hq": 4, "Hk": 2},
    # e4m3fnuz (gfx942) does not run under Triton 3.6's interpreter ("fail to convert fp8e4b8 to ir
    # type"): its variants are compiled above and launched in tests/runtime/test_differential_hip.py.
}


def _reference(q, k, v, scale, causal, window, align, lens=None):
    """fp32 attention of dequantised (B, H, S, D) inputs, keys visible by the operator's band rule."""
    sq, sk = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = sk - sq if align == "bottom_right" else 0
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i + diag - left
    if right >= 0:
        ok &= j <= i + diag + right
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def _run_case(name: str) -> dict:
    import aotriton_rt
    from tests.runtime.test_attention_op import InterpretedLibrary

    case = CASES[name]
    _install(case.get("arch", "sm90"))
    torch.manual_seed(0)
    fp8 = E4M3[case.get("dtype", "fp8e4nv")]
    hq, hk, d = case.get("Hq", 2), case.get("Hk", 2), case.get("D", 64)
    lib = InterpretedLibrary()
    errors = {}
    if "varlen" in case:
        lens = case["varlen"]
        b = len(lens)
        tq, tk = sum(a for a, _ in lens), sum(c for _, c in lens)
        q8 = (torch.randn(tq + 3, hq, d) * 2).to(fp8)
        q8[tq:] = float("nan")  # rows past the pack are never read
        k8 = (torch.randn(tk, hk, d) * 2).to(fp8)
        v8 = (torch.randn(tk, hk, d) * 2).to(fp8)
        descales = [torch.rand(b, hk) + 0.25 for _ in range(3)]
        cu_q = torch.tensor([0] + list(torch.tensor([a for a, _ in lens]).cumsum(0)), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor([c for _, c in lens]).cumsum(0)), dtype=torch.int32)
        out, lse = aotriton_rt.attention(q8[:tq], k8, v8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                         max_seqlen_q=max(a for a, _ in lens), max_seqlen_k=max(c for _, c in lens),
                                         window=case.get("window"), q_descale=descales[0], k_descale=descales[1],
                                         v_descale=descales[2], library=lib)
        worst = 0.0
        for i, (a, c) in enumerate(lens):
            qs = q8[cu_q[i]:cu_q[i + 1]].float().transpose(0, 1)[None] * descales[0][i].repeat_interleave(
                hq // hk)[None, :, None, None]
            ks = k8[cu_k[i]:cu_k[i + 1]].float().transpose(0, 1)[None] * descales[1][i][None, :, None, None]
            vs = v8[cu_k[i]:cu_k[i + 1]].float().transpose(0, 1)[None] * descales[2][i][None, :, None, None]
            got = out[cu_q[i]:cu_q[i + 1]].float().transpose(0, 1)[None]
            if not a:
                continue
            if not c:  # no keys: zero rows
                worst = max(worst, got.abs().max().item())
                continue
            ref = _reference(qs, ks, vs, d ** -0.5, False, case.get("window"), "top_left")
            bound = 0.07 * vs.abs().max().item() + 0.02
            worst = max(worst, (got - ref).abs().max().item() - bound)
        errors["out"] = worst
        return {"name": name, "failed": "" if worst <= 0 else f"error past the bound by {worst}", "errors": errors}
    if case.get("api") == "torch":
        return _torch_op_case(name, case, lib, fp8, hq, hk, d)
    b, sq, sk = 2, case.get("Sq", 17), case.get("Sk", 23)
    shape = (lambda s, h: (b, s, h, d)) if case.get("layout") == "bshd" else (lambda s, h: (b, h, s, d))
    q8 = (torch.randn(shape(sq, hq)) * 2).to(fp8)
    k8 = (torch.randn(shape(sk, hk)) * 2).to(fp8)
    v8 = (torch.randn(shape(sk, hk)) * 2).to(fp8)
    if case.get("descale") == "float":
        dq, dk, dv = 0.5, 0.25, 3.0
        fq, fk, fv = (torch.full((b, hk), x) for x in (dq, dk, dv))
    else:
        fq, fk, fv = dq, dk, dv = [torch.rand(b, hk) + 0.25 for _ in range(3)]
    out, lse = aotriton_rt.attention(q8, k8, v8, causal=case.get("causal", False), align=case.get("align", "top_left"),
                                     layout=case.get("layout", "bhsd"), q_descale=dq, k_descale=dk, v_descale=dv,
                                     out_dtype=case.get("out_dtype"), library=lib)
    to_bhsd = (lambda x: x.transpose(1, 2)) if case.get("layout") == "bshd" else (lambda x: x)

    def deq(x8, f, rep):
        return to_bhsd(x8.float()) * f.repeat_interleave(rep, 1)[:, :, None, None]

    qs, ks, vs = deq(q8, fq, hq // hk), deq(k8, fk, 1), deq(v8, fv, 1)
    ref = _reference(qs, ks, vs, d ** -0.5, case.get("causal", False), None, case.get("align", "top_left"))
    want = torch.float16 if case.get("out_dtype") == "fp16" else torch.bfloat16
    assert out.dtype == want, out.dtype
    err = (to_bhsd(out.float()) - ref).abs()
    bound = 0.07 * vs.abs().max().item() + 0.02
    errors["out"] = err.max().item()
    errors["mean"] = err.mean().item()
    failed = "" if errors["out"] <= bound and errors["mean"] <= 0.02 * vs.abs().max().item() else \
        f"max {errors['out']} (bound {bound}), mean {errors['mean']}"
    return {"name": name, "failed": failed, "errors": errors}


def _torch_op_case(name: str, case: dict, lib: object, fp8: object, hq: int, hk: int, d: int) -> dict:
    """ops.torch.attention on fp8: the operator's result eagerly, the custom op's under a function
    mode, and its fake implementation's shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    import aotriton_rt
    from aotriton_rt.ops import torch as op_torch

    q8, k8, v8 = ((torch.randn(2, h, 21, d) * 2).to(fp8) for h in (hq, hk, hk))
    dsc = [torch.rand(2, hk) + 0.25 for _ in range(3)]
    kw = dict(causal=True, q_descale=dsc[0], k_descale=dsc[1], v_descale=0.5, out_dtype="fp16", library=lib)
    want = aotriton_rt.attention(q8, k8, v8, **kw)
    got = op_torch.attention(q8, k8, v8, return_lse=True, **kw)

    class Watching(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    op_torch.register_library(lib)
    with Watching():
        through_op = op_torch.attention(q8, k8, v8, return_lse=True, **kw)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q8, k8, v8))
        fake = op_torch.attention(fq, fk, fv, return_lse=True, **{**kw, "q_descale": 2.0, "k_descale": None})
    failed = []
    for label, pair in (("eager", got), ("custom op", through_op)):
        if not (torch.equal(pair[0], want[0]) and torch.equal(pair[1], want[1])):
            failed.append(f"{label} differs from aotriton_rt.attention")
    if fake[0].shape != want[0].shape or fake[0].dtype != torch.float16 or fake[1].shape != want[1].shape:
        failed.append(f"fake: {fake[0].shape} {fake[0].dtype}, {fake[1].shape}")
    leaf = torch.ones(2, hk, requires_grad=True)
    try:
        op_torch.attention(q8, k8, v8, q_descale=leaf, library=lib)
        failed.append("a descale that requires grad was taken")
    except aotriton_rt.UnsupportedError as e:
        if "FP8 attention is inference only" not in str(e):
            failed.append(str(e))
    return {"name": name, "failed": "; ".join(failed), "errors": {"out": 0.0}}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    from tests.helpers.interpreter import run_sharded

    return run_sharded(__file__, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_kernel_matches_the_dequantised_fp32_reference_under_the_interpreter(interpreted, name) -> None:
    result = interpreted[name]
    assert not result["failed"], f"{name}: {result['failed']}"
    assert "out" in result["errors"]


def _main(names: list[str]) -> None:
    from tests.helpers.interpreter import patch_interpreter, report_cases

    patch_interpreter()
    report_cases(names, _run_case)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _main(sys.argv[1:])
