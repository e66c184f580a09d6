"""Buckets over the samples the user's sampler draws: the sampler decides what trains, buckets only group it.

A sampler that chooses which samples train and how often — a ``WeightedRandomSampler``, a
``RandomSampler`` with replacement or another ``num_samples``, a ``SubsetRandomSampler``, a subset or
curriculum sampler of the user's own — is part of the training recipe: the label share of a weighted
sampler, the number of samples an epoch trains, the samples a subset leaves out. Buckets must not
replace it with every sample once. When its draws can be known before the epoch (a finite sampler with
a ``__len__``), :class:`DrawnBucketBatchSampler` iterates the user's own sampler once at the epoch's
start — its own generator, or torch's, advancing exactly as the user's loader would advance it, after
its ``set_epoch`` — and cuts those draws into each bucket's batches (:func:`drawn_batches`): the
epoch trains the same indices, each as often as drawn, only grouped by size.

Under several processes, Lightning would wrap such a sampler in a ``DistributedSamplerWrapper``: every
rank iterates the whole sampler and trains its share of that one pass. Buckets do the same with one
epoch for all ranks: every rank iterates its sampler (so its generator advances as under Lightning's
wrapper), rank zero's draws are broadcast, every rank groups them identically, and each step's group
of ``size x world_size`` draws of one bucket is dealt out one share per rank (:func:`drawn_batches`
with ``world_size``): across the ranks the epoch trains exactly rank zero's draws, every rank at the
same bucket at every step. A sampler whose draws cannot be known before the epoch (no ``__len__``),
one that shards itself across ranks other than as the run's own sharding (a ``DistributedSampler``
subclass, or other replicas than the run's: each rank draws only its own share), or any choosing
sampler when Lightning does not shard it (``use_distributed_sampler=False``: each rank trains its own
draws) keeps the loader as the user built it (``batching: fixed``) with one warning that names it
(:func:`why_draws_unknown`). In one process a sharding sampler's draws are simply the epoch's.

Example:
    >>> from retune.buckets.plan import Buckets
    >>> buckets = Buckets(bounds=(10, 100), members=((0, 1, 2), (3,)), largest=(10, 100))
    >>> plan = drawn_batches(buckets, [2, 1], [3, 0, 0, 1, 3, 2])
    >>> [(b.bucket, b.indices) for b in plan]
    [(1, (3,)), (0, (0, 0)), (0, (1, 2)), (1, (3,))]
    >>> [[(b.bucket, b.indices) for b in drawn_batches(buckets, [2, 1], [3, 0, 0, 1, 3, 2], world_size=2, rank=r)]
    ...  for r in (0, 1)]
    [[(1, (3,)), (0, (0, 0))], [(1, (3,)), (0, (1, 2))]]
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from retune.buckets.loader import BucketBatchSampler
from retune.buckets.plan import Buckets, PlannedBatch
from retune.errors import RetuneError
from retune.random_state import keep_run_draw, sampler_generators


def bucket_of_index(buckets: Buckets) -> dict[int, int]:
    """Dataset index -> its bucket, for every sample the buckets hold.

    >>> bucket_of_index(Buckets((10, 100), ((0, 2), (1,)), (10, 100)))
    {0: 0, 2: 0, 1: 1}
    """
    return {index: bucket for bucket, members in enumerate(buckets.members) for index in members}


@dataclass(frozen=True)
class DrawnStep:
    """One step of every rank: the bucket it comes from and all the ranks' draws (each rank's share: :func:`deal`)."""

    bucket: int
    group: tuple[int, ...]


def drawn_batches(
    buckets: Buckets,
    batch_sizes: Sequence[int],
    draws: Sequence[int],
    *,
    drop_last: bool = False,
    where: Mapping[int, int] | None = None,
    world_size: int = 1,
    rank: int = 0,
) -> list[PlannedBatch]:
    """This rank's batches of one epoch of exactly ``draws`` (dataset indices, repeats included), grouped by bucket:
    its share (:func:`deal`) of every step of :func:`drawn_steps`.

    >>> buckets = Buckets((10,), ((0, 1),), (10,))
    >>> [b.indices for b in drawn_batches(buckets, [2], [1, 1, 0], drop_last=True)]
    [(1, 1)]
    >>> [b.indices for b in drawn_batches(buckets, [2], [1, 1, 0, 0, 1], world_size=2, rank=1)]
    [(0,), (1,)]
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size} is not valid")
    steps = drawn_steps(buckets, batch_sizes, draws, drop_last=drop_last, where=where, world_size=world_size)
    return [PlannedBatch(step.bucket, deal(step.group, world_size, rank)) for step in steps]


