"""The ABI proof against real Triton 3.6.0 binaries for every supported target.

Kernels are compiled on the CPU (no GPU needed), once per (kernel, target) per module. The
expected layout is plain C natural alignment, so agreement here is evidence, not tautology:
the offsets come from the binaries' own metadata.
"""

from __future__ import annotations

import copy
import io
import re
import struct

import pytest

from builder.abi import (
    HIDDEN_ARGS,
    AbiError,
    BinaryAbi,
    _as_bytes,
    natural_layout,
    prove,
    read_binary,
    read_cubin,
    read_hsaco,
)

triton = pytest.importorskip("triton", reason="the builder's ABI tests compile with triton")
tl = pytest.importorskip("triton.language")
msgpack = pytest.importorskip("msgpack")
elffile = pytest.importorskip("elftools.elf.elffile")


# --------------------------------------------------------------------------- kernels


@triton.jit
def mixed_kernel(n, x_ptr, s, y_ptr, flag, scale, BLOCK: tl.constexpr):
    # i32 then a pointer, i64, i1 then fp32: every scalar forces padding somewhere.
    off = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + off, mask=off < n)
    tl.store(y_ptr + off, x * scale + s + flag, mask=off < n)


@triton.jit
def narrow_kernel(a, p, b, h, g, u, v, d, c, w, q, BLOCK: tl.constexpr):
    # One of every narrow scalar: i8, i16, fp16, bf16, u32, u64, fp64, u8, u16.
    off = tl.arange(0, BLOCK)
    x = tl.load(p + off).to(tl.float32)
    y = x + a + b + h.to(tl.float32) + g.to(tl.float32) + u + v + d + c + w
    tl.store(q + off, y.to(tl.int32))


@triton.jit
def tail_kernel(x_ptr, n, BLOCK: tl.constexpr):
    # Ends in an i32, so the hidden pointers need 4 bytes of padding before them.
    off = tl.arange(0, BLOCK)
    tl.store(x_ptr + off, tl.load(x_ptr + off, mask=off < n) + 1, mask=off < n)


@triton.jit
def dot_kernel(a_ptr, b_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # tl.dot stages both tiles through shared memory / LDS.
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a = tl.load(a_ptr + rm[:, None] * BK + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * BN + rn[None, :])
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], tl.dot(a, b))


KERNELS = {
    "mixed": (mixed_kernel, {"n": "i32", "x_ptr": "*fp32", "s": "i64", "y_ptr": "*fp32",
                             "flag": "i1", "scale": "fp32", "BLOCK": "constexpr"},
              {"BLOCK": 128}),
    "narrow": (narrow_kernel, {"a": "i8", "p": "*fp16", "b": "i16", "h": "fp16", "g": "bf16",
                               "u": "u32", "v": "u64", "d": "fp64", "c": "u8", "w": "u16",
                               "q": "*i32", "BLOCK": "constexpr"}, {"BLOCK": 64}),
    "tail": (tail_kernel, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 256}),
    "dot": (dot_kernel, {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32", "BM": "constexpr",
                         "BN": "constexpr", "BK": "constexpr"}, {"BM": 64, "BN": 64, "BK": 64}),
}

# catalog arch -> (backend, Triton's arch, warp size)
TARGETS = {
    "gfx90a": ("hip", "gfx90a", 64),
    "gfx942": ("hip", "gfx942", 64),
    "gfx950": ("hip", "gfx950", 64),
    "gfx1100": ("hip", "gfx1100", 32),
    "gfx1201": ("hip", "gfx1201", 32),
    "sm80": ("cuda", 80, 32),
    "sm90": ("cuda", 90, 32),
}
HIP = [a for a, t in TARGETS.items() if t[0] == "hip"]
CUDA = [a for a, t in TARGETS.items() if t[0] == "cuda"]


