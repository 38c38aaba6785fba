"""recompute= on models and training loops beyond the toy transformer.

Blocks called several times a forward or calling each other, gradient accumulation,
evaluation forwards between steps, frozen blocks, keyword, tuple and dict arguments and
outputs, integer and view outputs, in-place writes around and inside blocks, exceptions
in forward, in the recompute or in a policy, double backward and gradient penalties,
random ops, module hooks, BatchNorm, complex and channels-last tensors, RNN cells: under
"full", "auto" (as users get it, or forced to plan selective blocks) and several
policies, every step's gradients are bit-identical to training without offload or
checkpointing, and the model is restored on exit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from engine_helpers import ReturnsLogits
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from prefetch_offload import (
    OffloadEngine,
    OffloadError,
    OffloadFallbackWarning,
    OffloadStats,
    offload_context,
    recompute,
    recompute_planner,
    recompute_profile,
)
from prefetch_offload.blocks import WHOLE
from prefetch_offload.recompute import RecomputePlan
from prefetch_offload.testing import TinyTransformer, make_batch, saved_storage_bytes

P = CheckpointPolicy
Policy = Callable[..., CheckpointPolicy]
StepResult = list[torch.Tensor | None]
Step = Callable[[nn.Module, int], StepResult]

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
_PROFILE_STEPS = len(recompute_profile.PROFILE)
# "auto": the profile, the planned step and its trial, two steps of the plan chosen.
_AUTO_STEPS = _PROFILE_STEPS + 3 + 2
# "selective" (no trial): the profile, the planned step, two more.
_SELECTIVE_STEPS = _PROFILE_STEPS + 3


def _everywhere(choice: CheckpointPolicy) -> Policy:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return choice

    return policy


def _on_matmuls(choice: CheckpointPolicy) -> Policy:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return choice if op in _MATMULS else P.PREFER_RECOMPUTE

    return policy


# The modes a test runs, by id. "selective" is "auto" forced to plan selective blocks on
# these toys (no offload alone, no dispatch-cost switch, no trial), as the suite does.
MODES: dict[str, Any] = {
    "full": "full",
    "auto": "auto",
    "selective": "auto",
    "matmuls-offloaded": _on_matmuls(P.PREFER_CPU_OFFLOAD),
    "all-offloaded": _everywhere(P.PREFER_CPU_OFFLOAD),
    "all-saved": _everywhere(P.PREFER_SAVE),
    "all-must-offload": _everywhere(P.MUST_CPU_OFFLOAD),
}
QUICK = ["full", "selective", "matmuls-offloaded", "all-saved"]


def _force_selective(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recompute, "OFFLOAD_ALONE", False)
    monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", 0.0)  # selective on a toy
    monkeypatch.setattr(recompute_planner, "SELECTIVE_MARGIN", 0.0)
    monkeypatch.setattr(recompute, "TRIAL", False)  # the selective plan stays


def _steps_for(mode: str) -> int:
    return {"auto": _AUTO_STEPS, "selective": _SELECTIVE_STEPS}.get(mode, 3)


def _snapshot(model: nn.Module, extra: StepResult) -> StepResult:
    """Copies of the parameters' gradients (None where there is none) and of ``extra``."""
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return grads + [None if e is None else e.detach().clone() for e in extra]


def _assert_same_steps(ref: list[StepResult], got: list[StepResult]) -> None:
    """Every step's every tensor bit for bit the same (or None in both), and not
    vacuously: some tensor is there."""
    assert len(ref) == len(got) and any(t is not None for step in ref for t in step)
    for s, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert len(a) == len(b), s
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x is None or y is None:
                assert x is None and y is None, (s, i)
                continue
            assert x.dtype == y.dtype and torch.equal(x, y), (s, i)


def _wrapped(model: nn.Module) -> list[bool]:
    return ["forward" in m.__dict__ for m in model.modules()]


class Trained(NamedTuple):
    plan: RecomputePlan | None
    stats: OffloadStats
    model: nn.Module  # the copy trained under the library


def _train_alike(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    base: nn.Module,
    step: Step,
    mode: str | Policy,
    *,
    steps: int | None = None,
    target: str = "disk",
    after_step: Callable[[OffloadEngine], None] | None = None,
    **kw: Any,
) -> Trained:
    """Trains a copy of ``base`` without the library and a copy under
    ``offload_context(recompute=MODES[mode])`` (or the policy ``mode``), each step seeded
    alike, ``after_step`` run after each step under the library; asserts every step's
    gradients (and what ``step`` returned) bit-identical, the model restored on exit,
    and that "auto" made its plan ("selective": with selective blocks, where no budget
    rules them out)."""
    if mode == "selective":
        _force_selective(monkeypatch)
    if steps is None:
        steps = _steps_for(mode) if isinstance(mode, str) else 3
    kw.setdefault("min_offload_bytes", 0)

    def train(model: nn.Module, engine: OffloadEngine | None) -> list[StepResult]:
        out = []
        for s in range(steps):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(777 + s)
            out.append(_snapshot(model, step(model, s)))
            if engine is not None and after_step is not None:
                after_step(engine)
        return out

    ref = train(copy.deepcopy(base), None)
    model = copy.deepcopy(base)
    before = _wrapped(model)
    where = str(tmp_path) if target == "disk" else None
    value = MODES[mode] if isinstance(mode, str) else mode
    with offload_context(target, where, model=model, recompute=value, **kw) as engine:
        got = train(model, engine)
        plan, stats = engine.recompute_plan(), engine.stats()
    assert _wrapped(model) == before, "the model was not restored"
    _assert_same_steps(ref, got)
    if mode in ("auto", "selective"):
        assert plan is not None and plan.plans_made >= 1, plan
    if mode == "selective" and not kw.get("device_budget"):
        assert plan is not None and plan.measured.get("blocks_selective", 0) > 0, plan
    return Trained(plan, stats, model)


def _seeded(step: int, *shape: int, grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(*shape, generator=g).requires_grad_(grad)


def _model(make: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return make()


def _scalar_loss_step(*shape: int) -> Step:
    """A step that backwards ``model(x)`` (a scalar) for a seeded ``x`` of ``shape``."""

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, *shape)
        m(x).backward()
        return [x.grad]

    return step


def _square_mean_step(*shape: int) -> Step:
    """A step that backwards ``model(x).square().mean()``."""

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, *shape)
        m(x).square().mean().backward()
        return [x.grad]

    return step


# -- models ---------------------------------------------------------------------------


