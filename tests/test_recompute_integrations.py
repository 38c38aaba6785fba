"""recompute= with what users run: the Hugging Face Trainer, DDP, FSDP2, regional compile.

Each compares parameters (or gradients) bit for bit with the same training without
offload or checkpointing.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from engine_helpers import on_two_processes
from torch.utils.checkpoint import CheckpointPolicy

from prefetch_offload import OffloadError, offload_context, recompute_planner, recompute_profile
from prefetch_offload import recompute as recompute_module
from prefetch_offload.testing import (
    TinyTransformer,
    make_batch,
    trainer_checkpointing,
    warm_up_unary_ops,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def matmuls_offloaded(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The common save list, with the saved outputs offloaded."""
    if op in _MATMULS:
        return CheckpointPolicy.PREFER_CPU_OFFLOAD
    return CheckpointPolicy.PREFER_RECOMPUTE


# -- Hugging Face Trainer ---------------------------------------------------------------------


def _trainer_run(tmp: Path, recompute: Any, *, hf_checkpointing: bool = False) -> tuple[list, list]:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp),
        per_device_train_batch_size=4,
        max_steps=len(recompute_profile.PROFILE) + 2,  # auto profiles, then plans
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **trainer_checkpointing(transformers, hf_checkpointing),
    )
    ids = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    if recompute is None:
        trainer.train()
    else:
        with offload_context(
            "disk", str(tmp / "acts"), model=model, recompute=recompute, min_offload_bytes=0
        ) as engine:
            trainer.train()
            plan = engine.recompute_plan()
            recomputed = engine.stats().step_bytes_recomputed
        # recompute="full" makes no plan; a policy's and auto's say what they recompute.
        assert recomputed > 0 and (plan is None) == (recompute == "full")
        assert plan is None or plan.bytes_recomputed > 0
        assert list((tmp / "acts").iterdir()) == []
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full", "auto", "policy"])
def test_trainer_with_recompute_is_bit_identical(
    tmp_path: Path, recompute: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "auto" plans checkpointed blocks here (offload alone might measure faster).
    monkeypatch.setattr(recompute_module, "OFFLOAD_ALONE", False)
    ref_losses, ref_params = _trainer_run(tmp_path / "a", None)
    mode = matmuls_offloaded if recompute == "policy" else recompute
    losses, params = _trainer_run(tmp_path / "b", mode)
    assert len(losses) == len(recompute_profile.PROFILE) + 2 and losses == ref_losses
    for a, b in zip(params, ref_params, strict=True):
        assert torch.equal(a, b)


def test_trainer_gradient_checkpointing_and_recompute_are_refused(tmp_path: Path) -> None:
    """NOTE [double checkpointing]: the Trainer switches its checkpointing on inside
    train(); the first block forward then says which of the two to drop."""
    with pytest.raises(OffloadError, match="Hugging Face gradient checkpointing"):
        _trainer_run(tmp_path, "full", hf_checkpointing=True)


def _small_llama(transformers: Any, *, width: int, heads: int) -> Any:
    """A seeded two-layer Llama with SDPA attention and the cache on (its default)."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("recompute", ["full", "auto"])
def test_a_cached_prompt_scored_with_grad_runs_its_blocks_whole(
    tmp_path: Path, recompute: str
) -> None:
    """NOTE [cached prompts]: a prefix cache filled without grad and passed to a forward
    with grad would get its keys appended again by a recompute (a shape error in
    backward); the blocks called with it run whole, and the gradients are exact."""
    transformers = pytest.importorskip("transformers")
    base = _small_llama(transformers, width=32, heads=2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    # transformers 5 names the argument ``cache``, earlier versions ``past_key_values``
    name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"

    def run(model: Any) -> list[torch.Tensor]:
        with torch.no_grad():
            cache = model(input_ids=ids[:, :8], use_cache=True).past_key_values
        model(input_ids=ids[:, 8:], labels=ids[:, 8:], **{name: cache}).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = run(copy.deepcopy(base))
    model = copy.deepcopy(base)
    with offload_context(
        "disk", str(tmp_path), model=model, recompute=recompute, min_offload_bytes=0
    ) as engine:
        got = run(model)
        recomputed = engine.stats().step_bytes_recomputed
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert recomputed == 0  # every block ran whole


@pytest.mark.parametrize("recompute", ["full", "policy"])
def test_a_kv_cache_is_off_in_forwards_with_grad_only(tmp_path: Path, recompute: str) -> None:
    """NOTE [kv cache]: with use_cache on, a recompute would append to the cache again;
    forwards with grad run without it and gradients match, while the config keeps the
    user's value: save_pretrained writes it, and a forward without grad fills a cache."""
    transformers = pytest.importorskip("transformers")
    model = _small_llama(transformers, width=64, heads=2)
    assert model.config.use_cache
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    mode = matmuls_offloaded if recompute == "policy" else recompute
    with offload_context("disk", str(tmp_path / "acts"), model=model, recompute=mode):
        assert model.config.use_cache
        out = model(input_ids=ids, labels=ids)
        assert not out.get("past_key_values", out.get("cache"))
        out.loss.backward()
        model.save_pretrained(tmp_path / "saved")
        with torch.no_grad():
            out = model(input_ids=ids)
        cache = out.get("past_key_values", out.get("cache"))
        assert cache is not None and cache.get_seq_length() == 32
    assert model.config.use_cache
    assert transformers.AutoConfig.from_pretrained(tmp_path / "saved").use_cache
    for a, p in zip(ref, model.parameters(), strict=True):
        assert torch.equal(a, p.grad)


def test_a_cache_asked_for_in_a_forward_with_grad_is_not_made(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [kv cache]: ``use_cache=True`` passed by the caller, with a padding mask: the
    forward makes no cache (a recompute would append to it, and backward's shapes would
    not match), says so once, leaves the config alone (a value the user writes during
    the forward stays), and the gradients match training with ``use_cache=False``."""
    transformers = pytest.importorskip("transformers")
    from prefetch_offload import kv_cache

    monkeypatch.setattr(kv_cache, "_warned", False)  # (said once a process)
    model = _small_llama(transformers, width=32, heads=4)
    config = model.config
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    seen: list[bool] = []
    model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(config.use_cache))
    with caplog.at_level("WARNING", logger="prefetch_offload"):
        with offload_context("disk", str(tmp_path), model=model, recompute="full"):
            out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=True)
            assert not out.get("past_key_values", out.get("cache"))
            out.loss.backward()
            model.config.use_cache = False  # the user's, between forwards
            model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=True)
    assert seen[0] is True  # the config untouched inside the forward
    assert model.config.use_cache is False
    assert len([r for r in caplog.records if "use_cache=True" in r.message]) == 1
    for a, p in zip(ref, model.parameters(), strict=True):
        assert torch.equal(a, p.grad)


@pytest.mark.parametrize("recompute", ["full", "auto"])
def test_packed_sequences_train_as_without_the_cache(tmp_path: Path, recompute: str) -> None:
    """NOTE [kv cache]: sequences packed into one row (``position_ids`` that restart, no
    mask), whose attention mask transformers 5 builds from the positions only where no
    cache is made: under recompute= the gradients are those of training with
    ``use_cache=False``, as under Hugging Face's own checkpointing (docs/guarantees.md,
    "Not promised", says where that differs from the default)."""
    transformers = pytest.importorskip("transformers")
    base = _small_llama(transformers, width=32, heads=2)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])

    def run(model: Any, steps: int) -> list[list[torch.Tensor]]:
        out = []
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids, position_ids=pos, use_cache=False).loss
            loss.backward()
            out.append([p.grad.clone() for p in model.parameters()])
        return out

    steps = len(recompute_profile.PROFILE) + 2 if recompute == "auto" else 2
    ref = run(copy.deepcopy(base), steps)
    model = copy.deepcopy(base)
    with offload_context("disk", str(tmp_path), model=model, recompute=recompute):
        got = []
        for _ in range(steps):  # the caller's default use_cache, which recompute turns off
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids, position_ids=pos).loss.backward()
            got.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(ref, got, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- regional torch.compile -------------------------------------------------------------------


def _why_compile_cannot_run() -> str | None:
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile (dynamo) is not supported on this Python/platform"
    if not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "g++", "c++")):
        return "torch.compile on CPU needs a C++ compiler"
    return None


@pytest.mark.slow
def test_blocks_compiled_one_by_one_under_every_recompute_mode(tmp_path: Path) -> None:
    """NOTE [compiled blocks]: "full" and a policy are traced by the compiler, and give
    what the same checkpoint compiled without the library gives (the compiler fuses a
    recompute otherwise than a forward: no checkpoint differs in rounding at some
    shapes, 8 tokens here); "auto" leaves compiled blocks to the engine, and gives what
    the compiled blocks give without the library. Bit-identical, all of them."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from prefetch_offload.blocks import WrappedBlocks, find_blocks
    from prefetch_offload.context import _saving_offloads

    reason = _why_compile_cannot_run()
    if reason:
        pytest.skip(reason)
    warm_up_unary_ops()
    torch.manual_seed(0)
    base = TinyTransformer(vocab=64, width=32, depth=2, heads=2)

    def run(model: torch.nn.Module, flush: Any = None) -> list[list[torch.Tensor]]:
        out = []
        for step in range(3):
            tokens, targets = make_batch(2, 8 + 8 * (step % 2), vocab=64, seed=step)
            model.zero_grad(set_to_none=True)
            loss = model(tokens, targets)
            if flush is not None:
                flush()
            loss.backward()
            out.append([p.grad.clone() for p in model.parameters()])
        return out

    def compiled() -> TinyTransformer:
        model = copy.deepcopy(base)
        for block in model.blocks:
            block.compile()
        return model

    def checkpointed(compiled_fn: Any) -> list[list[torch.Tensor]]:
        """The same blocks checkpointed as the compiler sees them, with no engine."""
        torch._dynamo.reset()
        model = compiled()
        wrapped = WrappedBlocks(find_blocks(model), None, compiled=compiled_fn)
        try:
            return run(model)
        finally:
            wrapped.restore()

    saving = functools.partial(
        create_selective_checkpoint_contexts, _saving_offloads(matmuls_offloaded)
    )
    refs = {"full": checkpointed(None), "policy": checkpointed(saving)}
    torch._dynamo.reset()
    refs["auto"] = run(compiled())
    for name, mode in (("full", "full"), ("policy", matmuls_offloaded), ("auto", "auto")):
        torch._dynamo.reset()
        model = compiled()
        with offload_context(
            "disk", str(tmp_path), model=model, recompute=mode, min_offload_bytes=0
        ) as engine:
            got = run(model, engine.flush)
            assert engine.stats().tensors_offloaded > 0, name
        assert all(
            torch.equal(a, b)
            for ga, gb in zip(refs[name], got, strict=True)
            for a, b in zip(ga, gb, strict=True)
        ), name


# -- DDP and FSDP2 (gloo, two ranks) ----------------------------------------------------------

_distributed = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def _dist_train(rank: int, wrap: str, recompute: str, save_dir: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model: torch.nn.Module = TinyTransformer(vocab=64, width=32, depth=3, heads=2)
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mode = matmuls_offloaded if recompute == "policy" else recompute
    ctx = (
        offload_context("disk", save_dir, model=model, recompute=mode, min_offload_bytes=0)
        if save_dir is not None
        else offload_context(None)
    )
    # auto profiles, then runs two planned steps; the others act from the first step.
    steps = len(recompute_profile.PROFILE) + 2 if recompute == "auto" else 3
    with ctx as engine:
        for step in range(steps):
            tokens, targets = make_batch(4, 16, vocab=64, seed=100 * rank + step)
            opt.zero_grad(set_to_none=True)
            loss = model(tokens, targets)
            engine.flush()
            loss.backward()
            opt.step()
    state = model.state_dict()
    full = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in state.items()}
    params = {k: v.detach().clone() for k, v in full.items()}
    if save_dir is None:
        return params
    stats = engine.stats()
    assert stats.step_bytes_recomputed > 0
    assert (stats.step_bytes_offloaded > 0) == (recompute == "policy")
    plan = engine.recompute_plan()
    if plan is None:  # recompute="full"
        return {"params": params, "choices": [], "agreeing": None}
    assert plan.plans_made == (1 if recompute == "auto" else 0) and plan.bytes_recomputed > 0
    # NOTE [ranks agree]: what each rank runs, to compare across ranks.
    choices = sorted((op.op, op.choice, op.reason) for op in plan.ops)
    return {"params": params, "choices": choices, "agreeing": plan.measured.get("ranks_agreeing")}


def _dist_rank(rank: int, wrap: str, recompute: str, save_dir: str, out: str) -> None:
    recompute_module.OFFLOAD_ALONE = False  # auto: checkpointed blocks on both ranks
    plain = _dist_train(rank, wrap, recompute, None)
    recomputed = _dist_train(rank, wrap, recompute, save_dir)
    torch.save({"plain": plain, **recomputed}, f"{out}.{rank}")


@_distributed
@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full", "policy", "auto"])
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_recompute_with_two_ranks_is_bit_identical(
    tmp_path: Path, wrap: str, recompute: str
) -> None:
    if wrap == "fsdp2":
        from torch.distributed import fsdp

        if not hasattr(fsdp, "fully_shard"):
            pytest.skip("needs torch.distributed.fsdp.fully_shard (FSDP2)")
    shared = tmp_path / "shared"
    shared.mkdir()
    out = tmp_path / "result.pt"
    on_two_processes(_dist_rank, wrap, recompute, str(shared), str(out))
    result, other = (torch.load(f"{out}.{rank}", weights_only=True) for rank in (0, 1))
    plain, recomputed = result["plain"], result["params"]
    # NOTE [ranks agree]: rank 1 runs rank 0's plan.
    assert result["choices"] == other["choices"]
    assert other["agreeing"] == (2.0 if recompute == "auto" else None)
    assert plain.keys() == recomputed.keys() and len(plain) > 0
    for k in plain:
        assert torch.equal(plain[k], recomputed[k]), k
    assert list(shared.iterdir()) == []


class _ParallelBlock(torch.nn.Module):
    """A block that runs a collective in its forward (and its backward), as a
    tensor-parallel block does: ranks must recompute it alike."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        h = all_reduce(self.up(x)) / dist.get_world_size()
        return x + self.down(torch.nn.functional.gelu(h))


def _collective_rank(rank: int, save_dir: str, out: str) -> None:
    warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)
    # Alone, rank 0 would checkpoint every block and rank 1 would run them whole: rank
    # 1's recomputes would meet no all-reduce on rank 0.
    recompute_module.OFFLOAD_ALONE = rank == 1
    if rank == 1:
        recompute_planner.leanest_of_the_fastest = lambda plans: "alone"  # type: ignore[assignment]
    results = {}
    for target in (None, "disk"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[_ParallelBlock(32) for _ in range(4)])
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        kwargs: dict[str, Any] = {"model": model, "recompute": "auto"} if target else {}
        with offload_context(target, save_dir, min_offload_bytes=0, **kwargs) as engine:
            for step in range(len(recompute_profile.PROFILE) + 4):
                x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
                opt.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
                opt.step()
        results[str(target)] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if target:
            plan = engine.recompute_plan()
            assert plan is not None
            blocks = ("blocks_whole", "blocks_plain", "blocks_selective")
            results["modes"] = {k: plan.measured[k] for k in blocks}  # type: ignore[misc]
    torch.save(results, f"{out}.{rank}")


@_distributed
@pytest.mark.slow
def test_blocks_that_run_collectives_are_recomputed_alike_on_every_rank(tmp_path: Path) -> None:
    """NOTE [ranks agree]: rank 1 runs rank 0's plan (checkpointed blocks, plain or
    selective); every all-reduce meets its pair and the parameters match training
    without offload, bit for bit."""
    shared = tmp_path / "shared"
    shared.mkdir()
    out = tmp_path / "result.pt"
    on_two_processes(_collective_rank, str(shared), str(out))
    got = [torch.load(f"{out}.{rank}", weights_only=True) for rank in (0, 1)]
    assert got[0]["modes"] == got[1]["modes"] and got[0]["modes"]["blocks_whole"] == 0
    for rank in (0, 1):
        for k, v in got[rank]["None"].items():
            assert torch.equal(v, got[rank]["disk"][k]), (rank, k)
