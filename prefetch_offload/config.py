"""Offload configuration: the frozen :class:`OffloadConfig` and the validators.

Every check here raises at the API boundary, before any hook is installed, with
a message that names the bad value and says how to fix it.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_INFLIGHT_COPY_BYTES",
    "IO_METHODS",
    "RECOMPUTE_MODES",
    "RECOMPUTE_RANKS",
    "STAGE_WRITES",
    "TARGETS",
    "ByteSize",
    "OffloadConfig",
    "parse_bytes",
    "validate_offload_config",
]

TARGETS: tuple[str | None, ...] = (None, "cpu", "disk")
RECOMPUTE_MODES: tuple[str, ...] = ("full", "auto")
RECOMPUTE_RANKS: tuple[str, ...] = ("agree", "own")
IO_METHODS: tuple[str, ...] = ("auto", "direct", "buffered", "mmap")
STAGE_WRITES: tuple[str, ...] = ("auto", "always", "never")
DEFAULT_CHUNK_BYTES = 8 << 20
DEFAULT_INFLIGHT_COPY_BYTES = 1 << 30
_ALIGN = 4096

IOMethod = Literal["auto", "direct", "buffered", "mmap"]
StageWrites = Literal["auto", "always", "never"]
# A byte count: an int, or a str with a decimal or binary unit ("6GiB", "512MB").
ByteSize = int | str

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(name: str, value: object) -> int:
    """``value`` as a whole number of bytes: an int >= 0, or a str such as "6GiB".

    Raises:
        TypeError: not an int or str (floats and bools included).
        ValueError: negative, an unknown unit, or a fraction of a byte.

    Example:
        >>> parse_bytes("host_budget", "1.5KiB")
        1536
    """
    example = f'{name}=6 << 30 or {name}="6GiB"'
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(
            f"prefetch_offload: {name} must be an int or a str with a unit, got "
            f"{type(value).__name__} ({value!r}); e.g. {example}."
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"prefetch_offload: {name} must be >= 0, got {value}; e.g. {example}.")
        return value
    match = _SIZE.fullmatch(value)
    unit = match.group(2).lower() if match else ""
    if match is None or (unit not in _UNITS and unit != ""):
        raise ValueError(
            f"prefetch_offload: {name}={value!r} is not a byte size; use a number with one of "
            f"the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, e.g. {example}."
        )
    number = match.group(1)
    whole, _, frac = number.partition(".")
    scale = _UNITS.get(unit, 1)
    numerator = int(whole + frac) * scale
    denominator = 10 ** len(frac)
    if numerator % denominator:
        raise ValueError(
            f"prefetch_offload: {name}={value!r} is not a whole number of bytes; e.g. {example}."
        )
    return numerator // denominator


class _Default:
    """Marks a field whose default depends on the target; resolved in __post_init__."""

    def __repr__(self) -> str:
        return "<default>"


_TARGET_DEFAULT: Any = _Default()


class _FromTarget(int):
    """``host_budget`` as target "disk" sets it when none was given (0): an int, and
    still the target's default to a ``dataclasses.replace`` that changes the target."""

    __slots__ = ()


def normalise_save_dir(save_dir: object) -> str | None:
    """The folder a ``save_dir`` names, as the configuration stores it.

    A path-like becomes its str and a leading "~" is expanded, as in a shell (not a
    folder named "~" here). A relative path is joined (not normalised: ".." after a
    symlink means what the OS makes of it) to the working directory now, so it names
    the same folder whatever the working directory is when a later slab file is made.

    Raises:
        TypeError: not a str or path-like.
        ValueError: "~user" for a user who does not exist here.
    """
    if isinstance(save_dir, os.PathLike):
        save_dir = os.fspath(save_dir)
    if save_dir is not None and not isinstance(save_dir, str):
        raise TypeError(
            "prefetch_offload: save_dir must be a str path, got "
            f"{type(save_dir).__name__}; pass the folder as a str or pathlib.Path."
        )
    if not save_dir:
        return save_dir
    save_dir = os.path.expanduser(save_dir)
    if save_dir.startswith("~"):
        raise ValueError(
            f"prefetch_offload: save_dir {save_dir!r} names a user's home folder "
            "that does not exist here; pass the folder's full path."
        )
    if not os.path.isabs(save_dir):
        with contextlib.suppress(OSError):  # no working directory: as given
            save_dir = os.path.join(os.getcwd(), save_dir)
    return save_dir


