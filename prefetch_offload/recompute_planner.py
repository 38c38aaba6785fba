"""The automatic policy's plan, made from one profile (NOTE [keep, offload, recompute] in
recompute.py): which blocks run whole, plainly or selectively checkpointed, and per op
position whether its output is recomputed or handed to the engine; and how two measured
plans are weighed.

# NOTE [interleaved blocks]
# Where offload alone beat plain checkpointing in the profile, the plan tried
# runs every other block the budget does not keep checkpointed plainly (the
# oldest first), the rest whole. A step under offload alone holds more than its
# budget: the write batches in flight, the prefetch window, and the free heap the
# trims allow, whose bound grows with the bytes a step moves (NOTE [heap trim]
# in heap.py). Half the blocks plain halve what moves; a plain block holds only
# its input, and its recompute's churn fits under the trims' bound that the
# whole blocks' moves set, where plain checkpointing of every block moves
# nothing, runs at the trims' floor, and pays their page faults. Measured on the
# 24-block transformer of ``bench/recompute.py`` (one run, 6 rounds, side by
# side: offload alone, and lanes that checkpoint every k-th block under the same
# context), step s / peak MiB / moved MiB a step:
#
#   device_budget 10%:  offload alone 1.748 / 477 / 873
#                       every 4th block plain 1.797 / 434 / 645
#                       every 3rd 1.835 / 409 / 575, every 2nd 1.800 / 368 / 419
#   device_budget 25%:  offload alone 1.702 / 554 / 721
#                       every 3rd 1.791 / 515 / 427, every 2nd 1.778 / 485 / 270
#
# (plain checkpointing without the engine: 1.481 s at 795 MiB, its heap
# untrimmed; ``recompute="full"``: 2.039 s at 246 MiB). Every other block moved
# least and held least, within 3-5% of offload alone's step, so halves are what
# is tried. The trial decides (NOTE [trial steps] in recompute.py): the plan stays where it ran
# faster than offload alone, or within 5% of it holding 5% less; else offload
# alone, or plain checkpointing, runs. (In one run of ``bench/recompute.py``, at
# 10% the trial ran 1.760 s a step against offload alone's 1.688 in the
# profile, 11% leaner, and stayed: 0.52x the bytes moved; in the run that
# ``docs/benchmarks.md`` cites it ran 2.131 s against 1.741 and yielded.)
# The interleaved plan's heap trims follow the bytes offload alone moved, not
# its own (NOTE [heap trim] in heap.py: a quarter of them): half the bytes
# moved would halve the free heap the trims allow, while the plain blocks'
# recompute churns as much heap as before, and the plan is weighed against
# offload alone's peak anyway. Measured on the 24-block transformer at 10% of
# the saved bytes (``bench/recompute.py``'s model; one process each way, its
# steps in turn): with a bound from its own moves the trial ran 2.001 and
# 1.951 s a step with 9 trims and 390-420k page faults each, and yielded to
# offload alone's 1.646 s; with offload alone's bound, 1.875 and 1.815 s with
# 4 trims and 290k faults, at 703 MiB against offload alone's 741, and stayed.
# Once settled, side by side (``bench/recompute.py``'s lanes, six rounds): the
# interleaved plan 1.750 s a step at 488.9 MiB moving 420.6 MiB, offload alone
# 1.741 s at 474.2 MiB moving 872.0; with the oldest half of those blocks plain
# instead of every other one, 1.757 s at 486.4 MiB, no better. The interleaved
# plan holds a few percent more at its peak (a plain block's recompute beside
# the prefetch window in backward), as lean as offload alone within the noise,
# so the bytes moved decide between them (NOTE [plans within the noise]).
# A selective plan is not interleaved: its ops already choose between moving
# and recomputing. With one block the budget does not keep, there is nothing
# to interleave.
#
# NOTE [a budget no plan reaches]
# A ``device_budget`` below what one block's recompute holds at once is met by no
# plan, and the plan that comes closest is every block checkpointed plainly: its
# block inputs move (or stay, where the budget keeps them), and backward holds one
# block's recompute at a time (one call's, where the model calls a block more than
# once a step: each call is a checkpoint of its own). Offload alone holds the
# budget plus the engine's working window (write batches in flight, the prefetch
# window), and a selective block its stored outputs as well. So such a budget gets
# that plan (whole blocks only where a smaller block fits the budget), whatever
# the profile measured faster, and one warning says the smallest peak reachable:
# the user asked for memory, and the fastest plan would spend it. A budget of 0
# (the default) asks for none: the engine moves what it can, and the fastest plan
# runs. Measured on the 8-layer Llama of ``bench/recompute.py --model llama`` at
# 10% of the saved bytes (35 MiB; a layer's recompute holds 43 MiB), one run: the
# profile measured offload alone faster (1.12 s a step against 1.32 s), and every
# layer plain ran 1.25 s at a peak of 180 MiB, the least of every mode in the run
# (``full_offload``, the same plan at a budget of 0: 184 MiB, 1.24 s;
# ``offload10``, offload alone at this budget: 221 MiB, 1.12 s), moving nothing.
#
# NOTE [plans within the noise]
# The walls that choose between plans (NOTE [trial steps] in recompute.py) are single steps on a
# shared machine, and the plans they compare often differ by less than the
# noise: on the 8-layer Llama of ``bench/recompute.py --model llama`` the
# profile put offload alone 1.6-3.3% ahead of plain checkpointing at 25% and
# 50% of the saved bytes in one run, and in the same run's side-by-side
# rounds offload alone ran 1.057-1.116 s (two processes of the same plan, 5.6%
# apart); in three such runs (two with lanes added for ``recompute="full"`` at
# those budgets) every layer checkpointed plainly under the engine ran
# 0.97-1.07 s at peaks of 222-305 MiB, offload alone 0.90-1.17 s at 273-376
# MiB. So the plans are also weighed by the memory their steps held.
# While the plan is measured a thread samples the process's anonymous resident
# memory every 2 ms (peak.py), and each step's peak runs, as its wall does,
# from its first block's forward to the end of its last backward; per kind,
# the most of its counted steps. The fastest plan runs, unless one whose steps
# took at most TIE (5%) longer held LEANER (5%) less memory than it: then the
# one of those that held least. Where none did, one of those that held at most
# LEANER (5%) more than the fastest, as lean within the noise, and moved
# LIGHTER (25%) fewer bytes to the target a step (the engine's
# ``bytes_offloaded``) runs: the one that moved least. Bytes
# moved are a load a step's time does not show: the link the gradients and
# the collectives share on a GPU, the disk's write endurance (a step that
# moves 1 GiB, a million steps: a petabyte written). On the 24-block
# transformer at 25% of the saved bytes (``bench/recompute.py``'s model; two
# runs, one process each) the interleaved trial ran 1.782 and 1.844 s a step at
# 827 and 815 MiB, moving 344 MiB a step where offload alone moved 721, and
# offload alone 1.723 and 1.717 s at 862 and 845 MiB in the profile: in the
# first run 3.4% slower and 4.1% leaner, within the noise on both counts, where
# the bytes moved decide; in the second 7.4% slower, where they do not (NOTE
# [interleaved blocks]). These rules decide
# between offload alone and plain checkpointing when the plan is every block
# checkpointed plainly, and among the trial, plain checkpointing and offload
# alone at the end of a trial.
# Peaks are sampled only under heap trims (without them the resident memory
# keeps what steps of other kinds left: NOTE [a trim where the plan changes] in recompute.py)
# and only for a CPU model: a GPU block's allocation peak lasts microseconds of
# host time, which sampling misses. Not sampled, or a failed read (no
# ``/proc``), or a fork's child: the fastest runs. The kernel's and CUDA's
# high-water marks are not used because resetting them resets a user's own
# peak figures too.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import NamedTuple

from torch.utils.checkpoint import CheckpointPolicy

from .blocks import PLAIN, SELECTIVE, WHOLE
from .checkpointing import OFFLOAD
from .recompute_plan import Position
from .recompute_profile import (
    INPUTS_STEP,
    OFFLOAD_ALL,
    RECOMPUTE_ALL,
    WHOLE_ALL_STEP,
    WHOLE_TIMED,
    Block,
    Profile,
)

__all__ = [
    "LEANER",
    "LIGHTER",
    "TIE",
    "Planned",
    "Weighed",
    "leaner",
    "leanest_of_the_fastest",
    "lighter",
    "make_plan",
    "unreachable_budget",
    "why_chosen",
]

_MiB = 1 << 20
# NOTE [keep, offload, recompute] in recompute.py: the dispatch modes' cost over their
# time in __torch_dispatch__ (the switch into Python is outside it).
DISPATCH_SWITCH = 1.5
# NOTE [plans within the noise]: a plan whose step took at most TIE longer than the
# fastest plan's counts as fast as it; of those, one that held at least LEANER less
# memory than the fastest runs instead (the one that held least), else one that held no
# more and moved at least LIGHTER fewer bytes (the one that moved least).
TIE = 0.05
LEANER = 0.05
LIGHTER = 0.25
# NOTE [keep, offload, recompute]: selective blocks only where their offloads save more
# than the dispatch modes cost by this share of the recompute-all step (the noise).
SELECTIVE_MARGIN = 0.05


class Weighed(NamedTuple):
    """A plan's measured step (NOTE [plans within the noise]): seconds, the most memory
    it held (0: unknown), and the bytes it moved to the target."""

    wall: float
    peak: int
    moved: int


def leaner(plan: Weighed, than: Weighed) -> bool:
    """``plan`` held LEANER less memory than ``than`` (NOTE [plans within the noise])."""
    return 0 < plan.peak <= than.peak * (1 - LEANER)


def lighter(plan: Weighed, than: Weighed) -> bool:
    """``plan`` held at most LEANER more memory than ``than`` (as lean within the noise)
    and moved LIGHTER fewer bytes (NOTE [plans within the noise])."""
    as_lean = 0 < plan.peak <= than.peak * (1 + LEANER)
    return as_lean and plan.moved <= than.moved * (1 - LIGHTER) and plan.moved < than.moved


def leanest_of_the_fastest(plans: dict[str, Weighed]) -> str:
    """Of ``plans``, the fastest, unless one within TIE of it held LEANER less: then
    the one of those that held least; else one within TIE of it that held at most
    LEANER more and moved LIGHTER fewer bytes: the one of those that moved least
    (NOTE [plans within the noise]). Where a plan within TIE held an unknown peak, the
    fastest."""
    fastest = min(plans, key=lambda name: plans[name].wall)
    best = plans[fastest]
    close = [name for name, p in plans.items() if p.wall <= best.wall * (1 + TIE)]
    if any(plans[name].peak <= 0 for name in close):
        return fastest
    leaner_ones = [name for name in close if leaner(plans[name], best)]
    if leaner_ones:
        return min(leaner_ones, key=lambda name: (plans[name].peak, plans[name].wall))
    lighter_ones = [name for name in close if lighter(plans[name], best)]
    return min(
        lighter_ones, key=lambda name: (plans[name].moved, plans[name].wall), default=fastest
    )


def why_chosen(plans: dict[str, Weighed], chosen: str, other: str, than: str) -> str:
    """Why plan ``chosen`` replaced plan ``other`` (called ``than`` in the text): it ran
    faster, or within TIE of it and held less memory, or about as much (within LEANER)
    and moved fewer bytes; else (a third plan was the fastest) it held less than the
    fastest."""
    mine, theirs = plans[chosen], plans[other]
    if mine.wall < theirs.wall:
        return f"ran faster than {than}"
    if leaner(mine, theirs):
        return f"ran within {TIE:.0%} of {than} and held less memory"
    if lighter(mine, theirs):
        return (
            f"ran within {TIE:.0%} of {than}, held within {LEANER:.0%} of its memory and "
            "moved fewer bytes"
        )
    return f"ran within {TIE:.0%} of the fastest plan and held less memory than it"


@dataclass(frozen=True)
class Planned:
    """A plan made from a profile: per op position its policy and why (the reason, its
    compute seconds and its modelled move seconds), per block its mode, the figures it
    was made from (``measured``), the share of the profiled op output bytes in the
    checkpointed blocks, the blocks profiled, the two plans the profile ran (plain
    checkpointing, offload alone) as measured, whether the plan is tried (NOTE [trial
    steps] in recompute.py), what makes the budget unreachable (None: reachable), the
    bytes the blocks saved in the whole step, and offload alone's profiled peak."""

    plan: dict[Position, CheckpointPolicy]
    reasons: dict[Position, tuple[str, float, float]]
    modes: dict[Block, str]
    measured: dict[str, float]
    share: float
    profiled: set[Block]
    profiled_plans: dict[str, Weighed]
    tried: bool
    unreachable: tuple[int, str] | None
    step_saved: int
    peak_alone: int


