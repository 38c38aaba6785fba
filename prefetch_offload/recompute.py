"""The automatic keep / offload / recompute policy: it profiles, plans and weighs the plan
for each op output of a checkpointed block (the profile: recompute_profile.py; the plan
made from it: recompute_planner.py; the plan in force and the steps that still weigh
it: recompute_weighing.py; the heap trims' verdict: recompute_trims.py; what was
decided, printed: recompute_plan.py).

# NOTE [keep, offload, recompute]
# Each wrapped block runs whole (not checkpointed: what autograd saves goes to
# the engine), checkpointed plainly (``torch.utils.checkpoint`` with no
# dispatch mode: recomputed whole), or selectively (the dispatch modes of
# checkpointing.py: each op output is stored, i.e. handed to the engine, which
# keeps the newest within ``device_budget`` and moves the rest, or recomputed).
# NOTE [block modes] in blocks.py. The automatic policy measures nine steps,
# then decides once per block and once per op position (the n-th op of an
# overload in a block class: NOTE [op keys] in checkpointing.py):
#
# - Profiling: (1) every block whole: the bytes each hands to the engine (its
#   live records before and after its forward), and the first calls warm up;
#   (2) every op output offloaded, each op timed (on CUDA, synchronized around
#   it); (3) and (4) every output recomputed, each op timed again; (5) to (7)
#   every block whole again, the step that offload alone takes at this budget;
#   (8) and (9) as (3) and (4). Per op position the compute time is the median
#   over every block and the timed steps, times its calls in a step; a block's
#   forward runs from its entry to its return, its backward from backward
#   reaching its output to backward reaching the block before; a step's figures
#   are its median block times the blocks, so a slow block (another process on
#   the cores) moves them little. The two plans the profile compares,
#   checkpointing and offload alone, count only in steps that follow a step of
#   their own kind, (4) and (9), (6) and (7), and the step of each pair whose
#   figures are lower counts, so a slow step does not decide between them
#   either: on this project's 2-core VM two runs of one mode differ by up to
#   16% a step, more than the modes often differ by. A step after one of the
#   other kind inherits that step's heap: after a whole step's trims, a
#   recompute-all step touches again the pages they gave back (NOTE [heap
#   trim] in heap.py). Measured on the 8-layer Llama of ``bench/recompute.py
#   --model llama`` at 50% of the saved bytes, one process, runs of three steps
#   of each kind in turn: recompute-all steps right after a step of another
#   kind took 1.02-1.32 s with 33k-67k page faults, the two after each 0.91-1.19 s with
#   0-52k; whole steps 0.98-1.41 s (88k-157k) whichever kind came before. So
#   were the whole and recompute-all steps to alternate, the recompute-all
#   steps would pay the whole steps' trims. Both pairs
#   sit at the same mean position, as the first steps of a process run slower
#   (that run: 1.19-1.24 s for the whole steps of the first run of three,
#   0.98-0.99 s for those of the third). Also measured, in step (2): the
#   bytes the engine moved (``O0``), the forward and backward stalls on writes
#   and reads (``Ef``, ``Eb``), the IO threads' read bandwidth ``R``, forward
#   and backward times (``Tf``, ``Tb``), the step (``Sa``); in step (3), next
#   to it, the step ``Sr``; which outputs the recompute read back.
# - Whole blocks: the newest blocks whose bytes (step 1) fit ``device_budget``
#   together run whole: the engine keeps their saved tensors anyway, so they
#   cost neither recompute nor moves nor the dispatch modes. They share the
#   budget with what the model saves outside the blocks (step 1: the engine's
#   live bytes as the first block call begins, and what it packs from the last
#   block's return until backward reaches a block: the head and the loss) and
#   with the inputs of the blocks it does not keep (step 3: what a checkpointed
#   block hands the engine), so a plan of whole and plain blocks moves nothing.
#   On the 8-layer Llama of ``bench/recompute.py --model llama`` at 50% of the
#   saved bytes (176.5 MiB; 41 MiB a layer, 32 MiB beside), the four newest
#   layers whole and the rest plain moved 15 MiB a step and held 431 MiB
#   without trims, over the target's limit of 415; three whole moved nothing
#   and held 360 (one run, modes side by side). A block the model calls more
#   than once a step (shared weights) counts the bytes and the forward seconds
#   of every call.
# - Per op, for the other blocks: moving O bytes costs ``k*O`` plus what compute
#   cannot hide, ``max(Ef*O/O0, O/W - Hf) + max(Eb*O/O0, O/R - Hb)``,
#   ``Hf = Tf - Ef``, ``Hb = Tb - Eb`` plus the recompute time chosen,
#   ``W = O0/Tf``. The stalls step (2) measured, in proportion to the bytes,
#   bound the exposure from below: reads that would fit in backward's compute by
#   bandwidth alone still stalled there (the 24-block transformer at 25%: 1.6 s
#   of stalls where bandwidth predicted none, and a plan that offloaded nearly
#   everything ran 1.37x offload alone's step). So the model meets its anchor:
#   moving everything costs what step (2) measured. ``k`` is what
#   moving cost step (2) beyond the stalls: ``(Sa - (Sr - C) - Ef - Eb) / O0``,
#   ``C`` the compute step (3) spent on what step (2) read back (on a CPU the IO
#   threads' share of the cores and page faults; on a GPU near zero). Positions
#   in order of compute seconds per byte, cheapest first: each is recomputed when
#   its compute time is below what its bytes cost to move, else offloaded. Never
#   read back by the recompute: recomputed (free). Views, ``_unsafe_view``
#   (its output is its input's memory, though its schema marks no alias) and
#   in-place ops: recomputed (storing one would keep another tensor alive, or
#   move its bytes twice). Random ops: recomputed (NOTE [random ops] in
#   checkpointing.py); one given a generator of the caller's own: stored, and
#   its block never runs plainly (its recompute would draw anew). An output a
#   later op of the forward writes is recomputed whatever the plan said (NOTE
#   [cache entry mutation]).
# - Plain or selective: selective only when its offloads save more (compute
#   time less move cost, summed) than the dispatch modes cost the blocks, by more
#   than 5% of the recompute-all step (SELECTIVE_MARGIN in recompute_planner.py:
#   a trial tells no smaller difference, NOTE [plans within the noise] there);
#   else every non-whole block is checkpointed plainly and its ops all recompute. (On the CPU
#   benchmarks of ``bench/recompute.py`` the net gain was at most 6 ms of a
#   0.55-1.8 s step, and a selective plan moves the bytes the budget does not
#   keep.)
#   The cost per block is DISPATCH_SWITCH (recompute_planner.py) times the
#   median block's time in the modes in the recompute-all steps, forward and
#   recompute (their ``__torch_dispatch__`` beyond the ops: NOTE [dispatch cost]
#   in checkpointing.py); the factor adds the switch into Python that the span
#   misses (a cheap op costs 8.8 us more under the forward mode, 5.9 us of it
#   in ``__torch_dispatch__``). A sum of
#   many short spans is steady; the difference of two block times is not: a
#   heap trim or another process lands in one block and not the other. Measured
#   on the 8-layer Llama of ``bench/recompute.py --model llama`` (2 CPU threads;
#   70 ops a block forward, 100 in the recompute): the modes measured 1.8-2.6
#   ms a block; whole steps with every layer selective and recomputing
#   everything against every layer plain, heap trims off, each in its own
#   process, three pairs: medians 1.19 / 1.04 / 1.12 s against 1.16 / 1.16 /
#   1.16 s, no difference above the noise; a paired step with trims on had
#   shown 15-90 ms a block, and chose plain and selective by turns.
# - Offload alone: where the plan so far checkpoints the blocks the budget
#   does not keep plainly (selective not worth its dispatch cost), and of steps
#   (6) and (7) against steps (4) and (9) less the dispatch modes' cost per
#   block (NOTE [trial steps]) the first are the faster, unless the others,
#   within 5% of them, held 5% less memory, or at most 5% more and moved 25% fewer
#   bytes; or, within 5% of the others, held 5% less (NOTE [plans within the
#   noise]): offload alone beat plain
#   checkpointing: every other one of those blocks runs whole instead, the
#   engine moving what it saves (NOTE [interleaved blocks]); with one such block,
#   where the budget keeps none, every block whole. A plan between the two is
#   tried against both; where offload alone runs, plain checkpointing is tried
#   again without the heap trims (NOTE [plain without trims] in recompute_trims.py). On the CPU,
#   where the IO threads and the recompute share the cores, offload alone is
#   often faster at small budgets on a fast disk; never on a disk slower than
#   forward saves.
#   The plan also prints estimates from block medians (``step_whole_s``,
#   ``step_checkpointed_s``: over the blocks the budget does not keep, the
#   median block of each kind times those blocks, plus the kept blocks whole),
#   which do not decide: on the 8-layer Llama of ``bench/recompute.py --model
#   llama`` they put offload alone 21-22% ahead at 10% and 25% of the saved
#   bytes (0.864 and 0.943 s against 1.100 and 1.173 s), and offload alone,
#   chosen on them, then ran 1.08 and 1.11 s a step against 0.97 s for
#   checkpointing without the engine (one run, 8 rounds).
# - Re-planning: a block or, in a selective block, an op position that the
#   profile did not see profiles again, once for each: one the new profile
#   misses too (it ran only in steps that see no ops, as an op of longer
#   sequences can when every fifth batch is longer) runs as the profile runs it
#   (an op stored, a block plain) and profiles nothing again. A block run whole
#   or plainly has no per-op plan to go stale. A plain block's op outputs count
#   as recomputed in the engine's per-step stats, as ``"full"`` counts them
#   (NOTE [plain blocks counted] in checkpointing.py). A measured step whose
#   forward was abandoned runs again: NOTE [abandoned forwards].
# - A ``device_budget`` below what one block's recompute holds at once (what it
#   saves for backward, step 1) cannot be met by any plan: NOTE [a budget no plan
#   reaches].
# - Trial: a plan the profile did not run as it is, selective blocks or whole
#   blocks beside checkpointed ones, runs three steps, and yields to a profiled
#   plan that ran faster, unless the trial, within 5% of it, held at least 5%
#   less, or at most 5% more and moved at least 25% fewer bytes; or to one within
#   5% of the fastest that held at least 5% less than it (NOTE [trial steps],
#   NOTE [plans within the noise] in recompute_planner.py).
# - Not in the cost model: the heap trims (NOTE [heap trim] in heap.py). Every
#   plan runs under them (the trial sees them), and on the CPU they are what
#   separates a checkpointed plan from checkpointing without the engine; a plan
#   that moves nothing then weighs them (NOTE [trims a plan does without] in recompute_trims.py).
#   Measured on the 8-layer Llama of ``bench/recompute.py --model llama``:
#   selective plans at 25% and 50% of the saved bytes ran at 1.18-1.32x
#   ``full``'s step (per-round median ratios) with trims, at peaks of 261-333
#   MiB. Without trims they ran at 0.90-1.04x, at 381-428 MiB. The peak limits
#   there are 291 and 379 MiB. (One run of ``bench/recompute.py --model llama
#   --steps 8`` with two lanes beside its modes: auto with no block kept whole,
#   once with the default heap trims and once with ``heap_trim_bytes=None``; the
#   25% and 50% plans came out selective.) A trim level taken from the profile
#   (no trims while the process holds less than the recompute-all step's peak
#   plus the budget) met the time at 25% and 50% in two runs (1.02-1.03x and
#   0.93-0.95x ``full``), with peaks 13-69 MiB over the limits at every budget:
#   that step, under the dispatch modes and the trims, holds more than
#   checkpointing without them.
#
# The measured figures decide, not a list of op names: on the benchmark
# transformer the norms, activation functions and residual adds come out cheap
# to recompute and the matmul and attention outputs expensive, on the CPU as
# the field reports on GPUs; with a fast enough link nothing is recomputed.
#
# NOTE [trial steps]
# The profile runs two plans as they are: every block whole (offload alone,
# steps (6) and (7)) and every block checkpointed with every output recomputed
# (steps (4) and (9): plain checkpointing, plus the dispatch modes' cost).
# Their walls, each step timed from its first block's forward to the end of its
# last backward (autograd's final callback), decide between the two (NOTE
# [keep, offload, recompute]). A plan between them, whole blocks beside
# checkpointed ones or selective blocks, is an estimate from block medians, and
# misses what the mix does to the step as a whole. On the CPU that is the heap
# trims (NOTE [heap trim] in heap.py): the whole blocks fill ``device_budget``,
# which was the trims' allowance, so near the end of forward the trimmer gives
# back free heap that backward then touches again. Measured on the 8-layer
# Llama of ``bench/recompute.py --model llama`` at 50% of the saved bytes (one
# run, each mode in a process of its own, side by side): four layers whole and
# four plain, estimated at 1.002 s for the blocks, ran 1.155 s a step with 2.0
# trims and 86k page faults, 1.08x checkpointing without the engine; every
# layer plain under the engine at the same budget ran 1.026 s (1.04x) with 0.1
# trims and 18k faults. (A trace of that plan's steps: trims at the last
# layer's forward and at the head's backward, each giving back 115-177 MiB.) So
# such a plan is tried. Its first planned step learns the prefetch order (NOTE
# [learned order] in plan.py) and is not counted; the next two are timed alike
# (a plan that moves nothing runs two more, without trims: NOTE [trims a plan
# does without]), and the faster is set against the faster of each profiled plan's two steps,
# timed alike (plain's less the dispatch modes' cost per block). The fastest of
# the three (or one within 5% of it that held at least 5% less: NOTE [plans
# within the noise]) runs from then on, until a new structure profiles again,
# and the printed plan says which, with the three figures. The walls include
# the head and the loss, alike for the three, and not what the loop does
# between steps (the optimizer, the data loader, an evaluation, a benchmark's
# other processes). On this project's 2-core VM the steps of one mode spread
# from 13% below to 17% above their median (eight rounds of checkpointing
# without the engine in the run above), so plans closer than that may go either
# way; the trial catches a plan clearly slower than one the profile ran.
#
# NOTE [abandoned forwards]
# A step starts at the first block forward after a backward, so that gradient
# accumulation (several forwards, then their backwards) is one step. A forward
# that raised, or whose loss was dropped without a backward (an evaluation
# with grad enabled), has no backward, and the next forward continues its
# step: its measurements would join that step's (ops that no recompute runs
# counted in each position's bytes and calls, a block's saved bytes counted
# twice, which changes the blocks a budget keeps whole, and a wall over two
# forwards). So each step counts its block calls entered, returned, and
# reached by backward (the block's output hook, once per call and backward
# pass). A measured step (a profiling step, a trial step, a step of the trims'
# trial) in which a call never returned or backward never reached one runs
# again: a profiling step's measurements go (the op positions' as they were
# before it, its block spans and dispatch times; the offload-all step's
# engine counters start again), and a trial step does not count. Unless the
# step before abandoned one too: a loop that abandons a forward every step (a
# validation loss computed with grad on and dropped, a block output that
# backward never reaches by design) counts its steps as they are, and its
# profile takes one step more, not twice as many. Ranks that agree on the plan
# (NOTE [ranks agree] in agreement.py) decide it together for a profiling or
# trial step: a step one rank runs again, every rank runs again, or their
# later exchanges would not meet. A step that runs again is of its own kind
# for the heap trims too (NOTE [profiling under trims]): its bound, and no
# trim for a change of plan. The engine asks for the bound at a pack, which
# may come between two backwards of one step, so there the decider only
# guesses from this rank's calls so far, and decides when the next block
# forward begins: with ranks agreeing, a rank whose own forwards all returned
# takes, in a step another rank's abandoned forward makes run again, the next
# kind's bound and one trim.
#
# NOTE [profiling under trims]
# The default trim bound follows the bytes the last step moved (NOTE [heap trim]
# in heap.py), which in training is the step before, alike. The profiling steps
# alternate: a recompute-all step moves the block inputs only, and the whole
# step after it trimmed at the 64 MiB floor, many times, where a plan of whole
# blocks trims at a quarter of what it moves; the recompute-all step after a
# step that moved everything trimmed at that step's large bound. Each was timed
# under the other's trims, against offload alone and for checkpointing. So in
# a step of the profile the bound follows the bytes the last step of its class
# moved (``trim_basis``): whole steps, the offload-all step, recompute-all
# steps (the first of which follows none: the floor), and planned steps. On
# the 24-block benchmark transformer at a 10% budget (2 CPU threads, one run
# each way), the two whole profiling steps ran 3.85 and 3.61 s with 17 trims
# each, against 2.60-2.94 s and 3-5 trims for the same plan once made; with
# the bound by class they ran 2.86 and 2.75 s with 2 and 5 trims, and the
# plan's steps 2.67-3.02 s, while the recompute-all steps went from 1-3 trims
# to 9-10, as checkpointed plans trim once made.
#
# NOTE [a trim where the plan changes]
# glibc keeps the heap a step leaves resident (NOTE [heap trim] in heap.py), so
# a step of one kind after steps of another runs on their heap: its allocations
# land on pages already resident (fewer page faults: faster than it runs on its
# own heap) and its peak RSS starts from their high-water mark (higher than its
# own), until its own trims give that back, which at a bound of a quarter of
# the bytes moved can take several steps. Measured on the 8-layer Llama of
# ``bench/recompute.py --model llama`` at 25% of the saved bytes, one process,
# six steps of offload alone then six with every layer checkpointed (two runs
# each way): without a trim between them the checkpointed steps ran 0.83-1.06 s
# at peaks of 213-326 MiB, the first three to five of them above 246 MiB; with
# one ``malloc_trim`` between them, 0.99-1.09 s at 190-233 MiB from the first.
# So a step whose trim class (``trim_basis``) differs from the last one's asks
# the engine's trimmer for one trim as its forward begins, whatever the slack:
# in the profile, the first step of each kind pays the refaults and is not the
# one counted (NOTE [keep, offload, recompute]); after it, the first planned
# step, which the trial does not count either (NOTE [trial steps]). A trial
# that replaces its plan asks for one too. Later planned steps trim only on the
# slack.
# On a CUDA model the same moments also empty PyTorch's caching allocator
# (``torch.cuda.empty_cache``, never inside a graph capture): it keeps reserved
# the blocks the profile's steps of other plans left, and reserved memory is
# the peak a user reads. Measured on an H200 (``bench/recompute.py --gpu``, the
# bf16 Llama shape at 25%): the planned steps held 1592 MiB reserved without
# it and 1138 MiB with it, against 992 MiB under ``recompute="full"``.
"""

