"""How the library meets the rest of a training program.

Forked DataLoader workers inside the context, nested contexts of other targets and
recompute modes on one model, threads each with a context on a shared save_dir, a
backward on another thread than its forward, generation between training steps under
recompute="auto", Hugging Face gradient checkpointing refused then turned off, a model
moved to another dtype mid-run, a body that raises with a graph pending, ``async with``
and ``aflush`` under recompute, an optimizer step between two backwards of a retained
graph, and a config's round trip through pickle, ``asdict`` and the mapping entry. What
trains is compared bit for bit with the same program without the library; errors are
autograd's or the library's own; on exit the model is restored and the save_dir empty.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from prefetch_offload import (
    OffloadConfig,
    OffloadContext,
    OffloadEngine,
    OffloadError,
    offload_context,
    offload_context_from_config,
    recompute_profile,
)
from prefetch_offload import recompute as recompute_module
from prefetch_offload.testing import TinyTransformer, make_batch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

Grads = list[torch.Tensor]

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
_IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _matmuls_must_offload(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A policy that offloads every matmul's output and recomputes the rest."""
    if op in _MATMULS:
        return CheckpointPolicy.MUST_CPU_OFFLOAD
    return CheckpointPolicy.PREFER_RECOMPUTE


_RECOMPUTE: dict[str, Any] = {"full": "full", "policy": _matmuls_must_offload}


def _tiny() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(vocab=64, width=32, depth=2, heads=2)


