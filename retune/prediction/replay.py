"""A traced step read again at another batch, without tracing: every storage scaled by the dimensions it has.

A trace (:func:`retune.prediction.trace.trace_step` with ``record=True``) keeps the order in which the step
made and freed its storages, the shape of the tensor that made each, and where its phases began
(:class:`~retune.prediction.trace.Recording`). Run again on a batch of another size, or another bucket's
longer samples, the same step makes the same storages in the same order; only the dimensions that come from
the batch change. So the step at the new batch is that recording with each storage's bytes scaled by its
dimensions' change, and its phases replayed at the same points (the trace's own accounting,
:func:`retune.prediction.trace.assemble`): the whole step's account at another batch in the time of a loop
over its storages (about a millisecond for a small transformer, where a trace takes a quarter of a second).

Which dimensions come from the batch is read from their sizes, so the traced batch is chosen to tell them
apart (:func:`tag_size`):

- **the batch dimension** is traced at a prime that divides no dimension of the module's parameters and
  buffers nor any other dimension of the batch, so a dimension it divides holds the batch once per factor:
  ``13 x 61`` tokens flattened, ``13 x 2`` heads (attention's ``batch x heads``);
- **the samples' other dimensions** (a bucket's padded length) change from the traced batch to the
  target's, tensor by tensor: each traced size maps to the target's; a dimension one or two away from such a
  size follows it (a shifted language-model target: ``length - 1``). A dimension derived otherwise (a pooled
  or strided length, ``length // 2``; a concatenation, ``2 x length``) keeps its traced size: such a step
  replays wrong, which the caller's check finds where it moves the prediction.

Every other dimension is the model's own and stays. A size the model's activations have and its parameters
do not (a concatenation's ``2 x hidden``) cannot be told, in one recording, from a sample size one or two away
from it; a recording at another length shows it as what it is, one that neither the batch nor the samples
explain (:func:`activation_sizes`: every such size, so a length-derived one and clipping's count of
gradients too; not one the recording's tag divides). The caller keeps those of its recordings (the fit's
:class:`~retune.prediction.reuse.TraceMemo`) and passes them to every later replay and tag size (``seen``):
they count as the model's own. Where that reading is not sure — a traced sample size
that is a size the model's own dimensions may take (a parameter's dimension or a divisor of one: 64 tokens
where a hidden size of 128 is split into two heads of 64 would read the heads as tokens), two target sizes
for one traced size, a prime that divides the samples' sizes — the replay refuses
(:class:`~retune.prediction.trace.CannotPredict`), or :func:`tag_size` finds no size to record at, and the
caller traces. A size one or two away from a traced sample size that is also such a size (the model's, or an
unchanged sample size) is read both ways (:meth:`Scaling.ambiguous`): where the two readings put every byte
count a prediction reads within :data:`AMBIGUITY_TOLERANCE` (a storage of a few bytes: the norms
``clip_grad_norm_`` stacks) the replay stands, else it refuses. A step whose storages do not scale with its
dimensions this way (padding to a multiple, a data structure sized other than by the batch) replays wrong;
the caller checks replays against traces before it trusts them (:mod:`retune.buckets.batching`), and every
size is verified by a real probe either way.

Example (a linear layer's step, traced at 13 samples and read at 100):
    >>> import torch
    >>> from retune.prediction.trace import trace_step
    >>> net = torch.nn.Linear(64, 32)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> def step(batch, optimizers):
    ...     net(batch).sum().backward()
    ...     optimizers[0].step()
    >>> traced = trace_step(net, [opt], torch.ones(4, 64), 13, step, steps=1, record=True)
    >>> direct = trace_step(net, [opt], torch.ones(4, 64), 100, step, steps=1)
    >>> replayed = replay(traced, target_shapes(torch.ones(4, 64), 100), 100)
    >>> replayed.peak_bytes == direct.peak_bytes, replayed.size
    (True, 100)
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from retune.memory import CpuPeakTracker, batch_tensors
from retune.prediction.trace import CannotPredict, Recording, StepFacts, StepTrace, TracedPhases, assemble
from retune.recovery.split import SplitError, batch_length, per_sample_tensors

__all__ = [
    "AMBIGUITY_TOLERANCE",
    "Scaling",
    "activation_sizes",
    "model_sizes",
    "replay",
    "scaling",
    "tag_size",
    "target_shapes",
]

_PRIMES = (13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97)
_OFFSETS = (1, -1, 2, -2)
_MARKS = frozenset({"forward_done", "update_skipped", "update_started", "update_done"})
"""The phase calls a recording may hold (:class:`~retune.prediction.trace.TracedPhases`)."""


def tag_size(batch: Any, fixed: Iterable[int], lengths_change: bool = True, seen: Iterable[int] = ()) -> int | None:
    """The batch size to trace at so that a replay can tell the batch dimension apart: the first of a few primes
    that divides none of ``fixed`` (the module's parameters' and buffers' dimensions) nor any of ``batch``'s
    per-sample dimensions, nor a size one or two away from one (a shifted target's ``length - 1``). None where
    every one does, or, where the samples' sizes will change in the replays (``lengths_change``: other buckets),
    where a per-sample size is not a parameter's dimension but divides one (:func:`model_sizes`: 64 tokens with
    a hidden size of 128 split into two heads of 64): the model's own activations may have that size too, and a
    replay would read them as the batch's.

    >>> import torch
    >>> tag_size(torch.ones(2, 26), {64, 128}), tag_size(torch.ones(2, 13 * 17), {64})
    (17, 19)
    >>> tag_size(torch.ones(2, 53), {64})  # 52 = 4 x 13 and 51 = 3 x 17: a shifted target would read as batches
    19
    >>> tag_size(torch.ones(2, 64), {128}) is None, tag_size(torch.ones(2, 64), {128}, lengths_change=False)
    (True, 17)

    ``seen``: the model's activations' sizes that earlier recordings showed (:func:`activation_sizes`), taken as
    its own. None too for a batch holding a list of one tensor per sample (images kept as a list): a replay scales
    dimensions, and that list's count of tensors is what grows with the batch.
    """
    fixed, seen = set(fixed), set(seen)
    if _per_sample_list(batch, batch_length(batch), "batch", top=True) is not None:
        return None  # one tensor per sample: their count grows with the batch, which a replay cannot scale
    sample = {d for shape in _sample_dims(batch) for d in shape}
    own = model_sizes(fixed) | seen
    if lengths_change and any(d in own and d not in fixed for d in sample):
        return None  # a sample size the model's own activations may have too: a replay could not tell them apart
    sizes = fixed | seen | {d + k for d in sample for k in (0, *_OFFSETS)}
    for prime in _PRIMES:
        if not any(d % prime == 0 for d in sizes if d > 0):
            return prime
    return None


def model_sizes(fixed: Iterable[int]) -> frozenset[int]:
    """Every size the model's own dimensions may take: each of ``fixed`` (its parameters' and buffers'
    dimensions) and each of their divisors (a hidden size split into heads, a width halved).

    >>> sorted(model_sizes({12, 7}))
    [1, 2, 3, 4, 6, 7, 12]
    """
    sizes: set[int] = set()
    for d in fixed:
        if d > 0:
            for x in range(1, math.isqrt(d) + 1):
                if d % x == 0:
                    sizes.update((x, d // x))
    return frozenset(sizes)


def activation_sizes(trace: StepTrace) -> frozenset[int]:
    """The sizes of the dimensions of ``trace``'s recorded storages that nothing else explains: not a multiple of
    the traced batch size, not a traced sample size nor one or two away from one, not a size the parameters'
    and buffers' dimensions take (:func:`model_sizes`); empty without a recording. They are the model's own
    activations' sizes (a concatenation's ``2 x hidden``), which a later recording at a sample size one or two
    away from one of them would read as that sample size's: :func:`replay` and :func:`tag_size` take them as the
    model's (``seen``).

    >>> import torch
    >>> from retune.prediction.trace import trace_step
    >>> net = torch.nn.Linear(32, 12)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> def step(batch, optimizers):  # a width of 2 x 12 that no parameter has
    ...     torch.cat([net(batch), net(batch)], -1).sum().backward()
    ...     optimizers[0].step()
    >>> sorted(activation_sizes(trace_step(net, [opt], torch.ones(4, 32), 13, step, steps=1, record=True)))
    [24]
    """
    recording = trace.recording
    if recording is None:
        return frozenset()
    explained = set(model_sizes(recording.fixed_dims))
    for shape, _ in recording.batch_shapes:
        if shape and shape[0] == trace.size:
            explained.update(d + k for d in shape[1:] for k in (0, *_OFFSETS))
    return frozenset(
        d
        for event in recording.events
        if event[0] == "+"
        for d in event[3]
        if d > 1 and d % trace.size != 0 and d not in explained
    )


def target_shapes(batch: Any, size: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of ``batch``'s tensors in a batch of ``size`` samples, as :func:`~retune.prediction.fake_batch.
    fake_batch` makes it (the leading dimension, where the batch's tensors share it, set to ``size``).

    >>> import torch
    >>> target_shapes({"ids": torch.ones(2, 7), "scale": torch.tensor(0.5)}, 5)
    ((5, 7), ())
    """
    total = _scalable_length(batch)
    return tuple(
        (size, *(int(d) for d in t.shape[1:]))
        if t.dim() > 0 and t.shape[0] == total
        else tuple(int(d) for d in t.shape)
        for t in batch_tensors(batch)
    )


