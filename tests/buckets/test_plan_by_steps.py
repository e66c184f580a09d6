"""Bucket bounds cut for the fewest steps (``search.predict: auto``), and the margin on a bucket's capacity.

The padded-work plan (:func:`~retune.buckets.plan.choose_bounds`) counts steps only where batches are large: in
a long tail of one or two samples per batch, whether a bound lets two samples fit halves the steps. With a
traced memory model the batch each bound allows is known, and :func:`~retune.buckets.plan.choose_bounds_for_steps`
minimises the steps themselves (checked against every possible cut on small inputs). In a fit, a predicted
search moves the bounds only when that takes fewer steps, verifies every bucket of the new plan with a real
probe, trains every sample once, keeps the bounds for later searches of the same samples (a checkpoint
carries them), and never runs a real step over the budget.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from retune import ScheduledBatchSizeFinder
from retune.buckets.plan import (
    Buckets,
    assign,
    choose_bounds,
    choose_bounds_for_steps,
    count_batches,
    plan_buckets,
    regroup,
)
from retune.buckets.sizes import search_buckets
from retune.buckets.train_buckets import BucketState
from retune.reports.batch_size import format_summary
from retune.schedule.models import parse_byte_size
from retune.search.largest import SearchPlan, apply_margin
from tests.helpers import bucket_data
from tests.helpers.bucket_data import BucketModel, IndexedTokens, UnfreezeAt, tokens
from tests.helpers.lightning_ns import seed
from tests.helpers.varlen import StepPeaks

BUDGET = parse_byte_size(bucket_data.BUDGET)


def _steps(sizes: list[int], bounds: tuple[int, ...], batch_for: Any, world: int = 1) -> int:
    grouped = assign(sorted(range(len(sizes)), key=lambda i: -sizes[i]), sorted(sizes, reverse=True), bounds)
    return count_batches(grouped, [max(1, batch_for(top)) for top in grouped.largest], world_size=world)


def test_the_long_tail_is_cut_where_two_samples_still_fit() -> None:
    sizes = [20] * 1000 + list(range(400, 520))

    def batch(longest: int) -> int:
        return 1000 // longest

    by_padding, by_steps = choose_bounds(sizes, 3), choose_bounds_for_steps(sizes, 3, batch)
    assert by_steps == (20, 499, 519)
    assert _steps(sizes, by_steps, batch) == 90 < _steps(sizes, by_padding, batch) == 110


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("trial", range(12))
def test_no_cut_takes_fewer_steps_than_the_chosen_one(trial: int, world: int) -> None:
    """Every way to cut a small random distribution into at most ``count`` buckets: none takes fewer steps."""
    r = random.Random(trial)
    sizes = [r.choice([r.randint(4, 40), r.randint(100, 400)]) for _ in range(r.randint(5, 24))]
    count = r.randint(1, 4)
    capacity = r.randint(400, 4000)

    def batch(longest: int) -> int:
        return max(1, capacity // (longest + 5 * longest * longest // 100))

    chosen = choose_bounds_for_steps(sizes, count, batch, world)
    assert 1 <= len(chosen) <= count and chosen[-1] == max(sizes)
    levels = sorted(set(sizes))
    best = min(
        _steps(sizes, (*cut, levels[-1]), batch, world)
        for k in range(count)
        for cut in itertools.combinations(levels[:-1], k)
    )
    assert _steps(sizes, chosen, batch, world) == best


def test_degenerate_inputs() -> None:
    assert choose_bounds_for_steps([], 3, lambda s: 1) == ()
    assert choose_bounds_for_steps([7, 7, 7], 4, lambda s: 2) == (7,)
    assert choose_bounds_for_steps([5, 9, 300], 1, lambda s: 2) == (300,)
    with pytest.raises(ValueError, match="count must be >= 1"):
        choose_bounds_for_steps([5], 0, lambda s: 1)


def test_regroup_cuts_the_same_samples_as_a_fresh_plan() -> None:
    r = random.Random(3)
    sizes = [r.randint(1, 600) for _ in range(200)]
    order = sorted(range(200), key=lambda i: (-sizes[i], i))
    ordered = [sizes[i] for i in order]
    planned = plan_buckets(order, ordered, 4)
    again = regroup(planned, (50, 100, 600))
    fresh = assign(order, ordered, (50, 100, 600))
    assert again == fresh and again.sizes == fresh.sizes
    assert sorted(i for m in again.members for i in m) == list(range(200))
    with pytest.raises(ValueError, match="do not know their samples' sizes"):
        regroup(Buckets((10,), ((0, 1),), (10,)), (5, 10))


def test_the_margin_cuts_the_capacity_not_its_floor() -> None:
    """One bucket whose memory reaches the limit at 2.7 samples: a 5% margin keeps 2 (``int(2.7 x 0.95)``), not
    ``int(2 x 0.95) = 1``; the search stops once its probe fit the size the margin leaves."""

    def measure(bucket: int, size: int) -> tuple[bool, int | None]:
        peak = 100 + size * 1000
        return peak <= 2800, peak

    result = search_buckets((512,), (10,), measure, 2800, start=1, max_trials=10, tolerance=0.05)
    plan = SearchPlan("binsearch", start=1, max_trials=10, margin=0.05, upper=10)
    assert result.found == [2] and result.capacity[0] == pytest.approx(2.7)
    assert apply_margin(plan, 2, True, result.capacity[0]) == 2
    assert apply_margin(plan, 2, True) == 1, "without the capacity: the floor cut twice"
    # never above the size a probe fit, and not cut at a cap
    assert apply_margin(plan, 2, True, 50.0) == 2 and apply_margin(plan, 10, False, 12.0) == 10


# -- in a fit ------------------------------------------------------------------------------------------------


def _lengths(n: int = 400) -> list[int]:
    """Short texts and a 5% tail of 600-1,200 tokens, which trains one or two to a batch: where the tail is cut
    decides how many of its samples go two at a time."""
    return bucket_data.long_tail_lengths(n, **bucket_data.LONG_TAIL_BY_STEPS)  # type: ignore[arg-type]


def _fit(predict: str) -> dict[str, Any]:
    seed(0)
    model = BucketModel(IndexedTokens(_lengths()), frozen=True)
    finder = ScheduledBatchSizeFinder(
        bucket_data.schedule(predict=predict, buckets=3), sample_size=tokens, verbose=False, write_report=False
    )
    peaks = StepPeaks()
    per_epoch: list[int] = []

    class Count(bucket_data.pl.Callback):  # type: ignore[misc,name-defined]
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            per_epoch.append(len(model.batches) - sum(per_epoch))

    bucket_data.trainer([UnfreezeAt(1), peaks, Count(), finder], epochs=2).fit(model)
    return {"model": model, "finder": finder, "peaks": peaks, "per_epoch": per_epoch}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    return {predict: _fit(predict) for predict in ("off", "auto")}


def test_a_predicted_search_moves_the_bounds_only_to_take_fewer_steps(runs: dict[str, dict[str, Any]]) -> None:
    off, auto = runs["off"], runs["auto"]
    history = auto["finder"].history
    assert [e.prediction for e in history] == ["predicted", "predicted"]
    moved = [e for e, o in zip(history, off["finder"].history, strict=True) if e.bucket_bounds != o.bucket_bounds]
    assert moved, "the tail is cut elsewhere once the traced memory says where two samples fit"
    assert len(auto["model"].batches) < len(off["model"].batches), "fewer real steps over the fit"
    state = auto["finder"]._buckets.state
    assert state.by_steps and state.bounds == history[-1].bucket_bounds
    assert BucketState.from_dict(state.to_dict()).by_steps, "a checkpoint carries the bounds' origin"
    assert not BucketState.from_dict({k: v for k, v in state.to_dict().items() if k != "by_steps"}).by_steps


def test_a_search_that_regroups_reports_the_sizes_and_bounds_in_force_before_it(
    runs: dict[str, dict[str, Any]],
) -> None:
    """Where a search groups the samples anew, its event's sizes before are the buckets' then in force, with
    their bounds; the summary said the longest bucket's size alone (``16 -> 78/52/8``)."""
    first, second = runs["auto"]["finder"].history
    assert second.bucket_bounds != first.bucket_bounds  # this re-tune regrouped the samples
    assert second.bucket_sizes_before == first.bucket_sizes
    assert second.bucket_bounds_before == first.bucket_bounds
    line = format_summary(second)
    before = "/".join(map(str, first.bucket_sizes)) + " (samples up to " + "/".join(map(str, first.bucket_bounds))
    assert before + ") -> " + "/".join(map(str, second.bucket_sizes)) in line, line
    assert first.bucket_bounds_before == [] and runs["off"]["finder"].history[1].bucket_bounds_before == []


