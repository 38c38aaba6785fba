"""recompute_planner.py: the plan made from one profile, and how measured plans are weighed
(NOTE [plans within the noise], NOTE [a budget no plan reaches]); the plans themselves
through the decider's steps (the fake clock of recompute_helpers.py)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from recompute_helpers import (
    _CHEAP,
    _LEAN_PLAIN,
    _NEEDED,
    _OPS,
    _RECOMPUTED_S,
    _SLOW_LINK,
    ADD,
    GB,
    GELU,
    MM,
    VIEW,
    P,
    _Fake,
    _MiB,
    _Peaks,
    _plan,
    _planned_steps,
    _profile_rest,
    _step,
    no_interleave,  # noqa: F401 (a fixture)
)

from prefetch_offload import OffloadFallbackWarning, OffloadStats, recompute, recompute_weighing
from prefetch_offload.blocks import PLAIN, SELECTIVE, WHOLE
from prefetch_offload.recompute import AutoDecider
from prefetch_offload.recompute_planner import (
    Weighed,
    leanest_of_the_fastest,
    unreachable_budget,
    why_chosen,
)
from prefetch_offload.recompute_profile import (
    OFFLOAD_ALL,
    OFFLOAD_ALL_STEP,
    PROFILE,
    RECOMPUTE_ALL,
    WHOLE_ALL,
    WHOLE_ALL_STEP,
    WHOLE_TIMED,
    Profile,
    Span,
)

_SLOW_PLAIN = (1.2, 300, 0)


@pytest.mark.parametrize(
    ("trial", "plain", "chosen", "why"),
    [
        ((0.9, 500, 900), _SLOW_PLAIN, "trial", ""),  # the fastest
        ((1.04, 380, 900), _SLOW_PLAIN, "trial", ""),  # within 5%, 5% leaner
        ((1.04, 400, 700), _SLOW_PLAIN, "trial", ""),  # within 5%, no fuller, 30% lighter
        ((1.04, 400, 800), _SLOW_PLAIN, "alone", "ran faster than"),  # 20% lighter only
        ((1.04, 420, 100), _SLOW_PLAIN, "trial", ""),  # 5% fuller: as lean, within the noise
        ((1.04, 421, 100), _SLOW_PLAIN, "alone", "ran faster than"),  # over 5% fuller
        ((1.06, 300, 0), _SLOW_PLAIN, "alone", "ran faster than"),  # over 5% slower
        ((1.04, 390, 500), (1.03, 300, 0), "plain", "ran faster than"),  # leanest
        ((0.99, 500, 0), (1.03, 300, 0), "plain", "ran within 5% of this plan's trial and"),
        ((1.02, 280, 0), (1.03, 270, 0), "plain", "ran within 5% of the fastest plan"),
    ],
)
def test_of_plans_within_the_noise_the_leaner_then_the_lighter_runs(
    trial: tuple[float, int, int], plain: tuple[float, int, int], chosen: str, why: str
) -> None:
    """NOTE [plans within the noise]: offload alone took 1.0 s at 400 MiB moving 1000
    bytes; the trial and plain checkpointing as given (seconds, MiB, bytes moved). The
    plan that runs, and why it replaced the trial."""
    plans = {
        "trial": Weighed(*trial),
        "plain": Weighed(*plain),
        "alone": Weighed(1.0, 400, 1000),
    }
    got = leanest_of_the_fastest(plans)
    assert got == chosen
    if chosen != "trial":
        text = why_chosen(plans, got, "trial", "this plan's trial")
        assert text.startswith(why), text


def test_a_budget_below_one_blocks_recompute_is_unreachable() -> None:
    """What one block's recompute holds: the largest block's saved bytes per call (its
    op outputs where nothing reached the engine's tiers); over the budget, unreachable;
    no budget (0), never."""
    profile = Profile(OffloadStats, lambda: 0.0)
    profile.block_bytes[("Block", 0)] = 900
    profile.spans[WHOLE_ALL_STEP] = {("Block", 0): Span(saved=300, calls=1)}
    assert unreachable_budget(profile, 250) == (300, "what the largest block saves for backward")
    assert unreachable_budget(profile, 300) is None
    assert unreachable_budget(profile, 0) is None
    profile.spans[WHOLE_ALL_STEP][("Block", 0)].calls = 2  # called twice a step: 150 a call
    assert unreachable_budget(profile, 250) is None
    profile.spans[WHOLE_ALL_STEP] = {("Block", 0): Span(saved=0, calls=1)}
    profile.spans[OFFLOAD_ALL_STEP] = {("Block", 0): Span(calls=3)}
    assert unreachable_budget(profile, 250) == (300, "the largest block's op outputs")


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
