"""What a search needs from traces: a peak line in the batch size, per bucket a plane in batch x sample
size, and the correction of predicted to measured from real probes. Pure functions, no torch.

A step's peak is affine in the batch size for the models retune serves (fixed: weights, gradients,
optimizer state; per sample: activations and their temporaries), so traces at a few sizes give
:class:`PeakLine` by least squares, and the largest size under a limit follows. With buckets the
per-sample part grows with the bucket's longest sample: points ``(size, longest, peak)`` from traces
of each bucket's own batch give :class:`retune.buckets.sizes.SizeModel`, the model the bucketed search
already fits from real probes (:func:`fit_buckets` is its fit, fed with traced points).

A trace predicts the allocator-free tensor bytes; a real probe measures what the device reports (on
CUDA: allocator rounding, library workspaces; a compiled step may need less). :func:`calibrate` fits
``measured ~ scale x predicted + offset`` from (predicted, measured) pairs of real probes. Two or more
pairs at different predictions give the least-squares line. One pair cannot tell a constant error
(a workspace) from a proportional one (rounding, fusion), so it gives the one of the two exact
corrections that predicts *more* above the probed size, where a search looks next: the scale when
the probe measured more than predicted, the offset when it measured less (both pass through the pair;
above it, ``x*m/p >= x+m-p`` when ``m > p``, and the reverse when ``m < p``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from retune.buckets.sizes import Point, SizeModel, fit_model

__all__ = ["Calibration", "PeakLine", "calibrate", "fit_buckets", "fit_line"]


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


def fit_buckets(points: Sequence[Point]) -> SizeModel | None:
    """The bucketed search's memory model (``fixed + size x (per_sample + per_unit x longest)``) through
    traced ``(size, longest, peak)`` points: :func:`retune.buckets.sizes.fit_model`, so a predicted model
    and a probed one are the same kind of object. None where that fit has too few points."""
    return fit_model(points)


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
