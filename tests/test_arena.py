"""The pinned arena (NOTE [pinned arena]): sub-allocation, growth, bounds, fallbacks."""

from __future__ import annotations

import gc
import random
import threading
import warnings

import pytest
import torch

from prefetch_offload import OffloadFallbackWarning
from prefetch_offload import arena as arena_module
from prefetch_offload.arena import PinnedArena, host_memory_limit, pin_block
from prefetch_offload.buffers import Block, mapped_block

KiB, MiB = 1 << 10, 1 << 20


class _Pins:
    """A pin function over anonymous mappings that records every block it made."""

    def __init__(self, *, fail: bool = False) -> None:
        self.sizes: list[int] = []
        self.fail = fail

    def __call__(self, size: int) -> Block:
        self.sizes.append(size)
        if self.fail:
            raise RuntimeError("CUDA error: out of memory (simulated)")
        return mapped_block(size)


def _step(arena: PinnedArena, sizes: list[int]) -> None:
    """One training step's leases: taken in forward order, returned in reverse."""
    held = []
    for n in sizes:
        t, region = arena.lease(n)
        region[:1] = b"\x01"  # written through the region, seen through the tensor
        assert t[0] == 1 and t.data_ptr() % 4096 == 0 and t.numel() >= n
        region.release()
        held.append(t)
    while held:
        held.pop()
    gc.collect()


def test_leases_are_carved_from_one_arena_and_page_aligned() -> None:
    pins = _Pins()
    arena = PinnedArena(pins, step_bytes=MiB, limit_bytes=None)
    a, _ = arena.lease(100_000)
    b, _ = arena.lease(5000)
    assert pins.sizes == [MiB] and arena.pinned_bytes == MiB
    assert b.data_ptr() - a.data_ptr() == 128 * KiB  # 100 000 bytes take two 64 KiB grains
    assert a.numel() == 128 * KiB and b.numel() == 64 * KiB
    assert arena.leased_bytes == 192 * KiB and arena.idle_bytes == MiB - 192 * KiB
    del a, b
    gc.collect()
    assert arena.leased_bytes == 0 and arena.idle_bytes == MiB


def test_returned_runs_merge_and_are_reused() -> None:
    arena = PinnedArena(_Pins(), step_bytes=MiB)
    a, _ = arena.lease(64 * KiB)
    b, _ = arena.lease(64 * KiB)
    c, _ = arena.lease(64 * KiB)
    start = a.data_ptr()
    view = b[10:20]  # a view keeps the run in use
    del a, b
    gc.collect()
    d, _ = arena.lease(128 * KiB)
    assert d.data_ptr() != start  # a's run alone is too small while b's is held
    del view, d
    gc.collect()
    e, _ = arena.lease(128 * KiB)
    assert e.data_ptr() == start  # a's and b's runs merged
    del c, e


def test_growth_doubles_in_power_of_two_arenas() -> None:
    pins = _Pins()
    arena = PinnedArena(pins, step_bytes=MiB)
    held = [arena.lease(512 * KiB)[0] for _ in range(16)]  # 8 MiB in all
    assert pins.sizes == [MiB, MiB, 2 * MiB, 4 * MiB]  # the total doubles each time
    assert arena.pinned_bytes == arena.peak_pinned_bytes == 8 * MiB
    big, _ = arena.lease(20 * MiB)  # larger than everything before: its own size
    assert pins.sizes[-1] == 32 * MiB
    del held, big


def test_alternating_and_varying_shapes_pin_nothing_after_warmup() -> None:
    """Each step leases a different mix of sizes (sequence lengths vary); once the largest
    step has been seen, no step pins or grows, unlike pools of exact sizes."""
    pins = _Pins()
    arena = PinnedArena(pins, step_bytes=256 * KiB)
    rng = random.Random(0)

    def shapes(seq: int) -> list[int]:
        return [seq * w for w in (3000, 12000, 3000, 700, 3000, 12000, 1500) for _ in range(4)]

    _step(arena, shapes(256))  # the longest sequence: the warm-up
    _step(arena, shapes(128))
    warm = (len(pins.sizes), arena.pinned_bytes)
    for i in range(20):
        seq = (64, 256)[i % 2] if i < 10 else rng.randrange(16, 257)
        _step(arena, shapes(seq))
        assert (len(pins.sizes), arena.pinned_bytes) == warm, i
    assert arena.pageable_fallbacks == 0


