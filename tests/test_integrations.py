"""Hugging Face Trainer end to end on a tiny Llama built from a config (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from prefetch_offload import offload_context  # noqa: E402
from prefetch_offload.testing import trainer_checkpointing  # noqa: E402


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Synthetic token ids: the labels are the inputs (causal LM)."""

    def __init__(self, n: int = 16, seq: int = 32, vocab: int = 128) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp: Path, *, save_dir: Path | None, checkpointing: bool) -> tuple[list, list]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp),
        per_device_train_batch_size=4,
        max_steps=4,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        **trainer_checkpointing(transformers, checkpointing),
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens())
    if save_dir is None:
        trainer.train()
    else:
        with offload_context(
            "disk", str(save_dir), min_offload_bytes=0, chunk_bytes=1 << 14
        ) as engine:
            compute_loss = trainer.compute_loss

            def flush_first_step(*args: Any, **kwargs: Any) -> Any:
                out = compute_loss(*args, **kwargs)
                if trainer.state.global_step == 0:
                    # The first step's writes land before its backward (NOTE [write tail]
                    # could drop them all on a loaded machine): reads are exercised. The
                    # other steps overlap as they would in training.
                    engine.flush()
                return out

            trainer.compute_loss = flush_first_step  # runs between forward and backward
            trainer.train()
        stats = engine.stats()
        assert stats.tensors_offloaded > 0 and stats.bytes_read > 0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_trainer_losses_identical_with_disk_offload(tmp_path: Path, checkpointing: bool) -> None:
    save_dir = tmp_path / "acts"
    ref_losses, ref_params = _train(tmp_path / "a", save_dir=None, checkpointing=checkpointing)
    losses, params = _train(tmp_path / "b", save_dir=save_dir, checkpointing=checkpointing)
    assert len(losses) == 4
    assert losses == ref_losses
    for a, b in zip(params, ref_params, strict=True):
        assert torch.equal(a, b)
    assert list(save_dir.iterdir()) == []
