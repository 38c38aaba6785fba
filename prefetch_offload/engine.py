"""The offload engine: the saved-tensor hooks and the state behind them.

One :class:`OffloadEngine` serves one ``offload_context``. Its ``pack`` hook
turns an eligible saved tensor into a small :class:`_Handle` at once and queues
the tensor's bytes for writing; its ``unpack`` hook turns the handle back into a
tensor equal in value, shape, strides, dtype and device.

# NOTE [record lifetime]
# Autograd owns the handles. A handle is one saved view (ViewMeta); it points at
# the _Record holding its storage span, shared by every view of that span (NOTE
# [dedup]). A record lives while any handle, or a write job still reading its
# source, references it. The engine and the scheduler
# hold records only weakly. When a record dies, its extent is queued for release
# with a deque append (safe from any thread, including inside the garbage
# collector) and returned to the allocator at the next pack or unpack,
# ``stats()`` call, or context exit (after exit, unpack and stats also unmap
# slabs that hold nothing any more). So slab space is freed when autograd releases the
# saved tensor, not at unpack, and ``backward(retain_graph=True)`` can read it
# again. Records hold the engine strongly: a graph built inside the context
# stays usable after it exits, and the slab files close when the last record
# and the last user reference to the engine are gone. A record still in the open
# write batch (NOTE [write batches]) is held by the batch until it is submitted
# or skipped, even if its graph was dropped: at most one batch of bytes.
#
# NOTE [memory handed to autograd]
# Unpack returns a view either of the original storage (its write had not
# finished, or it was never written) or of a fresh allocation that a read
# filled. The engine never writes into memory it has handed out, and keeps only
# a weak reference to the storage (so that the next view of the same record
# shares it instead of reading again, exactly as the original views shared
# theirs), plus the last few spans (NOTE [recently restored]). Read buffers come
# from a pool, but a block returns to it only when its storage has died, that
# is, when no tensor uses it (NOTE [read buffer pool]).
#
# NOTE [views built by the reader]
# Building a tensor from a storage (``torch.empty(0).set_(...)``) releases the
# GIL, and on a machine whose cores compute is keeping busy, getting it back in
# the hook thread can wait behind an IO thread that was preempted while holding
# it: measured at a third of a millisecond per unpack here, most of the unpack
# hook's time. So the IO thread that reads a record also builds the record's
# first saved view over the buffer it filled, and unpack hands that tensor out
# when the first view is the one asked for (once: later views, and later passes,
# build their own).
#
# NOTE [dedup]
# The same storage is often saved several times: one tensor by several ops (a
# layer's input feeds q, k and v), or several views of it (softmax saves the
# 4-D attention probabilities, the next matmul a 3-D view of them). A pack whose
# span lies inside a live record's span of the same storage, at the same
# version, shares that record: its bytes are written once and read once. The
# storage is identified by a weak reference to the storage object, never by
# address alone: a freed tensor's address is reused by the next allocation, and
# a dead weak reference can never match a new storage. The version counter
# (shared by all views of a tensor) catches in-place updates between two saves.
# Not every byte of a span is a saved element: the gaps of a strided view (x[::2]
# spans x[1::2]) and the rest of a whole storage (NOTE [whole storage]) may still
# be written legally through a tensor with a counter of its own (``x.data``, a
# numpy or frombuffer alias of the same memory), unseen by the version check.
# So once a CPU record's write has begun reading the tensor's memory (``frozen``),
# a pack shares the record only if its span lies inside a dense view saved there
# (``covered``), whose bytes autograd forbids changing; before that, the write
# reads what every later save sees. (A device record's bytes are copied at its
# first pack; they are not checked this way.)
#
# NOTE [whole storage]
# Views that overlap without one containing the other defeat containment
# dedup: attention's q, k and v are strided views of one fused qkv output, each
# spanning nearly all of it from a different first element, and would be
# offloaded three times. A view that covers at least half of its storage takes
# the whole storage as its record's span instead: the others then lie inside it
# and share the record. The cost is at most twice the view's own bytes, and
# only for a view that already spans half its storage.
#
# NOTE [write batches]
# The kernel's CPU cost per byte of O_DIRECT falls with request size, and on a
# machine whose cores compute keeps busy that CPU is step time. So pack does not
# hand each record to the IO threads: records join an open batch, which is
# submitted as one job once it holds ``chunk_bytes`` (at most half of
# ``max_pending_write_bytes``, so that a full cap always has a submitted batch
# to wait for), when the cap is reached, at flush() and at exit. The job waits
# for each record's host copy (NOTE [copy streams]), then writes every run of
# extents that are adjacent in one slab with one vectored write straight from
# the records' own pages, and publishes each record's outcome (a failed run
# fails exactly its records). Bytes in the open batch count as pending, so the
# cap still bounds what forward holds.
#
# NOTE [write tail]
# When backward starts, the last tensors forward saved are the first it needs,
# and their writes are often still queued behind the others. Writing them and
# reading them straight back would cost twice their bytes for nothing: at the
# first unpack after a forward, the open batch (never submitted) and every
# submitted batch that no IO thread has started yet are dropped, their extents
# freed, and their tensors stay in memory (they already were: that memory is
# what max_pending_write_bytes bounds) until backward consumes them. Batches are
# taken newest first; the first one a worker has started ends the scan (writes
# run in submission order). These are cancelled demotions (NOTE [tiers] in
# policy.py): the records return to their memory tier, and those still alive
# when forward resumes are demoted again as the budgets require.
#
# NOTE [write staging]
# O_DIRECT pins and maps every 4 KiB page of the memory it writes from, and on a
# VM the host handles each page as a separate piece of the request. Activations
# live in ordinary 4 KiB pages; measured on the project's 2-core VM (bench/
# hostcost.py), writes from them ran at 0.9-1.1 GB/s with 54-69 ms of guest
# kernel CPU per GB, against 3.0-4.0 GB/s and 6-7 ms/GB from huge pages. A copy
# into a huge-page buffer first costs a memcpy per byte: CPU time, which pays
# where the writes are the bottleneck and is wasted where compute is (always
# staging measured 1.31x of no offload against 1.29x unstaged on the
# compute-bound benchmark step, within noise, with more user CPU). So with
# stage_writes="auto" a write job stages its runs only while forward is
# IO-bound, which the cap tells: from the first pack that waits at
# max_pending_write_bytes until the backward pass ends. Then forward waits
# anyway, and the copy runs on the CPU it leaves idle. Each IO worker stages
# through one 2 MiB buffer (one huge page; 8 MiB buffers measured no better),
# so staging holds at most io_workers * 2 MiB beyond the cap; the buffers are
# unmapped when backward ends, with the read pool's idle blocks. Staging applies
# to O_DIRECT only: buffered and mmap writes copy through the kernel or memcpy
# already. (With verify=True, runs holding an exposed CPU record are staged with
# any io_method, for their checksums: NOTE [checksums].)
#
# NOTE [checksums]
# With ``verify=True`` each write request records the CRC-32 of the span bytes
# it carries (only the span: the rest of its first and last page belongs to
# other tensors and may change), computed by the IO thread from the same memory
# it writes. The read job recomputes them over what it read and raises
# OffloadIOError at the unpack on any mismatch, instead of returning a wrong
# tensor. zlib.crc32 runs at about 4 GB/s here and releases the GIL.
# A CPU record's span may hold bytes outside its first saved view (the gaps of a
# strided view, the rest of a whole storage) that may legally change while the
# write reads them (NOTE [dedup]): memory read twice, once for the checksum and
# once for the write, could differ, and a good tensor would fail its read. Such
# a record (``exposed``) is written staged (NOTE [write staging]) and checksummed
# from the staging copy, which is exactly what reaches the disk.
#
# NOTE [version check]
# Autograd normally refuses to backward through a saved tensor that was
# modified in place after it was saved, but skips that check whenever
# saved-tensor hooks are installed. An offloading engine makes the mistake
# worse (the async write may capture either value), so every handle remembers
# the version of the tensor that owns the saved view's version counter (its
# base), weakly, and unpack raises the same error autograd would. If the owner
# is gone, nothing can have modified it since.
# A CPU record in memory hands out the saved tensor's own memory. Once written,
# the record lets go of the tensor (``saved``) and cannot see that memory's
# version any more, so that memory is never remembered as the record's restored
# span: an alias sharing the dead owner's counter (``y.detach()``) may modify it
# after the write, and a later unpack must read the written bytes instead.
#
# NOTE [no cycles]
# When an op saves its own output, the tensor handed to pack holds the op's
# grad_fn, which holds the saved-tensor payload. A payload that kept that tensor
# would close a loop through C++ that Python's collector cannot see, and a graph
# dropped without backward would never be freed. Payloads therefore keep
# ``t.detach()`` (same storage, same version counter, no grad_fn), never ``t``.
#
# NOTE [backward passes]
# A record that backward has already consumed must not be prefetched again in
# the same pass (a node unpacks its saved tensors in save order, so the window
# below the second one would include the first). Each unpack stamps the record
# with the current pass number; the window skips stamped records. A pass ends
# when a handle is unpacked a second time (``backward(retain_graph=True)``
# again): then every record is fair game once more.
#
# NOTE [targets]
# Target "disk" writes each record's host bytes to a slab and lets go of them.
# Target "cpu" stops after the device layer: the record keeps the host copy (for
# CUDA tensors, a pinned CPU copy; CPU tensors are not taken at all, they are
# host memory already). Both share the record, dedup and lifetime machinery.
#
# NOTE [errors from workers]
# A write that fails leaves the record's source tensor in memory, so nothing is
# lost. A full disk (ENOSPC/EDQUOT, or ``disk_bytes_limit``) is expected
# operation: one warning, a fallback count, training goes on. Any other write
# error is stored and raised as OffloadIOError at the next pack or unpack call,
# or at context exit. A failed read raises OffloadIOError at the unpack that
# needed it, naming the tensor and chaining the OSError.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import itertools
import logging
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .buffers import HostBufferPool
from .config import OffloadConfig
from .device import DeviceLayer, Placed, default_device_layer
from .errors import OffloadError, OffloadFallbackWarning, OffloadIOError
from .io_pool import READ, WRITE, InlineIOPool, IOFuture, IOPool, ThreadIOPool
from .packed import Span, ViewMeta, make_view, new_read_buffer, source_buffer, view_span
from .plan import PrefetchPlan, current_group_key
from .policy import DEVICE, DISK, HOST, TierPolicy
from .slab import Extent, SlabStore, prepare_save_dir
from .stats import OffloadStats, StatsCounter
from .streams import Fence

__all__ = ["OffloadEngine"]

logger = logging.getLogger("prefetch_offload")

_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


# NOTE [profiler ranges]
# pack, unpack, stall (unpack waiting for a read), write and read appear as named
# ranges in torch.profiler traces. The IO threads' ranges are recorded when the
# profile is started with ``experimental_config=torch._C._profiler.
# _ExperimentalConfig(profile_all_threads=True)`` (a plain profile only sees the
# thread that started it). _RecordFunctionFast costs about 0.25 us when no
# profiler runs; a torch without it gets no ranges.
_profiler_range: Callable[[str], contextlib.AbstractContextManager[object]] = getattr(
    torch._C._profiler, "_RecordFunctionFast", lambda name: contextlib.nullcontext()
)


def _span_part(span: Span, lo: int, hi: int) -> tuple[int, int]:
    """The part of ``[lo, hi)`` (extent offsets) that holds the span's own bytes."""
    a = min(max(lo, span.pad), hi)
    return a, max(a, min(hi, span.pad + span.nbytes))


