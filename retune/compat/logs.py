"""Where ``self.log`` writes (the active loop's ``_results`` collection), and where retune's files go.

Probe steps log into a throwaway collection; a recovered step's micro-batches log once, as the whole
batch; values logged by an attempt that ran out of memory are taken back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from retune.compat.namespace import import_module, is_legacy, namespace_of


def results_owner(trainer: Any) -> Any | None:
    """The loop object holding the ``_results`` collection ``self.log`` writes to right now."""
    loop = trainer._active_loop
    while loop is not None and "_results" not in vars(loop):
        loop = getattr(loop, "epoch_loop", None)
    return loop


def throwaway_results(trainer: Any, like: Any, training: bool) -> Any:
    """An empty ``self.log`` collection standing in for ``like``; what is logged into it is dropped."""
    results = import_module(namespace_of(trainer) + ".trainer.connectors.logger_connector.result")._ResultCollection(
        training=training
    )
    if is_legacy(trainer):
        results.device = like.device
    return results


@contextmanager
def micro_batch_logging(trainer: Any, batch: Any, keep: bool) -> Iterator[None]:
    """Where ``self.log`` calls of a micro-batch's step go.

    ``keep``: into the run's metrics, weighted by the micro-batch's own size (Lightning reads the
    size from the batch it holds, so it is pointed at the micro-batch), so epoch means count every
    sample once. Otherwise into a throwaway collection: the whole batch already logged its values.
    """
    owner = results_owner(trainer)
    results = None if owner is None else owner._results
    if owner is None or results is None:
        yield
        return
    if keep:
        saved = (results.batch, results.batch_size)
        results.batch, results.batch_size = batch, None
        try:
            yield
        finally:
            results.batch, results.batch_size = saved
        return
    throwaway = throwaway_results(trainer, results, training=True)
    # nothing logged here is kept, so nothing is computed: a step-level `sync_dist` value would all-reduce at
    # `self.log`, on this rank only (a rank that splits its step, or the fit-start exactness check on a rank
    # whose forward ran out of memory before it logged), leaving the ranks' collectives mismatched
    throwaway.update_metrics = _drop
    owner._results = throwaway
    try:
        yield
    finally:
        owner._results = results


def _drop(key: str, value: Any, batch_size: Any) -> None:
    return None


_METRIC_STATE = ("value", "cumulated_batch_size", "_forward_cache", "_update_count", "_computed")


def _metric_state(metric: Any) -> dict[str, Any]:
    """What ``self.log`` changes in one logged value: its accumulators (reassigned, never updated in place)."""
    return {
        name: value.clone() if isinstance(value, torch.Tensor) else value
        for name in _METRIC_STATE
        if hasattr(metric, name)
        for value in [getattr(metric, name)]
    }


def _put_back(results: Any, keys: set[str], saved: dict[str, dict[str, Any]]) -> None:
    """Drop the values first logged after ``keys`` were the collection's, and restore the ``saved`` states."""
    for key in [k for k in results if k not in keys]:
        del results[key]
    for key, state in saved.items():
        for name, value in state.items():
            setattr(results[key], name, value)


def journal_logged_metrics(trainer: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """Record what ``self.log`` changes from now on: ``(rollback, stop)``.

    Used around a step's whole-batch attempt, so that values logged before the point where its
    forward ran out of memory can be taken back. Cheap enough for every step: a set of the logged
    keys, and the previous state of a key only when the attempt logs it.
    """
    owner = results_owner(trainer)
    results = None if owner is None else owner._results
    if results is None:
        return _nothing, _nothing
    keys = set(results.keys())
    before: dict[str, dict[str, Any]] = {}
    original = results.update_metrics

    def update_metrics(key: str, value: Any, batch_size: int) -> None:
        if key in keys and key not in before:
            before[key] = _metric_state(results[key])
        original(key, value, batch_size)

    results.update_metrics = update_metrics

    def stop() -> None:
        if vars(results).get("update_metrics") is update_metrics:
            del results.update_metrics

    def rollback() -> None:
        stop()
        _put_back(results, keys, before)

    return rollback, stop


def _nothing() -> None:
    return None


def save_logged_metrics(trainer: Any) -> Callable[[], None]:
    """Take what ``self.log`` has collected so far; returns the function that puts it back.

    Taken only while a step recovers, before a round of micro-batches: when one of them runs out of
    memory too, the round's earlier micro-batches have logged values that the next round logs again.
    """
    owner = results_owner(trainer)
    results = None if owner is None else owner._results
    if results is None:
        return _nothing
    keys = set(results.keys())
    saved = {key: _metric_state(metric) for key, metric in results.items()}
    return lambda: _put_back(results, keys, saved)


def eval_logging(trainer: Any, batch: Any) -> Any:
    """An evaluation micro-batch logs into the run's metrics weighted by its own size."""
    return micro_batch_logging(trainer, batch, keep=True)


def log_dir(trainer: Any) -> str | None:
    """The first logger's own folder (a CSV/TensorBoard logger's version folder), or None without a logger.

    Not ``trainer.log_dir``: that broadcasts from rank zero, a collective every rank must enter, so
    rank-zero-only code cannot read it under DDP; and on 1.9 it is only a TensorBoard logger's folder,
    for any other logger its ``save_dir``, which every version shares.
    """
    if not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    folder = getattr(logger, "log_dir", None) or logger.save_dir or trainer.default_root_dir
    return None if folder is None else str(folder)


def refresh_progress_bar(trainer: Any) -> None:
    """Let a TQDM bar show the new number of batches of the epoch whose loader was just rebuilt."""
    bar = getattr(trainer, "progress_bar_callback", None)
    train_bar = getattr(bar, "_train_progress_bar", None)
    if train_bar is not None and hasattr(train_bar, "reset"):
        total = trainer.num_training_batches
        train_bar.reset(total=None if total == float("inf") else int(total))


__all__ = [
    "eval_logging",
    "journal_logged_metrics",
    "log_dir",
    "micro_batch_logging",
    "refresh_progress_bar",
    "results_owner",
    "save_logged_metrics",
    "throwaway_results",
]
