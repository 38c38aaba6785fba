"""The memory probe of bench/step.py and bench/sweep.py: one mode's memory in a fresh process.

Memory is measured in separate processes, one per mode, where nothing else
shares the heap: ``bench/step.py --memory-probe MODE`` with the shape and knob
flags, which calls :func:`run_probe` and prints its JSON. A probe builds the
same model and batches as the timed run, sets up the mode, reads its RSS, and
runs ``PROBE_STEPS`` whole training steps (forward, backward, optimizer step)
from there; no warm-up comes first, because memory that the allocator keeps
after a first step is memory the user's process holds. A step's peak is the
largest RSS over it minus the RSS before the first step: what training added
to the process at its worst moment. The peak is the kernel's own high-water
mark (``VmHWM``, reset through ``/proc/self/clear_refs`` at each phase
boundary, all against the same starting RSS), so no peak is too short to
catch; a 1 ms RSS sampler runs beside it (the measure where the reset is not
allowed), and its samples over the last step are the probe's ``timeline``.

``allocator="default"`` runs the probe with glibc's defaults, which is what
users run: freed tensors stay resident in malloc's free lists until reused or
trimmed, so the peak counts memory that glibc keeps as well as memory that is
live. ``allocator="tuned"`` sets ``MALLOC_MMAP_THRESHOLD_=65536`` (every
allocation of 64 KiB or more gets its own mapping and leaves RSS when freed:
RSS then tracks live memory). glibc reads the variable at startup, hence the
subprocess.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _common import (
    RssSampler,
    heap_in_use_bytes,
    page_cache_bytes,
    peak_rss_bytes,
    read_rss_bytes,
    reset_peak_rss,
    scratch_folder,
)
from _harness import (
    ENGINE_MODES,
    LEARNING_RATE,
    Knobs,
    ModeSetup,
    Shape,
    build,
    counter_delta,
    counters,
    make_mode,
)
from _text import progress

__all__ = [
    "ALLOCATORS",
    "MMAP_THRESHOLD",
    "PROBE_STEPS",
    "ProbeError",
    "probe_many",
    "probe_memory",
    "run_probe",
]

# Probe allocators: glibc's defaults (the primary figure) and the tuned one.
ALLOCATORS: tuple[str, ...] = ("default", "tuned")
# The tuned allocator's setting: every malloc of >= 64 KiB gets its own mapping.
MMAP_THRESHOLD = 65536
# Whole training steps per memory probe, all measured (RSS before the first is the base).
PROBE_STEPS = 3
# The RSS sampler's interval: its samples over the last step are the probe's timeline.
SAMPLE_INTERVAL_S = 0.001
# The probe process is this script, with --memory-probe MODE.
_STEP_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step.py")


class ProbeError(RuntimeError):
    """A memory probe process failed; the message holds the end of its stderr."""


def probe_memory(
    mode: str,
    shape: Shape,
    knobs: Knobs,
    save_dir: Path,
    *,
    timeout_s: float = 900.0,
    allocator: str = "tuned",
) -> dict[str, Any]:
    """Run ``mode``'s memory probe in a fresh process; its JSON.

    ``allocator`` is ``"default"`` (``MALLOC_MMAP_THRESHOLD_`` is removed from the
    probe's environment; the figure bench/step.py reports first) or ``"tuned"``
    (this function's default, which bench/sweep.py relies on). ``save_dir`` must
    exist; the probe makes and removes its own folder in it.
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    cmd = [sys.executable, _STEP_SCRIPT, "--memory-probe", mode, *shape.argv(), *knobs.argv()]
    cmd += ["--save-dir", str(save_dir)]
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if allocator == "tuned":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ProbeError(
            f"memory probe for mode {mode!r} ({allocator} allocator) exited with status "
            f"{proc.returncode}:\n$ {' '.join(cmd)}\n{proc.stderr.strip()[-8000:]}"
        )
    result: dict[str, Any] = json.loads(lines[-1])
    result["allocator"] = allocator
    return result


def probe_many(
    requests: Sequence[tuple[str, Knobs]],
    shape: Shape,
    save_dir: Path,
    *,
    jobs: int = 1,
    allocator: str = "tuned",
) -> list[dict[str, Any]]:
    """:func:`probe_memory` for each ``(mode, knobs)``, ``jobs`` processes at a time.

    Each probe measures its own process's RSS, so running several at once does
    not mix their numbers, but they compete for cores, which can let disk's
    write queue (and so its memory) grow: keep ``jobs`` at 1 for numbers to report.
    """

    def one(request: tuple[str, Knobs]) -> dict[str, Any]:
        mode, knobs = request
        extra = ""
        if mode in ENGINE_MODES:
            extra = f", max_pending_write_bytes {knobs.max_pending_write_bytes}"
            extra += f", device_budget {knobs.device_budget}"
        progress(f"memory probe ({allocator} allocator): {mode}{extra}")
        return probe_memory(mode, shape, knobs, save_dir, allocator=allocator)

    if jobs <= 1:
        return [one(r) for r in requests]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, requests))


# -- inside the probe process ------------------------------------------------------------


