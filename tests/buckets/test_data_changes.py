"""``batching: buckets`` follows the data: a dataset whose sizes changed is rescanned and its buckets re-searched
(issue 28, point 4), whether it is the same object changed in place or a new one the hook built.

Every real step is measured independently of retune's probes (``tests/helpers/varlen.py``'s ``StepPeaks``:
``measure_peak`` around the step, the CPU tracker the probes use), against the schedule's budget.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

from retune import ScheduledBatchSizeFinder
from retune.probing.sample_sizes import FINGERPRINT_LARGEST, FINGERPRINT_SAMPLES
from tests.helpers import bucket_data
from tests.helpers.bucket_data import (
    BucketModel,
    Curriculum,
    IndexedTokens,
    RaiseMaxLen,
    ReadsPerEpoch,
    long_tail_lengths,
    tokens,
)
from tests.helpers.lightning_ns import pl, seed
from tests.helpers.varlen import StepPeaks

BUDGET = 5 * 2**20  # bucket_data.BUDGET
N = 300


class PerEpoch(pl.Callback):  # type: ignore[misc]
    def __init__(self, model: BucketModel) -> None:
        self.model, self.counts = model, [0]

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.counts.append(len(self.model.batches))

    def epoch(self, epoch: int) -> list[list[int]]:
        return self.model.batches[self.counts[epoch] : self.counts[epoch + 1]]


def _finder() -> ScheduledBatchSizeFinder:
    return ScheduledBatchSizeFinder(bucket_data.schedule(), sample_size=tokens, verbose=False, write_report=False)


def test_an_in_place_length_curriculum_is_rescanned_and_searched_again_within_the_budget() -> None:
    seed(0)
    data = Curriculum(long_tail_lengths(N, tail=0.05), max_len=64)
    model = BucketModel(data)
    finder, peaks, per_epoch = _finder(), StepPeaks(), PerEpoch(model)
    bucket_data.trainer([RaiseMaxLen(data, at=1, to=256), peaks, per_epoch, finder], epochs=3).fit(model)
    over = [p / BUDGET for p in peaks.peaks if p > BUDGET]
    assert not over, f"{len(over)} steps over the budget, the worst {max(over):.2f}x"
    assert [e.trigger for e in finder.history] == ["fit_start", "data_changed"]
    first, changed = finder.history
    assert max(first.bucket_bounds) == 64 and max(changed.bucket_bounds) > 200 and changed.epoch == 1
    assert changed.bucket_sizes[-1] < first.bucket_sizes[-1], "the long texts' bucket trains in smaller batches"
    assert finder.probe_batches.cache.scans == 2, "scanned at fit start and once after the change"
    for epoch in range(3):
        seen = Counter(i for b in per_epoch.epoch(epoch) for i in b)
        assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}


def test_an_unchanged_dataset_is_fingerprinted_once_per_epoch_and_never_rescanned() -> None:
    seed(0)
    data = IndexedTokens(long_tail_lengths(N))
    model = BucketModel(data)
    finder = _finder()
    reads = ReadsPerEpoch(data)
    bucket_data.trainer([reads, finder], epochs=4).fit(model)
    cache = finder.probe_batches.cache
    assert cache.scans == 1 and len(finder.history) == 1
    assert cache.checks == 3, "one fingerprint check at each later epoch start"
    # an epoch after the first reads each sample once to train it, plus the one fingerprint check
    extra = [b - a - N for a, b in pairwise(reads.reads)]
    assert all(0 < e <= FINGERPRINT_SAMPLES + FINGERPRINT_LARGEST for e in extra), extra


def test_a_rebuilt_dataset_with_the_same_samples_is_not_rescanned_and_a_longer_one_is() -> None:
    seed(0)
    lengths = long_tail_lengths(N, tail=0.05)

    model = bucket_data.RebuiltCurriculum(lengths, at=2, before=64, after=256)  # a new dataset object every epoch
    finder, peaks = _finder(), StepPeaks()
    bucket_data.trainer([peaks, finder], epochs=3, reload_dataloaders_every_n_epochs=1).fit(model)
    assert [e.trigger for e in finder.history] == ["fit_start", "data_changed"]
    assert finder.history[1].epoch == 2
    assert finder.probe_batches.cache.scans == 2
    assert max(peaks.peaks) <= BUDGET


def test_samples_that_move_between_buckets_of_searched_sizes_regroup_without_a_search() -> None:
    seed(0)
    data = IndexedTokens(long_tail_lengths(N))
    model = BucketModel(data)
    finder, per_epoch = _finder(), PerEpoch(model)

    class Swap(pl.Callback):  # type: ignore[misc]
        """Two samples the fingerprint reads trade their texts: the same sizes overall, other buckets."""

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.current_epoch == 1:
                rows = data.rows
                longest = max(range(N), key=lambda i: len(rows[i]))  # among the largest the fingerprint reads
                rows[0], rows[longest] = rows[longest], rows[0]  # sample 0: the first strided one

    swap = Swap()
    bucket_data.trainer([swap, per_epoch, finder], epochs=2).fit(model)
    assert len(finder.history) == 1, "the sizes found still fit: no search"
    buckets = finder._buckets.buckets
    assert buckets is not None and 0 in buckets.members[-1], "sample 0 now trains with the longest samples"
    seen = Counter(i for b in per_epoch.epoch(1) for i in b)
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    longest = next(b for b in per_epoch.epoch(1) if 0 in b)
    assert len(longest) <= finder.bucket_sizes[-1]


def test_a_resumed_run_whose_data_outgrew_the_checkpoints_buckets_searches_them_again(tmp_path: Path) -> None:
    seed(0)
    lengths = long_tail_lengths(N, tail=0.05)
    model = BucketModel(Curriculum(lengths, max_len=64))
    finder = _finder()
    trainer = bucket_data.trainer([finder], epochs=1)
    trainer.fit(model)
    path = tmp_path / "end.ckpt"
    trainer.save_checkpoint(path)
    seed(0)
    resumed = BucketModel(Curriculum(lengths, max_len=256))  # the next stage of the curriculum, a new process
    again, peaks = _finder(), StepPeaks()
    bucket_data.trainer([peaks, again], epochs=2).fit(resumed, ckpt_path=str(path))
    assert [(e.epoch, e.trigger) for e in again.history] == [(0, "fit_start"), (1, "data_changed")]
    assert max(again.history[1].bucket_bounds) > 200
    assert max(peaks.peaks) <= BUDGET
