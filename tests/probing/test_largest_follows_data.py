"""One batch size with ``probe_samples: largest`` follows the data: an epoch start whose train samples got longer
than the ones the probes ran on searches again (issue 28, point 4, for ``batching: fixed``).

The size found on the largest samples fits every batch only while they stay the largest: a length curriculum that
raises ``max_len`` on the same dataset object makes them longer with no trigger to notice. Every real step is
measured independently of retune's probes (``tests/helpers/varlen.py``'s ``StepPeaks``: ``measure_peak`` around the
step, the CPU tracker the probes use), against the schedule's budget. The bucket version is
tests/buckets/test_data_changes.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

import pytest
import torch

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
from tests.helpers.lightning_ns import seed
from tests.helpers.varlen import StepPeaks

BUDGET = 5 * 2**20  # bucket_data.BUDGET
N = 300


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _finder(messages: list[str] | None = None) -> ScheduledBatchSizeFinder:
    schedule = {
        "triggers": [{"kind": "fit_start"}],
        "search": {"batching": "fixed", "probe_samples": "largest", "steps_per_trial": 2},
        "memory": {"budget": bucket_data.BUDGET},
    }
    finder = ScheduledBatchSizeFinder(schedule, sample_size=tokens, verbose=messages is not None, write_report=False)
    if messages is not None:
        finder._say = lambda message, warn=False: messages.append(message)  # type: ignore[method-assign]
    return finder


def _over(peaks: StepPeaks) -> list[float]:
    return [p / BUDGET for p in peaks.peaks if p > BUDGET]


def test_an_in_place_length_curriculum_is_searched_again_and_no_step_exceeds_the_budget() -> None:
    seed(0)
    data = Curriculum(long_tail_lengths(N, tail=0.05), max_len=64)
    model = BucketModel(data)
    said: list[str] = []
    finder, peaks = _finder(said), StepPeaks()
    bucket_data.trainer([RaiseMaxLen(data, at=1, to=256), peaks, finder], epochs=3).fit(model)
    over = _over(peaks)
    assert not over, f"{len(over)} steps over the budget, the worst {max(over):.2f}x"
    assert [(e.epoch, e.trigger) for e in finder.history] == [(0, "fit_start"), (1, "data_changed")]
    first, changed = finder.history
    assert changed.batch_size_before == first.batch_size_after
    assert changed.batch_size_after < first.batch_size_after, "the longer texts train in smaller batches"
    assert max(peaks.sizes[-3:]) <= changed.batch_size_after
    assert finder.probe_batches.cache.scans == 2, "scanned at fit start and once after the change"
    longest = max(long_tail_lengths(N, tail=0.05))
    line = f"epoch 1: the train samples' sizes changed (largest sample 64 -> {longest}): searching the batch size again"
    assert line in said, said


def test_an_unchanged_dataset_costs_no_search_only_a_fingerprint_per_epoch() -> None:
    seed(0)
    data = IndexedTokens(long_tail_lengths(N))
    model = BucketModel(data)
    finder = _finder()
    reads = ReadsPerEpoch(data)
    bucket_data.trainer([reads, finder], epochs=4).fit(model)
    cache = finder.probe_batches.cache
    assert len(finder.history) == 1 and cache.scans == 1
    assert cache.checks == 3, "one fingerprint check at each later epoch start"
    extra = [b - a - N for a, b in pairwise(reads.reads)]
    assert all(0 < e <= FINGERPRINT_SAMPLES + FINGERPRINT_LARGEST for e in extra), extra


def test_samples_that_got_shorter_keep_the_size_with_one_line() -> None:
    seed(0)
    data = Curriculum(long_tail_lengths(N, tail=0.05), max_len=256)
    model = BucketModel(data)
    said: list[str] = []
    finder, peaks = _finder(said), StepPeaks()
    bucket_data.trainer([RaiseMaxLen(data, at=1, to=64), peaks, finder], epochs=3).fit(model)
    assert [e.trigger for e in finder.history] == ["fit_start"], "the size found on longer samples still fits"
    kept = [m for m in said if "still fits" in m]
    longest = max(long_tail_lengths(N, tail=0.05))
    size = finder.history[0].batch_size_after
    line = f"epoch 1: the train samples' sizes changed (largest sample {longest} -> 64); batch size {size} still fits"
    assert kept == [line], said
    assert not _over(peaks)


def test_a_rebuilt_longer_dataset_is_searched_again_at_the_epoch_it_arrives() -> None:
    seed(0)
    lengths = long_tail_lengths(N, tail=0.05)

    model = bucket_data.RebuiltCurriculum(lengths, at=2, before=64, after=256)  # a new dataset object every epoch
    finder, peaks = _finder(), StepPeaks()
    bucket_data.trainer([peaks, finder], epochs=3, reload_dataloaders_every_n_epochs=1).fit(model)
    assert [(e.epoch, e.trigger) for e in finder.history] == [(0, "fit_start"), (2, "data_changed")]
    assert finder.probe_batches.cache.scans == 2, "epoch 1's new object has the same fingerprint: not rescanned"
    assert not _over(peaks)
