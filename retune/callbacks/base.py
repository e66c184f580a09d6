"""What retune's callbacks share: their Lightning base class, printing, report files, trigger state.

``ScheduledBatchSizeFinder`` and ``ScheduledLRFinder`` both subclass :class:`RetuneCallback` (a
Lightning ``Callback`` of every installed namespace, picklable after a fit), print above Lightning's
progress bar (rank zero only), write their files next to the first logger's, and keep their triggers'
baselines in checkpoints; one implementation of each, here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retune import compat, messages
from retune.schedule.triggers import Trigger

if TYPE_CHECKING:
    _BASES: tuple[type, ...] = (object,)
else:
    _BASES = compat.callback_base_classes()


class RetuneCallback(*_BASES):  # type: ignore[misc]
    """The Lightning ``Callback`` base of retune's callbacks, in every installed Lightning namespace.

    Inheriting from each namespace's ``Callback`` lets ``isinstance`` checks pass whichever one the user
    imports (LightningCLI, the callback connector). A callback pickles (``ddp_spawn``) before and after
    a fit: what Lightning attaches to it during a fit is left out of its pickled state.
    """

    def __getstate__(self) -> dict[str, Any]:
        return compat.without_attached(self.__dict__)


def print_above_bar(message: str) -> None:
    """Print above a TQDM progress bar instead of through it."""
    messages.print_line(message)


def say(message: str, warn: bool, verbose: bool, is_global_zero: bool) -> None:
    """A warning (a ``RetuneWarning``, whatever ``verbose`` says) or, when verbose, a ``[retune]`` progress
    line; on rank zero only, each printed once (``retune.messages``: not also logged, which printed twice)."""
    if not is_global_zero:
        return
    if warn:
        messages.warn(message)
    elif verbose:
        messages.progress(message)


def report_dir(trainer: Any, out_dir: Path | None) -> Path | None:
    """``out_dir``, else ``retune/`` in the first logger's folder; None without either (``logger=False``:
    Lightning writes no logs then, so retune writes no files)."""
    if out_dir is not None:
        return out_dir
    folder = compat.log_dir(trainer)  # not trainer.log_dir: a collective, and only rank zero is here
    return None if folder is None else Path(folder) / "retune"


def trigger_states(triggers: Sequence[Trigger]) -> list[dict[str, Any] | None]:
    """Each trigger's ``state_dict()`` (None for a trigger without one), in order, for a checkpoint."""
    states: list[dict[str, Any] | None] = []
    for trigger in triggers:
        state = getattr(trigger, "state_dict", None)
        states.append(state() if callable(state) else None)
    return states


def load_trigger_states(triggers: Sequence[Trigger], saved: Sequence[dict[str, Any] | None]) -> None:
    """Give each trigger back its checkpointed baseline (by position, as :func:`trigger_states` wrote them)."""
    for trigger, state in zip(triggers, saved, strict=False):
        if state is not None and hasattr(trigger, "load_state_dict"):
            trigger.load_state_dict(state)


__all__ = ["RetuneCallback", "load_trigger_states", "print_above_bar", "report_dir", "say", "trigger_states"]
