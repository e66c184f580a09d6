"""``probe_samples: largest`` under DDP on CPU (gloo, 2 processes); each rank writes what it saw as JSON.

Run by tests/probing/test_probe_samples.py in a subprocess with a timeout. Both ranks scan the whole dataset
and probe the same global largest samples; Lightning's ``DistributedSampler`` then gives each rank
its shuffled shard. Each rank measures every real step of the epoch as a probe is measured.
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
from tests.helpers import varlen
from tests.helpers.dist_utils import leave_rank
from tests.helpers.lightning_ns import pl


class WriteResult(pl.Callback):  # type: ignore[misc,name-defined]
    def __init__(self, out: Path, finder: ScheduledBatchSizeFinder, peaks: varlen.StepPeaks) -> None:
        self.out, self.finder, self.peaks = out, finder, peaks

    def teardown(self, trainer: Any, model: Any, stage: str) -> None:
        result = {
            "rank": trainer.global_rank,
            "batch_size": self.finder.batch_size,
            "trials": [[t.batch_size, t.fits] for t in self.finder.history[0].trials],
            "scans": self.finder.probe_batches.cache.scans,
            "peaks": self.peaks.peaks,
            "sizes": self.peaks.sizes,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    pl.seed_everything(0)
    model = varlen.TokenClassifier(varlen.TokenDataset(varlen.lengths()), shuffle=True)
    finder = ScheduledBatchSizeFinder(varlen.schedule("largest"), verbose=False, write_report=False)
    peaks = varlen.StepPeaks()
    trainer = ddp_trainer(
        callbacks=[finder, peaks, WriteResult(out, finder, peaks)],
        num_sanity_val_steps=0,
    )
    trainer.fit(model)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
