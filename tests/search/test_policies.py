"""What else changes with the batch size: ``apply.accumulate`` and ``apply.lr_scaling``.

Requirements under test:

1. ``accumulate: keep_effective`` sets gradient accumulation after a re-tune so that batch size x
   accumulation stays the effective batch size of the first tune (64 x 1 becomes 16 x 4); the
   nearest accumulation with a warning when it does not divide; refused (clear error) next to a
   ``GradientAccumulationScheduler``. An accumulated step has the full-batch gradient.
2. ``lr_scaling: linear | sqrt`` multiplies every param group's learning rate by ``k`` or
   ``sqrt(k)`` when the effective batch size changes by ``k``, including the schedulers' stored
   rates, so the schedule keeps its shape; the factor is recorded in the event.

The Lightning runs use a tiny linear model whose training step raises the real
``torch.OutOfMemoryError`` above a per-phase limit (frozen backbone / unfrozen, or by epoch), and
binsearch with ``margin: 0``, so every size found is exactly that limit.
"""

from __future__ import annotations

import doctest
import functools
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler as sched
from torch.utils.data import DataLoader, TensorDataset

import retune.search.policies
from retune import RetuneError, ScheduledBatchSizeFinder, ScheduleError, load_schedule
from retune.search.policies import Accumulation, accumulation_for, lr_factor, scale_learning_rates
from tests.helpers.lightning_ns import LEGACY, callbacks, pl, seed
from tests.helpers.retune_warnings import retune_warnings

# == the schedule keys ==========================================================================


def test_apply_defaults_to_free_accumulation_and_no_lr_scaling() -> None:
    schedule = load_schedule({"triggers": [{"kind": "fit_start"}]})
    assert (schedule.apply.accumulate, schedule.apply.lr_scaling) == ("free", "none")


@pytest.mark.parametrize(
    ("apply", "message"),
    [
        ({"accumulate": "keep"}, "apply.accumulate: Input should be 'free' or 'keep_effective'"),
        ({"lr_scaling": "Linear"}, "apply.lr_scaling: Input should be 'none', 'linear' or 'sqrt'"),
        ({"lr_scaling": "cubic"}, "apply.lr_scaling"),
        ({"scale": "linear"}, "scale"),
    ],
)
def test_apply_rejects_unknown_policies(apply: dict[str, str], message: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(message)):
        load_schedule({"triggers": [{"kind": "fit_start"}], "apply": apply})


# == unit: accumulation_for ====================================================================


@pytest.mark.parametrize(
    ("target", "batch", "accumulate"),
    [(64, 16, 4), (64, 64, 1), (64, 32, 2), (48, 16, 3), (64, 1, 64), (1, 1, 1), (96, 8, 12)],
)
def test_accumulation_for_exact_multiples(target: int, batch: int, accumulate: int) -> None:
    plan = accumulation_for(target, batch)
    assert plan == Accumulation(accumulate=accumulate, effective=target, target=target)
    assert plan.exact


@pytest.mark.parametrize(
    ("target", "batch", "accumulate", "effective"),
    [
        (64, 24, 3, 72),  # 2.67 -> 3
        (64, 26, 2, 52),  # 2.46 -> 2
        (64, 40, 2, 80),  # 1.6 -> 2
        (64, 48, 1, 48),  # 1.33 -> 1
        (64, 100, 1, 100),  # a batch above the target still accumulates at least 1
        (64, 1000, 1, 1000),
    ],
)
def test_accumulation_for_nearest_when_not_a_multiple(target: int, batch: int, accumulate: int, effective: int) -> None:
    plan = accumulation_for(target, batch)
    assert (plan.accumulate, plan.effective, plan.target) == (accumulate, effective, target)
    assert not plan.exact


