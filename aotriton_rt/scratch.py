"""Global scratch: who owns it, how long it lives, which launches may share it.

A kernel compiled by Triton may declare *global scratch* (device-side TMA descriptors, for
example): each launch passes one buffer of ``programs * size`` bytes in which every program
writes its own slice. Two launches that can run at the same time must never be given the same
buffer, or one overwrites the descriptors the other is reading (wrong results or a GPU fault).
:class:`ScratchPool`, one per :class:`~aotriton_rt.library.Library`, hands buffers out by
these rules:

* **Eager launches** (the stream is not capturing a graph) use one buffer per (device, stream).
  Launches on one stream run one after the other, so they share it; launches on two streams
  never do. Once a second stream on the device has used scratch, an event is recorded on the
  stream after each launch, marking the buffer's last use.
* **Bounded**: at most :data:`MAX_STREAMS` streams per device hold a buffer. A further stream
  takes the least recently used stream's buffer and first makes itself wait (on the device,
  not the host) for that buffer's last use. A buffer outgrown by its stream is parked and
  reused the same way; at most :data:`MAX_PARKED` per device are kept, the rest freed once
  their last use has finished. The one buffer whose last use may predate the events (the
  device's first stream, when it stopped before a second came) is never given to another
  stream. A process that cycles through many short-lived streams therefore holds at most
  ``MAX_STREAMS + MAX_PARKED + 1`` buffers per device.
* **Captured graphs** (CUDA graph capture, ``torch.cuda.graph``, ...): each (capture, stream)
  gets a buffer of its own, which is never handed to another launch while the graph lives,
  so replays and eager launches on any stream can overlap safely. On CUDA the buffer is tied
  to the graph with a user object: when the graph and every executable made from it are
  destroyed and their launches have finished, it returns to the pool. Where the driver
  cannot say which graph is being built (HIP), it lives as long as the process.
* Steady state allocates nothing: one capture query and the launch (plus one event record
  once several streams share the device).

Lifetime: buffers live as long as their Library (the process, for the default one).
"""

from __future__ import annotations

import collections
import ctypes
import threading
from collections.abc import Callable
from typing import Any

from .errors import LaunchError

#: Streams per device that keep a buffer of their own.
MAX_STREAMS = 32
#: Outgrown or evicted buffers kept per device for reuse.
MAX_PARKED = 8
#: The smallest buffer allocated (bytes): most launches then never grow it.
MIN_BYTES = 1 << 20
#: Alignment of every buffer handed out; a variant asking for more is refused at load.
ALIGN = 256

#: ``void (*)(void *)``: the drivers' host-function type (a graph user object's destructor).
_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def check_scratch(name: str, variant: Any) -> None:
    """Refuse, when it is loaded, a variant whose global scratch the pool cannot align."""
    if variant.scratch["global_size"] and variant.scratch["global_align"] > ALIGN:
        raise LaunchError(f"{name}: variant {variant.key[:16]} asks for {variant.scratch['global_align']}-byte "
                          f"aligned global scratch; at most {ALIGN} is supported: rebuild it")


def _size_for(nbytes: int) -> int:
    """Bytes allocated for a need of ``nbytes``: a power of two, at least :data:`MIN_BYTES`."""
    return max(MIN_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())


#: Where a parked buffer's last use stands.
_IDLE, _EVENT, _UNKNOWN = "idle", "event", "unknown"


