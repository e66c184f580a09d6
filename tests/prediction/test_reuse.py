"""A later search whose training state did not change reuses its traces (``retune.prediction.reuse``).

``trace_key`` changes with whatever a trace's memory depends on (which parameters train, the optimizer state,
an option that makes state or temporaries, train/eval flags, the batch's per-sample shapes, the size) and not
with what it does not (a learning rate's value). In a fit, a search at an epoch milestone after the state
stopped changing runs no trace and finds the same sizes, each still verified by a real probe; every fit's
first search traces (the memo is emptied at fit start).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import UserDict
from typing import Any

import pytest
import torch
from torch import nn

from retune import ScheduledBatchSizeFinder
from retune.prediction import reuse
from retune.prediction.reuse import TraceMemo, Unkeyable, trace_key
from retune.search.predict_run import Tracer
from tests.helpers import bucket_data
from tests.helpers.lightning_ns import pl, seed


def _key(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, size: int = 8) -> Any:
    return trace_key(model, [optimizer], batch, size)


def test_the_key_follows_what_a_traces_memory_depends_on() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    batch = (torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    key = _key(model, optimizer, batch)
    assert _key(model, optimizer, batch) == key
    for group in optimizer.param_groups:
        group["lr"] = 5e-4  # a scheduler's step: no memory of its own
    assert _key(model, optimizer, batch) == key
    assert _key(model, optimizer, (torch.zeros(3, 4), torch.zeros(3, dtype=torch.long))) == key  # the batch's size
    assert _key(model, optimizer, batch, size=9) != key
    assert _key(model, optimizer, (torch.zeros(2, 5), torch.zeros(2, dtype=torch.long))) != key  # per-sample shape
    model[0].requires_grad_(False)  # type: ignore[index]
    assert _key(model, optimizer, batch) != key
    model[0].requires_grad_(True)  # type: ignore[index]
    model.eval()
    assert _key(model, optimizer, batch) != key
    model.train()
    optimizer.param_groups[0]["weight_decay"] = 0.01  # a decay that was 0: a temporary in some optimizers
    assert _key(model, optimizer, batch) != key
    optimizer.param_groups[0]["weight_decay"] = 0.0
    nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    optimizer.step()  # the state exists now
    assert _key(model, optimizer, batch) != key


@dataclasses.dataclass
class _Batch:
    ids: torch.Tensor
    label: torch.Tensor


class _Encoding(UserDict):  # type: ignore[type-arg]  # a mapping of its own type, as transformers' BatchEncoding
    pass


def test_the_key_reads_every_tensor_of_a_container_batch_and_its_plain_values() -> None:
    """A dataclass, a mapping of its own type (transformers' ``BatchEncoding`` is one), a plain value in the batch:
    each changes the key when a per-sample shape or the value changes; a batch object retune cannot read is not
    keyed (``Unkeyable``: that trace is not remembered)."""
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for short, long in (
        (_Batch(torch.zeros(2, 128), torch.zeros(2)), _Batch(torch.zeros(2, 512), torch.zeros(2))),
        (_Encoding(input_ids=torch.zeros(2, 128)), _Encoding(input_ids=torch.zeros(2, 512))),
        ({"x": torch.zeros(2, 4), "max_len": 128}, {"x": torch.zeros(2, 4), "max_len": 512}),
    ):
        assert _key(model, optimizer, short) == _key(model, optimizer, short)
        assert _key(model, optimizer, short) != _key(model, optimizer, long), type(short)
    with pytest.raises(Unkeyable):
        _key(model, optimizer, object())


def test_a_trace_that_cannot_be_keyed_is_traced_and_not_remembered() -> None:
    """A module that cannot be a weak key (``__eq__`` without ``__hash__``) or a batch the key cannot read: the
    tracer gets no memo and traces as before."""

    class Unhashable(nn.Linear):
        def __eq__(self, other: object) -> bool:
            return self is other

        __hash__ = None  # type: ignore[assignment]

    tracer = Tracer(None, Unhashable(4, 2), torch.zeros(2, 4))
    assert tracer._memo_key([], 8, False, {}) == (None, None)
    tracer = Tracer(None, nn.Linear(4, 2), object())
    assert tracer._memo_key([], 8, False, {}) == (None, None)


def test_the_memo_keeps_the_last_entries() -> None:
    memo = TraceMemo(capacity=2)
    memo.put("a", 1)
    memo.put("b", 2)
    assert memo.get("a") == 1  # a is the newest now
    memo.put("c", 3)
    assert (memo.get("b"), memo.get("a"), memo.get("c"), memo.hits) == (None, 1, 3, 3)


def _count_traces(monkeypatch: Any) -> list[int]:
    """Each Tracer call that traced (a reused one does not), as the search it belonged to."""
    traced: list[int] = []
    original = Tracer.__call__

    def counted(self: Tracer, size: int) -> float:
        before = self.reused
        out = original(self, size)
        if self.reused == before:
            traced.append(size)
        return out

    monkeypatch.setattr(Tracer, "__call__", counted)
    return traced


def test_a_bucketed_search_after_nothing_changed_runs_no_trace_and_finds_the_same_sizes(monkeypatch: Any) -> None:
    """Searches at fit start, epoch 1 and epoch 2 (nothing frozen or unfrozen): fit start traces two lengths (a
    replay of its first trace equals the other, so it replays the middle); epoch 1 traces one bucket again (the
    optimizer state exists now: another key) and replays the others from it; epoch 2 finds that trace, with its
    recording, in the memo and traces nothing, and its sizes are epoch 1's, every bucket verified by its own
    probe again."""
    from tests.buckets.test_fit import _data
    from tests.helpers.bucket_data import BucketModel, tokens

    traced = _count_traces(monkeypatch)
    counts: list[int] = []

    class Mark(pl.Callback):  # type: ignore[misc]  # before the finder's own hook (it moves itself last)
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            counts.append(len(traced))

    def fit() -> list[Any]:
        seed(0)
        schedule = bucket_data.schedule(predict="auto")
        schedule["triggers"] = [{"kind": "fit_start"}, {"kind": "epoch", "at": [1, 2]}]
        finder = ScheduledBatchSizeFinder(schedule, sample_size=tokens, verbose=False, write_report=False)
        bucket_data.trainer([finder, Mark()], epochs=3).fit(BucketModel(_data()))
        return list(finder.history)

    history = fit()
    assert [e.trigger for e in history] == ["fit_start", "epoch", "epoch"]
    assert [e.prediction for e in history] == ["predicted"] * 3
    marks = [*counts, len(traced)]  # traces before each epoch's search (the finder's hooks run last), and after
    per_search = [b - a for a, b in itertools.pairwise(marks)]
    assert per_search == [2, 1, 0], per_search
    assert history[2].bucket_sizes == history[1].bucket_sizes
    assert history[2].bucket_bounds == history[1].bucket_bounds
    assert bucket_data.unverified_buckets(history[2]) == []
    assert len(history[2].trials) == len(history[2].bucket_sizes)
    # the same fit without the memo traces every search, and predicts what the remembered traces did
    monkeypatch.setattr(reuse, "memo_for", lambda module: TraceMemo())
    monkeypatch.setattr("retune.search.predict_run.memo_for", lambda module: TraceMemo())
    counts.clear()
    fresh = fit()
    assert len(traced) - sum(per_search) == 2 + 1 + 1
    for ours, theirs in zip(history, fresh, strict=True):
        assert (ours.predicted_bytes, ours.bucket_sizes, ours.trials) == (
            theirs.predicted_bytes,
            theirs.bucket_sizes,
            theirs.trials,
        )


def test_a_fixed_search_after_nothing_changed_runs_no_trace_and_every_fit_traces_its_first(monkeypatch: Any) -> None:
    """Fixed batching, ``mode: model``, searches at fit start, epoch 1 and epoch 2: epoch 2 traces nothing and
    finds epoch 1's size, verified by a probe; a second fit of the same model object traces its searches anew
    (the memo is emptied at fit start) and finds the same sizes."""
    from tests.helpers.varlen import trainer as quiet_trainer
    from tests.prediction.test_predicted_search import WideMLP, _schedule

    traced = _count_traces(monkeypatch)
    counts: list[int] = []

    class Mark(pl.Callback):  # type: ignore[misc]  # before the finder's own hook (it moves itself last)
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            counts.append(len(traced))

    model = WideMLP()
    schedule = _schedule("model", "auto")
    schedule["triggers"] = [{"kind": "fit_start"}, {"kind": "epoch", "at": [1, 2]}]
    sizes = []
    for _ in range(2):  # the same model object twice
        seed(0)
        counts.clear()
        finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
        quiet_trainer([finder, Mark()], 3, limit_train_batches=2).fit(model)
        marks = [*counts, len(traced)]
        per_search = [b - a for a, b in itertools.pairwise(marks)]
        assert per_search[0] > 0 and per_search[1] > 0 and per_search[2] == 0, per_search
        history = finder.history
        assert [e.prediction for e in history] == ["predicted"] * 3
        assert history[2].batch_size_after == history[1].batch_size_after
        assert all(any(t.fits and t.batch_size >= e.batch_size_after for t in e.trials) for e in history)
        sizes.append([e.batch_size_after for e in history])
    assert sizes[0] == sizes[1]


def test_a_search_after_gradient_accumulation_starts_traces_again(monkeypatch: Any) -> None:
    """``GradientAccumulationScheduler`` accumulates from epoch 2: nothing in the module or the optimizer changes,
    but a trace of an accumulating run holds the window's gradients in backward. Epoch 2's search traces again
    (accumulation is part of the key) and its first probe fits, predicted within 1%. Before, it reused epoch 1's
    trace and probed 725 (out of memory, -7.9%), 655 (out of memory) and 650: one probe more."""
    from tests.helpers.lightning_ns import callbacks
    from tests.helpers.varlen import trainer as quiet_trainer
    from tests.prediction.test_predicted_search import WideMLP, _schedule

    traced = _count_traces(monkeypatch)
    counts: list[int] = []

    class Mark(pl.Callback):  # type: ignore[misc]  # before the finder's own hook (it moves itself last)
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            counts.append(len(traced))

    seed(0)
    schedule = _schedule("model", "auto")
    schedule["triggers"] = [{"kind": "fit_start"}, {"kind": "epoch", "at": [1, 2]}]
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    accumulate = callbacks.GradientAccumulationScheduler({0: 1, 2: 3})
    quiet_trainer([accumulate, finder, Mark()], 3, limit_train_batches=12).fit(WideMLP())
    marks = [*counts, len(traced)]
    per_search = [b - a for a, b in itertools.pairwise(marks)]
    history = finder.history
    assert [e.prediction for e in history] == ["predicted"] * 3
    assert per_search[2] > 0, per_search  # epoch 2 traced: not epoch 1's trace of a run without accumulation
    assert history[2].trials[0].fits, history[2].trials
    errors = [e for e in history[2].prediction_errors if e is not None]
    assert errors and max(abs(e) for e in errors) < 0.01, errors
    assert history[2].batch_size_after < history[1].batch_size_after  # the window's gradients take room
