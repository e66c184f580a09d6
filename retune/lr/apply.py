"""Put a learning rate found by a range test on some param groups, and on whatever remembers their rates.

The range test measures the loss at constant rates (the scheduler is not stepped during it), so its
suggestion is a rate to train at, the rate a user writes into ``configure_optimizers``: the group's
**nominal** rate. That is OneCycleLR's ``max_lr`` (the peak), CyclicLR's ``max_lrs`` entry, or else
the rate the scheduler was built from (the group's ``initial_lr``, the scheduler's ``base_lrs``), or,
with no scheduler that records one (ReduceLROnPlateau, none), the group's current rate. Each chosen
group's rates move by one factor, ``suggestion / nominal``: the nominal values, the current rate
(which a warmup or a cycle has already moved away from the nominal one) and every other relative rate
(``min_lr`` of OneCycleLR, ``_last_lr``). So a warmup still warms up, now to the suggestion, OneCycle
peaks at it, and a decay continues its shape from it. Absolute floors (ReduceLROnPlateau's
``min_lrs``, CosineAnnealing's ``eta_min``) are the user's bounds, not rates relative to the nominal
one, and stay as they are.

Setting ``group["lr"]`` alone would not last: an LR scheduler recomputes each group's rate from its
``base_lrs`` (closed form) or the group's current rate (chainable form), OneCycleLR and CyclicLR keep
``initial_lr``/``max_lr``/``min_lr`` in the group or ``max_lrs`` on themselves, and ``BaseFinetuning``
callbacks remember the backbone group's rate (``previous_backbone_lr``) and set it again at every
epoch. A later ``apply.lr_scaling`` of the batch-size finder scales the new rates as before.

Torch only, no Lightning: the callback passes the optimizer and the objects that hold rates.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from retune.search.policies import GROUP_LR_KEYS, is_rate

# per-group lists kept by LR schedulers that move with the group's nominal rate (ReduceLROnPlateau's ``min_lrs``
# and CosineAnnealing's ``eta_min`` are absolute floors the user set, and are left alone)
_PER_GROUP_ATTRS = ("base_lrs", "_last_lr", "max_lrs")


def nominal_lr(optimizer: torch.optim.Optimizer, index: int, holders: Iterable[Any] = ()) -> float:
    """The rate group ``index`` is configured to train at, which a range test's suggestion replaces.

    OneCycleLR's ``max_lr`` (kept in the group), CyclicLR's ``max_lrs`` entry, else the rate the
    scheduler was built from (``initial_lr``, which every torch scheduler writes into the group), else
    the group's current rate.

    Args:
        optimizer: the optimizer holding the group.
        index: the index of the group in ``optimizer.param_groups``.
        holders: this optimizer's LR schedulers (and fine-tuning callbacks) that may keep the group's configured
            rate.
    """
    group = optimizer.param_groups[index]
    if is_rate(group.get("max_lr")):
        return float(group["max_lr"])
    for holder in _own(holders, optimizer):
        peaks = getattr(holder, "max_lrs", None)
        if isinstance(peaks, list) and index < len(peaks) and is_rate(peaks[index]):
            return float(peaks[index])
    if is_rate(group.get("initial_lr")):
        return float(group["initial_lr"])
    return float(group["lr"])


def set_group_lr(
    optimizer: torch.optim.Optimizer, groups: Sequence[int], lr: float, holders: Iterable[Any] = ()
) -> dict[int, float]:
    """Make ``lr`` the nominal rate of ``optimizer.param_groups[i]`` for each ``i`` in ``groups``; return the factors.

    ``holders`` are LR schedulers of this optimizer (nested ``SequentialLR``/``ChainedScheduler``
    children included) and fine-tuning callbacks with a ``previous_backbone_lr``, which belongs to the
    last group (``BaseFinetuning.unfreeze_and_add_param_group`` appends the backbone's group). Every
    rate of a group that moves with its nominal rate is multiplied by ``lr / nominal`` (see the module
    docstring); a group whose nominal rate is 0 takes ``lr`` everywhere (there is no factor to scale by).

    Args:
        optimizer: the optimizer whose groups to set.
        groups: indices into ``optimizer.param_groups``.
        lr: the new nominal rate.
        holders: LR schedulers of this optimizer and fine-tuning callbacks that keep a copy of the rate.
    """
    owned = _own(holders, optimizer)
    factors: dict[int, float] = {}
    nominals: dict[int, float] = {}
    for index in groups:
        group = optimizer.param_groups[index]
        nominal = nominal_lr(optimizer, index, owned)
        nominals[index] = nominal
        factor = lr / nominal if nominal > 0 else 0.0
        factors[index] = factor
        for key in GROUP_LR_KEYS:
            if is_rate(group.get(key)):
                group[key] = _moved(group[key], nominal, factor, lr)
    last = len(optimizer.param_groups) - 1
    for holder in owned:
        for attr in _PER_GROUP_ATTRS:
            values = getattr(holder, attr, None)
            if not (isinstance(values, list) and values and all(is_rate(v) for v in values)):
                continue
            updated = list(values)
            for index, factor in factors.items():
                if index < len(updated):  # a group added after the scheduler was built has no entry
                    updated[index] = _moved(updated[index], nominals[index], factor, lr)
            setattr(holder, attr, updated)
        if last in factors and is_rate(getattr(holder, "previous_backbone_lr", None)):
            holder.previous_backbone_lr = optimizer.param_groups[last]["lr"]
    return factors


def _moved(value: Any, nominal: float, factor: float, lr: float) -> Any:
    """A stored rate moved with its group: exactly ``lr`` where it equals the nominal rate (no rounding) or
    where there is no factor, else scaled by the factor."""
    if not factor or value == nominal:
        return lr
    return value * factor


def _own(holders: Iterable[Any], optimizer: torch.optim.Optimizer) -> list[Any]:
    """``holders`` with nested schedulers unnested, less the schedulers of other optimizers."""
    owned = []
    for holder in _unnested(holders):
        scheduled = getattr(holder, "optimizer", optimizer)
        if scheduled is not optimizer and getattr(scheduled, "optimizer", None) is not optimizer:
            continue  # another optimizer's scheduler
        owned.append(holder)
    return owned


def _unnested(holders: Iterable[Any]) -> list[Any]:
    found: list[Any] = []
    seen: set[int] = set()
    pending = list(holders)
    while pending:
        holder = pending.pop(0)
        if id(holder) in seen:
            continue
        seen.add(id(holder))
        found.append(holder)
        pending.extend(getattr(holder, "_schedulers", []))
    return found


__all__ = ["nominal_lr", "set_group_lr"]
