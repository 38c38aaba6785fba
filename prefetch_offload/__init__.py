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

from .config import OffloadConfig, validate_offload_config
from .context import OffloadContext, offload_context, offload_context_from_config
from .engine import OffloadEngine
from .errors import OffloadError, OffloadFallbackWarning, OffloadIOError
from .recompute import RecomputePlan
from .stats import OffloadStats

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
