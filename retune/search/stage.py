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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from retune import compat
from retune.allocator import process_limit, stats_for
from retune.errors import RetuneError
from retune.events import Direction, RetuneEvent
from retune.memory import device_total_bytes
from retune.probing.probe_batches import ProbeBatches
from retune.probing.prober import Prober, TrialReport
from retune.probing.timing import Clock
from retune.schedule.models import RetuneSchedule
from retune.search.batching import Batching, FixedBatching, Limits, Say, SearchJob
from retune.search.largest import (
    MemoryModel,
    Mode,
    SearchPlan,
    SearchResult,
    below_failure,
    failing_from,
    on_power_grid,
    plan_search,
)
from retune.search.policies import accumulation_for, cycle_mismatch, lr_factor, scale_learning_rates
from retune.search.throughput import trial_rates


@dataclass
class StageState:
    """What the last search of one stage found: applied size, bracket for a warm start, memory line."""

    size: int | None = None
    last: SearchResult | None = None
    model: MemoryModel | None = None
    mean_batch: int | None = None
    """Buckets: the samples per step the ``apply`` policies last saw (None: one batch size)."""
    failed_in_training: int | None = None
    """The smallest size a real training step ran out of memory at since the memory last shrank: no later search
    probes or applies it or a larger size (a probe on other batches may fit there; the training step did not)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "max_fitting": None if self.last is None else self.last.max_fitting,
            "min_failing": None if self.last is None else self.last.min_failing,
            "memory_model": None if self.model is None else [self.model.fixed, self.model.per_sample],
            "mean_batch": self.mean_batch,
            "failed_in_training": self.failed_in_training,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageState:
        size = data.get("size")
        has_last = data.get("max_fitting") is not None or data.get("min_failing") is not None
        last = SearchResult(size, data.get("max_fitting"), data.get("min_failing")) if has_last else None
        line = data.get("memory_model")
        model = None if line is None else MemoryModel(line[0], line[1])
        return cls(size, last, model, data.get("mean_batch"), data.get("failed_in_training"))


@dataclass
class Policies:
    """The ``apply`` policies' memory across searches: the effective batch size the first tune set, and
    the accumulation in force (re-applied at every epoch start: Lightning 1.9 resets it)."""

    reference_effective: int | None = None
    accumulate: int | None = None
    lr_attributes: list[str] = field(default_factory=list)
    """The model's ``lr``/``learning_rate`` that ``lr_scaling`` moved with the rates (the callback keeps their values
    in checkpoints: a resumed fit's ``hparams`` come from the constructor)."""


def mode_and_limit(
    schedule: RetuneSchedule, device: Any, budget: int | None, available: int | None
) -> tuple[Mode, int | None, str]:
    """The search to run and the memory limit ``model`` mode predicts against.

    ``model`` needs measured peaks and a limit: the budget, or ``available``, what the device's caching
    allocator lets every rank have (:func:`agreed_limits`: the smallest rank's
    :func:`retune.allocator.process_limit`, free memory plus its own reserved, within its memory fraction;
    not the device's total). Without both it falls back to ``binsearch`` and says so in the event.
    """
    mode = schedule.search.mode
    if mode != "model":
        return mode, budget, ""
    if budget is not None and device.type in ("cpu", "cuda"):
        return "model", budget, ""
    limit = available
    if limit is not None:
        return "model", limit, ""
    reason = "no memory.budget set" if budget is None else f"no memory statistics on {device.type}"
    return "binsearch", None, f"model mode needs measured peaks and a limit ({reason}); fell back to binsearch"


def device_limit(device: Any) -> int | None:
    """What this process can get from ``device``'s caching allocator, or None where it has none (CPU)."""
    stats = stats_for(device)
    return None if stats is None else process_limit(stats)


