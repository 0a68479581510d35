"""Which dK/dV and dQ kernels a backward launches: sm90's Gluon ones (attn_bwd_dkdv_sm90,
attn_bwd_dq_sm90; the dK/dV one also in the atomic scheme, DQ_ATOMIC=1) where the images hold them
for the call's spec, the portable attn_bwd_dkdv and attn_bwd_dq elsewhere, as tuning rules and
forced views say; explain names the ones chosen. Dispatch only: the catalogs are synthetic and
nothing is launched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import aotriton_rt
from aotriton_rt.ops import attention as op
from aotriton_rt.ops.attention.dispatch import backward_kernel, kernels_of
from aotriton_rt.ops.attention.family import DKDV, DQ
from tests.runtime.test_attention_op import _synthetic_variant, qkv

NAME = "attn_bwd_dkdv_sm90"
DQ_NAME = "attn_bwd_dq_sm90"
BASE = {"dtype": "fp16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "BIAS": 0, "DROPOUT": 0, "VARLEN": 0}
CAUSAL = {**BASE, "CAUSAL": 2}


def _images(folder: Path, tuning_table: dict | None = None, archs=("sm90",), gluon: bool = True,
            gluon_dq: bool = False, atomic: tuple[str, ...] = ()) -> Path:
    """Synthetic images: the split backward (fp16 D=128 causal) with and without dropout on each
    of ``archs``, attn_bwd_dkdv_sm90 (configs 0 and 1) for the spec without dropout on sm90, and
    with ``gluon_dq`` attn_bwd_dq_sm90 (configs 0 and 1) for that spec too. ``atomic`` adds the
    atomic scheme (without dropout): "rest" its preprocess and convert kernels on each arch,
    "portable" the portable atomic dK/dV on each arch, "gluon" attn_bwd_dkdv_sm90's (configs 0, 1)."""
    variants = []
    pre = {k: CAUSAL[k] for k in ("dtype", "HEAD_DIM", "HEAD_DIM_V", "VARLEN")}
    for arch in archs:
        variants.append(_synthetic_variant("attn_bwd_preprocess", {**pre, "DQ_ATOMIC": 0}, arch=arch))
        for dropout in (0, 1):
            spec = {**CAUSAL, "DROPOUT": dropout}
            variants.append(_synthetic_variant("attn_bwd_dkdv", {**spec, "DQ_ATOMIC": 0}, arch=arch))
            variants.append(_synthetic_variant("attn_bwd_dq", spec, arch=arch))
        if "rest" in atomic:
            variants.append(_synthetic_variant("attn_bwd_preprocess", {**pre, "DQ_ATOMIC": 1}, arch=arch))
            variants.append(_synthetic_variant("attn_bwd_dq_convert", {k: CAUSAL[k] for k in ("dtype", "HEAD_DIM",
                                                                                              "VARLEN")}, arch=arch))
        if "portable" in atomic:
            variants.append(_synthetic_variant("attn_bwd_dkdv", {**CAUSAL, "DQ_ATOMIC": 1}, arch=arch))
    if "gluon" in atomic:
        variants.append(_synthetic_variant(NAME, {**CAUSAL, "DQ_ATOMIC": 1}, 0))
        variants.append(_synthetic_variant(NAME, {**CAUSAL, "DQ_ATOMIC": 1}, 1))
    if gluon:
        variants.append(_synthetic_variant(NAME, {**CAUSAL, "DQ_ATOMIC": 0}, 0))
        variants.append(_synthetic_variant(NAME, {**CAUSAL, "DQ_ATOMIC": 0}, 1))
    if gluon_dq:
        variants.append(_synthetic_variant(DQ_NAME, CAUSAL, 0))
        variants.append(_synthetic_variant(DQ_NAME, CAUSAL, 1))
    (folder / "catalog.json").write_text(json.dumps({
        "schema": "aotriton-rt.catalog", "schema_version": 2, "triton_version": "3.6.0",
        "tuning": tuning_table or {}, "variants": variants}))
    return folder


def _dkdv(lib, S: int = 300, **kw):
    return op.attention_kernels(*qkv(S=S, D=128), causal=True, backward=True, library=lib, **kw)[DKDV]


