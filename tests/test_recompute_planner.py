"""recompute_planner.py: the plan made from one profile, and how measured plans are weighed
(NOTE [plans within the noise], NOTE [a budget no plan reaches]); the plans themselves
are tested through the decider's steps in test_recompute.py."""

from __future__ import annotations

import pytest

from prefetch_offload import OffloadStats
from prefetch_offload.recompute_planner import (
    Weighed,
    leanest_of_the_fastest,
    unreachable_budget,
    why_chosen,
)
from prefetch_offload.recompute_profile import OFFLOAD_ALL_STEP, WHOLE_ALL_STEP, Profile, Span

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