def _wanted_sums(rec: _Record, pieces: int) -> list[_Sum | None]:
    """What a staged write must checksum for ``rec``'s pieces (None: no checksum)."""
    crcs = rec.crcs
    if crcs is None:
        return [None] * pieces
    wanted: list[_Sum | None] = []
    for i, (lo, hi, _) in enumerate(crcs):
        a, b = _span_part(rec.span, lo, hi)
        wanted.append((crcs, i, a - lo, b - lo))
    return wanted


def _split(nbytes: int, chunk: int) -> list[int]:
    """Boundaries of ``max(1, nbytes // chunk)`` page-aligned requests of near-equal size.

    Every request is at least ``chunk`` bytes (unless ``nbytes`` is smaller) and
    under ``2 * chunk``; sizes differ by at most one page. ``nbytes`` is whole pages.
    """
    pages, parts = nbytes // 4096, max(1, nbytes // chunk)
    size, extra = divmod(pages, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + (size + (i < extra)) * 4096)
    return bounds


# NOTE [recently restored]
# Autograd frees a node's saved tensors as soon as the node has run, so when
# two adjacent nodes saved the same span (nll_loss and log_softmax both save the
# log-probabilities) the second would find the restored copy already gone and
# read it again. The engine keeps the last few restored spans alive: a bounded
# cost (this many spans, during backward only: they are let go when the backward
# pass ends, through an autograd final callback, or at the next pack) that
# removes those repeated reads.
_RECENT_SPANS = 3
# One staging buffer per IO worker, one huge page each (NOTE [write staging]).
_STAGE_BYTES = 2 << 20
# Cap on idle read buffers kept for reuse during backward (NOTE [read buffer pool]).
_POOL_IDLE_BYTES = 256 << 20

# NOTE [window bytes]
# With prefetch_bytes=None a prefetch window may hold what the slabs deliver in
# _AUTO_WINDOW_SECONDS at the read bandwidth measured so far (bytes read over
# the IO threads' time reading them), within [_AUTO_WINDOW_MIN, _AUTO_WINDOW_MAX];
# _AUTO_WINDOW_START until enough has been read to measure. A window bounded so
# has its reads done in about that time, which is the backward compute of a
# block or two that it must hide behind; a larger one holds memory for reads
# that could not have been late anyway. Eager windows are usually bounded by
# prefetch_depth first (NOTE [lookahead] in plan.py).
_AUTO_WINDOW_SECONDS = 0.1
_AUTO_WINDOW_START = 64 << 20
_AUTO_WINDOW_MIN = 16 << 20
_AUTO_WINDOW_MAX = 512 << 20

# A record queued for writing: its pieces (views of its host bytes) and its copy's fence.
_Pending = tuple["_Record", list[memoryview], Fence | None]
# A checksum a staged write fills in: the record's crcs, the piece's index in them, and
# the bytes [a, b) of the piece that belong to the span (NOTE [checksums]).
_Sum = tuple[list[tuple[int, int, int]], int, int, int]

# A span in memory: bytes [base, base + nbytes) of an untyped storage, there once
# its fence (if any) is done (NOTE [copy streams]).
Resident = Placed
# A fetch's result: the span, and the record's first view over it when the fetching
# thread could build it (NOTE [views built by the reader]).
Fetched = tuple[Resident, "torch.Tensor | None"]


