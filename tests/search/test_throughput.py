"""``search.objective: throughput`` as pure logic: ``choose_fastest`` over step-time oracles (no clock, no Lightning).

Every oracle gives each size a known step time, so the fastest size is known; "noise" is injected as
deterministic slow steps, never as real timing.
"""

from __future__ import annotations

import doctest
import math
from collections.abc import Callable

import pytest

import retune.search.throughput
from retune.events import Trial
from retune.probing.timing import samples_per_second, steady
from retune.search.largest import SearchResult
from retune.search.throughput import (
    EXTRA_TRIALS,
    ThroughputPlan,
    choose,
    choose_fastest,
    selection_budget,
    timed_sizes,
    trial_rates,
    with_choice,
)

TOL = 0.03
StepTime = Callable[[int], float]


def quadratic(best: float) -> StepTime:
    """``t(b) = c + b + b^2 / best^2 * c``: samples/s peaks at ``best`` and falls smoothly on both sides."""
    c = 1.0
    return lambda b: c + 0.01 * b + c * (b / best) ** 2


def knee(at: int, slope_after: float = 4.0) -> StepTime:
    """Linear up to ``at``, then each further sample costs ``slope_after`` times more: the fastest size is ``at``."""
    return lambda b: 10 + min(b, at) + slope_after * max(0, b - at)


def oracle(step: StepTime, steps: int = 2, calls: list[int] | None = None) -> Callable[[int], tuple[bool, list[float]]]:
    def time_trial(size: int) -> tuple[bool, list[float]]:
        if calls is not None:
            calls.append(size)
        return True, [step(size)] * steps

    return time_trial


def powers(step: StepTime, start: int, cap_fit: int) -> dict[int, list[float]]:
    """What a cold binsearch from ``start`` timed on its way up: every doubling that fit."""
    known, size = {}, start
    while size <= cap_fit:
        known[size] = [step(size)] * 2
        size *= 2
    return known


def best_rate(step: StepTime, cap: int) -> float:
    return max(b / step(b) for b in range(1, cap + 1))


# -- measurement -------------------------------------------------------------------------------


def test_the_first_step_of_a_trial_is_warm_up() -> None:
    assert steady([5.0, 1.0, 1.0]) == [1.0, 1.0]
    assert steady([5.0]) == [] and steady(None) == [] and steady([]) == []


def test_rate_is_size_over_the_median_step_so_one_slow_step_moves_nothing() -> None:
    assert samples_per_second(32, [0.5, 0.5, 9.0]) == 64.0
    assert samples_per_second(32, []) is None
    assert samples_per_second(32, [0.0, 0.0]) is None  # a clock that never moved measures nothing


def test_ties_within_the_tolerance_go_to_the_smaller_size() -> None:
    assert choose({16: 97.5, 32: 100.0, 64: 99.0}, 0.03) == 16
    assert choose({16: 96.9, 32: 100.0, 64: 99.0}, 0.03) == 32
    assert choose({16: 96.9, 32: 100.0, 64: 99.0}, 0.0) == 32
    assert choose({8: 10.0}, 0.03) == 8


# -- the strategy over known curves ----------------------------------------------------------------


@pytest.mark.parametrize("best", [3, 7, 12, 24, 48, 100, 333, 700])
@pytest.mark.parametrize("cap", [20, 64, 243, 1000])
def test_cold_search_lands_within_tolerance_of_the_best_size_that_fits(best: int, cap: int) -> None:
    step = quadratic(best)
    calls: list[int] = []
    choice = choose_fastest(ThroughputPlan(cap=cap, tolerance=TOL), powers(step, 2, cap), oracle(step, calls=calls))
    true_best = best_rate(step, cap)
    assert 1 <= choice.size <= cap
    assert choice.size / step(choice.size) >= (1 - TOL) * true_best, (choice.size, calls)
    assert len(choice.trials) == len(calls) <= EXTRA_TRIALS
    assert choice.largest == cap


