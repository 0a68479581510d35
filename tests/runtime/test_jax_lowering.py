"""aotriton_rt.jax without a GPU: jitted functions lowered to StableHLO for cuda and rocm on the CPU.

jaxlib's CUDA plugin imports without a GPU, so its own bindings serialize the real
``TritonKernelCall`` that the custom call carries; these tests decode that protobuf and check
it against the catalog (and, for ROCm, against the HSACO's own AMDGPU metadata).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import zlib
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
try:
    from jax._src.lib import gpu_triton
except ImportError:
    gpu_triton = None
if not hasattr(gpu_triton, "TritonKernelCall"):
    pytest.skip("jaxlib without a GPU plugin (pip install jax-cuda13-plugin)", allow_module_level=True)

import aotriton_rt  # noqa: E402
import aotriton_rt.jax as aj  # noqa: E402
from aotriton_rt import ArgumentError, ImageError, UnsupportedError  # noqa: E402

# -- a protobuf wire-format reader (enough for jaxlib's triton.proto) --------------------------

def _varint(b: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        c = b[i]
        i += 1
        n |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return n, i


def fields(b: bytes) -> list[tuple[int, int, object]]:
    out, i = [], 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(b, i)
        elif wire == 2:
            n, i = _varint(b, i)
            value, i = b[i:i + n], i + n
        elif wire == 5:
            value, i = b[i:i + 4], i + 4
        elif wire == 1:
            value, i = b[i:i + 8], i + 8
        else:
            raise AssertionError(f"wire type {wire}")
        out.append((num, wire, value))
    return out


def _custom_calls(op, found: list) -> list:
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.operation.name == "stablehlo.custom_call":
                    found.append(inner)
                _custom_calls(inner.operation, found)
    return found


def calls_of(lowered) -> list[dict]:
    """The decoded TritonKernelCall of every custom call of a lowered function, in program order."""
    return [decode(op.attributes["mhlo.backend_config"]["opaque"].value_bytes)
            for op in _custom_calls(lowered.compiler_ir("stablehlo").operation, [])]


def kernel_call_of(lowered) -> dict:
    (call,) = calls_of(lowered)
    return call


def decode(raw: bytes) -> dict:
    outer = fields(zlib.decompress(raw))
    call = fields(next(v for n, w, v in outer if w == 2))  # TritonAnyKernelCall.kernel_call
    kernel = fields(next(v for n, w, v in call if n == 1))
    params = [fields(v) for n, w, v in call if n == 5]
    grid = [v for n, w, v in call if n in (2, 3, 4)]
    strings = [v for n, w, v in kernel if w == 2]
    ints = {n: v for n, w, v in kernel if w == 0}
    return {"name": strings[0].decode(), "binary": strings[1], "ints": ints, "grid": grid, "params": params}


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lib(built_images: Path) -> aotriton_rt.Library:
    return aotriton_rt.Library(built_images)


def lower(f, *shapes, platform: str = "cuda"):
    return jax.jit(f).trace(*shapes).lower(lowering_platforms=(platform,))


X = jax.ShapeDtypeStruct((1000,), jnp.float32)


def test_the_builder_keeps_the_ptx_of_every_cuda_variant_and_the_catalog_its_digests(lib) -> None:
    cuda = [v for v in lib.variants if v.target.backend == "cuda"]
    assert cuda and all(v.ptx is not None and v.ptx.path.endswith(".ptx.xz") for v in cuda)
    assert all(v.ptx is None for v in lib.variants if v.target.backend == "hip")
    v = cuda[0]
    data = (lib._folder[v.key] / v.ptx.path).read_bytes()
    assert hashlib.sha256(data).hexdigest() == v.ptx.sha256
    assert f".entry {v.symbol}(" in lzma.decompress(data).decode()


def test_a_jitted_add_lowers_to_one_triton_custom_call_carrying_the_variants_ptx_and_grid(lib) -> None:
    add = aj.kernel("add", dtype="fp32", library=lib, arch="sm90")
    low = lower(lambda x, y: add(x, y, aj.Out(x.shape, x.dtype), x.size), X, X)
    hlo = low.as_text()
    assert hlo.count("stablehlo.custom_call @triton_kernel_call_ffi(%arg0, %arg1)") == 1
    assert "-> tensor<1000xf32>" in hlo
    call = kernel_call_of(low)
    v = add.handle.library.kernel("add", dtype="fp32").candidates[0]
    v = next(x for x in add.handle.candidates if x.target.arch == "sm90")
    assert call["name"] == v.symbol
    assert call["binary"].decode() == lzma.decompress((lib._folder[v.key] / v.ptx.path).read_bytes()).decode()
    assert call["ints"][2] == v.num_warps and call["ints"][6] == 90  # num_warps, compute capability
    block = v.config.constexprs["BLOCK"]
    assert call["grid"][0] == -(-1000 // block)
    # x, y, out: three buffers with the catalog's divisibility, then n as a scalar (no hidden args).
    assert len(call["params"]) == len(v.args) == 4
    assert [p[0][0] for p in call["params"][:3]] == [1, 1, 1]  # array parameters
    assert call["params"][3] == [(5, 0, 1000)]  # TritonKernelCall.Parameter.i32
    assert all(p == [(1, 2, b"\x10\x10")] for p in call["params"][:3])  # array, ptr_divisibility 16


def test_global_scratch_is_one_more_xla_result_so_command_buffers_can_capture_the_call(lib, monkeypatch) -> None:
    # jaxlib would cuMemAllocAsync a kernel's global scratch around each launch, which XLA's
    # command buffers (CUDA graphs) cannot capture; the lowering hands it an XLA buffer instead.
    import dataclasses

    from aotriton_rt.jax import kernels

    add = aj.kernel("add", dtype="fp32", library=lib, arch="sm90")
    f = lambda x, y: add(x, y, aj.Out(x.shape, x.dtype), x.size)  # noqa: E731
    plain = kernel_call_of(lower(f, X, X))
    real = kernels.variant_for
    monkeypatch.setattr(kernels, "variant_for", lambda call, platform: dataclasses.replace(
        real(call, platform), scratch={"global_size": 384, "global_align": 128}))
    low = lower(lambda x, y: add(x, y, aj.Out(x.shape, x.dtype), x.size), X, X)  # a new function: no cached lowering
    call = kernel_call_of(low)
    programs = call["grid"][0]
    hlo = low.as_text()
    assert f"-> (tensor<1000xf32>, tensor<{programs * 384}xui8>)" in hlo, hlo
    assert [o.shape for o in jax.tree.leaves(low.out_info)] == [(1000,)]  # the caller never sees the scratch
    # x, y, out, n, then the scratch: an array parameter aligned as the kernel asks ...
    assert len(call["params"]) == 5 and call["params"][4] == [(1, 2, b"\x10\x80\x01")]
    # ... and the kernel itself declares no scratch, so jaxlib allocates none.
    assert call["ints"] == plain["ints"] and call["params"][:4] == plain["params"]
    # An output before an input is an aliased operand whose result no parameter consumes: the
    # scratch goes before it, right after what the parameters take (operands, fresh results).
    softmax = aj.kernel("softmax", dtype="fp32", BLOCK=256, library=lib, arch="sm90")
    x = jax.ShapeDtypeStruct((4, 100), jnp.float32)
    low = lower(lambda a: softmax(aj.Out(a.shape, a.dtype), a, 4, 100, 100, 100), x)
    hlo = low.as_text()
    assert "-> (tensor<1536xui8>, tensor<4x100xf32>)" in hlo, hlo  # 4 programs x 384 bytes
    assert "output_operand_alias<output_tuple_indices = [1], operand_index = 0" in hlo, hlo
    assert [o.shape for o in jax.tree.leaves(low.out_info)] == [(4, 100)]


def test_an_output_before_an_input_is_a_zeroed_operand_aliased_to_its_result(lib) -> None:
    softmax = aj.kernel("softmax", dtype="fp32", BLOCK=256, library=lib, arch="sm90")
    x = jax.ShapeDtypeStruct((4, 100), jnp.float32)
    low = lower(lambda a: softmax(aj.Out(a.shape, a.dtype), a, 4, 100, 100, 100), x)
    hlo = low.as_text()
    # out (a zero-filled operand) is aliased to the call's only result; in_ptr follows it.
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], operand_index = 0" \
        in hlo, hlo
    assert "stablehlo.broadcast_in_dim" in hlo or "stablehlo.constant" in hlo
    assert kernel_call_of(low)["grid"][0] == 4


def test_the_rocm_lowering_passes_an_hsaco_file_matching_its_own_metadata(lib, tmp_path, monkeypatch) -> None:
    from builder.abi import read_hsaco

    monkeypatch.setenv("AOTRITON_RT_JAX_HSACO_DIR", str(tmp_path))
    for arch in ("gfx942", "gfx1100"):
        add = aj.kernel("add", dtype="fp32", library=lib, arch=arch)
        call = kernel_call_of(lower(lambda x, y, add=add: add(x, y, aj.Out(x.shape, x.dtype), x.size), X, X,
                                    platform="rocm"))
        path = Path(call["binary"].decode())
        assert path.parent == tmp_path
        v = next(x for x in add.handle.candidates if x.target.arch == arch)
        hsaco = path.read_bytes()
        assert hashlib.sha256(hsaco).hexdigest() == v.image.raw_sha256
        abi = read_hsaco(hsaco, v.symbol)
        # jaxlib launches num_warps * 64 threads on ROCm: the count passed must give the HSACO's block.
        assert call["ints"][2] * 64 == abi.extra["threads"] == v.num_threads
        # Parameters in kernel order: pointers as buffers, scalars by value; jaxlib appends the
        # two hidden scratch pointers, which the HSACO lists after them.
        kinds = ["pointer" if p[0][0] == 1 else "value" for p in call["params"]]
        assert kinds + ["pointer", "pointer"] == list(abi.extra["kinds"])
        assert call["ints"].get(6, 0) == 0  # no compute capability on ROCm


def test_kernel_calls_refuse_bad_input_while_tracing(lib) -> None:
    add = aj.kernel("add", dtype="fp32", library=lib, arch="sm90")
    h = jax.ShapeDtypeStruct((1000,), jnp.float16)
    with pytest.raises(ArgumentError, match="argument x_ptr must be a float32 array"):
        jax.jit(lambda x, y: add(x, y, aj.Out(x.shape, jnp.float32), 1000)).trace(h, X)
    with pytest.raises(ArgumentError, match=r"argument n \(i\d+\) = 18446744073709551616 is out of range"):
        jax.jit(lambda x, y: add(x, y, aj.Out(x.shape, x.dtype), 2**64)).trace(X, X)
    with pytest.raises(ArgumentError, match="must be a Python number under jax.jit"):
        jax.jit(lambda x, y, n: add(x, y, aj.Out(x.shape, x.dtype), n)).trace(X, X, 5)
    with pytest.raises(ArgumentError, match="takes 4 arguments"):
        jax.jit(lambda x, y: add(x, y, 5)).trace(X, X)


def test_lowering_for_the_cpu_or_without_ptx_says_what_is_missing(lib, tmp_path) -> None:
    add = aj.kernel("add", dtype="fp32", library=lib, arch="sm90")
    with pytest.raises(UnsupportedError, match=r"run on GPUs \(cuda, rocm\), not on 'cpu'"):
        lower(lambda x, y: add(x, y, aj.Out(x.shape, x.dtype), x.size), X, X, platform="cpu")
    # A catalog from before this builder (no PTX): the CUDA lowering names the rebuild.
    cat = _inline(lib.found.folders[0])
    for v in cat["variants"]:
        v.pop("ptx", None)
    (tmp_path / "catalog.json").write_text(json.dumps(cat))
    old = aotriton_rt.Library(tmp_path)
    add = aj.kernel("add", dtype="fp32", library=old, arch="sm90")
    with pytest.raises(ImageError, match="has no PTX in its catalog; jax.jit needs it"):
        lower(lambda x, y: add(x, y, aj.Out(x.shape, x.dtype), x.size), X, X)


def test_the_catalog_refuses_a_ptx_entry_on_a_hip_variant_or_of_another_format(lib) -> None:
    from aotriton_rt.catalog import Catalog
    from aotriton_rt.errors import CatalogError

    cat = _inline(lib.found.folders[0])
    cuda = next(v for v in cat["variants"] if v["target"]["backend"] == "cuda")
    hip = next(v for v in cat["variants"] if v["target"]["backend"] == "hip")
    hip["ptx"] = dict(cuda["ptx"])
    with pytest.raises(CatalogError, match="ptx is only for cuda variants"):
        Catalog.from_json(cat)
    del hip["ptx"]
    cuda["ptx"]["format"] = "cubin"
    with pytest.raises(CatalogError, match=r"ptx.format must be ptx"):
        Catalog.from_json(cat)


def test_vmap_of_a_kernel_call_runs_it_once_per_element(lib) -> None:
    add = aj.kernel("add", dtype="fp32", library=lib, arch="sm90")
    xs = jax.ShapeDtypeStruct((3, 1000), jnp.float32)
    f = jax.vmap(lambda x, y: add(x, y, aj.Out(x.shape, x.dtype), x.size))
    hlo = lower(f, xs, xs).as_text()
    assert hlo.count("triton_kernel_call_ffi") == 1 and "stablehlo.while" in hlo  # one launch per element
    assert "-> (tensor<3x1000xf32>" in hlo or "-> tensor<3x1000xf32>" in hlo


# -- attention ---------------------------------------------------------------------------------

QKV = jax.ShapeDtypeStruct((2, 4, 128, 64), jnp.bfloat16)


def test_attention_refuses_bad_input_at_trace_time_with_the_eager_errors(lib) -> None:
    f = lambda q, k, v: aj.attention(q, k, v, library=lib, arch="sm90")  # noqa: E731
    wrong = jax.ShapeDtypeStruct((2, 4, 128, 64), jnp.float16)
    with pytest.raises(ArgumentError, match="k has dtype fp16 but q has bf16"):
        jax.jit(f).trace(QKV, wrong, QKV)
    with pytest.raises(ArgumentError, match="must be 4-D"):
        jax.jit(f).trace(jax.ShapeDtypeStruct((4, 128, 64), jnp.bfloat16), QKV, QKV)
    big = jax.ShapeDtypeStruct((2, 4, 128, 600), jnp.bfloat16)
    with pytest.raises(UnsupportedError, match="exceeds the largest supported head dim 512"):
        jax.jit(f).trace(big, big, big)
    with pytest.raises(UnsupportedError, match="q has dtype i8; attention supports fp16, bf16, fp32"):
        jax.jit(f).trace(*[jax.ShapeDtypeStruct((2, 4, 128, 64), jnp.int8)] * 3)
    with pytest.raises(ArgumentError, match="needs max_seqlen_q and max_seqlen_k"):
        cu = jax.ShapeDtypeStruct((3,), jnp.int32)
        packed = jax.ShapeDtypeStruct((256, 4, 64), jnp.bfloat16)
        jax.jit(lambda q, k, v, c: aj.attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, library=lib)).trace(
            packed, packed, packed, cu)


def test_attention_names_the_kernel_its_images_lack(lib) -> None:
    from aotriton_rt import KernelNotFound

    with pytest.raises(KernelNotFound, match="attention .* needs attn_fwd"):
        jax.jit(lambda q, k, v: aj.attention(q, k, v, library=lib, arch="sm90")).trace(QKV, QKV, QKV)


BUILD_ATTENTION = r"""
import sys
from pathlib import Path
from builder import registry
from builder.build import build
from builder.targets import parse_targets

