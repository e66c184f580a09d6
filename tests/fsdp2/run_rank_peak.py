"""A rank's predicted FSDP2 peak (``retune.prediction.sharded.rank_peak``) against its measured peak, 2 gloo ranks.

Plain torch, no Lightning: 4 ``Linear(512, 512)`` + a head, each ``fully_shard``-ed, then the root; AdamW without
state yet (the state the first update creates is half on each rank). Each rank traces one step at each size
(``steps=1``, each gradient the rank's shard once reduced, as a search's Tracer does), predicts its peak, then
measures a real step at that size after the state exists (the steady state a prediction is for) with the CPU
tracker. Writes ``rank{r}.json`` into argv[1]. With argv[2] ``bf16`` every group has
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: the step is traced in bfloat16
(``compute_dtypes``) and its update apart (``trace_update``), as a search's Tracer does. argv[3]: ranks (2).
Run by
tests/prediction/test_fsdp2_trace.py in a subprocess with a timeout.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

SIZES = (2, 64, 256, 1024)


def _rank(rank: int, out: str, store: str, precision: str, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from retune.distributed.fsdp2 import ShardAccount, compute_dtypes, gradient_shards
    from retune.memory import measure_peak, resident_bytes
    from retune.prediction.sharded import rank_peak
    from retune.prediction.trace import OptimizerPhase, StepTrace, trace_step, trace_update

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)], nn.Linear(512, 4))
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if precision == "bf16"
            else MixedPrecisionPolicy()
        )
        for layer in model:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters())

        def step(batch: Any, optimizers: list[torch.optim.Optimizer]) -> None:
            x, y = batch
            nn.functional.cross_entropy(model(x), y).backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)

        def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(size)
            return torch.randn(size, 512, generator=g), torch.randint(0, 4, (size,), generator=g)

        dtypes = compute_dtypes(model)
        shards = gradient_shards(model)  # what the trace holds of each gradient once reduced
        account = ShardAccount.of(model, [optimizer], resident_bytes(model, [optimizer]))
        phase = trace_update(model, [optimizer]) if dtypes else None
        assert phase is None or isinstance(phase, OptimizerPhase), phase
        predicted = {}
        for size in SIZES:
            traced = trace_step(
                model,
                [optimizer],
                batch(2),
                size,
                step,
                steps=1,
                optimizer=phase,
                compute_dtypes=dtypes,
                reduced_gradients=shards,
            )
            assert isinstance(traced, StepTrace), traced
            # a probe's peak holds its batch (here made inside the measured block)
            predicted[size] = rank_peak(traced, account, sum(shards.values())) + size * (512 * 4 + 8)
        step(batch(2), [optimizer])  # the state exists from here: a steady step
        measured = {}
        for size in SIZES:
            with measure_peak(torch.device("cpu"), model, [optimizer]) as reading:
                step(batch(size), [optimizer])
            measured[size] = reading.peak_bytes
        result = {"fraction": account.fraction, "predicted": predicted, "measured": measured, "cast": len(dtypes)}
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder = sys.argv[1]
    precision = sys.argv[2] if len(sys.argv) > 2 else "fp32"
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    mp.start_processes(
        _rank, args=(folder, os.path.join(folder, "store"), precision, world), nprocs=world, start_method="spawn"
    )
