"""Capture what a probe step can change, and put it back bit for bit.

Lightning's finder saves a full checkpoint to disk and loads it back. A probe can only change
what an optimizer step and a forward pass touch, so this snapshot keeps exactly that:

* parameters that can receive a gradient (``requires_grad``, or already holding a ``.grad``) and
  their gradients; frozen parameters are left alone, so a frozen backbone costs nothing;
* all buffers (batch-norm statistics move in any training forward) and train/eval flags;
* torchmetrics states (plain attributes, not buffers: a ``Metric`` updated in ``training_step``,
  as every Flash Task does, would otherwise count the probe's batches in the epoch's value);
* optimizer state and hyperparameters, LR scheduler and grad scaler state;
* RNG states (python, numpy, torch, CUDA) and any extra generators (a sampler's own generator);
* any extra ``state_dict``/``load_state_dict`` objects (the loops' progress counters).

A search is one :meth:`TrainingSnapshot.capture`, a :meth:`~TrainingSnapshot.reset` before every
probe but the first, and one :meth:`~TrainingSnapshot.restore` at the end. Tensors are kept one of
two ways, and the difference is what each of those costs:

* **held** (in host memory already: a CPU run's parameters and optimizer state): the run's own
  tensor is set aside untouched and the probes run on a copy: capture moves the parameter
  (``param.data``) and the optimizer-state entry onto the copy, and the final restore moves them
  back, which copies nothing. The run ends the search on the very storage it started with.
  Gradients in host memory are held too, without any copy: the probes run with gradients empty.
* **copied** (device tensors, buffers, and tensors whose memory other tensors share): a host copy,
  written back in place, so the tensor keeps its identity and storage (``LightningOptimizer``
  shares the optimizer's ``state`` dict, DDP's reducer holds the parameters and may hold views of
  the gradients). Host memory, so that the snapshot does not take device memory from the probe.

All copies share one host allocation, each with a storage of its own (:mod:`retune.probing.host_copy`
says why that matters).
"""

from __future__ import annotations

import copy
import random
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from retune.distributed.local_shards import is_sharded, like_sharded, local
from retune.probing.attributes import ModuleAttributes
from retune.probing.host_copy import contiguous_strides, host_copies
from retune.probing.metric_states import MetricStates
from retune.random_state import sampler_generators


@dataclass
class _Kept:
    """One tensor of the run's state and its copy; ``held`` says which of the two the probes use."""

    original: torch.Tensor  # the run's tensor (for a parameter: an alias of its data)
    copy: torch.Tensor
    held: bool  # True: probes run on ``copy`` and ``original`` is set aside; False: ``copy`` is a backup

    def for_probe(self) -> torch.Tensor:
        """Put the captured values where the next probe reads them; return the tensor the run must use."""
        if self.held:
            self.copy.copy_(self.original)
            return self.copy
        local(self.original).copy_(self.copy)  # a sharded tensor: this rank's shard, in place
        return self.original

    def for_run(self) -> torch.Tensor:
        """Put the captured values back into the run's own tensor (for a held one: nothing to copy)."""
        if not self.held:
            local(self.original).copy_(self.copy)
        return self.original


@dataclass
class _ParamState:
    param: nn.Parameter
    data: _Kept
    grad: torch.Tensor | None  # the parameter's own gradient when ``grad_is_held``, else a host copy
    grad_is_held: bool = False
    sharded: bool = False  # a DTensor parameter (FSDP2): written in place, never re-pointed


@dataclass
class _OptimizerState:
    optimizer: torch.optim.Optimizer
    # per parameter: key -> _Kept (a tensor) or a plain value
    state: dict[Any, dict[str, Any]]
    groups: list[dict[str, Any]]


