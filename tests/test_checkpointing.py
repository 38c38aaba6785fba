"""checkpointing.py: selective checkpointing whose *_CPU_OFFLOAD outputs go through the engine.

Every test compares gradients bit for bit with training without offload or checkpointing.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import ReturnsLogits, slow_store
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from prefetch_offload import OffloadError, offload_context, recompute_planner, recompute_profile
from prefetch_offload import recompute as recompute_module
from prefetch_offload.checkpointing import CheckpointStats, PolicyDecider, draws_random
from prefetch_offload.testing import TinyTransformer, make_batch, warm_up_unary_ops

P = CheckpointPolicy
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


@pytest.fixture(autouse=True, scope="module")
def _unary_warm() -> None:
    warm_up_unary_ops()  # NOTE [first unary call]


def _model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(vocab=64, width=32, depth=4, heads=2)


def _grads(
    model: nn.Module, steps: int = 2, *, flush: Any = None, backwards: int = 1
) -> list[list[torch.Tensor]]:
    """Each step's gradients, after each of ``backwards`` backwards (all but the last
    with ``retain_graph=True``)."""
    out = []
    for step in range(steps):
        tokens, targets = make_batch(2, 16, vocab=64, seed=step)
        model.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        if flush is not None:
            flush()  # on disk before backward: the reads run (NOTE [write tail])
        for n in range(backwards):
            loss.backward(retain_graph=n < backwards - 1)
            out.append([p.grad.clone() for p in model.parameters()])
    return out


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(
        torch.equal(x, y) for ga, gb in zip(a, b, strict=True) for x, y in zip(ga, gb, strict=True)
    )


def _matmuls_offloaded(must: bool = False) -> Callable[..., CheckpointPolicy]:
    offload = P.MUST_CPU_OFFLOAD if must else P.PREFER_CPU_OFFLOAD

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return offload if op in _MATMULS else P.PREFER_RECOMPUTE

    return policy


def _saves_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return P.MUST_SAVE if op in _MATMULS else P.PREFER_RECOMPUTE


@pytest.mark.parametrize("target", ["disk", "cpu"])
def test_offloaded_outputs_go_through_the_engine_bit_identical(tmp_path: Path, target: str) -> None:
    ref = _grads(_model())
    model = _model()
    with offload_context(
        target,
        str(tmp_path) if target == "disk" else None,
        model=model,
        recompute=_matmuls_offloaded(),
        min_offload_bytes=0,
    ) as engine:
        got = _grads(model, flush=engine.flush)
        stats = engine.stats()
    assert _same(ref, got)
    assert stats.step_bytes_offloaded > 0 and stats.step_bytes_recomputed > 0
    assert stats.step_bytes_kept == 0
    if target == "disk":
        assert stats.bytes_read > 0  # the matmul outputs were read back for the recompute
    plan = engine.recompute_plan()
    assert plan is not None and plan.mode == "policy"
    choices = {d.op: d.choice for d in plan.ops}
    assert choices["aten.addmm.default"] == "offload"
    assert choices["aten.gelu.default"] == "recompute"
    assert "aten.addmm.default" in str(plan)


def test_offloaded_outputs_come_back_in_the_learned_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recompute unpacks its block's offloaded outputs in forward order, the blocks in
    reverse: reverse pack order prefetches each block's last output first. From the
    second step the engine prefetches in the order the step before read them, so the
    next block's reads run while this block's backward computes."""
    ref = _grads(_model(), steps=3)
    model = _model()

    def backward_computes(block: nn.Module, args: Any, out: torch.Tensor) -> None:
        if out.requires_grad:  # 30 ms of "compute" before each block's backward
            out.register_hook(lambda grad: time.sleep(0.03))

    for block in model.blocks:
        block.register_forward_hook(backward_computes)
    rates, got = [], []
    with offload_context(
        "disk", str(tmp_path), model=model, recompute=_matmuls_offloaded(), min_offload_bytes=0
    ) as engine:
        slow_store(engine, monkeypatch, "read", 0.003)  # a late read waits for its own
        for step in range(3):
            tokens, targets = make_batch(2, 16, vocab=64, seed=step)
            model.zero_grad(set_to_none=True)
            loss = model(tokens, targets)
            engine.flush()  # every output on disk: each unpack is a read
            before = engine.stats()
            loss.backward()
            after = engine.stats()
            hits = after.prefetch_hits - before.prefetch_hits
            misses = after.prefetch_misses - before.prefetch_misses
            rates.append(hits / (hits + misses))
            got.append([p.grad.clone() for p in model.parameters()])
        assert after.step_bytes_offloaded > 0 and after.predicted_steps == 2
    assert _same(ref, got)
    # Reverse order: about half the reads late (18 of 33 in time, one run); learned: all
    # but the first block's and the head's (26-29 of 33).
    assert min(rates[1:]) >= max(0.7, rates[0] + 0.15), rates


