"""The lookahead scheduler: which offloaded tensors to read before backward asks.

# NOTE [lookahead]
# Backward consumes saved tensors roughly in the reverse of the order forward
# packed them. The scheduler keeps every live record in pack order (weakly:
# it never keeps a record alive). When backward unpacks the record at position
# p, the next ``depth`` live records below p form the window; each one that
# needs a read and has none in flight gets a prefetch. At most ``depth``
# prefetches are outstanding at once: when a misprediction would exceed that,
# the oldest unconsumed prefetch is dropped (cancelled if not started, and its
# buffer freed when the read finishes). So prefetch memory is bounded by the
# ``depth`` largest tensors, whatever order backward really takes.
#
# The scheduler has no lock of its own; the engine calls it under its lock.
"""

from __future__ import annotations

import weakref
from collections import deque
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
        self._live = 0
        self._outstanding: deque[weakref.ref[Schedulable]] = deque()

    def register(self, rec: Schedulable) -> None:
        """Append a newly packed record; sets ``rec.pos``."""
        if len(self._order) > 64 and len(self._order) > 2 * self._live:
            self._compact()
        rec.pos = len(self._order)
        self._order.append(weakref.ref(rec))
        self._live += 1

    def forget(self) -> None:
        """Note that a registered record died (called from the engine's release path)."""
        self._live -= 1

    def _compact(self) -> None:
        alive = [r for r in self._order if r() is not None]
        for i, ref in enumerate(alive):
            rec = ref()
            if rec is not None:
                rec.pos = i
        self._order = alive
        self._live = len(alive)

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

    def issued(self, rec: Schedulable) -> None:
        """Record that ``rec`` got a prefetch; evicts the oldest beyond ``depth``."""
        self._outstanding.append(weakref.ref(rec))
        while len(self._outstanding) > self.depth:
            old = self._outstanding.popleft()()
            if old is not None:
                old.drop_prefetch()

    def consumed(self, rec: Schedulable) -> None:
        """Record that ``rec``'s prefetch was taken by an unpack."""
        for i, ref in enumerate(self._outstanding):
            if ref() is rec:
                del self._outstanding[i]
                return

    def clear(self) -> None:
        """Drop every outstanding prefetch."""
        while self._outstanding:
            old = self._outstanding.popleft()()
            if old is not None:
                old.drop_prefetch()
