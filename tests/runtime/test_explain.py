"""explain: which variant and config an attention call runs and why, agreeing with the dispatcher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import aotriton_rt
from aotriton_rt import ArgumentError, KernelNotFound, UnsupportedError
from aotriton_rt.ops import attention as op
from aotriton_rt.tuning import explain_config
from builder import tuning
from builder.registry import expand, load_kernels
from builder.targets import KNOWN
from tests.runtime.test_attention_op import Dev, _synthetic_variant, qkv

ROOT = Path(__file__).resolve().parents[2]
BASE = {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0, "SOFTCAP": 0}
CAUSAL = {**BASE, "CAUSAL": 2}


def _database() -> dict:
    """A measured database: causal fp16 D=128 forward, config 1 wins from 4096 on; nothing at D=64."""
    decl = load_kernels()["attn_fwd"]

    def params(i: int) -> dict:
        c = decl.configs_for(CAUSAL, KNOWN["sm90"])[i]
        return {**c.constexprs, "num_warps": c.num_warps, "num_stages": c.num_stages}

    entries = [tuning.Entry("attn_fwd", CAUSAL, n, {}, (tuning.Timing(0, params(0), n * 1.0),
                                                         tuning.Timing(1, params(1), n * (1.1 if n < 4096 else 0.8))))
               for n in (1024, 2048, 4096, 8192)]
    return tuning.database(entries, arch="sm90", machine={"gpu": "NVIDIA H200"}, method={})


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sm90 images (synthetic, never launched): fp16 forward at D=64 and D=128, configs 0 and 1, no
    mask and causal, and the split backward at D=128; the tuning table folded from _database()."""
    specs = [{**BASE, "HEAD_DIM": d, "HEAD_DIM_V": d, "CAUSAL": c} for d in (64, 128) for c in (0, 2)]
    # The images' variants predate the ALIBI axis; the builder's (ALIBI=0) take the database's rules too.
    jobs = [j for j in expand(load_kernels()["attn_fwd"], [KNOWN["sm90"]], "full", "3.6.0")
            if {k: v for k, v in j.spec.items() if k != "ALIBI"} in specs and not j.spec["ALIBI"]
            and j.config_index < 2]
    table, notes = tuning.fold([("sm90.json", _database())], jobs)
    assert notes == ["sm90.json: 2 rules folded, 0 dropped"]
    variants = [_synthetic_variant("attn_fwd", spec, i) for spec in specs for i in (0, 1)]
    variants.append(_synthetic_variant("attn_bwd_preprocess", {**{k: BASE[k] for k in ("dtype", "HEAD_DIM",
                                                                                        "HEAD_DIM_V", "VARLEN")},
                                                               "DQ_ATOMIC": 0}))
    variants.append(_synthetic_variant("attn_bwd_dkdv", {**CAUSAL, "DQ_ATOMIC": 0}))
    variants.append(_synthetic_variant("attn_bwd_dq", CAUSAL))
    folder = tmp_path_factory.mktemp("tuned")
    (folder / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                     "triton_version": "3.6.0", "tuning": table,
                                                     "variants": variants}))
    return folder


def test_a_measured_call_is_tuned_naming_the_database_and_the_bin(tuned: Path) -> None:
    lib = aotriton_rt.Library(tuned)
    long = op.explain(dtype="fp16", head_dim=128, seqlen_q=8000, causal=True, arch="sm90", library=lib)
    (pick,) = long.kernels
    assert long.tuned and pick.config == 1 and pick.spec == CAUSAL
    assert pick.choice.reason == ("tuned (rule #1 of tuning['attn_fwd'], from tuning database sm90 (NVIDIA H200), "
                                  "measured at seqlen_q 4096..8192, seqlen_q in [4096, inf], arch sm90)")
    assert pick.params == {**_synthetic_params(CAUSAL, 1)}
    short = op.explain(dtype="fp16", head_dim=128, seqlen_q=100, causal=True, arch="sm90", library=lib).kernels[0]
    assert short.tuned and short.config == 0 and "seqlen_q in [0, 4095]" in short.choice.reason


def _synthetic_params(spec: dict, index: int) -> dict:
    c = load_kernels()["attn_fwd"].configs_for(spec, KNOWN["sm90"])[index]
    return {**c.constexprs, "num_warps": c.num_warps, "num_stages": c.num_stages}


