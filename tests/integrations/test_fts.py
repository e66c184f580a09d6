"""finetuning-scheduler (FTS): a re-tune at every phase transition, with real FTS schedule files.

What FTS does at a transition (finetuning-scheduler 2.14, read from its source):

* ``FinetuningScheduler.on_train_epoch_start`` decides (``should_transition``) and performs the
  transition in the same hook: ``curr_depth += 1``, then ``step()``: with ``restore_best`` it
  reloads the best ``FTSCheckpoint`` (model weights, optimizer and LR-scheduler state; not loops,
  not callback states), optionally builds a new optimizer / LR scheduler (``new_optimizer``,
  ``new_lr_scheduler`` in the phase), thaws the phase's ``params`` and adds them to the optimizer
  as new param groups. Epoch-driven: ``max_transition_epoch <= current_epoch``. Early-stopping
  driven: ``FTSEarlyStopping`` marks the phase complete at the validation end of the epoch before.
* FTS's ``setup`` rebuilds ``trainer.callbacks`` (adds FTSCheckpoint / FTSEarlyStopping when
  missing, then Lightning's ``_reorder_callbacks``: checkpoints last). That undoes the finder's
  "last" place from its own ``setup``; the finder's ``on_fit_start`` moves it last again, so its
  epoch-start search always runs after FTS's transition, whatever order the user listed them in.

The model is tests/helpers/oracle.py's ``FineTuneModel``: its training step raises the real
``torch.OutOfMemoryError`` above a capacity that depends on the trainable parameters, so each
phase's true maximum batch size is known. The schedules are in tests/fts/.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from retune import ScheduledBatchSizeFinder, load_schedule
from tests.helpers.lightning_ns import NAMESPACE, pl
from tests.helpers.oracle import FineTuneModel

fts_module = pytest.importorskip("finetuning_scheduler", reason="finetuning-scheduler is not installed")
if NAMESPACE != "lightning.pytorch":
    pytest.skip("finetuning-scheduler builds on the lightning.pytorch namespace", allow_module_level=True)

pytestmark = [
    # epoch_transitions_only wants a max_transition_epoch on the final phase, and then says so
    pytest.mark.filterwarnings("ignore:Final phase max_transition_epoch"),
]

FinetuningScheduler = fts_module.FinetuningScheduler
FTSCheckpoint = fts_module.FTSCheckpoint
FTSEarlyStopping = fts_module.FTSEarlyStopping

ROOT = Path(__file__).resolve().parents[2]
FTS_DIR = Path(__file__).resolve().parents[1] / "fts"
N = 2048
SHIPPED = ROOT / "schedules" / "fts_phases.yaml"  # fit_start + fts_phase, every search setting at its default


def _schedule(*kinds: str) -> dict[str, Any]:
    """fit_start + ``kinds``, one probe step per trial: the oracle's verdict does not depend on the
    number of steps, and the searches are most of these tests' run time."""
    return {"search": {"steps_per_trial": 1}, "triggers": [{"kind": "fit_start"}, *({"kind": k} for k in kinds)]}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """These models are tiny: on a small shared CPU, torch's thread pool only adds contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class PhasedModel(FineTuneModel):
    """``FineTuneModel`` that also records, at each epoch start, what the epoch trains with.

    The module's ``on_train_epoch_start`` runs after every callback's, finder included, so what it
    records is the state the epoch trains from.
    """

    def __init__(self, record_state: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.record_state = record_state
        self.epoch_trainable: list[int] = []
        self.after_all: dict[int, dict[str, Any]] = {}
        self.epoch_end: dict[int, dict[str, Any]] = {}

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self.epoch_trainable.append(sum(p.numel() for p in self.parameters() if p.requires_grad))
        if self.record_state:
            self.after_all[self.current_epoch] = _training_state(self.trainer)

    def on_train_epoch_end(self) -> None:
        if self.record_state:
            self.epoch_end[self.current_epoch] = copy.deepcopy(self.state_dict())

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        super().validation_step(batch, batch_idx)
        # a deterministic metric for FTSCheckpoint: with mode="min" epoch 0 stays the best checkpoint
        self.log("val_epoch", float(self.current_epoch))


class ViewRecorder:
    """A custom trigger that never fires and records what the finder saw at each epoch start."""

    kind = "recorder"

    def __init__(self) -> None:
        self.seen: list[tuple[int, int | None, int]] = []

    def check(self, view: Any) -> None:
        self.seen.append((view.epoch, view.fts_phase, view.trainable_params))
        return None


class AfterFts(pl.Callback):  # type: ignore[misc,name-defined]
    """Listed after FTS: its epoch-start hook runs after FTS's and before the finder's (which is last)."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, Any]] = {}
        self.best: dict[int, dict[str, Any]] = {}

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        epoch = trainer.current_epoch
        self.states[epoch] = _training_state(trainer)
        path = trainer.checkpoint_callback.best_model_path
        if path:
            self.best[epoch] = torch.load(path, map_location="cpu", weights_only=False)


