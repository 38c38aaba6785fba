"""Pack, unpack, stall, write and read show up as named ranges in torch.profiler traces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from prefetch_offload import offload_context

pytestmark = pytest.mark.skipif(
    not hasattr(torch._C._profiler, "_RecordFunctionFast"), reason="torch without fast ranges"
)


def _names(save_dir: Path, **kw: object) -> set[str]:
    x = torch.randn(1 << 16, requires_grad=True)
    with (
        profile(activities=[ProfilerActivity.CPU], **kw) as prof,
        offload_context("disk", save_dir, min_offload_bytes=0, prefetch_depth=0) as engine,
    ):
        y = x * 2
        for _ in range(3):
            y = y.sin()
        engine.flush()
        y.sum().backward()
    return {e.name for e in prof.events() if e.name.startswith("prefetch_offload::")}


def test_hook_ranges_appear_in_a_plain_profile(save_dir: Path) -> None:
    names = _names(save_dir)
    assert {"prefetch_offload::pack", "prefetch_offload::unpack"} <= names
    assert "prefetch_offload::stall" in names  # depth 0: every unpack waits for its read


def test_io_thread_ranges_appear_when_profiling_all_threads(save_dir: Path) -> None:
    cfg = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    names = _names(save_dir, experimental_config=cfg)
    assert {"prefetch_offload::write", "prefetch_offload::read"} <= names