if __name__ == "__main__":
    base = {"dtype": "bf16", "HEAD_DIM": 64, "HEAD_DIM_V": 64}
    mask = {"CAUSAL": 1, "DROPOUT": 0, "VARLEN": 0}  # mode 1, as the default set: aligned at run time
    fwd = {**base, **mask, "BIAS": 0, "SOFTCAP": 0, "ALIBI": 0}
    want = {("attn_fwd", "sm90"): fwd, ("attn_fwd", "gfx942"): fwd,
            ("attn_bwd_preprocess", "sm90"): {**base, "VARLEN": 0, "DQ_ATOMIC": 0},
            ("attn_bwd_dkdv", "sm90"): {**base, **mask, "BIAS": 0, "DQ_ATOMIC": 0, "SOFTCAP": 0, "ALIBI": 0},
            ("attn_bwd_dq", "sm90"): {**base, **mask, "BIAS": 0, "SOFTCAP": 0, "ALIBI": 0},
            # The atomic scheme's three (preprocess zeroing DQacc, dK/dV adding dQ, the cast).
            ("attn_bwd_preprocess", "sm90", 1): {**base, "VARLEN": 0, "DQ_ATOMIC": 1},
            ("attn_bwd_dkdv", "sm90", 1): {**base, **mask, "BIAS": 0, "DQ_ATOMIC": 1, "SOFTCAP": 0, "ALIBI": 0},
            ("attn_bwd_dq_convert", "sm90"): {"dtype": "bf16", "HEAD_DIM": 64, "VARLEN": 0}}
    kernels = registry.load_kernels()
    jobs = [j for (name, arch, *_), spec in want.items()
            for j in registry.expand(kernels[name], parse_targets(arch), "full", "3.6.0")
            if dict(j.spec) == spec and j.config_index == 0]
    assert len(jobs) == len(want), [j.label for j in jobs]
    build(jobs, Path(sys.argv[1]), workers=2, timeout=900, keep_going=False, triton_version="3.6.0", quiet=True)
