"""Findings of a review of ``search.predict: auto``, each held by a test that failed before its fix.

* A prediction that errs low sends the first verifying probes over the limit; with a small ``search.max_trials``
  the trials ran out before any size fit and the fit failed (``RetuneError: no train batch size fits``) where
  ``predict: off`` ends on a small size that fit and warns that ``max_trials`` ran out. The last trial of a search
  where nothing fit yet goes no higher than where a search without prediction ends after as many failures (its
  start halved at each); a second review found the first rule (no higher than the start) failed where the start
  fails and a lower size fits.
* A batch field that is a list of one same-shape tensor per sample (``{"images": [img] * B, "ids": (B, T)}``, a
  collate that keeps images as a list) was never resized by the fake batch (a flat prediction at every size), or,
  with two samples, read as two batches of the images' channels (a wrong fallback reason).
* ``collate_fn=lambda b: b`` (a list of ``(x, y)`` samples) fell back with a reason about a time-major batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.data import DataLoader, TensorDataset

import retune.search.predict_run as predict_run
from retune import ScheduledBatchSizeFinder
from retune.errors import RetuneError
from retune.events import RetuneEvent, Trial
from retune.prediction.fake_batch import fake_batch
from retune.prediction.replay import tag_size, target_shapes
from retune.recovery.split import SplitError, batch_length, split_batch
from retune.search.largest import SearchPlan, run_search
from retune.search.predict_run import _not_batch_first
from retune.search.predicted import Prediction, predict_largest, run_predicted_search
from tests.helpers.lightning_ns import pl
from tests.helpers.varlen import trainer as quiet_trainer

LIMIT = 3_000_000


def _line(fixed: float, per_sample: float) -> Callable[[int], float]:
    return lambda size: fixed + per_sample * size


def _predicted(
    true_peak: Callable[[int], float], traced: Callable[[int], float], plan: SearchPlan, oom_above: int | None = None
) -> Any:
    """A predicted search of ``plan`` where ``traced`` is the trace and ``true_peak`` what the probes measure; above
    ``oom_above`` a probe runs out of memory for real and leaves no peak."""
    prediction = predict_largest(traced, LIMIT, upper=plan.upper, first=plan.upper, fixed=lambda: traced(0))

    def measure(size: int) -> tuple[bool, int | None]:
        if oom_above is not None and size > oom_above:
            return False, None
        peak = int(true_peak(size))
        return peak <= LIMIT, peak

    return run_predicted_search(plan, prediction, measure, LIMIT)


# -- max_trials runs out before any size fit ------------------------------------------------------------------


def test_one_trial_goes_where_a_search_without_prediction_starts_and_says_it_did_not_settle() -> None:
    """The trace reads half the true memory: the predicted size (about 4000) is twice what fits. With one trial the
    search without prediction probes ``init_val`` (2), fits and warns; the predicted one did the same probe's job
    at 4000, failed, and the fit raised."""
    true_peak, traced = _line(1e6, 1000), _line(5e5, 500)
    plan = SearchPlan("binsearch", 2, 1, 0.0, 8192)
    result = _predicted(true_peak, traced, plan)
    off = run_search(plan, lambda size: true_peak(size) <= LIMIT)
    assert (result.trials, result.size, result.unsettled) == (off.trials, off.size, off.unsettled)
    assert result.trials == [Trial(2, True)] and result.unsettled == "2 fit and no larger size was probed"


@pytest.mark.parametrize("oom_above", [None, 600])
def test_the_last_trial_with_nothing_fitting_goes_where_the_start_halving_ends_and_the_result_is_unsettled(
    oom_above: int | None,
) -> None:
    """Memory the trace misses (a fixed 1.9 MB) puts every calibrated step over the limit: 3 trials ran out on 3
    failures (2200, then steps down that still failed). A real out-of-memory error above 600 (no peak to
    calibrate with) bisects instead, and ran out the same way. The third trial now goes where a search without
    prediction ends after three failures: the start (4) halved twice."""
    true_peak, traced = _line(2.9e6, 190), _line(1e6, 900)
    plan = SearchPlan("binsearch", 4, 3, 0.0, 8192)
    result = _predicted(true_peak, traced, plan, oom_above)
    assert [t.fits for t in result.trials] == [False, False, True], result.trials
    assert result.trials[-1] == Trial(1, True) and result.size == 1
    assert result.max_fitting == 1 and result.min_failing == min(t.batch_size for t in result.trials[:2])
    assert result.unsettled == f"1 fit and {result.min_failing} failed: the sizes between were not probed"


def test_a_start_at_or_above_the_smallest_failure_halves_that_failure() -> None:
    """A warm start (200) at or above what failed (150, known): the first trial, just below it (149), measures over
    the limit, and the last goes to the start halved (100), where a search without prediction ends after one
    failure (the calibrated step down reached 141, which fails too: 105 is the largest that fits). Where the failures
    reach below that, it halves the smallest (a start of 400: 200 is above the 149 that failed, so 74)."""
    true_peak, traced = _line(2.98e6, 190), _line(1e6, 900)
    plan = SearchPlan("binsearch", 200, 2, 0.0, 8192, known_fail=150)
    result = _predicted(true_peak, traced, plan)
    assert result.trials == [Trial(149, False), Trial(100, True)] and result.size == 100
    higher = _predicted(true_peak, traced, SearchPlan("binsearch", 400, 2, 0.0, 8192, known_fail=150))
    assert higher.trials == [Trial(149, False), Trial(74, True)] and higher.size == 74


@pytest.mark.parametrize("oom_above", [None, 25])
@pytest.mark.parametrize("start", [3, 8, 32, 100])
@pytest.mark.parametrize("max_trials", [1, 2, 3, 4])
def test_wherever_a_search_without_prediction_ends_on_a_size_the_predicted_one_does(
    oom_above: int | None, start: int, max_trials: int
) -> None:
    """A review's case: memory ``2.7 MB + 10 kB x size`` (30 fits) traced as a third of its slope, a start that
    fails (32) and two trials: ``predict: off`` probes 32, then 16, and ends on 16; the predicted search probed
    its line's size, then the start, and ended with nothing (the caller's "no size fits")."""
    true_peak, traced = _line(2.7e6, 10_000), _line(2.7e6, 3_333)
    plan = SearchPlan("binsearch", start, max_trials, 0.0, 8192)
    off = run_search(plan, lambda size: (oom_above is None or size <= oom_above) and true_peak(size) <= LIMIT)
    result = _predicted(true_peak, traced, plan, oom_above)
    assert off.size is None or result.size is not None, (off.trials, result.trials)


def test_where_even_the_start_fails_nothing_fits() -> None:
    """The last chance is no promise: where the start does not fit either, the search ends with no size (the caller's
    "no size fits" error), as one without prediction does."""
    true_peak, traced = _line(3.1e6, 100), _line(1e6, 900)  # not even one sample fits
    plan = SearchPlan("binsearch", 2, 2, 0.0, 8192)
    cut = _predicted(true_peak, traced, plan)
    assert [t.fits for t in cut.trials] == [False, False] and cut.trials[-1] == Trial(1, False)
    assert cut.size is None and cut.max_fitting is None and not cut.unsettled


class WideMLP(pl.LightningModule):  # type: ignore[misc,name-defined]
    """Memory linear in the batch size (wide activations, Adam state); ``collate`` sets the loader's."""

    def __init__(self, batch_size: int = 4, n: int = 2048, collate: Callable[[list[Any]], Any] | None = None) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.collate = collate
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))

    def inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[0], batch[1]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self.inputs(batch)
        return F.cross_entropy(self.net(x), y)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True, collate_fn=self.collate)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _event(model: WideMLP, predict: str, **search: Any) -> RetuneEvent:
    pl.seed_everything(0)
    schedule = {
        "search": {"mode": "binsearch", "margin": 0.0, "steps_per_trial": 2, "predict": predict, **search},
        "memory": {"budget": "4MiB"},
        "triggers": [{"kind": "fit_start"}],
    }
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet_trainer([finder], 1, limit_train_batches=2).fit(model)
    return finder.history[0]


