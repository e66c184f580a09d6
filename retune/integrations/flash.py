"""Flash fine-tuning strategies that re-tune the batch size in the hook where they unfreeze.

Flash's strategies (``flash.core.finetuning``) freeze ``Task.modules_to_freeze()`` (the ``backbone``)
before training and unfreeze it at epoch starts by *extending* ``optimizer.param_groups[0]``. The
batch size that fit while the backbone was frozen then needs gradients, optimizer state and stored
activations for the backbone too, and runs out of memory. :class:`RetuneFlashStrategy` is the same
strategy with a :class:`~retune.ScheduledBatchSizeFinder` inside: at every epoch start it first
unfreezes exactly as Flash does, then checks the schedule's triggers and re-tunes, in the same
``on_train_epoch_start`` call. One object passed as ``strategy=`` does both::

    import flash
    from retune.integrations.flash import RetuneFlashStrategy

    trainer = flash.Trainer(max_epochs=10)
    trainer.finetune(model, datamodule=dm, strategy=RetuneFlashStrategy("freeze_unfreeze", unfreeze_epoch=2))

Why one callback and not Flash's strategy plus a finder: ``trainer.finetune`` takes a single
``strategy``, and doing both in one hook leaves no window between the unfreeze and the search in
which another callback could run.

The plain :class:`~retune.ScheduledBatchSizeFinder` works alongside Flash's own strategies too
(``trainer.finetune(..., strategy=("freeze_unfreeze", 2))`` with the finder in ``callbacks``); it
moves itself after every other callback, so it also sees each unfreeze in the same epoch.

The batch size is read and written where Lightning's lookup finds ``batch_arg_name``; for Flash that
is ``DataModule.batch_size``, which Flash's ``train_dataloader`` reads each time it builds a loader.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Union

from flash.core.finetuning import FinetuningStrategies, FlashBaseFinetuning
from flash.core.model import Task

from retune.callbacks.batch_size_finder import ScheduledBatchSizeFinder
from retune.errors import FieldProblem, RetuneError, ScheduleError
from retune.events import RetuneEvent
from retune.schedule.loading import ScheduleSource
from retune.schedule.models import (
    EpochTrigger,
    ParamGroupsChangedTrigger,
    RetuneSchedule,
    TrainableParamsChangedTrigger,
)
from retune.schedule.triggers import Trigger

STRATEGY_NAMES: tuple[str, ...] = tuple(s.value for s in FinetuningStrategies)
"""Flash's four strategy names: ``no_freeze``, ``freeze``, ``freeze_unfreeze``, ``unfreeze_milestones``."""

StrategyMetadata = Union[int, tuple[tuple[int, int], int], None]
"""Flash's ``strategy_metadata``: the unfreeze epoch, or ``((first_epoch, second_epoch), num_layers)``."""

FlashStrategySpec = Union[str, tuple[str, Any]]
"""What ``flash.Trainer.finetune(strategy=...)`` accepts as a name: ``"freeze"`` or ``("freeze_unfreeze", 2)``."""

_UNFREEZING = (FinetuningStrategies.FREEZE_UNFREEZE, FinetuningStrategies.UNFREEZE_MILESTONES)


def default_schedule(strategy: str | FinetuningStrategies) -> dict[str, Any]:
    """The schedule used when none is given: search at fit start, and after every unfreeze.

    ``param_groups_changed`` is the exact signal of a Flash unfreeze (Flash adds the unfrozen
    parameters to ``param_groups[0]``), so it fires at each unfreeze epoch and at no other. The
    strategies that never unfreeze (``no_freeze``, ``freeze``) search once, at fit start.

    Args:
        strategy: a Flash strategy name (``freeze_unfreeze``, ...) or a ``FinetuningStrategies`` member.
    """
    key = _strategy_key(strategy)
    triggers: list[dict[str, Any]] = [{"kind": "fit_start"}]
    if key in _UNFREEZING:
        triggers.append({"kind": "param_groups_changed"})
    return {"version": 1, "triggers": triggers}


