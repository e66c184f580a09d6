"""BatchNorm running statistics around a training step that runs out of memory (no Lightning here).

A BatchNorm layer in training mode updates ``running_mean``, ``running_var`` and
``num_batches_tracked`` inside its forward. A forward that runs out of memory after such a layer
has updated them for a batch that never trained; the run with memory updated them once. So the
recovery needs the values from before the step: :meth:`RunningStats.save` copies them into
buffers allocated once (one fused ``_foreach_copy_``, only for models that have such layers;
nothing at all for the others), and :meth:`RunningStats.restore` puts them back.

BatchNorm normalises each micro-batch with that micro-batch's statistics, so a recovered step's
gradient and running statistics differ from the whole batch's by nature (as under gradient
accumulation); and a 1-sample micro-batch cannot be normalised (BatchNorm1d raises), which is why
:func:`needs_two_samples` makes the recovery keep pieces of two samples or more.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _batchnorms(module: nn.Module) -> list[_BatchNorm]:
    return [m for m in module.modules() if isinstance(m, _BatchNorm)]


def needs_two_samples(module: nn.Module) -> bool:
    """True when a BatchNorm layer in training mode would normalise a micro-batch by its own statistics."""
    return any(m.training for m in _batchnorms(module))


class RunningStats:
    """The running statistics of every BatchNorm layer of a module, saved before a step and put back on demand."""

    def __init__(self, module: nn.Module) -> None:
        self.live: list[torch.Tensor] = []
        for layer in _batchnorms(module):
            for buffer in (layer.running_mean, layer.running_var, layer.num_batches_tracked):
                if isinstance(buffer, torch.Tensor):
                    self.live.append(buffer)
        self.saved = [torch.empty_like(b) for b in self.live]

    def __bool__(self) -> bool:
        return bool(self.live)

    def save(self) -> None:
        if self.live:
            with torch.no_grad():
                torch._foreach_copy_(self.saved, self.live)

    def restore(self) -> None:
        if self.live:
            with torch.no_grad():
                torch._foreach_copy_(self.live, self.saved)


__all__ = ["RunningStats", "needs_two_samples"]
