"""What the ``oom`` trigger's fit-start exactness check costs, relative to one training step (issue 28, point 6).

``python -m tests.benchmarks.bench_exactness_check`` (from the repository root, in the venv with
transformers; about half a minute).

A GPT-2 causal LM built from a config (2 layers, width 128, vocabulary 1000), batches of 32 x 64 tokens,
AdamW, one CPU thread, ``loss_reduction: token_mean`` with ``loss_items: shifted_labels`` (an exact setting:
the check runs its three no-gradient forwards and lets training start). The check's own time (the call,
timed around it) is divided by the median training step of the fit (steps 3 to 12, ``on_train_batch_start``
to ``on_train_batch_end``); the figure is the median over ``--fits`` fits. It runs once per fit.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

from retune import ScheduledBatchSizeFinder
from retune.step_parts import StepParts
from tests.helpers.lightning_ns import pl, seed


class LM(pl.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=1000, n_positions=128, n_embd=128, n_layer=2, n_head=4)
        self.model = transformers.GPT2LMHeadModel(config)
        g = torch.Generator().manual_seed(0)
        self.data = [torch.randint(0, 1000, (64,), generator=g) for _ in range(32 * 12)]
        self.batch_size = 32

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        return loss

    def train_dataloader(self) -> DataLoader[Any]:
        def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"input_ids": torch.stack(rows), "labels": torch.stack(rows)}

        return DataLoader(self.data, batch_size=self.batch_size, collate_fn=collate)  # type: ignore[arg-type]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Timer(pl.Callback):  # type: ignore[misc,name-defined]
    def __init__(self, finder: ScheduledBatchSizeFinder) -> None:
        self.finder = finder
        self.steps: list[float] = []
        self.check: float | None = None
        self.started = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        recovery = self.finder._train_recovery
        if recovery is not None and recovery.first_check is not None and self.check is None:
            inner = recovery.first_check

            def timed(step: StepParts) -> None:
                started = time.perf_counter()
                inner(step)
                self.check = time.perf_counter() - started

            recovery.first_check = timed
        self.started = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.steps.append(time.perf_counter() - self.started)


def one_fit() -> tuple[float, float]:
    seed(0)
    trigger = {"kind": "oom", "loss_reduction": "token_mean", "loss_items": "shifted_labels"}
    finder = ScheduledBatchSizeFinder({"triggers": [trigger]}, verbose=False, write_report=False)
    timer = Timer(finder)
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=[finder, timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LM())
    assert timer.check is not None
    return timer.check, statistics.median(timer.steps[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fits", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ratios = []
    for _ in range(args.fits):
        check, step = one_fit()
        ratios.append(check / step)
        print(f"check {check * 1000:.1f} ms, median training step {step * 1000:.1f} ms: {check / step:.2f}x a step")
    print(f"median over {args.fits} fits: the check costs {statistics.median(ratios):.2f}x one training step, once")


if __name__ == "__main__":
    main()


__all__ = ["LM", "Timer", "main", "one_fit"]
