"""The prefetch plan: windows, the learned order, unpack groups, the outstanding cap."""

from __future__ import annotations

import gc
import logging

import pytest

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