class MLPBlock(nn.Module):
    def __init__(self, w: int = 16, p: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Linear(w, 2 * w)
        self.b = nn.Linear(2 * w, w)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.p:
            h = F.dropout(h, self.p, training=self.training)
        return x + self.b(h)


class Stack(nn.Module):
    def __init__(self, n: int = 3, w: int = 16, p: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(w, w)
        self.layers = nn.ModuleList(MLPBlock(w, p) for _ in range(n))
        self.out = nn.Linear(w, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h).square().mean()


# -- blocks called several times, blocks calling blocks ---------------------------------


class Shared(nn.Module):
    """ALBERT-like: one block applied three times, then another."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = MLPBlock()
        self.other = MLPBlock()
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(3):
            h = self.shared(h)
        return self.out(self.other(h)).square().mean()


@pytest.mark.parametrize("mode", QUICK)
def test_a_block_called_three_times_a_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """One block module called three times a forward, beside another: each call is a
    checkpoint of its own, whose recompute replays that call's ops (NOTE [op keys] in
    checkpointing.py)."""
    _train_alike(
        tmp_path,
        monkeypatch,
        _model(Shared),
        _scalar_loss_step(4, 16),
        mode,
        recompute_blocks=[MLPBlock],
    )


@pytest.mark.parametrize("budget", [0, 1000, "1GiB"])
def test_a_block_called_three_times_under_auto_at_device_budgets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int | str
) -> None:
    """NOTE [a budget no plan reaches] in recompute_planner.py: below what one call of a block
    holds (1536 bytes), one warning, every block checkpointed plainly and never
    offload alone; over both blocks' bytes, both whole; at no budget, the fastest plan.
    Every step exact."""
    warned = (
        pytest.warns(OffloadFallbackWarning, match="no plan reaches it")
        if budget == 1000
        else contextlib.nullcontext()
    )
    with warned:
        plan = _train_alike(
            tmp_path,
            monkeypatch,
            _model(Shared),
            _scalar_loss_step(8, 16),
            "auto",
            recompute_blocks=[MLPBlock],
            device_budget=budget,
        ).plan
    assert plan is not None
    measured = plan.measured
    if budget == 1000:
        assert measured["offload_alone"] == 0 and measured["blocks_plain"] == 2, measured
    elif budget == "1GiB":
        assert (measured["blocks_whole"], measured["blocks_plain"]) == (2, 0), measured


def test_a_block_called_several_times_counts_one_call_s_bytes_per_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget over what one call of a shared block holds, though under its calls' sum,
    is reachable (no warning: a checkpointed call's recompute holds one call's bytes at
    once), and a plan that checkpoints it plainly counts each call's bytes once, as
    "full" does. The other block fits the budget whole; the plan is not tried, so it
    stays (a trial would keep it or not by the clock)."""
    monkeypatch.setattr(recompute, "OFFLOAD_ALONE", False)  # the plan checkpoints
    monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", math.inf)  # plainly
    monkeypatch.setattr(recompute, "TRIAL", False)
    block, x = _model(MLPBlock), _seeded(0, 8, 16)
    one = sum(saved_storage_bytes(block, lambda: block(x)))
    # Shared calls its block three times a forward; the other block fits whole beside
    # what the model saves outside the blocks and the shared block's inputs.
    budget = 3 * one - one // 6
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadFallbackWarning)
        auto = _train_alike(
            tmp_path / "auto",
            monkeypatch,
            _model(Shared),
            _scalar_loss_step(8, 16),
            "auto",
            recompute_blocks=[MLPBlock],
            device_budget=budget,
        )
    full = _train_alike(
        tmp_path / "full",
        monkeypatch,
        _model(Shared),
        _scalar_loss_step(8, 16),
        "full",
        recompute_blocks=[MLPBlock],
    )
    assert auto.plan is not None, auto.plan
    m = auto.plan.measured
    assert (m["blocks_whole"], m["blocks_plain"]) == (1, 1), auto.plan
    # The shared block's three calls of the four that "full" recomputes, alike in size.
    assert 4 * auto.stats.step_bytes_recomputed == 3 * full.stats.step_bytes_recomputed > 0


class CallsNeighbour(nn.Module):
    """Calls another wrapped block (not a submodule of its own) inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.neighbour: list[nn.Module] = []  # a plain list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        for n in self.neighbour:
            h = n(h)
        return x + h


@pytest.mark.parametrize("mode", QUICK)
def test_a_block_calling_a_sibling_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A wrapped block run inside another block's forward (and so inside its
    recompute) runs as its own forward did."""

    def build() -> nn.Module:
        m = nn.Sequential(*(CallsNeighbour() for _ in range(3)))
        m[1].neighbour.append(m[0])  # block 1 runs block 0 again inside itself
        return m

    _train_alike(tmp_path, monkeypatch, _model(build), _square_mean_step(4, 16), mode)


class InnerCheckpoint(nn.Module):
    """Checkpoints part of itself with torch's own checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)
        self.c = nn.Linear(16, 16)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=False)
        return h + torch.sigmoid(self.c(h))


@pytest.mark.parametrize("mode", QUICK)
def test_a_block_with_its_own_inner_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A checkpoint nested inside a checkpointed block: its recompute runs inside the
    block's recompute."""
    base = _model(lambda: nn.Sequential(nn.Linear(16, 16), *(InnerCheckpoint() for _ in range(3))))
    _train_alike(
        tmp_path,
        monkeypatch,
        base,
        _square_mean_step(4, 16),
        mode,
        recompute_blocks=[InnerCheckpoint],
    )


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.lin(x)) * x


@pytest.mark.parametrize("mode", QUICK)
@pytest.mark.parametrize("blocks", ["by-name", "by-class"])
def test_blocks_of_two_classes_chosen_by_name_or_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, blocks: str
) -> None:
    """NOTE [block detection] in blocks.py: ``recompute_blocks`` naming a subset of a
    Sequential's children, or two classes, checkpoints those and leaves the rest."""
    base = _model(
        lambda: nn.Sequential(
            nn.Linear(16, 16), MLPBlock(), Gate(), MLPBlock(), Gate(), MLPBlock(), nn.Linear(16, 1)
        )
    )
    chosen: list[Any] = ["1", "2", "5"] if blocks == "by-name" else [MLPBlock, Gate]
    _train_alike(
        tmp_path, monkeypatch, base, _square_mean_step(4, 16), mode, recompute_blocks=chosen
    )


# -- training loops --------------------------------------------------------------------


@pytest.mark.parametrize("mode", [*QUICK, "auto"])
@pytest.mark.parametrize("how", ["summed", "interleaved", "two-forwards-then-backwards"])
def test_gradient_accumulation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, how: str
) -> None:
    """Two micro-batches a step, their losses summed, backwarded one after the other,
    or both forwards first and the backwards in reverse: the accumulated gradients are
    exact, and "auto" still plans."""

    def step(m: nn.Module, s: int) -> StepResult:
        x1, x2 = _seeded(2 * s, 4, 16), _seeded(2 * s + 1, 6, 16)
        if how == "summed":
            (m(x1) + m(x2)).backward()
        elif how == "interleaved":
            m(x1).backward()
            m(x2).backward()
        else:
            l1, l2 = m(x1), m(x2)
            l2.backward()
            l1.backward()
        return [x1.grad, x2.grad]

    _train_alike(tmp_path, monkeypatch, _model(Stack), step, mode)


