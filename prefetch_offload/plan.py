"""The prefetch plan: in which order backward will want records, and what to read ahead.

# NOTE [lookahead]
# The plan keeps every live record in pack order (weakly: it never keeps a
# record alive). When backward unpacks a record, the records predicted to come
# next form the window; each one that needs a read and has none in flight gets
# a prefetch. The prediction is the order the previous backward unpacked the
# same records in (NOTE [learned order]); without one, it is the reverse of pack
# order, which is roughly what eager backward does.
#
# The window holds the next ``depth`` live records and is then extended to the
# end of the group (NOTE [unpack groups]) of the last of them, but never past
# ``window_bytes`` (at least one record is always taken). So in eager mode, where
# a node unpacks one to three tensors, the window is ``depth`` records, and under
# regional compilation, where each block's backward unpacks all of the block's
# saved tensors at once, it reaches to the end of the next block: that block's
# reads run during this block's backward compute.
#
# Backward order is only roughly predictable, so prefetches may outlive their
# window. While more prefetches are outstanding than twice the records the last
# window spanned (at least ``2 * depth``), the one farthest from the record
# being unpacked (the most speculative, or one backward passed over) is dropped:
# cancelled if not started, its buffer freed when the read finishes. Prefetch
# memory is thus bounded by about two windows, whatever order backward takes.
#
# NOTE [learned order]
# A step is what forward packs from the first pack after a backward until the
# next backward starts. The plan records each step's signature (the dtype, shape
# and byte size of every record, in pack order) and, during its backward, the
# order in which records were first unpacked. When the next step's backward
# starts with the same signature, that order is the prediction; a different
# signature (another sequence length, a changed model) falls back to reverse
# pack order for that step, and its own backward is recorded for the next one.
# Step 1 therefore runs on reverse order, and every repeated step from step 2
# on runs on the order its predecessor really took: regional compilation
# (forward order within a block, blocks in reverse), several losses, branches
# visited out of order.
#
# NOTE [unpack groups]
# Consecutive unpacks by one autograd node form a group: the node needs all of
# them before it computes anything. A compiled region's backward is one node, so
# its group is every tensor the region saved. One group holding most of a step's
# records means the whole model was compiled as one graph: backward then unpacks
# everything before computing anything, no order can overlap reads with compute,
# and the plan says so once, with the fix (compile each block), on the
# ``prefetch_offload`` logger.
#
# The plan has no lock of its own; the engine calls it under its lock.
"""

from __future__ import annotations

import logging
import weakref
from typing import Protocol

import torch

__all__ = ["PrefetchPlan", "Schedulable", "current_group_key"]

logger = logging.getLogger("prefetch_offload")

# A step longer than this stops being tracked for prediction (bounds the plan's
# memory when forward runs again and again without a backward).
_MAX_STEP_RECORDS = 1 << 16
# NOTE [unpack groups]: a group this large, holding this share of a step's
# unpacked records, is a whole-model compile.
_WHOLE_GRAPH_RECORDS = 16
_WHOLE_GRAPH_SHARE = 0.5

Signature = tuple[object, ...]


def current_group_key() -> int:
    """An id of the autograd node running now (0 outside backward or without support)."""
    get = getattr(torch._C, "_current_autograd_node", None)
    node = get() if get is not None else None
    return 0 if node is None else id(node) ^ (node._sequence_nr() << 1) | 1


class Schedulable(Protocol):
    """What the plan needs from a record."""

    pos: int  # set by register: position in pack order
    step: int  # set by register: the step the record was packed in
    spos: int  # set by register: position within its step

    @property
    def nbytes(self) -> int:
        """Bytes a read of the record brings into memory."""
        ...

    def needs_read(self) -> bool:
        """True when the record's bytes are not in memory and no read is in flight."""
        ...

    def drop_prefetch(self) -> None:
        """Forget (and cancel, if not started) an unconsumed prefetch."""
        ...


class _Learned:
    """A step's signature and the order its backward unpacked its records in."""

    __slots__ = ("groups", "order", "signature")

    def __init__(self, signature: tuple[Signature, ...], order: list[int], groups: list[int]):
        self.signature = signature
        self.order = order  # positions within the step, first unpack first
        self.groups = groups  # the group of each entry of order


