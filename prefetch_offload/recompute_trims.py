"""Whether a plan that moves nothing runs without the engine's heap trims, and at what
ceiling one trim runs (NOTE [trims a plan does without]); and plain checkpointing
weighed without trims against the plan it may replace (NOTE [plain without trims]).

# NOTE [trims a plan does without]
# A plan that moves nothing (every block checkpointed plainly, or whole where
# the budget keeps what it saves) leaves the engine no activation to move, and
# on the CPU what it still does is trim the heap (NOTE [heap trim] in
# heap.py): the trims are what separates such a plan from checkpointing
# without the engine. Their page faults cost time, and what they give back
# may buy little at the peak, where the next block's recompute touches the
# same pages again. So once such a plan holds (after its trial, where it had
# one), one planned step runs under trims and two without (the first of them
# on the heap the trims left), and their sampled peaks decide: the trims are
# held off for good (until a new profile, which runs under trims) where the
# most the others held is at most the larger of what the step under them held
# and what offload alone held in the profile, plus 5% (TRIMS_SLACK) of the
# bytes a step saves (the blocks' saved bytes in the profile's first step).
# Offload alone at this ``device_budget`` is the budget's own measure: it keeps
# what the budget holds and moves the rest, so a heap that holds no more than
# it did takes no more than the user gave to activations; the 5% is the slack
# of issue 23's peak target. The step under trims is no measure of the budget:
# the trims' allowance (NOTE [heap trim]) already lets its free heap fill the
# budget the plan leaves unused, so that budget added to its peak would count
# twice: on the 24-block transformer of ``bench/recompute.py`` at 50% of the
# saved bytes, every block plain, that sum (932 MiB with trims, 397 of the
# budget unused) holds the trims off at 1072 MiB without them, where offload
# alone held 1012, and the timed steps then peaked at 882 MiB above their
# start against the target's limit of 870. Where offload alone's peak is
# unknown (not sampled), the step under trims alone is the measure. Held off,
# where the process's anonymous resident memory passes the ceiling, what the
# verdict allows (105% of the most the steps without trims held where the step
# under them is unknown, or where rank 0's word holds them off above this rank's
# own allowance; the engine reads it at its packs), one trim runs and the trims
# stay held; where it passes it again within CEILING_STEPS (4, heap.py) steps of
# that trim, the trims run again for good (until a new profile), with one trim
# at once. The verdict's steps without trims come right after a trim, on a heap
# that has not settled, and glibc's heap may drift up later; a heap that drifts
# past what the budget has been measured to take is over the budget, so the
# ceiling is the allowance, not a drift above it. On the 8-layer Llama of
# ``bench/recompute.py --model llama --modes none,full,auto25,auto50 --warmup 25
# --steps 35`` at 50% (three layers whole beside five plain), a ceiling of 105%
# of the untrimmed peak (655 MiB, 6 over the allowance) let the timed steps peak
# at 415.6 MiB above their start against the target's limit of 412.3; at the
# allowance, in the run ``docs/benchmarks.md`` shows (642 MiB, the untrimmed
# peak 603), the plan's heap never passed it twice within 4 steps: 355.8 MiB
# (limit 402.5), 0.95x ``full``'s step; in another (630 MiB, the untrimmed peak
# 628) it passed twice in the warm-up and plain checkpointing stood in (NOTE
# [plain without trims]): 348.7 MiB (limit 429.5), 1.00x ``full``'s step.
# Without a stand-in the memory bound still comes first: on the same model, 60
# steps in a process each (2 CPU threads), every layer plain and held off from
# step 16, at 25% and 50% of the saved bytes the peak above the start settled at
# 317 and 303 MiB by steps 19 and 25 and stayed there to the end, 0.54-0.60 s a
# step (full checkpointing without the engine: 239-303 MiB, 0.53-0.60 s; the
# profile's steps under trims 0.62-0.69 s); with the ceiling at the allowance
# (548 MiB, 17 over the steps without trims), the heap passed it at the third
# step held, the trim took that step's peak from 282 to 265 MiB, and it passed
# again two steps later: the trims ran again for good, 0.57-0.69 s a step at
# 192-227 MiB. A heap still settling passes twice within 4 steps and gets its
# trims back; one that drifts past its ceiling after many steps pays a trim a
# pass, not the trims' page faults every step (in a ``bench/recompute.py
# --model llama`` run at 25%, trims for good after such a pass ran the timed
# steps at 1.05x ``full``'s). Trims held off but run once a step past the
# ceiling are no substitute for the trims: measured with ``bench/recompute.py
# --steps 8`` on the transformer at 25%, every block plain, the timed steps
# peaked at 548-921 MiB above their start against the target's limit of 652 (a
# trim a step gives back what the next backward's recompute touches again).
# Else (not held off) the trims run again, with one trim at once for what the steps without
# them left, at the bound as it is. A bound raised by what offload alone held
# in the profile above the step under trims trades page faults for memory
# (the 24-block transformer at 25% of the saved bytes, every block plain, one
# run with lanes for it: 1.728 s a step at 446 MiB above the start at the 64
# MiB floor, 1.701 s at 490 with 128 MiB, 1.618 s at 629 with 256, no trims
# 1.476 s at 802), but offload alone's profiled peak is no bound the target's
# limit keeps: so raised, on the IO-bound shape of ``bench/recompute.py`` at
# 10%, every block plain peaked at 398.7 MiB against the limit of 384.7
# (offload only: 374.5). A plan that moves activations keeps its trims untried: they give
# back what its moves free, and its steps without them would hold what the moves
# were asked to save. A CUDA model (no trims) and a run with no sampled peaks
# are not weighed. Measured with ``bench/recompute.py --model
# llama`` (the 8-layer Llama, one run, 2 CPU threads; every layer checkpointed
# plainly at each budget), under trims and without, against offload alone and
# the 17 MiB slack (5% of the 331 MiB the layers save): at 10% of the saved
# bytes 425 against 547 MiB, offload alone 504: the trims stayed; at 25% and
# 50% 508 against 549 and 582 against 604, offload alone 545 and 607: held
# off, and auto ran 1.01x and 1.00x the step of ``full`` (the same plan
# without the engine). On the transformer at 50%, in another run: 929
# against 974, offload alone 1019: held off, peaks of 705-768 MiB above the
# start against the target's limit of 924, 0.99x ``full``'s step.
# A tried plan that moves nothing (whole blocks within the budget beside plain
# ones) weighs its trims in its trial (NOTE [trial steps] in recompute.py): after its uncounted
# first step, two steps under trims and two without, and the verdict as above.
# Where held, the steps without trims are its trial's, weighed by time against
# the profiled plans, whose peaks were under trims; plain checkpointing is then
# weighed without trims against it (NOTE [plain without trims]), and where it
# loses the plan runs with the trims its trial judged. Measured with
# ``bench/recompute.py`` and lanes for such plans, side by side with ``full``
# (one run each): on the 8-layer Llama at 50% three layers whole and five
# plain ran 0.519 s a step at 360 MiB without trims and 0.611 s at 313 with
# them, ``full`` 0.553 s at 305; on the IO-bound shape at 50% (16 blocks, disk
# at 200 MB/s) seven whole and nine plain 0.944 s at 591 MiB and 1.151 s at
# 468, ``full`` 1.017 s at 542: 0.94x and 0.93x ``full``'s step without trims.
# An allowance that also counted plain checkpointing's profiled peak plus the
# whole blocks' bytes held the trims off for that IO-bound plan at 994 MiB
# (offload alone held 821 in the profile), and its timed steps peaked at
# 673-717 MiB above their start against the target's limit of 641: offload
# alone at the budget stays the measure.
#
# NOTE [plain without trims]
# The profile and the trial weigh plain checkpointing against the other plans
# under heap trims (NOTE [keep, offload, recompute], NOTE [trial steps]), and
# the trims cost plain checkpointing their page faults where they may buy it
# nothing (NOTE [trims a plan does without]). So where offload alone runs
# (chosen by the profile, or by a trial) or a tried plan was kept, plain
# checkpointing gets the trims' trial in its place: a first step not counted
# (the trim bound follows what the last step moved: NOTE [profiling under
# trims]; there, the other plan's), one under trims, two without, the trims'
# verdict as for a plan that moves nothing. Where its trims would be held off,
# the faster of its two steps without them is weighed against the plan's
# measured steps (offload alone's profiled ones, or the trial's), by time: the
# verdict has already found that what it holds without trims is within what
# it allows (offload alone's peak at the budget, or the step under trims), so
# the memory the other plan would save is not the user's to ask for (NOTE
# [plans within the noise] weighs plans whose memory the budget does not
# bound). Against a plan that moves activations (offload alone, an interleaved
# plan), a plain checkpointing within 5% (TIE) of the plan's time that held 5%
# (LEANER) less than it, or at most 5% more while moving 25% (LIGHTER) fewer
# bytes, wins too, as the profile's choices take the leaner or the lighter of
# two plans within the noise: the bytes moved cost more than the step shows.
# Against a tried plan that moves nothing (whole blocks within the budget beside
# plain ones) only a faster plain checkpointing wins: both hold within what the
# verdict allows, neither moves a byte, and the budget the whole blocks fill is
# what the user gave to buy time. Measured with ``bench/recompute.py --model
# llama`` with glibc's fast reuse off (docs/benchmarks.md) at 25%: the tried plan,
# one layer whole beside seven plain, ran 0.506 s a step without trims at 474 MiB,
# plain checkpointing 0.515 s at 432 MiB, within 5% and 9% leaner (the leaner of
# two plans within the noise); the plan runs, 0.85x ``full``'s step. Side by side
# with glibc's defaults and without trims (lanes added to that script, 14 rounds):
# three layers whole beside five plain 0.518 s, every layer plain under the
# engine 0.553 s, ``full`` 0.555 s. Plain checkpointing runs from then on if it
# won, its trims held off (with their ceiling). Else (without trims it held more
# than the verdict allows: it was weighed as it would run; or the plan won) the
# plan runs again as it was, under trims, with one trim at once (its first step
# trims at plain's bound); a tried plan that moves nothing then runs with the
# trims its trial judged (NOTE [trims a plan does without]). Where those are held
# off and plain checkpointing lost by time alone (it held within what its own
# verdict allows), plain stands in for the plan: should the plan's heap pass its
# ceiling twice within CEILING_STEPS steps, so that its trims would run again,
# plain checkpointing runs in its place, its trims held off under the ceiling of
# its own verdict, where its steps without trims ran faster than the plan's
# trial steps under them; if its heap passes that ceiling twice too, the trims
# run again for good, under whichever of the two ran faster with them (plain's
# profiled steps against the plan's trial steps; the leaner within the noise,
# NOTE [plans within the noise]). A plan whose heap cannot stay within its ceiling without
# trims is no longer the plan that was weighed: the stand-in is the fastest plan
# measured to hold within the bound without them. Not across ranks that agree
# (a rank's heap is its own, and their plans would part). Four steps of
# plain checkpointing, once per profile. Measured with ``bench/recompute.py
# --steps 8`` (the 24-block transformer, 2 CPU threads) at 50% of the saved
# bytes, in two runs: the trial kept the plan it tried (1.581 s a step; plain
# checkpointing under trims 1.756 s in the profile), and plain checkpointing
# without trims ran 1.463 s at 984 MiB (953 MiB with them) and replaced it:
# 1.02x the step of ``full`` by medians, where offload alone (``offload50``)
# ran 1.14x. In the other, plain checkpointing without trims
# ran 1.617 s, 3% faster than offload alone's 1.673 s in the profile, but at
# 1129 MiB against its 1019, 110 MiB more: offload alone
# stayed. At 10% plain ran 1.496-1.525 s without trims but held 1028-1060 MiB
# against 553-570 with them: offload alone stays. With
# glibc's fast reuse off (``GLIBC_TUNABLES``, ``--steps 5``) at 10%, plain
# checkpointing without trims ran 1.522 s at 525 MiB against offload alone's
# 1.518 s at 753 in the profile: by time alone offload alone ran, 1.07x
# ``full``'s step at a peak over the target's limit (479 MiB against 440). Ranks
# that agree on the plan take rank 0's word on whether plain is weighed and on
# whether it runs; where it runs, every rank holds its trims off. Not weighed:
# a block class that draws from a generator of the caller's own (never plain),
# no sampled peaks, no trims (a CUDA model).
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["CEILING", "TRIMS_SLACK", "TrimsVerdict", "ceiling_of", "trims_verdict_of"]

# NOTE [trims a plan does without]: the share of a step's saved bytes the heap may hold
# without trims beyond the step under them or offload alone (the peak slack).
TRIMS_SLACK = 0.05
# NOTE [trims a plan does without]: where the step under trims is unknown, or rank 0's
# word holds them off above this rank's allowance, trims held off trim once this much
# over the most the steps without them held.
CEILING = 0.05


class TrimsVerdict(NamedTuple):
    """NOTE [trims a plan does without]: whether the trims are held off, the most a step
    under them and the steps without them held, and what the verdict allows."""

    held: bool
    trimmed: int
    untrimmed: int
    allowed: float


def trims_verdict_of(trimmed: int, untrimmed: int, *, alone: int, saved: int) -> TrimsVerdict:
    """Whether trims are held off where a step under them held ``trimmed`` bytes and
    steps without them ``untrimmed`` at most: no more than that step or offload alone in
    the profile (``alone``; 0: unknown), whichever held more, and TRIMS_SLACK of the
    bytes a step saves (``saved``); with the two peaks and that allowance."""
    allowed = max(trimmed, alone) + TRIMS_SLACK * saved
    return TrimsVerdict(0 < trimmed and 0 < untrimmed <= allowed, trimmed, untrimmed, allowed)


def ceiling_of(verdict: TrimsVerdict) -> int | None:
    """Where trims held off by ``verdict`` trim once: what it allows (the peak the
    budget has been measured to take); CEILING over what the steps without them held
    where that is more (held by rank 0's word) or where the step under them is unknown;
    None where the untrimmed peak is unknown (held by rank 0's word)."""
    if not verdict.untrimmed:
        return None
    drift = verdict.untrimmed * (1 + CEILING)
    within = verdict.trimmed and verdict.untrimmed <= verdict.allowed
    most = verdict.allowed if within else drift
    return int(most) if math.isfinite(most) else None
