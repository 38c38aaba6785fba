"""What a recompute policy decided: per op kind, the bytes recomputed, offloaded and kept
over a step, why, and the figures an automatic plan measured (``str(plan)`` is the table a
user reads); and the recorder of a user's policy's choices."""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch.utils.checkpoint import CheckpointPolicy

from .checkpointing import OFFLOAD, RECOMPUTE, OpKey, PolicyDecider, op_kind, output_bytes
from .heap import CEILING_STEPS

__all__ = [
    "ALONE",
    "OpDecision",
    "OpMeasured",
    "Position",
    "RecomputePlan",
    "RecordingDecider",
    "StepDecider",
    "choice_name",
    "summarize",
]

_MiB = 1 << 20
# An op position: (block class, op overload, count in the block).
Position = tuple[str, Any, int]
# The name the printed plan and the weighings give offload alone (every block whole).
ALONE = "offload alone"


class OpMeasured(Protocol):
    """What a summary reads of one op position's measurements (the profile's ``OpObs``):
    its output bytes over a step, and its compute seconds over a step."""

    nbytes: int

    @property
    def total_s(self) -> float: ...


@dataclass(frozen=True)
class OpDecision:
    """What was decided for one op kind, over a step (all blocks, all positions)."""

    # The op overload, e.g. "aten.mm.default".
    op: str
    # "recompute", "offload", "keep" (saved in device memory), "mixed", or "whole" (no
    # block is checkpointed: autograd saves it, and the engine keeps or moves it).
    choice: str
    # Output bytes per step, of the checkpointed blocks (of every block where the choice
    # is "whole"), and positions (one per op call in a block class).
    bytes_per_step: int
    positions: int
    # Measured forward seconds per step (None: not timed, e.g. a user's policy).
    seconds_per_step: float | None = None
    # Seconds per step moving these bytes would cost by the model (None: not modelled).
    move_seconds_per_step: float | None = None
    # Why, in words.
    reason: str = ""


