"""The read buffer pool: reuse only after the last tensor using a block is gone."""

from __future__ import annotations

import gc
import mmap
import subprocess
import sys

import pytest
import torch

from prefetch_offload import heap
from prefetch_offload.buffers import Block, HostBufferPool


def test_blocks_are_page_aligned_and_sized_up() -> None:
    pool = HostBufferPool(1 << 30)
    t, _ = pool.lease(100_000)
    assert t.data_ptr() % 4096 == 0
    assert t.numel() >= 100_000 and t.numel() % (64 << 10) == 0


def test_block_returns_only_when_every_view_is_gone() -> None:
    pool = HostBufferPool(1 << 30)
    t, _ = pool.lease(1 << 20)
    addr = t.data_ptr()
    view = t[100:200].view(torch.int32)  # a view keeps the storage alive
    del t
    gc.collect()
    other, _ = pool.lease(1 << 20)
    assert other.data_ptr() != addr  # still in use through `view`
    view.fill_(7)
    del view
    gc.collect()
    again, _ = pool.lease(1 << 20)
    assert again.data_ptr() == addr  # recycled once nothing uses it
    assert (pool.hits, pool.misses) == (1, 2)
    del other, again


def test_idle_cap_and_trim() -> None:
    pool = HostBufferPool(max_idle_bytes=1 << 20)
    blocks = [pool.lease(1 << 20)[0] for _ in range(3)]
    del blocks
    gc.collect()
    assert pool.idle_bytes == 1 << 20  # two of the three were unmapped at the cap
    pool.trim()
    assert pool.idle_bytes == 0


class _Counting:
    """A block factory that counts the blocks it made and the ones still alive."""

    def __init__(self) -> None:
        self.made = 0
        self.alive: set[int] = set()

    def __call__(self, size: int) -> Block:
        self.made += 1
        m = mmap.mmap(-1, size)
        alive = self.alive

        class Counted(Block):
            __slots__ = ()

            def release(self) -> None:
                alive.discard(id(self))
                super().release()

        block = Counted(m, size, pinned=False, owner=m)
        alive.add(id(block))
        return block


def test_follow_peak_pool_reuses_blocks_and_keeps_up_to_its_peak() -> None:
    """A step's blocks are re-used by the next step, not re-made (the arena's pageable
    fallback pool works this way)."""
    factory = _Counting()
    pool = HostBufferPool(0, allocate=factory, follow_peak=True)
    for _ in range(3):  # three "steps" of the same four tensors
        step = [pool.lease(300_000)[0] for _ in range(4)]
        del step
        gc.collect()
    assert factory.made == 4 and pool.misses == 4 and pool.hits == 8
    assert pool.idle_bytes == pool.peak_leased_bytes == 4 * 320 * 1024
    kept = pool.lease(300_000)[0]
    pool.close()
    assert len(factory.alive) == 1  # idle blocks released at close; the leased one later
    del kept
    gc.collect()
    assert not factory.alive  # returned after close: released at once, not parked


def test_leases_after_close_do_not_pile_up() -> None:
    """Reads of backward passes run after the engine closed lease and return blocks
    again and again: what the pool keeps to count them stays bounded."""
    factory = _Counting()
    pool = HostBufferPool(0, allocate=factory, follow_peak=True)
    pool.close()
    for _ in range(50):
        out = pool.lease(4096)[0]
        del out
        gc.collect()
    assert not factory.alive and pool.leased_bytes == 0
    assert len(pool._late) <= 1


