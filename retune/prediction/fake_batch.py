"""A batch of any size made of fake tensors, from one real batch of the same kind.

A trace only needs shapes, dtypes and devices, so a batch of ``size`` samples is the real batch's
structure with every per-sample tensor's leading dimension set to ``size``: nothing of that size is
ever allocated, so a prediction at 4096 images costs what one at 4 does. The batch dimension is the
one retune splits along when it recovers from an OOM (:func:`retune.recovery.split.batch_length`,
the leading dimension the batch's tensors share); a scalar tensor is faked unchanged, and lists of
per-sample Python values (file names, raw strings) are repeated to ``size``, as are lists of one same-shape tensor
per sample (:func:`~retune.recovery.split.per_sample_tensors`: a collate that keeps images as a list), each a
fake of its own. A tensor of another
leading length (a class-weight vector in the batch) makes the batch dimension ambiguous: the trace
cannot predict and says which field to move out of the batch, as the OOM recovery does. Containers
are rebuilt as their own type (dicts and other mappings, Hugging Face ``BatchEncoding`` included,
named tuples, dataclasses: their ``init`` fields, a field with ``init=False`` made again by their
``__post_init__``).

Sample sizes stay the real batch's: a batch padded to 512 tokens gives fake batches padded to 512.
Per bucket, trace that bucket's own batch (its longest samples) at the sizes to fit.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from retune.prediction.fake_state import fake_tensor
from retune.recovery.split import SplitError, batch_length, per_sample_tensors

__all__ = ["fake_batch"]


def fake_batch(batch: Any, size: int, mode: FakeTensorMode, device: torch.device | None = None) -> Any:
    """``batch`` with ``size`` samples, as fake tensors of ``mode`` (see the module doc), on ``device``
    (default: where each tensor is).

    Raises :class:`~retune.recovery.split.SplitError` when the batch has no batch dimension retune can
    tell (the trace then cannot predict, and says why).
    """
    if size < 1:
        raise ValueError(f"a batch needs at least one sample, got size={size}")
    total = batch_length(batch)
    if total is None:
        raise SplitError(f"this {type(batch).__name__} batch holds no tensor with a batch dimension")
    return _resize(batch, size, total, mode, device, top=True)


def _resize(
    value: Any, size: int, total: int, mode: FakeTensorMode, device: torch.device | None, top: bool = False
) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != total:
            return fake_tensor(mode, value)  # not per sample: as it is (a scalar keeps its value)
        with mode:  # no data to copy: an empty fake of the new shape, on the target device
            return torch.empty((size, *value.shape[1:]), dtype=value.dtype, device=device or value.device)
    if isinstance(value, (str, bytes)) or value is None or isinstance(value, (int, float, bool)):
        return value
    if isinstance(value, Mapping):
        items = {key: _resize(item, size, total, mode, device) for key, item in value.items()}
        if type(value) is dict:
            return items
        try:
            return type(value)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {  # init fields only: replace() refuses a field with init=False (its __post_init__ makes it)
            f.name: _resize(getattr(value, f.name), size, total, mode, device)
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, (list, tuple)):
        if not top and per_sample_tensors(value, total):
            with mode:  # one tensor per sample, each its own fake: a fake met twice counts its bytes once
                parts = [
                    torch.empty(item.shape, dtype=item.dtype, device=device or item.device)
                    for item in itertools.islice(itertools.cycle(value), size)
                ]
        elif _holds_batches(value):
            parts = [_resize(item, size, total, mode, device) for item in value]
        elif len(value) == total:
            parts = list(itertools.islice(itertools.cycle(value), size))  # per-sample values, repeated
        else:
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*parts)
        return type(value)(parts)
    raise SplitError(f"a {type(value).__name__} in the batch: retune cannot tell its batch dimension")


def _holds_batches(value: list[Any] | tuple[Any, ...]) -> bool:
    """``(x, y)`` rather than a list of per-sample values: the rule :func:`~retune.recovery.split.split_batch` uses."""
    return any(
        (isinstance(item, torch.Tensor) and item.dim() > 0)
        or isinstance(item, (Mapping, list, tuple))
        or (dataclasses.is_dataclass(item) and not isinstance(item, type))
        for item in value
    )
