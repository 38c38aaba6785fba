"""blocks.py: which blocks are found, how they are wrapped, and that the model comes back."""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from prefetch_offload import OffloadError, offload_context
from prefetch_offload.blocks import SKIP, WrappedBlocks, current_block, find_blocks
from prefetch_offload.testing import TinyTransformer


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _Other(_Layer):
    pass


class _HFLike(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["_Other"]

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.ModuleList([_Layer(), _Layer(), _Layer()])  # a longer run, not named
        self.layers = nn.ModuleList([_Other(), _Other()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in [*self.pre, *self.layers]:
            x = m(x)
        return x


def test_longest_run_of_one_class_in_a_module_list() -> None:
    model = TinyTransformer(vocab=16, width=16, depth=5, heads=2)
    assert [n for n, _ in find_blocks(model)] == [f"blocks.{i}" for i in range(5)]


def test_longest_run_in_a_sequential_picks_the_longest_run() -> None:
    seq = nn.Sequential(_Layer(), _Other(), _Other(), _Other(), _Layer(), _Layer())
    assert [n for n, _ in find_blocks(seq)] == ["1", "2", "3"]


class _MoELayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([_Layer() for _ in range(8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts)  # type: ignore[return-value]


def test_a_longer_run_inside_a_member_of_another_run_does_not_count() -> None:
    """NOTE [block detection]: the layers, not the eight experts of the first layer."""
    model = nn.Sequential(nn.ModuleList([_MoELayer() for _ in range(4)]))
    assert [n for n, _ in find_blocks(model)] == [f"0.{i}" for i in range(4)]


def test_no_split_modules_win_over_the_longest_run() -> None:
    model = _HFLike()
    assert [n for n, _ in find_blocks(model)] == ["layers.0", "layers.1"]
    # A wrapper (DDP-like) that declares nothing still finds the inner declaration.
    outer = nn.Sequential(model)
    assert [n for n, _ in find_blocks(outer)] == ["0.layers.0", "0.layers.1"]


def test_no_split_modules_match_a_sharded_subclass() -> None:
    """FSDP2's fully_shard gives each sharded module a subclass of its class, named
    FSDP<Name>: the blocks _no_split_modules names are still found."""
    model = _HFLike()
    for layer in model.layers:
        layer.__class__ = type("FSDP_Other", (type(layer),), {})
    assert [n for n, _ in find_blocks(model)] == ["layers.0", "layers.1"]


def test_recompute_blocks_naming_a_container_is_an_error() -> None:
    """An nn.ModuleList has no forward that anything calls: wrapping it would checkpoint
    nothing, silently."""
    model = _HFLike()
    with pytest.raises(ValueError, match=r"\['layers'\], which have no forward of their own"):
        find_blocks(model, ["layers"])
    with pytest.raises(ValueError, match="name the blocks in it instead"):
        find_blocks(model, [nn.ModuleList])


def test_recompute_blocks_naming_the_model_itself_says_so() -> None:
    """The root (named "" by named_modules(), or its class) is no block: the error says
    the model itself was named, not only that no blocks were found."""
    model = _HFLike()
    for spec in ([""], [_HFLike]):
        with pytest.raises(ValueError, match="names the model itself"):
            find_blocks(model, spec)


def test_recompute_blocks_by_class_and_by_name() -> None:
    model = _HFLike()
    assert [n for n, _ in find_blocks(model, [_Layer])] == [
        "pre.0",
        "pre.1",
        "pre.2",
        "layers.0",
        "layers.1",
    ]  # subclasses too, as isinstance
    assert [n for n, _ in find_blocks(model, ["pre.1", "layers.0"])] == ["pre.1", "layers.0"]
    with pytest.raises(ValueError, match=r"\['nope'\] are not submodules"):
        find_blocks(model, ["nope"])
    with pytest.raises(TypeError, match=r"nn\.Module classes or qualified module names"):
        find_blocks(model, [3])  # type: ignore[list-item]


def test_nested_blocks_are_wrapped_once_at_the_outside() -> None:
    model = nn.Sequential(nn.Sequential(_Layer(), _Layer()), nn.Sequential(_Layer(), _Layer()))
    names = [n for n, _ in find_blocks(model, [nn.Sequential, _Layer])]
    assert names == ["0", "1"]


def test_no_blocks_is_an_error_that_says_what_to_pass() -> None:
    with pytest.raises(ValueError, match="pass recompute_blocks="):
        find_blocks(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        find_blocks("model")  # type: ignore[arg-type]


def test_restore_puts_back_the_instance_forward_or_removes_it() -> None:
    model = nn.Sequential(_Layer(), _Layer(), _Layer())

    def own(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    model[1].forward = own  # type: ignore[method-assign]
    wrapped = WrappedBlocks(find_blocks(model), None)
    assert all("forward" in m.__dict__ for m in model)
    x = torch.randn(2, 8, requires_grad=True)
    y = model(x)
    expected = torch.relu(model[2].lin(own(torch.relu(model[0].lin(x)))))
    assert torch.equal(y, expected)  # the block's own forward runs under the wrapper
    wrapped.restore()
    wrapped.restore()  # idempotent
    assert "forward" not in model[0].__dict__ and "forward" not in model[2].__dict__
    assert model[1].__dict__["forward"] is own


def test_the_block_running_is_known_to_the_context_fn() -> None:
    model = nn.Sequential(_Layer(), _Layer())
    seen = []

    def context_fn() -> tuple[object, object]:
        seen.append(current_block())
        return contextlib.nullcontext(), contextlib.nullcontext()

    wrapped = WrappedBlocks(find_blocks(model), context_fn)
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    wrapped.restore()
    assert seen == [("_Layer", 0), ("_Layer", 1)]
    assert current_block() is None


def test_skip_leaves_a_traced_block_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(_Layer(), _Layer())
    calls = []
    monkeypatch.setattr(
        "prefetch_offload.blocks.checkpoint", lambda *a, **k: calls.append(1) or a[0](*a[1:])
    )
    wrapped = WrappedBlocks(find_blocks(model), None, compiled=SKIP)
    x = torch.randn(2, 8, requires_grad=True)
    model(x)
    assert len(calls) == 2
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    model(x)
    assert len(calls) == 2  # traced: no checkpoint
    wrapped.restore()


def test_context_restores_the_model_when_the_body_raises(tmp_path: Path) -> None:
    model = TinyTransformer(vocab=16, width=16, depth=3, heads=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"):
        with offload_context("disk", str(tmp_path), model=model, recompute="auto"):
            assert all("forward" in b.__dict__ for b in model.blocks)
            raise RuntimeError("boom")
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert model.state_dict().keys() == before.keys()
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_while_exiting_still_restores_the_model_and_stops_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [interrupts] in io_pool.py: a Ctrl-C inside the model's restore at exit (a
    second one, as in a notebook) still puts every forward back, takes the hooks off
    and stops the IO threads (the autouse fixture checks those), then goes on."""
    from prefetch_offload import kv_cache

    model = TinyTransformer(vocab=16, width=16, depth=3, heads=2)
    tokens = torch.zeros(1, 4, dtype=torch.long)

    def interrupted(self: Any) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with offload_context("disk", str(tmp_path), model=model, recompute="full"):
            model(tokens, tokens).backward()
            monkeypatch.setattr(kv_cache.CacheOff, "remove", interrupted)
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_in_a_wrapped_block_leaves_no_block_on_the_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [interrupts] in io_pool.py: a Ctrl-C between the wrapper's first calls leaves
    nothing on the stack of running blocks (a stale entry keyed later checkpoints with
    a block that is not running, and held its inputs)."""
    from prefetch_offload import blocks

    model = TinyTransformer(vocab=16, width=16, depth=3, heads=2)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    real, calls = torch.compiler.is_compiling, [0]

    def is_compiling() -> bool:
        calls[0] += 1
        if calls[0] == 2:  # the wrapper's second call: the stack is being built
            raise KeyboardInterrupt
        return real()

    with offload_context("disk", str(tmp_path), model=model, recompute="full"):
        monkeypatch.setattr(torch.compiler, "is_compiling", is_compiling)
        with pytest.raises(KeyboardInterrupt):
            model(tokens, tokens)
        monkeypatch.setattr(torch.compiler, "is_compiling", real)
        assert blocks._local.__dict__.get("stack") == [] and current_block() is None
        assert not blocks._local.__dict__.get("calls")
        model(tokens, tokens).backward()


def test_hugging_face_checkpointing_on_a_wrapped_block_is_refused(tmp_path: Path) -> None:
    model = TinyTransformer(vocab=16, width=16, depth=2, heads=2)
    for block in model.blocks:
        block.gradient_checkpointing = True  # what gradient_checkpointing_enable() sets
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with offload_context("disk", str(tmp_path), model=model, recompute="full"):
        with pytest.raises(OffloadError, match="gradient checkpointing on"):
            model(tokens, tokens)


def test_no_grad_forward_is_not_checkpointed(tmp_path: Path) -> None:
    model = TinyTransformer(vocab=16, width=16, depth=2, heads=2)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    ref = model(tokens, tokens)
    with offload_context("disk", str(tmp_path), model=model, recompute="full"):
        with torch.no_grad():
            out = model(tokens, tokens)
    assert torch.equal(out, ref.detach())


def test_a_deep_copy_taken_while_wrapped_runs_its_own_blocks(tmp_path: Path) -> None:
    """NOTE [wrapping blocks]: an EMA or reference model copied inside the context must
    not run the original blocks (their parameters, this context's engine)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Layer() for _ in range(4)])
    x = torch.randn(2, 8, requires_grad=True)
    with offload_context("disk", str(tmp_path), model=model, recompute="full"):
        clone = copy.deepcopy(model)
        with torch.no_grad():
            for p in clone.parameters():
                p.zero_()
        assert torch.equal(clone(x), torch.zeros(2, 8))  # inside: the clone's own weights
    assert torch.equal(clone(x), torch.zeros(2, 8))  # and after exit
    assert not torch.equal(model(x), torch.zeros(2, 8))
    clone(x).sum().backward()  # the clone trains on its own, with no engine


def test_a_model_pickled_while_wrapped_loads_with_its_own_blocks(tmp_path: Path) -> None:
    """NOTE [wrapping blocks]: torch.save(model) inside the context pickles each block's
    forward as its own, and loading needs nothing of prefetch_offload."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Layer() for _ in range(4)])
    x = torch.randn(2, 8)
    buf = io.BytesIO()
    with offload_context("disk", str(tmp_path), model=model, recompute="full"):
        torch.save(model, buf)
    assert b"prefetch_offload" not in buf.getvalue()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), model(x))
    with torch.no_grad():
        for p in loaded.parameters():
            p.zero_()
    assert torch.equal(loaded(x), torch.zeros(2, 8))  # its own weights, not the original's


class _Keyworded(nn.Module):
    """A block with keyword arguments named as ``torch.utils.checkpoint``'s own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(
        self, x: torch.Tensor, debug: bool = False, preserve_rng_state: bool = False
    ) -> torch.Tensor:
        y = torch.relu(self.lin(x))
        return y * (2 if debug else 1) * (3 if preserve_rng_state else 1)


def test_block_keywords_reach_the_block_under_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.ModuleList([_Keyworded() for _ in range(3)])
    x = torch.randn(2, 8, requires_grad=True)

    def run() -> torch.Tensor:
        h = x
        for block in model:
            h = block(h, debug=True, preserve_rng_state=True)
        return h

    want = run()
    with offload_context("disk", str(tmp_path), model=model, recompute="full"):
        got = run()
        got.sum().backward()
    assert torch.equal(got, want)


def test_the_checkpoint_sees_keyword_tensors_for_their_devices_rng(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block called with its input as a keyword: torch's checkpoint saves the RNG state
    of the devices of its positional arguments' tensors (``get_device_states(*args)``,
    through their trees), which a CUDA dropout's mask depends on, so the keyword tensors
    must reach it positionally (CPU twin: what the checkpoint is called with)."""
    import prefetch_offload.blocks as blocks_module

    seen: list[torch.Tensor] = []
    real = blocks_module.checkpoint

    def recorded(fn: Any, *args: Any, **kwargs: Any) -> Any:
        seen.extend(x for x in torch.utils._pytree.tree_leaves(args) if isinstance(x, torch.Tensor))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(blocks_module, "checkpoint", recorded)
    torch.manual_seed(0)
    model = nn.ModuleList([_Keyworded() for _ in range(2)])
    x = torch.randn(2, 8, requires_grad=True)
    with offload_context("disk", str(tmp_path), model=model, recompute="full"):
        h = model[0](x=x, debug=True)
        model[1](x=h).sum().backward()
    assert any(t is x for t in seen) and any(t is h for t in seen)


def test_two_contexts_on_one_model_exited_out_of_order(tmp_path: Path) -> None:
    """A refused exit changes nothing; exiting in the right order then restores all."""
    model = nn.Sequential(*[_Layer() for _ in range(3)])
    a = offload_context("disk", str(tmp_path), model=model, recompute="full")
    b = offload_context("disk", str(tmp_path), model=model, recompute="full")
    a.__enter__()
    b.__enter__()
    with pytest.raises(OffloadError, match="reverse order"):
        a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)
    assert not any("forward" in block.__dict__ for block in model)


def test_blocks_wrapped_again_on_another_thread_refuse_the_first_restore() -> None:
    """The same, where the hooks cannot tell (each thread has its own): the blocks do."""
    model = nn.Sequential(*[_Layer() for _ in range(3)])
    blocks = find_blocks(model)
    first = WrappedBlocks(blocks, None, model=model)
    second = WrappedBlocks(blocks, None, model=model)
    with pytest.raises(OffloadError, match="reverse order"):
        first.restore()
    assert all("forward" in block.__dict__ for block in model)  # nothing changed
    second.restore()
    first.restore()
    assert not any("forward" in block.__dict__ for block in model)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return x + (h if scale is None else h * scale)


@pytest.mark.parametrize("by_keyword", [False, True])
def test_each_checkpointed_block_s_inputs_reach_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, by_keyword: bool
) -> None:
    """recompute="full": the checkpoint saves each block's tensor arguments, keywords
    included, through the hooks (what offload moves, with autograd's version check);
    nothing else of the blocks is saved in forward."""
    from prefetch_offload import OffloadEngine

    seen: list[tuple[int, ...]] = []
    real = OffloadEngine.pack

    def pack(self: OffloadEngine, t: torch.Tensor) -> Any:
        seen.append(tuple(t.shape))
        return real(self, t)

    monkeypatch.setattr(OffloadEngine, "pack", pack)
    torch.manual_seed(0)
    model = nn.ModuleList(_Residual() for _ in range(3))
    x = torch.randn(8, 32, requires_grad=True)
    scale = torch.full((1, 32), 0.5)
    with offload_context("disk", str(tmp_path), model=model, recompute="full"):
        h = x
        for block in model:
            h = block(x=h, scale=scale) if by_keyword else block(h)
        assert seen == [(8, 32), (1, 32)] * 3 if by_keyword else seen == [(8, 32)] * 3
        with torch.no_grad():
            x.mul_(1)  # a block input changed in place after it was saved
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            h.sum().backward()


@pytest.mark.parametrize("recompute", ["full", "auto"])
def test_a_functional_call_recomputes_with_the_tensors_its_forward_used(
    tmp_path: Path, recompute: str
) -> None:
    """NOTE [reparametrized blocks]: ``torch.func.functional_call`` puts the module's own
    parameters back before backward; the checkpoint's recompute runs with the call's
    tensors put back in the block for its duration, and the module keeps its own."""
    from prefetch_offload.recompute_profile import PROFILE
    from prefetch_offload.testing import make_batch

    torch.manual_seed(0)
    base = TinyTransformer(vocab=64, width=32, depth=2, heads=2)
    steps = len(PROFILE) + 2 if recompute == "auto" else 2

    def run(model: nn.Module) -> list[list[torch.Tensor]]:
        out = []
        for step in range(steps):
            tokens, targets = make_batch(2, 16, vocab=64, seed=step)
            params = {k: (v.detach() * 1.5).requires_grad_() for k, v in model.named_parameters()}
            torch.func.functional_call(model, params, (tokens, targets)).backward()
            out.append([p.grad for p in params.values()])
        return out

    ref = run(copy.deepcopy(base))
    model = copy.deepcopy(base)
    own = dict(model.named_parameters())
    with offload_context(
        "disk", str(tmp_path), model=model, recompute=recompute, min_offload_bytes=0
    ):
        got = run(model)
    pairs = [(a, b) for ga, gb in zip(ref, got, strict=True) for a, b in zip(ga, gb, strict=True)]
    assert all(torch.equal(a, b) for a, b in pairs)
    assert all(p is own[k] for k, p in model.named_parameters())  # the module's own, back
