"""``retune.callbacks.base``: what both callbacks share reads each one's events through its report module.

The base prints an event's summary, logs its metrics and prints the table at fit end through the
callback's ``_report`` (an ``EventReport``); both report modules take the same ``where`` a recovered step's
or a search's line starts with, so one ``_record`` serves both callbacks.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from retune import ScheduledBatchSizeFinder, ScheduledLRFinder
from retune.callbacks.base import EventReport
from retune.lr.events import LRFindEvent
from retune.reports import batch_size, lr


def _lr_event() -> LRFindEvent:
    return LRFindEvent(
        epoch=3, global_step=30, trigger="unfreeze", groups=[1], lrs_before=[0.1], lr_after=0.01, method="min_div10"
    )


def test_each_callback_reads_its_events_through_its_report_module() -> None:
    assert ScheduledBatchSizeFinder._report is batch_size
    assert ScheduledLRFinder._report is lr
    members = [name for name in vars(EventReport) if not name.startswith("_")]
    assert sorted(members) == ["event_metrics", "format_summary", "format_table"]
    for module in (batch_size, lr):
        for name in members:
            ours = list(inspect.signature(getattr(EventReport, name)).parameters)[1:]  # without self
            assert list(inspect.signature(getattr(module, name)).parameters) == ours, (module.__name__, name)


def test_the_range_tests_summary_starts_where_it_is_told() -> None:
    event = _lr_event()
    assert lr.format_summary(event).startswith("epoch 3: param groups [1] lr 0.1 -> 0.01")
    assert lr.format_summary(event, "fit start").startswith("fit start: param groups [1]")
    assert lr.event_metrics(event)["retune/lr_group1"] == 0.01
    assert "1 learning-rate range test" in lr.format_table([event])


def test_trigger_states_follow_each_trigger_when_the_schedule_lists_them_in_another_order() -> None:
    """A checkpoint names each trigger's state (class and which of that class), so resuming with the triggers
    listed in another order gives each its own baseline back (by position it gave one the other's, or crashed)."""
    from retune.callbacks.base import load_trigger_states, trigger_states
    from retune.schedule.triggers import FitStart, ParamGroupsChanged, TrainableParamsChanged

    groups, count = ParamGroupsChanged(), TrainableParamsChanged()
    groups.baseline, count.baseline = (frozenset({"head.weight"}),), 42
    saved = trigger_states([FitStart(), groups, count])
    groups2, count2 = ParamGroupsChanged(), TrainableParamsChanged()
    load_trigger_states([count2, FitStart(), groups2], saved)
    assert count2.baseline == 42
    assert groups2.baseline == (frozenset({"head.weight"}),)


def test_trigger_states_of_an_older_checkpoint_are_read_by_position_where_they_fit() -> None:
    from retune.callbacks.base import load_trigger_states
    from retune.schedule.triggers import ParamGroupsChanged, TrainableParamsChanged

    groups, count = ParamGroupsChanged(), TrainableParamsChanged()
    load_trigger_states([groups, count], [{"baseline": [["a"]]}, {"baseline": 7}])  # the same order: read
    assert (groups.baseline, count.baseline) == ((frozenset({"a"}),), 7)
    groups, count = ParamGroupsChanged(), TrainableParamsChanged()
    load_trigger_states([groups, count], [{"baseline": 7}, {"baseline": [["a"]]}])  # reordered: not misread
    assert groups.baseline is None


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"triggers": ["fit_start"]}, "triggers[0] is 'fit_start'"),
        ({"triggers": [{"kind": "epoch", "at": [1]}]}, "schedule's `triggers` list"),
        ({"triggers": [object()]}, "needs a `kind` string"),
        ({"triggers": "fit_start"}, "must be a list of trigger objects"),
        ({"verbose": "no"}, "verbose must be True or False, got 'no'"),
        ({"triggers": {"kind": "fit_start"}}, "must be a list of trigger objects"),
        ({"out_dir": 123}, "out_dir must be a path"),
        ({"split_batch": 5}, "split_batch must be a function or None, got 5"),
        ({"clock": 5}, "clock must be a function or None, got 5"),
    ],
)
def test_wrong_constructor_arguments_are_refused_where_they_are_given(kwargs: dict[str, Any], words: str) -> None:
    """Found at the first epoch start (a trigger written as a string), or never (verbose="no"), such a mistake
    would stop the run mid-fit or be silently misread."""
    with pytest.raises(TypeError) as info:
        ScheduledBatchSizeFinder({"triggers": [{"kind": "fit_start"}]}, **kwargs)
    assert words in str(info.value)


def test_a_custom_trigger_answering_something_else_is_a_clear_error() -> None:
    from retune import RetuneError
    from retune.schedule.triggers import TrainingView, evaluate

    class Sideways:
        kind = "sideways"

        def check(self, view: TrainingView) -> str:
            return "sideways"

    view = TrainingView(epoch=1, global_step=0, fit_starting=False, trainable_params=1, param_groups=())
    with pytest.raises(RetuneError, match="returned 'sideways' from check"):
        evaluate([Sideways()], view)  # type: ignore[list-item]


def test_retunes_metrics_are_logged_at_the_step_lightning_logs_at(tmp_path: Any) -> None:
    """Two optimizers stepped by hand: ``global_step`` counts both (twice the batches), while Lightning logs
    ``self.log`` values at the batches that stepped; retune's metrics follow Lightning's, not ``global_step``."""
    import csv

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from tests.helpers.lightning_ns import pl, seed

    class TwoOptimizers(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.batch_size = 4
            self.body, self.head = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
            self.data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> None:
            first, second = self.optimizers()
            loss = torch.nn.functional.mse_loss(self.head(self.body(batch[0])), batch[1])
            first.zero_grad()
            second.zero_grad()
            self.manual_backward(loss)
            first.step()
            second.step()
            self.log("train_loss", loss)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=self.batch_size)

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.body.parameters(), lr=0.01), torch.optim.SGD(self.head.parameters(), lr=0.01)]

    seed(0)
    schedule = {"triggers": [{"kind": "epoch", "at": [1]}], "search": {"max_val": 8, "steps_per_trial": 1}}
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    logger = pl.loggers.CSVLogger(str(tmp_path))
    trainer = pl.Trainer(
        max_epochs=2,
        callbacks=[finder],
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TwoOptimizers())
    with open(logger.experiment.metrics_file_path) as file:
        rows = list(csv.DictReader(file))
    steps = [int(r["step"]) for r in rows if r.get("retune/batch_size")]
    assert finder.history[0].global_step == 8  # 4 batches, two optimizer steps each
    assert steps == [4], steps  # the batches that stepped before epoch 1, where Lightning logs


def test_paths_sequences_and_ints_that_read_as_intended_are_taken(tmp_path: Any) -> None:
    """An ``os.PathLike`` out_dir (pytest's ``tmpdir``), a trigger sequence that is not a list, ``verbose=0``."""
    import collections

    from retune.schedule.triggers import FitStart

    class Folder:
        def __fspath__(self) -> str:
            return str(tmp_path)

    finder = ScheduledBatchSizeFinder(
        {"triggers": [{"kind": "epoch", "every": 1}]},
        triggers=collections.deque([FitStart()]),
        out_dir=Folder(),  # type: ignore[arg-type]
        verbose=0,
    )
    assert finder.verbose is False and str(finder.out_dir) == str(tmp_path)
    assert [t.kind for t in finder.triggers] == ["epoch", "fit_start"]