def make_plan(
    profile: Profile, budget: int, *, may_run_alone: bool = True, may_interleave: bool = True
) -> Planned:
    """The plan a finished profile gives under ``device_budget`` ``budget`` (NOTE [keep,
    offload, recompute] in recompute.py); ``may_run_alone``: offload alone (every block
    whole) may be the plan; ``may_interleave``: where offload alone beat plain
    checkpointing, the plan tried interleaves them (NOTE [interleaved blocks])."""
    offload_all = profile.block_times(OFFLOAD_ALL)
    n = offload_all[2]
    # What the modes measured of themselves per block, forward and recompute (NOTE
    # [dispatch cost] in checkpointing.py), the median block.
    spent = [v for i in profile.steps(RECOMPUTE_ALL) for v in profile.dispatch.get(i, {}).values()]
    in_modes = statistics.median(spent) if spent else 0.0
    n = max(n, 1)
    whole, held, beside = _whole_blocks(profile, budget)
    rest = n - len(whole)
    # The blocks the budget does not keep, whose plans the offload-alone test compares
    # (a kept block runs whole either way, and costs no moves).
    kept = set(whole)
    share = _share_beside(profile, kept, rest, n)
    others = {key for key in profile.spans.get(WHOLE_ALL_STEP, {}) if key not in kept}
    # The dispatch modes' own cost per block (NOTE [keep, offload, recompute] in recompute.py).
    overhead = DISPATCH_SWITCH * in_modes
    model = _MoveModel.of(profile, offload_all, held)
    plan, reasons, gain = _per_op(profile, share, model)
    # NOTE [a budget no plan reaches]: then the leanest plan, every block plain.
    unreachable = unreachable_budget(profile, budget)
    lean = unreachable is not None
    # Selective only where its offloads save more than its dispatch modes cost, by
    # more than the noise of a step (NOTE [plans within the noise]).
    wall_recompute = profile.wall(RECOMPUTE_ALL)
    noise = SELECTIVE_MARGIN * wall_recompute if math.isfinite(wall_recompute) else 0.0
    selective = not lean and gain - overhead * rest > noise
    if not selective:
        plain = (
            "block checkpointed plainly: device_budget is below what one block's "
            "recompute holds, and this is the plan that holds least"
            if lean
            else "block checkpointed plainly: selective would save less than its dispatch "
            f"costs and {SELECTIVE_MARGIN:.0%} of a step"
        )
        for pos in plan:
            if (plan[pos] in OFFLOAD or lean) and profile.fixed.get(pos) != "generator":
                plan[pos] = CheckpointPolicy.PREFER_RECOMPUTE
                reasons[pos] = (plain, reasons[pos][1], reasons[pos][2])
    # Per block the budget does not keep: what the chosen way is expected to take,
    # against what it took whole, the engine moving what the budget does not keep.
    f_whole, b_whole, _ = profile.block_times(WHOLE_TIMED, others)
    f_rest, b_rest, _ = profile.block_times(RECOMPUTE_ALL, others)
    f_kept, b_kept, _ = profile.block_times(WHOLE_TIMED, kept)
    block_whole = f_whole + b_whole
    block_ckpt = (f_rest + b_rest) - (gain / rest if selective and rest else overhead)
    step_kept = len(whole) * (f_kept + b_kept)
    checkpointed = rest
    profiled = {key for spans in profile.spans.values() for key in spans}
    # NOTE [trial steps]: the two plans the profile ran, by their walls; a plan between
    # them is tried against both.
    # (The correction at most half the step: a toy block whose ops all cost less
    # than their dispatch.)
    wall_plain = wall_recompute - min(n * overhead, wall_recompute / 2)
    wall_alone = profile.wall(WHOLE_TIMED)
    peak_plain, peak_alone = profile.peak(RECOMPUTE_ALL), profile.peak(WHOLE_TIMED)
    profiled_plans = {
        "plain": Weighed(wall_plain, peak_plain, profile.moved_by_kind(RECOMPUTE_ALL)),
        "alone": Weighed(
            wall_alone if may_run_alone and not lean else math.inf,
            peak_alone,
            profile.moved_by_kind(WHOLE_TIMED),
        ),
    }
    alone_won = (
        may_run_alone
        and not lean
        and rest > 0
        and leanest_of_the_fastest(profiled_plans) == "alone"
    )
    # NOTE [interleaved blocks]: where offload alone beat plain checkpointing, the
    # plan tried runs every other block the budget does not keep whole, the rest plain.
    interleaved: list[Block] = []
    if may_interleave and alone_won and not selective:
        interleaved = sorted(profiled - kept, key=lambda key: key[1])[1::2]
    tried = selective or bool(interleaved) or 0 < len(whole) < len(profiled)
    offload_alone = alone_won and not tried
    beat = (
        "offload alone measured faster than plain checkpointing"
        if wall_alone < wall_plain
        else f"offload alone measured within {TIE:.0%} of plain checkpointing and held less memory"
    )
    if interleaved:
        why = (
            "every other block the budget does not keep checkpointed plainly, the rest "
            f"whole: {beat}"
        )
        for pos in plan:
            if profile.fixed.get(pos) != "generator":
                reasons[pos] = (why, reasons[pos][1], reasons[pos][2])
        whole += interleaved
        rest -= len(interleaved)
        share = _share_beside(profile, set(whole), rest, n)
    if offload_alone:
        for pos in plan:
            plan[pos] = CheckpointPolicy.PREFER_RECOMPUTE
            reasons[pos] = (f"every block whole: {beat}", reasons[pos][1], reasons[pos][2])
        whole = list(profiled)
        selective, rest, share = False, 0, 0.0
    modes = dict.fromkeys(profiled, SELECTIVE if selective else PLAIN)
    modes.update(dict.fromkeys(whole, WHOLE))
    step_saved = profile.step_saved()
    measured = {
        "step_saved_MiB": step_saved / _MiB,
        "blocks_whole": len(whole),
        "blocks_selective": rest if selective else 0,
        "blocks_plain": 0 if selective else rest,
        "blocks_interleaved": len(interleaved),
        "whole_MiB": held / _MiB,
        "beside_whole_MiB": beside / _MiB,
        "dispatch_s_per_block": overhead,
        "dispatch_in_modes_s": in_modes,
        "selective_gain_s": gain,
        # The blocks' share of the step with every block whole, and with the blocks the
        # budget keeps whole and the rest checkpointed (estimates, from block medians).
        "step_whole_s": step_kept + checkpointed * block_whole,
        "step_checkpointed_s": step_kept + checkpointed * block_ckpt,
        # The profile's steps, forward to backward's end (NOTE [trial steps] in recompute.py).
        "wall_plain_s": wall_plain,
        "wall_alone_s": wall_alone,
        # The most memory those steps held (NOTE [plans within the noise]; 0: unknown).
        "peak_plain_MiB": peak_plain / _MiB,
        "peak_alone_MiB": peak_alone / _MiB,
        "moved_plain_MiB": profiled_plans["plain"].moved / _MiB,
        "moved_alone_MiB": profiled_plans["alone"].moved / _MiB,
        "offload_alone": float(offload_alone),
        **model.figures(),
    }
    return Planned(
        plan,
        reasons,
        modes,
        measured,
        share,
        profiled,
        profiled_plans,
        tried,
        unreachable,
        step_saved,
        peak_alone,
    )


