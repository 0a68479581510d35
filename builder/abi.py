"""The ABI proof: a binary's own metadata against the catalog's argument layout.

The runtime packs kernel arguments with the offsets the catalog records; nothing at launch
time can tell a wrong offset from a right one, the kernel just reads garbage. So every image
is proved at build time: its parameter list, parameter block size, wave size, thread count,
static shared memory, cluster shape and architecture are read from the binary itself and must
equal the catalog variant, or the build fails with :class:`AbiError`.

What the binaries say (Triton 3.6.0; observed on gfx90a, gfx942, gfx950, gfx1100, gfx1201,
sm80 and sm90 with kernels that mix i1/i8/u8/i16/u16/fp16/bf16/i32/u32/fp32/i64/u64/fp64 scalars and
pointers in padding-forcing orders):

* Parameters follow C natural alignment in declaration order (i1 and u1 take one byte), then
  two 8-byte pointers Triton appends (global and profile scratch). :func:`natural_layout`
  computes exactly this. Both formats mark which parameters are pointers (HSACO
  ``.value_kind: global_buffer``; cubin KPARAM_INFO state space 4, from PTX's
  ``.ptr .global``), so the proof also checks pointer vs. scalar against the catalog types.
* HSACO: ``.kernarg_segment_size`` equals the end of the last parameter: Triton's AMD backend
  emits no implicit (``hidden_*``) kernel arguments and nothing is rounded beyond the
  8-byte alignment the trailing pointers already give. The rule enforced is equality with
  ``param_size``. ``.group_segment_fixed_size`` is 0 even for kernels that use LDS: Triton
  puts all of it in one dynamically sized ``global_smem`` array whose size (``shared``) is
  passed at launch, so the enforced rule is "static LDS is 0". ``.max_flat_workgroup_size``
  equals ``num_warps * wavefront_size``.
* cubin: ``EIATTR_CBANK_PARAM_SIZE`` equals ``param_size``; ``EIATTR_REQNTID`` is
  ``(num_warps * 32, 1, 1)``; ``EIATTR_CTA_PER_CLUSTER`` appears only when ``num_ctas > 1``.
  Static shared memory (``.nv.shared.<symbol>``) is *not* tied to ``shared`` (Triton's
  ``global_smem`` is a dynamic ``.extern .shared`` array): it was 0 on sm80 and 1024 bytes on
  sm90 in every kernel tried that touches shared memory, so it is reported (the driver needs
  it to size the dynamic opt-in) but not compared.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aotriton_rt.catalog import POINTER_SIZE, TRITON_SCALARS, Variant

#: The two 8-byte pointers Triton 3.x appends after the declared arguments, in order.
HIDDEN_ARGS = ("global_scratch", "profile_scratch")

# Scalar sizes as Triton 3.6 passes them: the catalog's one table (a scalar is aligned to its
# size; every pointer, "*fp16", "*i8", ..., is 8 bytes).
_SCALAR_SIZES = {t: size for t, (size, _) in TRITON_SCALARS.items()}

# AMDGPU code object metadata note (msgpack), see the LLVM AMDGPUUsage document.
_NT_AMDGPU_METADATA = 32

# .nv.info record formats: a 4-byte record (NVAL, BVAL, HVAL) or 2-byte length + payload.
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4
# .nv.info attributes read here (numbering as printed by `cuobjdump -elf`).
_EIATTR_MAX_THREADS = 0x05
_EIATTR_PARAM_CBANK = 0x0A
_EIATTR_REQNTID = 0x10
_EIATTR_KPARAM_INFO = 0x17
_EIATTR_CBANK_PARAM_SIZE = 0x19
_EIATTR_MAXREG_COUNT = 0x1B
_EIATTR_REGCOUNT = 0x2F
_EIATTR_CUDA_API_VERSION = 0x37
_EIATTR_CTA_PER_CLUSTER = 0x3D
_EIATTR_EXPLICIT_CLUSTER = 0x3E

# Every NVIDIA GPU runs 32-thread warps; a cubin does not record it.
_NVIDIA_WARP_SIZE = 32


class AbiError(Exception):
    """A binary's metadata disagrees with its catalog variant, or cannot be read.

    For a mismatch the message names the symbol (and target), the field, the catalog's value
    and the binary's value; the same are kept as attributes ``symbol``, ``field``,
    ``expected`` and ``found`` (``None`` when the error is not a mismatch).
    """

    def __init__(self, message: str, *, symbol: str | None = None, field: str | None = None,
                 expected: Any = None, found: Any = None) -> None:
        super().__init__(message)
        self.symbol = symbol
        self.field = field
        self.expected = expected
        self.found = found


@dataclass(frozen=True)
class BinaryAbi:
    """The launch ABI of one kernel as its binary records it.

    ``params`` holds ``(offset, size)`` of every kernel parameter in declaration order,
    Triton's hidden scratch pointers included. ``param_size`` is ``.kernarg_segment_size``
    (HSACO) or ``EIATTR_CBANK_PARAM_SIZE`` (cubin). ``static_shared`` is the fixed LDS /
    static shared memory in bytes, ``warp_size`` the wavefront size (``None`` for cubin,
    which does not record it). ``extra`` holds the rest that was read: ``kinds`` ("pointer" or
    "value" per parameter), ``arch``, ``threads`` (the required or maximum block size),
    register counts, and for cubin ``cluster_dims`` when the kernel has one.
    """

    format: str
    symbol: str
    params: tuple[tuple[int, int], ...]
    param_size: int
    static_shared: int | None
    warp_size: int | None
    extra: dict = field(default_factory=dict)


def natural_layout(types: Sequence[str]) -> tuple[list[tuple[int, int, int]], int]:
    """Lay out Triton signature types as the compiled kernel expects them.

    Args:
        types: the runtime (non-constexpr) argument types in launch order, as Triton spells
            them: ``"*fp16"`` (any pointer), ``"i1"``, ``"i32"``, ``"fp32"``, ``"u64"``...
    Returns:
        ``(layout, total)``: ``(offset, size, align)`` for each type followed by the two
        hidden 8-byte scratch pointers, and the parameter block size (the end of the last
        parameter rounded up to the largest alignment, as C would).
    Raises:
        AbiError: a type Triton does not pass as a plain scalar or pointer (``constexpr``,
            ``tensordesc<...>``, ``fp8e4nv`` ...).

    >>> natural_layout(["i32", "*fp32"])
    ([(0, 4, 4), (8, 8, 8), (16, 8, 8), (24, 8, 8)], 32)
    """
    layout: list[tuple[int, int, int]] = []
    offset = 0
    widest = 1
    for ty in [*types, *["*i8"] * len(HIDDEN_ARGS)]:
        if ty.startswith("*"):
            size = POINTER_SIZE
        elif ty in _SCALAR_SIZES:
            size = _SCALAR_SIZES[ty]
        else:
            raise AbiError(f"natural_layout: no known kernel-argument layout for Triton type "
                           f"{ty!r}; known: pointers ('*fp16', ...) and "
                           f"{', '.join(_SCALAR_SIZES)}")
        offset = -(-offset // size) * size
        layout.append((offset, size, size))
        offset += size
        widest = max(widest, size)
    return layout, -(-offset // widest) * widest


# --------------------------------------------------------------------------- reading


def read_binary(data: bytes, fmt: str, symbol: str) -> BinaryAbi:
    """Read the launch ABI of ``symbol`` from an image of format ``fmt`` ("hsaco" or "cubin").

    Raises:
        AbiError: unknown format, not an ELF of that format, or no such kernel in it.
    """
    readers = {"hsaco": read_hsaco, "cubin": read_cubin}
    if fmt not in readers:
        raise AbiError(f"{symbol}: image.format {fmt!r} is not one of {sorted(readers)}",
                       symbol=symbol, field="image.format", expected=sorted(readers), found=fmt)
    return readers[fmt](data, symbol)


def read_hsaco(data: bytes, symbol: str) -> BinaryAbi:
    """Read ``symbol``'s ABI from an AMDGPU code object (HSACO).

    The source is the ``NT_AMDGPU_METADATA`` note (name "AMDGPU", type 32, msgpack):
    the ``amdhsa.kernels`` entry whose ``.name`` is ``symbol``. Also checks that its
    ``.symbol`` is ``symbol + ".kd"`` and that the kernel descriptor is in the ELF symbol table.

    Raises:
        AbiError: not an AMDGPU ELF, no metadata note, no such kernel, or no descriptor symbol.

    >>> abi = read_hsaco(open("add.hsaco", "rb").read(), "add_kernel")  # doctest: +SKIP
    >>> abi.params, abi.param_size, abi.warp_size  # doctest: +SKIP
    (((0, 8), (8, 8), (16, 4), (24, 8), (32, 8)), 40, 64)
    """
    elf = _open_elf(data, "hsaco", "EM_AMDGPU", symbol)
    meta = _amdgpu_metadata(elf, symbol)
    kernels = meta.get("amdhsa.kernels") or []
    kernel = next((k for k in kernels if k.get(".name") == symbol), None)
    if kernel is None:
        names = [k.get(".name") for k in kernels]
        raise AbiError(f"{symbol}: symbol: no kernel of that name in the AMDGPU metadata; "
                       f"the binary has {names}",
                       symbol=symbol, field="symbol", expected=symbol, found=names)
    descriptor = symbol + ".kd"
    if kernel.get(".symbol") != descriptor:
        raise AbiError(f"{symbol}: .symbol: expected {descriptor!r}, binary has "
                       f"{kernel.get('.symbol')!r}",
                       symbol=symbol, field=".symbol", expected=descriptor,
                       found=kernel.get(".symbol"))
    if descriptor not in _elf_symbols(elf):
        raise AbiError(f"{symbol}: symbol: the kernel descriptor {descriptor!r} is not in the "
                       f"ELF symbol table", symbol=symbol, field="symbol",
                       expected=descriptor, found=None)
    args = kernel.get(".args") or []
    try:
        params = tuple((int(a[".offset"]), int(a[".size"])) for a in args)
        kinds = tuple(_HSACO_KINDS.get(a[".value_kind"], a[".value_kind"]) for a in args)
        param_size = int(kernel[".kernarg_segment_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise AbiError(f"{symbol}: malformed AMDGPU metadata for the kernel: {e!r}",
                       symbol=symbol) from e
    target = str(meta.get("amdhsa.target", ""))
    extra = {
        "kinds": kinds,
        # "amdgcn-amd-amdhsa--gfx942:sramecc+:xnack-" -> "gfx942"
        "arch": target.rpartition("-")[2].split(":")[0] or None,
        "target": target,
        "threads": kernel.get(".max_flat_workgroup_size"),
        "kernarg_segment_align": kernel.get(".kernarg_segment_align"),
        "private_segment_fixed_size": kernel.get(".private_segment_fixed_size"),
        "sgpr_count": kernel.get(".sgpr_count"),
        "vgpr_count": kernel.get(".vgpr_count"),
        "agpr_count": kernel.get(".agpr_count"),
        "sgpr_spill_count": kernel.get(".sgpr_spill_count"),
        "vgpr_spill_count": kernel.get(".vgpr_spill_count"),
        "uses_dynamic_stack": kernel.get(".uses_dynamic_stack"),
        "metadata_version": tuple(meta.get("amdhsa.version") or ()),
    }
    return BinaryAbi("hsaco", symbol, params, param_size,
                     kernel.get(".group_segment_fixed_size"), kernel.get(".wavefront_size"),
                     extra)


def read_cubin(data: bytes, symbol: str) -> BinaryAbi:
    """Read ``symbol``'s ABI from a CUDA cubin.

    The source is the ``.nv.info.<symbol>`` section: a run of EIATTR records, each a 1-byte
    format, a 1-byte attribute, then either a 2-byte value (formats 1-3) or a 2-byte length
    and that many payload bytes (format 4). One ``EIATTR_KPARAM_INFO`` per parameter carries
    12 bytes: u32 index, u16 ordinal, u16 offset, then a u32 whose bits are
    ``[0:8)`` pointee log2 alignment, ``[8:12)`` state space (4 for a ``.ptr .global``
    pointer, 0 for a by-value scalar), ``[12:17)`` constant bank (0x1f), ``[18:32)`` size
    in bytes. Parameters are returned sorted by ordinal. ``.text.<symbol>`` must exist.

    Raises:
        AbiError: not a CUDA ELF, no such kernel, or malformed ``.nv.info`` records.
    """
    elf = _open_elf(data, "cubin", "EM_CUDA", symbol)
    if elf.get_section_by_name(f".text.{symbol}") is None:
        names = sorted(s.name[len(".text."):] for s in elf.iter_sections()
                       if s.name.startswith(".text."))
        raise AbiError(f"{symbol}: symbol: no .text.{symbol} section; the cubin's kernels are "
                       f"{names}", symbol=symbol, field="symbol", expected=symbol, found=names)
    info = elf.get_section_by_name(f".nv.info.{symbol}")
    if info is None:
        raise AbiError(f"{symbol}: the cubin has no .nv.info.{symbol} section", symbol=symbol)
    kparams: dict[int, tuple[int, int, str]] = {}
    extra: dict[str, Any] = {}
    param_size = None
    for attr, payload in _eiattr_records(info.data(), symbol):
        if attr == _EIATTR_KPARAM_INFO:
            _, ordinal, offset, word = struct.unpack_from("<IHHI", _need_len(payload, 12, symbol))
            if ordinal in kparams:
                raise AbiError(f"{symbol}: EIATTR_KPARAM_INFO lists ordinal {ordinal} twice",
                               symbol=symbol)
            kparams[ordinal] = (offset, word >> 18, "pointer" if (word >> 8) & 0xF else "value")
        elif attr == _EIATTR_CBANK_PARAM_SIZE:
            param_size = struct.unpack_from("<H", payload)[0]
        elif attr == _EIATTR_PARAM_CBANK:
            # u32 symbol index of .nv.constant0.<symbol>, u16 offset, u16 size of the block
            _, base, size = struct.unpack_from("<IHH", _need_len(payload, 8, symbol))
            extra["param_cbank_offset"], extra["param_cbank_size"] = base, size
        elif attr == _EIATTR_REQNTID:
            extra["reqntid"] = struct.unpack_from("<3I", _need_len(payload, 12, symbol))
        elif attr == _EIATTR_MAX_THREADS:
            extra["max_threads"] = struct.unpack_from("<3I", _need_len(payload, 12, symbol))
        elif attr == _EIATTR_CTA_PER_CLUSTER:
            extra["cluster_dims"] = struct.unpack_from("<3I", _need_len(payload, 12, symbol))
        elif attr == _EIATTR_EXPLICIT_CLUSTER:
            extra["explicit_cluster"] = True
        elif attr == _EIATTR_MAXREG_COUNT:
            extra["maxreg_count"] = struct.unpack_from("<H", payload)[0]
        elif attr == _EIATTR_CUDA_API_VERSION:
            extra["cuda_api_version"] = struct.unpack_from("<I", _need_len(payload, 4, symbol))[0]
    if param_size is None:
        raise AbiError(f"{symbol}: .nv.info.{symbol} has no EIATTR_CBANK_PARAM_SIZE",
                       symbol=symbol)
    if sorted(kparams) != list(range(len(kparams))):
        raise AbiError(f"{symbol}: EIATTR_KPARAM_INFO ordinals {sorted(kparams)} are not "
                       f"0..{len(kparams) - 1}", symbol=symbol)
    ordered = [kparams[i] for i in range(len(kparams))]
    extra["kinds"] = tuple(kind for _, _, kind in ordered)
    extra["threads"] = extra.get("reqntid") or extra.get("max_threads")
    extra["arch"] = _cubin_arch(elf.header["e_flags"])
    registers = _cubin_registers(elf, symbol)
    if registers is not None:
        extra["registers"] = registers
    shared = elf.get_section_by_name(f".nv.shared.{symbol}")
    return BinaryAbi("cubin", symbol, tuple((o, s) for o, s, _ in ordered), param_size,
                     shared["sh_size"] if shared is not None else 0, None, extra)


_HSACO_KINDS = {"global_buffer": "pointer", "by_value": "value"}


def _open_elf(data: bytes, fmt: str, machine: str, symbol: str):
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    if not data.startswith(b"\x7fELF"):
        raise AbiError(f"{symbol}: image.format: the image is not an ELF file, so not a {fmt} "
                       f"(starts with {bytes(data[:4])!r})", symbol=symbol, field="image.format",
                       expected=fmt, found=None)
    try:
        elf = ELFFile(io.BytesIO(data))
        found = elf.header["e_machine"]
    except ELFError as e:
        raise AbiError(f"{symbol}: malformed {fmt} ELF: {e}", symbol=symbol) from e
    if found != machine:
        raise AbiError(f"{symbol}: image.format: catalog says {fmt} ({machine}), binary is "
                       f"{found}", symbol=symbol, field="image.format", expected=fmt, found=found)
    return elf


def _as_bytes(desc: bytes | str) -> bytes:
    """pyelftools hands an unknown note's desc back as bytes, older versions as latin-1 str."""
    return desc.encode("latin-1") if isinstance(desc, str) else bytes(desc)


