"""``offload_context``: the one entry point users wrap around training."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from .config import (
    _TARGET_DEFAULT,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_INFLIGHT_COPY_BYTES,
    ByteSize,
    OffloadConfig,
    normalise_save_dir,
    validate_offload_config,
)
from .errors import OffloadError, OffloadFallbackWarning
from .heap import fast_reuse_hint
from .null_engine import NullEngine
from .stats import OffloadStats

# NOTE [no torch]: torch, and every module that needs it, is imported when a context
# with a target is entered (or a model's blocks are checked), not with this module.
if TYPE_CHECKING:
    import torch

    from .blocks import WrappedBlocks
    from .engine import OffloadEngine

__all__ = ["OffloadContext", "offload_context", "offload_context_from_config"]


def _top_hooks() -> tuple[Any, Any] | None:
    """The innermost saved-tensor hooks of this thread (None: none, or torch cannot say)."""
    import torch

    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


logger = logging.getLogger("prefetch_offload")


def _summary(stats: OffloadStats, target: str | None, hint: str | None = None) -> str:
    """The line logged at exit; ``hint`` (:func:`fast_reuse_hint`) is named when heap
    trims ran (NOTE [heap trim])."""
    mb = 1 << 20
    line = (
        f"prefetch_offload ({target}): offloaded {stats.tensors_offloaded} tensors "
        f"({stats.bytes_offloaded / mb:.1f} MiB), read back {stats.bytes_read / mb:.1f} MiB, "
        f"prefetch hit rate {stats.hit_rate:.1%}, backward stalled {stats.stall_seconds:.3f} s, "
        f"pack waited {stats.pack_wait_seconds:.3f} s, {stats.fallbacks} fallbacks to memory, "
        f"{stats.tensors_kept} tensors kept, {stats.dedup_hits} dedup hits, "
        f"heap trims: {stats.heap_trims} ({stats.heap_trim_seconds:.3f} s)"
    )
    if stats.heap_trims and hint:
        line += (
            ". Pages a trim gives back are faulted in again by later steps; starting "
            f"Python with {hint} (`python -m prefetch_offload run train.py` does it) lets "
            "glibc reuse freed activations instead (a change to the whole process: "
            "measure it)."
        )
    return line


# The oldest torch release the engine is tested on (the CI runs 2.13; 2.11's CUDA
# build runs the CPU suite too). Older releases lack pieces the engine relies on
# or changed them (saved-tensor hook semantics under compile, the autograd node
# and graph task queries, fast profiler ranges).
MIN_TORCH = (2, 11)
TESTED_TORCH = "2.11 and 2.13"


def check_torch_version(version: str) -> None:
    """Raise :class:`OffloadError` if ``version`` is older than :data:`MIN_TORCH`.

    Example:
        >>> check_torch_version("2.13.0+cpu")
    """
    parts = version.split("+")[0].split(".")
    try:
        found = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return  # a source build with an unusual version string: let it run
    if found < MIN_TORCH:
        raise OffloadError(
            f"prefetch_offload needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (tested with "
            f"{TESTED_TORCH}); this process has torch {version}. Upgrade torch, e.g. "
            f"pip install 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}'."
        )


def _current_task() -> asyncio.Task[Any] | None:
    """The asyncio task running on this thread now, if any."""
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running event loop here
        return None


# The contexts entered on each thread and not yet exited, with the asyncio task that
# entered each (None: outside a task).
_entered = threading.local()


def _claim_thread(context: OffloadContext) -> None:
    """Refuse a context that a task would enter while another task of this thread holds
    one: saved-tensor hooks are per thread, so each would take the other's tensors, and
    the first exit would find the other's hooks on top."""
    task = _current_task()
    held: list[tuple[OffloadContext, asyncio.Task[Any] | None]]
    held = _entered.__dict__.setdefault("held", [])
    for _, other in held:
        if other is not None and other is not task and not other.done():
            raise OffloadError(
                "prefetch_offload: another asyncio task on this thread holds an "
                "offload_context; saved-tensor hooks are per thread, so the two would "
                "take each other's saved tensors. Enter one context around the tasks "
                "(or train each in a thread of its own)."
            )
    held.append((context, task))


