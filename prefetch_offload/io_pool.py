"""Background IO: futures and the pools that run read and write jobs.

Two pools share one interface. :class:`InlineIOPool` runs each job in the
calling thread when it is submitted: the simple reference that tests compare
the fast path against. :class:`ThreadIOPool` runs jobs on ``workers`` daemon
threads, reads before writes (backward waits on reads; forward does not wait
on writes until the byte cap is hit).

# NOTE [claiming jobs]
# A job runs exactly once, in whichever thread claims it first: a worker that
# pops it, or a hook thread that needs the result now and would rather do the
# read itself than wait behind a queue of prefetches. ``IOFuture.claim`` is that
# atomic PENDING -> RUNNING step; the loser of the race just waits on the result.
# A job a hook thread claimed is still in the pool's queue until a worker pops
# and skips it, which can be long after the hook used the result (every worker
# busy with reads). So the job's one consumer takes the result with
# ``IOFuture.take``, which leaves the future without it: a read's buffer is
# held by the tensor autograd uses, never by a queued future.
#
# NOTE [interrupts]
# A ``KeyboardInterrupt`` (Ctrl-C) is raised in the main thread between any two of
# its calls, the hooks' included, so bookkeeping the hooks share with the IO
# threads can be left half done, and Python's own threading code with it:
# ``Condition.notify``, interrupted after it woke a waiter and before it dropped
# it from its list, leaves an entry that the next notify wakes instead of a
# thread; ``with condition:`` can keep the lock for good, as the condition's
# ``__enter__`` is Python code that an interrupt can end once it has taken the
# lock. A user who interrupts a step and trains on (as in a notebook), or leaves
# the context, must not hang on that. So a condition is entered through its lock
# (a C lock's ``__enter__`` and the block that follows are not split by an
# interrupt), and no wait depends on a wakeup an interrupted call owed: an idle
# worker looks at its queue again every RECHECK_S, whatever woke it; a pack at
# the write cap waits only while a write job that can lower the pending bytes is
# running or queued, looking again as often (``WritePath.queue``), and bytes an
# interrupt left counted with no job to write them are forgotten by the next
# ``flush`` that finds no job, no open batch and no batch on its way to the pool;
# a write the backward skips is dropped in one step (``IOFuture.cancel``). What an
# interrupt can lose is memory, never a value: a record whose write batch it lost
# stays in memory (served from there, as every record whose write has not
# finished) and keeps its slab space until it dies.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .streams import isolate_from_captures

__all__ = ["READ", "RECHECK_S", "WRITE", "IOFuture", "IOPool", "InlineIOPool", "ThreadIOPool"]

T = TypeVar("T")

READ = 0  # priority: reads first
WRITE = 1
# NOTE [interrupts]: an idle worker looks at its queue at least this often.
RECHECK_S = 0.5

_PENDING, _RUNNING, _DONE = 0, 1, 2


class IOFuture(Generic[T]):
    """The result of one IO job: ``done()``, ``result()``, and ``claim()``/``run()``.

    A job's exception is stored and re-raised, with its traceback, by ``result()``.
    """

    __slots__ = ("_cond", "_exc", "_fn", "_lock", "_result", "_state")

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn: Callable[[], T] | None = fn
        self._state = _PENDING
        self._result: T | None = None
        self._exc: BaseException | None = None
        # Entered as the lock, never as the condition (NOTE [interrupts]).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    def claim(self) -> bool:
        """Take the right to run the job (NOTE [claiming jobs]). True for exactly one caller."""
        with self._lock:
            if self._state != _PENDING:
                return False
            self._state = _RUNNING
            return True

    def cancel(self) -> bool:
        """Drop the job if nobody has started it. Returns whether it was dropped."""
        with self._lock:
            if self._state != _PENDING:
                return False
            self._state = _DONE
            self._fn = None
            self._exc = CancelledIO()
            self._cond.notify_all()
            return True

    def run(self) -> None:
        """Run the claimed job and publish its result or exception."""
        fn, self._fn = self._fn, None
        result: T | None = None
        exc: BaseException | None = None
        try:
            assert fn is not None, "IOFuture.run() without a successful claim()"
            result = fn()
        except BaseException as e:  # stored and re-raised by result()
            exc = e
        # Drop the job (and whatever it references) before anyone can see it done.
        del fn
        with self._lock:
            self._result, self._exc, self._state = result, exc, _DONE
            self._cond.notify_all()

    def done(self) -> bool:
        """Whether the job has finished (or was cancelled)."""
        return self._state == _DONE

    def wait(self) -> None:
        """Block until the job has finished."""
        with self._lock:
            while self._state != _DONE:
                self._cond.wait()

    def result(self) -> T:
        """Wait for the job and return its value, or raise its exception."""
        self.wait()
        if self._exc is not None:
            raise self._exc
        return self._result  # type: ignore[return-value]

    def take(self) -> T:
        """``result()`` for the job's one consumer: the future lets go of the value
        (NOTE [claiming jobs]); a later ``take()`` or ``result()`` raises RuntimeError."""
        self.wait()
        with self._lock:
            if self._exc is not None:
                raise self._exc
            result, self._result = self._result, None
            self._exc = RuntimeError("IOFuture: its result was already taken (take())")
        return result  # type: ignore[return-value]

    def exception(self) -> BaseException | None:
        """Wait for the job and return its exception, or None."""
        self.wait()
        return self._exc


class CancelledIO(Exception):
    """Stored in a future whose job was cancelled before it started."""


class IOPool:
    """Runs IO jobs. Subclasses decide where."""

    def submit(self, fn: Callable[[], T], priority: int) -> IOFuture[T]:
        raise NotImplementedError

    def shutdown(self, wait: bool = True) -> None:
        """Finish every queued job, then stop (waiting for the threads if ``wait``). Idempotent."""


class InlineIOPool(IOPool):
    """Runs every job at once in the submitting thread (the reference path)."""

    def submit(self, fn: Callable[[], T], priority: int) -> IOFuture[T]:
        fut: IOFuture[T] = IOFuture(fn)
        fut.claim()
        fut.run()
        return fut


class InlineAfterShutdown(IOPool):
    """Runs jobs on ``pool`` until shutdown, then inline in the submitting thread.

    The engine's parts share one of these, so that a graph used after its
    context exited reads synchronously without anyone swapping pools.
    """

    def __init__(self, pool: IOPool) -> None:
        self.pool = pool

    def submit(self, fn: Callable[[], T], priority: int) -> IOFuture[T]:
        return self.pool.submit(fn, priority)

    def shutdown(self, wait: bool = True) -> None:
        pool, self.pool = self.pool, InlineIOPool()
        pool.shutdown(wait)


class ThreadIOPool(IOPool):
    """``workers`` daemon threads pulling jobs from one priority queue.

    Jobs make CUDA calls (copy events, copies to the device, pinned blocks), so each
    thread runs in thread-local capture mode from its first job on: a CUDA graph
    captured by another thread never sees them (NOTE [capture mode] in streams.py).
    """

    def __init__(self, workers: int, name: str = "prefetch_offload-io") -> None:
        self._lock = threading.Lock()  # entered as the lock (NOTE [interrupts])
        self._cond = threading.Condition(self._lock)
        self._heap: list[tuple[int, int, IOFuture[object]]] = []
        self._seq = itertools.count()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        try:
            for i in range(workers):
                t = threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                t.start()  # (may fail: a limit on threads)
                self._threads.append(t)
        except BaseException:
            self.shutdown()  # the threads already started stop
            raise

    def submit(self, fn: Callable[[], T], priority: int) -> IOFuture[T]:
        fut: IOFuture[T] = IOFuture(fn)
        with self._lock:
            if self._stopping:
                raise RuntimeError("ThreadIOPool.submit after shutdown")
            heapq.heappush(self._heap, (priority, next(self._seq), fut))  # type: ignore[arg-type]
            self._cond.notify()
        return fut

    def _work(self) -> None:
        isolated = False
        while True:
            with self._lock:
                while not self._heap and not self._stopping:
                    self._cond.wait(RECHECK_S)  # NOTE [interrupts]: a wakeup may be lost
                if not self._heap:
                    return
                _, _, fut = heapq.heappop(self._heap)
            if not isolated:  # NOTE [capture mode]: until CUDA is initialized, every job
                isolated = isolate_from_captures()
            if fut.claim():
                fut.run()
            del fut  # an idle worker must not keep the last result (a read buffer) alive

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            self._stopping = True
            self._cond.notify_all()
        if not wait:
            return
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads (for tests and diagnostics)."""
        return list(self._threads)