class _Buffer:
    __slots__ = ("device", "base", "ptr", "size", "event", "marked", "state")

    def __init__(self, device: int, base: int, size: int, event: int) -> None:
        self.device = device
        self.base = base
        self.ptr = -(-base // ALIGN) * ALIGN
        self.size = size
        self.event = event
        self.marked = False  # its event was recorded after its last eager launch
        self.state = _IDLE   # once parked: _IDLE (free to reuse), _EVENT (wait for .event), _UNKNOWN


class ScratchPool:
    """Per-library global scratch (see the module docstring for the rules).

    ``driver`` is called for the library's driver on first need (loading it lazily).
    """

    def __init__(self, driver: Callable[[], Any]) -> None:
        self._driver = driver
        # One lock: a launch with scratch holds it from taking the buffer to recording the
        # event, so no other thread can hand the buffer to another stream in between.
        self._lock = threading.Lock()
        # The driver, its capture probe and its raw event recorder, bound at the first launch.
        self._drv: Any = None
        self._probe: Any = None
        self._record: Any = None
        # (stream, device, buffer, several streams) of the last eager launch: its stream's buffer
        # is still the most recently used, so a repeat on that stream needs no bookkeeping.
        self._fast: tuple[int, int, _Buffer, bool] | None = None
        self._streams: collections.OrderedDict[tuple[int, int], _Buffer] = collections.OrderedDict()
        self._per_device: collections.Counter[int] = collections.Counter()
        self._parked: dict[int, list[_Buffer]] = {}
        self._graphs: dict[tuple[int, int, int], _Buffer] = {}  # (device, capture id, stream)
        self._graph_owned: dict[int, _Buffer] = {}  # key given to the graph -> buffer
        self._next_key = 1
        # Keys of graph buffers whose graph is gone: appended by the driver's thread, drained here.
        self._released: collections.deque[int] = collections.deque()
        self._on_release = None  # the destructor callback, made with the driver's function type

    def launch(self, device: int, stream: int, nbytes: int, launcher: Any, gx: int, gy: int, gz: int,
               values: tuple) -> None:
        """Launch ``launcher`` over (gx, gy, gz) on ``stream`` with ``values`` and a scratch
        buffer of ``nbytes`` private to this stream (or to the graph being captured on it)."""
        with self._lock:
            # The common case: the same stream as the last launch, not capturing, buffer big enough.
            fast = self._fast
            if fast is not None and fast[0] == stream and fast[1] == device and fast[2].size >= nbytes \
                    and not self._probe(stream) and not self._released:
                buf = fast[2]
                launcher(gx, gy, gz, stream, values + (buf.ptr, 0))
                if fast[3] and self._record(buf.event, stream):
                    self._drv.event_record(device, buf.event, stream)
                return
            self._launch(device, stream, nbytes, launcher, gx, gy, gz, values)

    def _launch(self, device: int, stream: int, nbytes: int, launcher: Any, gx: int, gy: int, gz: int,
                values: tuple) -> None:
        driver = self._drv
        if driver is None:
            driver = self._driver()
            self._probe, self._record = driver.capture_probe(), driver.event_recorder()
            self._drv = driver
        self._fast = None
        if self._released:
            self._drain()
        status = self._probe(stream)
        if status:
            status, capture, graph = driver.capture_info(device, stream)
        if status == 0:
            buf = self._for_stream(driver, device, stream, nbytes)
            launcher(gx, gy, gz, stream, values + (buf.ptr, 0))
            several = self._per_device[device] > 1
            if several:
                driver.event_record(device, buf.event, stream)
            buf.marked = several
            self._fast = (stream, device, buf, several)
        else:
            buf = self._for_capture(driver, device, stream, capture, graph, nbytes)
            launcher(gx, gy, gz, stream, values + (buf.ptr, 0))

    # -- eager ---------------------------------------------------------------------------------
    def _for_stream(self, driver: Any, device: int, stream: int, nbytes: int) -> _Buffer:
        key = (device, stream)
        buf = self._streams.get(key)
        if buf is not None:
            if buf.size >= nbytes:
                self._streams.move_to_end(key)
                return buf
            # Outgrown: its stream may still be running launches that use it; mark their end.
            driver.event_record(device, buf.event, stream)
            buf.marked = True
            del self._streams[key]
            self._per_device[device] -= 1
            self._park(driver, buf)
        if self._per_device[device] >= MAX_STREAMS:
            victim_key = next(k for k in self._streams if k[0] == device)
            self._park(driver, self._streams.pop(victim_key))
            self._per_device[device] -= 1
        buf = self._reuse(driver, device, stream, nbytes) or self._new(driver, device, nbytes)
        self._streams[key] = buf
        self._per_device[device] += 1
        return buf

    def _park(self, driver: Any, buf: _Buffer) -> None:
        """Keep ``buf`` for reuse; its stream's launches may still be using it."""
        buf.state = _EVENT if buf.marked else _UNKNOWN
        parked = self._parked.setdefault(buf.device, [])
        parked.append(buf)
        spare = [b for b in parked if b.state != _UNKNOWN]
        if len(spare) > MAX_PARKED:
            smallest = min(spare, key=lambda b: b.size)
            parked.remove(smallest)
            driver.free(smallest.device, smallest.base, smallest.event)

    def _reuse(self, driver: Any, device: int, stream: int, nbytes: int) -> _Buffer | None:
        parked = self._parked.get(device)
        fits = [b for b in parked or () if b.size >= nbytes and b.state != _UNKNOWN]
        if not fits:
            return None
        buf = min(fits, key=lambda b: b.size)
        parked.remove(buf)
        if buf.state == _EVENT:
            driver.stream_wait_event(device, stream, buf.event)
        elif not buf.event:  # a graph's buffer after the graph is gone: idle
            buf.event = driver.event_create(device)
        buf.marked = False
        return buf

    def _new(self, driver: Any, device: int, nbytes: int) -> _Buffer:
        size = _size_for(nbytes)
        base = driver.alloc(device, size + ALIGN)
        return _Buffer(device, base, size, driver.event_create(device))

    # -- graphs --------------------------------------------------------------------------------
    def _for_capture(self, driver: Any, device: int, stream: int, capture: int, graph: int,
                     nbytes: int) -> _Buffer:
        key = (device, capture, stream)
        buf = self._graphs.get(key)
        if buf is not None and buf.size >= nbytes:
            return buf
        # A larger one: the smaller stays owned by the graph, whose earlier launches use it.
        idle = [b for b in self._parked.get(device, ()) if b.state == _IDLE and b.size >= nbytes]
        if idle:
            buf = min(idle, key=lambda b: b.size)
            self._parked[device].remove(buf)
        else:
            size = _size_for(nbytes)
            buf = _Buffer(device, driver.alloc_relaxed(device, size + ALIGN), size, 0)
        self._graphs[key] = buf
        if graph:
            self._give_to_graph(driver, graph, buf)
        return buf  # without a graph to tie it to: lives as long as the process

    def _give_to_graph(self, driver: Any, graph: int, buf: _Buffer) -> None:
        if self._on_release is None:
            released = self._released
            self._on_release = _HOST_FN(lambda data: released.append(data))
        key = self._next_key
        self._next_key += 1
        if driver.retain_in_graph(graph, key, self._on_release):
            self._graph_owned[key] = buf

    def _drain(self) -> None:
        """Return the buffers of destroyed graphs to the pool (their launches have finished)."""
        while self._released:
            buf = self._graph_owned.pop(self._released.popleft() or 0, None)
            if buf is None:
                continue
            for k in [k for k, b in self._graphs.items() if b is buf]:
                del self._graphs[k]
            buf.state = _IDLE
            self._parked.setdefault(buf.device, []).append(buf)

    # -- inspection ----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counts for tests and diagnostics: buffers per role and their bytes."""
        with self._lock:
            self._drain()
            parked = [b for bs in self._parked.values() for b in bs]
            graphs = set(map(id, self._graphs.values())) | set(map(id, self._graph_owned.values()))
            return {"streams": len(self._streams), "parked": len(parked), "graphs": len(graphs),
                    "bytes": sum(b.size for b in self._streams.values()) + sum(b.size for b in parked)}
