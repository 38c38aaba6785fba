"""The pinned arena: host copies of device tensors, carved out of a few large pinned blocks.

# NOTE [pinned arena]
# Every copy between a GPU and host memory goes through page-locked (pinned)
# host memory: only from pinned memory is a copy asynchronous. Pinning is
# expensive: ``cudaHostAlloc`` costs milliseconds and takes driver locks, and
# PyTorch's pinned allocator rounds every allocation up to a power of two, so
# blocks pinned per size can hold twice the bytes they serve, and varying
# sequence lengths make a pool of exact sizes miss at every step. So the layer
# pins a few large arenas and sub-allocates from them, first fit over sorted
# free runs that are merged on free (as the slab files are, NOTE [slab
# allocation]), in 64 KiB grains, page-aligned. A lease is a tensor over its
# run; the run returns to the free list when that tensor's storage dies (no
# tensor and no copy uses it any more, NOTE [read buffer pool]), through a
# deque, since that may happen in any thread or inside the garbage collector.
#
# Growth. When no free run fits, a new arena is pinned, as large as all the
# arenas before it together (at least ``step_bytes``, at least the lease): the
# total doubles, so a step that needs N bytes ends up in about log2(N / step)
# arenas, pinned during the first step. Arena sizes are powers of two, which
# PyTorch's allocator serves without rounding. A step whose leases all come back
# before the next step's leave the arenas whole again, so the next step fits
# whatever its shapes were (the test alternates two shapes: after the first of
# each, nothing is pinned and nothing grows). Arenas are kept until ``close``
# (or ``trim``), so the next step finds them.
#
# Bounds. The arenas never hold more than ``limit_bytes``: by default half of
# the machine's RAM or of the cgroup's memory limit, whichever is smaller,
# shared among the node's ranks (divided by ``LOCAL_WORLD_SIZE``, which
# torchrun sets: eight ranks on one node would otherwise pin up to four times
# its RAM), since pinned memory cannot be swapped or reclaimed, and the rest of
# the process needs room; ``set_limit`` replaces it (the engine passes its host budget plus
# what staging needs), never above the RAM or cgroup limit itself. A lease that
# fits nowhere under the limit, or arrives after pinning failed once, is served
# from pageable memory instead: correct, but every copy from or to it is
# synchronous (the host waits for the GPU). Such leases are counted in
# ``pageable_fallbacks`` and the first one warns (``OffloadFallbackWarning``)
# with the reason and what to change. Pinning is not retried after a failure:
# each try costs milliseconds, and what failed (the RAM or the container's
# limit) rarely changes within a run.
#
# After ``close`` leases still work (a graph may be unpacked after its context
# exits): each is one pinned block of its own, freed with its storage, and
# arenas are dropped as soon as nothing uses them.
#
# Unpinning. PyTorch's pinned allocator keeps a freed block pinned in its cache
# for the next request of that size, so an arena the layer drops would stay
# page-locked for good (arenas come in sizes nothing else asks for). So once
# arenas pinned by PyTorch are dropped, the layer empties that cache
# (``torch.accelerator.empty_host_cache``): it unpins every cached block that
# nothing uses, other components' too, which costs them a new pin at their
# next request. It happens at ``close``, and for an arena still in use then, at
# the first call to the arena after its last lease is gone (not from the lease's
# finalizer, which may run where the arena's lock is held).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import warnings
import weakref
from collections.abc import Callable

import torch

from .buffers import Block, HostBufferPool, mapped_block
from .errors import OffloadFallbackWarning
from .freelist import FreeRuns

__all__ = ["PinnedArena", "host_memory_limit", "pin_block"]

_GRAIN = 64 << 10  # leases are whole grains
_PAGE = 4096
_DEFAULT_STEP = 64 << 20  # the first arena
# Idle pageable blocks kept for the fallback path (it keeps up to its peak use too).
_PAGEABLE_IDLE = 64 << 20


def pin_block(size: int) -> Block:
    """``size`` bytes of page-locked memory from PyTorch's pinned allocator.

    The block starts a page (``cudaHostAlloc`` gives whole pages; if not, the
    block is the aligned part, a page shorter).

    Raises:
        RuntimeError: the memory could not be pinned (no CUDA, or the driver
            refused: out of memory, a container limit). PyTorch's allocator clears
            CUDA's error state before it raises, so nothing stale is left for the
            next kernel launch to trip over.
    """
    t = torch.empty((size,), dtype=torch.uint8, pin_memory=True)
    lead = (-t.data_ptr()) % _PAGE
    usable = (size - lead) // _PAGE * _PAGE if lead else size
    return Block(t.numpy()[lead : lead + usable], usable, pinned=True, owner=t)


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def host_memory_limit() -> int | None:
    """Bytes of RAM this process may use: physical memory or the cgroup's memory
    limit, whichever is smaller (None if neither can be read)."""
    limits = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    cgroup = ""
    with contextlib.suppress(OSError), open("/proc/self/cgroup", encoding="ascii") as f:
        for line in f:
            if line.startswith("0::"):  # cgroup v2
                cgroup = line[3:].strip().rstrip("/")
    for path in (
        f"/sys/fs/cgroup{cgroup}/memory.max",
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # cgroup v1
    ):
        value = _read_int(path)
        if value is not None and value < 1 << 60:  # v1 writes "no limit" as a huge number
            limits.append(value)
    return min(limits) if limits else None


def _local_ranks() -> int:
    """Processes on this node that each pin their own arenas (torchrun's LOCAL_WORLD_SIZE)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(int(value), 1) if value.isdigit() else 1


def _limit(limit_bytes: int | None) -> int | None:
    """``limit_bytes`` capped at the RAM or cgroup limit; None: half of that limit,
    shared among the node's ranks (NOTE [pinned arena])."""
    ram = host_memory_limit()
    if limit_bytes is None:
        return None if ram is None else ram // 2 // _local_ranks()
    return limit_bytes if ram is None else min(limit_bytes, ram)


def _unpin_cached() -> None:
    """Unpin the blocks PyTorch's pinned allocator keeps cached and unused (NOTE
    [pinned arena]: otherwise a dropped arena stays page-locked)."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:
        empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        with contextlib.suppress(RuntimeError):
            empty()


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


class _Arena(FreeRuns):
    """One pinned block and its free runs (bytes, in whole grains)."""

    __slots__ = ("block", "reserved")

    def __init__(self, block: Block, reserved: int) -> None:
        super().__init__(block.size // _GRAIN * _GRAIN)
        self.block = block
        self.reserved = reserved  # bytes pinned for it (the block may be a page shorter)


class PinnedArena:
    """Page-aligned pinned host buffers carved out of a few large arenas (NOTE [pinned arena]).

    Thread-safe. Leases come back when their storage dies.

    Args:
        pin: makes one pinned block of the given size; raises when it cannot pin
            (:func:`pin_block` for CUDA; the CPU twin passes an anonymous mapping).
        step_bytes: the size of the first arena, and the least any later one adds.
        limit_bytes: the most bytes the arenas may hold, at most the RAM or cgroup
            limit; by default half of it (no limit where neither can be read).
    """

    def __init__(
        self,
        pin: Callable[[int], Block] = pin_block,
        *,
        step_bytes: int = _DEFAULT_STEP,
        limit_bytes: int | None = None,
    ) -> None:
        if step_bytes < _GRAIN:
            raise ValueError(
                f"prefetch_offload: step_bytes must be at least {_GRAIN} (one grain), got "
                f"{step_bytes}; use e.g. 64 << 20."
            )
        self.pin = pin
        self.step_bytes = _pow2_at_least(step_bytes)
        self._default_limit = limit_bytes is None
        self.limit_bytes = _limit(limit_bytes)
        self._lock = threading.Lock()
        self._arenas: list[_Arena] = []
        self._returned: collections.deque[tuple[_Arena, int, int]] = collections.deque()
        self._closed = False
        self._pin_error: str | None = None  # why pinning failed, once it has
        self._warned = False
        self._pageable = HostBufferPool(_PAGEABLE_IDLE, allocate=mapped_block, follow_peak=True)
        #: Blocks pinned (arenas, and blocks leased after close): ``cudaHostAlloc`` calls.
        self.pin_calls = 0
        #: Bytes the arenas hold now, and the most they ever held.
        self.pinned_bytes = 0
        self.peak_pinned_bytes = 0
        #: Leases served from pageable memory (pinning failed, or the limit was reached).
        self.pageable_fallbacks = 0
        self._leased = 0  # arena bytes leased and not yet returned

    # -- limits ---------------------------------------------------------------------------

    def set_limit(self, limit_bytes: int | None) -> None:
        """Cap the arenas at ``limit_bytes``, at most the RAM or cgroup limit (None: the
        default, half of it).

        Arenas already pinned are kept; the cap stops growth, and ``trim`` releases
        idle arenas.
        """
        with self._lock:
            self._default_limit = limit_bytes is None
            self.limit_bytes = _limit(limit_bytes)

    # -- leases ---------------------------------------------------------------------------

    @property
    def leased_bytes(self) -> int:
        """Bytes leased and not yet returned (pinned and pageable)."""
        self._refile()
        pageable = self._pageable
        pageable.idle_bytes  # noqa: B018 (files the blocks returned so far)
        return self._leased + pageable.leased_bytes

    @property
    def idle_bytes(self) -> int:
        """Bytes held and not leased: the arenas' free runs and idle pageable blocks."""
        self._refile()
        with self._lock:
            free = sum(a.size - a.used for a in self._arenas)
        return free + self._pageable.idle_bytes

    def lease(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        """A page-aligned host buffer of at least ``nbytes`` bytes, as a tensor and a buffer.

        Returns ``(tensor, region)``: a uint8 tensor over the buffer, and a writable
        memoryview of its first ``nbytes`` bytes to read into (release it when the
        read is done). The buffer returns when the tensor's storage dies.
        """
        size = -(-max(nbytes, 1) // _GRAIN) * _GRAIN
        self._refile()
        if self._closed:
            return self._lease_alone(nbytes, size)
        with self._lock:
            got = self._take(size)
            if got is None and self._pin_error is None:
                got = self._grow(size)
            if got is not None:
                self._leased += size
        if got is None:
            return self._lease_pageable(nbytes)
        arena, offset = got
        whole = memoryview(arena.block.buffer)  # a view: slicing an mmap would copy
        out = torch.frombuffer(whole[offset : offset + size], dtype=torch.uint8)
        returned = weakref.finalize(
            out.untyped_storage(), self._returned.append, (arena, offset, size)
        )
        returned.atexit = False  # NOTE [read buffer pool]: only once the storage is dead
        return out, whole[offset : offset + nbytes]

    def fits(self, nbytes: int) -> bool:
        """Whether a lease of ``nbytes`` would be pinned now (a free run, or room to grow)."""
        size = -(-max(nbytes, 1) // _GRAIN) * _GRAIN
        self._refile()
        with self._lock:
            if any(n >= size for a in self._arenas for _, n in a.free):
                return True
            return self._pin_error is None and self._growth(size) is not None

    def _take(self, size: int) -> tuple[_Arena, int] | None:
        # Under the lock. First fit, oldest arena first.
        for arena in self._arenas:
            offset = arena.take(size)
            if offset is not None:
                return arena, offset
        return None

    def _growth(self, size: int) -> int | None:
        """The size of the next arena for a lease of ``size``, or None past the limit."""
        want = _pow2_at_least(max(self.step_bytes, self.pinned_bytes, size))
        limit = self.limit_bytes
        if limit is not None and self.pinned_bytes + want > limit:
            want = _pow2_at_most(limit - self.pinned_bytes)
            if want < size:
                return None
        return want

    def _grow(self, size: int) -> tuple[_Arena, int] | None:
        # Under the lock: the other leases wait while one arena is pinned (rare).
        want = self._growth(size)
        if want is None:
            return None
        try:
            block = self.pin(want)
        except (RuntimeError, OSError, MemoryError) as exc:
            self._pin_error = f"pinning {want} bytes failed: {exc}"
            return None
        self.pin_calls += 1
        arena = _Arena(block, want)
        self._arenas.append(arena)
        self.pinned_bytes += want
        self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)
        offset = arena.take(size)
        return None if offset is None else (arena, offset)

    def _lease_pageable(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        with self._lock:
            self.pageable_fallbacks += 1
            warn, self._warned = not self._warned, True
            reason = self._pin_error
        if warn:
            if reason is not None:
                what = (
                    f"could not pin host memory ({reason}). Lower host_budget, or raise the "
                    "pinned-memory limit (the container's memory limit, or free RAM)"
                )
            else:
                what = (
                    f"the pinned arenas reached their limit of {self.limit_bytes} bytes "
                    + (
                        "(half of the RAM or cgroup memory limit)"
                        if self._default_limit
                        else "(host_budget plus what staging needs, at most the RAM limit)"
                    )
                    + ". Raise host_budget, or offload fewer bytes (device_budget, "
                    "min_offload_bytes)"
                )
            warnings.warn(
                f"prefetch_offload: {what}. Host copies that do not fit use pageable memory "
                "instead, which makes every copy to or from them synchronous: the host waits "
                "for the GPU, and packs and prefetches stop overlapping compute. "
                "OffloadStats.pageable_fallbacks counts them.",
                OffloadFallbackWarning,
                stacklevel=4,
            )
        return self._pageable.lease(nbytes)

    def _lease_alone(self, nbytes: int, size: int) -> tuple[torch.Tensor, memoryview]:
        """After close: one pinned block for this lease, freed with its storage."""
        if self._pin_error is None:
            try:
                block = self.pin(size)
            except (RuntimeError, OSError, MemoryError) as exc:
                with self._lock:
                    self._pin_error = f"pinning {size} bytes failed: {exc}"
            else:
                with self._lock:
                    self.pin_calls += 1
                out = torch.frombuffer(block.buffer, dtype=torch.uint8)
                return out, memoryview(block.buffer)[:nbytes]
        return self._lease_pageable(nbytes)

    def _refile(self) -> None:
        returned = self._returned
        if not returned and not self._closed:
            return
        with self._lock:
            while returned:
                arena, offset, size = returned.popleft()
                arena.give(offset, size)
                self._leased -= size
                del arena  # a dropped arena must be gone before the unpin below
            dropped = self._drop(lambda a: a.used == 0) if self._closed else False
        if dropped:
            _unpin_cached()

    def _drop(self, idle: Callable[[_Arena], bool]) -> bool:
        # Under the lock. A dropped arena's memory lives on while any lease uses it
        # (each lease's storage holds the block), so dropping is always safe. Returns
        # whether an arena PyTorch pinned was dropped (NOTE [pinned arena]: unpinning).
        keep = []
        pinned = False
        for arena in self._arenas:
            if idle(arena):
                self.pinned_bytes -= arena.reserved
                pinned = pinned or arena.block.pinned
            else:
                keep.append(arena)
        self._arenas = keep
        return pinned

    # -- lifetime -------------------------------------------------------------------------

    def trim(self) -> None:
        """Release arenas that nothing uses (and idle pageable blocks)."""
        self._refile()
        with self._lock:
            dropped = self._drop(lambda a: a.used == 0)
        if dropped:
            _unpin_cached()  # the arena's memory only now leaves PyTorch's pinned cache
        self._pageable.trim()

    def close(self) -> None:
        """Release idle arenas now and the others once nothing uses them; later leases
        get a pinned block each (NOTE [pinned arena])."""
        with self._lock:
            self._closed = True
        self.trim()
        self._pageable.close()
