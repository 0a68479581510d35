"""Global scratch ownership (aotriton_rt.scratch): private per stream and per captured graph,
bounded, and allocation-free in steady state.

The pool's rules run against a recording driver that models what the GPU could do: every
launch records which buffer it was given and on which stream, and a buffer handed to another
stream must come with a wait on an event recorded after the previous owner's last use. The
driver bindings the pool needs run against the fake libcuda in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aotriton_rt import scratch
from aotriton_rt.errors import LaunchError
from aotriton_rt.scratch import MAX_PARKED, MAX_STREAMS, ScratchPool
from tests.fakecuda import build_fake_cuda, fake_cuda_env

REPO = Path(__file__).resolve().parents[2]


class RecordingDriver:
    """Records every call; ``capturing`` maps a stream to its (capture id, graph)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.capturing: dict[int, tuple[int, int]] = {}
        self.next_ptr = 0x10_0000_0000
        self.next_event = 1
        self.live: set[int] = set()
        self.graph_objects: dict[int, list[tuple[int, object]]] = {}
        # event -> the stream position (len of that stream's launch list) it was recorded at
        self.recorded: dict[int, tuple[int, int]] = {}
        self.launches: dict[int, list[int]] = {}  # stream -> scratch pointers, in order

    def capture_probe(self):
        def probe(stream: int) -> int:
            self.calls.append(("probe", stream))
            return int(stream in self.capturing)
        return probe

    def event_recorder(self):
        def record(event: int, stream: int) -> int:
            self.event_record(0, event, stream)
            return 0
        return record

    def capture_info(self, device: int, stream: int) -> tuple[int, int, int]:
        self.calls.append(("capture_info", device, stream))
        if stream in self.capturing:
            return (1, *self.capturing[stream])
        return 0, 0, 0

    def alloc(self, device: int, nbytes: int) -> int:
        self.calls.append(("alloc", device, nbytes))
        ptr, self.next_ptr = self.next_ptr, self.next_ptr + nbytes + 0x1000
        self.live.add(ptr)
        return ptr

    def alloc_relaxed(self, device: int, nbytes: int) -> int:
        self.calls.append(("alloc_relaxed", device, nbytes))
        return self.alloc(device, nbytes)

    def free(self, device: int, ptr: int, event: int = 0) -> None:
        self.calls.append(("free", device, ptr, event))
        self.live.remove(ptr)

    def event_create(self, device: int) -> int:
        self.next_event += 1
        self.calls.append(("event_create", device, self.next_event))
        return self.next_event

    def event_record(self, device: int, event: int, stream: int) -> None:
        self.calls.append(("event_record", device, event, stream))
        self.recorded[event] = (stream, len(self.launches.get(stream, ())))

    def stream_wait_event(self, device: int, stream: int, event: int) -> None:
        # A wait is on the event's latest record at the time of the call (CUDA's rule).
        self.calls.append(("stream_wait_event", device, stream, event, self.recorded.get(event)))

    def retain_in_graph(self, graph: int, data: int, destroy: object) -> bool:
        self.calls.append(("retain_in_graph", graph, data))
        self.graph_objects.setdefault(graph, []).append((data, destroy))
        return True

    def destroy_graph(self, graph: int) -> None:
        for data, destroy in self.graph_objects.pop(graph, []):
            destroy(data)

    def launcher(self, gx: int, gy: int, gz: int, stream: int, values: tuple) -> None:
        self.calls.append(("launch", stream, values[-2]))
        self.launches.setdefault(stream, []).append(values[-2])

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c[0] == name)


@pytest.fixture()
def drv() -> RecordingDriver:
    return RecordingDriver()


@pytest.fixture()
def pool(drv: RecordingDriver) -> ScratchPool:
    return ScratchPool(lambda: drv)


def run(pool: ScratchPool, drv: RecordingDriver, stream: int, nbytes: int = 4096, device: int = 0) -> int:
    pool.launch(device, stream, nbytes, drv.launcher, 1, 1, 1, (7,))
    return drv.launches[stream][-1]


