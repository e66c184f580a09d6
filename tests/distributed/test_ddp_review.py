"""Two DDP findings of a review, on 2 gloo ranks (tests/ddp/run_ddp_review.py, each run in a subprocess with a timeout).

1. An ``oom`` recovered on rank 1 only was kept by rank 1 alone, while Lightning checkpoints rank 0's callback state:
   a run resumed from a checkpoint written after it forgot the failure (no re-search, the failed size applied again).
   The ranks now tell each other in the step's own agreement (retune/distributed/grad_sync.py's ``StepNews``).
2. Ranks whose epochs hold different numbers of samples (a dataset per rank, ``use_distributed_sampler=False``)
   capped the search each at its own length: their plans diverged and their collectives got mismatched payloads.
   The cap is now agreed (the smallest), and bucketed ranks that group different samples fall back together.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from retune.buckets.train_buckets import TrainBuckets
from retune.callbacks.oom_recovery import OomRecovery
from retune.events import RetuneEvent
from retune.recovery.train_step import TrainStepRecovery
from retune.schedule.triggers import OutOfMemory
from tests.helpers.dist_utils import run_rank_scripts
from tests.helpers.lightning_ns import pl

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "ddp" / "run_ddp_review.py"
TIMEOUT_S = 240  # below the suite's per-test timeout, so a hang fails these tests with the runs' output


def _load(runs: dict[str, tuple[int | None, str, Path]]) -> dict[str, Any]:
    return {
        name: {
            "returncode": code,
            "output": output,
            "out": out,
            "ranks": {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")},
        }
        for name, (code, output, out) in runs.items()
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The runs that need no checkpoint: the oom run that writes them, and the uneven ranks' runs."""
    runs = {
        "save": ["oom_save", "{out}"],
        "uneven_fixed": ["uneven", "{out}", "fixed"],
        "uneven_buckets": ["uneven", "{out}", "buckets"],
        "own_pass": ["own_pass", "{out}"],
    }
    return _load(run_rank_scripts(runs, SCRIPT, tmp_path_factory.mktemp("review"), TIMEOUT_S))


