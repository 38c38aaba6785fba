"""DistributedDataParallel with the gloo backend: two ranks offloading into one save_dir."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from prefetch_offload import offload_context
from prefetch_offload.testing import TinyTransformer, make_batch

STEPS = 3

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, save_dir: str | None, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            TinyTransformer(vocab=64, width=32, depth=2, heads=2)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(STEPS):
            tokens, targets = make_batch(4, 32, vocab=64, seed=100 * rank + step)
            opt.zero_grad(set_to_none=True)
            if save_dir is None:
                model(tokens, targets).backward()
            else:
                with offload_context(
                    "disk", save_dir, min_offload_bytes=0, chunk_bytes=1 << 14
                ) as engine:
                    loss = model(tokens, targets)
                    engine.flush()  # on disk before backward: the reads are exercised
                    loss.backward()
                assert engine.stats().tensors_offloaded > 0 and engine.stats().bytes_read > 0
            opt.step()
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, out)
        # Both ranks done before either tears gloo down: without it, a rank could
        # abort ("terminate called without an active exception") about 1 run in 10,
        # with or without offload.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train(tmp_path: Path, save_dir: str | None, name: str) -> dict[str, torch.Tensor]:
    out = str(tmp_path / f"{name}.pt")
    mp.start_processes(
        _rank, args=(2, _free_port(), save_dir, out), nprocs=2, join=True, start_method="spawn"
    )
    return torch.load(out, weights_only=True)


@pytest.mark.slow
def test_ddp_two_ranks_sharing_one_save_dir(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    plain = _train(tmp_path, None, "plain")
    offloaded = _train(tmp_path, str(shared), "offloaded")
    assert plain.keys() == offloaded.keys()
    for k in plain:
        assert torch.equal(plain[k], offloaded[k]), k
    assert list(shared.iterdir()) == []
