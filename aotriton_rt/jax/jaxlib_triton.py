"""What jaxlib's Triton custom call needs, built from a catalog variant.

jaxlib (``jaxlib.gpu_triton``, from the CUDA or ROCm plugin) launches a compiled Triton kernel
inside an XLA program through the custom call target ``triton_kernel_call_ffi``; its one
attribute ``opaque`` is a zlib-compressed ``TritonKernelCall`` protobuf that jaxlib's own
bindings serialize. Facts this module relies on (jaxlib 0.10.2 and 0.11.2 sources):

* ``TritonKernel(name, num_warps, num_ctas, shared_mem_bytes, binary, ttir, compute_capability
  [, global_scratch_size, global_scratch_align])``: the last two only in jaxlib > 0.11.0.
  ``binary`` is PTX text on CUDA (jaxlib assembles it with ptxas for ``compute_capability``,
  sm_90a features from 9.0 on; it cannot take a cubin), and on ROCm the *path* of an HSACO
  file, which jaxlib reads and then **deletes** on first launch. The launch block is
  ``num_warps * 32`` threads on CUDA and ``num_warps * 64`` on ROCm, so a wave32 HIP variant
  is passed ``num_threads / 64`` "warps".
* Parameters, in kernel order: ``create_array_parameter(bytes_to_zero, ptr_divisibility)``
  consumes the next XLA buffer (operands, then results); ``create_scalar_parameter(value,
  type)`` bakes a scalar in. jaxlib appends the two hidden Triton 3.x pointers (global and
  profile scratch) itself.
* Scalars exist as bool/i32/u32/i64/u64/fp32/fp64; the driver copies each parameter with the
  kernel's own size, so an i8/i16 (u8/u16) scalar passed as i32 (u32) arrives intact on these
  little-endian GPUs.
"""

from __future__ import annotations

import atexit
import os
import stat
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Any

from ..catalog import MAX_PTX, Image, Variant, check_image
from ..errors import ImageError, ImageMismatch, UnsupportedError

#: The custom call target jaxlib registers for CUDA and ROCm.
TARGET = "triton_kernel_call_ffi"
#: Threads per "warp" in jaxlib's launch: block size = num_warps * this.
JAXLIB_WARP = {"cuda": 32, "hip": 64}
_SCALAR_AS = {"i1": "i32", "i8": "i32", "i16": "i32", "u8": "u32", "u16": "u32", "i32": "i32", "u32": "u32",
              "i64": "i64", "u64": "u64", "fp32": "fp32", "fp64": "fp64"}

_ptx_cache: dict[str, str] = {}
_lock = threading.Lock()


def triton_module() -> Any:
    """jaxlib's ``gpu_triton`` bindings, or UnsupportedError saying what is missing."""
    try:
        from jax._src.lib import gpu_triton
    except ImportError as e:
        raise UnsupportedError(f"this jaxlib has no Triton custom call (jax._src.lib.gpu_triton: {e}); install a "
                               "GPU jaxlib: pip install 'jax[cuda13]' (or the ROCm plugin)") from None
    if not hasattr(gpu_triton, "TritonKernelCall"):
        raise UnsupportedError("jaxlib's Triton custom call comes with its GPU plugin, and neither "
                               "jax-cuda13-plugin / jax-cuda12-plugin nor jax-rocm7-plugin is installed; "
                               "install one (pip install 'jax[cuda13]'), or call aotriton_rt eagerly "
                               "(aotriton_rt.attention on JAX arrays, through DLPack)")
    return gpu_triton


def scalar_type(t: str) -> str:
    """The jaxlib scalar type that carries a catalog scalar type."""
    return _SCALAR_AS[t]


def ptx_text(folder: Path, variant: Variant) -> str:
    """The PTX of a CUDA variant, digest-checked (ImageError when absent or damaged)."""
    image = variant.ptx
    if image is None:
        raise ImageError(f"{variant.kernel} {variant.key[:16]} ({variant.target.arch}) has no PTX in its catalog; "
                         "jax.jit needs it: rebuild the images with this version's builder "
                         "(python -m builder build), which keeps the PTX of every CUDA variant")
    hit = _ptx_cache.get(variant.key)
    if hit is not None:
        return hit
    raw = _read_checked(folder, image, variant)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ImageError(f"{folder / image.path}: PTX is not ASCII text") from None
    with _lock:
        _ptx_cache[variant.key] = text
    return text


def _read_checked(folder: Path, image: Image, variant: Variant) -> bytes:
    # The one image check (catalog.check_image): a regular file only (a FIFO fails at once
    # instead of blocking jax.jit), of the catalog's size before a byte is read, sha256, then
    # xz decompressed no further than raw_size. The catalog bounds both sizes by MAX_PTX.
    if image.size > MAX_PTX or image.raw_size > MAX_PTX:
        raise ImageError(f"{folder / image.path}: the catalog gives {max(image.size, image.raw_size)} bytes, "
                         f"over the {MAX_PTX} bytes allowed for one PTX")
    try:
        return check_image(folder, image)
    except ImageMismatch as e:
        raise ImageError(f"the PTX of {variant.kernel} {variant.key[:16]}: {e}") from None


#: Where ``hsaco_file`` writes when ``AOTRITON_RT_JAX_HSACO_DIR`` is not set: (pid, folder).
_private_dir: tuple[int, Path] | None = None
ENV_HSACO_DIR = "AOTRITON_RT_JAX_HSACO_DIR"


