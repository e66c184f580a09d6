"""Token-level fine-tunes for the ``oom`` trigger's exactness tests: token-mean losses with ignored labels.

Tasks: ``torch`` (an embedding + per-token head with ``F.cross_entropy(..., ignore_index=-100)``, no
transformers needed, so it runs on both Lightning lines), and with transformers: ``token`` (BERT token
classification), ``mlm`` (BERT masked LM, where a sequence may have no masked token at all) and
``causal`` (GPT-2 causal LM, whose loss is shifted). The HF models are tiny, built from configs with
dropout 0; nothing is downloaded.

The oracle raises the real ``torch.OutOfMemoryError`` when a batch's padded token count exceeds
``capacity``: at the start of ``training_step`` (``where="forward"``) or in backward, through the
logits (``where="backward"``). Each run records what a user's callbacks see: the step outputs'
logits rows, the step-level logged loss, the learning rate (a ``ReduceLROnPlateau`` on
``train_loss_step`` with ``interval: step``) and the samples each step trained.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.lightning_ns import pl
from tests.helpers.oom_oracle import FailInBackward

VOCAB, CLASSES = 40, 5


def token_samples(task: str, n: int = 30, seed: int = 0) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        length = int(torch.randint(3, 14, (), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g)
        if task in ("torch", "token"):
            labels = torch.randint(0, CLASSES, (length,), generator=g)
            labels[torch.rand(length, generator=g) < 0.3] = -100  # sub-word pieces, special tokens
        elif task == "mlm":
            masked = torch.rand(length, generator=g) < 0.25  # some sequences mask nothing: 0 items
            labels = torch.where(masked, ids, torch.full_like(ids, -100))
            ids = torch.where(masked, torch.full_like(ids, VOCAB - 1), ids)
        else:  # causal
            labels = ids.clone()
        samples.append({"ids": ids, "labels": labels, "index": i})
    return samples


def labelled_tokens(batch: dict[str, torch.Tensor]) -> int:
    """A user's own count for ``loss_items`` (given by dotted path in a test): the labelled tokens."""
    return int((batch["labels"] != -100).sum())


def collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    longest = max(len(s["ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s["ids"])] = s["ids"]
        labels[row, : len(s["labels"])] = s["labels"]
    return {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "labels": labels,
        "index": torch.tensor([s["index"] for s in samples]),
    }


class TorchTagger(nn.Module):
    """A token tagger in plain torch whose loss is a mean over the labelled tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.head = nn.Linear(32, CLASSES)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.head(self.body(self.embed(input_ids)))
        loss = F.cross_entropy(logits.reshape(-1, CLASSES), labels.reshape(-1), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def build_model(task: str) -> nn.Module:
    if task == "torch":
        return TorchTagger()
    import transformers

    if task == "causal":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
        return transformers.GPT2LMHeadModel(config)
    bert = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=CLASSES,
    )
    if task == "mlm":
        return transformers.BertForMaskedLM(bert)
    return transformers.BertForTokenClassification(bert)


class TokenTask(pl.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(
        self,
        task: str,
        capacity: int | None = None,
        where: str = "forward",
        batch_size: int = 8,
        sync_dist: bool = False,
    ) -> None:
        super().__init__()
        self.sync_dist = sync_dist
        self.task = task
        self.capacity = capacity
        self.where = where
        self.batch_size = batch_size
        self.samples = token_samples(task)
        torch.manual_seed(0)
        self.model = build_model(task)
        self.trained: Counter[int] = Counter()
        self.step_losses: list[float] = []
        self.lrs: list[float] = []
        self.output_rows: list[tuple[int, int]] = []
        self.ooms = 0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        too_big = self.capacity is not None and batch["input_ids"].numel() > self.capacity
        if too_big and self.where == "forward":
            self.ooms += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle: {batch['input_ids'].numel()} tokens)")
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        out = self.model(**inputs)
        if self.where == "backward" and too_big:
            out["loss"] = FailInBackward.apply(out["loss"], True)
        self.log("train_loss", out["loss"], on_step=True, on_epoch=True, prog_bar=True, sync_dist=self.sync_dist)
        if not too_big and torch.is_grad_enabled():  # the oom trigger's fit-start check runs forwards without
            self.trained.update(batch["index"].tolist())  # gradients (retune/recovery/exactness.py): nothing trains
        return out  # a ModelOutput for the HF tasks, a dict for torch

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.output_rows.append((int(outputs["logits"].shape[0]), int(batch["input_ids"].shape[0])))
        self.step_losses.append(float(self.trainer.callback_metrics["train_loss_step"]))
        self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.samples, batch_size=self.batch_size, collate_fn=collate)  # type: ignore[arg-type]

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.0)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss_step", "interval": "step"},
        }
