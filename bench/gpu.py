"""Train a transformer on a CUDA GPU under each offload mode: step time and peak memory.

Modes, each training its own copy of one model (same initial weights, same
batch), interleaved round by round (round ``r`` runs one step of every mode,
in the order ``round_order(modes, r)`` gives: a balanced Latin square) so
that clock and thermal drift hit all alike:

- ``none``: no offload.
- ``cpu``: this library, target "cpu" (pinned host RAM).
- ``budget``: ``cpu`` with ``device_budget`` set to ``--budget-fraction`` (default
  0.5) of the bytes one forward saves for backward (parameters excluded, measured
  once before the modes are built, as bench/step.py does): the newest saved
  tensors up to the budget stay in GPU memory, the oldest are copied to pinned
  host RAM (NOTE [tiers] in prefetch_offload/policy.py).
- ``copybudget``: the reference for ``budget``'s step time: ``none``'s training,
  no hooks, while a side CUDA stream (a side thread on the twin) copies
  ``saved - budget`` bytes from a device buffer to a pinned host buffer in
  ``--chunk-bytes`` pieces, starting when forward starts, and back when backward
  starts; the step's end waits for both (its time includes copies that outlast
  backward). Its buffers are made once for the run.
- ``disk``: this library, target "disk" (GPU -> pinned staging -> slab files).
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``.
- ``ondemand``: the approach of the common fine-tuning libraries, reimplemented
  here: pack copies each saved activation to pinned host memory with a
  non-blocking copy on the compute stream, unpack copies it back on the compute
  stream when backward asks (no lookahead, no side stream).

Each library engine lives for the whole run (as ``with offload_context(...):
trainer.train()`` would); its hooks are installed around each of its steps.

Columns: median step time and its ratio to ``none``; peak activation memory
(``torch.cuda.max_memory_allocated`` during forward, minus what was allocated
when forward started: the model, its gradients, the batch) and its cut against
``none``; the same peak over the whole step; bytes offloaded per step; hit
rate and stall time (library modes). Before the timed rounds the script also
measures the host link (pinned D2H and H2D copies of 1 GiB) and the save_dir
disk (O_DIRECT, 8 MiB requests), and prints the time those bandwidths need
for the step's bytes: the bound any offload mode must live within.

Exactness: the first round's gradients of every mode are compared with those
of ``none`` (torch.equal), with the math attention backend (fused attention
backward kernels may use atomics) and after a control that runs ``none``
twice: if the model itself is not reproducible, the column says so instead of
claiming anything.

After the table come issue 14's targets for the GPU run, each PASS, FAIL or n/a:
exact gradients; target "cpu" within 1.03x of ``none`` with its forward peak cut by
80% or more, ahead of ``save_on_cpu`` on both; no pinned arena made (no
``cudaHostAlloc``) and no pageable fallback during the timed steps (NOTE [pinned
arena]); reserved memory the same at the start of every timed step. Then issue 13's
budget targets, judged as bench/step.py judges them on the CPU: ``budget``'s step
peak at most ``device_budget + (none's step peak - saved) + 10% of saved``;
its bytes moved per step within 10% of ``saved - budget``; its step time below
``cpu``'s (offload everything) and at most 1.05x ``copybudget``'s. Only inexact
gradients make the exit status non-zero.

``--twin`` runs the same script on the CPU through the CUDA path's CPU twin
(memory columns read 0 there): the smoke test in tests/test_bench.py uses it.

Example (H200; see docs/benchmarks.md):
    python bench/gpu.py --width 2048 --depth 8 --seq 2048 --batch 8 --json gpu.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import os
import queue
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import RssSampler, read_rss_bytes, round_order, scratch_folder
from _plot import memory_over_step
from _text import log
from step import (
    BUDGET_FRACTION,
    BUDGET_SLACK,
    IOBUDGET_LIMIT,
    MOVE_TOLERANCE,
    _saved_activation_bytes,
)

from prefetch_offload import OffloadConfig, OffloadEngine
from prefetch_offload.device import (
    DeviceLayer,
    RoutingDevice,
    SpanCopyDevice,
    default_device_layer,
)
from prefetch_offload.probe import raw_bandwidth
from prefetch_offload.testing import TinyTransformer, make_batch, warm_up_unary_ops

MODES = ("none", "cpu", "budget", "copybudget", "disk", "save_on_cpu", "ondemand")
# The library modes and the target each engine runs with.
ENGINE_TARGETS = {"cpu": "cpu", "budget": "cpu", "disk": "disk"}
# The traced step's sampling period: each sample takes the GIL from the step's hooks, so
# a period far above one sample's cost (microseconds) keeps the trace from slowing the
# step it draws, and still resolves every block's forward and backward.
TRACE_INTERVAL_S = 0.002


class OnDemandHooks:
    """Baseline: copy to pinned host memory on the compute stream, copy back on demand."""

    def pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        if not t.is_cuda or isinstance(base, torch.nn.Parameter) or base.is_leaf:
            return t
        return t.device, t.to("cpu", non_blocking=True)  # pinned, ordered on the stream

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)


class CopyReplay:
    """copybudget: ``nbytes`` per step moved by a bare side stream, no hooks, no engine.

    Device -> pinned host during forward, host -> device during backward, in
    ``chunk``-byte copies, between two buffers made once here. On a GPU the copies
    are queued on a side CUDA stream; on the twin a side thread copies between two
    CPU buffers. The step calls :meth:`forward_started`, :meth:`backward_started`
    and, when backward has returned, :meth:`wait`; ``bytes_d2h`` and ``bytes_h2d``
    count what was moved (exactly ``nbytes`` each per step, by construction).
    """

    def __init__(self, nbytes: int, *, chunk: int, cuda: bool) -> None:
        if nbytes < 0 or chunk < 1:
            raise ValueError("CopyReplay needs nbytes >= 0 and chunk >= 1")
        self.nbytes, self.chunk, self.cuda = nbytes, chunk, cuda
        self.bytes_d2h = 0
        self.bytes_h2d = 0
        device = torch.device("cuda" if cuda else "cpu")
        self._device_buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self._host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self._stream: Any = None
        self._thread: threading.Thread | None = None
        self._cmds: queue.Queue[str | None] = queue.Queue()
        self._done: queue.Queue[BaseException | None] = queue.Queue()
        if cuda:
            self._stream = torch.cuda.Stream()
            torch.cuda.synchronize()  # the buffers are made before any copy reads them
        else:
            self._thread = threading.Thread(target=self._main, name="bench-copybudget", daemon=True)
            self._thread.start()

    def _copy(self, op: str) -> None:
        """Every chunk of one direction; the counters add what each copy moves."""
        d2h = op == "d2h"
        src, dst = (self._device_buf, self._host_buf) if d2h else (self._host_buf, self._device_buf)
        for off in range(0, self.nbytes, self.chunk):
            piece = src[off : off + self.chunk]
            dst[off : off + self.chunk].copy_(piece, non_blocking=self.cuda)
            if d2h:
                self.bytes_d2h += piece.numel()
            else:
                self.bytes_h2d += piece.numel()

    def _start(self, op: str) -> None:
        if self.cuda:
            with torch.cuda.stream(self._stream):  # queued in order on the side stream
                self._copy(op)
        else:
            self._cmds.put(op)

    def forward_started(self) -> None:
        """Start this step's device -> host copies."""
        self._start("d2h")

    def backward_started(self) -> None:
        """Start this step's host -> device copies (after the device -> host ones)."""
        self._start("h2d")

    def wait(self) -> None:
        """The step's end waits for both directions; re-raise the twin thread's error.

        On a GPU the compute stream waits for an event recorded on the side stream
        (the step's closing synchronize then covers the copies); on the twin this
        blocks until the side thread has done both."""
        if self.cuda:
            done = torch.cuda.Event()
            done.record(self._stream)
            torch.cuda.current_stream().wait_event(done)
            return
        errors = [err for err in (self._done.get(), self._done.get()) if err is not None]
        if errors:
            raise errors[0]

    def _main(self) -> None:
        while (op := self._cmds.get()) is not None:
            try:
                self._copy(op)
                self._done.put(None)
            except BaseException as exc:
                self._done.put(exc)

    def close(self) -> None:
        """Stop the twin's thread; the buffers go with the object."""
        if self._thread is not None:
            self._cmds.put(None)
            self._thread.join()
            self._thread = None
        elif self._stream is not None:
            self._stream.synchronize()


