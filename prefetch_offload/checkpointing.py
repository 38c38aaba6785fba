"""Selective checkpointing whose ``*_CPU_OFFLOAD`` outputs go through the offload engine.

PyTorch's ``create_selective_checkpoint_contexts`` keeps ``*_SAVE`` outputs in
the checkpoint frame's storage and, in eager mode, recomputes ``*_CPU_OFFLOAD``
ones. :func:`selective_contexts` returns the same pair of dispatch modes (the
one forward runs under, the one the recompute runs under) with the offload
policies given their meaning: the output is packed by the engine (its target
and budgets decide where it lives) and unpacked in the recompute, so the
learned prefetch order brings it back ahead of the recompute that needs it.

# NOTE [op keys]
# An op is known by its overload and its count among the ops of that overload
# in the same checkpoint call, as torch's modes key their storage: the
# recompute replays the forward's ops in the same order, so the n-th
# ``aten.mm.default`` of the recompute is the n-th of the forward. The
# decider (a user's policy or the automatic plan) sees the block's class name
# and index (blocks.current_block) and that key.
#
# NOTE [random ops]
# An op that draws from the RNG (tagged ``nondeterministic_seeded``: dropout,
# bernoulli, rand*) advances the generator in forward. The checkpoint restores
# the RNG state before its recompute, so every random op of the recompute must
# draw again, in the same order, for a later random op to see the same state
# (and a later dropout the same mask). A random op whose output was saved or
# offloaded therefore still runs in the recompute; its result is dropped and
# the stored output returned. An attention kernel tagged so for its dropout
# does not draw when its ``dropout_p`` is 0, and is treated as any other op.
# Nor does an op given a ``torch.Generator`` of the caller's own: the checkpoint
# restores the default generators only, so running it again would advance the
# caller's generator a second time (and change every later draw from it); its
# stored output is returned without running it. Recomputing such an op draws
# other numbers, as it does under torch's own checkpoint: the automatic policy
# stores it in every plan (NOTE [keep, offload, recompute] in recompute.py).
#
# NOTE [cache entry mutation]
# A stored output that is modified in place before the recompute uses it is
# made again instead where the choice was a ``PREFER_*`` one (every choice of
# the automatic plan) of an op that writes no input: the recompute replays the
# block's ops in order, so the op's inputs there are the forward's. A
# ``MUST_*`` one, or the output of an op that writes its inputs (a buffer's
# count: running it again would count twice; NOTE [ops that write their
# inputs]), raises, as in torch's modes. allow_cache_entry_mutation=True hands
# the stored value out as it is, unchecked (the engine's own version check of
# an offloaded one too). Its version counter sees a write after the block
# returned: the saved value's, or, for an offloaded one, a probe's
# (``_Packed``). Both, and every tensor the engine keeps of the output, are
# detached inside ``__torch_dispatch__``, where a ``detach()`` shares the
# counter only under ``_sharing_counters``; without it the engine read a
# counter of its own, and a write after the block returned reached the
# recompute unseen.
# A version counter misses a change made through another tensor over the same
# memory that does not share it: ``matmul`` on a 3-d input runs ``mm`` and
# then ``_unsafe_view`` of its output, which has a counter of its own, so a
# ``mul_`` of the matmul's result changes the stored ``mm`` output unseen, and
# the recompute would apply the ``mul_`` a second time. So the forward mode
# also knows each stored output's storage (weakly: the storage object, which
# torch keeps one of per memory) and, at every op that writes an input, looks
# up the storages it writes. A stored output found there is recomputed
# instead (its stored value released) where the choice was a ``PREFER_*`` one
# (the automatic plan's are): the recompute replays the forward's ops in order,
# so making it again is always right. A ``MUST_*`` one raises at its recompute,
# as a counted change does.
#
# NOTE [ops that write their inputs]
# An in-place op (``relu_``, ``add_``, ``masked_fill_``) or an ``out=`` op that
# writes memory an earlier op of the same forward made runs again in the
# recompute, whatever a user's policy chose for it. Its output is the tensor it
# wrote, and in the recompute that tensor is the recompute's own: a stored output
# returned instead would leave it unwritten (autograd's in-place kernel hands
# back ``self``, not the returned value), and every later op of the recompute
# would see the value from before the write. Running it again costs no memory
# (its output is its input's) and moves nothing. A write to other memory (a
# module buffer such as batch norm's ``num_batches_tracked``, or the block's
# input, which the recompute gets again as the same tensor) follows the policy:
# recomputed, it applies its change a second time, as checkpointing a whole
# block does; stored, its version moved with the write itself (autograd counts
# it after the op returns), so the recompute raises unless
# ``allow_cache_entry_mutation=True``, which returns it as it is and counts the
# change once. The forward mode keeps the storages, weakly, of the new memory
# its ops made (not views). The automatic plan recomputes every op that writes an input (NOTE
# [keep, offload, recompute] in recompute.py), as checkpointing a whole block does.
#
# NOTE [autocast casts]
# Under autocast a parameter's cast (``_to_copy`` of a leaf that requires grad)
# is cached for the rest of the autocast region: a block run twice, or a weight
# cast before the block in the same region, reaches the dispatch modes in
# forward only on the first use, or not at all, while the recompute (which
# enters autocast afresh) casts again. Counted among the ``_to_copy`` calls,
# those casts would shift the keys of every later ``_to_copy`` (NOTE [op keys]):
# a missing op at best, another call's stored output at worst. So such a cast
# is neither counted nor stored, in forward and in the recompute: it runs
# (it is cheap, and the recompute needs it on any path).
#
# NOTE [dispatch cost]
# In a pass the decider times (``timing()`` when the mode is entered: the
# profiling steps), each mode times its ``__torch_dispatch__`` from entry to
# return, less the wrapped op's own call (on CUDA, a forward op's synchronize
# is the op's), and tells the decider the sum when the block's pass through it
# ends. That is the Python the modes add per op (the decider's call, the
# storage, the output trees); the switch into Python before
# ``__torch_dispatch__`` runs is not in it. The sum of many short spans is
# steady where the difference of two block times is not (NOTE [keep, offload,
# recompute] in recompute.py). Other passes time nothing: an op costs the
# modes one flag test more than its dispatch.
#
# NOTE [plain blocks counted]
# A block checkpointed whole (``recompute="full"``) stores no op output: its
# recompute makes every one again. Its forward runs under a mode that only
# adds up each op's output bytes, counted as recomputed (as the selective
# modes count a recomputed output), so ``step_bytes_recomputed`` means the same
# in every mode; its recompute context marks the step's end. The mode costs the
# switch into Python per op (on the 8-layer Llama of ``bench/recompute.py``,
# about 70 ops a layer, 2 CPU threads: no difference above the noise, fastest
# steps 1.140 / 1.139 s counted every call against 1.110 / 1.164 s not; on a
# GPU that launches small kernels it would be a share of the forward), so a
# block and call signature (its arguments' shapes, dtypes and devices, plain
# scalars, and the autocast state) is counted once and its sum reused, the 4096
# used last kept: a new sequence length counts once more. Ops that change with
# the data alone, or with the module's training flag, are not seen again.
# The automatic plan's plain blocks are counted the same way (its planned
# steps run them with these contexts).
#
# NOTE [counted at the recompute]
# A checkpointed call's forward adds up its bytes kept, offloaded and
# recomputed in a tally of its own, and the stats count the tally when the
# call's recompute begins, once, in the step running then: the automatic
# plan's step where it says when steps begin, else the one that the first
# count after a checkpointed forward (outside backward) began. A forward that
# no backward follows (one that raised, or whose loss was dropped: an
# evaluation with grad on) then counts nothing, where counting in forward
# would add it to the next step's figures; a graph kept for a second backward
# counts once (the second pass leaves the figures of the first); a forward
# replayed by an outer checkpoint's recompute counts where its own recompute
# runs; and a call whose output the loss does not use counts in no step (what
# it offloaded shows in the tier figures). A step's figures are complete once
# its backward has recomputed every call; with gradient accumulation they
# cover the forwards since the last backward. A call replayed inside backward
# counts in the step of its backward pass: under a reentrant outer checkpoint,
# whose forward runs the blocks without grad, every checkpointed forward is a
# replay, and each of its backward passes counts as a step of its own (the
# figures are the last one's).
"""

