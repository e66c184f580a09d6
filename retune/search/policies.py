"""What else changes with the batch size: gradient accumulation and learning rates.

Changing the batch size mid-run changes the optimisation. Two policies let users choose what
stays constant:

* ``accumulate: keep_effective`` keeps ``batch_size x accumulate_grad_batches`` at the effective
  batch size of the first tune (64 x 1 becomes 16 x 4 after an unfreeze), so the optimizer sees
  the same number of samples per step and the LR schedule stays meaningful;
* ``lr_scaling: linear | sqrt`` scales learning rates with the effective batch size instead:
  by ``k`` (Goyal et al. 2017, for SGD) or ``sqrt(k)`` (Krizhevsky 2014; Malladi et al. 2022 for
  Adam), including the schedulers' base rates so the schedule keeps its shape.

Pure functions over torch objects; the callback decides when to call them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from retune.errors import RetuneError


@dataclass(frozen=True)
class Accumulation:
    """Gradient accumulation for a batch size, and the effective batch size it gives."""

    accumulate: int
    effective: int
    target: int

    @property
    def exact(self) -> bool:
        return self.effective == self.target


def accumulation_for(target_effective: int, batch_size: int) -> Accumulation:
    """The accumulation that brings ``batch_size`` closest to ``target_effective`` (at least 1).

    Example:
        >>> accumulation_for(64, 16)
        Accumulation(accumulate=4, effective=64, target=64)
        >>> accumulation_for(64, 24)   # 64 / 24 = 2.67: the nearest is 3, giving 72
        Accumulation(accumulate=3, effective=72, target=64)
    """
    if batch_size < 1 or target_effective < 1:
        raise ValueError(f"batch sizes must be >= 1, got target {target_effective} and batch {batch_size}")
    accumulate = max(1, round(target_effective / batch_size))
    return Accumulation(accumulate, accumulate * batch_size, target_effective)


def check_accumulation(policy: str, scheduled: bool) -> None:
    """Refuse ``accumulate: keep_effective`` where the run schedules its accumulation itself (``scheduled``:
    a ``GradientAccumulationScheduler`` or a dict ``accumulate_grad_batches``): both would set it.

    >>> check_accumulation("keep_effective", scheduled=False)
    >>> check_accumulation("keep_effective", scheduled=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    retune.errors.RetuneError: apply.accumulate: keep_effective sets gradient accumulation itself ...
    """
    if policy == "keep_effective" and scheduled:
        raise RetuneError(
            "apply.accumulate: keep_effective sets gradient accumulation itself and cannot share it with a "
            "GradientAccumulationScheduler (or a dict `accumulate_grad_batches`); remove one of the two"
        )


def lr_factor(policy: str, old_effective: int, new_effective: int) -> float:
    """How much learning rates scale when the effective batch size goes from old to new."""
    if policy == "none" or old_effective == new_effective:
        return 1.0
    ratio = new_effective / old_effective
    if policy == "linear":
        return ratio
    if policy == "sqrt":
        return math.sqrt(ratio)
    raise ValueError(f"unknown lr_scaling policy {policy!r}")


# Keys in a param group that hold learning rates (OneCycleLR and CyclicLR keep theirs in the group).
GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "base_lr")
# Attributes that hold learning rates, as lists per group or a single value: LR schedulers' (ReduceLROnPlateau
# rebuilds ``min_lrs`` from ``default_min_lr`` when a group is added) and BaseFinetuning's, which sets the
# backbone group's rate from ``previous_backbone_lr`` at every epoch after the unfreeze.
_LR_ATTRS = ("base_lrs", "_last_lr", "min_lrs", "default_min_lr", "max_lrs", "eta_min", "previous_backbone_lr")


def is_rate(value: Any) -> bool:
    return isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool)


def scale_learning_rates(optimizers: Iterable[torch.optim.Optimizer], holders: Iterable[Any], factor: float) -> None:
    """Multiply every learning rate the optimizers and ``holders`` keep by ``factor``.

    Scaling only ``group["lr"]`` would be undone at the scheduler's next step (it recomputes from
    ``base_lrs``), so the schedulers' stored rates move too and the schedule keeps its shape.
    ``holders`` are LR schedulers (nested ones in ``SequentialLR``/``ChainedScheduler`` included) and
    fine-tuning callbacks that remember a rate. Tensor rates are replaced by scaled tensors.
    """
    if factor == 1.0:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for key in GROUP_LR_KEYS:
                if is_rate(group.get(key)):
                    group[key] = group[key] * factor
    seen: set[int] = set()
    pending = list(holders)
    while pending:
        holder = pending.pop()
        if id(holder) in seen:
            continue
        seen.add(id(holder))
        pending.extend(getattr(holder, "_schedulers", []))  # SequentialLR, ChainedScheduler
        for attr in _LR_ATTRS:
            value = getattr(holder, attr, None)
            if isinstance(value, list) and value and all(is_rate(v) for v in value):
                setattr(holder, attr, [v * factor for v in value])
            elif value is not None and is_rate(value):
                setattr(holder, attr, value * factor)


def cycle_mismatch(total: int, taken: int, remaining: int) -> str | None:
    """What goes wrong with a schedule built for ``total`` optimizer steps (``OneCycleLR``'s ``total_steps``) that
    has taken ``taken`` when the fit has ``remaining`` more to take (None: it fits, within a factor of two).

    >>> cycle_mismatch(6, 0, 768)
    "it was built for 6 steps and the fit now takes 768: it raises 'Tried to step 7 times' at step 7"
    >>> cycle_mismatch(768, 0, 45)
    'it was built for 768 steps and the fit now takes 45: the fit ends 6% into its cycle'
    >>> cycle_mismatch(100, 10, 80) is None
    True
    """
    needed = taken + remaining
    if needed > total:
        return (
            f"it was built for {total} steps and the fit now takes {needed}: it raises "
            f"'Tried to step {total + 1} times' at step {total + 1}"
        )
    if total > 2 * needed:
        ends = f"the fit ends {needed / total:.0%} into its cycle"
        return f"it was built for {total} steps and the fit now takes {needed}: {ends}"
    return None


__all__ = [
    "GROUP_LR_KEYS",
    "Accumulation",
    "accumulation_for",
    "check_accumulation",
    "cycle_mismatch",
    "is_rate",
    "lr_factor",
    "scale_learning_rates",
]
