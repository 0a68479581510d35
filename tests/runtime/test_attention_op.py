"""The attention operator without a GPU.

- Dispatch as pure functions: which kernel parameters a call asks for, head-dim buckets,
  backward schemes, tuning-table rules; and through a real :class:`aotriton_rt.Library` over a
  synthetic catalog (real JSON, no images: nothing is launched).
- Every validation refusal, pinned, raised before any allocation or launch (arrays are
  ``__cuda_array_interface__`` descriptions of memory that is never touched).
- The torch custom ops' fake implementations under ``FakeTensorMode``.
- End to end under Triton's interpreter: the operator's real argument lists, strides, padding,
  copies and reductions drive the real kernels from ``builder/kernels/attention*.py`` on CPU
  tensors, compared with an fp64 reference; also the torch op (autograd, ``opcheck``,
  ``torch.compile``). ``TRITON_INTERPRET=1`` must be set before triton is imported, so those
  cases run in subprocesses that execute this file as a script.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import aotriton_rt
from aotriton_rt import ArgumentError, KernelNotFound, UnsupportedError, interop
from aotriton_rt.ops import attention as op
from aotriton_rt.ops.attention import (
    AttentionCall,
    backward_params,
    forward_params,
    head_dim_buckets,
    select_config,
    select_mode,
)

ROOT = Path(__file__).resolve().parents[2]


# =============================================================================================
# Interpreter side (subprocess, TRITON_INTERPRET=1): a Library whose kernels run the Triton
# source of builder/kernels on CPU tensors, checking what the compiled variants would check.
# =============================================================================================

def _patch_interpreter() -> None:
    # Two Triton 3.6 interpreter defects (the same shims as tests/builder/test_attention_interpret.py):
    # int() of 1-element arrays under numpy >= 2.4, and bf16 dot operands multiplied as bit patterns.
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # noqa: ANN001, ANN202
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def widen(h):  # noqa: ANN001, ANN202
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = dot


class InterpretedKernel:
    """A kernel handle (``arg_names``, ``__call__``, ``variant``) launching the Triton source.

    Like a compiled variant it refuses misaligned pointers, indivisible scalars, wrong
    pointer dtypes and failed ``checks``; small blocks (16) keep the interpreter quick and
    exercise the unmasked middle loops on short sequences.
    """

    def __init__(self, lib: InterpretedLibrary, name: str, params: dict) -> None:
        from builder.registry import _divisibility, _resolve_signature
        from builder.targets import KNOWN

        self.lib, self.name = lib, name
        self.decl = decl = lib.decls[name]
        missing = [a for a in decl.axes if a not in params]
        unknown = [p for p in params if p not in decl.axes]
        if missing or unknown:
            raise KernelNotFound(f"{name}: missing axes {missing}, unknown params {unknown}")
        self.spec = dict(params)
        config = decl.configs_for(self.spec, KNOWN["sm90"])[0]
        self.constexprs = {n: self.spec[n] if n in self.spec else config.constexprs.get(n)
                           for n, t in decl.signature.items() if t == "constexpr"}
        self.constexprs.update({k: 16 for k in ("BLOCK_M", "BLOCK_N") if k in self.constexprs})
        self.constexprs.update({k: 0 for k in ("USE_TMA", "WARP_SPEC") if k in self.constexprs})
        self.signature = _resolve_signature(decl, self.spec)
        self.divisibility = _divisibility(decl, self.signature)
        self.arg_names = [n for n, t in self.signature.items() if t != "constexpr"]

    def __call__(self, *args: Any, stream: Any = None) -> None:
        import torch

        from aotriton_rt.pack import compile_expr

        dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "i8": torch.int8,
                  "i32": torch.int32}
        values = dict(zip(self.arg_names, args, strict=True))
        for name, value in values.items():
            t = self.signature[name]
            if t.startswith("*"):
                if value is None:
                    values[name] = torch.empty(0, dtype=dtypes[t[1:]])
                    continue
                assert isinstance(value, torch.Tensor), f"{self.name}.{name}: {type(value)}"
                assert value.dtype == dtypes[t[1:]], f"{self.name}.{name}: {value.dtype} for {t}"
                assert value.data_ptr() % 16 == 0, f"{self.name}.{name}: misaligned"
            else:
                assert isinstance(value, float if t == "fp32" else int), f"{self.name}.{name}={value!r} ({t})"
                div = self.divisibility.get(name)
                assert not div or value % div == 0, f"{self.name}.{name}={value} not a multiple of {div}"
        names = list(values)
        vals = [values[n] if not self.signature[n].startswith("*") else 0 for n in names]
        for check in self.decl.checks:
            assert compile_expr(check, names, self.constexprs, "check")(*vals), f"{self.name}: `{check}` fails"
        grid = tuple(compile_expr(g, names, self.constexprs, "grid")(*vals) for g in self.decl.grid)
        self.lib.launches.append((self.name, self.spec, {n: v.data_ptr() for n, v in values.items()
                                                          if isinstance(v, torch.Tensor)}))
        if grid[0] * grid[1] * grid[2]:
            self.decl.fn[grid](*values.values(), **self.constexprs)

    def variant(self, device: int = 0) -> Any:
        from types import SimpleNamespace

        blocks = {k: v for k, v in self.constexprs.items() if k not in self.spec}
        return SimpleNamespace(spec=self.spec, config=SimpleNamespace(index=0, constexprs=blocks))


class InterpretedLibrary:
    """What the operator uses of a Library: ``kernel()``, ``catalogs`` (tuning), availability."""

    def __init__(self, missing: tuple[str, ...] = ()) -> None:
        from builder.registry import load_kernels

        self.decls = load_kernels()
        self.missing = missing  # kernels (or "name:PARAM=value") these "images" lack
        self.catalogs: list = []
        self.launches: list = []

    def has(self, name: str, params: dict) -> bool:
        return name not in self.missing and not any(f"{name}:{k}={v}" in self.missing for k, v in params.items())

    def kernel(self, name: str, **params: Any) -> InterpretedKernel:
        if not self.has(name, params):
            raise KernelNotFound(f"{name} with {params} is not in these images")
        return InterpretedKernel(self, name, params)


def _install_cpu_operator() -> None:
    """Let the operator take CPU tensors and interpreted libraries (this process only)."""
    import torch

    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
             torch.int64: "i64", torch.int8: "i8"}
    describe = op._describe

    def cpu_describe(obj: Any, name: str) -> interop.ArrayInfo:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            return interop.ArrayInfo(obj.data_ptr(), 0, names[obj.dtype], tuple(obj.shape), tuple(obj.stride()),
                                     "torch")
        return describe(obj, name)

    op._describe = cpu_describe
    op._available = lambda lib, name, params: lib.has(name, params)


# ---------------------------------------------------------------------------------------------
# Cases: (B, Hq, Hk, Sq, Sk, D, Dv), layout, features. Sequence lengths are primes, not block
# multiples; every case runs forward and backward and compares all outputs.
# ---------------------------------------------------------------------------------------------

CASES: dict[str, dict] = {
    "plain_fp32_bhsd": {},
    "fp16_bshd_causal_bottom_right": {"dtype": "fp16", "layout": "bshd", "causal": True, "align": "bottom_right"},
    "bf16_causal_top_left_sq_gt_sk": {"dtype": "bf16", "causal": True, "Sq": 29, "Sk": 19},
    "bottom_right_sq_gt_sk_empty_rows": {"causal": True, "align": "bottom_right", "Sq": 29, "Sk": 19},
    "window_bottom_right_no_causal": {"window": (5, 3), "align": "bottom_right"},
    "window_causal_left_only_gqa": {"causal": True, "window": (7, -1), "Hq": 4, "Hk": 2},
    "mqa_bshd_head_dim_40_padded": {"Hq": 3, "Hk": 1, "layout": "bshd", "D": 40},
    "head_dim_8_and_v_24": {"D": 8, "Dv": 24, "causal": True},
    "unequal_192_128": {"D": 192, "Dv": 128, "Sq": 17, "Sk": 23},
    "strided_views_copied": {"views": "odd", "causal": True},
    "strided_views_in_place": {"views": "aligned", "layout": "bshd"},
    "bias_full": {"bias": "full"},
    "bias_heads_causal_2d_broadcast": {"bias": "rows_keys", "causal": True},
    "bias_broadcast_keys_copied": {"bias": "batch_heads_rows", "Hq": 4, "Hk": 2},
    "dropout_mask_replayed": {"dropout": 0.3},
    "dropout_bias_causal_gqa_bf16": {"dtype": "bf16", "dropout": 0.2, "bias": "heads", "causal": True,
                                     "Hq": 4, "Hk": 2},
    "varlen_causal_bottom_right": {"varlen": ((5, 9), (17, 31), (1, 1), (23, 0)), "causal": True,
                                   "align": "bottom_right"},
    "varlen_window_bias_dropout_gqa": {"varlen": ((19, 19), (33, 7)), "window": (4, 2), "bias": "full",
                                       "dropout": 0.25, "Hq": 4, "Hk": 2},
    "atomic_dq_when_available": {"available": "atomic", "causal": True, "D": 40, "bias": "full"},
    "deterministic_forces_split": {"available": "atomic", "deterministic": True},
    "unequal_pair_missing_runs_padded": {"D": 192, "Dv": 128, "missing": ("attn_fwd:HEAD_DIM_V=128",
                                                                         "attn_bwd_dq:HEAD_DIM_V=128")},
    "torch_op_autograd_dropout_bias": {"api": "torch", "dropout": 0.2, "bias": "heads", "causal": True},
    "torch_op_varlen_fp16": {"api": "torch", "dtype": "fp16", "varlen": ((7, 11), (21, 13))},
    "torch_opcheck_and_compile": {"api": "opcheck"},
}


def _bias_shape(kind: str, B: int, H: int, Sq: int, Sk: int) -> tuple[int, ...]:
    return {"full": (B, H, Sq, Sk), "heads": (H, Sq, Sk), "rows_keys": (Sq, Sk), "batch_heads_rows": (B, H, Sq, 1)
            }[kind]


def run_case(name: str, case: dict) -> dict:
    """Run one case through the operator; returns max errors and the checks that failed."""
    import torch

    from aotriton_rt.ops import torch as op_torch

    c = {"B": 2, "Hq": 2, "Hk": 2, "Sq": 23, "Sk": 37, "D": 32, "dtype": "fp32", "layout": "bhsd",
         "causal": False, "window": None, "align": "top_left", "bias": None, "dropout": 0.0, "varlen": None,
         "api": "core", **case}
    c.setdefault("Dv", c["D"])
    missing = tuple(c.get("missing", ()))
    if c.get("available") != "atomic":
        missing += ("attn_bwd_dq_convert",)
    lib = InterpretedLibrary(missing)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[c["dtype"]]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    B, Hq, Hk, D, Dv = c["B"], c["Hq"], c["Hk"], c["D"], c["Dv"]
    varlen = c["varlen"]
    if varlen:
        B = len(varlen)
        lens_q, lens_k = [a for a, _ in varlen], [b for _, b in varlen]
        Sq, Sk = max(lens_q), max(lens_k)
    else:
        Sq, Sk = c["Sq"], c["Sk"]
        lens_q, lens_k = [Sq] * B, [Sk] * B

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    # Logical per-sequence (H, S, D) tensors, laid out as the call takes them.
    qs = [randn(Hq, n, D) for n in lens_q]
    ks = [randn(Hk, n, D) for n in lens_k]
    vs = [randn(Hk, n, Dv) for n in lens_k]
    dos = [randn(Hq, n, Dv) for n in lens_q]

    def lay(ts: list) -> torch.Tensor:
        if varlen:
            return torch.cat([t.transpose(0, 1) for t in ts], 0)  # (total, H, D)
        x = torch.stack(ts)  # (B, H, S, D)
        if c.get("views"):
            # A view into a wider NaN-filled buffer: rows padded by 3 (odd) or 16 (aligned) elements.
            extra = 3 if c["views"] == "odd" else 16
            base = torch.full((*x.shape[:-1], x.shape[-1] + extra), float("nan"), dtype=dtype)
            base = base.transpose(1, 2).contiguous().transpose(1, 2) if c["layout"] == "bshd" else base
            view = base[..., :x.shape[-1]]
            view.copy_(x)
            x = view
        return x.transpose(1, 2) if c["layout"] == "bshd" else x

    def unlay(x: torch.Tensor, lens: list) -> list:
        if varlen:
            starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
            return [x[starts[b]:starts[b] + n].transpose(0, 1) for b, n in enumerate(lens)]
        x = x.transpose(1, 2) if c["layout"] == "bshd" else x
        return [x[b] for b in range(B)]

    q, k, v, dout = lay(qs), lay(ks), lay(vs), lay(dos)
    opts: dict[str, Any] = {"causal": c["causal"], "window": c["window"], "align": c["align"]}
    if c["layout"] != "bhsd":
        opts["layout"] = c["layout"]
    bias = None
    if c["bias"]:
        bias = torch.randn(*_bias_shape(c["bias"], B, Hq, Sq, Sk), generator=gen).to(dtype)
        opts["bias"] = bias
    if varlen:
        opts["cu_seqlens_q"] = torch.tensor([0, *lens_q], dtype=torch.int32).cumsum(0).to(torch.int32)
        opts["cu_seqlens_k"] = torch.tensor([0, *lens_k], dtype=torch.int32).cumsum(0).to(torch.int32)
    p_drop = c["dropout"]
    failed: list[str] = []
    errors: dict[str, float] = {}
    mask = None

    if c["api"] == "opcheck":
        return _opcheck(lib, q, k, v)
    if c["api"] == "core":
        if p_drop:
            opts.update(dropout_p=p_drop, seed=0x1234_5678_9ABC, offset=77)
        fwd = op.attention(q, k, v, **opts, return_mask=bool(p_drop), library=lib)
        out, lse = fwd[:2]
        if p_drop:
            mask = fwd[2]
            # The same (seed, offset) again: the same mask; the next offset: another one.
            again = op.attention(q, k, v, **opts, return_mask=True, library=lib)[2]
            if not torch.equal(mask, again):
                failed.append("dropout mask differs for the same seed and offset")
            other = op.attention(q, k, v, **{**opts, "offset": 78}, return_mask=True, library=lib)[2]
            if torch.equal(mask, other):
                failed.append("dropout mask did not change with the offset")
        if c.get("views"):
            # Rows padded to a multiple of 16 are read in place; odd padding is copied first.
            q_ptr = next(ptrs["Q"] for n, _, ptrs in lib.launches if n == "attn_fwd")
            if (q_ptr == q.data_ptr()) != (c["views"] == "aligned"):
                failed.append(f"views={c['views']!r}: q {'was' if q_ptr == q.data_ptr() else 'was not'} read in place")
        lib.launches.clear()
        grads = op.attention_backward(dout, q, k, v, out, lse, **opts, deterministic=c.get("deterministic", False),
                                      library=lib)
    else:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if bias is not None:
            opts["bias"] = bias = bias.clone().requires_grad_()
        torch.manual_seed(5)
        res = op_torch.attention(*leaves, **opts, dropout_p=p_drop, return_lse=True, return_mask=bool(p_drop),
                                 library=lib)
        out, lse = res[:2]
        mask = res[2] if p_drop else None
        if p_drop:
            torch.manual_seed(5)
            again = op_torch.attention(*leaves, **opts, dropout_p=p_drop, return_mask=True, library=lib)[1]
            nxt = op_torch.attention(*leaves, **opts, dropout_p=p_drop, return_mask=True, library=lib)[1]
            if not torch.equal(mask, again):
                failed.append("torch.manual_seed did not reproduce the mask")
            if torch.equal(mask, nxt):
                failed.append("successive calls drew the same mask")
        lib.launches.clear()
        out.backward(dout)
        grads = [t.grad for t in leaves] + [bias.grad if bias is not None else None]
        out, lse = out.detach(), lse.detach()

    launched = [n for n, _, _ in lib.launches]
    if c.get("available") == "atomic" and not c.get("deterministic"):
        expect = ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq_convert"]
    else:
        expect = ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    if launched != expect:
        failed.append(f"backward launched {launched}, expected {expect}")
    if c.get("missing"):
        fwd_spec = next(s for n, s, _ in lib.launches if n == "attn_bwd_dkdv")
        if (fwd_spec["HEAD_DIM"], fwd_spec["HEAD_DIM_V"]) != (192, 192):
            failed.append(f"expected the padded 192/192 variants, ran {fwd_spec}")
    tol = {"fp32": 2e-4, "fp16": 2e-2, "bf16": 8e-2}[c["dtype"]]

    def compare(what: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        got, ref = got.double(), ref.double()
        if got.shape != ref.shape:
            failed.append(f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
            return
        both_inf = torch.isinf(ref) & torch.isinf(got) & (torch.sign(ref) == torch.sign(got))
        diff = torch.where(both_inf, 0.0, (got - ref).abs())
        err = float(diff.max()) if diff.numel() else 0.0
        finite = ref[torch.isfinite(ref)]
        scale_ = max(1.0, float(finite.abs().max()) if finite.numel() else 1.0)
        errors[what] = max(errors.get(what, 0.0), err / scale_)
        if not err <= tol * scale_:  # NaN fails too
            failed.append(f"{what}: max error {err:.3g} > {tol * scale_:.3g}")

    outs, dqs, dks, dvs = unlay(out, lens_q), unlay(grads[0], lens_q), unlay(grads[1], lens_k), unlay(grads[2], lens_k)
    scale = 1.0 / math.sqrt(D)
    group = Hq // Hk
    full_bias = None
    if bias is not None:
        full_bias = bias.detach().double().reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).expand(B, Hq, Sq, Sk)
        full_bias = full_bias.clone().requires_grad_()
    dbias_parts = []
    for b in range(B):
        lq, lk = lens_q[b], lens_k[b]
        qr, kr, vr = (t.double().requires_grad_() for t in (qs[b], ks[b], vs[b]))
        s = qr @ kr.repeat_interleave(group, 0).transpose(-1, -2) * scale
        if full_bias is not None:
            s = s + full_bias[b, :, :lq, :lk]
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        vis = torch.ones(lq, lk, dtype=torch.bool)
        wl, wr = c["window"] if c["window"] else (-1, -1)
        if c["causal"]:
            wr = 0
        if c["causal"] or c["window"]:
            rel = j - i - (lk - lq if c["align"] == "bottom_right" else 0)
            vis = vis & (rel >= -wl if wl >= 0 else vis) & (rel <= wr if wr >= 0 else vis)
        row_ok = vis.any(-1)
        s = torch.where(vis, s, float("-inf"))
        s_safe = torch.where(row_ok[:, None], s, 0.0)
        pr = torch.softmax(s_safe, -1) * row_ok[:, None]
        lse_ref = torch.where(row_ok, torch.logsumexp(s_safe.detach(), -1), float("-inf"))
        if mask is not None:
            pr = pr * mask[b, :, :lq, :lk].double() / (1 - p_drop)
        o = pr @ vr.repeat_interleave(group, 0)
        o.backward(dos[b].double())
        compare("out", outs[b], o.detach())
        got_lse = lse[:, int(opts["cu_seqlens_q"][b]):int(opts["cu_seqlens_q"][b]) + lq] if varlen else lse[b]
        compare("lse", got_lse, lse_ref)
        compare("dq", dqs[b], qr.grad)
        compare("dk", dks[b], kr.grad)
        compare("dv", dvs[b], vr.grad)
        dbias_parts.append(b)
    if full_bias is not None:
        ref = full_bias.grad
        dims = tuple(i for i, (e, f) in enumerate(zip((1,) * (4 - bias.dim()) + tuple(bias.shape), (B, Hq, Sq, Sk)))
                     if e == 1 and f != 1)
        ref = ref.sum(dims, keepdim=True) if dims else ref
        compare("dbias", grads[3], ref.reshape(bias.shape))
    if mask is not None:
        kept = float(mask.double().mean()) if not (c["causal"] or c["window"] or varlen) else None
        if kept is not None and abs(kept - (1 - p_drop)) > 0.05:
            failed.append(f"kept fraction {kept:.3f} is far from {1 - p_drop:.3f}")
    return {"name": name, "errors": errors, "failed": failed}


def _opcheck(lib: InterpretedLibrary, q: Any, k: Any, v: Any) -> dict:
    """torch.library.opcheck on both ops, and a torch.compile training step (aot_eager)."""
    import torch

    from aotriton_rt.ops import torch as op_torch

    failed: list[str] = []
    key = op_torch._library_key(lib)
    fwd_args = (q, k, v, None, None, None, -1, -1, True, -1, -1, "top_left", 0.0, 0, 0, 0.25, "bhsd", False,
                False, key)
    try:
        torch.library.opcheck(torch.ops.aotriton_rt.attention_fwd.default, fwd_args)
        out, lse, _ = torch.ops.aotriton_rt.attention_fwd(*fwd_args)
        bwd_args = (torch.randn_like(out), q, k, v, out, lse, None, None, None, -1, -1, True, -1, -1, "top_left",
                    0.0, 0, 0, 0.25, "bhsd", True, False, key)
        torch.library.opcheck(torch.ops.aotriton_rt.attention_bwd.default, bwd_args)
    except Exception as exc:  # reported to the test
        failed.append(f"opcheck: {type(exc).__name__}: {str(exc)[:1500]}")

    def step(q: Any, k: Any, v: Any) -> Any:
        return op_torch.attention(q, k, v, causal=True, library=lib).float().square().mean()

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    try:
        torch.compile(step, backend="aot_eager", fullgraph=True)(*leaves).backward()
        step(*eager).backward()
        for a, b in zip(leaves, eager):
            if not torch.equal(a.grad, b.grad):
                failed.append("torch.compile gradients differ from eager")
    except Exception as exc:
        failed.append(f"torch.compile: {type(exc).__name__}: {str(exc)[:1500]}")
    return {"name": "opcheck", "errors": {"out": 0.0}, "failed": failed}


def _main(names: list[str]) -> None:
    _patch_interpreter()
    _install_cpu_operator()
    for name in names:
        try:
            result = run_case(name, CASES[name])
        except Exception as exc:  # reported to the test, which fails with it
            import traceback

            result = {"name": name, "errors": {}, "failed": [traceback.format_exc()[-3000:]]}
        result["name"] = name
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _main(sys.argv[1:])
