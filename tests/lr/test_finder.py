"""ScheduledLRFinder in real fits: no trace, the suggestion, group selection, order, resume, errors, report.

Runs on both Lightning lines (tests/helpers/lightning_ns.py picks the namespace; CI runs the flash stack too).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import retune
from retune import ScheduledBatchSizeFinder, ScheduledLRFinder, ScheduleError
from retune.cli import main as cli_main
from retune.errors import RetuneError
from retune.reports import lr as lr_report
from tests.helpers.lightning_ns import LEGACY, PRECISION_32, callbacks, pl, seed
from tests.helpers.oracle import FineTuneModel, MemoryOracle

UNFREEZE_AT = 2
LR_FIND: dict[str, Any] = {"steps": 30, "skip_begin": 3, "min_lr": 1e-5, "max_lr": 10.0}
SCHEDULE: dict[str, Any] = {
    "triggers": [{"kind": "fit_start"}, {"kind": "trainable_params_changed"}],
    "lr_find": LR_FIND,
}


def _trainer(tmp_path: Path, extra: list[Any], epochs: int = 3, **kwargs: Any) -> Any:
    return pl.Trainer(
        max_epochs=epochs,
        callbacks=extra,
        logger=kwargs.pop("logger", False),
        enable_progress_bar=False,
        enable_checkpointing=kwargs.pop("enable_checkpointing", False),
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        precision=PRECISION_32,
        default_root_dir=tmp_path,
        deterministic=True,
        **kwargs,
    )


def _model(**kwargs: Any) -> FineTuneModel:
    seed(7)
    defaults: dict[str, Any] = {"batch_size": 64, "n": 512, "head_only_optimizer": True, "scheduler": "step"}
    defaults.update(kwargs)
    return FineTuneModel(**defaults)


def _backbone(**kwargs: Any) -> Any:
    return callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE_AT, **kwargs)


class SetByHand(pl.Callback):
    """The run without a range test: sets the rates ``ScheduledLRFinder`` set, at the same epoch starts.

    Listed after ``BackboneFinetuning``, so it runs after the unfreeze, where the finder ran.
    """

    def __init__(self, events: list[Any]) -> None:
        self.by_epoch = {e.epoch: e for e in events}

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        event = self.by_epoch.get(trainer.current_epoch)
        if event is None or event.lr_after is None:
            return
        optimizer = trainer.optimizers[0]
        for group in event.groups:
            optimizer.param_groups[group]["lr"] = event.lr_after
        for config in trainer.lr_scheduler_configs:
            if 0 in event.groups:
                config.scheduler.base_lrs[0] = event.lr_after
        if len(optimizer.param_groups) - 1 in event.groups:
            for cb in trainer.callbacks:
                if hasattr(cb, "previous_backbone_lr"):
                    cb.previous_backbone_lr = event.lr_after


class Batches(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(batch[0].clone())


def _state(model: Any, trainer: Any) -> tuple[dict[str, torch.Tensor], list[float], Any]:
    optimizer = trainer.optimizers[0]
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        [g["lr"] for g in optimizer.param_groups],
        optimizer.state_dict()["state"],
    )


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_no_trace_equals_a_run_that_sets_the_same_rates_by_hand(tmp_path: Path, optimizer: str) -> None:
    """Weights, optimizer state, rates and the batches fed are bit-identical to a run without the range tests
    that sets the same rates at the same epoch starts (fit start, and the unfreeze)."""
    finder = ScheduledLRFinder(SCHEDULE, verbose=False, write_report=False)
    batches_a = Batches()
    model_a = _model(optimizer=optimizer)
    trainer_a = _trainer(tmp_path / "a", [finder, _backbone(), batches_a], epochs=4)
    trainer_a.fit(model_a)
    assert [(e.epoch, e.groups) for e in finder.history] == [(0, [0]), (UNFREEZE_AT, [1])]
    assert all(e.lr_after is not None and e.steps > 5 for e in finder.history)

    batches_b = Batches()
    model_b = _model(optimizer=optimizer)
    trainer_b = _trainer(tmp_path / "b", [_backbone(), SetByHand(finder.history), batches_b], epochs=4)
    trainer_b.fit(model_b)

    weights_a, lrs_a, state_a = _state(model_a, trainer_a)
    weights_b, lrs_b, state_b = _state(model_b, trainer_b)
    assert lrs_a == lrs_b
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:
        assert torch.equal(weights_a[key], weights_b[key]), key
    for index in state_a:
        for name, value in state_a[index].items():
            other = state_b[index][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    assert len(batches_a.seen) == len(batches_b.seen)
    assert all(torch.equal(x, y) for x, y in zip(batches_a.seen, batches_b.seen, strict=True))
    assert trainer_a.global_step == trainer_b.global_step


def test_no_trace_control_a_different_rate_changes_the_weights(tmp_path: Path) -> None:
    """The comparison above can fail: setting a slightly different rate by hand gives other weights."""
    finder = ScheduledLRFinder(SCHEDULE, verbose=False, write_report=False)
    model_a = _model()
    _trainer(tmp_path / "a", [finder, _backbone()]).fit(model_a)
    off = [
        type(e)(**{**e.__dict__, "lr_after": e.lr_after * 1.001}) if e.lr_after is not None else e
        for e in finder.history
    ]
    model_b = _model()
    _trainer(tmp_path / "b", [_backbone(), SetByHand(off)]).fit(model_b)
    assert not torch.equal(model_a.head.weight, model_b.head.weight)


# -- the suggestion on a problem whose divergence point is known ---------------------------------


class LeastSquares(pl.LightningModule):
    """Linear least squares with unit-variance features and mean squared error: the Hessian is 2I, so plain
    (full-batch) gradient descent diverges above lr = 1.0 and converges in one step at 0.5."""

    def __init__(self, manual: bool = False, nan: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(4096, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(4096, 1, generator=g)
        self.linear = torch.nn.Linear(8, 1, bias=False)
        torch.nn.init.zeros_(self.linear.weight)
        self.automatic_optimization = not manual
        self.nan = nan

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self.linear(x), y)
        if self.nan:
            loss = loss * float("nan")
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=512, shuffle=True)


@pytest.mark.parametrize("method", ["valley", "steepest", "min_div10"])
def test_suggestion_on_least_squares_is_below_the_divergence_point(tmp_path: Path, method: str) -> None:
    seed(0)
    schedule = {"triggers": [{"kind": "fit_start"}], "lr_find": {"min_lr": 1e-4, "max_lr": 10.0, "suggestion": method}}
    finder = ScheduledLRFinder(schedule, verbose=False, write_report=False)
    model = LeastSquares()
    with torch.no_grad():
        start = F.mse_loss(model.linear(model.x), model.y).item()
    _trainer(tmp_path, [finder], epochs=2).fit(model)
    (event,) = finder.history
    assert event.stopped_early, "the sweep reaches 10, far above the divergence point 1.0"
    assert event.lrs[-1] > 1.0
    assert event.lr_after is not None and 0.01 <= event.lr_after < 1.0
    assert finder.lr == event.lr_after
    # the run then trained at that rate (16 steps) without diverging
    with torch.no_grad():
        assert F.mse_loss(model.linear(model.x), model.y).item() < start / 2


def test_manual_optimization_is_supported(tmp_path: Path) -> None:
    seed(0)
    finder = ScheduledLRFinder(
        {"triggers": [{"kind": "fit_start"}], "lr_find": {"min_lr": 1e-4, "max_lr": 10.0}}, verbose=False
    )
    model = LeastSquares(manual=True)
    trainer = _trainer(tmp_path, [finder], epochs=1)
    trainer.fit(model)
    (event,) = finder.history
    assert event.lr_after is not None and 0.01 <= event.lr_after < 1.0
    assert trainer.optimizers[0].param_groups[0]["lr"] == event.lr_after


def test_nan_loss_from_the_first_step_is_a_clear_error_and_changes_nothing(tmp_path: Path) -> None:
    seed(0)
    finder = ScheduledLRFinder({"triggers": [{"kind": "fit_start"}]}, verbose=False)
    model = LeastSquares(nan=True)
    before = model.linear.weight.detach().clone()
    with pytest.raises(RetuneError, match=r"loss was nan at the first step .*lr 1e-07"):
        _trainer(tmp_path, [finder], epochs=1).fit(model)
    assert torch.equal(model.linear.weight, before)


def test_several_optimizers_are_refused(tmp_path: Path) -> None:
    class TwoOptimizers(FineTuneModel):
        def configure_optimizers(self) -> Any:
            return [
                torch.optim.SGD(self.head.parameters(), lr=0.1),
                torch.optim.SGD(self.backbone.parameters(), lr=0.1),
            ]

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            for optimizer in self.optimizers():
                optimizer.zero_grad()
            loss = F.cross_entropy(self(batch[0]), batch[1])
            self.manual_backward(loss)
            for optimizer in self.optimizers():
                optimizer.step()
            return loss

    seed(0)
    model = TwoOptimizers(n=128)
    model.automatic_optimization = False
    finder = ScheduledLRFinder({"triggers": [{"kind": "fit_start"}]}, verbose=False)
    with pytest.raises(RetuneError, match="one optimizer; this run has 2"):
        _trainer(tmp_path, [finder], epochs=1).fit(model)


def test_training_step_without_a_loss_is_a_clear_error(tmp_path: Path) -> None:
    class NoLoss(FineTuneModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return None

    seed(0)
    finder = ScheduledLRFinder({"triggers": [{"kind": "fit_start"}]}, verbose=False)
    with pytest.raises(RetuneError, match="training_step returned no loss at step 1"):
        _trainer(tmp_path, [finder], epochs=1).fit(NoLoss(n=128))


# -- group selection ----------------------------------------------------------------------------


@pytest.mark.parametrize(("groups", "expected"), [("new", [1]), ("all", [0, 1]), ((0,), [0])])
def test_group_selection_at_the_unfreeze(tmp_path: Path, groups: Any, expected: list[int]) -> None:
    schedule = {"triggers": [{"kind": "trainable_params_changed"}], "lr_find": {**LR_FIND, "groups": groups}}
    finder = ScheduledLRFinder(schedule, verbose=False, write_report=False)
    backbone = _backbone()
    head_lrs: list[float] = []

    class Rates(pl.Callback):
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            head_lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    rates = Rates()
    trainer = _trainer(tmp_path, [finder, backbone, rates], epochs=UNFREEZE_AT + 1)
    trainer.fit(_model(scheduler=None))
    (event,) = finder.history
    assert event.epoch == UNFREEZE_AT and event.groups == expected
    # the rates the test found were set on exactly those groups, and only there
    optimizer = trainer.optimizers[0]
    assert [g["lr"] for i, g in enumerate(optimizer.param_groups) if i in expected] == [event.lr_after] * len(expected)
    if 0 not in expected:
        assert optimizer.param_groups[0]["lr"] == 0.05 == head_lrs[-1]
        assert event.lrs_before == [pytest.approx(0.005)]  # BackboneFinetuning's initial rate: 0.1 x the head's
    if 1 in expected:
        assert backbone.previous_backbone_lr == event.lr_after  # its next epochs continue from the new rate


def test_backbone_finetuning_keeps_changing_the_rate_after_it(tmp_path: Path) -> None:
    schedule = {"triggers": [{"kind": "trainable_params_changed"}], "lr_find": LR_FIND}
    finder = ScheduledLRFinder(schedule, verbose=False, write_report=False)
    rates: list[float] = []

    class Rates(pl.Callback):
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            groups = trainer.optimizers[0].param_groups
            if len(groups) > 1:
                rates.append(groups[1]["lr"])

    backbone = _backbone(lambda_func=lambda epoch: 1.5, should_align=False)
    _trainer(tmp_path, [finder, backbone, Rates()], epochs=UNFREEZE_AT + 2).fit(_model(scheduler=None))
    (event,) = finder.history
    assert rates[0] == event.lr_after
    assert rates[1] == pytest.approx(event.lr_after * 1.5)


def test_step_scheduler_continues_from_the_new_rate(tmp_path: Path) -> None:
    finder = ScheduledLRFinder({"triggers": [{"kind": "fit_start"}], "lr_find": LR_FIND}, verbose=False)
    trainer = _trainer(tmp_path, [finder], epochs=3)
    trainer.fit(_model(head_only_optimizer=False))  # StepLR(step_size=1, gamma=0.5)
    (event,) = finder.history
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.base_lrs == [event.lr_after]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(event.lr_after * 0.5**3)


class Scheduled(FineTuneModel):
    """SGD 0.05 on every parameter with the scheduler ``make(optimizer)`` stepped every step."""

    def __init__(self, make: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.make = make

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.make(opt), "interval": "step"}}


class StepRates(pl.Callback):
    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])


def _scheduled_fit(tmp_path: Path, make: Any) -> tuple[ScheduledLRFinder, list[float]]:
    finder = ScheduledLRFinder({"triggers": [{"kind": "fit_start"}], "lr_find": LR_FIND}, verbose=False)
    rates = StepRates()
    seed(7)
    model = Scheduled(make, batch_size=64, n=512, head_only_optimizer=False)
    _trainer(tmp_path, [finder, rates], epochs=2).fit(model)
    return finder, rates.rates


def test_warmup_warms_up_to_the_suggestion(tmp_path: Path) -> None:
    """The suggestion is the rate the warmup reaches, not the rate of its first step (which would end at 10x)."""
    finder, rates = _scheduled_fit(
        tmp_path, lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=8)
    )
    assert finder.lr is not None
    assert finder.history[0].lrs_before == [0.05]  # the configured rate, not the warmup's first 0.005
    assert rates[0] == pytest.approx(0.1 * finder.lr)
    assert rates[8:] == pytest.approx([finder.lr] * len(rates[8:]))
    assert rates == sorted(rates)


def test_one_cycle_peaks_at_the_suggestion(tmp_path: Path) -> None:
    finder, rates = _scheduled_fit(
        tmp_path, lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=16)
    )
    assert finder.lr is not None
    assert finder.lr * 0.99 < max(rates) <= finder.lr  # the cycle's peak falls between two steps
    assert rates[0] == pytest.approx(finder.lr / 25)  # OneCycleLR's div_factor, kept


def test_explicit_groups_are_honoured_at_fit_start(tmp_path: Path) -> None:
    """``groups: [1]`` at fit start tunes group 1 alone; group 0 keeps its configured (discriminative) rate."""

    class TwoGroups(FineTuneModel):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(
                [{"params": self.head.parameters(), "lr": 0.05}, {"params": self.backbone.parameters(), "lr": 0.005}],
                lr=0.05,
            )

    schedule = {"triggers": [{"kind": "fit_start"}], "lr_find": {**LR_FIND, "groups": [1]}}
    finder = ScheduledLRFinder(schedule, verbose=False, write_report=False)
    seed(7)
    trainer = _trainer(tmp_path, [finder], epochs=1)
    trainer.fit(TwoGroups(batch_size=64, n=512, head_only_optimizer=False))
    (event,) = finder.history
    assert event.groups == [1]
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [0.05, event.lr_after]


def test_schedule_without_lr_find_says_which_defaults_it_uses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    finder = ScheduledLRFinder({"triggers": [{"kind": "epoch", "at": [5]}]}, write_report=False)
    trainer = _trainer(tmp_path, [finder], epochs=1)
    trainer.fit(_model(scheduler=None))
    trainer.fit(_model(scheduler=None))  # a second fit: said once per callback
    err = capsys.readouterr().err
    notice = (
        "[retune] the schedule has no lr_find section: the range tests use the defaults (min_lr 1e-07, max_lr 1.0, "
        "mode exponential, skip_begin 10, skip_end 1, steps 100, early_stop_threshold 4.0, smoothing 0.98, "
        "suggestion valley, groups new)"
    )
    assert err.count(notice) == 1


def test_schedule_with_lr_find_says_nothing_about_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    finder = ScheduledLRFinder({"triggers": [{"kind": "epoch", "at": [5]}], "lr_find": {}}, write_report=False)
    _trainer(tmp_path, [finder], epochs=1).fit(_model(scheduler=None))
    assert "no lr_find section" not in capsys.readouterr().err


# -- with the batch-size finder -----------------------------------------------------------------


@pytest.mark.parametrize("lr_first", [True, False])
def test_batch_size_is_searched_first_whatever_the_order(tmp_path: Path, lr_first: bool) -> None:
    schedule = {**SCHEDULE, "search": {"mode": "binsearch", "margin": 0.0}}
    lr_finder = ScheduledLRFinder(schedule, verbose=False, write_report=False)
    bs_finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    finders = [lr_finder, bs_finder] if lr_first else [bs_finder, lr_finder]
    model = _model(batch_size=8, oracle=MemoryOracle(capacity=1_500_000))
    trainer = _trainer(tmp_path, [*finders, _backbone()], epochs=UNFREEZE_AT + 1)
    trainer.fit(model)
    assert trainer.callbacks[-2:] == [bs_finder, lr_finder]
    assert [e.epoch for e in bs_finder.history] == [e.epoch for e in lr_finder.history] == [0, UNFREEZE_AT]
    for size_event, lr_event in zip(bs_finder.history, lr_finder.history, strict=True):
        assert lr_event.batch_size == size_event.batch_size_after  # the range test ran at the new size
    assert bs_finder.history[1].batch_size_after < bs_finder.history[0].batch_size_after


# -- resume, logging, report --------------------------------------------------------------------


def test_resume_keeps_history_and_baselines(tmp_path: Path) -> None:
    first = ScheduledLRFinder(SCHEDULE, verbose=False, write_report=False)
    trainer = _trainer(tmp_path / "a", [first, _backbone()], epochs=UNFREEZE_AT)
    trainer.fit(_model(scheduler=None))
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    assert [e.epoch for e in first.history] == [0]

    resumed = ScheduledLRFinder(SCHEDULE, verbose=False, write_report=False)
    backbone = _backbone()
    trainer = _trainer(tmp_path / "b", [resumed, backbone], epochs=UNFREEZE_AT + 1)
    trainer.fit(_model(scheduler=None), ckpt_path=ckpt)
    # no second fit-start test; the unfreeze after the resume tests only the backbone's new group
    assert [(e.epoch, e.trigger, e.groups) for e in resumed.history] == [
        (0, "fit_start", [0]),
        (UNFREEZE_AT, "trainable_params_changed", [1]),
    ]
    assert resumed.history[0] == first.history[0]
    assert trainer.optimizers[0].param_groups[1]["lr"] == resumed.history[1].lr_after


def test_metrics_history_files_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    finder = ScheduledLRFinder(SCHEDULE, verbose=True)
    _trainer(tmp_path, [finder, _backbone()], epochs=UNFREEZE_AT + 1, logger=logger).fit(_model())
    out = Path(logger.log_dir) / "retune"
    paths = finder.report_paths
    assert paths is not None and paths.json == out / lr_report.JSON_NAME and paths.png is not None
    assert lr_report.read_lr_history(paths.json) == finder.history
    assert json.loads(paths.json.read_text())["kind"] == "lr_find"
    metrics = (Path(logger.log_dir) / "metrics.csv").read_text()
    assert "retune/lr_group0" in metrics and "retune/lr_group1" in metrics and "retune/lr_find_steps" in metrics
    printed = capsys.readouterr().err
    assert lr_report.format_table(finder.history) in printed
    assert "learning-rate range test on param groups [1]" in printed

    capsys.readouterr()
    png = tmp_path / "again.png"
    assert cli_main(["report", str(paths.json), "--plot", str(png)]) == 0
    shown = capsys.readouterr().out
    assert "2 learning-rate range tests" in shown and "trainable_params_changed" in shown
    assert png.stat().st_size > 10_000


def test_diverged_loss_is_written_as_null_and_read_back_as_nan(tmp_path: Path) -> None:
    seed(0)
    schedule = {
        "triggers": [{"kind": "fit_start"}],
        "lr_find": {"min_lr": 1e-2, "max_lr": 1e30, "steps": 40, "early_stop_threshold": None},
    }
    finder = ScheduledLRFinder(schedule, verbose=False, out_dir=tmp_path)
    _trainer(tmp_path, [finder], epochs=1).fit(LeastSquares())
    (event,) = finder.history
    assert event.stopped_early and not all(math.isfinite(v) for v in event.losses)
    text = (tmp_path / lr_report.JSON_NAME).read_text()
    assert "NaN" not in text and "Infinity" not in text
    (back,) = lr_report.read_lr_history(tmp_path / lr_report.JSON_NAME)
    assert [math.isfinite(v) for v in back.losses] == [math.isfinite(v) for v in event.losses]


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lr_find", "field"),
    [
        ({"groups": "newest"}, "lr_find.groups"),
        ({"max_lr": 1e-9}, "lr_find.max_lr"),
        ({"steps": 5}, "lr_find.steps"),
        ({"mode": "cosine"}, "lr_find.mode"),
        ({"suggestion": "best"}, "lr_find.suggestion"),
        ({"setps": 10}, "lr_find.setps"),
        ({"early_stop_threshold": 1.0}, "lr_find.early_stop_threshold"),
        ({"smoothing": 1.0}, "lr_find.smoothing"),
        # conflicts with a defaulted field: checked on the final values
        ({"min_lr": 2.0}, "lr_find.min_lr"),
        ({"skip_begin": 150}, "lr_find.skip_begin"),
        ({"skip_begin": 0, "skip_end": 99}, "lr_find.skip_end"),
    ],
)
def test_bad_lr_find_config_names_the_field(lr_find: dict[str, Any], field: str) -> None:
    with pytest.raises(ScheduleError, match=rf"<dict>: {field}: "):
        ScheduledLRFinder({"triggers": [{"kind": "fit_start"}], "lr_find": lr_find})


def test_group_index_beyond_the_optimizer_is_a_clear_error(tmp_path: Path) -> None:
    schedule = {"triggers": [{"kind": "epoch", "at": [1]}], "lr_find": {**LR_FIND, "groups": [3]}}
    finder = ScheduledLRFinder(schedule, verbose=False)
    with pytest.raises(RetuneError, match=r"lr_find.groups lists \[3\], but the optimizer has 1 param groups"):
        _trainer(tmp_path, [finder], epochs=2).fit(_model())


def test_exported_and_in_the_json_schema() -> None:
    assert retune.ScheduledLRFinder is ScheduledLRFinder
    schema = retune.RetuneSchedule.model_json_schema()
    assert "lr_find" in schema["properties"]
    assert {"min_lr", "max_lr", "steps", "mode", "groups", "suggestion"} <= set(
        schema["$defs"]["LRFindConfig"]["properties"]
    )


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
_ = LEGACY


class WarmsUpFromHparams(FineTuneModel):
    """Lightning's documented warm-up: ``optimizer_step`` sets every group's rate from ``hparams.learning_rate``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters({"learning_rate": 0.05})
        self.rates: list[float] = []

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        closure = kwargs.get("optimizer_closure", args[-1] if args and callable(args[-1]) else None)
        optimizer.step(closure=closure)
        scale = min(1.0, (self.trainer.global_step + 1) / 5)
        for group in optimizer.param_groups:
            group["lr"] = scale * self.hparams.learning_rate
        self.rates.append(optimizer.param_groups[0]["lr"])


