"""``batching: buckets`` resumed mid-epoch continues the epoch's plan (issue 28, point 5).

Lightning restarts the train loader from its first batch while ``batch_idx`` continues; the bucketed
loader continues its epoch's plan from the batch after the last one trained instead, so the resumed epoch
trains every sample once across the two runs, in the order of a run that was never interrupted, and an
out-of-memory step after the resume is blamed on the bucket it came from. Memory comes from an oracle that
raises the real OOM error type (``torch.OutOfMemoryError``) when ``batch x longest`` passes its capacity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from retune import ScheduledBatchSizeFinder
from tests.helpers import bucket_data
from tests.helpers.bucket_data import BucketModel, IndexedTokens, long_tail_lengths, tokens
from tests.helpers.lightning_ns import LEGACY, pl, seed

N = 300


def _data() -> IndexedTokens:
    return IndexedTokens(long_tail_lengths(N, tail=0.05))


class Steps(BucketModel):
    """Records each real batch with its epoch; from global step ``drop_at`` on, an oracle runs out of memory
    (the real error type) on batches of long samples (> 100 tokens) above ``capacity // 2`` padded tokens."""

    def __init__(self, data: IndexedTokens, capacity: int | None = None, drop_at: int = 0) -> None:
        super().__init__(data)
        self.capacity, self.drop_at = capacity, drop_at
        self.steps: list[tuple[int, int, list[int]]] = []
        """``(epoch, global step, dataset indices)`` of every real batch."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.steps.append((self.trainer.current_epoch, self.trainer.global_step, batch[2].tolist()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.capacity is not None:
            ids = batch[0]
            longest = int((ids > 0).sum(1).max())
            capacity = self.capacity
            if longest > 100 and self.trainer.global_step >= self.drop_at:
                capacity //= 2
            if ids.shape[0] * longest > capacity:
                raise torch.OutOfMemoryError(f"CUDA out of memory (oracle: {ids.shape[0]} x {longest} > {capacity})")
        return super().training_step(batch, batch_idx)

    def epoch(self, epoch: int) -> list[list[int]]:
        return [indices for e, _, indices in self.steps if e == epoch]


class SaveAt(pl.Callback):  # type: ignore[misc]
    """Saves a checkpoint where ``ModelCheckpoint(every_n_train_steps=...)`` does: in ``on_train_batch_end``
    of the epoch's batch ``batch_idx``, and records the callback's pending bucket failures at that moment."""

    def __init__(self, path: Path, epoch: int, batch_idx: int, finder: ScheduledBatchSizeFinder) -> None:
        self.path, self.at, self.finder = path, (epoch, batch_idx), finder
        self.pending: dict[int, tuple[int, int]] | None = None
        self.events = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) == self.at:
            trainer.save_checkpoint(self.path)
            assert self.finder._buckets is not None
            self.pending = dict(self.finder._buckets.failures)
            self.events = len(self.finder.history)


def _finder(oom: bool = False) -> ScheduledBatchSizeFinder:
    if not oom:
        return ScheduledBatchSizeFinder(bucket_data.schedule(), sample_size=tokens, verbose=False, write_report=False)
    schedule = {
        "triggers": [{"kind": "fit_start"}, {"kind": "oom"}],
        "search": {"batching": "buckets", "buckets": 4, "steps_per_trial": 1, "mode": "binsearch", "margin": 0.0},
    }
    return ScheduledBatchSizeFinder(schedule, sample_size=tokens, verbose=False, write_report=False)


REPEATED = 1 if LEGACY else 0
"""Batches trained again after a resume: Lightning 1.9 counts the batch a checkpoint was saved after in
``on_train_batch_end`` as not completed and runs its ``batch_idx`` once more (with any loader); 2.x does not."""


@pytest.mark.parametrize(("epoch", "done"), [(0, 4), (1, 7)])
def test_a_mid_epoch_resume_continues_the_epochs_plan(tmp_path: Path, epoch: int, done: int) -> None:
    seed(0)
    whole = Steps(_data())
    bucket_data.trainer([_finder()], epochs=2).fit(whole)

    seed(0)
    first = Steps(_data())
    finder = _finder()
    path = tmp_path / "mid.ckpt"
    bucket_data.trainer([SaveAt(path, epoch, done - 1, finder), finder], epochs=2).fit(first)
    assert first.steps == whole.steps, "saving a checkpoint changes nothing"

    seed(0)
    resumed = Steps(_data())
    again = _finder()
    bucket_data.trainer([again], epochs=2).fit(resumed, ckpt_path=str(path))
    trained = first.epoch(epoch)[: done - REPEATED] + resumed.epoch(epoch)
    assert trained == whole.epoch(epoch), "the resumed epoch continues the plan, in the uninterrupted run's order"
    assert sorted(i for b in trained for i in b) == list(range(N)), "every sample once in the resumed epoch"
    if epoch == 0:
        assert resumed.epoch(1) == whole.epoch(1), "the next epoch is the uninterrupted run's"
    assert again.bucket_sizes == finder.bucket_sizes
    assert len(again.history) == len(finder.history) == 1, "the resume searches nothing"


def _bucket_of(finder: ScheduledBatchSizeFinder, indices: list[int]) -> int:
    assert finder._buckets is not None and finder._buckets.buckets is not None
    members = finder._buckets.buckets.members
    found = {b for b, m in enumerate(members) for i in indices if i in m}
    assert len(found) == 1, found
    return found.pop()


def _oom_fit(callbacks: list[Any], finder: ScheduledBatchSizeFinder, ckpt: Path | None = None) -> Steps:
    seed(0)
    model = Steps(_data(), capacity=2048, drop_at=2)  # the long samples' batches run out of memory from step 2
    bucket_data.trainer([*callbacks, finder], epochs=2).fit(model, ckpt_path=None if ckpt is None else str(ckpt))
    return model


@pytest.mark.parametrize("saved", ["before_the_oom", "after_the_oom"])
def test_an_oom_after_a_mid_epoch_resume_is_blamed_on_its_bucket_and_pending_failures_survive(
    tmp_path: Path, saved: str
) -> None:
    whole_finder = _finder(oom=True)
    whole = _oom_fit([], whole_finder)
    failed = [e.global_step for e in whole_finder.history if e.is_recovery]
    assert len(failed) == 1, "one step runs out of memory; its bucket's next batches keep the split"
    longest = _bucket_of(whole_finder, whole.steps[failed[0]][2])
    save_at = failed[0] - 1 if saved == "before_the_oom" else failed[0]  # batch_idx == global step in epoch 0

    finder = _finder(oom=True)
    path = tmp_path / "mid.ckpt"
    saver = SaveAt(path, 0, save_at, finder)
    _oom_fit([saver], finder)
    assert saver.pending == ({} if saved == "before_the_oom" else {longest: saver.pending[longest]})

    again = _finder(oom=True)
    loaded: dict[int, tuple[int, int]] = {}

    class Pending(pl.Callback):  # type: ignore[misc]
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            assert again._buckets is not None
            loaded.update(again._buckets.failures)

    resumed = _oom_fit([Pending()], again, ckpt=path)
    assert loaded == saver.pending, "the pending bucket failures came back with the checkpoint"
    after = [e for e in again.history[saver.events :] if e.is_recovery]  # the history came back too
    if saved == "before_the_oom":
        # the same batch runs out of memory after the resume (1.9: one global step later, it repeats a batch)
        assert [e.global_step for e in after] == [failed[0] + REPEATED]
    else:
        assert not after, "the split its bucket keeps came back with the checkpoint too"
    for event in after:  # the bucket named is the one of the batch that ran out of memory
        indices = next(i for e, step, i in resumed.steps if (e, step) == (0, event.global_step))
        assert _bucket_of(again, indices) == longest and f"bucket {longest}," in event.note, event.note
    searches = [e for e in again.history if not e.is_recovery]
    assert [(e.epoch, e.trigger) for e in searches] == [(0, "fit_start"), (1, "oom")]
    assert set(searches[1].trial_buckets) == {longest}, "only the failing bucket is searched again"
    assert searches[1].bucket_sizes == [e for e in whole_finder.history if not e.is_recovery][1].bucket_sizes
    assert resumed.epoch(1) == whole.epoch(1)


@pytest.mark.skipif(
    LEGACY,
    reason="pytorch-lightning 1.9 loads checkpoints with torch.load's weights_only default, "
    "which torch 2.6+ refuses for ModelCheckpoint's state (the manual saves above load)",
)
def test_model_checkpoints_mid_epoch_and_at_the_epoch_end_resume_where_they_were_saved(tmp_path: Path) -> None:
    seed(0)
    whole = Steps(_data())
    bucket_data.trainer([_finder()], epochs=2).fit(whole)
    per_epoch = len(whole.epoch(0))
    seed(0)
    steps = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    ends = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="end-{step}", save_top_k=-1)
    bucket_data.trainer([steps, ends, _finder()], epochs=1, enable_checkpointing=True).fit(Steps(_data()))
    paths = sorted(tmp_path.glob("*.ckpt"))
    expected = {f"end-step={per_epoch}.ckpt"} | {f"step={k}.ckpt" for k in range(3, per_epoch, 3)}
    assert {p.name for p in paths} == expected and len(expected) >= 3
    for path in paths:
        done = int(path.stem.split("step=")[1])
        seed(0)
        resumed = Steps(_data())
        bucket_data.trainer([_finder()], epochs=2).fit(resumed, ckpt_path=str(path))
        assert resumed.epoch(0) == whole.epoch(0)[done:], path.name
        assert resumed.epoch(1) == whole.epoch(1), path.name
