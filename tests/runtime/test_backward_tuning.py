"""The backward's tuned scheme and kernels at run time: a database's whole-backward decisions folded
for the gputest jobs route calls (scheme, dK/dV and dQ kernels per length bin), an ``atomic`` scheme
rule never serves a deterministic call, and explain names the rule that decided each choice or says
"untuned". Dispatch only: the catalogs are synthetic (as this checkout declares the kernels) and
nothing is launched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import aotriton_rt
from aotriton_rt.ops import attention as op
from builder import tuning
from builder.registry import expand, load_kernels
from builder.targets import KNOWN
from tests.runtime.test_attention_op import _synthetic_variant, qkv

ROOT = Path(__file__).resolve().parents[2]
OWN_DKDV, OWN_DQ = "attn_bwd_dkdv_sm90", "attn_bwd_dq_sm90"
CALL = {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0, "DROPOUT": 0, "VARLEN": 0, "BIAS": 0}
PAIRS = (("split", OWN_DKDV, OWN_DQ), ("split", OWN_DKDV, "attn_bwd_dq"), ("split", "attn_bwd_dkdv", OWN_DQ),
         ("split", "attn_bwd_dkdv", "attn_bwd_dq"), ("atomic", "attn_bwd_dkdv", "attn_bwd_dq_convert"))


def _whole(n: int, times: list[float], spec: dict) -> tuning.Entry:
    timings = tuple(tuning.Timing(i, {"scheme": s, "attn_bwd_dkdv": dkdv,
                                      "attn_bwd_dq" if s == "split" else "attn_bwd_dq_convert": last}, t)
                    for i, ((s, dkdv, last), t) in enumerate(zip(PAIRS, times)))
    return tuning.Entry(tuning.BACKWARD, spec, n, {}, timings)


def _catalog(folder: Path, table: dict) -> Path:
    """sm90 images holding fp16 D=64 no mask and causal (mode 2) with both schemes and both Gluon
    kernels, and ``table`` as their tuning."""
    variants = [_synthetic_variant("attn_bwd_dq_convert", {"dtype": "fp16", "HEAD_DIM": 64, "VARLEN": 0}),
                _synthetic_variant("attn_fwd", CALL)]
    pre = {k: CALL[k] for k in ("dtype", "HEAD_DIM", "HEAD_DIM_V", "VARLEN")}
    for atomic in (0, 1):
        variants.append(_synthetic_variant("attn_bwd_preprocess", {**pre, "DQ_ATOMIC": atomic}))
    for causal in (0, 2):
        spec = {**CALL, "CAUSAL": causal}
        variants += [_synthetic_variant("attn_bwd_dq", spec), _synthetic_variant(OWN_DQ, spec),
                     _synthetic_variant(OWN_DKDV, {**spec, "DQ_ATOMIC": 0})]
        variants += [_synthetic_variant("attn_bwd_dkdv", {**spec, "DQ_ATOMIC": a}) for a in (0, 1)]
    (folder / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                     "triton_version": "3.6.0", "tuning": table,
                                                     "variants": variants}))
    return folder


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> aotriton_rt.Library:
    """No mask: up to 2047 the split scheme with the Gluon dK/dV and the portable dQ; from 2048 the
    atomic scheme, and for deterministic calls the split one with both Gluon kernels. Causal: not
    measured."""
    entries = [_whole(1024, [10, 9, 12, 11, 20], CALL), _whole(2048, [20, 22, 24, 24, 15], CALL)]
    db = tuning.database(entries, arch="sm90", machine={"gpu": "NVIDIA H200"}, method={})
    jobs = [j for name in ("attn_bwd_dkdv", "attn_bwd_dq", OWN_DKDV, OWN_DQ)
            for j in expand(load_kernels()[name], [KNOWN["sm90"]], "gputest", "3.6.0")]
    table, notes = tuning.fold([("sm90.json", db)], jobs)
    assert notes == ["sm90.json: 5 rules folded, 0 dropped"]
    return aotriton_rt.Library(_catalog(tmp_path_factory.mktemp("bwd"), table))


def _ran(lib, n: int, causal: bool = False, **kw) -> tuple[str, ...]:
    handles = op.attention_kernels(*qkv(S=n, D=64), causal=causal, backward=True, library=lib, **kw)
    return tuple(handles[role].name for role in handles if role != "attn_bwd_preprocess")


def test_the_folded_decisions_pick_the_scheme_and_kernels_per_length(tuned: aotriton_rt.Library) -> None:
    assert _ran(tuned, 1000) == (OWN_DKDV, "attn_bwd_dq")
    assert _ran(tuned, 3000) == ("attn_bwd_dkdv", "attn_bwd_dq_convert")


def test_an_atomic_scheme_rule_never_serves_a_deterministic_call(tuned: aotriton_rt.Library) -> None:
    assert _ran(tuned, 3000, deterministic=True) == (OWN_DKDV, OWN_DQ)
    ex = op.explain(dtype="fp16", head_dim=64, seqlen_q=3000, backward=True, deterministic=True, arch="sm90",
                    library=tuned)
    assert ex.scheme == "split"
    assert ex.scheme_reason == ("deterministic=True (the atomic scheme is not reproducible; "
                                "tuning['attn_bwd_mode'] is not asked)")


def test_a_scheme_rule_for_every_call_still_leaves_deterministic_calls_split(tmp_path: Path) -> None:
    lib = aotriton_rt.Library(_catalog(tmp_path, {"attn_bwd_mode": [{"mode": "atomic"}]}))
    assert _ran(lib, 100) == ("attn_bwd_dkdv", "attn_bwd_dq_convert")
    assert _ran(lib, 100, deterministic=True) == (OWN_DKDV, OWN_DQ)
    assert _ran(lib, 100, scheme="split") == (OWN_DKDV, OWN_DQ)


def test_a_scheme_rule_names_the_mask_mode_of_the_calls_it_serves(tuned: aotriton_rt.Library) -> None:
    # The rule's spec is the split dK/dV spec of the call (mode_spec): no-mask rules leave causal calls alone.
    assert _ran(tuned, 3000, causal=True) == (OWN_DKDV, OWN_DQ)
    ex = op.explain(dtype="fp16", head_dim=64, seqlen_q=3000, causal=True, backward=True, arch="sm90", library=tuned)
    assert ex.scheme_spec == {**CALL, "CAUSAL": 2}
    assert ex.scheme_reason.startswith("untuned (no rule of tuning['attn_bwd_mode'] matches; heuristic: the "
                                       "deterministic split scheme")
    assert [k.kernel_reason.split(";")[0] for k in ex.kernels[1:]] == [
        "untuned (no rule of tuning['attn_bwd_dkdv_kernel'] matches", "untuned (no rule of "
        "tuning['attn_bwd_dq_kernel'] matches"]


def test_explain_names_the_rule_behind_the_scheme_and_each_kernel(tuned: aotriton_rt.Library) -> None:
    short = op.explain(dtype="fp16", head_dim=64, seqlen_q=1000, backward=True, arch="sm90", library=tuned)
    assert short.scheme == "split" and [k.role for k in short.kernels] == [
        "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    assert short.scheme_reason == ("tuned (rule #0 of tuning['attn_bwd_mode'], from tuning database sm90 (NVIDIA "
                                   "H200), whole backward, split vs atomic measured at seqlen_k 1024..1024, "
                                   "seqlen_k in [0, 2047], arch sm90)")
    assert [k.kernel for k in short.kernels[1:]] == [OWN_DKDV, "attn_bwd_dq"]
    assert short.kernels[2].kernel_reason == (
        "tuned (rule #0 of tuning['attn_bwd_dq_kernel'], from tuning database sm90 (NVIDIA H200), whole split "
        "backward, attn_bwd_dq_sm90 vs attn_bwd_dq measured at seqlen_q 1024..1024, seqlen_q in [0, 2047], arch sm90)")
    text = str(op.explain(dtype="fp16", head_dim=64, seqlen_q=5000, backward=True, arch="sm90", library=tuned))
    assert "  scheme atomic: tuned (rule #1 of tuning['attn_bwd_mode']" in text
    assert "attn_bwd_dq_convert[" in text and "attn_bwd_dq_sm90" not in text


def test_the_cli_explains_the_backward_choices_and_info_names_their_source(tuned: aotriton_rt.Library) -> None:
    folder = str(tuned.found.folders[0])
    run = subprocess.run([sys.executable, "-m", "aotriton_rt", "explain", "attention", "--images", folder, "--arch",
                          "sm90", "--dtype", "fp16", "--head-dim", "64", "--seqlen", "1000", "--backward"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[2] == ("attention backward on sm90: fp16, head dim 64, no mask, seqlen_q 1000, seqlen_k 1000")
    assert lines[3].startswith("  scheme split: tuned (rule #0 of tuning['attn_bwd_mode'], from tuning database")
    assert lines[6].startswith("  attn_bwd_dq[") and lines[6].endswith(
        "kernel: tuned (rule #0 of tuning['attn_bwd_dq_kernel'], from tuning database sm90 (NVIDIA H200), whole split "
        "backward, attn_bwd_dq_sm90 vs attn_bwd_dq measured at seqlen_q 1024..1024, seqlen_q in [0, 2047], arch sm90)")
    info = subprocess.run([sys.executable, "-m", "aotriton_rt", "info", "--images", folder], cwd=ROOT,
                          capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    assert ("attn_bwd_mode 2 rules (tuning database sm90 (NVIDIA H200), whole backward, split vs atomic)"
            in info.stdout), info.stdout
