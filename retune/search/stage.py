"""One stage's batch-size search, from the trigger to the applied size: the path every search takes.

The callback decides *when* a stage is searched (its hooks and triggers); this module decides *how*:
where the search starts (cold, warm, below a real out-of-memory failure), which search runs
(``power``/``binsearch``/``model``), the probe session that puts the training state back, the error
when nothing fits, applying the result (the batch-size attribute and the dataloader reload) and the
``apply`` policies, and the :class:`~retune.events.RetuneEvent` that records it. Keeping it out of
the callback class keeps the callback a thin layer of hooks, and lets every kind of search (one
size, or one size per length bucket) share this one path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from retune import compat
from retune.allocator import process_limit, stats_for
from retune.buckets.train_buckets import BucketOutcome, TrainBuckets
from retune.errors import RetuneError
from retune.events import Direction, RetuneEvent, Trial
from retune.memory import device_total_bytes
from retune.probing.probe_batches import ProbeBatches
from retune.probing.prober import Prober, TrialReport
from retune.probing.timing import Clock
from retune.schedule.models import RetuneSchedule
from retune.search.largest import (
    MemoryModel,
    Mode,
    SearchPlan,
    SearchResult,
    _apply_margin,
    plan_search,
    run_model_search,
    run_search,
)
from retune.search.policies import accumulation_for, lr_factor, scale_learning_rates
from retune.search.predict_run import PredictionRecord, predicted_search
from retune.search.throughput import (
    ThroughputPlan,
    choose_fastest,
    selection_budget,
    selection_steps,
    timed_sizes,
    trial_rates,
    with_choice,
)

Say = Callable[..., None]
"""``say(message, warn=False)``: the callback's rank-zero printer."""


@dataclass
class StageState:
    """What the last search of one stage found: applied size, bracket for a warm start, memory line."""

    size: int | None = None
    last: SearchResult | None = None
    model: MemoryModel | None = None
    mean_batch: int | None = None
    """Buckets: the samples per step the ``apply`` policies last saw (None: one batch size)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "max_fitting": None if self.last is None else self.last.max_fitting,
            "min_failing": None if self.last is None else self.last.min_failing,
            "memory_model": None if self.model is None else [self.model.fixed, self.model.per_sample],
            "mean_batch": self.mean_batch,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageState:
        size = data.get("size")
        has_last = data.get("max_fitting") is not None or data.get("min_failing") is not None
        last = SearchResult(size, data.get("max_fitting"), data.get("min_failing")) if has_last else None
        line = data.get("memory_model")
        return cls(size, last, None if line is None else MemoryModel(line[0], line[1]), data.get("mean_batch"))


@dataclass
class Policies:
    """The ``apply`` policies' memory across searches: the effective batch size the first tune set, and
    the accumulation in force (re-applied at every epoch start: Lightning 1.9 resets it)."""

    reference_effective: int | None = None
    accumulate: int | None = None


def mode_and_limit(schedule: RetuneSchedule, device: Any, budget: int | None) -> tuple[Mode, int | None, str]:
    """The search to run and the memory limit ``model`` mode predicts against.

    ``model`` needs measured peaks and a limit: the budget, or what this process can get from the
    device's caching allocator (:func:`retune.allocator.process_limit`: free memory plus its own
    reserved, within its memory fraction; not the device's total). Without both it falls back to
    ``binsearch`` and says so in the event.
    """
    mode = schedule.search.mode
    if mode != "model":
        return mode, budget, ""
    if budget is not None and device.type in ("cpu", "cuda"):
        return "model", budget, ""
    limit = device_limit(device)
    if limit is not None:
        return "model", limit, ""
    reason = "no memory.budget set" if budget is None else f"no memory statistics on {device.type}"
    return "binsearch", None, f"model mode needs measured peaks and a limit ({reason}); fell back to binsearch"


def device_limit(device: Any) -> int | None:
    """What this process can get from ``device``'s caching allocator, or None where it has none (CPU)."""
    stats = stats_for(device)
    return None if stats is None else process_limit(stats)


