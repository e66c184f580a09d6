"""The optimizer update of a CPU trace measured on meta tensors (``retune.prediction.meta_update``).

The claim: the same account as the update run on fakes (every field of the trace, phase by phase), for every
optimizer torch ships and its implementation variants, with the optimizer state there or not yet; where the meta
update cannot run, the fake update measures it as before; nothing real is written.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from retune.prediction import StepTrace, trace_training_step
from retune.prediction import trace as trace_module
from retune.prediction.meta_update import update_on_meta
from tests.helpers.prediction_models import PredictionModel, at_train_start, mlp

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-3),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-3),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-3),
    "two_groups": lambda ps: torch.optim.AdamW(
        [{"params": ps[:2], "lr": 1e-3}, {"params": ps[2:], "lr": 1e-4, "weight_decay": 0.0}]
    ),
}

FIELDS = (
    "peak_bytes",
    "resident_bytes",
    "created_bytes",
    "optimizer",
    "compute_bytes",
    "update_start_bytes",
    "forward_bytes",
    "backward_bytes",
    "update_bytes",
    "grads_before",
    "grads_after",
    "steady_bytes",
    "steady_parts",
)


class _WithOptimizer(PredictionModel):
    def __init__(self, make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> None:
        base = mlp()
        super().__init__(base.net, base.make_batch, base.loss_of)
        self._make = make

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self._make([p for p in self.parameters() if p.requires_grad])


def _warm_up(trainer: Any, model: Any) -> None:
    from retune.compat.stage_steps import hooks_isolated, training_step

    with hooks_isolated(trainer, model):
        training_step(trainer, model, model.make_batch(2), 0)


def _traces(
    model: PredictionModel, monkeypatch: pytest.MonkeyPatch, with_state: bool, sizes: tuple[int, ...] = (2, 64)
) -> tuple[list[Any], list[Any], list[Any]]:
    """Each size traced with the update on meta tensors and with it forced onto the fakes; what ``update_on_meta``
    returned each time it was asked."""
    answers: list[Any] = []

    def spied(*args: Any, **kwargs: Any) -> Any:
        answers.append(update_on_meta(*args, **kwargs))
        return answers[-1]

    on_meta: list[Any] = []
    on_fakes: list[Any] = []

    def work(trainer: Any, m: PredictionModel) -> None:
        if with_state:
            _warm_up(trainer, m)
        for size in sizes:
            monkeypatch.setattr(trace_module, "update_on_meta", spied)
            on_meta.append(trace_training_step(trainer, m, m.make_batch(2), size, steps=1))
            monkeypatch.setattr(trace_module, "update_on_meta", lambda *a, **k: None)
            on_fakes.append(trace_training_step(trainer, m, m.make_batch(2), size, steps=1))

    at_train_start(model, work)
    return on_meta, on_fakes, answers


@pytest.mark.parametrize("with_state", [False, True], ids=["first_step", "state_exists"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_update_on_meta_tensors_is_accounted_as_on_fakes(
    name: str, with_state: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    on_meta, on_fakes, answers = _traces(_WithOptimizer(OPTIMIZERS[name]), monkeypatch, with_state)
    assert answers and all(a is not None for a in answers), f"{name}: the meta update fell back ({answers})"
    for meta, fake in zip(on_meta, on_fakes, strict=True):
        assert isinstance(meta, StepTrace) and isinstance(fake, StepTrace), (meta, fake)
        for field in FIELDS:
            assert getattr(meta, field) == getattr(fake, field), (name, field, meta, fake)
    if name not in ("sgd", "adagrad"):  # plain SGD keeps no state; Adagrad makes its state when constructed
        assert (on_meta[0].created_bytes > 0) is not with_state, "the state is created only where it did not exist"


class _CpuMinded(torch.optim.Optimizer):
    """An optimizer written for a CPU: it makes its scratch tensor on ``"cpu"`` by name, which a meta parameter
    refuses (a device mismatch) and a fake CPU parameter accepts."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        scratch = torch.zeros(p.shape, device="cpu")
                        p.add_(p.grad + scratch, alpha=-group["lr"])
        return loss