def _release_thread(context: OffloadContext) -> None:
    """``context`` no longer holds this thread (exited, or its entry failed)."""
    held = _entered.__dict__.get("held", [])
    held[:] = [entry for entry in held if entry[0] is not context]


class OffloadContext:
    """Installs the offload hooks on enter and removes them on exit.

    Hooks are thread-local (PyTorch keeps the saved-tensor hook stack per
    thread): each thread that trains needs its own context. Not re-entrant.
    Also an async context manager: ``async with`` installs the hooks in the
    event loop's thread and waits for pending writes at exit without blocking
    the loop; two tasks of one thread cannot hold contexts at once (entering the
    second raises :class:`OffloadError`). A summary of the stats is logged at
    INFO on the ``prefetch_offload`` logger at exit.
    """

    def __init__(self, config: OffloadConfig) -> None:
        if not isinstance(config, OffloadConfig):
            raise TypeError(
                f"prefetch_offload: OffloadContext takes an OffloadConfig, got "
                f"{type(config).__name__}; for a mapping use offload_context_from_config()."
            )
        self.config = config
        self._engine: OffloadEngine | NullEngine | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._thread: int | None = None
        self._wrapped: WrappedBlocks | None = None
        self._claim = threading.Lock()
        self._claimed = False  # entered, or being entered (by one thread only)

    def __enter__(self) -> OffloadEngine | NullEngine:
        with self._claim:
            if self._claimed:
                raise OffloadError(
                    "prefetch_offload: an offload_context can be entered only once; "
                    "call offload_context(...) again for each with block."
                )
            self._claimed = True
        try:
            return self._enter()
        except BaseException:
            with self._claim:  # nothing was left entered: it may be entered again
                self._claimed = False
            raise

    def _enter(self) -> OffloadEngine | NullEngine:
        if self.config.target is None:
            self._engine = NullEngine()
            return self._engine
        try:
            import torch
        except ImportError:  # NOTE [no torch]: no autograd here, so nothing to offload
            warnings.warn(
                f"prefetch_offload: torch cannot be imported here, so there is nothing to "
                f"offload; offload_context({self.config.target!r}) does nothing.",
                OffloadFallbackWarning,
                stacklevel=3,
            )
            self._engine = NullEngine()
            return self._engine
        from .engine import OffloadEngine

        check_torch_version(torch.__version__)
        _claim_thread(self)
        engine = None
        hooks = None
        try:
            engine = OffloadEngine(self.config)
            hooks = torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack)
            hooks.__enter__()
            self._engine, self._hooks = engine, hooks
            self._thread = threading.get_ident()
            if self.config.recompute is not None:
                self._wrapped = _wrap_model(engine, self.config)
        except BaseException:
            if self._hooks is not None:
                hooks.__exit__(None, None, None)  # type: ignore[union-attr]
            self._engine = self._hooks = None
            _release_thread(self)
            if engine is not None:
                engine.close(raise_errors=False)
            raise
        return engine

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        engine, hooks = self._engine, self._hooks
        if hooks is not None:
            assert engine is not None and not isinstance(engine, NullEngine)
            if threading.get_ident() != self._thread:
                # The hooks are on the entering thread's stack: popping this one's would
                # fail inside PyTorch and leave them (and the IO threads) behind.
                raise OffloadError(
                    "prefetch_offload: an offload_context must be exited in the thread "
                    "that entered it (saved-tensor hooks are per thread); exit it there."
                )
            top = _top_hooks()
            if top is not None and top[0] != engine.pack:
                # Hooks are a stack: popping now would remove the inner context's (or
                # another library's) hooks and leave this one's installed.
                raise OffloadError(
                    "prefetch_offload: an offload_context was exited while hooks entered "
                    "after it are still installed; exit contexts in reverse order of "
                    "entering them (nest the with blocks)."
                )
        if self._wrapped is not None:
            self._wrapped.check_restore()  # (a refused exit changes nothing)
        # Each step runs whatever an earlier one raised (a second Ctrl-C while exiting:
        # NOTE [interrupts] in io_pool.py): the model, then the hooks, then the engine.
        with contextlib.ExitStack() as later:
            later.callback(self._close_engine, engine, exc_type)
            if hooks is not None:
                self._hooks = None
                later.callback(_release_thread, self)
                later.callback(hooks.__exit__, exc_type, exc, tb)
            if self._wrapped is not None:  # NOTE [wrapping blocks]: the model as it was
                self._wrapped.restore()
                self._wrapped = None

    def _close_engine(
        self, engine: OffloadEngine | NullEngine | None, exc_type: type[BaseException] | None
    ) -> None:
        if engine is not None and not isinstance(engine, NullEngine):
            if engine.closed:
                return  # exited before: closed and summarized then
            try:
                engine.close(raise_errors=exc_type is None)
            finally:
                stats = engine.stats()
                hint = fast_reuse_hint() if stats.heap_trims else None
                logger.info("%s", _summary(stats, self.config.target, hint))
        elif engine is not None:
            engine.close()

    async def __aenter__(self) -> OffloadEngine | NullEngine:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        engine = self._engine
        if self._hooks is not None:
            assert engine is not None and not isinstance(engine, NullEngine)
            # Wait for the writes in a worker thread; the hooks come off in this thread.
            waiting = _ExecutorWait(engine._wait_writes)
            try:
                await asyncio.get_running_loop().run_in_executor(None, waiting.run)
            except BaseException:  # cancelled while waiting: still remove hooks, stop threads
                # The close waits for the same writes; the worker's wait, which may still
                # be handing the batch it took to the IO pool, ends first.
                waiting.abandon()
                self.__exit__(*sys.exc_info())
                raise
        self.__exit__(exc_type, exc, tb)


