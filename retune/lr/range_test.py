"""The learning-rate range test as pure logic: the sweep, the smoothing, divergence and the suggestion.

A range test trains for a few steps while the learning rate grows from ``min_lr`` to ``max_lr``
(Smith, 2017, "Cyclical Learning Rates"; Lightning's ``LearningRateFinder``; fastai's ``lr_find``).
The loss first barely moves (the rate is too small to matter), then falls, then rises as the rate
becomes too large. This module turns the recorded losses into one suggested rate; the Lightning
glue (:mod:`retune.lr.probe`) runs the steps and restores the run.

No Lightning or torch import: everything here is tested on plain lists.

Suggestion methods (``lr_find.suggestion``), each on the bias-corrected exponential moving average
of the loss (``smoothing``), with the first ``skip_begin`` and last ``skip_end`` points ignored:

* ``valley`` (default): fastai's default since 2021. Find the longest stretch over which the
  smoothed loss keeps decreasing (the longest decreasing subsequence), and take the rate
  halfway into it (fastai's ``1/3 + 1/6``): well inside the region where training makes progress, away
  from its noisy start and from the cliff at its end. It looks at the whole curve, so one noisy
  point cannot move it far.
* ``steepest``: Lightning's method, the point where the smoothed loss falls fastest. Lightning takes
  the gradient with respect to the learning rate itself; on an exponential sweep the points are
  crowded at small rates, where a little noise between two nearly equal rates reads as a huge slope,
  so it often lands orders of magnitude too low (7.6e-6 on the problem issue 23 describes). retune
  takes the gradient with respect to ``log(lr)`` on an exponential sweep (the axis the sweep is
  uniform in, and the one every range-test plot uses); on a linear sweep both are the same.
* ``min_div10``: the rate at the lowest smoothed loss, divided by 10 (fastai's former default):
  the minimum sits just before divergence, and a tenth of it is a conservative rate that still
  trains.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

SweepMode = Literal["exponential", "linear"]
SuggestionMethod = Literal["valley", "steepest", "min_div10"]
GroupSpec = str | tuple[int, ...]


def sweep_lrs(min_lr: float, max_lr: float, steps: int, mode: SweepMode) -> list[float]:
    """The learning rate of each step: ``steps`` rates from ``min_lr`` to ``max_lr`` inclusive.

    Example:
        >>> [round(lr, 12) for lr in sweep_lrs(1e-3, 1.0, 4, "exponential")]
        [0.001, 0.01, 0.1, 1.0]
        >>> sweep_lrs(0.0, 1.0, 3, "linear")
        [0.0, 0.5, 1.0]
    """
    if steps < 2:
        raise ValueError(f"a range test needs at least 2 steps, got {steps}")
    if not max_lr > min_lr:
        raise ValueError(f"max_lr ({max_lr}) must be greater than min_lr ({min_lr})")
    last = steps - 1
    if mode == "linear":
        return [min_lr + (max_lr - min_lr) * i / last for i in range(steps)]
    if min_lr <= 0:
        raise ValueError(f"an exponential sweep needs min_lr > 0, got {min_lr}")
    ratio = max_lr / min_lr
    rates = [min_lr * ratio ** (i / last) for i in range(steps)]
    rates[-1] = max_lr  # exactly, not max_lr * (1 +- 1 ulp)
    return rates


def smooth(losses: Sequence[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average, as Lightning's and fastai's range tests compute it.

    A non-finite loss makes every later smoothed value non-finite too, which is what it means: the
    run has diverged. ``beta=0`` returns the losses unchanged.
    """
    out: list[float] = []
    average = 0.0
    for i, loss in enumerate(losses):
        average = beta * average + (1 - beta) * loss
        out.append(average / (1 - beta ** (i + 1)))
    return out


def diverged(smoothed: float, best: float, threshold: float | None) -> bool:
    """Whether the range test should stop: the smoothed loss is not finite, or above ``threshold`` x the best.

    A best loss at or below zero (a loss that can go negative, a log-likelihood) cannot be
    multiplied into a bound; then only a non-finite loss stops the test.
    """
    if not math.isfinite(smoothed):
        return True
    if threshold is None or best <= 0 or not math.isfinite(best):
        return False
    return smoothed > threshold * best


