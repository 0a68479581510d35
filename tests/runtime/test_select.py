"""Variant selection is a pure function that explains its rejections."""

import pytest

from aotriton_rt.arch import compatible, normalize, pick_target
from aotriton_rt.catalog import Catalog
from aotriton_rt.errors import KernelNotFound
from aotriton_rt.select import match, select_one


@pytest.fixture(scope="module")
def variants(built_images):
    return Catalog.load(built_images).variants


def test_selection_picks_the_variant_for_the_device_arch(variants):
    v = select_one(variants, "add", {"dtype": "fp16"}, ["sm90"])
    assert (v.kernel, v.spec["dtype"], v.target.arch) == ("add", "fp16", "sm90")


def test_selection_matches_config_constexprs_and_warps(variants):
    v = select_one(variants, "add", {"dtype": "fp32", "BLOCK": 1024, "num_warps": 4}, ["gfx942"])
    assert v.config.constexprs["BLOCK"] == 1024


def test_no_match_lists_rejected_candidates_and_why(variants):
    expected = r"(?s)no variant of 'add' matches dtype='fp64'.*dtype='fp16', asked 'fp64'"
    with pytest.raises(KernelNotFound, match=expected):
        select_one(variants, "add", {"dtype": "fp64"}, ["sm90"])


def test_unknown_kernel_lists_the_known_ones(variants):
    with pytest.raises(KernelNotFound, match=r"no kernel named 'nope' in the catalog; kernels: add, softmax"):
        select_one(variants, "nope", {})


def test_unknown_parameter_is_named(variants):
    with pytest.raises(KernelNotFound, match=r"has no parameter 'COLOR'"):
        select_one(variants, "add", {"COLOR": 1}, ["sm90"])


def test_wrong_arch_is_a_rejection_reason(variants):
    sel = match(variants, "add", {"dtype": "fp16"}, ["gfx90a"])
    assert not sel.accepted
    assert any("built for" in why and "gfx90a" in why for _, why in sel.rejected)


def test_ambiguous_request_asks_for_the_missing_axis(variants):
    with pytest.raises(KernelNotFound, match=r"ambiguous: also specify dtype \(one of bf16, fp16, fp32\)"):
        select_one(variants, "add", {}, ["sm90"])


@pytest.mark.parametrize("raw,arch", [("gfx942:sramecc+:xnack-", "gfx942"), ("gfx1100", "gfx1100"),
                                      ("sm_90", "sm90"), ("9.0", "sm90"), ("sm90a", "sm90"), ("8.6", "sm86")])
def test_arch_names_normalise(raw, arch):
    backend = "hip" if raw.startswith("gfx") else "cuda"
    assert normalize(backend, raw) == arch


def test_cuda_binary_compatibility_follows_major_versions():
    assert compatible("cuda", "sm86") == ["sm86", "sm85", "sm84", "sm83", "sm82", "sm81", "sm80"]
    assert compatible("cuda", "sm90") == ["sm90"]
    assert compatible("hip", "gfx942") == ["gfx942"]


def test_missing_arch_error_lists_built_archs_and_the_fix():
    with pytest.raises(KernelNotFound, match=r"no image for gfx1201; built archs: gfx90a, gfx942 — build it with "
                                             r"`python -m builder build --targets gfx1201 --add` "
                                             r"\(keeps the images already there\)"):
        pick_target("hip", "gfx1201", ["gfx942", "gfx90a"])
