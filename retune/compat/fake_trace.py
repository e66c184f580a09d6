"""What a fake-tensor trace of a training step (:mod:`retune.prediction`) changes on the trainer and module.

The prediction runs the user's training step against stand-in optimizers over fake parameters. The
step reaches its optimizer through the strategy (automatic optimization: ``trainer.optimizers``;
manual: ``self.optimizers()``, the strategy's ``LightningOptimizer`` wrappers), so both must point at
the stand-ins while it runs: :func:`optimizers_replaced`.

``self.log`` cannot run on fake tensors: its metric objects (torchmetrics) deep-copy a default value
created inside the fake mode, which a fake tensor refuses. What a probe logs is thrown away anyway
(``hooks_isolated``) and a logged scalar is no memory worth predicting, so during a trace
``self.log``/``self.log_dict`` return without doing anything: :func:`logging_silenced`.

Internals used and why: the strategy's ``_optimizers`` and ``_lightning_optimizers``, saved and
restored as they were (the ``optimizers`` setter would build new ``LightningOptimizer`` wrappers on
the way back); both Lightning lines have both (1.9 keeps the wrappers in a dict by index, 2.x in a list).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["logging_silenced", "optimizers_replaced"]


@contextmanager
def optimizers_replaced(trainer: Any, optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """``trainer.optimizers`` (and the module's ``self.optimizers()``) are ``optimizers`` inside the block."""
    strategy = trainer.strategy
    saved = (strategy._optimizers, strategy._lightning_optimizers)
    try:
        strategy.optimizers = list(optimizers)
        yield
    finally:
        strategy._optimizers, strategy._lightning_optimizers = saved


def _drop(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during a trace: nothing is recorded."""


@contextmanager
def logging_silenced(pl_module: Any) -> Iterator[None]:
    """``pl_module.log`` and ``pl_module.log_dict`` do nothing inside the block (instance attributes,
    removed afterwards; one the user set on the instance is put back)."""
    names = ("log", "log_dict")
    saved = {name: vars(pl_module)[name] for name in names if name in vars(pl_module)}
    try:
        for name in names:
            object.__setattr__(pl_module, name, _drop)
        yield
    finally:
        for name in names:
            if name in saved:
                object.__setattr__(pl_module, name, saved[name])
            else:
                object.__delattr__(pl_module, name)