@dataclass
class RangeTest:
    """The state of one range test while it runs: feed each step's loss to :meth:`record`.

    ``record`` answers whether to stop. The first ``min_steps`` steps never stop on the threshold
    (Lightning waits two steps: the first smoothed values are single losses), but a non-finite loss
    always stops.

    The threshold applies to the larger of the lowest smoothed loss and the smoothed loss when the
    threshold starts to apply (step ``min_steps``). Lightning and fastai use the lowest alone, which
    suits a test at fit start, where the loss falls far below where it began. Mid-run, after an
    unfreeze, the loss is near its floor already and one batch can be several times another: 4x the
    lowest value is then batch noise, and such a test "diverged" after a dozen steps at 1e-7
    (measured on the BERT benchmark, both Lightning's and the first version of this one). The loss
    rising to 4x where the test started is divergence in both situations.
    """

    lrs: list[float]
    beta: float = 0.98
    threshold: float | None = 4.0
    min_steps: int = 2
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    stopped_early: bool = False
    _average: float = 0.0
    _best: float = math.inf
    _start: float = 0.0

    def record(self, loss: float) -> bool:
        """Add the loss of the step run at ``lrs[len(losses)]``; True when the test should stop."""
        i = len(self.losses)
        self.losses.append(loss)
        self._average = self.beta * self._average + (1 - self.beta) * loss
        value = self._average / (1 - self.beta ** (i + 1))
        self.smoothed.append(value)
        if math.isfinite(value):
            self._best = min(self._best, value)
        if i == self.min_steps:
            self._start = value
        reference = max(self._best, self._start)
        stop = not math.isfinite(value) or (i >= self.min_steps and diverged(value, reference, self.threshold))
        if stop and i + 1 < len(self.lrs):
            self.stopped_early = True
        return stop or i + 1 >= len(self.lrs)

    @property
    def tested_lrs(self) -> list[float]:
        return self.lrs[: len(self.losses)]

    @property
    def steps_run(self) -> int:
        return len(self.losses)


@dataclass(frozen=True)
class Suggestion:
    """The suggested rate and the index of the curve point it comes from (for the plot)."""

    lr: float
    index: int
    """Index into the test's steps of the point the method picked (``min_div10``: the minimum)."""


def suggest(
    lrs: Sequence[float],
    smoothed: Sequence[float],
    method: SuggestionMethod = "valley",
    skip_begin: int = 10,
    skip_end: int = 1,
    log_scale: bool = True,
) -> Suggestion | None:
    """One learning rate from a range test's curve, or None when too few finite points remain.

    ``log_scale`` says the sweep was exponential (``steepest`` then differentiates in ``log(lr)``).
    Points with a non-finite smoothed loss are dropped first; then ``skip_begin`` from the start and
    ``skip_end`` from the end of what remains, as Lightning skips them.
    """
    if len(lrs) != len(smoothed):
        raise ValueError(f"{len(lrs)} learning rates but {len(smoothed)} losses")
    finite = [i for i, value in enumerate(smoothed) if math.isfinite(value)]
    kept = finite[skip_begin : len(finite) - skip_end if skip_end else None]
    if len(kept) < 2:
        return None
    xs = [math.log(lrs[i]) if log_scale else lrs[i] for i in kept]
    ys = [smoothed[i] for i in kept]
    if method == "steepest":
        slopes = _gradient(xs, ys)
        best = min(range(len(slopes)), key=lambda k: slopes[k])
        return Suggestion(lrs[kept[best]], kept[best])
    if method == "min_div10":
        best = min(range(len(ys)), key=lambda k: ys[k])
        return Suggestion(lrs[kept[best]] / 10, kept[best])
    if method == "valley":
        position = _valley(ys)
        return Suggestion(lrs[kept[position]], kept[position])
    raise ValueError(f"unknown suggestion method {method!r}")


