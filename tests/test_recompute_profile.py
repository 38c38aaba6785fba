"""recompute_profile.py: what the profiling steps measured, and the medians and best steps
the plan reads (NOTE [keep, offload, recompute] in recompute.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from recompute_helpers import (
    _LEAN_PLAIN,
    _NEEDED,
    _OPS,
    _SLOW_LINK,
    GB,
    GELU,
    VIEW,
    _Fake,
    _Peaks,
    _plan,
    _planned_steps,
    _step,
)

from prefetch_offload import OffloadStats
from prefetch_offload.blocks import PLAIN, SELECTIVE, WHOLE
from prefetch_offload.peak import PeakSampler
from prefetch_offload.recompute import AutoDecider
from prefetch_offload.recompute_profile import (
    OFFLOAD_ALL,
    PROFILE,
    RECOMPUTE_ALL,
    WHOLE_ALL,
    WHOLE_TIMED,
    Profile,
    most,
)

MM = torch.ops.aten.mm.default


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_counted_steps_follow_a_step_of_their_own_kind() -> None:
    """The plan compares only the steps after one of their own kind: the faster of two
    each, for plain checkpointing and offload alone."""
    assert Profile.steps(WHOLE_ALL) == [0] and Profile.steps(OFFLOAD_ALL) == [1]
    assert Profile.counted(RECOMPUTE_ALL) == [3, 8]
    assert Profile.counted(WHOLE_TIMED) == [5, 6]
    assert Profile.counted(OFFLOAD_ALL) == []
    assert len(PROFILE) == 9


def test_most_is_unknown_where_any_sample_is() -> None:
    assert most([3, 5, 4]) == 5
    assert most([3, 0, 4]) == 0 and most([]) == 0


def test_a_forgotten_step_gives_back_what_the_step_before_measured() -> None:
    """NOTE [abandoned forwards] in recompute.py: the op measurements of a step that runs
    again are those of the step before it, copies that the rerun cannot change."""
    clock = _Clock()
    profile = Profile(OffloadStats, clock)
    key = ("Block", 0, MM, 0)
    step = Profile.steps(OFFLOAD_ALL)[0]
    profile.observed(step, key, MM, torch.zeros(4), 0.5)
    profile.step_ended(step, 1.0, 1.0, 0, 0)
    pos = ("Block", MM, 0)
    assert profile.obs[pos].seconds == [0.5] and profile.obs[pos].nbytes == 16
    rerun = step + 1  # a recompute-all step, abandoned
    for _ in range(2):  # (the kept copy is not the one measured again)
        profile.entered(rerun, ("Block", 0))
        profile.observed(rerun, key, MM, torch.zeros(4), 9.0)
        assert profile.obs[pos].seconds == [0.5, 9.0]
        profile.forget(rerun)
        assert profile.obs[pos].seconds == [0.5] and profile.obs[pos].nbytes == 16
        assert rerun not in profile.spans


def test_block_times_take_the_median_block_of_the_faster_counted_step() -> None:
    """Each block's forward from its entry to its return; its backward from backward
    reaching it to backward reaching the block before it (the first: to the step's end)."""
    clock = _Clock()
    profile = Profile(OffloadStats, clock)
    for step, scale in zip(Profile.counted(WHOLE_TIMED), (2.0, 1.0), strict=True):
        for b in range(3):
            clock.now = 10.0 * step + b * scale
            profile.entered(step, ("Block", b))
            clock.now += scale * (b + 1) * 0.1
            profile.exited(step, ("Block", b))
        for b in reversed(range(3)):
            clock.now = 10.0 * step + 5 + (2 - b) * scale
            profile.reached(step, ("Block", b))
        profile.step_ended(step, 10.0 * step + 5 + 3 * scale, 1.0, 0, 0)
    forward, backward, blocks = profile.block_times(WHOLE_TIMED)
    assert blocks == 3
    assert forward == pytest.approx(0.2)  # the second step's median block: 0.1, 0.2, 0.3
    assert backward == pytest.approx(1.0)
    assert profile.block_times(WHOLE_TIMED, {("Block", 2)})[0] == pytest.approx(0.3)


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
