"""The batch-size search as pure logic: ``plan_search`` / ``run_search`` over a ``fits(size)`` oracle.

Every oracle here is monotone, ``fits = lambda s: s <= M``: ``M`` is the largest size that fits in memory.
"""

from __future__ import annotations

import doctest
from collections.abc import Callable
from types import ModuleType

import pytest

import retune.schedule.models
import retune.search.largest
from retune.events import Direction, Trial
from retune.search.largest import Mode, SearchPlan, SearchResult, plan_search, run_model_search, run_search

MS = range(1, 601)


def fits_upto(m: int) -> Callable[[int], bool]:
    return lambda size: size <= m


def cold(
    mode: Mode = "binsearch",
    *,
    init_val: int = 2,
    max_trials: int = 100,
    margin: float = 0.0,
    max_val: int = 8192,
    dataset_len: int | None = None,
) -> SearchPlan:
    return plan_search(
        mode=mode,
        init_val=init_val,
        max_trials=max_trials,
        margin=margin,
        max_val=max_val,
        dataset_len=dataset_len,
        warm_start=True,
        previous=None,
        direction="unknown",
    )


def warm(
    previous: SearchResult,
    direction: Direction,
    mode: Mode = "binsearch",
    *,
    init_val: int = 2,
    max_trials: int = 100,
    margin: float = 0.0,
    max_val: int = 8192,
    dataset_len: int | None = None,
    warm_start: bool = True,
) -> SearchPlan:
    return plan_search(
        mode=mode,
        init_val=init_val,
        max_trials=max_trials,
        margin=margin,
        max_val=max_val,
        dataset_len=dataset_len,
        warm_start=warm_start,
        previous=previous,
        direction=direction,
    )


def sizes(result: SearchResult) -> list[int]:
    return [t.batch_size for t in result.trials]


def largest_power_multiple(init: int, m: int) -> int | None:
    """The largest init * 2**k <= m, or (when init > m) the largest init // 2**k <= m, >= 1."""
    if init <= m:
        size = init
        while size * 2 <= m:
            size *= 2
        return size
    size = init
    while size > m and size > 1:
        size //= 2
    return size if size <= m else None


def check_invariants(result: SearchResult, m: int, upper: int, max_trials: int) -> None:
    """What must hold for every search over a monotone oracle, whatever the plan."""
    assert 1 <= len(result.trials) <= max_trials
    for trial in result.trials:
        assert isinstance(trial, Trial)
        assert 1 <= trial.batch_size <= upper
        assert trial.fits == (trial.batch_size <= m)
    assert len(set(sizes(result))) == len(result.trials), f"a size was probed twice: {sizes(result)}"
    fitting = [t.batch_size for t in result.trials if t.fits]
    failing = [t.batch_size for t in result.trials if not t.fits]
    assert result.max_fitting == (max(fitting) if fitting else None)
    if failing:
        assert result.min_failing is not None and result.min_failing <= min(failing)
    if result.size is not None:
        assert result.max_fitting is not None
        assert result.size <= result.max_fitting <= m


# --- cold search ----------------------------------------------------------------------------------


@pytest.mark.parametrize("init_val", [1, 2, 3, 5, 32])
def test_binsearch_margin0_finds_m_exactly(init_val: int) -> None:
    for m in MS:
        result = run_search(cold("binsearch", init_val=init_val), fits_upto(m))
        check_invariants(result, m, upper=8192, max_trials=100)
        assert result.size == m, (m, sizes(result))
        assert result.max_fitting == m
        assert result.min_failing == m + 1
        # m + 1 was actually probed (cold searches have no assumed failures)
        assert Trial(m + 1, False) in result.trials


@pytest.mark.parametrize("init_val", [1, 2, 3, 5, 32, 600])
def test_power_finds_largest_doubling_of_init(init_val: int) -> None:
    for m in MS:
        result = run_search(cold("power", init_val=init_val), fits_upto(m))
        check_invariants(result, m, upper=8192, max_trials=100)
        assert result.size == largest_power_multiple(init_val, m), (m, sizes(result))


@pytest.mark.parametrize("margin", [0.05, 0.1, 0.5, 0.99])
def test_binsearch_margin_applied_to_found_size(margin: float) -> None:
    for m in MS:
        result = run_search(cold("binsearch", margin=margin), fits_upto(m))
        assert result.max_fitting == m
        assert result.size == max(1, int(m * (1 - margin)))
        assert result.size <= m


