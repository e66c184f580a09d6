"""Recover a real training step that ran out of memory by training the same batch in micro-batches.

Why here and not in the loop: the step's closure (forward, zero_grad, backward) is the one place
that sees both an OOM in forward and one in backward, and the optimizer step that follows it
(gradient clipping, the AMP grad scaler, the scheduler) is left to Lightning unchanged. The glue
in :mod:`retune.compat` hands this module the closure's three parts as plain callables, so the
logic below is free of Lightning.

What a recovered step guarantees:

* **the same update.** Micro-batch ``i`` has its loss weighted by its share of the batch: of the
  samples (``loss_reduction: mean``), of the items a token-mean loss averages over
  (``token_mean``, :mod:`retune.recovery.loss_items`), or 1 (``sum``); gradients accumulate inside the one
  optimizer step, so the update equals the whole batch's up to float rounding. The step's outputs
  and logged values are the whole batch's too (``StepParts.join`` and ``StepParts.logs``).
* **no trace of the failed attempt.** An OOM in forward has produced no gradient; what it logged
  and the BatchNorm statistics it updated are taken back. Every attempt at the batch starts from the
  random state the whole batch's step started from (:mod:`retune.recovery.step_rng`: the failed forward's
  Dropout draws are not skipped by the micro-batches nor by the rest of the run). An OOM in backward leaves some
  parameters holding this batch's complete gradient (autograd accumulates a parameter's gradient
  once, when all of it is known) and the rest untouched:
  :class:`~retune.recovery.gradients.FinishedGradients` finds which after the failure, those keep
  what they got, and only the others are computed again, with the finished ones frozen (no second
  contribution, no memory for their gradients). Gradients already accumulated from earlier batches
  of an accumulation window are set aside while micro-batches run (moved to host memory when they
  live on an accelerator: :class:`~retune.recovery.gradients.GradientsAside`) and added back after,
  so a micro-batch that runs out of memory too can be dropped whole.
* **every sample once.** A round of micro-batches that runs out of memory halves the largest
  micro-batch size and trains the whole batch again from the set-aside state; a batch whose
  pieces cannot shrink further (one sample; two for BatchNorm models) raises
  :class:`~retune.errors.RetuneError` with the gradients as they were before the step.
* **only the splittable sites.** An OOM is located by the hook it came from
  (:mod:`retune.recovery.oom_sites`); one raised where a smaller batch would not help is re-raised with a note.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from retune import messages
from retune.errors import RetuneError
from retune.oom import clear_device_cache, forget_exception, is_oom_error
from retune.recovery.gradients import FinishedGradients, GradientsAside
from retune.recovery.loss_items import ItemsFn, count_items, resolve_items_fn, token_labels_hint
from retune.recovery.micro_batches import (
    KeptSplit,
    LossReduction,
    Recovered,
    all_single,
    largest_piece,
    loss_weights,
    samples_in,
)
from retune.recovery.oom_sites import add_note, oom_site, split_helps, why_not_recovered
from retune.recovery.running_stats import RunningStats, needs_two_samples
from retune.recovery.side_effects import SideEffects
from retune.recovery.split import Readings, SplitError, SplitFn, batch_length, pieces_for, split_batch
from retune.recovery.step_rng import StepRng
from retune.step_parts import StepParts


class TrainStepRecovery(KeptSplit):
    """Runs each training step's closure, and re-runs a step that ran out of memory in micro-batches.

    The split a recovery needed is kept for the rest of the epoch as a *largest micro-batch size*
    (``max_size``): the following batches are as large, and an OOM costs a full forward (and maybe
    backward) on the device, so a later batch larger than that size is split up front, while one
    that is not (a short last batch) runs whole. ``pieces`` is the same for micro-batches that do not
    tell their size (a custom ``split_batch``). :meth:`new_epoch` sets both back when the search at
    the epoch start has applied a size that fits.
    """

    def __init__(
        self,
        params: Callable[[], Sequence[torch.nn.Parameter]],
        split_fn: SplitFn | None = None,
        loss_reduction: LossReduction = "mean",
        on_recovered: Callable[[Recovered], None] | None = None,
        items_fn: ItemsFn | None = None,
        module: torch.nn.Module | None = None,
        warn: Callable[[str], None] | None = None,
        split_key: Callable[[], Hashable] | None = None,
        first_check: Callable[[StepParts], None] | None = None,
        asked: Callable[[], int | None] = lambda: None,
    ) -> None:
        self._params = params
        self.first_check = first_check
        """Run on the first batch before it trains (:class:`retune.recovery.exactness.ExactnessCheck`)."""
        self.split_key = split_key
        """What a kept split belongs to (``batching: buckets``: the bucket of the batch now); None: every batch."""
        self.splits: dict[Hashable, tuple[int | None, int]] = {}
        """With ``split_key``: each key's kept split ``(max_size, pieces)``; ``max_size``/``pieces`` hold the
        split of the batch being trained, so an OOM in one bucket does not cut every other bucket's batches."""
        self.split_fn = split_fn
        self.asked = asked
        """The batch size the train loader was asked for now (None: not known): with the first batch, it tells a
        list of samples (``collate_fn=lambda b: b``) from a list of batches (:meth:`Readings.note_first`)."""
        self.readings = Readings()
        """How the batches' lists of same-shape tensors read (per sample or batches), as the batches that tell say:
        a batch that reads both ways (a last batch of three beside an ``(ids, mask, type_ids)`` triple) is split as
        the first batch read it at fit start."""
        self.loss_reduction = loss_reduction
        self.items_fn = items_fn if items_fn is not None else resolve_items_fn(None)
        self.on_recovered = on_recovered
        self.module = module
        self.warn = warn if warn is not None else _warn
        self.max_size: int | None = None
        self.pieces = 1
        self.finished = FinishedGradients(params())
        self.stats = _running_stats(module)
        self.rng = StepRng()
        self._first_batch = True

    def close(self) -> None:
        self.finished.remove()

    def new_epoch(self, keep_split: bool = False) -> None:
        """Whole batches again (the search has just applied a size), and the model's layers as they are now.

        ``keep_split``: the epoch start of a run resumed mid-epoch from a checkpoint with a kept split."""
        if not keep_split:
            self.max_size, self.pieces = None, 1
            self.splits = {}
        self.finished.rearm(self._params())
        self.stats = _running_stats(self.module)

    def run(self, step: StepParts) -> Any:
        """The closure's body: forward, zero_grad, backward; on an OOM, the same batch in micro-batches.

        With ``split_key``, the split kept for the batch's key (its bucket) is in force while it runs."""
        if self.split_key is None:
            return self._run_step(step)
        key = self.split_key()
        self.max_size, self.pieces = self.splits.get(key, (None, 1))
        try:
            return self._run_step(step)
        finally:
            if self.max_size is not None or self.pieces > 1:
                self.splits[key] = (self.max_size, self.pieces)

    def _run_step(self, step: StepParts) -> Any:
        finished = self.finished
        if self._first_batch:
            self._first_batch = False
            # resumed with a kept split (the same on every rank: it comes from the checkpoint), the batch is
            # known not to fit whole; the check's forwards come first, so an unsplittable batch is skipped there
            resumed = bool(self.splits) if self.split_key is not None else self.max_size is not None or self.pieces > 1
            if self.first_check is not None and not resumed:
                self.first_check(step)
            self.check_batch(step.batch)
        self.rng.save()  # every attempt at this batch (micro-batch rounds included) starts from here
        if self.max_size is not None or self.pieces > 1:
            kept = self._kept_split(step.batch)
            if kept is not None:
                return self._in_pieces(step, kept, forward_done=False, zero_done=False, failed_in="")
        stats = self.stats
        if stats is not None:
            stats.save()
        forward_done = zero_done = backward_started = False
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
                if step.zero_grad is None:
                    finished.take()  # inside an accumulation window: note the gradients of the earlier batches
                backward_started = True
                step.backward(loss)
            return result
        except BaseException as exc:
            stop_journal()
            if not split_helps(exc):
                raise  # not out of memory, or where a smaller batch needs no less (with a note saying so)
            site = oom_site(exc.__traceback__)
            forget_exception(exc)  # its frames held the failed forward's activations and graph
        # outside the except block: the exception and the frames holding the failed step's tensors are gone
        result = loss = None
        if backward_started:
            finished.collect([p for p in self._params() if p.requires_grad], noted_now=step.zero_grad is None)
        else:
            finished.ids.clear()
            finished.forget()
        if not forward_done:
            rollback_logs()  # what the failed forward logged before it ran out of memory
            if stats is not None:
                stats.restore()  # and its BatchNorm updates: the micro-batches update them instead
        clear_device_cache()
        failed_in = (site if site not in (None, "training_step", "backward") else None) or (
            "backward" if forward_done else "forward"
        )
        return self._in_pieces(step, None, forward_done, zero_done, failed_in)

    def check_batch(self, batch: Any) -> None:
        """At fit start (the first batch): can this batch be split, and counted as the loss needs?

        Found here, a batch retune cannot split fails before any training, with the field and the way
        out in the message, instead of at the first OOM hours into the run.
        """
        if self.split_fn is None:
            self.readings.note_first(batch, self.asked())
            try:
                total = batch_length(batch, self.readings)
                if total is None:
                    split_batch(batch, 2)  # raises the message that says why
            except SplitError as exc:
                raise SplitError(
                    "the `oom` trigger checks at fit start that it can split a training batch into micro-batches, "
                    f"should a step run out of memory: {exc}"
                ) from None
            if total == 1:
                self.warn(
                    "the first training batch holds one sample along its first dimension (a packed (1, tokens) "
                    "batch?): the `oom` trigger cannot split it, so a step that runs out of memory stops the run. "
                    "Pass ScheduledBatchSizeFinder(split_batch=fn) to cut such a batch another way"
                )
        if self.loss_reduction == "token_mean":
            count_items(self.items_fn, batch)  # raises naming what is missing and the way out
        elif self.loss_reduction == "mean" and token_labels_hint(batch):
            self.warn(
                "the training batch's `labels` are per token with ignored (-100) positions: a Hugging Face "
                "token-classification, masked-LM or causal-LM loss averages over the labelled tokens, not the "
                "samples. Set `loss_reduction: token_mean` on the oom trigger (causal LM: also `loss_items: "
                "shifted_labels`), or a step recovered in micro-batches weighs them by samples and its update "
                "differs from the whole batch's"
            )

    def _kept_split(self, batch: Any) -> tuple[int | None, int] | None:
        """``(max_size, pieces)`` for a batch the kept split cuts up front, None for one that runs whole."""
        total = samples_in(batch, self.readings) if self.max_size is not None else None
        if total is not None and self.max_size is not None:
            return (self.max_size, 0) if total > self.max_size else None
        return (None, self.pieces) if self.pieces > 1 else None

    def _min_size(self) -> int:
        return 2 if self.module is not None and needs_two_samples(self.module) else 1

    def _in_pieces(
        self,
        step: StepParts,
        kept: tuple[int | None, int] | None,
        forward_done: bool,
        zero_done: bool,
        failed_in: str,
    ) -> Any:
        total = batch_length(step.batch, self.readings) if self.split_fn is None else samples_in(step.batch, None)
        if total is None and self.split_fn is None:
            split_batch(step.batch, 2)  # raises SplitError naming the type and the way out
        min_size = self._min_size()
        if total is not None and total <= 1:
            raise RetuneError(
                f"the training step at {step.where() or 'this step'} ran out of memory on a batch of one sample "
                "along its first dimension, which retune cannot split (a packed (1, tokens) batch?). Pass "
                "ScheduledBatchSizeFinder(split_batch=fn) to cut it another way, or free memory (freeze more "
                "layers, lower precision, shorter inputs)"
            )
        # the largest micro-batch size to try first, or the number of pieces when sizes are unknown
        # the whole batch failed (one try, at its full size) unless this is the kept split of a later batch
        tried, failed_largest = (0, None) if kept is not None else (1, total)
        if kept is not None:
            size, pieces = kept
        elif total is not None:
            size, pieces = max(min_size, -(-total // 2)), 0
        else:
            size, pieces = None, max(2, self.pieces)
        if step.zero_grad is not None and not zero_done:
            try:
                step.zero_grad()  # the window starts with this batch; the failed forward never reached it
            except BaseException as exc:
                if is_oom_error(exc):
                    add_note(exc, why_not_recovered(oom_site(exc.__traceback__)))
                raise
        params = [p for p in self._params() if p.requires_grad]
        # parameters whose complete gradient for this batch the failed backward already accumulated
        done = [p for p in params if id(p) in self.finished.ids] if forward_done else []
        pending = [p for p in params if id(p) not in self.finished.ids] if forward_done else params
        aside = GradientsAside(pending)
        stats = self.stats
        if stats is not None:
            # before the step (a failed forward's updates are already taken back), or after the whole batch's
            # forward, which updated them as the run with memory did: each round of micro-batches starts there
            stats.save()
        for p in done:
            p.requires_grad_(False)
        try:
            while True:
                count = pieces_for(total, size, min_size) if total is not None and size is not None else pieces
                micro = split_batch(step.batch, count, self.split_fn, self.readings)
                largest = largest_piece(micro)
                no_progress = (
                    len(micro) <= tried if failed_largest is None or largest is None else largest >= failed_largest
                )
                if tried and no_progress:
                    aside.put_back()
                    if step.zero_grad is not None:
                        for p in done:
                            p.grad = None  # the window started with this batch: nothing came before it
                    raise RetuneError(self._cannot_split_further(step, total, micro, failed_largest, min_size))
                restore_logs = step.save_logs() if not forward_done else None
                # the module's side effects (metric states, public attributes) as this round starts: a round that
                # runs out of memory partway is taken back, as its logs are (after a backward OOM the forwards
                # leave none: see _train_micro)
                round_start = SideEffects.capture(self.module) if not forward_done and self.module else None
                self.rng.rewind()  # the failed attempt's draws again: the masks the whole batch drew (or would)
                try:
                    outcome = self._train_micro(
                        step, micro, keep_logs=not forward_done, frozen=bool(done), forward_done=forward_done
                    )
                except BaseException:
                    aside.drop_new()
                    aside.put_back()  # another error: the gradients set aside are not lost with it
                    raise
                if outcome is not None:
                    break
                step.logs.clear()
                if restore_logs is not None:
                    restore_logs()  # the micro-batches that ran before this round failed log again in the next
                if round_start is not None:
                    round_start.restore()  # and update their metrics again: once
                if stats is not None:
                    stats.restore()
                aside.drop_new()
                clear_device_cache()
                tried, failed_largest = len(micro), largest
                if size is not None and largest is not None:
                    size = max(1, -(-largest // 2))
                else:
                    size, pieces = None, max(pieces, len(micro)) * 2
                    pieces = pieces if total is None else min(pieces, total)
        finally:
            for p in done:
                p.requires_grad_(True)
        if forward_done and stats is not None:
            stats.restore()  # the micro-batches' forwards must not update them a second time
        aside.merge()
        if not failed_in and tried:
            failed_in = "a micro-batch"  # the kept split was not enough for this batch
        self._keep(micro, size is not None, total, failed_in)
        results, loss = outcome
        result = step.join(results, [samples_in(m) for m in micro]) if step.join is not None else results[-1]
        return step.with_loss(result, loss)

    def _cannot_split_further(
        self, step: StepParts, total: int | None, micro: list[Any], failed_largest: int | None, min_size: int
    ) -> str:
        where = step.where() or "this step"
        samples = total if total is not None else len(micro)
        if min_size > 1 and failed_largest is not None and failed_largest <= 3:
            pieces = f", and in micro-batches of {failed_largest}" if failed_largest != samples else ""
            return (
                f"the training step at {where} ran out of memory on a batch of {samples} samples{pieces}; smaller "
                "micro-batches would hold one sample, and the model has BatchNorm layers in training mode, which "
                "cannot train on one sample (BatchNorm1d raises, the others normalise a sample by itself), so retune "
                "stops here. Free memory (freeze more layers, lower precision, smaller inputs), or put the BatchNorm "
                "layers in eval mode"
            )
        if (failed_largest is not None and failed_largest <= 1) or all_single(micro):
            return (
                f"the training step at {where} ran out of memory on a batch of {samples} samples, and still did in "
                "micro-batches of one sample: one sample does not fit in memory. Free memory (freeze more layers, "
                "lower precision, shorter inputs) to go on"
            )
        return (
            f"the training step at {where} ran out of memory in {len(micro)} micro-batches and split_batch gives no "
            "more, smaller pieces; return more, smaller ones"
        )

    def _train_micro(
        self, step: StepParts, micro: list[Any], keep_logs: bool, frozen: bool, forward_done: bool = False
    ) -> tuple[list[Any], torch.Tensor] | None:
        """Forward and backward of every micro-batch; None when one runs out of memory where a split helps.

        ``forward_done``: the whole batch's forward ran (an OOM in backward), so what it changed on the module (a
        torchmetrics state it updated, a list it appended to, a counter) is the run's; each micro-batch's forward,
        which only rebuilds the graph, is undone there (its backward and the hooks around it are the real ones,
        and keep what they change)."""
        combined: torch.Tensor | None = None
        results: list[Any] = []
        weights = loss_weights(micro, self.loss_reduction, self.items_fn)
        logs = step.logs
        module = self.module if forward_done else None
        try:
            for part, weight in zip(micro, weights, strict=True):
                before = SideEffects.capture(module) if module is not None else None
                try:
                    with logs.record(part) if keep_logs else logs.discard(part):
                        result = step.forward(part)
                finally:
                    if before is not None:
                        before.restore()
                loss = step.loss_of(result)
                if loss is not None:
                    # a piece with no counted items adds nothing (and its loss may be 0/0 = NaN: never backward it);
                    # with the finished layers frozen a loss may need no gradient at all
                    needs_backward = weight != 0.0 and (loss.requires_grad or not frozen)
                    if step.backward is not None and needs_backward:
                        step.backward(loss * weight)
                    share = loss.detach() * weight if weight != 0.0 else torch.zeros_like(loss.detach())
                    combined = share if combined is None else combined + share
                results.append(result)
                del result, loss
        except BaseException as exc:
            if not split_helps(exc):
                raise
            forget_exception(exc)
        else:
            if keep_logs:
                logs.commit(weights, [samples_in(m) for m in micro], self.loss_reduction == "sum")
            return results, (combined if combined is not None else torch.zeros(()))
        return None  # this frame ends here: the micro-batches' results and graphs go with it


def _none() -> None:
    return None


def _running_stats(module: torch.nn.Module | None) -> RunningStats | None:
    """The module's BatchNorm statistics to guard, or None when it has none (nothing to copy per step)."""
    stats = RunningStats(module) if module is not None else None
    return stats if stats else None


def _warn(message: str) -> None:
    messages.warn(message)


__all__ = ["TrainStepRecovery"]
