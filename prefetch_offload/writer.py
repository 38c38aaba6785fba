"""The write path: write batches, the pending-bytes cap, staging, checksums, the write tail.

# NOTE [write batches]
# The kernel's CPU cost per byte of O_DIRECT falls with request size, and on a
# machine whose cores compute keeps busy that CPU is step time. So pack does not
# hand each record to the IO threads: records join an open batch, which is
# submitted as one job once it holds ``chunk_bytes`` (at most half of
# ``max_pending_write_bytes``, so that a full cap always has a submitted batch
# to wait for), when the cap is reached, at flush() and at exit. A batch filled
# by an ``exposed`` CPU record (its span holds bytes outside the view saved: q
# of a fused q, k, v projection) goes at the next record's pack instead: the
# saves of one op that share the record (k and v) then all come before its
# write begins, whatever the IO threads' timing (NOTE [dedup] in records.py:
# once the write has begun, a save shares only bytes a dense saved view
# covers), so the records a step makes, and the signature its learned order is
# kept under (NOTE [learned order] in plan.py), are the same in every step of
# one structure. The job waits
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
# O_DIRECT pins and maps every 4 KiB page of the memory it writes from, and each
# page is a separate piece of the request. Activations live in ordinary 4 KiB
# pages; measured on the project's 2-core VM (bench/io.py --cost, docs/results/
# hostcost.json), writes from them ran at 0.8-1.5 GB/s with 68-79 ms of guest
# CPU per GB, against 4.9-7.1 GB/s and 10-14 ms/GB from huge pages. A copy
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
# unmapped when backward ends (the read pool keeps its idle blocks across
# steps: NOTE [read buffer pool] in buffers.py). Staging applies
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
# NOTE [moved storages]
# A CPU record's write reads its bytes from the saved tensor's own storage, at the
# address that storage had when the record was queued. A storage can move without
# a new version: ``untyped_storage().resize_()`` (or ``resize_`` of a tensor
# sharing it, ``x.data``) reallocates it and copies its bytes, and autograd
# without hooks reads the saved tensor through the storage, wherever it now is.
# Read at the old address, the write would copy freed memory. So a write job first
# compares each record's storage address with the one queued, and a record whose
# storage moved is not written: it stays in memory, as a record whose write the
# tail skipped (NOTE [write tail]), and comes back through its storage, as
# autograd's would. Queued again later (by a budget, as such records are), it is
# written from where its storage is then: the span's place in its page follows the
# storage (``_demote_to_disk`` in engine.py), as it does for a record kept in
# memory by ``device_budget`` whose storage moved before its first write. A
# storage that moves while its write reads it leaves the record in memory the same
# way (the bytes the write read are not the saved ones; its slab space is freed);
# where that write failed (EFAULT, its old pages let go), the other records it
# carried stay in memory too, and no error is reported. Such a move is a race the
# engine cannot see coming: a write that copies through mmap or a staging buffer
# faults on pages already let go, and the process dies (resizing a storage an op
# saved, while training, is outside what ``docs/guarantees.md`` promises).
"""

from __future__ import annotations

import collections
import errno
import functools
import itertools
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .buffers import HostBufferPool
from .config import OffloadConfig
from .errors import OffloadFallbackWarning, OffloadIOError
from .io_pool import RECHECK_S, WRITE, IOFuture, IOPool
from .packed import source_address, source_buffer, span_part
from .policy import DEVICE, HOST, TierPolicy
from .profiling import profiler_range
from .slab import Extent, SlabStore
from .stats import StatsCounter
from .streams import Fence

if TYPE_CHECKING:
    from .records import Record as _Record

__all__ = ["WritePath", "split_requests"]

_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# One staging buffer per IO worker, one huge page each (NOTE [write staging]).
_STAGE_BYTES = 2 << 20

# A record queued for writing: its pieces (views of its host bytes) and its copy's fence.
# A record queued for writing: its pieces, the fence its host copy waits on, and the
# address its pieces read from (NOTE [moved storages]).
_Pending = tuple["_Record", list[memoryview], Fence | None, int]


def _moved(item: _Pending) -> bool:
    """Whether the storage a queued record's pieces read from has moved since (NOTE
    [moved storages])."""
    rec, _, _, address = item
    source = rec.source
    return source is not None and source_address(source[0], source[1], rec.span) != address


