"""The kernel sources under a Triton release other than the pinned one.

The builder is pinned to Triton 3.6.0 and the wheels ship what it compiles. The same sources also
compile with Triton 3.9.0 (the Gluon calls whose names moved between the releases go through
``builder/kernels/_gluon.py``), so the code each release generates can be compared on a GPU from
one source tree. CI installs 3.9.0 beside the pinned release and runs this file with it first on
the path and ``AOTRITON_BUILDER_EXPECT_TRITON=3.9.0``; without that variable the file skips.

Each variant goes through the builder's own path: compile, then the ABI proof of the binary
against the catalog (argument offsets, parameter block size, thread count). Built here: the
sm90 Gluon variants that use every moved name (TMA loads into reinterpreted 3-D and 4-D views,
TMA reduce-adds, persistent loops), the portable forward for sm90 and, under the pinned release
too, the same list, so both runs check the same variants.
"""

from __future__ import annotations

import lzma
import os
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("elftools")

from tests.helpers.sass import sass_ops  # noqa: E402

EXPECT = os.environ.get("AOTRITON_BUILDER_EXPECT_TRITON")

_BASE = {"BIAS": 0, "DROPOUT": 0, "VARLEN": 0, "SOFTCAP": 0, "ALIBI": 0}
_D128 = {"dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128}
#: (kernel, spec, config, SASS opcodes it must hold): one variant per moved name and loop shape.
VARIANTS = (
    # Persistent forward: 4-D views of the Q/K/V ring slots, TMA loads.
    ("attn_fwd_sm90", {**_D128, "CAUSAL": 0, **_BASE}, 7, ("UTMALDG", "HGMMA")),
    # dK/dV with FA3's dQ: one TMA reduce-add per tile from a reinterpreted 3-D view.
    ("attn_bwd_dkdv_sm90", {**_D128, "CAUSAL": 0, **_BASE, "DQ_ATOMIC": 1}, 5, ("UTMALDG", "UTMAREDG", "HGMMA")),
    # The same, persistent: 4-D views and the reduce inside the unit loop.
    ("attn_bwd_dkdv_sm90", {**_D128, "CAUSAL": 2, **_BASE, "DQ_ATOMIC": 1}, 7, ("UTMALDG", "UTMAREDG", "HGMMA")),
    # Persistent dQ.
    ("attn_bwd_dq_sm90", {**_D128, "CAUSAL": 1, **_BASE}, 3, ("UTMALDG", "HGMMA")),
    # Persistent FP8 forward (e4m3 wgmma).
    ("attn_fwd_fp8_sm90", {"dtype": "fp8e4nv", "out_dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128,
                           "CAUSAL": 0, "VARLEN": 0}, 3, ("UTMALDG", "QGMMA")),
    # The portable forward (tl.dot lowered by Triton's own pipeliner).
    ("attn_fwd", {**_D128, "CAUSAL": 2, **_BASE}, 0, ("HGMMA",)),
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """VARIANTS, built for sm90 by the builder under the Triton release on the path, proof included."""
    import triton

    from builder.build import build
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    kernels = load_kernels()
    jobs = []
    for name, spec, config, _ in VARIANTS:
        found = [j for j in expand(kernels[name], parse_targets("sm90"), "full", triton.__version__)
                 if j.spec == spec and j.config_index == config]
        assert len(found) == 1, (name, spec, config)
        jobs += found
    out = tmp_path_factory.mktemp("releases")
    summary = build(jobs, out, workers=2, timeout=600, keep_going=False, triton_version=triton.__version__,
                    quiet=True)
    assert summary.failed == [] and summary.compiled == len(VARIANTS)
    return out


def test_the_release_on_the_path_is_the_one_ci_installed() -> None:
    import triton

    if EXPECT is None:
        pytest.skip("AOTRITON_BUILDER_EXPECT_TRITON is not set (CI sets it when it runs this file "
                    "under a second Triton release)")
    assert triton.__version__ == EXPECT


def test_every_variant_compiles_proves_its_abi_and_keeps_its_tensor_core_and_tma_code(built: Path) -> None:
    import triton

    from aotriton_rt.catalog import Catalog
    from builder.build import prove_folder

    catalog = Catalog.load(built / "catalog.json")
    assert catalog.triton_version == triton.__version__
    assert prove_folder(built) == len(VARIANTS)
    held = {(v.kernel, tuple(sorted(v.spec.items())), v.config.index): v for v in catalog.variants}
    for name, spec, config, opcodes in VARIANTS:
        variant = held[(name, tuple(sorted(spec.items())), config)]
        assert variant.triton_version == triton.__version__
        ops = sass_ops(lzma.decompress((built / variant.image.path).read_bytes()))
        for opcode in opcodes:
            assert any(op.startswith(opcode) for op in ops), (name, config, opcode, sorted(ops)[:40])
        # The Gluon kernels: two consumer warp groups and the loader's; the portable one: its config's warps.
        assert variant.num_warps == (12 if name.endswith("sm90") else variant.config.num_warps)
