"""Split a batch into micro-batches along its batch dimension, and put step outputs back together.

Pure logic over the containers batches are made of, free of Lightning: tensors, tuples, lists,
named tuples, dicts and other mappings (Hugging Face ``BatchEncoding`` included), dataclasses,
and lists of per-sample Python values (strings, file names) or of one same-shape tensor per sample
(:func:`per_sample_tensors`: a collate that keeps images as a list) whose length is the batch's, and the
dataset's samples in a list as they are (:func:`samples_as_listed`: ``collate_fn=lambda b: b``) where a run's
:class:`Readings` say its first batch held them. Values
without a batch dimension (a scalar tensor, an int, ``None``, a string) are given unchanged to
every micro-batch. A batch type retune does not know is not guessed at: :func:`split_batch`
raises :class:`SplitError` naming the type, and ``ScheduledBatchSizeFinder(split_batch=fn)``
takes over (``fn(batch, pieces) -> list of micro-batches``).

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.zeros(5, 3), "labels": torch.arange(5), "task": "nli"}
    >>> [(len(m["labels"]), m["task"]) for m in split_batch(batch, 2)]
    [(3, 'nli'), (2, 'nli')]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

SplitFn = Callable[[Any, int], Sequence[Any]]
"""A user's own splitter: ``fn(batch, pieces)`` returns ``pieces`` micro-batches (or fewer, never empty)."""


class SplitError(TypeError):
    """A batch that cannot be split along its batch dimension by the built-in rules."""


class SampleList(list):  # type: ignore[type-arg]
    """A micro-batch cut from a list of samples (:func:`samples_as_listed`): a plain ``list`` to the user's step,
    whose length is its samples wherever retune reads it (weights, joins, sizes), without the run's
    :class:`Readings`."""


@dataclasses.dataclass
class Readings:
    """How each list of same-shape tensors in a run's batches reads, by its place in the batch (``batch[0]``,
    ``batch['images']``): one tensor per sample (True) or one batch per item (False).

    A batch tells where the list's length and its tensors' rows differ (eight images of 3 channels, three
    ``(ids, mask, type_ids)`` of 8 rows); a batch of as many samples as the list has tensors, each of that many
    rows (the last batch of 3 beside that triple, 2 stereo clips of 2 channels), reads both ways. A recovery keeps
    the readings its batches told (the first batch's at fit start) and reads such a batch as they did; without one,
    :func:`per_sample_tensors` guesses from the list's length.
    """

    per_sample: dict[str, bool] = dataclasses.field(default_factory=dict)
    """Each list's reading by its place in the batch: True, one tensor per sample; False, one batch per item."""
    listed: bool | None = None
    """Whether the batches are the dataset's samples in a list (``collate_fn=lambda b: b``), as the first batch and
    the size the loader was asked for told (:meth:`note_first`); None: not known, read as batches."""

    def note_first(self, batch: Any, asked: int | None) -> None:
        """Read the run's first batch, which the loader made at ``asked`` samples (None: not known): whether the
        batches are lists of samples (:func:`samples_as_listed`), and its lists of same-shape tensors.

        Args:
            batch: the run's first batch (a training step's, or an evaluation loop's).
            asked: the batch size the loader was asked for (its attribute); None: not known.
        """
        if self.listed is None:
            self.listed = samples_as_listed(batch, asked)
        if not self.listed:
            with contextlib.suppress(SplitError):  # a batch that cannot be split says so where it is split
                batch_length(batch, self)


def piece_sizes(total: int, pieces: int) -> list[int]:
    """Sizes of ``pieces`` near-equal parts of ``total`` samples, larger first (``torch.tensor_split``'s rule).

    Args:
        total: samples in the batch (>= 0).
        pieces: how many parts (>= 1).

    >>> piece_sizes(10, 4)
    [3, 3, 2, 2]
    """
    pieces = max(1, min(pieces, total))
    base, extra = divmod(total, pieces)
    return [base + 1 if i < extra else base for i in range(pieces)]


