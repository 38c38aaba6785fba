"""Giving glibc's free heap memory back (NOTE [heap trim])."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from prefetch_offload import OffloadConfig, OffloadEngine, heap, offload_context
from prefetch_offload.heap import (
    CEILING_STEPS,
    FAST_REUSE_OFF,
    HeapTrimmer,
    fast_reuse_hint,
    heap_trim_supported,
)
from prefetch_offload.stats import StatsCounter
from prefetch_offload.testing import TinyTransformer, make_batch

glibc_only = pytest.mark.skipif(not heap_trim_supported(), reason="needs glibc's malloc_trim")
MiB = 1 << 20


class _Jobs:
    """Keeps submitted trim jobs until the test runs them."""

    def __init__(self) -> None:
        self.jobs: list[Callable[[], None]] = []

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.append(job)

    def run_all(self) -> None:
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job()


class _Slack:
    """A slack gauge the test sets by hand."""

    def __init__(self) -> None:
        self.value = 0
        self.in_use = 0
        self.reads = 0

    def __call__(self) -> tuple[int, int]:
        self.reads += 1
        return self.value, self.in_use


def _trimmer(
    threshold: int | None,
    *,
    own: Callable[[], int] = lambda: 0,
    allowance: Callable[[], int] = lambda: 0,
    step_share: float | None = None,
    resident: Callable[[], int] = lambda: 0,
) -> tuple[HeapTrimmer, _Jobs, _Slack, StatsCounter]:
    jobs, slack, stats = _Jobs(), _Slack(), StatsCounter()
    trimmer = HeapTrimmer(
        threshold,
        stats,
        own_bytes=own,
        levels=slack,
        submit=jobs.submit,
        interval=0.0,
        allowance=allowance,
        step_share=step_share,
        resident=resident,
    )
    return trimmer, jobs, slack, stats


def _warnings(caplog: pytest.LogCaptureFixture) -> int:
    return len([r for r in caplog.records if "heap_trim_bytes ignored" in r.message])


@glibc_only
def test_trims_when_the_slack_has_grown_by_the_threshold_and_never_queues_two() -> None:
    trimmer, jobs, slack, stats = _trimmer(10 * MiB)
    slack.value = 100 * MiB
    trimmer.check()  # no CPU activation saved yet: the slack is not the engine's doing
    assert jobs.jobs == []
    trimmer.saved()
    trimmer.check()  # the first measure sets the floor
    slack.value = 109 * MiB
    trimmer.check()  # grown by 9 MiB < 10: nothing
    assert jobs.jobs == []
    slack.value = 110 * MiB
    trimmer.check()  # grown by 10 MiB: one trim
    assert len(jobs.jobs) == 1
    slack.value = 150 * MiB
    trimmer.check()  # due again, but one is queued: it will give this back too
    assert len(jobs.jobs) == 1
    slack.value = 102 * MiB  # what the trim leaves is the new floor
    jobs.run_all()
    assert stats.snapshot().heap_trims == 1 and stats.snapshot().heap_trim_seconds >= 0
    slack.value = 111 * MiB
    trimmer.check()  # 9 MiB over 102: nothing
    assert jobs.jobs == []
    slack.value = 95 * MiB
    trimmer.check()  # the floor follows the slack down...
    slack.value = 105 * MiB
    trimmer.check()  # ...so 10 MiB over its lowest is due
    assert len(jobs.jobs) == 1
    jobs.run_all()
    assert stats.snapshot().heap_trims == 2


@glibc_only
def test_a_held_trimmer_measures_and_trims_nothing_until_let_go() -> None:
    """NOTE [trims a plan does without] in recompute_trims.py: held, neither the slack nor a
    plan change queues a trim; let go, the slack built meanwhile is due at once."""
    trimmer, jobs, slack, _ = _trimmer(10 * MiB)
    trimmer.saved()
    trimmer.check()  # floor 0
    trimmer.hold(True)
    assert trimmer.held
    slack.value = 500 * MiB
    trimmer.check()
    trimmer.trim_now()
    assert jobs.jobs == [] and slack.reads == 1  # (the floor's measure only)
    trimmer.hold(False)
    trimmer.check()
    assert len(jobs.jobs) == 1 and not trimmer.held


@glibc_only
def test_a_held_trimmer_trims_once_above_its_ceiling_and_runs_again_if_passed_soon() -> None:
    """NOTE [trims a plan does without] in recompute_trims.py: held with a ceiling, the
    slack queues nothing, measured without mallinfo2's walk; the resident memory above
    the ceiling queues one trim and the trims stay held; above it again CEILING_STEPS
    steps later, one more trim, still held; above it again within CEILING_STEPS steps
    of that, the trims run again for good, with one trim at once."""
    resident = [0]
    trimmer, jobs, slack, stats = _trimmer(10 * MiB, resident=lambda: resident[0])
    trimmer.saved()
    trimmer.hold(True, 800 * MiB)
    slack.value, resident[0] = 500 * MiB, 800 * MiB
    trimmer.check()  # at the ceiling, whatever the slack: nothing
    assert jobs.jobs == [] and slack.reads == 0 and trimmer.held
    resident[0] = 801 * MiB
    trimmer.check()
    trimmer.check()  # queued: no second one
    assert len(jobs.jobs) == 1 and trimmer.held
    jobs.run_all()
    assert stats.snapshot().heap_trims == 1
    for _ in range(CEILING_STEPS):  # the heap drifts past it again, steps later
        trimmer.step_moved(0)
    trimmer.check()
    assert len(jobs.jobs) == 1 and trimmer.held
    jobs.run_all()
    for _ in range(CEILING_STEPS - 1):  # and again sooner: for good
        trimmer.step_moved(0)
    trimmer.check()
    assert len(jobs.jobs) == 1 and not trimmer.held
    jobs.run_all()
    assert stats.snapshot().heap_trims == 3
    slack.value = 600 * MiB
    trimmer.check()  # the slack rule again: a floor, then growth past the bound trims
    slack.value = 611 * MiB
    trimmer.check()
    assert len(jobs.jobs) == 1 and slack.reads > 0
    jobs.run_all()
    trimmer.hold(True)  # held without a ceiling: nothing trims
    resident[0] = 10_000 * MiB
    trimmer.check()
    assert len(jobs.jobs) == 0 and trimmer.held


@glibc_only
def test_a_ceiling_read_across_a_trim_or_a_new_hold_counts_for_nothing() -> None:
    """Two hooks check at once: while one reads the resident memory above the ceiling,
    the other queues a trim at the ceiling and it runs (or a new verdict holds the trims
    under another ceiling). The first reading is from before that: it neither trims
    again nor, as a second pass within CEILING_STEPS steps, lets the trims run."""
    trimmer: HeapTrimmer | None = None
    during: list[Callable[[], None]] = []

    def resident() -> int:
        if during:
            during.pop()()  # (the other hook, while this one reads)
        return 900 * MiB

    trimmer, jobs, _, stats = _trimmer(10 * MiB, resident=resident)
    trimmer.saved()
    trimmer.hold(True, 800 * MiB)

    def other_hook() -> None:
        assert trimmer is not None
        trimmer.check()  # over the ceiling: the first pass, one trim
        jobs.run_all()

    during.append(other_hook)
    trimmer.check()
    assert jobs.jobs == [] and trimmer.held and stats.snapshot().heap_trims == 1
    during.append(lambda: trimmer.hold(True, 950 * MiB) if trimmer else None)
    trimmer.check()  # read under the old ceiling: nothing
    assert jobs.jobs == [] and trimmer.held
    trimmer.check()  # 900 MiB is under the new one
    assert jobs.jobs == [] and trimmer.held


@glibc_only
def test_a_trim_at_the_ceiling_that_leaves_the_process_above_it_lets_the_trims_run() -> None:
    """Live memory above the ceiling (no trim brings it under): the trims run again at
    the next measure of the same step; a new hold starts the count again."""
    resident = [0]
    trimmer, jobs, _, _ = _trimmer(10 * MiB, resident=lambda: resident[0])
    trimmer.saved()
    trimmer.hold(True, 800 * MiB)
    resident[0] = 900 * MiB
    trimmer.check()
    jobs.run_all()
    assert trimmer.held
    trimmer.check()  # still above it, the same step
    assert len(jobs.jobs) == 1 and not trimmer.held
    jobs.run_all()
    trimmer.hold(True, 800 * MiB)  # a new verdict: its first pass trims and holds
    trimmer.check()
    assert len(jobs.jobs) == 1 and trimmer.held


@glibc_only
def test_the_engines_own_buffers_are_not_slack() -> None:
    own = [0]
    trimmer, jobs, slack, _ = _trimmer(10 * MiB, own=lambda: own[0])
    trimmer.saved()
    trimmer.check()
    slack.value, own[0] = 30 * MiB, 25 * MiB  # read buffers mapped: 5 MiB of slack
    trimmer.check()
    assert jobs.jobs == []
    slack.value = 40 * MiB
    trimmer.check()
    assert len(jobs.jobs) == 1


@glibc_only
def test_the_allowance_raises_the_bound_while_it_lasts() -> None:
    """The device budget's unfilled share may be slack (NOTE [heap trim])."""
    headroom = [30 * MiB]
    trimmer, jobs, slack, _ = _trimmer(10 * MiB, allowance=lambda: headroom[0])
    trimmer.saved()
    trimmer.check()  # floor 0
    slack.value = 39 * MiB
    trimmer.check()  # 39 < 10 + 30: the budget's free share holds it
    assert jobs.jobs == []
    headroom[0] = 29 * MiB  # kept records fill the budget: the bound comes down...
    trimmer.check()
    assert len(jobs.jobs) == 1  # ...and the slack over it is given back
    slack.value = 5 * MiB  # what the trim leaves is the new floor
    jobs.run_all()
    headroom[0] = 0  # the budget full: the plain bound again
    slack.value = 14 * MiB
    trimmer.check()
    assert jobs.jobs == []
    slack.value = 15 * MiB
    trimmer.check()
    assert len(jobs.jobs) == 1


