"""How big a sample is, which samples are the largest, and how much sizes vary (no Lightning here).

``search.probe_samples: largest`` probes every trial on the largest samples of the stage's dataset,
because with pad-to-longest collation (text, speech), variable image sizes or variable box counts
a step's memory follows its largest sample, and the first batches of an epoch rarely hold it. This
module holds the pure part of that:

* :func:`default_sample_size`: a sample's size, the number of elements it holds;
* :func:`resolve_size_fn`: a ``sample_size`` override given as a dotted path in a schedule;
* :func:`scan_sizes` and :class:`SizeCache`: the sizes of a dataset's samples, largest first,
  computed once per dataset (a search runs again at every trigger) and again when its
  :class:`Fingerprint` changes, optionally on a seeded random subset (``search.scan_limit``);
* :func:`size_spread`: a cheap look at a few dozen random samples, to warn when ``first`` is risky;
* :func:`preserved_rng`: every scan reads ``dataset[i]``, which may draw random numbers
  (augmentations); the run's RNG streams are put back afterwards so its data order and
  augmentations do not shift.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np
import torch

from retune.errors import RetuneError
from retune.random_state import preserved_rng
from retune.schedule.dotted import resolve_dotted

SizeFn = Callable[[Any], int]
"""``fn(sample) -> int``: a sample's size (``dataset[i]`` as the dataset returns it, before collate)."""

SCAN_SEED = 0
"""Seed of the random subset a ``scan_limit`` scans and of the spread look (fixed: every rank and
every search picks the same samples, so DDP ranks probe the same batches)."""

SPREAD_SAMPLES = 48
"""How many random samples the spread look under ``probe_samples: first`` reads."""

SPREAD_RATIO = 2.0
"""The spread look warns when the largest of its samples is more than this many times the median."""

FINGERPRINT_SAMPLES = 16
"""Evenly strided samples whose sizes (with the largest ones') identify a dataset's sizes (:class:`Fingerprint`)."""

_MAX_DEPTH = 32


def default_sample_size(sample: Any) -> int:
    """The number of elements a sample holds: what pad-to-longest batching and most memory grow with.

    Tensors and arrays count their elements (``numel``); Python and NumPy numbers count 1 (a label, a
    token id in a list); strings and bytes count their length (a proxy for tokens when a tokenizer
    runs in ``collate_fn``); PIL-style images count width x height x bands. Containers add up their
    contents: tuples, lists, mappings (dicts, Hugging Face ``BatchEncoding``: values only),
    dataclasses and attrs classes. ``None`` and anything else count 0: pass ``sample_size`` when
    the memory follows something this walk cannot see.

    >>> default_sample_size({"input_ids": torch.zeros(12, dtype=torch.long), "label": 3})
    13
    >>> default_sample_size((torch.zeros(3, 4), "hello"))
    17
    """
    return _size(sample, 0, set())


def _size(obj: Any, depth: int, seen: set[int]) -> int:
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return int(obj.numel())
    if isinstance(obj, np.ndarray):
        return int(obj.size)
    if isinstance(obj, (bool, int, float, complex, np.generic)):
        return 1
    if isinstance(obj, (str, bytes, bytearray)):
        return len(obj)
    if depth >= _MAX_DEPTH or id(obj) in seen:
        return 0  # a cycle, or nesting no real sample has
    seen.add(id(obj))
    try:
        if isinstance(obj, Mapping):
            return sum(_size(value, depth + 1, seen) for value in obj.values())
        if isinstance(obj, (tuple, list)):
            return sum(_size(item, depth + 1, seen) for item in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return sum(_size(getattr(obj, f.name), depth + 1, seen) for f in dataclasses.fields(obj))
        attrs = getattr(type(obj), "__attrs_attrs__", None)
        if attrs is not None:
            return sum(_size(getattr(obj, a.name), depth + 1, seen) for a in attrs)
        image_size = getattr(obj, "size", None)
        if callable(getattr(obj, "getbands", None)) and _is_int_pair(image_size):
            width, height = image_size
            return int(width) * int(height) * len(obj.getbands())
        shape = getattr(obj, "shape", None)  # array-likes of other libraries (JAX, CuPy, xarray)
        if isinstance(shape, tuple) and all(isinstance(d, int) for d in shape):
            return math.prod(shape)
        return 0
    finally:
        seen.discard(id(obj))


def _is_int_pair(value: Any) -> TypeGuard[tuple[int, int]]:
    return isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value)


