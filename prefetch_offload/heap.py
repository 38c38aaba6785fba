"""Giving the heap memory that glibc keeps back to the kernel, once per training step.

# NOTE [heap trim]
# glibc's malloc keeps the memory a program frees, to reuse it, and gives back to
# the kernel only a free top of the heap (or a freed block of its own mapping,
# which PyTorch's tensors stop getting once glibc raises its mmap threshold to
# their size). A training step's heap is fragmented: small allocations that live
# until backward sit between large freed blocks. Offloading frees every activation
# as its write lands, so forward leaves the heap full of freed holes that glibc
# keeps resident, and backward's gradients and temporaries then wander through
# them. Measured on bench/step.py's transformer (6 blocks, width 256, batch
# 8x256, 248.6 MiB saved per step; 2-core VM, glibc 2.36): with disk offload the
# heap held 25-45 MiB of live bytes above its size before training while its main
# arena grew by ~200 MiB, 160-210 MiB of it free in 40-55 chunks of 1-22 MiB;
# the process's peak RSS was ~300 MiB above its RSS before training against ~400
# without offload: about half the activation memory cut, where the live bytes
# promised almost all of it.
#
# ``malloc_trim(0)`` returns the whole free pages inside those holes (every
# arena, not only the top). Each page that is used again later costs a page
# fault and a page of zeroing (about 1.8 us per 4 KiB page there, 0.45 ms per
# MiB), and after a trim glibc's allocations wander over the cold pages it gave
# back (a freed block coalesces with its cold neighbours and is split from
# their start), so every trim costs faults in proportion to what the process
# allocates after it. So the engine trims once per step, where the fewest
# bytes are live and the most were just freed: when a forward begins after a
# backward (the previous step's activations, gradients and temporaries are
# garbage then), if that step saved at least ``heap_trim_bytes`` of CPU
# activations. Within the step, forward's later tensors reuse the blocks its
# written activations left, and backward reuses what forward left, all of it
# resident: the peak is the step's own growth from a trimmed heap. A trim runs
# on an IO thread as a job of write priority (queued reads go first; the hooks
# never wait for it), at most one at a time.
#
# Measured on that transformer (docs/tuning.md section 4), time side by side
# with each configuration in its own process: one trim per step at the
# forward's start cost ~52k page faults per step and 1.33x the step time of no
# offload (no trims: ~14k, 1.22x); trims when backward starts and every 128 MiB
# of activations saved or unpacked (4 per step) cost ~105k faults, 1.47-1.55x,
# and held no lower peak than one trim per step, measured side by side in two
# states of the VM: ~185-195 MiB above the RSS before training for both (cuts
# of 81-91%) in one, ~285-297 for both (40-49%) in another (what sets the
# state is not known); without offload ~395-415. One trim when backward starts held ~275
# MiB in the first state: backward's gradients wander over the pages forward's
# holes gave back. At 4x the batch (993 MiB saved per step) one trim per step
# held the peak at 338 MiB against 1,337 without offload.
# Alternatives measured, and no better: reading spans back into heap memory
# allocated on the unpacking thread (where forward's freed blocks are) instead
# of mapped blocks changed neither time nor memory; MADV_HUGEPAGE on the heap
# cut a refault's cost by a quarter (zeroing dominates) at the risk of
# compaction stalls (one 0.19 s refault of 128 MiB); giving back a written
# activation's own pages (MADV_DONTNEED, when the engine held the storage's
# last reference) reached only 30-60% of the bytes, since forward still holds
# many tensors when their writes land, and without trims moved the cut from
# ~40% to 42%.
# Records of CUDA tensors do not count: their host memory is pinned or mapped,
# not glibc's heap. Where glibc is absent (musl, macOS, Windows) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import OffloadError
from .io_pool import WRITE, IOPool
from .stats import StatsCounter

__all__ = ["HeapTrimmer", "heap_trim_supported"]


def _load_malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_MALLOC_TRIM = _load_malloc_trim()


def heap_trim_supported() -> bool:
    """Whether this process's C library can give free heap pages back (glibc)."""
    return _MALLOC_TRIM is not None


class HeapTrimmer:
    """Trims glibc's heap when a step begins (NOTE [heap trim]).

    Args:
        threshold: bytes of CPU activations a step must save for the heap to be
            trimmed when the next one begins; None turns trimming off.
        pool: the IO pool trims run on.
        stats: counts ``heap_trims`` and ``heap_trim_seconds``.
        report: takes a trim's failure, for the next hook call to raise.
    """

    def __init__(
        self,
        threshold: int | None,
        pool: IOPool,
        stats: StatsCounter,
        report: Callable[[BaseException], None],
    ) -> None:
        self.threshold = threshold if _MALLOC_TRIM is not None else None
        self.pool = pool
        self._stats = stats
        self._report = report
        self._lock = threading.Lock()
        self._saved = 0  # CPU activation bytes saved since the last trim was considered
        self._queued = False  # a trim is queued or running: the next one would add nothing

    @property
    def enabled(self) -> bool:
        """Whether trims happen at all."""
        return self.threshold is not None

    def saved(self, nbytes: int) -> None:
        """Count ``nbytes`` of CPU activations saved by forward."""
        if self.threshold is not None:
            # No lock on this hot path (every CPU pack): an update lost to a concurrent
            # pack only shifts a threshold test by one tensor.
            self._saved += nbytes

    def step_begins(self) -> None:
        """A forward begins after a backward: trim if the last step saved at least
        ``threshold`` bytes of CPU activations; count from zero."""
        if self.threshold is None:
            return
        with self._lock:
            due, self._saved = self._saved >= self.threshold, 0
        if due:
            self.soon()

    def soon(self) -> None:
        """Queue a trim, unless one is queued or running already."""
        if self.threshold is None:
            return
        with self._lock:
            if self._queued:
                return
            self._queued = True
        try:
            self.pool.submit(self._trim, WRITE)  # after queued reads: unpacks may wait on those
        except BaseException:
            with self._lock:
                self._queued = False
            raise

    def _trim(self) -> None:
        try:
            start = time.perf_counter()
            _MALLOC_TRIM(0)
            self._stats.add(heap_trims=1, heap_trim_seconds=time.perf_counter() - start)
        except Exception as exc:  # NOTE [errors from workers]
            err = OffloadError(f"prefetch_offload: giving heap memory back failed: {exc}")
            err.__cause__ = exc
            self._report(err)
        finally:
            with self._lock:
                self._queued = False
