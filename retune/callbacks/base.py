"""What retune's callbacks share: their Lightning base class, printing, report files, trigger state.

``ScheduledBatchSizeFinder`` and ``ScheduledLRFinder`` both subclass :class:`RetuneCallback` (a
Lightning ``Callback`` of every installed namespace, picklable after a fit): it loads the schedule and
builds the triggers from the constructor arguments both take, starts ``setup`` (rank, ``fast_dev_run``,
this rank's own copy of weights ``ddp_spawn`` shared), keeps the callback after the others, records an
event (its summary printed above Lightning's progress bar on rank zero, its metrics logged), prints the
table and writes the files at fit end next to the first logger's, and keeps the history and the
triggers' baselines in checkpoints; one implementation of each, here. A subclass says which report
module reads its events (``_report``, an :class:`EventReport`) and what its files are
(:meth:`RetuneCallback._write_files`).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from retune import compat, messages
from retune.callbacks.ordering import move_retune_last
from retune.errors import RetuneError
from retune.schedule.loading import ScheduleSource, load_schedule
from retune.schedule.triggers import Trigger, build_triggers

if TYPE_CHECKING:
    _BASES: tuple[type, ...] = (object,)
else:
    _BASES = compat.callback_base_classes()

log = logging.getLogger("retune")


class EventReport(Protocol):
    """How a callback's events read: :mod:`retune.reports.batch_size` and :mod:`retune.reports.lr` are each one."""

    def format_summary(self, event: Any, where: str | None = None) -> str:
        """The line that ends a search or a range test (``where``: what it starts with; default ``epoch N``)."""
        ...

    def event_metrics(self, event: Any) -> dict[str, float]:
        """What one event sends to the loggers (the keys the callback's docstring lists)."""
        ...

    def format_table(self, events: Sequence[Any]) -> str:
        """The table of the run's events printed at fit end."""
        ...


