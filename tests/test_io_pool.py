"""Futures and pools: exactly-once jobs, errors with tracebacks, priorities, real overlap."""

from __future__ import annotations

import gc
import threading
import time
import traceback
import weakref

import pytest

from prefetch_offload.io_pool import READ, WRITE, InlineIOPool, IOFuture, ThreadIOPool


def test_future_runs_once_for_the_claimer() -> None:
    calls: list[int] = []
    fut: IOFuture[int] = IOFuture(lambda: calls.append(1) or 7)
    assert fut.claim()
    assert not fut.claim()
    fut.run()
    assert fut.done() and fut.result() == 7 and calls == [1]
    assert not fut.cancel()


def test_error_is_re_raised_with_its_traceback() -> None:
    def job() -> None:
        raise OSError(5, "disk said no")

    fut: IOFuture[None] = IOFuture(job)
    fut.claim()
    fut.run()
    with pytest.raises(OSError, match="disk said no") as info:
        fut.result()
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "job" in frames


def test_cancel_before_start() -> None:
    fut: IOFuture[int] = IOFuture(lambda: 1)
    assert fut.cancel()
    assert not fut.claim()
    assert fut.done()


def test_inline_pool_runs_at_submit() -> None:
    fut = InlineIOPool().submit(lambda: 3, READ)
    assert fut.done() and fut.result() == 3


def test_thread_pool_overlaps_jobs() -> None:
    """Two jobs really run at once: each waits at a barrier only the other can release."""
    pool = ThreadIOPool(2)
    barrier = threading.Barrier(2, timeout=5)
    stamps: list[tuple[float, float]] = []

    def job() -> None:
        start = time.perf_counter()
        barrier.wait()
        stamps.append((start, time.perf_counter()))

    futs = [pool.submit(job, WRITE) for _ in range(2)]
    for f in futs:
        f.result()
    pool.shutdown()
    assert max(s for s, _ in stamps) < min(e for _, e in stamps)


def test_reads_jump_the_write_queue() -> None:
    pool = ThreadIOPool(1)
    gate = threading.Event()
    order: list[str] = []
    blocker = pool.submit(gate.wait, WRITE)  # occupies the only worker
    time.sleep(0.05)
    writes = [pool.submit(lambda i=i: order.append(f"w{i}"), WRITE) for i in range(3)]
    read = pool.submit(lambda: order.append("r"), READ)
    gate.set()
    for f in [blocker, *writes, read]:
        f.result()
    pool.shutdown()
    assert order[0] == "r"


def test_a_claimed_job_is_skipped_by_workers() -> None:
    pool = ThreadIOPool(1)
    gate = threading.Event()
    pool.submit(gate.wait, WRITE)
    ran_in: list[str] = []
    fut = pool.submit(lambda: ran_in.append(threading.current_thread().name), READ)
    assert fut.claim()  # a hook thread takes the job before a worker does
    fut.run()
    gate.set()
    pool.shutdown()
    assert ran_in == [threading.current_thread().name]


def test_a_taken_result_is_not_kept_by_the_queue() -> None:
    # A job a hook thread claimed stays queued until a worker pops it; the
    # worker here is busy, so only take() lets the result go (a read buffer).
    pool = ThreadIOPool(1)
    gate, busy = threading.Event(), threading.Event()
    pool.submit(lambda: (busy.set(), gate.wait()), WRITE)
    assert busy.wait(10)

    class Buffer:
        pass

    fut = pool.submit(Buffer, READ)
    assert fut.claim()
    fut.run()
    buf = fut.take()
    alive = weakref.ref(buf)
    del buf, fut
    gc.collect()
    try:
        assert alive() is None
    finally:
        gate.set()
        pool.shutdown()


def test_take_is_for_one_consumer() -> None:
    fut = InlineIOPool().submit(lambda: 7, READ)
    assert fut.take() == 7
    with pytest.raises(RuntimeError, match="already taken"):
        fut.take()
    with pytest.raises(RuntimeError, match="already taken"):
        fut.result()
    failing = InlineIOPool().submit(lambda: 1 / 0, READ)
    with pytest.raises(ZeroDivisionError):
        failing.take()


def test_shutdown_finishes_queued_jobs_and_stops_threads() -> None:
    pool = ThreadIOPool(2)
    done: list[int] = []
    for i in range(20):
        pool.submit(lambda i=i: (time.sleep(0.001), done.append(i)), WRITE)
    pool.shutdown()
    assert sorted(done) == list(range(20))
    assert not any(t.is_alive() for t in pool.threads)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None, READ)


def test_a_thread_that_cannot_start_stops_those_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A limit on threads met part way: the error goes up, and the threads already
    started stop (none is left waiting for jobs for good)."""
    start = threading.Thread.start
    started: list[threading.Thread] = []

    def limited(self: threading.Thread) -> None:
        if len(started) == 2:
            raise RuntimeError("can't start new thread")
        start(self)
        started.append(self)

    monkeypatch.setattr(threading.Thread, "start", limited)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        ThreadIOPool(4)
    monkeypatch.undo()
    assert len(started) == 2
    for t in started:
        t.join(5)
    assert not any(t.is_alive() for t in started)


def test_a_wakeup_lost_to_an_interrupted_notify_still_runs_the_job() -> None:
    """NOTE [interrupts]: a Ctrl-C inside ``Condition.notify``, after it woke the idle
    worker and before it dropped it from its list, leaves an entry that the next
    notify wakes instead of the worker; the worker looks at its queue again anyway."""
    pool = ThreadIOPool(1)
    try:
        deadline = time.monotonic() + 5
        while not pool._cond._waiters and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.001)  # the worker is idle, waiting
        ran = threading.Event()
        with pool._cond:  # what an interrupted submit leaves: queued, waiter woken, listed
            first = IOFuture(lambda: None)
            pool._heap.append((WRITE, -1, first))
            pool._cond._waiters[0].release()  # type: ignore[attr-defined]
        first.wait()
        fut = pool.submit(ran.set, WRITE)  # its notify wakes the stale entry only
        assert ran.wait(timeout=5), "the worker never ran the job"
        fut.wait()
    finally:
        pool.shutdown()


def test_an_interrupt_cannot_leave_a_pool_or_future_lock_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [interrupts]: ``with condition:`` runs the condition's Python ``__enter__``,
    which a Ctrl-C can end after it took the lock, keeping it for good (every later
    submit, worker and exit then hangs). The pool and its futures enter their
    conditions through the C lock: a condition's ``__enter__`` that is interrupted
    so is never run."""
    real_enter = threading.Condition.__enter__

    def interrupted_enter(self: threading.Condition) -> bool:
        real_enter(self)
        raise KeyboardInterrupt  # after the lock was taken, before the block

    pool = ThreadIOPool(1)
    try:
        monkeypatch.setattr(threading.Condition, "__enter__", interrupted_enter)
        ran: list[int] = []
        fut = pool.submit(lambda: ran.append(1), WRITE)
        fut.wait()
        assert ran == [1] and fut.exception() is None
        own: IOFuture[int] = IOFuture(lambda: 7)
        assert own.claim()
        own.run()
        assert own.take() == 7
    finally:
        monkeypatch.undo()
        pool.shutdown()
