"""Each retune warning is printed exactly once, where Lightning users look (issue 20).

Before, a warning went to the ``retune`` logger, which nobody configured, so Python's last-resort
handler printed it, and then again as a ``[retune]`` line. The scenarios run a user's script in a
subprocess (tests/ddp/run_messages.py) with Python's warning filters at their defaults, and count
each message in everything the process printed. All four start at once to share the start-up cost.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retune import RetuneWarning, messages
from tests.helpers.dist_utils import kill_session
from tests.helpers.retune_warnings import retune_warnings

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "ddp" / "run_messages.py"
TIMEOUT_S = 240
SCENARIOS = ("plain", "quiet", "logging", "ddp")
PLACES = "is set in"  # the duplicate batch-size attribute warning
SHARED = "validation and training share `batch_size`"
TRIAL = "trial 1 batch_size=8"


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(SCRIPT), name],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for name in SCENARIOS
    }
    started, results = time.monotonic(), {}
    for name, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            kill_session(proc)
            output, _ = proc.communicate(timeout=30)
            output = f"TIMED OUT after {TIMEOUT_S}s\n{output}"
        kill_session(proc)
        assert proc.returncode == 0, f"{name}:\n{output[-4000:]}"
        results[name] = output
    return results


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_warning_is_printed_exactly_once(outputs: dict[str, str], scenario: str) -> None:
    output = outputs[scenario]
    assert "RESULT batch_size=16" in output, output[-3000:]
    assert output.count(PLACES) == 1, output
    assert output.count(SHARED) == 1, output
    assert output.count("RetuneWarning") == 2, output  # shown as Python shows warnings, as Lightning's are


def test_warnings_name_the_users_line_not_retunes(outputs: dict[str, str]) -> None:
    """Attributed to the script's ``trainer.fit`` call, so the source line shown under it is the user's."""
    lines = outputs["plain"].splitlines()
    warning_lines = [i for i, line in enumerate(lines) if "RetuneWarning" in line]
    assert all("run_messages.py" in lines[i] for i in warning_lines), lines
    assert all(lines[i + 1].strip() == "trainer.fit(Model())" for i in warning_lines), lines


@pytest.mark.parametrize(("scenario", "trial_lines"), [("plain", 1), ("quiet", 0), ("logging", 1), ("ddp", 1)])
def test_progress_lines_follow_verbose_and_print_on_rank_zero_only(
    outputs: dict[str, str], scenario: str, trial_lines: int
) -> None:
    assert outputs[scenario].count(TRIAL) == trial_lines, outputs[scenario]


def test_other_ranks_print_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        messages.set_rank(1)
        with retune_warnings() as said:
            messages.warn("from rank one")
            messages.progress("from rank one")
        assert said == [] and capsys.readouterr().err == ""
    finally:
        messages.set_rank(0)
    with retune_warnings() as said:
        messages.warn("from rank zero")
    assert said == ["from rank zero"]
    assert issubclass(RetuneWarning, UserWarning)