def test_the_gluon_dkdv_serves_the_specs_it_holds_and_the_portable_one_the_rest(tmp_path: Path) -> None:
    lib = aotriton_rt.Library(_images(tmp_path))
    assert _dkdv(lib).name == NAME
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, backward=True, arch="sm90", library=lib)
    assert [k.kernel for k in ex.kernels] == ["attn_bwd_preprocess", NAME, "attn_bwd_dq"]
    assert ex.kernels[1].kernel_reason == ("untuned (no rule of tuning['attn_bwd_dkdv_kernel'] matches; heuristic: "
                                           "sm90's own dK/dV kernel, preferred where the images hold it)")
    assert "kernel:" not in ex.kernels[0].line() and "kernel:" not in ex.kernels[2].line()
    # Dropout is not in attn_bwd_dkdv_sm90's specs: the portable dK/dV, and nothing to explain about it.
    dropped = op.attention_kernels(*qkv(S=300, D=128), causal=True, dropout_p=0.1, seed=1, offset=0,
                                    backward=True, library=lib)
    assert dropped[DKDV].name == "attn_bwd_dkdv"
    plain = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, dropout=True, backward=True,
                       arch="sm90", library=lib)
    assert plain.kernels[1].kernel == "attn_bwd_dkdv" and "kernel:" not in str(plain)


def _dq(lib, S: int = 300, **kw):
    return op.attention_kernels(*qkv(S=S, D=128), causal=True, backward=True, library=lib, **kw)[DQ]


def test_the_gluon_dq_serves_the_specs_it_holds_beside_the_gluon_dkdv(tmp_path: Path) -> None:
    lib = aotriton_rt.Library(_images(tmp_path, gluon_dq=True))
    assert (_dkdv(lib).name, _dq(lib).name) == (NAME, DQ_NAME)
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, backward=True, arch="sm90", library=lib)
    assert [k.kernel for k in ex.kernels] == ["attn_bwd_preprocess", NAME, DQ_NAME]
    assert ex.kernels[2].kernel_reason == ("untuned (no rule of tuning['attn_bwd_dq_kernel'] matches; heuristic: "
                                           "sm90's own dQ kernel, preferred where the images hold it)")
    assert ex.kernels[2].line().startswith(f"{DQ_NAME}[")
    assert "kernel: untuned (no rule of tuning['attn_bwd_dq_kernel']" in ex.kernels[2].line()
    dropped = op.attention_kernels(*qkv(S=300, D=128), causal=True, dropout_p=0.1, seed=1, offset=0,
                                    backward=True, library=lib)
    assert (dropped[DKDV].name, dropped[DQ].name) == ("attn_bwd_dkdv", "attn_bwd_dq")


def test_images_with_only_the_gluon_dq_run_it_beside_the_portable_dkdv(tmp_path: Path) -> None:
    lib = aotriton_rt.Library(_images(tmp_path, gluon=False, gluon_dq=True))
    assert (_dkdv(lib).name, _dq(lib).name) == ("attn_bwd_dkdv", DQ_NAME)


def test_a_dq_kernel_rule_sends_its_lengths_to_the_portable_dq_and_leaves_the_dkdv_alone(tmp_path: Path) -> None:
    table = {"attn_bwd_dq_kernel": [{"arch": "sm90", "spec": {"HEAD_DIM": 128}, "seqlen_q": [None, 1023],
                                     "kernel": "attn_bwd_dq", "source": "db"}],
             DQ_NAME: [{"arch": "sm90", "seqlen_q": [4096, None], "config": 1}]}
    lib = aotriton_rt.Library(_images(tmp_path, table, gluon_dq=True))
    assert (_dq(lib, S=1000).name, _dkdv(lib, S=1000).name) == ("attn_bwd_dq", NAME)
    long = _dq(lib, S=5000)
    assert long.name == DQ_NAME and long.candidates[0].config.index == 1
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=1000, causal=True, backward=True, arch="sm90", library=lib)
    assert ex.kernels[2].kernel == "attn_bwd_dq"
    assert ex.kernels[2].kernel_reason == ("tuned (rule #0 of tuning['attn_bwd_dq_kernel'], from db, seqlen_q in "
                                           "[0, 1023], arch sm90)")


