"""What the automatic policy's profiling steps measured (NOTE [keep, offload, recompute]
in recompute.py): per op position its output bytes and seconds, per step and block the
block's span, per step its time, peak and bytes moved, and the engine's counters around
the offload-all step; and the medians and bests the plan is made from."""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .checkpointing import OpKey, output_bytes
from .recompute_plan import Position
from .stats import OffloadStats

__all__ = [
    "INPUTS_STEP",
    "OFFLOAD_ALL",
    "OFFLOAD_ALL_STEP",
    "PLANNED",
    "PROFILE",
    "RECOMPUTE_ALL",
    "WHOLE_ALL",
    "WHOLE_ALL_STEP",
    "WHOLE_TIMED",
    "OpObs",
    "Outside",
    "Profile",
    "Span",
    "copied",
    "live_bytes",
    "most",
]

Block = tuple[str, int]


@dataclass
class OpObs:
    """One op position's measurements over the profiling steps."""

    func: Any
    nbytes: int = 0  # output bytes over the offload-all step (every block)
    calls: int = 0  # calls in the offload-all step (one per block)
    seconds: list[float] = dataclasses.field(default_factory=list)  # per call, both steps
    consumed: int = 0
    # "alias" or "random": recomputed whatever the cost; "generator": stored whatever it is
    fixed: str | None = None

    @property
    def total_s(self) -> float:
        """Compute seconds over a step: the median call, as often as the step calls it."""
        return statistics.median(self.seconds) * self.calls if self.seconds else 0.0


@dataclass
class Span:
    """One block's forward in a step (its seconds, summed over its calls where the model
    calls it more than once; the last call's start and end), when backward reached it,
    and (whole-block step) the bytes its calls handed to the engine; how many calls
    returned. A call that never returned (its forward raised) counts nothing."""

    start: float = 0.0
    end: float = 0.0
    forward: float = 0.0
    grad: float | None = None
    saved: int = 0
    live: int = 0  # the engine's live bytes when the call now running began
    calls: int = 0

    def per_call(self, nbytes: int) -> int:
        """``nbytes`` summed over this block's calls, per call: what one call's
        recompute holds, where a model calls the block more than once a step."""
        return nbytes // max(self.calls, 1)


@dataclass
class Outside:
    """NOTE [keep, offload, recompute]: in the whole step, the engine's live bytes as
    its first block call began, and its packed bytes as the last block call returned
    and as backward reached a block (None: not yet)."""

    live: int
    exited: int = 0
    backward: int | None = None

    @property
    def nbytes(self) -> int:
        """The bytes saved outside the blocks: live before the first, packed after the
        last (none where backward never came)."""
        after = 0 if self.backward is None else max(self.backward - self.exited, 0)
        return self.live + after


# The kinds of profiling step, then the plan (NOTE [keep, offload, recompute] in recompute.py).
WHOLE_ALL, OFFLOAD_ALL, RECOMPUTE_ALL, WHOLE_TIMED, PLANNED = range(5)
# The profiling steps in order (NOTE [keep, offload, recompute]): the two kinds whose
# times the plan compares each run twice after a step of their own kind, at the same
# mean position, and the faster of each kind's two counts.
PROFILE = (
    WHOLE_ALL,
    OFFLOAD_ALL,
    RECOMPUTE_ALL,
    RECOMPUTE_ALL,
    WHOLE_TIMED,
    WHOLE_TIMED,
    WHOLE_TIMED,
    RECOMPUTE_ALL,
    RECOMPUTE_ALL,
)
WHOLE_ALL_STEP = PROFILE.index(WHOLE_ALL)
OFFLOAD_ALL_STEP = PROFILE.index(OFFLOAD_ALL)
# The step whose checkpointed blocks hand the engine their inputs alone (NOTE [keep,
# offload, recompute]: what a block the budget does not keep takes of it).
INPUTS_STEP = PROFILE.index(RECOMPUTE_ALL)


def copied(obs: dict[Position, OpObs]) -> dict[Position, OpObs]:
    """The measurements, each a copy of its own (NOTE [abandoned forwards] in
    recompute.py)."""
    return {pos: dataclasses.replace(o, seconds=list(o.seconds)) for pos, o in obs.items()}


def most(peaks: list[int]) -> int:
    """The most of sampled peaks; 0 (unknown) if there are none or one is unknown."""
    return 0 if not peaks or 0 in peaks else max(peaks)


def live_bytes(s: OffloadStats) -> int:
    """The bytes the engine's tiers hold now."""
    return s.device_tier_bytes + s.host_tier_bytes + s.disk_tier_bytes