def resolve_size_fn(path: str) -> SizeFn:
    """The callable a dotted path (``mypkg.sizes.tokens`` or ``mypkg.sizes:tokens``) names.

    Raises ValueError with a message that says what failed: the module, the attribute, or the value
    that is not callable. The caller adds the field and the schedule's source.
    """
    fn: SizeFn = resolve_dotted(path, "fn(sample) -> int")
    return fn


def checked_size(size_fn: SizeFn, sample: Any, index: int) -> int:
    """``size_fn(sample)`` as an int >= 0, or a RetuneError that names the function, sample and value."""
    value = size_fn(sample)
    try:
        if isinstance(value, bool):
            raise TypeError
        size = operator.index(value)
    except TypeError:
        raise RetuneError(
            f"sample_size {_name(size_fn)} returned {value!r} ({type(value).__name__}) for sample {index}; "
            "it must return an int"
        ) from None
    if size < 0:
        raise RetuneError(f"sample_size {_name(size_fn)} returned {size} for sample {index}; sizes must be >= 0")
    return size


def _name(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}.{qualname}" if module else str(qualname)


def _subset(count: int, limit: int | None, seed: int) -> list[int]:
    """Positions ``0..count-1`` to read: all of them, or a seeded random ``limit`` of them, ascending."""
    if limit is None or count <= limit:
        return list(range(count))
    return sorted(random.Random(seed).sample(range(count), limit))


@dataclass(frozen=True)
class SizeScan:
    """The sizes of a dataset's samples, largest first (ties: lower index first)."""

    candidates: Sequence[int]
    """The dataset indices the stage draws from (all of them, or a sampler's subset)."""
    order: list[int]
    """Scanned dataset indices, largest sample first."""
    sizes: list[int]
    """Their sizes, in the same order."""
    seconds: float
    """What the scan took (reading every scanned sample once)."""

    @property
    def scanned(self) -> int:
        return len(self.order)

    @property
    def sizeless(self) -> bool:
        """True when every scanned sample measured 0: the size function sees nothing in these samples."""
        return not self.sizes or self.sizes[0] == 0

    def largest(self, count: int) -> list[int]:
        """The ``count`` largest samples' indices; past the scanned ones (a ``scan_limit`` smaller than
        the batch), the unscanned candidates in dataset order."""
        picked = self.order[:count]
        if len(picked) < count:
            scanned = set(self.order)
            for index in self.candidates:
                if len(picked) >= count:
                    break
                if index not in scanned:
                    picked.append(index)
        return picked


def scan_sizes(
    dataset: Any,
    candidates: Sequence[int],
    size_fn: SizeFn,
    limit: int | None = None,
    seed: int = SCAN_SEED,
) -> SizeScan:
    """Read ``dataset[i]`` for the candidates (or a seeded random ``limit`` of them) and size each one.

    Reads happen under :func:`preserved_rng`. The sort is stable (ties keep the lower index first), so
    every rank and every search that scans the same data picks the same samples.
    """
    started = time.perf_counter()
    indices = [int(candidates[p]) for p in _subset(len(candidates), limit, seed)]
    with preserved_rng():
        sizes = [checked_size(size_fn, dataset[i], i) for i in indices]
    if indices:
        by_size = torch.sort(torch.tensor(sizes, dtype=torch.int64), descending=True, stable=True)
        order = [indices[p] for p in by_size.indices.tolist()]
        sorted_sizes = by_size.values.tolist()
    else:
        order, sorted_sizes = [], []
    return SizeScan(candidates, order, sorted_sizes, time.perf_counter() - started)


