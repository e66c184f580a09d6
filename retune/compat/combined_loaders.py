"""What a ``*_dataloader()`` hook returned, iterated the way Lightning's loops iterate it.

A train hook may return one loader, a dict, list or tuple of loaders (nested at will), or a
``CombinedLoader`` the user built in any mode. Lightning's fit loop wraps everything that is not
already a ``CombinedLoader`` in one (``max_size_cycle`` on 2.x; on 1.9 the trainer's
``multiple_trainloader_mode``) and iterates that, so a probe does the same: the batches it runs are
the ones training would run, in the user's mode (``max_size_cycle``, ``min_size``, ``max_size``,
whose exhausted loaders give None). A 2.x ``CombinedLoader`` yields ``(batch, batch_idx,
dataloader_idx)``; the training step receives only the batch. (``sequential`` is refused by
Lightning's fit loop itself; evaluation loops run it, see ``retune.compat.data.eval_dataloaders``.)

The search's cap (the most samples one rank's epoch can put in a batch, :func:`dataset_length`) needs the
loaders inside such a structure:
:func:`leaf_loaders` finds them in any nesting of dicts, lists, tuples and ``CombinedLoader`` s.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any

import torch

from retune.compat.namespace import import_module, is_legacy, namespace_of
from retune.errors import RetuneError

_COMBINED_MODULES = (
    "lightning.pytorch.utilities.combined_loader",  # 2.x
    "pytorch_lightning.utilities.combined_loader",  # pytorch_lightning 2.x
    "pytorch_lightning.trainer.supporters",  # 1.9
)


def is_combined_loader(obj: Any) -> bool:
    """True for a Lightning ``CombinedLoader`` of either line (found by class, so no Lightning import)."""
    return any(cls.__name__ == "CombinedLoader" and cls.__module__ in _COMBINED_MODULES for cls in type(obj).__mro__)


def _yields_indices(combined: Any) -> bool:
    """2.x ``CombinedLoader`` iterators yield ``(batch, batch_idx, dataloader_idx)``; 1.9's yield the batch."""
    return hasattr(combined, "flattened")


class Batches:
    """The batches of a 2.x ``CombinedLoader``, without the indices its iterator adds."""

    def __init__(self, combined: Any) -> None:
        self.combined = combined

    def __iter__(self) -> Iterator[Any]:
        return (batch for batch, _, _ in self.combined)


def as_train_loader(trainer: Any, loader: Any) -> Any:
    """What the fit loop iterates for ``loader``: the user's ``CombinedLoader``, or one wrapping ``loader``."""
    if is_combined_loader(loader):
        return loader
    if is_legacy(trainer):
        combined = import_module(namespace_of(trainer) + ".trainer.supporters").CombinedLoader
        return combined(loader, trainer._data_connector.multiple_trainloader_mode)
    combined = import_module(namespace_of(trainer) + ".utilities.combined_loader").CombinedLoader
    return combined(loader, "max_size_cycle")


def train_batches(trainer: Any, loader: Any) -> Generator[Any, None, None]:
    """Endless training batches from what ``train_dataloader()`` returned, as the fit loop draws them;
    the loader starts over when it ends (a probe may need more steps than an epoch has)."""
    combined = as_train_loader(trainer, loader)
    batches = Batches(combined) if _yields_indices(combined) else combined
    while True:
        empty = True
        for batch in batches:
            empty = False
            yield batch
        if empty:
            raise RetuneError(
                "the train dataloader yielded no batches, so no batch size can be probed (with drop_last=True, "
                "a batch size above the samples its sampler draws per epoch gives none)"
            )