def search_stage(
    trainer: Any,
    pl_module: Any,
    *,
    schedule: RetuneSchedule,
    stage: str,
    name: str,
    label: str,
    direction: Direction,
    cold: bool,
    state: StageState,
    policies: Policies,
    probe_batches: ProbeBatches,
    known_oom: tuple[int, int] | None,
    on_trial: TrialReport,
    say: Say,
    before_plan: Callable[[Any], None] | None = None,
    clock: Clock | None = None,
    buckets: TrainBuckets | None = None,
) -> tuple[RetuneEvent, str]:
    """Search ``stage``'s batch size (attribute ``name``), apply it, and return the event and where it ran.

    ``known_oom`` is ``(fitting, failed)`` from a real training step that ran out of memory at
    ``failed`` and trained in pieces of ``fitting``: the search starts below the failure. ``state``
    is updated in place; ``before_plan(loader)`` sees the stage's loader once (a warning about it).
    With ``search.objective: throughput`` the size applied is the fastest that fits (:mod:`retune.search.throughput`),
    its steps timed with ``clock``. With ``buckets`` (``search.batching: buckets``, train stage) every
    bucket gets its own size, unless the loader cannot be bucketed (then one size, as ``fixed``).
    On any failure the attribute is put back to what it was.
    """
    config = schedule.search
    before = compat.get_batch_attr(trainer, pl_module, name)
    started = time.perf_counter()
    device = pl_module.device
    budget = schedule.memory.budget_bytes(device_total_bytes(device))
    mode, limit, note = mode_and_limit(schedule, device, budget)
    previous = None if cold else state.last
    if known_oom is not None:
        fitting, failed = known_oom  # a real step failed at `failed`, and pieces of `fitting` ran
        previous = SearchResult(state.size, min(fitting, failed - 1), failed)
        direction = "down"
    with _paused(buckets):
        loader = compat.request_dataloader(trainer, stage)
    if before_plan is not None:
        before_plan(loader)
    grouped = buckets.prepare(loader, say) if buckets is not None else None
    plan = plan_search(
        mode=mode,
        init_val=config.init_val,
        max_trials=config.max_trials,
        margin=config.margin,
        max_val=config.max_val,
        dataset_len=compat.dataset_length(loader, trainer.world_size),
        warm_start=config.warm_start or known_oom is not None,
        previous=previous,
        direction=direction,
    )
    del loader
    epoch = trainer.current_epoch
    where = f"epoch {epoch}" if stage in ("train", "val") and compat.trainer_fn(trainer) == "fit" else label
    shown_mode: str = mode
    if grouped is not None:
        shown_mode, note = "buckets", ""
        limit = budget if budget is not None else device_limit(device)
        if limit is None:
            note = "no memory limit to model (no memory.budget, no device statistics): each bucket was bisected"
        say(
            f"{where}: {label} fired, searching the {stage} batch size of {grouped.count} buckets "
            f"(samples up to {', '.join(str(b) for b in grouped.largest)})"
        )
    else:
        say(f"{where}: {label} fired, searching the {stage} batch size (from {plan.start})")
    prober = Prober(
        trainer,
        pl_module,
        name,
        config.steps_per_trial,
        budget,
        on_trial=on_trial,
        stage=stage,
        track_memory=shown_mode in ("model", "buckets") or stats_for(device) is not None,  # a caching allocator
        arrange=lambda loader: probe_batches.arrange(loader, stage, prober.steps_per_trial),
        time_steps=config.objective == "throughput",
        clock=clock,
    )
    outcome: BucketOutcome | None = None
    largest: int | None = None
    prediction = PredictionRecord()
    try:
        with prober.session():
            if grouped is not None and buckets is not None:
                outcome = buckets.search(
                    trainer,
                    grouped,
                    prober,
                    limit=limit,
                    start=min(config.init_val, plan.upper),
                    max_trials=config.max_trials,
                    max_val=config.max_val,
                    margin_of=lambda found, memory_bound: apply_margin(plan, found, memory_bound),
                    tolerance=config.margin,
                    steps=config.steps_per_trial,
                    direction=direction,
                    cold=cold,
                )
                if config.objective == "throughput":
                    buckets.cap_at_fastest(
                        outcome,
                        prober,
                        tolerance=config.throughput_tolerance,
                        steps=config.steps_per_trial,
                        warm=config.warm_start and not cold,
                    )
                result = _bucket_summary(outcome)
            else:
                predicted = None
                if config.predict == "auto":  # predict, then verify (retune.search.predict_run)
                    predicted = predicted_search(
                        trainer,
                        pl_module,
                        prober,
                        plan,
                        limit if limit is not None else budget if budget is not None else device_limit(device),
                        stage=stage,
                        same_batch=config.probe_samples == "largest",
                        record=prediction,
                        warn_once=probe_batches.warn_once,
                    )
                if predicted is not None:
                    result = predicted
                elif mode == "model" and limit is not None:
                    # after an unfreeze the old slope misleads more than it helps: measure the new one
                    prior = None if cold or direction == "down" else state.model
                    result = run_model_search(plan, prober.measure, limit, prior)
                else:
                    result = run_search(plan, prober.fits)
            if config.objective == "throughput" and result.size is not None and outcome is None:
                largest = result.size
                result = fastest_that_fits(prober, result, schedule, None if cold else state.size)
    except BaseException:
        compat.set_batch_attr(trainer, pl_module, name, before)
        raise
    if result.size is None:
        compat.set_batch_attr(trainer, pl_module, name, before)
        smallest = min(t.batch_size for t in result.trials) if result.trials else 1
        what = f"{stage} batch size" if outcome is None else f"{stage} batch size for the longest samples' bucket"
        raise RetuneError(
            f"no {what} fits in memory after trigger {label!r} at epoch {epoch}: the smallest "
            f"size tried, {smallest}, ran out of memory ({len(result.trials)} trials). Free memory (freeze "
            f"more layers, lower precision, shorter inputs) or raise search.max_trials if it stopped early."
        )
    compat.set_batch_attr(trainer, pl_module, name, result.size)
    if outcome is not None and buckets is not None:
        changed = outcome.sizes != outcome.sizes_before or not buckets.active
        buckets.apply(outcome)
        if changed:
            compat.reload_dataloader(trainer, stage)
            compat.refresh_progress_bar(trainer)
        size_before = state.mean_batch or before
        mean = buckets.mean_batch()
        size_after = max(1, round(mean))
    else:
        if result.size != before:
            compat.reload_dataloader(trainer, stage)
            if stage == "train":
                compat.refresh_progress_bar(trainer)
        size_before, size_after = before, result.size
    if stage == "train":
        accumulate, factor = apply_policies(
            trainer, schedule, policies, size_before, size_after, first_tune=state.last is None, say=say
        )
    else:
        accumulate, factor = 1, 1.0
    event = RetuneEvent(
        epoch=epoch,
        global_step=trainer.global_step,
        trigger=label,
        stage=stage,
        batch_size_before=before,
        batch_size_after=result.size,
        trials=list(result.trials),
        duration_s=time.perf_counter() - started,
        direction="cold" if cold else direction,
        max_fitting=result.max_fitting,
        min_failing=result.min_failing,
        peak_bytes=list(prober.peaks),
        budget_bytes=budget,
        accumulate=accumulate,
        effective_batch_size=accumulate * size_after,
        lr_factor=factor,
        mode=shown_mode,
        note="; ".join(n for n in (note, prediction.note) if n),
        objective=config.objective,
        samples_per_s=[] if config.objective != "throughput" else trial_rates(result.trials, prober.step_times),
        largest=largest if outcome is None else _reference_largest(outcome),
        **_bucket_fields(outcome, buckets),
        **prediction.event_fields(len(result.trials)),
    )
    state.size, state.last = result.size, result
    state.mean_batch = size_after if outcome is not None else None
    if result.model is not None:
        state.model = result.model
    return event, where


