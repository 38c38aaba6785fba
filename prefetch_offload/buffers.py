"""Reusable host buffers, returned only when no tensor uses them any more.

# NOTE [read buffer pool]
# Reading an offloaded span into a fresh allocation costs a page fault and a
# page of zeroing per 4 KiB (measured here: 2-3x the CPU time of the read
# itself), on a machine where compute already uses every core. So reads land in
# pooled page-aligned anonymous mappings instead. A leased block is wrapped with
# ``torch.frombuffer`` (zero-copy; the tensor's storage holds the block), and a
# finalizer on that storage returns the block when the storage dies: that is,
# when no tensor autograd or the user holds still uses the memory (NOTE [memory
# handed to autograd] in reader.py), and no copy still reads or writes it (NOTE
# [copies keep their buffers] in streams.py). Returned blocks go through a deque
# (append is safe from any thread, including the garbage collector) and are
# re-filed at the next lease. The engine's read pool keeps idle blocks up to the
# most bytes leased at once in this step or the last one (at least 16 MiB),
# across steps: each backward reads the same sizes again, so its reads land in
# pages already faulted in; a step that reads less (a plan that moves fewer
# bytes, a shorter sequence) lets the rest go when the next one starts
# (``new_period``), instead of holding the largest step's blocks for good, and a
# step that read nothing (a plan that moves nothing) keeps none. A block mapped
# afresh costs its zeroing, about 0.15 ms per MiB for a huge-page block and
# three times that for 4 KiB pages. Measured on the 24-block benchmark
# transformer (970 MiB read per step): 7-10 new blocks per step instead of ~75
# when the pool was emptied at every step's end, for ~34 MiB held idle through
# forward, where a step that offloads everything is well below its peak in
# backward. ``trim`` unmaps every idle block; the engine calls it when it
# closes.
#
# NOTE [huge pages]
# Python's ``mmap.mmap(-1, n)`` is a *shared* anonymous mapping (shmem), which
# never gets transparent huge pages (nor counts as anonymous memory, which the
# heap trimmer measures: NOTE [heap trim]), so every block is a private
# anonymous mapping where the platform has one. O_DIRECT pins every 4 KiB page
# of its buffer for each request: measured here (bench/io.py --cost, docs/
# results/hostcost.json), reading into 4 KiB pages ran at 0.9 GB/s for 60-64 ms
# of guest CPU per GB, and into private mappings that
# ``madvise(MADV_HUGEPAGE)`` gave huge pages at 1.5-1.9 GB/s for 15-17 (writes:
# 0.8-1.5 GB/s and 68-79 ms/GB against 4.9-7.1 and 10-14). So blocks of 2 MiB or
# more are also aligned to 2 MiB
# and ask for huge pages (the kernel may still refuse: then they behave as
# before).
#
# Pinned host memory for the CUDA path is not pooled here: it comes from a few
# large arenas (NOTE [pinned arena] in arena.py). Its pageable fallback uses
# this pool.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Block", "HostBufferPool", "mapped_block"]

_GRAIN = 64 << 10  # size classes: multiples of 64 KiB


class Block:
    """One page-aligned host block: ``buffer`` (writable), ``size``, ``pinned``."""

    __slots__ = ("buffer", "owner", "pinned", "size")

    def __init__(self, buffer: Any, size: int, *, pinned: bool, owner: Any = None) -> None:
        self.buffer = buffer
        self.size = size
        self.pinned = pinned
        self.owner = owner  # what keeps the memory alive (a mapping or a pinned tensor)

    def release(self) -> None:
        """Give the memory back (safe once no tensor uses the block)."""
        owner, self.owner, buffer, self.buffer = self.owner, None, self.buffer, None
        if isinstance(buffer, memoryview):
            with contextlib.suppress(BufferError):
                buffer.release()
        if isinstance(owner, mmap.mmap):
            try:
                owner.close()
            except BufferError:
                pass  # still exported somewhere: unmapped when the last export goes


_HUGE = 2 << 20


def mapped_block(size: int) -> Block:
    """A private anonymous mapping, 2 MiB aligned, asking for huge pages (NOTE [huge pages])."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if not flags or size < _HUGE:
        # Private where possible, as the large blocks are: anonymous memory, which is
        # what the heap trimmer takes the pool's bytes out of (NOTE [heap trim]).
        m = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
        return Block(m, size, pinned=False, owner=m)
    m = mmap.mmap(-1, size + _HUGE, flags=flags)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            m.madvise(advice)
    whole = memoryview(m)
    probe = torch.frombuffer(whole, dtype=torch.uint8, count=1)
    lead = (-probe.data_ptr()) % _HUGE
    del probe
    buffer = whole[lead : lead + size]
    whole.release()
    return Block(buffer, size, pinned=False, owner=m)