class RetuneFlashStrategy(FlashBaseFinetuning):  # type: ignore[misc]
    """A Flash fine-tuning strategy that re-runs the batch-size search right after it unfreezes.

    Args:
        strategy: one of Flash's strategy names, ``"no_freeze"``, ``"freeze"``, ``"freeze_unfreeze"``
            or ``"unfreeze_milestones"`` (or a ``FinetuningStrategies`` member).
        strategy_metadata: Flash's own spelling of the unfreeze points, as in
            ``trainer.finetune(strategy=("freeze_unfreeze", 2))``: the epoch for ``freeze_unfreeze``,
            ``((first_epoch, second_epoch), num_layers)`` for ``unfreeze_milestones``. Give either this
            or the keywords below.
        unfreeze_epoch: ``freeze_unfreeze`` only: the epoch at whose start the backbone is unfrozen.
        milestones: ``unfreeze_milestones`` only: ``(first_epoch, second_epoch)``. At the first the last
            ``num_layers`` leaf modules of the backbone are unfrozen, at the second the rest.
        num_layers: ``unfreeze_milestones`` only: how many of the backbone's last leaf modules the
            first milestone unfreezes.
        schedule: a schedule file, dict or :class:`~retune.RetuneSchedule` (search settings and
            triggers). Default: :func:`default_schedule` — fit start, plus ``param_groups_changed``
            for the strategies that unfreeze.
        triggers: extra :class:`~retune.Trigger` objects, checked after the schedule's own.
        train_bn: as in Flash: keep batch-norm layers of the frozen backbone trainable.
        verbose: print one line per trial and a summary per search (rank zero only).

    Raises:
        ValueError: an unknown strategy name.
        TypeError: unfreeze points missing, given twice, or given to a strategy that takes none.
        ScheduleError: a schedule none of whose triggers fires at the strategy's unfreeze epochs (it
            would never re-tune, which is the point of this class); add ``param_groups_changed``.

    After (or during) training, :attr:`batch_size` is the train batch size in use and
    :attr:`history` holds one :class:`~retune.RetuneEvent` per search. Checkpoints keep both, as
    plain data under ``"retune"`` next to Flash's own state. (Resuming a run past an unfreeze fails
    in Flash 0.8.2 on Lightning 1.9 itself, retune or not: Lightning records only *added* param
    groups, and Flash extends the first one, so the saved optimizer state no longer matches.)

    The triggers are checked inside this strategy's ``on_train_epoch_start``, right after its own
    unfreeze. Flash lists the strategy first, so a change that a *later* callback makes at the same
    epoch start (rare with Flash) is seen at the next epoch start; use a plain
    :class:`~retune.ScheduledBatchSizeFinder`, which runs after every callback, for that case.
    """

    def __init__(
        self,
        strategy: str | FinetuningStrategies = "no_freeze",
        strategy_metadata: StrategyMetadata = None,
        *,
        unfreeze_epoch: int | None = None,
        milestones: tuple[int, int] | None = None,
        num_layers: int | None = None,
        schedule: ScheduleSource | None = None,
        triggers: Sequence[Trigger] = (),
        train_bn: bool = True,
        verbose: bool = True,
    ) -> None:
        key = _strategy_key(strategy)
        metadata = _metadata(key, strategy_metadata, unfreeze_epoch, milestones, num_layers)
        super().__init__(key, metadata, train_bn)
        self.finder = ScheduledBatchSizeFinder(
            default_schedule(key) if schedule is None else schedule, triggers=triggers, verbose=verbose
        )
        """The finder this strategy drives; it is never in ``trainer.callbacks`` itself."""
        if not triggers:
            _check_unfreezes_are_searched(key, metadata, self.finder.schedule)

    @classmethod
    def from_flash(
        cls,
        strategy: FlashStrategySpec,
        *,
        schedule: ScheduleSource | None = None,
        triggers: Sequence[Trigger] = (),
        train_bn: bool = True,
        verbose: bool = True,
    ) -> RetuneFlashStrategy:
        """The re-tuning version of a strategy written the way ``trainer.finetune`` takes it.

        ``strategy=("freeze_unfreeze", 2)`` becomes
        ``strategy=RetuneFlashStrategy.from_flash(("freeze_unfreeze", 2))``.
        """
        if isinstance(strategy, tuple):
            if len(strategy) != 2:
                raise TypeError(f"a Flash strategy tuple is (name, metadata), got {strategy!r}")
            name, metadata = strategy
            return cls(name, metadata, schedule=schedule, triggers=triggers, train_bn=train_bn, verbose=verbose)
        return cls(strategy, schedule=schedule, triggers=triggers, train_bn=train_bn, verbose=verbose)

    # -- what users read -----------------------------------------------------------------------

    @property
    def schedule(self) -> RetuneSchedule:
        """The validated schedule the finder runs (search settings and triggers)."""
        return self.finder.schedule

    @property
    def batch_size(self) -> int | None:
        """The train batch size the last search chose (None before the first search)."""
        return self.finder.batch_size

    @property
    def history(self) -> list[RetuneEvent]:
        """One :class:`~retune.RetuneEvent` per search, oldest first."""
        return self.finder.history

    # -- Lightning hooks: Flash's behaviour first, then the finder's ------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # Flash freezes modules_to_freeze() here
        if stage == "fit":
            _refuse_second_finder(trainer, self.finder)
        self.finder.setup(trainer, pl_module, stage)
        self._keep_finder_out(trainer)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_fit_start(trainer, pl_module)  # Lightning restores Flash's param groups on resume
        self.finder.on_fit_start(trainer, pl_module)
        self._keep_finder_out(trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Unfreeze as Flash does, then check the triggers and re-tune, before any batch of the epoch."""
        super().on_train_epoch_start(trainer, pl_module)
        self.finder.on_train_epoch_start(trainer, pl_module)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_fit_end(trainer, pl_module)
        self.finder.on_fit_end(trainer, pl_module)  # the table and the history files

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_validation_start(trainer, pl_module)
        self.finder.on_validation_start(trainer, pl_module)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_test_start(trainer, pl_module)
        self.finder.on_test_start(trainer, pl_module)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_predict_start(trainer, pl_module)
        self.finder.on_predict_start(trainer, pl_module)

    # the `oom` trigger's recovery is installed and removed around each loop

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        self.finder.on_train_start(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_end(trainer, pl_module)
        self.finder.on_train_end(trainer, pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self.finder.on_exception(trainer, pl_module, exception)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_validation_end(trainer, pl_module)
        self.finder.on_validation_end(trainer, pl_module)

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_test_end(trainer, pl_module)
        self.finder.on_test_end(trainer, pl_module)

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_predict_end(trainer, pl_module)
        self.finder.on_predict_end(trainer, pl_module)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self.finder.teardown(trainer, pl_module, stage)  # a checkpoint loaded by hand afterwards is a fit's

    def state_dict(self) -> dict[str, Any]:
        state = dict(super().state_dict())
        state["retune"] = self.finder.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = dict(state_dict)
        finder_state = state.pop("retune", None)
        super().load_state_dict(state)
        if finder_state is not None:
            self.finder.load_state_dict(finder_state)

    def _keep_finder_out(self, trainer: Any) -> None:
        """Take the finder back out of ``trainer.callbacks``.

        Used on its own, the finder appends itself to ``trainer.callbacks`` in ``setup`` and
        ``on_fit_start`` so that it runs after every other callback. Here this strategy calls its
        hooks, so left in the list it would search a second time at every epoch start. The list is
        replaced, not edited, because Lightning may be iterating over it right now.
        """
        if any(cb is self.finder for cb in trainer.callbacks):
            trainer.callbacks = [cb for cb in trainer.callbacks if cb is not self.finder]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.strategy.value!r}, {self.strategy_metadata!r}, "
            f"triggers={'+'.join(t.kind for t in self.finder.triggers)})"
        )


def register_strategies(
    schedule: ScheduleSource | None = None,
    *,
    prefix: str = "retune_",
    registry: Any = None,
    verbose: bool = True,
) -> list[str]:
    """Add ``retune_no_freeze``, ``retune_freeze``, ``retune_freeze_unfreeze`` and
    ``retune_unfreeze_milestones`` to Flash's fine-tuning strategy registry.

    For code that names its strategy as a string or tuple (configs, Flash's CLI)::

        register_strategies("schedules/freeze_unfreeze.yaml")
        trainer.finetune(model, datamodule=dm, strategy=("retune_freeze_unfreeze", 2))

    Flash builds a new strategy from the registry for each ``finetune`` call, with the
    ``strategy_metadata`` of the tuple. Every Task shares Flash's registry (``Task.finetuning_strategies``,
    the default ``registry``), so registering affects all of them; calling again replaces the earlier
    registration (with the new ``schedule``). ``schedule=None`` uses :func:`default_schedule` per
    strategy. Returns the names registered.

    Args:
        schedule: the schedule every registered strategy uses (a file, a dict or a ``RetuneSchedule``); None:
            :func:`default_schedule` per strategy.
        prefix: what the registered names start with.
        registry: the registry to add to; None: Flash's, shared by every Task.
        verbose: print a line per search (rank zero only).
    """
    target = Task.finetuning_strategies if registry is None else registry
    names: list[str] = []
    for name in STRATEGY_NAMES:
        full = prefix + name
        target.remove(full)  # FlashRegistry(override=True) appends a second entry for a new partial
        target(fn=functools.partial(RetuneFlashStrategy, name, schedule=schedule, verbose=verbose), name=full)
        names.append(full)
    return names


# -- argument checks -------------------------------------------------------------------------------


def _strategy_key(strategy: str | FinetuningStrategies) -> FinetuningStrategies:
    if isinstance(strategy, FinetuningStrategies):
        return strategy
    if isinstance(strategy, str):
        for key in FinetuningStrategies:
            if key.value == strategy:
                return key
    raise ValueError(f"unknown Flash fine-tuning strategy {strategy!r}; one of: {', '.join(STRATEGY_NAMES)}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _metadata(
    key: FinetuningStrategies,
    metadata: StrategyMetadata,
    unfreeze_epoch: int | None,
    milestones: tuple[int, int] | None,
    num_layers: int | None,
) -> StrategyMetadata:
    """Flash's ``strategy_metadata`` from either spelling, checked before Flash's own checks run."""
    keywords = {"unfreeze_epoch": unfreeze_epoch, "milestones": milestones, "num_layers": num_layers}
    given = [name for name, value in keywords.items() if value is not None]
    if key not in _UNFREEZING:
        if metadata is not None or given:
            extra = ", ".join(given) if given else f"strategy_metadata={metadata!r}"
            raise TypeError(f"the {key.value!r} strategy never unfreezes and takes no unfreeze points ({extra})")
        return None
    if key is FinetuningStrategies.FREEZE_UNFREEZE:
        if milestones is not None or num_layers is not None:
            raise TypeError(
                "'freeze_unfreeze' takes `unfreeze_epoch`; `milestones`/`num_layers` are for 'unfreeze_milestones'"
            )
        epoch = _one_of(key, metadata, unfreeze_epoch, "unfreeze_epoch=2")
        if not _is_int(epoch) or epoch < 0:
            raise TypeError(f"'freeze_unfreeze' needs the epoch to unfreeze at, an int >= 0; got {epoch!r}")
        return int(epoch)
    if unfreeze_epoch is not None:
        raise TypeError(
            "'unfreeze_milestones' takes `milestones` and `num_layers`; `unfreeze_epoch` is for 'freeze_unfreeze'"
        )
    if (milestones is None) != (num_layers is None):
        raise TypeError("'unfreeze_milestones' needs both `milestones=(first, second)` and `num_layers`")
    spelled = None if milestones is None else (tuple(milestones), num_layers)
    value = _one_of(key, metadata, spelled, "milestones=(5, 10), num_layers=2")
    ok = (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], tuple)
        and len(value[0]) == 2
        and all(_is_int(v) for v in (*value[0], value[1]))
    )
    if not ok:
        raise TypeError(f"'unfreeze_milestones' needs ((first_epoch, second_epoch), num_layers) of ints; got {value!r}")
    (first, second), layers = value
    if not 0 <= first < second or layers < 1:
        raise TypeError(
            f"'unfreeze_milestones' needs 0 <= first_epoch < second_epoch and num_layers >= 1; got {value!r} "
            "(with first >= second Flash would never unfreeze the rest of the backbone)"
        )
    return ((first, second), layers)


def _one_of(key: FinetuningStrategies, metadata: Any, keywords: Any, example: str) -> Any:
    if metadata is not None and keywords is not None:
        raise TypeError(f"{key.value!r}: give the unfreeze points once, as strategy_metadata or as keywords")
    if metadata is None and keywords is None:
        raise TypeError(f"{key.value!r} needs its unfreeze points, e.g. RetuneFlashStrategy({key.value!r}, {example})")
    return keywords if metadata is None else metadata


def _unfreeze_epochs(key: FinetuningStrategies, metadata: StrategyMetadata) -> tuple[int, ...]:
    if key is FinetuningStrategies.FREEZE_UNFREEZE and isinstance(metadata, int):
        return (metadata,)
    if key is FinetuningStrategies.UNFREEZE_MILESTONES and isinstance(metadata, tuple):
        return tuple(metadata[0])
    return ()


def _check_unfreezes_are_searched(
    key: FinetuningStrategies, metadata: StrategyMetadata, schedule: RetuneSchedule
) -> None:
    """Refuse a schedule that would never search after this strategy's unfreezes."""
    epochs = _unfreeze_epochs(key, metadata)
    if not epochs:
        return
    for config in schedule.triggers:
        if isinstance(config, (ParamGroupsChangedTrigger, TrainableParamsChangedTrigger)):
            return
    missed = set(epochs)
    for config in schedule.triggers:
        if isinstance(config, EpochTrigger):
            if config.at is not None:
                missed -= set(config.at)
            elif config.every is not None:
                missed -= {e for e in epochs if e > 0 and e % config.every == 0}
    if missed:
        where = ", ".join(str(e) for e in sorted(missed))
        raise ScheduleError(
            f"RetuneFlashStrategy({key.value!r})",
            [
                FieldProblem(
                    "triggers",
                    f"no trigger fires at the unfreeze at epoch {where}, so the batch size would never be "
                    "re-tuned; add {kind: param_groups_changed} (Flash extends param_groups[0] when it unfreezes)",
                )
            ],
        )


def _refuse_second_finder(trainer: Any, own: ScheduledBatchSizeFinder) -> None:
    """Two finders would both search at every trigger; the second search would be wasted work."""
    others = [cb for cb in trainer.callbacks if isinstance(cb, ScheduledBatchSizeFinder) and cb is not own]
    if others:
        raise RetuneError(
            "RetuneFlashStrategy already re-tunes the batch size; remove the ScheduledBatchSizeFinder from "
            "the trainer's callbacks (or use one of Flash's own strategies with it)"
        )


__all__ = ["STRATEGY_NAMES", "RetuneFlashStrategy", "default_schedule", "register_strategies"]
