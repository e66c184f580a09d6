"""``set_group_lr`` on its own (torch only): the suggestion becomes each group's nominal rate.

The range test measures the loss at constant rates, so its suggestion is the rate to train at: what
a warmup warms up to, where OneCycle peaks. Every rate that is relative to the nominal one moves by
``suggestion / nominal``; absolute floors stay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as sched

from retune.lr.apply import nominal_lr, set_group_lr

SUGGESTION = 0.003


def _optimizer(lrs: tuple[float, ...] = (0.01,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def _rates(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def _reference(make: Callable[[torch.optim.Optimizer, float], Any], steps: int) -> list[float]:
    """The rates of the same scheduler configured with the suggestion by hand."""
    optimizer = _optimizer((SUGGESTION,))
    return _rates(optimizer, make(optimizer, SUGGESTION), steps)


SCHEDULES: dict[str, Callable[[torch.optim.Optimizer, float], Any]] = {
    "LinearLR warmup": lambda o, lr: sched.LinearLR(o, start_factor=0.1, total_iters=8),
    "LambdaLR warmup from 0": lambda o, lr: sched.LambdaLR(o, lambda e: min(1.0, e / 4)),
    "OneCycleLR": lambda o, lr: sched.OneCycleLR(o, max_lr=lr, total_steps=16),
    "CyclicLR": lambda o, lr: sched.CyclicLR(o, base_lr=lr / 10, max_lr=lr, step_size_up=4),
    "CosineAnnealingLR": lambda o, lr: sched.CosineAnnealingLR(o, T_max=16),
    "StepLR": lambda o, lr: sched.StepLR(o, step_size=3, gamma=0.5),
    "SequentialLR warmup then cosine": lambda o, lr: sched.SequentialLR(
        o,
        [sched.LinearLR(o, start_factor=0.1, total_iters=4), sched.CosineAnnealingLR(o, T_max=12)],
        milestones=[4],
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("after", [0, 5])
def test_the_schedule_runs_as_if_configured_with_the_suggestion(name: str, after: int) -> None:
    """Set at step 0 (fit start) or mid-schedule, the rates from then on are those of the same schedule
    written with the suggestion as its rate: a warmup still warms up, to the suggestion; OneCycle peaks at it."""
    make = SCHEDULES[name]
    optimizer = _optimizer()
    scheduler = make(optimizer, 0.01)
    _rates(optimizer, scheduler, after)
    set_group_lr(optimizer, [0], SUGGESTION, [scheduler])
    got = _rates(optimizer, scheduler, 16 - after)
    assert got == pytest.approx(_reference(make, 16)[after:], rel=1e-9)
    assert max(got) <= SUGGESTION * (1 + 1e-9)


def test_warmup_from_zero_is_not_skipped() -> None:
    optimizer = _optimizer()
    scheduler = sched.LambdaLR(optimizer, lambda e: min(1.0, e / 4))
    assert optimizer.param_groups[0]["lr"] == 0.0
    set_group_lr(optimizer, [0], SUGGESTION, [scheduler])
    assert optimizer.param_groups[0]["lr"] == 0.0  # still the warmup's first step
    assert scheduler.base_lrs == [SUGGESTION]


def test_nominal_rate_of_each_kind() -> None:
    optimizer = _optimizer()
    assert nominal_lr(optimizer, 0) == 0.01  # no scheduler: the rate itself
    warm = sched.LinearLR(optimizer, start_factor=0.1, total_iters=8)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.001)
    assert nominal_lr(optimizer, 0, [warm]) == 0.01  # the configured rate, not the warmup's current one
    cycle_opt = _optimizer()
    sched.OneCycleLR(cycle_opt, max_lr=0.05, total_steps=10)
    assert nominal_lr(cycle_opt, 0) == 0.05
    cyclic_opt = _optimizer()
    cyclic = sched.CyclicLR(cyclic_opt, base_lr=0.001, max_lr=0.02)
    assert nominal_lr(cyclic_opt, 0, [cyclic]) == 0.02


def test_plateau_floor_is_not_rescaled_and_reductions_continue() -> None:
    optimizer = _optimizer((0.01, 0.002))
    plateau = sched.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, min_lr=[1e-3, 1e-4])
    plateau.step(1.0)
    plateau.step(2.0)  # one reduction: 0.005
    set_group_lr(optimizer, [0], SUGGESTION, [plateau])
    assert optimizer.param_groups[0]["lr"] == SUGGESTION  # no initial_lr: the current rate is the nominal one
    assert optimizer.param_groups[1]["lr"] == 0.001  # not chosen: reduced once, as before
    assert plateau.min_lrs == [1e-3, 1e-4]  # the user's floors
    for _ in range(4):
        plateau.step(3.0)
    assert optimizer.param_groups[0]["lr"] == 1e-3


def test_cosine_eta_min_is_not_rescaled() -> None:
    optimizer = _optimizer()
    cosine = sched.CosineAnnealingLR(optimizer, T_max=4, eta_min=1e-4)
    set_group_lr(optimizer, [0], SUGGESTION, [cosine])
    assert cosine.eta_min == 1e-4
    assert cosine.base_lrs == [SUGGESTION]


def test_only_the_chosen_groups_move() -> None:
    optimizer = _optimizer((0.01, 0.001))
    warm = sched.LinearLR(optimizer, start_factor=0.5, total_iters=4)
    set_group_lr(optimizer, [1], SUGGESTION, [warm])
    assert warm.base_lrs == [0.01, SUGGESTION]
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.005, SUGGESTION * 0.5])
    assert optimizer.param_groups[0]["initial_lr"] == 0.01


def test_group_with_zero_nominal_rate_takes_the_suggestion() -> None:
    optimizer = _optimizer((0.0,))
    assert set_group_lr(optimizer, [0], SUGGESTION) == {0: 0.0}
    assert optimizer.param_groups[0]["lr"] == SUGGESTION
