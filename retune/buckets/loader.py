"""The bucketed train loader: the user's own DataLoader, reading batches that retune forms per bucket.

``search.batching: buckets`` replaces only the batch sampler of the loader ``train_dataloader()``
returns (on a shallow copy): dataset, ``collate_fn``, workers, pinning, worker seeding and the
loader's class stay the user's. The copy's ``sampler`` is a ``DistributedSampler`` view of this
rank's indices, so Lightning leaves it alone under DDP instead of injecting its own (which would
shard the samples a second time), and forwards ``set_epoch`` to it every epoch on both Lightning
lines.

The loader is swapped where Lightning asks for it: the train dataloader source's ``dataloader()`` is
wrapped for the duration of ``fit``, so every (re)load — Lightning's own, and retune's after a search —
gets the bucketed copy at the sizes in force. Probes read the user's loader unwrapped.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler

from retune import compat
from retune.buckets.plan import Buckets, PlannedBatch, count_batches, epoch_batches


class BucketBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches of an epoch: each bucket at its own size, shuffled across buckets.

    The plan is a pure function of ``(seed, epoch)`` (:func:`retune.buckets.plan.epoch_batches`), so a
    resumed or re-created sampler yields the same batches, and every rank agrees on them. ``start``
    continues epoch ``epoch``'s plan from its batch ``start`` (a fit restored mid-epoch: Lightning
    restarts the loader while ``batch_idx`` continues), for the first pass over that epoch only.
    """

    def __init__(
        self,
        buckets: Buckets,
        batch_sizes: list[int],
        *,
        seed: int,
        epoch: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        world_size: int = 1,
        rank: int = 0,
        start: int = 0,
    ) -> None:
        self.buckets = buckets
        self.batch_sizes = list(batch_sizes)
        self.seed = seed
        self.epoch = epoch
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.world_size = world_size
        self.rank = rank
        self.sampler = _RankOrder(self)
        self._plan: list[PlannedBatch] | None = None
        self._plan_epoch: int | None = None
        self._resume: tuple[int, int] | None = (epoch, start) if start > 0 else None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def plan(self) -> list[PlannedBatch]:
        """This epoch's batches for this rank (computed once per epoch)."""
        if self._plan is None or self._plan_epoch != self.epoch:
            self._plan = epoch_batches(
                self.buckets,
                self.batch_sizes,
                seed=self.seed,
                epoch=self.epoch,
                shuffle=self.shuffle,
                drop_last=self.drop_last,
                world_size=self.world_size,
                rank=self.rank,
            )
            self._plan_epoch = self.epoch
        return self._plan

    def bucket_at(self, batch_idx: int) -> int | None:
        """The bucket of this epoch's batch ``batch_idx`` (None outside the epoch)."""
        plan = self.plan
        return plan[batch_idx].bucket if 0 <= batch_idx < len(plan) else None

    def __iter__(self) -> Iterator[list[int]]:
        plan, start = self.plan, 0
        if self._resume is not None and self._resume[0] == self.epoch:
            start = self._resume[1]
        self._resume = None  # the epoch's next pass (a later epoch, a reload) starts from its first batch
        for batch in plan[start:]:
            yield list(batch.indices)

    def __len__(self) -> int:
        return count_batches(self.buckets, self.batch_sizes, self.drop_last, self.world_size)


class _RankOrder(DistributedSampler):  # type: ignore[type-arg]
    """This rank's indices in batch order: the loader's ``sampler`` as Lightning and users inspect it.

    A ``DistributedSampler`` so that Lightning does not inject one (the batches are already sharded);
    ``DistributedSampler.__init__`` is not called, as it would look up a process group.
    """

    def __init__(self, owner: BucketBatchSampler) -> None:
        self.owner = owner
        self.num_replicas = owner.world_size
        self.rank = owner.rank
        self.shuffle = owner.shuffle
        self.seed = owner.seed
        self.drop_last = owner.drop_last
        self.dataset = None  # type: ignore[assignment]

    @property
    def epoch(self) -> int:
        return self.owner.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.owner.epoch = value

    def set_epoch(self, epoch: int) -> None:
        self.owner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return (index for batch in self.owner.plan for index in batch.indices)

    def __len__(self) -> int:
        return sum(len(batch.indices) for batch in self.owner.plan)


def with_batch_sampler(loader: DataLoader[Any], batch_sampler: BucketBatchSampler) -> DataLoader[Any]:
    """A shallow copy of the user's ``loader`` that reads ``batch_sampler``'s batches; nothing else changes.

    ``DataLoader`` refuses a new sampler after construction, so the copy's attributes are written directly.
    """
    new = copy.copy(loader)
    state = new.__dict__
    state["sampler"] = batch_sampler.sampler
    state["batch_sampler"] = batch_sampler
    state["batch_size"] = None
    state["drop_last"] = False
    state["_iterator"] = None
    return new


def loader_seed(loader: DataLoader[Any]) -> int:
    """The shuffle seed: the loader's own generator's, else torch's (``seed_everything`` sets both)."""
    import torch

    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator):
        return int(generator.initial_seed())
    sampler_generator = getattr(getattr(loader, "sampler", None), "generator", None)
    if isinstance(sampler_generator, torch.Generator):
        return int(sampler_generator.initial_seed())
    return int(torch.initial_seed())


def is_shuffled(loader: DataLoader[Any]) -> bool:
    """Whether the user's loader draws a new order every epoch (anything but a sequential order)."""
    from torch.utils.data import SequentialSampler

    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle)
    return not isinstance(sampler, SequentialSampler)


class TrainLoaderHook:
    """Wraps the train dataloader source of a fit so that what it returns can be replaced.

    ``convert(loader)`` gets what ``train_dataloader()`` returned and returns the loader to train on.
    While :meth:`paused` (a search's probes), the user's loader passes through unchanged.
    """

    def __init__(self, convert: Callable[[Any], Any]) -> None:
        self.convert = convert
        self._paused = 0
        self._source: Any = None

    def install(self, trainer: Any) -> None:
        source = compat.dataloader_source(trainer, "train")
        original = type(source).dataloader.__get__(source)

        def dataloader() -> Any:
            loader = original()
            return loader if self._paused else self.convert(loader)

        source.dataloader = dataloader
        self._source = source

    def uninstall(self) -> None:
        if self._source is not None and "dataloader" in vars(self._source):
            del self._source.dataloader
        self._source = None

    @property
    def installed(self) -> bool:
        return self._source is not None

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __getstate__(self) -> dict[str, Any]:
        return {"convert": self.convert, "_paused": 0, "_source": None}  # ddp_spawn pickles the callback


__all__ = [
    "BucketBatchSampler",
    "TrainLoaderHook",
    "is_shuffled",
    "loader_seed",
    "with_batch_sampler",
]