@pytest.mark.parametrize("max_trials", [1, 2])
def test_a_fit_whose_prediction_errs_low_ends_on_a_size_that_fit_as_without_prediction(
    monkeypatch: pytest.MonkeyPatch, max_trials: int
) -> None:
    """The run's trace read as half what it is (a prediction that errs low, as a GRU's did by 42%): the first
    verifying probe measures over the budget. With one or two trials the fit raised ``RetuneError``; now it ends
    on a size that fit (``init_val`` halved once per trial before the last), and the note says ``max_trials`` ran
    out."""
    real = predict_run.predict_largest

    def errs_low(trace: Callable[[int], float], limit: float, **options: Any) -> Prediction:
        return real(lambda size: 0.5 * trace(size), limit, **{**options, "phases": None})

    monkeypatch.setattr(predict_run, "predict_largest", errs_low)
    try:
        auto = _event(WideMLP(), "auto", max_trials=max_trials, init_val=4)
    except RetuneError as error:
        pytest.fail(f"a predicted search cut short by max_trials raised: {error}")
    assert auto.prediction == "predicted" and [t.fits for t in auto.trials] == [False] * (max_trials - 1) + [True]
    floor = 4 >> (max_trials - 1)
    assert auto.trials[-1] == Trial(floor, True) and auto.batch_size_after == floor
    assert f"search.max_trials ({max_trials}) ran out" in auto.note, auto.note


