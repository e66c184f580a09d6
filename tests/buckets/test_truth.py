"""``batching: buckets`` trains the user's data and never keeps a size it measured to fail (issue 28).

Memory comes from oracles that raise the real OOM error type (``torch.OutOfMemoryError``) when a batch's
cost passes a capacity, so the searches bisect on real out-of-memory steps, as on a GPU without a budget.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from retune import ScheduledBatchSizeFinder
from retune.buckets.plan import plan_buckets
from retune.probing.sample_sizes import scan_sizes
from tests.helpers import bucket_data
from tests.helpers.bucket_data import BucketModel, IndexedTokens, long_tail_lengths, tokens
from tests.helpers.lightning_ns import seed
from tests.helpers.retune_warnings import retune_warnings

N = 400


def _data() -> IndexedTokens:
    return IndexedTokens(long_tail_lengths(N))


class _CostOracle(BucketModel):
    """Runs out of memory like a GPU, with the real error type, when ``batch x cost`` passes ``capacity``; a
    sample's cost is its tokens, except for the ``heavy`` samples, whose memory does not follow their length.
    Counts ``training_step`` calls per epoch, and those of real steps (between the batch hooks, with gradients)
    apart."""

    def __init__(
        self,
        data: Any,
        capacity: int,
        heavy: dict[int, int] | None = None,
        long_halved_from: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(data, **kwargs)
        self.capacity, self.heavy, self.long_halved_from = capacity, heavy or {}, long_halved_from
        self.real = False
        self.real_calls: Counter[int] = Counter()
        self.real_ooms = 0
        self.calls_per_batch: list[tuple[list[int], int]] = []
        """Each real batch's dataset indices and how many ``training_step`` calls it took."""

    def cost(self, ids: torch.Tensor, index: torch.Tensor) -> int:
        lengths = (ids > 0).sum(1).tolist()
        return max(self.heavy.get(int(i), n) for i, n in zip(index.tolist(), lengths, strict=True))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, _, index = batch
        # the oom trigger's fit-start exactness check runs the first batch without gradients: no training step
        real = self.real and torch.is_grad_enabled()
        if real:
            self.real_calls[self.trainer.current_epoch] += 1
            self.calls_per_batch[-1] = (self.calls_per_batch[-1][0], self.calls_per_batch[-1][1] + 1)
        capacity = self.capacity
        halved = self.long_halved_from is not None and self.trainer.global_step >= self.long_halved_from
        if halved and int((ids > 0).sum(1).max()) > 100:
            capacity //= 2  # memory that long sequences need grew: only the long samples' bucket fails
        if ids.shape[0] * self.cost(ids, index) > capacity:
            self.real_ooms += int(real)
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle: {ids.shape[0]} x cost > {self.capacity})")
        return super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.real = True
        self.calls_per_batch.append((batch[2].tolist(), 0))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.real = False


def _oracle_schedule(oom: bool, **search: Any) -> dict[str, Any]:
    triggers: list[dict[str, Any]] = [{"kind": "fit_start"}]
    if oom:
        triggers.append({"kind": "oom"})
    return {
        "triggers": triggers,
        "search": {
            "batching": "buckets",
            "buckets": 4,
            "steps_per_trial": 1,
            "mode": "binsearch",
            "margin": 0.0,
            **search,
        },
    }


# -- a size measured to fail is never used for that bucket again ---------------------------------------------


def _heavy_sample(data: IndexedTokens) -> tuple[int, int]:
    """The longest sample of the shortest bucket, and a cost for it above the next bucket's longest sample:
    its memory does not follow its length, so "a size that fits longer samples fits shorter ones" is wrong."""
    scan = scan_sizes(data, range(len(data)), tokens)
    plan = plan_buckets(scan.order, scan.sizes, 4)
    return plan.members[0][0], 2 * plan.largest[1]