class ChecksPairs(nn.Module):
    """Puts its own non-reentrant checkpoint around each pair of its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(p=0.2) for _ in range(4))
        self.out = nn.Linear(16, 1)

    def _pair(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return self.layers[i + 1](self.layers[i](x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in (0, 2):
            x = checkpoint(self._pair, x, i, use_reentrant=False)
        return self.out(x).square().mean()


@pytest.mark.parametrize("mode", ["auto", "full", "all-offloaded"])
@pytest.mark.parametrize("schedule", ["one-forward-one-backward", "reversed"])
def test_micro_batches_in_flight_through_the_model_s_own_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, schedule: str
) -> None:
    """NOTE [block modes] in blocks.py: with several micro-batches in flight (a
    pipeline's one forward, one backward; or every forward, then the backwards in
    reverse), the model's own checkpoint replays each block as the forward of its own
    micro-batch ran it, though the plan moved on between that forward and the replay."""

    def step(m: nn.Module, s: int) -> StepResult:
        xs = [_seeded(10 * s + i, 4, 16) for i in range(4)]
        if schedule == "reversed":
            losses = [m(x) for x in xs]
            for loss in reversed(losses):
                loss.backward()
        else:
            losses = [m(xs[0]), m(xs[1])]
            for i in range(2, 4):
                losses[i - 2].backward()
                losses.append(m(xs[i]))
            losses[2].backward()
            losses[3].backward()
        return [x.grad for x in xs]

    _train_alike(tmp_path, monkeypatch, _model(ChecksPairs), step, mode)


@pytest.mark.parametrize("mode", [*QUICK, "auto"])
@pytest.mark.parametrize("how", ["no-grad", "inference-mode", "grad-kept-then-dropped"])
def test_an_evaluation_forward_between_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, how: str
) -> None:
    """An eval-mode forward between training steps with dropout, under no_grad, under
    inference_mode, or with grad and its graph dropped: the training steps and the
    evaluation outputs are exact, and "auto" still plans."""

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, 4, 16)
        m.train()
        m(x).backward()
        m.eval()
        xe = _seeded(100 + s, 5, 16, grad=False)
        if how == "no-grad":
            with torch.no_grad():
                v = m(xe)
        elif how == "inference-mode":
            with torch.inference_mode():
                v = m(xe)
        else:  # a validation loss computed with grad on and thrown away
            v = m(xe)
        m.train()
        return [x.grad, v]

    _train_alike(tmp_path, monkeypatch, _model(lambda: Stack(p=0.2)), step, mode)


@pytest.mark.parametrize("mode", QUICK)
def test_backward_through_one_of_two_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Two forwards a step, one of them dropped without backward (which one alternates):
    what the dropped graph offloaded is freed, and the step that follows is exact."""

    def step(m: nn.Module, s: int) -> StepResult:
        x1, x2 = _seeded(s, 4, 16), _seeded(50 + s, 4, 16)
        l1, l2 = m(x1), m(x2)
        (l2 if s % 2 else l1).backward()
        return [x1.grad, x2.grad]

    _train_alike(tmp_path, monkeypatch, _model(Stack), step, mode)


@pytest.mark.parametrize("mode", QUICK)
def test_a_backward_after_the_context_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A graph built inside the context is backwarded after it exits (the blocks
    restored, the engine closed): its recompute runs, exact."""
    if mode == "selective":
        _force_selective(monkeypatch)
    base = _model(lambda: Stack(4, w=32))
    steps = _steps_for(mode)

    def step(m: nn.Module, s: int) -> torch.Tensor:
        m.zero_grad(set_to_none=True)
        x = _seeded(s, 8, 32)
        m(x).backward()
        assert x.grad is not None
        return x.grad

    ref_model = copy.deepcopy(base)
    ref = [_snapshot(ref_model, [step(ref_model, s)]) for s in range(steps + 1)]
    model = copy.deepcopy(base)
    with offload_context(
        "disk", str(tmp_path), model=model, recompute=MODES[mode], min_offload_bytes=0
    ):
        got = [_snapshot(model, [step(model, s)]) for s in range(steps)]
        model.zero_grad(set_to_none=True)
        x = _seeded(steps, 8, 32)
        loss = model(x)
    assert not any(_wrapped(model))
    loss.backward()
    got.append(_snapshot(model, [x.grad]))
    _assert_same_steps(ref, got)


@pytest.mark.parametrize("mode", ["auto", "selective"])
def test_blocks_left_out_in_some_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """LayerDrop: a different block is skipped in two steps of three, during the
    profile and after the plan; the plan holds (no block is new) and every step is
    exact."""

    class DropsLayers(Stack):
        def __init__(self) -> None:
            super().__init__(5)
            self.skip: set[int] = set()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for i, layer in enumerate(self.layers):
                if i not in self.skip:
                    h = layer(h)
            return self.out(h).square().mean()

    def step(m: nn.Module, s: int) -> StepResult:
        m.skip = {s % 5} if s % 3 else set()
        x = _seeded(s, 4, 16)
        m(x).backward()
        return [x.grad]

    plan = _train_alike(
        tmp_path, monkeypatch, _model(DropsLayers), step, mode, steps=_AUTO_STEPS + 8
    ).plan
    assert plan is not None and plan.plans_made == 1, plan


# -- frozen blocks ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", [*QUICK, "all-offloaded"])
@pytest.mark.parametrize("frozen", ["first-two", "middle"])
def test_frozen_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, frozen: str
) -> None:
    """Blocks whose parameters need no grad: the first two, whose input needs none
    either (their outputs are never recomputed), or one between trained blocks. Exact,
    and nothing the engine took is still held once a step's backward is done."""
    base = _model(lambda: Stack(4, w=32))
    for i in [0, 1] if frozen == "first-two" else [1]:
        base.layers[i].requires_grad_(False)
    if frozen == "first-two":
        base.inp.requires_grad_(False)
    held: list[tuple[int, int, int, int]] = []

    def step(m: nn.Module, s: int) -> StepResult:
        m(_seeded(s, 8, 32, grad=False)).backward()
        return []

    def after_step(engine: OffloadEngine) -> None:
        engine.flush()
        st = engine.stats()
        held.append(
            (st.device_tier_bytes, st.host_tier_bytes, st.disk_tier_bytes, st.disk_bytes_in_use)
        )

    _train_alike(tmp_path, monkeypatch, base, step, mode, after_step=after_step)
    assert held and set(held) == {(0, 0, 0, 0)}, held


# -- keyword, tuple, dict, integer and view arguments and outputs ---------------------------


class HFLayer(nn.Module):
    """A Hugging Face style layer: keyword arguments, a tuple of tensors, a None, flags
    and a float in; a tuple with an optional tensor and a dict out."""

    def __init__(self, w: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(w, w)
        self.o = nn.Linear(w, w)

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past: Any = None,
        output_attentions: bool = False,
        scale: float = 1.0,
    ) -> tuple[Any, ...]:
        assert position_embeddings is not None and past is None
        cos, sin = position_embeddings
        q = self.q(hidden) * cos + hidden * sin
        scores = q @ hidden.transpose(-1, -2) * scale
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask, -1e4)
        a = scores.softmax(-1)
        h = hidden + self.o(a @ hidden)
        return (h, a if output_attentions else None, {"n": 3, "aux": h.mean()})


class HFModel(nn.Module):
    def __init__(self, n: int = 3, w: int = 16) -> None:
        super().__init__()
        self.emb = nn.Linear(w, w)
        self.rot = nn.Parameter(torch.randn(8, w) / 4)
        self.layers = nn.ModuleList(HFLayer(w) for _ in range(n))
        self.out = nn.Linear(w, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        t = x.shape[1]
        pe = (self.rot[:t].cos(), self.rot[:t].sin())  # tensors in a tuple, with grad
        aux: Any = 0
        for layer in self.layers:
            h, attn, extra = layer(
                h,
                attention_mask=mask,
                position_embeddings=pe,
                past=None,
                output_attentions=True,
                scale=0.5,
            )
            aux = aux + extra["aux"] * extra["n"] + attn.sum() * 1e-3
        return self.out(h).square().mean() + aux


@pytest.mark.parametrize("mode", [*QUICK, "auto"])
def test_hugging_face_style_keywords_tuples_and_dicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Tensors that require grad inside a tuple argument, and outputs in a tuple with a
    dict: gradients reach them all, and the sequence length changes between steps."""

    def step(m: nn.Module, s: int) -> StepResult:
        t = 8 if s % 3 else 6
        x = _seeded(s, 2, t, 16)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        m(x, mask).backward()
        return [x.grad]

    _train_alike(tmp_path, monkeypatch, _model(HFModel), step, mode)


@dataclasses.dataclass
class HiddenOut:
    hidden: torch.Tensor
    note: str = "a field that is not a tensor"


class DataclassBlock(nn.Module):
    """Returns a dataclass (not a pytree) holding its output, and one of its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.pos = nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor) -> tuple[HiddenOut, torch.Tensor]:
        return HiddenOut(x + torch.tanh(self.lin(x))), self.pos


class DataclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DataclassBlock() for _ in range(3))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = x.new_zeros(())
        for layer in self.layers:
            out, pos = layer(x)
            x, extra = out.hidden, extra + pos.sum()
        return self.out(x).square().mean() + extra


@pytest.mark.parametrize("mode", [*QUICK, "auto"])
def test_blocks_returning_a_dataclass_and_a_parameter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """NOTE [block modes] in blocks.py: "auto" hears backward reach a block through the
    tensors of a dataclass it returns (so it plans), and hooks no parameter a block
    hands back (that hook would outlive the step, and the context)."""
    trained = _train_alike(
        tmp_path, monkeypatch, _model(DataclassModel), _square_mean_step(4, 16), mode
    )
    # Each step's forward would have hooked each parameter once more, for good.
    assert all(not layer.pos._backward_hooks for layer in trained.model.layers)


class IntBlock(nn.Module):
    """Takes and returns integer and bool tensors beside the hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.lin = nn.Linear(16, 16)

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = x + self.emb(ids)
        g = self.lin(h)
        m = g > 0  # a bool output
        idx = g.argmax(-1)  # an int64 one
        h = torch.where(keep[..., None] & m, g, h)
        return h, (ids + idx) % 32, m


class IntModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(IntBlock() for _ in range(3))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        keep = ids % 2 == 0
        for layer in self.layers:
            x, ids, mask = layer(x, ids, keep)
            keep = mask.any(-1)
        return self.out(x).square().mean()


@pytest.mark.parametrize("mode", QUICK)
def test_integer_and_bool_tensors_through_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Integer and bool block outputs (stored, offloaded or recomputed like any other)
    steer the next block: exact."""

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, 3, 5, 16)
        ids = torch.randint(0, 32, (3, 5), generator=torch.Generator().manual_seed(s))
        m(x, ids).backward()
        return [x.grad]

    _train_alike(tmp_path, monkeypatch, _model(IntModel), step, mode)


class ViewOut(nn.Module):
    """Returns a view of its input when skipped, else a view of an intermediate."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skip:
            return x.view(x.shape)
        h = x + torch.tanh(self.lin(x))
        return h.transpose(0, 1).transpose(0, 1)[:, :]


class InputOut(nn.Module):
    """Returns its input itself when skipped (LayerDrop)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.skip else x + torch.tanh(self.lin(x))


@pytest.mark.parametrize("mode", QUICK)
@pytest.mark.parametrize("cls", [ViewOut, InputOut], ids=["view", "input"])
def test_outputs_that_are_views_or_the_input_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, cls: type[nn.Module]
) -> None:
    """A block whose output is a view of its input, its input itself, or a view of an
    intermediate, which block does which changing per step."""
    base = _model(
        lambda: nn.Sequential(nn.Linear(16, 16), *(cls() for _ in range(4)), nn.Linear(16, 1))
    )

    def step(m: nn.Module, s: int) -> StepResult:
        for i, layer in enumerate(list(m)[1:5]):
            layer.skip = (i + s) % 3 == 0
        x = _seeded(s, 4, 16)
        m(x).square().mean().backward()
        return [x.grad]

    _train_alike(tmp_path, monkeypatch, base, step, mode)


# -- in-place writes around and inside blocks ----------------------------------------------


class ScalesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)  # the block's input, written in place
        return x + torch.tanh(self.lin(x))


class InputWriter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.layers = nn.ModuleList(ScalesInput() for _ in range(3))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h * 1.0)
        return self.out(h).square().mean()


@pytest.mark.parametrize("mode", ["full", "selective", "matmuls-offloaded"])
def test_a_block_that_writes_its_own_input_raises_autograd_s_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """docs/usage.md: a block that writes its own input in place raises autograd's
    in-place error in backward, as torch.utils.checkpoint does (the checkpoint saved
    that input before the write); plain PyTorch trains it. "auto" runs its first step
    whole, and raises at the first one that checkpoints."""
    with pytest.raises(OffloadError, match="modified by an inplace operation"):
        _train_alike(tmp_path, monkeypatch, _model(InputWriter), _scalar_loss_step(4, 16), mode)


class ScalesOutputs(nn.Module):
    """Writes each block's output in place after the block returned: legal in plain
    PyTorch (the block's last op, an add, saves nothing), and no recompute reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.layers = nn.ModuleList(MLPBlock() for _ in range(3))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
            h.mul_(0.9)
        return self.out(h).square().mean()


@pytest.mark.parametrize("mode", [*QUICK, "all-offloaded"])
def test_a_block_s_last_output_written_after_it_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """NOTE [cache entry mutation] in checkpointing.py: an output written after the block
    returned matters only where its recompute reads it; the block's own result, which
    no recompute of the block needs, may be written, whatever is stored."""
    _train_alike(tmp_path, monkeypatch, _model(ScalesOutputs), _scalar_loss_step(4, 16), mode)


class ScalesLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ReturnsLogits() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux: Any = 0
        for layer in self.layers:
            logits, x = layer(x)
            logits.mul_(0.5)
            aux = aux + logits.sum()
        return x.square().mean() + aux


@pytest.mark.parametrize("mode", ["full", "auto"])
def test_an_output_the_recompute_reads_written_after_the_block_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """NOTE [cache entry mutation] in checkpointing.py: a write after the block
    returned is seen through the output's version counter; recomputed ("full") the
    block is exact, and "auto", whose profile offloads every op output, makes the
    written output again: exact too."""
    _train_alike(tmp_path, monkeypatch, _model(ScalesLogits), _scalar_loss_step(4, 16), mode)


class InPlaceInside(nn.Module):
    """Writes intermediates in place through views, a transposed view, clamp_ and +=."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h[:, :8].mul_(2.0)
        h.transpose(0, 1)[3].add_(1.0)
        g = h * 1.5
        g.clamp_(max=3.0)
        g = F.dropout(torch.tanh(g), 0.2, training=self.training)
        out = self.b(g)
        out += x
        return out


@pytest.mark.parametrize("mode", [*QUICK, "all-offloaded"])
def test_in_place_writes_through_views_of_intermediates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """NOTE [ops that write their inputs] in checkpointing.py: writes through views of
    a stored output, and in-place dropout, run again in the recompute: exact."""
    base = _model(lambda: nn.Sequential(*(InPlaceInside() for _ in range(3))))
    _train_alike(tmp_path, monkeypatch, base, _square_mean_step(6, 16), mode)


