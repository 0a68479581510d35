"""Decode never reads or writes outside its arrays, whatever ``cache_seqlens`` and ``block_table`` say.

- Under Triton's interpreter (subprocesses): the real kernels on hostile tables and lengths
  (pages past the cache, negative entries, lengths past the capacity or near the int32 limit,
  appends through them), every load, store and atomic checked against the extents of the
  arrays the call passed; the faulting sequence answers NaN, the others exactly, the fault flag
  holds the right bits, and the cache outside the rows a valid append writes is unchanged.
- Host refusal before launch with FlashAttention-2's rule (int, CPU-tensor and NumPy lengths,
  appended rows; exactly at capacity runs), ``check=True`` on hostile device tables, the fault
  flag's API, and the launch cache refusing bad-typed options as a fresh call does.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from aotriton_rt import ArgumentError, FaultError
from aotriton_rt.ops import decode as op
from tests.helpers.interpreter import patch_interpreter, report_cases, run_sharded
from tests.runtime.test_decode_op import _AddressHandle, _Handle, _install_cpu, _Library

ROOT = Path(__file__).resolve().parents[2]
BIG = 10**6

# B=3 (sequence 1 is the hostile one), Hq=4, Hk=2, Sq=1, D=32, fp32; paged: pages of 16 rows, a
# 3-column table (capacity 48) over 9 pages; contiguous: 48 rows.
HOSTILE: dict[str, dict] = {
    "page_past_the_cache": {"paged": 1, "lens": (40, 30, 5), "table": {(1, 1): BIG}, "faults": 2},
    "negative_page": {"paged": 1, "lens": (40, 30, 5), "table": {(1, 0): -5}, "faults": 2},
    "length_past_the_table": {"paged": 1, "lens": (40, 48 + 7, 5), "faults": 1},
    "negative_length": {"paged": 1, "lens": (40, -3, 5), "faults": 1},
    "length_near_the_int32_limit_with_append": {"paged": 1, "lens": (40, 2**31 - 2, 5), "new": 2, "faults": 1},
    "append_through_a_page_past_the_cache": {"paged": 1, "lens": (20, 15, 5), "new": 2, "table": {(1, 1): BIG},
                                             "faults": 2},
    "append_through_a_negative_page_with_splits": {"paged": 1, "lens": (20, 31, 5), "new": 2,
                                                   "table": {(1, 1): -1}, "faults": 2, "splits": 3},
    "contiguous_length_past_the_cache_with_append": {"paged": 0, "lens": (20, 47, 5), "new": 2, "faults": 1},
    "contiguous_negative_length_splits": {"paged": 0, "lens": (40, -1, 5), "faults": 1, "splits": 2},
    # In range, exactly at capacity (lengths on the host, checked and copied): correct, no fault.
    "exactly_at_capacity_paged_host_lengths": {"paged": 1, "lens": (46, 0, 46), "new": 2, "host": True,
                                               "faults": 0, "good": (0, 1, 2)},
    "exactly_at_capacity_contiguous": {"paged": 0, "lens": (48, 1, 0), "faults": 0, "good": (0, 1, 2)},
    # The checker itself: told that K is one page smaller than it is, it must see accesses past it.
    "checker_sees_an_access_past_an_array": {"paged": 1, "lens": (40, 30, 40), "faults": 0, "good": (0, 1, 2),
                                             "shrink_k": True},
}

# ---------------------------------------------------------------------------------------------
# Interpreter side (subprocess).
# ---------------------------------------------------------------------------------------------

EXTENTS: list = []  # (name, first byte, end) of each array argument of the launch running now
VIOLATIONS: list = []
SHRINK: dict = {}


def _extent(t: Any) -> tuple[int, int]:
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


class _CheckedHandle(_Handle):
    """Launches the Triton source with the extents of its array arguments registered."""

    def __call__(self, *args: Any) -> None:
        import torch

        EXTENTS.clear()
        for name, a in zip(self.arg_names, args, strict=True):
            if isinstance(a, torch.Tensor):
                lo, hi = _extent(a)
                if name in SHRINK:
                    hi -= SHRINK[name]
                EXTENTS.append((f"{self.decl.name}.{name}", lo, hi))
        super().__call__(*args)


def _install_checker() -> None:
    """Check every masked-in address of the interpreter's loads, stores and atomics."""
    import numpy as np
    from triton.runtime import interpreter as interp

    def check(kind: str, ptrs: Any, mask: Any, width: int) -> None:
        addr = np.asarray(ptrs.data).astype(np.uint64).ravel()
        live = np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).ravel().astype(bool)
        for a in addr[live].tolist():
            if not any(lo <= a and a + width <= hi for _, lo, hi in EXTENTS):
                VIOLATIONS.append(f"{kind} at {a:#x} outside {[n for n, _, _ in EXTENTS]}")
                return

    b = interp.InterpreterBuilder
    load, store, rmw = b.create_masked_load, b.create_masked_store, b.create_atomic_rmw

    def width(ptrs: Any) -> int:
        return np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize

    def masked_load(self, ptrs, mask, other, *a):
        check("load", ptrs, mask, width(ptrs))
        return load(self, ptrs, mask, other, *a)

    def masked_store(self, ptrs, value, mask, *a):
        check("store", ptrs, mask, width(ptrs))
        return store(self, ptrs, value, mask, *a)

    def atomic_rmw(self, op_, ptr, val, mask, *a):
        check("atomic", ptr, mask, width(ptr))
        return rmw(self, op_, ptr, val, mask, *a)

    # Unmasked loads and stores call these with an all-true mask.
    b.create_masked_load, b.create_masked_store, b.create_atomic_rmw = masked_load, masked_store, atomic_rmw


