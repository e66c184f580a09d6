"""Which samples a probe's batches hold (``search.probe_samples``), applied to the user's own loader.

``first`` probes the first batches of the loader the ``*_dataloader()`` hook returns at the candidate
size, as Lightning's finder does. ``largest`` keeps that loader — its ``collate_fn``, workers, pinning,
its class — and only changes the order it reads the dataset in: every probe batch at size ``b`` is
the ``b`` largest samples, so padding, the transfer hooks and the step see the worst batch the epoch
can produce. Only the index order is replaced (on a shallow copy of the loader), so nothing else
about the loader can drift from training.

It cannot work where the loader does not draw single samples by position: an ``IterableDataset``,
a custom ``batch_sampler`` that decides which samples go together (bucketing, token budgets),
``batch_size=None`` (the dataset yields whole batches), or a sampler whose keys are not positions.
There it warns once, naming the reason, and the probes use the first batches.

Under DDP every rank scans the whole dataset with the same seed and probes the same *global*
largest samples: the shard a rank receives changes every epoch (``DistributedSampler.set_epoch``),
so any rank can meet the longest sample, and no rank needs to communicate to agree on them.

The samples a stage's last probes ran on are kept (per loader), so that an epoch start can tell whether
the data outgrew them (:meth:`ProbeBatches.largest_change`): a length curriculum that raises ``max_len``
on the same dataset object makes the largest samples longer than the size in force was measured on.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from retune import messages
from retune.compat.combined_loaders import is_combined_loader, length_of
from retune.errors import FieldProblem, RetuneError, ScheduleError
from retune.probing.sample_sizes import (
    SizeCache,
    SizeFn,
    SizeScan,
    default_sample_size,
    preserved_rng,
    resolve_size_fn,
    size_spread,
)
from retune.schedule.models import RetuneSchedule


def _holds_loaders(item: Any) -> bool:
    """A loader, or a dict/list/tuple/``CombinedLoader`` of them (not a batch's tensors)."""
    if isinstance(item, DataLoader) or is_combined_loader(item):
        return True
    if isinstance(item, Mapping):
        return all(_holds_loaders(v) for v in item.values())
    return isinstance(item, (list, tuple)) and bool(item) and all(_holds_loaders(v) for v in item)


class _FixedOrder(Sampler[int]):
    """Yields the given indices, in order (the probe's chosen samples)."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def why_not_reorderable(loader: Any) -> str | None:
    """Why a probe cannot pick this loader's samples by size, or None when it can."""
    if not isinstance(loader, DataLoader):
        return f"it is a {type(loader).__name__}, not a torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return f"its dataset ({type(loader.dataset).__name__}) is an IterableDataset, which has no random access"
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        return "it has batch_size=None, so the dataset yields whole batches"
    if type(batch_sampler) is not BatchSampler:
        return (
            f"its batch_sampler ({type(batch_sampler).__name__}) decides which samples go together "
            "(bucketing, token budgets), which a probe must not override"
        )
    try:
        len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return f"its dataset ({type(loader.dataset).__name__}) has no length"
    return None


def budget_not_ensured(dataset: Any) -> str:
    """What a run with an ``IterableDataset`` loses, and the ways out (for the warnings that name it).

    Probes can only read a stream's first batches, so a later batch of longer samples is never measured:
    neither a ``memory.budget`` nor bucketed batch sizes can be ensured for the steps that follow. A stream
    that keeps its position between iterations loses what the probes read: retune cannot put a stream back.
    """
    return (
        f"the dataset ({type(dataset).__name__}) is an IterableDataset, so probes run on its first batches only "
        "and steps may exceed the memory budget (a later batch of longer samples is never measured). To keep every "
        "step within the budget: use a map-style dataset (__getitem__ and __len__) with `search.probe_samples: "
        "largest`; or probe with `probe_samples: largest` on a map-style sample of the stream that holds its "
        "longest samples; or add the `oom` trigger so a step that runs out of memory is re-run in micro-batches. "
        "Each probe iterates the stream anew: one that keeps its position between iterations (a cursor, a queue) "
        "starts training after the samples the probes read"
    )


def candidate_indices(sampler: Any, dataset_len: int) -> Sequence[int]:
    """The dataset indices a sampler can draw: a ``SubsetRandomSampler``'s subset, a
    ``WeightedRandomSampler``'s nonzero weights, else every position (``DistributedSampler`` included:
    its shards change every epoch)."""
    if isinstance(sampler, SubsetRandomSampler):
        return [int(i) for i in sampler.indices]
    if isinstance(sampler, WeightedRandomSampler) and len(sampler.weights) == dataset_len:
        return [i for i, w in enumerate(sampler.weights.tolist()) if w > 0]
    return range(dataset_len)


def probe_batch(chosen: list[int], size: int, drawn: int | None) -> list[int]:
    """The indices of one ``largest`` probe batch at ``size``: the ``chosen`` largest candidates (at most ``size``).

    Where there are fewer candidates than ``size``, the batch is one the epoch can produce: a sampler that draws
    more samples per epoch than it has candidates (``drawn``: with replacement, or a ``num_samples`` above them)
    repeats samples, so the batch cycles through the largest ones up to ``min(size, drawn)``; otherwise no epoch
    batch holds more than the candidates, and the batch is those alone (the search is told it held fewer than
    ``size``). Repeating candidates there probed a batch the epoch never produces (142 samples built from 48).

    >>> probe_batch([5, 3, 9], 2, None), probe_batch([5, 3, 9], 5, 3), probe_batch([5, 3, 9], 5, 100)
    ([5, 3], [5, 3, 9], [5, 3, 9, 5, 3])
    """
    if len(chosen) >= size or not chosen:
        return chosen[:size]
    if drawn is None or drawn <= len(chosen):
        return chosen
    target = min(size, drawn)
    return [chosen[i % len(chosen)] for i in range(target)]


def batch_size_of(loader: DataLoader[Any]) -> int:
    batch_sampler = loader.batch_sampler
    size = loader.batch_size if loader.batch_size is not None else getattr(batch_sampler, "batch_size", None)
    assert isinstance(size, int), "a reorderable loader has a BatchSampler with an int batch size"
    return size


def with_index_order(loader: DataLoader[Any], indices: list[int], batch_size: int) -> DataLoader[Any]:
    """A shallow copy of ``loader`` that reads ``indices`` in order, ``batch_size`` at a time.

    Everything else is the user's loader: class, ``collate_fn``, workers, pinning, worker seeding,
    generator. ``DataLoader`` refuses new samplers after construction, so the copy's attributes are
    written directly; a persistent worker pool is not shared with (or kept by) the copy.
    """
    sampler = _FixedOrder(indices)
    new = copy.copy(loader)
    state = new.__dict__
    state["sampler"] = sampler
    state["batch_sampler"] = BatchSampler(sampler, batch_size, drop_last=False)
    state["_iterator"] = None
    state["persistent_workers"] = False
    return new


class _CountedBatches:
    """A loader's batch sampler that writes down how many samples each batch it yields holds.

    Counting the indices a batch sampler yields, rather than the batch the collate function builds, works for
    any batch structure (dicts, lists, a custom class) and sees exactly the samples that went together. It
    stands in for the user's batch sampler on a shallow copy of the loader only (:func:`counted`); every other
    attribute is the user's.
    """

    def __init__(self, inner: Any, seen: list[int]) -> None:
        self.inner = inner
        self.seen = seen

    def __iter__(self) -> Iterator[Any]:
        for batch in self.inner:
            with contextlib.suppress(TypeError):  # indices without a length: nothing to count
                self.seen.append(len(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def counted(loader: Any, seen: list[int]) -> Any:
    """``loader``, or a shallow copy whose batch sampler appends each batch's sample count to ``seen``.

    Only a ``DataLoader`` over a map-style dataset with a batch sampler is counted: an iterable dataset's batch
    sampler yields placeholder indices that do not say how many samples the stream had left. The copy is made as
    :func:`with_index_order` makes its own (no shared iterator or persistent worker pool).
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if loader.batch_sampler is None:
        return loader
    new = copy.copy(loader)
    state = new.__dict__
    state["batch_sampler"] = _CountedBatches(loader.batch_sampler, seen)
    state["_iterator"] = None
    state["persistent_workers"] = False
    return new


class HeldSizes:
    """How many samples the batches of one search's probes held, by the batch size each probe asked for.

    A loader's batches need not hold the size it is asked for: a batch sampler of the user's own (token budgets,
    bucketing) decides them, a hook may not read the batch-size attribute, a sampler may draw fewer samples per
    epoch than the size. A trial's verdict is about the batches it ran, so a size none of them held is not
    verified: :meth:`verified_cap` says which size the probes did verify, :meth:`describe` what they saw.
    """

    def __init__(self) -> None:
        self.by_size: dict[int, list[int]] = {}
        """Size probed -> the sample count of every batch its probes drew (all the loaders' batches)."""
        self.sources: dict[int, str] = {}
        """Size probed -> what decides the batches of the loader probed at it (for the warning)."""
        self._warned: set[str] = set()

    def clear(self) -> None:
        """Forget the counts (a new search); which stages were warned about is kept for the fit."""
        self.by_size.clear()
        self.sources.clear()

    def first_warning(self, stage: str) -> bool:
        """True the first time it is asked for ``stage``: the mismatch is said once per fit, noted at every search."""
        if stage in self._warned:
            return False
        self._warned.add(stage)
        return True

    def record(self, size: int, source: str) -> list[int]:
        """The list a probe at ``size`` appends its batches' sample counts to."""
        self.sources.setdefault(size, source)
        return self.by_size.setdefault(size, [])

    def held(self, size: int) -> int | None:
        """The most samples a batch of a probe at ``size`` held (None: not counted)."""
        seen = self.by_size.get(size)
        return max(seen) if seen else None

    def mismatched(self) -> dict[int, tuple[int, int]]:
        """Sizes whose probes' batches never held that many samples exactly: size -> (fewest, most) held.

        An epoch's last, partial batch holds fewer and does not count: only the largest batch is compared.
        """
        return {size: (min(seen), max(seen)) for size, seen in self.by_size.items() if seen and max(seen) != size}

    def verified_cap(self, fitting: Sequence[int]) -> int | None:
        """The most samples a batch of a fitting probe (one at a size in ``fitting``) held, where some probe's
        batches did not hold their size; None when every counted probe held its size (nothing to cap)."""
        if not self.mismatched():
            return None
        held = [h for h in (self.held(size) for size in fitting) if h is not None]
        return max(held) if held else None

    def describe(self) -> str:
        """``at sizes 2-240 the batches held 7-11 samples (its batch_sampler (TokenBudget) ...)``."""
        off = self.mismatched()
        sizes = sorted(off)
        fewest = min(lo for lo, _ in off.values())
        most = max(hi for _, hi in off.values())
        span = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        held = f"{fewest}" if fewest == most else f"{fewest}-{most}"
        why = self.sources.get(sizes[-1], "")
        return f"probes at {span} ran batches of {held} samples" + (f" ({why})" if why else "")


def batches_source(loader: Any, size: int, attribute: str = "the batch-size attribute") -> str:
    """What decides how many samples the batches of ``loader`` (built for ``size``) hold, for the warning;
    ``attribute``: what the search wrote ``size`` to, in words."""
    if not isinstance(loader, DataLoader):
        return f"it is a {type(loader).__name__}"
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return f"its batch_sampler ({type(batch_sampler).__name__}) decides which samples go together"
    if loader.batch_size is not None and loader.batch_size != size:
        return f"the loader was built with batch_size={loader.batch_size}: does the hook read {attribute}?"
    sampler = getattr(batch_sampler, "sampler", None) or loader.sampler
    return f"its sampler ({type(sampler).__name__}) draws fewer samples per epoch"


@dataclass(frozen=True)
class LargestChange:
    """A stage's data changed since its last probes ran on its largest samples (:meth:`ProbeBatches.largest_change`)."""

    search: bool
    """They got larger: the size in force was measured on smaller ones, so the stage is searched again."""
    largest_before: int = 0
    """The largest sample size the last probes ran on."""
    largest_after: int = 0
    """The largest sample size now."""

    def describe(self) -> str:
        """``largest sample 64 -> 256``, for the log."""
        return f"largest sample {self.largest_before} -> {self.largest_after}"


@dataclass
class _Probed:
    """What a stage's loader's last probes ran on: its dataset, the candidates and their scan."""

    dataset: Any
    candidates: Sequence[int]
    scan: SizeScan
    """The scan the probes' largest samples came from."""
    seen: SizeScan
    """The scan last compared with it at an epoch start (a change is reported once)."""


class ProbeBatches:
    """Applies ``search.probe_samples`` to the loaders a search's trials request; one per callback.

    It keeps what must outlive a search: the sizes scanned per dataset (:class:`~retune.probing.sample_sizes.SizeCache`)
    and which warnings were given, so each is given once per run.
    """

    def __init__(
        self,
        mode: str = "first",
        sample_size: SizeFn | None = None,
        scan_limit: int | None = None,
        say: Callable[..., None] | None = None,
        budgeted: bool = False,
    ) -> None:
        self.mode = mode
        self.budgeted = budgeted
        """A ``memory.budget`` or ``batching: buckets`` is set: a stream's steps then deserve a plain warning."""
        self.size_fn: SizeFn = sample_size or default_sample_size
        self.scan_limit = scan_limit
        self.say = say or messages.say
        """``say(message, warn=False)``: the callback's rank-zero printer (a bound method, so that the
        callback still pickles for ``ddp_spawn``)."""
        self.cache = SizeCache()
        self.scan_seconds = 0.0
        """Time spent scanning sample sizes, over the whole run."""
        self._warned: set[str] = set()
        self._looked: set[str] = set()
        self._streams: set[str] = set()
        self._probed: dict[str, _Probed] = {}
        """``where`` (``train``, ``train[0]``, ...) -> what its last ``largest`` probes ran on."""
        self.held = HeldSizes()
        """How many samples the current search's probe batches held, by the size probed (:meth:`arrange`)."""
        self.attribute = "the batch-size attribute"
        """The attribute the current search writes, in words (the callback sets it before each search): a loader
        that ignores it is asked about it by name."""

    @classmethod
    def from_schedule(
        cls,
        schedule: RetuneSchedule,
        source: Any,
        sample_size: SizeFn | None,
        say: Callable[..., None],
    ) -> ProbeBatches:
        """The schedule's ``search.probe_samples`` with its size function: the constructor's ``sample_size``
        or the schedule's dotted path, resolved now so that a wrong path fails when the callback is built,
        not in the middle of a fit. ``say(message, warn=...)`` prints (the callback's rank-zero printer)."""
        search = schedule.search
        if sample_size is not None and search.sample_size is not None:
            raise RetuneError(
                f"sample_size is given twice: as a constructor argument ({sample_size!r}) and as "
                f"search.sample_size ({search.sample_size!r}) in the schedule; keep one"
            )
        if sample_size is not None and not callable(sample_size):
            raise RetuneError(f"sample_size must be a function fn(sample) -> int, got {sample_size!r}")
        if search.sample_size is not None:
            try:
                sample_size = resolve_size_fn(search.sample_size)
            except ValueError as exc:
                name = str(source) if isinstance(source, (str, PurePath)) else "<schedule>"
                raise ScheduleError(name, [FieldProblem("search.sample_size", str(exc))]) from None
        return cls(
            search.probe_samples,
            sample_size,
            search.scan_limit,
            say=say,
            budgeted=schedule.memory.budget is not None or search.batching == "buckets",
        )

    def arrange(self, loader: Any, stage: str, steps: int, size: int | None = None) -> Any:
        """The loader a trial should iterate: ``loader`` itself, or (``largest``) its largest samples,
        enough for ``steps`` batches. Loaders returned in a dict, list or tuple (nested at will) or in a
        Lightning 2.x ``CombinedLoader`` (a copy, in its own mode) are arranged one by one.

        With ``size`` (the batch size the trial probes), each loader's batches are counted into :attr:`held`
        as the trial draws them (:func:`counted`), so that the search can tell a size no batch held."""
        if is_combined_loader(loader) and hasattr(loader, "flattened"):
            arranged = copy.copy(loader)  # the hook's own object keeps its loaders
            arranged.flattened = [self.arrange(d, f"{stage}[{i}]", steps, size) for i, d in enumerate(loader.flattened)]
            return arranged
        if isinstance(loader, Mapping):
            return {key: self.arrange(value, f"{stage}[{key!r}]", steps, size) for key, value in loader.items()}
        if isinstance(loader, (list, tuple)) and loader and all(_holds_loaders(d) for d in loader):
            return [self.arrange(value, f"{stage}[{i}]", steps, size) for i, value in enumerate(loader)]
        arranged = self._one(loader, stage, steps)
        if size is None:
            return arranged
        return counted(arranged, self.held.record(size, batches_source(loader, size, self.attribute)))

    def _one(self, loader: Any, where: str, steps: int) -> Any:
        reason = why_not_reorderable(loader)
        if self.budgeted and isinstance(getattr(loader, "dataset", None), IterableDataset):
            lead = where if self.mode == "first" else f"probe_samples: largest cannot pick the {where} dataloader's"
            lead += "" if self.mode == "first" else " samples"
            self.warn_stream(where, loader.dataset, lead)
            return loader
        if self.mode == "first":
            if reason is None and where not in self._looked:
                self._looked.add(where)
                self._check_spread(loader, where)
            return loader
        if reason is not None:
            self.warn_once(where, f"probe_samples: largest cannot pick the {where} dataloader's samples: {reason}")
            return loader
        dataset = loader.dataset
        candidates = candidate_indices(loader.batch_sampler.sampler, len(dataset))
        if not candidates:
            return loader
        scan, fresh = self.cache.find(dataset, candidates, self.size_fn, self.scan_limit), False
        if scan is None:
            problem = self.unindexable(dataset, candidates[0])
            if problem is not None:
                self.warn_once(where, f"probe_samples: largest cannot pick the {where} dataloader's samples: {problem}")
                return loader
            scan, fresh = self.cache.get(dataset, candidates, self.size_fn, self.scan_limit)
        if fresh:
            self.scan_seconds += scan.seconds
            per_sample = scan.seconds / max(scan.scanned, 1)
            self.say(
                f"scanned the sizes of {scan.scanned} of {len(candidates)} {where} samples in {scan.seconds:.2f}s "
                f"({per_sample * 1e6:.0f} us per sample); largest {scan.sizes[0] if scan.sizes else 0}"
            )
        if scan.sizeless:
            self.warn_once(
                where,
                f"probe_samples: largest found no size in the {where} samples (every one measured 0); pass "
                "sample_size to say what a sample's memory grows with. Probing the first batches instead",
            )
            return loader
        batch_size = batch_size_of(loader)
        batch = probe_batch(scan.largest(batch_size), batch_size, length_of(loader.batch_sampler.sampler))
        self._probed[where] = _Probed(dataset, candidates, scan, scan)
        return with_index_order(loader, batch * steps, len(batch))

    def largest_change(self, stage: str, loaders: Sequence[Any], batch_size: int | None) -> LargestChange | None:
        """Whether the ``batch_size`` largest samples of ``stage``'s data are now larger than those its last
        probes ran on (``probe_samples: largest``), or changed at all; None when nothing changed (or never probed).

        ``loaders`` are the ones the stage runs on now (Lightning's, after any reload): with one loader, its
        dataset is checked, whether the object probed (changed in place) or a new one; otherwise each probed
        dataset object is checked in place. The check is the size cache's fingerprint (a few dozen samples
        read); only a changed fingerprint rescans. A change is reported once: the next check compares again
        only once the data changes again (a search in between records what its probes ran on).
        """
        if self.mode != "largest" or batch_size is None:
            return None
        probed = {w: p for w, p in self._probed.items() if w == stage or w.startswith(f"{stage}[")}
        changes = []
        for where, known in probed.items():
            dataset, candidates = known.dataset, known.candidates
            now = loaders[0] if where == stage and len(loaders) == 1 else None
            if now is not None and why_not_reorderable(now) is None and now.dataset is not known.dataset:
                dataset = now.dataset
                candidates = candidate_indices(now.batch_sampler.sampler, len(dataset))
            if not candidates:
                continue
            scan = self.cache.find(dataset, candidates, self.size_fn, self.scan_limit)
            if scan is None:
                if self.unindexable(dataset, candidates[0]) is not None:
                    continue
                scan, _ = self.cache.get(dataset, candidates, self.size_fn, self.scan_limit)
                self.scan_seconds += scan.seconds
                self.say(f"rescanned the sizes of {scan.scanned} {where} samples in {scan.seconds:.2f}s: they changed")
            if scan is known.seen:
                continue
            known.seen = scan
            before, after = known.scan.sizes[:batch_size], scan.sizes[:batch_size]
            grew = len(after) > len(before) or any(a > b for a, b in zip(after, before, strict=False))
            changes.append(LargestChange(grew, before[0] if before else 0, after[0] if after else 0))
        if not changes:
            return None
        return next((c for c in changes if c.search), changes[0])

    def unindexable(self, dataset: Any, first: int) -> str | None:
        """A sampler's keys are positions only if ``dataset[position]`` works; say why not otherwise."""
        try:
            with preserved_rng():
                dataset[first]
        except (KeyError, IndexError, TypeError) as exc:
            return (
                f"dataset[{first}] raised {type(exc).__name__}: {exc}; its sampler does not draw positions "
                f"0..len-1, so retune cannot choose samples by position"
            )
        return None

    def _check_spread(self, loader: Any, where: str) -> None:
        dataset = loader.dataset
        candidates = candidate_indices(loader.batch_sampler.sampler, len(dataset))
        if not candidates or self.unindexable(dataset, candidates[0]) is not None:
            return
        spread = size_spread(dataset, candidates, self.size_fn)
        if spread.wide:
            self.warn_once(
                where,
                f"the {where} samples' sizes vary widely ({spread.count} random samples: largest {spread.largest}, "
                f"median {spread.median:g}, {spread.ratio:.1f}x); probes on the first batches may miss the memory "
                "of the largest ones. Set `search.probe_samples: largest` to probe on them",
            )

    def warn_stream(self, where: str, dataset: Any, lead: str) -> None:
        """Say once per fit for ``where`` that a stream's steps may exceed the budget (buckets and probes alike)."""
        if where not in self._streams:
            self._streams.add(where)
            self.say(f"{lead}: {budget_not_ensured(dataset)}", warn=True)

    def warn_once(self, where: str, message: str) -> None:
        """Say ``message`` once per fit for ``where`` (a search runs at every trigger; the reason does not change)."""
        key = f"{where}: {message}"
        if key not in self._warned:
            self._warned.add(key)
            self.say(message, warn=True)


__all__ = [
    "HeldSizes",
    "LargestChange",
    "ProbeBatches",
    "budget_not_ensured",
    "candidate_indices",
    "counted",
    "probe_batch",
    "why_not_reorderable",
    "with_index_order",
]
