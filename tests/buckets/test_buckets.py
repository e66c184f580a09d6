"""Length buckets, pure logic (retune.buckets.plan, retune.buckets.sizes): no Lightning, no training."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from retune.buckets.plan import (
    Buckets,
    assign,
    choose_bounds,
    count_batches,
    epoch_batches,
    mean_batch,
    plan_buckets,
)
from retune.buckets.sizes import BucketMemory, SizeModel, fit_model, search_buckets
from retune.search.largest import SearchPlan, apply_margin


def _long_tail(n: int = 2000, seed: int = 0) -> list[int]:
    r = random.Random(seed)
    return [r.randint(16, 64) if r.random() < 0.98 else r.randint(400, 512) for _ in range(n)]


def _plan(sizes: list[int], count: int) -> Buckets:
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    return plan_buckets(order, [sizes[i] for i in order], count)


# -- boundaries ------------------------------------------------------------------------------------


def test_bounds_separate_the_long_tail_and_minimise_padded_work() -> None:
    sizes = _long_tail()
    bounds = choose_bounds(sizes, 4)
    assert len(bounds) == 4 and bounds[-1] == max(sizes)
    assert bounds[-2] <= 64, "the long tail gets a bucket of its own"

    def work(bs: tuple[int, ...]) -> int:
        return sum(next(b for b in bs if s <= b) for s in sizes)

    # no other choice of 4 bounds among the sizes does less padded work (random alternatives)
    r = random.Random(1)
    distinct = sorted(set(sizes))
    best = work(bounds)
    for _ in range(300):
        other = (*sorted(r.sample(distinct[:-1], 3)), distinct[-1])
        assert work(other) >= best


def test_bounds_never_make_empty_buckets() -> None:
    assert choose_bounds([5, 5, 9], 8) == (5, 9)
    assert choose_bounds([], 3) == ()
    with pytest.raises(ValueError):
        choose_bounds([1], 0)


def test_many_distinct_sizes_are_merged_into_levels_quickly() -> None:
    r = random.Random(0)
    sizes = [r.randint(1, 10**6) for _ in range(50_000)]
    bounds = choose_bounds(sizes, 6)
    assert len(bounds) == 6 and bounds[-1] == max(sizes)


def test_buckets_hold_every_sample_once_largest_first() -> None:
    sizes = _long_tail(500)
    plan = _plan(sizes, 5)
    members = [i for m in plan.members for i in m]
    assert sorted(members) == list(range(500))
    for bucket, m in enumerate(plan.members):
        assert [sizes[i] for i in m] == sorted((sizes[i] for i in m), reverse=True)
        assert max(sizes[i] for i in m) == plan.largest[bucket] <= plan.bounds[bucket]
    assert list(plan.largest) == sorted(plan.largest)
    assert plan.worst(plan.count - 1, 3) == list(plan.members[-1][:3])


def test_assign_with_saved_bounds_is_stable() -> None:
    sizes = _long_tail(300)
    plan = _plan(sizes, 4)
    order = sorted(range(300), key=lambda i: (-sizes[i], i))
    again = assign(order, [sizes[i] for i in order], plan.bounds)
    assert again == plan


# -- batches of an epoch ------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_per_epoch_each_bucket_at_its_size(drop_last: bool) -> None:
    sizes = _long_tail(1000)
    plan = _plan(sizes, 4)
    batch_sizes = [40, 30, 20, 3]
    batches = epoch_batches(plan, batch_sizes, seed=3, epoch=0, drop_last=drop_last)
    seen = Counter(i for b in batches for i in b.indices)
    assert all(count == 1 for count in seen.values())
    if not drop_last:
        assert sorted(seen) == list(range(1000))
    else:  # a bucket's partial batch moves up to longer samples: only the longest samples' bucket drops one
        assert 1000 - len(seen) < batch_sizes[-1]
    for b in batches:
        if drop_last:  # its own samples, or shorter ones moved up (a size that fits longer samples fits them)
            assert all(sizes[i] <= plan.largest[b.bucket] for i in b.indices)
            assert len(b.indices) == batch_sizes[b.bucket]
        else:
            assert set(b.indices) <= set(plan.members[b.bucket])
            assert len(b.indices) <= batch_sizes[b.bucket]
    assert len(batches) == count_batches(plan, batch_sizes, drop_last)


def test_shuffled_across_buckets_reproducible_and_new_every_epoch() -> None:
    plan = _plan(_long_tail(800), 4)
    sizes = [30, 20, 10, 2]
    first = epoch_batches(plan, sizes, seed=7, epoch=0)
    assert first == epoch_batches(plan, sizes, seed=7, epoch=0)
    assert first != epoch_batches(plan, sizes, seed=7, epoch=1)
    assert first != epoch_batches(plan, sizes, seed=8, epoch=0)
    # batches of different buckets are interleaved, not one bucket after another
    buckets = [b.bucket for b in first]
    switches = sum(1 for a, b in itertools.pairwise(buckets) if a != b)
    assert switches > plan.count * 3


def test_without_shuffle_samples_keep_dataset_order() -> None:
    plan = _plan(_long_tail(300), 3)
    batches = epoch_batches(plan, [50, 50, 5], seed=0, epoch=0, shuffle=False)
    assert batches == epoch_batches(plan, [50, 50, 5], seed=0, epoch=5, shuffle=False)
    for b in batches:
        assert list(b.indices) == sorted(b.indices)
    firsts = [min(b.indices) for b in batches]
    assert firsts == sorted(firsts)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_same_number_of_batches_same_bucket_every_sample_across_ranks(world: int, drop_last: bool) -> None:
    sizes = _long_tail(1001)
    plan = _plan(sizes, 4)
    batch_sizes = [17, 11, 7, 2]
    per_rank = [
        epoch_batches(plan, batch_sizes, seed=1, epoch=2, drop_last=drop_last, world_size=world, rank=r)
        for r in range(world)
    ]
    assert len({len(p) for p in per_rank}) == 1
    assert len(per_rank[0]) == count_batches(plan, batch_sizes, drop_last, world)
    for step in range(len(per_rank[0])):
        assert len({p[step].bucket for p in per_rank}) == 1, "every rank trains the same bucket at a step"
        assert all(p[step].indices for p in per_rank), "no rank gets an empty batch"
    seen = Counter(i for p in per_rank for b in p for i in b.indices)
    if drop_last:
        assert all(c == 1 for c in seen.values())
    else:
        assert set(seen) == set(range(1001)), "every sample trains once per epoch across ranks"
        padding = sum(c - 1 for c in seen.values())
        assert padding < world * plan.count, "only each bucket's last round is padded"


def test_mean_batch_is_samples_per_step() -> None:
    plan = _plan(_long_tail(1000), 4)
    sizes = [40, 30, 20, 3]
    batches = epoch_batches(plan, sizes, seed=0, epoch=0)
    assert mean_batch(plan, sizes) == pytest.approx(sum(len(b.indices) for b in batches) / len(batches))


def test_invalid_batch_plans_are_refused() -> None:
    plan = _plan([5, 6, 7, 50], 2)
    with pytest.raises(ValueError, match="batch sizes"):
        epoch_batches(plan, [1], seed=0, epoch=0)
    with pytest.raises(ValueError, match=">= 1"):
        epoch_batches(plan, [0, 1], seed=0, epoch=0)
    with pytest.raises(ValueError, match="rank"):
        epoch_batches(plan, [1, 1], seed=0, epoch=0, world_size=2, rank=2)


# -- the per-bucket search -------------------------------------------------------------------------

LENGTHS = (25, 35, 44, 54, 64, 512)
LIMIT = 48 * 2**20


def _memory(fixed: float, per_sample: float, per_token: float, per_token2: float = 0.0):  # type: ignore[no-untyped-def]
    """A device: peak = fixed + batch x (per_sample + per_token x longest + per_token2 x longest^2)."""

    def measure(bucket: int, size: int) -> tuple[bool, int | None]:
        s = LENGTHS[bucket]
        peak = int(fixed + size * (per_sample + per_token * s + per_token2 * s * s))
        return peak <= LIMIT, peak

    return measure


def _truth(measure) -> list[int]:  # type: ignore[no-untyped-def]
    return [max(b for b in range(1, 5000) if measure(i, b)[0]) for i in range(len(LENGTHS))]


@pytest.mark.parametrize("quadratic", [0.0, 30.0], ids=["linear", "attention-like"])
def test_exact_sizes_and_a_retune_after_an_unfreeze_in_at_most_buckets_plus_4_trials(quadratic: float) -> None:
    frozen = _memory(20e6, 2000, 3000, quadratic)
    cold = search_buckets(LENGTHS, (4096,) * 6, frozen, LIMIT, start=2, max_trials=25)
    assert cold.found == _truth(frozen)
    assert all(t.fits is (t.peak is not None and t.peak <= LIMIT) for t in cold.trials)
    unfrozen = _memory(30e6, 3000, 4500, quadratic * 1.5)  # gradients, optimizer state, stored activations
    retune = search_buckets(
        LENGTHS,
        (4096,) * 6,
        unfrozen,
        LIMIT,
        start=2,
        max_trials=25,
        previous=cold.found,
        direction="down",
        prior=cold.memory,
    )
    assert retune.found == _truth(unfrozen)
    assert all(a < b for a, b in zip(retune.found, cold.found, strict=True))  # type: ignore[operator]
    assert len(retune.trials) <= len(LENGTHS) + 4
    same = search_buckets(
        LENGTHS, (4096,) * 6, unfrozen, LIMIT, start=2, max_trials=25, previous=retune.found, prior=retune.memory
    )
    assert same.found == retune.found and len(same.trials) <= len(LENGTHS) + 1
    refrozen = _memory(15e6, 2000, 3000, quadratic)
    up = search_buckets(
        LENGTHS,
        (4096,) * 6,
        refrozen,
        LIMIT,
        start=2,
        max_trials=25,
        previous=same.found,
        direction="up",
        prior=same.memory,
    )
    assert up.found == _truth(refrozen) and len(up.trials) <= len(LENGTHS) + 4


def test_every_accepted_size_was_probed_and_fit_and_shorter_buckets_never_get_less() -> None:
    measure = _memory(20e6, 2000, 3000, 30.0)
    result = search_buckets(LENGTHS, (4096,) * 6, measure, LIMIT, start=2, max_trials=25)
    fits = {(t.bucket, t.batch_size) for t in result.trials if t.fits}
    for bucket, size in enumerate(result.found):
        assert (bucket, size) in fits
    assert result.found == sorted(result.found, reverse=True)  # type: ignore[type-var]


def test_nothing_fits_the_longest_bucket() -> None:
    huge = _memory(20e6, 2000, 3000, 300.0)  # one 512-token sample needs more than the limit
    result = search_buckets(LENGTHS, (4096,) * 6, huge, LIMIT, start=2, max_trials=25)
    assert result.found[-1] is None and all(s is not None for s in result.found[:-1])


def test_an_out_of_memory_step_re_searches_only_its_bucket() -> None:
    measure = _memory(20e6, 2000, 3000)
    cold = search_buckets(LENGTHS, (4096,) * 6, measure, LIMIT, start=2, max_trials=25)
    truth = cold.found
    assert truth[2] is not None
    failed = truth[2]  # the real step of bucket 2 ran out of memory at its size
    after = search_buckets(
        LENGTHS,
        (4096,) * 6,
        _memory(21e6, 2000, 3000),
        LIMIT,
        start=2,
        max_trials=25,
        previous=truth,
        direction="down",
        prior=cold.memory,
        known_fail={2: failed},
        known_fit={2: failed // 2},
        only=[2],
    )
    assert {t.bucket for t in after.trials} == {2}
    assert after.found[2] is not None and after.found[2] < failed
    assert [s for b, s in enumerate(after.found) if b != 2] == [s for b, s in enumerate(truth) if b != 2]


def test_real_out_of_memory_errors_without_peaks_still_converge() -> None:
    def measure(bucket: int, size: int) -> tuple[bool, int | None]:
        ok, peak = _memory(20e6, 2000, 3000)(bucket, size)
        return ok, (peak if ok else None)  # a real OOM leaves no peak

    result = search_buckets(LENGTHS, (4096,) * 6, measure, LIMIT, start=2, max_trials=60)
    assert result.found == _truth(_memory(20e6, 2000, 3000))


def test_without_a_limit_each_bucket_is_bisected_from_the_longer_ones() -> None:
    def measure(bucket: int, size: int) -> tuple[bool, int | None]:
        return size * LENGTHS[bucket] <= 4000, None

    result = search_buckets(LENGTHS, (4096,) * 6, measure, None, start=2, max_trials=200)
    assert result.found == [4000 // s for s in LENGTHS]
    assert result.memory is None


def test_max_trials_bounds_the_whole_search_and_unprobed_buckets_inherit_a_known_fit() -> None:
    measure = _memory(20e6, 2000, 3000)
    result = search_buckets(LENGTHS, (4096,) * 6, measure, LIMIT, start=2, max_trials=4)
    assert len(result.trials) == 4
    assert all(s is not None for s in result.found)
    longest_fit = result.found[-1]
    assert longest_fit is not None and all(s is not None and s >= longest_fit for s in result.found)


def test_model_fit_and_memory_round_trip() -> None:
    points = [(4, 100, 1000 + 4 * (10 + 2 * 100)), (8, 100, 1000 + 8 * 210), (16, 20, 1000 + 16 * 50)]
    model = fit_model(points)
    assert model is not None
    assert model.fixed == pytest.approx(1000) and model.per_sample == pytest.approx(10)
    assert model.per_unit == pytest.approx(2)
    assert model.largest_within(1000 + 50 * 210, 100, 10_000) == 50
    assert SizeModel.from_list(model.to_list()) == model
    memory = BucketMemory(1.0, (2.0, None), model)
    assert BucketMemory.from_dict(memory.to_dict()) == memory


def test_a_bert_like_retune_with_capped_buckets_within_buckets_plus_4_trials_at_the_margin() -> None:
    """Attention-like memory with the short buckets capped by their sample counts; after the unfreeze the
    per-sample memory grows more for short samples than for long ones, so the last search's ratios mislead
    and the change is interpolated over the length. With the tolerance of a 5% margin, the size each bucket
    trains at (the margin cuts the line's capacity, never above the probed fit) is at least the margin's cut of
    the largest size that fits, in at most buckets + 4 trials."""
    lengths, uppers = (25, 37, 47, 56, 64, 493), (142, 144, 200, 200, 200, 10)

    def device(fixed: float, c0: float, c1: float, c2: float):  # type: ignore[no-untyped-def]
        def measure(bucket: int, size: int) -> tuple[bool, int | None]:
            s = lengths[bucket]
            peak = int(fixed + size * (c0 + c1 * s + c2 * s * s))
            return peak <= LIMIT, peak

        return measure

    frozen, unfrozen = device(2e6, 20_000, 1500, 30), device(3e6, 60_000, 6000, 60)
    cold = search_buckets(lengths, uppers, frozen, LIMIT, start=2, max_trials=25, tolerance=0.05)
    retune = search_buckets(
        lengths,
        uppers,
        unfrozen,
        LIMIT,
        start=2,
        max_trials=25,
        previous=cold.found,
        direction="down",
        prior=cold.memory,
        tolerance=0.05,
    )
    assert len(retune.trials) <= len(lengths) + 4
    for bucket, size in enumerate(retune.found):
        best = max(b for b in range(1, uppers[bucket] + 1) if unfrozen(bucket, b)[0])
        assert size is not None and size <= best
        plan = SearchPlan("binsearch", start=2, max_trials=25, margin=0.05, upper=max(uppers))
        used = apply_margin(plan, size, size < uppers[bucket], retune.capacity[bucket])
        assert used <= size
        assert used >= max(1, int(best * 0.95)), (bucket, size, used, best)


def test_a_size_the_margin_would_cut_back_to_the_probed_fit_is_not_probed() -> None:
    """``peak = 10 + 45 x size`` within 100: 2 fits (exactly at the limit) and the 5% margin cuts it to 1, the size a
    probe already showed to fit; so that probe is skipped and the size used is the same (issue 29: a long-tail
    bucket at batch 1-2). Without a margin the search probes 2 and uses it."""

    def measure(bucket: int, size: int) -> tuple[bool, int | None]:
        peak = 10 + 45 * size
        return peak <= 100, peak

    def used(found: int | None, margin: float) -> int | None:
        return None if found is None else max(1, int(found * (1 - margin))) if found < 10 else found

    with_margin = search_buckets((500,), (10,), measure, 100, start=1, max_trials=10, tolerance=0.05)
    without = search_buckets((500,), (10,), measure, 100, start=1, max_trials=10, tolerance=0.0)
    assert [t.batch_size for t in without.trials] == [1, 4, 2] and without.found == [2]
    assert [t.batch_size for t in with_margin.trials] == [1, 4]
    assert used(with_margin.found[0], 0.05) == used(without.found[0], 0.05) == 1
