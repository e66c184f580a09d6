"""The loop objects retune reaches into: which one runs a stage, and where a training batch is."""

from __future__ import annotations

from typing import Any

from retune.compat.namespace import is_legacy


def trainer_fn(trainer: Any) -> str:
    """``fit``, ``validate``, ``test`` or ``predict``: what the trainer is running."""
    fn = trainer.state.fn
    return str(getattr(fn, "value", fn))


def eval_loop(trainer: Any, stage: str) -> Any:
    """The 2.x loop that runs ``stage`` now: validation inside fit, or the validate/test/predict loop."""
    if stage == "val":
        return trainer.validate_loop if trainer_fn(trainer) == "validate" else trainer.fit_loop.epoch_loop.val_loop
    return trainer.test_loop if stage == "test" else trainer.predict_loop


def automatic_loop(trainer: Any) -> Any:
    """The loop object that builds each training batch's closure (``_make_closure``) in automatic optimization."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if is_legacy(trainer):
        return epoch_loop.batch_loop.optimizer_loop
    return epoch_loop.automatic_optimization


def batch_is_accumulating(trainer: Any) -> bool:
    """True while the current training batch ends without an optimizer step (inside an accumulation window)."""
    loop = trainer.fit_loop.epoch_loop if is_legacy(trainer) else trainer.fit_loop
    return bool(loop._should_accumulate())


def batch_index(trainer: Any) -> int:
    """The index within the epoch of the train batch being run now (both Lightning lines)."""
    return int(trainer.fit_loop.epoch_loop.batch_idx)


def resumed_batches(trainer: Any) -> int:
    """The batches of the current epoch that a fit restored mid-epoch from a checkpoint counts as trained
    (the ``batch_idx`` its next batch gets); 0 when the fit did not restart mid-epoch.

    Both lines restart the train loader from its first batch while ``batch_idx`` continues, so a loader
    whose epoch is a fixed plan skips this many batches to continue where the checkpoint left off. Called
    where the loop requests its train loader: on 2.x in ``setup_data``, before the epoch loop's
    ``reset`` turns a checkpoint saved in ``on_train_batch_end`` into one more completed batch (mirrored
    here: ``_TrainingEpochLoop.update_restart_stage``'s ``RESTARTED_ON_TRAIN_BATCH_END``); on 1.9 in
    ``on_run_start``, where ``reset_on_restart`` will make ``ready`` the completed count (1.9 trains the
    batch a checkpoint was saved after once more: its ``completed`` counter does not include it).
    """
    loop = trainer.fit_loop
    if not loop.restarting:
        return 0
    batches = loop.epoch_loop.batch_progress
    if is_legacy(trainer):
        return int(batches.current.completed)
    epochs = loop.epoch_progress.total
    mid_epoch = (  # _FitLoop.update_restart_stage's RESTARTED_MID_EPOCH
        epochs.started == epochs.ready
        and epochs.processed == epochs.started - 1
        and epochs.completed == epochs.processed
    )
    if not mid_epoch:
        return 0
    total = batches.total
    on_batch_end = (
        total.started == total.ready and total.processed == total.started and total.completed == total.processed - 1
    )
    return int(batches.current.completed) + int(on_batch_end)


__all__ = ["automatic_loop", "batch_index", "batch_is_accumulating", "eval_loop", "resumed_batches", "trainer_fn"]


def logger_step(trainer: Any) -> int:
    """The step Lightning's logger connector logs ``self.log`` values at (``_batches_that_stepped``: batches
    whose optimizer step ran, both lines), so retune's metrics line up with the run's own; ``global_step``
    counts every optimizer's steps (two optimizers, manual optimization) and drifts from it."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    stepped = getattr(loop, "_batches_that_stepped", None)
    return int(stepped) if isinstance(stepped, int) else int(trainer.global_step)