def make_variant(kernel: str, arch: str, compiled) -> dict:
    """A catalog variant as the builder writes it, with offsets from natural_layout."""
    _, signature, constexprs = KERNELS[kernel]
    backend, _, warp = TARGETS[arch]
    runtime = [(n, t) for n, t in signature.items() if t != "constexpr"]
    layout, total = natural_layout([t for _, t in runtime])
    entries = [{"name": n, "type": t, "offset": o, "size": s, "align": a}
               for (n, t), (o, s, a) in zip([*runtime, *[(h, "*i8") for h in HIDDEN_ARGS]],
                                            layout, strict=True)]
    md = compiled.metadata
    return {
        "kernel": kernel, "symbol": md.name,
        "target": {"backend": backend, "arch": arch, "warp_size": warp},
        "config": {"constexprs": dict(constexprs), "num_warps": md.num_warps},
        "args": entries[:len(runtime)], "hidden_args": entries[len(runtime):],
        "param_size": total, "num_warps": md.num_warps, "num_ctas": md.num_ctas,
        "cluster_dims": [md.num_ctas, 1, 1], "shared": md.shared,
        "image": {"format": "cubin" if backend == "cuda" else "hsaco"},
    }


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(kernel, arch, **options) -> (variant, raw binary, shared)``, compiled once."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
    patch.setenv("TRITON_DISABLE_LINE_INFO", "1")
    built: dict = {}

    def get(kernel: str, arch: str, **options) -> tuple[dict, bytes, int]:
        key = (kernel, arch, tuple(sorted(options.items())))
        if key not in built:
            fn, signature, constexprs = KERNELS[kernel]
            backend, triton_arch, warp = TARGETS[arch]
            compiled = triton.compile(ASTSource(fn, signature, constexprs),
                                      target=GPUTarget(backend, triton_arch, warp),
                                      options=options or None)
            fmt = "cubin" if backend == "cuda" else "hsaco"
            built[key] = (make_variant(kernel, arch, compiled), compiled.asm[fmt],
                          compiled.metadata.shared)
        variant, raw, shared = built[key]
        return copy.deepcopy(variant), raw, shared

    yield get
    patch.undo()


# --------------------------------------------------------------------------- natural_layout


def test_natural_layout_pads_each_scalar_to_its_own_alignment():
    layout, total = natural_layout(["i32", "*fp32", "i64", "*fp32", "i1", "fp32"])
    assert layout == [(0, 4, 4), (8, 8, 8), (16, 8, 8), (24, 8, 8), (32, 1, 1), (36, 4, 4),
                      (40, 8, 8), (48, 8, 8)]
    assert total == 56


def test_natural_layout_packs_narrow_scalars_back_to_back():
    layout, _ = natural_layout(["u1", "i8", "i16", "fp16", "bf16", "u16", "u32"])
    assert [o for o, _, _ in layout[:7]] == [0, 1, 2, 4, 6, 8, 12]
    assert [s for _, s, _ in layout[:7]] == [1, 1, 2, 2, 2, 2, 4]


def test_natural_layout_appends_two_aligned_hidden_pointers():
    layout, total = natural_layout(["i8"])
    assert layout == [(0, 1, 1), (8, 8, 8), (16, 8, 8)]
    assert total == 24
    assert natural_layout([]) == ([(0, 8, 8), (8, 8, 8)], 16)


@pytest.mark.parametrize("bad", ["constexpr", "tensordesc<fp16[64, 64]>", "fp8e4nv", "int"])
def test_natural_layout_rejects_types_without_a_plain_layout(bad):
    with pytest.raises(AbiError, match="no known kernel-argument layout for Triton type "
                                       + re.escape(repr(bad))):
        natural_layout(["i32", bad])


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_natural_layout_matches_what_the_binary_records(build, kernel, arch):
    variant, raw, _ = build(kernel, arch)
    _, signature, _ = KERNELS[kernel]
    layout, total = natural_layout([t for t in signature.values() if t != "constexpr"])
    abi = read_binary(raw, variant["image"]["format"], variant["symbol"])
    assert abi.params == tuple((o, s) for o, s, _ in layout)
    assert abi.param_size == total


# --------------------------------------------------------------------------- reading


@pytest.mark.parametrize("arch", HIP)
def test_read_hsaco_reads_wave_size_pointer_kinds_and_block_size(build, arch):
    variant, raw, _ = build("mixed", arch)
    abi = read_hsaco(raw, "mixed_kernel")
    assert isinstance(abi, BinaryAbi) and abi.format == "hsaco"
    assert abi.warp_size == TARGETS[arch][2]
    assert abi.extra["arch"] == arch
    assert abi.extra["kinds"] == ("value", "pointer", "value", "pointer", "value", "value",
                                  "pointer", "pointer")
    assert abi.extra["threads"] == variant["num_warps"] * TARGETS[arch][2]


