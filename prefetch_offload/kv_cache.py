"""Hugging Face's key/value cache, off for the forwards whose blocks are checkpointed.

# NOTE [kv cache]
# A Hugging Face model with ``use_cache`` on fills a key/value cache in
# forward; a checkpointed layer's recompute appends to it again, so its
# attention sees twice the keys (a wrong gradient, or a recompute that runs
# other ops than its forward). Hugging Face turns the cache off per call under
# its own checkpointing (in training, with grad enabled), and so does the
# wrapping, whose blocks are checkpointed whenever grad is enabled: while the
# blocks are wrapped, every module outside them that holds a config with
# ``use_cache`` and whose forward takes it (the model, its base model; not a
# rotary embedding that keeps the config) runs each forward called with grad
# enabled with ``config.use_cache`` false, set back by a forward hook as the
# forward returns or raises an ``Exception``. The model's forward reads the flag
# and passes the blocks no cache; their recomputes in backward get the same
# arguments. At any other time the config is as the user set it:
# ``save_pretrained`` (the Trainer's checkpoints) and a deep copy see the
# user's value, a forward without grad (``generate``) keeps its cache, and a
# value the user sets inside the context stays. Nested forwards that share a
# config set it back once, at the outermost; several threads share the flag as
# they share the config. Limits: an interrupt (``KeyboardInterrupt``) inside a
# forward skips PyTorch's always-called hooks, so the flag stays off until the
# same module's next forward on that thread or the context's exit; the hooks
# act only for the modules of a context still entered, and exit removes them
# from the model, but a deep copy or a pickle (``torch.save(model)``) made
# meanwhile carries them (inert; loading such a pickle needs this library); and
# ``torch.compile(model, fullgraph=True)`` of the whole model cannot trace them
# (compile the blocks, as ``docs/recipes.md`` does).
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["CacheOff"]

_lock = threading.Lock()
# Per config (by id): [the config, forwards running with its cache turned off here].
_turned_off: dict[int, list[Any]] = {}
# The modules whose hooks act, and how many entered contexts watch each.
_watched: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_local = threading.local()


def _before(module: nn.Module, args: Any) -> None:
    """Forward pre-hook: turn the config's cache off for a forward with grad enabled."""
    stack = _local.__dict__.setdefault("stack", [])
    for i, entry in enumerate(stack):
        if entry[0] == id(module):  # a forward of it that never returned (an interrupt)
            _give_back(stack[i:])
            del stack[i:]
            break
    config = getattr(module, "config", None)
    counted = False
    if module in _watched and config is not None and torch.is_grad_enabled():
        with _lock:
            entry = _turned_off.get(id(config))
            if entry is not None:
                entry[1] += 1
                counted = True
            elif getattr(config, "use_cache", False):
                config.use_cache = False
                _turned_off[id(config)] = [config, 1]
                counted = True
    stack.append((id(module), id(config), counted))


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
                    entry[0].use_cache = True


def _after(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook (also called when the forward raises): the outermost forward that
    turned the cache off turns it back on."""
    stack = _local.__dict__.get("stack")
    if not stack or stack[-1][0] != id(module):
        return  # (an earlier pre-hook raised before ours ran)
    _give_back([stack.pop()])


def _may_read_the_flag(module: nn.Module) -> bool:
    """Whether the module's forward takes ``use_cache`` (or any keyword): the model and
    its base model do, a rotary embedding that keeps the config does not."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: hooked, to be safe
        return True
    return any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD for p in params)


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
                if not _may_read_the_flag(module):
                    continue
                with _lock:
                    _watched[module] = _watched.get(module, 0) + 1
                self._modules.append(module)
                self._handles.append(module.register_forward_pre_hook(_before))
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
                    entry[0].use_cache = True
