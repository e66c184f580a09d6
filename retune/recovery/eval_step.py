"""Recover a ``validation_step``/``test_step``/``predict_step`` that ran out of memory, in micro-batches.

Without gradients nothing has to be undone: what the failed step logged is taken back, the batch
runs again as micro-batches, their outputs are joined and their logged values weighted by size
(:class:`EvalStepRecovery`). The training step's recovery, with its exactness guarantees, is
:mod:`retune.recovery.train_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from retune.errors import RetuneError
from retune.oom import clear_device_cache, forget_exception, is_oom_error
from retune.recovery.micro_batches import KeptSplit, Recovered, all_single, samples_in
from retune.recovery.side_effects import SideEffects
from retune.recovery.split import Readings, SplitFn, batch_length, join_outputs, pieces_for, split_batch


class EvalStepRecovery(KeptSplit):
    """Wraps a ``validation_step``/``test_step``/``predict_step``: an OOM re-runs the batch in micro-batches.

    Without gradients nothing has to be undone; the micro-batches' outputs are joined along the batch
    dimension (:func:`~retune.recovery.split.join_outputs`: predictions come back whole) and their ``self.log``
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
        module: torch.nn.Module | None = None,
        asked: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.step = step
        self.module = module
        """Whose torchmetrics states and public attributes a round of micro-batches that fails partway puts back."""
        self.save_logs = save_logs
        self.journal_logs = journal_logs
        self.logging = logging
        self.split_fn = split_fn
        self.asked = asked
        """The batch size the loader was asked for (None: not known), read with the loop's first batch."""
        self.readings = Readings()
        """How the loop's lists of same-shape tensors read, as its batches tell (read from the first batch, so a
        last batch that reads both ways is split as the first was: :class:`~retune.recovery.split.Readings`)."""
        self._read_first = False
        self.on_recovered = on_recovered
        self.where = where
        self.max_size: int | None = None  # the kept split: largest micro-batch (samples) for the rest of the loop
        self.pieces = 1  # the same, for micro-batches that do not tell their size (a custom split_batch)

    def __call__(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if self.split_fn is None and not self._read_first:
            self._read_first = True
            self.readings.note_first(batch, self.asked())  # before any batch can read both ways
        failed_in = ""
        known = self.max_size is not None and self.split_fn is None
        if self.pieces == 1 and (not known or (samples_in(batch, self.readings) or 0) <= (self.max_size or 0)):
            rollback_logs, stop_journal = self.journal_logs() if self.journal_logs is not None else (_none, _none)
            try:
                return self.step(batch, *args, **kwargs)
            except BaseException as exc:
                if not is_oom_error(exc):
                    raise
                forget_exception(exc)  # the failed step's activations go with its frames
            finally:
                stop_journal()
            rollback_logs()  # what the failed step logged before it ran out of memory
            clear_device_cache()
            failed_in = "forward"
        total = batch_length(batch, self.readings) if self.split_fn is None else None
        if total is not None:
            pieces = pieces_for(total, self.max_size if not failed_in and self.max_size else -(-total // 2))
        else:
            pieces = max(2, self.pieces)
        tried = 1 if failed_in else 0
        while True:
            micro = split_batch(batch, pieces, self.split_fn, self.readings)
            if tried and len(micro) <= tried:
                if all_single(micro):
                    raise RetuneError(
                        f"the evaluation step at {self.where() or 'this step'} ran out of memory on a batch of "
                        f"{total if total is not None else len(micro)} samples, and still did in micro-batches of "
                        "one sample: one sample does not fit in memory"
                    )
                raise RetuneError(f"split_batch gives no more pieces than {tried} for {pieces}")
            restore_logs = self.save_logs()
            # a round that runs out of memory partway leaves nothing: its logs, metric updates, appended outputs
            round_start = SideEffects.capture(self.module) if self.module is not None else None
            outputs = self._run(micro, args, kwargs)
            if outputs is not None:
                break
            restore_logs()
            if round_start is not None:
                round_start.restore()
            clear_device_cache()
            tried = len(micro)
            pieces = pieces * 2 if total is None else min(pieces * 2, total)
        if not failed_in and tried:
            failed_in = "a micro-batch"
        self._keep(micro, total is not None, total, failed_in)
        return join_outputs(outputs, [samples_in(m) for m in micro])

    def _run(self, micro: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
        outputs: list[Any] = []
        try:
            for part in micro:
                with self.logging(part):
                    outputs.append(self.step(part, *args, **kwargs))
        except BaseException as exc:
            if not is_oom_error(exc):
                raise
            forget_exception(exc)
        else:
            return outputs
        return None


def _none() -> None:
    return None


__all__ = ["EvalStepRecovery"]
