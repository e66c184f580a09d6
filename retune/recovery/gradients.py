"""The gradients around a backward pass that ran out of memory, for a recovery that must not count one twice.

An OOM in backward leaves some parameters holding this batch's complete gradient and the rest
untouched: :class:`FinishedGradients` finds which, so only the others are computed again.
Gradients already accumulated from earlier batches of an accumulation window are set aside while
micro-batches run (:class:`GradientsAside`) and added back after, so a micro-batch that runs out of
memory too can be dropped whole. Used by :class:`~retune.recovery.train_step.TrainStepRecovery`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FinishedGradients:
    """Which parameters received their gradient in a backward pass that ran out of memory.

    Autograd accumulates a parameter's gradient once, when all of it is known. Nothing is noted on a
    step that starts an accumulation window (every step, without accumulation): its ``zero_grad``
    has just set the gradients to None (torch's default) or to zeros, so after a failed backward the
    parameters holding a gradient that is not None and not all zeros are the finished ones (a
    finished gradient that is exactly zero is recomputed as zero: no harm). Inside a window the
    gradients hold the earlier batches' sums, so :meth:`take` notes each gradient tensor and its
    version counter right before backward (no copy, no hook) and :meth:`collect` compares. The
    trainable parameters of that note are listed at :meth:`rearm` (each epoch start); one unfrozen
    since is judged by the first rule.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.ids: set[int] = set()
        self.trainable: list[torch.nn.Parameter] = []
        self._before: list[tuple[torch.Tensor | None, int]] | None = None
        self.rearm(params)

    def rearm(self, params: Sequence[torch.nn.Parameter]) -> None:
        """List the trainable parameters again (an unfreeze)."""
        self.trainable = [p for p in params if p.requires_grad]

    def take(self) -> None:
        self._before = [(g, g._version) if (g := p.grad) is not None else (None, 0) for p in self.trainable]

    def forget(self) -> None:
        self._before = None

    def collect(self, params: Sequence[torch.nn.Parameter], noted_now: bool) -> None:
        """``ids``: the parameters among ``params`` that received their gradient since the step's ``zero_grad``
        (or, ``noted_now``, since this step's :meth:`take`)."""
        noted: dict[int, tuple[torch.Tensor | None, int]] = {}
        if noted_now and self._before is not None:
            noted = {id(p): before for p, before in zip(self.trainable, self._before, strict=True)}
        self.ids = set()
        for p in params:
            g = p.grad
            before = noted.get(id(p))
            if before is not None:
                changed = g is not before[0] or (g is not None and g._version != before[1])
            else:
                changed = g is not None and bool(g.detach().any())
            if changed:
                self.ids.add(id(p))
        self._before = None

    def remove(self) -> None:
        self.trainable, self._before = [], None
        self.ids.clear()


class GradientsAside:
    """Gradients of ``params`` set aside while micro-batches accumulate fresh ones, then added back."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.saved: list[tuple[torch.Tensor | None, torch.device | None]] = []
        for p in self.params:
            grad = p.grad
            if grad is None:
                self.saved.append((None, None))
            elif grad.device.type == "cpu":
                self.saved.append((grad, None))
            else:
                self.saved.append((grad.to("cpu"), grad.device))  # frees device memory for the micro-batches
            p.grad = None
        self.was_empty = all(g is None for g, _ in self.saved)

    def drop_new(self) -> None:
        for p in self.params:
            p.grad = None

    def put_back(self) -> None:
        for p, (grad, device) in zip(self.params, self.saved, strict=True):
            p.grad = None if grad is None else grad if device is None else grad.to(device)

    def merge(self) -> None:
        for p, (grad, device) in zip(self.params, self.saved, strict=True):
            if grad is None:
                continue
            old = grad if device is None else grad.to(device)
            if p.grad is not None:
                old.add_(p.grad)
            p.grad = old


__all__ = ["FinishedGradients", "GradientsAside"]
