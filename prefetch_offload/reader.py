"""The read path: records back into memory, prefetched in the order the plan predicts.

# NOTE [memory handed to autograd]
# Unpack returns a view either of the original storage (its write had not
# finished, or it was never written) or of a fresh allocation that a read
# filled. The engine never writes into memory it has handed out, and keeps only
# a weak reference to the storage (so that the next view of the same record
# shares it instead of reading again, exactly as the original views shared
# theirs), plus the last few spans (NOTE [recently restored]). Read buffers come
# from a pool, but a block returns to it only when its storage has died, that
# is, when no tensor uses it (NOTE [read buffer pool]).
#
# NOTE [views built by the reader]
# Building a tensor from a storage (``torch.empty(0).set_(...)``) releases the
# GIL, and on a machine whose cores compute is keeping busy, getting it back in
# the hook thread can wait behind an IO thread that was preempted while holding
# it: measured at a third of a millisecond per unpack here, most of the unpack
# hook's time. So the IO thread that reads a record also builds the record's
# first saved view over the buffer it filled, and unpack hands that tensor out
# when the first view is the one asked for (once: later views, and later passes,
# build their own).
#
# NOTE [recently restored]
# Autograd frees a node's saved tensors as soon as the node has run, so when
# two adjacent nodes saved the same span (nll_loss and log_softmax both save the
# log-probabilities) the second would find the restored copy already gone and
# read it again. The engine keeps the last few restored spans alive: a bounded
# cost (_RECENT_SPANS spans, during backward only: they are let go when the
# backward pass ends, through an autograd final callback, or at the next pack
# outside a backward) that removes those repeated reads.
#
# A record that several saves share (NOTE [dedup]: the rotary tables or the mask
# that every layer saves) is consumed at its first unpack in a pass (NOTE
# [backward passes]): no window prefetches it again in that pass, and once it
# has left the recent spans each later save's unpack would read it again,
# synchronously. So such a record stays restored from its first unpack in a
# pass until as many unpacks as it has saves have come, or the pass ends.
#
# NOTE [head of line]
# Copies to a device run in order on one stream. On a miss that needs such a
# copy, the record being waited for is copied before its window's prefetches,
# so compute does not wait behind prefetch_depth speculative copies. Reads from
# disk are not ordered so: the window's reads go to the IO threads first, and
# the unpacking thread reads the record itself meanwhile (NOTE [claiming jobs]).
#
# NOTE [window bytes]
# With prefetch_bytes=None a prefetch window may hold what the slabs deliver in
# _AUTO_WINDOW_SECONDS at the read bandwidth measured so far (bytes read over
# the IO threads' time reading them), within [_AUTO_WINDOW_MIN, AUTO_WINDOW_MAX];
# AUTO_WINDOW_START until enough has been read to measure. A window bounded so
# has its reads done in about that time, which is the backward compute of a
# block or two that it must hide behind; a larger one holds memory for reads
# that could not have been late anyway. Eager windows are usually bounded by
# prefetch_depth first (NOTE [lookahead] in plan.py).
"""

from __future__ import annotations

import collections
import errno
import functools
import threading
import time
import weakref
import zlib
from typing import Any

import torch

from .buffers import HostBufferPool
from .config import OffloadConfig
from .device import DeviceLayer
from .errors import OffloadIOError
from .io_pool import READ, IOFuture, IOPool
from .packed import make_view, new_read_buffer, span_part
from .plan import PrefetchPlan, current_group_key
from .profiling import profiler_range
from .records import Fetched, Record, sentinel_for
from .slab import SlabStore
from .stats import StatsCounter
from .streams import Fence

__all__ = ["AUTO_WINDOW_MAX", "AUTO_WINDOW_START", "ReadPath"]

_RECENT_SPANS = 3
# Cap on idle read buffers kept for reuse during backward (NOTE [read buffer pool]).
_POOL_IDLE_BYTES = 16 << 20
_AUTO_WINDOW_SECONDS = 0.1
AUTO_WINDOW_START = 64 << 20
_AUTO_WINDOW_MIN = 16 << 20
AUTO_WINDOW_MAX = 512 << 20


