"""The largest-batch-size search, as pure logic over a ``fits(size) -> bool`` oracle.

Semantics follow Lightning's ``BatchSizeFinder`` where it is sound:

* ``power`` doubles from the start size until a size fails and returns the last size that fit;
  if the start size fails it halves until one fits.
* ``binsearch`` does the same, then bisects between the largest fit and the smallest failure,
  and applies ``margin`` to the result (``found * (1 - margin)``, at least 1) when memory limited
  it: a search that reached the cap without a failure returns the cap itself.
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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from retune.events import Direction, Trial

Mode = Literal["power", "binsearch", "model"]


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
    then: int | None = None
    """``model`` mode: the second size to measure when the first fit and no line exists yet."""

    def __post_init__(self) -> None:
        if self.start < 1 or self.upper < 1 or self.max_trials < 1:
            raise ValueError(f"invalid search plan {self}")


@dataclass(frozen=True)
class MemoryModel:
    """``memory(batch) = fixed + per_sample * batch``, in bytes."""

    fixed: float
    per_sample: float

    def predict(self, size: int) -> float:
        return self.fixed + self.per_sample * size

    def largest_within(self, limit: int, upper: int) -> int:
        """The largest size the line keeps within ``limit`` (``upper`` when memory does not grow)."""
        if self.per_sample <= 0:
            return upper
        return int(min(upper, (limit - self.fixed) // self.per_sample))


@dataclass
class SearchResult:
    """The outcome: ``size`` to apply (margin included) and what was learned on the way."""

    size: int | None
    max_fitting: int | None
    min_failing: int | None
    trials: list[Trial] = field(default_factory=list)
    peaks: list[int | None] = field(default_factory=list)
    model: MemoryModel | None = None
    unsettled: str = ""
    """Where ``max_trials`` ran out with a size still to probe, what the search left open, in words (empty: it
    settled): ``size`` is then the largest size that fit of those tried, not the largest that fits, and the
    event's note says so (:func:`retune.search.stage.search_stage`)."""


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
    if direction == "down" and mode == "model":
        # after an unfreeze the last size most likely runs out of memory, and a real OOM leaves no peak to
        # fit; two smaller sizes measure the new memory line instead, and the prediction verifies it
        first = max(1, start // 8)
        return SearchPlan(mode, first, max_trials, margin, upper, known_fail=failure, then=max(first + 1, start // 4))
    if direction == "down":
        return SearchPlan(mode, start, max_trials, margin, upper, known_fail=failure)
    if direction == "up":
        return SearchPlan(mode, start, max_trials, margin, upper)
    return SearchPlan(mode, start, max_trials, margin, upper, hint_fail=failure)


def failing_from(fitting: int, failed: int) -> int:
    """After a real training step ran out of memory at ``failed`` samples and its micro-batches of ``fitting``
    trained, at a size the search that followed an earlier real failure had verified: the size from which the
    next search treats the stage (or the bucket) as failing, halfway between the two.

    The first real failure may be the memory's change since the last search (the probes then see it, and the
    re-search finds the size that fits). A second one at a size probed *after* the first failed on something the
    probes cannot see (a longer or heavier batch than the probed ones, fragmentation): a probe just below
    ``failed`` would fit again, and the run would fail again, one size lower, every epoch. Halving the gap to
    the size that trained for real ends that in a few epochs; a size that then fails halves it again.

    >>> failing_from(28, 112), failing_from(4, 16), failing_from(15, 16), failing_from(1, 2)
    (70, 10, 16, 2)
    """
    return max(fitting + 1, min(failed, (fitting + failed + 1) // 2))


def below_failure(plan: SearchPlan, failed: int | None) -> SearchPlan:
    """``plan`` with ``failed`` (a size a real training step ran out of memory at) and every larger size out of
    reach: a known failure, never probed nor applied.

    >>> plan = SearchPlan("binsearch", 16, 25, 0.0, 8192, hint_fail=16)
    >>> capped = below_failure(plan, 16)
    >>> capped.start, capped.known_fail, capped.hint_fail
    (15, 16, None)
    """
    if failed is None:
        return plan
    known = failed if plan.known_fail is None else min(plan.known_fail, failed)
    start = max(1, min(plan.start, failed - 1))
    hint = plan.hint_fail if plan.hint_fail is not None and plan.hint_fail < failed else None
    then = plan.then if plan.then is not None and start < plan.then < failed else None
    return replace(plan, start=start, known_fail=known, hint_fail=hint, then=then)


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
    # only a failure limits the size by memory; without one the search stopped at the cap (or ran out of trials)
    unsettled = ""
    if size is not None and lo is not None and _next_size(plan, lo, hi, hint)[0] is not None:
        unsettled = open_bracket(lo, hi)  # max_trials ran out with a size still to probe
    return SearchResult(_apply_margin(plan, lo, memory_bound=hi is not None), lo, hi, trials, unsettled=unsettled)


def open_bracket(fit: int, failed: int | None) -> str:
    """What a search that ran out of trials knows, in words: the largest size that fit and the smallest that failed.

    >>> open_bracket(714, 849), open_bracket(64, None)
    ('714 fit and 849 failed: the sizes between were not probed', '64 fit and no larger size was probed')
    """
    if failed is None:
        return f"{fit} fit and no larger size was probed"
    return f"{fit} fit and {failed} failed: the sizes between were not probed"


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


def on_power_grid(init_val: int, size: int, upper: int) -> int:
    """The size ``power`` mode ends on when ``size`` is the largest that fits: the largest ``init_val`` doubled or
    halved a whole number of times that is at most ``size`` (``upper`` itself where ``size`` reaches it, as the
    doubling stops there). A prediction finds ``size`` directly; ``power`` keeps its sizes.

    The grid is the schedule's ``init_val``'s, not a warm start's first size: a predicted search's verified size
    is off the grid (36 where 32 was applied), and a re-tune starting there would put every later size on that
    size's own grid (36 halved: 18), where a power search from ``init_val`` gives 16.

    >>> on_power_grid(2, 971, 8192), on_power_grid(2, 8192, 8192), on_power_grid(48, 30, 8192), on_power_grid(3, 2, 99)
    (512, 8192, 24, 1)
    """
    if size >= upper:
        return upper
    grid = max(1, init_val)
    if grid <= size:  # doubled, as a power search climbs
        while grid * 2 <= size:
            grid *= 2
        return grid
    while grid > size:  # halved, as a power search whose first size fails goes down (3 -> 1, never 2)
        grid = max(1, grid // 2)
    return grid


def _apply_margin(plan: SearchPlan, found: int | None, memory_bound: bool) -> int | None:
    """``found`` cut by the margin, a safety cut against batches the probes did not see.

    Only a size that memory limited is cut: not one at the cap (``max_val`` or the dataset's length)
    or one the search never saw fail, which is the largest size the run may use, as it was tried.
    """
    if found is None or plan.mode == "power" or plan.margin <= 0 or not memory_bound or found >= plan.upper:
        return found
    return max(1, int(found * (1 - plan.margin)))


def apply_margin(plan: SearchPlan, found: int, memory_bound: bool, capacity: float | None = None) -> int:
    """The schedule's margin applied to one bucket's size, by the same rule as a fixed search: only a size
    that memory limited is cut (not one at the bucket's cap, its share of samples or ``max_val``).

    ``capacity``, the size (a fraction) at which the bucket's measured memory line reaches the limit, is what
    the margin cuts when it is known, never above ``found`` (the size a probe fit): cutting the whole-number
    ``found`` instead would cut twice where batches are small (a line that reaches the limit at 2.7 samples
    keeps 2 with a 5% margin, not ``int(2 x 0.95) = 1``).

    >>> plan = SearchPlan("binsearch", start=2, max_trials=25, margin=0.05, upper=1000)
    >>> apply_margin(plan, 2, True), apply_margin(plan, 2, True, capacity=2.7), apply_margin(plan, 100, True, 101.5)
    (1, 2, 96)
    """
    value = _apply_margin(plan, found, memory_bound)
    if value is None:
        return found  # not cut: at a cap, margin 0 or power mode
    if capacity is not None and capacity > found:
        return min(found, max(value, int(capacity * (1 - plan.margin))))
    return value


# -- model mode ----------------------------------------------------------------------------------


def run_model_search(
    plan: SearchPlan,
    measure: Callable[[int], tuple[bool, int | None]],
    limit: int,
    prior: MemoryModel | None = None,
    phases: Callable[[int], Sequence[int] | None] | None = None,
    recheck: Callable[[int], int | None] | None = None,
) -> SearchResult:
    """Find the largest size whose measured peak stays within ``limit`` in a few probes.

    Memory grows almost linearly with the batch size, so two measured peaks predict the answer:
    fit ``fixed + per_sample * size`` through them, probe the predicted size, and stop there when its
    measured peak plus one sample's worth of memory exceeds the limit. Otherwise the new point
    refines the line (a secant through the points nearest the limit, kept inside the bracket of
    known fits and failures), and when the line is contradicted by a failure that left no peak the
    bracket is bisected, so the search still converges on non-linear memory.

    ``prior`` (the last search's line) supplies the per-sample slope while only one point of the new
    regime is known; after an unfreeze its prediction is corrected by the next probe.

    ``phases(size)``: the measured trial's peak per phase of the step (forward, backward, the update: the
    prober's :meth:`~retune.probing.prober.Prober.phases_at`), where it tells them apart. Each phase grows
    linearly with the batch but at its own slope, so one line through two step peaks cuts across the corner
    where one phase overtakes another (a line through two probes where forward binds under-reads the size
    where backward does); with phases the next size is where the first phase line reaches the limit.

    ``recheck(size)``: a measured point's peak as the verdict reads it now (the prober's
    :meth:`~retune.probing.prober.Prober.checked_at`: a caching allocator's headroom can grow after a point was
    measured), re-read before each line is drawn.

    A probe without a peak (a real out-of-memory error) only moves the bracket.
    """
    lo: int | None = None
    hi: int | None = plan.known_fail
    points: dict[int, int] = {}
    by_phase: dict[int, Sequence[int]] = {}
    trials: list[Trial] = []
    peaks: list[int | None] = []
    unsettled = ""
    size: int | None = plan.start
    while size is not None:
        ok, peak = measure(size)
        trials.append(Trial(size, ok))
        peaks.append(peak)
        if peak is not None:
            points[size] = peak
            measured = phases(size) if phases is not None else None
            if measured:
                by_phase[size] = measured
        if ok:
            lo = size if lo is None else max(lo, size)
        else:
            hi = size if hi is None else min(hi, size)
        if recheck is not None:
            for known in points:
                points[known] = recheck(known) or points[known]
        if len(trials) >= plan.max_trials:
            if lo is not None and _model_next(plan, lo, hi, points, limit, prior, by_phase) is not None:
                unsettled = open_bracket(lo, hi)  # a size still to probe
            break
        size = _model_next(plan, lo, hi, points, limit, prior, by_phase)
    line = _secant(points, limit) or prior
    # below the cap, a model search stops on a failure or on a measured peak one sample short of the limit:
    # either way memory limited the size; the margin cuts where the measured line reaches the limit
    capacity = (limit - line.fixed) / line.per_sample if line is not None and line.per_sample > 0 else None
    size = None if lo is None else apply_margin(plan, lo, True, capacity)
    return SearchResult(size, lo, hi, trials, peaks, line, unsettled)


def _model_next(
    plan: SearchPlan,
    lo: int | None,
    hi: int | None,
    points: dict[int, int],
    limit: int,
    prior: MemoryModel | None,
    by_phase: Mapping[int, Sequence[int]] | None = None,
) -> int | None:
    if lo is not None and hi is not None and hi - lo <= 1:
        return None
    if lo is not None and lo >= plan.upper:
        return None
    if hi is not None and hi <= 1 and lo is None:
        return None
    ceiling = plan.upper if hi is None else min(plan.upper, hi - 1)
    floor = 1 if lo is None else lo + 1
    line = _secant(points, limit)
    if line is None and prior is not None and points:
        size, peak = max(points.items())
        line = MemoryModel(peak - prior.per_sample * size, prior.per_sample)
    if line is None:  # one point or none: step geometrically, as a cold power search would
        if lo is None:
            candidate = hi // 2 if hi is not None else plan.start
        elif hi is not None:
            # bracketed without a line: a second point gives one (a failure may leave no peak). The
            # plan's second size comes first: it lies further up the memory curve than lo // 2, where
            # the optimizer step's flat peak can hide the per-sample slope
            if plan.then is not None and lo < plan.then < hi and plan.then not in points:
                return plan.then
            smaller = max(1, lo // 2)
            if lo > 1 and smaller not in points:
                return smaller
            candidate = (lo + hi) // 2
        else:
            candidate = plan.then if plan.then is not None and plan.then > lo else lo * 8
    else:
        predicted = line.largest_within(limit, plan.upper)
        per_phase = phase_lines(by_phase or {}, points, limit)
        if per_phase:
            predicted = min(phase.largest_within(limit, plan.upper) for phase in per_phase)
        if lo is not None and predicted <= lo:
            if lo in points and points[lo] + _slope_left_of(points, lo) > limit:
                return None  # measured at lo; one more sample's memory would exceed the limit
            candidate = lo + 1
        elif hi is not None and predicted >= hi:
            # the line says a size that failed fits: it is wrong here (a real OOM left no peak to
            # correct it with), so bisect the bracket
            candidate = hi // 2 if lo is None else (lo + hi) // 2
        else:
            candidate = predicted
    candidate = max(floor, min(ceiling, candidate))
    if lo is not None and hi is not None and not (lo < candidate < hi):
        candidate = (lo + hi) // 2
    if candidate in points or candidate in (lo, hi):
        if lo is None or hi is None:
            return None
        candidate = (lo + hi) // 2
        if candidate in (lo, hi):
            return None
    return candidate


def _slope_left_of(points: dict[int, int], size: int) -> float:
    """Memory per sample just below ``size``: from the nearest smaller measured point when there is one.

    Memory is convex in the batch size when it bends at all (a phase with a flat peak gives way to
    one that grows), so this slope does not overstate what one more sample costs, and stopping on
    it never skips a size that fits.
    """
    smaller = [s for s in points if s < size]
    if not smaller:
        return 0.0  # nothing to bound the slope with: probe size + 1 instead of guessing
    nearest = max(smaller)
    return (points[size] - points[nearest]) / (size - nearest)


def nearest_pair(points: Mapping[int, float], limit: float) -> tuple[int, int]:
    """The two sizes whose peaks are nearest ``limit``: the largest at or under it and the smallest over it
    when there are both, else the two nearest on the one side (at least two points). A line through them
    describes memory where a search needs it (the measured or traced points of a peak-vs-size line).

    >>> nearest_pair({8: 100, 16: 190, 32: 380}, limit=250)
    (16, 32)
    >>> nearest_pair({8: 100, 16: 190, 32: 380}, limit=1000)
    (32, 16)
    """
    below = sorted((s for s, p in points.items() if p <= limit), reverse=True)
    above = sorted(s for s, p in points.items() if p > limit)
    if below and above:
        return below[0], above[0]
    side = below if below else above
    return side[0], side[1]


def phase_lines(
    phases: Mapping[int, Sequence[float]], points: Mapping[int, float], limit: float
) -> tuple[MemoryModel, ...]:
    """A line per phase of the step through the two sizes nearest the limit (:func:`nearest_pair` of ``points``,
    the step peaks), where both have their peak per phase in ``phases`` (else none): the step's peak at a size
    is the highest line there.

    >>> lines = phase_lines({8: (180, 150), 16: (260, 270)}, {8: 180, 16: 270}, limit=400)
    >>> [(line.fixed, line.per_sample) for line in lines]   # forward binds at 8, backward from 14 on
    [(100.0, 10.0), (30.0, 15.0)]
    >>> min(line.largest_within(400, 1000) for line in lines)   # one line through 180 and 270 says 27
    24
    """
    if len(points) < 2:
        return ()
    a, b = nearest_pair(points, limit)
    at_a, at_b = phases.get(a), phases.get(b)
    if a == b or not at_a or not at_b or len(at_a) != len(at_b):
        return ()
    lines = []
    for x, y in zip(at_a, at_b, strict=True):
        slope = (y - x) / (b - a)
        lines.append(MemoryModel(x - slope * a, slope))
    return tuple(lines)


def _secant(points: dict[int, int], limit: int) -> MemoryModel | None:
    """The line through the two measured points nearest the limit (one on each side when possible)."""
    if len(points) < 2:
        return None
    a, b = nearest_pair(points, limit)
    if a == b:
        return None
    slope = (points[b] - points[a]) / (b - a)
    return MemoryModel(points[a] - slope * a, slope)


__all__ = [
    "MemoryModel",
    "Mode",
    "SearchPlan",
    "SearchResult",
    "apply_margin",
    "below_failure",
    "failing_from",
    "nearest_pair",
    "open_bracket",
    "on_power_grid",
    "phase_lines",
    "plan_search",
    "run_model_search",
    "run_search",
]
