"""A recovered step draws the random numbers the run with memory drew (retune/recovery/step_rng.py).

A failed forward has drawn its Dropout masks before it runs out of memory. Without a rewind the micro-batches
drew the next masks and the whole run's stream stayed shifted: a Dropout model ended 9e-2 off in its weights,
with another torch RNG state. The OOMs here are the real ``torch.OutOfMemoryError`` type, raised by an oracle
*after* the random draws (at the end of forward, or in backward between the head and the body), and every run
is compared with the same run that never ran out of memory, on the same batches. A batch of 16 at a capacity
of 5 fails whole, fails again in halves of 8 and trains in quarters: the rewind before a second, smaller round
is exercised too, and so is the split kept for the later batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from retune.recovery.step_rng import StepRng
from tests.helpers.lightning_ns import pl, seed
from tests.helpers.oom_oracle import FailInBackward
from tests.helpers.varlen import trainer as quiet_trainer


def _bernoulli_draws_per_element() -> bool:
    """Whether this CPU's ``bernoulli_`` (nn.Dropout's mask) draws one number per element, in order: the
    default kernel does; torch's MKL kernel (Intel CPUs) draws one seed per call, so a split batch's masks
    are not the whole batch's even from the same state, and nn.Dropout cannot be exact there."""
    state = torch.get_rng_state()
    whole = torch.empty(8, 16).bernoulli_(0.5)
    torch.set_rng_state(state)
    halves = torch.cat([torch.empty(4, 16).bernoulli_(0.5), torch.empty(4, 16).bernoulli_(0.5)])
    torch.set_rng_state(state)
    return torch.equal(whole, halves)


class MaskDropout(nn.Module):
    """Dropout drawn with ``torch.rand`` (one number per element, in order, on every CPU)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        return x * (torch.rand_like(x) >= self.p) / (1 - self.p)


class DropoutNet(pl.LightningModule):  # type: ignore[misc,name-defined]
    """Linear -> Tanh -> Dropout -> Linear, running out of memory above ``capacity`` samples *after* its dropout
    drew the mask: at the end of forward, or in backward after the head received its gradient."""

    def __init__(
        self,
        capacity: int | None,
        where: str = "forward",
        dropout: str = "nn.Dropout",
    ) -> None:
        super().__init__()
        self.capacity = capacity
        self.where = where
        self.batch_size = 16
        drop = nn.Dropout(0.5) if dropout == "nn.Dropout" else MaskDropout(0.5)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), drop)
        self.head = nn.Linear(32, 3)
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))

    def _too_big(self, x: torch.Tensor) -> bool:
        return self.capacity is not None and torch.is_grad_enabled() and len(x) > self.capacity

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.body(x)  # the dropout mask is drawn here
        if self.where == "backward":
            hidden = FailInBackward.apply(hidden, self._too_big(x))
        out = self.head(hidden)
        if self.where == "forward" and self._too_big(x):
            raise torch.OutOfMemoryError("CUDA out of memory (oracle: at the end of forward, after dropout)")
        return F.cross_entropy(out, y)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.02)


def _fit(capacity: int | None, **kwargs: Any) -> tuple[DropoutNet, torch.Tensor, ScheduledBatchSizeFinder | None]:
    seed(0)
    model = DropoutNet(capacity, **kwargs)
    finder = None
    if capacity is not None:
        finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    quiet_trainer([] if finder is None else [finder], 1, limit_val_batches=0).fit(model)
    return model, torch.get_rng_state(), finder


def _max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("dropout", ["nn.Dropout", "rand-mask"])
def test_a_recovered_dropout_step_draws_the_masks_of_the_run_with_memory(where: str, dropout: str) -> None:
    """The oracle raises the real ``torch.OutOfMemoryError`` after the dropout drew its mask (at the end of
    forward, or in backward). Recovered, the weights are those of the run that never ran out of memory on the
    same batches (within 1e-5; they were 9e-2 off), and the torch RNG after fit is the same state."""
    if dropout == "nn.Dropout" and not _bernoulli_draws_per_element():
        pytest.skip("this CPU's bernoulli_ draws one seed per call (MKL): a split batch's masks differ by nature")
    with_memory, rng_with_memory, _ = _fit(None, where=where, dropout=dropout)
    recovered, rng_recovered, finder = _fit(5, where=where, dropout=dropout)
    assert finder is not None and any(e.trigger == "oom" for e in finder.history)  # it did recover
    assert _max_difference(with_memory, recovered) < 1e-5
    assert torch.equal(rng_with_memory, rng_recovered)


def test_step_rng_rewinds_to_the_steps_start() -> None:
    rng = StepRng()
    rng.save()
    first = torch.rand(4)
    torch.rand(7)  # a micro-batch round that ran out of memory too
    rng.rewind()
    assert torch.equal(torch.rand(4), first)  # the failed attempt's numbers again
    rng.rewind()
    assert torch.equal(torch.rand(4), first)  # and again for the next, smaller round
