"""Length buckets for ``search.batching: buckets``: which samples go together, and each epoch's batches.

With pad-to-longest collation a batch costs memory in proportion to ``batch size x its longest
sample``, so one batch size for the whole dataset must fit the rarest, longest samples. Grouping
samples of similar size into buckets, each with its own batch size, lets the short majority train
in large batches while the long tail stays safe. This module is the pure part (no Lightning, no
torch): bucket boundaries from the distribution of sample sizes, and the batches of an epoch for one
rank, seeded and reproducible.

Boundaries minimise the padded work of an epoch, ``sum(samples in bucket x largest sample in
bucket)``: with a batch size per bucket chosen so a batch fills the memory budget, memory per batch is
about ``batch x largest`` and the number of steps an epoch takes is proportional to that sum. An
exact dynamic programme over the distinct sizes finds them (sizes are first merged into at most
:data:`MAX_LEVELS` quantile levels, so millions of distinct image sizes cost no more than text).

Under DDP every rank builds the same global plan from the same seed and takes its share, so every
rank runs the same number of batches, the ranks' batches at a given step come from the same bucket,
and every sample is trained once per epoch across ranks (the last, partial group of a bucket is
padded with the bucket's own samples, as ``DistributedSampler`` pads; with ``drop_last`` it moves up to
the bucket of longer samples, and only the longest samples' bucket drops its partial group).

Example:
    >>> sizes = [16] * 90 + [512] * 10
    >>> plan = plan_buckets(list(range(100)), sizes, count=2)
    >>> plan.largest, [len(m) for m in plan.members]
    ((16, 512), [90, 10])
    >>> batches = epoch_batches(plan, [30, 2], seed=0, epoch=0)
    >>> len(batches), sorted({len(b.indices) for b in batches})
    (8, [2, 30])
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MAX_LEVELS = 512
"""Distinct sizes the boundary search considers (more are merged into quantile levels)."""


@dataclass(frozen=True)
class Buckets:
    """Samples grouped by size. Bucket 0 holds the smallest samples."""

    bounds: tuple[int, ...]
    """The largest sample size each bucket may hold (inclusive), ascending."""
    members: tuple[tuple[int, ...], ...]
    """Each bucket's dataset indices, largest sample first (ties: lower index first)."""
    largest: tuple[int, ...]
    """Each bucket's largest sample size: its worst batch is made of its largest samples."""
    sizes: tuple[tuple[int, ...], ...] = field(default=(), compare=False)
    """Each member's sample size, as ``members`` (empty where the buckets were built by hand): what
    :func:`regroup` needs to cut the same samples at other bounds."""

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def samples(self) -> int:
        return sum(len(m) for m in self.members)

    def worst(self, bucket: int, size: int) -> list[int]:
        """The ``size`` largest samples of ``bucket`` (a probe batch that is that bucket's worst batch)."""
        return list(self.members[bucket][:size])

    def bucket_of(self, sample_size: int) -> int:
        """The bucket a sample of this size belongs to (sizes above the last bound go to the last bucket)."""
        for bucket, bound in enumerate(self.bounds):
            if sample_size <= bound:
                return bucket
        return len(self.bounds) - 1


