"""Adversarial probes of the IO layers: the slab allocator against a model, short and
empty writes, future races, pool accounting under failures and finalizers, buffers kept
after exit, checksums of bytes that may legally change, and the CPU twin with staging,
verify, copy delays, retain_graph, checkpointing and the write-tail skip."""

from __future__ import annotations

import contextlib
import copy
import errno
import gc
import itertools
import mmap
import os
import queue
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from prefetch_offload import OffloadConfig, OffloadEngine, OffloadIOError
from prefetch_offload import slab as slab_mod
from prefetch_offload.buffers import Block, HostBufferPool
from prefetch_offload.device import RoutingDevice, SpanCopyDevice
from prefetch_offload.io_pool import READ, WRITE, CancelledIO, ThreadIOPool
from prefetch_offload.slab import Extent, SlabStore
from prefetch_offload.testing import TinyTransformer, make_batch

PAGE = 4096


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- the slab allocator --------------------------------------------------------------------

_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 20)),  # pages; > 8 needs its own slab
        st.tuples(st.just("free"), st.integers(0, 1 << 16)),
        st.tuples(st.just("trim"), st.just(0)),
    ),
    max_size=60,
)


def _check_store(store: SlabStore, live: dict[int, tuple[Extent, int]]) -> None:
    """Every invariant of NOTE [slab allocation], against the extents handed out."""
    by_slab: dict[int, list[Extent]] = {}
    for ext, _ in live.values():
        by_slab.setdefault(ext.slab, []).append(ext)
    assert set(by_slab) <= set(store._slabs)  # no live extent in a closed slab
    for sid, slab in store._slabs.items():
        used = sorted((e.offset, e.length) for e in by_slab.get(sid, ()))
        assert slab.used == sum(n for _, n in used)
        free = [tuple(r) for r in slab.free]
        assert free == sorted(free)
        for (a, n), (b, _) in itertools.pairwise(free):
            assert a + n < b  # disjoint and coalesced: no two runs touch
        runs = sorted(used + free)
        pos = 0
        for off, n in runs:  # used and free tile the slab exactly, page-aligned
            assert off == pos and n > 0 and off % PAGE == 0 and n % PAGE == 0
            pos += n
        assert pos == slab.size
    assert store.used_bytes == sum(e.length for e, _ in live.values())
    assert store.reserved_bytes == sum(s.size for s in store._slabs.values())
    assert store.peak_used_bytes >= store.used_bytes
    if store.disk_bytes_limit is not None:
        assert store.reserved_bytes <= store.disk_bytes_limit


@settings(max_examples=60, deadline=None)
@given(ops=_OPS, limit=st.sampled_from([None, 8, 20, 40]))
def test_slab_allocator_agrees_with_a_model(ops: list[tuple[str, int]], limit: int | None) -> None:
    """Random allocate/free/trim: no overlap, exact accounting, coalescing, first fit,
    oversized tensors in slabs of their own, the disk cap, and fds closed by trim."""
    with tempfile.TemporaryDirectory() as d:
        base = _fds()
        store = SlabStore(
            d,
            slab_bytes=8 * PAGE,
            io_method="buffered",
            disk_bytes_limit=None if limit is None else limit * PAGE,
        )
        live: dict[int, tuple[Extent, int]] = {}
        tag = 0
        for op, arg in ops:
            if op == "alloc":
                n = arg * PAGE
                fits = [
                    (sid, next(off for off, m in s.free if m >= n))
                    for sid, s in store._slabs.items()
                    if any(m >= n for _, m in s.free)
                ]
                reserved = store.reserved_bytes
                ext = store.allocate(n)
                if fits:  # first fit: the first slab with room, at its first run that fits
                    assert ext is not None and (ext.slab, ext.offset) == fits[0]
                elif ext is None:  # only the cap may refuse a new slab
                    assert limit is not None
                    assert reserved + n > limit * PAGE  # not even n bytes left under it
                else:  # a new slab: slab_bytes (or the tensor), cut to what the cap leaves
                    want = max(8 * PAGE, n)
                    if limit is not None:  # the cap cuts the slab that reaches it
                        want = min(want, limit * PAGE - reserved)
                    assert ext.offset == 0 and store._slabs[ext.slab].size == want
                if ext is not None:
                    tag += 1
                    store.write(ext, 0, memoryview(bytes([tag % 251 + 1]) * n))
                    live[tag] = (ext, tag % 251 + 1)
            elif op == "free" and live:
                key = sorted(live)[arg % len(live)]
                store.free(live.pop(key)[0])
            elif op == "trim":
                store.trim()
                assert all(s.used for s in store._slabs.values())
            _check_store(store, live)
            assert _fds() == base + len(store._slabs)  # one descriptor per open slab
        for ext, value in live.values():  # nobody's bytes were overwritten
            out = bytearray(ext.length)
            store.read(ext, 0, memoryview(out))
            assert out == bytes([value]) * ext.length
        store.close()
        assert _fds() == base


