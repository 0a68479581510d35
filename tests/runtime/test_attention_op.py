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
import subprocess
import sys
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
from tests.helpers.interpreter import patch_interpreter, report_cases, run_sharded

ROOT = Path(__file__).resolve().parents[2]


# =============================================================================================
# Interpreter side (subprocess, TRITON_INTERPRET=1): a Library whose kernels run the Triton
# source of builder/kernels on CPU tensors, checking what the compiled variants would check.
# =============================================================================================

class InterpretedKernel:
    """A kernel handle (``arg_names``, ``__call__``, ``variant``) launching the Triton source.

    Like a compiled variant it refuses misaligned pointers, indivisible scalars, wrong
    pointer dtypes and failed ``checks``; small blocks (16) keep the interpreter quick and
    exercise the unmasked middle loops on short sequences.
    """

    def __init__(self, lib: InterpretedLibrary, name: str, params: dict) -> None:
        from builder.registry import _constexpr_defaults, _divisibility, _resolve_signature, constexprs_of
        from builder.targets import KNOWN

        self.lib, self.name = lib, name
        self.decl = decl = lib.decls[name]
        missing = [a for a in decl.axes if a not in params]
        unknown = [p for p in params if p not in decl.axes]
        if missing or unknown:
            raise KernelNotFound(f"{name}: missing axes {missing}, unknown params {unknown}")
        self.spec = dict(params)
        config = decl.configs_for(self.spec, KNOWN["sm90"])[0]
        self.constexprs = constexprs_of(decl.signature, self.spec, config, _constexpr_defaults(decl))
        self.constexprs.update({k: 16 for k in ("BLOCK_M", "BLOCK_N") if k in self.constexprs})
        self.constexprs.update({k: 0 for k in ("USE_TMA", "WARP_SPEC") if k in self.constexprs})
        self.signature = _resolve_signature(decl, self.spec)
        self.divisibility = _divisibility(decl, self.signature, self.spec)
        self.arg_names = [n for n, t in self.signature.items() if t != "constexpr"]

    def __call__(self, *args: Any, stream: Any = None) -> None:
        import torch

        from aotriton_rt.arguments import compile_expr

        dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "i8": torch.int8,
                  "i32": torch.int32, "fp8e4nv": torch.float8_e4m3fn, "fp8e4b8": torch.float8_e4m3fnuz}
        values = dict(zip(self.arg_names, args, strict=True))
        for name, value in values.items():
            t = self.signature[name]
            if t.startswith("*"):
                if value is None:
                    values[name] = torch.empty(0, dtype=dtypes[t[1:]])
                    continue
                assert isinstance(value, torch.Tensor), f"{self.name}.{name}: {type(value)}"
                assert value.dtype == dtypes[t[1:]], f"{self.name}.{name}: {value.dtype} for {t}"
                align = self.divisibility.get(name, value.element_size())  # ALiBi slopes: their element's
                assert value.data_ptr() % align == 0, f"{self.name}.{name}: misaligned"
            else:
                assert isinstance(value, float if t == "fp32" else int), f"{self.name}.{name}={value!r} ({t})"
                div = self.divisibility.get(name)
                assert not div or value % div == 0, f"{self.name}.{name}={value} not a multiple of {div}"
        names = list(values)
        vals = [values[n] if not self.signature[n].startswith("*") else 0 for n in names]
        for check in self.decl.checks_for(self.spec):
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


def dispatch_arch_kernels() -> tuple[str, ...]:
    """The per-architecture Gluon kernels the dispatcher may pick (forwards, the FP8 forward and
    backward kernels, and their aligned-length siblings)."""
    from aotriton_rt.ops.attention.family import ALIGNED_SIBLINGS, ARCH_BACKWARDS, ARCH_FORWARDS, ARCH_FP8_FORWARDS

    return tuple(dict.fromkeys((*ARCH_FORWARDS.values(), *ARCH_FP8_FORWARDS.values(),
                                *(n for own in ARCH_BACKWARDS.values() for n in own.values()),
                                *ALIGNED_SIBLINGS.values())))


class InterpretedLibrary:
    """What the operator uses of a Library: ``kernel()``, ``tuning``, availability."""

    def __init__(self, missing: tuple[str, ...] = ()) -> None:
        from builder.registry import load_kernels

        self.decls = load_kernels()
        # Kernels (or "name:PARAM=value") these "images" lack; always the per-arch Gluon kernels,
        # which the interpreter does not run.
        self.missing = (*dispatch_arch_kernels(), *missing)
        self.tuning: dict = {}
        self.launches: list = []

    def has(self, name: str, params: dict) -> bool:
        return name not in self.missing and not any(f"{name}:{k}={v}" in self.missing for k, v in params.items())

    def kernel(self, name: str, **params: Any) -> InterpretedKernel:
        if not self.has(name, params):
            raise KernelNotFound(f"{name} with {params} is not in these images")
        return InterpretedKernel(self, name, params)


def _install_cpu_operator() -> None:
    """Let the operator take CPU tensors and interpreted libraries (this process only)."""

    from aotriton_rt.ops.attention import dispatch, problem
    from tests.helpers.cpu_arrays import cpu_describer

    problem._describe = cpu_describer(problem._describe)
    dispatch._available = lambda lib, name, params: lib.has(name, params)
    # The interpreter runs this checkout's kernels: a variant takes the arguments its source declares.
    dispatch._takes = lambda lib, name, params, args: all(a in lib.decls[name].signature for a in args)


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
    "atomic_dq_when_asked": {"available": "atomic", "causal": True, "D": 40, "bias": "full"},
    "deterministic_forces_split": {"available": "atomic", "deterministic": True},
    "unequal_pair_missing_runs_padded": {"D": 192, "Dv": 128, "missing": ("attn_fwd:HEAD_DIM_V=128",
                                                                         "attn_bwd_dq:HEAD_DIM_V=128"),
                                         "runs": {"HEAD_DIM": 192, "HEAD_DIM_V": 192}},
    # Images without mask mode 2 (the default set): mode 1 aligned bottom-right by causal_align.
    "bottom_right_on_mode_1_empty_rows_gqa": {"causal": True, "align": "bottom_right", "Sq": 41, "Sk": 19, "Hq": 4,
                                              "Hk": 2, "missing": ("attn_fwd:CAUSAL=2", "attn_bwd_dkdv:CAUSAL=2",
                                                                   "attn_bwd_dq:CAUSAL=2"), "runs": {"CAUSAL": 1}},
    "varlen_bottom_right_window_on_mode_1": {"varlen": ((5, 9), (17, 31), (23, 4)), "window": (3, 2),
                                             "align": "bottom_right", "missing": ("attn_fwd:CAUSAL=2",
                                             "attn_bwd_dkdv:CAUSAL=2", "attn_bwd_dq:CAUSAL=2"), "runs": {"CAUSAL": 1}},
    "torch_op_autograd_dropout_bias": {"api": "torch", "dropout": 0.2, "bias": "heads", "causal": True},
    "torch_op_varlen_fp16": {"api": "torch", "dtype": "fp16", "varlen": ((7, 11), (21, 13))},
    "torch_opcheck_and_compile": {"api": "opcheck"},
    # Logit softcap, forward and backward: small caps, so tanh bends every score.
    "softcap_bf16_causal_bottom_right": {"softcap": 1.5, "dtype": "bf16", "causal": True, "align": "bottom_right",
                                         "Sq": 29, "Sk": 41},
    "softcap_fp32_varlen_window_gqa": {"softcap": 0.75, "varlen": ((5, 9), (17, 31), (23, 4)), "window": (3, 2),
                                       "align": "bottom_right", "Hq": 4, "Hk": 2},
    "softcap_fp16_no_mask_head_dim_40_padded": {"softcap": 2.0, "dtype": "fp16", "D": 40, "layout": "bshd"},
    "softcap_torch_op_autograd": {"softcap": 1.0, "api": "torch", "causal": True},
    "softcap_atomic_dq": {"softcap": 1.25, "available": "atomic", "causal": True, "D": 40},
    # ALiBi (FlashAttention-2's: -slope * |i + Sk - Sq - j| after the scale, queries and keys aligned
    # bottom-right whatever the mask's alignment), forward and backward. Slopes shared by the batch
    # ("heads"), per sequence ("batch"), or a 4-byte aligned view read in place ("view").
    "alibi_causal_bottom_right_sq_lt_sk": {"alibi": "heads", "causal": True, "align": "bottom_right"},
    "alibi_bf16_no_mask_sq_gt_sk_per_batch_bshd": {"alibi": "batch", "dtype": "bf16", "Sq": 41, "Sk": 19,
                                                   "layout": "bshd"},
    "alibi_top_left_causal_gqa_view": {"alibi": "view", "causal": True, "Hq": 4, "Hk": 2},
    "alibi_varlen_window_gqa_per_sequence": {"alibi": "batch", "varlen": ((5, 9), (17, 31), (23, 4)),
                                             "window": (3, 2), "align": "bottom_right", "Hq": 4, "Hk": 2},
    "alibi_dropout_mask_replayed": {"alibi": "heads", "dropout": 0.3, "causal": True, "align": "bottom_right"},
    "alibi_atomic_dq_head_dim_40_padded": {"alibi": "batch", "available": "atomic", "causal": True, "D": 40},
    # A short query run (the decode kernels' territory): the decode kernels have no ALiBi.
    "alibi_five_query_rows_not_routed_to_decode": {"alibi": "batch", "Sq": 5, "causal": True,
                                                   "align": "bottom_right", "layout": "bshd", "dtype": "fp16"},
    "alibi_torch_op_autograd_varlen": {"alibi": "batch", "api": "torch", "varlen": ((7, 11), (21, 13)),
                                       "causal": True, "align": "bottom_right"},
    "alibi_torch_opcheck_and_compile": {"alibi": "heads", "api": "opcheck"},
}