def test_accumulation_for_is_the_nearest_over_a_grid() -> None:
    for target in range(1, 130):
        for batch in range(1, 130):
            plan = accumulation_for(target, batch)
            best = min(abs(a * batch - target) for a in range(1, target // batch + 3))
            assert plan.accumulate >= 1
            assert plan.effective == plan.accumulate * batch
            assert abs(plan.effective - target) == best, (target, batch, plan)
            assert plan.exact == (target % batch == 0)


@pytest.mark.parametrize(("target", "batch"), [(0, 16), (64, 0), (-64, 16), (64, -1)])
def test_accumulation_for_rejects_sizes_below_one(target: int, batch: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        accumulation_for(target, batch)


# == unit: lr_factor ===========================================================================


@pytest.mark.parametrize(
    ("policy", "old", "new", "expected"),
    [
        ("none", 64, 16, 1.0),
        ("none", 16, 64, 1.0),
        ("linear", 64, 16, 0.25),
        ("linear", 16, 64, 4.0),
        ("linear", 64, 72, 72 / 64),
        ("sqrt", 64, 16, 0.5),
        ("sqrt", 16, 64, 2.0),
        ("sqrt", 64, 32, math.sqrt(0.5)),
        ("linear", 64, 64, 1.0),
        ("sqrt", 64, 64, 1.0),
    ],
)
def test_lr_factor(policy: str, old: int, new: int, expected: float) -> None:
    assert math.isclose(lr_factor(policy, old, new), expected, rel_tol=1e-12)


def test_lr_factor_rejects_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown lr_scaling policy 'cubic'"):
        lr_factor("cubic", 64, 16)


def test_apply_module_doctests() -> None:
    result = doctest.testmod(retune.search.policies, verbose=False)
    assert result.attempted >= 2
    assert result.failed == 0


# == unit: scale_learning_rates on real optimizers and schedulers ==============================

LRS = (0.1, 0.02)  # two param groups with different rates


def _optimizer(kind: str = "sgd") -> torch.optim.Optimizer:
    groups = [{"params": [nn.Parameter(torch.ones(2))], "lr": lr} for lr in LRS]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=LRS[0])
    return torch.optim.SGD(groups, lr=LRS[0], momentum=0.9)


def _step(optimizer: torch.optim.Optimizer, scheduler: Any, metric: float) -> None:
    optimizer.step()  # no gradients: a no-op, called so torch sees the documented order
    if isinstance(scheduler, sched.ReduceLROnPlateau):
        scheduler.step(metric)
    else:
        scheduler.step()


def _lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(group["lr"]) for group in optimizer.param_groups]


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda o: sched.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, milestones=[3, 7], gamma=0.3),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, gamma=0.9),
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda e: 1 / (1 + e)),
    "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.2, total_iters=6),
    "CosineAnnealingLR-eta_min": lambda o: sched.CosineAnnealingLR(o, T_max=4, eta_min=0.004),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=3, eta_min=0.004),
    "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=[0.2, 0.04], total_steps=24),
    "OneCycleLR-linear-three-phase": lambda o: sched.OneCycleLR(
        o, max_lr=[0.2, 0.04], total_steps=24, anneal_strategy="linear", three_phase=True
    ),
    "CyclicLR": lambda o: sched.CyclicLR(o, base_lr=[0.01, 0.002], max_lr=[0.1, 0.05], step_size_up=3),
    "CyclicLR-exp_range": lambda o: sched.CyclicLR(
        o, base_lr=0.01, max_lr=0.1, step_size_up=2, step_size_down=3, mode="exp_range", gamma=0.9
    ),
    "ReduceLROnPlateau-min_lrs": lambda o: sched.ReduceLROnPlateau(o, factor=0.5, patience=0, min_lr=[0.01, 0.004]),
    "ReduceLROnPlateau-scalar-min_lr": lambda o: sched.ReduceLROnPlateau(o, factor=0.5, patience=1, min_lr=0.003),
}


@pytest.mark.parametrize("factor", [0.25, 0.5, 3.0])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scaled_schedule_is_the_unscaled_schedule_times_k(name: str, factor: float) -> None:
    """Scale mid-schedule; every later rate of every group is ``factor`` x the unscaled twin's."""
    make = SCHEDULERS[name]
    plain_opt, scaled_opt = _optimizer(), _optimizer()
    plain, scaled = make(plain_opt), make(scaled_opt)
    # a plateau metric that never improves, so ReduceLROnPlateau keeps reducing down to its floor
    metrics = iter([1.0] * 100)
    for _ in range(3):
        metric = next(metrics)
        _step(plain_opt, plain, metric)
        _step(scaled_opt, scaled, metric)
    assert _lrs(scaled_opt) == _lrs(plain_opt)

    scale_learning_rates([scaled_opt], [scaled], factor)
    for a, b in zip(_lrs(plain_opt), _lrs(scaled_opt), strict=True):
        assert math.isclose(b, factor * a, rel_tol=1e-9)

    sequence_plain, sequence_scaled = [], []
    for _ in range(18):
        metric = next(metrics)
        _step(plain_opt, plain, metric)
        _step(scaled_opt, scaled, metric)
        sequence_plain.append(_lrs(plain_opt))
        sequence_scaled.append(_lrs(scaled_opt))
        for a, b in zip(plain.get_last_lr(), scaled.get_last_lr(), strict=True):
            assert math.isclose(float(b), factor * float(a), rel_tol=1e-9)
    for step, (a_row, b_row) in enumerate(zip(sequence_plain, sequence_scaled, strict=True)):
        for a, b in zip(a_row, b_row, strict=True):
            assert math.isclose(b, factor * a, rel_tol=1e-9, abs_tol=1e-15), (name, step, a_row, b_row)
    assert len({tuple(row) for row in sequence_plain}) > 1, "the schedule must move for the comparison to mean much"


