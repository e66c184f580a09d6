"""ScheduledBatchSizeFinder inside real Lightning runs: error paths, where the batch size lives,
resuming, manual optimization, and that probe steps stay invisible to logging and other callbacks.

Every model here consults the memory oracle of ``tests.helpers.oracle`` (a real ``torch.OutOfMemoryError``
above its capacity), so each search has a known right answer. Searches start near that answer
(``init_val`` 64, one step per trial) to keep every fit around a second on a small CPU.
"""

from __future__ import annotations

import copy
import csv
import functools
import importlib
import math
import re
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import retune
from retune import RetuneError, RetuneEvent
from tests.helpers.lightning_ns import LEGACY, callbacks, pl
from tests.helpers.oracle import MemoryOracle, make_data
from tests.helpers.retune_warnings import retune_warnings

ScheduledBatchSizeFinder = retune.ScheduledBatchSizeFinder

# Capacity at which the fully trainable model below fits at most 127 samples: a binsearch from 64
# then costs one out-of-memory trial (128) and ends at 127, 120 after the default 5% margin.
ORACLE = MemoryOracle(capacity=2_950_000)
N = 512  # samples: a handful of batches per epoch at the tuned size
START = 8  # the batch size every model starts with
FAST_SEARCH: dict[str, Any] = {"init_val": 64, "steps_per_trial": 1}


def schedule(*triggers: str | dict[str, Any], batch_arg_name: str = "batch_size", **search: Any) -> dict[str, Any]:
    return {
        "batch_arg_name": batch_arg_name,
        "search": {**FAST_SEARCH, **search},
        "triggers": [{"kind": t} if isinstance(t, str) else t for t in triggers],
    }


def make_trainer(*cbs: Any, ns: ModuleType = pl, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "devices": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
    }
    options.update(overrides)
    return ns.Trainer(callbacks=list(cbs), **options)


# -- models, built per Lightning namespace -----------------------------------------------------


