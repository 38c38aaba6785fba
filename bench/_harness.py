"""The training harness of ``bench/step.py`` and ``bench/sweep.py``: lanes stepped side by side.

A lane is one configuration (an offload mode and its knobs) training its own copy
of one model: same initial weights, same batches. The caller steps every lane
once per round, in the order ``round_order`` gives (a balanced Latin square), so
that machine drift and the previous step's leftovers hit every lane alike. Each
lane sets up what lives for the whole run once (the engine and its IO threads,
the bare-IO thread) and installs its saved-tensor hooks around each of its own
steps: what ``offload_context`` does for a user who wraps ``trainer.train()``.

A lane runs in the calling process (:class:`Lane`) or in a process of its own
(:class:`ProcessLane`, spawned, answering calls over a pipe). In one process
the lanes share one heap: pages one lane's heap trim gives back are faulted in
again by whichever lane allocates next, and the peak RSS is the process's. In
processes of their own each lane's page faults, peak RSS and live heap are its
own, as a user's training is.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import multiprocessing
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
from _common import (
    TORCH_THREADS,
    IOReplay,
    heap_in_use_bytes,
    peak_rss_bytes,
    read_rss_bytes,
    reset_peak_rss,
)
from _probe import Sampler, _sgd_step

from prefetch_offload import OffloadConfig, OffloadEngine
from prefetch_offload.testing import TinyTransformer, make_batch, warm_up_unary_ops

__all__ = [
    "DEVICES",
    "KINDS",
    "Lane",
    "LaneFailed",
    "LaneSpec",
    "ProcessLane",
    "Shape",
    "add_shape_args",
    "build",
    "parse_config",
]

# What each kind of lane runs. "budget" offloads to disk on the CPU and to host RAM
# ("cpu") on a GPU; "cpu" needs a GPU or the twin; the two io* kinds train as "none"
# while a bare thread moves bytes (IOReplay).
KINDS: dict[str, str] = {
    "none": "no offload",
    "disk": "prefetch_offload, target disk",
    "budget": "offload with device_budget a share of saved",
    "cpu": 'prefetch_offload, target "cpu" (pinned host RAM)',
    "iospread": "no hooks; a bare thread moves every saved byte (O_DIRECT)",
    "iobudget": "iospread moving saved - budget bytes",
    "save_on_cpu": "torch save_on_cpu",
}
REPLAY_KINDS = frozenset({"iospread", "iobudget"})
# "cuda": a GPU; "twin": the CUDA path's CPU twin (CPU tensors, the GPU's engine layer).
DEVICES = ("cpu", "cuda", "twin")
_DEFAULT_CHUNK = next(
    f.default for f in dataclasses.fields(OffloadConfig) if f.name == "chunk_bytes"
)
_CHOICES = {
    "checkpoint": ("off", "reentrant", "non-reentrant"),
    "compile": ("off", "regional", "whole"),
    "attention": ("explicit", "sdpa"),
    "dtype": ("fp32", "bf16"),
}


@dataclass(frozen=True)
class Shape:
    """The TinyTransformer trained and its batch; ``checkpoint`` runs every block under
    ``torch.utils.checkpoint``; ``compile`` compiles each block ("regional") or the
    whole model."""

    depth: int = 16
    width: int = 256
    heads: int = 4
    batch: int = 8
    seq: int = 256
    vocab: int = 512
    attention: str = "explicit"
    dtype: str = "fp32"
    checkpoint: str = "off"
    compile: str = "off"

    def __str__(self) -> str:
        extra = [
            f"{f.name} {getattr(self, f.name)}"
            for f in dataclasses.fields(self)[5:]
            if getattr(self, f.name) != f.default
        ]
        return ", ".join(
            [
                f"TinyTransformer, {self.depth} blocks, width {self.width}, {self.heads} heads, "
                f"batch {self.batch} x {self.seq} tokens",
                *extra,
            ]
        )


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """A flag per field of :class:`Shape` (``--depth``, ``--checkpoint``, ...)."""
    for f in dataclasses.fields(Shape):
        flag = "--" + f.name.replace("_", "-")
        if f.name in _CHOICES:
            p.add_argument(flag, choices=_CHOICES[f.name], default=f.default)
        else:
            p.add_argument(flag, type=int, default=f.default)


def build(
    shape: Shape, rounds: int, device: str = "cpu"
) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model (seeded: every process builds the same weights) and one batch per round,
    on ``device`` ("twin" is the CPU)."""
    where = "cuda" if device == "cuda" else "cpu"
    batches = [
        tuple(t.to(where) for t in make_batch(shape.batch, shape.seq, vocab=shape.vocab, seed=r))
        for r in range(rounds)
    ]
    torch.manual_seed(0)
    # Built where it trains: a GPU-sized model initialised by 2 CPU threads takes seconds
    # per lane (every lane is seeded alike, so the lanes still start identical).
    with torch.device(where):
        model = TinyTransformer(
            vocab=shape.vocab,
            width=shape.width,
            depth=shape.depth,
            heads=shape.heads,
            attention=shape.attention,
        )
    model = model.to(where, dtype=torch.bfloat16 if shape.dtype == "bf16" else torch.float32)
    if shape.checkpoint != "off":
        reentrant = shape.checkpoint == "reentrant"
        for block in model.blocks:  # type: ignore[union-attr]
            block.forward = _checkpointed(block.forward, reentrant)
    if shape.compile == "regional":
        for block in model.blocks:  # type: ignore[union-attr]
            block.compile()
    elif shape.compile == "whole":
        model.compile()
    return model, batches  # type: ignore[return-value]


