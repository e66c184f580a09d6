"""Evaluation batch sizes: val inside fit (at the triggers) and at validate, test and predict start.

Evaluation needs no gradients or optimizer state, so its largest batch is much larger than training's.
The model's steps raise the real ``torch.OutOfMemoryError`` above each stage's capacity (no GPU here).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import RetuneError, ScheduledBatchSizeFinder
from tests.helpers.lightning_ns import pl
from tests.helpers.retune_warnings import retune_warnings

TRAIN_MAX, EVAL_MAX = 60, 400


def _oom_above(size: int, limit: int) -> None:
    if size > limit:
        raise torch.OutOfMemoryError(f"CUDA out of memory (oracle: batch {size} > {limit})")


class StagedModel(pl.LightningModule):  # type: ignore[misc,name-defined]
    """A classifier with one batch-size attribute per stage and a memory oracle per stage."""

    def __init__(self, separate_attrs: bool = True, n: int = 1024) -> None:
        super().__init__()
        self.batch_size = 8
        if separate_attrs:
            self.train_batch_size = 8
            self.val_batch_size = 8
            self.test_batch_size = 8
            self.predict_batch_size = 8
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 2))
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g))
        self.seen: dict[str, list[int]] = {"train": [], "val": [], "test": [], "predict": []}
        self.modes: list[bool] = []

    def _size(self, stage: str) -> int:
        return int(getattr(self, f"{stage}_batch_size", self.batch_size))

    def _loader(self, stage: str) -> DataLoader:
        return DataLoader(self.data, batch_size=self._size(stage), shuffle=stage == "train")

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _oom_above(batch[0].shape[0], TRAIN_MAX)
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def _eval(self, stage: str, batch: Any) -> torch.Tensor:
        assert not torch.is_grad_enabled()
        self.modes.append(self.training)
        _oom_above(batch[0].shape[0], EVAL_MAX)
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._eval("val", batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._eval("test", batch))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        self._eval("predict", batch)
        return self.net(batch[0]).argmax(1)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.seen["train"].append(batch[0].shape[0])

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.seen["val"].append(batch[0].shape[0])

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.seen["test"].append(batch[0].shape[0])

    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.seen["predict"].append(batch[0].shape[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _schedule(*stages: str) -> dict[str, Any]:
    return {
        "search": {"mode": "binsearch", "margin": 0.0, "steps_per_trial": 1},
        "triggers": [{"kind": "fit_start"}],
        "stages": list(stages),
    }


def _trainer(finder: ScheduledBatchSizeFinder, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "max_epochs": 1,
        "callbacks": [finder],
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


def test_val_is_tuned_at_fit_start_with_its_own_attribute() -> None:
    model = StagedModel()
    finder = ScheduledBatchSizeFinder(_schedule("train", "val"), verbose=False)
    _trainer(finder).fit(model)
    assert [(e.stage, e.trigger) for e in finder.history] == [("train", "fit_start"), ("val", "fit_start")]
    assert finder.batch_sizes == {"train": TRAIN_MAX, "val": EVAL_MAX}
    assert (model.train_batch_size, model.val_batch_size, model.batch_size) == (TRAIN_MAX, EVAL_MAX, 8)
    assert max(model.seen["train"]) == TRAIN_MAX
    assert max(model.seen["val"]) == EVAL_MAX  # the validation after the search ran at the new size
    assert model.training, "probes leave the model in train mode"


def test_val_sharing_the_train_attribute_is_skipped_with_a_warning() -> None:
    model = StagedModel(separate_attrs=False)
    finder = ScheduledBatchSizeFinder(_schedule("train", "val"), verbose=False)
    with retune_warnings() as said:
        _trainer(finder).fit(model)
    assert [e.stage for e in finder.history] == ["train"]
    assert model.batch_size == TRAIN_MAX
    assert any("share `batch_size`" in message for message in said), said


@pytest.mark.parametrize("stage", ["test", "predict", "val"])
def test_eval_stage_is_tuned_when_it_starts(stage: str) -> None:
    model = StagedModel()
    before = [p.detach().clone() for p in model.parameters()]
    finder = ScheduledBatchSizeFinder(_schedule(stage), verbose=False)
    trainer = _trainer(finder)
    run = {"test": trainer.test, "predict": trainer.predict, "val": trainer.validate}[stage]
    run(model)
    (event,) = finder.history
    assert event.stage == stage
    assert event.trigger == {"test": "test_start", "predict": "predict_start", "val": "validate_start"}[stage]
    assert event.batch_size_after == EVAL_MAX == getattr(model, f"{stage}_batch_size")
    assert model.seen[stage] and max(model.seen[stage]) == EVAL_MAX  # the real loop ran at the new size
    assert all(not training for training in model.modes), "eval probes run in eval mode, like Lightning"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_eval_probes_leave_no_logged_metrics_behind() -> None:
    model = StagedModel(n=256)
    finder = ScheduledBatchSizeFinder(_schedule("test"), verbose=False)
    trainer = _trainer(finder)
    results = trainer.test(model)
    # one dataloader, one test_loss averaged over the real batches only
    assert list(results[0]) == ["test_loss"]
    model.eval()
    with torch.no_grad():
        expected = F.cross_entropy(model.net(model.data.tensors[0]), model.data.tensors[1]).item()
    assert results[0]["test_loss"] == pytest.approx(expected, rel=1e-5)


def test_an_eval_stage_without_its_dataloader_hook_from_the_module_is_refused() -> None:
    model = StagedModel()
    finder = ScheduledBatchSizeFinder(_schedule("test"), verbose=False)
    with pytest.raises(RetuneError, match="test_dataloader"):
        _trainer(finder).test(model, dataloaders=DataLoader(model.data, batch_size=4))


class Sampling(StagedModel):
    """A shuffled test loader and a ``predict_step`` that samples (``multinomial``, as a generative model does): what
    an evaluation run on its own draws depends on where torch's RNG stood when the loop made its loader's
    iterator."""

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self._size("test"), shuffle=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        _oom_above(batch[0].shape[0], EVAL_MAX)
        self.seen.setdefault("first", []).append(float(batch[0][0, 0]))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        _oom_above(batch[0].shape[0], EVAL_MAX)
        return torch.multinomial(self.net(batch[0]).softmax(-1), 1).squeeze(1)


@pytest.mark.parametrize("stage", ["test", "predict"])
def test_an_evaluation_run_searched_draws_what_a_run_at_the_size_found_draws(stage: str) -> None:
    """Before (2.x), the rebuilt loader's iterator drew its base seed and the shuffle after the first one had: the
    test saw another first batch, and the predictions sampled other classes (1.9 makes the iterator later)."""
    runs = []
    for searched in (True, False):
        pl.seed_everything(0)
        model = Sampling()
        if not searched:
            setattr(model, f"{stage}_batch_size", EVAL_MAX)  # the size the search finds (oracle: EVAL_MAX fits)
        finder = ScheduledBatchSizeFinder(_schedule(stage), verbose=False)
        trainer = _trainer(finder, limit_test_batches=1, **({} if searched else {"callbacks": []}))  # plain: none
        out = trainer.test(model, verbose=False) if stage == "test" else trainer.predict(model)
        runs.append((model, out, torch.rand(1).item(), finder))
    (model, out, after, finder), (plain, plain_out, plain_after, _) = runs
    assert getattr(model, f"{stage}_batch_size") == EVAL_MAX and finder.history
    if stage == "test":
        assert model.seen["first"] == plain.seen["first"]
    else:
        assert all(torch.equal(a, b) for a, b in zip(out, plain_out, strict=True))
    assert after == plain_after  # and the run's RNG goes on from the same place
