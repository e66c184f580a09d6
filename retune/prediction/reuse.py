"""What a traced prediction depends on, as a key: a later search whose training state did not change reuses it.

A trace is a pure function of the module's parameters and buffers (their shapes, dtypes, devices, which ones
train), its train/eval flags, the optimizers (their kind, their param groups, the options that decide what
state and temporaries an update makes, and the state each parameter has), the batch's structure (dtypes
and per-sample shapes) and the size traced. :func:`trace_key` reads all of that without touching a value:
equal keys, equal traces. A search at an epoch milestone or an ``oom`` re-search after nothing of that
changed then costs its verifying probes only (on the issue-29 BERT a trace is 2-4 real steps).

What it cannot see is code: a ``training_step`` that branches on the epoch, a module attribute that turns
activation checkpointing on. Such a change keeps the old prediction, and the verifying probes, which every
size still needs, measure the truth: the search then corrects from them (more probes, never a size that was
not verified).

>>> import torch
>>> model = torch.nn.Linear(4, 2)
>>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
>>> batch = torch.zeros(2, 4)
>>> trace_key(model, [optimizer], batch, 8) == trace_key(model, [optimizer], batch, 8)
True
>>> model.weight.requires_grad_(False)
Parameter containing:...
>>> trace_key(model, [optimizer], batch, 8) == trace_key(model.requires_grad_(True), [optimizer], batch, 8)
False
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import torch

from retune.distributed.local_shards import local

__all__ = ["TraceMemo", "Unkeyable", "forget", "memo_for", "trace_key"]


class Unkeyable(Exception):
    """Something a trace depends on that :func:`trace_key` cannot describe: that trace is not remembered."""


def _tensor(tensor: torch.Tensor) -> Hashable:
    shard = local(tensor)
    return (tuple(tensor.shape), tuple(shard.shape), str(tensor.dtype), str(tensor.device), tensor.requires_grad)


def _option(value: Any) -> Hashable:
    """An optimizer option as far as memory goes: flags and names as they are, a number as zero or not (a
    weight decay or a momentum of 0 makes no temporary or no buffer; its size does not matter)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return value != 0
    if isinstance(value, (tuple, list)):
        return tuple(_option(v) for v in value)
    return type(value).__name__


def _state_value(value: Any) -> Hashable:
    """A value of an optimizer's state: a tensor by its shape, dtype and device, a plain number by its type (a
    step count changes at every step, its memory does not); anything else is not described."""
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value).__name__
    raise Unkeyable(f"optimizer state holds a {type(value).__name__}")


def _batch(value: Any) -> Hashable:
    """A batch as a trace sees it (:func:`retune.prediction.fake_batch.fake_batch`'s walk): each tensor by its
    dtype, device and per-sample shape, each plain value as it is (a step may branch on it), containers by
    their type and their items; anything else is not described."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), str(value.device), tuple(value.shape[1:]) if value.dim() else None)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, Mapping):
        return (type(value).__qualname__, tuple((key, _batch(item)) for key, item in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = tuple((f.name, _batch(getattr(value, f.name))) for f in dataclasses.fields(value))
        return (type(value).__qualname__, fields)
    if isinstance(value, (list, tuple)):
        return (type(value).__qualname__, tuple(_batch(item) for item in value))
    raise Unkeyable(f"a {type(value).__name__} in the batch")


def trace_key(
    module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer], batch: Any, size: int, *extra: Hashable
) -> Hashable:
    """Everything a trace of ``module``'s step on ``batch`` at ``size`` depends on but its code (module doc).

    Raises :class:`Unkeyable` where something is not described (a batch or optimizer state of a kind it does not
    know): such a trace is not remembered."""
    ids: dict[int, int] = {}
    for p in module.parameters():
        ids.setdefault(id(p), len(ids))
    params = tuple(
        (name, ids[id(p)], _tensor(p)) for name, p in module.named_parameters(remove_duplicate=False)
    )  # the index: which names share one tensor (tied weights)
    buffers = tuple((name, _tensor(b)) for name, b in module.named_buffers() if b is not None)
    modes = tuple(sub.training for sub in module.modules())
    optimizer_keys = []
    for optimizer in optimizers:
        groups = tuple(
            (
                tuple(ids.get(id(p), -1) for p in group["params"]),
                tuple(sorted((str(k), _option(v)) for k, v in group.items() if k != "params")),
            )
            for group in optimizer.param_groups
        )
        state = []
        for owner, values in optimizer.state.items():
            if not isinstance(owner, torch.Tensor) or not isinstance(values, Mapping):
                raise Unkeyable(f"optimizer state under a {type(owner).__name__}")
            described = tuple(sorted((str(k), _state_value(v)) for k, v in values.items()))
            state.append((ids.get(id(owner), -1), _tensor(owner), described))
        optimizer_keys.append((type(optimizer).__qualname__, groups, tuple(sorted(state, key=repr))))
    return (type(module).__qualname__, params, buffers, modes, tuple(optimizer_keys), _batch(batch), size, extra)


class TraceMemo:
    """The last ``capacity`` traced results of one module's step, by :func:`trace_key`: :func:`memo_for`."""

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = 0
        self.replays: bool | None = None
        """Whether a replay of a recorded trace of this module's step equalled a trace at another size in this
        fit (:class:`retune.search.predict_run.Replaying`); None: not checked yet."""
        self.activation_sizes: set[int] = set()
        """The sizes of the model's own activations that this fit's recorded traces showed
        (:func:`retune.prediction.replay.activation_sizes`): every later replay and tag size takes them as the
        model's."""

    def get(self, key: Hashable) -> Any:
        if key in self._entries:
            self._entries.move_to_end(key)
            self.hits += 1
            return self._entries[key]
        return None

    def put(self, key: Hashable, value: Any) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


_MEMOS: weakref.WeakKeyDictionary[torch.nn.Module, TraceMemo] = weakref.WeakKeyDictionary()


def memo_for(module: torch.nn.Module) -> TraceMemo:
    """``module``'s memo of traced results: it lives as long as the module, and :func:`forget` empties it (the
    finder does at every fit's start, so each fit traces its own first search)."""
    memo = _MEMOS.get(module)
    if memo is None:
        memo = _MEMOS[module] = TraceMemo()
    return memo


def forget(module: torch.nn.Module) -> None:
    """Drop ``module``'s memo of traced results."""
    _MEMOS.pop(module, None)
