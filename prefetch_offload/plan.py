"""The prefetch plan: in which order backward will want records, and what to read ahead.

# NOTE [lookahead]
# The plan keeps every live record in pack order (weakly: it never keeps a
# record alive). When backward unpacks a record, the records predicted to come
# next form the window; each one that needs a read and has none in flight gets
# a prefetch. The prediction is the order in which backward unpacked a step of
# the same structure (NOTE [learned order]); without one, it is the reverse of
# pack order, which is roughly what eager backward does.
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
# window spanned (at least ``2 * depth``), or their bytes pass twice the larger
# of ``window_bytes`` and the last window's bytes, the one farthest from the
# record being unpacked (the most speculative, or one backward passed over) is
# dropped: cancelled if not started, its buffer freed when the read finishes.
# Prefetch memory is thus bounded by about two windows, whatever order backward
# takes.
#
# NOTE [learned order]
# A step is what forward packs from the first pack after a backward until the
# next backward starts. The plan records, per step, the order in which backward
# first unpacked its records, and learns it when the next forward starts, keyed
# by the step's signature: the signature the engine gives each record (its dtype
# and number of dimensions), in pack order, over the records (and placeholders,
# below) still alive when the step's backward first unpacks one of them. When a
# later step's backward starts with a signature it has learned, that order is
# the prediction; an unknown signature (a changed model, another branch taken)
# falls back to reverse pack order for that step, and its own backward is
# learned for the next time. Step 1 therefore runs on reverse order, and every
# repeated step from step 2 on runs on the order a step of its structure really
# took: regional compilation (forward order within a block, blocks in reverse),
# several losses, branches visited out of order.
# - Sizes are not in the signature: another sequence length (dynamic padding,
#   bucketed batches) leaves the graph, and so the order, as it was. A tensor
#   kept in memory only for its size (under ``min_offload_bytes``: a causal
#   mask, per-token norm statistics) is in the signature too, as a placeholder
#   the engine registers (once per tensor, as dedup makes one record of a tensor
#   saved twice), so that one crossing the threshold as the length changes does
#   not change the structure. Its unpacks are reported like a record's, so the
#   learned order places it; where a placeholder stands in the predicted order,
#   the window passes over it, and a record in a placeholder's place is
#   prefetched there.
# - The last _LEARNED_KEPT signatures are kept, so structures that alternate
#   (two tasks, a second backward for a gradient penalty) each keep theirs.
# - Records dead before their step's backward (a forward whose graph was
#   dropped, merged into the next step) are not in it.
# - Several steps are tracked at once (_STEPS_KEPT), so a step's backward may
#   come after later forwards (pipeline schedules: F1, B0, F2, B1, ...).
# - Tensors saved during a backward neither start a step nor join one (NOTE
#   [packs inside backward] in engine.py): a reentrant checkpoint's recompute
#   stays in memory, and what a create_graph backward saves is registered in no
#   step, with reverse-order windows.
#
# NOTE [unpack groups]
# Consecutive unpacks by one autograd node form a group: the node needs all of
# them before it computes anything. A compiled region's backward is one node, so
# its group is every tensor the region saved. One group holding most of a
# step's records, with no second one of _WHOLE_GRAPH_RECORDS or more (two
# compiled blocks are two groups), means the whole model was compiled as one
# graph: backward then unpacks everything before computing anything, no order
# can overlap reads with compute, and the plan says so once, with the fix
# (compile each block), on the ``prefetch_offload`` logger.
#
# The plan has no lock of its own; the engine calls it under its lock.
"""

from __future__ import annotations

import collections
import logging
import weakref
from typing import Any, Protocol

import torch

__all__ = ["PrefetchPlan", "Schedulable", "current_group_key"]

logger = logging.getLogger("prefetch_offload")

