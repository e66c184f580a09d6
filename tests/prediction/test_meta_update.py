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


def _same_accounts(on_meta: list[Any], on_fakes: list[Any]) -> None:
    """Every field of each trace with the update on meta tensors equals the trace with it on the fakes."""
    for meta, fake in zip(on_meta, on_fakes, strict=True):
        assert isinstance(meta, StepTrace) and isinstance(fake, StepTrace), (meta, fake)
        for field in FIELDS:
            assert getattr(meta, field) == getattr(fake, field), (field, meta, fake)


@pytest.mark.parametrize("with_state", [False, True], ids=["first_step", "state_exists"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_update_on_meta_tensors_is_accounted_as_on_fakes(
    name: str, with_state: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    on_meta, on_fakes, answers = _traces(_WithOptimizer(OPTIMIZERS[name]), monkeypatch, with_state)
    assert answers and all(a is not None for a in answers), f"{name}: the meta update fell back ({answers})"
    _same_accounts(on_meta, on_fakes)
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
    """Refused on meta tensors (a device mismatch), where asked: an optimizer of the user's own is not asked."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.empty(10, device="meta"))
    p.grad = torch.empty(10, device="meta")
    assert update_on_meta(_CpuMinded([p]), None, {}) is None
    on_meta, on_fakes, answers = _traces(_WithOptimizer(_CpuMinded), monkeypatch, with_state=True)
    assert answers == [], "not one of torch's optimizers: the fakes measure it"
    _same_accounts(on_meta, on_fakes)
    for meta in on_meta:
        assert meta.optimizer is not None
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
    assert answers == [], "not one of torch's optimizers: the fakes measure it"
    assert str(on_meta[0]) == str(on_fakes[0]), "the fakes decide, as without the meta update"


class _TwoUpdates(PredictionModel):
    """Manual optimization stepping one optimizer twice: the head alone, then everything. A manual step may update
    more than once (or inside autocast), so its update is never measured on meta tensors: each is traced."""

    def __init__(self) -> None:
        base = mlp()
        super().__init__(base.net, base.make_batch, base.loss_of)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        features = self.net[:-1](batch[0]).detach()
        self.manual_backward(torch.nn.functional.cross_entropy(self.net[-1](features), batch[1]))
        opt.step()
        opt.zero_grad()
        loss = self.loss_of(self.net, batch)
        self.manual_backward(loss)
        opt.step()
        return loss


def test_a_manual_step_is_traced_on_fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = _TwoUpdates()
    on_meta, on_fakes, answers = _traces(model, monkeypatch, with_state=True)
    assert answers == [], "a manual step's updates are measured on the fakes"
    _same_accounts(on_meta, on_fakes)


class _GrowsACache(PredictionModel):
    """Registers a larger cache buffer when a batch outgrows it (a RoPE table): the step leaves resident memory of
    its own beside the optimizer state the update creates."""

    def __init__(self) -> None:
        base = mlp()
        super().__init__(base.net, base.make_batch, base.loss_of)
        self.register_buffer("cache", torch.zeros(2, 8), persistent=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        rows = batch[0].shape[0]
        if self.cache.shape[0] < rows:
            self.register_buffer("cache", torch.zeros(rows, 8), persistent=False)
        return self.loss_of(self.net, batch) + self.cache[:rows].sum()


class _ShrinksACache(_GrowsACache):
    """Starts with a large cache and replaces it with one as small as the batch: the step frees resident memory."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4000, 8), persistent=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        rows = batch[0].shape[0]
        if self.cache.shape[0] > rows:
            self.register_buffer("cache", torch.zeros(rows, 8), persistent=False)
        return self.loss_of(self.net, batch) + self.cache[:rows].sum()


@pytest.mark.parametrize("with_state", [False, True], ids=["first_step", "state_exists"])
@pytest.mark.parametrize(
    ("model", "sizes"), [(_GrowsACache, (2, 512)), (_ShrinksACache, (2, 64))], ids=["grows", "shrinks"]
)
def test_what_the_step_leaves_resident_is_counted_beside_the_state(
    model: type[PredictionModel], sizes: tuple[int, ...], with_state: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffer the step grows is resident beside the state the update creates; one it frees is taken from it (before
    the account is clamped at nothing), as the update on the fakes counts both."""
    torch.manual_seed(0)
    on_meta, on_fakes, answers = _traces(model(), monkeypatch, with_state, sizes=sizes)
    assert answers and all(a is not None for a in answers)
    _same_accounts(on_meta, on_fakes)
    if model is _GrowsACache:
        assert on_meta[-1].created_bytes >= 510 * 8 * 4, "the grown cache is resident after the step"


class _Scalar(PredictionModel):
    """A one-element parameter (a temperature) beside the net: its moments are one-element tensors."""

    def __init__(self) -> None:
        base = mlp()
        super().__init__(base.net, base.make_batch, base.loss_of)
        self.temperature = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss_of(self.net, batch) * self.temperature.squeeze()


@pytest.mark.parametrize("with_state", [False, True], ids=["first_step", "state_exists"])
def test_a_one_element_parameter_is_measured_on_meta(with_state: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    on_meta, on_fakes, answers = _traces(_Scalar(), monkeypatch, with_state)
    assert answers and all(a is not None for a in answers), answers
    _same_accounts(on_meta, on_fakes)


class _MyAdam(torch.optim.Adam):
    pass


def test_only_torchs_own_optimizers_without_step_hooks_are_measured_on_meta() -> None:
    """A subclass's ``step`` may do anything (views kept as state, random draws, an inner optimizer); a step hook
    would run twice where the meta update fails and the fakes run it again."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from retune.prediction.meta_update import meta_eligible

    def params() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.ones(2))]

    assert meta_eligible(torch.optim.AdamW(params()))
    assert meta_eligible(torch.optim.Adafactor(params())), "defined in torch.optim itself (its module's name)"
    assert not meta_eligible(_MyAdam(params()))
    assert not meta_eligible(_Wrapping(params()))
    hooked = torch.optim.SGD(params(), lr=0.1)
    handle = hooked.register_step_pre_hook(lambda *a: None)
    assert not meta_eligible(hooked)
    handle.remove()
    assert meta_eligible(hooked)
    handle = register_optimizer_step_post_hook(lambda *a: None)
    try:
        assert not meta_eligible(hooked), "a global step hook"
    finally:
        handle.remove()


def test_a_step_hook_runs_once_in_a_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    class Hooked(_WithOptimizer):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            optimizer = super().configure_optimizers()
            optimizer.register_step_pre_hook(lambda *a: calls.append(1))
            return optimizer

    torch.manual_seed(0)
    model = Hooked(OPTIMIZERS["adam"])
    answers: list[Any] = []

    def work(trainer: Any, m: PredictionModel) -> None:
        _warm_up(trainer, m)
        calls.clear()
        monkeypatch.setattr(
            trace_module, "update_on_meta", lambda *a, **k: answers.append(update_on_meta(*a, **k)) or answers[-1]
        )
        assert isinstance(trace_training_step(trainer, m, m.make_batch(2), 8, steps=1), StepTrace)
        seen.extend(calls)

    seen: list[int] = []
    at_train_start(model, work)
    assert answers == [] and seen == [1]


def test_an_update_inside_autocast_is_left_to_the_fakes() -> None:
    """Autocast casts a CPU tensor's operators, not a meta tensor's (a manual step's update runs inside it)."""
    p = torch.nn.Parameter(torch.empty(10, device="meta"))
    p.grad = torch.empty(10, device="meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert update_on_meta(torch.optim.SGD([p], lr=0.1, momentum=0.9), None, {}) is None
    assert update_on_meta(torch.optim.SGD([p], lr=0.1, momentum=0.9), None, {}) == (40, 40, 0)


class _Noisy(torch.optim.Optimizer):
    """Adds noise from a generator of its own (Langevin-style): outside the fake mode the draw would be real."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})
        self.generator = torch.Generator().manual_seed(0)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    noise = torch.randn(p.shape, generator=self.generator)
                    p.add_(p.grad + noise.to(p.device), alpha=-group["lr"])
        return None


def test_an_update_that_draws_random_numbers_is_refused_before_it_draws() -> None:
    p = torch.nn.Parameter(torch.empty(10, device="meta"))
    p.grad = torch.empty(10, device="meta")
    optimizer = _Noisy([p])
    before = optimizer.generator.get_state()
    assert update_on_meta(optimizer, None, {}) is None
    assert torch.equal(optimizer.generator.get_state(), before), "the optimizer's generator advanced"
