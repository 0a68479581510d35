"""Decode attention without a GPU.

- End to end under Triton's interpreter (subprocesses, ``TRITON_INTERPRET=1``): the operator's
  real argument lists drive the real kernels of ``builder/kernels/decode.py`` on CPU tensors,
  compared with an fp64 reference: contiguous and paged caches, random block tables, pages the
  sequences do not reference filled with NaN, ``cache_seqlens`` 0, 1 and not multiples of the
  page, appends that cross page boundaries, 1..16 query rows, GQA tiles taller than one block,
  causal, sliding windows, several splits merged by the combine kernel; the logit softcap
  (``c * tanh(s / c)``, through ``decode_attention`` and through ``aotriton_rt.attention``'s
  route to the decode kernels, which images built before the decode softcap leave to the forward).
- Refusals before any launch (arrays are ``__cuda_array_interface__`` descriptions of memory
  that is never touched): lengths past what the cache or block table can address, page sizes
  that are not multiples of 16, softcaps that are negative or not finite, and the debug-mode
  checks of device lengths and block tables.
- The softcap's launch argument and plan key, and images built before it (``KernelNotFound``
  for a capped call, an uncapped one runs).
- The split rule and its catalog overrides as pure functions.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

import aotriton_rt
from aotriton_rt import ArgumentError, CatalogError, UnsupportedError
from aotriton_rt.ops import decode as op
from aotriton_rt.ops.decode import SplitRule, num_splits_for, split_rule
from tests.helpers.interpreter import patch_interpreter, report_cases, run_sharded

ROOT = Path(__file__).resolve().parents[2]

# Defaults: B=3, Hq=4, Hk=2, Sq=1, D=32, fp32, contiguous cache of 80 rows, lengths (37, 0, 80).
CASES: dict[str, dict] = {
    "contiguous_one_split": {"splits": 1},
    "contiguous_three_splits_gqa": {"splits": 3, "Hq": 8, "Hk": 2},
    "contiguous_bhsd_cache_fp16": {"cache_layout": "bhsd", "dtype": "fp16", "splits": 2},
    "lengths_zero_and_one_bf16": {"lens": (0, 1, 17), "dtype": "bf16", "splits": 2},
    "paged_random_table_nan_pages": {"paged": 16, "lens": (37, 1, 16, 0), "splits": 3},
    "paged_32_rows_speculative_causal": {"paged": 32, "Sq": 4, "causal": True, "lens": (45, 70, 5), "splits": 2},
    "paged_append_across_page_boundaries": {"paged": 16, "new": 3, "lens": (14, 16, 31, 0), "Sq": 3,
                                            "causal": True, "splits": 2},
    "contiguous_append_one_row": {"new": 1, "lens": (20, 0, 79), "causal": True, "splits": 4},
    "sixteen_rows_group_of_four_taller_than_a_tile": {"Sq": 16, "Hq": 8, "Hk": 2, "causal": True,
                                                      "lens": (40, 60, 20), "splits": 2},
    "sliding_window_paged": {"paged": 16, "Sq": 2, "causal": True, "window": (9, 0), "lens": (50, 7, 33),
                             "splits": 3},
    "window_both_sides_no_causal": {"Sq": 3, "window": (5, 1), "splits": 1},
    "head_dim_80_split_rule_default": {"D": 80, "Hq": 2, "Hk": 1, "dtype": "fp16"},
    "mqa_all_heads_one_tile": {"Hq": 6, "Hk": 1, "Sq": 2, "causal": True, "paged": 16, "splits": 2},
    # A repeated call takes the cached launch plan (no checks, no planning) and computes the same.
    "repeated_call_takes_the_cached_plan": {"paged": 16, "lens": (37, 1, 16), "splits": 2, "repeat": True},
    # Key blocks against pages (block_n: the kernel's BLOCK_N): pages smaller than a block (one
    # table entry per 16-row chunk), pages a multiple of the block (one entry per block), pages
    # that neither divide nor are divided by the block; lengths ending mid-chunk and mid-page.
    "pages_of_16_in_blocks_of_64": {"paged": 16, "block_n": 64, "lens": (37, 1, 16, 0, 80), "causal": True,
                                    "splits": 2},
    "pages_of_32_in_blocks_of_64_append": {"paged": 32, "block_n": 64, "new": 2, "lens": (62, 30, 0, 95),
                                           "Sq": 2, "causal": True, "splits": 2, "cap": 128},
    # Pages that are no multiple of the block, 16-row chunks walked from the block's first row
    # (one division per block): page edges inside the block after any chunk, blocks that start
    # mid-page (row 16 or 32 of a 48-row page, row 64 of an 80-row one).
    "pages_of_48_in_blocks_of_64_edges_after_any_chunk": {"paged": 48, "block_n": 64, "lens": (191, 100, 47, 49),
                                                          "causal": True, "splits": 3},
    "pages_of_80_in_blocks_of_64_blocks_start_mid_page": {"paged": 80, "block_n": 64, "new": 1, "Sq": 2,
                                                          "lens": (159, 64, 80, 0), "causal": True, "splits": 2},
    "pages_of_48_in_blocks_of_32_window": {"paged": 48, "block_n": 32, "lens": (50, 95, 47, 1), "Sq": 3,
                                           "causal": True, "window": (40, 0), "splits": 3, "cap": 144},
    "pages_of_64_one_per_block_append_at_the_page_edge": {"paged": 64, "block_n": 64, "new": 2,
                                                          "lens": (62, 63, 0, 126), "splits": 2, "cap": 192},
    "pages_of_256_gqa_taller_than_a_tile": {"paged": 256, "block_n": 64, "Hq": 8, "Hk": 1, "Sq": 3,
                                            "lens": (300, 5, 256), "causal": True, "splits": 4, "cap": 512},
    # Seven splits (merged four at a time, the last step partly past the end), some without keys.
    "seven_splits_some_empty": {"splits": 7, "lens": (80, 3, 64), "Hq": 8, "Hk": 2, "Sq": 2, "causal": True},
    # Splits of paged caches and of GQA tiles under a two-sided window, merged by the combine kernel.
    "paged_splits_some_empty": {"paged": 16, "lens": (37, 1, 16, 0), "splits": 3},
    "gqa_window_splits": {"Sq": 2, "Hq": 8, "Hk": 2, "window": (30, 3), "lens": (70, 12, 45), "splits": 4},
    # Logit softcap: caps of about the scores' size (q.k * scale ~ N(0, 1) here, scaled up by
    # "amp"), so tanh bends every score; split partials merged by the combine kernel.
    "softcap_contiguous_gqa_splits": {"softcap": 1.5, "amp": 2.0, "Hq": 8, "Hk": 2, "splits": 3},
    "softcap_paged_16_speculative_causal_append_fp16": {"softcap": 2.0, "amp": 2.0, "paged": 16, "Sq": 4,
                                                       "new": 3, "causal": True, "lens": (14, 45, 0),
                                                       "dtype": "fp16", "splits": 2},
    "softcap_pages_of_48_in_blocks_of_64_window_bf16": {"softcap": 1.0, "amp": 3.0, "paged": 48, "block_n": 64,
                                                       "Sq": 3, "causal": True, "window": (40, 0),
                                                       "lens": (191, 47, 100), "dtype": "bf16", "splits": 2,
                                                       "cap": 192},
    "softcap_scale_negative_no_mask": {"softcap": 0.75, "scale": -0.3, "Sq": 2, "lens": (37, 1, 80), "splits": 2},
    "softcap_repeated_call_takes_the_cached_plan": {"softcap": 1.5, "paged": 16, "lens": (37, 1, 16), "splits": 2,
                                                    "repeat": True},
    # aotriton_rt.attention with a softcap and a few query rows: the decode kernels serve it (the
    # express route), or, in images whose decode kernel predates the cap, the SOFTCAP=1 forward.
    "attention_routes_a_softcapped_decode_step": {"api": "attention", "softcap": 1.5, "Sq": 3, "Sk": 45},
    "attention_softcap_on_old_decode_images_runs_the_forward": {"api": "attention", "softcap": 1.5, "Sq": 3,
                                                                "Sk": 45, "old": True},
}


# ---------------------------------------------------------------------------------------------
# Interpreter side (subprocess).
# ---------------------------------------------------------------------------------------------

class _Handle:
    """A kernel handle that launches the Triton source like a compiled variant (checks, grid)."""

    def __init__(self, decl: Any, spec: dict) -> None:
        from builder.registry import _constexpr_defaults, _divisibility, _resolve_signature, constexprs_of
        from builder.targets import KNOWN

        self.decl, self.spec = decl, spec
        config = decl.configs_for(spec, KNOWN["sm90"])[0]
        self.constexprs = constexprs_of(decl.signature, spec, config, _constexpr_defaults(decl))
        if "BLOCK_N" in self.constexprs:
            self.constexprs["BLOCK_N"] = BLOCK_N[0]  # 16 by default: short sequences span several blocks
        if "PDL" in self.constexprs:
            self.constexprs["PDL"] = 0  # griddepcontrol is PTX: the interpreter runs launches in order
        self.signature = _resolve_signature(decl, spec)
        self.divisibility = _divisibility(decl, self.signature, spec)
        self.checks = decl.checks_for(spec)
        self.arg_names = [n for n, t in self.signature.items() if t != "constexpr"]

    def variant(self, device: int = 0) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(config=SimpleNamespace(constexprs={k: v for k, v in self.constexprs.items()
                                                                  if k.startswith("BLOCK")}))

    def __call__(self, *args: Any) -> None:
        import torch

        from aotriton_rt.arguments import compile_expr

        values = dict(zip(self.arg_names, args, strict=True))
        for name, value in values.items():
            t = self.signature[name]
            if t.startswith("*"):
                if value is None:
                    values[name] = torch.empty(0, dtype=torch.float32 if "fp" in t else torch.int32)
                    continue
                div = self.divisibility.get(name, 1)
                assert value.data_ptr() % div == 0, f"{self.decl.name}.{name} misaligned for {div}"
            else:
                div = self.divisibility.get(name)
                assert not div or value % div == 0, f"{self.decl.name}.{name}={value} not a multiple of {div}"
        names = list(values)
        vals = [0 if self.signature[n].startswith("*") else values[n] for n in names]
        for check in self.checks:
            assert compile_expr(check, names, self.constexprs, "check")(*vals), f"{self.decl.name}: {check}"
        grid = tuple(compile_expr(g, names, self.constexprs, "grid")(*vals) for g in self.decl.grid)
        LAUNCHES.append((self.decl.name, grid))
        self.decl.fn[grid](*values.values(), **self.constexprs)


LAUNCHES: list = []
BLOCK_N = [16]


class _Library:
    """Images holding every decode variant of the sources (``held``: only the specs it accepts)."""

    def __init__(self, held: Any = None) -> None:
        from types import SimpleNamespace

        from builder.registry import load_kernels

        self.decls = load_kernels()
        self.tuning: dict = {}
        self.held = held or (lambda name, spec: True)
        self.variants = [SimpleNamespace(target=SimpleNamespace(backend="cuda", arch="sm90"))]

    def targets(self) -> list[tuple[str, str]]:
        return sorted({(v.target.backend, v.target.arch) for v in self.variants})

    def variants_of(self, name: str) -> list:
        """One stand-in catalog variant per spec of ``name`` the images hold (for selection)."""
        import itertools
        from types import SimpleNamespace

        decl = self.decls[name]
        axes = list(decl.axes)
        specs = [dict(zip(axes, values)) for values in itertools.product(*decl.axes.values())]
        # The arguments this checkout's source declares (images built before one lack it).
        args = [SimpleNamespace(name=n) for n, t in decl.signature.items() if t != "constexpr"]
        return [SimpleNamespace(kernel=name, target=SimpleNamespace(backend="cuda", arch="sm90"), params=spec,
                                config=SimpleNamespace(num_warps=4, num_stages=1, index=0), key=str(spec), args=args)
                for spec in specs if self.held(name, spec)]

    def kernel(self, name: str, **params: Any) -> _Handle:
        return _Handle(self.decls[name], params)


def _install_cpu() -> None:


    from aotriton_rt.ops.attention import problem
    from aotriton_rt.ops.decode import validate
    from tests.helpers.cpu_arrays import cpu_describer

    validate._describe = cpu_describer(validate._describe)
    problem._describe = cpu_describer(problem._describe)  # long runs go through the varlen forward
    validate._host_lengths = lambda obj: None  # CPU tensors stand for device arrays here


def fp64_reference(q: Any, keys: Any, vals: Any, group: int, scale: float, left: int, right: int,
                   start: int = 0, softcap: float = 0.0, alibi: Any = None, sinks: Any = None) -> tuple[Any, Any]:
    """One sequence's decode attention in fp64: q ``(Sq, Hq, D)`` against its cache rows ``keys``
    / ``vals`` ``(n, Hk, D)``, of which rows from ``start`` on are its keys; the queries are the
    last ``Sq`` rows (bottom-right), ``left``/``right`` the window (-1: unbounded); ``softcap``
    (0: none) makes the scores ``softcap * tanh(s / softcap)`` before the mask; ``alibi`` (None or
    the ``(Hq,)`` slopes) adds ``-slope * |i + n - Sq - j|``; ``sinks`` (None or ``(Hq,)`` logits)
    joins each row's softmax with no value (gpt-oss). Returns ``(out (Sq, Hq, D), lse (Hq, Sq))``:
    rows that see no key give 0 and -inf (with a sink: 0 and the sink's logit)."""
    import torch

    sq, n = q.shape[0], keys.shape[0]
    kk = keys[start:].double().transpose(0, 1).repeat_interleave(group, 0)  # (Hq, n - start, D)
    vv = vals[start:].double().transpose(0, 1).repeat_interleave(group, 0)
    s = q.double().transpose(0, 1) @ kk.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    rel = torch.arange(start, n)[None, :] - torch.arange(sq)[:, None] - (n - sq)
    if alibi is not None:
        s = s - alibi.double()[:, None, None] * rel.abs().double()[None]
    vis = torch.ones(sq, n - start, dtype=torch.bool)
    if left >= 0:
        vis &= rel >= -left
    if right >= 0:
        vis &= rel <= right
    s = s.masked_fill(~vis, float("-inf"))
    row_ok = vis.any(-1)
    s_safe = torch.where(row_ok[:, None], s, 0.0)
    ref = ((torch.softmax(s_safe, -1) * row_ok[:, None]) @ vv).transpose(0, 1)
    lse = torch.where(row_ok, torch.logsumexp(s_safe, -1), float("-inf"))
    if sinks is not None:
        joined = torch.logaddexp(lse, sinks.double()[:, None])  # (Hq, Sq)
        factor = torch.where(lse == float("-inf"), 0.0, torch.exp(lse - joined))
        return ref * factor.transpose(0, 1)[..., None], joined
    return ref, lse


def run_case(name: str, case: dict) -> dict:
    import torch

    c = {"B": 3, "Hq": 4, "Hk": 2, "Sq": 1, "D": 32, "dtype": "fp32", "cap": 80, "lens": (37, 0, 80),
         "paged": 0, "new": 0, "causal": False, "window": None, "cache_layout": "bshd", "splits": None, **case}
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[c["dtype"]]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    lens = list(c["lens"])
    B, Hq, Hk, Sq, D, new = len(lens), c["Hq"], c["Hk"], c["Sq"], c["D"], c["new"]
    total = [n + new for n in lens]
    cap = max(c["cap"], max(total))

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    # The logical sequences: keys/values of every row each sequence will hold after the append.
    keys = [randn(n, Hk, D) for n in total]
    vals = [randn(n, Hk, D) for n in total]
    q = (torch.randn(B, Sq, Hq, D, generator=gen) * c.get("amp", 1.0)).to(dtype)
    nan = float("nan")
    if c["paged"]:
        ps = c["paged"]
        max_blocks = -(-cap // ps)
        pages_needed = sum(-(-n // ps) for n in total)
        num_pages = pages_needed + 5
        perm = torch.randperm(num_pages, generator=gen).tolist()
        table = torch.full((B, max_blocks), -7, dtype=torch.int32)  # unreferenced entries: invalid pages
        k_cache = torch.full((num_pages, ps, Hk, D), nan, dtype=dtype)
        v_cache = torch.full((num_pages, ps, Hk, D), nan, dtype=dtype)
        it = iter(perm)
        for b, n in enumerate(total):
            for j in range(-(-n // ps)):
                table[b, j] = next(it)
            for r in range(lens[b]):  # only the cached rows; the new ones come through the append
                k_cache[table[b, r // ps], r % ps] = keys[b][r]
                v_cache[table[b, r // ps], r % ps] = vals[b][r]
    else:
        table = None
        k_cache = torch.full((B, cap, Hk, D), nan, dtype=dtype)
        v_cache = torch.full((B, cap, Hk, D), nan, dtype=dtype)
        for b in range(B):
            k_cache[b, :lens[b]] = keys[b][:lens[b]]
            v_cache[b, :lens[b]] = vals[b][:lens[b]]
        if c["cache_layout"] == "bhsd":
            k_cache = k_cache.transpose(1, 2).contiguous()
            v_cache = v_cache.transpose(1, 2).contiguous()
    k_new = v_new = None
    if new:
        k_new = torch.stack([keys[b][lens[b]:] for b in range(B)])
        v_new = torch.stack([vals[b][lens[b]:] for b in range(B)])
    seqlens = torch.tensor(lens, dtype=torch.int32)
    LAUNCHES.clear()
    BLOCK_N[0] = c.get("block_n", 16)
    lib = _Library()
    softcap, scale = c.get("softcap", 0.0), c.get("scale")
    out, lse = op.decode_attention(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, k_new=k_new,
                                   v_new=v_new, causal=c["causal"], window=c["window"], num_splits=c["splits"],
                                   cache_layout=c["cache_layout"], scale=scale, softcap=softcap, check=True,
                                   library=lib)
    errors: dict[str, float] = {}
    failed: list[str] = []
    if c.get("repeat"):
        op._kernels_of(lib).launches.clear()
        again = [op.decode_attention(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                     causal=c["causal"], num_splits=c["splits"], softcap=softcap, check=False,
                                     library=lib)
                 for _ in range(2)]
        if len(op._kernels_of(lib).launches) != 1:
            failed.append(f"{len(op._kernels_of(lib).launches)} cached launch plans after two equal calls")
        for o2, l2 in again:
            if not (torch.equal(o2, out) and torch.equal(l2, lse)):
                failed.append("a repeated call computed something else")
        if softcap:  # the same call without the cap: another plan, another answer
            plain, _ = op.decode_attention(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                           causal=c["causal"], num_splits=c["splits"], check=False, library=lib)
            if len(op._kernels_of(lib).launches) != 2 or torch.equal(plain, out):
                failed.append("a call without the softcap took the capped call's plan")
    tol = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 4e-2}[c["dtype"]]
    scale = 1 / math.sqrt(D) if scale is None else scale
    left, right = c["window"] if c["window"] else (-1, -1)
    if c["causal"]:
        right = 0
    group = Hq // Hk
    for b in range(B):
        n = total[b]
        ref, ref_lse = fp64_reference(q[b], keys[b], vals[b], group, scale, left, right, softcap=softcap)
        if softcap and n > 1:  # (one key takes all the weight, capped or not)
            uncapped, _ = fp64_reference(q[b], keys[b], vals[b], group, scale, left, right)
            bent = (uncapped - ref).abs().max().item()
            errors[f"bent{b}"] = bent
            if not bent > 10 * tol:
                failed.append(f"the cap bends sequence {b}'s answer by only {bent}: the case would prove nothing")
        got = out[b].double()
        err = (got - ref).abs().max().item() if n else got.abs().max().item()
        errors[f"out{b}"] = err
        if not err <= tol:
            failed.append(f"out[{b}] (length {n}) error {err}")
        gl = lse[b].double()
        both_inf = torch.isinf(gl) & torch.isinf(ref_lse)
        lerr = torch.where(both_inf, 0.0, (gl - ref_lse).abs()).max().item()
        errors[f"lse{b}"] = lerr
        if not lerr <= tol * 10:
            failed.append(f"lse[{b}] error {lerr}")
    if new:
        # The cache now holds the appended rows where the block table (or the batch) says.
        for b in range(B):
            for r in range(lens[b], total[b]):
                if table is not None:
                    got_k = k_cache[table[b, r // c["paged"]], r % c["paged"]]
                else:
                    got_k = k_cache[b, r]
                if not torch.equal(got_k, keys[b][r]):
                    failed.append(f"appended row {r} of sequence {b} is not in the cache")
    kernels = [name for name, _ in LAUNCHES]
    if softcap and "attn_decode" not in kernels:
        failed.append(f"launches {kernels}: the decode kernel did not run")
    want_combine = (c["splits"] or 1) > 1
    if c["splits"] is not None and want_combine != ("attn_decode_combine" in kernels):
        failed.append(f"launches {kernels} for {c['splits']} splits")
    if new and "attn_decode_append" not in kernels:
        failed.append("no append launched")
    return {"name": name, "errors": errors, "failed": failed, "launches": LAUNCHES[:]}


def run_attention_case(name: str, case: dict) -> dict:
    """``aotriton_rt.attention`` on a decode-shaped softcapped call (bottom-right causal, GQA, bshd):
    which kernels ran, and the answer against fp64."""
    import torch

    c = {"B": 2, "Hq": 8, "Hk": 2, "D": 32, **case}
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    B, Hq, Hk, Sq, Sk, D = c["B"], c["Hq"], c["Hk"], c["Sq"], c["Sk"], c["D"]
    q = torch.randn(B, Sq, Hq, D, generator=gen) * 2
    k, v = torch.randn(B, Sk, Hk, D, generator=gen), torch.randn(B, Sk, Hk, D, generator=gen)
    lib = _Library()
    if c.get("old"):  # attn_decode variants without the softcap argument
        listed = lib.variants_of

        def variants_of(kname: str) -> list:
            found = listed(kname)
            for variant in found if kname == "attn_decode" else ():
                variant.args = [a for a in variant.args if a.name != "softcap"]
            return found

        lib.variants_of = variants_of
    from aotriton_rt import interop
    from tests.helpers.cpu_arrays import cpu_describer

    LAUNCHES.clear()
    real = interop.describe
    cpu = cpu_describer(lambda obj, name: real(obj))
    interop.describe = lambda obj, **kw: cpu(obj, "")  # the route's own look at the arrays
    try:
        out, lse = aotriton_rt.attention(q, k, v, causal=True, align="bottom_right", layout="bshd",
                                         softcap=c["softcap"], library=lib)
    finally:
        interop.describe = real
    failed: list[str] = []
    ran = [n for n, _ in LAUNCHES]
    want = ["attn_fwd"] if c.get("old") else ["attn_decode"]
    if [n for n in ran if n != "attn_decode_combine"] != want:
        failed.append(f"launches {ran}, expected {want}")
    errors: dict[str, float] = {}
    for b in range(B):
        ref, ref_lse = fp64_reference(q[b], k[b], v[b], Hq // Hk, D ** -0.5, -1, 0, softcap=c["softcap"])
        errors[f"out{b}"] = err = (out[b].double() - ref).abs().max().item()
        errors[f"lse{b}"] = lerr = (lse[b].double() - ref_lse).abs().max().item()
        if not (err <= 1e-4 and lerr <= 1e-3):
            failed.append(f"sequence {b}: out error {err}, lse error {lerr}")
    return {"errors": errors, "failed": failed, "launches": LAUNCHES[:]}


def _main(names: list[str]) -> None:
    patch_interpreter()
    _install_cpu()
    report_cases(names, lambda name: (run_attention_case if CASES[name].get("api") == "attention" else run_case)(
        name, CASES[name]))


# ---------------------------------------------------------------------------------------------
# Test side.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return run_sharded(__file__, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_decode_operator_runs_the_real_kernels_and_matches_fp64_under_the_interpreter(interpreted: dict,
                                                                                       name: str) -> None:
    result = interpreted[name]
    assert not result["failed"], f"{name}: {result['failed']}"
    assert any(k.startswith("out") for k in result["errors"])


_TYPESTR = {"fp16": ("<f2", 2), "fp32": ("<f4", 4), "i32": ("<i4", 4), "i64": ("<i8", 8)}


class Dev:
    """A GPU array as ``__cuda_array_interface__`` describes it; its memory is never read."""

    def __init__(self, *shape: int, dtype: str = "fp16", strides: tuple[int, ...] | None = None,
                 ptr: int = 0x7F00_0000_0000) -> None:
        typestr, size = _TYPESTR[dtype]
        self._cai = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3,
                     "strides": None if strides is None else tuple(x * size for x in strides)}

    @property
    def __cuda_array_interface__(self) -> dict:
        return self._cai


def _dec(q: Any = None, k: Any = None, v: Any = None, **kw: Any) -> Any:
    q = q if q is not None else Dev(2, 1, 8, 64)
    k = k if k is not None else Dev(2, 256, 2, 64)
    v = v if v is not None else Dev(*k._cai["shape"], dtype=_dtype_of(k))
    return op.decode_attention(q, k, v, **kw)


def _dtype_of(d: Dev) -> str:
    return {v[0]: k for k, v in _TYPESTR.items()}[d._cai["typestr"]]


REFUSALS = [
    ("too_many_query_rows", lambda: _dec(Dev(2, 2**28 + 1, 8, 64)), ArgumentError,
     r"q has 268435457 query rows per sequence; decode attention takes 1\.\.MAX_SEQLEN_Q \(2\*\*28\) \(use "
     r"aotriton_rt\.attention for longer runs\)"),
    ("too_many_rows_per_kv_head", lambda: _dec(Dev(2, 2**28, 16, 64)), ArgumentError,
     r"8 query heads per KV head times 268435456 query rows exceed MAX_GROUP_ROWS \(2\*\*30\) rows per KV head"),
    ("page_size_not_multiple_of_16", lambda: _dec(k=Dev(10, 24, 2, 64), block_table=Dev(2, 4, dtype="i32")),
     ArgumentError, r"page size 24 \(k_cache\.shape\[1\]\) is not a multiple of 16"),
    ("length_beyond_block_table", lambda: _dec(k=Dev(10, 16, 2, 64), block_table=Dev(2, 4, dtype="i32"),
                                               cache_seqlens=60, k_new=Dev(2, 5, 2, 64), v_new=Dev(2, 5, 2, 64)),
     ArgumentError, r"cache_seqlens=60 plus 5 new rows exceeds the 64 rows block_table can address "
     r"\(block_table\.shape\[1\] \* page_size\)"),
    ("length_beyond_contiguous_cache", lambda: _dec(cache_seqlens=257), ArgumentError,
     r"cache_seqlens=257 plus 0 new rows exceeds the 256 rows k_cache holds"),
    ("append_longer_than_the_cache", lambda: _dec(k=Dev(2, 16, 2, 64), cache_seqlens=0, k_new=Dev(2, 17, 2, 64),
                                                  v_new=Dev(2, 17, 2, 64)), ArgumentError,
     r"appending 17 rows exceeds the cache's capacity of 16 rows per sequence"),
    ("max_seqlen_beyond_capacity", lambda: _dec(max_seqlen_k=300), ArgumentError,
     r"max_seqlen_k must be in \[0, 256\], got 300"),
    ("block_table_dtype", lambda: _dec(k=Dev(10, 16, 2, 64), block_table=Dev(2, 4, dtype="i64")), ArgumentError,
     r"block_table must be int32, got i64"),
    ("block_table_batch", lambda: _dec(k=Dev(10, 16, 2, 64), block_table=Dev(3, 4, dtype="i32")), ArgumentError,
     r"block_table must be \(batch, max_blocks\) = \(2, \.\.\.\), got shape \(3, 4\)"),
    ("append_without_lengths", lambda: _dec(k_new=Dev(2, 1, 2, 64), v_new=Dev(2, 1, 2, 64)), ArgumentError,
     r"appending k_new needs cache_seqlens"),
    ("k_new_alone", lambda: _dec(k_new=Dev(2, 1, 2, 64), cache_seqlens=3), ArgumentError,
     r"k_new and v_new come together"),
    ("k_new_heads", lambda: _dec(cache_seqlens=3, k_new=Dev(2, 1, 8, 64), v_new=Dev(2, 1, 8, 64)), ArgumentError,
     r"k_new must hold \(batch, rows, kv heads, head dim\) = \(2, n, 2, 64\)"),
    ("head_dim_past_the_largest_bucket", lambda: _dec(Dev(2, 1, 8, 257), Dev(2, 256, 2, 257)), UnsupportedError,
     r"head dim 257 exceeds the largest supported head dim 256; supported: 1\.\.256 \(compiled buckets 16, 32, "
     r"48, 64, 80, 96, 128, 160, 192, 224, 256; others are read masked on the next one\)"),
    ("head_dim_zero", lambda: _dec(Dev(2, 1, 8, 0), Dev(2, 256, 2, 0)), ArgumentError,
     r"head dim 0: q, the caches and k_new/v_new need at least one column"),
    ("gqa_ratio", lambda: _dec(Dev(2, 1, 6, 64), Dev(2, 256, 4, 64)), ArgumentError,
     r"q has 6 heads, not a multiple of the cache's 4 KV heads"),
    ("cache_batch", lambda: _dec(k=Dev(3, 256, 2, 64)), ArgumentError,
     r"k_cache has batch 3 but q has batch 2 \(a paged cache needs block_table\)"),
    ("cache_head_dim_not_contiguous", lambda: _dec(k=Dev(2, 256, 2, 64, strides=(256 * 2 * 128, 2 * 128, 128, 2))),
     ArgumentError, r"k_cache must have a contiguous head dim and non-negative strides \(it is read in place\), got "
     r"strides \(65536, 256, 128, 2\)"),
    ("k_new_head_dim_not_contiguous", lambda: _dec(cache_seqlens=3, k_new=Dev(2, 1, 2, 64, strides=(256, 128, 2, 2)),
                                                   v_new=Dev(2, 1, 2, 64)), ArgumentError,
     r"k_new must have a contiguous head dim and non-negative strides"),
    ("dtype_mismatch", lambda: _dec(k=Dev(2, 256, 2, 64, dtype="fp32"), v=Dev(2, 256, 2, 64)), ArgumentError,
     r"k_cache has dtype fp32 but q has fp16"),
    ("cache_seqlens_shape", lambda: _dec(cache_seqlens=Dev(3, dtype="i32")), ArgumentError,
     r"cache_seqlens must be a contiguous int32 array of shape \(2,\), got i32 \(3,\)"),
    ("causal_window", lambda: _dec(causal=True, window=(4, 2)), ArgumentError,
     r"causal=True hides every key right of the diagonal, but window=\(4, 2\) asks for 2 keys there"),
    ("num_splits", lambda: _dec(num_splits=0), ArgumentError, r"num_splits must be in \[1, 1024\], got 0"),
    ("negative_length", lambda: _dec(cache_seqlens=-1), ArgumentError, r"cache_seqlens must be >= 0, got -1"),
    ("negative_softcap", lambda: _dec(softcap=-30.0), ArgumentError,
     r"softcap must be a finite number > 0 \(None or 0: no softcap\), got -30\.0"),
    ("nan_softcap", lambda: _dec(softcap=float("nan")), ArgumentError,
     r"softcap must be a finite number > 0 .*got nan"),
    ("infinite_softcap", lambda: _dec(softcap=float("inf")), ArgumentError,
     r"softcap must be a finite number > 0 .*got inf"),
    ("boolean_softcap", lambda: _dec(softcap=True), ArgumentError, r"softcap must be a finite number > 0 .*got True"),
    ("softcap_with_a_zero_scale", lambda: _dec(softcap=50.0, scale=0.0), ArgumentError,
     r"softcap needs a non-zero scale"),
]


@pytest.mark.parametrize("case", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_decode_refuses_malformed_calls_before_any_launch(case: tuple) -> None:
    call, exc, match = case
    with pytest.raises(exc, match=match):
        call()


def test_attention_routes_only_calls_the_decode_kernels_express() -> None:
    from types import SimpleNamespace

    from aotriton_rt.ops.decode import route_from_attention

    lacking = SimpleNamespace(variants=[], tuning={}, variants_of=lambda name: [])  # no decode kernels
    q, k = Dev(2, 8, 1, 64), Dev(2, 2, 300, 64)
    base = {"causal": True, "window": None, "align": "bottom_right", "bias": None, "dropout_p": 0.0, "scale": None,
            "cu_seqlens_q": None, "cu_seqlens_k": None, "layout": "bhsd", "out": None, "lse": None,
            "return_mask": False, "library": lacking}
    for change in ({"bias": Dev(300)}, {"dropout_p": 0.1}, {"align": "top_left"}, {"out": q}, {"return_mask": True},
                   {"window": 3}, {}):
        assert route_from_attention(q, k, k, **{**base, **change}) is None, change
    assert route_from_attention(Dev(2, 8, 17, 64), k, k, **base) is None  # 17 query rows: prefill
    assert op.ROUTED_SEQLEN_Q == 16 < op.MAX_SEQLEN_Q


def test_a_decode_shaped_attention_call_is_validated_before_images_are_looked_for(monkeypatch) -> None:
    monkeypatch.setenv("AOTRITON_RT_IMAGES", "/nonexistent-aotriton-images")
    with pytest.raises(ArgumentError, match=r"scale must be a finite number, got nan"):
        aotriton_rt.attention(Dev(2, 8, 1, 64), Dev(2, 2, 300, 64), Dev(2, 2, 300, 64), scale=float("nan"))


def test_debug_mode_reads_lengths_and_pages_back_and_refuses_bad_ones() -> None:
    torch = pytest.importorskip("torch")
    from aotriton_rt.ops.attention.framework import arrays_for
    from aotriton_rt.ops.decode.validate import DecodePlan, _check_contents

    xp = arrays_for("torch")
    plan = DecodePlan("fp16", 64, 2, 8, 2, 1, 2, 64, True, 16, 10, 64, (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0),
                      (0, 0, 0), 4, -1, 0, 0.125, 0, False)
    table = torch.tensor([[1, 2, 3, 4], [5, 6, 99, -1]], dtype=torch.int32)
    _check_contents(xp, plan, torch.tensor([30, 14], dtype=torch.int32), table)  # 32 and 16 rows: pages in range
    with pytest.raises(ArgumentError, match=r"block_table\[1, 2\] = 99 is not a page of the cache \(0\.\.9\); "
                                            r"sequence 1 has 33 rows"):
        _check_contents(xp, plan, torch.tensor([30, 31], dtype=torch.int32), table)
    with pytest.raises(ArgumentError, match=r"cache_seqlens\[0\] = 63 plus 2 new rows is outside the 64 rows "
                                            r"block_table can address"):
        _check_contents(xp, plan, torch.tensor([63, 0], dtype=torch.int32), table)


def test_splits_fill_the_last_wave_but_stay_several_blocks_long() -> None:
    rule = SplitRule(waves=2, min_blocks=4, max_splits=64)
    # 264 slots. B=1, 8 KV heads, 64 key blocks: at most 16 splits (4 blocks each); 14 is the
    # fewest within 85% of the best (16: 128 of 264 slots).
    # 14 splits by efficiency, but 64 blocks in runs of cdiv(64, 14) = 5 fill only 13: no empty 14th.
    assert num_splits_for(1, 8, 1, 4096, 64, 132, rule) == 13
    assert num_splits_for(8, 8, 1, 4096, 64, 132, rule) == 4  # 256 of 264 slots
    assert num_splits_for(64, 8, 1, 8192, 64, 132, rule) == 1  # the batch fills the GPU
    assert num_splits_for(27, 8, 1, 8192, 64, 132, rule) == 1  # 216 >= 80% of 264
    assert num_splits_for(26, 8, 1, 8192, 64, 132, rule) == 5  # 208 < 211: 1040 of 1056 slots
    assert num_splits_for(1, 8, 1, 100, 64, 132, rule) == 1  # too short to split
    assert num_splits_for(1, 1, 1, 10**6, 64, 132, SplitRule(2, 1, 64)) == 55


def test_every_split_the_rule_picks_gets_keys() -> None:
    for batch, heads, seqlen in [(1, 1, 64 * 37), (1, 8, 2048), (2, 4, 100_000), (1, 2, 64 * 130), (3, 8, 999)]:
        for min_blocks in (1, 2, 4):
            splits = num_splits_for(batch, heads, 1, seqlen, 64, 132, SplitRule(2, min_blocks, 64))
            blocks = -(-seqlen // 64)
            per = -(-blocks // splits)
            assert (splits - 1) * per < blocks, (batch, heads, seqlen, min_blocks, splits)


def test_catalog_split_rules_override_the_default_per_arch() -> None:
    rules = [{"arch": "gfx942", "splits": {"waves": 1}}, {"arch": "sm90", "splits": {"min_blocks": 8}, "config": 2}]
    assert split_rule(rules, "sm90") == (SplitRule(2, 8, 64), 2)
    assert split_rule(rules, "gfx942")[0].waves == 1
    assert split_rule(rules, "sm80") == (SplitRule(2, 4, 64), 0)
    with pytest.raises(CatalogError, match=r"splits\.waves must be an integer in \[1, 64\], got 0"):
        split_rule([{"splits": {"waves": 0}}], "sm90")
    with pytest.raises(CatalogError, match=r"splits must be an object with waves, min_blocks, max_splits"):
        split_rule([{"splits": {"blocks": 3}}], "sm90")
    with pytest.raises(CatalogError, match=r"must be a list of rules"):
        split_rule({"sm90": 1}, "sm90")


@pytest.mark.parametrize("rule", [{"combine": "fused"}, {"combine": "separate"},
                                  {"arch": "gfx942", "combine": "fused"}])
def test_a_catalog_rule_naming_the_removed_fused_merge_is_refused_whatever_its_target(rule: dict) -> None:
    with pytest.raises(CatalogError, match=r"tuning\['attn_decode'\]\[1\]\.combine is no longer read: the fused split "
                       r"merge was removed .*drop the key, got '(fused|separate)'"):
        split_rule([{"arch": "sm80"}, rule], "sm90")


def test_a_catalog_rule_can_pick_a_config_from_a_work_size_on_and_per_cache_kind() -> None:
    rules = [{"arch": "sm90", "min_batch_heads": 212, "config": 2}, {"arch": "sm90", "paged": True, "config": 1},
             {"splits": {"waves": 1}}]
    assert split_rule(rules, "sm90", batch_heads=512) == (SplitRule(2, 4, 64), 2)
    assert split_rule(rules, "sm90", batch_heads=512, paged=True)[1] == 2
    assert split_rule(rules, "sm90", batch_heads=211, paged=True) == (SplitRule(2, 4, 64), 1)
    assert split_rule(rules, "sm90", batch_heads=64) == (SplitRule(1, 4, 64), 0)
    with pytest.raises(CatalogError, match=r"\[0\]\.min_batch_heads must be an integer in \[0, 2\*\*31\], got -1"):
        split_rule([{"min_batch_heads": -1}], "sm90")
    with pytest.raises(CatalogError, match=r"\[0\]\.paged must be true or false, got 1"):
        split_rule([{"paged": 1}], "sm90")
    with pytest.raises(CatalogError, match=r"\[0\]\.min_rows must be an integer in \[0, 2\*\*40\], got True"):
        split_rule([{"min_rows": True}], "sm90")
    assert split_rule([{"min_rows": 256, "config": 3}, {}], "sm90", rows=255) == (SplitRule(2, 4, 64), 0)
    assert split_rule([{"min_rows": 256, "config": 3}, {}], "sm90", rows=256) == (SplitRule(2, 4, 64), 3)


def test_a_catalog_rule_can_pick_a_config_for_fp8_caches_only() -> None:
    """fp8 caches have configs of their own (sm90's #4/#5): a rule keyed ``fp8`` leaves caches of
    q's type on the next rule."""
    rules = [{"arch": "sm90", "min_batch_heads": 212, "fp8": True, "config": 5},
             {"arch": "sm90", "min_batch_heads": 212, "config": 2}, {"fp8": False, "config": 1}, {}]
    assert split_rule(rules, "sm90", batch_heads=256, fp8=True)[1] == 5
    assert split_rule(rules, "sm90", batch_heads=256)[1] == 2
    assert split_rule(rules, "sm90", batch_heads=8)[1] == 1
    assert split_rule(rules, "sm90", batch_heads=8, fp8=True)[1] == 0
    with pytest.raises(CatalogError, match=r"\[0\]\.fp8 must be true or false, got 'yes'"):
        split_rule([{"fp8": "yes"}], "sm90", fp8=True)


def test_the_build_puts_the_decode_split_rule_of_each_target_in_the_catalog(tmp_path: Path) -> None:
    from aotriton_rt.catalog import Catalog
    from builder import registry
    from builder.merge import merge
    from builder.targets import parse_targets

    kernels = registry.load_kernels()
    jobs = [j for name in ("attn_decode", "attn_decode_combine")
            for j in registry.expand(kernels[name], parse_targets("sm90,gfx942"), "gputest", "3.6.0")]
    table = registry.tuning_of(kernels, jobs)
    assert set(table) == {"attn_decode"}
    assert sorted(r["arch"] for r in table["attn_decode"]) == ["gfx942", "sm90", "sm90", "sm90"]
    assert split_rule(table["attn_decode"], "gfx942") == (SplitRule(2, 4, 64), 0)
    # sm90: the deeper pipeline (config #2) once the call fills the GPU without splits.
    assert split_rule(table["attn_decode"], "sm90", batch_heads=64 * 8) == (SplitRule(2, 4, 64), 2)
    assert split_rule(table["attn_decode"], "sm90", batch_heads=8 * 8) == (SplitRule(2, 4, 64), 0)
    # sm90: the prefill tile (config #3) for a long query run, whatever the batch.
    assert split_rule(table["attn_decode"], "sm90", batch_heads=1, rows=4 * 64) == (SplitRule(2, 4, 64), 3)
    assert split_rule(table["attn_decode"], "sm90", batch_heads=64 * 8, rows=4 * 63) == (SplitRule(2, 4, 64), 2)
    # The default set builds #0 and, on sm90, the prefill tile #3: its catalog has their rules and
    # the split rule, not the large-batch rule of the config it lacks (#2).
    default = registry.expand(kernels["attn_decode"], parse_targets("sm90,gfx942"), "default", "3.6.0")
    assert {(j.target.arch, j.config_index) for j in default} == {("sm90", 0), ("sm90", 3), ("gfx942", 0)}
    splits = {"waves": 2, "min_blocks": 4, "max_splits": 64}
    assert registry.tuning_of(kernels, default) == {"attn_decode": [
        {"arch": "sm90", "min_rows": 256, "config": 3, "splits": splits}, {"arch": "sm90", "splits": splits},
        {"arch": "gfx942", "splits": splits}]}
    # Shards built from one commit repeat the rules; merging keeps each once.
    for shard in ("a", "b"):
        (tmp_path / shard).mkdir()
        (tmp_path / shard / "catalog.json").write_text(json.dumps(
            {"schema": "aotriton-rt.catalog", "schema_version": 2, "triton_version": "3.6.0", "tuning": table,
             "variants": []}))
    merged = merge([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert merged.tuning == table
    assert Catalog.load(tmp_path / "out" / "catalog.json").tuning == table


def test_decode_modules_import_no_framework_and_the_package_maps_the_name() -> None:
    import subprocess

    probe = ("import sys, aotriton_rt, aotriton_rt.ops.decode as m, aotriton_rt.integrations.transformers\n"
             "assert aotriton_rt.decode_attention is m.decode_attention\n"
             "print(sorted(x for x in sys.modules if x.split('.')[0] in "
             "('torch', 'cupy', 'jax', 'triton', 'numpy', 'transformers')))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("arch,paged", [("sm90", 1), ("sm90", 0), ("gfx942", 1)])
def test_decode_kernel_compiles_ahead_of_time_with_vector_cache_loads(arch: str, paged: int) -> None:
    """K/V must arrive in 16-byte pieces (on sm90: cp.async into the pipeline's ring). Without
    the declared stride divisibility (or with a mask varying along the head dim) the loads fall
    to 2 bytes: no 16-byte cp.async at all, a silent 8x loss on a memory-bound kernel."""
    import re
    import subprocess
    import tempfile

    import triton

    from builder.compile import compile_job
    from builder.kernels.attention import SHARED_LIMIT
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    want = {"dtype": "bf16", "HEAD_DIM": 128, "PAGED": paged, "PADDED_D": 0, "KV_DTYPE": "bf16"}
    jobs = [j for j in expand(load_kernels()["attn_decode"], parse_targets(arch), "default", "3.6.0")
            if j.spec == want and j.config_index == 0]
    from builder.abi import prove

    variant, raw, _ = compile_job(jobs[0])
    assert raw[:4] == b"\x7fELF" and 0 < variant.shared <= SHARED_LIMIT[arch]
    # The binary's own parameter list is the catalog's (on gfx942, tl.num_programs in the fused
    # merge once made the backend add 14 implicit hidden arguments: 53 parameters against 39).
    prove(variant, raw)
    if arch.startswith("sm"):
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(raw)
            f.flush()
            sass = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)
        assert ops.count("LDGSTS.E.BYPASS.128") >= 32, "K/V tiles are not loaded with 16-byte cp.async"
        assert not any(op.startswith("LDGSTS.E.BYPASS.") and not op.endswith(".128") for op in ops)
        assert any(op.startswith("HMMA") for op in ops)
        # Page ids: one per key block or 16-row chunk (both loops, all pipeline stages: 25 copies
        # of 4 bytes, 80 shared loads). A per-key lookup made 80 copies and ~220 shared loads.
        assert ops.count("LDGSTS.E") <= 40 and ops.count("LDS") <= 120, (ops.count("LDGSTS.E"), ops.count("LDS"))


@pytest.mark.parametrize("config", [0, 2])
def test_a_paged_cache_keeps_as_many_kv_tiles_in_flight_as_a_contiguous_one(config: int) -> None:
    """Triton's pipeliner gives loads addressed through the block table half the shared-memory
    ring of direct loads; the paged configs' extra stages must buy it back. At equal stages the
    paged sm90 binary held one K/V buffer (39 KB against 70 KB) and ran at 0.65-0.7x."""
    from builder.compile import compile_job
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    jobs = {j.spec["PAGED"]: j for j in expand(load_kernels()["attn_decode"], parse_targets("sm90"), "gputest",
                                               "3.6.0")
            if j.spec["dtype"] == "bf16" and j.spec["HEAD_DIM"] == 128 and not j.spec["PADDED_D"]
            and j.spec["KV_DTYPE"] == "bf16" and j.config_index == config}
    contiguous, paged = compile_job(jobs[0])[0].shared, compile_job(jobs[1])[0].shared
    tile = 2 * 64 * 128 * 2  # one K and one V tile of 64 keys
    assert contiguous >= 2 * tile
    assert contiguous <= paged < contiguous + tile // 4, (contiguous, paged)


def test_decode_head_dims_and_limits_mirror_the_builder() -> None:
    from builder.kernels import decode as kernels

    assert op.HEAD_DIM_BUCKETS == kernels.HEAD_DIM_BUCKETS
    assert op.MAX_SEQLEN_Q == kernels.MAX_SEQLEN_Q
    assert op.MAX_GROUP_ROWS == kernels.MAX_GROUP_ROWS


def test_decode_kernels_are_in_the_default_and_gputest_sets() -> None:
    from builder.kernels import decode as kernels
    from builder.targets import KNOWN

    for k in kernels.KERNELS:
        if not k.axes:  # attn_decode_lengths: one variant per target, in every set
            continue
        for dtype in ("fp16", "bf16"):
            for d in (64, 128):
                for padded in (0, 1):
                    spec = {"dtype": dtype, "HEAD_DIM": d, "PAGED": 1, "PADDED_D": padded}
                    assert k.sets["default"](spec, KNOWN["sm90"]) and k.sets["gputest"](spec, KNOWN["gfx942"])
            assert not k.sets["default"]({"dtype": dtype, "HEAD_DIM": 80, "PADDED_D": 1}, KNOWN["sm90"])
        assert k.sets["gputest"]({"dtype": "fp32", "HEAD_DIM": 128, "PADDED_D": 0}, KNOWN["sm90"])
        assert not k.sets["default"]({"dtype": "fp32", "HEAD_DIM": 128, "PADDED_D": 0}, KNOWN["sm90"])
        assert k.sets["gputest"]({"dtype": "fp16", "HEAD_DIM": 256, "PADDED_D": 1}, KNOWN["sm90"])
        assert not k.sets["gputest"]({"dtype": "fp16", "HEAD_DIM": 256, "PADDED_D": 0}, KNOWN["sm90"])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _main(sys.argv[1:])


class _AddressHandle(_Handle):
    """Records each launch by argument name, arrays as their addresses; prepared launches too."""

    library = type("Lib", (), {"backend_now": "cuda"})()

    def __call__(self, *args: Any) -> None:
        LAUNCHES.append(("call", self.decl.name, {n: a.data_ptr() if hasattr(a, "data_ptr") else (0 if a is None
                                                  else a) for n, a in zip(self.arg_names, args, strict=True)}))

    def prepare(self, device: int, values: list, *, pdl: bool = True) -> Any:
        assert device == 0
        PREPARED.append((self.decl.name, pdl))
        def launch(stream: int, args: tuple) -> None:
            assert stream == 0x77
            LAUNCHES.append(("prepared", self.decl.name, dict(zip(self.arg_names, args, strict=True))))
        return launch


#: (kernel, pdl) of each Kernel.prepare the decode plans made.
PREPARED: list = []


@pytest.mark.parametrize("paged,lens,images", [(0, "array", "current"), (16, "array", "current"),
                                               (0, "full", "current"), (0, "int", "current"),
                                               (16, "array", "with-counters"), (0, "int", "with-counters")])
def test_a_repeated_torch_call_launches_prepared_kernels_with_the_first_calls_arguments(
        monkeypatch: pytest.MonkeyPatch, paged: int, lens: str, images: str) -> None:
    import torch

    from aotriton_rt import interop

    names = {torch.float16: "fp16", torch.int32: "i32"}
    from aotriton_rt.ops.decode import validate

    monkeypatch.setattr(validate, "_describe", lambda obj, name: interop.ArrayInfo(
        obj.data_ptr(), 0, names[obj.dtype], tuple(obj.shape), tuple(obj.stride()), "torch"))
    monkeypatch.setattr(validate, "_host_lengths", lambda obj: None)
    monkeypatch.setattr(interop, "stream_getter", lambda framework: (lambda device: 0x77))
    lib = _Library()
    def kernel(name: str, **params: Any) -> _AddressHandle:
        handle = _AddressHandle(lib.decls[name], params)
        if images == "with-counters" and name == "attn_decode":
            # Images built before the fused split merge was removed: the decode kernel takes an
            # arrival-counter pointer after CacheSeqlens, which must be null (no merge in it).
            at = handle.arg_names.index("CacheSeqlens") + 1
            handle.arg_names = handle.arg_names[:at] + ["Counters"] + handle.arg_names[at:]
        return handle

    monkeypatch.setattr(lib, "kernel", kernel)
    B, Hk, D = 2, 2, 64
    q = torch.randn(B, 1, 8, D).half()
    if paged:
        k = torch.randn(8, paged, Hk, D).half()
        table = torch.arange(8, dtype=torch.int32).reshape(B, 4)
    else:
        k, table = torch.randn(B, 256, Hk, D).half(), None
    v = torch.randn_like(k)
    kn, vn = torch.randn(B, 1, Hk, D).half(), torch.randn(B, 1, Hk, D).half()
    seqlens = {"array": torch.tensor([37, 60], dtype=torch.int32), "full": None, "int": 50}[lens]
    new = {"k_new": kn, "v_new": vn} if lens != "full" else {}
    op._kernels_of(lib).launches.clear()
    LAUNCHES.clear()
    outs = [op.decode_attention(q, k, v, cache_seqlens=seqlens, block_table=table, num_splits=3, causal=True,
                                check=False, library=lib, **new) for _ in range(3)]
    # Splits: the combine kernel merges them (a second launch).
    kernels = (["attn_decode_append"] if new else []) + ["attn_decode", "attn_decode_combine"]
    n = len(kernels)
    first, second, third = LAUNCHES[:n], LAUNCHES[n:2 * n], LAUNCHES[2 * n:]
    assert [(w, n) for w, n, _ in first] == [("call", n) for n in kernels]
    assert [(w, n) for w, n, _ in second] == [(w, n) for w, n, _ in third] == [("prepared", n) for n in kernels]
    # New arrays each call (lengths: made once).
    fresh = {"Out", "LSE", "PartO", "PartL", "CacheSeqlens"}
    decode_args = [args for _, name, args in first if name == "attn_decode"][0]
    assert ("Counters" in decode_args) == (images == "with-counters")
    for (_, _, a), (_, _, b), (_, _, c) in zip(first, second, third):
        if "Counters" in a:
            assert a["Counters"] == b["Counters"] == c["Counters"] == 0
        assert {n: x for n, x in a.items() if n not in fresh} == {n: x for n, x in b.items() if n not in fresh}
        if "Out" in b:
            assert b["Out"] == outs[1][0].data_ptr() and b["LSE"] == outs[1][1].data_ptr()
        if "PartO" in b:
            assert b["PartO"] and b["PartL"] and b["PartO"] != b["PartL"]
        if "CacheSeqlens" not in b:
            continue
        if lens == "array":
            assert a["CacheSeqlens"] == b["CacheSeqlens"] == seqlens.data_ptr()
        else:  # the constant lengths array is made once per plan and reused
            assert b["CacheSeqlens"] == c["CacheSeqlens"] != 0
    cached = op._kernels_of(lib).launches
    assert cached and all(launch.fast is not None for launch in cached.values())


# ---------------------------------------------------------------------------------------------
# The logit softcap: its launch argument, its plans, images built before it.
# ---------------------------------------------------------------------------------------------

def _recording_library(monkeypatch: pytest.MonkeyPatch, *, take_softcap: bool = True) -> _Library:
    """CPU torch tensors stand for device 0 arrays; the kernels record their launches (as
    :class:`_AddressHandle`). ``take_softcap=False``: images built before ``attn_decode`` took
    the softcap (neither its catalog variants nor its handles have the argument)."""
    import torch

    from aotriton_rt import interop
    from aotriton_rt.ops.decode import validate

    names = {torch.float16: "fp16", torch.int32: "i32"}
    real = validate._describe
    monkeypatch.setattr(validate, "_describe", lambda obj, name: interop.ArrayInfo(
        obj.data_ptr(), 0, names[obj.dtype], tuple(obj.shape), tuple(obj.stride()), "torch")
        if isinstance(obj, torch.Tensor) else real(obj, name))
    monkeypatch.setattr(validate, "_host_lengths", lambda obj: None)
    monkeypatch.setattr(interop, "stream_getter", lambda framework: (lambda device: 0x77))
    lib = _Library()

    def kernel(name: str, **params: Any) -> _AddressHandle:
        handle = _AddressHandle(lib.decls[name], params)
        if not take_softcap:
            handle.arg_names = [n for n in handle.arg_names if n != "softcap"]
        return handle

    def variants_of(name: str, listed: Any = lib.variants_of) -> list:
        found = listed(name)
        for v in found if not take_softcap else ():
            v.args = [a for a in v.args if a.name != "softcap"]
        return found

    monkeypatch.setattr(lib, "kernel", kernel)
    monkeypatch.setattr(lib, "variants_of", variants_of)
    return lib


def _decode_arrays(paged: bool) -> dict:
    import torch

    q = torch.randn(2, 1, 8, 64).half()
    if paged:
        k = torch.randn(8, 16, 2, 64).half()
        table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    else:
        k, table = torch.randn(2, 64, 2, 64).half(), None
    return {"q": q, "k_cache": k, "v_cache": torch.randn_like(k), "block_table": table,
            "cache_seqlens": torch.tensor([37, 60], dtype=torch.int32)}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_the_softcap_reaches_the_decode_kernel_on_first_and_repeated_calls_and_keys_the_plan(
        monkeypatch: pytest.MonkeyPatch, paged: bool) -> None:
    lib = _recording_library(monkeypatch)
    a = _decode_arrays(paged)
    op._kernels_of(lib).launches.clear()
    LAUNCHES.clear()
    for softcap in (30.0, 30.0, 30.0, 0.0, 0.0, None, 12.5):
        op.decode_attention(**a, num_splits=2, causal=True, softcap=softcap, check=False, library=lib)
    decode = [(how, args["softcap"]) for how, name, args in LAUNCHES if name == "attn_decode"]
    # First call of a signature: the handle; then the prepared launch, with the same cap.
    assert decode == [("call", 30.0), ("prepared", 30.0), ("prepared", 30.0), ("call", 0.0), ("prepared", 0.0),
                      ("call", 0.0), ("call", 12.5)]
    assert not any("softcap" in args for _, name, args in LAUNCHES if name != "attn_decode")  # combine: none
    # One plan per cap (None and 0.0 are typed apart, and compute alike).
    assert sorted(launch.p.softcap for launch in op._kernels_of(lib).launches.values()) == [0.0, 0.0, 12.5, 30.0]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_images_built_before_the_decode_softcap_refuse_a_capped_call_and_run_an_uncapped_one(
        monkeypatch: pytest.MonkeyPatch, paged: bool) -> None:
    lib = _recording_library(monkeypatch, take_softcap=False)
    a = _decode_arrays(paged)
    LAUNCHES.clear()
    for _ in range(2):  # refused again: a refused call keeps no plan
        with pytest.raises(aotriton_rt.KernelNotFound,
                           match=fr"softcap=30\.0 needs attn_decode with a softcap argument; these images were built "
                                 fr"before it \(dtype=fp16, HEAD_DIM=64, PAGED={int(paged)}, PADDED_D=0, "
                                 fr"KV_DTYPE=fp16\): rebuild them \(`python -m builder build --kernels attn_decode`\)"):
            op.decode_attention(**a, causal=True, softcap=30.0, check=False, library=lib)
    assert not LAUNCHES and not op._kernels_of(lib).launches
    for softcap in (0.0, None):
        op.decode_attention(**a, causal=True, softcap=softcap, num_splits=2, check=False, library=lib)
    decode = [args for _, name, args in LAUNCHES if name == "attn_decode"]
    assert len(decode) == 2 and not any("softcap" in args for args in decode)


def test_the_express_route_takes_a_softcap_only_where_the_decode_kernel_does(monkeypatch: pytest.MonkeyPatch
                                                                            ) -> None:
    from aotriton_rt.ops.decode import route_options

    q, k = Dev(2, 8, 1, 64), Dev(2, 2, 300, 64)
    call = {"causal": True, "window": None, "align": "bottom_right", "bias": None, "dropout_p": 0.0, "scale": None,
            "cu_seqlens_q": None, "cu_seqlens_k": None, "layout": "bhsd", "out": None, "lse": None,
            "return_mask": False}
    current, old = _recording_library(monkeypatch), _recording_library(monkeypatch, take_softcap=False)
    assert route_options(q, k, k, **call, library=current, softcap=30.0)["softcap"] == 30.0
    assert route_options(q, k, k, **call, library=current)["softcap"] == 0.0
    assert route_options(q, k, k, **call, library=old, softcap=30.0) is None  # attention()'s forward serves it
    assert route_options(q, k, k, **call, library=old)["softcap"] == 0.0
    assert route_options(q, k, k, **call, library=current, softcap=-1.0) is None  # attention() refuses it


def test_a_capped_attention_call_on_the_express_route_keeps_its_decode_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """``aotriton_rt.attention`` with a cap and one query row: the decode kernel gets the cap on the
    first call and from the kept plan (prepared launches) on the next ones."""
    import torch

    from aotriton_rt import interop
    from aotriton_rt.ops.attention import problem
    from tests.helpers.cpu_arrays import cpu_describer

    lib = _recording_library(monkeypatch)
    monkeypatch.setattr(problem, "_describe", cpu_describer(problem._describe))
    cpu = cpu_describer(lambda obj, name, real=interop.describe: real(obj))
    monkeypatch.setattr(interop, "describe", lambda obj, **kw: cpu(obj, ""))
    q, k = torch.randn(2, 8, 1, 64).half(), torch.randn(2, 2, 300, 64).half()
    LAUNCHES.clear()
    for _ in range(3):
        aotriton_rt.attention(q, k, k, causal=True, align="bottom_right", softcap=30.0, library=lib)
    decode = [(how, args["softcap"]) for how, name, args in LAUNCHES if name == "attn_decode"]
    assert decode == [("call", 30.0), ("prepared", 30.0), ("prepared", 30.0)], decode


def test_a_catalog_mixing_old_and_new_decode_variants_serves_a_capped_call_from_the_new_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a real Library over a synthetic catalog (handles are made, nothing launches): the
    as-is D=64 variant predates the softcap, the masked one takes it."""
    import torch

    from aotriton_rt import interop
    from aotriton_rt.ops.decode import validate
    from tests.runtime.test_attention_op import _synthetic_variant

    names = {torch.float16: "fp16", torch.int32: "i32"}
    monkeypatch.setattr(validate, "_describe", lambda obj, name: interop.ArrayInfo(
        obj.data_ptr(), 0, names[obj.dtype], tuple(obj.shape), tuple(obj.stride()), "torch"))
    base = {"dtype": "fp16", "HEAD_DIM": 64}
    cache = {"KV_DTYPE": "fp16"}
    variants = [_synthetic_variant("attn_decode", {**base, "PAGED": 0, "PADDED_D": 0, **cache}, without=("softcap",)),
                _synthetic_variant("attn_decode", {**base, "PAGED": 0, "PADDED_D": 1, **cache})]
    variants += [_synthetic_variant("attn_decode_combine", {**base, "PADDED_D": d}) for d in (0, 1)]
    (tmp_path / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                       "triton_version": "3.6.0", "variants": variants}))
    lib = aotriton_rt.Library(tmp_path)
    a = _decode_arrays(False)
    a.pop("cache_seqlens")
    capped = op.decode_kernels(**a, softcap=30.0, library=lib)["attn_decode"]
    plain = op.decode_kernels(**a, library=lib)["attn_decode"]
    assert capped.params["PADDED_D"] == 1 and "softcap" in capped.arg_names
    assert plain.params["PADDED_D"] == 0 and "softcap" not in plain.arg_names
    # Only old variants: a capped call is refused before anything launches.
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "catalog.json").write_text(json.dumps({
        "schema": "aotriton-rt.catalog", "schema_version": 2, "triton_version": "3.6.0",
        "variants": [variants[0], variants[2]]}))
    with pytest.raises(aotriton_rt.KernelNotFound, match=r"softcap=30\.0 needs attn_decode with a softcap argument"):
        op.decode_attention(**a, cache_seqlens=50, softcap=30.0, library=aotriton_rt.Library(tmp_path / "old"))


def test_the_torch_ops_take_the_softcap_after_the_scale_and_pass_it_to_the_operator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``aotriton_rt::decode_attention(_append)``: a ``float softcap`` in the schema, checked by the
    wrapper as the operator checks it, passed through unchanged; the fake implementation traces
    it (opcheck on CPU tensors, the operator replaced by one of the same shapes)."""
    import torch

    from aotriton_rt.ops import torch_decode

    for name in ("decode_attention", "decode_attention_append"):
        schema = str(getattr(torch.ops.aotriton_rt, name).default._schema)
        assert "float scale, float softcap, SymInt num_splits" in schema, schema
    seen: list = []

    def operator(q: Any, k: Any, v: Any, **kw: Any) -> tuple:
        seen.append((kw["softcap"], kw["k_new"] is not None))
        b, s, h, _ = q.shape
        return q * 2, torch.zeros(b, h, s)

    monkeypatch.setattr(torch_decode._core, "decode_attention", operator)
    q, k = torch.randn(2, 1, 8, 64).half(), torch.randn(2, 64, 2, 64).half()
    kn = torch.randn(2, 1, 2, 64).half()
    lens = torch.tensor([3, 40], dtype=torch.int32)
    torch_decode.decode_attention(q, k, k, cache_seqlens=lens, softcap=30.0)
    torch_decode.decode_attention(q, k, k, cache_seqlens=lens, k_new=kn, v_new=kn, softcap=12)
    torch_decode.decode_attention(q, k, k, cache_seqlens=lens)
    assert seen == [(30.0, False), (12.0, True), (0.0, False)]
    for bad, match in ((-1.0, r"got -1\.0"), (float("nan"), "got nan"), (True, "got True")):
        with pytest.raises(ArgumentError, match=fr"softcap must be a finite number > 0 .*{match}"):
            torch_decode.decode_attention(q, k, k, cache_seqlens=lens, softcap=bad)
    with pytest.raises(ArgumentError, match=r"softcap needs a non-zero scale"):
        torch_decode.decode_attention(q, k, k, cache_seqlens=lens, scale=0.0, softcap=30.0)
    torch.library.opcheck(torch_decode.decode_attention_op,
                          (q, k, k, lens, -1, None, None, None, None, None, None, 0.0, 0.0, True, -1, 0, 0.125, 30.0,
                           0, -1, "bshd", "bshd", 0),
                          test_utils=("test_schema", "test_faketensor"))


def test_every_array_a_prepared_launch_reads_is_alive_when_it_is_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A repeated call's temporaries (the split partials, the fp32 copy of fp16 sinks) are held until
    their launches are enqueued: one freed earlier goes back to the allocator, whose next allocation
    in the same call then shares its memory (on the H200 the fp32 sinks landed in the partials the
    decode kernel wrote: a CUDA graph replayed outputs twice the reference)."""
    import weakref

    import torch
    from torch.overrides import TorchFunctionMode

    from aotriton_rt import interop
    from aotriton_rt.ops.decode import validate

    names = {torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32"}

    def describe(obj: Any, name: str = "") -> Any:  # CPU tensors stand for device 0 arrays
        return interop.ArrayInfo(obj.data_ptr(), 0, names[obj.dtype], tuple(obj.shape), tuple(obj.stride()), "torch")

    monkeypatch.setattr(validate, "_describe", describe)
    monkeypatch.setattr(interop, "describe", lambda obj, **kw: describe(obj))
    monkeypatch.setattr(validate, "_host_lengths", lambda obj: None)
    monkeypatch.setattr(interop, "stream_getter", lambda framework: (lambda device: 0x77))
    made: dict[int, list] = {}  # address -> weak references to the tensors made there

    class Track(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel():
                made.setdefault(out.data_ptr(), []).append(weakref.ref(out))
            return out

    dead: list[tuple[str, str]] = []

    class Checked(_AddressHandle):
        def prepare(self, device: int, values: list, *, pdl: bool = True) -> Any:
            def launch(stream: int, args: tuple) -> None:
                for arg, value in zip(self.arg_names, args, strict=True):
                    refs = made.get(value) if isinstance(value, int) and value else None
                    if refs and all(r() is None for r in refs):
                        dead.append((self.decl.name, arg))
                LAUNCHES.append(("prepared", self.decl.name, dict(zip(self.arg_names, args, strict=True))))
            return launch

    lib = _Library()
    monkeypatch.setattr(lib, "kernel", lambda name, **params: Checked(lib.decls[name], params))
    q = torch.randn(2, 1, 8, 64).half()
    k = torch.randn(2, 256, 2, 64).half()
    v = torch.randn_like(k)
    lens = torch.tensor([37, 60], dtype=torch.int32)
    sinks = torch.randn(8).half()  # converted to fp32 on every call
    op._kernels_of(lib).launches.clear()
    LAUNCHES.clear()
    with Track():
        for _ in range(3):
            op.decode_attention(q, k, v, cache_seqlens=lens, num_splits=3, sinks=sinks, check=False, library=lib)
    prepared = [(name, args) for how, name, args in LAUNCHES if how == "prepared"]
    assert {name for name, _ in prepared} == {"attn_decode", "attn_decode_combine"}
    assert all(args["Sinks"] for name, args in prepared if name == "attn_decode_combine")
    assert not dead, f"launched with the address of an array already freed: {dead}"