class Profile:
    """One profile's measurements, step by step (steps numbered by their index in
    PROFILE, kinds as PROFILE names them). The decider tells it each block call, op and
    step end of a profiling step; :func:`~prefetch_offload.recompute_planner.make_plan`
    reads it.

    Args:
        stats: the engine's counters now.
        clock: time source (tests pass a fake one).
    """

    def __init__(self, stats: Callable[[], OffloadStats], clock: Callable[[], float]) -> None:
        self._stats = stats
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Forget every step (a new profile, or a plan made)."""
        self.obs: dict[Position, OpObs] = {}
        # Positions recomputed whatever they cost, "alias" or "random" (the decider sees
        # the arguments that tell an attention kernel's dropout_p), or stored whatever
        # they cost, "generator" (NOTE [random ops] in checkpointing.py).
        self.fixed: dict[Position, str] = {}
        # Per step: each block's span, and the step's end (the next one's start).
        self.spans: dict[int, dict[Block, Span]] = {}
        self.ends: dict[int, float] = {}
        # Per step: its time, the most memory it held (0: unknown) and the bytes it moved
        # (NOTE [plans within the noise] in recompute_planner.py).
        self.walls: dict[int, float] = {}
        self.peaks: dict[int, int] = {}
        self.moved: dict[int, int] = {}
        # Per step and block: seconds in the dispatch modes beyond the ops (forward and
        # recompute; NOTE [dispatch cost] in checkpointing.py).
        self.dispatch: dict[int, collections.Counter[Block]] = {}
        self.block_bytes: collections.Counter[Block] = collections.Counter()
        self.outside: Outside | None = None  # (None: not measured)
        # The engine's counters at the end of the whole step and of the offload-all one.
        self.s0: OffloadStats | None = None
        self.s1: OffloadStats | None = None
        # NOTE [abandoned forwards] in recompute.py: what the op-timing steps measured
        # before the step now began.
        self._before: tuple[dict[Position, OpObs], collections.Counter[Block], dict[Any, str]]
        self._before = ({}, collections.Counter(), {})

    # -- what a profiling step reports --------------------------------------------------------

    def entered(self, step: int, key: Block) -> None:
        """A call of block ``key`` began in profiling step ``step``."""
        spans = self.spans.setdefault(step, {})
        span = spans.setdefault(key, Span())
        kind = PROFILE[step]
        if kind == WHOLE_ALL or step == INPUTS_STEP:
            span.live = live_bytes(self._stats())  # (every call's: a shared block's)
            if kind == WHOLE_ALL and len(spans) == 1 and not span.calls:
                self.outside = Outside(span.live)  # the step's first block call
        span.start = self._clock()

    def exited(self, step: int, key: Block) -> None:
        """A call of block ``key`` returned in profiling step ``step``."""
        span = self.spans.get(step, {}).get(key)
        if span is None:
            return
        span.end = self._clock()
        span.forward += span.end - span.start
        span.calls += 1
        kind = PROFILE[step]
        if kind == WHOLE_ALL or step == INPUTS_STEP:
            stats = self._stats()
            span.saved += live_bytes(stats) - span.live
            if kind == WHOLE_ALL and self.outside:
                self.outside.exited = stats.bytes_packed  # (until the last block's)

    def reached(self, step: int, key: Block) -> None:
        """Backward reached block ``key`` in profiling step ``step``."""
        span = self.spans.get(step, {}).get(key)
        if span is not None and span.grad is None:
            span.grad = self._clock()
        outside = self.outside
        if PROFILE[step] == WHOLE_ALL and outside and outside.backward is None:
            outside.backward = self._stats().bytes_packed

    def observed(self, step: int, key: OpKey, func: Any, out: Any, seconds: float) -> None:
        """An op (``key``: its block and position) ran in ``seconds``, in an offload-all
        or recompute-all step."""
        pos: Position = (key[0], func, key[3])
        obs = self.obs.get(pos)
        if obs is None:
            obs = self.obs[pos] = OpObs(func)
        obs.seconds.append(seconds)
        if PROFILE[step] == OFFLOAD_ALL:
            nbytes = output_bytes(out)
            obs.fixed = self.fixed.get(pos)
            obs.nbytes += nbytes
            obs.calls += 1
            self.block_bytes[(key[0], key[1])] += nbytes

    def consumed(self, key: OpKey) -> None:
        """The recompute of an offload-all step read an op's stored output back."""
        obs = self.obs.get((key[0], key[2], key[3]))
        if obs is not None:
            obs.consumed += 1

    def dispatched(self, step: int, block: Block, seconds: float) -> None:
        """The dispatch modes spent ``seconds`` beyond the ops of ``block``."""
        self.dispatch.setdefault(step, collections.Counter())[block] += seconds

    def step_ended(self, step: int, now: float, wall: float, peak: int, moved: int) -> None:
        """Profiling step ``step`` ended at ``now``, having taken ``wall`` seconds, held
        ``peak`` bytes at most (0: unknown) and moved ``moved``; the next one begins."""
        self.ends[step] = now
        self.walls[step] = wall
        self.peaks[step] = peak
        self.moved[step] = moved
        if PROFILE[step] == WHOLE_ALL:
            self.s0 = self._stats()
        elif PROFILE[step] == OFFLOAD_ALL:
            self.s1 = self._stats()
        self._before = (copied(self.obs), collections.Counter(self.block_bytes), dict(self.fixed))

    def forget(self, step: int) -> None:
        """Profiling step ``step`` had a forward abandoned (NOTE [abandoned forwards] in
        recompute.py): what it measured goes, and a step of its kind runs again."""
        obs, block_bytes, fixed = self._before
        self.obs, self.block_bytes, self.fixed = (
            copied(obs),
            collections.Counter(block_bytes),
            dict(fixed),
        )
        self.spans.pop(step, None)
        self.dispatch.pop(step, None)
        if PROFILE[step] == WHOLE_ALL:
            self.outside = None
        if PROFILE[step] == OFFLOAD_ALL:  # its moves count from the step that runs again
            self.s0 = self._stats()

    # -- what the plan reads ------------------------------------------------------------------

    @staticmethod
    def steps(kind: int) -> list[int]:
        """The profiling steps of a kind (their indices in PROFILE)."""
        return [i for i, k in enumerate(PROFILE) if k == kind]

    @staticmethod
    def counted(kind: int) -> list[int]:
        """The profiling steps of a kind that follow a step of the same kind: the ones the
        plan compares (NOTE [keep, offload, recompute] in recompute.py)."""
        return [i for i, k in enumerate(PROFILE) if k == kind and i and PROFILE[i - 1] == k]

    def block_times(self, kind: int, keys: set[Block] | None = None) -> tuple[float, float, int]:
        """The median block's forward and backward seconds in the profiling step of a
        kind (of its counted steps, the one whose median block took least), and the
        blocks it ran; the median over ``keys`` only, where given and any ran."""
        steps = self.counted(kind) or self.steps(kind)  # (the offload-all step: once)
        times = [self.step_block_times(i, keys) for i in steps]
        return min(times, key=lambda t: t[0] + t[1])

    def step_block_times(
        self, step: int, keys: set[Block] | None = None
    ) -> tuple[float, float, int]:
        """The median block's forward and backward seconds in one profiling step (over
        ``keys``, where given and any ran), and the blocks the step ran. A block's
        backward runs from backward reaching its output to backward reaching the block
        before it (the first block: to the next step)."""
        spans = sorted(self.spans.get(step, {}).items(), key=lambda kv: kv[0][1])
        if keys is not None and not keys.intersection(key for key, _ in spans):
            keys = None
        fwd, bwd = [], []
        later = self.ends.get(step, 0.0)
        for key, s in spans:  # by index: the block before ends this one's backward
            counted = keys is None or key in keys
            if s.end and counted:
                fwd.append(s.forward)
            if s.grad is not None:
                if later >= s.grad and counted:
                    bwd.append(later - s.grad)
                later = s.grad
        med = statistics.median
        return (med(fwd) if fwd else 0.0), (med(bwd) if bwd else 0.0), len(spans)

    def wall(self, kind: int) -> float:
        """The shorter of the counted profiling steps of a kind (NOTE [trial steps] in
        recompute.py)."""
        walls = [self.walls[i] for i in self.counted(kind) if i in self.walls]
        return min(walls) if walls else math.inf

    def peak(self, kind: int) -> int:
        """The most memory the counted profiling steps of a kind held (NOTE [plans within
        the noise] in recompute_planner.py); 0 if unknown."""
        return most([self.peaks.get(i, 0) for i in self.counted(kind)])

    def moved_by_kind(self, kind: int) -> int:
        """The most bytes a counted profiling step of a kind moved (NOTE [plans within the
        noise] in recompute_planner.py)."""
        return max((self.moved.get(i, 0) for i in self.counted(kind)), default=0)

    def step_saved(self) -> int:
        """The bytes the blocks saved in the whole step (NOTE [trims a plan does without]
        in recompute_trims.py)."""
        whole_step = self.spans.get(WHOLE_ALL_STEP, {}).values()
        return sum(span.saved for span in whole_step if span.saved > 0)

    def outputs_per_call(self) -> dict[Block, int]:
        """Each block's op output bytes in the offload-all step, per call of the block."""
        stored = self.spans.get(OFFLOAD_ALL_STEP, {})
        return {
            key: stored[key].per_call(nbytes) if key in stored else nbytes
            for key, nbytes in self.block_bytes.items()
        }

    def recompute_hold(self) -> int:
        """What one block's recompute holds at once: what the largest block saves for
        backward (the whole-block step), else (nothing reached the engine's tiers) its
        op outputs; one call's, where the model calls a block more than once a step."""
        whole = self.spans.get(WHOLE_ALL_STEP, {})
        saved = [s.per_call(s.saved) for s in whole.values() if s.saved > 0]
        if saved:
            return max(saved)
        return max(self.outputs_per_call().values(), default=0)
