"""GPU: `python -m builder tune` times the built forward configs through the runtime, writes a database
that loads and folds into a catalog without a dropped rule, and explain then says "tuned".

Needs an image folder with every sm90 attn_fwd config of fp16 D=128 (``AOTRITON_RT_TEST_IMAGES``,
e.g. ``python -m builder build --set gputest --targets sm90 --out .gpu-images``); about 20 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def _tune(images, out, kernels: str, head_dim: int) -> subprocess.CompletedProcess:
    """``builder tune`` of ``kernels`` at fp16, one head dim, both masks, bins 1024 and 4096, two rounds."""
    return subprocess.run([sys.executable, "-m", "builder", "tune", "--images", str(images), "--out", str(out),
                           "--kernels", kernels, "--bins", "1024,4096", "--dtypes", "fp16", "--head-dims",
                           str(head_dim), "--causal", "0,1", "--rounds", "2"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OUT": ""})


def test_tune_writes_a_database_the_build_folds_and_explain_reports(gpu_images: Path, tmp_path: Path) -> None:
    import triton

    import aotriton_rt
    from aotriton_rt.ops import attention as op
    from builder import tuning
    from builder.registry import expand, load_kernels
    from builder.targets import KNOWN

    if "attn_fwd" not in aotriton_rt.Library(gpu_images).kernels:
        pytest.skip(f"{gpu_images} has no attn_fwd: set AOTRITON_RT_TEST_IMAGES to a folder built with it "
                    "(python -m builder build --set gputest --targets sm90 --out .gpu-images)")
    out = tmp_path / "tuning.json"
    run = _tune(gpu_images, out, "attn_fwd", 128)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    db = tuning.load(out)
    assert db["machine"]["gpu"] and db["arch"] in KNOWN
    assert len(db["entries"]) == 4, run.stdout  # 2 masks x 2 bins
    for e in db["entries"]:
        times = [c["us"] for c in e["configs"]]
        assert len(times) >= 2 and all(t is None or t > 0 for t in times)
        assert not any("wrong result" in c.get("note", "") for c in e["configs"]), e
        assert e["winner"] == tuning.winner(tuning.entries_of({"entries": [e]})[0].timings).index
    jobs = expand(load_kernels()["attn_fwd"], [KNOWN[db["arch"]]], "full", triton.__version__)
    table, notes = tuning.fold([("tuning.json", db)], jobs)
    assert notes[0].endswith(" 0 dropped"), notes
    # The runtime on the folded table: the catalog's own rules replaced, as a build would write them.
    # The forward this test tuned (the sm90 Gluon one would serve these calls otherwise).
    lib = aotriton_rt.Library(gpu_images).with_tuning({**table, "attn_fwd_kernel": [{"kernel": "attn_fwd"}]})
    for n in (1000, 5000):
        ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=n, causal=True, library=lib)
        assert ex.tuned, str(ex)
        assert "from tuning database" in ex.kernels[0].choice.reason
    # Same measurements, same bytes.
    again = tuning.database(tuning.entries_of(db), arch=db["arch"], machine=db["machine"], method=db["method"],
                            tolerance=db["method"]["tolerance"])
    assert tuning.dumps(again) == out.read_bytes()
    print(json.dumps(db["rules"], indent=1))


def test_tune_measures_the_backwards_kernels_and_scheme_and_deterministic_calls_stay_split(
        gpu_images: Path, tmp_path: Path) -> None:
    """`tune --kernels attn_bwd` on gputest sm90 images: fp16 D=64, no mask (both schemes, both Gluon
    kernels) and causal, two bins; about 30 s on the H200."""
    import triton

    import aotriton_rt
    from aotriton_rt.ops import attention as op
    from builder import tuning
    from builder.registry import expand, load_kernels
    from builder.targets import KNOWN

    lib = aotriton_rt.Library(gpu_images)
    if not {"attn_bwd_dkdv_sm90", "attn_bwd_dq_sm90", "attn_bwd_dq_convert"} <= set(lib.kernels):
        pytest.skip(f"{gpu_images} lacks the Gluon backward or the atomic scheme: set AOTRITON_RT_TEST_IMAGES to "
                    "`python -m builder build --set gputest --targets sm90 --no-tuning-db --out .gpu-images`")
    out = tmp_path / "bwd.json"
    run = _tune(gpu_images, out, "attn_bwd", 64)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    db = tuning.load(out)
    assert {e["kernel"] for e in db["entries"]} == {"attn_bwd"} and len(db["entries"]) == 4, run.stdout
    for e in db["entries"]:
        schemes = [c["params"]["scheme"] for c in e["configs"]]
        assert len(schemes) >= 4 and schemes[0] == "split", e  # 2 dK/dV x 2 dQ kernels at least
        assert e["configs"][0]["params"]["attn_bwd_dkdv"] == "attn_bwd_dkdv_sm90"
        assert all(c["us"] is not None and c["us"] > 0 for c in e["configs"]), e  # none failed or wrong
        if e["spec"]["CAUSAL"] == 0:
            assert "atomic" in schemes, e  # gputest holds fp16 D=64's atomic-dQ backward
    assert {"attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"} <= set(db["rules"]), db["rules"]
    jobs = [j for name in ("attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_dkdv_sm90", "attn_bwd_dq_sm90")
            for j in expand(load_kernels()[name], [KNOWN[db["arch"]]], "gputest", triton.__version__)]
    table, notes = tuning.fold([("bwd.json", db)], jobs)
    assert notes[0].endswith(" 0 dropped"), notes
    lib = lib.with_tuning(table)
    for n in (1000, 5000):
        ex = op.explain(dtype="fp16", head_dim=64, seqlen_q=n, backward=True, library=lib)
        if "attn_bwd_mode" in table:
            assert ex.scheme_reason.startswith("tuned (rule"), str(ex)
        if ex.scheme == "split":  # (the atomic scheme's kernels have no alternative in these images)
            assert all(k.kernel_reason.startswith("tuned (rule") for k in ex.kernels[1:]), str(ex)
        det = op.explain(dtype="fp16", head_dim=64, seqlen_q=n, backward=True, deterministic=True, library=lib)
        assert det.scheme == "split" and det.kernels[-1].role == "attn_bwd_dq", str(det)
    again = tuning.database(tuning.entries_of(db), arch=db["arch"], machine=db["machine"], method=db["method"],
                            tolerance=db["method"]["tolerance"])
    assert tuning.dumps(again) == out.read_bytes()
    print(run.stdout[-3000:])
