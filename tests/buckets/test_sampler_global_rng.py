"""A choosing sampler on torch's global RNG (no ``generator=``) draws under buckets what a plain run draws.

A ``DataLoader`` iterator draws its workers' base seed from torch's global RNG when it is made, and only then
iterates the sampler, so a ``WeightedRandomSampler`` without a generator draws from the stream one draw after
that. Retune draws the epoch earlier, when Lightning asks the loader's length (the number of batches depends on
the draws), so it drew from the stream one draw before: a valid pass of the sampler, but not the one a seeded
plain run draws (81-91 of 150 draws differed per epoch with a ``RandomSampler`` with replacement, found by a
review). Now the pass runs after one such draw, the stream is put back, and the loader's iterator continues it
from after the pass once it has drawn its seed (``DrawnBucketBatchSampler.__iter__``). Each check compares a
retune run with a plain Lightning run of the same code and seed, epoch by epoch, as multisets of the dataset
indices ``training_step`` saw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, WeightedRandomSampler

from retune import ScheduledBatchSizeFinder
from tests.helpers import bucket_data
from tests.helpers.bucket_data import (
    BucketModel,
    IndexedTokens,
    IndicesByEpoch,
    UnfreezeAt,
    long_tail_lengths,
    pad_collate,
    tokens,
)
from tests.helpers.lightning_ns import seed

N = 200


def _weighted(data: Any) -> Sampler[int]:
    return WeightedRandomSampler(torch.tensor([10.0 if i % 4 == 0 else 1.0 for i in range(N)]), 150)


def _with_replacement(data: Any) -> Sampler[int]:
    return RandomSampler(data, replacement=True, num_samples=150)


class GlobalRngModel(BucketModel):
    """A loader over a sampler without a generator; the embedding frozen until ``UnfreezeAt`` (a re-search)."""

    def __init__(self, make_sampler: Callable[[Any], Sampler[int]]) -> None:
        super().__init__(IndexedTokens(long_tail_lengths(N)), batch_size=8, frozen=True)
        self.make_sampler = make_sampler

    def train_dataloader(self) -> DataLoader[Any]:
        sampler = self.make_sampler(self.data)
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler, collate_fn=pad_collate)


def _fit(make_sampler: Callable[[Any], Sampler[int]], retune: bool) -> tuple[IndicesByEpoch, Any]:
    seed(0)
    seen = IndicesByEpoch()
    callbacks: list[Any] = [seen, UnfreezeAt(1)]
    finder = None
    if retune:
        finder = ScheduledBatchSizeFinder(bucket_data.schedule(), sample_size=tokens, verbose=False, write_report=False)
        callbacks.append(finder)
    bucket_data.trainer(callbacks, epochs=3).fit(GlobalRngModel(make_sampler))
    return seen, finder


@pytest.mark.parametrize("make_sampler", [_weighted, _with_replacement], ids=["weighted", "with-replacement"])
def test_a_sampler_on_the_global_rng_draws_what_a_plain_run_draws(make_sampler: Callable[[Any], Sampler[int]]) -> None:
    plain, _ = _fit(make_sampler, retune=False)
    tuned, finder = _fit(make_sampler, retune=True)
    assert finder is not None and len(set(finder.bucket_sizes)) > 1, finder.bucket_sizes  # bucketed
    assert [e.trigger for e in finder.history] == ["fit_start", "trainable_params_changed"]  # searched twice
    assert sorted(tuned.epochs) == sorted(plain.epochs) == [0, 1, 2]
    for epoch in range(3):
        assert tuned.epochs[epoch] == plain.epochs[epoch], epoch
    assert plain.epochs[0] != plain.epochs[1]  # the stream went on: each epoch a pass of its own
