"""``batching: buckets`` never trains other data than the user's sampler draws (issue 28, point 1).

Buckets regroup an epoch's samples by size. That keeps the data only for a sampler that draws every
sample once per epoch; a sampler that chooses which samples train and how often (weights, a subset,
``num_samples``) keeps the loader as the user built it (``batching: fixed``), with one warning that
names the sampler. Before, buckets replaced such a sampler: the label share of a
``WeightedRandomSampler`` fell from its draws' to the dataset's, ``num_samples`` was ignored and
excluded samples trained.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, WeightedRandomSampler

from retune import ScheduledBatchSizeFinder
from retune.buckets.train_buckets import sampler_that_chooses
from tests.helpers import bucket_data
from tests.helpers.bucket_data import BucketModel, IndexedTokens, long_tail_lengths, pad_collate, tokens
from tests.helpers.lightning_ns import seed
from tests.helpers.retune_warnings import retune_warnings

N = 200


class EvenIndices(Sampler[int]):
    """A custom sampler that trains on a subset: the even indices only."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return (self.n + 1) // 2


class SamplerModel(BucketModel):
    def __init__(self, data: IndexedTokens, make_sampler: Any) -> None:
        super().__init__(data, batch_size=8)
        self.make_sampler = make_sampler

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, sampler=self.make_sampler(), collate_fn=pad_collate)


def _weights() -> torch.Tensor:
    # samples with index % 4 == 0 get 10x the weight: the draws' share of them is far above the dataset's 25%
    return torch.tensor([10.0 if i % 4 == 0 else 1.0 for i in range(N)])


def _fit(make_sampler: Any) -> tuple[list[int], list[str], ScheduledBatchSizeFinder]:
    seed(0)
    model = SamplerModel(IndexedTokens(long_tail_lengths(N)), make_sampler)
    finder = ScheduledBatchSizeFinder(bucket_data.schedule(), sample_size=tokens, verbose=False, write_report=False)
    with retune_warnings() as said:
        bucket_data.trainer([finder], epochs=1).fit(model)
    trained = [i for batch in model.batches for i in batch]
    return trained, said, finder


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(11)


@pytest.mark.parametrize("num_samples", [120, 600])
def test_a_weighted_sampler_trains_its_own_draws(num_samples: int) -> None:
    trained, said, _ = _fit(lambda: WeightedRandomSampler(_weights(), num_samples, generator=_generator()))
    expected = list(WeightedRandomSampler(_weights(), num_samples, generator=_generator()))
    assert len(trained) == num_samples
    assert Counter(trained) == Counter(expected)  # the same samples, as often as the sampler drew them
    share = sum(i % 4 == 0 for i in trained) / len(trained)
    assert share > 0.6, share  # the dataset's share is 0.25
    warnings = [m for m in said if "WeightedRandomSampler" in m]
    assert len(warnings) == 1 and "batching: fixed" in warnings[0], said


def test_a_subset_sampler_never_trains_an_excluded_sample() -> None:
    trained, said, _ = _fit(lambda: EvenIndices(N))
    assert sorted(trained) == list(range(0, N, 2))
    assert any("EvenIndices" in m for m in said), said


def test_a_random_sampler_with_replacement_keeps_its_draws() -> None:
    trained, said, _ = _fit(lambda: RandomSampler(range(N), replacement=True, num_samples=150, generator=_generator()))
    assert len(trained) == 150
    assert any("RandomSampler" in m for m in said), said


def test_a_plain_shuffled_loader_is_still_bucketed() -> None:
    trained, said, finder = _fit(lambda: RandomSampler(range(N), generator=_generator()))
    assert sorted(trained) == list(range(N))  # every sample once
    assert finder.bucket_sizes, "buckets were used"
    assert not any("chooses which samples" in m for m in said), said


def test_which_samplers_choose() -> None:
    data = list(range(10))
    assert sampler_that_chooses(DataLoader(data)) is None
    assert sampler_that_chooses(DataLoader(data, shuffle=True)) is None
    assert sampler_that_chooses(DataLoader(data, sampler=RandomSampler(data, num_samples=4))) is not None
    assert sampler_that_chooses(DataLoader(data, sampler=WeightedRandomSampler([1.0] * 10, 10))) == (
        "WeightedRandomSampler"
    )
    assert sampler_that_chooses(DataLoader(data, sampler=EvenIndices(10))) == "EvenIndices"
