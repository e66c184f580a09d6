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

from collections.abc import Sequence

from retune.buckets.sizes import Point, SizeModel, fit_model
from retune.prediction.line import Calibration, PeakLine, calibrate, fit_line

__all__ = ["Calibration", "PeakLine", "calibrate", "fit_buckets", "fit_line"]


def fit_buckets(points: Sequence[Point]) -> SizeModel | None:
    """The bucketed search's memory model (``fixed + size x (per_sample + per_unit x longest)``) through
    traced ``(size, longest, peak)`` points: :func:`retune.buckets.sizes.fit_model`, so a predicted model
    and a probed one are the same kind of object. None where that fit has too few points."""
    return fit_model(points)
