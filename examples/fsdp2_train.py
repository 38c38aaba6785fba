"""FSDP2 (``fully_shard``) training with activations offloaded to disk.

Run, one process per GPU (or two CPU processes with gloo where there is no GPU):

    torchrun --nproc_per_node 2 examples/fsdp2_train.py --save-dir /tmp/acts

Every rank offloads into the same ``--save-dir``: slab files are unlinked as soon
as they are created, so ranks never collide and nothing is left behind. Each rank
needs disk space for its own step's saved activations. The model is the small
transformer from ``prefetch_offload.testing`` on random tokens; swap in yours.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from prefetch_offload import offload_context
from prefetch_offload.testing import TinyTransformer, make_batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--save-dir", required=True, help="scratch folder, may be shared by ranks")
    p.add_argument("--target", default="disk", choices=["disk", "cpu"])
    p.add_argument(
        "--device-budget",
        default="0",
        help="activations each rank keeps where they were made (e.g. 64MiB); the rest moves",
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    return p.parse_args(argv)


def say(line: str) -> None:
    """Print ``line`` in one write, so that lines from different ranks do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = TinyTransformer(
            vocab=args.vocab, width=args.width, depth=args.depth, heads=args.heads
        ).to(device)
        for block in model.blocks:  # each block its own all-gather unit, then the root
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        # One context around the whole loop: slab files and IO threads are made once.
        with offload_context(
            args.target, args.save_dir, device_budget=args.device_budget
        ) as engine:
            for step in range(args.steps):
                tokens, targets = make_batch(
                    args.batch, args.seq, vocab=args.vocab, seed=1000 * rank + step
                )
                loss = model(tokens.to(device), targets.to(device))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if rank == 0:
                    say(f"step {step}: loss {loss.item():.4f}")

        s = engine.stats()
        say(
            f"rank {rank}: offloaded {s.tensors_offloaded} tensors "
            f"({s.bytes_offloaded / 2**20:.1f} MiB), read back {s.bytes_read / 2**20:.1f} MiB, "
            f"hit rate {s.hit_rate:.2f}, stalled {s.stall_seconds:.3f} s, "
            f"peak disk in use {s.peak_disk_bytes_in_use / 2**20:.1f} MiB "
            f"(slab files reserved {s.peak_disk_bytes_reserved / 2**20:.0f} MiB), "
            f"fallbacks {s.fallbacks}"
        )
        dist.barrier()  # every rank done before the process group is torn down
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
