"""retune with lightning-flash 0.8.2 (on pytorch-lightning 1.9.5): real Flash Tasks and DataModules.

The Task is Flash's own template classifier (``flash.template``: a ``ClassificationTask`` with a
``backbone`` and a ``head``, fed by ``TemplateData.from_numpy`` through Flash's input transforms), so
Flash's strategies freeze and unfreeze it exactly as they would any Task, and ``DataModule.batch_size``
is what Flash's ``train_dataloader`` reads. Its training step consults the memory oracle of
``tests/helpers/oracle.py``, which raises the real ``torch.OutOfMemoryError`` above a capacity that depends
on the batch size and the trainable parameter count, so each phase's true maximum is known.

Three phases with very different maxima: head only (frozen backbone), head + the backbone's last two
leaf modules (``unfreeze_milestones`` first milestone), everything.

Skipped where Flash is not installed (the main Lightning 2.x venv); run in the Flash venv with
``.venv-flash/bin/python -m pytest tests/integrations/test_flash.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

flash = pytest.importorskip("flash")

from flash.core.data.io.input import DataKeys  # noqa: E402
from flash.core.model import Task  # noqa: E402
from flash.template.classification import TemplateSKLearnClassifier  # noqa: E402
from flash.template.classification.data import TemplateData  # noqa: E402

from retune import RetuneError, RetuneEvent, ScheduledBatchSizeFinder, ScheduleError  # noqa: E402
from retune.integrations.flash import (  # noqa: E402
    STRATEGY_NAMES,
    RetuneFlashStrategy,
    default_schedule,
    register_strategies,
)
from tests.helpers.lightning_ns import pl  # noqa: E402
from tests.helpers.oracle import MemoryOracle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
N = 384
CAPACITY = 500_000  # true maxima: 274 head only, 27 with the last backbone layer, 15 all trainable
ORACLE = MemoryOracle(capacity=CAPACITY)
# one probe step per size is enough for a deterministic oracle; the ready schedules (3 steps) run too
QUICK = {"steps_per_trial": 1}
UNFREEZE_SCHEDULE: dict[str, Any] = {
    "search": QUICK,
    "triggers": [{"kind": "fit_start"}, {"kind": "param_groups_changed"}],
}
FIT_START_SCHEDULE: dict[str, Any] = {"search": QUICK, "triggers": [{"kind": "fit_start"}]}


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread() -> Iterator[None]:
    """These models are tiny: a second intra-op thread only adds OpenMP spin-waits, which on a loaded
    two-core machine made this module 3x slower (100 s instead of 30 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class OracleTask(TemplateSKLearnClassifier):  # type: ignore[misc]
    """Flash's template classifier whose training step runs out of memory like a GPU would."""

    def __init__(self) -> None:
        backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        super().__init__(num_features=16, num_classes=4, backbone=(backbone, 32), learning_rate=1e-3)
        self.oracle = ORACLE
        self.sizes_by_epoch: dict[int, list[int]] = {}
        self.true_max_by_epoch: dict[int, int] = {}
        self.metric_updates_at_first_batch: dict[int, int] = {}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.oracle.check(batch[DataKeys.INPUT].shape[0], self)
        return super().training_step(batch, batch_idx)

    def on_train_epoch_start(self) -> None:
        # the LightningModule hook runs after every callback's, so it sees this epoch's unfreeze
        self.true_max_by_epoch[self.current_epoch] = self.true_max_now()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.metric_updates_at_first_batch[self.current_epoch] = self.train_metrics["accuracy"]._update_count
        self.sizes_by_epoch.setdefault(self.current_epoch, []).append(int(batch[DataKeys.INPUT].shape[0]))

    def true_max_now(self) -> int:
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        return self.oracle.true_max(trainable, sum(p.numel() for p in self.parameters()))


def _datamodule(batch_size: int = 4) -> Any:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 16)).astype(np.float32)
    y = rng.integers(0, 4, N)
    return TemplateData.from_numpy(train_data=x, train_targets=y, batch_size=batch_size)


