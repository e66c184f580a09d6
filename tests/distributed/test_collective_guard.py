"""CollectiveGuard: a rank that fails anywhere in a guarded region never leaves another one waiting.

2 gloo processes in a subprocess with a timeout (tests/fsdp2/run_guard.py): a hang fails the test.
The failures are the real ``torch.OutOfMemoryError``, raised by an oracle before the k-th collective,
in regions of ``torch.distributed`` collectives and in regions of DTensor's functional collectives
(``full_tensor``, ``clip_grad_norm_`` over sharded gradients).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist_utils import run_rank_scripts

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "fsdp2" / "run_guard.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    (code, output, out) = run_rank_scripts({"guard": ["{out}"]}, SCRIPT, tmp_path_factory.mktemp("guard"), 120)["guard"]
    assert code == 0, output[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_one_rank_failing_before_any_collective_stops_the_other_at_its_next_one(ranks: Any) -> None:
    rank0, rank1 = ranks
    for r0, r1 in zip(rank0, rank1, strict=True):
        assert r0["aligned"] and r1["aligned"], "after every region both ranks are at the same collective"
        assert r0["unpatched"] and r1["unpatched"], "torch.distributed is given back after every region"
        assert r0["status_calls"] == r1["status_calls"]
        if r0["fail_at"] is None:
            assert r0["outcome"] == r1["outcome"] == "ok"
            assert not r0["cleaned"] and not r1["cleaned"]
            continue
        assert r1["outcome"] == "oom"  # rank 1's own error reaches it
        assert r0["outcome"] == ("oom" if r0["both"] else "peer")  # rank 0 is told, not left waiting
        assert r0["cleaned"] and r1["cleaned"], "on_failure ran on every rank"


def test_a_failure_after_the_last_collective_is_caught_by_the_closing_agreement(ranks: Any) -> None:
    rank0, _ = ranks
    late = next(r for r in rank0 if r["fail_at"] == 3 and not r["both"])
    assert late["outcome"] == "peer"  # rank 0 finished its region; the closing status all-reduce told it


def test_dtensor_collectives_are_guarded_too(ranks: Any) -> None:
    rank0, rank1 = ranks
    dtensor = [(r0, r1) for r0, r1 in zip(rank0, rank1, strict=True) if r0["kind"] == "dtensor"]
    assert len(dtensor) == 10
    clean = next(r0 for r0, _ in dtensor if r0["fail_at"] is None)
    # a status all-reduce before each functional collective (the all-gather, the all-reduce, the one
    # all-reduce of clip_grad_norm_'s norm), then the closing one: none of them bypassed the guard
    # (without guarding DTensor's collectives this is 1: the closing one only)
    assert clean["status_calls"] == 4
    before_clip = next(r0 for r0, _ in dtensor if r0["fail_at"] == 2 and not r0["both"])
    assert before_clip["outcome"] == "peer", "rank 0 stopped before clip_grad_norm_'s all-reduce, not in it"