def test_every_bucket_of_a_new_plan_is_verified_and_every_step_fits(runs: dict[str, dict[str, Any]]) -> None:
    auto = runs["auto"]
    assert max(auto["peaks"].peaks) <= BUDGET, max(auto["peaks"].peaks) / BUDGET
    for event in auto["finder"].history:
        assert bucket_data.unverified_buckets(event) == [], (event.bucket_sizes, event.trials)


def test_each_sample_trains_once_per_epoch_under_the_new_bounds(runs: dict[str, dict[str, Any]]) -> None:
    model, per_epoch = runs["auto"]["model"], runs["auto"]["per_epoch"]
    start = 0
    for count in per_epoch:
        epoch = model.batches[start : start + count]
        start += count
        assert sorted(i for batch in epoch for i in batch) == list(range(len(_lengths())))


def test_later_searches_of_the_same_samples_keep_the_bounds_in_force(runs: dict[str, dict[str, Any]]) -> None:
    """What the next search (an ``oom`` re-search keyed by bucket, a fallback) groups: the bounds in force, not
    the padded-work plan, while the samples are the ones they were cut for."""
    finder = runs["auto"]["finder"]
    buckets = finder._buckets
    loader = runs["auto"]["model"].train_dataloader()
    grouped = buckets.prepare(loader, lambda message: None)
    assert grouped is not None and list(grouped.bounds) == buckets.state.bounds
    assert tuple(grouped.bounds) != choose_bounds([tokens(sample) for sample in loader.dataset], 3)