def test_binsearch_margin_005_explicit_values() -> None:
    expected = {1: 1, 2: 1, 19: 18, 20: 19, 100: 95, 101: 95, 600: 570}
    for m, size in expected.items():
        assert run_search(cold("binsearch", margin=0.05), fits_upto(m)).size == size
    for m in MS:
        assert run_search(cold("binsearch", margin=0.05), fits_upto(m)).size == max(1, int(m * 0.95))


def test_power_ignores_margin() -> None:
    for m in (1, 7, 64, 100, 600):
        assert run_search(cold("power", margin=0.5), fits_upto(m)).size == largest_power_multiple(2, m)


@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_result_never_exceeds_m_and_fits_only_below_m(mode: Mode) -> None:
    for margin in (0.0, 0.05):
        for init_val in (1, 2, 7):
            for m in MS:
                result = run_search(cold(mode, init_val=init_val, margin=margin), fits_upto(m))
                assert result.size is not None and result.size <= m
                assert all(t.batch_size <= m for t in result.trials if t.fits)
                assert all(t.batch_size > m for t in result.trials if not t.fits)


# --- Lightning semantics where they agree ---------------------------------------------------------


def test_power_from_2_doubles_until_first_failure() -> None:
    for m in MS:
        result = run_search(cold("power", init_val=2), fits_upto(m))
        if m == 1:
            assert sizes(result) == [2, 1]
            continue
        expected = []
        size = 2
        while size <= m:
            expected.append(size)
            size *= 2
        expected.append(size)  # the first failure ends a power search
        assert sizes(result) == expected
        assert [t.fits for t in result.trials] == [True] * (len(expected) - 1) + [False]


def _lightning_binsearch_trials(m: int, init_val: int, max_val: int = 8192) -> list[int]:
    """Lightning 2.x ``_run_binsearch_scaling``'s sequence of tried sizes, transcribed (no dataset cap).

    Only valid when ``init_val`` fits and the doubling stays below ``max_val``, where Lightning is sound.
    """
    low, high, new_size, tried = 1, None, init_val, []
    for _ in range(1000):
        if new_size >= max_val:
            break
        tried.append(new_size)
        if new_size <= m:
            low = new_size
            if high:
                if high - low <= 1:
                    break
                new_size = (high + low) // 2
            else:
                new_size = min(int(new_size * 2.0), max_val)
        else:
            high = new_size
            new_size = (high + low) // 2
            if high - low <= 1:
                break
    return tried


@pytest.mark.parametrize("init_val", [1, 2, 3, 10])
def test_binsearch_trial_sequence_matches_lightning(init_val: int) -> None:
    for m in range(init_val, 601):
        result = run_search(cold("binsearch", init_val=init_val), fits_upto(m))
        assert sizes(result) == _lightning_binsearch_trials(m, init_val), m


def test_binsearch_bisects_between_last_success_and_first_failure() -> None:
    result = run_search(cold("binsearch", init_val=2), fits_upto(100))
    assert sizes(result)[:7] == [2, 4, 8, 16, 32, 64, 128]
    # then (64 + 128) // 2 and so on, always between the largest fit and the smallest failure
    lo, hi = 64, 128
    for trial in result.trials[7:]:
        assert trial.batch_size == (lo + hi) // 2
        if trial.fits:
            lo = trial.batch_size
        else:
            hi = trial.batch_size
    assert (lo, hi) == (100, 101)


def test_module_docstring_example_counts_13_trials() -> None:
    # The module docstring's example claims 14 trials; the search (and Lightning's) takes 13.
    result = run_search(SearchPlan("binsearch", 2, 25, 0.0, 8192), fits_upto(100))
    assert sizes(result) == [2, 4, 8, 16, 32, 64, 128, 96, 112, 104, 100, 102, 101]
    assert (result.size, len(result.trials)) == (100, 13)


# --- upper bound: max_val and dataset length ------------------------------------------------------