def test_the_models_learning_rate_attribute_takes_the_suggestion(tmp_path: Path) -> None:
    """As Lightning's ``LearningRateFinder`` does: an ``lr``/``learning_rate`` the rate came from is set too, so a
    step that reads it (a warm-up in ``optimizer_step``) trains at the suggestion, not at the old rate."""
    seed(7)
    model = WarmsUpFromHparams(batch_size=64, n=512, head_only_optimizer=False, scheduler=None)
    finder = ScheduledLRFinder({"triggers": [{"kind": "fit_start"}], "lr_find": LR_FIND}, verbose=False)
    _trainer(tmp_path, [finder], epochs=1).fit(model)
    (event,) = finder.history
    assert event.lr_after is not None and event.lr_after != 0.05
    assert model.hparams.learning_rate == event.lr_after and "`learning_rate` set too" in event.note
    assert model.rates[-1] == pytest.approx(event.lr_after)  # warmed up to the suggestion


def test_a_resumed_fit_keeps_the_rate_the_range_test_wrote_to_the_model(tmp_path: Path) -> None:
    """Lightning rebuilds ``hparams`` from the constructor when a fit resumes: the ``learning_rate`` the range test
    wrote comes back from the checkpoint, so the warm-up goes on at the suggestion (it trained at 0.05 again)."""
    schedule = {"triggers": [{"kind": "fit_start"}], "lr_find": LR_FIND}
    seed(7)
    model = WarmsUpFromHparams(batch_size=64, n=512, head_only_optimizer=False, scheduler=None)
    finder = ScheduledLRFinder(schedule, verbose=False, write_report=False)
    trainer = _trainer(tmp_path / "a", [finder], epochs=1)
    trainer.fit(model)
    ckpt = tmp_path / "epoch0.ckpt"
    trainer.save_checkpoint(ckpt)
    (event,) = finder.history
    assert event.lr_after is not None and event.lr_after != 0.05

    seed(7)
    resumed_model = WarmsUpFromHparams(batch_size=64, n=512, head_only_optimizer=False, scheduler=None)
    resumed = ScheduledLRFinder(schedule, verbose=False, write_report=False)
    _trainer(tmp_path / "b", [resumed], epochs=2).fit(resumed_model, ckpt_path=ckpt)
    assert resumed.history == finder.history  # no second test
    assert resumed_model.hparams.learning_rate == event.lr_after
    assert len(resumed_model.rates) == 8 and resumed_model.rates == [pytest.approx(event.lr_after)] * 8


