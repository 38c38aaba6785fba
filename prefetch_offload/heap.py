"""Giving back the heap memory glibc keeps resident, whenever it has built up.

# NOTE [heap trim]
# glibc's malloc keeps the memory a program frees, to reuse it, and gives back to
# the kernel only a free top of the heap (or a freed block of its own mapping,
# which PyTorch's tensors stop getting once glibc raises its mmap threshold to
# their size). Offloading frees every activation as its write lands, but the
# heap does not shrink to what is live: freed activations leave holes that
# small allocations living until backward (autograd's nodes and tensor
# metadata, 32-80 bytes each) split, so later tensors often fit no hole and
# land on pages the step has not touched yet. A walk of the main heap at the
# end of forward (bench/step.py's transformer, 24 blocks, width 256, batch
# 8x256, 970 MiB saved per step, disk offload, no trims; 2-core VM, glibc
# 2.36): 728 MiB of heap for 143 MiB live, 571 MiB of the free space in 159
# holes of 1-42 MiB, nearly every one closed by a single live chunk of 32-80
# bytes. Each page touched stays resident: that run's peak RSS was 734 MiB
# above its start, against 1346 without offload, whose own heap keeps 376 MiB
# beside the saved bytes.
#
# What keeps the holes apart is glibc's fast reuse of small chunks: a chunk in a
# thread's cache (tcache, up to 7 of each size) or in a fastbin counts as in
# use, so a freed activation beside one does not merge with the free space on
# its other side. Peak RSS above the start, the model above, no trims, the first
# four steps of one run each: disk offload 549-741 MiB with glibc's defaults,
# 226-305 with both turned off (``GLIBC_TUNABLES=glibc.malloc.
# tcache_count=0:glibc.malloc.mxfast=0``), 548-599 with only the cache off and
# 591-653 with only the fastbins off. A hook with no engine, which copies each
# saved tensor into a preallocated mapping and lets the original go at once,
# grew the same heap beside its copies (steps 3-6): 610-667 MiB, against 133-222
# with both off: any offloader that frees activations during forward meets it. A
# running process can turn off only the fastbins (``mallopt(M_MXFAST, 0)``:
# 447-761 MiB, no gain); glibc reads the cache's size once, at start, and
# even one cached chunk of each size keeps the holes apart (steps 5-7 of one
# run each, fastbins off by ``mallopt``, no trims: 583-750 MiB with
# ``tcache_count=1`` or 3, 263-305 with 0). Emptying the forward thread's cache
# at the end of each step (taking seven chunks of every cached size and
# freeing them on a thread whose own cache is full, so that they merge) held
# 657-802 MiB, against 618-708 with glibc as it starts. Freeing
# the activations on the forward thread instead of the IO threads changed
# nothing (543-667), nor did emptying the IO threads' caches into the forward
# thread (558-724), nor free 96 KiB chunks kept for small requests to split
# instead of the holes (763 against 741). Asking huge pages for the heap
# (``MADV_HUGEPAGE``) with the default trims took the faults from 233k to 134k a
# step but the step from 3.44 to 3.58 s (side by side, one run of bench/step.py,
# 5 steps): the count of faults is not the cost. So the engine trims, and
# ``docs/tuning.md`` offers the tunables as the user's choice, measured beside
# the default in ``docs/benchmarks.md``; the summary logged at exit names them
# when trims ran (:func:`fast_reuse_hint`).
#
# ``malloc_trim(0)`` returns the whole free pages inside those holes (every
# arena, not only the top). Each page used again later costs a page fault and
# a page of zeroing, and glibc holds the arena's lock while it gives pages back,
# so a trim is worth its cost only where memory has built up. Giving pages back
# lazily (``MADV_FREE``: the kernel takes them only when it needs memory) would
# make a reuse cheap, 19 ms to touch 256 MiB again against 153 ms after
# ``MADV_DONTNEED`` (one measure on the 2-core VM, kernel 6.18), but the kernel
# counts such pages in the RSS, and in its peak, until it takes them: without
# memory pressure no peak a user reads falls. So the trims give pages back at
# once (``malloc_trim`` does, and it is glibc's only way in). The engine trims
# on that measure: the slack, the process's anonymous resident memory minus the
# bytes malloc has handed out and not had back (``mallinfo2``) minus the
# engine's own mapped read buffers, is what a trim could give back. The hooks
# read it; mallinfo2 walks every free chunk under the arena locks (up to a
# millisecond on a fragmented heap), so a measure comes at most once per
# _CHECK_INTERVAL_S, at most a tenth of the time, at most once per the time the
# slack needs to grow by a sixteenth of the bound at 1 GiB/s, and never while
# a trim runs. When the slack has grown by the bound plus the allowance over
# its level after the last trim (or its lowest since), and the engine has saved
# CPU activations, the trimmer's own thread trims (the hooks never wait for
# it; at most one trim is queued or running, and a measure taken across a trim
# is dropped; trims queued on the IO pool behind reads would run only after
# backward). The allowance is the share of ``device_budget`` that kept records
# do not fill now: the user gave the budget to activations, and where they do
# not hold it (the start of forward, and backward once it has used the kept
# records) free heap may. A read buffer counts as the engine's from its lease,
# a few milliseconds before its read makes it resident; the level dips by that
# much meanwhile.
#
# The ceiling: the slack tolerated beyond the bound is the larger of the
# allowance and the room, the most malloc had handed out at a measure in this
# step or the last minus what is in use now. The step fills the room again on
# its way back to its peak, so a trim of it buys nothing at the peak and costs
# its page faults. Resident heap then stays within the bound of the larger of
# that peak and what is in use plus the allowance: never above what the slack
# rule alone allows at the step's peak, with no more trims than it. (Their sum
# would let a budget count twice: kept records are in the peak, and their
# share of the budget is allowance once backward has used them; that raised
# the peaks of budget runs by up to 110 MiB in one run of bench/recompute.py.)
# It matters where the live bytes rise and fall within a step: a checkpointed
# block's recompute holds its activations, and backward frees them before the
# next block's recompute holds its own. Measured with ``bench/step.py``, the
# ceiling against the slack rule in one run each (no budget): the 16-block
# transformer under reentrant checkpointing, 14.2 trims a step against 21.0,
# 1.39x against 1.52x the step without offload, peak 276 against 296 MiB; the
# 24-block transformer without checkpointing, 2.8 trims against 3.8, 236k
# faults a step against 270k, 1.29x against 1.30x bare IO, activation cut 94%
# against 96%.
#
# The bound: a trim gives back every free page, and the step's next
# allocations land on them, so the page faults a step pays fall as the bound
# grows, and its peak rises. ``heap_trim_bytes="auto"`` (the default) sets it
# to the larger of AUTO_TRIM_MIN_BYTES and AUTO_TRIM_STEP_SHARE of the bytes the
# last step moved out of memory (a step of a new size sets the next one's):
# the slack a step may hold grows with what the step frees. Measured on the
# 24-block transformer above, each bound in a process of its own, one run
# (docs/benchmarks.md, "Giving memory back on the CPU", has the step times):
#
#   bound                 trims/step  faults/step  peak MiB  activation cut
#   64 MiB                      12.6       374k       239       111%
#   128 MiB                      6.0       300k       308       104%
#   auto (242 MiB here)          2.8       221k       408        94%
#   384 MiB                      1.2       167k       551        79%
#   none (no trims)              0           7k       677        66%
#
# (the cut is of the saved bytes, against what no offload holds beside them;
# over 100% where the trims also give back free heap that no offload keeps).
# A quarter keeps the cut above 90% there with 0.59x the faults of 64 MiB; a
# model that saves less than 256 MiB a step keeps the 64 MiB floor.
#
# A checkpointed model moves little and its recompute churns much: the
# 16-block transformer under reentrant checkpointing moves 40 MiB a step, and
# at the 64 MiB floor the trims also give back the recompute's churn (what
# grows the heap beyond the ceiling), 15 a step, 419k faults: 1.50x the step
# without offload, for a peak of 298 MiB against its 646 (no trims: 1.02x,
# 713 MiB; a 256 MiB bound: 1.18x, 439 MiB; one run). Capping a step's trims at
# two more than the bound fits in the bytes moved gave 1.10x with 2 trims, but
# a peak of 622 MiB: the trims come early in forward, the peak is in
# backward's recompute, and offload then cut nothing a user could see, so the
# floor stays uncapped and ``docs/tuning.md`` gives the trade. Explicit bytes
# fix the bound; None never trims, and a run that saves no CPU activations
# (CUDA training) never trims. The faults left are what the trims cost in
# time: each refault zeroes a page, which huge pages make a quarter cheaper and
# no cheaper than that (zeroing dominates). Other placements
# measured on the 6-block shape, no better: one trim per step when forward or
# backward begins (the step's wander re-touches the heap before its peak:
# ~316 or ~250 MiB above the start, against ~167 with the 64 MiB bound); a
# fixed ceiling on the RSS instead of a bound on the slack (another point on
# the same curve); glibc's mmap threshold set by the engine (every freed block
# leaves at once: ~250k faults per step, 1.84x, and the whole process's
# allocator changed for good); giving back a written activation's own pages
# (30-60% of the bytes: forward still holds many tensors when their writes
# land). Moving the small long-lived allocations out of the holes did not
# change the heap's extent: copying saved tensors under ``min_offload_bytes``
# into an engine mapping left 629 MiB of peak, and a reserve of free small
# chunks was not used (glibc serves a small request from the remainder of the
# last split before its bins).
#
# Trimming is an optimisation: whatever stops it (no readable /proc/self/statm,
# no thread, a failed trim) turns it off with one warning, and training goes
# on; in the child of a fork (a DataLoader worker) it stops without a word.
# Records of CUDA tensors do not count: their host memory is pinned or mapped,
# not glibc's heap. Where glibc is absent (musl, macOS, Windows) this does
# nothing, nor where another allocator is preloaded (tcmalloc, jemalloc: glibc's
# trims would not reach its memory); where only mallinfo2 is missing (glibc <
# 2.33), the slack is the anonymous RSS minus the engine's mapped buffers.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from .stats import StatsCounter

__all__ = [
    "AUTO_TRIM_MIN_BYTES",
    "AUTO_TRIM_STEP_SHARE",
    "FAST_REUSE_OFF",
    "HeapTrimmer",
    "anon_resident_bytes",
    "fast_reuse_hint",
    "fast_reuse_tunables",
    "heap_levels",
    "heap_slack_bytes",
    "heap_trim_supported",
    "malloc_in_use_bytes",
    "resident_bytes",
]

logger = logging.getLogger("prefetch_offload")

# heap_trim_bytes="auto" (NOTE [heap trim]): the bound is the larger of these bytes and
# this share of the bytes the last step moved out of memory.
AUTO_TRIM_MIN_BYTES = 64 << 20
AUTO_TRIM_STEP_SHARE = 0.25
# The hooks read the slack at most this often (NOTE [heap trim]), and at most once per
# the time the slack takes to grow by a sixteenth of the bound at _SLACK_RATE bytes/s.
_CHECK_INTERVAL_S = 0.0005
_SLACK_RATE = 1 << 30
# NOTE [trims a plan does without] in recompute_trims.py: held, a pass of the ceiling
# trims once and the trims stay held; a second pass within this many steps of
# that trim lets them run again for good.
CEILING_STEPS = 4


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _function(libc: Any, name: str, argtypes: list[Any], restype: Any) -> Any:
    fn = getattr(libc, name, None) if libc is not None else None
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


def _interposed(libc: Any) -> bool:
    """Whether ``malloc`` resolves to another allocator than ``libc``'s (one preloaded:
    tcmalloc, jemalloc), whose memory glibc's trims and counts do not see."""
    try:
        ours = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
        return ours != ctypes.cast(libc.malloc, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return False


_LIBC = _libc()
_MALLOC_TRIM = (  # glibc only, and only where glibc's malloc is the process's
    None
    if _LIBC is None or _interposed(_LIBC)
    else _function(_LIBC, "malloc_trim", [ctypes.c_size_t], ctypes.c_int)
)
_MALLINFO2 = _function(_LIBC, "mallinfo2", [], _Mallinfo2)  # glibc >= 2.33
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# NOTE [heap trim]: the tunables that turn off glibc's per-thread cache and fastbins.
FAST_REUSE_OFF = "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"


_ENV_NAME = re.compile(rb"[A-Z_][A-Z0-9_]*=")


def _start_tunables() -> str:
    """``GLIBC_TUNABLES`` as this process started with it (what glibc read): from
    ``/proc/self/environ``, where glibc left a NUL after each tunable it took, so the
    pieces up to the next variable are joined again; from ``os.environ`` where that
    text is unreadable or no longer an environment (a process title written over it)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        items = []
    prefix = b"GLIBC_TUNABLES="
    for i, item in enumerate(items):
        if item.startswith(prefix):
            parts = [item[len(prefix) :]]
            for rest in items[i + 1 :]:
                if not rest or _ENV_NAME.match(rest):
                    break
                parts.append(rest)
            return b":".join(parts).decode(errors="replace")
    if any(_ENV_NAME.match(item) for item in items):
        return ""  # started without it (a later os.environ change reaches no glibc)
    return os.environ.get("GLIBC_TUNABLES", "")  # unreadable, or rewritten (setproctitle)


def _tunable_is_zero(tunables: dict[str, str], name: str) -> bool:
    try:
        return int(tunables.get(name, ""), 0) == 0
    except ValueError:
        return False


def fast_reuse_hint(environment: Mapping[str, str] | None = None) -> str | None:
    """The setting to suggest when trims ran: ``GLIBC_TUNABLES`` turning off glibc's
    per-thread cache and fastbins (NOTE [heap trim]), or None where glibc's malloc is
    not the process's, or ``environment`` (default: this process's at its start)
    already sets both."""
    if _MALLOC_TRIM is None:
        return None
    text = _start_tunables() if environment is None else environment.get("GLIBC_TUNABLES", "")
    tunables = _tunables(text)
    if _tunable_is_zero(tunables, "glibc.malloc.tcache_count") and _tunable_is_zero(
        tunables, "glibc.malloc.mxfast"
    ):
        return None
    return f"GLIBC_TUNABLES={FAST_REUSE_OFF}"


def fast_reuse_tunables(current: str = "") -> str:
    """A ``GLIBC_TUNABLES`` value that turns off glibc's per-thread cache and fastbins
    (NOTE [heap trim]) and keeps every other tunable of ``current`` as it was."""
    wanted = _tunables(FAST_REUSE_OFF)
    kept = [i for i in current.split(":") if i and i.split("=", 1)[0] not in wanted]
    return ":".join([*kept, FAST_REUSE_OFF])


def _tunables(text: str) -> dict[str, str]:
    """``GLIBC_TUNABLES`` text as name -> value (items without a value left out)."""
    return dict(item.split("=", 1) for item in text.split(":") if "=" in item)


def heap_trim_supported() -> bool:
    """Whether this process's allocator can give free heap pages back (glibc's malloc,
    not a preloaded one)."""
    return _MALLOC_TRIM is not None


class _Statm:
    """``/proc/self/statm``, kept open (one ``pread`` per read); a fork's child reopens
    it (the open file names the parent: "self" was resolved when it was opened)."""

    def __init__(self) -> None:
        self._fd = -1
        self._lock = threading.Lock()

    def pages(self) -> tuple[int, int]:
        """(resident, shared) pages: shared ones are file-backed or shmem."""
        with self._lock:
            if self._fd < 0:
                self._fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
            fields = os.pread(self._fd, 256, 0).split()
        return int(fields[1]), int(fields[2])

    def anon_resident_bytes(self) -> int:
        """Anonymous resident memory: resident minus shared pages."""
        resident, shared = self.pages()
        return (resident - shared) * _PAGE

    def after_fork_in_child(self) -> None:
        """A child of fork: the lock may have been copied held; reopen on next read."""
        self._lock = threading.Lock()
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = -1


_STATM = _Statm()


def resident_bytes() -> int:
    """This process's resident memory in bytes (``/proc/self/statm``; Linux)."""
    return _STATM.pages()[0] * _PAGE


