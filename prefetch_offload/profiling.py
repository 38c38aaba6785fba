"""Named ranges in torch.profiler traces for the engine's hooks and IO jobs.

# NOTE [profiler ranges]
# pack, unpack, stall (unpack waiting for a read), write and read appear as named
# ranges in torch.profiler traces. The IO threads' ranges are recorded when the
# profile is started with ``experimental_config=torch._C._profiler.
# _ExperimentalConfig(profile_all_threads=True)`` (a plain profile only sees the
# thread that started it). _RecordFunctionFast costs about 0.25 us when no
# profiler runs; a torch without it gets no ranges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

__all__ = ["profiler_range"]

profiler_range: Callable[[str], contextlib.AbstractContextManager[object]] = getattr(
    torch._C._profiler, "_RecordFunctionFast", lambda name: contextlib.nullcontext()
)
