"""Evaluation sizes count what is resident when evaluation runs inside fit (issue 27).

Validation runs after training steps, which leave every trainable parameter's gradient and the
optimizer's state resident; after an unfreeze the val search runs before any step, when the
backbone has neither. Every real validation step is measured here independently of the probes:
the CPU peak tracker around the step (``retune.memory.measure_peak``, whose base counts parameters,
buffers and optimizer state), plus the gradients resident at that moment and the batch's own bytes.
Each must stay within the budget, with ``batching: fixed`` and ``batching: buckets`` (whose val search
is one size).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from retune import ScheduledBatchSizeFinder
from retune.memory import measure_peak, pending_state_bytes, resident_in_evaluation, tensor_bytes
from retune.schedule.models import parse_byte_size
from tests.helpers import bucket_data
from tests.helpers.bucket_data import BucketModel, IndexedTokens, UnfreezeAt, pad_collate, tokens
from tests.helpers.lightning_ns import pl, seed

BUDGET = parse_byte_size(bucket_data.BUDGET)


class _ValModel(BucketModel):
    """The buckets tests' model with a validation step and its own ``val_batch_size``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(IndexedTokens([16] * 240), **kwargs)  # one length: every val batch needs the same
        self.val_batch_size = 4

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, labels, _ = batch
        hidden = self.mlp(self.embed(ids))
        mask = (ids > 0).unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        self.log("val_loss", F.cross_entropy(self.head(pooled), labels), batch_size=len(labels))

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.val_batch_size, collate_fn=pad_collate)


class _ValPeaks(pl.Callback):  # type: ignore[misc]
    """The memory of every real validation step: tracked peak + resident gradients + the batch."""

    def __init__(self) -> None:
        self.peaks: list[tuple[int, int, int]] = []  # (epoch, batch size, bytes)
        self._open: Any = None

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, *args: Any) -> None:
        self._grads = sum(p.grad.numel() * p.grad.element_size() for p in pl_module.parameters() if p.grad is not None)
        self._batch = tensor_bytes(batch)
        self._size = len(batch[1])
        self._open = measure_peak(pl_module.device, pl_module, list(trainer.optimizers))
        self._reading = self._open.__enter__()

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self._open.__exit__(None, None, None)
        peak = int(self._reading.peak_bytes) + self._grads + self._batch
        self.peaks.append((trainer.current_epoch, self._size, peak))


@pytest.mark.parametrize("batching", ["fixed", "buckets"])
def test_validation_after_an_unfreeze_stays_within_the_budget(batching: str) -> None:
    seed(0)
    model = _ValModel(frozen=True)
    schedule = bucket_data.schedule(batching=batching, mode="binsearch", margin=0.0)
    schedule["stages"] = ["train", "val"]
    finder = ScheduledBatchSizeFinder(schedule, sample_size=tokens, verbose=False, write_report=False)
    peaks = _ValPeaks()
    bucket_data.trainer([UnfreezeAt(1), peaks, finder], epochs=2, limit_val_batches=3).fit(model)
    searched = [(e.stage, e.epoch) for e in finder.history]
    assert ("val", 1) in searched, searched
    after = [peak for epoch, _, peak in peaks.peaks if epoch == 1]
    assert after and max(after) <= BUDGET, (max(after) / BUDGET, peaks.peaks)
    # the size is not needlessly small: it uses most of the budget
    assert max(after) > 0.8 * BUDGET, max(after) / BUDGET


def test_pending_state_is_what_the_next_step_creates() -> None:
    """The estimate equals the state a real optimizer step creates, for AdamW (two buffers and a step count)
    and SGD with momentum (one buffer), and is zero for parameters that already have state or are frozen."""
    for make in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    ):
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        net[1].requires_grad_(False)
        optimizer = make(list(net.parameters()))
        predicted = pending_state_bytes(optimizer)
        net(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        created = sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values())
        assert predicted == created > 0
        assert pending_state_bytes(optimizer) == 0
        net[1].requires_grad_(True)  # unfrozen: its state comes next
        assert pending_state_bytes(optimizer) > 0


def test_resident_in_evaluation_adds_only_what_a_device_allocator_does_not_see_yet() -> None:
    net = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    param_bytes = sum(p.numel() * 4 for p in net.parameters())
    # nothing has run: the next backward creates the gradients, the next step the state
    assert resident_in_evaluation(net, [optimizer], counted_now=True) == param_bytes + pending_state_bytes(optimizer)
    net(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    assert resident_in_evaluation(net, [optimizer], counted_now=True) == 0  # all allocated now, counted
    state = sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values())
    assert resident_in_evaluation(net, [optimizer], counted_now=False) == param_bytes + state


def test_a_validate_call_after_the_fit_stays_within_the_budget() -> None:
    """``trainer.validate()`` on its own after a fit: the gradients the fit left on the parameters and the
    optimizer's state are still resident (nothing follows to allocate more). The search counted neither on a CPU
    budget, and the real step measured 1.05x its budget."""
    seed(0)
    model = _ValModel(frozen=True)
    schedule = bucket_data.schedule(batching="fixed", mode="binsearch", margin=0.0)
    schedule["stages"] = ["train", "val"]
    finder = ScheduledBatchSizeFinder(schedule, sample_size=tokens, verbose=False, write_report=False)
    peaks = _ValPeaks()
    trainer = bucket_data.trainer([UnfreezeAt(1), peaks, finder], epochs=2, limit_val_batches=3)
    trainer.fit(model)
    peaks.peaks.clear()
    trainer.validate(model, verbose=False)
    assert finder.history[-1].trigger == "validate_start"
    assert peaks.peaks and max(p for _, _, p in peaks.peaks) <= BUDGET, [p / BUDGET for _, _, p in peaks.peaks]
    assert max(p for _, _, p in peaks.peaks) > 0.8 * BUDGET  # and not needlessly small


def test_resident_after_a_fit_counts_what_exists_and_nothing_to_come() -> None:
    net = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(net.parameters())
    assert resident_in_evaluation(net, [optimizer], counted_now=False, upcoming=False) == 0  # nothing exists yet
    net(torch.randn(2, 4)).sum().backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in net.parameters() if p.grad is not None)
    assert resident_in_evaluation(net, [optimizer], counted_now=False, upcoming=False) == grads
    assert resident_in_evaluation(net, [optimizer], counted_now=True, upcoming=False) == 0  # an allocator counts it