def _llama() -> Any:
    """A seeded two-layer Llama built from a config (no downloads)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _context(save_dir: Path, model: nn.Module, recompute: Any, **kw: Any) -> OffloadContext:
    """A disk context that offloads every saved tensor, with ``recompute`` on ``model``
    (no recompute and no model where ``recompute`` is None)."""
    if recompute is not None:
        kw.update(model=model, recompute=recompute)
    return offload_context("disk", save_dir, min_offload_bytes=0, **kw)


def _steps(model: nn.Module, n: int = 3, engine: OffloadEngine | None = None) -> list[Grads]:
    """``n`` seeded steps' gradients; the writes flushed before each backward when
    ``engine`` is given (so backward reads from disk)."""
    out = []
    for step in range(n):
        tokens, targets = make_batch(2, 16, vocab=64, seed=step)
        model.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        if engine is not None:
            engine.flush()
        loss.backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def _params(model: nn.Module) -> Grads:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(ref: list[Grads], got: list[Grads]) -> None:
    """Every tensor of every step bit for bit the same, and not vacuously."""
    assert len(ref) == len(got) and ref and ref[0]
    for s, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert len(a) == len(b), s
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert x.dtype == y.dtype and torch.equal(x, y), (s, i)


def _wrapped(model: nn.Module) -> bool:
    return any("forward" in m.__dict__ for m in model.modules())


def _top_hooks() -> Any:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


# -- forked DataLoader workers -----------------------------------------------------------


class _Forked(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Reports, from the worker, how many engine threads it sees, whether saved-tensor
    hooks are installed there and its pid; runs an exact backward there too, through
    the hooks the fork inherited."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        names = [t.name for t in threading.enumerate() if t.name.startswith("prefetch_offload")]
        x = torch.randn(128, 128, requires_grad=True)
        (x.sin() * 2).sum().backward()
        assert torch.equal(x.grad, 2 * x.detach().cos())
        tokens, targets = make_batch(1, 16, vocab=64, seed=i)
        hooked = torch.tensor(_top_hooks() is not None)
        return tokens[0], targets[0], torch.tensor(len(names)), hooked, torch.tensor(os.getpid())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("recompute", [None, "full"])
def test_a_forked_dataloader_inside_the_context_trains_exactly(
    save_dir: Path, recompute: str | None
) -> None:
    """NOTE [fork]: DataLoader workers forked inside the context (two epochs, so forked
    again mid-run) run autograd exactly through the inherited hooks without the engine's
    threads, and the parent trains bit for bit as without the library."""
    base = _tiny()

    def train(model: nn.Module, ctx: OffloadContext) -> tuple[Grads, list[int], list[bool]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(
            _Forked(), batch_size=2, num_workers=2, multiprocessing_context="fork"
        )
        seen: list[int] = []
        hooked: list[bool] = []
        with ctx as engine:
            for _ in range(2):
                for tokens, targets, threads, hooks, pids in loader:
                    assert all(p != os.getpid() for p in pids.tolist())
                    seen += threads.tolist()
                    hooked += hooks.tolist()
                    opt.zero_grad()
                    loss = model(tokens, targets)
                    engine.flush()
                    loss.backward()
                    opt.step()
        return _params(model), seen, hooked

    ref, _, ref_hooked = train(copy.deepcopy(base), offload_context(None))
    model = copy.deepcopy(base)
    got, seen, hooked = train(model, _context(save_dir, model, recompute))
    _assert_same([ref], [got])
    assert not any(ref_hooked) and len(hooked) == 16 and all(hooked)  # inherited
    assert len(seen) == 16 and not any(seen)  # no engine thread in any worker
    assert list(save_dir.iterdir()) == []


# -- several contexts, several threads ---------------------------------------------------


@pytest.mark.parametrize(
    ("outer", "inner"), [("full", "full"), ("full", None), (None, "full"), ("full", "auto")]
)
def test_nested_contexts_of_other_targets_on_one_model(
    save_dir: Path, outer: str | None, inner: str | None
) -> None:
    """A disk context inside a cpu context, either or both with recompute on the same
    model: exact before, inside and after the inner one; on exit the blocks are
    restored, the folder is empty and no saved-tensor hooks are left."""
    base = _tiny()
    ref = _steps(copy.deepcopy(base))
    model = copy.deepcopy(base)
    okw: dict[str, Any] = {"model": model, "recompute": outer} if outer else {}
    with offload_context("cpu", min_offload_bytes=0, **okw):
        _assert_same(ref, _steps(model))
        with _context(save_dir, model, inner) as engine:
            _assert_same(ref, _steps(model, engine=engine))
        _assert_same(ref, _steps(model))
    assert engine.stats().tensors_offloaded > 0
    assert not _wrapped(model)
    assert list(save_dir.iterdir()) == []
    assert _top_hooks() is None


def test_threads_each_with_a_context_share_a_save_dir(save_dir: Path) -> None:
    """Three threads, each training its own copy under its own context on one save_dir
    (no recompute, "full", a policy): each thread's gradients are exact and the folder
    is left empty."""
    base = _tiny()
    ref = _steps(copy.deepcopy(base))
    results: dict[int, Any] = {}

    def worker(i: int, recompute: Any) -> None:
        try:
            model = copy.deepcopy(base)
            with _context(save_dir, model, recompute) as engine:
                results[i] = _steps(model, engine=engine)
        except BaseException as exc:  # reported by the assert below
            results[i] = exc

    modes = [None, "full", _matmuls_must_offload]
    threads = [threading.Thread(target=worker, args=(i, m)) for i, m in enumerate(modes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    for i in range(len(modes)):
        assert isinstance(results[i], list), results[i]
        _assert_same(ref, results[i])
    assert list(save_dir.iterdir()) == []


@pytest.mark.parametrize("mode", ["full", "policy"])
def test_backward_on_another_thread_than_the_forward_under_recompute(
    save_dir: Path, mode: str
) -> None:
    """Each step's backward runs on a new thread (the recompute there, outside the
    context's thread), every other step after a flush: the gradients are exact."""
    base = _tiny()
    ref = _steps(copy.deepcopy(base))
    model = copy.deepcopy(base)
    got: list[Grads] = []
    errors: list[BaseException] = []
    with _context(save_dir, model, _RECOMPUTE[mode]) as engine:
        for step in range(3):
            tokens, targets = make_batch(2, 16, vocab=64, seed=step)
            model.zero_grad(set_to_none=True)
            loss = model(tokens, targets)
            if step % 2:
                engine.flush()

            def backward(loss: torch.Tensor = loss) -> None:
                try:
                    loss.backward()
                except BaseException as exc:  # reported by the assert below
                    errors.append(exc)

            t = threading.Thread(target=backward)
            t.start()
            t.join(60)
            assert not t.is_alive() and not errors, errors
            got.append([p.grad.clone() for p in model.parameters()])
    _assert_same(ref, got)
    assert engine.stats().tensors_offloaded > 0