def pieces_for(total: int, max_size: int, min_size: int = 1) -> int:
    """How many near-equal pieces cut ``total`` samples into micro-batches of at most ``max_size``.

    ``min_size`` (2 for a model with BatchNorm layers in training mode, which cannot normalise one
    sample) wins over ``max_size`` where both cannot hold: 3 samples at ``max_size`` 2 are one piece
    of 3 rather than 2 + 1.

    Args:
        total: samples in the batch.
        max_size: the largest micro-batch that fits (what the failed step's split found).
        min_size: the smallest micro-batch the model can train on (2 with BatchNorm in training mode).

    >>> pieces_for(16, 8), pieces_for(3, 8), pieces_for(17, 8), pieces_for(3, 2), pieces_for(3, 2, min_size=2)
    (2, 1, 3, 2, 1)
    """
    pieces = max(1, -(-total // max(1, max_size)))
    if min_size > 1 and total // pieces < min_size:
        pieces = max(1, total // min_size)
    return pieces


def batch_length(batch: Any, readings: Readings | None = None) -> int | None:
    """The number of samples in ``batch``: the leading dimension its tensors share (None if it has none).

    Raises :class:`SplitError` when the batch dimension is ambiguous, since a split would then pair
    samples wrongly: tensors that disagree on their leading dimension, or a list of per-sample values
    (labels, strings) whose length is not that dimension (a ``tuple(zip(*samples))`` collate, whose
    tuple of images would otherwise be cut along the channels). The message names the fields
    (``batch['pos_weight']``) so the user knows which one to move out of the batch.

    Args:
        batch: a batch as the loader yields it: a tensor, or containers of tensors and per-sample values.
        readings: where given, what this batch tells of its lists of same-shape tensors is kept there, and a list
            it leaves open reads as kept (:class:`Readings`).
    """
    if isinstance(batch, SampleList) or (readings is not None and readings.listed and _one_layout(batch)):
        return len(batch)
    lengths: dict[int, str] = {}
    per_sample: dict[int, str] = {}
    stacks: dict[str, Sequence[torch.Tensor]] = {}
    _collect_lengths(batch, lengths, per_sample, stacks, "batch", top=True)
    # a list of same-shape tensors is read against the length the batch's other tensors agree on: one tensor per
    # sample where it holds that many ({"images": [img] * B, "ids": (B, T)}), batches where they have that many rows
    known = next(iter(lengths)) if len(lengths) == 1 else None
    for path, stack in stacks.items():
        if per_sample_tensors(stack, known, readings, path):
            per_sample.setdefault(len(stack), path)
        else:
            lengths.setdefault(int(stack[0].shape[0]), f"{path}[0]")
    if len(lengths) > 1:
        fields = ", ".join(f"{path} has {n}" for n, path in sorted(lengths.items(), key=lambda item: -item[0]))
        raise SplitError(
            f"the tensors of this {type(batch).__name__} batch disagree on their first dimension "
            f"({sorted(lengths)}: {fields}), so retune cannot tell the batch dimension; move the tensor that "
            "is not per sample out of the batch (onto the module), or pass split_batch=fn"
        )
    total = next(iter(lengths)) if lengths else None
    odd = {n: path for n, path in per_sample.items() if n != total}
    if total is not None and odd:
        fields = ", ".join(f"{path} has {n}" for n, path in sorted(odd.items()))
        raise SplitError(
            f"this {type(batch).__name__} batch holds tensors with {total} rows and lists of "
            f"{sorted(odd)} per-sample values ({fields}; a tuple(zip(*samples)) collate?), so retune "
            "cannot tell the batch dimension; stack the samples in your collate_fn or pass split_batch=fn"
        )
    return total


def samples_as_listed(batch: Any, asked: int | None) -> bool:
    """Whether ``batch``, made by a loader asked for ``asked`` samples, is those samples in a list, unstacked
    (``collate_fn=lambda b: b`` over ``(image, label)`` or ``{"input_ids": ..., "labels": ...}`` samples): its
    length is then the batch's, and a micro-batch is a slice of the list.

    The shape alone does not tell: a list of one batch per loader (``[{"x": ..., "n_tokens": 12}, {...}]``) is a
    list of containers of one layout too. So the list must hold ``asked`` items where the other reading, its
    tensors' rows, says another number (or cannot say: samples of different lengths), and, where its items are
    tuples as long as the list, hold fields of several kinds (a ``tuple(zip(*samples))`` of as many fields as
    samples is one tuple of images and one of labels). A run decides this once, on its first batch
    (:meth:`Readings.note_first`); a batch that could be either reads as batches, as before.

    Args:
        batch: a batch as the loader yields it.
        asked: the batch size the loader was asked for (None: not known, so not a list of samples).

    >>> import torch
    >>> samples = [(torch.ones(3, 8), 1) for _ in range(5)]
    >>> samples_as_listed(samples, 5), samples_as_listed(samples, 8), samples_as_listed(samples, None)
    (True, False, False)
    >>> loaders = [{"x": torch.ones(8, 4), "n_tokens": 12}, {"x": torch.ones(8, 4), "n_tokens": 9}]
    >>> samples_as_listed(loaders, 8), samples_as_listed([torch.ones(5, 8), torch.ones(5)], 2)
    (False, False)
    """
    if asked is None or not _one_layout(batch) or len(batch) != asked:
        return False
    first = batch[0]
    if isinstance(first, (list, tuple)) and len(first) == len(batch) and not _a_samples_fields(first):
        return False
    try:
        rows = batch_length(batch)
    except SplitError:
        return True  # its tensors disagree on their rows: samples of different lengths
    return rows != asked


def _one_layout(batch: Any) -> bool:
    """A list of containers of one layout: a list of samples or of batches."""
    if not isinstance(batch, list) or not batch:
        return False  # a tuple is a batch's fields (``collate_fn=lambda b: b`` makes a list)
    layout = _layout(batch[0])
    return layout is not None and all(_layout(item) == layout for item in batch[1:])


def _layout(item: Any) -> tuple[Any, ...] | None:
    """A container's type and shape of fields (keys, length, dataclass), None for anything else."""
    if isinstance(item, Mapping):
        return (type(item), tuple(item.keys()))
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return (type(item),)
    if isinstance(item, (list, tuple)):
        return (type(item), len(item))
    return None


def _a_samples_fields(item: Sequence[Any]) -> bool:
    """Whether a tuple or list reads as one sample's fields, ``(image, 3)``: fields of several kinds, holding a number,
    a string or a tensor without a dimension (in a nested mapping too). ``tuple(zip(*samples))`` makes one tuple per
    field instead, all images or all labels."""
    kinds = {_kind(value) for value in item}
    return len(kinds) > 1 and _holds_a_value(item)


def _holds_a_value(fields: Any) -> bool:
    """A number, a string or a dimensionless tensor among ``fields`` or a mapping's values, nested mappings too."""
    values = fields.values() if isinstance(fields, Mapping) else fields
    return any(_kind(value) == "value" or (isinstance(value, Mapping) and _holds_a_value(value)) for value in values)


def _kind(value: Any) -> str:
    if isinstance(value, (str, bytes, int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
        return "value"
    return "tensor" if isinstance(value, torch.Tensor) else type(value).__name__


def _collect_lengths(
    value: Any,
    lengths: dict[int, str],
    per_sample: dict[int, str],
    stacks: dict[str, Sequence[torch.Tensor]],
    path: str,
    top: bool = False,
) -> None:
    """The leading lengths of ``value``'s tensors into ``lengths`` and of its per-sample lists into ``per_sample``
    (each with the first path that has it); below the top, a list of same-shape tensors into ``stacks``, to be read
    once the other tensors' length is known (:func:`per_sample_tensors`)."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 0:
            lengths.setdefault(int(value.shape[0]), path)
        return
    if isinstance(value, (str, bytes)) or value is None or isinstance(value, (int, float, bool)):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            _collect_lengths(item, lengths, per_sample, stacks, f"{path}[{key!r}]")
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _collect_lengths(getattr(value, f.name), lengths, per_sample, stacks, f"{path}.{f.name}")
        return
    if isinstance(value, (list, tuple)):
        if not top and _same_shape_tensors(value):
            stacks.setdefault(path, value)
        elif _is_container_of_batches(value):
            fields = getattr(value, "_fields", None)
            for i, item in enumerate(value):
                at = f"{path}.{fields[i]}" if fields else f"{path}[{i}]"
                _collect_lengths(item, lengths, per_sample, stacks, at)
        elif value:
            per_sample.setdefault(len(value), path)
        return
    if top:
        raise SplitError(_unknown_type_message(value))


def _is_container_of_batches(value: Sequence[Any]) -> bool:
    """A tuple/list holding batched tensors or nested containers (``(x, y)``), not a list of per-sample values."""
    return any(
        (isinstance(item, torch.Tensor) and item.dim() > 0)
        or isinstance(item, (Mapping, list, tuple))
        or dataclasses.is_dataclass(item)
        for item in value
    )


def _holds_batches(value: Sequence[Any], size: int | None) -> bool:
    """Whether every tensor with a dimension in ``value`` (a tuple/list, nested containers included) has ``size``
    rows, as the parts of a micro-batch's output like ``(logits, x)`` do; None: unknown, so yes."""
    if size is None:
        return True

    def leaves(item: Any) -> Iterator[torch.Tensor]:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, Mapping):
            for v in item.values():
                yield from leaves(v)
        elif isinstance(item, (list, tuple)):
            for v in item:
                yield from leaves(v)

    shaped = [t for t in leaves(list(value)) if t.dim() > 0]
    return bool(shaped) and all(t.shape[0] == size for t in shaped)


def _same_shape_tensors(value: Sequence[Any]) -> bool:
    """A list or tuple (not a named tuple: ``Pair(x, y)`` holds batches) of tensors of one shape, at least one
    dimension, and nothing else: one tensor per sample or one batch per item, which :func:`per_sample_tensors`
    tells apart."""
    return (
        bool(value)
        and not hasattr(value, "_fields")
        and all(isinstance(item, torch.Tensor) and item.dim() > 0 for item in value)
        and len({tuple(item.shape) for item in value}) == 1
    )


def per_sample_tensors(
    value: Any, total: int | None, readings: Readings | None = None, path: str | None = None
) -> bool:
    """Whether ``value``, a list or tuple of same-shape tensors inside a batch of ``total`` samples (None: not known),
    holds one tensor per sample (a collate that keeps images as a list: ``{"images": [img] * B, "ids": (B, T)}``)
    rather than one batch per item (two augmented views ``[v1, v2]``, each ``(B, C, H, W)``).

    Per sample where it holds ``total`` tensors whose rows are not ``total``; batches where their rows are ``total``
    and it holds another number of them. Where both readings fit (``total`` tensors of ``total`` rows: two views of
    two samples) or neither (``total`` unknown, a ``tuple(zip(*samples))`` collate without a stacked tensor), more
    than two tensors are per sample and one or two are batches (``(x, y)``), so a batch of two samples traced or
    split is read as it always was. The top level of a batch is never per sample (``[x, y]`` is a batch): callers
    ask this below it. :func:`batch_length` and :func:`split_batch`
    read a batch alike through it (and the fake batch of a trace, ``retune.prediction.fake_batch``).

    Args:
        value: a list or tuple found below a batch's top level (anything else is not per sample).
        total: the batch's samples, as its other tensors agree on them (None: not known).
        readings: the run's :class:`Readings`: a reading this batch tells is kept there under ``path``, and one it
            leaves open is read from there where an earlier batch told it.
        path: the list's place in the batch, as :func:`batch_length` names fields (``batch[0]``).

    >>> import torch
    >>> images, ids = [torch.ones(3, 8, 8)] * 2, torch.ones(2, 16)
    >>> per_sample_tensors(images, 2), per_sample_tensors([torch.ones(2, 5)] * 2, 2), per_sample_tensors([ids], 2)
    (True, False, False)
    """
    if not isinstance(value, (list, tuple)) or not _same_shape_tensors(value):
        return False
    rows = int(value[0].shape[0])
    told: bool | None = None
    if total is not None and len(value) == total and rows != total:
        told = True
    elif total is not None and rows == total and len(value) != total:
        told = False
    if told is not None:
        if readings is not None and path is not None:
            readings.per_sample[path] = told
        return told
    if readings is not None and path is not None and path in readings.per_sample:
        return readings.per_sample[path]
    return len(value) > 2


def _unknown_type_message(value: Any) -> str:
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    return (
        f"retune cannot split a batch of type {name} into micro-batches: it knows tensors, tuples, lists, "
        "dicts and other mappings, dataclasses and named tuples. Pass "
        "ScheduledBatchSizeFinder(..., split_batch=fn) with fn(batch, pieces) -> list of micro-batches"
    )


def split_batch(
    batch: Any, pieces: int, split_fn: SplitFn | None = None, readings: Readings | None = None
) -> list[Any]:
    """``batch`` as up to ``pieces`` micro-batches that together hold every sample exactly once, in order.

    Fewer pieces come back when the batch has fewer samples than ``pieces``. ``split_fn`` replaces
    the built-in rules; its result is checked (a list of at least one micro-batch).

    Args:
        batch: the batch to split (any container :func:`batch_length` understands).
        pieces: how many micro-batches to aim for (>= 1).
        split_fn: ``fn(batch, pieces) -> list of micro-batches``, for a batch type the built-in rules do not know;
            None: the built-in rules.
        readings: the run's :class:`Readings` of lists of same-shape tensors (None: each batch read on its own).
    """
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}")
    if split_fn is not None:
        parts = list(split_fn(batch, pieces))
        if not parts:
            raise SplitError(f"split_batch returned no micro-batches for {pieces} pieces")
        return parts
    total = batch_length(batch, readings)
    if total is None:
        raise SplitError(
            f"this {type(batch).__name__} batch holds no tensor with a batch dimension (per-sample tensors in a "
            "list, as a tuple(zip(*samples)) collate makes, are not stacked), so retune cannot split it; stack the "
            "samples in your collate_fn or pass ScheduledBatchSizeFinder(..., split_batch=fn)"
        )
    sizes = piece_sizes(total, pieces)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [
        _slice(batch, start, start + size, total, "batch", readings, top=True)
        for start, size in zip(starts, sizes, strict=True)
    ]


def _slice(
    value: Any, start: int, stop: int, total: int, path: str, readings: Readings | None, top: bool = False
) -> Any:
    if top and readings is not None and readings.listed and _one_layout(value):
        return SampleList(value[start:stop])  # the samples as they are: each piece holds its own
    if isinstance(value, torch.Tensor):
        return value[start:stop] if value.dim() > 0 and value.shape[0] == total else value
    if isinstance(value, (str, bytes)) or value is None or isinstance(value, (int, float, bool)):
        return value
    if isinstance(value, Mapping):
        items = {key: _slice(item, start, stop, total, f"{path}[{key!r}]", readings) for key, item in value.items()}
        return _rebuild_mapping(value, items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # init fields only: replace() refuses a field with init=False (its __post_init__ makes it again)
        changes = {
            f.name: _slice(getattr(value, f.name), start, stop, total, f"{path}.{f.name}", readings)
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, (list, tuple)):
        fields = getattr(value, "_fields", None)
        if not top and per_sample_tensors(value, total, readings, path):
            parts = list(value[start:stop])  # one tensor per sample: each piece holds its samples' tensors
        elif _is_container_of_batches(value):
            parts = [
                _slice(item, start, stop, total, f"{path}.{fields[i]}" if fields else f"{path}[{i}]", readings)
                for i, item in enumerate(value)
            ]
        elif len(value) == total:
            parts = list(value[start:stop])  # per-sample values: file names, raw strings
        else:
            return value
        if isinstance(value, tuple) and fields is not None:
            return type(value)(*parts)  # a named tuple
        return type(value)(parts)
    raise SplitError(_unknown_type_message(value))


def _rebuild_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """The same mapping type with new values (``BatchEncoding(data)``, ``OrderedDict(items)``, plain dict)."""
    if type(original) is dict:
        return items
    try:
        return type(original)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def join_outputs(outputs: Sequence[Any], sizes: Sequence[int | None] | None = None) -> Any:
    """The outputs of a step's micro-batches as one output, as if the step had run on the whole batch.

    ``sizes`` are the micro-batches' sample counts. A tensor whose first dimension is its own
    micro-batch's size in every output is concatenated (when the trailing shapes differ, as for
    predictions padded per micro-batch, the pieces come back as a list instead); so is a per-sample
    list. Containers are joined leaf by leaf. Anything else — a scalar, a per-batch statistic such as
    a mean — has no whole-batch form to rebuild and is taken from the last micro-batch. Without
    ``sizes``, any tensor with a first dimension counts as batched.

    Args:
        outputs: what each micro-batch's step returned, in order.
        sizes: each micro-batch's sample count (None where unknown), in the same order.
    """
    if not outputs:
        return None
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]

    def batched(o: Any, i: int) -> bool:
        n = None if sizes is None else sizes[i]
        return o.dim() > 0 and (n is None or o.shape[0] == n)

    if isinstance(first, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) and batched(o, i) for i, o in enumerate(outputs)):
            return outputs[-1]
        if all(o.shape[1:] == first.shape[1:] for o in outputs):
            return torch.cat(list(outputs), dim=0)
        return list(outputs)  # batched, but of different shapes: each micro-batch's, in order
    if isinstance(first, Mapping) and all(isinstance(o, Mapping) and o.keys() == first.keys() for o in outputs):
        return _rebuild_mapping(first, {key: join_outputs([o[key] for o in outputs], sizes) for key in first})
    if isinstance(first, (list, tuple)) and all(type(o) is type(first) for o in outputs):
        same_length = all(len(o) == len(first) for o in outputs)
        per_sample = sizes is not None and all(len(o) == n for o, n in zip(outputs, sizes, strict=True))
        # `(logits, x)` holds batches: its tensors' first dimension is the micro-batch's size. A list of one tensor
        # per sample (`list(logits.unbind(0))`, generated sequences of their own lengths) is as long as the
        # micro-batch instead, and is concatenated: joined position by position it kept the last micro-batch's
        holds = (
            _is_container_of_batches(first)
            and same_length
            and (
                sizes is None
                or not per_sample
                or all(_holds_batches(o, n) for o, n in zip(outputs, sizes, strict=True))
            )
        )
        if holds:
            parts = [join_outputs([o[i] for o in outputs], sizes) for i in range(len(first))]
        elif sizes is None or per_sample:
            parts = [item for o in outputs for item in o]  # per-sample lists: concatenate
        else:
            return outputs[-1]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*parts)
        return type(first)(parts)
    return outputs[-1]


def detached(value: Any) -> Any:
    """``value`` with every tensor in it detached, containers (dicts, ``ModelOutput``, named tuples) kept.

    Args:
        value: a step's output: a tensor, or containers holding tensors.
    """
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, Mapping):
        return _rebuild_mapping(value, {k: detached(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        parts = [detached(v) for v in value]
        return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)
    return value


def join_detached(outputs: Sequence[Any], sizes: Sequence[int | None] | None = None) -> Any:
    """:func:`join_outputs` of the outputs detached: what a recovered step returns besides its loss
    (the micro-batches' graphs are spent once their backward ran).

    Args:
        outputs: what each micro-batch's step returned, in order.
        sizes: each micro-batch's sample count, as for :func:`join_outputs`.
    """
    return join_outputs([detached(o) for o in outputs], sizes)


__all__ = [
    "Readings",
    "SampleList",
    "SplitError",
    "SplitFn",
    "batch_length",
    "detached",
    "join_detached",
    "join_outputs",
    "per_sample_tensors",
    "piece_sizes",
    "pieces_for",
    "samples_as_listed",
    "split_batch",
]
