"""Predict, then verify: the largest batch size from traced peaks, each size used verified by a real probe.

A fake-tensor trace of the training step (:mod:`retune.prediction`) predicts its peak at any size for
a few hundred milliseconds and no memory; a real probe costs real steps. So the search traces first,
fits the peak line (``fixed + per_sample x size``) and jumps to the size the line predicts as the
largest within the limit; only then does it probe, and the probe both verifies the size and
calibrates the prediction (an affine correction of predicted to measured,
:func:`retune.prediction.fit.calibrate`). From the calibrated line the next size is the largest it
keeps within the limit, measured from the nearest probed size (up from a size that fit, down from one
that measured over the limit), so a prediction that errs by a constant or a proportion costs one more
probe, and a failure that left no peak (a real out-of-memory error) bisects. The search stops, as
``mode: model`` does, on a size that fit whose measured peak plus one sample's worth of memory would
pass the limit, or on a closed bracket.

A size is only ever used after a real probe fit: the result is the largest probed size that fit (the
schedule's margin then cuts it, as for ``binsearch`` and ``model``). Where ``max_trials`` would run out before
any size fit, the last trial goes no higher than the smallest size a search without prediction reaches in as
many trials (the plan's start, ``init_val`` or the warm start, halved at each failure), or halfway below the
smallest failure where that is lower (:func:`last_chance`): a prediction that errs low sends the first probes over
the limit, and without that trial a search that ``predict: off`` ends on a small size that fit (with its
"max_trials ran out" warning) ended with no size at all. The trial then may land below what a calibrated step
would have reached; the result says it is unsettled, as any search cut short by ``max_trials`` does. The
functions here are pure logic over ``trace(size)`` and ``measure(size)``; :mod:`retune.search.stage` connects
them to the traces and probes of a run (:mod:`retune.search.predict_run`).

Example (memory ``1000 + 10 x size``, traced exactly, limit 5000: one probe):
    >>> from retune.search.largest import SearchPlan
    >>> peak = lambda size: 1000 + 10 * size
    >>> prediction = predict_largest(peak, 5000, upper=8192, first=8192, fixed=lambda: 1000)
    >>> prediction.largest, prediction.traced   # the cap, then where the first trace predicts the answer
    (400, (8192, 400))
    >>> plan = SearchPlan(mode="model", start=8, max_trials=25, margin=0.0, upper=8192)
    >>> result = run_predicted_search(plan, prediction, lambda size: (peak(size) <= 5000, peak(size)), 5000)
    >>> result.size, [t.batch_size for t in result.trials]
    (400, [400])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from retune.events import Trial
from retune.prediction.line import Calibration, PeakLine, calibrate
from retune.search.largest import (
    MemoryModel,
    SearchPlan,
    SearchResult,
    apply_margin,
    nearest_pair,
    open_bracket,
    phase_lines,
)

__all__ = [
    "Prediction",
    "PredictedResult",
    "predict_largest",
    "last_chance",
    "run_predicted_search",
    "secant_line",
    "step_from",
]

MAX_TRACES = 3
"""Traces of one prediction at most: two for the line, one more where it extrapolates far (a trace of a small
model on a CPU can cost more than a real step: the probes correct the rest)."""
NEAR_LIMIT = 0.8
"""A traced size whose peak is this fraction of the limit or more anchors the line near it; below, the predicted
size is traced too (within ``MAX_TRACES``)."""
MAX_REPLAYS = 12
"""Points of one prediction at most where each further point is a replay (about a millisecond: ``cheap()``):
enough to close a bracket around the limit on memory that curves (an in-batch similarity: batch x batch)."""
TIGHT = 1.25
"""Where points are replays, the prediction goes on until the smallest size over the limit is within this factor of
the largest within it: the line through that pair describes curved memory near the limit, where one through a
distant point (the cap) overstated it 1.8-3.3x and the verifying probes crept up to the answer in steps of 1-4%."""


@dataclass(frozen=True)
class Prediction:
    """The traced peak line and the largest size it keeps within the limit (0: not even one sample)."""

    line: PeakLine
    largest: int
    points: tuple[tuple[int, float], ...]
    """Every ``(size, traced peak)``, in the order traced."""
    phase_lines: tuple[PeakLine, ...] = ()
    """One line per phase of the step (forward, backward, the update) where the traces told them apart: the
    step's peak is the highest, and :attr:`line` is the one that binds at :attr:`largest`."""

    def predict(self, size: int) -> float:
        """The predicted peak at ``size``: the highest phase line (the line, where there are none)."""
        if not self.phase_lines:
            return self.line.predict(size)
        return max(line.predict(size) for line in self.phase_lines)

    @property
    def traced(self) -> tuple[int, ...]:
        return tuple(size for size, _ in self.points)


