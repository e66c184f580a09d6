"""Sharded fine-tuning with FSDP2 (Lightning's ``ModelParallelStrategy``), re-tuning at the unfreeze.

The model is sharded in ``configure_model`` with ``fully_shard``: each Linear, then the root. Every
rank holds one shard of each parameter, of its gradient and of Adam's moments. ``BackboneFinetuning``
unfreezes the backbone at ``--unfreeze-at``; retune searches the batch size when fit starts and again
after the unfreeze, every rank running the same probes on its own shards, and all ranks agree on the
size. Runs on CPU with 2 processes (gloo)::

    python examples/fsdp2_finetune.py                               # 2 CPU processes, 4 MiB budget
    python examples/fsdp2_finetune.py --accelerator gpu --devices 4 --budget none   # real OOM on GPUs

On CPU there is no device memory to run out of, so the schedule's ``memory.budget`` bounds each
probe's measured peak (per rank). ``--budget none`` on GPUs searches up to each GPU's real limit.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder, load_schedule

SCHEDULE = Path(__file__).resolve().parent.parent / "schedules" / "freeze_unfreeze.yaml"


def make_data(n: int, seed: int) -> TensorDataset:
    """A 10-class problem labelled by a fixed random linear teacher: learnable and free to generate."""
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1234))
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


class ShardedClassifier(pl.LightningModule):
    """``backbone`` + ``head``, sharded with FSDP2; the per-rank batch size lives in ``batch_size``."""

    def __init__(self, n_train: int = 4096, batch_size: int = 16, hidden: int = 256, lr: float = 3e-3) -> None:
        super().__init__()
        self.batch_size = batch_size  # retune writes the size it finds here (per rank, as Lightning's)
        self.lr = lr
        self.backbone = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 10)
        self.train_set = make_data(n_train, seed=0)
        self.val_set = make_data(512, seed=1)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.backbone[0], self.backbone[2], self.head):
            fully_shard(layer, mesh=mesh)
        # resharded after forward: validation must not leave the root's parameters unsharded, or
        # BackboneFinetuning would compare unsharded tensors with the optimizer's sharded ones
        fully_shard(self, mesh=mesh, reshard_after_forward=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(x), sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        acc = (self(x).argmax(dim=1) == y).float().mean()
        self.log("val_acc", acc, batch_size=len(x), sync_dist=True)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=256)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # only the head; BackboneFinetuning adds the (sharded) backbone when it unfreezes it
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def main(argv: Sequence[str] | None = None) -> ScheduledBatchSizeFinder:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--unfreeze-at", type=int, default=1)
    parser.add_argument("--budget", default="4MiB", help="memory.budget per rank ('none' on GPUs)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--n-train", type=int, default=4096)
    parser.add_argument("--out", default="lightning_logs_fsdp2")
    parser.add_argument(
        "--predict", action="store_true", help="search.predict: auto (trace each rank's step, then verify)"
    )
    args = parser.parse_args(argv)

    pl.seed_everything(0)
    schedule = load_schedule(SCHEDULE).model_copy(deep=True)
    if args.budget != "none":
        schedule = schedule.model_copy(update={"memory": schedule.memory.model_copy(update={"budget": args.budget})})
    if args.predict:
        schedule = schedule.model_copy(update={"search": schedule.search.model_copy(update={"predict": "auto"})})
    finder = ScheduledBatchSizeFinder(schedule)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        # FSDP2 over every device; tensor parallelism is not supported by retune (it refuses it at setup)
        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
        max_epochs=args.epochs,
        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=args.unfreeze_at), finder],
        default_root_dir=args.out,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ShardedClassifier(n_train=args.n_train))
    if trainer.is_global_zero:
        for event in finder.history:
            how = f", {len(event.trials)} real probes" + (f", {event.prediction}" if event.prediction else "")
            print(f"epoch {event.epoch}: {event.trigger} -> batch size {event.batch_size_after} per rank{how}")
    # Lightning leaves the process group alive after fit; without this, gloo's worker threads are torn
    # down at interpreter exit, which can abort ("terminate called without an active exception",
    # pytorch/pytorch#190489) after the run has finished
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return finder


if __name__ == "__main__":
    main()
