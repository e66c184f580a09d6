"""``search.batching: buckets`` under FSDP2 (ModelParallelStrategy, 2 gloo processes on CPU); each rank
writes what it saw as JSON.

Run by tests/buckets/test_fsdp2.py in a subprocess with a timeout. The model and data are
run_ddp_buckets.py's (a long-tailed token dataset, the backbone frozen for the first epoch), sharded
with ``fully_shard`` in ``configure_model``; argv[2] is the search objective (``largest`` or
``throughput``); argv[3] ``predict`` turns on ``search.predict: auto``. Each rank records every real batch
and measures every real step as a probe is measured.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from tests.ddp.run_ddp_buckets import run
from tests.helpers import bucket_data
from tests.helpers.dist_utils import leave_rank
from tests.helpers.lightning_ns import pl


class ShardedBucketModel(bucket_data.BucketModel):
    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.mlp[0], self.mlp[2], self.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh, reshard_after_forward=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.mlp(self.embed(ids))
        mask = (ids > 0).unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * mask).sum(1) / mask.sum(1).clamp(min=1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels, _ = batch
        return F.cross_entropy(self(ids), labels)  # through __call__: the root's FSDP hooks run there


def main() -> None:
    pl.seed_everything(0)
    model = ShardedBucketModel(bucket_data.IndexedTokens(bucket_data.long_tail_lengths(401)), frozen=True)
    strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    search = {"predict": "auto"} if sys.argv[3:] == ["predict"] else None
    run(Path(sys.argv[1]), model, objective=sys.argv[2], strategy=strategy, search=search)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
