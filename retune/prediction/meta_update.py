"""The optimizer update of a traced CPU step, measured on ``meta`` tensors instead of fake ones.

Why: a fake tensor's operator runs its ``meta`` kernel and then FakeTensorMode's own work on top (the cache key,
a fake wrapper for every result, and on a cache miss the cache entry), and an update's operators miss that cache
wherever the trace meets a parameter shape for the first time: after an unfreeze, every newly trainable one. On
the issue-29 BERT (41 parameters, AdamW, one thread) the update is about 500 operators: 0.05 s on fakes, 0.026 s
on ``meta`` tensors, about a quarter of a re-tune's trace (``tests/benchmarks/bench_prediction.py``).

How: the fake optimizer clone the trace runs (:mod:`~retune.prediction.fake_state`) is cloned once more
(:func:`~retune.prediction.fake_state.cloned_optimizer`) over ``meta`` tensors of the same shapes, strides and
dtypes: each fake parameter, the fake gradient backward left on it (a parameter without one is skipped by the
update, as in the step), and its state; a scalar state kept as a fake constant (Adam's ``step``, read back with
``.item()``) is a private CPU copy of its value. Its ``step`` runs outside the fake mode, counted by a
:class:`~retune.memory.CpuPeakTracker` of ``meta`` and CPU tensors (the scalars a CPU update creates are CPU
tensors, as the fake update's are): its peak above its start, the state it created and its own need are the
update's :class:`~retune.prediction.trace.OptimizerPhase`, and the trace accounts the update as it accounts a
reused phase.

Where: only for a step whose module lives on the CPU (the caller checks). An optimizer picks its implementation by
its parameters' device (torch's ``foreach`` and ``fused`` defaults are for CUDA); a ``meta`` parameter picks as a
CPU one does, so the temporaries counted are the CPU update's; a CUDA update is traced on fakes of its device.
Anything that fails here (an optimizer that reads a tensor's value, ``capturable``, a sparse gradient, a state
value the mirror cannot make) returns None, and the trace runs the update on fakes as before. Nothing real is
written: outside the fake mode an operator on a real tensor would run for real, so every operator given a real
tensor the update did not make (or hold as its private scalar copy) is refused before it runs (an optimizer
wrapping another, whose inner optimizer holds the real parameters, falls back to the fakes, which refuse it too).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim import optimizer as torch_optimizer
from torch.utils._python_dispatch import _disable_current_modes

from retune.memory import FRESH_OPS, CpuPeakTracker, resident_bytes, storages_of, tensors_in
from retune.prediction.fake_state import cloned_optimizer

__all__ = ["meta_eligible", "update_on_meta"]


def meta_eligible(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the trace may measure ``optimizer``'s update on ``meta`` tensors: one of torch's own optimizers
    (``torch.optim``, not a subclass: a ``step`` of its own may keep views, draw random numbers, make tensors on a
    named device or step an inner optimizer over the real parameters) with no step hook, its own or global (a hook
    would run twice where the meta update fails and the fakes then run it).

    >>> meta_eligible(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]))
    True
    """
    try:
        cls = type(optimizer)
        module = str(cls.__module__)
        if not (module == "torch.optim" or module.startswith("torch.optim.")):
            return False
        if getattr(torch.optim, cls.__name__, None) is not cls:
            return False
        registries = (
            getattr(optimizer, "_optimizer_step_pre_hooks", None),
            getattr(optimizer, "_optimizer_step_post_hooks", None),
            getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
            getattr(torch_optimizer, "_global_optimizer_post_hooks", None),
        )
        return not any(registries)
    except Exception:  # an object this cannot read: the fakes measure its update
        return False


def update_on_meta(
    optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None, kwargs: Mapping[str, Any]
) -> tuple[int, int, int] | None:
    """``optimizer``'s update (a fake clone inside a trace) run on ``meta`` mirrors of its parameters, gradients
    and state: ``(extra, created, need)`` bytes, as :class:`~retune.prediction.trace.OptimizerPhase` holds them;
    None where it cannot be measured this way (the caller runs the update on the fakes).

    Args:
        optimizer: the optimizer whose ``step`` to measure (a fake clone, or a real optimizer: neither is written);
            its parameters' gradients are the ones to update.
        closure: what the update is passed as its closure (the caller's, which returns the loss already computed),
            or None.
        kwargs: further keyword arguments of the ``step`` call.

    >>> p = torch.nn.Parameter(torch.empty(1000, device="meta"))
    >>> p.grad = torch.empty(1000, device="meta")
    >>> update_on_meta(torch.optim.SGD([p], lr=0.1, momentum=0.9), None, {})   # the momentum buffer, 4000 bytes
    (4000, 4000, 0)
    """
    try:
        if _autocast_enabled():  # an update inside autocast (a manual step's): autocast casts CPU tensors, not meta
            return None
        with _disable_current_modes():
            return _measured(optimizer, closure, kwargs)
    except Exception:  # any failure: the fake update measures it instead
        return None


