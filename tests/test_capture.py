"""CUDA graph capture on the CPU twin (NOTE [capture mode] in prefetch_offload/streams.py).

A capture cannot run without a GPU, so ``_GlobalCapture`` plays one: while the
test's thread "captures", every CUDA call the engine's code makes (a fence's
event query or synchronize, a pinned allocation) is judged as
bench/gpu_preflight.py's ``CAPTURE_CASES`` say CUDA judges it, the table the
preflight measures on the GPU machine. tests/test_cuda.py runs the same
scenario under a real capture.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from prefetch_offload import OffloadConfig, OffloadEngine, OffloadError
from prefetch_offload import streams as streams_module
from prefetch_offload.buffers import Block, mapped_block
from prefetch_offload.device import RoutingDevice, SpanCopyDevice
from prefetch_offload.io_pool import WRITE
from prefetch_offload.streams import _ThreadFence

BENCH = Path(__file__).resolve().parent.parent / "bench"
_GLOBAL, _THREAD_LOCAL = 0, 1  # cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal


def _capture_cases() -> dict[str, bool]:
    """bench/gpu_preflight.py's CAPTURE_CASES: whether a capture survives each call."""
    spec = importlib.util.spec_from_file_location("_capture_preflight", BENCH / "gpu_preflight.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return dict(module.CAPTURE_CASES)


class _Devices:
    """Two GPUs as the CUDA runtime sees them: each thread's current device (0 in a new
    thread), the primary contexts, and a runtime call that makes its device's context."""

    def __init__(self, contexts: set[int]) -> None:
        self.contexts = set(contexts)
        self.made: list[int] = []  # contexts a runtime call created
        self._local = threading.local()

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)

    def device_count(self) -> int:
        return 2

    def has_context(self, index: int) -> bool:
        return index in self.contexts

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        before, self._local.index = self.current_device(), index
        try:
            yield
        finally:
            if before in self.contexts:  # as torch restores it: never making a context
                self._local.index = before

    def runtime_call(self) -> None:
        if self.current_device() not in self.contexts:
            self.contexts.add(self.current_device())
            self.made.append(self.current_device())

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make streams.py's _context_device see these devices."""
        monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", self.has_context, raising=False)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        monkeypatch.setattr(torch.cuda, "device_count", self.device_count)
        monkeypatch.setattr(torch.cuda, "device", self.device)


