"""A model whose training step runs out of memory the way a GPU would, on CPU.

No real OOM can happen in CI (no GPU; the CPU has plenty of RAM for these tiny models), so the
model consults a memory oracle at every training step and raises the real error type,
``torch.OutOfMemoryError``, when the modelled memory exceeds ``capacity``. The model is:

    memory(batch) = batch * (per_sample + per_sample_trainable * trainable_fraction)
                    + state_per_param * trainable_params

so unfreezing the backbone raises both the per-sample cost (activations kept for backward) and
the fixed cost (gradients and optimizer state), and the true maximum of each phase is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.lightning_ns import pl


@dataclass(frozen=True)
class MemoryOracle:
    capacity: int = 2_000_000
    per_sample: int = 1_000
    per_sample_trainable: int = 20_000
    state_per_param: int = 50

    def cost(self, batch_size: int, trainable: int, total: int) -> int:
        per_sample = self.per_sample + self.per_sample_trainable * trainable / total
        return math.ceil(batch_size * per_sample + self.state_per_param * trainable)

    def true_max(self, trainable: int, total: int) -> int:
        per_sample = self.per_sample + self.per_sample_trainable * trainable / total
        return math.floor((self.capacity - self.state_per_param * trainable) / per_sample)

    def check(self, batch_size: int, module: nn.Module) -> None:
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        total = sum(p.numel() for p in module.parameters())
        needed = self.cost(batch_size, trainable, total)
        if needed > self.capacity:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {needed - self.capacity} bytes "
                f"(oracle: batch {batch_size}, capacity {self.capacity})"
            )


def make_data(n: int = 2048, dim: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x @ w).argmax(dim=1)
    return TensorDataset(x, y)


class FineTuneModel(pl.LightningModule):
    """A backbone + head classifier with ``self.batch_size`` and a memory oracle."""

    def __init__(
        self,
        batch_size: int = 8,
        oracle: MemoryOracle | None = None,
        optimizer: str = "sgd",
        scheduler: str | None = None,
        n: int = 2048,
        shuffle: bool = True,
        freeze_backbone: bool = False,
        head_only_optimizer: bool = False,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.oracle = oracle or MemoryOracle()
        self.optimizer_name = optimizer
        self.scheduler_name = scheduler
        self.shuffle = shuffle
        self.head_only_optimizer = head_only_optimizer
        self.dataset = make_data(n)
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)
        if freeze_backbone:
            for p in self.backbone.parameters():
                p.requires_grad = False
        self.train_batch_sizes: list[int] = []
        self.epoch_true_max: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.oracle.check(x.shape[0], self)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def on_train_epoch_start(self) -> None:
        # runs after every callback's on_train_epoch_start, so it sees this epoch's frozen/unfrozen state
        self.epoch_true_max.append(self.true_max_now())

    def true_max_now(self) -> int:
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        return self.oracle.true_max(trainable, sum(p.numel() for p in self.parameters()))

    def on_train_batch_start(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.train_batch_sizes.append(int(batch[0].shape[0]))

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("val_loss", loss)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=256)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        # BackboneFinetuning adds the backbone to the optimizer itself when it unfreezes
        source = self.head.parameters() if self.head_only_optimizer else self.parameters()
        params = [p for p in source if p.requires_grad]
        if self.optimizer_name == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        else:
            opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        if self.scheduler_name is None:
            return opt
        if self.scheduler_name == "step":
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "train_loss_epoch"}}

    def phase_max(self, backbone_trainable: bool) -> int:
        head = sum(p.numel() for p in self.head.parameters())
        total = sum(p.numel() for p in self.parameters())
        trainable = total if backbone_trainable else head
        return self.oracle.true_max(trainable, total)
