"""Memory budgets per tier (NOTE [tiers]): the policy's accounting, and the engine under it."""

from __future__ import annotations

import gc
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import engine_with_hooks, twin_with_hooks

from prefetch_offload import (
    OffloadConfig,
    OffloadEngine,
    OffloadFallbackWarning,
    offload_context,
)
from prefetch_offload.policy import DEVICE, DISK, HOST, TierPolicy

N = 1 << 14  # elements per saved tensor
SIZE = N * 4  # its bytes
LINKS = 8  # saved tensors per chain


class Rec:
    def __init__(self, seq: int, nbytes: int = 10) -> None:
        self.seq = seq
        self.nbytes = nbytes
        self.tier = -1


# -- the policy's accounting --------------------------------------------------------------


def test_headroom_is_the_budget_its_records_do_not_fill() -> None:
    policy = TierPolicy(25, None)
    assert policy.headroom(DEVICE) == 25 and policy.headroom(HOST) == 0  # HOST: no limit
    recs = [Rec(i) for i in range(3)]
    for r in recs:
        policy.admit(r)
    assert policy.headroom(DEVICE) == 0  # 30 bytes kept: over, not negative
    (oldest,) = policy.over(DEVICE)
    assert policy.headroom(DEVICE) == 0  # being demoted still occupies its memory
    policy.demote(oldest, DISK)
    assert policy.headroom(DEVICE) == 5
    policy.died(DEVICE, recs[2].nbytes, recs[2].seq)
    assert policy.headroom(DEVICE) == 15
    assert TierPolicy(0, None).headroom(DEVICE) == 0


def test_the_oldest_records_over_the_budget_are_demoted() -> None:
    policy = TierPolicy(25, None)
    recs = [Rec(i) for i in range(4)]
    picked = []
    for r in recs:
        policy.admit(r)
        picked += policy.over(DEVICE)
        for p in policy.over(DEVICE):
            raise AssertionError(p)  # over() hands out each record once
        for p in picked:
            if p.tier == DEVICE:
                policy.demote(p, DISK)
    assert [r.seq for r in picked] == [0, 1]
    assert policy.bytes == [20, 0, 20] and policy.peak[DEVICE] == 20
    assert policy.demoted == [0, 0, 20]


def test_kept_records_are_never_offered_again_and_readmitted_ones_come_first() -> None:
    policy = TierPolicy(0, 0)
    a, b, c = Rec(0), Rec(1), Rec(2)
    for r in (a, b, c):
        policy.admit(r)
    assert policy.over(DEVICE) == [a, b, c]
    policy.keep(a, DEVICE)  # e.g. no disk space: stays, never tried again
    policy.demote(b, HOST)
    policy.demote(c, HOST)
    assert policy.over(HOST) == [b, c]
    policy.demote(b, DISK)
    policy.demote(c, DISK)
    policy.readmit([c, b], HOST)  # the write tail cancelled both writes
    assert policy.bytes == [10, 20, 0] and policy.demoted == [0, 20, 0]
    assert policy.over(HOST) == [b, c]  # oldest first again
    assert policy.over(DEVICE) == []  # a was kept


def test_a_record_taken_then_kept_is_never_offered_again() -> None:
    """take() (a record that must leave) leaves its entry in the queue; once the
    demotion failed and the record was kept, over() must not hand it out again."""
    policy = TierPolicy(0, None)
    a = Rec(0)
    policy.admit(a)
    assert policy.take(a, force=True)
    policy.keep(a, DEVICE)  # e.g. its write found the disk full
    assert policy.over(DEVICE) == []


@pytest.mark.parametrize(("device_budget", "host_budget"), [(0, None), (1 << 40, 0)])
def test_the_queues_follow_the_live_records_not_every_record_packed(
    device_budget: int, host_budget: int | None
) -> None:
    """NOTE [tiers]: a tier never over its budget (or with none) never pops its queue;
    dead and moved entries must not pile up over a long run."""
    policy = TierPolicy(device_budget, host_budget)
    for step in range(200):
        live = [Rec(step * 50 + i) for i in range(50)]
        for r in live:
            policy.admit(r)
            for moved in policy.over(DEVICE):
                policy.demote(moved, HOST)
        for r in live:
            policy.died(r.tier, r.nbytes, r.seq)
        del live, r
    assert policy.bytes == [0, 0, 0]
    assert len(policy._queues[DEVICE]) + len(policy._queues[HOST]) <= 200
    assert not policy._kept


def test_no_limit_demotes_nothing_and_deaths_are_subtracted() -> None:
    policy = TierPolicy(0, None)
    r = Rec(0)
    policy.admit(r)
    policy.demote(r, HOST)
    assert policy.over(HOST) == []
    policy.died(HOST, r.nbytes, r.seq)
    assert policy.bytes == [0, 0, 0] and policy.peak[HOST] == 10


