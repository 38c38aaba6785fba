"""The automatic policy's fake-clock harness: AutoDecider driven step by step by the test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from prefetch_offload import OffloadStats, recompute
from prefetch_offload.blocks import SELECTIVE, WHOLE
from prefetch_offload.recompute import AutoDecider
from prefetch_offload.recompute_profile import (
    OFFLOAD_ALL,
    PROFILE,
    RECOMPUTE_ALL,
    WHOLE_ALL,
    WHOLE_TIMED,
    Profile,
)

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

    def add(self, **counters: float) -> None:
        values = {f: getattr(self.stats, f) + v for f, v in counters.items()}
        self.stats = OffloadStats(**{**self.stats.__dict__, **values})


def _out(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes // 4, device="meta")


def _step(
    decider: AutoDecider,
    fake: _Fake,
    ops: list[tuple[Any, int, float]],
    *,
    step_s: float,
    forward_s: float = 1.0,
    blocks: int = 1,
    saved: int = 0,
    consumed: set[Any] | None = None,
    slow: int | None = None,
    dispatch_s: float = 0.0,
    block_s: list[float] | None = None,
    **counters: float,
) -> dict[Any, CheckpointPolicy]:
    """One step through ``blocks`` blocks, each taking ``forward_s`` forward and
    ``step_s - forward_s`` backward, as the wrapper and the dispatch modes report it: a
    selective block decides each op, and its recompute reads back what was stored
    (``consumed``: which of those it asks for; None: all); a whole block hands
    ``saved`` bytes to the engine; block ``slow`` takes a second longer forward; the
    modes report ``dispatch_s`` of their own per selective block; ``block_s``, if given,
    is each block's own ``step_s``."""
    decisions = {}
    modes = []
    for b in range(blocks):
        mode = decider.mode("Block", b)
        modes.append(mode)
        start = fake.now
        decider.entered("Block", b)
        if mode == SELECTIVE:
            for func, nbytes, seconds in ops:
                key = ("Block", b, func, 0)
                decisions[func] = decider.decide(key, func, (), {}, _out(nbytes))
                if decider.timing():
                    decider.observe(key, func, _out(nbytes), seconds, decisions[func])
            decider.dispatched(("Block", b), dispatch_s)
        elif mode == WHOLE:
            fake.add(device_tier_bytes=saved)
        fake.now = start + forward_s + (1.0 if b == slow else 0.0)
        decider.exited("Block", b)
    for b in reversed(range(blocks)):
        start = fake.now
        decider.backward("Block", b)
        if modes[b] == SELECTIVE:
            decider.recomputing()
            for func, _, _ in ops:
                stored = decisions[func] is not P.PREFER_RECOMPUTE
                if stored and (consumed is None or func in consumed):
                    decider.consumed(("Block", b, func, 0))
        fake.now = start + (step_s if block_s is None else block_s[b]) - forward_s
    fake.add(**counters)
    return decisions