@glibc_only
def test_with_a_step_share_the_bound_follows_the_bytes_a_step_moved() -> None:
    trimmer, jobs, slack, _ = _trimmer(10 * MiB, step_share=0.25)
    trimmer.saved()
    trimmer.check()  # floor 0
    trimmer.step_moved(200 * MiB)  # a quarter: 50 MiB, above the 10 MiB floor
    assert trimmer.bound == 50 * MiB
    slack.value = 49 * MiB
    trimmer.check()
    assert not jobs.jobs
    slack.value = 50 * MiB
    trimmer.check()
    assert len(jobs.jobs) == 1
    jobs.run_all()  # the floor is now 50 MiB
    trimmer.step_moved(8 * MiB)  # a small step: back to the floor
    assert trimmer.bound == 10 * MiB
    slack.value = 60 * MiB
    trimmer.check()
    assert len(jobs.jobs) == 1


@glibc_only
def test_slack_that_the_step_fills_again_at_its_peak_is_not_trimmed() -> None:
    """The ceiling (NOTE [heap trim]): memory freed below this step's or the last
    step's most in use is room the step fills again, not slack over the bound."""
    trimmer, jobs, slack, _ = _trimmer(10 * MiB)
    trimmer.saved()
    trimmer.check()  # floor 0, nothing in use
    slack.in_use = 100 * MiB
    trimmer.check()  # the step's peak so far
    slack.in_use, slack.value = 40 * MiB, 60 * MiB  # freed 60 MiB, all kept by glibc
    trimmer.check()
    assert jobs.jobs == []  # resident: 100 MiB, the peak itself
    slack.value = 69 * MiB
    trimmer.check()
    assert jobs.jobs == []  # 9 MiB over the peak: within the bound
    slack.value = 70 * MiB
    trimmer.check()
    assert len(jobs.jobs) == 1  # 10 MiB over: trimmed
    jobs.run_all()  # the floor is now 70 MiB
    trimmer.step_moved(0)  # a new step: the last one's peak still counts...
    slack.in_use = 20 * MiB
    trimmer.check()
    assert jobs.jobs == []
    trimmer.step_moved(0)  # ...for one step; then only this one's (20 MiB)
    slack.value = 80 * MiB
    trimmer.check()
    assert len(jobs.jobs) == 1