def test_short_writes_and_reads_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A vectored write or a read that moves fewer bytes than asked is resumed exactly."""
    store = SlabStore(str(tmp_path), slab_bytes=16 * PAGE, io_method="buffered")
    ext = store.allocate(12 * PAGE)
    assert ext is not None
    rng = random.Random(0)
    data = bytes(rng.randrange(256) for _ in range(12 * PAGE))
    cuts = [0, 1000, 4096, 9000, 9001, 30000, 12 * PAGE]
    views = [memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)]
    real_w, real_r = os.pwritev, os.preadv

    def short_write(fd: int, bufs: list[memoryview], pos: int) -> int:
        # A prefix of the concatenation, ending inside a buffer: 1.5 buffers at most.
        first = memoryview(bufs[0])
        prefix = [first] if len(bufs) > 1 else [first[: max(1, len(first) // 3)]]
        if len(bufs) > 1:
            second = memoryview(bufs[1])
            prefix.append(second[: max(1, len(second) // 2)])
        return real_w(fd, prefix, pos)

    def short_read(fd: int, bufs: list[memoryview], pos: int) -> int:
        return real_r(fd, [memoryview(bufs[0])[:777]], pos)

    monkeypatch.setattr(slab_mod.os, "pwritev", short_write)
    monkeypatch.setattr(slab_mod.os, "preadv", short_read)
    store.write(ext, 0, views)
    out = bytearray(12 * PAGE)
    store.read(ext, 0, memoryview(out))
    assert out == data
    store.close()


def test_a_write_that_writes_nothing_raises_instead_of_spinning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pwritev returning 0 made the write loop retry forever (the IO thread spun, and
    forward hung at the write cap); it is an IO error, as an empty read already was."""
    store = SlabStore(str(tmp_path), slab_bytes=4 * PAGE, io_method="buffered")
    ext = store.allocate(2 * PAGE)
    assert ext is not None
    calls = []

    def nothing(fd: int, bufs: list[memoryview], pos: int) -> int:
        calls.append(pos)
        if len(calls) > 100:
            raise RuntimeError("the write loop spins")
        return 0

    monkeypatch.setattr(slab_mod.os, "pwritev", nothing)
    with pytest.raises(OSError) as info:
        store.write(ext, 0, memoryview(bytes(2 * PAGE)))
    assert info.value.errno == errno.EIO and len(calls) == 1
    store.close()


# -- futures and the thread pool ---------------------------------------------------------


def test_claims_cancels_and_workers_race_every_job_runs_at_most_once() -> None:
    """Hook-thread claims and cancels against three workers popping the same jobs, then
    a shutdown with jobs still queued: each job runs once unless cancelled, never twice."""
    for trial in range(8):
        rng = random.Random(trial)
        pool = ThreadIOPool(3)
        counts: dict[int, int] = {}
        lock = threading.Lock()

        def job(i: int, counts: dict[int, int] = counts, lock: Any = lock) -> int:
            with lock:
                counts[i] = counts.get(i, 0) + 1
            return i

        futs = [pool.submit(lambda i=i: job(i), rng.choice([READ, WRITE])) for i in range(200)]
        for f in futs:
            r = rng.random()
            if r < 0.3 and f.claim():
                f.run()
            elif r < 0.6:
                f.cancel()
        pool.shutdown()
        for i, f in enumerate(futs):
            assert f.done()
            if isinstance(f.exception(), CancelledIO):
                assert i not in counts
            else:
                assert f.result() == i and counts[i] == 1
        assert not any(t.is_alive() for t in pool.threads)