@pytest.mark.parametrize("arch", CUDA)
def test_read_cubin_decodes_kparam_info_and_block_shape(build, arch):
    variant, raw, _ = build("mixed", arch)
    abi = read_cubin(raw, "mixed_kernel")
    assert abi.format == "cubin" and abi.warp_size is None
    assert abi.extra["arch"] == arch
    assert abi.extra["kinds"] == ("value", "pointer", "value", "pointer", "value", "value",
                                  "pointer", "pointer")
    assert abi.extra["threads"] == (variant["num_warps"] * 32, 1, 1)
    assert abi.extra["param_cbank_size"] == abi.param_size == 56
    assert abi.extra["registers"] > 0


@pytest.mark.parametrize("arch", HIP)
def test_hsaco_fixed_lds_is_zero_even_when_the_kernel_uses_shared_memory(build, arch):
    variant, raw, shared = build("dot", arch)
    assert shared > 0
    assert read_hsaco(raw, "dot_kernel").static_shared == 0
    prove(variant, raw)


def test_note_desc_is_accepted_as_str_or_bytes():
    packed = msgpack.packb({"amdhsa.version": [1, 2]})
    assert _as_bytes(packed) == packed
    assert _as_bytes(packed.decode("latin-1")) == packed


def test_read_binary_rejects_an_unknown_format():
    with pytest.raises(AbiError, match=r"image\.format 'ptx' is not one of \['cubin', 'hsaco'\]"):
        read_binary(b"\x7fELF", "ptx", "k")


def test_read_binary_rejects_bytes_that_are_not_elf():
    with pytest.raises(AbiError, match=r"k: image\.format: the image is not an ELF file"):
        read_binary(b"// PTX text", "cubin", "k")


@pytest.mark.parametrize("arch", ["gfx942", "sm90"])
def test_read_binary_rejects_the_other_backends_elf(build, arch):
    variant, raw, _ = build("tail", arch)
    other = "hsaco" if variant["image"]["format"] == "cubin" else "cubin"
    machine = "EM_CUDA" if other == "cubin" else "EM_AMDGPU"
    with pytest.raises(AbiError, match=rf"image\.format: catalog says {other} \({machine}\)"):
        read_binary(raw, other, "tail_kernel")


# --------------------------------------------------------------------------- proving


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_prove_accepts_the_natural_layout(build, kernel, arch):
    variant, raw, _ = build(kernel, arch)
    abi = prove(variant, raw)
    assert abi.symbol == f"{kernel}_kernel"
    assert len(abi.params) == len(variant["args"]) + len(variant["hidden_args"])


def _shift_offset(v):
    v["args"][1]["offset"] += 4


def _wrong_size(v):
    v["args"][0]["size"] = 8


def _drop_hidden(v):
    v["hidden_args"].pop()


def _shift_hidden(v):
    v["hidden_args"][0]["offset"] -= 8


def _grow_param_size(v):
    v["param_size"] += 8


def _flip_warp_size(v):
    v["target"]["warp_size"] = 96 - v["target"]["warp_size"]


def _rename(v):
    v["symbol"] = "other_kernel"


def _double_warps(v):
    v["num_warps"] *= 2


def _other_arch(v):
    v["target"]["arch"] = "sm75" if v["target"]["backend"] == "cuda" else "gfx908"


def _pointer_as_i64(v):
    v["args"][1]["type"] = "i64"


def _i32_as_pointer_of_same_slot(v):
    v["args"][5]["type"] = "*fp32"


