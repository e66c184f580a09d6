"""LightningCLI: ``ScheduledBatchSizeFinder`` and its schedule file set from a YAML config.

The callback is an ordinary ``trainer.callbacks`` entry; ``init_args.schedule`` is the path of a
schedule file (relative to where you run the command)::

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml --trainer.max_epochs=2

See ``examples/lightning_cli.yaml``. The model and datamodule here are minimal: what matters for
retune is that the batch size lives in an attribute (here the datamodule's ``batch_size``) that
``train_dataloader()`` reads, exactly as for Lightning's ``BatchSizeFinder``.

Needs LightningCLI's parser: ``pip install "jsonargparse[signatures]>=4.39"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TeacherData(pl.LightningDataModule):
    """Random inputs labelled by a fixed random linear teacher (10 classes): free and learnable."""

    def __init__(self, batch_size: int = 16, samples: int = 2048, features: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size  # retune finds it here (Lightning's lookup: model, then datamodule)
        self.samples = samples
        self.features = features

    def setup(self, stage: str) -> None:
        teacher = torch.randn(self.features, 10, generator=torch.Generator().manual_seed(1234))
        x = torch.randn(self.samples, self.features, generator=torch.Generator().manual_seed(0))
        v = torch.randn(max(256, self.samples // 4), self.features, generator=torch.Generator().manual_seed(1))
        self.train_set = TensorDataset(x, (x @ teacher).argmax(dim=1))
        self.val_set = TensorDataset(v, (v @ teacher).argmax(dim=1))

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=512)


class Classifier(pl.LightningModule):
    """``backbone`` (frozen and unfrozen by BackboneFinetuning) + ``head``."""

    def __init__(self, features: int = 32, hidden: int = 128, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.backbone = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(x))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self(x).argmax(dim=1) == y).float().mean(), batch_size=len(x))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # BackboneFinetuning adds the backbone to the optimizer when it unfreezes it
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def cli_main(args: Sequence[str] | None = None) -> LightningCLI:
    """Run the CLI; ``args`` replaces the command line (tests pass a list).

    ``overwrite``: LightningCLI saves the resolved config (``config.yaml``) into the run's folder and,
    by default, refuses to run again over it; an example should run twice in a row.
    """
    return LightningCLI(
        Classifier,
        TeacherData,
        args=None if args is None else list(args),
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    cli_main()
