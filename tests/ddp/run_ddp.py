"""One DDP scenario on CPU (gloo, 2 processes); each rank writes what it ended with as JSON.

Run by tests/distributed/test_ddp.py in a subprocess with a timeout, so a hang fails the test instead of
hanging CI. Lightning's DDP launcher starts rank 1 by re-running this script.

Scenarios:
  capacity  rank 1 has a smaller memory capacity than rank 0 (a smaller GPU, or other tenants)
  unfreeze  BackboneFinetuning unfreezes at epoch 1 under DDP
  error     rank 1 raises a non-memory error inside a probe
  spawn     the capacity scenario under ddp_spawn (results written from inside the spawned processes)
"""

from __future__ import annotations

import argparse
import atexit
import gc
import hashlib
import json
import multiprocessing
import os
import sys
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from retune import ScheduledBatchSizeFinder
from tests.helpers.dist_utils import leave_rank
from tests.helpers.lightning_ns import callbacks, pl
from tests.helpers.oracle import FineTuneModel, MemoryOracle

CAPACITY = 2_000_000
RANK1_CAPACITY = 1_500_000


class RankModel(FineTuneModel):
    """FineTuneModel whose memory capacity (and, in the error scenario, behaviour) depends on the rank."""

    def __init__(self, scenario: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario

    def setup(self, stage: str) -> None:
        if self.scenario in ("capacity", "spawn") and self.global_rank == 1:
            self.oracle = MemoryOracle(capacity=RANK1_CAPACITY)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.scenario == "error" and self.global_rank == 1 and batch[0].shape[0] >= 64:
            raise ValueError("boom on rank 1")
        return super().training_step(batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["capacity", "unfreeze", "error", "spawn"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--without-retune", action="store_true", help="the same run without the finder")
    args = parser.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0)
    unfreeze = args.scenario == "unfreeze"
    model = RankModel(args.scenario, batch_size=8, n=1024, head_only_optimizer=unfreeze)
    schedule = "schedules/freeze_unfreeze.yaml" if unfreeze else {"triggers": [{"kind": "fit_start"}]}
    finder = ScheduledBatchSizeFinder(schedule, verbose=False)
    cbs: list[Any] = [] if args.without_retune else [finder]
    if unfreeze:
        cbs.append(callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1))
    writer = WriteResult(args.out)
    cbs.append(writer)
    trainer = pl.Trainer(
        strategy="ddp_spawn" if args.scenario == "spawn" else "ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=3 if unfreeze else 2,
        callbacks=cbs,
        # a logger in one scenario: the finder's reports at fit end must not need a collective on rank 0
        logger=pl.loggers.CSVLogger(str(args.out), name="logs") if args.scenario == "capacity" else False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model)
    if args.scenario in ("capacity", "unfreeze"):
        _write_teardown_order(writer, trainer, args.out)


def _write_teardown_order(writer: WriteResult, trainer: Any, out: Path) -> None:
    """Whether the DDP wrapper (and its reducer) was freed while the process group was still alive.

    Freed after the group is destroyed, the reducer would be the group's last owner and destroy it
    holding the GIL, which can deadlock (tests/helpers/dist_utils.py). Lightning drops the wrapper at teardown
    and destroys the group at exit; nothing retune keeps may hold the wrapper past teardown.
    """
    import torch.distributed as dist

    gc.collect()
    result = {
        "wrapped": writer.wrapper_type,
        "wrapper_freed": writer.wrapper is not None and writer.wrapper() is None,
        "group_alive": dist.is_initialized(),
    }
    (out / f"teardown{trainer.global_rank}.json").write_text(json.dumps(result))


class WriteResult(pl.Callback):  # type: ignore[misc,name-defined]
    """Each rank writes what it ended with at fit end, inside its own process (ddp_spawn included)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.weights_shared_at_fit_start: bool | None = None
        self.wrapper: weakref.ref[Any] | None = None  # the strategy's wrapped model during fit
        self.wrapper_type = ""

    def on_fit_start(self, trainer: Any, model: Any) -> None:
        # ddp_spawn on pytorch-lightning < 2.1 leaves CPU weights in memory shared by all ranks (#17399)
        self.weights_shared_at_fit_start = any(t.is_shared() for t in [*model.parameters(), *model.buffers()])

    def on_train_start(self, trainer: Any, model: Any) -> None:
        self.wrapper = weakref.ref(trainer.strategy.model)
        self.wrapper_type = type(trainer.strategy.model).__name__

    def teardown(self, trainer: Any, model: Any, stage: str) -> None:  # after every on_fit_end
        finder = next((cb for cb in trainer.callbacks if isinstance(cb, ScheduledBatchSizeFinder)), None)
        if finder is None:
            finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "fit_start"}]}, verbose=False)
        weights = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
        result = {
            "rank": trainer.global_rank,
            "batch_size": finder.batch_size,
            "model_batch_size": model.batch_size,
            "history": [event.to_dict() for event in finder.history],
            "epoch_true_max": model.epoch_true_max,
            "weights_sha256": hashlib.sha256(weights).hexdigest(),
            "global_step": trainer.global_step,
            "batch_sizes_seen": model.train_batch_sizes,
            "report_written": finder.report_paths is not None,
            "weights_shared_at_fit_start": self.weights_shared_at_fit_start,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
        if multiprocessing.parent_process() is not None:
            # a ddp_spawn rank: it never returns to this script's __main__, so it leaves at its exit
            atexit.register(leave_rank)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