@pytest.fixture(scope="module")
def resumed(saved: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = saved["save"]["out"]
    assert (out / "mid.ckpt").exists() and (out / "end.ckpt").exists(), saved["save"]["output"][-4000:]
    runs = {f"resume_{c}": ["oom_resume", "{out}", str(out / f"{c}.ckpt")] for c in ("mid", "end")}
    return _load(run_rank_scripts(runs, SCRIPT, tmp_path_factory.mktemp("review_resumed"), TIMEOUT_S))


def _ranks(run: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    assert run["returncode"] == 0 and sorted(run["ranks"]) == [0, 1], run["output"][-4000:]
    for rank in run["ranks"].values():
        assert rank["error"] is None, rank["error"]
    return run["ranks"][0], run["ranks"][1]


def _history(rank: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank's events without their durations (each rank times its own)."""
    return [{k: v for k, v in e.items() if k != "duration_s"} for e in rank["history"]]


def _finder_state(path: Path) -> dict[str, Any]:
    checkpoint = torch.load(path, weights_only=False)
    return next(v for k, v in checkpoint["callbacks"].items() if "ScheduledBatchSizeFinder" in k)


def test_rank_zero_checkpoints_a_failure_that_happened_on_rank_one_only(saved: dict[str, Any]) -> None:
    rank0, rank1 = _ranks(saved["save"])
    for rank in (rank0, rank1):  # every rank keeps rank 1's recovery, as one event naming the rank
        recoveries = [e for e in rank["history"] if e["micro_batches"]]
        assert [(e["epoch"], e["note"].split(":")[0]) for e in recoveries] == [(1, "rank 1")], rank["history"]
    out = saved["save"]["out"]
    for name in ("mid", "end"):  # mid-epoch 1 (ModelCheckpoint every 6 steps) and after the fit
        state = _finder_state(out / f"{name}.ckpt")
        oom = next(t["state"] for t in state["triggers"] if t["trigger"].startswith("OutOfMemory"))
        assert oom == {"failed_size": 50, "fitting_size": 25}, (name, state["triggers"])
        assert [(e["epoch"], e["trigger"]) for e in state["history"]] == [(0, "fit_start"), (1, "oom")]
    # mid-epoch, rank 1's split goes on in the resumed epoch: batches above 25 are split up front on every rank
    assert _finder_state(out / "mid.ckpt")["oom_max_size"] == 25


@pytest.mark.parametrize("checkpoint", ["mid", "end"])
def test_a_run_resumed_after_rank_ones_failure_re_searches_below_it(resumed: dict[str, Any], checkpoint: str) -> None:
    rank0, rank1 = _ranks(resumed[f"resume_{checkpoint}"])
    assert _history(rank0) == _history(rank1)
    searches = [(e["epoch"], e["trigger"], e["batch_size_after"]) for e in rank0["history"] if not e["micro_batches"]]
    assert searches[0] == (0, "fit_start", 50)
    assert [s[:2] for s in searches[1:]] == [(2, "oom")], searches
    assert searches[1][2] <= 30  # the oom re-search is due at epoch 2, and 50 (what failed) is out of its reach
    # no step ran out of memory again: mid-epoch 1 the carried split cut rank 1's batches up front
    assert [e["epoch"] for e in rank1["history"] if e["micro_batches"]] == [1]
    assert rank0["global_step"] == rank1["global_step"]
    if checkpoint == "end":  # (mid-epoch, Lightning 1.9 counts the resumed epoch's steps its own way)
        assert rank0["global_step"] == 8 + -(-200 // searches[1][2])


@pytest.mark.parametrize("batching", ["fixed", "buckets"])
def test_ranks_with_epochs_of_different_lengths_agree_on_the_cap(saved: dict[str, Any], batching: str) -> None:
    """Rank 0 holds 40 samples, rank 1 24: the search is capped at 24 on both (rank 1's batch holds no more)."""
    rank0, rank1 = _ranks(saved[f"uneven_{batching}"])
    assert _history(rank0) == _history(rank1)
    (event,) = rank0["history"]
    assert event["batch_size_after"] == 24 and max(t[0] for t in event["trials"]) == 24
    # buckets: the ranks group different samples, so both train one size (batching: fixed) instead of diverging
    assert rank0["bucket_sizes"] == rank1["bucket_sizes"] == []


def test_each_rank_trains_its_own_loaders_whole_pass_without_lightnings_sampler(saved: dict[str, Any]) -> None:
    """``use_distributed_sampler=False`` and a plain shuffled loader: Lightning trains each rank's whole loader, and
    buckets planned one pass shared out across the ranks (each trained 32 of its 64 samples, without a word). Now
    they say why and train one batch size, on every sample of each rank's pass."""
    rank0, rank1 = _ranks(saved["own_pass"])
    for rank in (rank0, rank1):
        assert sorted(rank["seen"]) == ["0", "1"]  # JSON keys
        assert all(sorted(rank["seen"][epoch]) == list(range(64)) for epoch in ("0", "1")), rank["seen"]
        assert rank["bucket_sizes"] == []
    assert any("use_distributed_sampler=False" in m for m in rank0["said"]), rank0["said"]  # rank zero warns


class _Tiny(pl.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 64
        self.layer = torch.nn.Linear(2, 2)


def test_another_ranks_bucket_failure_is_kept_for_its_bucket_and_checkpointed() -> None:
    """What rank 0 does with rank 1's news of a recovered step under ``batching: buckets`` (no processes)."""
    buckets = TrainBuckets(4, cast(Any, None))
    buckets.state.sizes = [64, 48, 32, 16]
    events: list[RetuneEvent] = []

    def record(trainer: Any, event: RetuneEvent, warn: bool = True) -> None:
        events.append(event)

    recovery = OomRecovery(
        OutOfMemory(),
        split_batch=None,
        items_fn=None,
        buckets=buckets,
        say=lambda *args, **kwargs: None,
        attr=lambda trainer, module, stage: "batch_size",
        record=record,
    )
    model = _Tiny()
    recovery.train = TrainStepRecovery(lambda: list(model.parameters()), split_key=lambda: 0)
    recovery.train.splits = {0: (40, 1)}  # rank 0's own split of bucket 0
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    # rank 1: a batch of 32 in bucket 2 ran out of memory in backward and trained as 2 x 16, which it keeps
    recovery.peer_recovered(trainer, model, [[0] * 8, [1, 32, 16, 2, 2, 3, 17, 1]])
    assert buckets.failures == {2: (16, 32)}  # bucket 2's next search starts below 32
    assert (recovery.trigger.failed_size, recovery.trigger.fitting_size) == (32, 16)
    assert sorted(recovery.state_dict()["oom_splits"]) == [[0, 40, 1], [2, 16, 1]]
    (event,) = events
    assert event.micro_batches == 2 and event.batch_size_before == 32  # bucket 2's size in force
    assert event.note.startswith("rank 1: out of memory in backward on a batch of 32") and "bucket 2" in event.note
    recovery.new_epoch()  # the next epoch starts whole on every rank
    assert recovery.state_dict()["oom_splits"] == []


def test_only_a_loader_lightning_would_have_sharded_steps_aside_without_lightnings_sampler() -> None:
    """Under ``use_distributed_sampler=False`` a plain loader falls back (each rank trains its whole pass); a
    ``DistributedSampler`` of the user's own is the run's sharding and stays bucketed, as do plain loaders where
    Lightning shards them or in one process (no processes: the buckets' own check)."""
    from torch.utils.data import DataLoader, DistributedSampler

    data = list(range(64))
    buckets = TrainBuckets(4, None)
    buckets._world_size, buckets._rank, buckets._shared_out = 2, 0, False
    own = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=True))
    assert buckets.why_not(own) is None
    assert "use_distributed_sampler=False" in (buckets.why_not(DataLoader(data, batch_size=8, shuffle=True)) or "")
    buckets._shared_out = True
    assert buckets.why_not(DataLoader(data, batch_size=8, shuffle=True)) is None
    buckets._world_size, buckets._shared_out = 1, False
    assert buckets.why_not(DataLoader(data, batch_size=8, shuffle=True)) is None
