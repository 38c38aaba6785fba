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
    assert plan.predicted_steps == 0
    assert _names(plan.window(recs[3])) == [2, 1]


def test_a_step_without_unpacks_teaches_nothing() -> None:
    plan = PrefetchPlan(2)
    _step(plan, 4, [1, 0, 3, 2])
    keep = _step(plan, 4, [])  # step 2 has no unpacks: nothing to predict or learn
    assert plan.predicted_steps == 0
    recs = _step(plan, 4, [1])  # step 1's order still stands
    assert plan.predicted_steps == 1 and keep
    assert _names(plan.window(recs[1])) == [0, 3]


def test_records_of_an_older_step_use_reverse_order() -> None:
    plan = PrefetchPlan(2)
    old = _step(plan, 4, [0, 1, 2, 3])
    _step(plan, 4, [0])  # a new step; the old graph is still alive
    assert _names(plan.window(old[3])) == [2, 1]


def test_outstanding_prefetches_are_capped_in_bytes() -> None:
    """A byte cap smaller than a record makes one-record windows: at most about two
    windows' bytes stay outstanding, not 2 * depth records."""
    plan = PrefetchPlan(4, window_bytes=50)
    recs = _recs(12, plan)  # 100 bytes each
    anchor = recs[11]
    assert _names(plan.window(anchor)) == [10]  # one record always goes
    for r in recs[10:4:-1]:
        r.pending = True
        plan.issued(r, anchor)
    assert [r.name for r in recs if r.pending] == [9, 10]  # 2 * 100 bytes, the nearest


def test_a_step_is_learned_over_the_records_alive_at_its_backward() -> None:
    """A forward whose graph was dropped packs into the next step; its dead records are
    not in that step's signature, so the learned order still applies."""
    plan = PrefetchPlan(2)
    _step(plan, 6, [3, 4, 5, 0, 1, 2])
    plan.begin_forward()
    dropped = [Rec(100 + i, shape=(7,)) for i in range(3)]
    for r in dropped:
        plan.register(r, (r.shape, r.nbytes))
    del dropped, r
    gc.collect()
    recs = _recs(6, plan)
    plan.unpacked(recs[3], 0)
    assert plan.predicted_steps == 1
    assert _names(plan.window(recs[3])) == [4, 5]
    for i in (4, 5, 0, 1, 2):
        plan.unpacked(recs[i], 0)
    later = _step(plan, 6, [3])  # and what it teaches is the same order
    assert plan.predicted_steps == 2
    assert _names(plan.window(later[5])) == [0, 1]


def test_alternating_structures_each_keep_their_order() -> None:
    plan = PrefetchPlan(2)

    def step_b(order: list[int]) -> list[Rec]:
        plan.begin_forward()
        recs = [Rec(i, shape=(9,)) for i in range(4)]
        for r in recs:
            plan.register(r, (r.shape, r.nbytes))
        for i in order:
            plan.unpacked(recs[i], 0)
        return recs

    _step(plan, 6, [3, 4, 5, 0, 1, 2])
    step_b([0, 1, 2, 3])
    a = _step(plan, 6, [3])
    assert _names(plan.window(a[3])) == [4, 5]
    b = step_b([0])
    assert _names(plan.window(b[0])) == [1, 2]
    assert plan.predicted_steps == 2


def test_a_step_backwarded_after_later_forwards_follows_its_order() -> None:
    """Pipeline schedules run the next forward before the previous backward."""
    plan = PrefetchPlan(2)
    _step(plan, 6, [3, 4, 5, 0, 1, 2])
    plan.begin_forward()
    first = _recs(6, plan)
    plan.begin_forward()
    second = _recs(6, plan)
    plan.unpacked(first[3], 0)
    assert plan.predicted_steps == 1
    assert _names(plan.window(first[3])) == [4, 5]
    for i in (4, 5, 0, 1, 2):
        plan.unpacked(first[i], 0)
    plan.begin_forward()
    plan.unpacked(second[3], 0)
    assert plan.predicted_steps == 2
    assert _names(plan.window(second[5])) == [0, 1]