@dataclass
class PredictedResult(SearchResult):
    """A :class:`~retune.search.largest.SearchResult` with, per trial, the traced (uncalibrated) peak at its size."""

    predicted: list[int | None] = field(default_factory=list)
    calibration: Calibration = field(default_factory=Calibration)


def secant_line(points: Mapping[int, float], limit: float) -> PeakLine | None:
    """The line through the two traced points nearest the limit (one each side when possible): memory is
    convex in the batch size where it bends (a flat optimizer-step peak gives way to activations), so the
    points near the limit describe it there. None with fewer than two sizes."""
    if len(points) < 2:
        return None
    a, b = nearest_pair(points, limit)
    slope = (points[b] - points[a]) / (b - a)
    return PeakLine(points[a] - slope * a, slope)


def predict_largest(
    trace: Callable[[int], float],
    limit: float,
    *,
    upper: int,
    first: int,
    fixed: Callable[[], float | None] | None = None,
    max_traces: int = MAX_TRACES,
    phases: Callable[[], Mapping[int, Sequence[float]]] | None = None,
    cheap: Callable[[], bool] | None = None,
) -> Prediction:
    """The largest size the traced peak line keeps within ``limit``, from two traces where they suffice.

    The first trace is at ``first``: the search passes its cap (``max_val`` or the dataset's length), which
    a trace handles as cheaply as any size, and where memory grows with the batch, whatever the optimizer
    step's flat peak does among small sizes; when the cap fits, that is the answer. The second is where the
    first predicts the answer from ``fixed()`` (the memory that does not grow with the batch: parameters,
    their gradients and optimizer state, as known once the first trace ran), so the line is drawn near the
    limit; without ``fixed`` it is at a quarter of ``first`` (four times, when ``first`` fits). Where the
    line then extrapolates beyond twice the largest size traced (or below half the smallest), that size is
    traced too (up to ``max_traces``), and the line runs through the two traces nearest the limit.
    ``trace(size)`` is the predicted peak at ``size``;
    it may raise (the caller turns that into a fallback). With ``phases()`` (read after the traces: by traced
    size, the peak of each phase of the step, each linear in the size) a line is drawn per phase through the two
    sizes nearest the limit and the prediction is the highest: the step's peak is the highest phase's, so the
    line through its peaks at two sizes cuts across the corner where one phase overtakes another (over the true
    peak between them, by 2-5% on a small MLP after an unfreeze); the largest size keeps every phase within it.
    ``cheap()`` (read before each further point): the next point is a replay of a recorded trace, not a trace
    (:class:`~retune.search.predict_run.Replaying`); then up to :data:`MAX_REPLAYS` points close a bracket around
    the limit (the largest size within it and the smallest over it, :data:`TIGHT` apart), doubling up from a size
    far within the limit, so curved memory is read near the limit instead of along a line to the cap.

    >>> curved = lambda size: 1000 + size * size  # an in-batch similarity matrix: batch x batch
    >>> traced = predict_largest(curved, 5000, upper=4096, first=4096, fixed=lambda: 1000)
    >>> traced.largest, traced.traced   # a line from the cap: the probes then step up from 1
    (1, (4096, 1))
    >>> replayed = predict_largest(curved, 5000, upper=4096, first=4096, fixed=lambda: 1000, cheap=lambda: True)
    >>> replayed.largest, replayed.traced   # replays double up past the limit, halve to a tight bracket, and the
    ... # line through its two sizes nearest the limit (56 and 64) reads the answer
    (63, (4096, 1, 2, 4, 8, 16, 32, 64, 48, 56))
    """
    a = max(1, min(upper, first))
    peak_a = trace(a)
    if peak_a <= limit and a == upper:
        return Prediction(PeakLine(peak_a, 0.0), upper, ((a, peak_a),))
    b = max(1, a // 4) if peak_a > limit else min(upper, a * 4)
    base = None if fixed is None else fixed()
    if base is not None and peak_a > base:
        b = max(1, PeakLine(base, (peak_a - base) / a).largest_within(limit, upper))
    points: dict[int, float] = {a: peak_a}
    order = [a]
    if b != a:
        points[b] = trace(b)
        order.append(b)
    while True:
        line = secant_line(points, limit) or PeakLine(peak_a, 0.0)
        largest = line.largest_within(limit, upper)
        far = largest > 2 * max(points) or (1 <= largest < min(points) // 2)
        # memory that is not linear in the batch (an in-batch similarity matrix: batch x batch) bends the line
        # drawn from the cap: where no traced size within it is near the limit, the predicted size is traced too
        near = max((peak for peak in points.values() if peak <= limit), default=None)
        fits = max((s for s in points if points[s] <= limit), default=None)
        far = far or (near is not None and fits is not None and near < NEAR_LIMIT * limit and largest > fits)
        replays = cheap is not None and cheap()
        size = largest
        if replays and fits is not None and fits < upper:
            over = min((s for s in points if points[s] > limit), default=upper + 1)
            if over > 2 * fits:  # no bracket near the limit: the line to a far point undershoots curved memory
                grow = 2.0 if points[fits] < NEAR_LIMIT * limit else TIGHT
                size = max(largest, min(math.ceil(grow * fits), over - 1, upper))
            elif over > TIGHT * fits:  # a bracket, not yet tight: halve it
                size = (fits + over) // 2
            far = far or (over > TIGHT * fits and size not in points)
        if not far or len(points) >= (MAX_REPLAYS if replays else max_traces) or size in points or size < 1:
            break
        points[size] = trace(size)
        order.append(size)
    traced = tuple((size, points[size]) for size in order)
    lines = tuple(  # a line per phase through the two traced sizes nearest the limit, where both have them
        PeakLine(line.fixed, line.per_sample)
        for line in phase_lines(dict(phases()) if phases is not None else {}, points, limit)
    )
    if not lines:
        return Prediction(line, largest, traced)
    largest = min(phase.largest_within(limit, upper) for phase in lines)
    binding = max(lines, key=lambda phase: phase.predict(max(1, largest)))
    return Prediction(binding, largest, traced, lines)


def step_from(measured: Mapping[int, int], lo: int | None, hi: int | None, slope: float, limit: float) -> int | None:
    """The size the calibrated slope reaches from the nearest probed size: up from the largest that fit, down
    from the smallest that measured over the limit. None without a measured neighbour or a positive slope."""
    if slope <= 0:
        return None
    if lo is not None and lo in measured:
        return lo + math.floor((limit - measured[lo]) / slope)
    over = [s for s, p in measured.items() if p > limit and (hi is None or s >= hi)]
    if over:
        size = min(over)
        return size - math.ceil((measured[size] - limit) / slope)
    return None


def run_predicted_search(
    plan: SearchPlan,
    prediction: Prediction,
    measure: Callable[[int], tuple[bool, int | None]],
    limit: int,
    recheck: Callable[[int], int | None] | None = None,
) -> PredictedResult:
    """Verify the predicted largest size with real probes and correct it until the largest probed fit is the
    largest the calibrated line allows (see the module doc). ``plan`` gives the bounds, the known failure
    and the trial budget; its start is not used (the prediction is). ``recheck(size)``: a measured peak as the
    verdict reads it now (:meth:`~retune.probing.prober.Prober.checked_at`), re-read before each calibration."""
    lo: int | None = None
    hi: int | None = plan.known_fail
    measured: dict[int, int] = {}
    pairs: list[tuple[float, float]] = []
    result = PredictedResult(None, None, None)
    line = prediction.line
    calibration = Calibration()
    size: int | None = _clamp(max(1, prediction.largest), lo, hi, plan.upper)
    if size is not None and plan.max_trials == 1:
        size = last_chance(plan, size, hi)
    while size is not None:
        ok, peak = measure(size)
        result.trials.append(Trial(size, ok))
        result.peaks.append(peak)
        result.predicted.append(round(prediction.predict(size)))
        if peak is not None:
            measured[size] = peak
            pairs.append((prediction.predict(size), float(peak)))
        if recheck is not None and measured:
            for known in measured:
                measured[known] = recheck(known) or measured[known]
            pairs = [(prediction.predict(known), float(value)) for known, value in measured.items()]
        if peak is not None or recheck is not None:
            calibration = calibrate(pairs) if pairs else calibration
        if ok:
            lo = size if lo is None else max(lo, size)
        else:
            hi = size if hi is None else min(hi, size)
        if len(result.trials) >= plan.max_trials:
            if lo is not None and _next(plan, line, calibration, measured, lo, hi, limit) is not None:
                result.unsettled = open_bracket(lo, hi)
            break
        size = _next(plan, line, calibration, measured, lo, hi, limit)
        if size is not None and lo is None and len(result.trials) == plan.max_trials - 1:
            size = last_chance(plan, size, hi)  # the last trial, and nothing fit yet
    result.max_fitting, result.min_failing = lo, hi
    result.calibration = calibration
    corrected = _corrected(line, calibration)
    # the margin cuts where the calibrated line reaches the limit (never above the size that fit)
    capacity = (limit - corrected.fixed) / corrected.per_sample if corrected.per_sample > 0 else None
    result.size = None if lo is None else apply_margin(plan, lo, True, capacity)
    result.model = MemoryModel(corrected.fixed, corrected.per_sample)
    return result


def last_chance(plan: SearchPlan, candidate: int, failed: int | None) -> int:
    """The size for a search's last trial where no size has fit yet: ``candidate`` (where the calibrated line or the
    bisection goes next), but no higher than the smallest size a search without prediction reaches within
    ``max_trials``: it probes the plan's start first (``init_val``, or where a warm start resumes) and halves it at
    each failure, so it ends at ``start`` halved ``max_trials - 1`` times where nothing fits before. Nor, where
    ``failed`` (the smallest size that failed) is at or below that, higher than half of it. Whatever size such a
    search would have verified, memory that grows with the batch fits this one too, so a predicted search that would
    otherwise end with nothing fitting ends on a verified size wherever the search without prediction does (see the
    module doc); where the start fits, it ends lower than that search would (a later re-search grows it).

    Args:
        plan: the search's plan: its start and ``max_trials`` are those of a search without prediction.
        candidate: the size the predicted search would probe next.
        failed: the smallest size that failed so far (None: none did).

    >>> plan = SearchPlan(mode="binsearch", start=2, max_trials=1, margin=0.0, upper=1024)
    >>> last_chance(plan, 147, None), last_chance(plan, 1, 147), last_chance(plan, 90, 2)
    (2, 1, 1)
    >>> last_chance(SearchPlan(mode="binsearch", start=32, max_trials=3, margin=0.0, upper=1024), 50, 100)
    8
    """
    safe = max(1, plan.start >> (plan.max_trials - 1))
    if failed is not None and safe >= failed:
        safe = max(1, failed // 2)
    return max(1, min(candidate, safe))


def _corrected(line: PeakLine, calibration: Calibration) -> PeakLine:
    return PeakLine(calibration.apply(line.fixed), calibration.scale * line.per_sample)


def _next(
    plan: SearchPlan,
    line: PeakLine,
    calibration: Calibration,
    measured: Mapping[int, int],
    lo: int | None,
    hi: int | None,
    limit: int,
) -> int | None:
    if lo is not None and (lo >= plan.upper or (hi is not None and hi - lo <= 1)):
        return None
    if lo is None and hi is not None and hi <= 1:
        return None
    corrected = _corrected(line, calibration)
    slope = corrected.per_sample
    if lo is not None and lo in measured and measured[lo] + max(_slope_left_of(measured, lo, slope), 0.0) > limit:
        return None  # measured at lo, and one more sample's memory would pass the limit
    candidate = step_from(measured, lo, hi, slope, limit)
    if candidate is None and not measured:
        candidate = corrected.largest_within(limit, plan.upper)
    if candidate is None or (hi is not None and candidate >= hi):
        # no peak to step from, or the line says a size that failed fits (a real out-of-memory error left no
        # peak to correct it with): bisect the bracket
        candidate = hi // 2 if lo is None and hi is not None else (lo or 0) + ((hi or 2 * (lo or 1)) - (lo or 0)) // 2
    return _clamp(candidate, lo, hi, plan.upper)


def _slope_left_of(measured: Mapping[int, int], size: int, calibrated: float) -> float:
    """Memory one more sample adds at ``size``: the measured secant from the nearest smaller probed size when
    there is one (memory is convex where it bends, so that secant does not overstate it, and stopping on it
    never skips a size that fits), else the calibrated line's slope."""
    smaller = [s for s in measured if s < size]
    if not smaller:
        return calibrated
    nearest = max(smaller)
    return (measured[size] - measured[nearest]) / (size - nearest)


def _clamp(candidate: int, lo: int | None, hi: int | None, upper: int) -> int | None:
    """``candidate`` inside the open bracket ``(lo, hi)`` and ``1..upper``; None when the bracket is closed."""
    floor = 1 if lo is None else lo + 1
    ceiling = upper if hi is None else min(upper, hi - 1)
    if floor > ceiling:
        return None
    return max(floor, min(ceiling, candidate))