class _Steps:
    """What the probe records per step, all RSS figures above one base: the RSS before
    the first step.

    Each phase (forward; backward with the optimizer step) resets the kernel's
    high-water mark at its start (where allowed) and takes, at its end, the larger
    of it and the sampler's peak in the phase.
    """

    def __init__(self, sampler: RssSampler, params: list[torch.nn.Parameter]) -> None:
        self.sampler, self.params = sampler, params
        self.base, self.heap0 = read_rss_bytes(), heap_in_use_bytes()
        self.exact = reset_peak_rss()
        self.forward: list[int] = []
        self.backward: list[int] = []
        self.sampled: list[int] = []
        self.heap: list[int] = []
        self.cache: list[int] = []
        self.marks: list[tuple[float, float, float]] = []  # start, backward start, end

    def _reset(self) -> float:
        self.exact = reset_peak_rss() and self.exact
        return time.perf_counter()

    def _since(self, start: float) -> tuple[int, int]:
        """(peak, sampled peak) since ``start`` (a :meth:`_reset`), above the base."""
        now = read_rss_bytes()
        sampled = max(self.sampler.peak_between(start, time.perf_counter()) or 0, now)
        hwm = peak_rss_bytes() if self.exact else None
        return max(sampled, hwm or 0) - self.base, sampled - self.base

    def step(self, model: torch.nn.Module, batch: Any, setup: ModeSetup, handle: Any) -> None:
        """One whole training step (forward and backward inside the mode's step hooks,
        then SGD), recorded."""
        gc.collect()
        c0 = page_cache_bytes()
        t0 = self._reset()
        with setup.step_hooks(handle):
            loss = model(*batch)
            heap1 = heap_in_use_bytes()
            f_peak, f_sampled = self._since(t0)
            tb = self._reset()
            loss.backward()
        _sgd_step(self.params)
        del loss
        b_peak, b_sampled = self._since(tb)
        t1 = time.perf_counter()
        c1 = page_cache_bytes()
        self.forward.append(f_peak)
        self.backward.append(b_peak)
        self.sampled.append(max(f_sampled, b_sampled))
        self.marks.append((t0, tb, t1))
        if self.heap0 is not None and heap1 is not None:
            self.heap.append(heap1 - self.heap0)
        if c0 is not None and c1 is not None:
            self.cache.append(c1 - c0)

    def timeline(self) -> dict[str, Any]:
        """RSS over the last step: seconds from its start, bytes above the base."""
        t0, tb, t1 = self.marks[-1]
        trace = [(t - t0, rss - self.base) for t, rss in self.sampler.trace if t0 <= t <= t1]
        return {
            "t_s": [round(t, 6) for t, _ in trace],
            "rss_bytes": [rss for _, rss in trace],
            "backward_s": tb - t0,
            "end_s": t1 - t0,
            "interval_s": SAMPLE_INTERVAL_S,
        }


def _sgd_step(params: Sequence[torch.nn.Parameter]) -> None:
    """Plain SGD, then drop the gradients: what ``torch.optim.SGD`` + ``zero_grad`` do.

    The probe avoids ``torch.optim`` only because constructing an optimizer
    imports ``torch._dynamo``, which costs the short-lived probe process ~1.5 s.
    """
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-LEARNING_RATE)
                p.grad = None


def run_probe(mode: str, shape: Shape, knobs: Knobs, save_dir: str | None) -> dict[str, Any]:
    """The probe process's work: the memory of ``mode``'s whole steps, as a JSON document."""
    with scratch_folder(save_dir, prefix=f"bench-probe-{mode}-") as folder:
        model, batches = build(shape, PROBE_STEPS)
        params = list(model.parameters())
        setup = make_mode(mode, Path(folder).absolute(), knobs)
        with setup.run as handle:
            start = counters(handle)
            gc.collect()
            with RssSampler(SAMPLE_INTERVAL_S, record=True) as sampler:
                steps = _Steps(sampler, params)
                for batch in batches:
                    steps.step(model, batch, setup, handle)
            stats = counter_delta(start, counters(handle))
    peak = [max(f, b) for f, b in zip(steps.forward, steps.backward, strict=True)]
    return {
        "mode": mode,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "shape": dataclasses.asdict(shape),
        "knobs": dataclasses.asdict(knobs),
        "probed_steps": PROBE_STEPS,
        "rss_base_bytes": steps.base,
        # Per step, above rss_base_bytes: peak RSS over the whole step (the kernel's
        # VmHWM where clear_refs resets it: "peak_exact"), its forward and backward parts,
        # and the 1 ms sampler's peak alone.
        "step_peak_bytes": peak,
        "forward_peak_bytes": steps.forward,
        "backward_peak_bytes": steps.backward,
        "sampled_peak_bytes": steps.sampled,
        "peak_exact": steps.exact,
        # The step peaks again, under the name bench/sweep.py reads.
        "act_mem_bytes": peak,
        "heap_bytes": steps.heap,
        "cache_bytes": steps.cache,
        "timeline": steps.timeline(),
        "counters": stats,
    }
