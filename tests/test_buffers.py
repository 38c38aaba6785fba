"""The read buffer pool: reuse only after the last tensor using a block is gone."""

from __future__ import annotations

import gc

import torch

from prefetch_offload.buffers import ReadBufferPool


def test_blocks_are_page_aligned_and_sized_up() -> None:
    pool = ReadBufferPool(1 << 30)
    t, _ = pool.lease(100_000)
    assert t.data_ptr() % 4096 == 0
    assert t.numel() >= 100_000 and t.numel() % (64 << 10) == 0


def test_block_returns_only_when_every_view_is_gone() -> None:
    pool = ReadBufferPool(1 << 30)
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
    pool = ReadBufferPool(max_idle_bytes=1 << 20)
    blocks = [pool.lease(1 << 20)[0] for _ in range(3)]
    del blocks
    gc.collect()
    assert pool.idle_bytes == 1 << 20  # two of the three were unmapped at the cap
    pool.trim()
    assert pool.idle_bytes == 0
