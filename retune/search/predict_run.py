"""``search.predict: auto`` in a run: the traces of the run's own training step, agreed across ranks, and
the verifying probes, or the reason the search falls back to real probes alone.

The traces run inside the probe session (:meth:`retune.probing.prober.Prober.session`), on the batch a
probe at a small size would train on (:meth:`~retune.probing.prober.Prober.sample_batch` at the plan's start,
or at 2 where every step of a trial holds the same batch), faked at each traced size: the faked batches keep
that batch's sample sizes (its padded length, :mod:`retune.prediction.fake_batch`). With ``probe_samples:
largest`` that is the length every probe runs at (the dataset's largest samples, padded to the longest, at
every size), and the prediction is what the probes measure. With ``probe_samples: first`` (the default) on
data padded per batch it is not: a probe at ``N`` runs the first ``N`` samples padded to the longest of
*those*, which grows with ``N``, while the trace keeps the first few samples' length; the prediction then
reads low where the probes' padding is longer (45-49% on a small padded transformer with sequences of 4-23
tokens, where ``largest`` predicted the probe to the byte), and the verifying probes correct it (the
calibration), at the price of a first probe over the limit and more probes. Use ``probe_samples: largest``
with variable-length data (or buckets, each traced on its own worst batch). Each trace is one
step (:attr:`retune.prediction.trace.StepTrace.steady_bytes`: the state it creates counted as alive),
plus the batch's bytes, which a probe counts too (on a CPU added to the tracker's count, on a device in
the allocator's, the batch moved there inside the measured block): the prediction is the quantity a probe
measures. Under DDP every rank traces its own batch and the ranks agree on the largest prediction at
each size (one collective per trace), so every rank takes the same sizes and the same decisions; where
one rank cannot trace, none predicts.

The verifying probes are the search's own (:meth:`~retune.probing.prober.Prober.measure`), with
``steady_stop`` where every step of a trial holds the same batch (``probe_samples: largest``, a bucket's
worst batch): a trial then ends after its first step with the steady-state peak (one step once the
optimizer state exists; on the CPU tracker, the step that creates it, counted with the state), instead
of ``steps_per_trial`` steps.

Under FSDP2 each rank traces the plain module on its batch (:mod:`retune.prediction.trace`) and counts its
shards of the state in place of the whole (:class:`retune.distributed.fsdp2.ShardAccount`): what grows with
the batch is traced, what does not is the rank's. With a ``MixedPrecisionPolicy`` forward and backward are
traced in the dtype FSDP2 computes in, and the optimizer update, which runs on the stored shards, apart
(:func:`retune.prediction.trace.trace_update`, once per tracer).

Where it cannot predict (no limit to predict against, an evaluation stage, a torch whose FSDP2 keeps its hooks
elsewhere, a step that fails on fake tensors, a torch without fake tensors), :func:`why_not_predict` or the
trace says why, and the caller searches as if ``predict`` were ``off``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from retune import compat
from retune.distributed.fsdp2 import ShardAccount, compute_dtypes, gradient_shards, why_not_traced
from retune.memory import resident_bytes
from retune.prediction.reuse import TraceMemo, Unkeyable, memo_for, trace_key
from retune.probing.prober import Prober
from retune.recovery.split import SplitError, batch_length
from retune.search.largest import SearchPlan
from retune.search.predicted import PredictedResult, Prediction, predict_largest, run_predicted_search

__all__ = [
    "replay_matches",
    "REPLAY_TOLERANCE",
    "PredictionRecord",
    "Replaying",
    "Tracer",
    "Untraceable",
    "predicted_search",
    "sample_to_trace",
    "steady_probes",
    "why_not_predict",
]


class Untraceable(Exception):
    """A trace could not run on some rank: ``reason`` says why (every rank raises it together)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def why_not_predict(trainer: Any, stage: str, limit: int | None) -> str | None:
    """Why this search cannot predict, before any trace (None: it may try)."""
    if limit is None:
        return "there is no limit to predict against (no memory.budget and no device memory statistics)"
    if stage != "train":
        return f"the {stage} stage is probed: a prediction traces training steps"
    if compat.is_sharded(trainer):
        reason = why_not_traced(trainer.lightning_module)
        if reason is not None:
            return reason
    try:
        import retune.prediction.trace  # noqa: F401  # fake tensors: torch._subclasses.fake_tensor
    except ImportError as error:  # a torch without the fake-tensor API this build uses
        return f"this torch ({_torch_version()}) has no usable fake tensors: {error}"
    return None


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


