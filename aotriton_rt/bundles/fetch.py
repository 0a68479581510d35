"""Fetching bundles over HTTPS: ``download()``, with resume, retries and a deadline.

Needs the optional extra ``pip install aotriton-rt[download]`` (requests, platformdirs,
filelock, tqdm); each is imported on first use.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from .. import __version__
from ..errors import AotritonError, BundleError, DownloadError, shown
from .format import (
    CHUNK,
    DEFAULT_MAX_UNPACKED,
    INDEX_FILE,
    MAX_JSON,
    images_root,
    parse_index,
    select_bundles,
)
from .install import (
    InstalledBundle,
    bundle_cap,
    bundle_lock,
    install_bundle,
    installed_intact,
    need_optional,
    remove_path,
    reset_staging,
)

ENV_URL = "AOTRITON_RT_URL"
#: Where ``download`` looks when neither ``url`` nor ``$AOTRITON_RT_URL`` is given; a release
#: sets it to its published folder.
DEFAULT_URL: str | None = None
#: Seconds a whole ``download`` call may take, however steadily a server trickles bytes.
DEFAULT_DEADLINE = 3600.0
#: The longest ``timeout`` or ``deadline`` accepted, in seconds (a week): larger values, ``inf``
#: and ``nan`` are refused up front rather than overflowing a clock deep in the network stack.
MAX_SECONDS = 7 * 24 * 3600
#: The longest URL accepted (HTTP servers commonly stop at 8 KiB of request line).
MAX_URL_CHARS = 8192
_MAX_BACKOFF = 30.0
# 425/429/5xx are the statuses a server uses for "try again later"; other 4xx will not change.
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class _Net:
    timeout: float
    retries: int
    backoff: float
    allow_http: bool
    progress: bool
    #: time.monotonic() after which the whole download gives up, however steadily bytes trickle.
    deadline: float = float("inf")
    seconds: float = 0.0  # the deadline as the user gave it, for messages

    def check_deadline(self, url: str) -> None:
        if time.monotonic() > self.deadline:
            raise DownloadError(f"{url}: not finished within the deadline of {self.seconds:g} s; the server "
                                "is too slow. Try again later, or raise --deadline")


class _Transient(Exception):
    """A failure worth retrying: connection trouble, a timeout, 5xx, a short body."""


def check_url(url: str) -> str:
    """``url`` if it is one line of at most :data:`MAX_URL_CHARS` that names a host, else DownloadError."""
    def bad(why: str) -> DownloadError:
        return DownloadError(f"invalid URL {shown(url)}: {why}; pass --url as https://host/folder/")

    if not isinstance(url, str):
        raise bad("not a string")
    if len(url) > MAX_URL_CHARS:
        raise bad(f"longer than {MAX_URL_CHARS} characters")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise bad("it holds a space or control character (percent-encode it)")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parses the port: ValueError when out of range or not a number
    except ValueError as e:
        raise bad(str(e)) from None
    if parts.scheme.lower() in ("http", "https") and not parts.hostname:
        raise bad("it names no host")
    return url


def _check_scheme(url: str, allow_http: bool) -> None:
    scheme = urlsplit(url).scheme.lower()
    if scheme == "https" or (scheme == "http" and allow_http):
        return
    if scheme == "http":
        raise DownloadError(f"refusing plain HTTP for {shown(url)}: the index that vouches for every "
                            "digest would travel unauthenticated; use https://, or pass "
                            "--allow-http (allow_http=True) on a network you trust")
    raise DownloadError(f"unsupported URL {shown(url)}: use https:// (http:// with --allow-http); "
                        "for a bundle file on disk use --from-file")


def _resolve_url(url: str | None, allow_http: bool) -> tuple[str, str]:
    """(base URL ending in '/', index URL) from a folder URL or a URL of index.json itself."""
    url = url or os.environ.get(ENV_URL) or DEFAULT_URL
    if not url:
        raise DownloadError(f"no download URL: pass --url BASE (the folder holding {INDEX_FILE}) "
                            f"or set {ENV_URL}; for a bundle file on disk use --from-file")
    _check_scheme(check_url(url), allow_http)
    if urlsplit(url).path.endswith(".json"):
        return url.rsplit("/", 1)[0] + "/", url
    base = url.rstrip("/") + "/"
    return base, base + INDEX_FILE


def _session() -> Any:
    requests = need_optional("requests")
    session = requests.Session()
    session.headers["User-Agent"] = f"aotriton-rt/{__version__}"
    # Byte ranges and the digest must refer to the stored bytes, never a re-encoded stream.
    session.headers["Accept-Encoding"] = "identity"
    return session


@contextmanager
def _get(session: Any, url: str, net: _Net, headers: dict[str, str]) -> Iterator[Any]:
    """A streaming GET whose connection failures, also those while reading, become _Transient."""
    requests, urllib3 = sys.modules["requests"], importlib.import_module("urllib3")
    try:
        with session.get(url, headers=headers, stream=True,
                         timeout=(net.timeout, net.timeout)) as r:
            _check_scheme(r.url, net.allow_http)  # a redirect must not downgrade https
            yield r
    except requests.Timeout as e:
        raise _Transient(f"timed out (no answer for {net.timeout:g} s)") from e
    except (requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError) as e:
        raise _Transient("the connection broke mid-transfer") from e
    except (requests.ConnectionError, urllib3.exceptions.HTTPError) as e:
        text = str(e)
        # urllib3 reports a read timeout in the middle of a body as a connection error.
        if "timed out" in text.lower():
            raise _Transient(f"timed out (no data for {net.timeout:g} s)") from e
        raise _Transient(f"connection failed: {text}") from e
    except requests.RequestException as e:
        raise DownloadError(f"{url}: {e}") from e


def _body(r: Any, url: str, net: _Net) -> Iterator[bytes]:
    # Raw reads rather than iter_content: when a connection breaks mid-chunk, urllib3 2
    # discards the bytes it had buffered for that chunk, and those are what a resume keeps.
    # read1 returns what has arrived (read() would wait for a whole chunk, which a server
    # trickling a byte a second makes last for days), so the deadline is checked between reads.
    # decode_content=False: the digest is over the stored bytes, whatever a server claims.
    read = getattr(r.raw, "read1", None) or r.raw.read
    while True:
        net.check_deadline(url)
        chunk = read(CHUNK, decode_content=False)
        if not chunk:
            return
        yield chunk


def _status_error(r: Any, url: str) -> None:
    text = f"HTTP {r.status_code} {r.reason or ''}".rstrip()
    if r.status_code in _RETRY_STATUS:
        raise _Transient(f"{url}: {text}")
    hint = (f"; check --url: it must be the folder holding {INDEX_FILE}"
            if r.status_code in (401, 403, 404, 410) else "")
    raise DownloadError(f"{url}: {text}{hint}")


def _retrying(url: str, net: _Net, attempt: Callable[[], Any], progress: Callable[[], int]) -> Any:
    """Run ``attempt`` until it returns, retrying _Transient failures with exponential backoff.

    An attempt that moved ``progress`` forward (bytes kept for resuming) resets the count, so
    a connection that keeps dropping still finishes as long as every try gains ground.
    """
    failures = 0
    best = progress()
    while True:
        net.check_deadline(url)
        try:
            return attempt()
        except _Transient as e:
            # Only bytes beyond the most ever held count as progress: a server that cuts every
            # attempt short and then refuses the resume (416, another range) makes a restart
            # from 0 regain the same bytes over and over, which must not reset the count.
            if progress() > best:
                best, failures = progress(), 0
            else:
                failures += 1
            if failures > net.retries:
                raise DownloadError(f"{url}: gave up after {failures} failed attempts in a row; "
                                    f"last: {e}. Check the connection, or raise --retries / "
                                    "--timeout") from e
            if failures:
                pause = min(net.backoff * 2 ** (failures - 1), _MAX_BACKOFF)
                time.sleep(max(0.0, min(pause, net.deadline - time.monotonic())))


def _fetch_bytes(session: Any, url: str, net: _Net, limit: int) -> bytes:
    def attempt() -> bytes:
        with _get(session, url, net, {}) as r:
            if r.status_code != 200:
                _status_error(r, url)
            body = bytearray()
            for chunk in _body(r, url, net):
                body += chunk
                if len(body) > limit:
                    raise DownloadError(f"{url}: more than {limit} bytes; not a bundle index")
            return bytes(body)

    return _retrying(url, net, attempt, lambda: 0)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(enabled: bool, total: int, initial: int, label: str) -> Any:
    if not enabled:
        return _NoBar()
    tqdm = need_optional("tqdm")
    return tqdm.tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,
                     desc=label, file=sys.stderr)


class _Partial:
    """The ``.part`` file being downloaded, with the digest of the bytes it holds so far.

    A ``.part`` left in the staging folder is resumed only if it is a regular file of ours (not
    a link, FIFO or folder someone planted there), and it is opened with ``O_NOFOLLOW``, so a
    download never reads from or appends to any other file.
    """

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size = path, size
        self.hasher, self.have = hashlib.sha256(), 0
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise DownloadError(f"cannot read the partial download {path}: {e.strerror or e}") from None
        if not _ours(st) or st.st_size > size:
            remove_path(path)
            return
        with _open_part(path, append=False) as f:
            while chunk := f.read(CHUNK):
                self.hasher.update(chunk)
                self.have += len(chunk)

    def restart(self) -> None:
        remove_path(self.path)
        self.hasher, self.have = hashlib.sha256(), 0

    def append(self) -> Any:
        return _open_part(self.path, append=True)


def _ours(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and (not hasattr(os, "geteuid") or st.st_uid == os.geteuid())


def _open_part(path: Path, *, append: bool) -> Any:
    """Open a ``.part`` file without following a link or blocking on a FIFO; DownloadError
    unless it is a regular file of ours."""
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT if append else os.O_RDONLY) | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        raise DownloadError(f"cannot open the partial download {path}: {e.strerror or e}; something else "
                            "is at that path of the staging folder (remove it), or the folder is not "
                            "writable") from None
    if not _ours(os.fstat(fd)):
        os.close(fd)
        raise DownloadError(f"the partial download {path} was replaced by something other than a regular file "
                            "of yours while it was being written; nothing was installed")
    return os.fdopen(fd, "ab" if append else "rb")


def _range_start(value: str | None) -> int | None:
    m = re.match(r"^\s*bytes\s+(\d+)-\d+/(?:\d+|\*)\s*$", value or "")
    return int(m.group(1)) if m else None


def _fetch_rest(session: Any, url: str, st: _Partial, net: _Net, bar: Any) -> None:
    headers = {"Range": f"bytes={st.have}-"} if st.have else {}
    over = False
    with _get(session, url, net, headers) as r:
        if r.status_code == 416:  # the server's file is shorter than what we hold
            st.restart()
            bar.reset()
            raise _Transient(f"{url}: the server refused to resume; starting over")
        if r.status_code not in (200, 206):
            _status_error(r, url)
        if r.status_code == 206 and _range_start(r.headers.get("Content-Range")) != st.have:
            st.restart()
            bar.reset()
            raise _Transient(f"{url}: the server sent another range than asked; starting over")
        if r.status_code == 200 and st.have:  # the server ignores Range: take it from the top
            st.restart()
            bar.reset()
        with st.append() as f:
            for chunk in _body(r, url, net):
                if st.have + len(chunk) > st.size:
                    over = True
                    break
                f.write(chunk)
                st.hasher.update(chunk)
                st.have += len(chunk)
                bar.update(len(chunk))
    if over:
        st.restart()
        raise DownloadError(f"{url}: the server sent more than the {st.size} bytes the index "
                            "lists; nothing was installed")
    if st.have < st.size:
        raise _Transient(f"connection closed after {st.have} of {st.size} bytes")


def _fetch_file(session: Any, url: str, part: Path, size: int, sha256: str, net: _Net,
                label: str) -> None:
    st = _Partial(part, size)
    bar = _progress_bar(net.progress, size, st.have, label)
    try:
        _retrying(url, net, lambda: _fetch_rest(session, url, st, net, bar) if st.have < size
                  else None, lambda: st.have)
    finally:
        bar.close()
    got = st.hasher.hexdigest()
    if got != sha256:
        remove_path(part)
        raise DownloadError(f"{url}: the download has sha256 {got[:16]}..., the index says "
                            f"{sha256[:16]}...; it is corrupt or was replaced on the server. "
                            "Nothing was installed; run the command again")


def _install_from_url(session: Any, entry: dict, url: str, root: Path, net: _Net, *,
                      keep_partial: bool, cap: int, lock_timeout: float, force: bool = False) -> InstalledBundle:
    name, sha256 = entry["name"], entry["sha256"]
    # A bundle is its files plus tar headers (512 bytes each, padded): never more than this.
    if entry["size"] > bundle_cap(cap):
        raise BundleError(f"{url}: the index lists {entry['size']} bytes for bundle {name}, over the limit of "
                          f"{bundle_cap(cap)} for max_unpacked_bytes={cap}; refused before downloading")
    with bundle_lock(root, name, lock_timeout) as staging:
        if not force and installed_intact(root / name, sha256):
            remove_path(staging)  # whatever a killed installer left there is of no use now
            return InstalledBundle(name, root / name, sha256, tuple(entry["targets"]),
                                   "already installed")
        part_name = f"{sha256[:16]}.part"
        reset_staging(staging, keep=part_name)
        part = staging / part_name
        kept = False
        try:
            try:
                _fetch_file(session, url, part, entry["size"], sha256, net, name)
            except BaseException:
                kept = keep_partial and part.exists()
                raise
            return install_bundle(part, root, staging, expect_name=name, sha256=sha256, source=url,
                            cap=cap)
        finally:
            if not kept:
                remove_path(staging)


def _wanted(arch: str | Sequence[str], detect: Callable[[], list[str]] | None) -> list[str]:
    items = [a.strip() for a in (arch.split(",") if isinstance(arch, str) else arch) if a.strip()]
    lowered = [a.lower() for a in items]
    if not items:
        raise DownloadError("no target given: pass --arch auto or a list such as --arch gfx942,sm90")
    if "auto" not in lowered:
        return items
    if lowered != ["auto"]:
        raise DownloadError("--arch auto cannot be combined with named targets")
    reason = ""
    try:
        if detect is None:
            from ..arch import detect_targets as detect
        found = list(detect())
    except (AotritonError, ImportError) as e:
        found, reason = [], f" ({e})"
    if not found:
        raise DownloadError(f"--arch auto found no GPU on this machine{reason}; name the targets "
                            "to fetch instead, e.g. --arch gfx942 or --arch sm90,gfx1100")
    return found


def download(arch: str | Sequence[str] = "auto", *, url: str | None = None,
             dest: str | os.PathLike | None = None, allow_http: bool = False,
             timeout: float = 30.0, retries: int = 4, backoff: float = 0.5,
             progress: bool | None = None, keep_partial: bool = False,
             max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED, lock_timeout: float = 600.0,
             detect: Callable[[], list[str]] | None = None, deadline: float = DEFAULT_DEADLINE,
             force: bool = False) -> list[InstalledBundle]:
    """Download and install the bundles for ``arch``; afterwards no network is needed.

    Args:
        arch: ``"auto"`` (the GPUs of this machine), or archs / bundle names as a comma string
            or a sequence: ``"gfx942,sm90"``.
        url: the published folder holding ``index.json`` (or the index's URL); default
            ``$AOTRITON_RT_URL``, then :data:`DEFAULT_URL`.
        dest: the images root (default :func:`images_root`).
        allow_http: accept ``http://``; only https is accepted otherwise.
        timeout: seconds to connect, and seconds without data before a read gives up.
        deadline: seconds the whole call may take (index and every bundle) before it gives up,
            however steadily a slow server sends.
        retries: failed attempts in a row allowed per file before giving up.
        backoff: first pause between attempts; it doubles per failure (capped at 30 s).
        progress: show a progress bar; default when stderr is a terminal.
        keep_partial: keep a failed download's partial file so that the next call resumes it;
            by default nothing partial is left behind.
        max_unpacked_bytes: refuse bundles that unpack to more than this.
        lock_timeout: seconds to wait for another installer of the same bundle.
        detect: for ``"auto"``, the function listing this machine's archs (default
            :func:`aotriton_rt.arch.detect_targets`).
        force: install even when the same bundle is already installed (repairs an install
            that fails :func:`verify`; one that fails it is repaired without ``force`` too).

    Returns one :class:`InstalledBundle` per bundle. Raises DownloadError (network, HTTP,
    digest, no bundle for a target), BundleError (malformed or hostile index or bundle) or
    CatalogError (a catalog schema this runtime cannot read); the previous install stays as it
    was in every case.

    Example::

        download("gfx942", url="https://example.org/aotriton-rt/0.1.0/")
    """
    wanted = _wanted(arch, detect)
    base, index_url = _resolve_url(url, allow_http)
    if progress is None:  # a bar only for a person at a terminal, and only if tqdm is there
        progress = (sys.stderr is not None and sys.stderr.isatty()
                    and importlib.util.find_spec("tqdm") is not None)
    try:
        ok = 0 < timeout <= deadline <= MAX_SECONDS and retries >= 0 and backoff >= 0
    except TypeError:  # a value that is not a number
        ok = False
    if not ok:
        raise DownloadError(f"need 0 < timeout <= deadline <= {MAX_SECONDS} (seconds), retries >= 0 and "
                            f"backoff >= 0; got timeout={shown(timeout)}, deadline={shown(deadline)}, "
                            f"retries={shown(retries)}, backoff={shown(backoff)}")
    net = _Net(timeout, retries, backoff, allow_http, progress, time.monotonic() + deadline, deadline)
    root = images_root(dest)
    with _session() as session:
        index = parse_index(_fetch_bytes(session, index_url, net, MAX_JSON), index_url)
        return [_install_from_url(session, entry, base + quote(entry["file"]), root, net,
                                  keep_partial=keep_partial, cap=max_unpacked_bytes,
                                  lock_timeout=lock_timeout, force=force)
                for entry in select_bundles(index, wanted, source=index_url)]
