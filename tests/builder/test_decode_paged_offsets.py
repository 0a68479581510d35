"""The paged decode kernel's block-table addressing, compiled (Triton 3.6): what a key block costs.

Pages smaller than a key block (vLLM's 16 rows against 64-key blocks) take one block-table
entry per 16-row chunk. The chunk walk costs one unsigned division per block (each next chunk
is 16 rows on: an add and a compare); a signed ``//`` and ``%`` per chunk made eight division
sequences per block, 204 more instructions in the loop than a block inside one page (658
against 454), then 157 (602 against 445); the fault flag's check of each table entry (an add
and an OR of a sign word per entry, tested once after the loop) makes it 177 (618 against 441);
the logit softcap's branch (skipped without a cap) 206 (668 against 462); that branch holding
ALiBi's term too, 174 (638 against 464). The results are pinned under the interpreter
(tests/runtime/test_decode_op.py: pages of 16, 32, 48 and 80 rows in blocks of 64) and on the
GPU (tests/runtime/test_decode_gpu.py).
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from builder.compile import compile_job
from builder.registry import expand, load_kernels
from builder.targets import parse_targets


def _job(arch: str, kv: str = "bf16") -> Any:
    (job,) = [j for j in expand(load_kernels()["attn_decode"], parse_targets(arch), "default", "3.6.0")
              if j.spec == {"dtype": "bf16", "HEAD_DIM": 128, "PAGED": 1, "PADDED_D": 0, "KV_DTYPE": kv}
              and j.config_index == 0]
    return job


def _sass(raw: bytes) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(raw)
        f.flush()
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout


def _loops(sass: str) -> list[tuple[collections.Counter, collections.Counter]]:
    """Opcode counts of each loop (a backward branch's body) that runs a tensor-core dot: (the
    instructions every key block runs, those a forward branch inside the loop may skip: the
    logit softcap's and ALiBi's, which only calls with a cap or slopes run)."""
    ins: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ins)
            continue
        op = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if op:
            ins.append(op.group(1) + (" " + m.group(1) if (m := re.search(r"BRA\s+`?\(?\.(L_x_\d+)", line)) else ""))
    loops = []
    for i, text in enumerate(ins):
        target = text.split(" ")[1] if text.startswith("BRA ") else None
        if target in labels and labels[target] < i:
            first = labels[target]
            skipped: set[int] = set()
            for j in range(first, i):
                inner = ins[j].split(" ")[1] if ins[j].startswith("BRA ") else None
                if inner in labels and j < labels[inner] <= i:
                    skipped.update(range(j + 1, labels[inner]))
            always = collections.Counter(ins[j].split(" ")[0] for j in range(first, i + 1) if j not in skipped)
            maybe = collections.Counter(ins[j].split(" ")[0] for j in skipped)
            if any(op.startswith("HMMA") for op in always):
                loops.append((always, maybe))
    return loops


def test_a_chunked_key_block_costs_one_unsigned_division_not_two_signed_ones_per_chunk() -> None:
    variant, raw, _ = compile_job(_job("sm90"))
    sass = _sass(raw)
    # The paged binary holds both loops: blocks inside one page (first), 16-row chunks (second).
    (whole, whole_cap), (chunked, chunked_cap) = _loops(sass)
    for loop, cap in ((whole, whole_cap), (chunked, chunked_cap)):
        assert loop["IABS"] == 0, "a signed division (|x| and a sign fix-up) is left in the key loop"
        assert loop["MUFU.RCP"] <= 1 and loop["IMAD.HI.U32"] + loop["IMAD.HI"] <= 3, loop
        assert loop["LDGSTS.E.BYPASS.128"] == 16  # the K and V tiles: 16-byte copies either way
        # The softcap and ALiBi, skipped without either: per score a thread holds (a 16x64 tile
        # over 128 threads: 8) one exp2 and one fast division, and ALiBi's absolute value,
        # conversion and FMA; nothing else of the loop's.
        assert cap["MUFU.EX2"] == cap["MUFU.RCP"] == 8 and sum(cap.values()) <= 96, cap
        assert cap["IABS"] == cap["I2FP.F32.S32"] == 8, cap
        assert not any(op.startswith(("HMMA", "LDGSTS", "BAR")) for op in cap), cap
    assert chunked["LDGSTS.E"] == 4 and whole["LDGSTS.E"] == 1  # four page ids per block, or one
    # The softcap's branch cost the chunked loop 32 instructions (predicate moves: its per-chunk
    # load masks kept across the branch), the whole-page one 4: 206 more against 178 before it;
    # with ALiBi's term in the branch 174 (638 against 464).
    extra = sum(chunked.values()) - sum(whole.values())
    assert extra <= 215, f"the chunked loop runs {extra} more instructions per block than the whole-page one"
    assert sum(whole.values()) <= 470 and sum(chunked.values()) <= 645, (sum(whole.values()), sum(chunked.values()))


def test_alibi_shares_the_softcaps_branch_so_a_plain_contiguous_block_skips_it() -> None:
    """The contiguous binary: ALiBi's term behind a branch of its own was if-converted into every
    key block (31 more instructions: absolute value, conversion, predicated FMA per score, 496
    against 465); in the softcap's branch a block without either runs 475."""
    (job,) = [j for j in expand(load_kernels()["attn_decode"], parse_targets("sm90"), "default", "3.6.0")
              if j.spec == {"dtype": "bf16", "HEAD_DIM": 128, "PAGED": 0, "PADDED_D": 0, "KV_DTYPE": "bf16"}
              and j.config_index == 0]
    ((loop, terms),) = _loops(_sass(compile_job(job)[1]))
    assert loop["IABS"] == 0 and loop["I2FP.F32.S32"] == 0, loop
    assert terms["IABS"] == 8 and terms["MUFU.EX2"] == 8, terms
    assert loop["LDGSTS.E.BYPASS.128"] == 16
    assert sum(loop.values()) <= 480, sum(loop.values())


def test_an_fp8_cache_keeps_the_chunk_walk_and_its_copies_in_both_paged_loops() -> None:
    """The fp8 variant (bf16 queries) of the same kernel: no signed division either; its rows are
    half as many bytes, so K arrives in four 16-byte copies per block where bf16 needed eight
    (V, read as ``(keys, D)`` for the P·V dot, in eight 8-byte ones); the same table-entry copies;
    the widening to bf16 goes through ``cvt.rn.f16x2.e4m3x2`` (two values per instruction)."""
    variant, raw, _ = compile_job(_job("sm90", "fp8e4nv"))
    (whole, _), (chunked, _) = _loops(_sass(raw))
    for loop in (whole, chunked):
        assert loop["IABS"] == 0 and loop["MUFU.RCP"] <= 1 and loop["IMAD.HI.U32"] + loop["IMAD.HI"] <= 3, loop
        assert loop["LDGSTS.E.BYPASS.128"] == 4 and loop["LDGSTS.E.64"] == 8, loop
        assert loop["F2FP.F16.E4M3.UNPACK_B"] == 64, loop
    assert chunked["LDGSTS.E"] == 4 and whole["LDGSTS.E"] == 1
    assert sum(chunked.values()) - sum(whole.values()) <= 215


@pytest.mark.parametrize("arch", ["sm80", "gfx1100"])  # gfx942: test_decode_op.py
def test_the_paged_decode_kernel_compiles_for_sm80_and_keeps_its_abi_on_hip(arch: str) -> None:
    from builder.abi import prove

    variant, raw, _ = compile_job(_job(arch))
    assert variant.pdl is False
    if arch.startswith("gfx"):
        prove(variant, raw)
    else:
        assert raw[:4] == b"\x7fELF"
