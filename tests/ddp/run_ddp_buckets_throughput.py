"""``objective: throughput`` with ``batching: buckets`` under DDP on CPU (gloo, 2 processes).

Run by tests/buckets/test_ddp.py in a subprocess with a timeout. Each rank's steps advance its own injected
clock by a known function of the padded tokens; rank 1's knee is lower (past 512 tokens it slows down), so
the slowest rank's timings decide the padded work per step, and both ranks must cap every bucket alike.
Each rank writes its history, bucket sizes and the sizes of the batches it trained as JSON.
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
from tests.helpers import bucket_data
from tests.helpers.dist_utils import leave_rank
from tests.helpers.lightning_ns import pl
from tests.helpers.step_time import FakeClock

TIMES = {0: bucket_data.PaddedStepTime(knee=1024), 1: bucket_data.PaddedStepTime(knee=512)}
N = 401


class Record(pl.Callback):  # type: ignore[misc,name-defined]
    def __init__(self, out: Path, finder: ScheduledBatchSizeFinder) -> None:
        self.out, self.finder = out, finder
        self.sizes: list[int] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.sizes.append(int(batch[0].shape[0]))

    def teardown(self, trainer: Any, model: Any, stage: str) -> None:
        result = {
            "rank": trainer.global_rank,
            "history": [e.to_dict() for e in self.finder.history],
            "bucket_sizes": self.finder.bucket_sizes,
            "sizes": self.sizes,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    pl.seed_everything(0)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    clock = FakeClock()
    data = bucket_data.IndexedTokens(bucket_data.long_tail_lengths(N))
    model = bucket_data.TimedBucketModel(data, clock, TIMES[rank])
    schedule = bucket_data.schedule(objective="throughput")
    schedule["triggers"] = [{"kind": "fit_start"}]
    finder = ScheduledBatchSizeFinder(
        schedule, sample_size=bucket_data.tokens, verbose=False, write_report=False, clock=clock
    )
    trainer = ddp_trainer(
        callbacks=[finder, Record(out, finder)],
        num_sanity_val_steps=0,
    )
    trainer.fit(model)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