def _whole_blocks(profile: Profile, budget: int) -> tuple[list[Block], int, int]:
    """The blocks that run whole: the newest whose saved bytes the budget keeps anyway,
    beside what the model saves outside the blocks and the inputs of the blocks it does
    not keep; with the bytes they save, and the bytes saved beside them."""
    whole: list[Block] = []
    held = 0
    inputs = {key: max(span.saved, 0) for key, span in profile.spans.get(INPUTS_STEP, {}).items()}
    beside = (profile.outside.nbytes if profile.outside else 0) + sum(inputs.values())
    for key, span in sorted(
        profile.spans.get(WHOLE_ALL_STEP, {}).items(), key=lambda kv: -kv[0][1]
    ):
        # A block whose saved tensors never reached the engine's tiers (nothing
        # measured) is not known to fit.
        others = beside - inputs.get(key, 0)
        if span.saved <= 0 or held + span.saved + others > budget:
            break
        held += span.saved
        beside = others
        whole.append(key)
    return whole, held, beside


def _share_beside(profile: Profile, run_whole: set[Block], count: int, n: int) -> float:
    """Of the profiled op output bytes and seconds, the share of the blocks still
    checkpointed (not in ``run_whole``): by their op output bytes (a block the model
    calls at two places counts both); ``count`` of the ``n`` where none were measured."""
    total = sum(profile.block_bytes.values())
    inside = sum(b for key, b in profile.block_bytes.items() if key not in run_whole)
    return inside / total if total else count / n


