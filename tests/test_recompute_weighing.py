"""recompute_weighing.py: the plan in force as a weighing rewrites it. The weighings
themselves (trial, trims' trial, plain without trims, stand-in) run through the decider's
steps in test_recompute.py."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy as P

from prefetch_offload.blocks import PLAIN, SELECTIVE, WHOLE
from prefetch_offload.recompute_planner import Weighed
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