class ReadPath:
    """Brings records back for unpack: in memory, prefetched, or read now.

    It shares the engine's lock, counters, plan and IO pool; ``closed`` is set
    by the engine under the lock before the pool shuts down.
    """

    def __init__(
        self,
        config: OffloadConfig,
        store: SlabStore | None,
        device: DeviceLayer,
        pool: IOPool,
        stats: StatsCounter,
        lock: threading.Lock,
        plan: PrefetchPlan,
    ) -> None:
        self.config = config
        self._store = store
        self._device = device
        self.pool = pool
        self._stats = stats
        self._lock = lock
        self._plan = plan
        self.closed = False
        self.recent: collections.deque[torch.UntypedStorage] = collections.deque(
            maxlen=_RECENT_SPANS
        )
        # NOTE [recently restored]: shared records' restored spans, by id(record).
        self.shared: dict[int, torch.UntypedStorage] = {}
        self.read_pool = HostBufferPool(_POOL_IDLE_BYTES, follow_peak=True)

    def copy_first(self, rec: Record) -> bool:
        """Whether ``rec`` needs a copy to its device that nothing has queued yet
        (then it is materialized before its window is prefetched: NOTE [head of line])."""
        return (
            rec.prefetch is None
            and rec.source is not None
            and not rec.host_only
            and rec.resident() is None
        )

    def begin_backward(self) -> None:
        """Size the window (NOTE [window bytes]); each step's order is predicted at its
        first unpack (NOTE [learned order])."""
        if self.config.prefetch_bytes is None:
            snap = self._stats.snapshot()
            if snap.read_seconds > 0 and snap.bytes_read >= _AUTO_WINDOW_MIN:
                bandwidth = snap.bytes_read / snap.read_seconds
                self._plan.window_bytes = int(
                    min(max(bandwidth * _AUTO_WINDOW_SECONDS, _AUTO_WINDOW_MIN), AUTO_WINDOW_MAX)
                )

    def end_backward(self) -> None:
        """NOTE [recently restored]: no restored span is kept into forward; the read
        pool's idle blocks are (NOTE [read buffer pool])."""
        self.recent.clear()
        self.shared.clear()

    def keep_shared(self, rec: Record, storage: torch.UntypedStorage, more: bool) -> None:
        """Keep a shared record's restored span while ``more`` of its saves will unpack
        in this pass; let it go after the last (NOTE [recently restored])."""
        if more:
            self.shared[id(rec)] = storage
        else:
            self.shared.pop(id(rec), None)

    def materialize(
        self, rec: Record, *, recent: bool = True
    ) -> tuple[torch.UntypedStorage, int, tuple[torch.Tensor, torch.Tensor] | None]:
        """The record's span on its device, ready for the current stream: shared, in
        memory, prefetched, or copied and read now; and the first view, if built.
        ``recent``: keep a span restored now among the recent ones (NOTE [recently
        restored]; not for a read outside backward)."""
        placed = rec.resident()
        built = None
        if placed is not None:
            self._stats.add(prefetch_hits=1)
        else:
            with self._lock:
                fut, rec.prefetch = rec.prefetch, None
                if fut is not None:
                    self._plan.consumed(rec)
                source = rec.source
            if fut is not None and fut.done() and isinstance(fut.exception(), OSError):
                # A prefetch that failed is read or copied again, here: it may have been
                # issued in a backward that its failure ended, and the disk be well again.
                fut = None
            if fut is None and source is not None:
                # In host memory: the tensor itself (CPU), or a host copy to bring back.
                self._stats.add(**{"prefetch_hits" if rec.host_only else "prefetch_misses": 1})
                placed = self._device.to_device(
                    *source[:2], rec.span.nbytes, rec.device, source[2], rec.align
                )
            else:
                placed, built = self._collect(rec, fut)
            if source is None or placed[0] is not source[0]:  # NOTE [version check]
                rec.restored = (weakref.ref(placed[0]), placed[1], placed[2])
            if recent and not self.closed:
                self.recent.append(placed[0])  # NOTE [recently restored]
        storage, base, fence = placed
        if fence is not None:  # a copy to the device (CPU storages have none)
            self._device.use(storage, fence)  # NOTE [copy streams]
        return storage, base, built

    def _collect(self, rec: Record, fut: IOFuture[Fetched] | None) -> Fetched:
        """The read's result, counting a hit if it was ready and stall time if not."""
        if fut is not None and fut.done():
            self._stats.add(prefetch_hits=1)
            return self._read_result(rec, fut)
        start = time.perf_counter()
        if fut is None:
            fut = IOFuture(self._read_job(rec))
        try:
            with profiler_range("prefetch_offload::stall"):
                if fut.claim():  # NOTE [claiming jobs]: read here, not behind a queue
                    fut.run()
                fut.wait()
            return self._read_result(rec, fut)
        finally:
            self._stats.add(prefetch_misses=1, stall_seconds=time.perf_counter() - start)

    def _read_result(self, rec: Record, fut: IOFuture[Fetched]) -> Fetched:
        try:
            return fut.take()  # NOTE [claiming jobs]: no queued future keeps the buffer
        except OSError as exc:
            raise OffloadIOError(
                f"prefetch_offload: reading {rec.describe()} back from {self.config.save_dir!r} "
                f"failed: {exc}. The gradient cannot be computed without it."
            ) from exc

    def _read_job(self, rec: Record) -> Any:
        # The job must not reference the record: the record holds the job's future.
        extent, span, crcs, device, align = rec.extent, rec.span, rec.crcs, rec.device, rec.align
        meta, counter = rec.view0, rec.counter  # (a probe: no memory, no record)
        store, chunk, stats = self._store, self.config.chunk_bytes, self._stats
        lease = self._device.lease_for(device) or self.read_pool.lease
        to_device = self._device.to_device
        assert extent is not None and store is not None

        def job() -> Fetched:
            buf, base, region = new_read_buffer(span, lease)
            with region, profiler_range("prefetch_offload::read"):
                began = time.perf_counter()
                for off in range(0, span.extent_bytes, chunk):
                    store.read(extent, off, region[off : off + chunk])
                took = time.perf_counter() - began
                for lo, hi, crc in crcs or ():  # NOTE [checksums]
                    a, b = span_part(span, lo, hi)
                    if zlib.crc32(region[a:b]) != crc:
                        raise OSError(
                            errno.EIO,
                            f"checksum mismatch in bytes {a - span.pad}..{b - span.pad} of the "
                            "span: the slab file changed after it was written",
                        )
            stats.add(bytes_read=span.nbytes, read_seconds=took)
            placed = to_device(buf.untyped_storage(), base, span.nbytes, device, None, align)
            if placed[2] is not None:  # still being copied: built after use() instead
                return placed, None
            return placed, sentinel_for(make_view(placed[0], placed[1], meta), counter)

        return job

    def prefetch_after(self, rec: Record) -> None:
        """Prefetch the lookahead window below ``rec`` (NOTE [lookahead]): reads from
        disk on the IO threads, copies from host memory to the device right here."""
        if self.config.prefetch_depth == 0:
            return
        copies: list[IOFuture[Fetched]] = []
        with self._lock:
            if self.closed:  # set under this lock before the pool shuts down
                return
            self._plan.unpacked(rec, current_group_key())  # NOTE [learned order]
            for cand in self._plan.window(rec):
                assert isinstance(cand, Record)
                source = cand.source
                if source is None:
                    cand.prefetch = self.pool.submit(self._read_job(cand), READ)
                else:  # a host copy (needs_read is False for host-only records)
                    job = functools.partial(
                        self._copy_job,
                        *source[:2],
                        cand.span.nbytes,
                        cand.device,
                        source[2],
                        cand.align,
                    )
                    cand.prefetch = fut = IOFuture(job)
                    copies.append(fut)
                self._plan.issued(cand, rec)
        for fut in copies:  # only queues the copy (NOTE [copy streams])
            if fut.claim():
                fut.run()

    def _copy_job(
        self,
        storage: torch.UntypedStorage,
        base: int,
        nbytes: int,
        device: torch.device,
        after: Fence | None,
        align: int,
    ) -> Fetched:
        return self._device.to_device(storage, base, nbytes, device, after, align), None
