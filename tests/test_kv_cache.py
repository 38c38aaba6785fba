"""The key/value cache off for forwards with grad enabled, as set by the user otherwise
(NOTE [kv cache])."""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from prefetch_offload import kv_cache
from prefetch_offload.kv_cache import CacheOff


class Block(nn.Module):
    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config  # a block's own reference to the config: not hooked
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Base(nn.Module):
    """Reads the flag as a Hugging Face base model does, at the start of forward."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Block(config) for _ in range(2))
        self.seen: list[bool] = []

    def forward(
        self, x: torch.Tensor, fail: bool = False, use_cache: bool | None = None
    ) -> torch.Tensor:
        self.seen.append(self.config.use_cache if use_cache is None else use_cache)
        for layer in self.layers:
            x = layer(x)
        if fail:
            raise RuntimeError("forward failed")
        return x


class Head(nn.Module):
    """Takes only ``**kwargs``: its hook turns the config's flag off."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(use_cache=True)
        self.model = Base(self.config)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor, fail: bool = False, **kwargs: object) -> torch.Tensor:
        self.seen.append(self.config.use_cache)
        out = self.model(x, fail)
        self.seen.append(self.config.use_cache)  # after the inner forward returned
        return out


def _hooked(model: Head) -> CacheOff:
    return CacheOff(model, list(model.model.layers))


def test_a_forward_with_grad_runs_with_the_cache_off_and_sets_it_back() -> None:
    model = Head()
    hooks = _hooked(model)
    model(torch.randn(2, 4))
    assert model.seen == [False, False] and model.model.seen == [False]
    assert model.config.use_cache is True  # between forwards: the user's value
    with torch.no_grad():  # generate: nothing is checkpointed, the cache stays on
        model(torch.randn(2, 4))
    assert model.seen[2:] == [True, True]
    hooks.remove()
    model(torch.randn(2, 4))
    assert model.seen[4:] == [True, True]


class Rotary(nn.Module):
    """Keeps the config, never reads use_cache (Llama's rotary embedding)."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_only_modules_outside_the_blocks_whose_forward_takes_the_flag_are_hooked() -> None:
    model = Head()
    model.model.rotary = Rotary(model.config)
    hooks = _hooked(model)
    assert hooks.modules == [model, model.model]
    hooks.remove()
    assert not model._forward_pre_hooks and not model.model._forward_hooks


def test_a_forward_that_raises_sets_the_cache_back() -> None:
    model = Head()
    hooks = _hooked(model)
    with pytest.raises(RuntimeError, match="forward failed"):
        model(torch.randn(2, 4), True)
    assert model.config.use_cache is True
    model(torch.randn(2, 4))  # the nesting count started again
    assert model.seen[-2:] == [False, False] and model.config.use_cache is True
    hooks.remove()


def test_a_value_the_user_sets_stays() -> None:
    model = Head()
    hooks = _hooked(model)
    model.config.use_cache = False
    model(torch.randn(2, 4))
    assert model.config.use_cache is False
    hooks.remove()
    assert model.config.use_cache is False


def test_a_deep_copy_carries_the_hooks_inert() -> None:
    model = Head()
    hooks = _hooked(model)
    twin = copy.deepcopy(model)
    twin(torch.randn(2, 4))
    assert twin.seen == [True, True]  # its blocks are not wrapped: its cache is safe
    model(torch.randn(2, 4))
    assert model.seen == [False, False]
    hooks.remove()


def test_nested_contexts_on_one_model_each_keep_theirs() -> None:
    model = Head()
    outer = _hooked(model)
    inner = _hooked(model)
    model(torch.randn(2, 4))
    inner.remove()
    model(torch.randn(2, 4))
    assert model.seen == [False, False, False, False] and model.config.use_cache is True
    outer.remove()
    model(torch.randn(2, 4))
    assert model.seen[-2:] == [True, True]


def test_a_pre_hook_that_raises_before_ours_leaves_the_outer_forward_off() -> None:
    """An earlier pre-hook of the inner module raises: our forward hook still runs
    there (always called) and must not end the outer forward's turn."""
    model = Head()

    def refuse(module: nn.Module, args: object) -> None:
        raise ValueError("refused")

    model.model.register_forward_pre_hook(refuse)
    hooks = _hooked(model)
    seen: list[bool] = []

    def outer(x: torch.Tensor) -> None:
        with pytest.raises(ValueError, match="refused"):
            model.model(x)
        seen.append(model.config.use_cache)

    model.forward = lambda x, fail=False: outer(x)  # type: ignore[method-assign]
    model(torch.randn(2, 4))
    assert seen == [False] and model.config.use_cache is True
    hooks.remove()


def test_threads_share_the_flag_and_the_last_one_out_sets_it_back() -> None:
    model = Head()
    hooks = _hooked(model)
    inside, go = threading.Event(), threading.Event()
    seen: list[bool] = []

    def slow(x: torch.Tensor) -> None:
        inside.set()
        go.wait(5)
        seen.append(model.config.use_cache)

    base = model.model
    base.forward = lambda x, fail=False, **kw: slow(x)  # type: ignore[method-assign]
    thread = threading.Thread(target=lambda: model(torch.randn(2, 4)))
    thread.start()
    assert inside.wait(5)
    del base.forward  # the second forward returns at once
    model(torch.randn(2, 4))
    assert model.config.use_cache is False  # the first thread's forward still runs
    go.set()
    thread.join(5)
    assert seen == [False] and model.config.use_cache is True
    hooks.remove()


