"""NOTE [ranks agree]: rank 0's decisions for every rank, through a shared store."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from engine_helpers import on_ranks

from prefetch_offload import offload_context
from prefetch_offload.agreement import RankAgreement
from prefetch_offload.errors import OffloadError

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


def test_every_rank_gets_rank_0_s_value() -> None:
    got = on_ranks(3, lambda a: [a.first_rank(f"{a.rank}-{i}".encode()) for i in range(4)])
    assert got == [[f"0-{i}".encode() for i in range(4)]] * 3


@pytest.mark.parametrize("flags", [(False, False, False), (False, True, False), (True,) * 3])
def test_any_is_true_on_every_rank_where_one_rank_passed_true(flags: tuple[bool, ...]) -> None:
    got = on_ranks(3, lambda a: [a.any(flags[a.rank] and i == 1) for i in range(3)])
    assert got == [[False, any(flags), False]] * 3


def test_the_store_holds_the_keys_of_the_last_exchanges_only() -> None:
    store = dist.HashStore()

    def many(a: RankAgreement) -> int:
        for i in range(50):
            a.first_rank(b"x")
            a.any(i % 7 == 0)
        return store.num_keys()

    counts = on_ranks(2, many, store)
    assert all(isinstance(c, int) and c <= 8 for c in counts), counts


def test_a_rank_left_waiting_raises_with_what_to_pass() -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=0.2))
    lone = RankAgreement(store, 1, 2, name="alone")
    with pytest.raises(OffloadError, match=r'rank 1 of 2 waited.*recompute_ranks="own"'):
        lone.first_rank(b"mine")
    with pytest.raises(OffloadError, match="did not"):
        lone.any(True)


def test_rank_0_never_waits_for_a_plan() -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=0.2))
    assert RankAgreement(store, 0, 2, name="first").first_rank(b"plan") == b"plan"


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (2, 2), (-1, 3)])
def test_an_agreement_needs_two_ranks_and_a_rank_among_them(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="2 or more ranks"):
        RankAgreement(dist.HashStore(), rank, world)


def test_without_a_process_group_each_rank_decides_alone() -> None:
    assert not dist.is_initialized()
    assert RankAgreement.of_default_group() is None


def test_a_torch_without_the_default_store_warns_and_decides_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    with pytest.warns(UserWarning, match="each rank decides recompute='auto' alone"):
        assert RankAgreement.of_default_group() is None


@pytest.mark.parametrize("ranks", ["agree", "own"])
def test_only_agree_asks_for_the_default_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranks: str
) -> None:
    asked: list[int] = []
    monkeypatch.setattr(RankAgreement, "of_default_group", lambda: asked.append(1))
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    with offload_context(
        "disk", str(tmp_path), model=model, recompute="auto", recompute_ranks=ranks
    ) as engine:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert asked == ([1] if ranks == "agree" else [])
    assert engine.recompute_plan() is not None