def choose_bounds(sizes: Sequence[int], count: int) -> tuple[int, ...]:
    """Upper bounds of at most ``count`` buckets that minimise ``sum(samples x largest)`` over buckets.

    >>> choose_bounds([10] * 50 + [20] * 50 + [400] * 2, 2)
    (20, 400)
    >>> choose_bounds([7, 7, 7], 4)
    (7,)
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if not sizes:
        return ()
    levels, weights = _levels(sorted(sizes))
    k = min(count, len(levels))
    n = len(levels)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # cost[j][b]: least padded work covering levels[0..b] with j + 1 buckets; cut[j][b]: where the last one starts
    cost = [[inf] * n for _ in range(k)]
    cut = [[0] * n for _ in range(k)]
    for b in range(n):
        cost[0][b] = prefix[b + 1] * levels[b]
    for j in range(1, k):
        row, prev = cost[j], cost[j - 1]
        for b in range(j, n):
            best, arg = inf, j
            top = levels[b]
            for a in range(j, b + 1):  # the last bucket covers levels[a..b]
                value = prev[a - 1] + (prefix[b + 1] - prefix[a]) * top
                if value < best:
                    best, arg = value, a
            row[b], cut[j][b] = best, arg
    bounds: list[int] = []
    b = n - 1
    for j in range(k - 1, -1, -1):
        bounds.append(levels[b])
        if j == 0:
            break
        b = cut[j][b] - 1
    return tuple(sorted(set(bounds)))


MAX_STEP_LEVELS = 128
"""Distinct sizes :func:`choose_bounds_for_steps` considers: it runs at every predicted search, so it merges
more than :func:`choose_bounds` does (quantile levels; a boundary can only fall between two of them)."""


def choose_bounds_for_steps(
    sizes: Sequence[int],
    count: int,
    batch_for: Callable[[int], int],
    world_size: int = 1,
) -> tuple[int, ...]:
    """Upper bounds of at most ``count`` buckets that minimise the steps of an epoch, where a bucket whose
    largest sample has size ``s`` trains ``batch_for(s)`` samples per rank at each step.

    :func:`choose_bounds` minimises padded work, which counts steps only where batches are large: a batch
    of the long tail holds one or two samples, and whether its longest sample lets two fit or only one
    halves or doubles its steps. With a memory model (``search.predict``: the traced memory per sample as
    a function of the length) the batch each bound allows is known, and the same dynamic programme over the
    distinct sizes minimises ``sum(ceil(samples per rank / batch))`` instead; ties go to less padded work.

    >>> sizes = [20] * 1000 + list(range(400, 520))   # a short majority and a long tail
    >>> def batch(longest): return 1000 // longest    # memory: one sample of length s costs s
    >>> choose_bounds(sizes, 3)                        # padded work: the tail cut in its middle, 110 steps
    (20, 459, 519)
    >>> choose_bounds_for_steps(sizes, 3, batch)       # steps: cut where 2 samples still fit, 90 steps
    (20, 499, 519)
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if not sizes:
        return ()
    levels, weights = _levels(sorted(sizes), MAX_STEP_LEVELS)
    k = min(count, len(levels))
    n = len(levels)
    world = max(1, world_size)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    batches = [max(1, int(batch_for(level))) * world for level in levels]
    tie = 1.0 / (prefix[-1] * levels[-1] + 1)  # padded work, scaled below one step
    inf = float("inf")
    cost = [[inf] * n for _ in range(k)]
    cut = [[0] * n for _ in range(k)]
    for b in range(n):
        cost[0][b] = -(-prefix[b + 1] // batches[b]) + prefix[b + 1] * levels[b] * tie
    for j in range(1, k):
        row, prev = cost[j], cost[j - 1]
        for b in range(j, n):
            best, arg = inf, j
            top, group, total = levels[b], batches[b], prefix[b + 1]
            for a in range(j, b + 1):  # the last bucket covers levels[a..b]
                held = total - prefix[a]
                value = prev[a - 1] + -(-held // group) + held * top * tie
                if value < best:
                    best, arg = value, a
            row[b], cut[j][b] = best, arg
    # fewer buckets can take fewer steps (a split bucket rounds up twice): the best of every count up to k
    used = min(range(k), key=lambda j: (cost[j][n - 1], j))
    bounds: list[int] = []
    b = n - 1
    for j in range(used, -1, -1):
        bounds.append(levels[b])
        if j == 0:
            break
        b = cut[j][b] - 1
    return tuple(sorted(set(bounds)))


def regroup(buckets: Buckets, bounds: Sequence[int]) -> Buckets:
    """The same samples cut at other ``bounds`` (as :func:`assign` would from the scan)."""
    if len(buckets.sizes) != buckets.count:
        raise ValueError("these buckets do not know their samples' sizes (built without assign())")
    order: list[int] = []
    sizes: list[int] = []
    for members, member_sizes in zip(reversed(buckets.members), reversed(buckets.sizes), strict=True):
        order.extend(members)  # buckets ascend, members descend: the whole scan, largest first
        sizes.extend(member_sizes)
    return assign(order, sizes, bounds)


def _levels(ordered: list[int], limit: int = MAX_LEVELS) -> tuple[list[int], list[int]]:
    """Distinct sizes and their counts; beyond ``limit``, quantile groups (each its group's largest)."""
    levels: list[int] = []
    weights: list[int] = []
    for size in ordered:
        if levels and levels[-1] == size:
            weights[-1] += 1
        else:
            levels.append(size)
            weights.append(1)
    if len(levels) <= limit:
        return levels, weights
    total = len(ordered)
    merged_levels: list[int] = []
    merged_weights: list[int] = []
    groups: list[int] = []
    seen = 0
    for level, weight in zip(levels, weights, strict=True):
        group = seen * limit // total  # the quantile group this level starts in
        seen += weight
        if groups and groups[-1] == group:
            merged_levels[-1] = level
            merged_weights[-1] += weight
        else:
            groups.append(group)
            merged_levels.append(level)
            merged_weights.append(weight)
    return merged_levels, merged_weights


def plan_buckets(order: Sequence[int], sizes: Sequence[int], count: int) -> Buckets:
    """Group the samples ``order`` (dataset indices, largest first, with their ``sizes``) into buckets.

    ``order``/``sizes`` are a :class:`~retune.probing.sample_sizes.SizeScan`'s. Empty buckets are never made.
    """
    if len(order) != len(sizes):
        raise ValueError(f"{len(order)} indices but {len(sizes)} sizes")
    bounds = choose_bounds(sizes, count)
    return assign(order, sizes, bounds)


def assign(order: Sequence[int], sizes: Sequence[int], bounds: Sequence[int]) -> Buckets:
    """Put each sample into the first bucket whose bound holds it; buckets left empty are dropped."""
    if not bounds:
        return Buckets((), (), ())
    groups: list[list[int]] = [[] for _ in bounds]
    group_sizes: list[list[int]] = [[] for _ in bounds]
    tops = [0] * len(bounds)
    for index, size in zip(order, sizes, strict=True):
        bucket = next((b for b, bound in enumerate(bounds) if size <= bound), len(bounds) - 1)
        groups[bucket].append(int(index))
        group_sizes[bucket].append(int(size))
        tops[bucket] = max(tops[bucket], int(size))
    kept = [b for b in range(len(bounds)) if groups[b]]
    return Buckets(
        tuple(int(bounds[b]) for b in kept),
        tuple(tuple(groups[b]) for b in kept),
        tuple(tops[b] for b in kept),
        tuple(tuple(group_sizes[b]) for b in kept),
    )


@dataclass(frozen=True)
class PlannedBatch:
    """One step of one rank: the bucket it comes from and the dataset indices it holds."""

    bucket: int
    indices: tuple[int, ...]


def count_batches(buckets: Buckets, batch_sizes: Sequence[int], drop_last: bool = False, world_size: int = 1) -> int:
    """Batches each rank runs per epoch (the same on every rank): :func:`epoch_batches`'s length, without the plan."""
    return sum(
        full + (1 if rest and not drop_last else 0)
        for full, rest in _groups(buckets, batch_sizes, drop_last, world_size)
    )


def _groups(buckets: Buckets, batch_sizes: Sequence[int], drop_last: bool, world_size: int) -> list[tuple[int, int]]:
    """Per bucket (shortest samples first), its full groups of ``size x world_size`` samples and the samples of
    its partial group, counting with ``drop_last`` the partial groups moved up from buckets of shorter samples
    (:func:`epoch_batches`); the last bucket's partial group is what ``drop_last`` drops."""
    counts: list[tuple[int, int]] = []
    carried = 0
    for bucket in _shortest_first(buckets):
        full, rest = divmod(len(buckets.members[bucket]) + carried, max(1, batch_sizes[bucket]) * world_size)
        counts.append((full, rest))
        carried = rest if drop_last else 0
    return counts


def _shortest_first(buckets: Buckets) -> list[int]:
    """The buckets in the order their partial groups move up: by their longest sample (bucket order, when built
    by :func:`assign`)."""
    return sorted(range(buckets.count), key=lambda b: (buckets.largest[b], b))


def epoch_batches(
    buckets: Buckets,
    batch_sizes: Sequence[int],
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    drop_last: bool = False,
    world_size: int = 1,
    rank: int = 0,
) -> list[PlannedBatch]:
    """This rank's batches for ``epoch``: each bucket cut into batches of its own size, batches shuffled
    across buckets. The same ``(seed, epoch)`` gives the same batches; every rank gets the same number.

    Without ``shuffle`` samples keep dataset order within a bucket and batches run in order of their
    first sample. A bucket's last group (``size x world_size`` samples at most) trains smaller when it
    is partial; under DDP it is padded with the bucket's first samples to a multiple of ``world_size`` so
    every rank gets a batch. With ``drop_last`` a partial group moves up instead, into the next bucket of
    longer samples (a size searched for longer samples fits shorter ones, padded to the batch's longest),
    where it trains in the first group; only the longest samples' bucket drops its partial group, so an
    epoch drops fewer samples than that bucket's ``size x world_size`` (where dropping every bucket's
    partial group would drop up to the sum of the sizes) and every batch holds its bucket's size.

    >>> buckets = Buckets((10, 50), ((0, 1, 2), (3, 4)), (10, 50))
    >>> [(b.bucket, b.indices) for b in epoch_batches(buckets, [2, 2], seed=0, epoch=0, shuffle=False, drop_last=True)]
    [(0, (0, 1)), (1, (2, 3))]
    """
    if len(batch_sizes) != buckets.count:
        raise ValueError(f"{buckets.count} buckets but {len(batch_sizes)} batch sizes")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size} is not valid")
    rng = random.Random(f"retune-buckets:{seed}:{epoch}")
    groups: list[tuple[int, list[int]]] = []
    order = _shortest_first(buckets)
    carried: list[int] = []  # with drop_last: the partial group of the bucket of shorter samples before
    for bucket in order:
        size = batch_sizes[bucket]
        if size < 1:
            raise ValueError(f"bucket {bucket} has batch size {size}; sizes must be >= 1")
        indices = list(buckets.members[bucket])
        if shuffle:
            rng.shuffle(indices)
            pool = carried + indices  # the samples moved up train in this bucket's first group
        else:
            indices.sort()
            pool = sorted(carried + indices)
        carried = []
        step = size * world_size
        for start in range(0, len(pool), step):
            group = pool[start : start + step]
            if len(group) < step:
                if drop_last:
                    carried = group if bucket != order[-1] else []
                    continue
                group = _pad(group, indices, world_size)
            groups.append((bucket, group))
    if shuffle:
        rng.shuffle(groups)
    else:
        groups.sort(key=lambda g: min(g[1]))
    batches = []
    for bucket, group in groups:
        share = len(group) // world_size
        batches.append(PlannedBatch(bucket, tuple(group[rank * share : (rank + 1) * share])))
    return batches


def _pad(group: list[int], pool: list[int], world_size: int) -> list[int]:
    """``group`` padded with samples of ``pool`` (cycled) to a multiple of ``world_size``."""
    missing = -len(group) % world_size
    padded = list(group)
    position = 0
    while missing:
        padded.append(pool[position % len(pool)])
        position += 1
        missing -= 1
    return padded


def mean_batch(buckets: Buckets, batch_sizes: Sequence[int], drop_last: bool = False, world_size: int = 1) -> float:
    """Samples per step on one rank, averaged over an epoch (what ``apply`` policies use as the batch size)."""
    steps = count_batches(buckets, batch_sizes, drop_last, world_size)
    if steps == 0:
        return 0.0
    trained = 0
    counts = _groups(buckets, batch_sizes, drop_last, world_size)
    for bucket, (full, rest) in zip(_shortest_first(buckets), counts, strict=True):
        trained += full * batch_sizes[bucket] + (-(-rest // world_size) if rest and not drop_last else 0)
    return trained / steps


__all__ = [
    "Buckets",
    "PlannedBatch",
    "assign",
    "choose_bounds",
    "choose_bounds_for_steps",
    "count_batches",
    "epoch_batches",
    "mean_batch",
    "plan_buckets",
    "regroup",
]
