"""Fake stand-ins for a run's training state: parameters, buffers and optimizers, without copying data.

A traced step must see tensors of the real shapes, dtypes and devices (that is what its memory
depends on) and must not be able to write to the real ones. :func:`fake_training_state` makes one
fake tensor per real storage with ``FakeTensorMode.from_tensor`` (metadata only: a fake tensor
holds no data; tied weights stay tied because the mode memoises real -> fake), and
:func:`swapped_in` puts the fakes into the module's ``_parameters``/``_buffers`` for the length of
the trace, so the user's ``training_step`` runs unchanged on them and every write (a BatchNorm's
running statistics, ``num_batches_tracked``) lands on a fake.

Optimizers are *cloned over the fake parameters*, not modelled analytically per optimizer kind: a
shallow copy of the real optimizer object (its class, hyperparameters and hooks; ``__init__`` is not
called, so any ``Optimizer`` subclass works without knowing its constructor) with fake param groups
and a fake copy of its state, without the wrappers installed on the object over its methods (an LR
scheduler's over ``step`` calls the real optimizer). Running the real ``step`` code on fakes accounts for whatever state
that optimizer keeps (Adam's two moments, SGD's momentum buffer, none for plain SGD), creates it at
the first step exactly as the real one would, and counts its temporaries; an analytic table would
miss all three for optimizers it does not list. Scalar state (Adam's ``step``) is faked as a
*constant* holding a private copy of its value, because ``step`` reads it back with ``.item()``,
which a fake tensor without a value refuses; a copy, because the fake mode computes in place on a
constant's value.

Under FSDP2 the parameters and the optimizer state are ``DTensor`` shards; their fakes are plain tensors of
the *whole* shape (``DTensor.shape``), so the traced module computes as FSDP2 computes each module between
its all-gather and its reshard (:func:`retune.distributed.fsdp2.hooks_removed` keeps FSDP2's hooks out of the
trace; :class:`~retune.distributed.fsdp2.ShardAccount` turns the whole state's bytes into a rank's).
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from retune.distributed.local_shards import is_sharded

__all__ = ["FakeTrainingState", "cloned_optimizer", "fake_tensor", "fake_training_state", "swapped_in"]


@dataclass
class FakeTrainingState:
    """Fakes of a module's parameters and buffers by qualified name (tied names share one fake), and
    optimizers that hold the fakes in place of the real parameters."""

    parameters: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizers: list[torch.optim.Optimizer]


def fake_tensor(mode: FakeTensorMode, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fake of ``tensor``; a one-element CPU tensor is a constant over a private copy of its value; an FSDP2
    shard a plain fake of the whole tensor, in ``dtype`` where given (the dtype FSDP2 computes it in)."""
    if is_sharded(tensor):  # an FSDP2 shard: a plain fake of the whole tensor (see the module doc)
        with mode:
            whole = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=tensor.device)
        if isinstance(tensor, torch.nn.Parameter):  # a Parameter, as mode.from_tensor keeps one
            return torch.nn.Parameter(whole, requires_grad=tensor.requires_grad)
        return whole.requires_grad_(tensor.requires_grad)
    if tensor.numel() <= 1 and tensor.device.type == "cpu":
        # a scalar the optimizer reads back with .item(): a constant, over a copy of its value
        converter = mode.fake_tensor_converter
        return converter.from_real_tensor(mode, tensor.detach().clone(), make_constant=True)
    return mode.from_tensor(tensor)