def _bias_shape(kind: str, B: int, H: int, Sq: int, Sk: int) -> tuple[int, ...]:
    return {"full": (B, H, Sq, Sk), "heads": (H, Sq, Sk), "rows_keys": (Sq, Sk), "batch_heads_rows": (B, H, Sq, 1)
            }[kind]


def _visible(c: dict, lq: int, lk: int) -> tuple:
    """(visible (lq, lk) bools, rows that see a key) of a case's mask for one sequence."""
    import torch

    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    vis = torch.ones(lq, lk, dtype=torch.bool)
    wl, wr = c["window"] if c["window"] else (-1, -1)
    if c["causal"]:
        wr = 0
    if c["causal"] or c["window"]:
        rel = j - i - (lk - lq if c["align"] == "bottom_right" else 0)
        vis = vis & (rel >= -wl if wl >= 0 else vis) & (rel <= wr if wr >= 0 else vis)
    return vis, vis.any(-1)


def _alibi_slopes(kind: str | None, B: int, H: int, gen: Any) -> Any:
    """The case's ALiBi slopes (fp32), or None: ``(H,)``, ``(B, H)``, or a ``(B, H)`` view at a
    4-byte offset into a larger buffer (``view``: the kernels read it in place)."""
    import torch

    if not kind:
        return None
    slopes = torch.rand(B if kind != "heads" else 1, H, generator=gen) * 0.4 + 0.05
    if kind == "heads":
        return slopes[0]
    if kind == "view":
        buffer = torch.full((B * H + 1,), float("nan"))
        buffer[1:] = slopes.flatten()
        return buffer[1:].view(B, H)
    return slopes


def _check_alibi_launches(lib: Any, alibi: Any, failed: list) -> None:
    """An ALiBi call ran the ALIBI=1 variants of every kernel with the axis, each reading the
    caller's slopes in place."""
    if alibi is None:
        return
    for name, spec, ptrs in lib.launches:
        if "ALIBI" in lib.decls[name].axes and (spec.get("ALIBI") != 1 or ptrs["alibi_slopes"] != alibi.data_ptr()):
            failed.append(f"alibi: launched {name} with ALIBI={spec.get('ALIBI')}, expected 1 and the slopes in place")
    if not any(n == "attn_fwd" or n == "attn_bwd_dkdv" for n, _, _ in lib.launches):
        failed.append(f"alibi: launched {[n for n, _, _ in lib.launches]}")


def _check_softcap_forward(lib: Any, softcap: Any, failed: list) -> None:
    """A softcapped call's forward ran attn_fwd's SOFTCAP=1 variant (never the decode kernels)."""
    ran = [(n, s.get("SOFTCAP")) for n, s, _ in lib.launches]
    if softcap and ran != [("attn_fwd", 1)] * len(ran):
        failed.append(f"softcap: launched {ran}, expected attn_fwd with SOFTCAP=1 only")


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
    softcap = c.get("softcap")
    if softcap:
        opts["softcap"] = softcap
    alibi = _alibi_slopes(c.get("alibi"), B, Hq, gen)
    if alibi is not None:
        opts["alibi_slopes"] = alibi

    if c["api"] == "opcheck":
        return _opcheck(lib, q, k, v, alibi)
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
        _check_softcap_forward(lib, softcap, failed)
        _check_alibi_launches(lib, alibi, failed)
        lib.launches.clear()
        scheme = "atomic" if c.get("available") == "atomic" and not c.get("deterministic") else None
        grads = op.attention_backward(dout, q, k, v, out, lse, **opts, deterministic=c.get("deterministic", False),
                                      scheme=scheme, library=lib)
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
        _check_softcap_forward(lib, softcap, failed)
        _check_alibi_launches(lib, alibi, failed)
        lib.launches.clear()
        out.backward(dout)
        grads = [t.grad for t in leaves] + [bias.grad if bias is not None else None]
        out, lse = out.detach(), lse.detach()

    _check_alibi_launches(lib, alibi, failed)
    launched = [n for n, _, _ in lib.launches]
    if c.get("available") == "atomic" and not c.get("deterministic"):
        expect = ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq_convert"]
    else:
        expect = ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    if launched != expect:
        failed.append(f"backward launched {launched}, expected {expect}")
    if c.get("runs"):
        ran = next(s for n, s, _ in lib.launches if n == "attn_bwd_dkdv")
        if any(ran.get(k) != v for k, v in c["runs"].items()):
            failed.append(f"expected variants with {c['runs']}, ran {ran}")
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
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if alibi is not None:
            # After the scale; i and j aligned bottom-right with the sequence's own lengths.
            slope = (alibi if alibi.dim() == 1 else alibi[b]).double()[:, None, None]
            s = s - slope * (torch.arange(lq)[:, None] + lk - lq - torch.arange(lk)[None, :]).abs()
        if full_bias is not None:
            s = s + full_bias[b, :, :lq, :lk]
        vis, row_ok = _visible(c, lq, lk)
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


def _opcheck(lib: InterpretedLibrary, q: Any, k: Any, v: Any, alibi: Any = None) -> dict:
    """torch.library.opcheck on both ops, and a torch.compile training step (aot_eager); with
    ``alibi`` (slopes), every call passes them."""
    import copy

    import torch

    from aotriton_rt.ops import torch as op_torch

    failed: list[str] = []
    key = op_torch._library_key(lib)
    fwd_args = (q, k, v, None, None, None, None, -1, -1, True, -1, -1, "top_left", 0.0, 0, 0, 0.25, "bhsd", False,
                False, key) + ((0.0, alibi) if alibi is not None else ())
    try:
        torch.library.opcheck(torch.ops.aotriton_rt.attention_fwd.default, fwd_args)
        out, lse, _ = torch.ops.aotriton_rt.attention_fwd(*fwd_args)
        bwd_args = (torch.randn_like(out), q, k, v, out, lse, None, None, None, None, -1, -1, True, -1, -1, "top_left",
                    0.0, 0, 0, 0.25, "bhsd", True, False, key) + ((0.0, alibi) if alibi is not None else ())
        torch.library.opcheck(torch.ops.aotriton_rt.attention_bwd.default, bwd_args)
    except Exception as exc:  # reported to the test
        failed.append(f"opcheck: {type(exc).__name__}: {str(exc)[:1500]}")

    # A library object no eager call has registered: compiled code finds it through
    # register_library (aotriton_rt.Library objects need not even that: live_library).
    fresh = copy.copy(lib)
    op_torch.register_library(fresh)

    def step(q: Any, k: Any, v: Any) -> Any:
        return op_torch.attention(q, k, v, causal=True, alibi_slopes=alibi, library=fresh).float().square().mean()

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
    patch_interpreter()
    _install_cpu_operator()
    report_cases(names, lambda name: run_case(name, CASES[name]))



# =============================================================================================
# Test side.
# =============================================================================================

_TYPESTR = {"fp16": ("<f2", 2), "fp32": ("<f4", 4), "i32": ("<i4", 4), "i64": ("<i8", 8)}


class Dev:
    """A GPU array as ``__cuda_array_interface__`` describes it; its memory is never read."""

    def __init__(self, *shape: int, dtype: str = "fp16", strides: tuple[int, ...] | None = None,
                 ptr: int = 0x7F00_0000_0000, readonly: bool = False) -> None:
        self.shape, self.dtype, self.ptr, self.readonly = shape, dtype, ptr, readonly
        typestr, size = _TYPESTR[dtype]
        self._cai = {"shape": shape, "typestr": typestr, "data": (ptr, readonly), "version": 3,
                     "strides": None if strides is None else tuple(x * size for x in strides)}

    @property
    def __cuda_array_interface__(self) -> dict:
        return self._cai