@dataclass
class TrainingSnapshot:
    """An in-memory copy of the state a probe can change. Create with :meth:`capture`.

    Example::

        snap = TrainingSnapshot.capture(model, optimizers=[optimizer])
        for size in sizes:
            if tried_one:
                snap.reset()  # start this probe from the captured state
            run_probe(size)
        snap.restore()  # the run continues as if no probe had happened
    """

    params: list[_ParamState] = field(default_factory=list)
    buffers: list[tuple[nn.Module, str, _Kept]] = field(default_factory=list)
    modes: list[tuple[nn.Module, bool]] = field(default_factory=list)
    optimizers: list[_OptimizerState] = field(default_factory=list)
    stateful: list[tuple[Any, Any]] = field(default_factory=list)
    counters: list[tuple[Any, str, Any]] = field(default_factory=list)
    metrics: MetricStates = field(default_factory=MetricStates)
    attributes: ModuleAttributes = field(default_factory=ModuleAttributes)
    """The contents of the module's public list, dict and set attributes (a step's outputs gathered for an
    epoch-end hook: :mod:`retune.probing.attributes`)."""
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
        """Copy the changeable state of ``module`` and ``optimizers``; the run continues on held copies.

        ``stateful`` objects (LR schedulers, grad scaler, loop progress) are saved through their own
        ``state_dict()``; ``counters`` are ``(object, attribute)`` pairs of plain values. An evaluation
        probe cannot change parameters, so it passes ``include_params=False`` and copies none.
        """
        snap = cls()
        optimizers = _with_inner_optimizers(optimizers)
        trainable = [p for p in module.parameters() if p.requires_grad or p.grad is not None] if include_params else []
        trainable_ids = {id(p) for p in trainable}
        held_grads = [p for p in trainable if p.grad is not None and _grad_holdable(p.grad)]
        held_grad_ids = {id(p) for p in held_grads}
        buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        for sub in module.modules():
            snap.modes.append((sub, sub.training))
            buffers += [(sub, name, buf) for name, buf in sub._buffers.items() if buf is not None]
        state_tensors = [
            value
            for optimizer in optimizers
            for entries in optimizer.state.values()
            for value in entries.values()
            if isinstance(value, torch.Tensor) and id(value) not in trainable_ids  # a parameter kept in state
        ]
        copied_grads = [p.grad for p in trainable if p.grad is not None and id(p) not in held_grad_ids]
        # every tensor to keep, each once; a tensor can be held only if no other tensor of the run shares
        # its memory (a probe's writes through the other one would reach the set-aside original)
        sources = list({id(t): t for t in [*trainable, *state_tensors, *copied_grads]}.values())
        users = Counter(
            _storage_ptr(t)
            for t in [*module.parameters(), *(buf for _, _, buf in buffers), *state_tensors, *copied_grads]
        )
        holdable = [
            t
            for t in sources
            if (id(t) in trainable_ids or type(t) is torch.Tensor) and _can_hold(t) and users[_storage_ptr(t)] == 1
        ]
        holdable_ids = {id(t) for t in holdable}
        others = [t for t in sources if id(t) not in holdable_ids] + [buf for _, _, buf in buffers]
        others = list({id(t): t for t in others}.values())
        kept_tensors = [*holdable, *others]
        # a sharded tensor is kept as this rank's shard: no gather, memory in proportion to the shard
        copies = dict(zip(map(id, kept_tensors), host_copies([local(t) for t in kept_tensors]), strict=True))
        snap.nbytes = sum(_nbytes(t) for t in kept_tensors)

        def kept(tensor: torch.Tensor, original: torch.Tensor) -> _Kept:
            return _Kept(original, copies[id(tensor)], held=id(tensor) in holdable_ids)

        def state_entry(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return copy.deepcopy(value)
            if id(value) in trainable_ids:
                return value  # the parameter itself: its values come back with the parameters
            return kept(value, value)

        # a parameter's original is an alias of its data at capture: the run's parameter object stays,
        # and whatever a probe points its ``.data`` at, the put-back points it at that storage again
        snap.params = [
            _ParamState(p, kept(p, p if is_sharded(p) else p.data), p.grad, grad_is_held=True, sharded=is_sharded(p))
            if id(p) in held_grad_ids
            else _ParamState(
                p,
                kept(p, p if is_sharded(p) else p.data),
                None if p.grad is None else copies[id(p.grad)],
                sharded=is_sharded(p),
            )
            for p in trainable
        ]
        snap.buffers = [(sub, name, kept(buf, buf)) for sub, name, buf in buffers]
        for optimizer in optimizers:
            state = {p: {k: state_entry(v) for k, v in entries.items()} for p, entries in optimizer.state.items()}
            groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            snap.optimizers.append(_OptimizerState(optimizer, state, groups))
        snap.stateful = [(obj, copy.deepcopy(obj.state_dict())) for obj in stateful]
        snap.counters = [(obj, name, copy.deepcopy(getattr(obj, name))) for obj, name in counters]
        snap.metrics = MetricStates.capture(module)
        snap.attributes = ModuleAttributes.capture(module, bindings=True)
        snap.rng = _rng_state()
        given = list(generators)
        own = [g for g in module_generators(module) if all(g is not k for k in given)]
        snap.generators = [(g, g.get_state()) for g in [*given, *own]]  # a step's own generator: put back too
        # only now, when nothing above can fail any more: move the run onto the held copies
        with torch.no_grad():
            for param in held_grads:
                param.grad = None
            for entry in snap.params:
                if entry.data.held:
                    entry.param.data = entry.data.copy
            for opt in snap.optimizers:
                for p, saved in opt.state.items():
                    for key, value in saved.items():
                        if isinstance(value, _Kept) and value.held:
                            opt.optimizer.state[p][key] = value.copy
        return snap

    @property
    def held_bytes(self) -> int:
        """Bytes of the copies the probes train on while the run's own tensors wait (0 on a GPU)."""
        entries = [e.data for e in self.params]
        entries += [v for o in self.optimizers for s in o.state.values() for v in s.values() if isinstance(v, _Kept)]
        return sum(_nbytes(k.copy) for k in entries if k.held)

    def reset(self) -> None:
        """Start the next probe from the captured state: the state between two probes.

        The captured parameters' gradients are left empty (``None``): a gradient held by reference must not
        be attached, since a step could write into it. A probe's first step then runs its forward without
        the gradients of a step before, which training's later steps hold until ``zero_grad``: its second
        step measures them, and a one-step verifying probe counts them (:class:`retune.memory.StepPhases`).
        """
        self._put_back(final=False)

    def restore(self) -> None:
        """Hand the captured state back to the run: its own tensors, values and gradients, as captured.

        Call it once, when the probes are over: calling it again straight away changes nothing, but
        after the run has trained on it would put the captured values back again. A gradient held by
        reference goes back onto its parameter as the same tensor.
        """
        self._put_back(final=True)

    def _put_back(self, final: bool) -> None:
        # first (it never raises): which object each public attribute names, then the restorers below write the
        # values of what they own into those objects (a torchmetrics state, a counter), not the other way round
        self.attributes.restore()
        with torch.no_grad():
            for entry in self.params:
                # always re-pointed, held or not: a probe may have pointed ``.data`` elsewhere
                # (``p.data = p.data.clamp(...)``, max-norm constraints, ``module.to()``); a sharded
                # parameter is FSDP2's own storage, which it all-gathers from: written in place only
                values = entry.data.for_run() if final else entry.data.for_probe()
                if not entry.sharded:
                    entry.param.data = values
                if not final:
                    entry.param.grad = None
                elif entry.grad_is_held:
                    entry.param.grad = entry.grad
                elif entry.grad is None:
                    entry.param.grad = None
                elif entry.param.grad is not None and local(entry.param.grad).shape == entry.grad.shape:
                    local(entry.param.grad).copy_(entry.grad)
                else:  # in the parameter's layout (channels_last): the host copy is contiguous
                    shard = torch.empty_like(local(entry.param).detach()).copy_(entry.grad)
                    entry.param.grad = like_sharded(shard, entry.param)
            for sub, name, buffer in self.buffers:  # never held: written back in place either way
                sub._buffers[name] = buffer.for_run()
        for sub, training in self.modes:
            sub.training = training
        for opt in self.optimizers:
            _restore_optimizer(opt, final)
        for obj, state in self.stateful:
            obj.load_state_dict(copy.deepcopy(state))
        for obj, name, value in self.counters:
            setattr(obj, name, copy.deepcopy(value))
        self.metrics.restore()
        _set_rng_state(self.rng)
        for generator, gen_state in self.generators:
            generator.set_state(gen_state)


def _with_inner_optimizers(optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """The optimizers and every optimizer they wrap, each once: an attribute of one that is an optimizer
    (``ZeroRedundancyOptimizer.optim`` holds the real state, the wrapper's own ``state`` stays empty; SAM's
    ``base_optimizer`` and a Lookahead's ``optimizer`` hold the momentum the wrapper's update uses). Found by
    review: a SAM-style wrapper's inner momentum was left as the probes' steps made it, so the run trained
    other weights than one that never searched."""
    found: list[torch.optim.Optimizer] = []
    pending = list(optimizers)
    while pending:
        candidate = pending.pop(0)
        if not isinstance(candidate, torch.optim.Optimizer) or any(candidate is f for f in found):
            continue
        found.append(candidate)
        pending.extend(value for value in vars(candidate).values() if isinstance(value, torch.optim.Optimizer))
    return found


def module_generators(module: nn.Module) -> list[torch.Generator]:
    """The ``torch.Generator`` objects ``module`` and its submodules keep as attributes (a step that draws its
    noise or masks from its own generator: the probes' steps advance it as a training step would)."""
    found: list[torch.Generator] = []
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, torch.Generator) and all(value is not g for g in found):
                found.append(value)
    return found


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds: a sharded tensor's local shard, not the whole tensor it stands for."""
    shard = local(tensor)
    return shard.numel() * shard.element_size()


def _storage_ptr(tensor: torch.Tensor) -> int:
    return int(local(tensor).untyped_storage().data_ptr())


def _grad_holdable(grad: torch.Tensor) -> bool:
    """Whether a gradient can be set aside by reference instead of copied.

    A sharded (FSDP2) gradient in host memory can, although its shard is a view of the buffer its
    reduce-scatter wrote: FSDP2 gives each reduce-scatter a fresh buffer, and the probes run with
    the gradient ``None``, so nothing writes into the set-aside one.
    """
    if is_sharded(grad):
        return grad.device.type == "cpu"
    return _host_resident(grad)


def _host_resident(tensor: torch.Tensor) -> bool:
    """Whether this tensor already lives in host memory and is not a view, so that the snapshot can set
    it aside instead of copying it. A device tensor is copied to the host, so that the snapshot
    does not hold device memory the probe should have; so is a view (DDP's
    ``gradient_as_bucket_view``, flat gradient buffers), whose memory other tensors write into."""
    return tensor.device.type == "cpu" and not tensor._is_view()


def _can_hold(tensor: torch.Tensor) -> bool:
    """A tensor that owns all of its storage, in host memory, with exactly the strides of its contiguous
    copy (so that the probes run on the same layout: a channels_last weight, even a depthwise one whose
    strides ``is_contiguous()`` accepts, is copied instead)."""
    return (
        type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and _host_resident(tensor)
        and tensor.stride() == contiguous_strides(tensor.shape)  # not is_contiguous(): it ignores size-1 dims
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == _nbytes(tensor)
        and tensor.numel() > 0
    )


def _restore_optimizer(opt: _OptimizerState, final: bool) -> None:
    optimizer = opt.optimizer
    restored: dict[Any, dict[str, Any]] = {}
    with torch.no_grad():
        for p, saved in opt.state.items():
            entries: dict[str, Any] = {}
            for key, value in saved.items():
                if isinstance(value, _Kept):
                    entries[key] = value.for_run() if final else value.for_probe()
                elif isinstance(value, torch.Tensor):  # a parameter, restored with the parameters
                    entries[key] = value
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


__all__ = ["TrainingSnapshot", "sampler_generators"]
