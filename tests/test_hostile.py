"""Odd and hostile inputs: kept in memory (or handled), never a crash; crash safety."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from prefetch_offload import OffloadConfig, OffloadEngine, offload_context
from prefetch_offload.io_pool import InlineIOPool


class Tagged(torch.Tensor):
    """A trivial tensor subclass."""


def _odd_tensors() -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():  # beta/prototype/deprecation notices from torch
        warnings.simplefilter("ignore")
        return _make_odd_tensors()


def _make_odd_tensors() -> dict[str, torch.Tensor]:
    dense = torch.randn(64, 64)
    out = {
        "sparse_coo": dense.to_sparse(),
        "sparse_csr": dense.to_sparse_csr(),
        "meta": torch.empty(64, 64, device="meta"),
        "zero_size": torch.empty(0, 64),
        "subclass": dense.as_subclass(Tagged),
        "conj": torch.randn(64, 64, dtype=torch.complex64).conj(),
        "neg": torch.randn(64, 64, dtype=torch.complex64).conj().imag,
        "quantized": torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8),
        "nested": torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)]),
        "misaligned": torch.frombuffer(
            bytearray(4 * 4097), dtype=torch.float32, offset=2, count=4096
        ),
        "inference": None,  # filled below
        "zero_tensor": torch._efficientzerotensor(64, 64),  # no memory (forward-mode AD)
    }
    with torch.inference_mode():
        out["inference"] = torch.randn(64, 64)
    return out


@pytest.mark.parametrize("name", sorted(_odd_tensors()))
def test_odd_tensors_are_kept_and_returned_unchanged(save_dir: Path, name: str) -> None:
    t = _odd_tensors()[name]
    engine = OffloadEngine(
        OffloadConfig(target="disk", save_dir=str(save_dir), min_offload_bytes=0),
        pool=InlineIOPool(),
    )
    try:
        packed = engine.pack(t)
        out = engine.unpack(packed)
    finally:
        engine.close()
    # Kept as a detached alias of t (NOTE [no cycles] in records.py): same everything.
    assert type(out) is type(t)
    assert (out.dtype, out.device, out.layout) == (t.dtype, t.device, t.layout)
    if not t.is_nested:
        assert out.shape == t.shape
    if t.layout == torch.strided and not t.is_nested and t.device.type != "meta":
        assert out.data_ptr() == t.data_ptr() and out.stride() == t.stride()
    assert engine.stats().tensors_kept == 1
    assert engine.stats().tensors_offloaded == 0


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_step_with_forward_mode_ad_trains_exactly(save_dir: Path) -> None:
    """Forward-mode AD saves memoryless zero tensors for backward (layer norm's): they
    stay in memory, and the tangent and gradients match training without offload."""
    import torch.autograd.forward_ad as fwad

    def step() -> tuple[torch.Tensor, ...]:
        torch.manual_seed(0)
        x = torch.randn(4, 8, 32)
        w = torch.ones(32, requires_grad=True)
        lin = torch.nn.Linear(32, 32)
        with fwad.dual_level():
            dual = fwad.make_dual(x, torch.ones_like(x))
            out = lin(torch.nn.functional.layer_norm(dual, (32,), w))
            primal, tangent = fwad.unpack_dual(out)
        primal.square().sum().backward()
        assert w.grad is not None and lin.weight.grad is not None
        return tangent, w.grad, lin.weight.grad

    ref = step()
    with offload_context("disk", str(save_dir), min_offload_bytes=0):
        got = step()
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def test_sparse_training_under_offload(save_dir: Path) -> None:
    """A model mixing sparse and dense ops trains with exact gradients."""
    torch.manual_seed(0)
    w = torch.randn(64, 32, requires_grad=True)
    a = torch.randn(128, 64).relu().to_sparse()

    def step() -> torch.Tensor:
        h = torch.sparse.mm(a, w)  # saves the sparse a (kept) ...
        return (h.tanh() * 2).sum()  # ... and dense h / tanh(h) (offloaded)

    step().backward()
    ref, w.grad = w.grad.clone(), None
    with offload_context("disk", save_dir, min_offload_bytes=0) as engine:
        step().backward()
    assert torch.equal(w.grad, ref)
    stats = engine.stats()
    assert stats.tensors_kept >= 1 and stats.tensors_offloaded + stats.writes_skipped >= 1


_CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    from prefetch_offload import offload_context
    x = torch.randn(1 << 20, requires_grad=True)
    with offload_context("disk", sys.argv[1], min_offload_bytes=0) as engine:
        ys = [(x * (i + 1)).sin() for i in range(16)]
        engine.flush()
        print("ready", flush=True)
        time.sleep(60)
    """
)


def test_sigkill_mid_step_leaves_nothing_and_the_folder_still_works(save_dir: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(save_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        before = os.statvfs(save_dir)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert os.listdir(save_dir) == []
    after = os.statvfs(save_dir)
    # 64 MiB of slab space came back with the process (allow for unrelated disk activity).
    assert (after.f_bavail - before.f_bavail) * after.f_frsize > 32 << 20
    x = torch.randn(1 << 16, requires_grad=True)
    with offload_context("disk", save_dir, min_offload_bytes=0) as engine:
        (x * 2).sin().sum().backward()
    stats = engine.stats()
    assert stats.tensors_offloaded + stats.writes_skipped == 1
    assert torch.equal(x.grad, 2 * (x.detach() * 2).cos())