# The running backward's graph task id (-1 outside backward; -2 if torch lacks it).
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -2)


def _version_error(what: str, now: int, then: int) -> OffloadError:
    return OffloadError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: {what} is at version {now}; expected version {then} instead. "
        "PyTorch skips this check when saved-tensor hooks are installed; prefetch_offload "
        "keeps it (NOTE [version check]). Do not modify a tensor in place after an op saved it."
    )


class _Kept:
    """A saved tensor left in memory, with its version at save time."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        # NOTE [no cycles]: a detached alias (same storage and version counter).
        self.tensor = t.detach()
        self.version = -1 if torch.is_inference(t) else t._version

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if self.version >= 0 and t._version != self.version:
            what = f"a saved tensor (shape {list(t.shape)}, {t.dtype})"
            raise _version_error(what, t._version, self.version)
        return t


class _Handle:
    """What autograd stores for an offloaded tensor: a view of a record's span."""

    __slots__ = ("owner", "pass_no", "record", "version", "view")

    def __init__(
        self, record: _Record, view: ViewMeta, owner: weakref.ref[torch.Tensor], version: int
    ) -> None:
        self.record = record
        self.view = view
        self.pass_no = -1  # NOTE [backward passes]
        # NOTE [version check]: the tensor that owns the saved view's version counter.
        self.owner = owner
        self.version = version

    def check_version(self) -> None:
        owner = self.owner()
        if owner is not None and owner._version != self.version:
            raise _version_error(self.record.describe(), owner._version, self.version)
        self.record.check_version()

    def __repr__(self) -> str:
        return f"<prefetch_offload handle {self.record.describe()}>"


class _Record:
    """One offloaded storage span: where its bytes are, and what is in memory."""

    __slots__ = (
        "__weakref__",
        "align",
        "crcs",
        "device",
        "engine",
        "exposed",
        "extent",
        "frozen",
        "held",
        "host_only",
        "key",
        "on_disk",
        "pass_no",
        "pos",
        "prefetch",
        "restored",
        "saved",
        "seq",
        "skipped",
        "source",
        "span",
        "spos",
        "step",
        "tainted",
        "tier",
        "version",
        "view0",
        "write_error",
        "writes_left",
    )

    def __init__(
        self,
        engine: OffloadEngine,
        span: Span,
        extent: Extent | None,
        source: Resident | None,
        device: torch.device,
        seq: int,
        view0: ViewMeta,
        saved: torch.Tensor | None,
        version: int,
    ) -> None:
        self.engine = engine
        self.span = span
        # NOTE [version check]: the saved tensor while its bytes are read from its own
        # memory (shares its version counter), the version at save time, and whether
        # the bytes on disk may hold a later value.
        self.saved = saved
        self.version = version
        self.tainted = False
        # NOTE [dedup]: whether a write has begun reading the span from the tensor's memory.
        self.frozen = False
        self.key = 0  # the dedup table key (storage address), set by pack
        # NOTE [checksums]: (lo, hi, crc32 of the span bytes in [lo, hi)) per write request.
        self.crcs: list[tuple[int, int, int]] | None = None
        # Whether span bytes outside the first saved view may change while it is written.
        self.exposed = False
        self.view0 = view0  # the first saved view, for messages
        self.extent = extent
        # The span in host memory while its bytes are not safely on disk.
        self.source: Resident | None = source
        self.device = device
        # The span's address modulo 512 on its device, kept when it is copied back.
        self.align = 0
        # Whether the device's memory is host memory (CPU tensors): no copies either way.
        self.host_only = engine._device.identity(device)
        self.seq = seq
        self.pos = self.step = self.spos = -1  # NOTE [lookahead] in plan.py
        self.tier = DEVICE  # NOTE [tiers] in policy.py
        # A device span kept in the DEVICE tier (CUDA tensors; CPU ones are ``source``).
        self.held: Resident | None = None
        self.skipped = False  # NOTE [write tail]: a queued write was dropped
        self.pass_no = -1  # NOTE [backward passes]
        self.on_disk = False
        self.writes_left = 0
        self.write_error: BaseException | None = None
        self.prefetch: IOFuture[Fetched] | None = None
        # The span on its device, while any view handed to autograd keeps it alive.
        self.restored: tuple[weakref.ref[torch.UntypedStorage], int, Fence | None] | None = None

    def describe(self) -> str:
        v = self.view0
        return (
            f"saved tensor #{self.seq} (shape {list(v.shape)}, {v.dtype}, "
            f"{self.span.nbytes} bytes on {self.device})"
        )

    def check_version(self) -> None:
        """Raise autograd's in-place error if the saved bytes are not the saved values."""
        saved = self.saved
        now = saved._version if saved is not None else self.version
        if self.tainted or now != self.version:
            raise _version_error(self.describe(), max(now, self.version + 1), self.version)

    @property
    def nbytes(self) -> int:
        """The span's bytes."""
        return self.span.nbytes

    def resident(self) -> Resident | None:
        """The span on its device if a view handed out earlier still holds it."""
        restored = self.restored
        if restored is None:
            return None
        storage = restored[0]()
        return None if storage is None else (storage, restored[1], restored[2])

    # Scheduler protocol -------------------------------------------------------------

    def needs_read(self) -> bool:
        """Whether a prefetch would help: a read from disk, or a copy to the device."""
        if self.prefetch is not None or self.pass_no == self.engine._pass_no:
            return False
        if self.source is not None:
            if self.host_only:
                return False  # in memory, where autograd wants it
        elif not self.on_disk:
            return False
        return self.resident() is None

    def drop_prefetch(self) -> None:
        fut, self.prefetch = self.prefetch, None
        if fut is not None:
            fut.cancel()

    def __del__(self) -> None:
        # NOTE [record lifetime]: never take a lock here.
        try:
            self.engine._dead.append((self.extent, self.key, self.tier, self.span.nbytes))
        except Exception:  # interpreter shutdown
            pass


class _NullEngine:
    """What ``offload_context(None)`` yields: no hooks, all-zero stats.

    It has the engine's public methods, so that code written for an offloading run
    (``engine.flush()``, ``await engine.aflush()``) also runs with offloading off.
    """

    config = None
    io_method = "none"

    def __init__(self) -> None:
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether the owning context has exited."""
        return self._closed

    def stats(self) -> OffloadStats:
        """All-zero statistics."""
        return OffloadStats()

    def flush(self) -> None:
        """Nothing is ever queued: returns at once."""

    async def aflush(self) -> None:
        """Nothing is ever queued: returns at once."""

    def close(self, *, raise_errors: bool = True) -> None:
        """Mark the context exited."""
        self._closed = True


class _DedupEntry:
    """A live record's span within one storage (NOTE [dedup])."""

    __slots__ = ("covered", "end", "owner", "record", "start", "storage", "version")

    def __init__(
        self,
        storage: torch.UntypedStorage,
        owner: weakref.ref[torch.Tensor],
        version: int,
        start: int,
        end: int,
        rec: _Record,
    ) -> None:
        self.storage = weakref.ref(storage)
        # The same storage can sit under tensors with separate version counters
        # (``a`` and ``a.data``): only views of one owner share a counter.
        self.owner = owner
        self.version = version
        self.start = start
        self.end = end
        self.record = weakref.ref(rec)
        # Byte ranges of dense views saved into the record (NOTE [dedup]).
        self.covered: list[tuple[int, int]] = []

    def is_covered(self, start: int, end: int) -> bool:
        """Whether bytes ``[start, end)`` lie inside one dense view saved in the record."""
        return any(lo <= start and end <= hi for lo, hi in self.covered)

    def cover(self, start: int, end: int) -> None:
        """Note a dense view of bytes ``[start, end)`` saved in the record."""
        if not self.is_covered(start, end):
            self.covered.append((start, end))


