"""Several evaluation dataloaders: probed one after another, as Lightning runs them, with one size for all.

``val_dataloader()`` (or test, predict) may return several loaders. Lightning runs them in turn,
each batch with its ``dataloader_idx`` (passed to the step only when there are several), so the
probe does the same and a size fits only if it fits every loader. The two loaders here hold samples
of different sizes (8 and 32 features); the steps raise the real ``torch.OutOfMemoryError`` above
``CAPACITY`` batch elements (no GPU here), so the small-sample loader fits 400 per batch and the
large-sample loader only 100. The budget test at the end uses retune's real CPU peak tracker instead.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from tests.helpers.lightning_ns import LEGACY, NAMESPACE, pl

WIDTHS = (8, 32)  # features per sample of loader 0 and loader 1
CAPACITY = 3200  # batch elements a step can hold
FITS = (CAPACITY // WIDTHS[0], CAPACITY // WIDTHS[1])  # (400, 100)
TRAIN_MAX = 60
N = 512  # samples per loader
REAL_STEPS = 2 * -(-N // FITS[1])  # batches of both loaders in the real loop at the size found

_ONLY_2X = pytest.mark.skipif(LEGACY, reason="Lightning 1.9 fails on a dict of loaders and has no CombinedLoader modes")


class TwoLoaders(pl.LightningModule):  # type: ignore[misc,name-defined]
    """Two eval loaders of different sample sizes; every hook checks it got the batch of the loader it was told."""

    def __init__(self, container: str = "list", n: int = N, widths: tuple[int, ...] = WIDTHS) -> None:
        super().__init__()
        self.container = container
        self.widths = widths
        self.batch_size = 8
        self.train_batch_size = 8
        self.val_batch_size = 8
        self.test_batch_size = 8
        self.predict_batch_size = 8
        self.net = nn.Linear(8, 2)
        g = torch.Generator().manual_seed(0)
        self.sets = [
            TensorDataset(torch.randn(n, width, generator=g), torch.randint(0, 2, (n,), generator=g))
            for width in widths
        ]
        self._steps: list[tuple[str, int | None, int]] = []  # (stage, dataloader_idx, batch size) per step run
        # private: a search puts a module's public containers back as they were (retune.probing.attributes)
        self._transfers: list[tuple[int, int]] = []  # (dataloader_idx, features) per on_before_batch_transfer
        self._after_transfers: list[int] = []

    def _loaders(self, stage: str) -> Any:
        size = getattr(self, f"{stage}_batch_size")
        loaders = [DataLoader(data, batch_size=size) for data in self.sets]
        if self.container == "dict":
            return dict(zip(("small", "large"), loaders, strict=True))
        if self.container == "tuple":
            return tuple(loaders)
        return loaders if len(loaders) > 1 or self.container == "list" else loaders[0]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.sets[0], batch_size=self.train_batch_size, shuffle=True)

    def val_dataloader(self) -> Any:
        return self._loaders("val")

    def test_dataloader(self) -> Any:
        return self._loaders("test")

    def predict_dataloader(self) -> Any:
        return self._loaders("predict")

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self._transfers.append((dataloader_idx, int(batch[0].shape[1])))
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self._after_transfers.append(dataloader_idx)
        return batch

    def _step(self, stage: str, batch: Any, dataloader_idx: int | None) -> torch.Tensor:
        x, y = batch  # a list of both loaders' batches would not unpack into two tensors of one batch
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        assert x.shape[1] == self.widths[dataloader_idx or 0], "the batch comes from the loader dataloader_idx names"
        if x.numel() > CAPACITY:
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle: {x.numel()} elements > {CAPACITY})")
        self._steps.append((stage, dataloader_idx, int(x.shape[0])))
        return F.cross_entropy(self.net(x.view(len(x), -1, 8).mean(1)), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch[0].shape[0] > TRAIN_MAX:
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle: train batch {batch[0].shape[0]})")
        return self._step("train", batch, None)

    # dataloader_idx has no default: a step called without it, as the probe did, raises a TypeError
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        self.log("val_loss", self._step("val", batch, dataloader_idx))

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        self.log("test_loss", self._step("test", batch, dataloader_idx))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> torch.Tensor:
        self._step("predict", batch, dataloader_idx)
        return self.net(batch[0].view(len(batch[0]), -1, 8).mean(1)).argmax(1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _schedule(*stages: str, **search: Any) -> dict[str, Any]:
    return {
        "search": {"mode": "binsearch", "margin": 0.0, "steps_per_trial": 2, **search},
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
        "accelerator": "cpu",
    }
    options.update(kwargs)
    return pl.Trainer(**options)


def _run(stage: str, model: TwoLoaders, finder: ScheduledBatchSizeFinder) -> Any:
    trainer = _trainer(finder)
    return {"val": trainer.validate, "test": trainer.test, "predict": trainer.predict}[stage](model)


@pytest.mark.parametrize("container", ["list", "tuple", pytest.param("dict", marks=_ONLY_2X)])
@pytest.mark.parametrize("stage", ["val", "test", "predict"])
def test_every_eval_loader_is_probed_in_turn_and_the_size_fits_the_largest_samples(stage: str, container: str) -> None:
    model = TwoLoaders(container)
    finder = ScheduledBatchSizeFinder(_schedule(stage), verbose=False)
    _run(stage, model, finder)
    (event,) = finder.history
    assert event.batch_size_after == FITS[1] == getattr(model, f"{stage}_batch_size")
    # the largest size that ran loader 0 through the probe is above the answer: only loader 1 limits it
    probed = [(idx, size) for s, idx, size in model._steps if s == stage]
    assert max(size for idx, size in probed if idx == 0) > FITS[1]
    assert max(size for idx, size in probed if idx == 1) == FITS[1]
    # transfer hooks always got the index of the loader whose batch they saw
    assert all(width == WIDTHS[idx] for idx, width in model._transfers)
    assert set(model._after_transfers) == {0, 1}
    # after the search the real loop ran both loaders at the size found
    real = probed[-REAL_STEPS:]
    assert {idx for idx, _ in real} == {0, 1} and max(size for _, size in real) == FITS[1]


def test_a_trial_fails_when_only_the_last_loader_runs_out_of_memory() -> None:
    model = TwoLoaders()
    finder = ScheduledBatchSizeFinder(_schedule("test", init_val=150, max_val=150), verbose=False)
    _run("test", model, finder)
    (event,) = finder.history
    # 150 fits loader 0 and fails on loader 1: the trial is a failure, so the search goes down
    assert (event.trials[0].batch_size, event.trials[0].fits) == (150, False)
    assert ("test", 0, 150) in model._steps and ("test", 1, 150) not in model._steps
    assert event.batch_size_after == FITS[1]


def test_fit_tunes_validation_over_every_val_loader() -> None:
    model = TwoLoaders()
    finder = ScheduledBatchSizeFinder(_schedule("train", "val"), verbose=False)
    _trainer(finder, limit_train_batches=2).fit(model)
    assert [(e.stage, e.trigger) for e in finder.history] == [("train", "fit_start"), ("val", "fit_start")]
    assert finder.batch_sizes == {"train": TRAIN_MAX, "val": FITS[1]}
    assert (model.train_batch_size, model.val_batch_size) == (TRAIN_MAX, FITS[1])
    real_val = [(idx, size) for s, idx, size in model._steps if s == "val"][-REAL_STEPS:]
    assert {idx for idx, _ in real_val} == {0, 1} and max(size for _, size in real_val) == FITS[1]


def test_one_eval_loader_gets_no_dataloader_idx() -> None:
    class OneLoader(TwoLoaders):
        def test_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
            self.log("test_loss", self._step("test", batch, None))

    model = OneLoader(container="single", widths=(WIDTHS[1],))
    finder = ScheduledBatchSizeFinder(_schedule("test"), verbose=False)
    _run("test", model, finder)
    assert finder.history[0].batch_size_after == FITS[1]
    assert {idx for idx, _ in model._transfers} == {0}  # transfer hooks still get 0, as Lightning passes them


def test_an_empty_loader_among_several_is_skipped() -> None:
    model = TwoLoaders()
    model.sets[0] = TensorDataset(torch.zeros(0, WIDTHS[0]), torch.zeros(0, dtype=torch.long))
    finder = ScheduledBatchSizeFinder(_schedule("test"), verbose=False)
    _run("test", model, finder)
    assert finder.history[0].batch_size_after == FITS[1]


class _Measured(TwoLoaders):
    """No oracle: the step's memory grows with the sample's size, and the CPU tracker measures it."""

    def _step(self, stage: str, batch: Any, dataloader_idx: int | None) -> torch.Tensor:
        x, y = batch
        hidden = torch.relu(x.repeat(1, 4))  # four times the sample's size of activations
        return F.cross_entropy(self.net(hidden.view(len(x), -1, 8).mean(1)), y)


class _MeasuredOne(_Measured):
    def validation_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        self._step("val", batch, None)


def _budget_search(widths: tuple[int, ...]) -> int:
    """The val size found under a 2 MiB budget measured by the CPU tracker."""
    single = len(widths) == 1
    model = (_MeasuredOne if single else _Measured)(widths=widths, n=2048, container="single" if single else "list")
    schedule = _schedule("val", steps_per_trial=1, max_val=2048)
    schedule["memory"] = {"budget": "2MiB"}
    finder = ScheduledBatchSizeFinder(schedule, verbose=False)
    _trainer(finder, limit_val_batches=1).validate(model)
    return finder.batch_sizes["val"]


def test_under_a_cpu_budget_the_size_is_the_one_the_largest_samples_allow() -> None:
    small, large = (8,), (512,)
    both = _budget_search(small + large)
    assert both == _budget_search(large) < _budget_search(small)


@_ONLY_2X
def test_a_combined_loader_in_a_zipping_mode_is_one_stream_without_dataloader_idx() -> None:
    combined_loader = importlib.import_module(NAMESPACE + ".utilities.combined_loader")

    class Zipped(TwoLoaders):
        def val_dataloader(self) -> Any:
            loaders = {"small": DataLoader(self.sets[0], batch_size=self.val_batch_size)}
            loaders["large"] = DataLoader(self.sets[1], batch_size=self.val_batch_size)
            return combined_loader.CombinedLoader(loaders, "max_size_cycle")

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            self._transfers.append((dataloader_idx, int(batch["large"][0].shape[1])))
            return batch

        def validation_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
            assert set(batch) == {"small", "large"}, "Lightning hands the step the zipped batches"
            self._step("val", batch["small"], 0)
            self._step("val", batch["large"], 1)

    model = Zipped()
    finder = ScheduledBatchSizeFinder(_schedule("val"), verbose=False)
    _run("val", model, finder)
    assert finder.history[0].batch_size_after == FITS[1]
    assert {idx for idx, _ in model._transfers} == {0}


@_ONLY_2X
def test_a_step_without_batch_idx_is_called_without_it_as_on_lightning_2() -> None:
    class NoBatchIdx(TwoLoaders):
        def test_step(self, batch: Any) -> None:  # type: ignore[override]
            self._step("test", batch, None)

    model = NoBatchIdx(container="single", widths=(WIDTHS[1],))
    finder = ScheduledBatchSizeFinder(_schedule("test"), verbose=False)
    _run("test", model, finder)
    assert finder.history[0].batch_size_after == FITS[1]