def test_a_failed_demotion_is_released_and_picked_again() -> None:
    policy = TierPolicy(0, None)
    a, b = Rec(0), Rec(1)
    policy.admit(a)
    policy.admit(b)
    assert policy.over(DEVICE) == [a, b]
    policy.demote(a, DISK)
    policy.release([b, a])  # b's demotion raised; a moved already: left alone
    assert policy.over(DEVICE) == [b]  # the excess is seen again
    policy.demote(b, DISK)
    assert policy.bytes == [0, 0, 20]


def test_a_record_that_dies_while_leaving_frees_its_excess() -> None:
    policy = TierPolicy(0, None)
    a = Rec(0)
    policy.admit(a)
    assert policy.over(DEVICE) == [a]
    policy.died(DEVICE, a.nbytes, a.seq)  # before its demotion ran
    b = Rec(1)
    policy.admit(b)
    assert policy.over(DEVICE) == [b]  # not hidden behind a's stale excess


def test_a_memory_tiers_peak_is_what_it_keeps_once_room_is_made() -> None:
    """A demotion into HOST may pass its budget until over(HOST) hands the oldest out:
    the peak is taken after that, as a pack leaves the tier."""
    policy = TierPolicy(0, 10)
    for r in (Rec(0), Rec(1)):
        policy.admit(r)
        for p in policy.over(DEVICE):
            policy.demote(p, HOST)
        for p in policy.over(HOST):
            policy.demote(p, DISK)
    assert policy.peak == [0, 10, 10] and policy.bytes == [0, 10, 10]


# -- the engine, CPU tensors to disk -------------------------------------------------------


def _chain(x: torch.Tensor, engine: OffloadEngine | None = None, budget: int = -1) -> torch.Tensor:
    """LINKS saved tensors of SIZE bytes; checks the device tier after every pack."""
    h = x
    for i in range(LINKS):
        # One SIZE tensor saved per link (pow saves a). Multiplications and
        # subtractions only: no MKL VML kernel (NOTE [first unary call]).
        a = h * ((1.0 + i / 64) / 2)
        h = a - a.pow(3) / 6
        if engine is not None and budget >= 0:
            assert engine.stats().device_tier_bytes <= max(budget, 0)
    return h.sum()


def _reference(x: torch.Tensor) -> torch.Tensor:
    ref = x.detach().clone().requires_grad_()
    _chain(ref).backward()
    assert ref.grad is not None
    return ref.grad


