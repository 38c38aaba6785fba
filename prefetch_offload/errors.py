"""The library's runtime exception types.

Bad input at the API boundary raises :class:`ValueError` or :class:`TypeError`.
Everything that goes wrong while offloading (an IO error in a worker thread, a
corrupted read, use after shutdown) raises a subclass of :class:`OffloadError`.
"""

from __future__ import annotations

__all__ = ["OffloadError", "OffloadFallbackWarning", "OffloadIOError"]


class OffloadError(RuntimeError):
    """Base class of every runtime failure raised by prefetch_offload."""


class OffloadIOError(OffloadError):
    """A read or write of offloaded bytes failed.

    Raised at the hook call (pack or unpack) that follows the failure, or at
    context exit, with the original ``OSError`` chained as ``__cause__``.
    """


class OffloadFallbackWarning(UserWarning):
    """Some saved tensors stayed in memory because the disk (or the disk cap) is full.

    Issued once per context; ``OffloadStats.fallbacks`` counts every such tensor.
    """
