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
from retune.compat.combined_loaders import is_combined_loader
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
    neither a ``memory.budget`` nor bucketed batch sizes can be ensured for the steps that follow.
    """
    return (
        f"the dataset ({type(dataset).__name__}) is an IterableDataset, so probes run on its first batches only "
        "and steps may exceed the memory budget (a later batch of longer samples is never measured). To keep every "
        "step within the budget: use a map-style dataset (__getitem__ and __len__) with `search.probe_samples: "
        "largest`; or probe with `probe_samples: largest` on a map-style sample of the stream that holds its "
        "longest samples; or add the `oom` trigger so a step that runs out of memory is re-run in micro-batches"
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

    def arrange(self, loader: Any, stage: str, steps: int) -> Any:
        """The loader a trial should iterate: ``loader`` itself, or (``largest``) its largest samples,
        enough for ``steps`` batches. Loaders returned in a dict, list or tuple (nested at will) or in a
        Lightning 2.x ``CombinedLoader`` (a copy, in its own mode) are arranged one by one."""
        if is_combined_loader(loader) and hasattr(loader, "flattened"):
            arranged = copy.copy(loader)  # the hook's own object keeps its loaders
            arranged.flattened = [self.arrange(d, f"{stage}[{i}]", steps) for i, d in enumerate(loader.flattened)]
            return arranged
        if isinstance(loader, Mapping):
            return {key: self.arrange(value, f"{stage}[{key!r}]", steps) for key, value in loader.items()}
        if isinstance(loader, (list, tuple)) and loader and all(_holds_loaders(d) for d in loader):
            return [self.arrange(value, f"{stage}[{i}]", steps) for i, value in enumerate(loader)]
        return self._one(loader, stage, steps)

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
        chosen = scan.largest(batch_size)
        self._probed[where] = _Probed(dataset, candidates, scan, scan)
        return with_index_order(loader, chosen * steps, batch_size)

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
    "LargestChange",
    "ProbeBatches",
    "budget_not_ensured",
    "candidate_indices",
    "why_not_reorderable",
    "with_index_order",
]
