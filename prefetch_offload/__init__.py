"""prefetch_offload: offload autograd-saved activations to disk, prefetch them for backward.

Public API (everything else is internal and may change):

- entry points: :func:`offload_context`, :func:`offload_context_from_config`,
  :class:`OffloadContext`, :func:`validate_offload_config` (a non-raising check of
  a trainer's setting);
- configuration and the engine: :class:`OffloadConfig`, :class:`OffloadEngine`;
- statistics: :class:`OffloadStats`, :class:`RecomputePlan` (``engine.recompute_plan()``);
- errors: :class:`OffloadError` (base), :class:`OffloadIOError`,
  :class:`OffloadFallbackWarning`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import OffloadConfig, validate_offload_config
from .errors import OffloadError, OffloadFallbackWarning, OffloadIOError
from .stats import OffloadStats

if TYPE_CHECKING:
    from .context import OffloadContext, offload_context, offload_context_from_config
    from .engine import OffloadEngine
    from .recompute import RecomputePlan

# Imported on first use: the configuration, its check and the errors need no torch
# (a CLI's --help, a CI job validating a trainer's setting).
_LAZY = {
    "OffloadContext": "context",
    "offload_context": "context",
    "offload_context_from_config": "context",
    "OffloadEngine": "engine",
    "RecomputePlan": "recompute",
}


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "OffloadConfig",
    "OffloadContext",
    "OffloadEngine",
    "OffloadError",
    "OffloadFallbackWarning",
    "OffloadIOError",
    "OffloadStats",
    "RecomputePlan",
    "offload_context",
    "offload_context_from_config",
    "validate_offload_config",
]

__version__ = "0.1.0"
