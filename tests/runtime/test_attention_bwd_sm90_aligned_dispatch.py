"""When a backward runs the aligned-length sibling of the Gluon dK/dV (``attn_bwd_dkdv_sm90_a16``:
both lengths and the LSE/Delta strides declared multiples of 16) in place of ``attn_bwd_dkdv_sm90``:
only where the call's values meet every divisibility the sibling's catalog declares and the images
hold it for the spec; tuning rules name the family and its config rules choose the sibling's config;
explain says which ran and why. Dispatch only: the catalogs are synthetic and nothing is launched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import aotriton_rt
from aotriton_rt.ops import attention as op
from aotriton_rt.ops.attention.dispatch import ALIGNED_REASON, aligned_facts, backward_kernel, kernels_of
from aotriton_rt.ops.attention.family import ALIGNED_SIBLINGS, DKDV, AttentionCall, family_of
from tests.runtime.test_attention_bwd_sm90_dispatch import CAUSAL, NAME, _images
from tests.runtime.test_attention_op import Dev, _synthetic_variant, qkv

ALIGNED = "attn_bwd_dkdv_sm90_a16"
SPLIT = {**CAUSAL, "DQ_ATOMIC": 0}
UNTUNED = ("untuned (no rule of tuning['attn_bwd_dkdv_kernel'] matches; heuristic: sm90's own dK/dV kernel, "
           "preferred where the images hold it)")


def _with_sibling(folder: Path, tuning_table: dict | None = None, sibling: bool = True, edit=None,
                  **kw) -> aotriton_rt.Library:
    """``_images`` (the split backward, fp16 D=128 causal, with attn_bwd_dkdv_sm90 configs 0 and 1)
    plus, with ``sibling``, attn_bwd_dkdv_sm90_a16 configs 0 and 1 for the same spec; ``edit`` may
    change each sibling entry (a catalog that declares it otherwise)."""
    _images(folder, tuning_table, **kw)
    catalog = json.loads((folder / "catalog.json").read_text())
    for index in (0, 1) if sibling else ():
        entry = _synthetic_variant(ALIGNED, SPLIT, index)
        catalog["variants"].append(edit(entry) if edit else entry)
    (folder / "catalog.json").write_text(json.dumps(catalog))
    return aotriton_rt.Library(folder)


def _dkdv(lib, S: int, Sk: int | None = None, **kw):
    return op.attention_kernels(*qkv(B=1, H=2, S=S, Sk=Sk, D=128), causal=True, align="bottom_right",
                                backward=True, library=lib, **kw)[DKDV]


def _explain(lib, S: int, Sk: int | None = None):
    return op.explain(dtype="fp16", head_dim=128, seqlen_q=S, seqlen_k=Sk, causal=True, align="bottom_right",
                      backward=True, arch="sm90", library=lib)


def test_the_registry_declares_the_aligned_sibling_as_its_family_but_for_the_lengths_and_lse_strides() -> None:
    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    kernels = load_kernels()
    assert ALIGNED_SIBLINGS == {NAME: ALIGNED} and family_of(ALIGNED) == NAME and family_of(NAME) == NAME
    plain, aligned = kernels[NAME], kernels[ALIGNED]
    assert aligned.fn is plain.fn and aligned.signature == plain.signature and aligned.grid == plain.grid
    extra = {n: d for n, d in aligned.divisibility.items() if plain.divisibility.get(n) != d}
    assert extra == {"stride_lz": 16, "stride_lh": 16, "seqlen_q": 16, "seqlen_k": 16}
    assert set(plain.checks) < set(aligned.checks)
    assert set(aligned.checks) - set(plain.checks) == {"stride_lz % 16 == 0 and stride_lh % 16 == 0"}

    targets = parse_targets("sm80,sm90,gfx942")

    def jobs(name: str, build_set: str) -> dict:
        return {(tuple(sorted(j.spec.items())), j.config_index, j.target.arch): j
                for j in expand(kernels[name], targets, build_set, "3.6.0")}

    # The family's variants (both schemes), spec for spec and config for config, on sm90 only.
    for build_set in ("gputest", "full", "default"):
        mine, family = jobs(ALIGNED, build_set), jobs(NAME, build_set)
        assert mine and set(mine) == set(family), build_set
        assert all(j.config == family[k].config and j.key != family[k].key for k, j in mine.items())
        assert all(j.divisibility["seqlen_k"] == 16 for j in mine.values())
    # The split scheme: four configs a spec at D=128 (two tiles, the persistent one, the OVERLAP=1
    # one), five at D=64 (and the OVERLAP=2 one); the atomic scheme 13 at D=128 and 7 at D=64; as
    # many specs of each head dim and scheme.
    assert len(jobs(ALIGNED, "gputest")) == 5 * (4 + 5 + 13 + 7)
    assert len(jobs(ALIGNED, "full")) == 6 * (4 + 5 + 13 + 7)
    # The default set: the family's (config #0 and the tuned ones) of the two dtypes, head dims 64
    # and 128, mask modes 0 and 1, both schemes.
    assert {(k[0], k[1]) for k in jobs(ALIGNED, "default")} == {(k[0], k[1]) for k in jobs(NAME, "default")}
    assert len({k[0] for k in jobs(ALIGNED, "default")}) == 16 and {0} <= {k[1] for k in jobs(ALIGNED, "default")}


def test_an_aligned_call_runs_the_sibling_and_a_ragged_one_the_plain_kernel(tmp_path: Path) -> None:
    lib = _with_sibling(tmp_path)
    assert _dkdv(lib, 16384).name == ALIGNED
    assert _dkdv(lib, 16383).name == NAME
    # One ragged length is enough to keep the plain kernel, either one.
    assert _dkdv(lib, 1024, 1000).name == NAME
    assert _dkdv(lib, 1000, 1024).name == NAME
    assert _dkdv(lib, 1024, 2048).name == ALIGNED
    # The other kernels of the backward are unchanged.
    handles = op.attention_kernels(*qkv(B=1, H=2, S=16384, D=128), causal=True, backward=True, library=lib)
    assert [h.name for h in handles.values()] == ["attn_bwd_preprocess", ALIGNED, "attn_bwd_dq"]


def test_the_operator_passes_the_lse_strides_the_dispatch_checks() -> None:
    """The LSE/Delta strides every launch path passes are contiguous (B, Hq, Sq), not padded:
    multiples of 16 exactly when seqlen_q is, and what the call the dispatch sees carries."""
    from aotriton_rt.ops.attention import problem

    def prepare(q, k, v, **options):
        defaults = {"causal": False, "window": None, "align": "top_left", "bias": None, "dropout_p": 0.0, "seed": None,
                    "offset": 0, "scale": None, "cu_seqlens_q": None, "cu_seqlens_k": None, "max_seqlen_q": None,
                    "max_seqlen_k": None, "layout": "bhsd"}
        return problem.prepare(q, k, v, **{**defaults, **options})

    p = prepare(*qkv(B=3, H=5, S=1040, D=128), causal=True)
    assert p.lse_strides() == (5 * 1040, 1040) and p.call(0).lse_strides == (5 * 1040, 1040)
    assert aligned_facts(p.call(0)) == {"seqlen_q": 1040, "seqlen_k": 1040, "stride_lz": 5200, "stride_lh": 1040}
    ragged = prepare(*qkv(B=3, H=5, S=1000, D=128), causal=True)
    assert ragged.lse_strides() == (5000, 1000)
    q = Dev(10, 2, 128, dtype="fp16")
    cu = Dev(3, dtype="i32")
    varlen = prepare(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16)
    assert varlen.lse_strides() == (0, 10) and aligned_facts(varlen.call(0)) is None


@pytest.mark.parametrize(("lse_strides", "lengths", "aligned"), [
    ((2 * 16384, 16384), (16384, 16384), True),
    ((16, 16), (16, 16), True),
    ((2 * 16384 + 8, 16384), (16384, 16384), False),  # a padded batch stride off by 8
    ((2 * 16384, 16392 + 4), (16384, 16384), False),  # a head stride not a multiple of 16
    (None, (16384, 16384), False),  # unknown LSE strides
    ((2 * 16384, 16384), (16384, 16376 + 1), False),
])
def test_the_sibling_serves_only_calls_whose_lengths_and_lse_strides_are_multiples_of_16(
        tmp_path: Path, lse_strides, lengths, aligned: bool) -> None:
    ks = kernels_of(_with_sibling(tmp_path))
    call = AttentionCall("fp16", 128, 128, 2, lengths[0] == lengths[1], seqlen_q=lengths[0], seqlen_k=lengths[1],
                         lse_strides=lse_strides)
    name, why = backward_kernel(ks, call, DKDV, SPLIT, "sm90")
    assert name == (ALIGNED if aligned else NAME)
    assert why == (f"{UNTUNED}; {ALIGNED_REASON}" if aligned else UNTUNED)


def test_a_variable_length_call_never_runs_the_sibling(tmp_path: Path) -> None:
    ks = kernels_of(_with_sibling(tmp_path))
    call = AttentionCall("fp16", 128, 128, 2, True, varlen=True, seqlen_q=1024, seqlen_k=1024, lse_strides=(0, 1024))
    assert aligned_facts(call) is None
    assert ks.aligned_sibling(NAME, SPLIT, call) is None


def test_images_without_the_sibling_run_the_plain_kernel_at_aligned_lengths(tmp_path: Path) -> None:
    lib = _with_sibling(tmp_path, sibling=False)
    assert _dkdv(lib, 16384).name == NAME
    assert _explain(lib, 16384).kernels[1].kernel_reason == UNTUNED


def test_explain_names_the_sibling_and_why_at_aligned_lengths_and_the_plain_kernel_otherwise(tmp_path: Path) -> None:
    lib = _with_sibling(tmp_path)
    ex = _explain(lib, 16384)
    pick = ex.kernels[1]
    assert (pick.kernel, pick.role) == (ALIGNED, DKDV)
    assert pick.kernel_reason == f"{UNTUNED}; {ALIGNED_REASON}"
    assert pick.line().startswith(f"{ALIGNED}[dtype=fp16,") and pick.line().endswith(ALIGNED_REASON)
    assert "aligned-length variant (seqlen and LSE strides multiples of 16)" in str(ex)
    assert pick.variant_key == _dkdv(lib, 16384).candidates[0].key
    plain = _explain(lib, 16383).kernels[1]
    assert plain.kernel == NAME and plain.kernel_reason == UNTUNED and "aligned" not in str(_explain(lib, 16383))


def test_the_familys_config_rules_choose_the_siblings_config(tmp_path: Path) -> None:
    table = {NAME: [{"arch": "sm90", "seqlen_k": [4096, None], "config": 1, "source": "db"}]}
    lib = _with_sibling(tmp_path, table)
    long, short = _dkdv(lib, 16384), _dkdv(lib, 1024)
    assert (long.name, long.candidates[0].config.index) == (ALIGNED, 1)
    assert (short.name, short.candidates[0].config.index) == (ALIGNED, 0)
    ragged = _dkdv(lib, 16383)
    assert (ragged.name, ragged.candidates[0].config.index) == (NAME, 1)
    pick = _explain(lib, 16384).kernels[1]
    assert pick.config == 1 and pick.tuned
    assert pick.choice.reason == "tuned (rule #0 of tuning['attn_bwd_dkdv_sm90'], from db, seqlen_k in [4096, inf], " \
                                 "arch sm90)"


def test_a_rule_naming_the_family_runs_the_sibling_and_one_naming_the_portable_kernel_does_not(
        tmp_path: Path) -> None:
    family = {"attn_bwd_dkdv_kernel": [{"arch": "sm90", "kernel": NAME, "source": "db"}]}
    lib = _with_sibling(tmp_path, family)
    assert _dkdv(lib, 16384).name == ALIGNED and _dkdv(lib, 16383).name == NAME
    assert _explain(lib, 16384).kernels[1].kernel_reason == (
        f"tuned (rule #0 of tuning['attn_bwd_dkdv_kernel'], from db, arch sm90); {ALIGNED_REASON}")
    (tmp_path / "portable").mkdir()
    portable = {"attn_bwd_dkdv_kernel": [{"arch": "sm90", "kernel": "attn_bwd_dkdv", "source": "db"}]}
    assert _dkdv(_with_sibling(tmp_path / "portable", portable), 16384).name == "attn_bwd_dkdv"
    # A rule naming the sibling names no kernel of the role: the family's (and then its sibling) runs.
    (tmp_path / "sibling").mkdir()
    named = _with_sibling(tmp_path / "sibling", {"attn_bwd_dkdv_kernel": [{"kernel": ALIGNED}]})
    assert _dkdv(named, 16384).name == ALIGNED and _dkdv(named, 16383).name == NAME


def test_forced_views_of_the_family_run_the_sibling_at_aligned_lengths_with_the_forced_config(tmp_path: Path) -> None:
    """What builder.tune and the GPU tests force: a view naming the family's config."""
    from builder.tune import forced_config, forced_dkdv

    lib = _with_sibling(tmp_path)
    for index in (0, 1):
        for S, name in ((16384, ALIGNED), (16383, NAME)):
            handle = _dkdv(forced_config(lib, NAME, index), S)
            assert (handle.name, handle.candidates[0].config.index) == (name, index)
    assert _dkdv(forced_dkdv(lib, "attn_bwd_dkdv"), 16384).name == "attn_bwd_dkdv"


