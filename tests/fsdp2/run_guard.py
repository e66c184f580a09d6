"""CollectiveGuard on 2 gloo processes, without Lightning: a rank failing anywhere never strands the other.

Run by tests/distributed/test_collective_guard.py in a subprocess with a timeout (a hang fails the test). Each
rank runs regions of three collectives; in each region rank 1 raises before collective ``k`` (k = 3:
after the last one, so only the closing status all-reduce can tell rank 0). Two kinds of region:

* ``c10d``: an all-gather, a reduce-scatter, an all-reduce through ``torch.distributed`` (what
  FSDP2 and Lightning issue);
* ``dtensor``: DTensor's functional collectives: an all-gather of a sharded DTensor
  (``full_tensor``), the all-reduce of a partial one, and ``clip_grad_norm_`` over a sharded
  parameter's gradient (the sum of the per-rank norms: what gradient clipping does under FSDP2).

After every region both ranks run a plain all-reduce, which only gives the right answer if neither
rank is a collective behind.

Usage: run_guard.py OUT
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard

from retune.distributed.collective_guard import CollectiveGuard, PeerFailed
from tests.helpers.dist_utils import leave_rank

FAIL_AT = [None, 0, 1, 2, 3]  # None: nobody fails; 3: rank 1 fails after the region's last collective
KINDS = ("c10d", "dtensor")


def region(rank: int, fail_at: int | None, both: bool, kind: str, mesh: DeviceMesh) -> None:
    """Three collectives; rank 1 (and with ``both`` rank 0 too) raises before collective ``fail_at``."""
    for k in range(4):
        if k == fail_at and (rank == 1 or both):
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle, rank {rank}, before collective {k})")
        if k == 3:
            return
        if kind == "c10d":
            _c10d(k, rank)
        else:
            _dtensor(k, rank, mesh)


def _c10d(k: int, rank: int) -> None:
    if k == 0:
        out = torch.empty(4)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
    elif k == 1:
        out = torch.empty(1)
        dist.reduce_scatter_tensor(out, torch.ones(2))
    else:
        dist.all_reduce(torch.ones(3))


def _dtensor(k: int, rank: int, mesh: DeviceMesh) -> None:
    if k == 0:
        whole = DTensor.from_local(torch.full((2,), float(rank)), mesh, [Shard(0)], run_check=False).full_tensor()
        assert whole.tolist() == [0.0, 0.0, 1.0, 1.0], whole
    elif k == 1:
        total = DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False).full_tensor()
        assert total.tolist() == [2.0, 2.0, 2.0], total
    else:
        param = nn.Parameter(DTensor.from_local(torch.zeros(2), mesh, [Shard(0)], run_check=False))
        param.grad = DTensor.from_local(torch.full((2,), 3.0), mesh, [Shard(0)], run_check=False)
        norm = torch.nn.utils.clip_grad_norm_([param], max_norm=1.0)
        assert abs(float(norm.full_tensor()) - 6.0) < 1e-5, norm  # sqrt(4 * 9): both ranks' shards


def worker(rank: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # reduce_scatter_tensor's rename
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    results = []
    for kind, both, fail_at in ((k, b, f) for k in KINDS for b in (False, True) for f in FAIL_AT):
        cleaned = []
        outcome = "ok"
        guard = CollectiveGuard()
        try:
            with guard.region(on_failure=lambda cleaned=cleaned: cleaned.append(True)):
                region(rank, fail_at, both, kind, mesh)
        except PeerFailed:
            outcome = "peer"
        except torch.OutOfMemoryError:
            outcome = "oom"
        check = torch.tensor([1.0])
        dist.all_reduce(check)  # 2.0 only if both ranks are at the same collective
        results.append(
            {
                "kind": kind,
                "fail_at": fail_at,
                "both": both,
                "outcome": outcome,
                "cleaned": bool(cleaned),
                "aligned": check.item() == 2.0,
                "status_calls": guard.status_calls,
                "unpatched": dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"
                and funcol.all_reduce.__module__ == "torch.distributed._functional_collectives",
            }
        )
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    leave_rank()  # the DTensor collectives above made the exit abort often without it


def main() -> None:
    out = sys.argv[1]
    Path(out).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, out), nprocs=2, join=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
