"""What the epoch start does when the train data changed: detect it on rank zero, keep or re-search sizes.

A dataset can change under a run without any trigger firing: a length curriculum that raises
``max_len`` on the same dataset object, a datamodule that rebuilds its dataset every epoch. The sizes in
force were found for the samples probed then, so the callback checks, at each epoch start, whether the
train samples' sizes changed since (a cheap fingerprint, :mod:`retune.probing.sample_sizes`): with
buckets, since the samples were grouped; with one size and ``probe_samples: largest``, since its probes
ran on the largest samples. Rank zero's answer is every rank's, so the ranks search (or not) together.
When the samples got longer the callback searches again (trigger ``data_changed``); otherwise the sizes
stay, on the regrouped buckets, and one line says so (:func:`keep_sizes`).
"""

from __future__ import annotations

from typing import Any

from retune import compat
from retune.buckets.train_buckets import DataChange, TrainBuckets
from retune.messages import Say
from retune.probing.probe_batches import LargestChange, ProbeBatches

Change = DataChange | LargestChange
"""What changed: per bucket (:class:`DataChange`) or for one size's largest samples (:class:`LargestChange`)."""


def train_data_change(
    trainer: Any,
    *,
    tuned: bool,
    buckets: TrainBuckets | None,
    probe_batches: ProbeBatches,
    train_size: int | None,
    say: Say,
) -> Change | None:
    """Whether the train samples' sizes changed since the sizes in force were found: rank zero's answer, on
    every rank (every rank must call it: it broadcasts, unless the schedule leaves nothing to follow — one
    size probed on the first samples, or the train size not tuned — which every rank knows alike).

    Args:
        trainer: the Lightning trainer (its train loaders hold the data trained now).
        tuned: whether the train stage's size is tuned at all (``train`` in the schedule's stages).
        buckets: the run's buckets, or None with one size.
        probe_batches: the probes' batch maker, which remembers what its largest probes ran on.
        train_size: the train batch size in force (one size).
        say: where a rescan reports.
    """
    if not tuned or (buckets is None and probe_batches.mode != "largest"):
        return None  # nothing to follow, on every rank alike (the schedule says so): no broadcast
    local: Change | None
    if buckets is not None and buckets.state.sizes:
        local = buckets.data_change(say)
    else:  # one size (fixed, or buckets that fell back): what its probes ran on
        local = probe_batches.largest_change("train", compat.train_loaders(trainer), train_size)
    shared = compat.broadcast_object(trainer, local if not isinstance(local, DataChange) else local.search)
    if shared is None or isinstance(shared, LargestChange):
        return shared
    if not isinstance(local, DataChange):
        return None
    return local if local.search == shared else DataChange(local.buckets, shared, local.largest_before)


def keep_sizes(trainer: Any, change: Change, buckets: TrainBuckets | None, train_size: int | None, say: Say) -> None:
    """The samples changed but no size needs a search: say so, and regroup the buckets over the new samples.

    Args:
        trainer: the Lightning trainer (its train loader is rebuilt over the regrouped buckets).
        change: what :func:`train_data_change` found (its ``search`` is false).
        buckets: the run's buckets, or None with one size.
        train_size: the train batch size in force (one size).
        say: where the line goes.
    """
    where = f"epoch {trainer.current_epoch}: the train samples' sizes changed ({change.describe()})"
    if isinstance(change, LargestChange):
        say(f"{where}; batch size {train_size} still fits")
        return
    assert buckets is not None
    say(f"{where}; the bucket sizes still fit")
    buckets.regroup(change)
    compat.reload_dataloader(trainer, "train")


__all__ = ["Change", "keep_sizes", "train_data_change"]