MUTATIONS = {
    "shifted offset": (_shift_offset, r"args\[1\]\.offset: catalog has 12, binary has 8"),
    "wrong size": (_wrong_size, r"args\[0\]\.size: catalog has 8, binary has 4"),
    "missing hidden arg": (_drop_hidden, r"args\+hidden_args \(parameter count\): catalog has 7, "
                                         r"binary has 8 \(6 args \+ 1 hidden_args"),
    "shifted hidden arg": (_shift_hidden, r"hidden_args\[0\]\.offset: catalog has 32, binary "
                                          r"has 40"),
    "wrong param_size": (_grow_param_size, r"param_size: catalog has 64, binary has 56"),
    "wrong warp size": (_flip_warp_size, r"target\.warp_size: catalog has \d+, binary has \d+"),
    "wrong symbol": (_rename, r"other_kernel: symbol: "),
    "wrong num_warps": (_double_warps, r"num_warps \(threads per block\): catalog has"),
    "wrong arch": (_other_arch, r"target\.arch: catalog has '(sm75|gfx908)', binary has "),
    "pointer declared as i64": (_pointer_as_i64, r"args\[1\]\.kind: catalog has 'value', binary "
                                                 r"has 'pointer' \(catalog type 'i64'\)"),
    "scalar declared as pointer": (_i32_as_pointer_of_same_slot,
                                   r"args\[5\]\.kind: catalog has 'pointer', binary has 'value'"),
}


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_prove_catches_a_wrong_catalog_layout(build, mutation, arch):
    variant, raw, _ = build("mixed", arch)
    mutate, message = MUTATIONS[mutation]
    mutate(variant)
    with pytest.raises(AbiError, match=message) as caught:
        prove(variant, raw)
    assert caught.value.field is not None
    if mutation != "wrong symbol":
        assert str(caught.value).startswith(f"ABI mismatch in mixed_kernel ({TARGETS[arch][0]}/")


@pytest.mark.parametrize("arch", ["gfx942", "sm80"])
def test_prove_catches_a_catalog_naming_the_wrong_image_format(build, arch):
    variant, raw, _ = build("mixed", arch)
    variant["image"]["format"] = "hsaco" if arch.startswith("sm") else "cubin"
    with pytest.raises(AbiError, match=r"mixed_kernel: image\.format: catalog says "):
        prove(variant, raw)


def test_prove_says_which_catalog_field_is_missing(build):
    variant, raw, _ = build("mixed", "gfx942")
    del variant["param_size"]
    with pytest.raises(AbiError, match=r"mixed_kernel: the catalog variant has no 'param_size'"):
        prove(variant, raw)


def test_prove_checks_cluster_dims_against_the_cubin(build):
    variant, raw, _ = build("dot", "sm90", num_ctas=2)
    assert variant["cluster_dims"] == [2, 1, 1]
    assert prove(variant, raw).extra["cluster_dims"] == (2, 1, 1)
    variant["cluster_dims"] = [1, 1, 1]
    with pytest.raises(AbiError, match=r"cluster_dims: catalog has \(1, 1, 1\), binary has "
                                       r"\(2, 1, 1\)"):
        prove(variant, raw)
    plain, raw, _ = build("dot", "sm90")
    plain["cluster_dims"] = [2, 1, 1]
    with pytest.raises(AbiError, match=r"cluster_dims: catalog has \(2, 1, 1\), binary has "
                                       r"\(1, 1, 1\)"):
        prove(plain, raw)


# --------------------------------------------------------------------------- tampered binaries
# A right catalog against a wrong binary: the binary side of every check must bite too.


def _section(raw: bytes, name: str):
    elf = elffile.ELFFile(io.BytesIO(raw))
    section = elf.get_section_by_name(name)
    return section["sh_offset"], section["sh_size"]


def _replace_in(raw: bytes, names: list[str], old: bytes, new: bytes) -> bytes:
    assert len(old) == len(new)
    out = bytearray(raw)
    for name in names:
        start, size = _section(raw, name)
        chunk = bytes(out[start:start + size])
        assert old in chunk, (name, old)
        out[start:start + size] = chunk.replace(old, new)
    return bytes(out)


def _retouch_metadata(raw: bytes, **fields) -> bytes:
    """Rewrite fields of the first kernel in the AMDGPU note, keeping its encoded length."""
    desc = next(n["n_desc"] for s in elffile.ELFFile(io.BytesIO(raw)).iter_sections()
                if s["sh_type"] == "SHT_NOTE" for n in s.iter_notes())
    desc = _as_bytes(desc)
    meta = msgpack.unpackb(desc)
    meta["amdhsa.kernels"][0].update(fields)
    new = msgpack.packb(meta)
    assert len(new) == len(desc) and raw.count(desc) == 1
    return raw.replace(desc, new)