def agreed_limits(
    trainer: Any, device: Any, budget: int | None, dataset_len: int | None
) -> tuple[int | None, int | None]:
    """``(device limit, dataset length)`` for one search, the same on every rank: without a budget, what the device's
    caching allocator lets *every* rank have (the smallest rank's :func:`device_limit`: each rank's follows its own
    GPU's free memory, but the ranks must take the same decisions, or they pick different sizes or wait in
    collectives the others never call; None where a budget is set or no rank has a caching allocator), and the
    smallest rank's ``dataset_len`` (the samples one rank's epoch holds: the search's cap).

    Each rank counts its own epoch (``use_distributed_sampler=False`` with a dataset per rank, a sampler that
    draws a rank's own share): a cap read per rank gave the ranks different plans, so they probed different sizes
    and met in collectives with mismatched payloads. No batch of the smallest rank's epoch holds more, so no
    larger size can be verified on every rank. A rank whose length is unknown (an iterable dataset) puts no cap.
    One all-gather under DDP, whether or not a budget is set; none on one device."""
    own_limit = None if budget is not None else device_limit(device)
    if not compat.is_distributed(trainer):
        return own_limit, dataset_len
    gathered = compat.all_gather_object(trainer, (own_limit, dataset_len))
    limits = [int(v) for v, _ in gathered if v is not None]
    lengths = [int(n) for _, n in gathered if n is not None]
    return (min(limits) if limits else None), (min(lengths) if lengths else None)


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
    batching: Batching | None = None,
) -> tuple[RetuneEvent, str]:
    """Search ``stage``'s batch size (attribute ``name``), apply it, and return the event and where it ran.

    ``known_oom`` is ``(fitting, failed)`` from a real training step that ran out of memory at
    ``failed`` and trained in pieces of ``fitting``: the search starts below the failure. ``state``
    is updated in place; ``before_plan(loader)`` sees the stage's loader once (a warning about it).
    With ``search.objective: throughput`` the size applied is the fastest that fits (:mod:`retune.search.throughput`),
    its steps timed with ``clock``. ``batching`` sizes the batches (:mod:`retune.search.batching`; default
    one size for every batch: the buckets pass their own). On any failure the attribute is put back to what it was.
    """
    config = schedule.search
    batching = batching or FixedBatching()
    before = compat.get_batch_attr(trainer, pl_module, name)
    started = time.perf_counter()
    device = pl_module.device
    budget = schedule.memory.budget_bytes(device_total_bytes(device))
    loader = batching.loader(trainer, stage)
    # one limit and one cap for the search, the same on every rank (one all-gather)
    available, dataset_len = agreed_limits(
        trainer, device, budget, compat.dataset_length(loader, compat.sharded_across(trainer))
    )
    mode, limit, note = mode_and_limit(schedule, device, budget, available)
    if before_plan is not None:
        before_plan(loader)
    step_limit = budget if budget is not None else available
    search = batching.begin(loader, say, Limits(mode, limit, note, budget, device, step_limit))
    plan, direction = _plan(schedule, mode, dataset_len, state, cold, direction, known_oom)
    del loader
    epoch = trainer.current_epoch
    where = f"epoch {epoch}" if stage in ("train", "val") and compat.trainer_fn(trainer) == "fit" else label
    say(f"{where}: {label} fired, searching the {stage} batch size {search.describe(plan)}")
    prober = Prober(
        trainer,
        pl_module,
        name,
        config.steps_per_trial,
        budget,
        on_trial=on_trial,
        stage=stage,
        device_limit=available,
        track_memory=search.needs_peaks or stats_for(device) is not None,  # a caching allocator
        # the size the prober just wrote to the attribute: what each batch of the trial should hold
        arrange=lambda loader: probe_batches.arrange(
            loader, stage, prober.steps_per_trial, size=compat.get_batch_attr(trainer, pl_module, name)
        ),
        time_steps=config.objective == "throughput",
        clock=clock,
    )
    probe_batches.held.clear()  # the batches this search's probes hold, by the size probed
    job = SearchJob(
        trainer, stage, schedule, plan, prober, direction, cold, state, probe_batches.warn_once, probe_batches.held
    )
    try:
        with prober.session():
            result = search.run(job)
    except BaseException:
        compat.set_batch_attr(trainer, pl_module, name, before)
        raise
    if result.size is None:
        compat.set_batch_attr(trainer, pl_module, name, before)
        # a search without peaks of its own (binsearch, power) measured them in the prober, trial by trial
        peaks = list(prober.peaks) if not any(result.peaks) and len(prober.peaks) == len(result.trials) else None
        raise _nothing_fits(search.what(stage), label, epoch, result, budget, peaks)
    compat.set_batch_attr(trainer, pl_module, name, result.size)
    size_before, size_after, mean_batch = search.apply(job, before, result.size)
    note = search.note
    if result.unsettled:  # the size is what fit of the sizes tried, not the largest that fits: say so
        stopped = (
            f"search.max_trials ({config.max_trials}) ran out before the {stage} search settled "
            f"({result.unsettled}); raise search.max_trials to let it settle"
        )
        say(f"{where}: {stopped}", warn=True)
        note = "; ".join(n for n in (note, stopped) if n)
    accumulate, factor = 1, 1.0
    accumulate_was = compat.get_accumulation(trainer)
    if stage == "train":
        accumulate, factor = apply_policies(
            trainer,
            schedule,
            policies,
            size_before,
            size_after,
            first_tune=state.last is None,
            trained=trainer.global_step > 0 or trainer.current_epoch > 0,
            say=say,
        )
    if stage == "train" and (size_before, compat.get_accumulation(trainer)) != (size_after, accumulate_was):
        _check_cycles(trainer, where, size_before, size_after, say, first=state.last is None)
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
        mode=search.mode,
        note=note,
        objective=config.objective,
        samples_per_s=[] if config.objective != "throughput" else trial_rates(result.trials, prober.step_times),
        **search.event_fields(),
    )
    state.size, state.last, state.mean_batch = result.size, result, mean_batch
    if result.model is not None:
        state.model = result.model
    return event, where