class OffloadEngine:
    """The state of one offload context; its ``pack``/``unpack`` are the hooks.

    Use it through :func:`prefetch_offload.offload_context`; the object yielded by
    the ``with`` statement is this engine, for ``stats()`` and ``flush()``.

    Example:
        >>> with offload_context("disk", save_dir="/tmp/acts") as engine:  # doctest: +SKIP
        ...     loss = model(batch)
        ...     engine.flush()        # every saved tensor is on disk now
        ...     loss.backward()
        >>> engine.stats().prefetch_hits  # doctest: +SKIP
    """

    def __init__(
        self,
        config: OffloadConfig,
        *,
        device: DeviceLayer | None = None,
        pool: IOPool | None = None,
    ) -> None:
        if config.target not in ("cpu", "disk"):
            raise ValueError(
                "prefetch_offload: OffloadEngine needs target 'cpu' or 'disk', "
                f"got {config.target!r}; use offload_context(None) to disable offloading."
            )
        self.config = config
        # NOTE [targets]: "cpu" keeps host copies in records; "disk" writes them to slabs.
        self._store: SlabStore | None = None
        if config.target == "disk":
            assert config.save_dir is not None  # checked by OffloadConfig
            prepare_save_dir(config.save_dir)
            self._store = SlabStore(
                config.save_dir,
                slab_bytes=config.slab_bytes,
                io_method=config.io_method,
                disk_bytes_limit=config.disk_bytes_limit,
            )
            self._finalizer = weakref.finalize(self, self._store.close)
        self._device = device or default_device_layer(
            config.target, max_inflight_bytes=config.max_inflight_copy_bytes
        )
        # Records whose device-to-host copy may still run, oldest first (NOTE [version check]).
        self._copying: collections.deque[tuple[Fence, weakref.ref[_Record]]] = collections.deque()
        self._lock = threading.Lock()
        self._writes_idle = threading.Condition(self._lock)
        self._pending_write_bytes = 0
        # Write jobs in submission order (NOTE [record lifetime]: flush waits on them).
        self._write_futs: collections.deque[IOFuture[None]] = collections.deque()
        # The open write batch: records queued but not yet submitted (NOTE [write batches]).
        self._open: list[_Pending] = []
        self._open_bytes = 0
        # Submitted batches, oldest first, that backward may still skip (NOTE [write tail]).
        self._tail: collections.deque[tuple[IOFuture[None], list[weakref.ref[_Record]]]] = (
            collections.deque()
        )
        self._stats = StatsCounter()
        self._plan = PrefetchPlan(
            config.prefetch_depth, window_bytes=config.prefetch_bytes or _AUTO_WINDOW_START
        )
        self._policy = TierPolicy(config.device_budget, config.host_budget)
        # Storage address -> spans of live records in it (NOTE [dedup]).
        self._dedup: dict[int, list[_DedupEntry]] = {}
        self._dead: collections.deque[tuple[Extent | None, int, int, int]] = collections.deque()
        self._error: BaseException | None = None
        self._warned_full = False
        self._warned_host = False  # NOTE [tiers]: host budget exhausted with no disk
        self._warned_cpu_budget = False
        self._seq = 0
        self._pass_no = 0
        self._closed = False
        self._recent: collections.deque[torch.UntypedStorage] = collections.deque(
            maxlen=_RECENT_SPANS
        )
        self._in_backward = False
        # NOTE [recently restored]: the graph task whose end a final callback awaits.
        self._end_task: int | None = None
        self._read_pool = HostBufferPool(_POOL_IDLE_BYTES)
        # NOTE [write staging]: one 2 MiB huge-page buffer per IO worker, and
        # whether forward has waited at the write cap since the last backward.
        self._stage_pool = HostBufferPool(config.io_workers * _STAGE_BYTES)
        self._staging = config.stage_writes == "always"
        # ``pool`` lets tests run the inline reference pool instead of threads.
        if pool is None:
            pool = ThreadIOPool(config.io_workers) if self._store is not None else InlineIOPool()
        self._pool: IOPool = pool
        # An engine dropped without close() (built directly) still stops its threads.
        weakref.finalize(self, pool.shutdown, wait=False)

    # -- public ---------------------------------------------------------------------------

    @property
    def io_method(self) -> str:
        """The byte mover in use: "direct", "buffered", "mmap", or "none" (target "cpu")."""
        return self._store.io_method if self._store is not None else "none"

    @property
    def closed(self) -> bool:
        """Whether the owning context has exited."""
        return self._closed

    def stats(self) -> OffloadStats:
        """A snapshot of the counters (see :class:`OffloadStats`)."""
        self._drain_dead()
        store = self._store
        if store is not None:
            self._stats.set(
                disk_bytes_reserved=store.reserved_bytes,
                disk_bytes_in_use=store.used_bytes,
                peak_disk_bytes_reserved=store.peak_reserved_bytes,
                peak_disk_bytes_in_use=store.peak_used_bytes,
            )
        self._stats.set(copy_wait_seconds=self._device.copy_wait_seconds())
        with self._lock:
            policy = self._policy
            self._stats.set(
                device_tier_bytes=policy.bytes[DEVICE],
                host_tier_bytes=policy.bytes[HOST],
                disk_tier_bytes=policy.bytes[DISK],
                peak_device_tier_bytes=policy.peak[DEVICE],
                peak_host_tier_bytes=policy.peak[HOST],
                peak_disk_tier_bytes=policy.peak[DISK],
                bytes_demoted_to_host=policy.demoted[HOST],
                bytes_demoted_to_disk=policy.demoted[DISK],
                predicted_steps=self._plan.predicted_steps,
            )
        return self._stats.snapshot()

    def flush(self) -> None:
        """Block until every queued write has finished; raise a stored worker error."""
        self._wait_writes()
        self._raise_pending()

    async def aflush(self) -> None:
        """:meth:`flush` for event loops: waits in a worker thread, not in the loop."""
        await asyncio.get_running_loop().run_in_executor(None, self._wait_writes)
        self._raise_pending()

    # -- pack -----------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a handle for an offloaded tensor, or ``t`` kept as it is."""
        with _profiler_range("prefetch_offload::pack"):
            return self._pack(t)

    def _pack(self, t: torch.Tensor) -> Any:
        self._raise_pending()
        self._drain_dead()
        if self._copying:
            self._settle_copies()
        if self._closed:
            raise OffloadError(
                "prefetch_offload: pack hook called after its offload_context exited; "
                "create a new context for new forward passes."
            )
        if self._in_backward:  # forward again
            self._in_backward = False
            self._end_task = None  # in case that backward raised (no final callback)
            with self._lock:
                self._plan.begin_forward()  # NOTE [learned order]
            self._enforce_budgets()  # NOTE [tiers]: what the write tail kept
            self._recent.clear()  # NOTE [recently restored]
            # NOTE [read buffer pool]: unmapping takes a while; an IO thread does it.
            self._pool.submit(self._background(self._read_pool.trim), READ)
        if not self._eligible(t):
            self._stats.add(tensors_kept=1)
            if not self._warned_cpu_budget and self.config.target == "cpu":
                self._note_cpu_budget(t)
            return _Kept(t)
        storage = t.untyped_storage()
        vstart, vbytes = view_span(t)
        version = t._version
        itemsize = t.element_size()
        shape, stride = tuple(t.shape), t.stride()
        owner_t = t._base if t._base is not None else t
        dense = t.numel() * itemsize == vbytes  # no gaps: every spanned byte is an element
        with self._lock:
            key = storage.data_ptr()
            for entry in self._dedup.get(key, ()):
                rec = entry.record()
                if (
                    rec is not None
                    and entry.storage() is storage
                    and entry.owner() is owner_t
                    and entry.version == version
                    and entry.start <= vstart
                    and vstart + vbytes <= entry.end
                    and (vstart - entry.start) % itemsize == 0
                    and (not rec.frozen or entry.is_covered(vstart, vstart + vbytes))
                ):
                    if dense:  # NOTE [dedup]: its bytes are saved elements now
                        entry.cover(vstart, vstart + vbytes)
                    self._stats.add(dedup_hits=1)
                    view = ViewMeta(t.dtype, shape, stride, vstart - entry.start)
                    return _Handle(rec, view, entry.owner, version)
        start, nbytes = vstart, vbytes
        whole = storage.nbytes()
        if nbytes < whole <= 2 * nbytes:  # NOTE [whole storage]
            start, nbytes = 0, whole
        # Host memory is the storage itself, or a page-aligned host block (pad 0).
        identity = self._device.identity(storage.device)
        span = Span(nbytes, (key + start) % 4096 if identity else 0)
        view = ViewMeta(t.dtype, shape, stride, vstart - start)
        owner = weakref.ref(owner_t)
        here: Resident = (storage, start, None)
        # NOTE [version check]: the bytes are read from t's own memory until they are
        # copied or written; NOTE [no cycles]: a detached alias.
        saved = t.detach()
        with self._lock:
            rec = _Record(
                self,
                span,
                None,
                here if identity else None,
                t.device,
                self._seq,
                view,
                saved,
                version,
            )
            if not identity:  # NOTE [tiers]: resident on its device until demoted
                rec.held = here
                rec.restored = (weakref.ref(storage), start, None)
            self._seq += 1
            rec.align = (key + start) % 512
            # NOTE [checksums]: bytes no saved view holds, read from the tensor's memory.
            rec.exposed = rec.host_only and not (dense and (start, nbytes) == (vstart, vbytes))
            self._plan.register(rec, (t.dtype, shape, nbytes))
            entry = _DedupEntry(storage, owner, version, start, start + nbytes, rec)
            if dense:
                entry.cover(vstart, vstart + vbytes)
            rec.key = key
            self._dedup.setdefault(rec.key, []).append(entry)
            self._policy.admit(rec)
        self._enforce_budgets()
        return _Handle(rec, view, owner, version)

    # -- tiers ----------------------------------------------------------------------------

    def _enforce_budgets(self) -> None:
        """Demote the oldest records of each tier over its budget (NOTE [tiers])."""
        with self._lock:
            recs = self._policy.over(DEVICE)
        for rec in recs:
            self._demote_from_device(rec)
        with self._lock:
            recs = self._policy.over(HOST)
        for rec in recs:
            self._demote_to_disk(rec, HOST)

    def _unskip(self, rec: _Record) -> None:
        """A write the write tail dropped is queued again (NOTE [write tail])."""
        if rec.skipped:
            rec.skipped = False
            self._stats.add(writes_skipped=-1)

    def _demote_from_device(self, rec: _Record) -> None:
        """Move a DEVICE record to the next tier: disk for CPU tensors, else a host copy."""
        if rec.host_only:  # host memory already: nothing to copy (NOTE [targets])
            self._demote_to_disk(rec, DEVICE)
            return
        held = rec.held
        assert held is not None
        store = self._store
        nbytes = rec.span.nbytes
        host_budget = self._policy.budgets[HOST]
        keep_host = host_budget is None or host_budget > 0
        if store is None and host_budget is not None:
            with self._lock:
                full = self._policy.bytes[HOST] + nbytes > host_budget
                if full:
                    self._policy.keep(rec, DEVICE)
            if full:
                self._note_host_full()
                return
        # Straight to disk: slab space first, so that a full disk costs no copy.
        extent = None
        if not keep_host:
            assert store is not None
            extent = self._allocate(store, rec.span.extent_bytes)
            if extent is None:
                with self._lock:
                    self._policy.keep(rec, DEVICE)
                return
        host, base, fence = self._device.to_host(held[0], held[1], nbytes)
        pad = (host.data_ptr() + base) % 4096
        if pad != rec.span.pad:  # a host block that is not page-aligned
            rec.span = Span(nbytes, pad)
            if extent is not None:
                assert store is not None
                store.free(extent)
                extent = self._allocate(store, rec.span.extent_bytes)
        with self._lock:
            rec.source = (host, base, fence)
            rec.held = rec.restored = None
            if fence is not None:
                self._copying.append((fence, weakref.ref(rec)))
            if keep_host:
                self._policy.demote(rec, HOST)
            elif extent is None:  # the re-reservation failed: the host copy is kept
                self._policy.keep(rec, HOST)
            else:
                rec.extent = extent
                self._policy.demote(rec, DISK)
        if store is None:  # NOTE [targets]: the host copy is the offloaded tensor
            self._stats.add(tensors_offloaded=1, bytes_offloaded=nbytes)
        elif rec.extent is not None:
            self._unskip(rec)
            self._queue_write(rec, host, base, fence)

    def _demote_to_disk(self, rec: _Record, tier: int) -> None:
        """Write a memory-tier record's host bytes to a slab (a full disk keeps it)."""
        store = self._store
        source = rec.source
        if store is None or source is None:
            with self._lock:
                self._policy.keep(rec, tier)
            return
        extent = self._allocate(store, rec.span.extent_bytes)
        with self._lock:
            if extent is None:  # no space: it stays in memory (counted, warned)
                self._policy.keep(rec, tier)
                return
            rec.extent = extent
            self._policy.demote(rec, DISK)
        self._unskip(rec)
        self._queue_write(rec, *source)

    def _note_host_full(self) -> None:
        """Target "cpu" with host_budget exhausted: the tensor stays on its device."""
        self._stats.add(fallbacks=1)
        with self._lock:
            if self._warned_host:
                return
            self._warned_host = True
        warnings.warn(
            f"prefetch_offload: host_budget={self.config.host_budget} bytes of host copies "
            "are in use, so newer saved tensors stay on their device. Raise host_budget, "
            "or use target 'disk' with host_budget to spill the oldest copies to disk.",
            OffloadFallbackWarning,
            stacklevel=4,
        )

    def _note_cpu_budget(self, t: torch.Tensor) -> None:
        """Say once that target "cpu" has nothing to do for CPU tensors."""
        if t.device.type != "cpu":
            return
        self._warned_cpu_budget = True
        cfg = self.config
        if cfg.device_budget or cfg.host_budget is not None:
            logger.warning(
                "prefetch_offload: target 'cpu' leaves CPU tensors where they are (they are "
                "host memory already), so device_budget=%s and host_budget=%s have nothing to "
                "do here; use target 'disk' to move saved CPU tensors out of RAM.",
                cfg.device_budget,
                cfg.host_budget,
            )

    def _settle_copies(self, *, wait: bool = False) -> None:
        """Finish the version check of records whose device-to-host copy has ended.

        NOTE [version check]: until its copy has run, a record keeps the saved
        tensor (to compare versions, and so the device memory cannot be reused);
        after it, the host copy holds the saved value and the device memory can go.
        """
        copying = self._copying
        with self._lock:
            while copying:
                fence, ref = copying[0]
                if not fence.done():
                    if not wait:
                        return
                    with contextlib.suppress(Exception):
                        fence.wait()  # a failed copy is raised where its bytes are used
                copying.popleft()
                rec = ref()
                if rec is None or rec.saved is None:
                    continue
                if rec.saved._version != rec.version:
                    rec.tainted = True
                rec.saved = None

    def _eligible(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is offloaded. Everything else stays in memory, unchanged."""
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return False  # subclasses (incl. Parameter), sparse, mkldnn
        if not self._device.accepts(t) or t.is_quantized or t.is_nested:
            return False
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            return False  # side-stream copies and event queries are illegal in a capture
        if t.is_conj() or t.is_neg() or torch.is_inference(t):
            return False
        # Autograd hands over views of parameters (weight.t()), not the Parameter.
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            return False
        itemsize = t.element_size()
        if itemsize == 0 or t.data_ptr() % itemsize:
            return False
        n = t.numel()
        if n == 0:
            return False
        return n * itemsize >= self.config.min_offload_bytes

    def _queue_write(
        self, rec: _Record, host: torch.UntypedStorage, base: int, fence: Fence | None
    ) -> None:
        """Add ``rec`` to the open write batch (NOTE [write batches])."""
        nbytes = rec.span.extent_bytes
        cap = self.config.max_pending_write_bytes
        batch = None
        with self._lock:
            if self._pending_write_bytes and self._pending_write_bytes + nbytes > cap:
                batch = self._take_batch()  # the bytes being waited for may be in it
        if batch:
            self._submit_batch(batch)
        pieces = _split(nbytes, self.config.chunk_bytes)
        src = source_buffer(host, base, rec.span)
        with self._lock:
            if self._pending_write_bytes and self._pending_write_bytes + nbytes > cap:
                if self.config.stage_writes == "auto":
                    self._staging = True  # NOTE [write staging]: forward waits on writes
                start = time.perf_counter()
                while self._pending_write_bytes and self._pending_write_bytes + nbytes > cap:
                    self._writes_idle.wait()
                self._stats.add(pack_wait_seconds=time.perf_counter() - start)
            self._pending_write_bytes += nbytes
            self._stats.set_max("peak_pending_write_bytes", self._pending_write_bytes)
            rec.writes_left = 1
            if self.config.verify:  # NOTE [checksums]
                rec.crcs = [(lo, hi, 0) for lo, hi in itertools.pairwise(pieces)]
            views = [src[lo:hi] for lo, hi in itertools.pairwise(pieces)]
            self._open.append((rec, views, fence))
            self._open_bytes += nbytes
            target = min(self.config.chunk_bytes, max(cap // 2, 1))
            batch = self._take_batch() if self._open_bytes >= target else None
        if batch:
            self._submit_batch(batch)

    def _take_batch(self) -> list[_Pending]:
        """The open batch, emptied (call under the lock)."""
        batch, self._open, self._open_bytes = self._open, [], 0
        return batch

    def _submit_batch(self, batch: list[_Pending]) -> None:
        fut = self._pool.submit(functools.partial(self._write_batch, batch), WRITE)
        with self._lock:
            futs = self._write_futs
            while futs and futs[0].done():
                futs.popleft()
            futs.append(fut)
            tail = self._tail  # NOTE [write tail]
            while tail and tail[0][0].done():
                tail.popleft()
            tail.append((fut, [weakref.ref(rec) for rec, _, _ in batch]))

    def _write_batch(self, batch: list[_Pending]) -> None:
        """IO job: write a batch, adjacent extents with one vectored write each."""
        store = self._store
        assert store is not None
        runs: list[list[_Pending]] = []
        for item in batch:
            rec = item[0]
            assert rec.extent is not None
            if runs:
                last = runs[-1][-1][0].extent
                assert last is not None
                if last.slab == rec.extent.slab and last.offset + last.length == rec.extent.offset:
                    runs[-1].append(item)
                    continue
            runs.append([item])
        for run in runs:
            exc: BaseException | None = None
            culprit = run[0][0]  # the record to name if the run fails
            with self._lock:  # NOTE [dedup]: the bytes are read from here on
                for rec, _, _ in run:
                    rec.frozen = rec.host_only
            # NOTE [checksums]: an exposed record is checksummed from its staged copy.
            staged = (self._staging and store.io_method == "direct") or any(
                rec.exposed and rec.crcs is not None for rec, _, _ in run
            )
            try:
                views: list[memoryview] = []
                sums: list[_Sum | None] = []  # staged runs: checksums over the staged copy
                for rec, pieces, fence in run:
                    culprit = rec
                    if fence is not None:
                        fence.wait()  # the host copy must be complete (NOTE [copy streams])
                    crcs = rec.crcs
                    if staged:
                        sums.extend(_wanted_sums(rec, len(pieces)))
                    elif crcs is not None:  # NOTE [checksums]: the span's bytes in each piece
                        for i, (lo, hi, _) in enumerate(crcs):
                            a, b = _span_part(rec.span, lo, hi)
                            crcs[i] = (lo, hi, zlib.crc32(pieces[i][a - lo : b - lo]))
                    views.extend(pieces)
                first = run[0][0].extent
                assert first is not None
                culprit = run[0][0]
                with _profiler_range("prefetch_offload::write"):
                    if staged:
                        self._staged_write(first, views, sums)  # NOTE [write staging]
                    else:
                        store.write(first, 0, views if len(views) > 1 else views[0])
            except BaseException as e:  # every failure must reach the bookkeeping below
                exc = e
            finally:
                for _, pieces, _ in run:
                    for view in pieces:
                        view.release()
            for rec, _, _ in run:
                self._write_done(rec, exc, culprit)

    def _staged_write(
        self, first: Extent, views: list[memoryview], sums: list[_Sum | None]
    ) -> None:
        """Write ``views`` back to back from ``first``, copied through a staging buffer,
        and fill in the checksums ``sums`` asks for, one per view, over the staged bytes."""
        store = self._store
        assert store is not None
        size = _STAGE_BYTES
        buf, region = self._stage_pool.lease(size)
        staging, src = buf.numpy(), None
        offset = fill = 0
        try:
            for view, want in zip(views, sums, strict=True):
                src = np.frombuffer(view, dtype=np.uint8)
                done = crc = 0
                while done < len(src):
                    n = min(len(src) - done, size - fill)
                    np.copyto(staging[fill : fill + n], src[done : done + n])  # no GIL
                    if want is not None:  # NOTE [checksums]: over the bytes written
                        a, b = max(want[2], done), min(want[3], done + n)
                        if a < b:
                            crc = zlib.crc32(staging[fill + a - done : fill + b - done], crc)
                    fill, done = fill + n, done + n
                    if fill == size:
                        store.write(first, offset, region)
                        offset, fill = offset + fill, 0
                if want is not None:
                    crcs, i = want[0], want[1]
                    crcs[i] = (crcs[i][0], crcs[i][1], crc)
            if fill:
                store.write(first, offset, region[:fill])
        finally:
            # A failure's traceback keeps this frame: drop what exports the caller's views
            # (it releases them next) and what keeps the staging block leased.
            region.release()
            del buf, staging, src
        self._stats.add(bytes_staged=offset + fill)

    def _write_done(
        self, rec: _Record, exc: BaseException | None, culprit: _Record | None = None
    ) -> None:
        """Publish the outcome of ``rec``'s write."""
        with self._lock:
            if rec.writes_left == 0:
                return  # skipped meanwhile (NOTE [write tail])
            rec.writes_left = 0
            self._pending_write_bytes -= rec.span.extent_bytes
            self._writes_idle.notify_all()
            if exc is None:
                saved = rec.saved
                if saved is not None and saved._version != rec.version:
                    rec.tainted = True  # NOTE [version check]: modified before it was written
                rec.on_disk = True
                rec.saved = None
                rec.source = None  # NOTE [record lifetime]: the activation can go now
                self._stats.add(tensors_offloaded=1, bytes_offloaded=rec.span.nbytes)
                return
            rec.write_error = exc
            extent, rec.extent = rec.extent, None
            self._policy.keep(rec, DEVICE if rec.host_only else HOST)  # NOTE [tiers]
        if extent is not None:
            self._store.free(extent)  # type: ignore[union-attr]
        self._write_failed(culprit or rec, exc)

    def _skip_tail_writes(self) -> None:
        """Drop writes that backward would read right back (NOTE [write tail])."""
        freed: list[Extent] = []
        skipped: list[_Record] = []

        def skip(rec: _Record) -> None:
            rec.writes_left = 0
            rec.skipped = True
            self._pending_write_bytes -= rec.span.extent_bytes
            skipped.append(rec)
            if rec.extent is not None:
                freed.append(rec.extent)
                rec.extent = None

        with self._lock:
            for rec, pieces, _ in self._take_batch():  # never submitted
                for view in pieces:
                    view.release()
                skip(rec)
            tail = self._tail
            while tail:
                fut, refs = tail.pop()  # newest first
                # Strong references first: abandoning the job drops the batch, the
                # only thing that may still keep a dropped graph's records alive.
                recs = [ref() for ref in refs]
                if not fut.claim():
                    break  # a worker started it; writes run in order: older ones too
                fut.abandon()
                for rec in recs:
                    if rec is not None and rec.writes_left:
                        skip(rec)
                del recs
            tail.clear()  # older writes have started: none left to skip
            self._writes_idle.notify_all()
            # NOTE [tiers]: cancelled demotions return to their memory tier.
            self._policy.readmit([r for r in skipped if r.host_only], DEVICE)
            self._policy.readmit([r for r in skipped if not r.host_only], HOST)
        if freed:
            assert self._store is not None
            for extent in freed:
                self._store.free(extent)
        if skipped:
            self._stats.add(writes_skipped=len(skipped))

    def _allocate(self, store: SlabStore, nbytes: int) -> Extent | None:
        """Slab space for a record, or None (counted and warned) where none is left."""
        try:
            extent = store.allocate(nbytes)
        except OSError as exc:
            raise OffloadIOError(
                f"prefetch_offload: could not create a slab file in "
                f"{self.config.save_dir!r}: {exc}. Check the folder's permissions and space."
            ) from exc
        if extent is None:
            self._note_no_space("the slab reservation failed")
        return extent

    def _wait_writes(self) -> None:
        """Submit the open batch; wait until every write job has finished."""
        with self._lock:
            batch = self._take_batch()
        if batch:
            self._submit_batch(batch)
        futs = self._write_futs
        while True:
            with self._lock:
                while futs and futs[0].done():
                    futs.popleft()
                if not futs:
                    return
                fut = futs[0]
            fut.wait()

    def _write_failed(self, rec: _Record, exc: BaseException) -> None:
        """NOTE [errors from workers]: the record keeps its source in memory."""
        self._stats.add(fallbacks=1)
        if getattr(exc, "errno", None) in _SPACE_ERRNOS:
            self._note_no_space(f"a write failed ({exc.strerror})", counted=True)
            return
        err = OffloadIOError(
            f"prefetch_offload: writing {rec.describe()} to {self.config.save_dir!r} failed: "
            f"{exc}. The tensor was kept in memory; check the disk and the folder."
        )
        err.__cause__ = exc
        with self._lock:
            if self._error is None:
                self._error = err

    def _note_no_space(self, what: str, *, counted: bool = False) -> None:
        if not counted:
            self._stats.add(fallbacks=1)
        with self._lock:
            if self._warned_full:
                return
            self._warned_full = True
        limit = self.config.disk_bytes_limit
        cap = f" or disk_bytes_limit={limit} was reached" if limit is not None else ""
        warnings.warn(
            f"prefetch_offload: no space left for activations in {self.config.save_dir!r}"
            f"{cap} ({what}); tensors that do not fit stay in memory. Free disk space, "
            "raise disk_bytes_limit, or pick another save_dir.",
            OffloadFallbackWarning,
            stacklevel=3,
        )

    # -- unpack ---------------------------------------------------------------------------

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the tensor that ``pack`` was given, restored."""
        with _profiler_range("prefetch_offload::unpack"):
            return self._unpack(packed)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.unpack()
        if not self._in_backward:
            self._in_backward = True
            self._skip_tail_writes()
            self._begin_backward()
        if _graph_task_id() != self._end_task:
            self._queue_end_of_backward()
        if self._dead:
            self._drain_dead()
        if self._copying:
            self._settle_copies()
        self._raise_pending()
        packed.check_version()
        rec = packed.record
        if packed.pass_no == self._pass_no:  # NOTE [backward passes]: a new pass
            self._pass_no += 1
        packed.pass_no = rec.pass_no = self._pass_no
        self._prefetch_after(rec)
        storage, base, built = self._materialize(rec)
        if built is not None and packed.view is rec.view0:
            return built  # NOTE [views built by the reader]
        return make_view(storage, base, packed.view)

    def _begin_backward(self) -> None:
        """Predict this backward's order (NOTE [learned order]) and size its window."""
        if self.config.prefetch_bytes is None:  # NOTE [window bytes]
            snap = self._stats.snapshot()
            if snap.read_seconds > 0 and snap.bytes_read >= _AUTO_WINDOW_MIN:
                bandwidth = snap.bytes_read / snap.read_seconds
                self._plan.window_bytes = int(
                    min(max(bandwidth * _AUTO_WINDOW_SECONDS, _AUTO_WINDOW_MIN), _AUTO_WINDOW_MAX)
                )
        with self._lock:
            self._plan.begin_backward()

    def _queue_end_of_backward(self) -> None:
        """Let the recently restored spans go when this backward pass ends.

        Keyed by graph task: autograd runs no final callbacks for a backward that
        raised, so the next backward must queue its own.
        """
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        except RuntimeError:
            return  # unpacked outside a backward pass (e.g. grad_fn._saved_self)
        self._end_task = _graph_task_id()

    def _end_of_backward(self) -> None:
        self._end_task = None
        self._recent.clear()
        # NOTE [read buffer pool]: nothing idle is kept into the next forward.
        self._read_pool.trim()
        # NOTE [write staging]: the next forward stages only once it waits on writes.
        self._staging = self.config.stage_writes == "always"
        self._stage_pool.trim()

    def _materialize(self, rec: _Record) -> tuple[torch.UntypedStorage, int, torch.Tensor | None]:
        """The record's span on its device, ready for the current stream: shared, in
        memory, prefetched, or copied and read now; and the first view, if built."""
        placed = rec.resident()
        built = None
        if placed is not None:
            self._stats.add(prefetch_hits=1)
        else:
            with self._lock:
                fut, rec.prefetch = rec.prefetch, None
                if fut is not None:
                    self._plan.consumed(rec)
                source = rec.source
            if fut is None and source is not None:
                # In host memory: the tensor itself (CPU), or a host copy to bring back.
                self._stats.add(**{"prefetch_hits" if rec.host_only else "prefetch_misses": 1})
                placed = self._device.to_device(
                    *source[:2], rec.span.nbytes, rec.device, source[2], rec.align
                )
            else:
                placed, built = self._collect(rec, fut)
            if source is None or placed[0] is not source[0]:  # NOTE [version check]
                rec.restored = (weakref.ref(placed[0]), placed[1], placed[2])
            if not self._closed:
                self._recent.append(placed[0])  # NOTE [recently restored]
        storage, base, fence = placed
        if fence is not None:  # a copy to the device (CPU storages have none)
            self._device.use(storage, fence)  # NOTE [copy streams]
        return storage, base, built

    def _collect(self, rec: _Record, fut: IOFuture[Fetched] | None) -> Fetched:
        """The read's result, counting a hit if it was ready and stall time if not."""
        if fut is not None and fut.done():
            self._stats.add(prefetch_hits=1)
            return self._read_result(rec, fut)
        start = time.perf_counter()
        if fut is None:
            fut = IOFuture(self._read_job(rec))
        try:
            with _profiler_range("prefetch_offload::stall"):
                if fut.claim():  # NOTE [claiming jobs]: read here, not behind a queue
                    fut.run()
                fut.wait()
            return self._read_result(rec, fut)
        finally:
            self._stats.add(prefetch_misses=1, stall_seconds=time.perf_counter() - start)

    def _read_result(self, rec: _Record, fut: IOFuture[Fetched]) -> Fetched:
        try:
            return fut.result()
        except OSError as exc:
            raise OffloadIOError(
                f"prefetch_offload: reading {rec.describe()} back from {self.config.save_dir!r} "
                f"failed: {exc}. The gradient cannot be computed without it."
            ) from exc

    def _read_job(self, rec: _Record) -> Any:
        # The job must not reference the record: the record holds the job's future.
        extent, span, crcs, device, align = rec.extent, rec.span, rec.crcs, rec.device, rec.align
        meta = rec.view0
        store, chunk, stats = self._store, self.config.chunk_bytes, self._stats
        lease = self._device.lease_for(device) or self._read_pool.lease
        to_device = self._device.to_device
        assert extent is not None and store is not None

        def job() -> Fetched:
            buf, base, region = new_read_buffer(span, lease)
            with region, _profiler_range("prefetch_offload::read"):
                began = time.perf_counter()
                for off in range(0, span.extent_bytes, chunk):
                    store.read(extent, off, region[off : off + chunk])
                took = time.perf_counter() - began
                for lo, hi, crc in crcs or ():  # NOTE [checksums]
                    a, b = _span_part(span, lo, hi)
                    if zlib.crc32(region[a:b]) != crc:
                        raise OSError(
                            errno.EIO,
                            f"checksum mismatch in bytes {a - span.pad}..{b - span.pad} of the "
                            "span: the slab file changed after it was written",
                        )
            stats.add(bytes_read=span.nbytes, read_seconds=took)
            placed = to_device(buf.untyped_storage(), base, span.nbytes, device, None, align)
            if placed[2] is not None:  # still being copied: built after use() instead
                return placed, None
            return placed, make_view(placed[0], placed[1], meta)

        return job

    def _prefetch_after(self, rec: _Record) -> None:
        """Prefetch the lookahead window below ``rec`` (NOTE [lookahead]): reads from
        disk on the IO threads, copies from host memory to the device right here."""
        if self.config.prefetch_depth == 0:
            return
        copies: list[IOFuture[Fetched]] = []
        with self._lock:
            if self._closed:  # set under this lock before the pool shuts down
                return
            self._plan.unpacked(rec, current_group_key())  # NOTE [learned order]
            for cand in self._plan.window(rec):
                assert isinstance(cand, _Record)
                source = cand.source
                if source is None:
                    cand.prefetch = self._pool.submit(self._read_job(cand), READ)
                else:  # a host copy (needs_read is False for host-only records)
                    job = functools.partial(
                        self._copy_job,
                        *source[:2],
                        cand.span.nbytes,
                        cand.device,
                        source[2],
                        cand.align,
                    )
                    cand.prefetch = fut = IOFuture(job)
                    copies.append(fut)
                self._plan.issued(cand, rec)
        for fut in copies:  # only queues the copy (NOTE [copy streams])
            if fut.claim():
                fut.run()

    def _copy_job(
        self,
        storage: torch.UntypedStorage,
        base: int,
        nbytes: int,
        device: torch.device,
        after: Fence | None,
        align: int,
    ) -> Fetched:
        return self._device.to_device(storage, base, nbytes, device, after, align), None

    # -- lifetime -------------------------------------------------------------------------

    def _drain_dead(self) -> None:
        """Return dead records' extents to the allocator (NOTE [record lifetime])."""
        dead = self._dead
        if not dead:
            return
        store = self._store
        with self._lock:
            keys = set()
            while dead:
                extent, key, tier, nbytes = dead.popleft()
                self._plan.forget()
                self._policy.died(tier, nbytes)
                keys.add(key)
                if extent is not None and store is not None:
                    store.free(extent)
            for key in keys:
                live = [e for e in self._dedup.get(key, ()) if e.record() is not None]
                if live:
                    self._dedup[key] = live
                else:
                    self._dedup.pop(key, None)
        if self._closed and store is not None:
            store.trim()  # a graph used after exit: give its space back as it goes

    def _background(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Wrap a fire-and-forget job so that its failure reaches the next hook call."""

        def job() -> None:
            try:
                fn()
            except Exception as exc:
                err = OffloadError(f"prefetch_offload: background task {fn!r} failed: {exc}")
                err.__cause__ = exc
                with self._lock:
                    if self._error is None:
                        self._error = err

        return job

    def _raise_pending(self) -> None:
        if self._error is not None:
            with self._lock:
                err, self._error = self._error, None
            if err is not None:
                raise err

    def close(self, *, raise_errors: bool = True) -> None:
        """Finish pending writes, stop the IO threads, release unused slabs.

        Later unpacks (a graph used after the context) read synchronously.
        Raises a stored worker error if ``raise_errors``, else warns with it.
        """
        if self._closed:
            return
        self._wait_writes()
        with self._lock:
            self._closed = True
            self._plan.clear()
            self._recent.clear()
        self._settle_copies(wait=True)
        self._device.close()
        self._pool.shutdown()
        # After the IO threads stopped: a prefetch still reading at close returns its
        # block when it ends (NOTE [read buffer pool]: nothing idle is kept after exit).
        self._read_pool.trim()
        self._stage_pool.close()
        self._pool = InlineIOPool()
        self._drain_dead()
        if self._store is not None:
            self._store.trim()
        err, self._error = self._error, None
        if err is not None:
            if raise_errors:
                raise err
            warnings.warn(f"{err} (raised while another exception was propagating)", stacklevel=2)