@pytest.mark.parametrize("arch", HIP)
def test_prove_rejects_an_hsaco_with_a_fixed_lds_segment(build, arch):
    variant, raw, _ = build("dot", arch)
    tampered = _retouch_metadata(raw, **{".group_segment_fixed_size": 64})
    with pytest.raises(AbiError, match=r"shared \(static LDS \.group_segment_fixed_size\): "
                                       r"catalog has 0, binary has 64; Triton passes all LDS "
                                       r"\(\d+ bytes\) dynamically"):
        prove(variant, tampered)


def test_prove_rejects_an_hsaco_whose_wavefront_differs(build):
    variant, raw, _ = build("mixed", "gfx942")
    tampered = _retouch_metadata(raw, **{".wavefront_size": 32})
    with pytest.raises(AbiError, match=r"target\.warp_size: catalog has 64, binary has 32"):
        prove(variant, tampered)


def test_prove_rejects_an_hsaco_without_the_kernel_descriptor_symbol(build):
    variant, raw, _ = build("mixed", "gfx1100")
    tampered = _replace_in(raw, [".strtab", ".dynstr"], b"mixed_kernel.kd\0", b"mixed_kernel.kx\0")
    with pytest.raises(AbiError, match=r"mixed_kernel: symbol: the kernel descriptor "
                                       r"'mixed_kernel\.kd' is not in the ELF symbol table"):
        prove(variant, tampered)


def test_read_hsaco_rejects_a_binary_without_the_metadata_note(build):
    _, raw, _ = build("mixed", "gfx90a")
    tampered = _replace_in(raw, [".note"], b"AMDGPU\0", b"NVIDIA\0")
    with pytest.raises(AbiError, match=r"has no NT_AMDGPU_METADATA note"):
        read_hsaco(tampered, "mixed_kernel")


def _kparam_record(raw: bytes, symbol: str, ordinal: int) -> int:
    """File offset of the KPARAM_INFO record for ``ordinal`` in ``.nv.info.<symbol>``."""
    start, size = _section(raw, f".nv.info.{symbol}")
    pos = start
    while pos < start + size:
        fmt, attr, value = struct.unpack_from("<BBH", raw, pos)
        if (fmt, attr) == (4, 0x17) and struct.unpack_from("<H", raw, pos + 8)[0] == ordinal:
            return pos
        pos += 4 + (value if fmt == 4 else 0)
    raise AssertionError(f"no KPARAM_INFO for ordinal {ordinal}")


@pytest.mark.parametrize("arch", CUDA)
def test_prove_rejects_a_cubin_whose_kparam_offset_differs(build, arch):
    variant, raw, _ = build("mixed", arch)
    out = bytearray(raw)
    struct.pack_into("<H", out, _kparam_record(raw, "mixed_kernel", 2) + 10, 24)
    with pytest.raises(AbiError, match=r"args\[2\]\.offset: catalog has 16, binary has 24"):
        prove(variant, bytes(out))


@pytest.mark.parametrize("arch", CUDA)
def test_read_cubin_rejects_a_duplicated_parameter_ordinal(build, arch):
    _, raw, _ = build("mixed", arch)
    out = bytearray(raw)
    struct.pack_into("<H", out, _kparam_record(raw, "mixed_kernel", 3) + 8, 2)
    with pytest.raises(AbiError, match=r"EIATTR_KPARAM_INFO lists ordinal 2 twice"):
        read_cubin(bytes(out), "mixed_kernel")


def test_read_cubin_rejects_an_unknown_record_format(build):
    _, raw, _ = build("mixed", "sm80")
    out = bytearray(raw)
    out[_section(raw, ".nv.info.mixed_kernel")[0]] = 9
    with pytest.raises(AbiError, match=r"unknown \.nv\.info record format 9 at byte 0"):
        read_cubin(bytes(out), "mixed_kernel")


def test_read_cubin_requires_the_kernels_text_section(build):
    _, raw, _ = build("mixed", "sm90")
    tampered = _replace_in(raw, [".shstrtab"], b".text.mixed_kernel", b".tExt.mixed_kernel")
    with pytest.raises(AbiError, match=r"mixed_kernel: symbol: no \.text\.mixed_kernel section"):
        read_cubin(tampered, "mixed_kernel")