def _plan(
    schedule: RetuneSchedule,
    mode: Mode,
    dataset_len: int | None,
    state: StageState,
    cold: bool,
    direction: Direction,
    known_oom: tuple[int, int] | None,
) -> tuple[SearchPlan, Direction]:
    """Where the search starts: cold, warm from the stage's last search, or below a real step's failure.

    A size a real training step ran out of memory at stays out of reach of every later search until a trigger
    says the memory shrank (``up``): a search on other batches (the first ones, a milestone's) may see it fit."""
    config = schedule.search
    previous = None if cold else state.last
    if direction == "up":
        state.failed_in_training = None  # the memory shrank: a size that failed in training may fit now
    if known_oom is not None:
        fitting, failed = known_oom  # a real step failed at `failed`, and pieces of `fitting` ran
        known = state.failed_in_training
        if known is not None:  # a size the last search verified after a real failure failed too: its probes cannot
            failed = failing_from(fitting, failed)  # see what fails, so halfway to what trained for real
        previous = SearchResult(state.size, min(fitting, failed - 1), failed)
        direction = "down"
        state.failed_in_training = failed if known is None else min(known, failed)
    plan = plan_search(
        mode=mode,
        init_val=config.init_val,
        max_trials=config.max_trials,
        margin=config.margin,
        max_val=config.max_val,
        dataset_len=dataset_len,
        warm_start=config.warm_start or known_oom is not None,
        previous=previous,
        direction=direction,
    )
    capped = below_failure(plan, state.failed_in_training)
    if mode == "power" and capped.start != plan.start:  # on power's grid, as its sizes are (15 -> 8 for init_val 16)
        capped = replace(capped, start=on_power_grid(config.init_val, capped.start, capped.upper))
    return capped, direction


