"""``search.objective: throughput`` in real fits, on both Lightning lines, with a step-time oracle.

Every training step advances an injected clock by a known function of the batch size
(tests/helpers/step_time.py), so the fastest size is known and nothing depends on real timing; memory is the
OOM oracle of tests/helpers/oracle.py (the real ``torch.OutOfMemoryError``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from retune import ScheduledBatchSizeFinder
from retune.events import RetuneEvent
from retune.reports import batch_size as report
from tests.helpers.lightning_ns import callbacks, pl
from tests.helpers.step_time import FakeClock, StepTimeOracle, TimedModel, roomy_oracle

TOL = 0.03
FREEZE_UNFREEZE = [{"kind": "fit_start"}, {"kind": "trainable_params_changed"}]


def _schedule(
    objective: str | None = "throughput", triggers: list[dict[str, Any]] | None = None, **search: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"triggers": triggers or [{"kind": "fit_start"}], "search": dict(search)}
    if objective is not None:
        body["search"]["objective"] = objective
    return body


def _fit(
    schedule: dict[str, Any],
    times: StepTimeOracle,
    *,
    epochs: int = 1,
    unfreeze_at: int | None = None,
    out_dir: Path | None = None,
    **trainer_kwargs: Any,
) -> tuple[ScheduledBatchSizeFinder, TimedModel, Any]:
    pl.seed_everything(0)
    clock = FakeClock()
    model = TimedModel(clock, times, batch_size=8, oracle=roomy_oracle(), head_only_optimizer=True, n=2048)
    finder = ScheduledBatchSizeFinder(
        schedule, verbose=False, clock=clock, write_report=out_dir is not None, out_dir=out_dir
    )
    cbs: list[Any] = [finder]
    if unfreeze_at is not None:
        cbs.insert(0, callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=unfreeze_at))
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=cbs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        limit_train_batches=2,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return finder, model, trainer


def _rate(times: StepTimeOracle, event: RetuneEvent, trainable: float = 0.0) -> float:
    return times.rate(event.batch_size_after, trainable)


def test_throughput_chooses_the_fastest_size_that_fits_and_the_default_is_unchanged() -> None:
    times = StepTimeOracle(knee=48)
    largest, _, _ = _fit(_schedule(objective=None), times)
    fastest, model, _ = _fit(_schedule(), times)
    (plain,) = largest.history
    (event,) = fastest.history

    # the default is `largest`, untimed, exactly as before
    assert plain.objective == "largest" and plain.samples_per_s == [] and plain.largest is None
    # throughput runs the same search for what fits first, then picks among the sizes that fit
    assert event.trials[: len(plain.trials)] == plain.trials
    assert (event.max_fitting, event.min_failing) == (plain.max_fitting, plain.min_failing)
    assert event.largest == plain.batch_size_after
    assert event.objective == "throughput"
    assert len(event.samples_per_s) == len(event.trials) == len(event.peak_bytes)
    # the size that trains fastest, within the tolerance: far below the largest that fits
    assert _rate(times, event) >= (1 - TOL) * times.best_rate(event.largest)
    assert event.batch_size_after <= 48 < event.largest
    assert fastest.batch_size == model.batch_size == event.batch_size_after
    assert _rate(times, event) > 2.5 * times.rate(event.largest)
    # within 1.5x the trials of the largest search
    assert len(event.trials) <= 1.5 * len(plain.trials)


def test_the_warm_up_step_is_not_timed_and_rates_are_exact() -> None:
    # the first step of each trial takes 1 s more: were it timed, every rate would be far lower
    times = StepTimeOracle(knee=48, warmup=1.0)
    finder, _, _ = _fit(_schedule(), times)
    (event,) = finder.history
    for trial, rate in zip(event.trials, event.samples_per_s, strict=True):
        if trial.fits:
            assert rate == pytest.approx(times.rate(trial.batch_size)), trial
        else:
            assert rate is None


def test_more_steps_per_trial_time_more_steps() -> None:
    times = StepTimeOracle(knee=48)
    finder, _, _ = _fit(_schedule(steps_per_trial=5), times)
    (event,) = finder.history
    assert _rate(times, event) >= (1 - TOL) * times.best_rate(event.largest or 0)


def test_selection_trials_time_four_steps_the_fit_search_two(monkeypatch: pytest.MonkeyPatch) -> None:
    from retune.probing.prober import Prober

    timed: list[int] = []
    original = Prober.time

    def spy(self: Prober, size: int, steps: int | None = None) -> tuple[bool, list[float]]:
        ok, seconds = original(self, size, steps)
        timed.append(len(seconds))
        return ok, seconds

    monkeypatch.setattr(Prober, "time", spy)
    times = StepTimeOracle(knee=48)
    finder, _, _ = _fit(_schedule(), times)
    (event,) = finder.history
    assert timed and set(timed) == {4}, timed  # 1 warm-up + 4 timed steps in every selection trial
    selection = len(timed)
    search = [r for r in event.samples_per_s[: len(event.trials) - selection] if r is not None]
    assert search, "the fit search's trials are timed too (2 steady steps each, by default)"
    assert _rate(times, event) >= (1 - TOL) * times.best_rate(event.largest or 0)


def test_re_tune_after_an_unfreeze_re_measures() -> None:
    # unfrozen, each sample costs 3x and the knee moves to 12: the old choice is now too large to be fastest
    times = StepTimeOracle(knee=48, knee_unfrozen=12, unfrozen_cost=2.0)
    finder, model, _ = _fit(_schedule(triggers=FREEZE_UNFREEZE), times, epochs=2, unfreeze_at=1)
    frozen, unfrozen = finder.history
    assert unfrozen.trigger == "trainable_params_changed" and unfrozen.direction == "down"
    assert unfrozen.objective == "throughput"
    assert _rate(times, frozen) >= (1 - TOL) * times.best_rate(frozen.largest or 0)
    assert unfrozen.batch_size_after <= 12 < frozen.batch_size_after
    assert _rate(times, unfrozen, 1.0) >= (1 - TOL) * times.best_rate(unfrozen.largest or 0, 1.0)
    # timed again after the unfreeze: the new rates are the unfrozen step's
    timed = [(t.batch_size, r) for t, r in zip(unfrozen.trials, unfrozen.samples_per_s, strict=True) if r is not None]
    assert timed and all(r == pytest.approx(times.rate(b, 1.0)) for b, r in timed)
    # the warm start starts at the last choice, and the largest-fit bracket is memory's, not the choice
    assert unfrozen.trials[0].batch_size == frozen.max_fitting
    previous = [
        r
        for t, r in zip(unfrozen.trials, unfrozen.samples_per_s, strict=True)
        if t.batch_size == frozen.batch_size_after
    ]
    assert previous and previous[0] is not None  # the selection looked at the last choice first
    assert model.batch_size == unfrozen.batch_size_after
    assert unfrozen.largest is not None and unfrozen.largest < frozen.largest  # type: ignore[operator]


def test_every_epoch_trigger_re_measures_each_time() -> None:
    times = StepTimeOracle(knee=48)
    finder, _, _ = _fit(_schedule(triggers=[{"kind": "fit_start"}, {"kind": "epoch", "every": 1}]), times, epochs=3)
    assert [e.trigger for e in finder.history] == ["fit_start", "epoch", "epoch"]
    first, *later = finder.history
    for event in later:
        assert event.objective == "throughput" and any(r is not None for r in event.samples_per_s)
        # a warm re-tune without a change costs far fewer trials than the cold search
        assert len(event.trials) < len(first.trials)
        assert _rate(times, event) >= (1 - TOL) * times.best_rate(event.largest or 0)


def test_keep_effective_accumulates_more_for_a_smaller_fastest_size() -> None:
    times = StepTimeOracle(knee=48, knee_unfrozen=12, unfrozen_cost=2.0)
    schedule = _schedule(triggers=FREEZE_UNFREEZE)
    schedule["apply"] = {"accumulate": "keep_effective"}
    finder, _, trainer = _fit(schedule, times, epochs=2, unfreeze_at=1)
    frozen, unfrozen = finder.history
    assert frozen.accumulate == 1 and frozen.effective_batch_size == frozen.batch_size_after
    expected = max(1, round(frozen.batch_size_after / unfrozen.batch_size_after))
    assert unfrozen.accumulate == expected > 1
    assert trainer.accumulate_grad_batches == expected


def test_with_a_cpu_budget_the_memory_probes_are_not_timed_but_the_choice_is() -> None:
    # the CPU tracker slows every operator, so steps it measures are not timed; the selection times its own
    times = StepTimeOracle(knee=48)
    schedule = _schedule()
    schedule["memory"] = {"budget": "256MiB"}
    finder, _, _ = _fit(schedule, times)
    (event,) = finder.history
    fit_search = len([p for p in event.peak_bytes if p is not None])
    assert fit_search > 0
    for trial, peak, rate in zip(event.trials, event.peak_bytes, event.samples_per_s, strict=True):
        assert peak is None or rate is None, (trial, peak, rate)  # never both: tracked steps are not timed
    assert _rate(times, event) >= (1 - TOL) * times.best_rate(event.largest or 0)


def test_events_report_and_files_show_the_throughput(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    times = StepTimeOracle(knee=48)
    finder, _, _ = _fit(_schedule(), times, out_dir=tmp_path)
    (event,) = finder.history
    chosen = report.chosen_rate(event)
    assert chosen == pytest.approx(times.rate(event.batch_size_after))
    summary = report.format_summary(event)
    assert f"-> {event.batch_size_after} (the fastest at {report.format_rate(chosen)}" in summary
    assert f"largest that fits {event.largest}" in summary
    table = report.format_table(finder.history)
    assert "samples/s" in table.splitlines()[1] and str(event.largest) in table.splitlines()[-1]
    metrics = report.event_metrics(event)
    assert metrics["retune/samples_per_s"] == pytest.approx(chosen)
    # history.json keeps every rate; the CSV and the plot show them
    again = report.read_history(tmp_path / report.JSON_NAME).events[0]
    assert again == event
    rows = (tmp_path / report.CSV_NAME).read_text().splitlines()
    assert "objective,largest,samples_per_s,trial_samples_per_s" in rows[0]  # the prediction columns follow
    assert f",throughput,{event.largest},{chosen:.1f}," in rows[1]
    from matplotlib.image import imread

    assert imread(tmp_path / report.PNG_NAME).shape[:2] == report.PLOT_SIZE_PX[::-1]
    line = report.format_trial(3, 45, True, None, 817.9)
    assert line == "trial 3 batch_size=45: fits, 818 samples/s"


def test_largest_history_still_reads_and_renders(tmp_path: Path) -> None:
    # a history.json from before the throughput objective has none of its keys
    old = {"epoch": 0, "global_step": 0, "trigger": "fit_start", "stage": "train", "batch_size_before": 2,
           "batch_size_after": 64, "trials": [[2, True], [64, True]]}  # fmt: skip
    (tmp_path / "h.json").write_text(json.dumps({"version": 1, "events": [old]}))
    (event,) = report.read_history(tmp_path / "h.json").events
    assert event.objective == "largest" and event.samples_per_s == [] and report.chosen_rate(event) is None
    assert "samples/s" not in report.format_table([event])
    assert "fastest" not in report.format_summary(event)
    report.plot_history(tmp_path / "p.png", [event])


def test_ddp_ranks_agree_and_the_slowest_rank_decides(tmp_path: Path) -> None:
    from tests.ddp.run_ddp_throughput import TIMES
    from tests.helpers.dist_utils import run_rank_scripts

    script = Path(__file__).resolve().parents[1] / "ddp" / "run_ddp_throughput.py"
    (code, output, out) = run_rank_scripts({"throughput": ["{out}"]}, script, tmp_path, 240)["throughput"]
    assert code == 0, output[-4000:]
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(ranks) == [0, 1], output[-4000:]
    (event0,), (event1,) = ranks[0]["history"], ranks[1]["history"]
    assert event0 == {**event1, "duration_s": event0["duration_s"]}  # the same trials, rates and choice
    chosen = event0["batch_size_after"]
    assert ranks[0]["batch_size"] == ranks[1]["batch_size"] == ranks[1]["model_batch_size"] == chosen

    def slowest(size: int) -> float:  # every step waits for the slowest rank
        return size / max(TIMES[0].seconds(size), TIMES[1].seconds(size))

    for (size, fits), rate in zip(event0["trials"], event0["samples_per_s"], strict=True):
        assert rate is None if not fits else rate == pytest.approx(slowest(size))
    best = max(slowest(b) for b in range(1, event0["largest"] + 1))
    assert slowest(chosen) >= (1 - TOL) * best
    assert chosen <= 16 < 0.9 * 48  # rank 0 alone would have chosen near 48


# -- the trial budget: at most 1.5x the trials of `largest` (issue 28) ---------------------------

# The two curves the issue measured above the README's 1.5x: a CPU BERT with no budget (flat near its top,
# the search for what fits climbing to the dataset's length without a failure: 8 trials; 14 with throughput
# before) and a step time whose samples/s peaks at 100 with 512 the largest size (7 trials; 13 before).
BERT_LIKE = pytest.param(StepTimeOracle(fixed=0.05, per_sample=1 / 430, knee=128, crowded=0.003), 256, 2, id="bert")
PEAK_100 = pytest.param(StepTimeOracle(knee=100), 512, 8, id="peak-100-of-512")


def _cold(objective: str | None, times: StepTimeOracle, n: int, init_val: int) -> RetuneEvent:
    pl.seed_everything(0)
    clock = FakeClock()
    # memory for every size up to n: the search for what fits stops at the dataset's length, never failing
    model = TimedModel(clock, times, batch_size=8, oracle=roomy_oracle(8_000_000), head_only_optimizer=True, n=n)
    finder = ScheduledBatchSizeFinder(_schedule(objective, init_val=init_val), verbose=False, clock=clock)
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        limit_train_batches=2,
    )
    trainer.fit(model)
    (event,) = finder.history
    return event


@pytest.mark.parametrize(("times", "n", "init_val"), [BERT_LIKE, PEAK_100])
def test_throughput_costs_at_most_one_and_a_half_times_the_trials_of_largest(
    times: StepTimeOracle, n: int, init_val: int
) -> None:
    plain = _cold(None, times, n, init_val)
    fastest = _cold("throughput", times, n, init_val)
    assert plain.min_failing is None and plain.batch_size_after == n  # the cap, reached without a failure
    assert len(fastest.trials) <= 1.5 * len(plain.trials), [t.batch_size for t in fastest.trials]
    # and its choice is still the fastest size, within 5% (the sizes' rates are exact: the clock is the oracle's)
    assert _rate(times, fastest) >= 0.95 * times.best_rate(n)
