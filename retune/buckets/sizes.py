"""Every bucket's largest batch size in about one probe each: a memory model in batch size x sample size.

A binary search per bucket would cost ``buckets x ~10`` probes at every trigger. But the buckets
are the same model on the same data, cut by length, and with pad-to-longest collation a step's peak
is close to ``fixed + batch x (per_sample + per_unit x longest)``: the fixed part (weights, gradients,
optimizer state) is shared, and the part that grows with the batch grows with the length of its
longest sample. So the search anchors on the bucket of the longest samples (two or three probes to
separate the fixed part from the per-sample part), predicts every other bucket's size from the model,
and verifies each prediction with one probe. Each probe adds a point, the model is refitted (least
squares over all points), and a bucket whose verification disagrees is corrected from its own
measured point, so memory that is not linear in the length (attention) costs a probe or two more,
never a wrong size: a size is only accepted after it was probed and fit.

Shorter samples usually need no more memory at the same batch size, so a size that fits a bucket of
longer samples is a known fit for every shorter bucket (no probe), and the result does not give a
bucket of shorter samples a smaller size than a longer one, with one exception: a size measured to
fail for a bucket is evidence, whatever the lengths predict (a sample whose memory does not follow
its length), so a bucket is never raised to or above a size that failed for it.

Without measured peaks (no budget and no device statistics) there is no model to fit; each bucket is
then searched by ``run_search`` from the known fit of the next longer bucket.

Example:
    >>> def measure(bucket, size):            # memory: 100 + size * (1 + 2 * longest)
    ...     peak = 100 + size * (1 + 2 * (16, 64, 512)[bucket])
    ...     return peak <= 20_000, peak
    >>> result = search_buckets((16, 64, 512), (4096,) * 3, measure, 20_000, start=2, max_trials=25)
    >>> result.found, len(result.trials)
    ([603, 154, 19], 6)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from retune.events import Direction
from retune.search.largest import SearchPlan, nearest_pair, run_search

Measure = Callable[[int, int], tuple[bool, "int | None"]]
"""``measure(bucket, size) -> (fits, peak)``: one probe of ``bucket``'s worst batch at ``size``."""