# -- the host buffer pool ----------------------------------------------------------------


class _Counting:
    """Makes mapped blocks and counts those not yet released."""

    def __init__(self, fail_first: int = 0) -> None:
        self.fail = fail_first
        self.alive: set[int] = set()
        self.lock = threading.Lock()

    def __call__(self, size: int) -> Block:
        if self.fail:
            self.fail -= 1
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        m = mmap.mmap(-1, size)
        alive, lock = self.alive, self.lock

        class Counted(Block):
            __slots__ = ()

            def release(self) -> None:
                with lock:
                    alive.discard(id(self))
                super().release()

        block = Counted(m, size, pinned=False, owner=m)
        with lock:
            alive.add(id(block))
        return block


def test_a_failed_allocation_leases_nothing() -> None:
    """A block that could not be made was still counted as leased, forever: the
    counter never returned to 0, and a follow-peak pool kept that much more idle."""
    pool = HostBufferPool(0, allocate=_Counting(fail_first=1), follow_peak=True)
    with pytest.raises(OSError):
        pool.lease(1 << 16)
    assert (pool.leased_bytes, pool.peak_leased_bytes) == (0, 0)
    t, _ = pool.lease(1 << 16)
    assert pool.leased_bytes == pool.peak_leased_bytes == 1 << 16
    del t
    gc.collect()
    assert pool.idle_bytes == 1 << 16 and pool.leased_bytes == 0


def test_blocks_returned_in_other_threads_and_the_collector_are_all_accounted() -> None:
    """Storages dying in another thread while this one leases and trims, and inside the
    garbage collector after close: every block is released exactly once, counters end at 0."""
    factory = _Counting()
    pool = HostBufferPool(4 << 16, allocate=factory, follow_peak=True)
    handed: queue.SimpleQueue[torch.Tensor | None] = queue.SimpleQueue()

    def dropper() -> None:
        while handed.get() is not None:  # the storage dies here, in this thread
            pass

    th = threading.Thread(target=dropper)
    th.start()
    try:
        for i in range(300):
            t, _ = pool.lease((i % 3 + 1) << 16)
            t[0] = 1  # in use
            handed.put(t)
            del t
            if i % 25 == 0:
                pool.trim()
    finally:
        handed.put(None)
        th.join()
    gc.collect()
    pool.trim()
    assert pool.leased_bytes == 0 and pool.idle_bytes == 0 and not factory.alive

    class Cycle:
        pass

    c = Cycle()
    c.self, c.t = c, pool.lease(1 << 16)[0]  # dies only in the collector
    del c
    pool.close()
    assert len(factory.alive) == 1
    gc.collect()  # the finalizer runs inside the collector, after close
    assert not factory.alive and pool.leased_bytes == 0


def test_blocks_returned_concurrently_after_close_are_all_uncounted() -> None:
    """After close, returns from many threads at once each release their block and
    leave the count exact (they are counted without the pool's lock)."""
    factory = _Counting()
    pool = HostBufferPool(1 << 20, allocate=factory)
    leases = [[pool.lease(1 << 16)[0] for _ in range(50)] for _ in range(4)]
    pool.close()
    assert pool.leased_bytes == 200 << 16
    start = threading.Barrier(len(leases))

    def drop(batch: list[torch.Tensor]) -> None:
        start.wait()
        while batch:
            batch.pop()  # the storage dies in this thread

    threads = [threading.Thread(target=drop, args=(batch,)) for batch in leases]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    del leases
    assert pool.leased_bytes == 0 and not factory.alive


# -- engines on the CPU twin and on disk ---------------------------------------------------


