"""``objective: throughput`` with ``batching: buckets`` in real fits (both Lightning lines).

Every training step advances an injected clock by a known function of its padded tokens (``batch x
longest``, tests/helpers/bucket_data.py ``PaddedStepTime``), so the fastest padded work per step is known and
nothing depends on real timing; memory is measured against the CPU budget as in tests/buckets/test_fit.py
(every real step measured independently with ``StepPeaks``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from retune import ScheduledBatchSizeFinder
from retune.buckets.throughput import capped_sizes, reference_bucket
from retune.cli import main
from retune.events import RetuneEvent
from retune.reports import batch_size as report
from retune.schedule.models import parse_byte_size
from retune.search.policies import accumulation_for
from tests.helpers import bucket_data
from tests.helpers.bucket_data import (
    IndexedTokens,
    PaddedStepTime,
    TimedBucketModel,
    UnfreezeAt,
    long_tail_lengths,
    tokens,
)
from tests.helpers.lightning_ns import seed
from tests.helpers.step_time import FakeClock
from tests.helpers.varlen import StepPeaks

BUDGET = parse_byte_size(bucket_data.BUDGET)
N = 400
TOL = 0.03  # as tests/search/test_throughput_fit.py: the default tolerance (0.02) and the ladder between timed sizes
TIMES = PaddedStepTime(knee=1024)


def _fit(
    times: PaddedStepTime = TIMES,
    *,
    objective: str | None = "throughput",
    epochs: int = 1,
    frozen: bool = False,
    unfreeze_at: int | None = None,
    apply: dict[str, Any] | None = None,
    triggers: list[dict[str, Any]] | None = None,
    ckpt: Path | None = None,
    save: Path | None = None,
    out_dir: Path | None = None,
    predict: str = "off",
) -> dict[str, Any]:
    seed(0)
    clock = FakeClock()
    model = TimedBucketModel(IndexedTokens(long_tail_lengths(N)), clock, times, frozen=frozen)
    schedule = bucket_data.schedule() if objective is None else bucket_data.schedule(objective=objective)
    schedule["search"]["predict"] = predict
    if apply is not None:
        schedule["apply"] = apply
    if triggers is not None:
        schedule["triggers"] = triggers
    finder = ScheduledBatchSizeFinder(
        schedule, sample_size=tokens, verbose=False, write_report=out_dir is not None, out_dir=out_dir, clock=clock
    )
    peaks = StepPeaks()
    extra = [] if unfreeze_at is None else [UnfreezeAt(unfreeze_at)]
    trainer = bucket_data.trainer([*extra, peaks, finder], epochs=epochs)
    trainer.fit(model, ckpt_path=None if ckpt is None else str(ckpt))
    if save is not None:
        trainer.save_checkpoint(save)
    return {"finder": finder, "model": model, "peaks": peaks, "trainer": trainer}


def _reference_trials(event: RetuneEvent) -> list[tuple[int, float | None]]:
    ref = event.reference_bucket
    return [
        (t.batch_size, r)
        for t, r, b in zip(event.trials, event.samples_per_s, event.trial_buckets, strict=True)
        if b == ref
    ]


def _check_cap(event: RetuneEvent, times: PaddedStepTime, unfrozen: bool = False) -> None:
    """The reference bucket's chosen size is the fastest within the tolerance, and every bucket is capped at
    its padded work (or keeps its largest size where the curve did not turn)."""
    ref = event.reference_bucket
    assert ref == reference_bucket(event.bucket_bounds, event.bucket_samples)
    longest = event.bucket_bounds[ref]
    chosen = event.bucket_sizes[ref]
    cap = event.bucket_largest[ref]
    assert event.largest == cap
    best = max(times.rate(b, longest, unfrozen) for b in range(1, cap + 1))
    assert times.rate(chosen, longest, unfrozen) >= (1 - TOL) * best
    assert event.padded_per_step == chosen * longest
    assert event.bucket_sizes == capped_sizes(event.bucket_largest, event.bucket_bounds, chosen * longest)
    # the rates in the event are the oracle's, for the reference bucket's worst batch (its longest samples)
    timed = [(b, r) for b, r in _reference_trials(event) if r is not None]
    assert timed and all(r == pytest.approx(times.rate(b, longest, unfrozen)) for b, r in timed)


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    return {"largest": _fit(objective=None), "throughput": _fit()}


def test_buckets_are_capped_at_the_fastest_padded_work_and_the_default_is_unchanged(
    runs: dict[str, dict[str, Any]],
) -> None:
    (plain,) = runs["largest"]["finder"].history
    finder = runs["throughput"]["finder"]
    (event,) = finder.history
    # the default is `largest`, untimed, exactly as before
    assert plain.objective == "largest" and plain.samples_per_s == [] and plain.largest is None
    assert plain.bucket_largest == [] and plain.reference_bucket is None and plain.padded_per_step is None
    # throughput runs the same search for what fits first, then times the reference bucket
    assert event.trials[: len(plain.trials)] == plain.trials
    assert event.bucket_largest == plain.bucket_sizes
    assert len(event.samples_per_s) == len(event.trials) == len(event.trial_buckets) == len(event.peak_bytes)
    added = event.trial_buckets[len(plain.trials) :]
    assert added and set(added) == {event.reference_bucket}
    # the knee is 1024 padded tokens: the reference bucket (samples up to 32 tokens) is fastest near 32
    assert event.reference_bucket == 2 and event.bucket_bounds[2] == 32
    assert 1024 - 32 <= event.padded_per_step <= 1024 + 32  # type: ignore[operator]
    _check_cap(event, TIMES)
    assert event.bucket_sizes != event.bucket_largest, "the cap binds: the largest sizes are past the knee"
    # the sizes applied are the capped ones, everywhere
    assert finder.bucket_sizes == event.bucket_sizes
    assert event.batch_size_after == event.bucket_sizes[-1] == finder.batch_size
    # (on 400 samples the capped sizes happen to take as many steps per epoch as the largest ones)
    assert event.samples_per_step <= plain.samples_per_step


def test_the_loop_trains_the_capped_sizes_within_the_budget(runs: dict[str, dict[str, Any]]) -> None:
    run = runs["throughput"]
    (event,) = run["finder"].history
    peaks, model = run["peaks"], run["model"]
    assert max(peaks.peaks) <= BUDGET
    assert max(peaks.sizes) == max(event.bucket_sizes) < max(event.bucket_largest)
    assert sorted(i for b in model.batches for i in b) == list(range(N)), "each sample once"
    # a step's padded work never exceeds the cap (but for a bucket of size 1)
    for batch in model.batches:
        longest = max(len(model.data.rows[i]) for i in batch)
        assert len(batch) * longest <= event.padded_per_step or len(batch) == 1  # type: ignore[operator]


def test_no_cap_when_the_fastest_is_the_largest_that_fits() -> None:
    # the knee is far above anything that fits: samples/s only grows with the size
    run = _fit(PaddedStepTime(knee=1_000_000))
    (event,) = run["finder"].history
    assert event.padded_per_step is None
    assert event.bucket_sizes == event.bucket_largest == run["finder"].bucket_sizes
    assert report.chosen_rate(event) is not None
    assert "no cap: the largest that fits is the fastest" in report.format_summary(event)


def test_re_tune_after_an_unfreeze_re_measures_from_the_last_choice() -> None:
    # unfrozen, each token costs 3x and the knee moves down to 512 tokens
    times = PaddedStepTime(knee=1024, knee_unfrozen=512, unfrozen_cost=2.0)
    run = _fit(times, epochs=2, frozen=True, unfreeze_at=1)
    finder, peaks = run["finder"], run["peaks"]
    frozen, unfrozen = finder.history
    assert unfrozen.trigger == "trainable_params_changed" and unfrozen.objective == "throughput"
    _check_cap(frozen, times)
    _check_cap(unfrozen, times, unfrozen=True)
    assert unfrozen.padded_per_step < frozen.padded_per_step  # type: ignore[operator]
    assert unfrozen.bucket_sizes_before == frozen.bucket_sizes
    assert finder.bucket_sizes == unfrozen.bucket_sizes
    # the warm start: the selection looks at the last choice first
    assert _selection(unfrozen)[0][0] == frozen.bucket_sizes[frozen.reference_bucket]  # type: ignore[index]
    # the fit search started from memory's largest sizes, not from the cap
    assert unfrozen.bucket_largest != unfrozen.bucket_sizes
    assert max(peaks.peaks) <= BUDGET


def _selection(event: RetuneEvent) -> list[tuple[int, float | None]]:
    """The trials the selection added (after the fit search's, which on a CPU with a budget are not timed)."""
    first = next(i for i, r in enumerate(event.samples_per_s) if r is not None)
    return list(zip([t.batch_size for t in event.trials[first:]], event.samples_per_s[first:], strict=True))


def test_every_epoch_trigger_re_measures_each_time() -> None:
    run = _fit(epochs=3, triggers=[{"kind": "fit_start"}, {"kind": "epoch", "every": 1}])
    first, *later = run["finder"].history
    assert [e.trigger for e in run["finder"].history] == ["fit_start", "epoch", "epoch"]
    for event in later:
        _check_cap(event, TIMES)
        # warm: the selection looks at the last choice first, and the search for what fits is cheaper
        assert _selection(event)[0][0] == first.bucket_sizes[first.reference_bucket]  # type: ignore[index]
        assert len(event.trials) - len(_selection(event)) < len(first.trials) - len(_selection(first))


def test_keep_effective_and_lr_scaling_follow_the_capped_samples_per_step() -> None:
    times = PaddedStepTime(knee=1024, knee_unfrozen=512, unfrozen_cost=2.0)
    run = _fit(times, epochs=2, frozen=True, unfreeze_at=1, apply={"accumulate": "keep_effective"})
    first, second = run["finder"].history
    assert first.accumulate == 1 and first.effective_batch_size == round(first.samples_per_step)
    plan = accumulation_for(round(first.samples_per_step), round(second.samples_per_step))
    assert second.accumulate == plan.accumulate == run["trainer"].accumulate_grad_batches > 1
    lr = _fit(times, epochs=2, frozen=True, unfreeze_at=1, apply={"lr_scaling": "linear"})
    a, b = lr["finder"].history
    assert b.lr_factor == pytest.approx(round(b.samples_per_step) / round(a.samples_per_step))
    assert b.lr_factor < 1


def test_resume_keeps_the_capped_sizes_and_the_next_search_starts_warm(tmp_path: Path) -> None:
    path = tmp_path / "one.ckpt"
    first = _fit(save=path)
    state = first["finder"].state_dict()["buckets"]
    (event,) = first["finder"].history
    assert state["sizes"] == event.bucket_sizes and state["largest"] == event.bucket_largest
    assert (state["reference"], state["padded"]) == (event.reference_bucket, event.padded_per_step)
    resumed = _fit(epochs=3, ckpt=path, triggers=[{"kind": "fit_start"}, {"kind": "epoch", "at": [2]}])
    finder = resumed["finder"]
    assert [e.trigger for e in finder.history] == ["fit_start", "epoch"]
    assert finder.history[1].bucket_sizes_before == event.bucket_sizes
    assert max(resumed["peaks"].sizes) <= max(event.bucket_sizes)
    # the re-tune after the resume: the fit search starts from the largest sizes, the selection at the choice
    again = finder.history[1]
    assert _selection(again)[0][0] == event.bucket_sizes[event.reference_bucket]  # type: ignore[index]
    _check_cap(again, TIMES)


def test_events_report_and_files_show_the_cap(
    runs: dict[str, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (event,) = runs["throughput"]["finder"].history
    ref = event.reference_bucket
    assert ref is not None
    chosen = report.chosen_rate(event)
    assert chosen == pytest.approx(TIMES.rate(event.bucket_sizes[ref], event.bucket_bounds[ref]))
    # the rates are the reference bucket's: the same size in another bucket would be another batch
    assert set(report.size_rates(event)) == {b for b, r in _reference_trials(event) if r is not None}
    summary = report.format_summary(event)
    largest = "/".join(map(str, event.bucket_largest))
    assert f"largest that fit {largest}" in summary
    assert f"fastest {event.bucket_sizes[ref]} in bucket {ref} at {report.format_rate(chosen)}" in summary
    assert f"capped at {event.padded_per_step:,} padded per step" in summary
    table = report.format_table([event])
    assert "largest" in table.splitlines()[1] and largest in table.splitlines()[-1]
    assert "padded/step (bucket timed)" in table and f"{event.padded_per_step:,} (bucket {ref})" in table
    metrics = report.event_metrics(event)
    assert metrics["retune/padded_per_step"] == event.padded_per_step
    assert metrics["retune/samples_per_s"] == pytest.approx(chosen)
    assert RetuneEvent.from_dict(event.to_dict()) == event
    paths = report.write_outputs([event], tmp_path)
    rows = (tmp_path / report.CSV_NAME).read_text().splitlines()
    header = rows[0].split(",")
    values = dict(zip(header, rows[1].split(","), strict=True))
    assert values["bucket_largest"] == largest and values["reference_bucket"] == str(ref)
    assert values["padded_per_step"] == str(event.padded_per_step)
    assert paths and (tmp_path / report.PNG_NAME).exists()
    # `retune report` re-renders them from history.json
    assert main(["report", str(paths.json), "--plot", str(tmp_path / "again.png")]) == 0
    out = capsys.readouterr().out
    assert largest in out and f"{event.padded_per_step:,} (bucket {ref})" in out


class _OomAfter(TimedBucketModel):
    """Runs out of memory like a GPU, with the real error type, when ``batch x longest`` passes ``capacity``
    tokens; from global step 1 on, batches of long samples (> 100 tokens) have half of it."""

    def __init__(self, clock: FakeClock, times: PaddedStepTime, capacity: int) -> None:
        super().__init__(IndexedTokens(long_tail_lengths(N)), clock, times)
        self.capacity = capacity

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        longest = int((ids > 0).sum(1).max())
        capacity = self.capacity // 2 if longest > 100 and self.trainer.global_step >= 1 else self.capacity
        if ids.shape[0] * longest > capacity:
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle: {ids.shape[0]} x {longest} > {capacity})")
        return super().training_step(batch, batch_idx)


def test_an_oom_re_tune_lowers_only_the_failing_bucket_and_keeps_the_padded_work() -> None:
    seed(0)
    clock = FakeClock()
    times = PaddedStepTime(knee=1536)
    model = _OomAfter(clock, times, capacity=2048)
    schedule = {
        "triggers": [{"kind": "fit_start"}, {"kind": "oom"}],
        "search": {"batching": "buckets", "buckets": 4, "mode": "binsearch", "margin": 0.0, "objective": "throughput"},
    }
    finder = ScheduledBatchSizeFinder(schedule, sample_size=tokens, verbose=False, write_report=False, clock=clock)
    bucket_data.trainer([finder], epochs=2).fit(model)
    first, second = [e for e in finder.history if not e.is_recovery]
    assert second.trigger == "oom"
    _check_cap(first, times)
    # the long samples' bucket: 8 x 246 fit 2048 tokens, the cap at ~1536 padded tokens per step lowered it
    assert first.bucket_largest[3] == 8 and first.bucket_sizes[3] == first.padded_per_step // 246 < 8  # type: ignore[operator]
    # the re-tune probes only that bucket for what fits, times nothing, and keeps T*
    assert set(second.trial_buckets) == {3} and all(r is None for r in second.samples_per_s)
    assert second.padded_per_step == first.padded_per_step
    assert second.reference_bucket == first.reference_bucket
    assert second.bucket_largest[:3] == first.bucket_largest[:3]
    assert second.bucket_largest[3] == 1024 // 246
    assert second.bucket_sizes == capped_sizes(second.bucket_largest, second.bucket_bounds, first.padded_per_step)  # type: ignore[arg-type]
    assert finder.bucket_sizes == second.bucket_sizes


def test_with_predict_the_timing_trials_search_below_the_verified_predictions(runs: dict[str, dict[str, Any]]) -> None:
    """``predict: auto``: the traces predict every bucket's largest size and one probe per bucket verifies it (the
    fit search), then the reference bucket is timed below its verified size only, and the cap binds as without
    predict. The loop trains within the budget, each sample once."""
    run = _fit(predict="auto")
    (event,) = run["finder"].history
    (plain,) = runs["throughput"]["finder"].history
    assert event.prediction == "predicted" and event.note == ""
    timed_from = next(i for i, r in enumerate(event.samples_per_s) if r is not None)
    fit_trials = event.trials[:timed_from]
    (without,) = runs["largest"]["finder"].history
    assert len(fit_trials) < len(without.trials), "fewer probes to the largest sizes than without predict"
    assert all(r is None for r in event.samples_per_s[:timed_from]) and all(p for p in event.peak_bytes[:timed_from])
    ref = event.reference_bucket
    cap = event.bucket_largest[ref]  # the verified size, after the margin
    timed = [t for t, r in zip(event.trials[timed_from:], event.samples_per_s[timed_from:], strict=True) if r]
    assert timed and all(t.batch_size <= cap for t in timed), "the timing trials search below the verified size"
    assert set(event.trial_buckets[timed_from:]) == {ref}
    assert plain.reference_bucket == ref
    # every bucket capped at the chosen padded work (the selection's own precision: the tests above; from a cap of
    # 42 instead of 40 its ladder times 30 and 35, not 32, and picks 30, 3.2% below the best rate)
    chosen = event.bucket_sizes[ref]
    assert event.padded_per_step == chosen * event.bucket_bounds[ref] and chosen <= cap
    assert event.bucket_sizes == capped_sizes(event.bucket_largest, event.bucket_bounds, event.padded_per_step)
    assert TIMES.rate(chosen, event.bucket_bounds[ref]) >= 0.95 * TIMES.rate(cap, event.bucket_bounds[ref])
    peaks, model = run["peaks"], run["model"]
    assert max(peaks.peaks) <= BUDGET
    assert sorted(i for b in model.batches for i in b) == list(range(N)), "each sample once"