class _Job:
    """A submitted write batch; ``started`` and ``void`` change under the writer's lock,
    ``done`` is set when the job returns."""

    __slots__ = ("batch", "done", "started", "void")

    def __init__(self, batch: list[_Pending]) -> None:
        self.batch = batch
        self.started = False
        self.void = False
        self.done = threading.Event()


# A checksum a staged write fills in: the record's crcs, the piece's index in them, and
# the bytes [a, b) of the piece that belong to the span (NOTE [checksums]).
_Sum = tuple[list[tuple[int, int, int]], int, int, int]


def _wanted_sums(rec: _Record, pieces: int) -> list[_Sum | None]:
    """What a staged write must checksum for ``rec``'s pieces (None: no checksum)."""
    crcs = rec.crcs
    if crcs is None:
        return [None] * pieces
    wanted: list[_Sum | None] = []
    for i, (lo, hi, _) in enumerate(crcs):
        a, b = span_part(rec.span, lo, hi)
        wanted.append((crcs, i, a - lo, b - lo))
    return wanted


def split_requests(nbytes: int, chunk: int) -> list[int]:
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


class WritePath:
    """Moves records' host bytes into their slab extents (target "disk" only).

    It shares the engine's lock (its condition variable wakes packs waiting at
    the cap), counters and IO pool; errors that are not a full disk go to
    ``report``, which the engine raises at the next hook call.
    """

    def __init__(
        self,
        config: OffloadConfig,
        store: SlabStore,
        pool: IOPool,
        stats: StatsCounter,
        lock: threading.Lock,
        policy: TierPolicy,
        report: Callable[[BaseException], None],
    ) -> None:
        self.config = config
        self._store = store
        self.pool = pool
        self._stats = stats
        self._lock = lock
        self._policy = policy
        self._report = report
        self._writes_idle = threading.Condition(lock)
        self.pending_bytes = 0
        # Write jobs in submission order (NOTE [record lifetime]: flush waits on them).
        self._futs: collections.deque[IOFuture[None]] = collections.deque()
        # The open write batch: records queued but not yet submitted (NOTE [write batches]).
        self._open: list[_Pending] = []
        self._unfollowed: list[_Job] = []  # started jobs whose submit was interrupted
        # Per thread, batches taken from the open one and not yet handed to the pool or
        # put back (NOTE [interrupts] in io_pool.py: pending, though in no job yet).
        self._transit: collections.Counter[threading.Thread] = collections.Counter()
        self._open_bytes = 0
        # Submitted batches, oldest first, that backward may still skip (NOTE [write tail]).
        self._tail: collections.deque[tuple[IOFuture[None], list[weakref.ref[_Record]]]] = (
            collections.deque()
        )
        self._warned_full = False
        # NOTE [write staging]: one 2 MiB huge-page buffer per IO worker, and
        # whether forward has waited at the write cap since the last backward.
        self.stage_pool = HostBufferPool(config.io_workers * _STAGE_BYTES)
        self.staging = config.stage_writes == "always"

    def end_backward(self) -> None:
        """NOTE [write staging]: the next forward stages only once it waits on writes."""
        self.staging = self.config.stage_writes == "always"
        self.stage_pool.trim()

    def close(self) -> None:
        """Release the staging buffers (after the IO threads stopped)."""
        self.stage_pool.close()

    def queue(
        self, rec: _Record, host: torch.UntypedStorage, base: int, fence: Fence | None
    ) -> None:
        """Add ``rec`` to the open write batch (NOTE [write batches])."""
        nbytes = rec.span.extent_bytes
        cap = self.config.max_pending_write_bytes
        target = min(self.config.chunk_bytes, max(cap // 2, 1))
        batch = None
        with self._lock:
            # NOTE [write batches]: a full batch kept for the views of its newest
            # record goes now, and the bytes waited for at the cap may be in it.
            if self._open_bytes >= target or (
                self.pending_bytes and self.pending_bytes + nbytes > cap
            ):
                batch = self._take_batch()
        if batch:
            self._submit_batch(batch)
        pieces = split_requests(nbytes, self.config.chunk_bytes)
        address = source_address(host, base, rec.span)  # NOTE [moved storages]
        src = source_buffer(address, rec.span)
        with self._lock:
            if self.pending_bytes and self.pending_bytes + nbytes > cap:
                if self.config.stage_writes == "auto":
                    self.staging = True  # NOTE [write staging]: forward waits on writes
                start = time.perf_counter()
                while self.pending_bytes and self.pending_bytes + nbytes > cap:
                    if self._open:  # another pack's, since the check above: no job
                        batch = self._take_batch()  # would write it while this waits
                        self._lock.release()
                        try:
                            self._submit_batch(batch)
                        finally:
                            self._lock.acquire()
                        continue
                    if not self._writing():  # NOTE [interrupts] in io_pool.py: what an
                        break  # interrupt left counted no job writes (flush forgets it)
                    self._writes_idle.wait(RECHECK_S)  # (a job is done after its notify)
                self._stats.add(pack_wait_seconds=time.perf_counter() - start)
            self.pending_bytes += nbytes
            self._stats.set_max("peak_pending_write_bytes", self.pending_bytes)
            rec.writes_left = 1
            if self.config.verify:  # NOTE [checksums]
                rec.crcs = [(lo, hi, 0) for lo, hi in itertools.pairwise(pieces)]
            views = [src[lo:hi] for lo, hi in itertools.pairwise(pieces)]
            self._open.append((rec, views, fence, address))
            self._open_bytes += nbytes
            # NOTE [write batches]: full, unless the record's other views may come next.
            batch = self._take_batch() if self._open_bytes >= target and not rec.exposed else None
        if batch:
            self._submit_batch(batch)

    def _writing(self) -> bool:
        """Whether a submitted write job has not finished (call under the lock)."""
        return any(not fut.done() for fut in self._futs) or any(
            not job.done.is_set() for job in self._unfollowed
        )

    def _take_batch(self, *, submit: bool = True) -> list[_Pending]:
        """The open batch, emptied (call under the lock); to ``submit`` with
        :meth:`_submit_batch` (counted in transit until then)."""
        batch, self._open, self._open_bytes = self._open, [], 0
        if batch and submit:
            self._transit[threading.current_thread()] += 1
        return batch

    def _submit_batch(self, batch: list[_Pending]) -> None:
        try:
            self._submit_taken(batch)
        finally:
            with self._lock:
                me = threading.current_thread()
                self._transit[me] -= 1
                if self._transit[me] <= 0:
                    del self._transit[me]

    def _submit_taken(self, batch: list[_Pending]) -> None:
        job = _Job(batch)
        try:
            fut = self.pool.submit(functools.partial(self._write_batch, job), WRITE)
        except BaseException:
            # An interrupt (Ctrl-C) or a refused job: the batch goes back in front of the
            # open one, whose records a later pack, flush or backward settles; dropped, its
            # bytes would stay pending with no job to write them, and a pack at the cap
            # would wait for them forever. An interrupt may come after the job was queued:
            # one not started yet is voided (it will write nothing), one started keeps it.
            with self._lock:
                if not job.started:
                    job.void = True
                    self._open[:0] = batch
                    self._open_bytes += sum(rec.span.extent_bytes for rec, *_ in batch)
                    self._writes_idle.notify_all()  # a pack waiting at the cap submits it
                else:  # running with no future kept: wait() waits for it by its event
                    self._unfollowed.append(job)
            raise
        with self._lock:
            futs = self._futs
            while futs and futs[0].done():
                futs.popleft()
            futs.append(fut)
            tail = self._tail  # NOTE [write tail]
            while tail and tail[0][0].done():
                tail.popleft()
            tail.append((fut, [weakref.ref(rec) for rec, *_ in batch]))

    def _write_batch(self, job: _Job) -> None:
        """IO job: write a batch (NOTE [write batches]); ``job.done`` is set as it ends."""
        try:
            self._write_job(job)
        finally:
            job.done.set()

    def _write_job(self, job: _Job) -> None:
        """Write a batch, adjacent extents with one vectored write each."""
        with self._lock:
            if job.void:
                return  # its submit was interrupted after queueing it: the batch went back
            job.started = True
        batch = self._without_moved(job.batch)  # NOTE [moved storages]
        store = self._store
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
                for rec, *_ in run:
                    rec.frozen = rec.host_only
            # NOTE [checksums]: an exposed record is checksummed from its staged copy.
            staged = (self.staging and store.io_method == "direct") or any(
                rec.exposed and rec.crcs is not None for rec, *_ in run
            )
            try:
                views: list[memoryview] = []
                sums: list[_Sum | None] = []  # staged runs: checksums over the staged copy
                for rec, pieces, fence, _ in run:
                    culprit = rec
                    if fence is not None:
                        fence.wait()  # the host copy must be complete (NOTE [copy streams])
                    crcs = rec.crcs
                    if staged:
                        sums.extend(_wanted_sums(rec, len(pieces)))
                    elif crcs is not None:  # NOTE [checksums]: the span's bytes in each piece
                        for i, (lo, hi, _) in enumerate(crcs):
                            a, b = span_part(rec.span, lo, hi)
                            crcs[i] = (lo, hi, zlib.crc32(pieces[i][a - lo : b - lo]))
                    views.extend(pieces)
                first = run[0][0].extent
                assert first is not None
                culprit = run[0][0]
                with profiler_range("prefetch_offload::write"):
                    if staged:
                        self._staged_write(first, views, sums)  # NOTE [write staging]
                    else:
                        store.write(first, 0, views if len(views) > 1 else views[0])
            except BaseException as e:  # every failure must reach the bookkeeping below
                exc = e
            finally:
                for _, pieces, *_ in run:
                    for view in pieces:
                        view.release()
            # NOTE [moved storages]: moved while the write read it. A failure is then
            # the move's (EFAULT: the old pages are gone), and the run's other records
            # were not written either: they stay in memory too, with no error.
            rest = self._without_moved(run)
            if rest is not run and exc is not None:
                self._keep_in_memory(rest)
                continue
            for item in rest:
                rec = item[0]
                try:
                    self._write_done(rec, exc, culprit)
                except BaseException as failure:  # NOTE [errors from workers]
                    # (a warning made an error by the user's filters): the other records
                    # of the batch are still settled, and the user hears of it.
                    self._report(failure)

    def _without_moved(self, items: list[_Pending]) -> list[_Pending]:
        """``items`` less the records whose storage moved since they were queued (NOTE
        [moved storages]), which stay in memory; ``items`` itself where none moved."""
        moved = [item for item in items if _moved(item)]
        if not moved:
            return items
        self._keep_in_memory(moved)
        gone = {id(item) for item in moved}
        return [item for item in items if id(item) not in gone]

    def _keep_in_memory(self, items: list[_Pending]) -> None:
        """Keep in memory, as records whose write was skipped, the records of ``items``;
        their views are released."""
        skipped: list[_Record] = []
        with self._lock:
            for rec, pieces, *_ in items:
                for view in pieces:
                    view.release()
                if rec.writes_left:  # (else skipped meanwhile: NOTE [write tail])
                    skipped.append(rec)
            freed = self._skip(skipped)
        self._skipped(len(skipped), freed)

    def _staged_write(
        self, first: Extent, views: list[memoryview], sums: list[_Sum | None]
    ) -> None:
        """Write ``views`` back to back from ``first``, copied through a staging buffer,
        and fill in the checksums ``sums`` asks for, one per view, over the staged bytes."""
        store = self._store
        size = _STAGE_BYTES
        buf, region = self.stage_pool.lease(size)
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
            self.pending_bytes -= rec.span.extent_bytes
            self._writes_idle.notify_all()
            if exc is None:
                saved, source = rec.saved, rec.source
                if saved is not None and saved._version != rec.version:
                    rec.tainted = True  # NOTE [version check]: modified before it was written
                if source is not None and rec.handout_changed(source[0]):
                    rec.tainted = True  # NOTE [handouts]: changed in backward before written
                rec.on_disk = True
                rec.saved = None
                rec.source = None  # NOTE [record lifetime]: the activation can go now
                self._stats.add(tensors_offloaded=1, bytes_offloaded=rec.span.nbytes)
                return
            extent, rec.extent = rec.extent, None
            self._policy.keep(rec, DEVICE if rec.host_only else HOST)  # NOTE [tiers]
        if extent is not None:
            self._store.free(extent)
        self._write_failed(culprit or rec, exc)

    def skip_tail(self) -> None:
        """Drop writes that backward would read right back (NOTE [write tail])."""
        skipped: list[_Record] = []
        with self._lock:
            for rec, pieces, *_ in self._take_batch(submit=False):  # never submitted
                for view in pieces:
                    view.release()
                skipped.append(rec)
            tail = self._tail
            while tail:
                fut, refs = tail.pop()  # newest first
                # Strong references first: cancelling the job drops the batch, the
                # only thing that may still keep a dropped graph's records alive.
                recs = [ref() for ref in refs]
                if not fut.cancel():  # (in one step: NOTE [interrupts] in io_pool.py)
                    break  # a worker started it; writes run in order: older ones too
                skipped += [rec for rec in recs if rec is not None and rec.writes_left]
                del recs
            tail.clear()  # older writes have started: none left to skip
            freed = self._skip(skipped)
        self._skipped(len(skipped), freed)

    def _skip(self, skipped: list[_Record]) -> list[Extent]:
        """Under the lock: ``skipped``'s writes will not happen, and the records stay in
        their memory tier (NOTE [tiers]: cancelled demotions). Returns their extents,
        for :meth:`_skipped` to free once the lock is let go."""
        freed: list[Extent] = []
        for rec in skipped:
            rec.writes_left = 0
            rec.skipped = True
            self.pending_bytes -= rec.span.extent_bytes
            if rec.extent is not None:
                freed.append(rec.extent)
                rec.extent = None
        self._writes_idle.notify_all()
        self._policy.readmit([r for r in skipped if r.host_only], DEVICE)
        self._policy.readmit([r for r in skipped if not r.host_only], HOST)
        return freed

    def _skipped(self, count: int, freed: list[Extent]) -> None:
        """After :meth:`_skip`, without the lock: free the extents, count the skips."""
        for extent in freed:
            self._store.free(extent)
        if count:
            self._stats.add(writes_skipped=count)

    def allocate(self, nbytes: int) -> Extent | None:
        """Slab space for a record, or None (counted and warned) where none is left."""
        try:
            extent = self._store.allocate(nbytes)
        except OSError as exc:
            fix = (
                f"Lower slab_bytes ({self.config.slab_bytes}): the folder's filesystem holds "
                "no file that large."
                if exc.errno == errno.EFBIG
                else "Check the folder's permissions and space."
            )
            raise OffloadIOError(
                f"prefetch_offload: could not create a slab file in "
                f"{self.config.save_dir!r}: {exc}. {fix}"
            ) from exc
        if extent is None:
            self.note_no_space("the slab reservation failed")
        return extent

    def wait(self) -> None:
        """Submit the open batch; wait until every write job has finished."""
        with self._lock:
            self._transit.pop(threading.current_thread(), None)  # (lost, if any)
            batch = self._take_batch()
        if batch:
            self._submit_batch(batch)
        futs = self._futs
        while True:
            with self._lock:
                while futs and futs[0].done():
                    futs.popleft()
                if not futs:
                    break
                fut = futs[0]
            fut.wait()
        while self._unfollowed:  # started jobs whose submit was interrupted
            self._unfollowed[0].done.wait()
            with self._lock:
                self._unfollowed = [j for j in self._unfollowed if not j.done.is_set()]
        with self._lock:  # NOTE [interrupts] in io_pool.py: what one left counted
            on_the_way = any(thread.is_alive() for thread in self._transit)
            if not self._open and not on_the_way and not self._writing():
                self.pending_bytes = 0

    def _write_failed(self, rec: _Record, exc: BaseException) -> None:
        """NOTE [errors from workers]: the record keeps its source in memory."""
        self._stats.add(fallbacks=1)
        if getattr(exc, "errno", None) in _SPACE_ERRNOS:
            self.note_no_space(f"a write failed ({exc.strerror})", counted=True)
            return
        err = OffloadIOError(
            f"prefetch_offload: writing {rec.describe()} to {self.config.save_dir!r} failed: "
            f"{exc}. The tensor was kept in memory; check the disk and the folder."
        )
        err.__cause__ = exc
        self._report(err)

    def note_no_space(self, what: str, *, counted: bool = False) -> None:
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
