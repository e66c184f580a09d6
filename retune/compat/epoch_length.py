"""The number of training batches of the epoch that starts, when the loader's length changed since it was built.

Lightning counts an epoch's training batches once, when it builds the train loader (2.x
``FitLoop.setup_data``: the combined loader's ``limits`` and ``fit_loop.max_batches``, which is
``trainer.num_training_batches``; 1.9 ``Trainer.reset_train_dataloader``: ``trainer.num_training_batches``),
with ``limit_train_batches`` applied and ``val_check_batch`` derived from it. The epoch ends when that
many batches were read (or the loader runs out). A bucketed loader over a sampler that draws a new
multiset every epoch (``search.batching: buckets`` with a ``WeightedRandomSampler``, say) has a new
number of batches every epoch while the loader object stays the same: without a recount, an epoch
longer than the first is cut short. :func:`refresh_train_batches` recounts from the loader's current
length exactly as Lightning counted at build time, for the epoch that is starting (call it from
``on_train_epoch_start``, after the loop gave the samplers their epoch).
"""

from __future__ import annotations

from typing import Any

from retune.compat.namespace import is_legacy


def _limited(length: int | float, limit: int | float) -> int | float:
    """``length`` batches under ``limit_train_batches`` (an int caps, a float is a fraction), as Lightning parses it."""
    if length == 0 or length == float("inf"):
        return length
    if isinstance(limit, int):
        return min(length, limit)
    return int(length * limit)


def _length(loader: Any) -> int | float:
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return float("inf")


def sampler_epoch(trainer: Any) -> int:
    """The epoch Lightning gives the train samplers (``set_epoch``) for the epoch that starts or runs.

    ``trainer.current_epoch`` lags it between a checkpoint's restore and the fit loop's start (2.x builds
    the train loader before it moves ``current_epoch`` to the restored epoch): a loader that draws its
    epoch's samples when it is built must draw for this one.
    """
    return int(trainer.fit_loop.epoch_progress.current.processed)


def refresh_train_batches(trainer: Any) -> int | float:
    """Recount the training batches of the epoch that starts from the train loader's length now; the new count.

    Everything Lightning derived from the count at build time follows: the per-loader limits (2.x), the
    loop's batch count (``trainer.num_training_batches``) and, for a fractional ``val_check_interval``,
    ``trainer.val_check_batch``. ``limit_train_batches`` applies as Lightning applies it.
    """
    limit = trainer.limit_train_batches
    if is_legacy(trainer):
        combined = trainer.train_dataloader
        if combined is None:
            return float(trainer.num_training_batches)
        count: int | float = _limited(_length(combined), limit)
        trainer.num_training_batches = count
    else:
        loop = trainer.fit_loop
        combined = loop._combined_loader
        if combined is None:
            return float(loop.max_batches)
        limits = [_limited(_length(loader), limit) for loader in combined.flattened]
        combined.limits = limits
        if combined._iterator is not None:  # the epoch's iterator (made at build time) counts with its own copy
            combined._iterator.limits = limits
        count = _length(combined)  # the combined loader applies the limits, as Lightning's ``sized_len`` reads it
        loop.max_batches = count
        if getattr(trainer, "_val_check_time_interval", None) is not None:
            return count  # validation by wall time: no batch-based check to move
    interval = trainer.val_check_interval
    if not isinstance(interval, int) and count != float("inf"):
        trainer.val_check_batch = max(1, int(count * interval))
    return count


__all__ = ["refresh_train_batches", "sampler_epoch"]