def anon_resident_bytes() -> int:
    """This process's anonymous resident memory in bytes: resident less file-backed and
    shared pages (``/proc/self/statm``; Linux)."""
    return _STATM.anon_resident_bytes()


def malloc_in_use_bytes() -> int | None:
    """Bytes malloc has handed out and not had back (all arenas, mmapped blocks
    included): live memory, without what glibc keeps for reuse. None where glibc's
    ``mallinfo2`` is unavailable."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def heap_levels() -> tuple[int, int]:
    """(slack, in use): anonymous resident bytes that malloc has not handed out, and
    the bytes it has (0 where ``mallinfo2`` is unavailable), from one read of each
    (NOTE [heap trim]).

    The slack includes memory mapped outside malloc (by the engine, Python's
    small-object arenas, ...); only its changes mean something.
    """
    in_use = malloc_in_use_bytes() or 0
    return _STATM.anon_resident_bytes() - in_use, in_use


def heap_slack_bytes() -> int:
    """Anonymous resident bytes that malloc has not handed out (:func:`heap_levels`)."""
    return heap_levels()[0]


class _TrimThread:
    """One daemon thread that runs the trims it is given, one at a time, in order."""

    def __init__(self) -> None:
        # Entered as the lock (NOTE [interrupts] in io_pool.py).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._jobs: list[Callable[[], None]] = []
        self._closing = False
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; starts the thread if it is not running (first job, or it
        died). Raises RuntimeError if no thread can be started."""
        with self._lock:
            if self._closing:
                return
            if self._thread is None or not self._thread.is_alive():
                thread = threading.Thread(
                    target=self._run, name="prefetch_offload-heap-trim", daemon=True
                )
                thread.start()
                self._thread = thread
            self._jobs.append(job)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.pop(0)
            job()
            del job  # a waiting thread must not keep the trimmer alive

    def close(self, *, wait: bool = True) -> None:
        with self._lock:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()