def _check_cycles(trainer: Any, where: str, before: int, size: int, say: Say, *, first: bool) -> None:
    """Warn where a schedule built for a fixed number of optimizer steps (``OneCycleLR``) no longer fits the fit
    now that the batch size (or the accumulation) changed: ``configure_optimizers`` runs before the search at
    fit start, so a ``total_steps`` taken from ``trainer.estimated_stepping_batches`` counts the placeholder's
    steps, and a later search changes the steps per epoch again (unless ``keep_effective`` keeps them)."""
    remaining = compat.remaining_optimizer_steps(trainer)
    if remaining is None:
        return
    if first:
        how = (
            f"configure_optimizers ran before this search, at batch size {before}, so a total_steps taken from "
            "trainer.estimated_stepping_batches counts that size's steps. Start the model at the size found "
            f"({size}), or use a schedule measured in epochs"
        )
    else:
        how = (
            "its total_steps was fixed when it was built. Use apply.accumulate: keep_effective (the steps per "
            "epoch stay as they were), or a schedule measured in epochs"
        )
    for scheduler in compat.cycle_schedulers(trainer):
        problem = cycle_mismatch(int(scheduler.total_steps), int(getattr(scheduler, "last_epoch", 0)), remaining)
        if problem is not None:
            say(
                f"{where}: {type(scheduler).__name__} does not fit the run at batch size {size}: {problem}; {how}",
                warn=True,
            )


def _nothing_fits(
    what: str,
    label: str,
    epoch: int,
    result: SearchResult,
    budget: int | None,
    trial_peaks: Sequence[int | None] | None = None,
) -> RetuneError:
    smallest = min(t.batch_size for t in result.trials) if result.trials else 1
    count = len(result.trials)
    within = "memory" if budget is None else f"memory.budget ({budget / 2**20:.4g} MiB)"
    # a probe fails by running out of memory or by measuring over the limit (a budget, a predicted search's
    # probes): say which where the trial measured a peak (``trial_peaks``: the prober's, where the result has none)
    measured = result.peaks if trial_peaks is None else trial_peaks
    peaks = {t.batch_size: p for t, p in zip(result.trials, measured, strict=False) if p is not None}
    peak = peaks.get(smallest)
    how = "did not fit" if peak is None else f"peaked at {peak / 2**20:.4g} MiB, over the limit"
    return RetuneError(
        f"no {what} fits in {within} after trigger {label!r} at epoch {epoch}: the smallest "
        f"size tried, {smallest}, {how} ({count} trial{'' if count == 1 else 's'}). Free memory (freeze "
        "more layers, lower precision, shorter inputs)"
        + ("" if budget is None else ", raise memory.budget")
        + " or raise search.max_trials if it stopped early."
    )


def apply_policies(
    trainer: Any,
    schedule: RetuneSchedule,
    policies: Policies,
    before: int,
    after: int,
    *,
    first_tune: bool,
    trained: bool = False,
    say: Say,
) -> tuple[int, float]:
    """Keep the effective batch size and/or scale learning rates (the schedule's ``apply``).

    The first tune sets the target, and the learning rates belong to it, unless the run has ``trained``
    already: a first search after training steps (an ``oom`` re-search, an epoch milestone without
    ``fit_start``) keeps the effective batch size and the rates the run trained with, at ``before``."""
    policy = schedule.apply
    accumulate_before = compat.get_accumulation(trainer)
    accumulate = accumulate_before
    sets_target = first_tune and not trained
    if policy.accumulate == "keep_effective":
        if policies.reference_effective is None and sets_target:
            policies.reference_effective = after * accumulate_before  # the first tune sets the target
        else:
            if policies.reference_effective is None:  # the size the run trained at is the target
                policies.reference_effective = before * accumulate_before
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
    factor = 1.0 if sets_target else lr_factor(policy.lr_scaling, before * accumulate_before, after * accumulate)
    rates = [float(g[k]) for o in trainer.optimizers for g in o.param_groups for k in ("lr", "initial_lr") if k in g]
    scale_learning_rates(trainer.optimizers, compat.lr_holders(trainer), factor)
    # a model's `lr`/`learning_rate` that names a group's rate moves with it (a warm-up in optimizer_step reads it)
    scaled = compat.scale_lr_attributes(trainer, trainer.lightning_module, rates, factor)
    policies.lr_attributes = sorted({*policies.lr_attributes, *scaled})
    return accumulate, factor


__all__ = [
    "Policies",
    "StageState",
    "agreed_limits",
    "apply_policies",
    "device_limit",
    "mode_and_limit",
    "search_stage",
]