@pytest.mark.parametrize("oom", [False, True])
def test_a_bucket_never_trains_at_a_size_its_probes_measured_to_fail(oom: bool) -> None:
    seed(0)
    data = _data()
    heavy, cost = _heavy_sample(data)
    model = _CostOracle(data, capacity=2048, heavy={heavy: cost})
    finder = ScheduledBatchSizeFinder(_oracle_schedule(oom), sample_size=tokens, verbose=False, write_report=False)
    bucket_data.trainer([finder], epochs=3).fit(model)
    searches = [e for e in finder.history if not e.is_recovery]
    for event in searches:
        for bucket, size in enumerate(event.bucket_sizes):
            failed = [
                t.batch_size
                for t, b in zip(event.trials, event.trial_buckets, strict=True)
                if b == bucket and not t.fits
            ]
            assert not failed or size < min(failed), (event.trigger, bucket, size, failed)
    assert model.real_ooms == 0, "no real step ran out of memory"
    batches_per_epoch = len(model.batches) // 3
    assert dict(model.real_calls) == {0: batches_per_epoch, 1: batches_per_epoch, 2: batches_per_epoch}
    assert finder.bucket_sizes[0] * cost <= 2048


# -- the split kept after an OOM applies to the bucket that failed ---------------------------------------------


def test_the_split_kept_after_an_oom_cuts_only_the_failing_buckets_batches() -> None:
    seed(0)
    data = _data()
    model = _CostOracle(data, capacity=2048, long_halved_from=1)
    finder = ScheduledBatchSizeFinder(_oracle_schedule(True), sample_size=tokens, verbose=False, write_report=False)
    bucket_data.trainer([finder], epochs=1).fit(model)
    recoveries = [e for e in finder.history if e.is_recovery]
    assert recoveries and all("bucket 3" in e.note for e in recoveries), [e.note for e in recoveries]
    split = [(indices, calls) for indices, calls in model.calls_per_batch if calls > 1]
    assert split, "the long samples' batches were recovered in micro-batches"
    lengths = [len(data[i]["input_ids"]) for indices, _ in split for i in indices]
    assert min(lengths) > 100, "only batches of the failing (long) bucket are split"
    assert model.real_calls[0] == len(model.calls_per_batch) + sum(calls - 1 for _, calls in split)
    assert sorted(i for indices, _ in model.calls_per_batch for i in indices) == list(range(N))


class _ShortHalved(_CostOracle):
    """From global step 1 the shortest samples' bucket's batches have half the capacity (the budget of a real
    step shrank for them only): they run out of memory and are recovered, the other buckets train as planned."""

    def __init__(self, data: Any, capacity: int, short_top: int) -> None:
        super().__init__(data, capacity)
        self.full, self.short_top = capacity, short_top

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        ids = batch[0]
        short = int((ids > 0).sum(1).max()) <= self.short_top
        self.capacity = self.full // 2 if short and self.trainer.global_step >= 1 else self.full


def test_a_recovered_step_is_reported_at_its_buckets_size_not_the_longest_buckets() -> None:
    """The batch-size attribute holds the longest samples' bucket's size only; an OOM of a shorter bucket's
    batch was reported at that size (``2 -> 2`` for a batch of 76, in the warning, the history and the report)."""
    seed(0)
    data = _data()
    scan = scan_sizes(data, range(len(data)), tokens)
    short_top = plan_buckets(scan.order, scan.sizes, 4).largest[0]
    model = _ShortHalved(data, capacity=2048, short_top=short_top)
    finder = ScheduledBatchSizeFinder(_oracle_schedule(True), sample_size=tokens, verbose=False, write_report=False)
    bucket_data.trainer([finder], epochs=1).fit(model)
    sizes = finder.history[0].bucket_sizes
    assert sizes[0] != sizes[-1], sizes  # the shortest and the longest bucket's sizes differ: the test can tell
    recoveries = [e for e in finder.history if e.is_recovery]
    assert recoveries and all("bucket 0" in e.note for e in recoveries), [e.note for e in recoveries]
    for event in recoveries:
        assert event.batch_size_before == event.batch_size_after == sizes[0], (event, sizes)
        failed = int(event.note.split("on a batch of ")[1].split(";")[0])
        assert 1 < failed <= sizes[0], (failed, sizes)  # the failed batch is the short bucket's (partial or whole)


