"""What to build: kernel declarations, their expansion into jobs, selection, shards, targets.

Nothing here compiles; expansion is pure and fast, so it is checked exhaustively.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="kernel declarations are @triton.jit functions")
tl = pytest.importorskip("triton.language")

from builder import registry  # noqa: E402 - after the importorskip above
from builder.registry import ConfigDecl, Job, KernelDecl, expand, load_kernels, select, shard  # noqa: E402
from builder.targets import KNOWN, UnknownTarget, parse_targets  # noqa: E402

FIXTURE = "tests.builder.kernels_fixture"
GFX942, GFX1100, SM90 = KNOWN["gfx942"], KNOWN["gfx1100"], KNOWN["sm90"]


@triton.jit
def axpy_kernel(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, x * alpha + tl.load(y_ptr + offs))


@triton.jit
def other_kernel(x_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)


def _axpy(**changes) -> KernelDecl:
    fields = dict(
        name="axpy", fn=axpy_kernel,
        signature={"x_ptr": "*{dtype}", "y_ptr": "*{dtype}", "n": "i32", "alpha": "fp32",
                   "BLOCK": "constexpr", "EVEN": "constexpr"},
        axes={"dtype": ("fp16", "bf16", "fp32"), "EVEN": (False, True)},
        configs=(ConfigDecl(constexprs={"BLOCK": 256}, num_warps=2, num_stages=1),
                 ConfigDecl(constexprs={"BLOCK": 1024}, num_warps=8, num_stages=2,
                        options={"waves_per_eu": 2}, backends=("hip",))),
        grid=("cdiv(n, BLOCK)", "1", "1"),
    )
    fields.update(changes)
    return KernelDecl(**fields)


def _expand(kernel: KernelDecl, tgts=(GFX942, SM90), build_set: str = "full", **kw) -> list[Job]:
    return expand(kernel, list(tgts), build_set, "3.6.0", **kw)


# --------------------------------------------------------------------------- declarations


def test_load_kernels_finds_the_builders_own_kernels() -> None:
    kernels = load_kernels()
    assert {"add", "softmax", "layernorm", "rmsnorm"} <= set(kernels)
    assert kernels["add"].name == "add" and kernels["add"].fn.__name__ == "add_kernel"


def test_load_kernels_reads_another_package_and_skips_private_modules() -> None:
    kernels = load_kernels(FIXTURE)
    # _twice (a private subpackage) would raise if it were imported.
    assert sorted(kernels) == ["broken", "scale", "slow"]


def test_load_kernels_refuses_a_name_declared_twice() -> None:
    with pytest.raises(ValueError, match=r"^kernel name 'twin' is declared twice "
                                         r"\(tests\.builder\.kernels_fixture\._twice\.two\)$"):
        load_kernels(FIXTURE + "._twice")


def test_kernel_signature_must_list_the_functions_arguments_in_order() -> None:
    swapped = {"y_ptr": "*fp32", "x_ptr": "*fp32", "n": "i32", "alpha": "fp32",
               "BLOCK": "constexpr", "EVEN": "constexpr"}
    with pytest.raises(ValueError, match=re.escape(
            "kernel axpy: signature names ['y_ptr', 'x_ptr', 'n', 'alpha', 'BLOCK', 'EVEN'] must be "
            "the function's arguments in order: ['x_ptr', 'y_ptr', 'n', 'alpha', 'BLOCK', 'EVEN']")):
        _axpy(signature=swapped)


def test_kernel_axis_must_be_a_constexpr_or_a_signature_field() -> None:
    with pytest.raises(ValueError, match=r"kernel axpy: axis 'layout' is neither a constexpr argument nor "
                                         r"used as \{layout\} in the signature"):
        _axpy(axes={"dtype": ("fp16",), "EVEN": (True,), "layout": ("row",)})


def test_kernel_refuses_a_predicate_for_the_full_set() -> None:
    with pytest.raises(ValueError, match=r"kernel axpy: the full set is everything; it takes no predicate"):
        _axpy(sets={"full": lambda spec, target: True})


def test_grid_of_evaluates_the_rule_as_the_runtime_does_and_ignores_extra_names() -> None:
    assert _axpy().grid_of(n=1000, BLOCK=256, alpha=2.0, num_warps=4) == (4, 1, 1)
    assert _axpy(grid=("cdiv(n, BLOCK * (1 + min(EVEN, 1)))", "2", "1")).grid_of(n=1000, BLOCK=256,
                                                                                EVEN=1) == (2, 2, 1)


def test_the_attention_forward_grid_pairs_causal_query_blocks() -> None:
    fwd = load_kernels()["attn_fwd"]
    common = {"seqlen_q": 4097, "batch": 3, "num_heads_q": 5, "BLOCK_M": 128, "WARP_SPEC": 0}
    assert fwd.grid_of(CAUSAL=0, **common) == (33, 15, 1)
    assert fwd.grid_of(CAUSAL=2, **common) == (17, 15, 1)  # 33 blocks: 16 pairs and the middle one
    assert fwd.grid_of(CAUSAL=1, **{**common, "WARP_SPEC": 1}) == (33, 15, 1)  # unpaired


# --------------------------------------------------------------------------- expansion


def test_expand_is_the_cross_product_of_axes_configs_and_targets() -> None:
    jobs = _expand(_axpy())
    # 3 dtypes x 2 EVEN x (2 configs on hip, 1 on cuda: the second is hip-only)
    assert len(jobs) == 3 * 2 * 2 + 3 * 2 * 1
    seen = {(j.target.arch, j.spec["dtype"], j.spec["EVEN"], j.config_index) for j in jobs}
    assert len(seen) == len(jobs)
    assert {j.config_index for j in jobs if j.target.backend == "cuda"} == {0}
    assert {j.config_index for j in jobs if j.target.backend == "hip"} == {0, 1}


def test_expand_resolves_the_signature_and_the_constexprs() -> None:
    job = next(j for j in _expand(_axpy(), [GFX942])
               if j.spec == {"dtype": "bf16", "EVEN": True} and j.config_index == 1)
    assert job.signature == {"x_ptr": "*bf16", "y_ptr": "*bf16", "n": "i32", "alpha": "fp32",
                             "BLOCK": "constexpr", "EVEN": "constexpr"}
    # Axis values and config values both become constexprs; the config's BLOCK is index 1's.
    assert job.constexprs == {"BLOCK": 1024, "EVEN": True}
    assert job.options() == {"num_warps": 8, "num_stages": 2, "waves_per_eu": 2}
    assert job.grid == ("cdiv(n, BLOCK)", "1", "1")
    assert job.label == "axpy[dtype=bf16,EVEN=True]#1@gfx942"
    assert job.package == "builder.kernels"


def test_expand_assumes_16_byte_pointers_unless_told_otherwise() -> None:
    job = _expand(_axpy(), [SM90])[0]
    assert job.divisibility == {"x_ptr": 16, "y_ptr": 16}
    told = _expand(_axpy(divisibility={"x_ptr": 16, "n": 16, "BLOCK": 16}), [SM90])[0]
    # Constexprs cannot carry an alignment promise; scalars can (n % 16 == 0).
    assert told.divisibility == {"x_ptr": 16, "n": 16}
    assert _expand(_axpy(divisibility={}), [SM90])[0].divisibility == {}


def test_divisibility_and_checks_may_be_declared_per_spec() -> None:
    # A masked variant (EVEN=False) promises nothing of its arguments; the even one their alignment.
    kernel = _axpy(divisibility=lambda spec: {"x_ptr": 16, "y_ptr": 16, "n": 16} if spec["EVEN"] else {},
                   checks=lambda spec: ("n % BLOCK == 0",) if spec["EVEN"] else ["n >= 1"])
    jobs = {(j.spec["dtype"], j.spec["EVEN"]): j for j in _expand(kernel, [SM90])}
    assert jobs[("fp16", True)].divisibility == {"x_ptr": 16, "y_ptr": 16, "n": 16}
    assert jobs[("fp16", True)].checks == ("n % BLOCK == 0",)
    assert jobs[("bf16", False)].divisibility == {} and jobs[("bf16", False)].checks == ("n >= 1",)
    # Both are part of a variant's key: the same spec otherwise declared builds another binary.
    static = {(j.spec["dtype"], j.spec["EVEN"]): j for j in _expand(_axpy(), [SM90])}
    assert static[("fp16", True)].key != jobs[("fp16", True)].key
    assert kernel.divisibility_for({"dtype": "fp16", "EVEN": False}) == {}
    with pytest.raises(ValueError, match=r"kernel axpy: its divisibility is per spec; pass the spec"):
        registry._divisibility(kernel, jobs[("fp16", True)].signature)
    with pytest.raises(ValueError, match=r"kernel axpy: checks of spec \{'dtype': 'fp16', 'EVEN': False\} must be a "
                                         r"sequence of strings, got 'n > 0'"):
        _expand(_axpy(checks=lambda spec: "n > 0"), [SM90])
    with pytest.raises(ValueError, match=r"kernel axpy: divisibility of spec .* must be a mapping of argument names "
                                         r"to integers, got list"):
        _expand(_axpy(divisibility=lambda spec: [16]), [SM90])


def test_expand_drops_excluded_specs_per_target() -> None:
    kernel = _axpy(exclude=lambda spec, t: spec["dtype"] == "bf16" and t.arch == "gfx1100")
    jobs = _expand(kernel, [GFX1100, SM90])
    assert not [j for j in jobs if j.target.arch == "gfx1100" and j.spec["dtype"] == "bf16"]
    assert [j for j in jobs if j.target.arch == "sm90" and j.spec["dtype"] == "bf16"]


def test_expand_default_set_keeps_what_the_kernel_chooses_and_full_keeps_all() -> None:
    kernel = _axpy(sets={"default": lambda spec, t: spec["dtype"] != "bf16" and spec["EVEN"]})
    default = _expand(kernel, build_set="default")
    assert {(j.spec["dtype"], j.spec["EVEN"]) for j in default} == {("fp16", True), ("fp32", True)}
    assert len(_expand(kernel, build_set="full")) == len(_expand(_axpy()))
    # A kernel that names no default set is built whole in the default set.
    assert len(_expand(_axpy(), build_set="default")) == len(_expand(_axpy()))


def test_a_set_may_keep_only_the_first_configs_and_the_others_keep_all() -> None:
    kernel = _axpy(set_configs={"default": 1})
    default = _expand(kernel, build_set="default")
    assert {(j.target.arch, j.config_index) for j in default} == {("gfx942", 0), ("sm90", 0)}
    assert {j.config_index for j in _expand(kernel, build_set="full") if j.target.arch == "gfx942"} == {0, 1}
    # Config 0 is the same variant in every set: the same key.
    full_keys = {j.key for j in _expand(kernel, build_set="full")}
    assert {j.key for j in default} <= full_keys


def test_a_set_may_name_the_configs_it_keeps_per_spec_and_they_keep_their_numbers() -> None:
    kernel = _axpy(set_configs={"default": lambda spec, target: (1,) if spec["dtype"] == "fp32" else (0, 1)})
    default = _expand(kernel, [GFX942], build_set="default")  # two configs there (#1 is HIP's)
    assert {j.config_index for j in default if j.spec["dtype"] == "fp32"} == {1}
    assert {j.config_index for j in default if j.spec["dtype"] == "fp16"} == {0, 1}
    full = {(j.target.arch, tuple(sorted(j.spec.items())), j.config_index): j.key
            for j in _expand(kernel, [GFX942], build_set="full")}
    for j in default:  # config #1 kept alone is still #1: the same variant, the same key
        assert full[(j.target.arch, tuple(sorted(j.spec.items())), j.config_index)] == j.key
    bad = _axpy(set_configs={"default": lambda spec, target: (2,)})
    with pytest.raises(ValueError, match=r"kernel axpy: set 'default' keeps configs \[2\] of spec .* which has 2"):
        _expand(bad, [GFX942], build_set="default")


def test_tuning_rules_naming_a_config_the_build_leaves_out_are_dropped() -> None:
    rules = lambda target: [{"min": 1, "config": 1}, {"config": 0}, {"other": True}]
    kernel = _axpy(tuning=rules, set_configs={"default": 1})
    table = registry.tuning_of({"axpy": kernel}, _expand(kernel, [GFX942], build_set="default"))
    assert table == {"axpy": [{"arch": "gfx942", "config": 0}, {"arch": "gfx942", "other": True}]}
    table = registry.tuning_of({"axpy": kernel}, _expand(kernel, [GFX942], build_set="full"))
    assert table["axpy"][0] == {"arch": "gfx942", "min": 1, "config": 1}


def test_expand_takes_configs_chosen_per_spec_and_target() -> None:
    kernel = _axpy(configs=lambda spec, t: [ConfigDecl(constexprs={"BLOCK": 64 if t.warp_size == 32 else 128},
                                                   num_warps=4 if spec["dtype"] == "fp32" else 2)])
    jobs = _expand(kernel)
    assert {(j.target.arch, j.constexprs["BLOCK"]) for j in jobs} == {("gfx942", 128), ("sm90", 64)}
    assert {j.config.num_warps for j in jobs if j.spec["dtype"] == "fp32"} == {4}


def test_expand_refuses_a_constexpr_without_a_value() -> None:
    kernel = _axpy(configs=(ConfigDecl(num_warps=4),))
    with pytest.raises(ValueError, match=r"kernel axpy: constexpr BLOCK has no value in spec "
                                         r"\{'dtype': 'fp16', 'EVEN': False\} or config #0"):
        _expand(kernel)


def test_a_kernel_without_the_asked_set_contributes_its_default_set() -> None:
    only_fp16 = _axpy(sets={"default": lambda spec, target: spec["dtype"] == "fp16"})
    assert {j.spec["dtype"] for j in _expand(only_fp16, build_set="gputest")} == {"fp16"}
    extra = _axpy(sets={"default": lambda spec, target: spec["dtype"] == "fp16",
                        "gputest": lambda spec, target: spec["dtype"] != "fp16"})
    assert "fp16" not in {j.spec["dtype"] for j in _expand(extra, build_set="gputest")}
    assert registry.known_sets({"axpy": extra}) == ["default", "full", "gputest"]


def test_expand_records_the_kernels_package_for_the_workers() -> None:
    scale = load_kernels(FIXTURE)["scale"]
    assert {j.package for j in _expand(scale, package=FIXTURE)} == {FIXTURE}


# --------------------------------------------------------------------------- keys


def test_job_keys_are_sha256_hex_unique_and_stable() -> None:
    jobs = _expand(_axpy())
    assert all(re.fullmatch(r"[0-9a-f]{64}", j.key) for j in jobs)
    assert len({j.key for j in jobs}) == len(jobs)
    assert [j.key for j in _expand(_axpy())] == [j.key for j in jobs]


@pytest.mark.parametrize("change", ["triton", "source", "options", "grid", "checks", "divisibility",
                                    "target"])
def test_job_key_changes_with_everything_that_determines_the_binary(change: str) -> None:
    base = _expand(_axpy(), [GFX942], source_key="src")[0]
    kernel, tgt, version, source = _axpy(), [GFX942], "3.6.0", "src"
    if change == "triton":
        version = "3.6.1"
    elif change == "source":
        source = "edited"
    elif change == "options":
        kernel = _axpy(configs=(ConfigDecl(constexprs={"BLOCK": 256}, num_warps=2, num_stages=1,
                                       options={"waves_per_eu": 1}),))
    elif change == "grid":
        kernel = _axpy(grid=("cdiv(n, BLOCK)", "2", "1"))
    elif change == "checks":
        kernel = _axpy(checks=("n > 0",))
    elif change == "divisibility":
        kernel = _axpy(divisibility={"x_ptr": 16})
    elif change == "target":
        tgt = [KNOWN["gfx950"]]
    other = expand(kernel, tgt, "full", version, source_key=source)[0]
    assert other.spec == base.spec and other.config_index == base.config_index
    assert other.key != base.key


def test_job_key_follows_the_kernel_source() -> None:
    # Two functions with the same signature but different bodies give different keys.
    a = _expand(_axpy(name="k", fn=other_kernel, signature={"x_ptr": "*fp32", "n": "i32",
                                                           "BLOCK": "constexpr", "EVEN": "constexpr"},
                      axes={"EVEN": (True,)}), [SM90])
    assert a[0].key != _expand(_axpy(), [SM90])[0].key
    assert other_kernel.cache_key != axpy_kernel.cache_key


# --------------------------------------------------------------------------- selection and shards


def test_select_without_names_takes_every_kernel_by_name() -> None:
    kernels = load_kernels(FIXTURE)
    assert [k.name for k in select(kernels, None)] == ["broken", "scale", "slow"]
    assert [k.name for k in select(kernels, "")] == ["broken", "scale", "slow"]


def test_select_takes_the_named_kernels_once_each() -> None:
    kernels = load_kernels(FIXTURE)
    assert [k.name for k in select(kernels, " slow, scale ,slow")] == ["scale", "slow"]


def test_select_refuses_unknown_names_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"^unknown kernel nope, also; known kernels: broken, scale, slow$"):
        select(load_kernels(FIXTURE), "scale,nope,also")


def test_shards_partition_the_jobs_evenly_whatever_their_order() -> None:
    jobs = _expand(_axpy())
    shuffled = list(jobs)
    random.Random(7).shuffle(shuffled)
    parts = [shard(jobs, f"{k}/4") for k in range(1, 5)]
    assert [shard(shuffled, f"{k}/4") for k in range(1, 5)] == parts
    keys = [j.key for part in parts for j in part]
    assert sorted(keys) == sorted(j.key for j in jobs)
    assert len(set(keys)) == len(keys)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert shard(jobs, None) == sorted(jobs, key=lambda j: j.key)


@pytest.mark.parametrize("spec", ["0/4", "5/4", "2", "a/b", "1/0", "-1/4"])
def test_shard_refuses_a_malformed_spec(spec: str) -> None:
    with pytest.raises(ValueError, match=rf"^--shard must be K/N with 1 <= K <= N, got '{re.escape(spec)}'$"):
        shard(_expand(_axpy()), spec)


def test_more_shards_than_jobs_leaves_some_empty() -> None:
    jobs = _expand(_axpy(), [SM90])[:3]
    parts = [shard(jobs, f"{k}/5") for k in range(1, 6)]
    assert [len(p) for p in parts] == [1, 1, 1, 0, 0]


# --------------------------------------------------------------------------- targets


def test_targets_default_to_the_supported_set() -> None:
    assert [t.arch for t in parse_targets(None)] == ["sm80", "sm90", "gfx1100", "gfx1201",
                                                     "gfx90a", "gfx942", "gfx950"]


def test_targets_accept_aliases_and_cuda_spellings() -> None:
    assert [t.arch for t in parse_targets("cuda")] == ["sm80", "sm90"]
    assert {t.backend for t in parse_targets("hip")} == {"hip"}
    assert parse_targets("sm_90a, SM80 ,gfx942,gfx942") == [KNOWN["sm80"], SM90, GFX942]


def test_targets_know_their_wave_size() -> None:
    assert {t.arch: t.warp_size for t in parse_targets("gfx942,gfx1100,sm90")} == {
        "gfx942": 64, "gfx1100": 32, "sm90": 32}


def test_unknown_target_fails_listing_the_known_ones() -> None:
    with pytest.raises(UnknownTarget, match=r"^unknown target gfx9999, sm75; known targets: gfx908, gfx90a, "
                                            r"gfx942, .*, sm90 \(aliases: hip, cuda, default\)$"):
        parse_targets("gfx942,gfx9999,sm75")
    assert issubclass(UnknownTarget, ValueError)


def test_targets_give_tritons_gpu_target() -> None:
    from triton.backends.compiler import GPUTarget

    from builder.targets import gpu_target

    assert gpu_target(GFX942) == GPUTarget("hip", "gfx942", 64)
    # Capability 90, not "sm90a": Triton picks the arch-specific variant itself.
    assert gpu_target(SM90) == GPUTarget("cuda", 90, 32)


def test_builder_modules_import_without_importing_triton() -> None:
    # The builder's own modules (not the kernel files) import triton only when they compile, so
    # the CLI answers argument errors fast and the pure parts test without triton's start-up.
    code = ("import sys, builder.registry, builder.targets, builder.compile, builder.build, "
            "builder.merge, builder.abi, builder.__main__; print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(registry.__file__).parent.parent)
    assert out.stdout.strip() == "False", out.stderr