def test_scale_touches_the_stored_rates_each_scheduler_keeps() -> None:
    k = 0.25
    opt = _optimizer()
    cosine = sched.CosineAnnealingLR(opt, T_max=4, eta_min=0.004)
    scale_learning_rates([opt], [cosine], k)
    assert cosine.eta_min == pytest.approx(0.004 * k)
    assert cosine.base_lrs == pytest.approx([lr * k for lr in LRS])
    assert [g["initial_lr"] for g in opt.param_groups] == pytest.approx([lr * k for lr in LRS])
    assert cosine.get_last_lr() == pytest.approx([lr * k for lr in LRS])

    opt = _optimizer()
    one_cycle = sched.OneCycleLR(opt, max_lr=[0.2, 0.04], total_steps=10, div_factor=10, final_div_factor=100)
    scale_learning_rates([opt], [one_cycle], k)
    for group, max_lr in zip(opt.param_groups, (0.2, 0.04), strict=True):
        assert group["max_lr"] == pytest.approx(max_lr * k)
        assert group["initial_lr"] == pytest.approx(max_lr / 10 * k)
        assert group["min_lr"] == pytest.approx(max_lr / 10 / 100 * k)
        assert group["lr"] == pytest.approx(max_lr / 10 * k)
        assert group["momentum"] == pytest.approx(0.95)  # momenta are not learning rates

    opt = _optimizer()
    plateau = sched.ReduceLROnPlateau(opt, min_lr=[0.01, 0.004])
    scale_learning_rates([opt], [plateau], k)
    assert plateau.min_lrs == pytest.approx([0.01 * k, 0.004 * k])

    opt = _optimizer()
    cyclic = sched.CyclicLR(opt, base_lr=[0.01, 0.002], max_lr=[0.1, 0.05])
    scale_learning_rates([opt], [cyclic], k)
    assert cyclic.base_lrs == pytest.approx([0.01 * k, 0.002 * k])
    assert cyclic.max_lrs == pytest.approx([0.1 * k, 0.05 * k])


def test_scale_without_schedulers_and_across_optimizers() -> None:
    sgd, adam = _optimizer("sgd"), _optimizer("adam")
    scale_learning_rates([sgd, adam], [], 0.5)
    assert _lrs(sgd) == pytest.approx([lr * 0.5 for lr in LRS])
    assert _lrs(adam) == pytest.approx([lr * 0.5 for lr in LRS])
    assert adam.param_groups[0]["betas"] == (0.9, 0.999)
    assert sgd.param_groups[0]["momentum"] == 0.9


def test_factor_one_is_a_no_op() -> None:
    opt = _optimizer()
    scheduler = sched.StepLR(opt, step_size=1)
    before = (opt.state_dict(), scheduler.state_dict())
    scale_learning_rates([opt], [scheduler], 1.0)
    assert (opt.state_dict(), scheduler.state_dict()) == before


def test_scaling_twice_composes() -> None:
    opt = _optimizer()
    scheduler = sched.StepLR(opt, step_size=1, gamma=0.5)
    scale_learning_rates([opt], [scheduler], 8.0)
    scale_learning_rates([opt], [scheduler], 0.25)
    assert _lrs(opt) == pytest.approx([lr * 2 for lr in LRS])
    _step(opt, scheduler, 0.0)
    assert _lrs(opt) == pytest.approx([lr * 2 * 0.5 for lr in LRS])


def _sequential(o: torch.optim.Optimizer) -> Any:
    warmup = sched.LinearLR(o, start_factor=0.1, total_iters=3)
    return sched.SequentialLR(o, [warmup, sched.CosineAnnealingLR(o, T_max=10, eta_min=0.001)], milestones=[3])


def _chained(o: torch.optim.Optimizer) -> Any:
    return sched.ChainedScheduler([sched.ExponentialLR(o, gamma=0.9), sched.CosineAnnealingWarmRestarts(o, T_0=3)])


@pytest.mark.parametrize("make", [_sequential, _chained], ids=["SequentialLR-warmup-cosine", "ChainedScheduler"])
def test_nested_schedulers_keep_the_scaling(make: Callable[[torch.optim.Optimizer], Any]) -> None:
    plain_opt, scaled_opt = _optimizer(), _optimizer()
    plain, scaled = make(plain_opt), make(scaled_opt)
    _step(plain_opt, plain, 0.0)
    _step(scaled_opt, scaled, 0.0)
    scale_learning_rates([scaled_opt], [scaled], 0.25)
    for _ in range(6):  # SequentialLR crosses its milestone at step 3
        _step(plain_opt, plain, 0.0)
        _step(scaled_opt, scaled, 0.0)
        assert _lrs(scaled_opt) == pytest.approx([0.25 * lr for lr in _lrs(plain_opt)])


