"""What the train- and eval-step recoveries share: micro-batch sizes, their loss weights, the kept split.

A recovered step runs its batch as micro-batches (:func:`~retune.recovery.split.split_batch`); both
recoveries need to know how many samples each one holds (:func:`samples_in`, :func:`largest_piece`),
when a split cannot go further (:func:`all_single`), and, once a batch needed a split, to keep it for
the rest of the loop (:class:`KeptSplit`) and report it (:class:`Recovered`). :func:`loss_weights` is
what makes a recovered training step's update the whole batch's: each micro-batch's loss weighted by
its share, as :class:`~retune.recovery.train_step.TrainStepRecovery` does and the fit-start check in
:mod:`retune.recovery.exactness` replays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from retune import messages
from retune.recovery.loss_items import ItemsFn, count_items, resolve_items_fn
from retune.recovery.split import Readings, batch_length

LossReduction = Literal["mean", "sum", "token_mean"]


@dataclass(frozen=True)
class Recovered:
    """What one recovered (or proactively split) step did."""

    samples: int
    pieces: int
    """How many micro-batches the batch finally trained as."""
    failed_in: str
    """``forward``, ``backward``, ``a micro-batch`` or the hook that ran out of memory (``on_before_backward``)."""
    micro_size: int | None = None
    """The largest micro-batch's samples (None when the micro-batches do not tell their size)."""


class KeptSplit:
    """The split a recovery keeps for the rest of the loop once a batch needed it (training and evaluation).

    A mixin: the recovery sets ``max_size``, ``pieces`` and ``on_recovered`` in its constructor.
    """

    max_size: int | None  # the largest micro-batch (samples) for the rest of the loop
    pieces: int  # the same, for micro-batches that do not tell their size (a custom split_batch)
    on_recovered: Callable[[Recovered], None] | None

    def _keep(self, micro: list[Any], sized: bool, total: int | None, failed_in: str) -> None:
        """Remember the split that worked and report the recovery (``failed_in``: where the batch failed).

        The largest micro-batch is kept where sizes are known, not the number of pieces: a later, shorter
        batch (the epoch's last, a short length bucket) is then cut no more than it needs.
        """
        largest = largest_piece(micro)
        if sized and largest is not None:
            self.max_size = largest if self.max_size is None else min(self.max_size, largest)
        else:
            self.pieces = max(self.pieces, len(micro))
        if failed_in and self.on_recovered is not None:
            self.on_recovered(Recovered(total or 0, len(micro), failed_in, largest))


def samples_in(micro: Any, readings: Readings | None = None) -> int | None:
    """Samples in a micro-batch (or a batch, read with the run's ``readings``): its tensors' shared first dimension,
    else ``len()``, else unknown."""
    try:
        found = batch_length(micro, readings)
    except TypeError:
        found = None
    if found is None:
        try:
            found = len(micro)
        except TypeError:
            return None
    return found


def largest_piece(micro: Sequence[Any]) -> int | None:
    """The largest micro-batch's samples, or None when one does not tell its size."""
    sizes = [samples_in(m) for m in micro]
    return None if any(n is None for n in sizes) else max(n or 0 for n in sizes)


def all_single(micro: Sequence[Any]) -> bool:
    """True when every micro-batch holds one sample (a split cannot go further)."""
    sizes = [samples_in(m) for m in micro]
    return all(n is not None and n <= 1 for n in sizes)


def loss_weights(micro: Sequence[Any], reduction: LossReduction, items_fn: ItemsFn | None = None) -> list[float]:
    """Each micro-batch's loss weight (a recovered step's, and the fit-start exactness check's): its share of
    the samples for a mean loss (equal shares when a custom micro-batch does not tell its size), its share of
    the counted items for a token mean (0 for every piece of a batch with none: no division by zero), 1 for a
    sum."""
    if reduction == "sum":
        return [1.0] * len(micro)
    if reduction == "token_mean":
        counts = [count_items(items_fn or resolve_items_fn(None), m) for m in micro]
        items = sum(counts)
        return [c / items if items else 0.0 for c in counts]
    sizes = [samples_in(m) for m in micro]
    if any(n is None for n in sizes):
        messages.warn(
            "retune cannot tell how many samples the micro-batches from split_batch hold (no tensors with a "
            "batch dimension, no len()); their losses are weighted equally, which equals the whole batch's "
            "update only when the pieces are equal. Give the micro-batch type a __len__."
        )
        return [1.0 / len(micro)] * len(micro)
    total = sum(n or 0 for n in sizes) or 1
    return [(n or 0) / total for n in sizes]


__all__ = [
    "KeptSplit",
    "LossReduction",
    "Recovered",
    "all_single",
    "largest_piece",
    "loss_weights",
    "samples_in",
]
