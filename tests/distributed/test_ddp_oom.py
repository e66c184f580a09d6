"""The ``oom`` trigger under DDP: 2 gloo ranks where only rank 1 runs out of memory.

Each run lives in a subprocess with a timeout (tests/ddp/run_ddp_oom.py), so a hang — rank 0
waiting in a collective for a rank that ran out of memory — fails the test instead of stalling CI.
The runs start together to share the cost of starting Python, torch and Lightning.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist_utils import run_rank_scripts

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "ddp" / "run_ddp_oom.py"
TIMEOUT_S = 240  # below the suite's per-test timeout, so a hang fails these tests with the runs' output
RUNS = {
    "none": ["none", "{out}"],
    "forward": ["forward", "{out}"],
    "backward": ["backward", "{out}"],
    "none_acc": ["none", "{out}", "2"],
    "backward_acc": ["backward", "{out}", "2"],
    "single": ["single", "{out}"],
    "token_none": ["token_none", "{out}"],
    "token": ["token", "{out}"],
    "inexact": ["inexact", "{out}"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    results = {}
    for name, (code, output, out) in run_rank_scripts(
        RUNS, SCRIPT, tmp_path_factory.mktemp("ddp_oom"), TIMEOUT_S
    ).items():
        ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
        results[name] = {"returncode": code, "output": output, "ranks": ranks}
    return results


def _ranks(run: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    assert sorted(run["ranks"]) == [0, 1], run["output"][-4000:]
    return run["ranks"][0], run["ranks"][1]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


@pytest.mark.parametrize(
    ("name", "reference"), [("forward", "none"), ("backward", "none"), ("backward_acc", "none_acc")]
)
def test_only_rank_one_runs_out_of_memory_and_every_rank_ends_equal(
    runs: dict[str, Any], name: str, reference: str
) -> None:
    rank0, rank1 = _ranks(runs[name])
    ref0, _ = _ranks(runs[reference])
    assert runs[name]["returncode"] == 0, runs[name]["output"][-4000:]
    assert "error" not in rank0 and "error" not in rank1
    assert rank1["recoveries"]  # only rank 1 ran out of memory; rank 0 learns each recovery in the step's agreement
    assert rank0["recoveries"] == rank1["recoveries"]
    assert all(e["note"].startswith("rank 1: ") for e in rank0["recoveries"])
    assert rank0["global_step"] == rank1["global_step"] == ref0["global_step"]
    assert _max_diff(rank0["weights"], rank1["weights"]) == 0.0  # the ranks stay identical
    assert _max_diff(rank0["weights"], ref0["weights"]) < 1e-5  # and equal a run with memory for every batch
    for rank in (rank0, rank1):  # each rank's own shard trained every sample exactly once
        assert {count for _, count in rank["trained"]} == {1}
        # retune's gradient sync let go of the DDP wrapper before the group is destroyed (no teardown deadlock)
        assert rank["wrapper_freed"] and rank["group_alive"]


def test_a_sample_that_fits_nowhere_stops_every_rank_without_a_hang(runs: dict[str, Any]) -> None:
    run = runs["single"]
    assert "TIMED OUT" not in run["output"]
    rank0, rank1 = _ranks(run)
    assert "one sample does not fit" in rank1["error"]
    assert "other rank(s) failed" in rank0["error"]


def test_an_inexact_loss_on_one_rank_is_refused_on_every_rank_before_training(runs: dict[str, Any]) -> None:
    """The fit-start exactness check (retune/recovery/exactness.py) runs on each rank's own batch; the ranks
    agree on the verdict, so rank 0, whose own loss is exact, stops with rank 1's diagnosis instead of training
    on while rank 1 stops (which would leave it waiting in the gradient all-reduce)."""
    run = runs["inexact"]
    assert "TIMED OUT" not in run["output"]
    rank0, rank1 = _ranks(run)
    for rank in (rank0, rank1):
        assert "RetuneError" in rank["error"] and "of rank 1" in rank["error"], rank["error"]
        assert "`loss_reduction: sum`" in rank["error"]
        assert rank["global_step"] == 0 and not rank["trained"]


def test_token_mean_step_logs_and_outputs_under_ddp_equal_the_run_with_memory(runs: dict[str, Any]) -> None:
    """Rank 1 splits its batches of a token-mean loss; the step-level loss is logged with ``sync_dist=True`` (one
    collective per step on every rank, as without an OOM), and a ReduceLROnPlateau monitors it per step."""
    rank0, rank1 = _ranks(runs["token"])
    ref0, ref1 = _ranks(runs["token_none"])
    assert runs["token"]["returncode"] == 0, runs["token"]["output"][-4000:]
    assert "error" not in rank0 and "error" not in rank1, rank1.get("traceback", rank0.get("traceback"))
    assert rank1["recoveries"] and all(e["note"].startswith("rank 1: ") for e in rank0["recoveries"])
    assert rank0["global_step"] == rank1["global_step"] == ref0["global_step"]
    assert _max_diff(rank0["weights"], rank1["weights"]) == 0.0
    assert _max_diff(rank0["weights"], ref0["weights"]) < 1e-5
    for got, ref in ((rank0, ref0), (rank1, ref1)):
        assert got["step_losses"] == pytest.approx(ref["step_losses"], abs=1e-5)
        assert got["lrs"] == ref["lrs"]
        assert all(rows == size for rows, size in got["output_rows"])
    assert {count for _, count in rank1["trained"]} == {1}