class ShrinksAtEpoch(pl.Callback):
    """From epoch ``at`` on, the model's memory oracle fits fewer samples (before retune's search: it runs last)."""

    def __init__(self, at: int, capacity: int) -> None:
        self.at, self.capacity = at, capacity

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch >= self.at:
            pl_module.oracle = MemoryOracle(capacity=self.capacity)


def test_a_resumed_fit_keeps_the_rate_lr_scaling_wrote_to_the_model(tmp_path: Path) -> None:
    """``apply.lr_scaling`` moves the model's ``learning_rate`` with the rates at a smaller size; a fit resumed after
    it trains at the scaled rate (the constructor's 0.05 came back, 2-5x the rate for the size)."""
    schedule = {
        "triggers": [{"kind": "fit_start"}, {"kind": "epoch", "at": [1]}],
        "search": {"mode": "binsearch", "margin": 0.0, "init_val": 64},
        "apply": {"lr_scaling": "linear"},
    }

    def fit(epochs: int, finder: ScheduledBatchSizeFinder, root: Path, ckpt: Path | None = None) -> Any:
        seed(7)
        model = WarmsUpFromHparams(batch_size=8, n=512, oracle=MemoryOracle(capacity=1_500_000), scheduler=None)
        trainer = _trainer(root, [ShrinksAtEpoch(1, 500_000), finder], epochs=epochs)
        trainer.fit(model, ckpt_path=ckpt)
        return model, trainer

    first = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    model, trainer = fit(2, first, tmp_path / "a")
    start, shrunk = first.history
    assert shrunk.batch_size_after < start.batch_size_after
    scaled = 0.05 * shrunk.batch_size_after / start.batch_size_after
    assert model.hparams.learning_rate == pytest.approx(scaled)
    ckpt = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(ckpt)

    resumed = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    resumed_model, _ = fit(3, resumed, tmp_path / "b", ckpt)
    assert resumed.history == first.history
    assert resumed_model.hparams.learning_rate == pytest.approx(scaled)
    assert resumed_model.rates and resumed_model.rates == [pytest.approx(scaled)] * len(resumed_model.rates)


