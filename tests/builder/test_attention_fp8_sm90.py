"""The Gluon sm90 FP8 forward (builder/kernels/attention_fp8_sm90.py) through the builder, on the CPU.

It compiles for sm90 with the builder's own path, its binaries prove the catalog's argument
layout, and their SASS shows what the kernel is for: both products on FP8 wgmma (``QGMMA`` with
e4m3 operands, P·V's A operand from registers), kept asynchronous by ptxas (several per fence),
and no local-memory traffic in the key loops.
"""

from __future__ import annotations

import lzma
import re
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("elftools")

#: (head dim, mask mode, output dtype, config index): the largest tile without a mask, a D=64
#: causal one without ping-pong, a persistent D=128 bottom-right one, the first one again with
#: EXP2_SPLIT (#5 at D=128: the tile table's five, then the split twins of #0 and #3) and with the
#: keys in order (#7, KEY_ORDER=0: the one variant whose ptxas keeps a register in local memory
#: around the loops).
BUILT = ((128, 0, "bf16", 0), (64, 1, "fp16", 1), (128, 2, "bf16", 3), (128, 0, "bf16", 5), (128, 0, "bf16", 7))
#: BUILT's index of the EXP2_SPLIT variant and of its twin, and of the keys-in-order twin.
SPLIT, TWIN, IN_ORDER = 3, 0, 4


def _kernels():
    from builder.registry import load_kernels

    return load_kernels()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from builder.build import build
    from builder.registry import expand
    from builder.targets import parse_targets

    jobs = [j for j in expand(_kernels()["attn_fwd_fp8_sm90"], parse_targets("sm90"), "full", "3.6.0")
            if (j.spec["HEAD_DIM"], j.spec["CAUSAL"], j.spec["out_dtype"], j.config_index) in BUILT]
    assert len(jobs) == len(BUILT)
    out = tmp_path_factory.mktemp("fp8_gluon")
    summary = build(jobs, out, workers=1, timeout=600, keep_going=False, triton_version="3.6.0", quiet=True)
    assert summary.failed == [] and summary.compiled == len(BUILT)
    return out


def _variants(built: Path) -> list:
    from aotriton_rt.catalog import Catalog

    order = {(d, c, o, i): n for n, (d, c, o, i) in enumerate(BUILT)}
    return sorted(Catalog.load(built / "catalog.json").variants, key=lambda v: order[
        (v.spec["HEAD_DIM"], v.spec["CAUSAL"], v.spec["out_dtype"], v.config.index)])


def test_the_fp8_gluon_variants_compile_and_their_binaries_prove_the_catalog_layout(built: Path) -> None:
    from builder.build import prove_folder

    assert prove_folder(built) == len(BUILT)
    portable = [n for n, t in _kernels()["attn_fwd_fp8"].signature.items() if t != "constexpr"]
    for variant in _variants(built):
        assert variant.kernel == "attn_fwd_fp8_sm90" and variant.target.arch == "sm90"
        # Two consumer warp groups and the loader's group (its one warp padded to a group).
        assert variant.num_warps == 12 and variant.config.num_warps == 4
        # Three device-side TMA descriptors (Q, K, V^T), 128 bytes each, in the runtime's global scratch.
        assert variant.scratch["global_size"] == 3 * 128 and variant.scratch["global_align"] == 128
        # attn_fwd_fp8's argument list: the operator's argument values fit unchanged.
        assert [a.name for a in variant.args] == portable
        c = variant.config.constexprs
        d = variant.spec["HEAD_DIM"]
        # Two 64-row Q tiles and STAGES K and V^T blocks, one byte an element, and the barriers.
        assert 2 * 64 * d + c["STAGES"] * 2 * c["BLOCK_N"] * d <= variant.shared <= 232448
    assert [v.config.constexprs["PERSISTENT"] for v in _variants(built)] == [0, 0, 132, 0, 0]


