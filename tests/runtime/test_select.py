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


def test_no_match_says_in_one_line_what_the_images_have_and_how_to_get_more(variants):
    with pytest.raises(KernelNotFound) as e:
        select_one(variants, "add", {"dtype": "fp64"}, ["sm90"])
    message = str(e.value)
    assert "\n" not in message
    assert "no variant of 'add' has dtype='fp64' on sm90 (these images have dtype bf16, fp16, fp32)" in message
    assert "pip install 'aotriton-rt[images-sm90-full]'" in message
    assert "python -m builder build --set full --kernels add --targets sm90 --add --out" in message


def test_unknown_kernel_lists_the_known_ones(variants):
    with pytest.raises(KernelNotFound, match=r"no kernel named 'nope' in the catalog; kernels: add, softmax"):
        select_one(variants, "nope", {})


def test_unknown_parameter_is_named(variants):
    with pytest.raises(KernelNotFound, match=r"has no parameter 'COLOR'"):
        select_one(variants, "add", {"COLOR": 1}, ["sm90"])


def test_a_misspelt_parameter_is_one_line_with_the_likely_name(variants):
    with pytest.raises(KernelNotFound) as e:
        select_one(variants, "add", {"dtyp": "fp16"}, ["sm90"])
    assert str(e.value).startswith("'add' has no parameter 'dtyp' (did you mean 'dtype'?); its parameters: ")
    assert "\n" not in str(e.value)


def test_no_variant_for_the_device_arch_names_the_archs_built_and_the_fix(variants):
    with pytest.raises(KernelNotFound) as e:
        select_one(variants, "add", {"dtype": "fp16"}, ["gfx90a"])
    assert str(e.value).startswith("these images hold 'add' for gfx1100, gfx942, sm80, sm90, none for gfx90a; "
                                   "install the full set for this GPU "
                                   "(`pip install 'aotriton-rt[images-gfx90a-full]'`)")


def test_the_image_wheel_extras_named_in_errors_exist(variants):
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    from aotriton_rt.select import IMAGE_WHEEL_TARGETS

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert {f"images-{t}-full" for t in IMAGE_WHEEL_TARGETS} == {e for e in extras if e.startswith("images-")}


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
