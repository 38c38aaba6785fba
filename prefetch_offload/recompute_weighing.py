"""What runs once the automatic plan is made, until it settles: the plan the blocks and ops
follow now, the tried plan's trial (NOTE [trial steps] in recompute.py), the trims'
trial of a plan that moves nothing, plain checkpointing weighed without trims against the
plan it may replace, and plain checkpointing standing in for a tried plan whose trims
come back (NOTE [trims a plan does without], NOTE [plain without trims] in
recompute_trims.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable

from torch.utils.checkpoint import CheckpointPolicy

from .agreement import RankAgreement
from .blocks import PLAIN, WHOLE
from .checkpointing import OFFLOAD
from .recompute_plan import ALONE, Position, RecomputePlan, summarize
from .recompute_planner import (
    TIE,
    Planned,
    Weighed,
    leaner,
    leanest_of_the_fastest,
    lighter,
    why_chosen,
)
from .recompute_profile import Block, OpObs, most
from .recompute_trims import TrimsVerdict, ceiling_of, trims_verdict_of

__all__ = ["TRIAL_STEPS", "UNTRIMMED_STEPS", "ActivePlan", "Weighing"]

_MiB = 1 << 20
# NOTE [trial steps] in recompute.py: the planned steps timed before a tried plan is kept
# or replaced.
TRIAL_STEPS = 2
# NOTE [trims a plan does without]: one planned step with heap trims, then these without.
UNTRIMMED_STEPS = 2
# The measured figures that say a plan's blocks (:meth:`ActivePlan.switch` rewrites them).
_BLOCK_COUNTS = (
    "blocks_whole",
    "blocks_plain",
    "blocks_selective",
    "blocks_interleaved",
    "whole_MiB",
    "offload_alone",
)


class ActivePlan:
    """The plan the blocks and ops follow now: per block its mode, per op position its
    policy and why (the reason, compute seconds, modelled move seconds), the figures it
    was made and weighed by (``measured``), the share of the profiled op output bytes in
    the blocks still checkpointed, the blocks profiled, the profile's op measurements
    (``obs``, kept while a trial or a stand-in may change the plan) and the plan as last
    printed (``last``).

    Args:
        own_draws: the op positions that draw from a generator of the caller's own (the
            decider's set, as it grows): never recomputed (NOTE [random ops] in
            checkpointing.py).
    """

    def __init__(self, own_draws: set[Position]) -> None:
        self._own_draws = own_draws
        self.plan: dict[Position, CheckpointPolicy] = {}
        self.reasons: dict[Position, tuple[str, float, float]] = {}
        self.modes: dict[Block, str] = {}
        self.measured: dict[str, float] = {}
        self.share = 0.0
        self.profiled: set[Block] = set()
        self.obs: dict[Position, OpObs] = {}
        self.plans_made = 0
        self.last = RecomputePlan("auto")

    def adopt(self, planned: Planned) -> None:
        """A plan made from a new profile (its op positions join those planned before)."""
        self.modes = planned.modes
        self.plan.update(planned.plan)
        self.reasons.update(planned.reasons)
        self.plans_made += 1
        self.measured = planned.measured
        self.profiled, self.share = planned.profiled, planned.share

    def summarize(self, obs: dict[Position, OpObs] | None = None) -> None:
        """Print the plan as it stands (``last``), from ``obs`` or the kept measurements."""
        obs = self.obs if obs is None else obs
        self.last = summarize(
            obs, self.plan, self.reasons, self.share, self.measured, self.plans_made
        )

    def switch(self, how: str, than: str) -> None:
        """Every profiled block checkpointed plainly (PLAIN) or whole (WHOLE), which
        ``than`` says why."""
        if how == PLAIN:
            why = f"plain checkpointing of every block {than}"
            m = self.measured  # (offload alone's reason, or the interleaving's, on every op)
            alone = bool(m.get("offload_alone") or m.get("blocks_interleaved"))
            moved = [
                pos
                for pos, policy in self.plan.items()
                if (policy in OFFLOAD or alone) and pos not in self._own_draws
            ]
        else:
            why = f"offload alone {than}"
            moved = list(self.plan)
        for pos in moved:
            self.plan[pos] = CheckpointPolicy.PREFER_RECOMPUTE
            self.reasons[pos] = (why, *self.reasons[pos][1:])
        self.modes = dict.fromkeys(self.profiled, how)
        n = len(self.profiled)
        self.measured.update(
            blocks_whole=n if how == WHOLE else 0,
            blocks_plain=n if how == PLAIN else 0,
            blocks_selective=0,
            blocks_interleaved=0,
            whole_MiB=0.0 if how == PLAIN else self.measured.get("whole_MiB", 0.0),
            offload_alone=float(how == WHOLE),
        )
        self.share = 1.0 if how == PLAIN else 0.0

    def moves(self) -> bool:
        """Whether the plan moves activations: selective blocks, whole blocks beyond the
        budget (offload alone, or interleaved with plain ones)."""
        m = self.measured
        return any(m.get(k) for k in ("blocks_selective", "offload_alone", "blocks_interleaved"))

    def block_counts(self) -> dict[str, float]:
        """The plan's blocks as :meth:`switch` rewrites them in ``measured``."""
        return {k: self.measured[k] for k in _BLOCK_COUNTS if k in self.measured}

    def rival(self) -> tuple[str, Weighed] | None:
        """The plan that plain checkpointing is weighed against without trims (NOTE
        [plain without trims] in recompute_trims.py): offload alone, or a tried plan its
        trial kept; its name and its measured step (seconds, the most memory it held, 0:
        unknown, and the bytes it moved). From the printed figures, which ranks that
        agree take from rank 0."""
        m = self.measured
        if m.get("offload_alone"):
            peak, moved = m["peak_alone_MiB"], m.get("moved_alone_MiB", 0.0)
            return ALONE, Weighed(m["wall_alone_s"], round(peak * _MiB), round(moved * _MiB))
        if m.get("trial_choice") == 0 and "trial_step_s" in m:
            peak, moved = m["trial_peak_MiB"], m.get("trial_moved_MiB", 0.0)
            step = Weighed(m["trial_step_s"], round(peak * _MiB), round(moved * _MiB))
            return "this plan's trial", step
        return None


