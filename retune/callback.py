"""``ScheduledBatchSizeFinder``: the Lightning callback that re-runs the batch-size search on triggers.

Why not a ``BatchSizeFinder`` subclass: Lightning moves those to the front of the callback list,
so at an epoch start they search *before* ``BackboneFinetuning`` unfreezes, and once steps have
been taken their loop-based trials run zero batches (Lightning issue #21903). This callback puts
itself after every other callback and runs its own probe steps, so it searches the model as the
epoch will train it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from retune import compat
from retune.apply import accumulation_for, lr_factor, scale_learning_rates
from retune.errors import RetuneError
from retune.events import RetuneEvent, Trial
from retune.loading import ScheduleSource, load_schedule
from retune.memory import device_total_bytes
from retune.probe import Prober
from retune.search import MemoryModel, Mode, SearchResult, plan_search, run_model_search, run_search
from retune.triggers import Firing, TrainingView, Trigger, build_triggers, evaluate

log = logging.getLogger("retune")

if TYPE_CHECKING:
    _CallbackBase = object
    _BASES: tuple[type, ...] = (object,)
else:
    _BASES = compat.callback_base_classes()


class ScheduledBatchSizeFinder(*_BASES):  # type: ignore[misc]
    """Re-run the largest-batch-size search whenever the schedule's triggers fire.

    Args:
        schedule: a schedule file (YAML, JSON or TOML), a dict, or a :class:`~retune.RetuneSchedule`.
        triggers: extra :class:`~retune.Trigger` objects, checked after the schedule's own.
        verbose: print one line per trial and a summary per search (rank zero only).

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
    """

    def __init__(self, schedule: ScheduleSource, triggers: Sequence[Trigger] = (), verbose: bool = True) -> None:
        self.schedule = load_schedule(schedule)
        self.triggers: list[Trigger] = [*build_triggers(self.schedule.triggers), *triggers]
        self.verbose = verbose
        self.batch_size: int | None = None
        self.history: list[RetuneEvent] = []
        self._last: SearchResult | None = None
        self._memory_model: MemoryModel | None = None
        self._reference_effective: int | None = None
        self._accumulate: int | None = None
        self._fit_starting = False
        self._restored = False
        self._disabled = False

    # -- Lightning hooks -----------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._disabled = bool(trainer.fast_dev_run)
        if self._disabled:
            self._say("fast_dev_run is on: skipping every batch-size search in this run", warn=True)
            return
        compat.check_train_source(trainer)
        compat.check_strategy(trainer)
        if self.schedule.apply.accumulate == "keep_effective" and compat.accumulation_is_scheduled(trainer):
            raise RetuneError(
                "apply.accumulate: keep_effective sets gradient accumulation itself and cannot share it with a "
                "GradientAccumulationScheduler (or a dict `accumulate_grad_batches`); remove one of the two"
            )
        name = self.schedule.batch_arg_name
        if not compat.has_batch_attr(trainer, pl_module, name):
            raise RetuneError(
                f"batch_arg_name {name!r} not found on the model, model.hparams, the datamodule or "
                f"datamodule.hparams; set `batch_arg_name` in the schedule to the attribute your "
                f"train_dataloader() reads"
            )
        self._move_last(trainer)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._disabled:
            return
        self._move_last(trainer)  # again: another callback's setup may have rebuilt the list
        if self._restored and self.batch_size is not None:
            compat.set_batch_attr(trainer, pl_module, self.schedule.batch_arg_name, self.batch_size)
            if self._accumulate is not None:
                compat.set_accumulation(trainer, self._accumulate)
            self._fit_starting = False
        else:
            self._fit_starting = True
        self._restored = False

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._disabled:
            return
        view = self._view(trainer, pl_module)
        self._fit_starting = False
        # every rank updates its triggers' baselines; rank zero's decision is the one all ranks follow
        firing = compat.broadcast_object(trainer, evaluate(self.triggers, view))
        if firing is not None:
            self._search(trainer, pl_module, firing, cold="fit_start" in firing.kinds)
        if self._accumulate is not None:
            compat.set_accumulation(trainer, self._accumulate)  # Lightning 1.9 resets it every epoch

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "batch_size": self.batch_size,
            "last": None
            if self._last is None
            else {"max_fitting": self._last.max_fitting, "min_failing": self._last.min_failing},
            "memory_model": None
            if self._memory_model is None
            else {"fixed": self._memory_model.fixed, "per_sample": self._memory_model.per_sample},
            "reference_effective": self._reference_effective,
            "accumulate": self._accumulate,
            "history": [event.to_dict() for event in self.history],
            "triggers": [_trigger_state(t) for t in self.triggers],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batch_size = state_dict.get("batch_size")
        last = state_dict.get("last")
        self._last = None if last is None else SearchResult(self.batch_size, last["max_fitting"], last["min_failing"])
        model = state_dict.get("memory_model")
        self._memory_model = None if model is None else MemoryModel(model["fixed"], model["per_sample"])
        self._reference_effective = state_dict.get("reference_effective")
        self._accumulate = state_dict.get("accumulate")
        self.history = [RetuneEvent.from_dict(e) for e in state_dict.get("history", [])]
        for trigger, saved in zip(self.triggers, state_dict.get("triggers", []), strict=False):
            if saved is not None and hasattr(trigger, "load_state_dict"):
                trigger.load_state_dict(saved)
        self._restored = True

    # -- the search ----------------------------------------------------------------------------

    def _search(self, trainer: Any, pl_module: Any, firing: Firing, cold: bool) -> None:
        config = self.schedule.search
        name = self.schedule.batch_arg_name
        before = compat.get_batch_attr(trainer, pl_module, name)
        started = time.perf_counter()
        device = pl_module.device
        budget = self.schedule.memory.budget_bytes(device_total_bytes(device))
        mode, limit, note = self._mode_and_limit(device, budget)
        loader = compat.request_train_dataloader(trainer)
        plan = plan_search(
            mode=mode,
            init_val=config.init_val,
            max_trials=config.max_trials,
            margin=config.margin,
            max_val=config.max_val,
            dataset_len=compat.dataset_length(loader, trainer.world_size),
            warm_start=config.warm_start,
            previous=None if cold else self._last,
            direction=firing.direction,
        )
        del loader
        epoch = trainer.current_epoch
        self._say(f"epoch {epoch}: {firing.label} fired, searching the train batch size (from {plan.start})")
        prober = Prober(trainer, pl_module, name, config.steps_per_trial, budget, on_trial=self._report_trial)
        try:
            with prober.session():
                if mode == "model" and limit is not None:
                    prior = None if cold else self._memory_model
                    result = run_model_search(plan, prober.measure, limit, prior)
                else:
                    result = run_search(plan, prober.fits)
        except BaseException:
            compat.set_batch_attr(trainer, pl_module, name, before)
            raise
        if result.size is None:
            compat.set_batch_attr(trainer, pl_module, name, before)
            smallest = min(t.batch_size for t in result.trials)
            raise RetuneError(
                f"no batch size fits in memory after trigger {firing.label!r} at epoch {epoch}: the smallest size "
                f"tried, {smallest}, ran out of memory ({len(result.trials)} trials). Free memory (freeze more "
                f"layers, lower precision, shorter inputs) or raise search.max_trials if it stopped early."
            )
        compat.set_batch_attr(trainer, pl_module, name, result.size)
        if result.size != before:
            compat.reload_train_dataloader(trainer)
            compat.refresh_progress_bar(trainer)
        accumulate, factor = self._apply_policies(trainer, before, result.size)
        event = RetuneEvent(
            epoch=epoch,
            global_step=trainer.global_step,
            trigger=firing.label,
            stage="train",
            batch_size_before=before,
            batch_size_after=result.size,
            trials=list(result.trials),
            duration_s=time.perf_counter() - started,
            direction="cold" if cold else firing.direction,
            max_fitting=result.max_fitting,
            min_failing=result.min_failing,
            peak_bytes=list(prober.peaks),
            budget_bytes=budget,
            accumulate=accumulate,
            effective_batch_size=accumulate * result.size,
            lr_factor=factor,
            mode=mode,
            note=note,
        )
        self.history.append(event)
        self.batch_size = result.size
        self._last = result
        if result.model is not None:
            self._memory_model = result.model
        self._say(
            f"epoch {epoch}: batch size {before} -> {result.size} ({len(result.trials)} trials, "
            f"{event.duration_s:.2f}s, trigger {firing.label})"
        )

    def _apply_policies(self, trainer: Any, before: int, after: int) -> tuple[int, float]:
        """Keep the effective batch size and/or scale learning rates (the schedule's ``apply``)."""
        policy = self.schedule.apply
        accumulate_before = compat.get_accumulation(trainer)
        accumulate = accumulate_before
        if policy.accumulate == "keep_effective":
            if self._reference_effective is None:
                self._reference_effective = after * accumulate_before  # the first tune sets the target
            else:
                plan = accumulation_for(self._reference_effective, after)
                if not plan.exact:
                    self._say(
                        f"keep_effective: {self._reference_effective} is not a multiple of batch size {after}; "
                        f"accumulating {plan.accumulate} batches gives an effective batch size of {plan.effective}",
                        warn=True,
                    )
                accumulate = plan.accumulate
            self._accumulate = accumulate
            compat.set_accumulation(trainer, accumulate)
        factor = lr_factor(policy.lr_scaling, before * accumulate_before, after * accumulate)
        scale_learning_rates(trainer.optimizers, compat.lr_schedulers(trainer), factor)
        return accumulate, factor

    def _mode_and_limit(self, device: Any, budget: int | None) -> tuple[Mode, int | None, str]:
        """The search to run and the memory limit ``model`` mode predicts against.

        ``model`` needs measured peaks and a limit: the budget, or a CUDA device's total memory.
        Without both it falls back to ``binsearch`` and says so in the event.
        """
        mode = self.schedule.search.mode
        if mode != "model":
            return mode, budget, ""
        if budget is not None and device.type in ("cpu", "cuda"):
            return "model", budget, ""
        if device.type == "cuda":
            return "model", device_total_bytes(device), ""
        reason = "no memory.budget set" if budget is None else f"no memory statistics on {device.type}"
        return "binsearch", None, f"model mode needs measured peaks and a limit ({reason}); fell back to binsearch"

    # -- helpers -------------------------------------------------------------------------------

    def _view(self, trainer: Any, pl_module: Any) -> TrainingView:
        names = {id(p): name for name, p in pl_module.named_parameters()}
        groups = tuple(
            frozenset(names.get(id(p), f"<unnamed:{id(p)}>") for g in opt.param_groups for p in g["params"])
            for opt in trainer.optimizers
        )
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        return TrainingView(
            epoch=trainer.current_epoch,
            global_step=trainer.global_step,
            fit_starting=self._fit_starting,
            trainable_params=trainable,
            param_groups=groups,
            fts_phase=compat.fts_phase(trainer),
        )

    def _move_last(self, trainer: Any) -> None:
        """Run after every other callback in each hook, whatever order the user listed them in.

        The list is replaced, not edited, because Lightning may be iterating over it right now.
        """
        if trainer.callbacks and trainer.callbacks[-1] is self:
            return
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is not self] + [self]

    def _report_trial(self, size: int, fits: bool, peak: int | None) -> None:
        memory = "" if peak is None else f", peak {peak / 2**20:.1f} MiB"
        self._say(f"  trial batch_size={size}: {'fits' if fits else 'does not fit'}{memory}")

    def _say(self, message: str, warn: bool = False) -> None:
        if warn:
            log.warning(message)
        else:
            log.info(message)
        if self.verbose or warn:
            _rank_zero_print(f"[retune] {message}")


def _trigger_state(trigger: Trigger) -> dict[str, Any] | None:
    state = getattr(trigger, "state_dict", None)
    return state() if callable(state) else None


def _rank_zero_print(message: str) -> None:
    import os
    import sys

    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) != 0:
        return
    try:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)
    except ImportError:  # pragma: no cover - Lightning depends on tqdm
        print(message, file=sys.stderr)


__all__ = ["ScheduledBatchSizeFinder", "Trial"]