@glibc_only
def test_the_budget_s_allowance_and_the_room_below_the_peak_do_not_add_up() -> None:
    """Kept records are in the step's peak; once backward has used them their share of
    the budget is allowance again. Counting both would let the budget count twice
    (NOTE [heap trim]): the larger of the two is tolerated beyond the bound."""
    headroom = [0]
    trimmer, jobs, slack, _ = _trimmer(10 * MiB, allowance=lambda: headroom[0])
    trimmer.saved()
    trimmer.check()  # floor 0
    slack.in_use = 100 * MiB  # the peak: kept records fill the budget (no allowance)
    trimmer.check()
    # Backward used 30 MiB of kept records, and 20 MiB more was freed: 30 MiB of
    # allowance, 50 MiB of room.
    headroom[0], slack.in_use, slack.value = 30 * MiB, 50 * MiB, 59 * MiB
    trimmer.check()
    assert jobs.jobs == []  # within 10 + 50: the room, the larger
    slack.value = 60 * MiB
    trimmer.check()
    assert len(jobs.jobs) == 1  # not within 10 + 50 + 30
    jobs.run_all()  # the floor is now 60 MiB
    # Room 10 MiB (in use 90), allowance 30: the allowance, the larger, holds.
    slack.in_use, slack.value = 90 * MiB, 99 * MiB
    trimmer.check()
    assert jobs.jobs == []  # 39 MiB over the floor: within 10 + 30
    slack.value = 100 * MiB
    trimmer.check()
    assert len(jobs.jobs) == 1