def qkv(B: int = 2, H: int = 4, S: int = 64, D: int = 64, Hk: int | None = None, Sk: int | None = None,
        dtype: str = "fp16") -> tuple[Dev, Dev, Dev]:
    Hk, Sk = Hk or H, Sk or S
    return Dev(B, H, S, D, dtype=dtype), Dev(B, Hk, Sk, D, dtype=dtype), Dev(B, Hk, Sk, D, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Dispatch as pure functions.
# ---------------------------------------------------------------------------------------------

def only(*allowed: tuple[str, dict], takes: tuple[str, ...] = ("causal_align",)):
    """An availability predicate: these (kernel, partial params) and nothing else, their variants
    taking the run-time arguments ``takes`` (images of this checkout by default; ``takes=()``:
    built before ``causal_align`` existed)."""
    def available(name: str, params: dict, args: tuple[str, ...]) -> bool:
        return set(args) <= set(takes) and any(name == n and all(params.get(k) == v for k, v in want.items())
                                               for n, want in allowed)
    return available


def test_forward_params_follow_the_call_with_the_head_dim_bucket() -> None:
    call = AttentionCall("bf16", 40, 40, causal=2, bias=True, dropout=2, varlen=True)
    assert forward_params(call) == {"dtype": "bf16", "HEAD_DIM": 48, "HEAD_DIM_V": 48, "CAUSAL": 2, "BIAS": 1,
                                    "DROPOUT": 2, "VARLEN": 1, "SOFTCAP": 0, "ALIBI": 0}
    plain = AttentionCall("fp32", 64, 64)
    assert forward_params(plain) == {"dtype": "fp32", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0, "BIAS": 0,
                                     "DROPOUT": 0, "VARLEN": 0, "SOFTCAP": 0, "ALIBI": 0}
    capped = AttentionCall("bf16", 256, 256, causal=1, softcap=True)
    assert forward_params(capped)["SOFTCAP"] == 1 and forward_params(capped)["ALIBI"] == 0
    assert forward_params(AttentionCall("bf16", 128, 128, causal=1, alibi=True))["ALIBI"] == 1
    # Images built before an axis (no variant has the parameter): the same spec without it, and
    # without the newer ones (images before SOFTCAP predate ALIBI too).
    before_softcap = {"dtype": "fp32", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0, "BIAS": 0, "DROPOUT": 0,
                      "VARLEN": 0}
    assert forward_params(plain, lambda name, params, args: not {"SOFTCAP", "ALIBI"} & set(params)) == before_softcap
    assert forward_params(plain, lambda name, params, args: "ALIBI" not in params) == {**before_softcap, "SOFTCAP": 0}
    assert forward_params(capped, lambda name, params, args: "ALIBI" not in params)["SOFTCAP"] == 1


def test_an_alibi_call_asks_for_alibi_variants_only_and_names_the_axis_when_images_lack_it() -> None:
    call = AttentionCall("fp16", 64, 64, causal=2, alibi=True)
    before_alibi = lambda name, params, args: "ALIBI" not in params
    assert forward_params(call, before_alibi)["ALIBI"] == 1
    mode, kernels = backward_params(call, before_alibi)
    assert kernels["attn_bwd_dkdv"]["ALIBI"] == 1 and kernels["attn_bwd_dq"]["ALIBI"] == 1
    assert "ALIBI" not in kernels["attn_bwd_preprocess"]
    # The ALiBi variants take the slopes (a variant that does not is never picked).
    assert dispatch_needed_args(call, forward_params(call)) == ("alibi_slopes",)
    mode, kernels = backward_params(AttentionCall("fp16", 64, 64, alibi=True), mode="atomic")
    assert mode == "atomic" and kernels["attn_bwd_dkdv"]["ALIBI"] == 1 and kernels["attn_bwd_dkdv"]["DQ_ATOMIC"] == 1


def dispatch_needed_args(call: AttentionCall, spec: dict) -> tuple[str, ...]:
    from aotriton_rt.ops.attention.dispatch import needed_args

    return needed_args(call, spec)


def test_an_uncapped_call_never_takes_a_softcap_variant_of_images_that_have_the_axis() -> None:
    # Images with the SOFTCAP axis holding this spec capped only (the default set at head dim 256
    # varlen): the spec without the axis would match the SOFTCAP=1 variants, which refuse
    # softcap=0. The call's own SOFTCAP=0 spec is named instead, so KernelNotFound says what is missing.
    images = [{"HEAD_DIM": 256, "VARLEN": 1, "SOFTCAP": 1}, {"HEAD_DIM": 128, "VARLEN": 1, "SOFTCAP": 0}]

    def available(name: str, params: dict, args: tuple[str, ...]) -> bool:
        return any(all(v.get(k, params[k]) == params[k] for k in params if k in ("HEAD_DIM", "VARLEN", "SOFTCAP"))
                   and all(k in v or k not in ("SOFTCAP",) for k in params) for v in images)

    call = AttentionCall("bf16", 256, 256, causal=1, varlen=True)
    assert forward_params(call, available)["SOFTCAP"] == 0
    assert all(p.get("SOFTCAP", 0) == 0 for p in backward_params(call, available)[1].values())
    # Images built before the axis: the unkeyed spec, as before.
    assert "SOFTCAP" not in forward_params(call, lambda name, params, args: not {"SOFTCAP", "ALIBI"} & set(params))


def test_equal_lengths_run_on_whichever_causal_alignment_the_images_hold() -> None:
    top_left = AttentionCall("fp16", 64, 64, causal=1, causal_equivalent=True)
    assert forward_params(top_left)["CAUSAL"] == 2
    assert forward_params(top_left, only(("attn_fwd", {"CAUSAL": 1})))["CAUSAL"] == 1
    # Equal lengths: any mode-1 variant serves, even one built before causal_align (its band is
    # top-left, which is the bottom-right one here).
    equal = AttentionCall("fp16", 64, 64, causal=2, causal_equivalent=True)
    assert forward_params(equal, only(("attn_fwd", {"CAUSAL": 1}), takes=()))["CAUSAL"] == 1
    # Different lengths, top-left: mode 2 is bottom-right only, so it never serves.
    strict = AttentionCall("fp16", 64, 64, causal=1)
    assert forward_params(strict, only(("attn_fwd", {"CAUSAL": 2})))["CAUSAL"] == 1


def test_a_bottom_right_call_runs_on_mode_1_only_where_its_variants_take_causal_align() -> None:
    lopsided = AttentionCall("fp16", 128, 128, causal=2, seqlen_q=100, seqlen_k=300)
    # Mode 2 first (images built before causal_align hold it for bottom-right calls) ...
    assert forward_params(lopsided, only(("attn_fwd", {"CAUSAL": 2}), ("attn_fwd", {"CAUSAL": 1})))["CAUSAL"] == 2
    # ... mode 1 when that is all the images hold (the default set), aligned by its argument ...
    assert forward_params(lopsided, only(("attn_fwd", {"CAUSAL": 1})))["CAUSAL"] == 1
    mode1 = only(("attn_bwd_preprocess", {}), ("attn_bwd_dkdv", {"CAUSAL": 1}), ("attn_bwd_dq", {"CAUSAL": 1}))
    assert {p.get("CAUSAL") for p in backward_params(lopsided, mode1)[1].values()} == {None, 1}
    # ... and never a mode-1 variant that cannot be aligned: the call's own mode is named instead, so
    # that KernelNotFound says what is missing.
    old = only(("attn_fwd", {"CAUSAL": 1}), takes=())
    assert forward_params(lopsided, old)["CAUSAL"] == 2
    old_bwd = only(("attn_bwd_preprocess", {}), ("attn_bwd_dkdv", {"CAUSAL": 1}), ("attn_bwd_dq", {"CAUSAL": 1}),
                   takes=())
    assert backward_params(lopsided, old_bwd)[1]["attn_bwd_dkdv"]["CAUSAL"] == 2


def test_head_dims_take_the_smallest_bucket_and_unequal_pairs_only_where_compiled() -> None:
    first = lambda dk, dv: head_dim_buckets(dk, dv)[0]
    assert first(64, 64) == (64, 64)
    assert first(40, 40) == (48, 48)
    assert first(1, 1) == (16, 16)
    assert first(72, 72) == (80, 80)
    assert head_dim_buckets(192, 128)[:2] == [(192, 128), (192, 192)]
    assert head_dim_buckets(180, 100)[:2] == [(192, 128), (192, 192)]
    assert first(8, 24) == (32, 32)
    assert head_dim_buckets(256, 64) == [(256, 256), (512, 512)]
    # Then every wider bucket, narrowest first: images without a bucket run on the next they hold.
    assert head_dim_buckets(80, 80) == [(80, 80), (96, 96), (128, 128), (160, 160), (192, 192), (224, 224),
                                        (256, 256), (512, 512)]
    assert head_dim_buckets(192, 128) == [(192, 128), (192, 192), (224, 224), (256, 256), (512, 512)]
    # 257..512 on the 512 bucket, unequal pairs with a side above 256 too (only equal 512 is compiled).
    assert head_dim_buckets(300, 300) == head_dim_buckets(512, 256) == head_dim_buckets(64, 257) == [(512, 512)]
    with pytest.raises(UnsupportedError, match=r"head dim 513 exceeds the largest supported head dim 512; "
                                               r"supported: 1\.\.512 \(compiled buckets 16, 32, 48"):
        head_dim_buckets(64, 513)
    call = AttentionCall("fp16", 192, 128)
    assert forward_params(call)["HEAD_DIM_V"] == 128
    assert forward_params(call, only(("attn_fwd", {"HEAD_DIM_V": 192})))["HEAD_DIM_V"] == 192


def test_head_dims_whose_bucket_the_images_lack_run_zero_padded_on_the_next_bucket_they_hold() -> None:
    # The default set compiles 64, 128 and 256: Phi-3's 96 and Phi-2's 80 run on 128, forward and backward.
    held = lambda name, params, args: params.get("HEAD_DIM") in (64, 128, 256)
    for d in (80, 96, 112):
        call = AttentionCall("bf16", d, d, causal=2, dropout=1)
        assert forward_params(call, held)["HEAD_DIM"] == 128 and forward_params(call, held)["HEAD_DIM_V"] == 128
        mode, kernels = backward_params(call, held)
        assert mode == "split" and {p["HEAD_DIM"] for p in kernels.values()} == {128}
    assert forward_params(AttentionCall("fp16", 160, 160), held)["HEAD_DIM"] == 256
    assert forward_params(AttentionCall("fp16", 192, 128), held)["HEAD_DIM_V"] == 256
    # Images holding none of them: the call's own bucket, so that KernelNotFound names what is missing.
    none = lambda name, params, args: False
    assert forward_params(AttentionCall("fp16", 80, 80), none)["HEAD_DIM"] == 80
    assert backward_params(AttentionCall("fp16", 80, 80), none)[1]["attn_bwd_dq"]["HEAD_DIM"] == 80


def test_backward_prefers_split_and_takes_atomic_dq_only_when_asked_or_alone() -> None:
    call = AttentionCall("fp16", 128, 128, causal=2, bias=True)
    mode, kernels = backward_params(call)
    assert mode == "split"
    assert list(kernels) == ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    assert kernels["attn_bwd_preprocess"]["DQ_ATOMIC"] == 0 and kernels["attn_bwd_dkdv"]["DQ_ATOMIC"] == 0
    assert kernels["attn_bwd_dq"]["BIAS"] == 1
    # A tuning rule asks for atomic dQ.
    mode, kernels = backward_params(call, mode="atomic")
    assert mode == "atomic"
    assert list(kernels) == ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq_convert"]
    assert kernels["attn_bwd_dkdv"] == {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "CAUSAL": 2,
                                        "DROPOUT": 0, "VARLEN": 0, "SOFTCAP": 0, "ALIBI": 0, "BIAS": 2, "DQ_ATOMIC": 1}
    assert kernels["attn_bwd_dq_convert"] == {"dtype": "fp16", "HEAD_DIM": 128, "VARLEN": 0}
    # Images with only the atomic kernels: atomic, unless the call must be deterministic.
    no_dq = lambda name, params, args: name != "attn_bwd_dq"
    assert backward_params(call, no_dq)[0] == "atomic"
    assert backward_params(call, no_dq, deterministic=True)[0] == "split"
    # Images without the convert kernel: split, whatever the preference.
    no_convert = lambda name, params, args: name != "attn_bwd_dq_convert"
    assert backward_params(call, no_convert, mode="atomic")[0] == "split"
    # A tuning rule cannot make a deterministic call atomic.
    assert backward_params(call, mode="atomic", deterministic=True)[0] == "split"


def test_backward_writes_dbias_only_when_asked_and_dropout_replays_without_the_mask() -> None:
    call = AttentionCall("bf16", 64, 64, bias=True, dropout=2)
    _, kernels = backward_params(call, deterministic=True, dbias=False)
    assert kernels["attn_bwd_dkdv"]["BIAS"] == 1 and kernels["attn_bwd_dkdv"]["DROPOUT"] == 1
    assert kernels["attn_bwd_dq"]["DROPOUT"] == 1


def test_tuning_rules_pick_the_first_match_by_arch_spec_and_length() -> None:
    rules = [{"arch": "sm80", "config": 3},
             {"spec": {"HEAD_DIM": 128}, "seqlen_k": [4096, None], "config": 2},
             {"spec": {"HEAD_DIM": 128}, "seqlen_q": [None, 100], "config": 1}]
    spec = {"dtype": "fp16", "HEAD_DIM": 128}
    pick = lambda **kw: select_config(rules, kernel="attn_fwd", spec=spec, arch="sm90", **kw)
    assert pick(seqlen_q=8192, seqlen_k=8192) == 2
    assert pick(seqlen_q=64, seqlen_k=1024) == 1
    assert pick(seqlen_q=1024, seqlen_k=1024) == 0
    assert select_config(rules, kernel="attn_fwd", spec=spec, seqlen_q=1, seqlen_k=1, arch="sm80") == 3
    assert select_config(None, kernel="attn_fwd", spec=spec, seqlen_q=1, seqlen_k=1) == 0
    asked = []
    select_config([{"spec": {"HEAD_DIM": 64}, "arch": "sm90", "config": 1}], kernel="attn_fwd", spec=spec,
                  seqlen_q=1, seqlen_k=1, arch=lambda: asked.append(1) or "sm90")
    assert asked == [], "the device arch is looked up only when a rule names one"
    assert select_mode([{"seqlen_k": [None, 2048], "mode": "split"}], spec=spec, seqlen_q=1, seqlen_k=1) == "split"


@pytest.mark.parametrize("rules,match", [
    ({"config": 1}, r"catalog tuning\['attn_fwd'\] must be a list of rules, got dict"),
    ([3], r"catalog tuning\['attn_fwd'\]\[0\] must be an object, got 3"),
    ([{"seqlen_k": [1]}], r"catalog tuning\['attn_fwd'\]\[0\]\.seqlen_k must be \[low, high\]"),
    ([{"config": -1}], r"config must be an integer >= 0"),
])
def test_malformed_tuning_rules_are_catalog_errors(rules: Any, match: str) -> None:
    with pytest.raises(aotriton_rt.CatalogError, match=match):
        select_config(rules, kernel="attn_fwd", spec={}, seqlen_q=1, seqlen_k=1)


# ---------------------------------------------------------------------------------------------
# Through a real Library over a synthetic catalog (no images: handles are made, never launched).
# ---------------------------------------------------------------------------------------------

def _synthetic_variant(name: str, spec: dict, index: int = 0, arch: str = "sm90", without: tuple[str, ...] = ()
                       ) -> dict:
    """A catalog entry for ``name``/``spec`` as this checkout declares it (``without``: arguments it
    lacks, as in images built before they existed)."""
    import hashlib

    from builder.registry import _divisibility, _resolve_signature, load_kernels
    from builder.targets import KNOWN

    decl = load_kernels()[name]
    signature = _resolve_signature(decl, spec)
    div = _divisibility(decl, signature, spec)
    args, offset = [], 0
    for arg, t in signature.items():
        if t == "constexpr" or arg in without:
            continue
        size = 8 if t.startswith("*") or t in ("i64", "u64") else 4
        offset = -(-offset // size) * size
        args.append({"name": arg, "type": t, "offset": offset, "size": size, "align": size,
                     **({"divisibility": div[arg]} if div.get(arg, 1) > 1 else {})})
        offset += size
    offset = -(-offset // 8) * 8
    hidden = [{"name": n, "type": "*i8", "offset": offset + 8 * i, "size": 8, "align": 8}
              for i, n in enumerate(("global_scratch", "profile_scratch"))]
    config = decl.configs_for(spec, KNOWN[arch])[index]
    body = {"kernel": name, "symbol": name, "target": {"backend": "cuda", "arch": arch, "warp_size": 32},
            "spec": spec, "config": {"index": index, "constexprs": dict(config.constexprs),
                                     "num_warps": config.num_warps, "num_stages": config.num_stages, "options": {}},
            "args": args, "hidden_args": hidden, "param_size": offset + 16,
            "scratch": {"global_size": 0, "global_align": 1, "profile_size": 0, "profile_align": 1},
            "num_warps": config.num_warps, "num_ctas": 1, "cluster_dims": [1, 1, 1], "shared": 0,
            "launch": {"cooperative": False, "pdl": False}, "grid": list(decl.grid),
            "checks": [c for c in decl.checks_for(spec) if not any(a in c for a in without)],
            "triton_version": "3.6.0"}
    key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    body["key"] = key
    body["image"] = {"path": f"cuda/{arch}/{name}/{name}-{key[:16]}.cubin.xz", "format": "cubin",
                     "compression": "xz", "sha256": "0" * 64, "size": 1, "raw_sha256": "0" * 64, "raw_size": 1}
    return body


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> aotriton_rt.Library:
    """fp16 D=64 images: the forward (no mask and bottom-right causal, configs 0 and 1) and the
    split backward without mask; a tuning rule sends long keys to forward config 1."""
    folder = tmp_path_factory.mktemp("synthetic")
    base = {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64}
    variants = []
    for causal in (0, 2):
        for index in (0, 1):
            variants.append(_synthetic_variant("attn_fwd", {**base, "CAUSAL": causal, "BIAS": 0, "DROPOUT": 0,
                                                            "VARLEN": 0}, index))
    variants.append(_synthetic_variant("attn_bwd_preprocess", {**base, "VARLEN": 0, "DQ_ATOMIC": 0}))
    variants.append(_synthetic_variant("attn_bwd_dkdv", {**base, "CAUSAL": 0, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0,
                                                         "DQ_ATOMIC": 0}))
    variants.append(_synthetic_variant("attn_bwd_dq", {**base, "CAUSAL": 0, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0}))
    catalog = {"schema": "aotriton-rt.catalog", "schema_version": 2, "triton_version": "3.6.0",
               "tuning": {"attn_fwd": [{"arch": "sm90", "spec": {"HEAD_DIM": 64}, "seqlen_k": [4096, None],
                                        "config": 1}]},
               "variants": variants}
    (folder / "catalog.json").write_text(json.dumps(catalog))
    return aotriton_rt.Library(folder)


def test_library_dispatch_reads_the_tuning_table_per_sequence_length(synthetic: aotriton_rt.Library) -> None:
    short = op.attention_kernels(*qkv(S=1000), causal=True, library=synthetic)["attn_fwd"]
    long = op.attention_kernels(*qkv(S=5000), causal=True, library=synthetic)["attn_fwd"]
    assert short.params == {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 2, "BIAS": 0,
                            "DROPOUT": 0, "VARLEN": 0}
    assert [v.config.index for v in short.candidates] == [0, 1]  # the lowest index launches
    assert [v.config.index for v in long.candidates] == [1]
    assert long.params["BLOCK_M"] == long.candidates[0].config.constexprs["BLOCK_M"]


def test_a_tuning_rule_naming_a_config_the_images_lack_runs_config_0(tmp_path: Path) -> None:
    # The default set builds config #0 only; a catalog rule (e.g. merged from another build) may
    # still name an alternate: dispatch must run config 0, not fail.
    spec = {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0}
    catalog = {"schema": "aotriton-rt.catalog", "schema_version": 2, "triton_version": "3.6.0",
               "tuning": {"attn_fwd": [{"arch": "sm90", "config": 2}]},
               "variants": [_synthetic_variant("attn_fwd", spec, 0)]}
    (tmp_path / "catalog.json").write_text(json.dumps(catalog))
    handle = op.attention_kernels(*qkv(), library=aotriton_rt.Library(tmp_path))["attn_fwd"]
    assert handle.params == spec and [v.config.index for v in handle.candidates] == [0]


def test_an_old_mode_1_variant_never_serves_a_bottom_right_call_and_a_new_one_does(tmp_path: Path) -> None:
    spec = {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 1, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0}

    def images(folder: Path, without: tuple[str, ...]) -> aotriton_rt.Library:
        folder.mkdir()
        variants = [_synthetic_variant("attn_fwd", spec, without=without),
                    _synthetic_variant("attn_bwd_preprocess", {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64,
                                                               "VARLEN": 0, "DQ_ATOMIC": 0}),
                    _synthetic_variant("attn_bwd_dkdv", {**spec, "DQ_ATOMIC": 0}, without=without),
                    _synthetic_variant("attn_bwd_dq", spec, without=without)]
        (folder / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                         "triton_version": "3.6.0", "variants": variants}))
        return aotriton_rt.Library(folder)

    old, new = images(tmp_path / "old", ("causal_align",)), images(tmp_path / "new", ())
    lopsided = qkv(S=64, Sk=96)
    # Top-left (mode 1's band in both) and equal lengths (either band): both images serve.
    for lib in (old, new):
        assert op.attention_kernels(*lopsided, causal=True, library=lib)["attn_fwd"].params["CAUSAL"] == 1
        assert op.attention_kernels(*qkv(), causal=True, align="bottom_right", backward=True,
                                    library=lib)["attn_bwd_dq"].params["CAUSAL"] == 1
    # Bottom-right with unequal lengths: only a variant that takes causal_align.
    fwd = op.attention_kernels(*lopsided, causal=True, align="bottom_right", library=new)["attn_fwd"]
    assert fwd.params["CAUSAL"] == 1 and "causal_align" in fwd.arg_names
    backward = op.attention_kernels(*lopsided, causal=True, align="bottom_right", backward=True, library=new)
    assert {h.params.get("CAUSAL", 1) for h in backward.values()} == {1}
    with pytest.raises(KernelNotFound, match=r"bottom-right\) needs attn_fwd with .*CAUSAL=2.*which these images lack"):
        op.attention_kernels(*lopsided, causal=True, align="bottom_right", library=old)
    with pytest.raises(KernelNotFound, match=r"bottom-right\) needs attn_bwd_dkdv with .*CAUSAL=2"):
        op.attention_kernels(*lopsided, causal=True, align="bottom_right", backward=True, library=old)


def test_alibi_calls_on_images_without_the_axis_name_the_kernel_and_alibi_1(tmp_path: Path) -> None:
    spec = {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0,
            "SOFTCAP": 0}

    def images(folder: Path, axis: bool) -> aotriton_rt.Library:
        # Without the axis: images built before it (their kernels take no slopes either).
        folder.mkdir()
        alibi, without = ({"ALIBI": 0}, ()) if axis else ({}, ("alibi_slopes", "stride_az"))
        variants = [_synthetic_variant("attn_fwd", {**spec, **alibi}, without=without),
                    _synthetic_variant("attn_bwd_preprocess", {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64,
                                                               "VARLEN": 0, "DQ_ATOMIC": 0}),
                    _synthetic_variant("attn_bwd_dkdv", {**spec, **alibi, "DQ_ATOMIC": 0}, without=without),
                    _synthetic_variant("attn_bwd_dq", {**spec, **alibi}, without=without)]
        (folder / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                         "triton_version": "3.6.0", "variants": variants}))
        return aotriton_rt.Library(folder)

    old, new = images(tmp_path / "old", False), images(tmp_path / "new", True)
    for lib, alibi in ((old, {}), (new, {"ALIBI": 0})):  # calls without slopes run as before
        assert op.attention_kernels(*qkv(), library=lib)["attn_fwd"].params == {**spec, **alibi}
        assert op.attention_kernels(*qkv(), backward=True, library=lib)["attn_bwd_dq"].params == {**spec, **alibi}
    slopes = Dev(4, dtype="fp32")
    with pytest.raises(KernelNotFound, match=r"^attention \(fp16, head dim 64, no mask, ALiBi\) needs attn_fwd with "
                                             r"dtype=fp16, .*SOFTCAP=0, ALIBI=1, which these images lack .*'attn_fwd' "
                                             r"has no parameter 'ALIBI'"):
        op.attention_kernels(*qkv(), alibi_slopes=slopes, library=old)
    with pytest.raises(KernelNotFound, match=r"ALiBi\) needs attn_bwd_dkdv with .*ALIBI=1.*has no parameter 'ALIBI'"):
        op.attention_kernels(*qkv(), alibi_slopes=slopes, backward=True, library=old)
    # Images with the axis but not the variant (the default set): the variant, and what they hold.
    with pytest.raises(KernelNotFound, match=r"ALiBi\) needs attn_fwd with .*ALIBI=1, .*no variant of 'attn_fwd' "
                                             r"has ALIBI=1 \(these images have ALIBI 0\)"):
        op.attention_kernels(*qkv(), alibi_slopes=slopes, library=new)