def _hsaco_folder() -> Path:
    """A folder only this user can write to, so that nobody can swap the HSACO between our
    write and jaxlib's read: ``$AOTRITON_RT_JAX_HSACO_DIR`` if it is one, else a fresh
    ``mkdtemp`` folder (0700) per process. Never a fixed name in the shared temporary
    directory, which another user could create first (as a link, or open to all)."""
    global _private_dir
    given = os.environ.get(ENV_HSACO_DIR)
    if given:
        folder = Path(given)
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise ImageError(f"{ENV_HSACO_DIR}={given}: cannot create it ({e.strerror or e}); name a folder "
                             "of yours, or unset it") from None
        _check_private(folder, f"{ENV_HSACO_DIR}={given}")
        return folder
    with _lock:
        if _private_dir is None or _private_dir[0] != os.getpid():  # a fork gets its own
            folder = Path(tempfile.mkdtemp(prefix="aotriton-rt-jax-"))
            atexit.register(_remove_if_empty, folder)
            _private_dir = (os.getpid(), folder)
        return _private_dir[1]


def _check_private(folder: Path, what: str) -> None:
    try:
        st = os.lstat(folder)
    except OSError as e:
        raise ImageError(f"{what}: {e.strerror or e}; name a folder of yours, or unset it") from None
    owner = st.st_uid == os.geteuid() if hasattr(os, "geteuid") else True
    if not stat.S_ISDIR(st.st_mode) or not owner or st.st_mode & 0o022:
        raise ImageError(f"{what} is not a private folder (a real folder, not a link, owned by you and "
                         "writable by no one else); the HSACO jaxlib loads is never written where another "
                         "user could replace it. Name such a folder (chmod 700), or unset the variable")


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()  # jaxlib deletes each file it reads; what it never launched stays
    except OSError:
        pass


def hsaco_file(raw: bytes, variant: Variant) -> str:
    """A fresh file holding ``raw`` for jaxlib's ROCm call, which deletes it after reading it.

    Written with an exclusive create in a private folder (see :func:`_hsaco_folder`), then
    read back and compared with ``raw`` (already checked against the catalog's digest), so
    the path handed to jaxlib names exactly the code object the catalog vouches for.
    """
    folder = _hsaco_folder()
    try:
        # mkstemp: O_CREAT | O_EXCL (never through an existing file or link), mode 0600.
        fd, name = tempfile.mkstemp(prefix=f"{variant.kernel}-{variant.key[:16]}-", suffix=".hsaco", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
        with os.fdopen(os.open(name, flags), "rb") as f:
            st = os.fstat(f.fileno())
            back = f.read(len(raw) + 1) if stat.S_ISREG(st.st_mode) else b""
    except OSError as e:
        raise ImageError(f"cannot write the HSACO of {variant.kernel} {variant.key[:16]} for jaxlib in {folder}: "
                         f"{e.strerror or e}; set {ENV_HSACO_DIR} to a private folder with space") from None
    if back != raw:
        raise ImageError(f"{name} changed after it was written; it was not handed to jaxlib")
    return name


def scratch_bytes(variant: Variant, grid: tuple[int, int, int]) -> int:
    """Bytes of global scratch one launch of ``variant`` over ``grid`` needs (0: none)."""
    per_program = variant.scratch["global_size"]
    if not per_program or not variant.hidden_args:
        return 0
    return grid[0] * grid[1] * grid[2] * variant.num_ctas * per_program


def kernel_call(variant: Variant, binary: str, grid: tuple[int, int, int], params: list[tuple]) -> bytes:
    """The ``opaque`` attribute: one zlib-compressed ``TritonKernelCall`` for ``variant``.

    ``params`` are ``("array", bytes_to_zero, divisibility)`` or ``("scalar", value, type)``
    in kernel order; for a variant with global scratch, the last is its scratch array.
    """
    lib = triton_module()
    backend = variant.target.backend
    warp = JAXLIB_WARP[backend]
    if variant.num_threads % warp:
        raise UnsupportedError(f"{variant.kernel} ({variant.target.arch}) runs {variant.num_threads} threads per "
                               f"block, which jaxlib's {backend} Triton call cannot launch (it launches "
                               f"multiples of {warp}); use the eager path")
    cc = int(variant.target.arch[2:]) if backend == "cuda" else 0
    # Global scratch (e.g. device-side TMA descriptors) is never left to jaxlib: it would
    # cuMemAllocAsync/cuMemFreeAsync it around every launch, and memory nodes cannot live in
    # the child graph XLA's command buffers (CUDA graphs) capture a custom call into
    # (CUDA_ERROR_NOT_SUPPORTED). The caller passes the scratch as one more XLA buffer instead.
    kernel = lib.TritonKernel(variant.symbol, variant.num_threads // warp, variant.num_ctas, variant.shared,
                              binary, "", cc)
    made = []
    for p in params:
        if p[0] == "array":
            made.append(lib.create_array_parameter(p[1], p[2]))
        else:
            made.append(lib.create_scalar_parameter(p[1], p[2]))
    call = lib.TritonKernelCall(kernel, grid[0], grid[1], grid[2], made)
    return zlib.compress(call.to_proto(variant.symbol, b""))