# Byte sizes besides the budgets: each an int, or a str with a unit ("8MiB").
_SIZES = (
    "min_offload_bytes",
    "max_pending_write_bytes",
    "max_inflight_copy_bytes",
    "chunk_bytes",
    "slab_bytes",
    "disk_bytes_limit",
)
# The most IO threads a context starts, and the largest file offset (a slab's size).
_MAX_IO_WORKERS = 1024
_MAX_FILE_BYTES = (1 << 63) - 1


def _check_int(name: str, value: object, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"prefetch_offload: {name} must be an int, got {type(value).__name__} "
            f"({value!r}). {hint}"
        )
    if value < minimum:
        raise ValueError(f"prefetch_offload: {name} must be >= {minimum}, got {value}. {hint}")


@dataclass(frozen=True)
class OffloadConfig:
    """How an offload context behaves. Build it with keyword arguments.

    Example:
        >>> OffloadConfig(target="disk", save_dir="/tmp", prefetch_depth=2).io_workers
        2
    """

    # Where saved tensors go: None (off), "cpu" (host RAM) or "disk" (slab files).
    target: str | None = "disk"
    # Folder for the slab files (target "disk" only); the engine creates it (0700)
    # at context entry if missing. A pathlib.Path is stored as its str, and a
    # leading "~" is expanded.
    save_dir: str | None = None
    # How many saved tensors backward reads ahead of the one it needs; 0 reads synchronously.
    prefetch_depth: int = 4
    # Background IO threads that write and prefetch.
    io_workers: int = 2
    # Saved tensors smaller than this many bytes stay in memory.
    min_offload_bytes: ByteSize = 1 << 16
    # Cap on bytes queued for writing; pack waits when it is reached. Trades memory for speed.
    max_pending_write_bytes: ByteSize = 64 << 20
    # Cap on device-to-host copy bytes in flight (CUDA tensors): past it, pack waits for
    # the oldest copy. Bounds the device memory copies hold when the link is slower than
    # compute; too low a cap keeps the host from running ahead of the GPU.
    max_inflight_copy_bytes: ByteSize = DEFAULT_INFLIGHT_COPY_BYTES
    # Request size, in bytes (multiple of 4096): writes gather queued tensors into
    # batches of about this size (at most half of max_pending_write_bytes), written with
    # one vectored write per run of adjacent extents; reads use requests of at most this.
    chunk_bytes: ByteSize = DEFAULT_CHUNK_BYTES
    # Size of each preallocated slab file, in bytes (multiple of 4096).
    slab_bytes: ByteSize = 256 << 20
    # How bytes move into the slabs: "direct" (O_DIRECT pread/pwrite), "buffered"
    # (pread/pwrite through the page cache), "mmap" (memcpy into a mapping, the
    # simple reference path), or "auto" (direct where the filesystem allows it).
    io_method: IOMethod = "auto"
    # Whether O_DIRECT writes first copy the bytes into a reused huge-page buffer
    # (NOTE [write staging] in writer.py): "auto" does it while forward is waiting on
    # the write cap (the writes are the bottleneck), "always", or "never".
    stage_writes: StageWrites = "auto"
    # Cap on slab bytes on disk; past it tensors stay in memory (None: no cap).
    disk_bytes_limit: ByteSize | None = None
    # CRC-32 of every packed span, checked when it is read back: a corrupted byte
    # raises OffloadIOError instead of giving a wrong gradient. Costs CPU time.
    verify: bool = False
    # NOTE [tiers] in policy.py. Bytes of saved activations that may stay where they
    # were made (GPU memory for CUDA tensors, RAM for CPU tensors): the newest ones,
    # which backward needs first. 0 moves every eligible tensor. An int or "6GiB".
    device_budget: ByteSize = 0
    # Bytes of host RAM that copies of CUDA tensors may hold. Target "cpu": None (no
    # limit) by default; target "disk": 0 by default (host memory only as staging),
    # and a positive value makes RAM the middle tier before disk. A
    # ``dataclasses.replace`` to target "cpu" of a "disk" configuration that took the
    # default takes the "cpu" default.
    host_budget: ByteSize | None = _TARGET_DEFAULT
    # Cap on the bytes one prefetch window reads ahead (NOTE [lookahead] in plan.py);
    # None derives it from the measured read bandwidth. An int or "256MiB".
    prefetch_bytes: ByteSize | None = None
    # NOTE [heap trim] in heap.py: glibc's free heap pages go back to the kernel when
    # the resident memory malloc keeps free has grown by this many bytes since the
    # last trim (once CPU activations were saved); None never trims. "auto": the
    # larger of 64 MiB and a quarter of the bytes the last step moved out of memory.
    # An int or "64MiB" fixes the bound.
    heap_trim_bytes: ByteSize | Literal["auto"] | None = "auto"
    # NOTE [keep, offload, recompute] in recompute.py. The model whose repeated blocks
    # are checkpointed while the context is entered (required with recompute).
    model: Any = field(default=None, repr=False, compare=False)
    # None: nothing is checkpointed. "full": each block is checkpointed (its input goes
    # through the engine). "auto": the engine decides per op, from measurements, to
    # keep, offload or recompute. A callable: a selective-checkpoint policy with
    # PyTorch's signature policy(ctx, op, *args, **kwargs) -> CheckpointPolicy, whose
    # *_CPU_OFFLOAD outputs go through the engine.
    recompute: str | Callable[..., Any] | None = None
    # The blocks to checkpoint: module classes or qualified names; None detects them
    # (NOTE [block detection] in blocks.py).
    recompute_blocks: tuple[Any, ...] | None = None
    # NOTE [ranks agree] in agreement.py. With recompute="auto" in a distributed run:
    # "agree" runs rank 0's plan on every rank of the default process group; "own" lets
    # each rank decide from its own steps (ranks that run different steps or blocks).
    recompute_ranks: Literal["agree", "own"] = "agree"

    def __post_init__(self) -> None:
        self._check_fields()
        _check_recompute_fields(self)

    def _check_fields(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(
                f"Unknown activation_offloading target: {self.target!r}. "
                "Expected None, 'cpu', or 'disk'."
            )
        object.__setattr__(self, "save_dir", normalise_save_dir(self.save_dir))
        for name in _SIZES:  # a str with a unit, as the budgets take; stored as an int
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, parse_bytes(name, value))
        if self.target == "disk" and not self.save_dir:
            raise ValueError(
                "activation_offloading='disk' requires save_dir: pass a scratch folder, "
                "e.g. offload_context('disk', save_dir='/scratch/offload')."
            )
        _check_int(
            "prefetch_depth",
            self.prefetch_depth,
            0,
            "Use 0 for synchronous reads or a small lookahead such as 4.",
        )
        _check_int("io_workers", self.io_workers, 1, "Use at least 1 IO thread, e.g. 2.")
        if self.io_workers > _MAX_IO_WORKERS:
            raise ValueError(
                f"prefetch_offload: io_workers must be at most {_MAX_IO_WORKERS} (one thread "
                f"each), got {self.io_workers}; a few per disk suffice, e.g. 2 to 8."
            )
        _check_int(
            "min_offload_bytes",
            self.min_offload_bytes,
            0,
            "Use 0 to offload every eligible tensor.",
        )
        _check_int(
            "max_pending_write_bytes",
            self.max_pending_write_bytes,
            1,
            "Use a byte count such as 64 << 20.",
        )
        _check_int(
            "max_inflight_copy_bytes",
            self.max_inflight_copy_bytes,
            1,
            "Use a byte count such as 1 << 30.",
        )
        for name in ("chunk_bytes", "slab_bytes"):
            value = getattr(self, name)
            _check_int(name, value, _ALIGN, f"Use a multiple of {_ALIGN} bytes.")
            if value > _MAX_FILE_BYTES:
                raise ValueError(
                    f"prefetch_offload: {name} must be at most {_MAX_FILE_BYTES} (what a "
                    f"file offset holds), got {value}; the default is "
                    f"{getattr(OffloadConfig, name)}."
                )
            if value % _ALIGN:
                raise ValueError(
                    f"prefetch_offload: {name} must be a multiple of {_ALIGN}, got {value}; "
                    f"round it to {(value // _ALIGN + 1) * _ALIGN}."
                )
        if self.io_method not in IO_METHODS:
            raise ValueError(
                f"prefetch_offload: io_method must be one of {IO_METHODS}, got {self.io_method!r}."
            )
        if self.stage_writes not in STAGE_WRITES:
            raise ValueError(
                f"prefetch_offload: stage_writes must be one of {STAGE_WRITES}, got "
                f"{self.stage_writes!r}; 'auto' (the default) stages writes only while "
                "forward waits on them."
            )
        if not isinstance(self.verify, bool):
            raise TypeError(f"prefetch_offload: verify must be True or False, got {self.verify!r}.")
        if self.disk_bytes_limit is not None:
            _check_int(
                "disk_bytes_limit",
                self.disk_bytes_limit,
                0,
                "Use None for no cap, or a byte count.",
            )
            if self.target == "disk" and self.disk_bytes_limit < _ALIGN:
                raise ValueError(
                    f"prefetch_offload: disk_bytes_limit={self.disk_bytes_limit} leaves no "
                    f"room for one {_ALIGN}-byte page on disk, so every saved tensor would "
                    "stay in memory; pass None for no cap, a byte count such as "
                    '20 << 30, or target="cpu" to keep the copies in RAM.'
                )
        object.__setattr__(self, "device_budget", parse_bytes("device_budget", self.device_budget))
        host_budget = self.host_budget
        if host_budget is _TARGET_DEFAULT or type(host_budget) is _FromTarget:
            host_budget = _FromTarget(0) if self.target == "disk" else None
        elif host_budget is None and self.target == "disk":
            raise ValueError(
                "prefetch_offload: host_budget=None (no limit) needs target 'cpu'; with target "
                "'disk' give the bytes of RAM host copies may hold before disk, e.g. "
                'host_budget="32GiB", or 0 to use RAM only as staging (a target "cpu" '
                "configuration's default is None: pass host_budget= to dataclasses.replace "
                "with the new target)."
            )
        elif host_budget is not None:
            host_budget = parse_bytes("host_budget", host_budget)
        object.__setattr__(self, "host_budget", host_budget)
        if self.prefetch_bytes is not None:
            prefetch_bytes = parse_bytes("prefetch_bytes", self.prefetch_bytes)
            if prefetch_bytes == 0:
                raise ValueError(
                    "prefetch_offload: prefetch_bytes must be > 0; use prefetch_depth=0 to "
                    "turn prefetching off, None for a window sized from the read bandwidth, "
                    'or e.g. "256MiB".'
                )
            object.__setattr__(self, "prefetch_bytes", prefetch_bytes)
        if self.heap_trim_bytes is not None and self.heap_trim_bytes != "auto":
            try:
                heap_trim_bytes = parse_bytes("heap_trim_bytes", self.heap_trim_bytes)
            except (TypeError, ValueError) as exc:
                raise type(exc)(
                    f'{exc} heap_trim_bytes also takes "auto" (the default) or None (never trim).'
                ) from None
            if heap_trim_bytes == 0:
                raise ValueError(
                    "prefetch_offload: heap_trim_bytes must be > 0; use None to never give "
                    'free heap memory back, "auto" to follow the step, or e.g. "128MiB".'
                )
            object.__setattr__(self, "heap_trim_bytes", heap_trim_bytes)