@functools.cache
def classes(ns_name: str) -> SimpleNamespace:
    """Model, datamodule and callback classes subclassing the given namespace's Lightning classes."""
    ns = importlib.import_module(ns_name)
    Callback = importlib.import_module(ns_name + ".callbacks").Callback

    class OracleModel(ns.LightningModule):
        """Backbone + head with the memory oracle; no batch-size attribute and no train_dataloader."""

        def __init__(self, oracle: MemoryOracle = ORACLE, n: int = N) -> None:
            super().__init__()
            self.oracle = oracle
            self.dataset = make_data(n)
            self.backbone = nn.Sequential(
                nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU()
            )
            self.head = nn.Linear(64, 4)
            self.seen: list[tuple[int, int]] = []  # (epoch, batch size) of every real training batch

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.backbone(x))

        def compute_loss(self, batch: Any) -> torch.Tensor:
            x, y = batch
            self.oracle.check(x.shape[0], self)
            return F.cross_entropy(self(x), y)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.compute_loss(batch)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.seen.append((self.current_epoch, int(batch[0].shape[0])))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def true_max(self) -> int:
            total = sum(p.numel() for p in self.parameters())
            trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
            return self.oracle.true_max(trainable, total)

        def loader(self, batch_size: int) -> DataLoader:
            return DataLoader(self.dataset, batch_size=batch_size, shuffle=True)

    class AttrModel(OracleModel):
        """``self.batch_size`` on the model, the everyday case."""

        def __init__(self, batch_size: int = START, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.batch_size = batch_size

        def train_dataloader(self) -> DataLoader:
            return self.loader(self.batch_size)

    class HParamsModel(OracleModel):
        """The batch size only in ``self.hparams`` (``save_hyperparameters()``)."""

        def __init__(self, batch_size: int = START) -> None:
            super().__init__()
            self.save_hyperparameters("batch_size")

        def train_dataloader(self) -> DataLoader:
            return self.loader(self.hparams.batch_size)

    class TrainBsModel(OracleModel):
        """A custom attribute name, ``train_bs``."""

        def __init__(self, train_bs: int = START) -> None:
            super().__init__()
            self.train_bs = train_bs

        def train_dataloader(self) -> DataLoader:
            return self.loader(self.train_bs)

    class BatchDataModule(ns.LightningDataModule):
        """The batch size and the train dataloader on a datamodule."""

        def __init__(self, batch_size: int = START, n: int = N) -> None:
            super().__init__()
            self.batch_size = batch_size
            self.dataset = make_data(n)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)

    class FailingModel(AttrModel):
        """Raises ``make_exc()`` (remembered in ``self.raised``) at batch sizes >= ``fail_at``. Remembered in a
        private attribute: a probe's step changes no public one the search does not put back."""

        def __init__(self, fail_at: int, make_exc: Callable[[], BaseException], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.fail_at = fail_at
            self.make_exc = make_exc
            self._raised: BaseException | None = None

        @property
        def raised(self) -> BaseException | None:
            return self._raised

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch[0].shape[0] >= self.fail_at:
                self._raised = self.make_exc()
                raise self._raised
            return super().training_step(batch, batch_idx)

    class ManualModel(AttrModel):
        """Manual optimization: the step zeroes, back-propagates and steps itself."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            loss = self.compute_loss(batch)
            self.manual_backward(loss)
            opt.step()

    class LoggingModel(AttrModel):
        """Logs per step, plus epoch aggregates that a leaked probe step would change."""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.compute_loss(batch)
            size = batch[0].shape[0]
            self.log("train_loss", loss, on_step=True, on_epoch=True, batch_size=size)
            self.log("batch_max", float(size), on_step=False, on_epoch=True, reduce_fx="max", batch_size=size)
            self.log("step_count", 1.0, on_step=False, on_epoch=True, reduce_fx="sum", batch_size=size)
            return loss

    class Capture(Callback):
        """Copies the run's state at every epoch start; records hooks called and exceptions seen."""

        def __init__(self) -> None:
            self.hooks: list[str] = []
            self.exceptions: list[BaseException] = []
            self.weights: dict[str, torch.Tensor] = {}
            self.optimizer: torch.optim.Optimizer | None = None
            self.optimizer_state: dict[str, Any] = {}
            self.batch_size: int | None = None

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self.hooks.append("on_fit_start")

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self.hooks.append("on_train_epoch_start")
            self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            self.optimizer = trainer.optimizers[0]
            self.optimizer_state = copy.deepcopy(self.optimizer.state_dict())
            self.batch_size = pl_module.batch_size

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self.exceptions.append(exception)

    class StepCounter(Callback):
        """Counts the per-step hooks a probe step would call if callbacks were not hidden."""

        def __init__(self) -> None:
            self.calls: Counter[str] = Counter()

        def on_train_batch_start(self, *args: Any) -> None:
            self.calls["on_train_batch_start"] += 1

        def on_train_batch_end(self, *args: Any) -> None:
            self.calls["on_train_batch_end"] += 1

        def on_before_backward(self, *args: Any) -> None:
            self.calls["on_before_backward"] += 1

        def on_after_backward(self, *args: Any) -> None:
            self.calls["on_after_backward"] += 1

        def on_before_optimizer_step(self, *args: Any) -> None:
            self.calls["on_before_optimizer_step"] += 1

    return SimpleNamespace(**{k: v for k, v in locals().items() if isinstance(v, type)})


C = classes(pl.__name__)


# -- shared checks ------------------------------------------------------------------------------


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Recursive equality with exact tensor comparison."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"tensor differs at {where}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"keys differ at {where}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"length differs at {where}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{a!r} != {b!r} at {where}"


def assert_in_range(size: int | None, true_max: int) -> None:
    assert size is not None and 0.9 * true_max <= size <= true_max, (size, true_max)


def assert_epoch_batches(seen: list[tuple[int, int]], epoch: int, size: int, n: int = N) -> None:
    """Every batch of ``epoch`` has ``size`` samples except a final partial one."""
    sizes = [s for e, s in seen if e == epoch]
    assert len(sizes) == math.ceil(n / size), sizes
    assert all(s == size for s in sizes[:-1]), sizes
    assert sizes[-1] == (n % size or size), sizes


@pytest.fixture
def restore_sigint():
    """Lightning ignores SIGINT after catching a KeyboardInterrupt; give the test session its handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


# -- 1. error paths ---------------------------------------------------------------------------


def test_no_size_fits_raises_retune_error_naming_trigger_epoch_and_smallest_size() -> None:
    model = C.AttrModel(oracle=MemoryOracle(capacity=100))  # the fixed cost alone exceeds capacity
    finder = ScheduledBatchSizeFinder(schedule("fit_start", init_val=4), verbose=False)
    with pytest.raises(RetuneError) as info:
        make_trainer(finder).fit(model)
    message = str(info.value)
    assert "fit_start" in message
    assert "epoch 0" in message
    assert re.search(r"smallest\b.*?\b1\b", message), message
    assert model.batch_size == START  # put back, not left at the last (failed) trial size
    assert model.seen == [] and finder.history == [] and finder.batch_size is None
    assert "memory.budget" not in message  # none was set


def test_no_size_fits_names_the_budget_where_one_is_set() -> None:
    """A budget too small for one sample: the message says the budget is what nothing fits in, and to raise it."""
    sched = schedule("fit_start", init_val=4)
    sched["memory"] = {"budget": "1KiB"}
    finder = ScheduledBatchSizeFinder(sched, verbose=False)
    with pytest.raises(RetuneError) as info:
        make_trainer(finder).fit(C.AttrModel(oracle=MemoryOracle(capacity=100)))
    message = str(info.value)
    assert "fits in memory.budget (0.0009766 MiB)" in message and "raise memory.budget" in message, message


def _failing_run(make_exc: Callable[[], BaseException], finder_first: bool) -> tuple[Any, Any, Any, Any]:
    """Epoch 0 trains at 8; the search at epoch 1 tries 16 and 32 (real steps) and then hits 64.

    The capture callback copies the state at epoch 1's start before the search runs, even when the
    user lists it after the finder: the finder moves itself to the end of the callback list.
    """
    model = C.FailingModel(fail_at=64, make_exc=make_exc, n=64)
    capture = C.Capture()
    finder = ScheduledBatchSizeFinder(schedule({"kind": "epoch", "at": [1]}, init_val=16), verbose=False)
    cbs = (finder, capture) if finder_first else (capture, finder)
    trainer = make_trainer(*cbs, max_epochs=2)
    return model, capture, finder, trainer


def _assert_restored_to_epoch_start(model: Any, capture: Any) -> None:
    assert capture.hooks.count("on_train_epoch_start") == 2  # the snapshot below is epoch 1's, pre-search
    assert_same(model.state_dict(), capture.weights, "weights")
    assert capture.optimizer is not None and capture.optimizer_state["state"], "epoch 0 left momentum buffers"
    assert_same(capture.optimizer.state_dict(), capture.optimizer_state, "optimizer")
    assert model.batch_size == capture.batch_size == START


def test_non_memory_error_in_probe_restores_state_and_reraises_original() -> None:
    model, capture, finder, trainer = _failing_run(lambda: ValueError("bad label at this size"), finder_first=False)
    with pytest.raises(ValueError, match="bad label") as info:
        trainer.fit(model)
    assert info.value is model.raised  # the user's own exception object, not a wrapper
    assert not isinstance(info.value, RetuneError)
    assert capture.exceptions == [model.raised]
    _assert_restored_to_epoch_start(model, capture)
    assert [e for e, _ in model.seen] == [0] * 8  # epoch 1 never trained
    assert finder.history == []


def test_keyboard_interrupt_in_probe_restores_state_and_trainer_reports_interruption(restore_sigint: None) -> None:
    model, capture, finder, trainer = _failing_run(KeyboardInterrupt, finder_first=True)
    if LEGACY:
        # Lightning 1.9 catches KeyboardInterrupt in fit(), warns, marks the run INTERRUPTED and
        # returns normally (no re-raise, no sys.exit).
        with pytest.warns(UserWarning, match="Detected KeyboardInterrupt"):
            trainer.fit(model)
    else:
        # Lightning 2.x catches KeyboardInterrupt in fit(), tears down, marks the run INTERRUPTED and
        # calls sys.exit(1) from its except block, so the original is the SystemExit's context.
        with pytest.raises(SystemExit) as info:
            trainer.fit(model)
        assert info.value.__context__ is model.raised
    assert isinstance(model.raised, KeyboardInterrupt)
    assert capture.exceptions == [model.raised]
    assert trainer.interrupted
    _assert_restored_to_epoch_start(model, capture)
    assert finder.history == []


def test_non_oom_runtime_error_is_not_a_failed_trial() -> None:
    model = C.FailingModel(fail_at=128, make_exc=lambda: RuntimeError("shape mismatch: [128, 16] vs [64, 16]"))
    finder = ScheduledBatchSizeFinder(schedule("fit_start"), verbose=False)
    with pytest.raises(RuntimeError, match="shape mismatch") as info:
        make_trainer(finder).fit(model)
    assert info.value is model.raised and not isinstance(info.value, RetuneError)
    assert finder.history == [] and finder.batch_size is None
    assert model.batch_size == START


def test_missing_batch_arg_name_fails_at_setup() -> None:
    model = C.AttrModel()
    capture = C.Capture()
    finder = ScheduledBatchSizeFinder(schedule("fit_start", batch_arg_name="bs"), verbose=False)
    with pytest.raises(RetuneError, match=r"\bbs\b"):
        make_trainer(capture, finder).fit(model)
    assert "on_fit_start" not in capture.hooks  # raised in setup, before fit even started
    assert model.seen == []


def test_dataloader_passed_to_fit_is_refused_at_setup() -> None:
    model = C.AttrModel()
    capture = C.Capture()
    finder = ScheduledBatchSizeFinder(schedule("fit_start"), verbose=False)
    with pytest.raises(RetuneError, match="train_dataloader"):
        make_trainer(capture, finder).fit(model, train_dataloaders=DataLoader(model.dataset, batch_size=START))
    assert "on_fit_start" not in capture.hooks
    assert model.seen == []


def test_fast_dev_run_skips_the_search_with_a_warning() -> None:
    model = C.AttrModel()
    finder = ScheduledBatchSizeFinder(schedule("fit_start"), verbose=False)
    trainer = make_trainer(finder, fast_dev_run=True)
    with retune_warnings() as said:
        trainer.fit(model)
    assert any("fast_dev_run" in message for message in said), said
    assert trainer.state.finished
    assert finder.history == [] and finder.batch_size is None
    assert model.batch_size == START and model.seen == [(0, START)]


# -- 2. where the batch size lives ------------------------------------------------------------


def _location(case: str) -> tuple[Any, Any, str, Callable[[], int]]:
    """model, datamodule, batch_arg_name, and a reader of the size the train loader will use."""
    if case == "model":
        model = C.AttrModel()
        assert "batch_size" not in model.hparams
        return model, None, "batch_size", lambda: model.batch_size
    if case == "hparams":
        model = C.HParamsModel()
        assert not hasattr(model, "batch_size")
        return model, None, "batch_size", lambda: model.hparams.batch_size
    if case == "datamodule":
        model, dm = C.OracleModel(), C.BatchDataModule()
        assert not hasattr(model, "batch_size") and "batch_size" not in model.hparams
        return model, dm, "batch_size", lambda: dm.batch_size
    model = C.TrainBsModel()
    assert not hasattr(model, "batch_size")
    return model, None, "train_bs", lambda: model.train_bs


@pytest.mark.parametrize("case", ["model", "hparams", "datamodule", "train_bs"])
def test_batch_size_is_written_where_batch_arg_name_lives(case: str) -> None:
    model, dm, name, read = _location(case)
    finder = ScheduledBatchSizeFinder(schedule("fit_start", batch_arg_name=name), verbose=False)
    make_trainer(finder).fit(model, datamodule=dm)
    assert finder.batch_size == read()
    assert_in_range(finder.batch_size, model.true_max())
    assert [(e.batch_size_before, e.batch_size_after) for e in finder.history] == [(START, finder.batch_size)]
    assert_epoch_batches(model.seen, 0, finder.batch_size)


# -- 3. resume ----------------------------------------------------------------------------------


RESUME_SCHEDULE = schedule("fit_start", "trainable_params_changed")


def test_resumed_run_restores_the_tuned_size_and_history_without_searching(tmp_path: Path) -> None:
    first_model = C.AttrModel()
    first = ScheduledBatchSizeFinder(RESUME_SCHEDULE, verbose=False)
    # str dirpaths: 1.9 keeps a Path in the checkpoint, which torch.load(weights_only=True) refuses
    checkpoint = callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    make_trainer(checkpoint, first, max_epochs=2, enable_checkpointing=True).fit(first_model)
    assert len(first.history) == 1 and first.batch_size is not None
    tuned = first.batch_size
    assert (tmp_path / "last.ckpt").exists()

    seen_at_start: dict[str, Any] = {}

    class AtTrainStart(C.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            seen_at_start["batch_size"] = second.batch_size
            seen_at_start["history"] = copy.deepcopy(second.history)
            seen_at_start["attr"] = pl_module.batch_size

    model = C.AttrModel()
    second = ScheduledBatchSizeFinder(RESUME_SCHEDULE, verbose=False)
    # the same callbacks as the checkpointed run, as Lightning asks of a resume
    resumed_checkpoint = callbacks.ModelCheckpoint(dirpath=str(tmp_path / "resumed"), save_last=True)
    trainer = make_trainer(AtTrainStart(), resumed_checkpoint, second, max_epochs=4, enable_checkpointing=True)
    trainer.fit(model, ckpt_path=tmp_path / "last.ckpt")

    assert seen_at_start == {"batch_size": tuned, "history": first.history, "attr": tuned}
    assert second.history == first.history  # no search at the resumed start
    assert second.batch_size == model.batch_size == tuned
    assert trainer.current_epoch == 4
    assert sorted({e for e, _ in model.seen}) == [2, 3]
    for epoch in (2, 3):
        assert_epoch_batches(model.seen, epoch, tuned)


def test_state_dict_round_trip() -> None:
    model = C.AttrModel()
    finder = ScheduledBatchSizeFinder(RESUME_SCHEDULE, verbose=False)
    make_trainer(finder).fit(model)
    state = finder.state_dict()

    fresh = ScheduledBatchSizeFinder(RESUME_SCHEDULE, verbose=False)
    assert fresh.batch_size is None and fresh.history == []
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.batch_size == finder.batch_size == model.batch_size
    assert fresh.history == finder.history and all(isinstance(e, RetuneEvent) for e in fresh.history)
    assert fresh.state_dict() == state


# -- 4. manual optimization -------------------------------------------------------------------


def test_manual_optimization_search_and_global_step() -> None:
    model = C.ManualModel()
    finder = ScheduledBatchSizeFinder(schedule("fit_start", steps_per_trial=2), verbose=False)
    trainer = make_trainer(finder, max_epochs=2)
    trainer.fit(model)
    assert_in_range(finder.batch_size, model.true_max())
    assert model.batch_size == finder.batch_size
    probe_steps = sum(len(e.trials) for e in finder.history) * 2
    assert probe_steps > 0
    # one optimizer step per real batch; the probes' optimizer steps are not counted
    assert trainer.global_step == len(model.seen) == 2 * math.ceil(N / finder.batch_size)
    for epoch in (0, 1):
        assert_epoch_batches(model.seen, epoch, finder.batch_size)


# -- 5./6. probe steps are invisible to logging and to other callbacks ----------------------


def test_self_log_in_probe_steps_does_not_leak(tmp_path: Path) -> None:
    model = C.LoggingModel()
    logger = pl.loggers.CSVLogger(save_dir=tmp_path, name="csv", version=0)
    finder = ScheduledBatchSizeFinder(schedule("fit_start"), verbose=False)
    trainer = make_trainer(finder, logger=logger, log_every_n_steps=1)
    trainer.fit(model)

    real_steps = len(model.seen)
    assert real_steps == math.ceil(N / finder.batch_size)
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    step_rows = [r for r in rows if r.get("train_loss_step")]
    assert [int(r["step"]) for r in step_rows] == list(range(real_steps))

    # The search tried sizes above the one it chose (127 fits; 5% margin gives 120): a leaked probe
    # step would raise the max, and any leaked step would raise the count.
    assert max(t.batch_size for t in finder.history[0].trials if t.fits) > finder.batch_size
    assert trainer.callback_metrics["batch_max"].item() == finder.batch_size
    assert trainer.callback_metrics["step_count"].item() == real_steps


def test_other_callbacks_do_not_see_probe_steps() -> None:
    model = C.AttrModel()
    counter = C.StepCounter()
    finder = ScheduledBatchSizeFinder(schedule("fit_start", steps_per_trial=2), verbose=False)
    make_trainer(counter, finder).fit(model)
    assert finder.history and finder.history[0].trials
    real_steps = len(model.seen)
    assert real_steps == math.ceil(N / finder.batch_size)
    assert dict(counter.calls) == {
        hook: real_steps
        for hook in (
            "on_train_batch_start",
            "on_train_batch_end",
            "on_before_backward",
            "on_after_backward",
            "on_before_optimizer_step",
        )
    }


def test_the_progress_bar_stays_visible_to_the_trainer_during_probes() -> None:
    # RichProgressBar (Lightning's default wherever rich is installed, as with Hugging Face's libraries)
    # redraws from its own thread and asserts that trainer.progress_bar_callback is itself; with every
    # callback hidden during probes, each redraw in a search printed an AssertionError traceback
    bar = callbacks.TQDMProgressBar(refresh_rate=0)  # a progress bar that draws nothing
    seen: list[Any] = []

    class Model(C.AttrModel):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(self.trainer.progress_bar_callback)
            return super().training_step(batch, batch_idx)

    model = Model()
    finder = ScheduledBatchSizeFinder(schedule("fit_start", steps_per_trial=2), verbose=False)
    make_trainer(bar, finder, enable_progress_bar=True).fit(model)
    assert len(seen) >= len(finder.history[0].trials) + len(model.seen)  # at least one step per trial
    assert all(s is bar for s in seen)


# -- 7. console output ----------------------------------------------------------------------


@pytest.mark.parametrize("verbose", [True, False])
def test_summary_line_only_when_verbose(verbose: bool, capsys: pytest.CaptureFixture[str]) -> None:
    model = C.AttrModel()
    finder = ScheduledBatchSizeFinder(schedule("fit_start"), verbose=verbose)
    make_trainer(finder).fit(model)
    out, err = capsys.readouterr()
    assert finder.batch_size is not None
    if verbose:
        assert re.search(rf"batch size {START} -> {finder.batch_size}\b", err), err
    else:
        assert "[retune]" not in out + err
        assert "batch size" not in out + err


# -- 8. both Lightning namespaces in one session --------------------------------------------


def test_works_with_both_lightning_namespaces() -> None:
    lightning_pytorch = pytest.importorskip(
        "lightning.pytorch", reason="needs both namespaces; the `lightning` package is not installed (flash stack)"
    )
    import pytorch_lightning

    finders = []
    for ns in (lightning_pytorch, pytorch_lightning):
        model = classes(ns.__name__).AttrModel()
        assert isinstance(model, ns.LightningModule)
        finder = ScheduledBatchSizeFinder(schedule("fit_start"), verbose=False)
        assert isinstance(finder, ns.callbacks.Callback)
        trainer = make_trainer(finder, ns=ns)
        assert isinstance(trainer, ns.Trainer)
        trainer.fit(model)
        assert trainer.callbacks[-1] is finder
        assert finder.batch_size == model.batch_size
        assert_in_range(finder.batch_size, model.true_max())
        assert_epoch_batches(model.seen, 0, finder.batch_size)
        finders.append(finder)
    assert type(finders[0]) is type(finders[1]) is ScheduledBatchSizeFinder
    assert finders[0].batch_size == finders[1].batch_size


@pytest.mark.parametrize("mode", ["binsearch", "model"])
def test_a_size_capped_by_max_val_is_not_cut_by_the_margin(mode: str) -> None:
    """Issue 20: with ``max_val: 64`` and a model for which 64 fits, the size is 64 (it was 60 after the 5%
    margin); the same run with room only for 63 gets the margin. ``model`` mode predicts from the CPU budget."""
    extra: dict[str, Any] = {"mode": mode, "max_val": 64, "margin": 0.05, "init_val": 16}
    sched = schedule("fit_start", **extra)
    if mode == "model":
        sched["memory"] = {"budget": "1GiB"}  # far above what 64 samples need: the cap decides
    model = C.AttrModel()
    finder = ScheduledBatchSizeFinder(sched, verbose=False)
    make_trainer(finder).fit(model)
    assert finder.batch_size == model.batch_size == 64
    assert finder.history[0].max_fitting == 64 and finder.history[0].min_failing is None

    capacity = ORACLE.capacity
    while C.AttrModel(oracle=MemoryOracle(capacity=capacity)).true_max() >= 64:
        capacity = capacity * 19 // 20  # until the largest size that fits is below the cap
    tight = C.AttrModel(oracle=MemoryOracle(capacity=capacity))
    finder = ScheduledBatchSizeFinder(schedule("fit_start", **{**extra, "mode": "binsearch"}), verbose=False)
    make_trainer(finder).fit(tight)
    found = finder.history[0].max_fitting
    assert found == tight.true_max() and finder.batch_size == int(found * 0.95)


def test_a_search_cut_short_by_max_trials_says_so_in_a_warning_and_the_event() -> None:
    """Found by review: a search whose ``max_trials`` ran out applied the largest size that fit of those it tried
    without a word, where the user expects the largest that fits. The event's note and one warning now say what
    was left open and what to raise; a search with the trials it needs says nothing of the kind. (The oracle
    raises the real ``torch.OutOfMemoryError`` above its capacity.)"""
    model = C.AttrModel()
    finder = ScheduledBatchSizeFinder(schedule("fit_start", max_trials=2), verbose=False)
    with retune_warnings() as said:
        make_trainer(finder).fit(model)
    event = finder.history[0]
    assert [t.batch_size for t in event.trials] == [64, 128] and finder.batch_size < model.true_max()
    stopped = "search.max_trials (2) ran out before the train search settled (64 fit and 128 failed"
    assert stopped in event.note, event.note
    assert any(stopped in message for message in said), said

    settled = ScheduledBatchSizeFinder(schedule("fit_start"), verbose=False)
    with retune_warnings() as said:
        make_trainer(settled).fit(C.AttrModel())
    assert "max_trials" not in settled.history[0].note and not any("max_trials" in m for m in said)