@dataclass
class Tracer:
    """``trace(size)``: the agreed predicted peak at ``size`` on ``batch``; ``seconds`` spent tracing."""

    trainer: Any
    pl_module: Any
    batch: Any
    seconds: float = 0.0
    traces: int = 0
    fixed: float | None = None
    """After a trace: what does not grow with the batch, agreed across ranks (parameters, buffers and optimizer
    state, traced, plus the trainable parameters' gradients; under FSDP2 the rank's account of them:
    :meth:`retune.distributed.fsdp2.ShardAccount.fixed`)."""
    phases: dict[int, tuple[float, ...]] = field(default_factory=dict)
    """By traced size, the steady peak of forward, backward and the update, each plus the batch and agreed across
    ranks (:attr:`retune.prediction.trace.StepTrace.steady_parts`): each grows linearly with the batch, so the
    prediction draws a line per phase and takes the highest (:class:`retune.search.predicted.Prediction`), where
    one line through the step's peaks at two sizes would cut across the corner where one phase overtakes
    another. Empty where the trace does not tell them apart (FSDP2: the rank's account is one peak)."""
    reused: int = 0
    """Predictions taken from an earlier trace of the same training state, batch and size
    (:mod:`retune.prediction.reuse`), without tracing."""
    optimizer: Any = None
    """The optimizer update the first trace measured (:class:`retune.prediction.trace.OptimizerPhase`): later
    traces of this search reuse it and run forward and backward only (the state is the same; only the batch
    differs). Share one between tracers of one search (several buckets) with ``Tracer(..., optimizer=...)``."""
    record: bool = False
    """Traces keep their recording (:attr:`retune.prediction.trace.StepTrace.recording`) in :attr:`last`, for
    :meth:`replay`."""
    last: Any = None
    """The last trace this tracer made (:class:`retune.prediction.trace.StepTrace`), where it made one."""
    batch_arg_name: str | None = None
    """The attribute the run's batch size lives in: a trace at a size holds that size there, as a probe does (a
    step that reads ``self.batch_size``: noise or in-batch targets sized by it). None: left as it is."""

    def tag_size(self, lengths_change: bool = True) -> int | None:
        """The batch size to record a trace at (:func:`retune.prediction.replay.tag_size`, of the batch as the trace
        sees it: after the transfer hooks), agreed across ranks (one collective): None on every rank where any rank
        has none or the ranks' differ, and under FSDP2. ``lengths_change``: the replays will be at other samples'
        sizes (other buckets), not only other batch sizes."""
        from retune.prediction.replay import tag_size
        from retune.prediction.trace import fixed_dims

        local = None
        if not compat.is_sharded(self.trainer):
            try:
                batch = compat.batch_to_device(self.trainer, self.pl_module, self.batch, 0)
                local = tag_size(batch, fixed_dims(self.pl_module), lengths_change, self._activation_sizes())
            except Exception:  # a batch whose sizes cannot be read: no recording, the search traces
                local = None
        gathered = compat.all_gather_object(self.trainer, local)
        return local if local is not None and all(tag == local for tag in gathered) else None

    def replay(self, source: Any, size: int) -> float | None:
        """The agreed prediction at ``size`` on this tracer's batch read from ``source``, a recorded trace of the same
        training state (:func:`retune.prediction.replay.replay`), without tracing; None on every rank where any
        rank cannot replay it (the caller traces instead). Not under FSDP2, whose rank account is traced. Every
        rank calls it, with or without a ``source`` (None: this rank has none), as it is one collective."""
        from retune.prediction.replay import replay, target_shapes
        from retune.prediction.trace import CannotPredict

        started = time.perf_counter()
        result: Any = CannotPredict("a sharded step's account is traced")
        if source is None:
            result = CannotPredict("no recorded trace to replay")
        elif not compat.is_sharded(self.trainer):
            try:
                batch = compat.batch_to_device(self.trainer, self.pl_module, self.batch, 0)
                result = replay(source, target_shapes(batch, size), size, self._activation_sizes())
            except Exception as error:  # a batch the replay cannot read (its shapes): the caller traces
                result = CannotPredict(f"the batch could not be read for a replay: {type(error).__name__}: {error}")
        local = str(result) if isinstance(result, CannotPredict) else self._local(result, None, {})
        self.seconds += time.perf_counter() - started
        gathered = compat.all_gather_object(self.trainer, local)
        if any(isinstance(value, str) for value in gathered):
            return None
        return self._agreed(local, size, gathered)

    def recorded_replay(self, size: int, lengths_change: bool = True) -> tuple[float, Any] | None:
        """The agreed prediction at ``size`` read from a trace this tracer records at an agreed tag size
        (:meth:`tag_size`), with that trace (:class:`retune.prediction.trace.StepTrace`, whose recording later
        sizes can be replayed from); None on every rank where no tag size is agreed or the replay is refused on
        any rank: the caller traces ``size`` instead. Collective: every rank calls it."""
        tag = self.tag_size(lengths_change)  # agreed: every rank records, or none
        if tag is None:
            return None
        self.record = True
        try:
            self(tag)
        finally:
            self.record = False
        recorded = self.last if self.last is not None and self.last.recording is not None else None
        value = self.replay(recorded, size)  # every rank, with or without its recording: one collective
        return None if value is None else (value, recorded)

    def __call__(self, size: int) -> float:
        from retune.prediction.trace import CannotPredict, trace_training_step, trace_update

        started = time.perf_counter()
        optimizers = list(self.trainer.optimizers)
        sharded = compat.is_sharded(self.trainer)
        # FSDP2's mixed precision: parameters computed in another dtype than they are stored in
        dtypes: dict[int, Any] = compute_dtypes(self.pl_module) if sharded else {}
        memo, key = self._memo_key(optimizers, size, sharded, dtypes)
        remembered = None if memo is None else memo.get(key)
        if remembered is not None:  # the same training state traced at this size before: the same prediction
            kept, phase, trace = remembered
            self.optimizer = self.optimizer or phase
            self.last = trace if trace is not None else self.last
            self.reused += 1
            self.seconds += time.perf_counter() - started
            return self._agreed(kept, size)
        account = None
        shards: dict[int, int] = {}
        result: Any = None
        if sharded:  # the trace counts the whole state: this rank holds shards
            account = ShardAccount.of(self.pl_module, optimizers, resident_bytes(self.pl_module, optimizers))
            shards = gradient_shards(self.pl_module)  # each gradient whole when made, the rank's shard once reduced
            if dtypes and self.optimizer is None:  # the update runs on the stored shards: traced apart
                phase = trace_update(self.pl_module, optimizers, self.pl_module.device)
                result = phase if isinstance(phase, CannotPredict) else None
                self.optimizer = None if isinstance(phase, CannotPredict) else phase
        if result is None:
            # a manual step marks no phases: one step that creates the state only bounds a later one (the state
            # twice where the update is the peak); two steps, where the state does not exist yet, trace that step
            manual = not getattr(self.pl_module, "automatic_optimization", True)
            with _batch_attr_at(self.trainer, self.pl_module, self.batch_arg_name, size):
                result = trace_training_step(
                    self.trainer,
                    self.pl_module,
                    self.batch,
                    size,
                    steps=None if manual else 1,
                    optimizer=self.optimizer,
                    compute_dtypes=dtypes,
                    reduced_gradients=shards,
                    record=self.record,
                )
        self.seconds += time.perf_counter() - started
        self.traces += 1
        if isinstance(result, CannotPredict):
            local: tuple[float, tuple[float, ...], float] | str = str(result)
        else:
            self.optimizer, self.last = result.optimizer, result
            local = self._local(result, account, shards)
            if result.recording is not None:
                self._saw(result)
            if memo is not None:  # with its recording where it kept one: a replay from it needs no trace either
                memo.put(key, (local, self.optimizer, result if result.recording is not None else None))
        return self._agreed(local, size)

    def _activation_sizes(self) -> frozenset[int]:
        """The sizes of the model's activations that this fit's recordings showed (see :meth:`_saw`)."""
        memo = _memo_of(self.pl_module)
        return frozenset(memo.activation_sizes) if memo is not None else frozenset()

    def _saw(self, result: Any) -> None:
        """Keep the sizes of the model's own activations that ``result``'s recording shows, for the fit's later
        replays and tag sizes: a recording at another sample size cannot tell such a size from a length one or
        two away from it (:func:`retune.prediction.replay.activation_sizes`)."""
        from retune.prediction.replay import activation_sizes

        memo = _memo_of(self.pl_module)
        try:
            sizes = activation_sizes(result)
        except Exception:  # a recording it cannot read: nothing kept (this runs on one rank, before the agreement)
            sizes = frozenset()
        if memo is not None:
            memo.activation_sizes.update(sizes)

    def _local(
        self, result: Any, account: ShardAccount | None, shards: dict[int, int]
    ) -> tuple[float, tuple[float, ...], float]:
        """This rank's ``(peak, phases, fixed)`` from a traced (or replayed) step."""
        from retune.prediction.sharded import rank_peak

        grads = sum(p.numel() * p.element_size() for p in self.pl_module.parameters() if p.requires_grad)
        fixed = float(result.resident_bytes + result.created_bytes + grads)
        # a probe's peak holds its batch: on a CPU the tracker's count plus the loader's batch, on a device the
        # allocator's, after the batch moved there inside the measured block
        peak = float(result.steady_bytes + result.batch_bytes)
        parts = result.steady_parts
        phases = tuple(float(part + result.batch_bytes) for part in parts) if parts is not None else ()
        if account is not None:  # the trace held each gradient as the rank's shard from its reduce on
            peak = rank_peak(result, account, sum(shards.values())) + result.batch_bytes
            fixed, phases = float(account.fixed(result.created_bytes)), ()
        return peak, phases, fixed

    def _memo_key(
        self, optimizers: list[Any], size: int, sharded: bool, dtypes: dict[int, Any]
    ) -> tuple[TraceMemo | None, Any]:
        """The module's memo of traces and this trace's key (:mod:`retune.prediction.reuse`); no memo where the
        key cannot be made (a batch or optimizer state it cannot describe, a module without a hash: an ``__eq__``
        without ``__hash__``). Whether the run accumulates gradients is part of the key (a trace of an accumulating
        run holds the window's gradients in backward), and under FSDP2 the dtypes each parameter is computed in."""
        module = self.pl_module
        # a run that accumulates gradients traces its window's gradients into backward (trace_training_step): a
        # GradientAccumulationScheduler that starts accumulating changes the trace, not the training state
        extra: tuple[Any, ...] = (self.trainer is not None and compat.get_accumulation(self.trainer) > 1,)
        if sharded:
            extra += (True, tuple(str(dtypes.get(id(p))) for p in module.parameters()))
        try:
            return memo_for(module), trace_key(module, optimizers, self.batch, size, *extra)
        except (Unkeyable, TypeError):  # TypeError: an unhashable module (its own walks and the memo need a hash)
            return None, None

    def _agreed(
        self, local: tuple[float, tuple[float, ...], float] | str, size: int, gathered: list[Any] | None = None
    ) -> float:
        """This rank's ``(peak, phases, fixed)`` at ``size`` (or why it cannot trace) agreed across ranks: the
        largest of each (phase by phase, where every rank has them); the peak is returned, the phases kept in
        :attr:`phases`. ``gathered``: every rank's, where the caller gathered them already."""
        if gathered is None:
            gathered = compat.all_gather_object(self.trainer, local)
        reasons = [value for value in gathered if isinstance(value, str)]
        if reasons:
            raise Untraceable(reasons[0])
        values = [(float(peak), tuple(phases), float(fixed)) for peak, phases, fixed in gathered]
        self.fixed = max(fixed for _, _, fixed in values)
        parts = [phases for _, phases, _ in values]
        if parts and all(len(p) == len(parts[0]) and p for p in parts):
            self.phases[size] = tuple(max(column) for column in zip(*parts, strict=True))
        return max(peak for peak, _, _ in values)