def test_a_dq_rule_naming_a_kernel_that_does_not_serve_the_call_keeps_the_arch_one(tmp_path: Path) -> None:
    lib = aotriton_rt.Library(_images(tmp_path, {"attn_bwd_dq_kernel": [{"kernel": NAME}]}, gluon_dq=True))
    assert _dq(lib).name == DQ_NAME
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, backward=True, arch="sm90", library=lib)
    assert ex.kernels[2].kernel_reason.endswith(f"names '{NAME}', which does not serve this spec on sm90; "
                                                f"{DQ_NAME} runs")


def test_forced_views_run_any_pair_of_dkdv_and_dq(tmp_path: Path) -> None:
    from builder.tune import DQ_KERNELS, forced_config, forced_split

    assert DQ_KERNELS == ("attn_bwd_dq", DQ_NAME)
    lib = aotriton_rt.Library(_images(tmp_path, gluon_dq=True))
    for dkdv in ("attn_bwd_dkdv", NAME):
        for dq in ("attn_bwd_dq", DQ_NAME):
            view = forced_split(lib, dkdv, dq)
            assert (_dkdv(view).name, _dq(view).name) == (dkdv, dq)
    # Timing a portable dQ config must time the portable kernel; a Gluon dQ config its own.
    assert _dq(forced_config(lib, "attn_bwd_dq", 0)).name == "attn_bwd_dq"
    gluon = _dq(forced_config(lib, DQ_NAME, 1))
    assert gluon.name == DQ_NAME and gluon.candidates[0].config.index == 1
    assert _dkdv(forced_config(lib, DQ_NAME, 1)).name == NAME  # the other role keeps its routing


def test_a_malformed_dq_kernel_rule_is_refused_when_the_catalog_loads(tmp_path: Path) -> None:
    _images(tmp_path, {"attn_bwd_dq_kernel": [{"kernel": ["attn_bwd_dq"]}]})
    with pytest.raises(aotriton_rt.CatalogError,
                       match=r"tuning\['attn_bwd_dq_kernel'\] rule .*kernel must be a kernel name"):
        aotriton_rt.Library(tmp_path).variants_of("attn_bwd_dq")


def test_a_kernel_rule_sends_its_lengths_to_the_portable_dkdv(tmp_path: Path) -> None:
    table = {"attn_bwd_dkdv_kernel": [{"arch": "sm90", "spec": {"HEAD_DIM": 128}, "seqlen_k": [None, 1023],
                                       "kernel": "attn_bwd_dkdv", "source": "db"}],
             NAME: [{"arch": "sm90", "seqlen_k": [4096, None], "config": 1}]}
    lib = aotriton_rt.Library(_images(tmp_path, table))
    short, long = _dkdv(lib, S=1000), _dkdv(lib, S=5000)
    assert (short.name, long.name) == ("attn_bwd_dkdv", NAME)
    assert long.candidates[0].config.index == 1  # the Gluon kernel's own config rules apply
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=1000, causal=True, backward=True, arch="sm90", library=lib)
    assert ex.kernels[1].kernel == "attn_bwd_dkdv"
    assert ex.kernels[1].kernel_reason == ("tuned (rule #0 of tuning['attn_bwd_dkdv_kernel'], from db, seqlen_k in "
                                           "[0, 1023], arch sm90)")


def test_a_rule_naming_a_kernel_that_does_not_serve_the_call_keeps_the_arch_one(tmp_path: Path) -> None:
    lib = aotriton_rt.Library(_images(tmp_path, {"attn_bwd_dkdv_kernel": [{"kernel": "attn_bwd_dkdv_sm100"}]}))
    assert _dkdv(lib).name == NAME
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, backward=True, arch="sm90", library=lib)
    assert ex.kernels[1].kernel_reason.endswith("names 'attn_bwd_dkdv_sm100', which does not serve this spec on "
                                                "sm90; attn_bwd_dkdv_sm90 runs")