def test_an_unmeasured_call_says_untuned_and_runs_the_heuristic_config_0(tuned: Path) -> None:
    lib = aotriton_rt.Library(tuned)
    ex = op.explain(dtype="fp16", head_dim=64, seqlen_q=8000, arch="sm90", library=lib)
    assert not ex.tuned and ex.kernels[0].config == 0
    assert ex.kernels[0].choice.reason.startswith("untuned (no rule of tuning['attn_fwd'] matches; heuristic: "
                                                  "config 0, the first of the kernel's config table")
    backward = op.explain(dtype="fp16", head_dim=128, seqlen_q=8000, causal=True, backward=True, arch="sm90",
                          library=lib)
    assert backward.scheme == "split" and [k.kernel for k in backward.kernels] == [
        "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    assert backward.scheme_reason == ("untuned (no rule of tuning['attn_bwd_mode'] matches; heuristic: the "
                                      "deterministic split scheme, bit-reproducible)")
    assert all(k.choice.reason.startswith("untuned") for k in backward.kernels)
    assert [k.note for k in backward.kernels] == ["the only config built"] * 3 and ex.kernels[0].note == ""


@pytest.mark.parametrize("seqlen", [100, 1000, 4096, 5000, 20000])
def test_explain_agrees_with_the_kernels_the_dispatcher_picks(tuned: Path, seqlen: int) -> None:
    lib = aotriton_rt.Library(tuned)
    handle = op.attention_kernels(*qkv(S=seqlen, D=128), causal=True, library=lib)["attn_fwd"]
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=seqlen, causal=True, arch="sm90", library=lib)
    assert handle.candidates[0].config.index == ex.kernels[0].config
    assert handle.candidates[0].key == ex.kernels[0].variant_key


def test_a_rule_asking_for_a_config_not_built_says_which_runs(tmp_path: Path) -> None:
    variants = [_synthetic_variant("attn_fwd", {**BASE, "CAUSAL": 0}, 0)]
    (tmp_path / "catalog.json").write_text(json.dumps({
        "schema": "aotriton-rt.catalog", "schema_version": 2, "triton_version": "3.6.0",
        "tuning": {"attn_fwd": [{"config": 2}]}, "variants": variants}))
    pick = op.explain(dtype="fp16", head_dim=128, seqlen_q=64, library=aotriton_rt.Library(tmp_path)).kernels[0]
    assert pick.config == 0 and not pick.tuned
    assert pick.note == "config #2 is not in these images, so #0 runs"


def test_explain_refuses_bad_facts_and_names_what_is_missing(tuned: Path) -> None:
    lib = aotriton_rt.Library(tuned)
    with pytest.raises(ArgumentError, match=r"arch 'sm80' has no images here; built: sm90"):
        op.explain(dtype="fp16", head_dim=128, seqlen_q=64, arch="sm80", library=lib)
    with pytest.raises(ArgumentError, match=r"dtype must be one of fp16, bf16, fp32, got 'int8'"):
        op.explain(dtype="int8", head_dim=128, seqlen_q=64, library=lib)
    with pytest.raises(ArgumentError, match=r"scheme must be None, 'split' or 'atomic', got 'fused'"):
        op.explain(dtype="fp16", head_dim=128, seqlen_q=64, backward=True, scheme="fused", library=lib)
    with pytest.raises(ArgumentError, match=r"seqlen_q must be an integer in \[1, 2\*\*31 - 1\], got 0"):
        op.explain(dtype="fp16", head_dim=128, seqlen_q=0, library=lib)
    with pytest.raises(KernelNotFound, match=r"needs attn_fwd with dtype=bf16, .* on sm90, which these images lack"):
        op.explain(dtype="bf16", head_dim=128, seqlen_q=64, arch="sm90", library=lib)


def test_explain_config_reports_the_rule_it_used() -> None:
    rules = [{"spec": {"HEAD_DIM": 64}, "config": 1}, {"arch": "sm90", "seqlen_k": [1024, 2047], "config": 3,
                                                       "source": "db"}]
    hit = explain_config(rules, kernel="k", spec={"HEAD_DIM": 128}, seqlen_q=1, seqlen_k=1500, arch="sm90")
    assert (hit.config, hit.rule_index, hit.tuned) == (3, 1, True)
    assert hit.reason == "tuned (rule #1 of tuning['k'], from db, seqlen_k in [1024, 2047], arch sm90)"
    miss = explain_config(rules, kernel="k", spec={"HEAD_DIM": 128}, seqlen_q=1, seqlen_k=1500, arch="sm80")
    assert (miss.config, miss.tuned) == (0, False)


