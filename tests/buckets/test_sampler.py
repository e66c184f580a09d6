"""``batching: buckets`` trains exactly what the user's sampler draws (issue 28, point 1).

Buckets regroup an epoch's samples by size. A sampler that chooses which samples train and how often
(weights, a subset, ``num_samples``) is part of the recipe, so each epoch its own draws are bucketed:
the sampler is iterated once at the epoch's start, with its own generator, and exactly those indices,
each as often as drawn, train, grouped by size. Before, buckets replaced such a sampler: the label
share of a ``WeightedRandomSampler`` fell from its draws' to the dataset's, ``num_samples`` was ignored
and excluded samples trained. A sampler whose draws cannot be known before the epoch (no ``__len__``)
keeps the loader as the user built it (``batching: fixed``), with one warning that names it. Under several
processes rank zero's draws are shared out (the pure plan here, 2 gloo ranks in tests/buckets/test_ddp.py).

Every check compares the samples ``training_step`` saw, epoch by epoch, with the draws of a fresh copy
of the same sampler (same generator seed) iterated as a plain ``DataLoader`` would iterate it: exact
multiset equality. Every real step is measured (``StepPeaks``) against the memory budget.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from retune import ScheduledBatchSizeFinder
from retune.buckets.drawn import (
    DrawnBucketBatchSampler,
    bucket_of_index,
    draw_epoch,
    drawn_batches,
    drawn_steps,
    why_draws_unknown,
)
from retune.buckets.plan import Buckets
from retune.buckets.train_buckets import TrainBuckets, sampler_that_chooses
from retune.errors import RetuneError
from retune.schedule.models import parse_byte_size
from tests.helpers import bucket_data
from tests.helpers.bucket_data import BucketModel, IndexedTokens, long_tail_lengths, pad_collate, tokens
from tests.helpers.lightning_ns import pl, seed
from tests.helpers.retune_warnings import retune_warnings
from tests.helpers.varlen import StepPeaks

N = 200
BUDGET = parse_byte_size(bucket_data.BUDGET)


class EvenIndices(Sampler[int]):
    """A custom sampler that trains on a subset: the even indices only (in order)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return (self.n + 1) // 2


class EpochShifted(Sampler[int]):
    """A custom sampler that draws differently every epoch through ``set_epoch`` (a curriculum that widens)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(range(0, self.n, 3 - self.epoch))  # epoch 0: every 3rd sample; epoch 1: every 2nd

    def __len__(self) -> int:
        return len(range(0, self.n, 3 - self.epoch))


class Endless(Sampler[int]):
    """A sampler without ``__len__``: its draws cannot be known before the epoch."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(3)
        while True:
            yield int(torch.randint(self.n, (1,), generator=generator))


class SamplerModel(BucketModel):
    def __init__(self, data: IndexedTokens, make_sampler: Callable[[], Any]) -> None:
        super().__init__(data, batch_size=8)
        self.make_sampler = make_sampler

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, sampler=self.make_sampler(), collate_fn=pad_collate)