REPLAY_TOLERANCE = 0.01
"""How far a replay of a recorded trace may be from a trace at the same size and batch for later searches of the
fit to replay instead of trace (the replays measured: equal to the byte, MLP to GPT-2; a step whose storages do
not scale with its batch's dimensions is off by far more)."""


@contextmanager
def _batch_attr_at(trainer: Any, pl_module: Any, name: str | None, size: int) -> Iterator[None]:
    """Inside the block, the run's batch-size attribute ``name`` holds ``size`` (where it can be read), as in a probe
    at that size; put back after."""
    before = None
    if name is not None:
        try:
            before = compat.get_batch_attr(trainer, pl_module, name)
        except Exception:  # no such attribute (a loader of fixed batches): nothing to hold
            before = None
    if name is None or before is None:
        yield
        return
    compat.set_batch_attr(trainer, pl_module, name, size)
    try:
        yield
    finally:
        compat.set_batch_attr(trainer, pl_module, name, before)


def replay_matches(
    replayed: float,
    traced: float,
    replayed_parts: tuple[float, ...] | None = None,
    traced_parts: tuple[float, ...] | None = None,
    fixed: float = 0.0,
) -> bool:
    """Whether a replay equals a trace at the same size and batch, for the fit's verdict: the peaks within
    :data:`REPLAY_TOLERANCE`, and each phase (forward, backward, the update: where both have them) within that
    fraction of its part above ``fixed``, the memory no batch changes. The peak alone is blind where a batch of one
    sample peaks in the optimizer update (the same in both): a replay that got the activations wrong by 7-85% passed
    there, and the fit replayed wrong sizes after it."""
    if abs(replayed - traced) > REPLAY_TOLERANCE * traced:
        return False
    if not replayed_parts or not traced_parts or len(replayed_parts) != len(traced_parts):
        return True
    return all(
        abs(r - t) <= REPLAY_TOLERANCE * max(t - fixed, 0.0) for r, t in zip(replayed_parts, traced_parts, strict=True)
    )


