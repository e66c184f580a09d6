"""What a step changes on the module besides its parameters, saved and put back by a recovery.

A ``training_step`` or ``validation_step`` that updates a torchmetrics ``Metric`` or appends to a list on the
module does so once per call; a recovered step calls it once per micro-batch, and a round of micro-batches that
runs out of memory partway must leave nothing behind, or the next round counts those micro-batches again (a
``SumMetric`` of the samples read 36 for 16). The probes' snapshot and the ``oom`` trigger's exactness check keep
the same two things (:mod:`retune.probing.metric_states`, :mod:`retune.probing.attributes`).

Example:
    >>> import torch
    >>> module = torch.nn.Linear(2, 2)
    >>> module.seen = []
    >>> saved = SideEffects.capture(module)
    >>> module.seen.append(1)
    >>> saved.restore()
    >>> module.seen
    []
"""

from __future__ import annotations

import torch

from retune.probing.attributes import ModuleAttributes
from retune.probing.metric_states import MetricStates


class SideEffects:
    """A module's torchmetrics states and public attributes (:mod:`retune.probing.metric_states`,
    :mod:`retune.probing.attributes`), saved, and put back by :meth:`restore` (attributes first, then the metrics,
    as the probes do: an attribute rebound after them would name the updated state object again)."""

    def __init__(self, metrics: MetricStates, attributes: ModuleAttributes) -> None:
        self.metrics, self.attributes = metrics, attributes

    @classmethod
    def capture(cls, module: torch.nn.Module) -> SideEffects:
        return cls(MetricStates.capture(module), ModuleAttributes.capture(module, bindings=True))

    def restore(self) -> None:
        self.attributes.restore()
        self.metrics.restore()


__all__ = ["SideEffects"]
