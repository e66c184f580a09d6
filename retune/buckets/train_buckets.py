"""``search.batching: buckets`` for the train stage: what a run keeps between searches, and one search.

:class:`TrainBuckets` owns the buckets of a fit: the samples grouped by size (from the sample-size
scan of ``probe_samples: largest``, cached per dataset), each bucket's batch size, the memory the
last search learned (the next one's prior), the shuffle seed, and the hook that hands Lightning the
bucketed loader. A search probes each bucket on its worst batch (its largest samples) through the
same :class:`~retune.probing.prober.Prober` session as a fixed search (:mod:`retune.search.stage` runs both).

A sampler that chooses which samples train and how often (weights, a subset, ``num_samples``) stays
the truth: each epoch its own draws are bucketed (:mod:`retune.buckets.drawn`; under DDP, rank zero's
draws shared out across the ranks). Where buckets cannot work — an ``IterableDataset``, a custom
``batch_sampler``, a loader that is not a ``DataLoader``, several train loaders, samples without a
size, a choosing sampler whose draws cannot be known before the epoch (no ``__len__``) or that the
ranks would not share (it shards itself, or ``use_distributed_sampler=False``) — training stays on one
batch size (``fixed``) and one warning says why.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from retune import compat
from retune.buckets.drawn import (
    DrawnBucketBatchSampler,
    EveryRankDraws,
    bucket_of_index,
    trims_across_ranks,
    why_draws_unknown,
)
from retune.buckets.loader import BucketBatchSampler, TrainLoaderHook, is_shuffled, loader_seed
from retune.buckets.loader import with_batch_sampler as _with_batch_sampler
from retune.buckets.plan import (
    Buckets,
    assign,
    choose_bounds_for_steps,
    count_batches,
    mean_batch,
    plan_buckets,
    regroup,
)
from retune.buckets.sizes import (
    BucketMemory,
    BucketSearchResult,
    BucketTrial,
    below_failure,
    carried_down,
    length_curve,
    search_buckets,
)
from retune.buckets.throughput import bucket_timings, cap_at_fastest, capped_sizes, reference_bucket
from retune.events import Direction
from retune.probing.probe_batches import ProbeBatches, candidate_indices, why_not_reorderable, with_index_order
from retune.probing.prober import Prober
from retune.search.largest import failing_from
from retune.search.predict_run import steady_probes
from retune.search.throughput import ThroughputPlan, choose_fastest, selection_budget, selection_steps

_TRIMS = "DistributedSampler with drop_last=True"  # the run's own, over a dataset its ranks do not divide


def sampler_that_chooses(loader: Any, world_size: int = 1, rank: int = 0) -> str | None:
    """The class name of ``loader``'s sampler when it decides *which* samples train (and how often), else None.

    Buckets regroup an epoch's samples by size; they replace the sampler's draws with their own plan only
    for a sampler that draws every sample of the loader's dataset exactly once per epoch across the run's
    ``world_size`` processes, in an order that does not matter: a ``SequentialSampler`` or a
    ``RandomSampler`` without replacement over the whole dataset, and a ``DistributedSampler`` that is the
    run's own sharding (``num_replicas`` the run's processes, ``rank`` this process's, over a dataset as
    long as the loader's: what Lightning injects under DDP, or what a user builds for it). The same
    classes over part of the dataset — a ``SequentialSampler`` over the first 100 positions, a
    ``DistributedSampler`` that shards a one-process run (an array job's share of the data) — choose, as
    do a ``WeightedRandomSampler``, a ``RandomSampler`` with replacement or another ``num_samples``, and a
    custom sampler (a subset, a curriculum), and the run's own ``DistributedSampler(drop_last=True)`` where the
    ranks do not divide the dataset (it leaves samples out of each epoch: :func:`draws_source`):
    replacing their draws would silently train other data, so
    buckets group their own draws each epoch (:class:`~retune.buckets.drawn.DrawnBucketBatchSampler`), or
    leave the loader as the user built it when they cannot be known before the epoch or shared by the ranks.

    >>> from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler
    >>> data = list(range(8))
    >>> sampler_that_chooses(DataLoader(data, sampler=SequentialSampler(range(4))))
    'SequentialSampler'
    >>> shard = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=1))
    >>> sampler_that_chooses(shard), sampler_that_chooses(shard, world_size=2, rank=1)  # one process; its own run
    ('DistributedSampler', None)
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else None
    if sampler is None or isinstance(batch_sampler, BucketBatchSampler):
        return None
    length = compat.length_of(getattr(loader, "dataset", None))
    # exact classes: subclasses (Lightning's wrapper of a custom sampler under DDP, a user's own) may choose
    if type(sampler) is SequentialSampler:
        return None if length is not None and compat.length_of(sampler) == length else type(sampler).__name__
    if type(sampler) is DistributedSampler:
        own = (sampler.num_replicas, sampler.rank) == (world_size, rank) and compat.length_of(sampler.dataset) == length
        if own and trims_across_ranks(sampler, length):  # its epochs leave samples out: its draws are grouped
            return _TRIMS
        return None if own and length is not None else type(sampler).__name__
    if type(sampler) is RandomSampler:
        whole = length is not None and sampler.num_samples == length and compat.length_of(sampler.data_source) == length
        return None if not sampler.replacement and whole else "RandomSampler with replacement or num_samples"
    return type(sampler).__name__