def test_forced_views_run_either_dkdv(tmp_path: Path) -> None:
    from builder.tune import DKDV_KERNELS, forced_config, forced_dkdv

    assert DKDV_KERNELS == ("attn_bwd_dkdv", NAME)
    lib = aotriton_rt.Library(_images(tmp_path))
    assert _dkdv(forced_dkdv(lib, "attn_bwd_dkdv")).name == "attn_bwd_dkdv"
    assert _dkdv(forced_dkdv(lib, NAME)).name == NAME
    # Timing a portable config must time the portable kernel, not the arch one that would serve.
    assert _dkdv(forced_config(lib, "attn_bwd_dkdv", 0)).name == "attn_bwd_dkdv"
    gluon = _dkdv(forced_config(lib, NAME, 1))
    assert gluon.name == NAME and gluon.candidates[0].config.index == 1


def test_images_of_another_arch_keep_the_portable_dkdv(tmp_path: Path) -> None:
    lib = aotriton_rt.Library(_images(tmp_path, archs=("sm80", "sm90")))
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, backward=True, arch="sm80", library=lib)
    assert ex.kernels[1].kernel == "attn_bwd_dkdv"
    assert ex.kernels[1].kernel_reason == ("the portable dK/dV kernel (sm80 has no per-architecture dK/dV kernel for "
                                           "this spec here)")


def test_images_without_the_gluon_dkdv_run_the_portable_one_and_explain_nothing(tmp_path: Path) -> None:
    lib = aotriton_rt.Library(_images(tmp_path, gluon=False))
    assert _dkdv(lib).name == "attn_bwd_dkdv"
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, backward=True, arch="sm90", library=lib)
    assert "kernel:" not in str(ex)


def test_roles_without_a_gluon_kernel_for_the_spec_keep_the_portable_kernels(tmp_path: Path) -> None:
    ks = kernels_of(aotriton_rt.Library(_images(tmp_path)))
    call = op.AttentionCall("fp16", 128, 128, 2, True, seqlen_q=300, seqlen_k=300)
    # These images hold no Gluon atomic dK/dV and no Gluon dQ.
    assert backward_kernel(ks, call, DKDV, {**CAUSAL, "DQ_ATOMIC": 1}, "sm90") == (DKDV, "")
    assert backward_kernel(ks, call, DQ, CAUSAL, "sm90") == (DQ, "")
    assert backward_kernel(ks, call, "attn_bwd_preprocess", CAUSAL, "sm90") == ("attn_bwd_preprocess", "")
    assert backward_kernel(ks, call, "attn_bwd_dq_convert", CAUSAL, "sm90") == ("attn_bwd_dq_convert", "")
    assert backward_kernel(ks, call, DKDV, {**CAUSAL, "DQ_ATOMIC": 0}, "sm90")[0] == NAME


def _atomic(lib, **kw):
    return op.attention_kernels(*qkv(S=300, D=128), causal=True, backward=True, library=lib, scheme="atomic", **kw)


def test_the_atomic_scheme_runs_the_gluon_dkdv_where_the_images_hold_its_atomic_spec(tmp_path: Path) -> None:
    lib = aotriton_rt.Library(_images(tmp_path, atomic=("rest", "portable", "gluon")))
    handles = _atomic(lib)
    assert list(handles) == ["attn_bwd_preprocess", DKDV, "attn_bwd_dq_convert"]
    assert handles[DKDV].name == NAME and handles[DKDV].candidates[0].spec["DQ_ATOMIC"] == 1
    assert handles["attn_bwd_dq_convert"].name == "attn_bwd_dq_convert"
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, backward=True, scheme="atomic",
                    arch="sm90", library=lib)
    assert ex.scheme == "atomic" and [k.kernel for k in ex.kernels] == ["attn_bwd_preprocess", NAME,
                                                                      "attn_bwd_dq_convert"]
    assert ex.kernels[1].kernel_reason == ("untuned (no rule of tuning['attn_bwd_dkdv_kernel'] matches; heuristic: "
                                           "sm90's own dK/dV kernel, preferred where the images hold it)")
    # The default scheme is unchanged: split, with the Gluon split dK/dV.
    default = op.attention_kernels(*qkv(S=300, D=128), causal=True, backward=True, library=lib)
    assert DQ in default and default[DKDV].name == NAME and default[DKDV].candidates[0].spec["DQ_ATOMIC"] == 0