class ByEpoch(pl.Callback):  # type: ignore[misc]
    """The dataset indices of every real step, per epoch (probe steps are hidden from callbacks)."""

    def __init__(self) -> None:
        self.epochs: dict[int, list[list[int]]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.epochs.setdefault(int(trainer.current_epoch), []).append(batch[2].tolist())

    def trained(self, epoch: int) -> list[int]:
        return [i for batch in self.epochs.get(epoch, []) for i in batch]


def _fit(
    make_sampler: Callable[[], Any], epochs: int = 2, **trainer_kwargs: Any
) -> tuple[ByEpoch, list[str], ScheduledBatchSizeFinder, StepPeaks]:
    seed(0)
    model = SamplerModel(IndexedTokens(long_tail_lengths(N)), make_sampler)
    finder = ScheduledBatchSizeFinder(bucket_data.schedule(), sample_size=tokens, verbose=False, write_report=False)
    seen, peaks = ByEpoch(), StepPeaks()
    with retune_warnings() as said:
        bucket_data.trainer([seen, peaks, finder], epochs=epochs, **trainer_kwargs).fit(model)
    return seen, said, finder, peaks


def _draws(make_sampler: Callable[[], Any], epochs: int) -> list[list[int]]:
    """What a plain DataLoader over a fresh copy of the sampler trains, epoch by epoch (its set_epoch called)."""
    sampler = make_sampler()
    out = []
    for epoch in range(epochs):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        out.append([int(i) for i in sampler])
    return out


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(11)


def _weights() -> torch.Tensor:
    # samples with index % 4 == 0 get 10x the weight: the draws' share of them is far above the dataset's 25%
    return torch.tensor([10.0 if i % 4 == 0 else 1.0 for i in range(N)])


def _bucketed(finder: ScheduledBatchSizeFinder, seen: ByEpoch, said: list[str]) -> None:
    """Buckets were used (several sizes trained, no fallback warning)."""
    assert finder.bucket_sizes and len(set(finder.bucket_sizes)) > 1, finder.bucket_sizes
    sizes = {len(b) for batches in seen.epochs.values() for b in batches}
    assert max(sizes) > 8, sizes  # the short samples' buckets train far above the loader's batch_size of 8
    assert not any("batching: fixed" in m for m in said), said


def _within_budget(peaks: StepPeaks) -> None:
    assert peaks.peaks and max(peaks.peaks) <= BUDGET, max(peaks.peaks) / BUDGET


@pytest.mark.parametrize("num_samples", [120, 600])
def test_a_weighted_sampler_trains_exactly_its_own_draws_every_epoch(num_samples: int) -> None:
    def make() -> WeightedRandomSampler:
        return WeightedRandomSampler(_weights(), num_samples, generator=_generator())

    seen, said, finder, peaks = _fit(make)
    expected = _draws(make, 2)
    assert expected[0] != expected[1]
    for epoch in range(2):
        trained = seen.trained(epoch)
        assert len(trained) == num_samples  # num_samples smaller and larger than the dataset's 200
        assert Counter(trained) == Counter(expected[epoch])  # the same samples, as often as the sampler drew them
        share = sum(i % 4 == 0 for i in trained) / len(trained)
        assert share == sum(i % 4 == 0 for i in expected[epoch]) / num_samples
        assert share > 0.6, share  # the dataset's share is 0.25
    # the samples per step that keep_effective and lr_scaling use: the epoch's draws over its batches
    assert finder.history[0].samples_per_step == round(num_samples / len(seen.epochs[0]), 2)
    _bucketed(finder, seen, said)
    _within_budget(peaks)


def test_a_subset_sampler_never_trains_an_excluded_sample() -> None:
    seen, said, finder, peaks = _fit(lambda: EvenIndices(N))
    for epoch in range(2):
        assert sorted(seen.trained(epoch)) == list(range(0, N, 2))  # each drawn sample once, no odd one
    _bucketed(finder, seen, said)
    _within_budget(peaks)


def test_a_subset_random_sampler_trains_its_subset_with_its_generator() -> None:
    def make() -> SubsetRandomSampler:
        return SubsetRandomSampler(list(range(50, 190)), generator=_generator())

    seen, said, finder, peaks = _fit(make)
    for epoch in range(2):
        assert sorted(seen.trained(epoch)) == list(range(50, 190))
    _bucketed(finder, seen, said)
    _within_budget(peaks)


def test_a_random_sampler_with_replacement_keeps_its_draws() -> None:
    def make() -> RandomSampler:
        return RandomSampler(range(N), replacement=True, num_samples=150, generator=_generator())

    seen, said, finder, _ = _fit(make)
    expected = _draws(make, 2)
    for epoch in range(2):
        assert Counter(seen.trained(epoch)) == Counter(expected[epoch])
    _bucketed(finder, seen, said)


def test_a_sampler_gets_its_epoch_before_it_draws() -> None:
    seen, said, finder, _ = _fit(lambda: EpochShifted(N))
    assert sorted(seen.trained(0)) == list(range(0, N, 3))
    assert sorted(seen.trained(1)) == list(range(0, N, 2))  # an epoch longer than the first is not cut short
    _bucketed(finder, seen, said)


def test_a_run_resumed_at_an_epoch_boundary_trains_what_a_fresh_sampler_draws(tmp_path: Path) -> None:
    # a resumed run builds its loader (and so draws) before Lightning moves current_epoch to the restored
    # epoch: the draw must be the one for the epoch set_epoch gets, and only one pass of the sampler
    def make() -> WeightedRandomSampler:
        return WeightedRandomSampler(_weights(), 600, generator=_generator())

    def finder() -> ScheduledBatchSizeFinder:
        return ScheduledBatchSizeFinder(bucket_data.schedule(), sample_size=tokens, verbose=False, write_report=False)

    seed(0)
    first = SamplerModel(IndexedTokens(long_tail_lengths(N)), make)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    bucket_data.trainer([finder(), checkpoint], epochs=1, enable_checkpointing=True).fit(first)
    seed(0)
    resumed = SamplerModel(IndexedTokens(long_tail_lengths(N)), make)
    seen, again = ByEpoch(), finder()
    bucket_data.trainer([seen, again], epochs=2).fit(resumed, ckpt_path=str(tmp_path / "last.ckpt"))
    assert list(seen.epochs) == [1]
    # a plain loader over a fresh sampler, resumed: set_epoch(1), then its first pass
    assert Counter(seen.trained(1)) == Counter(_draws(make, 1)[0])
    assert again.bucket_sizes and max(len(b) for b in seen.epochs[1]) > 8


def test_the_epoch_count_follows_the_draws_under_limit_train_batches_and_max_steps() -> None:
    def make() -> WeightedRandomSampler:
        return WeightedRandomSampler(_weights(), 600, generator=_generator())

    seen, _, _, _ = _fit(make, epochs=2, limit_train_batches=3)
    assert [len(seen.epochs[e]) for e in range(2)] == [3, 3]
    full, _, _, _ = _fit(make, epochs=2)
    counts = [len(full.epochs[e]) for e in range(2)]
    assert min(counts) > 6 and counts[0] != counts[1], counts  # the draws change the count from epoch to epoch
    assert [len(full.trained(e)) for e in range(2)] == [600, 600]
    half, _, _, _ = _fit(make, epochs=2, limit_train_batches=0.5)
    assert [len(half.epochs[e]) for e in range(2)] == [c // 2 for c in counts]  # each epoch's own count, halved
    for e in range(2):  # the first batches of the same plan
        assert half.epochs[e] == full.epochs[e][: counts[e] // 2]
    steps, _, _, _ = _fit(make, epochs=5, max_steps=counts[0] + 2)
    assert [len(steps.epochs[e]) for e in sorted(steps.epochs)] == [counts[0], 2]


class ValidatedModel(SamplerModel):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.training_step(batch, batch_idx)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=4, collate_fn=pad_collate)


class ValidationAfter(pl.Callback):  # type: ignore[misc]
    """How many training batches of the epoch ran before each validation."""

    def __init__(self, seen: ByEpoch) -> None:
        self.seen = seen
        self.after: list[tuple[int, int]] = []

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            epoch = int(trainer.current_epoch)
            self.after.append((epoch, len(self.seen.epochs.get(epoch, []))))


def test_validation_runs_after_each_epochs_last_batch_whatever_its_count() -> None:
    # Lightning validates when (batch_idx + 1) % val_check_batch == 0, val_check_batch counted when the loader
    # was built: without a recount an epoch of other length validates mid-epoch, or not at all
    seed(0)
    model = ValidatedModel(
        IndexedTokens(long_tail_lengths(N)), lambda: WeightedRandomSampler(_weights(), 600, generator=_generator())
    )
    finder = ScheduledBatchSizeFinder(bucket_data.schedule(), sample_size=tokens, verbose=False, write_report=False)
    seen = ByEpoch()
    after = ValidationAfter(seen)
    bucket_data.trainer([seen, after, finder], epochs=2, limit_val_batches=1).fit(model)
    counts = [len(seen.epochs[e]) for e in range(2)]
    assert counts[0] != counts[1], counts
    assert after.after == [(0, counts[0]), (1, counts[1])]


def test_a_plain_shuffled_or_sequential_loader_is_bucketed_as_before() -> None:
    for make in (
        lambda: RandomSampler(range(N), generator=_generator()),
        lambda: SequentialSampler(range(N)),
        lambda: DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=5),
    ):
        seen, said, finder, _ = _fit(make)
        for epoch in range(2):
            assert sorted(seen.trained(epoch)) == list(range(N))  # every sample once per epoch
        _bucketed(finder, seen, said)
        assert sampler_that_chooses(make_loader(make())) is None
        assert not isinstance(finder._buckets.sampler, DrawnBucketBatchSampler)  # type: ignore[union-attr]


def make_loader(sampler: Any) -> DataLoader[Any]:
    return DataLoader(list(range(N)), sampler=sampler)


def test_a_sampler_whose_draws_cannot_be_known_falls_back_to_fixed_with_a_warning_naming_it() -> None:
    seen, said, finder, _ = _fit(lambda: Endless(N), epochs=1, limit_train_batches=4)
    warnings = [m for m in said if "batching: buckets cannot" in m]
    assert len(warnings) == 1, said
    assert "Endless" in warnings[0] and "no __len__" in warnings[0] and "batching: fixed" in warnings[0]
    assert finder.bucket_sizes == []
    assert [len(b) for b in seen.epochs[0]] == [finder.batch_size] * 4


def test_under_several_processes_a_sampler_is_bucketed_unless_the_ranks_cannot_share_its_draws() -> None:
    # rank zero's draws are shared out (tests/buckets/test_ddp.py runs it on 2 ranks); a sampler that shards
    # itself, or one Lightning does not share out (use_distributed_sampler=False), keeps today's fallback
    class OwnShards(DistributedSampler):  # type: ignore[type-arg]
        """A user's DistributedSampler subclass: each rank draws its own share."""

    weighted = WeightedRandomSampler(_weights(), 100)
    assert why_draws_unknown(weighted, world_size=1) is None
    assert why_draws_unknown(weighted, world_size=2) is None
    own = OwnShards(range(N), num_replicas=2, rank=0)
    reason = why_draws_unknown(own, world_size=2)
    assert reason is not None and "OwnShards" in reason and "shards them itself across the 2 processes" in reason
    assert why_draws_unknown(own, world_size=1) is None  # one process: its draws are the epoch
    unshared = why_draws_unknown(weighted, world_size=2, sharded_by_lightning=False)
    assert unshared is not None and "WeightedRandomSampler" in unshared and "use_distributed_sampler=False" in unshared
    endless = why_draws_unknown(Endless(N), world_size=2)
    assert endless is not None and "Endless" in endless and "no __len__" in endless
    from retune.probing.probe_batches import ProbeBatches

    buckets = TrainBuckets(4, ProbeBatches("largest", tokens))
    buckets._world_size = 2
    assert buckets.why_not(make_loader(weighted)) is None
    assert buckets.why_not(make_loader(own)) == reason
    assert buckets.why_not(make_loader(Endless(N))) == endless
    assert buckets.why_not(make_loader(RandomSampler(range(N)))) is None  # every sample once: bucketed as before
    assert buckets.why_not(make_loader(DistributedSampler(range(N), num_replicas=2, rank=0))) is None
    buckets._shared_out = False
    assert buckets.why_not(make_loader(weighted)) == unshared


@pytest.mark.parametrize("shared_out", [True, False])
def test_whether_lightning_shares_out_a_sampler_is_read_from_the_trainer(shared_out: bool) -> None:
    from retune import compat
    from tests.helpers.lightning_ns import LEGACY

    flag = "replace_sampler_ddp" if LEGACY else "use_distributed_sampler"
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, **{flag: shared_out})
    assert compat.shares_out_samplers(trainer) is shared_out


