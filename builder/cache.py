"""The compile cache: compiled variants by key, in a folder that several builders may share.

``python -m builder build --cache DIR`` (or ``AOTRITON_BUILDER_CACHE=DIR``) looks up every variant
it would compile here first, and stores every variant it compiles. The key is the variant's own
(:func:`builder.registry.expand`: kernel source, signature, constexprs, options, target, Triton
version...), so an entry is only ever read for the variant it was compiled for, by any builder
on any machine. Entries live in a namespace named after the builder's own compile code
(:data:`NAMESPACE_SOURCES`): a builder that compiles, compresses or lays out variants
differently never reads another's entries.

An entry is one file, ``DIR/<namespace>/<key[:2]>/<key>``: :data:`MAGIC`, the variant's catalog
entry as one line of canonical JSON, then its xz image, then (CUDA) its xz PTX. This module is
the only reader and writer of that format.

The folder is untrusted shared storage, read the way the runtime reads an image folder:

- no symbolic link below ``DIR`` is followed: every file and folder is opened ``O_NOFOLLOW``
  relative to its parent's descriptor (a link where an entry or folder should be is discarded);
- every read is bounded: an entry is a regular file of at most :data:`MAX_ENTRY_BYTES`, its JSON
  line at most :data:`MAX_VARIANT_JSON`, and its size must be exactly what its variant declares;
- the variant is parsed by the catalog's own bounded parsers (:func:`aotriton_rt.catalog.parse_json`,
  :meth:`aotriton_rt.catalog.Variant.from_json`) and must be the job asked for (key, kernel,
  target, spec, config, grid, checks, Triton version, image paths); the image and PTX must match
  their digests (:func:`aotriton_rt.catalog.check_image_bytes`), and the image must pass the ABI
  proof; nothing from an entry is executed;
- an entry that fails any check is reported, compiled again and replaced;
- entries are written to a temporary file beside their place and renamed into it, so a reader
  sees a whole entry or none, and concurrent builders storing the same key do no harm.

The digests detect corruption, not a writer who means harm: whoever can write to the folder can
store a binary that passes every check. Give write access only to builders you trust, as for a
shared ccache or sccache folder.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from aotriton_rt.catalog import (
    IMAGE_FORMATS,
    SCHEMA_VERSION,
    Variant,
    canonical_bytes,
    check_image_bytes,
    image_path,
    parse_json,
)
from aotriton_rt.catalog.schema import MAX_IMAGE_BYTES, MAX_PTX
from aotriton_rt.errors import CatalogError, ImageMismatch

from .registry import Job

#: The environment variable naming the cache folder when ``--cache`` is not given.
ENV = "AOTRITON_BUILDER_CACHE"
MAGIC = b"aotriton-rt.compile-cache 1\n"
#: One variant's catalog entry as JSON; real ones are a few KB.
MAX_VARIANT_JSON = 1 << 20
#: A whole entry: its JSON line and the largest image and PTX the catalog schema allows.
MAX_ENTRY_BYTES = len(MAGIC) + MAX_VARIANT_JSON + MAX_IMAGE_BYTES + MAX_PTX
#: The builder's files whose code decides a variant's bytes beyond its key (how it is compiled,
#: compressed and laid out): their digest names the namespace entries are stored in.
NAMESPACE_SOURCES = ("compile.py", "abi.py", "targets.py")

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_WRITE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                | getattr(os, "O_CLOEXEC", 0))


class CacheError(Exception):
    """The cache folder cannot be used at all (it cannot be created, or this system cannot open
    files without following links)."""


class BadEntry(Exception):
    """An entry that is not a valid entry for the job asked for; ``path`` and the message say why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


@dataclass(frozen=True)
class Hit:
    """A variant read from the cache: its catalog entry and its files' bytes, all checked."""

    variant: Variant
    image: bytes
    ptx: bytes | None


def namespace() -> str:
    """The folder, inside the cache, of this builder's entries: the entry format, the catalog
    schema and a digest of :data:`NAMESPACE_SOURCES`."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in NAMESPACE_SOURCES:
        digest.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    return f"v1-schema{SCHEMA_VERSION}-{digest.hexdigest()[:16]}"


class CompileCache:
    """The compile cache in the folder ``root`` (created if missing), for builds with Triton
    ``triton_version``. :meth:`get` a job's variant, :meth:`put` one just compiled."""

    def __init__(self, root: Path, triton_version: str) -> None:
        if not (getattr(os, "O_NOFOLLOW", 0) and os.open in os.supports_dir_fd):
            raise CacheError("the compile cache needs a system that opens files without following links "
                             "(O_NOFOLLOW and dir_fd): Linux or macOS")
        self.root = Path(root)
        self.triton_version = triton_version
        self.namespace = namespace()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"cannot create the compile cache folder {self.root}: {e.strerror or e}") from e

    def path(self, key: str) -> Path:
        """Where the entry of ``key`` is (for messages; every access goes through descriptors)."""
        return self.root / self.namespace / key[:2] / key

    # ------------------------------------------------------------------ reading

    def get(self, job: Job) -> Hit | None:
        """The cached variant of ``job``, checked; None when there is none.

        Raises:
            BadEntry: an entry is there but is not a valid entry for ``job`` (it is left for
                :meth:`put` to replace).
        """
        where = self.path(job.key)
        try:
            folder = self._folder(job.key, create=False)
        except OSError as e:  # e.g. a folder this user may not read
            raise BadEntry(where.parent, f"cannot be opened: {e.strerror or e}") from None
        if folder is None:
            return None
        try:
            data = _read_entry(folder, job.key, where)
        finally:
            os.close(folder)
        if data is None:
            return None
        return _parse(data, job, self.triton_version, where)

    # ------------------------------------------------------------------ writing

    def put(self, job: Job, variant: Variant, image: bytes, ptx: bytes | None) -> None:
        """Store ``job``'s freshly compiled variant, replacing whatever is at its place.

        Raises:
            OSError: the entry cannot be written (the build goes on without storing it).
        """
        data = MAGIC + canonical_bytes(variant.to_json()) + image + (ptx or b"")
        folder = self._folder(job.key, create=True)
        tmp = f".{job.key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, _WRITE_FLAGS, 0o644, dir_fd=folder)
            try:
                with os.fdopen(fd, "wb", closefd=False) as f:
                    f.write(data)
            finally:
                os.close(fd)
            # rename (not replace): the one that takes dir_fd; on POSIX both replace the target.
            os.rename(tmp, job.key, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=folder)
            except OSError:
                pass
            raise
        finally:
            os.close(folder)

    # ------------------------------------------------------------------ folders

    def _folder(self, key: str, *, create: bool) -> int | None:
        """A descriptor of ``<namespace>/<key[:2]>``, opened without following links; None when
        it does not exist (and ``create`` is false). A link or file in a folder's place is
        removed when ``create`` is true, refused otherwise."""
        root = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            ns = _subfolder(root, self.namespace, create, self.root / self.namespace)
            if ns is None:
                return None
            try:
                return _subfolder(ns, key[:2], create, self.root / self.namespace / key[:2])
            finally:
                os.close(ns)
        finally:
            os.close(root)


