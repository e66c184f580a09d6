"""``search.batching: buckets`` in real fits (both Lightning lines): memory, data order, re-tunes, no trace.

Every real step is measured independently of retune's probes (``StepPeaks``: ``measure_peak`` around
the step, as ``tests/helpers/varlen.py`` measures ``probe_samples: largest``), and every batch carries its
samples' dataset indices (``tests/helpers/bucket_data.py``).
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from retune import ScheduledBatchSizeFinder
from retune.events import RetuneEvent
from retune.schedule.models import parse_byte_size
from retune.search.policies import accumulation_for
from tests.helpers import bucket_data
from tests.helpers.bucket_data import BucketModel, IndexedTokens, UnfreezeAt, long_tail_lengths, pad_collate, tokens
from tests.helpers.lightning_ns import pl, seed
from tests.helpers.retune_warnings import retune_warnings
from tests.helpers.varlen import StepPeaks

BUDGET = parse_byte_size(bucket_data.BUDGET)
N = 400


def _data() -> IndexedTokens:
    return IndexedTokens(long_tail_lengths(N))


def _finder(**search: Any) -> ScheduledBatchSizeFinder:
    return ScheduledBatchSizeFinder(
        bucket_data.schedule(**search), sample_size=tokens, verbose=False, write_report=False
    )


def _epochs(model: BucketModel, per_epoch: list[int]) -> list[list[list[int]]]:
    out, start = [], 0
    for count in per_epoch:
        out.append(model.batches[start : start + count])
        start += count
    return out


def _fit(epochs: int = 2, frozen: bool = False, unfreeze_at: int | None = None, **search: Any) -> dict[str, Any]:
    seed(0)
    model = BucketModel(_data(), frozen=frozen)
    finder = _finder(**search)
    peaks = StepPeaks()
    per_epoch: list[int] = []

    class Count(pl.Callback):  # type: ignore[misc]
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            per_epoch.append(len(model.batches) - sum(per_epoch))

    extra = [] if unfreeze_at is None else [UnfreezeAt(unfreeze_at)]
    bucket_data.trainer([*extra, peaks, Count(), finder], epochs=epochs).fit(model)
    return {"model": model, "finder": finder, "peaks": peaks, "epochs": _epochs(model, per_epoch)}


@pytest.fixture(scope="module")
def plain_run() -> dict[str, Any]:
    return _fit()


def test_every_real_step_fits_the_budget_and_short_buckets_train_in_larger_batches(plain_run: dict[str, Any]) -> None:
    finder, peaks = plain_run["finder"], plain_run["peaks"]
    assert peaks.peaks and max(peaks.peaks) <= BUDGET, max(peaks.peaks) / BUDGET
    sizes = finder.bucket_sizes
    event = finder.history[0]
    assert event.mode == "buckets" and event.bucket_sizes == sizes and len(sizes) == 4
    counts = event.bucket_samples
    # shorter samples never get a smaller batch, unless the whole bucket is one batch
    assert all(a >= b or a == c for a, b, c in zip(sizes, sizes[1:], counts, strict=False)), (sizes, counts)
    assert min(sizes[:-1]) >= 4 * sizes[-1]
    assert event.batch_size_after == sizes[-1] == finder.batch_size  # the one size that fits every batch
    assert event.samples_per_step >= 3 * sizes[-1]
    # the batches the loop ran are the buckets' sizes (the last batch of a bucket may be partial)
    assert set(peaks.sizes) - set(sizes), "some batches are partial"
    assert max(peaks.sizes) == max(sizes)


def test_each_sample_once_per_epoch_shuffled_and_reproducible(plain_run: dict[str, Any]) -> None:
    epochs = plain_run["epochs"]
    assert len(epochs) == 2
    for batches in epochs:
        seen = Counter(i for b in batches for i in b)
        assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    assert epochs[0] != epochs[1], "a new order every epoch"
    again = _fit()
    assert again["epochs"] == epochs, "the same seed gives the same batches"


def test_re_tuned_after_an_unfreeze_sizes_drop_and_still_fit() -> None:
    run = _fit(epochs=2, frozen=True, unfreeze_at=1)
    finder, peaks = run["finder"], run["peaks"]
    assert [e.trigger for e in finder.history] == ["fit_start", "trainable_params_changed"]
    frozen, unfrozen = finder.history
    assert all(a < b for a, b in zip(unfrozen.bucket_sizes, frozen.bucket_sizes, strict=True))
    assert unfrozen.bucket_sizes_before == frozen.bucket_sizes
    assert len(unfrozen.trials) <= len(unfrozen.bucket_sizes) + 4
    assert max(peaks.peaks) <= BUDGET, max(peaks.peaks) / BUDGET
    assert len(set(unfrozen.trial_buckets)) == len(unfrozen.bucket_sizes), "every bucket verified by a probe"


def test_probes_leave_no_trace() -> None:
    """A run with buckets (two searches: fit start and an epoch milestone) ends with the same weights as a run
    without retune that trains on the same batches."""
    seed(0)
    model = BucketModel(_data())
    sched = bucket_data.schedule()
    sched["triggers"] = [{"kind": "fit_start"}, {"kind": "epoch", "at": [1]}]
    finder = ScheduledBatchSizeFinder(sched, sample_size=tokens, verbose=False, write_report=False)
    bucket_data.trainer([finder], epochs=2).fit(model)
    assert len(finder.history) == 2 and len(finder.history[1].trials) >= 4
    batches = model.batches

    class Replay(BucketModel):
        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(self.data, batch_sampler=batches, collate_fn=pad_collate)

    seed(0)
    replay = Replay(_data())
    no_sampler = {"replace_sampler_ddp": False} if _legacy() else {"use_distributed_sampler": False}
    bucket_data.trainer([], epochs=1, **no_sampler).fit(replay)
    assert replay.batches == batches
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), replay.parameters(), strict=True))


def _legacy() -> bool:
    from tests.helpers.lightning_ns import LEGACY

    return LEGACY


def test_resume_keeps_the_bucket_sizes_without_searching(tmp_path: Path) -> None:
    seed(0)
    model = BucketModel(_data())
    finder = _finder()
    trainer = bucket_data.trainer([finder], epochs=1)
    trainer.fit(model)
    path = tmp_path / "one.ckpt"
    trainer.save_checkpoint(path)
    sizes = finder.bucket_sizes
    seed(0)
    resumed_model = BucketModel(_data())
    resumed = _finder()
    peaks = StepPeaks()
    bucket_data.trainer([peaks, resumed], epochs=2).fit(resumed_model, ckpt_path=str(path))
    assert resumed.bucket_sizes == sizes
    assert len(resumed.history) == 1, "the restored sizes are used; fit_start does not fire again"
    assert max(peaks.sizes) == max(sizes), "the resumed epoch trains bucketed batches"
    assert sorted(i for b in resumed_model.batches for i in b) == list(range(N))


def test_history_round_trips_with_bucket_fields(plain_run: dict[str, Any]) -> None:
    event = plain_run["finder"].history[0]
    assert RetuneEvent.from_dict(event.to_dict()) == event
    state = plain_run["finder"].state_dict()
    assert state["buckets"]["sizes"] == plain_run["finder"].bucket_sizes
    assert len(state["buckets"]["bounds"]) == 4


def test_the_callback_still_pickles_for_ddp_spawn() -> None:
    finder = _finder()
    copy = pickle.loads(pickle.dumps(finder))
    assert copy.bucket_sizes == [] and copy._buckets is not None


# -- apply policies ------------------------------------------------------------------------------


def test_keep_effective_and_lr_scaling_use_the_mean_samples_per_step() -> None:
    run = _fit(epochs=2, frozen=True, unfreeze_at=1)
    frozen_mean = run["finder"].history[0].samples_per_step
    seed(0)
    model = BucketModel(_data(), frozen=True)
    sched = bucket_data.schedule()
    sched["apply"] = {"accumulate": "keep_effective", "lr_scaling": "none"}
    finder = ScheduledBatchSizeFinder(sched, sample_size=tokens, verbose=False, write_report=False)
    trainer = bucket_data.trainer([UnfreezeAt(1), finder], epochs=2)
    trainer.fit(model)
    first, second = finder.history
    assert first.accumulate == 1 and first.samples_per_step == pytest.approx(frozen_mean)
    # the effective batch size is the mean samples per step x accumulation; the first tune sets the target
    plan = accumulation_for(round(first.samples_per_step), round(second.samples_per_step))
    assert second.accumulate == plan.accumulate == trainer.accumulate_grad_batches
    assert second.effective_batch_size == plan.effective


def test_lr_scaling_follows_the_mean_samples_per_step() -> None:
    seed(0)
    model = BucketModel(_data(), frozen=True)
    sched = bucket_data.schedule()
    sched["apply"] = {"lr_scaling": "linear"}
    finder = ScheduledBatchSizeFinder(sched, sample_size=tokens, verbose=False, write_report=False)
    trainer = bucket_data.trainer([UnfreezeAt(1), finder], epochs=2)
    trainer.fit(model)
    first, second = finder.history
    assert first.lr_factor == 1.0
    assert second.lr_factor == pytest.approx(round(second.samples_per_step) / round(first.samples_per_step))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 * second.lr_factor)


# -- fallbacks -------------------------------------------------------------------------------------


class _Stream(IterableDataset[dict[str, Any]]):
    def __init__(self, data: IndexedTokens) -> None:
        self.data = data

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self.data[i] for i in range(len(self.data)))


class _StreamModel(BucketModel):
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_Stream(self.data), batch_size=self.batch_size, collate_fn=pad_collate)


class _OwnBatches(BatchSampler):
    pass


class _OwnSamplerModel(BucketModel):
    def train_dataloader(self) -> DataLoader[Any]:
        sampler = _OwnBatches(SequentialSampler(self.data), self.batch_size, drop_last=False)
        return DataLoader(self.data, batch_sampler=sampler, collate_fn=pad_collate)


@pytest.mark.parametrize(
    ("model_cls", "reason"),
    [
        (_StreamModel, "is an IterableDataset"),
        (_OwnSamplerModel, "its batch_sampler (_OwnBatches) decides which samples go together"),
    ],
)
def test_loaders_that_cannot_be_bucketed_fall_back_to_fixed_with_one_warning(
    model_cls: type[BucketModel], reason: str
) -> None:
    seed(0)
    sched = bucket_data.schedule()
    sched["triggers"] = [{"kind": "fit_start"}, {"kind": "epoch", "at": [1]}]
    finder = ScheduledBatchSizeFinder(sched, sample_size=tokens, verbose=False, write_report=False)
    with retune_warnings() as said:
        bucket_data.trainer([finder], epochs=2, limit_train_batches=2).fit(model_cls(_data(), batch_size=4))
    warnings = [message for message in said if "batching: buckets cannot" in message]
    assert len(warnings) == 1 and reason in warnings[0] and "batching: fixed" in warnings[0], warnings
    assert finder.bucket_sizes == [] and len(finder.history) == 2
    assert all(e.mode != "buckets" and not e.bucket_sizes for e in finder.history)
    assert finder.batch_size is not None


def test_a_stream_with_buckets_warns_that_steps_may_exceed_the_budget_and_what_to_do() -> None:
    seed(0)
    finder = _finder()
    with retune_warnings() as said:
        bucket_data.trainer([finder], epochs=1, limit_train_batches=2).fit(_StreamModel(_data(), batch_size=4))
    warnings = [message for message in said if "IterableDataset" in message]
    assert len(warnings) == 1, said
    for part in ("batching: fixed", "steps may exceed the memory budget", "map-style", "probe_samples: largest", "oom"):
        assert part in warnings[0], (part, warnings[0])


# -- the oom trigger ---------------------------------------------------------------------------------


class _TokenOracle(BucketModel):
    """Runs out of memory like a GPU, with the real error type: a batch fails when ``batch x longest``
    exceeds its capacity. From global step ``drop_at`` on, batches of long samples (> 100 tokens) have half
    the capacity (memory that long sequences need grew), so only the long samples' bucket fails."""

    def __init__(self, data: IndexedTokens, capacity: int, drop_at: int) -> None:
        super().__init__(data)
        self.capacity, self.drop_at = capacity, drop_at
        self.ooms = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        longest = int((ids > 0).sum(1).max())
        capacity = self.capacity
        if longest > 100 and self.trainer.global_step >= self.drop_at:
            capacity //= 2
        if ids.shape[0] * longest > capacity:
            self.ooms += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle: {ids.shape[0]} x {longest} > {capacity})")
        return super().training_step(batch, batch_idx)


