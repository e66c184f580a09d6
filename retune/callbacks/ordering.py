"""Where retune's callbacks run in each hook: after every other callback, the batch-size finder first.

A re-tune must see the model as the epoch will train it, so retune's callbacks run after whatever
freezes or unfreezes (``BackboneFinetuning``, Flash strategies, finetuning-scheduler). When both
finders fire at one epoch start the batch size is searched first and the learning-rate range test
runs at the new size: the rate that suits a batch size depends on it. Each retune callback has a
``_retune_rank`` (batch size 1, learning rate 2; other callbacks 0) and every one of them, in its
``setup`` and ``on_fit_start``, re-sorts the list by it. The sort is stable and the same whichever
callback does it, so the order converges whatever order the user listed them in.
"""

from __future__ import annotations

from typing import Any


def retune_order(callbacks: list[Any]) -> list[Any]:
    """``callbacks`` with retune's moved to the end, by rank; every other callback keeps its place."""
    return sorted(callbacks, key=_rank)


def _rank(callback: Any) -> int:
    rank = getattr(type(callback), "_retune_rank", 0)
    return rank if isinstance(rank, int) else 0


def move_retune_last(trainer: Any) -> None:
    """Re-sort ``trainer.callbacks`` when needed. The list is replaced, not edited, because Lightning
    may be iterating over it right now."""
    ordered = retune_order(list(trainer.callbacks))
    if any(a is not b for a, b in zip(ordered, trainer.callbacks, strict=True)):
        trainer.callbacks = ordered


__all__ = ["move_retune_last", "retune_order"]
