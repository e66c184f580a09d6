"""A ``training_step`` that updates a torchmetrics metric (Lightning's documented pattern, every Flash task's) is
searched with real probes: the fallback says why (not FakeTensorMode's words), and the metric holds the run's
steps alone afterwards, with the same size found.

Faking the metric's states was tried and left: its update then reads its inputs' values (torchmetrics checks
them for NaN and negative weights: ``.item()``), which a fake trace does not have. No out-of-memory error is
involved.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from tests.helpers.lightning_ns import pl, seed
from tests.helpers.varlen import trainer as quiet_trainer

torchmetrics = pytest.importorskip("torchmetrics")


class _Measured(pl.LightningModule):  # type: ignore[misc,name-defined]
    """Memory linear in the batch; the step updates a mean of its loss and a running sum of its logits."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        self.loss_mean = torchmetrics.MeanMetric()
        self.logit_sum = torchmetrics.SumMetric()
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(2048, 64, generator=g), torch.randint(0, 10, (2048,), generator=g))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.loss_mean(loss.detach())
        self.logit_sum.update(logits.detach().sum())
        self.log("loss_mean", self.loss_mean)
        return loss

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _fit(predict: str | None, batch_size: int) -> tuple[_Measured, ScheduledBatchSizeFinder | None]:
    seed(0)
    model = _Measured(batch_size)
    finder = None
    if predict is not None:
        schedule = {
            "search": {"mode": "model", "margin": 0.0, "steps_per_trial": 2, "predict": predict},
            "memory": {"budget": "4MiB"},
            "triggers": [{"kind": "fit_start"}],
        }
        finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    quiet_trainer([] if finder is None else [finder], 1, limit_train_batches=2).fit(model)
    return model, finder


def test_a_step_that_updates_a_metric_falls_back_says_why_and_the_metric_keeps_the_runs_steps_alone() -> None:
    _, off = _fit("off", 4)
    assert off is not None
    size = off.history[0].batch_size_after
    searched, finder = _fit("auto", size)  # starting at the size found: both runs train the same batches
    assert finder is not None
    event = finder.history[0]
    assert event.prediction == "probed" and event.batch_size_after == size
    assert "torchmetrics" in event.note or "depends on tensor values" in event.note, event.note
    assert "Please convert all Tensors" not in event.note.split("(")[0]
    plain, _ = _fit(None, size)
    assert searched.logit_sum._update_count == 2  # the run's two steps, none of the probes'
    for name in ("loss_mean", "logit_sum"):
        ours, theirs = getattr(searched, name), getattr(plain, name)
        assert ours._update_count == theirs._update_count  # the logged one is reset by Lightning at the epoch's end
        for state in ours._defaults:
            assert torch.equal(getattr(ours, state), getattr(theirs, state)), (name, state)