def test_plateau_floor_stays_scaled_after_a_param_group_is_added() -> None:
    k = 0.25
    plain_opt, scaled_opt = _optimizer(), _optimizer()
    plain = sched.ReduceLROnPlateau(plain_opt, factor=0.5, patience=0, min_lr=0.01)
    scaled = sched.ReduceLROnPlateau(scaled_opt, factor=0.5, patience=0, min_lr=0.01)
    scale_learning_rates([scaled_opt], [scaled], k)
    for opt in (plain_opt, scaled_opt):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(1))], "lr": 0.05 * (k if opt is scaled_opt else 1)})
    for _ in range(10):  # reduce until every group sits on its floor
        _step(plain_opt, plain, 1.0)
        _step(scaled_opt, scaled, 1.0)
    assert _lrs(scaled_opt) == pytest.approx([k * lr for lr in _lrs(plain_opt)])


def test_tensor_learning_rates_are_scaled_too() -> None:
    opt = torch.optim.Adam([nn.Parameter(torch.ones(2))], lr=torch.tensor(0.01))
    scheduler = sched.StepLR(opt, step_size=1, gamma=0.5)
    scale_learning_rates([opt], [scheduler], 0.5)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.005)
    assert [float(v) for v in scheduler.base_lrs] == pytest.approx([0.005])


# == Lightning integration =====================================================================

DIM = 4
N = 208  # 208 = 3 * 64 + 16 = 13 * 16: 4 batches at 64; 13 at 16 (not a multiple of 4)
FROZEN_MAX, UNFROZEN_MAX = 64, 16
LR = 0.01


class LinearModel(pl.LightningModule):  # type: ignore[misc,name-defined]
    """``head(backbone(x))``, both ``nn.Linear``, MSE loss; no layer depends on the batch, so the mean
    gradient over 64 samples equals the mean of four 16-sample mean gradients.

    A training step above ``limit_now()`` raises ``torch.OutOfMemoryError``. The limit is ``limits[0]``
    while the backbone is frozen and ``limits[1]`` once it trains (``limit_by="unfreeze"``), or
    ``limits[0]`` before epoch ``switch_epoch`` and ``limits[1]`` from it on (``limit_by="epoch"``).
    """

    def __init__(
        self,
        *,
        batch_size: int = 8,
        limits: tuple[int, int] = (FROZEN_MAX, UNFROZEN_MAX),
        limit_by: str = "unfreeze",
        switch_epoch: int = 1,
        scheduler: str | None = None,
        n: int = N,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.limits = limits
        self.limit_by = limit_by
        self.switch_epoch = switch_epoch
        self.scheduler_name = scheduler
        torch.manual_seed(0)
        self.backbone = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 1)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, DIM, generator=g)
        y = x @ torch.randn(DIM, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
        self.dataset = TensorDataset(x, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def limit_now(self) -> int:
        if self.limit_by == "unfreeze":
            late = any(p.requires_grad for p in self.backbone.parameters())
        else:
            late = self.trainer.current_epoch >= self.switch_epoch
        return self.limits[1] if late else self.limits[0]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if x.shape[0] > self.limit_now():
            raise torch.OutOfMemoryError(f"CUDA out of memory (test limit {self.limit_now()}, batch {x.shape[0]})")
        self.log("flat", 1.0, on_step=False, on_epoch=True)  # never improves: drives ReduceLROnPlateau
        return F.mse_loss(self(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self) -> Any:
        if self.limit_by == "unfreeze":  # BackboneFinetuning adds the backbone group itself
            opt = torch.optim.SGD(self.head.parameters(), lr=LR)
        else:
            opt = torch.optim.SGD(
                [{"params": self.backbone.parameters(), "lr": LR / 10}, {"params": self.head.parameters()}], lr=LR
            )
        name = self.scheduler_name
        if name is None:
            return opt
        if name == "step":
            return {"optimizer": opt, "lr_scheduler": sched.StepLR(opt, step_size=1, gamma=0.5)}
        if name == "cosine":
            return {"optimizer": opt, "lr_scheduler": sched.CosineAnnealingLR(opt, T_max=2, eta_min=LR / 100)}
        if name == "onecycle":
            one_cycle = sched.OneCycleLR(opt, max_lr=[LR, LR * 10], total_steps=200, pct_start=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": one_cycle, "interval": "step"}}
        assert name == "plateau"
        plateau = sched.ReduceLROnPlateau(opt, factor=0.5, patience=0, min_lr=[LR / 20, LR / 400])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "flat"}}


class Recorder(pl.Callback):  # type: ignore[misc,name-defined]
    """What the loop did per epoch: batch sizes, accumulation, optimizer steps and learning rates,
    and the parameters and gradients at the first optimizer step of ``capture_epoch``.

    Probe steps never reach it: the finder runs them with the callback list emptied.
    """

    def __init__(self, capture_epoch: int | None = None) -> None:
        self.capture_epoch = capture_epoch
        self.batch_sizes: dict[int, list[int]] = {}
        self.accumulate: dict[int, set[int]] = {}
        self.steps: dict[int, int] = {}
        self.epoch_lrs: dict[int, list[float]] = {}
        self.step_lrs: list[tuple[int, list[float]]] = []
        self.captured: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, *_: Any) -> None:
        epoch = trainer.current_epoch
        self.batch_sizes.setdefault(epoch, []).append(int(batch[0].shape[0]))
        self.accumulate.setdefault(epoch, set()).add(int(trainer.accumulate_grad_batches))
        if batch_idx == 0:
            self.epoch_lrs[epoch] = _lrs(trainer.optimizers[0])

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any, *_: Any) -> None:
        epoch = trainer.current_epoch
        self.steps[epoch] = self.steps.get(epoch, 0) + 1
        self.step_lrs.append((epoch, _lrs(optimizer)))
        if epoch == self.capture_epoch and self.captured is None:
            self.captured = {
                name: (p.detach().clone(), p.grad.detach().clone())
                for name, p in pl_module.named_parameters()
                if p.grad is not None
            }


