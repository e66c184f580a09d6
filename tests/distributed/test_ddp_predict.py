"""``search.predict: auto`` under DDP on CPU: 2 gloo processes per scenario, each in a subprocess with a timeout.

The scenarios live in tests/ddp/run_ddp_predict.py; all three start at once. Budgets on the CPU tracker, no
OOM oracle: a probe fails only by measuring over the budget, on the rank that needs more. A hang (one rank
in a collective the other never calls: a trace that fails on one rank only) fails the test at the timeout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist_utils import run_rank_scripts

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "ddp" / "run_ddp_predict.py"
TIMEOUT_S = 240  # below the suite's per-test timeout (pyproject.toml): a hung scenario fails with its output


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    scenarios = {scenario: [scenario, "{out}"] for scenario in ("agree", "fallback", "off", "retune", "tags")}
    results: dict[str, Any] = {}
    for scenario, (code, output, out) in run_rank_scripts(
        scenarios, SCRIPT, tmp_path_factory.mktemp("ddp_predict"), TIMEOUT_S
    ).items():
        assert code == 0, output[-4000:]
        ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
        assert sorted(ranks) == [0, 1], output[-4000:]
        results[scenario] = ranks
    return results


def test_ranks_agree_on_every_traced_and_probed_size_and_every_size_is_verified(runs: dict[str, Any]) -> None:
    zero, one = runs["agree"][0], runs["agree"][1]
    assert zero["prediction"] == one["prediction"] == "predicted" and zero["note"] == ""
    assert zero["trials"] == one["trials"], "the ranks took the same sizes and the same decisions"
    assert zero["predicted"] == one["predicted"], "the agreed prediction: the larger rank's"
    assert zero["peaks"] == one["peaks"], "the agreed peak: the larger rank's"
    size = zero["batch_size"]
    assert size == one["batch_size"] and [size, True] in zero["trials"], "the size used was probed and fit"
    assert all(seen <= size for rank in (zero, one) for seen in rank["seen"]) and size in zero["seen"]
    # rank 0 alone fits its whole shard (512 samples: WideMLP fits 725 in 4 MiB); rank 1 needs more per sample,
    # so the agreed prediction and the size used are rank 1's
    assert size < 512, zero
    assert all(fits == (peak <= 4 << 20) for (_, fits), peak in zip(zero["trials"], zero["peaks"], strict=True) if peak)


def test_a_trace_that_fails_on_one_rank_falls_back_on_every_rank_without_a_hang(runs: dict[str, Any]) -> None:
    zero, one, off = runs["fallback"][0], runs["fallback"][1], runs["off"][0]
    assert zero["prediction"] == one["prediction"] == "probed"
    assert "nonzero" in zero["note"] and zero["note"] == one["note"], "rank 0 says rank 1's reason"
    assert zero["predicted"] == one["predicted"] == []
    assert zero["trials"] == one["trials"] == off["trials"], "the sizes the search finds without predict"
    assert zero["batch_size"] == one["batch_size"] == off["batch_size"]


def test_a_re_tune_under_ddp_traces_once_and_replays_with_the_ranks_agreeing(runs: dict[str, Any]) -> None:
    """Each rank records its own trace at the same tag size and replays it; the ranks agree on every replayed
    prediction (the larger rank's), take the same sizes, and the re-tune traces one size."""
    zero, one = runs["retune"][0], runs["retune"][1]
    assert zero["traced"] == one["traced"] and len(zero["traced"]) == 2, zero["traced"]
    first, again = zero["traced"]
    assert len(first) == 2 and again == [first[0]]  # the tag size, then one size checked; then the tag alone
    assert zero["later"] == one["later"] and len(zero["later"]) == 1
    assert zero["later"][0]["predicted"] and zero["later"][0]["size"] == zero["batch_size"] == one["batch_size"]
    assert zero["trials"] == one["trials"] and zero["predicted"] == one["predicted"]


def test_ranks_that_would_record_at_different_tag_sizes_record_nothing_and_do_not_hang(runs: dict[str, Any]) -> None:
    zero, one = runs["tags"][0], runs["tags"][1]
    assert zero["traced"] == one["traced"] and zero["traced"][0][0] == 512, zero["traced"]  # at the cap: no tag
    assert all(len(sizes) >= 2 for sizes in zero["traced"])  # every size traced, in both searches
    assert zero["later"] == one["later"] and zero["prediction"] == one["prediction"] == "predicted"
    assert zero["batch_size"] == one["batch_size"]