@dataclass
class Replaying:
    """``trace(size)`` for :func:`~retune.search.predicted.predict_largest` that traces once and reads the other
    sizes from that trace's recording (:mod:`retune.prediction.replay`), where replays have matched traces in
    this fit.

    The first call traces at a tag size (:func:`~retune.prediction.replay.tag_size`), recorded, and replays it at
    the size asked. In the fit's first search the second call also traces, and the replay is checked against
    it: within :data:`REPLAY_TOLERANCE` every later search of the fit traces once and replays every size; else
    none replays, and :attr:`replayed_unchecked` tells the caller that the first value was a replay that did not
    hold (it predicts again from traces). ``state`` holds the fit's verdict (the module's
    :class:`~retune.prediction.reuse.TraceMemo`); without one, or under FSDP2 (a rank's account is traced),
    every call traces."""

    tracer: Tracer
    state: TraceMemo | None
    source: Any = None
    replayed_unchecked: bool = False
    tried: bool = False

    @property
    def replays_next(self) -> bool:
        """Whether the next call replays (about a millisecond) rather than traces: a recording exists and this fit's
        replays matched its traces. The same on every rank (the recording and the verdict are agreed)."""
        state = self.state
        return (
            state is not None
            and state.replays is True
            and self.source is not None
            and not compat.is_sharded(self.tracer.trainer)
        )

    def __call__(self, size: int) -> float:
        tracer, state = self.tracer, self.state
        # the same on every rank: the memo's verdict comes from agreed values, sharding is the run's
        if state is None or state.replays is False or compat.is_sharded(tracer.trainer):
            return tracer(size)
        if self.source is None and not self.tried:
            self.tried = True
            got = tracer.recorded_replay(size, lengths_change=False)  # one batch shape
            if got is None:
                return tracer(size)
            self.source = got[1]
            self.replayed_unchecked = state.replays is None
            return got[0]
        if self.source is None:
            return tracer(size)
        replayed = tracer.replay(self.source, size)
        replayed_parts = tracer.phases.get(size)
        if state.replays is True and replayed is not None:
            return replayed
        traced = tracer(size)
        if state.replays is None:  # the fit's first check
            state.replays = replayed is not None and replay_matches(
                replayed, traced, replayed_parts, tracer.phases.get(size), tracer.fixed or 0.0
            )
            self.replayed_unchecked = self.replayed_unchecked and not state.replays
        return traced


