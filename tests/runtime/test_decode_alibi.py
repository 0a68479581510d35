"""ALiBi slopes and attention sinks in the decode kernels, on the CPU.

- Under Triton's interpreter (subprocesses): the operator's real argument lists drive the real
  kernels of ``builder/kernels/decode.py`` on CPU tensors against an fp64 reference (query row
  ``i`` at key position ``i + len_k - Sq``, score ``-= slope * |i + len_k - Sq - j|``; the sink
  joined to each row's softmax with no value): slopes per head and per sequence, GQA tiles (each
  row its own head's slope), contiguous and paged caches with small pages, one split and several
  (merged by the combine kernel, which joins the sink), windows, left padding, a chunk of 16
  query rows, appends; 128-row chunks through the variable-length forward's ALiBi variant (left
  padded) or, without one, on the decode kernels; a sink of -inf leaves its head's rows bit for
  bit as without sinks; ALiBi
  and sinks together; the ``attn_sinks`` pass for images whose kernels predate the arguments;
  ``aotriton_rt.attention``'s route to the decode kernels with slopes and sinks (no pass), and to
  the ALiBi forward where the decode kernels predate the slopes.
- Without the interpreter: typed refusals, the launch arguments of first and prepared calls, the
  plan key, images built before the arguments, the torch op's schema.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest

import aotriton_rt
from aotriton_rt import ArgumentError, KernelNotFound, UnsupportedError
from aotriton_rt.ops import decode as op
from tests.helpers.interpreter import patch_interpreter, report_cases, run_sharded
from tests.runtime.test_decode_op import LAUNCHES, Dev, _dec, _decode_arrays

#: Interpreter cases (defaults in run_case). ``alibi``: "head" ``(Hq,)`` or "batch" ``(B, Hq)``
#: slopes; ``sinks``: True (a logit per head, head ``minus_inf`` at -inf); ``old``: the images'
#: decode kernels predate the arguments (they get a handle without them).
CASES: dict[str, dict] = {
    "alibi_per_head_gqa_three_splits": {"alibi": "head", "Hq": 8, "Hk": 2, "splits": 3},
    "alibi_per_sequence_one_split_fp16": {"alibi": "batch", "dtype": "fp16", "splits": 1, "Hq": 4, "Hk": 1},
    "alibi_paged_16_in_blocks_of_64_chunk_causal_append": {"alibi": "batch", "paged": 16, "block_n": 64, "Sq": 3,
                                                           "new": 2, "causal": True, "lens": (37, 1, 16, 0, 80),
                                                           "splits": 2, "Hq": 8, "Hk": 2},
    "alibi_pages_of_48_window_left_padding": {"alibi": "head", "paged": 48, "block_n": 64, "Sq": 2, "causal": True,
                                              "window": (30, 0), "lens": (100, 47, 60), "leftpad": (20, 0, 59),
                                              "splits": 2, "cap": 144},
    "alibi_sixteen_row_chunk_taller_than_a_tile_bf16": {"alibi": "head", "Sq": 16, "Hq": 8, "Hk": 2, "causal": True,
                                                        "lens": (40, 60, 20), "splits": 2, "dtype": "bf16"},
    "alibi_window_both_sides_no_causal": {"alibi": "batch", "Sq": 3, "window": (5, 1), "splits": 1},
    "sinks_one_split_minus_inf_head_bit_for_bit": {"sinks": True, "minus_inf": 1, "splits": 1, "Hq": 4, "Hk": 2,
                                                   "lens": (37, 0, 80)},
    "sinks_splits_combine_minus_inf_head_bit_for_bit_paged": {"sinks": True, "minus_inf": 5, "splits": 3,
                                                              "paged": 16, "Hq": 8, "Hk": 2, "Sq": 2,
                                                              "causal": True, "lens": (37, 1, 16, 0)},
    "sinks_fp16_sinks_bf16_queries_window": {"sinks": True, "sinks_dtype": "fp16", "dtype": "bf16", "Sq": 2,
                                             "causal": True, "window": (9, 0), "splits": 2},
    "sinks_and_alibi_paged_splits": {"sinks": True, "alibi": "head", "paged": 16, "block_n": 64, "Sq": 2,
                                     "causal": True, "lens": (70, 5, 33), "splits": 2, "Hq": 8, "Hk": 2},
    "sinks_and_alibi_one_split_left_padding": {"sinks": True, "alibi": "batch", "leftpad": (10, 0, 40), "Sq": 2,
                                               "causal": True, "splits": 1},
    "sinks_on_images_before_the_arguments_run_the_pass": {"sinks": True, "old": True, "splits": 2, "Hq": 8,
                                                          "Hk": 2},
    "repeated_call_with_new_slopes_and_sinks_takes_the_plan": {"sinks": True, "alibi": "head", "splits": 2,
                                                               "repeat": True},
    # A chunk of 128 rows: through the variable-length forward (its ALIBI=1 variant, which joins the
    # sinks too), or on the decode kernels where the images' forward has no ALiBi.
    "alibi_and_sinks_128_rows_left_padded_through_the_varlen_forward": {
        "alibi": "batch", "sinks": True, "Sq": 128, "Hq": 2, "Hk": 1, "paged": 16, "new": 5, "causal": True,
        "lens": (150, 30), "leftpad": (40, 3), "cap": 160, "routed": True},
    "alibi_128_rows_on_the_decode_kernels_without_an_alibi_forward": {
        "alibi": "head", "sinks": True, "Sq": 128, "Hq": 2, "Hk": 1, "causal": True, "lens": (0, 30), "new": 128,
        "cap": 160, "splits": 2, "routed": False, "no_alibi_forward": True},
    # aotriton_rt.attention with 3 query rows: the decode kernels serve ALiBi and sinks (no pass);
    # images whose decode kernels predate the slopes leave the call to the ALIBI=1 forward.
    "attention_routes_alibi_and_sinks_to_the_decode_kernels": {"api": "attention", "alibi": "batch", "sinks": True},
    "attention_alibi_on_old_decode_images_runs_the_forward": {"api": "attention", "alibi": "head", "old": True},
}

#: The decode kernels' ALiBi and sinks arguments (stripped from "old" images' handles).
NEW_ARGS = ("alibi_slopes", "stride_az", "use_alibi", "Sinks", "use_sinks")


class _OldHandle:
    """A decode handle as images built before the arguments hold it: without them in its argument
    list (the runtime then passes none); it launches the source with them at their neutral values."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.decl, self.constexprs = inner, inner.decl, inner.constexprs
        self.arg_names = [n for n in inner.arg_names if n not in NEW_ARGS]

    def variant(self, device: int = 0) -> Any:
        return self.inner.variant(device)

    def __call__(self, *args: Any) -> None:
        given = dict(zip(self.arg_names, args, strict=True))
        full = {"alibi_slopes": None, "stride_az": 0, "use_alibi": 0, "Sinks": None, "use_sinks": 0, **given}
        self.inner(*[full[n] for n in self.inner.arg_names])


