"""``objective: throughput`` with ``batching: buckets``: every bucket capped at the fastest padded work per step.

With pad-to-longest collation a step of a bucket does work in proportion to its batch size times the
bucket's longest sample (its padded tokens, pixels...). Where samples per second peak below the largest
size that fits, what peaks is the work a step does at once (activations that stop fitting in caches, a
device's allocator near its limit), so one bucket's fastest size says how much padded work per step is
fastest for all of them. The selection therefore runs once, on the **reference bucket**, the one where
most of the epoch's time goes (the most padded work per epoch: its samples x its longest sample), and
every bucket's size becomes the padded work ``T* = b* x longest_ref`` of the reference bucket's fastest
size ``b*`` divided by its own longest sample, never more than the largest size that fit it, never
below 1. When ``b*`` is the largest size the reference bucket fits (the curve never turned below what
fits), nothing is known about more work per step and every bucket keeps its largest size.

The cap keeps the buckets' order: ``T* / longest`` shrinks as samples grow, so a bucket of shorter
samples is never given a smaller size than one of longer samples (unless its own count or memory
limited it already).

When the padded-work assumption is wrong: a model whose cost is not linear in the padded length
(attention's quadratic term makes long buckets slower per token, so the cap lets them run more work per
step than their own fastest), a model that skips padding (packed or masked kernels: work follows real
tokens, not padded ones), or a per-sample overhead that dominates very short samples. The largest sizes
stay in the event (``bucket_largest``) so such a run can be compared with ``objective: largest``.

Example:
    >>> ref = reference_bucket(largest=(32, 64, 256), counts=(300, 80, 20))   # 9600 vs 5120 vs 5120
    >>> ref
    0
    >>> capped_sizes([400, 150, 30], (32, 64, 256), padded=96 * 32)         # b* = 96 in bucket 0
    [96, 48, 12]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from retune.buckets.sizes import BucketTrial
from retune.probing.timing import steady
from retune.search.throughput import ThroughputResult


def reference_bucket(largest: Sequence[int], counts: Sequence[int]) -> int:
    """The bucket with the most padded work per epoch (samples x longest sample); ties: the longer samples'."""
    if not largest or len(largest) != len(counts):
        raise ValueError(f"{len(largest)} buckets but {len(counts)} counts")
    return max(range(len(largest)), key=lambda b: (counts[b] * largest[b], largest[b], -b))


def capped_sizes(sizes: Sequence[int], largest: Sequence[int], padded: int) -> list[int]:
    """Each bucket's size at most ``padded`` work per step: ``max(1, min(size, padded // longest))``."""
    if len(sizes) != len(largest):
        raise ValueError(f"{len(sizes)} sizes but {len(largest)} buckets")
    return [max(1, min(size, padded // max(1, longest))) for size, longest in zip(sizes, largest, strict=True)]


def bucket_timings(
    trials: Sequence[BucketTrial], step_times: Sequence[Sequence[float] | None], bucket: int
) -> dict[int, list[float]]:
    """The steady step seconds of ``bucket``'s fitting, timed trials, pooled by size.

    ``step_times`` is the prober's per-trial list, in the order of ``trials`` (one entry per probe; None
    where a trial failed or its steps were not timed, as under the CPU memory tracker).
    """
    known: dict[int, list[float]] = {}
    for trial, times in zip(trials, step_times, strict=False):
        if trial.bucket == bucket and trial.fits and times:
            known.setdefault(trial.batch_size, []).extend(steady(times))
    return {size: seconds for size, seconds in known.items() if seconds}


@dataclass(frozen=True)
class BucketChoice:
    """Every bucket's size after the throughput cap, and what it was derived from."""

    sizes: list[int]
    largest: list[int]
    """Each bucket's largest size that fit (margin applied), before the cap."""
    reference: int
    chosen: int
    """The reference bucket's chosen size ``b*`` (where a warm re-tune starts looking)."""
    padded: int | None
    """``T* = b* x longest_ref``, the padded work per step every bucket is capped at; None when ``b*`` is the
    largest size that fit (the curve did not turn: no cap)."""


def cap_at_fastest(
    sizes: Sequence[int], largest: Sequence[int], reference: int, choice: ThroughputResult
) -> BucketChoice:
    """Cap every bucket at the padded work per step of the reference bucket's fastest size.

    ``sizes`` are the largest sizes that fit each bucket (``largest[b]`` its longest sample), and ``choice``
    the selection run on the reference bucket with ``cap = sizes[reference]``. A selection trial that failed
    below the cap (memory not monotone in the batch size) lowered ``choice.largest``: no bucket of samples as
    long as the reference's or longer keeps a size above it.
    """
    before = list(sizes)
    chosen = min(choice.size, before[reference])
    if chosen < choice.largest:
        padded = chosen * largest[reference]
        return BucketChoice(capped_sizes(before, largest, padded), before, reference, chosen, padded)
    ceiling = choice.largest
    after = [min(size, ceiling) if largest[b] >= largest[reference] else size for b, size in enumerate(before)]
    after[reference] = chosen
    return BucketChoice([max(1, s) for s in after], before, reference, chosen, None)


__all__ = ["BucketChoice", "bucket_timings", "cap_at_fastest", "capped_sizes", "reference_bucket"]