def _memo_of(module: Any) -> TraceMemo | None:
    """``module``'s :class:`~retune.prediction.reuse.TraceMemo` (None: a module without a hash)."""
    try:
        return memo_for(module)
    except TypeError:
        return None


def sample_to_trace(trainer: Any, prober: Prober, size: int) -> Any:
    """The batch a probe at ``size`` would train on, to trace (:meth:`~retune.probing.prober.Prober.sample_batch`);
    :class:`Untraceable` on every rank where the loader failed on any (one collective under DDP: a rank without
    a batch must not leave the others waiting in a trace's agreement)."""
    try:
        batch, reason = prober.sample_batch(size), None
    except Exception as error:  # said as the reason; the loader's failure shows again in the probes that follow
        batch, reason = None, f"no batch to trace ({type(error).__name__}: {error})"
    if reason is None:
        reason = _not_batch_first(batch, size)
    reasons = [r for r in compat.all_gather_object(trainer, reason) if r is not None]
    if reasons:
        raise Untraceable(reasons[0])
    return batch


def _not_batch_first(batch: Any, size: int) -> str | None:
    """Why ``batch``, asked of the loader at ``size`` samples, cannot be faked at other sizes (None: it can). A trace
    fakes the batch's leading dimension as its samples (:mod:`retune.prediction.fake_batch`); a batch whose leading
    dimension is longer than the samples asked for is not batch-first (``pad_sequence``'s default time-major
    ``(length, batch)``), and faking its length as the batch predicted every bucket's memory per sample alike."""
    try:
        length = batch_length(batch)
    except SplitError:
        return None  # the trace says why (an ambiguous batch dimension)
    if length is not None and length > size and _samples_as_they_are(batch, size):
        return (
            f"the batch is a {type(batch).__name__} of {size} samples as the dataset returns them (a collate_fn "
            f"such as `lambda b: b`), not tensors with a batch dimension ({length}, its tensors' first dimension, "
            "is a sample's own); a prediction fakes the batch dimension: stack the samples in the collate_fn to "
            "predict"
        )
    if length is not None and length > size:
        return (
            f"the batch's leading dimension is {length} where the loader was asked for {size} samples: a prediction "
            "fakes the leading dimension as the samples (batch-first); a time-major batch (pad_sequence's default, "
            "(length, batch)) or a loader that decides its own batch sizes is searched with real probes"
        )
    return None


