"""Hugging Face's key/value cache, off for the forwards whose blocks are checkpointed.

# NOTE [kv cache]
# A Hugging Face model with ``use_cache`` on fills a key/value cache in
# forward; a checkpointed layer's recompute appends to it again, so its
# attention sees twice the keys (a wrong gradient, a shape error in backward
# with a padding mask, or a cache handed back with every key twice). Hugging
# Face turns the cache off per call under its own checkpointing (in training,
# with grad enabled, whatever the caller passed), and so does the wrapping,
# whose blocks are checkpointed whenever grad is enabled. While the blocks are
# wrapped, every module outside them that holds a config with ``use_cache``
# and whose forward takes it (the model, its base model; not a rotary
# embedding that keeps the config) runs each forward called with grad enabled
# without the cache:
# - a forward that names ``use_cache`` (every Hugging Face model) is called
#   with ``use_cache=False`` in place of what the caller passed (positionally
#   or by keyword); an explicit true value is said once on the
#   ``prefetch_offload`` logger, as Hugging Face says it. Hugging Face gives an
#   argument passed this way priority over the config, and the model passes
#   it to its base model, so the config is not touched. The position is read
#   from the forward in place at each call (a forward set on the module later
#   is read again);
# - a forward that takes only ``**kwargs`` (a wrapper that passes them on, or
#   one that reads the config itself), or names ``use_cache`` as positional
#   only, runs with ``config.use_cache`` false,
#   set back to the value it had by a forward hook as the forward returns or
#   raises an ``Exception``, unless something else wrote the flag meanwhile.
#   Nested forwards that share a config set it back once, at the outermost;
#   several threads share the flag as they share the config.
# The blocks' recomputes in backward get the arguments their forward got. At
# any other time the config is as the user set it: ``save_pretrained`` (the
# Trainer's checkpoints) and a deep copy see the user's value, a forward
# without grad (``generate``) keeps its cache, and a value the user sets
# inside the context stays, except a false one written during a forward of
# the second kind, which cannot be told from the hook's own. Limits: an
# interrupt (``KeyboardInterrupt``) inside a forward of the second kind skips
# PyTorch's always-called hooks, so the flag stays off until the same module's
# next forward on that thread or the context's exit; the hooks act only for
# the modules of a context still entered, and exit removes them from the
# model, but a deep copy or a pickle (``torch.save(model)``) made meanwhile
# carries them (inert; loading such a pickle needs this library); and
# ``torch.compile(model, fullgraph=True)`` of the whole model cannot trace them
# (compile the blocks, as ``docs/recipes.md`` does).
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["CacheOff"]

logger = logging.getLogger("prefetch_offload")

_lock = threading.Lock()
# Per config (by id): [the config, forwards running with its cache turned off here, the
# value it had].
_turned_off: dict[int, list[Any]] = {}
# The modules whose hooks act, and how many entered contexts watch each.
_watched: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_local = threading.local()
_warned = False
# A forward's ``use_cache`` parameter: its position (-1: keyword only), or None where the
# forward does not name it (NOTE [kv cache]).
_Where = int | None


def _before(module: nn.Module, args: Any, kwargs: Any) -> Any:
    """Forward pre-hook: a forward with grad enabled runs without the cache (NOTE [kv
    cache]): its call gets ``use_cache=False``, or its config's flag is turned off."""
    stack = _local.__dict__.setdefault("stack", [])
    for i, entry in enumerate(stack):
        if entry[0] == id(module):  # a forward of it that never returned (an interrupt)
            _give_back(stack[i:])
            del stack[i:]
            break
    config = getattr(module, "config", None)
    counted = False
    call = None
    if module in _watched and config is not None and torch.is_grad_enabled():
        where = _where_of(module)
        if where is not None:
            call = _without_cache(where, args, kwargs)
        else:
            with _lock:
                entry = _turned_off.get(id(config))
                if entry is not None:
                    entry[1] += 1
                    counted = True
                elif getattr(config, "use_cache", False):
                    _turned_off[id(config)] = [config, 1, config.use_cache]
                    config.use_cache = False
                    counted = True
    stack.append((id(module), id(config), counted))
    return call