@glibc_only
def test_without_a_step_share_the_bound_stays_fixed() -> None:
    trimmer, jobs, slack, _ = _trimmer(10 * MiB)
    trimmer.saved()
    trimmer.check()
    trimmer.step_moved(400 * MiB)
    assert trimmer.bound == 10 * MiB
    slack.value = 10 * MiB
    trimmer.check()
    assert len(jobs.jobs) == 1


@glibc_only
def test_checks_are_spaced_by_the_interval() -> None:
    jobs, slack = _Jobs(), _Slack()
    trimmer = HeapTrimmer(MiB, StatsCounter(), levels=slack, submit=jobs.submit, interval=3600.0)
    trimmer.saved()
    trimmer.check()  # sets the floor
    slack.value = 64 * MiB
    trimmer.check()  # within the interval: not even measured
    assert jobs.jobs == []


@glibc_only
def test_a_larger_bound_spaces_the_checks_further() -> None:
    """A sixteenth of the bound at 1 GiB/s: a 64 GiB bound waits four seconds."""
    calls: list[int] = []

    def gauge() -> tuple[int, int]:
        calls.append(1)
        return 0, 0

    for bound, measured in ((64 << 30, 1), (MiB, 3)):
        calls.clear()
        trimmer = HeapTrimmer(bound, StatsCounter(), levels=gauge, submit=_Jobs().submit)
        trimmer.saved()
        for _ in range(3):
            trimmer.check()
            # Past the least interval, a 1 MiB bound's spacing, and ten times a measure
            # that a busy machine slowed (the spacing is at least that).
            time.sleep(0.02)
        assert len(calls) == measured


def test_none_never_trims() -> None:
    trimmer, jobs, slack, stats = _trimmer(None)
    assert not trimmer.enabled
    trimmer.saved()
    trimmer.check()
    slack.value = 1 << 40
    trimmer.check()
    assert jobs.jobs == [] and stats.snapshot().heap_trims == 0


@glibc_only
def test_a_failed_trim_turns_trimming_off_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    trimmer, jobs, slack, _ = _trimmer(MiB)
    trimmer.saved()
    trimmer.check()
    slack.value = 2 * MiB
    trimmer.check()

    def broken(pad: int) -> int:
        raise OSError("no")

    monkeypatch.setattr(heap, "_MALLOC_TRIM", broken)
    with caplog.at_level("WARNING", logger="prefetch_offload"):
        jobs.run_all()
    assert not trimmer.enabled and _warnings(caplog) == 1
    assert "giving heap memory back failed" in caplog.records[-1].getMessage()
    slack.value = 10 * MiB
    trimmer.check()  # off: the hooks go on without trims
    assert jobs.jobs == [] and not trimmer._queued