def _schedule(
    accumulate: str = "free", lr_scaling: str = "none", triggers: str = "unfreeze", init_val: int = 16
) -> dict[str, Any]:
    second = {"kind": "trainable_params_changed"} if triggers == "unfreeze" else {"kind": "epoch", "at": [1]}
    return {
        "search": {"mode": "binsearch", "margin": 0.0, "init_val": init_val, "steps_per_trial": 1, "max_val": 128},
        "triggers": [{"kind": "fit_start"}, second],
        "apply": {"accumulate": accumulate, "lr_scaling": lr_scaling},
    }


def _fit(
    model: LinearModel,
    schedule: dict[str, Any],
    *,
    epochs: int = 3,
    unfreeze: bool = True,
    extra: tuple[Any, ...] = (),
    ckpt_path: Path | None = None,
    **trainer_kwargs: Any,
) -> tuple[Any, ScheduledBatchSizeFinder, Recorder]:
    seed(0)
    finder = ScheduledBatchSizeFinder(schedule, verbose=False)
    recorder = Recorder(capture_epoch=1)
    cbs: list[Any] = [finder, recorder, *extra]
    if unfreeze:
        cbs.insert(0, callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1))
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=cbs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, finder, recorder


def test_keep_effective_exact_accumulates_four_after_the_unfreeze() -> None:
    trainer, finder, rec = _fit(LinearModel(), _schedule("keep_effective"))

    first, second = finder.history
    assert [e.trigger for e in finder.history] == ["fit_start", "trainable_params_changed"]
    assert (first.batch_size_after, first.accumulate, first.effective_batch_size) == (64, 1, 64)
    assert (second.batch_size_after, second.accumulate, second.effective_batch_size) == (16, 4, 64)
    assert first.lr_factor == second.lr_factor == 1.0  # lr_scaling: none

    assert rec.accumulate == {0: {1}, 1: {4}, 2: {4}}
    assert trainer.accumulate_grad_batches == 4
    assert {e: sizes[0] for e, sizes in rec.batch_sizes.items()} == {0: 64, 1: 16, 2: 16}
    batches = {0: math.ceil(N / 64), 1: math.ceil(N / 16), 2: math.ceil(N / 16)}
    assert {e: len(sizes) for e, sizes in rec.batch_sizes.items()} == batches
    expected_steps = {e: math.ceil(b / (1 if e == 0 else 4)) for e, b in batches.items()}
    assert rec.steps == expected_steps == {0: 4, 1: 4, 2: 4}  # 13 batches: 4+4+4+1, the partial window steps
    assert trainer.global_step == sum(expected_steps.values())


def test_accumulated_step_after_the_retune_has_the_full_batch_gradient() -> None:
    """Four micro-batches of 16 give the gradient of one 64-sample batch: Lightning divides each
    micro-batch loss by ``accumulate_grad_batches`` before backward, so the sum is the mean."""
    model = LinearModel()
    x, y = model.dataset.tensors
    _, finder, rec = _fit(model, _schedule("keep_effective"), epochs=2)
    assert finder.history[1].accumulate == 4
    assert rec.batch_sizes[1][:4] == [16, 16, 16, 16]
    assert rec.captured is not None
    assert set(rec.captured) == {"backbone.weight", "backbone.bias", "head.weight", "head.bias"}

    # the parameters the 4 micro-batches ran with (no step between them): recompute on all 64 samples
    params = {name: p.clone().requires_grad_(True) for name, (p, _) in rec.captured.items()}
    hidden = F.linear(x[:64], params["backbone.weight"], params["backbone.bias"])
    loss = F.mse_loss(F.linear(hidden, params["head.weight"], params["head.bias"]), y[:64])
    reference = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
    for name, (_, grad) in rec.captured.items():
        torch.testing.assert_close(grad, reference[name], atol=1e-6, rtol=1e-5, msg=name)
        assert not torch.allclose(grad, 4 * reference[name], atol=1e-6), f"{name}: the loss was not scaled by 1/4"


