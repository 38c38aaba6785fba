"""The keep / offload / recompute decision for each op output of a checkpointed block.

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
#   than 5% of the recompute-all step (_SELECTIVE_MARGIN: a trial tells no
#   smaller difference, NOTE [plans within the noise]); else every non-whole
#   block is checkpointed plainly and its ops all recompute. (On the CPU
#   benchmarks of ``bench/recompute.py`` the net gain was at most 6 ms of a
#   0.55-1.8 s step, and a selective plan moves the bytes the budget does not
#   keep.)
#   The cost per block is _DISPATCH_SWITCH times the median block's time in the
#   modes in the recompute-all steps, forward and recompute (their ``__torch_dispatch__``
#   beyond the ops: NOTE [dispatch cost] in checkpointing.py); the factor adds
#   the switch into Python that the span misses (a cheap op costs 8.8 us more
#   under the forward mode, 5.9 us of it in ``__torch_dispatch__``). A sum of
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
#   again without the heap trims (NOTE [plain without trims]). On the CPU,
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
#   NOTE [plans within the noise]).
# - Not in the cost model: the heap trims (NOTE [heap trim] in heap.py). Every
#   plan runs under them (the trial sees them), and on the CPU they are what
#   separates a checkpointed plan from checkpointing without the engine; a plan
#   that moves nothing then weighs them (NOTE [trims a plan does without]).
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
# is tried. The trial decides (NOTE [trial steps]): the plan stays where it ran
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
#
# NOTE [plans within the noise]
# The walls that choose between plans (NOTE [trial steps]) are single steps on a
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
# took at most _TIE (5%) longer held _LEANER (5%) less memory than it: then the
# one of those that held least. Where none did, one of those that held at most
# _LEANER (5%) more than the fastest, as lean within the noise, and moved
# _LIGHTER (25%) fewer bytes to the target a step (the engine's
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
# keeps what steps of other kinds left: NOTE [a trim where the plan changes])
# and only for a CPU model: a GPU block's allocation peak lasts microseconds of
# host time, which sampling misses. Not sampled, or a failed read (no
# ``/proc``), or a fork's child: the fastest runs. The kernel's and CUDA's
# high-water marks are not used because resetting them resets a user's own
# peak figures too.
#
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
# and what offload alone held in the profile, plus 5% (_TRIMS_SLACK) of the
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
# where the process's anonymous resident memory passes the ceiling, the larger
# of what the verdict allows and 105% of the most the steps without trims held
# (the latter alone where the step under them is unknown; the engine reads it
# at its packs), one trim runs and the trims stay held; where it passes it again
# within CEILING_STEPS (4, heap.py) steps of that trim, the trims run again for
# good (until a new profile), with one trim at once. The verdict's steps without
# trims come right after a trim, on a heap that has not settled, and glibc's
# heap may drift up later. Measured on the 8-layer Llama of ``bench/recompute.py
# --model llama``, 60 steps in a process each (2 CPU threads), every layer plain
# and held off from step 16: at 25% and 50% of the saved bytes the peak above
# the start settled at 317 and 303 MiB by steps 19 and 25 and stayed there to
# the end, passing no ceiling, 0.54-0.60 s a step (full checkpointing without
# the engine: 239-303 MiB, 0.53-0.60 s; the profile's steps under trims 0.62-0.69
# s); with the ceiling lowered to the allowance (548 MiB, 17 over the steps
# without trims), the heap passed it at the third step held, the trim took that
# step's peak from 282 to 265 MiB, and it passed again two steps later: the
# trims ran again for good, 0.57-0.69 s a step at 192-227 MiB. Side by side
# with ``full`` (``bench/recompute.py --model llama --modes none,full,auto25,
# auto50 --warmup 25 --steps 35``), in one run plain checkpointing held off at 50%
# passed no ceiling in 60 steps and ran 1.02x ``full``'s step; in another
# three layers whole beside five plain, held off, passed theirs (635 MiB) twice
# within 4 steps, and under the trims again ran 1.10x ``full``'s: the memory
# bound comes first (there plain checkpointing ran 0.531 s a step without
# trims against the plan's 0.516: it stands in for such a plan whose trims come
# back, NOTE [plain without trims]). A heap still
# settling passes twice within 4 steps and gets its trims back; one that drifts
# past its ceiling after many steps pays a trim a pass, not the trims' page
# faults every step (in a ``bench/recompute.py --model llama`` run at 25%, trims
# for good after such a pass ran the timed steps at 1.05x ``full``'s). Trims
# held off but run once a step past the ceiling are no substitute for the trims:
# measured with ``bench/recompute.py --steps 8`` on the transformer at 25%, every
# block plain, the timed steps peaked at 548-921 MiB above their start against
# the target's limit of 652 (a trim a step gives back what the next backward's
# recompute touches again). On the 8-layer Llama at 50%, three layers whole,
# with a ceiling of 105% of the untrimmed peak (646 MiB), the heap passed it
# after 22 steps held off, 32 MiB under what the verdict allowed; in another
# run, with the allowance (629 MiB, 1 MiB over the untrimmed steps' peak) as the
# ceiling, the trims ran again within the warm-up, and auto took 1.11x
# ``full``'s step. Else (not held
# off) the trims run again, with one trim at once for what the steps without
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
# ones) weighs its trims in its trial (NOTE [trial steps]): after its uncounted
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
# plan), a plain checkpointing within 5% (_TIE) of the plan's time that held 5%
# (_LEANER) less than it, or at most 5% more while moving 25% (_LIGHTER) fewer
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
#
# The measured figures decide, not a list of op names: on the benchmark
# transformer the norms, activation functions and residual adds come out cheap
# to recompute and the matmul and attention outputs expensive, on the CPU as
# the field reports on GPUs; with a fast enough link nothing is recomputed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .agreement import AGREE_EVERY, RankAgreement
from .blocks import PLAIN, SELECTIVE, WHOLE
from .checkpointing import (
    OFFLOAD,
    RECOMPUTE,
    CheckpointStats,
    OpKey,
    PolicyDecider,
    draws_own_generator,
    draws_random,
    op_kind,
    output_bytes,
)
from .checkpointing import output_aliases as _aliases  # (storing one moves its bytes twice)
from .errors import OffloadFallbackWarning
from .heap import CEILING_STEPS
from .peak import PeakSampler
from .stats import OffloadStats

__all__ = ["AutoDecider", "OpDecision", "RecomputePlan", "RecordingDecider"]

_MiB = 1 << 20
# NOTE [keep, offload, recompute]: the dispatch modes' cost over their time in
# __torch_dispatch__ (the switch into Python is outside it).
_DISPATCH_SWITCH = 1.5
# Whether a plan may run every block whole where offload alone measured fastest (tests
# of the checkpointed paths turn it off, for a plan they can predict).
OFFLOAD_ALONE = True
# Whether a plan where offload alone beat plain checkpointing interleaves the two (NOTE
# [interleaved blocks]); tests that follow offload alone's plan turn it off.
INTERLEAVE = True
# Whether a plan the profile did not run as a whole is tried (NOTE [trial steps]); tests
# that follow a selective or mixed plan step by step turn it off.
TRIAL = True
# NOTE [trial steps]: the planned steps timed before a tried plan is kept or replaced.
_TRIAL_STEPS = 2
# NOTE [trims a plan does without]: one planned step with heap trims, then these without.
_UNTRIMMED_STEPS = 2

# An op position: (block class, op overload, count in the block).
Position = tuple[str, Any, int]


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
    # The measurements the automatic plan used (NOTE [keep, offload, recompute]).
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
        if m.get("weighing_plain"):  # NOTE [plain without trims]
            lines.append(
                "  now: every block checkpointed plainly in the plan's place, for a few "
                "steps, weighed without heap trims against it"
            )
        if "untrimmed_plain_s" in m:  # NOTE [plain without trims]
            rival = _ALONE if m["rival_alone"] else "the plan's trial"
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
        if "trims_held" in m:  # NOTE [trims a plan does without]
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


def _choice_name(policy: CheckpointPolicy) -> str:
    if policy in RECOMPUTE:
        return "recompute"
    if policy in OFFLOAD:
        return "offload"
    return "keep"


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
        return _Recorded(self, PolicyDecider(policy))

    def _record(self, key: OpKey, func: Any, policy: CheckpointPolicy, out: Any) -> None:
        kind = op_kind(func)
        with self._lock:
            if self._recomputed:  # a new step: the first forward op after a recompute
                self._recomputed = False
                self._last, self._bytes = self._bytes, collections.Counter()
            self._bytes[(kind, _choice_name(policy))] += output_bytes(out)
            self._positions[kind].add((key[0], func, key[3]))

    def _overruled(self, func: Any, policy: CheckpointPolicy, out: Any) -> None:
        """The op last recorded runs again instead (NOTE [ops that write their inputs])."""
        kind, nbytes = op_kind(func), output_bytes(out)
        with self._lock:
            was = (kind, _choice_name(policy))
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


class _Recorded:
    """One policy's decider, recording into a :class:`RecordingDecider`."""

    def __init__(self, recorder: RecordingDecider, inner: PolicyDecider) -> None:
        self._recorder = recorder
        self._inner = inner

    def decide(self, key: OpKey, func: Any, args: Any, kwargs: Any, out: Any) -> CheckpointPolicy:
        policy = self._inner.decide(key, func, args, kwargs, out)
        self._recorder._record(key, func, policy, out)
        return policy

    def timing(self) -> bool:
        return False

    def observe(self, key: OpKey, func: Any, out: Any, seconds: float, policy: Any) -> None:
        pass

    def recomputing(self) -> None:
        self._recorder._consumed()

    def consumed(self, key: OpKey) -> None:
        pass

    def dispatched(self, block: tuple[str, int], seconds: float) -> None:
        pass

    def overruled(self, key: OpKey, func: Any, out: Any, policy: CheckpointPolicy) -> None:
        self._recorder._overruled(func, policy, out)


