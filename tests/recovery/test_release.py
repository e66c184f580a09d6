"""A failed attempt is released completely before the next one starts.

Every place that catches an out-of-memory error (train-step recovery, eval-step recovery, a probe
trial) must drop what the failed attempt allocated before it runs again: on a caching allocator the
next, smaller attempt otherwise starts with the failed one's activations still resident, and runs
out of memory too (issue 27: a batch of 48 recovered as 48 micro-batches of 1 on an H200). The
failed attempt's tensors are watched through weak references: each must be dead when the first
micro-batch (or the next trial) starts. The OOMs are raised with the real error type,
``torch.OutOfMemoryError``, by an oracle that fails any batch above a capacity (in forward, in
backward through ``FailInBackward`` from ``tests/helpers/oom_oracle.py``, or in a hook), as a GPU would.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from retune.lr.probe import run_range_test
from retune.lr.range_test import RangeTest
from retune.probing.prober import Prober
from tests.helpers.lightning_ns import pl, seed
from tests.helpers.oom_oracle import FailInBackward

OOM = {"triggers": [{"kind": "oom"}]}


class _Watched(pl.LightningModule):  # type: ignore[misc]
    """Runs out of memory on batches larger than ``capacity`` at ``where``; watches the failed attempt's tensors."""

    def __init__(self, where: str, capacity: int = 4, batch_size: int = 8) -> None:
        super().__init__()
        self.where, self.capacity, self.batch_size = where, capacity, batch_size
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
        self._refs: list[weakref.ref[torch.Tensor]] = []  # the failed attempt's activation and loss
        self._alive: list[list[bool]] = []  # at the start of each attempt after a failure: which are alive
        self._full = False

    def _step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        full = len(x) > self.capacity
        if self._refs and not full:
            self._alive.append([ref() is not None for ref in self._refs])
            self._refs = []
        self._full = full
        hidden = self.net[1](self.net[0](x))
        if full:
            self._refs.append(weakref.ref(hidden))
            if self.where == "forward":
                raise torch.OutOfMemoryError("CUDA out of memory (oracle: forward)")
        out = self.net[2](hidden)
        if self.where == "backward" and torch.is_grad_enabled():
            out = FailInBackward.apply(out, full, "oracle: backward")
        loss = F.cross_entropy(out, y)
        if full:
            self._refs.append(weakref.ref(loss))
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._step(batch), batch_size=len(batch[0]))

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if self.where == "on_before_backward" and self._full:
            raise torch.OutOfMemoryError("CUDA out of memory (oracle: on_before_backward)")

    def on_after_backward(self) -> None:
        if self.where == "on_after_backward" and self._full:
            raise torch.OutOfMemoryError("CUDA out of memory (oracle: on_after_backward)")

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _trainer(*callbacks: Any, **kwargs: Any) -> Any:
    return pl.Trainer(
        max_epochs=1,
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


@pytest.mark.parametrize("where", ["forward", "backward", "on_before_backward"])
def test_train_recovery_starts_its_first_micro_batch_without_the_failed_attempt(where: str) -> None:
    seed(0)
    model = _Watched(where)
    finder = ScheduledBatchSizeFinder(OOM, verbose=False, write_report=False)
    _trainer(finder, limit_train_batches=2, limit_val_batches=0).fit(model)
    assert model._alive, "the oracle must make a step run out of memory and recover"
    assert all(not any(alive) for alive in model._alive), f"failed attempt still alive: {model._alive}"
    assert [e.micro_batches for e in finder.history if e.is_recovery] == [2]


def test_eval_recovery_starts_its_first_micro_batch_without_the_failed_attempt() -> None:
    seed(0)
    model = _Watched("forward")
    finder = ScheduledBatchSizeFinder(OOM, verbose=False, write_report=False)
    _trainer(finder, limit_val_batches=2).validate(model, verbose=False)
    assert model._alive and all(not any(alive) for alive in model._alive), model._alive


class _ProbeAt(pl.Callback):  # type: ignore[misc]
    """Runs a trial at the full size (which fails), then one at the capacity, at the first training batch."""

    def __init__(self) -> None:
        self.fits: list[bool] = []

    def on_train_start(self, trainer: Any, pl_module: _Watched) -> None:
        prober = Prober(trainer, pl_module, "batch_size", steps_per_trial=1)  # the peak measured, as a search does
        with prober.session():
            self.fits = [prober.fits(pl_module.batch_size), prober.fits(pl_module.capacity)]
        pl_module.capacity = 1000  # the run's own steps (its loader holds 8) fit


@pytest.mark.parametrize("where", ["forward", "backward", "on_after_backward"])
def test_a_probe_trial_after_an_oom_starts_without_the_failed_trial(where: str) -> None:
    seed(0)
    model = _Watched(where)
    probe = _ProbeAt()
    _trainer(probe, limit_train_batches=1, limit_val_batches=0).fit(model)
    assert probe.fits == [False, True]
    assert model._alive and not any(model._alive[0]), model._alive


class _RangeTestAt(pl.Callback):  # type: ignore[misc]
    """Runs a learning-rate range test whose first step runs out of memory; checks what the error still holds."""

    def __init__(self) -> None:
        self.alive: list[bool] | None = None

    def on_train_start(self, trainer: Any, pl_module: _Watched) -> None:
        try:
            run_range_test(trainer, pl_module, [0], RangeTest([1e-3, 1e-2]))
        except torch.OutOfMemoryError as exc:
            assert "oracle" in str(exc) and exc.__traceback__ is not None  # the user's error, with its traceback
            self.alive = [ref() is not None for ref in pl_module._refs]
        pl_module.capacity = 1000  # the run's own steps fit


def test_an_oom_in_the_range_test_reaches_the_user_without_the_failed_steps_tensors() -> None:
    """The range test re-raises the OOM (it has no smaller step to try); the error keeps its message and
    traceback lines, but not the failed step's activation, so a caller that catches it has the memory back."""
    seed(0)
    model = _Watched("forward")
    probe = _RangeTestAt()
    _trainer(probe, limit_train_batches=1, limit_val_batches=0).fit(model)
    assert probe.alive == [False]


def test_an_oom_after_backward_reaches_the_user_without_the_failed_steps_tensors() -> None:
    """An OOM in ``on_after_backward`` is not recovered (the gradients are complete; micro-batches would not
    need less memory there) and reaches the user, without the failed step's activation and loss."""
    seed(0)
    model = _Watched("on_after_backward")
    finder = ScheduledBatchSizeFinder(OOM, verbose=False, write_report=False)
    with pytest.raises(torch.OutOfMemoryError, match="on_after_backward") as info:
        _trainer(finder, limit_train_batches=2, limit_val_batches=0).fit(model)
    assert info.value.__traceback__ is not None  # the user's error, with its traceback
    assert len(model._refs) == 2, "the oracle must make the first step run out of memory"
    assert [ref() is not None for ref in model._refs] == [False, False]
