"""The search's cap is what one rank's epoch can put in one batch, and a size no probe batch held is not verified.

The cap was ``len(dataset)``: with a ``SubsetRandomSampler`` over 48 of 240 samples every probe at 64, 128 and
240 ran the 48 samples and 240 was reported as verified; ``probe_samples: largest`` built its batches above 48 by
repeating the 48 candidates (a batch the epoch never produces); with ``drop_last=True`` the size applied trained
no step at all, or (``first``) the search died on a loader that yielded no batches. A ``batch_sampler`` of the
user's own that ignores the batch size had every probe run its own batches (7-11 samples) and "240" reported.

The model here runs out of memory (the real ``torch.OutOfMemoryError``) above ``capacity`` samples in a step, an
oracle, and records the dataset indices of every batch a step received, in probes and in real steps alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    Sampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from retune import ScheduledBatchSizeFinder
from tests.helpers.lightning_ns import pl, seed
from tests.helpers.retune_warnings import retune_warnings
from tests.helpers.varlen import trainer as quiet_trainer

N = 240
SUBSET = list(range(0, N, 5))  # 48 samples


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.arange(N), torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g))


class Indexed(pl.LightningModule):  # type: ignore[misc,name-defined]
    """A linear model whose loader ``make_loader(dataset, batch_size)`` builds; OOM above ``capacity`` samples."""

    def __init__(self, make_loader: Callable[[Any, int], DataLoader[Any]], capacity: int = 10**9) -> None:
        super().__init__()
        self.batch_size = 2
        self.make_loader = make_loader
        self.capacity = capacity
        self.data = _data()
        self.net = nn.Linear(4, 1)
        self._batches: list[list[int]] = []
        """The dataset indices of every batch a training step received (probes, then the real steps; private, so
        that the probes' appends are not put back as a public attribute's would be)."""

    def train_dataloader(self) -> DataLoader[Any]:
        return self.make_loader(self.data, self.batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        self._batches.append(index.tolist())
        if len(index) > self.capacity:
            raise torch.OutOfMemoryError("CUDA out of memory (test oracle)")
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RealSteps(pl.Callback):  # type: ignore[misc,name-defined]
    """How many samples each real training step's batch held (probes never call the callbacks)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.sizes.append(len(batch[0]))


def _fit(model: Indexed, **search: Any) -> tuple[ScheduledBatchSizeFinder, RealSteps, list[str]]:
    finder = ScheduledBatchSizeFinder(
        {
            "search": {"mode": "binsearch", "margin": 0.0, "steps_per_trial": 2, "max_val": 8192, **search},
            "triggers": [{"kind": "fit_start"}],
        },
        verbose=False,
        write_report=False,
    )
    steps = RealSteps()
    trainer = quiet_trainer([finder, steps], 1, limit_val_batches=0)
    with retune_warnings() as said:
        trainer.fit(model)
    return finder, steps, said


def _subset_loader(drop_last: bool) -> Callable[[Any, int], DataLoader[Any]]:
    def make(data: Any, batch_size: int) -> DataLoader[Any]:
        sampler = SubsetRandomSampler(SUBSET, generator=torch.Generator().manual_seed(1))
        return DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=drop_last)

    return make


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("probe_samples", ["first", "largest"])
def test_a_sampler_over_part_of_the_data_caps_the_search_at_its_samples(probe_samples: str, drop_last: bool) -> None:
    """Memory never runs out: the search stops at the 48 samples the sampler draws per epoch, which the epoch's
    one step holds (before: 240 "verified", and with drop_last 0 steps trained, or a crash)."""
    seed(0)
    model = Indexed(_subset_loader(drop_last))
    finder, steps, said = _fit(model, probe_samples=probe_samples)
    assert finder.batch_size == len(SUBSET)
    trials = finder.history[0].trials
    assert max(t.batch_size for t in trials) == len(SUBSET), trials
    assert steps.sizes == [len(SUBSET)]
    # every probe batch is one the epoch can produce: samples the sampler draws, none twice
    for batch in model._batches:
        assert set(batch) <= set(SUBSET) and len(set(batch)) == len(batch), batch
    assert not [s for s in said if "do not hold the batch size" in s], said


def test_largest_probes_never_build_a_batch_the_epoch_cannot_produce() -> None:
    """Memory runs out above 100 samples: before, ``largest`` probed 142 by repeating the 48 candidates and
    applied 100, a size no batch of the epoch holds. Every probe batch holds its size in distinct samples."""
    seed(0)
    model = Indexed(_subset_loader(drop_last=True), capacity=100)
    finder, steps, _ = _fit(model, probe_samples="largest")
    assert finder.batch_size == len(SUBSET)
    assert steps.sizes == [len(SUBSET)]
    for batch in model._batches:
        assert len(set(batch)) == len(batch), batch