def _checkpointed(forward: Callable[..., Any], reentrant: bool) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    return lambda x: checkpoint(forward, x, use_reentrant=reentrant)


@dataclass(frozen=True)
class LaneSpec:
    """One lane: its name, its kind (a key of ``KINDS``), the OffloadConfig keywords of
    an engine lane, the environment of its process (isolated lanes: e.g. an allocator
    setting, read at startup), the bytes per step of a bare-IO lane, and what the
    tables call it."""

    name: str
    kind: str
    knobs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    replay_bytes: int = 0
    label: str = ""


def parse_config(text: str) -> tuple[str, dict[str, Any]]:
    """``--config NAME:JSON`` -> (name, the JSON object): OffloadConfig keywords, and
    optionally ``"mode"`` (the lane's kind, default "disk"), ``"env"`` (its process's
    environment) and ``"budget_fraction"`` (a budget lane's device_budget share)."""
    name, _, body = text.partition(":")
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--config needs NAME:JSON, NAME a word: {text!r}")
    try:
        doc = json.loads(body) if body else {}
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--config {name}: bad JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("mode", "disk") not in KINDS:
        raise argparse.ArgumentTypeError(
            f"--config {name}: a JSON object whose 'mode' is one of {', '.join(KINDS)}"
        )
    knobs = {k: v for k, v in doc.items() if k not in ("mode", "env", "budget_fraction")}
    try:
        OffloadConfig(**{"target": "cpu", **knobs})
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"--config {name}: {exc}") from exc
    return name, doc


# -- one lane ----------------------------------------------------------------------------


@contextlib.contextmanager
def _engine_run(config: OffloadConfig, device: str) -> Iterator[OffloadEngine]:
    """One engine for the run (``offload_context`` minus the hooks); on the twin, the
    GPU's device layer over CPU tensors."""
    layer = None
    if device == "twin":
        from prefetch_offload.device import RoutingDevice, SpanCopyDevice

        layer = RoutingDevice([SpanCopyDevice("cpu")])
    engine = OffloadEngine(config, device=layer)
    try:
        yield engine
    except BaseException:
        engine.close(raise_errors=False)
        raise
    engine.close()


def _setup(
    spec: LaneSpec, folder: str, device: str
) -> tuple[AbstractContextManager[Any], Callable[[Any], AbstractContextManager[Any]]]:
    """The lane's run context (entered once; gives the engine, the replay or None) and
    its step hooks (entered around each step, given that handle)."""
    none: Callable[[Any], AbstractContextManager[Any]] = contextlib.nullcontext
    if spec.kind == "none":
        return contextlib.nullcontext(), none
    if spec.kind in REPLAY_KINDS:
        chunk = spec.knobs.get("chunk_bytes", _DEFAULT_CHUNK)
        replay = IOReplay(os.path.join(folder, spec.name), spec.replay_bytes, chunk=chunk)
        return replay, none
    if spec.kind == "save_on_cpu":
        pin = device == "cuda"
        return contextlib.nullcontext(), lambda _: torch.autograd.graph.save_on_cpu(pin)
    target = "cpu" if spec.kind == "cpu" or (spec.kind == "budget" and device != "cpu") else "disk"
    save_dir = os.path.join(folder, spec.name) if target == "disk" else None
    config = OffloadConfig(**{"target": target, "save_dir": save_dir, **spec.knobs})

    def hooks(engine: OffloadEngine) -> AbstractContextManager[Any]:
        return torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack)

    return _engine_run(config, device), hooks