@pytest.mark.parametrize("mode", ["power", "binsearch"])
@pytest.mark.parametrize(
    ("max_val", "dataset_len", "upper"),
    [(8192, None, 8192), (100, None, 100), (8192, 37, 37), (64, 1000, 64), (50, 50, 50), (1, None, 1), (8192, 1, 1)],
)
def test_huge_m_returns_the_cap_and_tries_it(mode: Mode, max_val: int, dataset_len: int | None, upper: int) -> None:
    plan = cold(mode, max_val=max_val, dataset_len=dataset_len)
    assert plan.upper == upper
    result = run_search(plan, fits_upto(10**9))
    assert result.size == upper
    assert result.trials[-1] == Trial(upper, True)
    assert max(sizes(result)) == upper
    assert result.min_failing is None


def test_cap_between_doublings_is_probed_not_skipped() -> None:
    # 2, 4, ..., 64, then 100 (the cap) rather than 128
    result = run_search(cold("power", max_val=100), fits_upto(10**9))
    assert sizes(result) == [2, 4, 8, 16, 32, 64, 100]
    # when the cap itself fails, binsearch bisects below it and never probes above it
    result = run_search(cold("binsearch", max_val=100), fits_upto(80))
    assert result.size == 80
    assert max(sizes(result)) == 100


def test_dataset_len_zero_still_allows_size_1() -> None:
    plan = cold(dataset_len=0)
    assert plan.upper == 1 and plan.start == 1
    assert run_search(plan, fits_upto(5)).size == 1


@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_init_val_above_upper_is_clamped(mode: Mode) -> None:
    plan = cold(mode, init_val=1000, max_val=64)
    assert plan.start == 64
    result = run_search(plan, fits_upto(10**9))
    assert sizes(result) == [64]
    assert result.size == 64
    plan = cold(mode, init_val=1000, dataset_len=10)
    assert plan.start == 10
    assert sizes(run_search(plan, fits_upto(3)))[0] == 10


@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_failing_start_halves_down(mode: Mode) -> None:
    result = run_search(cold(mode, init_val=512), fits_upto(40))
    assert sizes(result)[:5] == [512, 256, 128, 64, 32]
    assert [t.fits for t in result.trials[:5]] == [False, False, False, False, True]
    if mode == "power":
        assert sizes(result) == [512, 256, 128, 64, 32]
        assert result.size == 32
    else:
        assert result.size == 40
        assert result.min_failing == 41


@pytest.mark.parametrize("mode", ["power", "binsearch"])
@pytest.mark.parametrize("init_val", [1, 2, 3, 100, 8192])
def test_nothing_fits_gives_none_after_trying_1(mode: Mode, init_val: int) -> None:
    result = run_search(cold(mode, init_val=init_val, margin=0.05), fits_upto(0))
    assert result.size is None
    assert result.max_fitting is None
    assert result.min_failing == 1
    assert result.trials[-1] == Trial(1, False)
    assert not any(t.fits for t in result.trials)
    assert sizes(result) == sorted(sizes(result), reverse=True)


# --- max_trials -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_max_trials_bounds_every_probe(mode: Mode) -> None:
    for init_val in (2, 512):
        for m in (0, 1, 3, 40, 100, 257, 600):
            full = run_search(cold(mode, init_val=init_val), fits_upto(m))
            for max_trials in range(1, len(full.trials) + 2):
                result = run_search(cold(mode, init_val=init_val, max_trials=max_trials), fits_upto(m))
                check_invariants(result, m, upper=8192, max_trials=max_trials)
                # a budget only cuts the search short, it does not change the probes
                assert result.trials == full.trials[:max_trials]
                fitting = [t.batch_size for t in result.trials if t.fits]
                assert result.size == (max(fitting) if fitting else None)
                # a search cut short says so (the event's note): not where it had settled, nor where nothing fit
                cut = max_trials < len(full.trials) and result.size is not None
                assert bool(result.unsettled) == cut, (mode, init_val, m, max_trials, result.unsettled)
                assert not full.unsettled


