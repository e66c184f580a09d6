"""CollectiveGuard on 2 gloo processes, without Lightning: a rank failing anywhere never strands the other.

Run by tests/test_collective_guard.py in a subprocess with a timeout (a hang fails the test). Each
rank runs regions of three collectives (an all-gather, a reduce-scatter, an all-reduce: what FSDP2
and Lightning issue); in each region rank 1 raises before collective ``k`` (k = 3: after the last
one, so only the closing status all-reduce can tell rank 0). After every region both ranks run a
plain all-reduce, which only gives the right answer if neither rank is a collective behind.

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
import torch.multiprocessing as mp

from retune.collective_guard import CollectiveGuard, PeerFailed

FAIL_AT = [None, 0, 1, 2, 3]  # None: nobody fails; 3: rank 1 fails after the region's last collective


def region(rank: int, fail_at: int | None, both: bool) -> None:
    """Three collectives; rank 1 (and with ``both`` rank 0 too) raises before collective ``fail_at``."""
    for k in range(4):
        if k == fail_at and (rank == 1 or both):
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle, rank {rank}, before collective {k})")
        if k == 0:
            out = torch.empty(4)
            dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
        elif k == 1:
            out = torch.empty(1)
            dist.reduce_scatter_tensor(out, torch.ones(2))
        elif k == 2:
            dist.all_reduce(torch.ones(3))


def worker(rank: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # reduce_scatter_tensor's rename
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = []
    for both in (False, True):
        for fail_at in FAIL_AT:
            cleaned = []
            outcome = "ok"
            guard = CollectiveGuard()
            try:
                with guard.region(on_failure=lambda cleaned=cleaned: cleaned.append(True)):
                    region(rank, fail_at, both)
            except PeerFailed:
                outcome = "peer"
            except torch.OutOfMemoryError:
                outcome = "oom"
            check = torch.tensor([1.0])
            dist.all_reduce(check)  # 2.0 only if both ranks are at the same collective
            results.append(
                {
                    "fail_at": fail_at,
                    "both": both,
                    "outcome": outcome,
                    "cleaned": bool(cleaned),
                    "aligned": check.item() == 2.0,
                    "status_calls": guard.status_calls,
                    "unpatched": dist.all_reduce.__module__ == "torch.distributed.distributed_c10d",
                }
            )
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


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