def _amdgpu_metadata(elf, symbol: str) -> dict:
    import msgpack

    for section in elf.iter_sections():
        if section["sh_type"] != "SHT_NOTE":
            continue
        for note in section.iter_notes():
            if note["n_name"] == "AMDGPU" and note["n_type"] in (_NT_AMDGPU_METADATA,
                                                                 "NT_AMDGPU_METADATA"):
                try:
                    meta = msgpack.unpackb(_as_bytes(note["n_desc"]), raw=False)
                except (ValueError, msgpack.UnpackException) as e:
                    raise AbiError(f"{symbol}: unreadable AMDGPU metadata note: {e}",
                                   symbol=symbol) from e
                if not isinstance(meta, dict):
                    raise AbiError(f"{symbol}: the AMDGPU metadata note is not a map",
                                   symbol=symbol)
                return meta
    raise AbiError(f"{symbol}: the HSACO has no NT_AMDGPU_METADATA note (name 'AMDGPU', "
                   f"type 32); was it built for code object v3 or later?", symbol=symbol)


def _elf_symbols(elf) -> set[str]:
    names: set[str] = set()
    for section in elf.iter_sections():
        if section["sh_type"] in ("SHT_SYMTAB", "SHT_DYNSYM"):
            names.update(s.name for s in section.iter_symbols())
    return names