class Weighing:
    """The planned steps that still measure the plan: its trial where the profile did not
    run it as it is (NOTE [trial steps] in recompute.py), then where it moves nothing its
    heap trims' trial, or where offload alone or a tried plan runs, plain checkpointing
    weighed without trims in its place (NOTE [trims a plan does without], NOTE [plain
    without trims] in recompute_trims.py); and, once settled, trims held off that come
    back (with plain checkpointing standing in for a tried plan).

    Args:
        active: the plan the blocks and ops follow; rewritten where a weighing says.
        trim_heap: asks the engine for one heap trim (NOTE [a trim where the plan
            changes] in recompute.py).
        hold_trims: holds the engine's heap trims off (True, with the ceiling given) or
            lets them run (False); None: no trims to weigh.
        trims_held: whether the engine's trims are held off now; None: as ``hold_trims``
            last said.
        weighs: whether trims are weighed (trims to hold, and peaks sampled).
        own_rng: the block classes that draw from a generator of the caller's own (the
            decider's set): never plain.
        stop_sampling: stops sampling memory (nothing more to measure).
        agreement: the ranks that decide together (NOTE [ranks agree] in
            agreement.py); None decides alone.
    """

    def __init__(
        self,
        active: ActivePlan,
        *,
        trim_heap: Callable[[], None],
        hold_trims: Callable[[bool, int | None], None] | None,
        trims_held: Callable[[], bool] | None,
        weighs: bool,
        own_rng: set[str],
        stop_sampling: Callable[[], None],
        agreement: RankAgreement | None,
    ) -> None:
        self.active = active
        self._trim_heap = trim_heap
        self._hold_trims = hold_trims
        self._trims_held = False
        self._trims_held_now = trims_held
        self._weighs = weighs
        self._own_rng = own_rng
        self._stop_sampling = stop_sampling
        self._agreement = agreement
        # The two plans the profile ran, by name (NOTE [trial steps] in recompute.py),
        # offload alone's profiled peak (0: unknown) and the bytes the blocks saved in the
        # whole step, as this rank profiled them.
        self.profiled_plans: dict[str, Weighed] = {}
        self.peak_alone = 0
        self.step_saved = 0
        # NOTE [trial steps] in recompute.py: the planned steps while a plan is tried, as
        # measured, and the steps left.
        self._trial_steps: list[Weighed] = []
        self.trial_left = 0
        # A tried plan that moves nothing: whether its trial runs steps without trims, the
        # verdict on its trims there (None: not judged) and its fastest step under them.
        self._trial_untrimmed = False
        self._trial_trims: TrimsVerdict | None = None
        self._trial_trimmed_s = math.inf
        # NOTE [trims a plan does without]: the steps of the trims' trial left, and those
        # measured; whether plain checkpointing runs in the plan's place (NOTE [plain
        # without trims]) and the plan's modes meanwhile.
        self._trim_trial_left = 0
        self._trim_steps: list[Weighed] = []
        self._challenging = False
        self._rival_modes: dict[Block, str] = {}
        # Plain checkpointing's verdict and fastest step without trims, where it held
        # within what they allow but lost to a tried plan that moves nothing: the plan's
        # stand-in should its trims come back (NOTE [plain without trims]).
        self._stand_in: tuple[TrimsVerdict, float] | None = None
        # Once plain stands in: the plan's modes, share and block counts (its summary is
        # printed from the active plan's obs, kept meanwhile).
        self._stood_for: tuple[dict[Block, str], float, dict[str, float]] | None = None

    @property
    def timing(self) -> bool:
        """Whether the planned step now is timed: a trial step, or a step of plain
        checkpointing weighed in the plan's place."""
        return bool(self.trial_left) or self._challenging

    @property
    def measuring(self) -> bool:
        """Whether the planned step now is measured: a trial step or a step of the trims'
        trial."""
        return bool(self.trial_left or self._trim_trial_left)

    def plan_made(self, planned: Planned, *, tried: bool) -> None:
        """A plan from a new profile: tried (``tried``) for TRIAL_STEPS counted steps, and
        UNTRIMMED_STEPS more without trims where it moves nothing (the count ranks that
        agree take from rank 0, before :meth:`trial_begins`)."""
        self.profiled_plans = planned.profiled_plans
        self.peak_alone = planned.peak_alone  # (ranks that agree print rank 0's figures)
        self.step_saved = planned.step_saved
        self.trial_left = TRIAL_STEPS + 1 if tried else 0
        # NOTE [trims a plan does without]: a tried plan that moves nothing runs its last
        # trial steps without trims.
        if self.trial_left and self._weighs and not self.active.moves():
            self.trial_left += UNTRIMMED_STEPS
        self._trial_steps = []

    def trial_begins(self) -> None:
        """The trial's steps as counted (rank 0's count, where ranks agree) begin."""
        self._trial_untrimmed = self.trial_left > TRIAL_STEPS + 1
        self._trial_trims, self._trial_trimmed_s, self._stand_in = None, math.inf, None
        self._stood_for = None

    def step_ended(self, step: Weighed) -> None:
        """A counted planned step ended, as measured: a trial's or a trims' trial's."""
        if self.trial_left:
            self._trial_step_ended(step)
        elif self._trim_trial_left:
            self._trim_step_ended(step)

    def stop(self) -> None:
        """A new profile begins: nothing more is weighed (a plain checkpointing in the
        plan's place ends unjudged), and the trims run."""
        if self._challenging:  # (the plan made last runs no more: as it was)
            self._end_weighing()
        self.trial_left, self.active.obs, self._stand_in = 0, {}, None
        self._stood_for = None
        self._trim_trial_left, self._challenging = 0, False
        self.hold(False)

    def close(self) -> None:
        """The context exits: a weighing of plain checkpointing ends unjudged (the plan
        made last is the plan)."""
        if self._challenging:
            self.active.modes = self._rival_modes
            self._end_weighing()

    def _trial_step_ended(self, step: Weighed) -> None:
        """A planned step of a tried plan ended, as measured (NOTE [trial steps])."""
        self._trial_steps.append(step)
        self.trial_left -= 1
        if self._trial_untrimmed and self.trial_left == UNTRIMMED_STEPS:
            self.hold(True)  # NOTE [trims a plan does without]: the last steps without
        if self.trial_left == 0:
            self._judge_trial()

    def _judge_trial(self) -> None:
        """Keep the tried plan or take a profiled one: the fastest of the three, unless
        one within 5% of it held at least 5% less memory, or at most 5% more and moved
        25% fewer bytes (NOTE [trial steps], NOTE [plans within the noise])."""
        steps = self._trial_steps[1:]  # (the first planned step learns the order)
        if self._trial_untrimmed:  # NOTE [trims a plan does without]: its trims, judged
            n = UNTRIMMED_STEPS
            peaks = [step.peak for step in steps]
            self._trial_trims = self._trims_verdict_of(most(peaks[:-n]), most(peaks[-n:]))
            self._trial_trimmed_s = min(step.wall for step in steps[:-n])
            # the steps without trims count where it may run without them
            steps = steps[-n:] if self._trial_trims.held else steps[:-n]
            self.hold(False)
        tried = min(step.wall for step in steps)
        trial_peak = most([step.peak for step in steps])
        trial_moved = max(step.moved for step in steps)
        # Without trims within what their verdict allows, the plan is weighed by time (NOTE
        # [trims a plan does without]): the other plans' peaks were under trims.
        untrimmed = self._trial_trims is not None and self._trial_trims.held
        plans = {"trial": Weighed(tried, 0 if untrimmed else trial_peak, trial_moved)}
        plans.update(self.profiled_plans)
        chosen = leanest_of_the_fastest(plans)
        choice = ("trial", "plain", "alone").index(chosen)
        why = why_chosen(plans, chosen, "trial", "this plan's trial") if choice else ""
        plain, alone = plans["plain"].wall, plans["alone"].wall
        if self._agreement is not None:  # NOTE [ranks agree] in agreement.py: rank 0's
            mine = [choice, why, tried, plain, alone, trial_peak, trial_moved]
            got = json.loads(self._agreement.first_rank(json.dumps(mine).encode()))
            choice, why, tried, plain, alone, trial_peak, trial_moved = got
        if choice:
            self._trial_trims = None  # (the tried plan's: another plan runs)
            self.active.switch(PLAIN if choice == 1 else WHOLE, why)
            self._trim_heap()  # NOTE [a trim where the plan changes]
        self.active.measured.update(
            trial_step_s=tried,
            trial_plain_s=plain,
            trial_alone_s=alone,
            trial_choice=choice,
            trial_peak_MiB=trial_peak / _MiB,
            trial_moved_MiB=trial_moved / _MiB,
        )
        if untrimmed:
            self.active.measured["trial_untrimmed"] = 1.0
        self.active.summarize()
        self.begin_trims_trial()

    def hold(self, on: bool, ceiling: int | None = None) -> None:
        """Hold the engine's heap trims off (but where the process holds more than
        ``ceiling`` bytes), or let them run."""
        if self._hold_trims is not None and (self._trims_held != on or ceiling is not None):
            self._hold_trims(on, ceiling)
            self._trims_held = on

    def begin_trims_trial(self) -> None:
        """The plan holds: where it is offload alone or a tried plan, weigh plain
        checkpointing without trims against it (NOTE [plain without trims]); where it
        moves nothing, weigh its heap trims; else stop sampling memory."""
        weighs = self._weighs
        # (A block class that draws its own numbers is never plain.)
        plain = (
            math.isfinite(self.active.measured.get("wall_plain_s", math.inf)) and not self._own_rng
        )
        rival = self.active.rival() is not None
        challenge = weighs and plain and rival
        if self._agreement is not None and rival:  # NOTE [ranks agree]
            challenge = json.loads(self._agreement.first_rank(json.dumps(challenge).encode()))
        if challenge:
            self._challenging, self._rival_modes = True, dict(self.active.modes)
            self.active.modes = dict.fromkeys(self.active.profiled, PLAIN)
            self.active.measured["weighing_plain"] = 1.0  # (the printed plan says so meanwhile)
            self.active.summarize()
            self._trim_heap()  # NOTE [a trim where the plan changes]
            self._start_trim_steps(settling=True)
        elif self._trial_trims is not None:  # its trims judged in its trial
            self._apply_trims(self._trial_trims, record=True)
            self._stop_sampling()
            self.active.obs = {}
        elif weighs and not self.active.moves():  # (after a trial's steps without trims, their
            self._start_trim_steps(settling=self._trial_untrimmed)  # heap settles first)
        else:
            self._stop_sampling()
            self.active.obs = {}

    def _end_weighing(self) -> None:
        """Plain checkpointing no longer runs in the plan's place unjudged: its steps end,
        and the plan made last is printed as it was (NOTE [plain without trims])."""
        self._challenging, self._trim_trial_left = False, 0
        del self.active.measured["weighing_plain"]
        self.active.summarize()

    def _start_trim_steps(self, *, settling: bool) -> None:
        """The trims' trial: one step under trims, then UNTRIMMED_STEPS without; after
        a first, uncounted step where ``settling`` (plain checkpointing in place of
        another plan: its trim bound follows what that plan moved)."""
        self._trim_trial_left = 1 + UNTRIMMED_STEPS + settling
        self._trim_steps = []

    def _trim_step_ended(self, step: Weighed) -> None:
        """A step of the trims' trial ended, as measured: the last but UNTRIMMED_STEPS
        ran under trims, those after it without."""
        self._trim_steps.append(step)
        self._trim_trial_left -= 1
        if self._trim_trial_left == UNTRIMMED_STEPS:
            self.hold(True)
        elif self._trim_trial_left == 0:
            self._judge_trims()

    def _judge_trims(self) -> None:
        """Hold the trims off for good where the steps without them held no more than
        the step under them or offload alone in the profile, whichever held more, and
        5% of the bytes a step saves (NOTE [trims a plan does without]); else let them
        run, with one trim now for what the steps without them left. Where plain
        checkpointing ran in place of another plan, it stays only where its trims are
        held off and :meth:`_weigh_plain` prefers it (NOTE [plain without trims])."""
        under, *without = self._trim_steps[-1 - UNTRIMMED_STEPS :]
        trimmed, untrimmed = under.peak, most([step.peak for step in without])
        verdict = self._trims_verdict_of(trimmed, untrimmed)
        again, record = False, True  # again: the plan that ran again, its own trims' trial
        challenged, self._challenging = self._challenging, False
        if challenged:
            del self.active.measured["weighing_plain"]
            wall = min(step.wall for step in without)
            moved = max(step.moved for step in without)
            plain = self._weigh_plain(verdict.held, Weighed(wall, untrimmed, moved))
            self.active.measured.update(
                plain_trims_peak_MiB=trimmed / _MiB,
                plain_untrimmed_peak_MiB=untrimmed / _MiB,
                plain_allowed_MiB=verdict.allowed / _MiB,
            )
            if not plain and self._trial_trims is not None:  # the plan's, from its trial
                held_off = self._trial_trims.held and self._agreement is None
                if verdict.held and held_off:  # NOTE [plain without trims]: its stand-in
                    self._stand_in = (verdict, wall)
                verdict = self._trial_trims
            else:  # (where the plan runs again, the other plan's trims go untried)
                verdict, record = verdict._replace(held=plain), plain
            again = not plain and not self.active.moves() and self._trial_trims is None
        self._apply_trims(verdict, record=record)
        self.active.summarize()
        if again:
            self._start_trim_steps(settling=True)  # (its bound follows plain's moves)
            return
        self._stop_sampling()
        if self._stand_in is None:  # (a stand-in's plan is printed from them)
            self.active.obs = {}

    def released(self) -> None:
        """Where trims held off for good run again (the process passed their ceiling
        twice within CEILING_STEPS steps), the plan says so (NOTE [trims a plan does
        without]). Where they were a tried plan's and plain checkpointing stands in for
        it, faster without trims than the plan with them, plain runs in its place, its
        trims held off under their own ceiling; where plain's come back too, the faster
        of the two under trims runs (NOTE [plain without trims] in recompute_trims.py)."""
        now = self._trims_held_now
        if not (self._trims_held and self.active.measured.get("trims_held") and now and not now()):
            return
        self._trims_held = False
        stand_in, self._stand_in = self._stand_in, None
        stood_for, self._stood_for = self._stood_for, None
        obs, self.active.obs = self.active.obs, {}
        self.active.measured.update(trims_held=0.0, trims_released=1.0)
        if stand_in is not None and stand_in[1] < self._trial_trimmed_s:
            verdict = stand_in[0]
            self._stood_for = (
                dict(self.active.modes),
                self.active.share,
                self.active.block_counts(),
            )
            self.active.measured.update(
                stand_in=1.0,
                plan_ceiling_MiB=self.active.measured.get("trims_ceiling_MiB", 0.0),
                trial_trimmed_s=self._trial_trimmed_s,
                trims_released=0.0,
            )
            self.active.switch(PLAIN, "standing in for the tried plan, heap trims held off")
            self._apply_trims(verdict, record=True)
            self.active.obs = obs  # (until plain's own trims come back)
            self.active.summarize(obs)
            return
        if stood_for is not None and self._trial_trims is not None:
            plain = self.profiled_plans["plain"]
            plan = Weighed(self._trial_trimmed_s, self._trial_trims.trimmed, 0)
            chosen = leanest_of_the_fastest({"plain": plain, "plan": plan})
            self.active.measured["stand_in_kept"] = float(chosen == "plain")
            if chosen == "plan":
                self.active.modes, self.active.share, counts = stood_for
                self.active.measured.update(counts)
            self.active.summarize(obs)
            return
        m = {**self.active.last.measured, "trims_held": 0.0, "trims_released": 1.0}
        self.active.last = dataclasses.replace(self.active.last, measured=m)

    def _trims_verdict_of(self, trimmed: int, untrimmed: int) -> TrimsVerdict:
        """Whether trims are held off where a step under them held ``trimmed`` bytes and
        steps without them ``untrimmed`` at most: no more than that step or offload alone
        in the profile, whichever held more, and 5% of the bytes a step saves (NOTE [trims
        a plan does without]); with the two peaks and that allowance."""
        return trims_verdict_of(trimmed, untrimmed, alone=self.peak_alone, saved=self.step_saved)

    def _apply_trims(self, verdict: TrimsVerdict, *, record: bool) -> None:
        """Hold the trims off for good, or let them run with one trim now for what steps
        without them left; the plan prints the figures where held, or where ``record``.
        Held off, one trim runs where the process passes the verdict's ceiling
        (:func:`~prefetch_offload.recompute_trims.ceiling_of`: its allowance), and the
        trims run again where it passes it twice within CEILING_STEPS steps."""
        held, trimmed, untrimmed, allowed = verdict
        figures = {
            "trims_held": float(held),
            "trims_peak_MiB": trimmed / _MiB,
            "untrimmed_peak_MiB": untrimmed / _MiB,
            "trims_allowed_MiB": allowed / _MiB,
        }
        if held:
            ceiling = ceiling_of(verdict)
            self.hold(True, ceiling)
            self.active.measured.update(figures, trims_ceiling_MiB=(ceiling or 0) / _MiB)
        else:
            self.hold(False)
            self._trim_heap()
            if record:
                self.active.measured.update(figures)

    def _weigh_plain(self, held: bool, step: Weighed) -> bool:
        """Plain checkpointing ran in place of the plan (offload alone, or a tried plan),
        as ``step`` measured its steps without trims, ``held``: it held no more without
        them than the verdict allows. Keep it where it ran faster than the plan's
        measured steps, or, where the plan moves activations, within 5% of them holding
        5% less, or at most 5% more and moving 25% fewer bytes; else the plan runs again
        (NOTE [plain without trims]). Whether plain runs (its trims held off: rank 0's
        choice, where ranks agree)."""
        name, theirs = self.active.rival() or ("", Weighed(math.inf, 0, 0))
        wall, rival = step.wall, theirs.wall
        close = wall <= (1 + TIE) * rival
        # NOTE [plain without trims]: against a plan that moves nothing, time alone.
        moves = name == ALONE or theirs.moved > 0
        as_good = close and moves and (leaner(step, theirs) or lighter(step, theirs))
        plain = held and (wall < rival or as_good)  # (held: within what the verdict allows)
        if self._agreement is not None:  # NOTE [ranks agree] in agreement.py: rank 0's
            plain = json.loads(self._agreement.first_rank(json.dumps(plain).encode()))
        self.active.measured.update(
            untrimmed_plain_s=wall,
            untrimmed_choice=float(plain),
            rival_s=rival,
            rival_peak_MiB=theirs.peak / _MiB,
            rival_alone=float(name == ALONE),
        )
        if plain:
            why = why_chosen({"plain": step, name: theirs}, "plain", name, name)
            self.active.switch(PLAIN, "with heap trims held off " + why)
            return True
        self.active.modes = self._rival_modes
        return False