from __future__ import annotations

import collections
import functools
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from .blocks import _graph_task_id, current_block, current_call, in_backward
from .errors import OffloadError
from .packed import view_span
from .records import version_probe
from .streams import capturing

__all__ = [
    "OFFLOAD",
    "RECOMPUTE",
    "SAVE",
    "CheckpointStats",
    "Decider",
    "OffloadHooks",
    "PlainCounts",
    "PolicyDecider",
    "as_policy",
    "draws_own_generator",
    "draws_random",
    "graph_kept",
    "op_kind",
    "output_aliases",
    "output_bytes",
    "plain_contexts",
    "selective_contexts",
]

SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
OFFLOAD = (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD)

_IGNORED: frozenset[Any] = frozenset(
    getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default})
)
_SEEDED = torch.Tag.nondeterministic_seeded

# (block class, block index, op overload, count): NOTE [op keys].
OpKey = tuple[str, int, Any, int]


def as_policy(policy: Any) -> Callable[..., CheckpointPolicy]:
    """``policy`` as a callable with PyTorch's signature ``policy(ctx, op, *args,
    **kwargs) -> CheckpointPolicy``: a callable as it is, a list of op overloads as
    theirs saved and the rest recomputed (``checkpoint_context_fn``'s contract).

    Raises:
        TypeError: neither, or a list holding something other than an OpOverload.
    """
    if isinstance(policy, list):
        ops = list(policy)
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(
                    f"prefetch_offload: the ops to save must be OpOverloads, got {op!r}; "
                    "e.g. torch.ops.aten.mm.default rather than torch.ops.aten.mm."
                )

        def saves(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

        return saves
    if not callable(policy):
        raise TypeError(
            "prefetch_offload: checkpoint_context_fn needs a policy callable "
            f"policy(ctx, op, *args, **kwargs) or a list of ops, got {type(policy).__name__}."
        )
    return policy


def op_kind(func: Any) -> str:
    """A readable name for an op overload, e.g. ``"aten.mm.default"``."""
    return str(func)


def draws_random(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of ``func`` draws from the RNG the checkpoint restores (NOTE
    [random ops]): tagged ``nondeterministic_seeded``, given no ``generator`` of the
    caller's own, and not an op whose ``dropout_p`` is 0 (attention kernels carry the
    tag for their dropout)."""
    if _SEEDED not in func.tags:
        return False
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            return bool(kwargs.get(arg.name, args[i] if i < len(args) else arg.default_value))
        if arg.name == "generator":
            return kwargs.get(arg.name, args[i] if i < len(args) else None) is None
    return True


def draws_own_generator(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of ``func`` draws from a ``torch.Generator`` given to it, whose
    state no checkpoint restores (NOTE [random ops])."""
    if _SEEDED not in func.tags:
        return False
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "generator":
            return kwargs.get("generator", args[i] if i < len(args) else None) is not None
    return False


def output_bytes(out: Any) -> int:
    """Bytes of the tensors in an op's output (a tensor, or a tree of them)."""
    return sum(
        x.numel() * x.element_size()
        for x in torch.utils._pytree.tree_leaves(out)
        if isinstance(x, torch.Tensor)
    )


_TO_COPY = torch.ops.aten._to_copy.default


def _plain(x: Any) -> bool:
    """A strided tensor of torch's own with memory to compare (a wrapper subclass such
    as DTensor has none of its own: its version counter is what sees a change)."""
    return (
        isinstance(x, torch.Tensor)
        and (type(x) is torch.Tensor or isinstance(x, torch.nn.Parameter))
        and x.layout == torch.strided
    )


def _cached_cast(func: Any, args: Any) -> bool:
    """A cast autocast may have cached (NOTE [autocast casts])."""
    if func is not _TO_COPY or not args:
        return False
    x = args[0]
    return isinstance(x, torch.Tensor) and x.is_leaf and x.requires_grad


def _sharing_counters() -> Any:
    """Inside ``__torch_dispatch__``, a ``detach()`` shares the version counter only
    under this guard (as torch's modes detach): the engine's detaches too, or its
    version check would read a counter of its own (NOTE [version check] in records.py)."""
    return torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False)