# -- a list of one tensor per sample --------------------------------------------------------------------------


def _images(samples: int, container: type = list) -> dict[str, Any]:
    return {"images": container(torch.randn(3, 8, 8) for _ in range(samples)), "ids": torch.ones(samples, 16)}


@pytest.mark.parametrize("samples", [2, 4])
@pytest.mark.parametrize("container", [list, tuple])
def test_a_list_of_per_sample_images_holds_one_fake_per_sample_at_every_size(samples: int, container: type) -> None:
    """At two samples the images' list was read as two batches of 3 rows (the channels: "batch['images'][0] has
    3"), at four it was per sample but the fake batch kept four images at every size (a flat prediction)."""
    batch = _images(samples, container)
    assert batch_length(batch) == samples
    fake = fake_batch(batch, 16, FakeTensorMode())
    assert type(fake["images"]) is container and len(fake["images"]) == 16
    assert all(tuple(image.shape) == (3, 8, 8) for image in fake["images"]) and fake["ids"].shape == (16, 16)
    assert len({id(image) for image in fake["images"]}) == 16  # each its own: a batch's bytes count each once
    assert tuple(fake_batch(batch, 1, FakeTensorMode())["ids"].shape) == (1, 16)


def test_splitting_a_batch_gives_each_piece_its_own_samples_images() -> None:
    """A recovery that splits the batch: each micro-batch held every image (four images with two ids)."""
    batch = _images(4)
    pieces = split_batch(batch, 2)
    assert [len(p["images"]) for p in pieces] == [2, 2] and [p["ids"].shape[0] for p in pieces] == [2, 2]
    assert all(a is b for a, b in zip([i for p in pieces for i in p["images"]], batch["images"], strict=True))
    assert [len(p["images"]) for p in split_batch(_images(2), 2)] == [1, 1]


def test_lists_of_batches_stay_batches_read_against_the_batch_length() -> None:
    """Three augmented views of four samples were read as three per-sample values (a ``SplitError``); views whose
    rows are the batch's are batches, and where both readings fit (two views of two samples) they stay batches, as
    before. The top level is never per sample (``[x, y]``), nor is a named tuple."""
    views = {"views": [torch.randn(4, 5) for _ in range(3)], "y": torch.arange(4)}
    assert batch_length(views) == 4
    fake = fake_batch(views, 16, FakeTensorMode())
    assert [tuple(v.shape) for v in fake["views"]] == [(16, 5)] * 3
    assert [[tuple(v.shape) for v in p["views"]] for p in split_batch(views, 2)] == [[(2, 5)] * 3] * 2
    pair = {"views": [torch.randn(2, 5) for _ in range(2)], "y": torch.arange(2)}
    assert [tuple(v.shape) for v in fake_batch(pair, 16, FakeTensorMode())["views"]] == [(16, 5)] * 2
    from retune.recovery.split import per_sample_tensors

    assert not per_sample_tensors(pair["views"], 2) and per_sample_tensors(_images(2)["images"], 2)
    top = [torch.randn(3, 5) for _ in range(3)]
    assert batch_length(top) == 3 and [tuple(v.shape) for v in fake_batch(top, 16, FakeTensorMode())] == [(16, 5)] * 3
    with pytest.raises(SplitError, match=r"no tensor with a batch dimension .*zip"):  # tuple(zip(*samples)): refused
        split_batch((tuple(torch.zeros(3, 8, 8) for _ in range(4)), (0, 1, 2, 3)), 2)


def test_a_replay_refuses_a_list_of_per_sample_tensors() -> None:
    """A replay scales the traced batch's dimensions, and the images' count is none: the replay kept the tag
    size's images at every size. No tag size is recorded for such a batch (the search traces), and its target
    shapes are refused."""
    batch = _images(2)
    assert tag_size(batch, {64}) is None
    with pytest.raises(SplitError, match=r"batch\['images'\] holds one tensor per sample"):
        target_shapes(batch, 8)
    assert tag_size({"ids": torch.ones(2, 26)}, {64, 128}) == 17


