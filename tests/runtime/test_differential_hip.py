"""aotriton-rt launches HIP kernels exactly as Triton's own HIP launcher does.

For every kernel of the default set on every default HIP target (one variant each, rotating
through the variants from target to target, plus a sample of the full set on gfx942), the
variant is launched twice against the recording fake ``libamdhip64``: once by ``@triton.jit``
through Triton's own driver and launcher (compiled here from C against the HIP headers in the
triton wheel, loading the fake through ``TRITON_LIBHIP_PATH``), once by aotriton-rt from the
image the builder made. The two launches must agree on the code object (size and digest),
kernel symbol, grid, block, dynamic shared memory, stream and every byte of the kernarg
segment that the fake builds from the code object's own AMDGPU metadata.

No AMD GPU exists here: this proves what reaches ``hipModuleLaunchKernel``, not execution.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aotriton_rt.catalog import Catalog
from builder.targets import DEFAULT
from tests.fakehip import build_fake_hip, fake_hip_env
from tests.fakehip.differential import compile_env, differences, hooked_env, logged_launches, run_python

# The default HIP targets plus gfx1151 (known and buildable, though not a default target).
HIP_TARGETS = tuple(sorted({*(a for a in DEFAULT if a.startswith("gfx")), "gfx1151"}, key=lambda a: (len(a), a)))
DEVICE_ARCH = {"gfx90a": "gfx90a:sramecc+:xnack-", "gfx942": "gfx942:sramecc+:xnack-",
               "gfx950": "gfx950:sramecc+:xnack-", "gfx1100": "gfx1100", "gfx1151": "gfx1151",
               "gfx1201": "gfx1201", "gfx1250": "gfx1250"}
LAUNCHES = ("hipModuleLaunchKernel", "hipModuleLaunchCooperativeKernel")
#: The kernels whose feature variants (spec axes SOFTCAP, ALIBI) the gfx942 sample adds.
FEATURE_KERNELS = "attn_fwd,attn_bwd_dkdv,attn_bwd_dq"


@pytest.fixture(scope="session")
def hip_sample_images(tmp_path_factory: pytest.TempPathFactory, triton_cache: Path) -> Path:
    """The default set's kernels, one variant each per default HIP target, plus variants of the
    full set on gfx942: attention's bias, dropout and varlen paths, its logit softcap and ALiBi
    variants and its head dim 512 bucket (forward, dK/dV, dQ each), built by the builder."""
    out = tmp_path_factory.mktemp("diff-hip")
    env = compile_env(triton_cache)
    run_python(["-m", "tests.fakehip.differential", "build", str(out), ",".join(HIP_TARGETS), "default", "1"], env)
    folders = [out]
    for name, kernels, where in (("full", "attn_fwd,attn_bwd_dq", None),
                                 ("softcap", FEATURE_KERNELS, "SOFTCAP=1"), ("alibi", FEATURE_KERNELS, "ALIBI=1"),
                                 ("d512", FEATURE_KERNELS, "HEAD_DIM=512")):
        folders.append(tmp_path_factory.mktemp(f"diff-hip-{name}"))
        run_python(["-m", "tests.fakehip.differential", "build", str(folders[-1]), "gfx942", "full", "1", kernels,
                    *([where] if where else [])], env)
    from builder.merge import merge

    merged = tmp_path_factory.mktemp("diff-hip-merged")
    merge(folders, merged)
    return merged


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_hip(tmp_path_factory.mktemp("fakehip"))


def launch_both(images: Path, arch: str, fake: Path, tmp: Path, triton_cache: Path,
                extra_env: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Run the differential for ``arch``; returns (triton, aotriton-rt) records by variant key."""
    env = {**compile_env(triton_cache), **fake_hip_env(fake, None, arch=DEVICE_ARCH[arch], lds=160 * 1024),
           "TRITON_LIBHIP_PATH": str(fake), **(extra_env or {})}
    return logged_launches(images, arch, tmp, env, LAUNCHES, "hipModuleLoadData")


@pytest.mark.slow
@pytest.mark.parametrize("arch", HIP_TARGETS)
def test_aotriton_launches_every_default_hip_kernel_as_tritons_own_launcher_does(
        hip_sample_images: Path, fake_lib: Path, tmp_path: Path, triton_cache: Path, arch: str) -> None:
    jit, aot = launch_both(hip_sample_images, arch, fake_lib, tmp_path, triton_cache)
    catalog = Catalog.load(hip_sample_images)
    kernels = {v.kernel for v in catalog.variants if v.target.arch == arch}
    assert {"add", "softmax", "layernorm", "rmsnorm", "attn_fwd", "attn_bwd_preprocess", "attn_bwd_dq",
            "attn_bwd_dkdv"} <= kernels
    assert differences(hip_sample_images, arch, jit, aot) == []
    if arch in ("gfx942", "gfx950"):  # the FP8 forward (default set), in each arch's e4m3 format
        fp8 = [v for v in catalog.variants if v.target.arch == arch and v.kernel == "attn_fwd_fp8"]
        assert fp8 and all(v.key in jit and v.key in aot for v in fp8), arch
        assert {v.spec["dtype"] for v in fp8} == {"fp8e4b8" if arch == "gfx942" else "fp8e4nv"}
    if arch == "gfx942":  # the feature variants were launched and compared too
        for axis, value in (("SOFTCAP", 1), ("ALIBI", 1), ("HEAD_DIM", 512)):
            launched = {v.kernel for v in catalog.variants if v.target.arch == arch and v.spec.get(axis) == value
                        and v.key in jit and v.key in aot}
            assert launched == set(FEATURE_KERNELS.split(",")), (axis, launched)
    # Both sides really launched, through the two different argument-passing styles.
    assert {r["launch"]["via"] for r in jit.values()} == {"kernelParams"}
    assert {r["launch"]["via"] for r in aot.values()} == {"extra"}


