"""torchmetrics states a step updates, saved and put back (torchmetrics itself is optional).

A ``Metric`` keeps its states as plain attributes, not buffers (``add_state``), and counts its updates: a
``training_step`` that updates one (Lightning's documented pattern, every Flash task's) would count a probe's
batches, or the ``oom`` trigger's exactness check's forwards, in the epoch's value. :class:`MetricStates`
saves every ``Metric`` submodule's registered states and update bookkeeping (deep copies) and writes copies of
them back. The probes' snapshot (:mod:`retune.probing.snapshot`) and the exactness check
(:mod:`retune.recovery.exactness`) use it; both put the module's public attributes back *before* it (a
rebinding restored after it would name the object the step updated in place again).

Example (without torchmetrics installed there is nothing to save):
    >>> import torch
    >>> with metrics_kept(torch.nn.Linear(2, 2)):
    ...     pass
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["MetricStates", "is_metric", "metrics_kept"]

_BOOKKEEPING = ("_update_count", "_computed", "_forward_cache")


def is_metric(module: nn.Module) -> bool:
    """A torchmetrics ``Metric``, checked without importing torchmetrics (it is optional)."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(module, torchmetrics.Metric)


def _state(metric: Any) -> dict[str, Any]:
    """The states registered with ``add_state`` (listed in ``_defaults``) and the update bookkeeping."""
    names = [*metric._defaults, *(name for name in _BOOKKEEPING if hasattr(metric, name))]
    return {name: copy.deepcopy(getattr(metric, name)) for name in names}


@dataclass
class MetricStates:
    """Every ``Metric`` submodule of a module and its saved states (:meth:`capture`); :meth:`restore` writes them."""

    saved: list[tuple[nn.Module, dict[str, Any]]] = field(default_factory=list)

    @classmethod
    def capture(cls, module: nn.Module) -> MetricStates:
        return cls([(sub, _state(sub)) for sub in module.modules() if is_metric(sub)])

    def restore(self) -> None:
        """Copies of the saved states back (the saved ones stay intact for a later restore)."""
        for metric, state in self.saved:
            for name, value in state.items():
                setattr(metric, name, copy.deepcopy(value))


@contextmanager
def metrics_kept(module: nn.Module) -> Iterator[None]:
    """Inside the block ``module``'s metrics may be updated; after it they hold what they held before."""
    states = MetricStates.capture(module)
    try:
        yield
    finally:
        states.restore()
