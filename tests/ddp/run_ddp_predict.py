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
  retune    the agree scenario searched again at epoch 1 (the optimizer state exists: new traces): the fit's
            first search records a trace and checks its replay, the re-tune traces once and replays its sizes,
            each rank its own recording, and the ranks agree (retune.prediction.replay)
  tags      the retune scenario where rank 1's batches hold a per-sample size of 17 (rank 0's tag size): the
            ranks would record at different sizes, so neither records, both trace every size, nothing hangs
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

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

    def train_dataloader(self) -> DataLoader[Any]:
        if self.scenario == "tags" and self.global_rank == 1:  # a per-sample size of 17 in rank 1's batches only
            x, y = self.data.tensors
            data = TensorDataset(x, y, torch.zeros(len(x), 17))  # rank 0 would record at 17 (65 = 5 x 13)
            return DataLoader(data, batch_size=self.batch_size, shuffle=True)
        return super().train_dataloader()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch[0], batch[1]
        if self.global_rank == 1 and self.scenario in ("fallback", "off"):
            x = x * ((x > 0).nonzero().shape[0] / x.numel())  # an output shape that depends on the data
        loss = F.cross_entropy(self.net(x), y)
        if self.global_rank == 1 and self.scenario in ("agree", "retune", "tags"):
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
        later = [
            {
                "trials": [[t.batch_size, t.fits] for t in e.trials],
                "predicted": e.predicted_bytes,
                "size": e.batch_size_after,
            }
            for e in self.finder.history[1:]
        ]
        write_rank_result(
            self.out,
            trainer.global_rank,
            self.finder,
            predicted=event.predicted_bytes,
            note=event.note,
            seen=self.seen,
            later=later,
            traced=TRACED,
        )


TRACED: list[list[int]] = []
"""The sizes this rank traced, search by search (each search's ``Tracer`` calls)."""


def _count_traces() -> None:
    import retune.search.predict_run as predict_run

    call, search = predict_run.Tracer.__call__, predict_run.predicted_search

    def counted(self: Any, size: int) -> float:
        TRACED[-1].append(size)
        return call(self, size)

    def searched(*args: Any, **kwargs: Any) -> Any:
        TRACED.append([])
        return search(*args, **kwargs)

    predict_run.Tracer.__call__ = counted  # type: ignore[method-assign]
    import retune.search.batching as batching

    batching.predicted_search = searched  # type: ignore[attr-defined]


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    pl.seed_everything(0)
    schedule = _schedule("model", "off" if scenario == "off" else "auto")
    epochs = 1
    if scenario in ("retune", "tags"):
        schedule["triggers"] = [{"kind": "fit_start"}, {"kind": "epoch", "at": [1]}]
        epochs = 2
        _count_traces()
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    trainer = ddp_trainer(callbacks=[finder, WriteResult(out, finder)], limit_train_batches=2, max_epochs=epochs)
    trainer.fit(RankMLP(scenario))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