def test_interleaved_returns_do_not_grow_forever() -> None:
    """Disk-like traffic: staging leases return while later ones are taken, reads in
    backward; after warm-up the arenas stop growing."""
    pins = _Pins()
    arena = PinnedArena(pins, step_bytes=256 * KiB)
    rng = random.Random(1)
    counts = []
    for _ in range(12):
        live: list[torch.Tensor] = []
        for _ in range(40):  # forward: staging blocks, written and returned out of order
            live.append(arena.lease(rng.choice((64 * KiB, 300 * KiB, MiB)))[0])
            if len(live) > 4:
                live.pop(rng.randrange(len(live)))
        live.clear()
        reads = [arena.lease(rng.choice((64 * KiB, 300 * KiB, MiB)))[0] for _ in range(6)]
        del reads
        gc.collect()
        counts.append(len(pins.sizes))
    assert counts[-1] == counts[3], counts


def test_limit_bounds_the_arenas_and_the_rest_is_pageable_with_one_warning() -> None:
    pins = _Pins()
    arena = PinnedArena(pins, step_bytes=MiB, limit_bytes=3 * MiB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = [arena.lease(MiB)[0] for _ in range(5)]
    assert pins.sizes == [MiB, MiB, MiB]  # the third is cut from 2 MiB to fit the limit
    assert arena.pinned_bytes == 3 * MiB and arena.pageable_fallbacks == 2
    (w,) = caught
    assert issubclass(w.category, OffloadFallbackWarning)
    assert "limit of 3145728 bytes" in str(w.message) and "synchronous" in str(w.message)
    assert not arena.fits(MiB) and not arena.fits(1)
    del held
    gc.collect()
    assert arena.fits(MiB)  # free runs again
    arena.set_limit(64 * MiB)
    assert arena.fits(8 * MiB)  # room to grow


def test_failed_pinning_is_not_retried_and_warns_once() -> None:
    pins = _Pins(fail=True)
    arena = PinnedArena(pins, step_bytes=MiB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = [arena.lease(100_000)[0] for _ in range(3)]
    assert len(pins.sizes) == 1 and arena.pageable_fallbacks == 3
    (w,) = caught
    assert "could not pin host memory" in str(w.message) and "host_budget" in str(w.message)
    assert all(t.data_ptr() % 4096 == 0 for t in held)
    del held
    gc.collect()
    assert arena.leased_bytes == 0


def test_close_releases_arenas_once_unused_and_later_leases_still_work() -> None:
    pins = _Pins()
    arena = PinnedArena(pins, step_bytes=MiB)
    kept, _ = arena.lease(100_000)
    kept.fill_(7)
    arena.close()
    assert arena.pinned_bytes == MiB  # still in use
    assert bool((kept == 7).all())
    late, region = arena.lease(5000)  # a graph unpacked after its context: own block
    region[:1] = b"\x02"
    assert late[0] == 2 and len(pins.sizes) == 2 and arena.pin_calls == 2
    del kept, late, region
    gc.collect()
    assert arena.leased_bytes == 0 and arena.idle_bytes == 0 and arena.pinned_bytes == 0


def test_leases_and_returns_from_many_threads_are_all_accounted() -> None:
    arena = PinnedArena(_Pins(), step_bytes=MiB)
    start = threading.Barrier(4)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        held = []
        for _ in range(200):
            t, _ = arena.lease(rng.choice((4096, 64 * KiB, 200 * KiB)))
            t[0] = seed
            held.append(t)
            if len(held) > 3:
                held.pop(rng.randrange(len(held)))  # returned in this thread
        for t in held:
            assert t[0] == seed  # no two live leases overlap

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    gc.collect()
    assert arena.leased_bytes == 0 and arena.idle_bytes == arena.pinned_bytes


def test_step_bytes_must_be_a_grain() -> None:
    with pytest.raises(ValueError, match="step_bytes"):
        PinnedArena(_Pins(), step_bytes=4096)


def test_host_memory_limit_bounds_every_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    ram = host_memory_limit()
    assert ram is None or ram > 0
    arena = PinnedArena(_Pins(), limit_bytes=1 << 62)
    assert arena.limit_bytes == (1 << 62 if ram is None else ram)
    arena.set_limit(None)
    assert arena.limit_bytes == (None if ram is None else ram // 2)
    arena.set_limit(MiB)
    assert arena.limit_bytes == MiB


def test_default_limit_is_shared_among_the_node_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena_module, "host_memory_limit", lambda: 64 << 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun: eight ranks pin on this node
    assert PinnedArena(_Pins()).limit_bytes == 4 << 30
    assert PinnedArena(_Pins(), limit_bytes=16 << 30).limit_bytes == 16 << 30  # as asked
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert PinnedArena(_Pins()).limit_bytes == 32 << 30


def test_dropped_pinned_arenas_leave_pytorchs_pinned_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [pinned arena]: PyTorch keeps a freed pinned block pinned in its cache; once an
    arena it pinned is dropped, the cache is emptied, or the arena stays page-locked."""
    unpins: list[int] = []
    monkeypatch.setattr(arena_module, "_unpin_cached", lambda: unpins.append(1))

    def pinned(size: int) -> Block:
        block = mapped_block(size)
        return Block(block.buffer, block.size, pinned=True, owner=block.owner)

    arena = PinnedArena(pinned, step_bytes=MiB)
    kept, _ = arena.lease(100_000)
    arena.close()
    assert unpins == []  # still in use: nothing dropped
    del kept
    gc.collect()
    _late, region = arena.lease(5000)  # the next call drops the unused arena
    region.release()
    assert unpins == [1] and arena.pinned_bytes == 0
    twin = PinnedArena(_Pins(), step_bytes=MiB)  # the CPU twin's mappings: nothing to unpin
    twin.lease(5000)
    gc.collect()
    twin.close()
    assert unpins == [1] and twin.pinned_bytes == 0


@pytest.mark.parametrize("offset", [0, 100])
def test_pin_block_keeps_the_page_aligned_part(
    monkeypatch: pytest.MonkeyPatch, offset: int
) -> None:
    """pin_block's own arithmetic, on the CPU: PyTorch's pinned allocator handed out a
    block ``offset`` bytes past a page start; the block is its page-aligned part."""
    real_empty = torch.empty
    made: list[torch.Tensor] = []

    def unaligned(shape: tuple[int], *, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
        assert pin_memory and dtype == torch.uint8
        raw = real_empty((shape[0] + 2 * 4096,), dtype=torch.uint8)
        start = (-raw.data_ptr()) % 4096 + offset
        made.append(raw[start : start + shape[0]])
        return made[-1]

    monkeypatch.setattr(torch, "empty", unaligned)
    block = pin_block(MiB)
    monkeypatch.undo()
    t = torch.frombuffer(block.buffer, dtype=torch.uint8)
    base = made[0].data_ptr()
    assert t.data_ptr() % 4096 == 0 and t.numel() == block.size
    assert block.size == (MiB if offset == 0 else MiB - 4096)
    assert base <= t.data_ptr() and t.data_ptr() + block.size <= base + MiB
    assert block.pinned and block.owner is made[0]


def test_pin_block_pins_or_raises() -> None:
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            pin_block(MiB)
        return
    block = pin_block(MiB)
    t = torch.frombuffer(block.buffer, dtype=torch.uint8)
    assert block.pinned and t.is_pinned() and t.data_ptr() % 4096 == 0
