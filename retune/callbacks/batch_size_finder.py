"""``ScheduledBatchSizeFinder``: the Lightning callback that re-runs the batch-size search on triggers.

Why not a ``BatchSizeFinder`` subclass: Lightning moves those to the front of the callback list,
so at an epoch start they search *before* ``BackboneFinetuning`` unfreezes, and once steps have
been taken their loop-based trials run zero batches (Lightning issue #21903). This callback puts
itself after every other callback and runs its own probe steps, so it searches the model as the
epoch will train it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from retune import compat, messages
from retune.allocator import EXPANDABLE_ADVICE, expandable_segments, stats_for
from retune.buckets.batching import BucketBatching
from retune.buckets.train_buckets import BucketState, TrainBuckets
from retune.callbacks.base import RetuneCallback, load_trigger_states, print_above_bar, report_dir, say, trigger_states
from retune.callbacks.ordering import move_retune_last
from retune.callbacks.trainer_view import training_view
from retune.compat import hooks as hook_calls
from retune.compat.closure_runner import install_closure_runner
from retune.distributed.grad_sync import SyncedSteps
from retune.errors import FieldProblem, RetuneError, ScheduleError
from retune.events import Direction, RetuneEvent, Trial
from retune.oom import is_oom_error
from retune.probing.batch_size_attr import duplicate_attr_message, loader_batch_size
from retune.probing.probe_batches import ProbeBatches
from retune.probing.timing import Clock
from retune.recovery.loss_items import ItemsFn, resolve_items_fn
from retune.recovery.oom_sites import add_note, oom_site, why_not_recovered
from retune.recovery.split import SplitFn, join_detached
from retune.recovery.step_recovery import EvalStepRecovery, Recovered, TrainStepRecovery
from retune.reports import batch_size as report
from retune.schedule.loading import ScheduleSource, load_schedule
from retune.schedule.triggers import OutOfMemory, TrainingView, Trigger, build_triggers, evaluate
from retune.search.stage import Policies, StageState, search_stage

log = logging.getLogger("retune")


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

    Logged metrics (through ``pl_module.log`` on every logger, rank zero's values):

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
        self.schedule = load_schedule(schedule)
        self.clock = clock
        self.probe_batches = ProbeBatches.from_schedule(self.schedule, schedule, sample_size, say=self._say)
        search = self.schedule.search
        self._buckets = TrainBuckets(search.buckets, self.probe_batches) if search.batching == "buckets" else None
        self.triggers: list[Trigger] = [*build_triggers(self.schedule.triggers), *triggers]
        self.split_batch = split_batch
        self._oom: OutOfMemory | None = next((t for t in self.triggers if isinstance(t, OutOfMemory)), None)
        self._items_fn = self._resolve_items(schedule, loss_items)
        self._train_recovery: TrainStepRecovery | None = None
        self._eval_recovery: EvalStepRecovery | None = None
        self._undo: list[Callable[[], None]] = []
        self._eval_undo: Callable[[], None] | None = None  # no lambda: ddp_spawn pickles the callback
        self._resumed_split: tuple[int | None, int] = (None, 1)
        self._resumed_splits: dict[Any, tuple[int | None, int]] = {}
        self._split_resumed = False
        self.verbose = verbose
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.write_report = write_report
        self.report_paths: report.OutputPaths | None = None
        self._trial_no = 0
        self.history: list[RetuneEvent] = []
        self._stages: dict[str, StageState] = {}
        self._policies = Policies()
        self._fit_starting = False
        self._restored = False
        self._disabled = False
        self._is_global_zero = True
        self._warned_attrs: set[str] = set()  # batch-size attributes already reported as set in several places

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
        self._is_global_zero = bool(getattr(trainer, "is_global_zero", True))
        messages.set_rank(int(getattr(trainer, "global_rank", 0)))
        self._disabled = bool(trainer.fast_dev_run)
        if self._disabled:
            self._say("fast_dev_run is on: skipping every batch-size search in this run", warn=True)
            return
        compat.check_strategy(trainer)
        if self._oom is not None:  # every stage: evaluation steps are recovered in micro-batches too
            compat.check_oom_trigger(trainer)
        if compat.unshare_spawned_weights(trainer, pl_module):
            log.debug("ddp_spawn left this rank's CPU weights in shared memory; gave it its own copy")
        stages = {"fit": ["train", "val"], "validate": ["val"], "test": ["test"], "predict": ["predict"]}[stage]
        for tuned in (s for s in stages if s in self.schedule.stages):
            if tuned == "val" and stage == "fit" and not self._separate_val(trainer, pl_module):
                continue
            compat.check_source(trainer, tuned)
            hook_calls.check_probeable(trainer, pl_module, tuned)
            name = self._attr(trainer, pl_module, tuned)
            if not compat.has_batch_attr(trainer, pl_module, name):
                raise RetuneError(
                    f"batch_arg_name {name!r} not found on the model, model.hparams, the datamodule or "
                    f"datamodule.hparams; set `batch_arg_name` in the schedule to the attribute your "
                    f"{compat.dataloader_hook(tuned)}() reads"
                )
        if stage != "fit":
            return
        if self._oom is not None and not pl_module.automatic_optimization:
            raise RetuneError(
                "the `oom` trigger recovers a training step by re-running it in micro-batches inside Lightning's "
                "closure, which manual optimization does not use; remove `oom` from the schedule's triggers, or "
                "catch torch.OutOfMemoryError in your training_step (retune.recovery.split.split_batch splits a batch)"
            )
        if self.schedule.apply.accumulate == "keep_effective" and compat.accumulation_is_scheduled(trainer):
            raise RetuneError(
                "apply.accumulate: keep_effective sets gradient accumulation itself and cannot share it with a "
                "GradientAccumulationScheduler (or a dict `accumulate_grad_batches`); remove one of the two"
            )
        if self._buckets is not None and "train" in self.schedule.stages:
            self._buckets.install(trainer)
        self._move_last(trainer)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._disabled:
            return
        self._move_last(trainer)  # again: another callback's setup may have rebuilt the list
        no_slack = self.schedule.search.margin == 0 or self.schedule.search.mode == "power"  # power applies none
        if no_slack and stats_for(pl_module.device) is not None and not expandable_segments():
            self._say(EXPANDABLE_ADVICE, warn=True)  # a caching allocator, no slack for its fragmentation
        if self._restored and self.batch_sizes:
            for stage, size in self.batch_sizes.items():
                if stage in ("train", "val"):
                    compat.set_batch_attr(trainer, pl_module, self._attr(trainer, pl_module, stage), size)
            if self._policies.accumulate is not None:
                compat.set_accumulation(trainer, self._policies.accumulate)
            if self._buckets is not None and self._buckets.hook.installed:
                self._buckets.restore(trainer, self._say)  # the loader Lightning builds next is bucketed
            self._fit_starting = False
        else:
            self._fit_starting = True
        self._restored = False

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._disabled:
            return
        if self._train_recovery is not None:
            # each epoch starts whole, at the size the search picks now; a run resumed mid-epoch keeps its split
            self._train_recovery.new_epoch(keep_split=self._split_resumed)
            self._split_resumed = False
        if self._oom is not None and compat.is_distributed(trainer):
            # a rank that ran out of memory tells the others, so rank zero's trigger decision includes it
            failures = {} if self._buckets is None else self._buckets.failures
            gathered = compat.all_gather_object(trainer, (self._oom.consume(), failures))
            for known, _ in gathered:
                if known is not None:
                    self._oom.record(failed_size=known[1], fitting_size=known[0])
            if self._buckets is not None:
                self._buckets.merge_failures([bucket_failures for _, bucket_failures in gathered])
        view = self._view(trainer, pl_module)
        self._fit_starting = False
        # every rank updates its triggers' baselines; rank zero's decision is the one all ranks follow
        firing = compat.broadcast_object(trainer, evaluate(self.triggers, view))
        if firing is not None:
            cold = "fit_start" in firing.kinds
            if "train" in self.schedule.stages:
                self._search(trainer, pl_module, "train", firing.label, firing.direction, cold)
            if "val" in self.schedule.stages and self._separate_val(trainer, pl_module):
                self._search(trainer, pl_module, "val", firing.label, "unknown", cold)
        if self._oom is not None:
            self._oom.consume()  # used by the train search above, or of no use (train is not tuned)
        if self._policies.accumulate is not None:
            compat.set_accumulation(trainer, self._policies.accumulate)  # Lightning 1.9 resets it every epoch

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._disabled or self._oom is None:
            return
        reduction = self._oom.loss_reduction
        recovery = TrainStepRecovery(
            lambda: list(pl_module.parameters()),
            split_fn=self.split_batch,
            loss_reduction="sum" if reduction == "sum" else "token_mean" if reduction == "token_mean" else "mean",
            on_recovered=lambda done: self._recovered(trainer, pl_module, "train", done),
            items_fn=self._items_fn,
            module=pl_module,
            warn=lambda message: self._say(message, warn=True),
            split_key=None if self._buckets is None else lambda: self._buckets_now(trainer),
        )
        (recovery.max_size, recovery.pieces), self._resumed_split = self._resumed_split, (None, 1)
        recovery.splits, self._resumed_splits = self._resumed_splits, {}
        self._split_resumed = recovery.max_size is not None or recovery.pieces > 1 or bool(recovery.splits)
        self._train_recovery = recovery
        run: Callable[[Any], Any] = recovery.run
        if compat.is_distributed(trainer):
            ddp = compat.ddp_wrapper(trainer)
            if ddp is None:
                raise RetuneError(
                    f"the `oom` trigger under {type(trainer.strategy).__name__} needs a DDP-wrapped model"
                )
            synced = SyncedSteps(
                ddp,
                recovery.run,
                accumulating=lambda: compat.batch_is_accumulating(trainer),
                params=lambda: list(pl_module.parameters()),
                buffers=lambda: list(pl_module.buffers()),
            )
            run = synced.run
            self._undo.append(synced.close)
        self._undo += [install_closure_runner(trainer, run, join_detached), recovery.close]

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._uninstall()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._oom is not None and not self._disabled and is_oom_error(exception):
            # an OOM the recovery did not see (a hook before or after the step): say where, and why not
            add_note(exception, why_not_recovered(oom_site(exception.__traceback__)))
        self._uninstall()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if compat.trainer_fn(trainer) == "validate" and not trainer.sanity_checking:
            self._eval_start(trainer, pl_module, "val", "validate_start")
        self._guard_eval(trainer, pl_module, "val")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._unguard_eval()

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._eval_start(trainer, pl_module, "test", "test_start")
        self._guard_eval(trainer, pl_module, "test")

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._unguard_eval()

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._eval_start(trainer, pl_module, "predict", "predict_start")
        self._guard_eval(trainer, pl_module, "predict")

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self._unguard_eval()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "stages": {stage: state.to_dict() for stage, state in self._stages.items()},
            "reference_effective": self._policies.reference_effective,
            "accumulate": self._policies.accumulate,
            "history": [event.to_dict() for event in self.history],
            "triggers": trigger_states(self.triggers),
            # the split the epoch keeps after a recovered OOM: a run resumed mid-epoch need not fail again first
            "oom_max_size": None if self._train_recovery is None else self._train_recovery.max_size,
            "oom_pieces": 1 if self._train_recovery is None else self._train_recovery.pieces,
            # with buckets, the split each bucket keeps ([bucket or None, max_size, pieces])
            "oom_splits": []
            if self._train_recovery is None
            else [[key, size, pieces] for key, (size, pieces) in self._train_recovery.splits.items()],
            "buckets": None if self._buckets is None else self._buckets.state.to_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._stages = {stage: StageState.from_dict(s) for stage, s in state_dict.get("stages", {}).items()}
        self._policies = Policies(state_dict.get("reference_effective"), state_dict.get("accumulate"))
        self.history = [RetuneEvent.from_dict(e) for e in state_dict.get("history", [])]
        load_trigger_states(self.triggers, state_dict.get("triggers", []))
        self._restored = True
        max_size = state_dict.get("oom_max_size")
        self._resumed_split = (None if max_size is None else int(max_size), int(state_dict.get("oom_pieces", 1)))
        self._resumed_splits = {
            None if key is None else int(key): (None if size is None else int(size), int(pieces))
            for key, size, pieces in state_dict.get("oom_splits") or []  # absent before issue 28
        }
        saved_buckets = state_dict.get("buckets")
        if self._buckets is not None and saved_buckets:
            self._buckets.state = BucketState.from_dict(saved_buckets)

    # -- out-of-memory recovery (the `oom` trigger; the mechanics live in retune.recovery.step_recovery) ------

    def _resolve_items(self, source: Any, loss_items: str | Callable[[Any], Any] | None) -> ItemsFn | None:
        """The ``token_mean`` counting function, resolved now so a wrong path fails when the callback is built."""
        configured = None if self._oom is None else self._oom.loss_items
        if loss_items is not None and configured is not None:
            raise RetuneError(
                f"loss_items is given twice: as a constructor argument ({loss_items!r}) and as the oom trigger's "
                f"loss_items ({configured!r}) in the schedule; keep one"
            )
        if loss_items is not None and not callable(loss_items) and not isinstance(loss_items, str):
            raise RetuneError(f"loss_items must be a function fn(batch) -> int or a name, got {loss_items!r}")
        if loss_items is not None and (self._oom is None or self._oom.loss_reduction != "token_mean"):
            # as the schedule refuses it on the trigger: a count nothing would use is a mistake, not a no-op
            why = (
                "the schedule has no oom trigger"
                if self._oom is None
                else (f"the oom trigger's loss_reduction is {self._oom.loss_reduction!r}")
            )
            raise RetuneError(
                f"loss_items counts what a token_mean loss averages over, but {why}; set `loss_reduction: "
                "token_mean` on the oom trigger, or drop the loss_items argument"
            )
        try:
            return resolve_items_fn(loss_items if loss_items is not None else configured)
        except ValueError as exc:
            name = str(source) if isinstance(source, (str, Path)) else "<schedule>"
            index = next((i for i, t in enumerate(self.schedule.triggers) if t.kind == "oom"), 0)
            raise ScheduleError(name, [FieldProblem(f"triggers[{index}].loss_items", str(exc))]) from None

    def _guard_eval(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Recover an evaluation step that runs out of memory, for this loop run (after its search)."""
        if self._disabled or self._oom is None or self._eval_recovery is not None:
            return

        def wrap(step: Callable[..., Any]) -> Callable[..., Any]:
            recovery = EvalStepRecovery(
                step,
                logging=lambda batch: compat.eval_logging(trainer, batch),
                save_logs=lambda: compat.save_logged_metrics(trainer),
                journal_logs=lambda: compat.journal_logged_metrics(trainer),
                split_fn=self.split_batch,
                on_recovered=lambda done: self._recovered(trainer, pl_module, stage, done),
                where=lambda: f"{stage}, epoch {trainer.current_epoch}, global step {trainer.global_step}",
            )
            self._eval_recovery = recovery
            return recovery

        self._eval_undo = compat.wrap_eval_step(pl_module, stage, wrap)

    def _unguard_eval(self) -> None:
        if self._eval_undo is not None:
            self._eval_undo()
        self._eval_undo = self._eval_recovery = None

    def _uninstall(self) -> None:
        if self._buckets is not None:
            self._buckets.uninstall()
        self._unguard_eval()
        while self._undo:
            self._undo.pop()()
        self._train_recovery = None

    def _buckets_now(self, trainer: Any) -> int | None:
        """The bucket of the batch being trained (None: not bucketed): the key of the split it keeps."""
        return None if self._buckets is None else self._buckets.bucket_now(trainer)

    def _recovered(self, trainer: Any, pl_module: Any, stage: str, done: Recovered) -> None:
        """Record a step that ran out of memory and was trained in micro-batches; the next search starts below it."""
        name = self._attr(trainer, pl_module, stage)
        # loaders passed straight to validate/predict have no batch-size attribute: the batch's own size
        size = compat.get_batch_attr(trainer, pl_module, name) if compat.has_batch_attr(trainer, pl_module, name) else 0
        samples = done.samples or size
        size = size or samples
        largest_piece = done.micro_size or -(-samples // done.pieces)
        bucket = None
        if stage == "train" and self._oom is not None:
            self._oom.record(failed_size=samples, fitting_size=largest_piece)
            if self._buckets is not None:
                bucket = self._buckets.record_failure(trainer, failed=samples, fitting=largest_piece)
        where = "" if bucket is None else f" (bucket {bucket}, its next search lowers only its size)"
        event = RetuneEvent(
            epoch=trainer.current_epoch,
            global_step=trainer.global_step,
            trigger="oom",
            stage=stage,
            batch_size_before=size,
            batch_size_after=size,
            direction="down",
            micro_batches=done.pieces,
            note=f"out of memory in {done.failed_in} on a batch of {samples}; trained it as {done.pieces} "
            f"micro-batches of at most {largest_piece}{where}",
        )
        self.history.append(event)
        self._say(report.format_summary(event), warn=True)
        self._log_event(trainer, event)

    # -- the search ----------------------------------------------------------------------------

    def _eval_start(self, trainer: Any, pl_module: Any, stage: str, label: str) -> None:
        if self._disabled or stage not in self.schedule.stages:
            return
        self._search(trainer, pl_module, stage, label, "unknown", cold=self._stage(stage).last is None)

    def _search(self, trainer: Any, pl_module: Any, stage: str, label: str, direction: Direction, cold: bool) -> None:
        name = self._attr(trainer, pl_module, stage)
        known = self._oom.consume() if self._oom is not None and stage == "train" and "oom" in label else None
        self._trial_no = 0
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
            before_plan=lambda loader: self._warn_duplicate_attr(trainer, pl_module, name, stage, loader),
            clock=self.clock,
            batching=BucketBatching(self._buckets) if self._buckets is not None and stage == "train" else None,
        )
        self.history.append(event)
        self._say(report.format_summary(event, where))
        self._log_event(trainer, event)

    # -- helpers -------------------------------------------------------------------------------

    def _stage(self, stage: str) -> StageState:
        return self._stages.setdefault(stage, StageState())

    def _attr(self, trainer: Any, pl_module: Any, stage: str) -> str:
        """The stage's own attribute (``val_batch_size``...) when the model or datamodule has it, else
        ``batch_arg_name``: the per-stage API proposed when Lightning's finder was designed."""
        own = getattr(self.schedule.stage_batch_arg_names, stage)
        return own if compat.has_batch_attr(trainer, pl_module, own) else self.schedule.batch_arg_name

    def _warn_duplicate_attr(self, trainer: Any, pl_module: Any, name: str, stage: str, loader: Any) -> None:
        """Once per attribute name: it is set in several places (model and ``model.hparams``...), which
        Lightning warns about too; retune keeps writing all of them (see ``retune.probing.batch_size_attr``)."""
        if name in self._warned_attrs:
            return
        places = compat.batch_attr_places(trainer, pl_module, name)
        hook = compat.dataloader_hook(stage)
        message = duplicate_attr_message(name, places, loader_batch_size(loader), hook)
        if message is not None:
            self._warned_attrs.add(name)
            self._say(message, warn=True)

    def _separate_val(self, trainer: Any, pl_module: Any) -> bool:
        """Validation inside fit is tuned only through its own attribute: sharing ``batch_size`` with
        training would make the val search overwrite the train size."""
        if self._attr(trainer, pl_module, "val") != self._attr(trainer, pl_module, "train"):
            return True
        if not getattr(self, "_warned_shared_val", False):
            self._warned_shared_val = True
            own = self.schedule.stage_batch_arg_names.val
            self._say(
                f"stages lists val, but validation and training share `{self.schedule.batch_arg_name}`; give "
                f"validation its own `{own}` to tune it during fit (skipped)",
                warn=True,
            )
        return False

    def _view(self, trainer: Any, pl_module: Any) -> TrainingView:
        return training_view(trainer, pl_module, self._fit_starting)

    def _move_last(self, trainer: Any) -> None:
        """Run after every other callback in each hook, whatever order the user listed them in (but before
        a ``ScheduledLRFinder``, whose range test runs at the batch size found here: ``retune.callbacks.ordering``)."""
        move_retune_last(trainer)

    def _report_trial(self, size: int, fits: bool, peak: int | None, samples_per_s: float | None = None) -> None:
        self._trial_no += 1
        bucket = None if self._buckets is None else self._buckets.current_bucket
        self._say("  " + report.format_trial(self._trial_no, size, fits, peak, samples_per_s, bucket=bucket))

    def _log_event(self, trainer: Any, event: RetuneEvent) -> None:
        """Send a search's result to every logger, at the step it ran (the probes are over: loggers are back).

        ``logger.log_metrics`` rather than ``pl_module.log``: it records the value at the search's own
        step, works from every hook (eval-stage searches run where ``self.log`` is refused), and keeps
        retune's numbers out of ``callback_metrics``, which checkpoint and early-stopping monitors read.
        """
        if not self._is_global_zero:
            return
        metrics = report.event_metrics(event)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Print the table of searches and write history.json, history.csv and batch_size.png.

        The files go to ``out_dir``, else to ``retune/`` in the first logger's folder; a run with
        neither (``logger=False``) writes none, as Lightning writes no logs then.
        """
        if self._disabled or not self.history or not self._is_global_zero:
            return
        if self.verbose:
            print_above_bar(report.format_table(self.history))
        out = report_dir(trainer, self.out_dir)
        if not self.write_report or out is None:
            return
        budgets = [e.budget_bytes for e in self.history if e.budget_bytes is not None]
        self.report_paths = report.write_outputs(
            self.history, out, end_step=trainer.global_step, budget_bytes=budgets[-1] if budgets else None
        )
        self._say(f"history, CSV and plot in {out}")

    def _say(self, message: str, warn: bool = False) -> None:
        """A warning (always, once) or, when ``verbose``, a progress line; rank zero only (``retune.messages``)."""
        say(message, warn, self.verbose, self._is_global_zero)


__all__ = ["ScheduledBatchSizeFinder", "Trial"]