def test_an_attribute_naming_another_groups_rate_is_left_alone(tmp_path: Path) -> None:
    """At the unfreeze only the backbone's new group is tested: the model's ``lr`` is the head's rate."""
    schedule = {"triggers": [{"kind": "trainable_params_changed"}], "lr_find": LR_FIND}
    finder = ScheduledLRFinder(schedule, verbose=False, write_report=False)
    model = _model(scheduler=None)
    model.lr = 0.05  # the head's rate, as configure_optimizers builds it
    _trainer(tmp_path, [finder, _backbone()], epochs=UNFREEZE_AT + 1).fit(model)
    (event,) = finder.history
    assert event.groups == [1] and model.lr == 0.05 and "set too" not in event.note


def test_an_attribute_that_names_a_tested_and_an_untested_groups_rate_is_left_alone(tmp_path: Path) -> None:
    """The backbone's new group starts at the head's rate (``backbone_initial_ratio_lr=1``): the model's ``lr`` names
    both, so it is not the tested group's alone, and stays."""
    schedule = {"triggers": [{"kind": "trainable_params_changed"}], "lr_find": LR_FIND}
    finder = ScheduledLRFinder(schedule, verbose=False, write_report=False)
    model = _model(scheduler=None)
    model.lr = 0.05
    _trainer(tmp_path, [finder, _backbone(backbone_initial_ratio_lr=1.0)], epochs=UNFREEZE_AT + 1).fit(model)
    (event,) = finder.history
    assert event.groups == [1] and event.lrs_before == [pytest.approx(0.05)]
    assert model.lr == 0.05 and "set too" not in event.note


