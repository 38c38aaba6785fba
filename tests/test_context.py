"""offload_context: errors before any hook is installed, the None target, hook removal."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_same_grads, grads_of, reference_grads, tiny_model

from prefetch_offload import (
    OffloadConfig,
    OffloadContext,
    OffloadError,
    OffloadStats,
    offload_context,
    offload_context_from_config,
)
from prefetch_offload.context import _ExecutorWait, _top_hooks, check_torch_version


def test_none_target_is_a_no_op() -> None:
    with offload_context(None) as engine:
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # no hooks
        x = torch.randn(1 << 16, requires_grad=True)
        (x * 2).sin().sum().backward()
        engine.flush()
    assert engine.stats() == OffloadStats()
    assert torch.equal(x.grad, 2 * (2 * x.detach()).cos())


@pytest.mark.parametrize("build", ["mapping", "config"])
def test_recompute_reaches_the_engine_from_a_config(tmp_path: Path, build: str) -> None:
    """``model=`` and ``recompute=`` work through ``offload_context_from_config`` (a
    config file's mapping with the model added) and ``OffloadContext(OffloadConfig(...))``
    as through ``offload_context``: blocks checkpointed, gradients bit-identical, the
    model put back at exit."""
    from prefetch_offload.testing import make_batch

    model = tiny_model()
    forwards = [vars(block).get("forward") for block in model.blocks]
    tokens, targets = make_batch(2, 16, vocab=64, seed=0)

    def step(m: torch.nn.Module) -> None:
        m(tokens, targets).backward()

    want = reference_grads(model, step)
    settings = {
        "activation_offloading": "disk",
        "save_dir": str(tmp_path),
        "min_offload_bytes": 0,
        "recompute": "full",
    }
    ctx = (
        offload_context_from_config({**settings, "model": model}, device="cpu")
        if build == "mapping"
        else OffloadContext(
            OffloadConfig(
                target="disk",
                save_dir=tmp_path,
                min_offload_bytes=0,
                model=model,
                recompute="full",
            )
        )
    )
    with ctx as engine:
        assert all("forward" in vars(block) for block in model.blocks)  # wrapped
        loss = model(tokens, targets)
        engine.flush()  # the block inputs on disk before backward (NOTE [write tail])
        loss.backward()
        stats = engine.stats()
    assert stats.step_bytes_recomputed > 0 and stats.tensors_offloaded > 0
    assert [vars(block).get("forward") for block in model.blocks] == forwards  # put back
    assert_same_grads(grads_of(model), want)


def test_the_none_engine_answers_the_recompute_api() -> None:
    """Code written for an offloading run also runs with offloading off: no plan, and
    PyTorch's selective checkpointing with offload choices kept as saves."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is torch.ops.aten.mm.default:
            return CheckpointPolicy.MUST_CPU_OFFLOAD
        return CheckpointPolicy.PREFER_RECOMPUTE

    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)
    (torch.tanh(x @ w) @ w).sum().backward()
    want, w.grad = w.grad, None
    with offload_context(None) as engine:
        assert engine.recompute_plan() is None
        forward, _ = engine.checkpoint_context_fn(policy)
        assert forward.policy_fn(None, torch.ops.aten.mm.default) is CheckpointPolicy.MUST_SAVE
        out = checkpoint(
            lambda a: torch.tanh(a @ w) @ w,
            x,
            use_reentrant=False,
            context_fn=lambda: engine.checkpoint_context_fn(policy),
        )
        out.sum().backward()
        # The engine's checks, with its errors (a list of ops saves those).
        with pytest.raises(TypeError, match="OpOverloads"):
            engine.checkpoint_context_fn([torch.ops.aten.mm])
        with pytest.raises(TypeError, match="policy callable"):
            engine.checkpoint_context_fn(3)  # type: ignore[arg-type]
        forward, _ = engine.checkpoint_context_fn([torch.ops.aten.mm.default])
        assert forward.policy_fn(None, torch.ops.aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert torch.equal(w.grad, want)


def test_a_relative_save_dir_is_the_folder_it_named_at_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    x = torch.randn(1 << 16, requires_grad=True)
    with offload_context("disk", "acts", min_offload_bytes=0) as engine:
        assert engine.config.save_dir == str(first / "acts")
        monkeypatch.chdir(second)  # the training script changes folder meanwhile
        y = (x * 2).sin()
        engine.flush()
        y.sum().backward()
        assert engine.stats().bytes_offloaded > 0
    assert (first / "acts").is_dir() and not (second / "acts").exists()


def test_cpu_target_on_cpu_training_keeps_tensors_in_ram() -> None:
    with offload_context("cpu") as engine:
        x = torch.randn(1 << 16, requires_grad=True)
        (x * 2).sin().sum().backward()
    assert engine.stats().tensors_offloaded == 0


@pytest.mark.parametrize(
    ("target", "save_dir", "kw", "exc", "match"),
    [
        ("ram", None, {}, ValueError, "Unknown activation_offloading target"),
        ("disk", None, {}, ValueError, "requires save_dir"),
        ("disk", "SAVE", {"prefetch_depth": -1}, ValueError, "prefetch_depth"),
        ("disk", "SAVE", {"io_workers": 0}, ValueError, "io_workers"),
        ("disk", "FILE", {}, ValueError, "not a folder"),
    ],
)
def test_bad_input_raises_before_hooks(
    tmp_path: Path, target: str, save_dir: str | None, kw: dict, exc: type, match: str
) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("")
    path = {"SAVE": str(tmp_path), "FILE": str(a_file), None: None}[save_dir]
    with pytest.raises(exc, match=match):
        with offload_context(target, path, **kw):
            pytest.fail("the body must not run")


def test_hooks_are_removed_on_exit(save_dir: Path) -> None:
    w = torch.randn(1 << 15, requires_grad=True)
    with offload_context("disk", save_dir, min_offload_bytes=0) as engine:
        (w * 2).sin()
    before = engine.stats()
    assert before.tensors_offloaded == 1
    (w * 2).sin()
    assert engine.stats() == before


def test_cpu_target_twin_keeps_host_copies(save_dir: Path) -> None:
    """The "cpu" target's span-copy path, run on the CPU through the CUDA path's twin."""
    from prefetch_offload import OffloadConfig, OffloadEngine
    from prefetch_offload.device import SpanCopyDevice

    engine = OffloadEngine(
        OffloadConfig(target="cpu", min_offload_bytes=0), device=SpanCopyDevice("cpu")
    )
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(300, 300, requires_grad=True)

    def run() -> torch.Tensor:
        view = (w * 1)[5:69, 10:266].t()  # a strided view into a bigger storage
        return ((x * 2).t() * view).sum()  # mul saves both operands

    run().backward()
    ref = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
        loss = run()
    engine.close()
    loss.backward()
    assert torch.equal(x.grad, ref[0]) and torch.equal(w.grad, ref[1])
    stats = engine.stats()
    assert stats.tensors_offloaded == 2
    assert stats.bytes_offloaded == 64 * 256 * 4 + (1 + 255 + 63 * 300) * 4


def test_context_cannot_be_entered_twice(save_dir: Path) -> None:
    ctx = offload_context("disk", save_dir)
    with ctx:
        pass
    with pytest.raises(RuntimeError, match="only once"), ctx:
        pass


def test_summary_is_logged_at_exit(save_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(1 << 15, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="prefetch_offload"):
        with offload_context("disk", save_dir, min_offload_bytes=0) as engine:
            loss = (x * 2).sin().sum()
            engine.flush()  # written before backward starts (else the write tail may skip it)
            loss.backward()
    (record,) = [r for r in caplog.records if r.name == "prefetch_offload"]
    assert record.levelno == logging.INFO
    assert "offloaded 1 tensors (0.1 MiB)" in record.getMessage()
    assert "hit rate" in record.getMessage() and "fallbacks" in record.getMessage()


def test_context_from_a_config_mapping(save_dir: Path) -> None:
    cfg = {"activation_offloading": "disk", "save_dir": str(save_dir), "prefetch_depth": 2}
    ctx = offload_context_from_config(cfg, device="cpu")
    assert ctx.config.prefetch_depth == 2 and ctx.config.target == "disk"
    x = torch.randn(1 << 15, requires_grad=True)
    with ctx as engine:
        (x * 2).sin().sum().backward()
    stats = engine.stats()
    assert stats.tensors_offloaded + stats.writes_skipped == 1  # NOTE [write tail]
    assert offload_context_from_config({"activation_offloading": None}).config.target is None


@pytest.mark.parametrize(
    ("cfg", "kw", "match"),
    [
        ({"activation_offloading": "disk"}, {}, "requires a save_dir"),
        ({"activation_offloading": "cpu", "backend": "unsloth"}, {}, "unsloth backend"),
        ({"activation_offloading": "cpu"}, {"backend": "mlx"}, "mlx backend"),
        ({"activation_offloading": "cpu", "device": "mps"}, {}, "Current device: mps"),
        ({"activation_offloading": "tape"}, {}, "Unknown activation_offloading target"),
        ({"activation_offloading": "cpu", "prefetch_dept": 2}, {}, "unknown offload setting"),
        ({"activation_offloading": "cpu", "prefetch_depth": -1}, {}, "prefetch_depth"),
    ],
)
def test_config_mapping_errors_match_the_validator(cfg: dict, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        offload_context_from_config(cfg, **kw)


async def test_async_with_and_aflush(save_dir: Path) -> None:
    x = torch.randn(1 << 16, requires_grad=True)
    async with offload_context("disk", save_dir, min_offload_bytes=0) as engine:
        y = (x * 2).sin()
        await engine.aflush()  # the loop stays free while writes finish
        assert engine.stats().tensors_offloaded == 1
        await asyncio.sleep(0)
        y.sum().backward()
    assert engine.closed
    assert torch.equal(x.grad, 2 * (x.detach() * 2).cos())
    assert engine.stats().bytes_read == (1 << 16) * 4


async def test_two_tasks_of_one_thread_cannot_hold_contexts_at_once(save_dir: Path) -> None:
    """Hooks are per thread: a second task's context would take the first task's saved
    tensors, and the first exit would find the other's hooks on top."""
    entered, leave = asyncio.Event(), asyncio.Event()

    async def first() -> None:
        async with offload_context("disk", save_dir / "a", min_offload_bytes=0):
            entered.set()
            await leave.wait()

    task = asyncio.create_task(first())
    await entered.wait()
    with pytest.raises(OffloadError, match="another asyncio task"):
        async with offload_context("disk", save_dir / "b"):
            pass
    leave.set()
    await task
    x = torch.randn(1 << 15, requires_grad=True)
    async with offload_context("disk", save_dir / "b", min_offload_bytes=0) as engine:
        async with offload_context("cpu"):  # nested in one task: allowed
            pass
        (x * 2).sin().sum().backward()
    assert engine.closed and _top_hooks() is None


def test_a_context_is_entered_by_one_thread_only(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from prefetch_offload import engine as engine_module

    building, go = threading.Event(), threading.Event()
    real = engine_module.OffloadEngine

    class SlowEngine(real):  # type: ignore[misc,valid-type]
        def __init__(self, config: OffloadConfig) -> None:
            building.set()
            assert go.wait(10)
            super().__init__(config)

    monkeypatch.setattr(engine_module, "OffloadEngine", SlowEngine)  # imported at entry
    ctx = offload_context("disk", save_dir)
    done: list[object] = []

    def enter_and_exit() -> None:
        with ctx as engine:
            done.append(engine)

    thread = threading.Thread(target=enter_and_exit)
    thread.start()
    assert building.wait(10)
    with pytest.raises(OffloadError, match="only once"), ctx:
        pass
    go.set()
    thread.join(10)
    assert len(done) == 1 and done[0].closed


def test_a_context_whose_entry_failed_may_be_entered_again(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    ctx = offload_context("disk", str(blocker / "acts"))
    for _ in range(2):  # the same error again, not "only once"
        with pytest.raises((OSError, ValueError, OffloadError)) as info, ctx:
            pass
        assert "only once" not in str(info.value)


def test_a_second_exit_logs_nothing_more(save_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    ctx = offload_context("disk", save_dir)
    with caplog.at_level(logging.INFO, logger="prefetch_offload"):
        with ctx:
            pass
        ctx.__exit__(None, None, None)
    assert len([r for r in caplog.records if r.name == "prefetch_offload"]) == 1


def test_context_defaults_are_the_config_defaults() -> None:
    """offload_context spells out every knob; its defaults must be OffloadConfig's."""
    params = inspect.signature(offload_context).parameters
    for field in dataclasses.fields(OffloadConfig):
        if field.name in ("target", "save_dir"):
            continue
        assert params[field.name].default == field.default, field.name


def test_exiting_contexts_out_of_order_is_an_error_and_changes_nothing(tmp_path: Path) -> None:
    outer = offload_context("disk", str(tmp_path / "a"))
    inner = offload_context("disk", str(tmp_path / "b"))
    outer_engine = outer.__enter__()
    inner_engine = inner.__enter__()
    try:
        with pytest.raises(OffloadError, match="reverse order"):
            outer.__exit__(None, None, None)
        x = torch.randn(1 << 15, requires_grad=True)
        (x * 2).sin().sum().backward()  # still the inner context's hooks
        assert inner_engine.stats().peak_disk_bytes_in_use > 0
        assert outer_engine.stats().peak_disk_bytes_in_use == 0
    finally:
        inner.__exit__(None, None, None)
        outer.__exit__(None, None, None)
    assert outer_engine.closed and inner_engine.closed
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("version", ["2.10.1", "2.4.0+cu121", "1.13.1"])
def test_an_older_torch_fails_at_entry_naming_the_supported_versions(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    ctx = offload_context("disk", save_dir)
    with pytest.raises(OffloadError, match=r"needs torch >= 2\.11 \(tested with 2\.11 and 2\.13\)"):
        ctx.__enter__()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0+cpu", "2.15.0a0+git1234", "unknown"])
def test_supported_or_unparsable_torch_versions_pass(version: str) -> None:
    check_torch_version(version)


def test_summary_names_glibc_s_tunables_only_when_trims_ran() -> None:
    from prefetch_offload.context import _summary
    from prefetch_offload.stats import OffloadStats

    hint = "GLIBC_TUNABLES=glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"
    trimmed = OffloadStats(heap_trims=3, heap_trim_seconds=0.25)
    assert "heap trims: 3 (0.250 s)" in _summary(trimmed, "disk", hint)
    assert hint in _summary(trimmed, "disk", hint)
    assert "python -m prefetch_offload run" in _summary(trimmed, "disk", hint)
    assert hint not in _summary(OffloadStats(), "disk", hint)  # no trims: nothing to suggest
    assert "faulted in again" not in _summary(trimmed, "disk", None)  # already set, or no glibc


def test_an_interrupt_while_exit_waits_for_writes_still_closes_the_engine(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while the exit waits for pending writes: the interrupt reaches the caller,
    and the engine closes in the background (IO threads stopped, files closed)."""
    import threading

    x = torch.randn(1 << 15, requires_grad=True)
    with pytest.raises(KeyboardInterrupt):
        with offload_context("disk", save_dir, min_offload_bytes=0) as engine:
            y = (x * 2).sin()
            real = engine._writer.wait
            calls: list[int] = []

            def interrupted() -> None:
                calls.append(1)
                if len(calls) == 1:
                    raise KeyboardInterrupt
                real()

            monkeypatch.setattr(engine._writer, "wait", interrupted)
    engine.close()  # a second close waits for the one the interrupt left running
    assert engine.closed and len(calls) == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("prefetch_offload-")]
    del y


def test_a_plan_change_empties_the_allocator_cache_only_for_a_cuda_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [a trim where the plan changes]: a CUDA model's plan change also empties the
    caching allocator (never inside a graph capture); a CPU model's only trims the heap."""
    from types import SimpleNamespace

    from prefetch_offload.context import _release_at_plan_change

    calls: list[str] = []
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    engine: Any = SimpleNamespace(_heap=SimpleNamespace(trim_now=lambda: calls.append("trim")))
    on_cuda = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(is_cuda=True)]))
    release = _release_at_plan_change(engine, on_cuda)
    release()
    capturing[0] = True
    release()
    assert calls == ["trim", "empty", "trim"]
    calls.clear()
    _release_at_plan_change(engine, torch.nn.Linear(2, 2))()
    assert calls == ["trim"]


def test_an_abandoned_executor_wait_never_runs_and_one_running_is_waited_for() -> None:
    """``__aexit__`` cancelled while the writes are awaited in an executor: a wait that
    had not started never runs; abandoning one that runs returns once it ended."""
    calls: list[str] = []
    early = _ExecutorWait(lambda: calls.append("early"))
    early.abandon()
    early.run()
    assert calls == []

    entered = threading.Event()

    def slow() -> None:
        entered.set()
        time.sleep(0.2)
        calls.append("slow")

    running = _ExecutorWait(slow)
    worker = threading.Thread(target=running.run)
    worker.start()
    assert entered.wait(10)
    running.abandon()
    assert calls == ["slow"]  # (abandon returned after the wait ended)
    worker.join()
