"""One FSDP2 scenario on CPU: ModelParallelStrategy, 2 gloo processes; each rank writes its result as JSON.

Run by tests/test_fsdp2.py in a subprocess with a timeout, so a hang (a rank waiting in an all-gather
for a rank that ran out of memory) fails the test instead of hanging CI. Lightning's launcher starts
rank 1 by re-running this script. The model is tests/oracle.py's backbone + head, sharded in
``configure_model`` with ``fully_shard`` (each Linear, then the root).

Scenarios (argv[1]):
  forward    rank 1 has less memory: the oracle raises the real torch.OutOfMemoryError in the middle
             of its forward (between two sharded layers), rank 0 fits every size
  backward   the same, raised in rank 1's backward after the head's gradient was reduce-scattered
  unfreeze   BackboneFinetuning unfreezes at epoch 1, AdamW (sharded optimizer state): re-tune lowers
  reference  no retune; the epochs run at the sizes given in argv[3] ("8,8,4"): the exactness baseline
  features   model mode with a memory budget, probe_samples largest, val stage, BackboneFinetuning
             with param_groups_changed, an epoch milestone,
             keep_effective + linear lr scaling, a CSV logger (the report)
  error      rank 1 raises a ValueError in the middle of a probe's forward: every rank ends with an error
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from retune import ScheduledBatchSizeFinder
from retune.local_shards import local
from retune.snapshot import TrainingSnapshot
from tests.lightning_ns import callbacks, pl
from tests.oom_oracle import FailInBackward
from tests.oracle import FineTuneModel, MemoryOracle

RANK1_CAPACITY = 1_500_000
UNLIMITED = MemoryOracle(capacity=10**12)


def _strategy() -> Any:
    return pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


class ShardedModel(FineTuneModel):
    """FineTuneModel sharded with FSDP2; the memory oracle is checked where ``where`` says."""

    def __init__(self, scenario: str, sizes: list[int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario
        self.sizes = sizes
        self.val_batch_size = 64
        self.where = {"forward": "forward", "backward": "backward", "error": "error"}.get(scenario, "start")
        self.rank_oracle = UNLIMITED

    def setup(self, stage: str) -> None:
        if self.global_rank == 1 and self.scenario in ("forward", "backward"):
            self.rank_oracle = MemoryOracle(capacity=RANK1_CAPACITY)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.backbone[0], self.backbone[3], self.head):
            fully_shard(layer, mesh=mesh)
        # the root group holds what is left (the BatchNorm). Resharded after forward: a validation forward
        # would otherwise leave its parameters unsharded, and BackboneFinetuning compares them with the
        # optimizer's sharded ones (torch.equal of a tensor and a DTensor fails), with or without retune
        fully_shard(self, mesh=mesh, reshard_after_forward=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        h = self.backbone[:3](x)  # the first sharded Linear, BatchNorm, ReLU
        if self.where == "forward":
            self.rank_oracle.check(batch, self)  # rank 0 is now waiting for the next all-gather
        if self.where == "error" and self.global_rank == 1 and batch >= 64:
            raise ValueError("boom on rank 1")
        h = self.backbone[3:](h)
        if self.where == "backward":
            exceeds = self._exceeds(batch)
            h = FailInBackward.apply(h, exceeds, "oracle, rank 1 backward")
        return self.head(h)

    def _exceeds(self, batch: int) -> bool:
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.parameters())
        return self.rank_oracle.cost(batch, trainable, total) > self.rank_oracle.capacity

    def rank_true_max(self) -> int:
        """The largest batch this rank's oracle lets through (the sharded oracle of forward/backward)."""
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        return self.rank_oracle.true_max(trainable, sum(p.numel() for p in self.parameters()))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        if self.where == "start":
            self.oracle.check(x.shape[0], self)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def train_dataloader(self) -> DataLoader:
        size = self.batch_size if self.sizes is None else self.sizes[self.trainer.current_epoch]
        return DataLoader(self.dataset, batch_size=size, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.val_batch_size)


def schedule_for(scenario: str) -> Any:
    if scenario in ("unfreeze", "reference"):
        return "schedules/freeze_unfreeze.yaml"
    if scenario == "features":
        return {
            "search": {"mode": "model", "probe_samples": "largest", "max_val": 512},
            "memory": {"budget": "200KiB"},
            "apply": {"accumulate": "keep_effective", "lr_scaling": "linear"},
            "stages": ["train", "val"],
            "triggers": [{"kind": "fit_start"}, {"kind": "param_groups_changed"}, {"kind": "epoch", "at": [2]}],
        }
    return {"search": {"max_val": 512}, "triggers": [{"kind": "fit_start"}]}


def _snapshot_cost(model: Any, trainer: Any) -> dict[str, int]:
    """What a snapshot of the trained state copies on this rank, next to the whole state's size."""
    if not trainer.optimizers:
        return {}
    snap = TrainingSnapshot.capture(model, optimizers=list(trainer.optimizers))
    snap.restore()
    trainable = [p for p in model.parameters() if p.requires_grad]
    whole = sum(p.numel() * p.element_size() for p in trainable)  # a DTensor's numel() is the whole tensor's
    whole += sum(
        v.numel() * v.element_size()
        for opt in trainer.optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return {"snapshot_bytes": snap.nbytes, "whole_state_bytes": whole, "buffer_bytes": buffers}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    sizes = [int(s) for s in sys.argv[3].split(",")] if len(sys.argv) > 3 else None
    torch.set_num_threads(1)
    pl.seed_everything(0)
    unfreeze = scenario in ("unfreeze", "reference", "features")
    model = ShardedModel(
        scenario,
        sizes=sizes,
        batch_size=8,
        n=512,
        head_only_optimizer=unfreeze,
        optimizer="adamw" if scenario in ("unfreeze", "reference") else "sgd",
        oracle=MemoryOracle() if scenario != "features" else UNLIMITED,
    )
    finder = ScheduledBatchSizeFinder(schedule_for(scenario), verbose=False, out_dir=out / "report")
    cbs: list[Any] = [] if scenario == "reference" else [finder]
    if unfreeze:
        cbs.append(callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1))
    trainer = pl.Trainer(
        strategy=_strategy(),
        accelerator="cpu",
        devices=2,
        max_epochs=3 if unfreeze else 2,
        callbacks=cbs,
        logger=pl.loggers.CSVLogger(str(out), name="logs") if scenario == "features" else False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_train_batches=4,
        limit_val_batches=2 if scenario == "features" else 0,
        reload_dataloaders_every_n_epochs=1 if scenario == "reference" else 0,
    )
    result: dict[str, Any] = {}
    try:
        trainer.fit(model)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
    result.update(
        rank=trainer.global_rank,
        global_step=trainer.global_step,
        batch_size=finder.batch_size,
        batch_sizes=finder.batch_sizes,
        model_batch_size=model.batch_size,
        history=[event.to_dict() for event in finder.history],
        epoch_true_max=model.epoch_true_max,
        rank_true_max=model.rank_true_max(),
        batch_sizes_seen=model.train_batch_sizes,
        accumulate=trainer.accumulate_grad_batches,
        lr=[g["lr"] for opt in trainer.optimizers for g in opt.param_groups],
        # this rank's shards: compared with the same rank of another run, no collective needed
        shards=[local(p).detach().reshape(-1).tolist() for p in model.parameters()],
        sharded=[type(p).__name__ for p in model.parameters()],
        report=finder.report_paths is not None,
        **_snapshot_cost(model, trainer),
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