def _library(old: bool, no_alibi_forward: bool = False) -> Any:
    from tests.runtime.test_decode_op import _Library

    lib = _Library((lambda name, spec: not (name == "attn_fwd" and spec.get("ALIBI"))) if no_alibi_forward else None)
    if old:
        made, listed = lib.kernel, lib.variants_of

        def kernel(name: str, **params: Any) -> Any:
            handle = made(name, **params)
            return _OldHandle(handle) if name in ("attn_decode", "attn_decode_combine") else handle

        def variants_of(name: str) -> list:
            found = listed(name)
            for v in found if name in ("attn_decode", "attn_decode_combine") else ():
                v.args = [a for a in v.args if a.name not in NEW_ARGS]
            return found

        lib.kernel, lib.variants_of = kernel, variants_of
    return lib


def _slopes(c: dict, B: int, Hq: int, gen: Any) -> Any:
    """Slopes of the size that bends the answer (ALiBi's own are 2**-8h/H; here 0.05-0.5)."""
    import torch

    if not c.get("alibi"):
        return None
    per_head = torch.rand(Hq, generator=gen) * 0.45 + 0.05
    if c["alibi"] == "head":
        return per_head
    return (per_head[None, :] * torch.linspace(0.5, 1.5, B)[:, None]).contiguous()


def _sinks(c: dict, Hq: int, gen: Any) -> Any:
    import torch

    if not c.get("sinks"):
        return None
    s = torch.randn(Hq, generator=gen) * 2 + 1
    if "minus_inf" in c:
        s[c["minus_inf"]] = float("-inf")
    return s.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[c.get("sinks_dtype", "fp32")])