@dataclasses.dataclass(frozen=True)
class GpuRow:
    """One mode's measurements."""

    mode: str
    step_seconds: tuple[float, ...]
    fwd_peak_bytes: tuple[int, ...]
    step_peak_bytes: tuple[int, ...]
    exact: str
    bytes_offloaded_per_step: float | None = None
    hit_rate: float | None = None
    stall_seconds_per_step: float | None = None
    pack_wait_seconds_per_step: float | None = None
    # Growth of the caching allocator's reserved memory over each step: blocks cached
    # for the copy streams (NOTE [copy streams]) show here, not in allocated memory.
    reserved_growth_bytes: tuple[int, ...] = ()
    # The caching allocator's reserved memory when each timed step began (all modes
    # share that allocator): what "no growth step over step" is judged on.
    reserved_start_bytes: tuple[int, ...] = ()
    # Library modes: pinned arenas made during the timed steps (cudaHostAlloc calls,
    # NOTE [pinned arena]) and host buffers that fell back to pageable memory.
    pin_calls_timed: int | None = None
    pageable_fallbacks: int | None = None
    # Library modes (NOTE [tiers]): bytes demoted from the device tier to host memory
    # per timed step, and the most the device tier ever kept once a pack returned.
    bytes_demoted_to_host_per_step: float | None = None
    peak_device_tier_bytes: int | None = None

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def fwd_peak(self) -> float:
        return statistics.median(self.fwd_peak_bytes)

    @property
    def step_peak(self) -> float:
        return statistics.median(self.step_peak_bytes)


