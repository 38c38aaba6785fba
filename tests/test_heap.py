"""Giving glibc's free heap memory back (NOTE [heap trim])."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from prefetch_offload import OffloadConfig, offload_context
from prefetch_offload.heap import HeapTrimmer, heap_trim_supported
from prefetch_offload.io_pool import InlineIOPool, IOFuture
from prefetch_offload.stats import StatsCounter
from prefetch_offload.testing import TinyTransformer, make_batch

glibc_only = pytest.mark.skipif(not heap_trim_supported(), reason="needs glibc's malloc_trim")
MiB = 1 << 20


class _QueuedPool(InlineIOPool):
    """Keeps submitted jobs until the test runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.jobs: list[Callable[[], Any]] = []

    def submit(self, fn: Callable[[], Any], priority: int) -> IOFuture[Any]:
        self.jobs.append(fn)
        return IOFuture(fn)

    def run_all(self) -> None:
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job()


def _trimmer(every: int | None) -> tuple[HeapTrimmer, _QueuedPool, StatsCounter, list[Any]]:
    pool, stats, errors = _QueuedPool(), StatsCounter(), []
    return HeapTrimmer(every, pool, stats, errors.append), pool, stats, errors


@glibc_only
def test_trims_when_a_step_begins_after_enough_bytes_and_never_queues_two() -> None:
    trimmer, pool, stats, errors = _trimmer(10)
    trimmer.saved(6)
    trimmer.step_begins()  # the step before saved less than the threshold: no trim
    assert pool.jobs == []
    trimmer.saved(6)
    trimmer.saved(6)  # no trim within a step, however much it saves
    assert pool.jobs == []
    trimmer.step_begins()  # 12 >= 10: one trim, and counting starts again
    assert len(pool.jobs) == 1
    trimmer.saved(10)
    trimmer.step_begins()  # due, but one is queued: it would give back nothing more
    assert len(pool.jobs) == 1
    pool.run_all()
    assert stats.snapshot().heap_trims == 1 and stats.snapshot().heap_trim_seconds >= 0
    trimmer.step_begins()  # nothing saved since: nothing to give back
    assert pool.jobs == []
    trimmer.saved(10)
    trimmer.step_begins()
    pool.run_all()
    assert stats.snapshot().heap_trims == 2 and errors == []


def test_none_never_trims() -> None:
    trimmer, pool, stats, _ = _trimmer(None)
    assert not trimmer.enabled
    trimmer.saved(1 << 40)
    trimmer.step_begins()
    assert pool.jobs == [] and stats.snapshot().heap_trims == 0


@glibc_only
def test_a_trim_gives_freed_heap_pages_back() -> None:
    """What the engine relies on: glibc keeps freed heap chunks resident, and
    malloc_trim(0) returns their pages even when a live chunk pins the heap's top."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * page

    # 64 KiB chunks stay below glibc's mmap threshold: they come from the heap. The
    # allocations run on a fresh thread so that they come from its own arena, whose
    # state no earlier test shaped.
    freed: list[int] = []

    def churn() -> None:
        chunks = [libc.malloc(64 << 10) for _ in range(1024)]  # 64 MiB
        for c in chunks:
            ctypes.memset(c, 1, 64 << 10)
        pin = libc.malloc(64 << 10)  # live above them: the top cannot shrink
        ctypes.memset(pin, 1, 64 << 10)
        before = rss()
        for c in chunks:
            libc.free(c)
        kept = rss()
        trimmer, pool, _, _ = _trimmer(1)
        trimmer.soon()
        pool.run_all()
        freed.extend([before - kept, kept - rss()])
        libc.free(pin)

    thread = threading.Thread(target=churn)
    thread.start()
    thread.join()
    kept_back, given_back = freed
    assert kept_back < 16 * MiB  # free() alone kept most of it resident
    assert given_back > 32 * MiB


@glibc_only
@pytest.mark.parametrize("every", [None, 1 << 20])
def test_engine_trims_as_activations_leave(tmp_path: Path, every: int | None) -> None:
    """One trim per step, when the next forward begins; CPU training stays exact."""
    torch.manual_seed(0)
    model = TinyTransformer(width=64, depth=2, heads=2)
    ref = TinyTransformer(width=64, depth=2, heads=2)
    ref.load_state_dict(model.state_dict())
    tokens, targets = make_batch(2, 64)
    ref(tokens, targets).backward()
    with offload_context(
        "disk",
        save_dir=str(tmp_path),
        min_offload_bytes=0,
        chunk_bytes=16384,  # small write batches: the tiny model's tensors reach the disk
        heap_trim_bytes=every,
    ) as engine:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(tokens, targets).backward()
            deadline = time.monotonic() + 30
            while engine._heap._queued and time.monotonic() < deadline:
                time.sleep(0.001)  # the step's trim has run: the next one is not skipped
        stats = engine.stats()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)
    assert stats.bytes_offloaded > 0
    if every is None:
        assert stats.heap_trims == 0
    else:  # when the second and the third forward began; none within a step
        assert stats.heap_trims == 2


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, "heap_trim_bytes must be > 0"),
        (True, TypeError, "heap_trim_bytes must be an int or a str"),
        (-1, ValueError, "heap_trim_bytes must be >= 0"),
        ("lots", ValueError, "heap_trim_bytes"),
    ],
)
def test_heap_trim_bytes_is_checked(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        OffloadConfig(target="disk", save_dir="/tmp/x", heap_trim_bytes=value)  # type: ignore[arg-type]


def test_heap_trim_bytes_takes_units_and_none() -> None:
    assert OffloadConfig(target=None, heap_trim_bytes="64MiB").heap_trim_bytes == 64 * MiB
    assert OffloadConfig(target=None, heap_trim_bytes=None).heap_trim_bytes is None
    assert OffloadConfig(target=None).heap_trim_bytes == 16 * MiB