def apply_margin(plan: SearchPlan, found: int, memory_bound: bool) -> int:
    """The schedule's margin applied to one bucket's size, by the same rule as a fixed search: only a size
    that memory limited is cut (not one at the bucket's cap, its share of samples or ``max_val``)."""
    value = _apply_margin(plan, found, memory_bound)
    return found if value is None else value


@contextmanager
def _paused(buckets: TrainBuckets | None) -> Iterator[None]:
    """The user's own loader, not the bucketed one, for as long as the block runs."""
    if buckets is None:
        yield
        return
    with buckets.hook.paused():
        yield


def _bucket_summary(outcome: BucketOutcome) -> SearchResult:
    """The bucketed search as one ``SearchResult``: the longest samples' bucket's size (the one size that
    fits every batch, which the batch-size attribute holds), with every trial."""
    sizes = outcome.sizes
    longest = max(range(len(sizes)), key=lambda b: (outcome.buckets.largest[b], -b))
    size = sizes[longest] if all(s is not None for s in sizes) else None
    result = outcome.result
    trials = [Trial(t.batch_size, t.fits) for t in result.trials]
    return SearchResult(size, result.found[longest], result.min_failing[longest], trials)


def _bucket_fields(outcome: BucketOutcome | None, buckets: TrainBuckets | None) -> dict[str, Any]:
    if outcome is None or buckets is None:
        return {}
    return {
        "bucket_sizes": [int(s) for s in outcome.sizes if s is not None],
        "bucket_sizes_before": list(outcome.sizes_before),
        "bucket_bounds": list(outcome.buckets.largest),
        "bucket_samples": [len(m) for m in outcome.buckets.members],
        "trial_buckets": [t.bucket for t in outcome.result.trials],
        "samples_per_step": round(buckets.mean_batch(), 2),
        "bucket_largest": list(outcome.largest),
        "reference_bucket": outcome.reference,
        "padded_per_step": outcome.padded,
    }


