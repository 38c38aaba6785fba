"""The slab store: preallocated, unlinked scratch files and the allocator over them.

# NOTE [scratch files]
# Slab files never have a name anyone else can see. They are opened with
# O_TMPFILE (an unnamed inode in ``save_dir``), so a killed process leaves
# nothing behind and the space returns when the last descriptor closes. Where
# O_TMPFILE is unsupported, the file is created with O_CREAT|O_EXCL|O_NOFOLLOW
# and mode 0600 under a random name, inside a private 0700 subfolder made for
# it, and both are removed at once. Either way nothing is
# opened through a symlink and no two processes or contexts can collide.
#
# NOTE [slab allocation]
# Each slab is one file of ``slab_bytes`` (smaller near a full disk: NOTE [slab
# sizes on a full disk]) reserved up front with posix_fallocate, so a full disk
# shows up as a failed reservation (the tensor stays in memory) rather than as
# an IO error in the middle of a write. Space is handed out in whole pages,
# first fit, and coalesced on free, so the same activations reuse the same space
# step after step. A tensor larger than a slab gets a dedicated slab of its own
# size, kept for reuse by the next step.
#
# NOTE [slab sizes on a full disk]
# A filesystem with less free space than one slab still takes what it has.
# When a new slab fails for space (ENOSPC or EDQUOT, from creating the file or
# reserving its bytes), the store tries again at half the size, in whole
# pages, down to a floor: the request itself, rounded up to a page. Each try is
# a fresh unlinked file, closed at once if it fails, so a half-reserved file
# never stays behind. Halving from ``slab_bytes`` (or from what
# ``disk_bytes_limit`` leaves) fills the free space down to less than the
# request that is refused, in one slab per halving step.
#
# The smallest size that failed is remembered. While it is, new slabs start at
# half of it, and a request at least that large is refused with no reservation
# tried; every failure at least halves the next start, so from one reset to the
# next the failed reservations number about log2(slab_bytes / 4096) in all,
# not a ladder per request. If creating the file itself fails for space (no
# inode left), no size is tried until a reset. Space may have come back, and
# the memory is reset, when:
#   * ``trim`` closes a slab: the next slab tries the full ``slab_bytes``;
#   * the filesystem reports more free bytes or inodes (statvfs, one call per
#     new slab while a failure is remembered) than after the last reservation
#     that failed or came out small: the next slab starts at the free bytes
#     reported, so the churn of a shared disk costs a try or two, not a ladder
#     from the top.
# Where statvfs fails, only ``trim`` resets the memory. Under a quota that holds
# this user below the free space, statvfs reports the disk's free space, so any
# gain in it (another user's files deleted) starts the sizes again from what is
# free, and a few reservations fail before one fits: time, not memory.
# Filesystems without fallocate get a sparse file (ftruncate) of the full size:
# there a full disk shows up at write time instead.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .freelist import FreeRuns
from .packed import ALIGN

__all__ = [
    "Extent",
    "SlabStore",
    "check_writable",
    "direct_io_supported",
    "open_scratch_file",
    "prepare_save_dir",
]

_O_TMPFILE = getattr(os, "O_TMPFILE", 0)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# Buffers per vectored write (Linux IOV_MAX).
_IOV_MAX = 1024
# A reservation that fails with one of these is a full disk, not an error.
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def open_scratch_file(directory: str, *, direct: bool) -> int:
    """Open a new unnamed read-write file in ``directory`` (NOTE [scratch files]).

    Raises:
        OSError: the folder does not allow it (``EINVAL`` when ``direct`` is
            unsupported by the filesystem).
    """
    flags = os.O_RDWR | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
    if _O_TMPFILE:
        try:
            return os.open(directory, flags | _O_TMPFILE, 0o600)
        except OSError as exc:
            # EOPNOTSUPP: the filesystem has no O_TMPFILE; EISDIR: the kernel predates it.
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR):
                raise
    # A private (0700, randomly named, created exclusively) subfolder holds the name
    # for the moment between create and unlink; both go at once.
    private = tempfile.mkdtemp(prefix=".prefetch_offload-", dir=directory)
    try:
        path = os.path.join(private, f"{secrets.token_hex(8)}.slab")
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.unlink(path)
        except OSError:
            os.close(fd)
            raise
    finally:
        with contextlib.suppress(OSError):  # not empty only if someone planted a file there
            os.rmdir(private)
    return fd


def direct_io_supported(directory: str) -> bool:
    """Whether files in ``directory`` accept O_DIRECT requests of 4096-byte pages."""
    if not _O_DIRECT:
        return False
    try:
        fd = open_scratch_file(directory, direct=True)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, ALIGN)
        page = mmap.mmap(-1, ALIGN)
        try:
            return os.pwrite(fd, page, 0) == ALIGN
        finally:
            page.close()
    except OSError:
        return False
    finally:
        os.close(fd)


def prepare_save_dir(save_dir: str) -> Path:
    """Create ``save_dir`` if needed (mode 0700) and prove that files can be made in it.

    Raises:
        ValueError: the path is a file, a dangling symlink, not writable, or on a
            read-only filesystem; the message says what to change.
    """
    path = Path(save_dir)
    try:
        dangling = path.is_symlink() and not path.exists()
        path.is_dir()
    except (OSError, ValueError) as exc:  # a folder above it unreadable, a name too long
        raise ValueError(
            f"prefetch_offload: save_dir {save_dir!r} cannot be used ({_reason(exc)}); pass a "
            "folder path this user can reach and write to."
        ) from exc
    if dangling:
        raise ValueError(
            f"prefetch_offload: save_dir {save_dir!r} is a dangling symlink; "
            "point it at an existing folder or pass a real folder path."
        )
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"prefetch_offload: save_dir {save_dir!r} exists and is not a folder; "
            "pass a folder path for the offload scratch files."
        )
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise ValueError(
            f"prefetch_offload: cannot create save_dir {save_dir!r} ({_reason(exc)}); "
            "pass a folder you can write to."
        ) from exc
    check_writable(save_dir)
    return path


def _reason(exc: OSError | ValueError) -> str:
    return str(exc.strerror) if isinstance(exc, OSError) else str(exc)


def check_writable(save_dir: str) -> None:
    """Raise ValueError unless a scratch file can really be made in ``save_dir``.

    A real probe: ``access()`` says yes to root and can be wrong on network filesystems.
    """
    try:
        os.close(open_scratch_file(save_dir, direct=False))
    except OSError as exc:
        reason = "read-only filesystem" if exc.errno == errno.EROFS else exc.strerror
        raise ValueError(
            f"prefetch_offload: save_dir {save_dir!r} is not writable ({reason}); "
            "pass a folder on a writable filesystem that this user can write to."
        ) from exc


@dataclass(frozen=True, slots=True)
class Extent:
    """A page-aligned run of bytes inside one slab."""

    slab: int
    offset: int
    length: int


class _Slab(FreeRuns):
    """One slab file, its mapping (io_method "mmap"), and its free runs."""

    __slots__ = ("fd", "mm")

    def __init__(self, fd: int, size: int, mm: mmap.mmap | None) -> None:
        super().__init__(size)
        self.fd = fd
        self.mm = mm


class _NoInode(Exception):
    """No scratch file could be created for lack of space (no size would fit)."""


class SlabStore:
    """Slab files in one folder, an allocator over them, and the byte movers.

    ``allocate``/``free`` are thread-safe. ``write``/``read`` may run
    concurrently from many threads on disjoint extents. ``close`` must only be
    called once no request is in flight. Slabs are ``slab_bytes`` long, or
    shorter where the disk or ``disk_bytes_limit`` has less room (NOTE [slab
    sizes on a full disk]).
    """

    def __init__(
        self,
        directory: str,
        *,
        slab_bytes: int,
        io_method: str = "auto",
        disk_bytes_limit: int | None = None,
    ) -> None:
        if io_method == "auto":
            io_method = "direct" if direct_io_supported(directory) else "buffered"
        elif io_method == "direct" and not direct_io_supported(directory):
            raise ValueError(
                f"prefetch_offload: io_method='direct' but {directory!r} does not support "
                "O_DIRECT (tmpfs on older kernels, some network filesystems); "
                "use io_method='auto'."
            )
        self.directory = directory
        self.io_method = io_method
        self.slab_bytes = slab_bytes
        self.disk_bytes_limit = disk_bytes_limit
        self._lock = threading.Lock()
        self._slabs: dict[int, _Slab] = {}
        self._next_id = 0
        self.reserved_bytes = 0
        self.used_bytes = 0
        self.peak_reserved_bytes = 0
        self.peak_used_bytes = 0
        self.closed = False
        # NOTE [slab sizes on a full disk]: the smallest slab size that failed for
        # space since the last reset (None: none), and the free space seen after it.
        self._failed_size: int | None = None
        self._free_after_failure: tuple[int, int] = (0, 0)

    def use_buffered(self) -> None:
        """Move bytes through the page cache from now on (io_method "direct" becomes
        "buffered"; the slabs open now drop O_DIRECT, their bytes stay where they are).
        Requests in flight end as they began. "mmap" and "buffered" stay as they are."""
        with self._lock:
            if self.io_method != "direct":
                return
            for slab in self._slabs.values():
                flags = fcntl.fcntl(slab.fd, fcntl.F_GETFL)
                fcntl.fcntl(slab.fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
            self.io_method = "buffered"

    # -- allocation -----------------------------------------------------------------

    def allocate(self, length: int) -> Extent | None:
        """Reserve ``length`` bytes (a multiple of 4096).

        Returns:
            The extent, or None when the disk is full or ``disk_bytes_limit`` is
            reached (the caller keeps the tensor in memory).

        Raises:
            OSError: creating a slab failed for a reason other than space.
        """
        with self._lock:
            for sid, slab in self._slabs.items():
                off = slab.take(length)
                if off is not None:
                    self._count_use(length)
                    return Extent(sid, off, length)
            size = max(self.slab_bytes, length)
            if self.disk_bytes_limit is not None:
                # The slab that reaches the cap is cut to fit it, so a cap below
                # slab_bytes still offloads (into one smaller slab).
                room = (self.disk_bytes_limit - self.reserved_bytes) // 4096 * 4096
                if room < length:
                    return None
                size = min(size, room)
            slab = self._new_slab(size, floor=max(-(-length // ALIGN) * ALIGN, ALIGN))
            if slab is None:
                return None
            sid = self._next_id
            self._next_id += 1
            self._slabs[sid] = slab
            self.reserved_bytes += slab.size
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
            off = slab.take(length)
            assert off == 0
            self._count_use(length)
            return Extent(sid, 0, length)

    def _count_use(self, length: int) -> None:
        self.used_bytes += length
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)

    def _new_slab(self, size: int, *, floor: int) -> _Slab | None:
        """The largest slab of ``size``, ``size / 2``, ... ``floor`` bytes the disk takes.

        Returns None when not even ``floor`` bytes fit; see NOTE [slab sizes on a
        full disk] for the sizes tried and what a failure is remembered as.
        Called with ``self._lock`` held.
        """
        if self._failed_size is not None:
            free = self._free_space()
            if any(now > then for now, then in zip(free, self._free_after_failure, strict=True)):
                self._failed_size = None  # space came back: start at what is free
                size = min(size, max(free[0] // ALIGN * ALIGN, floor))
            elif floor >= self._failed_size:
                return None  # known not to fit: no reservation tried
            else:
                size = max(min(size, self._failed_size // 2 // ALIGN * ALIGN), floor)
        try:
            while True:
                try:
                    slab = self._try_slab(size)
                except _NoInode:
                    self._failed_size = ALIGN  # no file at all: no size fits
                    return None
                if slab is not None:
                    return slab
                self._failed_size = size
                if size <= floor:
                    return None
                size = max(size // 2 // ALIGN * ALIGN, floor)
        finally:
            if self._failed_size is not None:
                # What a later "space came back" is measured against: the free
                # space after this failure, or after the smaller slab taken since.
                self._free_after_failure = self._free_space()

    def _try_slab(self, size: int) -> _Slab | None:
        """A new slab of exactly ``size`` bytes, or None where the disk has no room for it.

        Raises:
            _NoInode: the file itself could not be made for lack of space.
            OSError: any other failure.
        """
        try:
            fd = open_scratch_file(self.directory, direct=self.io_method == "direct")
        except OSError as exc:
            if exc.errno not in _SPACE_ERRNOS:
                raise
            raise _NoInode from exc  # no inode left, or an inode quota
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in _SPACE_ERRNOS:
                    os.close(fd)  # unlinked: closing returns what was half-reserved
                    return None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                try:
                    os.ftruncate(fd, size)
                except OSError as exc2:
                    if exc2.errno not in _SPACE_ERRNOS:
                        raise
                    os.close(fd)
                    return None
            mm = mmap.mmap(fd, size) if self.io_method == "mmap" else None
        except BaseException:
            os.close(fd)
            raise
        return _Slab(fd, size, mm)

    def _free_space(self) -> tuple[int, int]:
        """Free bytes and free inodes of the slab folder's filesystem; (0, 0) if unknown."""
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return (0, 0)
        return (st.f_bavail * st.f_frsize, st.f_favail)

    @property
    def lock(self) -> threading.Lock:
        """The store's lock, for :meth:`free_locked` and :meth:`trim_locked`."""
        return self._lock

    def free(self, extent: Extent) -> None:
        """Return an extent's space to the allocator."""
        with self._lock:
            self.free_locked(extent)

    def free_locked(self, extent: Extent) -> None:
        """:meth:`free`, with :attr:`lock` held."""
        slab = self._slabs.get(extent.slab)
        if slab is None:  # store already closed
            return
        slab.give(extent.offset, extent.length)
        self.used_bytes -= extent.length

    def trim(self) -> None:
        """Close slabs that hold no live extent, returning their disk space."""
        with self._lock:
            self.trim_locked()

    def trim_locked(self) -> None:
        """:meth:`trim`, with :attr:`lock` held."""
        for sid in [sid for sid, s in self._slabs.items() if s.used == 0]:
            slab = self._slabs.pop(sid)
            self.reserved_bytes -= slab.size
            _close_slab(slab)
            self._failed_size = None  # NOTE [slab sizes on a full disk]

    def close(self) -> None:
        """Close every slab. Idempotent."""
        with self._lock:
            slabs, self._slabs = self._slabs, {}
            self.reserved_bytes = 0
            self.used_bytes = 0
            self.closed = True
        for slab in slabs.values():
            _close_slab(slab)

    # -- byte movers ------------------------------------------------------------------

    def write(self, extent: Extent, offset: int, data: memoryview | Sequence[memoryview]) -> None:
        """Write ``data`` at ``offset`` bytes into ``extent`` (page-aligned for "direct").

        A sequence of buffers is written back to back with one vectored write; it
        may run on past ``extent`` into the extents that follow it in the slab
        (the caller knows they are adjacent, NOTE [write batches] in writer.py).
        """
        slab = self._slabs[extent.slab]
        pos = extent.offset + offset
        views = [data] if isinstance(data, memoryview) else list(data)
        if slab.mm is not None:
            for view in views:
                dst = np.frombuffer(slab.mm, dtype=np.uint8, count=len(view), offset=pos)
                np.copyto(dst, np.frombuffer(view, dtype=np.uint8))
                pos += len(view)
            return
        while views:
            n = os.pwritev(slab.fd, views[:_IOV_MAX], pos)
            if n == 0:  # would retry forever, as a short read would (see ``read``)
                raise OSError(errno.EIO, f"short write at offset {pos} of a slab file")
            pos += n
            while views and n >= len(views[0]):  # drop what was written
                n -= len(views[0])
                views.pop(0)
            if n:
                views[0] = views[0][n:]

    def read(self, extent: Extent, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``offset`` bytes into ``extent``."""
        slab = self._slabs[extent.slab]
        pos = extent.offset + offset
        if slab.mm is not None:
            src = np.frombuffer(slab.mm, dtype=np.uint8, count=len(out), offset=pos)
            np.copyto(np.frombuffer(out, dtype=np.uint8), src)
            return
        view = out
        while view:
            n = os.preadv(slab.fd, [view], pos)
            if n == 0:
                raise OSError(errno.EIO, f"short read at offset {pos} of a slab file")
            view = view[n:]
            pos += n


def _close_slab(slab: _Slab) -> None:
    if slab.mm is not None:
        try:
            slab.mm.close()
        except BufferError:
            # A numpy view still exports the mapping; it is unmapped when that view dies.
            pass
    os.close(slab.fd)
