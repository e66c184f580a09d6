"""Which attribute holds each stage's batch size, checked at setup and warned about once per run.

``ScheduledBatchSizeFinder`` tunes a stage through an attribute its dataloader hook reads: the stage's
own (``val_batch_size``...) when the model or datamodule has it, else ``batch_arg_name`` (the
per-stage API proposed when Lightning's finder was designed). :class:`StageAttrs` answers which one,
refuses at setup a stage whose attribute does not exist, skips validation inside fit when it shares
training's attribute, and warns once about an attribute set in several places
(:mod:`retune.probing.batch_size_attr`). Kept out of the callback so its hooks read as hooks.
"""

from __future__ import annotations

from typing import Any

from retune import compat
from retune.compat import hooks as hook_calls
from retune.errors import RetuneError
from retune.messages import Say
from retune.probing.batch_size_attr import duplicate_attr_message, loader_batch_size
from retune.schedule.models import RetuneSchedule


class StageAttrs:
    """The batch-size attribute of each stage, for one callback (``say`` is its bound printer: picklable)."""

    def __init__(self, schedule: RetuneSchedule, say: Say) -> None:
        self.schedule = schedule
        self._say = say
        self._warned: set[str] = set()  # attributes already reported as set in several places
        self._warned_shared_val = False

    def name(self, trainer: Any, pl_module: Any, stage: str) -> str:
        """The stage's own attribute (``val_batch_size``...) when the model or datamodule has it, else
        ``batch_arg_name``: the per-stage API proposed when Lightning's finder was designed."""
        own = getattr(self.schedule.stage_batch_arg_names, stage)
        return own if compat.has_batch_attr(trainer, pl_module, own) else self.schedule.batch_arg_name

    def describe(self, trainer: Any, pl_module: Any, stage: str) -> str:
        """The attribute a search of ``stage`` writes, in words, for a warning about a loader that ignores it:
        ``batch_size`` where a stage's own attribute also exists would be the one a hook reads by mistake."""
        name = self.name(trainer, pl_module, stage)
        shared = self.schedule.batch_arg_name
        if name == shared or not compat.has_batch_attr(trainer, pl_module, shared):
            return f"`{name}`, which retune sets"
        return (
            f"`{name}`, which retune sets (the stage's own attribute, used where it exists; `{shared}` exists too: "
            f"`stage_batch_arg_names: {{{stage}: {shared}}}` in the schedule makes retune set that one)"
        )

    def check(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """At setup: the stage's data can be probed and its attribute exists (else a clear error)."""
        compat.check_source(trainer, stage)
        hook_calls.check_probeable(trainer, pl_module, stage)
        name = self.name(trainer, pl_module, stage)
        if not compat.has_batch_attr(trainer, pl_module, name):
            raise RetuneError(
                f"batch_arg_name {name!r} not found on the model, model.hparams, the datamodule or "
                f"datamodule.hparams; set `batch_arg_name` in the schedule to the attribute your "
                f"{compat.dataloader_hook(stage)}() reads"
            )

    def check_setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """At ``setup(stage)``: :meth:`check` every tuned stage that entry point runs (validation inside fit only
        when it has its own attribute: :meth:`separate_val`)."""
        stages = {"fit": ["train", "val"], "validate": ["val"], "test": ["test"], "predict": ["predict"]}[stage]
        for tuned in (s for s in stages if s in self.schedule.stages):
            if not (tuned == "val" and stage == "fit" and not self.separate_val(trainer, pl_module)):
                self.check(trainer, pl_module, tuned)

    def warn_duplicate(self, trainer: Any, pl_module: Any, name: str, stage: str, loader: Any) -> None:
        """Once per attribute name: it is set in several places (model and ``model.hparams``...), which
        Lightning warns about too; retune keeps writing all of them (see ``retune.probing.batch_size_attr``)."""
        if name in self._warned:
            return
        places = compat.batch_attr_places(trainer, pl_module, name)
        hook = compat.dataloader_hook(stage)
        message = duplicate_attr_message(name, places, loader_batch_size(loader), hook)
        if message is not None:
            self._warned.add(name)
            self._say(message, warn=True)

    def separate_val(self, trainer: Any, pl_module: Any) -> bool:
        """Validation inside fit is tuned only through its own attribute: sharing ``batch_size`` with
        training would make the val search overwrite the train size (warned once)."""
        if self.name(trainer, pl_module, "val") != self.name(trainer, pl_module, "train"):
            return True
        if not self._warned_shared_val:
            self._warned_shared_val = True
            own = self.schedule.stage_batch_arg_names.val
            self._say(
                f"stages lists val, but validation and training share `{self.schedule.batch_arg_name}`; give "
                f"validation its own `{own}` to tune it during fit (skipped)",
                warn=True,
            )
        return False


__all__ = ["StageAttrs"]