def test_a_forward_cut_short_by_an_interrupt_is_given_back_at_the_next_one() -> None:
    """An interrupt skips PyTorch's always-called hooks: the next forward of the same
    module gives back what the cut-short one counted, and it ends with the cache on."""
    model = Head()
    hooks = _hooked(model)

    def interrupt(module: nn.Module, args: object, output: object) -> None:
        raise KeyboardInterrupt

    handle = model.model.layers[1].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 4))
    assert model.config.use_cache is False  # until the next forward, or the exit
    handle.remove()
    model(torch.randn(2, 4))
    assert model.config.use_cache is True
    hooks.remove()


def test_a_forward_that_names_use_cache_is_called_without_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward that takes ``use_cache`` gets False in its call, whatever the caller
    passed, by keyword or by position; an explicit True is said once; the config is not
    touched, so a value the user writes during the forward stays."""
    monkeypatch.setattr(kv_cache, "_warned", False)  # (said once a process)
    base = Base(SimpleNamespace(use_cache=True))
    hooks = CacheOff(base, list(base.layers))
    flags: list[bool] = []
    base.layers[0].register_forward_pre_hook(lambda m, a: flags.append(base.config.use_cache))
    x = torch.randn(2, 4)
    with caplog.at_level("WARNING", logger="prefetch_offload"):
        base(x)
        base(x, use_cache=True)
        base(x, False, True)
    assert base.seen == [False, False, False] and flags == [True, True, True]
    said = [r for r in caplog.records if "use_cache=True is incompatible" in r.message]
    assert len(said) == 1
    with torch.no_grad():  # generate: the caller's value
        base(x, use_cache=True)
    assert base.seen[-1] is True

    def user_turns_it_off(module: nn.Module, args: object) -> None:
        base.config.use_cache = False

    handle = base.layers[1].register_forward_pre_hook(user_turns_it_off)
    base(x)
    handle.remove()
    assert base.config.use_cache is False
    hooks.remove()


def test_a_flag_written_during_a_forward_that_turned_it_off_is_not_set_back() -> None:
    """The flag is set back to the value it had only if the hook's False is still there:
    a value written meanwhile (here True, after the forward had turned it off) stays."""
    model = Head()
    model.config.use_cache = 1  # a truthy value that is not True: set back as it was
    hooks = _hooked(model)
    model(torch.randn(2, 4))
    assert model.config.use_cache == 1 and model.config.use_cache is not True

    def user_writes(module: nn.Module, args: object) -> None:
        model.config.use_cache = "user"

    handle = model.model.layers[0].register_forward_pre_hook(user_writes)
    model(torch.randn(2, 4))
    handle.remove()
    assert model.config.use_cache == "user"
    hooks.remove()


class _PositionalOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(use_cache=True)
        self.seen: list[object] = []

    def forward(self, x: torch.Tensor, /, fail: bool = False, use_cache: object = None) -> None:
        self.seen.append((use_cache, self.config.use_cache))


class _KeywordOnly(_PositionalOnly):
    def forward(self, *args: object, use_cache: object = None) -> None:  # type: ignore[override]
        self.seen.append((use_cache, self.config.use_cache))


class _OnlyPositional(_PositionalOnly):
    def forward(self, x: torch.Tensor, use_cache: object = None, /) -> None:  # type: ignore[override]
        self.seen.append((use_cache, self.config.use_cache))


def test_use_cache_after_positional_only_or_star_args_or_itself_positional_only() -> None:
    """Its position counts positional-only parameters before it; after ``*args`` it is
    keyword only; a positional-only ``use_cache`` (never passed by keyword) has the
    config's flag turned off instead."""
    x = torch.randn(2, 4)
    m = _PositionalOnly()
    hooks = CacheOff(m, [])
    m(x, False, True)
    m(x)
    assert m.seen == [(False, True), (False, True)]
    hooks.remove()
    k = _KeywordOnly()
    hooks = CacheOff(k, [])
    k(x, 1, 2, use_cache=True)
    assert k.seen == [(False, True)]
    hooks.remove()
    o = _OnlyPositional()
    hooks = CacheOff(o, [])
    o(x)
    o(x, True)  # passed: the forward's own choice, with the config's flag off
    assert o.seen == [(None, False), (True, False)] and o.config.use_cache is True
    hooks.remove()


def test_a_forward_set_on_the_module_after_its_hooks_is_read_again() -> None:
    """A forward replaced on the instance (another signature) is read at the call: one
    with another parameter where ``use_cache`` was keeps its argument, and the config's
    flag is turned off for it instead."""
    m = _PositionalOnly()
    hooks = CacheOff(m, [])
    seen: list[object] = []

    def other(x: torch.Tensor, fail: bool = False, labels: object = None) -> None:
        seen.append((labels, m.config.use_cache))

    m.forward = other  # type: ignore[method-assign]
    m(torch.randn(2, 4), False, "labels")
    assert seen == [("labels", False)] and m.config.use_cache is True
    del m.forward
    m(torch.randn(2, 4), False, True)
    assert m.seen == [(False, True)]
    hooks.remove()