def link_bandwidth(nbytes: int = 1 << 30) -> tuple[float, float]:
    """GB/s of pinned host <-> device copies (D2H, H2D), best of three each."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = []
    for dst, src in ((host, dev), (dev, host)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out.append(nbytes / best / 1e9)
    del dev, host
    torch.cuda.empty_cache()
    return out[0], out[1]


class _Gpu:
    """The CUDA calls the benchmark makes; all no-ops for the CPU twin."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.device = torch.device("cuda" if cuda else "cpu")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def allocated_now(self) -> int:
        """``allocated()`` for a sampling thread: the one counter, read from the nested
        stats (``memory_allocated`` also flattens and sorts every statistic, holding the
        GIL that the hooks of the step being traced need)."""
        if not self.cuda:
            return 0
        return torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"]

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def reserved(self) -> int:
        return torch.cuda.memory_reserved() if self.cuda else 0

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved() if self.cuda else 0


def _math_attention(cuda: bool) -> AbstractContextManager[Any]:
    if not cuda:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def run(
    args: argparse.Namespace,
) -> tuple[list[GpuRow], dict[str, float], dict[str, dict[str, Any]], dict[str, int]]:
    """The rows, the measured link and disk bandwidths, with ``--plot`` one traced
    step's memory timeline per mode, and the sizes the budget modes use: the bytes one
    forward saves (``saved_activation_bytes``) and ``device_budget``."""
    gpu = _Gpu(not args.twin)
    if not gpu.cuda:
        warm_up_unary_ops()  # NOTE [first unary call]: the twin's modes are compared bit for bit
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    base = TinyTransformer(
        vocab=args.vocab,
        width=args.width,
        depth=args.depth,
        heads=args.heads,
        attention=args.attention,
    ).to(device=gpu.device, dtype=dtype)
    tokens, targets = make_batch(args.batch, args.seq, vocab=args.vocab)
    tokens, targets = tokens.to(gpu.device), targets.to(gpu.device)
    modes = [m.strip() for m in args.modes.split(",")]
    if modes[0] != "none":
        raise SystemExit("--modes must start with none (the reference)")
    unknown = [m for m in modes if m not in MODES]
    if unknown or len(set(modes)) != len(modes):
        raise SystemExit(f"--modes: unknown or repeated modes in {args.modes!r}; known: {MODES}")
    # NOTE [tiers]: the budget modes' sizes, from one forward of the model as it will train
    # (the attention backend of the timed steps: fused kernels save other tensors).
    saved = _saved_activation_bytes(base, (tokens, targets))
    device_budget = round(saved * args.budget_fraction)
    sizes = {"saved_activation_bytes": saved, "device_budget": device_budget}
    gpu.sync()

    env: dict[str, float] = {}
    if gpu.cuda:
        env["d2h_gbps"], env["h2d_gbps"] = link_bandwidth()
    with scratch_folder(args.save_dir, prefix="gpu-") as folder:
        if "disk" in modes:
            env["disk_write_gbps"], env["disk_read_gbps"] = raw_bandwidth(
                folder, args.disk_probe_mb << 20, 8 << 20, 4
            )
        engines: dict[str, OffloadEngine] = {}
        layers: dict[str, DeviceLayer] = {}
        ctx: dict[str, Callable[[], AbstractContextManager[Any]]] = {"none": nullcontext}
        for mode, target in ENGINE_TARGETS.items():
            if mode in modes:
                cfg = OffloadConfig(
                    target=target,
                    save_dir=folder if target == "disk" else None,
                    prefetch_depth=args.depth_prefetch,
                    max_pending_write_bytes=args.max_pending_mb << 20,
                    min_offload_bytes=args.min_offload_bytes,
                    chunk_bytes=args.chunk_bytes,
                    device_budget=device_budget if mode == "budget" else 0,
                )
                layer = layers[mode] = (
                    default_device_layer(target, max_inflight_bytes=cfg.max_inflight_copy_bytes)
                    if gpu.cuda
                    else RoutingDevice([SpanCopyDevice("cpu")])
                )
                eng = engines[mode] = OffloadEngine(cfg, device=layer)
                ctx[mode] = functools.partial(saved_tensors_hooks, eng.pack, eng.unpack)
        if "save_on_cpu" in modes:
            ctx["save_on_cpu"] = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
        if "ondemand" in modes:
            od = OnDemandHooks()
            ctx["ondemand"] = functools.partial(saved_tensors_hooks, od.pack, od.unpack)
        replays: dict[str, CopyReplay] = {}
        if "copybudget" in modes:
            ctx["copybudget"] = nullcontext  # none's training, beside the copies
            replays["copybudget"] = CopyReplay(
                max(saved - device_budget, 0), chunk=args.chunk_bytes, cuda=gpu.cuda
            )

        models = {m: copy.deepcopy(base) for m in modes}
        opts = {m: torch.optim.SGD(models[m].parameters(), lr=1e-4) for m in modes}

        reserved_growth: dict[str, list[int]] = {m: [] for m in modes}
        # Each mode's last step: its start, its backward's start and its end (perf_counter).
        marks: dict[str, tuple[float, float, float]] = {}
        reserved_start: dict[str, list[int]] = {m: [] for m in modes}

        def step(mode: str, *, update: bool = True) -> tuple[float, int, int, list[torch.Tensor]]:
            model = models[mode]
            gpu.sync()
            gpu.reset_peak()
            start_mem = gpu.allocated()
            start_reserved = gpu.reserved()
            reserved_start[mode].append(start_reserved)
            replay = replays.get(mode)
            t0 = time.perf_counter()
            with ctx[mode]():
                if replay is not None:
                    replay.forward_started()
                loss = model(tokens, targets)
                fwd_peak = gpu.peak() - start_mem  # allocations are counted when issued
                tb = time.perf_counter()
                if replay is not None:
                    replay.backward_started()
                loss.backward()
            del loss
            if replay is not None:
                replay.wait()  # copies that outlast backward count in the step
            grads = [p.grad.detach().clone() for p in model.parameters()] if not update else []
            if update:
                opts[mode].step()
            opts[mode].zero_grad(set_to_none=True)
            gpu.sync()
            t1 = time.perf_counter()
            marks[mode] = (t0, tb, t1)
            reserved_growth[mode].append(gpu.peak_reserved() - start_reserved)
            return t1 - t0, fwd_peak, gpu.peak() - start_mem, grads

        def traced_step(mode: str) -> dict[str, Any]:
            """One more step of ``mode``, with memory sampled every TRACE_INTERVAL_S:
            allocated device memory on a GPU (counted when allocations are issued), RSS
            on the twin; both above what the step started with."""
            read = gpu.allocated_now if gpu.cuda else read_rss_bytes
            gpu.sync()
            base = read()
            with RssSampler(TRACE_INTERVAL_S, record=True, read=read) as sampler:
                step(mode)
                last = read()
            t0, tb, t1 = marks[mode]
            inside = [(t, v) for t, v in sampler.trace if t0 < t < t1]
            trace = [(t - t0, v - base) for t, v in ((t0, base), *inside, (t1, last))]
            return {
                "t_s": [round(t, 6) for t, _ in trace],
                "rss_bytes": [v for _, v in trace],
                "backward_s": tb - t0,
                "end_s": t1 - t0,
                "counter": "torch.cuda.memory_allocated" if gpu.cuda else "RSS",
            }

        # Exactness: round 0 without an update, every mode against none (and none twice),
        # with the math attention backend: fused attention backward kernels may use
        # atomics, which no offload can make reproducible.
        with _math_attention(gpu.cuda):
            _, _, _, ref = step("none", update=False)
            _, _, _, again = step("none", update=False)
            reproducible = all(torch.equal(a, b) for a, b in zip(ref, again, strict=True))
            exact: dict[str, str] = {"none": "ref" if reproducible else "model not reproducible"}
            for mode in modes[1:]:
                _, _, _, g = step(mode, update=False)
                same = all(torch.equal(a, b) for a, b in zip(ref, g, strict=True))
                exact[mode] = ("yes" if same else "NO") if reproducible else "n/a (model)"
        del ref, again

        samples: dict[str, list[tuple[float, int, int]]] = {m: [] for m in modes}
        before = {m: e.stats() for m, e in engines.items()}
        pins_before = {m: _pin_counts(layer) for m, layer in layers.items()}
        copied_before = {m: rp.bytes_d2h for m, rp in replays.items()}
        for r in range(args.warmup + args.steps):
            if r == args.warmup:
                before = {m: e.stats() for m, e in engines.items()}
                pins_before = {m: _pin_counts(layer) for m, layer in layers.items()}
                copied_before = {m: rp.bytes_d2h for m, rp in replays.items()}
            order = round_order(modes, r)
            times = []
            for mode in order:
                dt, fwd, peak, _ = step(mode)
                times.append(f"{mode} {dt * 1e3:.1f} ms")
                if r >= args.warmup:
                    samples[mode].append((dt, fwd, peak))
            # Per round, flushed: a stage killed by its time limit still leaves numbers.
            kind = "warmup" if r < args.warmup else "timed"
            print(f"round {r + 1} ({kind}): " + ", ".join(times), file=sys.stderr, flush=True)
        rows = []
        for mode in modes:
            s = samples[mode]
            extra: dict[str, Any] = {}
            if mode in engines:
                a, b = before[mode], engines[mode].stats()
                n = args.steps
                hits, misses = (
                    b.prefetch_hits - a.prefetch_hits,
                    b.prefetch_misses - a.prefetch_misses,
                )
                pins, fallbacks = _pin_counts(layers[mode])
                extra = dict(
                    bytes_offloaded_per_step=(b.bytes_offloaded - a.bytes_offloaded) / n,
                    hit_rate=hits / (hits + misses) if hits + misses else 0.0,
                    stall_seconds_per_step=(b.stall_seconds - a.stall_seconds) / n,
                    pack_wait_seconds_per_step=(b.pack_wait_seconds - a.pack_wait_seconds) / n,
                    pin_calls_timed=pins - pins_before[mode][0],
                    pageable_fallbacks=fallbacks,
                    bytes_demoted_to_host_per_step=(
                        b.bytes_demoted_to_host - a.bytes_demoted_to_host
                    )
                    / n,
                    peak_device_tier_bytes=b.peak_device_tier_bytes,
                )
            elif mode in replays:
                copied = replays[mode].bytes_d2h - copied_before[mode]
                extra = dict(bytes_offloaded_per_step=copied / args.steps)
            rows.append(
                GpuRow(
                    mode,
                    tuple(x[0] for x in s),
                    tuple(x[1] for x in s),
                    tuple(x[2] for x in s),
                    exact[mode],
                    reserved_growth_bytes=tuple(reserved_growth[mode][-args.steps :]),
                    reserved_start_bytes=tuple(reserved_start[mode][-args.steps :]),
                    **extra,
                )
            )
        timelines = {m: traced_step(m) for m in modes} if args.plot else {}
        for e in engines.values():
            e.close()
        for rp in replays.values():
            rp.close()
    return rows, env, timelines, sizes


