"""The range test's pure logic (retune.lr.range_test): sweep, smoothing, divergence, suggestion, group selection."""

from __future__ import annotations

import itertools
import math

import pytest

from retune.lr.range_test import GroupInfo, RangeTest, diverged, new_groups, select_groups, smooth, suggest, sweep_lrs


def test_exponential_sweep_is_even_in_log_and_hits_both_ends() -> None:
    lrs = sweep_lrs(1e-6, 1.0, 7, "exponential")
    assert lrs[0] == 1e-6 and lrs[-1] == 1.0
    ratios = [b / a for a, b in itertools.pairwise(lrs)]
    assert all(r == pytest.approx(10.0) for r in ratios)


def test_linear_sweep() -> None:
    assert sweep_lrs(0.1, 0.5, 5, "linear") == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1e-3, 1e-4, 10, "exponential"), "greater than"),
        ((0.0, 1.0, 10, "exponential"), "min_lr > 0"),
        ((1e-3, 1.0, 1, "linear"), "at least 2"),
    ],
)
def test_sweep_refuses_bad_ranges(args: tuple, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        sweep_lrs(*args)


def test_smoothing_is_bias_corrected_ema() -> None:
    assert smooth([3.0, 3.0, 3.0], 0.9) == pytest.approx([3.0, 3.0, 3.0])  # no pull towards 0 at the start
    assert smooth([1.0, 2.0], 0.0) == [1.0, 2.0]
    out = smooth([1.0, 3.0], 0.5)
    assert out[1] == pytest.approx((0.5 * 0.5 * 1.0 + 0.5 * 3.0) / (1 - 0.25))
    assert math.isnan(smooth([1.0, math.nan, 1.0], 0.9)[2])


def test_divergence_rule() -> None:
    assert diverged(5.0, 1.0, 4.0)
    assert not diverged(3.9, 1.0, 4.0)
    assert not diverged(100.0, 1.0, None)
    assert diverged(math.inf, 1.0, None) and diverged(math.nan, 1.0, 4.0)
    assert not diverged(5.0, -1.0, 4.0)  # a negative best loss gives no bound


def test_range_test_stops_on_divergence_but_not_in_its_first_steps() -> None:
    test = RangeTest([1e-3 * 2**i for i in range(10)], beta=0.0, threshold=4.0)
    assert not test.record(1.0)
    assert not test.record(10.0)  # step 1: too early to call divergence
    assert not test.record(0.5)
    assert test.record(2.5)  # 2.5 > 4 x 0.5
    assert test.stopped_early and test.steps_run == 4 and test.tested_lrs == test.lrs[:4]


def test_noise_near_a_low_loss_is_not_divergence() -> None:
    """Mid-run the loss sits near its floor and batches differ several-fold: only a rise above where the
    test started stops it, not 4x the lowest (noisy) value."""
    noisy = [0.08, 0.03, 0.05, 0.01, 0.09, 0.02, 0.12, 0.03] * 3
    test = RangeTest([1e-7] * len(noisy) + [1.0, 1.0], beta=0.0, threshold=4.0)
    assert not any(test.record(v) for v in noisy)
    assert test.record(1.0)  # 1.0 > 4 x 0.05, the level at the start


def test_range_test_runs_to_the_end_and_a_nan_always_stops() -> None:
    test = RangeTest([0.1, 0.2, 0.3], beta=0.0, threshold=None)
    assert [test.record(v) for v in (3.0, 2.0, 1.0)] == [False, False, True]
    assert not test.stopped_early
    nan = RangeTest([0.1, 0.2, 0.3], beta=0.5)
    assert nan.record(math.nan) and nan.stopped_early


def _curve() -> tuple[list[float], list[float]]:
    """Flat, then falling between 1e-3 and 1e-1, then rising: a textbook range test in log space."""
    lrs = sweep_lrs(1e-6, 10.0, 71, "exponential")
    losses = []
    for lr in lrs:
        x = math.log10(lr)
        losses.append(2.0 if x < -3 else 2.0 - (x + 3) if x < -1 else (0.0 + 4 * (x + 1) ** 2))
    return lrs, losses


def test_suggestions_land_in_the_falling_part() -> None:
    lrs, losses = _curve()
    valley = suggest(lrs, losses, "valley", skip_begin=0, skip_end=0)
    steepest = suggest(lrs, losses, "steepest", skip_begin=0, skip_end=0)
    minimum = suggest(lrs, losses, "min_div10", skip_begin=0, skip_end=0)
    assert valley is not None and steepest is not None and minimum is not None
    assert 1e-3 <= valley.lr <= 1e-1
    assert 1e-3 <= steepest.lr <= 1e-1
    assert minimum.lr == pytest.approx(lrs[minimum.index] / 10) and lrs[minimum.index] == pytest.approx(0.1)


def test_steepest_in_log_space_is_not_fooled_by_noise_among_crowded_small_rates() -> None:
    """Lightning differentiates in lr itself: a tiny wobble between two nearly equal small rates wins."""
    lrs, losses = _curve()
    losses[5] -= 1e-3  # noise on the flat part
    in_log = suggest(lrs, losses, "steepest", skip_begin=0, skip_end=0, log_scale=True)
    in_lr = suggest(lrs, losses, "steepest", skip_begin=0, skip_end=0, log_scale=False)
    assert in_log is not None and in_lr is not None
    assert in_lr.lr < 1e-5  # Lightning's reading: the noise
    assert 1e-3 <= in_log.lr <= 1e-1


def test_suggestion_skips_and_drops_non_finite_points() -> None:
    lrs, losses = _curve()
    losses[-1] = math.nan
    assert suggest(lrs, losses, "valley") is not None
    assert suggest(lrs[:5], losses[:5], "valley", skip_begin=3, skip_end=1) is None  # one point left
    with pytest.raises(ValueError, match="unknown suggestion"):
        suggest(lrs, losses, "magic")  # type: ignore[arg-type]


def _group(params: str, trainable: str) -> GroupInfo:
    return GroupInfo(frozenset(params.split()), frozenset(trainable.split()))


def test_new_groups_are_added_or_unfrozen() -> None:
    before = [_group("h.w h.b", "h.w h.b")]
    assert new_groups(None, before) == [0]
    assert new_groups(before, before) == []
    added = [_group("h.w h.b", "h.w h.b"), _group("b.w", "b.w")]
    assert new_groups(before, added) == [1]  # BackboneFinetuning / FTS add a group
    extended = [_group("h.w h.b b.w", "h.w h.b b.w")]
    assert new_groups(before, extended) == [0]  # Flash extends group 0
    frozen_up_front = [_group("h.w", "h.w"), _group("b.w", "")]
    unfrozen = [_group("h.w", "h.w"), _group("b.w", "b.w")]
    assert new_groups(frozen_up_front, unfrozen) == [1]


def test_group_selection() -> None:
    assert select_groups("new", 3, [2], fit_start=True) == [0, 1, 2]
    # an explicit list is honoured at fit start too: the other groups keep their discriminative rates
    assert select_groups((1,), 3, [0, 1, 2], fit_start=True) == [1]
    assert select_groups("all", 3, [], fit_start=True) == [0, 1, 2]
    assert select_groups("new", 3, [2], fit_start=False) == [2]
    assert select_groups("new", 3, [], fit_start=False) == [0, 1, 2]  # an epoch milestone: nothing new
    assert select_groups("all", 3, [2], fit_start=False) == [0, 1, 2]
    assert select_groups((2, 0, 2), 3, [], fit_start=False) == [0, 2]
    with pytest.raises(ValueError, match=r"lists \[5\].*3 param groups"):
        select_groups((5,), 3, [], fit_start=False)