@pytest.mark.parametrize("per_sample", [1000, 3333, 70_000])
def test_a_model_search_cut_short_by_max_trials_says_what_it_left_open(per_sample: int) -> None:
    """``max_trials`` stops a model search before its line pinned the size: the result names the bracket it had
    (``unsettled``), which the event's note and a warning repeat; a search given the trials it needs settles."""
    limit = 3_000_000

    def measure(size: int) -> tuple[bool, int]:
        peak = 1_000_000 + per_sample * size
        return peak <= limit, peak

    full = run_model_search(SearchPlan("model", 2, 25, 0.0, 8192), measure, limit)
    assert full.size == (limit - 1_000_000) // per_sample and not full.unsettled
    for max_trials in range(1, len(full.trials)):
        result = run_model_search(SearchPlan("model", 2, max_trials, 0.0, 8192), measure, limit)
        assert result.trials == full.trials[:max_trials]
        assert result.unsettled.startswith(f"{result.max_fitting} fit"), result.unsettled


def test_max_trials_1_returns_start_if_it_fits() -> None:
    assert sizes(run_search(cold(max_trials=1), fits_upto(100))) == [2]
    assert run_search(cold(max_trials=1), fits_upto(100)).size == 2
    assert run_search(cold(max_trials=1, init_val=200), fits_upto(100)).size is None


# --- warm start -----------------------------------------------------------------------------------


def previous_for(p: int) -> SearchResult:
    return SearchResult(size=p, max_fitting=p, min_failing=p + 1)


@pytest.mark.parametrize("p", [1, 2, 3, 7, 64, 100, 250, 599, 1000])
def test_warm_unknown_unchanged_costs_two_trials(p: int) -> None:
    plan = warm(previous_for(p), "unknown")
    assert plan.start == p and plan.hint_fail == p + 1 and plan.known_fail is None
    result = run_search(plan, fits_upto(p))
    assert result.trials == [Trial(p, True), Trial(p + 1, False)]
    assert result.size == p


def test_warm_unknown_any_new_m() -> None:
    p = 100
    for m in range(0, 601):
        result = run_search(warm(previous_for(p), "unknown"), fits_upto(m))
        check_invariants(result, m, upper=8192, max_trials=100)
        assert result.size == (m or None)


@pytest.mark.parametrize("p", [2, 16, 100, 1000])
def test_warm_down_unchanged_costs_one_trial(p: int) -> None:
    plan = warm(previous_for(p), "down")
    assert plan.known_fail == p + 1 and plan.hint_fail is None
    result = run_search(plan, fits_upto(p))
    assert result.trials == [Trial(p, True)]
    assert (result.size, result.max_fitting, result.min_failing) == (p, p, p + 1)


def test_warm_down_never_probes_previous_failure_and_finds_new_m() -> None:
    p = 1000
    for m in range(0, p + 1):
        result = run_search(warm(previous_for(p), "down"), fits_upto(m))
        check_invariants(result, m, upper=8192, max_trials=100)
        assert max(sizes(result)) < p + 1
        assert result.size == (m or None)


def test_warm_down_cheaper_than_cold() -> None:
    p, m = 1000, 250
    warm_result = run_search(warm(previous_for(p), "down"), fits_upto(m))
    cold_result = run_search(cold(init_val=2), fits_upto(m))
    assert warm_result.size == cold_result.size == m
    assert sizes(warm_result) == [1000, 500, 250, 375, 312, 281, 265, 257, 253, 251]
    assert len(cold_result.trials) == 15
    assert len(warm_result.trials) < len(cold_result.trials)


def test_warm_up_finds_larger_m() -> None:
    p = 100
    for m in range(p, 1200):
        plan = warm(previous_for(p), "up")
        assert plan.start == p and plan.known_fail is None and plan.hint_fail is None
        result = run_search(plan, fits_upto(m))
        check_invariants(result, m, upper=8192, max_trials=100)
        assert result.size == m
        assert sizes(result)[0] == p


def test_warm_up_on_power_doubles_from_previous() -> None:
    result = run_search(warm(previous_for(100), "up", "power"), fits_upto(700))
    assert sizes(result) == [100, 200, 400, 800]
    assert result.size == 400


def test_warm_start_false_ignores_previous() -> None:
    for direction in ("down", "up", "unknown"):
        plan = warm(previous_for(1000), direction, warm_start=False)  # type: ignore[arg-type]
        assert plan == cold()
        assert run_search(plan, fits_upto(2000)).size == 2000  # the old failure does not bracket it


def test_warm_previous_without_fit_is_cold() -> None:
    previous = SearchResult(size=None, max_fitting=None, min_failing=1)
    assert warm(previous, "down", init_val=4) == cold(init_val=4)


