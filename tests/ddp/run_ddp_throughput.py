"""``search.objective: throughput`` under DDP on CPU (gloo, 2 processes); each rank writes what it saw as JSON.

Run by tests/search/test_throughput_fit.py in a subprocess with a timeout. Each rank's steps advance its own
injected clock by a known step time; rank 1 is slower past 16 samples (say, a GPU shared with another
job), so the slowest rank's timings decide, and both ranks must choose the same size.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from retune import ScheduledBatchSizeFinder
from tests.ddp import ddp_trainer
from tests.helpers.dist_utils import leave_rank
from tests.helpers.lightning_ns import pl
from tests.helpers.step_time import FakeClock, StepTimeOracle, TimedModel, roomy_oracle

TIMES = {0: StepTimeOracle(knee=48), 1: StepTimeOracle(knee=16)}


class WriteResult(pl.Callback):  # type: ignore[misc,name-defined]
    def __init__(self, out: Path, finder: ScheduledBatchSizeFinder) -> None:
        self.out, self.finder = out, finder

    def teardown(self, trainer: Any, model: Any, stage: str) -> None:
        result = {
            "rank": trainer.global_rank,
            "batch_size": self.finder.batch_size,
            "model_batch_size": model.batch_size,
            "history": [event.to_dict() for event in self.finder.history],
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    pl.seed_everything(0)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    clock = FakeClock()
    model = TimedModel(clock, TIMES[rank], batch_size=8, oracle=roomy_oracle(), head_only_optimizer=True, n=2048)
    schedule = {"search": {"objective": "throughput"}, "triggers": [{"kind": "fit_start"}]}
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False, clock=clock)
    trainer = ddp_trainer(
        limit_train_batches=2,
        callbacks=[finder, WriteResult(out, finder)],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
