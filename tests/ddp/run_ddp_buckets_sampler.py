"""``search.batching: buckets`` over a sampler that chooses what trains, under DDP on CPU (gloo, 2 processes).

Run by tests/buckets/test_ddp.py in a subprocess with a timeout. ``weighted`` (the default): the user's
loader has a ``WeightedRandomSampler`` with its own seeded generator and an odd ``num_samples``; Lightning
would wrap it in a ``DistributedSamplerWrapper``. ``distributed``: the user's loader has its own shuffled
``DistributedSampler(drop_last=True)`` over an odd number of samples (``N_ODD``), which leaves one sample
out of every epoch (another one each epoch). Two epochs; each rank records every real batch (its samples'
indices and the bucket it came from), the draws its bucketed sampler used, the warnings retune gave, and
measures every real step as a probe is measured.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch.utils.data import DataLoader, DistributedSampler, WeightedRandomSampler

from retune import ScheduledBatchSizeFinder
from tests.ddp import ddp_trainer
from tests.ddp.run_ddp_buckets import Record
from tests.helpers import bucket_data
from tests.helpers.dist_utils import leave_rank
from tests.helpers.lightning_ns import pl
from tests.helpers.retune_warnings import retune_warnings
from tests.helpers.varlen import StepPeaks

N = 200
NUM_SAMPLES = 301  # odd: Lightning's DistributedSamplerWrapper would pad it to 302
SEED = 11
N_ODD = 201  # the distributed case: 2 ranks of 100, one sample trimmed per epoch


def make_sampler() -> WeightedRandomSampler:
    # samples with index % 4 == 0 get 10x the weight: the draws' share of them is far above the dataset's 25%
    weights = torch.tensor([10.0 if i % 4 == 0 else 1.0 for i in range(N)])
    return WeightedRandomSampler(weights, NUM_SAMPLES, generator=torch.Generator().manual_seed(SEED))


class WeightedModel(bucket_data.BucketModel):
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=8, sampler=make_sampler(), collate_fn=bucket_data.pad_collate)


def make_distributed(rank: int, data: Any) -> DistributedSampler[Any]:
    return DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=SEED, drop_last=True)


class OwnDistributedModel(bucket_data.BucketModel):
    def train_dataloader(self) -> DataLoader[Any]:
        sampler = make_distributed(self.trainer.global_rank, self.data)
        return DataLoader(self.data, batch_size=8, sampler=sampler, collate_fn=bucket_data.pad_collate)


class Draws(pl.Callback):  # type: ignore[misc,name-defined]
    """The draws the bucketed sampler trained each epoch (rank zero's, shared), written next to Record's file."""

    def __init__(self, out: Path, finder: ScheduledBatchSizeFinder) -> None:
        self.out, self.finder = out, finder
        self.draws: dict[int, list[int]] = {}

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        buckets = self.finder._buckets
        sampler = None if buckets is None else buckets.sampler
        self.draws[int(trainer.current_epoch)] = list(getattr(sampler, "draws", []))

    def teardown(self, trainer: Any, model: Any, stage: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"draws{trainer.global_rank}.json").write_text(json.dumps(self.draws))


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    pl.seed_everything(0)
    distributed = len(sys.argv) > 2 and sys.argv[2] == "distributed"
    if distributed:
        model: bucket_data.BucketModel = OwnDistributedModel(
            bucket_data.IndexedTokens(bucket_data.long_tail_lengths(N_ODD))
        )
    else:
        model = WeightedModel(bucket_data.IndexedTokens(bucket_data.long_tail_lengths(N)))
    finder = ScheduledBatchSizeFinder(
        bucket_data.schedule(), sample_size=bucket_data.tokens, verbose=False, write_report=False
    )
    peaks = StepPeaks()
    trainer = ddp_trainer(
        max_epochs=2,
        callbacks=[finder, peaks, Record(out, finder, peaks), Draws(out, finder)],
        num_sanity_val_steps=0,
    )
    with retune_warnings() as said:  # rank zero's (retune warns there only)
        trainer.fit(model)
    (out / f"warnings{trainer.global_rank}.json").write_text(json.dumps(said))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