def _samples_as_they_are(batch: Any, size: int) -> bool:
    """Whether ``batch``, asked of the loader at ``size`` samples, is those samples in a list, unstacked (a
    ``collate_fn=lambda b: b`` over ``(x, y)`` samples): ``size`` items of one type, each a container (a tuple, a
    list, a mapping), or each a tensor of one shape without a dimension of ``size`` (time-major fields
    ``[src, tgt]``, each ``(length, batch)``, have one). A batch split into fields (``(x, y)``) holds tensors whose
    first dimension is the batch's, so :func:`_not_batch_first` asks this only where that dimension is longer than
    the samples asked for."""
    if not isinstance(batch, (list, tuple)) or hasattr(batch, "_fields") or len(batch) != size:
        return False
    if len({type(item) for item in batch}) != 1:
        return False
    if all(isinstance(item, torch.Tensor) for item in batch):
        shapes = {tuple(item.shape) for item in batch}
        return len(shapes) == 1 and size not in next(iter(shapes))
    return all(isinstance(item, (list, tuple, Mapping)) for item in batch)


@contextmanager
def steady_probes(prober: Prober, same_batch: bool) -> Iterator[None]:
    """The prober's trials measure the steady state inside the block, and stop at their first steady step when
    ``same_batch`` (see the module doc)."""
    before = (prober.steady_peaks, prober.steady_stop)
    prober.steady_peaks, prober.steady_stop = True, same_batch
    try:
        yield
    finally:
        prober.steady_peaks, prober.steady_stop = before


