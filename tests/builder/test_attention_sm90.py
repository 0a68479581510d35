"""The Gluon sm90 forward (builder/kernels/attention_sm90.py) through the builder, on the CPU.

It compiles for sm90 with the builder's own path (GluonASTSource), its binary proves the
catalog's argument layout, its argument list is attn_fwd's (the operator passes the same values
by name), and no other target builds it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("triton")
pytest.importorskip("elftools")


def _kernels():
    from builder.registry import load_kernels

    return load_kernels()


def test_the_gluon_forward_is_built_for_sm90_only() -> None:
    from builder.registry import expand
    from builder.targets import parse_targets

    jobs = expand(_kernels()["attn_fwd_sm90"], parse_targets("sm80,sm90,gfx942,gfx950"), "full", "3.6.0")
    assert jobs and {j.target.arch for j in jobs} == {"sm90"}
    assert {j.spec["dtype"] for j in jobs} == {"fp16", "bf16"}
    assert all(j.spec["HEAD_DIM"] == j.spec["HEAD_DIM_V"] for j in jobs)


def test_the_gluon_forward_is_not_in_the_default_set() -> None:
    from builder.registry import expand
    from builder.targets import parse_targets

    assert expand(_kernels()["attn_fwd_sm90"], parse_targets("sm90"), "default", "3.6.0") == []


def test_its_runtime_arguments_are_attn_fwds_in_order_and_type() -> None:
    kernels = _kernels()
    portable, gluon = kernels["attn_fwd"], kernels["attn_fwd_sm90"]

    def runtime(k):
        return [(n, t) for n, t in k.signature.items() if t != "constexpr"]

    assert runtime(gluon) == runtime(portable)
    assert {n: d for n, d in gluon.divisibility.items()} == dict(portable.divisibility)


def test_the_builder_picks_gluons_source_class_for_gluon_kernels_only() -> None:
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    from builder.compile import source_class

    kernels = _kernels()
    assert source_class(kernels["attn_fwd_sm90"].fn) is GluonASTSource
    assert source_class(kernels["attn_fwd"].fn) is ASTSource


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One variant (bf16 D=64 bottom-right causal, config #0) built by the builder, proof included."""
    from builder.build import build
    from builder.registry import expand
    from builder.targets import parse_targets

    want = {"dtype": "bf16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 2, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0}
    jobs = [j for j in expand(_kernels()["attn_fwd_sm90"], parse_targets("sm90"), "full", "3.6.0")
            if j.spec == want and j.config_index == 0]
    assert len(jobs) == 1
    out = tmp_path_factory.mktemp("gluon")
    summary = build(jobs, out, workers=1, timeout=600, keep_going=False, triton_version="3.6.0", quiet=True)
    assert summary.failed == [] and summary.compiled == 1
    return out


def test_an_sm90_gluon_variant_compiles_and_its_binary_proves_the_catalog_layout(built: Path) -> None:
    from aotriton_rt.catalog import Catalog
    from builder.build import verify_folder
    from builder.kernels.attention_sm90 import CONSUMER_REGS

    assert verify_folder(built) == 1
    (variant,) = Catalog.load(built / "catalog.json").variants
    assert variant.kernel == "attn_fwd_sm90" and variant.target.arch == "sm90"
    # Two consumer warp groups and the loader's group (its one warp padded to a group).
    assert variant.num_warps == 12 and variant.config.num_warps == 4
    assert variant.config.constexprs["CONSUMER_REGS"] == CONSUMER_REGS
    # Three device-side TMA descriptors (Q, K, V), 128 bytes each, in the runtime's global scratch.
    assert variant.scratch["global_size"] == 3 * 128 and variant.scratch["global_align"] == 128
    # attn_fwd's argument list: the operator's argument values fit unchanged.
    assert [a.name for a in variant.args] == [n for n, t in _kernels()["attn_fwd"].signature.items()
                                              if t != "constexpr"]
    assert variant.shared <= 232448


def test_a_catalog_that_lies_about_the_gluon_binary_fails_the_abi_proof(built: Path) -> None:
    import lzma

    from aotriton_rt.catalog import Catalog
    from builder.abi import AbiError, prove

    (variant,) = Catalog.load(built / "catalog.json").variants
    raw = lzma.decompress((built / variant.image.path).read_bytes())
    prove(variant.to_json(), raw)
    wrong_warps = {**variant.to_json(), "num_warps": 4}  # the binary requires 12 warps (384 threads)
    with pytest.raises(AbiError, match=r"num_warps .*catalog has \(128, 1, 1\), binary has \(384, 1, 1\)"):
        prove(wrong_warps, raw)
    args = [dict(a) for a in variant.to_json()["args"]]
    args[-1]["offset"] += 4  # window_right moved
    with pytest.raises(AbiError, match=r"ABI mismatch in attn_fwd_sm90 .*args\[\d+\]\.offset"):
        prove({**variant.to_json(), "args": args}, raw)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
