"""The pure logic of ``objective: throughput`` with ``batching: buckets`` (retune/buckets/throughput.py), alone.

The reference bucket, the cap at the fastest padded work per step, how a search's timed trials are
attributed to a bucket, and what a resumed run keeps (``BucketState``).
"""

from __future__ import annotations

import itertools
import random

import pytest

from retune.buckets.sizes import BucketTrial
from retune.buckets.throughput import BucketChoice, bucket_timings, cap_at_fastest, capped_sizes, reference_bucket
from retune.buckets.train_buckets import BucketState
from retune.search.throughput import ThroughputPlan, ThroughputResult, choose_fastest


def test_the_reference_bucket_is_where_most_padded_work_goes() -> None:
    # 300 x 32 = 9600 padded tokens per epoch, against 80 x 64 = 5120 and 20 x 256 = 5120
    assert reference_bucket((32, 64, 256), (300, 80, 20)) == 0
    # a long tail that is not rare: its bucket holds most of the work
    assert reference_bucket((32, 64, 256), (300, 80, 60)) == 2
    # a tie goes to the longer samples (whose memory binds first)
    assert reference_bucket((10, 20), (200, 100)) == 1
    with pytest.raises(ValueError, match="2 buckets but 1 counts"):
        reference_bucket((10, 20), (5,))


def test_capped_sizes_give_every_bucket_the_same_padded_work_within_what_fits() -> None:
    # T* = 1000: bucket sizes 1000 // longest, never above the largest that fits, never below 1
    assert capped_sizes([200, 80, 30, 3], (10, 20, 50, 2000), 1000) == [100, 50, 20, 1]
    # a bucket whose largest fit is below its share of the work keeps it (memory, or its sample count)
    assert capped_sizes([60, 80, 30], (10, 20, 50), 1000) == [60, 50, 20]
    with pytest.raises(ValueError, match="3 sizes but 2 buckets"):
        capped_sizes([1, 2, 3], (1, 2), 10)


def _choice(size: int, largest: int) -> ThroughputResult:
    return ThroughputResult(size=size, largest=largest)


def test_a_curve_that_turned_caps_every_bucket_at_the_reference_work() -> None:
    largest = (14, 23, 32, 246)
    choice = cap_at_fastest([95, 57, 40, 4], largest, 2, _choice(33, 40))
    assert choice == BucketChoice([75, 45, 33, 4], [95, 57, 40, 4], 2, 33, 33 * 32)


def test_a_curve_that_never_turned_below_what_fits_keeps_the_largest_sizes() -> None:
    # the fastest size is the largest that fits: nothing is known about more work per step
    choice = cap_at_fastest([95, 57, 40, 4], (14, 23, 32, 246), 2, _choice(40, 40))
    assert choice.sizes == [95, 57, 40, 4] and choice.padded is None and choice.chosen == 40


def test_a_selection_trial_that_failed_lowers_the_reference_and_longer_buckets() -> None:
    # memory not monotone in the batch size: 36 failed in the reference bucket, so nothing at or above it is
    # kept there or in buckets of longer samples; the fastest is then the largest left (no cap on shorter ones)
    choice = cap_at_fastest([95, 57, 40, 38], (14, 23, 32, 40), 2, _choice(35, 35))
    assert choice.sizes == [95, 57, 35, 35] and choice.padded is None
    # and when the curve turned below the failure, the cap applies as usual
    turned = cap_at_fastest([95, 57, 40, 38], (14, 23, 32, 40), 2, _choice(20, 35))
    assert turned.sizes == [45, 27, 20, 16] and turned.padded == 640


def test_the_cap_keeps_shorter_samples_at_sizes_no_smaller_than_longer_ones() -> None:
    r = random.Random(0)
    for _ in range(500):
        count = r.randint(2, 7)
        longest = sorted(r.sample(range(4, 600), count))
        # largest fits as a search leaves them: non-increasing in the length, but for a bucket's own count
        fits: list[int] = []
        for _ in range(count):
            fits.append(r.randint(1, 600) if not fits else r.randint(1, fits[-1]))
        reference = r.randrange(count)
        chosen = r.randint(1, fits[reference])
        result = cap_at_fastest(fits, longest, reference, _choice(chosen, fits[reference]))
        sizes = result.sizes
        assert all(a >= b for a, b in itertools.pairwise(sizes)), (fits, longest, reference, chosen)
        assert all(1 <= s <= f for s, f in zip(sizes, fits, strict=True))
        assert sizes[reference] == chosen
        if result.padded is not None:
            # no bucket runs more padded work per step than the reference's fastest
            assert all(s * n <= result.padded or s == 1 for s, n in zip(sizes, longest, strict=True))


def test_bucket_timings_take_one_buckets_fitting_timed_trials_in_trial_order() -> None:
    trials = [
        BucketTrial(3, 2, True, 10),
        BucketTrial(0, 64, True, 20),
        BucketTrial(0, 128, False, None),
        BucketTrial(0, 32, True, 5),
        BucketTrial(1, 64, True, 9),
        BucketTrial(0, 64, True, 21),
    ]
    step_times: list[list[float] | None] = [[9.0, 0.1], [9.0, 0.5, 0.6], None, None, [9.0, 0.2], [9.0, 0.7]]
    # the first step of each trial warms up; an untimed trial (None) and a failed one add nothing
    assert bucket_timings(trials, step_times, 0) == {64: [0.5, 0.6, 0.7]}
    assert bucket_timings(trials, step_times, 1) == {64: [0.2]}
    assert bucket_timings(trials, step_times, 2) == {}


def test_the_selection_on_the_reference_bucket_reuses_its_timed_trials() -> None:
    """The black box the bucket path drives: known rates of the reference bucket save trials."""

    def seconds(size: int) -> float:  # 32 padded tokens per sample, fastest at 1024 tokens: size 32
        tokens = size * 32
        return 0.01 + 1e-5 * min(tokens, 1024) + 4e-5 * max(0, tokens - 1024)

    def time_trial(size: int) -> tuple[bool, list[float]]:
        return True, [seconds(size)] * 2

    cold = choose_fastest(ThroughputPlan(cap=120, tolerance=0.03), {}, time_trial)
    known = {s: [seconds(s)] * 2 for s in (16, 64, 120)}
    warm = choose_fastest(ThroughputPlan(cap=120, tolerance=0.03), known, time_trial)
    assert len(warm.trials) < len(cold.trials)
    for result in (cold, warm):
        # within the tolerance of the fastest it timed (the ladder's granularity: within 5% of the true best)
        assert result.rates[result.size] >= 0.97 * max(result.rates.values())
        assert result.size / seconds(result.size) >= 0.95 * max(s / seconds(s) for s in range(1, 121))


def test_bucket_state_round_trips_and_reads_checkpoints_from_before_the_cap() -> None:
    state = BucketState([14, 32, 256], [75, 33, 4], None, 7, [95, 40, 4], 1, 33, 1056)
    again = BucketState.from_dict(state.to_dict())
    assert again == state and again.fit_sizes == [95, 40, 4]
    old = {"bounds": [14, 32, 256], "sizes": [95, 40, 4], "memory": None, "seed": 7}
    read = BucketState.from_dict(old)
    assert read.largest == [] and read.reference is None and read.padded is None
    assert read.fit_sizes == [95, 40, 4]  # a warm search starts from the sizes it trained at
