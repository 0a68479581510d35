"""A fake ``libamdhip64`` for CPU-only tests, and helpers to use it.

``build_fake_hip(tmp_path)`` compiles ``fake_amdhip64.c`` with gcc into
``tmp_path/libamdhip64.so`` and returns that path; ``fake_hip_env(...)`` gives the
environment that points aotriton-rt (and hip-python) at it and configures the fake GPUs;
``read_log(path)`` parses what the fake recorded (it, ``compile_shared`` and ``fnv1a64`` live in
:mod:`tests.helpers.fake_driver`, shared with the fake libcuda). Typical use, in a subprocess so that the
environment is in place before anything loads the library::

    lib = build_fake_hip(tmp_path)
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, **fake_hip_env(lib, log, arch="gfx942:sramecc+:xnack-")}
    subprocess.run([sys.executable, "-c", CODE], env=env, check=True)
    launches = [r for r in read_log(log) if r["call"] == "hipModuleLaunchKernel"]
    assert launches[0]["args"] == struct.pack("<QQi", 1, 2, 3)

Log records are dicts; every record has ``call`` and ``status``. Launch records carry
``name grid block shared stream device module_device args_size`` and ``args`` (the bytes of
the argument buffer); module loads carry ``size fnv1a64 head`` (``head``: first 16 bytes).
"""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path
from typing import NamedTuple

from tests.helpers.fake_driver import compile_shared, fnv1a64, read_log

__all__ = ["AMDGPU_MACH", "CompiledKernel", "build_fake_hip", "compile_shared", "fake_code_object", "fake_hip_env",
           "fnv1a64", "read_log", "triton_add_kernel"]

SOURCE = Path(__file__).with_name("fake_amdhip64.c")

# EF_AMDGPU_MACH values (low byte of e_flags) of the targets the fake knows.
AMDGPU_MACH = {"gfx90a": 0x3F, "gfx942": 0x4C, "gfx950": 0x4F, "gfx1100": 0x41, "gfx1151": 0x4A,
               "gfx1201": 0x4E, "gfx1250": 0x49}


def build_fake_hip(directory: Path, name: str = "libamdhip64.so") -> Path:
    """Compile the fake HIP runtime into ``directory/name`` and return its path.

    The soname is ``name`` too. Use the default (the real runtime's name) in subprocesses;
    for a copy loaded into the test process itself pick another name, e.g.
    ``"libfakeamdhip64.so"``: a library mapped under the real name would be found by any
    later discovery in that process (``/proc/self/maps``, dlopen by soname).
    """
    return compile_shared(SOURCE, Path(directory) / name, name)


def fake_hip_env(library: Path, log: Path | None = None, *, arch: str = "gfx942:sramecc+:xnack-",
                 devices: int = 1, name: str = "Fake AMD Instinct", lds: int = 65536,
                 backend: str | None = None, fail: str = "", capturing: str = "") -> dict[str, str]:
    """Environment variables that make aotriton-rt use the fake library with these GPUs.

    ``backend`` sets ``AOTRITON_RT_HIP_BACKEND`` ("ctypes" or "hip-python") when given;
    ``fail`` is FAKEHIP_FAIL ("call=code,..."); ``capturing`` is FAKEHIP_CAPTURING.
    """
    env = {
        "AOTRITON_RT_HIP_LIB": str(library),
        "FAKEHIP_ARCH": arch,
        "FAKEHIP_DEVICES": str(devices),
        "FAKEHIP_NAME": name,
        "FAKEHIP_LDS": str(lds),
        "FAKEHIP_FAIL": fail,
        "FAKEHIP_CAPTURING": capturing,
        "FAKEHIP_LOG": str(log) if log is not None else "",
    }
    if backend is not None:
        env["AOTRITON_RT_HIP_BACKEND"] = backend
    return env


def fake_code_object(arch: str, symbols: list[str], metadata: bytes | None = None) -> bytes:
    """A minimal AMDGPU ELF64 image for ``arch`` (e.g. "gfx942") naming ``symbols``.

    Enough for the fake (and not for a GPU): an ELF header with EM_AMDGPU and the arch's
    EF_AMDGPU_MACH, a string table holding the names, and a section header table that ends
    the file, which is how the fake finds the image's size. ``metadata`` (msgpack bytes, as in
    a real code object) is added as the NT_AMDGPU_METADATA note of a SHT_NOTE section.
    """
    strtab = b"\0" + b"".join(s.encode() + b"\0" for s in symbols)
    strtab += b"\0" * (-len(strtab) % 8)
    note = b""
    if metadata is not None:
        note = struct.pack("<III", 7, len(metadata), 32) + b"AMDGPU\0\0" + metadata
        note += b"\0" * (-len(note) % 8)
    shoff = 64 + len(strtab) + len(note)
    header = bytearray(64)
    header[0:4] = b"\x7fELF"
    header[4:7] = bytes([2, 1, 1])           # ELFCLASS64, little endian, version 1
    header[7] = 64                            # ELFOSABI_AMDGPU_HSA
    struct.pack_into("<HHI", header, 16, 3, 224, 1)                   # ET_DYN, EM_AMDGPU
    struct.pack_into("<QQQ", header, 24, 0, 0, shoff)                 # entry, phoff, shoff
    struct.pack_into("<IHHHHHH", header, 48, AMDGPU_MACH[arch.split(":")[0]], 64, 0, 0,
                     64, 3 if note else 2, 1)                         # flags ... shnum, shstrndx
    null_section = bytes(64)
    strtab_section = struct.pack("<IIQQQQIIQQ", 0, 3, 0, 0, 64, len(strtab), 0, 0, 1, 0)
    note_section = struct.pack("<IIQQQQIIQQ", 0, 7, 0, 0, 64 + len(strtab), len(note), 0, 0, 4, 0) if note else b""
    return bytes(header) + strtab + note + null_section + strtab_section + note_section


_ADD_KERNEL_SOURCE = """\
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)
"""


class CompiledKernel(NamedTuple):
    """A kernel Triton compiled: the image bytes and the facts a launch needs."""

    image: bytes
    symbol: str
    num_warps: int
    shared: int


def triton_add_kernel(backend: str, arch: str | int, warp_size: int, directory: Path,
                      block: int = 1024) -> CompiledKernel:
    """Compile ``out = x + y`` (fp32; args x, y, out, n and Triton's two hidden scratch
    pointers) for one target with the installed Triton, e.g. ``("hip", "gfx942", 64)`` or
    ``("cuda", 90, 32)``. Imports triton, so call it only from tests that may.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # @triton.jit reads the function's source file, so the kernel must live in a real file.
    source = Path(directory) / "aotriton_test_add_kernel.py"
    source.write_text(_ADD_KERNEL_SOURCE)
    spec = importlib.util.spec_from_file_location("aotriton_test_add_kernel", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    src = ASTSource(fn=module.add_kernel,
                    signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32",
                               "BLOCK": "constexpr"},
                    constexprs={"BLOCK": block})
    kernel = triton.compile(src, target=GPUTarget(backend, arch, warp_size))
    image = kernel.asm["hsaco" if backend == "hip" else "cubin"]
    return CompiledKernel(image, kernel.metadata.name, kernel.metadata.num_warps,
                          kernel.metadata.shared)
