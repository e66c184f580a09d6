"""The ``Batching`` seam: how one stage's batches are sized, one size or one size per group of samples.

:func:`~retune.search.stage.search_stage` is one path for every search: it plans, opens the probe
session, raises the error when nothing fits, applies the ``apply`` policies and records the event.
What differs between one batch size for every batch and one size per length bucket sits behind two
small protocols defined here:

* :class:`Batching` is what the callback hands the search: it fetches the stage's loader as the user
  built it and, per search, :meth:`~Batching.begin` returns a :class:`StageSearch`;
* :class:`StageSearch` runs the probes for one search, applies what it found (the loader reload) and
  adds its own fields to the event.

:class:`FixedBatching` (one size; ``search.batching: fixed`` and every stage but train) lives here.
The buckets implement the protocols in their own package (:mod:`retune.buckets.batching`), which
imports this one and not the reverse: a fixed search never enters the buckets' code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from retune import compat
from retune.events import Direction
from retune.messages import Say
from retune.probing.probe_batches import HeldSizes
from retune.probing.prober import Prober
from retune.schedule.models import RetuneSchedule
from retune.search.largest import Mode, SearchPlan, SearchResult, on_power_grid, run_model_search, run_search
from retune.search.predict_run import PredictionRecord, predicted_search
from retune.search.throughput import (
    ThroughputPlan,
    choose_fastest,
    selection_budget,
    selection_steps,
    timed_sizes,
    with_choice,
)

if TYPE_CHECKING:
    from retune.search.stage import StageState


@dataclass(frozen=True)
class Limits:
    """What a search knows of memory before its first probe (:func:`~retune.search.stage.mode_and_limit`)."""

    mode: Mode
    """The fixed search's mode (``model`` falls back to ``binsearch`` without a limit)."""
    limit: int | None
    """The bytes ``model`` mode predicts against (None: no model)."""
    note: str
    """Why the mode fell back, for the event."""
    budget: int | None
    """``memory.budget`` in bytes (None: not set)."""
    device: Any
    step_limit: int | None
    """The bytes a step may use, read once where the search starts: the budget, else what the device's caching
    allocator lets every rank have (:func:`~retune.search.stage.agreed_limits`: the smallest rank's, so
    that the ranks take the same decisions), else None. Every limit the search reads is this one."""


@dataclass
class SearchJob:
    """One search's inputs, the same for every kind of batching, handed to :meth:`StageSearch.run`."""

    trainer: Any
    stage: str
    schedule: RetuneSchedule
    plan: SearchPlan
    prober: Prober
    direction: Direction
    cold: bool
    state: StageState
    """What the stage's last search found (read only: the search path updates it)."""
    warn_once: Callable[[str, str], None] | None = None
    """``warn_once(where, message)``: says a reason once per fit (``search.predict``'s fallback)."""
    held: HeldSizes | None = None
    """How many samples the probes' batches held, by the size probed (None: not counted)."""


class StageSearch(Protocol):
    """One search of one stage under a kind of batching."""

    mode: str
    """The mode the event shows."""
    note: str
    """A note for the event (empty: none)."""
    needs_peaks: bool
    """Whether the probes must measure peak memory (a memory model is fitted)."""

    def describe(self, plan: SearchPlan) -> str:
        """What the announcement says after "searching the <stage> batch size"."""
        ...

    def run(self, job: SearchJob) -> SearchResult:
        """Probe inside the open probe session; the result's ``size`` is what the batch-size attribute gets."""
        ...

    def what(self, stage: str) -> str:
        """The batch size the error names when nothing fits."""
        ...

    def apply(self, job: SearchJob, before: int, size: int) -> tuple[int, int, int | None]:
        """Train at what :meth:`run` found (the attribute already holds ``size``; reload what changed).

        Returns the samples per step before and after (what the ``apply`` policies compare) and the
        stage state's ``mean_batch`` (None: one batch size).
        """
        ...

    def event_fields(self) -> dict[str, Any]:
        """The event's fields this batching fills (``largest``, per-bucket fields)."""
        ...


class Batching(Protocol):
    """How a stage's batches are sized: the callback passes one per search."""

    def loader(self, trainer: Any, stage: str) -> Any:
        """The stage's loader as the user built it (what the plan and the probe batches are drawn from)."""
        ...

    def begin(self, loader: Any, say: Say, limits: Limits) -> StageSearch:
        """Start one search of ``loader``'s stage (may fall back to one size, warning once)."""
        ...


class FixedBatching:
    """One batch size for every batch: ``search.batching: fixed``, and every stage but train."""

    def loader(self, trainer: Any, stage: str) -> Any:
        return compat.request_dataloader(trainer, stage)

    def begin(self, loader: Any, say: Say, limits: Limits) -> StageSearch:
        return FixedSearch(limits)