def test_lightnings_batch_size_finder_in_the_same_fit_is_no_resume(tmp_path: Path) -> None:
    """Lightning's ``BatchSizeFinder`` saves a checkpoint in its ``on_fit_start`` and reads it back, which calls every
    callback's ``load_state_dict``: the range test took the fit for resumed and skipped its fit-start test."""
    finder = ScheduledLRFinder(SCHEDULE, verbose=False, write_report=False)
    lightning_bsf = callbacks.BatchSizeFinder(mode="power", init_val=16, max_trials=1, steps_per_trial=1)
    _trainer(tmp_path, [lightning_bsf, finder], epochs=1).fit(_model())
    assert [(e.trigger, e.epoch) for e in finder.history] == [("fit_start", 0)]


def test_a_fit_after_the_tuner_runs_its_fit_start_test(tmp_path: Path) -> None:
    """``Tuner(trainer).scale_batch_size(model)`` then ``trainer.fit(model)``: the tuner reads its checkpoint back
    inside a fit it ends before ``on_fit_start``, and the next fit took itself for resumed (no range test)."""
    finder = ScheduledLRFinder(SCHEDULE, verbose=False, write_report=False)
    trainer = _trainer(tmp_path, [finder], epochs=1)
    model = _model()
    tuner = trainer.tuner if LEGACY else pl.tuner.Tuner(trainer)
    tuner.scale_batch_size(model, mode="power", init_val=16, max_trials=1, steps_per_trial=1)
    assert finder.history == []
    trainer.fit(model)
    assert [(e.trigger, e.epoch) for e in finder.history] == [("fit_start", 0)]