def test_warm_start_respects_new_upper() -> None:
    # The dataset shrank below the previous size: start at the cap and never probe above it.
    plan = warm(previous_for(1000), "unknown", dataset_len=300)
    assert plan.start == 300 and plan.upper == 300
    result = run_search(plan, fits_upto(10**9))
    assert sizes(result) == [300]
    result = run_search(warm(previous_for(1000), "down", max_val=300), fits_upto(120))
    assert result.size == 120 and max(sizes(result)) <= 300


def test_warm_previous_min_failing_not_above_start_is_dropped() -> None:
    # A stale failure that does not lie above the start must not bracket the search.
    previous = SearchResult(size=100, max_fitting=100, min_failing=50)
    for direction in ("down", "unknown"):
        plan = warm(previous, direction)  # type: ignore[arg-type]
        assert plan.known_fail is None and plan.hint_fail is None
        assert run_search(plan, fits_upto(300)).size == 300


# --- plan validation and doctests -----------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{"start": 0}, {"upper": 0}, {"max_trials": 0}, {"start": -1}])
def test_invalid_plan_raises(kwargs: dict[str, int]) -> None:
    values = {"mode": "binsearch", "start": 2, "max_trials": 25, "margin": 0.0, "upper": 8192, **kwargs}
    with pytest.raises(ValueError, match="invalid search plan"):
        SearchPlan(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "module",
    [
        pytest.param(retune.search.largest, id="search"),
        pytest.param(retune.schedule.models, id="schedule"),
    ],
)
def test_module_doctests_pass(module: ModuleType) -> None:
    outcome = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert outcome.attempted > 0, module.__name__
    assert outcome.failed == 0, module.__name__


def test_warm_start_from_margin_result_does_not_compound_margin() -> None:
    first = run_search(cold("binsearch", margin=0.05), fits_upto(300))
    assert (first.size, first.max_fitting, first.min_failing) == (285, 300, 301)
    again = run_search(warm(first, "unknown", margin=0.05), fits_upto(300))
    assert sizes(again) == [300, 301]
    assert again.size == 285


# --- the margin cuts only a size that memory limited (issue 20) -----------------------------------


@pytest.mark.parametrize("init_val", [1, 2, 3, 64])
def test_binsearch_cap_hit_without_a_failure_keeps_the_cap(init_val: int) -> None:
    """With ``max_val: 64`` and a model for which 64 fits, the size is 64, not 60: nothing failed."""
    for m in (64, 65, 100, 10_000):
        result = run_search(cold("binsearch", init_val=init_val, margin=0.05, max_val=64), fits_upto(m))
        assert result.size == 64 and result.max_fitting == 64 and result.min_failing is None, sizes(result)


def test_binsearch_dataset_length_cap_keeps_the_cap() -> None:
    result = run_search(cold("binsearch", margin=0.1, dataset_len=50), fits_upto(10_000))
    assert result.size == 50 and sizes(result)[-1] == 50


def test_binsearch_failure_just_below_the_cap_applies_the_margin() -> None:
    """64 is the cap and fails; 63 fits: memory limited the size, so the margin applies."""
    result = run_search(cold("binsearch", margin=0.05, max_val=64), fits_upto(63))
    assert result.max_fitting == 63 and result.min_failing == 64
    assert result.size == int(63 * 0.95)


def test_binsearch_known_failure_just_above_the_cap_keeps_the_cap() -> None:
    """A warm start remembers a failure at 65, above the new cap of 64: the cap, not memory, stops it."""
    previous = SearchResult(60, 64, 65)
    result = run_search(warm(previous, "unknown", margin=0.05, max_val=64), fits_upto(64))
    assert result.size == 64 and result.max_fitting == 64


@pytest.mark.parametrize("cap", [64, 50])
def test_binsearch_margin_zero_at_and_below_the_cap(cap: int) -> None:
    assert run_search(cold("binsearch", margin=0.0, max_val=cap), fits_upto(10_000)).size == cap
    assert run_search(cold("binsearch", margin=0.0, max_val=cap), fits_upto(cap - 1)).size == cap - 1


def test_binsearch_below_the_cap_the_margin_still_applies() -> None:
    for m in (1, 20, 63, 100, 600):
        result = run_search(cold("binsearch", margin=0.05, max_val=8192), fits_upto(m))
        assert result.size == max(1, int(m * 0.95))