def test_which_samplers_choose() -> None:
    data = list(range(10))
    assert sampler_that_chooses(DataLoader(data)) is None
    assert sampler_that_chooses(DataLoader(data, shuffle=True)) is None
    assert sampler_that_chooses(DataLoader(data, sampler=RandomSampler(data, num_samples=4))) is not None
    assert sampler_that_chooses(DataLoader(data, sampler=WeightedRandomSampler([1.0] * 10, 10))) == (
        "WeightedRandomSampler"
    )
    assert sampler_that_chooses(DataLoader(data, sampler=EvenIndices(10))) == "EvenIndices"


# -- the plan of an epoch's draws (pure) -----------------------------------------------------------------------


def test_drawn_batches_keep_every_draw_in_its_bucket_at_its_size() -> None:
    sizes = [10, 10, 10, 50, 50, 200]
    buckets = Buckets((10, 50, 200), ((0, 1, 2), (3, 4), (5,)), (10, 50, 200))
    draws = [5, 0, 0, 3, 5, 5, 1, 4, 0, 2, 3]
    plan = drawn_batches(buckets, [3, 2, 1], draws)
    assert Counter(i for b in plan for i in b.indices) == Counter(draws)
    for batch in plan:
        assert all(sizes[i] <= buckets.bounds[batch.bucket] for i in batch.indices)
        assert len(batch.indices) <= [3, 2, 1][batch.bucket]
    # each bucket's draws in draw order, batches in the order of their first draw
    assert [b.indices for b in plan] == [(5,), (0, 0, 1), (3, 4), (5,), (5,), (0, 2), (3,)]
    # drop_last: a bucket's partial batch moves up to the next bucket of longer samples (its size fits them), so
    # only the longest samples' bucket drops one (before: every bucket's, here (0, 2) and (3,))
    kept = drawn_batches(buckets, [3, 2, 1], draws, drop_last=True)
    assert [(b.bucket, b.indices) for b in kept] == [
        (2, (5,)),
        (0, (0, 0, 1)),
        (1, (3, 4)),
        (2, (5,)),
        (2, (5,)),
        (1, (0, 2)),
        (2, (3,)),
    ]
    moved = drawn_batches(buckets, [3, 2, 2], draws, drop_last=True)
    assert [b.indices for b in moved] == [(5, 5), (0, 0, 1), (3, 4), (5, 3), (0, 2)]
    short = drawn_batches(buckets, [3, 2, 2], draws[:-1], drop_last=True)  # the longest bucket's third 5 drops
    assert [(b.bucket, b.indices) for b in short] == [(2, (5, 5)), (0, (0, 0, 1)), (1, (3, 4)), (1, (0, 2))]
    with pytest.raises(ValueError, match="index 9"):
        drawn_batches(buckets, [3, 2, 1], [0, 9])


