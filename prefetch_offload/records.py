"""Records and handles: what autograd holds for an offloaded tensor, and its state.

# NOTE [record lifetime]
# Autograd owns the handles. A handle is one saved view (ViewMeta); it points at
# the Record holding its storage span, shared by every view of that span (NOTE
# [dedup]). A record lives while any handle, or a write job still reading its
# source, references it. The engine and the scheduler hold records only weakly.
# When a record dies, its extent is queued for release with a deque append (safe
# from any thread, including inside the garbage collector) and returned to the
# allocator at the next pack or unpack, ``stats()`` call, or context exit (after
# exit, unpack and stats also unmap slabs that hold nothing any more). A graph
# that outlives the context and is dropped without a backward calls none of
# these: so from exit on, a dead record with an extent drains at once, where it
# can without waiting (no other code holds the engine's lock or the store's, so
# none is midway through what the drain changes, the same thread included), and
# closes the slabs emptied; where one is held, the holder's next drain does it.
# So slab space is freed when autograd releases the saved
# tensor, not at unpack, and ``backward(retain_graph=True)`` can read it again.
# Records hold the engine strongly: a graph built inside the context stays
# usable after it exits, and the slab files close when the last record and the
# last user reference to the engine are gone. A record still in the open write
# batch (NOTE [write batches]) is held by the batch until it is submitted or
# skipped, even if its graph was dropped: at most one batch of bytes.
#
# NOTE [dedup]
# The same storage is often saved several times: one tensor by several ops (a
# layer's input feeds q, k and v), or several views of it (softmax saves the 4-D
# attention probabilities, the next matmul a 3-D view of them). A pack whose
# span lies inside a live record's span of the same storage, at the same
# version, shares that record: its bytes are written once and read once. The
# storage is identified by a weak reference to the storage object, never by
# address alone: a freed tensor's address is reused by the next allocation, and
# a dead weak reference can never match a new storage. The version counter
# (shared by all views of a tensor) catches in-place updates between two saves.
# Not every byte of a span is a saved element: the gaps of a strided view
# (x[::2] spans x[1::2]) and the rest of a whole storage (NOTE [whole storage])
# may still be written legally through a tensor with a counter of its own
# (``x.data``, a numpy or frombuffer alias of the same memory), unseen by the
# version check. So once a CPU record's write has begun reading the tensor's
# memory (``frozen``), a pack shares the record only if its span lies inside a
# dense view saved there (``covered``), whose bytes autograd forbids changing;
# before that, the write reads what every later save sees. Dense: each byte of
# the span in exactly one element (``is_dense`` in packed.py); an expanded
# strided view may count as many elements as its span has bytes and still skip
# most of them. A device record's bytes are read by its copy to the host, which
# waits for the work its save had queued (NOTE [copy streams]): a save that
# shares the record before its copy is issued adds the work queued before it to
# what the copy waits for (``joined_fence``), so a kernel that wrote the gaps in
# between is seen; while the copy is being issued (another thread's demotion),
# the record is ``frozen`` as a CPU record is. Once its copy is issued (at its
# own save where the budget keeps nothing), sharing is not checked: checking
# would lose the sharing of q, k and v (NOTE [whole storage]), whose first view
# is copied before the other two are saved (on the CPU twin an SDPA
# TinyTransformer moved 35% more bytes). A write to the gaps through an alias
# that bumps no version counter, between two saves of one storage, after the
# first one's copy was issued, can therefore reach backward stale on a device.
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
# NOTE [version check]
# Autograd normally refuses to backward through a saved tensor that was
# modified in place after it was saved, but skips that check whenever
# saved-tensor hooks are installed. An offloading engine makes the mistake
# worse (the async write may capture either value), so every handle remembers
# the version the saved tensor had, and unpack raises the same error autograd
# would if its version counter moved since. The record reads that counter
# through ``counter``: a 0-element tensor that shares it (``detach()`` shares
# the counter, and ``.data =`` gives it other memory and keeps the counter),
# so it holds none of the saved memory and sees a change made through any alias
# of it, a ``detach()`` of an owner that has since died included.
# A CPU record in memory hands out the saved tensor's own memory. Once written,
# the record lets go of the tensor (``saved``) and cannot see that memory's
# version any more, so that memory is never remembered as the record's restored
# span: an alias sharing the dead owner's counter (``y.detach()``) may modify it
# after the write, and a later unpack must read the written bytes instead.
#
# NOTE [handouts]
# Every unpack builds a new tensor over the record's memory: the span still in
# memory, one read back and still held (the next unpack may hand it out again),
# or memory read afresh. A backward function that changes what it unpacked,
# while another node still needs that saved tensor (or the same node, in a
# later pass of a retained graph), would pass the change on unseen, or hide it,
# where autograd without hooks raises at that unpack. So every result is handed
# out with the saved tensor's own version counter, over whatever memory: the
# record's version probe (``counter``) shares it, and each result is the
# probe's ``detach()`` (which shares the counter) given the view's data
# (``.data =`` keeps the counter). Every other saved object of that tensor (a
# small view kept for its size, another record over the same memory, the same
# record's next pass) checks that counter at its unpack and raises autograd's
# error if it moved, as autograd does. Where the tensor type takes no new data
# (no probe), the results handed out over one memory share a sentinel of their
# own instead: a 0-element tensor (``handout``: the memory, weakly, the
# sentinel, its version), which an unpack over the same memory checks first;
# memory read afresh then gets a new sentinel (its bytes are the written ones).
# A write that lands after such a change, or a copy of a device span to the
# host issued after it, taints the record. Probes and sentinels hold no
# memory, so they live as long as the record.
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
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from .device import Placed
from .errors import OffloadError
from .io_pool import IOFuture
from .packed import Span, ViewMeta
from .policy import DEVICE
from .slab import Extent
from .streams import Fence

if TYPE_CHECKING:
    from .engine import OffloadEngine

__all__ = [
    "DedupEntry",
    "Fetched",
    "Handle",
    "Kept",
    "Record",
    "Resident",
    "Wrapped",
    "is_dtensor",
    "sentinel_for",
    "version_error",
    "version_probe",
]

# A span in memory: bytes [base, base + nbytes) of an untyped storage, there once
# its fence (if any) is done (NOTE [copy streams]).
Resident = Placed
# A fetch's result: the span, and the record's first view over it, handed out (with
# its sentinel: NOTE [handouts]), when the fetching thread could build it (NOTE
# [views built by the reader]).
Fetched = tuple[Resident, "tuple[torch.Tensor, torch.Tensor] | None"]


def sentinel_for(
    view: torch.Tensor, counter: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view as a result to hand out, its sentinel)``: ``counter`` (the saved tensor's
    version probe) where given, else a new 0-element tensor; the result shares the
    sentinel's version counter (NOTE [handouts])."""
    sentinel = (
        counter if counter is not None else torch.empty((0,), dtype=view.dtype, device=view.device)
    )
    return _sharing(sentinel, view), sentinel