class HostBufferPool:
    """Page-aligned host buffers by size class, recycled when their storage dies.

    Args:
        max_idle_bytes: idle bytes kept for reuse.
        allocate: makes a block of the given size (default: an anonymous mapping).
        follow_peak: keep idle blocks up to the most bytes leased at once in this
            period or the last one (:meth:`new_period`), if that is more than
            ``max_idle_bytes`` (the next step needs the same blocks again); none
            where neither leased anything.
    """

    def __init__(
        self,
        max_idle_bytes: int,
        *,
        allocate: Callable[[int], Block] = mapped_block,
        follow_peak: bool = False,
    ) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.allocate = allocate
        self.follow_peak = follow_peak
        self._lock = threading.Lock()
        self._idle: dict[int, list[Block]] = {}
        self._idle_bytes = 0
        self._returned: collections.deque[Block] = collections.deque()
        self._closed = False
        self.hits = 0
        self.misses = 0
        # Bytes leased and not yet returned (see leased_bytes), and the most at once:
        # ever, in this period, and in the last one (follow_peak's cap).
        self._leased = 0
        self.peak_leased_bytes = 0
        self._period_peak = 0
        self._last_period_peak = 0
        # Sizes of blocks returned after close: counted without the lock (NOTE
        # [read buffer pool]: a finalizer may run where the lock is held).
        self._late: collections.deque[int] = collections.deque()

    @property
    def leased_bytes(self) -> int:
        """Bytes leased and not yet returned."""
        return self._leased - sum(list(self._late))  # list(): a snapshot, safe from appends

    @property
    def mapped_bytes(self) -> int:
        """Bytes of blocks leased or idle: what the pool holds mapped (read without the
        lock, so possibly a moment old)."""
        return self._leased + self._idle_bytes

    @property
    def idle_bytes(self) -> int:
        """Bytes of idle blocks held for reuse."""
        self._refile()
        return self._idle_bytes

    def lease(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        """A page-aligned block of at least ``nbytes`` bytes, as a tensor and as a buffer.

        Returns ``(tensor, region)``: a uint8 tensor over the block, and a writable
        memoryview of its first ``nbytes`` bytes to read into (release it when the
        read is done). The block returns to the pool when the tensor's storage dies.
        """
        size = -(-max(nbytes, 1) // _GRAIN) * _GRAIN
        self._refile()
        block = None
        with self._lock:
            free = self._idle.get(size)
            if free:
                block = free.pop()
                self._idle_bytes -= size
                self.hits += 1
            else:
                self.misses += 1
            if block is not None:
                self._count_lease(size)
        if block is None:
            block = self.allocate(size)  # counted once made: a failure leased nothing
            with self._lock:
                self._count_lease(size)
        out = torch.frombuffer(block.buffer, dtype=torch.uint8)
        # Never at interpreter exit while the storage lives (atexit handlers may still
        # train): a block handed back early could be leased again under a live tensor.
        returned = weakref.finalize(out.untyped_storage(), self._give_back, block)
        returned.atexit = False
        return out, memoryview(block.buffer)[:nbytes]

    def _count_lease(self, size: int) -> None:
        # Under the lock. Blocks released after close are settled here, so their sizes do
        # not pile up over the reads of backward passes run after it.
        late = self._late
        while late:
            self._leased -= late.popleft()
        self._leased += size
        leased = self.leased_bytes
        self.peak_leased_bytes = max(self.peak_leased_bytes, leased)
        self._period_peak = max(self._period_peak, leased)

    def new_period(self) -> None:
        """A new step begins: with ``follow_peak``, idle blocks beyond the most bytes
        leased at once in the period that ended (or leased now) are released."""
        self._refile()
        drop: list[Block] = []
        with self._lock:
            self._last_period_peak = self._period_peak
            self._period_peak = self.leased_bytes
            cap = self._cap()
            for size in sorted(self._idle, reverse=True):
                blocks = self._idle[size]
                while blocks and self._idle_bytes > cap:
                    drop.append(blocks.pop())
                    self._idle_bytes -= size
        for block in drop:
            block.release()

    def _give_back(self, block: Block) -> None:
        # Runs when a leased storage dies, in any thread (or the collector): no locks.
        if self._closed:
            self._late.append(block.size)  # deque.append: atomic, no lock needed
            block.release()
        else:
            self._returned.append(block)

    def _cap(self) -> int:
        if self._closed:
            return 0
        if self.follow_peak:
            peaks = max(self._period_peak, self._last_period_peak)
            # (A period that leased nothing, as a step of a plan that moves nothing,
            # and nothing leased now: nothing to keep for the next.)
            return max(self.max_idle_bytes, peaks) if peaks else 0
        return self.max_idle_bytes

    def _refile(self) -> None:
        returned = self._returned
        if not returned:
            return
        drop = []
        with self._lock:
            cap = self._cap()
            while returned:
                block = returned.popleft()
                self._leased -= block.size
                if self._idle_bytes + block.size > cap:
                    drop.append(block)
                    continue
                self._idle.setdefault(block.size, []).append(block)
                self._idle_bytes += block.size
        for block in drop:
            block.release()

    def trim(self) -> None:
        """Release every idle block."""
        self._refile()
        with self._lock:
            idle, self._idle = self._idle, {}
            self._idle_bytes = 0
        for blocks in idle.values():
            for block in blocks:
                block.release()

    def close(self) -> None:
        """Release every idle block now, and every leased one when it is returned."""
        with self._lock:
            self._closed = True
        self.trim()  # also releases blocks returned before close
