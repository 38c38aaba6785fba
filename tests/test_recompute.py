"""recompute.py: the automatic keep / offload / recompute policy.

The cost model is driven with fake measurements (a clock and engine counters the
test sets); the end-to-end tests train a model under recompute="auto".
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from prefetch_offload import OffloadFallbackWarning, OffloadStats, offload_context
from prefetch_offload.recompute import AutoDecider
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


def _out(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes // 4, device="meta")


def _step(
    decider: AutoDecider,
    fake: _Fake,
    ops: list[tuple[Any, int, float]],
    *,
    step_s: float,
    forward_s: float = 1.0,
    consumed: set[Any] | None = None,
    **counters: float,
) -> dict[Any, CheckpointPolicy]:
    """One step of one block: forward decides each op; the recompute reads back what was
    stored (``consumed``: which of those it asks for; None: all)."""
    decisions = {}
    start = fake.now
    for func, nbytes, seconds in ops:
        decisions[func] = decider.decide(("Block", 0, func, 0), func, (), {}, _out(nbytes))
        fake.now += seconds
        decider.observe(("Block", 0, func, 0), func, _out(nbytes), seconds, decisions[func])
    fake.now = start + forward_s
    decider.recomputing()
    fake.now = start + step_s - 0.1
    decider.recomputing()  # the last block's recompute (block 0)
    for func, _, _ in ops:
        stored = decisions[func] is not P.PREFER_RECOMPUTE
        if stored and (consumed is None or func in consumed):
            decider.consumed(("Block", 0, func, 0))
    fake.now = start + step_s
    values = {f: getattr(fake.stats, f) + v for f, v in counters.items()}
    fake.stats = OffloadStats(**{**fake.stats.__dict__, **values})
    return decisions


_MM_S = 1.0
_OPS = [(MM, GB // 2, _MM_S), (GELU, GB // 2, 0.01), (VIEW, GB // 2, 0.0), (ADD, GB // 4, 0.01)]
_NEEDED = {MM, GELU, VIEW}
# What the recompute-all step recomputes of what the offload-all step read back.
_RECOMPUTED_S = _MM_S + 0.01


def _plan(offload_all_s: float, recompute_all_s: float, **profile: float) -> AutoDecider:
    fake = _Fake()
    decider = AutoDecider(fake.snapshot, 0, clock=fake.clock)
    warm = _step(decider, fake, _OPS, step_s=3.0)
    assert warm[MM] is P.PREFER_CPU_OFFLOAD and warm[VIEW] is P.PREFER_RECOMPUTE
    assert not decider.timing()
    first = _step(decider, fake, _OPS, step_s=offload_all_s, consumed=_NEEDED, **profile)
    assert first[MM] is P.PREFER_CPU_OFFLOAD and decider.timing()
    second = _step(decider, fake, _OPS, step_s=recompute_all_s)
    assert set(second.values()) == {P.PREFER_RECOMPUTE} and decider.profiling
    assert decider.plan().plans_made == 0
    decider.decisions = _step(decider, fake, _OPS, step_s=3.0)  # type: ignore[attr-defined]
    assert decider.plan().plans_made == 1 and not decider.profiling
    return decider


def test_a_slow_link_recomputes_what_is_cheap_per_byte_and_offloads_the_rest() -> None:
    # Forward stalled 1 s on writes of 1.25 GB; reads took 4 s for as many bytes; the
    # step that stored everything took 3 s, the one that recomputed everything 2.5 s.
    decider = _plan(
        3.0,
        2.5,
        bytes_offloaded=1.25 * GB,
        pack_wait_seconds=1.0,
        bytes_read=1.25 * GB,
        read_seconds=4.0,
    )
    decisions = decider.decisions  # type: ignore[attr-defined]
    assert decisions[GELU] is P.PREFER_RECOMPUTE  # 0.01 s for 0.5 GB
    assert decisions[MM] is P.PREFER_CPU_OFFLOAD  # 1 s: more than moving its bytes costs
    assert decisions[VIEW] is P.PREFER_RECOMPUTE  # aliases its input
    assert decisions[ADD] is P.PREFER_RECOMPUTE  # the recompute never asked for it
    measured = decider.plan().measured
    # Moving cost 3 - (2.5 - 1.01) = 1.51 s, 1 s of it the forward stall: 0.41 s/GB.
    assert measured["move_s_per_GB"] == pytest.approx(0.51 / 1.25)
    assert measured["forward_stall_s"] == 1.0


def test_moving_that_costs_the_step_time_without_any_stall_is_counted() -> None:
    """No stall was seen, but the step that stored everything was slower than the one
    that recomputed everything by more than the recompute: the difference is the move's
    (IO threads sharing the cores, page faults), and the cheap ops are recomputed."""
    decider = _plan(4.0, 2.5, bytes_offloaded=1.25 * GB, bytes_read=1.25 * GB, read_seconds=0.1)
    decisions = decider.decisions  # type: ignore[attr-defined]
    assert decisions[GELU] is P.PREFER_RECOMPUTE
    assert decider.plan().measured["move_s_per_GB"] == pytest.approx(2.51 / 1.25)


def test_a_fast_link_offloads_everything_the_recompute_needs() -> None:
    # Storing was free: the recompute-all step was slower by exactly its recompute.
    decider = _plan(
        2.0, 2.0 + _RECOMPUTED_S, bytes_offloaded=1.25 * GB, bytes_read=1.25 * GB, read_seconds=0.1
    )
    decisions = decider.decisions  # type: ignore[attr-defined]
    assert decisions[GELU] is P.PREFER_CPU_OFFLOAD
    assert decisions[MM] is P.PREFER_CPU_OFFLOAD
    assert decisions[ADD] is P.PREFER_RECOMPUTE  # never needed: free either way


def test_the_plan_says_what_and_why() -> None:
    decider = _plan(3.0, 2.5, bytes_offloaded=GB, pack_wait_seconds=1.0)
    text = str(decider.plan())
    assert "aten.gelu.default" in text and "recompute is cheaper than moving" in text
    assert "aliases another tensor" in text and "never needed by the recompute" in text
    assert decider.plan().measured["moved_MiB"] > 900


def _grads(model: nn.Module, steps: int, seq: int | list[int] = 16) -> list[list[torch.Tensor]]:
    out = []
    for step in range(steps):
        length = seq[step] if isinstance(seq, list) else seq
        tokens, targets = make_batch(2, length, vocab=64, seed=step)
        model.zero_grad(set_to_none=True)
        model(tokens, targets).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def _model(depth: int = 4) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(vocab=64, width=32, depth=depth, heads=2)


@pytest.mark.parametrize("target", ["disk", "cpu"])
def test_auto_is_bit_identical_and_plans_once(tmp_path: Path, target: str) -> None:
    warm_up_unary_ops()
    lengths = [16, 16, 16, 12, 16, 20]  # another length is the same structure: no new plan
    ref = _grads(_model(), 6, lengths)
    model = _model()
    with offload_context(
        target,
        str(tmp_path) if target == "disk" else None,
        model=model,
        recompute="auto",
        min_offload_bytes=0,
    ) as engine:
        got = _grads(model, 6, lengths)
        plan = engine.recompute_plan()
        stats = engine.stats()
    assert all(
        torch.equal(a, b)
        for ga, gb in zip(ref, got, strict=True)
        for a, b in zip(ga, gb, strict=True)
    )
    assert plan is not None and plan.mode == "auto" and plan.plans_made == 1
    assert plan.bytes_recomputed > 0
    choices = {d.op: d.choice for d in plan.ops}
    assert choices["aten.view.default"] == "recompute"
    assert stats.step_bytes_recomputed > 0
    assert stats.step_bytes_offloaded + stats.step_bytes_recomputed > 0


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

    extras = [False, False, False, True, True, False, True, False]
    ref = steps(ref_model, extras)
    with offload_context(
        "disk", str(tmp_path), model=model, recompute="auto", min_offload_bytes=0
    ) as engine:
        got = steps(model, extras)
        plan = engine.recompute_plan()
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert plan is not None and plan.plans_made == 2  # the first, and the one with sigmoid


def test_a_budget_no_plan_can_reach_warns_once(tmp_path: Path) -> None:
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with offload_context(
            "disk", str(tmp_path), model=model, recompute="auto", device_budget=1024
        ):
            _grads(model, 5)
    hits = [w for w in caught if issubclass(w.category, OffloadFallbackWarning)]
    assert len(hits) == 1 and "smallest reachable" in str(hits[0].message)