def test_a_placeholder_keeps_the_structure_of_a_tensor_that_crossed_the_size_floor() -> None:
    """Position 2 is a record in one step and kept in memory (a placeholder) in the
    next: the signatures agree, the window passes over the placeholder, and the order
    learned with the placeholder still places the record when it comes back."""
    plan = PrefetchPlan(2)

    def step(small: int | None, order: list[int]) -> list[Any]:
        plan.begin_forward()
        entries: list[Any] = []
        for i in range(6):
            if i == small:
                entries.append(_Holder())
                plan.placeholder(entries[-1], ((25,), 100), key=i)
                plan.placeholder(_Holder(), ((25,), 100), key=i)  # saved again: nothing
            else:
                entries.append(Rec(i))
                plan.register(entries[-1], ((25,), 100))
        for i in order:
            plan.unpacked(entries[i], 0)
        return entries

    order = [3, 4, 5, 0, 1, 2]  # the region of 0..2 is unpacked in forward order
    step(None, order)  # learned with a record at 2
    recs = step(2, order[:1])  # a placeholder at 2 now: same structure
    assert plan.predicted_steps == 1
    assert _names(plan.window(recs[5])) == [0, 1]
    assert _names(plan.window(recs[0])) == [1]  # 2 is passed over
    step(2, order)  # learned with the placeholder at 2, unpacked in its place
    recs = step(None, order[:1])  # a record at 2 again: in the window
    assert plan.predicted_steps == 3
    assert _names(plan.window(recs[0])) == [1, 2]


class _Holder:
    """A stand-in for a kept tensor's handle (Kept): weakly held, with its place."""

    __slots__ = ("__weakref__", "spos", "step")


# -- unpack groups (NOTE [unpack groups]) --------------------------------------------------


def test_a_window_extends_to_the_end_of_a_group() -> None:
    plan = PrefetchPlan(2)
    # Three compiled regions of 4 records each, unpacked region by region.
    order = [8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3]
    groups = [1] * 4 + [2] * 4 + [3] * 4
    _step(plan, 12, order, groups)
    recs = _step(plan, 12, [11], [1])
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


