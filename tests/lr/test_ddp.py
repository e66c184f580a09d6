"""ScheduledLRFinder under DDP: 2 CPU processes (gloo), each scenario in a subprocess with a timeout.

The scenarios live in tests/ddp/run_ddp_lr.py. The ranks must agree on every range test (one curve,
the mean of the ranks' losses, and one suggestion), end with identical weights, and end exactly where
a DDP run without the finder that sets the same rates by hand ends. An error on one rank inside a
range test stops both ranks instead of hanging them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist_utils import run_rank_scripts

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "ddp" / "run_ddp_lr.py"
TIMEOUT_S = 240


def _collect(results: dict[str, Any]) -> dict[str, Any]:
    runs = {}
    for scenario, (code, output, out) in results.items():
        ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
        runs[scenario] = {"returncode": code, "output": output, "ranks": ranks}
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ddp_lr")
    first = _collect(run_rank_scripts({s: [s, "{out}"] for s in ("agree", "error")}, SCRIPT, root, TIMEOUT_S))
    events = root / "agree" / "rank0.json"
    if events.exists():
        first.update(
            _collect(run_rank_scripts({"hand": ["hand", "{out}", "--events", str(events)]}, SCRIPT, root, TIMEOUT_S))
        )
    return first


def _both(run: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    assert run["returncode"] == 0, run["output"][-4000:]
    assert sorted(run["ranks"]) == [0, 1], run["output"][-4000:]
    return run["ranks"][0], run["ranks"][1]


def test_ranks_agree_on_one_curve_averaged_over_ranks(runs: dict[str, Any]) -> None:
    rank0, rank1 = _both(runs["agree"])
    strip = [{k: v for k, v in e.items() if k != "duration_s"} for e in rank0["history"]]
    assert strip == [{k: v for k, v in e.items() if k != "duration_s"} for e in rank1["history"]]
    assert [e["epoch"] for e in rank0["history"]] == [0, 1]
    first = rank0["history"][0]
    steps = len(first["losses"])
    # rank 1's loss is 3x its cross-entropy, so neither rank's own curve is the one recorded
    mean = [(a + b) / 2 for a, b in zip(rank0["raw_losses"][:steps], rank1["raw_losses"][:steps], strict=True)]
    assert first["losses"] == pytest.approx(mean, rel=1e-6)
    assert first["losses"] != pytest.approx(rank0["raw_losses"][:steps], rel=1e-3)
    assert rank0["weights_sha256"] == rank1["weights_sha256"]
    assert rank0["lrs"] == rank1["lrs"] and rank0["lrs"][0] == rank0["history"][-1]["lr_after"]


def test_no_trace_under_ddp(runs: dict[str, Any]) -> None:
    agree0, _ = _both(runs["agree"])
    hand0, hand1 = _both(runs["hand"])
    assert hand0["weights_sha256"] == hand1["weights_sha256"] == agree0["weights_sha256"]
    assert hand0["global_step"] == agree0["global_step"]


def test_an_error_on_one_rank_stops_both(runs: dict[str, Any]) -> None:
    run = runs["error"]
    assert run["returncode"] != 0
    assert "TIMED OUT" not in run["output"], run["output"][-4000:]
    assert "boom on rank 1" in run["output"]
    assert "rank 1 failed at step 5 of the learning-rate range test" in run["output"]