def test_oom_lowers_only_the_failing_bucket_after_recovering_the_step() -> None:
    seed(0)
    model = _TokenOracle(_data(), capacity=2048, drop_at=1)
    sched = {
        "triggers": [{"kind": "fit_start"}, {"kind": "oom"}],
        "search": {"batching": "buckets", "buckets": 4, "steps_per_trial": 1, "mode": "binsearch", "margin": 0.0},
    }
    finder = ScheduledBatchSizeFinder(sched, sample_size=tokens, verbose=False, write_report=False)
    bucket_data.trainer([finder], epochs=2).fit(model)
    searches = [e for e in finder.history if not e.is_recovery]
    recoveries = [e for e in finder.history if e.is_recovery]
    assert [e.trigger for e in searches] == ["fit_start", "oom"]
    assert recoveries and all("bucket 3" in e.note for e in recoveries), [e.note for e in recoveries]
    first, second = searches
    assert first.note.startswith("no memory limit to model")  # no budget: each bucket bisected on real OOMs
    assert set(second.trial_buckets) == {3}, "only the failing bucket is probed again"
    assert second.bucket_sizes[:3] == first.bucket_sizes[:3]
    assert second.bucket_sizes[3] < first.bucket_sizes[3]
    assert second.bucket_sizes[3] * first.bucket_bounds[3] <= 1024
    # every sample trained once per epoch, the failed steps included (recovered in micro-batches)
    per_epoch = len(model.batches) // 2
    for batches in (model.batches[:per_epoch], model.batches[per_epoch:]):
        assert sorted(i for b in batches for i in b) == list(range(N))


def test_a_bucket_search_cut_short_by_max_trials_names_the_buckets_in_a_warning_and_the_event() -> None:
    """Found by review: ``max_trials`` that ran out left buckets at a longer bucket's fit (2 samples where 97
    fit) with an empty note. The warning and the event's note name each bucket left open, at its size."""
    with retune_warnings() as said:
        run = _fit(epochs=1, max_trials=3)
    event = run["finder"].history[0]
    assert "search.max_trials (3) ran out before the train search settled (buckets 0 (samples up to" in event.note
    assert any("search.max_trials (3) ran out" in message for message in said), said
    assert max(run["peaks"].peaks) <= BUDGET  # what was applied was measured to fit