def test_the_launch_values_carry_the_alignment_of_a_bottom_right_band() -> None:
    from aotriton_rt.ops.attention.problem import prepare

    opts = {"window": None, "bias": None, "dropout_p": 0.0, "seed": None, "offset": None, "scale": None,
            "cu_seqlens_q": None, "cu_seqlens_k": None, "max_seqlen_q": None, "max_seqlen_k": None, "layout": "bhsd"}
    aligns = {(causal, align): prepare(*qkv(S=64, Sk=96), causal=causal, align=align, **opts).scalars()["causal_align"]
              for causal in (True, False) for align in ("top_left", "bottom_right")}
    assert aligns == {(True, "top_left"): 0, (True, "bottom_right"): 1, (False, "top_left"): 0,
                      (False, "bottom_right"): 0}
    window = prepare(*qkv(S=64, Sk=96), causal=False, align="bottom_right", **{**opts, "window": (8, 8)})
    assert window.scalars()["causal_align"] == 1


def test_a_causal_align_other_than_0_or_1_is_refused_by_the_variant(tmp_path: Path) -> None:
    from aotriton_rt.arguments import Packer

    spec = {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 1, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0}
    (tmp_path / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                       "triton_version": "3.6.0",
                                                       "variants": [_synthetic_variant("attn_fwd", spec)]}))
    variant = aotriton_rt.Library(tmp_path).kernel("attn_fwd", **spec).candidates[0]
    names = [a.name for a in variant.args]
    values = [1 if n in ("batch", "num_heads_q", "num_heads_k") else 0 for n in names]
    packer = Packer(variant)
    packer.run_checks(values)  # causal_align 0
    values[names.index("causal_align")] = 2
    with pytest.raises(ArgumentError, match=r"^attn_fwd: causal_align=2 violates `causal_align == 0 or causal_align "
                                            r"== 1`"):
        packer.run_checks(values)


