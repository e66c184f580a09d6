"""One FSDP2 scenario on CPU: ModelParallelStrategy, 2 gloo processes; each rank writes its result as JSON.

Run by tests/distributed/test_fsdp2.py in a subprocess with a timeout, so a hang (a rank waiting in an all-gather
for a rank that ran out of memory) fails the test instead of hanging CI. Lightning's launcher starts
rank 1 by re-running this script. The model is tests/helpers/oracle.py's backbone + head, sharded in
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
  fts        finetuning-scheduler's epoch-driven phases (tests/fts/epoch_driven.yaml, through its
             ModelParallelStrategyAdapter) thaw the sharded model; the schedule is fit_start + fts_phase
  stages     fit, then trainer.test and trainer.predict with `stages: [train, test, predict]`; rank 1
             has less memory for evaluation: the oracle raises torch.OutOfMemoryError in the middle of
             its eval forward (between two sharded layers) above EVAL_CAPACITY[1]
  predict    search.predict auto under a memory budget on the CPU tracker (no oracle): the unsharded fake
             trace of each rank's step and its per-rank account of the shards; BackboneFinetuning unfreezes at
             epoch 1 (AdamW): predicted at fit start and at the re-tune
  predict_off           the same with predict off: the sizes real probes alone find
  predict_bf16          predict with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on the Linear
             groups (the root's BatchNorm stays float32, as its running statistics), everything trainable, searched
             at fit start and at epoch 1: forward and backward traced with those groups in bfloat16, the update
             apart
  predict_reference     no retune; the epochs run at the sizes given in argv[3]: the predict run's exactness baseline
  clip       gradient_clip_val=1.0 (clip_grad_norm_ over DTensor gradients: a DTensor all-reduce of the
             norm); rank 1's oracle raises torch.OutOfMemoryError in on_before_optimizer_step, after
             backward and just before the clip's all-reduce
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
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader

from retune import ScheduledBatchSizeFinder
from retune.distributed.fsdp2 import compute_dtypes, fsdp_modules
from retune.distributed.local_shards import local
from retune.probing.snapshot import TrainingSnapshot
from tests.helpers.dist_utils import leave_rank
from tests.helpers.lightning_ns import callbacks, pl
from tests.helpers.oom_oracle import FailInBackward
from tests.helpers.oracle import FineTuneModel, MemoryOracle, make_data

RANK1_CAPACITY = 1_500_000
UNLIMITED = MemoryOracle(capacity=10**12)
EVAL_CAPACITY = {0: 400, 1: 300}  # the largest evaluation batch each rank fits ("stages")
EVAL_SAMPLES = 2048  # the test and predict dataset: 1024 samples per rank, more than either rank fits
FTS_SCHEDULE = Path(__file__).resolve().parents[1] / "fts" / "epoch_driven.yaml"


def _strategy() -> Any:
    return pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


class ShardedModel(FineTuneModel):
    """FineTuneModel sharded with FSDP2; the memory oracle is checked where ``where`` says."""

    def __init__(self, scenario: str, sizes: list[int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario
        self.sizes = sizes
        self.val_batch_size = 64
        self.where = {"forward": "forward", "backward": "backward", "error": "error", "clip": "clip"}.get(
            scenario, "start"
        )
        self.rank_oracle = UNLIMITED
        self.eval_capacity: int | None = None
        self.eval_data = make_data(EVAL_SAMPLES, seed=1)
        self.test_batch_size = self.predict_batch_size = 8
        self.eval_seen: dict[str, list[int]] = {"test": [], "predict": []}
        self.epoch_trainable: list[int] = []
        self.grad_types: set[str] = set()
        self._step_batch = 0

    def setup(self, stage: str) -> None:
        if self.global_rank == 1 and self.scenario in ("forward", "backward", "clip"):
            self.rank_oracle = MemoryOracle(capacity=RANK1_CAPACITY)
        if self.scenario == "stages":
            self.eval_capacity = EVAL_CAPACITY[self.global_rank]

    def configure_model(self) -> None:
        if fsdp_modules(self):  # Lightning calls it again for test and predict: shard once
            return
        mesh = self.device_mesh["data_parallel"]
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.scenario == "predict_bf16"
            else MixedPrecisionPolicy()
        )
        for layer in (self.backbone[0], self.backbone[3], self.head):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        # the root group holds what is left (the BatchNorm). Resharded after forward: a validation forward
        # would otherwise leave its parameters unsharded, and BackboneFinetuning compares them with the
        # optimizer's sharded ones (torch.equal of a tensor and a DTensor fails), with or without retune
        fully_shard(self, mesh=mesh, reshard_after_forward=True)  # the BatchNorm stays float32, as its buffers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        h = self.backbone[:3](x)  # the first sharded Linear, BatchNorm, ReLU
        if self.where == "forward":
            self.rank_oracle.check(batch, self)  # rank 0 is now waiting for the next all-gather
        if self.eval_capacity is not None and not self.training and batch > self.eval_capacity:
            rank, capacity = self.global_rank, self.eval_capacity
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle, rank {rank} eval forward: {batch} > {capacity})")
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
        self._step_batch = x.shape[0]
        if self.where == "start":
            self.oracle.check(x.shape[0], self)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Backward is over (gradients reduce-scattered); Lightning clips next, with a DTensor all-reduce."""
        self.grad_types.update(type(p.grad).__name__ for p in self.parameters() if p.grad is not None)
        if self.where == "clip":
            self.rank_oracle.check(self._step_batch, self)

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self.epoch_trainable.append(sum(p.numel() for p in self.parameters() if p.requires_grad))

    def test_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):  # type: ignore[no-untyped-def]
        return self(batch[0]).argmax(1)

    def on_test_batch_start(self, batch, batch_idx, dataloader_idx=0):  # type: ignore[no-untyped-def]
        self.eval_seen["test"].append(int(batch[0].shape[0]))

    def on_predict_batch_start(self, batch, batch_idx, dataloader_idx=0):  # type: ignore[no-untyped-def]
        self.eval_seen["predict"].append(int(batch[0].shape[0]))

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.eval_data, batch_size=self.test_batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.eval_data, batch_size=self.predict_batch_size)

    def train_dataloader(self) -> DataLoader:
        size = self.batch_size if self.sizes is None else self.sizes[self.trainer.current_epoch]
        return DataLoader(self.dataset, batch_size=size, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.val_batch_size)