@dataclass(frozen=True)
class Scaling:
    """How each traced dimension's size becomes the target's (see the module doc)."""

    traced_size: int
    size: int
    lengths: Mapping[int, int]
    """A traced per-sample size -> the target's."""
    fixed: frozenset[int]
    """The sizes the model's own dimensions may take (:func:`model_sizes`): never read as the batch's."""
    stay: frozenset[int] = frozenset()
    """Per-sample sizes the target keeps: never read as one or two away from a size that changes."""
    follow: frozenset[int] = frozenset()
    """Sizes read as one or two away from a size that changes even where they are in :attr:`fixed` or
    :attr:`stay`: the other reading of an ambiguous dimension (:meth:`ambiguous`)."""

    def dim(self, d: int) -> int:
        """The target's size of a traced dimension of size ``d``.

        >>> Scaling(13, 100, {61: 30}, frozenset({64})).dim(13 * 61), Scaling(13, 100, {61: 30}, frozenset()).dim(60)
        (3000, 29)
        """
        if d <= 0:
            return d
        if d % self.traced_size == 0:
            return self.size * self.dim(d // self.traced_size)
        target = self.lengths.get(d)
        if target is not None:
            return target
        if (d not in self.fixed and d not in self.stay) or d in self.follow:
            for offset in _OFFSETS:
                near = self.lengths.get(d - offset)
                if near is not None:
                    return max(0, near + offset)
        return d

    def bytes(self, nbytes: int, shape: Sequence[int]) -> int:
        """``nbytes`` of a storage made by a tensor of ``shape``, at the target."""
        ratio = 1.0
        for d in shape:
            if d > 0:
                ratio *= self.dim(d) / d
        return round(nbytes * ratio)

    def ambiguous(self, shapes: Iterable[Sequence[int]]) -> frozenset[int]:
        """The dimensions among ``shapes`` (a recording's) that cannot be read for sure: one or two away from a
        sample size that changes, and also a size the model's own dimensions or the samples' unchanged ones take
        (``length - 1`` of 41 tokens is 40, which divides a vocabulary of 1000). :func:`replay` reads them both ways.

        >>> sorted(Scaling(13, 100, {41: 30}, frozenset({40, 1000})).ambiguous([(13, 40), (1000, 7)]))
        [40]
        """
        unsure = set()
        for shape in shapes:
            for d in shape:
                if d in self.lengths or d <= 0 or (d not in self.fixed and d not in self.stay):
                    continue
                if any(d - offset in self.lengths for offset in _OFFSETS):
                    unsure.add(d)
        return frozenset(unsure)

    def ambiguity(self, shapes: Iterable[Sequence[int]]) -> str | None:
        """Why a dimension among ``shapes`` cannot be read for sure (:meth:`ambiguous`), or None."""
        for d in sorted(self.ambiguous(shapes)):
            offset = next(o for o in _OFFSETS if d - o in self.lengths)
            return (
                f"a dimension of {d} is {offset:+d} from the sample size {d - offset} and also a size the "
                "model's own dimensions (or the samples' unchanged ones) take: it cannot be told which"
            )
        return None


def scaling(
    traced: Sequence[tuple[tuple[int, ...], int]],
    target: Sequence[tuple[int, ...]],
    traced_size: int,
    size: int,
    fixed: frozenset[int],
    seen: frozenset[int] = frozenset(),
) -> Scaling | str:
    """The :class:`Scaling` from a traced batch (its tensors' shapes and bytes) to ``target``'s shapes, or why the
    sizes cannot be told apart (``fixed``: the module's parameters' and buffers' dimensions; ``seen``: its
    activations' sizes that other recordings showed, :func:`activation_sizes`, taken as they are, without their
    divisors)."""
    own = model_sizes(fixed) | seen
    if traced_size < 2:
        return f"a batch traced at {traced_size} sample cannot tell the batch dimension apart"
    if any(d % traced_size == 0 for d in fixed | seen if d > 0):
        return f"the batch was traced at {traced_size}, which divides a dimension of the module's own"
    if len(traced) != len(target):
        return "the batch to replay at holds other tensors than the traced one"
    lengths: dict[int, int] = {}
    stay: set[int] = set()
    for (shape, _), new in zip(traced, target, strict=True):
        if len(shape) != len(new):
            return f"a batch tensor of shape {list(new)} where the traced one was {list(shape)}"
        per_sample = zip(shape[1:], new[1:], strict=True) if shape and shape[0] == traced_size else ()
        for old, now in per_sample:
            if old % traced_size == 0:
                return f"a sample dimension of {old} is a multiple of the traced batch size {traced_size}"
            if lengths.get(old, now) != now:
                return f"a sample dimension of {old} becomes both {lengths[old]} and {now}"
            if old == now:
                stay.add(old)
            else:
                if old in own:
                    return (
                        f"a sample dimension of {old} is a size the model's own dimensions may take (one of its "
                        "parameters' dimensions or a divisor of one: a hidden size split into heads)"
                    )
                lengths[old] = now
    if stay & lengths.keys():
        both = sorted(stay & lengths.keys())[0]
        return f"a sample dimension of {both} changes in one batch tensor and not in another"
    return Scaling(traced_size, size, lengths, own, frozenset(stay))


def replay(
    trace: StepTrace, target: Sequence[tuple[int, ...]], size: int, seen: Iterable[int] = ()
) -> StepTrace | CannotPredict:
    """``trace``'s step at a batch of ``target``'s shapes (:func:`target_shapes`) and ``size`` samples, read from
    its :attr:`~retune.prediction.trace.StepTrace.recording` (see the module doc); never raises. ``seen``: the
    model's activations' sizes that other recordings showed (:func:`activation_sizes`), taken as its own: a
    dimension one or two from a traced sample size that is one of them is read both ways, and the replay refuses
    where the two readings differ by more than :data:`AMBIGUITY_TOLERANCE`."""
    started = time.perf_counter()
    recording = getattr(trace, "recording", None)
    if recording is None:
        return CannotPredict("the trace kept no recording to replay")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return CannotPredict(f"a batch needs at least one sample, got size={size!r}")
    try:
        sizes = frozenset(int(d) for d in seen if int(d) > 0)
        scale = scaling(recording.batch_shapes, target, trace.size, size, recording.fixed_dims, sizes)
        if isinstance(scale, str):
            return CannotPredict(scale)
        unknown = next((event for event in recording.events if not _known(event)), None)
        if unknown is not None:
            return CannotPredict(f"the recording holds an event this replay does not know: {unknown!r}"[:200])
        shapes = [event[3] for event in recording.events if event[0] == "+"]
        result = _accounted(trace, recording, scale, size)
        unsure = scale.ambiguous(shapes)
        if unsure:  # read both ways: where it decides nothing (a few bytes), either reading is the replay
            other = _accounted(trace, recording, dataclasses.replace(scale, follow=unsure), size)
            if not _same_prediction(result, other):
                return CannotPredict(scale.ambiguity(shapes) or "an ambiguous dimension")
    except Exception as error:  # a recording or a target this replay cannot read: trace instead
        return CannotPredict(f"the recording could not be replayed: {type(error).__name__}: {error}")
    return dataclasses.replace(result, seconds=time.perf_counter() - started)


AMBIGUITY_TOLERANCE = 0.001
"""How far apart the two readings of an ambiguous dimension (:meth:`Scaling.ambiguous`) may put every byte count a
prediction reads for the replay to stand: 0.1%, where such a dimension is a few bytes' storage (the norms
``clip_grad_norm_`` stacks, one per gradient)."""


def _known(event: tuple[Any, ...]) -> bool:
    """Whether a replay knows ``event``: a storage made or freed, or a phase mark it may call."""
    return event[0] in ("+", "-") or (event[0] == "@" and len(event) > 1 and event[1] in _MARKS)


def _accounted(trace: StepTrace, recording: Recording, scale: Scaling, size: int) -> StepTrace:
    """The recording's storages counted at ``scale``, its phases re-run where it marked them."""
    tracker = CpuPeakTracker()  # never entered: counted event by event
    phases = TracedPhases(tracker, recording.reuse)
    for event in recording.events:
        kind = event[0]
        if kind == "+":
            tracker.count(event[1], scale.bytes(event[2], event[3]))
        elif kind == "-":
            tracker.release(event[1])
        else:
            getattr(phases, event[1])()
    batch_bytes = sum(scale.bytes(nbytes, shape) for shape, nbytes in recording.batch_shapes)
    facts = StepFacts(
        size,
        trace.steps,
        trace.resident_bytes,
        trace.created_bytes,
        batch_bytes,
        trace.grads_before,
        trace.grads_after,
        trace.accumulating,
    )
    return assemble(phases, tracker, facts, recording.reuse, 0.0)


def _same_prediction(one: StepTrace, other: StepTrace) -> bool:
    """Whether every byte count a prediction reads is within :data:`AMBIGUITY_TOLERANCE` between the two."""
    fields = ("peak_bytes", "steady_bytes", "batch_bytes", "compute_bytes", "update_bytes", "update_start_bytes")
    pairs = [(getattr(one, f), getattr(other, f)) for f in fields]
    pairs += list(zip(one.steady_parts or (), other.steady_parts or (), strict=False))
    return (one.steady_parts is None) == (other.steady_parts is None) and all(
        abs(a - b) <= AMBIGUITY_TOLERANCE * max(abs(a), abs(b), 1) for a, b in pairs
    )


def _sample_dims(batch: Any) -> list[tuple[int, ...]]:
    """Each per-sample tensor's dimensions after the batch dimension (see :func:`target_shapes`)."""
    total = _scalable_length(batch)
    return [tuple(int(d) for d in t.shape[1:]) for t in batch_tensors(batch) if t.dim() > 0 and t.shape[0] == total]


def _scalable_length(batch: Any) -> int | None:
    """``batch``'s length (:func:`~retune.recovery.split.batch_length`), where a replay can scale it: a list of one
    tensor per sample (:func:`~retune.recovery.split.per_sample_tensors`) raises :class:`SplitError`, as its
    tensors' count, not a dimension, grows with the batch (a replay kept the traced size's images at every size;
    :func:`tag_size` then records nothing and the search traces)."""
    total = batch_length(batch)
    path = _per_sample_list(batch, total, "batch", top=True)
    if path is not None:
        raise SplitError(f"{path} holds one tensor per sample: a replay scales dimensions, not a count of tensors")
    return total


def _per_sample_list(value: Any, total: int | None, path: str, top: bool = False) -> str | None:
    """The path of the first list of per-sample tensors in ``value`` (None: it holds none)."""
    items: list[tuple[str, Any]] = []
    if isinstance(value, Mapping):
        items = [(f"{path}[{key!r}]", item) for key, item in value.items()]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f"{path}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, (list, tuple)):
        if not top and per_sample_tensors(value, total):
            return path
        items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    for at, item in items:
        found = _per_sample_list(item, total, at)
        if found is not None:
            return found
    return None
