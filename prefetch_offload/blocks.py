"""Finding a model's repeated blocks and checkpointing them, restored exactly afterwards.

This module knows nothing of tiers or of the engine: it wraps each block's
``forward`` in a non-reentrant :func:`torch.utils.checkpoint.checkpoint` with a
``context_fn`` it is given, and puts the model back as it was.

# NOTE [block detection]
# Blocks are found as Hugging Face finds its shard units: the classes named in
# ``_no_split_modules`` of the model (or of any submodule that declares it, so
# a DDP- or PEFT-wrapped model works too), matched along each module's class
# hierarchy (FSDP2's ``fully_shard`` gives a sharded block a subclass of its
# class, ``FSDPLlamaDecoderLayer``). Without that list, the blocks are the
# longest run of consecutive children of one class inside an ``nn.ModuleList``
# or ``nn.Sequential`` anywhere in the tree (the decoder layers of nearly every
# architecture); a run inside a member of another run (the experts of one
# mixture-of-experts layer) does not count. ``recompute_blocks`` overrides
# both: module classes, or qualified names as ``named_modules()`` gives them; a
# module with no forward of its own (the ``nn.ModuleList`` holding the blocks)
# is refused there, as nothing calls it. A block nested in another block is not
# wrapped on its own (its outer block's checkpoint covers it).
#
# NOTE [wrapping blocks]
# Each block gets an instance attribute ``forward`` that runs the class's
# forward under the checkpoint; ``nn.Module.__call__`` (and with it every
# forward hook, FSDP2's all-gathers, DDP's and a compiled module's wrapper) is
# untouched, so parameter names, state dicts and hooks stay the same. On
# restore the attribute is deleted again, or set back when the block had an
# instance ``forward`` of its own. A deep copy of the model taken meanwhile (an
# EMA, a reference model) gets its blocks' own forwards, not the wrapper, which
# would run the original blocks, and so does a model pickled meanwhile
# (``torch.save(model)``; loading it needs nothing of this library). A shallow
# copy of a block (``copy.copy``, ``nn.DataParallel``'s replicas) shares its
# instance dictionary, and with it the wrapper: it runs the original block.
# The block's keyword arguments are bound before ``checkpoint`` sees them,
# which would take the names it shares with them. Hugging Face's own gradient
# checkpointing wraps the same blocks around ``__call__``; a block that has it
# switched on is refused at its forward (NOTE [double checkpointing]).
#
# NOTE [double checkpointing]
# Hugging Face's ``gradient_checkpointing`` (``TrainingArguments`` or
# ``gradient_checkpointing_enable()``; transformers 5 also names it
# ``activation_checkpointing``) checkpoints each decoder layer itself. Composing
# the two would checkpoint every block twice: two recomputes in backward for no
# memory gained. So a wrapped block whose ``gradient_checkpointing`` attribute
# is true raises at its forward, with what to change. The Trainer switches it
# on inside ``train()``, after the context is entered, so the check runs at
# forward time, not at enter.
#
# NOTE [reparametrized blocks]
# ``torch.func.functional_call(model, params, ...)`` puts other tensors in the
# modules' parameter and buffer slots for the call and the originals back as it
# returns, before backward. A checkpoint's recompute runs the block again in
# backward, and would read the originals: a wrong gradient, unseen (as with
# ``torch.utils.checkpoint`` inside a functional call, but here the wrapping
# chose the checkpoint). So each checkpointed call notes the tensor in every
# slot of the block, and a recompute that finds another one there runs with the
# noted ones put back for its duration, as autograd without a checkpoint would
# use the forward's own. (FSDP2 puts the same unsharded parameter objects back
# for backward, so nothing is swapped there.) Not while compiling: the noting
# would be traced.
#
# NOTE [cached prompts]
# A block called with a key/value cache (``past_key_values`` given to a
# forward with grad: a cached prompt scored in training) appends its keys to
# that cache in forward, and a recompute would append them again (a shape
# error in backward, or attention over twice the keys). Hugging Face's own
# checkpointing drops such a cache, which changes the result; here the block
# runs whole instead (not checkpointed: what it saves goes through the hooks
# as without ``recompute``), and the gradients are those of training without
# the library. NOTE [kv cache] in kv_cache.py turns the cache off where the
# caller only asks for one (``use_cache``).
#
# NOTE [compiled blocks]
# A block compiled on its own (``block.compile()``, regional compilation) runs
# its forward inside the compiled graph, where ops are fused and no dispatch
# mode sees them one by one; there the checkpoint is traced by the compiler,
# which applies a policy's save and recompute choices itself. So while
# torch.compile traces a block, the wrapper uses a second ``context_fn`` the
# caller gives (``compiled``), or none at all (``SKIP``): the engine then
# offloads what the compiled graph saves, as without ``recompute``.
#
# NOTE [block modes]
# A caller may choose, per block and per call, how the block runs
# (:class:`BlockModes`): ``SELECTIVE`` (the checkpoint with the ``context_fn``:
# its dispatch modes see every op), ``PLAIN`` (``torch.utils.checkpoint``
# without a ``context_fn``: the block is recomputed whole, with no Python per
# op) or ``WHOLE`` (not checkpointed: autograd saves what it saves, through
# whatever saved-tensor hooks are active). It is told when each block's forward
# starts and ends, and, through gradient hooks on the block's outputs that
# require grad (in a pytree or a dataclass; not a leaf such as a parameter the
# block returns, whose hook would outlive the step), when backward reaches the
# block (before its recompute): once a pass, at the first of them that gets a
# gradient (one the loss does not use, such as router logits with the
# auxiliary loss off, gets none).
# A block forward that runs inside a backward replays one: the recompute of a
# checkpoint the user put around several blocks. It must save what that forward
# saved, so it runs in the mode that forward had, and the caller is neither
# asked nor told (its steps and timings are the forward's). Which forward: with
# micro-batches in flight (a pipeline's one forward, one backward) the block's
# last forward may be a later micro-batch's, run after the plan moved on. The
# recompute runs inside the backward of a node that forward made (its first
# saved tensor that backward unpacks), so the block keeps the autograd sequence
# number each recent forward began at, and a replay takes the latest forward
# that began before that node was made (the last one where no node runs, or none
# began before it). Under a reentrant checkpoint the forward runs without grad
# and so is not seen: its recompute (run by the checkpoint's own backward node)
# is the block's first run with grad, asked and told as a forward, also where
# a forward with grad ran outside that checkpoint before (an evaluation with
# grad on), which a replay would otherwise repeat for good.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .errors import OffloadError
from .kv_cache import CacheOff

__all__ = [
    "PLAIN",
    "SELECTIVE",
    "SKIP",
    "WHOLE",
    "BlockModes",
    "BlockSpec",
    "WrappedBlocks",
    "current_block",
    "current_call",
    "find_blocks",
    "in_backward",
]

# Module classes, or qualified module names as named_modules() gives them.
BlockSpec = Sequence[type[nn.Module] | str]

ContextFn = Callable[[], tuple[Any, Any]]


def _check_spec(blocks: object) -> tuple[type[nn.Module] | str, ...] | None:
    if blocks is None:
        return None
    if isinstance(blocks, str | type):
        blocks = (blocks,)
    if not isinstance(blocks, Iterable):
        raise TypeError(
            "prefetch_offload: recompute_blocks must be a list of nn.Module classes or "
            f"qualified module names, got {type(blocks).__name__}; e.g. "
            "recompute_blocks=[LlamaDecoderLayer] or recompute_blocks=['model.layers.0']."
        )
    spec = tuple(blocks)
    for item in spec:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise TypeError(
                "prefetch_offload: recompute_blocks entries must be nn.Module classes or "
                f"qualified module names (str), got {item!r}."
            )
    if not spec:
        raise ValueError(
            "prefetch_offload: recompute_blocks is empty; pass None to detect the blocks, "
            "or the block classes or names to checkpoint."
        )
    return spec


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop blocks nested inside another found block; keep the model's order."""
    names = [name for name, _ in found]
    out = []
    for name, module in found:
        if not any(name != other and name.startswith(other + ".") for other in names):
            out.append((name, module))
    return out


