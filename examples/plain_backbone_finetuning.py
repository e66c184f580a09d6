"""Plain Lightning fine-tuning with ``BackboneFinetuning``, re-tuning the batch size at the unfreeze.

``BackboneFinetuning`` freezes ``model.backbone`` when fit starts and unfreezes it at
``--unfreeze-at``. From then on a step also needs the backbone's gradients, its Adam state and the
activations its backward pass keeps, so the batch size that fit while it was frozen no longer
does. retune's ``ScheduledBatchSizeFinder`` with ``schedules/freeze_unfreeze.yaml`` searches when
fit starts and again when the number of trainable parameters changes::

    python examples/plain_backbone_finetuning.py                   # CPU, 2 MiB budget
    python examples/plain_backbone_finetuning.py --budget none --accelerator gpu   # real OOM on a GPU

What the model needs for retune is what Lightning's ``BatchSizeFinder`` needs: the batch size in
an attribute (``self.batch_size``) that ``train_dataloader()`` reads. A CPU has no fixed memory to
run out of, so on CPU the example sets the schedule's ``memory.budget`` (``--budget``): retune
measures each probe's peak tensor memory and a size "fits" when that stays under the budget. On a
GPU use ``--budget none`` to search up to the real device limit.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import RetuneEvent, ScheduledBatchSizeFinder, load_schedule
from retune.reports import batch_size as report

SCHEDULE = Path(__file__).resolve().parent.parent / "schedules" / "freeze_unfreeze.yaml"


def make_data(n: int, seed: int) -> TensorDataset:
    """A 10-class problem labelled by a fixed random linear teacher: learnable and free to generate."""
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1234))
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


class Classifier(pl.LightningModule):
    """``backbone`` (what BackboneFinetuning freezes) + ``head``; the batch size lives in ``batch_size``."""

    def __init__(self, n_train: int = 4096, batch_size: int = 16, hidden: int = 128, lr: float = 3e-3) -> None:
        super().__init__()
        self.batch_size = batch_size  # retune writes the size it finds here
        self.lr = lr
        self.backbone = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 10)
        self.train_set = make_data(n_train, seed=0)
        self.val_set = make_data(max(256, n_train // 4), seed=1)

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

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=512)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # only what is trainable now (the head); BackboneFinetuning adds the backbone when it unfreezes it
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)


@dataclass
class Result:
    history: list[RetuneEvent]
    batch_size: int | None
    val_acc: float
    outputs: report.OutputPaths


def main(argv: Sequence[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--unfreeze-at", type=int, default=2, help="epoch BackboneFinetuning unfreezes at (from 0)")
    parser.add_argument("--samples", type=int, default=4096, help="training samples")
    parser.add_argument("--budget", default="2MiB", help="memory.budget for the schedule, or 'none' (GPU)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--out", default="retune-example", help="where the history, CSV and plot go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no per-trial lines")
    args = parser.parse_args(argv)

    pl.seed_everything(args.seed, verbose=False)
    # The ready-made schedule, with this run's budget: any schedule file works, and so does a dict.
    schedule = load_schedule(SCHEDULE).model_dump(mode="json")
    schedule["memory"]["budget"] = None if args.budget.lower() == "none" else args.budget
    finder = ScheduledBatchSizeFinder(schedule, verbose=not args.quiet)

    model = Classifier(n_train=args.samples)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator=args.accelerator,
        devices=1,
        # the finder puts itself after BackboneFinetuning whatever the order, so it sees the unfreeze
        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=args.unfreeze_at), finder],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not args.quiet,
    )
    trainer.fit(model)

    outputs = report.write_outputs(finder.history, args.out, end_step=trainer.global_step)
    print(report.format_table(finder.history))
    val_acc = float(trainer.callback_metrics["val_acc"])
    print(f"val accuracy {val_acc:.3f}; history, CSV and plot in {args.out}/")
    return Result(list(finder.history), finder.batch_size, val_acc, outputs)


if __name__ == "__main__":
    main()
