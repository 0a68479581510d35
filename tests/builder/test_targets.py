"""Which AMD targets the pinned Triton can produce, measured rather than assumed."""

from __future__ import annotations

import pytest

from builder.targets import BEYOND_COMPILER, DEFAULT, KNOWN, TargetBeyondCompiler, UnknownTarget, parse_targets


def test_gfx1151_is_a_known_rdna_target_with_32_wide_waves_built_when_asked() -> None:
    assert "gfx1151" not in DEFAULT  # the quickstart's build-time budget (docs/performance.md)
    assert KNOWN["gfx1151"].warp_size == 32
    assert KNOWN["gfx1151"] not in parse_targets("hip")
    assert parse_targets("gfx1151") == [KNOWN["gfx1151"]]


def test_a_target_beyond_the_compiler_fails_naming_the_compiler_version() -> None:
    with pytest.raises(TargetBeyondCompiler, match=r"^gfx1250 cannot be built with triton 3\.6\.0: its assembler "
                                                   r"rejects the attention backward kernels .* leave it out of "
                                                   r"--targets\)$"):
        parse_targets("gfx942,gfx1250")
    assert issubclass(TargetBeyondCompiler, UnknownTarget)
    assert not set(BEYOND_COMPILER) & set(KNOWN)


@pytest.mark.slow
def test_triton_still_cannot_compile_the_attention_backward_for_gfx1250(monkeypatch: pytest.MonkeyPatch) -> None:
    # The day the pinned Triton compiles it, gfx1250 moves from BEYOND_COMPILER into KNOWN.
    import triton

    from builder.registry import expand, load_kernels
    from builder.targets import Target

    if triton.__version__ != BEYOND_COMPILER["gfx1250"][0]:
        pytest.skip(f"measured with triton {BEYOND_COMPILER['gfx1250'][0]}, {triton.__version__} is installed")
    from builder.compile import compile_env, compile_job

    for name, value in compile_env().items():  # compile_job sets these; undo them after the test
        monkeypatch.setenv(name, value)

    kernel = load_kernels()["attn_bwd_preprocess"]
    job = sorted(expand(kernel, [Target("hip", "gfx1250", 32)], "default", triton.__version__),
                 key=lambda j: j.label)[0]
    with pytest.raises(RuntimeError, match=r"LLD failed to link hsaco"):
        compile_job(job)
