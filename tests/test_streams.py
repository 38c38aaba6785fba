"""Copy streams through the CPU twin: ordering, fences, buffers kept alive, the cap."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch

from prefetch_offload import OffloadError, OffloadFallbackWarning
from prefetch_offload import streams as streams_module
from prefetch_offload.streams import CudaStreams, ThreadStreams


def test_d2h_then_h2d_chain_without_host_waits() -> None:
    streams = ThreadStreams(delay=0.02)
    try:
        src = torch.arange(1000, dtype=torch.uint8)
        host = torch.empty(1000, dtype=torch.uint8)
        f1 = streams.d2h(host, src)
        assert not f1.done()  # queued, not run: the hook thread did not wait
        out, f2 = streams.h2d(host, after=f1)  # ordered after the D2H copy
        streams.use(out, f2)
        assert f1.done() and f2.done()
        assert torch.equal(out, src)
    finally:
        streams.close()


def test_copies_keep_their_tensors_alive_until_done() -> None:
    """NOTE [copies keep their buffers]: dropping the caller's references is safe."""
    streams = ThreadStreams(delay=0.05)
    try:
        src = torch.full((4096,), 7, dtype=torch.uint8)
        host = torch.empty(4096, dtype=torch.uint8)
        src_ref, host_ref = weakref.ref(src.untyped_storage()), weakref.ref(host.untyped_storage())
        fence = streams.d2h(host, src)
        del src, host
        gc.collect()
        assert src_ref() is not None and host_ref() is not None  # the copy still runs
        fence.wait()
        streams.poll()
        gc.collect()
        assert src_ref() is None and host_ref() is None  # released once seen done
    finally:
        streams.close()


def test_inflight_cap_makes_the_next_copy_wait() -> None:
    streams = ThreadStreams(delay=0.03, max_inflight_bytes=1500)
    try:
        fences = [
            streams.d2h(torch.empty(1000, dtype=torch.uint8), torch.ones(1000, dtype=torch.uint8))
            for _ in range(3)
        ]
        # Each copy had to wait for the one before: at most 1000 bytes were in flight.
        assert fences[0].done() and fences[1].done()
        assert streams.throttle_seconds >= 0.03
    finally:
        streams.close()


def test_failed_copy_raises_where_it_is_used() -> None:
    streams = ThreadStreams()
    try:
        fence = streams.d2h(torch.empty(10, dtype=torch.uint8), torch.ones(11, dtype=torch.uint8))
        with pytest.raises(OffloadError, match="asynchronous copy failed"):
            fence.wait()
        out, f2 = streams.h2d(torch.ones(4, dtype=torch.uint8), after=fence)
        with pytest.raises(OffloadError):
            streams.use(out, f2)  # the dependent copy fails too, never silently
    finally:
        streams.close()


def test_close_stops_the_workers_and_later_copies_run_inline() -> None:
    streams = ThreadStreams(delay=0.01)
    streams.d2h(torch.empty(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8))
    streams.close()
    start = time.perf_counter()
    out, fence = streams.h2d(torch.full((8,), 3, dtype=torch.uint8), after=None)
    assert fence.done() and torch.equal(out, torch.full((8,), 3, dtype=torch.uint8))
    assert time.perf_counter() - start < 1.0


