"""What a ``*_dataloader()`` hook returned, iterated the way Lightning's loops iterate it.

A train hook may return one loader, a dict, list or tuple of loaders (nested at will), or a
``CombinedLoader`` the user built in any mode. Lightning's fit loop wraps everything that is not
already a ``CombinedLoader`` in one (``max_size_cycle`` on 2.x; on 1.9 the trainer's
``multiple_trainloader_mode``) and iterates that, so a probe does the same: the batches it runs are
the ones training would run, in the user's mode (``max_size_cycle``, ``min_size``, ``max_size``,
whose exhausted loaders give None). A 2.x ``CombinedLoader`` yields ``(batch, batch_idx,
dataloader_idx)``; the training step receives only the batch. (``sequential`` is refused by
Lightning's fit loop itself; evaluation loops run it, see ``retune.compat.data.eval_dataloaders``.)

The dataset-length cap on the search needs the loaders inside such a structure:
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
            raise RetuneError("the train dataloader yielded no batches, so no batch size can be probed")


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
    """Samples one rank sees per epoch from the largest dataset among the loaders (None when any of them
    has no length, an iterable dataset): no batch of any of them can hold more."""
    lengths = []
    for leaf in leaf_loaders(loader):
        dataset = getattr(leaf, "dataset", None)
        if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
            return None
        try:
            lengths.append(-(-len(dataset) // max(world_size, 1)))
        except TypeError:
            return None
    return max(lengths) if lengths else None


__all__ = [
    "Batches",
    "as_train_loader",
    "dataset_length",
    "is_combined_loader",
    "leaf_loaders",
    "train_batches",
    "train_loaders",
]