@dataclass(frozen=True)
class _MoveModel:
    """What moving the op outputs cost the offload-all step beyond recomputing them
    (NOTE [keep, offload, recompute] in recompute.py): its blocks' forward and backward
    seconds, the bytes it moved and stored, the stalls it met, the write and read
    bandwidths, the seconds per byte that compute did not hide, and what the budget keeps
    of the outputs beyond the whole blocks."""

    t_fwd: float
    t_bwd: float
    step_offload: float
    step_recompute: float
    recomputed_s: float
    moved: int
    stored: int
    e_fwd: float
    e_bwd: float
    write_bw: float
    read_bw: float
    per_byte: float
    left_on_device: int

    @classmethod
    def of(cls, profile: Profile, offload_all: tuple[float, float, int], held: int) -> _MoveModel:
        """The model a profile gives: ``offload_all`` is the offload-all step's median
        block forward and backward seconds and the blocks it ran; the whole blocks save
        ``held``."""
        s0, s1 = profile.s0, profile.s1
        assert s0 is not None and s1 is not None
        f_off, b_off, n = offload_all
        n = max(n, 1)
        # The recompute-all step next to the offload-all one: the two are differenced
        # for the move cost, and the lower of two noisy steps would bias it upward.
        f_rec, b_rec, _ = profile.step_block_times(profile.steps(RECOMPUTE_ALL)[0])
        t_fwd, t_bwd = max(n * f_off, 1e-9), max(n * b_off, 1e-9)
        step_offload, step_recompute = n * (f_off + b_off), n * (f_rec + b_rec)
        moved = s1.bytes_offloaded - s0.bytes_offloaded
        e_fwd = (s1.pack_wait_seconds - s0.pack_wait_seconds) + (
            s1.copy_wait_seconds - s0.copy_wait_seconds
        )
        e_bwd = s1.stall_seconds - s0.stall_seconds
        read = s1.bytes_read - s0.bytes_read
        read_s = s1.read_seconds - s0.read_seconds
        stored = sum(o.nbytes for o in profile.obs.values() if o.fixed is None)
        # What the recompute-all step recomputed that the offload-all step read back.
        recomputed_s = sum(
            o.total_s for o in profile.obs.values() if o.fixed is None and o.consumed
        )
        # Moving `moved` bytes cost the offload-all step this much beyond the compute the
        # recompute-all step spent instead, less the stalls the exposure terms model.
        move_cost = step_offload - (step_recompute - recomputed_s)
        return cls(
            t_fwd,
            t_bwd,
            step_offload,
            step_recompute,
            recomputed_s,
            moved,
            stored,
            e_fwd,
            e_bwd,
            write_bw=moved / t_fwd if moved else math.inf,
            read_bw=read / read_s if read and read_s > 0 else math.inf,
            per_byte=max(move_cost - e_fwd - e_bwd, 0.0) / moved if moved else 0.0,
            # The bytes the budget keeps of the outputs, less what the whole blocks take.
            left_on_device=max(stored - moved - held, 0),
        )

    def cost(self, share: float, cut: float, recompute_s: float) -> float:
        """Seconds a step spends moving the checkpointed blocks' op outputs (``share`` of
        the stored bytes) but ``cut`` bytes recomputed in ``recompute_s`` seconds."""
        out = max(self.stored * share - cut - self.left_on_device, 0)
        part = out / self.moved if self.moved else 0.0  # of the stalls step (2) measured
        hide_f = max(self.t_fwd - self.e_fwd, 0.0)
        hide_b = max(self.t_bwd - self.e_bwd, 0.0)
        return (
            self.per_byte * out
            + max(part * self.e_fwd, out / self.write_bw - hide_f)
            + max(part * self.e_bwd, out / self.read_bw - hide_b - recompute_s)
        )

    def figures(self) -> dict[str, float]:
        """The model's figures, as the plan prints them."""
        finite = math.isfinite
        return {
            "step_offload_all_s": self.step_offload,
            "step_recompute_all_s": self.step_recompute,
            "recompute_s": self.recomputed_s,
            "move_s_per_GB": self.per_byte * 1e9,
            "forward_s": self.t_fwd,
            "backward_s": self.t_bwd,
            "moved_MiB": self.moved / _MiB,
            "forward_stall_s": self.e_fwd,
            "backward_stall_s": self.e_bwd,
            "write_GBps": self.write_bw / 1e9 if finite(self.write_bw) else math.inf,
            "read_GBps": self.read_bw / 1e9 if finite(self.read_bw) else math.inf,
        }