class _ExecutorWait:
    """A wait run in an executor, which the awaiting side can abandon: one that has not
    started never runs, and :meth:`abandon` returns once one that has started ended."""

    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait = wait
        self._lock = threading.Lock()
        self._abandoned = False
        self._started = False
        self._ended = threading.Event()

    def run(self) -> None:
        with self._lock:
            if self._abandoned:
                return
            self._started = True
        try:
            self._wait()
        finally:
            self._ended.set()

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            started = self._started
        if started:
            self._ended.wait()


def _wrap_model(engine: OffloadEngine, config: OffloadConfig) -> WrappedBlocks:
    """Checkpoint the model's blocks as ``config.recompute`` says (blocks.py)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from .agreement import RankAgreement
    from .blocks import SKIP, WrappedBlocks, find_blocks
    from .checkpointing import PlainCounts, plain_contexts, selective_contexts
    from .recompute import AutoDecider, RecordingDecider

    blocks = find_blocks(config.model, config.recompute_blocks)
    recompute = config.recompute
    stats = engine._ckpt_stats
    if recompute == "full":  # NOTE [plain blocks counted] in checkpointing.py
        contexts = functools.partial(plain_contexts, stats, PlainCounts())
        return WrappedBlocks(blocks, contexts, model=config.model)
    compiled: Any
    if recompute == "auto":
        decider: Any = AutoDecider(
            engine.stats,
            engine.config.device_budget,  # type: ignore[arg-type]
            checkpoint_stats=stats,
            trim_heap=_release_at_plan_change(engine, config.model),
            hold_trims=engine._heap.hold,
            trims_held=lambda: engine._heap.held,
            peaks=_peak_sampler(engine, config.model),
            agreement=RankAgreement.of_default_group()
            if config.recompute_ranks == "agree"
            else None,
        )
        engine._decider = decider
        compiled = SKIP  # NOTE [compiled blocks]: the engine offloads what the graph saves
    else:
        assert callable(recompute)
        decider = RecordingDecider("policy").for_policy(recompute)
        engine._decider = decider._recorder
        # NOTE [compiled blocks]: the compiler saves what is not recomputed, through the
        # engine's hooks; an offload choice is a save there.
        compiled = functools.partial(
            create_selective_checkpoint_contexts, _saving_offloads(recompute)
        )

    def context_fn() -> tuple[Any, Any]:
        return selective_contexts(decider, engine, stats)

    if recompute != "auto":
        return WrappedBlocks(blocks, context_fn, compiled=compiled, model=config.model)
    # NOTE [block modes]; NOTE [plain blocks counted] in checkpointing.py
    plain = functools.partial(plain_contexts, stats, PlainCounts())
    return WrappedBlocks(
        blocks, context_fn, compiled=compiled, model=config.model, modes=decider, plain_fn=plain
    )


def _release_at_plan_change(engine: OffloadEngine, model: Any) -> Callable[[], None]:
    """What a change of plan gives back (NOTE [a trim where the plan changes] in
    recompute.py): the heap the steps before left resident and, for a CUDA model, the
    free blocks the caching allocator keeps for them, whose reserved memory would
    otherwise stay the peak a user reads."""
    if not _on_cuda(model):
        return engine._heap.trim_now

    import torch

    def release() -> None:
        engine._heap.trim_now()
        if not torch.cuda.is_current_stream_capturing():  # (a capture cannot free)
            torch.cuda.empty_cache()

    return release


def _peak_sampler(engine: OffloadEngine, model: Any) -> Any:
    """What samples the memory a plan holds (NOTE [plans within the noise] in
    recompute_planner.py): the process's anonymous resident memory, for a CPU model offloaded to
    disk under heap trims. None (plans go by time alone) for a CUDA model, whose
    allocation peaks last microseconds of host time, and without trims (heap trims off,
    or target "cpu", which keeps CPU tensors where they are), where the resident memory
    keeps what earlier steps of other plans left."""
    from .peak import PeakSampler

    if _on_cuda(model) or engine.config.target != "disk" or not engine._heap.enabled:
        return None
    return PeakSampler()


def _on_cuda(model: Any) -> bool:
    """Whether ``model``'s first parameter is a CUDA tensor."""
    param = next(iter(model.parameters()), None)
    return param is not None and param.is_cuda


