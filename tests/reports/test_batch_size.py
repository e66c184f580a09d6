"""retune.reports.batch_size: history JSON/CSV round trips, the table, the PNG plot, and `retune report`."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from retune import RetuneEvent, Trial
from retune.cli import main
from retune.reports import batch_size as report
from tests.helpers.retune_warnings import retune_warnings

# skip guard: the plot checks read the PNG back (matplotlib is not in the flash stack)
imread = pytest.importorskip("matplotlib.image", reason="the report's plot needs matplotlib, not installed").imread

WIDTH, HEIGHT = report.PLOT_SIZE_PX


def _events() -> list[RetuneEvent]:
    frozen = RetuneEvent(
        epoch=0,
        global_step=0,
        trigger="fit_start",
        stage="train",
        batch_size_before=16,
        batch_size_after=110,
        trials=[Trial(64, True), Trial(128, False), Trial(96, True), Trial(116, True), Trial(117, False)],
        duration_s=0.9,
        direction="cold",
        max_fitting=116,
        min_failing=117,
    )
    unfrozen = RetuneEvent(
        epoch=3,
        global_step=21,
        trigger="trainable_params_changed",
        stage="train",
        batch_size_before=110,
        batch_size_after=31,
        trials=[Trial(116, False), Trial(58, False), Trial(29, True), Trial(33, True), Trial(34, False)],
        duration_s=0.25,
        direction="down",
        max_fitting=33,
        min_failing=34,
    )
    return [frozen, unfrozen]


def _with_peaks(event: RetuneEvent, peaks: list[int | None]) -> RetuneEvent:
    return RetuneEvent.from_dict({**event.to_dict(), "peak_bytes": peaks})


def _png_shape(path: Path) -> tuple[int, ...]:
    image = imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4), image.shape
    assert image.std() > 0.05, "the image is blank"
    return tuple(image.shape[:2])


# -- files -------------------------------------------------------------------------------------


def test_write_outputs_round_trip(tmp_path: Path) -> None:
    events = _events()
    steps = [(0, 110), (1, 110), (21, 31), (22, 31)]
    memory = [(0, 1_900_000), (21, 1_950_000)]
    paths = report.write_outputs(
        events, tmp_path / "out", steps=steps, memory=memory, budget_bytes=2 * 2**20, end_step=40, meta={"seed": 0}
    )
    assert paths.json == tmp_path / "out" / "history.json"
    assert paths.csv == tmp_path / "out" / "history.csv"
    assert paths.png == tmp_path / "out" / "batch_size.png"

    back = report.read_history(paths.json)
    assert back.events == events
    assert back.steps == steps
    assert back.memory == memory
    assert back.budget_bytes == 2 * 2**20
    assert back.end_step == 40
    assert back.meta == {"seed": 0}
    assert json.loads(paths.json.read_text())["version"] == report.FORMAT_VERSION

    with paths.csv.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["trigger"] for r in rows] == ["fit_start", "trainable_params_changed"]
    assert [(int(r["batch_size_before"]), int(r["batch_size_after"])) for r in rows] == [(16, 110), (110, 31)]
    assert [int(r["trials"]) for r in rows] == [5, 5]
    assert rows[1]["trial_sizes"] == "116:fail 58:fail 29:fit 33:fit 34:fail"
    assert rows[0]["peak_bytes"] == ""  # nothing measured

    assert _png_shape(paths.png) == (HEIGHT, WIDTH)


def test_write_outputs_overwrites(tmp_path: Path) -> None:
    report.write_outputs(_events(), tmp_path, plot=False)
    paths = report.write_outputs(_events()[:1], tmp_path, plot=False)
    assert paths.png is None
    assert len(report.read_history(paths.json).events) == 1


def test_bare_list_of_events_is_read(tmp_path: Path) -> None:
    path = tmp_path / "events.json"
    path.write_text(json.dumps([e.to_dict() for e in _events()]))
    assert report.read_history(path).events == _events()


def test_unknown_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"version": 99, "events": []}))
    with pytest.raises(ValueError, match="version 99"):
        report.read_history(path)


def test_plot_without_matplotlib_is_skipped_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import raise ImportError
    with retune_warnings() as said:
        paths = report.write_outputs(_events(), tmp_path)
    assert paths.png is None
    assert paths.json.exists() and paths.csv.exists()
    assert not (tmp_path / report.PNG_NAME).exists()
    assert len(said) == 1 and "matplotlib" in said[0], said


# -- the plot ----------------------------------------------------------------------------------


@pytest.mark.parametrize("with_memory", [False, True], ids=["sizes-only", "with-memory"])
def test_plot_is_a_png_of_the_fixed_size(tmp_path: Path, with_memory: bool) -> None:
    events = _events()
    if with_memory:
        events = [_with_peaks(events[0], [900_000, None, 1_500_000, 1_800_000, None]), events[1]]
    path = report.plot_history(tmp_path / "plot.png", report.History(events=events, end_step=50))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _png_shape(path) == (HEIGHT, WIDTH)


def test_plot_of_no_events(tmp_path: Path) -> None:
    path = report.plot_history(tmp_path / "empty.png", [])
    assert _png_shape(path) == (HEIGHT, WIDTH)


def test_batch_size_series_from_events() -> None:
    assert report.batch_size_series(_events(), end_step=40) == [(0, 110), (21, 31), (40, 31)]
    assert report.batch_size_series(_events()) == [(0, 110), (21, 31)]
    assert report.batch_size_series([]) == []


def test_chosen_peak() -> None:
    frozen = _events()[0]
    assert report.chosen_peak(frozen) is None
    # 110 was applied (116 less the margin) without being probed: the peak at 116 bounds it
    with_peaks = _with_peaks(frozen, [900_000, None, 1_500_000, 1_800_000, None])
    assert report.chosen_peak(with_peaks) == 1_800_000
    assert report.trial_peaks(with_peaks) == [900_000, None, 1_500_000, 1_800_000, None]


# -- console lines and metrics -----------------------------------------------------------------


def test_table() -> None:
    table = report.format_table(_events())
    lines = table.splitlines()
    assert lines[0] == "retune: 2 searches"
    assert lines[1].split() == ["epoch", "step", "trigger", "batch", "size", "trials", "seconds"]
    assert lines[3].split() == ["0", "0", "fit_start", "16", "->", "110", "5", "0.90"]
    assert lines[4].split() == ["3", "21", "trainable_params_changed", "110", "->", "31", "5", "0.25"]
    # columns line up
    assert len({len(line) for line in lines[1:3]}) == 1


def test_table_peak_column_only_when_measured() -> None:
    events = _events()
    events[1] = _with_peaks(events[1], [None, None, 1_000_000, 1_900_000, None])
    table = report.format_table(events)
    assert table.splitlines()[1].split()[-1] == "peak"
    assert table.splitlines()[4].endswith("1.8 MiB")
    assert table.splitlines()[3].endswith("-")


def test_other_stages() -> None:
    frozen, unfrozen = _events()
    val = RetuneEvent.from_dict({**unfrozen.to_dict(), "stage": "val", "batch_size_after": 512, "global_step": 21})
    events = [frozen, unfrozen, val]
    lines = report.format_table(events).splitlines()
    assert lines[1].split()[3] == "stage"
    assert [line.split()[3] for line in lines[3:]] == ["train", "train", "val"]
    # the plotted series is the train size over training steps
    assert report.batch_size_series(events, end_step=30) == [(0, 110), (21, 31), (30, 31)]
    assert report.event_metrics(val) == {
        "retune/val_batch_size": 512.0,
        "retune/val_search_seconds": 0.25,
        "retune/val_trials": 5.0,
    }


def test_table_of_no_events() -> None:
    assert report.format_table([]) == "retune: 0 searches (the schedule's triggers never fired)"


def test_lines_and_metrics() -> None:
    frozen, unfrozen = _events()
    assert report.format_trial(3, 128, False) == "trial 3 batch_size=128: does not fit"
    assert report.format_trial(1, 64, True, 1536 * 1024) == "trial 1 batch_size=64: fits, peak 1.5 MiB"
    assert report.format_summary(unfrozen) == (
        "epoch 3: train batch size 110 -> 31 (5 trials, 0.25s, trigger trainable_params_changed)"
    )
    assert report.format_summary(unfrozen, where="validate start").startswith("validate start: train batch size")
    assert report.event_metrics(frozen) == {
        "retune/batch_size": 110.0,
        "retune/search_seconds": 0.9,
        "retune/trials": 5.0,
    }
    assert report.format_bytes(512) == "512 B"
    assert report.format_bytes(3 * 2**30) == "3.0 GiB"


# -- `retune report` ---------------------------------------------------------------------------


def test_cli_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = report.write_outputs(_events(), tmp_path, plot=False)
    assert main(["report", str(paths.json)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(report.format_table(_events()) + "\n")
    png = tmp_path / report.PNG_NAME  # the run's own plot, re-rendered
    assert f"plot: {png}" in out
    assert _png_shape(png) == (HEIGHT, WIDTH)

    other = tmp_path / "elsewhere" / "p.png"
    assert main(["report", str(paths.json), "--plot", str(other)]) == 0
    assert other.exists()


def test_cli_report_table_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = report.write_outputs(_events(), tmp_path, plot=False)
    assert main(["report", str(paths.json), "--no-plot"]) == 0
    assert capsys.readouterr().out == report.format_table(_events()) + "\n"
    assert not (tmp_path / report.PNG_NAME).exists()


@pytest.mark.parametrize(
    "content",
    [None, "{not json", '"a string"', '{"hello": "world"}', '{"triggers": [{"kind": "fit_start"}]}'],
    ids=["missing", "bad-json", "not-history", "an-object", "a-schedule"],
)
def test_cli_report_bad_file(tmp_path: Path, content: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "history.json"
    if content is not None:
        path.write_text(content)
    assert main(["report", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"error: {path}: cannot read a retune history")
    assert not (tmp_path / report.PNG_NAME).exists()  # nothing written beside a file that is not a history
    if content and content.startswith('{"'):
        assert "no 'events' list" in err and ("schedule" in err) == ("triggers" in content)


def test_cli_report_as_a_process(tmp_path: Path) -> None:
    paths = report.write_outputs(_events(), tmp_path, plot=False)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "TkAgg"}  # a GUI backend must not matter
    proc = subprocess.run(
        [sys.executable, "-m", "retune", "report", str(paths.json)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "trainable_params_changed" in proc.stdout
    assert _png_shape(tmp_path / report.PNG_NAME) == (HEIGHT, WIDTH)
