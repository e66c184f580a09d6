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
    global_step: int
    trigger: str
    groups: list[int]
    """Indices of the optimizer's param groups the test swept and set."""
    lrs_before: list[float]
    """Each chosen group's nominal rate before the test (the configured rate a warmup or OneCycle works from,
    as ``lr_after`` is; see :func:`retune.lr.apply.nominal_lr`), in the order of ``groups``."""
    lr_after: float | None
    method: str
    suggestion_index: int | None = None
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    steps_planned: int = 0
    stopped_early: bool = False
    """The loss diverged (above ``early_stop_threshold`` x its lowest, or not finite) before the last rate."""
    duration_s: float = 0.0
    batch_size: int | None = None
    """The train dataloader's batch size during the test (after a batch-size search at the same trigger)."""
    mode: str = "exponential"
    note: str = ""

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
