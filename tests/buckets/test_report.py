"""Bucket sizes everywhere a batch size shows: summary line, table, CSV, JSON, metrics, plot, ``retune report``;
and the schedule's ``search.batching`` / ``search.buckets`` fields with their errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from retune import RetuneEvent, Trial, load_schedule
from retune.cli import main
from retune.errors import ScheduleError
from retune.reports import batch_size as report

imread = pytest.importorskip("matplotlib.image", reason="the report's plot needs matplotlib, not installed").imread


def _events() -> list[RetuneEvent]:
    common = {"stage": "train", "budget_bytes": 6 * 2**20, "mode": "buckets", "bucket_bounds": [14, 23, 32, 246]}
    return [
        RetuneEvent(
            epoch=0,
            global_step=0,
            trigger="fit_start",
            batch_size_before=8,
            batch_size_after=7,
            trials=[Trial(2, True), Trial(8, True), Trial(128, True), Trial(73, True), Trial(101, True)],
            trial_buckets=[3, 3, 0, 2, 1],
            peak_bytes=[1_000_000, 4_000_000, 3_900_000, 5_000_000, 5_100_000],
            bucket_sizes=[121, 95, 69, 7],
            bucket_samples=[128, 135, 129, 8],
            samples_per_step=66.67,
            duration_s=1.5,
            direction="cold",
            **common,  # type: ignore[arg-type]
        ),
        RetuneEvent(
            epoch=1,
            global_step=6,
            trigger="trainable_params_changed",
            batch_size_before=7,
            batch_size_after=4,
            trials=[Trial(1, True), Trial(4, True), Trial(5, True), Trial(102, True), Trial(45, True), Trial(62, True)],
            trial_buckets=[3, 3, 3, 0, 2, 1],
            peak_bytes=[1, 2, 3, 4, 5, 6],
            bucket_sizes=[96, 58, 42, 4],
            bucket_sizes_before=[121, 95, 69, 7],
            bucket_samples=[128, 135, 129, 8],
            samples_per_step=40.0,
            duration_s=1.1,
            direction="down",
            **common,  # type: ignore[arg-type]
        ),
    ]


def test_summary_table_and_metrics_show_every_bucket() -> None:
    first, second = _events()
    line = report.format_summary(second)
    assert "batch sizes per bucket 121/95/69/7 -> 96/58/42/4" in line and "samples up to 14/23/32/246" in line
    assert "6 trials" in line and "40 samples per step" in line
    table = report.format_table([first, second])
    assert "buckets of samples up to 14/23/32/246" in table
    assert "8 -> 121/95/69/7" in table and "121/95/69/7 -> 96/58/42/4" in table
    metrics = report.event_metrics(second)
    assert metrics["retune/batch_size"] == 4.0 and metrics["retune/samples_per_step"] == 40.0
    assert [metrics[f"retune/batch_size_bucket{b}"] for b in range(4)] == [96.0, 58.0, 42.0, 4.0]
    assert report.format_trial(3, 128, True, None, bucket=0) == "trial 3 bucket 0 batch_size=128: fits"
    # the chosen peak is the worst bucket's (the worst batch an epoch can produce)
    assert report.chosen_peak(first) == 5_100_000


def test_csv_json_plot_and_the_report_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = _events()
    paths = report.write_outputs(events, tmp_path, end_step=12, budget_bytes=6 * 2**20)
    rows = list(csv.DictReader(paths.csv.open()))
    assert [r["bucket_sizes"] for r in rows] == ["121/95/69/7", "96/58/42/4"]
    assert rows[0]["bucket_bounds"] == "14/23/32/246" and rows[1]["samples_per_step"] == "40"
    data = json.loads(paths.json.read_text())
    assert data["events"][1]["bucket_sizes"] == [96, 58, 42, 4]
    assert report.read_history(paths.json).events == events
    assert imread(str(paths.png)).shape[:2] == (report.PLOT_SIZE_PX[1], report.PLOT_SIZE_PX[0])
    assert report.bucket_series(events, 12)[3] == [(0, 7), (6, 4), (12, 4)]
    assert main(["report", str(paths.json), "--plot", str(tmp_path / "again.png")]) == 0
    out = capsys.readouterr().out
    assert "121/95/69/7 -> 96/58/42/4" in out


def test_events_without_bucket_fields_still_load() -> None:
    old = {
        "epoch": 0,
        "global_step": 0,
        "trigger": "fit_start",
        "stage": "train",
        "batch_size_before": 2,
        "batch_size_after": 64,
        "trials": [[2, True]],
    }
    event = RetuneEvent.from_dict(old)
    assert event.bucket_sizes == [] and "batch size 2 -> 64" in report.format_summary(event)


def test_schedule_fields() -> None:
    default = load_schedule({"triggers": [{"kind": "fit_start"}]}).search
    assert default.batching == "fixed" and default.buckets == 6
    chosen = load_schedule({"triggers": [{"kind": "fit_start"}], "search": {"batching": "buckets", "buckets": 3}})
    assert chosen.search.batching == "buckets" and chosen.search.buckets == 3
    # the fastest padded work per step, every bucket capped at it (tests/buckets/test_throughput_fit.py)
    both = load_schedule(
        {"triggers": [{"kind": "fit_start"}], "search": {"batching": "buckets", "objective": "throughput"}}
    )
    assert both.search.batching == "buckets" and both.search.objective == "throughput"


@pytest.mark.parametrize(
    ("search", "field", "text"),
    [
        ({"batching": "bucket"}, "search.batching", "'fixed' or 'buckets'"),
        ({"buckets": 1}, "search.buckets", "greater than or equal to 2"),
        ({"buckets": 2.5}, "search.buckets", "valid integer"),
        ({"buckets": "4"}, "search.buckets", "valid integer"),
        ({"batching": "buckets", "scan_limit": 100}, "search.batching", "cannot be combined with search.scan_limit"),
        ({"objective": "throughput", "batching": "buckets", "steps_per_trial": 1}, "search.objective", ">= 2, got 1"),
    ],
)
def test_bad_bucket_configuration_is_a_schedule_error_naming_the_field(
    search: dict[str, object], field: str, text: str
) -> None:
    with pytest.raises(ScheduleError) as info:
        load_schedule({"triggers": [{"kind": "fit_start"}], "search": search})
    message = str(info.value)
    assert f"{field}:" in message and text in message, message
