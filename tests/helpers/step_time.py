"""A step whose duration is a known function of the batch size, read through an injected clock.

Timing-based behaviour must be tested without timing: the model's ``training_step`` advances a
:class:`FakeClock` by ``StepTimeOracle.seconds(batch_size, trainable_fraction)`` and the finder reads
that clock (``ScheduledBatchSizeFinder(..., clock=clock)``), so every step of a given size takes exactly
the modelled time and the fastest size is known in advance. The first step of each probe trial takes
``warmup`` seconds more (optimizer state is allocated there on a real device), which the selection must
ignore. Memory is the oracle of tests/helpers/oracle.py (the real ``torch.OutOfMemoryError``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.helpers.oracle import FineTuneModel, MemoryOracle


class FakeClock:
    """A clock that only moves when a step says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class StepTimeOracle:
    """``seconds(b) = fixed + per_sample * b`` up to ``knee``, then each further sample costs ``crowded``.

    Samples/s grows with ``b`` up to the knee (the fixed cost is shared by more samples) and falls after
    it when ``crowded`` is large enough, so the fastest size is the knee. Trainable parameters (an
    unfrozen backbone) scale the per-sample costs by ``1 + unfrozen_cost * trainable_fraction``.
    """

    fixed: float = 0.010
    per_sample: float = 0.001
    knee: int = 48
    crowded: float = 0.004
    unfrozen_cost: float = 0.0
    knee_unfrozen: int | None = None
    warmup: float = 1.0

    def knee_for(self, trainable_fraction: float) -> int:
        return self.knee if self.knee_unfrozen is None or trainable_fraction < 1 else self.knee_unfrozen

    def seconds(self, batch_size: int, trainable_fraction: float = 0.0) -> float:
        scale = 1 + self.unfrozen_cost * trainable_fraction
        knee = self.knee_for(trainable_fraction)
        linear = self.fixed + self.per_sample * scale * min(batch_size, knee)
        return linear + self.crowded * scale * max(0, batch_size - knee)

    def rate(self, batch_size: int, trainable_fraction: float = 0.0) -> float:
        return batch_size / self.seconds(batch_size, trainable_fraction)

    def best_rate(self, cap: int, trainable_fraction: float = 0.0) -> float:
        return max(self.rate(b, trainable_fraction) for b in range(1, cap + 1))


class TimedModel(FineTuneModel):
    """``FineTuneModel`` whose every training step takes the oracle's time on ``clock``."""

    def __init__(self, clock: FakeClock, times: StepTimeOracle, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.clock = clock
        self.times = times
        self._last_size: int | None = None

    def trainable_fraction(self) -> float:
        backbone = list(self.backbone.parameters())
        return sum(p.numel() for p in backbone if p.requires_grad) / sum(p.numel() for p in backbone)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)  # the memory oracle raises first for sizes that do not fit
        size = int(batch[0].shape[0])
        warm = self.times.warmup if batch_idx == 0 else 0.0  # a probe trial's first step warms up
        self.clock.advance(self.times.seconds(size, self.trainable_fraction()) + warm)
        return loss


def roomy_oracle(capacity: int = 2_000_000) -> MemoryOracle:
    """Memory for a few hundred samples with the backbone frozen, fewer unfrozen."""
    return MemoryOracle(capacity=capacity, per_sample=1_000, per_sample_trainable=4_000, state_per_param=50)
