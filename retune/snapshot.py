"""Capture what a probe step can change, and put it back bit for bit.

Lightning's finder saves a full checkpoint to disk and loads it back. A probe can only change
what an optimizer step and a forward pass touch, so this snapshot copies exactly that:

* parameters that can receive a gradient (``requires_grad``, or already holding a ``.grad``) and
  their gradients; frozen parameters are left alone, so a frozen backbone costs nothing. Gradients
  in host memory are not copied at all: capture takes the tensor off its parameter and restore
  puts the same tensor back, so no probe step can write into it (device gradients are copied to
  the host, so that they do not take device memory from the probe);
* all buffers (batch-norm statistics move in any training forward) and train/eval flags;
* torchmetrics states (plain attributes, not buffers: a ``Metric`` updated in ``training_step``,
  as every Flash Task does, would otherwise count the probe's batches in the epoch's value);
* optimizer state and hyperparameters, LR scheduler and grad scaler state;
* RNG states (python, numpy, torch, CUDA) and any extra generators (a sampler's own generator);
* any extra ``state_dict``/``load_state_dict`` objects (the loops' progress counters).

Copies live in host memory, so the snapshot does not take device memory away from the probe it
protects, and all of them share one allocation (:mod:`retune.host_copy` says why that matters).
Restoring writes back *in place*: parameter, buffer and optimizer-state tensors keep their
identity, which matters to anything holding a reference (``LightningOptimizer`` shares the
optimizer's ``state`` dict, DDP's reducer holds the parameters).
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from retune.host_copy import host_copies


@dataclass
class _ParamState:
    param: nn.Parameter
    data: torch.Tensor
    grad: torch.Tensor | None
    grad_is_held: bool = False  # ``grad`` is the parameter's own gradient tensor, not a copy


@dataclass
class _TensorCopy:
    """An optimizer-state tensor and its host copy (a marker no user state value can be mistaken for)."""

    original: torch.Tensor
    host: torch.Tensor


@dataclass
class _OptimizerState:
    optimizer: torch.optim.Optimizer
    # per parameter: key -> _TensorCopy (written back in place) or a plain value
    state: dict[Any, dict[str, Any]]
    groups: list[dict[str, Any]]


@dataclass
class TrainingSnapshot:
    """An in-memory copy of the state a probe can change. Create with :meth:`capture`."""

    params: list[_ParamState] = field(default_factory=list)
    buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    modes: list[tuple[nn.Module, bool]] = field(default_factory=list)
    optimizers: list[_OptimizerState] = field(default_factory=list)
    stateful: list[tuple[Any, Any]] = field(default_factory=list)
    counters: list[tuple[Any, str, Any]] = field(default_factory=list)
    metrics: list[tuple[nn.Module, dict[str, Any]]] = field(default_factory=list)
    rng: dict[str, Any] = field(default_factory=dict)
    generators: list[tuple[torch.Generator, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0

    @classmethod
    def capture(
        cls,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        stateful: Iterable[Any] = (),
        counters: Iterable[tuple[Any, str]] = (),
        generators: Iterable[torch.Generator] = (),
        include_params: bool = True,
    ) -> TrainingSnapshot:
        """Copy the changeable state of ``module`` and ``optimizers``.

        ``stateful`` objects (LR schedulers, grad scaler, loop progress) are saved through their own
        ``state_dict()``; ``counters`` are ``(object, attribute)`` pairs of plain values. An evaluation
        probe cannot change parameters, so it passes ``include_params=False`` and copies none.
        """
        snap = cls()
        trainable = [p for p in module.parameters() if p.requires_grad or p.grad is not None] if include_params else []
        held = [p for p in trainable if p.grad is not None and _holds_gradient(p.grad)]
        held_ids = {id(p) for p in held}
        buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        for sub in module.modules():
            snap.modes.append((sub, sub.training))
            buffers += [(sub, name, buf) for name, buf in sub._buffers.items() if buf is not None]
            if _is_metric(sub):
                snap.metrics.append((sub, _metric_state(sub)))
        state_tensors = [
            value
            for optimizer in optimizers
            for entries in optimizer.state.values()
            for value in entries.values()
            if isinstance(value, torch.Tensor)
        ]
        # every tensor to copy, each once, so that all host copies share one allocation
        copied_grads = [p.grad for p in trainable if p.grad is not None and id(p) not in held_ids]
        tensors = [*trainable, *copied_grads, *(buf for _, _, buf in buffers), *state_tensors]
        sources = list({id(t): t for t in tensors}.values())
        host = {id(t): c for t, c in zip(sources, host_copies(sources), strict=True)}
        snap.nbytes = sum(t.numel() * t.element_size() for t in sources)
        snap.params = [
            _ParamState(p, host[id(p)], p.grad, grad_is_held=True)
            if id(p) in held_ids
            else _ParamState(p, host[id(p)], None if p.grad is None else host[id(p.grad)])
            for p in trainable
        ]
        snap.buffers = [(sub, name, buf, host[id(buf)]) for sub, name, buf in buffers]
        for optimizer in optimizers:
            state = {p: {k: _saved(v, host) for k, v in entries.items()} for p, entries in optimizer.state.items()}
            groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            snap.optimizers.append(_OptimizerState(optimizer, state, groups))
        snap.stateful = [(obj, copy.deepcopy(obj.state_dict())) for obj in stateful]
        snap.counters = [(obj, name, copy.deepcopy(getattr(obj, name))) for obj, name in counters]
        snap.rng = _rng_state()
        snap.generators = [(g, g.get_state()) for g in generators]
        for param in held:  # only now: nothing above can fail any more
            param.grad = None
        return snap

    def restore(self, gradients: bool = True) -> None:
        """Write everything back. Safe to call several times (once after each probe).

        A gradient held by reference goes back onto its parameter as the same tensor, so after a
        restore with gradients the snapshot shares it with the run: restore with gradients last.

        ``gradients=False`` leaves the captured parameters' gradients empty (``None``) instead: the
        state between two probes, where the next probe's first step drops them anyway (Lightning
        calls ``zero_grad`` at the start of every accumulation window) and where a gradient held by
        reference must not be attached, since a step could write into it.
        """
        with torch.no_grad():
            for entry in self.params:
                entry.param.data.copy_(entry.data)
                if not gradients:
                    entry.param.grad = None
                elif entry.grad_is_held:
                    entry.param.grad = entry.grad
                elif entry.grad is None:
                    entry.param.grad = None
                elif entry.param.grad is not None and entry.param.grad.shape == entry.grad.shape:
                    entry.param.grad.copy_(entry.grad)
                else:  # in the parameter's layout (channels_last): the host copy is contiguous
                    entry.param.grad = torch.empty_like(entry.param.detach()).copy_(entry.grad)
            for sub, name, original, saved in self.buffers:
                original.copy_(saved)
                sub._buffers[name] = original
        for sub, training in self.modes:
            sub.training = training
        for opt in self.optimizers:
            _restore_optimizer(opt)
        for obj, state in self.stateful:
            obj.load_state_dict(copy.deepcopy(state))
        for obj, name, value in self.counters:
            setattr(obj, name, copy.deepcopy(value))
        for metric, state in self.metrics:
            for name, value in state.items():
                setattr(metric, name, copy.deepcopy(value))
        _set_rng_state(self.rng)
        for generator, gen_state in self.generators:
            generator.set_state(gen_state)


def _saved(value: Any, host: dict[int, torch.Tensor]) -> Any:
    """An optimizer-state entry as the snapshot keeps it: a tensor with its host copy, else a deep copy."""
    return _TensorCopy(value, host[id(value)]) if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _holds_gradient(grad: torch.Tensor) -> bool:
    """Keep this gradient by reference rather than copy it: it already lives in host memory, so a copy
    would only cost time. A device gradient is copied, so that it does not hold device memory the
    probe should have; so is a view (DDP's ``gradient_as_bucket_view``, flat gradient buffers), whose
    memory other steps write into while it is off its parameter."""
    return grad.device.type == "cpu" and not grad._is_view()


_METRIC_BOOKKEEPING = ("_update_count", "_computed", "_forward_cache")


def _is_metric(module: nn.Module) -> bool:
    """A torchmetrics ``Metric``, checked without importing torchmetrics (it is optional)."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(module, torchmetrics.Metric)


def _metric_state(metric: Any) -> dict[str, Any]:
    """The states registered with ``add_state`` (listed in ``_defaults``) and the update bookkeeping."""
    names = [*metric._defaults, *(name for name in _METRIC_BOOKKEEPING if hasattr(metric, name))]
    return {name: copy.deepcopy(getattr(metric, name)) for name in names}


def _restore_optimizer(opt: _OptimizerState) -> None:
    optimizer = opt.optimizer
    restored: dict[Any, dict[str, Any]] = {}
    with torch.no_grad():
        for p, saved in opt.state.items():
            entries: dict[str, Any] = {}
            for key, value in saved.items():
                if isinstance(value, _TensorCopy):
                    value.original.copy_(value.host)
                    entries[key] = value.original
                else:
                    entries[key] = copy.deepcopy(value)
            restored[p] = entries
    # in place: LightningOptimizer shares this dict object with the wrapped optimizer
    optimizer.state.clear()
    optimizer.state.update(restored)
    for group, saved_group in zip(optimizer.param_groups, opt.groups, strict=True):
        for key in [k for k in group if k != "params" and k not in saved_group]:
            del group[key]
        group.update(copy.deepcopy(saved_group))


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def sampler_generators(loader: Any) -> list[torch.Generator]:
    """Generators a dataloader draws from when iterated (its own, its sampler's, its batch sampler's).

    A datamodule that keeps one generator and hands it to every dataloader it builds would otherwise
    see the probe's draws shift the next epoch's shuffle order.
    """
    found: list[torch.Generator] = []
    candidates = [loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)]
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None:
        candidates.append(getattr(batch_sampler, "sampler", None))
    for obj in candidates:
        generator = getattr(obj, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found