def _sharing(sentinel: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` as a new tensor with ``sentinel``'s version counter (NOTE [handouts])."""
    out = sentinel.detach()
    out.data = data
    return out


def version_error(what: str, now: int, then: int) -> OffloadError:
    return OffloadError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: {what} is at version {now}; expected version {then} instead. "
        "PyTorch skips this check when saved-tensor hooks are installed; prefetch_offload "
        "keeps it (NOTE [version check]). Do not modify a tensor in place after an op saved it."
    )


class Kept:
    """A saved tensor left in memory, with its version at save time."""

    # A placeholder in the plan (NOTE [learned order]) is weakly held there and has
    # its step and position in it; others have spos -1.
    __slots__ = ("__weakref__", "spos", "step", "tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        # NOTE [no cycles]: a detached alias (same storage and version counter).
        self.tensor = t.detach()
        self.version = -1 if torch.is_inference(t) else t._version
        self.step = self.spos = -1

    def unchecked(self) -> None:
        """Skip the version check at unpack (NOTE [version check])."""
        self.version = -1

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if self.version >= 0 and t._version != self.version:
            what = f"a saved tensor (shape {list(t.shape)}, {t.dtype})"
            raise version_error(what, t._version, self.version)
        return t


# NOTE [wrapper subclasses]
# A DTensor (tensor and sequence parallelism) is a wrapper around a plain local
# tensor plus how it is laid out over a device mesh. The engine packs the local
# tensor like any other saved tensor and keeps the layout; unpack rebuilds the
# wrapper with ``from_local`` (no communication: ``run_check=False``, with the
# global shape and stride given). Other tensor subclasses stay in memory, as
# the engine cannot rebuild them, and ``OffloadStats.subclasses_kept`` counts
# them; so do wrapper parameters (a leaf that requires grad).


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it)."""
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


class Wrapped:
    """A DTensor's packed local tensor and what rebuilds the wrapper around it."""

    __slots__ = ("cls", "inner", "mesh", "owner", "placements", "shape", "stride", "version")

    def __init__(self, t: torch.Tensor, inner: object) -> None:
        self.cls = type(t)
        self.inner = inner  # the local tensor's Handle or Kept
        self.mesh = t.device_mesh  # type: ignore[attr-defined]
        self.placements = t.placements  # type: ignore[attr-defined]
        self.shape = t.shape
        self.stride = t.stride()
        # NOTE [version check]: an in-place op on a DTensor moves the wrapper's version
        # counter, not its local tensor's; the wrapper is held weakly (a 0-element probe
        # of a DTensor would still hold the local tensor).
        self.owner = weakref.ref(t)
        self.version = t._version

    def unchecked(self) -> None:
        """Skip the version checks at unpack (NOTE [version check])."""
        self.version = -1
        self.inner.unchecked()  # type: ignore[attr-defined]

    def check_version(self) -> None:
        """Raise autograd's in-place error if the DTensor changed since it was saved."""
        owner = self.owner()
        if owner is not None and self.version >= 0 and owner._version != self.version:
            what = f"a {self.cls.__name__} of shape {list(self.shape)}"
            raise version_error(what, owner._version, self.version)

    def rebuild(self, local: torch.Tensor) -> torch.Tensor:
        """The DTensor around ``local``, as it was saved."""
        return self.cls.from_local(  # type: ignore[attr-defined, no-any-return]
            local,
            self.mesh,
            self.placements,
            run_check=False,
            shape=self.shape,
            stride=self.stride,
        )


# One 0-element tensor per dtype and device, which every probe's data is (version_probe;
# ``.data =`` keeps the probe's own counter).
_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def version_probe(t: torch.Tensor) -> torch.Tensor | None:
    """A 0-element tensor sharing ``t``'s version counter and none of its memory (NOTE
    [version check]); None where this tensor type refuses new data."""
    probe = t.detach()
    key = (t.dtype, t.device)
    empty = _EMPTY.get(key)
    if empty is None:
        empty = _EMPTY[key] = torch.empty(0, dtype=t.dtype, device=t.device)
    try:
        probe.data = empty
    except (RuntimeError, TypeError):
        return None
    return probe


class Handle:
    """What autograd stores for an offloaded tensor: a view of a record's span."""

    __slots__ = ("checked", "pass_no", "record", "view")

    def __init__(self, record: Record, view: ViewMeta) -> None:
        self.record = record
        self.view = view
        self.pass_no = -1  # NOTE [backward passes]
        self.checked = True

    def unchecked(self) -> None:
        """Skip the version check at unpack (NOTE [version check])."""
        self.checked = False

    def check_version(self) -> None:
        """NOTE [version check]: a view shares its record only at the record's version
        (NOTE [dedup]), so the record's check is the view's."""
        if self.checked:
            self.record.check_version()

    def __repr__(self) -> str:
        return f"<prefetch_offload handle {self.record.describe()}>"


class Record:
    """One offloaded storage span: where its bytes are, and what is in memory."""

    __slots__ = (
        "__weakref__",
        "align",
        "counter",
        "crcs",
        "device",
        "engine",
        "exposed",
        "extent",
        "frozen",
        "handout",
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
        "shares",
        "skipped",
        "source",
        "span",
        "spos",
        "step",
        "tainted",
        "tier",
        "unpack_pass",
        "unpacks",
        "version",
        "view0",
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
        self.counter = None if saved is None else version_probe(saved)
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
        # NOTE [recently restored]: saves that share the record beyond its first (dedup),
        # and its unpacks in backward pass ``unpack_pass``.
        self.shares = 0
        self.unpack_pass = -1
        self.unpacks = 0
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
        self.prefetch: IOFuture[Fetched] | None = None
        # The span on its device, while any view handed to autograd keeps it alive.
        self.restored: tuple[weakref.ref[torch.UntypedStorage], int, Fence | None] | None = None
        # NOTE [handouts]: the memory last handed out, the sentinel, its version then.
        self.handout: tuple[weakref.ref[torch.UntypedStorage], torch.Tensor, int] | None = None

    def describe(self) -> str:
        v = self.view0
        return (
            f"saved tensor #{self.seq} (shape {list(v.shape)}, {v.dtype}, "
            f"{self.span.nbytes} bytes on {self.device})"
        )

    def hand_out(
        self,
        storage: torch.UntypedStorage,
        view: torch.Tensor | None,
        built: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``view`` (over ``storage``) as an unpack's result, with the saved tensor's
        version counter (or, where it has no probe, the sentinel of the results handed
        out before over the same memory); raises autograd's in-place error if one of
        those was changed since (NOTE [handouts]). ``built``
        instead: a result and its sentinel (:func:`sentinel_for`, with ``counter``) made
        by the reading thread over memory read afresh. Needs no lock (the tensor calls
        release the GIL, and may wait to get it back): ``handout`` is read and replaced
        whole."""
        last = self.handout
        if last is None or last[0]() is not storage:  # memory not handed out before
            # NOTE [handouts]: with the saved tensor's own counter, where it has a probe
            out, sentinel = built if built is not None else sentinel_for(view, self.counter)  # type: ignore[arg-type]
            self.handout = (weakref.ref(storage), sentinel, sentinel._version)
            return out
        sentinel, version = last[1], last[2]
        if sentinel._version != version:
            raise version_error(
                f"{self.describe()}, as handed to an earlier unpack in backward,",
                sentinel._version,
                version,
            )
        return _sharing(sentinel, built[0] if built is not None else view)  # type: ignore[arg-type]

    def handout_changed(self, storage: torch.UntypedStorage) -> bool:
        """Whether a result handed out over ``storage`` was changed in place since."""
        last = self.handout
        return last is not None and last[0]() is storage and last[1]._version != last[2]

    def check_version(self) -> None:
        """Raise autograd's in-place error if the saved bytes are not the saved values."""
        counter = self.counter
        now = counter._version if counter is not None else self.version
        if self.tainted or now != self.version:
            raise version_error(self.describe(), max(now, self.version + 1), self.version)

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
        # NOTE [record lifetime]: never wait for a lock here.
        try:
            engine = self.engine
            engine._dead.append((self.extent, self.key, self.tier, self.span.nbytes, self.seq))
            if self.extent is not None and engine.closed:
                engine.drain_now()
        except Exception:  # interpreter shutdown
            pass


class DedupEntry:
    """A live record's span within one storage (NOTE [dedup])."""

    __slots__ = ("covered", "end", "owner", "record", "start", "storage", "version")

    def __init__(
        self,
        storage: torch.UntypedStorage,
        owner: weakref.ref[torch.Tensor],
        version: int,
        start: int,
        end: int,
        rec: Record,
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
