"""The lookahead scheduler: the window, the outstanding cap, weak references."""

from __future__ import annotations

import gc

from prefetch_offload.scheduler import PrefetchScheduler


class Rec:
    def __init__(self, name: int) -> None:
        self.name = name
        self.pos = -1
        self.pending = False
        self.on_disk = True

    def needs_read(self) -> bool:
        return self.on_disk and not self.pending

    def drop_prefetch(self) -> None:
        self.pending = False


def _recs(n: int, sched: PrefetchScheduler) -> list[Rec]:
    recs = [Rec(i) for i in range(n)]
    for r in recs:
        sched.register(r)
    return recs


def test_window_is_the_next_records_below() -> None:
    sched = PrefetchScheduler(3)
    recs = _recs(10, sched)
    assert [r.name for r in sched.window(recs[9])] == [8, 7, 6]
    assert [r.name for r in sched.window(recs[1])] == [0]
    recs[7].pending = True  # already in flight: counts toward depth, not issued again
    assert [r.name for r in sched.window(recs[9])] == [8, 6]


def test_depth_zero_never_prefetches() -> None:
    sched = PrefetchScheduler(0)
    recs = _recs(4, sched)
    assert sched.window(recs[3]) == []


def test_dead_records_are_skipped_and_not_kept_alive() -> None:
    sched = PrefetchScheduler(2)
    recs = _recs(6, sched)
    del recs[3:5]  # records 3 and 4 die
    gc.collect()
    assert [r.name for r in sched.window(recs[3])] == [2, 1]  # recs[3] is record 5


def test_outstanding_prefetches_are_capped_farthest_first() -> None:
    sched = PrefetchScheduler(2)
    recs = _recs(12, sched)
    anchor = recs[11]
    for r in recs[1:6]:
        r.pending = True
        sched.issued(r, anchor)
    # Cap is 2 * depth = 4: the record farthest from the anchor (1) was dropped.
    assert [r.name for r in recs if r.pending] == [2, 3, 4, 5]
    sched.consumed(recs[5])
    recs[5].pending = False
    recs[6].pending = True
    sched.issued(recs[6], anchor)
    assert [r.name for r in recs if r.pending] == [2, 3, 4, 6]
    sched.clear()
    assert not any(r.pending for r in recs)


def test_compaction_keeps_positions_consistent() -> None:
    sched = PrefetchScheduler(2)
    keep: list[Rec] = []
    for i in range(500):
        r = Rec(i)
        sched.register(r)
        if i % 10 == 0:
            keep.append(r)
        else:
            sched.forget()
    assert [r.name for r in sched.window(keep[-1])] == [keep[-2].name, keep[-3].name]
