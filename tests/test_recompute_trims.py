"""recompute_trims.py: the heap trims' verdict on a plan that moves nothing, and its ceiling
(NOTE [trims a plan does without])."""

from __future__ import annotations

import pytest

from prefetch_offload.recompute_trims import (
    CEILING,
    TRIMS_SLACK,
    TrimsVerdict,
    ceiling_of,
    trims_verdict_of,
)

MB = 1 << 20


@pytest.mark.parametrize(
    ("trimmed", "untrimmed", "alone", "held"),
    [
        (500, 520, 0, True),  # within the step under trims and 5% of the saved 1000
        (500, 551, 0, False),  # 1 over it
        (500, 640, 600, True),  # offload alone held more: its peak and 5%
        (500, 651, 600, False),
        (0, 100, 600, False),  # the step under trims unsampled: no verdict holds them
        (500, 0, 600, False),  # the steps without them unsampled
    ],
)
def test_trims_are_held_off_where_the_steps_without_them_hold_no_more_than_allowed(
    trimmed: int, untrimmed: int, alone: int, held: bool
) -> None:
    """The allowance: the larger of the step under trims and offload alone's profiled
    peak, and TRIMS_SLACK of the bytes a step saves (1000 MiB here)."""
    verdict = trims_verdict_of(trimmed * MB, untrimmed * MB, alone=alone * MB, saved=1000 * MB)
    assert verdict.held is held
    assert verdict.allowed == max(trimmed, alone) * MB + TRIMS_SLACK * 1000 * MB
    assert (verdict.trimmed, verdict.untrimmed) == (trimmed * MB, untrimmed * MB)


def test_the_ceiling_is_what_the_verdict_allows() -> None:
    """One trim runs where the process passes what the verdict allows, however close the
    steps without trims came to it; CEILING over the most those steps held where the step
    under trims is unknown, or where they held more than allowed (held by rank 0's word);
    no ceiling where the untrimmed peak is unknown."""
    roomy = TrimsVerdict(True, 500 * MB, 520 * MB, 600.0 * MB)
    assert ceiling_of(roomy) == 600 * MB
    tight = TrimsVerdict(True, 500 * MB, 590 * MB, 600.0 * MB)
    assert ceiling_of(tight) == 600 * MB
    over = TrimsVerdict(True, 500 * MB, 640 * MB, 600.0 * MB)  # rank 0 held them off
    assert ceiling_of(over) == int(640 * MB * (1 + CEILING))
    unknown_step = TrimsVerdict(True, 0, 520 * MB, 9e18)
    assert ceiling_of(unknown_step) == int(520 * MB * (1 + CEILING))
    assert ceiling_of(TrimsVerdict(True, 500 * MB, 0, 600.0 * MB)) is None