"""


@pytest.fixture(scope="module")
def attn_lib(tmp_path_factory) -> aotriton_rt.Library:
    """Real attention images: bf16 D=64 causal (mask mode 1, which a bottom-right call runs with
    causal_align 1) forward and both backward schemes (sm90), forward (gfx942)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("attention")
    subprocess.run([sys.executable, "-c", BUILD_ATTENTION, str(out)], cwd=Path(__file__).resolve().parents[2],
                   check=True)
    return aotriton_rt.Library(out)


QA = jax.ShapeDtypeStruct((2, 4, 200, 64), jnp.bfloat16)
KA = jax.ShapeDtypeStruct((2, 2, 333, 64), jnp.bfloat16)


def _loss(lib, arch="sm90"):
    def loss(q, k, v):
        out = aj.attention(q, k, v, causal=True, align="bottom_right", library=lib, arch=arch)
        return out.astype(jnp.float32).sum()
    return loss


def _scalars(call: dict, variant) -> dict:
    """Kernel scalar values by name, decoded from the call's parameters (i32/i64/u64/fp32)."""
    import struct

    out = {}
    for a, p in zip(variant.args, call["params"]):
        num, wire, value = p[0]
        if a.is_pointer:
            out[a.name] = "null" if num != 1 else "buffer"
        elif wire == 5:
            out[a.name] = struct.unpack("<f", value)[0]
        else:  # varint: protobuf encodes negative int32/int64 as 64-bit two's complement
            out[a.name] = value - 2**64 if a.type in ("i32", "i64") and value >= 2**63 else value
    return out


