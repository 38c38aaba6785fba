"""The tier policy: where each record lives, under the memory budgets.

# NOTE [tiers]
# A record lives in one of three tiers: DEVICE (its bytes stay where they were
# made: GPU memory for CUDA tensors, RAM for CPU tensors), HOST (a host copy of
# a CUDA tensor) and DISK (a slab extent). Each memory tier has a budget
# (``device_budget``, ``host_budget``; None is no limit). A packed record enters
# DEVICE; whenever a tier holds more bytes than its budget, its oldest records
# (packed earliest, so needed last by backward) are demoted to the next tier:
# DEVICE to HOST for CUDA tensors, DEVICE to DISK for CPU tensors (which have no
# host copy to make), HOST to DISK. So the tensors backward needs first stay in
# the fastest tier, no knowledge of the step's size is needed (step 1 already
# works), and the bytes a tier keeps never exceed its budget once a pack
# returns. Demotion is asynchronous: a record being demoted still occupies its
# old memory until its copy or write lands, which ``max_pending_write_bytes``
# and ``max_inflight_copy_bytes`` bound. With budget 0 every eligible record is
# demoted as it is packed.
#
# The write tail (NOTE [write tail] in writer.py) is the one exception: when
# backward starts, demotions that have not started are cancelled and their
# records return to the front (oldest end) of their memory tier, over budget,
# because backward is about to consume them. When forward resumes, the budgets
# are enforced again, which demotes whatever of them is still alive.
#
# A record that cannot be demoted (no space on disk, no host budget left and no
# disk) stays where it is, outside the tier's queue: it is never tried again,
# and the engine warns once and counts it as a fallback. A demotion that raises
# (a slab file that cannot be created) returns its record, and those handed out
# after it, to the oldest end of the queue, to be tried at the next pack.
#
# The queues hold records weakly and learn late that one died or left: they
# drop such entries when over() meets them, and are rebuilt without them once
# those are half an entry list (a tier never over its budget, or with none,
# never pops; a tier with no budget has no queue), so their length follows the
# live records, not the records ever packed.
#
# The policy has no lock of its own; the engine calls it under its lock.
"""

from __future__ import annotations

import collections
import weakref
from typing import Protocol

__all__ = ["DEVICE", "DISK", "HOST", "TIER_NAMES", "TierPolicy", "Tiered"]

DEVICE, HOST, DISK = 0, 1, 2
# NOTE [tiers]: a queue is rebuilt once this many of its entries, and half of them,
# died or left.
_STALE_MIN = 64
TIER_NAMES = ("device", "host", "disk")


class Tiered(Protocol):
    """What the policy needs from a record."""

    tier: int  # set by the policy
    seq: int  # pack order

    @property
    def nbytes(self) -> int:
        """The bytes the record occupies in any tier."""
        ...