def run_case(name: str, case: dict) -> dict:
    import torch

    from tests.runtime.test_decode_op import BLOCK_N, fp64_reference

    c = {"Hq": 4, "Hk": 2, "Sq": 1, "D": 32, "dtype": "fp32", "cap": 80, "lens": (37, 0, 80), "paged": 0, "new": 0,
         "causal": False, "window": None, "splits": None, **case}
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[c["dtype"]]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    lens = list(c["lens"])
    B, Hq, Hk, Sq, D, new = len(lens), c["Hq"], c["Hk"], c["Sq"], c["D"], c["new"]
    total = [n + new for n in lens]
    cap = max(c["cap"], max(total))
    keys = [torch.randn(n, Hk, D, generator=gen).to(dtype) for n in total]
    vals = [torch.randn(n, Hk, D, generator=gen).to(dtype) for n in total]
    q = torch.randn(B, Sq, Hq, D, generator=gen).to(dtype)
    nan = float("nan")
    if c["paged"]:
        ps = c["paged"]
        num_pages = sum(-(-n // ps) for n in total) + 5
        perm = iter(torch.randperm(num_pages, generator=gen).tolist())
        table = torch.full((B, -(-cap // ps)), -7, dtype=torch.int32)
        k_cache = torch.full((num_pages, ps, Hk, D), nan, dtype=dtype)
        v_cache = torch.full((num_pages, ps, Hk, D), nan, dtype=dtype)
        starts = c.get("leftpad", (0,) * B)
        for b, n in enumerate(total):
            for j in range(-(-n // ps)):
                table[b, j] = next(perm) if (j + 1) * ps > starts[b] else -9  # pages before the start: unmapped
            for r in range(starts[b], lens[b]):
                k_cache[table[b, r // ps], r % ps] = keys[b][r]
                v_cache[table[b, r // ps], r % ps] = vals[b][r]
    else:
        table = None
        k_cache = torch.full((B, cap, Hk, D), nan, dtype=dtype)
        v_cache = torch.full((B, cap, Hk, D), nan, dtype=dtype)
        for b in range(B):
            first = c["leftpad"][b] if c.get("leftpad") else 0
            k_cache[b, first:lens[b]] = keys[b][first:lens[b]]
            v_cache[b, first:lens[b]] = vals[b][first:lens[b]]
    k_new = v_new = None
    if new:
        k_new = torch.stack([keys[b][lens[b]:] for b in range(B)])
        v_new = torch.stack([vals[b][lens[b]:] for b in range(B)])
    seqlens = torch.tensor(lens, dtype=torch.int32)
    leftpad = torch.tensor(c["leftpad"], dtype=torch.int32) if c.get("leftpad") else None
    slopes, sinks = _slopes(c, B, Hq, gen), _sinks(c, Hq, gen)
    LAUNCHES.clear()
    BLOCK_N[0] = c.get("block_n", 16)
    lib = _library(c.get("old", False), c.get("no_alibi_forward", False))
    _FORWARD_SPECS.clear()
    kw = {"cache_seqlens": seqlens, "block_table": table, "causal": c["causal"], "window": c["window"],
          "num_splits": c["splits"], "cache_leftpad": leftpad, "library": lib}
    out, lse = op.decode_attention(q, k_cache, v_cache, k_new=k_new, v_new=v_new, alibi_slopes=slopes, sinks=sinks,
                                   check=True, **kw)
    launched = [n for n, _ in LAUNCHES]
    errors: dict[str, float] = {}
    failed: list[str] = []
    if sinks is not None and ("attn_sinks" in launched) != bool(c.get("old")):
        failed.append(f"launches {launched}: the attn_sinks pass {'expected' if c.get('old') else 'ran'}")
    if c["splits"] is not None and ("attn_decode_combine" in launched) != (c["splits"] > 1):
        failed.append(f"launches {launched} for {c['splits']} splits")
    if "routed" in c:
        if c["routed"] != ("attn_decode_pack" in launched):
            failed.append(f"launches {launched}: the variable-length route {'not ' if c['routed'] else ''}expected")
        if c["routed"] and [spec.get("ALIBI") for _, spec in _FORWARD_SPECS] != [1]:
            failed.append(f"the variable-length forward ran as {_FORWARD_SPECS}, expected ALIBI=1")
    tol = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 4e-2}[c["dtype"]]
    left, right = c["window"] if c["window"] else (-1, -1)
    if c["causal"]:
        right = 0
    for b in range(B):
        first = c["leftpad"][b] if c.get("leftpad") else 0
        per_seq = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        ref, ref_lse = fp64_reference(q[b], keys[b], vals[b], Hq // Hk, 1 / math.sqrt(D), left, right, first,
                                      alibi=per_seq, sinks=sinks)
        if per_seq is not None and total[b] - first > 1:  # the case proves something only where ALiBi bends it
            plain = fp64_reference(q[b], keys[b], vals[b], Hq // Hk, 1 / math.sqrt(D), left, right, first,
                                   sinks=sinks)[0]
            errors[f"bent{b}"] = bent = (plain - ref).abs().max().item()
            if not bent > 10 * tol:
                failed.append(f"ALiBi bends sequence {b}'s answer by only {bent}")
        errors[f"out{b}"] = err = (out[b].double() - ref).abs().max().item()
        if not err <= tol:
            failed.append(f"out[{b}] (length {total[b]}) error {err}")
        gl = lse[b].double()
        both_inf = torch.isinf(gl) & torch.isinf(ref_lse) & (gl.sign() == ref_lse.sign())
        errors[f"lse{b}"] = lerr = torch.where(both_inf, 0.0, (gl - ref_lse).abs()).max().item()
        if not lerr <= tol * 10:
            failed.append(f"lse[{b}] error {lerr}")
    if "minus_inf" in c:  # that head's rows: bit for bit the call without sinks
        plain_out, plain_lse = op.decode_attention(q, k_cache, v_cache, alibi_slopes=slopes, check=True, **{
            **kw, "cache_seqlens": torch.tensor(total, dtype=torch.int32)})
        h = c["minus_inf"]
        if not (torch.equal(out[:, :, h], plain_out[:, :, h]) and torch.equal(lse[:, h], plain_lse[:, h])):
            failed.append(f"head {h}'s sink of -inf changed its rows")
        others = [x for x in range(Hq) if x != h]
        if torch.equal(out[:, :, others], plain_out[:, :, others]):
            failed.append("the other heads' sinks changed nothing: the case proves nothing")
    if c.get("repeat"):  # the kept plan reads each call's slopes and sinks
        op._kernels_of(lib).launches.clear()
        for factor in (1.0, 2.0):
            again, again_lse = op.decode_attention(q, k_cache, v_cache, alibi_slopes=slopes * factor,
                                                   sinks=sinks + factor, check=False, **kw)
            for b in range(B):
                ref, ref_lse = fp64_reference(q[b], keys[b], vals[b], Hq // Hk, 1 / math.sqrt(D), left, right,
                                              alibi=slopes * factor, sinks=sinks + factor)
                errors[f"repeat{factor}_{b}"] = err = (again[b].double() - ref).abs().max().item()
                if not err <= tol:
                    failed.append(f"a repeated call with slopes * {factor}, sinks + {factor}: error {err}")
        if len(op._kernels_of(lib).launches) != 1:
            failed.append(f"{len(op._kernels_of(lib).launches)} plans for calls differing in slope and sink values")
    if new:
        for b in range(B):
            for r in range(lens[b], total[b]):
                got = k_cache[table[b, r // c["paged"]], r % c["paged"]] if table is not None else k_cache[b, r]
                if not torch.equal(got, keys[b][r]):
                    failed.append(f"appended row {r} of sequence {b} is not in the cache")
    return {"errors": errors, "failed": failed, "launches": LAUNCHES[:]}


def run_attention_case(name: str, case: dict) -> dict:
    """``aotriton_rt.attention`` on a decode-shaped call (bottom-right causal, GQA, bshd) with ALiBi
    slopes (and sinks): which kernels ran, and the answer against fp64."""
    import torch

    from tests.runtime.test_decode_op import fp64_reference

    B, Hq, Hk, Sq, Sk, D = 2, 8, 2, 3, 45, 32
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    q = torch.randn(B, Sq, Hq, D, generator=gen)
    k, v = torch.randn(B, Sk, Hk, D, generator=gen), torch.randn(B, Sk, Hk, D, generator=gen)
    slopes, sinks = _slopes(case, B, Hq, gen), _sinks(case, Hq, gen)
    lib = _library(case.get("old", False))
    LAUNCHES.clear()
    out, lse = aotriton_rt.attention(q, k, v, causal=True, align="bottom_right", layout="bshd", alibi_slopes=slopes,
                                     sinks=sinks, library=lib)
    failed: list[str] = []
    ran = [n for n, _ in LAUNCHES]
    want = ["attn_fwd"] if case.get("old") else ["attn_decode"]
    if [n for n in ran if n != "attn_decode_combine"] != want:
        failed.append(f"launches {ran}, expected {want}")
    if case.get("old"):
        ran_alibi = [spec.get("ALIBI") for n, spec in _FORWARD_SPECS]
        if ran_alibi != [1]:
            failed.append(f"the forward ran with ALIBI {ran_alibi}")
    errors: dict[str, float] = {}
    for b in range(B):
        per_seq = slopes if slopes.dim() == 1 else slopes[b]
        ref, ref_lse = fp64_reference(q[b], k[b], v[b], Hq // Hk, D ** -0.5, -1, 0, alibi=per_seq, sinks=sinks)
        errors[f"out{b}"] = err = (out[b].double() - ref).abs().max().item()
        errors[f"lse{b}"] = lerr = (lse[b].double() - ref_lse).abs().max().item()
        if not (err <= 1e-4 and lerr <= 1e-3):
            failed.append(f"sequence {b}: out error {err}, lse error {lerr}")
    return {"errors": errors, "failed": failed, "launches": LAUNCHES[:]}


#: (kernel, spec) of the attention forward's launches in a child (run_attention_case).
_FORWARD_SPECS: list = []


def _main(names: list[str]) -> None:
    from aotriton_rt import interop
    from tests.helpers.cpu_arrays import cpu_describer
    from tests.runtime.test_decode_op import _Handle, _install_cpu

    patch_interpreter()
    _install_cpu()
    # The sinks' and the route's own look at the arrays (aotriton_rt.interop.describe).
    real = interop.describe
    cpu = cpu_describer(lambda obj, name: real(obj))
    interop.describe = lambda obj, **kw: cpu(obj, "")
    call = _Handle.__call__

    def recording(self: Any, *args: Any) -> None:
        if self.decl.name == "attn_fwd":
            _FORWARD_SPECS.append((self.decl.name, self.spec))
        call(self, *args)

    _Handle.__call__ = recording
    report_cases(names, lambda name: (run_attention_case if CASES[name].get("api") == "attention" else run_case)(
        name, CASES[name]))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return run_sharded(__file__, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_decode_with_alibi_and_sinks_runs_the_real_kernels_and_matches_fp64(interpreted: dict, name: str) -> None:
    result = interpreted[name]
    assert not result["failed"], f"{name}: {result['failed']}"
    assert any(k.startswith("out") for k in result["errors"])


# ---------------------------------------------------------------------------------------------
# Without the interpreter: refusals, launch arguments, older images, explain, the torch op.
# ---------------------------------------------------------------------------------------------

REFUSALS = [
    ("slopes_fp16", {"alibi_slopes": Dev(8, dtype="fp16")}, ArgumentError,
     r"alibi_slopes must be float32, got fp16; convert it, e\.g\. slopes\.float\(\)"),
    ("slopes_shape", {"alibi_slopes": Dev(3, 8, dtype="fp32")}, ArgumentError,
     r"alibi_slopes must have shape \(8,\) \(a slope per query head\) or \(2, 8\) \(per sequence and query "
     r"head\), got \(3, 8\)"),
    ("slopes_strided_heads", {"alibi_slopes": Dev(2, 8, dtype="fp32", strides=(1, 2))}, ArgumentError,
     r"alibi_slopes must be contiguous along the heads \(stride 1\), got stride 2"),
    ("slopes_with_softcap", {"alibi_slopes": Dev(8, dtype="fp32"), "softcap": 30.0}, UnsupportedError,
     r"alibi_slopes with softcap= is not compiled \(no model combines them\); drop one"),
    ("slopes_with_a_zero_scale", {"alibi_slopes": Dev(8, dtype="fp32"), "scale": 0.0}, ArgumentError,
     r"alibi_slopes needs a non-zero scale"),
    ("sinks_shape", {"sinks": Dev(4, dtype="fp32")}, ArgumentError,
     r"sinks must have shape \(8,\): one logit per query head, got \(4,\)"),
    ("sinks_dtype", {"sinks": Dev(8, dtype="i32")}, ArgumentError, r"sinks must be fp16, bf16 or fp32, got i32"),
]


@pytest.mark.parametrize("case", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_decode_refuses_malformed_slopes_and_sinks_before_any_launch(case: tuple) -> None:
    kw, exc, match = case
    with pytest.raises(exc, match=match):
        _dec(**kw)


def _recording(monkeypatch: pytest.MonkeyPatch, old: bool = False) -> Any:
    """CPU torch tensors stand for device 0 arrays; the kernels record their launches (first calls
    by handle, repeated ones prepared). ``old``: images whose decode and combine kernels predate
    the ALiBi and sinks arguments (neither their variants nor their handles have them)."""
    from aotriton_rt import interop
    from aotriton_rt.ops.decode import validate
    from tests.helpers.cpu_arrays import cpu_describer
    from tests.runtime.test_decode_op import _AddressHandle, _Library

    monkeypatch.setattr(validate, "_describe", cpu_describer(validate._describe))
    real = interop.describe
    cpu = cpu_describer(lambda obj, name: real(obj))
    monkeypatch.setattr(interop, "describe", lambda obj, **kw: cpu(obj, ""))
    monkeypatch.setattr(validate, "_host_lengths", lambda obj: None)
    monkeypatch.setattr(interop, "stream_getter", lambda framework: (lambda device: 0x77))
    lib = _Library()
    listed = lib.variants_of

    def kernel(name: str, **params: Any) -> Any:
        handle = _AddressHandle(lib.decls[name], params)
        if old and name in ("attn_decode", "attn_decode_combine"):
            handle.arg_names = [n for n in handle.arg_names if n not in NEW_ARGS]
        return handle

    def variants_of(name: str) -> list:
        found = listed(name)
        for v in found if old and name in ("attn_decode", "attn_decode_combine") else ():
            v.args = [a for a in v.args if a.name not in NEW_ARGS]
        return found

    monkeypatch.setattr(lib, "kernel", kernel)
    monkeypatch.setattr(lib, "variants_of", variants_of)
    op._kernels_of(lib).launches.clear()
    LAUNCHES.clear()
    return lib


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("splits", [1, 2])
def test_slopes_and_sinks_reach_the_kernels_on_first_and_repeated_calls(monkeypatch: pytest.MonkeyPatch,
                                                                       paged: bool, splits: int) -> None:
    import torch

    lib = _recording(monkeypatch)
    a = _decode_arrays(paged)
    slopes = [torch.rand(2, 8), torch.rand(2, 8)]  # per sequence: batch stride 8
    sinks = torch.randn(8)
    for s in slopes:
        op.decode_attention(**a, alibi_slopes=s, sinks=sinks, num_splits=splits, causal=True, check=False,
                            library=lib)
    decode = [(how, args) for how, name, args in LAUNCHES if name == "attn_decode"]
    assert [how for how, _ in decode] == ["call", "prepared"]
    for (_, args), s in zip(decode, slopes):
        assert (args["alibi_slopes"], args["stride_az"], args["use_alibi"]) == (s.data_ptr(), 8, 1)
        assert (args["Sinks"], args["use_sinks"]) == (sinks.data_ptr(), 1)
    combine = [args for _, name, args in LAUNCHES if name == "attn_decode_combine"]
    assert len(combine) == (2 if splits > 1 else 0)
    assert all((args["Sinks"], args["use_sinks"]) == (sinks.data_ptr(), 1) for args in combine)
    assert "attn_sinks" not in [name for _, name, _ in LAUNCHES]  # joined by the kernels: no pass
    # Without either: their switches off, nothing read; another plan (the key has both arrays).
    LAUNCHES.clear()
    op.decode_attention(**a, num_splits=splits, causal=True, check=False, library=lib)
    (args,) = [args for _, name, args in LAUNCHES if name == "attn_decode"]
    assert (args["alibi_slopes"], args["use_alibi"], args["Sinks"], args["use_sinks"]) == (0, 0, 0, 0)
    assert len(op._kernels_of(lib).launches) == 2


def test_fp16_sinks_are_passed_as_fp32_and_slopes_per_head_have_no_batch_stride(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    lib = _recording(monkeypatch)
    a = _decode_arrays(False)
    sinks, slopes = torch.randn(8).half(), torch.rand(8)
    for _ in range(2):
        op.decode_attention(**a, alibi_slopes=slopes, sinks=sinks, num_splits=1, check=False, library=lib)
    decode = [args for _, name, args in LAUNCHES if name == "attn_decode"]
    assert len(decode) == 2
    for args in decode:
        assert args["stride_az"] == 0 and args["alibi_slopes"] == slopes.data_ptr()
        assert args["Sinks"] not in (0, sinks.data_ptr())  # a converted fp32 copy, made per call


def test_images_before_the_arguments_refuse_slopes_and_run_the_sinks_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    lib = _recording(monkeypatch, old=True)
    a = _decode_arrays(True)
    refusal = (r"alibi_slopes needs attn_decode with ALiBi arguments \(alibi_slopes, stride_az, use_alibi\); these "
               r"images were built before them \(dtype=fp16, HEAD_DIM=64, PAGED=1, PADDED_D=0, KV_DTYPE=fp16\): "
               r"rebuild them \(`python -m builder build --kernels attn_decode,attn_decode_combine`\)")
    for _ in range(2):  # refused again: a refused call keeps no plan
        with pytest.raises(KernelNotFound, match=refusal):
            op.decode_attention(**a, alibi_slopes=torch.rand(8), check=False, library=lib)
    assert not LAUNCHES and not op._kernels_of(lib).launches
    sinks = torch.randn(8)
    for _ in range(2):
        op.decode_attention(**a, sinks=sinks, num_splits=2, check=False, library=lib)
    ran = [(how, name) for how, name, _ in LAUNCHES]
    assert ran == [("call", "attn_decode"), ("call", "attn_decode_combine"), ("call", "attn_sinks"),
                   ("prepared", "attn_decode"), ("prepared", "attn_decode_combine"), ("call", "attn_sinks")], ran


def test_the_express_route_takes_slopes_only_where_the_decode_kernel_does(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from aotriton_rt.ops.decode import route_options

    q, k = torch.randn(2, 8, 1, 64).half(), torch.randn(2, 2, 300, 64).half()
    call = {"causal": True, "window": None, "align": "bottom_right", "bias": None, "dropout_p": 0.0, "scale": None,
            "cu_seqlens_q": None, "cu_seqlens_k": None, "layout": "bhsd", "out": None, "lse": None,
            "return_mask": False}
    slopes = torch.rand(2, 8)
    current = _recording(monkeypatch)
    opts = route_options(q, k, k, **call, library=current, alibi_slopes=slopes)
    assert opts is not None and "alibi_slopes" not in opts  # an array: passed per call
    assert route_options(q, k, k, **call, library=current, alibi_slopes=slopes.half()) is None  # attention() refuses
    old = _recording(monkeypatch, old=True)
    assert route_options(q, k, k, **call, library=old, alibi_slopes=slopes) is None  # the ALIBI=1 forward serves it
    assert route_options(q, k, k, **call, library=old) is not None


def test_explain_decode_says_who_joins_the_sinks_and_asks_for_alibi_variants(tmp_path: Any) -> None:
    """``explain decode`` over synthetic sm90 catalogs: with sinks, the decode kernel's epilogue
    (one split) or the combine (several) joins them; on images built before the arguments the
    attn_sinks pass does, and an ALiBi call is refused naming what it needs."""
    import subprocess

    from aotriton_rt.ops.decode.explain import explain
    from tests.helpers.interpreter import ROOT
    from tests.runtime.test_attention_op import _synthetic_variant
    from tests.runtime.test_decode_fp8 import _catalog

    base = {"dtype": "bf16", "HEAD_DIM": 128}
    decode = {**base, "PAGED": 0, "PADDED_D": 0, "KV_DTYPE": "bf16"}
    combine = {**base, "PADDED_D": 0}
    sinks = [_synthetic_variant("attn_sinks", {"dtype": "bf16", "ALIGNED": a}) for a in (0, 1)]
    new = _catalog(tmp_path / "new", [_synthetic_variant("attn_decode", decode),
                                      _synthetic_variant("attn_decode_combine", combine)])
    old = _catalog(tmp_path / "old", [_synthetic_variant("attn_decode", decode, without=NEW_ARGS),
                                      _synthetic_variant("attn_decode_combine", combine, without=NEW_ARGS), *sinks])
    one = str(explain(dtype="bf16", head_dim=128, seqlen_k=8192, batch=64, sinks=True, alibi=True, arch="sm90",
                      library=new))
    assert one.splitlines()[0].endswith("8192 keys, ALiBi slopes, sinks"), one
    assert "1 split(s)" in one and one.splitlines()[1].endswith("joins the attention sinks in its epilogue"), one
    split = str(explain(dtype="bf16", head_dim=128, seqlen_k=8192, batch=2, sinks=True, arch="sm90", library=new))
    assert "13 split(s)" in split and split.splitlines()[-1].endswith("merges the 13 splits and joins the attention "
                                                                      "sinks"), split
    before = str(explain(dtype="bf16", head_dim=128, seqlen_k=8192, batch=2, sinks=True, arch="sm90", library=old))
    assert before.splitlines()[-1].startswith("  attn_sinks[dtype=bf16, ALIGNED=1] config #0"), before
    assert before.splitlines()[-1].endswith("joins the attention sinks to (out, lse): the decode variants predate "
                                            "them"), before
    with pytest.raises(KernelNotFound, match=r"needs attn_decode with dtype=bf16, HEAD_DIM=128, PAGED=0, PADDED_D=0, "
                                             r"KV_DTYPE=bf16 taking alibi_slopes, use_alibi on sm90"):
        explain(dtype="bf16", head_dim=128, seqlen_k=8192, alibi=True, arch="sm90", library=old)
    with pytest.raises(UnsupportedError, match=r"alibi_slopes with softcap= is not compiled"):
        explain(dtype="bf16", head_dim=128, seqlen_k=8192, alibi=True, softcap=True, arch="sm90", library=new)
    cli = subprocess.run([sys.executable, "-m", "aotriton_rt", "explain", "decode", "--images", str(tmp_path / "new"),
                          "--arch", "sm90", "--dtype", "bf16", "--seqlen", "1", "--seqlen-k", "8192", "--batch", "64",
                          "--alibi", "--sinks"], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == one


def test_the_torch_ops_take_the_slopes_after_the_sinks_and_refuse_them_with_a_softcap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from aotriton_rt.ops import torch_decode

    for name in ("decode_attention", "decode_attention_append"):
        schema = str(getattr(torch.ops.aotriton_rt, name).default._schema)
        assert "Tensor? sinks, Tensor? alibi_slopes, Tensor? k_scale" in schema, schema
    seen: list = []

    def operator(q: Any, k: Any, v: Any, **kw: Any) -> tuple:
        seen.append((kw["alibi_slopes"], kw["sinks"], kw["k_new"] is not None))
        b, s, h, _ = q.shape
        return q * 2, torch.zeros(b, h, s)

    monkeypatch.setattr(torch_decode._core, "decode_attention", operator)
    q, k = torch.randn(2, 1, 8, 64).half(), torch.randn(2, 64, 2, 64).half()
    kn = torch.randn(2, 1, 2, 64).half()
    lens = torch.tensor([3, 40], dtype=torch.int32)
    slopes, sinks = torch.rand(8), torch.randn(8)
    torch_decode.decode_attention(q, k, k, cache_seqlens=lens, alibi_slopes=slopes, sinks=sinks)
    torch_decode.decode_attention(q, k, k, cache_seqlens=lens, k_new=kn, v_new=kn, alibi_slopes=slopes)
    assert [(a is slopes, s is sinks, new) for a, s, new in seen] == [(True, True, False), (True, False, True)]
    with pytest.raises(UnsupportedError, match=r"alibi_slopes with softcap= is not compiled"):
        torch_decode.decode_attention(q, k, k, cache_seqlens=lens, alibi_slopes=slopes, softcap=30.0)
    torch.library.opcheck(torch_decode.decode_attention_op,
                          (q, k, k, lens, -1, None, None, sinks, slopes, None, None, 0.0, 0.0, True, -1, 0, 0.125, 0.0,
                           0, -1, "bshd", "bshd", 0),
                          test_utils=("test_schema", "test_faketensor"))


if __name__ == "__main__":
    _main(sys.argv[1:])