def _check_recompute_fields(config: OffloadConfig) -> None:
    recompute, model, blocks = config.recompute, config.model, config.recompute_blocks
    if config.recompute_ranks not in RECOMPUTE_RANKS:
        raise ValueError(
            f"prefetch_offload: recompute_ranks={config.recompute_ranks!r} is not a choice; "
            "use 'agree' (every rank runs rank 0's recompute='auto' plan) or 'own' (each "
            "rank decides from its own steps, e.g. under pipeline parallelism)."
        )
    example = "e.g. offload_context('disk', save_dir=..., model=model, recompute='auto')"
    if recompute is not None and not callable(recompute):
        if not isinstance(recompute, str):
            raise TypeError(
                f"prefetch_offload: recompute must be None, 'full', 'auto' or a policy "
                f"callable, got {type(recompute).__name__} ({recompute!r})."
            )
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(
                f"prefetch_offload: recompute={recompute!r} is not a mode; use None, 'full', "
                "'auto', or a policy callable policy(ctx, op, *args, **kwargs) -> "
                "torch.utils.checkpoint.CheckpointPolicy."
            )
    if model is not None and not callable(getattr(model, "named_modules", None)):
        raise TypeError(
            f"prefetch_offload: model must be a torch.nn.Module, got {type(model).__name__}."
        )
    if recompute is None:
        if model is not None:
            raise ValueError(
                "prefetch_offload: model= is used only to checkpoint its blocks; pass "
                f"recompute='full', 'auto' or a policy with it ({example}), or drop model=."
            )
        if blocks is not None:
            raise ValueError(
                "prefetch_offload: recompute_blocks= needs recompute= ('full', 'auto' or a "
                f"policy) and model= ({example})."
            )
        return
    if model is None:
        raise ValueError(
            f"prefetch_offload: recompute={recompute!r} needs the model whose blocks it "
            f"checkpoints: pass model= ({example})."
        )
    if config.target is None:
        raise ValueError(
            "prefetch_offload: recompute= needs target 'cpu' or 'disk' (with target None "
            "nothing is offloaded); for checkpointing alone use torch.utils.checkpoint."
        )
    if blocks is not None:
        if isinstance(blocks, str | type):
            blocks = (blocks,)
        if not isinstance(blocks, list | tuple | set | frozenset):
            raise TypeError(
                "prefetch_offload: recompute_blocks must be a list of nn.Module classes or "
                f"qualified module names, got {type(blocks).__name__}; e.g. "
                "recompute_blocks=[LlamaDecoderLayer] or ['model.layers.0', 'model.layers.1']."
            )
        object.__setattr__(config, "recompute_blocks", tuple(blocks))


