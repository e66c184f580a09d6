"""FSDP2 (Lightning's ModelParallelStrategy) on CUDA with real out-of-memory errors.

Not part of the default test run (no GPU in CI). Run on a machine with 2+ CUDA GPUs (NCCL):

    python tests/gpu/fsdp2_check.py             # every visible GPU; about 2-4 minutes

Each scenario runs in a subprocess with a timeout (a hang fails it) and every rank prints one JSON line:

  * ``agree``: rank 1 is capped at 1.5 GiB, the others at 3 GiB (``set_per_process_memory_fraction``),
    so the largest probes run out of memory on rank 1 only — for real, wherever the CUDA allocator
    fails (forward or backward) — while the other ranks wait in FSDP2's collectives. The search must
    end (no hang), every rank must apply the same size, and fit must finish;
  * ``unfreeze`` and ``reference``: BackboneFinetuning unfreezes at epoch 1 and retune re-tunes lower;
    the reference run trains without retune at the same sizes at the same epochs, and the weights
    (each rank's shards) must match within 1e-5;
  * ``oom``: the ``oom`` trigger is refused at setup on every rank.

It also prints each search's time and the snapshot's bytes per rank (the shard, not the whole model).
Needs retune's dependencies: ``pip install -e ".[lightning]"``, or keep the machine's torch and
``pip install "pydantic>=2.6,<3" pyyaml lightning`` with ``PYTHONPATH=.``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TIMEOUT_S = 600
WIDTH = 4096


def _worker(scenario: str, out: Path, sizes: list[int] | None) -> None:
    from torch.distributed.fsdp import fully_shard

    from retune import ScheduledBatchSizeFinder
    from retune.distributed.local_shards import local
    from retune.probing.snapshot import TrainingSnapshot
    from tests.helpers.lightning_ns import callbacks, pl

    class Wide(pl.LightningModule):  # type: ignore[misc,name-defined]
        """Big activations per sample, so that real CUDA OOM comes at a few thousand samples."""

        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 2
            self.backbone = nn.Sequential(nn.Linear(1024, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU())
            self.head = nn.Linear(WIDTH, 10)
            g = torch.Generator().manual_seed(0)
            self.data = TensorDataset(
                torch.randn(65536, 1024, generator=g), torch.randint(0, 10, (65536,), generator=g)
            )

        def setup(self, stage: str) -> None:
            # absolute caps, so the boundaries do not move with the GPU's size: a few thousand samples
            cap = (1.5 if self.global_rank == 1 and scenario == "agree" else 3.0) * 2**30
            device = self.trainer.strategy.root_device
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(cap / total, device)

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.backbone[0], self.backbone[2], self.head):
                fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh, reshard_after_forward=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.backbone(x))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x), y)

        def train_dataloader(self) -> DataLoader:
            size = self.batch_size if sizes is None else sizes[self.trainer.current_epoch]
            return DataLoader(self.data, batch_size=size, shuffle=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    unfreeze = scenario in ("unfreeze", "reference")
    schedule: Any = {"search": {"max_val": 65536}, "triggers": [{"kind": "fit_start"}]}
    if unfreeze:
        schedule = "schedules/freeze_unfreeze.yaml"
    if scenario == "oom":
        schedule = {"triggers": [{"kind": "fit_start"}, {"kind": "oom"}]}
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    cbs: list[Any] = [] if scenario == "reference" else [finder]
    if unfreeze:
        cbs.append(callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1))
    pl.seed_everything(0)
    devices = torch.cuda.device_count()
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=devices,
        strategy=pl.strategies.ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1),
        max_epochs=3 if unfreeze else 1,
        limit_train_batches=3,
        callbacks=cbs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        reload_dataloaders_every_n_epochs=1 if scenario == "reference" else 0,
    )
    model = Wide()
    result: dict[str, Any] = {"scenario": scenario}
    try:
        trainer.fit(model)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    snap_bytes = None
    if trainer.optimizers and "error" not in result:
        snap = TrainingSnapshot.capture(model, optimizers=list(trainer.optimizers))
        snap.restore()
        snap_bytes = snap.nbytes
    result.update(
        rank=trainer.global_rank,
        history=[(e.trigger, e.batch_size_after, e.trials, round(e.duration_s, 2)) for e in finder.history],
        global_step=trainer.global_step,
        snapshot_bytes=snap_bytes,
        whole_param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    torch.save([local(p).detach().cpu() for p in model.parameters()], out / f"shards{trainer.global_rank}.pt")
    print(json.dumps(result))


def _run(scenario: str, out: Path, sizes: str | None = None) -> list[dict[str, Any]]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", scenario, str(out), *([sizes] if sizes else [])]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    try:
        subprocess.run(cmd, env=env, timeout=TIMEOUT_S, check=False, start_new_session=True)
    except subprocess.TimeoutExpired:
        sys.exit(f"[{scenario}] TIMED OUT after {TIMEOUT_S}s: a hang")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if len(ranks) != torch.cuda.device_count():
        sys.exit(f"[{scenario}] only {len(ranks)} ranks wrote a result")
    return ranks


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sizes = [int(s) for s in sys.argv[4].split(",")] if len(sys.argv) > 4 else None
        _worker(sys.argv[2], Path(sys.argv[3]), sizes)
        return
    if torch.cuda.device_count() < 2:
        sys.exit("needs 2+ CUDA GPUs: run this on a multi-GPU machine")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        agree = _run("agree", Path(tmp, "agree"))
        sizes = {json.dumps(r["history"][0][1]) for r in agree if r.get("history")}
        if any("error" in r for r in agree) or len(sizes) != 1:
            failures.append(f"agree: ranks disagree or failed: {agree}")
        print(f"[agree] size {sizes}, search {agree[0]['history'][0][3] if agree[0]['history'] else '-'} s")
        for r in agree:
            print(f"[agree] rank {r['rank']}: snapshot {r['snapshot_bytes']} B of {r['whole_param_bytes']} B params")

        tuned = _run("unfreeze", Path(tmp, "unfreeze"))
        frozen, unfrozen = tuned[0]["history"][0][1], tuned[0]["history"][1][1]
        if not unfrozen < frozen:
            failures.append(f"unfreeze: the re-tune did not lower the size ({frozen} -> {unfrozen})")
        _run("reference", Path(tmp, "reference"), f"{frozen},{unfrozen},{unfrozen}")
        for rank in range(torch.cuda.device_count()):
            a = torch.load(Path(tmp, "unfreeze", f"shards{rank}.pt"))
            b = torch.load(Path(tmp, "reference", f"shards{rank}.pt"))
            diff = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
            print(f"[exact] rank {rank}: max |tuned - reference| = {diff:.2e}")
            if diff > 1e-5:
                failures.append(f"exact: rank {rank} differs by {diff}")

        for r in _run("oom", Path(tmp, "oom")):
            if "`oom` trigger is not supported under ModelParallelStrategy" not in r.get("error", ""):
                failures.append(f"oom: rank {r['rank']} was not refused: {r}")
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))
    print("all FSDP2 checks passed")


if __name__ == "__main__":
    main()