def test_library_dispatch_falls_back_to_the_split_backward_it_holds(synthetic: aotriton_rt.Library) -> None:
    kernels = op.attention_kernels(*qkv(), backward=True, library=synthetic)
    assert list(kernels) == ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    assert kernels["attn_bwd_dkdv"].params["DQ_ATOMIC"] == 0


def test_a_combination_the_images_lack_names_itself_and_the_build_command(synthetic: aotriton_rt.Library) -> None:
    with pytest.raises(KernelNotFound, match=r"attention \(fp16, head dim 64, causal/window top-left\) needs "
                                             r"attn_fwd with dtype=fp16, HEAD_DIM=64, HEAD_DIM_V=64, CAUSAL=1, .*"
                                             r"which these images lack \(or use a supported combination\): no variant "
                                             r"of 'attn_fwd' has CAUSAL=1 \(these images have CAUSAL 0, 2\); "
                                             r"`python -m builder build --set full --kernels attn_fwd --targets "
                                             r"<target> --add --out <image folder>`"):
        op.attention_kernels(*qkv(S=64, Sk=96), causal=True, library=synthetic)
    with pytest.raises(KernelNotFound, match=r"attention \(fp16, head dim 64, causal/window top-left\) needs "
                                             r"attn_bwd_dkdv with .*CAUSAL=2, DROPOUT=0, VARLEN=0, BIAS=0"):
        op.attention_kernels(*qkv(), causal=True, backward=True, library=synthetic)
    with pytest.raises(KernelNotFound, match=r"attention \(fp16, head dim 80, no mask\) needs attn_fwd with "
                                             r"dtype=fp16, HEAD_DIM=80"):
        op.attention_kernels(*qkv(D=80), library=synthetic)