@pytest.mark.parametrize(
    ("budget", "kept"),
    [
        (0, 0),
        (SIZE // 2, 0),  # smaller than one tensor
        (SIZE, 1),  # exactly one tensor
        (3 * SIZE + 100, 3),
        (LINKS * SIZE * 4, LINKS),  # larger than the step: nothing moves
    ],
)
def test_device_budget_keeps_the_newest_tensors(save_dir: Path, budget: int, kept: int) -> None:
    x = torch.randn(N, requires_grad=True)
    with engine_with_hooks(save_dir, device_budget=budget, chunk_bytes=4096) as engine:
        loss = _chain(x, engine, budget)
        engine.flush()
        stats = engine.stats()
        assert stats.device_tier_bytes == kept * SIZE
        assert stats.disk_tier_bytes == stats.bytes_demoted_to_disk == (LINKS - kept) * SIZE
        assert stats.bytes_offloaded == (LINKS - kept) * SIZE
        loss.backward()
        stats = engine.stats()
    # Backward read exactly what was demoted: the kept tensors were the newest.
    assert stats.bytes_read == (LINKS - kept) * SIZE
    assert stats.peak_device_tier_bytes == kept * SIZE
    assert x.grad is not None and torch.equal(x.grad, _reference(x))


def test_budgets_take_units_and_change_between_contexts(save_dir: Path) -> None:
    x = torch.randn(N, requires_grad=True)
    moved = []
    for budget in ("128KiB", 0, "1MiB"):
        x.grad = None
        with offload_context("disk", save_dir, device_budget=budget, min_offload_bytes=0) as eng:
            loss = _chain(x)
            eng.flush()
            moved.append(eng.stats().bytes_demoted_to_disk)
            loss.backward()
        assert x.grad is not None and torch.equal(x.grad, _reference(x))
    assert moved == [(LINKS - 2) * SIZE, LINKS * SIZE, 0]


def test_tiers_are_empty_after_the_step(save_dir: Path) -> None:
    x = torch.randn(N, requires_grad=True)
    with engine_with_hooks(save_dir, device_budget=2 * SIZE, chunk_bytes=4096) as engine:
        for _ in range(3):
            loss = _chain(x)
            engine.flush()  # nothing left for the write tail to return to memory
            loss.backward()
        gc.collect()
        stats = engine.stats()
    assert (stats.device_tier_bytes, stats.host_tier_bytes, stats.disk_tier_bytes) == (0, 0, 0)
    assert stats.peak_device_tier_bytes == 2 * SIZE


def test_write_tail_records_are_demoted_when_forward_resumes(save_dir: Path) -> None:
    """The cancelled demotions of an unpack during forward return to the device tier,
    over budget, and the next pack demotes those still alive (NOTE [tiers])."""
    x = torch.randn(N, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:  # big batches: the writes stay queued
        ys = [(x * (i + 2)).sin() for i in range(4)]
        torch.autograd.grad(ys[0].sum(), x, retain_graph=True)
        assert engine.stats().device_tier_bytes == 4 * SIZE
        (x * 9).sin()
        engine.flush()
        stats = engine.stats()
        assert stats.device_tier_bytes == 0 and stats.writes_skipped == 0
        sum(y.sum() for y in ys).backward()


def test_target_cpu_on_cpu_tensors_says_budgets_have_nothing_to_do(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="prefetch_offload")
    with offload_context("cpu", device_budget="1MiB"):  # too small to move anyway
        (torch.randn(4, requires_grad=True).exp() * 2).sum().backward()
    assert caplog.records == []
    x = torch.randn(N, requires_grad=True)
    with offload_context("cpu", device_budget="1MiB") as engine:
        _chain(x).backward()
        _chain(x).backward()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "nothing to" in msgs[0] and "target 'disk'" in msgs[0]
    assert engine.stats().tensors_offloaded == 0
    caplog.clear()
    with offload_context("cpu") as engine:  # no budget asked for: nothing to say
        _chain(x).backward()
    assert caplog.records == []


def test_a_twin_keeping_a_small_cpu_tensor_does_not_say_budgets_do_nothing(
    save_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The CPU twin moves CPU tensors: one kept for its size is no reason to warn."""
    caplog.set_level(logging.WARNING, logger="prefetch_offload")
    x = torch.randn(N, requires_grad=True)
    with twin_with_hooks("cpu", save_dir, device_budget=SIZE, min_offload_bytes=SIZE) as (
        engine,
        _,
    ):
        (torch.randn(4, requires_grad=True).exp() * 2).sum().backward()  # kept: small
        _chain(x).backward()
        stats = engine.stats()
    assert stats.tensors_kept > 0 and stats.bytes_demoted_to_host > 0
    assert caplog.records == []


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"device_budget": -1}, ValueError, "device_budget must be >= 0"),
        ({"device_budget": 1.5}, TypeError, "device_budget must be an int or a str"),
        ({"host_budget": "6 gigs"}, ValueError, "host_budget='6 gigs' is not a byte size"),
        ({"host_budget": "0.5B"}, ValueError, "not a whole number of bytes"),
        ({"host_budget": None}, ValueError, "host_budget=None .* needs target 'cpu'"),
        ({"prefetch_bytes": 0}, ValueError, "prefetch_bytes must be > 0"),
        ({"prefetch_bytes": True}, TypeError, "prefetch_bytes must be an int or a str"),
    ],
)
def test_bad_budgets_are_refused_with_a_fix(
    tmp_path: Path, kw: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        offload_context("disk", tmp_path, **kw)


def test_budget_defaults_follow_the_target(tmp_path: Path) -> None:
    assert OffloadConfig(target="disk", save_dir=str(tmp_path)).host_budget == 0
    assert OffloadConfig(target="cpu").host_budget is None
    cfg = OffloadConfig(target="cpu", device_budget="6GiB", host_budget="512MB")
    assert (cfg.device_budget, cfg.host_budget) == (6 << 30, 512 * 10**6)


# -- the CPU twin of the CUDA path: the host tier ------------------------------------------


def test_twin_host_budget_spills_the_oldest_copies_to_disk(save_dir: Path) -> None:
    x = torch.randn(N, requires_grad=True)
    with twin_with_hooks(
        "disk", save_dir, chunk_bytes=4096, device_budget=SIZE, host_budget=2 * SIZE
    ) as (engine, _):
        loss = _chain(x)
        engine.flush()
        stats = engine.stats()
        assert (stats.device_tier_bytes, stats.host_tier_bytes) == (SIZE, 2 * SIZE)
        assert stats.disk_tier_bytes == (LINKS - 3) * SIZE
        assert stats.bytes_demoted_to_host == (LINKS - 1) * SIZE
        assert stats.bytes_demoted_to_disk == (LINKS - 3) * SIZE
        # Never more than its budget once a pack returned (NOTE [tiers]).
        assert stats.peak_host_tier_bytes == 2 * SIZE
        loss.backward()
        assert engine.stats().bytes_read == (LINKS - 3) * SIZE
    assert x.grad is not None and torch.equal(x.grad, _reference(x))


def test_budget_holds_after_a_demotion_raised(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A demotion that fails (no slab could be made) raises at its pack; the record it
    was for goes back to its tier's queue, so later packs still keep the budget."""
    from prefetch_offload import OffloadIOError

    x = torch.randn(N, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:  # device_budget 0; batches stay open
        ys = [(x * (i + 2)).sin() for i in range(4)]
        torch.autograd.grad(ys[0].sum(), x, retain_graph=True)  # write tail: readmitted

        def denied(nbytes: int) -> None:
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(engine._store, "allocate", denied)
        with pytest.raises(OffloadIOError):
            (x * 7).sin()  # forward resumes: demoting the readmitted records raises
        monkeypatch.undo()
        queue = [r.seq for r in (ref() for ref in engine._policy._queues[DEVICE]) if r]
        assert queue == sorted(queue) and len(queue) == 4  # oldest first, as before
        h = x
        for _ in range(4):  # the next packs demote what is over the budget, old and new
            h = (h * 1.01).sin()
            assert engine.stats().device_tier_bytes == 0
        (h.sum() + sum(y.sum() for y in ys)).backward()
        del ys
        gc.collect()
        engine.flush()
        assert engine._policy._leaving == {} and engine._policy._leaving_bytes == [0, 0, 0]


def test_twin_slab_space_comes_back_after_a_copy_off_the_device_raised(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Straight to disk, the extent is reserved before the copy: a copy that raises
    gives it back, and the record, released, is demoted at the next pack in age order."""
    x = torch.randn(N, requires_grad=True)
    with twin_with_hooks("disk", save_dir, device_budget=0, host_budget=0) as (engine, _):
        real = engine._device.to_host
        calls = []

        def flaky(*args: Any, **kw: Any) -> Any:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("pinned allocation failed")
            return real(*args, **kw)

        monkeypatch.setattr(engine._device, "to_host", flaky)
        y = x * 2
        with pytest.raises(RuntimeError, match="pinned allocation failed"):
            y.sin()
        assert engine._store.used_bytes == 0
        z = (x * 3).sin()  # demotes y's released record first, then its own
        assert engine.stats().device_tier_bytes == 0
        engine.flush()
        z.sum().backward()
        del y, z
        gc.collect()
        engine.flush()
        engine.stats()  # drains dead records
        assert engine._store.used_bytes == 0


def test_twin_flush_lets_the_device_memory_of_finished_copies_go(save_dir: Path) -> None:
    """After flush() every copy off the device is done: the device tensors it copied
    are no longer held for it (on a GPU: no device memory held after flush)."""
    import weakref

    x = torch.randn(1 << 16, requires_grad=True)
    with twin_with_hooks("cpu", save_dir, device_budget=0) as (engine, _):
        y = x * 2
        ref = weakref.ref(y.untyped_storage())
        z = y.sin()  # saves y; budget 0: copied to the host tier at once
        del y
        engine.flush()
        gc.collect()
        assert engine.stats().device_tier_bytes == 0
        assert ref() is None
        z.sum().backward()


def test_twin_device_budget_serves_resident_tensors_without_copies(save_dir: Path) -> None:
    x = torch.randn(N, requires_grad=True)
    with twin_with_hooks("disk", save_dir, chunk_bytes=4096, device_budget=LINKS * SIZE) as (
        engine,
        _,
    ):
        _chain(x).backward()
        stats = engine.stats()
    assert stats.bytes_demoted_to_host == stats.bytes_demoted_to_disk == 0
    assert stats.prefetch_misses == 0 and stats.bytes_read == 0
    assert x.grad is not None and torch.equal(x.grad, _reference(x))


def test_twin_cpu_target_with_host_budget_exhausted_stays_on_device(save_dir: Path) -> None:
    x = torch.randn(N, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with twin_with_hooks("cpu", save_dir, host_budget=3 * SIZE) as (engine, _):
            _chain(x).backward()
            stats = engine.stats()
    fallback = [w for w in caught if issubclass(w.category, OffloadFallbackWarning)]
    assert len(fallback) == 1 and "host_budget" in str(fallback[0].message)
    assert stats.tensors_offloaded == 3 and stats.fallbacks == LINKS - 3
    assert stats.peak_host_tier_bytes == 3 * SIZE
    assert stats.peak_device_tier_bytes == (LINKS - 3) * SIZE
    assert x.grad is not None and torch.equal(x.grad, _reference(x))