@pytest.mark.parametrize("which", range(len(BUILT)))
def test_both_products_are_asynchronous_e4m3_wgmma_with_p_in_registers_and_no_spills_in_the_loops(
        built: Path, which: int) -> None:
    """ptxas serializes wgmma (a fence and a wait around each instruction) when it cannot prove
    in-flight operand registers safe, a silent 2x loss; P stays in registers across its P·V here."""
    from tests.helpers.sass import listing_loop_spills, sass_listing, sass_ops

    variant = _variants(built)[which]
    raw = lzma.decompress((built / variant.image.path).read_bytes())
    ops, listing = sass_ops(raw), sass_listing(raw)
    qgmma = sum(n for op, n in ops.items() if op.startswith("QGMMA"))
    assert not any(op.startswith("HGMMA") for op in ops), "a product left FP8"
    assert len(re.findall(r"QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3 ", listing)) == qgmma > 0
    d, block_n = variant.spec["HEAD_DIM"], variant.config.constexprs["BLOCK_N"]
    # Per consumer, three issue sites of each product (prologue or epilogue, masked loop, unmasked
    # loop), each of D/32 (Q.K^T) or BLOCK_N/32 (P.V) k-steps of 32; two consumers.
    assert qgmma == 2 * 3 * (d + block_n) // 32
    # P.V's A operand is P in registers: `QGMMA ... Racc, Rp, gdesc[...]` (Q.K^T reads both from
    # shared memory: `Racc, gdesc[...]`).
    assert len(re.findall(r"QGMMA\.\S+ R\d+, R\d+, gdesc", listing)) == 2 * 3 * block_n // 32
    fences = ops.get("WARPGROUP.ARRIVE", 0)
    assert qgmma >= min(d, block_n) // 32 * fences > 0, f"wgmma serialized by ptxas: {qgmma} QGMMA, {fences} fences"
    assert listing_loop_spills(listing) == 0, "local memory in the key loops"


def test_the_exp2_split_config_takes_a_quarter_of_the_unmasked_blocks_exp2_off_the_special_function_unit(
        built: Path) -> None:
    """With FP8 matmuls a key block's exp2 on the special-function unit takes about as long as its
    matmuls: EXP2_SPLIT computes half of an unmasked block's P with attn_fwd_sm90's polynomial
    (FMA and integer pipes). Per consumer thread that block's P is 64 x BLOCK_N / 128 values, so
    the unmasked loop of each of the two consumers loses BLOCK_N / 4 ``MUFU.EX2``; the twin config
    is otherwise the same (and the masked loop, the prologue and the epilogue are unchanged)."""
    from tests.helpers.sass import sass_ops

    variants = _variants(built)
    split, twin = variants[SPLIT], variants[TWIN]
    assert split.config.constexprs == {**twin.config.constexprs, "EXP2_SPLIT": 1}
    ops = [sass_ops(lzma.decompress((built / v.image.path).read_bytes())) for v in (split, twin)]
    block_n = split.config.constexprs["BLOCK_N"]
    assert ops[0]["MUFU.EX2"] == ops[1]["MUFU.EX2"] - 2 * block_n // 4
    # The polynomial: three more FMAs a value at least (degree 3, Horner).
    assert ops[0].get("FFMA", 0) >= ops[1].get("FFMA", 0) + 2 * 3 * block_n // 4


def test_the_key_order_hands_p_to_the_pv_wgmma_without_shuffles_or_byte_repacking(built: Path) -> None:
    """KEY_ORDER=1 (every config but the last): P's e4m3 bytes are already in the registers of the
    threads whose P·V operand takes them, so the kernel has no ``SHFL.IDX`` (the keys-in-order twin
    moves P with them; ``SHFL.BFLY`` are the row maxima and sums, in both), and P rounded just before
    its wgmma is packed by its conversions instead of a byte at a time (``PRMT``, ``LOP3``)."""
    from tests.helpers.sass import sass_ops

    variants = _variants(built)
    ordered, in_order = variants[TWIN], variants[IN_ORDER]
    assert ordered.config.constexprs == {**in_order.config.constexprs, "KEY_ORDER": 1}
    ops = [sass_ops(lzma.decompress((built / v.image.path).read_bytes())) for v in (ordered, in_order)]
    assert ops[0].get("SHFL.IDX", 0) == 0 < ops[1].get("SHFL.IDX", 0)
    assert ops[0]["SHFL.BFLY"] == ops[1]["SHFL.BFLY"]
    assert sum(n for op, n in ops[0].items() if op.startswith("PRMT")) * 5 < sum(
        n for op, n in ops[1].items() if op.startswith("PRMT"))
    assert sum(n for op, n in ops[0].items() if op.startswith("F2FP")) == sum(
        n for op, n in ops[1].items() if op.startswith("F2FP"))