@pytest.mark.parametrize("at", [5, 16, 48, 90, 200])
def test_a_sharp_knee_is_found_from_a_cold_search_or_a_nearby_start(at: int) -> None:
    # samples/s rises slowly until the knee, then falls steeply: the worst case for a ladder of doublings.
    # The choice is within the tolerance of the best size *measured*, which can itself miss the knee by a
    # little, so the bound is the target, 5% of the true best (smooth curves: the test above)
    step = knee(at)
    cap = 400
    for start, known in ((None, powers(step, 2, cap)), (max(1, at // 2), {}), (min(cap, 2 * at), {}), (at, {})):
        choice = choose_fastest(ThroughputPlan(cap=cap, tolerance=TOL, start=start), known, oracle(step))
        assert choice.size / step(choice.size) >= 0.95 * best_rate(step, cap), (start, choice)
        assert max(choice.rates.values()) >= (1 - TOL) * best_rate(step, cap)


@pytest.mark.parametrize("at", [5, 16, 48, 90, 200])
def test_a_sharp_knee_from_far_away_lands_within_ten_percent(at: int) -> None:
    # no timings and the cap 80x the knee (or a start 200x below it): the climb or descent uses most of
    # the trials and leaves less for refinement
    step = knee(at)
    for start in (None, 1, 400):
        choice = choose_fastest(ThroughputPlan(cap=400, tolerance=TOL, start=start), {}, oracle(step))
        assert choice.size / step(choice.size) >= 0.9 * best_rate(step, 400), (start, choice)


def test_a_cold_binsearch_needs_no_ladder_rungs_of_its_own() -> None:
    # the fit search timed every power of two: the selection only refines, times between the choice (38) and
    # the fastest (45), and repeats the near tie
    step = knee(48)
    calls: list[int] = []
    choice = choose_fastest(ThroughputPlan(cap=1474, tolerance=TOL), powers(step, 2, 1474), oracle(step, calls=calls))
    assert all(not math.log2(size).is_integer() for size in calls), calls
    assert 38 <= choice.size <= 45 and choice.fastest == 45
    assert choice.size / step(choice.size) >= (1 - TOL) * best_rate(step, 1474)
    assert len(calls) <= 7


def test_no_prior_timings_descends_from_the_cap_by_halves() -> None:
    step = knee(48)
    calls: list[int] = []
    choice = choose_fastest(ThroughputPlan(cap=1000, tolerance=TOL), {}, oracle(step, calls=calls))
    assert calls[:5] == [1000, 500, 250, 125, 62]
    assert calls[5] == 31  # 62 was the fastest yet; 31 is clearly slower, which ends the descent
    assert choice.size / step(choice.size) >= (1 - TOL) * best_rate(step, 1000)


def test_a_re_tune_starts_at_the_previous_choice() -> None:
    step = knee(48)
    calls: list[int] = []
    choose_fastest(ThroughputPlan(cap=1000, tolerance=TOL, start=45), {}, oracle(step, calls=calls))
    assert calls[:3] == [45, 90, 22]  # up once (not faster), then down once (slower): the curve turned


def test_a_re_tune_whose_start_is_still_the_fastest_refines_once() -> None:
    step = knee(48)
    calls: list[int] = []
    choice = choose_fastest(ThroughputPlan(cap=1000, tolerance=TOL, start=48), {}, oracle(step, calls=calls))
    assert calls == [48, 96, 24, 34, 68] and choice.size == 48  # nothing moved: one round of midpoints
    # the curve moved between the rungs (30 is faster than 15 and 60, but 48 is the fastest): the first
    # round finds 42, the second refines around it
    moved: list[int] = []
    choice = choose_fastest(ThroughputPlan(cap=1000, tolerance=TOL, start=30), {}, oracle(step, calls=moved))
    assert moved[:5] == [30, 60, 15, 21, 42] and len(moved) > 5
    assert choice.size / step(choice.size) >= (1 - TOL) * best_rate(step, 1000)


def test_a_start_above_the_cap_is_clamped() -> None:
    step = knee(300)
    calls: list[int] = []
    choice = choose_fastest(ThroughputPlan(cap=100, tolerance=TOL, start=500), {}, oracle(step, calls=calls))
    assert calls[0] == 100 and max(calls) <= 100 and choice.largest == 100
    assert choice.size / step(choice.size) >= (1 - TOL) * 100 / step(100)


def test_sizes_above_the_cap_are_never_chosen_even_when_timed_faster() -> None:
    # binsearch's margin: the largest size that fit (256) was timed, but the size to apply is 243
    step = knee(1000)
    known = powers(step, 2, 256)
    choice = choose_fastest(ThroughputPlan(cap=243, tolerance=TOL), known, oracle(step))
    assert choice.size <= 243 and 256 not in choice.rates


def test_the_largest_is_chosen_when_it_is_the_fastest() -> None:
    step = knee(10_000)  # samples/s only grows: the largest size that fits is the fastest
    choice = choose_fastest(ThroughputPlan(cap=300, tolerance=TOL), powers(step, 2, 300), oracle(step))
    assert 300 in choice.rates
    assert choice.size / step(choice.size) >= (1 - TOL) * 300 / step(300)


def test_a_flat_curve_gives_the_smaller_size() -> None:
    step: StepTime = lambda b: 0.01 * b  # noqa: E731  every size trains equally fast
    choice = choose_fastest(ThroughputPlan(cap=512, tolerance=TOL), {}, oracle(step))
    assert choice.size < 512 and choice.size <= min(choice.rates)


def test_nothing_timed_falls_back_to_the_cap() -> None:
    choice = choose_fastest(ThroughputPlan(cap=77, tolerance=TOL), {}, lambda size: (True, []))
    assert choice.size == 77 and choice.rates == {} and choice.fastest is None
    assert [t.batch_size for t in choice.trials] == [77]


def test_the_extra_trials_are_bounded() -> None:
    for budget in (0, 1, 3):
        choice = choose_fastest(ThroughputPlan(cap=1000, tolerance=TOL, max_trials=budget), {}, oracle(knee(48)))
        assert len(choice.trials) <= budget
    assert choose_fastest(ThroughputPlan(cap=1000, tolerance=TOL, max_trials=0), {}, oracle(knee(48))).size == 1000


def test_a_size_that_unexpectedly_fails_caps_the_choice_below_it() -> None:
    step = knee(48)

    def time_trial(size: int) -> tuple[bool, list[float]]:
        return (size < 40), [step(size)] * 2  # memory that is not monotone: 45 and up fail now

    choice = choose_fastest(ThroughputPlan(cap=400, tolerance=TOL), powers(step, 2, 400), time_trial)
    assert choice.size < 40 and choice.largest == 44
    assert Trial(45, False) in choice.trials
    assert all(size < 40 for size in choice.rates)
    merged = with_choice(SearchResult(400, 420, 421, [Trial(420, True), Trial(421, False)]), choice)
    assert merged.size == choice.size and merged.min_failing == 45 and merged.max_fitting == 32


def test_one_slow_step_per_trial_does_not_move_the_choice() -> None:
    # another process takes the core for one step of every trial: the median ignores it
    step = knee(48)

    def noisy(size: int) -> tuple[bool, list[float]]:
        t = step(size)
        return True, [t, 5 * t, t]

    clean = choose_fastest(ThroughputPlan(cap=400, tolerance=TOL), {}, oracle(step, steps=3))
    with_noise = choose_fastest(ThroughputPlan(cap=400, tolerance=TOL), {}, noisy)
    assert with_noise.size == clean.size


def test_a_near_tie_is_timed_again_and_pooled() -> None:
    # the first trial at 64 is slowed for both steps (a long interference); the repeat corrects it
    step = knee(64, slope_after=1.5)
    seen: dict[int, int] = {}

    def time_trial(size: int) -> tuple[bool, list[float]]:
        seen[size] = seen.get(size, 0) + 1
        slow = 1.04 if size == 64 and seen[size] == 1 else 1.0
        return True, [step(size) * slow] * 3

    choice = choose_fastest(ThroughputPlan(cap=128, tolerance=TOL, start=64), {}, time_trial)
    assert seen[64] == 2, seen
    assert choice.size / step(choice.size) >= (1 - TOL) * best_rate(step, 128)


def test_no_repeat_for_a_clear_winner() -> None:
    step = knee(32, slope_after=20.0)
    calls: list[int] = []
    choose_fastest(ThroughputPlan(cap=64, tolerance=0.0, start=32), {32: [step(32)] * 2}, oracle(step, calls=calls))
    assert len(calls) == len(set(calls)), calls


# -- bookkeeping -----------------------------------------------------------------------------------


def test_timed_sizes_pool_steady_steps_of_fitting_trials() -> None:
    trials = [Trial(2, True), Trial(4, False), Trial(8, True), Trial(8, True), Trial(16, True)]
    times = [[9.0, 1.0, 1.0], None, [9.0, 2.0], [9.0, 3.0], None]
    assert timed_sizes(trials, times) == {2: [1.0, 1.0], 8: [2.0, 3.0]}
    assert trial_rates(trials, times) == [2.0, None, 4.0, 8 / 3, None]
    assert trial_rates(trials, times[:2]) == [2.0, None, None, None, None]


def test_with_choice_keeps_the_memory_bracket_for_warm_starts() -> None:
    result = SearchResult(243, 256, 257, [Trial(256, True), Trial(257, False)])
    choice = choose_fastest(ThroughputPlan(cap=243, tolerance=TOL), {}, oracle(knee(48)))
    merged = with_choice(result, choice)
    assert merged.size == choice.size
    assert (merged.max_fitting, merged.min_failing) == (256, 257)
    assert merged.trials == [*result.trials, *choice.trials]


@pytest.mark.parametrize(
    "kwargs", [{"cap": 0, "tolerance": 0.03}, {"cap": 5, "tolerance": 1.0}, {"cap": 5, "tolerance": -0.1}]
)
def test_invalid_plans_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ThroughputPlan(**kwargs)  # type: ignore[arg-type]


def test_doctests() -> None:
    assert doctest.testmod(retune.search.throughput, raise_on_error=False).failed == 0


def test_a_step_that_raises_records_no_time() -> None:
    import torch

    from retune.probing.timing import timed

    ticks = iter([1.0, 3.5, 10.0, 99.0])
    seconds: list[float] = []
    with timed(torch.device("cpu"), lambda: next(ticks), seconds):
        pass
    assert seconds == [2.5]
    with pytest.raises(torch.OutOfMemoryError), timed(torch.device("cpu"), lambda: next(ticks), seconds):
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert seconds == [2.5]  # the out-of-memory step is a failed trial, not a slow one


def test_the_selection_budget_is_half_the_fit_search_within_bounds() -> None:
    """Half the search for what fits keeps throughput within 1.5x the trials of largest (issue 28); a search
    that timed nothing (a CPU budget's tracked probes) leaves the selection a curve to find: the full 10."""
    assert [selection_budget(n) for n in (1, 2, 6, 7, 8, 13, 17, 25, 40)] == [3, 3, 3, 3, 4, 6, 8, 10, 10]
    assert selection_budget(8, timed=False) == EXTRA_TRIALS


def test_a_short_budget_refines_toward_the_faster_neighbour_first() -> None:
    """A cold binsearch timed 8..512, and the peak is at 100. Round one: the fastest timed size is 128, whose
    faster neighbour is 64, so 91 first (then 181). Round two: 91 is fastest now and of its neighbours 128 is
    faster than 64, so the one trial left goes to 108, between 91 and 128, not to 76 below."""
    step = quadratic(100)
    known = powers(step, 8, 512)
    calls: list[int] = []
    choice = choose_fastest(ThroughputPlan(cap=512, tolerance=TOL, max_trials=3), known, oracle(step, calls=calls))
    assert calls == [91, 181, 108]
    assert choice.size / step(choice.size) >= 0.98 * best_rate(step, 512)


def test_a_sharp_knee_between_two_timed_sizes_is_timed_before_choosing() -> None:
    """Every cap from just above a sharp knee to 3x it, cold or from a start on either side, at the default
    tolerance: the choice is within 3.5% of the true best. Without timing between the choice and the fastest
    (or toward a nearly-as-fast larger neighbour of the fastest) the worst of these lands 5.2% below (knee 16,
    cap 20: 14 where 16 is best)."""
    worst = 1.0
    for at in (16, 32, 48):
        step = knee(at)
        for cap in range(at + 2, 3 * at + 1):
            for start in (None, max(1, at // 2), 2 * at):
                choice = choose_fastest(ThroughputPlan(cap=cap, tolerance=0.02, start=start), {}, oracle(step))
                worst = min(worst, choice.size / step(choice.size) / best_rate(step, cap))
    assert worst >= 0.965, worst
