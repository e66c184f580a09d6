"""A batch-size attribute set in two places (the model and ``model.hparams``, or the datamodule and its
hparams): retune warns once per attribute name, naming both places, and keeps writing both."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from retune import ScheduledBatchSizeFinder
from retune.probing.batch_size_attr import duplicate_attr_message, loader_batch_size
from tests.helpers.lightning_ns import pl
from tests.helpers.oracle import FineTuneModel, make_data
from tests.helpers.retune_warnings import retune_warnings

# -- the message, alone ----------------------------------------------------------------------------

PLACES = [("model.batch_size", 8), ("model.hparams.batch_size", 32)]


def test_one_place_is_no_duplicate() -> None:
    assert duplicate_attr_message("batch_size", PLACES[:1], 8, "train_dataloader") is None


def test_the_message_names_both_places_and_the_one_the_loader_was_built_from() -> None:
    message = duplicate_attr_message("batch_size", PLACES, 8, "train_dataloader")
    assert message is not None
    assert "`batch_size` is set in 2 places: model.batch_size = 8 and model.hparams.batch_size = 32." in message
    assert "reads the current size from model.hparams.batch_size" in message
    assert "writes every new size to all of them" in message
    assert "train_dataloader() built its loader from model.batch_size (batch size 8)" in message
    assert "reports as before (32) is not its size" in message  # the loader used 8


def test_the_loader_reading_the_place_retune_reads_needs_no_caveat() -> None:
    message = duplicate_attr_message("batch_size", PLACES, 32, "val_dataloader")
    assert message is not None
    assert "val_dataloader() built its loader from model.hparams.batch_size (batch size 32)" in message
    assert "is not its size" not in message


@pytest.mark.parametrize(
    ("places", "loader_size", "reason"),
    [
        ([("model.batch_size", 16), ("model.hparams.batch_size", 16)], 16, "while they hold the same value"),
        (PLACES, 12, "its loader's batch size, 12, is in none of them"),
        (PLACES, None, "no single batch size"),
    ],
)
def test_when_the_place_the_loader_reads_cannot_be_told(
    places: list[tuple[str, Any]], loader_size: int | None, reason: str
) -> None:
    message = duplicate_attr_message("batch_size", places, loader_size, "train_dataloader")
    assert message is not None and "cannot be told" in message and reason in message


def test_loader_batch_size() -> None:
    data = TensorDataset(torch.zeros(10, 2))
    assert loader_batch_size(DataLoader(data, batch_size=4)) == 4
    sampler = BatchSampler(SequentialSampler(data), batch_size=3, drop_last=False)
    assert loader_batch_size(DataLoader(data, batch_sampler=sampler)) == 3
    assert loader_batch_size([DataLoader(data, batch_size=4), DataLoader(data, batch_size=4)]) == 4
    assert loader_batch_size({"a": DataLoader(data, batch_size=4), "b": DataLoader(data, batch_size=5)}) is None
    assert loader_batch_size(object()) is None


# -- in a run, on both Lightning lines -------------------------------------------------------------


class HparamsModel(FineTuneModel):
    """``self.batch_size`` (read by ``train_dataloader``) next to a ``batch_size`` hyperparameter."""

    def __init__(self) -> None:
        super().__init__(batch_size=8, n=256)
        self.save_hyperparameters({"batch_size": 32})


class HparamsData(pl.LightningDataModule):  # type: ignore[misc,name-defined]
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = 8
        self.data = make_data(256)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


class NoAttrModel(FineTuneModel):
    def __init__(self) -> None:
        super().__init__(n=256)
        del self.batch_size

    def train_dataloader(self) -> DataLoader:  # type: ignore[override]
        raise AssertionError("the datamodule's loader is used")

    def val_dataloader(self) -> DataLoader:  # type: ignore[override]
        raise AssertionError("no validation here")


def _fit(model: Any, **fit_kwargs: Any) -> tuple[ScheduledBatchSizeFinder, list[str]]:
    schedule = {
        "search": {"mode": "binsearch", "steps_per_trial": 1},
        "triggers": [{"kind": "fit_start"}, {"kind": "epoch", "at": [1]}],
    }
    finder = ScheduledBatchSizeFinder(schedule, verbose=False)
    trainer = pl.Trainer(
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=0,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    with retune_warnings() as said:
        trainer.fit(model, **fit_kwargs)
    return finder, [message for message in said if "places" in message]


def test_model_and_its_hparams_warned_once_and_both_written() -> None:
    model = HparamsModel()
    finder, warnings = _fit(model)
    assert len(finder.history) == 2, "two searches, one warning"
    (message,) = warnings
    assert "model.batch_size = 8 and model.hparams.batch_size = 32" in message
    assert "train_dataloader() built its loader from model.batch_size (batch size 8)" in message
    assert finder.history[0].batch_size_before == 32  # Lightning's lookup reads the last place, as the warning says
    assert model.batch_size == model.hparams.batch_size == finder.batch_size != 8


def test_datamodule_and_its_hparams_warned_once_and_both_written() -> None:
    data = HparamsData()
    finder, warnings = _fit(NoAttrModel(), datamodule=data)
    (message,) = warnings
    assert "datamodule.batch_size = 8 and datamodule.hparams.batch_size = 32" in message
    assert "built its loader from datamodule.batch_size" in message
    assert data.batch_size == data.hparams.batch_size == finder.batch_size != 8