def test_tune_times_the_sibling_as_its_family(tmp_path: Path) -> None:
    """builder.tune's whole-backward contenders and config entries name the family: the rules it
    writes must name kernels the dispatch chooses among."""
    from builder.tune import backward_contenders

    lib = _with_sibling(tmp_path, gluon_dq=True)
    _, contenders = backward_contenders(lib, "sm90", "fp16", 128, True)
    assert contenders and contenders[0][1]["attn_bwd_dkdv"] == NAME
    assert not any(ALIGNED in params.values() for _, params, _ in contenders)


@pytest.mark.parametrize(("what", "edit"), [
    # Declares seqlen_k divisible by 32: 16400 is a multiple of 16, not of 32.
    ("a larger divisor than the call meets", lambda a: {**a, "divisibility": 32} if a["name"] == "seqlen_k" else a),
    # Declares a divisor that is no power of two (the choice caches key on powers of two).
    ("a divisor that is no power of two", lambda a: {**a, "divisibility": 48} if a["name"] == "stride_lh" else a),
    # Declares an argument beyond the four facts divisible: the family promises nothing of it.
    ("another argument", lambda a: {**a, "divisibility": 16} if a["name"] == "num_heads_q" else a),
    # Declares the facts as the family does (then it is no aligned sibling, but must still be safe).
    ("fewer facts", lambda a: {k: v for k, v in a.items() if k != "divisibility"} if a["name"] == "seqlen_q" else a),
])
def test_a_sibling_declared_otherwise_than_the_call_allows_is_never_chosen(tmp_path: Path, what: str, edit) -> None:
    def declare(entry: dict) -> dict:
        return {**entry, "args": [edit(a) for a in entry["args"]]}

    lib = _with_sibling(tmp_path, edit=declare)
    name = _dkdv(lib, 16400).name
    if what == "fewer facts":
        assert name == ALIGNED  # what it declares the call meets
    else:
        assert name == NAME, what