class RetuneCallback(*_BASES):  # type: ignore[misc]
    """The Lightning ``Callback`` base of retune's callbacks, in every installed Lightning namespace.

    Inheriting from each namespace's ``Callback`` lets ``isinstance`` checks pass whichever one the user
    imports (LightningCLI, the callback connector). A callback pickles (``ddp_spawn``) before and after
    a fit: what Lightning attaches to it during a fit is left out of its pickled state.

    The constructor takes what both callbacks take (see each callback's ``Args``).
    """

    history: list[Any]
    """One event per search or range test, oldest first (the subclass says which event type)."""
    report_paths: Any
    """The files :meth:`on_fit_end` wrote (None before)."""
    _report: ClassVar[EventReport]
    """The report module that reads this callback's events (summary line, logged metrics, table)."""

    def __init__(
        self,
        schedule: ScheduleSource,
        triggers: Sequence[Trigger] = (),
        verbose: bool = True,
        out_dir: str | Path | None = None,
        write_report: bool = True,
    ) -> None:
        self.schedule = load_schedule(schedule)
        self.triggers: list[Trigger] = [*build_triggers(self.schedule.triggers), *checked_triggers(triggers)]
        for name, flag in (("verbose", verbose), ("write_report", write_report)):
            if not isinstance(flag, int):  # a bool (an int 0 or 1 reads as one)
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
            raise TypeError(f"out_dir must be a path (a str or an os.PathLike), got {out_dir!r}")
        self.verbose = bool(verbose)
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.write_report = bool(write_report)
        self.report_paths = None
        self.history = []
        self._fit_starting = False
        self._restored = False
        self._disabled = False
        self._is_global_zero = True
        self._lr_values: dict[str, float] = {}
        """The model's ``lr``/``learning_rate`` this callback wrote (:meth:`_wrote_lr`), by name: their values at the
        last checkpoint, written back when a fit resumes (Lightning rebuilds ``hparams`` from the constructor)."""
        self._entry: str | None = None  # the entry point (fit, validate, test, predict) of the current setup
        self._fit_started = False  # this fit's on_fit_start ran (a strategy may restore callbacks after it)
        self._fit_ran = False  # some fit's on_fit_start ran: a checkpoint written before one has nothing to resume
        self._restored_in_entry = False  # the checkpoint marked resumed was read inside a fit/validate/... entry
        self._attached: tuple[weakref.ref[Any], weakref.ref[Any]] | None = None  # the setup's trainer and module

    def __getstate__(self) -> dict[str, Any]:
        state = compat.without_attached(self.__dict__)
        state.pop("_attached", None)  # weak references do not pickle (ddp_spawn); setup makes them again
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._attached = None

    def _start_setup(self, trainer: Any, pl_module: Any, skipped: str, stage: str = "fit") -> bool:
        """The start of ``setup``: this rank (printing is rank zero's) and whether ``fast_dev_run`` turns the
        callback off for the run (then True, and one warning says that every ``skipped`` is skipped). Else
        this rank gets its own copy of weights ``ddp_spawn`` left in shared memory: a probe or a range test
        restores the weights from a snapshot, which must not see another rank's steps.

        ``stage`` is Lightning's entry point: a checkpoint Lightning restores callbacks from for ``validate``,
        ``test`` or ``predict`` leaves a fit's state alone (:meth:`_load_common_state`)."""
        self._entry = stage
        self._fit_started = False
        if self._restored_in_entry:
            # read inside an earlier entry that ended before its on_fit_start (the tuner's checkpoint, read back in
            # a fit it exits there): not this fit's. One loaded by hand between entries is, as before.
            self._restored = False
        self._attached = (weakref.ref(trainer), weakref.ref(pl_module))
        self._is_global_zero = bool(getattr(trainer, "is_global_zero", True))
        messages.set_rank(int(getattr(trainer, "global_rank", 0)))
        self._disabled = bool(trainer.fast_dev_run)
        if self._disabled:
            self._say(f"fast_dev_run is on: skipping every {skipped} in this run", warn=True)
        elif compat.unshare_spawned_weights(trainer, pl_module):
            log.debug("ddp_spawn left this rank's CPU weights in shared memory; gave it its own copy")
        return self._disabled

    def _check_trigger_sources(self, trainer: Any) -> None:
        """At a fit's setup: a trigger whose source the run lacks would never fire. An ``fts_phase`` trigger without
        finetuning-scheduler's callback waits for phases that never come, and the unfreeze another callback makes
        then runs out of memory at the size tuned before it."""
        if any(getattr(t, "kind", None) == "fts_phase" for t in self.triggers) and compat.fts_phase(trainer) is None:
            raise RetuneError(
                "the schedule's fts_phase trigger fires when finetuning-scheduler's FinetuningScheduler changes phase, "
                "and no FinetuningScheduler is among the trainer's callbacks: add one, or use the "
                "trainable_params_changed trigger for another unfreezing callback (BackboneFinetuning, your own)"
            )

    def _move_last(self, trainer: Any) -> None:
        """Run after every other callback in each hook, whatever order the user listed them in (the batch-size
        search before the range test, which runs at the size found: :mod:`retune.callbacks.ordering`)."""
        move_retune_last(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Print the table of the run's events and write the files (rank zero, only when something ran).

        The files go to ``out_dir``, else to ``retune/`` in the first logger's folder; a run with
        neither (``logger=False``) writes none, as Lightning writes no logs then.
        """
        if self._disabled or not self.history or not self._is_global_zero:
            return
        if self.verbose:
            print_above_bar(self._report.format_table(self.history))
        out = report_dir(trainer, self.out_dir)
        if not self.write_report or out is None:
            return
        self.report_paths, what = self._write_files(trainer, out)
        self._say(f"{what} in {out}")

    def _write_files(self, trainer: Any, out: Path) -> tuple[Any, str]:
        """Write the run's files into ``out``: their paths, and what they are in words."""
        raise NotImplementedError

    def _log_metrics(self, trainer: Any, metrics: dict[str, float]) -> None:
        """Send an event's metrics to every logger, at the step it ran (rank zero's values only).

        ``logger.log_metrics`` rather than ``pl_module.log``: it records the value at the event's own
        step, works from every hook (eval-stage searches run where ``self.log`` is refused), and keeps
        retune's numbers out of ``callback_metrics``, which checkpoint and early-stopping monitors read.
        """
        if not self._is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=compat.logger_step(trainer))

    def _record(self, trainer: Any, event: Any, where: str = "", warn: bool = False) -> None:
        """Keep an event (a search, a range test, a recovered step), print its summary and log its metrics."""
        self.history.append(event)
        self._say(self._report.format_summary(event, where), warn=warn)
        self._log_metrics(trainer, self._report.event_metrics(event))

    def _common_state(self) -> dict[str, Any]:
        """The checkpoint keys both callbacks write: the format version, the history, the triggers' baselines, and
        the learning-rate attributes this callback wrote, as they are now."""
        attached = self._live()
        if attached is not None and self._lr_values:
            self._lr_values.update(compat.lr_attribute_values(*attached, list(self._lr_values)))
        return {
            "version": 1,
            "history": [event.to_dict() for event in self.history],
            "triggers": trigger_states(self.triggers),
            "lr_attributes": dict(self._lr_values),
            "fit_ran": self._fit_ran,
        }

    def _load_common_state(self, state_dict: dict[str, Any], event: Callable[[dict[str, Any]], Any]) -> bool:
        """Read back :meth:`_common_state`'s keys (``event`` builds one history entry) and mark the run resumed.

        False, and nothing read, where Lightning restores callbacks for ``validate``/``test``/``predict``
        (``ckpt_path``): the fit's history, sizes and baselines stay this callback's, and a later ``fit`` starts as a
        fit does. Where the strategy restores callbacks after ``on_fit_start`` (``restore_checkpoint_after_setup``:
        FSDP, ``ModelParallelStrategy``), the resumed state is applied right away (:meth:`_resume`), before
        Lightning builds the train loader: a subclass calls :meth:`_loaded` once it has read its own keys.

        Also False for a checkpoint written before any fit's ``on_fit_start`` ran (``fit_ran``): Lightning's
        ``BatchSizeFinder``/``LearningRateFinder`` and the ``Tuner`` save one and read it back inside a fit, which
        is no resume (the fit-start search and range test were skipped); checkpoints without the key are resumed."""
        if self._entry not in (None, "fit") or state_dict.get("fit_ran", True) is False:
            return False
        self.history = [event(e) for e in state_dict.get("history", [])]
        load_trigger_states(self.triggers, state_dict.get("triggers", []))
        self._lr_values = {str(k): float(v) for k, v in state_dict.get("lr_attributes", {}).items()}
        self._restored = True
        self._restored_in_entry = self._entry is not None
        self._fit_ran = True  # the checkpoint's fit ran: one written from this state again is resumed too
        return True

    def _loaded(self) -> None:
        """The end of ``load_state_dict``: where this fit's ``on_fit_start`` already ran, go on from the checkpoint."""
        attached = self._live()
        if self._fit_started and attached is not None and not self._disabled:
            self._resume(*attached)

    def _fit_start(self, trainer: Any, pl_module: Any) -> None:
        """``on_fit_start``'s common part: a fit resumed from a checkpoint goes on from it (:meth:`_resume`), else
        the fit's first epoch start is its fit start."""
        self._fit_started = self._fit_ran = True
        if self._restored:
            self._resume(trainer, pl_module)
        else:
            self._fit_starting = True

    def _resume(self, trainer: Any, pl_module: Any) -> None:
        """Go on from the checkpoint just read: its learning-rate attributes written back (a subclass adds its own
        state), and no fit-start trigger: the fit started before the checkpoint."""
        compat.write_lr_attributes(trainer, pl_module, self._lr_values)
        self._fit_starting = False
        self._restored = False

    def _wrote_lr(self, trainer: Any, pl_module: Any, names: Sequence[str]) -> None:
        """The model's ``names`` (``lr``, ``learning_rate``) were just written: a checkpoint keeps their values."""
        self._lr_values.update(compat.lr_attribute_values(trainer, pl_module, names))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """The entry point ended: a checkpoint loaded by hand afterwards is a fit's (:meth:`_load_common_state`)."""
        self._entry = None
        self._fit_started = False

    def _live(self) -> tuple[Any, Any] | None:
        """The trainer and module of the current setup, while both exist."""
        if self._attached is None:
            return None
        trainer, pl_module = self._attached[0](), self._attached[1]()
        return None if trainer is None or pl_module is None else (trainer, pl_module)

    def _say(self, message: str, warn: bool = False) -> None:
        """A warning (always, once) or, when ``verbose``, a progress line; rank zero only (``retune.messages``)."""
        if self._is_global_zero:
            messages.say(message, warn, self.verbose)


