"""The `retune` command, in-process (retune.cli.main) and as a real process (python -m retune, console script)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from retune import __version__, load_schedule
from retune.cli import main

HERE = Path(__file__).resolve().parents[1]
SCHEDULES = HERE.parent / "schedules"
GOOD = sorted(p for p in SCHEDULES.iterdir() if not p.name.startswith("."))
BAD_DIR = HERE / "schedules_bad"
BAD = BAD_DIR / "epoch_at_negative.yaml"
BAD_MESSAGE = f"error: {BAD}: triggers[1].at[1]: Input should be greater than or equal to 0 (got -1)"
# fit_start.yaml does not set warm_start; `show` must print the default.
NO_WARM_START = SCHEDULES / "fit_start.yaml"

# Loading this file currently escapes as a TypeError (see test_schedule_errors.py).


def _ok_line(path: Path) -> str:
    schedule = load_schedule(path)
    kinds = "+".join(t.kind for t in schedule.triggers)
    return f"OK {path} (mode={schedule.search.mode}, triggers={kinds})"


def _run(*args: str, exe: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = (exe or [sys.executable, "-m", "retune"]) + list(args)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=HERE, check=False)


def test_good_schedules_exist() -> None:
    assert len(GOOD) >= 6


# -- in-process ---------------------------------------------------------------------------------


def test_validate_good_files(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", *map(str, GOOD)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [_ok_line(p) for p in GOOD]
    assert err == ""


def test_validate_reports_bad_and_keeps_going(capsys: pytest.CaptureFixture[str]) -> None:
    good = SCHEDULES / "freeze_unfreeze.yaml"
    assert main(["validate", str(BAD), str(good)]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [_ok_line(good)]
    assert err.splitlines() == [BAD_MESSAGE]


def _bad_entries() -> list[object]:
    return [
        pytest.param(
            p,
            id=p.name,
        )
        for p in sorted(BAD_DIR.iterdir())
    ]


@pytest.mark.parametrize("path", _bad_entries())
def test_validate_every_bad_file_fails_cleanly(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"error: {path}: ")


def test_validate_needs_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["validate"])
    assert info.value.code == 2
    assert "FILE" in capsys.readouterr().err


def test_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "properties" in schema
    assert "triggers" in schema["properties"]
    assert schema["required"] == ["triggers"]


def test_show_yaml_fills_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert "warm_start" not in NO_WARM_START.read_text(encoding="utf-8")
    assert main(["show", str(NO_WARM_START)]) == 0
    out = capsys.readouterr().out
    assert "warm_start: true" in out
    assert "budget: null" in out
    data = yaml.safe_load(out)
    assert data == load_schedule(NO_WARM_START).model_dump(mode="json")
    assert list(data) == [
        "version",
        "batch_arg_name",
        "search",
        "memory",
        "triggers",
        "apply",
        "lr_find",
        "stages",
        "stage_batch_arg_names",
    ]
    assert load_schedule(data) == load_schedule(NO_WARM_START)


def test_show_json(capsys: pytest.CaptureFixture[str]) -> None:
    path = SCHEDULES / "unfreeze_milestones.yaml"
    assert main(["show", str(path), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == load_schedule(path).model_dump(mode="json")
    assert data["search"]["warm_start"] is True
    assert data["triggers"][1] == {"kind": "epoch", "at": [5, 10], "every": None}


def test_show_bad_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(BAD)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [BAD_MESSAGE]


def test_show_rejects_unknown_format(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["show", str(NO_WARM_START), "--format", "xml"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"retune {__version__}\n"


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "usage: retune" in capsys.readouterr().err


# -- as a process -------------------------------------------------------------------------------


def test_process_validate_good_files() -> None:
    proc = _run("validate", *map(str, GOOD))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [_ok_line(p) for p in GOOD]
    assert proc.stderr == ""


def test_process_validate_good_and_bad() -> None:
    good = SCHEDULES / "every_n_epochs.yaml"
    proc = _run("validate", str(good), str(BAD))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [_ok_line(good)]
    assert proc.stderr.splitlines() == [BAD_MESSAGE]
    assert "Traceback" not in proc.stderr


def test_process_schema() -> None:
    proc = _run("schema")
    assert proc.returncode == 0, proc.stderr
    assert "properties" in json.loads(proc.stdout)


def test_process_show() -> None:
    proc = _run("show", str(NO_WARM_START))
    assert proc.returncode == 0, proc.stderr
    assert "warm_start: true" in proc.stdout
    assert yaml.safe_load(proc.stdout) == load_schedule(NO_WARM_START).model_dump(mode="json")

    proc = _run("show", "--format", "json", str(NO_WARM_START))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["search"]["warm_start"] is True


def test_process_show_bad_file() -> None:
    proc = _run("show", str(BAD))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [BAD_MESSAGE]
    assert "Traceback" not in proc.stderr


def test_process_version() -> None:
    proc = _run("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"retune {__version__}"


def test_console_script() -> None:
    # The script installed next to this interpreter (the venv's bin/), whether or not the venv is activated.
    bin_dir = str(Path(sys.executable).parent)
    script = shutil.which("retune", path=bin_dir)
    assert script is not None, f"no `retune` console script in {bin_dir}; is retune installed in this environment?"

    proc = _run("--version", exe=[script])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"retune {__version__}"

    good = SCHEDULES / "fit_start.yaml"
    proc = _run("validate", str(good), str(BAD), exe=[script])
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [_ok_line(good)]
    assert proc.stderr.splitlines() == [BAD_MESSAGE]


# -- `retune report`: bad paths and bad histories ------------------------------------------------


def _history(folder: Path) -> Path:
    from retune.events import RetuneEvent, Trial
    from retune.reports import batch_size as report

    event = RetuneEvent(
        epoch=0,
        global_step=0,
        trigger="fit_start",
        stage="train",
        batch_size_before=2,
        batch_size_after=60,
        trials=[Trial(2, True), Trial(64, True), Trial(128, False)],
    )
    return report.write_json(folder / "history.json", report.History(events=[event]))


def test_report_plot_to_a_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    history = _history(tmp_path)
    folder = tmp_path / "plots"
    folder.mkdir()
    assert main(["report", str(history), "--plot", str(folder)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"error: --plot: {str(folder)!r} is a folder; give the PNG's file name, such as "
        f"{str(folder / 'batch_size.png')!r}\n"
    )


def test_report_plot_under_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    history = _history(tmp_path)
    png = history / "p.png"  # a "folder" that is the history file itself
    assert main(["report", str(history), "--plot", str(png)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"error: --plot: {str(history)!r} is a file, not a folder (in {str(png)!r})\n"


def test_report_unwritable_default_plot_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    history = _history(tmp_path)
    (tmp_path / "batch_size.png").mkdir()  # where the plot goes by default
    assert main(["report", str(history)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write the plot to {str(tmp_path / 'batch_size.png')!r}: ")
    assert err.count("\n") == 1


def test_report_plot_and_no_plot_are_exclusive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    history = _history(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["report", str(history), "--no-plot", "--plot", str(tmp_path / "p.png")])
    assert info.value.code == 2
    assert "argument --plot: not allowed with argument --no-plot" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("content", ["[]", '{"version": 1, "events": []}'], ids=["bare-list", "object"])
def test_report_with_no_events_writes_no_plot(tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "history.json"
    path.write_text(content)
    assert main(["report", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: no events in this history: nothing to tabulate or plot\n"
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (
            '[{"x": 1}]',
            "history: events[0] is not a retune event: missing epoch, global_step, trigger, stage, "
            "batch_size_before, batch_size_after; unknown key 'x'",
        ),
        (
            '{"version": 1, "events": [{"epoch": 0}]}',
            "history: events[0] is not a retune event: missing global_step, trigger, stage, batch_size_before, "
            "batch_size_after",
        ),
        ("[1]", "history: events[0] is 1, not an object of an event's fields"),
        (
            '{"kind": "lr_find", "version": 1, "events": [{"epoch": 0, "y": 2, "z": 3}]}',
            "learning-rate history: events[0] is not a retune event: missing global_step, trigger, groups, "
            "lrs_before, lr_after, method; unknown keys 'y', 'z'",
        ),
    ],
    ids=["unknown-key", "missing-keys", "not-an-object", "lr-history"],
)
def test_report_names_what_a_bad_event_lacks(
    tmp_path: Path, content: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "history.json"
    path.write_text(content)
    assert main(["report", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"error: {path}: cannot read a retune {problem}\n"
    assert list(tmp_path.iterdir()) == [path]