@glibc_only
def test_trim_now_queues_one_trim_whatever_the_slack() -> None:
    """NOTE [a trim where the plan changes]: no slack over the bound is needed; none before CPU
    activations were saved, none beside a queued one, none with trims off."""
    trimmer, jobs, slack, stats = _trimmer(64 * MiB)
    trimmer.trim_now()
    assert jobs.jobs == []  # nothing saved yet: the heap is not the engine's doing
    trimmer.saved()
    slack.value = 30 * MiB
    trimmer.check()  # the floor: 30 MiB
    slack.value = 31 * MiB  # far below the bound
    trimmer.trim_now()
    trimmer.trim_now()
    assert len(jobs.jobs) == 1
    slack.value = 5 * MiB
    jobs.run_all()
    assert stats.snapshot().heap_trims == 1 and not trimmer._queued
    slack.value = 68 * MiB
    trimmer.check()  # the trim's floor (5 MiB), not 30, stands: 63 MiB over it, below
    assert jobs.jobs == []
    slack.value = 69 * MiB
    trimmer.check()  # 64 MiB over the floor the trim left
    assert len(jobs.jobs) == 1
    off, off_jobs, _, _ = _trimmer(None)
    off.saved()
    off.trim_now()
    assert off_jobs.jobs == []


@glibc_only
def test_no_measure_while_a_trim_is_queued_and_none_across_one() -> None:
    calls = [0]
    jobs, slack = _Jobs(), _Slack()

    def counted() -> tuple[int, int]:
        calls[0] += 1
        return slack()

    trimmer = HeapTrimmer(MiB, StatsCounter(), levels=counted, submit=jobs.submit, interval=0.0)
    trimmer.saved()
    trimmer.check()
    slack.value = 2 * MiB
    trimmer.check()
    assert len(jobs.jobs) == 1 and calls[0] == 2
    trimmer.check()  # queued: glibc holds its arena locks while it trims; no measure
    assert calls[0] == 2
    slack.value = 0
    jobs.run_all()  # the trim measures the level it leaves: 0
    assert calls[0] == 3

    # A hook that measured before a trim and decides after it must drop its measure.
    slack.value = 5 * MiB
    real_measure = trimmer.measure

    def measure_across_a_trim() -> tuple[int, int]:
        levels = real_measure()  # 5 MiB over the floor: due...
        with trimmer._lock:
            trimmer._generation += 1  # ...but a trim completes meanwhile
        return levels

    trimmer.measure = measure_across_a_trim  # type: ignore[method-assign]
    trimmer.check()
    assert jobs.jobs == []
    trimmer.measure = real_measure  # type: ignore[method-assign]
    trimmer.check()  # measured afresh: due
    assert len(jobs.jobs) == 1


@glibc_only
def test_a_thread_that_cannot_start_turns_trimming_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    slack = _Slack()
    trimmer = HeapTrimmer(MiB, StatsCounter(), levels=slack, interval=0.0)
    trimmer.saved()
    trimmer.check()
    slack.value = 8 * MiB

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with caplog.at_level("WARNING", logger="prefetch_offload"):
        trimmer.check()  # the hook does not fail
    assert not trimmer.enabled and not trimmer._queued and _warnings(caplog) == 1
    trimmer.close()


@glibc_only
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_trim_thread_is_started_again() -> None:
    stats = StatsCounter()
    slack = _Slack()
    trimmer = HeapTrimmer(MiB, stats, levels=slack, interval=0.0)
    worker = trimmer._thread
    assert worker is not None

    def die() -> None:
        raise SystemExit  # ends the thread quietly, as no trim job would

    worker.submit(die)
    first = worker._thread
    assert first is not None
    first.join(timeout=30)
    assert not first.is_alive()
    trimmer.saved()
    trimmer.check()
    slack.value = 8 * MiB
    trimmer.check()  # queued on a dead thread, it would never run: a new one runs it
    deadline = time.monotonic() + 30
    while stats.snapshot().heap_trims == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert stats.snapshot().heap_trims == 1
    assert worker._thread is not first
    trimmer.close()