def test_saved_outputs_stay_in_memory_and_nothing_of_them_is_written(tmp_path: Path) -> None:
    ref = _grads(_model())
    model = _model()
    with offload_context(
        "disk", str(tmp_path), model=model, recompute=_saves_matmuls, min_offload_bytes=1 << 30
    ) as engine:  # the block inputs stay too: nothing reaches the disk
        got = _grads(model, flush=engine.flush)
        stats = engine.stats()
    assert _same(ref, got)
    assert stats.step_bytes_kept > 0 and stats.step_bytes_offloaded == 0
    assert stats.bytes_offloaded == 0


def test_prefer_offload_stays_within_device_budget_and_must_offload_leaves(
    tmp_path: Path,
) -> None:
    ref = _grads(_model())
    moved = {}
    for must in (False, True):
        model = _model()
        with offload_context(
            "disk",
            str(tmp_path),
            model=model,
            recompute=_matmuls_offloaded(must),
            min_offload_bytes=0,
            device_budget="1GiB",
        ) as engine:
            got = _grads(model, flush=engine.flush)
            moved[must] = engine.stats().bytes_offloaded
        assert _same(ref, got)
    assert moved[False] == 0  # everything fits the budget: PREFER_* stays
    assert moved[True] > 0  # MUST_* leaves the device whatever the budget


def test_checkpoint_context_fn_for_users_who_call_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(8, 64, requires_grad=True)
    block(x).sum().backward()
    ref = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad(set_to_none=True)
    with offload_context("disk", str(tmp_path), min_offload_bytes=0) as engine:
        for policy in (_matmuls_offloaded(), [torch.ops.aten.addmm.default]):
            x.grad = None
            block.zero_grad(set_to_none=True)
            context_fn = functools.partial(engine.checkpoint_context_fn, policy)
            y = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
            engine.flush()
            y.sum().backward()
            got = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
        assert engine.stats().bytes_read > 0
        with pytest.raises(TypeError, match="OpOverloads"):
            engine.checkpoint_context_fn([torch.ops.aten.mm])
        with pytest.raises(TypeError, match="policy callable"):
            engine.checkpoint_context_fn(3)  # type: ignore[arg-type]


class _TwoDropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Out-of-place draws (as CUDA's native_dropout): a stored mask is safe to reuse.
        h = self.a(x)
        h = h * torch.bernoulli(torch.full_like(h, 0.5)) * 2
        h = self.b(h)
        return h * torch.bernoulli(torch.full_like(h, 0.5)) * 2 + x


def _dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_TwoDropouts() for _ in range(3)])


