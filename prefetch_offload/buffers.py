"""Reusable host buffers, returned only when no tensor uses them any more.

# NOTE [read buffer pool]
# Reading an offloaded span into a fresh allocation costs a page fault and a
# page of zeroing per 4 KiB (measured here: 2-3x the CPU time of the read
# itself), on a machine where compute already uses every core. So reads land
# in pooled page-aligned anonymous mappings instead. A leased block is wrapped
# with ``torch.frombuffer`` (zero-copy; the tensor's storage holds the block),
# and a finalizer on that storage returns the block when the storage dies: that
# is, when no tensor autograd or the user holds still uses the memory (NOTE
# [memory handed to autograd] in engine.py), and no copy still reads or
# writes it (NOTE [copies keep their buffers] in streams.py). Returned blocks
# go through a deque (append is safe from any thread, including the garbage
# collector) and are re-filed at the next lease. ``trim`` unmaps idle blocks:
# the engine trims the read pool at the start of each forward so it holds
# nothing while activations are being produced.
#
# NOTE [pinned pool]
# The CUDA path stages every copy through page-locked (pinned) host memory:
# only from pinned memory is a copy truly asynchronous. Pinning costs
# milliseconds per call, so the same pool class keeps pinned blocks for reuse:
# each block is an anonymous mapping registered with ``cudaHostRegister`` once,
# and unregistered when it is unmapped. Its idle cap follows its use: idle
# blocks are kept up to the most bytes that were ever leased at once (the next
# step needs the same blocks again), and every idle block is released at close.
# A block whose registration fails is used unpinned (copies are then
# synchronous, still correct) and counted.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading
import weakref
from typing import Protocol

import torch

__all__ = ["CudaPinner", "HostBufferPool", "Pinner"]

_GRAIN = 64 << 10  # size classes: multiples of 64 KiB


class Pinner(Protocol):
    """Page-locks host memory (NOTE [pinned pool])."""

    def pin(self, address: int, nbytes: int) -> bool:
        """Page-lock ``[address, address + nbytes)``; False if that failed."""
        ...

    def unpin(self, address: int) -> None:
        """Undo a successful :meth:`pin` of the range starting at ``address``."""
        ...


class CudaPinner:
    """Registers host ranges with the CUDA driver (``cudaHostRegister``, portable)."""

    def pin(self, address: int, nbytes: int) -> bool:
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1)) == 0

    def unpin(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)


class _Block:
    __slots__ = ("address", "map", "pinned", "size")

    def __init__(self, size: int, pinner: Pinner | None) -> None:
        self.map = mmap.mmap(-1, size)
        self.size = size
        view = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(view)
        del view  # the export would keep the mapping from closing
        self.pinned = pinner is not None and pinner.pin(self.address, size)

    def release(self, pinner: Pinner | None) -> None:
        if self.pinned and pinner is not None:
            pinner.unpin(self.address)
            self.pinned = False
        try:
            self.map.close()
        except BufferError:
            pass  # still exported somewhere: unmapped when the last export goes


class HostBufferPool:
    """Page-aligned host buffers by size class, recycled when their storage dies.

    Args:
        max_idle_bytes: idle bytes kept for reuse. With a ``pinner`` the cap is at
            least the most bytes ever leased at once (NOTE [pinned pool]).
        pinner: page-locks new blocks; None for plain (pageable) memory.
    """

    def __init__(self, max_idle_bytes: int, *, pinner: Pinner | None = None) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.pinner = pinner
        self._lock = threading.Lock()
        self._idle: dict[int, list[_Block]] = {}
        self._idle_bytes = 0
        self._returned: collections.deque[_Block] = collections.deque()
        self._closed = False
        self.hits = 0
        self.misses = 0
        #: Bytes leased and not yet returned, and the most at once.
        self.leased_bytes = 0
        self.peak_leased_bytes = 0
        #: Blocks that could not be pinned (used as pageable memory).
        self.pin_failures = 0

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
            self.leased_bytes += size
            self.peak_leased_bytes = max(self.peak_leased_bytes, self.leased_bytes)
        if block is None:
            block = _Block(size, self.pinner)
            if self.pinner is not None and not block.pinned:
                self.pin_failures += 1
        out = torch.frombuffer(block.map, dtype=torch.uint8)
        weakref.finalize(out.untyped_storage(), self._returned.append, block)
        return out, memoryview(block.map)[:nbytes]

    def _cap(self) -> int:
        if self._closed:
            return 0
        if self.pinner is not None:
            return max(self.max_idle_bytes, self.peak_leased_bytes)
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
                self.leased_bytes -= block.size
                if self._idle_bytes + block.size > cap:
                    drop.append(block)
                    continue
                self._idle.setdefault(block.size, []).append(block)
                self._idle_bytes += block.size
        for block in drop:
            block.release(self.pinner)

    def trim(self) -> None:
        """Release every idle block."""
        self._refile()
        with self._lock:
            idle, self._idle = self._idle, {}
            self._idle_bytes = 0
        for blocks in idle.values():
            for block in blocks:
                block.release(self.pinner)

    def close(self) -> None:
        """Release every idle block now, and every leased one when it is returned."""
        with self._lock:
            self._closed = True
        self.trim()