def test_whatever_the_lengths_and_heads_the_chosen_kernel_takes_the_calls_values(tmp_path: Path) -> None:
    """What the launcher checks (each argument's declared divisibility, from the catalog), checked for
    the kernel the dispatch chose, over random fixed-length calls: the sibling never gets a value it
    would refuse, and it runs exactly when all four facts are multiples of 16."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    lib = _with_sibling(tmp_path)
    ks = kernels_of(lib)
    declared = {name: {a.name: a.divisibility for a in lib.variants_of(name)[0].args} for name in (NAME, ALIGNED)}

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(st.integers(1, 70000), st.integers(1, 70000), st.integers(1, 64), st.booleans(), st.booleans())
    def check(sq: int, sk: int, heads: int, round_q: bool, round_k: bool) -> None:
        # Lengths near multiples of 16 as often as not.
        sq = max(16, sq // 16 * 16) if round_q else sq
        sk = max(16, sk // 16 * 16) if round_k else sk
        lse = (heads * sq, sq)  # the operator's contiguous (B, Hq, Sq)
        call = AttentionCall("fp16", 128, 128, 2, sq == sk, seqlen_q=sq, seqlen_k=sk, lse_strides=lse)
        name, _ = backward_kernel(ks, call, DKDV, SPLIT, "sm90")
        values = {"seqlen_q": sq, "seqlen_k": sk, "stride_lz": lse[0], "stride_lh": lse[1]}
        assert all(v % declared[name].get(n, 1) == 0 for n, v in values.items()), (name, values)
        assert (name == ALIGNED) == all(v % 16 == 0 for v in values.values()), (name, values)

    check()