@dataclass
class PredictionRecord:
    """What ``search.predict`` did in one search, for its event: ``path`` is ``predicted`` or ``probed`` (empty:
    not asked), ``reason`` why it fell back, ``predicted`` the traced peak per trial, ``seconds`` tracing."""

    path: str = ""
    reason: str = ""
    predicted: list[int | None] = field(default_factory=list)
    seconds: float = 0.0

    def fell_back(self, reason: str, warn_once: Callable[[str, str], None]) -> None:
        self.path, self.reason = "probed", reason
        warn_once("predict", f"search.predict: the batch size is searched with real probes only: {reason}")

    def event_fields(self, trials: int) -> dict[str, Any]:
        if not self.path:
            return {}
        predicted = (self.predicted + [None] * trials)[:trials] if self.path == "predicted" else []
        return {"prediction": self.path, "predicted_bytes": predicted, "prediction_s": round(self.seconds, 4)}

    @property
    def note(self) -> str:
        return f"predict fell back to real probes: {self.reason}" if self.path == "probed" else ""


def predicted_search(
    trainer: Any,
    pl_module: Any,
    prober: Prober,
    plan: SearchPlan,
    limit: int | None,
    *,
    stage: str,
    same_batch: bool,
    record: PredictionRecord,
    warn_once: Callable[[str, str], None],
) -> PredictedResult | None:
    """Trace, predict and verify one batch size (inside the probe session). None when it cannot predict: then
    ``record`` holds the reason, said once per fit through ``warn_once``, and the caller probes as without
    predict. ``same_batch``: every step of a trial holds the same batch, so a verifying probe may stop at
    its first steady-state step."""
    reason = why_not_predict(trainer, stage, limit)
    if reason is not None or limit is None:
        record.fell_back(reason or "no limit", warn_once)
        return None
    first = max(1, min(plan.upper, plan.start))
    started = time.perf_counter()
    try:
        batch = sample_to_trace(trainer, prober, min(first, 2) if same_batch else first)
    except Untraceable as error:  # the loader's own failure shows in the probes that follow, as without predict
        record.seconds = time.perf_counter() - started
        record.fell_back(error.reason, warn_once)
        return None
    tracer = Tracer(
        trainer, pl_module, batch, seconds=time.perf_counter() - started, batch_arg_name=prober.batch_arg_name
    )

    def predict(trace: Callable[[int], float], cheap: Callable[[], bool] | None = None) -> Prediction:
        return predict_largest(
            trace,
            limit,
            upper=plan.upper,
            first=plan.upper,
            fixed=lambda: tracer.fixed,
            phases=lambda: tracer.phases,
            cheap=cheap,
        )

    try:
        replaying = Replaying(tracer, _memo_of(pl_module))
        prediction = predict(replaying, lambda: replaying.replays_next)
        if replaying.replayed_unchecked:  # its first value was a replay that the fit's check did not confirm
            tracer.phases.clear()
            prediction = predict(tracer)
    except Untraceable as error:
        record.seconds = tracer.seconds
        record.fell_back(error.reason, warn_once)
        return None
    record.path, record.seconds = "predicted", tracer.seconds
    with steady_probes(prober, same_batch):
        result = run_predicted_search(plan, prediction, prober.measure, limit, prober.checked_at)
    record.predicted = list(result.predicted)
    return result