def _autocast_enabled() -> bool:
    """Whether autocast is on for the CPU (or any device) where the update would run."""
    try:
        return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))
    except TypeError:  # an older torch: no device argument
        return bool(torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled())


def _measured(
    optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None, kwargs: Mapping[str, Any]
) -> tuple[int, int, int] | None:
    mirrors: dict[int, torch.Tensor] = {}  # one mirror per tensor: a parameter in two groups stays one
    own: set[int] = set()  # the real tensors the update may touch: the scalar copies (and what it makes, _MetaOnly)

    def param_of(param: torch.Tensor) -> torch.Tensor:
        if id(param) not in mirrors:
            mirror = torch.nn.Parameter(_meta(param), requires_grad=param.requires_grad)
            if param.grad is not None:
                mirror.grad = _meta(param.grad)
            mirrors[id(param)] = mirror
        return mirrors[id(param)]

    def value_of(value: torch.Tensor) -> torch.Tensor:
        """A CPU scalar (``step``, read back with ``.item()``): a private copy of its value; any other tensor (a
        one-element parameter's moments too, which meet its meta gradient): a meta one."""
        if value.dim() != 0 or value.device.type != "cpu":
            return _meta(value)
        constant = value.constant if isinstance(value, FakeTensor) else value  # fake_state's copy of the value
        if not isinstance(constant, torch.Tensor):
            return _meta(value)
        copy = constant.detach().clone()
        own.add(copy.untyped_storage()._cdata)
        return copy

    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and param.grad.layout != torch.strided:
                return None  # a sparse gradient (nn.Embedding(sparse=True)): its parts, not one strided tensor
    mirror = cloned_optimizer(optimizer, param_of, value_of)
    nothing = torch.nn.Module()  # resident_bytes of the mirror's state alone
    before = resident_bytes(nothing, [mirror])
    with _MetaOnly(own) as tracker:
        tracker.log_new_storages()
        if closure is not None:
            mirror.step(closure, **kwargs)
        else:
            mirror.step(**kwargs)
        need = tracker.own_need(0)
    created = max(0, resident_bytes(nothing, [mirror]) - before)
    return tracker.peak_bytes, created, need


class _RealTensorReached(RuntimeError):
    """The update reached a real tensor it did not make (see :class:`_MetaOnly`)."""


class _MetaOnly(CpuPeakTracker):  # type: ignore[no-untyped-call]
    """The update's tracker, which refuses any operator given a real tensor the update neither made nor holds as
    the mirror's private scalar copy, *before* it runs: an optimizer that wraps another (``ZeroRedundancyOptimizer``,
    a Lookahead) steps its inner optimizer, whose parameters and state are the real ones, and outside the fake mode
    (which refuses every real tensor) nothing else would stop that update from writing the real weights."""

    def __init__(self, own: set[int]) -> None:
        super().__init__(("meta", "cpu"))
        self.own = own

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            raise _RealTensorReached(f"{func} draws random numbers (a generator of the run's would advance)")
        for value in (*args, *(kwargs or {}).values()):
            if isinstance(value, (torch.UntypedStorage, torch.TypedStorage)) and value.device.type != "meta":
                raise _RealTensorReached(f"{func} reached a real storage")
        fresh = func in FRESH_OPS  # its input is a tensor just made from Python data, unless it aliases numpy's
        for tensor in tensors_in((args, kwargs) if kwargs else args):
            if tensor.is_meta or (fresh and tensor.untyped_storage().resizable()):
                continue
            if any(s._cdata not in self.own for s in storages_of(tensor)):
                raise _RealTensorReached(f"{func} reached a real tensor of shape {tuple(tensor.shape)}")
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for tensor in tensors_in(out):
            if not tensor.is_meta:
                self.own.update(s._cdata for s in storages_of(tensor))
        return out


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    """A ``meta`` tensor of ``tensor``'s shape, strides and dtype (a fake or a real one): no memory, no data."""
    return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="meta")
