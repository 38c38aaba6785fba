"""Reusable host buffers for reads, returned only when no tensor uses them any more.

# NOTE [read buffer pool]
# Reading an offloaded span into a fresh allocation costs a page fault and a
# page of zeroing per 4 KiB (measured here: 2-3x the CPU time of the read
# itself), on a machine where compute already uses every core. So reads land
# in pooled page-aligned anonymous mappings instead. A leased block is wrapped
# with ``torch.frombuffer`` (zero-copy; the tensor's storage holds the block),
# and a finalizer on that storage returns the block when the storage dies: that
# is, when no tensor autograd or the user holds still uses the memory (NOTE
# [memory handed to autograd] in engine.py). Returned blocks go through a
# deque (append is safe from any thread, including the garbage collector) and
# are re-filed at the next lease. ``trim`` unmaps idle blocks: the engine trims
# at the start of each forward so the pool holds nothing while activations are
# being produced.
"""

from __future__ import annotations

import collections
import mmap
import threading
import weakref

import torch

__all__ = ["ReadBufferPool"]

_GRAIN = 64 << 10  # size classes: multiples of 64 KiB


class ReadBufferPool:
    """Page-aligned host buffers by size class, recycled when their storage dies."""

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._idle: dict[int, list[mmap.mmap]] = {}
        self._idle_bytes = 0
        self._returned: collections.deque[mmap.mmap] = collections.deque()
        self.hits = 0
        self.misses = 0

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
        if block is None:
            block = mmap.mmap(-1, size)
        out = torch.frombuffer(block, dtype=torch.uint8)
        weakref.finalize(out.untyped_storage(), self._returned.append, block)
        return out, memoryview(block)[:nbytes]

    def _refile(self) -> None:
        returned = self._returned
        if not returned:
            return
        with self._lock:
            while returned:
                block = returned.popleft()
                size = len(block)
                if self._idle_bytes + size > self.max_idle_bytes:
                    _unmap(block)
                    continue
                self._idle.setdefault(size, []).append(block)
                self._idle_bytes += size

    def trim(self) -> None:
        """Unmap every idle block."""
        self._refile()
        with self._lock:
            idle, self._idle = self._idle, {}
            self._idle_bytes = 0
        for blocks in idle.values():
            for block in blocks:
                _unmap(block)


def _unmap(block: mmap.mmap) -> None:
    try:
        block.close()
    except BufferError:
        pass  # still exported somewhere: unmapped when the last export goes