@contextlib.contextmanager
def _engine(
    save_dir: Path, *, twin: float | None = None, **kw: Any
) -> Iterator[tuple[OffloadEngine, SpanCopyDevice | None]]:
    """An engine with hooks; ``twin``: the CPU twin device path with this copy delay."""
    kw.setdefault("min_offload_bytes", 0)
    kw.setdefault("chunk_bytes", 16384)
    layer = None
    device = None
    if twin is not None:
        layer = SpanCopyDevice(
            "cpu", twin_delay=twin, max_inflight_bytes=kw.get("max_pending_write_bytes", 64 << 20)
        )
        device = RoutingDevice([layer])
    engine = OffloadEngine(
        OffloadConfig(target="disk", save_dir=str(save_dir), **kw), device=device
    )
    try:
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            yield engine, layer
    finally:
        engine.close(raise_errors=False)


def test_read_pool_keeps_nothing_after_close_with_a_prefetch_in_flight(save_dir: Path) -> None:
    """close() trimmed the read pool before it stopped the IO threads: a prefetch still
    reading then returned its block to a pool nobody trims any more, and the engine (which
    the user holds) kept that memory after exit (up to 2 * prefetch_depth tensors)."""
    a = torch.randn(1 << 14, requires_grad=True)
    started, release = threading.Event(), threading.Event()
    with _engine(save_dir, io_workers=1, chunk_bytes=4096, prefetch_depth=2) as (engine, _):
        other = [(a * (i + 2)).sin() for i in range(3)]  # a graph backward leaves alone
        y = (a * 7).sin()
        engine.flush()
        real_read = engine._store.read

        def gated(*args: Any) -> None:
            if threading.current_thread() is not threading.main_thread():  # prefetches only
                started.set()
                assert release.wait(10)
            real_read(*args)

        engine._store.read = gated  # type: ignore[method-assign]
        y.sum().backward()  # its unpack prefetches two of `other`'s records
        assert started.wait(10)
        real_shutdown = engine._pool.shutdown

        def shutdown(wait: bool = True) -> None:
            release.set()  # the prefetch finishes while close() runs
            real_shutdown(wait)

        engine._pool.shutdown = shutdown  # type: ignore[method-assign]
    assert torch.equal(a.grad, 7 * (a.detach() * 7).cos())
    assert engine._reader.read_pool.leased_bytes == 0
    assert engine._reader.read_pool.idle_bytes == 0
    del other


def test_an_interrupt_while_a_write_batch_is_submitted_loses_nothing(save_dir: Path) -> None:
    """A Ctrl-C landing in the submit of a taken batch dropped it: its bytes stayed
    pending with no job to write them, and the next pack at the cap waited forever."""
    x = torch.randn(1 << 17, requires_grad=True)  # 512 KiB saved per op
    with _engine(save_dir, chunk_bytes=4096, max_pending_write_bytes=1 << 20) as (engine, _):
        pool = engine._writer.pool
        real = pool.submit
        fired = []

        def interrupted(fn: Any, prio: Any) -> Any:
            if not fired:
                fired.append(1)
                raise KeyboardInterrupt
            return real(fn, prio)

        pool.submit = interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            (x * 2).exp()
        pool.submit = real  # type: ignore[method-assign]
        engine.flush()
        assert engine._writer.pending_bytes == 0
        done = threading.Event()
        kept = []

        def more() -> None:  # saved-tensor hooks are per thread
            with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
                kept.extend((x * (i + 3)).exp() for i in range(4))
            done.set()

        threading.Thread(target=more, daemon=True).start()
        assert done.wait(10), "a pack waited at the write cap for bytes no job writes"
        sum(y.sum() for y in kept).backward()
    ref = x.detach().clone().requires_grad_()
    sum(y.sum() for y in [(ref * (i + 3)).exp() for i in range(4)]).backward()
    assert torch.equal(x.grad, ref.grad)