def _detach(x: Any) -> Any:
    # A view op's output is detached beneath autograd so that the recompute's as_view
    # sees no autograd metadata and the version counter is shared (as torch's modes).
    if isinstance(x, torch.Tensor):
        with _sharing_counters():
            return x.detach()
    return x


class OffloadHooks(Protocol):
    """The engine's side: pack an output away, unpack it for the recompute."""

    def pack_output(self, t: torch.Tensor, *, must: bool, checked: bool = True) -> Any: ...

    def unpack_output(self, packed: Any) -> torch.Tensor: ...


class Decider(Protocol):
    """Chooses keep / recompute / offload for each op output (NOTE [op keys])."""

    def decide(
        self, key: OpKey, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> CheckpointPolicy: ...

    def timing(self) -> bool:
        """Whether the modes time the pass that begins now (a profiling step): each op
        in forward (``observe``), and their own dispatch (``dispatched``)."""
        ...

    def observe(self, key: OpKey, func: Any, out: Any, seconds: float, policy: Any) -> None: ...

    def recomputing(self) -> None:
        """A checkpoint's recompute begins (the step's backward has started)."""
        ...

    def consumed(self, key: OpKey) -> None: ...

    def dispatched(self, block: tuple[str, int], seconds: float) -> None:
        """One pass of ``block`` through a mode (its forward, or its recompute) ended; it
        spent ``seconds`` in the mode's ``__torch_dispatch__`` beyond its ops' own calls
        (NOTE [dispatch cost])."""
        ...

    def overruled(self, key: OpKey, func: Any, out: Any, policy: CheckpointPolicy) -> None:
        """The op ``decide`` just answered ``policy`` for runs again in the recompute
        instead (NOTE [ops that write their inputs])."""
        ...


class PolicyDecider:
    """A user's policy with PyTorch's signature ``policy(ctx, op, *args, **kwargs)``."""

    def __init__(self, policy: Callable[..., Any]) -> None:
        self.policy = policy

    def decide(
        self, key: OpKey, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> CheckpointPolicy:
        ctx = SelectiveCheckpointContext(is_recompute=False, op_output=out)
        policy = self.policy(ctx, func, *args, **kwargs)
        if isinstance(policy, bool):  # torch accepts a bool: True saves
            return CheckpointPolicy.MUST_SAVE if policy else CheckpointPolicy.PREFER_RECOMPUTE
        if not isinstance(policy, CheckpointPolicy):
            raise TypeError(
                f"prefetch_offload: the recompute policy returned {policy!r} for {func}; it "
                "must return a torch.utils.checkpoint.CheckpointPolicy (or a bool)."
            )
        return policy

    def timing(self) -> bool:
        return False

    def observe(self, key: OpKey, func: Any, out: Any, seconds: float, policy: Any) -> None:
        pass

    def recomputing(self) -> None:
        pass

    def consumed(self, key: OpKey) -> None:
        pass

    def dispatched(self, block: tuple[str, int], seconds: float) -> None:
        pass

    def overruled(self, key: OpKey, func: Any, out: Any, policy: CheckpointPolicy) -> None:
        pass


class CheckpointStats:
    """Bytes of checkpointed op outputs kept, offloaded and recomputed, per step.

    A call's bytes count when its recompute begins (NOTE [counted at the recompute]),
    in the step running then: the automatic plan's step where it says when steps
    begin (:meth:`step_began`), else the one the first count after a checkpointed
    forward outside backward began (a call replayed inside backward: its backward
    pass).
    """

    def __init__(self) -> None:
        self.current = [0, 0, 0]  # kept, offloaded, recomputed
        self._key: tuple[str, int] | None = None  # the step ``current`` counts
        self._step = 0  # the automatic plan's step now
        self._stepped = False  # whether the plan says when steps begin
        self._ended = -1  # the last step whose backward ended (step_ended)
        self._fresh = False  # a checkpointed forward outside backward since the last count

    def forward_began(self) -> None:
        """A checkpointed call's forward begins outside backward: the next count of such
        a call begins a step."""
        self._fresh = True

    def step_began(self) -> None:
        self._step += 1
        self._stepped = True

    def step_ended(self) -> None:
        """The step now has finished its backward (the automatic plan says so): a step
        that counted nothing, as a step of whole blocks, is the last step now."""
        self._ended = self._step

    def recompute_began(self, tally: list[int]) -> None:
        """A checkpointed call's recompute begins: what its forward counted (``tally``:
        kept, offloaded and recomputed bytes, then 1 for a forward replayed inside
        backward) is the running step's now, once."""
        if not any(tally[:3]):
            return  # (counted already: a kept graph's next backward)
        if self._stepped:
            key = ("step", self._step)
            new = key != self._key
        else:  # (a replayed call's step is its backward pass: under a reentrant outer
            key = ("pass", _graph_task_id())  # checkpoint, every call is replayed)
            new = key != self._key if tally[3] else self._fresh
        if new:
            self.current = [0, 0, 0]
        self._key, self._fresh = key, False
        for which in range(3):
            self.current[which] += tally[which]
            tally[which] = 0

    def last_step(self) -> tuple[int, int, int]:
        """(kept, offloaded, recomputed) of the last step: the running one once a
        recompute in it began, else the one before it (a step that counted nothing:
        zeros); without steps from the plan, the last that counted."""
        if self._stepped and self._key != ("step", self._step):
            if self._ended == self._step or self._key != ("step", self._step - 1):
                return 0, 0, 0
        kept, offloaded, recomputed = self.current
        return kept, offloaded, recomputed


# Whether the running backward keeps its graph (NOTE [packs inside backward] in engine.py).
graph_kept: Callable[[], bool] = getattr(
    torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True
)
_RECOMPUTE = object()
_CONSUMED = object()
_MISMATCH = (
    "The ops of a checkpointed block ran differently in its recompute than in its "
    "forward (a data-dependent branch, or global state that changed in between)."
)


class _Entry:
    __slots__ = ("changed", "mode", "must", "nbytes", "value", "versions")

    def __init__(self, mode: int, value: Any, versions: Any, must: bool, nbytes: int) -> None:
        self.mode = mode  # 0 saved, 1 offloaded
        self.value = value
        self.versions = versions
        self.must = must  # a MUST_* policy: never recomputed instead
        self.nbytes = nbytes
        self.changed = False  # NOTE [cache entry mutation]: written in forward since


_WRITES: dict[Any, tuple[int, ...] | None] = {}


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op writes (its arguments marked ``(a!)`` in its schema)."""
    where = _WRITES.get(func, ())
    if where == ():
        schema = func._schema
        marked = tuple(
            i
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        where = _WRITES[func] = marked or None
    if where is None:
        return []
    names = func._schema.arguments
    values = [args[i] if i < len(args) else kwargs.get(names[i].name) for i in where]
    return [x for x in torch.utils._pytree.tree_leaves(values) if isinstance(x, torch.Tensor)]


# Ops whose output shares its input's memory with no alias in their schema (matmul's
# reshape of its mm output).
_UNMARKED_ALIASES = frozenset({torch.ops.aten._unsafe_view.default})
_ALIASES: dict[Any, bool] = {}


def output_aliases(func: Any) -> bool:
    """Whether an op's output is an input's memory, not new memory: a view, an input
    written in place or ``out=``, or matmul's ``_unsafe_view`` (unmarked)."""
    aliases = _ALIASES.get(func)
    if aliases is None:
        schema = func._schema
        aliases = _ALIASES[func] = bool(
            getattr(func, "is_view", False)
            or func in _UNMARKED_ALIASES
            or schema.is_mutable
            or any(r.alias_info is not None for r in schema.returns)
        )
    return aliases


class _Mode(TorchDispatchMode):
    """What both modes of one checkpoint call share: the storage, keyed by op (NOTE [op
    keys]), the decider, the engine's hooks and the stats."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(
        self,
        decider: Decider,
        hooks: OffloadHooks | None,
        storage: dict[Any, Any],
        stats: CheckpointStats,
        tally: list[int],
    ) -> None:
        super().__init__()
        self.decider = decider
        self.hooks = hooks
        self.storage = storage
        self.stats = stats
        # The call's bytes kept, offloaded and recomputed, counted by its forward and
        # handed to the stats as its recompute begins (NOTE [counted at the recompute]).
        self.tally = tally  # (and 1 at its end for a forward replayed inside backward)
        self.counts: collections.Counter[Any] = collections.Counter()
        # NOTE [dispatch cost]: seconds in __torch_dispatch__, and in the ops it called,
        # in a pass the decider times (``timing()`` when the pass began).
        self.timed = False
        self.spent = 0.0
        self.op_seconds = 0.0

    def _block(self) -> tuple[str, int]:
        raise NotImplementedError

    def _dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def __enter__(self) -> _Mode:
        # NOTE [dispatch cost]: timed only in a pass the decider measures.
        self.timed = self.decider.timing()
        self.spent = self.op_seconds = 0.0
        return super().__enter__()  # type: ignore[no-any-return]

    def _call(self, func: Any, args: Any, kwargs: dict[str, Any], sync: bool = False) -> Any:
        """Run the op; in a timed pass, add its own time (with ``sync``, its CUDA
        kernels') to op_seconds."""
        if not self.timed:
            return func(*args, **kwargs)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if sync:
            _sync(out)
        self.op_seconds += time.perf_counter() - start
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.timed:
            return self._dispatch(func, args, kwargs or {})
        start = time.perf_counter()
        try:
            return self._dispatch(func, args, kwargs or {})
        finally:
            self.spent += time.perf_counter() - start

    def __exit__(self, *exc: Any) -> Any:
        # Off the dispatch stack first: an interrupt in the decider's call (NOTE
        # [interrupts] in io_pool.py) must not leave the mode on for every later op.
        out = super().__exit__(*exc)
        if self.timed:  # (__enter__ zeroes both sums for the next pass)
            self.decider.dispatched(self._block(), max(self.spent - self.op_seconds, 0.0))
        return out


class _Saving(_Mode):
    """Forward: run each op, then keep, offload or mark for recompute its output."""

    def __init__(
        self,
        decider: Decider,
        hooks: OffloadHooks | None,
        storage: dict[Any, Any],
        stats: CheckpointStats,
        tally: list[int],
        allow_cache_entry_mutation: bool = False,
    ) -> None:
        super().__init__(decider, hooks, storage, stats, tally)
        self.allow_mutation = allow_cache_entry_mutation
        self.block = current_block() or ("", -1)
        # NOTE [cache entry mutation]: storage address -> (the storage, weakly, the key
        # of a stored output over it).
        self.memory: dict[int, list[tuple[weakref.ref[Any], int, int, Any]]] = {}
        # NOTE [ops that write their inputs]: storage address -> the storages, weakly,
        # of new memory ops of this forward made (their outputs, not views).
        self.produced: dict[int, list[weakref.ref[Any]]] = {}

    def _block(self) -> tuple[str, int]:
        return self.block

    def __enter__(self) -> _Saving:
        replayed = in_backward()  # before the push: nothing that may raise after it
        self.tally[3] = int(replayed)
        if not replayed:
            self.stats.forward_began()
        super().__enter__()
        if replayed:  # a forward replayed by an outer checkpoint's recompute (NOTE
            self.timed = False  # [block modes]): not the step's forward
        return self

    def _remember(self, key: Any, out: Any) -> None:
        for x in torch.utils._pytree.tree_leaves(out):
            if _plain(x):
                storage = x.untyped_storage()
                start, nbytes = view_span(x)
                entries = self.memory.setdefault(storage.data_ptr(), [])
                entries.append((weakref.ref(storage), start, start + nbytes, key))

    def _made_here(self, written: list[torch.Tensor]) -> bool:
        """Whether an op of this forward made the memory of a tensor in ``written`` (NOTE
        [ops that write their inputs])."""
        for t in written:
            if _plain(t):
                storage = t.untyped_storage()
                for ref in self.produced.get(storage.data_ptr(), ()):
                    if ref() is storage:
                        return True
        return False

    def _note_made(self, func: Any, out: Any) -> None:
        if output_aliases(func):
            return
        for x in torch.utils._pytree.tree_leaves(out):
            if _plain(x):
                storage = x.untyped_storage()
                self.produced.setdefault(storage.data_ptr(), []).append(weakref.ref(storage))

    def _writes(self, written: list[torch.Tensor]) -> None:
        """NOTE [cache entry mutation]: a stored output whose bytes this op writes is
        recomputed instead, or (``MUST_*``) raises at its recompute."""
        for t in written:
            if not _plain(t):
                continue
            storage = t.untyped_storage()
            start, nbytes = view_span(t)
            for ref, lo, hi, key in self.memory.get(storage.data_ptr(), ()):
                entry = self.storage.get(key)
                if ref() is not storage or not isinstance(entry, _Entry):
                    continue
                if start >= hi or start + nbytes <= lo:
                    continue  # another part of the same memory
                if entry.must:
                    entry.changed = True
                else:  # its value (an engine record too) goes now
                    self.storage[key] = _RECOMPUTE
                    self.tally[entry.mode] -= entry.nbytes
                    self.tally[2] += entry.nbytes

    def _dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if func in _IGNORED or _cached_cast(func, args):  # NOTE [autocast casts]
            return self._call(func, args, kwargs)
        written = _written(func, args, kwargs)
        if written and self.memory:
            self._writes(written)
        before = self.op_seconds
        out = self._call(func, args, kwargs, sync=True)
        seconds = self.op_seconds - before
        count = self.counts[func]
        self.counts[func] = count + 1
        key: OpKey = (self.block[0], self.block[1], func, count)
        policy = self.decider.decide(key, func, args, kwargs, out)
        if written and policy not in RECOMPUTE and self._made_here(written):
            # NOTE [ops that write their inputs]: it runs again in the recompute.
            self.decider.overruled(key, func, out, policy)
            policy = CheckpointPolicy.PREFER_RECOMPUTE
        self._note_made(func, out)
        nbytes = output_bytes(out)
        if self.timed:
            self.decider.observe(key, func, out, seconds, policy)
        if policy in OFFLOAD and self.hooks is not None:
            must = policy is CheckpointPolicy.MUST_CPU_OFFLOAD
            hooks, checked = self.hooks, not self.allow_mutation
            with _sharing_counters():  # NOTE [cache entry mutation]: a later write is seen
                value = tree_map(
                    lambda x: (
                        _Packed(hooks.pack_output(x.detach(), must=must, checked=checked), x)
                        if isinstance(x, torch.Tensor)
                        else x
                    ),
                    out,
                )
            self.storage[(func, count)] = _Entry(1, value, None, must, nbytes)
            self._remember((func, count), out)
            self.tally[1] += nbytes
        elif policy in SAVE or policy in OFFLOAD:  # offload with no engine: kept
            value = tree_map(_detach, out)
            versions = tree_map(
                lambda x: x._version if isinstance(x, torch.Tensor) else None, value
            )
            must = policy in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_CPU_OFFLOAD)
            self.storage[(func, count)] = _Entry(0, value, versions, must, nbytes)
            self._remember((func, count), out)
            self.tally[0] += nbytes
        else:
            self.storage[(func, count)] = _RECOMPUTE
            self.tally[2] += nbytes
        return out


def _sync(out: Any) -> None:
    """Wait for a CUDA op's kernels (a profiling step times ops one by one)."""
    for x in torch.utils._pytree.tree_leaves(out):
        if isinstance(x, torch.Tensor) and x.is_cuda:
            if not capturing(x.device):  # NOTE [capture mode]: a sync would end it
                torch.cuda.synchronize(x.device)
            return


class _Restoring(_Mode):
    """Recompute: return stored outputs, run the ops marked for recompute."""

    def __init__(
        self,
        decider: Decider,
        hooks: OffloadHooks | None,
        storage: dict[Any, Any],
        stats: CheckpointStats,
        tally: list[int],
        block: Callable[[], tuple[str, int]],
        allow_cache_entry_mutation: bool,
    ) -> None:
        super().__init__(decider, hooks, storage, stats, tally)
        self.block = block
        self.allow_mutation = allow_cache_entry_mutation

    def __enter__(self) -> _Restoring:
        self.counts.clear()
        self.stats.recompute_began(self.tally)
        self.decider.recomputing()
        return super().__enter__()  # type: ignore[no-any-return]

    def _block(self) -> tuple[str, int]:
        return self.block()

    def _dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if func in _IGNORED or _cached_cast(func, args):  # NOTE [autocast casts]
            return self._call(func, args, kwargs)
        count = self.counts[func]
        self.counts[func] = count + 1
        entry = self.storage.get((func, count))
        if entry is None:
            raise OffloadError(
                f"prefetch_offload: {func} (call {count}) ran in a checkpoint's recompute but "
                f"not in its forward. {_MISMATCH}"
            )
        if entry is _CONSUMED:
            raise OffloadError(
                f"prefetch_offload: a selectively checkpointed block was recomputed a second "
                f"time, and the output of {func} it stored went with the first: pass "
                "retain_graph=True to every backward but the last through it, and let the "
                "policy offload that output (*_CPU_OFFLOAD) rather than keep it in memory "
                "(*_SAVE), which serves one recompute only."
            )
        if entry is _RECOMPUTE:
            return self._call(func, args, kwargs)
        if entry.mode == 0 or not graph_kept():  # let go once used; an offloaded one
            self.storage[(func, count)] = _CONSUMED  # stays for a second backward where
            # this one keeps the graph (retain_graph=True), as the engine's records do
        block = self.block()
        self.decider.consumed((block[0], block[1], func, count))
        drawn = None
        if draws_random(func, args, kwargs):  # NOTE [random ops]
            drawn = self._call(func, args, kwargs)
        if entry.changed and not self.allow_mutation:  # NOTE [cache entry mutation]
            raise OffloadError(
                f"prefetch_offload: the output of {func} kept by a selective checkpoint "
                "(a MUST_* policy) was modified in place later in the forward (directly, or "
                "through a tensor over the same memory); let the policy return PREFER_* for "
                "it (it is then recomputed), or pass allow_cache_entry_mutation=True."
            )
        if entry.mode == 1:
            hooks = self.hooks
            assert hooks is not None
            leaves = torch.utils._pytree.tree_leaves(entry.value)
            if not self.allow_mutation and any(  # NOTE [cache entry mutation]
                isinstance(x, _Packed) and x.changed() for x in leaves
            ):
                return self._instead(func, args, kwargs, entry, drawn, "offloaded")
            with _sharing_counters():
                return tree_map(
                    lambda x: hooks.unpack_output(x.handle) if isinstance(x, _Packed) else x,
                    entry.value,
                )
        if not self.allow_mutation:  # NOTE [cache entry mutation]
            for x, v in zip(
                torch.utils._pytree.tree_leaves(entry.value),
                torch.utils._pytree.tree_leaves(entry.versions),
                strict=False,
            ):
                if isinstance(x, torch.Tensor) and x._version != v:
                    return self._instead(func, args, kwargs, entry, drawn, "saved")
        return entry.value

    def _instead(
        self, func: Any, args: Any, kwargs: dict[str, Any], entry: _Entry, drawn: Any, how: str
    ) -> Any:
        """A stored output changed since it was stored (written after its block
        returned): made again where the choice was a ``PREFER_*`` one of an op that
        writes no input, else the checkpoint raises (NOTE [cache entry mutation])."""
        if entry.must or func._schema.is_mutable:
            raise _modified(func, how)
        return drawn if drawn is not None else self._call(func, args, kwargs)


def _modified(func: Any, how: str) -> OffloadError:
    return OffloadError(
        f"prefetch_offload: the output of {func} {how} by a selective checkpoint was "
        "modified in place before its recompute; do not modify it, or pass "
        "allow_cache_entry_mutation=True."
    )


class PlainCounts:
    """Op output bytes of a block checkpointed whole, per block and call signature
    (NOTE [plain blocks counted]); the ``limit`` used last are kept."""

    def __init__(self, limit: int = 4096) -> None:
        self._bytes: collections.OrderedDict[Any, int] = collections.OrderedDict()
        self._limit = limit

    @staticmethod
    def key() -> Any:
        """The block running now, its call's signature and the autocast state (None
        outside a block)."""
        block, call = current_block(), current_call()
        if block is None or call is None:
            return None
        leaves = torch.utils._pytree.tree_leaves(call)
        autocast = tuple(
            (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
        )
        return (block, tuple(_leaf_signature(x) for x in leaves), autocast)

    def get(self, key: Any) -> int | None:
        if key is None or key not in self._bytes:
            return None
        self._bytes.move_to_end(key)
        return self._bytes[key]

    def put(self, key: Any, nbytes: int) -> None:
        if key is None:
            return
        self._bytes[key] = nbytes
        self._bytes.move_to_end(key)
        while len(self._bytes) > self._limit:
            self._bytes.popitem(last=False)


def _leaf_signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.device.type)
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return type(x).__name__


class _Counting(TorchDispatchMode):
    """A plainly checkpointed block's forward, the first time its signature runs: adds
    up its op outputs, all of which the recompute makes again, and counts them as
    recomputed (NOTE [plain blocks counted])."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, tally: list[int], counts: PlainCounts, key: Any) -> None:
        super().__init__()
        self.tally = tally
        self.counts = counts
        self.key = key
        self.nbytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func not in _IGNORED:
            self.nbytes += output_bytes(out)
        return out

    def __exit__(self, *exc: Any) -> Any:
        try:
            if exc[0] is None:
                self.tally[2] += self.nbytes
                self.counts.put(self.key, self.nbytes)
        except BaseException:
            super().__exit__(*exc)  # off the dispatch stack whatever happens
            raise
        return super().__exit__(*exc)


class _OnEnter:
    """A context that only calls ``call`` when entered."""

    def __init__(self, call: Callable[[], None]) -> None:
        self.call = call

    def __enter__(self) -> None:
        self.call()

    def __exit__(self, *exc: Any) -> None:
        return None


def plain_contexts(
    stats: CheckpointStats, counts: PlainCounts
) -> tuple[TorchDispatchMode | _OnEnter, _OnEnter]:
    """The (forward, recompute) contexts of a block checkpointed whole (``recompute=
    "full"``): nothing stored; the forward's op outputs counted as recomputed, by a
    mode the first time the block's call signature runs, else from that count (NOTE
    [plain blocks counted]), handed to the stats as the recompute begins (NOTE
    [counted at the recompute])."""
    key = counts.key()
    known = counts.get(key)
    replayed = in_backward()  # (a forward replayed by an outer checkpoint's recompute)
    tally = [0, 0, known or 0, int(replayed)]
    if not replayed:
        stats.forward_began()
    forward = _OnEnter(lambda: None) if known is not None else _Counting(tally, counts, key)
    return forward, _OnEnter(functools.partial(stats.recompute_began, tally))


class _Packed:
    """An output tensor packed by the engine (a leaf of the stored output tree), and
    its version then, read through a probe that shares its counter (NOTE [cache entry
    mutation]; None where the tensor type refuses one)."""

    __slots__ = ("handle", "probe", "version")

    def __init__(self, handle: Any, t: torch.Tensor) -> None:
        self.handle = handle
        # (under _sharing_counters; a wrapper's version the engine checks: NOTE
        # [wrapper subclasses] in records.py)
        self.probe = version_probe(t) if _plain(t) else None
        self.version = t._version

    def changed(self) -> bool:
        return self.probe is not None and self.probe._version != self.version


def selective_contexts(
    decider: Decider,
    hooks: OffloadHooks | None,
    stats: CheckpointStats,
    *,
    allow_cache_entry_mutation: bool = False,
) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The (forward, recompute) contexts for one ``torch.utils.checkpoint`` call."""
    storage: dict[Any, Any] = {}
    tally = [0, 0, 0, 0]  # NOTE [counted at the recompute]
    saving = _Saving(decider, hooks, storage, stats, tally, allow_cache_entry_mutation)
    restoring = _Restoring(
        decider, hooks, storage, stats, tally, lambda: saving.block, allow_cache_entry_mutation
    )
    return saving, restoring