def leaf_loaders(loader: Any) -> list[Any]:
    """The loaders inside ``loader``: itself, or every loader in a nesting of dicts, lists, tuples and
    ``CombinedLoader`` s (a 2.x one lists them in ``flattened``, a 1.9 one keeps the user's structure)."""
    if is_combined_loader(loader):
        return leaf_loaders(list(loader.flattened) if hasattr(loader, "flattened") else loader.loaders)
    if type(loader).__name__ == "CycleIterator" and hasattr(loader, "loader"):
        return leaf_loaders(loader.loader)  # 1.9's max_size_cycle wraps each loader in one
    if isinstance(loader, Mapping):
        return [leaf for value in loader.values() for leaf in leaf_loaders(value)]
    if isinstance(loader, Sequence) and not isinstance(loader, (str, bytes)) and _all_iterable(loader):
        return [leaf for value in loader for leaf in leaf_loaders(value)]
    return [loader]


def train_loaders(trainer: Any) -> list[Any]:
    """The loaders the fit loop trains on now (after Lightning's processing and any reload); empty before it
    built them. ``trainer.train_dataloader`` is the user's structure on 2.x and a ``CombinedLoader`` on 1.9."""
    loader = trainer.train_dataloader
    return [] if loader is None else leaf_loaders(loader)


def _all_iterable(items: Sequence[Any]) -> bool:
    return len(items) > 0 and all(hasattr(item, "__iter__") and not isinstance(item, torch.Tensor) for item in items)


def dataset_length(loader: Any, world_size: int) -> int | None:
    """The most samples one batch of any of the loaders can hold: what one rank's epoch draws from the largest
    of them (None when any of them has no length, an iterable dataset).

    An epoch draws what the loader's sampler yields, not its dataset: a ``SubsetRandomSampler`` over 48 of 240
    samples, a ``WeightedRandomSampler(num_samples=100)``, a ``RandomSampler(num_samples=...)`` put that many
    samples in an epoch, and no batch holds more. Capped at ``len(dataset)`` instead, a search probed sizes whose
    batches held the 48 samples (and reported 240 verified), and with ``drop_last`` applied a size that trains no
    step at all. ``world_size`` is the number of ranks Lightning shards a sampler across (1 where it does not,
    ``use_distributed_sampler=False``): each rank then draws its ``ceil(n / world_size)``; a ``DistributedSampler``
    the loader already has is left alone by Lightning, and its length is one rank's share already.
    """
    lengths = []
    for leaf in leaf_loaders(loader):
        samples = epoch_samples(leaf, world_size)
        if samples is None:
            return None
        lengths.append(samples)
    return max(lengths) if lengths else None


def epoch_samples(loader: Any, world_size: int) -> int | None:
    """Samples one rank draws from ``loader`` per epoch: its sampler's length where it has one, else its dataset's,
    divided among the ``world_size`` ranks Lightning shards it across (see :func:`dataset_length`); None for an
    iterable dataset or a loader without a dataset."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    sampler = _epoch_sampler(loader)
    if isinstance(sampler, torch.utils.data.DistributedSampler):
        sharded = length_of(sampler)  # the user's own shard: Lightning keeps it, and it is per rank already
        if sharded is not None:
            return sharded
    samples = length_of(sampler) if sampler is not None else None
    if samples is None:
        samples = length_of(dataset)
    if samples is None:
        return None
    return -(-samples // max(world_size, 1))


def _epoch_sampler(loader: Any) -> Any:
    """The sampler that decides an epoch's samples: a ``BatchSampler``'s (or another batch sampler's ``sampler``),
    else the loader's own. With a custom batch sampler that has none, torch gives the loader a placeholder
    ``SequentialSampler`` over the whole dataset, which is what it then reports."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else None
    return inner if inner is not None else getattr(loader, "sampler", None)


def length_of(obj: Any) -> int | None:
    """``len(obj)``, or None where it has no length (a sampler without ``__len__``, an iterable dataset).

    >>> length_of([1, 2]), length_of(iter([1, 2]))
    (2, None)
    """
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


__all__ = [
    "Batches",
    "as_train_loader",
    "dataset_length",
    "epoch_samples",
    "is_combined_loader",
    "leaf_loaders",
    "length_of",
    "train_batches",
    "train_loaders",
]
