"""Fine-tune a Flash Task and re-tune the batch size every time the backbone is unfrozen.

``flash.Trainer.finetune`` freezes the Task's ``backbone`` and unfreezes it during training
(``freeze_unfreeze`` at one epoch, ``unfreeze_milestones`` in two steps). Each unfreeze makes a
training step need more memory: gradients and Adam state for the backbone, and the activations kept
for its backward pass. ``RetuneFlashStrategy`` is Flash's strategy with the batch-size search built
in: at every epoch start it unfreezes exactly as Flash does, then searches again::

    python examples/flash_finetune.py                                  # freeze_unfreeze at epoch 2
    python examples/flash_finetune.py --strategy unfreeze_milestones --milestones 1 3 --num-layers 2
    python examples/flash_finetune.py --plain          # Flash's own strategy + ScheduledBatchSizeFinder
    python examples/flash_finetune.py --memory-mib 0 --accelerator gpu  # real OOM errors on a GPU

The Task is Flash's template classifier (``flash.template``) on random data, so nothing is
downloaded. A CPU has no fixed memory to run out of, so by default the Task simulates a small
device: its training step raises the real ``torch.OutOfMemoryError`` when an estimate of the step's
memory exceeds ``--memory-mib`` (fp32 weights; gradient and two Adam moments per trainable weight;
per sample, the activations kept for backward from the first trainable layer on).

Needs the Flash stack (pytorch-lightning 1.9.5, lightning-flash 0.8.2)::

    pip install torch==2.13.0 && pip install -r requirements/flash.txt && pip install --no-deps -e .
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flash
import numpy as np
import pytorch_lightning as pl
import torch
from flash.core.data.io.input import DataKeys
from flash.template.classification import TemplateSKLearnClassifier
from flash.template.classification.data import TemplateData
from torch import nn

from retune import ScheduledBatchSizeFinder
from retune.integrations.flash import RetuneFlashStrategy

FEATURES, CLASSES, WIDTH = 32, 10, 128
SCHEDULES = Path(__file__).resolve().parent.parent / "schedules"


class SimulatedDeviceClassifier(TemplateSKLearnClassifier):  # type: ignore[misc]
    """Flash's template classifier (backbone + head) on a simulated device of ``memory_mib``."""

    def __init__(self, memory_mib: float) -> None:
        backbone = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU())
        super().__init__(num_features=FEATURES, num_classes=CLASSES, backbone=(backbone, WIDTH), learning_rate=1e-3)
        self.memory_bytes = int(memory_mib * 2**20)
        self.epoch_max: dict[int, int] = {}  # the simulated device's true maximum, per epoch

    def _simulated_cost(self) -> tuple[int, int]:
        """(fixed bytes, bytes per sample) of one training step with the current trainable set."""
        layers = [*self.backbone, self.head]
        total = sum(p.numel() for p in self.parameters())
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        fixed = 4 * (total + 3 * trainable)  # weights, plus gradient and Adam's two moments when trainable
        first = next(i for i, m in enumerate(layers) if any(p.requires_grad for p in m.parameters()))
        kept = sum(m.in_features if isinstance(m, nn.Linear) else WIDTH for m in layers[first:])
        return fixed, 4 * kept

    def simulated_max(self) -> int:
        fixed, per_sample = self._simulated_cost()
        return (self.memory_bytes - fixed) // per_sample

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.memory_bytes > 0:  # on a real device its allocator raises the error itself
            fixed, per_sample = self._simulated_cost()
            needed = fixed + batch[DataKeys.INPUT].shape[0] * per_sample
            if needed > self.memory_bytes:
                raise torch.OutOfMemoryError(f"simulated device out of memory: {needed} of {self.memory_bytes} bytes")
        return super().training_step(batch, batch_idx)

    def on_train_epoch_start(self) -> None:
        # runs after every callback's on_train_epoch_start: the unfreeze and the search are done
        self.epoch_max[self.current_epoch] = self.simulated_max()


def make_datamodule(n_train: int, batch_size: int) -> Any:
    """Flash DataModule over random data with a linear teacher; ``batch_size`` is what retune rewrites."""
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((FEATURES, CLASSES))
    x = rng.standard_normal((n_train + 512, FEATURES)).astype(np.float32)
    y = (x @ teacher).argmax(axis=1)
    return TemplateData.from_numpy(
        train_data=x[:n_train], train_targets=y[:n_train], val_data=x[n_train:], val_targets=y[n_train:],
        batch_size=batch_size,
    )  # fmt: skip


@dataclass
class Result:
    trainer: Any
    model: SimulatedDeviceClassifier
    history: list[Any]


def main(argv: Sequence[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="freeze_unfreeze", choices=["freeze_unfreeze", "unfreeze_milestones"])
    parser.add_argument("--unfreeze-epoch", type=int, default=2)
    parser.add_argument("--milestones", type=int, nargs=2, default=(1, 3))
    parser.add_argument("--num-layers", type=int, default=2, help="leaf modules the first milestone unfreezes")
    parser.add_argument("--plain", action="store_true", help="Flash's own strategy + ScheduledBatchSizeFinder")
    parser.add_argument("--max-epochs", type=int, default=4)
    parser.add_argument("--n-train", type=int, default=2048)
    parser.add_argument("--memory-mib", type=float, default=0.5, help="simulated device memory; 0: no simulation")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--quiet", action="store_true", help="no per-trial lines from retune")
    args = parser.parse_args(argv)

    if args.accelerator == "cpu":
        torch.set_num_threads(1)  # a model this small runs fastest on one CPU thread
    pl.seed_everything(0)
    model = SimulatedDeviceClassifier(args.memory_mib)
    datamodule = make_datamodule(args.n_train, batch_size=8)
    if args.strategy == "freeze_unfreeze":
        flash_strategy: Any = ("freeze_unfreeze", args.unfreeze_epoch)
    else:
        flash_strategy = ("unfreeze_milestones", (tuple(args.milestones), args.num_layers))

    callbacks: list[Any] = []
    if args.plain:
        # Flash's strategy unfreezes; the finder (which puts itself after every other callback) searches
        finder = ScheduledBatchSizeFinder(SCHEDULES / "freeze_unfreeze.yaml", verbose=not args.quiet)
        callbacks.append(finder)
        strategy: Any = flash_strategy
    else:
        # one callback: unfreeze, then search, in the same hook (default schedule: fit start + param groups changed)
        strategy = RetuneFlashStrategy.from_flash(flash_strategy, verbose=not args.quiet)
    trainer = flash.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_epochs=args.max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.finetune(model, datamodule=datamodule, strategy=strategy)

    history = finder.history if args.plain else strategy.history
    print(f"\n{'epoch':>5}  {'trigger':<26} {'batch size':>12}  {'simulated max':>13}  trials")
    for event in history:
        sizes = f"{event.batch_size_before} -> {event.batch_size_after}"
        simulated = model.epoch_max[event.epoch] if args.memory_mib > 0 else "-"
        print(f"{event.epoch:>5}  {event.trigger:<26} {sizes:>12}  {simulated!s:>13}  {len(event.trials)}")
    return Result(trainer, model, history)


if __name__ == "__main__":
    main()
