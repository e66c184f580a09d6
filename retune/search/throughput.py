"""``search.objective: throughput``: the batch size that trains fastest, as pure logic over timed trials.

The largest size that fits is often not the fastest: past some size a step's time grows faster than
its samples (cache misses on a CPU, allocator retries and fragmentation near a GPU's limit), so
samples per second peaks below the largest size and falls after it. The search for what fits already
runs real steps at many sizes; timing them costs nothing. This module picks, among the sizes that
fit, the one with the most samples per second, adding the few trials it needs to see the curve turn.

Measurement: a trial's steps are timed one by one; its **first step is warm-up** (optimizer state is
allocated, caches and allocator pools fill) and never counts. The trials the selection adds run at
least :data:`SELECTION_STEPS` steps (4 timed), more than the fit search's. A size's rate is
``size / median`` of all the steady steps timed at that size, pooled over its trials, so one slow
step (another process took the core) moves nothing.

Strategy, over sizes at most ``cap`` (what ``largest`` would apply, margin included):

1. **Start** at the previous search's choice when there is one (a re-tune: the optimum rarely moves
   far), else at the fastest size the fit search already timed, else at ``cap``.
2. **Climb** on a ladder of doublings toward ``cap`` while each step up is faster by more than the
   tolerance; if it never climbed, **descend** by halves while each step down is within the
   tolerance of the fastest seen (a smaller size that ties is preferred, so it keeps looking), and
   stop at the first size clearly slower. Sizes the fit search already timed are reused as ladder
   rungs when they lie within 1.5x of the doubling or halving (a cold ``binsearch`` times every power
   of two on its way up, so a cold search usually needs no rung of its own).
3. **Refine** between the fastest size and its measured neighbours at their geometric midpoints
   (the faster neighbour's side first), twice (the second round around the fastest size after the
   first), so the size lands within about 10% of the best on the ladder between doublings. A re-tune
   whose start (the previous choice) is still faster than both its rungs was refined there last time:
   its second round runs only when the first found a faster midpoint.
4. **Between the choice and the fastest**: where the smallest size within the tolerance of the fastest
   (what step 6 chooses) lies below the fastest with untimed sizes between them, their midpoint is
   timed once; where the two are one size, the midpoint toward its larger neighbour when that one is
   nearly as fast (within twice the tolerance). On a sharp knee the best size lies there, and the
   choice is only as good as the fastest size measured; a size above the choice never lowers it.
5. **Repeat a near tie**: when the chosen size and the runner-up are within twice the tolerance,
   both are timed once more and their steps pooled.
6. **Choose** the smallest size whose rate is within ``tolerance`` of the fastest: ties go to the
   smaller size (less memory, more optimizer steps per epoch).

The trials it may add are :func:`selection_budget` of the fit search's count: half of them (at least
:data:`MIN_EXTRA_TRIALS`, at most :data:`EXTRA_TRIALS`; :data:`EXTRA_TRIALS` when the fit search timed
nothing), so a cold ``throughput`` search costs at most 1.5x the trials of ``largest``; the steps above
spend them in that order (a cold ``binsearch`` timed every doubling: the midpoints get them). A size
that unexpectedly fails (memory that is not monotone in the batch size) caps the choice below it.

Example:
    >>> step_seconds = lambda size: 0.004 + 0.0005 * size + 0.000004 * size**2  # fastest near 32
    >>> time_trial = lambda size: (True, [step_seconds(size)] * 2)
    >>> known = {s: [step_seconds(s)] * 2 for s in (2, 4, 8, 16, 32, 64, 128, 256)}  # a cold binsearch's
    >>> choice = choose_fastest(ThroughputPlan(cap=243, tolerance=0.03), known, time_trial)
    >>> choice.fastest, choice.size, [t.batch_size for t in choice.trials]
    (32, 23, [23, 45, 27, 38, 23, 32])
    >>> round(choice.rates[23]), round(choice.rates[32])   # 23 is within 3% of 32: the smaller wins
    (1306, 1328)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from retune.events import Trial
from retune.probing.timing import samples_per_second, steady
from retune.search.largest import SearchResult

EXTRA_TRIALS = 10
"""Most trials the throughput selection adds to a search (the search for what fits has ``max_trials``)."""
MIN_EXTRA_TRIALS = 3
"""Fewest trials a selection may add, however short the search for what fits was (a warm re-tune's two)."""
SELECTION_STEPS = 5
"""Steps each selection trial runs at least (1 warm-up + 4 timed). The search for what fits times
``steps_per_trial - 1`` steps per trial (2 by default), enough to tell a doubling apart; telling
neighbouring sizes apart on a flat curve takes more: a median of 4 steps halves the spread of a
median of 2 on a machine whose steps wobble by several percent."""
REUSE_FACTOR = 1.5
"""A timed size within this factor of a ladder rung's target stands in for it (no new trial)."""

TimeTrial = Callable[[int], tuple[bool, Sequence[float]]]
"""``time_trial(size) -> (fits, steady step seconds)``: one more trial at ``size``."""


def selection_budget(fit_trials: int, timed: bool = True) -> int:
    """Trials a selection may add after a search for what fits of ``fit_trials``.

    When that search timed its trials (``timed``): half as many, so that ``throughput`` costs at most 1.5x
    the trials of ``largest`` (a cold search of 6 trials or more), within [:data:`MIN_EXTRA_TRIALS`,
    :data:`EXTRA_TRIALS`]. The steps spend it in order of what they are worth: reaching the fastest region
    (climb or descend), midpoints beside the fastest size (its faster neighbour's side first), then timing
    a near tie again. When it timed nothing (a CPU memory budget: the tracker slows the steps it measures,
    so they are not timed) the selection has no curve to start from and must descend from the cap by
    halves first: it gets :data:`EXTRA_TRIALS`.
    """
    if not timed:
        return EXTRA_TRIALS
    return min(EXTRA_TRIALS, max(MIN_EXTRA_TRIALS, fit_trials // 2))


def selection_steps(steps_per_trial: int) -> int:
    """Steps of one selection trial: ``steps_per_trial``, raised to :data:`SELECTION_STEPS`."""
    return max(steps_per_trial, SELECTION_STEPS)


@dataclass(frozen=True)
class ThroughputPlan:
    """What the selection needs before its first trial."""

    cap: int
    """The largest size it may choose: what ``objective: largest`` applies (margin included)."""
    tolerance: float
    start: int | None = None
    """The previous search's choice, where a re-tune starts looking."""
    max_trials: int = EXTRA_TRIALS

    def __post_init__(self) -> None:
        if self.cap < 1 or not 0 <= self.tolerance < 1 or self.max_trials < 0:
            raise ValueError(f"invalid throughput plan {self}")


@dataclass
class ThroughputResult:
    """The size chosen and every rate it was chosen from."""

    size: int
    largest: int
    """The largest size it could choose (``cap``, lowered below a size that unexpectedly failed)."""
    rates: dict[int, float] = field(default_factory=dict)
    """Samples per second of every timed size up to ``largest``, pooled over its trials."""
    trials: list[Trial] = field(default_factory=list)
    """The trials it added, in order."""
    timings: list[list[float]] = field(default_factory=list)
    """The steady step seconds of each added trial, in the order of ``trials`` (empty when it failed)."""

    @property
    def fastest(self) -> int | None:
        """The size with the highest measured rate (None when nothing was timed)."""
        return max(self.rates, key=lambda s: (self.rates[s], -s)) if self.rates else None


def choose_fastest(
    plan: ThroughputPlan, known: Mapping[int, Sequence[float]], time_trial: TimeTrial
) -> ThroughputResult:
    """Pick the size with the most samples per second among sizes up to ``plan.cap`` that fit.

    ``known`` maps sizes the fit search ran (and that fit) to their steady step seconds; sizes above
    the cap are ignored. ``time_trial`` runs one more trial. When nothing can be timed (a clock that
    never advances) the result is ``cap``, as ``largest`` would choose.
    """
    return _Selection(plan, known, time_trial).run()


class _Selection:
    def __init__(self, plan: ThroughputPlan, known: Mapping[int, Sequence[float]], time_trial: TimeTrial) -> None:
        self.plan = plan
        self.tol = plan.tolerance
        self.ceiling = plan.cap
        self.time_trial = time_trial
        self.seconds: dict[int, list[float]] = {s: list(t) for s, t in known.items() if s <= plan.cap and t}
        self.result = ThroughputResult(size=plan.cap, largest=plan.cap)

    def run(self) -> ThroughputResult:
        start = self._start()
        if self._have(start):
            climbed = self._climb(start)
            if not climbed:
                self._descend(start)
            # a re-tune whose start is still the fastest was refined there last time: one round of
            # midpoints checks that nothing moved between the rungs; a second only if something did
            settled = self.plan.start is not None and self._fastest() == start
            self._refine(settled=settled)
            self._between_choice_and_fastest()
            self._repeat_near_tie()
        rates = self._rates()
        self.result.rates = rates
        self.result.largest = self.ceiling
        self.result.size = choose(rates, self.tol) if rates else self.ceiling
        return self.result

    # -- steps -------------------------------------------------------------------------------

    def _start(self) -> int:
        if self.plan.start is not None:
            return max(1, min(self.plan.start, self.ceiling))
        rates = self._rates()
        if rates:
            return max(rates, key=lambda s: (rates[s], -s))
        return self.ceiling

    def _climb(self, start: int) -> bool:
        current, climbed = start, False
        while (step := self._rung(current, up=True)) is not None and self._have(step):
            if self._rate(step) > self._rate(current) * (1 + self.tol):
                current, climbed = step, True
            else:
                break
        return climbed

    def _descend(self, start: int) -> None:
        current = start
        while (step := self._rung(current, up=False)) is not None and self._have(step):
            if self._rate(step) >= (1 - self.tol) * self._best_rate():
                current = step
            else:
                break

    def _refine(self, *, settled: bool = False) -> None:
        """Two rounds of midpoints; after a settled re-tune's first round, a second only if the fastest moved."""
        first = self._fastest()
        for round_no in range(2):
            best = self._fastest()
            if round_no == 1 and settled and best == first:
                return
            timed = sorted(self.seconds)
            below = [s for s in timed if s < best]
            above = [s for s in timed if s > best]
            sides = []  # (the neighbour's rate, the midpoint toward it)
            if below:
                sides.append((self._rate(below[-1]), _geometric_mid(below[-1], best)))
            if above:
                sides.append((self._rate(above[0]), _geometric_mid(best, above[0])))
            # on a curve with one peak, the peak lies between the fastest size and its faster neighbour:
            # that side first, so a selection short of trials spends its last one where it counts
            midpoints = [mid for _, mid in sorted(sides, key=lambda side: -side[0])]
            new = [m for m in midpoints if m is not None and m not in self.seconds and m <= self.ceiling]
            for size in new:
                self._have(size)
            if not new:
                return

    def _between_choice_and_fastest(self) -> None:
        """One more trial where the size chosen (the smallest within the tolerance of the fastest) and the
        fastest differ with untimed sizes between them, or, where they are one size, between it and its
        larger neighbour when that one is nearly as fast (within twice the tolerance): the choice is only as
        good as the fastest measured, and on a sharp knee the best size lies there (a knee at 16 between 14
        and 17; at 32 between 30 and 35). Neither trial can lower the choice: both time sizes above it."""
        rates = self._rates()
        if len(rates) < 2:
            return
        chosen, fastest = choose(rates, self.tol), self._fastest()
        other: int | None = chosen if chosen < fastest else None
        if other is None:  # a sharp top: a knee's peak hides before its steep side, toward a larger neighbour
            above = [s for s in sorted(rates) if s > fastest][:1]
            near = [s for s in above if rates[s] >= (1 - 2 * self.tol) * rates[fastest]]
            other = near[0] if near else None
        if other is not None:
            mid = _geometric_mid(min(other, fastest), max(other, fastest))
            if mid is not None and mid not in self.seconds:
                self._have(mid)

    def _repeat_near_tie(self) -> None:
        rates = self._rates()
        if len(rates) < 2:
            return
        chosen = choose(rates, self.tol)
        fastest = self._fastest()
        if chosen != fastest:
            pair = [chosen, fastest]
        else:
            runner_up = max((s for s in rates if s != chosen), key=lambda s: rates[s])
            if rates[runner_up] < rates[chosen] * (1 - 2 * self.tol):
                return  # a clear winner: no repeat
            pair = [chosen, runner_up]
        for size in pair:
            self._time(size)

    # -- measurements ------------------------------------------------------------------------

    def _have(self, size: int) -> bool:
        """Whether ``size`` has a rate, timing it if needed (False: out of trials, or it failed)."""
        if size in self.seconds:
            return True
        return self._time(size) and size in self.seconds

    def _time(self, size: int) -> bool:
        if len(self.result.trials) >= self.plan.max_trials or size > self.ceiling:
            return False
        fits, seconds = self.time_trial(size)
        self.result.trials.append(Trial(size, fits))
        self.result.timings.append(list(seconds) if fits else [])
        if not fits:
            # memory that is not monotone in the batch size: nothing at or above this size is safe
            self.ceiling = min(self.ceiling, size - 1)
            self.seconds = {s: t for s, t in self.seconds.items() if s < size}
            return False
        if seconds:
            self.seconds.setdefault(size, []).extend(seconds)
        return True

    def _rates(self) -> dict[int, float]:
        rates = {s: samples_per_second(s, t) for s, t in self.seconds.items() if s <= self.ceiling}
        return {s: r for s, r in rates.items() if r is not None}

    def _rate(self, size: int) -> float:
        return self._rates().get(size, 0.0)

    def _best_rate(self) -> float:
        return max(self._rates().values(), default=0.0)

    def _fastest(self) -> int:
        rates = self._rates()
        return max(rates, key=lambda s: (rates[s], -s)) if rates else self.ceiling

    def _rung(self, size: int, *, up: bool) -> int | None:
        """The next size on the ladder from ``size``: a timed size near the doubling (halving), else that."""
        if up:
            if size >= self.ceiling:
                return None
            target = min(size * 2, self.ceiling)
            near = [s for s in self.seconds if size < s <= self.ceiling and _within(s, target)]
        else:
            if size <= 1:
                return None
            target = max(1, size // 2)
            near = [s for s in self.seconds if s < size and _within(s, target)]
        if near:
            return min(near, key=lambda s: abs(math.log(s / target)))
        return target


def choose(rates: Mapping[int, float], tolerance: float) -> int:
    """The smallest size whose rate is within ``tolerance`` of the highest: ties go to the smaller size."""
    best = max(rates.values())
    return min(s for s, r in rates.items() if r >= (1 - tolerance) * best)


def _within(size: int, target: int) -> bool:
    return target / REUSE_FACTOR <= size <= target * REUSE_FACTOR


def _geometric_mid(low: int, high: int) -> int | None:
    mid = round(math.sqrt(low * high))
    return mid if low < mid < high else None


def timed_sizes(trials: Sequence[Trial], step_times: Sequence[Sequence[float] | None]) -> dict[int, list[float]]:
    """The steady step seconds of every fitting, timed trial of a search, pooled by size."""
    known: dict[int, list[float]] = {}
    for trial, times in zip(trials, step_times, strict=False):
        if trial.fits and times:
            known.setdefault(trial.batch_size, []).extend(steady(times))
    return {size: seconds for size, seconds in known.items() if seconds}


def trial_rates(trials: Sequence[Trial], step_times: Sequence[Sequence[float] | None]) -> list[float | None]:
    """Samples per second of each trial from its own steady steps (None where it failed or was not timed)."""
    padded = [*step_times, *([None] * (len(trials) - len(step_times)))]
    return [
        samples_per_second(t.batch_size, steady(times)) if t.fits else None
        for t, times in zip(trials, padded, strict=False)
    ]


def with_choice(result: SearchResult, choice: ThroughputResult) -> SearchResult:
    """The fit search's result with the fastest size applied and its trials appended.

    ``max_fitting`` and ``min_failing`` stay the memory bracket a warm start needs, lowered only when a
    selection trial failed below it (memory that is not monotone in the batch size).
    """
    failed = [t.batch_size for t in choice.trials if not t.fits]
    trials = [*result.trials, *choice.trials]
    min_failing = min([*failed, *([] if result.min_failing is None else [result.min_failing])], default=None)
    max_fitting = result.max_fitting
    if failed and min_failing is not None and max_fitting is not None and min_failing <= max_fitting:
        max_fitting = max((t.batch_size for t in trials if t.fits and t.batch_size < min_failing), default=None)
    return SearchResult(choice.size, max_fitting, min_failing, trials, result.peaks, result.model, result.unsettled)


__all__ = [
    "EXTRA_TRIALS",
    "ThroughputPlan",
    "ThroughputResult",
    "choose",
    "MIN_EXTRA_TRIALS",
    "SELECTION_STEPS",
    "choose_fastest",
    "selection_budget",
    "selection_steps",
    "timed_sizes",
    "trial_rates",
    "with_choice",
]
