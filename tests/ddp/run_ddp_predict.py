"""``search.predict: auto`` under DDP on CPU (gloo, 2 processes); each rank writes what it saw as JSON.

Run by tests/distributed/test_ddp_predict.py in a subprocess with a timeout, so a hang (one rank waiting on
a collective the other never calls) fails the test instead of hanging CI.

Scenarios:
  agree     rank 1's step keeps a wider activation alive (more memory per sample than rank 0's): each rank
            traces its own step, the ranks agree on the larger prediction at every traced size, and every
            size is verified by probes both ranks run
  fallback  rank 1's step has a data-dependent operator (``nonzero``): its trace cannot run, rank 0's can; both
            ranks fall back to real probes together
  off       the fallback scenario's model with ``predict: off`` (the sizes the fallback must find)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from retune import ScheduledBatchSizeFinder
from tests.ddp import ddp_trainer
from tests.helpers.dist_utils import leave_rank, write_rank_result
from tests.helpers.lightning_ns import pl
from tests.prediction.test_predicted_search import WideMLP, _schedule


class RankMLP(WideMLP):
    """``WideMLP`` whose rank 1 differs: a wider activation kept for backward (``agree``), or ``nonzero``."""

    def __init__(self, scenario: str) -> None:
        super().__init__(n=1024)
        self.scenario = scenario

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_rank == 1 and self.scenario in ("fallback", "off"):
            x = x * ((x > 0).nonzero().shape[0] / x.numel())  # an output shape that depends on the data
        loss = F.cross_entropy(self.net(x), y)
        if self.global_rank == 1 and self.scenario == "agree":
            wide = torch.relu(self.net[0](x).repeat(1, 4))  # kept for backward: more memory per sample
            loss = loss + 0.0 * wide.sum()
        return loss


class WriteResult(pl.Callback):  # type: ignore[misc,name-defined]
    def __init__(self, out: Path, finder: ScheduledBatchSizeFinder) -> None:
        self.out, self.finder = out, finder
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer: Any, model: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(int(batch[0].shape[0]))  # real steps only: a probe's hooks are hidden from callbacks

    def teardown(self, trainer: Any, model: Any, stage: str) -> None:
        event = self.finder.history[0]
        write_rank_result(
            self.out, trainer.global_rank, self.finder, predicted=event.predicted_bytes, note=event.note, seen=self.seen
        )


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    pl.seed_everything(0)
    schedule = _schedule("model", "off" if scenario == "off" else "auto")
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    trainer = ddp_trainer(callbacks=[finder, WriteResult(out, finder)], limit_train_batches=2)
    trainer.fit(RankMLP(scenario))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
