"""``batching: buckets`` trains the user's sampler's part of the data, and ``drop_last`` drops one partial batch.

Two silent ways buckets trained other data than the user's loader:

- **A sampler over part of the dataset was taken for the whole.** Whether a sampler "draws every sample
  once" was read from its class alone, so a ``DistributedSampler`` that shards a one-process run (an
  array job's share: ``num_replicas=2, rank=0``) and a ``SequentialSampler`` over the first positions were
  replaced by retune's plan over the whole dataset: 240 samples per epoch where the loader trains 120 or
  100. Now only a ``DistributedSampler`` that is the run's own sharding (the run's processes, this rank,
  the loader's dataset: what Lightning injects under DDP) and a ``SequentialSampler`` as long as the
  dataset are replaced; the others choose, and their own draws are grouped each epoch.
- **``drop_last`` dropped every bucket's partial batch.** A sampler that draws a subset puts fewer draws
  into a bucket than its size (sized for its members), so whole buckets dropped: 28 of 100 draws trained.
  Now a bucket's partial batch moves up to the bucket of longer samples (whose size fits them) and only
  the longest samples' bucket drops its partial batch: an epoch drops fewer samples than that bucket's size.

Every check counts the samples ``training_step`` saw, epoch by epoch, against what the user's loader trains
(a fresh copy of its sampler, iterated as a plain ``DataLoader`` would).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler, WeightedRandomSampler

from retune import ScheduledBatchSizeFinder
from retune.buckets.drawn import drawn_steps, why_draws_unknown
from retune.buckets.plan import Buckets, count_batches, epoch_batches, mean_batch
from retune.buckets.train_buckets import TrainBuckets, _uppers, sampler_that_chooses
from retune.probing.probe_batches import ProbeBatches
from tests.buckets.test_sampler import ByEpoch
from tests.helpers import bucket_data
from tests.helpers.bucket_data import BucketModel, IndexedTokens, long_tail_lengths, pad_collate, tokens
from tests.helpers.lightning_ns import seed
from tests.helpers.retune_warnings import retune_warnings

N = 200


class LoaderModel(BucketModel):
    """``BucketModel`` whose loader takes ``make_sampler()`` (None: shuffled) and ``drop_last``."""

    def __init__(self, make_sampler: Callable[[], Any] | None, drop_last: bool = False) -> None:
        super().__init__(IndexedTokens(long_tail_lengths(N)), batch_size=8, drop_last=drop_last)
        self.make_sampler = make_sampler

    def train_dataloader(self) -> DataLoader[Any]:
        if self.make_sampler is None:
            return super().train_dataloader()
        return DataLoader(
            self.data, batch_size=8, sampler=self.make_sampler(), collate_fn=pad_collate, drop_last=self.drop_last
        )


def _fit(
    make_sampler: Callable[[], Any] | None, *, drop_last: bool = False, epochs: int = 2
) -> tuple[ByEpoch, ScheduledBatchSizeFinder, list[str]]:
    seed(0)
    model = LoaderModel(make_sampler, drop_last)
    finder = ScheduledBatchSizeFinder(bucket_data.schedule(), sample_size=tokens, verbose=False, write_report=False)
    seen = ByEpoch()
    with retune_warnings() as said:
        bucket_data.trainer([seen, finder], epochs=epochs).fit(model)
    assert finder.bucket_sizes and len(set(finder.bucket_sizes)) > 1, finder.bucket_sizes  # bucketed
    assert not any("batching: fixed" in m for m in said), said
    return seen, finder, said


def _loader_trains(make_sampler: Callable[[], Any], epochs: int, drop_last: bool = False) -> list[list[int]]:
    """What the user's own loader (batch size 8) trains over a fresh copy of its sampler, epoch by epoch."""
    sampler = make_sampler()
    out = []
    for epoch in range(epochs):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)  # as Lightning does for the loader's sampler
        loader = DataLoader(list(range(N)), batch_size=8, sampler=sampler, drop_last=drop_last)
        out.append([int(i) for batch in loader for i in batch])
    return out


