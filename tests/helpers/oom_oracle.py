"""A text model that runs out of memory the way a GPU does, on CPU: by padded token count.

No real OOM can happen in CI, so the model raises the real error type, ``torch.OutOfMemoryError``,
when a batch's padded token count (``batch * longest``) exceeds ``capacity`` — in forward, or (the
``where="backward"`` variant) in the backward pass, after some parameters already received their
gradient, as a real backward OOM leaves them. Every sample whose gradient was computed is counted
in ``trained``, so tests can check that each sample trained exactly once.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.helpers.lightning_ns import pl


class TokenData(Dataset[dict[str, Any]]):
    """Variable-length token sequences; a few are 8x longer than the rest (like real text corpora)."""

    def __init__(self, n: int = 96, seed: int = 0, vocab: int = 50) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, 12, (n,), generator=g)
        lengths[torch.randperm(n, generator=g)[: max(1, n // 16)]] *= 8
        self.items = [
            {"ids": torch.randint(1, vocab, (int(length),), generator=g), "index": i, "label": i % 3}
            for i, length in enumerate(lengths)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def pad_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    longest = max(len(s["ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s["ids"])] = s["ids"]
    return {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "labels": torch.tensor([s["label"] for s in samples]),
        "index": torch.tensor([s["index"] for s in samples]),
    }


class FailInBackward(torch.autograd.Function):
    """Identity in forward; raises the real OOM in backward when told to (a backward that runs out of memory)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fail: bool, message: str = "oracle") -> torch.Tensor:  # type: ignore[override]
        ctx.fail, ctx.message = fail, message
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        if ctx.fail:
            raise torch.OutOfMemoryError(f"CUDA out of memory ({ctx.message})")
        return grad, None, None


class TokenModel(pl.LightningModule):
    """Embedding -> encoder layer (the "backbone") -> mean pool -> head.

    In backward, the head's gradient is accumulated before the oracle raises between head and
    encoder, so a backward OOM leaves the head holding its complete gradient and the encoder none.
    """

    def __init__(
        self,
        batch_size: int = 16,
        capacity: int | None = None,
        where: str = "forward",
        n: int = 96,
        lr: float = 0.05,
        optimizer: str = "sgd",
        shuffle: bool = False,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.capacity = capacity
        self.where = where
        self.lr = lr
        self.optimizer_name = optimizer
        self.shuffle = shuffle
        self.data = TokenData(n)
        self.embed = nn.Embedding(50, 16)
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 3)
        self.trained: Counter[int] = Counter()
        self.ooms = 0
        self.batch_sizes: list[int] = []
        self.predicted: list[torch.Tensor] = []

    def _tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["input_ids"].numel())

    def _check(self, batch: dict[str, torch.Tensor]) -> None:
        if self.capacity is not None and self._tokens(batch) > self.capacity:
            self.ooms += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle: {self._tokens(batch)} > {self.capacity})")

    def forward(self, batch: dict[str, torch.Tensor], count: bool = False) -> torch.Tensor:
        mask = batch["attention_mask"].unsqueeze(-1).float()
        hidden = self.encoder(self.embed(batch["input_ids"]))
        if count and hidden.requires_grad:
            index = batch["index"].tolist()
            # counted when the encoder's gradient is computed: past the point where a backward OOM fails
            hidden.register_hook(lambda grad: self.trained.update(index))
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        if self.where == "backward" and self.capacity is not None and torch.is_grad_enabled():
            tokens = self._tokens(batch)
            pooled = FailInBackward.apply(pooled, tokens > self.capacity, f"oracle: {tokens} > {self.capacity}")
        return self.head(pooled)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.where == "forward":
            self._check(batch)
        loss = F.cross_entropy(self(batch, count=True), batch["labels"])
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(batch["labels"]))
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.batch_sizes.append(int(batch["labels"].shape[0]))

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._check(batch)
        loss = F.cross_entropy(self(batch), batch["labels"])
        self.log("val_loss", loss, batch_size=len(batch["labels"]))

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> Any:
        self._check(batch)
        return {"logits": self(batch), "index": batch["index"]}

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=self.shuffle, collate_fn=pad_collate)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, collate_fn=pad_collate)

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, collate_fn=pad_collate)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