class TierPolicy:
    """Bytes per tier, the budgets, and which records to demote next.

    Args:
        device_budget: bytes DEVICE may keep.
        host_budget: bytes HOST may keep; None is no limit.
    """

    def __init__(self, device_budget: int, host_budget: int | None) -> None:
        self.budgets: tuple[int | None, int | None] = (device_budget, host_budget)
        # DEVICE and HOST records that may be demoted, oldest first (weakly held).
        self._queues: tuple[collections.deque[weakref.ref[Tiered]], ...] = (
            collections.deque(),
            collections.deque(),
        )
        self.bytes = [0, 0, 0]  # per tier, right now (records being demoted included)
        self.peak = [0, 0, 0]  # per tier, the most ever kept there once a pack returned
        self.demoted = [0, 0, 0]  # bytes demoted into each tier
        self.admitted = 0  # bytes of every record admitted, ever
        # Records over() handed out and not yet moved, by seq (unique, unlike an id
        # that a dead record's successor may reuse): their bytes, and per tier.
        self._leaving: dict[int, int] = {}
        self._leaving_bytes = [0, 0, 0]
        # Kept for good (keep()): never handed out, though still in a queue (by seq).
        self._kept: set[int] = set()
        # Per queue: entries that died or left since it was last rebuilt (NOTE [tiers]).
        self._stale = [0, 0]

    def _enqueue(self, rec: Tiered, tier: int, *, oldest: bool = False) -> None:
        if self.budgets[tier] is None:
            return  # never over its budget: nothing would ever pop it
        queue = self._queues[tier]
        if oldest:
            queue.appendleft(weakref.ref(rec))
        else:
            queue.append(weakref.ref(rec))

    def _went_stale(self, tier: int) -> None:
        if tier > HOST:
            return
        self._stale[tier] += 1
        queue = self._queues[tier]
        if self._stale[tier] >= _STALE_MIN and 2 * self._stale[tier] >= len(queue):
            live = [
                ref
                for ref in queue
                if (rec := ref()) is not None and rec.tier == tier and rec.seq not in self._kept
            ]
            queue.clear()
            queue.extend(live)
            self._stale[tier] = 0

    def headroom(self, tier: int) -> int:
        """Bytes of ``tier``'s budget that its records do not fill now (0 for no limit)."""
        budget = self.budgets[tier]
        return 0 if budget is None else max(0, budget - self.bytes[tier])

    def admit(self, rec: Tiered) -> None:
        """A newly packed record enters DEVICE, at the newest end (call :meth:`over` next)."""
        rec.tier = DEVICE
        self.bytes[DEVICE] += rec.nbytes
        self.admitted += rec.nbytes
        self._enqueue(rec, DEVICE)

    def _add(self, rec: Tiered, tier: int) -> None:
        self.bytes[tier] += rec.nbytes
        self._note_peak(tier)

    def _note_peak(self, tier: int) -> None:
        kept = self.bytes[tier] - self._leaving_bytes[tier]
        if kept > self.peak[tier]:
            self.peak[tier] = kept

    def _leave(self, rec: Tiered) -> None:
        """``rec`` moves out of its tier: first from the records over() handed out."""
        nbytes = self._leaving.pop(rec.seq, None)
        if nbytes is not None:
            self._leaving_bytes[rec.tier] -= nbytes
        self.bytes[rec.tier] -= rec.nbytes

    def over(self, tier: int) -> list[Tiered]:
        """The oldest records of ``tier`` to demote to bring it within its budget.

        They are still counted in ``tier`` until the caller moves each one with
        :meth:`demote`, or keeps it with :meth:`keep`, but are never handed out
        twice, and a second call does not pick more for the same excess.
        """
        budget = self.budgets[tier]
        picked: list[Tiered] = []
        if budget is not None:
            queue = self._queues[tier]
            excess = self.bytes[tier] - self._leaving_bytes[tier] - budget
            while excess > 0 and queue:
                rec = queue.popleft()()
                if rec is None or rec.tier != tier or rec.seq in self._leaving:
                    continue  # died (drained soon) or moved already
                if rec.seq in self._kept:
                    continue  # NOTE [tiers]: never tried again
                picked.append(rec)
                self._leaving[rec.seq] = rec.nbytes
                self._leaving_bytes[tier] += rec.nbytes
                excess -= rec.nbytes
        self._note_peak(tier)
        return picked

    def take(self, rec: Tiered, *, force: bool = False) -> bool:
        """Hand out ``rec`` itself for demotion if its tier is over its budget now (as
        :meth:`over` hands out the oldest): for a record saved during a backward. With
        ``force``, whatever the budget: a record that must leave its tier."""
        tier, budget = rec.tier, self.budgets[rec.tier]
        if budget is None or rec.seq in self._leaving:
            return False
        if not force and self.bytes[tier] - self._leaving_bytes[tier] <= budget:
            self._note_peak(tier)
            return False
        self._leaving[rec.seq] = rec.nbytes
        self._leaving_bytes[tier] += rec.nbytes
        self._note_peak(tier)
        return True

    def demote(self, rec: Tiered, tier: int) -> None:
        """Move ``rec`` to the slower ``tier``; HOST records may be demoted again later."""
        self._leave(rec)
        self._went_stale(rec.tier)  # its entry in the old tier's queue
        rec.tier = tier
        self.bytes[tier] += rec.nbytes
        if tier == DISK:  # a memory tier's peak is noted once over() has made room
            self._note_peak(tier)
        self.demoted[tier] += rec.nbytes
        if tier == HOST:
            self._enqueue(rec, HOST)

    def keep(self, rec: Tiered, tier: int) -> None:
        """``rec`` stays in (or returns to) memory ``tier`` for good: never demoted."""
        self._leave(rec)
        rec.tier = tier
        self._add(rec, tier)
        self._kept.add(rec.seq)

    def readmit(self, recs: list[Tiered], tier: int) -> None:
        """Cancelled demotions: ``recs`` return to the oldest end of ``tier``."""
        for rec in sorted(recs, key=lambda r: r.seq, reverse=True):
            self._leave(rec)
            self.demoted[rec.tier] -= rec.nbytes
            rec.tier = tier
            self._add(rec, tier)
            self._enqueue(rec, tier, oldest=True)

    def release(self, recs: list[Tiered]) -> None:
        """Records over() handed out that were neither moved nor kept (a demotion
        failed): back to the oldest end of their tier, oldest first, to be picked
        again. Those moved already are left alone."""
        for rec in sorted(recs, key=lambda r: r.seq, reverse=True):
            nbytes = self._leaving.pop(rec.seq, None)
            if nbytes is not None:
                self._leaving_bytes[rec.tier] -= nbytes
                self._enqueue(rec, rec.tier, oldest=True)

    def died(self, tier: int, nbytes: int, seq: int) -> None:
        """The record ``seq`` of ``tier`` died (if over() had handed it out, it is not
        leaving any more)."""
        self.bytes[tier] -= nbytes
        leaving = self._leaving.pop(seq, None)
        if leaving is not None:
            self._leaving_bytes[tier] -= leaving
        self._kept.discard(seq)
        self._went_stale(tier)
