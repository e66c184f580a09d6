"""Schedule mistakes that `retune validate` used to pass and the callback refused or ignored (issue 28, point 8).

Each is now the same located ``ScheduleError`` from ``retune validate`` and from
``ScheduledBatchSizeFinder``: a dotted path that does not resolve, ``loss_items`` that the trigger's
``loss_reduction`` would ignore, ``min_fraction: 5`` (a percentage), and a quoted budget.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from retune import RetuneError, ScheduledBatchSizeFinder, ScheduleError
from retune.cli import main

BAD = Path(__file__).resolve().parents[1] / "schedules_bad"
GAPS = [
    "sample_size_not_importable.yaml",
    "sample_size_not_a_function.yaml",
    "loss_items_not_importable.json",
    "loss_items_with_mean.yaml",
    "min_fraction_percent.yaml",
    "budget_quoted_above_one.yaml",
]


@pytest.mark.parametrize("name", GAPS)
def test_validate_and_the_callback_refuse_alike(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = BAD / name
    assert main(["validate", str(path)]) == 1
    validate_error = capsys.readouterr().err.strip()
    with pytest.raises(ScheduleError) as info:
        ScheduledBatchSizeFinder(path, verbose=False)
    assert validate_error == f"error: {info.value}"
    assert str(info.value).startswith(f"{path}: ")


def test_the_callback_refuses_a_loss_items_argument_nothing_would_use() -> None:
    count = lambda batch: 1  # noqa: E731
    with pytest.raises(RetuneError, match=r"loss_reduction is 'mean'; set `loss_reduction: token_mean`"):
        ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, loss_items=count)
    with pytest.raises(RetuneError, match=r"the schedule has no oom trigger"):
        ScheduledBatchSizeFinder({"triggers": [{"kind": "fit_start"}]}, verbose=False, loss_items=count)
    finder = ScheduledBatchSizeFinder(
        {"triggers": [{"kind": "oom", "loss_reduction": "token_mean"}]}, verbose=False, loss_items=count
    )
    assert finder._recovery is not None and finder._recovery.items_fn is count


def test_validate_imports_a_module_beside_the_schedule_from_the_console_script(tmp_path: Path) -> None:
    """The console script's own import path is its bin folder; a module in the working directory (where the
    training script runs from) must resolve as it will at fit time."""
    (tmp_path / "mysizes_28.py").write_text("def tokens(sample):\n    return len(sample)\n", encoding="utf-8")
    schedule = tmp_path / "s.yaml"
    schedule.write_text(
        "search:\n  probe_samples: largest\n  sample_size: mysizes_28.tokens\ntriggers:\n  - kind: fit_start\n",
        encoding="utf-8",
    )
    code = "import sys; from retune.cli import main; sys.path.pop(0); sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # this checkout's retune, not the cwd
    run = [sys.executable, "-c", code, "validate", "s.yaml"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK s.yaml")