def _training_state(trainer: Any) -> dict[str, Any]:
    module = trainer.lightning_module
    optimizer = trainer.optimizers[0]
    return {
        "model": copy.deepcopy(module.state_dict()),
        "requires_grad": {n: p.requires_grad for n, p in module.named_parameters()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "schedulers": [copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs],
        "optimizer_obj": optimizer,
        "scheduler_objs": [c.scheduler for c in trainer.lr_scheduler_configs],
    }


def _same(a: Any, b: Any) -> bool:
    """Exact equality of nested state (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if callable(a) or hasattr(a, "__dict__"):
        return a is b
    return bool(a == b)


def _trainer(root: Path, cbs: list[Any], max_epochs: int) -> Any:
    return pl.Trainer(
        max_epochs=max_epochs,
        callbacks=cbs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )


def _fts(schedule: str, **kwargs: Any) -> Any:
    return FinetuningScheduler(ft_schedule=str(FTS_DIR / schedule), **kwargs)


def _phase_trainable(model: FineTuneModel) -> list[int]:
    head = sum(p.numel() for p in model.head.parameters())
    last = sum(p.numel() for p in model.backbone[3].parameters())
    return [head, head + last, sum(p.numel() for p in model.parameters())]


def _phase_of_epoch(transitions: list[int], epochs: int) -> list[int]:
    return [sum(1 for t in transitions if t <= e) for e in range(epochs)]


def _assert_one_search_per_phase(
    trainer: Any, model: PhasedModel, finder: Any, fts: Any, transitions: list[int], trigger: str
) -> None:
    """The shared assertions: one search per transition, each near its phase's true maximum."""
    epochs = trainer.current_epoch
    phases = _phase_of_epoch(transitions, epochs)
    assert trainer.state.finished, "the fit did not complete"
    assert fts.curr_depth == 2
    # each phase thaws more: its true maximum is lower, and FTS's thaw is what the epoch trains
    per_phase_max = [model.epoch_true_max[phases.index(p)] for p in range(3)]
    assert per_phase_max[0] > per_phase_max[1] > per_phase_max[2]
    assert model.epoch_true_max == [per_phase_max[p] for p in phases]
    assert model.epoch_trainable == [_phase_trainable(model)[p] for p in phases]

    assert [e.trigger for e in finder.history] == ["fit_start", trigger, trigger]
    assert [e.epoch for e in finder.history] == [0, *transitions]
    assert [e.direction for e in finder.history] == ["cold", "down", "down"]
    for event in finder.history:
        true_max = model.epoch_true_max[event.epoch]
        assert 0.9 * true_max <= event.batch_size_after <= true_max, (event.epoch, event.batch_size_after, true_max)
    assert finder.batch_size == model.batch_size == finder.history[-1].batch_size_after

    # every epoch, the transition's included, trained at the size found for its phase
    size_of_epoch = [[e.batch_size_after for e in finder.history if e.epoch <= ep][-1] for ep in range(epochs)]
    expected: list[int] = []
    for size in size_of_epoch:
        expected += [size] * (N // size) + ([N % size] if N % size else [])
    assert model.train_batch_sizes == expected
    assert trainer.global_step == sum(math.ceil(N / s) for s in size_of_epoch)
    # FTS's own step count (on_before_zero_grad, a loop hook probes never reach) agrees with Lightning's
    assert fts._fts_state._ft_global_steps == trainer.global_step
    assert trainer.callbacks[-1] is finder


# -- 1 and 5: epoch-driven transitions, finder listed before or after FTS ---------------------------


@pytest.mark.parametrize("finder_first", [True, False], ids=["finder-listed-first", "finder-listed-last"])
def test_epoch_driven_transitions_search_each_phase_after_fts_thawed_it(tmp_path: Path, finder_first: bool) -> None:
    pl.seed_everything(0)
    model = PhasedModel(batch_size=8, n=N)
    recorder = ViewRecorder()
    assert load_schedule(SHIPPED) == load_schedule({"triggers": [{"kind": "fit_start"}, {"kind": "fts_phase"}]})
    finder = ScheduledBatchSizeFinder(SHIPPED, triggers=[recorder], verbose=False)
    fts = _fts("epoch_driven.yaml", epoch_transitions_only=True, restore_best=False)
    ckpt = FTSCheckpoint(monitor="val_loss", save_top_k=1)  # FTS needs one, restore_best or not
    trainer = _trainer(tmp_path, [finder, fts, ckpt] if finder_first else [fts, ckpt, finder], max_epochs=5)
    trainer.fit(model)

    _assert_one_search_per_phase(trainer, model, finder, fts, transitions=[2, 4], trigger="fts_phase")
    # at every epoch start the finder saw FTS's new phase and its thawed parameters, not the last epoch's
    trainable = _phase_trainable(model)
    phases = _phase_of_epoch([2, 4], 5)
    assert recorder.seen == [(e, phases[e], trainable[phases[e]]) for e in range(5)]


# -- 2: early-stopping-driven transitions -------------------------------------------------------


def test_early_stopping_driven_transitions_search_each_phase(tmp_path: Path) -> None:
    """No phase sets ``max_transition_epoch``: FTSEarlyStopping ends every phase.

    ``min_delta=10`` makes it deterministic: the first val_loss record sets the best score, and no
    later record improves on it by 10 (a 4-class cross-entropy starts near 1.4), so with
    ``patience=1`` each phase is complete after one non-improving validation. Phase 0 runs epochs
    0-1, phase 1 epoch 2, phase 2 (final) epoch 3, after which early stopping ends the fit.
    """
    pl.seed_everything(0)
    model = PhasedModel(batch_size=8, n=N)
    finder = ScheduledBatchSizeFinder(_schedule("fts_phase"), verbose=False)
    fts = _fts("es_driven.yaml")  # FTS defaults: early stopping composed with epochs, restore_best=True
    early = FTSEarlyStopping(monitor="val_loss", min_delta=10.0, patience=1)
    ckpt = FTSCheckpoint(monitor="val_loss", save_top_k=1)
    trainer = _trainer(tmp_path, [finder, fts, early, ckpt], max_epochs=10)
    trainer.fit(model)

    assert all(phase["max_transition_epoch"] == -1 for phase in fts.ft_schedule.values())
    assert trainer.current_epoch == 4 and trainer.should_stop, "early stopping in the final phase ends the fit"
    _assert_one_search_per_phase(trainer, model, finder, fts, transitions=[2, 3], trigger="fts_phase")


# -- 3: trainable_params_changed sees FTS's transitions too --------------------------------------


@pytest.mark.parametrize(
    ("kinds", "label"),
    [
        (["trainable_params_changed"], "trainable_params_changed"),
        (["trainable_params_changed", "fts_phase"], "trainable_params_changed+fts_phase"),
    ],
    ids=["trainable-only", "both-give-one-search"],
)
def test_trainable_params_changed_fires_at_each_fts_transition(tmp_path: Path, kinds: list[str], label: str) -> None:
    pl.seed_everything(0)
    model = PhasedModel(batch_size=8, n=N)
    finder = ScheduledBatchSizeFinder(_schedule(*kinds), verbose=False)
    fts = _fts("epoch_driven.yaml", epoch_transitions_only=True, restore_best=False)
    trainer = _trainer(tmp_path, [finder, fts, FTSCheckpoint(monitor="val_loss", save_top_k=1)], max_epochs=5)
    trainer.fit(model)
    _assert_one_search_per_phase(trainer, model, finder, fts, transitions=[2, 4], trigger=label)


# -- 4: FTS's restore_best and retune's snapshot ------------------------------------------------


def _assert_retune_left_fts_state_alone(model: PhasedModel, spy: AfterFts, finder: Any, epochs: int) -> None:
    """What the epoch trains from (recorded after the finder) is exactly what FTS left (recorded
    between FTS and the finder): weights, buffers, requires_grad, optimizer state and hyperparameters,
    LR scheduler state, and the very optimizer and scheduler objects."""
    assert sorted(model.after_all) == sorted(spy.states) == list(range(epochs))
    for epoch in range(epochs):
        fts_left, trained = spy.states[epoch], model.after_all[epoch]
        for key in ("model", "requires_grad", "optimizer", "schedulers"):
            assert _same(trained[key], fts_left[key]), f"epoch {epoch}: retune changed {key} after FTS"
        assert trained["optimizer_obj"] is fts_left["optimizer_obj"]
        assert all(a is b for a, b in zip(trained["scheduler_objs"], fts_left["scheduler_objs"], strict=True))
    # and the searches in between really ran probes (optimizer steps on those weights)
    for event in finder.history[1:]:
        assert any(t.fits for t in event.trials) and any(not t.fits for t in event.trials)


def test_restore_best_weights_survive_the_search_at_each_transition(tmp_path: Path) -> None:
    """FTS rolls back to its best checkpoint at each transition; retune's snapshot/restore, in the
    same ``on_train_epoch_start`` but after FTS, keeps FTS's restored weights and optimizer state.

    The checkpoint monitors ``val_epoch`` (the epoch number) with ``mode="min"``, so the best
    checkpoint is always epoch 0's and each transition visibly rolls two epochs of training back.
    The finder is listed first, the adversarial order.
    """
    pl.seed_everything(0)
    model = PhasedModel(record_state=True, batch_size=8, n=N, scheduler="step")
    finder = ScheduledBatchSizeFinder(_schedule("fts_phase"), verbose=False)
    fts = _fts("epoch_driven.yaml", epoch_transitions_only=True)  # restore_best=True is FTS's default
    spy = AfterFts()
    ckpt = FTSCheckpoint(monitor="val_epoch", mode="min", save_top_k=1)
    trainer = _trainer(tmp_path, [finder, fts, spy, ckpt], max_epochs=5)
    trainer.fit(model)

    assert fts.restore_best
    order = trainer.callbacks
    assert order.index(fts) < order.index(spy) < order.index(finder) == len(order) - 1
    assert [(e.epoch, e.trigger) for e in finder.history] == [(0, "fit_start"), (2, "fts_phase"), (4, "fts_phase")]
    _assert_retune_left_fts_state_alone(model, spy, finder, epochs=5)
    for epoch in (2, 4):
        best = spy.best[epoch]
        assert best["epoch"] == 0, "the setup must keep epoch 0's checkpoint the best"
        restored = spy.states[epoch]
        # FTS restored the checkpoint: weights, buffers and the optimizer state of the restored groups
        assert _same(restored["model"], best["state_dict"])
        assert _same(restored["optimizer"]["state"], best["optimizer_states"][0]["state"])
        # which is not what the previous epoch ended with, so keeping it is not a no-op
        assert not _same(restored["model"], model.epoch_end[epoch - 1])
        # and the epoch trains from those weights, after the search
        assert _same(model.after_all[epoch]["model"], best["state_dict"])
    for event in finder.history:
        true_max = model.epoch_true_max[event.epoch]
        assert 0.9 * true_max <= event.batch_size_after <= true_max


def test_optimizer_and_scheduler_fts_rebuilds_at_a_transition_are_probed_and_left_clean(tmp_path: Path) -> None:
    """A phase with ``new_optimizer`` / ``new_lr_scheduler``: FTS replaces the SGD + StepLR from
    ``configure_optimizers`` with a new AdamW + StepLR at epoch 2. The finder snapshots after that,
    so it probes the new optimizer and leaves it as FTS built it (no state from the probe steps)."""
    pl.seed_everything(0)
    model = PhasedModel(record_state=True, batch_size=8, n=N, scheduler="step")
    finder = ScheduledBatchSizeFinder(_schedule("fts_phase"), verbose=False)
    fts = _fts("reinit_optimizer.yaml", epoch_transitions_only=True)
    spy = AfterFts()
    # mode="max" keeps the latest checkpoint the best: restoring it never mixes SGD state into AdamW
    ckpt = FTSCheckpoint(monitor="val_epoch", mode="max", save_top_k=1)
    trainer = _trainer(tmp_path, [finder, fts, spy, ckpt], max_epochs=5)
    trainer.fit(model)

    _assert_retune_left_fts_state_alone(model, spy, finder, epochs=5)
    before, after = model.after_all[1], model.after_all[2]
    assert isinstance(before["optimizer_obj"], torch.optim.SGD)
    assert isinstance(after["optimizer_obj"], torch.optim.AdamW)
    assert after["scheduler_objs"][0] is not before["scheduler_objs"][0]
    assert after["optimizer"]["state"] == {}, "the probes' AdamW steps must not leave optimizer state behind"
    assert trainer.optimizers[0] is after["optimizer_obj"]
    assert [(e.epoch, e.trigger) for e in finder.history] == [(0, "fit_start"), (2, "fts_phase"), (4, "fts_phase")]
    for event in finder.history:
        true_max = model.epoch_true_max[event.epoch]
        assert 0.9 * true_max <= event.batch_size_after <= true_max


# -- the example -------------------------------------------------------------------------------


def test_example_fts_finetune_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("fts_finetune_example", ROOT / "examples" / "fts_finetune.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # dataclasses look their module up there
    spec.loader.exec_module(example)

    result = example.main(["--root-dir", str(tmp_path), "--quiet"])
    finder, model, fts = result.finder, result.model, result.fts
    assert result.trainer.state.finished
    assert fts.curr_depth == 2
    assert [e.trigger for e in finder.history] == ["fit_start", "fts_phase", "fts_phase"]
    sizes = [e.batch_size_after for e in finder.history]
    assert sizes[0] > sizes[1] > sizes[2]
    for event in finder.history:
        simulated_max = model.epoch_max[event.epoch]
        assert 0.9 * simulated_max <= event.batch_size_after <= simulated_max