def test_a_size_that_failed_in_a_real_step_stays_out_of_reach_at_later_milestones() -> None:
    """The heavy sample's batch runs out of memory in a real step (the probes see each bucket's longest
    samples, not its heaviest); the ``oom`` re-search lowers that bucket, and an epoch milestone's full search
    after it must not raise it back to the size that failed (before, it did, and the bucket ran out of memory
    again every other epoch)."""
    seed(0)
    data = _data()
    scan = scan_sizes(data, range(len(data)), tokens)
    plan = plan_buckets(scan.order, scan.sizes, 4)
    heavy, cost = plan.members[0][-1], 2 * plan.largest[1]  # the shortest bucket's shortest sample: never probed
    model = _CostOracle(data, capacity=2048, heavy={heavy: cost})
    schedule = _oracle_schedule(True)
    schedule["triggers"].append({"kind": "epoch", "every": 1})
    schedule["search"]["probe_samples"] = "largest"
    finder = ScheduledBatchSizeFinder(schedule, sample_size=tokens, verbose=False, write_report=False)
    bucket_data.trainer([finder], epochs=5).fit(model)
    failed: dict[int, int] = {}
    bounds: list[int] | None = None
    shown = [(e.trigger, e.epoch, e.bucket_sizes, e.bucket_bounds) for e in finder.history]
    for event in finder.history:
        if event.is_recovery:
            bucket = int(event.note.split("bucket ")[1].split()[0].strip(",;:()"))
            size = int(event.note.split("on a batch of ")[1].split(";")[0])
            failed[bucket] = min(size, failed.get(bucket, size))
            continue
        if bounds is not None and list(event.bucket_bounds) != bounds:
            failed = {}  # cut anew: other buckets
        bounds = list(event.bucket_bounds)
        for bucket, size in failed.items():
            assert event.bucket_sizes[bucket] < size, shown
    assert failed, shown  # a real step ran out of memory
    assert any(e.trigger == "epoch" for e in finder.history), shown


class _TrainedIndices(bucket_data.pl.Callback):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        self.seen: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.setdefault(int(trainer.current_epoch), []).extend(batch[2].tolist())


def _buckets_finder() -> ScheduledBatchSizeFinder:
    return ScheduledBatchSizeFinder(bucket_data.schedule(), sample_size=tokens, verbose=False, write_report=False)


def test_overfit_batches_trains_its_first_batches_with_one_size() -> None:
    """``overfit_batches=3`` trains the same first 3 batches every epoch: the reload after a bucketed search crashed
    (2.x: Lightning cannot inject its sampler into the buckets' batch sampler; 1.9: no ``batch_size``). Buckets
    step aside with a warning, and every epoch trains the same first batches at the size found."""
    seed(0)
    model = BucketModel(IndexedTokens(long_tail_lengths(200)), batch_size=8)
    seen, finder = _TrainedIndices(), _buckets_finder()
    with retune_warnings() as said:
        bucket_data.trainer([seen, finder], epochs=2, overfit_batches=3).fit(model)
    assert finder.bucket_sizes == [] and any("overfit_batches" in m for m in said), said
    size = finder.batch_size
    assert size is not None and seen.seen[0] == seen.seen[1] == list(range(3 * size))


@pytest.mark.parametrize("explicit", [False, True])
def test_a_batch_sampler_that_drops_its_last_batch_is_read_as_dropping(explicit: bool) -> None:
    """``DataLoader(batch_sampler=BatchSampler(sampler, 8, drop_last=True))`` says ``drop_last=False`` itself: the
    buckets trained every sample (207 of 207), where the same loader written ``drop_last=True`` dropped a partial
    batch's samples (206)."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    class Dropping(BucketModel):
        def train_dataloader(self) -> DataLoader[Any]:
            if explicit:
                sampler = BatchSampler(RandomSampler(self.data), 8, drop_last=True)
                return DataLoader(self.data, batch_sampler=sampler, collate_fn=bucket_data.pad_collate)
            return DataLoader(self.data, batch_size=8, shuffle=True, drop_last=True, collate_fn=bucket_data.pad_collate)

    seed(0)
    seen, finder = _TrainedIndices(), _buckets_finder()
    with retune_warnings():
        bucket_data.trainer([seen, finder], epochs=1).fit(Dropping(IndexedTokens(long_tail_lengths(207))))
    assert finder.bucket_sizes and len(seen.seen[0]) < 207 and len(set(seen.seen[0])) == len(seen.seen[0])