def _no_split_classes(model: nn.Module) -> set[str]:
    classes: set[str] = set()
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
        if declared:
            classes.update(str(c) for c in declared)
    return classes


def _longest_run(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The longest run of same-class children of an nn.ModuleList or nn.Sequential, of
    the runs not inside a member of another run (NOTE [block detection])."""
    runs: list[list[tuple[str, nn.Module]]] = []
    for prefix, container in model.named_modules():
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            continue
        run: list[tuple[str, nn.Module]] = []
        for name, child in container.named_children():
            qualified = f"{prefix}.{name}" if prefix else name
            if run and type(run[-1][1]) is type(child):
                run.append((qualified, child))
            else:
                if len(run) >= 2:
                    runs.append(run)
                run = [(qualified, child)]
        if len(run) >= 2:
            runs.append(run)
    members = [name for run in runs for name, _ in run]
    outer = [
        run
        for run in runs
        if not any(run[0][0].startswith(m + ".") for m in members)  # inside a member
    ]
    return max(outer, key=len, default=[])


def find_blocks(model: nn.Module, blocks: BlockSpec | None = None) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model`` as (qualified name, module), in model order.

    NOTE [block detection]. Raises :class:`ValueError` when none is found, or when a
    name in ``blocks`` is not a submodule.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"prefetch_offload: model must be a torch.nn.Module, got {type(model).__name__}."
        )
    spec = _check_spec(blocks)
    named = list(model.named_modules())
    if spec is not None:
        names = {item for item in spec if isinstance(item, str)}
        classes = tuple(item for item in spec if isinstance(item, type))
        known = {name for name, _ in named}
        missing = sorted(names - known)
        if missing:
            raise ValueError(
                f"prefetch_offload: recompute_blocks names {missing} are not submodules of the "
                "model; use names as model.named_modules() gives them, e.g. 'model.layers.0'."
            )
        found = [
            (n, m) for n, m in named if n and (n in names or (classes and isinstance(m, classes)))
        ]
        containers = sorted(n for n, m in found if type(m).forward is nn.Module.forward)
        if containers:  # an nn.ModuleList / ModuleDict: nothing calls its forward
            raise ValueError(
                f"prefetch_offload: recompute_blocks names {containers}, which have no forward "
                "of their own (an nn.ModuleList or nn.ModuleDict holding the blocks): name "
                "the blocks in it instead, e.g. 'model.layers.0', or pass their class."
            )
        how = f"recompute_blocks={list(spec)!r}"
        if not found and ("" in names or (classes and isinstance(model, classes))):
            raise ValueError(
                f"prefetch_offload: {how} names the model itself, which cannot be a block "
                "(a block is a submodule the model calls); name the repeated layers inside "
                "it instead, by class (e.g. [MyDecoderLayer]) or by qualified name (e.g. "
                "'layers.0')."
            )
    else:
        wanted = _no_split_classes(model)
        # Along the class's MRO: fully_shard gives each sharded module a subclass of its
        # class (FSDPLlamaDecoderLayer) that _no_split_modules does not name.
        found = [
            (n, m) for n, m in named if n and any(c.__name__ in wanted for c in type(m).__mro__)
        ]
        how = f"_no_split_modules {sorted(wanted)}"
        if not found:
            found = _longest_run(model)
            how = "a run of same-class children in an nn.ModuleList or nn.Sequential"
    found = _outermost(found)
    if not found:
        raise ValueError(
            f"prefetch_offload: no blocks to checkpoint were found in {type(model).__name__} "
            f"(looked for {how}); pass recompute_blocks= with the block classes "
            "(e.g. [MyDecoderLayer]) or their qualified names (e.g. ['layers.0', 'layers.1'])."
        )
    return found


# What a block's forward does while torch.compile traces it (NOTE [compiled blocks]):
# checkpoint with this context_fn (None: a plain checkpoint), or SKIP the checkpoint.
SKIP = "skip"

# How a block runs in eager mode (NOTE [block modes]).
SELECTIVE, PLAIN, WHOLE = "selective", "plain", "whole"


class BlockModes(Protocol):
    """Chooses how each block runs, and hears when it runs (NOTE [block modes]).

    ``kind`` is the block's class name, ``index`` its position among the wrapped blocks.
    """

    def mode(self, kind: str, index: int) -> str:
        """``SELECTIVE``, ``PLAIN`` or ``WHOLE`` for this call of the block."""
        ...

    def entered(self, kind: str, index: int) -> None:
        """The block's forward starts (grad enabled, not compiling)."""
        ...

    def exited(self, kind: str, index: int) -> None:
        """The block's forward returned."""
        ...

    def backward(self, kind: str, index: int) -> None:
        """Backward reached the block's output (before the block's own backward)."""
        ...


class WrappedBlocks:
    """Blocks whose forward runs under a checkpoint; :meth:`restore` undoes it exactly.

    Args:
        blocks: (name, module) pairs, as :func:`find_blocks` gives them.
        context_fn: the checkpoint's ``context_fn`` in eager mode (None: plain).
        compiled: the ``context_fn`` while torch.compile traces the block, or
            ``SKIP`` to leave a compiled block unchecked (NOTE [compiled blocks]).
        model: the model the blocks are from; its forwards with grad enabled run with
            ``config.use_cache`` off (NOTE [kv cache] in kv_cache.py).
        modes: chooses per call how each block runs (NOTE [block modes]); None:
            always the checkpoint with ``context_fn``.
        plain_fn: the checkpoint's ``context_fn`` for a call ``modes`` runs plainly
            (NOTE [plain blocks counted] in checkpointing.py); None: none.
    """

    def __init__(
        self,
        blocks: list[tuple[str, nn.Module]],
        context_fn: ContextFn | None,
        *,
        compiled: ContextFn | str | None = None,
        model: nn.Module | None = None,
        modes: BlockModes | None = None,
        plain_fn: ContextFn | None = None,
    ) -> None:
        self.blocks = blocks
        self._saved: list[tuple[nn.Module, bool, Any]] = []
        self._mine: list[_BlockForward] = []  # the wrappers this object installed
        self._cache_off: CacheOff | None = None
        try:
            self._cache_off = CacheOff(model, [module for _, module in blocks])
            for index, (name, module) in enumerate(blocks):
                own = "forward" in module.__dict__
                self._saved.append((module, own, module.__dict__.get("forward")))
                wrapper = _checkpointed(module, name, index, context_fn, compiled, modes, plain_fn)
                self._mine.append(wrapper)
                module.forward = wrapper  # type: ignore[method-assign]
        except BaseException:
            self.restore()
            raise

    @property
    def names(self) -> list[str]:
        """The wrapped blocks' qualified names, in model order."""
        return [name for name, _ in self.blocks]

    def check_restore(self) -> None:
        """Raise :class:`OffloadError`, changing nothing, where another context has
        wrapped these blocks since and is still entered (exit that one first)."""
        for (module, _, _), mine in zip(self._saved, self._mine, strict=False):
            current = module.__dict__.get("forward")
            if isinstance(current, _BlockForward) and current is not mine:
                raise OffloadError(
                    "prefetch_offload: an offload_context with model= was exited while "
                    "another one that wraps the same model's blocks is still entered; "
                    "exit contexts in reverse order of entering them."
                )

    def restore(self) -> None:
        """Put every block's ``forward`` back as it was (idempotent), after
        :meth:`check_restore`. The cache hooks go whatever the forwards' restore raised
        (NOTE [interrupts] in io_pool.py)."""
        self.check_restore()
        try:
            while self._saved:
                module, own, previous = self._saved[-1]
                if own:
                    module.forward = previous  # type: ignore[method-assign]
                else:
                    module.__dict__.pop("forward", None)
                self._saved.pop()
            self._mine.clear()
        finally:
            cache_off, self._cache_off = self._cache_off, None
            if cache_off is not None:
                cache_off.remove()


# The block running now, for the contexts a checkpoint's context_fn makes
# (NOTE [op keys] in checkpointing.py): its class name and position.
_local = threading.local()
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
# The autograd sequence number the next node made on this thread gets.
_sequence_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr


def in_backward() -> bool:
    """Whether the calling thread runs inside a backward (autograd's graph task)."""
    return _graph_task_id() >= 0


def current_block() -> tuple[str, int] | None:
    """(class name, index) of the innermost wrapped block whose forward is running on
    this thread, or None."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def current_call() -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The (args, kwargs) of that block's forward call, or None."""
    calls = getattr(_local, "calls", None)
    return calls[-1] if calls else None


def _checkpointed(
    module: nn.Module,
    name: str,
    index: int,
    context_fn: ContextFn | None,
    compiled: ContextFn | str | None,
    modes: BlockModes | None = None,
    plain_fn: ContextFn | None = None,
) -> _BlockForward:
    own = module.__dict__.get("forward")  # a forward of the block's own, if any
    inner = own if own is not None else type(module).forward.__get__(module)
    kind = type(module).__name__
    # NOTE [block modes]: the mode of the last forward outside backward (None: no such
    # forward yet, as under a reentrant checkpoint, whose forward runs without grad),
    # and of the recent ones, each with the autograd sequence number it began at.
    last: list[str | None] = [None]
    history: collections.deque[tuple[int, str]] = collections.deque(maxlen=_HISTORY)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if getattr(module, "gradient_checkpointing", False):  # NOTE [double checkpointing]
            raise OffloadError(
                f"prefetch_offload: block {name!r} has Hugging Face gradient checkpointing on, "
                "and offload_context(recompute=...) checkpoints the same blocks; use one of "
                "them: drop gradient_checkpointing (or activation_checkpointing) from the "
                "TrainingArguments / do not call gradient_checkpointing_enable(), or pass "
                "recompute=None to keep Hugging Face's (its block inputs are offloaded)."
            )
        if not torch.is_grad_enabled() or _holds_cache(args, kwargs):  # NOTE [cached prompts]
            return inner(*args, **kwargs)
        fn = context_fn
        how = SELECTIVE
        replay = False
        if torch.compiler.is_compiling():  # NOTE [compiled blocks]
            if compiled == SKIP:
                return inner(*args, **kwargs)
            fn = compiled  # type: ignore[assignment]
        elif modes is not None:  # NOTE [block modes]
            backward = in_backward()
            reentrant = backward and _reentrant_recompute()
            replay = backward and last[0] is not None and not reentrant
            if replay:
                how = _replayed(history, last[0])  # type: ignore[arg-type]
            else:
                how = modes.mode(kind, index)
                modes.entered(kind, index)
                if not backward or reentrant:  # (a checkpoint inside it replays it)
                    last[0] = how
                    history.append((_sequence_nr(), how))
        if how == PLAIN and not replay and not torch.compiler.is_compiling():
            fn = plain_fn  # NOTE [plain blocks counted] in checkpointing.py
        elif how != SELECTIVE:
            fn = None
        extra: dict[str, Any] = {}
        if fn is not None:
            extra["context_fn"] = fn
        stack = _local.__dict__.setdefault("stack", [])
        # The call, for an eager context_fn (NOTE [plain blocks counted]); never while
        # compiling (the list would be a side effect for the compiler to track).
        calls = None
        if fn is not None and not torch.compiler.is_compiling():
            calls = _local.__dict__.setdefault("calls", [])
        # Cut back to these lengths whatever happens from here (an interrupt between two
        # calls included: NOTE [interrupts] in io_pool.py).
        depth, made = len(stack), len(calls) if calls is not None else 0
        try:
            stack.append((kind, index))  # for context_fn, which checkpoint calls first
            if calls is not None:
                calls.append((args, kwargs))
            if how == WHOLE:
                out = inner(*args, **kwargs)
            else:
                # Every argument, keywords too, goes in positionally and on its own:
                # checkpoint would take keywords it shares a name with (debug,
                # preserve_rng_state, ...), saves the RNG state of the devices of its
                # positional tensors only, and saves (through the hooks, with their
                # version check) only tensors passed directly, not inside a container.
                names = tuple(kwargs)
                # NOTE [reparametrized blocks]
                state = None if torch.compiler.is_compiling() else _slots(module)
                out = checkpoint(
                    _call,
                    inner,
                    state,
                    len(args),
                    names,
                    *args,
                    *kwargs.values(),
                    use_reentrant=False,
                    **extra,
                )
        finally:
            del stack[depth:]
            if calls is not None:
                del calls[made:]
        if modes is not None and not torch.compiler.is_compiling() and not replay:
            modes.exited(kind, index)
            _hook_backward(out, lambda: modes.backward(kind, index))
        return out

    return _BlockForward(forward, module, own)


_Slots = list[tuple[dict[str, Any], str, Any]]


def _slots(module: nn.Module) -> _Slots:
    """Every parameter and buffer slot of ``module`` and the tensor in it now (NOTE
    [reparametrized blocks])."""
    return [
        (slots, key, value)
        for m in module.modules()
        for slots in (m._parameters, m._buffers)
        for key, value in slots.items()
    ]


def _call(
    fn: Callable[..., Any],
    state: _Slots | None,
    positional: int,
    names: tuple[str, ...],
    *flat: Any,
) -> Any:
    """``fn`` called with ``flat``'s first ``positional`` values, then the rest by name;
    in a recompute, with the forward's tensors in the block's slots (NOTE
    [reparametrized blocks])."""
    changed = (
        []
        if state is None or not in_backward()
        else [(slots, key, value) for slots, key, value in state if slots.get(key) is not value]
    )
    theirs = [(slots, key, slots.get(key, _MISSING)) for slots, key, _ in changed]
    try:
        for slots, key, value in changed:
            slots[key] = value
        return fn(*flat[:positional], **dict(zip(names, flat[positional:], strict=True)))
    finally:
        for slots, key, value in theirs:
            if value is _MISSING:
                slots.pop(key, None)
            else:
                slots[key] = value


_MISSING = object()
_CACHE_NAMES = ("past_key_values", "past_key_value", "layer_past")


def _holds_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a block call carries a key/value cache (NOTE [cached prompts]): a
    Hugging Face ``Cache``, or anything under one of its names."""
    if any(kwargs.get(name) is not None for name in _CACHE_NAMES):
        return True
    return any(_is_cache(x) for x in (*args, *kwargs.values()))


def _is_cache(x: Any) -> bool:
    return any(
        c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(x).__mro__
    )


class _BlockForward:
    """A wrapped block's ``forward`` (NOTE [wrapping blocks]). A deep copy of the model
    made while it is wrapped (an EMA, a reference model) gets its block's own forward
    back: this wrapper runs the original block, in this context's engine."""

    __slots__ = ("_call", "_module", "_own")

    def __init__(self, call: Callable[..., Any], module: nn.Module, own: Any) -> None:
        self._call = call
        self._module = module
        self._own = own  # the block's own forward it wraps; None: its class's

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled with the model (torch.save(model) inside the context): it loads as the
        # block's own forward, as a deep copy does, and loading needs no prefetch_offload.
        if self._own is None:  # the class's forward, bound to the loaded block
            return getattr, (self._module, "forward")
        return copy.copy, (self._own,)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        clone = memo.get(id(self._module))
        if clone is None:  # the wrapper copied on its own: it still runs the original
            return self
        if self._own is None:
            return type(self._module).forward.__get__(clone)  # the class's forward
        return copy.deepcopy(self._own, memo)  # a forward of the block's own (a wrapper)


# NOTE [block modes]: the forwards of a block whose modes a replay looks up (micro-batches
# a pipeline schedule has in flight at once).
_HISTORY = 64


def _replayed(history: collections.deque[tuple[int, str]], last: str) -> str:
    """The mode of the forward that a replay inside backward runs again (NOTE [block
    modes]): the latest one that began before the node backward runs now was made."""
    node = torch._C._current_autograd_node()
    if node is None:
        return last
    made = node._sequence_nr()
    for began, how in reversed(history):
        if began <= made:
            return how
    return last


def _reentrant_recompute() -> bool:
    """Whether a block forward inside backward is a reentrant checkpoint's recompute
    (NOTE [block modes]): the node backward runs now is that checkpoint's."""
    node = torch._C._current_autograd_node()
    return node is not None and node.name() == "CheckpointFunctionBackward"


def _hook_backward(out: Any, call: Callable[[], None]) -> None:
    """Call ``call`` once per backward pass, when it reaches the first tensor of
    ``out`` that the block computed and gets a gradient (NOTE [block modes])."""
    last = [-2]  # the graph task ``call`` ran in last

    def hook(grad: torch.Tensor) -> None:
        task = _graph_task_id()
        if task < 0 or task != last[0]:
            last[0] = task
            call()

    for x in _output_tensors(out):
        # Not a leaf (a parameter the block returns): a hook on one outlives the step.
        if x.requires_grad and x.grad_fn is not None:
            x.register_hook(hook)


def _output_tensors(out: Any) -> Iterator[torch.Tensor]:
    """The tensors in a block's output: a pytree's leaves, and a dataclass's fields."""
    for x in torch.utils._pytree.tree_leaves(out):
        if isinstance(x, torch.Tensor):
            yield x
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for field in dataclasses.fields(x):
                yield from _output_tensors(getattr(x, field.name, None))