def test_follow_peak_lets_go_of_what_the_last_period_did_not_lease() -> None:
    """A step that leases less than an earlier one (a plan that moves fewer bytes) keeps
    only its own peak once the next step begins, not the largest step's blocks."""
    factory = _Counting()
    pool = HostBufferPool(0, allocate=factory, follow_peak=True)
    block = 320 * 1024
    for count in (4, 1):
        pool.new_period()
        step = [pool.lease(300_000)[0] for _ in range(count)]
        del step
        gc.collect()
        assert pool.idle_bytes == 4 * block  # within a period: the last one's peak too
    pool.new_period()  # the last period leased one block at a time
    assert pool.idle_bytes == pool.mapped_bytes == block
    assert len(factory.alive) == 1 and pool.peak_leased_bytes == 4 * block
    pool.lease(300_000)  # this period leases one block too (dropped at once)
    gc.collect()
    pool.new_period()
    assert pool.idle_bytes == block and factory.made == 4  # reused, and kept
    pool.new_period()
    assert pool.idle_bytes == 0  # a period that leased nothing
    held = pool.lease(300_000)[0]
    pool.new_period()  # leased now counts toward the new period's peak
    assert pool.idle_bytes == 0 and pool.leased_bytes == block
    del held
    gc.collect()
    assert pool.idle_bytes == block
    pool.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_mapped_bytes_is_anonymous_memory() -> None:
    """The heap trimmer takes ``mapped_bytes`` out of the process's anonymous RSS
    (NOTE [heap trim]): small blocks and large ones must both count there."""
    pool = HostBufferPool(0)
    statm = heap._STATM
    before, mapped = statm.anon_resident_bytes(), pool.mapped_bytes
    leased = []
    for size in (1 << 20,) * 8 + (4 << 20,) * 4:  # 24 MiB, half in blocks below 2 MiB
        tensor, region = pool.lease(size)
        tensor[:size].fill_(1)  # what a read does: every page resident (no heap copy)
        region.release()
        leased.append(tensor)
    grown = statm.anon_resident_bytes() - before
    assert pool.mapped_bytes - mapped == 24 << 20
    assert abs(grown - (24 << 20)) < 4 << 20, grown
    del leased, tensor
    gc.collect()
    pool.close()


def test_a_live_lease_is_not_handed_back_at_interpreter_exit() -> None:
    """A handler that runs at exit after weakref's own (registered before the first
    lease) may still lease: it must not get a block a live tensor still uses."""
    code = """
import atexit

def at_exit():
    for pool, held in ((POOL, HELD), (ARENA, HELD_ARENA)):
        again, _ = pool.lease(1 << 20)
        print("shared" if again.data_ptr() == held.data_ptr() else "apart")

atexit.register(at_exit)  # before any import makes a finalizer: runs after weakref's hook

from prefetch_offload.arena import PinnedArena
from prefetch_offload.buffers import HostBufferPool, mapped_block

POOL = HostBufferPool(16 << 20)
HELD, _ = POOL.lease(1 << 20)
ARENA = PinnedArena(mapped_block, step_bytes=4 << 20)
HELD_ARENA, _ = ARENA.lease(1 << 20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["apart", "apart"]


def test_follow_peak_keeps_its_floor_until_a_period_leased_nothing() -> None:
    """NOTE [read buffer pool]: the floor (``max_idle_bytes``) keeps small steps' blocks;
    a plan that moves nothing reads nothing, and once such a step ended the pool holds
    no idle block (the engine's read pool held 14.6 MiB idle under such a plan)."""
    factory = _Counting()
    block = 320 * 1024
    pool = HostBufferPool(4 * block, allocate=factory, follow_peak=True)
    for _ in range(2):
        pool.new_period()
        step = [pool.lease(300_000)[0] for _ in range(2)]
        del step
        gc.collect()
    pool.new_period()  # the last period leased two blocks, under the floor: both kept
    assert pool.idle_bytes == 2 * block and factory.made == 2
    pool.new_period()  # a period that leased nothing
    assert pool.idle_bytes == pool.mapped_bytes == 0 and not factory.alive
    again = pool.lease(300_000)[0]  # a step that reads again: the floor holds again
    del again
    gc.collect()
    assert pool.idle_bytes == block
    pool.new_period()
    assert pool.idle_bytes == block and factory.made == 3
    pool.close()