def drawn_steps(
    buckets: Buckets,
    batch_sizes: Sequence[int],
    draws: Sequence[int],
    *,
    drop_last: bool = False,
    where: Mapping[int, int] | None = None,
    world_size: int = 1,
) -> list[DrawnStep]:
    """Every step of one epoch of exactly ``draws`` (dataset indices, repeats included), grouped by bucket.

    Each bucket's draws keep the order the sampler drew them in and are cut into groups of
    ``size x world_size``, one step each; steps run in the order of their first sample's draw, so the
    sampler's randomness (or a curriculum's order) decides the order of the epoch, not a second shuffle.
    Each rank takes its contiguous share of a step's group (:func:`deal`: sizes differ by one at most, never
    above the bucket's size), so across the ranks every draw trains once and every rank's step comes from
    the same bucket. A bucket's last, partial group trains smaller. With ``drop_last`` it moves up instead, to
    the next bucket of longer samples (whose size fits them: it was searched for longer ones), and joins its
    draws; only the longest samples' bucket drops its last partial group, so an epoch drops fewer draws than
    that bucket's ``size x world_size`` and every step holds ``size`` draws per rank (the rule of every
    bucketed loader: :func:`~retune.buckets.plan.epoch_batches`). Without ``drop_last``, under several
    processes a last group with fewer draws than ranks cannot give every rank a sample: it takes draws from
    the bucket's previous group (a size of 2 or more), else it moves to the next bucket of longer samples;
    in the longest samples' bucket it takes draws from a step of shorter samples that can spare them, and
    only when no step can (every step holds one draw per rank) is it padded with that bucket's own draws,
    as ``DistributedSampler`` pads. ``where`` is :func:`bucket_of_index` of ``buckets`` (computed when not given).

    >>> buckets = Buckets((10, 50), ((0, 1), (2,)), (10, 50))
    >>> [(s.bucket, s.group) for s in drawn_steps(buckets, [2, 2], [2, 0, 2], world_size=2)]  # 0 moves up
    [(1, (2, 0, 2))]
    >>> [(s.bucket, s.group) for s in drawn_steps(buckets, [2, 1], [0, 1, 1, 0, 2], world_size=2)]  # 0 fills up
    [(0, (0, 1, 1)), (1, (0, 2))]
    >>> [(s.bucket, s.group) for s in drawn_steps(buckets, [2, 2], [0, 2, 2, 1, 2, 0], drop_last=True)]  # 0 moves up
    [(0, (0, 1)), (1, (2, 2)), (1, (2, 0))]
    """
    if len(batch_sizes) != buckets.count:
        raise ValueError(f"{buckets.count} buckets but {len(batch_sizes)} batch sizes")
    if world_size < 1:
        raise ValueError(f"world size {world_size} is not valid")
    where = bucket_of_index(buckets) if where is None else where
    drawn: list[list[tuple[int, int]]] = [[] for _ in range(buckets.count)]
    for position, index in enumerate(draws):
        bucket = where.get(index)
        if bucket is None:
            raise ValueError(f"index {index!r} (draw {position}) is not a sample of the buckets")
        drawn[bucket].append((position, index))
    steps: list[tuple[int, int, list[tuple[int, int]]]] = []
    carried: list[tuple[int, int]] = []  # shorter samples' partial group moved up (drop_last, or too few for the ranks)
    longest = max(range(buckets.count), key=lambda b: (buckets.largest[b], b)) if buckets.count else -1
    for bucket in sorted(range(buckets.count), key=lambda b: (buckets.largest[b], b)):
        size = batch_sizes[bucket]
        if size < 1:
            raise ValueError(f"bucket {bucket} has batch size {size}; sizes must be >= 1")
        picks = sorted(drawn[bucket] + carried)
        carried = []
        step = size * world_size
        groups = [picks[start : start + step] for start in range(0, len(picks), step)]
        if drop_last and groups and len(groups[-1]) < step:  # a partial group: up a bucket, dropped from the last
            partial = groups.pop()
            carried = partial if bucket != longest else []
        elif groups and len(groups[-1]) < world_size:  # not a sample for every rank (several processes only)
            last, missing = groups[-1], world_size - len(groups[-1])
            if len(groups) > 1 and size > 1:  # the previous group keeps size - 1 or more per rank
                groups[-2], groups[-1] = groups[-2][:-missing], groups[-2][-missing:] + last
            elif bucket != longest:
                carried = groups.pop()
            else:
                groups[-1] = last + _spare(steps, missing, world_size, picks)
        steps.extend((group[0][0], bucket, group) for group in groups)
    ordered = sorted((min(group), bucket, group) for _, bucket, group in steps)
    return [DrawnStep(bucket, tuple(index for _, index in sorted(group))) for _, bucket, group in ordered]