def test_an_interrupt_after_a_write_batch_was_queued_writes_it_once(save_dir: Path) -> None:
    """A Ctrl-C landing in the pool's submit after the job was queued: the batch goes
    back for a later submit, and the queued job, not started yet, writes nothing."""
    x = torch.randn(1 << 14, requires_grad=True)
    with _engine(save_dir, chunk_bytes=1 << 20) as (engine, _):  # submitted at the flush
        writer = engine._writer
        pool = writer.pool
        real_submit, real_done = pool.submit, writer._write_done
        gate = threading.Event()
        settled: list[int] = []

        def queued_then_interrupted(fn: Any, prio: Any) -> Any:
            def held() -> None:  # the IO thread starts the job only after the interrupt
                gate.wait(10)
                fn()

            real_submit(held, prio)
            raise KeyboardInterrupt

        def counted(rec: Any, exc: Any, culprit: Any = None) -> None:
            settled.append(id(rec))
            real_done(rec, exc, culprit)

        writer._write_done = counted  # type: ignore[method-assign]
        pool.submit = queued_then_interrupted  # type: ignore[method-assign]
        y = (x * 2).exp()
        with pytest.raises(KeyboardInterrupt):
            engine.flush()
        pool.submit = real_submit  # type: ignore[method-assign]
        gate.set()
        engine.flush()
        assert len(settled) == len(set(settled)) == 1  # one record, settled once
        assert writer.pending_bytes == 0
        y.sum().backward()
    assert torch.equal(x.grad, 2 * (x.detach() * 2).exp())


def test_flush_waits_for_a_batch_whose_interrupted_submit_had_started_it(
    save_dir: Path,
) -> None:
    """The interrupt lands after an IO thread began the job: the batch is written by
    it, and flush() waits for that job though no future of it was kept."""
    x = torch.randn(1 << 14, requires_grad=True)
    with _engine(save_dir, chunk_bytes=1 << 20) as (engine, _):
        writer, store = engine._writer, engine._store
        pool = writer.pool
        real_submit, real_write = pool.submit, store.write
        began, release = threading.Event(), threading.Event()

        def slow_write(*args: Any) -> Any:
            began.set()
            assert release.wait(10)
            return real_write(*args)

        def started_then_interrupted(fn: Any, prio: Any) -> Any:
            real_submit(fn, prio)
            assert began.wait(10)  # an IO thread is writing the batch
            raise KeyboardInterrupt

        store.write = slow_write  # type: ignore[method-assign]
        pool.submit = started_then_interrupted  # type: ignore[method-assign]
        y = (x * 2).exp()
        with pytest.raises(KeyboardInterrupt):
            engine.flush()
        pool.submit = real_submit  # type: ignore[method-assign]
        threading.Timer(0.3, release.set).start()
        engine.flush()
        assert writer.pending_bytes == 0  # landed before flush returned
        y.sum().backward()
    assert torch.equal(x.grad, 2 * (x.detach() * 2).exp())


def test_an_interrupted_submit_wakes_a_pack_waiting_at_the_cap(save_dir: Path) -> None:
    """Another thread's pack waits at the write cap for bytes in a batch whose submit
    was interrupted: the batch went back into the open one, and the waiter submits it."""
    small = torch.randn(1 << 14, requires_grad=True)  # 64 KiB: stays in the open batch
    big = torch.randn(1 << 15, requires_grad=True)  # 128 KiB: over the cap beside it
    with _engine(save_dir, chunk_bytes=1 << 20, max_pending_write_bytes=160 << 10) as (
        engine,
        _,
    ):
        pool = engine._writer.pool
        real = pool.submit
        hold, entered = threading.Event(), threading.Event()
        fired: list[int] = []

        def slow_then_interrupted(fn: Any, prio: Any) -> Any:
            if not fired:
                fired.append(1)
                entered.set()
                hold.wait(10)  # meanwhile the other thread's pack waits at the cap
                raise KeyboardInterrupt
            return real(fn, prio)

        pool.submit = slow_then_interrupted  # type: ignore[method-assign]
        a = (small * 2).exp()
        kept: list[torch.Tensor] = []
        done = threading.Event()

        def pack_at_cap() -> None:
            with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
                kept.append((big * 3).exp())
            done.set()

        def flush() -> None:
            with contextlib.suppress(KeyboardInterrupt):
                engine.flush()

        flusher = threading.Thread(target=flush, daemon=True)
        flusher.start()
        assert entered.wait(10)
        packer = threading.Thread(target=pack_at_cap, daemon=True)
        packer.start()
        time.sleep(0.2)  # the packer reaches the cap and waits
        hold.set()
        flusher.join(10)
        assert done.wait(10), "a pack waited at the write cap for a batch no job writes"
        (a.sum() + kept[0].sum()).backward()
    assert torch.equal(small.grad, 2 * (small.detach() * 2).exp())
    assert torch.equal(big.grad, 3 * (big.detach() * 3).exp())


