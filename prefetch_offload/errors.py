"""The library's runtime exception types.

Bad input at the API boundary raises :class:`ValueError` or :class:`TypeError`.
Everything that goes wrong while offloading (an IO error in a worker thread, a
corrupted read, use after shutdown) raises a subclass of :class:`OffloadError`.
"""

from __future__ import annotations

import threading

__all__ = ["ErrorSlot", "OffloadError", "OffloadFallbackWarning", "OffloadIOError"]


class OffloadError(RuntimeError):
    """Base class of every runtime failure raised by prefetch_offload."""


class OffloadIOError(OffloadError):
    """A read or write of offloaded bytes failed.

    Raised at the hook call (pack or unpack) that follows the failure, or at
    context exit, with the original ``OSError`` chained as ``__cause__``.
    """


class OffloadFallbackWarning(UserWarning):
    """Offloading fell short of what was asked, and training goes on.

    Some saved tensors stayed in memory (the disk or ``disk_bytes_limit`` is
    full, or ``host_budget`` is used up with no disk to spill to), or host
    copies are pageable instead of pinned (copies become synchronous). Issued
    once per cause and context; ``OffloadStats.fallbacks`` and
    ``OffloadStats.pageable_fallbacks`` count them.
    """


class ErrorSlot:
    """The first error a background thread reports, kept for the next hook call.

    Shared by the engine and its IO paths (it holds none of them, so it closes no
    reference cycle). NOTE [errors from workers] in engine.py.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def report(self, err: BaseException) -> None:
        """Keep ``err`` unless an earlier error is waiting."""
        with self._lock:
            if self._error is None:
                self._error = err

    def take(self) -> BaseException | None:
        """The waiting error, cleared; None if there is none."""
        if self._error is None:
            return None
        with self._lock:
            err, self._error = self._error, None
        return err