def test_samples_that_got_shorter_keep_the_bounds_in_force_without_a_search() -> None:
    """A length curriculum that shortens the samples (the tail cut at 900 tokens from epoch 1) under bounds cut by
    steps: the samples are regrouped at the bounds in force, every bucket's samples got no longer, so nothing is
    searched again (the padded-work plan of the new sizes would have other bounds, and a search)."""
    seed(0)
    data = bucket_data.Curriculum(_lengths(), max_len=1200)
    model = BucketModel(data)
    finder = ScheduledBatchSizeFinder(
        bucket_data.schedule(predict="auto", buckets=3), sample_size=tokens, verbose=False, write_report=False
    )
    peaks = StepPeaks()
    first: list[int] = []

    class Count(bucket_data.pl.Callback):  # type: ignore[misc,name-defined]
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            first.append(len(model.batches))

    bucket_data.trainer([bucket_data.RaiseMaxLen(data, at=1, to=900), peaks, Count(), finder], epochs=2).fit(model)
    assert finder._buckets is not None and finder._buckets.state.by_steps
    assert [e.trigger for e in finder.history] == ["fit_start"], [e.trigger for e in finder.history]
    assert max(peaks.peaks) <= BUDGET
    assert sorted(i for batch in model.batches[first[0] :] for i in batch) == list(range(len(_lengths())))
    assert max(len(data[i]["input_ids"]) for batch in model.batches[first[0] :] for i in batch) == 900


def test_throughput_caps_the_buckets_of_a_new_plan() -> None:
    """``objective: throughput`` after a predicted search moved the bounds: the selection times the new plan's
    reference bucket (no start from the old plan's choice), every size is at most what fits, every sample
    trains once per epoch, every step within the budget. (Real clock: the choice varies, these do not.)"""
    seed(0)
    model = BucketModel(IndexedTokens(_lengths()), frozen=True)
    finder = ScheduledBatchSizeFinder(
        bucket_data.schedule(predict="auto", buckets=3, objective="throughput"),
        sample_size=tokens,
        verbose=False,
        write_report=False,
    )
    peaks = StepPeaks()
    bucket_data.trainer([UnfreezeAt(1), peaks, finder], epochs=2).fit(model)
    assert finder._buckets is not None and finder._buckets.state.by_steps
    for event in finder.history:
        assert event.prediction == "predicted" and event.objective == "throughput"
        assert all(s <= f for s, f in zip(event.bucket_sizes, event.bucket_largest, strict=True))
        assert event.reference_bucket is not None and event.reference_bucket < len(event.bucket_bounds)
        assert bucket_data.unverified_buckets(event) == []
    assert max(peaks.peaks) <= BUDGET
    assert sorted(i for batch in model.batches for i in batch) == sorted(list(range(len(_lengths()))) * 2)
