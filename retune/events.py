"""What a search did, as plain records: kept in ``callback.history``, in checkpoints and in JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple

Direction = Literal["down", "up", "unknown"]
"""Which way a warm search moves from the current size: ``down`` after more parameters became
trainable (each step needs more memory), ``up`` after fewer, ``unknown`` when the trigger cannot tell.
Triggers answer it; the searches start from it."""


class Trial(NamedTuple):
    """One candidate size and whether a real training step at that size fit in memory."""

    batch_size: int
    fits: bool


@dataclass(frozen=True)
class RetuneEvent:
    """One search (or one recovered out-of-memory step): when it ran, why, and what it found.

    ``trigger`` is the kind that fired (several joined by ``"+"``, e.g. ``"epoch+trainable_params_changed"``).
    ``trials`` are in the order tried. ``direction`` is ``"cold"`` for a search from ``init_val`` (fit
    start, or no earlier result), else what the trigger implied for the warm start: ``"down"`` after more
    parameters became trainable, ``"up"`` after fewer, ``"unknown"`` otherwise.
    """

    epoch: int
    """The epoch at whose start the search ran (or in which the recovered step ran)."""
    global_step: int
    """Optimizer steps taken when it ran."""
    trigger: str
    """The trigger kind that fired; several firing together are joined by ``+``
    (``epoch+trainable_params_changed``)."""
    stage: str
    """``train``, ``val``, ``test`` or ``predict``: whose batch size was searched."""
    batch_size_before: int
    """The stage's batch size before the search."""
    batch_size_after: int
    """The batch size the search applied (the same as before for a recovered step)."""
    trials: list[Trial] = field(default_factory=list)
    """The sizes probed, in the order tried, each with whether a real step at that size fit."""
    duration_s: float = 0.0
    """Wall-clock seconds the search took, probes and state restores included."""
    direction: str = "unknown"
    """``cold`` for a search from ``init_val``, else what the trigger implied for the warm start: ``down``,
    ``up`` or ``unknown``."""
    max_fitting: int | None = None
    """The largest size that fit in this search (None: none fit)."""
    min_failing: int | None = None
    """The smallest size that failed in this search (None: none failed)."""
    peak_bytes: list[int | None] = field(default_factory=list)
    """Measured peak memory of each trial, in the order of ``trials`` (None where not measurable)."""
    budget_bytes: int | None = None
    """The limit a trial's peak was held to (None: only a real out-of-memory error counted)."""
    accumulate: int = 1
    """Gradient accumulation in force after the search."""
    effective_batch_size: int = 0
    """``batch_size_after * accumulate``: samples per optimizer step."""
    lr_factor: float = 1.0
    """What the learning rates were multiplied by (``apply.lr_scaling``)."""
    mode: str = ""
    """The search mode that ran (``model`` falls back to ``binsearch`` without memory statistics)."""
    note: str = ""
    """Why the search ended as it did, in words, when that needs saying (a fallback, a cap by the dataset)."""
    micro_batches: int = 0
    """For a recovered out-of-memory step (trigger ``oom``): how many micro-batches the batch trained as.
    0 for a search. Such an event has no trials and leaves the batch size as it was."""
    objective: str = "largest"
    """``largest`` (the largest size that fits) or ``throughput`` (the fitting size with the most samples/s)."""
    samples_per_s: list[float | None] = field(default_factory=list)
    """With ``throughput``: samples per second of each trial, in the order of ``trials``, from its steady
    steps (the first step of a trial warms up), the slowest rank's under DDP; None where it failed or
    was not timed. Empty for ``largest``."""
    largest: int | None = None
    """With ``throughput``: the size ``largest`` would have applied (the largest that fit, margin included)."""

    bucket_sizes: list[int] = field(default_factory=list)
    """``search.batching: buckets``: the train batch size of each length bucket after the search, shortest
    samples first (empty with ``fixed``). ``batch_size_after`` is then the size of the longest samples' bucket,
    the one size that fits every batch, which the batch-size attribute holds."""
    bucket_sizes_before: list[int] = field(default_factory=list)
    """Each bucket's size before the search (empty at the first one), of the buckets then in force: where the
    search grouped the samples anew, ``bucket_bounds_before`` says which."""
    bucket_bounds: list[int] = field(default_factory=list)
    """Each bucket's largest sample size (``sample_size``), the worst batch its size was probed on."""
    bucket_bounds_before: list[int] = field(default_factory=list)
    """The buckets' largest sample sizes before the search, where the search grouped the samples anew (other
    bounds: ``bucket_sizes_before`` are those buckets' sizes); empty where the bounds stayed."""
    bucket_samples: list[int] = field(default_factory=list)
    """How many samples each bucket holds."""
    trial_buckets: list[int] = field(default_factory=list)
    """The bucket each trial probed, in the order of ``trials`` (buckets only)."""
    samples_per_step: float = 0.0
    """Buckets: samples per training step on one rank, averaged over an epoch (what ``apply`` policies use)."""
    bucket_largest: list[int] = field(default_factory=list)
    """Buckets with ``throughput``: each bucket's largest size that fit (margin applied), before the cap at
    the fastest padded work per step (``bucket_sizes`` are after it). Empty otherwise."""
    reference_bucket: int | None = None
    """Buckets with ``throughput``: the bucket whose sizes were timed (the most padded work per epoch); its
    trials' rates are ``samples_per_s`` and ``largest`` is its largest size that fit."""
    padded_per_step: int | None = None
    """Buckets with ``throughput``: ``T*``, the reference bucket's fastest size x its longest sample, the padded
    work per step (in ``sample_size`` units: tokens, pixels) every bucket was capped at. None: no cap (the
    fastest size was the largest that fit)."""

    prediction: str = ""
    """``search.predict: auto``: ``predicted`` when the search traced the step and verified the predicted sizes
    with real probes, ``probed`` when it could not trace and searched with real probes alone (``note`` says
    why); empty when prediction was off."""
    predicted_bytes: list[int | None] = field(default_factory=list)
    """``predicted``: the traced peak at each trial's size, uncalibrated, the quantity ``peak_bytes`` measured
    (None where a trial was not predicted); empty otherwise."""
    prediction_s: float = 0.0
    """Seconds the traces took (included in ``duration_s``)."""

    @property
    def prediction_errors(self) -> list[float | None]:
        """Per trial, ``(predicted - measured) / measured`` of the uncalibrated trace (positive: it predicted
        more); None where either is missing."""
        return [
            None if p is None or m is None or m <= 0 else (p - m) / m
            for p, m in zip(self.predicted_bytes, self.peak_bytes, strict=False)
        ]

    @property
    def is_recovery(self) -> bool:
        return self.micro_batches > 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["trials"] = [[t.batch_size, t.fits] for t in self.trials]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RetuneEvent:
        values = dict(data)
        values["trials"] = [Trial(int(size), bool(fits)) for size, fits in values.get("trials", [])]
        return cls(**values)


__all__ = ["Direction", "RetuneEvent", "Trial"]
