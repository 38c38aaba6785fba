"""Hugging Face Trainer with activations offloaded to disk.

Run: pip install -e '.[hf]' && python examples/hf_trainer.py
A tiny Llama is built from a config (no download) and trained on random tokens.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from prefetch_offload import offload_context


class RandomTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 64, seq: int = 128, vocab: int = 1024) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=8,
        max_steps=10,
        logging_steps=2,
        report_to=[],
        save_strategy="no",
        # The Trainer's own checkpointing works too: activation_checkpointing=True
        # (transformers 5; gradient_checkpointing=True before).
    )
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    with offload_context("disk", save_dir=tempfile.mkdtemp(), prefetch_depth=4) as engine:
        trainer.train()
    print(engine.stats())


if __name__ == "__main__":
    main()