def _pin_counts(layer: DeviceLayer) -> tuple[int, int]:
    """(pinned arenas made so far, pageable fallbacks) of a library mode's device layer."""
    parts = layer.layers if isinstance(layer, RoutingDevice) else [layer]
    pins = sum(p.pool.pin_calls for p in parts if isinstance(p, SpanCopyDevice))
    return pins, layer.pageable_fallbacks()


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def _size(nbytes: float) -> str:
    """A byte count in GB, MB or kB (decimal), whichever reads best: the GPU's sizes
    and the twin's toy ones alike."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 1e3:.1f} kB"


def targets(
    rows: list[GpuRow], *, saved_bytes: int | None = None, device_budget: int | None = None
) -> list[dict[str, str]]:
    """Issue 14's targets for the GPU run, then issue 13's budget targets where the
    ``budget`` mode ran (they need the bytes one forward saves and its ``device_budget``),
    each judged PASS, FAIL or n/a from the rows."""
    by = {r.mode: r for r in rows}
    ref = by["none"]
    out = []

    def add(target: str, ok: bool | None, value: str) -> None:
        out.append({"target": target, "verdict": _verdict(ok), "value": value})

    others = rows[1:]
    exact = (
        None
        if any(r.exact.startswith("n/a") for r in others)
        else all(r.exact == "yes" for r in others)
    )
    add("gradients bit-identical to none", exact, ", ".join(f"{r.mode} {r.exact}" for r in others))
    cpu = by.get("cpu")
    if cpu is not None:
        ratio = cpu.median_step_s / ref.median_step_s
        add("cpu: step time at most 1.03x none", ratio <= 1.03, f"{ratio:.3f}x")
        cut = 1 - cpu.fwd_peak / ref.fwd_peak if ref.fwd_peak else None
        add(
            "cpu: forward peak allocated memory cut by 80% or more",
            None if cut is None else cut >= 0.80,
            "not measured (CPU twin)" if cut is None else f"{cut:.0%}",
        )
        soc = by.get("save_on_cpu")
        if soc is not None:
            faster = cpu.median_step_s < soc.median_step_s
            smaller = cpu.fwd_peak <= soc.fwd_peak
            add(
                "cpu: ahead of save_on_cpu in step time and forward peak",
                faster and smaller,
                f"{cpu.median_step_s * 1e3:.1f} vs {soc.median_step_s * 1e3:.1f} ms, "
                f"{cpu.fwd_peak / 1e9:.2f} vs {soc.fwd_peak / 1e9:.2f} GB",
            )
    for r in rows:
        if r.pin_calls_timed is not None:
            add(
                f"{r.mode}: no pinning after warm-up, nothing pageable",
                r.pin_calls_timed == 0 and r.pageable_fallbacks == 0,
                f"{r.pin_calls_timed} arenas pinned in the timed steps, "
                f"{r.pageable_fallbacks} pageable fallbacks",
            )
    starts = [b for r in rows for b in r.reserved_start_bytes]
    if starts:
        grew = max(starts) - min(starts)
        add(
            "reserved memory does not grow step over step after warm-up",
            grew == 0,
            f"{grew / 1e6:.0f} MB between the timed steps' starts",
        )
    budget = by.get("budget")
    if budget is not None and saved_bytes is not None and device_budget is not None:
        out += _budget_targets(by, saved_bytes, device_budget)
    return out


def _budget_targets(by: dict[str, GpuRow], saved: int, held: int) -> list[dict[str, str]]:
    """Issue 13's targets for ``budget`` (device_budget ``held`` of ``saved`` bytes), as
    bench/step.py judges them on the CPU, with the GPU's allocated memory for RSS and
    ``copybudget`` (a bare side stream moving saved - budget) for ``iobudget``."""
    ref, budget = by["none"], by["budget"]
    out: list[dict[str, str]] = []

    def add(target: str, ok: bool | None, value: str) -> None:
        out.append({"target": target, "verdict": _verdict(ok), "value": value})

    peak = (
        f"budget: step peak at most budget + (none's step peak - saved) + "
        f"{BUDGET_SLACK:.0%} of saved"
    )
    if ref.step_peak or budget.step_peak:
        most = held + (ref.step_peak - saved) + BUDGET_SLACK * saved
        add(
            peak,
            budget.step_peak <= most,
            f"{_size(budget.step_peak)} vs {_size(held)} + ({_size(ref.step_peak)} - "
            f"{_size(saved)}) + {_size(BUDGET_SLACK * saved)} = {_size(most)}",
        )
    else:  # the twin reads no device memory
        add(peak, None, "not measured (CPU twin)")
    move = saved - held
    moved = budget.bytes_offloaded_per_step
    ok: bool | None
    if moved is None:
        ok, ratio = None, "not measured"
    elif move > 0:
        ok = abs(moved - move) <= MOVE_TOLERANCE * move  # a ratio would round at the edge
        ratio = f"{moved / move:.3f}x"
    else:  # the budget holds everything: nothing should move
        ok, ratio = moved == 0, "nothing to move"
    add(
        f"budget: bytes moved per step within {MOVE_TOLERANCE:.0%} of saved - budget",
        ok,
        f"{_size(moved or 0)}/step vs {_size(saved)} - {_size(held)} = {_size(move)}: {ratio}",
    )
    for other, target, limit, strict in (
        ("cpu", "budget: step time below cpu's (offload everything)", 1.0, True),
        (
            "copybudget",
            f"budget: step time at most {IOBUDGET_LIMIT:.2f}x copybudget's (a bare stream "
            "moving saved - budget)",
            IOBUDGET_LIMIT,
            False,
        ),
    ):
        row = by.get(other)
        if row is None:
            add(target, None, f"{other} did not run")
            continue
        vs = budget.median_step_s / row.median_step_s
        add(
            target,
            vs < limit if strict else vs <= limit,
            f"{budget.median_step_s * 1e3:.1f} vs {row.median_step_s * 1e3:.1f} ms: {vs:.3f}x",
        )
    return out


def table(
    rows: list[GpuRow],
    env: dict[str, float],
    args: argparse.Namespace,
    sizes: dict[str, int] | None = None,
) -> str:
    ref = rows[0]
    name = "CPU (twin)" if args.twin else torch.cuda.get_device_name()
    lines = [
        f"model: {args.dtype} width {args.width} depth {args.depth} heads {args.heads} "
        f"attention {args.attention}, batch {args.batch} x {args.seq} tokens; "
        f"{args.steps} timed rounds after {args.warmup} warmup; "
        f"{name} torch {torch.__version__}",
        (
            "link: D2H {d2h_gbps:.1f} GB/s, H2D {h2d_gbps:.1f} GB/s".format(**env)
            if "d2h_gbps" in env
            else "link: not measured (CPU twin)"
        )
        + (
            "; disk: write {disk_write_gbps:.2f} GB/s, read {disk_read_gbps:.2f} GB/s".format(**env)
            if "disk_write_gbps" in env
            else ""
        ),
        f"{'mode':<12} {'step ms':>8} {'ratio':>6} {'fwd peak GB':>11} {'cut':>5} "
        f"{'step peak GB':>12} {'GB/step':>8} {'hit':>5} {'stall ms':>8} {'exact':>6}",
    ]
    for r in rows:
        cut = 1 - r.fwd_peak / ref.fwd_peak if ref.fwd_peak else 0.0
        gb = (
            f"{r.bytes_offloaded_per_step / 1e9:8.2f}" if r.bytes_offloaded_per_step else f"{'':>8}"
        )
        hit = f"{r.hit_rate:5.2f}" if r.hit_rate is not None else f"{'':>5}"
        stall = (
            f"{r.stall_seconds_per_step * 1e3:8.1f}"
            if r.stall_seconds_per_step is not None
            else f"{'':>8}"
        )
        lines.append(
            f"{r.mode:<12} {r.median_step_s * 1e3:8.1f} {r.median_step_s / ref.median_step_s:6.2f} "
            f"{r.fwd_peak / 1e9:11.2f} {cut:5.0%} {r.step_peak / 1e9:12.2f} {gb} {hit} {stall} "
            f"{r.exact:>6}"
        )
    growth = ", ".join(
        f"{r.mode} {statistics.median(r.reserved_growth_bytes) / 1e6:.0f}"
        for r in rows
        if r.reserved_growth_bytes
    )
    if growth:
        lines.append(f"reserved memory growth per step, median MB (caching allocator): {growth}")
    by = {r.mode: r for r in rows}
    if sizes is not None and ("budget" in by or "copybudget" in by):
        saved, held = sizes["saved_activation_bytes"], sizes["device_budget"]
        line = (
            f"budget: one forward saves {_size(saved)}; device_budget {_size(held)} "
            f"({args.budget_fraction:g} x saved); saved - budget {_size(saved - held)}"
        )
        b = by.get("budget")
        if b is not None and b.bytes_offloaded_per_step is not None:
            line += (
                f"; budget moved {_size(b.bytes_offloaded_per_step)}/step (demoted to host "
                f"{_size(b.bytes_demoted_to_host_per_step or 0)}/step), device tier peak "
                f"{_size(b.peak_device_tier_bytes or 0)}"
            )
        c = by.get("copybudget")
        if c is not None and c.bytes_offloaded_per_step is not None:
            line += f"; copybudget moved {_size(c.bytes_offloaded_per_step)}/step each way"
        lines.append(line)
    cpu = next((r for r in rows if r.bytes_offloaded_per_step), None)
    if cpu is not None and "d2h_gbps" in env:
        vol = cpu.bytes_offloaded_per_step
        lines.append(
            f"bound for {vol / 1e9:.2f} GB/step: link {vol / env['d2h_gbps'] / 1e9 * 1e3:.0f} ms "
            f"D2H + {vol / env['h2d_gbps'] / 1e9 * 1e3:.0f} ms H2D (each overlappable with "
            f"compute; none's whole step is {ref.median_step_s * 1e3:.0f} ms)"
            + (
                f"; disk {vol / env['disk_write_gbps'] / 1e9 * 1e3:.0f} ms write + "
                f"{vol / env['disk_read_gbps'] / 1e9 * 1e3:.0f} ms read"
                if "disk_write_gbps" in env
                else ""
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--attention", choices=("explicit", "sdpa"), default="sdpa")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--budget-fraction",
        type=_budget_fraction,
        default=BUDGET_FRACTION,
        metavar="F",
        help="the budget mode's device_budget as a share of the bytes one forward saves, "
        f"in (0, 1] (default {BUDGET_FRACTION}); copybudget moves the rest",
    )
    p.add_argument("--depth-prefetch", type=int, default=4, help="prefetch_depth of the engine")
    p.add_argument("--max-pending-mb", type=int, default=64, help="max_pending_write_bytes in MiB")
    p.add_argument("--min-offload-bytes", type=int, default=1 << 16, help="min_offload_bytes")
    p.add_argument("--chunk-bytes", type=int, default=16 << 20, help="chunk_bytes of the engine")
    p.add_argument("--save-dir", default=None, help="parent folder for the disk mode's slabs")
    p.add_argument("--disk-probe-mb", type=int, default=2048, help="bytes the disk probe moves")
    p.add_argument("--json", default=None, help="write the rows and environment here")
    p.add_argument("--twin", action="store_true", help="run on the CPU through the CPU twin")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="after the timed rounds, one more step per mode with memory sampled every "
        "2 ms (allocated GPU memory; RSS on the twin), drawn into this PNG and "
        "kept in the JSON as 'timelines'; needs matplotlib (the bench extra)",
    )
    p.add_argument(
        "--replot",
        default=None,
        metavar="JSON",
        help="only draw --plot from the timelines of this earlier --json (for a machine "
        "without matplotlib)",
    )
    words = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(words)
    if args.replot and not args.plot:
        p.error("--replot needs --plot PATH")
    if args.replot:
        return 0 if plot_timelines(json.loads(Path(args.replot).read_text()), args.plot) else 1
    if not args.twin and not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA device", file=sys.stderr)
        return 2
    rows, env, timelines, sizes = run(args)
    print(table(rows, env, args, sizes), flush=True)
    verdicts = targets(
        rows, saved_bytes=sizes["saved_activation_bytes"], device_budget=sizes["device_budget"]
    )
    for t in verdicts:
        print(f"target {t['verdict']:>4}: {t['target']} ({t['value']})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "bench": "gpu.py",
                    "command": shlex.join(["python", "bench/gpu.py", *words]),
                    "args": vars(args),
                    "env": env,
                    "device": "CPU (twin)" if args.twin else torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    **sizes,
                    "rows": [
                        dataclasses.asdict(r) | {"median_step_s": r.median_step_s} for r in rows
                    ],
                    "targets": verdicts,
                    "timelines": timelines,
                },
                f,
                indent=1,
            )
    if timelines:
        plot_timelines({"args": vars(args), "timelines": timelines}, args.plot)
    return 1 if any(r.exact == "NO" for r in rows) else 0


def _budget_fraction(text: str) -> float:
    """``--budget-fraction``: a share in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            "the budget fraction is the share of the saved bytes the budget keeps on the "
            f"device, in (0, 1]; got {text!r}"
        )
    return value


def plot_timelines(doc: dict[str, Any], path: str) -> bool:
    """Draw the traced steps of a run (its JSON, or the same keys) into ``path``."""
    a, timelines = doc["args"], doc.get("timelines")
    if not timelines:
        log("--replot: this JSON has no memory timelines: its run had no --plot")
        return False
    counter = next(iter(timelines.values()))["counter"]
    return memory_over_step(
        timelines,
        Path(path),
        saved_bytes=None,
        title=f"bench/gpu.py, {a['dtype']}, width {a['width']} depth {a['depth']}, "
        f"batch {a['batch']} x {a['seq']}: one training step per mode",
        modes=list(timelines),
        ylabel=f"{counter} above the step's start, MiB",
    )


if __name__ == "__main__":
    raise SystemExit(main())