@dataclass
class _Obs:
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
class _Span:
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
class _Outside:
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


# The kinds of profiling step, then the plan (NOTE [keep, offload, recompute]).
_WHOLE_ALL, _OFFLOAD_ALL, _RECOMPUTE_ALL, _WHOLE_TIMED, _PLANNED = range(5)
# The profiling steps in order (NOTE [keep, offload, recompute]): the two kinds whose
# times the plan compares each run twice after a step of their own kind, at the same
# mean position, and the faster of each kind's two counts.
_PROFILE = (
    _WHOLE_ALL,
    _OFFLOAD_ALL,
    _RECOMPUTE_ALL,
    _RECOMPUTE_ALL,
    _WHOLE_TIMED,
    _WHOLE_TIMED,
    _WHOLE_TIMED,
    _RECOMPUTE_ALL,
    _RECOMPUTE_ALL,
)
_WHOLE_ALL_STEP = _PROFILE.index(_WHOLE_ALL)
_OFFLOAD_ALL_STEP = _PROFILE.index(_OFFLOAD_ALL)
# The step whose checkpointed blocks hand the engine their inputs alone (NOTE [keep,
# offload, recompute]: what a block the budget does not keep takes of it).
_INPUTS_STEP = _PROFILE.index(_RECOMPUTE_ALL)
# NOTE [plans within the noise]: a plan whose step took at most _TIE longer than the
# fastest plan's counts as fast as it; of those, one that held at least _LEANER less
# memory than the fastest runs instead (the one that held least), else one that held no
# more and moved at least _LIGHTER fewer bytes (the one that moved least).
_TIE = 0.05
_LEANER = 0.05
_LIGHTER = 0.25
# NOTE [keep, offload, recompute]: selective blocks only where their offloads save more
# than the dispatch modes cost by this share of the recompute-all step (the noise).
_SELECTIVE_MARGIN = 0.05
# NOTE [trims a plan does without]: the share of a step's saved bytes the heap may hold
# without trims beyond the step under them or offload alone (the issue's peak slack).
_TRIMS_SLACK = 0.05
# NOTE [trims a plan does without]: trims held off run again above this much over the
# most the steps without them held, or above the allowance where that is more.
_CEILING = 0.05
# The measured figures that say a plan's blocks (:meth:`AutoDecider._switch` rewrites
# them).
_BLOCK_COUNTS = (
    "blocks_whole",
    "blocks_plain",
    "blocks_selective",
    "blocks_interleaved",
    "whole_MiB",
    "offload_alone",
)
_ALONE = "offload alone"


class _Weighed(NamedTuple):
    """A plan's measured step (NOTE [plans within the noise]): seconds, the most memory
    it held (0: unknown), and the bytes it moved to the target."""

    wall: float
    peak: int
    moved: int


class _TrimsVerdict(NamedTuple):
    """NOTE [trims a plan does without]: whether the trims are held off, the most a step
    under them and the steps without them held, and what the verdict allows."""

    held: bool
    trimmed: int
    untrimmed: int
    allowed: float


def _leaner(plan: _Weighed, than: _Weighed) -> bool:
    """``plan`` held _LEANER less memory than ``than`` (NOTE [plans within the noise])."""
    return 0 < plan.peak <= than.peak * (1 - _LEANER)


def _lighter(plan: _Weighed, than: _Weighed) -> bool:
    """``plan`` held at most _LEANER more memory than ``than`` (as lean within the noise)
    and moved _LIGHTER fewer bytes (NOTE [plans within the noise])."""
    as_lean = 0 < plan.peak <= than.peak * (1 + _LEANER)
    return as_lean and plan.moved <= than.moved * (1 - _LIGHTER) and plan.moved < than.moved


def _leanest_of_the_fastest(plans: dict[str, _Weighed]) -> str:
    """Of ``plans``, the fastest, unless one within _TIE of it held _LEANER less: then
    the one of those that held least; else one within _TIE of it that held at most
    _LEANER more and moved _LIGHTER fewer bytes: the one of those that moved least
    (NOTE [plans within the noise]). Where a plan within _TIE held an unknown peak, the
    fastest."""
    fastest = min(plans, key=lambda name: plans[name].wall)
    best = plans[fastest]
    close = [name for name, p in plans.items() if p.wall <= best.wall * (1 + _TIE)]
    if any(plans[name].peak <= 0 for name in close):
        return fastest
    leaner = [name for name in close if _leaner(plans[name], best)]
    if leaner:
        return min(leaner, key=lambda name: (plans[name].peak, plans[name].wall))
    lighter = [name for name in close if _lighter(plans[name], best)]
    return min(lighter, key=lambda name: (plans[name].moved, plans[name].wall), default=fastest)


def _why_chosen(plans: dict[str, _Weighed], chosen: str, other: str, than: str) -> str:
    """Why plan ``chosen`` replaced plan ``other`` (called ``than`` in the text): it ran
    faster, or within _TIE of it and held less memory, or about as much (within _LEANER)
    and moved fewer bytes; else (a third plan was the fastest) it held less than the
    fastest."""
    mine, theirs = plans[chosen], plans[other]
    if mine.wall < theirs.wall:
        return f"ran faster than {than}"
    if _leaner(mine, theirs):
        return f"ran within {_TIE:.0%} of {than} and held less memory"
    if _lighter(mine, theirs):
        return (
            f"ran within {_TIE:.0%} of {than}, held within {_LEANER:.0%} of its memory and "
            "moved fewer bytes"
        )
    return f"ran within {_TIE:.0%} of the fastest plan and held less memory than it"


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


def _copied(obs: dict[Position, _Obs]) -> dict[Position, _Obs]:
    """The measurements, each a copy of its own (NOTE [abandoned forwards])."""
    return {pos: dataclasses.replace(o, seconds=list(o.seconds)) for pos, o in obs.items()}


def _most(peaks: list[int]) -> int:
    """The most of sampled peaks; 0 (unknown) if there are none or one is unknown."""
    return 0 if not peaks or 0 in peaks else max(peaks)


def _moved_text(measured: dict[str, float], key: str) -> str:
    """ ", moving N MiB" for the bytes a plan moved a step, where measured."""
    return f", moving {measured[key]:.0f} MiB" if key in measured else ""


def _peak_text(measured: dict[str, float], key: str) -> str:
    """ " at N MiB" for a sampled peak, else nothing."""
    value = measured.get(key, 0.0)
    return f" at {value:.0f} MiB" if value > 0 else ""


# NOTE [profiling under trims]: steps alike in the bytes they move.
_TRIM_CLASS = {
    _WHOLE_ALL: "whole",
    _WHOLE_TIMED: "whole",
    _OFFLOAD_ALL: "stored",
    _RECOMPUTE_ALL: "checkpointed",
    _PLANNED: "planned",
}
_PHASE_MODE = {
    _WHOLE_ALL: WHOLE,
    _OFFLOAD_ALL: SELECTIVE,
    _RECOMPUTE_ALL: SELECTIVE,
    _WHOLE_TIMED: WHOLE,
}