@pytest.mark.parametrize("first", [P.MUST_SAVE, P.PREFER_CPU_OFFLOAD, P.PREFER_RECOMPUTE])
def test_dropout_masks_match_when_one_random_op_is_stored(
    tmp_path: Path, first: CheckpointPolicy
) -> None:
    """NOTE [random ops]: the first dropout stored, the second recomputed: the second's
    mask must come from the same RNG state as in forward."""

    calls = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is torch.ops.aten.bernoulli.default:
            calls.append(op)
            return first if len(calls) % 2 == 1 else P.PREFER_RECOMPUTE
        return P.PREFER_RECOMPUTE

    def run(model: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        x = torch.randn(16, 64, requires_grad=True)
        model(x).sum().backward()
        return [x.grad] + [p.grad for p in model.parameters()]

    ref = run(_dropout_model())
    model = _dropout_model()
    with offload_context("disk", str(tmp_path), model=model, recompute=policy, min_offload_bytes=0):
        got = run(model)
    assert len(calls) == 6  # two draws per block, three blocks
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def test_nn_dropout_under_every_recompute_mode(tmp_path: Path) -> None:
    """nn.functional.dropout (on the CPU: empty_like, bernoulli_, div_, mul) in a block,
    with "auto" over three steps and "full": gradients as without checkpointing."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(torch.relu(self.lin(x)), 0.3, training=True) + x

    def run(model: nn.Module) -> list[list[torch.Tensor]]:
        torch.manual_seed(1)
        out = []
        for _ in range(3):
            x = torch.randn(32, 64, requires_grad=True)
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
            out.append([x.grad] + [p.grad.clone() for p in model.parameters()])
        return out

    torch.manual_seed(0)
    base = nn.Sequential(*[Block() for _ in range(4)])
    ref = run(copy.deepcopy(base))
    for mode in ("auto", "full", _matmuls_offloaded()):
        model = copy.deepcopy(base)
        with offload_context(
            "disk", str(tmp_path), model=model, recompute=mode, min_offload_bytes=0
        ):
            assert _same(ref, run(model)), mode


class _MutatesSaved(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        z = torch.sigmoid(y)
        y.add_(1)  # the saved mul output, modified after it was stored
        return self.lin(z) + y


def test_a_stored_output_modified_in_place_raises(tmp_path: Path) -> None:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return P.MUST_SAVE if op is torch.ops.aten.mul.Tensor else P.PREFER_RECOMPUTE

    model = nn.Sequential(_MutatesSaved(), _MutatesSaved())
    x = torch.randn(4, 8, requires_grad=True)
    with offload_context("disk", str(tmp_path), model=model, recompute=policy):
        loss = model(x).sum()
        with pytest.raises(OffloadError, match="modified in place"):
            loss.backward()


class _ScalesMatmul(nn.Module):
    """``x @ w`` on a 3-d input runs ``mm`` then ``_unsafe_view`` of its output (a
    version counter of its own); ``mul_`` then changes the mm output's memory."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 32) / 4)
        self.w2 = nn.Parameter(torch.randn(32, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        h.mul_(2.0)
        g = torch.bmm(x, self.w[:, :16][None].expand(x.shape[0], 16, 16))
        g.add_(1.0)  # a bmm output changed directly: its own counter moves
        return x + h @ self.w2 + g


def _mutating_grads(model: nn.Module, steps: int) -> list[list[torch.Tensor]]:
    out = []
    for step in range(steps):
        torch.manual_seed(step)
        x = torch.randn(2, 8, 16, requires_grad=True)
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        out.append([*(p.grad.clone() for p in model.parameters()), x.grad])
    return out


def _trained_under(
    tmp_path: Path, target: str, block: Callable[[], nn.Module], policy: Any
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], Any, Any]:
    """Two steps of three blocks without offload, and under ``policy`` (the reference
    gradients, the gradients, the engine's stats and plan)."""
    torch.manual_seed(0)
    ref_model = nn.Sequential(*(block() for _ in range(3)))
    model = copy.deepcopy(ref_model)
    ref = _mutating_grads(ref_model, 2)
    where = str(tmp_path) if target == "disk" else None
    with offload_context(
        target, where, model=model, recompute=policy, min_offload_bytes=0
    ) as engine:
        got = _mutating_grads(model, 2)
        return ref, got, engine.stats(), engine.recompute_plan()


@pytest.mark.parametrize("target", ["disk", "cpu"])
@pytest.mark.parametrize("store", [P.PREFER_CPU_OFFLOAD, P.PREFER_SAVE])
def test_a_stored_output_written_later_in_the_forward_is_recomputed(
    tmp_path: Path, target: str, store: CheckpointPolicy
) -> None:
    """NOTE [cache entry mutation]: a PREFER_* output whose memory a later op of the
    forward writes (through an _unsafe_view, or directly) is recomputed instead."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return store if op in _MATMULS else P.PREFER_RECOMPUTE

    ref, got, stats, _ = _trained_under(tmp_path, target, _ScalesMatmul, policy)
    assert _same(ref, got)
    # Three matmuls a block; the two written later are recomputed instead, the third
    # (``h @ w2``: 2 x 8 x 16 floats) stays stored.
    assert stats.step_bytes_kept + stats.step_bytes_offloaded == 3 * 2 * 8 * 16 * 4


class _InPlace(nn.Module):
    """A ReLU in place on a linear's output, and a residual added in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.act(self.a(x)))
        h += x
        return h.sin()


@pytest.mark.parametrize("target", ["disk", "cpu"])
@pytest.mark.parametrize("store", [P.PREFER_CPU_OFFLOAD, P.PREFER_SAVE, P.MUST_SAVE, True])
def test_ops_that_write_their_inputs_run_again_whatever_the_policy(
    tmp_path: Path, target: str, store: CheckpointPolicy | bool
) -> None:
    """NOTE [ops that write their inputs]: an in-place op's stored output returned in the
    recompute would leave the recompute's own tensor unwritten (a bool policy too)."""
    in_place = (torch.ops.aten.relu_.default, torch.ops.aten.add_.Tensor)
    asked = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy | bool:
        asked.append(op)
        if store in (P.MUST_SAVE, True):  # a MUST on an op whose output is written raises
            return store if op in in_place else P.PREFER_RECOMPUTE
        return store

    ref, got, _, plan = _trained_under(tmp_path, target, _InPlace, policy)
    assert _same(ref, got)
    assert set(in_place) <= set(asked)  # the policy was asked, and overruled
    assert {d.op: d.choice for d in plan.ops}["aten.relu_.default"] == "recompute"


class _CountsCalls(nn.Module):
    """A buffer counted up in place each forward, as batch norm's num_batches_tracked."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.lin(x).relu()


@pytest.mark.parametrize("stored", [P.PREFER_SAVE, P.PREFER_CPU_OFFLOAD])
@pytest.mark.parametrize("allow", [False, True])
def test_a_write_to_memory_the_block_did_not_make_follows_the_policy(
    tmp_path: Path, allow: bool, stored: CheckpointPolicy
) -> None:
    """NOTE [ops that write their inputs]: a buffer's in-place count is not forced to run
    again (it would count twice). Stored, kept or offloaded, its version moved with the
    write itself: the recompute raises, unless allow_cache_entry_mutation=True, which
    returns it as it is (an offloaded one unchecked by the engine too)."""

    def saves_writes(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return stored if op._schema.is_mutable else P.PREFER_RECOMPUTE

    torch.manual_seed(0)
    ref_model = nn.Sequential(_CountsCalls(), _CountsCalls())
    mods = [copy.deepcopy(m) for m in ref_model]
    ref = _mutating_grads(ref_model, 2)
    with offload_context("disk", str(tmp_path), min_offload_bytes=0) as engine:
        context_fn = functools.partial(
            engine.checkpoint_context_fn, saves_writes, allow_cache_entry_mutation=allow
        )

        def grads(steps: int) -> list[list[torch.Tensor]]:
            out = []
            for step in range(steps):
                torch.manual_seed(step)
                x = torch.randn(2, 8, 16, requires_grad=True)
                for m in mods:
                    m.zero_grad(set_to_none=True)
                y = x
                for m in mods:
                    y = checkpoint(m, y, use_reentrant=False, context_fn=context_fn)
                y.square().sum().backward()
                out.append([*(p.grad.clone() for m in mods for p in m.parameters()), x.grad])
            return out

        if not allow:
            with pytest.raises(OffloadError, match="modified in place before its recompute"):
                grads(1)
            return
        got = grads(2)
    assert _same(ref, got)
    assert [int(m.calls) for m in mods] == [2, 2]  # once a step, not again in the recompute


@pytest.mark.parametrize("min_offload_bytes", [0, None])
@pytest.mark.parametrize("stored", [P.PREFER_SAVE, P.PREFER_CPU_OFFLOAD, P.MUST_CPU_OFFLOAD])
def test_a_stored_output_written_after_the_block_returned_is_made_again(
    tmp_path: Path, stored: CheckpointPolicy, min_offload_bytes: int | None
) -> None:
    """NOTE [cache entry mutation]: the logits, stored and then halved in place by the
    code after the block (legal without checkpointing), would reach the recompute of
    the sum halved. Kept in memory or offloaded (the engine's version probe made inside
    the dispatch mode shares their counter), the change is seen: a ``PREFER_*`` choice
    makes them again (the gradients are exact), a ``MUST_*`` one raises."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return stored if op is torch.ops.aten.addmm.default else P.PREFER_RECOMPUTE

    def step(block: nn.Module, x: torch.Tensor, context_fn: Any = None) -> list[torch.Tensor]:
        if context_fn is None:
            logits, y = block(x)
        else:
            logits, y = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
        logits.mul_(0.5)
        (y.square().sum() + logits.sum()).backward()
        return [x.grad, *(p.grad for p in block.parameters())]

    torch.manual_seed(0)
    block = ReturnsLogits()
    ref_block = copy.deepcopy(block)
    x = torch.randn(4, 16)
    ref = step(ref_block, x.clone().requires_grad_())
    tuning = {} if min_offload_bytes is None else {"min_offload_bytes": min_offload_bytes}
    with offload_context("disk", str(tmp_path), **tuning) as engine:
        context_fn = functools.partial(engine.checkpoint_context_fn, policy)
        if stored is P.MUST_CPU_OFFLOAD:
            with pytest.raises(OffloadError, match="modified in place before its recompute"):
                step(block, x.clone().requires_grad_(), context_fn)
            return
        got = step(block, x.clone().requires_grad_(), context_fn)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


@pytest.mark.parametrize("must", [P.MUST_CPU_OFFLOAD, P.MUST_SAVE])
def test_a_must_output_written_later_in_the_forward_raises(
    tmp_path: Path, must: CheckpointPolicy
) -> None:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return must if op is torch.ops.aten.mm.default else P.PREFER_RECOMPUTE

    model = nn.Sequential(_ScalesMatmul(), _ScalesMatmul())
    x = torch.randn(2, 8, 16, requires_grad=True)
    with offload_context("disk", str(tmp_path), model=model, recompute=policy):
        loss = model(x).sum()
        with pytest.raises(OffloadError, match="through a tensor over the same memory"):
            loss.backward()


def test_only_a_write_over_a_stored_output_s_bytes_counts() -> None:
    """NOTE [cache entry mutation]: the bytes written are compared with the stored
    output's, not only the storage (a preallocated buffer holds other things too)."""
    from prefetch_offload.checkpointing import _Saving

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return P.PREFER_SAVE

    stats = CheckpointStats()
    storage: dict[Any, Any] = {}
    saving = _Saving(PolicyDecider(policy), None, storage, stats, [0, 0, 0, 0])
    buffer = torch.zeros(16)
    first, second, middle = buffer[:8], buffer[8:], buffer[4:12]
    with saving:
        torch.ops.aten.alias.default(first)  # a stored output over bytes 0-31
    (key,) = storage
    with saving:
        second.add_(1)  # beside it
    assert storage[key] is not _recompute_mark()
    with saving:
        middle.add_(1)  # over half of it
    assert storage[key] is _recompute_mark()


def _recompute_mark() -> Any:
    from prefetch_offload import checkpointing

    return checkpointing._RECOMPUTE


def test_a_wrapper_subclass_in_a_selective_block_is_left_to_its_version_counter(
    tmp_path: Path,
) -> None:
    """A tensor subclass (as DTensor) has no memory of its own to compare: the write
    check passes over it instead of failing on its storage."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    w = torch.randn(4, 4, requires_grad=True)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return P.PREFER_SAVE if op is torch.ops.aten.mm.default else P.PREFER_RECOMPUTE

    def f(x: torch.Tensor) -> torch.Tensor:
        h = (x @ w) * 1.5
        h.mul_(2)
        return h.sum()

    x = two_tensor.TwoTensor(torch.randn(3, 4), torch.randn(3, 4)).requires_grad_()
    f(x).backward()
    want, w.grad = w.grad.clone(), None
    with offload_context("disk", str(tmp_path)) as engine:
        out = checkpoint(
            f,
            x,
            use_reentrant=False,
            context_fn=functools.partial(engine.checkpoint_context_fn, policy),
        )
        out.backward()
    assert torch.equal(w.grad, want)


def test_auto_recomputes_what_the_forward_writes_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The automatic plan's profiling step offloads every output, and a selective plan
    offloads matmul outputs: those written later are recomputed, bit-identical."""

    monkeypatch.setattr(recompute_module, "OFFLOAD_ALONE", False)
    monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", 0.0)  # selective on a toy
    monkeypatch.setattr(recompute_planner, "SELECTIVE_MARGIN", 0.0)
    torch.manual_seed(0)
    ref_model = nn.Sequential(*(_ScalesMatmul() for _ in range(4)))
    model = copy.deepcopy(ref_model)
    ref = _mutating_grads(ref_model, 9)
    with offload_context("disk", str(tmp_path), model=model, recompute="auto", min_offload_bytes=0):
        got = _mutating_grads(model, 9)
    assert _same(ref, got)


class _CastBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class _RunsBlocksTwice(nn.Module):
    """Under autocast each block runs twice, its weights cast once (autocast's cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(32, 32)
        self.layers = nn.ModuleList(_CastBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.pre(x)
            for _ in range(2):
                for layer in self.layers:
                    h = layer(h)
            return h.float()


@pytest.mark.parametrize("recompute", ["matmuls", "recompute_all", "auto"])
def test_autocast_s_cached_weight_casts_keep_the_op_keys(
    tmp_path: Path, recompute: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [autocast casts]: the second run of a block gets its weights' casts from
    autocast's cache in forward, and casts again in the recompute."""

    monkeypatch.setattr(recompute_module, "OFFLOAD_ALONE", False)
    monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", 0.0)  # selective on a toy
    monkeypatch.setattr(recompute_planner, "SELECTIVE_MARGIN", 0.0)
    torch.manual_seed(0)
    ref_model = _RunsBlocksTwice()
    model = copy.deepcopy(ref_model)

    def grads(m: nn.Module, steps: int) -> list[list[torch.Tensor]]:
        out = []
        for step in range(steps):
            torch.manual_seed(step)
            x = torch.randn(16, 32, requires_grad=True)
            m.zero_grad(set_to_none=True)
            m(x).square().sum().backward()
            out.append([*(p.grad.clone() for p in m.parameters()), x.grad])
        return out

    policies: dict[str, Any] = {
        "matmuls": _matmuls_offloaded(),
        "recompute_all": lambda ctx, op, *a, **k: P.PREFER_RECOMPUTE,
        "auto": "auto",
    }
    steps = len(recompute_profile.PROFILE) + 2 if recompute == "auto" else 2
    ref = grads(ref_model, steps)
    with offload_context(
        "disk",
        str(tmp_path),
        model=model,
        recompute=policies[recompute],
        recompute_blocks=[_CastBlock],
        min_offload_bytes=0,
    ):
        got = grads(model, steps)
    assert _same(ref, got)


def test_a_second_recompute_of_a_block_whose_outputs_were_kept_is_refused(
    tmp_path: Path,
) -> None:
    model = _model()
    tokens, targets = make_batch(2, 16, vocab=64)
    with offload_context("disk", str(tmp_path), model=model, recompute=_saves_matmuls):
        loss = model(tokens, targets)
        loss.backward(retain_graph=True)
        with pytest.raises(OffloadError, match="recomputed a second time"):
            loss.backward()


@pytest.mark.parametrize("recompute", ["policy", "auto"])
def test_offloaded_outputs_serve_a_second_backward(
    tmp_path: Path, recompute: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """retain_graph=True: the second backward recomputes each block again and reads its
    offloaded outputs again; both backwards bit-identical to plain autograd's. Under
    "auto" every profiling step and the plan see it."""

    monkeypatch.setattr(recompute_module, "OFFLOAD_ALONE", False)
    monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", 0.0)  # selective on a toy
    monkeypatch.setattr(recompute_planner, "SELECTIVE_MARGIN", 0.0)

    steps = len(recompute_profile.PROFILE) + 2 if recompute == "auto" else 2
    ref = _grads(_model(), steps, backwards=2)
    model = _model()
    policy: Any = "auto" if recompute == "auto" else _matmuls_offloaded()
    with offload_context(
        "disk", str(tmp_path), model=model, recompute=policy, min_offload_bytes=0
    ) as engine:
        got = _grads(model, steps, flush=engine.flush, backwards=2)
        stats = engine.stats()
    assert _same(ref, got)
    assert stats.bytes_read > 0
    if recompute == "policy":  # (auto's plan may end plain; its profile offloaded all)
        assert stats.step_bytes_offloaded > 0


def test_a_policy_that_returns_something_else_is_a_type_error(tmp_path: Path) -> None:
    model = _model()
    tokens, targets = make_batch(2, 16, vocab=64)
    with offload_context("disk", str(tmp_path), model=model, recompute=lambda *a, **k: "save"):
        with pytest.raises(TypeError, match="CheckpointPolicy"):
            model(tokens, targets)


def test_bool_policies_are_read_as_torch_reads_them(tmp_path: Path) -> None:
    ref = _grads(_model())
    model = _model()
    with offload_context(
        "disk", str(tmp_path), model=model, recompute=lambda ctx, op, *a, **k: op in _MATMULS
    ) as engine:
        got = _grads(model)
    assert _same(ref, got)
    assert engine.stats().step_bytes_kept > 0


def test_a_model_with_recompute_full_offloads_block_inputs_only(tmp_path: Path) -> None:
    ref = _grads(_model())
    model = _model()
    with offload_context(
        "disk", str(tmp_path), model=model, recompute="full", min_offload_bytes=0
    ) as engine:
        got = _grads(model, flush=engine.flush)
        stats = engine.stats()
    assert _same(ref, got)
    assert engine.recompute_plan() is None
    # Four block inputs per step (plus what is saved outside the blocks) reach the engine.
    assert 4 <= stats.tensors_offloaded < 40
    model_copy = copy.deepcopy(model)
    assert all("forward" not in b.__dict__ for b in model_copy.blocks)


def test_recompute_full_counts_every_op_output_as_recomputed_per_step(tmp_path: Path) -> None:
    """NOTE [plain blocks counted]: a block checkpointed whole recomputes what a policy
    that recomputes every op does, and step_bytes_recomputed says so, per step."""

    def recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return P.PREFER_RECOMPUTE

    per_step: dict[str, list[tuple[int, int, int]]] = {}
    for name, recompute in (("full", "full"), ("policy", recompute_all)):
        model = _model()
        with offload_context("disk", str(tmp_path / name), model=model, recompute=recompute) as e:
            seen = []
            for seq in (16, 16, 8):  # a shorter batch: fewer bytes
                tokens, targets = make_batch(2, seq, vocab=64, seed=0)
                model(tokens, targets).backward()
                s = e.stats()
                seen.append((s.step_bytes_kept, s.step_bytes_offloaded, s.step_bytes_recomputed))
        per_step[name] = seen
    full = per_step["full"]
    assert full == per_step["policy"]
    assert all(kept == offloaded == 0 for kept, offloaded, _ in full)
    assert full[0][2] == full[1][2] > full[2][2] > 0  # per step, not summed over steps


def test_recompute_full_counts_each_block_and_call_signature_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [plain blocks counted]: the counting mode runs the first time a block sees
    a call signature; later calls reuse the sum (and the step's figure is the same)."""
    from prefetch_offload import checkpointing

    made: list[Any] = []

    class Counting(checkpointing._Counting):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self.key)

    monkeypatch.setattr(checkpointing, "_Counting", Counting)
    model = _model()
    recomputed = []
    with offload_context("disk", str(tmp_path), model=model, recompute="full") as engine:
        for seq in (16, 16, 8, 16, 8):
            tokens, targets = make_batch(2, seq, vocab=64, seed=0)
            model(tokens, targets).backward()
            recomputed.append(engine.stats().step_bytes_recomputed)
    assert len(made) == 2 * 4  # two lengths, four blocks
    assert len(set(made)) == 8 and all(key is not None for key in made)
    assert recomputed[0] == recomputed[1] == recomputed[3] > recomputed[2] == recomputed[4] > 0


def test_attention_with_dropout_p_zero_does_not_count_as_random() -> None:
    """NOTE [random ops]: the CPU's fused attention carries the seeded tag for its
    dropout; at dropout_p=0 it draws nothing, so a stored output is not run again."""
    q = torch.randn(1, 2, 8, 4)
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert not draws_random(sdpa, (q, q, q, 0.0), {})
    assert not draws_random(sdpa, (q, q, q), {})  # the default, 0
    assert draws_random(sdpa, (q, q, q), {"dropout_p": 0.1})
    assert draws_random(torch.ops.aten.bernoulli.default, (q,), {})
    assert not draws_random(torch.ops.aten.mm.default, (q, q), {})


@pytest.mark.parametrize("timing", [True, False])
def test_the_modes_report_their_own_time_beyond_the_ops_per_timed_pass(timing: bool) -> None:
    """NOTE [dispatch cost]: each pass through a mode (forward, recompute) that the
    decider times reports the time in ``__torch_dispatch__`` less the ops' own: here a
    decider that sleeps 1 ms per op is counted, the block's 200 ms outside its ops is
    not. A pass the decider does not time reports nothing."""
    from prefetch_offload.checkpointing import CheckpointStats, PolicyDecider, selective_contexts

    passes: list[float] = []

    class Slow(PolicyDecider):
        def decide(self, *a: Any) -> CheckpointPolicy:
            time.sleep(0.001)
            return P.PREFER_RECOMPUTE

        def timing(self) -> bool:
            return timing

        def dispatched(self, block: tuple[str, int], seconds: float) -> None:
            passes.append(seconds)

    def body(x: torch.Tensor) -> torch.Tensor:
        y = torch.mm(x, x)  # one op under the modes
        time.sleep(0.2)  # outside the modes: not the dispatch's
        return y

    decider = Slow(lambda *a, **k: P.PREFER_RECOMPUTE)
    x = torch.randn(4, 4, requires_grad=True)
    out = checkpoint(
        body,
        x,
        use_reentrant=False,
        context_fn=lambda: selective_contexts(decider, None, CheckpointStats()),
    )
    out.sum().backward()
    if not timing:
        assert passes == []
        return
    assert len(passes) == 2  # the forward, then the recompute
    assert 0.001 <= passes[0] < 0.2  # the decider's sleep, not the body's
    assert 0.0 < passes[1] < 0.2


def test_checkpoint_stats_per_step_and_a_step_without_checkpointed_ops_counts_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call counts as its recompute begins (NOTE [counted at the recompute]): a call
    replayed inside backward (a reentrant outer checkpoint's) in its backward pass; the
    others in the step that the first count after a checkpointed forward outside
    backward began; with step_began (the automatic plan), in its step. A step that
    recomputed nothing reports zeros once its backward ended, the step before until
    then. A call counted already (a kept graph's next backward) counts nothing more."""
    from prefetch_offload import checkpointing
    from prefetch_offload.checkpointing import CheckpointStats

    task = [7]
    monkeypatch.setattr(checkpointing, "_graph_task_id", lambda: task[0])
    stats = CheckpointStats()
    assert stats.last_step() == (0, 0, 0)
    stats.forward_began()  # an evaluation forward: its calls never count
    first = [0, 100, 10, 1]  # offloaded, recomputed; replayed
    stats.recompute_began(first)
    stats.recompute_began([5, 0, 0, 1])  # the same backward pass
    assert stats.last_step() == (5, 100, 10)
    task[0] = 8  # the graph kept: its next backward
    stats.recompute_began(first)
    assert stats.last_step() == (5, 100, 10)
    stats.recompute_began([7, 0, 0, 1])  # another backward pass: another step
    assert stats.last_step() == (7, 0, 0)
    stats.forward_began()  # two forwards, then their backwards: one step
    stats.forward_began()
    stats.recompute_began([0, 0, 2, 0])
    task[0] = 10
    stats.recompute_began([0, 0, 3, 0])
    assert stats.last_step() == (0, 0, 5)
    stats.step_began()  # from here the plan says when steps begin
    assert stats.last_step() == (0, 0, 0)  # (the step before counted under no plan step)
    stats.recompute_began([0, 0, 5, 0])
    task[0] = 11
    stats.recompute_began([0, 0, 1, 0])  # another pass, the same step (accumulation)
    assert stats.last_step() == (0, 0, 6)
    stats.step_began()  # a step of whole blocks: no checkpointed op
    assert stats.last_step() == (0, 0, 6)  # the step before is the last finished one
    stats.step_ended()  # its backward ended: it is the last finished one now
    assert stats.last_step() == (0, 0, 0)
    stats.step_began()
    assert stats.last_step() == (0, 0, 0)