def test_an_update_the_meta_tensors_cannot_run_is_measured_on_fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    on_meta, on_fakes, answers = _traces(_WithOptimizer(_CpuMinded), monkeypatch, with_state=True)
    assert answers and all(a is None for a in answers), "the meta update must fail here, or this tests nothing"
    for meta, fake in zip(on_meta, on_fakes, strict=True):
        assert isinstance(meta, StepTrace) and meta.optimizer is not None
        for field in FIELDS:
            assert getattr(meta, field) == getattr(fake, field), (field, meta, fake)
        assert meta.optimizer.extra_bytes > 0, "the scratch tensor and the update's temporary are counted"


def test_the_meta_update_writes_nothing_real() -> None:
    """The mirror holds meta tensors and private copies of scalar state: the real optimizer's state, parameters
    and gradients are unchanged, and so are a fake constant's values it copied."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    optimizer = torch.optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    before = copy.deepcopy(optimizer.state_dict()), [p.detach().clone() for p in params]
    measured = update_on_meta(optimizer, None, {})
    assert measured is not None
    extra, created, need = measured
    assert created == 0, "the state exists: the update creates none"
    assert extra == need > 0, "Adam's temporaries"
    after = optimizer.state_dict()
    assert all(torch.equal(after["state"][i]["step"], before[0]["state"][i]["step"]) for i in (0, 1))
    assert all(
        torch.equal(after["state"][i][k], before[0]["state"][i][k]) for i in (0, 1) for k in ("exp_avg", "exp_avg_sq")
    )
    assert all(torch.equal(p, q) for p, q in zip(params, before[1], strict=True))


def test_a_sparse_gradient_is_left_to_the_fakes() -> None:
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    embedding(torch.tensor([1, 2])).sum().backward()
    assert update_on_meta(torch.optim.SGD(embedding.parameters(), lr=0.1), None, {}) is None


class _Wrapping(torch.optim.Optimizer):
    """Steps an inner optimizer over the same parameters, as ``ZeroRedundancyOptimizer`` or a Lookahead does: a
    clone's param groups hold the mirrors, its inner optimizer still holds the real parameters."""

    def __init__(self, params: Any) -> None:
        params = list(params)
        super().__init__(params, {"lr": 0.1})
        self.inner = torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def step(self, closure: Any = None) -> Any:
        return self.inner.step(closure)


def test_an_update_that_reaches_real_tensors_is_refused_before_it_writes_them() -> None:
    """Outside the fake mode an operator on a real tensor runs for real: the meta update refuses it first."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = _Wrapping(params)
    before = [p.detach().clone() for p in params]
    assert update_on_meta(optimizer, None, {}) is None
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True)), "a real weight was updated"
    # reading a state the optimizer keeps in a defaultdict leaves empty entries (as a fake trace's read does)
    assert not any(optimizer.inner.state.values()), "the real optimizer's state was created"


def test_a_wrapping_optimizer_inside_a_trace_leaves_the_run_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = _WithOptimizer(_Wrapping)
    weights: list[torch.Tensor] = []
    on_meta, on_fakes, answers = [], [], []

    def work(trainer: Any, m: PredictionModel) -> None:
        _warm_up(trainer, m)
        for p in m.parameters():  # gradients present, as between backward and zero_grad
            p.grad = torch.ones_like(p)
        weights.extend(p.detach().clone() for p in m.parameters())
        monkeypatch.setattr(
            trace_module, "update_on_meta", lambda *a, **k: answers.append(update_on_meta(*a, **k)) or answers[-1]
        )
        on_meta.append(trace_training_step(trainer, m, m.make_batch(2), 8, steps=1))
        assert all(torch.equal(p, w) for p, w in zip(m.parameters(), weights, strict=True))
        monkeypatch.setattr(trace_module, "update_on_meta", lambda *a, **k: None)
        on_fakes.append(trace_training_step(trainer, m, m.make_batch(2), 8, steps=1))

    at_train_start(model, work)
    assert answers == [None]
    assert str(on_meta[0]) == str(on_fakes[0]), "the fakes decide, as without the meta update"
