"""The prefetch plan: windows, the learned order, unpack groups, the outstanding cap."""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import engine_with_hooks, slow_store

from prefetch_offload.plan import PrefetchPlan


class Rec:
    def __init__(self, name: int, nbytes: int = 100, shape: tuple[int, ...] = (25,)) -> None:
        self.name = name
        self.nbytes = nbytes
        self.shape = shape
        self.pos = self.step = self.spos = -1
        self.pending = False
        self.on_disk = True

    def needs_read(self) -> bool:
        return self.on_disk and not self.pending

    def drop_prefetch(self) -> None:
        self.pending = False


def _recs(n: int, plan: PrefetchPlan, **kw: int) -> list[Rec]:
    recs = [Rec(i, **kw) for i in range(n)]
    for r in recs:
        plan.register(r, (r.shape, r.nbytes))
    return recs


def _names(recs: list[Rec]) -> list[int]:
    return [r.name for r in recs]


def _step(
    plan: PrefetchPlan, n: int, order: list[int], groups: list[int] | None = None
) -> list[Rec]:
    """One step: pack ``n`` records, then unpack them in ``order`` (group keys per unpack)."""
    plan.begin_forward()
    recs = _recs(n, plan)
    plan.begin_backward()
    for i, k in zip(order, groups or [0] * len(order), strict=True):
        plan.unpacked(recs[i], k)
    return recs


# -- reverse pack order (no learned order) ---------------------------------------------


def test_window_is_the_next_records_below() -> None:
    plan = PrefetchPlan(3)
    recs = _recs(10, plan)
    assert _names(plan.window(recs[9])) == [8, 7, 6]
    assert _names(plan.window(recs[1])) == [0]
    recs[7].pending = True  # already in flight: counts toward depth, not issued again
    assert _names(plan.window(recs[9])) == [8, 6]


def test_depth_zero_never_prefetches() -> None:
    plan = PrefetchPlan(0)
    recs = _recs(4, plan)
    assert plan.window(recs[3]) == []


def test_window_bytes_cap_the_window_but_one_record_always_goes() -> None:
    plan = PrefetchPlan(4, window_bytes=250)
    recs = _recs(10, plan)  # 100 bytes each
    assert _names(plan.window(recs[9])) == [8, 7]
    plan.window_bytes = 50
    assert _names(plan.window(recs[9])) == [8]


def test_dead_records_are_skipped_and_not_kept_alive() -> None:
    plan = PrefetchPlan(2)
    recs = _recs(6, plan)
    del recs[3:5]  # records 3 and 4 die
    gc.collect()
    assert _names(plan.window(recs[3])) == [2, 1]  # recs[3] is record 5


def test_outstanding_prefetches_are_capped_farthest_first() -> None:
    plan = PrefetchPlan(2)
    recs = _recs(12, plan)
    anchor = recs[11]
    plan.window(anchor)  # a window of 2: the cap is 2 * depth = 4
    for r in recs[1:6]:
        r.pending = True
        plan.issued(r, anchor)
    # The record farthest from the anchor (1) was dropped.
    assert [r.name for r in recs if r.pending] == [2, 3, 4, 5]
    plan.consumed(recs[5])
    recs[5].pending = False
    recs[6].pending = True
    plan.issued(recs[6], anchor)
    assert [r.name for r in recs if r.pending] == [2, 3, 4, 6]
    plan.clear()
    assert not any(r.pending for r in recs)


def test_compaction_keeps_positions_consistent() -> None:
    plan = PrefetchPlan(2)
    keep: list[Rec] = []
    for i in range(500):
        r = Rec(i)
        plan.register(r, ())
        if i % 10 == 0:
            keep.append(r)
        else:
            plan.forget()
    assert _names(plan.window(keep[-1])) == [keep[-2].name, keep[-3].name]


# -- the learned order (NOTE [learned order]) ---------------------------------------------


def test_the_order_of_the_last_backward_is_the_prediction() -> None:
    plan = PrefetchPlan(2)
    order = [3, 4, 5, 0, 1, 2]  # two regions, forward order inside each, regions reversed
    first = _step(plan, 6, order)
    assert _names(plan.window(first[3])) == [2, 1]  # step 1: reverse pack order
    recs = _step(plan, 6, order[:1])  # step 2 repeats step 1's structure
    assert plan.predicted_steps == 1
    assert _names(plan.window(recs[3])) == [4, 5]
    assert _names(plan.window(recs[5])) == [0, 1]


def test_a_changed_structure_falls_back_to_reverse_order() -> None:
    plan = PrefetchPlan(2)
    _step(plan, 6, [3, 4, 5, 0, 1, 2])
    plan.begin_forward()
    recs = [Rec(i, shape=(30,)) for i in range(6)]  # same count, other shapes
    for r in recs:
        plan.register(r, (r.shape, r.nbytes))
    plan.begin_backward()
    assert plan.predicted_steps == 0
    assert _names(plan.window(recs[3])) == [2, 1]


def test_a_step_without_unpacks_teaches_nothing() -> None:
    plan = PrefetchPlan(2)
    _step(plan, 4, [1, 0, 3, 2])
    plan.begin_forward()
    _recs(4, plan)
    plan.begin_backward()  # predicted from step 1
    recs = _step(plan, 4, [])  # step 2 had no unpacks: step 1's order still stands
    assert plan.predicted_steps == 2
    assert _names(plan.window(recs[1])) == [0, 3]


