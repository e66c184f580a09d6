"""The batch-size attribute, found and written the way Lightning's own tuner does (``lightning_*attr``)."""

from __future__ import annotations

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


__all__ = ["batch_attr_places", "get_batch_attr", "has_batch_attr", "set_batch_attr"]
