"""A user's training script, as a new user writes it: no logging configured, ``python train.py``.

Run by tests/callbacks/test_messages.py in a subprocess (its output captured whole, Python's warning filters
at their defaults), once per scenario:

  plain    verbose=True
  quiet    verbose=False (warnings must still show)
  logging  logging.basicConfig(level=INFO) first (the user configured logging)
  ddp      verbose=True under DDP on 2 CPU processes (only rank zero prints)

The model provokes two retune warnings: its batch size is set both on the model and in its saved
hyperparameters, and the schedule lists ``val`` while validation shares the train attribute. Its
``training_step`` takes no ``batch_idx`` (issue 20), which also runs the DDP probe path.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from tests.helpers.dist_utils import leave_rank
from tests.helpers.lightning_ns import pl


class Model(pl.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"batch_size": 4})
        self.batch_size = 4
        self.net = nn.Linear(4, 1)
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        if x.shape[0] > 16:
            raise torch.OutOfMemoryError("CUDA out of memory (test oracle)")
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    scenario = sys.argv[1]
    if scenario == "logging":
        logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    schedule = {
        "search": {"mode": "binsearch", "margin": 0.0, "steps_per_trial": 1, "init_val": 8},
        "triggers": [{"kind": "fit_start"}],
        "stages": ["train", "val"],
    }
    finder = ScheduledBatchSizeFinder(schedule, verbose=scenario != "quiet", write_report=False)
    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        accelerator="cpu",
        devices=2 if scenario == "ddp" else 1,
        **({"strategy": "ddp"} if scenario == "ddp" else {}),
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model())
    if trainer.global_rank == 0:
        print(f"RESULT batch_size={finder.batch_size}", flush=True)


if __name__ == "__main__":
    main()
    leave_rank()