def test_keep_effective_inexact_warns_and_records_the_effective_size() -> None:
    with retune_warnings() as warnings:
        trainer, finder, rec = _fit(LinearModel(limits=(64, 24)), _schedule("keep_effective", "linear"))
    second = finder.history[1]
    assert (second.batch_size_after, second.accumulate, second.effective_batch_size) == (24, 3, 72)
    assert second.lr_factor == pytest.approx(72 / 64)  # linear scaling follows the effective change
    assert len(warnings) == 1, warnings
    for number in ("72", "24", "64"):  # the effective size it gives, the new batch size, the target
        assert re.search(rf"\b{number}\b", warnings[0]), warnings[0]
    assert rec.accumulate == {0: {1}, 1: {3}, 2: {3}}
    assert rec.steps == {0: 4, 1: math.ceil(math.ceil(N / 24) / 3), 2: 3}
    assert trainer.global_step == 4 + 3 + 3


_LEGACY_ONLY = pytest.mark.skipif(not LEGACY, reason="only Lightning 1.9 takes a dict for accumulate_grad_batches")


@pytest.mark.parametrize(
    "how", ["trainer-arg", "constant-scheduler", pytest.param("constant-dict", marks=_LEGACY_ONLY)]
)
def test_keep_effective_keeps_an_accumulation_set_before_the_first_tune(how: str) -> None:
    """Accumulation 2 at the first tune (``Trainer(accumulate_grad_batches=2)``, a
    ``GradientAccumulationScheduler({0: 2})``, or on 1.9 ``accumulate_grad_batches={0: 2}``, which never
    change it): the target is 64 x 2 = 128 = 16 x 8."""
    if how == "trainer-arg":
        _, finder, rec = _fit(LinearModel(), _schedule("keep_effective"), accumulate_grad_batches=2)
    elif how == "constant-dict":
        _, finder, rec = _fit(LinearModel(), _schedule("keep_effective"), accumulate_grad_batches={0: 2})
    else:
        extra = (callbacks.GradientAccumulationScheduler({0: 2}),)
        _, finder, rec = _fit(LinearModel(), _schedule("keep_effective"), extra=extra)
    first, second = finder.history
    assert (first.accumulate, first.effective_batch_size) == (2, 128)
    assert (second.batch_size_after, second.accumulate, second.effective_batch_size) == (16, 8, 128)
    assert rec.accumulate == {0: {2}, 1: {8}, 2: {8}}
    assert rec.steps == {0: 2, 1: 2, 2: 2}


def test_keep_effective_refuses_a_gradient_accumulation_scheduler() -> None:
    scheduler = callbacks.GradientAccumulationScheduler({0: 1, 2: 2})
    model = LinearModel(limit_by="epoch")
    with pytest.raises(RetuneError, match="GradientAccumulationScheduler") as info:
        _fit(model, _schedule("keep_effective", triggers="epoch"), unfreeze=False, extra=(scheduler,))
    assert "keep_effective" in str(info.value)


def test_keep_effective_refuses_a_gradient_accumulation_scheduler_subclass() -> None:
    class MyAccumulation(callbacks.GradientAccumulationScheduler):  # type: ignore[misc,name-defined]
        pass

    extra = (MyAccumulation({0: 1, 2: 2}),)
    with pytest.raises(RetuneError, match="GradientAccumulationScheduler"):
        _fit(LinearModel(limit_by="epoch"), _schedule("keep_effective", triggers="epoch"), unfreeze=False, extra=extra)


@_LEGACY_ONLY
def test_keep_effective_refuses_a_scheduling_dict_on_lightning_1_9() -> None:
    """1.9's ``Trainer(accumulate_grad_batches={0: 1, 2: 2})`` builds an internal scheduler
    (``trainer.accumulation_scheduler``) that no callback list shows: refused all the same."""
    model = LinearModel(limit_by="epoch")
    with pytest.raises(RetuneError, match="GradientAccumulationScheduler") as info:
        _fit(
            model,
            _schedule("keep_effective", triggers="epoch"),
            unfreeze=False,
            accumulate_grad_batches={0: 1, 2: 2},
        )
    assert "keep_effective" in str(info.value)


def test_free_accumulation_runs_next_to_a_gradient_accumulation_scheduler() -> None:
    scheduler = callbacks.GradientAccumulationScheduler({0: 1, 2: 2})
    model = LinearModel(limit_by="epoch")
    _, finder, rec = _fit(model, _schedule("free", triggers="epoch"), unfreeze=False, extra=(scheduler,))
    assert [e.batch_size_after for e in finder.history] == [64, 16]
    assert [e.accumulate for e in finder.history] == [1, 1]
    assert rec.accumulate == {0: {1}, 1: {1}, 2: {2}}
    assert rec.steps == {0: 4, 1: 13, 2: 7}


@functools.cache
def _unscaled_step_lr_run() -> tuple[list[int], Recorder]:
    """The twin without lr_scaling of the StepLR + BackboneFinetuning runs (shared: it never changes)."""
    _, finder, recorder = _fit(LinearModel(scheduler="step"), _schedule("free", "none"), epochs=4)
    assert [e.lr_factor for e in finder.history] == [1.0, 1.0]
    return [e.batch_size_after for e in finder.history], recorder


