"""Checkpoints: a resumed fit goes on where the checkpointed one was; evaluating from one leaves the fit alone.

Both Lightning lines (tests/helpers/lightning_ns.py). What a resume must bring back that Lightning does not: the
model's ``lr``/``learning_rate`` retune wrote (Lightning rebuilds ``hparams`` from the constructor), and the state of
a strategy that restores callbacks after ``on_fit_start`` (``restore_checkpoint_after_setup``: FSDP,
``ModelParallelStrategy``). What it must not do: ``trainer.validate/test(ckpt_path=...)`` loads callback states too,
and a fit's history, sizes and baselines are not rolled back by it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from retune import ScheduledBatchSizeFinder
from tests.callbacks.test_behaviour import START, C, make_trainer, schedule
from tests.helpers.lightning_ns import callbacks, pl

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SCHEDULE = schedule("fit_start", "trainable_params_changed")


class LateRestore(pl.strategies.SingleDeviceStrategy):
    """A single device restoring the checkpoint after ``on_fit_start``, as FSDP and ``ModelParallelStrategy`` do."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


class FirstLoader(pl.Callback):
    """The batch size of the first training batch, and the finder's history when training starts."""

    def __init__(self, finder: ScheduledBatchSizeFinder) -> None:
        self.finder = finder
        self.first: int | None = None
        self.history: list[Any] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.history = list(self.finder.history)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.first is None:
            self.first = int(batch[0].shape[0])


def _checkpointed(tmp_path: Path, epochs: int = 2) -> tuple[ScheduledBatchSizeFinder, Path]:
    finder = ScheduledBatchSizeFinder(SCHEDULE, verbose=False, write_report=False)
    checkpoint = callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    make_trainer(checkpoint, finder, max_epochs=epochs, enable_checkpointing=True).fit(C.AttrModel())
    assert len(finder.history) == 1 and finder.batch_size not in (None, START)
    return finder, tmp_path / "last.ckpt"


def test_a_strategy_that_restores_after_fit_start_resumes_without_searching(tmp_path: Path) -> None:
    """The checkpoint is read after ``on_fit_start``: its sizes are applied before Lightning builds the train loader,
    and no fit-start search runs (before, the fit searched again from the constructor's size and kept the flag)."""
    first, ckpt = _checkpointed(tmp_path)
    model = C.AttrModel()
    second = ScheduledBatchSizeFinder(SCHEDULE, verbose=False, write_report=False)
    seen = FirstLoader(second)
    trainer = make_trainer(seen, second, max_epochs=3, strategy=LateRestore(device=torch.device("cpu")))
    trainer.fit(model, ckpt_path=ckpt)
    assert second.history == first.history == seen.history
    assert seen.first == model.batch_size == second.batch_size == first.batch_size
    assert not second._restored  # nothing left over for the next fit


class Validated(C.AttrModel):  # type: ignore[misc, name-defined]
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.compute_loss(batch))

    def val_dataloader(self) -> Any:
        return self.loader(64)


@pytest.mark.parametrize("entry", ["validate", "test"])
def test_evaluating_from_a_checkpoint_leaves_the_fits_state_alone(tmp_path: Path, entry: str) -> None:
    """``validate/test(ckpt_path=...)`` loads callback states: an older checkpoint rolled the history back, and the
    next ``fit`` skipped its fit-start search (it took itself for resumed)."""
    finder = ScheduledBatchSizeFinder(
        schedule("fit_start", {"kind": "epoch", "at": [1]}), verbose=False, write_report=False
    )
    checkpoint = callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1, every_n_epochs=1)
    model = Validated()
    if entry == "test":
        model.test_step = model.validation_step
        model.test_dataloader = model.val_dataloader
    trainer = make_trainer(checkpoint, finder, max_epochs=2, enable_checkpointing=True, limit_val_batches=1)
    trainer.fit(model)
    history = list(finder.history)
    assert [e.trigger for e in history] == ["fit_start", "epoch"]
    epoch0 = next(tmp_path.glob("epoch=0*.ckpt"))
    getattr(trainer, entry)(model, ckpt_path=str(epoch0), verbose=False)
    assert finder.history == history

    make_trainer(finder, max_epochs=1).fit(C.AttrModel())
    assert [e.trigger for e in finder.history] == ["fit_start", "epoch", "fit_start"]


class OwnValSize(C.AttrModel):  # type: ignore[misc, name-defined]
    """Validation reads its own attribute, ``eval_bs``; the train loader reads ``batch_size``."""

    def __init__(self) -> None:
        super().__init__()
        self.eval_bs = START

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        with torch.no_grad():
            self(x)

    def val_dataloader(self) -> Any:
        return self.loader(self.eval_bs)


def test_resuming_without_the_val_stage_keeps_the_val_size_off_the_train_attribute(tmp_path: Path) -> None:
    """A checkpoint tuned val on its own attribute; the resumed fit's schedule tunes train only, so "val" names the
    train attribute there: the checkpoint's val size went onto ``batch_size`` and training resumed at it."""
    own_val = {**SCHEDULE, "stages": ["train", "val"], "stage_batch_arg_names": {"val": "eval_bs"}}
    first = ScheduledBatchSizeFinder(own_val, verbose=False, write_report=False)
    checkpoint = callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    make_trainer(checkpoint, first, enable_checkpointing=True, limit_val_batches=1).fit(OwnValSize())
    train, val = first.batch_sizes["train"], first.batch_sizes["val"]
    assert train != val, "the test needs a val size other than the train size"
    model = OwnValSize()
    second = ScheduledBatchSizeFinder(SCHEDULE, verbose=False, write_report=False)
    seen = FirstLoader(second)
    make_trainer(seen, second, max_epochs=2, limit_val_batches=1).fit(model, ckpt_path=tmp_path / "last.ckpt")
    assert seen.first == model.batch_size == train and model.eval_bs == START


def test_a_state_loaded_by_hand_before_a_fit_is_resumed(tmp_path: Path) -> None:
    """``finder.load_state_dict(state)`` then ``fit()`` without ``ckpt_path`` goes on from that state (a first fix of
    the tuner's stale resume, clearing the mark at every setup, dropped it: a second fit-start search ran)."""
    first, _ = _checkpointed(tmp_path)
    second = ScheduledBatchSizeFinder(SCHEDULE, verbose=False, write_report=False)
    second.load_state_dict(first.state_dict())
    model = C.AttrModel()
    seen = FirstLoader(second)
    make_trainer(seen, second, max_epochs=1).fit(model)
    assert second.history == first.history and seen.first == first.batch_size