def test_grad_of_attention_under_jit_lowers_to_the_forward_and_the_split_backward(attn_lib) -> None:
    low = lower(jax.grad(_loss(attn_lib), argnums=(0, 1, 2)), QA, KA, KA)
    hlo = low.as_text()
    calls = calls_of(low)  # attn_fwd, then preprocess, dkdv, dq
    assert [c["name"] for c in calls] == ["attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    fwd = next(v for v in attn_lib.variants if v.kernel == "attn_fwd" and v.target.arch == "sm90")
    s = _scalars(calls[0], fwd)
    assert s["Q"] == s["K"] == s["V"] == s["Out"] == s["LSE"] == "buffer"
    assert s["Bias"] == s["DropMask"] == s["cu_seqlens_q"] == "null"
    assert (s["batch"], s["num_heads_q"], s["num_heads_k"], s["seqlen_q"], s["seqlen_k"]) == (2, 4, 2, 200, 333)
    assert (s["window_left"], s["window_right"]) == (-1, 0) and s["sm_scale"] == pytest.approx(0.125)
    # Mask mode 1 aligned bottom-right by its run-time argument, in the forward and both backward kernels.
    assert fwd.spec["CAUSAL"] == 1 and s["causal_align"] == 1
    for call, name in zip(calls[2:], ("attn_bwd_dkdv", "attn_bwd_dq")):
        variant = next(v for v in attn_lib.variants if v.kernel == name)
        assert _scalars(call, variant)["causal_align"] == 1, name
    # Contiguous (B, H, S, D) strides as the eager path computes them for contiguous arrays.
    assert (s["stride_qz"], s["stride_qh"], s["stride_qm"]) == (4 * 200 * 64, 200 * 64, 64)
    assert (s["stride_kz"], s["stride_kh"], s["stride_kn"]) == (2 * 333 * 64, 333 * 64, 64)
    assert (s["stride_lz"], s["stride_lh"]) == (4 * 200, 200)
    block_m = fwd.config.constexprs["BLOCK_M"]
    from aotriton_rt.arguments import Packer

    assert calls[0]["grid"] == list(Packer(fwd).grid_for([s[a.name] if not a.is_pointer else 0 for a in fwd.args]))
    assert calls[0]["grid"][0] >= -(-200 // block_m) // 2 and calls[0]["grid"][1] == 2 * 4
    assert "tensor<2x4x200xf32>" in hlo  # lse declared fp32 (B, H, Sq)


ATOMIC = ["attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq_convert"]


@pytest.mark.parametrize(("flags", "determinism"), [
    ("", False), ("--xla_gpu_deterministic_ops=true", True), ("--xla_gpu_exclude_nondeterministic_ops", True),
    ("--xla_gpu_autotune_level=0 --xla_gpu_exclude_nondeterministic_ops=1", True),
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_deterministic_ops=false", False), ("--xla_gpu_deterministic_ops_extra=true", False)])
def test_xlas_determinism_flags_make_the_backward_reproducible(attn_lib, monkeypatch, flags: str,
                                                               determinism: bool) -> None:
    """XLA_FLAGS asking XLA for reproducible ops (the last mention of a flag wins) count as
    deterministic=True: the backward keeps the split scheme (the tuning rules' atomic one is never
    asked), and an explicit scheme="atomic" is refused while tracing, naming the flags; without them
    it lowers to the atomic kernels."""
    from aotriton_rt.errors import UnsupportedError
    from aotriton_rt.jax.attention import xla_asks_determinism

    monkeypatch.setenv("XLA_FLAGS", flags)
    assert xla_asks_determinism() is determinism

    def loss(q, k, v):  # a new function each time: no trace is reused across flag settings
        out = aj.attention(q, k, v, causal=True, align="bottom_right", scheme="atomic", library=attn_lib,
                           arch="sm90")
        return out.astype(jnp.float32).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    if determinism:
        with pytest.raises(UnsupportedError, match=r"not deterministic, but reproducible results were asked for "
                                                   r"\(.*XLA's --xla_gpu_deterministic_ops"):
            lower(grad, QA, KA, KA)
    else:
        assert [c["name"] for c in calls_of(lower(grad, QA, KA, KA))] == ATOMIC


def test_vmap_of_attention_folds_the_mapped_axis_into_the_batch(attn_lib) -> None:
    v = jax.ShapeDtypeStruct((3,) + QA.shape, QA.dtype)
    vk = jax.ShapeDtypeStruct((3,) + KA.shape, KA.dtype)
    low = lower(jax.vmap(jax.grad(_loss(attn_lib), argnums=(0, 1, 2))), v, vk, vk)
    hlo = low.as_text()
    assert hlo.count("triton_kernel_call_ffi") == 4 and "stablehlo.while" not in hlo
    call = calls_of(low)[0]
    fwd = next(x for x in attn_lib.variants if x.kernel == "attn_fwd" and x.target.arch == "sm90")
    assert _scalars(call, fwd)["batch"] == 6


def test_the_rocm_attention_forward_matches_its_hsaco_metadata(attn_lib, tmp_path, monkeypatch) -> None:
    from builder.abi import read_hsaco

    monkeypatch.setenv("AOTRITON_RT_JAX_HSACO_DIR", str(tmp_path))
    f = lambda q, k, v: aj.attention_forward(q, k, v, causal=True, align="bottom_right", library=attn_lib,  # noqa: E731
                                             arch="gfx942")
    call = kernel_call_of(lower(f, QA, KA, KA, platform="rocm"))
    v = next(x for x in attn_lib.variants if x.kernel == "attn_fwd" and x.target.arch == "gfx942")
    abi = read_hsaco(Path(call["binary"].decode()).read_bytes(), v.symbol)
    kinds = ["pointer" if p[0][0] == 1 or a.is_pointer else "value" for a, p in zip(v.args, call["params"])]
    assert kinds + ["pointer", "pointer"] == list(abi.extra["kinds"])
    assert call["ints"][2] * 64 == abi.extra["threads"]
    assert [size for _, size in abi.params[:len(v.args)]] == [a.size for a in v.args]


def test_an_updated_array_is_an_operand_aliased_to_the_returned_result(lib) -> None:
    add = aj.kernel("add", dtype="fp32", library=lib, arch="sm90")
    low = lower(lambda x, y, z: add(x, y, aj.Update(z), x.size), X, X, X)
    hlo = low.as_text()
    assert "triton_kernel_call_ffi(%arg0, %arg1, %arg2)" in hlo
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], operand_index = 2" \
        in hlo
    assert len(kernel_call_of(low)["params"]) == 4


def test_a_variant_check_fails_when_lowering_with_the_eager_message(lib) -> None:
    softmax = aj.kernel("softmax", dtype="fp32", BLOCK=256, library=lib, arch="sm90")
    x = jax.ShapeDtypeStruct((4, 300), jnp.float32)
    with pytest.raises(ArgumentError, match=r"softmax: n_cols=300 violates `n_cols <= BLOCK`"):
        lower(lambda a: softmax(aj.Out(a.shape, a.dtype), a, 4, 300, 300, 300), x)


def test_a_jaxlib_without_the_gpu_plugin_is_named_when_lowering(lib, monkeypatch) -> None:
    import types

    import jax._src.lib as jaxlib_bridge

    monkeypatch.setattr(jaxlib_bridge, "gpu_triton", types.SimpleNamespace(), raising=False)
    add = aj.kernel("add", dtype="fp32", library=lib, arch="sm90")
    with pytest.raises(UnsupportedError, match="neither jax-cuda13-plugin / jax-cuda12-plugin nor jax-rocm7-plugin"):
        lower(lambda x, y: add(x, y, aj.Out(x.shape, x.dtype), x.size), X, X)


def test_equal_calls_share_one_compilation_outside_jit(lib) -> None:
    from aotriton_rt.jax import kernels

    add = aj.kernel("add", dtype="fp32", library=lib, arch="sm90")
    x = jnp.zeros((8,), jnp.float32)
    calls = []
    original = kernel_p_bind = kernels.kernel_p.bind

    def spy(*args, **params):
        calls.append(params["call"])
        return original(*args, **params)

    kernels.kernel_p.bind = spy
    try:
        for _ in range(2):
            with pytest.raises(UnsupportedError, match="not on 'cpu'"):
                add(x, x, aj.Out(x.shape, x.dtype), 8)
    finally:
        kernels.kernel_p.bind = kernel_p_bind
    assert calls[0] == calls[1] and hash(calls[0]) == hash(calls[1])


def test_a_scalar_the_variant_assumes_divisible_is_refused_while_tracing(attn_lib) -> None:
    fwd = aj.kernel("attn_fwd", dtype="bf16", HEAD_DIM=64, HEAD_DIM_V=64, CAUSAL=1, BIAS=0, DROPOUT=0, VARLEN=0,
                    library=attn_lib, arch="sm90")
    args = {a.name: 0 for a in fwd.args}
    args.update(Q=jnp.zeros((1, 1, 8, 64), jnp.bfloat16), stride_qm=24)

    with pytest.raises(ArgumentError, match="argument stride_qm = 24 is not a multiple of 16, which this kernel"):
        fwd(*[args[n] if not a.is_pointer or n == "Q" else None for a, n in zip(fwd.args, fwd.arg_names)])


@pytest.fixture(scope="module")
def feature_lib(attn_lib, tmp_path_factory) -> aotriton_rt.Library:
    """attn_lib's sm90 variants cloned under every mask/bias/dropout/varlen/head-dim spec.

    The clones keep the real binaries and argument lists (the attention kernels take the same
    arguments whatever their constexprs): enough to trace and lower every feature's glue, never
    to run it.
    """
    import copy
    import itertools

    folder = tmp_path_factory.mktemp("features")
    shutil_copy = __import__("shutil").copytree
    shutil_copy(attn_lib.found.folders[0], folder, dirs_exist_ok=True)
    cat = _inline(folder)
    axes = {"attn_fwd": {"CAUSAL": (0, 1, 2), "BIAS": (0, 1), "DROPOUT": (0, 1, 2), "VARLEN": (0, 1),
                         "SOFTCAP": (0, 1), "ALIBI": (0, 1)},
            "attn_bwd_preprocess": {"VARLEN": (0, 1), "DQ_ATOMIC": (0,)},
            "attn_bwd_dkdv": {"CAUSAL": (0, 1, 2), "BIAS": (0, 1, 2), "DROPOUT": (0, 1), "VARLEN": (0, 1),
                              "DQ_ATOMIC": (0,), "SOFTCAP": (0, 1), "ALIBI": (0, 1)},
            "attn_bwd_dq": {"CAUSAL": (0, 1, 2), "BIAS": (0, 1), "DROPOUT": (0, 1), "VARLEN": (0, 1),
                            "SOFTCAP": (0, 1), "ALIBI": (0, 1)}}
    variants = []
    for v in cat["variants"]:
        if v["target"]["arch"] != "sm90" or v["kernel"] not in axes or v["spec"].get("DQ_ATOMIC"):
            continue  # the split scheme's kernels only
        names = list(axes[v["kernel"]])
        for d, values in itertools.product((64, 80), itertools.product(*axes[v["kernel"]].values())):
            spec = dict(zip(names, values))
            if spec.get("ALIBI") and (spec["BIAS"] or spec["SOFTCAP"]):
                continue  # not compiled (builder/kernels/attention.py, fwd_excluded)
            clone = copy.deepcopy(v)
            clone["spec"].update(dict(zip(names, values)), HEAD_DIM=d, HEAD_DIM_V=d)
            clone["key"] = hashlib.sha256(json.dumps(clone, sort_keys=True).encode()).hexdigest()
            variants.append(clone)
    cat["variants"] = variants
    (folder / "catalog.json").write_text(json.dumps(cat))
    return aotriton_rt.Library(folder)


def _inline(folder) -> dict:
    """The folder's catalog in the inline form (every variant in full), which catalog.json may hold too."""
    from aotriton_rt.catalog import Catalog

    return Catalog.load(folder / "catalog.json").to_json()


def _lowers(f, *shapes) -> list[dict]:
    return calls_of(lower(f, *shapes))


def test_every_attention_feature_traces_and_lowers_forward_and_backward(feature_lib) -> None:
    lib = feature_lib
    q = jax.ShapeDtypeStruct((2, 4, 100, 72), jnp.bfloat16)  # head dim 72: padded to the 80 bucket
    k = jax.ShapeDtypeStruct((2, 2, 129, 72), jnp.bfloat16)  # GQA 4/2; 129 keys: bias rows padded to 136
    bias = jax.ShapeDtypeStruct((1, 4, 1, 129), jnp.bfloat16)

    def grads(**opts):
        def loss(q, k, v, b):
            return aj.attention(q, k, v, bias=b, library=lib, arch="sm90", **opts).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2, 3))

    calls = _lowers(grads(causal=True, window=(16, 0), align="top_left"), q, k, k, bias)
    assert [c["name"] for c in calls] == ["attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    fwd = next(v for v in lib.variants if v.kernel == "attn_fwd")
    s = _scalars(calls[0], fwd)
    assert s["Bias"] == "buffer" and (s["stride_bz"], s["stride_bh"], s["stride_bm"]) == (0, 136, 0)
    assert (s["window_left"], s["window_right"], s["stride_qm"], s["causal_align"]) == (16, 0, 80, 0)
    dkdv = next(v for v in lib.variants if v.kernel == "attn_bwd_dkdv")
    assert _scalars(calls[2], dkdv)["DBias"] == "buffer"
    # The bias's gradient comes back in its own shape; dq/dk/dv in theirs (sliced from the bucket).
    out = jax.eval_shape(grads(causal=True), q, k, k, bias)
    assert [tuple(g.shape) for g in out] == [q.shape, k.shape, k.shape, bias.shape]
    # Dropout: the same (seed, offset) in the forward and the backward.
    calls = _lowers(grads(dropout_p=0.25, seed=7, offset=3), q, k, k, bias)
    for c, name in zip(calls, ("attn_fwd", "attn_bwd_dkdv")):
        v = next(x for x in lib.variants if x.kernel == name)
        sc = _scalars(c if name == "attn_fwd" else calls[2], v)
        assert (sc["philox_seed"], sc["philox_offset"]) == (7, 3) and sc["dropout_p"] == pytest.approx(0.25)


def test_softcap_lowers_to_the_softcap_variants_with_the_cap_baked_in(feature_lib) -> None:
    lib = feature_lib
    q = jax.ShapeDtypeStruct((2, 4, 100, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 2, 129, 64), jnp.bfloat16)

    def loss(q, k, v):
        return aj.attention(q, k, v, causal=True, softcap=30.0, library=lib, arch="sm90").astype(jnp.float32).sum()

    calls = _lowers(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
    assert [c["name"] for c in calls] == ["attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    for call, name in zip((calls[0], calls[2], calls[3]), ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")):
        variant = next(v for v in lib.variants if v.kernel == name)
        assert _scalars(call, variant)["softcap"] == pytest.approx(30.0), name
    # Without a cap the same call passes 0 (the SOFTCAP=0 variants never read it).
    plain = _lowers(lambda q, k, v: aj.attention_forward(q, k, v, causal=True, library=lib, arch="sm90"), q, k, k)
    fwd = next(v for v in lib.variants if v.kernel == "attn_fwd")
    assert _scalars(plain[0], fwd)["softcap"] == 0.0
    with pytest.raises(aotriton_rt.ArgumentError, match="softcap"):
        jax.eval_shape(lambda q, k, v: aj.attention(q, k, v, softcap=-1.0, library=lib, arch="sm90"), q, k, k)


def test_alibi_lowers_with_the_slopes_as_an_operand_under_grad_and_vmap(feature_lib) -> None:
    lib = feature_lib
    q = jax.ShapeDtypeStruct((2, 4, 100, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 2, 129, 64), jnp.bfloat16)
    variant = {n: next(v for v in lib.variants if v.kernel == n) for n in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")}

    def loss(q, k, v, slopes):
        out = aj.attention(q, k, v, causal=True, align="bottom_right", alibi_slopes=slopes, library=lib, arch="sm90")
        return out.astype(jnp.float32).sum()

    # Shared by the batch (batch stride 0) or per sequence (stride Hq): a buffer every kernel reads.
    for shape, stride in (((4,), 0), ((2, 4), 4)):
        slopes = jax.ShapeDtypeStruct(shape, jnp.float32)
        calls = _lowers(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, k, slopes)
        assert [c["name"] for c in calls] == ["attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
        for call in (calls[0], calls[2], calls[3]):
            sc = _scalars(call, variant[call["name"]])
            assert (sc["alibi_slopes"], sc["stride_az"], sc["causal_align"]) == ("buffer", stride, 1), call["name"]
        # The slopes are a constant: their gradient is zero, shaped like them.
        grads = jax.eval_shape(jax.grad(loss, argnums=3), q, k, k, slopes)
        assert grads.shape == shape and grads.dtype == jnp.float32
    # Without slopes the same call passes a null pointer (the ALIBI=0 variants never read it).
    plain = _lowers(lambda q, k, v: aj.attention_forward(q, k, v, causal=True, library=lib, arch="sm90"), q, k, k)
    assert (_scalars(plain[0], variant["attn_fwd"])["alibi_slopes"], _scalars(plain[0], variant["attn_fwd"])[
        "stride_az"]) == ("null", 0)
    # vmap over shared slopes: one launch for the folded batch, the slopes per (element, sequence).
    mapped = jax.ShapeDtypeStruct((3, 4), jnp.float32)
    f = jax.vmap(lambda q, k, v, s: aj.attention(q, k, v, alibi_slopes=s, library=lib, arch="sm90"))
    (call,) = _lowers(f, *(jax.ShapeDtypeStruct((3, *x.shape), x.dtype) for x in (q, k, k)), mapped)
    sc = _scalars(call, variant["attn_fwd"])
    assert (sc["batch"], sc["alibi_slopes"], sc["stride_az"]) == (6, "buffer", 4)
    with pytest.raises(aotriton_rt.ArgumentError, match=r"alibi_slopes must be float32, got bf16"):
        jax.eval_shape(lambda q, k, v, s: aj.attention(q, k, v, alibi_slopes=s, library=lib, arch="sm90"), q, k, k,
                       jax.ShapeDtypeStruct((4,), jnp.bfloat16))


def test_the_dropout_mask_the_layouts_and_varlen_lower(feature_lib) -> None:
    lib = feature_lib
    q = jax.ShapeDtypeStruct((2, 100, 4, 64), jnp.bfloat16)  # bshd
    f = lambda q, k, v: aj.attention_forward(q, k, v, layout="bshd", dropout_p=0.1, seed=1, return_mask=True,  # noqa: E731
                                             library=lib, arch="sm90")
    out, lse, mask = jax.eval_shape(f, q, q, q)
    assert (out.shape, lse.shape, mask.shape, mask.dtype) == ((2, 100, 4, 64), (2, 4, 100), (2, 4, 100, 100),
                                                              jnp.int8)
    (call,) = _lowers(f, q, q, q)
    s = _scalars(call, next(v for v in lib.variants if v.kernel == "attn_fwd"))
    assert (s["stride_qz"], s["stride_qh"], s["stride_qm"]) == (100 * 4 * 64, 64, 4 * 64)
    assert s["DropMask"] == "buffer" and call["params"][6][0][2][:1] == b"\x08"  # zeroed: bytes_to_zero set
    # Varlen: packed (total, heads, dim) and int32 prefix sums; lengths static.
    packed = jax.ShapeDtypeStruct((300, 4, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)

    def loss(q, k, v, cu):
        out = aj.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200,
                           causal=True, library=lib, arch="sm90")
        return out.astype(jnp.float32).sum()

    calls = _lowers(jax.grad(loss, argnums=(0, 1, 2)), packed, packed, packed, cu)
    s = _scalars(calls[0], next(v for v in lib.variants if v.kernel == "attn_fwd"))
    assert (s["batch"], s["seqlen_q"], s["cu_seqlens_q"], s["stride_qz"], s["stride_lz"]) == (2, 200, "buffer", 0, 0)
    assert len(calls) == 4


def test_a_call_with_no_programs_launches_nothing_and_returns_zeros(lib, feature_lib) -> None:
    add = aj.kernel("add", dtype="fp32", library=lib, arch="sm90")
    empty = jax.ShapeDtypeStruct((0,), jnp.float32)
    hlo = lower(lambda x, y: add(x, y, aj.Out(x.shape, x.dtype), x.size), empty, empty).as_text()
    assert "custom_call" not in hlo and "tensor<0xf32>" in hlo
    hlo = lower(lambda q: aj.attention(q, q, q, library=feature_lib, arch="sm90"),
                jax.ShapeDtypeStruct((0, 4, 16, 64), jnp.bfloat16)).as_text()
    assert "custom_call" not in hlo



def _ancestry(values: list) -> tuple[set[str], set[int], set]:
    """What the values are computed from: the op names on the way, the function arguments
    reached, and the custom calls (operations) reached, whose own operands are not followed."""
    from jax._src.lib.mlir import ir

    names, args, calls, seen = set(), set(), set(), set()
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, ir.BlockArgument) or getattr(ir.BlockArgument, "isinstance", lambda v: False)(value):
            args.add(ir.BlockArgument(value).arg_number)  # older bindings hand out plain Values
            continue
        op = value.owner
        if op in seen:
            continue
        seen.add(op)
        names.add(op.name)
        if op.name == "stablehlo.custom_call":
            calls.add(op)
            continue
        stack.extend(op.operands)
    return names, args, calls


def test_sinks_lower_to_the_same_kernels_with_the_rescale_between_forward_and_backward(feature_lib) -> None:
    lib = feature_lib
    q = jax.ShapeDtypeStruct((2, 4, 100, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 2, 129, 64), jnp.bfloat16)  # GQA 4/2
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32)

    def grads(with_sinks: bool):
        def loss(q, k, v, s):
            out = aj.attention(q, k, v, causal=True, window=(16, 0), sinks=s if with_sinks else None, library=lib,
                               arch="sm90")
            return out.astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2, 3) if with_sinks else (0, 1, 2))

    # The same four kernels with or without sinks: the sinks are jnp around them.
    low = lower(grads(True), q, k, k, sinks)
    assert [c["name"] for c in calls_of(low)] == ["attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    module = low.compiler_ir("stablehlo")  # held: the operations below live in it
    ops = [op.operation for op in _custom_calls(module.operation, [])]
    fwd, pre, dkdv = ops[0], ops[1], ops[2]
    # Without sinks the backward kernels read the forward kernel's (out, lse) as they are ...
    plain_module = lower(grads(False), q, k, k, sinks).compiler_ir("stablehlo")
    plain = [op.operation for op in _custom_calls(plain_module.operation, [])]
    assert any(x.owner == plain[0] for x in plain[1].operands)
    # ... with sinks, a rescaled pair: computed from the forward's results and the sinks (argument
    # 3) through exp and log, and the dK/dV kernel reads no forward result directly either.
    for op in (pre, dkdv):
        assert not any(x.owner == fwd for x in op.operands)
    names, args, calls = _ancestry(list(pre.operands))
    assert fwd in calls and 3 in args and {"stablehlo.exponential", "stablehlo.log"} <= names, (names, args)
    # dsinks: a reduction over the rows of what the forward and the sinks gave, beside the kernels.
    main = next(op for op in module.body.operations
                if op.operation.attributes["sym_name"].value == "main")
    ret = list(main.regions[0].blocks[0].operations)[-1]
    names, args, calls = _ancestry([ret.operands[3]])
    assert fwd in calls and 3 in args and {"stablehlo.reduce", "stablehlo.exponential"} <= names, (names, args)
    assert not calls & set(ops[1:])  # the sinks' gradient needs none of the backward kernels
    # Shapes and dtypes: the sinks' gradient comes back like the sinks (bf16 here).
    got = jax.eval_shape(grads(True), q, k, k, jax.ShapeDtypeStruct((4,), jnp.bfloat16))
    assert [(tuple(g.shape), g.dtype) for g in got] == [(q.shape, q.dtype), (k.shape, k.dtype), (k.shape, k.dtype),
                                                        ((4,), jnp.bfloat16)]
    with pytest.raises(ArgumentError, match=r"sinks must have shape \(4,\): one logit per query head, got \(2,\)"):
        jax.eval_shape(grads(True), q, k, k, jax.ShapeDtypeStruct((2,), jnp.float32))
    # Packed sequences: the sinks' rows are the lse's (Hq, total).
    packed = jax.ShapeDtypeStruct((300, 4, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)

    def packed_loss(q, k, v, s, cu):
        out = aj.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200,
                           causal=True, sinks=s, library=lib, arch="sm90")
        return out.astype(jnp.float32).sum()

    low = lower(jax.grad(packed_loss, argnums=(0, 1, 2, 3)), packed, packed, packed, sinks, cu)
    assert len(calls_of(low)) == 4 and tuple(jax.tree.leaves(low.out_info)[3].shape) == (4,)


def test_sinks_lower_for_rocm_and_under_vmap(attn_lib, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AOTRITON_RT_JAX_HSACO_DIR", str(tmp_path))
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32)
    f = lambda q, k, v, s: aj.attention_forward(q, k, v, causal=True, align="bottom_right", sinks=s,  # noqa: E731
                                                library=attn_lib, arch="gfx942")
    low = lower(f, QA, KA, KA, sinks, platform="rocm")
    assert kernel_call_of(low)["name"] == "attn_fwd"
    hlo = low.as_text()
    assert "stablehlo.log" in hlo and "stablehlo.exponential" in hlo
    assert [tuple(o.shape) for o in jax.tree.leaves(low.out_info)] == [QA.shape, (2, 4, 200)]
    # vmap with a sinks array per element: still one launch per kernel, the mapped axis folded into
    # the batch, the sinks' gradient one row per element.
    def loss(q, k, v, s):
        return aj.attention(q, k, v, causal=True, align="bottom_right", sinks=s, library=attn_lib,
                            arch="sm90").astype(jnp.float32).sum()

    mapped = [jax.ShapeDtypeStruct((3,) + x.shape, x.dtype) for x in (QA, KA, KA, sinks)]
    low = lower(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3))), *mapped)
    hlo = low.as_text()
    assert hlo.count("triton_kernel_call_ffi") == 4 and "stablehlo.while" not in hlo
    fwd = next(x for x in attn_lib.variants if x.kernel == "attn_fwd" and x.target.arch == "sm90")
    assert _scalars(calls_of(low)[0], fwd)["batch"] == 6
    assert tuple(jax.tree.leaves(low.out_info)[3].shape) == (3, 4)


