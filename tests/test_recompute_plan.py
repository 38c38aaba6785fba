"""recompute_plan.py: the printable plan per op kind, as the automatic policy summarizes
it (the recorder of a user's policy is tested through offload_context in
test_checkpointing.py and test_recompute_patterns.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy as P

from prefetch_offload.checkpointing import op_kind
from prefetch_offload.recompute_plan import summarize
from prefetch_offload.recompute_profile import OpObs

MM = torch.ops.aten.mm.default
ADD = torch.ops.aten.add.Tensor
MM0, MM1, ADD0 = ("Block", MM, 0), ("Block", MM, 1), ("Block", ADD, 0)


def _profiled() -> tuple[dict, dict, dict]:
    obs = {
        MM0: OpObs(MM, nbytes=100, calls=2, seconds=[0.1, 0.3]),
        MM1: OpObs(MM, nbytes=300, calls=2, seconds=[0.2]),
        ADD0: OpObs(ADD, nbytes=50, calls=2, seconds=[0.01]),
    }
    plan = {MM0: P.PREFER_CPU_OFFLOAD, MM1: P.PREFER_RECOMPUTE, ADD0: P.PREFER_RECOMPUTE}
    reasons = {
        MM0: ("moving is cheaper than recompute", 0.4, 0.1),
        MM1: ("recompute is cheaper than moving", 0.4, 0.5),
        ADD0: ("recompute is cheaper than moving", 0.02, 0.3),
    }
    return obs, plan, reasons


def test_a_row_per_op_kind_over_the_blocks_still_checkpointed() -> None:
    """Half the profiled bytes in checkpointed blocks: each row's bytes and seconds are
    half the profile's, its choice "mixed" where its positions differ, its reasons
    joined; the totals count each choice."""
    obs, plan, reasons = _profiled()
    got = summarize(obs, plan, reasons, 0.5, {"step_saved_MiB": 1.0}, 2)
    rows = {d.op: d for d in got.ops}
    mm, add = rows[op_kind(MM)], rows[op_kind(ADD)]
    assert (mm.choice, mm.bytes_per_step, mm.positions) == ("mixed", 200, 2)
    assert mm.seconds_per_step == pytest.approx((0.2 * 2 + 0.2 * 2) * 0.5)
    assert mm.move_seconds_per_step == pytest.approx(0.6)
    assert mm.reason == "moving is cheaper than recompute; recompute is cheaper than moving"
    assert (add.choice, add.bytes_per_step) == ("recompute", 25)
    assert (got.bytes_offloaded, got.bytes_recomputed, got.bytes_kept) == (50, 175, 0)
    assert got.plans_made == 2 and got.measured == {"step_saved_MiB": 1.0}
    assert "mixed" in str(got) and "aten.mm" in str(got)


def test_with_no_block_checkpointed_every_row_is_whole_at_every_blocks_bytes() -> None:
    """Every block whole within the budget: what autograd saves goes to the engine, every
    block's bytes, and the reason says the budget keeps them; under offload alone the
    profile's reason stands."""
    obs, plan, reasons = _profiled()
    kept = summarize(obs, plan, reasons, 0.0, {}, 1)
    assert {d.choice for d in kept.ops} == {"whole"}
    assert {d.op: d.bytes_per_step for d in kept.ops} == {op_kind(MM): 400, op_kind(ADD): 50}
    assert {d.reason for d in kept.ops} == {"every block whole: device_budget keeps what they save"}
    assert kept.bytes_offloaded == kept.bytes_recomputed == 0
    alone = summarize(obs, plan, reasons, 0.0, {"offload_alone": 1.0}, 1)
    assert {d.op: d.reason for d in alone.ops}[op_kind(ADD)] == "recompute is cheaper than moving"
