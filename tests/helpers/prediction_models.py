"""Small models for the memory-prediction tests and benchmark, each with a batch maker.

Every scenario is a LightningModule whose ``training_step`` calls its network on a batch made by
``make_batch(size)`` and logs its loss (as real steps do: the trace must get through ``self.log``).
The Hugging Face ones are built from configs with random weights: nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.lightning_ns import pl

BatchMaker = Callable[[int], Any]


class PredictionModel(pl.LightningModule):
    """``net`` trained with AdamW on batches from ``make_batch``; ``loss_of(net, batch)`` is the loss."""

    def __init__(self, net: nn.Module, make_batch: BatchMaker, loss_of: Callable[[nn.Module, Any], torch.Tensor]):
        super().__init__()
        self.net = net
        self.make_batch = make_batch
        self.loss_of = loss_of

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss_of(self.net, batch)
        self.log("loss", loss)
        return loss

    def train_dataloader(self) -> DataLoader[Any]:
        batch = self.make_batch(4)
        if isinstance(batch, dict):
            samples: list[Any] = [{key: value[i] for key, value in batch.items()} for i in range(4)]
        else:
            samples = [tuple(value[i] for value in batch) for i in range(4)]
        return DataLoader(samples, batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _classify(net: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(net(batch[0]), batch[1])


def _hf(net: nn.Module, batch: Any) -> torch.Tensor:
    return net(**batch).loss  # type: ignore[no-any-return]


def mlp() -> PredictionModel:
    """Linear-ReLU-BatchNorm-Dropout-Linear: buffers written by the step, random dropout masks."""
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.BatchNorm1d(256), nn.Dropout(0.1), nn.Linear(256, 10))
    return PredictionModel(net, lambda n: (torch.randn(n, 64), torch.randint(0, 10, (n,))), _classify)


def cnn() -> PredictionModel:
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    return PredictionModel(net, lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))), _classify)


def bert(seq: int = 64) -> PredictionModel:
    """A 2-layer BERT (hidden 64) classifying token sequences, with an attention mask."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
    )

    def make(n: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.randint(0, 1000, (n, seq)),
            "attention_mask": torch.ones(n, seq, dtype=torch.long),
            "labels": torch.randint(0, 2, (n,)),
        }

    return PredictionModel(BertForSequenceClassification(config), make, _hf)


def gpt2_lora(seq: int = 64) -> PredictionModel:
    """A 2-layer GPT-2 (embedding 64) language model with LoRA adapters (peft) on its attention."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    net = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=2, n_positions=128))
    lora = get_peft_model(net, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))

    def make(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 1000, (n, seq))
        return {"input_ids": ids, "labels": ids}

    return PredictionModel(lora, make, _hf)


SCENARIOS: dict[str, Callable[[], PredictionModel]] = {"mlp": mlp, "cnn": cnn, "bert": bert, "gpt2_lora": gpt2_lora}
"""Every scenario of the tests and the benchmark; ``bert`` and ``gpt2_lora`` need transformers (and peft)."""


def at_train_start(model: pl.LightningModule, work: Callable[[Any, Any], None]) -> None:
    """Fit ``model`` for one step on CPU and run ``work(trainer, model)`` at ``on_train_start``, where
    the trainer's strategy, optimizers and hooks are set up as during a search."""

    class Run(pl.Callback):  # type: ignore[misc,name-defined]
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            work(trainer, pl_module)

    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=1,
        callbacks=[Run()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(model)