def _eiattr_records(data: bytes, symbol: str) -> Iterable[tuple[int, bytes]]:
    pos = 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise AbiError(f"{symbol}: truncated .nv.info.{symbol} record at byte {pos}",
                           symbol=symbol)
        fmt, attr, value = struct.unpack_from("<BBH", data, pos)
        if fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):
            yield attr, data[pos + 2:pos + 4]
            pos += 4
        elif fmt == _EIFMT_SVAL:
            if pos + 4 + value > len(data):
                raise AbiError(f"{symbol}: .nv.info.{symbol} record 0x{attr:02x} at byte {pos} "
                               f"runs past the section", symbol=symbol)
            yield attr, data[pos + 4:pos + 4 + value]
            pos += 4 + value
        else:
            raise AbiError(f"{symbol}: unknown .nv.info record format {fmt} at byte {pos}",
                           symbol=symbol)


def _need_len(payload: bytes, n: int, symbol: str) -> bytes:
    if len(payload) < n:
        raise AbiError(f"{symbol}: .nv.info record payload of {len(payload)} bytes, "
                       f"expected {n}", symbol=symbol)
    return payload


def _cubin_arch(e_flags: int) -> str:
    # The SM number sits in bits 16..23 (CUDA ELF ABI v7, what ptxas 12.x writes) and in
    # bits 8..15 of newer ABI versions that leave 16..23 zero.
    sm = (e_flags >> 16) & 0xFF or (e_flags >> 8) & 0xFF
    return f"sm{sm}"


