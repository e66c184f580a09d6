"""What a run would get wrong later is said when it starts, and the loaders follow the sizes found.

Both Lightning lines (tests/helpers/lightning_ns.py); the cases only pytorch-lightning 1.9 can build (truncated
backpropagation through time, several optimizers under automatic optimization) run in the flash stack.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from retune import RetuneError, ScheduledBatchSizeFinder, ScheduledLRFinder
from tests.callbacks.test_behaviour import START, C, make_trainer, schedule
from tests.helpers.lightning_ns import LEGACY, pl
from tests.helpers.retune_warnings import retune_warnings

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("callback", [ScheduledBatchSizeFinder, ScheduledLRFinder])
def test_an_fts_phase_trigger_without_finetuning_scheduler_is_refused(callback: Any) -> None:
    """It would never fire: the unfreeze another callback makes then runs out of memory at the frozen phase's size."""
    finder = callback({"triggers": [{"kind": "fit_start"}, {"kind": "fts_phase"}]}, verbose=False)
    trainer = make_trainer(finder)
    with pytest.raises(RetuneError, match="no FinetuningScheduler is among the trainer's callbacks"):
        trainer.fit(C.AttrModel())


class UnusedStageAttribute(C.AttrModel):  # type: ignore[misc, name-defined]
    """Has ``train_batch_size`` (which wins where it exists), but its loader reads ``batch_size``."""

    def __init__(self) -> None:
        super().__init__()
        self.train_batch_size = 64


def test_a_loader_that_ignores_the_attribute_is_asked_about_the_attribute_by_name() -> None:
    """The warning names what retune wrote and the attribute the hook may read instead (it asked about
    "the batch-size attribute", while retune wrote ``train_batch_size`` and the hook read ``batch_size``)."""
    finder = ScheduledBatchSizeFinder(schedule("fit_start"), verbose=False, write_report=False)
    with retune_warnings() as said:
        make_trainer(finder).fit(UnusedStageAttribute())
    (warning,) = [w for w in said if "do not hold the batch size retune probes" in w]
    assert "does the hook read `train_batch_size`, which retune sets (the stage's own attribute" in warning
    assert "`stage_batch_arg_names: {train: batch_size}` in the schedule makes retune set that one" in warning
    assert finder.batch_size == START  # what the batches held: the size no probe verified is not applied


class ValidatesAtTheAttribute(C.AttrModel):  # type: ignore[misc, name-defined]
    """The validation loader reads the train attribute too (no ``val_batch_size``), as many models do."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(batch_size=batch_size)
        self.val_batches: list[int] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_batches.append(int(batch[0].shape[0]))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)


def test_validation_inside_fit_follows_the_train_size_it_shares_an_attribute_with() -> None:
    """As Lightning's ``BatchSizeFinder`` does: the loader the sanity check built at the starting 500 validated at
    500 for the whole fit (a placeholder too large runs out of memory in validation on a GPU)."""
    finder = ScheduledBatchSizeFinder(schedule("fit_start"), verbose=False, write_report=False)
    model = ValidatesAtTheAttribute(batch_size=500)
    make_trainer(finder, num_sanity_val_steps=1, limit_val_batches=2).fit(model)
    found = finder.batch_size
    assert found is not None and found < 500
    assert model.val_batches == [500, found, found]  # the sanity check ran before the search, at the start size


@pytest.mark.skipif(not LEGACY, reason="truncated_bptt_steps is pytorch-lightning 1.9's (2.x has none)")
def test_the_oom_trigger_with_truncated_backpropagation_through_time_is_refused() -> None:
    """A recovered split's micro-batches each got the whole batch's hidden state (the last micro-batch's): refused."""

    class Recurrent(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 8
            self.rnn = nn.GRU(4, 8, batch_first=True)
            self.truncated_bptt_steps = 5

        def training_step(self, batch: Any, batch_idx: int, hiddens: Any) -> dict[str, Any]:
            out, hiddens = self.rnn(batch[0], hiddens)
            return {"loss": out.pow(2).mean(), "hiddens": hiddens}

        def train_dataloader(self) -> DataLoader:
            return DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 10, 4)), batch_size=self.batch_size)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    finder = ScheduledBatchSizeFinder(schedule("fit_start", "oom"), verbose=False)
    with pytest.raises(RetuneError, match=r"truncated backpropagation through time \(truncated_bptt_steps=5\)"):
        make_trainer(finder).fit(Recurrent())


@pytest.mark.skipif(not LEGACY, reason="2.x refuses several optimizers under automatic optimization itself")
def test_several_optimizers_under_automatic_optimization_are_refused_at_fit_start() -> None:
    """pytorch-lightning 1.9 steps each optimizer in turn; the first train search could not probe it and ended the
    run after its first epochs (64 steps in)."""

    class TwoOptimizers(C.AttrModel):  # type: ignore[misc, name-defined]
        def training_step(self, batch: Any, batch_idx: int, optimizer_idx: int = 0) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self) -> Any:
            return [
                torch.optim.SGD(self.backbone.parameters(), lr=0.01),
                torch.optim.SGD(self.head.parameters(), lr=0.1),
            ]

    steps: list[int] = []

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            steps.append(trainer.global_step)

    finder = ScheduledBatchSizeFinder(schedule({"kind": "epoch", "every": 2}), verbose=False)
    with pytest.raises(RetuneError, match="this run has 2, which the first train search could not probe"):
        make_trainer(Steps(), finder, max_epochs=3).fit(TwoOptimizers())
    assert steps == []  # refused before training, not at the epoch-2 search
