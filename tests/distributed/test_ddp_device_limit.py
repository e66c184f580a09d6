"""No ``memory.budget`` under DDP: every rank searches against the smallest rank's device limit (issue 29 review).

Each rank's limit is what its own device's caching allocator lets it have, and free memory differs between GPUs
by a few MiB. Read per rank, the limits gave the ranks different probe verdicts, predicted sizes, numbers of
traces (so of collectives: a hang) and bucket bounds. 2 gloo processes per scenario (tests/ddp/run_ddp_device_limit.py),
on a caching allocator simulated on the CPU that gives rank 1 less than rank 0; both scenarios start at once, each
in a subprocess killed at the timeout, so a hang fails the test instead of hanging it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.ddp.run_ddp_device_limit import LIMITS
from tests.helpers.dist_utils import run_rank_scripts

SCRIPT = Path(__file__).resolve().parents[1] / "ddp" / "run_ddp_device_limit.py"
TIMEOUT_S = 120  # a run takes ~10 s; the code before the fix hung here


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    scenarios = {scenario: [scenario, "{out}"] for scenario in ("fixed", "buckets")}
    results: dict[str, list[dict[str, Any]]] = {}
    for scenario, (code, output, out) in run_rank_scripts(
        scenarios, SCRIPT, tmp_path_factory.mktemp("ddp_device_limit"), TIMEOUT_S
    ).items():
        assert code == 0, output[-4000:]
        results[scenario] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return results


def _agreed(ranks: list[dict[str, Any]], smallest: int) -> None:
    zero, one = ranks
    for rank in ranks:  # every limit either rank's search read: the smaller rank's
        assert rank["limits"]["prober"] and set(rank["limits"]["prober"]) == {smallest}, rank["limits"]
        assert rank["limits"]["search"] == [smallest], rank["limits"]
    assert zero["prediction"] == one["prediction"] == "predicted"
    assert zero["trials"] == one["trials"] and zero["peaks"] == one["peaks"]
    assert all(fits == (peak <= smallest) for (_, fits), peak in zip(zero["trials"], zero["peaks"], strict=True))


def test_a_fixed_search_without_a_budget_takes_the_smallest_ranks_limit_on_every_rank(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    zero, one = runs["fixed"]
    smallest = min(LIMITS["fixed"].values())
    _agreed([zero, one], smallest)
    assert zero["batch_size"] == one["batch_size"] == 665  # rank 0's own limit alone fits 725
    assert [665, True] in zero["trials"]


def test_bucket_bounds_and_sizes_without_a_budget_are_the_same_on_every_rank(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    zero, one = runs["buckets"]
    smallest = min(LIMITS["buckets"].values())
    _agreed([zero, one], smallest)
    assert zero["by_steps"] and one["by_steps"], "the bounds were cut by steps, against the limit"
    assert zero["bucket_bounds"] == one["bucket_bounds"] == [32, 866, 1187]  # rank 0's limit alone cuts at 943
    assert zero["bucket_sizes"] == one["bucket_sizes"]
    assert zero["batch_size"] == one["batch_size"]