@glibc_only
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_trimming_stops_in_the_child_of_a_fork() -> None:
    slack = _Slack()
    trimmer = HeapTrimmer(MiB, StatsCounter(), levels=slack, interval=0.0)
    trimmer.saved()
    heap.heap_slack_bytes()  # the parent's statm is open
    said: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = said.append  # type: ignore[method-assign]
    logging.getLogger("prefetch_offload").addHandler(handler)
    try:
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            ok = not trimmer.enabled and heap._STATM._fd == -1  # the parent's file closed
            ok = ok and heap.heap_slack_bytes() != 0 and heap._STATM._fd >= 0  # the child's
            trimmer.check()
            trimmer.close()  # must not wait on a thread or a lock copied from the parent
            ok = ok and not said  # a DataLoader worker's fork says nothing
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        logging.getLogger("prefetch_offload").removeHandler(handler)
    assert os.waitstatus_to_exitcode(status) == 0
    assert trimmer.enabled and not said
    trimmer.close()


def _trimmer_with_its_thread() -> tuple[HeapTrimmer, threading.Thread]:
    """A trimmer on its own thread that has run one trim."""
    slack = _Slack()
    stats = StatsCounter()
    trimmer = HeapTrimmer(MiB, stats, levels=slack, interval=0.0)
    trimmer.saved()
    trimmer.check()
    slack.value = 8 * MiB
    trimmer.check()
    deadline = time.monotonic() + 30
    while stats.snapshot().heap_trims == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert stats.snapshot().heap_trims == 1
    thread = trimmer._thread._thread  # type: ignore[union-attr]
    assert thread is not None and thread.is_alive()
    return trimmer, thread


@glibc_only
def test_the_trim_thread_runs_trims_and_stops_at_close() -> None:
    trimmer, thread = _trimmer_with_its_thread()
    trimmer.close()
    assert not thread.is_alive()