def _trainer(epochs: int, callbacks: list[Any] | None = None, **kwargs: Any) -> Any:
    return flash.Trainer(
        max_epochs=epochs,
        callbacks=callbacks or [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **kwargs,
    )


def _check_run(trainer: Any, model: OracleTask, history: list[RetuneEvent], epochs: int) -> None:
    """Every search within [0.9, 1.0] x the true maximum of its epoch, and every epoch trained at the
    size the last search chose (Flash drops the last partial batch: N // size batches per epoch)."""
    assert trainer.state.finished and trainer.current_epoch == epochs
    for event in history:
        true_max = model.true_max_by_epoch[event.epoch]
        assert 0.9 * true_max <= event.batch_size_after <= true_max, (event.epoch, event.batch_size_after, true_max)
    size, steps = None, 0
    for epoch in range(epochs):
        size = next((e.batch_size_after for e in reversed(history) if e.epoch <= epoch), size)
        assert size is not None
        assert model.sizes_by_epoch[epoch] == [size] * (N // size), f"epoch {epoch} did not train at {size}"
        steps += N // size
    assert trainer.global_step == steps


def _phase_maxima() -> tuple[int, int, int]:
    model = OracleTask()
    total = sum(p.numel() for p in model.parameters())
    head = sum(p.numel() for p in model.head.parameters())
    last = sum(p.numel() for p in model.backbone[2].parameters())
    return ORACLE.true_max(head, total), ORACLE.true_max(head + last, total), ORACLE.true_max(total, total)


def test_the_phases_need_very_different_batch_sizes() -> None:
    frozen, partly, unfrozen = _phase_maxima()
    assert (frozen, partly, unfrozen) == (274, 27, 15)
    with pytest.raises(torch.OutOfMemoryError):
        ORACLE.check(unfrozen + 1, OracleTask())


# -- (a) the plain callback next to Flash's own strategies ------------------------------------------


def test_plain_finder_with_flash_freeze_unfreeze() -> None:
    pl.seed_everything(0)
    model, dm = OracleTask(), _datamodule()
    finder = ScheduledBatchSizeFinder("schedules/freeze_unfreeze.yaml", verbose=False)
    trainer = _trainer(2, [finder])
    trainer.finetune(model, datamodule=dm, strategy=("freeze_unfreeze", 1))

    frozen, _, unfrozen = _phase_maxima()
    assert model.true_max_by_epoch == {0: frozen, 1: unfrozen}
    assert [(e.epoch, e.trigger, e.direction) for e in finder.history] == [
        (0, "fit_start", "cold"),
        (1, "trainable_params_changed", "down"),
    ]
    assert len(trainer.optimizers[0].param_groups) == 1  # Flash extended group 0
    assert finder.batch_size == dm.batch_size == finder.history[-1].batch_size_after
    _check_run(trainer, model, finder.history, 2)


def test_plain_finder_with_flash_unfreeze_milestones() -> None:
    pl.seed_everything(0)
    model, dm = OracleTask(), _datamodule()
    finder = ScheduledBatchSizeFinder(UNFREEZE_SCHEDULE, verbose=False)
    trainer = _trainer(3, [finder])
    trainer.finetune(model, datamodule=dm, strategy=("unfreeze_milestones", ((1, 2), 2)))

    assert model.true_max_by_epoch == dict(enumerate(_phase_maxima()))
    assert [(e.epoch, e.trigger, e.direction) for e in finder.history] == [
        (0, "fit_start", "cold"),
        (1, "param_groups_changed", "down"),
        (2, "param_groups_changed", "down"),
    ]
    _check_run(trainer, model, finder.history, 3)


# -- (b) retune.integrations.flash --------------------------------------------------------------------


class _SeesBatchSize(pl.Callback):  # type: ignore[misc,name-defined]
    """Listed after the strategy: records the batch size it finds at each epoch start."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.seen[trainer.current_epoch] = trainer.datamodule.batch_size


def test_strategy_freeze_unfreeze_retunes_in_its_own_hook(tmp_path: Path) -> None:
    pl.seed_everything(0)
    model, dm = OracleTask(), _datamodule()
    strategy = RetuneFlashStrategy("freeze_unfreeze", unfreeze_epoch=1, verbose=False)
    seer = _SeesBatchSize()
    trainer = _trainer(2, [seer])
    trainer.finetune(model, datamodule=dm, strategy=strategy)

    assert [(e.epoch, e.trigger, e.direction) for e in strategy.history] == [
        (0, "fit_start", "cold"),
        (1, "param_groups_changed", "down"),
    ]
    _check_run(trainer, model, strategy.history, 2)
    # Flash puts the strategy first; a callback after it already sees the re-tuned size at the unfreeze epoch
    assert trainer.callbacks.index(strategy) < trainer.callbacks.index(seer)
    assert seer.seen == {0: strategy.history[0].batch_size_after, 1: strategy.history[1].batch_size_after}
    assert not any(isinstance(cb, ScheduledBatchSizeFinder) for cb in trainer.callbacks)
    assert strategy.batch_size == dm.batch_size

    # checkpoints keep Flash's state and the finder's, under the strategy's key. Lightning 1.9 loads
    # checkpoints with torch.load's default, weights_only=True on torch >= 2.6, so the state must be
    # plain data. (The whole file needs weights_only=False: this Task's hparams hold its backbone module.)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"][strategy.state_key]
    torch.save(saved, tmp_path / "strategy.pt")
    assert torch.load(tmp_path / "strategy.pt", weights_only=True) == saved
    assert "internal_optimizer_metadata" in saved
    assert saved["retune"]["stages"]["train"]["size"] == strategy.batch_size
    restored = RetuneFlashStrategy("freeze_unfreeze", 1, verbose=False)
    restored.load_state_dict(saved)
    assert restored.batch_size == strategy.batch_size
    assert [e.to_dict() for e in restored.history] == [e.to_dict() for e in strategy.history]


def test_strategy_unfreeze_milestones_from_a_schedule_file() -> None:
    pl.seed_everything(0)
    model, dm = OracleTask(), _datamodule()
    strategy = RetuneFlashStrategy(
        "unfreeze_milestones", milestones=(1, 2), num_layers=2, schedule="schedules/freeze_unfreeze.yaml", verbose=False
    )
    trainer = _trainer(3)
    trainer.finetune(model, datamodule=dm, strategy=strategy)

    assert model.true_max_by_epoch == dict(enumerate(_phase_maxima()))
    assert [(e.epoch, e.trigger, e.direction) for e in strategy.history] == [
        (0, "fit_start", "cold"),
        (1, "trainable_params_changed", "down"),
        (2, "trainable_params_changed", "down"),
    ]
    _check_run(trainer, model, strategy.history, 3)


@pytest.mark.parametrize("name", ["no_freeze", "freeze"])
def test_strategies_that_never_unfreeze_search_once(name: str) -> None:
    pl.seed_everything(0)
    model, dm = OracleTask(), _datamodule()
    strategy = RetuneFlashStrategy(name, schedule=FIT_START_SCHEDULE, verbose=False)
    trainer = _trainer(2)
    trainer.finetune(model, datamodule=dm, strategy=strategy)

    frozen, _, unfrozen = _phase_maxima()
    assert set(model.true_max_by_epoch.values()) == {unfrozen if name == "no_freeze" else frozen}
    assert [e.trigger for e in strategy.history] == ["fit_start"]
    _check_run(trainer, model, strategy.history, 2)


@pytest.fixture
def registered() -> Iterator[list[str]]:
    names = register_strategies(UNFREEZE_SCHEDULE, verbose=False)
    yield names
    for name in names:
        Task.finetuning_strategies.remove(name)


def test_registered_names_work_as_strategy_tuples(registered: list[str]) -> None:
    assert registered == [f"retune_{name}" for name in STRATEGY_NAMES]
    assert set(registered) <= set(OracleTask.available_finetuning_strategies())
    assert registered == register_strategies(UNFREEZE_SCHEDULE, verbose=False)  # again: replaced, not doubled
    assert sum(e["name"] == "retune_freeze" for e in Task.finetuning_strategies.functions) == 1

    pl.seed_everything(0)
    model, dm = OracleTask(), _datamodule()
    trainer = _trainer(2)
    trainer.finetune(model, datamodule=dm, strategy=("retune_freeze_unfreeze", 1))
    (strategy,) = [cb for cb in trainer.callbacks if isinstance(cb, RetuneFlashStrategy)]
    assert strategy.strategy_metadata == 1
    assert [e.trigger for e in strategy.history] == ["fit_start", "param_groups_changed"]
    _check_run(trainer, model, strategy.history, 2)


def test_finder_in_callbacks_next_to_the_strategy_is_refused() -> None:
    trainer = _trainer(1, [ScheduledBatchSizeFinder("schedules/freeze_unfreeze.yaml", verbose=False)])
    strategy = RetuneFlashStrategy("freeze", verbose=False)
    with pytest.raises(RetuneError, match="already re-tunes"):
        trainer.finetune(OracleTask(), datamodule=_datamodule(), strategy=strategy)


def test_the_strategy_drives_every_hook_the_finder_implements() -> None:
    """The finder is not in ``trainer.callbacks``: a hook it implements that the strategy does not
    forward would silently never run."""
    own = [cls for cls in ScheduledBatchSizeFinder.__mro__ if cls.__module__.startswith("retune")]  # base included
    hooks = {name for cls in own for name in vars(cls) if hasattr(pl.Callback, name) and not name.startswith("__")}
    assert {"setup", "on_fit_start", "on_train_epoch_start", "state_dict", "load_state_dict"} <= hooks
    assert hooks <= set(vars(RetuneFlashStrategy))


def test_flash_spelling_and_keywords_build_the_same_strategy() -> None:
    cases = [
        (RetuneFlashStrategy("freeze_unfreeze", 3), RetuneFlashStrategy.from_flash(("freeze_unfreeze", 3))),
        (
            RetuneFlashStrategy("unfreeze_milestones", milestones=(2, 4), num_layers=1),
            RetuneFlashStrategy.from_flash(("unfreeze_milestones", ((2, 4), 1))),
        ),
        (RetuneFlashStrategy("freeze"), RetuneFlashStrategy.from_flash("freeze")),
    ]
    for keywords, flash_spelling in cases:
        assert keywords.strategy == flash_spelling.strategy
        assert keywords.strategy_metadata == flash_spelling.strategy_metadata
    assert cases[0][0].strategy_metadata == 3
    assert cases[1][0].strategy_metadata == ((2, 4), 1)
    assert [t.kind for t in cases[0][0].finder.triggers] == ["fit_start", "param_groups_changed"]
    assert [t.kind for t in cases[2][0].finder.triggers] == ["fit_start"]
    assert default_schedule("no_freeze") == {"version": 1, "triggers": [{"kind": "fit_start"}]}


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("unfreeze_all",), {}, ValueError, "one of: no_freeze, freeze, freeze_unfreeze, unfreeze_milestones"),
        (("freeze_unfreeze",), {}, TypeError, "needs its unfreeze points"),
        (("freeze_unfreeze", 2), {"unfreeze_epoch": 2}, TypeError, "once"),
        (("freeze_unfreeze",), {"unfreeze_epoch": -1}, TypeError, "int >= 0"),
        (("freeze_unfreeze",), {"unfreeze_epoch": True}, TypeError, "int >= 0"),
        (("freeze_unfreeze",), {"milestones": (1, 2), "num_layers": 1}, TypeError, "unfreeze_epoch"),
        (("freeze", 3), {}, TypeError, "never unfreezes"),
        (("no_freeze",), {"unfreeze_epoch": 1}, TypeError, "never unfreezes"),
        (("unfreeze_milestones",), {"milestones": (1, 2)}, TypeError, "both"),
        (("unfreeze_milestones",), {"milestones": (3, 2), "num_layers": 1}, TypeError, "first_epoch < second_epoch"),
        (("unfreeze_milestones", (1, 2)), {}, TypeError, "of ints"),
        (("freeze_unfreeze", 2), {"schedule": {"triggers": [{"kind": "fit_start"}]}}, ScheduleError, "epoch 2"),
        (
            ("unfreeze_milestones", ((1, 4), 1)),
            {"schedule": {"triggers": [{"kind": "epoch", "at": [1]}]}},
            ScheduleError,
            "epoch 4",
        ),
    ],
)
def test_bad_arguments_are_refused_when_built(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        RetuneFlashStrategy(*args, **kwargs)


def test_schedules_that_search_at_the_unfreeze_epochs_are_accepted() -> None:
    RetuneFlashStrategy("freeze_unfreeze", 4, schedule={"triggers": [{"kind": "epoch", "every": 2}]})
    RetuneFlashStrategy("unfreeze_milestones", ((1, 4), 1), schedule={"triggers": [{"kind": "epoch", "at": [1, 4]}]})
    RetuneFlashStrategy("freeze_unfreeze", 1, schedule="schedules/freeze_unfreeze.yaml")


def test_probe_steps_leave_the_task_metrics_untouched() -> None:
    pl.seed_everything(0)
    model, dm = OracleTask(), _datamodule()
    trainer = _trainer(1)
    trainer.finetune(
        model, datamodule=dm, strategy=RetuneFlashStrategy("freeze", schedule=FIT_START_SCHEDULE, verbose=False)
    )
    assert model.metric_updates_at_first_batch == {0: 0}


# -- the example ----------------------------------------------------------------------------------


def test_example_flash_finetune_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("flash_finetune_example", ROOT / "examples" / "flash_finetune.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # dataclasses look their module up there
    spec.loader.exec_module(example)

    before = torch.get_num_threads()
    result = example.main(["--quiet", "--max-epochs", "2", "--unfreeze-epoch", "1", "--n-train", "1024"])
    torch.set_num_threads(before)
    assert [e.epoch for e in result.history] == [0, 1]
    for event in result.history:
        true_max = result.model.epoch_max[event.epoch]
        assert 0.9 * true_max <= event.batch_size_after <= true_max
    assert result.trainer.state.finished
