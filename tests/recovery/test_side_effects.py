"""What ``training_step`` changes on the module besides ``self.log``, after a recovered step.

After an OOM in backward the whole batch's forward has already run, so what it changed (a torchmetrics state it
updated, a list it appended to, a counter) is what the run that never ran out of memory has; the micro-batches'
forwards only rebuild the graph and must leave nothing there. The OOMs are real ``torch.OutOfMemoryError``s
raised by the oracle of ``tests/helpers/oom_oracle.py`` (in backward, after the head received its gradient), and
every run is compared with the same run at unlimited capacity.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from retune import ScheduledBatchSizeFinder
from tests.helpers.lightning_ns import pl, seed
from tests.helpers.oom_oracle import TokenModel

torchmetrics = pytest.importorskip("torchmetrics")


class KeepsState(TokenModel):
    """A ``SumMetric`` of the samples seen, a logged accuracy ``Metric``, a step counter and a list of
    per-batch loss sums, all updated in ``training_step``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen = torchmetrics.SumMetric()
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
        self.calls = 0
        self.loss_sums: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.where == "forward":
            self._check(batch)
        logits = self(batch, count=True)
        loss = F.cross_entropy(logits, batch["labels"])
        samples = len(batch["labels"])
        self.seen.update(float(samples))
        self.accuracy(logits.argmax(-1), batch["labels"])
        self.log("acc", self.accuracy, on_step=False, on_epoch=True, batch_size=samples)
        self.calls += 1
        self.loss_sums.append(float(loss.detach()) * samples)
        return loss