@pytest.mark.parametrize(("policy", "k"), [("linear", 0.25), ("sqrt", 0.5)])
def test_lr_scaling_with_free_accumulation_and_step_lr(policy: str, k: float) -> None:
    """The configured rates belong to the first tuned size (the starting batch size is often a
    placeholder), so the first tune (8 -> 64) keeps them; the re-tune 64 -> 16 scales by k. Every later
    rate is the product times the unscaled twin's."""
    plain_sizes, plain_rec = _unscaled_step_lr_run()
    _, finder, rec = _fit(LinearModel(scheduler="step"), _schedule("free", policy), epochs=4)

    assert [e.batch_size_after for e in finder.history] == plain_sizes == [64, 16]
    first, second = finder.history
    assert first.lr_factor == 1.0
    assert second.lr_factor == pytest.approx(k)
    assert (second.accumulate, second.effective_batch_size) == (1, 16)

    total = first.lr_factor * second.lr_factor
    assert rec.epoch_lrs[0] == pytest.approx([first.lr_factor * lr for lr in plain_rec.epoch_lrs[0]])
    assert rec.epoch_lrs[0] == pytest.approx([first.lr_factor * LR])
    for epoch in (1, 2, 3):  # head group: StepLR halves it every epoch, on top of the scaling
        assert rec.epoch_lrs[epoch][0] == pytest.approx(total * plain_rec.epoch_lrs[epoch][0])
    assert rec.epoch_lrs[3][0] == pytest.approx(total * LR * 0.5**3)
    # the backbone group BackboneFinetuning adds at the unfreeze, in that epoch
    assert len(rec.epoch_lrs[1]) == 2
    assert rec.epoch_lrs[1][1] == pytest.approx(total * plain_rec.epoch_lrs[1][1])


def test_lr_scaling_survives_backbone_finetuning_epochs_after_the_unfreeze() -> None:
    _, plain_rec = _unscaled_step_lr_run()
    _, finder, rec = _fit(LinearModel(scheduler="step"), _schedule("free", "linear"), epochs=3)
    total = finder.history[0].lr_factor * finder.history[1].lr_factor
    assert rec.epoch_lrs[2] == pytest.approx([total * lr for lr in plain_rec.epoch_lrs[2]])


@pytest.mark.parametrize("scheduler", ["onecycle", "cosine", "plateau"])
def test_lr_scaling_keeps_each_schedule_consistent_in_a_run(scheduler: str) -> None:
    """No BackboneFinetuning: memory shrinks at epoch 1 and an epoch trigger re-tunes. Every optimizer
    step's rates (both groups) are the cumulative factor times the unscaled twin's at the same step."""
    schedule_plain = _schedule("free", "none", triggers="epoch")
    schedule_scaled = _schedule("free", "linear", triggers="epoch")
    _, plain, plain_rec = _fit(LinearModel(limit_by="epoch", scheduler=scheduler), schedule_plain, unfreeze=False)
    _, finder, rec = _fit(LinearModel(limit_by="epoch", scheduler=scheduler), schedule_scaled, unfreeze=False)

    assert [e.batch_size_after for e in finder.history] == [e.batch_size_after for e in plain.history] == [64, 16]
    assert [e.lr_factor for e in finder.history] == pytest.approx([1.0, 0.25])
    assert len(rec.step_lrs) == len(plain_rec.step_lrs) == 4 + 13 + 13
    cumulative = {0: 1.0, 1: 0.25, 2: 0.25}
    for (epoch, lrs), (plain_epoch, plain_lrs) in zip(rec.step_lrs, plain_rec.step_lrs, strict=True):
        assert epoch == plain_epoch
        assert lrs == pytest.approx([cumulative[epoch] * lr for lr in plain_lrs], rel=1e-9)
    assert len({tuple(lrs) for _, lrs in plain_rec.step_lrs}) > 1, "the schedule moved"


def test_keep_effective_with_linear_scaling_leaves_rates_alone_at_the_retune() -> None:
    _, finder, rec = _fit(LinearModel(scheduler="step"), _schedule("keep_effective", "linear"))
    first, second = finder.history
    assert first.lr_factor == 1.0  # the configured rate belongs to the first tuned size
    assert (second.accumulate, second.effective_batch_size, second.lr_factor) == (4, 64, 1.0)
    assert rec.epoch_lrs[0] == pytest.approx([LR])
    assert rec.epoch_lrs[1][0] == pytest.approx(LR * 0.5)  # StepLR only
    assert rec.accumulate == {0: {1}, 1: {4}, 2: {4}}


