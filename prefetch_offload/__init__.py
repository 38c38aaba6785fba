"""prefetch_offload: offload autograd-saved activations to disk, prefetch them for backward.

Public API (everything else is internal and may change):
"""

from __future__ import annotations

# Entry points
from .config import OffloadConfig, validate_offload_config
from .context import OffloadContext, offload_context, offload_context_from_config
from .engine import OffloadEngine

# Errors
from .errors import OffloadError, OffloadFallbackWarning, OffloadIOError

# Statistics
from .stats import OffloadStats

__all__ = [
    # configuration
    "OffloadConfig",
    # entry points
    "OffloadContext",
    # types
    "OffloadEngine",
    # errors
    "OffloadError",
    "OffloadFallbackWarning",
    "OffloadIOError",
    "OffloadStats",
    "offload_context",
    "offload_context_from_config",
    "validate_offload_config",
]

__version__ = "0.1.0"