def _trainer(finder: ScheduledBatchSizeFinder) -> Any:
    return pl.Trainer(
        max_epochs=1,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def _fit(capacity: int | None) -> tuple[KeepsState, ScheduledBatchSizeFinder, Any]:
    """One batch of 16 samples per epoch, failing in backward under ``capacity`` (tokens): no later batch runs
    with the split kept, so every count below is this batch's."""
    seed(0)
    model = KeepsState(capacity=capacity, where="backward", n=16, batch_size=16)
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    trainer = _trainer(finder)
    trainer.fit(model)
    return model, finder, trainer


@pytest.mark.timeout(120)
def test_a_backward_oom_leaves_the_whole_batch_changes_once() -> None:
    base, _, base_trainer = _fit(None)
    model, finder, trainer = _fit(100)
    recoveries = [e for e in finder.history if e.trigger == "oom"]
    assert len(recoveries) == 1 and recoveries[0].micro_batches >= 2, [e.note for e in recoveries]
    assert "backward" in recoveries[0].note
    # what the whole batch's forward changed, once: not again per micro-batch
    assert model.calls == base.calls == 1
    assert model.seen.compute().item() == base.seen.compute().item() == 16
    assert model.seen._update_count == base.seen._update_count == 1
    assert model.loss_sums == pytest.approx(base.loss_sums, rel=1e-6)
    assert len(model.loss_sums) == 1
    assert trainer.callback_metrics["acc"].item() == base_trainer.callback_metrics["acc"].item()
    # and the update is the whole batch's
    for a, b in zip(model.parameters(), base.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


class SetsAfterBackward(TokenModel):
    """``on_after_backward`` keeps a gradient norm and counts its calls: the micro-batches' backwards are the real
    ones after a backward OOM (the whole batch's never finished), so what they set stays."""

    def on_after_backward(self) -> None:
        self.grad_norm = float(sum(p.grad.norm() ** 2 for p in self.parameters() if p.grad is not None) ** 0.5)
        self.backwards = getattr(self, "backwards", 0) + 1

    def on_before_optimizer_step(self, optimizer: Any, *args: Any) -> None:
        self.norms = [*getattr(self, "norms", []), self.grad_norm]


@pytest.mark.timeout(120)
def test_what_the_micro_batches_backward_hooks_set_stays() -> None:
    seed(0)
    model = SetsAfterBackward(capacity=100, where="backward", n=16, batch_size=16)
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    _trainer(finder).fit(model)
    assert [e.trigger for e in finder.history] == ["oom"]
    assert model.backwards == finder.history[0].micro_batches  # once per micro-batch, as documented
    assert len(model.norms) == 1 and model.norms[0] > 0


class HeavySampleInForward(KeepsState):
    """Sample 12 runs out of memory in forward in any batch of more than 2 samples: the whole batch fails, then the
    first rounds of micro-batches fail partway, after other micro-batches updated the metrics."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        index = batch["index"].tolist()
        if self.capacity is not None and 12 in index and len(index) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (oracle: a heavy sample)")
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(120)
def test_a_round_of_micro_batches_that_fails_partway_counts_nothing() -> None:
    """Before, the micro-batches that ran before a round failed updated the metrics again in the next round: a
    ``SumMetric`` of the samples read 36 for 16."""
    results = {}
    for capacity in (None, 10**6):
        seed(0)
        model = HeavySampleInForward(capacity=capacity, where="none", n=16, batch_size=16)
        finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
        trainer = _trainer(finder)
        trainer.fit(model)
        results[capacity] = (model, trainer, finder)
    (base, base_trainer, _), (model, trainer, finder) = results[None], results[10**6]
    assert finder.history and finder.history[0].micro_batches >= 4  # rounds of 8 and 4 failed before 2 fit
    assert model.seen.compute().item() == base.seen.compute().item() == 16
    assert trainer.callback_metrics["acc"].item() == pytest.approx(base_trainer.callback_metrics["acc"].item())


class WeightedEval(pl.LightningModule):  # type: ignore[misc,name-defined]
    """Each batch of 8 holds six samples of weight 1 and two of 5; a step whose weight passes 8 runs out of memory
    (the real error type) before it counts its samples: a round of 4 fails partway (its first half, 4, counted;
    its second, 12, fails), rounds of 2 fit."""

    def __init__(self, capacity: float | None) -> None:
        super().__init__()
        self.capacity = capacity
        self.net = torch.nn.Linear(4, 3)
        self.batch_size = 8
        g = torch.Generator().manual_seed(3)
        weights = torch.ones(32)
        weights[6::8] = weights[7::8] = 5
        inputs, labels = torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)
        self.data = torch.utils.data.TensorDataset(inputs, labels, weights)
        self.count = torchmetrics.SumMetric()
        self.outs: list[int] = []

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.capacity is not None and float(batch[2].sum()) > self.capacity:
            raise torch.OutOfMemoryError("CUDA out of memory (oracle: weight above capacity)")
        self.count.update(float(len(batch[0])))
        self.outs.append(len(batch[0]))
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]), batch_size=len(batch[0]))

    def on_validation_epoch_end(self) -> None:
        self.log("val_count", self.count.compute())
        self.log("val_outs", float(sum(self.outs)))


@pytest.mark.timeout(120)
def test_an_evaluation_round_that_fails_partway_counts_nothing() -> None:
    """Before, a round of micro-batches that ran out of memory partway left its metric updates and appended outputs:
    74 samples counted where the run with memory counts 64 (and validation's logged loss was already right)."""
    results = []
    for capacity in (None, 8.0):
        seed(0)
        finder = ScheduledBatchSizeFinder(
            {"triggers": [{"kind": "oom"}], "stages": ["train"]}, verbose=False, write_report=False
        )
        trainer = pl.Trainer(
            callbacks=[finder], logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu"
        )
        results.append((trainer.validate(WeightedEval(capacity), verbose=False)[0], finder))
    (base, _), (recovered, finder) = results
    assert [e for e in finder.history if e.trigger == "oom"], "the capacity must make evaluation steps fail"
    assert recovered["val_count"] == base["val_count"] == 32 and recovered["val_outs"] == base["val_outs"] == 32
    assert recovered["val_loss"] == pytest.approx(base["val_loss"], rel=1e-5)