def test_read_pool_keeps_nothing_for_a_backward_after_exit(save_dir: Path) -> None:
    """A graph made inside the context and used after it reads synchronously; the blocks
    those reads lease go when their tensors die, not into a pool the engine keeps."""
    a = torch.randn(1 << 14, requires_grad=True)
    with _engine(save_dir, chunk_bytes=4096) as (engine, _):
        y = (a * 3).sin()
        engine.flush()
    y.sum().backward()  # after exit
    assert torch.equal(a.grad, 3 * (a.detach() * 3).cos())
    pool = engine._reader.read_pool
    assert (pool.leased_bytes, pool.idle_bytes) == (0, 0)


@pytest.mark.parametrize(
    ("stage_writes", "io_method"),
    [("never", "auto"), ("always", "auto"), ("never", "buffered"), ("never", "mmap")],
)
def test_verify_accepts_bytes_outside_saved_views_changing_during_the_write(
    save_dir: Path, stage_writes: str, io_method: str
) -> None:
    """NOTE [dedup]: the gaps of a saved strided view may legally change through an alias
    with its own version counter (``x.data``). With verify=True the checksum was taken
    from the tensor's memory before the write read that memory again, so a change in
    between failed a correct tensor's read with "checksum mismatch"."""
    a = torch.randn(1 << 14, requires_grad=True)
    started, release = threading.Event(), threading.Event()
    with _engine(
        save_dir,
        verify=True,
        io_workers=1,
        chunk_bytes=4096,
        stage_writes=stage_writes,
        io_method=io_method,
        prefetch_depth=0,
    ) as (engine, _):
        # Hold the write job where it reads the memory (again): the store's write, or
        # the staging copy (staged writes copy first, then write from the copy).
        owner, name = (
            (engine._writer, "_staged_write")
            if stage_writes == "always"
            else (engine._store, "write")
        )
        real_write = getattr(owner, name)

        def gated(*args: Any) -> None:
            started.set()
            assert release.wait(10)
            real_write(*args)

        setattr(owner, name, gated)
        x = a * 2
        y = x[::2].sin()  # saves x[::2]: its span holds x[1::2], which no saved view holds
        other = torch.randn(1 << 10, requires_grad=True).exp()  # NOTE [write batches]:
        # the next record's pack submits the batch the exposed record filled
        assert started.wait(10)  # the write job has begun
        x.data[1::2] = 0.0
        release.set()
        engine.flush()  # on disk: backward reads it back and checks it
        y.sum().backward()
    expect = torch.zeros_like(a)
    expect[::2] = 2 * (2 * a.detach()[::2]).cos()
    assert torch.equal(a.grad, expect)
    assert engine.stats().bytes_read > 0
    del other


