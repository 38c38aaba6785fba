"""The CUDA path, on a real GPU. Marked gpu_only: skipped on CPU-only machines.

The same code runs on the CPU in tests/test_device.py and tests/test_streams.py
through the CPU twin (``SpanCopyDevice("cpu")``, worker-thread streams).
"""

from __future__ import annotations

import copy
import gc
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import ZeroesItsSaved, poison_freed_memory
from torch.utils.checkpoint import checkpoint

from prefetch_offload import OffloadConfig, OffloadEngine, OffloadStats, offload_context
from prefetch_offload.device import RoutingDevice, SpanCopyDevice
from prefetch_offload.slab import direct_io_supported
from prefetch_offload.testing import TinyTransformer, make_batch

pytestmark = [
    pytest.mark.gpu_only,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def save_dir(tmp_path: Path) -> Iterator[Path]:
    """A scratch folder that takes O_DIRECT where any nearby one does: pytest's tmp
    folder may be tmpfs, where the disk target would fall back to buffered IO and the
    pinned-memory O_DIRECT path (CUDA-only) would go untested."""
    d = tmp_path / "offload"
    d.mkdir()
    if direct_io_supported(str(d)):
        yield d
        return
    scratch = Path(__file__).resolve().parent.parent / ".scratch"
    scratch.mkdir(exist_ok=True)
    local = Path(tempfile.mkdtemp(prefix="cuda-test-", dir=scratch))
    try:
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _setup(
    dtype: torch.dtype = torch.float32, attention: str = "explicit"
) -> tuple[TinyTransformer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyTransformer(vocab=128, width=64, depth=2, heads=2, attention=attention)
    model = model.to(device="cuda", dtype=dtype)
    tokens, targets = make_batch(4, 64, vocab=128)
    return model, tokens.cuda(), targets.cuda()


def _kw(target: str, save_dir: Path) -> dict[str, Any]:
    return {"save_dir": str(save_dir)} if target == "disk" else {}


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _left_the_device(stats: OffloadStats) -> int:
    """Records whose device memory was released: written to the target, or, for target
    disk, copied to pinned host memory whose write backward dropped because it came
    first (NOTE [write tail]; on a fast GPU a small model's forward ends before any
    write starts)."""
    return stats.tensors_offloaded + stats.writes_skipped


@pytest.mark.parametrize("target", ["cpu", "disk"])
@pytest.mark.parametrize("depth", [0, 1, 4])
@pytest.mark.parametrize("flush", [False, True])
def test_cuda_grads_bit_identical(save_dir: Path, target: str, depth: int, flush: bool) -> None:
    model, tokens, targets = _setup()
    ref = copy.deepcopy(model)
    ref(tokens, targets).backward()
    kw = _kw(target, save_dir)
    with offload_context(target, prefetch_depth=depth, min_offload_bytes=0, **kw) as engine:
        loss = model(tokens, targets)
        if flush:
            engine.flush()  # disk: every tensor written, backward reads everything back
        loss.backward()
    assert _same(_grads(model), _grads(ref))
    stats = engine.stats()
    assert _left_the_device(stats) > 0
    if flush and target == "disk":
        assert stats.tensors_offloaded > 0
        assert stats.bytes_read > 0


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_cuda_bf16_sdpa_grads_bit_identical(save_dir: Path, target: str) -> None:
    model, tokens, targets = _setup(torch.bfloat16, "sdpa")
    ref = copy.deepcopy(model)
    ref(tokens, targets).backward()
    control = copy.deepcopy(model)
    control(tokens, targets).backward()
    if not _same(_grads(control), _grads(ref)):
        pytest.skip("this GPU's fused attention backward is not reproducible")
    with offload_context(target, min_offload_bytes=0, **_kw(target, save_dir)):
        model(tokens, targets).backward()
    assert _same(_grads(model), _grads(ref))


def _sleepy_step(x: torch.Tensor) -> torch.Tensor:
    loss = torch.zeros((), device=x.device)
    for i in range(4):
        torch.cuda._sleep(20_000_000)  # queued GPU work: the next copies run late
        y = (x * (i + 2)).sin()  # saves x * (i + 2); freed, its block reused, next round

        def slow_grad(g: torch.Tensor) -> torch.Tensor:
            # In backward: the compute stream is busy while prefetches land, and a
            # same-size allocation would take a block handed back too early.
            torch.cuda._sleep(20_000_000)
            torch.full_like(g, float("nan"))
            return g

        y.register_hook(slow_grad)
        loss = loss + y.sum()
        scratch = torch.full_like(x, float("nan"))  # likely takes the freed block
        del y, scratch
    torch.cuda._sleep(20_000_000)
    return loss


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_cuda_freed_host_memory_poisoned(
    save_dir: Path, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pinned runs, read buffers and slab extents are overwritten the moment the engine
    gives them back (tests/test_freed_memory.py), while queued GPU work makes every copy
    run late: a copy still reading host memory the engine gave back corrupts a gradient."""
    seen = poison_freed_memory(monkeypatch)
    x = torch.randn(1 << 22, device="cuda", requires_grad=True)
    _sleepy_step(x).backward()
    expected = x.grad
    with offload_context(target, min_offload_bytes=0, **_kw(target, save_dir)) as engine:
        for step in range(3):
            x.grad = None
            loss = _sleepy_step(x)
            if step == 1:
                engine.flush()  # disk: this step reads everything back
            loss.backward()
            assert torch.equal(x.grad, expected), f"step {step}"
    assert engine.stats().tensors_offloaded > 0
    assert seen.arena_runs > 0


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_cuda_budget_copy_waits_for_the_stream_that_made_the_tensor(
    save_dir: Path, target: str
) -> None:
    """NOTE [copy streams]: a record a device_budget keeps on the GPU is copied at a later
    pack, here made on another stream than the one the copy is issued from. The copy
    must wait for the stream that made the tensor, not for the current one."""
    x = torch.randn(1 << 22, device="cuda", requires_grad=True)  # 16 MiB per saved tensor
    other = torch.cuda.Stream()

    def step() -> torch.Tensor:
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(other):
            torch.cuda._sleep(100_000_000)  # x * 2 is made late, on the other stream
            a = (x * 2).sin()  # saves x * 2: kept on the GPU, within the budget
        b = (x * 3).sin()  # saves x * 3 here: over budget, x * 2's record is copied now
        torch.cuda.current_stream().wait_stream(other)
        return a.sum() + b.sum()

    step().backward()
    expected, x.grad = x.grad, None
    kw = _kw(target, save_dir)
    with offload_context(target, device_budget=16 << 20, min_offload_bytes=0, **kw) as engine:
        step().backward()
    assert torch.equal(x.grad, expected)
    assert engine.stats().bytes_demoted_to_host + engine.stats().bytes_demoted_to_disk > 0


@pytest.mark.parametrize("target", ["cpu", "disk"])
@pytest.mark.parametrize("depth", [0, 4])
def test_cuda_race_with_queued_gpu_work(save_dir: Path, target: str, depth: int) -> None:
    """Long GPU work queued around each copy: a too-early free or reuse corrupts values."""
    x = torch.randn(1 << 22, device="cuda", requires_grad=True)
    _sleepy_step(x).backward()
    expected, x.grad = x.grad, None
    kw = _kw(target, save_dir)
    with offload_context(target, prefetch_depth=depth, min_offload_bytes=0, **kw):
        _sleepy_step(x).backward()
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("target", ["cpu", "disk"])
@pytest.mark.parametrize("depth", [0, 4])
def test_cuda_backward_waits_for_late_host_to_device_copies(
    save_dir: Path, target: str, depth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every H2D copy is queued behind long work on the H2D stream: if the compute
    stream did not wait on the copy's event (``use``), backward would read the
    restored tensor before its bytes land, and the gradient would differ."""
    from prefetch_offload.streams import CudaStreams

    real = CudaStreams._h2d

    def late(self: CudaStreams, src: torch.Tensor, after: Any, pad: int) -> Any:
        with torch.cuda.stream(self._h2d_stream):
            torch.cuda._sleep(20_000_000)  # the copy queued next runs late
        return real(self, src, after, pad)

    monkeypatch.setattr(CudaStreams, "_h2d", late)
    x = torch.randn(1 << 22, device="cuda", requires_grad=True)

    def step() -> torch.Tensor:
        return sum(((x * (i + 2)).sin() * (i + 1)).sum() for i in range(4))

    step().backward()
    expected, x.grad = x.grad, None
    with offload_context(
        target, prefetch_depth=depth, min_offload_bytes=0, **_kw(target, save_dir)
    ) as engine:
        loss = step()
        engine.flush()  # every record is on the host (or disk): backward copies all back
        loss.backward()
    assert engine.stats().tensors_offloaded > 0
    assert torch.equal(x.grad, expected)


def test_cuda_graph_capture_keeps_saved_tensors_in_memory(save_dir: Path) -> None:
    """Under CUDA graph capture the hooks keep tensors (side-stream copies and event
    queries cannot be captured), and the captured graph replays correctly."""
    x = torch.randn(1 << 16, device="cuda", requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as CUDA graphs require
        (x * 2).sin().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with offload_context("cpu", min_offload_bytes=0) as engine:
        with torch.cuda.graph(graph):
            loss = (x * 2).sin().sum()
    stats = engine.stats()
    assert stats.tensors_offloaded == 0 and stats.tensors_kept > 0
    graph.replay()
    loss.backward()
    torch.cuda.synchronize()
    assert torch.equal(x.grad, 2 * (x.detach() * 2).cos())


def test_cuda_graph_capture_while_writes_are_queued(save_dir: Path) -> None:
    """NOTE [capture mode]: target disk; an eager forward leaves writes queued behind
    busy IO threads, then a graph is captured (global mode, the default) while those
    threads write (each waits on its copy's event) and a CPU tensor is saved under it;
    flush() inside returns at once. capture_end succeeds and the graph replays."""
    from prefetch_offload.io_pool import WRITE

    x = torch.randn(1 << 20, device="cuda", requires_grad=True)
    w = torch.randn(1 << 16, device="cuda", requires_grad=True)
    c = torch.randn(1 << 12, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as CUDA graphs require
        (w * 2).sin().sum().backward()
    torch.cuda.current_stream().wait_stream(side)

    def eager_step() -> torch.Tensor:
        return sum(((x * (i + 2)).sin() * (i + 1)).sum() for i in range(4))

    eager_step().backward()
    expected, x.grad = x.grad, None
    gate = threading.Event()
    graph = torch.cuda.CUDAGraph()
    kw = {"save_dir": str(save_dir), "min_offload_bytes": 0, "chunk_bytes": 1 << 20}
    with offload_context("disk", **kw) as engine:
        for _ in range(engine.config.io_workers):  # the writes start inside the capture
            engine._pool.submit(gate.wait, WRITE)
        eager = eager_step()
        try:
            with torch.cuda.graph(graph):
                out = (w * 2).sin().sum()
                (c * 2).sin().sum()  # a CPU tensor saved under the capture
                gate.set()
                engine._wait_writes()  # the IO threads wait on copy events meanwhile
                engine.flush()
        finally:
            gate.set()
            torch.cuda.set_stream(torch.cuda.default_stream())  # if capture_end raised
        eager.backward()
    assert torch.equal(x.grad, expected)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, (w.detach() * 2).sin().sum())


def test_cuda_side_streams_are_dedicated_and_non_blocking() -> None:
    """NOTE [side streams]: the copy streams are in no pool (no torch.cuda.Stream() is
    one of them), and do not wait for work queued on the default stream."""
    from prefetch_offload import streams

    assert streams._cudart() is not None, "libcudart not found: pooled streams in use"
    device = torch.device("cuda", torch.cuda.current_device())
    copies = streams.CudaStreams(device, max_inflight_bytes=1 << 20)
    ours = {copies._d2h_stream.cuda_stream, copies._h2d_stream.cuda_stream}
    pooled = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(40)}
    assert len(ours) == 2 and not ours & pooled
    torch.cuda.synchronize()
    torch.cuda.default_stream().synchronize()
    with torch.cuda.stream(torch.cuda.default_stream()):
        torch.cuda._sleep(500_000_000)  # long work on the default stream
    event = torch.cuda.Event()
    event.record(copies._d2h_stream)
    time.sleep(0.05)
    assert event.query(), "the copy stream waited for the default stream"
    torch.cuda.synchronize()


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_cuda_compute_stream_changes_between_steps(save_dir: Path, target: str) -> None:
    """The current stream is read at every hook call: one engine, default then side stream."""
    model, tokens, targets = _setup()
    ref = copy.deepcopy(model)
    stream = torch.cuda.Stream()
    with offload_context(target, min_offload_bytes=0, **_kw(target, save_dir)):
        model(tokens, targets).backward()  # the engine's copy streams are made here
        model.zero_grad(set_to_none=True)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # Long work queued on the new stream first: a copy ordered after a cached
            # (old) stream would read the activations before they exist.
            torch.cuda._sleep(20_000_000)
            model(tokens, targets).backward()
    with torch.cuda.stream(stream):
        ref(tokens, targets).backward()  # the reference, on the same stream, no offload
    torch.cuda.synchronize()
    assert _same(_grads(model), _grads(ref))


@pytest.mark.parametrize("reentrant", [False, True])
def test_cuda_checkpoint_recompute(save_dir: Path, reentrant: bool) -> None:
    """Reentrant checkpoint saves block inputs through the hooks and recomputes in backward."""
    model, tokens, targets = _setup()
    ref = copy.deepcopy(model)

    def run(m: TinyTransformer) -> torch.Tensor:
        x = m.embed(tokens)
        for block in m.blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        logits = m.head(m.norm(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    run(ref).backward()
    with offload_context("disk", save_dir=str(save_dir), min_offload_bytes=0) as engine:
        run(model).backward()
    assert _same(_grads(model), _grads(ref))
    assert _left_the_device(engine.stats()) > 0


def test_cuda_no_host_sync_in_hooks(save_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Target cpu, steady state: pack and unpack only queue copies and query events."""
    from prefetch_offload import streams

    model, tokens, targets = _setup()
    model(tokens, targets).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(tokens, targets).backward()  # control: the model's own ops do not sync
    except RuntimeError as exc:
        pytest.skip(f"the model itself synchronizes on this build: {exc}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    engine = OffloadEngine(OffloadConfig(target="cpu", min_offload_bytes=0))
    layer = _layer(engine)
    try:
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            model(tokens, targets).backward()  # first step: streams and pinned blocks
        torch.cuda.synchronize()
        gc.collect()
        pins = layer.pool.pin_calls

        def no_wait(self: object) -> None:
            raise AssertionError("a hook waited on a copy on the host")

        monkeypatch.setattr(streams._CudaFence, "wait", no_wait)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
                model(tokens, targets).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        monkeypatch.undo()
        assert layer.pool.pin_calls == pins  # no cudaHostAlloc in steady state
        # A copy to pageable memory blocks the host without a sync the debug mode sees.
        assert layer.pageable_fallbacks() == 0
    finally:
        engine.close()


def _layer(engine: OffloadEngine) -> SpanCopyDevice:
    device = engine._device
    assert isinstance(device, RoutingDevice)
    layer = device._by_type["cuda"]
    assert isinstance(layer, SpanCopyDevice)
    return layer


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_cuda_arena_is_pinned_and_stops_growing(save_dir: Path, target: str) -> None:
    """NOTE [pinned arena]: sequence lengths alternate; after one step of each, no
    cudaHostAlloc and no growth, every lease pinned, no pageable fallback."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab=128, width=64, depth=2, heads=2).cuda()
    batches = [tuple(t.cuda() for t in make_batch(4, seq, vocab=128)) for seq in (64, 160)]
    layer = SpanCopyDevice("cuda", arena_step_bytes=1 << 20)  # grows during warm-up
    kw = _kw(target, save_dir)
    if target == "disk":
        kw["max_pending_write_bytes"] = 1 << 20  # bounds the staging leases live at once
    engine = OffloadEngine(
        OffloadConfig(target=target, min_offload_bytes=0, **kw), device=RoutingDevice([layer])
    )
    seen = []
    try:
        for i in range(10):
            tokens, targets = batches[i % 2]
            with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
                model(tokens, targets).backward()
            torch.cuda.synchronize()
            gc.collect()
            seen.append((layer.pool.pin_calls, layer.pool.pinned_bytes))
        block, _ = layer.pool.lease(1 << 20)
        assert block.is_pinned()
        assert layer.pageable_fallbacks() == 0
        assert all(s == seen[3] for s in seen[4:]), seen
    finally:
        engine.close()


def test_cuda_chunked_copies_are_exact_under_a_small_cap() -> None:
    """NOTE [copy chunks]: tensors far above max_inflight_copy_bytes, behind queued GPU
    work, copied in chunks; the cap holds and gradients are exact."""
    layer = SpanCopyDevice("cuda", max_inflight_bytes=1 << 20)
    engine = OffloadEngine(
        OffloadConfig(target="cpu", min_offload_bytes=0), device=RoutingDevice([layer])
    )
    x = torch.randn(1 << 22, device="cuda", requires_grad=True)  # 16 MiB per saved tensor
    _sleepy_step(x).backward()
    expected, x.grad = x.grad, None
    try:
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            _sleepy_step(x).backward()
        assert engine.stats().tensors_offloaded > 0
        streams = layer.streams(x.device)
        assert 0 < streams.peak_inflight_bytes <= 1 << 20
        assert torch.equal(x.grad, expected)
    finally:
        engine.close()


def test_cuda_direct_io_from_pinned_memory(save_dir: Path) -> None:
    """NOTE [direct IO from pinned memory]: the layer's verdict matches a round trip
    through a pinned block, and it warns exactly when it says no."""
    from prefetch_offload.arena import pin_block
    from prefetch_offload.device import direct_io_roundtrip
    from prefetch_offload.errors import OffloadFallbackWarning

    if not direct_io_supported(str(save_dir)):
        pytest.skip("no folder here takes O_DIRECT")
    layer = SpanCopyDevice("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = layer.direct_io_ok(str(save_dir), now=True)
    warned = [w for w in caught if issubclass(w.category, OffloadFallbackWarning)]
    assert len(warned) == (0 if ok else 1)
    block = pin_block(64 << 20)
    buf = memoryview(block.buffer)
    try:
        direct_io_roundtrip(str(save_dir), buf)
        works = True
    except OSError:
        works = False
    finally:
        buf.release()
    assert ok == works
    layer.close()


def test_building_an_engine_makes_no_cuda_context(save_dir: Path) -> None:
    """NOTE [direct IO from pinned memory]: a rank that enters the context before
    ``torch.cuda.set_device`` must not get a context on GPU 0 from the probe; the probe
    runs at the first CUDA tensor, on its device."""
    import subprocess
    import sys

    code = f"""
import torch
from prefetch_offload import OffloadConfig, OffloadEngine
engine = OffloadEngine(OffloadConfig(target="disk", save_dir={str(save_dir)!r}))
before = [torch._C._cuda_hasPrimaryContext(i) for i in range(torch.cuda.device_count())]
device = torch.cuda.device_count() - 1
x = torch.randn(1 << 20, device=device, requires_grad=True)
with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
    (x * 2).sin().sum().backward()
after = [torch._C._cuda_hasPrimaryContext(i) for i in range(torch.cuda.device_count())]
engine.close()
print(any(before), after[0] if device else True, after[device], engine.io_method)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    before, first, last, _ = out.stdout.split()
    assert before == "False"  # building the engine made no context
    assert last == "True"
    if torch.cuda.device_count() > 1:
        assert first == "False"  # a tensor on the last GPU made none on GPU 0


def test_cuda_peak_memory_drops_by_the_offloaded_bytes(save_dir: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(vocab=128, width=256, depth=4, heads=4).cuda()
    tokens, targets = make_batch(8, 256, vocab=128)
    tokens, targets = tokens.cuda(), targets.cuda()

    def forward_peak(ctx: Callable[[], Any]) -> tuple[int, Any]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with ctx() as engine:
            loss = model(tokens, targets)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            loss.backward()
        model.zero_grad(set_to_none=True)
        return peak, engine

    small = {"min_offload_bytes": 0, "max_inflight_copy_bytes": 16 << 20}
    forward_peak(lambda: offload_context("cpu", **small))  # PyTorch's pinned cache warms up
    plain, _ = forward_peak(lambda: offload_context(None))
    peak, engine = forward_peak(lambda: offload_context("cpu", **small))
    saved = engine.stats().bytes_offloaded
    assert peak < 0.5 * plain
    assert plain - peak >= 0.5 * saved


class _KeywordDropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, *, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.lin(x)))


def test_cuda_dropout_in_a_block_called_by_keyword_recomputes_the_same_mask(
    save_dir: Path,
) -> None:
    """recompute="full": the checkpoint restores the CUDA RNG for the recompute's
    dropout only where it sees the block's tensors, keywords included."""
    torch.manual_seed(0)
    model = torch.nn.ModuleList(_KeywordDropout() for _ in range(3)).cuda()
    reference = copy.deepcopy(model)

    def grads(m: torch.nn.ModuleList) -> list[torch.Tensor]:
        torch.manual_seed(1)
        h = torch.randn(8, 64, device="cuda")
        for block in m:
            h = block(x=h)
        h.square().sum().backward()
        return [p.grad.clone() for p in m.parameters()]

    want = grads(reference)
    with offload_context("disk", str(save_dir), model=model, recompute="full"):
        got = grads(model)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_cuda_recompute_auto_is_exact_and_releases_the_cache_where_the_plan_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """recompute="auto" on a CUDA model through its profile, trial and plan: every step's
    gradients equal those without offload or checkpointing (fp32, explicit attention:
    deterministic kernels), and where the plan changes the caching allocator's free
    blocks go back (NOTE [a trim where the plan changes])."""
    from prefetch_offload import recompute_profile

    emptied: list[int] = []
    real_empty = torch.cuda.empty_cache

    def empty_cache() -> None:
        emptied.append(1)
        real_empty()

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    model, tokens, targets = _setup()
    ref = copy.deepcopy(model)
    ref(tokens, targets).backward()
    expected = _grads(ref)
    with offload_context("cpu", model=model, recompute="auto", min_offload_bytes=0) as engine:
        for _ in range(len(recompute_profile.PROFILE) + 4):  # the profile, the trial, the plan
            model.zero_grad(set_to_none=True)
            model(tokens, targets).backward()
            assert _same(_grads(model), expected)
        plan = engine.recompute_plan()
    assert plan is not None and plan.mode == "auto" and plan.plans_made == 1
    assert emptied


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_cuda_a_change_in_backward_is_seen_by_a_small_view_kept_before_the_record(
    save_dir: Path, target: str
) -> None:
    """NOTE [handouts]: a record kept in the device tier hands its own device memory out
    with the saved tensor's version counter, which the small view kept before it shares:
    the view's unpack raises, as autograd does, instead of reading the zeroed bytes."""
    x = torch.randn(1 << 14, device="cuda", requires_grad=True)
    w = torch.randn(8, device="cuda", requires_grad=True)

    def loss() -> torch.Tensor:
        h = x * 1.5
        return (h[:8] * w).sum() + ZeroesItsSaved.apply(h).sum()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss().backward()
    with offload_context(
        target, min_offload_bytes=4096, device_budget="1GiB", **_kw(target, save_dir)
    ):
        y = loss()
        with pytest.raises(RuntimeError, match=r"inplace|in place"):
            y.backward()