# -- a sampler over part of the dataset trains that part ---------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_a_distributed_sampler_that_shards_a_one_process_run_trains_its_shard(rank: int) -> None:
    # manual or array-job sharding: one process trains the share of rank ``rank`` of 2. Before: all 200 samples
    def make() -> DistributedSampler[Any]:
        return DistributedSampler(range(N), num_replicas=2, rank=rank, shuffle=True, seed=3)

    seen, _, _ = _fit(make)
    expected = _loader_trains(make, 2)
    assert len(expected[0]) == N // 2 and set(expected[0]) != set(expected[1])  # a new shard every epoch
    for epoch in range(2):
        assert Counter(seen.trained(epoch)) == Counter(expected[epoch])
    assert max(len(b) for b in seen.epochs[0]) > 8  # its draws trained in buckets, above the loader's size


def test_a_sequential_sampler_over_part_of_the_dataset_trains_that_part() -> None:
    seen, _, _ = _fit(lambda: SequentialSampler(range(100)))  # before: all 200 samples
    for epoch in range(2):
        assert sorted(seen.trained(epoch)) == list(range(100))
    assert max(len(b) for b in seen.epochs[0]) > 8


def test_the_runs_own_sharding_is_replaced_and_any_other_chooses() -> None:
    data = list(range(N))

    def loader(sampler: Any) -> DataLoader[Any]:
        return DataLoader(data, sampler=sampler)

    # what Lightning injects under DDP for a plain loader: DistributedSampler(loader.dataset, num_replicas=world
    # size, rank=global rank) (its _get_distributed_sampler); a user's own DistributedSampler(dataset) is the same
    for world, rank in ((1, 0), (2, 0), (2, 1), (4, 3)):
        own = loader(DistributedSampler(data, num_replicas=world, rank=rank))
        assert sampler_that_chooses(own, world, rank) is None
    assert sampler_that_chooses(loader(DistributedSampler(range(N), num_replicas=2, rank=1)), 2, 1) is None
    for sampler, world, rank in (
        (DistributedSampler(data, num_replicas=2, rank=0), 1, 0),  # a one-process run's shard
        (DistributedSampler(data, num_replicas=2, rank=0), 2, 1),  # another rank's shard
        (DistributedSampler(data, num_replicas=4, rank=1), 2, 1),  # another sharding than the run's
        (DistributedSampler(range(N // 2), num_replicas=2, rank=1), 2, 1),  # shards of part of the dataset
    ):
        assert sampler_that_chooses(loader(sampler), world, rank) == "DistributedSampler"
    assert sampler_that_chooses(loader(SequentialSampler(range(N - 1)))) == "SequentialSampler"
    assert sampler_that_chooses(loader(SequentialSampler(range(N)))) is None

    # one process: a sharding sampler's draws are the epoch (grouped each epoch); under DDP a sharding that is not
    # the run's cannot be shared by the ranks (each draws its own share): one batch size, one warning
    shard = DistributedSampler(data, num_replicas=2, rank=0)
    buckets = TrainBuckets(4, ProbeBatches("largest", tokens))
    assert buckets.why_not(loader(shard)) is None and why_draws_unknown(shard, 1) is None
    buckets._world_size, buckets._rank = 2, 1
    reason = buckets.why_not(loader(shard))
    assert reason is not None and "shards them itself across the 2 processes" in reason
    assert buckets.why_not(loader(DistributedSampler(data, num_replicas=2, rank=1))) is None


# -- drop_last drops one partial batch an epoch, not one per bucket -----------------------------------------------


def _weights() -> torch.Tensor:
    return torch.tensor([10.0 if i % 4 == 0 else 1.0 for i in range(N)])


@pytest.mark.parametrize("num_samples", [60, 120])
def test_a_sampler_of_fewer_draws_than_samples_with_drop_last_drops_less_than_one_batch(num_samples: int) -> None:
    def make() -> WeightedRandomSampler:
        return WeightedRandomSampler(_weights(), num_samples, generator=torch.Generator().manual_seed(11))

    seen, finder, _ = _fit(make, drop_last=True)
    draws = _loader_trains(make, 2)
    longest = finder.bucket_sizes[-1]
    for epoch in range(2):
        trained = Counter(seen.trained(epoch))
        assert not trained - Counter(draws[epoch]), "only the sampler's draws, at most as often as drawn"
        dropped = num_samples - trained.total()
        assert 0 <= dropped < longest, (dropped, longest, finder.bucket_sizes)  # before: most of the draws
        assert {len(b) for b in seen.epochs[epoch]} <= set(finder.bucket_sizes)  # every batch full
    assert max(finder.bucket_sizes) <= num_samples  # no bucket searched above what one epoch can draw


def test_a_sampler_on_torchs_rng_draws_a_new_epoch_every_epoch() -> None:
    """A ``WeightedRandomSampler`` without a generator of its own draws from torch's RNG. Its epoch is drawn when
    Lightning first asks the loader's length, inside the rebuild at the search's size that puts the random streams
    back: epoch 1 trained epoch 0's draws again, in the same order (and epoch 2 those of epoch 1, and so on)."""
    seen, _, _ = _fit(lambda: WeightedRandomSampler(_weights(), 150), epochs=3)
    epochs = [seen.trained(epoch) for epoch in range(3)]
    assert all(len(draws) == 150 for draws in epochs)
    assert len({tuple(sorted(draws)) for draws in epochs}) == 3, "each epoch a new draw of the sampler"


def test_a_shuffled_loader_with_drop_last_drops_less_than_one_batch_of_the_longest_samples() -> None:
    seen, finder, _ = _fit(None, drop_last=True)
    for epoch in range(2):
        trained = Counter(seen.trained(epoch))
        assert max(trained.values()) == 1 and set(trained) <= set(range(N))
        assert N - len(trained) < finder.bucket_sizes[-1], (N - len(trained), finder.bucket_sizes)
        assert {len(b) for b in seen.epochs[epoch]} <= set(finder.bucket_sizes)


# -- the plans (pure) ------------------------------------------------------------------------------------------------


def _random_buckets(r: random.Random) -> tuple[Buckets, list[int], dict[int, int]]:
    count = r.randint(1, 5)
    members, start = [], 0
    for _ in range(count):
        n = r.randint(1, 30)
        members.append(tuple(range(start, start + n)))
        start += n
    largest = tuple(10 * (b + 1) for b in range(count))
    sizes = [r.randint(1, 12) for _ in range(count)]
    length = {i: largest[b] for b, m in enumerate(members) for i in m}
    return Buckets(largest, tuple(members), largest), sizes, length


def test_drawn_steps_with_drop_last_move_partial_groups_up_and_drop_only_the_longest_buckets() -> None:
    r = random.Random(5)
    for _ in range(1500):
        buckets, sizes, length = _random_buckets(r)
        world = r.randint(1, 4)
        draws = [r.choice(list(length)) for _ in range(r.randint(0, 120))]
        steps = drawn_steps(buckets, sizes, draws, drop_last=True, world_size=world)
        trained = Counter(i for s in steps for i in s.group)
        assert not trained - Counter(draws)
        assert len(draws) - trained.total() < sizes[-1] * world  # at most the longest bucket's partial group
        for step in steps:
            assert len(step.group) == sizes[step.bucket] * world  # full: every rank its bucket's size
            assert all(length[i] <= buckets.largest[step.bucket] for i in step.group)  # shorter samples fit


@pytest.mark.parametrize("shuffle", [True, False])
def test_epoch_batches_with_drop_last_drop_less_than_the_longest_buckets_group_and_count_right(shuffle: bool) -> None:
    r = random.Random(7)
    for _ in range(600):
        buckets, sizes, length = _random_buckets(r)
        world = r.randint(1, 4)
        for drop_last in (True, False):
            ranks = [
                epoch_batches(
                    buckets, sizes, seed=3, epoch=1, shuffle=shuffle, drop_last=drop_last, world_size=world, rank=k
                )
                for k in range(world)
            ]
            count = count_batches(buckets, sizes, drop_last, world)
            assert all(len(plan) == count for plan in ranks)  # __len__ is every rank's number of batches
            assert all([b.bucket for b in plan] == [b.bucket for b in ranks[0]] for plan in ranks)
            plan = ranks[0]
            if plan:
                assert mean_batch(buckets, sizes, drop_last, world) == pytest.approx(
                    sum(len(b.indices) for b in plan) / len(plan)
                )
            if not drop_last:
                continue
            trained = Counter(i for p in ranks for b in p for i in b.indices)
            assert max(trained.values(), default=1) == 1
            assert len(length) - len(trained) < sizes[-1] * world
            for k, p in enumerate(ranks):
                for batch in p:
                    assert len(batch.indices) == sizes[batch.bucket], (k, batch)
                    assert all(length[i] <= buckets.largest[batch.bucket] for i in batch.indices)


def test_a_choosing_samplers_draws_cap_every_buckets_size() -> None:
    buckets = Buckets((10, 50), (tuple(range(90)), (90, 91, 92)), (10, 50))
    assert _uppers(buckets, 64, 1) == [64, 3]
    assert _uppers(buckets, 64, 1, draws=20) == [20, 3]
    assert _uppers(buckets, 64, 2, draws=20) == [10, 2]
    assert _uppers(buckets, 64, 1, draws=0) == [1, 1]


# -- the run's own DistributedSampler(drop_last=True): its epoch across the ranks ------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_draws_is_the_distributed_samplers_epoch_across_its_ranks(world: int, shuffle: bool) -> None:
    from retune.buckets.drawn import EveryRankDraws, trims_across_ranks

    for n in (10, 11, 13):
        shares = [
            DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=shuffle, seed=3, drop_last=True)
            for r in range(world)
        ]
        every = EveryRankDraws(shares[1])
        for epoch in (0, 1):
            for share in shares:
                share.set_epoch(epoch)
            every.set_epoch(epoch)
            drawn = list(every)
            assert len(drawn) == len(every) == (n // world) * world
            for r, share in enumerate(shares):  # rank r's own pass is the epoch's r-th of every `world` draws
                assert drawn[r::world] == list(share)
        assert trims_across_ranks(shares[0], n) == (n % world != 0)
        assert shares[1].rank == 1  # the copies per rank left the sampler as it was


def test_only_the_runs_own_distributed_sampler_that_trims_has_its_draws_bucketed() -> None:
    from retune.buckets.drawn import EveryRankDraws
    from retune.buckets.train_buckets import draws_source

    odd, even = list(range(11)), list(range(10))

    def loader(data: list[int], drop_last: bool) -> DataLoader[Any]:
        return DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=1, drop_last=drop_last))

    trims = loader(odd, True)
    assert sampler_that_chooses(trims, 2, 1) == "DistributedSampler with drop_last=True"
    assert isinstance(draws_source(trims, 2, 1), EveryRankDraws)
    for kept in (loader(even, True), loader(odd, False)):  # drops nothing; pads instead (every sample trains)
        assert sampler_that_chooses(kept, 2, 1) is None
        assert draws_source(kept, 2, 1) is kept.batch_sampler.sampler  # type: ignore[union-attr]
    # not the run's own sharding (one process): a shard of the data, its own draws as they are
    assert sampler_that_chooses(trims, 1, 0) == "DistributedSampler"
    assert draws_source(trims, 1, 0) is trims.batch_sampler.sampler  # type: ignore[union-attr]


@pytest.mark.parametrize("chooses", [False, True], ids=["plain", "drawn"])
def test_under_drop_last_a_bucket_capped_by_its_samples_fills_a_step_on_every_rank(chooses: bool) -> None:
    """Found by review (2 gloo ranks, 201 samples, ``drop_last``): a bucket's size was capped at its share of the
    samples rounded up, 36 per rank for 71 samples, so a step needed 72 and none filled: all 71 moved up, bucket
    by bucket, into the longest samples' bucket, and trained there a few at a time (38 batches per rank where 4
    do). Under ``drop_last`` the share rounds down: each bucket fills a step of its own."""
    buckets = Buckets((10, 50, 100), (tuple(range(71)), tuple(range(71, 191)), tuple(range(191, 201))), (10, 50, 100))
    before = [max(1, -(-len(m) // 2)) for m in buckets.members]  # the old cap: [36, 60, 5]
    sizes = _uppers(buckets, 1024, 2, drop_last=True)
    assert sizes == [35, 60, 5] and before == [36, 60, 5]

    def steps(batch_sizes: list[int]) -> list[int]:  # the bucket of each step of rank 0
        if chooses:
            plan = drawn_steps(buckets, batch_sizes, list(range(201)), drop_last=True, world_size=2)
            return [step.bucket for step in plan]
        batches = epoch_batches(buckets, batch_sizes, seed=0, epoch=0, drop_last=True, world_size=2, rank=0)
        return [batch.bucket for batch in batches]

    assert len(steps(before)) == 9 and 0 not in steps(before)  # the first bucket never trained as itself
    assert sorted(steps(sizes)) == [0, 1, 2]  # a full step of every bucket; 1 sample dropped (< 5 x 2)
