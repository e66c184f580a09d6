"""The batch-size attribute, found and written the way Lightning's own tuner does (``lightning_*attr``)."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

from retune.compat.namespace import import_module, namespace_of
from retune.errors import RetuneError


def _parsing(trainer: Any) -> ModuleType:
    return import_module(namespace_of(trainer) + ".utilities.parsing")


def has_batch_attr(trainer: Any, pl_module: Any, name: str) -> bool:
    return bool(_parsing(trainer).lightning_hasattr(pl_module, name))


def get_batch_attr(trainer: Any, pl_module: Any, name: str) -> int:
    value = _parsing(trainer).lightning_getattr(pl_module, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RetuneError(f"`{name}` must hold an int batch size, found {value!r}")
    return value


def set_batch_attr(trainer: Any, pl_module: Any, name: str, value: int) -> None:
    """Write ``value`` everywhere Lightning's lookup finds ``name`` (model, hparams, datamodule)."""
    _parsing(trainer).lightning_setattr(pl_module, name, value)


def batch_attr_places(trainer: Any, pl_module: Any, name: str) -> list[tuple[str, Any]]:
    """Every place Lightning's lookup finds ``name``, in its order, as ``("model.hparams.batch_size", 32)``
    pairs: ``set_batch_attr`` writes all of them, ``get_batch_attr`` reads the last."""
    datamodule = getattr(trainer, "datamodule", None)
    labels = [(pl_module, "model"), (datamodule, "datamodule")]
    labels += [(getattr(owner, "hparams", None), f"{label}.hparams") for owner, label in labels if owner is not None]
    places = []
    for holder in _parsing(trainer)._lightning_get_all_attr_holders(pl_module, name):
        label = next((text for obj, text in labels if obj is holder), type(holder).__name__)
        value = holder[name] if isinstance(holder, dict) else getattr(holder, name)
        places.append((f"{label}.{name}", value))
    return places


LR_ATTRIBUTES = ("lr", "learning_rate")
"""The names Lightning's ``LearningRateFinder`` writes its suggestion to (on the model, its ``hparams`` or the
datamodule), which ``configure_optimizers`` or a warm-up in ``optimizer_step`` read the rate from."""


def set_lr_attributes(
    trainer: Any, pl_module: Any, old: list[float], new: float, others: list[float] | None = None
) -> list[str]:
    """Write ``new`` to each of :data:`LR_ATTRIBUTES` whose value is one of the ``old`` rates it replaces (the rate
    the attribute names: a head's rate is left alone when only the backbone's group was tested), everywhere
    Lightning's lookup finds it. An attribute whose value is also one of ``others`` (the rates of groups left as
    they are) names either: it is left alone too. Returns the names written."""
    return _rewrite_lr_attributes(trainer, pl_module, old, others or [], lambda value: new)


def scale_lr_attributes(trainer: Any, pl_module: Any, rates: list[float], factor: float) -> list[str]:
    """``apply.lr_scaling``: multiply each of :data:`LR_ATTRIBUTES` whose value is one of the optimizers' ``rates``
    (before the scaling, which moves every group by ``factor``) by ``factor``. Returns the names written."""
    if factor == 1.0:
        return []
    return _rewrite_lr_attributes(trainer, pl_module, rates, [], lambda value: value * factor)


def _rewrite_lr_attributes(
    trainer: Any, pl_module: Any, old: list[float], others: list[float], rewrite: Any
) -> list[str]:
    parsing = _parsing(trainer)
    written = []

    def among(value: float, rates: list[float]) -> bool:
        return any(math.isclose(value, rate, rel_tol=1e-9, abs_tol=0.0) for rate in rates)

    for name in LR_ATTRIBUTES:
        if not parsing.lightning_hasattr(pl_module, name):
            continue
        value = parsing.lightning_getattr(pl_module, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if among(float(value), old) and not among(float(value), others):
            parsing.lightning_setattr(pl_module, name, rewrite(float(value)))
            written.append(name)
    return written


def lr_attribute_values(trainer: Any, pl_module: Any, names: Any) -> dict[str, float]:
    """The value of each of ``names`` (:data:`LR_ATTRIBUTES` retune wrote) where Lightning's lookup finds a number:
    what a checkpoint keeps, since Lightning rebuilds the model's ``hparams`` from its constructor on resume."""
    parsing = _parsing(trainer)
    values = {}
    for name in names:
        if parsing.lightning_hasattr(pl_module, name):
            value = parsing.lightning_getattr(pl_module, name)
            if not isinstance(value, bool) and isinstance(value, (int, float)):
                values[name] = float(value)
    return values


def write_lr_attributes(trainer: Any, pl_module: Any, values: dict[str, float]) -> list[str]:
    """Write back what :func:`lr_attribute_values` read (a resumed fit), everywhere Lightning's lookup finds each
    name; a name the model no longer has is skipped. Returns the names written."""
    parsing = _parsing(trainer)
    written = []
    for name, value in values.items():
        if parsing.lightning_hasattr(pl_module, name):
            parsing.lightning_setattr(pl_module, name, value)
            written.append(name)
    return written


__all__ = [
    "LR_ATTRIBUTES",
    "batch_attr_places",
    "get_batch_attr",
    "has_batch_attr",
    "lr_attribute_values",
    "scale_lr_attributes",
    "set_batch_attr",
    "set_lr_attributes",
    "write_lr_attributes",
]