# -- FP8 attention ------------------------------------------------------------------------------

BUILD_FP8 = """
import sys
from pathlib import Path
from builder import registry
from builder.build import build
from builder.targets import parse_targets

if __name__ == "__main__":
    spec = {"dtype": "fp8e4nv", "out_dtype": "fp16", "HEAD_DIM": 64, "HEAD_DIM_V": 64, "CAUSAL": 1, "VARLEN": 0}
    kernels = registry.load_kernels()
    jobs = [j for name in sys.argv[2:] for j in registry.expand(kernels[name], parse_targets("sm90"), "full", "3.6.0")
            if dict(j.spec) == spec and j.config_index == 0]
    assert len(jobs) == len(sys.argv[2:]), [j.label for j in jobs]
    build(jobs, Path(sys.argv[1]), workers=1, timeout=900, keep_going=False, triton_version="3.6.0", quiet=True)
"""


@pytest.fixture(scope="module")
def fp8_lib(tmp_path_factory) -> aotriton_rt.Library:
    """A real FP8 forward image: OCP e4m3, fp16 out, D=64, mask mode 1 (sm90)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("fp8")
    subprocess.run([sys.executable, "-c", BUILD_FP8, str(out), "attn_fwd_fp8"], cwd=Path(__file__).resolve().parents[2],
                   check=True)
    return aotriton_rt.Library(out)


@pytest.fixture(scope="module")
def fp8_gluon_lib(tmp_path_factory) -> aotriton_rt.Library:
    """Both FP8 forwards of the same spec as fp8_lib: the portable one and sm90's Gluon one (config
    #0, which reads V^T with each 32 keys in its register order)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("fp8_gluon")
    subprocess.run([sys.executable, "-c", BUILD_FP8, str(out), "attn_fwd_fp8", "attn_fwd_fp8_sm90"],
                   cwd=Path(__file__).resolve().parents[2], check=True)
    return aotriton_rt.Library(out)