def test_launches_on_two_streams_never_share_a_scratch_buffer(pool: ScratchPool, drv: RecordingDriver) -> None:
    a = {run(pool, drv, 0xA) for _ in range(3)}
    b = {run(pool, drv, 0xB) for _ in range(3)}
    assert len(a) == 1 and len(b) == 1 and a != b
    assert all(p % scratch.ALIGN == 0 for p in a | b)


def test_steady_state_allocates_nothing_and_one_stream_records_no_event(pool: ScratchPool,
                                                                        drv: RecordingDriver) -> None:
    run(pool, drv, 0xA)
    before = (drv.count("alloc"), drv.count("event_create"))
    drv.calls.clear()
    for _ in range(100):
        run(pool, drv, 0xA)
    assert (drv.count("alloc"), drv.count("event_create")) == (0, 0) and before == (1, 1)
    assert [c[0] for c in drv.calls[:2]] == ["probe", "launch"]
    assert drv.count("event_record") == 0 and drv.count("capture_info") == 0


def test_once_two_streams_share_a_device_each_launch_marks_its_buffers_last_use(pool: ScratchPool,
                                                                                drv: RecordingDriver) -> None:
    run(pool, drv, 0xA)
    run(pool, drv, 0xB)
    drv.calls.clear()
    for _ in range(50):
        run(pool, drv, 0xA)
        run(pool, drv, 0xB)
    assert [c[0] for c in drv.calls[:3]] == ["probe", "launch", "event_record"]
    assert drv.count("event_record") == 100 and drv.count("alloc") == 0 and drv.count("stream_wait_event") == 0


def test_a_buffer_only_moves_to_another_stream_behind_its_last_use(pool: ScratchPool, drv: RecordingDriver) -> None:
    # More streams than the bound: every buffer handed to a new stream waits for the event the
    # previous owner recorded after its last launch.
    owner: dict[int, int] = {}
    first = run(pool, drv, 0)  # alone on the device: its last use is not marked, so it is never given away
    for s in range(1, 3 * MAX_STREAMS + 1):
        ptr = run(pool, drv, s)
        previous = owner.get(ptr)
        if previous is not None:
            waits = [c for c in drv.calls if c[0] == "stream_wait_event" and c[2] == s]
            assert len(waits) == 1
            stream, position = waits[0][4]
            assert stream == previous and position == len(drv.launches[previous])
        owner[ptr] = s
    assert first not in owner
    assert len(drv.live) <= MAX_STREAMS + MAX_PARKED + 1
    assert pool.stats()["streams"] == MAX_STREAMS


def test_ten_thousand_short_lived_streams_keep_a_bounded_number_of_buffers(pool: ScratchPool,
                                                                          drv: RecordingDriver) -> None:
    for s in range(10_000):
        run(pool, drv, 0x1000 + s)
    assert drv.count("alloc") <= MAX_STREAMS + 2
    assert len(drv.live) <= MAX_STREAMS + MAX_PARKED + 1


def test_an_outgrown_buffer_is_parked_behind_its_streams_launches_then_reused(pool: ScratchPool,
                                                                             drv: RecordingDriver) -> None:
    small = run(pool, drv, 0xA, 1 << 10)
    big = run(pool, drv, 0xA, 4 << 20)
    assert big != small and pool.stats()["parked"] == 1
    recorded = [c[2] for c in drv.calls if c[0] == "event_record" and c[3] == 0xA]
    # Alone on the device, only the growth marks the small buffer's last use.
    assert len(recorded) == 1
    assert run(pool, drv, 0xB, 1 << 10) == small
    wait = [c for c in drv.calls if c[0] == "stream_wait_event"]
    assert wait == [("stream_wait_event", 0, 0xB, recorded[0], (0xA, 1))]


def test_growth_doubles_so_a_growing_grid_allocates_logarithmically(pool: ScratchPool, drv: RecordingDriver) -> None:
    for n in range(1, 200):
        run(pool, drv, 0xA, n * 64 * 1024)
    assert drv.count("alloc") <= 5


