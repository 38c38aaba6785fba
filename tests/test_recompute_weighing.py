"""recompute_weighing.py: the plan in force as a weighing rewrites it. The weighings
themselves (trial, trims' trial, plain without trims, stand-in) run through the decider's
steps (the fake clock of recompute_helpers.py)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from engine_helpers import on_ranks
from recompute_helpers import (
    _CHEAP,
    _LEAN_PLAIN,
    _NEEDED,
    _OPS,
    _SLOW_LINK,
    GB,
    GELU,
    VIEW,
    _Fake,
    _MiB,
    _Peaks,
    _plan,
    _planned_steps,
    _profile_rest,
    _step,
    no_interleave,  # noqa: F401 (a fixture)
)
from torch.utils.checkpoint import CheckpointPolicy as P

from prefetch_offload import recompute
from prefetch_offload.blocks import PLAIN, SELECTIVE, WHOLE
from prefetch_offload.heap import CEILING_STEPS
from prefetch_offload.recompute import AutoDecider
from prefetch_offload.recompute_planner import Weighed
from prefetch_offload.recompute_profile import WHOLE_TIMED
from prefetch_offload.recompute_weighing import ActivePlan

MM = torch.ops.aten.mm.default
ADD = torch.ops.aten.add.Tensor
RAND = torch.ops.aten.rand_like.default
MB = 1 << 20


def _selective(own: set) -> ActivePlan:
    """Two selective blocks: an offloaded mm, a recomputed add, and an op that draws from
    the caller's own generator (stored, never recomputed)."""
    active = ActivePlan(own)
    active.plan = {("B", MM, 0): P.PREFER_CPU_OFFLOAD, ("B", ADD, 0): P.PREFER_RECOMPUTE}
    active.plan[("B", RAND, 0)] = P.PREFER_CPU_OFFLOAD
    active.reasons = {pos: ("profiled", 0.5, 0.25) for pos in active.plan}
    active.profiled = {("B", 0), ("B", 1)}
    active.modes = dict.fromkeys(active.profiled, SELECTIVE)
    active.measured = {"blocks_selective": 2.0, "blocks_whole": 0.0, "whole_MiB": 3.0}
    active.share = 0.5
    return active


def test_plain_recomputes_what_was_offloaded_but_a_draw_of_the_callers_own() -> None:
    own = {("B", RAND, 0)}
    active = _selective(own)
    assert active.moves()
    active.switch(PLAIN, "ran faster")
    assert set(active.modes.values()) == {PLAIN} and active.share == 1.0
    assert active.plan[("B", MM, 0)] is P.PREFER_RECOMPUTE
    why = "plain checkpointing of every block ran faster"
    assert active.reasons[("B", MM, 0)] == (why, 0.5, 0.25)
    assert active.plan[("B", RAND, 0)] is P.PREFER_CPU_OFFLOAD  # (its recompute draws again)
    assert active.reasons[("B", ADD, 0)][0] == "profiled"  # (recomputed already)
    assert active.block_counts() == {
        "blocks_whole": 0,
        "blocks_plain": 2,
        "blocks_selective": 0,
        "blocks_interleaved": 0,
        "whole_MiB": 0.0,
        "offload_alone": 0.0,
    }
    assert not active.moves()


def test_offload_alone_runs_every_block_whole() -> None:
    active = _selective(set())
    active.switch(WHOLE, "ran faster")
    assert set(active.modes.values()) == {WHOLE} and active.share == 0.0
    assert all(policy is P.PREFER_RECOMPUTE for policy in active.plan.values())
    assert active.measured["offload_alone"] == 1.0 and active.measured["whole_MiB"] == 3.0
    assert active.moves()


def test_the_rival_of_plain_checkpointing_is_offload_alone_or_a_kept_trial() -> None:
    """From the printed figures: offload alone's profiled step, or the trial's where it
    kept its plan; none where neither runs."""
    active = ActivePlan(set())
    assert active.rival() is None
    active.measured = {"offload_alone": 1.0, "wall_alone_s": 2.0, "peak_alone_MiB": 700.0}
    assert active.rival() == ("offload alone", Weighed(2.0, 700 * MB, 0))
    active.measured = {"trial_choice": 0.0, "trial_step_s": 1.5, "trial_peak_MiB": 600.0}
    active.measured["trial_moved_MiB"] = 400.0
    assert active.rival() == ("this plan's trial", Weighed(1.5, 600 * MB, 400 * MB))
    active.measured["trial_choice"] = 1.0  # replaced by plain checkpointing
    assert active.rival() is None


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