def _sync_device() -> None:
    """Wait for the CUDA work queued so far, where CUDA runs (NOTE [trial steps]: a step's
    time on a GPU is its kernels', not the host's queueing)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _live_bytes(s: OffloadStats) -> int:
    return s.device_tier_bytes + s.host_tier_bytes + s.disk_tier_bytes


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
        self._trim_heap = trim_heap  # NOTE [a trim where the plan changes]
        # NOTE [trims a plan does without]: holds the engine's heap trims off, or lets them
        # run; the steps of the trims' trial left, their walls and peaks, what the plan
        # keeps of the budget at the end of forward, what one block's recompute holds, and
        # whether the trial runs plain checkpointing against offload alone (NOTE [plain
        # without trims]).
        self._hold_trims = hold_trims
        self._trims_held = False
        self._trims_held_now = trims_held
        self._trim_trial_left = 0
        self._trim_steps: list[_Weighed] = []  # the trims' trial's steps, as measured
        self._challenging = False
        # A tried plan that moves nothing: whether its trial runs steps without trims, and
        # the verdict on its trims there (_trims_verdict_of's; None: not judged).
        self._trial_untrimmed = False
        self._trial_trims: _TrimsVerdict | None = None
        self._trial_trimmed_s = math.inf  # its fastest trial step under trims
        # Plain checkpointing's verdict and fastest step without trims, where it held
        # within what they allow but lost to such a plan: the plan's stand-in should
        # its trims come back (NOTE [plain without trims]).
        self._stand_in: tuple[_TrimsVerdict, float] | None = None
        # Once plain stands in: the plan's modes, share and block counts (its summary is
        # printed from _trial_obs, kept meanwhile).
        self._stood_for: tuple[dict[tuple[str, int], str], float, dict[str, float]] | None
        self._stood_for = None
        self._rival_modes: dict[tuple[str, int], str] = {}  # the plan plain runs in place of
        self._block_hold = 0
        # NOTE [plans within the noise]: the most memory each profiling step held; sampled
        # while the plan is measured.
        self._peak_source = peaks
        self._peaks: dict[int, int] = {}
        self._step_peak: int | None = None  # the step's, taken as its backward ended
        self._closed = False
        self._budget = device_budget
        self._clock = clock
        self._ckpt_stats = checkpoint_stats
        self._lock = threading.RLock()
        self._plan: dict[Position, CheckpointPolicy] = {}
        self._reasons: dict[Position, tuple[str, float, float]] = {}
        self._modes: dict[tuple[str, int], str] = {}  # per block, once planned
        self._obs: dict[Position, _Obs] = {}
        # Positions recomputed whatever they cost, "alias" or "random" (decide() sees
        # the arguments that tell an attention kernel's dropout_p), or stored whatever
        # they cost, "generator" (NOTE [random ops] in checkpointing.py).
        self._fixed: dict[Position, str] = {}
        # Block classes with an op that draws from a generator of the caller's own: their
        # blocks never run plainly (their recompute would draw again); those op positions.
        self._own_rng: set[str] = set()
        self._own_draws: set[Position] = set()
        # Per profiling step (its index in _PROFILE): each block's span, and the step's
        # end (the next one's start).
        self._spans: dict[int, dict[tuple[str, int], _Span]] = {}
        self._ends: dict[int, float] = {}
        # Per profiling step and block: seconds in the dispatch modes beyond the ops
        # (forward and recompute; NOTE [dispatch cost] in checkpointing.py).
        self._dispatch: dict[int, collections.Counter[tuple[str, int]]] = {}
        self._step_no = 0  # the profiling step now (an index in _PROFILE)
        self._phase = _PROFILE[0]  # its kind, or _PLANNED
        self._ended = _PLANNED  # the kind of the step before this one
        # NOTE [profiling under trims]: the bytes the last step of each class moved.
        self._moved_by: dict[str, int] = {}
        self._stale = False  # an unplanned block or position appeared: profile again
        # The blocks and op positions that made a profile start again (NOTE [keep,
        # offload, recompute]: once each).
        self._replanned_for: set[Any] = set()
        # NOTE [abandoned forwards]: the step's block calls entered, returned and reached
        # by backward; whether the step before abandoned a forward; what the op-timing
        # steps measured before it began.
        self._calls = [0, 0, 0]
        self._abandoned = False
        self._before: tuple[dict[Position, _Obs], collections.Counter[Any], dict[Any, str]]
        self._before = ({}, collections.Counter(), {})
        self._in_backward = False
        # The engine's counters at the start and the end of the offload-all step.
        self._s0: OffloadStats | None = None
        self._step_saved = 0  # the bytes the blocks saved in the whole step (profiled)
        self._peak_alone = 0  # the most offload alone held in this rank's profile (0: unknown)
        self._s1: OffloadStats | None = None
        self._block_bytes: collections.Counter[tuple[str, int]] = collections.Counter()
        self._outside: _Outside | None = None  # (None: not measured)
        self._warned = False
        # NOTE [trial steps]: the planned steps while a plan is tried, as measured, and the
        # steps left.
        self._trial_steps: list[_Weighed] = []
        self._trial_left = 0
        # The start of the step now, and the end of its last backward (NOTE [trial steps]);
        # the profiling steps' times.
        self._step_start: float | None = None
        self._backward_end: float | None = None
        self._end_queued = False
        self._walls: dict[int, float] = {}
        # NOTE [plans within the noise]: the engine's bytes_offloaded as the step now began;
        # the bytes each profiling step moved.
        self._offloaded = 0
        self._moved: dict[int, int] = {}
        # The two plans the profile ran, by name (NOTE [trial steps]).
        self._profiled_plans: dict[str, _Weighed] = {}
        self._trial_obs: dict[Position, _Obs] = {}  # the profile's, for the plan's summary
        self._profiled: set[tuple[str, int]] = set()
        self.plans_made = 0
        self.measured: dict[str, float] = {}
        self._last = RecomputePlan("auto")

    # -- BlockModes -------------------------------------------------------------------------

    def mode(self, kind: str, index: int) -> str:
        with self._lock:
            if self._in_backward:
                self._step_started()
            if self._phase != _PLANNED:
                return _PHASE_MODE[self._phase]
            how = self._modes.get((kind, index))
            if how is None:  # a block the profile did not see: profile again
                self._unplanned((kind, index))
                how = PLAIN
            if how == PLAIN and kind in self._own_rng:  # NOTE [random ops] in
                return SELECTIVE  # checkpointing.py: its draws are stored
            return how

    def entered(self, kind: str, index: int) -> None:
        with self._lock:
            self._calls[0] += 1  # NOTE [abandoned forwards]
            if self._phase == _PLANNED:
                return
            spans = self._spans.setdefault(self._step_no, {})
            span = spans.setdefault((kind, index), _Span())
            if self._phase == _WHOLE_ALL or self._step_no == _INPUTS_STEP:
                span.live = _live_bytes(self._stats())  # (every call's: a shared block's)
                if self._phase == _WHOLE_ALL and len(spans) == 1 and not span.calls:
                    self._outside = _Outside(span.live)  # the step's first block call
            span.start = self._clock()

    def exited(self, kind: str, index: int) -> None:
        with self._lock:
            self._calls[1] += 1  # NOTE [abandoned forwards]
            span = self._spans.get(self._step_no, {}).get((kind, index))
            if span is None or self._phase == _PLANNED:
                return
            span.end = self._clock()
            span.forward += span.end - span.start
            span.calls += 1
            if self._phase == _WHOLE_ALL or self._step_no == _INPUTS_STEP:
                stats = self._stats()
                span.saved += _live_bytes(stats) - span.live
                if self._phase == _WHOLE_ALL and self._outside:
                    self._outside.exited = stats.bytes_packed  # (until the last block's)

    def backward(self, kind: str, index: int) -> None:
        with self._lock:
            self._calls[2] += 1  # NOTE [abandoned forwards]
            self._in_backward = True
            span = self._spans.get(self._step_no, {}).get((kind, index))
            if span is not None and span.grad is None:
                span.grad = self._clock()
            outside = self._outside
            if self._phase == _WHOLE_ALL and outside and outside.backward is None:
                outside.backward = self._stats().bytes_packed
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
                if self._phase == _OFFLOAD_ALL:
                    self._fixed[pos] = "generator"
                return CheckpointPolicy.PREFER_CPU_OFFLOAD
            random = draws_random(func, args, kwargs)
            fixed = random or _aliases(func)
            if fixed and self._phase == _OFFLOAD_ALL:
                self._fixed[pos] = "random" if random else "alias"
            if self._phase == _RECOMPUTE_ALL or fixed:
                return CheckpointPolicy.PREFER_RECOMPUTE
            if self._phase != _PLANNED:
                return CheckpointPolicy.PREFER_CPU_OFFLOAD
            policy = self._plan.get(pos)
            if policy is None:  # NOTE [keep, offload, recompute]: profile again
                self._unplanned(pos)
                return CheckpointPolicy.PREFER_CPU_OFFLOAD
            return policy

    def timing(self) -> bool:
        # The selective profiling steps whose step time the plan does not compare time
        # their ops (on CUDA, a synchronize each: NOTE [trial steps]).
        if self._phase == _OFFLOAD_ALL:
            return True
        counted = self._counted(_RECOMPUTE_ALL)
        return self._phase == _RECOMPUTE_ALL and self._step_no not in counted

    def observe(self, key: OpKey, func: Any, out: Any, seconds: float, policy: Any) -> None:
        with self._lock:
            if self._phase not in (_OFFLOAD_ALL, _RECOMPUTE_ALL):
                return
            pos: Position = (key[0], func, key[3])
            obs = self._obs.get(pos)
            if obs is None:
                obs = self._obs[pos] = _Obs(func)
            obs.seconds.append(seconds)
            if self._phase == _OFFLOAD_ALL:
                nbytes = output_bytes(out)
                obs.fixed = self._fixed.get(pos)
                obs.nbytes += nbytes
                obs.calls += 1
                self._block_bytes[(key[0], key[1])] += nbytes

    def recomputing(self) -> None:
        with self._lock:
            self._in_backward = True

    def consumed(self, key: OpKey) -> None:
        with self._lock:
            self._in_backward = True
            if self._phase == _OFFLOAD_ALL:
                obs = self._obs.get((key[0], key[2], key[3]))
                if obs is not None:
                    obs.consumed += 1

    def overruled(self, key: OpKey, func: Any, out: Any, policy: CheckpointPolicy) -> None:
        pass  # (it answers recompute for every op that writes an input: never overruled)

    def dispatched(self, block: tuple[str, int], seconds: float) -> None:
        with self._lock:
            if self._phase != _PLANNED:
                self._dispatch.setdefault(self._step_no, collections.Counter())[block] += seconds

    def close(self) -> None:
        """Stop sampling memory, for good (the context exits); a weighing of plain
        checkpointing ends unjudged (the plan made last is the plan)."""
        with self._lock:
            self._closed = True
            if self._challenging:
                self._modes = self._rival_modes
                self._end_weighing()
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
            if upcoming != _PLANNED:  # a new profile: under trims, as every profile
                self._hold(False)
            if _TRIM_CLASS[ended] != _TRIM_CLASS[upcoming]:
                self._trim_heap()  # NOTE [a trim where the plan changes]
            default = 0 if _TRIM_CLASS[upcoming] == "checkpointed" else moved
            if upcoming == _PLANNED and self.measured.get("blocks_interleaved"):
                # NOTE [interleaved blocks]: the bound offload alone ran under
                return self._moved_by.get("whole", default)
            return self._moved_by.get(_TRIM_CLASS[upcoming], default)

    def _next_phase(self) -> int:
        """The kind of step _step_started will begin."""
        if self._phase == _PLANNED:  # (with ranks agreeing, this rank's view of a check)
            checks = self._checks(self._planned_steps + 1)
            return _PROFILE[0] if self._stale and checks else _PLANNED
        if self._runs_again(alone=True):  # NOTE [abandoned forwards]: its own kind again
            return self._phase
        following = self._step_no + 1
        return _PROFILE[following] if following < len(_PROFILE) else _PLANNED

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
        if self._phase == _PLANNED:
            self._trims_released()
            stale = self._agreed_stale()
            if self._trial_left and not stale and not again:
                self._trial_step_ended(_Weighed(wall, peak, moved))
            elif self._trim_trial_left and not stale and not again:
                self._trim_step_ended(_Weighed(wall, peak, moved))
            if stale:
                if self._challenging:  # (the plan made last runs no more: as it was)
                    self._end_weighing()
                self._trial_left, self._trial_obs, self._stand_in = 0, {}, None
                self._stood_for = None
                self._trim_trial_left, self._challenging = 0, False
                self._hold(False)
                self._reset_profile()
                self._moved_by.clear()  # NOTE [profiling under trims]: a new profile
                # (and its offload-all step sees again which classes draw their own)
                self._own_rng.clear()
                self._own_draws.clear()
                self._step_no, self._phase = 0, _PROFILE[0]
            return
        if again:
            self._forget_step()
            return
        self._ends[self._step_no] = now
        self._walls[self._step_no] = wall
        self._peaks[self._step_no] = peak
        self._moved[self._step_no] = moved
        if self._phase == _WHOLE_ALL:
            self._s0 = self._stats()
        elif self._phase == _OFFLOAD_ALL:
            self._s1 = self._stats()
        self._step_no += 1
        if self._step_no < len(_PROFILE):
            self._phase = _PROFILE[self._step_no]
            self._before = (
                _copied(self._obs),
                collections.Counter(self._block_bytes),
                dict(self._fixed),
            )
            return
        self._make_plan()
        self._reset_profile()
        self._phase, self._planned_steps = _PLANNED, 0
        if not self._trial_left:
            self._begin_trim_trial()

    def _forget_step(self) -> None:
        """The profiling step that ended had a forward abandoned (NOTE [abandoned
        forwards]): what it measured goes, and a step of its kind runs again."""
        obs, block_bytes, fixed = self._before
        self._obs, self._block_bytes, self._fixed = (
            _copied(obs),
            collections.Counter(block_bytes),
            dict(fixed),
        )
        self._spans.pop(self._step_no, None)
        self._dispatch.pop(self._step_no, None)
        if self._phase == _WHOLE_ALL:
            self._outside = None
        if self._phase == _OFFLOAD_ALL:  # its moves count from the step that runs again
            self._s0 = self._stats()

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
        return self._phase != _PLANNED or bool(self._trial_left) or self._challenging

    def _measuring(self) -> bool:
        """Whether the step now is measured: a profiling step, a trial step (NOTE [trial
        steps]) or a step of the trims' trial (NOTE [trims a plan does without])."""
        return self._phase != _PLANNED or bool(self._trial_left or self._trim_trial_left)

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

    def _reset_profile(self) -> None:
        self._obs.clear()
        self._fixed.clear()
        self._spans.clear()
        self._ends.clear()
        self._walls.clear()
        self._peaks.clear()
        self._moved.clear()
        self._dispatch.clear()
        self._block_bytes.clear()
        self._outside = None
        self._s0 = self._s1 = None
        self._before = ({}, collections.Counter(), {})

    @staticmethod
    def _steps(kind: int) -> list[int]:
        """The profiling steps of a kind (their indices in _PROFILE)."""
        return [i for i, k in enumerate(_PROFILE) if k == kind]

    @staticmethod
    def _counted(kind: int) -> list[int]:
        """The profiling steps of a kind that follow a step of the same kind: the ones the
        plan compares (NOTE [keep, offload, recompute])."""
        return [i for i, k in enumerate(_PROFILE) if k == kind and i and _PROFILE[i - 1] == k]

    def _block_times(
        self, kind: int, keys: set[tuple[str, int]] | None = None
    ) -> tuple[float, float, int]:
        """The median block's forward and backward seconds in the profiling step of a
        kind (of its counted steps, the one whose median block took least), and the
        blocks it ran; the median over ``keys`` only, where given and any ran."""
        steps = self._counted(kind) or self._steps(kind)  # (the offload-all step: once)
        times = [self._step_block_times(i, keys) for i in steps]
        return min(times, key=lambda t: t[0] + t[1])

    def _step_block_times(
        self, step: int, keys: set[tuple[str, int]] | None = None
    ) -> tuple[float, float, int]:
        """The median block's forward and backward seconds in one profiling step (over
        ``keys``, where given and any ran), and the blocks the step ran. A block's
        backward runs from backward reaching its output to backward reaching the block
        before it (the first block: to the next step)."""
        spans = sorted(self._spans.get(step, {}).items(), key=lambda kv: kv[0][1])
        if keys is not None and not keys.intersection(key for key, _ in spans):
            keys = None
        fwd, bwd = [], []
        later = self._ends.get(step, 0.0)
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

    def _make_plan(self) -> None:
        s0, s1 = self._s0, self._s1
        assert s0 is not None and s1 is not None
        f_off, b_off, n = self._block_times(_OFFLOAD_ALL)
        # The recompute-all step next to the offload-all one: the two are differenced
        # for the move cost, and the lower of two noisy steps would bias it upward.
        f_rec, b_rec, _ = self._step_block_times(self._steps(_RECOMPUTE_ALL)[0])
        # What the modes measured of themselves per block, forward and recompute (NOTE
        # [dispatch cost] in checkpointing.py), the median block.
        spent = [v for i in self._steps(_RECOMPUTE_ALL) for v in self._dispatch.get(i, {}).values()]
        in_modes = statistics.median(spent) if spent else 0.0
        n = max(n, 1)
        # Whole blocks: the newest whose saved bytes the budget keeps anyway, beside what
        # the model saves outside the blocks and the inputs of the blocks it does not keep.
        whole: list[tuple[str, int]] = []
        held = 0
        inputs = {
            key: max(span.saved, 0) for key, span in self._spans.get(_INPUTS_STEP, {}).items()
        }
        beside = (self._outside.nbytes if self._outside else 0) + sum(inputs.values())
        for key, span in sorted(
            self._spans.get(_WHOLE_ALL_STEP, {}).items(), key=lambda kv: -kv[0][1]
        ):
            # A block whose saved tensors never reached the engine's tiers (nothing
            # measured) is not known to fit.
            others = beside - inputs.get(key, 0)
            if span.saved <= 0 or held + span.saved + others > self._budget:
                break
            held += span.saved
            beside = others
            whole.append(key)
        rest = n - len(whole)
        # The blocks the budget does not keep, whose plans the offload-alone test compares
        # (a kept block runs whole either way, and costs no moves).
        kept = set(whole)
        # Of the profiled bytes and seconds, the share of the blocks still checkpointed:
        # by their op output bytes (a block the model calls at two places counts both).
        total = sum(self._block_bytes.values())

        def share_beside(run_whole: set[tuple[str, int]], count: int) -> float:
            """The profiled op output bytes' share in the blocks not in ``run_whole``
            (``count`` of the ``n``, where none were measured)."""
            inside = sum(b for key, b in self._block_bytes.items() if key not in run_whole)
            return inside / total if total else count / n

        share = share_beside(kept, rest)
        others = {key for key in self._spans.get(_WHOLE_ALL_STEP, {}) if key not in kept}
        t_fwd, t_bwd = max(n * f_off, 1e-9), max(n * b_off, 1e-9)
        step_offload, step_recompute = n * (f_off + b_off), n * (f_rec + b_rec)
        # The dispatch modes' own cost per block (NOTE [keep, offload, recompute]).
        overhead = _DISPATCH_SWITCH * in_modes
        moved = s1.bytes_offloaded - s0.bytes_offloaded
        e_fwd = (s1.pack_wait_seconds - s0.pack_wait_seconds) + (
            s1.copy_wait_seconds - s0.copy_wait_seconds
        )
        e_bwd = s1.stall_seconds - s0.stall_seconds
        read = s1.bytes_read - s0.bytes_read
        read_s = s1.read_seconds - s0.read_seconds
        stored = sum(o.nbytes for o in self._obs.values() if o.fixed is None)
        # What the recompute-all step recomputed that the offload-all step read back.
        recomputed_s = sum(o.total_s for o in self._obs.values() if o.fixed is None and o.consumed)
        write_bw = moved / t_fwd if moved else math.inf
        read_bw = read / read_s if read and read_s > 0 else math.inf
        # Moving `moved` bytes cost the offload-all step this much beyond the compute the
        # recompute-all step spent instead, less the stalls the exposure terms model.
        move_cost = step_offload - (step_recompute - recomputed_s)
        per_byte = max(move_cost - e_fwd - e_bwd, 0.0) / moved if moved else 0.0
        hide_f = max(t_fwd - e_fwd, 0.0)
        hide_b = max(t_bwd - e_bwd, 0.0)
        # The bytes the budget keeps of the outputs, less what the whole blocks take of it.
        left_on_device = max(stored - moved - held, 0)

        def cost(cut: float, recompute_s: float) -> float:
            out = max(stored * share - cut - left_on_device, 0)
            part = out / moved if moved else 0.0  # of the stalls step (2) measured
            return (
                per_byte * out
                + max(part * e_fwd, out / write_bw - hide_f)
                + max(part * e_bwd, out / read_bw - hide_b - recompute_s)
            )

        plan: dict[Position, CheckpointPolicy] = {}
        reasons: dict[Position, tuple[str, float, float]] = {}
        free = []
        candidates = []
        for pos, obs in self._obs.items():
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
        cut = sum(self._obs[p].nbytes for p in free) * share
        recompute_s = gain = 0.0
        for _, pos in sorted(candidates, key=lambda c: c[0]):
            obs = self._obs[pos]
            nbytes, seconds = obs.nbytes * share, obs.total_s * share
            move = cost(cut, recompute_s) - cost(cut + nbytes, recompute_s + seconds)
            if seconds < move:
                plan[pos] = CheckpointPolicy.PREFER_RECOMPUTE
                reasons[pos] = ("recompute is cheaper than moving", seconds, move)
                cut += nbytes
                recompute_s += seconds
            else:
                plan[pos] = CheckpointPolicy.PREFER_CPU_OFFLOAD
                reasons[pos] = ("moving is cheaper than recompute", seconds, move)
                gain += seconds - move
        # NOTE [a budget no plan reaches]: then the leanest plan, every block plain.
        self._block_hold = self._recompute_hold()
        unreachable = self._unreachable()
        lean = unreachable is not None
        # Selective only where its offloads save more than its dispatch modes cost, by
        # more than the noise of a step (NOTE [plans within the noise]).
        wall_recompute = self._wall(_RECOMPUTE_ALL)
        noise = _SELECTIVE_MARGIN * wall_recompute if math.isfinite(wall_recompute) else 0.0
        selective = not lean and gain - overhead * rest > noise
        if not selective:
            plain = (
                "block checkpointed plainly: device_budget is below what one block's "
                "recompute holds, and this is the plan that holds least"
                if lean
                else "block checkpointed plainly: selective would save less than its dispatch "
                f"costs and {_SELECTIVE_MARGIN:.0%} of a step"
            )
            for pos in plan:
                if (plan[pos] in OFFLOAD or lean) and self._fixed.get(pos) != "generator":
                    plan[pos] = CheckpointPolicy.PREFER_RECOMPUTE
                    reasons[pos] = (plain, reasons[pos][1], reasons[pos][2])
        # Per block the budget does not keep: what the chosen way is expected to take,
        # against what it took whole, the engine moving what the budget does not keep.
        f_whole, b_whole, _ = self._block_times(_WHOLE_TIMED, others)
        f_rest, b_rest, _ = self._block_times(_RECOMPUTE_ALL, others)
        f_kept, b_kept, _ = self._block_times(_WHOLE_TIMED, kept)
        block_whole = f_whole + b_whole
        block_ckpt = (f_rest + b_rest) - (gain / rest if selective and rest else overhead)
        step_kept = len(whole) * (f_kept + b_kept)
        checkpointed = rest
        profiled = {key for spans in self._spans.values() for key in spans}
        # NOTE [trial steps]: the two plans the profile ran, by their walls; a plan between
        # them is tried against both.
        # (The correction at most half the step: a toy block whose ops all cost less
        # than their dispatch.)
        wall_plain = wall_recompute - min(n * overhead, wall_recompute / 2)
        wall_alone = self._wall(_WHOLE_TIMED)
        peak_plain, peak_alone = self._peak(_RECOMPUTE_ALL), self._peak(_WHOLE_TIMED)
        profiled_plans = {
            "plain": _Weighed(wall_plain, peak_plain, self._moved_by_kind(_RECOMPUTE_ALL)),
            "alone": _Weighed(
                wall_alone if OFFLOAD_ALONE and not lean else math.inf,
                peak_alone,
                self._moved_by_kind(_WHOLE_TIMED),
            ),
        }
        alone_won = (
            OFFLOAD_ALONE
            and not lean
            and rest > 0
            and _leanest_of_the_fastest(profiled_plans) == "alone"
        )
        # NOTE [interleaved blocks]: where offload alone beat plain checkpointing, the
        # plan tried runs every other block the budget does not keep whole, the rest plain.
        interleaved: list[tuple[str, int]] = []
        if INTERLEAVE and alone_won and not selective:
            interleaved = sorted(profiled - kept, key=lambda key: key[1])[1::2]
        tried = selective or bool(interleaved) or 0 < len(whole) < len(profiled)
        offload_alone = alone_won and not tried
        beat = (
            "offload alone measured faster than plain checkpointing"
            if wall_alone < wall_plain
            else f"offload alone measured within {_TIE:.0%} of plain checkpointing and held "
            "less memory"
        )
        if interleaved:
            why = (
                "every other block the budget does not keep checkpointed plainly, the rest "
                f"whole: {beat}"
            )
            for pos in plan:
                if self._fixed.get(pos) != "generator":
                    reasons[pos] = (why, reasons[pos][1], reasons[pos][2])
            whole += interleaved
            rest -= len(interleaved)
            share = share_beside(set(whole), rest)
        if offload_alone:
            for pos in plan:
                plan[pos] = CheckpointPolicy.PREFER_RECOMPUTE
                reasons[pos] = (f"every block whole: {beat}", reasons[pos][1], reasons[pos][2])
            whole = list(profiled)
            selective, rest, share = False, 0, 0.0
        self._modes = dict.fromkeys(profiled, SELECTIVE if selective else PLAIN)
        self._modes.update(dict.fromkeys(whole, WHOLE))
        self._plan.update(plan)
        self._reasons.update(reasons)
        self.plans_made += 1
        # NOTE [trims a plan does without]: the bytes the blocks saved in the whole step.
        whole_step = self._spans.get(_WHOLE_ALL_STEP, {}).values()
        self._step_saved = sum(span.saved for span in whole_step if span.saved > 0)
        self._peak_alone = peak_alone  # (this rank's: ranks that agree print rank 0's figures)
        self.measured = {
            "step_saved_MiB": self._step_saved / _MiB,
            "blocks_whole": len(whole),
            "blocks_selective": rest if selective else 0,
            "blocks_plain": 0 if selective else rest,
            "blocks_interleaved": len(interleaved),
            "whole_MiB": held / _MiB,
            "beside_whole_MiB": beside / _MiB,
            "dispatch_s_per_block": overhead,
            "dispatch_in_modes_s": in_modes,
            "selective_gain_s": gain,
            "step_offload_all_s": step_offload,
            "step_recompute_all_s": step_recompute,
            # The blocks' share of the step with every block whole, and with the blocks the
            # budget keeps whole and the rest checkpointed (estimates, from block medians).
            "step_whole_s": step_kept + checkpointed * block_whole,
            "step_checkpointed_s": step_kept + checkpointed * block_ckpt,
            # The profile's steps, forward to backward's end (NOTE [trial steps]).
            "wall_plain_s": wall_plain,
            "wall_alone_s": wall_alone,
            # The most memory those steps held (NOTE [plans within the noise]; 0: unknown).
            "peak_plain_MiB": peak_plain / _MiB,
            "peak_alone_MiB": peak_alone / _MiB,
            "moved_plain_MiB": profiled_plans["plain"].moved / _MiB,
            "moved_alone_MiB": profiled_plans["alone"].moved / _MiB,
            "offload_alone": float(offload_alone),
            "recompute_s": recomputed_s,
            "move_s_per_GB": per_byte * 1e9,
            "forward_s": t_fwd,
            "backward_s": t_bwd,
            "moved_MiB": moved / _MiB,
            "forward_stall_s": e_fwd,
            "backward_stall_s": e_bwd,
            "write_GBps": write_bw / 1e9 if math.isfinite(write_bw) else math.inf,
            "read_GBps": read_bw / 1e9 if math.isfinite(read_bw) else math.inf,
        }
        self._profiled, self._share = profiled, share
        self._profiled_plans = profiled_plans
        self._trial_left = _TRIAL_STEPS + 1 if TRIAL and tried else 0
        # NOTE [trims a plan does without]: a tried plan that moves nothing runs its last
        # trial steps without trims.
        weighs = self._hold_trims is not None and self._peak_source is not None
        if self._trial_left and weighs and not self._moves():
            self._trial_left += _UNTRIMMED_STEPS
        self._trial_steps = []
        if self._agreement is not None:
            self._take_first_ranks_plan(self._agreement)
        self._trial_untrimmed = self._trial_left > _TRIAL_STEPS + 1  # (rank 0's count)
        self._trial_trims, self._trial_trimmed_s, self._stand_in = None, math.inf, None
        self._stood_for = None
        self._trial_obs = dict(self._obs)  # (cleared once no trial can change the plan)
        self._last = self._summarize(self._share, self._obs)
        self._warn_budget(unreachable)

    def _take_first_ranks_plan(self, agreement: RankAgreement) -> None:
        """Run rank 0's plan (NOTE [ranks agree] in agreement.py): its block modes, its
        choice per op position with its reasons, its figures, and whether it is tried."""
        mine = {(kind, str(func), n): (kind, func, n) for kind, func, n in self._plan}
        sent = agreement.first_rank(
            json.dumps(
                {
                    "modes": sorted([*key, how] for key, how in self._modes.items()),
                    "plan": sorted(
                        [*name, self._plan[pos].name, *self._reasons[pos]]
                        for name, pos in mine.items()
                    ),
                    "measured": self.measured,
                    "share": self._share,
                    "trial_left": self._trial_left,
                }
            ).encode()
        )
        if agreement.rank == 0:
            return
        got = json.loads(sent)
        modes = {(kind, index): how for kind, index, how in got["modes"]}
        if modes.keys() != self._modes.keys():
            raise agreement.mismatch(
                f"its blocks {sorted(modes)} are not this rank's {sorted(self._modes)}"
            )
        plan = {(kind, func, n): rest for kind, func, n, *rest in got["plan"]}
        if plan.keys() != mine.keys():
            raise agreement.mismatch(
                f"its op positions ({len(plan)}) are not this rank's ({len(mine)}): "
                f"{sorted(plan.keys() ^ mine.keys())[:4]} differ"
            )
        self._modes = modes
        for name, (policy, why, seconds, move) in plan.items():
            pos = mine[name]
            self._plan[pos] = CheckpointPolicy[policy]
            self._reasons[pos] = (why, seconds, move)
        self.measured = {**got["measured"], "ranks_agreeing": float(agreement.world)}
        self._share, self._trial_left = got["share"], got["trial_left"]

    def _wall(self, kind: int) -> float:
        """The shorter of the counted profiling steps of a kind (NOTE [trial steps])."""
        walls = [self._walls[i] for i in self._counted(kind) if i in self._walls]
        return min(walls) if walls else math.inf

    def _peak(self, kind: int) -> int:
        """The most memory the counted profiling steps of a kind held (NOTE [plans within
        the noise]); 0 if unknown."""
        return _most([self._peaks.get(i, 0) for i in self._counted(kind)])

    def _moved_by_kind(self, kind: int) -> int:
        """The most bytes a counted profiling step of a kind moved (NOTE [plans within the
        noise])."""
        return max((self._moved.get(i, 0) for i in self._counted(kind)), default=0)

    def _trial_step_ended(self, step: _Weighed) -> None:
        """A planned step of a tried plan ended, as measured (NOTE [trial steps])."""
        self._trial_steps.append(step)
        self._trial_left -= 1
        if self._trial_untrimmed and self._trial_left == _UNTRIMMED_STEPS:
            self._hold(True)  # NOTE [trims a plan does without]: the last steps without
        if self._trial_left == 0:
            self._judge_trial()

    def _judge_trial(self) -> None:
        """Keep the tried plan or take a profiled one: the fastest of the three, unless
        one within 5% of it held at least 5% less memory, or at most 5% more and moved
        25% fewer bytes (NOTE [trial steps], NOTE [plans within the noise])."""
        steps = self._trial_steps[1:]  # (the first planned step learns the order)
        if self._trial_untrimmed:  # NOTE [trims a plan does without]: its trims, judged
            n = _UNTRIMMED_STEPS
            peaks = [step.peak for step in steps]
            self._trial_trims = self._trims_verdict_of(_most(peaks[:-n]), _most(peaks[-n:]))
            self._trial_trimmed_s = min(step.wall for step in steps[:-n])
            # the steps without trims count where it may run without them
            steps = steps[-n:] if self._trial_trims.held else steps[:-n]
            self._hold(False)
        tried = min(step.wall for step in steps)
        trial_peak = _most([step.peak for step in steps])
        trial_moved = max(step.moved for step in steps)
        # Without trims within what their verdict allows, the plan is weighed by time (NOTE
        # [trims a plan does without]): the other plans' peaks were under trims.
        untrimmed = self._trial_trims is not None and self._trial_trims.held
        plans = {"trial": _Weighed(tried, 0 if untrimmed else trial_peak, trial_moved)}
        plans.update(self._profiled_plans)
        chosen = _leanest_of_the_fastest(plans)
        choice = ("trial", "plain", "alone").index(chosen)
        why = _why_chosen(plans, chosen, "trial", "this plan's trial") if choice else ""
        plain, alone = plans["plain"].wall, plans["alone"].wall
        if self._agreement is not None:  # NOTE [ranks agree] in agreement.py: rank 0's
            mine = [choice, why, tried, plain, alone, trial_peak, trial_moved]
            got = json.loads(self._agreement.first_rank(json.dumps(mine).encode()))
            choice, why, tried, plain, alone, trial_peak, trial_moved = got
        if choice:
            self._trial_trims = None  # (the tried plan's: another plan runs)
            self._switch(PLAIN if choice == 1 else WHOLE, why)
            self._trim_heap()  # NOTE [a trim where the plan changes]
        self.measured.update(
            trial_step_s=tried,
            trial_plain_s=plain,
            trial_alone_s=alone,
            trial_choice=choice,
            trial_peak_MiB=trial_peak / _MiB,
            trial_moved_MiB=trial_moved / _MiB,
        )
        if untrimmed:
            self.measured["trial_untrimmed"] = 1.0
        self._last = self._summarize(self._share, self._trial_obs)
        self._begin_trim_trial()

    def _switch(self, how: str, than: str) -> None:
        """Every profiled block checkpointed plainly (PLAIN) or whole (WHOLE), which
        ``than`` says why."""
        if how == PLAIN:
            why = f"plain checkpointing of every block {than}"
            m = self.measured  # (offload alone's reason, or the interleaving's, on every op)
            alone = bool(m.get("offload_alone") or m.get("blocks_interleaved"))
            moved = [
                pos
                for pos, policy in self._plan.items()
                if (policy in OFFLOAD or alone) and pos not in self._own_draws
            ]
        else:
            why = f"offload alone {than}"
            moved = list(self._plan)
        for pos in moved:
            self._plan[pos] = CheckpointPolicy.PREFER_RECOMPUTE
            self._reasons[pos] = (why, *self._reasons[pos][1:])
        self._modes = dict.fromkeys(self._profiled, how)
        n = len(self._profiled)
        self.measured.update(
            blocks_whole=n if how == WHOLE else 0,
            blocks_plain=n if how == PLAIN else 0,
            blocks_selective=0,
            blocks_interleaved=0,
            whole_MiB=0.0 if how == PLAIN else self.measured.get("whole_MiB", 0.0),
            offload_alone=float(how == WHOLE),
        )
        self._share = 1.0 if how == PLAIN else 0.0

    def _outputs_per_call(self) -> dict[tuple[str, int], int]:
        """Each block's op output bytes in the offload-all step, per call of the block."""
        stored = self._spans.get(_OFFLOAD_ALL_STEP, {})
        return {
            key: stored[key].per_call(nbytes) if key in stored else nbytes
            for key, nbytes in self._block_bytes.items()
        }

    def _unreachable(self) -> tuple[int, str] | None:
        """What one block's recompute holds at once (``_block_hold``, set first), and
        what that is, where it is more than a ``device_budget`` given (NOTE [a budget no
        plan reaches]); else None."""
        if self._budget <= 0 or not self._block_bytes:
            return None  # (0: no budget given; the engine moves what it can)
        floor = self._block_hold
        whole = self._spans.get(_WHOLE_ALL_STEP, {}).values()
        what = (
            "what the largest block saves for backward"
            if any(s.saved > 0 for s in whole)
            else "the largest block's op outputs"
        )
        return (floor, what) if floor > self._budget else None

    def _recompute_hold(self) -> int:
        """What one block's recompute holds at once: what the largest block saves for
        backward (the whole-block step), else (nothing reached the engine's tiers) its
        op outputs; one call's, where the model calls a block more than once a step."""
        whole = self._spans.get(_WHOLE_ALL_STEP, {})
        saved = [s.per_call(s.saved) for s in whole.values() if s.saved > 0]
        if saved:
            return max(saved)
        return max(self._outputs_per_call().values(), default=0)

    # -- the trims' trial (NOTE [trims a plan does without]) ---------------------------------

    def _hold(self, on: bool, ceiling: int | None = None) -> None:
        """Hold the engine's heap trims off (but where the process holds more than
        ``ceiling`` bytes), or let them run."""
        if self._hold_trims is not None and (self._trims_held != on or ceiling is not None):
            self._hold_trims(on, ceiling)
            self._trims_held = on

    def _rival(self) -> tuple[str, _Weighed] | None:
        """The plan that plain checkpointing is weighed against without trims (NOTE
        [plain without trims]): offload alone, or a tried plan its trial kept; its name
        and its measured step (seconds, the most memory it held, 0: unknown, and the
        bytes it moved). From the printed figures, which ranks that agree take from rank
        0."""
        m = self.measured
        if m.get("offload_alone"):
            peak, moved = m["peak_alone_MiB"], m.get("moved_alone_MiB", 0.0)
            return _ALONE, _Weighed(m["wall_alone_s"], round(peak * _MiB), round(moved * _MiB))
        if m.get("trial_choice") == 0 and "trial_step_s" in m:
            peak, moved = m["trial_peak_MiB"], m.get("trial_moved_MiB", 0.0)
            step = _Weighed(m["trial_step_s"], round(peak * _MiB), round(moved * _MiB))
            return "this plan's trial", step
        return None

    def _begin_trim_trial(self) -> None:
        """The plan holds: where it is offload alone or a tried plan, weigh plain
        checkpointing without trims against it (NOTE [plain without trims]); where it
        moves nothing, weigh its heap trims; else stop sampling memory."""
        weighs = self._hold_trims is not None and self._peak_source is not None
        # (A block class that draws its own numbers is never plain.)
        plain = math.isfinite(self.measured.get("wall_plain_s", math.inf)) and not self._own_rng
        rival = self._rival() is not None
        challenge = weighs and plain and rival
        if self._agreement is not None and rival:  # NOTE [ranks agree]
            challenge = json.loads(self._agreement.first_rank(json.dumps(challenge).encode()))
        if challenge:
            self._challenging, self._rival_modes = True, dict(self._modes)
            self._modes = dict.fromkeys(self._profiled, PLAIN)
            self.measured["weighing_plain"] = 1.0  # (the printed plan says so meanwhile)
            self._last = self._summarize(self._share, self._trial_obs)
            self._trim_heap()  # NOTE [a trim where the plan changes]
            self._start_trim_steps(settling=True)
        elif self._trial_trims is not None:  # its trims judged in its trial
            self._apply_trims(self._trial_trims, record=True)
            self._sample_peaks(False)
            self._trial_obs = {}
        elif weighs and not self._moves():  # (after a trial's steps without trims, their
            self._start_trim_steps(settling=self._trial_untrimmed)  # heap settles first)
        else:
            self._sample_peaks(False)
            self._trial_obs = {}

    def _end_weighing(self) -> None:
        """Plain checkpointing no longer runs in the plan's place unjudged: its steps end,
        and the plan made last is printed as it was (NOTE [plain without trims])."""
        self._challenging, self._trim_trial_left = False, 0
        del self.measured["weighing_plain"]
        self._last = self._summarize(self._share, self._trial_obs)

    def _moves(self) -> bool:
        """Whether the plan moves activations: selective blocks, whole blocks beyond the
        budget (offload alone, or interleaved with plain ones)."""
        m = self.measured
        return any(m.get(k) for k in ("blocks_selective", "offload_alone", "blocks_interleaved"))

    def _start_trim_steps(self, *, settling: bool) -> None:
        """The trims' trial: one step under trims, then _UNTRIMMED_STEPS without; after
        a first, uncounted step where ``settling`` (plain checkpointing in place of
        another plan: its trim bound follows what that plan moved)."""
        self._trim_trial_left = 1 + _UNTRIMMED_STEPS + settling
        self._trim_steps = []

    def _trim_step_ended(self, step: _Weighed) -> None:
        """A step of the trims' trial ended, as measured: the last but _UNTRIMMED_STEPS
        ran under trims, those after it without."""
        self._trim_steps.append(step)
        self._trim_trial_left -= 1
        if self._trim_trial_left == _UNTRIMMED_STEPS:
            self._hold(True)
        elif self._trim_trial_left == 0:
            self._judge_trims()

    def _judge_trims(self) -> None:
        """Hold the trims off for good where the steps without them held no more than
        the step under them or offload alone in the profile, whichever held more, and
        5% of the bytes a step saves (NOTE [trims a plan does without]); else let them
        run, with one trim now for what the steps without them left. Where plain
        checkpointing ran in place of another plan, it stays only where its trims are
        held off and :meth:`_weigh_plain` prefers it (NOTE [plain without trims])."""
        under, *without = self._trim_steps[-1 - _UNTRIMMED_STEPS :]
        trimmed, untrimmed = under.peak, _most([step.peak for step in without])
        verdict = self._trims_verdict_of(trimmed, untrimmed)
        again, record = False, True  # again: the plan that ran again, its own trims' trial
        challenged, self._challenging = self._challenging, False
        if challenged:
            del self.measured["weighing_plain"]
            wall = min(step.wall for step in without)
            moved = max(step.moved for step in without)
            plain = self._weigh_plain(verdict.held, _Weighed(wall, untrimmed, moved))
            self.measured.update(
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
            again = not plain and not self._moves() and self._trial_trims is None
        self._apply_trims(verdict, record=record)
        self._last = self._summarize(self._share, self._trial_obs)
        if again:
            self._start_trim_steps(settling=True)  # (its bound follows plain's moves)
            return
        self._sample_peaks(False)
        if self._stand_in is None:  # (a stand-in's plan is printed from them)
            self._trial_obs = {}

    def _trims_released(self) -> None:
        """Where trims held off for good run again (the process passed their ceiling
        twice within CEILING_STEPS steps), the plan says so (NOTE [trims a plan does
        without]). Where they were a tried plan's and plain checkpointing stands in for
        it, faster without trims than the plan with them, plain runs in its place, its
        trims held off under their own ceiling; where plain's come back too, the faster
        of the two under trims runs (NOTE [plain without trims])."""
        now = self._trims_held_now
        if not (self._trims_held and self.measured.get("trims_held") and now and not now()):
            return
        self._trims_held = False
        stand_in, self._stand_in = self._stand_in, None
        stood_for, self._stood_for = self._stood_for, None
        obs, self._trial_obs = self._trial_obs, {}
        self.measured.update(trims_held=0.0, trims_released=1.0)
        if stand_in is not None and stand_in[1] < self._trial_trimmed_s:
            verdict = stand_in[0]
            self._stood_for = (dict(self._modes), self._share, self._block_counts())
            self.measured.update(
                stand_in=1.0,
                plan_ceiling_MiB=self.measured.get("trims_ceiling_MiB", 0.0),
                trial_trimmed_s=self._trial_trimmed_s,
                trims_released=0.0,
            )
            self._switch(PLAIN, "standing in for the tried plan, heap trims held off")
            self._apply_trims(verdict, record=True)
            self._trial_obs = obs  # (until plain's own trims come back)
            self._last = self._summarize(self._share, obs)
            return
        if stood_for is not None and self._trial_trims is not None:
            plain = self._profiled_plans["plain"]
            plan = _Weighed(self._trial_trimmed_s, self._trial_trims.trimmed, 0)
            chosen = _leanest_of_the_fastest({"plain": plain, "plan": plan})
            self.measured["stand_in_kept"] = float(chosen == "plain")
            if chosen == "plan":
                self._modes, self._share, counts = stood_for
                self.measured.update(counts)
            self._last = self._summarize(self._share, obs)
            return
        m = {**self._last.measured, "trims_held": 0.0, "trims_released": 1.0}
        self._last = dataclasses.replace(self._last, measured=m)

    def _block_counts(self) -> dict[str, float]:
        """The plan's blocks as :meth:`_switch` rewrites them in ``measured``."""
        return {k: self.measured[k] for k in _BLOCK_COUNTS if k in self.measured}

    def _trims_verdict_of(self, trimmed: int, untrimmed: int) -> _TrimsVerdict:
        """Whether trims are held off where a step under them held ``trimmed`` bytes and
        steps without them ``untrimmed`` at most: no more than that step or offload alone
        in the profile, whichever held more, and 5% of the bytes a step saves (NOTE [trims
        a plan does without]); with the two peaks and that allowance."""
        allowed = max(trimmed, self._peak_alone) + _TRIMS_SLACK * self._step_saved
        return _TrimsVerdict(0 < trimmed and 0 < untrimmed <= allowed, trimmed, untrimmed, allowed)

    def _apply_trims(self, verdict: _TrimsVerdict, *, record: bool) -> None:
        """Hold the trims off for good, or let them run with one trim now for what steps
        without them left; the plan prints the figures where held, or where ``record``.
        Held off, one trim runs where the process passes the larger of the allowance and
        105% of what the steps without them held (the latter alone where the step under
        them is unknown; no ceiling where the untrimmed peak is unknown: held by rank
        0's word), and the trims run again where it passes it twice within CEILING_STEPS
        steps."""
        held, trimmed, untrimmed, allowed = verdict
        figures = {
            "trims_held": float(held),
            "trims_peak_MiB": trimmed / _MiB,
            "untrimmed_peak_MiB": untrimmed / _MiB,
            "trims_allowed_MiB": allowed / _MiB,
        }
        if held:
            ceiling = None
            if untrimmed:
                drift = untrimmed * (1 + _CEILING)
                most = max(allowed, drift) if trimmed else drift
                ceiling = int(most) if math.isfinite(most) else None
            self._hold(True, ceiling)
            self.measured.update(figures, trims_ceiling_MiB=(ceiling or 0) / _MiB)
        else:
            self._hold(False)
            self._trim_heap()
            if record:
                self.measured.update(figures)

    def _weigh_plain(self, held: bool, step: _Weighed) -> bool:
        """Plain checkpointing ran in place of the plan (offload alone, or a tried plan),
        as ``step`` measured its steps without trims, ``held``: it held no more without
        them than the verdict allows. Keep it where it ran faster than the plan's
        measured steps, or, where the plan moves activations, within 5% of them holding
        5% less, or at most 5% more and moving 25% fewer bytes; else the plan runs again
        (NOTE [plain without trims]). Whether plain runs (its trims held off: rank 0's
        choice, where ranks agree)."""
        name, theirs = self._rival() or ("", _Weighed(math.inf, 0, 0))
        wall, rival = step.wall, theirs.wall
        close = wall <= (1 + _TIE) * rival
        # NOTE [plain without trims]: against a plan that moves nothing, time alone.
        moves = name == _ALONE or theirs.moved > 0
        as_good = close and moves and (_leaner(step, theirs) or _lighter(step, theirs))
        plain = held and (wall < rival or as_good)  # (held: within what the verdict allows)
        if self._agreement is not None:  # NOTE [ranks agree] in agreement.py: rank 0's
            plain = json.loads(self._agreement.first_rank(json.dumps(plain).encode()))
        self.measured.update(
            untrimmed_plain_s=wall,
            untrimmed_choice=float(plain),
            rival_s=rival,
            rival_peak_MiB=theirs.peak / _MiB,
            rival_alone=float(name == _ALONE),
        )
        if plain:
            why = _why_chosen({"plain": step, name: theirs}, "plain", name, name)
            self._switch(PLAIN, "with heap trims held off " + why)
            return True
        self._modes = self._rival_modes
        return False

    def _warn_budget(self, unreachable: tuple[int, str] | None) -> None:
        """Warn once where a budget no plan reaches (what :meth:`_unreachable` said)."""
        if unreachable is not None and not self._warned:
            floor, what = unreachable
            self._warned = True
            warnings.warn(
                f"prefetch_offload: device_budget={self._budget} bytes is below what one "
                f"block's recompute holds at once ({floor} bytes, {what}): no plan reaches "
                f"it; the smallest reachable is about {floor} bytes plus the tensors saved "
                "outside the blocks, which checkpointing every block plainly (but a smaller "
                "one the budget keeps whole) comes closest to, and runs. Raise "
                "device_budget to at least that, or split the blocks "
                "(recompute_blocks=) finer.",
                OffloadFallbackWarning,
                stacklevel=2,
            )

    def _summarize(self, share: float, obs: dict[Position, _Obs]) -> RecomputePlan:
        per: dict[str, list[Position]] = collections.defaultdict(list)
        for pos in obs:
            per[op_kind(pos[1])].append(pos)
        ops = []
        totals: collections.Counter[str] = collections.Counter()
        # The rows' bytes and seconds are the checkpointed blocks' share; with none
        # checkpointed, every block's (what autograd saves and the engine keeps or moves).
        row_share = share or 1.0
        for kind, positions in per.items():
            choices = {_choice_name(self._plan[p]) for p in positions}
            nbytes = round(sum(obs[p].nbytes for p in positions) * row_share)
            for p in positions:
                totals[_choice_name(self._plan[p])] += round(obs[p].nbytes * share)
            reasons = sorted({self._reasons[p][0] for p in positions})
            choice = choices.pop() if len(choices) == 1 else "mixed"
            if share == 0:  # no block checkpointed: what autograd saves goes to the engine
                choice = "whole"
                if not self.measured.get("offload_alone") and not self.measured.get("trial_choice"):
                    reasons = ["every block whole: device_budget keeps what they save"]
            ops.append(
                OpDecision(
                    kind,
                    choice,
                    nbytes,
                    len(positions),
                    seconds_per_step=sum(obs[p].total_s for p in positions) * row_share,
                    move_seconds_per_step=sum(self._reasons[p][2] for p in positions),
                    reason="; ".join(reasons),
                )
            )
        return RecomputePlan(
            "auto",
            tuple(ops),
            bytes_recomputed=totals["recompute"],
            bytes_offloaded=totals["offload"],
            bytes_kept=totals["keep"],
            measured=dict(self.measured),
            plans_made=self.plans_made,
        )

    def plan(self) -> RecomputePlan:
        """The last plan made (empty before the first profiling step has ended)."""
        with self._lock:
            return self._last

    @property
    def profiling(self) -> bool:
        """Whether the current step warms up or profiles (no plan acts yet)."""
        return self._phase != _PLANNED