class OutOps(nn.Module):
    """Writes with ``out=`` into memory it made."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        mask = torch.empty(h.shape, dtype=torch.bool)
        torch.gt(h, 0.1, out=mask)
        idx = torch.empty(h.shape[0], dtype=torch.long)
        torch.argmax(h, -1, out=idx)
        return x + torch.tanh(h) * mask + idx[:, None].float() * 0.01


@pytest.mark.parametrize("mode", QUICK)
def test_out_variant_ops_inside_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """NOTE [ops that write their inputs] in checkpointing.py: an ``out=`` op writes
    memory an earlier op made and runs again in the recompute, whatever is stored."""
    base = _model(lambda: nn.Sequential(*(OutOps() for _ in range(3))))
    _train_alike(tmp_path, monkeypatch, base, _square_mean_step(4, 16), mode)


# -- exceptions ---------------------------------------------------------------------------


class Flaky(MLPBlock):
    """Raises in forward when armed (outside backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.armed:
            raise ValueError("boom in forward")
        return x + self.b(h)


class FlakyStack(Stack):
    def __init__(self) -> None:
        super().__init__(0)
        self.layers = nn.ModuleList(Flaky() for _ in range(4))


@pytest.mark.parametrize("mode", ["full", "selective", "matmuls-offloaded", "auto"])
def test_an_exception_in_a_block_s_forward_then_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The third block raises in the forward of steps 1 and 4 (profiling steps under
    "auto", which run again: NOTE [abandoned forwards]) and of the last step but one;
    each such step is retried, and every step's gradients are those of a clean one."""
    steps = _steps_for(mode) + (2 if mode in ("auto", "selective") else 0)
    fail_at = {1, 4, steps - 2}

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, 4, 16)
        if s in fail_at:
            m.layers[2].armed = True
            try:
                with pytest.raises(ValueError, match="boom in forward"):
                    m(x)
            finally:
                m.layers[2].armed = False
        m(x).backward()
        return [x.grad]

    _train_alike(tmp_path, monkeypatch, _model(FlakyStack), step, mode, steps=steps)


class FailsInRecompute(MLPBlock):
    """Raises in its recompute (a forward inside backward) when armed, once."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.armed and torch._C._current_graph_task_id() >= 0:
            self.armed = False
            raise ValueError("boom in recompute")
        return x + self.b(h)


@pytest.mark.parametrize("mode", ["full", "selective", "matmuls-offloaded"])
def test_an_exception_in_a_recompute_then_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A block's recompute raises halfway through a backward (some blocks' outputs
    read back, some not); the step is retried and every later step is exact. Only the
    run under the library recomputes, so only it raises."""
    base = _model(lambda: nn.Sequential(nn.Linear(16, 16), *(FailsInRecompute() for _ in range(3))))
    fail_at = _steps_for(mode) - 2  # a planned step: "selective" recomputes its blocks
    raised: list[int] = []

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, 4, 16)
        if s == fail_at and any(_wrapped(m)):  # under the library only
            m[2].armed = True
            with pytest.raises(ValueError, match="boom in recompute"):
                m(x).square().mean().backward()
            raised.append(s)
            assert not m[2].armed
            m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        return [x.grad]

    _train_alike(tmp_path, monkeypatch, base, step, mode)
    assert raised == [fail_at]


def test_a_policy_raising_mid_forward_then_training_goes_on(tmp_path: Path) -> None:
    """A policy that raises at its seventh call (in the first step's forward): the
    error reaches the caller, the step is retried and four steps are exact."""
    calls = [0]

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        calls[0] += 1
        if calls[0] == 7:
            raise KeyError("policy bug")
        return P.PREFER_CPU_OFFLOAD if op in _MATMULS else P.PREFER_RECOMPUTE

    def train(m: nn.Module, fails: bool) -> list[StepResult]:
        out = []
        for s in range(4):
            m.zero_grad(set_to_none=True)
            x = _seeded(s, 4, 16)
            if fails and s == 0:
                with pytest.raises(KeyError, match="policy bug"):
                    m(x)
            m(x).backward()
            out.append(_snapshot(m, [x.grad]))
        return out

    base = _model(Stack)
    ref = train(copy.deepcopy(base), False)
    model = copy.deepcopy(base)
    with offload_context("disk", str(tmp_path), model=model, recompute=policy, min_offload_bytes=0):
        got = train(model, True)
    assert not any(_wrapped(model))
    _assert_same_steps(ref, got)
    assert calls[0] > 7


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_the_body_raising_in_the_profile_then_a_new_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The training loop raises in the fourth profiling step, between its forward and
    its backward or as the backward starts: the model is restored, and trains on in a
    new context bit for bit as a copy that never saw the first."""
    model = _model(Stack)
    before = _wrapped(model)

    def stop(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        with offload_context(
            "disk", str(tmp_path / "a"), model=model, recompute="auto", min_offload_bytes=0
        ):
            for s in range(4):
                loss = model(_seeded(s, 4, 16))
                if s == 3 and where == "forward":
                    raise RuntimeError("stop")
                if s == 3:
                    loss.register_hook(stop)
                loss.backward()
    assert _wrapped(model) == before
    model.zero_grad(set_to_none=True)
    _train_alike(tmp_path / "b", monkeypatch, model, _scalar_loss_step(4, 16), "selective")


# -- double backward and gradient penalties ---------------------------------------------


@pytest.mark.parametrize("mode", [*QUICK, "all-offloaded", "auto"])
def test_double_backward_through_checkpointed_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """create_graph=True, then a backward of the loss plus a gradient penalty: each
    block is recomputed a second time, and its offloaded outputs read again; outputs a
    policy keeps in memory (*_SAVE) serve one recompute, and the second raises (docs:
    Limits)."""

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, 4, 16)
        loss = m(x)
        gs = torch.autograd.grad(loss, [*m.parameters(), x], create_graph=True)
        (loss + sum(g.square().sum() for g in gs)).backward()
        return [x.grad]

    if mode == "all-saved":
        with pytest.raises(OffloadError, match="recomputed a second time"):
            _train_alike(tmp_path, monkeypatch, _model(Stack), step, mode)
        return
    _train_alike(tmp_path, monkeypatch, _model(Stack), step, mode)


class PenaltyStack(Stack):
    """Takes a gradient penalty after the first block, in the middle of the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        penalty: Any = 0
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i == 0:  # a backward inside the forward, through block 0
                (g,) = torch.autograd.grad(h.square().sum(), x, create_graph=True)
                penalty = g.square().mean()
        return self.out(h).square().mean() + penalty


@pytest.mark.parametrize("mode", ["full", "selective", "matmuls-offloaded", "auto"])
def test_a_gradient_penalty_taken_between_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A backward through block 0 in the middle of the forward reaches that block's
    gradient hooks (NOTE [block modes] in blocks.py) before the step's own backward:
    every step is exact, and "auto" still plans."""
    _train_alike(tmp_path, monkeypatch, _model(PenaltyStack), _scalar_loss_step(4, 16), mode)


# -- random ops, hooks, normalization --------------------------------------------------------


class RandomBlock(nn.Module):
    """Out-of-place random ops: native_dropout's mask, rand_like, randperm, multinomial."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, mask = torch.native_dropout(torch.tanh(self.a(x)), 0.3, True)
        noise = torch.rand_like(h) * 0.1
        perm = torch.randperm(h.shape[-1])
        pick = torch.multinomial(h.abs() + 0.1, 2)
        g = self.b(h + noise)[:, perm] * mask
        return x + g + pick.float().mean() * 0.01


@pytest.mark.parametrize("mode", [*QUICK, "all-must-offload"])
def test_out_of_place_random_ops_draw_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """NOTE [random ops] in checkpointing.py: stored or recomputed, every random op's
    draw in the recompute is forward's, and the RNG state after the step (a draw the
    step returns) is that of training without checkpointing."""

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, 4, 16)
        m(x).square().mean().backward()
        return [x.grad, torch.rand(2)]

    base = _model(lambda: nn.Sequential(*(RandomBlock() for _ in range(3))))
    _train_alike(tmp_path, monkeypatch, base, step, mode)