def test_each_captured_graph_gets_scratch_no_eager_launch_or_other_graph_uses(pool: ScratchPool,
                                                                              drv: RecordingDriver) -> None:
    eager = run(pool, drv, 0xA)
    drv.capturing[0xA] = (101, 0x6A)
    in_graph = {run(pool, drv, 0xA) for _ in range(3)}
    drv.capturing[0xA] = (102, 0x6B)
    other_graph = run(pool, drv, 0xA)
    drv.capturing[0xB] = (102, 0x6B)  # the same capture, forked onto a second stream
    forked = run(pool, drv, 0xB)
    assert len(in_graph) == 1 and len({eager, *in_graph, other_graph, forked}) == 4
    assert drv.count("alloc_relaxed") == 3
    assert [c[1] for c in drv.calls if c[0] == "retain_in_graph"] == [0x6A, 0x6B, 0x6B]
    # Captured launches record no event: replays are the graph's business.
    assert [c for c in drv.calls if c[0] == "event_record" and c[3] == 0xB] == []
    assert drv.count("capture_info") == 5
    del drv.capturing[0xA], drv.capturing[0xB]
    assert run(pool, drv, 0xA) == eager


def test_a_destroyed_graphs_scratch_returns_to_the_pool_and_is_reused(pool: ScratchPool, drv: RecordingDriver) -> None:
    drv.capturing[0xA] = (101, 0x6A)
    in_graph = run(pool, drv, 0xA)
    del drv.capturing[0xA]
    assert pool.stats()["graphs"] == 1
    drv.destroy_graph(0x6A)
    assert pool.stats() == {"streams": 0, "parked": 1, "graphs": 0, "bytes": scratch.MIN_BYTES}
    assert run(pool, drv, 0xC) == in_graph
    assert drv.count("stream_wait_event") == 0  # idle: the graph's launches had finished


def test_a_graph_the_driver_cannot_name_keeps_its_scratch_for_the_process(pool: ScratchPool,
                                                                          drv: RecordingDriver) -> None:
    drv.capturing[0xA] = (101, 0)  # HIP: no graph handle from the capture query
    in_graph = run(pool, drv, 0xA)
    del drv.capturing[0xA]
    assert drv.count("retain_in_graph") == 0
    assert run(pool, drv, 0xA) != in_graph and pool.stats()["graphs"] == 1


def test_devices_have_separate_buffers_and_bounds(pool: ScratchPool, drv: RecordingDriver) -> None:
    assert run(pool, drv, 0xA, device=0) != run(pool, drv, 0xA, device=1)
    assert {c[1] for c in drv.calls if c[0] == "alloc"} == {0, 1}


def test_a_variant_asking_for_scratch_aligned_past_the_pool_is_refused_at_load() -> None:
    from types import SimpleNamespace

    from aotriton_rt.scratch import check_scratch

    variant = SimpleNamespace(key="ab" * 32, scratch={"global_size": 384, "global_align": 512})
    with pytest.raises(LaunchError, match=r"^attn_fwd: variant abababababababab asks for 512-byte aligned global "
                                          r"scratch; at most 256 is supported: rebuild it$"):
        check_scratch("attn_fwd", variant)
    check_scratch("attn_fwd", SimpleNamespace(key="", scratch={"global_size": 384, "global_align": 256}))
    check_scratch("attn_fwd", SimpleNamespace(key="", scratch={"global_size": 0, "global_align": 4096}))