class FixedSearch:
    """One size from ``power``, ``binsearch`` or ``model``; with ``objective: throughput`` the fastest below it."""

    def __init__(self, limits: Limits) -> None:
        self.mode: str = limits.mode
        self.note = limits.note
        self.limit = limits.limit
        self.needs_peaks = limits.mode == "model"  # search.predict needs a budget or device stats: peaks anyway
        self.largest: int | None = None
        self.prediction = PredictionRecord()
        # search.predict: the limit a prediction aims at (the budget, else what the device's allocator gives every
        # rank: the ranks' second trace size, number of traces and predicted start must be the same)
        self.predict_limit = limits.limit if limits.limit is not None else limits.step_limit
        self._trials = 0

    def describe(self, plan: SearchPlan) -> str:
        return f"(from {plan.start})"

    def run(self, job: SearchJob) -> SearchResult:
        result = self._predicted(job) if job.schedule.search.predict == "auto" else None
        if result is not None:
            if self.mode == "power" and result.size is not None:  # the size power mode would end on, below a fit
                # power mode's sizes are init_val doubled (or halved), whatever size a warm start began from
                result.size = on_power_grid(job.schedule.search.init_val, result.size, job.plan.upper)
        elif self.mode == "model" and self.limit is not None:
            # after an unfreeze the old slope misleads more than it helps: measure the new one
            prior = None if job.cold or job.direction == "down" else job.state.model
            job.prober.record_phases = True  # a line per phase of the step, where the CPU tracker tells them apart
            prober = job.prober
            result = run_model_search(job.plan, prober.measure, self.limit, prior, prober.phases_at, prober.checked_at)
        else:
            result = run_search(job.plan, job.prober.fits)
        if job.schedule.search.objective == "throughput" and result.size is not None:
            self.largest = result.size
            result = fastest_that_fits(job.prober, result, job.schedule, None if job.cold else job.state.size)
        self._trials = len(result.trials)
        return self._as_held(job, result)

    def _as_held(self, job: SearchJob, result: SearchResult) -> SearchResult:
        """``result`` at most the most samples a fitting probe's batch held, where batches did not hold the size
        probed (a batch sampler of the user's own, a hook that ignores the attribute, a sampler that draws fewer
        samples per epoch): a trial's verdict is about the batches it ran, so a size none of them held was not
        verified. Said once per fit (a warning naming what decides the batches) and in every such event's note.

        Under DDP the ranks agree (one all-gather per search): a batch sampler of the user's own may give each rank
        other batches, and every rank must apply the same size; the smallest cap any rank found is applied."""
        held = job.held
        if held is None or result.size is None:  # the same on every rank: the verdicts are agreed
            return result
        cap = held.verified_cap([t.batch_size for t in result.trials if t.fits])
        local = None if cap is None else (cap, held.describe())
        found = [c for c in compat.all_gather_object(job.trainer, local) if c is not None]
        if not found:
            return result
        cap, seen = min(found)
        capped = min(result.size, cap)
        message = (
            f"the {job.stage} dataloader's batches do not hold the batch size retune probes: {seen}. A size no "
            f"probe batch held is not verified, so the {job.stage} batch size is {capped}"
            + (f" (not {result.size})" if capped != result.size else "")
            + ", the most samples a fitting probe's batch held; the batches training runs are the ones the loader "
            "makes, whatever the batch size"
        )
        if held.first_warning(job.stage) and job.warn_once is not None:
            job.warn_once(job.stage, message)
        self.note = "; ".join(n for n in (self.note, message) if n)
        result.size = capped
        if result.max_fitting is not None:
            result.max_fitting = min(result.max_fitting, cap)
        return result

    def what(self, stage: str) -> str:
        return f"{stage} batch size"

    def apply(self, job: SearchJob, before: int, size: int) -> tuple[int, int, int | None]:
        if size != before:
            compat.reload_dataloader(job.trainer, job.stage)
            if job.stage == "train":
                compat.refresh_progress_bar(job.trainer)
        return before, size, None

    def _predicted(self, job: SearchJob) -> SearchResult | None:
        """Predict, then verify (:mod:`retune.search.predict_run`); None: it fell back (the note says why)."""
        prober = job.prober
        result = predicted_search(
            job.trainer,
            prober.pl_module,
            prober,
            job.plan,
            self.predict_limit,
            stage=job.stage,
            same_batch=job.schedule.search.probe_samples == "largest",
            record=self.prediction,
            warn_once=job.warn_once or _say_nothing,
        )
        self.note = "; ".join(n for n in (self.note, self.prediction.note) if n)
        return result

    def event_fields(self) -> dict[str, Any]:
        return {"largest": self.largest, **self.prediction.event_fields(self._trials)}


def _say_nothing(where: str, message: str) -> None:
    """Where a search has no way to warn (a caller without ``warn_once``): the event's note still says it."""


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


__all__ = [
    "Batching",
    "FixedBatching",
    "FixedSearch",
    "Limits",
    "Say",
    "SearchJob",
    "StageSearch",
    "fastest_that_fits",
]
