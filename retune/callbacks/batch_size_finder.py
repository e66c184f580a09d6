"""``ScheduledBatchSizeFinder``: the Lightning callback that re-runs the batch-size search on triggers.

Why not a ``BatchSizeFinder`` subclass: Lightning moves those to the front of the callback list,
so at an epoch start they search *before* ``BackboneFinetuning`` unfreezes, and once steps have
been taken their loop-based trials run zero batches (Lightning issue #21903). This callback puts
itself after every other callback and runs its own probe steps, so it searches the model as the
epoch will train it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from retune import compat
from retune.allocator import EXPANDABLE_ADVICE, expandable_segments, stats_for
from retune.buckets.batching import BucketBatching
from retune.buckets.train_buckets import BucketState, DataChange, TrainBuckets
from retune.callbacks.base import EventReport, RetuneCallback
from retune.callbacks.data_follow import Change, keep_sizes, train_data_change
from retune.callbacks.oom_recovery import OomRecovery, split_state
from retune.callbacks.stage_attrs import StageAttrs
from retune.callbacks.trainer_view import training_view
from retune.errors import RetuneError
from retune.events import Direction, RetuneEvent, Trial
from retune.prediction.reuse import forget as forget_traces
from retune.probing.probe_batches import ProbeBatches
from retune.probing.timing import Clock
from retune.recovery.split import SplitFn
from retune.reports import batch_size as report
from retune.schedule.loading import ScheduleSource
from retune.schedule.triggers import Trigger, evaluate
from retune.search.policies import check_accumulation
from retune.search.stage import Policies, StageState, search_stage


class ScheduledBatchSizeFinder(RetuneCallback):
    """Re-run the largest-batch-size search whenever the schedule's triggers fire.

    Args:
        schedule: a schedule file (YAML, JSON or TOML), a dict, or a :class:`~retune.RetuneSchedule`.
        triggers: extra :class:`~retune.Trigger` objects, checked after the schedule's own.
        verbose: print one line per trial and a summary per search (rank zero only).
        out_dir: where ``history.json``, ``history.csv`` and ``batch_size.png`` go at fit
            end (default: ``retune/`` in the first logger's folder; no logger and no ``out_dir``: no files).
        write_report: write those files (``False``: keep ``history`` in memory and checkpoints only).
        split_batch: with the ``oom`` trigger, how to cut a batch of a type retune does not know into
            micro-batches: ``fn(batch, pieces) -> list of micro-batches`` (see :mod:`retune.recovery.split`).
        sample_size: ``fn(sample) -> int``, the size of ``dataset[i]`` that ``search.probe_samples: largest``
            ranks samples by (default: the number of elements in its tensors, numbers and strings).
        clock: with ``search.objective: throughput``, the timer probe steps are read with (default
            ``time.perf_counter``); a simulation or a test passes one that advances by a known step time.
        loss_items: with the ``oom`` trigger's ``loss_reduction: token_mean``, what the loss averages over:
            ``fn(batch) -> int`` (or ``"labels"``, ``"shifted_labels"``; see :mod:`retune.recovery.loss_items`), in
            place of the trigger's ``loss_items``.

    Example::

        from lightning.pytorch import Trainer
        from lightning.pytorch.callbacks import BackboneFinetuning
        from retune import ScheduledBatchSizeFinder

        finder = ScheduledBatchSizeFinder("schedules/freeze_unfreeze.yaml")
        trainer = Trainer(callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=5), finder])
        trainer.fit(model, datamodule=dm)
        finder.batch_size   # the train batch size in use now
        finder.history      # one RetuneEvent per search, oldest first

    The batch size is per device (per DDP process), like every Lightning batch size.

    Logged metrics (every logger's ``log_metrics``, at the step the search ran, rank zero's values):

    ==============================  ===================================  =========================================
    key                             when                                 value
    ==============================  ===================================  =========================================
    ``retune/batch_size``           every search                         the size applied
    ``retune/search_seconds``       every search                         how long the search took
    ``retune/trials``               every search                         probes run
    ``retune/batch_size_bucket<i>`` ``batching: buckets``                bucket *i*'s size, shortest samples first
    ``retune/samples_per_step``     ``batching: buckets``                mean samples per step over an epoch
    ``retune/padded_per_step``      buckets with ``throughput``          the cap on padded work per step
    ``retune/samples_per_s``        ``objective: throughput``            the chosen size's measured rate
    ``retune/oom_micro_batches``    a step recovered by ``oom``          micro-batches it was split into
    ==============================  ===================================  =========================================
    """

    _retune_rank = 1  # after every other callback, before a ScheduledLRFinder (retune.callbacks.ordering)
    _report: ClassVar[EventReport] = report  # each event's summary line, logged metrics, and the table at fit end

    def __init__(
        self,
        schedule: ScheduleSource,
        triggers: Sequence[Trigger] = (),
        verbose: bool = True,
        out_dir: str | Path | None = None,
        write_report: bool = True,
        split_batch: SplitFn | None = None,
        sample_size: Callable[[Any], int] | None = None,
        clock: Clock | None = None,
        loss_items: str | Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(schedule, triggers, verbose, out_dir, write_report)
        for name, value in (("split_batch", split_batch), ("clock", clock)):
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be a function or None, got {value!r}")
        self.clock = clock
        self.probe_batches = ProbeBatches.from_schedule(self.schedule, schedule, sample_size, say=self._say)
        search = self.schedule.search
        self._buckets = TrainBuckets(search.buckets, self.probe_batches) if search.batching == "buckets" else None
        self.split_batch = split_batch
        self._attrs = StageAttrs(self.schedule, self._say)
        self._recovery = OomRecovery.for_triggers(  # the `oom` trigger's step recovery; None without the trigger
            self.triggers,
            self.schedule,
            schedule,
            loss_items,
            split_batch=split_batch,
            buckets=self._buckets,
            say=self._say,
            attr=self._attrs.name,
            record=self._record,
        )
        self.history: list[RetuneEvent] = []
        self.report_paths: report.OutputPaths | None = None
        self._trial_no = 0
        self._stages: dict[str, StageState] = {}
        self._policies = Policies()
        self._eval_rng_undo: Callable[[], None] | None = None

    @property
    def batch_size(self) -> int | None:
        """The train batch size retune last applied (None before the first search)."""
        return self._stage("train").size

    @property
    def batch_sizes(self) -> dict[str, int]:
        """The last size applied per stage, e.g. ``{"train": 76, "val": 1024}``."""
        return {stage: state.size for stage, state in self._stages.items() if state.size is not None}

    @property
    def bucket_sizes(self) -> list[int]:
        """With ``search.batching: buckets``: each length bucket's train batch size, shortest samples first
        (empty before the first search, with ``fixed``, or where the loader could not be bucketed)."""
        return [] if self._buckets is None else list(self._buckets.state.sizes)

    # -- Lightning hooks -----------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._start_setup(trainer, pl_module, "batch-size search", stage):
            return
        compat.check_strategy(trainer)
        if self._recovery is not None:
            self._recovery.check_strategy(trainer)
        self._attrs.check_setup(trainer, pl_module, stage)
        if stage != "fit":
            searched = {"validate": "val", "test": "test", "predict": "predict"}.get(stage)
            if searched in self.schedule.stages:  # the loop's draws for its loader, kept for the rebuilt one's
                self._eval_rng_undo = compat.watch_eval_iterator(trainer, searched)
            return
        self._check_trigger_sources(trainer)
        if self._recovery is not None:
            self._recovery.check_fit(pl_module)
            steps = compat.truncated_bptt_steps(trainer, pl_module)
            if steps:
                raise RetuneError(
                    f"the `oom` trigger cannot recover a step of truncated backpropagation through time "
                    f"(truncated_bptt_steps={steps}): each split starts from the hidden state the split before left "
                    "for the whole batch, which micro-batches of it cannot share; remove `oom` from the schedule's "
                    "triggers"
                )
        check_accumulation(self.schedule.apply.accumulate, compat.accumulation_is_scheduled(trainer))
        if self._buckets is not None and "train" in self.schedule.stages:
            self._buckets.install(trainer)
        self._move_last(trainer)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._disabled:
            return
        forget_traces(pl_module)  # a fit's first predicted search traces: nothing carried from another fit
        count = len(trainer.optimizers)
        if "train" in self.schedule.stages and pl_module.automatic_optimization and count > 1:
            raise RetuneError(  # pytorch-lightning 1.9 steps each in turn (optimizer_idx); 2.x refuses it itself
                f"ScheduledBatchSizeFinder probes a training step of one optimizer under automatic optimization; this "
                f"run has {count}, which the first train search could not probe. Use one optimizer with a param "
                "group per part of the model, or manual optimization"
            )
        self._move_last(trainer)  # again: another callback's setup may have rebuilt the list
        no_slack = self.schedule.search.margin == 0 or self.schedule.search.mode == "power"  # power applies none
        if no_slack and stats_for(pl_module.device) is not None and not expandable_segments():
            self._say(EXPANDABLE_ADVICE, warn=True)  # a caching allocator, no slack for its fragmentation
        self._fit_start(trainer, pl_module)

    def _resume(self, trainer: Any, pl_module: Any) -> None:
        """The sizes, accumulation and buckets of the checkpoint, before Lightning builds the train loader; a
        checkpoint from before the first search leaves the fit-start search to come."""
        super()._resume(trainer, pl_module)
        if not self.batch_sizes:
            self._fit_starting = True
            return
        # the val size only onto an attribute of its own in this schedule: a shared one is the train size's (a val size
        # the checkpoint tuned on its own attribute, or a standalone validate() found, would overwrite it)
        own_val = "val" in self.schedule.stages and self._attrs.separate_val(trainer, pl_module)
        for stage in ("train", "val") if own_val else ("train",):
            if stage in self.batch_sizes:
                name = self._attrs.name(trainer, pl_module, stage)
                compat.set_batch_attr(trainer, pl_module, name, self.batch_sizes[stage])
        if self._policies.accumulate is not None:
            compat.set_accumulation(trainer, self._policies.accumulate)
        if self._buckets is not None and self._buckets.hook.installed:
            self._buckets.restore(trainer, self._say)  # the loader Lightning builds next is bucketed

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._disabled:
            return
        if compat.resumed_batches(trainer):
            # Lightning 1.9 runs this hook again when a fit resumes mid-epoch (2.x does not): the epoch's searches
            # ran before the checkpoint, and its plan (buckets: continued from the next batch) and splits go on
            return
        if self._recovery is not None:
            self._recovery.new_epoch()
            self._recovery.share_failures(trainer)
        with self.probe_batches.cache.checking_once():  # the data is checked once, whatever searches follow
            change = train_data_change(
                trainer,
                tuned="train" in self.schedule.stages,
                buckets=self._buckets,
                probe_batches=self.probe_batches,
                train_size=self._stage("train").size,
                say=self._say,
            )
            view = training_view(trainer, pl_module, self._fit_starting)
            self._fit_starting = False
            # every rank updates its triggers' baselines; rank zero's decision is the one all ranks follow
            firing = compat.broadcast_object(trainer, evaluate(self.triggers, view))
            if firing is not None:
                cold = "fit_start" in firing.kinds
                label = firing.label if change is None else f"{firing.label}+data_changed"
                if "train" in self.schedule.stages:
                    self._search(trainer, pl_module, "train", label, firing.direction, cold)
                if "val" in self.schedule.stages and self._attrs.separate_val(trainer, pl_module):
                    self._search(trainer, pl_module, "val", firing.label, "unknown", cold)
            elif change is not None:
                self._follow_data(trainer, pl_module, change)
        if self._recovery is not None:
            self._recovery.trigger.consume()  # used by the train search above, or of no use (train is not tuned)
        if self._policies.accumulate is not None:
            compat.set_accumulation(trainer, self._policies.accumulate)  # Lightning 1.9 resets it every epoch
        if self._buckets is not None:
            self._buckets.epoch_started(trainer)  # buckets over the user sampler's draws: this epoch's batch count

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._disabled and self._recovery is not None:
            self._recovery.start_train(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._uninstall()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._recovery is not None and not self._disabled:
            self._recovery.note_unrecovered(exception)
        self._uninstall()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        searched = compat.trainer_fn(trainer) == "validate" and not trainer.sanity_checking  # not inside fit
        self._eval_start(trainer, pl_module, "val", "validate_start" if searched else "")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._unguard_eval()

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._eval_start(trainer, pl_module, "test", "test_start")

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._unguard_eval()

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._eval_start(trainer, pl_module, "predict", "predict_start")

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self._unguard_eval()

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._common_state(),
            "stages": {stage: state.to_dict() for stage, state in self._stages.items()},
            "reference_effective": self._policies.reference_effective,
            "accumulate": self._policies.accumulate,
            # the split the epoch keeps after a recovered OOM: a run resumed mid-epoch need not fail again first
            **(split_state(None) if self._recovery is None else self._recovery.state_dict()),
            "buckets": None if self._buckets is None else self._buckets.state.to_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._load_common_state(state_dict, RetuneEvent.from_dict):
            return
        self._stages = {stage: StageState.from_dict(s) for stage, s in state_dict.get("stages", {}).items()}
        self._policies = Policies(state_dict.get("reference_effective"), state_dict.get("accumulate"))
        if self._recovery is not None:
            self._recovery.load_state_dict(state_dict)
        saved_buckets = state_dict.get("buckets")
        if self._buckets is not None and saved_buckets:
            self._buckets.state = BucketState.from_dict(saved_buckets)
        self._loaded()

    def _unguard_eval(self) -> None:
        if self._recovery is not None:
            self._recovery.unguard_eval()
        self._unwatch_eval()

    def _unwatch_eval(self) -> None:
        undo, self._eval_rng_undo = self._eval_rng_undo, None
        if undo is not None:
            undo()

    def _uninstall(self) -> None:
        if self._buckets is not None:
            self._buckets.uninstall()
        if self._recovery is not None:
            self._recovery.uninstall()
        self._unwatch_eval()

    def _follow_data(self, trainer: Any, pl_module: Any, change: Change) -> None:
        """Train the changed data within the memory found (``retune.callbacks.data_follow``): the train size (each
        bucket's) searched again when the samples got longer (trigger ``data_changed``), else kept."""
        if not change.search:
            keep_sizes(trainer, change, self._buckets, self._stage("train").size, self._say)
            return
        what = "the buckets" if isinstance(change, DataChange) else "the batch size"
        where = f"epoch {trainer.current_epoch}: the train samples' sizes changed ({change.describe()})"
        self._say(f"{where}: searching {what} again")
        self._search(trainer, pl_module, "train", "data_changed", "unknown", cold=False)

    # -- the search ----------------------------------------------------------------------------

    def _eval_start(self, trainer: Any, pl_module: Any, stage: str, label: str) -> None:
        """An evaluation loop starts: search its batch size (``label``, the event's trigger; empty: no search),
        then guard its steps against running out of memory (the ``oom`` trigger)."""
        if self._disabled:
            return
        if label and stage in self.schedule.stages:
            self._search(trainer, pl_module, stage, label, "unknown", cold=self._stage(stage).last is None)
        if self._recovery is not None:
            self._recovery.guard_eval(trainer, pl_module, stage)

    def _search(self, trainer: Any, pl_module: Any, stage: str, label: str, direction: Direction, cold: bool) -> None:
        name = self._attrs.name(trainer, pl_module, stage)
        oom = None if self._recovery is None else self._recovery.trigger
        known = oom.consume() if oom is not None and stage == "train" and "oom" in label else None
        self._trial_no = 0
        self.probe_batches.attribute = self._attrs.describe(trainer, pl_module, stage)
        with self.probe_batches.cache.checking_once():  # a dataset is fingerprinted once, not at every trial
            event, where = search_stage(
                trainer,
                pl_module,
                schedule=self.schedule,
                stage=stage,
                name=name,
                label=label,
                direction=direction,
                cold=cold,
                state=self._stage(stage),
                policies=self._policies,
                probe_batches=self.probe_batches,
                known_oom=known,
                on_trial=self._report_trial,
                say=self._say,
                before_plan=lambda loader: self._attrs.warn_duplicate(trainer, pl_module, name, stage, loader),
                clock=self.clock,
                batching=BucketBatching(self._buckets) if self._buckets is not None and stage == "train" else None,
            )
        if self._policies.lr_attributes:  # lr_scaling moved the model's lr/learning_rate: checkpoints keep them
            self._wrote_lr(trainer, pl_module, self._policies.lr_attributes)
        if stage == "train" and event.batch_size_after != event.batch_size_before:
            self._follow_in_validation(trainer, pl_module, name)
        self._record(trainer, event, where)

    def _follow_in_validation(self, trainer: Any, pl_module: Any, name: str) -> None:
        """Validation inside fit whose loader reads the train attribute (no ``val_batch_size`` of its own) is rebuilt
        at the size found, as Lightning's ``BatchSizeFinder`` rebuilds it: the loader built before the search (the
        sanity check's, at the starting size) validated at that size for the whole fit (128 where training ran 40;
        a large placeholder then runs out of memory in validation)."""
        if compat.trainer_fn(trainer) == "fit" and self._attrs.name(trainer, pl_module, "val") == name:
            compat.reload_dataloader(trainer, "val")

    # -- helpers -------------------------------------------------------------------------------

    def _stage(self, stage: str) -> StageState:
        return self._stages.setdefault(stage, StageState())

    def _report_trial(self, size: int, fits: bool, peak: int | None, samples_per_s: float | None = None) -> None:
        self._trial_no += 1
        bucket = None if self._buckets is None else self._buckets.current_bucket
        self._say("  " + report.format_trial(self._trial_no, size, fits, peak, samples_per_s, bucket=bucket))

    def _write_files(self, trainer: Any, out: Path) -> tuple[report.OutputPaths, str]:
        budget = next((e.budget_bytes for e in reversed(self.history) if e.budget_bytes is not None), None)
        paths = report.write_outputs(self.history, out, end_step=trainer.global_step, budget_bytes=budget)
        return paths, "history, CSV and plot"


__all__ = ["ScheduledBatchSizeFinder", "Trial"]
