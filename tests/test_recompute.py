"""recompute.py: the automatic keep / offload / recompute policy.

The cost model is driven with fake measurements (a clock and engine counters the
test sets); the end-to-end tests train a model under recompute="auto".
"""

from __future__ import annotations

import collections
import copy
import functools
import math
import re
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import on_ranks
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from prefetch_offload import (
    OffloadFallbackWarning,
    OffloadStats,
    offload_context,
    recompute,
    recompute_planner,
    recompute_trims,
    recompute_weighing,
)
from prefetch_offload.agreement import AGREE_EVERY
from prefetch_offload.blocks import PLAIN, SELECTIVE, WHOLE
from prefetch_offload.errors import OffloadError
from prefetch_offload.heap import CEILING_STEPS
from prefetch_offload.peak import PeakSampler
from prefetch_offload.recompute import AutoDecider
from prefetch_offload.recompute_profile import (
    OFFLOAD_ALL,
    PROFILE,
    RECOMPUTE_ALL,
    WHOLE_ALL,
    WHOLE_TIMED,
    Profile,
)
from prefetch_offload.recompute_weighing import ActivePlan
from prefetch_offload.testing import TinyTransformer, make_batch, warm_up_unary_ops

P = CheckpointPolicy
MM, GELU, VIEW = torch.ops.aten.mm.default, torch.ops.aten.gelu.default, torch.ops.aten.view.default
ADD = torch.ops.aten.add.Tensor
GB = 10**9


class _Fake:
    """A clock and the engine counters, both set by the test."""

    def __init__(self) -> None:
        self.now = 0.0
        self.stats = OffloadStats()

    def clock(self) -> float:
        return self.now

    def snapshot(self) -> OffloadStats:
        return self.stats

    def add(self, **counters: float) -> None:
        values = {f: getattr(self.stats, f) + v for f, v in counters.items()}
        self.stats = OffloadStats(**{**self.stats.__dict__, **values})


