"""The head dim 512 bucket without a GPU: which calls run on it, where it is compiled, and the
typed refusal of a call that needs it where no build compiles it (the GPU cases are
tests/runtime/test_attention_gpu.py's ``d512`` ones)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import aotriton_rt
from aotriton_rt import KernelNotFound, NoDevice, UnsupportedError
from aotriton_rt.ops import attention as op
from aotriton_rt.ops.attention.dispatch import LibraryKernels, backward_params, forward_params
from aotriton_rt.ops.attention.family import (
    WIDE_HEAD_DIM,
    AttentionCall,
    bucket,
    head_dim_buckets,
    wide_compiled,
    wide_refusal,
)
from tests.runtime.test_attention_op import _synthetic_variant


def test_head_dims_257_to_512_run_zero_padded_on_the_512_bucket() -> None:
    for d in range(257, 513):
        assert bucket(d) == WIDE_HEAD_DIM
        assert head_dim_buckets(d, d) == [(512, 512)]
    assert bucket(256) == 256 and head_dim_buckets(256, 256) == [(256, 256), (512, 512)]
    # Unequal pairs with a side above 256 run equal on 512: v's zero columns are sliced back.
    assert head_dim_buckets(512, 256) == head_dim_buckets(128, 400) == [(512, 512)]
    call = AttentionCall("bf16", 384, 384, causal=2, causal_equivalent=True, varlen=True)
    assert forward_params(call) == {"dtype": "bf16", "HEAD_DIM": 512, "HEAD_DIM_V": 512, "CAUSAL": 2, "BIAS": 0,
                                    "DROPOUT": 0, "VARLEN": 1, "SOFTCAP": 0, "ALIBI": 0}
    mode, specs = backward_params(AttentionCall("fp16", 300, 300))
    assert mode == "split" and {s["HEAD_DIM"] for s in specs.values()} == {512}
    with pytest.raises(UnsupportedError, match=r"head dim 513 exceeds the largest supported head dim 512"):
        bucket(513)


def test_the_512_bucket_is_compiled_for_fp16_and_bf16_on_sm90_and_cdna_only() -> None:
    for arch in ("sm90", "gfx90a", "gfx942", "gfx950"):
        assert all(wide_compiled(dt, arch, bwd) for dt in ("fp16", "bf16") for bwd in (False, True))
        assert not wide_compiled("fp32", arch, False)
    for arch in ("sm80", "sm86", "sm89", "gfx1100", "gfx1201"):
        assert not wide_compiled("fp16", arch, False) and not wide_compiled("bf16", arch, True)
    # Narrower buckets are never refused, whatever the arch.
    assert wide_refusal(AttentionCall("fp32", 256, 256), {"HEAD_DIM": 256, "HEAD_DIM_V": 256}, "gfx1100", True) is None


class _NoImages:
    """A library that holds nothing: every kernel is missing."""

    tuning: dict = {}

    def variants_of(self, name: str) -> list:
        return []

    def kernel(self, name: str, **params: Any) -> Any:
        raise KernelNotFound(f"no variant of {name!r}")


def _kernels(arch: str) -> LibraryKernels:
    ks = LibraryKernels(_NoImages())
    ks.arch[0] = arch
    return ks


def test_a_call_on_the_512_bucket_where_no_build_compiles_it_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedError, match=r"^head dim 512 forward is not available for fp16 on gfx1100: head "
                                               r"dim 300 runs on the 512 bucket, compiled for fp16 and bf16 on sm90, "
                                               r"gfx90a, gfx942 and gfx950 only \(its tiles spill registers "
                                               r"elsewhere\); use a head dim up to 256, or a GPU of those archs$"):
        _kernels("gfx1100").forward(AttentionCall("fp16", 300, 300), 0)
    with pytest.raises(UnsupportedError, match=r"^head dim 512 backward is not available for fp32 on sm90: head dim "
                                               r"512/256 runs on the 512 bucket, .* use a head dim up to 256, or "
                                               r"fp16/bf16$"):
        _kernels("sm90").backward(AttentionCall("fp32", 512, 256), 0, False, True)
    with pytest.raises(UnsupportedError, match=r"^head dim 512 backward is not available for bf16 on sm80"):
        _kernels("sm80").backward(AttentionCall("bf16", 512, 512, causal=1), 0, True, True)


def test_a_call_on_the_512_bucket_where_it_is_compiled_names_the_missing_variant() -> None:
    # sm90 compiles it: images without it (the default set) lack a variant, not the arch's support.
    with pytest.raises(KernelNotFound, match=r"needs attn_fwd with dtype=fp16, HEAD_DIM=512, HEAD_DIM_V=512"):
        _kernels("sm90").forward(AttentionCall("fp16", 400, 400), 0)
    with pytest.raises(KernelNotFound, match=r"needs attn_fwd with dtype=fp16, HEAD_DIM=256"):
        _kernels("gfx1100").forward(AttentionCall("fp16", 256, 256), 0)


def test_without_a_device_to_name_the_arch_a_missing_512_variant_stays_kernel_not_found(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # JAX lowers for a named arch on machines without a GPU: the refusal must not probe a driver.
    ks = LibraryKernels(_NoImages())

    def no_device(device: int) -> str:
        raise NoDevice("no GPU backend is usable")

    monkeypatch.setattr(ks, "device_arch", no_device)
    with pytest.raises(KernelNotFound, match=r"needs attn_fwd with dtype=fp32, HEAD_DIM=512"):
        ks.forward(AttentionCall("fp32", 512, 512), 0)


def test_explain_refuses_the_512_bucket_by_name_where_it_is_not_compiled(tmp_path: Path) -> None:
    variants = [_synthetic_variant("attn_fwd", {"dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 0,
                                                "BIAS": 0, "DROPOUT": 0, "VARLEN": 0, "SOFTCAP": 0, "ALIBI": 0},
                                   arch=arch) for arch in ("sm90", "sm80")]
    (tmp_path / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                       "triton_version": "3.6.0", "variants": variants}))
    lib = aotriton_rt.Library(tmp_path)
    with pytest.raises(UnsupportedError, match=r"^head dim 512 forward is not available for fp16 on sm80"):
        op.explain(dtype="fp16", head_dim=320, seqlen_q=128, arch="sm80", library=lib)
    with pytest.raises(UnsupportedError, match=r"^head dim 512 backward is not available for fp32 on sm90"):
        op.explain(dtype="fp32", head_dim=512, seqlen_q=128, arch="sm90", backward=True, library=lib)
    with pytest.raises(KernelNotFound, match=r"needs attn_fwd with .*HEAD_DIM=512.* on sm90, which these images lack"):
        op.explain(dtype="bf16", head_dim=512, seqlen_q=128, arch="sm90", library=lib)



def test_decode_refuses_head_dim_512_so_short_queries_stay_with_the_attention_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from aotriton_rt.ops.decode import decode_attention, route_options
    from tests.runtime.test_attention_op import Dev
    from tests.runtime.test_decode_op import _recording_library

    with pytest.raises(UnsupportedError, match=r"^head dim 512 exceeds the largest supported head dim 256; supported: "
                                               r"1\.\.256 \(compiled buckets 16, .*, 256; others are read masked"):
        decode_attention(Dev(2, 1, 8, 512), Dev(2, 256, 2, 512), Dev(2, 256, 2, 512))
    call = {"causal": True, "window": None, "align": "bottom_right", "bias": None, "dropout_p": 0.0, "scale": None,
            "cu_seqlens_q": None, "cu_seqlens_k": None, "layout": "bhsd", "out": None, "lse": None,
            "return_mask": False}
    lib = _recording_library(monkeypatch)
    # One query row: the decode kernels take head dim 256, attention()'s own kernels take 512.
    assert route_options(Dev(2, 8, 1, 256), *[Dev(2, 2, 300, 256)] * 2, **call, library=lib) is not None
    assert route_options(Dev(2, 8, 1, 512), *[Dev(2, 2, 300, 512)] * 2, **call, library=lib) is None
