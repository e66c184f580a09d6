"""Fine-tune with finetuning-scheduler and re-tune the batch size at every phase transition.

finetuning-scheduler's ``FinetuningScheduler`` (FTS) thaws a model phase by phase, following a
schedule file (``examples/fts_schedule.yaml``): the head first, then the last backbone layer, then
the whole backbone. Each phase trains more parameters, so a step needs more memory: gradients and
optimizer state for the new parameters, and activations kept for their backward pass. retune's
``ScheduledBatchSizeFinder`` with ``schedules/fts_phases.yaml`` (triggers ``fit_start`` and
``fts_phase``) searches the largest batch size that fits when fit starts and again at every phase
transition, after FTS has restored its best checkpoint and thawed the next phase::

    python examples/fts_finetune.py                    # CPU, simulated 2 MiB device: ~15 s, half of it imports
    python examples/fts_finetune.py --memory-mib 0 --accelerator gpu   # real OOM errors on a GPU

A CPU has no fixed memory to run out of, so by default the model simulates a small device: its
training step raises the real ``torch.OutOfMemoryError`` when an estimate of the step's memory
exceeds ``--memory-mib`` (weights; the gradient and momentum of every trainable weight; per sample,
the activations kept for backward from the first trainable layer on). ``--memory-mib 0`` turns the
simulation off, for a real device whose own allocator raises the error.

Needs ``pip install finetuning-scheduler`` (which builds on ``lightning``).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from finetuning_scheduler import FinetuningScheduler, FTSCheckpoint, FTSEarlyStopping
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder

HERE = Path(__file__).resolve().parent
FTS_SCHEDULE = HERE / "fts_schedule.yaml"
RETUNE_SCHEDULE = HERE.parent / "schedules" / "fts_phases.yaml"


def make_data(n: int, seed: int) -> TensorDataset:
    """A 10-class problem with a random linear teacher: learnable, and free to generate."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1234))
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


class Classifier(pl.LightningModule):
    """A backbone + head classifier that keeps its train batch size in ``self.batch_size``."""

    def __init__(self, batch_size: int = 16, memory_mib: float = 2.0, n_train: int = 2048) -> None:
        super().__init__()
        self.batch_size = batch_size  # retune writes the size it finds here
        self.memory_bytes = int(memory_mib * 2**20)
        self.backbone = nn.Sequential(
            nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU()
        )
        self.head = nn.Linear(256, 10)
        self.train_set = make_data(n_train, seed=0)
        self.val_set = make_data(1024, seed=1)
        self.epoch_max: list[int] = []  # the simulated device's true maximum, per epoch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    # -- the simulated device ------------------------------------------------------------------

    def _simulated_cost(self) -> tuple[int, int]:
        """(fixed bytes, bytes per sample) of one training step with the current trainable set."""
        layers = [*self.backbone, self.head]
        total = sum(p.numel() for p in self.parameters())
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        fixed = 4 * (total + 2 * trainable)  # fp32 weights, plus gradient and SGD momentum when trainable
        first = next(i for i, m in enumerate(layers) if any(p.requires_grad for p in m.parameters()))
        # every layer from the first trainable one on keeps its input (256 floats here) for backward
        kept = sum(m.in_features if isinstance(m, nn.Linear) else 256 for m in layers[first:])
        return fixed, 4 * kept

    def simulated_max(self) -> int:
        fixed, per_sample = self._simulated_cost()
        return (self.memory_bytes - fixed) // per_sample

    def _check_memory(self, batch_size: int) -> None:
        if self.memory_bytes <= 0:
            return  # a real device: its allocator raises the out-of-memory error itself
        fixed, per_sample = self._simulated_cost()
        needed = fixed + batch_size * per_sample
        if needed > self.memory_bytes:
            raise torch.OutOfMemoryError(
                f"simulated device out of memory: batch {batch_size} needs {needed} bytes of {self.memory_bytes}"
            )

    # -- Lightning hooks -----------------------------------------------------------------------

    def on_train_epoch_start(self) -> None:
        # runs after every callback's on_train_epoch_start, FTS's transition and retune's search included
        self.epoch_max.append(self.simulated_max())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self._check_memory(x.shape[0])
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=512)

    def configure_optimizers(self) -> Any:
        # FTS convention: optimize only what is trainable now (phase 0); FTS adds later phases' params
        # to this optimizer as new parameter groups when it thaws them
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


@dataclass
class Result:
    trainer: Any
    model: Classifier
    finder: ScheduledBatchSizeFinder
    fts: FinetuningScheduler


def main(argv: Sequence[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--memory-mib", type=float, default=2.0, help="simulated device memory; 0: no simulation")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--root-dir", help="where FTS writes checkpoints and its schedule (default: a temp dir)")
    parser.add_argument("--quiet", action="store_true", help="no per-trial lines from retune")
    args = parser.parse_args(argv)

    if args.accelerator == "cpu":
        torch.set_num_threads(1)  # a model this small runs fastest on one CPU thread
    pl.seed_everything(0)
    root = args.root_dir or tempfile.mkdtemp(prefix="retune-fts-")
    model = Classifier(memory_mib=args.memory_mib)
    finder = ScheduledBatchSizeFinder(RETUNE_SCHEDULE, verbose=not args.quiet)
    fts = FinetuningScheduler(ft_schedule=str(FTS_SCHEDULE))  # restore_best=True by default
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_epochs=args.max_epochs,
        # the finder may be listed anywhere: it moves itself after every other callback
        callbacks=[
            finder,
            fts,
            FTSEarlyStopping(monitor="val_loss", patience=2),  # a phase also ends when val_loss stalls
            FTSCheckpoint(monitor="val_loss", save_top_k=1),  # the best checkpoint FTS restores
        ],
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model)

    print(f"\ncheckpoints and FTS's schedule copy: {root}")
    print(f"{'epoch':>5}  {'trigger':<10} {'batch size':>16}  {'simulated max':>13}  trials")
    for event in finder.history:
        sizes = f"{event.batch_size_before} -> {event.batch_size_after}"
        simulated = model.epoch_max[event.epoch] if args.memory_mib > 0 else "-"
        print(f"{event.epoch:>5}  {event.trigger:<10} {sizes:>16}  {simulated!s:>13}  {len(event.trials)}")
    return Result(trainer, model, finder, fts)


if __name__ == "__main__":
    main()