from __future__ import annotations

import json
import math
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .agreement import AGREE_EVERY, RankAgreement
from .blocks import PLAIN, SELECTIVE, WHOLE
from .checkpointing import (
    CheckpointStats,
    OpKey,
    draws_own_generator,
    draws_random,
)
from .checkpointing import output_aliases as _aliases  # (storing one moves its bytes twice)
from .errors import OffloadFallbackWarning
from .peak import PeakSampler
from .recompute_plan import (
    OpDecision,
    Position,
    RecomputePlan,
    RecordingDecider,
)
from .recompute_planner import (
    Weighed,
    make_plan,
)
from .recompute_profile import (
    OFFLOAD_ALL,
    PLANNED,
    PROFILE,
    RECOMPUTE_ALL,
    WHOLE_ALL,
    WHOLE_TIMED,
    Profile,
)
from .recompute_weighing import ActivePlan, Weighing
from .stats import OffloadStats

__all__ = ["AutoDecider", "OpDecision", "RecomputePlan", "RecordingDecider"]

# Whether a plan may run every block whole where offload alone measured fastest (tests
# of the checkpointed paths turn it off, for a plan they can predict).
OFFLOAD_ALONE = True
# Whether a plan where offload alone beat plain checkpointing interleaves the two (NOTE
# [interleaved blocks]); tests that follow offload alone's plan turn it off.
INTERLEAVE = True
# Whether a plan the profile did not run as a whole is tried (NOTE [trial steps]); tests
# that follow a selective or mixed plan step by step turn it off.
TRIAL = True
# NOTE [profiling under trims]: steps alike in the bytes they move.
_TRIM_CLASS = {
    WHOLE_ALL: "whole",
    WHOLE_TIMED: "whole",
    OFFLOAD_ALL: "stored",
    RECOMPUTE_ALL: "checkpointed",
    PLANNED: "planned",
}
_PHASE_MODE = {
    WHOLE_ALL: WHOLE,
    OFFLOAD_ALL: SELECTIVE,
    RECOMPUTE_ALL: SELECTIVE,
    WHOLE_TIMED: WHOLE,
}