def test_power_at_the_cap_is_the_cap() -> None:
    assert run_search(cold("power", margin=0.5, max_val=64), fits_upto(1000)).size == 64


@pytest.mark.parametrize(("per_sample", "expected"), [(1000, 2), (1300, 1), (10, 256)])
def test_model_mode_cuts_the_margin_from_the_measured_lines_capacity(per_sample: int, expected: int) -> None:
    """``peak = 100 + per_sample x size`` within 2,800: the line reaches the limit at 2.7 samples (per sample 1000),
    2.08 (1300: 2 fits, and the margin's 5% of 2.08 passes below 2) or 270 (10); a 5% margin keeps
    ``int(capacity x 0.95)``, never above the size that fit: 2, 1 and 256. Cutting the whole number that fit (2)
    instead gave ``int(2 x 0.95) = 1`` for the first."""
    from retune.search.largest import run_model_search

    def measure(size: int) -> tuple[bool, int | None]:
        peak = 100 + per_sample * size
        return peak <= 2800, peak

    plan = SearchPlan("model", start=1, max_trials=25, margin=0.05, upper=4096)
    result = run_model_search(plan, measure, 2800)
    assert result.max_fitting == (2800 - 100) // per_sample
    assert result.size == expected


@pytest.mark.parametrize(("start", "then"), [(4, 8), (16, 32), (2, 40)])
def test_model_mode_draws_a_line_per_phase_of_the_step(start: int, then: int) -> None:
    """Forward (``9000 + 10 x size``: the step before's gradients) binds at small sizes, backward (``3000 +
    20 x size``) from 600 on, the update's flat peak (12000) below both: the true maximum under 20,000 is 850.
    A line through two step peaks where forward binds predicts 1100, which fails; lines per phase (the prober's
    ``phases_at``) find 850 on the first prediction. Without phases the search still ends on 850, in more
    probes."""
    from retune.search.largest import run_model_search

    def parts(size: int) -> tuple[int, int, int]:
        return 9000 + 10 * size, 3000 + 20 * size, 12000

    def measure(size: int) -> tuple[bool, int | None]:
        peak = max(parts(size))
        return peak <= 20000, peak

    plan = SearchPlan("model", start=start, max_trials=25, margin=0.0, upper=4096, then=then)
    plain = run_model_search(plan, measure, 20000)
    phased = run_model_search(plan, measure, 20000, phases=parts)
    assert plain.max_fitting == phased.max_fitting == 850
    assert [t.batch_size for t in phased.trials] == [start, then, 850]
    assert len(plain.trials) > len(phased.trials)


def test_model_mode_without_phases_at_a_size_keeps_one_line() -> None:
    """A trial that did not tell its phases apart (an allocator, manual optimization): the step peaks' line, as
    before."""
    from retune.search.largest import run_model_search

    def measure(size: int) -> tuple[bool, int | None]:
        peak = 1000 + 7 * size
        return peak <= 8000, peak

    plan = SearchPlan("model", start=8, max_trials=25, margin=0.0, upper=4096)
    result = run_model_search(plan, measure, 8000, phases=lambda size: None)
    assert result.max_fitting == 1000 and len(result.trials) == 3


def test_a_size_that_failed_in_training_caps_every_later_plan_on_powers_grid() -> None:
    """``StageState.failed_in_training`` (a real step ran out of memory at 16) keeps 16 and above out of reach of a
    later search, a cold one too; a power search starts on its grid below it (8 for init_val 16, not 15)."""
    from retune import load_schedule
    from retune.search.stage import StageState, _plan

    for mode, start in (("power", 8), ("binsearch", 15)):
        schedule = load_schedule(
            {"triggers": [{"kind": "epoch", "every": 1}], "search": {"mode": mode, "init_val": 16}}
        )
        state = StageState(size=4, failed_in_training=16)
        plan, direction = _plan(schedule, mode, None, state, True, "unknown", None)  # type: ignore[arg-type]
        assert (plan.start, plan.known_fail, direction) == (start, 16, "unknown")
        plan, _ = _plan(schedule, mode, None, state, False, "up", None)  # type: ignore[arg-type]
        assert plan.known_fail is None and state.failed_in_training is None  # the memory shrank: forgotten