class OwnGeneratorBlock(nn.Module):
    """Noise from a generator of the block's own, beside dropout from the default one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.g = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.a(x)), 0.2)
        return x + h * torch.rand(h.shape, generator=self.g)


@pytest.mark.parametrize("mode", ["selective", "plain", "all-saved", "all-offloaded", "auto"])
def test_random_ops_on_a_generator_of_the_block_s_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """NOTE [random ops] in checkpointing.py: a stored draw from a generator the block
    owns is not drawn again in the recompute (the checkpoint does not restore that
    generator), and "auto" stores it in every plan, so every step and the generator's
    state after it are those of training without checkpointing. (A policy that
    recomputes it draws anew, as under torch's own checkpoint.)"""

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, 4, 16)
        m(x).square().mean().backward()
        return [x.grad, torch.rand(2, generator=m[0].g)]

    base = _model(lambda: nn.Sequential(*(OwnGeneratorBlock() for _ in range(3))))
    if mode == "plain":  # "auto" planning every block plain: these run selective
        monkeypatch.setattr(recompute, "OFFLOAD_ALONE", False)
        monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", 1e9)
        monkeypatch.setattr(recompute, "TRIAL", False)
    trained = _train_alike(tmp_path, monkeypatch, base, step, "auto" if mode == "plain" else mode)
    if mode in ("selective", "plain"):  # ("auto" runs these toys whole)
        assert "generator of the caller's own" in str(trained.plan)


def _own_draws_saved(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return P.MUST_SAVE if kwargs.get("generator") is not None else P.PREFER_RECOMPUTE


def test_a_checkpoint_context_fn_stores_a_draw_from_an_own_generator(tmp_path: Path) -> None:
    """The same through ``engine.checkpoint_context_fn`` in the user's own checkpoint."""
    base = _model(lambda: nn.Sequential(*(OwnGeneratorBlock() for _ in range(2))))

    def train(model: nn.Module, wrap: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> list:
        out = []
        for s in range(3):
            model.zero_grad()
            torch.manual_seed(s)
            h = _seeded(s, 4, 16)
            for block in model:
                h = wrap(block, h)
            h.square().mean().backward()
            out.append(_snapshot(model, [torch.rand(2, generator=model[0].g)]))
        return out

    ref = train(copy.deepcopy(base), lambda b, h: b(h))
    with offload_context("disk", str(tmp_path), min_offload_bytes=0) as engine:
        fn = functools.partial(engine.checkpoint_context_fn, _own_draws_saved)
        got = train(
            copy.deepcopy(base),
            lambda b, h: checkpoint(b, h, use_reentrant=False, context_fn=fn),
        )
    _assert_same_steps(ref, got)


@pytest.mark.parametrize("mode", QUICK)
def test_module_hooks_on_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Forward pre-hooks and forward hooks that change values, and full backward hooks
    that scale the gradient, on the blocks: each runs as it would without the library,
    in forward and in the recompute alike."""
    base = _model(Stack)
    calls: list[str] = []

    def pre(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * 1.25,)

    def post(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out - 0.1

    def bwd(mod: nn.Module, grad_in: Any, grad_out: Any) -> Any:
        calls.append("backward")
        return (grad_in[0] * 0.5,)

    for layer in base.layers:
        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)
        layer.register_full_backward_hook(bwd)
    _train_alike(tmp_path, monkeypatch, base, _scalar_loss_step(4, 16), mode)
    assert calls


class BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.bn(self.lin(x)))


@pytest.mark.parametrize("mode", ["full", "selective", "matmuls-offloaded"])
def test_batch_norm_blocks_are_exact_and_count_each_step_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """BatchNorm in train mode normalizes with batch statistics: gradients exact. Its
    buffer writes are recomputed like the block's other ops, so, as docs/usage.md
    says of any checkpoint, they apply twice: num_batches_tracked counts two a step
    (NOTE [ops that write their inputs] in checkpointing.py)."""
    base = _model(lambda: nn.Sequential(*(BNBlock() for _ in range(3))))
    trained = _train_alike(tmp_path, monkeypatch, base, _square_mean_step(8, 16), mode)
    if mode != "selective":  # (the profile's steps that run blocks whole count once)
        steps = _steps_for(mode)
        assert [int(b.bn.num_batches_tracked) for b in trained.model] == [2 * steps] * 3


# -- odd tensors ------------------------------------------------------------------------------


class FFTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.fft.rfft(self.lin(x), dim=-1)  # complex64
        f = f * torch.exp(1j * f.abs() * 0.1)
        empty = x[:, :0] * 2.0  # an empty tensor, stored or offloaded too
        y = torch.fft.irfft(f, n=16, dim=-1)
        return x + torch.tanh(torch.cat([y, empty], -1))


@pytest.mark.parametrize("mode", QUICK)
def test_complex_and_empty_intermediates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Complex64 intermediates (an FFT and back) and an empty tensor, stored, offloaded
    or recomputed: exact."""
    base = _model(lambda: nn.Sequential(*(FFTBlock() for _ in range(3))))
    _train_alike(tmp_path, monkeypatch, base, _square_mean_step(4, 16), mode)


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c2(F.gelu(self.c1(x)))


@pytest.mark.parametrize("mode", QUICK)
def test_channels_last_convolutions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Channels-last activations keep their strides through offload and recompute."""
    base = _model(lambda: nn.Sequential(*(ConvBlock() for _ in range(3))))
    base = base.to(memory_format=torch.channels_last)

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, 2, 4, 6, 6).detach().to(memory_format=torch.channels_last)
        x.requires_grad_()
        m(x).square().mean().backward()
        return [x.grad]

    _train_alike(tmp_path, monkeypatch, base, step, mode)


class RNNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.gru = nn.GRUCell(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x)
        g = self.gru(h[:, -1], x[:, 0])
        a, b = torch.unsafe_chunk(h, 2, -1)
        return x + h * 0.5 + g[:, None] * 0.1 + torch.cat([b, a], -1) * 0.1


@pytest.mark.parametrize("mode", QUICK)
def test_recurrent_cells_in_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """LSTM and GRU cells (whose gates are written in place) and unsafe_chunk views."""
    base = _model(lambda: nn.Sequential(*(RNNBlock() for _ in range(3))))
    _train_alike(tmp_path, monkeypatch, base, _square_mean_step(2, 5, 16), mode)


# -- autocast, budgets, engine knobs, policies ----------------------------------------------


@pytest.mark.parametrize("pattern", ["alternating", "switched-on-after-the-plan"])
def test_autocast_on_and_off_across_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str
) -> None:
    """NOTE [autocast casts] in checkpointing.py: bf16 autocast on in every other step,
    or from the first planned step on: the casts are other op positions, profiled once
    more at most, and every step is exact."""
    base = _model(lambda: TinyTransformer(vocab=64, width=16, depth=2, heads=2))

    def step(m: nn.Module, s: int) -> StepResult:
        on = s % 2 == 0 if pattern == "alternating" else s >= _SELECTIVE_STEPS
        tokens, targets = make_batch(2, 6, vocab=64, seed=s)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            loss = m(tokens, targets)
        loss.backward()
        return [loss]

    plan = _train_alike(
        tmp_path, monkeypatch, base, step, "selective", steps=_SELECTIVE_STEPS + 8
    ).plan
    assert plan is not None and plan.plans_made <= 2, plan


@pytest.mark.parametrize(
    ("mode", "target", "budget", "whole"),
    [
        ("auto", "disk", 20_000, 0),
        ("auto", "disk", "1GiB", 3),
        ("auto", "cpu", 150_000, 0),
        ("selective", "disk", 150_000, 3),
    ],
)
def test_auto_at_device_budgets(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    target: str,
    budget: int | str,
    whole: int,
) -> None:
    """NOTE [keep, offload, recompute] in recompute.py: the blocks whose saved bytes the
    budget keeps run whole (all three under a budget over them all); under one below a
    block's recompute, one warning and every block plain (NOTE [a budget no plan
    reaches] in recompute_planner.py). One plan, every step exact, batch lengths varying."""

    def step(m: nn.Module, s: int) -> StepResult:
        tokens, targets = make_batch(2, 8 if s % 4 else 6, vocab=64, seed=s)
        m(tokens, targets).backward()
        return []

    base = _model(lambda: TinyTransformer(vocab=64, width=32, depth=3, heads=2))
    warned = (
        pytest.warns(OffloadFallbackWarning, match="no plan reaches it")
        if whole == 0
        else contextlib.nullcontext()
    )
    with warned:
        plan = _train_alike(
            tmp_path, monkeypatch, base, step, mode, target=target, device_budget=budget
        ).plan
    assert plan is not None and plan.plans_made == 1, plan
    assert (plan.measured["blocks_whole"], plan.measured["blocks_plain"]) == (whole, 3 - whole)


@pytest.mark.parametrize(
    "knobs",
    [
        {"verify": True},
        {"prefetch_depth": 0},
        {"io_method": "mmap"},
        {"device_budget": "1KiB", "verify": True},
    ],
    ids=["verify", "depth-0", "mmap", "tiny-budget-verify"],
)
def test_engine_knobs_under_a_selective_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, knobs: dict[str, Any]
) -> None:
    """A float64 model through checksummed writes, synchronous reads, mmap reads, and a
    budget no plan reaches (NOTE [a budget no plan reaches] in recompute_planner.py)."""
    base = _model(lambda: Stack(3, w=32).double())

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, 8, 32).double().detach().requires_grad_()
        m(x).backward()
        return [x.grad]

    warned = (
        pytest.warns(OffloadFallbackWarning, match="no plan reaches it")
        if "device_budget" in knobs
        else contextlib.nullcontext()
    )
    with warned:
        _train_alike(tmp_path, monkeypatch, base, step, "selective", **knobs)


def _cycling_policy(shift: int) -> Policy:
    """MUST_CPU_OFFLOAD on matmuls; the other ops cycle through PREFER_SAVE,
    PREFER_CPU_OFFLOAD, PREFER_RECOMPUTE and MUST_RECOMPUTE, one value a call."""
    values = [P.PREFER_SAVE, P.PREFER_CPU_OFFLOAD, P.PREFER_RECOMPUTE, P.MUST_RECOMPUTE]
    n = [shift]

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _MATMULS:
            return P.MUST_CPU_OFFLOAD
        n[0] += 1
        return values[n[0] % len(values)]

    return policy


@pytest.mark.parametrize("shift", [0, 1, 2])
@pytest.mark.parametrize(("target", "budget"), [("disk", 0), ("cpu", 30_000)])
def test_a_policy_cycling_through_every_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shift: int, target: str, budget: int
) -> None:
    """Every CheckpointPolicy value on neighbouring ops of one block, which op gets
    which shifting each call (op keys stay put: NOTE [op keys] in checkpointing.py)."""
    base = _model(lambda: TinyTransformer(vocab=64, width=32, depth=3, heads=2), seed=shift)

    def step(m: nn.Module, s: int) -> StepResult:
        tokens, targets = make_batch(2, 16, vocab=64, seed=s)
        m(tokens, targets).backward()
        return []

    policy = _cycling_policy(shift)
    _train_alike(tmp_path, monkeypatch, base, step, policy, target=target, device_budget=budget)


class GrowsWithRows(MLPBlock):
    """An extra op for batches of more than 8 rows: a new op position."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if x.shape[0] > 8:
            h = h * 2.0
        return x + self.b(h)