def test_draw_epoch_refuses_a_sampler_that_yields_more_than_its_length() -> None:
    class Liar(EvenIndices):
        def __len__(self) -> int:
            return 3

    with pytest.raises(RetuneError, match=r"Liar.*more indices than its __len__ \(3\)"):
        draw_epoch(Liar(20), 0)
    assert draw_epoch(EvenIndices(7), 0) == [0, 2, 4, 6]


def test_drawn_sampler_draws_once_per_epoch() -> None:
    calls: list[int] = []

    class Counting(EvenIndices):
        def __iter__(self) -> Iterator[int]:
            calls.append(1)
            return super().__iter__()

    buckets = Buckets((10,), (tuple(range(10)),), (10,))
    sampler = DrawnBucketBatchSampler(buckets, [4], draws_from=Counting(10), epoch=0)
    assert len(sampler) == 2 and list(sampler) == [[0, 2, 4, 6], [8]] and sampler.bucket_at(1) == 0
    assert len(calls) == 1  # length, batches and buckets of the epoch come from one pass
    sampler.set_epoch(1)
    assert len(sampler) == 2 and len(calls) == 2


def test_drawn_steps_under_several_ranks_train_every_draw_once_at_one_bucket_per_step() -> None:
    # random buckets, sizes, draws and world sizes: each step gives every rank 1..size samples, holds only samples
    # of its bucket or shorter ones (their memory fits), and every draw trains exactly once across the ranks unless
    # no step could spare a sample for the longest bucket's last step (then at most world_size - 1 repeats)
    rng = random.Random(0)
    padded = 0
    for _ in range(2000):
        count, world = rng.randint(1, 4), rng.randint(1, 4)
        members, start = [], 0
        for _ in range(count):
            size = rng.randint(1, 6)
            members.append(tuple(range(start, start + size)))
            start += size
        bounds = tuple(10 * (b + 1) for b in range(count))
        buckets = Buckets(bounds, tuple(members), bounds)
        sizes = [rng.randint(1, 5) for _ in range(count)]
        draws = [rng.randrange(start) for _ in range(rng.randint(0, 60))]
        where = bucket_of_index(buckets)
        steps = drawn_steps(buckets, sizes, draws, world_size=world)
        plans = [drawn_batches(buckets, sizes, draws, world_size=world, rank=r) for r in range(world)]
        trained = Counter(i for plan in plans for b in plan for i in b.indices)
        assert trained == Counter(i for s in steps for i in s.group)
        extra = trained - Counter(draws)
        if extra:
            padded += 1
            assert trained - extra == Counter(draws) and extra.total() < world
            # no step of shorter samples could spare the missing ones and still give every rank a sample
            assert all(len(s.group) - extra.total() < world for s in steps if s.bucket != count - 1)
        else:
            assert trained == Counter(draws)
        for step in steps:
            assert world <= len(step.group) <= sizes[step.bucket] * world
            assert all(where[i] <= step.bucket for i in step.group)
        for plan in plans:
            assert [b.bucket for b in plan] == [s.bucket for s in steps]
            assert all(1 <= len(b.indices) <= sizes[b.bucket] for b in plan)
        if world == 1:
            assert plans[0] == drawn_batches(buckets, sizes, draws)  # one process: the plan it always was
    assert 0 < padded < 300, padded  # the fallback of tiny epochs, not the rule


