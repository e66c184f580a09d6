"""Recover a real training step that ran out of memory by training the same batch in micro-batches.

Why here and not in the loop: the step's closure (forward, zero_grad, backward) is the one place
that sees both an OOM in forward and one in backward, and the optimizer step that follows it
(gradient clipping, the AMP grad scaler, the scheduler) is left to Lightning unchanged. The glue
in :mod:`retune.compat` hands this module the closure's three parts as plain callables, so the
logic below is free of Lightning.

What a recovered step guarantees:

* **the same update.** Micro-batch ``i`` of ``n_i`` samples has its loss weighted by ``n_i / N``
  (a loss that is a mean over the batch; ``loss_reduction: sum`` weights by 1), and gradients
  accumulate inside the one optimizer step, so the update equals the whole batch's up to float
  rounding.
* **no trace of the failed attempt.** An OOM in forward has produced no gradient. An OOM in
  backward leaves some parameters holding this batch's complete gradient (autograd accumulates a
  parameter's gradient once, when all of it is known) and the rest untouched: a
  post-accumulate-grad hook records which, those keep what they got, and only the others are
  computed again, with the finished ones frozen (no second contribution, no memory for their
  gradients). Gradients already accumulated from earlier batches of an accumulation window are set
  aside while micro-batches run (moved to host memory when they live on an accelerator) and added
  back after, so a micro-batch that runs out of memory too can be dropped whole.
* **every sample once.** A micro-batch that runs out of memory doubles the number of pieces and
  trains the whole batch again from the set-aside state; a batch of one sample that does not fit
  raises :class:`~retune.errors.RetuneError` with the gradients as they were before the step.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from retune import messages
from retune.errors import RetuneError
from retune.oom import is_oom_error
from retune.split import SplitFn, batch_length, join_outputs, split_batch

LossReduction = Literal["mean", "sum"]


def free_accelerator_memory() -> None:
    """Give the failed attempt's blocks back before the smaller attempt, so it does not fail for fragmentation.

    ``gc.collect`` (reference cycles through the exception's frames can hold the activations) costs
    about 0.2 s in a process that imported Lightning, so it runs only where a device allocator keeps
    the blocks; on CPU the failed step's tensors are freed by reference counting when the exception is.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        gc.collect()
        torch.cuda.empty_cache()


class EvalStepRecovery:
    """Wraps a ``validation_step``/``test_step``/``predict_step``: an OOM re-runs the batch in micro-batches.

    Without gradients nothing has to be undone; the micro-batches' outputs are joined along the batch
    dimension (:func:`~retune.split.join_outputs`: predictions come back whole) and their ``self.log``
    values are weighted by their own sizes, so metrics cover every sample once. As in training, the
    split is kept for the rest of the loop once a batch needed it.
    """

    def __init__(
        self,
        step: Callable[..., Any],
        logging: Callable[[Any], Any],
        split_fn: SplitFn | None = None,
        on_recovered: Callable[[Recovered], None] | None = None,
        where: Callable[[], str] = lambda: "",
        save_logs: Callable[[], Callable[[], None]] = lambda: lambda: None,
        journal_logs: Callable[[], tuple[Callable[[], None], Callable[[], None]]] | None = None,
    ) -> None:
        self.step = step
        self.save_logs = save_logs
        self.journal_logs = journal_logs
        self.logging = logging
        self.split_fn = split_fn
        self.on_recovered = on_recovered
        self.where = where
        self.pieces = 1

    def __call__(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        failed_in = ""
        if self.pieces == 1:
            rollback_logs, stop_journal = self.journal_logs() if self.journal_logs is not None else (_none, _none)
            try:
                return self.step(batch, *args, **kwargs)
            except BaseException as exc:
                if not is_oom_error(exc):
                    raise
            finally:
                stop_journal()
            rollback_logs()  # what the failed step logged before it ran out of memory
            free_accelerator_memory()
            failed_in = "forward"
        pieces, tried = max(2, self.pieces), 0
        total = batch_length(batch) if self.split_fn is None else None
        while True:
            micro = split_batch(batch, pieces, self.split_fn)
            if len(micro) <= tried:
                raise RetuneError(f"split_batch gives no more pieces than {tried} for {pieces}")
            restore_logs = self.save_logs()
            outputs = self._run(micro, args, kwargs)
            if outputs is not None:
                break
            restore_logs()
            free_accelerator_memory()
            if _all_single(micro):
                raise RetuneError(
                    f"the evaluation step at {self.where() or 'this step'} ran out of memory on a batch of "
                    f"{total if total is not None else len(micro)} samples, and still did in micro-batches of one "
                    "sample: one sample does not fit in memory"
                )
            tried = len(micro)
            pieces = pieces * 2 if total is None else min(pieces * 2, total)
        if not failed_in and len(micro) > self.pieces:
            failed_in = "a micro-batch"
        self.pieces = max(self.pieces, len(micro))
        if failed_in and self.on_recovered is not None:
            self.on_recovered(Recovered(total or 0, len(micro), failed_in))
        return join_outputs(outputs, [_samples(m) for m in micro])

    def _run(self, micro: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
        outputs: list[Any] = []
        try:
            for part in micro:
                with self.logging(part):
                    outputs.append(self.step(part, *args, **kwargs))
        except BaseException as exc:
            if not is_oom_error(exc):
                raise
            return None
        return outputs


class FinishedGradients:
    """Which parameters received their gradient in the backward pass that is running now.

    One post-accumulate-grad hook per parameter; the per-step cost is a set insertion per
    parameter during backward and a ``clear()`` per step.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.ids: set[int] = set()
        # only the trainable ones are hooked, and only those are known: a frozen layer is hooked by
        # rearm() once it is unfrozen, or its gradient would be counted twice after a backward OOM
        self._params = [p for p in params if p.requires_grad]
        self._handles = [
            p.register_post_accumulate_grad_hook(self._record)  # type: ignore[no-untyped-call]
            for p in self._params
        ]

    def _record(self, param: torch.Tensor) -> None:
        self.ids.add(id(param))

    def rearm(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Hook parameters that became trainable since (an unfreeze)."""
        known = {id(p) for p in self._params}
        for p in params:
            if id(p) not in known and p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._record))  # type: ignore[no-untyped-call]
                self._params.append(p)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._params.clear()


@dataclass(frozen=True)
class Recovered:
    """What one recovered (or proactively split) step did."""

    samples: int
    pieces: int
    """How many micro-batches the batch finally trained as."""
    failed_in: str
    """``forward``, ``backward`` or ``""`` (split ahead of time: an earlier step of the epoch needed it)."""


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
        micro_logging: Callable[[Any, bool], Any],
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
        self.micro_logging = micro_logging  # context: (micro_batch, keep_logs) -> where self.log goes
        self.where = where  # "epoch 2, global step 40", for error messages: built only when one is raised
        self.save_logs = save_logs  # returns a function that puts the logged metrics back as they are now
        self.journal_logs = journal_logs  # starts recording what self.log changes: (rollback, stop)


class TrainStepRecovery:
    """Runs each training step's closure, and re-runs a step that ran out of memory in micro-batches.

    ``pieces`` is the split the rest of the epoch uses after a recovery (1: whole batches). Once a
    batch needed ``k`` pieces the following batches of the epoch are split into ``k`` from the
    start, without a failed attempt first: an OOM costs a full forward (and maybe backward) on the
    device, and the batches after it are as large. The callback sets it back to 1 when the search
    at the next epoch start has applied a size that fits.
    """

    def __init__(
        self,
        params: Callable[[], Sequence[torch.nn.Parameter]],
        split_fn: SplitFn | None = None,
        loss_reduction: LossReduction = "mean",
        on_recovered: Callable[[Recovered], None] | None = None,
    ) -> None:
        self._params = params
        self.split_fn = split_fn
        self.loss_reduction = loss_reduction
        self.on_recovered = on_recovered
        self.pieces = 1
        self.finished = FinishedGradients(params())

    def close(self) -> None:
        self.finished.remove()

    def run(self, step: StepParts) -> Any:
        """The closure's body: forward, zero_grad, backward; on an OOM, the same batch in micro-batches."""
        self.finished.rearm(self._params())  # a layer unfrozen since the last step gets its hook
        if self.pieces > 1:
            return self._in_pieces(step, self.pieces, forward_done=False, zero_done=False, failed_in="")
        self.finished.ids.clear()
        forward_done = zero_done = False
        rollback_logs, stop_journal = step.journal_logs() if step.journal_logs is not None else (_none, _none)
        try:
            result = step.forward(step.batch)
            forward_done = True
            stop_journal()
            if step.zero_grad is not None:
                step.zero_grad()
            zero_done = True
            loss = step.loss_of(result)
            if step.backward is not None and loss is not None:
                step.backward(loss)
            return result
        except BaseException as exc:
            stop_journal()
            if not is_oom_error(exc):
                raise
        # outside the except block: the exception and the frames holding the failed step's tensors are gone
        result = loss = None
        if not forward_done:
            rollback_logs()  # what the failed forward logged before it ran out of memory
        free_accelerator_memory()
        failed_in = "backward" if forward_done else "forward"
        return self._in_pieces(step, 2, forward_done, zero_done, failed_in)

    def _in_pieces(self, step: StepParts, pieces: int, forward_done: bool, zero_done: bool, failed_in: str) -> Any:
        total = batch_length(step.batch) if self.split_fn is None else None
        if total is None and self.split_fn is None:
            split_batch(step.batch, 2)  # raises SplitError naming the type and the way out
        if step.zero_grad is not None and not zero_done:
            step.zero_grad()  # the window starts with this batch; the failed forward never reached it
        params = [p for p in self._params() if p.requires_grad]
        # parameters whose complete gradient for this batch the failed backward already accumulated
        done = [p for p in params if id(p) in self.finished.ids] if forward_done else []
        pending = [p for p in params if id(p) not in self.finished.ids] if forward_done else params
        aside = _GradientsAside(pending)
        for p in done:
            p.requires_grad_(False)
        tried = 0
        try:
            while True:
                micro = split_batch(step.batch, pieces, self.split_fn)
                if len(micro) <= tried:
                    aside.put_back()
                    raise RetuneError(
                        f"the training step at {step.where() or 'this step'} ran out of memory in {tried} "
                        f"micro-batches and split_batch gives no more pieces for {pieces}; return more, smaller ones"
                    )
                restore_logs = step.save_logs() if not forward_done else None
                try:
                    outcome = self._train_micro(step, micro, keep_logs=not forward_done)
                except BaseException:
                    aside.drop_new()
                    aside.put_back()  # another error: the gradients set aside are not lost with it
                    raise
                if outcome is not None:
                    break
                if restore_logs is not None:
                    restore_logs()  # the micro-batches that ran before this round failed log again in the next
                aside.drop_new()
                free_accelerator_memory()
                if _all_single(micro):
                    aside.put_back()
                    if step.zero_grad is not None:
                        for p in done:
                            p.grad = None  # the window started with this batch: nothing came before it
                    raise RetuneError(
                        f"the training step at {step.where() or 'this step'} ran out of memory on a batch of "
                        f"{total if total is not None else len(micro)} samples, and still did in micro-batches "
                        "of one sample: "
                        "one sample does not fit in memory. "
                        "Free memory (freeze more layers, lower precision, shorter inputs) to go on"
                    )
                tried = len(micro)
                pieces = pieces * 2 if total is None else min(pieces * 2, total)
        finally:
            for p in done:
                p.requires_grad_(True)
        aside.merge()
        if not failed_in and len(micro) > self.pieces:
            failed_in = "a micro-batch"  # the kept split was not enough for this batch
        self.pieces = max(self.pieces, len(micro))
        if failed_in and self.on_recovered is not None:
            self.on_recovered(Recovered(total or 0, len(micro), failed_in))
        result, loss = outcome
        return step.with_loss(result, loss)

    def _train_micro(self, step: StepParts, micro: list[Any], keep_logs: bool) -> tuple[Any, torch.Tensor] | None:
        """Forward and backward of every micro-batch; None when one runs out of memory."""
        combined: torch.Tensor | None = None
        last = None
        try:
            for part, weight in zip(micro, _weights(micro, self.loss_reduction), strict=True):
                with step.micro_logging(part, keep_logs):
                    result = step.forward(part)
                loss = step.loss_of(result)
                if loss is not None:
                    if step.backward is not None:
                        step.backward(loss * weight)
                    share = loss.detach() * weight
                    combined = share if combined is None else combined + share
                last = result
                del result, loss
        except BaseException as exc:
            if not is_oom_error(exc):
                raise
            return None
        return last, (combined if combined is not None else torch.zeros(()))


def _none() -> None:
    return None


def _samples(micro: Any) -> int | None:
    """Samples in a micro-batch: its tensors' shared first dimension, else ``len()``, else unknown."""
    try:
        found = batch_length(micro)
    except TypeError:
        found = None
    if found is None:
        try:
            found = len(micro)
        except TypeError:
            return None
    return found


def _all_single(micro: Sequence[Any]) -> bool:
    """True when every micro-batch holds one sample (a split cannot go further)."""
    sizes = [_samples(m) for m in micro]
    return all(n is not None and n <= 1 for n in sizes)


def _weights(micro: Sequence[Any], reduction: LossReduction) -> list[float]:
    """Each micro-batch's loss weight: its share of the samples for a mean loss (equal shares when a custom
    micro-batch does not tell its size), 1 for a sum."""
    if reduction == "sum":
        return [1.0] * len(micro)
    sizes = [_samples(m) for m in micro]
    if any(n is None for n in sizes):
        messages.warn(
            "retune cannot tell how many samples the micro-batches from split_batch hold (no tensors with a "
            "batch dimension, no len()); their losses are weighted equally, which equals the whole batch's "
            "update only when the pieces are equal. Give the micro-batch type a __len__."
        )
        return [1.0 / len(micro)] * len(micro)
    total = sum(n or 0 for n in sizes) or 1
    return [(n or 0) / total for n in sizes]


class _GradientsAside:
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


__all__ = ["EvalStepRecovery", "FinishedGradients", "LossReduction", "Recovered", "StepParts", "TrainStepRecovery"]
