"""recompute_profile.py: what the profiling steps measured, and the medians and best steps
the plan reads (NOTE [keep, offload, recompute] in recompute.py)."""

from __future__ import annotations

import pytest
import torch

from prefetch_offload import OffloadStats
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
