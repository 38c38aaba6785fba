"""Counters the engine keeps, and the frozen snapshot users read.

The engine updates one :class:`StatsCounter` under its own lock from the hook
threads and the IO workers; :meth:`StatsCounter.snapshot` copies it into an
immutable :class:`OffloadStats`.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

__all__ = ["OffloadStats", "StatsCounter"]


@dataclass(frozen=True)
class OffloadStats:
    """A snapshot of what an offload context did. All counts are cumulative.

    Example:
        >>> s = OffloadStats(prefetch_hits=98, prefetch_misses=2)
        >>> s.hit_rate
        0.98
    """

    # Records moved to the target and released from memory: distinct storage spans
    # (the fused q, k, v of one projection count once), written to disk, or copied to
    # host memory for target "cpu".
    tensors_offloaded: int = 0
    # Bytes actually written to the target (storage spans, before alignment padding).
    bytes_offloaded: int = 0
    # Bytes read back from the target (prefetches and synchronous reads).
    bytes_read: int = 0
    # Bytes of the saved tensors the engine took in (storage spans, each once: dedup
    # hits and tensors_kept add nothing), whether kept or moved since.
    bytes_packed: int = 0
    # Saved tensors kept in memory because they were not eligible (parameters,
    # small, non-strided, other devices, ...).
    tensors_kept: int = 0
    # Of tensors_kept: tensor subclasses the engine cannot rebuild (NOTE [wrapper
    # subclasses] in records.py; a DTensor's local tensor is offloaded instead).
    subclasses_kept: int = 0
    # Of tensors_kept: tensors saved inside a backward that does not keep its graph
    # (a reentrant checkpoint's recompute), which stay where they are (NOTE [packs
    # inside backward] in engine.py).
    kept_in_backward: int = 0
    # Pack calls answered by an already-offloaded tensor (same storage, view and version).
    dedup_hits: int = 0
    # Unpacks served without waiting for IO (prefetched, or still in memory).
    prefetch_hits: int = 0
    # Unpacks that had to wait for a read (an in-flight prefetch or a synchronous read),
    # or, for target "cpu", restored a device tensor with no prefetch (a copy, no read).
    prefetch_misses: int = 0
    # Seconds unpack calls spent waiting for reads.
    stall_seconds: float = 0.0
    # Seconds pack calls spent waiting because the write queue was at its byte cap.
    pack_wait_seconds: float = 0.0
    # Seconds pack calls spent waiting because device-to-host copies were at their cap.
    copy_wait_seconds: float = 0.0
    # Host buffers of CUDA copies served from pageable memory because pinning failed or
    # the pinned limit was reached (NOTE [pinned arena]): their copies are synchronous.
    pageable_fallbacks: int = 0
    # Tensors that could not be written (full disk, disk cap, IO error) and stayed in memory.
    fallbacks: int = 0
    # Queued writes dropped because backward needed the tensor first (it stayed in memory).
    writes_skipped: int = 0
    # Bytes written through a huge-page staging buffer (NOTE [write staging] in writer.py).
    bytes_staged: int = 0
    # Largest number of bytes that were queued for writing at once.
    peak_pending_write_bytes: int = 0
    # Disk bytes reserved in slab files right now, and the most ever reserved.
    disk_bytes_reserved: int = 0
    peak_disk_bytes_reserved: int = 0
    # Bytes of slab space holding live tensors right now, and the most ever.
    disk_bytes_in_use: int = 0
    peak_disk_bytes_in_use: int = 0
    # Seconds the IO threads spent reading slabs (bytes_read / read_seconds is the
    # read bandwidth the prefetch window is sized from: NOTE [window bytes]).
    read_seconds: float = 0.0
    # NOTE [tiers] in policy.py: bytes of live offloaded tensors in each tier right
    # now (device: kept where they were made; host: host copies of CUDA tensors;
    # disk: written or being written), and the most each tier ever held.
    device_tier_bytes: int = 0
    host_tier_bytes: int = 0
    disk_tier_bytes: int = 0
    peak_device_tier_bytes: int = 0
    peak_host_tier_bytes: int = 0
    peak_disk_tier_bytes: int = 0
    # Bytes demoted into the host tier and into the disk tier (cumulative).
    bytes_demoted_to_host: int = 0
    bytes_demoted_to_disk: int = 0
    # Backward passes whose prefetches followed the order learned from the step
    # before (NOTE [learned order] in plan.py); the others used reverse pack order.
    predicted_steps: int = 0
    # Times glibc's free heap pages were given back, and the trim thread's seconds
    # doing it (NOTE [heap trim] in heap.py); the page faults of reusing them come later.
    heap_trims: int = 0
    heap_trim_seconds: float = 0.0
    # NOTE [keep, offload, recompute] in recompute.py: of the op outputs inside
    # the blocks recompute= checkpoints (and checkpoint_context_fn's), the bytes
    # the last step kept in device memory (*_SAVE), handed to the engine
    # (*_CPU_OFFLOAD; the tier figures above say where they went) and left to be
    # recomputed. A block checkpointed whole (recompute="full", or a plain block
    # of "auto") recomputes all of them (NOTE [plain blocks counted] in
    # checkpointing.py). A call counts as its recompute begins (NOTE [counted at
    # the recompute]): a forward no backward follows counts in no step.
    step_bytes_kept: int = 0
    step_bytes_offloaded: int = 0
    step_bytes_recomputed: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of unpacks served without waiting (0.0 when nothing was unpacked)."""
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else 0.0


class StatsCounter:
    """Mutable, lock-protected counters behind :class:`OffloadStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {f.name: f.default for f in dataclasses.fields(OffloadStats)}

    def add(self, **deltas: float) -> None:
        """Add each keyword's value to the counter of that name."""
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def set_max(self, name: str, value: int) -> None:
        """Raise counter ``name`` to ``value`` if it is lower."""
        with self._lock:
            if value > self._values[name]:
                self._values[name] = value

    def set(self, **values: float) -> None:
        """Overwrite counters with absolute values."""
        with self._lock:
            self._values.update(values)

    def snapshot(self) -> OffloadStats:
        """Return an immutable copy of the current counts."""
        with self._lock:
            return OffloadStats(**self._values)  # type: ignore[arg-type]