#: The fp8 KV-cache decode variants, by target: the cache type each target's images hold.
FP8_DECODE = {"gfx942": "fp8e4b8", "gfx950": "fp8e4nv"}


@pytest.fixture(scope="module")
def fp8_decode_images(tmp_path_factory: pytest.TempPathFactory, triton_cache: Path) -> Path:
    """Two variants each of the fp8 cache's decode and append kernels on gfx942 (e4m3fnuz) and
    gfx950 (e4m3fn), from the gputest set (as is and masked, contiguous and paged)."""
    env = compile_env(triton_cache)
    folders = []
    for arch, kv in FP8_DECODE.items():
        folders.append(tmp_path_factory.mktemp(f"diff-hip-{kv}"))
        run_python(["-m", "tests.fakehip.differential", "build", str(folders[-1]), arch, "gputest", "2",
                    "attn_decode,attn_decode_append", f"KV_DTYPE={kv}"], env)
    from builder.merge import merge

    merged = tmp_path_factory.mktemp("diff-hip-fp8-merged")
    merge(folders, merged)
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(FP8_DECODE))
def test_aotriton_launches_the_fp8_cache_decode_kernels_as_tritons_own_launcher_does(
        fp8_decode_images: Path, fake_lib: Path, tmp_path: Path, triton_cache: Path, arch: str) -> None:
    jit, aot = launch_both(fp8_decode_images, arch, fake_lib, tmp_path, triton_cache)
    catalog = Catalog.load(fp8_decode_images)
    keys = {v.key for v in catalog.variants if v.target.arch == arch and v.spec.get("KV_DTYPE") == FP8_DECODE[arch]}
    assert len(keys) == 4 and keys <= set(jit) and keys <= set(aot)
    assert differences(fp8_decode_images, arch, jit, aot) == []


# ---------------------------------------------------------------------------- the test can fail

# Each mutation breaks one thing aotriton-rt decides at launch; the differential must see it.
MUTATIONS = {
    # A scalar moved into the padding after it: a layout the packer accepts (same size, no
    # overlap) but not the one the code object reads. Variants without such padding stay as they are.
    "packer offset": (
        "import dataclasses\n"
        "import aotriton_rt.catalog as c\n"
        "_orig = c.Variant.from_json.__func__\n"
        "def _shifted(cls, *a, **k):\n"
        "    v = _orig(cls, *a, **k)\n"
        "    args = list(v.args)\n"
        "    ends = [x.offset for x in args[1:]] + [(v.hidden_args or [v])[0].offset "
        "if v.hidden_args else v.param_size]\n"
        "    for i, (x, nxt) in enumerate(zip(args, ends)):\n"
        "        if not x.is_pointer and nxt >= x.offset + 2 * x.size:\n"
        "            args[i] = dataclasses.replace(x, offset=x.offset + x.size)\n"
        "            break\n"
        "    return dataclasses.replace(v, args=tuple(args))\n"
        "c.Variant.from_json = classmethod(_shifted)\n",
        "kernarg"),
    "grid": (
        "import aotriton_rt.drivers.hip as h\n"
        "_orig = h.HipLauncher.__call__\n"
        "def _wrong(self, gx, gy, gz, stream, values):\n"
        "    return _orig(self, gx + 1, gy, gz, stream, values)\n"
        "h.HipLauncher.__call__ = _wrong\n",
        "grid"),
    "shared memory": (
        "import aotriton_rt.drivers.hip as h\n"
        "_orig = h.HipDriver.make_launcher\n"
        "def _wrong(self, function, *, shared, **k):\n"
        "    return _orig(self, function, shared=shared + 256, **k)\n"
        "h.HipDriver.make_launcher = _wrong\n",
        "shared"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_differential_fails_when_our_launch_is_wrong(hip_sample_images: Path, fake_lib: Path, tmp_path: Path,
                                                     triton_cache: Path, mutation: str) -> None:
    source, field = MUTATIONS[mutation]
    jit, aot = launch_both(hip_sample_images, "gfx942", fake_lib, tmp_path, triton_cache,
                           hooked_env(tmp_path, source))
    problems = differences(hip_sample_images, "gfx942", jit, aot)
    assert problems, f"the {mutation} mutation went unnoticed"
    assert all(f"{field}" in p for p in problems), problems