@glibc_only
def test_a_trim_gives_freed_heap_pages_back() -> None:
    """What the engine relies on: glibc keeps freed heap chunks resident, and
    malloc_trim(0) returns their pages even when a live chunk pins the heap's top."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * page

    # 64 KiB chunks stay below glibc's mmap threshold: they come from the heap. The
    # allocations run on a fresh thread so that they come from its own arena, whose
    # state no earlier test shaped.
    freed: list[int] = []

    def churn() -> None:
        chunks = [libc.malloc(64 << 10) for _ in range(1024)]  # 64 MiB
        for c in chunks:
            ctypes.memset(c, 1, 64 << 10)
        pin = libc.malloc(64 << 10)  # live above them: the top cannot shrink
        ctypes.memset(pin, 1, 64 << 10)
        before = rss()
        for c in chunks:
            libc.free(c)
        kept = rss()
        slack_kept = heap.heap_slack_bytes()
        heap._MALLOC_TRIM(0)
        freed.extend([before - kept, kept - rss(), slack_kept - heap.heap_slack_bytes()])
        libc.free(pin)

    thread = threading.Thread(target=churn)
    thread.start()
    thread.join()
    kept_back, given_back, slack_given_back = freed
    assert kept_back < 16 * MiB  # free() alone kept most of it resident
    assert given_back > 32 * MiB
    assert slack_given_back > 32 * MiB  # the slack saw it: what the engine trims on


def _leave_free_heap_memory(libc: Any, nbytes: int) -> int:
    """Allocate, touch and free ``nbytes`` of 64 KiB heap chunks below a live one
    (returned, for the caller to free): glibc keeps them resident, as slack."""
    chunks = [libc.malloc(64 << 10) for _ in range(nbytes // (64 << 10))]
    for c in chunks:
        ctypes.memset(c, 1, 64 << 10)
    pin = libc.malloc(64 << 10)
    ctypes.memset(pin, 1, 64 << 10)
    for c in chunks:
        libc.free(c)
    return int(pin)


@glibc_only
@pytest.mark.parametrize("threshold", [None, 4 * MiB])
def test_engine_trims_when_slack_builds_up(tmp_path: Path, threshold: int | None) -> None:
    """Slack left between steps is given back at the next hook; training stays exact."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    torch.manual_seed(0)
    model = TinyTransformer(width=64, depth=2, heads=2)
    ref = TinyTransformer(width=64, depth=2, heads=2)
    ref.load_state_dict(model.state_dict())
    tokens, targets = make_batch(2, 64)
    ref(tokens, targets).backward()
    pins: list[int] = []
    with offload_context(
        "disk",
        save_dir=str(tmp_path),
        min_offload_bytes=0,
        chunk_bytes=16384,  # small write batches: the tiny model's tensors reach the disk
        heap_trim_bytes=threshold,
    ) as engine:
        # Measure at every hook: a slow measure (a heap that earlier tests fragmented)
        # spaces the next one by ten times its cost, longer than this tiny step.
        engine._heap._interval = 0.0
        trims = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(tokens, targets).backward()
            deadline = time.monotonic() + 30
            while engine._heap._queued and time.monotonic() < deadline:
                time.sleep(0.001)  # a trim still running would take this slack too
            trims.append(engine.stats().heap_trims)
            # Free memory that earlier tests left resident would take the churn below
            # without new pages: give it back, and let the trimmer see that level.
            heap._MALLOC_TRIM(0)
            time.sleep(0.002)
            engine._heap.check()
            pins.append(_leave_free_heap_memory(libc, 32 * MiB))
            time.sleep(0.002)  # past the check interval: the next hook measures
        stats = engine.stats()
    for pin in pins:
        libc.free(pin)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)
    assert stats.tensors_offloaded + stats.writes_skipped > 0  # written, or the write tail
    if threshold is None:
        assert stats.heap_trims == 0
    else:  # each step after slack was left began with a trim
        assert trims[1] > trims[0] and trims[2] > trims[1]


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, "heap_trim_bytes must be > 0"),
        (True, TypeError, "heap_trim_bytes must be an int or a str"),
        (-1, ValueError, "heap_trim_bytes must be >= 0"),
        ("lots", ValueError, "heap_trim_bytes"),
    ],
)
def test_heap_trim_bytes_is_checked(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        OffloadConfig(target="disk", save_dir="/tmp/x", heap_trim_bytes=value)  # type: ignore[arg-type]


def test_heap_trim_bytes_takes_units_and_none() -> None:
    assert OffloadConfig(target=None, heap_trim_bytes="64MiB").heap_trim_bytes == 64 * MiB
    assert OffloadConfig(target=None, heap_trim_bytes=None).heap_trim_bytes is None
    assert OffloadConfig(target=None, heap_trim_bytes="auto").heap_trim_bytes == "auto"
    assert OffloadConfig(target=None).heap_trim_bytes == "auto"


@glibc_only
def test_a_slack_that_cannot_be_measured_turns_trimming_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def unreadable() -> tuple[int, int]:
        raise OSError("no /proc")

    jobs = _Jobs()
    trimmer = HeapTrimmer(MiB, StatsCounter(), levels=unreadable, submit=jobs.submit, interval=0.0)
    trimmer.saved()
    with caplog.at_level("WARNING", logger="prefetch_offload"):
        trimmer.check()  # the hook goes on; trimming is off, said once
        trimmer.check()
    assert not trimmer.enabled and jobs.jobs == [] and _warnings(caplog) == 1


@glibc_only
def test_a_trimmer_dropped_without_close_stops_its_thread() -> None:
    trimmer, thread = _trimmer_with_its_thread()
    del trimmer
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.mark.parametrize("budget", [0, 640 << 10])
def test_the_engine_lets_slack_use_the_unfilled_device_budget(tmp_path: Path, budget: int) -> None:
    """The trim bound's allowance is what kept records leave of ``device_budget``."""
    engine = OffloadEngine(
        OffloadConfig(
            target="disk", save_dir=str(tmp_path), min_offload_bytes=0, device_budget=budget
        )
    )
    try:
        assert engine._heap._allowance() == budget  # nothing kept yet
        w = torch.ones(64 << 10, requires_grad=True)  # 256 KiB
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            h = w
            for _ in range(6):
                h = torch.sin(h + 1)  # saves a fresh 256 KiB tensor
            engine.flush()  # demotions landed: two newest kept under 640 KiB
            assert engine._heap._allowance() == (budget - (512 << 10) if budget else 0)
            h.sum().backward()
        assert w.grad is not None
        del h
        engine.stats()  # drains the records backward freed
        assert engine._heap._allowance() == budget
    finally:
        engine.close()


@glibc_only
def test_auto_bound_follows_the_bytes_the_engine_moved_last_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(width=64, depth=2, heads=2)
    tokens, targets = make_batch(2, 64)
    config = OffloadConfig(
        target="disk",
        save_dir=str(tmp_path),
        min_offload_bytes=0,
        chunk_bytes=16384,  # small write batches: the tiny model's tensors reach the disk
    )
    assert config.heap_trim_bytes == "auto"
    engine = OffloadEngine(config)
    engine._heap.threshold = 1  # a floor below this tiny model's steps
    moved: list[int] = []
    bounds: list[int] = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            for _ in range(3):
                loss = model(tokens, targets)  # its first pack sets the last step's bytes
                bounds.append(engine._heap.bound)
                engine.flush()  # every step's tensors reach the disk before backward
                loss.backward()
                moved.append(engine.stats().bytes_demoted_to_disk)
    finally:
        engine.close()
    assert moved[0] > 0 and moved[1] - moved[0] > 0
    assert bounds[1] == int(heap.AUTO_TRIM_STEP_SHARE * moved[0])
    assert bounds[2] == int(heap.AUTO_TRIM_STEP_SHARE * (moved[1] - moved[0]))


@pytest.mark.skipif(not heap_trim_supported(), reason="needs glibc")
def test_fast_reuse_hint_reads_glibc_s_tunables() -> None:
    hint = fast_reuse_hint({})
    assert hint == f"GLIBC_TUNABLES={FAST_REUSE_OFF}"
    off = {"GLIBC_TUNABLES": "glibc.malloc.mxfast=0:glibc.malloc.tcache_count=0"}
    assert fast_reuse_hint(off) is None  # both already off, in any order
    half = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    assert fast_reuse_hint(half) == hint  # one alone does not keep the holes together
    other = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7:glibc.malloc.mxfast=0:junk"}
    assert fast_reuse_hint(other) == hint
    as_glibc_reads = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=00:glibc.malloc.mxfast=0x0"}
    assert fast_reuse_hint(as_glibc_reads) is None


def test_start_tunables_joins_what_glibc_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc leaves a NUL after each tunable it took, in the environment's own bytes."""
    real_open = open

    def environ(raw: bytes) -> None:
        def fake_open(path: Any, *args: Any, **kw: Any) -> Any:
            if path == "/proc/self/environ":
                import io

                return io.BytesIO(raw)
            return real_open(path, *args, **kw)

        monkeypatch.setattr("builtins.open", fake_open)

    environ(
        b"GLIBC_TUNABLES=glibc.malloc.tcache_count=0\0junk=1:glibc.malloc.mxfast=0\0"
        b"http_proxy=x\0HOME=/root\0COPY=glibc.malloc.tcache_count=7\0"
    )
    joined = heap._start_tunables()
    assert joined == "glibc.malloc.tcache_count=0:junk=1:glibc.malloc.mxfast=0:http_proxy=x"
    assert fast_reuse_hint() is None
    monkeypatch.setenv("GLIBC_TUNABLES", FAST_REUSE_OFF)
    environ(b"HOME=/root\0")  # started without it: a later os.environ change is too late
    assert heap._start_tunables() == ""
    environ(b"ray::worker\0\0\0")  # a process title written over it: os.environ says
    assert heap._start_tunables() == FAST_REUSE_OFF


def test_a_preloaded_allocator_turns_trimming_off() -> None:
    """tcmalloc or jemalloc in LD_PRELOAD: glibc's trims and counts do not see its memory."""
    lib = next(
        (
            p
            for p in (
                "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
            )
            if os.path.exists(p)
        ),
        None,
    )
    if lib is None or not heap_trim_supported():
        pytest.skip("needs glibc and a preloadable allocator")
    code = (
        "from prefetch_offload.heap import heap_trim_supported as s, fast_reuse_hint as f; "
        "print(s(), f())"
    )
    env = {**os.environ, "LD_PRELOAD": lib}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "None"]


@pytest.mark.skipif(not heap_trim_supported(), reason="needs glibc")
def test_fast_reuse_hint_reads_the_environment_the_process_started_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if fast_reuse_hint() is None:
        pytest.skip("this test process started with both tunables off")
    # glibc read its tunables at start: setting them now changes nothing, nor the hint.
    monkeypatch.setenv("GLIBC_TUNABLES", FAST_REUSE_OFF)
    assert fast_reuse_hint() is not None
    # A process that starts with them set needs no hint.
    code = "from prefetch_offload.heap import fast_reuse_hint as f; print(f())"
    env = {**os.environ, "GLIBC_TUNABLES": FAST_REUSE_OFF}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "None"