def _sync_device() -> None:
    """Wait for the CUDA work queued so far, where CUDA runs (NOTE [trial steps]: a step's
    time on a GPU is its kernels', not the host's queueing)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class AutoDecider:
    """``recompute="auto"``: profile nine steps, then decide per block and per op position.

    Steps (NOTE [keep, offload, recompute]): every block whole (the bytes each saves),
    every op output offloaded and timed, every output recomputed and timed (with the
    dispatch modes' own time) twice, every block whole again (offload alone's step)
    three times, and every output recomputed twice more; then the plan holds, after
    three trial steps where the profile did not run it as it is (NOTE [trial steps]). A
    step starts at the first block forward after backward reached a block. Implements
    both :class:`~prefetch_offload.checkpointing.Decider` and
    :class:`~prefetch_offload.blocks.BlockModes`.

    Args:
        stats: the engine's counters now (bytes moved, stalls, read bandwidth, tiers).
        device_budget: the engine's ``device_budget``: what whole blocks may hold.
        clock: time source (tests pass a fake one).
        checkpoint_stats: told when each step begins and when its backward ends.
        trim_heap: asks the engine for one heap trim (NOTE [a trim where the plan
            changes]).
        hold_trims: holds the engine's heap trims off (True; with one trim where the
            process's anonymous resident memory passes the ceiling given, if any, and
            the trims back where it passes it twice within CEILING_STEPS steps) or
            lets them run (False) (NOTE [trims a plan does without]); None: no trims
            to weigh.
        trims_held: whether the engine's trims are held off now (a process past the
            ceiling twice within CEILING_STEPS steps lets them run again); None: as
            ``hold_trims`` last said.
        peaks: samples the memory the measured steps hold (NOTE [plans within the
            noise]); None: plans go by time alone.
        agreement: the ranks that decide together (NOTE [ranks agree] in
            agreement.py); None decides alone.
    """

    def __init__(
        self,
        stats: Callable[[], OffloadStats],
        device_budget: int,
        *,
        clock: Callable[[], float] = time.perf_counter,
        checkpoint_stats: CheckpointStats | None = None,
        trim_heap: Callable[[], None] = lambda: None,
        hold_trims: Callable[[bool, int | None], None] | None = None,
        trims_held: Callable[[], bool] | None = None,
        peaks: PeakSampler | None = None,
        agreement: RankAgreement | None = None,
    ) -> None:
        self._stats = stats
        self._agreement = agreement
        self._planned_steps = 0  # NOTE [ranks agree]: since the last plan, for the checks
        # NOTE [plans within the noise] in recompute_planner.py: sampled while the plan is
        # measured.
        self._peak_source = peaks
        self._step_peak: int | None = None  # the step's, taken as its backward ended
        self._closed = False
        self._budget = device_budget
        self._clock = clock
        self._ckpt_stats = checkpoint_stats
        self._lock = threading.RLock()
        # What the profiling steps measured (NOTE [keep, offload, recompute]).
        self._profile = Profile(stats, clock)
        # Block classes with an op that draws from a generator of the caller's own: their
        # blocks never run plainly (their recompute would draw again); those op positions.
        self._own_rng: set[str] = set()
        self._own_draws: set[Position] = set()
        # The plan the blocks and ops follow, and the steps that still weigh it.
        self._active = ActivePlan(self._own_draws)
        self._weighing = Weighing(
            self._active,
            trim_heap=trim_heap,
            hold_trims=hold_trims,
            trims_held=trims_held,
            weighs=hold_trims is not None and peaks is not None,
            own_rng=self._own_rng,
            stop_sampling=lambda: self._sample_peaks(False),
            agreement=agreement,
        )
        self._trim_heap = trim_heap  # NOTE [a trim where the plan changes]
        self._step_no = 0  # the profiling step now (an index in PROFILE)
        self._phase = PROFILE[0]  # its kind, or PLANNED
        self._ended = PLANNED  # the kind of the step before this one
        # NOTE [profiling under trims]: the bytes the last step of each class moved.
        self._moved_by: dict[str, int] = {}
        self._stale = False  # an unplanned block or position appeared: profile again
        # The blocks and op positions that made a profile start again (NOTE [keep,
        # offload, recompute]: once each).
        self._replanned_for: set[Any] = set()
        # NOTE [abandoned forwards]: the step's block calls entered, returned and reached
        # by backward; whether the step before abandoned a forward.
        self._calls = [0, 0, 0]
        self._abandoned = False
        self._in_backward = False
        self._warned = False
        # The start of the step now, and the end of its last backward (NOTE [trial steps]).
        self._step_start: float | None = None
        self._backward_end: float | None = None
        self._end_queued = False
        # NOTE [plans within the noise] in recompute_planner.py: the engine's
        # bytes_offloaded as the step now began.
        self._offloaded = 0

    # -- BlockModes -------------------------------------------------------------------------

    def mode(self, kind: str, index: int) -> str:
        with self._lock:
            if self._in_backward:
                self._step_started()
            if self._phase != PLANNED:
                return _PHASE_MODE[self._phase]
            how = self._active.modes.get((kind, index))
            if how is None:  # a block the profile did not see: profile again
                self._unplanned((kind, index))
                how = PLAIN
            if how == PLAIN and kind in self._own_rng:  # NOTE [random ops] in
                return SELECTIVE  # checkpointing.py: its draws are stored
            return how

    def entered(self, kind: str, index: int) -> None:
        with self._lock:
            self._calls[0] += 1  # NOTE [abandoned forwards]
            if self._phase != PLANNED:
                self._profile.entered(self._step_no, (kind, index))

    def exited(self, kind: str, index: int) -> None:
        with self._lock:
            self._calls[1] += 1  # NOTE [abandoned forwards]
            if self._phase != PLANNED:
                self._profile.exited(self._step_no, (kind, index))

    def backward(self, kind: str, index: int) -> None:
        with self._lock:
            self._calls[2] += 1  # NOTE [abandoned forwards]
            self._in_backward = True
            if self._phase != PLANNED:
                self._profile.reached(self._step_no, (kind, index))
            if not self._end_queued:  # NOTE [trial steps]: the step's time ends with it
                try:
                    torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
                    self._end_queued = True
                except RuntimeError:  # not inside a backward (a test's own calls)
                    pass

    def _backward_ended(self) -> None:
        """Autograd's final callback of a backward that reached a block."""
        with self._lock:
            self._end_queued = False
            if self._ckpt_stats is not None:
                self._ckpt_stats.step_ended()
            if self._timing():
                _sync_device()
            if self._measuring() and self._peak_source is not None:
                peak = self._peak_source.take()  # NOTE [plans within the noise]
                self._step_peak = max(self._step_peak or 0, peak) if peak else 0
            self._backward_end = self._clock()

    # -- Decider ----------------------------------------------------------------------------

    def decide(self, key: OpKey, func: Any, args: Any, kwargs: Any, out: Any) -> CheckpointPolicy:
        with self._lock:
            pos: Position = (key[0], func, key[3])
            if draws_own_generator(func, args, kwargs):  # NOTE [random ops]
                self._own_rng.add(key[0])
                self._own_draws.add(pos)
                if self._phase == OFFLOAD_ALL:
                    self._profile.fixed[pos] = "generator"
                return CheckpointPolicy.PREFER_CPU_OFFLOAD
            random = draws_random(func, args, kwargs)
            fixed = random or _aliases(func)
            if fixed and self._phase == OFFLOAD_ALL:
                self._profile.fixed[pos] = "random" if random else "alias"
            if self._phase == RECOMPUTE_ALL or fixed:
                return CheckpointPolicy.PREFER_RECOMPUTE
            if self._phase != PLANNED:
                return CheckpointPolicy.PREFER_CPU_OFFLOAD
            policy = self._active.plan.get(pos)
            if policy is None:  # NOTE [keep, offload, recompute]: profile again
                self._unplanned(pos)
                return CheckpointPolicy.PREFER_CPU_OFFLOAD
            return policy

    def timing(self) -> bool:
        # The selective profiling steps whose step time the plan does not compare time
        # their ops (on CUDA, a synchronize each: NOTE [trial steps]).
        if self._phase == OFFLOAD_ALL:
            return True
        counted = Profile.counted(RECOMPUTE_ALL)
        return self._phase == RECOMPUTE_ALL and self._step_no not in counted

    def observe(self, key: OpKey, func: Any, out: Any, seconds: float, policy: Any) -> None:
        with self._lock:
            if self._phase in (OFFLOAD_ALL, RECOMPUTE_ALL):
                self._profile.observed(self._step_no, key, func, out, seconds)

    def recomputing(self) -> None:
        with self._lock:
            self._in_backward = True

    def consumed(self, key: OpKey) -> None:
        with self._lock:
            self._in_backward = True
            if self._phase == OFFLOAD_ALL:
                self._profile.consumed(key)

    def overruled(self, key: OpKey, func: Any, out: Any, policy: CheckpointPolicy) -> None:
        pass  # (it answers recompute for every op that writes an input: never overruled)

    def dispatched(self, block: tuple[str, int], seconds: float) -> None:
        with self._lock:
            if self._phase != PLANNED:
                self._profile.dispatched(self._step_no, block, seconds)

    def close(self) -> None:
        """Stop sampling memory, for good (the context exits); a weighing of plain
        checkpointing ends unjudged (the plan made last is the plan)."""
        with self._lock:
            self._closed = True
            self._weighing.close()
            self._sample_peaks(False)

    # -- the heap trims ---------------------------------------------------------------------

    def trim_basis(self, moved: int) -> int:
        """The bytes the heap trim bound follows in the step that begins now, the step that
        ended having moved ``moved`` (NOTE [profiling under trims]): what the last step of
        the new step's class moved (an interleaved plan's: what offload alone moved, NOTE
        [interleaved blocks]); a step of another class than the last asks for a trim.
        Called once per step, when its forward begins, before or after the first block
        forward."""
        with self._lock:
            if self._in_backward:  # the first block has not run yet: the phase will move
                ended, upcoming = self._phase, self._next_phase()
            else:
                ended, upcoming = self._ended, self._phase
            self._moved_by[_TRIM_CLASS[ended]] = moved
            if upcoming != PLANNED:  # a new profile: under trims, as every profile
                self._weighing.hold(False)
            if _TRIM_CLASS[ended] != _TRIM_CLASS[upcoming]:
                self._trim_heap()  # NOTE [a trim where the plan changes]
            default = 0 if _TRIM_CLASS[upcoming] == "checkpointed" else moved
            if upcoming == PLANNED and self._active.measured.get("blocks_interleaved"):
                # NOTE [interleaved blocks]: the bound offload alone ran under
                return self._moved_by.get("whole", default)
            return self._moved_by.get(_TRIM_CLASS[upcoming], default)

    def _next_phase(self) -> int:
        """The kind of step _step_started will begin."""
        if self._phase == PLANNED:  # (with ranks agreeing, this rank's view of a check)
            checks = self._checks(self._planned_steps + 1)
            return PROFILE[0] if self._stale and checks else PLANNED
        if self._runs_again(alone=True):  # NOTE [abandoned forwards]: its own kind again
            return self._phase
        following = self._step_no + 1
        return PROFILE[following] if following < len(PROFILE) else PLANNED

    # -- planning ---------------------------------------------------------------------------

    def _step_started(self) -> None:
        """The first block forward after backward began: the next phase."""
        self._in_backward = False
        self._ended = self._phase
        if self._timing():
            _sync_device()
        now = self._clock()
        wall = self._ended_wall(now)
        peak = self._ended_peak()
        offloaded = self._stats().bytes_offloaded  # NOTE [plans within the noise]
        moved, self._offloaded = offloaded - self._offloaded, offloaded
        self._step_start, self._backward_end, self._end_queued = now, None, False
        if self._ckpt_stats is not None:
            self._ckpt_stats.step_began()
        again = self._runs_again()  # NOTE [abandoned forwards]
        self._abandoned, self._calls = self._abandoned_calls(), [0, 0, 0]
        if self._phase == PLANNED:
            self._weighing.released()
            stale = self._agreed_stale()
            if not stale and not again:
                self._weighing.step_ended(Weighed(wall, peak, moved))
            if stale:
                self._weighing.stop()
                self._profile.reset()
                self._moved_by.clear()  # NOTE [profiling under trims]: a new profile
                # (and its offload-all step sees again which classes draw their own)
                self._own_rng.clear()
                self._own_draws.clear()
                self._step_no, self._phase = 0, PROFILE[0]
            return
        if again:
            self._profile.forget(self._step_no)
            return
        self._profile.step_ended(self._step_no, now, wall, peak, moved)
        self._step_no += 1
        if self._step_no < len(PROFILE):
            self._phase = PROFILE[self._step_no]
            return
        self._make_plan()
        self._profile.reset()
        self._phase, self._planned_steps = PLANNED, 0
        if not self._weighing.trial_left:
            self._weighing.begin_trims_trial()

    def _abandoned_calls(self) -> bool:
        """Whether a block call of the step so far raised, or backward has not reached it
        (NOTE [abandoned forwards])."""
        entered, returned, reached = self._calls
        return entered > returned or returned > reached

    def _runs_again(self, *, alone: bool = False) -> bool:
        """Whether the step that ends now runs again (NOTE [abandoned forwards]): a
        measured step with a block call that raised or that backward never reached,
        unless the step before had one too. With ranks agreeing on the plan, decided
        together for a profiling or trial step (NOTE [ranks agree] in agreement.py), so
        that they stay in step; ``alone``: this rank's guess, which changes nothing
        (trim_basis asks at a pack, which may come between two backwards)."""
        again = self._abandoned_calls() and not self._abandoned and self._measuring()
        if self._agreement is not None and self._timing() and not alone:
            again = self._agreement.any(again)
        return again

    def _unplanned(self, what: Any) -> None:
        """A block or op position the plan lacks: the next step profiles again, once for
        each (one the new profile missed too, as it ran only in steps that see no ops,
        runs as the profile runs it from then on)."""
        if what not in self._replanned_for:
            self._replanned_for.add(what)
            self._stale = True

    def _agreed_stale(self) -> bool:
        """Whether the step that begins now profiles again: this rank saw a new structure
        or, with ranks agreeing (NOTE [ranks agree] in agreement.py), some rank saw one
        by a check. Called once per planned step."""
        self._planned_steps += 1
        if not self._checks(self._planned_steps):
            return False  # (this rank's new structure waits for the check)
        stale, self._stale = self._stale, False
        return stale if self._agreement is None else self._agreement.any(stale)

    def _checks(self, planned_steps: int) -> bool:
        """Whether the planned step of this number acts on a new structure: every one
        deciding alone, every AGREE_EVERY-th with ranks agreeing (NOTE [ranks agree])."""
        return self._agreement is None or planned_steps % AGREE_EVERY == 0

    def _ended_peak(self) -> int:
        """The most memory the step that ends now held, from its first block's forward
        to the end of its last backward (NOTE [plans within the noise]); what came after
        its backward (the optimizer, the loop) is dropped. 0 if unknown."""
        source, peak, self._step_peak = self._peak_source, self._step_peak, None
        if source is None or not (self._measuring() or self._stale):
            return 0  # (a plan that runs: nothing measured)
        since = source.take()  # (a backward end not seen: the whole span)
        self._sample_peaks(True)  # (the first step's end, or a new profile: sampling begins)
        return since if peak is None else peak

    def _timing(self) -> bool:
        """Whether the step now is timed: a profiling step, a trial step (NOTE [trial
        steps]) or a step of plain checkpointing weighed against offload alone (NOTE
        [plain without trims])."""
        return self._phase != PLANNED or self._weighing.timing

    def _measuring(self) -> bool:
        """Whether the step now is measured: a profiling step, a trial step (NOTE [trial
        steps]) or a step of the trims' trial (NOTE [trims a plan does without])."""
        return self._phase != PLANNED or self._weighing.measuring

    def _sample_peaks(self, on: bool) -> None:
        """Sample memory while the plan is measured (not after the context exits)."""
        if self._peak_source is not None:
            if on and not self._closed:
                self._peak_source.start()
            elif not on:
                self._peak_source.stop()

    def _ended_wall(self, now: float) -> float:
        """The time of the step that ends now (NOTE [trial steps]): from its first block's
        forward to the end of its last backward, or (no backward end seen) to now."""
        start, end = self._step_start, self._backward_end
        if start is None:
            return math.inf  # (the first step: its start was not seen)
        return (end if end is not None and end > start else now) - start

    def _make_plan(self) -> None:
        """The profile ended: make the plan (recompute_planner.py), and try it or weigh its
        trims."""
        planned = make_plan(
            self._profile,
            self._budget,
            may_run_alone=OFFLOAD_ALONE,
            may_interleave=INTERLEAVE,
        )
        self._active.adopt(planned)
        self._weighing.plan_made(planned, tried=TRIAL and planned.tried)
        if self._agreement is not None:
            self._take_first_ranks_plan(self._agreement)
        self._weighing.trial_begins()
        self._active.obs = dict(self._profile.obs)  # (cleared once no trial can change it)
        self._active.summarize()
        self._warn_budget(planned.unreachable)

    def _take_first_ranks_plan(self, agreement: RankAgreement) -> None:
        """Run rank 0's plan (NOTE [ranks agree] in agreement.py): its block modes, its
        choice per op position with its reasons, its figures, and whether it is tried."""
        active = self._active
        mine = {(kind, str(func), n): (kind, func, n) for kind, func, n in active.plan}
        sent = agreement.first_rank(
            json.dumps(
                {
                    "modes": sorted([*key, how] for key, how in active.modes.items()),
                    "plan": sorted(
                        [*name, active.plan[pos].name, *active.reasons[pos]]
                        for name, pos in mine.items()
                    ),
                    "measured": active.measured,
                    "share": active.share,
                    "trial_left": self._weighing.trial_left,
                }
            ).encode()
        )
        if agreement.rank == 0:
            return
        got = json.loads(sent)
        modes = {(kind, index): how for kind, index, how in got["modes"]}
        if modes.keys() != active.modes.keys():
            raise agreement.mismatch(
                f"its blocks {sorted(modes)} are not this rank's {sorted(active.modes)}"
            )
        plan = {(kind, func, n): rest for kind, func, n, *rest in got["plan"]}
        if plan.keys() != mine.keys():
            raise agreement.mismatch(
                f"its op positions ({len(plan)}) are not this rank's ({len(mine)}): "
                f"{sorted(plan.keys() ^ mine.keys())[:4]} differ"
            )
        active.modes = modes
        for name, (policy, why, seconds, move) in plan.items():
            pos = mine[name]
            active.plan[pos] = CheckpointPolicy[policy]
            active.reasons[pos] = (why, seconds, move)
        active.measured = {**got["measured"], "ranks_agreeing": float(agreement.world)}
        active.share, self._weighing.trial_left = got["share"], got["trial_left"]

    def _warn_budget(self, unreachable: tuple[int, str] | None) -> None:
        """Warn once where a budget no plan reaches (what
        :func:`~prefetch_offload.recompute_planner.unreachable_budget` said)."""
        if unreachable is not None and not self._warned:
            floor, what = unreachable
            self._warned = True
            warnings.warn(
                f"prefetch_offload: device_budget={self._budget} bytes is below what one "
                f"block's recompute holds at once ({floor} bytes, {what}): no plan reaches "
                f"it; the smallest reachable is about {floor} bytes plus the tensors saved "
                "outside the blocks, which checkpointing every block plainly (but a smaller "
                "one the budget keeps whole) comes closest to, and runs. Raise "
                f"device_budget to at least {floor} bytes, or split the blocks "
                "(recompute_blocks=) finer.",
                OffloadFallbackWarning,
                stacklevel=2,
            )

    def plan(self) -> RecomputePlan:
        """The last plan made (empty before the first profiling step has ended)."""
        with self._lock:
            return self._active.last

    @property
    def profiling(self) -> bool:
        """Whether the current step warms up or profiles (no plan acts yet)."""
        return self._phase != PLANNED

    @property
    def measured(self) -> dict[str, float]:
        """The figures the plan now in force was made and weighed by."""
        return self._active.measured

    @property
    def plans_made(self) -> int:
        """Times the plan was made (a profile each)."""
        return self._active.plans_made