# -- Hugging Face models ------------------------------------------------------------------


def test_generation_between_training_steps_under_auto(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [kv cache]: ``generate`` (with its cache) and a no-grad forward with
    ``use_cache=True`` in eval mode, during the profile and after the plan: the tokens,
    logits and trained parameters match training without the library, the plan is made
    once (generation is no step), and the config keeps ``use_cache``."""
    monkeypatch.setattr(recompute_module, "OFFLOAD_ALONE", False)  # blocks checkpointed
    base = _llama()
    n = len(recompute_profile.PROFILE) + 2
    generate_at = {2, n - 1}  # in the profile, and in the second planned step

    def train(model: Any, ctx: OffloadContext) -> tuple[Grads, Grads, OffloadEngine]:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        generated: Grads = []
        with ctx as engine:
            for step in range(n):
                model.train()
                opt.zero_grad()
                model(input_ids=_IDS, labels=_IDS).loss.backward()
                opt.step()
                if step in generate_at:
                    model.eval()
                    generated.append(
                        model.generate(
                            _IDS[:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0
                        )
                    )
                    with torch.no_grad():
                        generated.append(model(input_ids=_IDS, use_cache=True).logits)
        return _params(model), generated, engine

    ref, ref_generated, _ = train(copy.deepcopy(base), offload_context(None))
    model = copy.deepcopy(base)
    got, generated, engine = train(model, _context(save_dir, model, "auto"))
    assert generated[0].shape == (2, 10)
    _assert_same([ref, ref_generated], [got, generated])
    plan = engine.recompute_plan()
    assert plan is not None and plan.plans_made == 1, plan
    assert model.config.use_cache
    assert not _wrapped(model)


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_(en|dis)able:FutureWarning")
def test_hf_gradient_checkpointing_with_auto_is_refused_then_can_be_turned_off(
    save_dir: Path,
) -> None:
    """NOTE [double checkpointing]: ``gradient_checkpointing_enable()`` on a model under
    recompute="auto" is refused at the first forward; turned off inside the context,
    training goes on exactly, and on exit every module's hooks are as they were."""
    base = _llama()
    ref = copy.deepcopy(base)
    ref(input_ids=_IDS, labels=_IDS).loss.backward()
    model = copy.deepcopy(base)
    model.gradient_checkpointing_enable()

    def hooks() -> dict[str, Any]:
        return {
            n: (dict(m._forward_pre_hooks), dict(m._forward_hooks))
            for n, m in model.named_modules()
        }

    before = hooks()
    with offload_context("disk", save_dir, model=model, recompute="auto") as engine:
        with pytest.raises(OffloadError, match="gradient checkpointing"):
            model(input_ids=_IDS, labels=_IDS)
        model.gradient_checkpointing_disable()
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=_IDS, labels=_IDS).loss
        engine.flush()
        loss.backward()
    _assert_same([[p.grad for p in ref.parameters()]], [[p.grad for p in model.parameters()]])
    assert not _wrapped(model)
    assert hooks() == before
    assert list(save_dir.iterdir()) == []


# -- the model changed, the body raising, async -----------------------------------------


@pytest.mark.parametrize("mode", ["full", "policy"])
def test_a_model_moved_to_another_dtype_inside_the_context(save_dir: Path, mode: str) -> None:
    """``model.double()`` between two steps inside the context (a new optimizer on the
    moved parameters): the steps before and after train as without the library."""
    base = _tiny()

    def train(model: nn.Module, ctx: OffloadContext) -> Grads:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with ctx:
            for step in range(4):
                if step == 2:
                    model.double()
                    opt = torch.optim.SGD(model.parameters(), lr=0.05)
                tokens, targets = make_batch(2, 16, vocab=64, seed=step)
                opt.zero_grad()
                model(tokens, targets).backward()
                opt.step()
        return _params(model)

    ref = train(copy.deepcopy(base), offload_context(None))
    model = copy.deepcopy(base)
    got = train(model, _context(save_dir, model, _RECOMPUTE[mode]))
    assert got[0].dtype == torch.float64
    _assert_same([ref], [got])
    assert list(save_dir.iterdir()) == []