def _out(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes // 4, device="meta")


def _step(
    decider: AutoDecider,
    fake: _Fake,
    ops: list[tuple[Any, int, float]],
    *,
    step_s: float,
    forward_s: float = 1.0,
    blocks: int = 1,
    saved: int = 0,
    consumed: set[Any] | None = None,
    slow: int | None = None,
    dispatch_s: float = 0.0,
    block_s: list[float] | None = None,
    **counters: float,
) -> dict[Any, CheckpointPolicy]:
    """One step through ``blocks`` blocks, each taking ``forward_s`` forward and
    ``step_s - forward_s`` backward, as the wrapper and the dispatch modes report it: a
    selective block decides each op, and its recompute reads back what was stored
    (``consumed``: which of those it asks for; None: all); a whole block hands
    ``saved`` bytes to the engine; block ``slow`` takes a second longer forward; the
    modes report ``dispatch_s`` of their own per selective block; ``block_s``, if given,
    is each block's own ``step_s``."""
    decisions = {}
    modes = []
    for b in range(blocks):
        mode = decider.mode("Block", b)
        modes.append(mode)
        start = fake.now
        decider.entered("Block", b)
        if mode == SELECTIVE:
            for func, nbytes, seconds in ops:
                key = ("Block", b, func, 0)
                decisions[func] = decider.decide(key, func, (), {}, _out(nbytes))
                if decider.timing():
                    decider.observe(key, func, _out(nbytes), seconds, decisions[func])
            decider.dispatched(("Block", b), dispatch_s)
        elif mode == WHOLE:
            fake.add(device_tier_bytes=saved)
        fake.now = start + forward_s + (1.0 if b == slow else 0.0)
        decider.exited("Block", b)
    for b in reversed(range(blocks)):
        start = fake.now
        decider.backward("Block", b)
        if modes[b] == SELECTIVE:
            decider.recomputing()
            for func, _, _ in ops:
                stored = decisions[func] is not P.PREFER_RECOMPUTE
                if stored and (consumed is None or func in consumed):
                    decider.consumed(("Block", b, func, 0))
        fake.now = start + (step_s if block_s is None else block_s[b]) - forward_s
    fake.add(**counters)
    return decisions


_MM_S = 1.0
_OPS = [(MM, GB // 2, _MM_S), (GELU, GB // 2, 0.01), (VIEW, GB // 2, 0.0), (ADD, GB // 4, 0.01)]
_NEEDED = {MM, GELU, VIEW}
# What the recompute-all step recomputes of what the offload-all step read back.
_RECOMPUTED_S = _MM_S + 0.01


def _plan(
    offload_all_s: float,
    recompute_all_s: float,
    *,
    blocks: int = 1,
    budget: int = 0,
    saved: int = 0,
    dispatch_s: float = 0.0,
    whole_s: float = 10.0,
    ops: list[tuple[Any, int, float]] = _OPS,
    checkpoint_stats: Any = None,
    trim_heap: Callable[[], None] = lambda: None,
    hold_trims: Callable[[bool, int | None], None] | None = None,
    trims_held: Callable[[], bool] | None = None,
    peaks: Any = None,
    agreement: Any = None,
    whole_moved: int = 0,
    **profile: float,
) -> AutoDecider:
    """The profiling steps (NOTE [keep, offload, recompute]), each block's share of
    the given step times (``whole_s``: the steps with every block whole again; the last
    recompute-all step and the last whole one take 1.2 times as long), then the first
    planned step (``decider.decisions``); the modes report ``dispatch_s`` of their own
    per block in the recompute-all steps, and the whole steps after them move
    ``whole_moved`` bytes."""
    fake = _Fake()
    decider = AutoDecider(
        fake.snapshot,
        budget,
        clock=fake.clock,
        checkpoint_stats=checkpoint_stats,
        trim_heap=trim_heap,
        hold_trims=hold_trims,
        trims_held=trims_held,
        peaks=peaks,
        agreement=agreement,
    )
    per = {"blocks": blocks, "forward_s": 1.0 / blocks}
    whole = _step(decider, fake, ops, step_s=3.0 / blocks, saved=saved, **per)  # type: ignore[arg-type]
    assert not whole and not decider.timing()  # every block whole: no op seen
    first = _step(
        decider, fake, ops, step_s=offload_all_s / blocks, consumed=_NEEDED, **per, **profile
    )  # type: ignore[arg-type]
    assert first[MM] is P.PREFER_CPU_OFFLOAD and first[VIEW] is P.PREFER_RECOMPUTE
    kinds = PROFILE
    counted = Profile.counted(RECOMPUTE_ALL)
    for i, kind in enumerate(kinds[2:], start=2):
        slower = 1.2 if kind not in kinds[i + 1 :] else 1.0
        if kind == RECOMPUTE_ALL:
            step_s = slower * recompute_all_s / blocks
            got = _step(decider, fake, ops, step_s=step_s, dispatch_s=dispatch_s, **per)  # type: ignore[arg-type]
            assert set(got.values()) == {P.PREFER_RECOMPUTE}
            assert decider.timing() == (i not in counted)  # a counted step runs untimed
        else:
            step_s = slower * whole_s / blocks
            got = _step(
                decider, fake, ops, step_s=step_s, saved=saved, bytes_offloaded=whole_moved, **per
            )  # type: ignore[arg-type]
            assert not got and not decider.timing()  # every block whole
        assert decider.profiling
    assert decider.plan().plans_made == 0
    decider.decisions = _step(decider, fake, ops, step_s=3.0 / blocks, **per)  # type: ignore[arg-type, attr-defined]
    assert decider.plan().plans_made == 1 and not decider.profiling
    decider.fake = fake  # type: ignore[attr-defined]  # for the steps a test adds
    return decider


_SLOW_LINK = {
    "bytes_offloaded": 1.25 * GB,
    "pack_wait_seconds": 1.0,
    "bytes_read": 1.25 * GB,
    "read_seconds": 4.0,
}


def test_a_slow_link_recomputes_what_is_cheap_per_byte_and_offloads_the_rest() -> None:
    # Forward stalled 1 s on writes of 1.25 GB; reads took 4 s for as many bytes; the
    # step that stored everything took 3 s, the one that recomputed everything 2.5 s.
    decider = _plan(3.0, 2.5, dispatch_s=0.01, **_SLOW_LINK)
    decisions = decider.decisions  # type: ignore[attr-defined]
    assert decider.mode("Block", 0) == SELECTIVE
    assert decisions[GELU] is P.PREFER_RECOMPUTE  # 0.01 s for 0.5 GB
    assert decisions[MM] is P.PREFER_CPU_OFFLOAD  # 1 s: more than moving its bytes costs
    assert decisions[VIEW] is P.PREFER_RECOMPUTE  # aliases its input
    assert decisions[ADD] is P.PREFER_RECOMPUTE  # the recompute never asked for it
    measured = decider.plan().measured
    # Moving cost 3 - (2.5 - 1.01) = 1.51 s, 1 s of it the forward stall: 0.41 s/GB.
    assert measured["move_s_per_GB"] == pytest.approx(0.51 / 1.25)
    assert measured["forward_stall_s"] == 1.0
    # The modes' own 0.01 s, with the switch into Python they do not see.
    assert measured["dispatch_s_per_block"] == pytest.approx(0.015)


def test_matmul_s_unsafe_view_counts_as_an_alias() -> None:
    """Its schema marks no alias, but its output is its input's memory: storing both
    would move the same bytes twice, so the plan recomputes the view."""
    unsafe_view = torch.ops.aten._unsafe_view.default
    out = torch.ops.aten.mm.default(torch.randn(6, 4), torch.randn(4, 5))
    view = unsafe_view(out, [2, 3, 5])
    assert view.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert unsafe_view._schema.returns[0].alias_info is None
    assert recompute._aliases(unsafe_view) and not recompute._aliases(MM)


def test_selective_that_saves_less_than_its_dispatch_costs_checkpoints_plainly() -> None:
    """The same link, but the dispatch modes measured 0.5 s of their own per block:
    offloading the matmul saves less than they cost, so the block is checkpointed
    without them and every op is recomputed."""
    decider = _plan(3.0, 2.5, dispatch_s=0.5, **_SLOW_LINK)
    assert decider.mode("Block", 0) == PLAIN
    assert decider.decisions == {}  # type: ignore[attr-defined]  # no dispatch mode ran
    plan = decider.plan()
    assert plan.bytes_offloaded == 0 and "checkpointed plainly" in str(plan)
    assert plan.measured["dispatch_in_modes_s"] == 0.5
    assert plan.measured["dispatch_s_per_block"] == pytest.approx(0.75)


@pytest.mark.parametrize("first", ["engine", "block"])
def test_in_the_profile_the_trim_bound_follows_the_last_step_of_the_same_class(
    first: str,
) -> None:
    """NOTE [profiling under trims]: whatever runs first in a step, the engine's forward
    or the first block, each profiling step trims as a step of its own kind would."""
    fake = _Fake()
    trims: list[int] = []  # NOTE [a trim where the plan changes]: the steps that ask
    decider = AutoDecider(
        fake.snapshot, 0, clock=fake.clock, trim_heap=lambda: trims.append(len(got) + 1)
    )
    # Bytes each step moves: whole 1000, offload-all 2000, recompute-all 10 and 20, whole
    # 900 to 1100, recompute-all 30 and 40, planned 500.
    moved = [1000, 2000, 10, 20, 900, 1000, 1100, 30, 40, 500, 500]
    # At the start of steps 1 to 10 (the first planned step: the bytes of the step before).
    expected = [1000, 0, 10, 1000, 900, 1000, 20, 30, 40, 500]
    got = []
    for step in range(len(moved)):
        if step and first == "engine":
            got.append(decider.trim_basis(moved[step - 1]))
        for b in range(2):
            decider.mode("Block", b)
            if step and b == 0 and first == "block":
                got.append(decider.trim_basis(moved[step - 1]))
            decider.entered("Block", b)
            fake.now += 0.1
            decider.exited("Block", b)
        for b in reversed(range(2)):
            decider.backward("Block", b)
            fake.now += 0.2
        assert decider.profiling == (step < len(PROFILE)), step
    assert got == expected
    # Of another class than the step before: offload-all, the first recompute-all, the
    # first whole again, recompute-all again, the first planned step.
    assert trims == [1, 2, 4, 7, 9]


def test_the_newest_blocks_the_budget_keeps_anyway_run_whole() -> None:
    """Three blocks saving 100 bytes each, a budget of 250: the two newest run
    unchecked (the engine keeps what they save), the oldest is checkpointed."""
    decider = _plan(3.0, 2.5, blocks=3, budget=250, saved=100, dispatch_s=0.5, **_SLOW_LINK)
    modes = [decider.mode("Block", b) for b in range(3)]
    assert modes[0] != WHOLE and modes[1:] == [WHOLE, WHOLE]
    plan = decider.plan()
    assert plan.measured["blocks_whole"] == 2 and "2 whole" in str(plan)


@pytest.mark.parametrize(
    ("budget", "aborted", "whole"),
    [(250, None, [PLAIN, PLAIN, WHOLE]), (450, 1, [PLAIN, WHOLE, WHOLE])],
)
def test_a_block_called_twice_a_step_counts_both_calls_against_the_budget(
    monkeypatch: pytest.MonkeyPatch, budget: int, aborted: int | None, whole: list[str]
) -> None:
    """Shared weights: each of three blocks runs twice a step and saves 100 bytes a call,
    so only the newest blocks that fit the budget at 200 bytes each run whole. A call
    whose forward raised (an out-of-memory retry) counts nothing: a profiling step with
    such a call after one without runs again (NOTE [abandoned forwards]), here the first
    whole step and the first of the three whole steps after the recompute-all ones."""
    monkeypatch.setattr(recompute, "OFFLOAD_ALONE", False)
    fake = _Fake()
    decider = AutoDecider(fake.snapshot, budget, clock=fake.clock)
    again = 0 if aborted is None else 2
    for _ in range(len(PROFILE) + 1 + again):
        for b in range(3):
            if b == aborted and decider.mode("Block", b) == WHOLE:
                decider.entered("Block", b)  # its forward raises: no exited
                fake.add(device_tier_bytes=70)
                fake.add(device_tier_bytes=-70)  # freed with the failed call
            for _call in range(2):
                mode = decider.mode("Block", b)
                decider.entered("Block", b)
                if mode == WHOLE:
                    fake.add(device_tier_bytes=100)
                fake.now += 0.5
                decider.exited("Block", b)
        for b in reversed(range(3)):
            for _call in range(2):  # (backward reaches each call's output)
                decider.backward("Block", b)
            fake.now += 1.0
        fake.add(device_tier_bytes=-fake.stats.device_tier_bytes)  # backward freed them
    assert not decider.profiling
    kept = whole.count(WHOLE)
    assert decider.plan().measured["blocks_whole"] == kept
    assert decider.plan().measured["whole_MiB"] * 2**20 == 200 * kept
    assert [decider.mode("Block", b) for b in range(3)] == whole


@pytest.mark.parametrize(
    ("before", "after", "inputs", "kept"),
    [(0, 0, 0, 3), (60, 0, 0, 2), (0, 60, 0, 2), (20, 20, 20, 2), (50, 50, 50, 1)],
)
def test_whole_blocks_leave_the_budget_room_for_what_is_saved_outside_them(
    monkeypatch: pytest.MonkeyPatch, before: int, after: int, inputs: int, kept: int
) -> None:
    """Four blocks saving 100 bytes each whole, a budget of 350. Beside the whole blocks
    the budget keeps what the model saves before the first block (``before``, live as
    it begins) and after the last (``after``, freed by backward before it reaches a
    block), and each checkpointed block's input (``inputs``): the newest blocks run
    whole only as far as all of it fits, so the plan moves nothing."""
    monkeypatch.setattr(recompute, "OFFLOAD_ALONE", False)
    fake = _Fake()
    decider = AutoDecider(fake.snapshot, 350, clock=fake.clock)
    for _ in range(len(PROFILE) + 1):
        fake.add(device_tier_bytes=before, bytes_packed=before)
        for b in range(4):
            nbytes = 100 if decider.mode("Block", b) == WHOLE else inputs
            decider.entered("Block", b)
            fake.add(device_tier_bytes=nbytes, bytes_packed=nbytes)
            fake.now += 0.5
            decider.exited("Block", b)
        fake.add(device_tier_bytes=after, bytes_packed=after)
        fake.add(device_tier_bytes=-after)  # the head's backward freed its records
        for b in reversed(range(4)):
            decider.backward("Block", b)
            fake.now += 1.0
        fake.add(device_tier_bytes=-fake.stats.device_tier_bytes)
    assert not decider.profiling
    modes = [decider.mode("Block", b) for b in range(4)]
    assert modes == [PLAIN] * (4 - kept) + [WHOLE] * kept
    m = decider.plan().measured
    assert m["blocks_whole"] == kept
    assert m["beside_whole_MiB"] * _MiB == before + after + inputs * (4 - kept)


def test_a_budget_that_keeps_every_block_whole_says_so_per_op() -> None:
    """No block checkpointed: no op is recomputed or stored by a checkpoint, and the
    plan's rows say so rather than a choice that does not act; a bandwidth nothing
    measured is left out of the text."""
    decider = _plan(3.0, 2.5, blocks=3, budget=1000, saved=100, dispatch_s=0.5)
    assert [decider.mode("Block", b) for b in range(3)] == [WHOLE] * 3
    plan = decider.plan()
    assert {d.choice for d in plan.ops} == {"whole"}
    assert plan.bytes_recomputed == plan.bytes_offloaded == 0
    # Each row has the bytes and time of every block (what the engine keeps or moves).
    assert all(d.bytes_per_step > 0 for d in plan.ops)
    assert max(d.seconds_per_step or 0.0 for d in plan.ops) > 0
    text = str(plan)
    assert "device_budget keeps what they save" in text and "inf" not in text


def test_profile_times_are_medians_over_blocks() -> None:
    """One block of four was slow in the offload-all step (another process had the
    cores): the median block leaves it out."""
    fake = _Fake()
    decider = AutoDecider(fake.snapshot, 0, clock=fake.clock)
    steps = [(3.0, None), (1.0, 2), (0.9, None), (0.95, None)]  # whole, offload-all, 2 x recompute
    steps += [(2.5, None), (2.0, 1), (2.1, 3)]  # whole x 3: the first after another kind
    steps += [(0.95, None), (0.95, None), (1.0, None)]  # recompute-all x 2, the plan
    for step_s, slow in steps:
        _step(decider, fake, _OPS, step_s=step_s / 4, forward_s=0.1, blocks=4, slow=slow)
    measured = decider.plan().measured
    assert measured["step_offload_all_s"] == pytest.approx(1.0)
    assert measured["step_recompute_all_s"] == pytest.approx(0.9)
    assert measured["step_whole_s"] == pytest.approx(2.0)


def test_of_the_two_compared_steps_each_the_faster_counts() -> None:
    """A whole step and a recompute-all step each ran slow once (another process had the
    cores), and the first whole step after a recompute-all one, not counted, slowest:
    the plan compares the faster counted step of each, and so still runs offload alone,
    which measured faster."""
    fake = _Fake()
    decider = AutoDecider(fake.snapshot, 0, clock=fake.clock)
    cheap = [(MM, GB // 2, 0.01), (GELU, GB // 2, 0.01), (VIEW, GB // 2, 0.0)]
    steps = [(3.0, {}), (3.0, _SLOW_LINK), (2.5, {}), (5.0, {}), (9.0, {}), (4.0, {}), (2.0, {})]
    steps += [(2.5, {}), (3.0, {}), (3.0, {})]
    for step_s, counters in steps:
        _step(decider, fake, cheap, step_s=step_s, forward_s=0.5, consumed=_NEEDED, **counters)
    measured = decider.plan().measured
    assert measured["step_recompute_all_s"] == pytest.approx(2.5)
    assert measured["step_whole_s"] == pytest.approx(2.0)
    assert measured["offload_alone"] == 1.0
    assert decider.mode("Block", 0) == WHOLE


@pytest.fixture
def no_interleave(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offload alone's own plan where it wins the profile, not the plan that interleaves
    whole blocks with plain ones, tried in its place (NOTE [interleaved blocks])."""
    monkeypatch.setattr(recompute, "INTERLEAVE", False)


@pytest.mark.usefixtures("no_interleave")
def test_offload_alone_runs_every_block_whole_where_it_measured_fastest() -> None:
    """Every op is cheap to recompute, so checkpointing is expected to take about what
    the recompute-all step took (2.5 s); the step with every block whole (the engine
    moving what the budget does not keep) took 2 s: no block is checkpointed, and the
    plan says why."""
    cheap = [(MM, GB // 2, 0.01), (GELU, GB // 2, 0.01), (VIEW, GB // 2, 0.0)]
    decider = _plan(3.0, 2.5, blocks=2, whole_s=2.0, ops=cheap, **_SLOW_LINK)
    assert [decider.mode("Block", b) for b in range(2)] == [WHOLE, WHOLE]
    assert decider.decisions == {}  # type: ignore[attr-defined]  # no dispatch mode ran
    plan = decider.plan()
    m = plan.measured
    assert m["offload_alone"] == 1.0 and m["blocks_whole"] == 2 and m["blocks_selective"] == 0
    assert m["step_whole_s"] == pytest.approx(2.0)
    assert m["step_checkpointed_s"] == pytest.approx(2.5, abs=0.05)
    assert plan.bytes_offloaded == plan.bytes_recomputed == 0
    assert "offload alone measured" in str(plan)
    # A whole step slower than checkpointing's expected one keeps the blocks checkpointed.
    decider = _plan(3.0, 2.5, blocks=2, whole_s=2.6, ops=cheap, **_SLOW_LINK)
    assert decider.mode("Block", 0) in (PLAIN, SELECTIVE)
    assert not decider.plan().measured["offload_alone"]


@pytest.mark.usefixtures("no_interleave")
def test_a_budget_no_plan_reaches_runs_the_leanest_plan_whatever_ran_faster() -> None:
    """NOTE [a budget no plan reaches]: each block saves 100 bytes and the budget is
    50. Offload alone measured fastest, and selective blocks would gain more than
    their dispatch costs (both plans at a budget of 0, the first lines); under the
    budget every block is checkpointed plainly, nothing is tried, and one warning says
    what is reachable."""
    cheap = [(MM, GB // 2, 0.01), (GELU, GB // 2, 0.01), (VIEW, GB // 2, 0.0)]
    assert _plan(3.0, 2.5, blocks=2, whole_s=2.0, ops=cheap, **_SLOW_LINK).mode("Block", 0) == WHOLE
    assert _plan(3.0, 2.5, **_SLOW_LINK).mode("Block", 0) == SELECTIVE
    for kw in ({"blocks": 2, "whole_s": 2.0, "ops": cheap}, {}):
        with pytest.warns(OffloadFallbackWarning, match="smallest reachable is about 100 bytes"):
            decider = _plan(3.0, 2.5, budget=50, saved=100, **kw, **_SLOW_LINK)  # type: ignore[arg-type]
        blocks = int(kw.get("blocks", 1))  # type: ignore[call-overload]
        assert [decider.mode("Block", b) for b in range(blocks)] == [PLAIN] * blocks
        plan = decider.plan()
        assert not plan.measured["offload_alone"] and plan.bytes_offloaded == 0
        assert "this is the plan that holds least" in str(plan)
        assert _planned_steps(decider, [9.0, 9.0, 9.0], blocks) == [PLAIN] * blocks


def test_offload_alone_or_plain_is_decided_by_whole_steps_not_block_medians() -> None:
    """Every block whole: two blocks of three took 0.5 s, one 5 s (its reads stalled),
    so the median block (0.5 s) beats a checkpointed one (1 s, less the dispatch modes'
    0.15 s), but the step (6 s) is slower than checkpointing's (3 s, less 3 x 0.15 s):
    every block is checkpointed plainly."""
    fake = _Fake()
    decider = AutoDecider(fake.snapshot, 0, clock=fake.clock)
    cheap = [(MM, GB // 2, 0.01), (GELU, GB // 2, 0.01), (VIEW, GB // 2, 0.0)]
    run = functools.partial(_step, decider, fake, cheap, forward_s=0.1, blocks=3)
    run(step_s=3.0)
    run(step_s=1.0, consumed=_NEEDED, **_SLOW_LINK)
    for kind in PROFILE[2:]:
        if kind == RECOMPUTE_ALL:
            run(step_s=1.0, dispatch_s=0.1)
        else:
            run(step_s=0.0, block_s=[0.5, 0.5, 5.0])
    assert [decider.mode("Block", b) for b in range(3)] == [PLAIN] * 3
    m = decider.plan().measured
    assert m["step_whole_s"] < m["step_checkpointed_s"]  # the medians' verdict
    assert m["wall_alone_s"] == pytest.approx(6.0)
    assert m["wall_plain_s"] == pytest.approx(3.0 - 3 * 0.15)
    assert not m["offload_alone"] and "trial_step_s" not in m


class _Peaks:
    """Scripted memory peaks (NOTE [plans within the noise]): the n-th take() reports the
    n-th step (the first step's start is not seen), by its kind; planned steps
    ``planned``."""

    def __init__(self, by_kind: dict[int, int], planned: int | list[int] = 0) -> None:
        self.by_kind, self.planned = by_kind, planned
        self.calls, self.running = 0, False

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False

    def take(self) -> int:
        step, self.calls = self.calls, self.calls + 1
        profile = PROFILE
        if step < len(profile):
            return self.by_kind[profile[step]]
        if isinstance(self.planned, list):  # (one per planned step)
            return self.planned[step - len(profile)]
        return self.planned


class _Holds(list[bool]):
    """The decider's holds of the heap trims, in order, and each one's ceiling."""

    def __init__(self, held: list[bool] | None = None) -> None:
        super().__init__()
        self.ceilings: list[int | None] = []
        self._held = held  # (where given, the engine's state: set by each hold)

    def __call__(self, on: bool, ceiling: int | None) -> None:
        self.append(on)
        self.ceilings.append(ceiling)
        if self._held is not None:
            self._held[0] = on


_LEAN_PLAIN = {WHOLE_ALL: 300 << 20, OFFLOAD_ALL: 250 << 20}
_LEAN_PLAIN |= {RECOMPUTE_ALL: 100 << 20, WHOLE_TIMED: 200 << 20}


@pytest.mark.usefixtures("no_interleave")
@pytest.mark.parametrize(
    ("whole_s", "peaks", "alone"),
    [
        (2.45, _LEAN_PLAIN, False),  # 2% faster, holding twice as much: plain
        (2.45, {**_LEAN_PLAIN, RECOMPUTE_ALL: 195 << 20}, True),  # 2.5% less
        (2.0, _LEAN_PLAIN, True),  # 20% faster: offload alone, whatever it holds
        (2.45, None, True),  # peaks unknown: the faster
        (2.45, {**_LEAN_PLAIN, RECOMPUTE_ALL: 0}, True),  # (a failed sample)
        (2.55, {**_LEAN_PLAIN, RECOMPUTE_ALL: 400 << 20}, True),  # 2% slower, leaner
    ],
)
def test_offload_alone_within_the_noise_of_plain_yields_to_the_leaner(
    whole_s: float, peaks: dict[int, int] | None, alone: bool
) -> None:
    """NOTE [plans within the noise]: plain checkpointing's steps took 2.5 s and held
    100 MiB at most, offload alone's ``whole_s`` and 200 MiB."""
    cheap = [(MM, GB // 2, 0.01), (GELU, GB // 2, 0.01), (VIEW, GB // 2, 0.0)]
    source = None if peaks is None else _Peaks(peaks)
    decider = _plan(3.0, 2.5, blocks=2, whole_s=whole_s, ops=cheap, peaks=source, **_SLOW_LINK)
    m = decider.plan().measured
    assert m["offload_alone"] == float(alone)
    assert m["wall_alone_s"] == pytest.approx(whole_s)
    text = str(decider.plan())
    if peaks is not None and peaks[RECOMPUTE_ALL] == 100 << 20:
        assert (m["peak_plain_MiB"], m["peak_alone_MiB"]) == (100, 200)
    if not alone:
        assert "weighed: plain checkpointing 2.500 s a step at 100 MiB, offload alone " in text
        assert "2.450 s at 200 MiB" in text
    if whole_s > 2.5:  # chosen for its memory: the plan says so
        assert "offload alone measured within 5% of plain checkpointing and held less" in text
    if peaks is not None and peaks[RECOMPUTE_ALL] == 195 << 20:  # not 5% less
        assert "at 200 MiB, plain checkpointing 2.500 s at 195 MiB" in text
    if source is not None:
        assert not source.running  # a plan the profile ran: nothing tried, sampling ends


@pytest.mark.parametrize(("trial_mib", "kept"), [(50, True), (150, False)])
def test_a_trial_within_the_noise_of_a_leaner_plan_yields_to_it(trial_mib: int, kept: bool) -> None:
    """The mixed plan's trial steps took 2.4 s, plain checkpointing 2.455 s in the
    profile (2% slower) at 100 MiB: the trial stays only if it held less."""
    source = _Peaks(_LEAN_PLAIN, planned=trial_mib << 20)
    decider = _plan(
        3.0, 2.5, blocks=3, budget=250, saved=100, dispatch_s=0.01, peaks=source,
        **_SLOW_LINK,
    )  # fmt: skip
    first = [decider.mode("Block", b) for b in range(3)]
    assert source.running  # the trial is measured too
    modes = _planned_steps(decider, [3.0, 2.4], 3)
    assert modes == (first if kept else [PLAIN] * 3)
    m = decider.plan().measured
    assert m["trial_choice"] == (0 if kept else 1) and m["trial_peak_MiB"] == trial_mib
    text = str(decider.plan())
    assert f"2.400 s a step at {trial_mib} MiB" in text
    if not kept:  # slower, not faster: the plan says so
        assert "plain checkpointing of every block ran within 5% of this plan's trial" in text
    assert not source.running


def test_a_fast_link_offloads_everything_the_recompute_needs() -> None:
    # Storing was free: the recompute-all step was slower by exactly its recompute.
    decider = _plan(
        2.0,
        2.0 + _RECOMPUTED_S,
        bytes_offloaded=1.25 * GB,
        bytes_read=1.25 * GB,
        read_seconds=0.1,
    )
    decisions = decider.decisions  # type: ignore[attr-defined]
    assert decisions[GELU] is P.PREFER_CPU_OFFLOAD
    assert decisions[MM] is P.PREFER_CPU_OFFLOAD
    assert decisions[ADD] is P.PREFER_RECOMPUTE  # never needed: free either way


def test_stalls_the_bandwidth_would_hide_still_count_in_proportion_to_the_bytes() -> None:
    """Reads at 12.5 GB/s would hide in backward's compute, but the offload-all step
    stalled 1 s on them all the same (and that was all moving cost it): each op's share
    of that second counts against offloading it, so the cheap gelu is recomputed, and
    the matmul, a second of compute for 0.4 s of stall, is still offloaded."""
    decider = _plan(
        2.5,
        2.51,
        bytes_offloaded=1.25 * GB,
        bytes_read=1.25 * GB,
        read_seconds=0.1,
        stall_seconds=1.0,
    )
    decisions = decider.decisions  # type: ignore[attr-defined]
    assert decider.plan().measured["move_s_per_GB"] == pytest.approx(0.0, abs=1e-6)
    assert decisions[GELU] is P.PREFER_RECOMPUTE
    assert decisions[MM] is P.PREFER_CPU_OFFLOAD
    reasons = {d.op: d.move_seconds_per_step for d in decider.plan().ops}
    assert reasons["aten.mm.default"] == pytest.approx(0.4, rel=0.01)


def test_moving_that_costs_the_step_time_without_any_stall_is_counted() -> None:
    """No stall was seen, but the step that stored everything was slower than the one
    that recomputed everything by more than the recompute: the difference is the move's
    (IO threads sharing the cores, page faults), and the cheap ops are recomputed."""
    decider = _plan(4.0, 2.5, bytes_offloaded=1.25 * GB, bytes_read=1.25 * GB, read_seconds=0.1)
    choices = {d.op: d.choice for d in decider.plan().ops}
    assert choices["aten.gelu.default"] == "recompute"
    assert decider.plan().measured["move_s_per_GB"] == pytest.approx(2.51 / 1.25)


def test_the_plan_says_what_and_why() -> None:
    decider = _plan(3.0, 2.5, bytes_offloaded=GB, pack_wait_seconds=1.0)
    text = str(decider.plan())
    assert "aten.gelu.default" in text and "recompute is cheaper than moving" in text
    assert "aliases another tensor" in text and "never needed by the recompute" in text
    assert decider.plan().measured["moved_MiB"] > 900


def _profile_rest(run: Any, whole_s: list[float], whole_moved: int = 0) -> None:
    """The profile's steps after the offload-all one: every output recomputed in 1.5 s,
    every block whole in ``whole_s``, moving ``whole_moved`` bytes."""
    for kind in PROFILE[2:]:
        if kind == RECOMPUTE_ALL:
            run(step_s=1.5)  # every output recomputed
        else:  # every block whole again
            run(step_s=0.0, block_s=whole_s, bytes_offloaded=whole_moved)


@pytest.mark.usefixtures("no_interleave")
def test_the_estimates_are_over_the_blocks_the_budget_does_not_keep() -> None:
    """Four blocks; the budget keeps the two newest whole. With every block whole, the
    two kept ones took 0.5 s and the two moved ones 2 s (they waited on reads); a
    checkpointed block takes 1.5 s. The printed estimates take the median over the
    blocks each concerns (over every block the whole one, 1.25 s, would look faster
    than checkpointing); the mixed plan is tried (NOTE [trial steps])."""
    fake = _Fake()
    decider = AutoDecider(fake.snapshot, 250, clock=fake.clock)
    cheap = [(MM, GB // 2, 0.01), (GELU, GB // 2, 0.01), (VIEW, GB // 2, 0.0)]
    run = functools.partial(_step, decider, fake, cheap, forward_s=0.1, blocks=4, saved=100)
    whole_s = [2.0, 2.0, 0.5, 0.5]
    run(step_s=3.0)  # every block whole: 100 bytes each
    run(step_s=1.5, consumed=_NEEDED, **_SLOW_LINK)
    _profile_rest(run, whole_s)
    modes = [decider.mode("Block", b) for b in range(4)]
    assert WHOLE not in modes[:2] and modes[2:] == [WHOLE, WHOLE]  # checkpointed, kept
    m = decider.plan().measured
    assert m["offload_alone"] == 0.0 and m["blocks_whole"] == 2
    assert m["step_whole_s"] == pytest.approx(2 * 0.5 + 2 * 2.0)
    assert m["step_checkpointed_s"] == pytest.approx(2 * 0.5 + 2 * 1.5, abs=0.1)


def _planned_steps(decider: AutoDecider, walls: list[float], blocks: int) -> list[str]:
    """Planned steps of the given walls (each block's share), then the modes of the
    next step's blocks."""
    for wall in walls:
        _step(decider, decider.fake, _OPS, step_s=wall / blocks, blocks=blocks)  # type: ignore[attr-defined]
    return [decider.mode("Block", b) for b in range(blocks)]


def test_a_mixed_plan_slower_in_its_trial_than_plain_checkpointing_yields_to_it() -> None:
    """NOTE [trial steps]: the budget keeps two of three blocks whole, the oldest is
    checkpointed. Its planned steps after the first took 3 s; the profile's step with
    every block recomputed took 2.5 s, less the dispatch modes' 0.015 s a block: every
    block is checkpointed plainly from then on, and the plan says why."""
    decider = _plan(3.0, 2.5, blocks=3, budget=250, saved=100, dispatch_s=0.01, **_SLOW_LINK)
    first = [decider.mode("Block", b) for b in range(3)]
    assert first[0] != WHOLE and first[1:] == [WHOLE, WHOLE]
    assert _planned_steps(decider, [3.0], 3) == first  # one timed step: not yet judged
    assert _planned_steps(decider, [3.1], 3) == [PLAIN] * 3
    plan = decider.plan()
    m = plan.measured
    assert m["trial_step_s"] == pytest.approx(3.0) and m["trial_choice"] == 1
    assert m["trial_plain_s"] == pytest.approx(2.5 - 3 * 0.015)
    assert m["trial_alone_s"] == pytest.approx(10.0)
    assert m["blocks_whole"] == 0 and m["blocks_plain"] == 3 and plan.plans_made == 1
    assert plan.bytes_offloaded == 0 and plan.bytes_recomputed > 0
    assert "replaced by plain checkpointing" in str(plan)
    assert _planned_steps(decider, [9.0, 9.0, 9.0], 3) == [PLAIN] * 3  # judged once


@pytest.mark.parametrize("trial_s", [3.1, 2.0])
def test_a_trial_that_replaces_its_plan_asks_for_a_trim_as_it_does(trial_s: float) -> None:
    """NOTE [a trim where the plan changes]: the profiling steps' trims come with the
    engine's trim_basis (the test below); the trial asks for one more only where it
    replaces the plan, as the plan that runs from then on begins."""
    trims: list[int] = []
    decider = _plan(
        3.0, 2.5, blocks=3, budget=250, saved=100, dispatch_s=0.01,
        trim_heap=lambda: trims.append(1), **_SLOW_LINK,
    )  # fmt: skip
    first = [decider.mode("Block", b) for b in range(3)]
    assert _planned_steps(decider, [3.0], 3) == first and trims == []
    assert _planned_steps(decider, [trial_s], 3) == (first if trial_s < 2.5 else [PLAIN] * 3)
    assert len(trims) == (1 if trial_s > 2.5 else 0)
    _planned_steps(decider, [9.0, 9.0], 3)
    assert len(trims) == (1 if trial_s > 2.5 else 0)


def test_a_tried_plan_that_ran_fastest_is_kept_judged_on_its_faster_step() -> None:
    """The first planned step (3 s: it learns the prefetch order) is not counted; of the
    next two, the faster (2 s) beats the profiled 2.455 s."""
    decider = _plan(3.0, 2.5, blocks=3, budget=250, saved=100, dispatch_s=0.01, **_SLOW_LINK)
    first = [decider.mode("Block", b) for b in range(3)]
    assert _planned_steps(decider, [4.0, 2.0], 3) == first
    m = decider.plan().measured
    assert m["trial_choice"] == 0 and m["trial_step_s"] == pytest.approx(2.0)
    assert "kept" in str(decider.plan())


def test_a_tried_plan_slower_than_offload_alone_yields_to_it() -> None:
    """Four blocks, the two newest kept whole; checkpointed blocks measured 1.5 s and
    moved whole ones 2 s, so the plan checkpoints the two oldest. In its trial it took
    6 s a step; with every block whole the profile took 5 s: offload alone."""
    fake = _Fake()
    decider = AutoDecider(fake.snapshot, 250, clock=fake.clock)
    cheap = [(MM, GB // 2, 0.01), (GELU, GB // 2, 0.01), (VIEW, GB // 2, 0.0)]
    run = functools.partial(_step, decider, fake, cheap, forward_s=0.1, blocks=4, saved=100)
    run(step_s=3.0)
    run(step_s=1.5, consumed=_NEEDED, **_SLOW_LINK)
    _profile_rest(run, [2.0, 2.0, 0.5, 0.5])
    for _ in range(3):
        assert [decider.mode("Block", b) for b in range(4)][2:] == [WHOLE, WHOLE]
        run(step_s=1.5)
    assert [decider.mode("Block", b) for b in range(4)] == [WHOLE] * 4
    plan = decider.plan()
    assert plan.measured["trial_choice"] == 2 and plan.measured["blocks_whole"] == 4
    assert plan.measured["trial_alone_s"] == pytest.approx(5.0)
    assert "replaced by offload alone" in str(plan)
    assert {d.choice for d in plan.ops} == {"whole"}
    assert "offload alone ran faster than this plan's trial" in str(plan)


def _alone_won(blocks: int, budget: int, trial_peak: int = 0) -> tuple[AutoDecider, Any]:
    """The profile with ``blocks`` blocks saving 100 bytes each: every block whole took
    1 s a block at 400 MiB moving 1000 bytes, every block checkpointed 1.5 s at 500 MiB
    moving none, and selective blocks would gain nothing (no op took time to compute):
    offload alone beat plain checkpointing. Planned steps hold ``trial_peak`` MiB. The
    decider, and a function that runs one step of the given seconds a block."""
    fake = _Fake()
    by_kind = {WHOLE_ALL: 300, OFFLOAD_ALL: 300}
    by_kind |= {RECOMPUTE_ALL: 500, WHOLE_TIMED: 400}
    source = _Peaks({k: v << 20 for k, v in by_kind.items()}, trial_peak << 20)
    decider = AutoDecider(fake.snapshot, budget, clock=fake.clock, peaks=source)
    free = [(func, nbytes, 0.0) for func, nbytes, _ in _CHEAP]
    run = functools.partial(_step, decider, fake, free, forward_s=0.1, blocks=blocks, saved=100)
    run(step_s=3.0)
    run(step_s=1.5, consumed=_NEEDED, **_SLOW_LINK)
    _profile_rest(run, [1.0] * blocks, whole_moved=1000)
    return decider, run


@pytest.mark.parametrize(
    ("trial_s", "trial_peak", "trial_moved", "choice"),
    [
        (0.9, 500, 1000, 0),
        (1.02, 300, 1000, 0),
        (1.02, 390, 1000, 2),
        (1.1, 300, 1000, 2),
        (1.02, 390, 500, 0),
        (1.02, 400, 750, 0),
        (1.02, 390, 800, 2),
        (1.02, 420, 500, 0),
        (1.02, 421, 500, 2),
        (1.06, 390, 500, 2),
    ],
)
def test_where_offload_alone_won_every_other_block_it_would_move_is_tried_plain(
    trial_s: float, trial_peak: int, trial_moved: int, choice: int
) -> None:
    """NOTE [interleaved blocks]: six blocks, the budget keeps the two newest whole; of
    the other four, the oldest and the third run plain and the second and fourth whole.
    The plan is tried against the profile's (NOTE [trial steps]): kept where its steps
    ran faster than offload alone's 6 s, or within 5% of them holding at least 5% less
    than its 400 MiB, or within 5% of them holding at most 5% more and moving at least
    25% fewer than its 1000 bytes (NOTE [plans within the noise]); else offload alone
    runs."""
    decider, run = _alone_won(6, 250, trial_peak)
    interleaved = [PLAIN, WHOLE, PLAIN, WHOLE, WHOLE, WHOLE]
    assert [decider.mode("Block", b) for b in range(6)] == interleaved
    plan = decider.plan()
    m = plan.measured
    assert m["blocks_interleaved"] == 2 and m["blocks_whole"] == 4 and m["blocks_plain"] == 2
    assert m["offload_alone"] == 0 and m["whole_MiB"] == pytest.approx(200 / 2**20)
    assert "4 whole (2 within device_budget, 2 between the plain ones" in str(plan)
    assert "every other block the budget does not keep checkpointed plainly" in str(plan)
    op_bytes = 6 * sum(nbytes for _, nbytes, _ in _CHEAP)  # every block's, a step
    assert plan.bytes_recomputed == pytest.approx(op_bytes * 2 / 6, rel=1e-6)  # two plain
    assert plan.bytes_offloaded == 0 and decider._active.moves()
    for _ in range(recompute_weighing.TRIAL_STEPS + 1):
        assert [decider.mode("Block", b) for b in range(6)] == interleaved
        run(step_s=trial_s, bytes_offloaded=trial_moved)
    modes = [decider.mode("Block", b) for b in range(6)]  # (the last trial step ends)
    m = decider.plan().measured
    assert m["trial_choice"] == choice and m["trial_alone_s"] == pytest.approx(6.0)
    assert m["trial_moved_MiB"] * 2**20 == pytest.approx(trial_moved)
    assert m["moved_alone_MiB"] * 2**20 == pytest.approx(1000) and m["moved_plain_MiB"] == 0
    mib = f"moving {trial_moved / 2**20:.0f} MiB; in the profile"
    assert mib in str(decider.plan())
    if choice:  # every block whole from then on, and the plan says why
        assert modes == [WHOLE] * 6
        assert m["blocks_interleaved"] == 0 and m["offload_alone"] == 1.0
        assert "replaced by offload alone" in str(decider.plan())
        assert "offload alone ran faster than this plan's trial" in str(decider.plan())
    else:
        assert modes == interleaved
        assert m["trial_step_s"] == pytest.approx(6 * trial_s) and decider._active.moves()


def test_where_offload_alone_won_with_one_block_to_move_none_is_interleaved() -> None:
    """NOTE [interleaved blocks]: two blocks and no budget interleave. One block alone
    runs whole, untried; two with the newest kept whole leave one to move, which runs
    plain as before (a plan the profile did not run: tried)."""
    decider, _ = _alone_won(2, 0)
    assert [decider.mode("Block", b) for b in range(2)] == [PLAIN, WHOLE]
    assert decider.plan().measured["blocks_interleaved"] == 1
    decider, _ = _alone_won(1, 0)
    assert decider.mode("Block", 0) == WHOLE
    m = decider.plan().measured
    assert m["offload_alone"] == 1.0 and m["blocks_interleaved"] == 0
    assert decider._weighing.trial_left == 0  # nothing to try
    decider, _ = _alone_won(2, 100)
    assert [decider.mode("Block", b) for b in range(2)] == [PLAIN, WHOLE]
    m = decider.plan().measured
    assert m["blocks_interleaved"] == 0 and decider._weighing.trial_left > 0


def test_without_trials_or_for_a_profiled_plan_nothing_is_tried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TRIAL off (tests that follow a plan step by step), or a plan the profile ran as
    a whole (every block checkpointed plainly): slow planned steps change nothing."""
    monkeypatch.setattr(recompute, "TRIAL", False)
    decider = _plan(3.0, 2.5, blocks=3, budget=250, saved=100, dispatch_s=0.01, **_SLOW_LINK)
    first = [decider.mode("Block", b) for b in range(3)]
    assert _planned_steps(decider, [9.0, 9.0, 9.0], 3) == first
    monkeypatch.setattr(recompute, "TRIAL", True)
    decider = _plan(3.0, 2.5, dispatch_s=0.5, **_SLOW_LINK)  # plain: no trial
    assert _planned_steps(decider, [9.0, 9.0, 9.0], 1) == [PLAIN]
    assert "trial_step_s" not in decider.plan().measured


def test_an_unplanned_block_or_op_profiles_again_once() -> None:
    decider = _plan(3.0, 2.5, **_SLOW_LINK)
    assert decider.mode("Block", 0) == SELECTIVE
    sigmoid = torch.ops.aten.sigmoid.default
    key = ("Block", 0, sigmoid, 0)
    assert decider.decide(key, sigmoid, (), {}, _out(8)) is P.PREFER_CPU_OFFLOAD
    decider.backward("Block", 0)
    assert decider.mode("Block", 0) == WHOLE and decider.profiling  # the profile again
    decider = _plan(3.0, 2.5, **_SLOW_LINK)
    fake = _Fake()
    decider._clock, decider._stats = fake.clock, fake.snapshot  # type: ignore[method-assign]
    assert decider.mode("Block", 7) == PLAIN and decider._stale  # not profiled
    decider.backward("Block", 7)
    assert decider.mode("Block", 0) == WHOLE and decider.profiling  # the profile again


# -- ranks agreeing (NOTE [ranks agree] in agreement.py) --------------------------------------


def test_ranks_that_measured_differently_run_rank_0_s_plan_and_trial_verdict() -> None:
    """Alone, rank 0 plans selective blocks (and tries them, and keeps them: its trial
    ran 2 s against plain checkpointing's 2.455 s) while rank 1, whose dispatch modes
    measured 50 times dearer, plans plain checkpointing; agreeing, rank 1 runs rank 0's
    plan, its reasons and figures, and keeps it though its own trial ran 9 s."""
    alone = _plan(3.0, 2.5, dispatch_s=0.5, **_SLOW_LINK)
    assert alone.mode("Block", 0) == PLAIN

    def rank(agreement: Any) -> tuple[Any, ...]:
        dispatch_s = 0.01 if agreement.rank == 0 else 0.5
        d = _plan(3.0, 2.5, dispatch_s=dispatch_s, agreement=agreement, **_SLOW_LINK)
        planned = (d.mode("Block", 0), dict(d.decisions))  # type: ignore[attr-defined]
        for wall in (2.0, 2.5) if agreement.rank == 0 else (9.0, 9.5):  # the trial's
            _step(d, d.fake, _OPS, step_s=wall)  # type: ignore[attr-defined]
        return (*planned, d.mode("Block", 0), d.plan().measured)

    (mode0, dec0, after0, m0), (mode1, dec1, after1, m1) = on_ranks(2, rank)
    assert mode0 == mode1 == SELECTIVE and dec0 == dec1
    assert after0 == after1 == SELECTIVE  # kept, as rank 0 judged
    assert m0["trial_choice"] == m1["trial_choice"] == 0
    assert m1["trial_step_s"] == pytest.approx(2.0) and m1["ranks_agreeing"] == 2.0
    assert m0["dispatch_s_per_block"] == m1["dispatch_s_per_block"] == pytest.approx(0.015)


def test_a_new_structure_one_rank_saw_profiles_every_rank_again_at_the_check() -> None:
    """Rank 1 meets a block the profile did not see in the second planned step; alone
    it would profile again at the next step. Agreeing, both ranks run the plan until
    the check, every AGREE_EVERY planned steps, then both profile again."""

    def rank(agreement: Any) -> list[bool]:
        d = _plan(3.0, 2.5, dispatch_s=0.5, agreement=agreement, **_SLOW_LINK)
        profiling = []
        for step in range(1, AGREE_EVERY + 1):
            _step(d, d.fake, _OPS, step_s=3.0)  # type: ignore[attr-defined]
            profiling.append(d.profiling)
            if step == 2 and agreement.rank == 1:
                assert d.mode("Block", 7) == PLAIN  # (unplanned: plainly, as alone)
        return profiling

    expected = [False] * (AGREE_EVERY - 1) + [True]
    assert on_ranks(2, rank) == [expected, expected]


def test_a_forward_one_rank_abandoned_in_the_profile_runs_the_step_again_on_every_rank() -> None:
    """NOTE [abandoned forwards]: rank 1's forward raises in the fourth profiling step
    (an out-of-memory retry); agreeing, both ranks run that step again and plan at the
    same step, so every later exchange (a check, a trial verdict) meets."""

    def rank(agreement: Any) -> list[bool]:
        fake = _Fake()
        d = AutoDecider(fake.snapshot, 0, clock=fake.clock, agreement=agreement)
        profiling = []
        for step in range(len(PROFILE) + 3):
            if step == 3 and agreement.rank == 1:
                d.mode("Block", 0)
                d.entered("Block", 0)  # its forward raised: no exited, no backward
            counters = _SLOW_LINK if step == 1 else {}
            _step(d, fake, _OPS, step_s=1.0, forward_s=0.1, blocks=2, **counters)
            profiling.append(d.profiling)
        return profiling

    expected = [True] * (len(PROFILE) + 1) + [False] * 2
    assert on_ranks(2, rank) == [expected, expected]


def test_a_rank_whose_blocks_differ_from_rank_0_s_is_told_what_to_pass() -> None:
    def rank(agreement: Any) -> Any:
        return _plan(3.0, 2.5, blocks=3 - agreement.rank, agreement=agreement, **_SLOW_LINK)

    first, second = on_ranks(2, rank)
    assert isinstance(first, AutoDecider)
    assert isinstance(second, OffloadError) and 'recompute_ranks="own"' in str(second)
    assert "its blocks" in str(second)


@pytest.mark.parametrize("abandoned", [1, 6])
def test_a_profiling_step_run_again_keeps_its_own_trim_class(abandoned: int) -> None:
    """NOTE [abandoned forwards], NOTE [profiling under trims]: the engine asks the trim
    bound at a step's first pack, before its first block; after the offload-all step or
    the last whole step with a forward abandoned, the step that runs again is of the
    same kind: the bound of its own class, and no trim asked for a change of plan."""
    trims: list[int] = []
    decider = AutoDecider(lambda: OffloadStats(), 0, trim_heap=lambda: trims.append(1))
    moved = {"whole": 100, "stored": 300, "checkpointed": 10}
    last: dict[str, int] = {}
    before = None
    for step in range(len(PROFILE) + 1):
        asked = len(trims)
        basis = decider.trim_basis(moved[before]) if before else None  # the first pack
        decider.mode("Block", 0)  # its first block: the step's own kind now
        kind = recompute._TRIM_CLASS[decider._phase]
        if before:
            last[before] = moved[before]
            assert basis == last.get(kind, 0 if kind == "checkpointed" else moved[before])
            assert (len(trims) > asked) == (kind != before), (step, kind, before)
        if step == abandoned:  # a forward that raised, then the step's own
            decider.entered("Block", 0)
        decider.entered("Block", 0)
        decider.exited("Block", 0)
        decider.backward("Block", 0)
        before = kind
    assert decider.profiling  # (one step run again: the profile is one step longer)


def test_a_step_s_peak_ends_with_its_backward() -> None:
    """NOTE [plans within the noise]: what the loop holds between a backward's end and
    the next step's first block (an optimizer's state, an evaluation) is not the step's;
    without a backward end seen, the step's peak runs to the next step."""
    gauge = [0]
    source = PeakSampler(lambda: gauge[0], interval=3600.0)  # samples by hand below
    fake = _Fake()
    decider = AutoDecider(fake.snapshot, 0, clock=fake.clock, peaks=source)
    run = functools.partial(_step, decider, fake, _OPS, step_s=1.0, blocks=2)
    MB = 1 << 20
    for in_step, at_end, between in [(100, 90, 500), (200, 150, 700), (300, 250, 0)]:
        gauge[0] = in_step * MB
        source.sample()  # (what the thread does every 2 ms)
        run()
        gauge[0] = at_end * MB
        decider._backward_ended()  # autograd's final callback
        gauge[0] = between * MB
        source.sample()
    decider.mode("Block", 0)  # the fourth step begins: the third has ended
    assert [decider._profile.peaks[i] // MB for i in range(3)] == [100, 200, 300]
    gauge[0] = 50 * MB
    source.sample()
    run()  # no backward end seen: to the next step's start
    gauge[0] = 40 * MB
    decider.mode("Block", 0)
    assert decider._profile.peaks[3] // MB == 50
    decider.close()
    assert not source.running


def test_memory_is_sampled_while_a_plan_is_measured_and_not_after_close() -> None:
    """NOTE [plans within the noise]: from the first step's end through the trial, again
    for a new profile, and never once the decider is closed."""
    source = _Peaks(_LEAN_PLAIN)
    decider = _plan(3.0, 2.5, peaks=source, **_SLOW_LINK)
    assert decider.mode("Block", 0) == SELECTIVE and source.running  # on trial
    _planned_steps(decider, [3.0, 3.0, 3.0], 1)
    assert not decider._weighing.trial_left and not source.running  # judged
    assert decider.mode("Block", 7) == PLAIN and decider._stale  # a block not profiled
    decider.backward("Block", 7)
    assert decider.mode("Block", 0) == WHOLE and decider.profiling and source.running
    decider.close()
    assert not source.running
    decider.backward("Block", 0)
    decider.mode("Block", 0)  # the next profiling step
    assert decider.profiling and not source.running  # closed: not started again


_MiB = 1 << 20
# What one block's recompute holds in _OPS (the profile's op outputs: no block whole).
_OPS_HOLD = sum(nbytes for _, nbytes, _ in _OPS)


@pytest.mark.parametrize(
    ("budget", "alone", "saved", "trimmed", "untrimmed", "held"),
    [
        (0, 200, 400, 400, [410, 420], True),  # bought 20 MiB: 5% of the 400 MiB saved
        (0, 200, 400, 400, [410, 421], False),  # bought 21 MiB
        (0, 200, 0, 400, [410, 420], False),  # bought 20 MiB, nothing saved
        (0, 1000, 400, 400, [900, 1020], True),  # offload alone held 1000 MiB, +5%
        (0, 1000, 400, 400, [900, 1021], False),
        (0, 0, 400, 400, [410, 420], True),  # offload alone's unknown: the trimmed step's
        (_OPS_HOLD + 1000 * _MiB, 200, 0, 400, [900, 1200], False),  # the budget unused
        (0, 200, 400, 400, [450, 0], False),  # a failed sample: trims stay
    ],
)
def test_a_plan_that_moves_nothing_holds_trims_off_where_it_holds_no_more_than_allowed(
    budget: int, alone: int, saved: int, trimmed: int, untrimmed: list[int], held: bool
) -> None:
    """NOTE [trims a plan does without]: every block checkpointed plainly (selective
    would save less than its dispatch costs); one planned step under trims, two without,
    then trims held off for good where the untrimmed ones' most is at most the larger
    of the trimmed step's and offload alone's in the profile (``alone`` MiB), plus 5%
    of the bytes the blocks saved (``saved`` MiB) in the profile's whole step; the
    budget the plan leaves unused does not count (the trims' allowance already let the
    trimmed step's heap fill it); else trims run again, with one trim at once. Held
    off, a trim comes above the most that verdict allows."""
    calls = _Holds()
    trims: list[int] = []
    peaks = {**_LEAN_PLAIN, WHOLE_TIMED: alone << 20}
    source = _Peaks(peaks, planned=[trimmed << 20, *(p << 20 for p in untrimmed)])
    decider = _plan(
        3.0, 2.5, budget=budget, saved=saved * _MiB, dispatch_s=0.5, peaks=source,
        hold_trims=calls, trim_heap=lambda: trims.append(1), **_SLOW_LINK,
    )  # fmt: skip
    assert decider.plan().measured["peak_alone_MiB"] == alone
    assert calls == [] and source.running  # the first planned step ran under trims
    assert _planned_steps(decider, [3.0], 1) == [PLAIN]
    assert calls == [True]  # it ended: two steps without
    _planned_steps(decider, [3.0], 1)
    assert calls == [True, held] and not source.running
    allowed = (max(trimmed, alone) << 20) + 0.05 * saved * _MiB
    ceiling = int(allowed)  # (one trim past it; trims run again past it twice)
    assert calls.ceilings == [None, ceiling if held else None]
    assert trims == ([] if held else [1])
    m = decider.plan().measured
    assert m["trims_held"] == float(held) and m["trims_peak_MiB"] == trimmed
    assert m["trims_allowed_MiB"] == pytest.approx(allowed / _MiB)
    assert m["step_saved_MiB"] == saved
    line = str(decider.plan()).split("heap trims:")[1].splitlines()[0]
    assert f"at most {allowed / _MiB:.0f} MiB allowed without" in line
    assert line.endswith(
        f"held off (one trim where the process passes {ceiling / _MiB:.0f} MiB; run again "
        f"where it passes it twice within {CEILING_STEPS} steps)"
        if held
        else "kept"
    )
    _planned_steps(decider, [3.0] * 5, 1)
    assert calls == [True, held]  # decided for good


def test_trims_that_run_again_past_their_ceiling_are_said_so() -> None:
    """NOTE [trims a plan does without]: trims held off for a plain plan run again once
    the process passes the ceiling (the engine's trimmer lets them): the plan says so
    at the next step, and nothing is weighed again."""
    calls = _Holds()
    held = [True]
    source = _Peaks(_LEAN_PLAIN, planned=[100 << 20] * 3 + [0])
    decider = _plan(
        3.0, 2.5, dispatch_s=0.5, peaks=source, hold_trims=calls,
        trims_held=lambda: held[0], **_SLOW_LINK,
    )  # fmt: skip
    _planned_steps(decider, [3.0, 3.0, 3.0], 1)
    assert calls == [True, True] and decider.plan().measured["trims_held"] == 1.0
    held[0] = False  # the process passed the ceiling
    _planned_steps(decider, [3.0], 1)
    m = decider.plan().measured
    assert m["trims_held"] == 0.0 and m["trims_released"] == 1.0
    ceiling = m["trims_ceiling_MiB"]
    said = f"run again as the process passed {ceiling:.0f} MiB twice within {CEILING_STEPS} steps"
    assert f"held off, then {said}" in str(decider.plan())
    _planned_steps(decider, [3.0] * 4, 1)
    assert calls == [True, True]


def test_a_new_profile_runs_under_trims_again() -> None:
    """Trims held off for a plan come back when a new structure profiles again."""
    calls = _Holds()
    source = _Peaks(_LEAN_PLAIN, planned=[400 << 20, 400 << 20, 400 << 20, 0])
    decider = _plan(3.0, 2.5, dispatch_s=0.5, peaks=source, hold_trims=calls, **_SLOW_LINK)
    _planned_steps(decider, [3.0, 3.0, 3.0], 1)
    assert calls == [True, True]
    assert decider.mode("Block", 7) == PLAIN and decider._stale  # a block not profiled
    decider.backward("Block", 7)
    assert decider.mode("Block", 0) == WHOLE and decider.profiling
    assert calls == [True, True, False]


_CHEAP = [(MM, GB // 2, 0.01), (GELU, GB // 2, 0.01), (VIEW, GB // 2, 0.0)]


@pytest.mark.parametrize("plan", ["selective", "alone"])
def test_a_plan_that_moves_bytes_keeps_its_trims_untried(
    plan: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offload alone or selective blocks move activations, which the trims give back:
    their heap is not weighed (NOTE [trims a plan does without]); where a block class
    draws from a generator of its own (never plain), no plain checkpointing is weighed
    against them either (NOTE [plain without trims]): they run on untried."""
    calls = _Holds()
    source = _Peaks(_LEAN_PLAIN, planned=100 << 20)
    kw: dict[str, Any] = (
        {"dispatch_s": 0.01} if plan == "selective" else {"whole_s": 2.0, "ops": _CHEAP}
    )
    real = AutoDecider._make_plan  # (an op draws from a generator of the block's own)
    monkeypatch.setattr(AutoDecider, "_make_plan", lambda d: d._own_rng.add("Block") or real(d))
    decider = _plan(3.0, 2.5, peaks=source, hold_trims=calls, **kw, **_SLOW_LINK)
    mode = SELECTIVE if plan == "selective" else WHOLE
    assert _planned_steps(decider, [2.0] * 6, 1) == [mode]  # (a trial kept: faster)
    assert calls == [] and not source.running
    assert "trims_held" not in decider.plan().measured


@pytest.mark.parametrize("still_draws", [False, True])
def test_a_new_profile_sees_again_which_block_classes_draw_from_their_own_generator(
    still_draws: bool,
) -> None:
    """NOTE [random ops] in checkpointing.py: a block class one of whose ops drew from a
    generator of the caller's own never runs plainly. A new structure profiles again
    (a second block appeared) and forgets it; the new profile's offload-all step sees
    the draw again where the class still makes it."""
    bernoulli = torch.ops.aten.bernoulli.p
    own = {"generator": torch.Generator()}
    with pytest.warns(OffloadFallbackWarning):  # (a budget no plan reaches: plain)
        decider = _plan(3.0, 2.5, budget=50, saved=100, **_SLOW_LINK)
    assert decider.mode("Block", 0) == PLAIN
    decider.decide(("Block", 0, bernoulli, 0), bernoulli, (), own, _out(400))
    assert decider.mode("Block", 0) == SELECTIVE  # its draws stored
    run = functools.partial(_step, decider, decider.fake, _OPS, forward_s=0.5, saved=100)
    run(step_s=1.5, blocks=2)  # a block the profile did not see: profile again
    for kind in PROFILE:
        run(step_s=1.5, blocks=2)
        if kind == OFFLOAD_ALL and still_draws:  # (the step's, as it ends)
            assert decider._phase == kind
            decider.decide(("Block", 0, bernoulli, 0), bernoulli, (), own, _out(400))
    assert decider.mode("Block", 0) == (SELECTIVE if still_draws else PLAIN)
    assert decider.plan().plans_made == 2


@pytest.mark.usefixtures("no_interleave")
@pytest.mark.parametrize(
    ("trimmed", "untrimmed", "walls", "plain", "alone_moved"),
    [
        (100, 100, [1.8, 1.9], True, 0),  # trims bought nothing, plain 10% faster
        (100, 100, [2.5, 2.4], False, 0),  # trims bought nothing, plain 20% slower
        (100, 300, [1.8, 1.9], False, 0),  # trims bought 200 MiB: it lost under them
        (100, 210, [1.8, 1.9], True, 0),  # trims bought 110 MiB, within alone's 200 + 20
        (190, 195, [2.08, 2.05], False, 0),  # 2.5% slower, 2.5% leaner
        (190, 195, [2.08, 2.05], True, 400),  # and moving nothing where alone moved
        (190, 210, [2.08, 2.05], True, 400),  # moving nothing, 5% more: within the noise
        (190, 211, [2.08, 2.05], False, 400),  # moving nothing, but over 5% more
        (100, 100, [2.08, 2.05], True, 0),  # 2.5% slower, half alone's memory: leaner
        (100, 100, [2.12, 2.11], False, 0),  # 5.5% slower, though half alone's memory
        (980, 1000, [1.99, 1.98], True, 0),  # 1% faster, held 5 times alone's: by time
        (980, 1001, [1.8, 1.9], False, 0),  # trims bought 21 MiB, over 5% of 400 saved
        (100, 0, [1.8, 1.9], False, 0),  # a failed sample: as it was weighed
    ],
)
def test_where_offload_alone_runs_plain_checkpointing_is_weighed_without_trims(
    trimmed: int, untrimmed: int, walls: list[float], plain: bool, alone_moved: int
) -> None:
    """NOTE [plain without trims]: the profile measured offload alone 2 s a step at 200
    MiB, plain checkpointing (under trims) 2.5 s. Plain checkpointing then runs four
    steps, the first uncounted, the second under trims (``trimmed`` MiB), two without
    (``untrimmed``, taking ``walls``); where those held no more than the larger of
    the step under trims and offload alone's 200 MiB, plus 5% of the 400 MiB saved,
    plain stays if it ran faster than offload alone, whatever it held, or within 5% of
    it holding 5% less, or at most 5% more and moving 25% fewer bytes (offload alone's whole
    steps moved ``alone_moved`` MiB, plain's nothing), its trims held off; else offload
    alone runs again under trims, with a trim at once."""
    calls = _Holds()
    trims: list[int] = []
    # (The first step, not counted, held 9999 MiB: counted, trims would look bought.)
    planned = [9999 << 20, trimmed << 20] + [untrimmed << 20] * 2 + [0]
    source = _Peaks(_LEAN_PLAIN, planned=planned)
    decider = _plan(
        3.0, 2.5, blocks=2, saved=200 * _MiB, whole_s=2.0, ops=_CHEAP, peaks=source,
        hold_trims=calls, trim_heap=lambda: trims.append(1), whole_moved=alone_moved * _MiB,
        **_SLOW_LINK,
    )  # fmt: skip
    assert decider.plan().measured["offload_alone"] == 1.0  # (the profile's choice)
    assert decider.plan().measured["moved_alone_MiB"] == alone_moved
    assert trims == [1] and calls == []  # plain began, under trims (its first uncounted)
    assert "\n  now: every block checkpointed plainly in the plan's place" in str(decider.plan())
    assert _planned_steps(decider, [3.0], 2) == [PLAIN, PLAIN] and calls == [True]  # trimmed
    assert _planned_steps(decider, [walls[0]], 2) == [PLAIN, PLAIN] and calls == [True]
    assert decider.timing() is False and decider._timing()  # timed, its ops not
    modes = _planned_steps(decider, [walls[1]], 2)
    assert modes == [PLAIN if plain else WHOLE] * 2 and not source.running
    assert calls == [True, plain]
    # (Offload alone held 200 MiB in the profile; 5% of the two blocks' 400 MiB.)
    allowed = (max(trimmed, 200) << 20) + 0.05 * (400 << 20)
    assert calls.ceilings[1] == (int(allowed) if plain else None)  # (its verdict's allowance)
    assert trims == ([1] if plain else [1, 1])
    plan = decider.plan()
    m = plan.measured
    assert m["untrimmed_choice"] == float(plain) and m["offload_alone"] == float(not plain)
    assert m["untrimmed_plain_s"] == pytest.approx(min(walls))
    assert m.get("trims_held") == (1.0 if plain else None)  # (alone's trims untried)
    assert m["blocks_plain"] == (2 if plain else 0)
    assert m["plain_trims_peak_MiB"] == trimmed and m["plain_untrimmed_peak_MiB"] == untrimmed
    assert m["plain_allowed_MiB"] == pytest.approx(allowed / _MiB)
    line = str(plan).split("without heap trims: ")[1].splitlines()[0]
    assert line.startswith(f"plain checkpointing ran {min(walls):.3f} s a step")
    assert f"at most {allowed / _MiB:.0f} MiB allowed without)" in line
    assert line.endswith("plain checkpointing runs" if plain else "the plan runs")
    assert "offload alone 2.000 s at 200 MiB" in line
    if plain:
        assert {d.choice for d in plan.ops} == {"recompute"} and plan.bytes_recomputed > 0
        why = "ran faster than" if min(walls) < 2.0 else "ran within 5% of"  # (and leaner)
        assert f"every block with heap trims held off {why} offload alone" in str(plan)
    else:
        assert {d.choice for d in plan.ops} == {"whole"} and plan.bytes_recomputed == 0
    assert _planned_steps(decider, [9.0] * 4, 2) == modes and len(calls) == 2
    assert "weighing_plain" not in m and "\n  now: " not in str(plan)


@pytest.mark.parametrize(
    ("walls", "plain"),
    [
        ([1.8, 1.9], True),  # 10% faster
        ([1.99, 2.5], True),  # 0.5% faster
        ([2.5, 2.4], False),  # 20% slower
        ([2.08, 2.05], False),  # 2.5% slower, a third leaner: time alone decides
    ],
)
def test_a_tried_plan_kept_is_weighed_against_plain_checkpointing_without_trims(
    walls: list[float], plain: bool
) -> None:
    """NOTE [plain without trims]: the budget keeps two of three blocks whole, and the
    trial kept that plan (2 s a step at 150 MiB, against 2.455 s for plain
    checkpointing under trims in the profile). Plain checkpointing then runs four
    steps, the last two without trims taking ``walls`` at 100 MiB: it stays where it ran
    faster; else the tried plan runs again, as it was, under trims. Neither moves a
    byte, so holding less within the noise does not count (it does against offload
    alone: test_where_offload_alone_runs_plain_checkpointing_is_weighed_without_trims)."""
    calls = _Holds()
    trims: list[int] = []
    planned = [150 << 20] * 3 + [100 << 20] * 4 + [0]
    source = _Peaks(_LEAN_PLAIN, planned=planned)
    decider = _plan(
        3.0, 2.5, blocks=3, budget=250, saved=100, dispatch_s=0.01, peaks=source,
        hold_trims=calls, trim_heap=lambda: trims.append(1), **_SLOW_LINK,
    )  # fmt: skip
    first = [decider.mode("Block", b) for b in range(3)]
    assert WHOLE in first and first != [WHOLE] * 3
    assert _planned_steps(decider, [4.0, 2.0], 3) == [PLAIN] * 3  # kept; plain weighed
    assert decider.plan().measured["trial_choice"] == 0 and trims == [1]
    modes = _planned_steps(decider, [3.0, 3.0, *walls], 3)  # (the first two under trims)
    assert modes == ([PLAIN] * 3 if plain else first) and calls == [True, plain]
    assert trims == ([1] if plain else [1, 1]) and not source.running
    plan = decider.plan()
    m = plan.measured
    assert m["untrimmed_choice"] == float(plain) and m["rival_s"] == pytest.approx(2.0)
    assert m["blocks_plain"] == (3 if plain else 0) and m["blocks_whole"] == (0 if plain else 2)
    line = str(plan).split("without heap trims: ")[1].splitlines()[0]
    assert "the plan's trial 2.000 s at 150 MiB" in line
    assert line.endswith("plain checkpointing runs" if plain else "the plan runs")
    if plain:
        assert "held off ran faster than this plan's trial" in str(plan)
    assert _planned_steps(decider, [9.0] * 4, 3) == modes and len(calls) == 2


def test_a_new_structure_while_plain_is_weighed_profiles_again_under_trims() -> None:
    """NOTE [plain without trims]: a block the profile did not see, in plain
    checkpointing's second step: the weighing ends, trims run again, a profile begins."""
    calls = _Holds()
    source = _Peaks(_LEAN_PLAIN, planned=100 << 20)
    decider = _plan(3.0, 2.5, whole_s=2.0, ops=_CHEAP, peaks=source, hold_trims=calls, **_SLOW_LINK)
    assert _planned_steps(decider, [1.8], 1) == [PLAIN] and calls == [True]
    assert decider.plan().measured["weighing_plain"] == 1.0
    assert decider.mode("Block", 7) == PLAIN and decider._stale
    decider.backward("Block", 7)
    assert decider.mode("Block", 0) == WHOLE and decider.profiling
    assert calls == [True, False] and not decider._weighing._challenging
    assert "weighing_plain" not in decider.plan().measured  # (the plan made last, as it was)


def test_a_context_closed_while_plain_is_weighed_leaves_the_plan_it_made() -> None:
    """NOTE [plain without trims]: the weighing ends unjudged at close; the printed plan
    is offload alone's, with no now: line."""
    source = _Peaks(_LEAN_PLAIN, planned=100 << 20)
    decider = _plan(3.0, 2.5, whole_s=2.0, ops=_CHEAP, peaks=source, hold_trims=_Holds(),
                    **_SLOW_LINK)  # fmt: skip
    assert "\n  now: " in str(decider.plan()) and decider.mode("Block", 0) == PLAIN
    decider.close()
    plan = decider.plan()
    assert "\n  now: " not in str(plan) and "weighing_plain" not in plan.measured
    assert plan.measured["offload_alone"] == 1.0 and decider.mode("Block", 0) == WHOLE
    assert not source.running


def test_ranks_weighing_plain_without_trims_run_rank_0_s_choice() -> None:
    """NOTE [plain without trims], NOTE [ranks agree]: rank 0's plain steps without
    trims ran 1.8 s and held what they held under trims; rank 1's ran 9 s and held 200
    MiB more (50 more than its own profile's offload alone), rank 2 samples no peaks
    (it would not weigh plain at all), and rank 3's sample of the step under trims
    failed. Every rank weighs plain, keeps it, and holds its trims off (with a ceiling
    where it knows the peak), as rank 0 judged."""

    def rank(agreement: Any) -> tuple[str, float, list[bool], list[Any]]:
        untrimmed = 100 if agreement.rank == 0 else 300
        trimmed = 0 if agreement.rank == 3 else 100
        planned = [100 << 20, trimmed << 20] + [untrimmed << 20] * 2
        # (Rank 1's own profile: offload alone held 250 MiB there, 200 on rank 0.)
        peaks = {**_LEAN_PLAIN, WHOLE_TIMED: 250 << 20} if agreement.rank == 1 else _LEAN_PLAIN
        source = None if agreement.rank == 2 else _Peaks(peaks, planned=planned)
        calls = _Holds()
        d = _plan(
            3.0, 2.5, whole_s=2.0, ops=_CHEAP, peaks=source, hold_trims=calls,
            agreement=agreement, **_SLOW_LINK,
        )  # fmt: skip
        wall = 1.8 if agreement.rank == 0 else 9.0
        steps = _planned_steps(d, [3.0, wall, wall], 1)
        return steps[0], d.plan().measured["untrimmed_choice"], calls, calls.ceilings

    got = on_ranks(4, rank)
    assert [g[:2] for g in got] == [(PLAIN, 1.0)] * 4 and all(g[2][-1] for g in got)
    # (The ceiling: what each rank's own verdict allows, offload alone's peak in its own
    # profile (no saved bytes), where it held no more without trims; else, held by rank
    # 0's word, or where the step under trims is unknown, 105% of what it held without.)
    ceilings = [200 << 20, int(1.05 * (300 << 20)), None, int(1.05 * (300 << 20))]
    assert [g[3][-1] for g in got] == ceilings


@pytest.mark.parametrize(
    ("untrimmed_mib", "unit", "held"),
    [(150, 1, True), (400, 1, False), (205, _MiB, True), (205, 1, False)],
)
def test_a_tried_plan_that_moves_nothing_is_tried_without_trims_too(
    untrimmed_mib: int, unit: int, held: bool
) -> None:
    """NOTE [trims a plan does without]: two of three blocks (``100 * unit`` bytes
    each) whole within the budget, the third plain (it moves nothing). Its trial runs
    an uncounted step, two under trims (2.4 s a step at 150 MiB) and two without (2 s
    at ``untrimmed_mib``); the trims' verdict on those peaks says which steps count:
    without trims where they held no more than allowed, else under them. Allowed: the
    larger of the trimmed steps' 150 MiB and offload alone's 200 in the profile, and
    5% of the bytes a step saves (``300 * unit``). Either beats plain checkpointing under trims in
    the profile (2.75 s less its dispatch modes' cost). Plain checkpointing without
    trims then ran 2.6 s and lost: the tried plan runs again with the trims its trial
    judged, and no more steps are measured."""
    calls = _Holds()
    trims: list[int] = []
    planned = [150 << 20] * 3 + [untrimmed_mib << 20] * 2 + [100 << 20] * 4 + [0]
    source = _Peaks(_LEAN_PLAIN, planned=planned)
    decider = _plan(
        3.0, 5.0, blocks=3, budget=250 * unit, saved=100 * unit, dispatch_s=0.5,
        ops=_CHEAP, peaks=source, hold_trims=calls, trim_heap=lambda: trims.append(1),
        **_SLOW_LINK,
    )  # fmt: skip
    first = [decider.mode("Block", b) for b in range(3)]
    assert sorted(first) == [PLAIN, WHOLE, WHOLE]
    assert _planned_steps(decider, [2.4, 2.4], 3) == first and calls == [True]
    assert _planned_steps(decider, [2.0, 2.0], 3) == [PLAIN] * 3  # kept; plain weighed
    assert calls == [True, False] and trims == [1]
    m = decider.plan().measured
    assert m["trial_choice"] == 0
    assert m["trial_step_s"] == pytest.approx(2.0 if held else 2.4)
    assert m["trial_peak_MiB"] == (untrimmed_mib if held else 150)
    assert m.get("trial_untrimmed", 0.0) == float(held)
    assert _planned_steps(decider, [3.0, 3.0, 2.6, 2.6], 3) == first  # plain lost
    assert calls == [True, False, True, held] and not source.running
    allowed = (200 << 20) + 0.05 * 300 * unit
    if held:
        assert calls.ceilings[-1] == int(allowed)
    assert trims == ([1] if held else [1, 1])
    plan = decider.plan()
    m = plan.measured
    assert m["untrimmed_choice"] == 0.0 and m["trims_held"] == float(held)
    assert m["untrimmed_peak_MiB"] == untrimmed_mib
    assert m["trims_allowed_MiB"] == pytest.approx(allowed / _MiB)
    text = str(plan)
    assert "without heap trims: " in text and "\n  heap trims: " in text
    assert (f"2.000 s a step without heap trims at {untrimmed_mib} MiB" in text) == held
    assert _planned_steps(decider, [9.0] * 4, 3) == first and len(calls) == 4


@pytest.mark.parametrize(
    ("trimmed_s", "plain_s", "plain_mib", "stands_in", "plain_stays"),
    [
        (2.4, 2.2, 100, True, False),
        (2.4, 2.6, 100, False, False),  # slower than the plan under trims
        (2.4, 2.2, 300, False, False),  # over what its trims' verdict allows
        (2.9, 2.2, 100, True, True),
    ],
)
def test_plain_checkpointing_stands_in_for_a_tried_plan_whose_trims_come_back(
    trimmed_s: float, plain_s: float, plain_mib: int, stands_in: bool, plain_stays: bool
) -> None:
    """NOTE [plain without trims]: the tried plan (two blocks whole within the budget,
    one plain) ran ``trimmed_s`` a step under trims and 2 s without, at 150 MiB, and was
    kept with its trims held off; plain checkpointing without trims then ran
    ``plain_s`` at ``plain_mib`` (within what they allow at 100) and lost. Once the plan's
    heap passes its ceiling twice (the engine lets the trims run again), plain
    checkpointing runs in its place where it ran faster without trims than the plan
    with them, its trims held off under its own ceiling; else the plan runs on under
    trims. Where plain's heap then passes its own ceiling twice, the faster of the two
    under trims runs: plain (2.75 s in the profile) or the plan (``trimmed_s``)."""
    held = [False]
    calls = _Holds(held)
    trims: list[int] = []
    planned = [150 << 20] * 5 + [100 << 20] * 2 + [plain_mib << 20] * 2 + [0]
    source = _Peaks(_LEAN_PLAIN, planned=planned)
    decider = _plan(
        3.0, 5.0, blocks=3, budget=250, saved=100, dispatch_s=0.5, ops=_CHEAP, peaks=source,
        hold_trims=calls, trim_heap=lambda: trims.append(1), trims_held=lambda: held[0],
        **_SLOW_LINK,
    )  # fmt: skip
    first = [decider.mode("Block", b) for b in range(3)]
    kept = _planned_steps(decider, [trimmed_s, trimmed_s, 2.0, 2.0], 3)
    assert kept == [PLAIN] * 3 and decider.plan().measured["trial_choice"] == 0
    assert _planned_steps(decider, [3.0, 3.0, plain_s, plain_s], 3) == first  # plain lost
    allowed = (200 << 20) + 0.05 * 300
    assert calls == [True, False, True, True] and calls.ceilings[-1] == int(allowed)
    assert _planned_steps(decider, [2.0], 3) == first  # (held: nothing changes)
    held[0] = False  # the plan's heap passed the ceiling twice: the engine trims again
    modes = _planned_steps(decider, [3.0], 3)
    plan = decider.plan()
    m = plan.measured
    assert modes == ([PLAIN] * 3 if stands_in else first)
    assert m.get("stand_in", 0.0) == float(stands_in) and m["trims_held"] == float(stands_in)
    assert plan.ops and m["blocks_whole"] == (0 if stands_in else 2)
    if stands_in:  # held off again, under plain's ceiling: its verdict's allowance
        assert calls == [True, False, True, True, True] and held[0]
        assert calls.ceilings[-1] == int(allowed) and m["untrimmed_peak_MiB"] == 100
        assert m["blocks_plain"] == 3 and {d.choice for d in plan.ops} == {"recompute"}
        text = str(plan)
        assert "0 whole, 3 checkpointed plainly" in text
        assert "then: the plan's heap passed 200 MiB twice within 4 steps, and with its " in text
        said = f"heap trims it ran {trimmed_s:.3f} s a step: plain checkpointing runs in its place"
        assert said in text
        assert _planned_steps(decider, [2.0] * 2, 3) == [PLAIN] * 3  # held: plain runs on
        held[0] = False  # plain's heap passed its own ceiling twice: trims for good
        modes = _planned_steps(decider, [3.0], 3)
        assert modes == ([PLAIN] * 3 if plain_stays else first)
        plan = decider.plan()
        m = plan.measured
        assert m["stand_in_kept"] == float(plain_stays) and plan.ops
        assert m["blocks_whole"] == (0 if plain_stays else 2)
        end = "plain checkpointing (2.750 s in the profile) runs on" if plain_stays else ""
        line = str(plan).split("then: ")[1].splitlines()[0]
        assert "; plain's heap passed its own ceiling twice too, and under heap trims " in line
        assert line.endswith(end or "the plan runs again")
    assert calls == [True, False, True, True] + [True] * stands_in  # (the engine let go)
    assert m["trims_held"] == 0.0 and m["trims_released"] == 1.0
    assert "held off, then run again as the process passed" in str(decider.plan())
    assert _planned_steps(decider, [9.0] * 4, 3) == modes
    assert len(calls) == 4 + stands_in and trims == [1]


def test_ranks_that_agree_keep_the_tried_plan_when_its_trims_come_back() -> None:
    """NOTE [plain without trims]: as in the test above, plain checkpointing lost only by
    time and ran faster without trims than the plan with them, but the ranks agree on
    their plans: a rank whose heap passes its ceiling runs the plan under trims, as its
    peers do, rather than standing plain in for it alone."""

    def rank(agreement: Any) -> tuple[list[str], list[str], float]:
        held = [False]
        calls = _Holds(held)
        planned = [150 << 20] * 5 + [100 << 20] * 4 + [0]
        d = _plan(
            3.0, 5.0, blocks=3, budget=250, saved=100, dispatch_s=0.5, ops=_CHEAP,
            peaks=_Peaks(_LEAN_PLAIN, planned=planned), hold_trims=calls,
            trims_held=lambda: held[0], agreement=agreement, **_SLOW_LINK,
        )  # fmt: skip
        first = [d.mode("Block", b) for b in range(3)]
        _planned_steps(d, [2.4, 2.4, 2.0, 2.0, 3.0, 3.0, 2.2, 2.2], 3)
        assert held[0]
        held[0] = False  # this rank's heap passed its ceiling twice
        modes = _planned_steps(d, [3.0], 3)
        return first, modes, d.plan().measured.get("stand_in", 0.0)

    got = on_ranks(2, rank)
    assert all(first == modes and WHOLE in modes and not stood for first, modes, stood in got)


def test_a_tried_plan_without_trims_within_what_they_allow_is_weighed_by_time() -> None:
    """The trial's steps without trims (2.7 s at 190 MiB) held no more than allowed: it
    is kept for being faster than plain checkpointing under trims in the profile (2.75
    s at 100 MiB), though within 5% of it and not 5% leaner, as offload alone's
    profile peak (200 MiB) says the budget allows that memory."""
    calls = _Holds()
    planned = [150 << 20] * 3 + [190 << 20] * 2 + [100 << 20] * 4 + [0]
    source = _Peaks(_LEAN_PLAIN, planned=planned)
    decider = _plan(
        3.0, 5.0, blocks=3, budget=250, saved=100, dispatch_s=0.5, ops=_CHEAP, peaks=source,
        hold_trims=calls, **_SLOW_LINK,
    )  # fmt: skip
    _planned_steps(decider, [2.8, 2.8, 2.7, 2.7], 3)
    m = decider.plan().measured
    assert m["trial_untrimmed"] == 1.0 and m["trial_step_s"] == pytest.approx(2.7)
    assert m["trial_choice"] == 0 and m["trial_plain_s"] == pytest.approx(2.75)


def test_a_tried_plan_that_moves_nothing_and_loses_its_trial_leaves_plain_its_own_trims() -> None:
    """As above, but the trial ran 3 s a step without trims (at 150 MiB, within what is
    allowed), slower than plain checkpointing's 2.75 s: plain checkpointing runs, under
    trims at once, and weighs its own trims (a step to settle the heap the trial's
    steps without trims left, one under them, two without), not the verdict of the
    plan it replaced."""
    calls = _Holds()
    planned = [150 << 20] * 5 + [400 << 20, 100 << 20, 500 << 20, 500 << 20, 0]
    source = _Peaks(_LEAN_PLAIN, planned=planned)
    decider = _plan(
        3.0, 5.0, blocks=3, budget=250, saved=100, dispatch_s=0.5, ops=_CHEAP, peaks=source,
        hold_trims=calls, **_SLOW_LINK,
    )  # fmt: skip
    assert _planned_steps(decider, [3.2, 3.2, 3.0, 3.0], 3) == [PLAIN] * 3
    assert calls == [True, False]  # the trial's steps without trims, then trims again
    m = decider.plan().measured
    assert m["trial_choice"] == 1 and m["trial_step_s"] == pytest.approx(3.0)
    assert _planned_steps(decider, [2.5, 2.5, 2.5], 3) == [PLAIN] * 3
    assert calls == [True, False, True] and source.running
    assert _planned_steps(decider, [2.5], 3) == [PLAIN] * 3
    assert calls == [True, False, True, False] and not source.running
    m = decider.plan().measured
    assert m["trims_held"] == 0.0 and m["untrimmed_peak_MiB"] == 500
    assert m["trims_peak_MiB"] == 100  # (not the settling step's 400)


def _grads(
    model: nn.Module,
    steps: int,
    seq: int | list[int] = 16,
    *,
    first: int = 0,
    flush: Callable[[], None] | None = None,
) -> list[list[torch.Tensor]]:
    """Each step's gradients, the batches seeded ``first``, ``first + 1``, ...; ``flush``
    (if given) runs between forward and backward."""
    out = []
    for step in range(first, first + steps):
        length = seq[step - first] if isinstance(seq, list) else seq
        tokens, targets = make_batch(2, length, vocab=64, seed=step)
        model.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        if flush is not None:
            flush()
        loss.backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def _exact(ref: list[list[torch.Tensor]], got: list[list[torch.Tensor]]) -> bool:
    """Every step's every gradient bit for bit the same."""
    return all(
        torch.equal(a, b)
        for ga, gb in zip(ref, got, strict=True)
        for a, b in zip(ga, gb, strict=True)
    )


def _model(depth: int = 4) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(vocab=64, width=32, depth=depth, heads=2)


@pytest.mark.parametrize("target", ["disk", "cpu"])
@pytest.mark.parametrize("alone", [True, False])
def test_auto_is_bit_identical_and_plans_once(
    tmp_path: Path, target: str, alone: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Either plan: whatever was measured fastest, and (offload alone ruled out) the
    checkpointed blocks."""
    monkeypatch.setattr(recompute, "OFFLOAD_ALONE", alone)
    bases: list[int] = []  # NOTE [profiling under trims]: the engine asks once a step
    real_basis = AutoDecider.trim_basis
    monkeypatch.setattr(
        AutoDecider, "trim_basis", lambda d, moved: bases.append(real_basis(d, moved)) or bases[-1]
    )
    warm_up_unary_ops()
    # The profile, the trial (a plan it did not run as it is: which one the clock
    # decides), four steps of plain checkpointing where offload alone or a tried plan
    # runs (NOTE [plain without trims]), four of a tried plan's own trims, one of the plan.
    weighing = 2 + recompute_weighing.UNTRIMMED_STEPS  # (a first step uncounted, one trimmed)
    steps = len(PROFILE) + 1 + recompute_weighing.TRIAL_STEPS + 2 * weighing + 1
    # Another length: the same structure, no new plan.
    lengths = ([16, 16, 16, 12, 16, 20, 16, 12] * 3)[:steps]
    ref = _grads(_model(), steps, lengths)
    model = _model()
    with offload_context(
        target,
        str(tmp_path) if target == "disk" else None,
        model=model,
        recompute="auto",
        min_offload_bytes=0,
    ) as engine:
        got = _grads(model, steps, lengths)
        plan = engine.recompute_plan()
        stats = engine.stats()
        decider = engine._decider
        source = decider._peak_source
    # NOTE [plans within the noise]: sampled under trims (target disk), stopped at exit
    assert (source is not None) == (target == "disk")
    if target == "disk":  # sampled: the profile's plans held known peaks
        assert plan is not None and plan.measured["peak_plain_MiB"] > 0
        assert plan.measured["peak_alone_MiB"] > 0
    assert not [t for t in threading.enumerate() if t.name == "prefetch_offload-peak"]
    if target == "disk":  # (CPU tensors under target "cpu" stay: no trims, no bound)
        assert len(bases) == steps - 1 and bases[1] == 0  # the first recompute-all step: floor
    assert _exact(ref, got)
    assert plan is not None and plan.mode == "auto" and plan.plans_made == 1
    assert not decider._weighing.trial_left and not decider._weighing._trim_trial_left  # settled
    assert "weighing_plain" not in plan.measured
    if plan.measured["offload_alone"]:  # every block whole: nothing checkpointed
        assert alone and plan.bytes_recomputed == stats.step_bytes_recomputed == 0
        assert {d.choice for d in plan.ops} == {"whole"}
        m = plan.measured  # measured, not estimated: by the profile's walls, or a trial
        if "trial_choice" in m:
            assert m["trial_choice"] == 2  # (its tried plan replaced by offload alone)
        else:
            assert m["wall_alone_s"] <= (1 + recompute_planner.TIE) * m["wall_plain_s"]
        return
    assert plan.bytes_recomputed > 0
    choices = {d.op: d.choice for d in plan.ops}
    assert choices["aten.view.default"] == "recompute"
    assert stats.step_bytes_recomputed > 0
    assert stats.step_bytes_offloaded + stats.step_bytes_recomputed > 0


def test_a_step_s_time_ends_with_its_backward_not_at_the_next_step(tmp_path: Path) -> None:
    """NOTE [trial steps]: what a loop does between steps (evaluation, a checkpoint, a
    benchmark's other processes) is in no step's time: here 0.3 s after each backward."""
    model = _model()
    with offload_context("disk", tmp_path, model=model, recompute="auto") as engine:
        for step in range(len(PROFILE) + 1):
            tokens, targets = make_batch(2, 16, vocab=64, seed=step)
            model(tokens, targets).backward()
            time.sleep(0.3)
        plan = engine.recompute_plan()
    assert plan is not None and plan.plans_made == 1
    for key in ("wall_plain_s", "wall_alone_s"):
        assert 0 < plan.measured[key] < 0.3, (key, plan.measured[key])


def test_profile_and_trial_steps_wait_for_the_device_at_both_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [trial steps]: on CUDA a step's time is its kernels'. The CPU twin counts the
    synchronizes: one as each profiling or trial step starts and one as its backward
    ends; none once the plan holds."""
    calls: list[int] = []
    monkeypatch.setattr(recompute, "_sync_device", lambda: calls.append(len(steps)))
    monkeypatch.setattr(recompute, "OFFLOAD_ALONE", False)
    monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", 0.0)  # selective on a toy: tried
    monkeypatch.setattr(recompute_planner, "SELECTIVE_MARGIN", 0.0)
    model = _model()
    steps: list[int] = []
    with offload_context(
        "disk", tmp_path, model=model, recompute="auto", min_offload_bytes=0
    ) as engine:
        for step in range(len(PROFILE) + 6):
            tokens, targets = make_batch(2, 16, vocab=64, seed=step)
            model(tokens, targets).backward()
            steps.append(step)
        plan = engine.recompute_plan()
    assert plan is not None
    m = plan.measured
    tried = 3 if "trial_step_s" in m else 0
    # (A tried plan kept, or offload alone: plain checkpointing weighed in its place,
    # by the clock; NOTE [plain without trims].)
    weighs = "untrimmed_plain_s" in m or "weighing_plain" in m
    weighed = 2 + recompute_weighing.UNTRIMMED_STEPS if weighs else 0
    timed = len(PROFILE) + tried + weighed  # steps whose time counts or could
    per_step = collections.Counter(calls)
    # Step k's backward end is counted at k (before the append), its start at k.
    assert all(per_step[k] == 2 for k in range(1, min(timed, len(steps)))), per_step
    assert per_step[0] == 1  # the first step: its end only
    assert all(per_step[k] == 0 for k in range(timed + 1, len(steps))), per_step


@pytest.mark.parametrize("to", ["plain", "alone"])
def test_a_trial_that_changes_the_plan_mid_training_stays_bit_identical(
    tmp_path: Path, to: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [trial steps]: the plan is tried whatever it is and the profiled plan ``to``
    made to look fastest; from the fourth planned step on every block runs that way (for
    offload alone, after plain checkpointing weighed without trims lost to its profiled
    0 s), and the gradients of every step match training without offload or
    checkpointing."""
    real_make_plan = AutoDecider._make_plan

    def make_plan(decider: AutoDecider) -> None:
        real_make_plan(decider)
        decider._weighing.trial_left = recompute_weighing.TRIAL_STEPS + 1
        decider._active.obs = dict(decider._profile.obs)
        fast = {"plain": 0.0, "alone": math.inf} if to == "plain" else {"plain": math.inf}
        walls = {"alone": 0.0, **fast}
        decider._weighing.profiled_plans = {
            name: recompute_planner.Weighed(wall, 0, 0) for name, wall in walls.items()
        }

    monkeypatch.setattr(AutoDecider, "_make_plan", make_plan)
    monkeypatch.setattr(recompute, "OFFLOAD_ALONE", False)  # the plan checkpoints
    warm_up_unary_ops()
    # The profile, the trial, three steps weighing heap trims (for offload alone, plain
    # checkpointing without them: NOTE [plain without trims]), two of the plan chosen.
    steps = len(PROFILE) + 3 + 3 + 2
    ref = _grads(_model(), steps)
    model = _model()
    with offload_context("disk", tmp_path, model=model, recompute="auto") as engine:
        got = _grads(model, steps)
        plan = engine.recompute_plan()
        stats = engine.stats()
        modes = set(engine._decider._active.modes.values())  # type: ignore[union-attr]
    assert plan is not None and plan.measured["trial_choice"] == (1 if to == "plain" else 2)
    assert modes == {PLAIN if to == "plain" else WHOLE}
    assert (stats.step_bytes_recomputed > 0) == (to == "plain")
    whole = {"plain": 0, "alone": 4}[to]
    assert plan.measured["blocks_whole"] == whole and plan.plans_made == 1
    assert _exact(ref, got)


@pytest.mark.parametrize("held", [True, False])
def test_the_trims_trial_holds_the_engine_s_trims_as_judged_and_stays_bit_identical(
    tmp_path: Path, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [trims a plan does without], with the engine: every block checkpointed
    plainly; after one planned step under trims and two without, the engine's trimmer
    is held off or runs as the judgement says, and every step's gradients match
    training without offload or checkpointing."""
    monkeypatch.setattr(recompute, "OFFLOAD_ALONE", False)  # the plan checkpoints
    monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", math.inf)  # plainly
    # The verdict: untrimmed <= max(trimmed, offload alone's) + _TRIMS_SLACK * saved,
    # with an infinite slack or a negative infinite one.
    monkeypatch.setattr(recompute_trims, "TRIMS_SLACK", math.inf if held else -math.inf)
    warm_up_unary_ops()
    plain = _model()
    ref = _grads(plain, len(PROFILE) + 2) + _grads(plain, 3)
    model = _model()
    # (Every saved tensor reaches the tiers: the whole step counts the bytes it saved.)
    with offload_context(
        "disk", tmp_path, model=model, recompute="auto", min_offload_bytes=0
    ) as engine:
        heap = engine._heap
        if not heap.enabled:
            pytest.skip("no heap trims here (not glibc)")
        got = _grads(model, len(PROFILE) + 2)
        assert heap.held  # the second planned step runs without trims
        got += _grads(model, 3)
        plan = engine.recompute_plan()
        assert heap.held == held
    assert plan is not None and plan.measured["trims_held"] == float(held)
    assert plan.measured["blocks_plain"] == 4 and plan.plans_made == 1
    assert _exact(ref, got)


@pytest.mark.usefixtures("no_interleave")
@pytest.mark.parametrize("to", ["plain", "alone"])
def test_plain_weighed_without_trims_runs_as_judged_and_stays_bit_identical(
    tmp_path: Path, to: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [plain without trims], with the engine: the profile made to choose offload
    alone; plain checkpointing runs four steps (the last two with the engine's trimmer
    held off), then the plan ``to`` runs, the trimmer held off only for plain, and every
    step's gradients match training without offload or checkpointing."""
    monkeypatch.setattr(recompute_planner, "leanest_of_the_fastest", lambda plans: "alone")
    # what plain weighs against
    rival = ("offload alone", recompute_planner.Weighed(math.inf if to == "plain" else 0.0, 0, 0))
    monkeypatch.setattr(ActivePlan, "rival", lambda a: rival if a.measured else None)
    monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", math.inf)  # (not selective)
    monkeypatch.setattr(recompute_trims, "TRIMS_SLACK", math.inf)  # the trims would be held off
    warm_up_unary_ops()
    plain = _model()
    ref = _grads(plain, len(PROFILE) + 2) + _grads(plain, 1) + _grads(plain, 3)
    model = _model()
    # (Every saved tensor reaches the tiers: the whole step counts the bytes it saved.)
    with offload_context(
        "disk", tmp_path, model=model, recompute="auto", min_offload_bytes=0
    ) as engine:
        heap = engine._heap
        if not heap.enabled:
            pytest.skip("no heap trims here (not glibc)")
        decider = engine._decider
        got = _grads(model, len(PROFILE) + 2)
        assert set(decider._active.modes.values()) == {PLAIN} and not heap.held  # under trims
        got += _grads(model, 1)
        assert set(decider._active.modes.values()) == {PLAIN} and heap.held
        got += _grads(model, 3)
        plan = engine.recompute_plan()
        stats = engine.stats()
        assert heap.held == (to == "plain")
        assert set(decider._active.modes.values()) == {PLAIN if to == "plain" else WHOLE}
    assert plan is not None and plan.measured["untrimmed_choice"] == float(to == "plain")
    assert plan.measured["blocks_whole"] == (0 if to == "plain" else 4)
    assert (stats.step_bytes_recomputed > 0) == (to == "plain") and plan.plans_made == 1
    assert _exact(ref, got)


def test_an_interleaved_plan_moves_its_whole_blocks_only_and_stays_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [interleaved blocks], with the engine: the profile made to choose offload
    alone, and the trial to keep the plan that interleaves: of four blocks the first and
    third run plain, the second and fourth whole. A planned step moves less than three
    quarters of what the profile's step with every block whole moved (the plain blocks'
    inputs, the whole blocks' saved tensors and the head's; each step flushes before
    backward, so every tensor reaches the disk) and recomputes the plain blocks; every
    step's gradients match training without offload or checkpointing. From the second
    planned step, the heap trims' bound follows what the profile's last step with every
    block whole moved, not the plan's own steps."""

    def choose(plans: dict[str, recompute_planner.Weighed]) -> str:
        return "trial" if "trial" in plans else "alone"

    monkeypatch.setattr(recompute_planner, "leanest_of_the_fastest", choose)  # the profile's
    monkeypatch.setattr(recompute_weighing, "leanest_of_the_fastest", choose)  # the trial's
    monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", math.inf)  # (not selective)
    moved: list[int] = []  # each step's, as the engine hands it over at the next step
    bases: list[int] = []
    real_basis = AutoDecider.trim_basis

    def basis(decider: AutoDecider, step_moved: int) -> int:
        moved.append(step_moved)
        bases.append(real_basis(decider, step_moved))
        return bases[-1]

    monkeypatch.setattr(AutoDecider, "trim_basis", basis)
    warm_up_unary_ops()
    whole_step = PROFILE.index(WHOLE_TIMED)
    steps = len(PROFILE) + 1 + recompute_weighing.TRIAL_STEPS + 1  # (judged, one more)

    ref = _grads(_model(), steps)
    got: list[list[torch.Tensor]] = []
    model = _model()
    with offload_context(
        "disk", tmp_path, model=model, recompute="auto", min_offload_bytes=0
    ) as engine:
        decider = engine._decider

        def run(n: int) -> int:
            """``n`` more steps, each flushed before backward; the bytes they moved."""
            before = engine.stats().bytes_offloaded
            got.extend(_grads(model, n, first=len(got), flush=engine.flush))
            return engine.stats().bytes_offloaded - before

        run(whole_step)
        alone = run(1)  # every block whole
        run(len(PROFILE) - whole_step - 1)
        kind = type(model.blocks[0]).__name__
        assert [decider.mode(kind, b) for b in range(4)] == [PLAIN, WHOLE] * 2
        interleaved = run(1)
        assert engine.stats().step_bytes_recomputed > 0  # the plain blocks'
        run(steps - len(got))
        plan = engine.recompute_plan()
    assert 0 < interleaved < 0.75 * alone
    last_whole = len(PROFILE) - 1 - PROFILE[::-1].index(WHOLE_TIMED)
    planned = len(PROFILE)  # bases[i] is asked at the start of step i + 1
    assert len(bases) == steps - 1 and moved[planned] == interleaved
    assert bases[planned:] == [moved[last_whole]] * (steps - 1 - planned)
    assert plan is not None and plan.measured["trial_choice"] == 0
    assert plan.measured["blocks_interleaved"] == 2 and plan.plans_made == 1
    assert _exact(ref, got)


class _DropBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(32, 64), nn.Linear(64, 32), nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.drop(torch.tanh(self.a(x))))


class _CheckpointsItsLayers(nn.Module):
    """A model that puts its own non-reentrant checkpoint around all its layers."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_DropBlock() for _ in range(3))
        self.head = nn.Linear(32, 32)
        self.reentrant = reentrant

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ckpt = torch.utils.checkpoint.checkpoint
        return self.head(ckpt(self.body, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize(
    "how",
    [
        "auto",
        "selective",
        "full",
        "auto-reentrant",
        "auto-reentrant-after-eval",
        "auto-in-reentrant-after-eval",
    ],
)
def test_blocks_inside_the_model_s_own_checkpoint_replay_their_forward(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [block modes]: the outer checkpoint's recompute runs each block's forward
    again inside backward; it runs as that forward did, and the plan's steps do not
    move (profiling, then the plan, bit-identical with dropout). Under a reentrant one
    the forward runs without grad: the recompute is the blocks' step, and plans, also
    after a forward with grad outside the checkpoint (an evaluation, its loss dropped),
    and where the loop puts a reentrant checkpoint around the model's own: its
    recompute runs the model's checkpoint, whose recompute replays that."""
    monkeypatch.setattr(recompute, "OFFLOAD_ALONE", False)
    monkeypatch.setattr(recompute, "TRIAL", False)  # the plan it made stays
    if how == "selective":
        monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", 0.0)  # selective on a toy
        monkeypatch.setattr(recompute_planner, "SELECTIVE_MARGIN", 0.0)
    torch.manual_seed(0)
    ref_model = _CheckpointsItsLayers(reentrant=how.startswith("auto-reentrant"))
    model = copy.deepcopy(ref_model)

    def grads(m: nn.Module) -> list[list[torch.Tensor]]:
        out = []
        for step in range(len(PROFILE) + 3):
            if step == 1 and how.endswith("eval"):
                m.body(torch.randn(4, 32)).sum()  # (with grad, dropped)
            torch.manual_seed(100 + step)
            x = torch.randn(4, 32, requires_grad=True)
            m.zero_grad(set_to_none=True)
            if how == "auto-in-reentrant-after-eval":
                y = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=True)
            else:
                y = m(x)
            y.square().sum().backward()
            out.append([*(p.grad.clone() for p in m.parameters()), x.grad])
        return out

    ref = grads(ref_model)
    with offload_context(
        "disk",
        str(tmp_path),
        model=model,
        recompute="full" if how == "full" else "auto",
        min_offload_bytes=0,
    ) as engine:
        got = grads(model)
        plan = engine.recompute_plan()
    assert _exact(ref, got)
    if how != "full":
        assert plan is not None and plan.plans_made == 1
        assert "3 whole" not in str(plan)  # checkpointed blocks planned
        if how == "selective":
            assert "3 selectively" in str(plan)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        if self.extra:
            h = torch.sigmoid(h) * h
        return h + x


def test_a_new_structure_is_planned_once_more_then_kept(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[_Branchy() for _ in range(3)])
    ref_model = copy.deepcopy(model)

    def steps(m: nn.Module, extras: list[bool]) -> list[torch.Tensor]:
        grads = []
        for i, extra in enumerate(extras):
            for block in m:
                block.extra = extra
            torch.manual_seed(i)
            x = torch.randn(8, 32, requires_grad=True)
            m(x).sum().backward()
            grads.append(x.grad)
        return grads

    plan = len(PROFILE) + 1  # the profile and the step that plans
    extras = [False] * plan + [True] * plan + [False, True]
    ref = steps(ref_model, extras)
    with offload_context(
        "disk", str(tmp_path), model=model, recompute="auto", min_offload_bytes=0
    ) as engine:
        got = steps(model, extras)
        plan = engine.recompute_plan()
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert plan is not None and plan.plans_made in (1, 2)
    # A block checkpointed plainly has no per-op plan to go stale; a selective one
    # profiles once more when sigmoid first runs (and never again).
    if plan.measured["blocks_selective"]:
        assert plan.plans_made == 2


def test_a_budget_no_plan_can_reach_warns_once_and_runs_every_block_plain(
    tmp_path: Path,
) -> None:
    """NOTE [a budget no plan reaches]: exact at every step, one warning, and every
    block checkpointed plainly from the first planned step on."""
    model = _model()
    steps = len(PROFILE) + 3
    ref = _grads(copy.deepcopy(model), steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with offload_context(
            "disk", str(tmp_path), model=model, recompute="auto", device_budget=1024
        ) as engine:
            got = _grads(model, steps)
    hits = [w for w in caught if issubclass(w.category, OffloadFallbackWarning)]
    assert len(hits) == 1 and "smallest reachable" in str(hits[0].message)
    plan = engine.recompute_plan()
    assert plan is not None and plan.measured["blocks_plain"] == 4
    assert plan.measured["offload_alone"] == 0 and plan.bytes_offloaded == 0
    assert _exact(ref, got)
    # The budget the warning names is one that a plan reaches: no warning there.
    named = re.search(r"device_budget to at least (\d+) bytes", str(hits[0].message))
    assert named is not None and int(named[1]) > 1024
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with offload_context(
            "disk", str(tmp_path), model=model, recompute="auto", device_budget=int(named[1])
        ) as engine:
            _grads(model, steps)
    assert not [w for w in caught if "smallest reachable" in str(w.message)]
    assert engine.recompute_plan() is not None


def test_the_dispatch_cost_is_the_median_block_s_own_time_in_the_modes() -> None:
    """Per block, what the modes measured of themselves in the recompute-all step,
    forward and recompute: the median block (one slowed by another process is left out),
    not a difference of two block times that a heap trim in one of them would move."""
    fake = _Fake()
    decider = AutoDecider(fake.snapshot, 0, clock=fake.clock)
    for step_s, dispatch_s in ((3.0, 9.0), (2.0, 9.0), (2.0, 0.25)):
        _step(
            decider, fake, _OPS, step_s=step_s / 4, forward_s=0.1, blocks=4, dispatch_s=dispatch_s
        )
    decider.dispatched(("Block", 3), 5.0)  # one slow block's recompute
    # The other recompute-all steps and the whole ones: the median is over every
    # recompute-all step.
    _step(decider, fake, _OPS, step_s=0.5, forward_s=0.1, blocks=4, dispatch_s=0.25)
    for _ in range(3):
        _step(decider, fake, _OPS, step_s=9.0, forward_s=0.1, blocks=4)  # every block whole
    for _ in range(2):
        _step(decider, fake, _OPS, step_s=0.5, forward_s=0.1, blocks=4, dispatch_s=0.25)
    decider.mode("Block", 0)  # the next step: the plan
    measured = decider.plan().measured
    assert measured["dispatch_in_modes_s"] == pytest.approx(0.25)
    assert measured["dispatch_s_per_block"] == pytest.approx(0.375)
    assert "dispatch_paired_s" not in measured


class _RoutedBlock(nn.Module):
    """Returns router logits first, then its result: with the auxiliary loss off, the
    logits get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.router(x), x + self.b(torch.tanh(self.a(x)))


class _Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_RoutedBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            _, x = layer(x)  # the router logits unused
        return x.square().mean()


def test_auto_plans_when_a_blocks_first_output_gets_no_gradient(tmp_path: Path) -> None:
    """NOTE [block modes]: backward reaching a block is heard at whichever output that
    requires grad gets a gradient first, so the steps still end and the plan is made."""
    steps = len(PROFILE) + 2

    def grads(model: nn.Module) -> list[list[torch.Tensor]]:
        out = []
        for step in range(steps):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            model.zero_grad(set_to_none=True)
            model(x).backward()
            out.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        return out

    torch.manual_seed(0)
    ref_model = _Routed()
    model = copy.deepcopy(ref_model)
    ref = grads(ref_model)
    with offload_context(
        "disk", str(tmp_path), model=model, recompute="auto", min_offload_bytes=0
    ) as engine:
        got = grads(model)
        plan = engine.recompute_plan()
    assert _exact(ref, got)
    assert plan is not None and plan.plans_made == 1


def test_an_interrupt_as_a_profiled_block_ends_leaves_no_dispatch_mode_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [interrupts] in io_pool.py: a Ctrl-C in the decider's call as a timed block's
    dispatch mode exits leaves the mode off the dispatch stack (left on, every later op
    of the process went through it, and raised once the context had exited); training
    goes on, exact."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    real, fired = AutoDecider.dispatched, []

    def dispatched(self: AutoDecider, *args: Any) -> None:
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        real(self, *args)

    monkeypatch.setattr(AutoDecider, "dispatched", dispatched)

    def step(m: nn.Module, seed: int) -> list[torch.Tensor]:
        tokens, targets = make_batch(2, 16, vocab=64, seed=seed)
        m.zero_grad(set_to_none=True)
        m(tokens, targets).backward()
        return [p.grad.clone() for p in m.parameters()]

    warm_up_unary_ops()
    steps = len(PROFILE) + 2
    reference = _model()
    ref = [step(reference, seed) for seed in range(steps)]
    model = _model()
    got = []
    with offload_context("disk", tmp_path, model=model, recompute="auto"):
        for seed in range(steps):
            try:
                got.append(step(model, seed))
            except KeyboardInterrupt:
                assert _get_current_dispatch_mode_stack() == []
                got.append(step(model, seed))  # the same step again
        assert fired
    assert _get_current_dispatch_mode_stack() == []
    assert torch.equal(torch.ones(2) * 2, torch.full((2,), 2.0))  # ops run after exit
    assert _exact(ref, got)