def test_resume_after_the_retune_keeps_the_accumulation(tmp_path: Path) -> None:
    schedule = _schedule("keep_effective", triggers="epoch")
    trainer, finder, _ = _fit(LinearModel(limit_by="epoch"), schedule, epochs=2, unfreeze=False)
    assert trainer.accumulate_grad_batches == 4
    path = tmp_path / "after_retune.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"]
    state = next(v for key, v in saved.items() if "ScheduledBatchSizeFinder" in key)
    assert (state["accumulate"], state["reference_effective"]) == (4, 64)
    assert finder.batch_size == 16

    model = LinearModel(limit_by="epoch")
    resumed, second, rec = _fit(model, schedule, epochs=3, unfreeze=False, ckpt_path=path)
    assert len(second.history) == 2 and second.history == finder.history  # no search on resume
    assert rec.accumulate == {2: {4}}
    assert rec.batch_sizes[2][0] == 16 and model.batch_size == 16
    assert rec.steps == {2: 4}
    assert resumed.global_step == 4 + 4 + 4


@pytest.mark.parametrize("accumulate, lr_scaling", [("keep_effective", "none"), ("free", "linear")])
def test_a_first_search_after_training_keeps_what_the_run_trained_with(accumulate: str, lr_scaling: str) -> None:
    """No ``fit_start`` trigger: epoch 0 trains at the model's 32, and the first search (epoch 1, where only 16
    fits) is not a placeholder's tune: ``keep_effective`` keeps 32 (16 x 2), linear scaling halves the rates."""
    schedule = _schedule(accumulate, lr_scaling, triggers="epoch")
    schedule["triggers"] = schedule["triggers"][1:]  # the epoch milestone alone
    model = LinearModel(batch_size=32, limits=(64, 16), limit_by="epoch")
    _, finder, rec = _fit(model, schedule, unfreeze=False)
    (event,) = finder.history
    assert (event.trigger, event.batch_size_before, event.batch_size_after) == ("epoch", 32, 16)
    if accumulate == "keep_effective":
        assert (event.accumulate, event.effective_batch_size, event.lr_factor) == (2, 32, 1.0)
        assert rec.accumulate == {0: {1}, 1: {2}, 2: {2}}
    else:
        assert (event.accumulate, event.lr_factor) == (1, 0.5)
        assert rec.epoch_lrs[1] == pytest.approx([x / 2 for x in rec.epoch_lrs[0]])


class EstimatedCycle(LinearModel):
    """``OneCycleLR`` sized from ``trainer.estimated_stepping_batches`` (Lightning's documented recipe), which
    ``configure_optimizers`` reads before the fit-start search, at the model's starting batch size."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=LR)
        cycle = sched.OneCycleLR(opt, max_lr=LR, total_steps=int(self.trainer.estimated_stepping_batches))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}


@pytest.mark.parametrize("start, words", [(128, "raises 'Tried to step 7 times'"), (4, "ends 8% into its cycle")])
def test_a_cycle_sized_before_the_first_search_is_warned_about(start: int, words: str) -> None:
    """At 128, 2 batches per epoch: 6 steps in 3 epochs, and at the 64 found the fit takes 12 (OneCycleLR raises at
    the 7th); at 4, 156 steps where 12 run. The warning says which, and why: the search came after
    ``configure_optimizers``."""
    schedule = _schedule(triggers="epoch")
    schedule["triggers"] = schedule["triggers"][:1]  # fit start alone
    schedule["search"]["init_val"] = 64
    with retune_warnings() as warnings:
        try:
            _fit(EstimatedCycle(batch_size=start, limit_by="epoch", limits=(64, 64)), schedule, unfreeze=False)
        except ValueError as error:  # OneCycleLR's own, at step 7: what the warning announced
            assert "Tried to step 7 times" in str(error)
    cycle = [w for w in warnings if "OneCycleLR does not fit" in w]
    assert len(cycle) == 1 and words in cycle[0], warnings
    assert f"at batch size {start}" in cycle[0] and "before this search" in cycle[0]


def test_a_cycle_that_fits_the_fit_is_not_warned_about() -> None:
    schedule = _schedule(triggers="epoch")
    schedule["triggers"] = schedule["triggers"][:1]
    schedule["search"]["init_val"] = 64
    with retune_warnings() as warnings:
        _fit(EstimatedCycle(batch_size=64, limit_by="epoch", limits=(64, 64)), schedule, unfreeze=False)
    assert not [w for w in warnings if "OneCycleLR" in w], warnings


def test_lr_scaling_moves_the_models_learning_rate_attribute_with_the_rates() -> None:
    """A model whose ``lr`` names its group's rate (read again by a warm-up in ``optimizer_step``, or by a rebuilt
    optimizer) has it scaled with the rates; an ``lr`` that names no group's rate is left alone."""
    model = LinearModel()
    model.lr, model.learning_rate = LR, 0.123
    _, finder, _ = _fit(model, _schedule("free", "linear"))
    _, second = finder.history
    assert second.lr_factor == pytest.approx(16 / 64)
    assert model.lr == pytest.approx(LR * second.lr_factor) and model.learning_rate == 0.123
