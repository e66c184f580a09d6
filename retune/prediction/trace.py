"""One training step traced on fake tensors at a given batch size, and its peak memory read off.

The step runs exactly as a probe runs it (the user's ``training_step`` with the arguments Lightning
would pass it, backward and the optimizer step under the trainer's strategy and precision:
:func:`retune.compat.stage_steps.training_step`), but inside a ``FakeTensorMode``: the module's
parameters and buffers are fakes (:mod:`~retune.prediction.fake_state`), the optimizer is a clone
over them, and the batch is fake at the requested size (:mod:`~retune.prediction.fake_batch`).
Fake tensors carry shapes, dtypes and devices and no data, and every operator runs only its shape
function, so a step at any size costs about the same few milliseconds and allocates nothing.

The peak is read by the probes' own tracker (:class:`retune.memory.CpuPeakTracker`) pushed inside the
fake mode: it sees every fake storage an operator returns, counts it once, and uncounts it when the
storage is freed, exactly as it does for a real probe; plus :func:`retune.memory.resident_bytes` of
the fake state before the step. So a prediction is the quantity ``measure_peak`` reports for a real
CPU probe, by construction, and the two differ only where a real kernel and its fake implementation
allocate differently (a decomposition with other intermediates). torch's ``MemTracker``
(``torch.distributed._tools.mem_tracker``) works on CPU in torch 2.13 and was read, not used: it
raises ``NotImplementedError`` when the root module runs twice in one tracked block (a step that
calls the model twice; two traced steps), it installs process-wide module and optimizer hooks for its
duration, and its total counts the gradients present before the step, which a probe does not (the
step frees them first); its per-module breakdown is what it adds, and nothing here needs it.

The optimizer's update does not depend on the batch: its peak is the memory alive when it starts
(parameters, state, gradients, what the step keeps of the batch) plus its own temporaries and the state
it creates. A trace measures that phase (:class:`OptimizerPhase`) and a later trace of the same state may
reuse it (``optimizer=``): it runs the closure (forward and backward) and skips the update, whose peak is
then the live bytes at its start plus the phase's measured extra. The update is about a third of a traced
step of a small transformer with Adam, and a search traces several sizes of one state. A CPU step's first
update is measured on ``meta`` tensors instead of fakes (:mod:`~retune.prediction.meta_update`: the same
account at about half the cost) and then accounted as a reused phase; where that cannot run, on the fakes.

Under FSDP2 the trace is of the plain module on the rank's batch, with whole-tensor fakes of the shards
(:mod:`~retune.prediction.fake_state`) and FSDP2's hooks out of the way
(:func:`retune.distributed.fsdp2.hooks_removed`): no collective runs, the activations are what FSDP2's
step computes, and the whole state's bytes are turned into the rank's by the caller
(:class:`retune.distributed.fsdp2.ShardAccount`). With a ``MixedPrecisionPolicy`` the parameters are faked in
the dtype FSDP2 computes them in (``compute_dtypes``) and the policy's input and output casts run where its
hooks would, so forward, backward and their gradients are in that dtype, as FSDP2's are; the optimizer update
runs on the stored dtype's shards, so it is traced apart (:func:`trace_update`: the update alone, on fakes of
the stored parameters and their gradients) and the step's trace reuses its phase.

Nothing of the run changes: the real parameters, gradients, buffers, optimizer state and the
trainer's optimizers are never written (the fakes stand in for them and the real objects are put
back), every module's train/eval flag, its public attributes (a list the step appends its outputs to
keeps no fake: :mod:`retune.probing.attributes`) and the global RNGs (Python, NumPy, torch, CUDA) are
put back, and callbacks, loggers and logged metrics are hidden as in a probe.

Where the trace cannot run, the result is a :class:`CannotPredict` with the reason (the operator, or
the exception), never an exception: an operator whose output depends on data (``.item()``, a tensor
in an ``if``: ``aten._local_scalar_dense``), one whose output *shape* depends on data (``nonzero``,
``masked_select``), an operator without a fake implementation (a custom kernel), a real tensor the
step reaches that was not faked (a tensor kept in a plain attribute; a grad scaler's state), or any
other error of the step under fake tensors. A ``torch.compile``'d module is traced eagerly, as the CPU
tracker runs it in a probe (its compiler stance), so it is predicted as the eager step.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from retune.compat.data import batch_to_device
from retune.compat.fake_trace import logging_silenced, optimizers_replaced
from retune.compat.stage_steps import hooks_isolated, step_marks, training_step
from retune.compat.state import get_accumulation
from retune.distributed.fsdp2 import hooks_removed
from retune.distributed.local_shards import is_sharded
from retune.memory import (
    CpuPeakTracker,
    StepPhases,
    batch_tensors,
    gradient_bytes,
    has_optimizer_state,
    resident_bytes,
    tensor_bytes,
)
from retune.prediction.fake_batch import fake_batch
from retune.prediction.fake_state import fake_training_state, swapped_in
from retune.prediction.meta_update import meta_eligible, update_on_meta
from retune.probing.attributes import attributes_kept
from retune.probing.sample_sizes import preserved_rng

__all__ = [
    "CannotPredict",
    "OptimizerPhase",
    "Recording",
    "StepFacts",
    "StepFn",
    "StepTrace",
    "TracedPhases",
    "assemble",
    "trace_step",
    "trace_training_step",
    "trace_update",
]

StepFn = Callable[[Any, list[torch.optim.Optimizer]], object]
"""``step(batch, optimizers)``: one training step of the module on ``batch`` with ``optimizers``."""


@dataclass(frozen=True)
class OptimizerPhase:
    """The optimizer update of a traced step: ``extra_bytes`` its peak above the live bytes when it started
    (temporaries and the state it creates while it runs), ``created_bytes`` the state alive after it."""

    extra_bytes: int
    created_bytes: int
    need_bytes: int | None = None
    """Its peak above that start beyond the state it created (:meth:`retune.memory.CpuPeakTracker.own_need`): what
    the same update needs once the state exists (None: not measured; ``extra_bytes`` stands for it)."""


@dataclass(frozen=True)
class Recording:
    """A traced step's storages in the order it made and freed them, with the shape of each, and the marks of its
    phases (the tracker's ``recording``: :class:`retune.memory.CpuPeakTracker`); what a replay at another batch
    needs besides."""

    events: tuple[tuple[Any, ...], ...]
    batch_shapes: tuple[tuple[tuple[int, ...], int], ...]
    """The fake batch's tensors, in pytree order: each one's shape and bytes."""
    fixed_dims: frozenset[int]
    """Every dimension of the module's parameters and buffers: sizes that never grow with the batch."""
    reuse: OptimizerPhase | None
    """The update's phase the trace reused (None: it measured the update)."""


@dataclass(frozen=True)
class StepTrace:
    """The traced peak of a step at ``size``: ``peak_bytes`` is what a CPU probe's ``measure_peak`` would
    report (``resident_bytes`` of parameters, buffers and optimizer state before the step, plus the peak
    of what the step allocates); ``seconds`` is what the trace took."""

    size: int
    peak_bytes: int
    resident_bytes: int
    steps: int
    seconds: float
    created_bytes: int = 0
    """Optimizer state the traced steps created (0 when it existed for every trainable parameter)."""
    batch_bytes: int = 0
    """Bytes of the fake batch's tensors at ``size``: a CPU probe adds its batch to the step's peak."""
    optimizer: OptimizerPhase | None = None
    """The update's phase, as measured (or reused: ``trace_step(optimizer=...)``); None when no closure-driven
    update was seen (the step called no optimizer's ``step``)."""
    compute_bytes: int = 0
    """``resident_bytes`` plus the peak before the optimizer update started (forward and backward; with two
    steps, the second's too, which holds the state the first created); without an update, the step's peak."""
    update_start_bytes: int = 0
    """``resident_bytes`` plus what was alive when the update started (gradients, what the step kept); 0 when no
    update was seen. With :attr:`compute_bytes` and the update's phase, what an account of a sharded step needs:
    FSDP2 holds different things in the two (:mod:`retune.prediction.sharded`)."""

    forward_bytes: int = 0
    """``resident_bytes`` plus the peak of forward (to ``zero_grad``) where the step marked it
    (:func:`retune.compat.stage_steps.step_marks`; 0: unmarked, a step function of its own)."""
    backward_bytes: int = 0
    """``resident_bytes`` plus the peak from ``zero_grad`` to the update's start (0: unmarked)."""
    update_bytes: int = 0
    """``resident_bytes`` plus the update's peak, as measured or as its reused phase gives it (0: no update)."""
    grads_before: int = 0
    """Gradient bytes alive when the step started (fakes of the step before's), counted until freed."""
    grads_after: int = 0
    """Gradient bytes alive when the step ended."""
    accumulating: bool = False
    """Traced for a run that accumulates gradients (:attr:`retune.memory.StepPhases.accumulating`)."""
    recording: Recording | None = field(default=None, compare=False, repr=False)
    """What the trace allocated and freed, in order, where it was asked to record (``trace_step(record=True)``):
    :func:`retune.prediction.replay.replay` reads the same step at another batch from it, without tracing."""

    @property
    def steady_bytes(self) -> int:
        """The peak of a step taken once the optimizer state exists and with the gradients of a step before alive
        in its forward. Traced with two steps it is ``peak_bytes`` (the second is such a step). Traced with one
        marked step it is that step's phases as a later step has them (:meth:`retune.memory.StepPhases.steady`:
        forward with those gradients and the state the step created, backward with the state, the update on the
        state instead of creating it, so a peak in the update does not count the state twice). Unmarked (a step
        function of its own): its peak plus the state it created, an upper bound."""
        parts = self.steady_parts
        return max(parts) if parts is not None else self.peak_bytes + (self.created_bytes if self.steps == 1 else 0)

    @property
    def steady_parts(self) -> tuple[int, int, int] | None:
        """:attr:`steady_bytes` by phase: forward, backward and the update, each with ``resident_bytes``
        (:meth:`retune.memory.StepPhases.steady_parts`); None where the step did not mark its phases or was traced
        twice (its second step's peak is the steady one)."""
        phases = self._steady_phases()
        if phases is None:
            return None
        forward, backward, update = phases.steady_parts(self.created_bytes)
        resident = self.resident_bytes
        return resident + forward, resident + backward, resident + update

    def _steady_phases(self) -> StepPhases | None:
        """The traced step's phases (one marked step with an update), else None (two steps: the second is steady)."""
        phase = self.optimizer
        if self.steps != 1 or not self.forward_bytes or phase is None:
            return None
        resident = self.resident_bytes
        return StepPhases(
            forward=self.forward_bytes - resident,
            backward=self.backward_bytes - resident,
            update=self.update_bytes - resident,
            update_start=self.update_start_bytes - resident,
            update_need=phase.extra_bytes if phase.need_bytes is None else phase.need_bytes,
            grads_before=self.grads_before,
            grads_after=self.grads_after,
            marked=True,
            accumulating=self.accumulating,
        )


@dataclass(frozen=True)
class CannotPredict:
    """The step could not be traced on fake tensors: ``reason`` says why in words, ``op`` names the
    operator when one was to blame (``aten.nonzero.default``)."""

    reason: str
    op: str | None = None

    def __str__(self) -> str:
        return self.reason


def trace_step(
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    batch: Any,
    size: int,
    step: StepFn,
    steps: int | None = None,
    device: torch.device | None = None,
    optimizer: OptimizerPhase | None = None,
    compute_dtypes: Mapping[int, torch.dtype] | None = None,
    reduced_gradients: Mapping[int, int] | None = None,
    accumulating: bool = False,
    record: bool = False,
    meta_update: bool = False,
) -> StepTrace | CannotPredict:
    """Trace ``steps`` calls of ``step`` on a fake ``batch`` of ``size`` samples; never raises.

    ``steps=None`` traces one step when every trainable parameter already has optimizer state, two
    otherwise: a first step creates the state, so only the second has the steady-state peak (state,
    gradients and activations alive together). ``steps=1`` where the state does not exist yet costs
    half and gives :attr:`StepTrace.steady_bytes`, a bound on that peak from the state it created.
    ``device`` puts the fake batch there (default: where
    the batch's tensors are). ``optimizer``, the phase an earlier one-step trace of the same training state
    measured, skips the update (see the module doc); it applies to one step only. ``compute_dtypes`` fakes
    FSDP2's mixed-precision parameters in their compute dtype (:func:`~retune.prediction.fake_state.
    fake_training_state`); pass the update's phase with it (:func:`trace_update`). ``reduced_gradients``
    (``id`` of a real parameter -> bytes: :func:`retune.distributed.fsdp2.gradient_shards`) counts each such
    gradient whole when backward makes it and at those bytes once it is accumulated: what an FSDP2 rank keeps
    of it after its reduce-scatter. ``accumulating``: the run accumulates gradients, so a window's later
    micro-batches hold them through backward (:attr:`StepTrace.steady_bytes` counts them there). ``record`` keeps
    the :attr:`StepTrace.recording` (none where a count changed other than by a new or a freed storage: the
    reduced gradients above), for :func:`retune.prediction.replay.replay`. ``meta_update``: ``step`` updates once,
    after its forward and backward (Lightning's automatic optimization), so where the module is on the CPU with one
    of torch's optimizers the update may be measured on ``meta`` tensors (:mod:`~retune.prediction.meta_update`;
    a manual step may update twice, or inside autocast).
    """
    started = time.perf_counter()
    count = steps if steps is not None else (1 if has_optimizer_state(optimizers) else 2)
    reuse = optimizer if count == 1 else None
    if compute_dtypes and reuse is None:  # the optimizers would update the compute-dtype fakes
        return CannotPredict("a step traced in its compute dtypes needs its update's phase (trace_update), one step")
    # a CPU step's one update, measured on meta tensors (meta_update: the same account, faster than on fakes);
    # meta_eligible never raises (nor does trace_step)
    on_meta = (
        meta_update
        and count == 1
        and reuse is None
        and len(optimizers) == 1
        and meta_eligible(optimizers[0])
        and _device_type(module, device) == "cpu"
        and not any(is_sharded(p) for p in module.parameters())
    )
    try:
        with preserved_rng(), _modes_preserved(module), torch.inference_mode(False), torch.enable_grad():
            mode = FakeTensorMode()  # real tensors reaching an op raise: nothing real can be written
            state = fake_training_state(mode, module, optimizers, compute_dtypes)
            fake = fake_batch(batch, size, mode, device)
            reduced = {  # by name: inside the swap below, the module's parameters are the fakes
                name: reduced_gradients[id(p)]
                for name, p in module.named_parameters(remove_duplicate=False)
                if reduced_gradients and id(p) in reduced_gradients
            }
            with attributes_kept(module), swapped_in(module, state), hooks_removed(module), mode:
                resident = resident_bytes(module, state.optimizers)
                batch_bytes = tensor_bytes(fake)
                with CpuPeakTracker(_device_type(module, device)) as tracker, _reduced(state, tracker, reduced):
                    if record:
                        tracker.record()
                    grads_before = tracker.adopt(p.grad for p in state.parameters.values() if p.grad is not None)
                    phases = TracedPhases(tracker, reuse, on_meta)
                    for opt in state.optimizers:
                        phases.wrap(opt)
                    with step_marks(phases):
                        for _ in range(count):
                            step(fake, state.optimizers)
                    grads_after = gradient_bytes(module)
                left = resident_bytes(module, state.optimizers) - resident  # a buffer the step grew, or shrank
            if reuse is None and phases.reuse is not None:  # the update was measured on meta tensors
                # what the step left resident and the state the update made, as the phase of an update run on the
                # fakes holds them
                left += phases.reuse.created_bytes
                phases.reuse = dataclasses.replace(phases.reuse, created_bytes=max(0, left))
            created = max(0, left)
            recording = None
            if record and tracker.recording is not None and ("!",) not in tracker.recording:
                recording = Recording(
                    tuple(tracker.recording),
                    batch_shapes(fake),
                    fixed_dims(module),
                    phases.reuse,  # the one given, or the update measured on meta tensors
                )
            facts = StepFacts(size, count, resident, created, batch_bytes, grads_before, grads_after, accumulating)
            result = assemble(phases, tracker, facts, reuse, time.perf_counter() - started, recording)
    except Exception as error:  # every failure of the trace is a "cannot predict"
        return cannot_predict(error)
    return result


@dataclass(frozen=True)
class StepFacts:
    """What a traced step's result holds besides its phases: the batch it was traced at and what does not
    depend on it."""

    size: int
    count: int
    resident: int
    created: int
    batch_bytes: int
    grads_before: int
    grads_after: int
    accumulating: bool


def assemble(
    phases: TracedPhases,
    tracker: CpuPeakTracker,
    facts: StepFacts,
    reuse: OptimizerPhase | None,
    seconds: float,
    recording: Recording | None = None,
) -> StepTrace:
    """The :class:`StepTrace` of a step whose phases were measured on ``tracker`` (traced, or replayed)."""
    resident, created = facts.resident, facts.created
    phase = phases.phase(created)
    tail = tracker.peak_bytes  # after the last update (the whole step where none ran)
    compute = resident + (phases.compute_peak if phases.updates else tail)
    update = resident + max(phases.update_peak, phases.skipped_peak, tail) if phases.updates else 0
    peak = max(compute, update)
    if reuse is not None and phase is not None:
        created = phase.created_bytes
    update_start = resident + phases.update_start if phase is not None else 0
    forward = resident + phases.forward_peak if phases.forward_peak is not None else 0
    backward = resident + phases.backward_peak if forward and phases.updates else 0
    return StepTrace(
        facts.size,
        peak,
        resident,
        facts.count,
        seconds,
        created,
        facts.batch_bytes,
        phase,
        compute,
        update_start,
        forward,
        backward,
        update,
        facts.grads_before,
        facts.grads_after,
        facts.accumulating,
        recording,
    )


def batch_shapes(batch: Any) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The shape and bytes of each of ``batch``'s tensors, in pytree order (:attr:`Recording.batch_shapes`)."""
    return tuple((tuple(int(d) for d in tensor.shape), tensor_bytes(tensor)) for tensor in batch_tensors(batch))


def fixed_dims(module: torch.nn.Module) -> frozenset[int]:
    """Every dimension of ``module``'s parameters and buffers (:attr:`Recording.fixed_dims`)."""
    dims: set[int] = set()
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        dims.update(int(d) for d in tensor.shape)
    return frozenset(dims)


@contextmanager
def _reduced(state: Any, tracker: CpuPeakTracker, reduced: Mapping[str, int]) -> Iterator[None]:
    """Inside the block, each fake parameter named in ``reduced`` has its gradient counted at those bytes from the
    moment backward accumulates it (see :func:`trace_step`)."""
    handles = []
    for name, kept in reduced.items():
        fake = state.parameters.get(name)
        if fake is not None and fake.requires_grad:

            def reduce(param: torch.Tensor, kept: int = kept) -> None:
                if param.grad is not None:
                    tracker.recount(param.grad, kept)

            handles.append(fake.register_post_accumulate_grad_hook(reduce))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class TracedPhases:
    """The phases of a traced step, measured on its tracker, and the same accounting re-run by a replay
    (:func:`retune.prediction.replay.replay` calls these methods where the recording marks them).

    Each fake optimizer's ``step`` wrapped (an instance attribute on the clone): measures the update's peak
    above the live bytes at its start, or, with ``reuse``, runs only the closure and accounts the update as
    ``reuse`` measured it."""

    def __init__(self, tracker: CpuPeakTracker, reuse: OptimizerPhase | None, on_meta: bool = False) -> None:
        self.tracker, self.reuse = tracker, reuse
        self.on_meta = on_meta
        """Measure the update on ``meta`` tensors (:mod:`~retune.prediction.meta_update`: a CPU step's, faster than
        on fakes) and account it as a reused phase; where that fails, the update runs on the fakes."""
        self.extra: int | None = None
        self.skipped_peak = 0
        self.updates = 0  # updates started (run or skipped)
        self.compute_peak = 0  # the tracker's peak before each update (forward and backward)
        self.update_start = 0  # the live bytes when an update started
        self.update_peak = 0  # the live bytes' peak during a measured update
        self.forward_peak: int | None = None  # the peak to zero_grad, where the step marks it (step_marks)
        self.backward_peak = 0  # from there to the update's start
        self.need: int | None = None  # a measured update's peak above its start beyond the state it created
        self._start = 0  # the live bytes when the measured update running now started

    def _mark(self, name: str) -> None:
        """Note in the tracker's recording where this phase call came (a replay makes it at the same point)."""
        if self.tracker.recording is not None:
            self.tracker.recording.append(("@", name))

    def forward_done(self) -> None:
        self._mark("forward_done")
        tracker = self.tracker
        self.forward_peak = max(self.forward_peak or 0, tracker.peak_bytes)
        self.compute_peak = max(self.compute_peak, tracker.peak_bytes)
        tracker.peak_bytes = tracker.live_bytes  # backward's own peak, from here

    def backward_done(self) -> None:
        """The update's start is where the optimizer's ``step`` runs it (after clipping): see :meth:`wrap`."""

    def update_skipped(self) -> None:
        """An update reused (``reuse``) starts here: accounted as it measured, not run."""
        self._mark("update_skipped")
        tracker = self.tracker
        assert self.reuse is not None
        start = tracker.live_bytes
        self._started(start)
        self.skipped_peak = max(self.skipped_peak, start + self.reuse.extra_bytes)
        self.extra = self.reuse.extra_bytes
        # as after a measured update: the peak from here is the step's tail, not forward and backward
        # again (read as the update's peak, it made a skipped update as large as the whole step)
        tracker.peak_bytes = tracker.live_bytes

    def update_started(self) -> None:
        """A measured update starts here (its own peak and the storages it makes are counted from now)."""
        self._mark("update_started")
        tracker = self.tracker
        self._start = start = tracker.live_bytes
        self._started(start)
        tracker.peak_bytes = start  # the update's own peak, from here
        tracker.log_new_storages()

    def update_done(self) -> None:
        """The measured update of :meth:`update_started` ended (or failed)."""
        self._mark("update_done")
        tracker, start = self.tracker, self._start
        self.need = max(self.need or 0, tracker.own_need(start))
        self.extra = max(self.extra or 0, tracker.peak_bytes - start)
        self.update_peak = max(self.update_peak, tracker.peak_bytes)
        tracker.peak_bytes = tracker.live_bytes  # a later step's forward and backward, from here

    def wrap(self, optimizer: torch.optim.Optimizer) -> None:
        original = optimizer.step

        def step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            loss = None
            if self.reuse is not None:
                if closure is not None:
                    with torch.enable_grad():
                        loss = closure()
                self.update_skipped()
                return loss
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            done: Any = lambda: loss  # noqa: E731  # the closure already ran: the update sees its loss
            if self.on_meta:
                measured = update_on_meta(optimizer, done if closure is not None else None, kwargs)
                self.on_meta = False  # one update is measured; a later one in the step reuses it
                if measured is not None:
                    self.reuse = OptimizerPhase(*measured)
                    self.update_skipped()
                    return loss
            self.update_started()
            try:
                original(done, **kwargs) if closure is not None else original(**kwargs)
            finally:
                self.update_done()
            return loss

        optimizer.step = step  # type: ignore[method-assign]

    def _started(self, live: int) -> None:
        self.updates += 1
        self.compute_peak = max(self.compute_peak, self.tracker.peak_bytes)
        if self.forward_peak is not None:
            self.backward_peak = max(self.backward_peak, self.tracker.peak_bytes)
        self.update_start = max(self.update_start, live)

    def phase(self, created: int) -> OptimizerPhase | None:
        if self.extra is None:
            return None
        return self.reuse or OptimizerPhase(self.extra, created, self.need)


def trace_update(
    module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device | None = None
) -> OptimizerPhase | CannotPredict:
    """The optimizer update alone, traced: every trainable parameter's fake holds a fake gradient of its own
    shape and dtype (alive when an update starts), each optimizer's ``step()`` runs, and its peak above that
    start and the state it created are the phase (what :class:`TracedPhases` measures inside a step). For a step
    traced in another dtype than its parameters are stored in (FSDP2's mixed precision), whose update runs on
    the stored parameters. An optimizer whose ``step`` needs a closure (L-BFGS) cannot be traced this way."""
    try:
        with preserved_rng(), torch.inference_mode(False):
            mode = FakeTensorMode()
            state = fake_training_state(mode, module, optimizers)
            with swapped_in(module, state), mode:
                for param in state.parameters.values():
                    if param.requires_grad:
                        param.grad = torch.zeros_like(param)
                before = resident_bytes(module, state.optimizers)
                with CpuPeakTracker(_device_type(module, device)) as tracker:
                    tracker.log_new_storages()
                    for opt in state.optimizers:
                        opt.step()
                    need = tracker.own_need(0)
                created = max(0, resident_bytes(module, state.optimizers) - before)
    except Exception as error:  # every failure of the trace is a "cannot predict"
        return cannot_predict(error)
    return OptimizerPhase(tracker.peak_bytes, created, need)


def trace_training_step(
    trainer: Any,
    pl_module: Any,
    batch: Any,
    size: int,
    batch_idx: int = 0,
    steps: int | None = None,
    optimizer: OptimizerPhase | None = None,
    compute_dtypes: Mapping[int, torch.dtype] | None = None,
    reduced_gradients: Mapping[int, int] | None = None,
    record: bool = False,
) -> StepTrace | CannotPredict:
    """:func:`trace_step` of the run's own training step, as a probe runs it (see the module doc).

    ``batch`` is one real batch of the kind the loader yields (a few samples); it goes through the transfer a
    probe's batch goes through (the precision's input conversion, ``on_before_batch_transfer``, the strategy's
    move and ``on_after_batch_transfer``: a hook that casts or reshapes the batch does so before the trace),
    then only its structure, dtypes and per-sample shapes are read.
    """
    try:
        batch = batch_to_device(trainer, pl_module, batch, 0)
    except Exception as error:  # a transfer hook that fails: a "cannot predict" (the probes then show it)
        return cannot_predict(error)

    def step(fake: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        with optimizers_replaced(trainer, optimizers), hooks_isolated(trainer, pl_module), logging_silenced(pl_module):
            training_step(trainer, pl_module, fake, batch_idx)

    return trace_step(
        pl_module,
        list(trainer.optimizers),
        batch,
        size,
        step,
        steps,
        pl_module.device,
        optimizer,
        compute_dtypes,
        reduced_gradients,
        get_accumulation(trainer) > 1,
        record,
        meta_update=bool(getattr(pl_module, "automatic_optimization", True)),
    )


def cannot_predict(error: BaseException) -> CannotPredict:
    """The reason a trace failed, in words, naming the operator where one was to blame."""
    func = getattr(error, "func", None)
    op = None if func is None else str(func)
    if isinstance(error, DataDependentOutputException):
        why = (
            "its result depends on tensor values (a .item(), or a tensor in an `if`), which a fake trace does not have"
        )
        return CannotPredict(f"data-dependent operator {op}: {why}", op)
    if isinstance(error, DynamicOutputShapeException):
        return CannotPredict(f"operator {op} returns a shape that depends on the data (nonzero, masked_select)", op)
    if isinstance(error, UnsupportedOperatorException):
        return CannotPredict(f"operator {op} has no fake-tensor implementation (a custom kernel?)", op)
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if "data is not allocated yet" in message:  # a fake tensor's values read outside an operator
        return CannotPredict(
            "the step reads tensor values outside an operator (torch.tensor() of tensors, .tolist(), .numpy(): "
            "often logging code, such as Lightning's grad_norm logged in on_before_optimizer_step), which a fake "
            f"trace does not have ({message[:200]})",
            op,
        )
    if "convert all Tensors to FakeTensors" in message:  # FakeTensorMode's words for a real tensor in an operator
        return CannotPredict(
            "the step computes with a tensor the trace cannot stand in for (a torchmetrics metric's state updated "
            "in the step, a tensor kept in a plain attribute of the module or made outside the step: register such "
            f"a tensor as a buffer to have it traced) ({message[:200]})",
            op,
        )
    return CannotPredict(f"the step failed on fake tensors: {type(error).__name__}: {message}"[:500], op)


def _device_type(module: torch.nn.Module, device: torch.device | None) -> str:
    """The device whose fakes the trace counts: the batch's target, else the module's parameters' (a CUDA
    step's activations are CUDA fakes, which a tracker of host memory would not see)."""
    if device is not None:
        return device.type
    first = next(iter(module.parameters()), None)
    return "cpu" if first is None else first.device.type


@contextmanager
def _modes_preserved(module: torch.nn.Module) -> Iterator[None]:
    """Every submodule's train/eval flag as it was (a step may call ``self.eval()``)."""
    modes = [(sub, sub.training) for sub in module.modules()]
    try:
        yield
    finally:
        for sub, training in modes:
            sub.training = training