def _cubin_registers(elf, symbol: str) -> int | None:
    """Registers per thread, from EIATTR_REGCOUNT in the shared .nv.info (keyed by symbol)."""
    symtab = elf.get_section_by_name(".symtab")
    info = elf.get_section_by_name(".nv.info")
    if symtab is None or info is None:
        return None
    index = next((i for i, s in enumerate(symtab.iter_symbols()) if s.name == symbol), None)
    for attr, payload in _eiattr_records(info.data(), symbol):
        if attr == _EIATTR_REGCOUNT and len(payload) >= 8:
            sym, count = struct.unpack_from("<II", payload)
            if sym == index:
                return count
    return None


# --------------------------------------------------------------------------- proving


def prove(variant: Variant | dict, raw: bytes) -> BinaryAbi:
    """Prove that ``raw`` is the binary ``variant`` (a catalog :class:`Variant`, or its JSON form
    as tests write it by hand) describes.

    Compares, from the binary's own metadata: every parameter's offset and size against
    ``args`` + ``hidden_args`` and whether it is a pointer; ``param_size``; the architecture;
    the wave size (HSACO) or 32 (cubin); the block size ``num_warps * warp_size``; the static
    LDS, which must be 0 on HSACO because ``shared`` is all dynamic; and the cluster shape
    (cubin). Returns what was read.

    Raises:
        AbiError: the first disagreement, naming the symbol and target, the field (e.g.
            ``args[1].offset``, ``param_size``, ``target.warp_size``), the catalog's value and
            the binary's value.

    >>> prove(variant, lzma.decompress(image_bytes))  # doctest: +SKIP
    BinaryAbi(format='cubin', symbol='add_kernel', params=((0, 8), ...), param_size=48, ...)
    """
    if isinstance(variant, Variant):
        variant = variant.to_json()
    symbol = _need(variant, "symbol", "?")
    target = _need(variant, "target", symbol)
    backend, arch = target.get("backend"), target.get("arch")
    where = f"{symbol} ({backend}/{arch})"

    def check(name: str, expected: Any, found: Any, note: str = "") -> None:
        if expected != found:
            raise AbiError(f"ABI mismatch in {where}: {name}: catalog has {expected!r}, "
                           f"binary has {found!r}{note}",
                           symbol=symbol, field=name, expected=expected, found=found)

    fmt = _need(variant, "image", symbol).get("format")
    abi = read_binary(raw, fmt, symbol)

    args = list(_need(variant, "args", symbol))
    hidden = list(_need(variant, "hidden_args", symbol))
    labelled = [(f"args[{i}]", a) for i, a in enumerate(args)]
    labelled += [(f"hidden_args[{i}]", a) for i, a in enumerate(hidden)]
    check("args+hidden_args (parameter count)", len(labelled), len(abi.params),
          f" ({len(args)} args + {len(hidden)} hidden_args in the catalog)")
    kinds = abi.extra.get("kinds") or ()
    for (label, arg), (offset, size), kind in zip(labelled, abi.params, kinds, strict=True):
        check(f"{label}.offset", arg.get("offset"), offset)
        check(f"{label}.size", arg.get("size"), size)
        if "type" in arg:
            check(f"{label}.kind", "pointer" if str(arg["type"]).startswith("*") else "value",
                  kind, f" (catalog type {arg['type']!r})")
    param_size = _need(variant, "param_size", symbol)
    check("param_size", param_size, abi.param_size)
    # The constant-bank window the driver copies parameters into must be the same size.
    check("param_size (EIATTR_PARAM_CBANK)", param_size,
          abi.extra.get("param_cbank_size", param_size))

    found_arch = abi.extra.get("arch")
    if fmt == "cubin":
        # The catalog may spell an arch-specific target like sm90a; the ELF records only the
        # SM number.
        check("target.arch", str(arch).rstrip("abf"), found_arch)
        warp = _NVIDIA_WARP_SIZE
    else:
        check("target.arch", arch, found_arch)
        warp = abi.warp_size
    check("target.warp_size", target.get("warp_size"), warp)

    # The kernel's code assumes exactly num_warps warps: a different block size is not a
    # launch failure but wrong results, so the binary's required block shape must match.
    threads = abi.extra.get("threads")
    if threads is not None:
        per_block = _need(variant, "num_warps", symbol) * warp
        if isinstance(threads, (list, tuple)):
            check("num_warps (threads per block)", (per_block, 1, 1), tuple(threads))
        else:
            check("num_warps (threads per block)", per_block, threads)

    if fmt == "hsaco":
        check("shared (static LDS .group_segment_fixed_size)", 0, abi.static_shared,
              f"; Triton passes all LDS ({variant.get('shared')} bytes) dynamically at launch, "
              f"so a fixed segment means the binary is not what the catalog describes")
    else:
        check("cluster_dims", tuple(variant.get("cluster_dims") or (1, 1, 1)),
              tuple(abi.extra.get("cluster_dims") or (1, 1, 1)))
    return abi


def _need(variant: dict, key: str, symbol: str) -> Any:
    if key not in variant:
        raise AbiError(f"{symbol}: the catalog variant has no {key!r}; cannot prove its ABI",
                       symbol=symbol, field=key)
    return variant[key]
