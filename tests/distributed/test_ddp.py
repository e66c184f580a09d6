"""DDP on CPU: 2 processes with the gloo backend, each scenario in a subprocess with a timeout.

A hang (ranks waiting on each other's collectives forever) fails the test at the timeout instead of
hanging CI. The scenarios live in tests/ddp/run_ddp.py; all three start at once to share the cost
of starting Python, torch and Lightning in six processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist_utils import run_rank_scripts

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "ddp" / "run_ddp.py"
# below the suite's per-test timeout (pyproject.toml), so that a hung scenario fails its tests with its output
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    scenarios = {scenario: [scenario, "{out}"] for scenario in ("capacity", "unfreeze", "error", "spawn")}
    results: dict[str, Any] = {}
    for scenario, (code, output, out) in run_rank_scripts(
        scenarios, SCRIPT, tmp_path_factory.mktemp("ddp"), TIMEOUT_S
    ).items():
        ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
        teardown = {int(p.stem[8:]): json.loads(p.read_text()) for p in out.glob("teardown*.json")}
        results[scenario] = {"returncode": code, "output": output, "ranks": ranks, "teardown": teardown}
    return results


def _both(run: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    assert run["returncode"] == 0, run["output"][-4000:]
    assert sorted(run["ranks"]) == [0, 1], run["output"][-4000:]
    return run["ranks"][0], run["ranks"][1]


def test_rank_dependent_capacity_agrees_on_the_smaller(runs: dict[str, Any]) -> None:
    rank0, rank1 = _both(runs["capacity"])
    smaller = min(rank0["epoch_true_max"][0], rank1["epoch_true_max"][0])
    assert rank1["epoch_true_max"][0] < rank0["epoch_true_max"][0], "rank 1 must be the smaller one"
    assert rank0["batch_size"] == rank1["batch_size"] == rank0["model_batch_size"] == rank1["model_batch_size"]
    assert 0.9 * smaller <= rank0["batch_size"] <= smaller
    # both ranks tried the same sizes and agreed on every outcome, including the sizes only rank 0 could fit
    assert [e["trials"] for e in rank0["history"]] == [e["trials"] for e in rank1["history"]]
    trials = rank0["history"][0]["trials"]
    assert any(size > smaller and not fits for size, fits in trials), "a size only rank 0 fits must fail"


def test_weights_identical_across_ranks_after_fit(runs: dict[str, Any]) -> None:
    rank0, rank1 = _both(runs["capacity"])
    assert rank0["report_written"], "rank zero writes the history and plot next to the CSV logger's files"
    assert rank0["weights_sha256"] == rank1["weights_sha256"]
    assert rank0["global_step"] == rank1["global_step"] > 0


@pytest.mark.parametrize("scenario", ["capacity", "unfreeze"])
def test_the_ddp_wrapper_is_freed_while_the_group_is_alive(runs: dict[str, Any], scenario: str) -> None:
    # a wrapper (and its reducer) that outlives destroy_process_group() destroys the group holding the
    # GIL, which can deadlock (issue 12): nothing the finder keeps may hold it past Lightning's teardown
    _both(runs[scenario])
    teardown = runs[scenario]["teardown"]
    assert sorted(teardown) == [0, 1], runs[scenario]["output"][-4000:]
    for rank in teardown.values():
        assert rank == {"wrapped": "DistributedDataParallel", "wrapper_freed": True, "group_alive": True}


def test_unfreeze_under_ddp(runs: dict[str, Any]) -> None:
    rank0, rank1 = _both(runs["unfreeze"])
    for rank in (rank0, rank1):
        assert [e["trigger"] for e in rank["history"]] == ["fit_start", "trainable_params_changed"]
    frozen0, unfrozen0 = (e["batch_size_after"] for e in rank0["history"])
    frozen1, unfrozen1 = (e["batch_size_after"] for e in rank1["history"])
    assert (frozen0, unfrozen0) == (frozen1, unfrozen1)
    true_unfrozen = rank0["epoch_true_max"][1]
    assert 0.9 * true_unfrozen <= unfrozen0 <= true_unfrozen
    # 1024 samples over 2 ranks: the frozen search is capped by the 512 samples a rank sees
    assert frozen0 <= 512
    assert max(rank0["batch_sizes_seen"][-3:]) == unfrozen0  # the unfrozen epochs ran at the agreed size


def test_a_non_memory_error_on_one_rank_ends_every_rank_with_the_error(runs: dict[str, Any]) -> None:
    run = runs["error"]
    assert "TIMED OUT" not in run["output"]
    assert run["returncode"] != 0
    assert "ValueError: boom on rank 1" in run["output"]  # the original error, from rank 1
    assert "rank 1 failed during a batch-size probe at size 64" in run["output"]  # rank 0 names it
    assert run["ranks"] == {}  # neither rank got past fit


def test_ddp_spawn_agrees_on_the_smaller_capacity(runs: dict[str, Any]) -> None:
    rank0, rank1 = _both(runs["spawn"])
    smaller = min(rank0["epoch_true_max"][0], rank1["epoch_true_max"][0])
    assert rank0["batch_size"] == rank1["batch_size"] == rank0["model_batch_size"] == rank1["model_batch_size"]
    assert 0.9 * smaller <= rank0["batch_size"] <= smaller
    assert rank0["weights_sha256"] == rank1["weights_sha256"]
    # each rank trains its own copy of the weights: pytorch-lightning < 2.1 leaves them in memory shared
    # by all spawned ranks (Lightning #17399), where one rank's probe would be another rank's snapshot
    assert rank0["weights_shared_at_fit_start"] is False and rank1["weights_shared_at_fit_start"] is False


@pytest.mark.parametrize(("strategy", "unshared"), [("ddp_spawn", True), ("ddp", False)])
def test_only_spawned_cpu_weights_are_unshared(strategy: str, unshared: bool) -> None:
    # Lightning < 2.1 leaves ddp_spawn's CPU weights shared by all ranks (#17399): the finder gives each
    # rank its own copy. Weights a user shared on purpose under another launcher are left alone.
    import torch

    from retune import compat
    from tests.helpers.lightning_ns import pl

    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)  # not launched
    model = torch.nn.Linear(4, 4)
    model.share_memory()
    weight = model.weight
    assert compat.unshare_spawned_weights(trainer, model) is unshared
    assert model.weight is weight, "the Parameter objects stay; only their storage is replaced"
    assert all(p.is_shared() is not unshared for p in model.parameters())
