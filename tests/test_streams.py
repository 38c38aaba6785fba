"""Copy streams through the CPU twin: ordering, fences, buffers kept alive, the cap."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from prefetch_offload import OffloadError
from prefetch_offload.streams import ThreadStreams


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
