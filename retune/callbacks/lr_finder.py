"""``ScheduledLRFinder``: the learning-rate range test, re-run whenever the schedule's triggers fire.

Why not Lightning's ``LearningRateFinder`` and its ``FineTuneLearningRateFinder`` recipe: Lightning
moves finder callbacks to the front of the list, so at an unfreeze epoch the recipe tests *before*
``BackboneFinetuning`` has added the backbone's param group, and it changes every group's rate at
once. This callback runs after every other one (and after ``ScheduledBatchSizeFinder``), tests only
the groups that the trigger made trainable (``lr_find.groups: new``), and leaves no trace of the
test's steps. The mechanics live in :mod:`retune.lr.range_test` (pure), :mod:`retune.lr.probe` (the
steps) and :mod:`retune.lr.apply` (setting the rate); this module is the hooks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from retune import compat
from retune.callbacks.base import EventReport, RetuneCallback
from retune.callbacks.trainer_view import group_infos, training_view
from retune.errors import RetuneError
from retune.lr.apply import nominal_lr, set_group_lr
from retune.lr.events import LRFindEvent
from retune.lr.probe import run_range_test
from retune.lr.range_test import GroupInfo, RangeTest, new_groups, select_groups, suggest, sweep_lrs
from retune.reports import lr as lr_report
from retune.schedule.loading import ScheduleSource
from retune.schedule.triggers import Firing, Trigger, evaluate


class ScheduledLRFinder(RetuneCallback):
    """Run a learning-rate range test at the schedule's triggers and set the suggested rate.

    Args:
        schedule: a schedule file (YAML, JSON or TOML), a dict, or a :class:`~retune.RetuneSchedule`;
            its ``triggers`` say when, its ``lr_find`` section how (range, steps, sweep, early stop,
            suggestion method, which param groups).
        triggers: extra :class:`~retune.Trigger` objects, checked after the schedule's own.
        verbose: print a line per range test and a table at the end of fit (rank zero only).
        out_dir: where ``lr_history.json``, ``lr_history.csv`` and ``lr_find.png`` go at fit end
            (default: ``retune/`` in the first logger's folder).
        write_report: write those files.

    Example::

        from lightning.pytorch.callbacks import BackboneFinetuning
        from retune import ScheduledBatchSizeFinder, ScheduledLRFinder

        trainer = Trainer(callbacks=[
            BackboneFinetuning(unfreeze_backbone_at_epoch=3),
            ScheduledLRFinder("schedules/lr_at_unfreeze.yaml"),
        ])
        trainer.fit(model, datamodule=dm)
        finder.lr        # the last rate set
        finder.history   # one LRFindEvent per range test

    By default (``groups: new``) every param group is tested and set at fit start, and at a later
    trigger only the groups holding parameters that were added to the optimizer or unfrozen since the
    last epoch start; an explicit list of groups is honoured at fit start too. The suggestion becomes
    each group's nominal rate (what a warmup warms up to, where OneCycle peaks: :mod:`retune.lr.apply`).
    A schedule without an ``lr_find`` section runs with the defaults and says so once. With a
    :class:`~retune.ScheduledBatchSizeFinder` firing at the same epoch start, the
    batch size is searched first and the range test runs at the new size, whatever the callback order.

    Logged metrics (every logger's ``log_metrics``, at the step the test ran, rank zero's values):

    ============================  =================================  =========================================
    key                           when                               value
    ============================  =================================  =========================================
    ``retune/lr_find_seconds``    every range test                   how long the test took
    ``retune/lr_find_steps``      every range test                   steps it ran (fewer when it stopped early)
    ``retune/lr_group<i>``        a test that made a suggestion      the rate set on param group *i*
    ============================  =================================  =========================================
    """

    _retune_rank = 2  # after every other callback and after ScheduledBatchSizeFinder (retune.callbacks.ordering)
    _report: ClassVar[EventReport] = (
        lr_report  # each range test's summary line, logged metrics, and the table at fit end
    )

    def __init__(
        self,
        schedule: ScheduleSource,
        triggers: Sequence[Trigger] = (),
        verbose: bool = True,
        out_dir: str | Path | None = None,
        write_report: bool = True,
    ) -> None:
        super().__init__(schedule, triggers, verbose, out_dir, write_report)
        if self.triggers and all(t.kind == "oom" for t in self.triggers):
            raise RetuneError(
                "ScheduledLRFinder: the schedule's only trigger is `oom`, which fires after a training step that "
                "the batch-size finder recovered from running out of memory; the range test never runs on it. Add "
                "the triggers the range test should run at (fit_start, epoch, param_groups_changed, ...)"
            )
        self.report_paths: lr_report.LROutputPaths | None = None
        self.history: list[LRFindEvent] = []
        self._groups_seen: list[GroupInfo] | None = None
        self._defaults_said = False

    @property
    def lr(self) -> float | None:
        """The learning rate the last range test set (None before the first, or when it made no suggestion)."""
        for event in reversed(self.history):
            if event.lr_after is not None:
                return event.lr_after
        return None

    # -- Lightning hooks -----------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._start_setup(trainer, pl_module, "learning-rate range test", stage) or stage != "fit":
            return
        if int(getattr(trainer, "world_size", 1)) > 1 and not compat.is_ddp(trainer):
            raise RetuneError(
                "ScheduledLRFinder supports a single device and DDP (ddp, ddp_spawn); "
                f"{type(trainer.strategy).__name__} shards the model, which range-test steps on the unwrapped module "
                "cannot run"
            )
        self._check_trigger_sources(trainer)
        self._move_last(trainer)
        if not self._defaults_said and "lr_find" not in self.schedule.model_fields_set:
            self._defaults_said = True
            self._say(lr_report.defaults_notice(self.schedule.lr_find))

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._disabled:
            return
        self._move_last(trainer)  # again: another callback's setup may have rebuilt the list
        count = len(trainer.optimizers)
        if count != 1:
            raise RetuneError(
                f"ScheduledLRFinder tunes the param groups of one optimizer; this run has {count}. Use one optimizer "
                "with a param group per part of the model (discriminative rates), or tune the rates by hand"
            )
        self._fit_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._disabled:
            return
        view = training_view(trainer, pl_module, self._fit_starting)
        fit_starting, self._fit_starting = self._fit_starting, False
        # every rank updates its triggers' baselines; rank zero's decision is the one all ranks follow
        firing = compat.broadcast_object(trainer, evaluate(self.triggers, view))
        groups_now = group_infos(trainer.optimizers[0], pl_module)
        new = new_groups(self._groups_seen, groups_now)
        self._groups_seen = groups_now
        if firing is not None:
            self._range_test(trainer, pl_module, firing, new, fit_starting)

    def state_dict(self) -> dict[str, Any]:
        seen = self._groups_seen
        return {
            **self._common_state(),
            "groups_seen": None if seen is None else [[sorted(g.params), sorted(g.trainable)] for g in seen],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._load_common_state(state_dict, LRFindEvent.from_dict):
            return
        seen = state_dict.get("groups_seen")
        self._groups_seen = None if seen is None else [GroupInfo(frozenset(p), frozenset(t)) for p, t in seen]
        self._loaded()

    # -- the range test ------------------------------------------------------------------------

    def _range_test(self, trainer: Any, pl_module: Any, firing: Firing, new: list[int], fit_start: bool) -> None:
        config = self.schedule.lr_find
        optimizer = trainer.optimizers[0]
        epoch = trainer.current_epoch
        try:
            chosen = select_groups(config.groups, len(optimizer.param_groups), new, fit_start)
        except ValueError as exc:
            raise RetuneError(f"{exc} (trigger {firing.label!r} at epoch {epoch})") from None
        frozen = [i for i in chosen if not any(p.requires_grad for p in optimizer.param_groups[i]["params"])]
        chosen = [i for i in chosen if i not in frozen]
        if not chosen:
            self._say(
                f"epoch {epoch}: {firing.label} fired, but param groups {frozen} hold no trainable parameter; "
                "no learning-rate range test",
                warn=True,
            )
            return
        lrs = sweep_lrs(config.min_lr, config.max_lr, config.steps, config.mode)
        test = RangeTest(lrs, beta=config.smoothing, threshold=config.early_stop_threshold)
        holders = compat.lr_holders(trainer)
        before = [nominal_lr(optimizer, i, holders) for i in chosen]  # like with like: lr_after is nominal too
        self._say(
            f"epoch {epoch}: {firing.label} fired, learning-rate range test on param groups {chosen} "
            f"({config.mode} {config.min_lr:.3g} -> {config.max_lr:.3g}, up to {config.steps} steps)"
        )
        seconds, batch_size = run_range_test(trainer, pl_module, chosen, test)
        first = test.losses[0]
        if not math.isfinite(first):
            raise RetuneError(
                f"the loss was {first} at the first step of the learning-rate range test (epoch {epoch}, lr "
                f"{lrs[0]:.3g}, the smallest rate of the sweep), before the learning rate could matter: the model "
                "or the data produce a non-finite loss (inputs, initialisation, precision). The run's state was "
                "restored; nothing was changed"
            )
        found = suggest(
            test.tested_lrs,
            test.smoothed,
            config.suggestion,
            config.skip_begin,
            config.skip_end,
            log_scale=config.mode == "exponential",
        )
        note = "" if not frozen else f"groups {frozen} skipped: no trainable parameter"
        if found is None:
            note = "; ".join(
                filter(None, [note, f"only {test.steps_run} steps before the loss diverged: no suggestion"])
            )
            self._say(
                f"epoch {epoch}: the range test diverged after {test.steps_run} steps, too few for a suggestion "
                f"(skip_begin {config.skip_begin}, skip_end {config.skip_end}); learning rates unchanged. Lower "
                "lr_find.min_lr or raise early_stop_threshold",
                warn=True,
            )
        else:
            set_group_lr(optimizer, chosen, found.lr, holders)
            # as Lightning's LearningRateFinder: the model's `lr`/`learning_rate`, where it named a tested rate
            others = [nominal_lr(optimizer, i, holders) for i in range(len(optimizer.param_groups)) if i not in chosen]
            written = compat.set_lr_attributes(trainer, pl_module, [float(r) for r in before], found.lr, others)
            self._wrote_lr(trainer, pl_module, written)
            if written:
                names = " and ".join(f"`{name}`" for name in written)
                note = "; ".join(filter(None, [note, f"{names} set too"]))
        event = LRFindEvent(
            epoch=epoch,
            global_step=trainer.global_step,
            trigger=firing.label,
            groups=chosen,
            lrs_before=before,
            lr_after=None if found is None else found.lr,
            method=config.suggestion,
            suggestion_index=None if found is None else found.index,
            lrs=test.tested_lrs,
            losses=list(test.losses),
            smoothed=list(test.smoothed),
            steps_planned=config.steps,
            stopped_early=test.stopped_early,
            duration_s=seconds,
            batch_size=batch_size,
            mode=config.mode,
            note=note,
        )
        self._record(trainer, event)

    def _write_files(self, trainer: Any, out: Path) -> tuple[lr_report.LROutputPaths, str]:
        """lr_history.json, lr_history.csv and lr_find.png."""
        return lr_report.write_outputs(self.history, out), "learning-rate history, CSV and plot"


__all__ = ["ScheduledLRFinder"]
