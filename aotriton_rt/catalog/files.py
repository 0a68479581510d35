"""Reading and writing the files of an image folder safely: bounded reads of regular files,
canonical JSON, atomic writes, and the one check of a file against its catalog digests
(:func:`check_file`, :func:`check_image`; :func:`check_image_bytes` for bytes already read),
used by the loader, the builder (build, merge, verify, its compile cache) and the bundle
installer and verifier.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import CatalogError, ImageMismatch
from .schema import Image

#: xz decoder memory cap: the builder's preset (9) needs at most a 64 MiB dictionary (it cuts it to the image).
XZ_MEMLIMIT = 256 << 20
_CHUNK = 1 << 20


def canonical_bytes(obj: Any) -> bytes:
    """Compact canonical JSON (sorted keys, no spaces), as shards are written."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def read_bounded(path: Path, limit: int, what: str, hint: str = "it is not a catalog this runtime reads") -> bytes:
    try:
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            # A FIFO would block a read forever and /dev/zero never ends: regular files only.
            if not stat.S_ISREG(st.st_mode):
                raise CatalogError(f"{what} {path} is not a regular file; reinstall the image folder")
            if st.st_size > limit:
                raise CatalogError(f"{what} {path} is {st.st_size} bytes, over the limit of "
                                   f"{limit}; {hint}")
            # At most what fstat said, plus one byte to notice growth: a read of ``limit`` bytes
            # would allocate that much up front however small the file is.
            data = f.read(st.st_size + 1)
    except OSError as e:
        raise CatalogError(f"cannot read {what} {path}: {e.strerror or e}") from e
    if len(data) > min(st.st_size, limit):
        raise CatalogError(f"{what} {path} changed while it was read; reinstall the image folder")
    return data


def open_regular(path: str | os.PathLike) -> Any:
    """Open ``path`` for reading without blocking: a FIFO opens at once (then fails the caller's
    regular-file check) instead of waiting for a writer forever."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    return os.fdopen(fd, "rb", buffering=0)


def parse_json(data: bytes, source: str) -> Any:
    """Parse catalog text: UTF-8 JSON, nested no deeper than Python can recurse; else CatalogError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CatalogError(f"{source}: not UTF-8 text (byte {e.start}); reinstall or rebuild the image "
                           "folder") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CatalogError(f"{source}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise CatalogError(f"{source}: JSON nested too deeply to be a catalog") from None
    except ValueError as e:  # e.g. an integer literal too long to convert
        raise CatalogError(f"{source}: not valid JSON ({e})") from None


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and os.replace."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def check_file(path: Path, size: int, sha256: str, *, keep: bool = True) -> bytes:
    """The bytes of ``path`` after checking that it is a regular file of ``size`` bytes with
    ``sha256``; ``keep=False`` streams the digest and returns ``b""``.

    Reads at most ``size + 1`` bytes of a regular file (never a FIFO or a device), so a hostile
    file costs no more than an honest one of the size the catalog claims.

    Raises:
        ImageMismatch: naming the file and the fix; its ``problem`` says what failed.
    """
    def fail(problem: str, message: str, detail: object = None) -> ImageMismatch:
        return ImageMismatch(message, path=path, problem=problem, detail=detail)

    hasher = hashlib.sha256()
    data = bytearray()
    try:
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise fail("not regular", f"image {path} is not a regular file; reinstall the image folder "
                                          "(`python -m aotriton_rt verify` checks one)")
            if st.st_size != size:
                raise fail("size", f"image {path} is {st.st_size} bytes but the catalog says {size}; it is "
                                   "corrupt or modified. Rebuild or re-download it", st.st_size)
            left = size + 1
            while left > 0 and (chunk := f.read(min(left, _CHUNK) if not keep else left)):
                hasher.update(chunk)
                left -= len(chunk)
                if keep:
                    data += chunk
    except IsADirectoryError:
        raise fail("not regular", f"image {path} is not a regular file; reinstall the image folder "
                                  "(`python -m aotriton_rt verify` checks one)") from None
    except OSError as e:
        raise fail("missing" if isinstance(e, FileNotFoundError) else "unreadable",
                   f"cannot read image {path}: {e.strerror or e}; reinstall the image "
                   "folder (`python -m aotriton_rt verify` checks one)", e.strerror or e) from e
    digest = hasher.hexdigest()
    if size + 1 - left != size or digest != sha256:
        raise fail("sha256", f"image {path} is corrupt: sha256 {digest[:16]}... but the catalog says "
                             f"{sha256[:16]}...; it was not loaded. Rebuild or re-download it")
    return bytes(data)


def check_image(folder: Path, image: Image, *, decompress: bool = True) -> bytes:
    """The one check of an image against its catalog entry: the raw binary (or, with
    ``decompress=False``, the file's bytes) after checking both of its digests.

    The file is read as :func:`check_file` reads it, and at most its ``raw_size`` bytes are
    decompressed (both capped by the schema), so a hostile image costs no more memory or time
    than an honest one of the size it claims.

    Raises:
        ImageMismatch: naming the file and the fix; its ``problem`` says what failed.
    """
    path = folder / image.path
    data = check_file(path, image.size, image.sha256)
    return _unpack(path, image, data) if decompress else data


def check_image_bytes(data: bytes, image: Image, where: Path, *, decompress: bool = True) -> bytes:
    """:func:`check_image` for an image's bytes already read from ``where`` (e.g. one part of a
    builder's compile-cache entry): the same size and digest checks, the same messages."""
    if len(data) != image.size:
        raise ImageMismatch(f"image {where} is {len(data)} bytes but the catalog says {image.size}; it is "
                            "corrupt or modified. Rebuild or re-download it", path=where, problem="size",
                            detail=len(data))
    digest = hashlib.sha256(data).hexdigest()
    if digest != image.sha256:
        raise ImageMismatch(f"image {where} is corrupt: sha256 {digest[:16]}... but the catalog says "
                            f"{image.sha256[:16]}...; it was not loaded. Rebuild or re-download it",
                            path=where, problem="sha256")
    return _unpack(where, image, data) if decompress else data


def _unpack(path: Path, image: Image, data: bytes) -> bytes:
    """The raw binary of ``data`` (the image's stored bytes, digest already checked), after
    checking its size and sha256 against the catalog's ``raw_size``/``raw_sha256``."""
    raw_size = image.raw_size
    if image.compression == "xz":
        try:
            d = lzma.LZMADecompressor(format=lzma.FORMAT_XZ, memlimit=XZ_MEMLIMIT)
            raw = d.decompress(data, max_length=raw_size + 1)
        except lzma.LZMAError as e:
            raise ImageMismatch(f"image {path} does not decompress: {e}", path=path, problem="decompress") from e
        if len(raw) > raw_size or not d.eof or d.unused_data:
            raise ImageMismatch(f"image {path} decompresses to more than the catalog's raw_size of {raw_size} "
                                "bytes (or has trailing data); it was not loaded", path=path, problem="raw_size")
    else:
        raw = data
    if len(raw) != raw_size or hashlib.sha256(raw).hexdigest() != image.raw_sha256:
        raise ImageMismatch(f"image {path} decompresses to bytes whose size or sha256 does not match the "
                            "catalog's raw_size/raw_sha256; it was not loaded", path=path,
                            problem="raw_size" if len(raw) != raw_size else "raw_sha256")
    return raw