@pytest.mark.parametrize(
    ("n", "groups"),
    [
        (40, [i // 2 + 1 for i in range(40)]),  # eager: a node unpacks one or two
        (41, [1] * 21 + [2] * 20),  # two blocks compiled one by one: neither is the model
    ],
    ids=["eager", "two-regions"],
)
def test_groups_of_a_step_compiled_per_block_are_not_reported(
    caplog: pytest.LogCaptureFixture, n: int, groups: list[int]
) -> None:
    plan = PrefetchPlan(2)
    caplog.set_level(logging.WARNING, logger="prefetch_offload")
    for _ in range(3):
        _step(plan, n, list(range(n)), groups)
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


def test_regions_of_another_size_keep_the_learned_order(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another sequence length changes every shape but not the graph: the order learned
    at one size serves the next size (NOTE [learned order])."""
    sizes = [1 << 14, 3 << 12, 1 << 13, 5 << 11]
    xs = [torch.randn(n, requires_grad=True) for n in sizes]
    expected = []
    for x in xs:
        _regions(x, compute=0.0).backward()
        expected.append(x.grad)
        x.grad = None
    rates = []
    with engine_with_hooks(save_dir) as engine:
        slow_store(engine, monkeypatch, "read", 0.003)
        for x, want in zip(xs, expected, strict=True):
            loss = _regions(x)
            engine.flush()
            before = engine.stats()
            loss.backward()
            rates.append(_hit_rate(before, engine.stats()))
            assert torch.equal(x.grad, want)
        assert engine.stats().predicted_steps == len(sizes) - 1
    assert rates[0] < 0.65 and min(rates[1:]) >= 0.85, rates


class _RegionWithStat(torch.autograd.Function):
    """_Region plus a small saved statistic (n/16 elements), as a norm's per-token
    statistics are: another length can take it under ``min_offload_bytes``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, compute: float) -> torch.Tensor:
        outs = [(x * (1.0 + i / 16)).sin() for i in range(4)]
        stat = x[: x.numel() // 16] * 2
        ctx.save_for_backward(x, *outs, stat)
        ctx.compute = compute
        return torch.stack(outs).sum(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *outs, stat = ctx.saved_tensors
        time.sleep(ctx.compute)
        g = sum((1.0 + i / 16) * torch.cos(x * (1.0 + i / 16)) for i in range(len(outs)))
        for o in outs:
            g = g + o / 64
        g = g.clone()
        g[: stat.numel()] += stat / 64
        return grad * g, None


def test_a_saved_tensor_crossing_min_offload_bytes_keeps_the_order(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 16384 elements each region's statistic (4 KiB) is offloaded; at 12288 it is
    kept (3 KiB): a placeholder keeps the steps' structure, so the order carries over,
    and the order learned with placeholders still prefetches the statistics when they
    are records again."""
    sizes = [1 << 14, 3 << 12, 1 << 14, 3 << 12, 1 << 14]
    xs = [torch.randn(n, requires_grad=True) for n in sizes]

    def run(x: torch.Tensor, compute: float) -> torch.Tensor:
        h = x
        for _ in range(6):
            h = _RegionWithStat.apply(h, compute)
        return h.sum()

    expected = []
    for x in xs:
        run(x, 0.0).backward()
        expected.append(x.grad)
        x.grad = None
    picked: list[Any] = []
    window = PrefetchPlan.window

    def logged(plan: PrefetchPlan, rec: Any) -> list[Any]:
        out = window(plan, rec)
        picked.extend(out)
        return out

    monkeypatch.setattr(PrefetchPlan, "window", logged)
    with engine_with_hooks(save_dir, min_offload_bytes=4096) as engine:
        slow_store(engine, monkeypatch, "read", 0.003)
        for x, want in zip(xs, expected, strict=True):
            loss = run(x, 0.02)
            engine.flush()
            picked.clear()
            loss.backward()
            assert torch.equal(x.grad, want)
        assert engine.stats().predicted_steps == len(sizes) - 1
    # The last step learned from a step whose statistics were placeholders.
    stats = {id(r) for r in picked if r.span.nbytes == (1 << 14) // 16 * 4}
    assert len(stats) >= 5, len(stats)  # the first region's may come first of all


def test_reentrant_checkpointing_keeps_the_learned_order(save_dir: Path) -> None:
    """Recomputation packs inside backward: those tensors stay in memory (NOTE [packs
    inside backward]); the step's own records are offloaded and follow the order learned
    from the step before, and the gradients stay exact."""
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(1 << 12, requires_grad=True)

    def segment(h: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            h = (h * (1.0 + i / 8)).sin()
        return h

    def step() -> torch.Tensor:
        h = x
        for _ in range(4):
            h = checkpoint(segment, h.sin(), use_reentrant=True)
        return h.sum()

    step().backward()
    expected, x.grad = x.grad, None
    with engine_with_hooks(save_dir, min_offload_bytes=1) as engine:
        for _ in range(3):
            loss = step()
            engine.flush()
            before = engine.stats()
            loss.backward()
            after = engine.stats()
            assert torch.equal(x.grad, expected)
            x.grad = None
            # Each segment's 3 recomputed inputs of sin stay; nothing is written then.
            assert after.kept_in_backward - before.kept_in_backward == 4 * 3
            assert after.bytes_offloaded == before.bytes_offloaded
        assert engine.stats().predicted_steps == 2
        # Forward offloaded at most the checkpoints' inputs and what sin saved outside
        # them (2 per segment and step; x itself is a leaf that stays).
        assert engine.stats().tensors_offloaded <= 3 * 4 * 2


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_forward_after_a_create_graph_backward_is_a_step(save_dir: Path) -> None:
    """A create_graph backward's last packs come from inside it; the next ordinary
    forward is still a step of its own, learned and predicted."""
    x = torch.randn(1 << 12, requires_grad=True)

    def chain() -> torch.Tensor:
        h = x
        for i in range(6):
            h = (h * (1.0 + i / 8)).sin()
        return h.sum()

    with engine_with_hooks(save_dir, min_offload_bytes=1) as engine:
        for _ in range(4):
            loss = chain()
            engine.flush()
            loss.backward(create_graph=True)
            x.grad = None
        assert engine.stats().predicted_steps == 3


def test_concurrent_backwards_clean_up_once_the_last_one_ends(save_dir: Path) -> None:
    """Two backward calls on two threads: the end-of-backward cleanup (recent spans,
    idle read buffers) waits for both instead of running at every thread switch."""
    import threading

    xs = [torch.randn(1 << 13, requires_grad=True) for _ in range(2)]

    def chain(x: torch.Tensor) -> torch.Tensor:
        h = x
        for i in range(100):
            h = (h * (1.0 + i / 512)).sin()
        return h.sum()

    with engine_with_hooks(save_dir, prefetch_depth=2) as engine:
        calls = []
        real = engine._reader.end_backward
        engine._reader.end_backward = lambda: (calls.append(1), real())[1]  # type: ignore[method-assign]
        losses = [chain(x) for x in xs]
        engine.flush()
        barrier = threading.Barrier(2)

        def run(loss: torch.Tensor) -> None:
            barrier.wait()
            loss.backward()

        threads = [threading.Thread(target=run, args=(loss,)) for loss in losses]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(x.grad is not None for x in xs)
        assert 1 <= len(calls) <= 2, len(calls)
        assert not engine._end_tasks
