"""The step recoveries (``retune.recovery.train_step``, ``eval_step``) alone, no Lightning:
a plain torch model and a closure made of plain functions.

The OOMs are the real ``torch.OutOfMemoryError``, raised by an oracle above a sample capacity, in
forward or in backward (after the head received its gradient, as a real backward OOM leaves it).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

from retune import RetuneError
from retune.recovery.eval_step import EvalStepRecovery
from retune.recovery.micro_batches import Recovered
from retune.recovery.train_step import TrainStepRecovery
from retune.step_parts import StepParts
from tests.helpers.oom_oracle import FailInBackward


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)


def _parts(net: Net, batch: tuple[torch.Tensor, torch.Tensor], capacity: int, where: str, **kw: Any) -> StepParts:
    calls = kw.pop("calls", {"zero_grad": 0, "logs": []})

    def forward(b: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, y = b
        too_big = x.shape[0] > capacity
        if too_big and where == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory (oracle)")
        hidden = FailInBackward.apply(net.body(x), too_big and where == "backward")
        loss = nn.functional.cross_entropy(net.head(hidden), y)
        calls["logs"].append(int(x.shape[0]))
        return {"loss": loss}

    def zero_grad() -> None:
        calls["zero_grad"] += 1
        for p in net.parameters():
            p.grad = None

    return StepParts(
        batch=batch,
        forward=forward,
        zero_grad=kw.get("zero_grad", zero_grad),
        backward=lambda loss: loss.backward(),
        loss_of=lambda r: r["loss"],
        with_loss=lambda r, loss: {**r, "loss": loss},
        where=lambda: "epoch 0, global step 7",
        save_logs=kw.get("save_logs", lambda: lambda: None),
    )


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)


def _whole_batch_grads(batch: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    net = Net()
    nn.functional.cross_entropy(net.head(net.body(batch[0])), batch[1]).backward()
    return [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("capacity", [4, 2, 1])
def test_recovered_gradients_equal_the_whole_batch(where: str, capacity: int) -> None:
    batch, net, seen = _batch(), Net(), []
    recovery = TrainStepRecovery(lambda: list(net.parameters()), on_recovered=seen.append)
    result = recovery.run(_parts(net, batch, capacity, where))
    for got, want in zip([p.grad for p in net.parameters()], _whole_batch_grads(batch), strict=True):
        assert got is not None and torch.allclose(got, want, atol=1e-6)
    assert seen == [Recovered(8, 8 // capacity, where, capacity)] and recovery.max_size == capacity
    whole_loss = nn.functional.cross_entropy(Net().head(Net().body(batch[0])), batch[1])
    assert torch.allclose(result["loss"], whole_loss, atol=1e-6)
    assert all(p.requires_grad for p in net.parameters())  # finished parameters are unfrozen again


def test_gradients_of_earlier_batches_in_the_window_survive_a_backward_oom() -> None:
    earlier, batch, net = _batch(6), _batch(), Net()
    nn.functional.cross_entropy(net.head(net.body(earlier[0])), earlier[1]).backward()
    recovery = TrainStepRecovery(lambda: list(net.parameters()))
    recovery.run(_parts(net, batch, 4, "backward", zero_grad=None))  # not the window's first batch
    want_net = Net()
    nn.functional.cross_entropy(want_net.head(want_net.body(earlier[0])), earlier[1]).backward()
    nn.functional.cross_entropy(want_net.head(want_net.body(batch[0])), batch[1]).backward()
    for got, want in zip(net.parameters(), want_net.parameters(), strict=True):
        assert torch.allclose(got.grad, want.grad, atol=1e-6)  # type: ignore[arg-type]


def test_a_failed_round_of_micro_batches_restores_the_logs_and_splits_further() -> None:
    restored: list[int] = []
    calls: dict[str, Any] = {"zero_grad": 0, "logs": []}
    net = Net()
    recovery = TrainStepRecovery(lambda: list(net.parameters()))
    parts = _parts(net, _batch(), 2, "forward", calls=calls, save_logs=lambda: lambda: restored.append(1))
    recovery.run(parts)
    assert recovery.max_size == 2 and calls["zero_grad"] == 1  # pieces of 4 failed, of 2 fit; zero_grad once
    assert restored == [1]  # the 2-piece round failed, so what its micro-batches logged was rolled back


def test_a_sample_that_does_not_fit_is_an_error_with_gradients_as_before() -> None:
    earlier, net = _batch(6), Net()
    nn.functional.cross_entropy(net.head(net.body(earlier[0])), earlier[1]).backward()
    before = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    recovery = TrainStepRecovery(lambda: list(net.parameters()))
    with pytest.raises(RetuneError, match=r"global step 7 .* batch of 8 samples.*one sample does not fit"):
        recovery.run(_parts(net, _batch(), 0, "forward", zero_grad=None))
    for p, want in zip(net.parameters(), before, strict=True):
        assert torch.equal(p.grad, want) and p.requires_grad  # type: ignore[arg-type]


def test_sum_reduction_weights_each_micro_batch_by_one() -> None:
    batch, net = _batch(), Net()
    recovery = TrainStepRecovery(lambda: list(net.parameters()), loss_reduction="sum")
    result = recovery.run(_parts(net, batch, 4, "forward"))
    halves = [
        nn.functional.cross_entropy(Net().head(Net().body(batch[0][s])), batch[1][s])
        for s in (slice(0, 4), slice(4, 8))
    ]
    assert torch.allclose(result["loss"], halves[0] + halves[1], atol=1e-6)


def test_a_kept_split_runs_later_batches_in_pieces_without_a_failed_attempt() -> None:
    net, seen = Net(), []
    calls: dict[str, Any] = {"zero_grad": 0, "logs": []}
    recovery = TrainStepRecovery(lambda: list(net.parameters()), on_recovered=seen.append)
    recovery.max_size = 2
    recovery.run(_parts(net, _batch(), 100, "forward", calls=calls))
    assert calls["logs"] == [2, 2, 2, 2] and seen == []  # no OOM, no event
    calls["logs"].clear()
    recovery.run(_parts(net, _batch(2), 100, "forward", calls=calls))
    assert calls["logs"] == [2]  # a batch no larger than the kept size runs whole


def test_a_parameter_unfrozen_later_is_hooked() -> None:
    net = Net()
    net.body.weight.requires_grad_(False)
    recovery = TrainStepRecovery(lambda: list(net.parameters()))
    net.body.weight.requires_grad_(True)
    batch = _batch()
    recovery.run(_parts(net, batch, 4, "backward"))
    for got, want in zip(net.parameters(), _whole_batch_grads(batch), strict=True):
        assert torch.allclose(got.grad, want, atol=1e-6)  # type: ignore[arg-type]
    recovery.close()


def test_a_layer_frozen_at_the_start_and_unfrozen_later_is_not_counted_twice() -> None:
    """The head is frozen when the recovery starts, then unfrozen: a backward OOM leaves its gradient complete."""
    net = Net()
    net.head.requires_grad_(False)
    recovery = TrainStepRecovery(lambda: list(net.parameters()))
    net.head.requires_grad_(True)
    batch = _batch()
    recovery.run(_parts(net, batch, 4, "backward"))
    for got, want in zip(net.parameters(), _whole_batch_grads(batch), strict=True):
        assert torch.allclose(got.grad, want, atol=1e-6)  # type: ignore[arg-type]


def test_micro_batches_of_unknown_size_warn_about_equal_weights() -> None:
    class Opaque:
        def __init__(self, data: tuple[torch.Tensor, torch.Tensor]) -> None:
            self.data = data

    net = Net()
    parts = _parts(net, _batch(), 4, "forward")
    inner = parts.forward
    parts.batch = Opaque(parts.batch)
    parts.forward = lambda b: inner(b.data)
    recovery = TrainStepRecovery(
        lambda: list(net.parameters()),
        split_fn=lambda b, n: [Opaque((b.data[0][:4], b.data[1][:4])), Opaque((b.data[0][4:], b.data[1][4:]))],
    )
    with pytest.warns(UserWarning, match="weighted equally"):
        recovery.run(parts)


def test_eval_step_joins_outputs_and_reports() -> None:
    seen: list[Recovered] = []

    def step(batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        if batch.shape[0] > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (oracle)")
        return {"out": batch * 2, "idx": dataloader_idx}

    wrapped = EvalStepRecovery(step, logging=lambda b: contextlib.nullcontext(), on_recovered=seen.append)
    got = wrapped(torch.arange(10.0), 0, 1)
    assert torch.equal(got["out"], torch.arange(10.0) * 2) and got["idx"] == 1
    assert seen == [Recovered(10, 4, "forward", 3)] and wrapped.max_size == 3
    with pytest.raises(ValueError, match="not an OOM"):
        EvalStepRecovery(lambda b: (_ for _ in ()).throw(ValueError("not an OOM")), lambda b: contextlib.nullcontext())(
            torch.zeros(2)
        )


def test_a_recovered_steps_logged_values_combine_as_the_whole_batch() -> None:
    """``retune.compat.closure_runner``: each key once per step, weighted like the loss, with the whole batch's size."""
    from types import SimpleNamespace

    from retune.compat.closure_runner import _batch_size, _combine

    def meta(kind: str) -> Any:
        kinds = ("mean", "sum", "max", "min")
        return SimpleNamespace(**{f"is_{k}_reduction": k == kind for k in kinds})

    entries = [(torch.tensor(1.0), 3, 0), (torch.tensor(4.0), 1, 1)]
    assert _combine(meta("mean"), entries, [0.25, 0.75], [3, 1], add=False).item() == pytest.approx(3.25)
    assert _combine(meta("mean"), entries, [1.0, 1.0], [3, 1], add=True).item() == pytest.approx(5.0)
    assert _combine(meta("sum"), entries, [0.25, 0.75], [3, 1], add=False).item() == 5.0
    assert _combine(meta("max"), entries, [0.25, 0.75], [3, 1], add=False).item() == 4.0
    # a piece without counted items (its token mean is NaN) is left out; none anywhere: by samples
    nan = [(torch.tensor(float("nan")), 3, 0), (torch.tensor(4.0), 1, 1)]
    assert _combine(meta("mean"), nan, [0.0, 1.0], [3, 1], add=False).item() == 4.0
    assert _combine(meta("mean"), entries, [0.0, 0.0], [3, 1], add=False).item() == pytest.approx(1.75)
    # the batch size: the pieces' own sizes add up; a fixed batch_size=self.batch_size stays what it was
    assert _batch_size([(None, 3, 0), (None, 1, 1)], [3, 1]) == 4
    assert _batch_size([(None, 16, 0), (None, 16, 1)], [8, 8]) == 16


def test_the_names_of_the_module_before_the_split_still_import() -> None:
    """``retune.recovery.step_recovery`` held every class until issue 30 split it: its names stay importable."""
    from retune.recovery import eval_step, gradients, micro_batches, step_recovery, train_step

    homes = {
        "EvalStepRecovery": eval_step,
        "FinishedGradients": gradients,
        "LossReduction": micro_batches,
        "Recovered": micro_batches,
        "TrainStepRecovery": train_step,
        "loss_weights": micro_batches,
    }
    assert sorted(step_recovery.__all__) == sorted(homes)
    for name, home in homes.items():
        assert getattr(step_recovery, name) is getattr(home, name)