def _reference_largest(outcome: BucketOutcome) -> int | None:
    """Throughput with buckets: the largest size that fit the reference bucket (the cap its selection had)."""
    if outcome.reference is None or not outcome.largest:
        return None
    return outcome.largest[outcome.reference]


def fastest_that_fits(prober: Prober, result: SearchResult, schedule: RetuneSchedule, last: int | None) -> SearchResult:
    """``objective: throughput``: among the sizes up to the one ``result`` applies, the fastest.

    Runs inside the probe session, timing the fit search's steps and adding the few trials the
    selection needs. A warm re-tune starts looking at ``last``, the size the previous search chose.
    """
    config = schedule.search
    assert result.size is not None
    start = last if config.warm_start else None
    steps = selection_steps(config.steps_per_trial)
    known = timed_sizes(result.trials, prober.step_times)
    choice = choose_fastest(
        ThroughputPlan(
            cap=result.size,
            tolerance=config.throughput_tolerance,
            start=start,
            max_trials=selection_budget(len(result.trials), timed=bool(known)),
        ),
        known,
        lambda size: prober.time(size, steps),
    )
    return with_choice(result, choice)


def apply_policies(
    trainer: Any,
    schedule: RetuneSchedule,
    policies: Policies,
    before: int,
    after: int,
    *,
    first_tune: bool,
    say: Say,
) -> tuple[int, float]:
    """Keep the effective batch size and/or scale learning rates (the schedule's ``apply``)."""
    policy = schedule.apply
    accumulate_before = compat.get_accumulation(trainer)
    accumulate = accumulate_before
    if policy.accumulate == "keep_effective":
        if policies.reference_effective is None:
            policies.reference_effective = after * accumulate_before  # the first tune sets the target
        else:
            plan = accumulation_for(policies.reference_effective, after)
            if not plan.exact:
                say(
                    f"keep_effective: {policies.reference_effective} is not a multiple of batch size {after}; "
                    f"accumulating {plan.accumulate} batches gives an effective batch size of {plan.effective}",
                    warn=True,
                )
            accumulate = plan.accumulate
        policies.accumulate = accumulate
        compat.set_accumulation(trainer, accumulate)
    # the learning rates you configured belong to the first tuned size (the model's starting batch size
    # is often a placeholder): scaling starts from there, like keep_effective's target
    factor = 1.0 if first_tune else lr_factor(policy.lr_scaling, before * accumulate_before, after * accumulate)
    scale_learning_rates(trainer.optimizers, compat.lr_holders(trainer), factor)
    return accumulate, factor


__all__ = ["Policies", "StageState", "apply_policies", "fastest_that_fits", "mode_and_limit", "search_stage"]
