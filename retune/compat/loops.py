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


__all__ = ["automatic_loop", "batch_index", "batch_is_accumulating", "eval_loop", "trainer_fn"]