@dataclass(frozen=True)
class RecomputePlan:
    """The keep / offload / recompute decisions per op kind, and the measurements.

    ``str(plan)`` is a table a user can read.
    """

    # "auto", "policy" (a user's callable) or "full".
    mode: str
    ops: tuple[OpDecision, ...] = ()
    # Bytes per step recomputed, offloaded (handed to the engine) and kept by the policy,
    # of the op outputs in checkpointed blocks (a whole block's the engine keeps or moves).
    bytes_recomputed: int = 0
    bytes_offloaded: int = 0
    bytes_kept: int = 0
    # The measurements the automatic plan used (NOTE [keep, offload, recompute] in recompute.py).
    measured: dict[str, float] = dataclasses.field(default_factory=dict)
    # Times the automatic plan was made (a profiling step each).
    plans_made: int = 0

    def __str__(self) -> str:
        lines = [
            f"prefetch_offload recompute plan ({self.mode}): per step, of the op outputs in "
            f"checkpointed blocks: {self.bytes_recomputed / _MiB:.1f} MiB recomputed, "
            f"{self.bytes_offloaded / _MiB:.1f} MiB offloaded, "
            f"{self.bytes_kept / _MiB:.1f} MiB kept"
        ]
        m = self.measured
        if m.get("offload_alone"):
            lines.append(
                f"  blocks: all {m['blocks_whole']:.0f} whole: offload alone measured "
                f"{m['wall_alone_s']:.3f} s a step{_peak_text(m, 'peak_alone_MiB')}, "
                f"plain checkpointing {m['wall_plain_s']:.3f} s"
                f"{_peak_text(m, 'peak_plain_MiB')}"
            )
        elif "blocks_whole" in m:
            whole = ""
            if m.get("blocks_interleaved"):
                kept = m["blocks_whole"] - m["blocks_interleaved"]
                whole = (
                    f" ({kept:.0f} within device_budget, {m['blocks_interleaved']:.0f} "
                    "between the plain ones, the engine moving what they save)"
                )
            elif not m.get("trial_choice") and m["blocks_whole"]:
                whole = " (within device_budget)"
            lines.append(
                f"  blocks: {m['blocks_whole']:.0f} whole{whole}, "
                f"{m['blocks_plain']:.0f} checkpointed plainly, "
                f"{m['blocks_selective']:.0f} selectively (the ops below)"
            )
            if "trial_step_s" not in m and math.isfinite(m.get("wall_alone_s", math.inf)):
                lines.append(
                    f"  weighed: plain checkpointing {m['wall_plain_s']:.3f} s a step"
                    f"{_peak_text(m, 'peak_plain_MiB')}, offload alone "
                    f"{m['wall_alone_s']:.3f} s{_peak_text(m, 'peak_alone_MiB')}"
                )
        if "trial_step_s" in m:
            verdict = ("kept", "replaced by plain checkpointing", "replaced by offload alone")
            untrimmed = " without heap trims" if m.get("trial_untrimmed") else ""
            lines.append(
                f"  trial: the plan ran {m['trial_step_s']:.3f} s a step{untrimmed}"
                f"{_peak_text(m, 'trial_peak_MiB')}{_moved_text(m, 'trial_moved_MiB')}; "
                f"in the profile, every block checkpointed plainly {m['trial_plain_s']:.3f} s"
                f"{_peak_text(m, 'peak_plain_MiB')}{_moved_text(m, 'moved_plain_MiB')} and "
                f"offload alone {m['trial_alone_s']:.3f} s{_peak_text(m, 'peak_alone_MiB')}"
                f"{_moved_text(m, 'moved_alone_MiB')}: {verdict[int(m['trial_choice'])]}"
            )
        if m.get("weighing_plain"):  # NOTE [plain without trims] in recompute_trims.py
            lines.append(
                "  now: every block checkpointed plainly in the plan's place, for a few "
                "steps, weighed without heap trims against it"
            )
        if "untrimmed_plain_s" in m:  # NOTE [plain without trims] in recompute_trims.py
            rival = ALONE if m["rival_alone"] else "the plan's trial"
            lines.append(
                f"  without heap trims: plain checkpointing ran {m['untrimmed_plain_s']:.3f} s "
                f"a step at {m['plain_untrimmed_peak_MiB']:.0f} MiB "
                f"({m['plain_trims_peak_MiB']:.0f} MiB with them, at most "
                f"{m['plain_allowed_MiB']:.0f} MiB allowed without), "
                f"{rival} {m['rival_s']:.3f} s{_peak_text(m, 'rival_peak_MiB')}: "
                + ("plain checkpointing runs" if m["untrimmed_choice"] else "the plan runs")
            )
        if m.get("stand_in"):  # NOTE [plain without trims]: its trims came back
            then = (
                f"  then: the plan's heap passed {m['plan_ceiling_MiB']:.0f} MiB twice "
                f"within {CEILING_STEPS} steps, and with its heap trims it ran "
                f"{m['trial_trimmed_s']:.3f} s a step: plain checkpointing runs in its place"
            )
            if "stand_in_kept" in m:
                then += "; plain's heap passed its own ceiling twice too, and under heap trims " + (
                    f"plain checkpointing ({m['trial_plain_s']:.3f} s in the profile) runs on"
                    if m["stand_in_kept"]
                    else "the plan runs again"
                )
            lines.append(then)
        if "trims_held" in m:  # NOTE [trims a plan does without] in recompute_trims.py
            lines.append(
                f"  heap trims: {m['trims_peak_MiB']:.0f} MiB held with them, "
                f"{m['untrimmed_peak_MiB']:.0f} MiB without, at most "
                f"{m['trims_allowed_MiB']:.0f} MiB allowed without: " + _trims_verdict(m)
            )
        if self.measured:  # (a bandwidth with nothing moved is unmeasured: left out)
            shown = sorted(
                (k, v)
                for k, v in self.measured.items()
                if math.isfinite(v) and k != "weighing_plain"  # (the now: line says it)
            )
            lines.append("  measured: " + ", ".join(f"{k}={v:.4g}" for k, v in shown))
        lines.append(
            f"  {'op':<36} {'choice':<10} {'MiB/step':>9} {'compute s':>10} {'move s':>9}  why"
        )
        for d in sorted(self.ops, key=lambda d: -d.bytes_per_step):
            sec = "" if d.seconds_per_step is None else f"{d.seconds_per_step:.4f}"
            mov = "" if d.move_seconds_per_step is None else f"{d.move_seconds_per_step:.4f}"
            lines.append(
                f"  {d.op:<36} {d.choice:<10} {d.bytes_per_step / _MiB:>9.2f} {sec:>10} "
                f"{mov:>9}  {d.reason}"
            )
        return "\n".join(lines)