# Every live trimmer, for the child of a fork (_after_fork_in_child).
_TRIMMERS: weakref.WeakSet[HeapTrimmer] = weakref.WeakSet()


class HeapTrimmer:
    """Trims glibc's heap when its slack has grown by ``threshold`` plus the larger of an
    allowance and what this step or the last had in use at its most beyond what is in
    use now (NOTE [heap trim]).

    Trimming is an optimisation: whatever keeps it from working (no readable
    ``/proc/self/statm``, no thread to run it, a failed trim) turns it off with one
    warning on the ``prefetch_offload`` logger, and training goes on. In the child of
    a fork it stops without a warning (DataLoader workers fork, each epoch).

    Args:
        threshold: bytes of slack growth that trigger a trim; None turns trimming off.
        stats: counts ``heap_trims`` and ``heap_trim_seconds``.
        own_bytes: bytes of the engine's own anonymous mapped buffers now (not slack).
        levels: measures the slack and malloc's bytes in use (tests give their own).
        submit: runs a trim job in the background (default: a thread of the
            trimmer's own, so that trims neither wait behind reads nor delay them).
        interval: the least time between two measures by :meth:`check`, in
            seconds, at least ten times what the last measure took and at least
            the time the slack needs to grow by a sixteenth of the bound at 1 GiB/s;
            0 measures at every call.
        allowance: bytes of slack growth tolerated beyond ``threshold`` now (the
            engine's unfilled ``device_budget``), unless the room below this step's or
            the last step's most in use is larger; read at each measure, no lock held.
        step_share: if set, the bound is the larger of ``threshold`` and this share
            of the bytes the last step moved out of memory (:meth:`step_moved`);
            None keeps ``threshold`` fixed.
        resident: the process's anonymous resident memory now, which a held
            trimmer's ceiling bounds (:meth:`hold`).
    """

    def __init__(
        self,
        threshold: int | None,
        stats: StatsCounter,
        *,
        own_bytes: Callable[[], int] = lambda: 0,
        levels: Callable[[], tuple[int, int]] = heap_levels,
        submit: Callable[[Callable[[], None]], None] | None = None,
        interval: float = _CHECK_INTERVAL_S,
        allowance: Callable[[], int] = lambda: 0,
        step_share: float | None = None,
        resident: Callable[[], int] = anon_resident_bytes,
    ) -> None:
        self.threshold = threshold if _MALLOC_TRIM is not None else None
        self._step_share = step_share
        self._bound = threshold or 0  # the slack growth that triggers a trim now
        self._stats = stats
        self._own_bytes = own_bytes
        self._levels = levels
        self._thread = _TrimThread() if submit is None else None
        self._submit = submit if submit is not None else self._thread.submit  # type: ignore[union-attr]
        self._interval = interval
        self._allowance = allowance
        self._resident = resident
        if self._thread is not None:  # a trimmer dropped without close() stops its thread
            weakref.finalize(self, self._thread.close, wait=False)
        self._lock = threading.Lock()
        self._saved = False  # CPU activations were saved (ever: backward frees them later)
        self._queued = False  # a trim is queued or running: the next one would add nothing
        self._held = False  # NOTE [trims a plan does without] in recompute_trims.py
        # While held: the resident memory above which one trim runs (and, passed again
        # within CEILING_STEPS steps of it, the trims run again, for good).
        self._ceiling: int | None = None
        self._steps = 0  # steps ended (step_moved)
        self._ceiling_trim: int | None = None  # the step of the last trim at the ceiling
        self._floor: int | None = None  # the slack after the last trim, or its lowest since
        # The most malloc had handed out at a measure this step and the last (NOTE [heap
        # trim]: the ceiling); under _lock.
        self._peak = self._last_peak = 0
        self._generation = 0  # trims done: a measure from before the last one is stale
        self._next_check = 0.0
        _TRIMMERS.add(self)

    @property
    def enabled(self) -> bool:
        """Whether trims happen at all."""
        return self.threshold is not None

    def level(self) -> int:
        """The slack now, without the engine's own buffers."""
        return self.measure()[0]

    def measure(self) -> tuple[int, int]:
        """(the slack now without the engine's own buffers, malloc's bytes in use)."""
        slack, in_use = self._levels()
        return slack - self._own_bytes(), in_use

    @property
    def held(self) -> bool:
        """Whether trims are held off (:meth:`hold`)."""
        return self._held

    def hold(self, on: bool, ceiling: int | None = None) -> None:
        """Hold trims off (``on``), or let them run again, with the bound and the
        allowance they had (NOTE [trims a plan does without] in recompute_trims.py). While
        held, :meth:`trim_now` queues nothing and :meth:`check` reads only the
        process's anonymous resident memory: where it is above ``ceiling`` bytes
        (None: never), one trim runs and the trims stay held; where it is above it
        again within CEILING_STEPS steps of that trim, the trims run again, with one
        trim at once (:attr:`held` turns False)."""
        with self._lock:
            self._held, self._ceiling = on, ceiling if on else None
            self._ceiling_trim = None
            self._generation += 1  # (a measure from before the hold is stale)

    @property
    def bound(self) -> int:
        """The slack growth that triggers a trim now, before the allowance."""
        return self._bound

    def step_moved(self, nbytes: int) -> None:
        """A step ended, having moved ``nbytes`` of CPU activations out of memory:
        with a ``step_share``, the bound follows it; the ceiling's peak starts again
        (it keeps the ended step's too, for one step) (NOTE [heap trim])."""
        if self.threshold is not None and self._step_share is not None:
            self._bound = max(self.threshold, int(self._step_share * nbytes))
        with self._lock:
            self._last_peak, self._peak = self._peak, 0
            self._steps += 1

    def saved(self) -> None:
        """CPU activations were saved: the slack may now be the engine's doing."""
        self._saved = True  # a plain store: no lock on this hot path (every CPU pack)

    def check(self) -> None:
        """Called by the hooks: queue a trim if the slack has grown by the bound plus
        the larger of the allowance and the room below the peak (NOTE [heap trim])."""
        if self.threshold is None or not self._saved or self._queued:
            return  # (while a trim runs, measuring would wait on glibc's arena locks)
        if self._held and self._ceiling is None:
            return  # (held with nothing to watch: no clock read on the hooks' path)
        start = time.perf_counter()
        if start < self._next_check:
            return
        if self._held:
            self._check_ceiling(start)
            return
        generation = self._generation
        try:
            level, in_use = self.measure()
        except (OSError, ValueError, IndexError) as exc:  # no readable /proc/self/statm
            self._turn_off(f"cannot measure the heap's free resident memory ({exc})")
            return
        # mallinfo2 walks every free chunk: on a fragmented heap a measure can take a
        # millisecond, so measure at most a tenth of the time.
        if self._interval > 0:
            end = time.perf_counter()
            self._next_check = end + max(
                self._interval, 10 * (end - start), self._bound / 16 / _SLACK_RATE
            )
        with self._lock:
            self._peak = peak = max(self._peak, in_use)
            # NOTE [heap trim]: the ceiling. Slack that this step or the last filled
            # with live memory at their most is not over the bound; nor is the allowance.
            room = max(peak, self._last_peak) - in_use
            if self._queued or generation != self._generation:
                return  # measured across a trim: stale
            floor = self._floor
            if floor is None or level < floor:
                self._floor = level
                return
            if level - floor < self._bound + max(self._allowance(), room):
                return
            self._queued = True
        self._queue()

    def _check_ceiling(self, start: float) -> None:
        """Held: where the resident memory is above the ceiling, queue one trim; where
        the last trim at the ceiling was fewer than CEILING_STEPS steps ago, let the
        trims run again too (NOTE [trims a plan does without] in recompute_trims.py)."""
        ceiling, generation = self._ceiling, self._generation
        if ceiling is None:
            return
        self._next_check = start + self._interval
        try:
            over = self._resident() > ceiling
        except (OSError, ValueError, IndexError) as exc:
            self._turn_off(f"cannot measure the process's resident memory ({exc})")
            return
        if over:
            with self._lock:
                if self._queued or not self._held:
                    return  # (a trim is on its way; or let go meanwhile)
                if generation != self._generation:
                    return  # (read across a trim, or before a new hold: stale)
                last = self._ceiling_trim
                if last is not None and self._steps - last < CEILING_STEPS:
                    self._held, self._ceiling = False, None  # drifting faster than that
                self._ceiling_trim = self._steps
                self._queued = True
            self._queue()

    def trim_now(self) -> None:
        """Queue one trim whatever the slack, unless one is queued or running: the steps
        after it run another plan, on a heap the steps before shaped (NOTE [a trim where
        the plan changes] in recompute.py). Returns at once; the trimmer's thread trims."""
        if self.threshold is None or not self._saved or self._held:
            return
        with self._lock:
            if self._queued:
                return
            self._queued = True
        self._queue()

    def _queue(self) -> None:
        """Hand the trim, marked queued under the lock, to the trimmer's thread."""
        try:
            self._submit(self._trim)
        except RuntimeError as exc:  # no thread can be started (limits, shutdown)
            with self._lock:
                self._queued = False
            self._turn_off(f"cannot start the trim thread ({exc})")

    def close(self) -> None:
        """Turn trimming off and stop the trim thread after the trim it may be running."""
        self.threshold = None
        if self._thread is not None:
            self._thread.close()

    def _turn_off(self, why: str) -> None:
        if self.threshold is None:
            return
        self.threshold = None
        logger.warning(
            "prefetch_offload: %s; glibc's free heap pages will not be given back "
            "(heap_trim_bytes ignored).",
            why,
        )

    def _trim(self) -> None:
        try:
            start = time.perf_counter()
            _MALLOC_TRIM(0)
            self._stats.add(heap_trims=1, heap_trim_seconds=time.perf_counter() - start)
            level = self.level()
            with self._lock:
                self._floor = level
                self._generation += 1
        except Exception as exc:  # NOTE [errors from workers]: said, and trimming stops
            self._turn_off(f"giving heap memory back failed ({exc!r})")
        finally:
            with self._lock:
                self._queued = False

    def _after_fork_in_child(self) -> None:
        """The child of a fork has none of the parent's threads, and its locks may have
        been copied held: trimming stops there (the engine's IO threads are gone too)."""
        self.threshold = None
        self._lock = threading.Lock()
        self._queued = False
        if self._thread is not None:
            self._thread = _TrimThread()
            self._submit = self._thread.submit


def _after_fork_in_child() -> None:
    _STATM.after_fork_in_child()
    for trimmer in list(_TRIMMERS):
        trimmer._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