@pytest.mark.parametrize("mode", ["full", "policy"])
def test_a_body_that_raises_leaves_a_usable_graph_and_a_clean_folder(
    save_dir: Path, mode: str
) -> None:
    """NOTE [record lifetime]: the body raises after a forward whose saved tensors were
    written: the exception propagates, the blocks are restored, the folder is empty and
    the engine closed, yet the pending graph backwards exactly after the exit; a new
    context on the same model and folder then trains exactly."""
    base = _tiny()
    tokens, targets = make_batch(2, 16, vocab=64, seed=0)
    ref = copy.deepcopy(base)
    ref(tokens, targets).backward()
    ref_grads = [[p.grad for p in ref.parameters()]]
    model = copy.deepcopy(base)
    with pytest.raises(KeyError, match="boom"):
        with _context(save_dir, model, _RECOMPUTE[mode]) as engine:
            loss = model(tokens, targets)
            engine.flush()
            assert engine.stats().tensors_offloaded > 0
            raise KeyError("boom")
    assert list(save_dir.iterdir()) == [] and engine.closed
    assert not _wrapped(model)
    loss.backward()
    _assert_same(ref_grads, [[p.grad for p in model.parameters()]])
    model.zero_grad(set_to_none=True)
    with _context(save_dir, model, _RECOMPUTE[mode]):
        model(tokens, targets).backward()
    _assert_same(ref_grads, [[p.grad for p in model.parameters()]])
    assert list(save_dir.iterdir()) == []


async def test_async_with_recompute_and_aflush(save_dir: Path) -> None:
    """``async with`` and ``await engine.aflush()`` under recompute="full": the
    gradients are exact, the engine closed and the blocks restored on exit."""
    base = _tiny()
    tokens, targets = make_batch(2, 16, vocab=64, seed=0)
    ref = copy.deepcopy(base)
    ref(tokens, targets).backward()
    model = copy.deepcopy(base)
    async with _context(save_dir, model, "full") as engine:
        loss = model(tokens, targets)
        await engine.aflush()
        loss.backward()
    assert engine.closed and engine.stats().tensors_offloaded > 0
    _assert_same([[p.grad for p in ref.parameters()]], [[p.grad for p in model.parameters()]])
    assert not _wrapped(model)
    assert list(save_dir.iterdir()) == []


@pytest.mark.parametrize("recompute", [None, "full"])
def test_an_optimizer_step_between_two_backwards_of_a_retained_graph_raises(
    save_dir: Path, recompute: str | None
) -> None:
    """An optimizer step writes the parameters a retained graph saved (read back from
    disk, or recomputed from): the second backward raises autograd's own error, not a
    silently wrong gradient."""
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, targets = make_batch(2, 16, vocab=64, seed=0)
    with _context(save_dir, model, recompute) as engine:
        loss = model(tokens, targets)
        engine.flush()
        loss.backward(retain_graph=True)
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    assert not _wrapped(model)


# -- configs ---------------------------------------------------------------------------


def test_a_config_round_trips_through_pickle_asdict_and_the_mapping_entry(
    save_dir: Path,
) -> None:
    """A config with every byte size given survives pickle (equal, same hash), a
    field-less ``dataclasses.replace``, a replace of another field (the user's
    host_budget stays) and ``offload_context_from_config(dataclasses.asdict(cfg))``,
    whose context trains exactly; ``OffloadContext(cfg)`` keeps the very config."""
    cfg = OffloadConfig(
        target="disk",
        save_dir=str(save_dir),
        device_budget="1MiB",
        host_budget="2MiB",
        prefetch_bytes="1MiB",
        heap_trim_bytes="64MiB",
        prefetch_depth=2,
    )
    loaded = pickle.loads(pickle.dumps(cfg))
    assert loaded == cfg and hash(loaded) == hash(cfg)
    assert dataclasses.replace(cfg) == cfg
    assert dataclasses.replace(cfg, prefetch_depth=3).host_budget == 2 << 20
    ctx = offload_context_from_config(dataclasses.asdict(cfg), device="cpu")
    assert ctx.config == cfg
    x = torch.randn(1 << 15, requires_grad=True)
    with ctx:
        (x * 2).sin().sum().backward()
    assert torch.equal(x.grad, 2 * (x.detach() * 2).cos())
    assert OffloadContext(cfg).config is cfg
    assert list(save_dir.iterdir()) == []