class GrowingStack(Stack):
    def __init__(self) -> None:
        super().__init__(4)
        self.layers = nn.ModuleList(GrowsWithRows() for _ in range(4))


def test_an_op_position_the_new_profile_misses_too_profiles_no_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [keep, offload, recompute], re-planning: every fifth batch is longer and adds
    an op position, which the selective plan lacks; the profile it starts runs that
    batch in a step that sees no ops (every block whole), so the new plan lacks it
    too. It runs stored from then on: one profile more, not one every ten steps."""
    _force_selective(monkeypatch)
    plans: list[int] = []
    profiling: list[bool] = []

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, 16 if s % 5 == 0 else 8, 16)
        m(x).backward()
        return [x.grad]

    def after(engine: OffloadEngine) -> None:
        decider = engine._decider
        assert isinstance(decider, recompute.AutoDecider)
        plans.append(decider.plans_made)
        profiling.append(decider.profiling)

    _train_alike(
        tmp_path, monkeypatch, _model(GrowingStack), step, "selective", steps=50, after_step=after
    )
    assert plans[-1] == 2, plans
    assert not any(profiling[25:]), profiling


def _abandoning_step(at: int, how: str) -> Step:
    """A step that backwards a seeded batch; at step ``at``, a forward first that raises
    in the third block (``raised``) or whose loss is dropped (``dropped``)."""

    def step(m: nn.Module, s: int) -> StepResult:
        if s == at:
            if how == "raised":
                block = m.layers[2]  # type: ignore[index]
                block.armed = True
                try:
                    with pytest.raises(ValueError, match="boom in forward"):
                        m(_seeded(s + 100, 8, 16))
                finally:
                    block.armed = False
            else:
                m(_seeded(s + 100, 8, 16))  # an evaluation with grad enabled: no backward
        x = _seeded(s, 8, 16)
        m(x).backward()
        return [x.grad]

    return step


@pytest.mark.parametrize("how", ["raised", "dropped"])
@pytest.mark.parametrize("at", [0, 1, 2])
def test_a_profiling_step_with_an_abandoned_forward_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: int, how: str
) -> None:
    """NOTE [abandoned forwards]: a forward abandoned in the whole-block step, the
    offload-all step or a recompute-all step makes the same plan, with the same
    figures, as a clean profile: the step runs again, one step later."""
    monkeypatch.setattr(recompute, "OFFLOAD_ALONE", False)
    monkeypatch.setattr(recompute, "TRIAL", False)
    monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", math.inf)  # a plain plan
    steps = len(recompute_profile.PROFILE) + 3
    base = _model(FlakyStack)
    one = sum(saved_storage_bytes(base.layers[0], lambda: base.layers[0](_seeded(0, 8, 16))))  # type: ignore[index]
    # Some blocks whole, the others plain (beside what the model saves outside them)
    budget = 3 * one + one // 2
    clean = _train_alike(
        tmp_path / "clean", monkeypatch, base, _abandoning_step(-1, how), "auto",
        steps=steps, device_budget=budget,
    )  # fmt: skip
    got = _train_alike(
        tmp_path / "abandoned", monkeypatch, base, _abandoning_step(at, how), "auto",
        steps=steps + 1, device_budget=budget,
    )  # fmt: skip
    assert clean.plan is not None and got.plan is not None
    assert 0 < clean.plan.measured["blocks_whole"] < len(base.layers), clean.plan  # type: ignore[arg-type]
    for key in ("blocks_whole", "blocks_plain", "whole_MiB", "moved_MiB"):
        assert got.plan.measured[key] == clean.plan.measured[key], key
    assert got.plan.bytes_recomputed == clean.plan.bytes_recomputed > 0
    assert got.stats.step_bytes_recomputed == clean.stats.step_bytes_recomputed > 0


def _rows_step(rows: Callable[[int], int]) -> Step:
    """A step that backwards ``model(x)`` for a seeded ``x`` of ``rows(step)`` x 16."""

    def step(m: nn.Module, s: int) -> StepResult:
        x = _seeded(s, rows(s), 16)
        m(x).backward()
        return [x.grad]

    return step


def test_a_plain_plan_counts_what_full_counts_after_the_batch_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [plain blocks counted] in checkpointing.py: auto's plain blocks are counted
    per call signature, as "full" counts them: after the batch grows fourfold, both
    count the larger step's bytes alike."""
    monkeypatch.setattr(recompute, "OFFLOAD_ALONE", False)
    monkeypatch.setattr(recompute_planner, "DISPATCH_SWITCH", math.inf)  # a plain plan
    steps = _AUTO_STEPS + 2
    rows = _rows_step(lambda s: 8 if s < steps - 2 else 32)
    seen: dict[str, list[tuple[int, int, int]]] = {"auto": [], "full": []}
    for mode in seen:

        def after(engine: OffloadEngine, mode: str = mode) -> None:
            s = engine.stats()
            seen[mode].append((s.step_bytes_kept, s.step_bytes_offloaded, s.step_bytes_recomputed))

        trained = _train_alike(
            tmp_path / mode, monkeypatch, _model(Stack), rows, mode, steps=steps, after_step=after
        )
        if mode == "auto":
            assert trained.plan is not None and trained.plan.measured["blocks_plain"] == 3
    small, large = seen["full"][-3], seen["full"][-1]
    assert large[2] > small[2] > 0
    assert seen["auto"][-3:] == seen["full"][-3:]