@dataclass(frozen=True)
class SizeModel:
    """``peak = fixed + batch x (per_sample + per_unit x longest)``, in bytes."""

    fixed: float
    per_sample: float
    per_unit: float

    def slope(self, longest: int) -> float:
        """Memory one more sample adds to a batch whose longest sample is ``longest``."""
        return self.per_sample + self.per_unit * longest

    def predict(self, size: int, longest: int) -> float:
        return self.fixed + size * self.slope(longest)

    def largest_within(self, limit: float, longest: int, upper: int) -> int:
        """The largest batch the model keeps within ``limit`` (``upper`` when memory does not grow)."""
        slope = self.slope(longest)
        if slope <= 0:
            return upper
        return int(max(0, min(upper, (limit - self.fixed) // slope)))

    def to_list(self) -> list[float]:
        return [self.fixed, self.per_sample, self.per_unit]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> SizeModel:
        return cls(float(values[0]), float(values[1]), float(values[2]))


Point = tuple[int, int, int]
"""``(batch size, longest sample, measured peak)``."""


def fit_model(points: Sequence[Point]) -> SizeModel | None:
    """The model through measured points: least squares on ``[1, b, b x s]`` over three or more points of
    two lengths or more; with one length, the line in ``b`` with the slope taken as proportional to the
    length. None with fewer than two points or no usable fit."""
    if len(points) < 2:
        return None
    lengths = {s for _, s, _ in points}
    if len(lengths) >= 2 and len(points) >= 3:
        model = _least_squares(points)
        if model is not None and model.slope(min(lengths)) > 0 and model.slope(max(lengths)) > 0:
            return model
    longest = max(lengths)
    same = sorted((b, p) for b, s, p in points if s == longest)
    if len(same) < 2 or same[0][0] == same[-1][0]:
        return None
    (b1, p1), (b2, p2) = same[0], same[-1]
    slope = (p2 - p1) / (b2 - b1)
    return SizeModel(p1 - slope * b1, 0.0, max(slope, 0.0) / max(longest, 1))


def _least_squares(points: Sequence[Point]) -> SizeModel | None:
    """Solve the 3x3 normal equations of ``peak ~ fixed + per_sample b + per_unit b s`` (no numpy needed)."""
    rows = [(1.0, float(b), float(b * s), float(p)) for b, s, p in points]
    a = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    y = [sum(r[i] * r[3] for r in rows) for i in range(3)]
    # Gaussian elimination with partial pivoting
    m = [[*row[:], y[i]] for i, row in enumerate(a)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * max(1.0, abs(m[col][col])):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(3):
            if r != col:
                factor = m[r][col] / m[col][col]
                m[r] = [x - factor * yv for x, yv in zip(m[r], m[col], strict=True)]
    fixed, per_sample, per_unit = (m[i][3] / m[i][i] for i in range(3))
    return SizeModel(fixed, per_sample, per_unit)


@dataclass(frozen=True)
class BucketTrial:
    """One probe: a bucket's worst batch at ``batch_size``, whether it fit, and its peak."""

    bucket: int
    batch_size: int
    fits: bool
    peak: int | None


@dataclass
class BucketSearchResult:
    """The largest size found to fit per bucket (None: nothing fit), and how it was found."""

    found: list[int | None]
    min_failing: list[int | None]
    trials: list[BucketTrial] = field(default_factory=list)
    memory: BucketMemory | None = None
    searched: list[int] = field(default_factory=list)
    """The buckets this search probed or re-derived (the others kept their previous size)."""
    capacity: list[float | None] = field(default_factory=list)
    """Per bucket, the batch size (a fraction) at which the line through its own measured peaks reaches the
    limit (None: not probed, or no peaks): what the margin cuts (:func:`retune.search.largest.apply_margin`)."""
    unordered: list[int] = field(default_factory=list)
    """Buckets whose own probes' line reaches the limit below the size longer samples fit at: memory did not grow
    with the sample size there (a collate that pads two dimensions apart), so they keep their own size
    (:func:`carried_down`)."""
    unsettled: list[int] = field(default_factory=list)
    """Buckets whose search ``max_trials`` cut short with a size still to probe (or before their first probe): their
    size is the largest that fit of those tried, or a longer bucket's fit, not the largest they fit."""


def search_buckets(
    largest: Sequence[int],
    uppers: Sequence[int],
    measure: Measure,
    limit: int | None,
    *,
    start: int,
    max_trials: int,
    previous: Sequence[int | None] | None = None,
    direction: Direction = "unknown",
    prior: BucketMemory | None = None,
    known_fail: Mapping[int, int] | None = None,
    known_fit: Mapping[int, int] | None = None,
    only: Sequence[int] | None = None,
    tolerance: float = 0.0,
    recheck: Callable[[int, int], int | None] | None = None,
) -> BucketSearchResult:
    """Find every bucket's largest fitting batch size (before any margin).

    ``largest[i]`` is bucket ``i``'s longest sample (ascending or not), ``uppers[i]`` its largest
    possible batch. ``previous`` (a re-tune) and ``direction`` choose the first probe of the anchor
    bucket; ``prior`` is the last search's model, used for how memory varies with length until two
    lengths are measured again. ``known_fail``/``known_fit`` are sizes known without a probe (a real
    out-of-memory step, its micro-batches); ``only`` limits the search to some buckets (the others
    keep ``previous``). ``max_trials`` bounds the probes of the whole search.

    ``tolerance`` (a fraction, 0 by default: the exact largest size) accepts a probe that fit within that
    fraction of the largest size the bucket's own measured line allows, without probing closer (the
    caller passes the schedule's margin: the precision a margin already gives up).

    ``recheck(bucket, size)``: a probe's peak as the verdict reads it now (a caching allocator's headroom can grow
    after the probe: :meth:`retune.probing.prober.Prober.checked_from`), re-read before every line is drawn.
    """
    count = len(largest)
    if len(uppers) != count:
        raise ValueError(f"{count} buckets but {len(uppers)} upper bounds")
    lo: list[int | None] = [None] * count
    hi: list[int | None] = [None] * count
    for bucket, size in (known_fail or {}).items():
        hi[bucket] = size
    for bucket, size in (known_fit or {}).items():
        lo[bucket] = size
    targets = list(range(count)) if only is None else sorted(set(only))
    result = BucketSearchResult([None] * count, [None] * count, searched=targets)
    if previous is not None:
        for bucket in range(count):
            if bucket not in targets:
                result.found[bucket] = previous[bucket]
    order = sorted(targets, key=lambda b: (-largest[b], b))  # longest samples first
    trials = result.trials
    if limit is None:
        result.unsettled = _search_without_peaks(
            order, largest, uppers, measure, start, max_trials, previous, lo, hi, trials
        )
    else:
        search = _ModelSearch(
            largest, uppers, measure, limit, start, max_trials, previous, direction, prior, lo, hi, trials, tolerance
        )
        search.recheck = recheck
        result.memory = search.run(order)
        result.capacity = [search.capacity.get(b) for b in range(count)]
        result.unordered = list(search.unordered)
        result.unsettled = search.unsettled(targets)
    # a size that fits longer samples fits shorter ones: carry the best known fit down the lengths
    best: int | None = None
    for bucket in sorted(range(count), key=lambda b: (-largest[b], b)):
        if bucket not in targets:
            kept = result.found[bucket]
            best = kept if best is None or (kept is not None and kept > best) else best
            continue
        own = lo[bucket]
        if best is not None and (own is None or own < best):
            raised = carried_down(below_failure(min(best, uppers[bucket]), hi[bucket]), result, bucket)
            own = raised if own is None or (raised is not None and raised > own) else own
        result.found[bucket] = own
        result.min_failing[bucket] = hi[bucket]
        if own is not None:
            best = own if best is None else max(best, own)
    return result


def carried_down(raised: int | None, result: BucketSearchResult, bucket: int) -> int | None:
    """``raised``, a size longer samples fit at, for ``bucket`` of shorter ones, unless its own probes' line reaches
    the limit below it (then None, and the bucket is noted in :attr:`BucketSearchResult.unordered`).

    Carrying a fit down the lengths rests on memory growing with the sample size. Where a bucket's own probes
    measured otherwise (images padded to the batch's tallest and widest apart, sized by their area: a tall and a
    wide image of one area make a batch of neither's), the longer samples' fit says nothing of it: a bucket of
    such images, measured to fit 7, was raised to 86 and trained at 11.5 times the budget.
    """
    capacity = result.capacity[bucket] if bucket < len(result.capacity) else None
    if raised is None or capacity is None or capacity >= raised:
        return raised
    if bucket not in result.unordered:
        result.unordered.append(bucket)
    return None


def below_failure(size: int, failed: int | None) -> int | None:
    """``size`` when it is below ``failed`` (a size measured to fail for the bucket), else None.

    A longer bucket's fit raises a shorter one only while no failure contradicts it: once a size at or
    below that fit failed for the bucket, its samples do not follow their length, and only its own
    measured fit is known to hold (``failed - 1`` was never measured)."""
    return size if failed is None or size < failed else None


def _record(
    trials: list[BucketTrial], measure: Measure, bucket: int, size: int, lo: list[int | None], hi: list[int | None]
) -> tuple[bool, int | None]:
    ok, peak = measure(bucket, size)
    trials.append(BucketTrial(bucket, size, ok, peak))
    if ok:
        current = lo[bucket]
        lo[bucket] = size if current is None else max(current, size)
    else:
        current = hi[bucket]
        hi[bucket] = size if current is None else min(current, size)
    return ok, peak


@dataclass(frozen=True)
class BucketMemory:
    """What a search learned: the shared fixed memory and each bucket's memory per sample.

    The next search uses it as its prior: after an unfreeze every slope changes, but their ratios to
    the anchor bucket's (how memory grows with the length) mostly do not, so one anchor line re-derives
    every bucket's prediction and each bucket costs one verifying probe.
    """

    fixed: float
    slopes: tuple[float | None, ...]
    model: SizeModel | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "fixed": self.fixed,
            "slopes": list(self.slopes),
            "model": None if self.model is None else self.model.to_list(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BucketMemory:
        model = data.get("model")
        return cls(
            float(data.get("fixed") or 0.0),
            tuple(None if v is None else float(v) for v in data.get("slopes") or []),
            None if model is None else SizeModel.from_list(model),
        )


class _ModelSearch:
    """The probes of one search with peaks: anchor on the longest bucket, then one bucket after another."""

    def __init__(
        self,
        largest: Sequence[int],
        uppers: Sequence[int],
        measure: Measure,
        limit: int,
        start: int,
        max_trials: int,
        previous: Sequence[int | None] | None,
        direction: Direction,
        prior: BucketMemory | None,
        lo: list[int | None],
        hi: list[int | None],
        trials: list[BucketTrial],
        tolerance: float = 0.0,
    ) -> None:
        self.largest, self.uppers, self.measure, self.limit = largest, uppers, measure, limit
        self.start, self.max_trials, self.previous, self.direction = start, max_trials, previous, direction
        self.prior = prior if prior is not None and len(prior.slopes) == len(largest) else None
        self.lo, self.hi, self.trials = lo, hi, trials
        self.tolerance = tolerance
        self.points: list[Point] = []
        self.measured: list[int] = []  # the bucket of each point
        self.recheck: Callable[[int, int], int | None] | None = None
        self.own: dict[int, dict[int, int]] = {b: {} for b in range(len(largest))}
        self.fixed: float | None = None
        self.slopes: dict[int, float] = {}
        self.anchor: int | None = None
        self.capacity: dict[int, float] = {}
        self.unordered: list[int] = []
        """Buckets whose own probes' line contradicted the longer buckets' fit they started from."""

    def run(self, order: list[int]) -> BucketMemory | None:
        # the anchor (longest samples) first, then the shortest (later buckets interpolate between the
        # two lengths instead of extrapolating), then the rest from long to short
        if len(order) > 2:
            order = [order[0], order[-1], *order[1:-1]]
        done: list[int] = []
        for bucket in order:
            if self.anchor is None:
                self.anchor = bucket
            self._bound_by(bucket, done)
            carried = self.lo[bucket] if self.lo[bucket] not in self.own[bucket] else None
            self._probe(bucket)
            if carried is not None and self.lo[bucket] == carried and carried not in self.own[bucket]:
                # the longer buckets' fit it started from, never its own: where its own probes' line reaches the
                # limit below it, memory did not grow with the sample size here (see carried_down)
                capacity = self._capacity(bucket)
                if capacity is not None and capacity < carried:
                    self.unordered.append(bucket)
                    fits = [s for s, peak in self.own[bucket].items() if peak <= self.limit]
                    self.lo[bucket] = max(fits) if fits else None
                    self._probe(bucket)  # on its own line, below what it measured to fail
            line = self._own_line(bucket)
            if line is not None and bucket == self.anchor and self.fixed is None:
                self.fixed = line[0]
            measured = self._measured_slope(bucket)
            if measured is not None and measured > 0:
                self.slopes[bucket] = measured
            capacity = self._capacity(bucket)
            if capacity is not None:
                self.capacity[bucket] = capacity
            done.append(bucket)
        if self.fixed is None:
            return self.prior
        slopes = tuple(self.slopes.get(b) for b in range(len(self.largest)))
        return BucketMemory(self.fixed, slopes, fit_model(self.points))

    def unsettled(self, buckets: Sequence[int]) -> list[int]:
        """Of ``buckets``, those with a size still to probe once the trials ran out (none where they did not)."""
        if len(self.trials) < self.max_trials:
            return []
        return sorted(b for b in buckets if self._next(b) is not None)

    def _capacity(self, bucket: int) -> float | None:
        """The batch size (a fraction) at which the line through ``bucket``'s own measured peaks reaches the limit
        (None: no peak of its own, or a line that does not grow)."""
        line = self._own_line(bucket) if self.own[bucket] else None
        return (self.limit - line[0]) / line[1] if line is not None and line[1] > 0 else None

    def _probe(self, bucket: int) -> None:
        """Probe ``bucket`` until its size is found or the search's trials run out."""
        while len(self.trials) < self.max_trials:
            size = self._next(bucket)
            if size is None:
                break
            _, peak = _record(self.trials, self.measure, bucket, size, self.lo, self.hi)
            if peak is not None:
                self.points.append((size, self.largest[bucket], peak))
                self.measured.append(bucket)
                self.own[bucket][size] = peak
            self._reread()

    def _reread(self) -> None:
        """Every point as the verdict reads it now (:attr:`recheck`)."""
        if self.recheck is None:
            return
        for i, bucket in enumerate(self.measured):
            size, longest, peak = self.points[i]
            now = self.recheck(bucket, size)
            if now is not None and now != peak:
                self.points[i] = (size, longest, now)
                self.own[bucket][size] = now

    def _bound_by(self, bucket: int, done: list[int]) -> None:
        """What the searched buckets say without a probe: a size that fit longer samples fits, and a size
        that failed shorter samples fails."""
        s, upper = self.largest[bucket], self.uppers[bucket]
        fits = [f for b in done if self.largest[b] >= s and (f := self.lo[b]) is not None]
        fails = [f for b in done if self.largest[b] <= s and (f := self.hi[b]) is not None]
        current = self.hi[bucket]
        if fails and (current is None or current > min(fails)):
            self.hi[bucket] = min(fails)
        current = self.lo[bucket]
        if fits and (current is None or current < max(fits)):
            fit = min(max(fits), upper)
            failed = self.hi[bucket]
            if failed is None or fit < failed:  # a size measured to fail here outweighs the longer buckets' fit
                self.lo[bucket] = fit

    def _own_line(self, bucket: int) -> tuple[float, float] | None:
        """``(intercept, slope)`` of this bucket's memory in the batch size, from what is known now."""
        own = self.own[bucket]
        if len(own) >= 2:
            (b1, p1), (b2, p2) = _nearest_pair(own, self.limit)
            if b2 != b1 and p2 > p1:
                slope = (p2 - p1) / (b2 - b1)
                return p1 - slope * b1, slope
        if len(own) == 1:
            (b, p) = next(iter(own.items()))
            if self.fixed is not None and p > self.fixed:
                return self.fixed, (p - self.fixed) / b
            predicted = self._predicted_slope(bucket)
            if predicted is not None:
                return p - predicted * b, predicted
            return None
        predicted = self._predicted_slope(bucket)
        if predicted is None or self.fixed is None:
            return None
        return self.fixed, predicted

    def _predicted_slope(self, bucket: int) -> float | None:
        """Memory per sample of a bucket not measured yet in this search.

        After a re-tune's first buckets: its last measured slope, times how much the slopes of the buckets
        measured so far changed, interpolated over the length (an unfreeze adds memory that grows with
        the tokens, so the change differs between short and long samples). Else the slopes measured so
        far, interpolated over the length; else the model fitted over every point; else proportional to
        the longest sample.
        """
        anchor = self.anchor
        prior = self.prior
        old = prior.slopes[bucket] if prior is not None else None
        if prior is not None and old is not None:
            changes = [
                (self.largest[b], now / was)
                for b, now in self.slopes.items()
                if (was := prior.slopes[b]) is not None and was > 0 and now > 0
            ]
            if changes:
                return old * _interpolate(changes, self.largest[bucket])
            if bucket == anchor and self.direction != "down":
                return old  # same memory as last time until a second point says otherwise
        measured = [(self.largest[b], slope) for b, slope in self.slopes.items()]
        if len({x for x, _ in measured}) >= 2:
            return _interpolate(measured, self.largest[bucket])  # between the lengths measured so far
        model = fit_model(self.points)
        lengths = {s for _, s, _ in self.points}
        if model is not None and len(lengths) >= 2 and model.slope(self.largest[bucket]) > 0:
            return model.slope(self.largest[bucket])
        anchor_slope = self.slopes.get(anchor) if anchor is not None else None
        if anchor_slope is not None and anchor is not None and self.largest[anchor] > 0:
            return anchor_slope * self.largest[bucket] / self.largest[anchor]
        return None

    def _measured_slope(self, bucket: int) -> float | None:
        """The bucket's memory per sample from its own probes: through the shared fixed memory and its
        largest fitting point (the anchor: its line's slope). None when it was not probed."""
        own = self.own[bucket]
        if not own:
            return None
        line = self._own_line(bucket)
        if bucket == self.anchor or self.fixed is None:
            return None if line is None else line[1]
        fitting = [b for b, p in own.items() if p <= self.limit]
        size = max(fitting) if fitting else min(own)
        peak = own[size]
        if peak <= self.fixed:
            return None if line is None else line[1]
        return (peak - self.fixed) / size

    def _next(self, bucket: int) -> int | None:
        lo, hi, upper = self.lo[bucket], self.hi[bucket], self.uppers[bucket]
        if lo is not None and (lo >= upper or (hi is not None and hi - lo <= 1)):
            return None
        if hi is not None and hi <= 1 and lo is None:
            return None
        own = self.own[bucket]
        line = self._own_line(bucket)
        if line is None:
            candidate = self._first_sizes(bucket)
        else:
            intercept, slope = line
            if lo is not None and lo in own and own[lo] + slope > self.limit:
                return None  # measured at lo, and one more sample would pass the limit
            predicted = int((self.limit - intercept) // slope) if slope > 0 else upper
            if lo is not None and lo in own and lo >= min(predicted, upper) * (1 - self.tolerance):
                return None  # measured at lo, within the tolerance of the largest its own line allows
            top = min(predicted, upper if hi is None else hi - 1)  # at the cap a size is not cut: probe it
            cut = self.tolerance
            capacity = (self.limit - intercept) / slope if slope > 0 else float(upper)
            if lo is not None and lo in own and lo < top < upper and slope > 0 and _cut(capacity, cut) <= lo:
                return None  # the margin cuts the largest size the line allows to lo or below: lo is used
            candidate = predicted
            if not own and self.tolerance > 0:
                # a prediction from other buckets: aim at the middle of the tolerance band, so a prediction
                # that errs by less than half the tolerance either way is accepted with this one probe
                candidate = max(1, int(predicted * (1 - self.tolerance / 2)))
            if lo is not None and candidate <= lo:
                candidate = lo + 1
        if hi is not None and candidate >= hi:
            candidate = (hi // 2) if lo is None else (lo + hi) // 2
        floor = 1 if lo is None else lo + 1
        ceiling = upper if hi is None else min(upper, hi - 1)
        candidate = max(floor, min(ceiling, candidate))
        if candidate in own or candidate in (lo, hi):
            if lo is None or hi is None:
                return None
            candidate = (lo + hi) // 2
            if candidate in (lo, hi) or candidate in own:
                return None
        return candidate

    def _first_sizes(self, bucket: int) -> int:
        """Where to probe before a line exists (the anchor's first probes)."""
        own = self.own[bucket]
        if own:  # one point and nothing to draw a line with: step as a cold search would
            size, peak = max(own.items())
            return size * 4 if peak <= self.limit else max(1, size // 2)
        before = self.previous[bucket] if self.previous is not None else None
        if before is None:
            lo = self.lo[bucket]
            return self.start if lo is None else lo * 2
        if self.direction == "down":
            return max(1, before // 4)  # the old size most likely fails now, and a real OOM leaves no peak
        return before


def _interpolate(points: list[tuple[int, float]], x: int) -> float:
    """Piecewise-linear ``y(x)`` through ``(x, y)`` points, constant beyond the ends."""
    ordered = sorted(points)
    if x <= ordered[0][0]:
        return ordered[0][1]
    if x >= ordered[-1][0]:
        return ordered[-1][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(ordered):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ordered[-1][1]  # pragma: no cover - the loop covers every x inside the range


def _cut(capacity: float, margin: float) -> int:
    """The size the schedule's margin leaves of ``capacity`` (the fractional size at which the measured line
    reaches the limit), as :func:`retune.search.largest.apply_margin` cuts it: probing above the size it gives
    cannot change the size used."""
    return max(1, int(capacity * (1 - margin)))


def length_curve(points: Sequence[tuple[int, float]], x: int) -> float:
    """Memory per sample at longest sample ``x`` from ``(longest, per-sample)`` points of traced buckets.

    Through three lengths or more: the parabola through the shortest, a middle and the longest (exact where
    per-sample memory is ``a + b x + c x^2``, as with attention, whose scores grow with the square of the
    length; a line between the points overstates the buckets between them, by 20-38% on the issue-29
    BERT), where it is positive; else, and with two lengths, piecewise-linear (:func:`_interpolate`).
    Constant beyond the ends.

    >>> round(length_curve([(10, 1 + 10 + 100), (20, 1 + 20 + 400), (40, 1 + 40 + 1600)], 30))
    931
    """
    ordered = sorted(dict(points).items())
    if len(ordered) >= 3 and ordered[0][0] < x < ordered[-1][0]:
        (x0, y0), (x2, y2) = ordered[0], ordered[-1]
        x1, y1 = ordered[len(ordered) // 2]
        value = (
            y0 * (x - x1) * (x - x2) / ((x0 - x1) * (x0 - x2))
            + y1 * (x - x0) * (x - x2) / ((x1 - x0) * (x1 - x2))
            + y2 * (x - x0) * (x - x1) / ((x2 - x0) * (x2 - x1))
        )
        if value > 0:
            return value
    return _interpolate(list(ordered), x)


def shifted_curve(
    before: Sequence[tuple[int, float]], ends: Sequence[tuple[int, float]], middle: int
) -> tuple[tuple[int, float], ...] | None:
    """A new per-sample curve from the last traced one and two newly traced lengths: ``ends`` (the shortest
    and the longest bucket now) and the curve ``before`` give the change at two lengths, the change is taken as
    ``a x + b x^2`` (what unfreezing layers adds: activations saved per token, and per pair of tokens where
    attention saves its scores; it is zero for an empty sample), and the point at ``middle`` is the old
    curve plus that change. A search after the first thus traces two lengths, not three (on the issue-29
    BERT, within 2.3% of tracing the middle too), where the fit's replays did not match its traces (else it
    traces one and replays the others: :mod:`retune.prediction.replay`). None when the two lengths are one, or
    the point would not be positive (trace it instead).

    >>> old = [(10, 2.0 + 10), (20, 2.0 + 20), (40, 2.0 + 40)]         # frozen: a + x
    >>> new = [(10, 2.0 + 10 + 30 + 1), (40, 2.0 + 40 + 120 + 16)]       # unfrozen: + 3x + x^2 / 100
    >>> [(x, round(y, 3)) for x, y in shifted_curve(old, new, 20)]
    [(10, 43.0), (20, 86.0), (40, 178.0)]
    """
    (x0, y0), (x2, y2) = sorted(ends)[0], sorted(ends)[-1]
    if not 0 < x0 < middle < x2:
        return None
    d0, d2 = y0 - length_curve(before, x0), y2 - length_curve(before, x2)
    # a x + b x^2 through (x0, d0) and (x2, d2)
    det = x0 * x2 * x2 - x2 * x0 * x0
    a = (d0 * x2 * x2 - d2 * x0 * x0) / det
    b = (x0 * d2 - x2 * d0) / det
    y1 = length_curve(before, middle) + a * middle + b * middle * middle
    if y1 <= 0:
        return None
    return ((x0, y0), (middle, y1), (x2, y2))


def _nearest_pair(own: Mapping[int, int], limit: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two measured points nearest the limit (one each side when possible), smaller size first."""
    first, second = sorted(nearest_pair(own, limit))
    return (first, own[first]), (second, own[second])


def _search_without_peaks(
    order: list[int],
    largest: Sequence[int],
    uppers: Sequence[int],
    measure: Measure,
    start: int,
    max_trials: int,
    previous: Sequence[int | None] | None,
    lo: list[int | None],
    hi: list[int | None],
    trials: list[BucketTrial],
) -> list[int]:
    """Per bucket, the fits-only search from the longer bucket's fit (or the previous size); returns the buckets
    whose search the trials ran out on (:attr:`BucketSearchResult.unsettled`)."""
    carried: int | None = None
    unsettled: list[int] = []
    for position, bucket in enumerate(order):
        left = max_trials - len(trials)
        if left <= 0:
            # a bucket not reached has something to probe, unless a longer bucket's fit already reaches its cap
            unsettled.extend(b for b in order[position:] if not (carried and carried >= uppers[b] and hi[b] is None))
            break
        upper = uppers[bucket]
        before = previous[bucket] if previous is not None else None
        first = before or (carried * 2 if carried else start)
        first = max(1, min(upper, first))
        if carried is not None and first <= carried and carried < upper:
            first = min(upper, carried + 1)
        known = hi[bucket]
        if known is not None and first >= known:  # the previous size failed since (a real step): start below it
            first = max(1, known - 1)
        known = known if known is not None and known > first else None
        plan = SearchPlan("binsearch", first, left, 0.0, upper, known_fail=known)

        def fits(size: int, bucket: int = bucket) -> bool:
            return _record(trials, measure, bucket, size, lo, hi)[0]

        if run_search(plan, fits).unsettled:
            unsettled.append(bucket)
        found = lo[bucket]
        if carried is not None and (found is None or found < carried):
            raised = below_failure(min(carried, upper), hi[bucket])
            lo[bucket] = raised if found is None or (raised is not None and raised > found) else found
        found = lo[bucket]
        if found is not None:
            carried = found if carried is None else max(carried, found)
    return sorted(unsettled)


__all__ = [
    "BucketMemory",
    "BucketSearchResult",
    "BucketTrial",
    "SizeModel",
    "below_failure",
    "carried_down",
    "fit_model",
    "length_curve",
    "shifted_curve",
    "search_buckets",
]