def test_fp8_attention_on_the_gluon_forward_hands_it_v_transposed_in_its_key_order(
        fp8_gluon_lib, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon FP8 forward reads V^T with each 32 keys in its register order and the keys rounded
    up to 32: XLA's transpose of V is gathered into that order (the eager path's pre-pass writes it)."""
    from aotriton_rt.ops.attention.fp8 import key_permutation

    monkeypatch.setenv("AOTRITON_RT_FP8_SM90", "1")
    q8 = jax.ShapeDtypeStruct((2, 4, 200, 64), jnp.float8_e4m3fn)
    k8 = jax.ShapeDtypeStruct((2, 2, 333, 64), jnp.float8_e4m3fn)
    low = lower(lambda q, k, v: aj.attention(q, k, v, causal=True, out_dtype="fp16", library=fp8_gluon_lib,
                                             arch="sm90"), q8, k8, k8)
    call = kernel_call_of(low)
    assert call["name"] == "attn_fwd_fp8_sm90"
    variant = next(v for v in fp8_gluon_lib.variants if v.kernel == "attn_fwd_fp8_sm90")
    assert variant.config.constexprs["KEY_ORDER"] == 1
    s = _scalars(call, variant)
    assert s["stride_vd"] == 352 and s["seqlen_k"] == 333  # 333 keys rounded up to 32
    # The V^T it is handed, computed by XLA on the CPU (the kernel's launch replaced by a function
    # that returns its V argument): V^T's columns in key_permutation's order, zeros past the keys.
    import importlib

    import numpy as np

    jax_attention = importlib.import_module("aotriton_rt.jax.attention")  # the module (the package exports a function)
    monkeypatch.setattr(jax_attention, "_launch", lambda handle, o, values: (values["V"], None))
    v = jax.random.normal(jax.random.key(0), (2, 2, 333, 64)).astype(jnp.float8_e4m3fn)
    got = np.asarray(jax.jit(lambda q, k, v: aj.attention(q, k, v, causal=True, out_dtype="fp16",
                                                          library=fp8_gluon_lib, arch="sm90"))(v[:, :, :200], v, v)
                     .astype(jnp.float32))
    natural = np.zeros((2, 2, 64, 352), np.float32)
    natural[..., :333] = np.swapaxes(np.asarray(v.astype(jnp.float32)), -1, -2)
    assert got.shape == (2, 2, 64, 352)
    np.testing.assert_array_equal(got, natural[..., key_permutation(352)])


def test_fp8_attention_lowers_to_the_fp8_forward_with_its_descales_and_refuses_grad(fp8_lib) -> None:
    q8 = jax.ShapeDtypeStruct((2, 4, 200, 64), jnp.float8_e4m3fn)
    k8 = jax.ShapeDtypeStruct((2, 2, 333, 64), jnp.float8_e4m3fn)
    dsc = jax.ShapeDtypeStruct((2, 2), jnp.float32)

    def f(q, k, v, d):
        return aj.attention(q, k, v, causal=True, align="bottom_right", q_descale=d, k_descale=0.5, v_descale=2.0,
                            out_dtype="fp16", library=fp8_lib, arch="sm90")
    low = lower(f, q8, k8, k8, dsc)
    call = kernel_call_of(low)
    assert call["name"] == "attn_fwd_fp8"
    variant = next(v for v in fp8_lib.variants if v.kernel == "attn_fwd_fp8")
    s = _scalars(call, variant)
    assert s["q_descale"] == s["k_descale"] == s["v_descale"] == "buffer"
    assert (s["stride_qdz"], s["stride_qdh"], s["stride_kdz"], s["stride_kdh"]) == (2, 1, 0, 0)
    assert (s["num_heads_q"], s["num_heads_k"], s["seqlen_q"], s["seqlen_k"], s["causal_align"]) == (4, 2, 200, 333, 1)
    assert [(tuple(o.shape), o.dtype) for o in jax.tree.leaves(low.out_info)] == [((2, 4, 200, 64), jnp.float16)]
    with pytest.raises(UnsupportedError, match="FP8 attention is inference only"):
        lower(jax.grad(lambda q, k, v, d: f(q, k, v, d).astype(jnp.float32).sum()), q8, k8, k8, dsc)
    with pytest.raises(UnsupportedError, match="does not take softcap="):
        lower(lambda q, k, v: aj.attention(q, k, v, softcap=30.0, library=fp8_lib, arch="sm90"), q8, k8, k8)
    with pytest.raises(ArgumentError, match=r"q_descale must have shape \(2, 2\)"):
        lower(lambda q, k, v, d: aj.attention(q, k, v, q_descale=d, library=fp8_lib, arch="sm90"), q8, k8, k8,
              jax.ShapeDtypeStruct((2, 4), jnp.float32))