def _saving_offloads(policy: Callable[..., Any]) -> Callable[..., Any]:
    """``policy`` with ``*_CPU_OFFLOAD`` read as ``*_SAVE`` (for the compiler's SAC)."""
    from torch.utils.checkpoint import CheckpointPolicy

    def compiled_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        choice = policy(ctx, op, *args, **kwargs)
        if choice is CheckpointPolicy.MUST_CPU_OFFLOAD:
            return CheckpointPolicy.MUST_SAVE
        if choice is CheckpointPolicy.PREFER_CPU_OFFLOAD:
            return CheckpointPolicy.PREFER_SAVE
        return choice

    return compiled_policy


def offload_context(
    target: str | None,
    save_dir: str | None = None,
    *,
    prefetch_depth: int = 4,
    io_workers: int = 2,
    min_offload_bytes: int = 1 << 16,
    max_pending_write_bytes: int = 64 << 20,
    max_inflight_copy_bytes: int = DEFAULT_INFLIGHT_COPY_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    slab_bytes: int = 256 << 20,
    io_method: str = "auto",
    stage_writes: str = "auto",
    disk_bytes_limit: int | None = None,
    verify: bool = False,
    device_budget: ByteSize = 0,
    host_budget: ByteSize | None = _TARGET_DEFAULT,
    prefetch_bytes: ByteSize | None = None,
    heap_trim_bytes: ByteSize | Literal["auto"] | None = "auto",
    model: torch.nn.Module | None = None,
    recompute: str | Callable[..., Any] | None = None,
    recompute_blocks: Sequence[type[torch.nn.Module] | str] | None = None,
    recompute_ranks: Literal["agree", "own"] = "agree",
) -> OffloadContext:
    """Offload the tensors autograd saves for backward while the block runs.

    Args:
        target: "disk" writes saved tensors to slab files in ``save_dir``;
            "cpu" keeps them in host RAM (CPU tensors already are); None does nothing.
        save_dir: scratch folder for "disk"; created (mode 0700) if missing.
            Nothing in it is visible while running or left behind afterwards.
        prefetch_depth: saved tensors read ahead of backward; 0 reads synchronously.
        io_workers: background IO threads.
        min_offload_bytes: smaller saved tensors stay in memory.
        max_pending_write_bytes: cap on bytes queued for writing; pack waits at the cap.
        max_inflight_copy_bytes: cap on GPU-to-host copy bytes in flight; pack waits at it.
        chunk_bytes: write batch and read request size (multiple of 4096).
        slab_bytes: size of each preallocated slab file (multiple of 4096).
        io_method: "auto", "direct" (O_DIRECT), "buffered" or "mmap".
        stage_writes: "auto" copies O_DIRECT writes through a huge-page buffer while
            forward waits at the write cap; "always" or "never" force it.
        disk_bytes_limit: cap on slab bytes; past it tensors stay in memory.
        verify: checksum every packed tensor and check it when read back.
        device_budget: bytes of saved activations that may stay where they were
            made (GPU memory, or RAM for CPU tensors): the newest, which backward
            needs first. An int or a str such as "6GiB"; 0 moves every eligible tensor.
        host_budget: bytes of RAM that host copies of CUDA tensors may hold.
            Target "cpu": no limit by default. Target "disk": 0 by default (RAM
            only as staging); a positive value makes RAM the tier before disk.
        prefetch_bytes: cap on the bytes one prefetch window reads ahead; None
            sizes it from the measured read bandwidth.
        heap_trim_bytes: give glibc's free heap memory back to the kernel whenever
            the resident memory it keeps free has grown by this many bytes (once CPU
            activations were saved), so the process stays within about this much
            of its live memory; memory given back costs page faults when it is used
            again. "auto" (default): the larger of 64 MiB and a quarter of the bytes
            the last step moved out of memory. None never trims.
        model: the model whose repeated blocks ``recompute`` checkpoints while the
            context is entered (restored exactly on exit); required with ``recompute``.
        recompute: None checkpoints nothing. "full" checkpoints each block
            (non-reentrant); its input goes through the engine. "auto" decides per
            op, from nine profiled steps, whether to keep, offload or recompute its
            output (``engine.recompute_plan()`` says what and why). A callable is a
            selective-checkpoint policy ``policy(ctx, op, *args, **kwargs) ->
            CheckpointPolicy``: ``*_SAVE`` keeps the output in device memory,
            ``*_RECOMPUTE`` recomputes it, ``*_CPU_OFFLOAD`` hands it to the engine
            (``PREFER_*`` may stay on the device within ``device_budget``).
        recompute_blocks: the blocks to checkpoint, as module classes or qualified
            names; None finds them (``_no_split_modules``, else the longest run of
            same-class children of an ``nn.ModuleList`` or ``nn.Sequential``).
        recompute_ranks: with ``recompute="auto"`` in a distributed run, "agree"
            (default) runs rank 0's plan on every rank of the default process group
            (initialized before the context is entered), so ranks never recompute
            different blocks (a hang where blocks run collectives); "own" lets each
            rank decide from its own steps (pipeline parallelism).

    Returns:
        A context manager whose ``__enter__`` yields the engine (``engine.stats()``).

    Raises:
        ValueError, TypeError: bad arguments, from this call. An unusable
            ``save_dir`` (or ``io_method="direct"`` where the filesystem has no
            O_DIRECT) raises when the ``with`` is entered, before any hook is
            installed; entering a context twice raises :class:`OffloadError`.

    Example:
        >>> with offload_context("disk", save_dir="/tmp/acts") as engine:  # doctest: +SKIP
        ...     loss = model(x).sum()
        ...     loss.backward()
        >>> engine.stats().bytes_offloaded  # doctest: +SKIP
    """
    config = OffloadConfig(
        target=target,
        save_dir=save_dir,  # type: ignore[arg-type]  # OffloadConfig checks and normalizes it
        prefetch_depth=prefetch_depth,
        io_workers=io_workers,
        min_offload_bytes=min_offload_bytes,
        max_pending_write_bytes=max_pending_write_bytes,
        max_inflight_copy_bytes=max_inflight_copy_bytes,
        chunk_bytes=chunk_bytes,
        slab_bytes=slab_bytes,
        io_method=io_method,  # type: ignore[arg-type]
        stage_writes=stage_writes,  # type: ignore[arg-type]
        disk_bytes_limit=disk_bytes_limit,
        verify=verify,
        device_budget=device_budget,
        host_budget=host_budget,
        prefetch_bytes=prefetch_bytes,
        heap_trim_bytes=heap_trim_bytes,
        model=model,
        recompute=recompute,
        recompute_blocks=recompute_blocks,  # type: ignore[arg-type]  # checked, made a tuple
        recompute_ranks=recompute_ranks,
    )
    if recompute is not None:
        from .blocks import find_blocks

        find_blocks(model, config.recompute_blocks)  # type: ignore[arg-type]  # at the call
    return OffloadContext(config)