def test_the_atomic_scheme_keeps_the_portable_dkdv_where_the_images_lack_the_gluon_atomic_one(tmp_path: Path) -> None:
    lib = aotriton_rt.Library(_images(tmp_path, atomic=("rest", "portable")))
    handles = _atomic(lib)
    assert handles[DKDV].name == DKDV and handles[DKDV].candidates[0].spec["DQ_ATOMIC"] == 1
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, backward=True, scheme="atomic",
                    arch="sm90", library=lib)
    assert ex.kernels[1].kernel == DKDV and "kernel:" not in ex.kernels[1].line()


def test_images_with_only_the_gluon_atomic_dkdv_run_the_atomic_scheme_on_sm90_and_split_elsewhere(
        tmp_path: Path) -> None:
    """No portable atomic dK/dV (as in the gputest set): the Gluon one holds the role on sm90; an
    sm80 device has no kernel for it, so its atomic call falls back to the split scheme."""
    lib = aotriton_rt.Library(_images(tmp_path, archs=("sm80", "sm90"), atomic=("rest", "gluon")))
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, backward=True, scheme="atomic",
                    arch="sm90", library=lib)
    assert ex.scheme == "atomic" and ex.kernels[1].kernel == NAME
    other = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, backward=True, scheme="atomic",
                       arch="sm80", library=lib)
    assert other.scheme == "split" and [k.kernel for k in other.kernels] == ["attn_bwd_preprocess", DKDV, DQ]
    assert "the images lack the atomic kernels, so split runs" in other.scheme_reason
    (tmp_path / "sm90").mkdir()
    sm90 = aotriton_rt.Library(_images(tmp_path / "sm90", atomic=("rest", "gluon")))
    assert _atomic(sm90)[DKDV].name == NAME


def test_a_dkdv_rule_naming_the_portable_kernel_the_images_lack_keeps_the_gluon_atomic_one(tmp_path: Path) -> None:
    table = {"attn_bwd_dkdv_kernel": [{"arch": "sm90", "kernel": "attn_bwd_dkdv", "source": "db"}]}
    lib = aotriton_rt.Library(_images(tmp_path, table, atomic=("rest", "gluon")))
    assert _atomic(lib)[DKDV].name == NAME
    assert _dkdv(lib).name == DKDV  # the split scheme's portable dK/dV is held: the rule applies
    ex = op.explain(dtype="fp16", head_dim=128, seqlen_q=300, causal=True, backward=True, scheme="atomic",
                    arch="sm90", library=lib)
    assert ex.kernels[1].kernel_reason == ("tuned (rule #0 of tuning['attn_bwd_dkdv_kernel'], from db, arch sm90) "
                                           "names 'attn_bwd_dkdv', which these images lack for this spec; "
                                           f"{NAME} runs")


def test_forced_views_run_either_atomic_dkdv_and_its_configs(tmp_path: Path) -> None:
    """What the GPU tests and bench/sm90_bwd_gluon.py force: scheme='atomic' on views of builder.tune."""
    from builder.tune import forced_config, forced_dkdv

    lib = aotriton_rt.Library(_images(tmp_path, atomic=("rest", "portable", "gluon")))
    assert _atomic(forced_dkdv(lib, DKDV))[DKDV].name == DKDV
    for index in (0, 1):
        handle = _atomic(forced_config(lib, NAME, index))[DKDV]
        assert handle.name == NAME and handle.candidates[0].config.index == index
        assert handle.candidates[0].spec["DQ_ATOMIC"] == 1


def test_a_malformed_dkdv_kernel_rule_is_refused_when_the_catalog_loads(tmp_path: Path) -> None:
    _images(tmp_path, {"attn_bwd_dkdv_kernel": [{"kernel": "attn bwd; rm"}]})
    with pytest.raises(aotriton_rt.CatalogError,
                       match=r"tuning\['attn_bwd_dkdv_kernel'\] rule .*kernel must be a kernel name"):
        aotriton_rt.Library(tmp_path).variants_of("attn_bwd_dkdv")
