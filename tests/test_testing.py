"""The test model's helpers (prefetch_offload/testing.py)."""

from __future__ import annotations

import torch

from prefetch_offload import testing


def test_warm_up_unary_ops_calls_every_op_and_restores_the_thread_count() -> None:
    """NOTE [first unary call]: each op exists in this torch, and the intra-op thread
    count the warm-up lowers to one comes back."""
    assert all(callable(getattr(torch, name, None)) for name in testing._UNARY_OPS)
    before = torch.get_num_threads()
    seen: list[int] = []
    real = torch.sin

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return real(x)

    torch.sin = spy  # type: ignore[assignment]
    try:
        testing.warm_up_unary_ops()
    finally:
        torch.sin = real  # type: ignore[assignment]
    assert seen == [1, 1]  # float32 and float64, on one thread
    assert torch.get_num_threads() == before