class Lane:
    """One lane in this process: its model copy, its run context and its step hooks.

    ``step(r)`` runs training step ``r`` (forward, backward, SGD) inside the lane's
    hooks and returns its wall seconds, loss, minor page faults and memory:
    ``peak``, the most the step held above the lane's start (the process's peak
    RSS on the CPU, allocated device memory on a GPU, where ``peak_reserved`` is
    the caching allocator's reserved memory: the process's, a lane's only where it
    has a process of its own), and ``live``, what was live at the end of forward
    above the start (malloc's bytes in use; on a GPU allocated memory).
    """

    def __init__(self, spec: LaneSpec, shape: Shape, rounds: int, device: str, folder: str):
        self.spec, self.device = spec, device
        self.cuda = device == "cuda"
        self.model, self.batches = build(shape, rounds, device)
        self.params = list(self.model.parameters())
        run, self._hooks = _setup(spec, folder, device)
        self._run: AbstractContextManager[Any] | None = run
        self.handle = run.__enter__()
        gc.collect()
        self.base_rss, self.base_heap = read_rss_bytes(), 0
        self.base_heap = self._live()
        self.base_reserved = torch.cuda.memory_reserved() if self.cuda else 0
        self.marks = (0.0, 0.0, 0.0)  # the last step's start, backward start, end

    def _live(self) -> int:
        """Live bytes above the lane's start: allocated device memory (read from the
        nested stats: ``memory_allocated`` flattens and sorts every statistic), or
        malloc's bytes in use."""
        if self.cuda:
            stats = torch.cuda.memory_stats_as_nested_dict()
            return int(stats["allocated_bytes"]["all"]["current"]) - self.base_heap
        return (heap_in_use_bytes() or 0) - self.base_heap

    def step(self, r: int) -> dict[str, Any]:
        tokens, targets = self.batches[r % len(self.batches)]
        replay = self.handle if isinstance(self.handle, IOReplay) else None
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        exact = reset_peak_rss()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        with self._hooks(self.handle):
            if replay is not None:
                replay.forward_started()
            loss = self.model(tokens, targets)
            live = self._live()
            tb = time.perf_counter()
            if replay is not None:
                replay.backward_started()
            loss.backward()
            if replay is not None:
                replay.wait()
        _sgd_step(self.params)
        if self.cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        reserved = None
        if self.cuda:  # in use; and what the caching allocator holds (the process's)
            peak = torch.cuda.max_memory_allocated() - self.base_heap
            reserved = torch.cuda.max_memory_reserved() - self.base_reserved
        else:
            peak = max(peak_rss_bytes() if exact else 0, read_rss_bytes()) - self.base_rss
        self.marks = (t0, tb, t1)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        return {
            "seconds": t1 - t0,
            "loss": loss.item(),
            "faults": faults,
            "peak": peak,
            "peak_reserved": reserved,
            "live": live,
        }

    def trace(self, r: int, interval: float) -> dict[str, Any]:
        """Step ``r`` with RSS and live bytes sampled every ``interval`` seconds from a
        thread: seconds from the step's start, bytes above the lane's start."""
        with Sampler(interval, self._live) as sampler:
            out = self.step(r)
        t0, tb, t1 = self.marks
        # The samples taken on entry and exit, just outside the step, stand at its ends.
        inside = [(min(max(t, t0), t1), rss, live) for t, rss, live in sampler.samples]
        return {
            "t_s": [round(t - t0, 5) for t, _, _ in inside],
            "rss_bytes": [rss - self.base_rss for _, rss, _ in inside],
            "live_bytes": [live for _, _, live in inside],
            "live_counter": "torch.cuda allocated" if self.cuda else "malloc in use",
            "backward_s": tb - t0,
            "end_s": t1 - t0,
            "seconds": out["seconds"],
            "interval_s": interval,
        }

    def counters(self) -> dict[str, float]:
        """Cumulative counters: the engine's stats, or the bytes a bare thread moved."""
        if isinstance(self.handle, IOReplay):
            return {
                "bytes_offloaded": self.handle.bytes_written,
                "bytes_read": self.handle.bytes_read,
            }
        if isinstance(self.handle, OffloadEngine):
            return dict(dataclasses.asdict(self.handle.stats()))
        return {}

    def final_params(self) -> list[torch.Tensor]:
        """Copies of the parameters now (a tensor sent over a pipe shares its memory)."""
        return [p.detach().cpu() if p.is_cuda else p.detach().clone() for p in self.params]

    def close(self) -> None:
        """Leave the run context (closing an engine raises what its threads raised)."""
        run, self._run = self._run, None
        if run is not None:
            run.__exit__(None, None, None)


