"""Put a learning rate found by a range test on some param groups, and on whatever remembers their rates.

Setting ``group["lr"]`` alone does not last: an LR scheduler recomputes each group's rate from its
``base_lrs`` (closed form) or the group's current rate (chainable form), OneCycleLR and CyclicLR
keep ``initial_lr``/``max_lr``/``min_lr`` in the group, and ``BaseFinetuning`` callbacks remember
the backbone group's rate (``previous_backbone_lr``) and set it again at every epoch. So each chosen
group's rates move by the same factor, ``new / current``: the group's rate keys, and each scheduler's
per-group lists at that group's index. A scheduler mid-way through its schedule continues its shape
from the new rate (at fit start, where nothing has decayed yet, ``base_lrs`` becomes the new rate
itself), and a later ``apply.lr_scaling`` of the batch-size finder scales the new rates as before.

Torch only, no Lightning: the callback passes the optimizer and the objects that hold rates.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from retune.apply import _GROUP_LR_KEYS, _is_rate

# per-group lists kept by LR schedulers (``eta_min`` and ``default_min_lr`` are one value for every group)
_PER_GROUP_ATTRS = ("base_lrs", "_last_lr", "min_lrs", "max_lrs")


def set_group_lr(
    optimizer: torch.optim.Optimizer, groups: Sequence[int], lr: float, holders: Iterable[Any] = ()
) -> dict[int, float]:
    """Set ``lr`` on ``optimizer.param_groups[i]`` for each ``i`` in ``groups``; return the factor applied to each.

    ``holders`` are LR schedulers of this optimizer (nested ``SequentialLR``/``ChainedScheduler``
    children included) and fine-tuning callbacks with a ``previous_backbone_lr``, which belongs to the
    last group (``BaseFinetuning.unfreeze_and_add_param_group`` appends the backbone's group). A group
    whose rate is 0 takes ``lr`` everywhere directly (there is no factor to scale by).
    """
    factors: dict[int, float] = {}
    currents: dict[int, float] = {}
    for index in groups:
        group = optimizer.param_groups[index]
        current = float(group["lr"])
        currents[index] = current
        factor = lr / current if current > 0 else 0.0
        factors[index] = factor
        for key in _GROUP_LR_KEYS:
            if key != "lr" and _is_rate(group.get(key)):
                group[key] = _moved(group[key], current, factor, lr)
        group["lr"] = lr
    last = len(optimizer.param_groups) - 1
    for holder in _unnested(holders):
        scheduled = getattr(holder, "optimizer", optimizer)
        if scheduled is not optimizer and getattr(scheduled, "optimizer", None) is not optimizer:
            continue  # another optimizer's scheduler
        for attr in _PER_GROUP_ATTRS:
            values = getattr(holder, attr, None)
            if not (isinstance(values, list) and values and all(_is_rate(v) for v in values)):
                continue
            updated = list(values)
            for index, factor in factors.items():
                if index < len(updated):  # a group added after the scheduler was built has no entry
                    updated[index] = _moved(updated[index], currents[index], factor, lr)
            setattr(holder, attr, updated)
        if last in factors and _is_rate(getattr(holder, "previous_backbone_lr", None)):
            holder.previous_backbone_lr = lr
    return factors


def _moved(value: Any, current: float, factor: float, lr: float) -> Any:
    """A stored rate moved with its group: exactly ``lr`` where it equals the group's current rate (fit
    start: nothing has decayed yet) or where there is no factor, else scaled by the factor."""
    if not factor or value == current:
        return lr
    return value * factor


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
