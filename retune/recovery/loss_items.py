"""What a token-mean loss averages over, counted per micro-batch (``loss_reduction: token_mean``; no Lightning here).

Hugging Face's token-classification, masked-LM and causal-LM losses are means over the *labelled
tokens* of a batch (labels that are not ``-100``), not over its samples. Splitting such a batch in
micro-batches and weighting each by its share of the samples gives another update: the pieces hold
different numbers of labelled tokens (transformers fixed the same bug in its gradient accumulation
in 2024 with ``num_items_in_batch``). Each micro-batch's loss must be weighted by its share of the
counted items instead, which is what this module counts:

* ``labels`` (the default): the entries of ``batch["labels"]`` that are not ``-100``, for a dict or
  ``BatchEncoding`` batch: token classification and masked LM, where the loss compares every
  labelled position with its own label;
* ``shifted_labels``: ``batch["labels"][..., 1:]`` that are not ``-100``, the positions a causal LM's
  shifted loss uses (position ``t`` predicts label ``t + 1``, so each row's first label is never
  a target);
* a function ``fn(batch) -> int`` (or a 0-dim integer tensor) for anything else: class-weighted
  cross-entropy (the sum of the weights of the batch's labels), a loss over another key.

retune does not guess whether a loss is a token mean: it cannot see inside ``training_step``. It
can see a hint, per-token ``labels`` with ignored positions, and :func:`token_labels_hint` lets the
callback warn once at fit start when ``loss_reduction`` is still ``mean``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch

from retune.errors import RetuneError
from retune.probing.sample_sizes import resolve_size_fn

IGNORE_INDEX = -100
"""The label value Hugging Face's (and torch's default) cross-entropy ignores."""

ItemsFn = Callable[[Any], Any]
"""``fn(batch) -> int``: the number of items a batch's token-mean loss averages over."""


def _labels(batch: Any, who: str) -> torch.Tensor:
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor):
        return labels
    if isinstance(batch, Mapping):
        found = f"its keys are {sorted(map(str, batch.keys()))}" if labels is None else "its `labels` is not a tensor"
    else:
        found = f"it is a {type(batch).__name__}, not a dict or BatchEncoding"
    raise RetuneError(
        f"loss_reduction: token_mean counts {who} under the `labels` key of a dict/BatchEncoding batch, but {found}; "
        "give the oom trigger `loss_items: mypkg.items.count` (or ScheduledBatchSizeFinder(loss_items=fn)) with "
        "fn(batch) -> the number of items the loss averages over"
    )


def label_items(batch: Any) -> int:
    """Labels that are not ``-100`` in ``batch["labels"]`` (token classification, masked LM).

    Args:
        batch: a mapping with a ``labels`` tensor (``-100`` marks ignored positions).
    """
    return int((_labels(batch, "the labels that are not -100") != IGNORE_INDEX).sum())


def shifted_label_items(batch: Any) -> int:
    """Labels after each row's first that are not ``-100``: the targets of a causal LM's shifted loss.

    Args:
        batch: a mapping with a ``labels`` tensor of shape ``(batch, sequence, ...)``.
    """
    labels = _labels(batch, "the shifted labels that are not -100")
    if labels.dim() == 0:
        raise RetuneError("loss_items: shifted_labels needs per-token labels (batch, tokens), got a 0-dim `labels`")
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


BUILTIN: dict[str, ItemsFn] = {"labels": label_items, "shifted_labels": shifted_label_items}


def resolve_items_fn(spec: str | ItemsFn | None) -> ItemsFn:
    """The counting function for ``spec``: a built-in name, a dotted path, a callable, or None (``labels``).

    Raises ValueError naming what failed (module, attribute, value); the caller adds the field.

    Args:
        spec: ``labels``, ``shifted_labels``, a dotted path ``pkg.mod.fn`` to ``fn(batch) -> int``, such a function
            itself, or None (``labels``).
    """
    if spec is None:
        return label_items
    if callable(spec):
        return spec
    if spec in BUILTIN:
        return BUILTIN[spec]
    return resolve_size_fn(spec)


def count_items(fn: ItemsFn, batch: Any) -> int:
    """``fn(batch)`` as an int >= 0, or a RetuneError that names the function and the value.

    Args:
        fn: the counting function (:func:`resolve_items_fn`'s result).
        batch: the batch (or micro-batch) whose loss items to count.
    """
    value = fn(batch)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    try:
        if isinstance(value, bool):
            raise TypeError
        count = operator.index(value)
    except TypeError:
        raise RetuneError(
            f"loss_items {_name(fn)} returned {value!r} ({type(value).__name__}); it must return an int, the number "
            "of items the batch's loss averages over"
        ) from None
    if count < 0:
        raise RetuneError(f"loss_items {_name(fn)} returned {count}; counts must be >= 0")
    return count


def token_labels_hint(batch: Any) -> bool:
    """True when ``batch["labels"]`` is per token (2 or more dimensions) with ignored (``-100``) positions:
    most likely a loss averaged over labelled tokens. A hint for a warning, never acted on silently.

    Args:
        batch: the batch a step trains on.
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    return isinstance(labels, torch.Tensor) and labels.dim() >= 2 and bool((labels == IGNORE_INDEX).any())


def _name(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}.{qualname}" if module else str(qualname)


__all__ = [
    "BUILTIN",
    "IGNORE_INDEX",
    "ItemsFn",
    "count_items",
    "label_items",
    "resolve_items_fn",
    "shifted_label_items",
    "token_labels_hint",
]