PREDICT_BUDGET = "160KiB"


def schedule_for(scenario: str) -> Any:
    if scenario in ("predict", "predict_off", "predict_bf16"):
        again = {"kind": "epoch", "at": [1]} if scenario == "predict_bf16" else {"kind": "trainable_params_changed"}
        return {
            "search": {"predict": "off" if scenario == "predict_off" else "auto", "max_val": 512},
            "memory": {"budget": PREDICT_BUDGET},
            "triggers": [{"kind": "fit_start"}, again],
        }
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
    if scenario == "fts":
        # one probe step per trial: the oracle's verdict does not depend on the number of steps
        search: dict[str, Any] = {"steps_per_trial": 1, "max_val": 4096}
        return {"search": search, "triggers": [{"kind": "fit_start"}, {"kind": "fts_phase"}]}
    if scenario == "stages":
        search = {"steps_per_trial": 1, "margin": 0.0, "max_val": 4096}
        return {"search": search, "stages": ["train", "test", "predict"], "triggers": [{"kind": "fit_start"}]}
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
    predicting = scenario.startswith("predict")
    reference = scenario in ("reference", "predict_reference")
    # no unfreeze under mixed precision: torch 2.13's FSDP2 fails the first step after requires_grad flips there
    # (foreach_reduce assigns a bfloat16 gradient to a float32 parameter), with retune or without it
    unfreeze = scenario in ("unfreeze", "reference", "features") or (predicting and scenario != "predict_bf16")
    model = ShardedModel(
        scenario,
        sizes=sizes,
        batch_size=8,
        # fts: 2048 samples per rank, more than the frozen phase fits, so every phase's maximum is the oracle's
        n=4096 if scenario == "fts" else 512,
        head_only_optimizer=unfreeze,
        optimizer="adamw" if scenario in ("unfreeze", "reference") or predicting else "sgd",
        oracle=UNLIMITED if scenario == "features" or predicting else MemoryOracle(),
    )
    finder = ScheduledBatchSizeFinder(schedule_for(scenario), verbose=False, out_dir=out / "report")
    cbs: list[Any] = [] if reference else [finder]
    if unfreeze:
        cbs.append(callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1))
    fts = None
    if scenario == "fts":
        from finetuning_scheduler import FinetuningScheduler, FTSCheckpoint

        fts = FinetuningScheduler(ft_schedule=str(FTS_SCHEDULE), epoch_transitions_only=True, restore_best=False)
        cbs += [fts, FTSCheckpoint(monitor="val_loss", save_top_k=1)]  # FTS wants one, restore_best or not
    trainer = pl.Trainer(
        strategy=_strategy(),
        accelerator="cpu",
        devices=2,
        max_epochs={"fts": 5, "stages": 1}.get(scenario, 3 if unfreeze else 2),
        callbacks=cbs,
        logger=pl.loggers.CSVLogger(str(out), name="logs") if scenario == "features" else False,
        enable_checkpointing=scenario == "fts",
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_train_batches=4,
        limit_val_batches=2 if scenario == "features" else 0,
        reload_dataloaders_every_n_epochs=1 if reference else 0,
        gradient_clip_val=1.0 if scenario == "clip" else None,
        default_root_dir=str(out),
    )
    result: dict[str, Any] = {}
    try:
        trainer.fit(model)
        if scenario == "stages":
            result["test_results"] = trainer.test(model, verbose=False)
            result["predictions"] = sum(len(batch) for batch in trainer.predict(model) or [])
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
        computed_in=sorted({str(dtype) for dtype in compute_dtypes(model).values()}),
        report=finder.report_paths is not None,
        epoch_trainable=model.epoch_trainable,
        fts_depth=None if fts is None else fts.curr_depth,
        fts_global_steps=None if fts is None else fts._fts_state._ft_global_steps,
        eval_seen=model.eval_seen,
        eval_capacity=model.eval_capacity,
        grad_types=sorted(model.grad_types),
        gradient_clip_val=trainer.gradient_clip_val,
        **_snapshot_cost(model, trainer),
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
