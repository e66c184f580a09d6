"""One training step as parts: what the Lightning closure runner hands the step recovery.

A base type shared across the layers: :mod:`retune.compat.closure_runner` builds a :class:`StepParts`
from the closure Lightning made for a batch (its own forward, zero_grad and backward), and
:mod:`retune.recovery.train_step` runs the step from them, whole or as micro-batches. Neither side
imports the other: this module is the contract between them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch


class MicroLogs(Protocol):
    """Where a recovered training step's ``self.log`` calls go (Lightning's side:
    :mod:`retune.compat.closure_runner`)."""

    def record(self, micro: Any) -> AbstractContextManager[Any]:
        """Around one micro-batch's step: its logged values are recorded, not applied."""

    def discard(self, micro: Any) -> AbstractContextManager[Any]:
        """Around one micro-batch's step whose values the whole batch already logged: dropped."""

    def commit(self, weights: Sequence[float], samples: Sequence[int | None], add: bool = False) -> None:
        """Apply the recorded values once, each key's combined as the whole batch's (weighted like the loss;
        ``add``: the loss is a sum, and so is a mean-reduced value's whole-batch form)."""

    def clear(self) -> None:
        """Forget what was recorded (a round of micro-batches ran out of memory)."""


class _NoLogs:
    def record(self, micro: Any) -> AbstractContextManager[Any]:
        return nullcontext()

    def discard(self, micro: Any) -> AbstractContextManager[Any]:
        return nullcontext()

    def commit(self, weights: Sequence[float], samples: Sequence[int | None], add: bool = False) -> None:
        return None

    def clear(self) -> None:
        return None


class StepParts:
    """The three parts of one step's closure, as Lightning built them, plus how to run the step on a micro-batch."""

    def __init__(
        self,
        batch: Any,
        forward: Callable[[Any], Any],
        zero_grad: Callable[[], None] | None,
        backward: Callable[[torch.Tensor], None] | None,
        loss_of: Callable[[Any], torch.Tensor | None],
        with_loss: Callable[[Any, torch.Tensor | None], Any],
        logs: MicroLogs | None = None,
        join: Callable[[Sequence[Any], Sequence[int | None]], Any] | None = None,
        where: Callable[[], str] = lambda: "",
        save_logs: Callable[[], Callable[[], None]] = lambda: lambda: None,
        journal_logs: Callable[[], tuple[Callable[[], None], Callable[[], None]]] | None = None,
    ) -> None:
        self.batch = batch
        self.forward = forward  # the step on a (micro-)batch: returns the loop's step result
        self.zero_grad = zero_grad
        self.backward = backward
        self.loss_of = loss_of  # the loss tensor (with graph) in a step result
        self.with_loss = with_loss  # the step result with another loss
        self.logs: MicroLogs = logs if logs is not None else _NoLogs()
        self.join = join  # the micro-batches' step results as one (outputs joined); None: the last one
        self.where = where  # "epoch 2, global step 40", for error messages: built only when one is raised
        self.save_logs = save_logs  # returns a function that puts the logged metrics back as they are now
        self.journal_logs = journal_logs  # starts recording what self.log changes: (rollback, stop)


__all__ = ["MicroLogs", "StepParts"]