def _subfolder(parent: int, name: str, create: bool, where: Path) -> int | None:
    for _ in range(2):
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:
                pass  # another builder made it meanwhile
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                raise
            # A symbolic link or a file where a folder belongs: never followed.
            if not create:
                raise BadEntry(where, "not a folder (a symbolic link or a file); it was not followed") from None
            os.unlink(name, dir_fd=parent)
    return os.open(name, _DIR_FLAGS, dir_fd=parent)


def _read_entry(folder: int, key: str, where: Path) -> bytes | None:
    """The bytes of the entry file, or None when there is none; bounded, never through a link."""
    try:
        fd = os.open(key, _READ_FLAGS, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise BadEntry(where, "a symbolic link; it was not followed") from None
        raise BadEntry(where, f"cannot be read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadEntry(where, "not a regular file")
        if st.st_size > MAX_ENTRY_BYTES:
            raise BadEntry(where, f"{st.st_size} bytes, over the limit of {MAX_ENTRY_BYTES}")
        chunks, left = [], st.st_size + 1  # one byte more notices a file that grows while read
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise BadEntry(where, f"cannot be read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) != st.st_size:
        raise BadEntry(where, "changed while it was read")
    return data


def _parse(data: bytes, job: Job, triton_version: str, where: Path) -> Hit:
    if not data.startswith(MAGIC):
        raise BadEntry(where, "not a compile-cache entry (wrong header)")
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + MAX_VARIANT_JSON + 1)
    if end < 0:
        raise BadEntry(where, f"no variant line of at most {MAX_VARIANT_JSON} bytes")
    try:
        variant = Variant.from_json(parse_json(data[len(MAGIC):end], f"compile-cache entry {where}"), "$",
                                    f"compile-cache entry {where}")
    except CatalogError as e:
        raise BadEntry(where, f"its variant is not a valid catalog entry ({e})") from None
    wrong = _mismatch(variant, job, triton_version)
    if wrong:
        raise BadEntry(where, f"it holds another variant than {job.label} ({wrong} differs)")
    body = data[end + 1:]
    image_size = variant.image.size
    ptx_size = variant.ptx.size if variant.ptx is not None else 0
    if len(body) != image_size + ptx_size:
        raise BadEntry(where, f"its files are {len(body)} bytes, but its variant says {image_size + ptx_size}")
    image, ptx = body[:image_size], body[image_size:] if variant.ptx is not None else None
    try:
        raw = check_image_bytes(image, variant.image, where)
        if variant.ptx is not None:
            check_image_bytes(ptx, variant.ptx, where)
    except ImageMismatch as e:
        raise BadEntry(where, f"its {e.problem} does not match its variant") from None
    from .abi import AbiError, prove

    try:
        prove(variant, raw)
    except AbiError as e:
        raise BadEntry(where, f"its variant does not match its binary ({e})") from None
    return Hit(variant, image, ptx)


def _mismatch(v: Variant, job: Job, triton_version: str) -> str | None:
    """The first field in which ``v`` is not what compiling ``job`` records, or None."""
    from .compile import config_of

    fmt = IMAGE_FORMATS.get(job.target.backend, "")
    ptx = image_path(job.target, job.kernel, job.key, "ptx") if job.target.backend == "cuda" else None
    for name, got, want in (
            ("key", v.key, job.key), ("kernel", v.kernel, job.kernel), ("target", v.target, job.target),
            ("spec", v.spec, dict(job.spec)), ("config", v.config, config_of(job)), ("grid", v.grid, tuple(job.grid)),
            ("checks", v.checks, tuple(job.checks)), ("triton_version", v.triton_version, triton_version),
            ("image.path", v.image.path, image_path(job.target, job.kernel, job.key, fmt)),
            ("ptx.path", v.ptx.path if v.ptx is not None else None, ptx)):
        if got != want:
            return name
    return None
