"""The buckets' side of the search's :class:`~retune.search.batching.Batching` seam.

:class:`BucketBatching` is what the callback passes :func:`~retune.search.stage.search_stage` for the
train stage under ``search.batching: buckets``: it reads the user's loader with the bucketed one
paused, groups the samples by size and, per search, returns a :class:`BucketSearch` that sizes every
bucket (:meth:`~retune.buckets.train_buckets.TrainBuckets.search`), caps them at the fastest padded
work with ``objective: throughput``, applies the sizes and fills the event's bucket fields. A loader
that cannot be bucketed falls back to one size for this search
(:class:`~retune.search.batching.FixedSearch`), with one warning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from retune import compat
from retune.buckets.plan import Buckets
from retune.buckets.sizes import shifted_curve
from retune.buckets.train_buckets import BucketOutcome, PredictBuckets, TracedBuckets, TrainBuckets
from retune.events import Trial
from retune.search.batching import FixedSearch, Limits, Say, SearchJob, StageSearch
from retune.search.largest import SearchPlan, SearchResult, apply_margin
from retune.search.predict_run import (
    PredictionRecord,
    Tracer,
    Untraceable,
    replay_matches,
    sample_to_trace,
    why_not_predict,
)

REPLAY_MISS = 0.1
"""How far a verifying probe may measure from a replayed (or traced) bucket's prediction before the fit stops
replaying (the benchmark's replays: within 4%; a replay that misreads a size: 30-60%)."""


class BucketBatching:
    """One batch size per bucket of samples grouped by size (the train stage's :class:`TrainBuckets`)."""

    def __init__(self, buckets: TrainBuckets) -> None:
        self.buckets = buckets

    def loader(self, trainer: Any, stage: str) -> Any:
        with self.buckets.hook.paused():  # the user's own loader, not the bucketed one
            return compat.request_dataloader(trainer, stage)

    def begin(self, loader: Any, say: Say, limits: Limits) -> StageSearch:
        grouped, differ = self.buckets.agreed(self.buckets.prepare(loader, say))
        if differ is not None:
            self.buckets.probe_batches.warn_once("train-buckets", differ)
        if grouped is None:
            return FixedSearch(limits)
        return BucketSearch(self.buckets, grouped, limits)


class BucketSearch:
    """One search of every bucket's size; the batch-size attribute gets the longest samples' bucket's."""

    def __init__(self, buckets: TrainBuckets, grouped: Buckets, limits: Limits) -> None:
        self.buckets = buckets
        self.grouped = grouped
        self.mode = "buckets"
        self.needs_peaks = True
        # the budget, else the smallest rank's device limit, agreed where the search started: the bounds cut by
        # steps, the predicted starts and the per-bucket model must be the same on every rank
        self.limit = limits.step_limit
        self.note = (
            ""
            if self.limit is not None
            else "no memory limit to model (no memory.budget, no device statistics): each bucket was bisected"
        )
        self.outcome: BucketOutcome | None = None
        self.prediction = PredictionRecord()
        self.traced: TracedBuckets | None = None
        """``search.predict``: the traced fixed memory and memory per sample (by the longest sample)."""
        self.before: tuple[list[int], list[int]] = ([], [])
        """The bucket sizes in force when the search started, and their buckets' largest samples."""

    def describe(self, plan: SearchPlan) -> str:
        grouped = self.grouped
        return f"of {grouped.count} buckets (samples up to {', '.join(str(b) for b in grouped.largest)})"

    def run(self, job: SearchJob) -> SearchResult:
        config, plan = job.schedule.search, job.plan
        in_force = self.buckets.buckets
        # the sizes and buckets in force before the search, for the event (the outcome's are the same buckets')
        self.before = (list(self.buckets.state.sizes), [] if in_force is None else list(in_force.largest))
        outcome = self.buckets.search(
            job.trainer,
            self.grouped,
            job.prober,
            limit=self.limit,
            start=min(config.init_val, plan.upper),
            max_trials=config.max_trials,
            max_val=config.max_val,
            margin_of=lambda found, memory_bound, capacity=None: apply_margin(plan, found, memory_bound, capacity),
            tolerance=config.margin,
            steps=config.steps_per_trial,
            direction=job.direction,
            cold=job.cold,
            predict=self._predictor(job) if config.predict == "auto" else None,
        )
        self.outcome = outcome
        self.note = "; ".join(n for n in (self.note, self.prediction.note) if n)
        if config.objective == "throughput":
            self.buckets.cap_at_fastest(
                outcome,
                job.prober,
                tolerance=config.throughput_tolerance,
                steps=config.steps_per_trial,
                warm=config.warm_start and not job.cold,
            )
        return _summary(outcome)

    def _predictor(self, job: SearchJob) -> PredictBuckets | None:
        """``search.predict: auto``: trace the worst batches of the shortest and the longest bucket at each one's cap,
        one step each (:class:`~retune.search.predict_run.Tracer`), and a middle bucket's; every bucket's memory per
        sample is the parabola in the length through the three (:func:`~retune.buckets.sizes.length_curve`). The
        first trace is made at a tag size and recorded (:mod:`retune.prediction.replay`): the fit's first search
        replays it at the longest bucket's batch, and where that equals the longest's trace (within
        ``REPLAY_TOLERANCE``) the middle is replayed instead of traced, and every later predicted search of the
        fit (after one that predicted) traces one bucket and replays the others (a step whose storages do not
        scale with its batch's dimensions fails that check, and is traced as before: a later search then traces
        the two ends and takes the middle from the last curve plus the change they show,
        :func:`~retune.buckets.sizes.shifted_curve`). Its predicted
        size is the largest the traced line keeps within the limit; where other bounds would take fewer steps at
        the predicted sizes, the search cuts the samples there (:meth:`TrainBuckets.search`). The first trace's
        optimizer update is reused by the others (forward and backward only: the same state). None where it
        cannot predict (the event's note says why)."""
        record, warn = self.prediction, job.warn_once or _say_nothing
        reason = why_not_predict(job.trainer, job.stage, self.limit)
        if reason is not None or self.limit is None:
            record.fell_back(reason or "no limit", warn)
            return None
        prober = job.prober

        def predict(
            buckets: Buckets, uppers: Sequence[int], arrange_of: Callable[[int], Any], before: TracedBuckets | None
        ) -> TracedBuckets | None:
            by_length = sorted(range(buckets.count), key=lambda b: (buckets.largest[b], b))
            ends, middle = sorted({by_length[0], by_length[-1]}), by_length[len(by_length) // 2]
            peaks: dict[int, float] = {}
            parts: dict[tuple[int, bool], tuple[float, ...] | None] = {}  # (bucket, replayed): its phases
            fixed = 0.0
            phase = None  # the first trace's optimizer update, reused by the others (the same state)
            source = None  # the first trace, recorded: the others can be read from it (retune.prediction.replay)
            batches: dict[int, Any] = {}
            sharded = compat.is_sharded(job.trainer)  # a rank's account is traced (no replay)
            check = self.buckets.replays is None and len(ends) == 2 and not sharded  # the fit's first: checked
            replaying = self.buckets.replays is True and before is not None and not sharded

            def tracer_for(bucket: int) -> Tracer:
                tracer = Tracer(
                    job.trainer,
                    prober.pl_module,
                    batches.get(bucket),
                    optimizer=phase,
                    batch_arg_name=prober.batch_arg_name,
                )
                if tracer.batch is None:
                    arrange = prober.arrange
                    prober.arrange = arrange_of(bucket)
                    try:
                        tracer.batch = batches[bucket] = sample_to_trace(job.trainer, prober, 2)
                    finally:
                        prober.arrange = arrange
                return tracer

            def trace(bucket: int, recorded: bool = False) -> bool:
                nonlocal fixed, phase, source
                tracer = None
                try:
                    tracer = tracer_for(bucket)
                    # traced at a size a replay tells apart, then read at the cap (else traced at the cap)
                    got = tracer.recorded_replay(uppers[bucket]) if recorded else None
                    peaks[bucket] = tracer(uppers[bucket]) if got is None else got[0]
                    parts[(bucket, got is not None)] = tracer.phases.get(uppers[bucket])
                    if recorded:
                        source = None if got is None else got[1]
                    phase = tracer.optimizer
                except Untraceable as error:
                    record.seconds += tracer.seconds if tracer is not None else 0.0
                    record.fell_back(error.reason, warn)
                    return False
                record.seconds += tracer.seconds
                fixed = tracer.fixed or 0.0
                return True

            def replayed(bucket: int) -> float | None:
                """The bucket's prediction read from the first trace (None: it cannot be)."""
                if source is None:
                    return None
                try:
                    tracer = tracer_for(bucket)
                except Untraceable:
                    return None
                value = tracer.replay(source, uppers[bucket])
                record.seconds += tracer.seconds
                parts[(bucket, True)] = tracer.phases.get(uppers[bucket])
                return value

            if not trace(ends[0], recorded=check or replaying):
                return None
            for bucket in (*ends[1:], middle) if replaying else ():
                value = replayed(bucket)
                if value is not None:
                    peaks[bucket] = value
            for bucket in ends[1:]:
                if bucket not in peaks and not trace(bucket):
                    return None

            def points() -> tuple[tuple[int, float], ...]:
                return tuple((buckets.largest[b], max(0.0, (peaks[b] - fixed) / uppers[b])) for b in sorted(peaks))

            if check:  # the fit's first predicted search: does a replay of its first trace give the other end's trace?
                other = ends[-1]
                value = replayed(other)
                if value is not None:  # compared: the verdict for the fit (not compared: a later search checks)
                    self.buckets.replays = replay_matches(
                        value, peaks[other], parts.get((other, True)), parts.get((other, False)), fixed
                    )
                if self.buckets.replays and middle not in peaks:
                    value = replayed(middle)
                    if value is not None:
                        peaks[middle] = value
                elif not self.buckets.replays and source is not None and not trace(ends[0]):
                    return None  # its own prediction was read at its cap from the tag size: traced there instead

            curve = None
            if before is not None and middle not in peaks and len(ends) == 2:
                curve = shifted_curve(before.curve, points(), buckets.largest[middle])
            if curve is None and middle not in peaks and not trace(middle):
                return None
            record.path = "predicted"
            self.traced = TracedBuckets(fixed, curve if curve is not None else points())
            return self.traced

        return predict

    def what(self, stage: str) -> str:
        return f"{stage} batch size for the longest samples' bucket"

    def apply(self, job: SearchJob, before: int, size: int) -> tuple[int, int, int | None]:
        outcome = self._outcome()
        if self.buckets.replays and self._replay_missed(outcome):
            self.buckets.replays = False  # the rest of the fit traces: what its probes measured outweighs the check
        changed = outcome.sizes != outcome.sizes_before or not self.buckets.active
        self.buckets.apply(outcome)
        if changed:
            compat.reload_dataloader(job.trainer, job.stage)
            compat.refresh_progress_bar(job.trainer)
        after = max(1, round(self.buckets.mean_batch()))
        return job.state.mean_batch or before, after, after

    def _replay_missed(self, outcome: BucketOutcome) -> bool:
        """Whether a probe of a bucket whose prediction a trace or a replay read directly (a point of the curve, not
        between points) measured more than :data:`REPLAY_MISS` from it. The fit's check of replays runs once; a
        later change (an unfreeze that brings a layer whose sizes a replay misreads into the peak) can make them
        wrong, and the verifying probes see it: 8 probes where 4 did, two of them 1.6-1.9 times the budget."""
        traced = self.traced
        if traced is None:
            return False
        tops, points = outcome.buckets.largest, {length for length, _ in traced.curve}
        for trial in outcome.result.trials:
            if trial.peak is None or tops[trial.bucket] not in points:
                continue
            predicted = traced.fixed + trial.batch_size * traced.slope(tops[trial.bucket])
            if abs(trial.peak - predicted) > REPLAY_MISS * trial.peak:
                return True
        return False

    def event_fields(self) -> dict[str, Any]:
        outcome = self._outcome()
        trials = outcome.result.trials
        prediction = self.prediction.event_fields(len(trials))
        traced = self.traced
        if traced is not None and prediction:
            tops = outcome.buckets.largest
            prediction["predicted_bytes"] = [
                round(traced.fixed + t.batch_size * traced.slope(tops[t.bucket])) for t in trials
            ]
        sizes_before, bounds_before = list(outcome.sizes_before), []
        old_sizes, old_bounds = self.before
        if not sizes_before and old_sizes and len(old_sizes) == len(old_bounds):
            # the search grouped the samples anew: the sizes in force were other buckets' (said with their bounds)
            sizes_before = old_sizes
            bounds_before = old_bounds if old_bounds != list(outcome.buckets.largest) else []
        return {
            **prediction,
            "largest": _reference_largest(outcome),
            "bucket_sizes": [int(s) for s in outcome.sizes if s is not None],
            "bucket_sizes_before": sizes_before,
            "bucket_bounds_before": bounds_before,
            "bucket_bounds": list(outcome.buckets.largest),
            "bucket_samples": [len(m) for m in outcome.buckets.members],
            "trial_buckets": [t.bucket for t in outcome.result.trials],
            "samples_per_step": round(self.buckets.mean_batch(), 2),
            "bucket_largest": list(outcome.largest),
            "reference_bucket": outcome.reference,
            "padded_per_step": outcome.padded,
        }

    def _outcome(self) -> BucketOutcome:
        assert self.outcome is not None, "BucketSearch.run has not run"
        return self.outcome


def _say_nothing(where: str, message: str) -> None:
    """Where a search has no way to warn: the event's note still says why it fell back."""


def _summary(outcome: BucketOutcome) -> SearchResult:
    """The bucketed search as one ``SearchResult``: the longest samples' bucket's size (the one size that
    fits every batch, which the batch-size attribute holds), with every trial."""
    sizes = outcome.sizes
    longest = max(range(len(sizes)), key=lambda b: (outcome.buckets.largest[b], -b))
    size = sizes[longest] if all(s is not None for s in sizes) else None
    result = outcome.result
    trials = [Trial(t.batch_size, t.fits) for t in result.trials]
    unsettled = ""
    if result.unsettled:
        shown = ", ".join(
            f"{b} (samples up to {outcome.buckets.largest[b]}) at {outcome.sizes[b]}" for b in result.unsettled
        )
        many = len(result.unsettled) > 1
        unsettled = (
            f"{'buckets' if many else 'bucket'} {shown} may fit more: the search stopped before it found "
            f"{'their' if many else 'its'} largest size"
        )
    return SearchResult(size, result.found[longest], result.min_failing[longest], trials, unsettled=unsettled)


def _reference_largest(outcome: BucketOutcome) -> int | None:
    """Throughput with buckets: the largest size that fit the reference bucket (the cap its selection had)."""
    if outcome.reference is None or not outcome.largest:
        return None
    return outcome.largest[outcome.reference]


__all__ = ["BucketBatching", "BucketSearch"]