class _GlobalCapture:
    """A capture in the global mode, and libcudart's thread capture modes."""

    def __init__(self, devices: _Devices | None = None) -> None:
        self.cases = _capture_cases()
        self.capturer: int | None = None
        self.modes: dict[int, int] = {}
        self.broken: list[str] = []  # the preflight case of each call that broke it
        self.devices = devices

    # The CUDA runtime, as streams.py calls it.
    def cudaThreadExchangeStreamCaptureMode(self, mode: Any) -> int:
        if self.devices is not None:
            self.devices.runtime_call()
        me = threading.get_ident()
        before = self.modes.get(me, _GLOBAL)
        self.modes[me], mode._obj.value = mode._obj.value, before
        return 0

    def is_current_stream_capturing(self) -> bool:
        return threading.get_ident() == self.capturer

    def call(self, what: str) -> None:
        """A CUDA call (``query``, ``synchronize``, ``pin``) made by the calling thread."""
        if self.capturer is None:
            return
        thread = threading.current_thread()
        if thread.name.startswith("prefetch_offload-twin"):
            return  # the twin's copy threads play the GPU itself, not a host thread
        if thread.ident == self.capturer:
            case = "query_same_thread_global"
        elif self.modes.get(thread.ident or 0, _GLOBAL) == _THREAD_LOCAL:
            case = f"{what}_isolated_thread_global"
        else:
            case = f"{what}_other_thread_global"
        if not self.cases[case]:
            self.broken.append(f"{case} ({thread.name})")

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        self.capturer = threading.get_ident()
        try:
            yield
        finally:
            self.capturer = None

    def pin(self, nbytes: int) -> Block:
        self.call("pin")
        return mapped_block(nbytes)


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch) -> _GlobalCapture:
    cap = _GlobalCapture()
    monkeypatch.setattr(streams_module, "_cudart", lambda: cap, raising=False)
    monkeypatch.setattr(streams_module, "_cuda_ready", lambda: True, raising=False)
    monkeypatch.setattr(streams_module, "_context_device", lambda: contextlib.nullcontext(True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", cap.is_current_stream_capturing)
    done, wait = _ThreadFence.done, _ThreadFence.wait

    def query(self: _ThreadFence) -> bool:
        cap.call("query")
        return done(self)

    def synchronize(self: _ThreadFence) -> None:
        cap.call("synchronize")
        wait(self)

    monkeypatch.setattr(_ThreadFence, "done", query)
    monkeypatch.setattr(_ThreadFence, "wait", synchronize)
    return cap


def test_preflight_cases_cover_every_call_the_model_judges() -> None:
    cases = _capture_cases()
    for what in ("query", "synchronize", "pin"):
        assert cases[f"{what}_isolated_thread_global"] is True
        assert f"{what}_other_thread_global" in cases
    assert cases["query_same_thread_global"] is False


def test_capture_after_an_eager_forward_left_writes_queued(
    save_dir: Path, capture: _GlobalCapture
) -> None:
    """Target "disk": an eager forward leaves writes queued, then a graph is captured
    while the IO threads write them (they wait on copy events) and read; a tensor saved
    under capture (a CPU one too) stays where it is, and flush() returns at once. No call
    may break the capture, and backward after it is exact."""
    layer = SpanCopyDevice("cpu", twin_delay=0.002, pin=capture.pin)
    config = OffloadConfig(
        target="disk", save_dir=str(save_dir), min_offload_bytes=0, chunk_bytes=16384
    )
    engine = OffloadEngine(config, device=RoutingDevice([layer]))
    x = torch.randn(1 << 14, requires_grad=True)

    def step() -> torch.Tensor:
        return sum(((x * (i + 2)).sin() * (i + 1)).sum() for i in range(4))

    step().backward()
    expected, x.grad = x.grad, None
    gate = threading.Event()
    try:
        for _ in range(config.io_workers):  # every IO thread busy until the capture runs
            engine._pool.submit(gate.wait, WRITE)
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            eager = step()  # copied off the "device", writes queued behind the gate
            kept_before = engine.stats().tensors_kept
            with capture.capturing():
                captured = (x * 7).sin().sum()  # saved under capture: stays where it is
                gate.set()
                engine._wait_writes()  # the IO threads write during the capture
                engine.flush()  # under capture: returns at once
            assert capture.broken == []
            assert engine.stats().tensors_kept > kept_before
            engine.flush()
            assert engine.stats().tensors_offloaded > 0
            eager.backward()
            assert torch.equal(x.grad, expected)
            captured.backward()
    finally:
        gate.set()
        engine.close()
    assert capture.modes  # the IO threads did switch to thread-local mode


def test_unpacking_an_offloaded_tensor_under_capture_is_a_clear_error(
    save_dir: Path, capture: _GlobalCapture
) -> None:
    """A forward run eagerly, its backward captured: restoring would query events and
    copy inside the capture; the unpack says so before any CUDA call."""
    layer = SpanCopyDevice("cpu", pin=capture.pin)
    config = OffloadConfig(target="cpu", min_offload_bytes=0)
    engine = OffloadEngine(config, device=RoutingDevice([layer]))
    x = torch.randn(1 << 12, requires_grad=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            loss = (x * 3).sin().sum()
        engine.flush()
        assert engine.stats().tensors_offloaded > 0
        with capture.capturing(), pytest.raises(OffloadError, match="unpacked inside one"):
            loss.backward()
        assert capture.broken == []
    finally:
        engine.close()


def test_a_tensor_a_budget_kept_on_its_device_unpacks_under_capture(
    save_dir: Path, capture: _GlobalCapture
) -> None:
    """Saved before the capture, kept on its device by device_budget: no copy to wait
    for, so the captured backward gets it as it is, with no CUDA call."""
    layer = SpanCopyDevice("cpu", pin=capture.pin)
    config = OffloadConfig(target="cpu", min_offload_bytes=0, device_budget=1 << 30)
    engine = OffloadEngine(config, device=RoutingDevice([layer]))
    x = torch.randn(1 << 12, requires_grad=True)
    (x * 3).sin().sum().backward()
    expected, x.grad = x.grad, None
    try:
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            loss = (x * 3).sin().sum()
        assert engine.stats().tensors_offloaded == 0 and engine.stats().device_tier_bytes > 0
        with capture.capturing():
            loss.backward()
        assert capture.broken == []
        assert torch.equal(x.grad, expected)
    finally:
        engine.close()


def test_an_in_place_change_is_still_caught_under_capture(
    save_dir: Path, capture: _GlobalCapture
) -> None:
    """The span handed out as it is under capture is still checked for in-place changes
    since its save (NOTE [version check])."""
    layer = SpanCopyDevice("cpu", pin=capture.pin)
    config = OffloadConfig(target="cpu", min_offload_bytes=0, device_budget=1 << 30)
    engine = OffloadEngine(config, device=RoutingDevice([layer]))
    x = torch.randn(1 << 12, requires_grad=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            h = x * 3
            loss = h.sin().sum()  # saves h
        with torch.no_grad():
            h.add_(1)
        with capture.capturing(), pytest.raises(RuntimeError, match="inplace operation"):
            loss.backward()
        assert capture.broken == []
    finally:
        engine.close()


def test_io_threads_wait_for_cuda_before_isolating(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [capture mode]: a thread asked before CUDA is initialized is asked again
    (and changes nothing meanwhile); once it is, the thread switches to thread-local
    mode for good, once."""
    cap = _GlobalCapture()
    ready = [False]
    monkeypatch.setattr(streams_module, "_cudart", lambda: cap, raising=False)
    monkeypatch.setattr(streams_module, "_cuda_ready", lambda: ready[0])
    monkeypatch.setattr(streams_module, "_context_device", lambda: contextlib.nullcontext(True))
    outcomes: list[bool] = []

    def thread() -> None:
        outcomes.append(streams_module.isolate_from_captures())
        ready[0] = True
        outcomes.append(streams_module.isolate_from_captures())
        outcomes.append(streams_module.isolate_from_captures())

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert outcomes == [False, True, True]
    assert list(cap.modes.values()) == [_THREAD_LOCAL]


def test_isolating_makes_no_context_on_gpu_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [capture mode]: a rank on GPU 1 whose IO thread (current device 0, as in
    every new thread) switches its capture mode makes no context on GPU 0; while no
    GPU has a context nothing can capture, and the thread is asked again."""
    devices = _Devices(contexts=set())
    devices.patch(monkeypatch)
    cap = _GlobalCapture(devices)
    monkeypatch.setattr(streams_module, "_cudart", lambda: cap, raising=False)
    monkeypatch.setattr(streams_module, "_cuda_ready", lambda: True)
    outcomes: list[object] = []

    def io_thread() -> None:
        outcomes.append(streams_module.isolate_from_captures())  # no context anywhere
        devices.contexts.add(1)  # the rank's training reaches GPU 1
        outcomes.append(streams_module.isolate_from_captures())
        outcomes.append(devices.current_device())  # it stays there for later calls

    t = threading.Thread(target=io_thread)
    t.start()
    t.join()
    assert outcomes == [False, True, 1]
    assert devices.made == [] and devices.contexts == {1}
    assert cap.modes == {t.ident: _THREAD_LOCAL}

    def borrowed_thread() -> None:  # aflush's executor thread: isolated while it waits
        with streams_module.capture_isolated():
            outcomes.append(cap.modes[threading.get_ident()])

    cap.modes.clear()  # a new thread may reuse the ident of the one that ended
    t = threading.Thread(target=borrowed_thread)
    t.start()
    t.join()
    assert outcomes[-1] == _THREAD_LOCAL and cap.modes[t.ident] == _GLOBAL
    assert devices.made == []
    devices.contexts.add(0)  # a thread whose own device has one stays on it
    t = threading.Thread(target=lambda: outcomes.append(streams_module.isolate_from_captures()))
    t.start()
    t.join()
    assert outcomes[-1] is True and devices.made == []


def test_flush_from_a_borrowed_thread_restores_its_capture_mode(
    capture: _GlobalCapture,
) -> None:
    """aflush waits in an event loop's executor thread: thread-local mode there only
    while it waits, the thread's own mode after."""
    engine = OffloadEngine(
        OffloadConfig(target="cpu", min_offload_bytes=0),
        device=RoutingDevice([SpanCopyDevice("cpu")]),
    )
    try:
        engine.pack(torch.randn(4096))
        t = threading.Thread(target=engine.flush)
        t.start()
        t.join()
        assert capture.modes == {t.ident: _GLOBAL}
    finally:
        engine.close()