def _without_cache(where: int, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """The call's arguments with ``use_cache=False`` (``where``: its position, -1 keyword
    only); an explicit true value is said once."""
    if 0 <= where < len(args):
        asked, args = args[where], (*args[:where], False, *args[where + 1 :])
    else:
        asked, kwargs = kwargs.get("use_cache"), {**kwargs, "use_cache": False}
    if asked:
        global _warned
        with _lock:
            said, _warned = _warned, True
        if not said:
            logger.warning(
                "prefetch_offload: use_cache=True is incompatible with checkpointed blocks "
                "(recompute=): a block's recompute would fill the cache again. Forwards with "
                "grad enabled run with use_cache=False, as under Hugging Face's own gradient "
                "checkpointing."
            )
    return args, kwargs


def _give_back(stale: list[tuple[int, int, bool]]) -> None:
    """Undo what these forwards counted; the last forward out turns the cache back on
    (also for forwards cut short by an interrupt: PyTorch runs its always-called hooks
    for an ``Exception`` only)."""
    with _lock:
        for _, key, counted in stale:
            entry = _turned_off.get(key) if counted else None
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _turned_off[key]
                    _restore(entry)


def _restore(entry: list[Any]) -> None:
    """Set the flag back to the value it had, unless something else wrote it meanwhile
    (a true value; a false one cannot be told from the hook's own)."""
    config, _, value = entry
    if config.use_cache is False:
        config.use_cache = value


def _after(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook (also called when the forward raises): the outermost forward that
    turned the cache off turns it back on."""
    stack = _local.__dict__.get("stack")
    if not stack or stack[-1][0] != id(module):
        return  # (an earlier pre-hook raised before ours ran)
    _give_back([stack.pop()])


def _reads_the_flag(forward: Any) -> tuple[bool, _Where]:
    """Whether a module's forward takes ``use_cache`` (or any keyword): the model and
    its base model do, a rotary embedding that keeps the config does not; and where it
    names it, by position or by keyword (None: not by either: its config's flag is
    turned off instead; NOTE [kv cache])."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: hooked, to be safe
        return True, None
    for i, p in enumerate(params):
        if p.name == "use_cache" and p.kind is p.POSITIONAL_OR_KEYWORD:
            return True, i  # (every parameter before it takes a position too)
        if p.name == "use_cache" and p.kind is p.KEYWORD_ONLY:
            return True, -1
        if p.name == "use_cache":  # positional only: not passed by keyword
            return True, None
    return any(p.kind is p.VAR_KEYWORD for p in params), None


# Per hooked module: the forward its position was read from, and the position (a forward
# set on the module after its hooks were made is read again).
_wheres: weakref.WeakKeyDictionary[nn.Module, tuple[Any, _Where]] = weakref.WeakKeyDictionary()


def _where_of(module: nn.Module) -> _Where:
    """Where the module's forward now in place names ``use_cache``."""
    forward = module.forward
    key = getattr(forward, "__func__", forward)
    known = _wheres.get(module)
    if known is not None and known[0] is key:
        return known[1]
    where = _reads_the_flag(forward)[1]
    _wheres[module] = (key, where)
    return where


class CacheOff:
    """Hooks on the modules of ``model`` outside ``blocks`` that hold a config with
    ``use_cache``: their forwards with grad enabled run with the cache off (NOTE [kv
    cache]). :meth:`remove` takes the hooks off (idempotent)."""

    def __init__(self, model: nn.Module | None, blocks: list[nn.Module]) -> None:
        self._handles: list[Any] = []
        self._modules: list[nn.Module] = []
        inside = {id(m) for block in blocks for m in block.modules()}
        try:
            for module in model.modules() if model is not None else ():
                config = getattr(module, "config", None)
                if id(module) in inside or not hasattr(config, "use_cache"):
                    continue
                if not _reads_the_flag(module.forward)[0]:
                    continue
                with _lock:
                    _watched[module] = _watched.get(module, 0) + 1
                self._modules.append(module)
                self._handles.append(module.register_forward_pre_hook(_before, with_kwargs=True))
                self._handles.append(module.register_forward_hook(_after, always_call=True))
        except BaseException:
            self.remove()
            raise

    @property
    def modules(self) -> list[nn.Module]:
        """The hooked modules."""
        return list(self._modules)

    def remove(self) -> None:
        """Take the hooks off; a config a forward cut short left off is turned back on."""
        while self._handles:
            self._handles.pop().remove()
        with _lock:
            while self._modules:
                module = self._modules.pop()
                left = _watched.get(module, 0) - 1
                if left > 0:
                    _watched[module] = left
                    continue
                _watched.pop(module, None)
                # A forward cut short without its hook (an interrupt) left it off.
                entry = _turned_off.pop(id(getattr(module, "config", None)), None)
                if entry is not None:
                    _restore(entry)
