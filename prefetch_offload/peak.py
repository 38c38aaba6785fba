"""The most memory a span of time held: a thread samples it while the plan is measured.

NOTE [plans within the noise] in recompute_planner.py says what reads it. The peak is sampled,
not read from the kernel's high-water mark (``VmHWM``), because resetting that mark
(``/proc/self/clear_refs``) would reset the peak a user or a profiler measures too.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable

from .heap import anon_resident_bytes

__all__ = ["PeakSampler"]

logger = logging.getLogger("prefetch_offload")

# Seconds between two samples: a block's recompute on the project's CPU lasts 25-100
# ms, so its peak lasts several samples; one read of /proc/self/statm costs ~10 us.
SAMPLE_INTERVAL_S = 0.002

_SAMPLERS: weakref.WeakSet[PeakSampler] = weakref.WeakSet()


class PeakSampler:
    """The most of ``read()`` (bytes) between two :meth:`take` calls, sampled every
    ``interval`` seconds by a daemon thread while started, and at each ``take``.

    A failed read, or a thread that cannot start, stops the sampling for good (one log
    line), and ``take`` returns 0 (unknown) from then on: what reads the peaks then
    goes by time alone. So does the child of a fork.
    """

    def __init__(
        self,
        read: Callable[[], int] = anon_resident_bytes,
        *,
        interval: float = SAMPLE_INTERVAL_S,
    ) -> None:
        self._read = read
        self._interval = interval
        self._lock = threading.Lock()
        self._peak = 0
        self._span = 0  # take() counts the spans: a reading from an ended span is dropped
        self._failed = False
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        # The running thread's stop event, set when the sampler is dropped (one finalizer).
        self._event_box: list[threading.Event | None] = [None]
        weakref.finalize(self, _set_event, self._event_box)
        _SAMPLERS.add(self)

    def start(self) -> None:
        """Sample in the background until :meth:`stop` (again after a stop)."""
        with self._lock:
            if self._stop is not None or self._failed:
                return
            stop = self._stop = threading.Event()
            thread = threading.Thread(
                target=_sample, args=(weakref.ref(self), stop), name="prefetch_offload-peak"
            )
            thread.daemon = True  # it holds no resource; it ends at stop or with the sampler
            # Known before it runs: a thread that fails at once is joined by a later stop.
            self._thread, self._event_box[0] = thread, stop
        try:
            thread.start()
        except RuntimeError as exc:  # no thread can be started (limits, shutdown)
            with self._lock:
                self._stop = self._thread = None
            self._fail(f"cannot start the sampling thread ({exc})")

    def stop(self) -> None:
        """Stop the background samples (``take`` still samples once) and wait for the
        thread, which is between two reads of a few microseconds."""
        current = threading.current_thread()
        with self._lock:
            stop, self._stop = self._stop, None
            thread = self._thread
            if thread is not current:  # (the thread itself, failing: a later stop joins it)
                self._thread = None
        if stop is not None:
            stop.set()
        if thread is not None and thread is not current and thread.ident is not None:
            thread.join(timeout=1.0)  # (not started yet: it sees the event and ends)

    @property
    def running(self) -> bool:
        """Whether the background samples run."""
        return self._stop is not None

    def take(self) -> int:
        """The most sampled since the last call, this moment included; 0 once sampling
        failed. The next span starts from this moment's reading."""
        now = self.sample()
        with self._lock:
            peak, self._peak = max(self._peak, now), now
            self._span += 1
        return 0 if self._failed else peak

    def sample(self) -> int:
        """One reading, kept if it is the most of this span; 0 once sampling failed."""
        if self._failed:
            return 0
        span = self._span
        try:
            value = self._read()
        except Exception as exc:  # no /proc, a CUDA error: never the user's
            self._fail(f"reading memory failed ({exc!r})")
            return 0
        with self._lock:
            if value > self._peak and span == self._span:  # (not a reading from before take)
                self._peak = value
        return value

    def _fail(self, why: str) -> None:
        with self._lock:
            already, self._failed = self._failed, True
        if not already:
            logger.info("prefetch_offload: memory peaks not sampled: %s", why)
        self.stop()

    def _after_fork_in_child(self) -> None:
        """No sampling thread in the child of a fork, and the lock may have been copied
        held: the child's peaks are unknown."""
        self._lock = threading.Lock()
        self._stop = self._thread = None
        self._failed = True


def _set_event(box: list[threading.Event | None]) -> None:
    event = box[0]
    if event is not None:
        event.set()


def _sample(ref: weakref.ref[PeakSampler], stop: threading.Event) -> None:
    """The sampling thread: holds its sampler only while it samples."""
    while True:
        sampler = ref()
        if sampler is None:
            return
        interval = sampler._interval
        sampler.sample()
        del sampler
        if stop.wait(interval):
            return


def _after_fork_in_child() -> None:
    for sampler in list(_SAMPLERS):
        sampler._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
