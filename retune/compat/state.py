"""Trainer state a probe step can change besides the module and optimizers: loop progress, schedulers,
the grad scaler, accumulation, and the callbacks that remember learning rates.

Internals used and why: the fit loop tree's progress objects and counters, which a probe's
manual-optimization step increments, so that a snapshot can put them back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from retune.compat.namespace import is_legacy


def loop_progress(trainer: Any) -> list[Any]:
    """Progress-tracking objects in the fit loop tree (they have ``state_dict``/``load_state_dict``)."""
    found: list[Any] = []
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for value in vars(obj).values():
            if dataclasses.is_dataclass(value) and hasattr(value, "load_state_dict"):
                found.append(value)
            elif _is_loop(value):
                walk(value)

    walk(trainer.fit_loop)
    return found


def _is_loop(value: Any) -> bool:
    return any(cls.__name__ in ("_Loop", "Loop") for cls in type(value).__mro__) and hasattr(value, "trainer")


def loop_counters(trainer: Any) -> list[tuple[Any, str]]:
    """Plain int counters a step increments outside the progress objects."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return [(epoch_loop, "_batches_that_stepped")] if hasattr(epoch_loop, "_batches_that_stepped") else []


def lr_schedulers(trainer: Any) -> list[Any]:
    return [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", [])]


def lr_holders(trainer: Any) -> list[Any]:
    """Objects that keep learning rates besides the optimizers: LR schedulers, and fine-tuning callbacks
    (``BaseFinetuning`` remembers the backbone's rate and re-applies it every epoch)."""
    callbacks = [cb for cb in trainer.callbacks if hasattr(cb, "previous_backbone_lr")]
    return [*lr_schedulers(trainer), *callbacks]


def grad_scaler(trainer: Any) -> Any | None:
    return getattr(trainer.precision_plugin, "scaler", None)


def reduced_precision(trainer: Any) -> bool:
    """True when the training step computes below float32: 16-bit mixed or true precision, transformer-engine,
    fp8 (2.x names such as ``"bf16-mixed"``; 1.9's ``16``, ``"bf16"``); full: ``32``/``64`` in any spelling."""
    precision = str(getattr(trainer, "precision", "32"))
    return not precision.startswith(("32", "64"))


def fts_phase(trainer: Any) -> int | None:
    """finetuning-scheduler's current phase, found by duck typing so FTS stays an optional install."""
    for callback in trainer.callbacks:
        depth = getattr(callback, "curr_depth", None)
        if isinstance(depth, int) and hasattr(callback, "ft_schedule"):
            return depth
    return None


def get_accumulation(trainer: Any) -> int:
    return int(trainer.accumulate_grad_batches)


def set_accumulation(trainer: Any, value: int) -> None:
    """Set gradient accumulation for the epoch that is starting.

    On 2.x the loop reads ``trainer.accumulate_grad_batches`` at every batch. On 1.9 the trainer's
    internal accumulation scheduler rewrites it at each epoch start (before callbacks run), so the
    callback sets it again every epoch.
    """
    trainer.accumulate_grad_batches = value


def accumulation_is_scheduled(trainer: Any) -> bool:
    """True when a ``GradientAccumulationScheduler`` changes accumulation by epoch."""
    schedulers = [
        cb
        for cb in trainer.callbacks
        if any(cls.__name__ == "GradientAccumulationScheduler" for cls in type(cb).__mro__)
    ]
    if is_legacy(trainer):
        schedulers.append(trainer.accumulation_scheduler)
    for scheduler in schedulers:
        scheduling = getattr(scheduler, "scheduling", {})
        if len(scheduling) > 1 or any(epoch != 0 for epoch in scheduling):
            return True
    return False


__all__ = [
    "accumulation_is_scheduled",
    "fts_phase",
    "get_accumulation",
    "grad_scaler",
    "loop_counters",
    "loop_progress",
    "lr_holders",
    "lr_schedulers",
    "reduced_precision",
    "set_accumulation",
]


def cycle_schedulers(trainer: Any) -> list[Any]:
    """LR schedulers stepped once per optimizer step whose length is fixed in steps when built (``total_steps``:
    ``OneCycleLR``, often sized from ``trainer.estimated_stepping_batches`` in ``configure_optimizers``)."""
    return [
        config.scheduler
        for config in getattr(trainer, "lr_scheduler_configs", [])
        if getattr(config, "interval", None) == "step"
        and getattr(config, "frequency", 1) == 1
        and isinstance(getattr(config.scheduler, "total_steps", None), int)
    ]


def remaining_optimizer_steps(trainer: Any) -> int | None:
    """The optimizer steps the fit takes from this epoch start on, at the loader and accumulation in force now
    (None: the fit's length is not known, an iterable loader without a length or no epoch limit)."""
    batches = getattr(trainer, "num_training_batches", None)
    if not isinstance(batches, int) or batches <= 0:
        return None
    per_epoch = -(-batches // max(1, get_accumulation(trainer)))
    max_epochs = getattr(trainer, "max_epochs", None)
    max_steps = getattr(trainer, "max_steps", -1)
    by_epochs = None
    if isinstance(max_epochs, int) and max_epochs >= 0:
        by_epochs = per_epoch * max(0, max_epochs - int(trainer.current_epoch))
    by_steps = max_steps - int(trainer.global_step) if isinstance(max_steps, int) and max_steps >= 0 else None
    known = [n for n in (by_epochs, by_steps) if n is not None]
    return min(known) if known else None
