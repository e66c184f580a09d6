"""The largest-batch-size search, as pure logic over a ``fits(size) -> bool`` oracle.

Semantics follow Lightning's ``BatchSizeFinder`` where it is sound:

* ``power`` doubles from the start size until a size fails and returns the last size that fit;
  if the start size fails it halves until one fits.
* ``binsearch`` does the same, then bisects between the largest fit and the smallest failure,
  and applies ``margin`` to the result (``found * (1 - margin)``, at least 1).
* No candidate exceeds ``upper`` (``max_val``, or the dataset length when smaller: a batch cannot
  hold more samples than the dataset has).

Where Lightning's finder is not sound we differ, on purpose: the result is always a size that was
actually tried and fit (Lightning can return a size it never tried when it hits ``max_val``), and
``max_trials`` bounds every probe, failing ones included.

Warm start is what makes re-tuning cheap: a re-tune starts at the last size that fit and uses the
direction the trigger implies. After an unfreeze (``"down"``) the previous smallest failure still
fails, so it brackets the search without a probe; with an unknown direction it is the next size
probed, so a re-tune that lands on the same size costs two trials.

Example:
    >>> plan = SearchPlan(mode="binsearch", start=2, max_trials=25, margin=0.0, upper=8192)
    >>> result = run_search(plan, lambda size: size <= 100)
    >>> result.size, len(result.trials)
    (100, 13)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from retune.events import Trial

Direction = Literal["down", "up", "unknown"]
Mode = Literal["power", "binsearch"]


@dataclass(frozen=True)
class SearchPlan:
    """Everything one search needs to know before its first probe."""

    mode: Mode
    start: int
    max_trials: int
    margin: float
    upper: int
    known_fail: int | None = None
    """A size assumed to fail without probing it (the previous failure, after memory grew)."""
    hint_fail: int | None = None
    """A size to probe next when growing, before doubling (the previous failure, direction unknown)."""

    def __post_init__(self) -> None:
        if self.start < 1 or self.upper < 1 or self.max_trials < 1:
            raise ValueError(f"invalid search plan {self}")


@dataclass
class SearchResult:
    """The outcome: ``size`` to apply (margin included) and what was learned on the way."""

    size: int | None
    max_fitting: int | None
    min_failing: int | None
    trials: list[Trial] = field(default_factory=list)


def plan_search(
    *,
    mode: Mode,
    init_val: int,
    max_trials: int,
    margin: float,
    max_val: int,
    dataset_len: int | None,
    warm_start: bool,
    previous: SearchResult | None,
    direction: Direction,
) -> SearchPlan:
    """Choose where a search starts: cold from ``init_val``, or warm from the previous result."""
    upper = max_val if dataset_len is None else max(1, min(max_val, dataset_len))
    if not warm_start or previous is None or previous.max_fitting is None:
        return SearchPlan(mode, min(init_val, upper), max_trials, margin, upper)
    start = min(previous.max_fitting, upper)
    failure = previous.min_failing if previous.min_failing is not None and previous.min_failing > start else None
    if direction == "down":
        return SearchPlan(mode, start, max_trials, margin, upper, known_fail=failure)
    if direction == "up":
        return SearchPlan(mode, start, max_trials, margin, upper)
    return SearchPlan(mode, start, max_trials, margin, upper, hint_fail=failure)


def run_search(plan: SearchPlan, fits: Callable[[int], bool]) -> SearchResult:
    """Probe sizes with ``fits`` until the largest fitting size is bracketed (or trials run out).

    ``size`` is None when no size fit, which the caller turns into an error naming the context.
    """
    lo: int | None = None
    hi: int | None = plan.known_fail
    hint = plan.hint_fail
    trials: list[Trial] = []
    size: int | None = plan.start
    while size is not None:
        ok = fits(size)
        trials.append(Trial(size, ok))
        if ok:
            lo = size
        else:
            hi = size
        if len(trials) >= plan.max_trials:
            break
        size, hint = _next_size(plan, lo, hi, hint)
    return SearchResult(_apply_margin(plan, lo), lo, hi, trials)


def _next_size(plan: SearchPlan, lo: int | None, hi: int | None, hint: int | None) -> tuple[int | None, int | None]:
    if lo is None:  # nothing fit yet: halve the smallest failure
        assert hi is not None
        return (None if hi <= 1 else max(1, hi // 2)), hint
    if hi is None:  # nothing failed yet: grow
        if lo >= plan.upper:
            return None, hint
        if hint is not None and lo < hint <= plan.upper:
            return hint, None
        return min(lo * 2, plan.upper), hint
    if plan.mode == "power" or hi - lo <= 1:
        return None, hint
    return (lo + hi) // 2, hint


def _apply_margin(plan: SearchPlan, found: int | None) -> int | None:
    if found is None or plan.mode != "binsearch" or plan.margin <= 0:
        return found
    return max(1, int(found * (1 - plan.margin)))
