"""What a learning-rate range test did, as a plain record: in ``ScheduledLRFinder.history``, checkpoints and JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class LRFindEvent:
    """One range test: when it ran, why, the curve it measured and the rate it set.

    ``lrs``, ``losses`` and ``smoothed`` are the tested rates and the (rank-averaged) raw and smoothed
    losses, one per step run; ``suggestion_index`` is the curve point the suggestion method picked
    (for ``min_div10`` the minimum, the rate set being a tenth of it). ``lr_after`` is None when no
    suggestion could be made (too few finite points), and then nothing was changed.
    """

    epoch: int
    """The epoch at whose start the range test ran."""
    global_step: int
    """Optimizer steps taken when it ran."""
    trigger: str
    """The trigger kind that fired (several joined by ``+``)."""
    groups: list[int]
    """Indices of the optimizer's param groups the test swept and set."""
    lrs_before: list[float]
    """Each chosen group's nominal rate before the test (the configured rate a warmup or OneCycle works from,
    as ``lr_after`` is; see :func:`retune.lr.apply.nominal_lr`), in the order of ``groups``."""
    lr_after: float | None
    """The rate set on each of ``groups`` (None: no suggestion could be made, nothing changed)."""
    method: str
    """The suggestion method of the schedule's ``lr_find`` section (``steepest``, ``min_div10``, ...)."""
    suggestion_index: int | None = None
    """The index into ``lrs`` of the curve point the method picked (None: no suggestion)."""
    lrs: list[float] = field(default_factory=list)
    """The rates tested, one per step run."""
    losses: list[float] = field(default_factory=list)
    """The raw loss at each tested rate (averaged over ranks)."""
    smoothed: list[float] = field(default_factory=list)
    """The smoothed loss the suggestion was read from, one per step run."""
    steps_planned: int = 0
    """Steps the sweep would have run without an early stop."""
    stopped_early: bool = False
    """The loss diverged (above ``early_stop_threshold`` x its lowest, or not finite) before the last rate."""
    duration_s: float = 0.0
    """Wall-clock seconds the test took, state restore included."""
    batch_size: int | None = None
    """The train dataloader's batch size during the test (after a batch-size search at the same trigger)."""
    mode: str = "exponential"
    """How rates were spaced: ``exponential`` or ``linear``."""
    note: str = ""
    """Why the test ended as it did, in words, when that needs saying."""

    @property
    def steps(self) -> int:
        return len(self.losses)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("losses", "smoothed"):  # JSON has no NaN or infinity: a diverged loss is written as null
            data[key] = [v if math.isfinite(v) else None for v in data[key]]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LRFindEvent:
        values = dict(data)
        for key in ("losses", "smoothed"):
            values[key] = [math.nan if v is None else float(v) for v in values.get(key, [])]
        values["groups"] = [int(g) for g in values.get("groups", [])]
        return cls(**values)


__all__ = ["LRFindEvent"]
