"""What a step leaves in a module's own Python attributes, put back.

A ``training_step`` may keep things on the module outside its parameters and buffers: Lightning 2.x's
documented way to gather a value per step for an epoch-end hook is a list on the module
(``self.training_step_outputs.append(loss.detach())``, read and cleared in ``on_train_epoch_end``).
A probe step appends to it too, so the epoch's mean would include the probes' losses; a fake-tensor
trace would append a *fake* tensor, and the epoch-end ``torch.stack`` then fails ("Mixing fake modes").
:class:`ModuleAttributes` saves, for every submodule, the contents of its public list, dict and set
attributes (a shallow copy: the same elements) and, where asked, which object each public attribute
names, and puts both back. The probes' snapshot and the traces ask for both: a counter a step rebinds
(``self.steps_seen += 1``, read by a warm-up) would otherwise count the probes' steps, and a run whose
search kept its size would end elsewhere than the same run without it.

Public means not starting with ``_``: torch's and Lightning's own fields (``_parameters``, hooks,
``_trainer``, ``_current_fx_name``) are restored by the code that owns them, and ``hparams`` is left
alone (the search sets the batch size there). What is not put back: the contents of a container inside
a container (a dict of lists), and in-place writes into a plain tensor attribute (register it as a
buffer: the snapshot restores buffers).

Example:
    >>> import torch
    >>> module = torch.nn.Linear(2, 2)
    >>> module.outputs = [1]
    >>> kept = ModuleAttributes.capture(module, bindings=True)
    >>> module.outputs.append(2); module.last = 3
    >>> kept.restore()
    >>> module.outputs, hasattr(module, "last")
    ([1], False)
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["ModuleAttributes", "attributes_kept"]

_LEFT_ALONE = frozenset({"hparams"})
_CONTAINERS = (list, dict, set, OrderedDict, defaultdict)
"""The container types whose contents are put back: these exactly, not their subclasses, which may refuse
changes (Hugging Face's ``ModelOutput`` refuses ``update``) or mean something else by them."""


def _public(sub: nn.Module) -> dict[str, Any]:
    return {name: value for name, value in vars(sub).items() if not name.startswith("_") and name not in _LEFT_ALONE}


@dataclass
class ModuleAttributes:
    """Saved public attributes of a module's submodules (see the module doc); :meth:`restore` puts them back."""

    containers: list[tuple[Any, Any]] = field(default_factory=list)
    """``(container, shallow copy of its contents)`` per public list, dict or set attribute (each object once)."""
    bindings: list[tuple[nn.Module, dict[str, Any]]] = field(default_factory=list)
    """Per submodule, its public attributes and the objects they named (with ``bindings=True``)."""

    @classmethod
    def capture(cls, module: nn.Module, bindings: bool = False) -> ModuleAttributes:
        """Save ``module``'s submodules' public containers' contents, and with ``bindings`` their public attributes."""
        kept = cls()
        seen: set[int] = set()
        for sub in module.modules():
            public = _public(sub)
            if bindings:
                kept.bindings.append((sub, public))
            for value in public.values():
                if type(value) in _CONTAINERS and id(value) not in seen:
                    seen.add(id(value))
                    kept.containers.append((value, value.copy()))
        return kept

    def restore(self) -> None:
        """Put the saved contents back in place (the same container objects) where they changed, and the saved
        attributes back. Never raises: a container that refuses is left as it is."""
        for sub, saved in self.bindings:
            attributes = vars(sub)
            for name in [n for n in _public(sub) if n not in saved]:
                del attributes[name]  # made by the step
            for name, value in saved.items():
                if attributes.get(name) is not value:
                    attributes[name] = value
        for container, saved in self.containers:
            if _same(container, saved):
                continue
            try:
                if isinstance(container, list):
                    container[:] = saved
                else:  # a dict or a set: emptied and refilled, in place
                    container.clear()
                    container.update(saved)
            except Exception:  # a container that refuses keeps what the step left (said in the module doc)
                continue


def _same(container: Any, saved: Any) -> bool:
    """Whether ``container`` holds what ``saved`` does, the same objects (no element's ``==``: a tensor's is
    elementwise)."""
    if len(container) != len(saved):
        return False
    if isinstance(container, list):
        return all(a is b for a, b in zip(container, saved, strict=True))
    if isinstance(container, dict):
        return all(key in saved and saved[key] is value for key, value in container.items())
    return all(item in saved for item in container)


@contextmanager
def attributes_kept(module: nn.Module, bindings: bool = True) -> Iterator[None]:
    """Inside the block ``module``'s public attributes may change; after it they are as they were."""
    kept = ModuleAttributes.capture(module, bindings)
    try:
        yield
    finally:
        kept.restore()
