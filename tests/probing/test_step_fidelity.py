"""A probe step holds what a training step holds, and a one-step verifying probe counts what a later step holds.

Lightning's loop zeroes the gradients after ``training_step`` and before backward, so the step before's
gradients are alive in every forward after the first; it keeps what ``training_step`` returned (a dict's logits)
until the update is done. The probes zeroed before the forward and kept the loss only: real steps at the size
found went to 1.09x the budget (a wide MLP, SGD with momentum) and 1.03x (a step returning its logits). A
one-step verifying probe (``predict: auto``) added the optimizer state it created to the step's peak, also where
that peak was the update creating the state: the state counted twice, a size far too small or no size at all.

Every real training step here is measured as a probe is, with the step before's gradients counted while they
are alive (``tests.helpers.varlen.StepPeaks``: ``measure_peak(grads=True)``). No out-of-memory error is involved:
the CPU tracker's counts against ``memory.budget``.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from retune.schedule.models import parse_byte_size
from tests.helpers.lightning_ns import pl, seed
from tests.helpers.varlen import StepPeaks
from tests.helpers.varlen import trainer as quiet_trainer


class _MLP(pl.LightningModule):  # type: ignore[misc,name-defined]
    """Wide layers (their gradients are a large part of a step's forward peak), SGD with momentum; ``logits``
    returns them beside the loss; ``frozen`` freezes the middle layer until epoch 1 (:class:`_Unfreeze`)."""

    def __init__(self, widths: tuple[int, ...], optimizer: str = "sgd", logits: bool = False) -> None:
        super().__init__()
        self.batch_size = 4
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])
        self.optimizer, self.logits = optimizer, logits
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(4096, widths[0], generator=g), torch.randint(0, widths[-1], (4096,)))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        return {"loss": loss, "logits": logits} if self.logits else loss

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Unfreeze(pl.Callback):  # type: ignore[misc,name-defined]
    """The middle ``Linear`` frozen at fit start, unfrozen at epoch 1 (the re-tune's trigger)."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        pl_module.net[2].requires_grad_(False)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            pl_module.net[2].requires_grad_(True)


def _fit(
    model: _MLP, predict: str, budget: str, epochs: int = 1, unfreeze: bool = False, accumulate: int = 1
) -> tuple[Any, StepPeaks]:
    seed(1)
    triggers = [{"kind": "fit_start"}] + ([{"kind": "trainable_params_changed"}] if unfreeze else [])
    schedule = {
        "search": {"mode": "binsearch", "margin": 0.0, "steps_per_trial": 2, "predict": predict},
        "memory": {"budget": budget},
        "triggers": triggers,
    }
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    peaks = StepPeaks()
    callbacks = ([_Unfreeze()] if unfreeze else []) + [peaks, finder]
    quiet_trainer(callbacks, epochs, limit_train_batches=4, accumulate_grad_batches=accumulate).fit(model)
    return finder, peaks


@pytest.mark.parametrize(
    ("model", "budget"),
    [
        (lambda: _MLP((64, 1024, 1024, 1024, 10)), "40MiB"),  # the step before's gradients in the forward
        (lambda: _MLP((64, 512, 512, 100), optimizer="adamw", logits=True), "12MiB"),  # logits alive to the update
    ],
    ids=["gradients", "logits"],
)
@pytest.mark.parametrize("predict", ["off", "auto"])
def test_every_real_step_at_the_size_found_fits_the_budget(model: Any, budget: str, predict: str) -> None:
    finder, peaks = _fit(model(), predict, budget)
    limit = parse_byte_size(budget)
    size = finder.history[0].batch_size_after
    steps = [peak for peak, n in zip(peaks.peaks, peaks.sizes, strict=True) if n == size]
    assert len(steps) >= 2, (size, peaks.sizes)
    assert max(steps) <= limit, (size, [round(p / limit, 3) for p in steps])
    assert max(steps) >= 0.99 * limit  # and the size is not far below the largest that fits


@pytest.mark.parametrize("predict", ["off", "auto"])
def test_with_gradient_accumulation_every_real_micro_batch_fits_the_budget(predict: str) -> None:
    """``accumulate_grad_batches=2``: the loop zeroes at a window's first micro-batch only, so the second runs
    backward with the first's gradients alive (+25% on a small language-model-like net). The probes zero where
    the loop does and a one-step verifying probe counts them in backward: every real micro-batch fits."""
    finder, peaks = _fit(_MLP((64, 1024, 1024, 1024, 10)), predict, "40MiB", accumulate=2)
    limit = parse_byte_size("40MiB")
    size = finder.history[0].batch_size_after
    steps = [peak for peak, n in zip(peaks.peaks, peaks.sizes, strict=True) if n == size]
    assert len(steps) >= 2 and max(steps) <= limit, (size, [round(p / limit, 3) for p in steps])


def test_a_one_step_verifying_probe_counts_the_state_once_where_the_update_is_the_peak() -> None:
    """AdamW over wide layers at a budget where the update, creating the state, is the step's peak at every
    size: the one-step verifying probe counted the state twice (every size at the limit: 200 where 723 fit, or
    no size at all). Now the prediction finds the size the two-step search finds, in one probe."""
    off, _ = _fit(_MLP((64, 512, 512, 100), optimizer="adamw"), "off", "10MiB")
    auto, peaks = _fit(_MLP((64, 512, 512, 100), optimizer="adamw"), "auto", "10MiB")
    event = auto.history[0]
    assert event.prediction == "predicted" and event.batch_size_after == off.history[0].batch_size_after
    assert len(event.trials) == 1
    errors = [e for e in event.prediction_errors if e is not None]
    assert errors and all(abs(e) <= 0.01 for e in errors), errors
    assert max(peaks.peaks) <= parse_byte_size("10MiB")


def test_after_an_unfreeze_a_line_per_phase_predicts_the_size_in_one_probe() -> None:
    """After the unfreeze the first trace (at the cap) peaks in backward, the second (near the answer) in
    forward, where the step before's gradients and the new state join the activations: one line through the two
    step peaks cut across the corner and predicted 2-5% over (three probes). A line per phase is exact."""
    model = _MLP((64, 512, 1024, 100), optimizer="adamw")
    off, _ = _fit(_MLP((64, 512, 1024, 100), optimizer="adamw"), "off", "15MiB", epochs=2, unfreeze=True)
    auto, peaks = _fit(model, "auto", "15MiB", epochs=2, unfreeze=True)
    assert [e.batch_size_after for e in auto.history] == [e.batch_size_after for e in off.history]
    retune = auto.history[1]
    assert retune.trigger == "trainable_params_changed" and retune.prediction == "predicted"
    assert len(retune.trials) == 1
    errors = [e for e in retune.prediction_errors if e is not None]
    assert errors and all(abs(e) <= 0.01 for e in errors), errors
    assert max(peaks.peaks) <= parse_byte_size("15MiB")


def test_model_mode_reads_each_trial_by_phase_and_ends_where_binsearch_does() -> None:
    """``mode: model`` draws a line per phase of the step (``Prober.record_phases``, ``phases_at``): each trial's
    peak is its highest phase, and after an unfreeze the search ends on the size binsearch finds, every real step
    at it within the budget."""
    found = {}
    for mode in ("binsearch", "model"):
        seed(1)
        model = _MLP((64, 1024, 1024, 1024, 10))
        schedule = {
            "search": {"mode": mode, "margin": 0.0, "steps_per_trial": 2},
            "memory": {"budget": "40MiB"},
            "triggers": [{"kind": "fit_start"}, {"kind": "trainable_params_changed"}],
        }
        finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
        peaks = StepPeaks()
        quiet_trainer([_Unfreeze(), peaks, finder], 2, limit_train_batches=4).fit(model)
        assert max(peaks.peaks) <= parse_byte_size("40MiB")
        found[mode] = [event.batch_size_after for event in finder.history]
    assert found["model"] == found["binsearch"]


class _PhasesOf(pl.Callback):  # type: ignore[misc,name-defined]
    """At train start, measures sizes 8 and 64 by phase (``record``): what ``measure`` returned and ``phases_at``.
    ``other(size, ours)``: a second rank's answer to the trial's gather, simulated (DDP's agreement)."""

    def __init__(self, record: bool, other: Any = None) -> None:
        self.record, self.other = record, other
        self.seen: list[tuple[int | None, tuple[int, ...] | None]] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        import retune.compat as compat_module
        from retune.probing.prober import Prober

        prober = Prober(trainer, pl_module, "batch_size", 2, budget_bytes=parse_byte_size("1GiB"))
        prober.record_phases = self.record
        gather = compat_module.all_gather_object
        with prober.session():
            for size in (8, 64):

                def two(trainer: Any, ours: Any, size: int = size) -> list[Any]:
                    return [*gather(trainer, ours), self.other(size, ours)]

                if self.other is not None:
                    compat_module.all_gather_object = two  # type: ignore[assignment]
                try:
                    _, peak = prober.measure(size)
                finally:
                    compat_module.all_gather_object = gather
                self.seen.append((peak, prober.phases_at(size)))


@pytest.mark.parametrize("record", [True, False])
def test_a_trial_by_phase_peaks_at_its_highest_phase(record: bool) -> None:
    seed(1)
    probe = _PhasesOf(record)
    quiet_trainer([probe], 1, limit_train_batches=1).fit(_MLP((64, 512, 512, 10), optimizer="adamw"))
    for peak, phases in probe.seen:
        if not record:
            assert phases is None
            continue
        assert phases is not None and len(phases) == 3 and max(phases) == peak
    if record:  # forward and backward grow with the batch; the update (AdamW over the weights) by the batch only
        (_, small), (_, large) = probe.seen
        assert small is not None and large is not None
        assert large[0] - small[0] > 100_000 and large[1] - small[1] > 100_000
        assert 0 < large[2] - small[2] < 20_000  # 56 more samples of 64 floats, and their logits


def test_ranks_agree_on_each_phase_as_the_larger_rank_has_it_or_on_none() -> None:
    """Under DDP each rank reads its own step by phase; the search draws its lines through the agreed phases: each
    the larger rank's. A rank that did not tell its phases apart leaves the size without phases on every rank (the
    line through the step peaks)."""

    def larger_backward(size: int, ours: Any) -> Any:
        status, peak, message, times, (reserved, headroom, phases) = ours
        return status, peak + 1000, message, times, (reserved, headroom, (phases[0], peak + 1000, phases[2]))

    def without_phases(size: int, ours: Any) -> Any:
        status, peak, message, times, (reserved, headroom, _) = ours
        return status, peak, message, times, (reserved, headroom, None)

    for other, expect_phases in ((larger_backward, True), (without_phases, False)):
        seed(1)
        probe = _PhasesOf(True, other)
        quiet_trainer([probe], 1, limit_train_batches=1).fit(_MLP((64, 512, 512, 10), optimizer="adamw"))
        for peak, phases in probe.seen:
            if not expect_phases:
                assert phases is None
                continue
            assert phases is not None and peak is not None
            assert phases[1] == peak and max(phases) == peak  # the other rank's larger backward binds