def _spare(
    steps: list[tuple[int, int, list[tuple[int, int]]]], missing: int, world_size: int, own: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """``missing`` draws for the longest samples' last step: the latest draws of the step of shorter samples that
    can best spare them (it keeps a sample per rank; shorter samples fit where longer ones do), else repeats of
    that bucket's ``own`` draws (as ``DistributedSampler`` pads)."""
    donors = [s for s in range(len(steps)) if len(steps[s][2]) - missing >= world_size]
    if not donors:
        return [own[i % len(own)] for i in range(missing)]
    donor = max(donors, key=lambda s: (len(steps[s][2]), steps[s][0]))
    first, bucket, group = steps[donor]
    steps[donor] = (first, bucket, group[:-missing])
    return group[-missing:]


def deal(group: Sequence[int], world_size: int, rank: int) -> tuple[int, ...]:
    """``rank``'s contiguous share of one step's ``group``: the first ``len % world_size`` ranks take one more.

    >>> [deal([4, 5, 6], 2, r) for r in (0, 1)]
    [(4, 5), (6,)]
    """
    share, extra = divmod(len(group), world_size)
    start = rank * share + min(rank, extra)
    return tuple(group[start : start + share + (1 if rank < extra else 0)])


def shards_itself(sampler: Any) -> bool:
    """Whether ``sampler`` draws only this rank's share of an epoch (a ``DistributedSampler`` or one like it).

    >>> from torch.utils.data import DistributedSampler
    >>> shards_itself(DistributedSampler(range(4), num_replicas=2, rank=0)), shards_itself(range(4))
    (True, False)
    """
    if isinstance(sampler, DistributedSampler):
        return True
    return hasattr(sampler, "num_replicas") and hasattr(sampler, "rank")


class EveryRankDraws:
    """One epoch of a run's own ``DistributedSampler`` over all its ranks, as one sampler (one pass: every draw).

    A ``DistributedSampler(drop_last=True)`` over a dataset that the ranks do not divide trims the epoch's
    order to a multiple of the ranks: ``len(dataset) % num_replicas`` samples, other ones each epoch when it
    shuffles, do not train. Buckets that replaced it with every sample once trained those too. Instead its
    draws are grouped as a choosing sampler's are (:class:`DrawnBucketBatchSampler`): this pass is its epoch
    order across the ranks, read from a copy per rank (the sampler's own ``__iter__``: its seed, epoch and
    shuffle; no generator of the run advances), so the ranks together train exactly the samples it keeps.

    >>> from torch.utils.data import DistributedSampler
    >>> sampler = DistributedSampler(range(5), num_replicas=2, rank=0, shuffle=False, drop_last=True)
    >>> list(EveryRankDraws(sampler)), len(EveryRankDraws(sampler))  # sample 4 is trimmed
    ([0, 1, 2, 3], 4)
    """

    def __init__(self, sampler: DistributedSampler[Any]) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return int(self.sampler.num_samples) * int(self.sampler.num_replicas)

    def __iter__(self) -> Iterator[int]:
        shares = []
        for rank in range(self.sampler.num_replicas):
            share = copy.copy(self.sampler)  # the same seed, epoch and shuffle; only the rank differs
            share.rank = rank
            shares.append(list(share))
        for step in zip(*shares, strict=True):  # rank r's i-th draw is the epoch order's (i * ranks + r)-th
            yield from (int(index) for index in step)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


def trims_across_ranks(sampler: Any, length: int | None) -> bool:
    """Whether ``sampler``, a ``DistributedSampler``, leaves samples of a dataset of ``length`` out of every epoch
    (``drop_last=True`` and a length its replicas do not divide): see :class:`EveryRankDraws`.

    >>> from torch.utils.data import DistributedSampler
    >>> trims_across_ranks(DistributedSampler(range(5), num_replicas=2, rank=0, drop_last=True), 5)
    True
    >>> trims_across_ranks(DistributedSampler(range(4), num_replicas=2, rank=0, drop_last=True), 4)
    False
    """
    if not isinstance(sampler, DistributedSampler) or not sampler.drop_last or length is None:
        return False
    return length % int(sampler.num_replicas) != 0


def why_draws_unknown(sampler: Any, world_size: int, *, sharded_by_lightning: bool = True) -> str | None:
    """Why the draws of a sampler that chooses what trains cannot be bucketed, or None when they can.

    Under ``world_size`` processes they can when Lightning would shard the sampler's one pass across the
    ranks (``sharded_by_lightning``: ``use_distributed_sampler``, the default) and the sampler does not shard
    itself: then rank zero's draws are every rank's (:class:`DrawnBucketBatchSampler`).
    """
    name = type(sampler).__name__
    if world_size > 1 and shards_itself(sampler):
        return (
            f"its sampler ({name}) chooses which samples train and shards them itself across the {world_size} "
            "processes, so each rank draws only its own share while buckets need every rank to agree on each "
            "step's bucket"
        )
    if world_size > 1 and not sharded_by_lightning:
        return (
            f"its sampler ({name}) chooses which samples train and Lightning does not share it out across the "
            f"{world_size} processes (use_distributed_sampler=False): each rank trains its own draws, while buckets "
            "need every rank to agree on each step's bucket"
        )
    try:
        length = len(sampler)
    except TypeError:
        length = None
    if length is None or not isinstance(length, int):
        return (
            f"its sampler ({name}) chooses which samples train and has no __len__, so the samples it draws in an "
            "epoch cannot be known before the epoch"
        )
    return None


def draw_epoch(sampler: Any, epoch: int) -> list[int]:
    """The dataset indices ``sampler`` draws for ``epoch``, in its order: its ``set_epoch`` (when it has one),
    then one pass over it, exactly as a ``DataLoader`` over it would make (its generator advances once).

    A pass longer than ``len(sampler)`` stops with a :class:`~retune.errors.RetuneError`: an endless sampler
    would otherwise never let the epoch start.
    """
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    expected = len(sampler)
    draws: list[int] = []
    for index in sampler:
        if len(draws) >= expected:
            raise RetuneError(
                f"search.batching: buckets draws each epoch's samples from the train sampler "
                f"({type(sampler).__name__}) before the epoch, but it yielded more indices than its __len__ "
                f"({expected}); make __len__ the number of indices one pass yields, or use `batching: fixed`"
            )
        draws.append(_position(index, sampler))
    return draws


def _position(index: Any, sampler: Any) -> int:
    try:
        return int(index)
    except (TypeError, ValueError):
        raise RetuneError(
            f"search.batching: buckets groups dataset positions, but the train sampler ({type(sampler).__name__}) "
            f"drew {index!r}; use `batching: fixed` for a sampler whose keys are not positions"
        ) from None


@dataclass(frozen=True)
class StreamAfter:
    """torch's global random stream where an epoch's pass over the user's sampler began (after the loader's base
    seed draw) and where it ended: :meth:`DrawnBucketBatchSampler.__iter__` continues from ``after``."""

    start: torch.Tensor
    after: torch.Tensor


ShareDraws = Callable[[Any], Any]
"""``share(obj)``: rank zero's ``obj`` on every rank (a collective: every rank calls it at the same point)."""


class DrawnBucketBatchSampler(BucketBatchSampler):
    """This rank's bucketed batches of exactly what the user's sampler draws each epoch.

    Unlike :class:`~retune.buckets.loader.BucketBatchSampler` (every sample once, retune's own seeded
    shuffle), the epoch's plan is :func:`drawn_batches` of one pass over ``draws_from``, the user's sampler
    itself, made once per epoch when the plan is first needed (Lightning asks for the loader's length at
    the epoch's start, on every rank). Its number of batches can change from epoch to epoch: the fit loop's
    count is refreshed at each epoch start (:meth:`retune.buckets.train_buckets.TrainBuckets.epoch_started`).
    Under several processes (``world_size``), every rank draws from its own sampler, then ``share`` gives
    every rank rank zero's draws; each rank takes its share of every step. A fit resumed mid-epoch
    (``start``) skips as many batches as were trained before the checkpoint, so the epoch keeps its length;
    the draws themselves are a new pass of the user's sampler, whose generator state no checkpoint holds.
    One rebuilt within an epoch whose draws were made (``drawn``: :meth:`drawn_for` of the sampler it replaces)
    groups those draws again instead of passing over the user's sampler a second time: Lightning's reload at an
    epoch start draws the epoch when it asks the length, and a search or a regroup at that epoch start rebuilds
    the loader again; a second pass there would train the user's next pass and skip this one.
    """

    def __init__(
        self,
        buckets: Buckets,
        batch_sizes: list[int],
        *,
        draws_from: Any,
        epoch: int = 0,
        drop_last: bool = False,
        start: int = 0,
        world_size: int = 1,
        rank: int = 0,
        share: ShareDraws | None = None,
        drawn: tuple[int, list[int], StreamAfter | None] | None = None,
        base_seeds_ahead: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(
            buckets,
            batch_sizes,
            seed=0,
            epoch=epoch,
            shuffle=False,
            drop_last=drop_last,
            world_size=world_size,
            rank=rank,
            start=start,
        )
        if world_size > 1 and share is None:
            raise ValueError("several processes draw one epoch through `share` (rank zero's draws on every rank)")
        self.draws_from = draws_from
        self.share = share
        self.draws: list[int] = []
        """The indices the user's sampler drew for the epoch of :attr:`plan` (rank zero's, on every rank;
        empty until it is made)."""
        self._given = drawn
        """``(epoch, draws, stream)`` made by the sampler this one replaced, used for that epoch instead of a new
        pass."""
        self.base_seeds_ahead = base_seeds_ahead
        """How many base seeds the loader's iterators draw from torch's global RNG, from now until the sampler is
        iterated for the epoch (a ``DataLoader`` without a ``generator`` draws one whenever it makes an iterator)."""
        self._stream: StreamAfter | None = None
        self._where = bucket_of_index(buckets)
        self._trained = 0
        """Samples the epoch's steps train across all ranks (rank zero's draws, plus any padding)."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        set_epoch = getattr(self.draws_from, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)  # Lightning calls it on the user's loader's sampler: it still gets it

    def drawn_for(self, epoch: int, length: int | None) -> tuple[int, list[int], StreamAfter | None] | None:
        """``(epoch, draws, stream)`` where this sampler drew ``epoch`` already and every draw is a position of a
        dataset of ``length`` samples (None: not known), for the sampler that replaces it within that epoch (with
        the global random stream its loader's iterator was to continue: :meth:`__iter__`); else None. The same
        on every rank: the draws are rank zero's, and every rank asks its length at the same points."""
        if self._plan is None or self._plan_epoch != epoch:
            return None
        if length is not None and any(index >= length for index in self.draws):
            return None
        stream, self._stream = self._stream, None
        return epoch, list(self.draws), stream

    @property
    def plan(self) -> list[PlannedBatch]:
        """This epoch's batches for this rank (the user's sampler is iterated once per epoch, here)."""
        if self._plan is None or self._plan_epoch != self.epoch:
            epoch = self.epoch
            given, self._given = self._given, None
            if given is not None and given[0] == epoch:
                self.draws, self._stream = given[1], given[2]
            else:
                self.draws = self._draw(epoch)
            try:
                steps = drawn_steps(
                    self.buckets,
                    self.batch_sizes,
                    self.draws,
                    drop_last=self.drop_last,
                    where=self._where,
                    world_size=self.world_size,
                )
            except ValueError as error:
                raise RetuneError(
                    f"search.batching: buckets cannot group what the train sampler ({type(self.draws_from).__name__}) "
                    f"drew at epoch {epoch}: {error}, so its size was never scanned; use `batching: fixed`"
                ) from None
            self._plan = [PlannedBatch(step.bucket, deal(step.group, self.world_size, self.rank)) for step in steps]
            self._trained = sum(len(step.group) for step in steps)
            self._plan_epoch = epoch
        return self._plan

    def _draw(self, epoch: int) -> list[int]:
        """The epoch's draws: this process's pass over the user's sampler, or rank zero's under several.

        Every rank passes over its own sampler (its generator advances as under Lightning's
        ``DistributedSamplerWrapper``, which iterates the whole sampler on every rank) and every rank
        reaches the broadcast, even when its own pass failed, so a refusal cannot leave a rank waiting.
        """
        failed: RetuneError | None = None
        try:
            draws, self._stream = self._pass(epoch)
        except RetuneError as error:
            failed, draws = error, []
        else:
            # the epoch's draw is the run's: Lightning may ask the length while retune rebuilds the loader, inside
            # a block that puts the random streams back (rolled back, the next epoch would draw these again)
            keep_run_draw(sampler_generators(self.draws_from))
        if self.world_size > 1:
            assert self.share is not None
            shared = self.share(str(failed) if failed is not None else draws)
            if isinstance(shared, str):
                raise RetuneError(f"rank 0: {shared}")
            draws = [int(i) for i in shared]
        if failed is not None:
            raise failed
        return draws

    def _pass(self, epoch: int) -> tuple[list[int], StreamAfter | None]:
        """One pass over the user's sampler, from where a plain loader's pass starts in torch's global random
        stream: after the draws of its workers' base seed by the iterators the loop makes before the epoch's
        first batch (``_BaseDataLoaderIter``). Retune's pass runs earlier, when Lightning asks the length, so the
        pass runs after as many such draws, the stream is put back, and :meth:`__iter__` continues it from after
        the pass once the iterators have drawn their seeds. A sampler on torch's RNG (a ``WeightedRandomSampler``
        without a ``generator``) then draws what a plain run draws."""
        ahead = self.base_seeds_ahead() if self.base_seeds_ahead is not None else 0
        if ahead <= 0:
            return draw_epoch(self.draws_from, epoch), None
        before = torch.get_rng_state()
        try:
            for _ in range(ahead):  # each iterator's base seed, as DataLoader draws it
                torch.empty((), dtype=torch.int64).random_()
            start = torch.get_rng_state()
            draws = draw_epoch(self.draws_from, epoch)
            return draws, StreamAfter(start, torch.get_rng_state())
        finally:
            torch.set_rng_state(before)

    def __iter__(self) -> Iterator[list[int]]:
        stream, self._stream = self._stream, None
        # runs at the iterator's first batch, after it drew its base seed: where it drew it where retune's pass
        # assumed, the stream goes on from after that pass (else it stays: something else drew in between)
        if stream is not None and torch.equal(torch.get_rng_state(), stream.start):
            torch.set_rng_state(stream.after)
        yield from super().__iter__()

    def __len__(self) -> int:
        return len(self.plan)

    def mean_batch(self) -> float:
        """Samples per step and rank over this epoch's plan, the same on every rank (0 for an empty epoch)."""
        plan = self.plan
        return self._trained / (len(plan) * self.world_size) if plan else 0.0


__all__ = [
    "DrawnBucketBatchSampler",
    "DrawnStep",
    "EveryRankDraws",
    "bucket_of_index",
    "deal",
    "draw_epoch",
    "drawn_batches",
    "drawn_steps",
    "shards_itself",
    "trims_across_ranks",
    "why_draws_unknown",
]
