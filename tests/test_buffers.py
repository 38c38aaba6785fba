"""The read buffer pool: reuse only after the last tensor using a block is gone."""

from __future__ import annotations

import gc

import torch

from prefetch_offload.buffers import HostBufferPool


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


class _FakePinner:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.pinned: set[int] = set()
        self.calls = 0

    def pin(self, address: int, nbytes: int) -> bool:
        self.calls += 1
        if self.fail:
            return False
        assert address % 4096 == 0 and nbytes % 4096 == 0
        self.pinned.add(address)
        return True

    def unpin(self, address: int) -> None:
        self.pinned.remove(address)


def test_pinned_pool_pins_once_and_keeps_up_to_its_peak() -> None:
    """NOTE [pinned pool]: a step's blocks are re-used by the next step, not re-pinned."""
    pinner = _FakePinner()
    pool = HostBufferPool(0, pinner=pinner)
    for _ in range(3):  # three "steps" of the same four tensors
        step = [pool.lease(300_000)[0] for _ in range(4)]
        del step
        gc.collect()
    assert pinner.calls == 4 and len(pinner.pinned) == 4
    assert pool.misses == 4 and pool.hits == 8
    assert pool.idle_bytes == pool.peak_leased_bytes == 4 * 320 * 1024
    kept = pool.lease(300_000)[0]
    pool.close()
    assert len(pinner.pinned) == 1  # idle blocks unpinned at close; the leased one later
    del kept
    gc.collect()
    assert pool.idle_bytes == 0  # re-files the returned block: released, the pool is closed
    assert not pinner.pinned


def test_pin_failure_is_counted_and_the_block_still_works() -> None:
    pool = HostBufferPool(1 << 20, pinner=_FakePinner(fail=True))
    t, region = pool.lease(5000)
    region[:3] = b"abc"
    region.release()
    assert bytes(t[:3].tolist()) == b"abc"
    assert pool.pin_failures == 1