def validate_offload_config(
    target: str | None,
    backend: str,
    device: str,
    save_dir: str | os.PathLike[str] | None = None,
) -> list[str]:
    """Check an ``activation_offloading`` setting without raising.

    Args:
        target: None, "cpu" or "disk".
        backend: "transformers", "unsloth" or "mlx".
        device: "cuda" (or "cuda:N") or "cpu" (CPU training offloads CPU tensors to disk).
        save_dir: scratch folder; required when ``target == "disk"``.

    Returns:
        Error messages; empty when the setting is valid or disabled.

    Example:
        >>> validate_offload_config("disk", "transformers", "cpu")
        ["activation_offloading='disk' requires a save_dir (scratch directory for offloaded activation tensors)."]
    """  # noqa: E501
    errors: list[str] = []
    if target is None:
        return errors
    if target not in TARGETS:
        errors.append(
            f"Unknown activation_offloading target: {target!r}. Expected None, 'cpu', or 'disk'."
        )
        return errors
    if backend == "unsloth":
        errors.append(
            "Activation offloading is not compatible with the unsloth backend. "
            "Unsloth manages its own memory. Use backend: transformers."
        )
        return errors
    if backend == "mlx":
        errors.append(
            "Activation offloading is not supported on the mlx backend. Use backend: transformers."
        )
        return errors
    if str(device).split(":")[0] not in ("cuda", "cpu"):  # "cuda:1" is a CUDA device too
        errors.append(
            f"Activation offloading requires CUDA or CPU training. Current device: {device}."
        )
    if target == "disk" and not save_dir:
        errors.append(
            "activation_offloading='disk' requires a save_dir "
            "(scratch directory for offloaded activation tensors)."
        )
    else:
        try:  # what the context would refuse, whatever the target: not a path, "~nosuchuser"
            normalise_save_dir(save_dir)
        except (TypeError, ValueError) as exc:
            errors.append(str(exc))
    return errors
