"""The peak line in the batch size and the calibration of predicted to measured peaks. Pure, no torch.

Apart from :mod:`retune.prediction.fit` (which adds the bucketed model) so that the search's
predict-then-verify (:mod:`retune.search.predicted`) uses them without reaching the buckets' package,
which implements a seam of the search. See :mod:`retune.prediction.fit` for what they model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Calibration", "PeakLine", "calibrate", "fit_line"]


@dataclass(frozen=True)
class PeakLine:
    """``peak = fixed + per_sample x size``, in bytes."""

    fixed: float
    per_sample: float

    def predict(self, size: int) -> float:
        return self.fixed + self.per_sample * size

    def largest_within(self, limit: float, upper: int) -> int:
        """The largest size in ``1..upper`` whose predicted peak is at most ``limit`` (0 if none is)."""
        if self.predict(1) > limit:
            return 0
        if self.per_sample <= 0:
            return upper
        return max(0, min(upper, math.floor((limit - self.fixed) / self.per_sample)))


def fit_line(points: Sequence[tuple[int, float]]) -> PeakLine:
    """Least squares through ``(size, peak)`` points; needs two distinct sizes (``ValueError`` otherwise)."""
    sizes = {size for size, _ in points}
    if len(sizes) < 2:
        raise ValueError(f"a peak line needs traces at two different sizes or more, got sizes {sorted(sizes)}")
    intercept, slope = _least_squares([(float(size), float(peak)) for size, peak in points])
    return PeakLine(intercept, slope)


def _least_squares(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line; the x values must not all be equal."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    slope = sxy / sxx
    return mean_y - slope * mean_x, slope


@dataclass(frozen=True)
class Calibration:
    """``measured ~ scale x predicted + offset``."""

    scale: float = 1.0
    offset: float = 0.0

    def apply(self, predicted: float) -> float:
        return self.scale * predicted + self.offset


def calibrate(pairs: Sequence[tuple[float, float]]) -> Calibration:
    """The correction of predicted to measured peaks from real probes' ``(predicted, measured)`` pairs
    (see the module doc for one pair). No pairs: the identity. Pairs all at one prediction: as one pair
    through their mean."""
    if not pairs:
        return Calibration()
    predictions = {predicted for predicted, _ in pairs}
    if len(predictions) == 1:
        predicted = pairs[0][0]
        measured = sum(m for _, m in pairs) / len(pairs)
        if predicted <= 0:
            return Calibration(1.0, measured - predicted)
        if measured >= predicted:
            return Calibration(measured / predicted, 0.0)
        return Calibration(1.0, measured - predicted)
    offset, scale = _least_squares([(float(p), float(m)) for p, m in pairs])
    return Calibration(scale, offset)