def test_verify_still_catches_corruption_of_a_staged_exposed_record(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checksums taken from the staging copy still guard the bytes on disk."""
    a = torch.randn(1 << 14, requires_grad=True)
    with _engine(save_dir, verify=True, io_method="buffered", prefetch_depth=0) as (engine, _):
        y = (a * 2)[::2].sin()
        engine.flush()
        assert engine.stats().bytes_staged > 0  # exposed: written through staging
        real_read = engine._store.read

        def corrupting(extent: Extent, offset: int, out: memoryview) -> None:
            real_read(extent, offset, out)
            out[len(out) // 2] ^= 0x01

        monkeypatch.setattr(engine._store, "read", corrupting)
        with pytest.raises(OffloadIOError, match="checksum mismatch"):
            y.sum().backward()


def test_fds_and_disk_space_come_back_after_a_failed_write(save_dir: Path) -> None:
    """An EIO write: the error reaches flush, the tensor stays in memory (exact grads),
    its extent is freed, and no descriptor outlives the engine."""
    gc.collect()  # earlier tests' engines
    base = _fds()
    x = torch.randn(1 << 14, requires_grad=True)
    with _engine(save_dir, chunk_bytes=4096) as (engine, _):

        def failing(*args: Any) -> None:
            raise OSError(errno.EIO, "Input/output error")

        engine._store.write = failing  # type: ignore[method-assign]
        y = (x * 2).sin()
        with pytest.raises(OffloadIOError, match="Input/output error"):
            engine.flush()
        assert engine.stats().disk_bytes_in_use == 0
        y.sum().backward()
    assert torch.equal(x.grad, 2 * (2 * x.detach()).cos())
    stats = engine.stats()
    assert stats.fallbacks == 1 and stats.disk_bytes_reserved == 0
    del engine, y
    gc.collect()
    assert _fds() == base


def _tiny() -> tuple[TinyTransformer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    tokens, targets = make_batch(2, 16, vocab=64)
    return TinyTransformer(vocab=64, width=32, depth=2, heads=2), tokens, targets


def _retain(m: TinyTransformer, tok: torch.Tensor, tgt: torch.Tensor, e: Any) -> None:
    loss = m(tok, tgt)
    loss.backward(retain_graph=True)  # the second pass reads what the first let go
    loss.backward()


def _checkpointed(m: TinyTransformer, tok: torch.Tensor, tgt: torch.Tensor, e: Any) -> None:
    x = m.embed(tok)
    for block in m.blocks:
        x = checkpoint(block, x, use_reentrant=False)
    logits = m.head(m.norm(x))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
    if e is not None:
        e.flush()
    loss.backward()


def _interleaved(m: TinyTransformer, tok: torch.Tensor, tgt: torch.Tensor, e: Any) -> None:
    first, second = m(tok, tgt), m(tok, tgt)
    first.backward()  # skips the tail writes (of `second`'s last tensors)
    third = m(tok, tgt)  # forward again: the skipped tensors are queued again
    (second + third).backward()


def _flushed(m: TinyTransformer, tok: torch.Tensor, tgt: torch.Tensor, e: Any) -> None:
    loss = m(tok, tgt)
    if e is not None:
        e.flush()
    loss.backward()


Step = Callable[[TinyTransformer, torch.Tensor, torch.Tensor, Any], None]


@pytest.mark.parametrize("step", [_retain, _checkpointed, _interleaved, _flushed])
@pytest.mark.parametrize(
    "kw",
    [
        {"stage_writes": "always"},
        {"stage_writes": "always", "verify": True, "max_pending_write_bytes": 1 << 16},
        {"verify": True, "io_method": "buffered", "slab_bytes": 4096},  # > a slab: own slabs
        {"io_method": "mmap", "prefetch_depth": 1},
    ],
    ids=["staged", "staged-verify-cap", "verify-tiny-slabs", "mmap"],
)
def test_twin_grads_bit_identical_with_staging_verify_and_copy_delays(
    save_dir: Path, step: Step, kw: dict[str, Any]
) -> None:
    """The CPU twin's late copies with staged and checksummed writes, retain_graph,
    checkpointing and the write-tail skip: exact gradients, and every pooled buffer
    (pinned, read, staging) and every byte of slab space back when it is over."""
    model, tokens, targets = _tiny()
    ref = copy.deepcopy(model)
    step(ref, tokens, targets, None)
    with _engine(save_dir, twin=0.002, **kw) as (engine, layer):
        step(model, tokens, targets, engine)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)
    gc.collect()
    stats = engine.stats()
    # Taken by the engine: written, or kept by the write tail (a loaded machine can
    # leave every write of this tiny step queued when backward starts).
    assert stats.tensors_offloaded + stats.writes_skipped > 0 and stats.fallbacks == 0
    assert stats.disk_bytes_in_use == 0 and stats.disk_bytes_reserved == 0
    if kw.get("stage_writes") == "always" and engine.io_method == "direct":
        assert stats.bytes_staged >= stats.bytes_offloaded
    assert layer is not None and layer.pool.leased_bytes == 0 and layer.pool.idle_bytes == 0
    for pool in (engine._reader.read_pool, engine._writer.stage_pool):
        assert pool.leased_bytes == 0 and pool.idle_bytes == 0
