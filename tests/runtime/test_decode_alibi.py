"""ALiBi slopes and attention sinks in the decode kernels, on the CPU.

- Under Triton's interpreter (subprocesses): the operator's real argument lists drive the real
  kernels of ``builder/kernels/decode.py`` on CPU tensors against an fp64 reference (query row
  ``i`` at key position ``i + len_k - Sq``, score ``-= slope * |i + len_k - Sq - j|``; the sink
  joined to each row's softmax with no value): slopes per head and per sequence, GQA tiles (each
  row its own head's slope), contiguous and paged caches with small pages, one split and several
  (merged by the combine kernel, which joins the sink), windows, left padding, a chunk of 16
  query rows, appends; a sink of -inf leaves its head's rows bit for bit as without sinks; ALiBi
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
from aotriton_rt.ops import decode as op
from tests.helpers.interpreter import patch_interpreter, report_cases, run_sharded
from tests.runtime.test_decode_op import LAUNCHES

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


def _library(old: bool) -> Any:
    from tests.runtime.test_decode_op import _Library

    lib = _Library()
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
    lib = _library(c.get("old", False))
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


if __name__ == "__main__":
    _main(sys.argv[1:])