class PrefetchPlan:
    """Pack order, the predicted unpack order, the window and the outstanding cap.

    Args:
        depth: records per window before it is extended to a group's end; 0: no prefetch.
        window_bytes: cap on a window's bytes (changeable later: ``window_bytes``).
        scan_limit: dead or ineligible entries a reverse-order scan may skip.
    """

    def __init__(self, depth: int, *, window_bytes: int = 64 << 20, scan_limit: int = 64) -> None:
        self.depth = depth
        self.window_bytes = window_bytes
        self._scan_limit = scan_limit + 8 * depth
        # Every live record in pack order, for reverse-order windows.
        self._order: list[weakref.ref[Schedulable]] = []
        self._deaths = 0  # deaths since the last compaction (may over-count a little)
        self._outstanding: dict[int, weakref.ref[Schedulable]] = {}
        self._last_span = 0  # records the last window spanned
        # The current step (NOTE [learned order]).
        self._step_no = 0
        self._step: list[weakref.ref[Schedulable]] = []
        self._sigs: list[Signature] = []
        self._tracking = True
        # Its backward, as recorded so far.
        self._seen: bytearray = bytearray()
        self._unpacked: list[int] = []
        self._groups: list[int] = []
        self._group_sizes: list[int] = []
        self._last_key = 0
        # The order learned from the previous step, and the prediction built from it.
        self._learned: _Learned | None = None
        self._pred: list[int] | None = None
        self._pred_groups: list[int] = []
        self._ppos: list[int] = []
        self.predicted_steps = 0  # steps whose backward followed a learned order
        self._warned_whole_graph = False

    # -- forward --------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A forward starts after a backward: learn from the step that just ended."""
        if self._tracking and self._unpacked:
            self._check_whole_graph()
            self._learned = _Learned(tuple(self._sigs), self._unpacked, self._groups)
        self._step_no += 1
        self._step, self._sigs, self._tracking = [], [], True
        self._reset_backward()
        self._pred = None

    def register(self, rec: Schedulable, signature: Signature) -> None:
        """Append a newly packed record; sets ``rec.pos``, ``rec.step``, ``rec.spos``."""
        if len(self._order) > 64 and 2 * self._deaths > len(self._order):
            self._compact()
        rec.pos = len(self._order)
        ref = weakref.ref(rec)
        self._order.append(ref)
        rec.step = self._step_no
        rec.spos = -1
        if self._tracking:
            if len(self._step) >= _MAX_STEP_RECORDS:
                self._tracking = False
                self._step, self._sigs = [], []
                return
            rec.spos = len(self._step)
            self._step.append(ref)
            self._sigs.append(signature)

    def forget(self) -> None:
        """Note that a registered record died."""
        self._deaths += 1

    def _compact(self) -> None:
        alive = [r for r in self._order if r() is not None]
        for i, ref in enumerate(alive):
            rec = ref()
            if rec is not None:
                rec.pos = i
        self._order = alive
        self._deaths = 0

    # -- backward -------------------------------------------------------------------------

    def begin_backward(self) -> None:
        """Backward starts after a forward: predict its order if the step repeats one."""
        self._reset_backward()
        self._pred = None
        learned = self._learned
        if not self._tracking or learned is None or learned.signature != tuple(self._sigs):
            return
        ppos = [-1] * len(self._step)
        for i, spos in enumerate(learned.order):
            ppos[spos] = i
        self._pred, self._pred_groups, self._ppos = learned.order, learned.groups, ppos
        self.predicted_steps += 1

    def _reset_backward(self) -> None:
        self._seen = bytearray(len(self._step))
        self._unpacked, self._groups, self._group_sizes = [], [], []
        self._last_key = 0

    def unpacked(self, rec: Schedulable, group_key: int) -> None:
        """Record that backward unpacked ``rec`` inside the node ``group_key`` names."""
        spos = rec.spos
        if rec.step != self._step_no or spos < 0 or not self._tracking:
            return
        seen = self._seen
        if spos >= len(seen):  # packed during this backward (double backward)
            seen.extend(bytes(spos + 1 - len(seen)))
        if seen[spos]:
            return
        seen[spos] = 1
        if group_key == 0 or group_key != self._last_key or not self._group_sizes:
            self._group_sizes.append(0)
        self._last_key = group_key
        self._group_sizes[-1] += 1
        self._unpacked.append(spos)
        self._groups.append(len(self._group_sizes) - 1)

    def _check_whole_graph(self) -> None:
        """NOTE [unpack groups]: say once if one node unpacked most of a step."""
        if self._warned_whole_graph or not self._group_sizes:
            return
        biggest = max(self._group_sizes)
        if biggest < _WHOLE_GRAPH_RECORDS or biggest < _WHOLE_GRAPH_SHARE * len(self._unpacked):
            return
        self._warned_whole_graph = True
        logger.warning(
            "prefetch_offload: one autograd node unpacked %d of the %d saved tensors of a step "
            "at once, so backward needs them all before it computes anything and no prefetch "
            "can overlap their reads with compute. This is what compiling the whole model as "
            "one graph does. Compile each block instead (for block in model.layers: "
            "block.compile()), so that each block's reads overlap the next block's backward.",
            biggest,
            len(self._unpacked),
        )

    def window(self, rec: Schedulable) -> list[Schedulable]:
        """Records to prefetch after ``rec`` is unpacked (NOTE [lookahead])."""
        if self.depth == 0:
            return []
        if (
            self._pred is not None
            and rec.step == self._step_no
            and 0 <= rec.spos < len(self._ppos)
            and self._ppos[rec.spos] >= 0
        ):
            return self._predicted_window(self._ppos[rec.spos])
        return self._reverse_window(rec)

    def _predicted_window(self, at: int) -> list[Schedulable]:
        pred, groups, step = self._pred, self._pred_groups, self._step
        assert pred is not None
        picked: list[Schedulable] = []
        seen = nbytes = 0
        group = -1
        for i in range(at + 1, len(pred)):
            if seen >= self.depth and groups[i] != group:
                break
            cand = step[pred[i]]()
            if cand is None:
                continue
            size = cand.nbytes
            if seen and nbytes + size > self.window_bytes:
                break
            seen, nbytes, group = seen + 1, nbytes + size, groups[i]
            if cand.needs_read():
                picked.append(cand)
        self._last_span = seen
        return picked

    def _reverse_window(self, rec: Schedulable) -> list[Schedulable]:
        picked: list[Schedulable] = []
        order = self._order
        pos = rec.pos
        if pos >= len(order) or order[pos]() is not rec:
            return []  # not registered (e.g. compacted away); nothing sensible to predict
        seen = nbytes = 0
        i = pos - 1
        budget = self.depth + self._scan_limit
        while i >= 0 and seen < self.depth and budget > 0:
            cand = order[i]()
            i -= 1
            budget -= 1
            if cand is None:
                continue
            size = cand.nbytes
            if seen and nbytes + size > self.window_bytes:
                break
            seen, nbytes = seen + 1, nbytes + size
            if cand.needs_read():
                picked.append(cand)
        self._last_span = seen
        return picked

    def _distance(self, a: Schedulable, b: Schedulable) -> int:
        ppos = self._ppos
        if (
            self._pred is not None
            and a.step == b.step == self._step_no
            and 0 <= a.spos < len(ppos)
            and 0 <= b.spos < len(ppos)
            and ppos[a.spos] >= 0
            and ppos[b.spos] >= 0
        ):
            return abs(ppos[a.spos] - ppos[b.spos])
        return abs(a.pos - b.pos)

    def issued(self, rec: Schedulable, anchor: Schedulable) -> None:
        """Record that ``rec`` got a prefetch while ``anchor`` was being unpacked.

        Drops the outstanding prefetches farthest from ``anchor`` while the cap
        is exceeded (NOTE [lookahead]).
        """
        out = self._outstanding
        out[id(rec)] = weakref.ref(rec)
        cap = 2 * max(self.depth, self._last_span)
        if len(out) <= cap:
            return
        live: list[tuple[int, int, Schedulable]] = []
        for key, ref in list(out.items()):
            r = ref()
            if r is None:
                del out[key]
            else:
                live.append((self._distance(r, anchor), key, r))
        live.sort(key=lambda item: item[0])
        for _, key, r in live[cap:]:
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