def fake_training_state(
    mode: FakeTensorMode,
    module: torch.nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    compute_dtypes: Mapping[int, torch.dtype] | None = None,
) -> FakeTrainingState:
    """Fakes for ``module``'s parameters and buffers and clones of ``optimizers`` over them (see module doc).

    ``compute_dtypes`` (``id`` of a sharded parameter -> dtype: :func:`retune.distributed.fsdp2.compute_dtypes`)
    fakes those parameters in the dtype FSDP2's ``MixedPrecisionPolicy`` gathers and computes them in, for a
    trace of forward and backward; the optimizers then hold those fakes too, so such a trace takes the
    update's phase from :func:`retune.prediction.trace.trace_update` instead of running it."""
    fakes: dict[int, torch.Tensor] = {}  # one fake per real tensor: tied names, and the optimizers' references
    dtypes = compute_dtypes or {}

    def fake(tensor: torch.Tensor, scalar_constant: bool = False) -> torch.Tensor:
        if id(tensor) not in fakes:
            constant = scalar_constant and tensor.dim() == 0 and tensor.device.type == "cpu"
            fakes[id(tensor)] = (
                fake_tensor(mode, tensor, dtypes.get(id(tensor)))
                if is_sharded(tensor) or constant
                else mode.from_tensor(tensor)
            )
        return fakes[id(tensor)]

    parameters = {name: fake(p) for name, p in module.named_parameters(remove_duplicate=False)}
    # a scalar buffer is a constant over a copy of its value: BatchNorm with momentum=None reads its
    # num_batches_tracked back (float()), which a plain fake cannot answer
    buffers = {
        name: fake(b, scalar_constant=True) for name, b in module.named_buffers(remove_duplicate=False) if b is not None
    }
    return FakeTrainingState(
        parameters, buffers, [cloned_optimizer(opt, fake, lambda value: fake_tensor(mode, value)) for opt in optimizers]
    )


def cloned_optimizer(
    optimizer: torch.optim.Optimizer,
    param_of: Callable[[torch.Tensor], torch.Tensor],
    value_of: Callable[[torch.Tensor], torch.Tensor],
) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` (see the module doc) whose param groups hold ``param_of`` of each parameter
    and whose state holds ``value_of`` of each tensor (other values copied), keyed by the new parameters."""
    clone = object.__new__(type(optimizer))
    clone.__dict__.update(optimizer.__dict__)
    for name in _patched_methods(optimizer):
        # an instance-level wrapper of a method calls the real optimizer: every torch LR scheduler wraps `step`
        # so (``func.__get__(opt_ref())``), which would run the real update inside the trace; the clone uses
        # its class's own method, bound to itself
        del clone.__dict__[name]

    clone.param_groups = [
        {**group, "params": [param_of(p) for p in group["params"]]} for group in optimizer.param_groups
    ]
    state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
    for param, values in optimizer.state.items():
        key = param_of(param) if isinstance(param, torch.Tensor) else param
        state[key] = {
            name: value_of(value) if isinstance(value, torch.Tensor) else copy.copy(value)
            for name, value in values.items()
        }
    clone.state = state
    for name, value in optimizer.__dict__.items():
        if isinstance(value, OrderedDict):  # the per-optimizer hook registries: the clone's own copies
            setattr(clone, name, OrderedDict(value))
    return clone


def _patched_methods(optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of ``optimizer``'s methods that its instance overrides with a callable of its own (a wrapper
    installed on the object, such as an LR scheduler's on ``step``)."""
    cls = type(optimizer)
    return [
        name
        for name, value in vars(optimizer).items()
        if callable(value) and callable(getattr(cls, name, None)) and not isinstance(value, type)
    ]


@contextmanager
def swapped_in(module: torch.nn.Module, state: FakeTrainingState) -> Iterator[None]:
    """``module``'s parameters and buffers are ``state``'s fakes inside the block; afterwards every submodule's
    parameters, buffers and submodules are exactly what they were (the same real objects under the same names),
    whatever the block did: a step that registers a tensor or a module of its own inside a trace (a cache made at its
    first call, a slot registered as None and filled, a layer built lazily or replaced) made it of fakes, which must
    not outlive the trace on the real module."""
    tables = ("_parameters", "_buffers", "_modules")
    saved = [
        (sub, [dict(getattr(sub, table)) for table in tables], set(sub._non_persistent_buffers_set))
        for sub in module.modules()
    ]
    try:
        for table, fakes in (("_parameters", state.parameters), ("_buffers", state.buffers)):
            for name, fake in fakes.items():
                owner_name, _, leaf = name.rpartition(".")
                entries: dict[str, Any] = getattr(module.get_submodule(owner_name), table)
                entries[leaf] = fake
        yield
    finally:
        for sub, contents, non_persistent in saved:
            for table, content in zip(tables, contents, strict=True):
                entries = getattr(sub, table)
                entries.clear()  # the same dict objects, back to their contents and order
                entries.update(content)
            sub._non_persistent_buffers_set.clear()
            sub._non_persistent_buffers_set.update(non_persistent)
