"""DDP runs on CPU (gloo, 2 processes) for two review findings; each rank writes what it saw as JSON.

Run by tests/distributed/test_ddp_review.py in a subprocess with a timeout.

* ``oom_save OUT``: the ``oom`` trigger, and only rank 1 runs out of memory (the real ``torch.OutOfMemoryError``)
  on a batch above 30 samples from epoch 1 on. Two epochs of 4 steps at the size the fit-start search found (50,
  ``search.max_val``); a checkpoint mid-epoch 1 (``ModelCheckpoint(every_n_train_steps=6)``: OUT/mid.ckpt) and one
  after the fit (OUT/end.ckpt).
* ``oom_resume OUT CKPT``: the same run resumed from CKPT, to three epochs.
* ``uneven OUT fixed|buckets``: ``use_distributed_sampler=False`` with a dataset of each rank's own, 40 samples on
  rank 0 and 24 on rank 1, one batch per epoch; a fit-start search in a 1MB budget (``batching: buckets``: the
  ranks' buckets differ too).
* ``own_pass OUT``: ``use_distributed_sampler=False`` with the same 64 variable-length samples on both ranks and
  ``batching: buckets``: each rank trains its loader's whole pass, as without retune (buckets shared one pass out
  across the ranks: 32 of 64 each).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from retune import ScheduledBatchSizeFinder
from tests.ddp import ddp_trainer
from tests.helpers import bucket_data
from tests.helpers.dist_utils import leave_rank
from tests.helpers.lightning_ns import LEGACY, pl
from tests.helpers.lightning_ns import callbacks as plcb

OOM_ABOVE = 30
"""Rank 1 runs out of memory on a training batch of more samples, from epoch 1 on."""


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Model(pl.LightningModule):  # type: ignore[misc,name-defined]
    """A small classifier; ``per_rank`` gives each rank a dataset of its own length (else one of ``n``)."""

    def __init__(self, n: int = 400, per_rank: tuple[int, int] | None = None, oom: bool = False) -> None:
        super().__init__()
        self.batch_size = 4
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.n, self.per_rank, self.oom = n, per_rank, oom
        self.data = Points(n)

    def setup(self, stage: str) -> None:
        if self.per_rank is not None:
            self.data = Points(self.per_rank[self.global_rank], seed=self.global_rank)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.oom and self.global_rank == 1 and self.current_epoch >= 1 and len(x) > OOM_ABOVE:
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle: {len(x)} > {OOM_ABOVE} samples)")
        return F.cross_entropy(self.net(x), y)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def write(out: Path, trainer: Any, finder: ScheduledBatchSizeFinder, error: str | None, **extra: Any) -> None:
    result = {
        "rank": trainer.global_rank,
        "error": error,
        "global_step": trainer.global_step,
        "history": [e.to_dict() for e in finder.history],
        **extra,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def fit(trainer: Any, model: Any, **kwargs: Any) -> str | None:
    try:
        trainer.fit(model, **kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
    return None


def oom(out: Path, ckpt: str | None) -> None:
    schedule = {
        "search": {"mode": "binsearch", "max_val": 50},
        "triggers": [{"kind": "fit_start"}, {"kind": "oom"}],
    }
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    model = Model(oom=True)
    callbacks: list[Any] = [finder]
    if ckpt is None:
        callbacks.append(plcb.ModelCheckpoint(dirpath=str(out), filename="mid", every_n_train_steps=6, save_top_k=1))
    trainer = ddp_trainer(
        callbacks=callbacks,
        max_epochs=2 if ckpt is None else 3,
        enable_checkpointing=True,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    error = fit(trainer, model, ckpt_path=ckpt)
    if ckpt is None and error is None:
        trainer.save_checkpoint(str(out / "end.ckpt"))
    write(out, trainer, finder, error)


def uneven(out: Path, batching: str) -> None:
    if batching == "buckets":
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        lengths = bucket_data.long_tail_lengths((40, 24)[rank], seed=rank)
        model: Any = bucket_data.BucketModel(bucket_data.IndexedTokens(lengths))
        schedule = bucket_data.schedule()
        schedule["triggers"] = [{"kind": "fit_start"}]
        finder = ScheduledBatchSizeFinder(schedule, sample_size=bucket_data.tokens, verbose=False, write_report=False)
    else:
        model = Model(per_rank=(40, 24))
        schedule = {
            "search": {"mode": "binsearch"},
            "memory": {"budget": "1MB"},
            "triggers": [{"kind": "fit_start"}],
        }
        finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    own_data = {"replace_sampler_ddp" if LEGACY else "use_distributed_sampler": False}
    trainer = ddp_trainer(
        callbacks=[finder],
        **own_data,
        limit_train_batches=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    error = fit(trainer, model)
    write(out, trainer, finder, error, bucket_sizes=finder.bucket_sizes)


class Trained(pl.Callback):  # type: ignore[misc,name-defined]
    """The sample indices each epoch trained (``bucket_data``'s batches carry them third)."""

    def __init__(self) -> None:
        self.seen: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.setdefault(trainer.current_epoch, []).extend(int(i) for i in batch[2])


def own_pass(out: Path) -> None:
    model = bucket_data.BucketModel(bucket_data.IndexedTokens(bucket_data.long_tail_lengths(64)), batch_size=8)
    schedule = bucket_data.schedule()
    schedule["triggers"] = [{"kind": "fit_start"}]
    finder = ScheduledBatchSizeFinder(schedule, sample_size=bucket_data.tokens, verbose=False, write_report=False)
    trained = Trained()
    own_data = {"replace_sampler_ddp" if LEGACY else "use_distributed_sampler": False}
    trainer = ddp_trainer(
        callbacks=[trained, finder], **own_data, max_epochs=2, limit_val_batches=0, num_sanity_val_steps=0
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = fit(trainer, model)
    said = [str(w.message) for w in caught if "search.batching: buckets" in str(w.message)]
    write(out, trainer, finder, error, seen=trained.seen, said=said, bucket_sizes=finder.bucket_sizes)


def main() -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    what, out = sys.argv[1], Path(sys.argv[2])
    if what == "oom_save":
        oom(out, None)
    elif what == "oom_resume":
        oom(out, sys.argv[3])
    elif what == "own_pass":
        own_pass(out)
    else:
        uneven(out, sys.argv[3])


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
