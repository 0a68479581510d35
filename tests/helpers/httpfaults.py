"""Test helpers for NOIMAGE mode: a synthetic image folder and a fault-injecting HTTP server.

``FaultServer(root)`` serves the files of ``root`` on 127.0.0.1 at ``/<fault>/<name>``. The
index and other files are always served faithfully; bundles (``*.tar``) get the fault named
by the first path segment:

========== ==============================================================================
ok         served as stored, with HTTP Range support
norange    the Range header is ignored: always 200 with the whole file
truncate   Content-Length of the whole file, but only the first half is sent (every time)
drop       the first request gets part of the body, then the connection drops; later
           requests are served normally (with Range), so a resume succeeds
missing    404
flaky      500 for the first ``flaky_failures`` requests, then served normally
broken     500 every time
corrupt    one byte flipped in the middle, same length (wrong digest)
slow       nothing is sent for ``delay`` seconds (longer than the client's timeout)
oversize   1 KiB of extra bytes after the file
resume416  every request from the top is cut short; every Range request is answered 416
wrongrange every request from the top is cut short; a Range request gets 206 from byte 0
trickle    the body is sent one byte per ``trickle`` seconds (each read gets data in time)
========== ==============================================================================

Every request is logged as a :class:`Hit`, so tests can assert what the client asked for.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import random
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

FAULTS = ("ok", "norange", "truncate", "drop", "missing", "flaky", "broken", "corrupt", "slow",
          "oversize", "resume416", "wrongrange", "trickle")

TARGETS = (("hip", "gfx942", 64), ("hip", "gfx90a", 64), ("hip", "gfx1100", 32),
           ("cuda", "sm90", 32))


def make_variant(kernel: str, backend: str, arch: str, warp: int, xz: bytes, raw: bytes,
                 seed: int) -> dict:
    """A catalog variant (schema_version 1) whose image is ``xz`` (the compressed ``raw``)."""
    key = hashlib.sha256(f"{kernel}/{backend}/{arch}/{seed}".encode()).hexdigest()
    fmt = "cubin" if backend == "cuda" else "hsaco"
    return {
        "key": key, "kernel": kernel, "symbol": f"{kernel}_kernel",
        "target": {"backend": backend, "arch": arch, "warp_size": warp},
        "spec": {"dtype": "fp32"},
        "config": {"index": 0, "constexprs": {"BLOCK": 1024}, "num_warps": 4, "num_stages": 3,
                   "options": {}},
        "args": [{"name": "x_ptr", "type": "*fp32", "offset": 0, "size": 8, "align": 8,
                  "divisibility": 16},
                 {"name": "n", "type": "i32", "offset": 8, "size": 4, "align": 4}],
        "hidden_args": [{"name": "global_scratch", "type": "*i8", "offset": 16, "size": 8,
                         "align": 8},
                        {"name": "profile_scratch", "type": "*i8", "offset": 24, "size": 8,
                         "align": 8}],
        "param_size": 32,
        "scratch": {"global_size": 0, "global_align": 1, "profile_size": 0, "profile_align": 1},
        "num_warps": 4, "num_ctas": 1, "cluster_dims": [1, 1, 1], "shared": 0,
        "launch": {"cooperative": False, "pdl": False},
        "grid": ["cdiv(n, BLOCK)", "1", "1"],
        "image": {"path": f"{backend}/{arch}/{kernel}/{kernel}-{key[:16]}.{fmt}.xz",
                  "format": fmt, "compression": "xz",
                  "sha256": hashlib.sha256(xz).hexdigest(), "size": len(xz),
                  "raw_sha256": hashlib.sha256(raw).hexdigest(), "raw_size": len(raw)},
        "triton_version": "3.6.0",
    }


def make_image_folder(root: Path, *, targets=TARGETS, kernels=("add", "softmax"), seed: int = 0,
                      raw_size: int = 6000, ptx: bool = False) -> Path:
    """Write an image folder: random 'binaries' xz-compressed, with a catalog of their digests.

    ``seed`` changes every image, which makes a second, different release of the same bundles;
    ``ptx`` gives each CUDA variant a PTX text beside its image, as the builder keeps for JAX.
    """
    rng = random.Random(seed)
    variants = []
    for backend, arch, warp in targets:
        for kernel in kernels:
            # Half random, half repeated: compressible like a real binary, distinct per variant.
            raw = rng.randbytes(raw_size // 2) + bytes(raw_size - raw_size // 2)
            xz = lzma.compress(raw, format=lzma.FORMAT_XZ)
            v = make_variant(kernel, backend, arch, warp, xz, raw, seed)
            path = root.joinpath(*v["image"]["path"].split("/"))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(xz)
            if ptx and backend == "cuda":
                text = f"// {kernel} {arch} {seed}\n.version 8.0\n.target sm_90\n".encode() * 40
                packed = lzma.compress(text, format=lzma.FORMAT_XZ)
                v["ptx"] = {"path": v["image"]["path"].replace(".cubin.xz", ".ptx.xz"), "format": "ptx",
                            "compression": "xz", "sha256": hashlib.sha256(packed).hexdigest(),
                            "size": len(packed), "raw_sha256": hashlib.sha256(text).hexdigest(),
                            "raw_size": len(text)}
                root.joinpath(*v["ptx"]["path"].split("/")).write_bytes(packed)
            variants.append(v)
    catalog = {"schema": "aotriton-rt.catalog", "schema_version": 2, "triton_version": "3.6.0",
               "tuning": {}, "variants": variants}
    root.mkdir(parents=True, exist_ok=True)
    (root / "catalog.json").write_text(json.dumps(catalog, indent=1), encoding="utf-8")
    return root


@dataclass(frozen=True)
class Hit:
    """One request the server answered."""

    fault: str
    name: str
    range: str | None
    status: int


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: FaultServer

    def handle_error(self, request, client_address) -> None:
        # A client that timed out and hung up makes the handler's write fail: expected here.
        pass


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:
        fs = self.server.owner
        fault, _, name = self.path.lstrip("/").partition("/")
        name = unquote(name)
        asked = self.headers.get("Range")
        with fs.lock:
            previous = sum(1 for h in fs.log if h.fault == fault and h.name == name)
        path = fs.root / name
        if fault not in FAULTS or ".." in name.split("/") or not path.is_file():
            return self._reply(fs, fault, name, asked, 404)
        data = path.read_bytes()
        if not name.endswith(".tar"):
            fault_here = "ok"
        else:
            fault_here = fault
        if fault_here == "missing" or fault_here == "broken" or (
                fault_here == "flaky" and previous < fs.flaky_failures):
            return self._reply(fs, fault, name, asked, 404 if fault_here == "missing" else 500)
        if fault_here == "slow":
            fs.stop.wait(fs.delay)
        if fault_here == "corrupt":
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
        if fault_here == "oversize":
            data += bytes(1024)
        m = re.fullmatch(r"bytes=(\d+)-", asked or "")
        if fault_here in ("resume416", "wrongrange"):
            if m and fault_here == "resume416":
                return self._reply(fs, fault, name, asked, 416)
            # From the top, cut short every time; a "resume" is served from byte 0 as a 206.
            cut = int(len(data) * fs.drop_fraction)
            status = 206 if m else 200
            return self._reply(fs, fault, name, asked, status, data[:cut], total=len(data),
                               content_range=f"bytes 0-{len(data) - 1}/{len(data)}" if m else None)
        if fault_here == "trickle":
            return self._trickle(fs, fault, name, asked, data)
        start = 0
        if m and fault_here not in ("norange", "truncate"):
            start = int(m.group(1))
            if start >= len(data):
                return self._reply(fs, fault, name, asked, 416)
        body = data[start:]
        cut = len(body)
        if fault_here == "truncate":
            cut = len(body) // 2
        elif fault_here == "drop" and previous == 0:
            cut = int(len(body) * fs.drop_fraction)
        status = 206 if start else 200
        self._reply(fs, fault, name, asked, status, body[:cut], total=len(body),
                    content_range=f"bytes {start}-{len(data) - 1}/{len(data)}" if start else None)

    def _trickle(self, fs: FaultServer, fault: str, name: str, asked: str | None, data: bytes) -> None:
        with fs.lock:
            fs.log.append(Hit(fault, name, asked, 200))
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            for i in range(len(data)):
                if fs.stop.wait(fs.trickle):
                    break
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def _reply(self, fs: FaultServer, fault: str, name: str, asked: str | None, status: int,
               body: bytes = b"", *, total: int | None = None,
               content_range: str | None = None) -> None:
        with fs.lock:
            fs.log.append(Hit(fault, name, asked, status))
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body) if total is None else total))
            self.send_header("Accept-Ranges", "bytes")
            if content_range:
                self.send_header("Content-Range", content_range)
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        # HTTP/1.0: the connection closes now, which is what cuts a short body off.
        self.close_connection = True


class FaultServer:
    """A threaded HTTP server on 127.0.0.1 that serves ``root`` with injected faults.

    Use as a context manager; ``url(fault)`` is the base URL to pass to ``download``.
    """

    def __init__(self, root: Path, *, delay: float = 3.0, flaky_failures: int = 2,
                 drop_fraction: float = 0.4, trickle: float = 0.05) -> None:
        self.root = Path(root)
        self.trickle = trickle
        self.delay, self.flaky_failures, self.drop_fraction = delay, flaky_failures, drop_fraction
        self.log: list[Hit] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        # A short poll interval: shutdown() waits up to one interval, once per test.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)

    def __enter__(self) -> FaultServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.stop.set()  # wake "slow" handlers so that shutdown is immediate
        self._server.shutdown()
        self._server.server_close()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def url(self, fault: str = "ok") -> str:
        return f"http://127.0.0.1:{self.port}/{fault}/"

    def hits(self, name_suffix: str = ".tar") -> list[Hit]:
        """The requests for files whose name ends with ``name_suffix``, in order."""
        with self.lock:
            return [h for h in self.log if h.name.endswith(name_suffix)]


def wait_at(barrier) -> None:
    """Pool initializer: hold every worker until all have started, so that they then contend."""
    barrier.wait(timeout=60)
