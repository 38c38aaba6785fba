"""The most memory a span of time held: a thread samples it while the plan is measured.

NOTE [plans within the noise] in recompute.py says what reads it. The peak is sampled,
not read from the kernel's high-water mark (``VmHWM``), because resetting that mark
(``/proc/self/clear_refs``) would reset the peak a user or a profiler measures too;
CUDA's own peak counters would need ``torch.cuda.reset_peak_memory_stats``, which
they share with the user as well.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

from .heap import resident_bytes

__all__ = ["PeakSampler"]

logger = logging.getLogger("prefetch_offload")

# Seconds between two samples: a block's recompute on the project's CPU lasts 25-100
# ms, so its peak lasts several samples; one read of /proc/self/statm costs ~10 us.
SAMPLE_INTERVAL_S = 0.002


class PeakSampler:
    """The most of ``read()`` (bytes) between two :meth:`take` calls, sampled every
    ``interval`` seconds by a daemon thread while started, and at each ``take``.

    A failed read stops the sampling for good (one log line) and ``take`` returns 0
    from then on: what reads the peaks then goes by time alone.
    """

    def __init__(
        self, read: Callable[[], int] = resident_bytes, *, interval: float = SAMPLE_INTERVAL_S
    ) -> None:
        self._read = read
        self._interval = interval
        self._lock = threading.Lock()
        self._peak = 0
        self._failed = False
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

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
        weakref.finalize(self, stop.set)
        thread.start()
        with self._lock:
            if self._stop is stop:  # (a stop meanwhile: the thread sees the event and ends)
                self._thread = thread

    def stop(self) -> None:
        """Stop the background samples (``take`` still samples once) and wait for the
        thread, which is between two reads of a few microseconds."""
        with self._lock:
            stop, self._stop = self._stop, None
            thread, self._thread = self._thread, None
        if stop is not None:
            stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)

    @property
    def running(self) -> bool:
        """Whether the background samples run."""
        return self._stop is not None

    def take(self) -> int:
        """The most sampled since the last call, this moment included; 0 once a read
        failed. The next span starts from this moment's reading."""
        now = self.sample()
        with self._lock:
            peak, self._peak = max(self._peak, now), now
        return 0 if self._failed else peak

    def sample(self) -> int:
        """One reading, kept if it is the most of this span; 0 once a read failed."""
        if self._failed:
            return 0
        try:
            value = self._read()
        except (OSError, ValueError, IndexError) as exc:  # no /proc (not Linux), a bad read
            with self._lock:
                already, self._failed = self._failed, True
            if not already:
                logger.info("prefetch_offload: memory peaks not sampled (%s)", exc)
            self.stop()
            return 0
        with self._lock:
            if value > self._peak:
                self._peak = value
        return value


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