def test_concurrent_threads_on_many_streams_each_launch_with_a_buffer_no_other_stream_holds(
        pool: ScratchPool, drv: RecordingDriver) -> None:
    import threading

    holders: dict[int, int] = {}
    conflicts: list[tuple] = []
    guard = threading.Lock()

    def launcher(gx: int, gy: int, gz: int, stream: int, values: tuple) -> None:
        ptr = values[-2]
        with guard:
            if holders.get(ptr, stream) != stream:
                conflicts.append((ptr, holders[ptr], stream))
            holders[ptr] = stream
        drv.launcher(gx, gy, gz, stream, values)
        with guard:
            holders.pop(ptr, None)

    def worker(base: int) -> None:
        for i in range(200):
            pool.launch(0, base + i % 50, 4096, launcher, 1, 1, 1, ())

    threads = [threading.Thread(target=worker, args=(0x100 * t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert conflicts == []


# ---------------------------------------------------------------------------- driver bindings

_BINDINGS = textwrap.dedent("""
    import ctypes, json, os, sys
    from aotriton_rt.drivers.cuda import CudaDriver
    from aotriton_rt.scratch import ScratchPool
    drv = CudaDriver()
    lib = ctypes.CDLL(os.environ["AOTRITON_RT_CUDA_LIB"])
    lib.fake_cuda_destroy_graph.argtypes = [ctypes.c_uint64]
    out = {"eager": drv.capture_info(0, 0x50)}
    os.environ["FAKECUDA_CAPTURING"] = str(0x60)
    out["capturing"] = drv.capture_info(0, 0x60)
    pool = ScratchPool(lambda: drv)
    seen = []
    launch = lambda gx, gy, gz, stream, values: seen.append((stream, values[-2]))
    pool.launch(0, 0x50, 1000, launch, 1, 1, 1, ())
    pool.launch(0, 0x60, 1000, launch, 1, 1, 1, ())
    out["seen"] = list(seen)
    out["stats"] = pool.stats()
    out["destroyed"] = lib.fake_cuda_destroy_graph(0x60)
    out["after"] = pool.stats()
    for s in range(0x100, 0x100 + 40):
        pool.launch(0, s, 1000, launch, 1, 1, 1, ())
    print(json.dumps(out))
""")


def test_the_cuda_bindings_query_captures_record_events_and_tie_scratch_to_a_graph(tmp_path: Path) -> None:
    lib = build_fake_cuda(tmp_path / "fake")
    log = tmp_path / "cuda.jsonl"
    env = {**fake_cuda_env(lib, log), "PYTHONPATH": str(REPO), "FAKECUDA_CAPTURING": ""}
    proc = subprocess.run([sys.executable, "-c", _BINDINGS], env={**__import__("os").environ, **env},
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["eager"] == [0, 0, 0] and out["capturing"] == [1, 0x60, 0x60]
    (s1, p1), (s2, p2) = out["seen"]
    assert (s1, s2) == (0x50, 0x60) and p1 != p2 and p1 % 256 == 0 and p2 % 256 == 0
    assert out["stats"]["graphs"] == 1 and out["destroyed"] == 1 and out["after"]["graphs"] == 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    names = [c["call"] for c in calls]
    assert "cuGraphRetainUserObject" in names and "cuEventRecord" in names
    # 41 eager streams, 32 kept: the others took a marked buffer behind a wait on the device.
    assert sum(1 for c in calls if c["call"] == "cuStreamWaitEvent") >= 40 - MAX_STREAMS - 1
    assert [c for c in calls if c["call"] == "cuEventRecord" and c["stream"] == 0x60] == []


# ---------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_a_captured_graphs_scratch_is_its_own_and_returns_to_the_pool_when_the_graph_dies(sm90_images: str) -> None:
    import gc
    import time

    import torch

    import aotriton_rt

    lib = aotriton_rt.Library(sm90_images)
    q, k, v = (torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    want, _ = aotriton_rt.attention(q, k, v, causal=True, library=lib)
    torch.cuda.synchronize()
    assert lib.scratch.stats()["streams"] == 1, "the sm90 forward at D=128 should use global scratch"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        got, _ = aotriton_rt.attention(q, k, v, causal=True, library=lib)
    assert lib.scratch.stats()["graphs"] == 1
    for _ in range(3):
        graph.replay()
        aotriton_rt.attention(q, k, v, causal=True, library=lib)  # eager, beside the replay
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    del graph
    gc.collect()
    torch.cuda.synchronize()
    deadline = time.monotonic() + 10
    while lib.scratch.stats()["graphs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = lib.scratch.stats()
    assert stats["graphs"] == 0 and stats["parked"] == 1, stats
