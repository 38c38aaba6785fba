"""recompute.py: the automatic keep / offload / recompute policy as a whole.

The decider is driven with fake measurements (a clock and engine counters the test sets:
recompute_helpers.py); the end-to-end tests train a model under recompute="auto". The plan,
its weighing and the profile's figures: test_recompute_planner.py, test_recompute_weighing.py
and test_recompute_profile.py.
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
from recompute_helpers import (
    _OPS,
    _SLOW_LINK,
    MM,
    P,
    _Fake,
    _out,
    _plan,
    _step,
    no_interleave,  # noqa: F401 (a fixture)
)
from torch import nn

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
from prefetch_offload.recompute import AutoDecider
from prefetch_offload.recompute_profile import OFFLOAD_ALL, PROFILE, WHOLE_TIMED
from prefetch_offload.recompute_weighing import ActivePlan
from prefetch_offload.testing import TinyTransformer, make_batch, warm_up_unary_ops


def test_matmul_s_unsafe_view_counts_as_an_alias() -> None:
    """Its schema marks no alias, but its output is its input's memory: storing both
    would move the same bytes twice, so the plan recomputes the view."""
    unsafe_view = torch.ops.aten._unsafe_view.default
    out = torch.ops.aten.mm.default(torch.randn(6, 4), torch.randn(4, 5))
    view = unsafe_view(out, [2, 3, 5])
    assert view.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert unsafe_view._schema.returns[0].alias_info is None
    assert recompute._aliases(unsafe_view) and not recompute._aliases(MM)


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