_CONFIG_KEYS = {f.name for f in dataclasses.fields(OffloadConfig)} - {"target"}


def offload_context_from_config(
    config: Mapping[str, Any], *, backend: str = "transformers", device: str = "cuda"
) -> OffloadContext:
    """Build the context from a trainer's config mapping (YAML, JSON, dict).

    Reads ``activation_offloading`` (or ``target``) for the target and the
    knobs of :class:`OffloadConfig` by name (``save_dir``, ``prefetch_depth``,
    ...). ``backend`` and ``device`` (also read from the mapping when present)
    are checked with :func:`validate_offload_config`, with the same messages.

    Raises:
        ValueError: the setting is invalid, a key is unknown (a typo would
            otherwise be ignored silently; the message lists the valid keys), or
            both ``activation_offloading`` and ``target`` are given.
        TypeError: a knob has the wrong type, or ``config`` is not a mapping.

    Example:
        >>> cfg = {"activation_offloading": "disk", "save_dir": "/tmp/acts", "prefetch_depth": 2}
        >>> ctx = offload_context_from_config(cfg, device="cpu")  # doctest: +SKIP
    """
    if not isinstance(config, Mapping):
        raise TypeError(
            f"prefetch_offload: expected a mapping of offload settings, got "
            f"{type(config).__name__}."
        )
    settings = dict(config)
    if "activation_offloading" in settings and "target" in settings:
        raise ValueError(
            "prefetch_offload: the settings give both 'activation_offloading' "
            f"({settings['activation_offloading']!r}) and 'target' ({settings['target']!r}); "
            "keep only one of them."
        )
    target = settings.pop("activation_offloading", settings.pop("target", None))
    backend = settings.pop("backend", backend)
    device = settings.pop("device", device)
    unknown = sorted(set(settings) - _CONFIG_KEYS, key=str)
    if unknown:
        valid = _CONFIG_KEYS | {"activation_offloading", "target", "backend", "device"}
        raise ValueError(
            f"prefetch_offload: unknown offload setting(s) {unknown}; valid keys are "
            f"{sorted(valid)}."
        )
    normalise_save_dir(settings.get("save_dir"))  # its TypeError, not the list's ValueError
    errors = validate_offload_config(target, backend, device, settings.get("save_dir"))
    if errors:
        raise ValueError(" ".join(errors))
    # target None too: the knobs are checked as offload_context(None, ...) checks them.
    return offload_context(target, **settings)