def run_hostile(name: str, case: dict) -> dict:
    import torch

    from aotriton_rt.ops.decode import validate

    c = {"new": 0, "table": {}, "splits": 1, "good": (0, 2), **case}
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    B, Hq, Hk, D, ps, width, cap = 3, 4, 2, 32, 16, 3, 48
    lens, new = list(c["lens"]), c["new"]
    nan = float("nan")
    q = torch.randn(B, 1, Hq, D, generator=gen)
    def fenced(rows: int, shape: tuple, margin: int) -> tuple[Any, Any]:
        """A cache inside a bigger buffer of NaN sentinels: a read outside it poisons a good answer."""
        buf = torch.full((rows + 2 * margin, *shape), nan)
        cache = buf[margin:margin + rows]
        cache.copy_(torch.randn(rows, *shape, generator=gen))
        return buf, cache

    if c["paged"]:
        num_pages = 9
        (buf, k_cache), (vbuf, v_cache) = (fenced(num_pages, (ps, Hk, D), 2) for _ in range(2))
        table = torch.arange(B * width, dtype=torch.int32).reshape(B, width) % num_pages
        for (b, j), page in c["table"].items():
            table[b, j] = page
    else:
        (buf, k_cache), (vbuf, v_cache) = (fenced(B, (cap, Hk, D), 1) for _ in range(2))
        table = None
    k_new = torch.randn(B, new, Hk, D, generator=gen) if new else None
    v_new = torch.randn(B, new, Hk, D, generator=gen) if new else None
    before_k, before_v = buf.clone(), vbuf.clone()
    SHRINK.clear()
    if c.get("shrink_k"):
        SHRINK["K"] = ps * Hk * D * 4
    seqlens = torch.tensor(lens, dtype=torch.int32)
    if c.get("host"):
        validate._host_lengths = HOST_LENGTHS
    lib = _Library()
    lib.kernel = lambda kname, **params: _CheckedHandle(lib.decls[kname], params)
    VIOLATIONS.clear()
    op.read_faults(library=lib)
    out, lse = op.decode_attention(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, k_new=k_new,
                                   v_new=v_new, num_splits=c["splits"], check=False, library=lib)
    validate._host_lengths = lambda obj: None
    faults = op.read_faults(library=lib)
    failed: list[str] = []
    if bool(VIOLATIONS) != bool(c.get("shrink_k")):
        failed.append(f"out-of-bounds accesses: {VIOLATIONS[:3]}" if VIOLATIONS else "the checker saw nothing")
    if faults != c["faults"]:
        failed.append(f"fault bits {faults}, expected {c['faults']}")
    scale = 1 / math.sqrt(D)
    group = Hq // Hk
    # The rows a valid append wrote, and the expected buffers.
    want_k, want_v = before_k.clone(), before_v.clone()
    wk = want_k[2:2 + 9] if c["paged"] else want_k[1:1 + B]
    wv = want_v[2:2 + 9] if c["paged"] else want_v[1:1 + B]
    base = lens
    for b in c["good"]:
        for i in range(new):
            r = base[b] + i
            if c["paged"]:
                wk[table[b, r // ps], r % ps], wv[table[b, r // ps], r % ps] = k_new[b, i], v_new[b, i]
            else:
                wk[b, r], wv[b, r] = k_new[b, i], v_new[b, i]
    if 1 not in c["good"] and new and c["faults"] == 2:
        # The hostile sequence's rows in range with an in-range page are written too.
        for i in range(new):
            r = base[1] + i
            page = int(table[1, r // ps])
            if 0 <= page < 9:
                wk[page, r % ps], wv[page, r % ps] = k_new[1, i], v_new[1, i]
    if not (torch.equal(buf.nan_to_num(7.0), want_k.nan_to_num(7.0))
            and torch.equal(vbuf.nan_to_num(7.0), want_v.nan_to_num(7.0))):
        failed.append("the caches changed outside the rows a valid append writes")
    for b in range(B):
        if b not in c["good"]:
            if not (out[b].isnan().all() and lse[b].isnan().all()):
                failed.append(f"the faulting sequence {b} is not all NaN")
            continue
        n = base[b] + new
        rows = torch.arange(n)
        if c["paged"]:
            kk = k_cache[table[b, rows // ps].long(), rows % ps]
            vv = v_cache[table[b, rows // ps].long(), rows % ps]
        else:
            kk, vv = k_cache[b, :n], v_cache[b, :n]
        kk = kk.double().transpose(0, 1).repeat_interleave(group, 0)
        vv = vv.double().transpose(0, 1).repeat_interleave(group, 0)
        s = q[b].double().transpose(0, 1) @ kk.transpose(-1, -2) * scale
        ref = (torch.softmax(s, -1) @ vv).transpose(0, 1) if n else torch.zeros_like(q[b]).double()
        err = (out[b].double() - ref).abs().max().item()
        if not err <= 1e-4:
            failed.append(f"out[{b}] error {err}")
    return {"name": name, "failed": failed}


HOST_LENGTHS = None


def _main(names: list[str]) -> None:
    global HOST_LENGTHS
    from aotriton_rt.ops.decode import validate

    HOST_LENGTHS = validate._host_lengths
    patch_interpreter()
    _install_cpu()
    _install_checker()
    report_cases(names, lambda name: run_hostile(name, HOSTILE[name]))


# ---------------------------------------------------------------------------------------------
# Test side.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hostile() -> dict[str, dict]:
    return run_sharded(__file__, list(HOSTILE))


@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_real_kernels_stay_inside_their_arrays_on_hostile_tables_under_the_interpreter(hostile: dict,
                                                                                          name: str) -> None:
    assert not hostile[name]["failed"], f"{name}: {hostile[name]['failed']}"


def test_the_fault_bits_mirror_the_builder() -> None:
    from builder.kernels import decode as kernels

    assert (op.FAULT_LENGTH, op.FAULT_PAGE) == (kernels.FAULT_LENGTH.value, kernels.FAULT_PAGE.value)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Any:
    """CPU torch tensors stand for device 0 arrays (lengths: on the host unless a test says
    otherwise); the kernels record their launches instead of running."""
    import torch

    from aotriton_rt import interop
    from aotriton_rt.ops.decode import validate

    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
             torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
             torch.bool: "bool"}
    real = validate._describe

    def describe(obj: Any, name: str) -> Any:
        if not isinstance(obj, torch.Tensor):  # refused (or read) as a real call would
            return real(obj, name)
        return interop.ArrayInfo(obj.data_ptr(), 0, names[obj.dtype], tuple(obj.shape), tuple(obj.stride()),
                                 "torch")

    monkeypatch.setattr(validate, "_describe", describe)
    monkeypatch.setattr(interop, "stream_getter", lambda framework: (lambda device: 0x77))
    lib = _Library()
    monkeypatch.setattr(lib, "kernel", lambda name, **params: _AddressHandle(lib.decls[name], params))
    yield lib  # a fresh library: its launch cache starts empty and goes with it


def _arrays(paged: bool) -> dict:
    import torch

    q = torch.randn(2, 1, 8, 64).half()
    if paged:  # 4 columns of 16-row pages: 64 rows per sequence
        k = torch.randn(10, 16, 2, 64).half()
        table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    else:
        k, table = torch.randn(2, 64, 2, 64).half(), None
    return {"q": q, "k_cache": k, "v_cache": torch.randn_like(k), "block_table": table}


def _append(rows: int) -> dict:
    import torch

    return {"k_new": torch.randn(2, rows, 2, 64).half(), "v_new": torch.randn(2, rows, 2, 64).half()} if rows else {}


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("kind", ["int", "cpu_tensor", "numpy"])
@pytest.mark.parametrize("new", [0, 5])
def test_lengths_on_the_host_past_capacity_are_refused_naming_the_array_and_exactly_at_capacity_runs(
        recording: Any, paged: bool, kind: str, new: int) -> None:
    import numpy as np
    import torch

    a = _arrays(paged)
    lens = {"int": lambda n: n, "cpu_tensor": lambda n: torch.tensor([n, 0], dtype=torch.int32),
            "numpy": lambda n: np.array([n, 0], dtype=np.int64)}[kind]
    name = "cache_seqlens" if kind == "int" else r"cache_seqlens\[0\]"
    what = r"block_table can address \(block_table\.shape\[1\] \* page_size\)" if paged else "k_cache holds"
    # Twice each: a repeated call takes the cached plan and must refuse just the same.
    for _ in range(2):
        op.decode_attention(**a, cache_seqlens=lens(64 - new), **_append(new), check=False, library=recording)
        with pytest.raises(ArgumentError, match=fr"{name}={65 - new} plus {new} new rows exceeds the 64 rows {what}"):
            op.decode_attention(**a, cache_seqlens=lens(65 - new), **_append(new), check=False, library=recording)
    with pytest.raises(ArgumentError, match=fr"{name} must be >= 0, got -1"):
        op.decode_attention(**a, cache_seqlens=lens(-1), **_append(new), check=False, library=recording)


def test_host_lengths_are_copied_to_the_device_for_each_call(recording: Any) -> None:
    import torch

    from tests.runtime.test_decode_op import LAUNCHES

    a = _arrays(True)
    LAUNCHES.clear()
    for n in (10, 20):
        op.decode_attention(**a, cache_seqlens=torch.tensor([n, 1], dtype=torch.int32), num_splits=1, check=False,
                            library=recording)
    kinds = [(w, name) for w, name, _ in LAUNCHES]
    assert kinds == [("call", "attn_decode"), ("prepared", "attn_decode")]
    assert all(args["Faults"] for _, _, args in LAUNCHES)


@pytest.mark.parametrize("change,match", [
    ({"table": (1, 0, -1)}, r"block_table\[1, 0\] = -1 is not a page of the cache \(0\.\.9\); sequence 1 has 33 rows"),
    ({"table": (1, 2, BIG)}, fr"block_table\[1, 2\] = {BIG} is not a page of the cache \(0\.\.9\)"),
    ({"lens": (62, 33)}, r"cache_seqlens\[0\] = 62 plus 3 new rows is outside the 64 rows block_table can address"),
    ({"lens": (-2, 33)}, r"cache_seqlens\[0\] = -2 plus 3 new rows is outside"),
], ids=["negative_page", "page_past_the_cache", "length_past_capacity", "negative_length"])
def test_check_reads_hostile_device_tables_and_lengths_back_and_names_the_array(
        recording: Any, monkeypatch: pytest.MonkeyPatch, change: dict, match: str) -> None:
    import torch

    from aotriton_rt.ops.decode import validate

    monkeypatch.setattr(validate, "_host_lengths", lambda obj: None)  # device lengths
    a = _arrays(True)
    if "table" in change:
        b, j, page = change["table"]
        a["block_table"][b, j] = page
    lens = torch.tensor(change.get("lens", (30, 30)), dtype=torch.int32)
    op.decode_attention(**{**a, "block_table": _arrays(True)["block_table"]}, cache_seqlens=lens.clamp(0, 61),
                        **_append(3), check=True, library=recording)
    with pytest.raises(ArgumentError, match=match):
        op.decode_attention(**a, cache_seqlens=lens, **_append(3), check=True, library=recording)
    op.decode_attention(**a, cache_seqlens=lens, **_append(3), check=False, library=recording)  # unchecked: runs


def test_check_raises_when_the_fault_flag_is_set_and_read_faults_reads_and_clears_it(
        recording: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from aotriton_rt.ops.decode import validate
    from aotriton_rt.ops.decode.launch import _kernels_of

    monkeypatch.setattr(validate, "_host_lengths", lambda obj: None)
    a = _arrays(True)
    op.decode_attention(**a, check=True, library=recording)
    (flag,) = _kernels_of(recording).faults.values()
    assert op.read_faults(library=recording) == 0
    flag.fill_(op.FAULT_PAGE)  # as an unchecked call's kernel would
    op.decode_attention(**a, check=False, library=recording)  # unchecked: no read
    assert op.read_faults(0, library=recording, clear=False) == op.FAULT_PAGE
    with pytest.raises(FaultError, match=r"decode kernels on device 0 met a referenced block_table entry outside "
                                         r"\[0, num_pages\) \(fault bits 2\)") as info:
        op.decode_attention(**a, check=True, library=recording)
    assert info.value.bits == op.FAULT_PAGE
    assert op.read_faults(library=recording) == 0  # cleared by the raise
    flag.fill_(op.FAULT_LENGTH | op.FAULT_PAGE)
    assert op.describe_faults(op.read_faults(library=recording)).startswith("cache_seqlens[b] + appended rows")
    assert op.read_faults(library=recording) == 0 and op.describe_faults(0) == "none"


@pytest.mark.parametrize("valid,bad,match", [
    ({"causal": True}, {"causal": 1}, r"causal must be True or False, got 1"),
    ({"window": (1, 1)}, {"window": (True, 1)}, r"window must be \(left, right\), two integers >= -1"),
    ({"num_splits": 1}, {"num_splits": True}, r"num_splits must be an integer, got True"),
    ({"max_seqlen_k": 1}, {"max_seqlen_k": True}, r"max_seqlen_k must be an integer, got True"),
    ({"scale": 1}, {"scale": True}, r"scale must be a finite number, got True"),
], ids=["causal", "window", "num_splits", "max_seqlen_k", "scale"])
def test_a_repeated_call_with_a_bad_typed_option_is_refused_as_a_fresh_call_is(
        recording: Any, valid: dict, bad: dict, match: str) -> None:
    a = _arrays(False)
    for _ in range(2):  # the second takes the cached plan
        op.decode_attention(**a, cache_seqlens=7, check=False, library=recording, **valid)
    assert op._kernels_of(recording).launches
    with pytest.raises(ArgumentError, match=match):
        op.decode_attention(**a, cache_seqlens=7, check=False, library=recording, **bad)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _main(sys.argv[1:])