def test_a_weighted_sampler_with_replacement_caps_at_its_draws_and_probes_its_worst_batches() -> None:
    """``WeightedRandomSampler(num_samples=100)`` over 10 samples draws 100 a epoch, repeating them: the cap is 100
    (not 240), and a ``largest`` probe batch at 64 holds 64 draws of the 10 (before: a batch of 30 "verified" 240)."""
    weights = [1.0 if i < 10 else 0.0 for i in range(N)]

    def make(data: Any, batch_size: int) -> DataLoader[Any]:
        sampler = WeightedRandomSampler(weights, 100, replacement=True, generator=torch.Generator().manual_seed(1))
        return DataLoader(data, batch_size=batch_size, sampler=sampler)

    seed(0)
    model = Indexed(make)
    finder, steps, said = _fit(model, probe_samples="largest")
    assert finder.batch_size == 100
    assert [t.batch_size for t in finder.history[0].trials][-1] == 100
    assert all(set(b) <= set(range(10)) for b in model._batches)
    assert steps.sizes == [100]
    assert not [s for s in said if "do not hold the batch size" in s], said


def test_a_distributed_sampler_of_the_users_own_caps_at_its_shard() -> None:
    """A one-process run on its own shard (``DistributedSampler(num_replicas=2, rank=0)``, an array job's share):
    Lightning keeps it, and each epoch draws its 120 samples (before: 240 reported, batches of 120)."""

    def make(data: Any, batch_size: int) -> DataLoader[Any]:
        return DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data, num_replicas=2, rank=0))

    seed(0)
    finder, steps, _ = _fit(Indexed(make))
    assert finder.batch_size == N // 2
    assert steps.sizes == [N // 2]


class TokenBudget(Sampler[list[int]]):
    """Batches of consecutive samples, as many as a budget allows (here: 7 to 11), whatever the batch size."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        start, sizes = 0, [7, 9, 11, 8, 10]
        while start < self.n:
            size = sizes[(start // 7) % len(sizes)]
            yield list(range(start, min(self.n, start + size)))
            start += size

    def __len__(self) -> int:
        return sum(1 for _ in self)


def test_a_batch_sampler_that_ignores_the_batch_size_is_said_and_nothing_it_never_held_is_verified() -> None:
    """Every probe ran the batch sampler's own batches (7-11 samples): before, the search reported 240 as verified
    in silence. Now one warning names the batch sampler and the sizes the batches held, and the size applied is the
    most samples a fitting probe's batch held."""

    def make(data: Any, batch_size: int) -> DataLoader[Any]:
        return DataLoader(data, batch_sampler=TokenBudget(len(data)))

    seed(0)
    model = Indexed(make)
    finder, steps, said = _fit(model)
    probe_batches = model._batches[: len(model._batches) - len(steps.sizes)]
    held = max(len(b) for b in probe_batches)
    assert finder.batch_size == held < 240
    event = finder.history[0]
    warned = [s for s in said if "do not hold the batch size" in s]
    assert len(warned) == 1 and "TokenBudget" in warned[0], said
    assert "do not hold the batch size" in event.note
    assert event.max_fitting is not None and event.max_fitting <= held


def test_a_hook_that_ignores_the_batch_size_is_said() -> None:
    """A ``train_dataloader`` with a fixed ``batch_size=16``: every probe trained batches of 16."""

    def make(data: Any, batch_size: int) -> DataLoader[Any]:
        return DataLoader(data, batch_size=16)

    seed(0)
    finder, _, said = _fit(Indexed(make))
    assert finder.batch_size == 16
    warned = [s for s in said if "do not hold the batch size" in s]
    assert len(warned) == 1 and "batch_size=16" in warned[0], said


def test_a_short_last_batch_is_not_a_mismatch() -> None:
    """200 samples at 64 end on a batch of 8: the probes cycle through it, and nothing is said."""

    def make(data: Any, batch_size: int) -> DataLoader[Any]:
        return DataLoader(torch.utils.data.Subset(data, range(200)), batch_size=batch_size)

    seed(0)
    finder, _, said = _fit(Indexed(make, capacity=100), steps_per_trial=4)
    assert finder.batch_size == 100
    assert not [s for s in said if "do not hold the batch size" in s], said


def test_the_ranks_a_sampler_is_shared_across_follow_use_distributed_sampler() -> None:
    """Under DDP Lightning shards a train sampler only with ``use_distributed_sampler`` (1.9:
    ``replace_sampler_ddp``); without it every rank draws the whole epoch, and the cap is not divided."""
    from types import SimpleNamespace

    from retune.compat import sharded_across

    def trainer(world_size: int, shards: bool) -> Any:
        return SimpleNamespace(
            world_size=world_size, _accelerator_connector=SimpleNamespace(use_distributed_sampler=shards)
        )

    assert [sharded_across(trainer(2, True)), sharded_across(trainer(2, False)), sharded_across(trainer(1, True))] == [
        2,
        1,
        1,
    ]