@dataclass(frozen=True)
class Spread:
    """Sizes of a few random samples: is the first batch a fair picture of the epoch's memory?"""

    largest: int
    median: float
    count: int

    @property
    def ratio(self) -> float:
        if self.median > 0:
            return self.largest / self.median
        return math.inf if self.largest > 0 else 1.0

    @property
    def wide(self) -> bool:
        return self.ratio > SPREAD_RATIO


def size_spread(
    dataset: Any, candidates: Sequence[int], size_fn: SizeFn, count: int = SPREAD_SAMPLES, seed: int = SCAN_SEED
) -> Spread:
    """Sizes of ``count`` seeded random samples (under :func:`preserved_rng`): largest and median."""
    positions = _subset(len(candidates), count, seed + 1)
    with preserved_rng():
        sizes = [checked_size(size_fn, dataset[int(candidates[p])], int(candidates[p])) for p in positions]
    if not sizes:
        return Spread(0, 0.0, 0)
    return Spread(max(sizes), float(statistics.median(sizes)), len(sizes))


@dataclass(frozen=True)
class Fingerprint:
    """What identifies a dataset's sizes cheaply: its length and the sizes of a few fixed samples.

    The samples are :data:`FINGERPRINT_SAMPLES` at evenly strided positions over the candidates (the
    first and the last included) plus the :data:`FINGERPRINT_LARGEST` largest samples of the scan it
    belongs to: a change to the data's overall sizes (a new tokenizer, a longer crop, every text cut
    at another ``max_len``) moves the strided ones, and a length curriculum that raises ``max_len``
    grows exactly the samples that were cut, which are the largest. A change confined to samples it
    does not read (one short text replaced by a long one) goes unseen until a full scan.
    """

    length: int
    indices: tuple[int, ...]
    sizes: tuple[int, ...]


FINGERPRINT_LARGEST = 16
"""The largest samples of a scan that its fingerprint re-reads (a curriculum grows the ones it cut)."""