def _gradient(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    """``dy/dx`` at every point: one-sided at the ends, second-order central differences inside
    (for unevenly spaced points, as ``numpy.gradient`` / ``torch.gradient`` compute it)."""
    n = len(xs)
    out = [0.0] * n
    out[0] = (ys[1] - ys[0]) / _nonzero(xs[1] - xs[0])
    out[-1] = (ys[-1] - ys[-2]) / _nonzero(xs[-1] - xs[-2])
    for i in range(1, n - 1):
        h0 = _nonzero(xs[i] - xs[i - 1])
        h1 = _nonzero(xs[i + 1] - xs[i])
        out[i] = (h0**2 * ys[i + 1] + (h1**2 - h0**2) * ys[i] - h1**2 * ys[i - 1]) / (h0 * h1 * (h0 + h1))
    return out


def _nonzero(value: float) -> float:
    return value if value != 0 else 1e-300


def _valley(ys: Sequence[float]) -> int:
    """fastai's ``valley``: the longest decreasing run of the curve, and a point 1/2 of the way into it.

    ``lds[i]`` is the length of the longest strictly decreasing subsequence ending at ``i``; the
    valley runs from its start to the point where that length is largest, and the suggestion sits
    ``sections + sections/2`` points in, with ``sections`` a third of the valley (fastai's choice).
    """
    n = len(ys)
    lds = [1] * n
    max_start = max_end = 0
    for i in range(1, n):
        for j in range(i):
            if ys[i] < ys[j] and lds[i] < lds[j] + 1:
                lds[i] = lds[j] + 1
        if lds[max_end] < lds[i]:
            max_end = i
            max_start = max_end - lds[max_end]
    sections = (max_end - max_start) / 3
    return min(n - 1, max(0, max_start + int(sections) + int(sections / 2)))


# -- which param groups a test tunes ------------------------------------------------------------


@dataclass(frozen=True)
class GroupInfo:
    """What group selection needs to know about one param group: its parameters and which train."""

    params: frozenset[str]
    trainable: frozenset[str]


def new_groups(before: Sequence[GroupInfo] | None, after: Sequence[GroupInfo]) -> list[int]:
    """Indices of the groups that hold a parameter that is new to the optimizer or newly trainable.

    ``before`` is the optimizer as the last epoch start saw it (None: nothing seen yet, every group
    is new). A parameter counts as new when no group held it before (``BackboneFinetuning`` and
    finetuning-scheduler add groups; Flash extends group 0) or when it held it frozen (a group
    added up front, unfrozen later).
    """
    if before is None:
        return list(range(len(after)))
    seen = frozenset().union(*(g.params for g in before))
    trained = frozenset().union(*(g.trainable for g in before))
    return [i for i, group in enumerate(after) if (group.params - seen) or (group.trainable - trained)]


def select_groups(spec: GroupSpec, n_groups: int, new: Sequence[int], fit_start: bool) -> list[int]:
    """The groups one range test tunes.

    ``"all"`` is every group, a tuple is those indices (each must exist), at fit start as at any other
    trigger: a list keeps the other groups' configured (discriminative) rates. ``"new"`` is the groups
    holding new or newly trainable parameters; at fit start, or when the trigger added none (an epoch
    milestone: there is no "new" to prefer), every group.
    """
    everything = list(range(n_groups))
    if spec == "all":
        return everything
    if spec == "new":
        return list(new) if new and not fit_start else everything
    if isinstance(spec, str):
        raise ValueError(f"unknown group selection {spec!r}; use 'new', 'all' or a list of group indices")
    missing = [i for i in spec if not 0 <= i < n_groups]
    if missing:
        raise ValueError(f"lr_find.groups lists {missing}, but the optimizer has {n_groups} param groups")
    return sorted(set(spec))


__all__ = [
    "GroupInfo",
    "GroupSpec",
    "RangeTest",
    "Suggestion",
    "SuggestionMethod",
    "SweepMode",
    "diverged",
    "new_groups",
    "select_groups",
    "smooth",
    "suggest",
    "sweep_lrs",
]