def _recording_d2h(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record (bytes already in flight, bytes of this copy) at every D2H copy issued."""
    seen: list[tuple[int, int]] = []
    real = ThreadStreams._d2h

    def recording(self: ThreadStreams, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
        seen.append((self._d2h_inflight.bytes, src.numel()))
        return real(self, dst, src, after)

    monkeypatch.setattr(ThreadStreams, "_d2h", recording)
    return seen


def test_large_copy_is_chunked_so_the_cap_bounds_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [copy chunks]: a copy above the cap never puts more than the cap in flight."""
    seen = _recording_d2h(monkeypatch)
    cap = 4096
    streams = ThreadStreams(delay=0.005, max_inflight_bytes=cap)
    try:
        small = torch.full((1000,), 1, dtype=torch.uint8)
        streams.d2h(torch.empty(1000, dtype=torch.uint8), small)
        src = torch.arange(20_000, dtype=torch.int64).to(torch.uint8)
        dst = torch.empty(20_000, dtype=torch.uint8)
        fence = streams.d2h(dst, src)
        fence.wait()
        assert torch.equal(dst, src)  # the last fence covers every chunk
        assert [n for _, n in seen] == [1000, 4096, 4096, 4096, 4096, 3616]
        assert max(before + n for before, n in seen) <= cap
        assert streams.peak_inflight_bytes <= cap
    finally:
        streams.close()


def test_large_copy_does_not_wait_for_every_earlier_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before chunking, a copy at or above the cap waited until nothing was in flight."""
    seen = _recording_d2h(monkeypatch)
    cap = 16 << 20  # chunks of 4 MiB
    streams = ThreadStreams(delay=0.02, max_inflight_bytes=cap)
    src = torch.randint(0, 255, (20 << 20,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    small = [torch.ones(2 << 20, dtype=torch.uint8) for _ in range(6)]
    try:
        for i in range(3):
            streams.d2h(small[2 * i], small[2 * i + 1])
        streams.d2h(dst, src).wait()
        assert torch.equal(dst, src)
        first_chunk = seen[3]
        assert first_chunk == (6 << 20, 4 << 20)  # issued behind the small ones, at once
        assert max(before + n for before, n in seen) <= cap
    finally:
        streams.close()


def test_a_failed_chunk_fails_the_whole_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin's fence for a chunked copy waits for every chunk and raises any failure."""
    real = ThreadStreams._d2h
    calls = []
    short: list[torch.Tensor] = []  # the twin holds copy tensors weakly: keep it alive

    def second_fails(self: ThreadStreams, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
        calls.append(src.numel())
        if len(calls) == 2:
            short.append(dst[:-1])  # a size mismatch: this chunk's copy fails
            dst = short[-1]
        return real(self, dst, src, after)

    monkeypatch.setattr(ThreadStreams, "_d2h", second_fails)
    streams = ThreadStreams(delay=0.01, max_inflight_bytes=16 << 20)  # 4 MiB chunks
    try:
        dst = torch.empty(12 << 20, dtype=torch.uint8)
        fence = streams.d2h(dst, torch.ones(12 << 20, dtype=torch.uint8))
        assert len(calls) == 3
        with pytest.raises(OffloadError, match="asynchronous copy failed"):
            fence.wait()
    finally:
        with contextlib.suppress(OffloadError):
            streams.close()


class _FakeCudart:
    """``cudaStreamCreateWithFlags`` as libcudart answers it: a new handle per call."""

    def __init__(self) -> None:
        self.flags: list[int] = []

    def cudaStreamCreateWithFlags(self, out: Any, flags: int) -> int:
        self.flags.append(flags)
        out._obj.value = 0x1000 + len(self.flags)  # ctypes.byref(c_void_p) -> its object
        return 0


def _fake_cuda_streams(
    monkeypatch: pytest.MonkeyPatch, cudart: _FakeCudart | None
) -> tuple[list[torch.device], list[tuple[int, torch.device]]]:
    """Pooled streams (torch.cuda.Stream) and wrapped ones (ExternalStream) made from now."""
    pooled: list[torch.device] = []
    wrapped: list[tuple[int, torch.device]] = []

    class FakeStream:
        def __init__(self, device: torch.device) -> None:
            pooled.append(device)

    class FakeExternalStream:
        def __init__(self, ptr: int, device: torch.device) -> None:
            wrapped.append((ptr, device))

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "ExternalStream", FakeExternalStream)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(streams_module, "_cudart", lambda: cudart)
    monkeypatch.setattr(streams_module, "_SIDE_STREAMS", {})
    return pooled, wrapped


def test_side_streams_are_dedicated_not_pooled(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [side streams]: PyTorch's pooled streams are handed to NCCL, FSDP and user
    streams too; the copy streams are made with cudaStreamCreateWithFlags(non-blocking),
    one pair per device for the whole process, and never come from the pool."""
    cudart = _FakeCudart()
    pooled, wrapped = _fake_cuda_streams(monkeypatch, cudart)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    first = [CudaStreams(cuda0, max_inflight_bytes=1 << 20) for _ in range(20)]
    assert pooled == []
    assert cudart.flags == [streams_module._STREAM_NON_BLOCKING] * 2
    assert [device for _, device in wrapped] == [cuda0, cuda0]
    assert len({ptr for ptr, _ in wrapped}) == 2  # two streams, not one shared
    assert len({(s._d2h_stream, s._h2d_stream) for s in first}) == 1
    assert first[0]._d2h_stream is not first[0]._h2d_stream
    CudaStreams(cuda1, max_inflight_bytes=1 << 20)
    assert [device for _, device in wrapped] == [cuda0, cuda0, cuda1, cuda1]
    assert pooled == []


def test_side_streams_fall_back_to_the_pool_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a reachable libcudart the copies still run, on pooled streams, and say so."""
    pooled, wrapped = _fake_cuda_streams(monkeypatch, None)
    cuda0 = torch.device("cuda", 0)
    with pytest.warns(OffloadFallbackWarning, match="pooled streams"):
        CudaStreams(cuda0, max_inflight_bytes=1 << 20)
    assert pooled == [cuda0, cuda0] and wrapped == []


class _SlowFence(streams_module.Fence):
    """Done once ``event`` is set; counts how often it was asked."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event
        self.asked = 0

    def done(self) -> bool:
        self.asked += 1
        return self.event.is_set()

    def wait(self) -> None:
        self.event.wait()


def test_drain_waits_on_the_oldest_copy_instead_of_spinning() -> None:
    """Copies issued from several threads can sit in the in-flight list in another order
    than their stream ends them: draining must wait on each, not poll in a loop."""
    older, newer = threading.Event(), threading.Event()
    newer.set()  # the later-listed copy is done first
    inflight = streams_module._Inflight()
    first, second = _SlowFence(older), _SlowFence(newer)
    inflight.add(first, 10)
    inflight.add(second, 10)
    timer = threading.Timer(0.3, older.set)
    timer.start()
    inflight.drain()
    timer.join()
    assert inflight.bytes == 0
    assert first.asked + second.asked < 10, "drain polled while it should have waited"


def test_joined_fence_waits_for_both_and_flattens() -> None:
    a, b, c = (_SlowFence(threading.Event()) for _ in range(3))
    assert streams_module.joined_fence(None, None) is None
    assert streams_module.joined_fence(a, None) is a
    assert streams_module.joined_fence(None, b) is b
    both = streams_module.joined_fence(streams_module.joined_fence(a, b), c)
    assert both is not None and streams_module._parts(both) == [a, b, c]
    a.event.set()
    b.event.set()
    assert not both.done()
    c.event.set()
    assert both.done()


def test_capturing_asks_the_named_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture on cuda:1 while cuda:0 is current is seen when cuda:1 is named."""
    current = [0]

    @contextlib.contextmanager
    def device(d: torch.device) -> Any:
        before, current[0] = current[0], d.index
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(streams_module, "_cuda_ready", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current[0] == 1)
    assert not streams_module.capturing()
    assert not streams_module.capturing(torch.device("cuda", 0))
    assert not streams_module.capturing(torch.device("cpu"))
    assert streams_module.capturing(torch.device("cuda", 1))
    assert current[0] == 0


def test_the_side_stream_is_current_inside_and_the_caller_s_after_even_on_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [lean CUDA calls]: _OnStream sets the stream directly (no GPU needed: the
    setter is recorded)."""
    seen: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_stream", seen.append)
    with streams_module._OnStream("side", "current"):
        assert seen == ["side"]
    with pytest.raises(ValueError), streams_module._OnStream("side", "current"):
        raise ValueError
    assert seen == ["side", "current", "side", "current"]