def test_a_step_of_whole_blocks_counts_nothing_once_its_backward_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget that keeps every block whole: read after its backward, each step of whole
    blocks (the profile's and the plan's) reports nothing kept, offloaded or recomputed,
    not the checkpointed step before it."""
    phases: list[str] = []
    counts: list[tuple[int, int, int]] = []

    def after(engine: OffloadEngine) -> None:
        decider = engine._decider
        assert isinstance(decider, recompute.AutoDecider)
        if decider.profiling:
            phases.append(recompute._PHASE_MODE[decider._phase])
        else:
            phases.append(decider._active.modes[("MLPBlock", 0)])
        s = engine.stats()
        counts.append((s.step_bytes_kept, s.step_bytes_offloaded, s.step_bytes_recomputed))

    trained = _train_alike(
        tmp_path, monkeypatch, _model(Stack), _rows_step(lambda s: 8), "auto",
        steps=_AUTO_STEPS, after_step=after, device_budget=1 << 30,
    )  # fmt: skip
    assert trained.plan is not None and trained.plan.measured["blocks_whole"] == 3
    whole = [c for how, c in zip(phases, counts, strict=True) if how == WHOLE]
    assert len(whole) >= 4 and all(c == (0, 0, 0) for c in whole), phases
    assert any(c != (0, 0, 0) for c in counts)  # the checkpointed profiling steps count


class TwoPlaces(nn.Module):
    """Blocks a, b, a, c, b: two modules each at two places of the list."""

    def __init__(self) -> None:
        super().__init__()
        a, b, c = MLPBlock(), MLPBlock(), MLPBlock()
        self.inp = nn.Linear(16, 16)
        self.layers = nn.ModuleList([a, b, a, c, b])
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h).square().mean()


def test_the_plan_s_bytes_are_its_steps_where_a_block_runs_at_two_places(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget keeps the block at one place whole, beside what the model saves
    outside the blocks and the others' inputs; the two at two places each are
    checkpointed (two calls' bytes would not fit): the plan's bytes a step add up to
    what its steps report (4 of 5 calls' bytes, not 2 of 3 modules')."""
    block, x = _model(MLPBlock), _seeded(0, 8, 16)
    one = sum(saved_storage_bytes(block, lambda: block(x)))
    trained = _train_alike(
        tmp_path, monkeypatch, _model(TwoPlaces), _rows_step(lambda s: 8), "selective",
        device_budget=3 * one + one // 2,
    )  # fmt: skip
    plan, s = trained.plan, trained.stats
    assert plan is not None and plan.measured["blocks_whole"] == 1, plan
    steps = s.step_bytes_kept + s.step_bytes_offloaded + s.step_bytes_recomputed
    assert plan.bytes_kept + plan.bytes_offloaded + plan.bytes_recomputed == steps > 0


@pytest.mark.parametrize("how", ["raised", "dropped"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_forward_no_backward_follows_counts_in_no_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, how: str
) -> None:
    """NOTE [counted at the recompute] in checkpointing.py: the step after a forward
    that raised in a block, or whose loss was dropped, reports what a clean step
    reports: the abandoned forward's ops were never recomputed."""
    steps = _steps_for(mode) + 1
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for at in (-1, steps - 2):

        def after(engine: OffloadEngine, at: int = at) -> None:
            s = engine.stats()
            seen.setdefault(at, []).append(
                (s.step_bytes_kept, s.step_bytes_offloaded, s.step_bytes_recomputed)
            )

        _train_alike(
            tmp_path / str(at), monkeypatch, _model(FlakyStack), _abandoning_step(at, how),
            mode, steps=steps, after_step=after,
        )  # fmt: skip
    clean, abandoned = seen[-1][-2], seen[steps - 2][-2]
    assert sum(clean) > 0 and abandoned == clean, (clean, abandoned)


def test_two_forwards_whose_losses_come_before_each_backward_profile_as_one_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accumulation with each loss computed just before its backward: the engine sees a
    pack between the two backwards, and the decider is asked there for the next step's
    trim bound; the step is still whole (every call reached by a backward), and the
    profile takes no step more (NOTE [abandoned forwards])."""
    lengths: list[int] = []

    def step(m: nn.Module, s: int) -> StepResult:
        xs = [_seeded(10 * s + i, 4, 16) for i in range(2)]
        hidden = [m.out(_through(m, x)) for x in xs]  # type: ignore[operator]
        for h in hidden:
            h.square().mean().backward()  # the loss's ops pack between the backwards
        return [x.grad for x in xs]

    def after(engine: OffloadEngine) -> None:
        decider = engine._decider
        assert isinstance(decider, recompute.AutoDecider)
        lengths.append(decider.profiling)

    _train_alike(tmp_path, monkeypatch, _model(Stack), step, "auto", after_step=after)
    assert lengths.index(False) == len(recompute_profile.PROFILE), lengths


def _through(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = m.inp(x)  # type: ignore[operator]
    for layer in m.layers:  # type: ignore[attr-defined]
        h = layer(h)
    return h


@pytest.mark.parametrize("mode", ["full", "matmuls-offloaded"])
def test_under_a_reentrant_checkpoint_of_the_user_s_each_step_reports_its_last_pass(
    tmp_path: Path, mode: str
) -> None:
    """NOTE [counted at the recompute]: a reentrant checkpoint around the model runs its
    forward without grad, so every block checkpoint runs replayed inside backward; each
    step reports the same figures, also after a forward outside it whose loss was
    dropped, and they do not grow from step to step."""
    model = _model(Stack)
    seen = []
    value = MODES[mode]
    with offload_context("disk", str(tmp_path), model=model, recompute=value) as engine:
        model(_seeded(99, 4, 16))  # dropped: its calls count in no step
        for s in range(4):
            checkpoint(model, _seeded(s, 4, 16), use_reentrant=True).backward()
            st = engine.stats()
            seen.append((st.step_bytes_kept, st.step_bytes_offloaded, st.step_bytes_recomputed))
    assert len(set(seen)) == 1 and sum(seen[0]) > 0, seen