_MM_S = 1.0
_OPS = [(MM, GB // 2, _MM_S), (GELU, GB // 2, 0.01), (VIEW, GB // 2, 0.0), (ADD, GB // 4, 0.01)]
_NEEDED = {MM, GELU, VIEW}
# What the recompute-all step recomputes of what the offload-all step read back.
_RECOMPUTED_S = _MM_S + 0.01


def _plan(
    offload_all_s: float,
    recompute_all_s: float,
    *,
    blocks: int = 1,
    budget: int = 0,
    saved: int = 0,
    dispatch_s: float = 0.0,
    whole_s: float = 10.0,
    ops: list[tuple[Any, int, float]] = _OPS,
    checkpoint_stats: Any = None,
    trim_heap: Callable[[], None] = lambda: None,
    hold_trims: Callable[[bool, int | None], None] | None = None,
    trims_held: Callable[[], bool] | None = None,
    peaks: Any = None,
    agreement: Any = None,
    whole_moved: int = 0,
    **profile: float,
) -> AutoDecider:
    """The profiling steps (NOTE [keep, offload, recompute]), each block's share of
    the given step times (``whole_s``: the steps with every block whole again; the last
    recompute-all step and the last whole one take 1.2 times as long), then the first
    planned step (``decider.decisions``); the modes report ``dispatch_s`` of their own
    per block in the recompute-all steps, and the whole steps after them move
    ``whole_moved`` bytes."""
    fake = _Fake()
    decider = AutoDecider(
        fake.snapshot,
        budget,
        clock=fake.clock,
        checkpoint_stats=checkpoint_stats,
        trim_heap=trim_heap,
        hold_trims=hold_trims,
        trims_held=trims_held,
        peaks=peaks,
        agreement=agreement,
    )
    per = {"blocks": blocks, "forward_s": 1.0 / blocks}
    whole = _step(decider, fake, ops, step_s=3.0 / blocks, saved=saved, **per)  # type: ignore[arg-type]
    assert not whole and not decider.timing()  # every block whole: no op seen
    first = _step(
        decider, fake, ops, step_s=offload_all_s / blocks, consumed=_NEEDED, **per, **profile
    )  # type: ignore[arg-type]
    assert first[MM] is P.PREFER_CPU_OFFLOAD and first[VIEW] is P.PREFER_RECOMPUTE
    kinds = PROFILE
    counted = Profile.counted(RECOMPUTE_ALL)
    for i, kind in enumerate(kinds[2:], start=2):
        slower = 1.2 if kind not in kinds[i + 1 :] else 1.0
        if kind == RECOMPUTE_ALL:
            step_s = slower * recompute_all_s / blocks
            got = _step(decider, fake, ops, step_s=step_s, dispatch_s=dispatch_s, **per)  # type: ignore[arg-type]
            assert set(got.values()) == {P.PREFER_RECOMPUTE}
            assert decider.timing() == (i not in counted)  # a counted step runs untimed
        else:
            step_s = slower * whole_s / blocks
            got = _step(
                decider, fake, ops, step_s=step_s, saved=saved, bytes_offloaded=whole_moved, **per
            )  # type: ignore[arg-type]
            assert not got and not decider.timing()  # every block whole
        assert decider.profiling
    assert decider.plan().plans_made == 0
    decider.decisions = _step(decider, fake, ops, step_s=3.0 / blocks, **per)  # type: ignore[arg-type, attr-defined]
    assert decider.plan().plans_made == 1 and not decider.profiling
    decider.fake = fake  # type: ignore[attr-defined]  # for the steps a test adds
    return decider


_SLOW_LINK = {
    "bytes_offloaded": 1.25 * GB,
    "pack_wait_seconds": 1.0,
    "bytes_read": 1.25 * GB,
    "read_seconds": 4.0,
}


@pytest.fixture
def no_interleave(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offload alone's own plan where it wins the profile, not the plan that interleaves
    whole blocks with plain ones, tried in its place (NOTE [interleaved blocks])."""
    monkeypatch.setattr(recompute, "INTERLEAVE", False)


class _Peaks:
    """Scripted memory peaks (NOTE [plans within the noise]): the n-th take() reports the
    n-th step (the first step's start is not seen), by its kind; planned steps
    ``planned``."""

    def __init__(self, by_kind: dict[int, int], planned: int | list[int] = 0) -> None:
        self.by_kind, self.planned = by_kind, planned
        self.calls, self.running = 0, False

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False

    def take(self) -> int:
        step, self.calls = self.calls, self.calls + 1
        profile = PROFILE
        if step < len(profile):
            return self.by_kind[profile[step]]
        if isinstance(self.planned, list):  # (one per planned step)
            return self.planned[step - len(profile)]
        return self.planned


_LEAN_PLAIN = {WHOLE_ALL: 300 << 20, OFFLOAD_ALL: 250 << 20}
_LEAN_PLAIN |= {RECOMPUTE_ALL: 100 << 20, WHOLE_TIMED: 200 << 20}


def _profile_rest(run: Any, whole_s: list[float], whole_moved: int = 0) -> None:
    """The profile's steps after the offload-all one: every output recomputed in 1.5 s,
    every block whole in ``whole_s``, moving ``whole_moved`` bytes."""
    for kind in PROFILE[2:]:
        if kind == RECOMPUTE_ALL:
            run(step_s=1.5)  # every output recomputed
        else:  # every block whole again
            run(step_s=0.0, block_s=whole_s, bytes_offloaded=whole_moved)


def _planned_steps(decider: AutoDecider, walls: list[float], blocks: int) -> list[str]:
    """Planned steps of the given walls (each block's share), then the modes of the
    next step's blocks."""
    for wall in walls:
        _step(decider, decider.fake, _OPS, step_s=wall / blocks, blocks=blocks)  # type: ignore[attr-defined]
    return [decider.mode("Block", b) for b in range(blocks)]


_MiB = 1 << 20


_CHEAP = [(MM, GB // 2, 0.01), (GELU, GB // 2, 0.01), (VIEW, GB // 2, 0.0)]
