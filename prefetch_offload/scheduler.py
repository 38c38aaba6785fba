"""The lookahead scheduler: which offloaded tensors to read before backward asks.

# NOTE [lookahead]
# Backward consumes saved tensors roughly in the reverse of the order forward
# packed them. The scheduler keeps every live record in pack order (weakly:
# it never keeps a record alive). When backward unpacks the record at position
# p, the next ``depth`` live records below p form the window; each one that
# needs a read and has none in flight gets a prefetch.
#
# Real backward order is only roughly reversed: one node unpacks its own saved
# tensors in the order they were saved (a matmul unpacks ``a`` then ``b``), and
# branches interleave. So up to ``2 * depth`` prefetches may be outstanding, and
# when a new one would exceed that, the one farthest from p (the most
# speculative, or one that backward passed over) is dropped: cancelled if not
# started, its buffer freed when the read finishes. Prefetch memory is thus
# bounded by the ``2 * depth`` largest tensors, whatever order backward takes.
#
# The scheduler has no lock of its own; the engine calls it under its lock.
"""

from __future__ import annotations

import weakref
from typing import Protocol

__all__ = ["PrefetchScheduler", "Schedulable"]


class Schedulable(Protocol):
    """What the scheduler needs from a record."""

    pos: int

    def needs_read(self) -> bool:
        """True when the record's bytes are only on disk and no read is in flight."""
        ...

    def drop_prefetch(self) -> None:
        """Forget (and cancel, if not started) an unconsumed prefetch."""
        ...


class PrefetchScheduler:
    """Pack order, the lookahead window, and the cap on outstanding prefetches."""

    def __init__(self, depth: int, *, scan_limit: int = 64) -> None:
        self.depth = depth
        # How many entries past the window a scan may skip (dead or ineligible).
        self._scan_limit = scan_limit + 8 * depth
        self._order: list[weakref.ref[Schedulable]] = []
        # Deaths reported since the last compaction (may over-count a little: a
        # record that died just before a compaction is reported after it).
        self._deaths = 0
        # Records with an unconsumed prefetch, by identity.
        self._outstanding: dict[int, weakref.ref[Schedulable]] = {}

    def register(self, rec: Schedulable) -> None:
        """Append a newly packed record; sets ``rec.pos``."""
        if len(self._order) > 64 and 2 * self._deaths > len(self._order):
            self._compact()
        rec.pos = len(self._order)
        self._order.append(weakref.ref(rec))

    def forget(self) -> None:
        """Note that a registered record died (called from the engine's release path)."""
        self._deaths += 1

    def _compact(self) -> None:
        alive = [r for r in self._order if r() is not None]
        for i, ref in enumerate(alive):
            rec = ref()
            if rec is not None:
                rec.pos = i
        self._order = alive
        self._deaths = 0

    def window(self, rec: Schedulable) -> list[Schedulable]:
        """Records to prefetch after ``rec`` is unpacked (NOTE [lookahead])."""
        if self.depth == 0:
            return []
        picked: list[Schedulable] = []
        seen = 0
        pos = rec.pos
        order = self._order
        if pos >= len(order) or order[pos]() is not rec:
            return []  # not registered (e.g. compacted away); nothing sensible to predict
        i = pos - 1
        budget = self.depth + self._scan_limit
        while i >= 0 and seen < self.depth and budget > 0:
            cand = order[i]()
            i -= 1
            budget -= 1
            if cand is None:
                continue
            seen += 1
            if cand.needs_read():
                picked.append(cand)
        return picked

    def issued(self, rec: Schedulable, anchor: Schedulable) -> None:
        """Record that ``rec`` got a prefetch while ``anchor`` was being unpacked.

        Drops the outstanding prefetch farthest from ``anchor`` while more than
        ``2 * depth`` are outstanding (NOTE [lookahead]).
        """
        out = self._outstanding
        out[id(rec)] = weakref.ref(rec)
        if len(out) <= 2 * self.depth:
            return
        live: list[tuple[int, int, Schedulable]] = []
        for key, ref in list(out.items()):
            r = ref()
            if r is None:
                del out[key]
            else:
                live.append((abs(r.pos - anchor.pos), key, r))
        live.sort(key=lambda item: item[0])
        for _, key, r in live[2 * self.depth :]:
            del out[key]
            r.drop_prefetch()

    def consumed(self, rec: Schedulable) -> None:
        """Record that ``rec``'s prefetch was taken by an unpack."""
        self._outstanding.pop(id(rec), None)

    def clear(self) -> None:
        """Drop every outstanding prefetch."""
        out, self._outstanding = self._outstanding, {}
        for ref in out.values():
            r = ref()
            if r is not None:
                r.drop_prefetch()
