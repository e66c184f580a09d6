"""Lightning glue of the ``oom`` trigger's training steps: the closure runner, and where ``self.log`` goes.

Two jobs, both on the hot path of every training step, so both are built once per fit and cost a
few attribute writes per step when nothing runs out of memory (``tests/benchmarks/bench_oom_overhead.py``):

* :func:`install_closure_runner` routes the body of every training closure the fit loop builds
  through :meth:`retune.recovery.train_step.TrainStepRecovery.run`, handing it the closure's parts (the loop's
  own ``_training_step``, zero_grad and backward: every hook Lightning calls there stays Lightning's);
* :class:`StepLogs` is the one interceptor of the epoch's ``self.log`` collection
  (``_ResultCollection.update_metrics``), installed once. Per step it can *journal* (note the previous
  state of each key the whole-batch attempt logs, so values logged before a forward ran out of memory
  can be taken back: references, no copies, since Lightning reassigns a logged value's accumulators
  and never updates them in place), *record* (a micro-batch's values are held, not applied), or pass
  through. After the micro-batches of a recovered step, :meth:`StepLogs.commit` applies each key once,
  as the whole batch would have logged it: a mean weighted like the loss (by samples, or by counted
  items for ``token_mean``), a sum added up, a max/min kept; with the whole batch's batch size. So a
  step-level monitor (``ReduceLROnPlateau`` on ``train_loss_step``), the progress bar and epoch means
  see what the run with memory would have seen, and a ``sync_dist`` step-level value syncs once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from retune.compat.logs import micro_batch_logging, results_owner, save_logged_metrics
from retune.compat.loops import automatic_loop
from retune.step_parts import StepParts

_OFF, _JOURNAL, _RECORD = 0, 1, 2
_STATE = ("value", "cumulated_batch_size", "_forward_cache", "_update_count", "_computed", "has_reset")
_MISSING = object()

JoinOutputs = Callable[[Sequence[Any], Sequence["int | None"]], Any]
"""``join(outputs, sizes)``: micro-batches' step outputs as the whole batch's (``retune.recovery.split``)."""


class StepLogs:
    """The training loop's ``self.log`` collection, seen by the closure runner (see the module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.mode = _OFF
        self.owner: Any = None
        self.results: Any = None
        self._original: Callable[..., None] | None = None
        self._wrapper: Callable[..., None] | None = None
        self.before: dict[str, tuple[Any, ...] | None] = {}
        self.n_keys = 0
        self.records: list[tuple[str, Any, Any, int]] = []
        self.index = 0
        self._rollback_stop = (self.rollback, self.stop)

    # -- the interceptor -------------------------------------------------------------------------

    def _current(self) -> Any:
        owner = self.owner
        if owner is None:
            owner = self.owner = results_owner(self.trainer)
            if owner is None:
                return None
        results = owner._results
        if results is not self.results:
            self._install(results)
        return results

    def _install(self, results: Any) -> None:
        self.uninstall()
        if results is None:
            return
        original = results.update_metrics
        journal = self

        def update_metrics(key: str, value: Any, batch_size: Any) -> None:
            mode = journal.mode
            if mode == _RECORD:
                journal.records.append((key, value, batch_size, journal.index))
                return
            if mode == _JOURNAL and key not in journal.before:
                journal.before[key] = _refs(results[key])
            original(key, value, batch_size)

        results.update_metrics = update_metrics
        self.results, self._original, self._wrapper = results, original, update_metrics

    def uninstall(self) -> None:
        results = self.results
        if results is not None and vars(results).get("update_metrics") is self._wrapper:
            del results.update_metrics
        self.results = self._original = self._wrapper = None

    # -- journal of the whole-batch attempt ------------------------------------------------------

    def begin(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """Start noting what ``self.log`` changes: ``(rollback, stop)``."""
        results = self._current()
        if results is None:
            return _nothing, _nothing
        self.mode = _JOURNAL
        self.before.clear()
        self.n_keys = len(results)
        return self._rollback_stop

    def stop(self) -> None:
        self.mode = _OFF

    def rollback(self) -> None:
        """Take back what the attempt logged: keys it created go, the others get their previous state."""
        self.mode = _OFF
        results = self.results
        if results is None:
            return
        for key in list(results)[self.n_keys :]:
            del results[key]
        for key, refs in self.before.items():
            if refs is not None and key in results:
                _put_refs(results[key], refs)
        self.before.clear()

    # -- micro-batches of a recovered step (retune.step_parts.MicroLogs) ---------------------------------------

    @contextmanager
    def record(self, micro: Any) -> Iterator[None]:
        results = self._current()
        if results is None:
            yield
            return
        saved = (results.batch, results.batch_size)
        results.batch, results.batch_size = micro, None  # Lightning reads a value's batch size from here
        self.mode = _RECORD
        try:
            yield
        finally:
            self.mode = _OFF
            results.batch, results.batch_size = saved
            self.index += 1

    def discard(self, micro: Any) -> AbstractContextManager[Any]:
        return micro_batch_logging(self.trainer, micro, keep=False)

    def clear(self) -> None:
        self.records.clear()
        self.index = 0

    def commit(self, weights: Sequence[float], samples: Sequence[int | None], add: bool = False) -> None:
        """Log each recorded key once, as the whole batch: see the module docstring for the rules."""
        records, self.records, self.index = self.records, [], 0
        results, original = self.results, self._original
        if results is None or original is None:
            return
        by_key: dict[str, list[tuple[Any, Any, int]]] = {}
        for key, value, batch_size, index in records:
            by_key.setdefault(key, []).append((value, batch_size, index))
        for key, entries in by_key.items():
            indices = [i for _, _, i in entries]
            metric = results[key]
            meta = getattr(metric, "meta", None)
            combinable = (
                meta is not None
                and len(set(indices)) == len(indices)
                and all(isinstance(v, torch.Tensor) for v, _, _ in entries)
            )
            if not combinable:  # a torchmetrics object, a collection, a key logged twice per step: as logged
                for value, batch_size, _ in entries:
                    original(key, value, batch_size)
                continue
            original(key, _combine(meta, entries, weights, samples, add), _batch_size(entries, samples))


def _combine(
    meta: Any, entries: list[tuple[Any, Any, int]], weights: Sequence[float], samples: Sequence[int | None], add: bool
) -> torch.Tensor:
    values = [v.to(torch.float64) if v.is_floating_point() else v.double() for v, _, _ in entries]
    if meta.is_sum_reduction:
        out = torch.stack(values).sum(0)
    elif meta.is_max_reduction:
        out = torch.stack(values).amax(0)
    elif meta.is_min_reduction:
        out = torch.stack(values).amin(0)
    elif meta.is_mean_reduction:
        w = [weights[i] for _, _, i in entries]
        if not add and sum(w) <= 0:  # no counted items anywhere: by samples
            w = [float(samples[i] or 0) for _, _, i in entries]
        total = 1.0 if add else (sum(w) or 1.0)
        # a piece with weight 0 (no counted items: its token mean is 0/0 = NaN) is left out, not multiplied by 0
        kept = [(wi / total, v) for wi, v in zip(w, values, strict=True) if wi != 0.0]
        out = sum((wi * v for wi, v in kept), torch.zeros_like(values[0]))
    else:
        out = values[-1]
    dtype = entries[-1][0].dtype
    return out.to(dtype if dtype.is_floating_point else torch.get_default_dtype())


def _batch_size(entries: list[tuple[Any, Any, int]], samples: Sequence[int | None]) -> Any:
    """The whole batch's: the micro-batches' own sizes add up; a fixed value (``batch_size=self.batch_size``)
    is what the whole batch would have logged too."""
    sizes = [bs for _, bs, _ in entries]
    own = [samples[i] for _, _, i in entries]
    if all(int(bs) == n for bs, n in zip(sizes, own, strict=True) if n is not None):
        return sum(int(bs) for bs in sizes)
    if len({int(bs) for bs in sizes}) == 1:
        return sizes[0]
    return sum(int(bs) for bs in sizes)


def _refs(metric: Any) -> tuple[Any, ...] | None:
    if not hasattr(metric, "meta"):
        return None  # a collection of values (Lightning 1.9 dicts): not journaled
    return tuple(getattr(metric, name, _MISSING) for name in _STATE)


def _put_refs(metric: Any, refs: tuple[Any, ...]) -> None:
    for name, value in zip(_STATE, refs, strict=True):
        if value is not _MISSING:
            setattr(metric, name, value)


def _nothing() -> None:
    return None


def _join_results(results: Sequence[Any], sizes: Sequence[int | None], join: JoinOutputs) -> Any:
    """The micro-batches' ``ClosureResult`` as one: the other outputs of ``training_step`` (logits, a
    ``ModelOutput``'s fields) joined along the batch dimension by ``join`` (the graphs are spent)."""
    last = results[-1]
    extras = [r.extra for r in results]
    if len(results) == 1 or not any(extras):
        return last
    return dataclasses.replace(last, extra=join(extras, sizes))


def _forward(loop: Any, kwargs: Any, batch: Any) -> Any:
    if batch is kwargs["batch"]:
        return loop._training_step(kwargs)
    step_kwargs = type(kwargs)(kwargs)
    step_kwargs["batch"] = batch
    return loop._training_step(step_kwargs)


def install_closure_runner(
    trainer: Any, run: Callable[[StepParts], Any], join_outputs: JoinOutputs
) -> Callable[[], None]:
    """Route the body of every training closure the fit loop builds through ``run``; returns the undo.

    ``run`` receives a :class:`retune.step_parts.StepParts` for the batch and returns the loop's step
    result (Lightning's ``ClosureResult``). ``join_outputs`` puts the micro-batches' other step outputs
    back together, detached (:func:`retune.recovery.split.join_detached`). Everything around the
    closure (``optimizer_step``, the precision plugin's gradient clipping and grad scaler, progress
    counters) stays Lightning's.
    Patched on the loop instance only, so nothing outside this trainer changes.
    """
    loop = automatic_loop(trainer)
    original = loop._make_closure
    logs = StepLogs(trainer)
    # one StepParts for the run, its per-step fields rewritten by each closure (closures run one at a time)
    parts = StepParts(
        None,
        lambda batch: None,
        None,
        None,
        loss_of=lambda result: result.closure_loss,
        with_loss=lambda result, loss: dataclasses.replace(result, closure_loss=loss),
        logs=logs,
        join=lambda results, sizes: _join_results(results, sizes, join_outputs),
        save_logs=lambda: save_logged_metrics(trainer),
        journal_logs=logs.begin,
        where=lambda: f"epoch {trainer.current_epoch}, global step {trainer.global_step}",
    )

    step_kwargs: list[Any] = [None]

    def forward(batch: Any) -> Any:
        return _forward(loop, step_kwargs[0], batch)

    def body(*args: Any, **kw: Any) -> Any:
        try:
            return run(parts)
        finally:  # hold neither the batch nor Lightning's step functions past the step
            parts.batch = parts.zero_grad = parts.backward = step_kwargs[0] = None

    parts.forward = forward

    def make_closure(kwargs: Any, optimizer: Any, *rest: Any) -> Any:
        closure = original(kwargs, optimizer, *rest)
        step_kwargs[0] = kwargs
        parts.batch = kwargs["batch"]
        parts.zero_grad = closure._zero_grad_fn
        parts.backward = closure._backward_fn
        closure.closure = body
        return closure

    loop._make_closure = make_closure

    def undo() -> None:
        logs.uninstall()
        if vars(loop).get("_make_closure") is make_closure:
            del loop._make_closure

    return undo


__all__ = ["JoinOutputs", "StepLogs", "install_closure_runner"]
