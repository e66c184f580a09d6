"""Measure the peak memory of a probe, on CUDA and on CPU.

A memory budget only means something if the probe's peak can be measured. On CUDA torch keeps the
statistic itself (``max_memory_allocated`` after ``reset_peak_memory_stats``). On CPU torch keeps
none, so :class:`CpuPeakTracker` counts it: a ``TorchDispatchMode`` sees every tensor an operator
returns during the probe (forward, backward and optimizer step, including optimizer state created
by the first step), counts each new storage once, and uncounts it when the storage is freed
(a ``weakref.finalize`` on the storage). The peak of those live bytes, plus the bytes already
resident when the probe starts (parameters, gradients, buffers, optimizer state), is the probe's
peak — the same quantity CUDA's ``max_memory_allocated`` reports, minus allocator rounding.

It measures tensor storage only: Python objects, the allocator's caching and fragmentation are not
included. That is what a budget should bound on CPU, where there is no fixed device to overflow.

``torch.compile`` and the tracker: dynamo refuses to compile a frame while a user
``TorchDispatchMode`` is active and marks that code object *skipped for the rest of the process*, so
a compiled module whose first call happened inside a tracked probe would train uncompiled, silently.
And where dynamo does compile under a mode, inductor's generated code allocates its buffers outside
the dispatcher, where no mode can count them (a step's peak reads as almost nothing). So the tracker
holds the compiler in its ``force_eager`` stance while it is active: a compiled module runs its
original code eagerly inside the probe (dynamo never sees the frame, nothing is marked skipped, and
the step's memory is fully counted), and compiles at its first call outside, in training. The
eager step's peak is what a CPU probe measures for a compiled model; a compiled step usually needs
less (fusion, fewer saved activations), so the size found is on the safe side.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from retune.allocator import MemoryStats, stats_for
from retune.distributed.fsdp2 import unsharded_storages
from retune.distributed.local_shards import local


def _metadata_ops() -> frozenset[Any]:
    """Operators that only read metadata (``prim.device``: a fake tensor's device is a dispatched query)."""
    try:
        return frozenset({torch.ops.prim.device.default})
    except (AttributeError, RuntimeError):  # a torch without it: every operator is tracked as before
        return frozenset()


_METADATA = _metadata_ops()


def _fresh_ops() -> frozenset[Any]:
    """Operators whose result is new memory although it is their input: ``lift_fresh`` hands the dispatcher a
    tensor just made from Python data (``torch.tensor(0.0)``: Adam's ``step``), which no operator allocated; a
    result whose storage is not resizable aliases memory torch does not own (``torch.from_numpy``,
    ``torch.as_tensor(ndarray)``) and is not new (:meth:`CpuPeakTracker.__torch_dispatch__`)."""
    try:
        return frozenset({torch.ops.aten.lift_fresh.default})
    except (AttributeError, RuntimeError):  # a torch without it: such tensors are not counted, as before
        return frozenset()


FRESH_OPS = _fresh_ops()


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an operator's arguments or results: nested tuples, lists and dicts of them (what
    ``torch.utils._pytree.tree_leaves`` would find there, at a fraction of its cost on the per-operator path).

    Args:
        value: an operator's arguments (a tuple, with a dict of keyword arguments) or its result.

    >>> [t.shape[0] for t in tensors_in(((torch.ones(1), [torch.ones(2), 3]), {"out": torch.ones(4)}))]
    [1, 2, 4]
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list, dict)):
                yield from tensors_in(item)
    elif isinstance(value, dict):
        yield from tensors_in(list(value.values()))


def storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``tensor``'s memory: its own (a sharded tensor's local shard's), or a sparse tensor's
    parts' (indices and values: a sparse tensor has no storage of its own; ``nn.Embedding(sparse=True)`` makes
    sparse gradients). None for a layout whose parts are not known.

    Args:
        tensor: any tensor, fake or real, dense, sharded or sparse.

    >>> [s.nbytes() for s in storages_of(torch.ones(3).to_sparse())]   # int64 indices (1 x 3), float values (3)
    [24, 12]
    """
    tensor = local(tensor)
    layout = tensor.layout
    if layout == torch.strided:
        return [tensor.untyped_storage()]
    if layout == torch.sparse_coo:
        parts: tuple[torch.Tensor, ...] = (tensor._indices(), tensor._values())
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (tensor.crow_indices(), tensor.col_indices(), tensor.values())
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (tensor.ccol_indices(), tensor.row_indices(), tensor.values())
    else:
        return []
    return [part.untyped_storage() for part in parts]


def _device_type(tensor: torch.Tensor) -> str:
    """``tensor.device.type``, read without a dispatch for a fake tensor (whose ``device`` is a dispatched
    query: a trace asks it of every argument and result of every operator)."""
    fake = getattr(tensor, "fake_device", None)
    return str(fake.type) if isinstance(fake, torch.device) else str(tensor.device.type)


class CpuPeakTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Live tensor bytes allocated while the mode is active, and their peak.

    Args:
        device_type: the device type whose tensors count: ``"cpu"`` for a probe (host memory; a device's
            allocator keeps its own statistics), the module's device type for a fake-tensor trace
            (``retune.prediction``); several, as a tuple, where one account spans them (an optimizer update
            measured on ``meta`` tensors keeps its scalar state on the CPU: ``retune.prediction.meta_update``).
        resized: storages resized in place outside the dispatcher, ``{key: bytes now}``, read at every operator
            (FSDP2's gathered parameters: ``retune.distributed.fsdp2.unsharded_storages``); None: none.

    Example:
        >>> with CpuPeakTracker() as tracker:
        ...     a = torch.empty(1000, 1000)       # 4 MB
        ...     b = torch.empty(1000, 1000)       # 8 MB live
        ...     del a
        ...     c = torch.empty(500, 1000)        # 6 MB live
        >>> tracker.peak_bytes, tracker.live_bytes
        (8000000, 6000000)
    """

    def __init__(
        self, device_type: str | tuple[str, ...] = "cpu", resized: Callable[[], dict[int, int]] | None = None
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type
        """The tensors counted: a probe counts host memory (a device's allocator keeps its own statistics); a
        fake-tensor trace (``retune.prediction``) counts the fakes on the module's device."""
        self._kinds = frozenset((device_type,) if isinstance(device_type, str) else device_type)
        self.resized = resized
        """Storages resized in place outside the dispatcher (FSDP2's unsharded parameters:
        ``retune.distributed.fsdp2.unsharded_storages``): their size now, by key, read at every operator and
        counted with the live bytes, never as a new storage."""
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}
        self._log: list[tuple[int, int, int]] | None = None  # (serial, bytes, live bytes after) per new storage
        self._serials: dict[int, int] = {}  # storage key -> the serial it was counted under (keys are reused)
        self._counted = 0
        self._stances: list[AbstractContextManager[Any]] = []
        self.recording: list[tuple[Any, ...]] | None = None
        """Where :meth:`record` was called: every storage counted from then on, as ``("+", serial, bytes, shape)``
        (the shape of the tensor that made it), every one freed as ``("-", serial)``, and the marks a caller adds
        (``retune.prediction.replay``: a trace replayed at other shapes); ``("!",)`` where a count changed
        otherwise (:meth:`recount`), which a replay cannot follow."""

    def __enter__(self) -> CpuPeakTracker:
        # force_eager before the mode is pushed: see the module docstring (torch < 2.6 has no stances)
        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is not None:
            stance = set_stance("force_eager")  # sets it now; its __exit__ restores the previous stance
            stance.__enter__()
            self._stances.append(stance)
        else:
            self._stances.append(nullcontext())
        try:
            super().__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            self._stances.pop().__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            super().__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
        finally:
            self._stances.pop().__exit__(None, None, None)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _METADATA:
            return out  # a fake tensor's device query (the autograd engine asks for every gradient): no memory
        kinds = self._kinds
        resized = self.resized() if self.resized is not None else {}
        # the inputs' storages, read once, only when a result is not counted yet (none: a fresh tensor)
        inputs: set[int] | None = None
        if func in FRESH_OPS:
            if not all(t.layout != torch.strided or t.untyped_storage().resizable() for t in tensors_in(args)):
                return out  # an alias of memory torch does not own (a NumPy array's, not resizable): not new, even
                # where the result is a fake of it (a trace counts what a probe counts)
            inputs = set()
        for leaf in tensors_in(out):
            if _device_type(leaf) not in kinds:
                continue
            # a sharded (DTensor) result: its local shard's; a sparse one: its indices' and values'. A sparse
            # in-place result (a gradient accumulated: ``grad += new``) holds new parts in the same tensor, which
            # the inputs, read after the operator, hold too: a sparse result's uncounted parts are all new memory
            sparse = leaf.layout != torch.strided
            for storage in storages_of(leaf):
                key = storage._cdata
                if key in self._live or key in resized:
                    continue
                if sparse:
                    self._track(storage, key, local(leaf).shape)
                    continue
                if inputs is None:
                    inputs = {
                        part._cdata
                        for t in tensors_in((args, kwargs) if kwargs else args)
                        if _device_type(t) in kinds
                        for part in storages_of(t)
                    }
                if key not in inputs:  # a view or an in-place result shares an input's storage: no new memory
                    self._track(storage, key, local(leaf).shape)
        if resized:
            if self.recording is not None:
                self.recording.append(("!",))
            for key in resized.keys() & self._live.keys():  # counted when created; its size is read from now on
                self.live_bytes -= self._live.pop(key)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes + sum(resized.values()))
        return out

    def record(self) -> None:
        """From now on, keep the :attr:`recording`."""
        self.recording = []

    def _track(self, storage: torch.UntypedStorage, key: int, shape: Iterable[int] = ()) -> None:
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        self.count(key, nbytes, shape)
        weakref.finalize(storage, self._release, key)

    def count(self, key: int, nbytes: int, shape: Iterable[int] = ()) -> None:
        """Count ``nbytes`` of a new storage ``key`` as live (a tracked one, or a replayed one:
        ``retune.prediction.replay``), until :meth:`release`."""
        self._live[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._counted += 1
        self._serials[key] = self._counted
        if self._log is not None:
            self._log.append((self._counted, nbytes, self.live_bytes))
        if self.recording is not None:
            self.recording.append(("+", self._counted, nbytes, tuple(int(d) for d in shape)))

    def adopt(self, tensors: Iterable[torch.Tensor]) -> int:
        """Count the storages of ``tensors``, made before the tracker started, as live from now until they are
        freed; returns the bytes added. A training step's gradients from the step before are alive in its
        forward until ``zero_grad`` frees them (Lightning zeroes after ``training_step``, before backward), and
        :func:`resident_bytes` leaves gradients out."""
        before = self.live_bytes
        for tensor in tensors:
            for storage in storages_of(tensor):
                if storage._cdata not in self._live:
                    self._track(storage, storage._cdata, local(tensor).shape)
        return self.live_bytes - before

    def log_new_storages(self) -> None:
        """From now on, remember every storage counted, with the live bytes after it (:meth:`own_need`)."""
        self._log = []

    def own_need(self, start: int) -> int:
        """Stop the log of :meth:`log_new_storages` and return the most the logged block needed above ``start``
        live bytes *beyond what it left alive*: at each new storage, the live bytes minus ``start`` minus the
        storages made so far that are still alive now. For an optimizer update that creates its state, that is
        its temporaries alone: what the same update needs once the state exists before it starts."""
        log, self._log = self._log or [], None
        alive = {self._serials[key] for key in self._live if key in self._serials}  # by serial: keys are reused
        kept = 0
        need = 0
        for serial, nbytes, live in log:
            if serial in alive:
                kept += nbytes
            need = max(need, live - start - kept)
        return need

    def recount(self, tensor: torch.Tensor, nbytes: int) -> None:
        """Count ``tensor``'s storage, counted since it was made, at ``nbytes`` from now on: what a sharded step
        keeps of it (``reduced_gradients`` of ``retune.prediction.trace.trace_step``). Only a tensor that is its
        whole storage is recounted (a view of a larger storage, several gradients in one buffer, keeps its count)."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live and storage.nbytes() == tensor.numel() * tensor.element_size():
            if self.recording is not None:
                self.recording.append(("!",))
            self.live_bytes -= self._live[key] - nbytes
            self._live[key] = nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: int) -> None:
        self.release(key)

    def release(self, key: int) -> None:
        """Uncount storage ``key`` (freed), if it was counted."""
        self.live_bytes -= self._live.pop(key, 0)
        serial = self._serials.pop(key, None)
        if self.recording is not None and serial is not None:
            self.recording.append(("-", serial))


@dataclasses.dataclass
class StepPhases:
    """A training step's live bytes on a :class:`CpuPeakTracker` by phase, for :meth:`steady`: the peak of the step
    as a later one runs it. A step marks its phases (``retune.compat.stage_steps.step_marks``):
    ``forward_done`` before ``zero_grad`` (Lightning zeroes after ``training_step``), ``backward_done`` when the
    closure ends, before gradient clipping and the optimizer update; :meth:`finish` after the step. A step that
    marks nothing (manual optimization) is one phase. All bytes are the tracker's (above the resident state).

    Example (the numbers of a step whose update creates 300 bytes of state and needs 50 of its own):
        >>> phases = StepPhases(forward=900, backward=700, update=1250, update_start=600, update_need=50,
        ...                     grads_before=0, grads_after=400, marked=True)
        >>> phases.steady(created=300)   # forward + the old gradients + the state; the update: 600 + 300 + 50
        1600
    """

    forward: int = 0
    """The peak up to ``zero_grad`` (with the gradients from the step before, counted while alive)."""
    backward: int = 0
    """The peak from ``zero_grad`` to the end of the closure (backward's new gradients)."""
    update: int = 0
    """The peak from there to the step's end (clipping, the update)."""
    update_start: int = 0
    """The live bytes when the update phase started (gradients, what the step kept of its output)."""
    update_need: int = 0
    """The update phase's peak above ``update_start`` beyond what it left alive (the state it created)."""
    grads_before: int = 0
    """Gradient bytes alive when the step started (from the step before)."""
    grads_after: int = 0
    """Gradient bytes alive when it ended."""
    marked: bool = False
    """Whether the step marked its phases (False: ``forward`` is the whole step's peak)."""
    accumulating: bool = False
    """Gradient accumulation (``accumulate_grad_batches > 1``): a window's later micro-batches run backward with the
    gradients accumulated so far alive, which a step that zeroed them did not hold."""

    @property
    def peak(self) -> int:
        """The step's peak as it ran."""
        return max(self.forward, self.backward, self.update)

    def steady(self, created: int) -> int:
        """The peak of the same step taken once the state it created (``created`` bytes) exists and with the
        gradients of a step before alive in its forward: each phase as it ran plus what was missing from it.
        Forward gains the state and the gradients it lacked; backward the state; an update that created state
        runs on it instead (its start, the state and its own need), so the state is not counted twice where the
        update is the step's peak. An unmarked step: its peak plus the state (an upper bound)."""
        if not self.marked:
            return self.peak + created
        return max(self.steady_parts(created))

    def steady_parts(self, created: int) -> tuple[int, int, int]:
        """:meth:`steady`'s forward, backward and update, each as a later step has it: each grows linearly with
        the batch (the update only with what the step keeps of it), so a prediction draws a line per phase."""
        forward = self.forward + max(0, self.grads_after - self.grads_before) + created
        backward = self.backward + created + (self.grads_after if self.accumulating else 0)
        update = self.update_start + created + self.update_need if created else self.update
        return forward, backward, update


class PhaseMarks:
    """The marks a training step gives (``forward_done``, ``backward_done``: the protocol of
    ``retune.compat.stage_steps.step_marks``), read off a live :class:`CpuPeakTracker` into a :class:`StepPhases`.

    Args:
        tracker: the tracker counting the step (its peak is reset at each mark, and is the whole step's again
            after :meth:`finish`).
        grads_before: the gradient bytes alive when the step started (:meth:`CpuPeakTracker.adopt`).
        accumulating: the run accumulates gradients (:attr:`StepPhases.accumulating`).
    """

    def __init__(self, tracker: CpuPeakTracker, grads_before: int, accumulating: bool = False) -> None:
        self.tracker = tracker
        self.phases = StepPhases(grads_before=grads_before, accumulating=accumulating)
        self._phase = 0  # 0 forward, 1 backward, 2 update

    def forward_done(self) -> None:
        if self._phase == 0:
            self.phases.forward = self.tracker.peak_bytes
            self.tracker.peak_bytes = self.tracker.live_bytes
            self._phase = 1

    def backward_done(self) -> None:
        if self._phase == 1:
            tracker = self.tracker
            self.phases.backward = tracker.peak_bytes
            self.phases.update_start = tracker.peak_bytes = tracker.live_bytes
            tracker.log_new_storages()
            self._phase = 2

    def finish(self, grads_after: int) -> StepPhases:
        """The phases, the step done; the tracker's peak is the whole step's again."""
        tracker, phases = self.tracker, self.phases
        if self._phase == 2:
            phases.update = tracker.peak_bytes
            phases.update_need = tracker.own_need(phases.update_start)
            phases.marked = True
        elif self._phase == 1:  # backward never reported its end: forward and backward are one phase
            phases.forward = max(phases.forward, tracker.peak_bytes)
        else:
            phases.forward = tracker.peak_bytes
        phases.grads_after = grads_after
        tracker.peak_bytes = phases.peak
        return phases


def gradient_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages of ``module``'s parameters' gradients now (a shard's own, under FSDP2).

    Args:
        module: the module whose parameters' gradients to count.
    """
    seen: dict[int, int] = {}
    for param in module.parameters():
        if param.grad is not None:
            for storage in storages_of(param.grad):
                seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def resident_bytes(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of the training state that outlives a step: parameters, buffers and optimizer state,
    each storage counted once. Gradients are left out: every step frees them (``zero_grad``) before
    its forward, and the tracker counts the ones backward allocates again.

    Args:
        module: the LightningModule (or any module) being trained.
        optimizers: its optimizers, whose state counts.
    """
    seen: dict[int, int] = {}

    def add(tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor):
            for storage in storages_of(tensor):
                seen[storage._cdata] = storage.nbytes()

    for param in module.parameters():
        add(param)
    for buffer in module.buffers():
        add(buffer)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                add(value)
    return sum(seen.values())


def has_gradients(optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    """Whether every trainable parameter of ``optimizers`` has a gradient (from a step before): a step's forward
    then holds them until ``zero_grad``, as every training step after the first does.

    Args:
        optimizers: the optimizers whose trainable parameters to check.
    """
    params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    return all(p.grad is not None for p in params if p.requires_grad)


def has_optimizer_state(optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    """Whether every trainable parameter of ``optimizers`` has its optimizer state: a step taken now has the
    steady-state peak (state, gradients and activations alive together); before the first step, or for
    parameters just unfrozen, the step creates that state after its activations are freed.

    Args:
        optimizers: the optimizers whose trainable parameters to check.
    """
    return all(
        len(optimizer.state.get(param, {})) > 0
        for optimizer in optimizers
        for group in optimizer.param_groups
        for param in group["params"]
        if param.requires_grad
    )


def _storage_bytes(tensors: Iterable[Any]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            for storage in storages_of(tensor):
                seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def resident_in_evaluation(
    module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer], counted_now: bool, upcoming: bool = True
) -> int:
    """Bytes resident when validation runs inside fit that an evaluation probe run now would not see.

    Validation runs after training steps, and they leave memory behind: every trainable parameter's
    gradient (Lightning sets gradients to None at the *next* step's ``zero_grad``, not after the
    optimizer step) and the optimizer's state, including the state the next optimizer step creates
    for parameters that have none yet: the ones just unfrozen, whose search runs before any step
    (issue 27: validation after an unfreeze reached 1.061x its budget on an H200).

    ``counted_now``: the probe's statistic already counts what exists now (a device allocator's
    allocated bytes); only what does not exist yet is added. Otherwise (the CPU tracker, which
    counts parameters and buffers only for an evaluation probe) the existing gradients and state
    are added as well.

    ``upcoming=False``: a ``trainer.validate()``/``test()``/``predict()`` run on its own, after a fit: no training
    step follows, so only what exists now is resident (the gradients the fit left on the parameters, and the state
    of the optimizers it kept), and only where the probe's statistic does not count it already (a CPU budget: a
    validation after a fit measured 1.05x its budget).
    """
    optimizers = list(optimizers)
    trainable = [p for p in module.parameters() if p.requires_grad]
    extra = 0
    if upcoming:  # allocated by the next backward
        extra += sum(local(p).numel() * p.element_size() for p in trainable if p.grad is None)
    if not counted_now:
        grads = (p.grad for p in module.parameters() if p.grad is not None)
        extra += _storage_bytes(grads if not upcoming else (p.grad for p in trainable if p.grad is not None))
        extra += _storage_bytes(value for opt in optimizers for state in opt.state.values() for value in state.values())
    if upcoming:
        for optimizer in optimizers:
            extra += pending_state_bytes(optimizer)
    return extra


def pending_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state the next step will create: trainable parameters with no state yet.

    Found by stepping the same optimizer class, with each group's options, on a one- and a
    two-element stand-in of the parameter's dtype on the CPU: the difference is the state per
    element (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's momentum buffer), the rest is per
    parameter (Adam's ``step``). An optimizer that cannot be stepped that way is assumed to keep
    two values per element, as the Adam family does.
    """
    total = 0
    cache: dict[tuple[torch.dtype, int], tuple[int, int]] = {}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if not param.requires_grad or optimizer.state.get(param):
                continue
            key = (param.dtype, index)
            if key not in cache:
                cache[key] = _state_line(optimizer, group, param.dtype)
            fixed, per_element = cache[key]
            total += fixed + per_element * local(param).numel()
    return total


def _state_line(optimizer: torch.optim.Optimizer, group: dict[str, Any], dtype: torch.dtype) -> tuple[int, int]:
    """``(bytes per parameter, bytes per element)`` of the state ``optimizer``'s class creates in one step."""
    options = {key: value for key, value in group.items() if key != "params"}
    accepted: Mapping[str, inspect.Parameter]
    try:
        accepted = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover - a constructor without a signature
        accepted = {}
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        # a group also holds what the class derives or a scheduler adds (AdamW's decoupled_weight_decay, initial_lr)
        options = {key: value for key, value in options.items() if key in accepted}
    for key in ("foreach", "fused", "capturable", "differentiable"):
        if key in options:
            options[key] = False  # a plain CPU step: the state's size does not depend on the kernel
    sizes = []
    try:
        for numel in (1, 2):
            stand_in = torch.zeros(numel, dtype=dtype, requires_grad=True)
            stand_in.grad = torch.zeros(numel, dtype=dtype)
            trial = type(optimizer)([stand_in], **options)
            trial.step()
            sizes.append(_storage_bytes(trial.state[stand_in].values()))
    except Exception:  # a custom optimizer with another constructor or step: the Adam family's two buffers
        size = torch.empty((), dtype=dtype).element_size()
        return 0, 2 * size
    per_element = sizes[1] - sizes[0]
    return sizes[0] - per_element, per_element


def held_bytes(raw: Any, moved: Any) -> int:
    """Bytes of ``raw``'s storages that ``moved`` still holds: of the loader's batch (``raw``), what a training step
    holds beside the batch the precision plugin made of it (``moved``). A copy the plugin made in place of a tensor
    (``bf16-true`` casts float inputs, ``64-true`` widens them) replaces it: Lightning's loop drops the loader's
    batch before the step (the copy is the step's; measured from before the transfer, a probe counts it as the
    step's own memory), so only the tensors passed through unchanged count.

    Args:
        raw: the batch as the loader yielded it (tensors in any containers :func:`tensor_bytes` walks).
        moved: the batch the precision plugin made of it (``retune.compat.convert_input``), before the hooks: what
            they make of it may hold ``raw``'s tensors in objects no walk can see into.

    >>> x, ids = torch.ones(4, 3), torch.ones(4, 7, dtype=torch.long)
    >>> held_bytes((x, ids), (x, ids)), held_bytes((x, ids), (x.bfloat16(), ids))
    (272, 224)
    """
    kept = {storage._cdata for tensor in _batch_tensors(moved, set()) for storage in storages_of(tensor)}
    seen: dict[int, int] = {}
    for tensor in _batch_tensors(raw, set()):
        for storage in storages_of(tensor):
            if storage._cdata in kept:
                seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages in a (nested) batch.

    Batches come in every container Lightning can move to a device, not only the ones torch's pytree
    knows: Hugging Face's ``BatchEncoding`` is a ``UserDict``, which pytree treats as one opaque leaf
    (its tensors would count as 0 bytes). So mappings of any kind, sequences and dataclasses are
    walked here, and pytree is asked only about the rest (its registered containers).

    Args:
        obj: a batch: a tensor, or containers (mappings, sequences, dataclasses, pytrees) holding tensors.
    """
    seen: dict[int, int] = {}
    for tensor in _batch_tensors(obj, set()):
        for storage in storages_of(tensor):
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def batch_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) batch, in the order :func:`tensor_bytes` walks it (any mapping, sequence or
    dataclass, then registered pytrees); a tensor met twice is listed once per place.

    Args:
        obj: a batch: a tensor, or containers (mappings, sequences, dataclasses, pytrees) holding tensors.

    >>> [t.shape[0] for t in batch_tensors({"ids": torch.ones(2, 3), "pair": (torch.ones(4), "name")})]
    [2, 4]
    """
    return list(_batch_tensors(obj, set()))


def _batch_tensors(obj: Any, visited: set[int]) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if obj is None or isinstance(obj, (str, bytes, int, float, bool)) or id(obj) in visited:
        return
    visited.add(id(obj))  # a container that holds itself, or one met twice, is walked once
    children: Iterable[Any]
    if isinstance(obj, Mapping):
        children = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [getattr(obj, field.name) for field in dataclasses.fields(obj)]
    else:
        leaves = tree_leaves(obj)
        if len(leaves) == 1 and leaves[0] is obj:
            return  # not a container anyone registered: no tensors to count
        children = leaves
    for child in children:
        yield from _batch_tensors(child, visited)


def device_total_bytes(device: torch.device) -> int | None:
    """Total memory of the device a budget fraction refers to (physical RAM for the CPU).

    Args:
        device: the device a ``memory.budget`` fraction is of.
    """
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
            return None
    return None


@dataclasses.dataclass
class PeakReading:
    """Filled in when the measured block ends; ``peak_bytes`` is None when no statistic exists.

    ``peak_bytes`` is the peak of allocated bytes (what tensors used); ``peak_reserved`` the peak of
    what a caching allocator held from the device meanwhile (None on CPU, which has no such cache).
    """

    peak_bytes: int | None = None
    """Peak allocated bytes during the block (None: no statistic on this device)."""
    source: str = "none"
    """Where the peak came from: ``allocator`` (device statistics), ``cpu-tracker`` (the CPU peak tracker) or
    ``none``."""
    peak_reserved: int | None = None
    """Peak bytes a caching allocator reserved during the block (None on the CPU)."""
    tracker: CpuPeakTracker | None = None
    """The CPU tracker counting the block (None on a device with allocator statistics)."""
    grads_before: int = 0
    """With ``grads=True`` on the CPU tracker: the gradient bytes alive when the block started, counted while alive."""


@contextmanager
def measure_peak(
    device: torch.device,
    module: torch.nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    stats: MemoryStats | None = None,
    extra: int = 0,
    grads: bool = False,
) -> Iterator[PeakReading]:
    """Measure the peak memory of the block on ``device`` (allocator statistics, or the CPU tracker).

    ``stats``: the device allocator's statistics (:func:`retune.allocator.stats_for`, CUDA's by
    default); given, they are read on any device (a test's simulated allocator on the CPU).
    ``extra``: bytes added to both peaks (what will be resident when the real step runs and is not
    now: :func:`resident_in_evaluation`). The
    reading is filled in even when the block raises (a budget check needs the peak of a probe that
    ran fine but used too much; an OOM leaves it partial, which the caller ignores).

    Args:
        device: the device the step runs on.
        module: the module being trained (the CPU tracker counts its resident state).
        optimizers: its optimizers (their state is resident too).
        stats: the device allocator's statistics; None: :func:`retune.allocator.stats_for` of ``device``.
        extra: bytes added to both peaks (state resident when the real step runs but not now).
        grads: on the CPU tracker, count the module's gradients alive at the start until they are freed (a
            training step's, from the step before: alive in its forward; an allocator counts them anyway).
    """
    reading = PeakReading()
    stats = stats if stats is not None else stats_for(device)
    if stats is not None:
        stats.reset_peaks()
        try:
            yield reading
        finally:
            now = stats.read()
            reading.peak_bytes, reading.peak_reserved = now.peak_allocated + extra, now.peak_reserved + extra
            reading.source = "allocator"
        return
    if device.type == "cpu":
        base = resident_bytes(module, list(optimizers))
        tracker = CpuPeakTracker(resized=unsharded_storages(module))
        reading.tracker = tracker
        try:
            with tracker:
                if grads:
                    reading.grads_before = tracker.adopt(p.grad for p in module.parameters() if p.grad is not None)
                yield reading
        finally:
            reading.peak_bytes = base + tracker.peak_bytes + extra
            reading.source = "cpu-tracker"
        return
    yield reading


__all__ = [
    "FRESH_OPS",
    "CpuPeakTracker",
    "PeakReading",
    "PhaseMarks",
    "StepPhases",
    "batch_tensors",
    "gradient_bytes",
    "held_bytes",
    "device_total_bytes",
    "has_gradients",
    "has_optimizer_state",
    "measure_peak",
    "storages_of",
    "resident_bytes",
    "tensor_bytes",
    "tensors_in",
]