def choice_name(policy: CheckpointPolicy) -> str:
    if policy in RECOMPUTE:
        return "recompute"
    if policy in OFFLOAD:
        return "offload"
    return "keep"


class StepDecider(Protocol):
    """What the engine asks of the decider behind ``recompute=`` at its hooks: a
    :class:`RecordingDecider` (a policy's) or ``recompute.AutoDecider``."""

    def plan(self) -> RecomputePlan:
        """What was decided, per op kind."""
        ...

    def trim_basis(self, moved: int) -> int:
        """The bytes the heap trim bound follows in the step that begins now, the step
        that ended having moved ``moved`` (NOTE [heap trim] in heap.py)."""
        ...

    def close(self) -> None:
        """The context exits: stop any thread of its own."""
        ...


class RecordingDecider:
    """Keeps, per op kind, the bytes of each choice of users' policies in the last step.

    :meth:`for_policy` gives the decider for one policy; all of them record here.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._lock = threading.Lock()
        self._bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self._last: collections.Counter[tuple[str, str]] = collections.Counter()
        self._positions: dict[str, set[Position]] = collections.defaultdict(set)
        self._recomputed = False

    def for_policy(self, policy: Callable[..., Any]) -> _Recorded:
        """A decider that asks ``policy`` (PyTorch's signature) and records its answers."""
        return _Recorded(self, policy)

    def _record(self, key: OpKey, func: Any, policy: CheckpointPolicy, out: Any) -> None:
        kind = op_kind(func)
        with self._lock:
            if self._recomputed:  # a new step: the first forward op after a recompute
                self._recomputed = False
                self._last, self._bytes = self._bytes, collections.Counter()
            self._bytes[(kind, choice_name(policy))] += output_bytes(out)
            self._positions[kind].add((key[0], func, key[3]))

    def _overruled(self, func: Any, policy: CheckpointPolicy, out: Any) -> None:
        """The op last recorded runs again instead (NOTE [ops that write their inputs])."""
        kind, nbytes = op_kind(func), output_bytes(out)
        with self._lock:
            was = (kind, choice_name(policy))
            self._bytes[was] -= nbytes
            if self._bytes[was] <= 0:
                del self._bytes[was]
            self._bytes[(kind, "recompute")] += nbytes

    def _consumed(self) -> None:
        self._recomputed = True

    def plan(self) -> RecomputePlan:
        """The last finished step's choices per op kind."""
        with self._lock:
            source = self._bytes if self._recomputed or not self._last else self._last
            per_kind: dict[str, dict[str, int]] = collections.defaultdict(dict)
            for (kind, choice), nbytes in source.items():
                per_kind[kind][choice] = nbytes
            ops = []
            totals: collections.Counter[str] = collections.Counter()
            for kind, choices in per_kind.items():
                for choice, nbytes in choices.items():
                    totals[choice] += nbytes
                choice = next(iter(choices)) if len(choices) == 1 else "mixed"
                ops.append(
                    OpDecision(
                        kind,
                        choice,
                        sum(choices.values()),
                        len(self._positions[kind]),
                        reason="the policy's choice"
                        if choice != "mixed"
                        else ", ".join(f"{c} {b / _MiB:.1f} MiB" for c, b in choices.items()),
                    )
                )
        return RecomputePlan(
            self.mode,
            tuple(ops),
            bytes_recomputed=totals["recompute"],
            bytes_offloaded=totals["offload"],
            bytes_kept=totals["keep"],
        )

    def trim_basis(self, moved: int) -> int:
        """A policy's steps are all of one kind: the bound follows what the last moved."""
        return moved

    def close(self) -> None:
        """Nothing runs beside a policy's steps."""


class _Recorded(PolicyDecider):
    """One policy's decider, recording into a :class:`RecordingDecider`."""

    def __init__(self, recorder: RecordingDecider, policy: Callable[..., Any]) -> None:
        super().__init__(policy)
        self._recorder = recorder

    def decide(self, key: OpKey, func: Any, args: Any, kwargs: Any, out: Any) -> CheckpointPolicy:
        policy = super().decide(key, func, args, kwargs, out)
        self._recorder._record(key, func, policy, out)
        return policy

    def recomputing(self) -> None:
        self._recorder._consumed()

    def overruled(self, key: OpKey, func: Any, out: Any, policy: CheckpointPolicy) -> None:
        self._recorder._overruled(func, policy, out)


def summarize(
    obs: Mapping[Position, OpMeasured],
    plan: dict[Position, CheckpointPolicy],
    reasons: dict[Position, tuple[str, float, float]],
    share: float,
    measured: dict[str, float],
    plans_made: int,
) -> RecomputePlan:
    """The automatic plan as printed: per op kind of the profile's op measurements
    ``obs``, the choice its positions got in ``plan`` and why (``reasons``: the reason,
    compute seconds, modelled move seconds), its bytes and seconds a step over the blocks
    still checkpointed (``share`` of the profiled bytes; every block's where none is),
    and the totals; with ``measured``, the figures the plan was made from."""
    per: dict[str, list[Position]] = collections.defaultdict(list)
    for pos in obs:
        per[op_kind(pos[1])].append(pos)
    ops = []
    totals: collections.Counter[str] = collections.Counter()
    # The rows' bytes and seconds are the checkpointed blocks' share; with none
    # checkpointed, every block's (what autograd saves and the engine keeps or moves).
    row_share = share or 1.0
    for kind, positions in per.items():
        choices = {choice_name(plan[p]) for p in positions}
        nbytes = round(sum(obs[p].nbytes for p in positions) * row_share)
        for p in positions:
            totals[choice_name(plan[p])] += round(obs[p].nbytes * share)
        why = sorted({reasons[p][0] for p in positions})
        choice = choices.pop() if len(choices) == 1 else "mixed"
        if share == 0:  # no block checkpointed: what autograd saves goes to the engine
            choice = "whole"
            if not measured.get("offload_alone") and not measured.get("trial_choice"):
                why = ["every block whole: device_budget keeps what they save"]
        ops.append(
            OpDecision(
                kind,
                choice,
                nbytes,
                len(positions),
                seconds_per_step=sum(obs[p].total_s for p in positions) * row_share,
                move_seconds_per_step=sum(reasons[p][2] for p in positions),
                reason="; ".join(why),
            )
        )
    return RecomputePlan(
        "auto",
        tuple(ops),
        bytes_recomputed=totals["recompute"],
        bytes_offloaded=totals["offload"],
        bytes_kept=totals["keep"],
        measured=dict(measured),
        plans_made=plans_made,
    )


def _trims_verdict(m: dict[str, float]) -> str:
    """The printed verdict on a plan's heap trims (NOTE [trims a plan does without])."""
    ceiling = m.get("trims_ceiling_MiB", 0.0)
    if m.get("trims_released"):
        return (
            f"held off, then run again as the process passed {ceiling:.0f} MiB twice "
            f"within {CEILING_STEPS} steps"
        )
    if not m["trims_held"]:
        return "kept"
    if not ceiling:
        return "held off"
    return (
        f"held off (one trim where the process passes {ceiling:.0f} MiB; run again where "
        f"it passes it twice within {CEILING_STEPS} steps)"
    )


def _moved_text(measured: dict[str, float], key: str) -> str:
    """ ", moving N MiB" for the bytes a plan moved a step, where measured."""
    return f", moving {measured[key]:.0f} MiB" if key in measured else ""


def _peak_text(measured: dict[str, float], key: str) -> str:
    """ " at N MiB" for a sampled peak, else nothing."""
    value = measured.get(key, 0.0)
    return f" at {value:.0f} MiB" if value > 0 else ""