def print_above_bar(message: str) -> None:
    """Print above a TQDM progress bar instead of through it."""
    messages.print_line(message)


def report_dir(trainer: Any, out_dir: Path | None) -> Path | None:
    """``out_dir``, else ``retune/`` in the first logger's folder; None without either (``logger=False``:
    Lightning writes no logs then, so retune writes no files)."""
    if out_dir is not None:
        return out_dir
    folder = compat.log_dir(trainer)  # not trainer.log_dir: a collective, and only rank zero is here
    return None if folder is None else Path(folder) / "retune"


def checked_triggers(triggers: Any) -> list[Trigger]:
    """The ``triggers=`` argument, checked where it is given: a list of objects with a ``kind`` string and a
    ``check(view)`` method (:class:`~retune.schedule.triggers.Trigger`). A trigger named by a string or a dict
    belongs in the schedule's ``triggers`` list, where it is validated; found only at the first epoch start,
    such a mistake would stop the run there."""
    if isinstance(triggers, (str, bytes, Mapping)) or not isinstance(triggers, Sequence):
        raise TypeError(
            f"triggers must be a list of trigger objects (see retune.schedule.triggers.Trigger), got {triggers!r}"
        )
    for index, trigger in enumerate(triggers):
        if isinstance(trigger, (str, Mapping)):
            raise TypeError(
                f"triggers[{index}] is {trigger!r}: the triggers= argument takes trigger objects; put a trigger "
                "written as a kind or a dict in the schedule's `triggers` list instead"
            )
        if not isinstance(getattr(trigger, "kind", None), str) or not callable(getattr(trigger, "check", None)):
            raise TypeError(
                f"triggers[{index}] ({trigger!r}) is not a trigger: it needs a `kind` string and a "
                "`check(view)` method that returns 'down', 'up', 'unknown' or None (retune.schedule.triggers.Trigger)"
            )
    return list(triggers)


