"""The ranks of a distributed run deciding ``recompute="auto"`` alike.

# NOTE [ranks agree]
# Each rank measures its own steps, and two ranks' steps differ by more than the
# plans often do, so ranks that decide alone may choose different plans. Under
# DDP, where a block's recompute runs no collective, that costs time (the
# slowest rank's plan sets the step). Where a block runs collectives of
# its own (tensor parallelism: a row-parallel linear's all-reduce), a rank that
# recomputes the block runs them again in backward, and a rank that does not
# never joins them. In ``test_blocks_that_run_collectives_are_recomputed_alike_on_
# every_rank`` (tests/test_recompute_integrations.py: two gloo ranks, an all-reduce
# in each block, rank 1 made to prefer offload alone), ranks deciding alone chose
# different plans, and the run either hung or paired the all-reduces wrongly
# without an error (two runs). So with ``recompute_ranks="agree"`` (the
# default) the ranks of the default process group decide together:
#
# - the plan made after the profile, and the verdict of its trial, are rank 0's;
#   every other rank takes them in place of its own (its own measurements stay
#   in nothing it runs). Rank 0's step is as noisy as any rank's; the point is
#   one plan, not a better one.
# - a new structure (a block or an op position the profile did not see) makes
#   the ranks profile again only when some rank saw one at a check, every
#   AGREE_EVERY planned steps; until then a rank runs an unseen block plainly
#   and stores an unseen op's output, as a rank deciding alone does in the step
#   that finds it.
#
# The ranks meet through the default group's key-value store (the one
# ``init_process_group`` made; private in torch, so a torch without it warns
# once and each rank decides alone), never through a collective: the exchange
# needs no device, no stream and no backend, and a rank that never arrives (a
# rank whose steps differ) ends in an OffloadError after the store's timeout
# (``init_process_group(timeout=)``) with what to pass, where a collective would
# hang for good. The exchanges come at the first block forward of a step, which
# a rank reaches only once its step before has finished, and in synchronous
# training that needs every rank to have joined that step's collectives: waiting
# there cannot deadlock with the training's own collectives.
# Rank 0 posts and never waits for a plan; the other ranks wait for it. A
# check of new structures is a barrier: each rank adds its flag and its
# arrival, and the last to arrive releases the others. Rank 0 deletes the keys
# of earlier exchanges at each check (every rank has passed them), so the
# store holds a few keys whatever the run's length. Measured with two ranks on
# the project's 2-core VM (a TCPStore, as ``init_process_group`` makes on one
# host): a check took 0.27 ms (median of 200), taking rank 0's plan 0.42 ms,
# and the store held 8 keys after 400 exchanges.
#
# Pipeline parallelism holds different blocks on different ranks and runs
# different steps: rank 0's plan names blocks a rank does not have, which is
# an OffloadError that says to pass ``recompute_ranks="own"``.
"""

from __future__ import annotations

import itertools
import warnings
from datetime import timedelta
from typing import Any

from .errors import OffloadError

__all__ = ["RankAgreement"]


# Agreements made in this process: each one's keys live under its own prefix, the
# same on every rank (each rank enters its contexts in the same order).
_COUNT = itertools.count()
# NOTE [ranks agree]: the planned steps between checks of new structures.
AGREE_EVERY = 8
_FIX = (
    'pass recompute_ranks="own" where ranks run different steps or blocks by design '
    "(pipeline parallelism), or make every rank run the same steps through the "
    "wrapped blocks"
)


class RankAgreement:
    """Rank 0's decisions for every rank, through a ``torch.distributed`` store.

    Every rank must make the same calls in the same order (NOTE [ranks agree]).

    Args:
        store: a ``torch.distributed.Store`` every rank shares (its own prefix is added).
        rank: this rank, 0 to ``world - 1``.
        world: how many ranks take part (at least 2).
        name: the keys' prefix, the same on every rank; None numbers the agreements
            this process makes, in order.
    """

    def __init__(self, store: Any, rank: int, world: int, *, name: str | None = None) -> None:
        import torch.distributed as dist

        if world < 2 or not 0 <= rank < world:
            raise ValueError(
                f"prefetch_offload: an agreement needs 2 or more ranks and a rank among "
                f"them, got rank {rank} of {world}"
            )
        name = str(next(_COUNT)) if name is None else name
        self._store = dist.PrefixStore(f"prefetch_offload/agree/{name}/", store)
        self.rank, self.world = rank, world
        self._seq = 0
        self._written: list[tuple[int, str]] = []  # rank 0: keys to delete once all passed

    @classmethod
    def of_default_group(cls) -> RankAgreement | None:
        """The default process group's ranks, where it is initialized with two or more;
        else None (each rank decides alone)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        store_of = getattr(dist.distributed_c10d, "_get_default_store", None)
        try:
            store = store_of() if store_of is not None else None
        except RuntimeError:
            store = None
        if store is None:
            warnings.warn(
                "prefetch_offload: this torch.distributed has no default store to agree "
                "through; each rank decides recompute='auto' alone, and ranks may choose "
                "different plans (NOTE [ranks agree] in agreement.py).",
                stacklevel=3,
            )
            return None
        return cls(store, dist.get_rank(), dist.get_world_size())

    def first_rank(self, value: bytes) -> bytes:
        """Rank 0's ``value``, on every rank (rank 0 does not wait)."""
        seq, key = self._next("value")
        if self.rank == 0:
            self._store.set(key, value)
            return value
        got = self._wait(seq, key, lambda: self._store.get(key))
        return bytes(got)

    def any(self, flag: bool) -> bool:
        """Whether any rank passed True; returns once every rank has called it."""
        seq, key = self._next("any")
        count, done = f"{seq}/count", f"{seq}/done"
        self._store.add(key, int(bool(flag)))
        if self._store.add(count, 1) == self.world:
            self._store.set(done, b"1")
        else:
            self._wait(seq, done, lambda: self._store.wait([done]))
        agreed = self._store.add(key, 0) > 0
        if self.rank == 0:  # every rank is past the earlier exchanges
            for old, name in self._written:
                if old < seq:
                    self._store.delete_key(name)
            self._written = [(s, n) for s, n in self._written if s >= seq]
            self._written += [(seq, key), (seq, count), (seq, done)]
        return agreed

    def _next(self, what: str) -> tuple[int, str]:
        seq, self._seq = self._seq, self._seq + 1
        key = f"{seq}/{what}"
        if self.rank == 0 and what == "value":
            self._written.append((seq, key))
        return seq, key

    def _wait(self, seq: int, key: str, call: Any) -> Any:
        try:
            return call()
        except Exception as err:  # the store's timeout (DistStoreError), or it closed
            timeout = getattr(self._store, "timeout", None)
            within = (
                f" within {timeout.total_seconds():.0f} s" if isinstance(timeout, timedelta) else ""
            )
            raise OffloadError(
                f"prefetch_offload: rank {self.rank} of {self.world} waited{within} for the "
                f"other ranks to reach recompute='auto' decision {seq} ({key!r}) and they "
                f"did not: the ranks are not running the same steps (or another rank raised "
                f"or left its offload_context: see its own error); {_FIX}."
            ) from err

    def mismatch(self, what: str) -> OffloadError:
        """The error for ranks whose blocks or ops differ from rank 0's."""
        return OffloadError(
            f"prefetch_offload: rank {self.rank} of {self.world} cannot take rank 0's "
            f"recompute='auto' plan: {what}; {_FIX}."
        )