def test_a_head_dim_below_the_images_bucket_runs_zero_padded_on_it(synthetic: aotriton_rt.Library) -> None:
    # The images hold head dim 64 only: 40 (bucket 48) runs on 64, forward and backward.
    kernels = op.attention_kernels(*qkv(D=40), backward=True, library=synthetic)
    assert {h.params["HEAD_DIM"] for h in kernels.values()} == {64}
    assert op.attention_kernels(*qkv(D=40), library=synthetic)["attn_fwd"].params["HEAD_DIM_V"] == 64


# ---------------------------------------------------------------------------------------------
# Validation: every refusal pinned; nothing is allocated or launched before it.
# ---------------------------------------------------------------------------------------------

def _fwd(*args: Any, **kw: Any) -> Any:
    return op.attention(*args, **kw)


REFUSALS = [
    ("layout", lambda: _fwd(*qkv(), layout="sbhd"), ArgumentError,
     r"layout must be 'bhsd' \(batch, heads, seqlen, head_dim\) or 'bshd' \(batch, seqlen, heads, head_dim\), "
     r"got 'sbhd'"),
    ("not_an_array", lambda: _fwd([1.0], *qkv()[1:]), ArgumentError, r"^q: cannot pass list as a GPU array"),
    ("int_dtype", lambda: _fwd(*qkv(dtype="i32")), UnsupportedError,
     r"q has dtype i32; attention supports fp16, bf16, fp32"),
    ("dtype_mismatch", lambda: _fwd(qkv()[0], Dev(2, 4, 64, 64, dtype="fp32"), qkv()[2]), ArgumentError,
     r"k has dtype fp32 but q has fp16; q, k, v \(and bias\) must share one dtype"),
    ("3d_dense", lambda: _fwd(Dev(4, 64, 64), *qkv()[1:]), ArgumentError,
     r"q must be 4-D \(batch, heads, seqlen, head_dim\) for layout='bhsd', got shape \(4, 64, 64\) \(packed "
     r"varlen arrays need cu_seqlens_q/k\)"),
    ("3d_bshd", lambda: _fwd(Dev(2, 64, 64), *qkv()[1:], layout="bshd"),
     ArgumentError, r"q must be 4-D \(batch, seqlen, heads, head_dim\) for layout='bshd'"),
    ("batch", lambda: _fwd(Dev(3, 4, 64, 64), *qkv()[1:]), ArgumentError, r"k has batch 2 but q has batch 3"),
    ("kv_len", lambda: _fwd(*qkv()[:2], Dev(2, 4, 65, 64)), ArgumentError,
     r"v has seqlen 65 but k has 64; k and v hold the same keys"),
    ("qk_dim", lambda: _fwd(Dev(2, 4, 64, 32), *qkv()[1:]), ArgumentError,
     r"k has head dim 64 but q has 32; q·k needs equal head dims \(v's may differ\)"),
    ("dim_too_big", lambda: _fwd(*qkv(D=520)), UnsupportedError,
     r"the q·k head dim 520 exceeds the largest supported head dim 512; supported: 1\.\.512 \(compiled buckets "
     r"16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 512; others are zero-padded\)"),
    ("v_dim_too_big", lambda: _fwd(*qkv()[:2], Dev(2, 4, 64, 1024)), UnsupportedError,
     r"the v head dim 1024 exceeds the largest supported head dim 512"),
    ("v_heads", lambda: _fwd(*qkv()[:2], Dev(2, 2, 64, 64)), ArgumentError,
     r"v has 2 heads but k has 4; k and v share their heads"),
    ("gqa_ratio", lambda: _fwd(*qkv(H=6, Hk=4)), ArgumentError,
     r"q has 6 heads, not a multiple of k's 4; grouped-query attention needs num_heads_q % num_heads_k == 0 "
     r"\(MQA: 1 key/value head\)"),
    ("grid", lambda: _fwd(*qkv(B=2000, H=40, S=16)), UnsupportedError,
     r"batch \* heads_q = 2000 \* 40 = 80000 exceeds 65535, the kernels' grid limit; split the batch into chunks "
     r"of at most 1638"),
    ("scale", lambda: _fwd(*qkv(), scale=float("nan")), ArgumentError, r"scale must be a finite number, got nan"),
    ("dropout_p", lambda: _fwd(*qkv(), dropout_p=1.0, seed=1), ArgumentError,
     r"dropout_p must be a number in \[0, 1\), got 1\.0"),
    ("dropout_seed", lambda: _fwd(*qkv(), dropout_p=0.1), ArgumentError,
     r"dropout_p=0\.1 needs seed= \(and offset=\): the backward must replay the forward's mask from the same "
     r"\(seed, offset\)"),
    ("seed_range", lambda: _fwd(*qkv(), dropout_p=0.1, seed=-1), ArgumentError,
     r"seed must be in \[0, 18446744073709551615\], got -1"),
    ("offset_type", lambda: _fwd(*qkv(), dropout_p=0.1, seed=1, offset=1.5), ArgumentError,
     r"offset must be an integer, got 1\.5"),
    ("return_mask", lambda: _fwd(*qkv(), return_mask=True), ArgumentError,
     r"return_mask=True returns the dropout mask, so it needs dropout_p > 0"),
    ("causal_type", lambda: _fwd(*qkv(), causal="bottom_right"), ArgumentError,
     r"causal must be True or False, got 'bottom_right'; choose the diagonal with align='top_left' or "
     r"'bottom_right'"),
    ("align", lambda: _fwd(*qkv(), causal=True, align="diagonal"), ArgumentError,
     r"align must be 'top_left' or 'bottom_right', got 'diagonal'"),
    ("window_value", lambda: _fwd(*qkv(), window=(3, -2)), ArgumentError,
     r"window must be \(left, right\), two integers >= -1 \(-1: unbounded\), got \(3, -2\)"),
    ("window_shape", lambda: _fwd(*qkv(), window=3), ArgumentError, r"window must be \(left, right\)"),
    ("causal_window", lambda: _fwd(*qkv(), causal=True, window=(8, 4)), ArgumentError,
     r"causal=True hides every key right of the diagonal, but window=\(8, 4\) asks for 4 keys there; pass "
     r"window=\(8, 0\) or causal=False"),
    ("bias_dtype", lambda: _fwd(*qkv(), bias=Dev(64, 64, dtype="fp32")), ArgumentError,
     r"bias has dtype fp32 but q has fp16"),
    ("bias_shape", lambda: _fwd(*qkv(), bias=Dev(3, 64, 64)), ArgumentError,
     r"bias of shape \(3, 64, 64\) does not broadcast to \(batch, heads_q, seqlen_q, seqlen_k\) = \(2, 4, 64, 64\)"),
    ("bias_5d", lambda: _fwd(*qkv(), bias=Dev(1, 2, 4, 64, 64)), ArgumentError,
     r"bias of shape \(1, 2, 4, 64, 64\) does not broadcast"),
    ("out_shape", lambda: _fwd(*qkv(), out=Dev(2, 4, 64, 32)), ArgumentError,
     r"out must have shape \(2, 4, 64, 64\) and dtype fp16, got \(2, 4, 64, 32\) fp16"),
    ("out_readonly", lambda: _fwd(*qkv(), out=Dev(2, 4, 64, 64, readonly=True)), ArgumentError,
     r"out is read-only; pass a writable array"),
    ("lse_dtype", lambda: _fwd(*qkv(), lse=Dev(2, 4, 64, dtype="fp16")), ArgumentError,
     r"lse must have shape \(2, 4, 64\) and dtype fp32, got \(2, 4, 64\) fp16"),
    ("one_cu", lambda: _fwd(Dev(100, 4, 64), Dev(100, 4, 64), Dev(100, 4, 64), cu_seqlens_q=Dev(3, dtype="i32")),
     ArgumentError, r"variable-length attention needs both cu_seqlens_q and cu_seqlens_k"),
    ("cu_dtype", lambda: _fwd(Dev(100, 4, 64), Dev(100, 4, 64), Dev(100, 4, 64),
                              cu_seqlens_q=Dev(3, dtype="i64"), cu_seqlens_k=Dev(3, dtype="i32")), ArgumentError,
     r"cu_seqlens_q must be int32, got i64; convert it, e\.g\. cu\.to\(torch\.int32\)"),
    ("cu_lengths", lambda: _fwd(Dev(100, 4, 64), Dev(100, 4, 64), Dev(100, 4, 64), cu_seqlens_q=Dev(3, dtype="i32"),
                                cu_seqlens_k=Dev(4, dtype="i32"), max_seqlen_q=50, max_seqlen_k=50), ArgumentError,
     r"cu_seqlens_q has 3 entries but cu_seqlens_k has 4; both are batch \+ 1 long"),
    ("cu_strided", lambda: _fwd(Dev(100, 4, 64), Dev(100, 4, 64), Dev(100, 4, 64),
                                cu_seqlens_q=Dev(3, dtype="i32", strides=(2,)), cu_seqlens_k=Dev(3, dtype="i32")),
     ArgumentError, r"cu_seqlens_q must be contiguous, got stride 2"),
    ("cu_short", lambda: _fwd(Dev(100, 4, 64), Dev(100, 4, 64), Dev(100, 4, 64), cu_seqlens_q=Dev(1, dtype="i32"),
                              cu_seqlens_k=Dev(1, dtype="i32")), ArgumentError,
     r"cu_seqlens_q must be 1-D with batch \+ 1 >= 2 entries, got shape \(1,\)"),
    ("varlen_4d", lambda: _fwd(*qkv(), cu_seqlens_q=Dev(3, dtype="i32"), cu_seqlens_k=Dev(3, dtype="i32")),
     ArgumentError, r"q must be 3-D \(total, heads, head_dim\) with cu_seqlens, got shape \(2, 4, 64, 64\)"),
    ("max_seqlen_dense", lambda: _fwd(*qkv(), max_seqlen_q=64), ArgumentError,
     r"max_seqlen_q/max_seqlen_k only apply with cu_seqlens_q/cu_seqlens_k"),
    ("max_seqlen_value", lambda: _fwd(Dev(100, 4, 64), Dev(100, 4, 64), Dev(100, 4, 64),
                                      cu_seqlens_q=Dev(3, dtype="i32"), cu_seqlens_k=Dev(3, dtype="i32"),
                                      max_seqlen_q=-5, max_seqlen_k=50), ArgumentError,
     r"max_seqlen_q must be in \[0, 2147483647\], got -5"),
    ("alibi_not_an_array", lambda: _fwd(*qkv(), alibi_slopes=[0.5] * 4), ArgumentError,
     r"^alibi_slopes: cannot pass list as a GPU array"),
    ("alibi_dtype", lambda: _fwd(*qkv(), alibi_slopes=Dev(4, dtype="fp16")), ArgumentError,
     r"alibi_slopes must be float32, got fp16; convert it, e\.g\. slopes\.float\(\)"),
    ("alibi_heads", lambda: _fwd(*qkv(), alibi_slopes=Dev(2, dtype="fp32")), ArgumentError,
     r"alibi_slopes must have shape \(4,\) \(a slope per query head\) or \(2, 4\) \(per sequence and query "
     r"head\), got \(2,\)"),
    ("alibi_batch", lambda: _fwd(*qkv(), alibi_slopes=Dev(3, 4, dtype="fp32")), ArgumentError,
     r"alibi_slopes must have shape \(4,\) .* or \(2, 4\) .*, got \(3, 4\)"),
    ("alibi_varlen_batch", lambda: _fwd(Dev(100, 4, 64), Dev(100, 4, 64), Dev(100, 4, 64),
                                        cu_seqlens_q=Dev(4, dtype="i32"), cu_seqlens_k=Dev(4, dtype="i32"),
                                        max_seqlen_q=50, max_seqlen_k=50, alibi_slopes=Dev(2, 4, dtype="fp32")),
     ArgumentError, r"alibi_slopes must have shape \(4,\) .* or \(3, 4\) .*, got \(2, 4\)"),
    ("alibi_strided", lambda: _fwd(*qkv(), alibi_slopes=Dev(2, 4, dtype="fp32", strides=(8, 2))), ArgumentError,
     r"alibi_slopes must be contiguous along the heads \(stride 1\), got stride 2; pass slopes\.contiguous\(\)"),
    ("alibi_with_bias", lambda: _fwd(*qkv(), bias=Dev(64, 64), alibi_slopes=Dev(4, dtype="fp32")), UnsupportedError,
     r"alibi_slopes with bias= is not compiled: the ALiBi kernels take no bias tensor; add the ALiBi term to the "
     r"bias instead \(-slope \* \|i \+ seqlen_k - seqlen_q - j\|\), or drop one"),
    ("alibi_with_softcap", lambda: _fwd(*qkv(), softcap=30.0, alibi_slopes=Dev(4, dtype="fp32")), UnsupportedError,
     r"alibi_slopes with softcap= is not compiled \(no model combines them\); drop one"),
]