def _trigger_keys(triggers: Sequence[Trigger]) -> list[str]:
    """What names each trigger in a checkpoint: its class and which of that class it is (``TrainableParamsChanged#0``),
    so a schedule whose triggers are listed in another order on resume gives each its own baseline back."""
    seen: dict[str, int] = {}
    keys = []
    for trigger in triggers:
        name = type(trigger).__qualname__
        keys.append(f"{name}#{seen.get(name, 0)}")
        seen[name] = seen.get(name, 0) + 1
    return keys


def trigger_states(triggers: Sequence[Trigger]) -> list[dict[str, Any]]:
    """Each trigger's ``state_dict()`` with the key that names it (:func:`_trigger_keys`), for a checkpoint;
    triggers without state are left out."""
    states: list[dict[str, Any]] = []
    for key, trigger in zip(_trigger_keys(triggers), triggers, strict=True):
        state = getattr(trigger, "state_dict", None)
        if callable(state):
            states.append({"trigger": key, "state": state()})
    return states


def load_trigger_states(triggers: Sequence[Trigger], saved: Sequence[dict[str, Any] | None]) -> None:
    """Give each trigger back its checkpointed baseline, found by its key (:func:`trigger_states`). A checkpoint
    of an earlier retune (states by position, no keys) is read by position where the trigger's state has the
    same fields; a trigger the checkpoint has no state for keeps the baseline it read at setup."""
    by_key = {
        entry["trigger"]: entry["state"]
        for entry in saved
        if isinstance(entry, dict) and set(entry) == {"trigger", "state"}
    }
    keyed = bool(by_key) or not saved
    for index, (key, trigger) in enumerate(zip(_trigger_keys(triggers), triggers, strict=True)):
        load = getattr(trigger, "load_state_dict", None)
        if not callable(load):
            continue
        if keyed:
            state = by_key.get(key)
        else:  # positional (before keys): only where the fields match this trigger's own
            state = saved[index] if index < len(saved) else None
            own = getattr(trigger, "state_dict", None)
            if state is not None and (not callable(own) or set(own()) != set(state)):
                state = None
        if state is None:
            continue
        if keyed:
            load(state)
        else:
            try:
                load(state)
            except (TypeError, ValueError):  # another trigger's state with the same fields: keep the setup's
                continue


__all__ = [
    "EventReport",
    "RetuneCallback",
    "checked_triggers",
    "load_trigger_states",
    "print_above_bar",
    "report_dir",
    "trigger_states",
]
