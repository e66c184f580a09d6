"""What the retune callbacks read off the trainer at an epoch start: the trigger view and the param groups."""

from __future__ import annotations

from typing import Any

from retune import compat
from retune.lr.range_test import GroupInfo
from retune.schedule.triggers import TrainingView


def _param_names(pl_module: Any) -> dict[int, str]:
    return {id(p): name for name, p in pl_module.named_parameters()}


def _name(names: dict[int, str], param: Any) -> str:
    return names.get(id(param), f"<unnamed:{id(param)}>")


def training_view(trainer: Any, pl_module: Any, fit_starting: bool) -> TrainingView:
    """The :class:`~retune.TrainingView` the triggers are asked about (parameter names, not objects, so that
    it survives a checkpoint)."""
    names = _param_names(pl_module)
    groups = tuple(
        frozenset(_name(names, p) for g in opt.param_groups for p in g["params"]) for opt in trainer.optimizers
    )
    trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
    return TrainingView(
        epoch=trainer.current_epoch,
        global_step=trainer.global_step,
        fit_starting=fit_starting,
        trainable_params=trainable,
        param_groups=groups,
        fts_phase=compat.fts_phase(trainer),
    )


def group_infos(optimizer: Any, pl_module: Any) -> list[GroupInfo]:
    """Each param group of ``optimizer``: the names of its parameters and of those that train."""
    names = _param_names(pl_module)
    return [
        GroupInfo(
            params=frozenset(_name(names, p) for p in g["params"]),
            trainable=frozenset(_name(names, p) for p in g["params"] if p.requires_grad),
        )
        for g in optimizer.param_groups
    ]


__all__ = ["group_infos", "training_view"]