@pytest.mark.parametrize("case", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_forward_refuses_malformed_calls_before_any_launch(case: tuple) -> None:
    call, exc, match = case
    with pytest.raises(exc, match=match):
        call()


def _bwd(**kw: Any) -> Any:
    q, k, v = qkv()
    args = {"dout": Dev(2, 4, 64, 64), "q": q, "k": k, "v": v, "out": Dev(2, 4, 64, 64),
            "lse": Dev(2, 4, 64, dtype="fp32")}
    args.update(kw)
    return op.attention_backward(args.pop("dout"), args.pop("q"), args.pop("k"), args.pop("v"), args.pop("out"),
                                 args.pop("lse"), **args)


@pytest.mark.parametrize("kw,match", [
    ({"dout": Dev(2, 4, 64, 32)}, r"dout must have shape \(2, 4, 64, 64\) and dtype fp16 \(the forward's output\), "
                                  r"got \(2, 4, 64, 32\) fp16"),
    ({"out": Dev(2, 4, 64, 64, dtype="fp32")}, r"out must have shape \(2, 4, 64, 64\) and dtype fp16"),
    ({"lse": Dev(2, 4, 64)}, r"lse must have shape \(2, 4, 64\) and dtype fp32 \(the forward's logsumexp\), got "
                             r"\(2, 4, 64\) fp16"),
    ({"deterministic": 1}, r"deterministic must be True or False, got 1"),
    ({"scheme": "fused"}, r"scheme must be None, 'split' or 'atomic', got 'fused'"),
    ({"dq": Dev(2, 4, 64, 64, dtype="fp32")}, r"dq must have shape \(2, 4, 64, 64\) and dtype fp16"),
    ({"dropout_p": 0.2}, r"dropout_p=0\.2 needs seed="),
    ({"alibi_slopes": Dev(2, 4, dtype="fp16")}, r"alibi_slopes must be float32, got fp16"),
])
def test_backward_refuses_malformed_calls_before_any_launch(kw: dict, match: str) -> None:
    with pytest.raises(ArgumentError, match=match):
        _bwd(**kw)


def test_backward_refuses_an_atomic_scheme_that_must_be_deterministic() -> None:
    with pytest.raises(UnsupportedError, match=r"scheme='atomic' sums dq with atomics and is not deterministic, "
                                               r"but reproducible results were asked for \(deterministic=True, .*; "
                                               r"use scheme='split' or leave scheme unset"):
        _bwd(scheme="atomic", deterministic=True)


@pytest.fixture
def two_devices():
    # CAI pointers at or above 0x2000_0000_0000 "live" on device 1.
    interop.set_pointer_device_resolver(lambda ptr: 1 if ptr >= 0x2000_0000_0000 else 0)
    yield
    interop.set_pointer_device_resolver(None)


def test_arrays_on_two_devices_are_refused(two_devices: None) -> None:
    q, k, v = Dev(2, 4, 64, 64, ptr=0x1000), Dev(2, 4, 64, 64, ptr=0x2000_0000_0000), Dev(2, 4, 64, 64, ptr=0x3000)
    with pytest.raises(ArgumentError, match=r"k is on device 1 but q is on device 0; every array must be on one GPU"):
        op.attention(q, k, v)
    with pytest.raises(ArgumentError, match=r"bias is on device 1 but q is on device 0"):
        op.attention(q, v, v, bias=Dev(64, 64, ptr=0x2000_0000_1000))
    with pytest.raises(ArgumentError, match=r"alibi_slopes is on device 1 but q is on device 0"):
        op.attention(q, v, v, alibi_slopes=Dev(4, dtype="fp32", ptr=0x2000_0000_2000))


# ---------------------------------------------------------------------------------------------
# torch: fake implementations and the import contract.
# ---------------------------------------------------------------------------------------------

def test_fake_forward_gives_the_real_output_shapes_for_every_layout() -> None:
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from aotriton_rt.ops import torch as op_torch

    with FakeTensorMode():
        q = torch.empty(2, 8, 33, 40, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 2, 50, 40, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(2, 2, 50, 24, dtype=torch.bfloat16, device="cuda")
        out, lse, mask = op_torch.attention(q, k, v, causal=True, dropout_p=0.1, seed=7, return_lse=True,
                                            return_mask=True)
        assert (out.shape, out.dtype, out.is_contiguous()) == ((2, 8, 33, 24), torch.bfloat16, True)
        assert (lse.shape, lse.dtype) == ((2, 8, 33), torch.float32)
        assert (mask.shape, mask.dtype) == ((2, 8, 33, 50), torch.int8)
        out, lse = op_torch.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bshd",
                                      return_lse=True)
        assert out.shape == (2, 33, 8, 24) and lse.shape == (2, 8, 33)
        packed = torch.empty(70, 8, 64, dtype=torch.float16, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        kv = torch.empty(70, 2, 64, dtype=torch.float16, device="cuda")
        out, lse, mask = op_torch.attention(packed, kv, kv, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                            max_seqlen_q=30, max_seqlen_k=30, dropout_p=0.5, seed=1,
                                            return_lse=True, return_mask=True)
        assert out.shape == (70, 8, 64) and lse.shape == (8, 70) and mask.shape == (3, 8, 30, 30)
        # ALiBi slopes change no shape, through the op and its schema's optional tensor.
        slopes = torch.empty(3, 8, device="cuda")
        out, lse = op_torch.attention(packed, kv, kv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=30,
                                      max_seqlen_k=30, alibi_slopes=slopes, return_lse=True)
        assert out.shape == (70, 8, 64) and lse.shape == (8, 70)


def test_fake_backward_gives_gradients_shaped_like_their_inputs() -> None:
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import aotriton_rt.ops.torch  # noqa: F401 - registers the ops

    with FakeTensorMode():
        q = torch.empty(2, 8, 33, 40, device="cuda").transpose(1, 2)
        k = torch.empty(2, 2, 50, 40, device="cuda").transpose(1, 2)
        v = torch.empty(2, 2, 50, 24, device="cuda").transpose(1, 2)
        out = torch.empty(2, 33, 8, 24, device="cuda")
        lse = torch.empty(2, 8, 33, device="cuda")
        bias = torch.empty(8, 1, 50, device="cuda")
        sinks = torch.empty(8, device="cuda", dtype=torch.bfloat16)
        dq, dk, dv, dbias, dsinks = torch.ops.aotriton_rt.attention_bwd(
            out, q, k, v, out, lse, bias, sinks, None, None, -1, -1, False, -1, -1, "top_left", 0.0, 0, 0, 0.1,
            "bshd", False, True, 0)
        assert (dq.shape, dk.shape, dv.shape, dbias.shape) == ((2, 33, 8, 40), (2, 50, 2, 40), (2, 50, 2, 24),
                                                               (8, 1, 50))
        assert (dsinks.shape, dsinks.dtype) == ((8,), torch.bfloat16)
        assert dq.is_contiguous() and dk.is_contiguous()
        *_, none, no_sinks = torch.ops.aotriton_rt.attention_bwd(
            out, q, k, v, out, lse, bias, None, None, None, -1, -1, False, -1, -1, "top_left", 0.0, 0, 0, 0.1,
            "bshd", False, False, 0)
        assert none.shape == (0,) and no_sinks.shape == (0,)
        grads = torch.ops.aotriton_rt.attention_bwd(
            out, q, k, v, out, lse, None, None, None, None, -1, -1, True, -1, -1, "top_left", 0.0, 0, 0, 0.1,
            "bshd", False, False, 0, 0.0, torch.empty(2, 8, device="cuda"))
        assert [g.shape for g in grads[:3]] == [(2, 33, 8, 40), (2, 50, 2, 40), (2, 50, 2, 24)]


def test_operator_modules_import_no_framework_and_the_package_maps_its_names() -> None:
    probe = ("import sys, aotriton_rt, aotriton_rt.ops.attention as m\n"
             "assert aotriton_rt.attention is m.attention and aotriton_rt.attention_backward is m.attention_backward\n"
             "print(sorted(x for x in sys.modules if x.split('.')[0] in ('torch', 'cupy', 'jax', 'triton', 'numpy')))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# The GPU matrix (tests/runtime/test_attention_gpu.py) against the gputest build set.
# ---------------------------------------------------------------------------------------------

class _Recorder:
    """A library that hands out the parameters it is asked for."""

    tuning: dict = {}

    def __init__(self) -> None:
        self.asked: list[tuple[str, dict]] = []

    def kernel(self, name: str, **params: Any) -> dict:
        self.asked.append((name, params))
        return params


def test_every_kernel_the_gpu_matrix_dispatches_is_in_the_gputest_set(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = pytest.importorskip("tests.runtime.test_attention_gpu")
    from builder.kernels._attention_sets import in_gputest_set
    from builder.registry import load_kernels
    from builder.targets import KNOWN

    decls = load_kernels()
    for name in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"):
        assert decls[name].sets["gputest"] is in_gputest_set
    # The preprocess's set adds the atomic scheme of the sm90 Gluon dK/dV (in_sm90_gluon_atomic_set):
    # a superset of in_gputest_set, which the dispatch below is checked against.
    from builder.registry import expand
    from builder.targets import parse_targets

    targets = parse_targets("sm80,sm90")
    pre = decls["attn_bwd_preprocess"]
    assert all(pre.sets["gputest"](j.spec, j.target) for j in expand(pre, targets, "full", "3.6.0")
               if in_gputest_set(j.spec, j.target))
    now = {"atomic": False, "dtype": "fp16", "hide": None}
    from aotriton_rt.ops.attention import dispatch

    arch_kernels = set(dispatch_arch_kernels())

    def in_gputest(lib: Any, name: str, params: dict) -> bool:
        # Dispatch chooses among what the gputest set holds, as on the GPU: the portable kernels
        # only (the matrix also runs them where the sm90 forward or dK/dV would serve: see
        # test_attention_gpu's portable cases), mask mode 2 hidden for the MODE_ONE runs.
        params = {**params, "dtype": now["dtype"]}
        decl = decls[name]
        return (name not in arch_kernels and (now["atomic"] or name != "attn_bwd_dq_convert")
                and (now["hide"] is None or params.get("CAUSAL") != now["hide"])
                and not (decl.exclude and decl.exclude(params, KNOWN["sm90"]))
                and in_gputest_set(params, KNOWN["sm90"]))

    monkeypatch.setattr(dispatch, "_available", in_gputest)
    monkeypatch.setattr(dispatch, "_takes", lambda lib, name, params, args: all(a in decls[name].signature
                                                                                for a in args))
    missing = []
    runs = [(name, case, None) for name, case in {**gpu.MATRIX, **gpu.STANDALONE}.items()]
    runs += [(f"{name} (mode 1)", gpu.MATRIX[name], 2) for name in gpu.MODE_ONE]
    for name, case, hide in runs:
        pl = gpu.plan(case)
        now.update(dtype=pl.dtype, hide=hide)
        dtype = pl.dtype if pl.dtype != "bf16" else "fp16"  # CAI has no bf16; the spec's dtype is patched below
        arrays = [Dev(*shape, dtype=dtype) for shape in (pl.q, pl.k, pl.v)]
        opts = dict(pl.options)
        if pl.bias is not None:
            opts["bias"] = Dev(*pl.bias, dtype=dtype)
        if pl.varlen:
            cu_q = Dev(len(pl.lens_q) + 1, dtype="i32")
            opts.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_q if case.get("self_cu") else Dev(len(pl.lens_k) + 1,
                                                                                            dtype="i32"))
        rec = _Recorder()
        now["atomic"] = bool(case.get("atomic"))
        for mask in ((False, True) if case.get("dropout") else (False,)):
            op.attention_kernels(*arrays, **opts, return_mask=mask, library=rec)
        op.attention_kernels(*arrays, **opts, backward=True, **pl.backward, library=rec)
        if case.get("atomic"):
            assert "attn_bwd_dq_convert" in [n for n, _ in rec.asked], f"{name}: the atomic scheme was not chosen"
        for kernel, params in rec.asked:
            params = {**params, "dtype": pl.dtype}
            if not in_gputest(rec, kernel, params):
                missing.append(f"{name}: {kernel}[{params}]")
        if hide is not None:
            assert {p["CAUSAL"] for _, p in rec.asked if "CAUSAL" in p} == {1}, f"{name}: not on mode 1"
    assert not missing, "kernels the GPU matrix needs but the gputest set lacks:\n" + "\n".join(missing)


# ---------------------------------------------------------------------------------------------
# End to end under the interpreter.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return run_sharded(__file__, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_operator_runs_the_real_kernels_and_matches_fp64_under_the_interpreter(interpreted: dict, name: str) -> None:
    result = interpreted[name]
    assert not result["failed"], f"{name}: {result['failed']} (errors {result['errors']})"
    expected = {"out"} if CASES[name].get("api") == "opcheck" else {"out", "lse", "dq", "dk", "dv"}
    if CASES[name].get("bias"):
        expected.add("dbias")
    assert expected <= set(result["errors"]), f"{name}: not every output was compared"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _main(sys.argv[1:])