# A step longer than this stops being tracked for prediction (bounds the plan's
# memory when forward runs again and again without a backward).
_MAX_STEP_RECORDS = 1 << 16
# NOTE [learned order]: steps tracked at once, and learned signatures kept.
_STEPS_KEPT = 8
_LEARNED_KEPT = 8
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
    """The order a step's backward unpacked its live records in."""

    __slots__ = ("groups", "order")

    def __init__(self, order: list[int], groups: list[int]) -> None:
        self.order = order  # indices into the step's live records, first unpack first
        self.groups = groups  # the group of each entry of order


class _Step:
    """One step's records and its backward as recorded so far (NOTE [learned order])."""

    __slots__ = (
        "group_sizes",
        "groups",
        "held",
        "key",
        "last_key",
        "learned_len",
        "live",
        "no",
        "placed",
        "ppos",
        "pred",
        "pred_groups",
        "refs",
        "seen",
        "sigs",
        "tracking",
        "unpacked",
    )

    def __init__(self, no: int) -> None:
        self.no = no
        # Records and placeholders (NOTE [learned order]) in pack order, their
        # signatures, and which entries are placeholders.
        self.refs: list[weakref.ref[Any]] = []
        self.sigs: list[Signature] = []
        self.held = bytearray()
        self.placed: dict[object, weakref.ref[Any]] = {}  # placeholders by memory
        self.tracking = True
        # Set at the step's first unpack: its live records (positions in the step)
        # and their signature.
        self.live: list[int] | None = None
        self.key: tuple[Signature, ...] = ()
        self.seen = bytearray()
        self.unpacked: list[int] = []  # positions in the step, first unpack first
        self.groups: list[int] = []
        self.group_sizes: list[int] = []
        self.last_key = 0
        self.learned_len = 0  # unpacks already learned
        # The prediction: positions in the step in predicted order, their groups, and
        # each position's index in that order (-1: not predicted).
        self.pred: list[int] | None = None
        self.pred_groups: list[int] = []
        self.ppos: list[int] = []

    def alive(self) -> bool:
        return any(ref() is not None for ref in self.refs)


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
        # Prefetches issued and not consumed: id -> (record, its bytes), and their total.
        self._outstanding: dict[int, tuple[weakref.ref[Schedulable], int]] = {}
        self._out_bytes = 0
        self._last_span = 0  # records the last window spanned
        self._last_bytes = 0  # and their bytes
        # NOTE [learned order]: the steps tracked, oldest first; packs go to the last.
        self._step_no = 0
        self._steps: collections.OrderedDict[int, _Step] = collections.OrderedDict()
        self._steps[0] = _Step(0)
        self._learned: collections.OrderedDict[tuple[Signature, ...], _Learned] = (
            collections.OrderedDict()
        )
        self.predicted_steps = 0  # steps whose backward followed a learned order
        self._warned_whole_graph = False

    # -- forward --------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """Packs start after unpacks: learn what backward did, and start a new step
        (NOTE [learned order])."""
        for no, st in list(self._steps.items()):
            self._learn(st)
            if not st.alive():
                del self._steps[no]
        self._step_no += 1
        self._steps[self._step_no] = _Step(self._step_no)
        while len(self._steps) > _STEPS_KEPT:
            self._steps.popitem(last=False)

    def _learn(self, st: _Step) -> None:
        """Keep what ``st``'s backward unpacked since it was last learned."""
        if not st.tracking or st.live is None or len(st.unpacked) == st.learned_len:
            return
        st.learned_len = len(st.unpacked)
        self._check_whole_graph(st)
        index = [-1] * len(st.refs)
        for k, spos in enumerate(st.live):
            index[spos] = k
        order = [index[spos] for spos in st.unpacked]
        self._learned[st.key] = _Learned(order, list(st.groups))
        self._learned.move_to_end(st.key)
        while len(self._learned) > _LEARNED_KEPT:
            self._learned.popitem(last=False)

    def register(self, rec: Schedulable, signature: Signature, *, in_step: bool = True) -> None:
        """Append a newly packed record; sets ``rec.pos``, ``rec.step``, ``rec.spos``.
        ``in_step=False``: saved during a backward, in no step's signature (NOTE
        [packs inside backward] in engine.py); its windows take reverse pack order."""
        if len(self._order) > 64 and 2 * self._deaths > len(self._order):
            self._compact()
        rec.pos = len(self._order)
        ref = weakref.ref(rec)
        self._order.append(ref)
        rec.step = self._step_no
        rec.spos = self._append(ref, signature, 0) if in_step else -1

    def placeholder(self, handle: Schedulable, signature: Signature, key: object) -> None:
        """A saved tensor kept in memory for its size alone: in the step's signature,
        never prefetched (NOTE [learned order]). ``handle`` lives as long as autograd
        holds the tensor; its unpacks are reported with :meth:`unpacked` like a
        record's. ``key`` names the tensor's memory: a second save of it in this step
        adds nothing, as a record's dedup hit does not. Sets ``handle.step`` and
        ``handle.spos`` (-1: not in the step)."""
        handle.step, handle.spos = self._step_no, -1
        st = self._steps.get(self._step_no)
        if st is None:
            return
        seen = st.placed.get(key)
        if seen is not None and seen() is not None:
            return
        handle.spos = self._append(weakref.ref(handle), signature, 1)
        if handle.spos >= 0:
            st.placed[key] = weakref.ref(handle)

    def _append(self, ref: weakref.ref[Any], signature: Signature, held: int) -> int:
        """Add an entry to the current step; its position, or -1 when untracked."""
        st = self._steps.get(self._step_no)
        if st is None or not st.tracking or st.live is not None:
            return -1  # NOTE [learned order]: in no step's signature
        if len(st.refs) >= _MAX_STEP_RECORDS:
            st.tracking = False
            st.refs, st.sigs, st.held = [], [], bytearray()
            return -1
        st.refs.append(ref)
        st.sigs.append(signature)
        st.held.append(held)
        return len(st.refs) - 1

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

    def _start(self, st: _Step) -> None:
        """``st``'s first unpack: its live records, signature and prediction."""
        refs = st.refs
        st.live = live = [i for i, ref in enumerate(refs) if ref() is not None]
        st.key = tuple(st.sigs[i] for i in live)
        st.sigs, st.placed = [], {}
        st.seen = bytearray(len(refs))
        learned = self._learned.get(st.key)
        if learned is None:
            return
        self._learned.move_to_end(st.key)
        st.pred = [live[k] for k in learned.order]
        st.pred_groups = learned.groups
        st.ppos = [-1] * len(refs)
        for i, spos in enumerate(st.pred):
            st.ppos[spos] = i
        self.predicted_steps += 1

    def unpacked(self, rec: Schedulable, group_key: int) -> None:
        """Record that backward unpacked ``rec`` inside the node ``group_key`` names."""
        spos = rec.spos
        st = self._steps.get(rec.step)
        if st is None or spos < 0 or not st.tracking:
            return
        if st.live is None:
            self._start(st)
        seen = st.seen
        if spos >= len(seen) or seen[spos]:
            return
        seen[spos] = 1
        if group_key == 0 or group_key != st.last_key or not st.group_sizes:
            st.group_sizes.append(0)
        st.last_key = group_key
        st.group_sizes[-1] += 1
        st.unpacked.append(spos)
        st.groups.append(len(st.group_sizes) - 1)

    def _check_whole_graph(self, st: _Step) -> None:
        """NOTE [unpack groups]: say once if one node unpacked most of a step."""
        if self._warned_whole_graph or not st.group_sizes:
            return
        sizes = sorted(st.group_sizes, reverse=True)
        biggest, total = sizes[0], len(st.unpacked)
        if biggest < _WHOLE_GRAPH_RECORDS or biggest < _WHOLE_GRAPH_SHARE * total:
            return
        if len(sizes) > 1 and sizes[1] >= _WHOLE_GRAPH_RECORDS:
            return  # two large regions: compiled per block already
        self._warned_whole_graph = True
        logger.warning(
            "prefetch_offload: one autograd node unpacked %d of the %d saved tensors of a step "
            "at once, so backward needs them all before it computes anything and no prefetch "
            "can overlap their reads with compute. Compiling the whole model as one graph does "
            "this (so does one custom autograd Function saving most of a step). Compile each "
            "block instead (for block in model.layers: block.compile()), so that each block's "
            "reads overlap the next block's backward.",
            biggest,
            total,
        )

    def _predicted(self, rec: Schedulable) -> tuple[_Step, int] | None:
        """``rec``'s step and its index in that step's prediction, if it has one."""
        st = self._steps.get(rec.step)
        if st is None or st.pred is None or not 0 <= rec.spos < len(st.ppos):
            return None
        at = st.ppos[rec.spos]
        return (st, at) if at >= 0 else None

    def window(self, rec: Schedulable) -> list[Schedulable]:
        """Records to prefetch after ``rec`` is unpacked (NOTE [lookahead])."""
        if self.depth == 0:
            return []
        found = self._predicted(rec)
        if found is not None:
            return self._predicted_window(*found)
        return self._reverse_window(rec)

    def _predicted_window(self, st: _Step, at: int) -> list[Schedulable]:
        pred, groups, refs = st.pred, st.pred_groups, st.refs
        assert pred is not None
        picked: list[Schedulable] = []
        seen = nbytes = 0
        group = -1
        for i in range(at + 1, len(pred)):
            if seen >= self.depth and groups[i] != group:
                break
            pos = pred[i]
            cand = refs[pos]()
            if cand is None or st.held[pos]:
                continue  # dead, or kept in memory in this step
            size = cand.nbytes
            if seen and nbytes + size > self.window_bytes:
                break
            seen, nbytes, group = seen + 1, nbytes + size, groups[i]
            if cand.needs_read():
                picked.append(cand)
        self._last_span, self._last_bytes = seen, nbytes
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
        self._last_span, self._last_bytes = seen, nbytes
        return picked

    def _distance(self, a: Schedulable, b: Schedulable) -> int:
        if a.step == b.step:
            fa, fb = self._predicted(a), self._predicted(b)
            if fa is not None and fb is not None:
                return abs(fa[1] - fb[1])
        return abs(a.pos - b.pos)

    def issued(self, rec: Schedulable, anchor: Schedulable) -> None:
        """Record that ``rec`` got a prefetch while ``anchor`` was being unpacked.

        Drops the outstanding prefetches farthest from ``anchor`` while the caps
        on records and bytes are exceeded (NOTE [lookahead]).
        """
        out = self._outstanding
        key = id(rec)
        if key in out:
            self._out_bytes -= out[key][1]
        out[key] = (weakref.ref(rec), rec.nbytes)
        self._out_bytes += rec.nbytes
        cap = 2 * max(self.depth, self._last_span)
        cap_bytes = 2 * max(self.window_bytes, self._last_bytes)
        if len(out) <= cap and self._out_bytes <= cap_bytes:
            return
        live: list[tuple[int, int, Schedulable]] = []
        for k, (ref, size) in list(out.items()):
            r = ref()
            if r is None:
                del out[k]
                self._out_bytes -= size
            else:
                live.append((self._distance(r, anchor), k, r))
        live.sort(key=lambda item: item[0])
        kept = nbytes = 0
        for _, k, r in live:
            size = out[k][1]
            if kept and (kept >= cap or nbytes + size > cap_bytes):
                del out[k]
                self._out_bytes -= size
                r.drop_prefetch()
            else:
                kept, nbytes = kept + 1, nbytes + size

    def consumed(self, rec: Schedulable) -> None:
        """Record that ``rec``'s prefetch was taken by an unpack."""
        entry = self._outstanding.pop(id(rec), None)
        if entry is not None:
            self._out_bytes -= entry[1]

    def clear(self) -> None:
        """Drop every outstanding prefetch."""
        out, self._outstanding, self._out_bytes = self._outstanding, {}, 0
        for ref, _ in out.values():
            r = ref()
            if r is not None:
                r.drop_prefetch()
