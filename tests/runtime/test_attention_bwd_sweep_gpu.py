"""Every sm90 config of the split backward's sweep (``bwdsweep`` set: dK/dV and dQ alternates, TMA
and register-capped ones included) against an fp32 reference on an H100/H200 (marker ``gpu``).

Each config runs through the operator (``attention_backward`` on a library view that forces it,
the other backward kernel at config 0) on ragged problems in NaN-filled buffers (rows past each
sequence are NaN, so a read past a sequence poisons the result): lengths that are no block
multiple, more keys than queries and more queries than keys (rows that see no key under the
bottom-right band), sequences shorter than one block, GQA. The check is bench/sm90_bwd.py's
(AOTriton's bound: 4x the error of the same math in the input dtype, plus an epsilon).

Images: ``AOTRITON_RT_BWD_SWEEP_IMAGES`` pointing at ``python -m builder build --set bwdsweep
--targets sm90 --kernels attn_fwd,attn_bwd_preprocess,attn_bwd_dkdv,attn_bwd_dq`` (or the folder
bench/sm90_bwd.py built).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import aotriton_rt  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROBLEMS = ("ragged_gqa", "more_queries", "short")  # bench/sm90_bwd.py's CHECK_PROBLEMS


@pytest.fixture(scope="module")
def sweep():
    folder = os.environ.get("AOTRITON_RT_BWD_SWEEP_IMAGES")
    if not folder:
        pytest.skip("set AOTRITON_RT_BWD_SWEEP_IMAGES to images built with --set bwdsweep --targets sm90")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU (H100/H200)")
    sys.path.insert(0, str(ROOT / "bench"))
    import sm90_bwd

    lib = aotriton_rt.Library(folder)
    cands = sm90_bwd.candidates_of(lib, sm90_bwd.shapes_of("all", "fp16,bf16"))
    assert len({c["index"] for c in cands}) > 1, f"{folder} holds no sweep alternates"
    return sm90_bwd, lib, cands


@pytest.mark.parametrize("problem", PROBLEMS)
def test_every_backward_sweep_config_matches_the_fp32_reference(sweep, problem: str) -> None:
    bench, lib, cands = sweep
    failed = []
    for cand in cands:
        res = bench.check(torch, lib, cand, problems={problem: bench.CHECK_PROBLEMS[problem]})
        if not res["ok"]:
            failed.append(bench.check_line({**res, **cand}))
    assert not failed, "\n".join(failed)
