"""Which Lightning a trainer comes from, and the modules of that line.

Two lines are supported: 2.x (``pytorch_lightning`` and ``lightning.pytorch``) and 1.9
(``pytorch_lightning`` 1.9.5, which lightning-flash pins). The namespace is taken from the trainer's
own class, never assumed, so a callback works with whichever ``Trainer`` the user built.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType
from typing import Any

from retune.errors import RetuneError

_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def namespace_of(trainer: Any) -> str:
    """``"lightning.pytorch"`` or ``"pytorch_lightning"``: the package the trainer's class comes from."""
    for cls in type(trainer).__mro__:
        module = cls.__module__
        for ns in _NAMESPACES:
            if module == ns or module.startswith(ns + "."):
                return ns
    raise RetuneError(
        f"{type(trainer).__name__} is not a Lightning Trainer (from lightning.pytorch or pytorch_lightning)"
    )


@cache
def import_module(name: str) -> ModuleType:
    return importlib.import_module(name)


@cache
def _major(ns: str) -> int:
    version = str(import_module(ns).__version__)
    return int(version.split(".")[0])


def is_legacy(trainer: Any) -> bool:
    """True on Lightning 1.x (the 1.9 line Flash pins)."""
    return _major(namespace_of(trainer)) < 2


def callback_base_classes() -> tuple[type, ...]:
    """Lightning ``Callback`` classes of every installed namespace.

    retune's callback inherits from all of them so that ``isinstance`` checks (LightningCLI's
    ``trainer.callbacks`` type, the callback connector) pass whichever namespace the user uses.
    """
    bases: list[type] = []
    for ns in _NAMESPACES:
        try:
            callback = import_module(ns + ".callbacks").Callback
        except ImportError:
            continue
        if callback not in bases:
            bases.append(callback)
    if not bases:
        raise ImportError("retune needs Lightning: pip install 'pytorch-lightning>=1.9' (or 'lightning')")
    return tuple(bases)


ATTACHED_TO_CALLBACKS = ("log", "log_dict")
"""What Lightning 1.9 sets on every callback at fit start (``callback.log = lightning_module.log``): bound
methods of the module, which keep it (and, once the trainer is gone, a dead weak proxy) alive."""


def without_attached(state: dict[str, Any]) -> dict[str, Any]:
    """A callback's ``__dict__`` without what Lightning attached to it (re-attached at every fit).

    Pickling a callback after a 1.9 fit otherwise pickles the whole LightningModule through those bound
    methods, and fails with ``ReferenceError`` once the trainer its weak proxy points at is gone.
    """
    return {key: value for key, value in state.items() if key not in ATTACHED_TO_CALLBACKS}


__all__ = [
    "ATTACHED_TO_CALLBACKS",
    "callback_base_classes",
    "import_module",
    "is_legacy",
    "namespace_of",
    "without_attached",
]