def fingerprint_indices(candidates: Sequence[int], largest: Sequence[int] = ()) -> tuple[int, ...]:
    """The dataset indices a fingerprint reads: strided candidates, then ``largest`` (duplicates once).

    >>> fingerprint_indices(range(100))[:4], len(fingerprint_indices(range(100)))
    ((0, 6, 13, 19), 16)
    >>> fingerprint_indices(range(3), largest=[2, 7])
    (0, 1, 2, 7)
    """
    count = len(candidates)
    picked = min(count, FINGERPRINT_SAMPLES)
    positions = [0] if picked == 1 else [p * (count - 1) // (picked - 1) for p in range(picked)]
    seen: dict[int, None] = {}
    for index in [int(candidates[p]) for p in positions] + [int(i) for i in largest[:FINGERPRINT_LARGEST]]:
        seen.setdefault(index, None)
    return tuple(seen)


def read_fingerprint(dataset: Any, indices: Sequence[int], size_fn: SizeFn) -> Fingerprint:
    """The sizes of ``dataset[i]`` for ``indices``, each read with the global RNGs seeded by its index.

    Seeding per sample makes a random augmentation that changes a sample's size (a random crop) read the
    same way at every check, so unchanged data keeps its fingerprint; the run's own RNG streams are put
    back afterwards (:func:`preserved_rng`).
    """
    sizes = []
    with preserved_rng():
        for index in indices:
            seed = SCAN_SEED + 7919 * int(index)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.default_generator.manual_seed(seed)  # not torch.manual_seed: that would queue a CUDA seed
            sizes.append(checked_size(size_fn, dataset[int(index)], int(index)))
    return Fingerprint(len(dataset), tuple(int(i) for i in indices), tuple(sizes))


@dataclass
class _Entry:
    dataset: Any
    candidates: Sequence[int]
    size_fn: SizeFn
    limit: int | None
    fingerprint: Fingerprint
    scan: SizeScan

    def matches(self, dataset: Any) -> bool:
        """Whether ``dataset`` reads the same sizes at this entry's fingerprint samples (same length too)."""
        known = self.fingerprint
        if len(dataset) != known.length:
            return False
        return read_fingerprint(dataset, known.indices, self.size_fn) == known


@dataclass
class SizeCache:
    """Scans kept across searches, so a dataset is read once per run rather than once per trigger.

    Every look-up checks the dataset's :class:`Fingerprint` (its length and the sizes of a few dozen
    fixed samples), whether it is the object scanned before or a new one the dataloader hook built
    (``DataLoader(MyDataset(self.rows), ...)``): a dataset whose fingerprint still matches reuses the
    scan, one whose fingerprint changed (a curriculum that raised ``max_len`` on the same object, a
    hook that swapped in longer texts) is scanned again. Inside :meth:`checking_once` (one search, one
    epoch start) each dataset is checked once, so a search's trials do not re-read it.
    """

    max_entries: int = 8
    entries: list[_Entry] = field(default_factory=list)
    scans: int = 0
    """How many scans actually ran (cache misses)."""
    checks: int = 0
    """How many fingerprint checks read samples (each reads at most ``FINGERPRINT_SAMPLES + FINGERPRINT_LARGEST``)."""
    _window: int = 0
    _checked: set[int] = field(default_factory=set)

    @contextmanager
    def checking_once(self) -> Iterator[None]:
        """Within the block, a dataset found matching its fingerprint is not checked again (nothing the
        block does changes the data: a search's probes, the work of one epoch start)."""
        self._window += 1
        try:
            yield
        finally:
            self._window -= 1
            if not self._window:
                self._checked.clear()

    def get(self, dataset: Any, candidates: Sequence[int], size_fn: SizeFn, limit: int | None) -> tuple[SizeScan, bool]:
        """The dataset's scan, and whether it was just computed (False: from the cache)."""
        known = self.find(dataset, candidates, size_fn, limit)
        if known is not None:
            return known, False
        scan = scan_sizes(dataset, candidates, size_fn, limit)
        self.scans += 1
        fingerprint = read_fingerprint(dataset, fingerprint_indices(candidates, scan.order), size_fn)
        self.entries = [e for e in self.entries if e.dataset is not dataset or e.size_fn is not size_fn]
        entry = _Entry(dataset, candidates, size_fn, limit, fingerprint, scan)
        self.entries.append(entry)
        del self.entries[: -self.max_entries]
        if self._window:
            self._checked.add(id(entry))
        return scan, True

    def find(self, dataset: Any, candidates: Sequence[int], size_fn: SizeFn, limit: int | None) -> SizeScan | None:
        """The cached scan of this dataset, or of one with the same type, length and fingerprint; else None
        (a dataset whose fingerprint changed since its scan: the caller scans it again)."""
        similar = [
            e
            for e in self.entries
            if e.size_fn is size_fn
            and e.limit == limit
            and type(e.dataset) is type(dataset)
            and e.candidates == candidates
        ]
        # the object scanned before first: the usual case, and the one an in-place change hides in
        similar.sort(key=lambda e: e.dataset is not dataset)
        for entry in similar:
            if id(entry) in self._checked and entry.dataset is dataset:
                return entry.scan
            self.checks += 1
            if entry.matches(dataset):
                entry.dataset = dataset  # hold the newest object; the old one may be freed
                if self._window:
                    self._checked.add(id(entry))
                return entry.scan
        return None


__all__ = [
    "FINGERPRINT_LARGEST",
    "FINGERPRINT_SAMPLES",
    "Fingerprint",
    "SizeCache",
    "SizeFn",
    "SizeScan",
    "Spread",
    "checked_size",
    "default_sample_size",
    "fingerprint_indices",
    "preserved_rng",
    "read_fingerprint",
    "resolve_size_fn",
    "scan_sizes",
    "size_spread",
]
