"""The ``oom`` trigger under DDP: 2 gloo ranks where only rank 1 runs out of memory.

Each run lives in a subprocess with a timeout (tests/ddp/run_ddp_oom.py), so a hang — rank 0
waiting in a collective for a rank that ran out of memory — fails the test instead of stalling CI.
The runs start together to share the cost of starting Python, torch and Lightning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "ddp" / "run_ddp_oom.py"
TIMEOUT_S = 240
RUNS = {
    "none": ["none"],
    "forward": ["forward"],
    "backward": ["backward"],
    "none_acc": ["none", "2"],
    "backward_acc": ["backward", "2"],
    "single": ["single"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    procs = {}
    for name, args in RUNS.items():
        out = tmp_path_factory.mktemp(name)
        procs[name] = (
            out,
            subprocess.Popen(
                [sys.executable, str(SCRIPT), args[0], str(out), *args[1:]],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
        )
    started = time.monotonic()
    results: dict[str, Any] = {}
    for name, (out, proc) in procs.items():
        try:
            output, _ = proc.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            output = f"TIMED OUT after {TIMEOUT_S}s (a hang)\n{output}"
        ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
        results[name] = {"returncode": proc.returncode, "output": output, "ranks": ranks}
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
    assert rank1["recoveries"] and not rank0["recoveries"]  # only rank 1 ran out of memory
    assert rank0["global_step"] == rank1["global_step"] == ref0["global_step"]
    assert _max_diff(rank0["weights"], rank1["weights"]) == 0.0  # the ranks stay identical
    assert _max_diff(rank0["weights"], ref0["weights"]) < 1e-5  # and equal a run with memory for every batch
    for rank in (rank0, rank1):  # each rank's own shard trained every sample exactly once
        assert {count for _, count in rank["trained"]} == {1}


def test_a_sample_that_fits_nowhere_stops_every_rank_without_a_hang(runs: dict[str, Any]) -> None:
    run = runs["single"]
    assert "TIMED OUT" not in run["output"]
    rank0, rank1 = _ranks(run)
    assert "one sample does not fit" in rank1["error"]
    assert "other rank(s) failed" in rank0["error"]