class ListOfVectors(WideMLP):
    """``WideMLP`` whose collate keeps the inputs as a list of one vector per sample (as a collate that keeps
    variable-size images as a list does), the labels stacked. Each input its own copy, as a decoded image is: a
    view of the dataset's tensor holds that whole tensor's storage in the batch the probes count."""

    def __init__(self) -> None:
        super().__init__(collate=self.keep_inputs)

    @staticmethod
    def keep_inputs(samples: list[Any]) -> dict[str, Any]:
        return {"x": [x.clone() for x, _ in samples], "y": torch.stack([y for _, y in samples])}

    def inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(batch["x"]), batch["y"]


def test_a_fit_on_a_list_of_per_sample_inputs_is_predicted_to_the_probes() -> None:
    """The list was faked at its traced length at every size: a flat prediction, the first probe far over the
    budget. Now the trace holds one input per sample, and the prediction is what the probes measure."""
    off = _event(ListOfVectors(), "off")
    auto = _event(ListOfVectors(), "auto")
    assert auto.prediction == "predicted", auto.note
    assert auto.batch_size_after == off.batch_size_after and len(auto.trials) <= 2 < len(off.trials)
    errors = [e for e in auto.prediction_errors if e is not None]
    assert errors and all(abs(e) <= 0.02 for e in errors), errors


# -- a list of samples as the dataset returns them ------------------------------------------------------------


def test_a_list_of_samples_is_said_to_be_one_not_a_time_major_batch() -> None:
    """``collate_fn=lambda b: b`` over ``(x, y)`` samples: the reason said the batch's leading dimension (64, the
    features) was that of a time-major batch."""
    samples = [(torch.zeros(64), torch.tensor(1)) for _ in range(2)]
    reason = _not_batch_first(samples, 2) or ""
    assert "list of 2 samples as the dataset returns them" in reason and "time-major" not in reason, reason
    assert "list of 3 samples" in (_not_batch_first([torch.zeros(64)] * 3, 3) or "")
    time_major = _not_batch_first([torch.zeros(30, 2), torch.zeros(30, 2)], 2) or ""  # [src, tgt], (length, batch)
    assert "time-major" in time_major, time_major


def test_a_fit_on_a_list_of_samples_falls_back_with_that_reason() -> None:
    model = WideMLP(collate=lambda samples: samples)
    model.inputs = lambda batch: (torch.stack([x for x, _ in batch]), torch.stack([y for _, y in batch]))  # type: ignore[method-assign]
    auto = _event(model, "auto")
    assert auto.prediction == "probed" and "samples as the dataset returns them" in auto.note, auto.note


def test_no_size_fits_says_a_probe_measured_over_the_limit_or_did_not_fit() -> None:
    """A probe fails by measuring over the limit (a budget, a predicted search) as often as by running out of memory:
    the error says which ("ran out of memory" was said of a 147 that peaked at 9.1 MiB under a 6 MiB budget)."""
    from retune.search.largest import SearchResult
    from retune.search.stage import _nothing_fits

    measured = SearchResult(None, None, 147, [Trial(147, False)], [9_542_041])
    message = str(_nothing_fits("train batch size", "fit_start", 0, measured, 6 * 2**20))
    assert "the smallest size tried, 147, peaked at 9.1 MiB, over the limit (1 trial)" in message
    assert "memory.budget (6 MiB)" in message
    unmeasured = SearchResult(None, None, 1, [Trial(4, False), Trial(1, False)], [None, None])
    assert "the smallest size tried, 1, did not fit (2 trials)" in str(
        _nothing_fits("train batch size", "oom", 3, unmeasured, None)
    )


@pytest.mark.parametrize("predict", ["off", "auto"])
def test_no_size_fits_says_the_peak_a_binsearch_probe_measured(predict: str) -> None:
    """``mode: binsearch`` keeps no peaks in its result (the prober has them): its "no size fits" said "did not fit"
    of a size that peaked at several times the budget, where ``mode: model`` named the peak."""
    schedule = {
        "search": {"mode": "binsearch", "predict": predict, "max_trials": 3, "steps_per_trial": 1},
        "memory": {"budget": "64KiB"},
        "triggers": [{"kind": "fit_start"}],
    }
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    with warnings.catch_warnings(), pytest.raises(RetuneError) as info:
        warnings.simplefilter("ignore")
        quiet_trainer([finder], 1, limit_train_batches=2).fit(WideMLP())
    assert "MiB, over the limit" in str(info.value) and "did not fit" not in str(info.value), str(info.value)