def test_records_of_an_older_step_use_reverse_order() -> None:
    plan = PrefetchPlan(2)
    old = _step(plan, 4, [0, 1, 2, 3])
    _step(plan, 4, [0])  # a new step; the old graph is still alive
    assert _names(plan.window(old[3])) == [2, 1]


# -- unpack groups (NOTE [unpack groups]) --------------------------------------------------


def test_a_window_extends_to_the_end_of_a_group() -> None:
    plan = PrefetchPlan(2)
    # Three compiled regions of 4 records each, unpacked region by region.
    order = [8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3]
    groups = [1] * 4 + [2] * 4 + [3] * 4
    _step(plan, 12, order, groups)
    recs = _step(plan, 12, [])
    assert _names(plan.window(recs[11])) == [4, 5, 6, 7]  # the whole next region
    plan.window_bytes = 300  # the bytes cap still holds
    assert _names(plan.window(recs[11])) == [4, 5, 6]


def test_one_node_unpacking_most_of_a_step_is_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plan = PrefetchPlan(2)
    caplog.set_level(logging.WARNING, logger="prefetch_offload")
    for _ in range(3):
        _step(plan, 40, list(range(40)), [7] * 40)
    plan.begin_forward()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "block.compile()" in msgs[0] and "40 of the 40" in msgs[0]


def test_eager_sized_groups_are_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    plan = PrefetchPlan(2)
    caplog.set_level(logging.WARNING, logger="prefetch_offload")
    for _ in range(3):
        _step(plan, 40, list(range(40)), [i // 2 + 1 for i in range(40)])
    plan.begin_forward()
    assert caplog.records == []


# -- the engine follows the learned order --------------------------------------------------


class _Region(torch.autograd.Function):
    """Saves ``k`` tensors; backward unpacks them all at once, in save order, as a
    compiled region's backward does, then computes for ``compute`` seconds."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: int, compute: float) -> torch.Tensor:
        outs = [(x * (1.0 + i / 16)).sin() for i in range(k)]
        ctx.save_for_backward(x, *outs)
        ctx.compute = compute
        return torch.stack(outs).sum(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *outs = ctx.saved_tensors
        time.sleep(ctx.compute)
        g = sum((1.0 + i / 16) * torch.cos(x * (1.0 + i / 16)) for i in range(len(outs)))
        # Not the exact derivative: a term in each saved output, so that a wrong byte in
        # any of them changes the gradient (the reference runs this same backward).
        for o in outs:
            g = g + o / 64
        return grad * g, None, None


def _regions(x: torch.Tensor, n: int = 8, k: int = 6, compute: float = 0.03) -> torch.Tensor:
    h = x
    for _ in range(n):
        h = _Region.apply(h, k, compute)
    return h.sum()


def _hit_rate(before: Any, after: Any) -> float:
    hits = after.prefetch_hits - before.prefetch_hits
    misses = after.prefetch_misses - before.prefetch_misses
    return hits / (hits + misses)


def test_regions_unpacked_in_save_order_are_prefetched_from_the_second_step(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each region's backward wants all its tensors at once, in forward order: reverse
    pack order prefetches the wrong ones; the learned order has them all ready."""
    x = torch.randn(1 << 14, requires_grad=True)
    ref = x.detach().clone().requires_grad_()
    _regions(ref, compute=0.0).backward()
    rates = []
    with engine_with_hooks(save_dir) as engine:
        slow_store(engine, monkeypatch, "read", 0.003)  # one read per tensor
        for _ in range(3):
            x.grad = None
            loss = _regions(x)
            engine.flush()  # every tensor on disk: each one is a read
            before = engine.stats()
            loss.backward()
            rates.append(_hit_rate(before, engine.stats()))
            assert x.grad is not None and torch.equal(x.grad, ref.grad)
        assert engine.stats().predicted_steps == 2
    # Reverse order: about half the reads are late. Learned: all but the first
    # region's (7 of 55 unpacks), which nothing precedes.
    assert rates[0] < 0.65, rates
    assert min(rates[1:]) >= 0.85, rates


def test_two_losses_backwarded_out_of_pack_order_keep_their_hit_rate(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Branch a is packed before branch b but backwarded first: reverse pack order misses
    every read at the switch from a to b; the learned order crosses it."""
    x = torch.randn(1 << 14, requires_grad=True)

    def branch(scale: float) -> torch.Tensor:
        h = x
        for i in range(6):
            h = (h * (scale + i / 16)).sin()
            h = _Slow.apply(h)
        return h.sum()

    a, b = branch(1.0), branch(2.0)
    a.backward()
    b.backward()
    expected = x.grad
    rates = []
    with engine_with_hooks(save_dir, prefetch_depth=2) as engine:
        slow_store(engine, monkeypatch, "read", 0.003)
        for _ in range(3):
            x.grad = None
            a, b = branch(1.0), branch(2.0)
            engine.flush()
            before = engine.stats()
            a.backward()
            b.backward()
            rates.append(_hit_rate(before, engine.stats()))
            assert torch.equal(x.grad, expected)
    assert rates[1] > rates[0] and rates[2] > rates[0], rates
    assert min(rates[1:]) >= 0.8, rates


class _Slow(torch.autograd.Function):
    """The identity, with a little backward compute to hide reads behind."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)
        return grad
