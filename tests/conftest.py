"""Shared fixtures. Tests mirror the package: test_<module>.py per module."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from prefetch_offload.testing import warm_up_unary_ops

torch.set_num_threads(2)
warm_up_unary_ops()  # NOTE [first unary call]: before any test compares gradients


@pytest.fixture
def save_dir(tmp_path: Path) -> Path:
    """An empty scratch folder on the test machine's disk."""
    d = tmp_path / "offload"
    d.mkdir()
    return d


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every test must stop the IO threads it started."""
    before = {t.ident for t in threading.enumerate()}
    yield
    leaked = [
        t
        for t in threading.enumerate()
        if t.ident not in before and t.name.startswith("prefetch_offload") and t.is_alive()
    ]
    assert not leaked, f"IO threads left running: {[t.name for t in leaked]}"
