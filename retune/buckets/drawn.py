"""Buckets over the samples the user's sampler draws: the sampler decides what trains, buckets only group it.

A sampler that chooses which samples train and how often — a ``WeightedRandomSampler``, a
``RandomSampler`` with replacement or another ``num_samples``, a ``SubsetRandomSampler``, a subset or
curriculum sampler of the user's own — is part of the training recipe: the label share of a weighted
sampler, the number of samples an epoch trains, the samples a subset leaves out. Buckets must not
replace it with every sample once. When its draws can be known before the epoch (a finite sampler with
a ``__len__``), :class:`DrawnBucketBatchSampler` iterates the user's own sampler once at the epoch's
start — its own generator, or torch's, advancing exactly as the user's loader would advance it, after
its ``set_epoch`` — and cuts those draws into each bucket's batches (:func:`drawn_batches`): the
epoch trains the same indices, each as often as drawn, only grouped by size. A sampler whose draws
cannot be known before the epoch (no ``__len__``), or any choosing sampler under several processes
(each rank would draw on its own, and the ranks must agree on every step's bucket), keeps the loader as
the user built it (``batching: fixed``) with one warning that names it (:func:`why_draws_unknown`).

Example:
    >>> from retune.buckets.plan import Buckets
    >>> buckets = Buckets(bounds=(10, 100), members=((0, 1, 2), (3,)), largest=(10, 100))
    >>> plan = drawn_batches(buckets, [2, 1], [3, 0, 0, 1, 3, 2])
    >>> [(b.bucket, b.indices) for b in plan]
    [(1, (3,)), (0, (0, 0)), (0, (1, 2)), (1, (3,))]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from retune.buckets.loader import BucketBatchSampler
from retune.buckets.plan import Buckets, PlannedBatch
from retune.errors import RetuneError


def bucket_of_index(buckets: Buckets) -> dict[int, int]:
    """Dataset index -> its bucket, for every sample the buckets hold.

    >>> bucket_of_index(Buckets((10, 100), ((0, 2), (1,)), (10, 100)))
    {0: 0, 2: 0, 1: 1}
    """
    return {index: bucket for bucket, members in enumerate(buckets.members) for index in members}


def drawn_batches(
    buckets: Buckets,
    batch_sizes: Sequence[int],
    draws: Sequence[int],
    *,
    drop_last: bool = False,
    where: Mapping[int, int] | None = None,
) -> list[PlannedBatch]:
    """One epoch's batches of exactly ``draws`` (dataset indices, repeats included), grouped by bucket.

    Each bucket's draws keep the order the sampler drew them in and are cut into batches of that
    bucket's size; batches run in the order of their first sample's draw, so the sampler's randomness
    (or a curriculum's order) decides the order of the epoch, not a second shuffle. A bucket's last,
    partial batch trains smaller, or not at all with ``drop_last`` (as buckets treat every loader).
    ``where`` is :func:`bucket_of_index` of ``buckets`` (computed when not given).

    >>> buckets = Buckets((10,), ((0, 1),), (10,))
    >>> [b.indices for b in drawn_batches(buckets, [2], [1, 1, 0], drop_last=True)]
    [(1, 1)]
    """
    if len(batch_sizes) != buckets.count:
        raise ValueError(f"{buckets.count} buckets but {len(batch_sizes)} batch sizes")
    where = bucket_of_index(buckets) if where is None else where
    drawn: list[list[tuple[int, int]]] = [[] for _ in range(buckets.count)]
    for position, index in enumerate(draws):
        bucket = where.get(index)
        if bucket is None:
            raise ValueError(f"index {index!r} (draw {position}) is not a sample of the buckets")
        drawn[bucket].append((position, index))
    groups: list[tuple[int, int, tuple[int, ...]]] = []
    for bucket, (picks, size) in enumerate(zip(drawn, batch_sizes, strict=True)):
        if size < 1:
            raise ValueError(f"bucket {bucket} has batch size {size}; sizes must be >= 1")
        for start in range(0, len(picks), size):
            group = picks[start : start + size]
            if len(group) < size and drop_last:
                continue
            groups.append((group[0][0], bucket, tuple(index for _, index in group)))
    groups.sort()
    return [PlannedBatch(bucket, indices) for _, bucket, indices in groups]


def why_draws_unknown(sampler: Any, world_size: int) -> str | None:
    """Why the draws of a sampler that chooses what trains cannot be bucketed, or None when they can."""
    name = type(sampler).__name__
    if world_size > 1:
        return (
            f"its sampler ({name}) chooses which samples train and how often, and under {world_size} processes "
            "each rank would draw its own epoch while buckets need every rank to agree on each step's bucket"
        )
    try:
        length = len(sampler)
    except TypeError:
        length = None
    if length is None or not isinstance(length, int):
        return (
            f"its sampler ({name}) chooses which samples train and has no __len__, so the samples it draws in an "
            "epoch cannot be known before the epoch"
        )
    return None


def draw_epoch(sampler: Any, epoch: int) -> list[int]:
    """The dataset indices ``sampler`` draws for ``epoch``, in its order: its ``set_epoch`` (when it has one),
    then one pass over it, exactly as a ``DataLoader`` over it would make (its generator advances once).

    A pass longer than ``len(sampler)`` stops with a :class:`~retune.errors.RetuneError`: an endless sampler
    would otherwise never let the epoch start.
    """
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    expected = len(sampler)
    draws: list[int] = []
    for index in sampler:
        if len(draws) >= expected:
            raise RetuneError(
                f"search.batching: buckets draws each epoch's samples from the train sampler "
                f"({type(sampler).__name__}) before the epoch, but it yielded more indices than its __len__ "
                f"({expected}); make __len__ the number of indices one pass yields, or use `batching: fixed`"
            )
        draws.append(_position(index, sampler))
    return draws


def _position(index: Any, sampler: Any) -> int:
    try:
        return int(index)
    except (TypeError, ValueError):
        raise RetuneError(
            f"search.batching: buckets groups dataset positions, but the train sampler ({type(sampler).__name__}) "
            f"drew {index!r}; use `batching: fixed` for a sampler whose keys are not positions"
        ) from None


class DrawnBucketBatchSampler(BucketBatchSampler):
    """The bucketed batches of exactly what the user's sampler draws each epoch.

    Unlike :class:`~retune.buckets.loader.BucketBatchSampler` (every sample once, retune's own seeded
    shuffle), the epoch's plan is :func:`drawn_batches` of one pass over ``draws_from``, the user's sampler
    itself, made once per epoch when the plan is first needed (Lightning asks for the loader's length at
    the epoch's start). Its number of batches can change from epoch to epoch: the fit loop's count is
    refreshed at each epoch start (:meth:`retune.buckets.train_buckets.TrainBuckets.epoch_started`).
    A fit resumed mid-epoch (``start``) skips as many batches as were trained before the checkpoint, so
    the epoch keeps its length; the draws themselves are a new pass of the user's sampler, whose
    generator state no checkpoint holds.
    """

    def __init__(
        self,
        buckets: Buckets,
        batch_sizes: list[int],
        *,
        draws_from: Any,
        epoch: int = 0,
        drop_last: bool = False,
        start: int = 0,
    ) -> None:
        super().__init__(buckets, batch_sizes, seed=0, epoch=epoch, shuffle=False, drop_last=drop_last, start=start)
        self.draws_from = draws_from
        self.draws: list[int] = []
        """The indices the user's sampler drew for the epoch of :attr:`plan` (empty until it is made)."""
        self._where = bucket_of_index(buckets)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        set_epoch = getattr(self.draws_from, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)  # Lightning calls it on the user's loader's sampler: it still gets it

    @property
    def plan(self) -> list[PlannedBatch]:
        """This epoch's batches (the user's sampler is iterated once per epoch, here)."""
        if self._plan is None or self._plan_epoch != self.epoch:
            epoch = self.epoch
            self.draws = draw_epoch(self.draws_from, epoch)
            try:
                self._plan = drawn_batches(
                    self.buckets, self.batch_sizes, self.draws, drop_last=self.drop_last, where=self._where
                )
            except ValueError as error:
                raise RetuneError(
                    f"search.batching: buckets cannot group what the train sampler ({type(self.draws_from).__name__}) "
                    f"drew at epoch {epoch}: {error}, so its size was never scanned; use `batching: fixed`"
                ) from None
            self._plan_epoch = epoch
        return self._plan

    def __len__(self) -> int:
        return len(self.plan)

    def mean_batch(self) -> float:
        """Samples per step over this epoch's plan (0 for an empty epoch)."""
        plan = self.plan
        return sum(len(b.indices) for b in plan) / len(plan) if plan else 0.0


__all__ = [
    "DrawnBucketBatchSampler",
    "bucket_of_index",
    "draw_epoch",
    "drawn_batches",
    "why_draws_unknown",
]