def test_drawn_steps_fill_the_longest_buckets_last_step_from_shorter_samples_not_with_repeats() -> None:
    # 2 ranks, the long bucket at size 1 with an odd number of draws: its last step takes a short sample from a
    # step that can spare one, where DistributedSampler would repeat a long one
    buckets = Buckets((10, 50), ((0, 1, 2), (3, 4)), (10, 50))
    draws = [0, 1, 3, 2, 4, 0, 3, 1, 2]
    steps = drawn_steps(buckets, [4, 1], draws, world_size=2)
    assert Counter(i for s in steps for i in s.group) == Counter(draws)
    assert [(s.bucket, s.group) for s in steps] == [(0, (0, 1, 2, 0, 1)), (1, (3, 4)), (1, (3, 2))]
    only_long = drawn_steps(buckets, [4, 1], [3, 4, 3], world_size=2)  # nothing shorter to take: one repeat
    assert [s.group for s in only_long] == [(3, 4), (3, 3)]


def test_a_drawn_sampler_of_several_ranks_trains_rank_zeros_draws_and_every_rank_reaches_the_broadcast() -> None:
    # two ranks simulated in one process: ``share`` gives every rank rank zero's object, as the broadcast does
    buckets = Buckets((10,), (tuple(range(N)),), (10,))
    shared: dict[str, Any] = {}

    def share_from(rank: int) -> Callable[[Any], Any]:
        def share(obj: Any) -> Any:
            if rank == 0:
                shared["obj"] = obj
            shared.setdefault("calls", []).append(rank)
            return shared["obj"]

        return share

    def weighted(seed_value: int) -> WeightedRandomSampler:
        return WeightedRandomSampler(_weights(), 61, generator=torch.Generator().manual_seed(seed_value))

    rank1_sampler = weighted(99)  # another seed on rank 1: rank zero's draws win, rank 1's generator still advances
    ranks = [
        DrawnBucketBatchSampler(buckets, [8], draws_from=weighted(11), world_size=2, rank=0, share=share_from(0)),
        DrawnBucketBatchSampler(buckets, [8], draws_from=rank1_sampler, world_size=2, rank=1, share=share_from(1)),
    ]
    batches = [list(r) for r in ranks]
    expected = [int(i) for i in weighted(11)]
    assert Counter(i for b in batches[0] + batches[1] for i in b) == Counter(expected)
    assert len(batches[0]) == len(batches[1]) == 4 and ranks[1].draws == expected
    assert ranks[0].mean_batch() == ranks[1].mean_batch() == 61 / 8
    state = rank1_sampler.generator.get_state()  # type: ignore[union-attr]
    assert not torch.equal(state, torch.Generator().manual_seed(99).get_state())  # one pass, as under Lightning

    class Liar(EvenIndices):
        def __len__(self) -> int:
            return 3

    shared.clear()
    failing = DrawnBucketBatchSampler(buckets, [8], draws_from=Liar(N), world_size=2, rank=0, share=share_from(0))
    waiting = DrawnBucketBatchSampler(
        buckets, [8], draws_from=EvenIndices(N), world_size=2, rank=1, share=share_from(1)
    )
    for sampler in (failing, waiting):
        with pytest.raises(RetuneError, match=r"rank 0: .*Liar.*more indices than its __len__"):
            len(sampler)
    assert shared["calls"] == [0, 1]  # both ranks reached the broadcast: neither waits for the other
