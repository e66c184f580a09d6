"""When to re-run the search: triggers as pure logic over a :class:`TrainingView`.

The Lightning glue builds one ``TrainingView`` per epoch start (after every callback that can
freeze or unfreeze has run) and asks every trigger once. A trigger answers ``None`` (do not
search) or the direction the change implies for a warm start: ``"down"`` when the step got more
expensive (more trainable parameters), ``"up"`` when cheaper, ``"unknown"`` otherwise.

Stateful triggers keep their baseline in ``state_dict()`` so that a resumed run compares with
what the checkpointed run saw, not with nothing.

Custom triggers implement the :class:`Trigger` protocol::

    class EveryThousandSteps:
        kind = "every_1000_steps"

        def __init__(self) -> None:
            self.last = 0

        def check(self, view: TrainingView) -> Direction | None:
            if view.global_step - self.last >= 1000:
                self.last = view.global_step
                return "unknown"
            return None

    ScheduledBatchSizeFinder("schedule.yaml", triggers=[EveryThousandSteps()])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from retune.errors import RetuneError
from retune.events import Direction
from retune.schedule.models import (
    EpochTrigger,
    FitStartTrigger,
    FtsPhaseTrigger,
    OomTrigger,
    ParamGroupsChangedTrigger,
    TrainableParamsChangedTrigger,
    TriggerConfig,
)


@dataclass(frozen=True)
class TrainingView:
    """What triggers may look at: the training state at one epoch start, free of Lightning types."""

    epoch: int
    """The epoch about to start (Lightning's ``current_epoch``, 0-based)."""
    global_step: int
    """Optimizer steps taken so far in this fit."""
    fit_starting: bool
    """True at the first epoch start of a ``fit`` that has no tuned size yet (not a resumed run)."""
    trainable_params: int
    """Number of parameter elements with ``requires_grad=True``."""
    param_groups: tuple[frozenset[str], ...]
    """Per optimizer, the names of all parameters in its param groups."""
    fts_phase: int | None = None
    """finetuning-scheduler's current phase (``curr_depth``), or None without that callback."""


@runtime_checkable
class Trigger(Protocol):
    """A reason to search. ``check`` is called exactly once per epoch start, in epoch order."""

    kind: str

    def check(self, view: TrainingView) -> Direction | None: ...


class FitStart:
    kind = "fit_start"

    def check(self, view: TrainingView) -> Direction | None:
        return "unknown" if view.fit_starting else None


class EpochMilestones:
    """Fires at the start of listed epochs, or of every N-th epoch (N, 2N, ...).

    Remembers the last epoch it saw so a run resumed mid-epoch does not search that epoch twice.
    """

    kind = "epoch"

    def __init__(self, at: Iterable[int] | None = None, every: int | None = None) -> None:
        if (at is None) == (every is None):
            raise ValueError("EpochMilestones needs exactly one of `at` or `every`")
        self.at = frozenset(at) if at is not None else None
        self.every = every
        self.last_epoch: int | None = None

    def check(self, view: TrainingView) -> Direction | None:
        if self.last_epoch is not None and view.epoch <= self.last_epoch:
            return None
        self.last_epoch = view.epoch
        if self.at is not None:
            hit = view.epoch in self.at
        else:
            assert self.every is not None
            hit = view.epoch > 0 and view.epoch % self.every == 0
        return "unknown" if hit else None

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = state.get("last_epoch")


class ParamGroupsChanged:
    """Fires when the set of parameters the optimizers hold changes.

    Compares parameter *names*, not group counts: Flash's strategies unfreeze by extending
    ``param_groups[0]``, which leaves the number of groups unchanged.
    """

    kind = "param_groups_changed"

    def __init__(self) -> None:
        self.baseline: tuple[frozenset[str], ...] | None = None

    def check(self, view: TrainingView) -> Direction | None:
        before, self.baseline = self.baseline, view.param_groups
        if before is None or before == view.param_groups:
            return None
        old = frozenset().union(*before)
        new = frozenset().union(*view.param_groups)
        # strictly more parameters to train costs more memory; a swap (freeze a layer, add an adapter) is unknown
        return "down" if new > old else "up" if new < old else "unknown"

    def state_dict(self) -> dict[str, Any]:
        return {"baseline": None if self.baseline is None else [sorted(g) for g in self.baseline]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        base = state.get("baseline")
        self.baseline = None if base is None else tuple(frozenset(g) for g in base)


class TrainableParamsChanged:
    """Fires when the trainable-parameter count changes by more than ``min_fraction`` of the last count."""

    kind = "trainable_params_changed"

    def __init__(self, min_fraction: float = 0.0) -> None:
        self.min_fraction = min_fraction
        self.baseline: int | None = None

    def check(self, view: TrainingView) -> Direction | None:
        before = self.baseline
        if before is None:
            self.baseline = view.trainable_params
            return None
        change = abs(view.trainable_params - before) / max(before, 1)
        if view.trainable_params == before or change <= self.min_fraction:
            return None
        self.baseline = view.trainable_params
        return "down" if view.trainable_params > before else "up"

    def state_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.baseline = state.get("baseline")


class FtsPhase:
    """Fires when finetuning-scheduler's phase changes; a deeper phase unfreezes more, so "down"."""

    kind = "fts_phase"

    def __init__(self) -> None:
        self.baseline: int | None = None

    def check(self, view: TrainingView) -> Direction | None:
        before, self.baseline = self.baseline, view.fts_phase
        if before is None or view.fts_phase is None or before == view.fts_phase:
            return None
        return "down" if view.fts_phase > before else "up"

    def state_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.baseline = state.get("baseline")


class OutOfMemory:
    """Fires at the first epoch start after a real step ran out of memory and was recovered.

    The recovery (:mod:`retune.recovery.train_step`) reports each event with :meth:`record`; the search that
    follows is warm and treats the failed batch size as a known failure ("down").
    """

    kind = "oom"

    def __init__(
        self, loss_reduction: str = "mean", loss_items: str | None = None, check_exactness: bool = True
    ) -> None:
        self.loss_reduction = loss_reduction
        self.loss_items = loss_items
        self.check_exactness = check_exactness
        """Compare the first batch's loss with its halves' before it trains (:mod:`retune.recovery.exactness`)."""
        self.failed_size: int | None = None
        """The smallest batch size that ran out of memory since the last epoch start."""
        self.fitting_size: int | None = None
        """The smallest micro-batch size that then fit (every micro-batch of a recovered step fit)."""

    def record(self, failed_size: int, fitting_size: int) -> None:
        self.failed_size = failed_size if self.failed_size is None else min(self.failed_size, failed_size)
        self.fitting_size = fitting_size if self.fitting_size is None else min(self.fitting_size, fitting_size)

    def check(self, view: TrainingView) -> Direction | None:
        return "down" if self.failed_size is not None else None

    def consume(self) -> tuple[int, int] | None:
        """``(fitting, failed)`` sizes learned since the last search, and forget them."""
        if self.failed_size is None or self.fitting_size is None:
            return None
        known = (self.fitting_size, self.failed_size)
        self.failed_size = self.fitting_size = None
        return known

    def state_dict(self) -> dict[str, Any]:
        return {"failed_size": self.failed_size, "fitting_size": self.fitting_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.failed_size = state.get("failed_size")
        self.fitting_size = state.get("fitting_size")


def build_triggers(configs: Sequence[TriggerConfig]) -> list[Trigger]:
    """The trigger objects for a schedule's ``triggers`` list."""
    triggers: list[Trigger] = []
    for config in configs:
        if isinstance(config, FitStartTrigger):
            triggers.append(FitStart())
        elif isinstance(config, EpochTrigger):
            triggers.append(EpochMilestones(at=config.at, every=config.every))
        elif isinstance(config, ParamGroupsChangedTrigger):
            triggers.append(ParamGroupsChanged())
        elif isinstance(config, TrainableParamsChangedTrigger):
            triggers.append(TrainableParamsChanged(config.min_fraction))
        elif isinstance(config, FtsPhaseTrigger):
            triggers.append(FtsPhase())
        elif isinstance(config, OomTrigger):
            triggers.append(OutOfMemory(config.loss_reduction, config.loss_items, config.check_exactness))
        else:  # pragma: no cover - the schedule's discriminated union admits nothing else
            raise TypeError(f"unknown trigger config {config!r}")
    return triggers


@dataclass(frozen=True)
class Firing:
    """The triggers that fired at one epoch start, merged into one search."""

    kinds: tuple[str, ...]
    direction: Direction

    @property
    def label(self) -> str:
        return "+".join(self.kinds)


def evaluate(triggers: Sequence[Trigger], view: TrainingView) -> Firing | None:
    """Ask every trigger (all of them, so each keeps its baseline current) and merge the answers."""
    kinds: list[str] = []
    directions: set[Direction] = set()
    for trigger in triggers:
        answer = trigger.check(view)
        if answer not in (None, "down", "up", "unknown"):
            raise RetuneError(
                f"trigger {trigger.kind!r} ({type(trigger).__qualname__}) returned {answer!r} from check(): a "
                "trigger returns 'down' (memory grew), 'up' (memory shrank), 'unknown' or None (no search)"
            )
        if answer is not None:
            if trigger.kind not in kinds:
                kinds.append(trigger.kind)
            directions.add(answer)
    if not kinds:
        return None
    known = directions - {"unknown"}
    direction: Direction = known.pop() if len(known) == 1 else "unknown"
    return Firing(tuple(kinds), direction)


__all__ = [
    "EpochMilestones",
    "Firing",
    "FitStart",
    "FtsPhase",
    "OutOfMemory",
    "ParamGroupsChanged",
    "TrainableParamsChanged",
    "TrainingView",
    "Trigger",
    "build_triggers",
    "evaluate",
]
