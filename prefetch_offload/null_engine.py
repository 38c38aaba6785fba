"""What ``offload_context(None)`` yields, and any context where torch is missing.

# NOTE [no torch]
# The entry points work where torch is not installed, as the API's contract
# says (a CI job that checks a trainer's setting, a CLI's --help path): the
# configuration and its check import no torch, and
# ``offload_context`` imports it only when a context with a target is entered.
# With target None nothing needs torch. With a target and no torch there is no
# autograd and so nothing to offload: the context says so once
# (:class:`OffloadFallbackWarning`) and yields this engine, as None would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .stats import OffloadStats

if TYPE_CHECKING:
    from .recompute import RecomputePlan

__all__ = ["NullEngine"]


class NullEngine:
    """No hooks, all-zero stats (NOTE [no torch]).

    It has the engine's public methods, so that code written for an offloading run
    (``engine.flush()``, ``await engine.aflush()``) also runs with offloading off.
    """

    config = None
    io_method = "none"

    def __init__(self) -> None:
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether the owning context has exited."""
        return self._closed

    def stats(self) -> OffloadStats:
        """All-zero statistics."""
        return OffloadStats()

    def flush(self) -> None:
        """Nothing is ever queued: returns at once."""

    async def aflush(self) -> None:
        """Nothing is ever queued: returns at once."""

    def close(self, *, raise_errors: bool = True) -> None:
        """Mark the context exited."""
        self._closed = True

    def recompute_plan(self) -> RecomputePlan | None:
        """No ``recompute=`` runs with offloading off: None."""
        return None

    def checkpoint_context_fn(
        self,
        policy: Callable[..., Any] | list[Any],
        *,
        allow_cache_entry_mutation: bool = False,
    ) -> tuple[Any, Any]:
        """PyTorch's selective checkpoint contexts for ``policy``; with nothing to offload
        to, a ``*_CPU_OFFLOAD`` output is kept (``*_SAVE``) rather than recomputed."""
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        from .checkpointing import as_policy  # (torch is there: the policy uses it)

        as_save = {
            CheckpointPolicy.MUST_CPU_OFFLOAD: CheckpointPolicy.MUST_SAVE,
            CheckpointPolicy.PREFER_CPU_OFFLOAD: CheckpointPolicy.PREFER_SAVE,
        }
        user = as_policy(policy)  # the engine's checks and errors

        def kept(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            choice = user(ctx, op, *args, **kwargs)
            return as_save.get(choice, choice)

        return create_selective_checkpoint_contexts(
            kept, allow_cache_entry_mutation=allow_cache_entry_mutation
        )