class LaneFailed(RuntimeError):
    """A lane raised, or its process died; the message names the lane (and holds the
    child's traceback)."""


def _serve(conn: Connection, args: tuple[Any, ...]) -> None:
    """An isolated lane's process: builds its Lane, says "ready", then answers the
    parent's calls until "close". Every answer is ``(True, value)``, or ``(False,
    traceback)`` when the call raised (the process then ends)."""
    torch.set_num_threads(TORCH_THREADS)
    warm_up_unary_ops()  # NOTE [first unary call]: lanes are compared bit for bit
    lane = None
    try:
        lane = Lane(*args)
        conn.send((True, "ready"))
        while True:
            name, call_args = conn.recv()
            if name == "close":
                lane, closing = None, lane
                closing.close()
                conn.send((True, None))
                return
            conn.send((True, getattr(lane, name)(*call_args)))
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send((False, traceback.format_exc()))
    finally:
        if lane is not None:
            with contextlib.suppress(Exception):
                lane.close()


class ProcessLane:
    """A :class:`Lane` in a spawned process of its own, with ``spec.env`` added to its
    environment; the same calls, answered over a pipe. Call :meth:`wait_ready` once
    every lane is started."""

    def __init__(self, spec: LaneSpec, shape: Shape, rounds: int, device: str, folder: str):
        self.spec = spec
        self._failed = False
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # The child imports _serve by this module's name, with bench/ on its sys.path,
        # and reads the environment (an allocator's settings) when it starts.
        saved_path, saved_env = list(sys.path), dict(os.environ)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        os.environ.update(spec.env)
        try:
            serve = importlib.import_module("_harness")._serve
            args = (spec, shape, rounds, device, folder)
            self._proc = ctx.Process(target=serve, args=(child, args), daemon=True)
            self._proc.start()
        finally:
            sys.path[:] = saved_path
            os.environ.clear()
            os.environ.update(saved_env)
        child.close()

    def _answer(self) -> Any:
        try:
            ok, value = self._conn.recv()
        except EOFError:
            self._failed = True
            self._proc.join(timeout=5)
            raise LaneFailed(
                f"lane {self.spec.name!r}: its process ended (exit code {self._proc.exitcode})"
            ) from None
        if not ok:
            self._failed = True
            raise LaneFailed(f"lane {self.spec.name!r} failed in its process:\n{value}")
        return value

    def _call(self, name: str, *args: Any) -> Any:
        try:
            self._conn.send((name, args))
        except OSError:
            raise LaneFailed(f"lane {self.spec.name!r}: its process is gone") from None
        return self._answer()

    def wait_ready(self) -> None:
        self._answer()

    def step(self, r: int) -> dict[str, Any]:
        return self._call("step", r)

    def trace(self, r: int, interval: float) -> dict[str, Any]:
        return self._call("trace", r, interval)

    def counters(self) -> dict[str, float]:
        return self._call("counters")

    def final_params(self) -> list[torch.Tensor]:
        return self._call("final_params")

    def close(self) -> None:
        """Close the child's lane (raising what that raised) and end the process."""
        try:
            if not self._failed and self._proc.is_alive():
                self._call("close")
        finally:
            self._proc.join(timeout=60)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
            self._conn.close()


def close_all(lanes: Sequence[Lane | ProcessLane]) -> None:
    """Close every lane, then raise the first error one of them raised."""
    first: BaseException | None = None
    for lane in lanes:
        try:
            lane.close()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first