def draws_source(loader: Any, world_size: int = 1, rank: int = 0) -> Any:
    """What one epoch's draws are read from when ``loader``'s sampler chooses (:func:`sampler_that_chooses`): its
    sampler, or, for the run's own ``DistributedSampler`` that trims the epoch, all its ranks' draws as one
    (:class:`~retune.buckets.drawn.EveryRankDraws`: rank zero's pass is then the whole epoch's, as the
    bucketed sampler needs). None without a batch sampler's sampler."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if isinstance(sampler, DistributedSampler) and sampler_that_chooses(loader, world_size, rank) == _TRIMS:
        return EveryRankDraws(sampler)
    return sampler


@dataclass(frozen=True)
class TracedBuckets:
    """What traces predicted: the memory every step holds, and the memory per sample as a function of the
    longest sample in the batch (the traced buckets' points; :func:`~retune.buckets.sizes.length_curve`
    between and beyond them), so for any grouping of the samples."""

    fixed: float
    curve: tuple[tuple[int, float], ...]
    """``(longest sample, memory per sample)`` of each traced bucket's worst batch."""

    def slope(self, longest: int) -> float:
        """Memory one more sample adds to a batch whose longest sample is ``longest``."""
        return length_curve(self.curve, longest)

    def largest(self, longest: int, upper: int, limit: float) -> int:
        """The largest batch (at most ``upper``) the prediction keeps within ``limit``."""
        slope = self.slope(longest)
        return upper if slope <= 0 else max(1, min(upper, int((limit - self.fixed) // slope)))

    def memory(self, buckets: Buckets) -> BucketMemory:
        """The prediction as a search's prior for these buckets."""
        return BucketMemory(self.fixed, tuple(self.slope(top) for top in buckets.largest), None)


PredictBuckets = Callable[
    [Buckets, Sequence[int], Callable[[int], Any], "TracedBuckets | None"], "TracedBuckets | None"
]
"""``predict(buckets, uppers, arrange_of, before)``: the traced prior (None: it fell back); ``arrange_of(bucket)``
is the probe arrangement of the bucket's worst batch at 2 samples (its padded length); ``before`` is the last
search's traced prior in this fit (None: none yet)."""


@dataclass
class BucketState:
    """What a run keeps about its buckets (in ``state_dict``: a resumed run trains at the same sizes)."""

    bounds: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    memory: BucketMemory | None = None
    seed: int | None = None
    largest: list[int] = field(default_factory=list)
    """``objective: throughput``: each bucket's largest size that fit, before the cap (empty: ``sizes`` are)."""
    reference: int | None = None
    """``objective: throughput``: the bucket the selection timed, and ``chosen``, its size there."""
    chosen: int | None = None
    padded: int | None = None
    """``objective: throughput``: the padded work per step every bucket is capped at (None: no cap)."""
    failed: dict[int, int] = field(default_factory=dict)
    """Bucket -> the smallest size measured to fail since the memory last changed: never applied again."""
    failed_in_training: dict[int, int] = field(default_factory=dict)
    """Bucket -> the smallest size a real training step ran out of memory at, kept while the bounds are the same
    and no trigger says the memory shrank: every search stays below it (its probes see the bucket's worst batch
    by length; the step that failed may have been heavier in another way)."""
    pending: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Bucket -> ``(fitting, failed)`` of real steps that ran out of memory since the last search (the next
    search lowers those buckets): kept here so a checkpoint taken mid-epoch carries them."""
    by_steps: bool = False
    """``bounds`` were cut by a predicted search for the fewest steps (:func:`~retune.buckets.plan.
    choose_bounds_for_steps`), not by padded work: the next searches keep them while the samples are the same."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "bounds": list(self.bounds),
            "sizes": list(self.sizes),
            "memory": None if self.memory is None else self.memory.to_dict(),
            "seed": self.seed,
            "largest": list(self.largest),
            "reference": self.reference,
            "chosen": self.chosen,
            "padded": self.padded,
            "failed": {str(b): int(size) for b, size in self.failed.items()},
            "failed_in_training": {str(b): int(size) for b, size in self.failed_in_training.items()},
            "pending": {str(b): [int(fit), int(fail)] for b, (fit, fail) in self.pending.items()},
            "by_steps": self.by_steps,
        }

    @property
    def fit_sizes(self) -> list[int]:
        """The largest sizes that fit (what a warm fit search starts from), capped or not."""
        return list(self.largest) if len(self.largest) == len(self.sizes) else list(self.sizes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BucketState:
        memory = data.get("memory")
        return cls(
            [int(b) for b in data.get("bounds") or []],
            [int(s) for s in data.get("sizes") or []],
            None if memory is None else BucketMemory.from_dict(memory),
            data.get("seed"),
            [int(s) for s in data.get("largest") or []],  # absent before throughput worked with buckets
            _int_or_none(data.get("reference")),
            _int_or_none(data.get("chosen")),
            _int_or_none(data.get("padded")),
            # absent before issue 28: no failed sizes known, no failures pending
            {int(b): int(size) for b, size in (data.get("failed") or {}).items()},
            {int(b): int(size) for b, size in (data.get("failed_in_training") or {}).items()},
            {int(b): (int(v[0]), int(v[1])) for b, v in (data.get("pending") or {}).items()},
            bool(data.get("by_steps", False)),  # absent before issue 29's bounds by steps
        )


@dataclass
class BucketOutcome:
    """One bucketed search's result, before it is applied."""

    buckets: Buckets
    result: BucketSearchResult
    sizes: list[int | None]
    """Each bucket's size after the margin (None: nothing fit the bucket); with ``objective: throughput``,
    after the cap at the fastest padded work per step."""
    sizes_before: list[int]
    largest: list[int] = field(default_factory=list)
    """``objective: throughput``: each bucket's largest size that fit (margin applied), before the cap."""
    reference: int | None = None
    chosen: int | None = None
    padded: int | None = None
    limited: bool = False
    """Only the buckets whose real steps ran out of memory were searched (an ``oom`` re-tune)."""
    regrouped_from: Buckets | None = None
    """The prediction cut the samples at new bounds for fewer steps; these were the buckets before."""


class TrainBuckets:
    """The buckets of the train stage across a fit (one per callback)."""

    def __init__(self, count: int, probe_batches: ProbeBatches) -> None:
        self.count = count
        self.probe_batches = probe_batches
        self.state = BucketState()
        self.buckets: Buckets | None = None
        self.hook = TrainLoaderHook(self._convert)
        self.sampler: BucketBatchSampler | None = None
        """The batch sampler of the loader Lightning trains on now (None: not bucketed)."""
        self.current_bucket: int | None = None
        """The bucket being probed now (for the trial lines)."""
        self._trainer: Any = None
        self._world_size = 1
        self._rank = 0
        self._shared_out = True
        """Lightning shards a train sampler across the ranks (``use_distributed_sampler``)."""
        self._source: Any = None
        """The loader ``train_dataloader()`` last returned to Lightning (what :meth:`data_change` checks)."""
        self.traced: TracedBuckets | None = None
        """The last predicted search's traces in this fit: a later one traces one length and replays the others
        (:attr:`replays`), or traces two and shifts this curve (:func:`~retune.buckets.sizes.shifted_curve`)."""
        self.replays: bool | None = None
        """Whether this fit's first predicted search found a replay of its first trace at the other traced buckets
        equal to their traces (:mod:`retune.prediction.replay`): later searches then trace one bucket and replay
        the others. None: not checked yet."""
        self.epoch_draws: int | None = None
        """Draws per epoch of the user's sampler when it chooses what trains (None: every sample once): no
        step can hold more, so no bucket's size is searched above it (:func:`_uppers`)."""

    @property
    def failures(self) -> dict[int, tuple[int, int]]:
        """Bucket -> ``(fitting, failed)`` sizes of real steps that ran out of memory since the last search."""
        return self.state.pending

    @failures.setter
    def failures(self, value: dict[int, tuple[int, int]]) -> None:
        self.state.pending = value

    # -- the fit ------------------------------------------------------------------------------

    def install(self, trainer: Any) -> None:
        self._trainer = trainer
        self._world_size = int(getattr(trainer, "world_size", 1) or 1)
        self._rank = int(getattr(trainer, "global_rank", 0) or 0)
        self._shared_out = compat.shares_out_samplers(trainer)
        self.traced, self.replays = None, None  # a fit's own: another fit may train another model
        self.hook.install(trainer)

    def uninstall(self) -> None:
        self.hook.uninstall()
        self._trainer = None
        self.sampler = None
        self._source = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_trainer"] = None  # ddp_spawn pickles the callback
        state["sampler"] = None
        state["_source"] = None
        return state

    @property
    def active(self) -> bool:
        """Whether the train loader is bucketed now."""
        return self.sampler is not None

    def restore(self, trainer: Any, say: Any) -> bool:
        """Rebuild the buckets a checkpoint's sizes belong to (same bounds); False when that is not possible."""
        if not self.state.sizes or not self.state.bounds:
            return False
        with self.hook.paused():
            loader = compat.request_dataloader(trainer, "train")
        buckets = self.prepare(loader, say, bounds=self.state.bounds)
        if buckets is None or buckets.count != len(self.state.sizes):
            self.state.sizes = []
            return False
        self.buckets = buckets
        return True

    def bucket_now(self, trainer: Any) -> int | None:
        """The bucket of the batch being trained (None: the loader is not bucketed)."""
        if self.sampler is None:
            return None
        return self.sampler.bucket_at(compat.batch_index(trainer))

    def record_failure(self, trainer: Any, failed: int, fitting: int) -> int | None:
        """A real step of the bucket being trained ran out of memory: remember it for that bucket's search."""
        bucket = self.bucket_now(trainer)
        if bucket is None:
            return None
        self.note_failure(bucket, failed, fitting)
        return bucket

    def note_failure(self, bucket: int, failed: int, fitting: int) -> None:
        """A real step of ``bucket`` ran out of memory at ``failed`` and trained in pieces of ``fitting`` (on this
        rank, or on another that told this one in the step's agreement under DDP)."""
        known = self.failures.get(bucket)
        if known is None:
            self.failures[bucket] = (fitting, failed)
        else:
            self.failures[bucket] = (min(known[0], fitting), min(known[1], failed))

    def merge_failures(self, gathered: Sequence[Mapping[int, tuple[int, int]]]) -> None:
        """Every rank's failures (DDP): the batches of a step come from the same bucket on every rank."""
        merged: dict[int, tuple[int, int]] = {}
        for failures in gathered:
            for bucket, (fitting, failed) in failures.items():
                known = merged.get(bucket)
                merged[bucket] = (fitting, failed) if known is None else (min(known[0], fitting), min(known[1], failed))
        self.failures = merged

    # -- grouping -------------------------------------------------------------------------------

    def why_not(self, loader: Any) -> str | None:
        """Why this train loader cannot be bucketed, or None."""
        if isinstance(loader, (Mapping, list, tuple)):
            return "train_dataloader() returns several loaders"
        trainer = self._trainer
        if trainer is not None and getattr(trainer, "overfit_batches", None):
            # Lightning trains the same first batches each epoch, in order, from a loader it rebuilds itself
            return "overfit_batches trains the same first batches of the loader in order every epoch"
        reason = why_not_reorderable(loader)
        if reason is None and sampler_that_chooses(loader, self._world_size, self._rank) is not None:
            # the sampler's own draws are bucketed each epoch (DrawnBucketBatchSampler), where they can be known
            source = draws_source(loader, self._world_size, self._rank)
            every_rank = isinstance(source, EveryRankDraws)  # the whole epoch's draws on every rank
            reason = why_draws_unknown(source, self._world_size, sharded_by_lightning=self._shared_out or every_rank)
        elif (
            reason is None
            and self._world_size > 1
            and not self._shared_out
            and not isinstance(getattr(loader, "sampler", None), DistributedSampler)  # the user's own sharding
        ):
            # each rank trains its loader's whole pass, where buckets plan one pass shared out across the ranks
            reason = (
                "with use_distributed_sampler=False (pytorch-lightning 1.9: replace_sampler_ddp=False) each rank "
                "trains its own loader's whole pass, which buckets would share out across the ranks (each rank would "
                f"train 1/{self._world_size} of its samples); give the loader a DistributedSampler of your own to "
                "bucket, or let Lightning shard it"
            )
        return reason

    def prepare(self, loader: Any, say: Any, bounds: Sequence[int] | None = None) -> Buckets | None:
        """Group the loader's samples by size (scanned once per dataset); None, with one warning, when not possible."""
        reason = self.why_not(loader)
        if isinstance(getattr(loader, "dataset", None), IterableDataset):
            self.probe_batches.warn_stream(
                "train",
                loader.dataset,
                "search.batching: buckets cannot group the train dataloader's samples, training with one batch size "
                "for every batch (batching: fixed)",
            )
            return None
        if reason is None:
            dataset = loader.dataset
            sampler = loader.batch_sampler.sampler
            candidates = candidate_indices(sampler, len(dataset))
            # why_not() let a choosing sampler through only with a __len__: its draws per epoch
            chooses = sampler_that_chooses(loader, self._world_size, self._rank) is not None
            self.epoch_draws = len(draws_source(loader, self._world_size, self._rank)) if chooses else None
            if not candidates:
                reason = "its sampler draws no samples"
            else:
                problem = self.probe_batches.unindexable(dataset, candidates[0])
                if problem is not None:
                    reason = problem
        if reason is not None:
            self.probe_batches.warn_once(
                "train-buckets",
                f"search.batching: buckets cannot group the train dataloader's samples: {reason}. Training with "
                "one batch size for every batch (batching: fixed)",
            )
            return None
        scan, fresh = self.probe_batches.cache.get(dataset, candidates, self.probe_batches.size_fn, None)
        if fresh and not bounds:
            self.state.by_steps = False  # new sizes: bounds cut for the old ones are not kept
        if fresh:
            self.probe_batches.scan_seconds += scan.seconds
            say(f"scanned the sizes of {scan.scanned} train samples in {scan.seconds:.2f}s for the buckets")
        if scan.sizeless:
            self.probe_batches.warn_once(
                "train-buckets",
                "search.batching: buckets found no size in the train samples (every one measured 0); pass "
                "sample_size to say what a sample's memory grows with. Training with one batch size (batching: fixed)",
            )
            return None
        if bounds:
            return assign(scan.order, scan.sizes, bounds)
        if self.state.by_steps and self.state.bounds:
            return assign(scan.order, scan.sizes, self.state.bounds)  # the same samples: the bounds in force
        return plan_buckets(scan.order, scan.sizes, self.count)

    def agreed(self, grouped: Buckets | None) -> tuple[Buckets | None, str | None]:
        """``grouped`` where every rank grouped the same samples, else None on every rank and why (DDP).

        Each rank groups the samples its own loader draws: with ``use_distributed_sampler=False`` and a dataset per
        rank the buckets differ, and with them each bucket's cap (its share of the members, :func:`_uppers`), the
        plan, and so the sizes the ranks probe and the collectives they meet in. One all-gather per bucketed search
        of the bounds, the members per bucket and the sampler's draws per epoch; where they differ, or a rank could
        not group its samples, every rank searches one size (``batching: fixed``) under the search's agreed cap."""
        trainer = self._trainer
        if trainer is None or not compat.is_distributed(trainer):
            return grouped, None
        local = (
            None
            if grouped is None
            else (list(grouped.bounds), [len(m) for m in grouped.members], self.epoch_draws, self._drop_last)
        )
        gathered = compat.all_gather_object(trainer, local)
        if all(found == local for found in gathered):
            return grouped, None
        seen = "; ".join(
            f"rank {rank}: "
            + ("cannot group its samples" if found is None else f"bounds {found[0]}, {sum(found[1])} samples")
            for rank, found in enumerate(gathered)
        )
        return None, (
            "search.batching: buckets needs every rank to group the same samples (a step's batches come from one "
            f"bucket on every rank), and the ranks' train dataloaders differ ({seen}; a dataset of each rank's own "
            "with use_distributed_sampler=False?). Training with one batch size for every batch (batching: fixed)"
        )

    @property
    def _drop_last(self) -> bool:
        """Whether the user's train loader drops its last partial batch (every step then holds a full size)."""
        return _drops_last(self._source) if self._source is not None else False

    def _convert(self, loader: Any) -> Any:
        """What Lightning trains on: the user's loader with the buckets' batch sampler, when sizes are known."""
        buckets, sizes = self.buckets, self.state.sizes
        self._source = loader if isinstance(loader, DataLoader) else None
        if buckets is None or not sizes or len(sizes) != buckets.count or self.why_not(loader) is not None:
            self.sampler = None
            return loader
        assert isinstance(loader, DataLoader)
        if not _indices_fit(buckets, loader):
            # a rebuilt dataset of another length: the epoch start regroups it (data_change) before it is bucketed;
            # bucketed now, a choosing sampler would draw samples no bucket holds when Lightning asks the length
            self.sampler = None
            return loader
        trainer = self._trainer
        epoch = int(trainer.current_epoch) if trainer is not None else 0
        if sampler_that_chooses(loader, self._world_size, self._rank) is not None:
            drawn_epoch = compat.sampler_epoch(trainer) if trainer is not None else epoch
            previous = self.sampler
            drawn = DrawnBucketBatchSampler(  # it draws when Lightning first asks its length: for the epoch it sets
                buckets,
                sizes,
                draws_from=draws_source(loader, self._world_size, self._rank),  # a plain BatchSampler's (why_not)
                epoch=drawn_epoch,
                # rebuilt within an epoch whose draws were made (Lightning's reload, then a search or a regroup
                # at the same epoch start): the epoch keeps them; a second pass would skip one of the user's
                drawn=previous.drawn_for(drawn_epoch, compat.length_of(loader.dataset))
                if isinstance(previous, DrawnBucketBatchSampler)
                else None,
                drop_last=_drops_last(loader),
                start=compat.resumed_batches(trainer) if trainer is not None else 0,  # mid-epoch resume: continue
                world_size=self._world_size,
                rank=self._rank,
                share=None if trainer is None else _Broadcast(trainer),  # rank zero's draws on every rank
            )
            self.sampler = drawn
            converted = _with_batch_sampler(loader, drawn)
            drawn.base_seeds_ahead = _base_seeds_ahead(converted, trainer)
            return converted
        seed = self.state.seed if self.state.seed is not None else loader_seed(loader)
        sampler = BucketBatchSampler(
            buckets,
            sizes,
            seed=seed,
            epoch=epoch,
            shuffle=is_shuffled(loader),
            drop_last=_drops_last(loader),
            world_size=self._world_size,
            rank=self._rank,
            start=compat.resumed_batches(trainer) if trainer is not None else 0,  # mid-epoch resume: continue
        )
        self.sampler = sampler
        return _with_batch_sampler(loader, sampler)

    # -- one search -----------------------------------------------------------------------------

    def search(
        self,
        trainer: Any,
        buckets: Buckets,
        prober: Prober,
        *,
        limit: int | None,
        start: int,
        max_trials: int,
        max_val: int,
        margin_of: Any,
        tolerance: float,
        steps: int,
        direction: Direction,
        cold: bool,
        predict: PredictBuckets | None = None,
    ) -> BucketOutcome:
        """Probe the buckets (all, or only those whose real steps ran out of memory) and return their sizes.

        ``predict`` (``search.predict: auto``) traces the buckets' worst batches before any probe: a full search
        may then cut the same samples at bounds that take fewer steps at the predicted sizes
        (:meth:`_fewer_steps`), and starts every bucket at its predicted size and verifies it, with probes that
        stop at their first steady-state step. An ``oom`` re-search keeps the buckets (its failures are theirs)
        and starts each failed bucket at its predicted size below the size that failed."""
        if self.state.seed is None:
            with self.hook.paused():
                loader = compat.request_dataloader(trainer, "train")
            self.state.seed = int(compat.broadcast_object(trainer, loader_seed(loader)))
        world = max(1, int(trainer.world_size))
        uppers = _uppers(buckets, max_val, world, self.epoch_draws, self._drop_last)
        same_buckets = list(buckets.bounds) == self.state.bounds and len(self.state.sizes) == buckets.count
        # a warm search starts where memory was last time: the largest sizes, not a throughput cap below them
        previous: list[int | None] | None = list(self.state.fit_sizes) if same_buckets and not cold else None
        prior = self.state.memory if same_buckets else None
        # a bucket that failed in a real step again, at a size its search verified after the first failure: its
        # probes cannot see what fails, so the failure counts from halfway to the size that trained (failing_from)
        again = self.state.failed_in_training if same_buckets and direction != "up" else {}
        failures = {
            b: (fitting, failing_from(fitting, failed) if b in again else failed)
            for b, (fitting, failed) in self.failures.items()
            if b < buckets.count and same_buckets
        }
        self.failures = {}
        only = sorted(failures) if failures else None

        def arrange_for(bucket: int, size: int) -> Any:
            def arrange(loader: Any) -> Any:
                return with_index_order(loader, buckets.worst(bucket, size) * steps, size)

            return arrange

        readings: dict[tuple[int, int], tuple[int, int | None]] = {}

        def measure(bucket: int, size: int) -> tuple[bool, int | None]:
            prober.arrange = arrange_for(bucket, size)
            self.current_bucket = bucket
            try:
                measured = prober.measure(size)
            finally:
                self.current_bucket = None
            if prober.last_reading is not None:
                readings[(bucket, size)] = prober.last_reading
            return measured

        def recheck(bucket: int, size: int) -> int | None:
            reading = readings.get((bucket, size))
            return None if reading is None else prober.checked_from(reading)

        known_fail = {
            b: min(failed, self.state.failed.get(b, failed)) if same_buckets else failed
            for b, (_, failed) in failures.items()
        }
        # a size a real step ran out of memory at stays out of reach while the buckets and the memory are the same
        in_training = {} if direction == "up" or not same_buckets else dict(self.state.failed_in_training)
        for b, fail_at in known_fail.items():
            in_training[b] = min(fail_at, in_training.get(b, fail_at))
        self.state.failed_in_training = in_training
        for b, fail_at in in_training.items():
            known_fail[b] = min(fail_at, known_fail.get(b, fail_at))
        direction = "down" if failures else direction
        traced = None
        regrouped_from = None
        if predict is not None:
            with self.hook.paused():
                traced = predict(buckets, uppers, lambda bucket: arrange_for(bucket, 2), self.traced)
            self.traced = traced or self.traced
        if traced is not None and limit is not None:
            # the same bounds while a real failure is known (its bucket is a bucket of these bounds)
            regroup = not failures and not in_training
            better = self._fewer_steps(buckets, traced, limit, max_val, margin_of, world) if regroup else None
            if better is not None:  # the same samples at new bounds: every bucket is searched (verified) anew
                uppers = _uppers(better, max_val, world, self.epoch_draws, self._drop_last)
                regrouped_from, buckets = buckets, better
            starts = predicted_start(traced, buckets, uppers, limit, previous, known_fail)
            if starts is not None:
                previous, prior, direction = starts, traced.memory(buckets), "unknown"
        with self.hook.paused(), steady_probes(prober, True) if traced is not None else nullcontext():
            result = search_buckets(
                buckets.largest,
                uppers,
                measure,
                limit,
                start=start,
                max_trials=max_trials,
                previous=previous,
                direction=direction,
                prior=prior,
                known_fail=known_fail,
                known_fit={
                    b: min(fitting, failed - 1) for b, (fitting, failed) in failures.items() if fitting < failed
                },
                only=only,
                tolerance=tolerance,
                recheck=recheck,
            )

        def capacity_of(bucket: int) -> float | None:
            return result.capacity[bucket] if bucket < len(result.capacity) else None

        sizes: list[int | None] = [
            None if found is None else margin_of(found, found < uppers[b], capacity_of(b))
            for b, found in enumerate(result.found)
        ]
        # after the margin, too: a size that fits longer samples fits shorter ones (up to a bucket's own count),
        # but never to or above a size measured to fail for that bucket (its probes, its real steps)
        failed = self._failed_sizes(result.min_failing, failures, keep=only is not None and same_buckets)
        for bucket, failed_size in in_training.items():
            failed[bucket] = min(failed_size, failed.get(bucket, failed_size))
        best: int | None = None
        for bucket in sorted(range(buckets.count), key=lambda b: -buckets.largest[b]):
            size = sizes[bucket]
            if size is not None and best is not None and size < best:
                raised = below_failure(min(best, uppers[bucket]), failed.get(bucket))
                raised = carried_down(raised, result, bucket)  # not past what its own probes measured
                sizes[bucket] = size = size if raised is None else max(size, raised)
            if size is not None:
                best = size if best is None else max(best, size)
        if only is not None and previous is not None:
            sizes = [sizes[b] if b in only else previous[b] for b in range(buckets.count)]
        if result.unordered:
            shown = ", ".join(f"{b} (samples up to {buckets.largest[b]})" for b in sorted(result.unordered))
            self.probe_batches.warn_once(
                "bucket-order",
                f"search.batching: buckets: bucket {shown} measured more memory per sample than longer samples "
                "fit with: memory does not grow with sample_size here (a collate that pads two dimensions apart, "
                "images sized by their area?), so a longer bucket's fit does not size it and it keeps the size its "
                "own probes found. A sample_size that bounds the padded batch (max(height, width) ** 2) groups such "
                "samples by what they cost",
            )
        self.state.failed = failed
        return BucketOutcome(
            buckets,
            result,
            sizes,
            list(self.state.sizes) if same_buckets and regrouped_from is None else [],
            limited=only is not None,
            regrouped_from=regrouped_from,
        )

    def _fewer_steps(
        self,
        buckets: Buckets,
        traced: TracedBuckets,
        limit: int,
        max_val: int,
        margin_of: Callable[[int, bool, float | None], int],
        world: int,
    ) -> Buckets | None:
        """The same samples cut at the bounds that take the fewest steps per epoch at the sizes the prediction
        gives them (margin included), when that is fewer than the buckets' own; else None (they stay)."""
        if self.count < 2 or len(buckets.sizes) != buckets.count:
            return None

        def batch_for(longest: int) -> int:
            found = traced.largest(longest, max_val, limit)
            slope = traced.slope(longest)
            return margin_of(found, found < max_val, (limit - traced.fixed) / slope if slope > 0 else None)

        def steps(grouped: Buckets) -> int:
            uppers = _uppers(grouped, max_val, world, self.epoch_draws, self._drop_last)
            sizes = [min(batch_for(top), upper) for top, upper in zip(grouped.largest, uppers, strict=True)]
            return count_batches(grouped, sizes, world_size=world)

        bounds = choose_bounds_for_steps([s for sizes in buckets.sizes for s in sizes], self.count, batch_for, world)
        if tuple(bounds) == tuple(buckets.bounds):
            return None
        candidate = regroup(buckets, bounds)
        return candidate if steps(candidate) < steps(buckets) else None

    def _failed_sizes(
        self,
        measured: Sequence[int | None],
        real: Mapping[int, tuple[int, int]],
        *,
        keep: bool,
    ) -> dict[int, int]:
        """Per bucket, the smallest size measured to fail: by this search's probes, by real steps that ran
        out of memory and, in an ``oom`` re-tune (``keep``: the memory did not change), by earlier searches."""
        failed: dict[int, int] = dict(self.state.failed) if keep else {}
        found = {b: size for b, size in enumerate(measured) if size is not None}
        found.update({b: min(size, found.get(b, size)) for b, (_, size) in real.items()})
        for bucket, size in found.items():
            failed[bucket] = min(size, failed.get(bucket, size))
        return failed

    def cap_at_fastest(
        self,
        outcome: BucketOutcome,
        prober: Prober,
        *,
        tolerance: float,
        steps: int,
        warm: bool,
    ) -> None:
        """``objective: throughput``: cap every bucket's size at the fastest padded work per step (in place).

        Runs inside the probe session, after the search for what fits. The selection
        (:func:`~retune.search.throughput.choose_fastest`) times the reference bucket's worst batch, as the search
        probed it, reusing the search's timed trials in that bucket; ``warm`` starts it at the size it chose
        there last time. An ``oom`` re-tune of some buckets keeps the padded work found last time and times
        nothing. Trials it adds are appended to ``outcome.result.trials`` (their bucket is the reference).
        """
        sizes = outcome.sizes
        if any(s is None for s in sizes):
            return  # nothing fits a bucket: the search fails as it would with objective: largest
        fit = [int(s) for s in sizes if s is not None]
        buckets = outcome.buckets
        same = list(buckets.bounds) == self.state.bounds and len(self.state.sizes) == buckets.count
        if outcome.limited and same and self.state.reference is not None:
            padded = self.state.padded
            outcome.sizes = list(fit if padded is None else capped_sizes(fit, buckets.largest, padded))
            outcome.largest, outcome.padded = fit, padded
            outcome.reference, outcome.chosen = self.state.reference, self.state.chosen
            return
        reference = reference_bucket(buckets.largest, [len(m) for m in buckets.members])
        start = self.state.chosen if warm and same and self.state.reference == reference else None
        known = bucket_timings(outcome.result.trials, prober.step_times, reference)
        trials = outcome.result.trials

        timed_steps = selection_steps(steps)

        def time_trial(size: int) -> tuple[bool, list[float]]:
            # the worst batch once per step the trial runs (Prober.time raises its steps_per_trial while it runs)
            prober.arrange = lambda loader: with_index_order(
                loader, buckets.worst(reference, size) * prober.steps_per_trial, size
            )
            self.current_bucket = reference
            try:
                fits, seconds = prober.time(size, timed_steps)
            finally:
                self.current_bucket = None
            trials.append(BucketTrial(reference, size, fits, None))
            return fits, seconds

        with self.hook.paused():
            choice = choose_fastest(
                ThroughputPlan(
                    cap=fit[reference],
                    tolerance=tolerance,
                    start=start,
                    max_trials=selection_budget(len(trials), timed=bool(known)),
                ),
                known,
                time_trial,
            )
        capped = cap_at_fastest(fit, buckets.largest, reference, choice)
        outcome.sizes = list(capped.sizes)
        outcome.largest, outcome.padded = capped.largest, capped.padded
        outcome.reference, outcome.chosen = capped.reference, capped.chosen

    def apply(self, outcome: BucketOutcome) -> None:
        sizes = outcome.sizes
        assert all(s is not None for s in sizes)
        self.buckets = outcome.buckets
        self.state.bounds = list(outcome.buckets.bounds)
        self.state.sizes = [int(s) for s in sizes if s is not None]
        self.state.largest = list(outcome.largest)
        self.state.reference, self.state.chosen, self.state.padded = outcome.reference, outcome.chosen, outcome.padded
        if outcome.regrouped_from is not None:
            self.state.by_steps = True
        if outcome.result.memory is not None:
            self.state.memory = outcome.result.memory

    def epoch_started(self, trainer: Any) -> None:
        """At each epoch start: a loader over the user sampler's draws has a new number of batches each epoch,
        which Lightning counted when it built the loader; recount it for the epoch that starts."""
        if isinstance(self.sampler, DrawnBucketBatchSampler):
            compat.refresh_train_batches(trainer)
            compat.refresh_progress_bar(trainer)

    def mean_batch(self) -> float:
        """Samples per step on one rank, over an epoch of the loader in use (0 when not bucketed)."""
        if self.buckets is None or not self.state.sizes:
            return 0.0
        sampler = self.sampler
        if isinstance(sampler, DrawnBucketBatchSampler):
            return sampler.mean_batch()  # this epoch's draws
        world, drop_last = (sampler.world_size, sampler.drop_last) if sampler is not None else (self._world_size, False)
        return mean_batch(self.buckets, self.state.sizes, drop_last, world)

    # -- the data changed --------------------------------------------------------------------------

    def data_change(self, say: Any) -> DataChange | None:
        """Whether the train samples' sizes changed since the buckets were grouped, and what that asks for.

        Checks the dataset of the loader Lightning trains on now (the same object changed in place, or a
        new one the hook built) by its fingerprint (:class:`~retune.probing.sample_sizes.Fingerprint`);
        a changed fingerprint rescans it and regroups the samples. None when nothing changed, or when
        the loader is not bucketed now (the next search groups it anyway).
        """
        loader = self._source
        if loader is None or self.buckets is None or not self.state.sizes or self.why_not(loader) is not None:
            return None
        cache = self.probe_batches.cache
        scans = cache.scans
        # bounds cut by steps stay: the next predicted search re-cuts them for the new sizes if that takes fewer
        grouped = self.prepare(loader, say, bounds=self.state.bounds if self.state.by_steps else None)
        before = self.buckets
        # a checkpoint's bounds on data that outgrew them (restore() puts longer samples in the last bucket)
        outgrown = any(top > bound for top, bound in zip(before.largest, before.bounds, strict=True))
        if grouped is None or (cache.scans == scans and not outgrown):
            return None  # the fingerprint matched (no scan ran): the sizes and the plan are the ones in force
        if grouped.bounds == before.bounds and grouped.members == before.members:
            return None
        # a sample only ever moves to a bucket whose sizes were searched for samples as long: sizes still fit
        fits = grouped.bounds == before.bounds and all(
            new <= old for new, old in zip(grouped.largest, before.largest, strict=True)
        )
        return DataChange(grouped, search=not fits, largest_before=before.largest)

    def regroup(self, change: DataChange) -> None:
        """Train the regrouped samples at the sizes in force (a change that needs no search); the caller
        reloads the train loader."""
        self.buckets = change.buckets


@dataclass(frozen=True)
class DataChange:
    """The train samples' sizes changed since their buckets were grouped (:meth:`TrainBuckets.data_change`)."""

    buckets: Buckets
    """The samples grouped anew from the rescan."""
    search: bool
    """The buckets' sizes must be searched again: a bucket's samples got longer (or the buckets moved)."""
    largest_before: tuple[int, ...]

    def describe(self) -> str:
        """``longest 64 -> 128``: each bucket's longest sample before and after, for the log."""
        before = ", ".join(str(s) for s in self.largest_before)
        after = ", ".join(str(s) for s in self.buckets.largest)
        return f"the buckets' longest samples {before} -> {after}"


def _uppers(buckets: Buckets, max_val: int, world: int, draws: int | None = None, drop_last: bool = False) -> list[int]:
    """Each bucket's largest possible batch on one rank: its share of the samples, at most ``max_val``.

    With a sampler that chooses what trains, at most its ``draws`` per epoch, too: a bucket holds at most
    that many of an epoch's draws (rank zero's, dealt out across the ranks), so a larger size could never
    fill a step; searching it would only cost probes, and a size no epoch fills would make ``drop_last`` drop
    the longest samples' bucket whole. (Its members still cap it: a probe's worst batch is distinct samples.)
    With ``drop_last`` every step holds the full size on every rank, so the share rounds down: 71 samples on 2
    ranks at 36 each made no full step, and all 71 moved up to the longest samples' bucket, one at a time.

    >>> buckets = Buckets((10, 50), (tuple(range(91)), (91, 92)), (10, 50))
    >>> _uppers(buckets, 64, 1), _uppers(buckets, 64, 2), _uppers(buckets, 64, 1, draws=20)
    ([64, 2], [46, 1], [20, 2])
    >>> _uppers(buckets, 64, 2, drop_last=True)
    [45, 1]
    """

    def share(members: int) -> int:
        held = members if draws is None else min(members, draws)
        return held // world if drop_last else -(-held // world)

    return [max(1, min(max_val, share(len(members)))) for members in buckets.members]


def predicted_start(
    traced: TracedBuckets,
    buckets: Buckets,
    uppers: Sequence[int],
    limit: float,
    previous: Sequence[int | None] | None,
    known_fail: Mapping[int, int],
) -> list[int | None] | None:
    """Where a predicted search starts each bucket: at its predicted size. An ``oom`` re-search (``known_fail``:
    the buckets whose real steps failed, and at what size) starts only those there, below the size that failed,
    and keeps ``previous`` for the others; without ``previous`` it cannot (None: start as without predict).

    >>> traced = TracedBuckets(100.0, ((10, 10.0), (100, 100.0)))
    >>> buckets = Buckets((10, 100), ((0, 1), (2,)), (10, 100))
    >>> predicted_start(traced, buckets, [64, 64], 2100.0, None, {})            # (2100 - 100) / slope
    [64, 20]
    >>> predicted_start(traced, buckets, [64, 64], 2100.0, [40, 30], {1: 12})  # below the failed 12
    [40, 11]
    >>> predicted_start(traced, buckets, [64, 64], 2100.0, None, {1: 12}) is None
    True
    """
    predicted = [traced.largest(top, uppers[b], limit) for b, top in enumerate(buckets.largest)]
    starts: list[int | None] = list(predicted)
    if not known_fail:
        return starts
    if previous is None:
        return None
    for bucket in range(buckets.count):
        starts[bucket] = (
            max(1, min(predicted[bucket], known_fail[bucket] - 1)) if bucket in known_fail else previous[bucket]
        )
    return starts


class _Broadcast:
    """Rank zero's object on every rank, through the trainer's strategy (a class, not a closure, so that a
    sampler holding it can be inspected and the trainer is named in one place)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def __call__(self, obj: Any) -> Any:
        return compat.broadcast_object(self.trainer, obj)


def _drops_last(loader: Any) -> bool:
    """Whether ``loader`` drops its last partial batch: its batch sampler's ``drop_last`` (a loader given
    ``batch_sampler=BatchSampler(..., drop_last=True)`` says ``drop_last=False`` itself), else its own."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    return bool(getattr(batch_sampler, "drop_last", getattr(loader, "drop_last", False)))


def _indices_fit(buckets: Buckets, loader: DataLoader[Any]) -> bool:
    """Whether the buckets hold every sample ``loader``'s sampler can draw (:func:`candidate_indices`) and no index
    past its dataset's end: a rebuilt dataset may be shorter, or longer (samples no bucket holds).

    >>> buckets = Buckets((10,), ((0, 1, 2),), (10,))
    >>> _indices_fit(buckets, DataLoader(range(3))), _indices_fit(buckets, DataLoader(range(4)))
    (True, False)
    """
    length = compat.length_of(loader.dataset)
    if length is None:
        return True
    if any(members and max(members) >= length for members in buckets.members):
        return False
    candidates = candidate_indices(getattr(loader.batch_sampler, "sampler", None), length)
    if isinstance(candidates, range) and candidates == range(length):  # every position: count them (all distinct)
        return sum(len(members) for members in buckets.members) >= length
    held = bucket_of_index(buckets)
    return all(index in held for index in candidates)


def _base_seeds_ahead(loader: DataLoader[Any], trainer: Any) -> Callable[[], int]:
    """How many base seeds ``loader``'s iterators draw from torch's global RNG before its sampler is iterated for
    the epoch (:func:`retune.compat.iterators_ahead`): none with a ``generator`` of its own, and none once an
    iterator with persistent workers exists (it is reused; only the first draws). Holds the loader weakly (the
    loader holds the sampler that asks)."""
    ref = weakref.ref(loader)

    def ahead() -> int:
        live = ref()
        if live is None or live.generator is not None:
            return 0
        count = compat.iterators_ahead(trainer)
        if live.persistent_workers and live.num_workers > 0:
            return 0 if live._iterator is not None else min(count, 1)
        return count

    return ahead


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


__all__ = [
    "BucketOutcome",
    "BucketState",
    "DataChange",
    "PredictBuckets",
    "TracedBuckets",
    "predicted_start",
    "TrainBuckets",
    "draws_source",
    "sampler_that_chooses",
]
