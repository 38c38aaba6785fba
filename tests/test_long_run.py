"""Many steps under one context: disk use, resident memory and threads stay flat."""

from __future__ import annotations

import copy
import gc
import os
import threading
from pathlib import Path

import torch

from prefetch_offload import offload_context
from prefetch_offload.testing import TinyTransformer, make_batch

STEPS = 300


def _threads() -> int:
    """Live threads, less the heap trim thread, which starts at the first trim
    (NOTE [heap trim]): once, whenever that comes, never a second one."""
    names = [t.name for t in threading.enumerate()]
    assert names.count("prefetch_offload-heap-trim") <= 1, names
    return sum(1 for name in names if name != "prefetch_offload-heap-trim")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_long_run_is_flat_and_exact(save_dir: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, width=32, depth=2, heads=2)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    batches = [make_batch(4, 32, vocab=64, seed=s) for s in range(4)]
    samples: list[tuple[int, int, int]] = []
    with offload_context(
        "disk", save_dir, min_offload_bytes=0, slab_bytes=1 << 20, chunk_bytes=1 << 14
    ) as engine:
        for step in range(STEPS):
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad(set_to_none=True)
                x, y = batches[step % 4]
                if m is model:
                    loss = m(x, y)
                    if step % 2:  # writes land whatever the IO timing; even steps meet the tail
                        engine.flush()
                    loss.backward()
                    del loss
                else:
                    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                        m(x, y).backward()
                o.step()
            if step % 50 == 49:
                engine.flush()
                gc.collect()
                stats = engine.stats()
                samples.append((stats.disk_bytes_reserved, _threads(), _rss()))
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    disk = {s[0] for s in samples}
    threads = {s[1] for s in samples}
    assert len(disk) == 1, f"slab space grew: {samples}"
    assert len(threads) == 1, f"thread count changed: {samples}"
    rss = [s[2] for s in samples]
    assert max(rss[1:]) - rss[1] < 32 << 20, f"resident memory grew: {rss}"
    final = engine.stats()
    assert final.tensors_offloaded + final.writes_skipped >= STEPS * 30
    assert final.tensors_offloaded >= STEPS // 2 * 30