def _per_op(
    profile: Profile, share: float, model: _MoveModel
) -> tuple[dict[Position, CheckpointPolicy], dict[Position, tuple[str, float, float]], float]:
    """Per op position, recompute or offload (NOTE [keep, offload, recompute] in
    recompute.py): fixed positions as they must run, then the rest from the cheapest to
    recompute per byte, each recomputed where that costs less than the moves it saves
    (``model``, over the checkpointed blocks' ``share``); with each choice's reason,
    seconds and modelled move seconds, and what the offloads save a step."""
    plan: dict[Position, CheckpointPolicy] = {}
    reasons: dict[Position, tuple[str, float, float]] = {}
    free = []
    candidates = []
    for pos, obs in profile.obs.items():
        if obs.fixed == "generator":  # NOTE [random ops] in checkpointing.py
            plan[pos] = CheckpointPolicy.PREFER_CPU_OFFLOAD
            why = "draws from a generator of the caller's own, which no recompute restores"
            reasons[pos] = (why, obs.total_s, 0.0)
        elif obs.fixed is not None:
            plan[pos] = CheckpointPolicy.PREFER_RECOMPUTE
            why = "aliases another tensor" if obs.fixed == "alias" else "draws random numbers"
            reasons[pos] = (why, obs.total_s, 0.0)
        elif obs.consumed == 0 or obs.nbytes == 0:
            plan[pos] = CheckpointPolicy.PREFER_RECOMPUTE
            reasons[pos] = ("never needed by the recompute", 0.0, 0.0)
            free.append(pos)
        else:
            candidates.append((obs.total_s / obs.nbytes, pos))
    cut = sum(profile.obs[p].nbytes for p in free) * share
    recompute_s = gain = 0.0
    for _, pos in sorted(candidates, key=lambda c: c[0]):
        obs = profile.obs[pos]
        nbytes, seconds = obs.nbytes * share, obs.total_s * share
        move = model.cost(share, cut, recompute_s) - model.cost(
            share, cut + nbytes, recompute_s + seconds
        )
        if seconds < move:
            plan[pos] = CheckpointPolicy.PREFER_RECOMPUTE
            reasons[pos] = ("recompute is cheaper than moving", seconds, move)
            cut += nbytes
            recompute_s += seconds
        else:
            plan[pos] = CheckpointPolicy.PREFER_CPU_OFFLOAD
            reasons[pos] = ("moving is cheaper than recompute", seconds, move)
            gain += seconds - move
    return plan, reasons, gain


def unreachable_budget(profile: Profile, budget: int) -> tuple[int, str] | None:
    """What one block's recompute holds at once, and what that is, where it is more than
    a ``device_budget`` given (NOTE [a budget no plan reaches]); else None."""
    if budget <= 0 or not profile.block_bytes:
        return None  # (0: no budget given; the engine moves what it can)
    floor = profile.recompute_hold()
    whole = profile.spans.get(WHOLE_ALL_STEP, {}).values()
    what = (
        "what the largest block saves for backward"
        if any(s.saved > 0 for s in whole)
        else "the largest block's op outputs"
    )
    return (floor, what) if floor > budget else None