def test_the_explain_command_prints_the_pick_without_a_gpu(tuned: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "aotriton_rt", "explain", "attention", "--images", str(tuned),
                          "--arch", "sm90", "--seqlen", "8192", "--causal", "--backward"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == ("attention forward on sm90: fp16, head dim 128, causal/window top-left, seqlen_q 8192, "
                        "seqlen_k 8192")
    assert lines[1].startswith("  attn_fwd[dtype=fp16, HEAD_DIM=128, HEAD_DIM_V=128, CAUSAL=2, BIAS=0, "
                               "DROPOUT=0, VARLEN=0, SOFTCAP=0] config #1 (")
    assert "tuned (rule #1 of tuning['attn_fwd']" in lines[1]
    assert lines[2].startswith("attention backward on sm90") and lines[3].startswith("  scheme split: ")
    bad = subprocess.run([sys.executable, "-m", "aotriton_rt", "explain", "attention", "--images", str(tuned),
                          "--arch", "gfx942", "--seqlen", "64"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip() == "error: arch 'gfx942' has no images here; built: sm90"


#: A bottom-right causal call whose lengths differ, explained for sm90.
LOPSIDED = {"dtype": "fp16", "head_dim": 128, "seqlen_q": 1000, "seqlen_k": 1500, "causal": True,
            "align": "bottom_right", "arch": "sm90"}


def _feature_library(folder: Path, axis: str, portable: tuple[str, ...],
                     extra: list | None = None, without: tuple[str, ...] = ()) -> aotriton_rt.Library:
    """Images of :data:`LOPSIDED`'s spec: ``portable`` kernels with ``axis`` 0 and 1, sm90's Gluon
    backward and the preprocess with 0 only (as they are compiled), and ``extra`` variants;
    ``without``: arguments the forward kernels lack (images built before them)."""
    spec = {**BASE, "CAUSAL": 1, "ALIBI": 0}
    pre = {k: BASE[k] for k in ("dtype", "HEAD_DIM", "HEAD_DIM_V", "VARLEN")}
    dkdv = {"DQ_ATOMIC": 0}
    variants = [_synthetic_variant(name, {**spec, axis: a, **(dkdv if name == "attn_bwd_dkdv" else {})},
                                   without=without if name.startswith("attn_fwd") else ())
                for a in (0, 1) for name in portable]
    variants += [_synthetic_variant("attn_bwd_dkdv_sm90", {**spec, **dkdv}),
                 _synthetic_variant("attn_bwd_dq_sm90", spec),
                 _synthetic_variant("attn_bwd_preprocess", {**pre, **dkdv}), *(extra or [])]
    folder.mkdir(exist_ok=True)
    (folder / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                     "triton_version": "3.6.0", "variants": variants}))
    return aotriton_rt.Library(folder)


def test_alibi_calls_explain_the_portable_alibi_kernels_where_sm90_runs_its_own(tmp_path: Path) -> None:
    """Images holding sm90's forward and backward kernels (ALIBI=0 only, as they are compiled) and
    the portable kernels with and without ALiBi: a call with slopes runs the portable ALIBI=1
    kernels, forward and backward, and explain says so (the Gluon kernels serve no such spec)."""
    gluon_fwd = _synthetic_variant("attn_fwd_sm90", {**BASE, "CAUSAL": 1, "ALIBI": 0})
    lib = _feature_library(tmp_path, "ALIBI", ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"), [gluon_fwd])
    facts = {**LOPSIDED, "library": lib}
    plain = op.explain(**facts, backward=True)
    assert [p.kernel for p in plain.kernels] == ["attn_bwd_preprocess", "attn_bwd_dkdv_sm90", "attn_bwd_dq_sm90"]
    assert op.explain(**facts).kernels[0].kernel == "attn_fwd_sm90"
    fwd = op.explain(**facts, alibi=True)
    (pick,) = fwd.kernels
    assert (pick.kernel, pick.spec["ALIBI"], pick.kernel_reason) == ("attn_fwd", 1, "")
    assert str(fwd).startswith("attention forward on sm90: fp16, head dim 128, causal/window bottom-right, ALiBi, "
                               "seqlen_q 1000, seqlen_k 1500\n  attn_fwd[dtype=fp16, HEAD_DIM=128, HEAD_DIM_V=128, "
                               "CAUSAL=1, BIAS=0, DROPOUT=0, VARLEN=0, SOFTCAP=0, ALIBI=1] config #0")
    bwd = op.explain(**facts, alibi=True, backward=True)
    assert [(p.kernel, p.spec.get("ALIBI")) for p in bwd.kernels] == [
        ("attn_bwd_preprocess", None), ("attn_bwd_dkdv", 1), ("attn_bwd_dq", 1)]
    # explain names the same kernels the operator launches for a call with slopes.
    handles = op.attention_kernels(*qkv(S=1000, Sk=1500, D=128), causal=True, align="bottom_right",
                                   alibi_slopes=Dev(4, dtype="fp32"), backward=True, library=lib)
    assert [(h.name, h.params.get("ALIBI")) for h in handles.values()] == [
        ("attn_bwd_preprocess", None), ("attn_bwd_dkdv", 1), ("attn_bwd_dq", 1)]
    run = subprocess.run([sys.executable, "-m", "aotriton_rt", "explain", "attention", "--images", str(tmp_path),
                          "--arch", "sm90", "--seqlen", "1000", "--seqlen-k", "1500", "--causal", "--align",
                          "bottom_right", "--alibi"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == str(fwd).splitlines()
    with pytest.raises(UnsupportedError, match=r"alibi with bias is not compiled: the ALiBi kernels take no bias "
                                               r"tensor"):
        op.explain(**facts, alibi=True, bias=True)


def test_softcap_calls_explain_the_capped_kernels(tmp_path: Path) -> None:
    """Images holding the forward with and without the cap (sm90's Gluon one too), the portable
    backward capped and not, and sm90's Gluon backward uncapped only (as compiled): a capped
    call runs the SOFTCAP=1 Gluon forward and the portable SOFTCAP=1 backward, an uncapped one
    never a SOFTCAP=1 variant, and explain, its command and warmup's choice say the same."""
    capped = ("attn_fwd", "attn_fwd_sm90", "attn_bwd_dkdv", "attn_bwd_dq")
    facts = {**LOPSIDED, "library": _feature_library(tmp_path / "capped", "SOFTCAP", capped)}
    (fwd,) = op.explain(**facts, softcap=True).kernels
    assert (fwd.kernel, fwd.spec["SOFTCAP"]) == ("attn_fwd_sm90", 1)
    bwd = op.explain(**facts, softcap=True, backward=True)
    assert [(p.kernel, p.spec.get("SOFTCAP")) for p in bwd.kernels] == [
        ("attn_bwd_preprocess", None), ("attn_bwd_dkdv", 1), ("attn_bwd_dq", 1)]
    assert "softcap" in str(bwd).splitlines()[0]
    plain = op.explain(**facts, backward=True)
    assert [(p.kernel, p.spec.get("SOFTCAP")) for p in plain.kernels] == [
        ("attn_bwd_preprocess", None), ("attn_bwd_dkdv_sm90", 0), ("attn_bwd_dq_sm90", 0)]
    assert op.explain(**facts).kernels[0].spec["SOFTCAP"] == 0
    run = subprocess.run([sys.executable, "-m", "aotriton_rt", "explain", "attention", "--images",
                          str(tmp_path / "capped"), "--arch", "sm90", "--seqlen", "1000", "--seqlen-k", "1500",
                          "--causal", "--align", "bottom_right", "--softcap", "--backward"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [*str(op.explain(**facts, softcap=True)).splitlines(), *str(bwd).splitlines()]
    with pytest.raises(UnsupportedError, match=r"alibi_slopes with softcap= is not compiled"):
        op.explain(**facts, alibi=True, softcap=True)
    # With sinks: the forward joins them in its epilogue (no kernel after it), which its line says;
    # the backward has their gradient's kernel after it, which these images lack, as the call would.
    (fused,) = op.explain(**facts, sinks=True).kernels
    assert fused.kernel == "attn_fwd_sm90"
    assert fused.note == "the only config built; joins the attention sinks in its epilogue"
    with pytest.raises(KernelNotFound, match=r"needs attn_sinks_bwd with dtype=fp16 on sm90"):
        op.explain(**facts, sinks=True, backward=True)
    # Images built before the forward took them: the sinks' kernel after the forward's (the epilogue
    # pass, 16-byte steps at D=128) and after the backward's (their gradient).
    old = ("Sinks", "use_sinks")
    with pytest.raises(KernelNotFound, match=r"needs attn_sinks with dtype=fp16, ALIGNED=1 on sm90"):
        op.explain(**{**facts, "library": _feature_library(tmp_path / "old", "SOFTCAP", capped, without=old)},
                   sinks=True)
    sinks = [_synthetic_variant("attn_sinks", {"dtype": "fp16", "ALIGNED": a}) for a in (0, 1)]
    sinks.append(_synthetic_variant("attn_sinks_bwd", {"dtype": "fp16"}))
    facts["library"] = _feature_library(tmp_path / "with-sinks", "SOFTCAP", capped, sinks, without=old)
    assert [(p.kernel, p.spec) for p in op.explain(**facts, sinks=True).kernels[1:]] == [
        ("attn_sinks", {"dtype": "fp16", "ALIGNED": 1})]
    assert op.explain(**{**facts, "head_dim": 100}, sinks=True).kernels[1].spec["ALIGNED"] == 0
    assert [p.kernel for p in op.explain(**facts, sinks=True, backward=True).kernels] == [
        "attn_bwd_preprocess", "attn_bwd_dkdv_sm90", "attn_bwd_dq_sm90", "attn_sinks_bwd"]
    with pytest.raises(ArgumentError, match=r"softcap must be True or False \(whether the call passes it\), got 50"):
        op.explain(**facts, softcap=50)


def test_info_names_the_tuned_kernels_and_their_database(tuned: Path, tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "aotriton_rt", "info", "--images", str(tuned)], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert ("tuning: attn_fwd 2 rules (tuning database sm90 (NVIDIA H200)); other kernels untuned "
            "(`explain attention` says per call)") in run.stdout.splitlines()
    (tmp_path / "catalog.json").write_text(json.dumps({**json.loads((tuned / "catalog.json").read_text()),
                                                       "tuning": {}}))
    bare = subprocess.run([sys.executable, "-m", "aotriton_rt", "info", "--images", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert "tuning: no rules (every kernel untuned: config 0, docs/tuning.md)" in bare.stdout


def _images_with_the_sm90_forward(folder: Path, tuning_table: dict | None = None, archs=("sm90",)) -> Path:
    """Synthetic images (never launched): attn_fwd and attn_fwd_sm90 for fp16 D=128 causal on each
    of ``archs`` (attn_fwd_sm90 on sm90 only), and attn_fwd with a bias."""
    variants = []
    for arch in archs:
        variants.append(_synthetic_variant("attn_fwd", CAUSAL, 0, arch=arch))
        variants.append(_synthetic_variant("attn_fwd", {**CAUSAL, "BIAS": 1}, 0, arch=arch))
    variants.append(_synthetic_variant("attn_fwd_sm90", CAUSAL, 0))
    variants.append(_synthetic_variant("attn_fwd_sm90", CAUSAL, 1))
    (folder / "catalog.json").write_text(json.dumps({
        "schema": "aotriton-rt.catalog", "schema_version": 2, "triton_version": "3.6.0",
        "tuning": tuning_table or {}, "variants": variants}))
    return folder


def test_the_sm90_forward_serves_the_specs_it_holds_and_the_portable_one_the_rest(tmp_path: Path) -> None:
    lib = aotriton_rt.Library(_images_with_the_sm90_forward(tmp_path))
    q, k, v = qkv(S=300, D=128)
    handle = op.attention_kernels(q, k, v, causal=True, library=lib)["attn_fwd"]
    assert handle.name == "attn_fwd_sm90"
    pick = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, arch="sm90", library=lib).kernels[0]
    assert pick.kernel == "attn_fwd_sm90"
    assert pick.line().endswith("kernel: untuned (no rule of tuning['attn_fwd_kernel'] matches; heuristic: sm90's "
                                "own forward, preferred where the images hold it)")
    # A bias is not in attn_fwd_sm90's specs: the portable forward, and nothing to explain about it.
    biased = op.attention_kernels(q, k, v, causal=True, bias=qkv(S=300, D=300)[0], library=lib)["attn_fwd"]
    assert biased.name == "attn_fwd"
    plain = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, bias=True, arch="sm90", library=lib)
    assert plain.kernels[0].kernel == "attn_fwd" and "kernel:" not in str(plain)


def test_a_kernel_rule_sends_its_lengths_to_the_portable_forward(tmp_path: Path) -> None:
    table = {"attn_fwd_kernel": [{"arch": "sm90", "spec": CAUSAL, "seqlen_q": [None, 1023], "kernel": "attn_fwd",
                                  "source": "db"}],
             "attn_fwd_sm90": [{"arch": "sm90", "spec": CAUSAL, "seqlen_q": [4096, None], "config": 1}]}
    lib = aotriton_rt.Library(_images_with_the_sm90_forward(tmp_path, table))
    short = op.attention_kernels(*qkv(S=1000, D=128), causal=True, library=lib)["attn_fwd"]
    long = op.attention_kernels(*qkv(S=5000, D=128), causal=True, library=lib)["attn_fwd"]
    assert (short.name, long.name) == ("attn_fwd", "attn_fwd_sm90")
    assert long.candidates[0].config.index == 1  # the arch forward's own config rules apply
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=1000, causal=True, arch="sm90", library=lib)
    assert ex.kernels[0].kernel_reason == ("tuned (rule #0 of tuning['attn_fwd_kernel'], from db, seqlen_q in "
                                           "[0, 1023], arch sm90)")


def test_a_malformed_kernel_rule_is_refused_when_the_catalog_loads(tmp_path: Path) -> None:
    _images_with_the_sm90_forward(tmp_path, {"attn_fwd_kernel": [{"kernel": "attn fwd; rm"}]})
    with pytest.raises(aotriton_rt.CatalogError, match=r"tuning\['attn_fwd_kernel'\] rule .*kernel must be a kernel"):
        aotriton_rt.Library(tmp_path).variants_of("attn_fwd")


def test_images_of_another_arch_keep_the_portable_forward(tmp_path: Path) -> None:
    lib = aotriton_rt.Library(_images_with_the_sm90_forward(tmp_path, archs=("sm80", "sm90")))
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, arch="sm80", library=lib)
    assert ex.kernels[0].kernel == "attn_fwd"
    assert ex.kernels[0].kernel_reason == "the portable forward (sm80 has no per-architecture forward for this " \
                                          "spec here)"


def test_default_images_run_the_persistent_forward_at_n1024_as_the_database_measured(tmp_path: Path) -> None:
    """The default set holds attn_fwd_sm90's one-tile #0 and persistent #6/#7 at D=128 and its
    persistent #4 at D=64, no mask and mask mode 1; the checked-in database measured bf16 D=128 causal
    in mode 2 (its rules stand for mode 1 too), the other causal specs in mode 1. Folded by the build, short
    sequences run a persistent config of attn_fwd_sm90, in either alignment and at unequal lengths."""
    from builder.kernels.attention_sm90 import TILES

    jobs = [j for name in ("attn_fwd", "attn_fwd_sm90")
            for j in expand(load_kernels()[name], [KNOWN["sm90"]], "default", "3.6.0")
            if j.spec["HEAD_DIM"] in (64, 128)]
    assert {j.spec["CAUSAL"] for j in jobs} == {0, 1}  # what the default set holds
    db = tuning.load(tuning.CHECKED_IN / "sm90.json")
    table, notes = tuning.fold([("sm90.json", db)], jobs)
    assert "mode-2 rules applied to CAUSAL=1" in notes[0]
    variants = [_synthetic_variant(j.kernel, j.spec, j.config_index) for j in jobs]
    (tmp_path / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                       "triton_version": "3.6.0", "tuning": table,
                                                       "variants": variants}))
    lib = aotriton_rt.Library(tmp_path)
    persistent = {128: {len(TILES[128]), len(TILES[128]) + 1}, 64: {len(TILES[64])}}
    for dtype in ("fp16", "bf16"):
        for d in (64, 128):
            for causal, align in ((False, "bottom_right"), (True, "bottom_right"), (True, "top_left")):
                for sq, sk in ((1024, 1024), (1024, 1500)):
                    pick = op.explain(dtype=dtype, head_dim=d, seqlen_q=sq, seqlen_k=sk, causal=causal, align=align,
                                      arch="sm90", library=lib).kernels[0]
                    where = (dtype, d, causal, align, sq, sk)
                    assert pick.kernel == "attn_fwd_sm90" and pick.spec["CAUSAL"] == int(causal), where
                    assert pick.config in persistent[d], where
                    if causal and dtype == "bf16" and d == 128:  # the one pair tune measured in mode 2
                        assert "applied to CAUSAL=1" in pick.kernel_reason, where
    # The dispatcher agrees, and the handle takes the alignment.
    handle = op.attention_kernels(*qkv(S=1000, Sk=1500, D=128), causal=True, align="bottom_right",
                                  library=lib)["attn_fwd"]
    assert handle.name == "attn_fwd_sm90" and handle.params["CAUSAL"] == 1 and "causal_align" in handle.arg_names


def test_gputest_images_run_the_persistent_forward_at_1024_and_explain_names_it_with_its_source(
        tmp_path: Path) -> None:
    """The checked-in database folded into (synthetic) gputest sm90 images: an fp16 D=128 call at
    N=1024 runs attn_fwd_sm90's persistent config #7 without a mask and #6 causal, as the H200 bench
    measured; default images (config #0 of each forward) run their own configs' faster forward."""
    db = tuning.load(tuning.CHECKED_IN / "sm90.json")
    if not any(e.get("source", "").startswith("bench/sm90_persistent.py") for e in db["entries"]):
        pytest.skip("builder tune re-measured the forward: the bench's interim entries are gone")

    def images(build_set: str, folder: Path) -> Path:
        jobs = [j for name in ("attn_fwd", "attn_fwd_sm90")
                for j in expand(load_kernels()[name], [KNOWN["sm90"]], build_set, "3.6.0")
                if j.spec.get("HEAD_DIM") == 128 and {**j.spec, "CAUSAL": 0} == {**BASE, "CAUSAL": 0, "ALIBI": 0}]
        table, _ = tuning.fold([("sm90.json", db)], jobs)
        folder.mkdir()
        (folder / "catalog.json").write_text(json.dumps({
            "schema": "aotriton-rt.catalog", "schema_version": 2, "triton_version": "3.6.0", "tuning": table,
            "variants": [_synthetic_variant(j.kernel, j.spec, j.config_index) for j in jobs]}))
        return folder

    gputest = images("gputest", tmp_path / "gputest")
    run = subprocess.run([sys.executable, "-m", "aotriton_rt", "explain", "attention", "--images", str(gputest),
                          "--arch", "sm90", "--dtype", "fp16", "--head-dim", "128", "--seqlen", "1024"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    line = run.stdout.splitlines()[1]
    assert line.startswith("  attn_fwd_sm90[dtype=fp16, HEAD_DIM=128, HEAD_DIM_V=128, CAUSAL=0, ") and \
        " config #7 (" in line and "PERSISTENT=132" in line, line
    assert "tuning['attn_fwd_sm90'], from bench/sm90_persistent.py --rounds 7 --budget 70, H200, 2026-12-01" in line
    assert "kernel: tuned (rule #" in line and "attn_fwd_sm90 vs attn_fwd measured at seqlen_q 1024" in line
    lib = aotriton_rt.Library(gputest)
    causal = op.explain(dtype="fp16", head_dim=128, seqlen_q=1024, causal=True, arch="sm90", library=lib).kernels[0]
    assert (causal.kernel, causal.spec["CAUSAL"], causal.config) == ("attn_fwd_sm90", 1, 6)
    handle = op.attention_kernels(*qkv(S=1024, D=128), causal=True, library=lib)["attn_fwd"]
    assert (handle.name, handle.candidates[0].config.index) == ("attn_fwd_sm90", 6)  # the dispatcher agrees
    # Default images: config #0 of each; causal at 1024 the portable forward, whose #0 was faster there.
    default = aotriton_rt.Library(images("default", tmp_path / "default"))
    picks = [op.explain(dtype="fp16", head_dim=128, seqlen_q=1024, causal=c, arch="sm90", library=default).kernels[0]
             for c in (False, True)]
    assert [(p.kernel, p.config) for p in picks] == [("attn_fwd_sm90", 0), ("attn_fwd", 0)]


def test_square_causal_calls_on_gputest_images_run_mode_2_only_for_the_dtype_both_forwards_hold_it(
        tmp_path: Path) -> None:
    """What tests/runtime/test_attention_sm90_gpu.py's persistent operator test expects per dtype:
    gputest holds D=128 mask mode 2 for bf16 only (in both forwards), so a square top-left causal
    call runs attn_fwd_sm90 mode 2 in bf16 and mode 1 in fp16, forced config or not."""
    from builder.tune import forced_config
    from tests.runtime.test_attention_sm90_gpu import _mode_run

    jobs = [j for name in ("attn_fwd", "attn_fwd_sm90") for j in expand(load_kernels()[name], [KNOWN["sm90"]],
                                                                        "gputest", "3.6.0")
            if j.spec.get("HEAD_DIM") == 128
            and {**j.spec, "CAUSAL": 0, "dtype": "fp16"} == {**BASE, "CAUSAL": 0, "ALIBI": 0}]
    (tmp_path / "catalog.json").write_text(json.dumps({
        "schema": "aotriton-rt.catalog", "schema_version": 2, "triton_version": "3.6.0", "tuning": {},
        "variants": [_synthetic_variant(j.kernel, j.spec, j.config_index) for j in jobs]}))
    lib = aotriton_rt.Library(tmp_path)
    assert {d: _mode_run(lib, d, 2) for d in ("fp16", "bf16")} == {"fp16": 1, "bf16": 2}
    assert {d: _mode_run(lib, d, 1) for d in ("fp16", "bf16")} == {"fp16": 1, "bf16": 1}
    for dtype in ("fp16", "bf16"):
        pick = op.explain(dtype=dtype, head_dim=128, seqlen_q=1100, seqlen_k=1100, causal=True, align="top_left",
                          arch="sm90", library=forced_config(lib, "attn_fwd_sm90", 6)).kernels[0]
        assert (pick.kernel, pick.spec["CAUSAL"], pick.config, pick.params["PERSISTENT"]) == (
            "attn_fwd_sm90", _mode_run(lib, dtype, 2), 6, 132)


def _matrix_images(folder: Path) -> aotriton_rt.Library:
    """Synthetic sm90 images (never launched) where most decisions have two answers: fp16 D=64 and
    D=128, the portable kernels of both backward schemes, sm90's forward, dK/dV (its aligned-length
    sibling too) and dQ at D=128, several configs, and tuning rules choosing kernels, configs (one
    that is not built) and the scheme per length bin."""
    def spec(d: int, causal: int, **more: int) -> dict:
        return {**BASE, "HEAD_DIM": d, "HEAD_DIM_V": d, "CAUSAL": causal, **more}

    variants = []
    for d in (64, 128):
        variants += [_synthetic_variant("attn_fwd", spec(d, c), i) for c in (0, 1, 2) for i in (0, 1)]
        variants += [_synthetic_variant("attn_bwd_preprocess", {"dtype": "fp16", "HEAD_DIM": d, "HEAD_DIM_V": d,
                                                                "VARLEN": 0, "DQ_ATOMIC": a}) for a in (0, 1)]
        variants += [_synthetic_variant("attn_bwd_dkdv", spec(d, c, DQ_ATOMIC=a)) for c in (0, 2) for a in (0, 1)]
        variants += [_synthetic_variant("attn_bwd_dq", spec(d, c)) for c in (0, 2)]
        variants.append(_synthetic_variant("attn_bwd_dq_convert", {"dtype": "fp16", "HEAD_DIM": d, "VARLEN": 0}))
    variants.append(_synthetic_variant("attn_bwd_dkdv", spec(64, 0, DQ_ATOMIC=0), 1))
    variants += [_synthetic_variant("attn_fwd_sm90", spec(128, c), i) for c in (0, 1) for i in (0, 6)]
    variants += [_synthetic_variant(name, spec(128, 2, DQ_ATOMIC=0), i)
                 for name in ("attn_bwd_dkdv_sm90", "attn_bwd_dkdv_sm90_a16") for i in (0, 1)]
    variants.append(_synthetic_variant("attn_bwd_dkdv_sm90", spec(128, 2, DQ_ATOMIC=1)))
    variants += [_synthetic_variant("attn_bwd_dq_sm90", spec(128, c), i) for c in (0, 2) for i in (0, 1)]
    table = {
        "attn_fwd": [{"arch": "sm90", "spec": {"HEAD_DIM": 64}, "seqlen_q": [2048, None], "config": 1},
                     {"spec": {"CAUSAL": 2}, "seqlen_k": [None, 511], "config": 2}],  # config 2 is not built
        "attn_fwd_kernel": [{"arch": "sm90", "seqlen_q": [None, 1023], "kernel": "attn_fwd"}],
        "attn_fwd_sm90": [{"seqlen_q": [4096, None], "config": 6}],
        "attn_bwd_mode": [{"spec": {"HEAD_DIM": 64, "CAUSAL": 0}, "seqlen_k": [4096, None], "mode": "atomic"}],
        "attn_bwd_dkdv": [{"spec": {"HEAD_DIM": 64, "CAUSAL": 0, "DQ_ATOMIC": 0}, "config": 1}],
        "attn_bwd_dkdv_sm90": [{"seqlen_k": [4096, None], "config": 1}],
        "attn_bwd_dq_kernel": [{"spec": {"CAUSAL": 0}, "seqlen_q": [None, 2047], "kernel": "attn_bwd_dq"}],
        "attn_bwd_dq_sm90": [{"seqlen_q": [4096, None], "config": 1}],
    }
    (folder / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                     "triton_version": "3.6.0", "tuning": table,
                                                     "variants": variants}))
    return aotriton_rt.Library(folder)


def _matrix() -> list[dict]:
    calls = []
    for d in (64, 128):
        for causal, align in ((False, "top_left"), (True, "top_left"), (True, "bottom_right")):
            for sq, sk in ((100, 100), (300, 500), (1000, 1500), (2048, 3000), (4096, 4096), (16384, 16384),
                           (8000, 8000)):
                fact = {"head_dim": d, "causal": causal, "align": align, "sq": sq, "sk": sk}
                calls.append({**fact, "backward": False})
                for deterministic, scheme in ((False, None), (True, None), (False, "atomic"), (False, "split")):
                    calls.append({**fact, "backward": True, "deterministic": deterministic, "scheme": scheme})
    return calls


def test_explain_reports_exactly_the_kernels_and_configs_the_operator_launches(tmp_path: Path) -> None:
    """Over a matrix of calls (head dims, masks and alignments, equal, unequal, aligned and ragged
    lengths in every tuning bin, forward and backward, each scheme, deterministic or not): each
    kernel explain names is the operator's handle for its role, and the variant explain reports is
    the one that handle runs on sm90 (config included); where the images lack a kernel both say so."""
    from aotriton_rt.select import select_one

    lib = _matrix_images(tmp_path)
    seen = set()
    for c in _matrix():
        options = {"causal": c["causal"], "align": c["align"], "backward": c["backward"]}
        if c["backward"]:
            options.update(deterministic=c["deterministic"], scheme=c["scheme"])
        try:
            handles = op.attention_kernels(*qkv(B=1, H=2, S=c["sq"], Sk=c["sk"], D=c["head_dim"]), library=lib,
                                           **options)
        except KernelNotFound:
            with pytest.raises(KernelNotFound):
                op.explain(dtype="fp16", head_dim=c["head_dim"], seqlen_q=c["sq"], seqlen_k=c["sk"], arch="sm90",
                           library=lib, **options)
            seen.add("missing")
            continue
        ex = op.explain(dtype="fp16", head_dim=c["head_dim"], seqlen_q=c["sq"], seqlen_k=c["sk"], arch="sm90",
                        library=lib, **options)
        assert [p.role for p in ex.kernels] == list(handles), c
        for pick in ex.kernels:
            handle = handles[pick.role]
            runs = select_one(handle.candidates, handle.name, handle.params, ["sm90"])
            assert (handle.name, runs.key, runs.config.index) == (pick.kernel, pick.variant_key, pick.config), c
            seen.add((pick.kernel, pick.config, pick.tuned))
            if pick.note.startswith("config #2 is not in these images"):
                seen.add("not built")
        if c["backward"]:
            assert ex.scheme == ("atomic" if "attn_bwd_dq_convert" in handles else "split"), c
            seen.add(ex.scheme)
    # The matrix reaches every kind of decision: both forwards, both schemes, sm90's backward kernels
    # and the aligned sibling, tuned configs, a tuned config that is not built, and missing kernels.
    assert {("attn_fwd", 1, True), ("attn_fwd", 0, False), "not built", ("attn_fwd_sm90", 6, True),
            ("attn_fwd_sm90", 0, False), ("attn_bwd_dkdv", 1, True), ("attn_bwd_dkdv_sm90", 0, False),
            ("attn_bwd_dkdv_sm90_a16", 1, True), ("attn_bwd_dq_sm90", 1, True), ("attn_bwd_dq", 0, False),
            ("attn_bwd_dq_convert", 0, False), "split", "atomic", "missing"} <= seen, sorted(map(str, seen))
